"""Prompt prefixes: chained block hashes of a request's prompt, and the index of which local
backend served which prefix recently (docs/routing.md, "Prefix-aware routing").

Pure: no asyncio, no I/O; the clock is the order of calls (least recently used).

**What is hashed.** The prompt as a chat template lays it out, without a tokenizer: for a chat
request the ``tools`` (canonical JSON) and then every message in order, each as its role, the
length of its content and the content itself (UTF-8; content that is not a string, such as a
list of parts, as canonical JSON), so that no two different message lists render alike; for a
completion request the ``prompt``. An Anthropic ``/v1/messages`` request's top-level ``system``
comes first as a system message. Other endpoints (``/v1/responses``' ``input``, rerank) have no
prefix here: they are routed by load alone. Two requests share leading blocks exactly when they share that leading
text, so a conversation's later turn (sent with the whole history) shares the blocks of its
first turn, and the same messages in another order share nothing after the first difference.
Another field (``temperature``, ``max_tokens``) changes nothing in the engine's KV cache, so it
is left out. Embeddings have no prefix (None).

**Blocks.** The rendered bytes are cut into :data:`BLOCK_BYTES` blocks (1 KiB, about 256 tokens
at the ~4 bytes/token of BPE tokenizers on English text); only whole blocks are hashed, since a
partial last block is the part the next turn changes. Why 1 KiB: an engine reuses a prefix at
token granularity, so finer is more exact, but each block is one hash per request, one index
entry and, when published, 19 bytes of gossip; 1 KiB keeps a 4,000-token (16 KB) prompt at 16
hashes (docs/benchmarks-routing.md: hashing it takes well under the 0.1 ms budget) while a
1,000-token system prompt still spans 4 blocks.

**Chaining.** Block ``i``'s digest is the first 8 bytes of SHA-256 over the digest of block
``i - 1`` and block ``i``, so digest ``i`` stands for blocks ``0..i`` and one lookup per block
finds the longest shared prefix. SHA-256 rather than BLAKE2b: CPUs with the SHA extensions
(x86 since 2017, ARMv8) hash 16 KB in ~14 us against BLAKE2b's ~27 us (measured on the
development VM, docs/benchmarks-routing.md). The first key is the **salt**: a hash of the model
and the tenant (the client key's tenant, "" without keys), so one tenant cannot learn through
routing whether another sent a prompt; ``routing.prefix_sharing = "model"`` salts by the model
alone (a system prompt common to every tenant is then shared).
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

BLOCK_BYTES = 1024
BYTES_PER_TOKEN = 4  # English text under BPE tokenizers: used only to turn bytes into predicted seconds
DIGEST_BYTES = 8  # 64-bit digests: 16 hex characters on the wire (mesh/extensions.py, ``prefixes``)
DEFAULT_INDEX_ENTRIES = 16384  # per model: ~4 MiB (an entry is ~250 bytes in CPython), 16 M characters of prompts
MAX_BACKENDS_PER_ENTRY = 8  # a digest remembers its most recent backends, at most this many
# A prompt's leading 512 blocks (512 KiB, ~130,000 tokens: beyond any context served today) are
# hashed: one request, however large (api.max_body_bytes is 32 MiB), costs at most 512 index
# entries and ~0.5 ms of hashing; a 17 MiB prompt once evicted every tenant's prefixes.
MAX_BLOCKS = 512

Sharing = Literal["tenant", "model"]


@dataclass(frozen=True, slots=True)
class PrefixKey:
    """One request's prefix: ``digests`` (block 0 first, one per whole block, each
    :data:`DIGEST_BYTES` bytes as 16 lowercase hex characters, the wire form) and
    ``prompt_bytes`` (the rendered prompt's length, whole or not)."""

    digests: tuple[str, ...]
    prompt_bytes: int


def _canonical(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8", "surrogatepass")


def _message(m: Any) -> bytes:
    if not isinstance(m, dict):
        return b"\x01" + _canonical(m)
    role, content = m.get("role"), m.get("content")
    head = role if isinstance(role, str) else json.dumps(role)
    if isinstance(content, str):
        return f"\x02{head}\x00{len(content)}\x00".encode("utf-8", "surrogatepass") + \
            content.encode("utf-8", "surrogatepass")
    return f"\x03{head}\x00".encode("utf-8", "surrogatepass") + _canonical(content)


def render_prompt(payload: Mapping[str, Any]) -> bytes | None:
    """The prompt of a chat or completion request as the engine's template orders it (module
    doc); None when the body has neither ``messages`` (a list) nor ``prompt``."""
    messages = payload.get("messages")
    if isinstance(messages, list):
        parts: list[bytes] = []
        tools = payload.get("tools")
        if tools:
            parts.append(b"\x04" + _canonical(tools))
        system = payload.get("system")  # Anthropic's /v1/messages: the system prompt beside the messages
        if system:
            parts.append(_message({"role": "system", "content": system}))
        parts.extend(_message(m) for m in messages)
        return b"".join(parts)
    prompt = payload.get("prompt")
    if isinstance(prompt, str):
        return prompt.encode("utf-8", "surrogatepass")
    if prompt is not None:
        return _canonical(prompt)  # a list of strings or of token ids
    return None


def salt_of(model: str, tenant: str, sharing: Sharing) -> bytes:
    """The first key of a chain: the model and (``sharing == "tenant"``) the tenant."""
    who = "" if sharing == "model" else tenant
    return hashlib.sha256(f"viiwork-prefix-1\0{model}\0{who}".encode("utf-8", "surrogatepass")).digest()[:16]


def chain(data: bytes, salt: bytes, block_bytes: int = BLOCK_BYTES, max_blocks: int = MAX_BLOCKS) -> tuple[str, ...]:
    """The chained digests of ``data``'s whole blocks (module doc), as hex: at most
    ``max_blocks`` (the leading ones)."""
    out: list[str] = []
    key = salt
    sha256 = hashlib.sha256
    view = memoryview(data)
    end = min(len(data), max_blocks * block_bytes)
    for start in range(0, end - block_bytes + 1, block_bytes):
        h = sha256(key)
        h.update(view[start:start + block_bytes])
        key = h.digest()[:DIGEST_BYTES]
        out.append(key.hex())
    return tuple(out)


def prefix_key(payload: Mapping[str, Any], model: str, tenant: str, sharing: Sharing = "tenant",
               block_bytes: int = BLOCK_BYTES) -> PrefixKey | None:
    """The :class:`PrefixKey` of a request body, or None when it has no prompt (embeddings,
    a malformed body the engine will refuse)."""
    data = render_prompt(payload)
    if data is None:
        return None
    return PrefixKey(chain(data, salt_of(model, tenant, sharing), block_bytes), len(data))


def published_positions(blocks: int) -> list[int]:
    """Which of a prompt's ``blocks`` digests a node publishes: blocks 0, 1, 3, 7, 15, ...
    (``2**k - 1``) and the last. A peer that finds digest ``i`` knows the prefix ``0..i`` is
    held; the powers of two bound the digests per prompt by ``log2(blocks) + 2`` while the
    found length is at least half the true one, and the last one makes a conversation's next
    turn find the whole of its previous turn."""
    if blocks <= 0:
        return []
    out = []
    i = 1
    while i <= blocks:
        out.append(i - 1)
        i *= 2
    if out[-1] != blocks - 1:
        out.append(blocks - 1)
    return out


class PrefixIndex:
    """Which local backends served which prefixes recently, for one model.

    ``max_entries`` bounds the digests held (the memory budget, :data:`DEFAULT_INDEX_ENTRIES`);
    the least recently used digest goes first. Each digest remembers up to
    :data:`MAX_BACKENDS_PER_ENTRY` backends, the most recent last. ``recent`` keeps the digests
    to publish (:func:`published_positions` of each prompt served, the most recent last, at most
    ``max_published``) and ``version`` counts its changes, so a publisher sees whether anything
    changed.
    """

    def __init__(self, max_entries: int = DEFAULT_INDEX_ENTRIES, max_published: int = 64) -> None:
        self.max_entries = max_entries
        self.max_published = max_published
        self._entries: OrderedDict[str, tuple[str, ...]] = OrderedDict()
        self.recent: OrderedDict[str, None] = OrderedDict()
        self.version = 0
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._entries)

    def served(self, backend_id: str, key: PrefixKey) -> None:
        """``backend_id`` was given ``key``'s prompt: it holds its blocks now."""
        entries = self._entries
        # Block 0 last: it becomes the most recently used, so eviction takes a prefix's tail
        # before its head and a remembered digest i always has its digests 0..i-1.
        for d in reversed(key.digests):
            held = entries.pop(d, None)
            if held is None:
                entries[d] = (backend_id,)
            elif held[-1] == backend_id:
                entries[d] = held
            else:
                entries[d] = (*(b for b in held if b != backend_id), backend_id)[-MAX_BACKENDS_PER_ENTRY:]
        while len(entries) > self.max_entries:
            entries.popitem(last=False)
            self.evicted += 1
        recent = self.recent
        added = False
        for i in published_positions(len(key.digests)):
            d = key.digests[i]
            if d in recent:
                recent.move_to_end(d)
            else:
                recent[d] = None
                added = True
        while len(recent) > self.max_published:
            recent.popitem(last=False)
        if added:
            self.version += 1

    def hits(self, key: PrefixKey) -> dict[str, int]:
        """Blocks of ``key`` each backend holds (only backends with at least one): the longest
        run of leading digests it is remembered for."""
        out: dict[str, int] = {}
        alive: tuple[str, ...] = ()  # the backends holding every block so far
        entries = self._entries
        blocks = 0
        for d in key.digests:
            held = entries.get(d)
            if held is None:
                break
            if blocks == 0:
                alive = held
            elif held != alive:
                still = tuple(b for b in alive if b in held)
                for b in alive:
                    if b not in still:
                        out[b] = blocks
                alive = still
                if not alive:
                    break
            blocks += 1
        for b in alive:
            out[b] = blocks
        return out

    def forget(self, backend_ids: Iterable[str]) -> None:
        """Forget ``backend_ids`` (their engines restarted or were removed: the cache is gone)."""
        gone = set(backend_ids)
        for d in list(self._entries):
            held = tuple(b for b in self._entries[d] if b not in gone)
            if held:
                self._entries[d] = held
            else:
                del self._entries[d]


def peer_hit(key_hex: tuple[str, ...], published: frozenset[str]) -> int:
    """Blocks of a prefix a peer holds by its published digests: the last position whose
    digest it publishes, plus one (0: none)."""
    for i in range(len(key_hex) - 1, -1, -1):
        if key_hex[i] in published:
            return i + 1
    return 0


__all__ = ["BLOCK_BYTES", "BYTES_PER_TOKEN", "PrefixIndex", "PrefixKey", "chain", "peer_hit", "prefix_key",
           "published_positions", "render_prompt", "salt_of"]
