"""A model entry served by a gang of hosts (``hosts = [...]``): who takes part, as which rank,
and the shared part of the entry every host must agree on (docs/configuration.md, "Gangs").

Each host of a gang writes the entry in its own config: ``hosts`` (node ids, or node names
unique in the mesh; the first is the head), its own ``gpus``, and the same shared part. A
host whose id or name is not in ``hosts`` ignores the entry (``gang_rank`` is None).

The shared part is compared as **per-key digests** (``shared_digests``): key -> 32 hex
characters of sha256 over the key's canonical JSON value. The head asks each worker for its
digests and refuses to start the gang when ``differing_keys`` names any: a digest, unlike
the value, is bounded in size and does not carry an operator's args (which may hold a
secret) to another host or into a log. ``shared_hash`` is one digest of the whole part, for
a quick equality check and for status pages.

Pure functions; ``ModelConfig`` is only a type here (the schema calls ``hosts_problem``).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from viiwork.engines.gang import MAX_GANG_HOSTS, GangEngine
from viiwork.engines.registry import ENGINES
from viiwork.mesh.identity import is_node_id

if TYPE_CHECKING:
    from viiwork.agent.config.schema import ModelConfig

#: Keys of a model entry that every host of its gang must write the same: what the model is
#: and how it is served. ``gang_port`` too: a worker dials the head's rendezvous at the port
#: of its own config.
SHARED_ENTRY_KEYS: tuple[str, ...] = ("name", "engine", "path", "kind", "hosts", "gang_port", "ctx_per_slot",
                                      "parallel", "args")
#: Keys each host sets for itself (its GPUs and its unit's limits). The engine's block is
#: split by the engine (``GangEngine.per_host_options``).
PER_HOST_ENTRY_KEYS: tuple[str, ...] = ("gpus", "gpus_per_backend", "backends", "env", "startup_timeout_s",
                                        "memory_max_bytes", "cpu_weight", "tasks_max", "sandbox", "gang_firewall",
                                        "options")

#: A digest: the first 32 hex characters (128 bits) of sha256.
DIGEST_CHARS = 32
_DIGEST_RE = re.compile(rf"[0-9a-f]{{{DIGEST_CHARS}}}")
_SHARED_KEY_RE = re.compile(r"[a-z][a-z0-9_]*(\.[a-z][a-z0-9_]*)?")
#: Most keys a peer's digests may carry (an entry and an engine block have fewer than this).
MAX_SHARED_KEYS = 128
#: A node name as [node] name allows: 1-63 characters of letters, digits, '-', '_', '.'.
_NODE_NAME_RE = re.compile(r"[A-Za-z0-9_.-]{1,63}")


class GangConfigError(ValueError):
    """An entry's hosts do not say unambiguously whether and as which rank this host takes part."""


def hosts_problem(hosts: Sequence[str]) -> tuple[tuple[int, ...], str] | None:
    """What is wrong with an entry's ``hosts`` as ``(path below hosts, message)``, or None.

    At least 2 and at most MAX_GANG_HOSTS entries; each a node id (16 characters of a-z, 2-7)
    or a node name ([node] name's characters); none twice."""
    if len(hosts) < 2:
        return (), (f"a gang spans at least 2 hosts (the first is the head), got {len(hosts)}; "
                    "remove hosts to serve the model on this host alone")
    if len(hosts) > MAX_GANG_HOSTS:
        return (), (f"a gang spans at most {MAX_GANG_HOSTS} hosts (llama.cpp takes at most 16 RPC servers), "
                    f"got {len(hosts)}")
    seen: dict[str, int] = {}
    for i, entry in enumerate(hosts):
        if not (is_node_id(entry) or _NODE_NAME_RE.fullmatch(entry)):
            return (i,), (f"not a node id or node name: {entry!r} (a node id is 16 characters of a-z and 2-7, "
                          "as `viiworkctl mesh` shows; a name has letters, digits, '-', '_' and '.')")
        if entry in seen:
            return (i,), f"{entry!r} is listed twice (hosts[{seen[entry]}] and hosts[{i}]): a host runs one part"
        seen[entry] = i
    return None


def gang_rank(model: ModelConfig, node_id: str | None, node_name: str) -> int | None:
    """This host's rank in ``model``'s gang (its index in ``hosts``: 0 = head), or None when the
    entry is not a gang's or does not name this host (which then ignores the entry).

    ``node_id``: this node's id, None when unknown (a host is then found by name only).
    Raises GangConfigError when this host is named twice (once by id, once by name)."""
    if not model.hosts:
        return None
    found = [i for i, entry in enumerate(model.hosts) if entry == node_name or (node_id and entry == node_id)]
    if len(found) > 1:
        raise GangConfigError(f"model {model.name!r}: hosts names this node twice (hosts[{found[0]}] and "
                              f"hosts[{found[1]}], by id and by name): list each host once")
    return found[0] if found else None


def takes_part(model: ModelConfig, node_id: str | None, node_name: str) -> bool:
    """Whether this host runs ``model``: a one-host entry always; a gang's when it names this host."""
    return not model.hosts or gang_rank(model, node_id, node_name) is not None


def needs_model_file(model: ModelConfig, node_id: str | None, node_name: str) -> bool:
    """Whether this host reads ``model.path`` itself: not when it ignores the entry, nor as a
    worker of an engine whose workers get the model from the head (llama.cpp's rpc-server:
    ``GangEngine.workers_load_model``)."""
    if not model.hosts:
        return True
    rank = gang_rank(model, node_id, node_name)
    if rank is None:
        return False
    engine = ENGINES[model.engine]
    return rank == 0 or not isinstance(engine, GangEngine) or engine.workers_load_model


def shared_part(model: ModelConfig) -> dict[str, Any]:
    """The part of ``model`` every host of its gang must agree on, as JSON values: the entry's
    ``SHARED_ENTRY_KEYS`` and, as ``<engine>.<key>``, the engine block's shared keys with their
    values in force (``GangEngine.gang_shared``). A ``kind`` is its string."""
    data = model.model_dump(mode="json", include=set(SHARED_ENTRY_KEYS))
    part: dict[str, Any] = {key: data[key] for key in SHARED_ENTRY_KEYS}
    engine = ENGINES[model.engine]
    if isinstance(engine, GangEngine) and model.options is not None:
        hosts = max(1, len(model.hosts))
        for key, value in engine.gang_shared(model.options, hosts, len(model.gpus)).items():
            part[f"{model.engine}.{key}"] = value
    return part


def _digest(value: object) -> str:
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()[:DIGEST_CHARS]


def shared_digests(model: ModelConfig) -> dict[str, str]:
    """``shared_part(model)`` with each value replaced by its digest (module docstring)."""
    return {key: _digest(value) for key, value in shared_part(model).items()}


def shared_hash(model: ModelConfig) -> str:
    """One sha256 (64 hex) over ``shared_digests(model)``: equal exactly when every digest is."""
    text = json.dumps(shared_digests(model), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def parse_digests(value: object) -> dict[str, str]:
    """A peer's digests, checked: a JSON object of at most MAX_SHARED_KEYS keys (``key`` or
    ``engine.key``, lowercase) to 32 lowercase hex characters. Raises ValueError naming the
    problem (a peer's message is never trusted to have our shape)."""
    if not isinstance(value, dict):
        raise ValueError(f"shared digests must be an object, got {type(value).__name__}")
    if len(value) > MAX_SHARED_KEYS:
        raise ValueError(f"shared digests carry at most {MAX_SHARED_KEYS} keys, got {len(value)}")
    for key, digest in value.items():
        if not isinstance(key, str) or not _SHARED_KEY_RE.fullmatch(key):
            raise ValueError(f"shared digests: bad key {str(key)[:60]!r}")
        if not isinstance(digest, str) or not _DIGEST_RE.fullmatch(digest):
            raise ValueError(f"shared digests: {key}: not {DIGEST_CHARS} lowercase hex characters")
    return dict(value)


def differing_keys(ours: Mapping[str, str], theirs: Mapping[str, str]) -> tuple[str, ...]:
    """The keys whose digests differ, sorted; a key only one side has differs too (an agent of
    another version, or another engine)."""
    return tuple(sorted(k for k in set(ours) | set(theirs) if ours.get(k) != theirs.get(k)))


def mismatch_message(model: str, host: str, keys: Sequence[str]) -> str:
    """The head's refusal, naming the differing keys: ``model 'm': host 'b' has a different
    gang entry: args, llamacpp.split_mode (write the same in every host's config)``."""
    return (f"model {model!r}: host {host!r} has a different gang entry: {', '.join(keys)} "
            "(write the same in every host's config; only gpus and per-host keys may differ)")
