"""The usage ledger: one SQLite row per finished request on the node that served it.

``store`` holds the file's schema and its SQL (blocking calls, for one thread); ``ledger``
the agent-facing :class:`~viiwork.agent.usage.ledger.Ledger` (a writer thread with group
commit, a bounded backlog when the disk refuses, retention); ``query`` the summaries that
``viiworkctl usage`` prints. docs/usage.md.
"""
