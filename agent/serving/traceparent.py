"""W3C Trace Context headers: ``traceparent`` and ``tracestate`` read, checked and written (pure).

The rules are the W3C Trace Context recommendation's (https://www.w3.org/TR/trace-context/,
sections 3.2 and 3.3), with this agent's bounds (docs/metrics.md, "Tracing"):

- ``traceparent`` is ``VERSION-TRACE_ID-PARENT_ID-FLAGS``: 2, 32, 16 and 2 lowercase hex
  digits. Version ``ff`` is invalid; version ``00`` is exactly 55 characters; a later version
  is at least 55 and, when longer, has a ``-`` after the flags (its other fields are not
  read), and at most :data:`MAX_TRACEPARENT_CHARS`. An all-zero trace id or parent id is
  invalid, and so is a request with more than one ``traceparent`` header.
- ``tracestate`` (several headers are one comma-separated list) is kept only beside a valid
  ``traceparent``: up to 32 ``key=value`` members, keys and values as the recommendation
  spells them, no key twice; a list that breaks a rule is dropped whole. Written back at most
  :data:`MAX_TRACESTATE_CHARS` characters: members over 128 characters go first, then members
  from the end, as the recommendation's truncation rule says.

Nothing here raises on what a client sends: an invalid header is an :class:`Invalid` reason
(the caller counts it and starts a new trace), a dropped ``tracestate`` is None.
"""

from __future__ import annotations

import os
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"

#: The longest ``traceparent`` read: version 00's is 55 characters; a later version may append
#: fields, bounded here so that a client cannot make this node scan kilobytes.
MAX_TRACEPARENT_CHARS = 256
#: The longest ``tracestate`` passed on (the recommendation asks vendors to propagate at least 512).
MAX_TRACESTATE_CHARS = 512
#: The most members a ``tracestate`` may have (the recommendation's limit).
MAX_TRACESTATE_MEMBERS = 32
#: A ``tracestate`` longer than this (all its headers together) is dropped without being parsed.
MAX_TRACESTATE_READ_CHARS = 8192
# Members longer than this are the first dropped when a tracestate must be cut (W3C, 3.3.1.5).
_LONG_MEMBER_CHARS = 128

_TRACEPARENT_00 = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")
_ZERO_TRACE_ID = "0" * 32
_ZERO_PARENT_ID = "0" * 16
# tracestate's key and value grammar (W3C, 3.3.1.3): a simple key, or tenant@system.
_KEY = re.compile(r"[a-z][a-z0-9_\-*/]{0,255}|[a-z0-9][a-z0-9_\-*/]{0,240}@[a-z][a-z0-9_\-*/]{0,13}")
_VALUE = re.compile(r"[\x20-\x2b\x2d-\x3c\x3e-\x7e]{0,255}[\x21-\x2b\x2d-\x3c\x3e-\x7e]")


class Invalid(str, Enum):
    """Why a ``traceparent`` was not taken (the label of /metrics' counter)."""

    MALFORMED = "malformed"  # not VERSION-TRACE_ID-PARENT_ID-FLAGS in lowercase hex, or version 00 not 55 chars
    VERSION = "version"  # version ff, which the recommendation forbids
    ZERO_ID = "zero_id"  # an all-zero trace id or parent id
    TOO_LONG = "too_long"  # over MAX_TRACEPARENT_CHARS
    REPEATED = "repeated"  # more than one traceparent header


@dataclass(frozen=True, slots=True)
class TraceParent:
    """A valid ``traceparent``: ``trace_id`` (32 lowercase hex digits, not all zero),
    ``parent_id`` (16, not all zero: the caller's span), ``sampled`` (flags bit 0: the caller
    may have recorded it; this node never samples because of it)."""

    trace_id: str
    parent_id: str
    sampled: bool


def parse_traceparent(values: Sequence[str]) -> TraceParent | Invalid | None:
    """The request's ``traceparent`` from its header ``values`` (every header of that name):
    None when there is none, an :class:`Invalid` reason when it breaks a rule (module doc)."""
    if not values:
        return None
    if len(values) > 1:
        return Invalid.REPEATED
    value = values[0]
    if len(value) > MAX_TRACEPARENT_CHARS:
        return Invalid.TOO_LONG
    match = _TRACEPARENT_00.match(value)
    if match is None:
        return Invalid.MALFORMED
    version, trace_id, parent_id, flags = match.groups()
    if version == "ff":
        return Invalid.VERSION
    if len(value) != 55 and (version == "00" or value[55] != "-"):
        return Invalid.MALFORMED
    if trace_id == _ZERO_TRACE_ID or parent_id == _ZERO_PARENT_ID:
        return Invalid.ZERO_ID
    return TraceParent(trace_id, parent_id, bool(int(flags, 16) & 1))


def traceparent_header(trace_id: str, parent_id: str, sampled: bool) -> str:
    """The ``traceparent`` this node sends (version 00, only the sampled flag)."""
    return f"00-{trace_id}-{parent_id}-{'01' if sampled else '00'}"


def parse_tracestate(values: Sequence[str]) -> str | None:
    """The ``tracestate`` to pass on from its header ``values`` (several headers are one list),
    as ``key=value`` members joined by commas, cut to MAX_TRACESTATE_CHARS (module doc);
    None when there is none or it breaks a rule (it is then dropped whole)."""
    if not values or sum(len(v) for v in values) > MAX_TRACESTATE_READ_CHARS:
        return None
    members: list[str] = []
    keys: set[str] = set()
    for value in values:
        for raw in value.split(","):
            member = raw.strip(" \t")
            if not member:  # empty members are allowed, and ignored
                continue
            key, eq, val = member.partition("=")
            if not eq or not _KEY.fullmatch(key) or not _VALUE.fullmatch(val) or key in keys:
                return None
            keys.add(key)
            members.append(member)
    if not members or len(members) > MAX_TRACESTATE_MEMBERS:
        return None
    return _cut(members)


def _cut(members: list[str]) -> str | None:
    """``members`` joined, within MAX_TRACESTATE_CHARS: long members dropped first, then from the end."""
    joined = ",".join(members)
    if len(joined) <= MAX_TRACESTATE_CHARS:
        return joined
    members = [m for m in members if len(m) <= _LONG_MEMBER_CHARS]
    while members and len(",".join(members)) > MAX_TRACESTATE_CHARS:
        members.pop()
    return ",".join(members) or None


class IdSource:
    """New trace ids (32 hex digits) and span ids (16), random and never all zero.

    A ``random.Random`` seeded from os.urandom once: ids need to be unique and unguessable
    enough to not collide, not secret (W3C, 3.2.2.3), and a system call per request is avoidable."""

    def __init__(self, rng: random.Random | None = None) -> None:
        self._bits = (rng or random.Random(os.urandom(16))).getrandbits

    def trace_id(self) -> str:
        while True:
            value = self._bits(128)
            if value:
                return f"{value:032x}"

    def span_id(self) -> str:
        while True:
            value = self._bits(64)
            if value:
                return f"{value:016x}"
