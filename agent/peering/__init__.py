"""Peering: the agent's side of the mesh (capacity published, routing over peers, forwards) and slot offers."""
