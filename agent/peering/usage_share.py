"""Mesh-wide key limits: every node reports what it admitted itself per key to its peers
(issue 17 item 6; docs/security.md, "Limits across the mesh").

One module (over 400 lines) because its parts share one state: the report format and the
receiving book are pure; the pushes, the route and the pacing all read the same per-peer
acknowledgements (``_Outbox``).

A key's ``rpm``/``tpm`` windows are numbered by the wall clock (agent/auth/limits.py), so every
node counts the same minute under the same number. Each node pushes, over the mesh's mutual TLS,
``POST /mesh/v1/key-usage`` to every alive peer: for the current window, the keys whose own counts
changed since that peer last acknowledged them, with their absolute counts::

    {"epoch": "9f2c41d07a3e5b68", "seq": 17, "window": 29410233,
     "usage": [["key-0001", 12, 3400], ["key-0002", 1, 9]]}

- A report **replaces** the sender's earlier figures for each key it names and that window
  (never adds); the receiver feeds the sum over its peers into ``Limiter.note_peer_usage``,
  which counts it beside its own. A node reports only what it admitted itself
  (``Limiter.own_usage``), never what it learned from peers: nothing is counted twice, and a
  forward is counted only at its origin (the serving node admits nothing).
- The sender is the TLS peer (``peer_of``): a report names no node. ``epoch`` (random per
  process) and ``seq`` (increasing per process) order reports: one not newer than the last
  from that sender is ignored (``stale``).
- Pushes start when this node's own counts change (``Limiter.listeners``), coalesced: at most
  one report in flight per peer, rounds at least ``MIN_GAP_S`` apart, and a check every
  ``POLL_S`` that retries what a failed push left unsent. A peer that restarted (a new
  ``boot`` in its summary) gets the whole window again.
- Bounded: a body of at most ``REPORT_MAX_BYTES``, at most ``MAX_KEYS_PER_REPORT`` keys (the
  rest in the next report); a report for an earlier window than the receiver's current one
  is ignored (``window``), one for a later window answered 409 (sent again); a malformed one
  gets 400 and is dropped, counted by reason. The keys remembered from one sender are at most
  ``MAX_KEYS_PER_SENDER`` per window (``keys_full``).
- Senders: only the mesh's current members (alive or suspect peers); a report from any other
  identity, even one the mesh's CA signed, is refused (403, ``dropped_not_member``). Peers'
  figures never evict this node's own counts (``Limiter.note_peer_usage``) and count at most
  the key's limit. What a hostile member can still do (over-report one key until it is
  removed): docs/security.md, "A hostile member"; ``by_sender`` in ``/v1/status`` shows it.

- Pacing (``pace``): an origin holds a request of a limited key while its admissions that
  some peer has not yet acknowledged fill its share of what the key has left, so a burst that
  reaches every origin at once is admitted in rounds of a round trip.

Error bound: a node decides on what its peers had reported, so the mesh may admit, past the
limit, what the other origins admitted within one report delay (the push's round trip plus
at most ``MIN_GAP_S``); pacing cuts that to about one request per origin in a burst.
Requests in flight (``concurrency``) stay per node.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import secrets
import time
from collections import Counter
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client.core import CounterMetricFamily

from viiwork.agent.auth.claims import MAX_LIMIT, NAME_PATTERN, KeyClaims
from viiwork.agent.auth.limits import Limiter
from viiwork.agent.serving.body import BodyError, parse_json, read_body
from viiwork.agent.serving.errors import ErrorCode, error_response
from viiwork.mesh.dialing import expect_node
from viiwork.mesh.identity import NodeId
from viiwork.mesh.membership import Liveness, PeerView
from viiwork.mesh.transport import peer_of

log = logging.getLogger(__name__)

KEY_USAGE_PATH = "/mesh/v1/key-usage"
#: A report's body: 512 keys of 64 characters with 10-digit counts fit in about 50 KB.
REPORT_MAX_BYTES = 65536
MAX_KEYS_PER_REPORT = 512
#: Keys remembered from one sender per window (16 full reports); at most the limiter's
#: ``max_keys``. A sender with more keys in use than this has the rest left out (``keys_full``)
#: and those keys are limited per node.
MAX_KEYS_PER_SENDER = 8192
#: Counts are at most this (a key's limits are at most MAX_LIMIT; tokens may overshoot their
#: estimate by far less than this factor).
MAX_COUNT = 1000 * MAX_LIMIT
MAX_SEQ = 2**63 - 1
#: Rounds of pushes are at least this far apart (a burst of admissions goes in one report).
MIN_GAP_S = 0.01
#: While a push failed, its figures are sent again this often.
POLL_S = 0.25
PUSH_TIMEOUT_S = 2.0
#: A request of a limited key waiting for its origin's share (``pace``) is let through when no
#: push has been acknowledged or has failed for this long (each answer or failure may free a
#: share: a failed push leaves its peer out of pacing until one succeeds, so a peer that stops
#: answering holds a limited key's requests for one push timeout), or when it has waited
#: PACE_MAX_TOTAL_S in all.
PACE_MAX_WAIT_S = PUSH_TIMEOUT_S + 0.5
PACE_MAX_TOTAL_S = 10.0
_EPOCH_RE = re.compile(r"[0-9a-f]{16}")


class UsageReportError(ValueError):
    """A malformed usage report: ``reason`` is its counter's name, the message says what is wrong."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class KeyUsage:
    """What one node admitted for key ``jti`` in a window: ``requests``, and ``tokens``
    (estimates, then real counts)."""

    jti: str
    requests: int
    tokens: int


@dataclass(frozen=True, slots=True)
class UsageReport:
    """One ``POST /mesh/v1/key-usage`` body (see the module doc)."""

    epoch: str
    seq: int
    window: int
    usage: tuple[KeyUsage, ...]

    def doc(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "seq": self.seq, "window": self.window,
                "usage": [[u.jti, u.requests, u.tokens] for u in self.usage]}

    @classmethod
    def parse(cls, doc: Any) -> UsageReport:
        """A report from its JSON; raises UsageReportError (reason ``malformed`` or ``too_many_keys``)."""
        if not isinstance(doc, dict):
            raise UsageReportError("malformed", "a usage report must be a JSON object")
        epoch = doc.get("epoch")
        if not isinstance(epoch, str) or not _EPOCH_RE.fullmatch(epoch):
            raise UsageReportError("malformed", "report.epoch must be 16 lowercase hex digits")
        seq, window = doc.get("seq"), doc.get("window")
        if not _is_int(seq, MAX_SEQ):
            raise UsageReportError("malformed", f"report.seq must be an integer 0..{MAX_SEQ}")
        if not _is_int(window, 2**40):
            raise UsageReportError("malformed", "report.window must be an integer 0..2^40 (minutes since the epoch)")
        entries = doc.get("usage")
        if not isinstance(entries, list):
            raise UsageReportError("malformed", "report.usage must be a list of [jti, requests, tokens]")
        if len(entries) > MAX_KEYS_PER_REPORT:
            raise UsageReportError("too_many_keys", f"report.usage names {len(entries)} keys, more than "
                                   f"{MAX_KEYS_PER_REPORT}")
        usage = []
        seen: set[str] = set()
        for i, entry in enumerate(entries):
            if not (isinstance(entry, list) and len(entry) == 3 and isinstance(entry[0], str)
                    and NAME_PATTERN.fullmatch(entry[0]) and _is_int(entry[1], MAX_COUNT)
                    and _is_int(entry[2], MAX_COUNT)):
                raise UsageReportError("malformed", f"report.usage[{i}] must be [jti (1..64 of A-Za-z0-9._-), "
                                       f"requests, tokens (integers 0..{MAX_COUNT})]")
            if entry[0] in seen:
                raise UsageReportError("malformed", f"report.usage[{i}] names key {entry[0]} again")
            seen.add(entry[0])
            usage.append(KeyUsage(entry[0], entry[1], entry[2]))
        assert isinstance(seq, int) and isinstance(window, int)
        return cls(epoch, seq, window, tuple(usage))


def _is_int(value: Any, maximum: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= maximum


class PeerUsageBook:
    """What peers reported for the current window, per key and peer (the receiving side; pure).

    ``self_id``: this node (its own reports are refused: a node counts itself from its own
    limiter). ``max_keys_per_sender``: keys remembered per sender and window, so that one
    member (docs/security.md, "A hostile member") fills at most its own part. ``senders``:
    per sender, ``reports`` taken and ``keys_full`` (figures left out), over the book's life;
    ``keys`` and ``max_requests`` (the most requests it reported for one key) in the current
    window. Not thread-safe (the agent's loop).
    """

    def __init__(self, self_id: NodeId, max_keys_per_sender: int) -> None:
        self.self_id = self_id
        self.max_keys_per_sender = max_keys_per_sender
        self.window: int | None = None
        self._by_key: dict[str, dict[NodeId, tuple[int, int]]] = {}
        self._last: dict[NodeId, tuple[str, int]] = {}  # sender -> (epoch, seq) of its last report
        self.senders: dict[NodeId, Counter[str]] = {}

    def __len__(self) -> int:
        return len(self._by_key)

    def peers(self) -> int:
        """Peers with figures in the current window."""
        return sum(1 for counts in self.senders.values() if counts["keys"])

    def accept(self, peer: NodeId, report: UsageReport, current_window: int,
               members: Collection[NodeId]) -> tuple[list[KeyUsage], int]:
        """Take ``peer``'s report; returns (the peers' new sums for the keys it named, keys
        left out for want of room in that sender's part). ``members``: the mesh's current
        members (alive or suspect peers). Raises UsageReportError (``self``, ``not_member``,
        ``window``, ``stale``) when the whole report is ignored."""
        if peer == self.self_id:
            raise UsageReportError("self", "a node does not take its own usage report")
        if peer not in members:
            raise UsageReportError("not_member", "the sender is not a live member of this mesh (a certificate "
                                   "of the mesh's CA alone does not make one)")
        if report.window != current_window:
            raise UsageReportError("window", f"report for window {report.window}; the current one here is "
                                   f"{current_window}")
        last = self._last.get(peer)
        if last is not None and last[0] == report.epoch and report.seq <= last[1]:
            raise UsageReportError("stale", f"report {report.seq} is not newer than {last[1]} from this sender")
        self._last[peer] = (report.epoch, report.seq)
        if self.window != current_window:  # a new window: the previous one's figures are done
            self.window = current_window
            self._by_key.clear()
            for counts in self.senders.values():
                counts["keys"] = counts["max_requests"] = 0
        counts = self.senders.setdefault(peer, Counter())
        counts["reports"] += 1
        sums, left_out = [], 0
        for usage in report.usage:
            figures = self._by_key.get(usage.jti)
            if figures is None or peer not in figures:
                if counts["keys"] >= self.max_keys_per_sender:
                    left_out += 1
                    continue
                counts["keys"] += 1
                if figures is None:
                    figures = self._by_key[usage.jti] = {}
            figures[peer] = (usage.requests, usage.tokens)  # replaces, never adds
            counts["max_requests"] = max(counts["max_requests"], usage.requests)
            sums.append(KeyUsage(usage.jti, sum(r for r, _ in figures.values()), sum(t for _, t in figures.values())))
        counts["keys_full"] += left_out
        return sums, left_out


@dataclass(slots=True)
class _Outbox:
    """What one peer has acknowledged of this node's own counts in ``window``."""

    boot: str
    window: int | None = None
    acked: dict[str, tuple[int, int]] = field(default_factory=dict)
    in_flight: bool = False
    failing: bool = False  # its last push failed

    def unacked(self, jti: str, window: int, requests: int, tokens: int) -> tuple[int, int]:
        """Of this node's own (requests, tokens) for ``jti``, what this peer has not acknowledged."""
        acked = self.acked.get(jti, (0, 0)) if self.window == window else (0, 0)
        return max(0, requests - acked[0]), max(0, tokens - acked[1])

    def changes(self, window: int, own: dict[str, tuple[int, int, int]]) -> list[KeyUsage]:
        if window != self.window:
            self.window, self.acked = window, {}
        out = []
        for jti, (w, requests, tokens) in own.items():
            if w == window and self.acked.get(jti) != (requests, tokens):
                out.append(KeyUsage(jti, requests, tokens))
                if len(out) == MAX_KEYS_PER_REPORT:
                    break
        return out


class UsageShare:
    """This node's side of the sharing (see the module doc): the route, the pushes, counters.

    ``limiter``: the node's per-key limits (agent/auth/limits.py). ``self_id``: this node.
    ``peers``: the mesh's peer table (``MeshNode.peers``). ``session``: the mesh's forwarding
    session (mutual TLS, ``expect_node``), None until the mesh has started. ``counters``:
    ``reports_out``, ``reports_in``, ``push_failed``, ``dropped_<reason>``, ``keys_full``.
    """

    def __init__(self, limiter: Limiter, self_id: Callable[[], NodeId], peers: Callable[[], list[PeerView]],
                 session: Callable[[], aiohttp.ClientSession | None]) -> None:
        self.limiter = limiter
        self.self_id = self_id
        self.peers = peers
        self.session = session
        self.epoch = secrets.token_hex(8)
        self.counters: Counter[str] = Counter()
        self._seq = 0
        self._book: PeerUsageBook | None = None
        self._outboxes: dict[NodeId, _Outbox] = {}
        self._wake = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()
        self._warned: set[str] = set()
        self._acked = asyncio.Event()  # set (and replaced) when a push is acknowledged
        self._alive = 0  # alive peers at the last round
        limiter.listeners.append(self._wake.set)

    def add_routes(self, app: web.Application) -> None:
        """``POST /mesh/v1/key-usage`` on the mesh listener (before it starts)."""
        app.router.add_post(KEY_USAGE_PATH, self.handle_usage)

    # -- receiving ----------------------------------------------------------------------

    def _drop(self, reason: str, peer: NodeId | None, message: str, status: int = 400) -> web.Response:
        self.counters[f"dropped_{reason}"] += 1
        # A peer can repeat a bad report every round: WARNING once per reason, then DEBUG.
        level = logging.DEBUG if reason in self._warned else logging.WARNING
        self._warned.add(reason)
        log.log(level, "usage report from %s dropped (%s): %s", peer, reason, message)
        return error_response(status, f"usage report dropped ({reason}): {message}", code=ErrorCode.INVALID_MESSAGE)

    async def handle_usage(self, request: web.Request) -> web.Response:
        """POST /mesh/v1/key-usage from a peer (mutual TLS): its own counts; 204 when taken (or
        ignored: an older window, or not newer than the sender's last), 409 for a window this
        node's clock has not reached yet (the sender retries), 400/413 when dropped."""
        peer = peer_of(request)
        if peer is None:
            return self._drop("no_certificate", None, "no verified peer certificate")
        try:
            body = await read_body(request, REPORT_MAX_BYTES, "REPORT_MAX_BYTES")
        except BodyError as exc:
            return self._drop("too_large" if exc.status == 413 else "malformed", peer, str(exc), exc.status)
        try:
            report = UsageReport.parse(parse_json(body))
        except BodyError as exc:
            return self._drop("malformed", peer, str(exc))
        except UsageReportError as exc:
            return self._drop(exc.reason, peer, str(exc))
        if self._book is None:
            self._book = PeerUsageBook(self.self_id(), min(MAX_KEYS_PER_SENDER, self.limiter.max_keys))
        window = self.limiter.current_window()
        if report.window > window:  # its clock turned the minute first: the sender tries again
            self.counters["ahead"] += 1
            return error_response(409, f"report for window {report.window}; the current one here is {window}",
                                  code=ErrorCode.INVALID_MESSAGE)
        try:
            sums, left_out = self._book.accept(peer, report, window, self._members())
        except UsageReportError as exc:
            if exc.reason == "self":
                return self._drop(exc.reason, peer, str(exc))
            if exc.reason == "not_member":  # the sender retries until it has joined (gossip)
                return self._drop(exc.reason, peer, str(exc), status=403)
            self.counters[f"ignored_{exc.reason}"] += 1  # late or reordered: routine, not an error
            log.debug("usage report from %s ignored: %s", peer, exc)
            return web.Response(status=204)
        self.counters["reports_in"] += 1
        self.counters["keys_full"] += left_out
        for usage in sums:
            if not self.limiter.note_peer_usage(usage.jti, window, usage.requests, usage.tokens):
                self.counters["keys_full"] += 1
        return web.Response(status=204)

    def _members(self) -> set[NodeId]:
        """The mesh's current members, as this node sees them (alive or suspect peers)."""
        return {v.node_id for v in self.peers() if v.liveness in (Liveness.ALIVE, Liveness.SUSPECT)}

    # -- sending ------------------------------------------------------------------------

    async def run(self) -> None:
        """Push this node's own counts to its alive peers until cancelled (see the module doc)."""
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(POLL_S):
                    await self._wake.wait()
            self._wake.clear()
            self._round()
            await asyncio.sleep(MIN_GAP_S)  # coalesce: what is admitted meanwhile goes in the next round

    def _round(self) -> None:
        session = self.session()
        if session is None:
            return
        window = self.limiter.current_window()
        own = self.limiter.own_usage()
        alive = {v.node_id: v for v in self.peers() if v.liveness is Liveness.ALIVE and v.mesh}
        self._alive = len(alive)
        for gone in set(self._outboxes) - set(alive):
            if not self._outboxes[gone].in_flight:
                del self._outboxes[gone]
        for peer, view in alive.items():
            outbox = self._outboxes.get(peer)
            if outbox is None or outbox.boot != view.boot:  # new, or restarted: everything again
                if outbox is not None and outbox.in_flight:
                    continue
                outbox = self._outboxes[peer] = _Outbox(view.boot)
            if outbox.in_flight:
                continue  # its push ends by waking the loop again
            changes = outbox.changes(window, own)
            if changes:
                self._seq += 1
                report = UsageReport(self.epoch, self._seq, window, tuple(changes))
                outbox.in_flight = True
                task = asyncio.get_running_loop().create_task(self._push(session, view, outbox, report))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)

    async def _push(self, session: aiohttp.ClientSession, view: PeerView, outbox: _Outbox,
                    report: UsageReport) -> None:
        try:
            async with session.post(f"https://{view.mesh}{KEY_USAGE_PATH}", data=json.dumps(report.doc()),
                                    headers={"Content-Type": "application/json", **expect_node(view.node_id)},
                                    timeout=aiohttp.ClientTimeout(total=PUSH_TIMEOUT_S)) as resp:
                await resp.read()
                if resp.status != 204:
                    raise ValueError(f"answered {resp.status}")
            self.counters["reports_out"] += 1
            outbox.failing = False
            if outbox.window == report.window:
                outbox.acked.update((u.jti, (u.requests, u.tokens)) for u in report.usage)
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError) as exc:
            self.counters["push_failed"] += 1
            outbox.failing = True
            log.debug("usage report to %s failed: %s", view.name, exc)
        finally:
            outbox.in_flight = False
        self._wake.set()  # what changed meanwhile goes now (a failed push waits for POLL_S)
        acked, self._acked = self._acked, asyncio.Event()
        acked.set()  # requests waiting in ``pace`` look again

    # -- pacing -------------------------------------------------------------------------

    def _over_share(self, claims: KeyClaims, tokens: int) -> bool:
        """Whether this node's admissions of ``claims``' key not yet acknowledged by every
        alive peer (its last push not failed) already fill its share of what the key has left (see ``pace``)."""
        nodes = 1 + self._alive
        if nodes == 1:
            return False
        window = self.limiter.current_window()
        own_r, own_t, peer_r, peer_t = self.limiter.usage_of(claims.jti)
        unacked_r = unacked_t = 0
        for outbox in self._outboxes.values():
            if not outbox.failing:
                r, t = outbox.unacked(claims.jti, window, own_r, own_t)
                unacked_r, unacked_t = max(unacked_r, r), max(unacked_t, t)
        if claims.rpm is not None and own_r + peer_r < claims.rpm:
            if unacked_r + 1 > max(1, (claims.rpm - own_r - peer_r) // nodes):
                return True
        if claims.tpm is not None and own_t + peer_t + tokens <= claims.tpm:
            if unacked_t + tokens > max(tokens, (claims.tpm - own_t - peer_t) // nodes):
                return True
        return False

    async def pace(self, claims: KeyClaims, tokens: int) -> None:
        """Wait (at most ``PACE_MAX_WAIT_S``) until a request of ``claims``' key, which may cost
        ``tokens``, fits this node's share; then the caller admits it (``Limiter.admit``, with
        no ``await`` in between, so the next waiter sees it counted).

        The share: this node's admissions of the key that some alive peer has not yet
        acknowledged may be at most one part per node of the mesh (this node and its alive
        peers) of what the key has left in the window as this node counts it (its limit less
        its own count and its peers' reports), and at least one request. A burst that reaches
        every origin before any report does is then admitted in rounds of one report's round
        trip, each origin taking a part of what is left, instead of every origin admitting up to
        the limit alone; the last rounds pass the limit by about one request per origin, each
        origin's share being cut from its own, slightly stale, count (measured in
        docs/benchmarks.md, "Mesh-wide limit accuracy"). A key whose window is spent is not
        held: the limiter refuses it at once."""
        if claims.rpm is None and claims.tpm is None:
            return
        deadline = time.monotonic() + PACE_MAX_TOTAL_S
        waited = False
        while self._over_share(claims, tokens):
            if not waited:
                waited = True
                self.counters["paced"] += 1
            try:
                async with asyncio.timeout(min(PACE_MAX_WAIT_S, max(0.0, deadline - time.monotonic()))):
                    await self._acked.wait()  # a push answered or failed: look again
            except TimeoutError:
                self.counters["pace_timeouts"] += 1
                return

    async def stop(self) -> None:
        """Cancel the pushes in flight."""
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError):
                await task

    # -- observability ------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        """The /v1/status ``usage_reports`` section."""
        book = self._book
        names = {v.node_id: v.name for v in self.peers()}
        by_sender = {} if book is None else {
            str(peer): {"name": names.get(peer), **dict(sorted(counts.items()))}
            for peer, counts in sorted(book.senders.items())}
        return {"epoch": self.epoch, "peers_reporting": book.peers() if book is not None else 0,
                "keys_from_peers": len(book) if book is not None else 0,
                **dict(sorted(self.counters.items())), "by_sender": by_sender}

    def metric_families(self) -> Iterable[CounterMetricFamily]:
        """``viiwork_usage_reports_total{direction}`` and ``viiwork_usage_reports_dropped_total{reason}``."""
        reports = CounterMetricFamily("viiwork_usage_reports", "Key usage reports exchanged with peers "
                                      "(mesh-wide limits).", labels=["direction"])
        for direction, name in (("out", "reports_out"), ("in", "reports_in"), ("failed", "push_failed")):
            reports.add_metric([direction], self.counters[name])
        dropped = CounterMetricFamily("viiwork_usage_reports_dropped", "Usage reports from peers dropped, by reason.",
                                      labels=["reason"])
        for name, count in sorted(self.counters.items()):
            if name.startswith("dropped_"):
                dropped.add_metric([name.removeprefix("dropped_")], count)
        return [reports, dropped]
