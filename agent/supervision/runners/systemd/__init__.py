"""The systemd runner: each backend is a transient systemd service, driven over D-Bus (docs/architecture.md, "A backend's life").

Modules, each imported by its own name (this package re-exports nothing):

- ``bus``: D-Bus names of systemd's objects and interfaces, the bus address, connecting,
  one method call, a property, and whether systemd answers on a bus (``detect_runner``).
- ``units``: unit names and object paths, labels in a unit's environment, systemd's exit
  statuses, the properties of a transient engine unit with its sandbox profiles, and the
  engine user's GPU device groups.
- ``handle``: ``SystemdHandle``, one engine unit: its state from signals, its exit, stopping it.
- ``runner``: ``SystemdRunner`` (start, adopt, signal routing, following a re-executed
  systemd) and ``create_runner`` for ``supervisor.runner``; its docstring gives the behaviour
  and the limits.
"""
