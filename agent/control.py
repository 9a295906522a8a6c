"""Control commands of the admin socket, defined once for the daemon and for viiworkctl.

Each ``ControlCommand``'s ``help`` is both the CLI help text and the API's documentation.
The admin API listens on a Unix socket (``api.admin_socket``; mode 0660, group
``viiwork-admin`` where that group exists): file permissions are the access control, and
nothing that changes the agent is reachable over TCP (docs/configuration.md, [api]).
"""

from __future__ import annotations

from dataclasses import dataclass

from viiwork.agent.auth.revocations import MAX_LIST_BYTES


@dataclass(frozen=True, slots=True)
class ControlCommand:
    """One control command: CLI name, help, HTTP method and path on the admin socket.

    ``takes_model``: the path names a model. ``body_max_bytes``: > 0 when the request's body is
    the command's argument (read up to this bound). ``takes_query``: the query string's
    parameters are its arguments. ``parent``: the viiworkctl command that offers it (None: a
    command of its own, registered by agent/cli/control.py).
    """

    name: str
    help: str
    method: str
    path: str
    takes_model: bool = False
    body_max_bytes: int = 0
    takes_query: bool = False
    parent: str | None = None

    @property
    def action(self) -> str:
        """Its field in ``viiwork.agent.admin.AdminActions``."""
        return self.name.replace("-", "_")

    def url_path(self, model: str | None = None) -> str:
        if self.takes_model:
            from urllib.parse import quote

            return self.path.format(model=quote(model or "", safe=""))
        return self.path


COMMANDS: tuple[ControlCommand, ...] = (
    ControlCommand("reload", "re-read the config file and restart only the models whose entries changed "
                   "(the agent also reloads on SIGHUP)", "POST", "/reload"),
    ControlCommand("drain", "stop admitting new requests on this node, for maintenance; requests in "
                   "flight finish (undo with undrain)", "POST", "/drain"),
    ControlCommand("undrain", "admit requests again after drain", "POST", "/undrain"),
    ControlCommand("down", "park MODEL: drain it, stop its backends and keep it out of routing "
                   "(undo with up)", "POST", "/models/{model}/down", takes_model=True),
    ControlCommand("up", "start MODEL again after down; also revives a model whose backends went dead",
                   "POST", "/models/{model}/up", takes_model=True),
    ControlCommand("models", "configured models with their state and backends", "GET", "/models"),
    ControlCommand("push-revocations", "take the signed revocation list in the body, then push it to every live "
                   "peer over mutual TLS", "POST", "/revocations", body_max_bytes=MAX_LIST_BYTES, parent="keys"),
    ControlCommand("usage", "summarise the usage ledgers of this node and of every live peer (over mutual "
                   "TLS), each node's own rows once", "GET", "/usage", takes_query=True, parent="usage"),
)

BY_NAME = {c.name: c for c in COMMANDS}
