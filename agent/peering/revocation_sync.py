"""The revocation list across the mesh (issue 17; docs/security.md, "Revocation across the mesh").

A node that takes a newer list from its operator (``viiworkctl keys push-revocations``, through
the admin socket: :meth:`RevocationSync.push_from_operator`) pushes it at once to every peer it
does not hold dead or gone, over the mesh's mutual TLS (``POST /mesh/v1/revocations``, the
signed list as the body). Every node publishes the version it holds in its capacity summary
(the ``revocations`` extension), so a node that missed a push (offline, joining later, a push
that failed) sees a peer with a higher version and fetches the list from it
(``GET /mesh/v1/revocations``). A list from a peer goes through the same checks as one from
the operator (``AuthGate.offer_revocations``: signature, issuer, audience, newer than the one
held); a forged or older one is dropped and counted by reason, and nothing a peer sends
raises out of this module.

Bounds: a list is at most ``MAX_LIST_BYTES`` both ways; one fetch in flight at a time, from
the peer publishing the highest version; a fetch that does not bring this node up to the
version the peer published (a peer that lies about its version, or cannot be reached) backs
that peer off, from ``REFETCH_MIN_S`` doubling to ``REFETCH_MAX_S``, so a lying peer costs at
most one bounded fetch per ``REFETCH_MAX_S``. The back-off decisions are :class:`Refetches`,
a pure class on an injected clock; the rest is the I/O shell.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client.core import CounterMetricFamily

from viiwork.agent.auth.errors import RevocationReason, RevocationRefused
from viiwork.agent.auth.gate import AuthGate
from viiwork.agent.auth.revocations import MAX_LIST_BYTES, RevocationList
from viiwork.agent.peering.mesh_link import MeshLink, PeerTarget, read_bounded
from viiwork.agent.serving.body import BodyError, read_body
from viiwork.agent.serving.errors import ErrorCode, error_response
from viiwork.mesh.dialing import expect_node
from viiwork.mesh.extensions import REVOCATIONS, Revocations
from viiwork.mesh.identity import NodeId
from viiwork.mesh.membership import Liveness, PeerView
from viiwork.mesh.transport import peer_of

log = logging.getLogger(__name__)

REVOCATIONS_PATH = "/mesh/v1/revocations"
CONTENT_TYPE = "application/jwt"  # RFC 7519 section 10.3.1: the body is the signed list itself
#: A push or a fetch ends after this long (a list at the cap is 4 MiB: well under a second on a LAN).
PUSH_TIMEOUT_S = 5.0
FETCH_TIMEOUT_S = 5.0
#: A peer whose fetch did not bring this node up to the version it published waits this long
#: before the next fetch from it, doubling each time up to REFETCH_MAX_S (reset by a good fetch).
REFETCH_MIN_S = 2.0
REFETCH_MAX_S = 60.0
#: How often the peers' published versions are compared with the one held, besides each new summary.
CHECK_INTERVAL_S = 1.0
#: Peers a push goes to: every one not held dead, gone or in conflict.
PUSH_LIVENESS = frozenset({Liveness.ALIVE, Liveness.SUSPECT})


def published_version(view: PeerView) -> int:
    """The revocation list version a peer publishes (0: none, or a value not understood)."""
    value = view.extensions.get(REVOCATIONS)
    return 0 if value is None else value.version


@dataclass
class _Backoff:
    delay_s: float = 0.0
    not_before: float = 0.0


class Refetches:
    """Which peer to fetch a newer list from, and when (module doc: one fetch at a time, each
    peer backed off after a fetch that did not catch up). ``clock``: monotonic seconds.
    ``rng`` breaks ties between peers publishing the same version."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, rng: random.Random | None = None) -> None:
        self.clock = clock
        self.rng = rng or random.Random()
        self.in_flight: NodeId | None = None
        self._backoff: dict[NodeId, _Backoff] = {}

    def pick(self, published: Iterable[tuple[NodeId, int]], held: int) -> tuple[NodeId, int] | None:
        """The peer to fetch from now, with the version it publishes: the highest version
        above ``held`` among peers not backed off; None while a fetch runs or none is due."""
        if self.in_flight is not None:
            return None
        now = self.clock()
        due = [(peer, ver) for peer, ver in published
               if ver > held and now >= self._backoff.get(peer, _Backoff()).not_before]
        if not due:
            return None
        top = max(ver for _, ver in due)
        peer, ver = self.rng.choice([(p, v) for p, v in due if v == top])
        self.in_flight = peer
        return peer, ver

    def done(self, peer: NodeId, caught_up: bool) -> None:
        """The fetch from ``peer`` ended; ``caught_up``: this node now holds at least the
        version ``peer`` published. Otherwise ``peer`` is backed off."""
        self.in_flight = None
        if caught_up:
            self._backoff.pop(peer, None)
            return
        b = self._backoff.setdefault(peer, _Backoff())
        b.delay_s = min(REFETCH_MAX_S, max(REFETCH_MIN_S, b.delay_s * 2))
        b.not_before = self.clock() + b.delay_s

    def forget(self, keep: Iterable[NodeId]) -> None:
        """Drop the back-off of peers not in ``keep`` (gone from the table)."""
        kept = set(keep)
        for peer in [p for p in self._backoff if p not in kept]:
            del self._backoff[peer]


class PushFailed(Exception):
    """A push to one peer did not get an answer saying what it holds; the message says why."""


class RevocationSync:
    """The revocation list of ``gate`` kept the same across ``mesh`` (module doc).

    Construct before ``mesh.start()`` (it adds the mesh routes), :meth:`start` after it,
    :meth:`stop` before ``mesh.stop()``. ``counters``: ``pushes_out`` (lists sent to peers),
    ``pushes_out_failed``, ``pushes_in``, ``pushes_in_taken``, ``pushes_in_dropped`` (a body that
    is not a list, or a list refused: the store counts why), ``fetches``, ``fetches_taken``,
    ``fetches_failed`` (no list came: unreachable, an error, too large), ``fetches_dropped``
    (the list did not verify or was not newer), ``fetches_behind`` (a list older than the peer
    published), ``served`` (lists given to peers that asked).
    """

    def __init__(self, gate: AuthGate, mesh: MeshLink, *, refetches: Refetches | None = None) -> None:
        self.gate = gate
        self.mesh = mesh
        self.refetches = refetches or Refetches()
        self.counters: Counter[str] = Counter()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._warned: set[RevocationReason] = set()
        self._stopped = False
        mesh.node.app.router.add_post(REVOCATIONS_PATH, self.handle_push)
        mesh.node.app.router.add_get(REVOCATIONS_PATH, self.handle_fetch)

    def held(self) -> int:
        current = self.gate.held_revocations()
        return 0 if current is None else current.ver

    async def start(self) -> None:
        """Publish the version held (from the state file) and begin watching the peers'."""
        self._publish()
        self.mesh.node.subscribe(lambda _peer: self.check())
        self._spawn(self._check_loop())

    async def stop(self) -> None:
        self._stopped = True
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _publish(self) -> None:
        ver = self.held()
        self.mesh.publish_extension(REVOCATIONS, Revocations(ver) if ver > 0 else None)

    async def _offer(self, token: str) -> RevocationList:
        held = await self.gate.offer_revocations(token)
        self._publish()
        return held

    # -- from the operator, to every live peer ------------------------------------------------

    async def push_from_operator(self, token: str) -> dict[str, Any]:
        """Take ``token`` (the admin socket's push-revocations) and push the list to every live
        peer. Returns ``{"version", "revoked", "taken", "peers": {name: outcome}}``; ``taken``
        False when this node held the same list already (it is pushed all the same). Raises
        RevocationRefused when this node refuses it (an older list, a forged one)."""
        held, taken = await offer_or_held(self.gate, self._offer, token.strip())
        return {"version": held.ver, "revoked": len(held.revoked), "taken": taken,
                "peers": await self.push_to_peers(held)}

    async def push_to_peers(self, held: RevocationList) -> dict[str, str]:
        """Push ``held`` to every peer not dead, gone or in conflict, all at once; each peer's
        outcome in words (``taken``, ``holds version N``, ``refused: REASON``, ``failed: ...``)."""
        assert held.token is not None
        targets = [PeerTarget.of(v) for v in self.mesh.node.peers() if v.liveness in PUSH_LIVENESS and v.mesh]
        outcomes = await asyncio.gather(*(self._push(t, held.token) for t in targets))
        return {t.id: outcome for t, outcome in zip(targets, outcomes, strict=True)}

    async def _push(self, target: PeerTarget, token: str) -> str:
        self.counters["pushes_out"] += 1
        try:
            answer = await self._post_list(target, token)
        except PushFailed as exc:
            self.counters["pushes_out_failed"] += 1
            log.debug("revocation list push to %s failed: %s", target.id, exc)
            return f"failed: {exc}"
        if answer.get("taken") is True:
            return "taken"
        reason = answer.get("reason")
        if reason == RevocationReason.STALE.value:
            return f"holds version {answer.get('version')}"
        return f"refused: {reason}"

    async def _post_list(self, target: PeerTarget, token: str) -> dict[str, Any]:
        session = self.mesh.session
        if session is None:
            raise PushFailed("the mesh is not started")
        try:
            async with session.post(target.base_url + REVOCATIONS_PATH, data=token.encode(),
                                    headers={"Content-Type": CONTENT_TYPE, **expect_node(target.node_id)},
                                    timeout=aiohttp.ClientTimeout(total=PUSH_TIMEOUT_S)) as resp:
                raw = await read_bounded(resp.content, 64 * 1024)
                if resp.status != 200:
                    raise PushFailed(f"answered {resp.status}: {raw[:200].decode(errors='replace')}")
                answer = _json_object(raw)
        except (aiohttp.ClientError, OSError, TimeoutError, RuntimeError) as exc:  # RuntimeError: session closed
            raise PushFailed(str(exc) or type(exc).__name__) from None
        if answer is None:
            raise PushFailed("the answer is not a JSON object")
        return answer

    # -- from peers -----------------------------------------------------------------------------

    async def handle_push(self, request: web.Request) -> web.Response:
        """POST /mesh/v1/revocations from a peer (mutual TLS): a signed list as the body.
        Answers 200 ``{"taken", "version" (held now), "reason" (why not taken, or null)}``;
        400/413/408 for a body that is not one (dropped, counted)."""
        peer = peer_of(request)
        self.counters["pushes_in"] += 1
        if peer is None:
            self.counters["pushes_in_dropped"] += 1
            return error_response(400, "no verified peer certificate", code=ErrorCode.INVALID_MESSAGE)
        try:
            token = (await read_body(request, MAX_LIST_BYTES, "MAX_LIST_BYTES")).decode("ascii").strip()
        except BodyError as exc:
            self.counters["pushes_in_dropped"] += 1
            return error_response(exc.status, str(exc), code=exc.code)
        except UnicodeDecodeError:
            self.counters["pushes_in_dropped"] += 1
            return error_response(400, "the body is not a signed list (ASCII)", code=ErrorCode.INVALID_MESSAGE)
        try:
            await self._offer(token)
        except RevocationRefused as exc:
            self.counters["pushes_in_dropped"] += 1
            self._log_refused("pushed by", self.mesh.peer_name(peer), exc)
            return web.json_response({"taken": False, "version": self.held(), "reason": exc.reason.value})
        except OSError as exc:  # the state file could not be written: the list is not taken
            log.warning("revocation list pushed by %s not taken: cannot write the state file: %s",
                        self.mesh.peer_name(peer), exc)
            return error_response(503, f"this node cannot keep the list: {exc}")
        self.counters["pushes_in_taken"] += 1
        return web.json_response({"taken": True, "version": self.held(), "reason": None})

    async def handle_fetch(self, request: web.Request) -> web.Response:
        """GET /mesh/v1/revocations from a peer (mutual TLS): the list held, as the body
        (``application/jwt``); 404 when this node holds none."""
        if peer_of(request) is None:
            return error_response(400, "no verified peer certificate", code=ErrorCode.INVALID_MESSAGE)
        current = self.gate.held_revocations()
        if current is None or current.token is None:
            return error_response(404, "this node holds no revocation list", code=ErrorCode.NOT_FOUND)
        self.counters["served"] += 1
        return web.Response(body=current.token.encode(), content_type=CONTENT_TYPE)

    def _log_refused(self, how: str, peer: str, exc: RevocationRefused) -> None:
        # A peer can repeat a bad list: WARNING for a forged one (once per reason), DEBUG for the
        # rest and for an older one (routine while two pushes cross).
        level = logging.DEBUG if exc.reason is RevocationReason.STALE or exc.reason in self._warned else logging.WARNING
        self._warned.add(exc.reason)
        log.log(level, "revocation list %s %s dropped: %s", how, peer, exc)

    # -- catching up with peers ---------------------------------------------------------------

    async def _check_loop(self) -> None:
        while not self._stopped:
            await asyncio.sleep(CHECK_INTERVAL_S)
            self.check()

    def check(self) -> None:
        """Start a fetch when a peer publishes a higher version than the one held (and none
        runs; back-off: :class:`Refetches`). Called on every new peer summary and each
        CHECK_INTERVAL_S; never blocks."""
        session = self.mesh.session
        if self._stopped or session is None or session.closed:  # (the mesh stops before this does)
            return
        views = {v.node_id: v for v in self.mesh.node.peers() if v.liveness in PUSH_LIVENESS and v.mesh}
        self.refetches.forget(v.node_id for v in self.mesh.node.peers())
        picked = self.refetches.pick(((n, published_version(v)) for n, v in views.items()), self.held())
        if picked is not None:
            self._spawn(self._fetch(PeerTarget.of(views[picked[0]]), picked[1]))

    async def _fetch(self, target: PeerTarget, published: int) -> None:
        caught_up = False
        try:
            self.counters["fetches"] += 1
            token = await self._get_list(target)
            if token is None:
                self.counters["fetches_failed"] += 1
                return
            try:
                await self._offer(token)
                self.counters["fetches_taken"] += 1
            except RevocationRefused as exc:
                self.counters["fetches_dropped"] += 1
                self._log_refused("fetched from", target.id, exc)
            caught_up = self.held() >= published
            if not caught_up:
                self.counters["fetches_behind"] += 1
        except OSError as exc:  # the state file could not be written: the list is not taken
            log.warning("revocation list from %s not taken: cannot write the state file: %s", target.id, exc)
        finally:
            self.refetches.done(target.node_id, caught_up)

    async def _get_list(self, target: PeerTarget) -> str | None:
        session = self.mesh.session
        if session is None:
            return None
        try:
            async with session.get(target.base_url + REVOCATIONS_PATH, headers=expect_node(target.node_id),
                                   timeout=aiohttp.ClientTimeout(total=FETCH_TIMEOUT_S)) as resp:
                if resp.status != 200:
                    log.debug("revocation list fetch from %s: answered %d", target.id, resp.status)
                    return None
                if resp.content_length is not None and resp.content_length > MAX_LIST_BYTES:
                    log.debug("revocation list fetch from %s: %d bytes, over the cap", target.id, resp.content_length)
                    return None
                raw = await read_bounded(resp.content, MAX_LIST_BYTES)
        except (aiohttp.ClientError, OSError, TimeoutError, RuntimeError) as exc:  # RuntimeError: session closed
            log.debug("revocation list fetch from %s failed: %s", target.id, exc)
            return None
        if len(raw) > MAX_LIST_BYTES:
            log.debug("revocation list fetch from %s: over %d bytes", target.id, MAX_LIST_BYTES)
            return None
        return raw.decode("ascii", errors="replace")

    # -- observability --------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        """The /v1/status ``revocations`` section: the version held, the number of revoked
        keys, the lists refused by reason (the store's) and the mesh counters (class doc)."""
        current = self.gate.held_revocations()
        refused = self.gate.revocations.refused if self.gate.revocations is not None else Counter()
        return {"version": 0 if current is None else current.ver,
                "revoked": 0 if current is None else len(current.revoked),
                "refused": {r.value: n for r, n in sorted(refused.items())},
                "peers_ahead": sorted(v.name for v in self.mesh.node.peers() if published_version(v) > self.held()),
                "mesh": dict(sorted(self.counters.items()))}

    def metric_families(self) -> Iterable[CounterMetricFamily]:
        """``viiwork_revocation_sync_total{event}``: the mesh counters of the class doc."""
        family = CounterMetricFamily("viiwork_revocation_sync", "Revocation lists pushed, received, fetched and "
                                     "served over the mesh, by event.", labels=["event"])
        for event, count in sorted(self.counters.items()):
            family.add_metric([event], count)
        return [family]


def operator_push(gate: AuthGate | None, sync: RevocationSync | None,
                  ) -> Callable[[str], Awaitable[dict[str, Any]]] | None:
    """The admin socket's push-revocations: through the mesh (``sync``), or on this node alone
    (keys on, no mesh: ``peers`` is empty); None when client keys are off or no issuer key is
    installed (the command then says so)."""
    if sync is not None:
        return sync.push_from_operator
    if gate is None or gate.revocations is None:
        return None
    alone = gate

    async def push_alone(token: str) -> dict[str, Any]:
        held, taken = await offer_or_held(alone, alone.offer_revocations, token.strip())
        return {"version": held.ver, "revoked": len(held.revoked), "taken": taken, "peers": {}}
    return push_alone


async def offer_or_held(gate: AuthGate, offer: Callable[[str], Awaitable[RevocationList]],
                        token: str) -> tuple[RevocationList, bool]:
    """``offer(token)`` as the operator pushes it: ``(list, True)`` when taken, ``(the list held,
    False)`` when this node holds that very list already (a retried push is not an error, on a
    standalone node as in a mesh); any other refusal (older, forged) raises RevocationRefused."""
    try:
        return await offer(token), True
    except RevocationRefused as exc:
        current = gate.held_revocations()
        if exc.reason is not RevocationReason.STALE or current is None or current.token != token:
            raise
        return current, False


def _json_object(raw: bytes) -> dict[str, Any] | None:
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    return doc if isinstance(doc, dict) else None

