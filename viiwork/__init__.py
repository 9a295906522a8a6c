"""viiwork: a systemd-native host agent for fleets of GPU inference machines.

The import packages are ``viiwork.agent``, ``viiwork.mesh`` and ``viiwork.engines``,
mapped from the repository's top-level ``agent/``, ``mesh/`` and ``engines/`` folders.
"""

__version__ = "0.1.0"
