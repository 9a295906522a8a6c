"""Gangs: one model served by engine parts on several hosts (docs/architecture.md)."""
