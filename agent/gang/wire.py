"""What a gang's head and workers say to each other over the mesh's mutual TLS (docs/mesh.md, "Gangs").

Three routes on every agent's mesh listener (the sender is the node of the verified client
certificate, as for every mesh route):

- ``POST /mesh/v1/gang/start``: the head asks a worker to start its part(s) of one gang. Body
  (JSON, at most :data:`MAX_BODY_BYTES`): ``model`` (the entry's name), ``gang`` (the gang id:
  engines/gang.py ``new_gang_id``), ``rank`` (the worker's, 1..size-1), ``size``,
  ``addresses`` (one host per rank, the head's first: where the engines' own rendezvous are
  reached), ``digests`` (the head's per-key digests of the entry's shared part:
  agent/config/gang.py) and ``tunnel_cert`` (a llama.cpp RPC gang's tunnel certificate, PEM,
  which the worker's exit will admit: agent/gang/tunnel_cert.py; null for other engines).
  Answer 200 ``{"gang", "rank", "parts": [{"role", "pid", "unit"}], "tunnel_port"}`` once
  the parts are ready at the level the gang plan asks (``tunnel_port``: the worker's tunnel
  exit for a llama.cpp RPC worker, else null); a refusal is ``{"reason", "detail"}`` with
  4xx (:class:`Reason`), a part that did not come up 503 ``part_failed``.
- ``POST /mesh/v1/gang/stop``: ``{"model", "gang"}``, from the head: the worker stops that
  gang's parts (200 ``{"stopped": bool}``).
- ``GET /mesh/v1/gang/parts``: the worker's parts, ``{"parts": [{"model", "gang", "rank",
  "running"}]}``, for the head's watch.

Parsing is strict and bounded: a body that is not exactly this shape is a 400 ``malformed``,
counted, and changes nothing.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from viiwork.agent.config.gang import parse_digests
from viiwork.agent.gang.tunnel_cert import pinned_der
from viiwork.engines.gang import MAX_GANG_HOSTS, is_gang_id

START_PATH = "/mesh/v1/gang/start"
STOP_PATH = "/mesh/v1/gang/stop"
PARTS_PATH = "/mesh/v1/gang/parts"
MAX_BODY_BYTES = 16 * 1024
MAX_ADDRESS_CHARS = 255


class Reason(StrEnum):
    """Why a worker refused a request about a gang (the answer's ``reason``)."""

    MALFORMED = "malformed"  # 400: not the documented shape
    NO_GANG_ENTRY = "no_gang_entry"  # 404: this host's config has no gang entry by that name
    NOT_IN_GANG = "not_in_gang"  # 409: the entry does not name this host
    RANK_MISMATCH = "rank_mismatch"  # 409: this host's rank (or the gang's size) is not the head's
    NOT_THE_HEAD = "not_the_head"  # 403: the sender is not the head this host's entry names
    CONFIG_MISMATCH = "config_mismatch"  # 409: the shared part differs (``keys`` names them)
    PART_FAILED = "part_failed"  # 503: the part did not start or did not become ready


STATUS = {Reason.MALFORMED: 400, Reason.NO_GANG_ENTRY: 404, Reason.NOT_IN_GANG: 409, Reason.RANK_MISMATCH: 409,
          Reason.NOT_THE_HEAD: 403, Reason.CONFIG_MISMATCH: 409, Reason.PART_FAILED: 503}


class Malformed(ValueError):
    """A body that is not the documented shape; the message says what is wrong."""


@dataclass(frozen=True, slots=True)
class StartRequest:
    model: str
    gang: str
    rank: int
    size: int
    addresses: tuple[str, ...]
    digests: dict[str, str]
    tunnel_cert: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"model": self.model, "gang": self.gang, "rank": self.rank, "size": self.size,
                "addresses": list(self.addresses), "digests": self.digests, "tunnel_cert": self.tunnel_cert}


def _object(raw: bytes, keys: frozenset[str]) -> dict[str, Any]:
    try:
        doc = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise Malformed(f"not JSON: {exc}") from None
    except RecursionError:  # thousands of nested arrays fit in the body's bound
        raise Malformed("not JSON: nested too deeply") from None
    if not isinstance(doc, dict):
        raise Malformed("not a JSON object")
    if set(doc) != keys:
        raise Malformed(f"expected the keys {sorted(keys)}, got {sorted(doc)[:20]}")
    return doc


def _model_and_gang(doc: dict[str, Any]) -> tuple[str, str]:
    model, gang = doc["model"], doc["gang"]
    if not isinstance(model, str) or not 0 < len(model) <= 255:
        raise Malformed("model: expected a model name")
    if not is_gang_id(gang):
        raise Malformed("gang: expected a gang id")
    return model, gang


def _int(value: object, name: str, low: int, high: int) -> int:
    if type(value) is not int or not low <= value <= high:
        raise Malformed(f"{name}: expected an integer in {low}..{high}")
    return value


def parse_start(raw: bytes) -> StartRequest:
    """The body of ``POST /mesh/v1/gang/start``; raises :class:`Malformed`."""
    doc = _object(raw, frozenset({"model", "gang", "rank", "size", "addresses", "digests", "tunnel_cert"}))
    model, gang = _model_and_gang(doc)
    size = _int(doc["size"], "size", 2, MAX_GANG_HOSTS)
    rank = _int(doc["rank"], "rank", 1, size - 1)
    addresses = doc["addresses"]
    if (not isinstance(addresses, list) or len(addresses) != size
            or not all(isinstance(a, str) and 0 < len(a) <= MAX_ADDRESS_CHARS for a in addresses)):
        raise Malformed(f"addresses: expected {size} host names or addresses")
    try:
        digests = parse_digests(doc["digests"])
    except ValueError as exc:
        raise Malformed(f"digests: {exc}") from None
    cert = doc["tunnel_cert"]
    if cert is not None:
        try:
            pinned_der(cert)
        except ValueError as exc:
            raise Malformed(f"tunnel_cert: {exc}") from None
    return StartRequest(model, gang, rank, size, tuple(addresses), digests, cert)


def parse_stop(raw: bytes) -> tuple[str, str]:
    """The body of ``POST /mesh/v1/gang/stop``: (model, gang); raises :class:`Malformed`."""
    return _model_and_gang(_object(raw, frozenset({"model", "gang"})))
