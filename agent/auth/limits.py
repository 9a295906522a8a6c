"""Per-key limits on this node: requests per minute, tokens per minute, requests in flight.

Windows are fixed and aligned to the wall clock: window ``w`` is ``[60 w, 60 (w + 1))`` seconds
since the epoch (UTC), so every node of a mesh (NTP-synchronised) counts the same minute under
the same number. A key's ``rpm`` and ``tpm`` count what it was admitted in the current window;
the counts start again at 0 when the next window begins (a fixed window, not a sliding one: a
client can get at most twice its limit across one window boundary, the price of a state of
four integers per key, which a mesh can add up node by node).

Tokens are debited before admission from an estimate (``estimate_tokens``: prompt characters
/ 4, plus ``max_tokens`` times ``n``, or for an answer without a bound what the key has left:
docs/security.md, "Limits"); :meth:`Limiter.finish` replaces the estimate with the real count when
the caller knows it (the engine's ``usage``), in the window the request was admitted in.

Mesh-wide limits (issue 17, item 6; agent/peering/usage_share.py) build on
:meth:`Limiter.note_peer_usage`: the consumption peers report for a key in a window is added to
this node's own when it decides, and never reported onward (a node reports only what it
admitted itself: ``own_usage``). ``listeners`` are told when this node's own counts change, so
the sharing can report them at once. Peers' figures are kept apart from this node's own
counts: noting them never evicts a key's own state (a member flooding made-up keys must not
reset a real key's count; docs/security.md, "A hostile member"), and they count at most the
key's own limit (more says nothing more).

Memory is bounded: the state of at most ``max_keys`` keys is kept, least recently used
dropped first (never a key with requests in flight); a dropped key starts its window again
at 0. Peers' figures for the current window: any number for keys with state here, and at
most ``max_keys`` more for keys this node has not seen (the rest left out). Not thread-safe:
one owner (the agent's loop).
"""

from __future__ import annotations

import math
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, TypeGuard

from viiwork.agent.auth.claims import KeyClaims

WINDOW_S = 60
DEFAULT_MAX_KEYS = 65536


def _wall_clock() -> float:
    return time.time()


def estimate_tokens(payload: Mapping[str, Any], unbounded: int = 0) -> int:
    """A request's tokens before it runs: its prompt (:func:`prompt_tokens_estimate`) plus the
    completion it may ask for.

    The completion is the first non-null of ``max_tokens`` and ``max_completion_tokens`` (a
    positive integer: the body checks refuse any other value, agent/serving/body.py) times
    ``n`` (a positive integer, else 1); without one it is ``unbounded`` (>= 0, all choices
    together): the caller's bound for an answer with no limit
    (:meth:`AuthGate.admit` passes what the key has left in the window, docs/security.md,
    "Limits"). Returns >= 1.
    """
    limit = _first_given(payload, "max_tokens", "max_completion_tokens", "max_output_tokens")
    if limit is None:
        completion = max(0, unbounded)
    else:
        n = payload.get("n")
        completion = (limit if _positive_int(limit) else 0) * (n if _positive_int(n) else 1)
    return max(1, prompt_tokens_estimate(payload) + completion)


def prompt_tokens_estimate(payload: Mapping[str, Any]) -> int:
    """A request's prompt tokens before it runs: characters of its text / 4 (rounded up), plus
    one per token id where the prompt is given as token ids.

    The text is that of ``messages`` (string contents and ``text`` parts), ``prompt`` (a
    string or strings) or ``input`` (embeddings: a string or strings); ``prompt``/``input``
    may also be a list of token ids or a list of such lists (OpenAI's forms). Returns >= 0.
    """
    chars = 0
    for text in _texts(payload):
        chars += len(text)
    return math.ceil(chars / 4) + _token_ids(payload)


def _first_given(payload: Mapping[str, Any], *names: str) -> Any:
    for name in names:
        value = payload.get(name)
        if value is not None:
            return value
    return None


def _positive_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _token_ids(payload: Mapping[str, Any]) -> int:
    count = 0
    for name in ("prompt", "input"):
        value = payload.get(name)
        if not isinstance(value, list):
            continue
        for item in value:
            if isinstance(item, int) and not isinstance(item, bool):
                count += 1
            elif isinstance(item, list):
                count += sum(1 for i in item if isinstance(i, int) and not isinstance(i, bool))
    return count


def _texts(payload: Mapping[str, Any]) -> Iterator[str]:
    messages = payload.get("messages")
    if isinstance(messages, list):
        for message in messages:
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, str):
                yield content
            elif isinstance(content, list):
                for part in content:
                    if isinstance(part, dict) and isinstance(part.get("text"), str):
                        yield part["text"]
    for name in ("prompt", "input"):
        value = payload.get(name)
        if isinstance(value, str):
            yield value
        elif isinstance(value, list):
            yield from (v for v in value if isinstance(v, str))


@dataclass(slots=True)
class _KeyState:
    window: int
    requests: int = 0  # admitted here in ``window``
    tokens: int = 0  # debited here in ``window`` (estimates, then real counts)
    in_flight: int = 0

    def roll(self, window: int) -> None:
        if window != self.window:
            self.window, self.requests, self.tokens = window, 0, 0


@dataclass(frozen=True, slots=True)
class Quota:
    """What a key has left in the current window: the ``x-ratelimit-*`` headers' figures.
    ``None``: the key has no such limit (its headers are left out)."""

    limit_requests: int | None
    remaining_requests: int | None
    limit_tokens: int | None
    remaining_tokens: int | None
    reset_s: float  # seconds until the window ends

    def headers(self) -> dict[str, str]:
        """OpenAI's header names; ``reset`` as a duration (``"12ms"``, ``"7.5s"``, ``"1m0s"``)."""
        out: dict[str, str] = {}
        for what, limit, remaining in (("requests", self.limit_requests, self.remaining_requests),
                                       ("tokens", self.limit_tokens, self.remaining_tokens)):
            if limit is not None and remaining is not None:
                out[f"x-ratelimit-limit-{what}"] = str(limit)
                out[f"x-ratelimit-remaining-{what}"] = str(max(0, remaining))
                out[f"x-ratelimit-reset-{what}"] = format_duration(self.reset_s)
        return out


def format_duration(seconds: float) -> str:
    """``seconds`` (>= 0) as OpenAI writes a reset time: ``"250ms"``, ``"7.5s"``, ``"1m0s"``."""
    if seconds < 1:
        return f"{max(0, round(seconds * 1000))}ms"
    minutes, rest = divmod(round(seconds, 3), 60)
    text = f"{rest:.3f}".rstrip("0").rstrip(".") + "s"
    return f"{int(minutes)}m{text}" if minutes else text


class LimitExceeded(Exception):
    """A request refused by its key's limit: ``limit`` is ``requests``, ``tokens`` or
    ``concurrency``; ``retry_after_s`` whole seconds (>= 1); ``quota`` for the headers."""

    def __init__(self, limit: str, message: str, retry_after_s: int, quota: Quota) -> None:
        super().__init__(message)
        self.limit = limit
        self.retry_after_s = retry_after_s
        self.quota = quota


@dataclass(slots=True)
class Admission:
    """An admitted request: give it back to :meth:`Limiter.finish` when it ends (once)."""

    jti: str
    window: int
    tokens: int  # debited so far (the estimate)
    quota: Quota
    state: _KeyState | None  # None: the key has no limit of its own (nothing tracked)
    done: bool = False

    @property
    def tracks_tokens(self) -> bool:
        """Whether the real token count matters (the key has a ``tpm``)."""
        return self.state is not None and self.quota.limit_tokens is not None


class Limiter:
    """The limits of every key seen on this node (see the module doc).

    ``max_keys``: keys whose state is kept (>= 1). ``clock``: seconds since the epoch.
    ``refused`` counts refusals by limit (requests, tokens, concurrency).
    """

    def __init__(self, max_keys: int = DEFAULT_MAX_KEYS, clock: Callable[[], float] = _wall_clock) -> None:
        if max_keys < 1:
            raise ValueError("max_keys must be >= 1")
        self.max_keys = max_keys
        self.clock = clock
        self.refused: Counter[str] = Counter()
        self._keys: OrderedDict[str, _KeyState] = OrderedDict()
        #: Peers' sums for ``_peer_window`` (note_peer_usage): jti -> (requests, tokens). Apart
        #: from ``_keys``, so that noting them never evicts this node's own counts.
        self._peer: dict[str, tuple[int, int]] = {}
        self._peer_window: int | None = None
        #: Called (on the owner's loop, must not block) after this node's own counts of a key
        #: changed: an admission, or a real token count replacing an estimate.
        self.listeners: list[Callable[[], None]] = []

    def _changed(self) -> None:
        for listener in self.listeners:
            listener()

    def __len__(self) -> int:
        return len(self._keys)

    def _state(self, jti: str, window: int) -> _KeyState:
        state = self._keys.get(jti)
        if state is None:
            state = self._keys[jti] = _KeyState(window)
            self._evict()
        else:
            self._keys.move_to_end(jti)
            state.roll(window)
        return state

    def _evict(self) -> None:
        if len(self._keys) <= self.max_keys:
            return
        for jti, state in self._keys.items():  # oldest first
            if state.in_flight == 0:
                del self._keys[jti]
                return
        # Every kept key has a request in flight: over the cap by at most the requests in flight.

    def admit(self, claims: KeyClaims, tokens: int) -> Admission:
        """Admit a request of ``claims``' key that may cost ``tokens`` (estimate_tokens).

        Returns an Admission (debited: one request, ``tokens``, one in flight). Raises
        LimitExceeded when ``rpm`` or ``tpm`` would be passed in this window (retry when it ends)
        or ``concurrency`` requests are in flight (retry in 1 s); nothing is debited then.
        """
        now = self.clock()
        window = math.floor(now / WINDOW_S)
        reset_s = (window + 1) * WINDOW_S - now
        if claims.rpm is None and claims.tpm is None and claims.concurrency is None:
            return Admission(claims.jti, window, tokens, Quota(None, None, None, None, reset_s), None)
        state = self._state(claims.jti, window)
        peer_requests, peer_tokens = self._peer_figures(claims.jti, window)
        # Peers' figures count at most the key's limit: more says nothing more, and an
        # over-report (a hostile member) cannot push the headers' figures past it.
        if claims.rpm is not None:
            peer_requests = min(peer_requests, claims.rpm)
        if claims.tpm is not None:
            peer_tokens = min(peer_tokens, claims.tpm)
        used_requests = state.requests + peer_requests
        used_tokens = state.tokens + peer_tokens

        def quota(requests: int, spent: int) -> Quota:
            return Quota(claims.rpm, None if claims.rpm is None else claims.rpm - requests,
                         claims.tpm, None if claims.tpm is None else claims.tpm - spent, reset_s)

        retry = max(1, math.ceil(reset_s))
        if claims.rpm is not None and used_requests + 1 > claims.rpm:
            self.refused["requests"] += 1
            raise LimitExceeded("requests", f"key {claims.jti} reached its limit of {claims.rpm} requests per "
                                f"minute; the window resets in {retry} s", retry, quota(used_requests, used_tokens))
        if claims.tpm is not None and used_tokens + tokens > claims.tpm:
            self.refused["tokens"] += 1
            raise LimitExceeded("tokens", f"key {claims.jti} has {max(0, claims.tpm - used_tokens)} of its "
                                f"{claims.tpm} tokens per minute left; this request may use about {tokens}",
                                retry, quota(used_requests, used_tokens))
        if claims.concurrency is not None and state.in_flight >= claims.concurrency:
            self.refused["concurrency"] += 1
            raise LimitExceeded("concurrency", f"key {claims.jti} has {state.in_flight} requests in flight, "
                                f"its limit", 1, quota(used_requests, used_tokens))
        state.requests += 1
        state.tokens += tokens
        state.in_flight += 1
        self._changed()
        return Admission(claims.jti, window, tokens, quota(used_requests + 1, used_tokens + tokens), state)

    def finish(self, admission: Admission, tokens_used: int | None = None) -> None:
        """``admission``'s request ended: it is no longer in flight; ``tokens_used`` (the engine's
        usage; None: unknown) replaces its estimate if its window is still the current one."""
        if admission.done:
            return
        admission.done = True
        state = admission.state
        if state is None:
            return
        state.in_flight = max(0, state.in_flight - 1)
        if tokens_used is not None and state.window == admission.window and tokens_used != admission.tokens:
            state.tokens = max(0, state.tokens + tokens_used - admission.tokens)
            self._changed()

    def current_window(self) -> int:
        """The number of the current window (seconds since the epoch // 60)."""
        return math.floor(self.clock() / WINDOW_S)

    def note_peer_usage(self, jti: str, window: int, requests: int, tokens: int) -> bool:
        """What peers admitted for ``jti`` in ``window`` (their sum, replacing the last sum):
        counted against the key's limits here too, apart from this node's own counts (never
        evicting them). Returns False when left out: a report for another window than the
        current one, or a key this node has no state for while ``max_keys`` such keys are
        already noted in this window."""
        now_window = math.floor(self.clock() / WINDOW_S)
        if window != now_window:
            return False
        if self._peer_window != window:  # a new window: the previous one's figures are done
            self._peer_window = window
            self._peer.clear()
        if jti not in self._peer and jti not in self._keys and len(self._peer) >= self.max_keys:
            return False
        self._peer[jti] = (max(0, requests), max(0, tokens))
        return True

    def _peer_figures(self, jti: str, window: int) -> tuple[int, int]:
        if self._peer_window != window:
            return 0, 0
        return self._peer.get(jti, (0, 0))

    def usage_of(self, jti: str) -> tuple[int, int, int, int]:
        """``jti``'s counts in the current window: (requests, tokens) admitted here, then
        (requests, tokens) its peers reported; zeros for what is not tracked."""
        window = self.current_window()
        state = self._keys.get(jti)
        own = (0, 0) if state is None or state.window != window else (state.requests, state.tokens)
        return (*own, *self._peer_figures(jti, window))

    def own_usage(self) -> dict[str, tuple[int, int, int]]:
        """jti -> (window, requests, tokens) admitted by this node itself in the current window
        (what it may report to peers)."""
        window = math.floor(self.clock() / WINDOW_S)
        return {jti: (s.window, s.requests, s.tokens) for jti, s in self._keys.items()
                if s.window == window and (s.requests or s.tokens)}
