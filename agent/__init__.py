"""The agent daemon: config, supervisor, routing, API and CLI (docs/architecture.md)."""
