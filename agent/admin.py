"""The admin API on a Unix socket: reload, drain/undrain, model down/up, models, push-revocations,
usage (docs/configuration.md, [api]).

Commands are listed once in ``viiwork.agent.control``; ``AdminApi`` maps each to an
``AdminActions`` implementation supplied by the daemon. Answers are JSON:
``{"ok": true, ...}`` or an OpenAI-shaped error with 400/404/409/500.
"""

from __future__ import annotations

import asyncio
import contextlib
import grp
import logging
import os
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web

from viiwork.agent.auth.errors import RevocationReason, RevocationRefused
from viiwork.agent.config.schema import Config
from viiwork.agent.control import COMMANDS, ControlCommand
from viiwork.agent.serving.api import ClientApi
from viiwork.agent.serving.body import BodyError, read_body
from viiwork.agent.serving.errors import ErrorCode, error_response
from viiwork.agent.supervision.supervisor import Supervisor

log = logging.getLogger(__name__)

ADMIN_GROUP = "viiwork-admin"


class ActionError(Exception):
    """A control command cannot be done; ``status`` is the HTTP status to answer, ``code``
    the error's code (agent/serving/errors.py)."""

    def __init__(self, status: int, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code


async def _no_revocation_sync(_body: bytes) -> dict[str, Any]:
    raise ActionError(409, "this agent takes no revocation list: client keys are off, or its issuer key is missing "
                      "([auth] mode = \"keys\", auth.issuer_keys; docs/security.md, \"Client keys\")")


async def _no_mesh_usage(_query: Mapping[str, str]) -> dict[str, Any]:
    raise ActionError(409, "this agent gathers no mesh usage: it has no [mesh] (read its own ledger with "
                      "viiworkctl usage, without --mesh)")


@dataclass
class AdminActions:
    """What the daemon does for each command; each returns a JSON-able dict.

    ``push_revocations`` gets the request body (a signed list); ``usage`` the query's parameters.
    """

    reload: Callable[[], Awaitable[dict[str, Any]]]
    drain: Callable[[], Awaitable[dict[str, Any]]]
    undrain: Callable[[], Awaitable[dict[str, Any]]]
    down: Callable[[str], Awaitable[dict[str, Any]]]
    up: Callable[[str], Awaitable[dict[str, Any]]]
    models: Callable[[], Awaitable[dict[str, Any]]]
    push_revocations: Callable[[bytes], Awaitable[dict[str, Any]]] = _no_revocation_sync
    usage: Callable[[Mapping[str, str]], Awaitable[dict[str, Any]]] = _no_mesh_usage


# Bounds request.read()/post(), which no command uses; a command that takes a body reads it
# with its own bound (ControlCommand.body_max_bytes, agent/serving/body.py).
ADMIN_MAX_BODY_BYTES = 64 * 1024


def build_admin_app(actions: AdminActions) -> web.Application:
    """The admin application: one route per command; any other method on a command's path
    is a JSON 405 ``method_not_allowed`` (with ``Allow``), any other path a JSON 404
    ``not_found`` (docs/routing.md, "Status codes"), like the client API."""
    app = web.Application(client_max_size=ADMIN_MAX_BODY_BYTES)
    for command in COMMANDS:
        resource = app.router.add_resource(command.path)
        resource.add_route(command.method, _handler(command, actions))
        resource.add_route("*", _method_not_allowed(command.method))
    app.router.add_route("*", "/{tail:.*}", _not_found)
    return app


def _method_not_allowed(allowed: str) -> Callable[[web.Request], Awaitable[web.Response]]:
    async def handle(request: web.Request) -> web.Response:
        return error_response(405, f"{request.method} is not allowed on {request.path}; use {allowed}",
                              code=ErrorCode.METHOD_NOT_ALLOWED, headers={"Allow": allowed})
    return handle


async def _not_found(request: web.Request) -> web.Response:
    known = ", ".join(f"{c.method} {c.path}" for c in COMMANDS)
    return error_response(404, f"no such admin command: {request.method} {request.path}; known: {known}",
                          code=ErrorCode.NOT_FOUND)


def _handler(command: ControlCommand, actions: AdminActions) -> Callable[[web.Request], Awaitable[web.Response]]:
    action = getattr(actions, command.action)
    name = command.name

    async def handle(request: web.Request) -> web.Response:
        try:
            if command.takes_model:
                result = await action(request.match_info["model"])
            elif command.body_max_bytes:
                try:
                    body = await read_body(request, command.body_max_bytes, f"{name}'s body")
                except BodyError as exc:
                    return error_response(exc.status, str(exc), code=exc.code)
                result = await action(body)
            elif command.takes_query:
                result = await action(dict(request.query))
            else:
                result = await action()
        except ActionError as exc:
            return error_response(exc.status, str(exc), code=exc.code)
        except Exception as exc:  # the admin socket must answer, and the agent keep running
            log.exception("admin command %s failed", name)
            return error_response(500, f"{name} failed: {exc}", code=ErrorCode.INTERNAL_ERROR)
        log.info("admin command %s done", name)
        return web.json_response({"ok": True, "command": name, **result})

    return handle


class AdminSocketInUse(OSError):
    """The admin socket path is taken: a live agent answers on it, or it is not a socket."""


#: How long a connect to an existing admin socket may take before it counts as answered
#: (a live agent whose backlog is full: never taken over).
STALE_PROBE_TIMEOUT_S = 1.0


async def _remove_if_stale(path: Path) -> None:
    """Remove ``path`` when it is a socket that nothing listens on (connect: ECONNREFUSED);
    raise AdminSocketInUse when something answers, or when it is not a socket."""
    if not path.is_socket():
        raise AdminSocketInUse(f"{path} exists and is not a socket: move it away, or set api.admin_socket elsewhere")
    try:
        async with asyncio.timeout(STALE_PROBE_TIMEOUT_S):
            _, writer = await asyncio.open_unix_connection(str(path))
    except ConnectionRefusedError:
        log.info("removing stale admin socket %s: nothing listens on it", path)
        path.unlink(missing_ok=True)
        return
    except FileNotFoundError:
        return
    except TimeoutError:
        raise AdminSocketInUse(f"{path} is held by a process that accepts no connection within "
                               f"{STALE_PROBE_TIMEOUT_S:g} s (a busy agent, its backlog full): it is not taken over; stop that "
                               "agent, or give this one its own api.admin_socket") from None
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    raise AdminSocketInUse(f"another agent answers on {path}: it is not taken over; stop that agent, or give "
                           "this one its own api.admin_socket")


async def start_admin_site(runner: web.AppRunner, path: Path) -> web.UnixSite:
    """Bind the admin socket at ``path``, mode 0660, group viiwork-admin.

    An existing socket is removed only when stale (nothing answers a connect); a live one
    (another agent's) or a non-socket file is AdminSocketInUse: docs/security.md, "Local users".
    """
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o750)
    if path.exists() or path.is_symlink():
        await _remove_if_stale(path)
    site = web.UnixSite(runner, str(path))
    await site.start()
    os.chmod(path, 0o660)
    try:
        gid = grp.getgrnam(ADMIN_GROUP).gr_gid
    except KeyError:
        gid = None
    if gid is not None:
        try:
            os.chown(path, -1, gid)
        except PermissionError as exc:
            log.warning("cannot give %s to group %s: %s", path, ADMIN_GROUP, exc)
    return site


def revocation_action(push: Callable[[str], Awaitable[dict[str, Any]]]) -> Callable[[bytes], Awaitable[dict[str, Any]]]:
    """The push-revocations action over ``push`` (a signed list -> the outcome, raising
    RevocationRefused): a body that is not ASCII is a 400, a list refused a 409 (``stale``: an
    older list than the one held) or a 400 (forged or malformed), the reason in the message."""
    async def push_revocations(body: bytes) -> dict[str, Any]:
        try:
            token = body.decode("ascii")
        except UnicodeDecodeError:
            raise ActionError(400, "the body is not a signed revocation list (not ASCII)") from None
        try:
            result = await push(token)
        except RevocationRefused as exc:
            status = 409 if exc.reason is RevocationReason.STALE else 400
            raise ActionError(status, f"revocation list refused: {exc}", exc.reason.value) from None
        taken = "taken" if result.get("taken") else "already held"
        return {"message": f"revocation list version {result.get('version')} {taken}; pushed to "
                           f"{len(result.get('peers') or {})} peer(s)", **result}
    return push_revocations


def usage_action(gather: Callable[[Mapping[str, str]], Awaitable[dict[str, Any]]],
                 ) -> Callable[[Mapping[str, str]], Awaitable[dict[str, Any]]]:
    """The usage action over ``gather``: a query it refuses (ValueError: a bad ``since_ms`` or
    ``by``) is a 400."""
    async def usage(query: Mapping[str, str]) -> dict[str, Any]:
        try:
            return await gather(query)
        except ValueError as exc:
            raise ActionError(400, str(exc)) from None
    return usage


def node_actions(*, supervisor: Supervisor, api: ClientApi, config_path: Path | None,
                 on_reloaded: Callable[[Config], None] | None = None,
                 push_revocations: Callable[[str], Awaitable[dict[str, Any]]] | None = None,
                 usage: Callable[[Mapping[str, str]], Awaitable[dict[str, Any]]] | None = None) -> AdminActions:
    """The daemon's actions over its ``Supervisor`` and ``ClientApi``.

    config_path: the file ``reload`` re-reads (None for the embedded demo config, which
    cannot be reloaded). on_reloaded: called with the new Config after a reload.
    push_revocations: takes a signed list and pushes it to the peers (``revocation_action``);
    None when client keys are off. usage: the mesh's usage for a query (None without a mesh).
    """
    from viiwork.agent.config.load import ConfigError, load_config
    from viiwork.agent.supervision.supervisor import UnknownModel

    async def reload() -> dict[str, Any]:
        if config_path is None:
            raise ActionError(409, "this agent runs the embedded demo config, which has no file to re-read",
                              ErrorCode.NOT_RELOADABLE)
        try:
            new = load_config(config_path)
        except ConfigError as exc:
            raise ActionError(400, f"config not reloaded, the running one stays:\n{exc}",
                              ErrorCode.INVALID_CONFIG) from None
        old = supervisor.config
        restart_needed = [s for s in ("node", "api", "mesh", "routing", "supervisor")
                          if getattr(old, s) != getattr(new, s)]
        result = await supervisor.reload(new)
        api.sync_models()
        if on_reloaded is not None:
            on_reloaded(new)
        if restart_needed:
            log.warning("reload: changes to %s take effect at the next agent restart", ", ".join(restart_needed))
        return {**result, "restart_needed": restart_needed}

    async def drain() -> dict[str, Any]:
        # New requests and forwards get 503, /health 503; the mesh publishes `draining` from
        # the next gossip round, so peers send no new forward here (docs/routing.md).
        api.draining = True
        in_flight = len(api.in_flight)
        return {"message": f"draining: new requests get 503; the {in_flight} request(s) in flight finish "
                           "(undo: viiworkctl undrain)", "in_flight": in_flight}

    async def undrain() -> dict[str, Any]:
        if getattr(api, "stopping", False):
            raise ActionError(409, "the agent is stopping: it admits no new request until it has restarted")
        api.draining = False
        return {"message": "admitting requests again"}

    async def known_model(change: Awaitable[None]) -> None:
        """Await the supervisor's ``down``/``up`` of a model; an unknown model is a 404."""
        try:
            await change
        except UnknownModel as exc:
            raise ActionError(404, str(exc), ErrorCode.MODEL_NOT_FOUND) from None

    async def down(model: str) -> dict[str, Any]:
        await known_model(supervisor.down(model))
        return {"message": f"model {model!r} is down: backends stopped, out of routing (undo: viiworkctl up {model})"}

    async def up(model: str) -> dict[str, Any]:
        await known_model(supervisor.up(model))
        return {"message": f"model {model!r} is starting"}

    async def models() -> dict[str, Any]:
        return {"models": supervisor.status()}

    return AdminActions(reload=reload, drain=drain, undrain=undrain, down=down, up=up, models=models,
                        push_revocations=_no_revocation_sync if push_revocations is None
                        else revocation_action(push_revocations),
                        usage=_no_mesh_usage if usage is None else usage_action(usage))
