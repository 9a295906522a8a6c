"""The mesh: identity, trust, discovery and signed capacity gossip (DESIGN §5)."""
