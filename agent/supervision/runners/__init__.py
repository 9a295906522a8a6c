"""Backend runners: process (asyncio subprocess) and systemd (transient units)."""
