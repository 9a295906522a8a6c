"""The mesh: identity, trust, discovery and signed capacity gossip (docs/mesh.md).

Public surface (what the agent uses):

- :class:`viiwork.mesh.node.MeshNode` and :class:`~viiwork.mesh.node.MeshSettings`: start,
  stop, publish local capacity, ``view()`` (the ``/v1/mesh`` document), ``peers()``
  (for routing), ``counters()``, the mutual-TLS contexts, and the listener app for
  forwarded requests (:func:`viiwork.mesh.transport.peer_of` names the calling node).
- :class:`viiwork.mesh.summary.ModelCapacity` and
  :class:`~viiwork.mesh.summary.PublishedState`: what a node publishes.

Inside, one module per concern: ``identity`` (node key, node id), ``boot`` (generations),
``trust`` (X.509 CA, enrolment, verification), ``pins`` (open-mode name pins), ``tls``
(SSL contexts), ``signing`` (the crypto seams), ``summary`` and ``messages`` (wire formats),
``membership`` (the pure protocol core), ``publisher`` (this node's summaries),
``ratelimit``, ``counters``, ``sim`` (the simulator), ``transport`` (aiohttp listener and
client), ``discovery`` (mDNS, seeds), ``node`` (the wiring). The core never imports
asyncio; nothing here imports the agent or the engines.
"""
