"""The agent's configuration: its schema and loader, the embedded demo config, TOML line lookup."""
