"""The agent daemon: config, supervisor, routing, API and CLI (DESIGN §2)."""
