"""Boot generations: the first half of the (generation, seq) pair that orders a node's summaries.

Every start of the agent takes ``generation = previous + 1`` from ``<state_dir>/boot.json``
(written atomically, mode 0600) before its first publication, so a restarted node's
summaries are newer than every summary of its previous run, whatever their seq: peers
accept them at once (docs/architecture.md, rule 7: generations and sequence numbers, never timestamps).

If the file is lost while the key survives (a restored backup, a hand-cleaned dir), the
node restarts at a generation its peers may already have seen. The membership core heals
that by itself: a node that receives a genuine summary of its own (signed by its own key)
with a (generation, seq) at or above its current one jumps past it and republishes, and
stores the new generation (see ``Membership`` and ``LocalPublisher``).

The ``nonce`` (8 random bytes, hex) names the boot for people and logs; it plays no part in
ordering.
"""

from __future__ import annotations

import json
import logging
import secrets
from dataclasses import dataclass
from pathlib import Path

from viiwork.mesh.identity import ensure_state_dir, write_private_file

log = logging.getLogger(__name__)

BOOT_FILE = "boot.json"
MAX_GENERATION = 2**53  # JSON-safe integer bound, also enforced by the summary decoder


@dataclass(frozen=True)
class Boot:
    """One run of a node: ``generation`` (>= 1, increases every start) and ``nonce`` (16 hex)."""

    generation: int
    nonce: str


def new_nonce() -> str:
    return secrets.token_hex(8)


def read_generation(state_dir: Path) -> int:
    """The generation stored in ``<state_dir>/boot.json``, 0 when missing or unreadable."""
    path = Path(state_dir) / BOOT_FILE
    try:
        data = json.loads(path.read_text())
        generation = data["generation"]
        if not isinstance(generation, int) or isinstance(generation, bool) or not 0 <= generation < MAX_GENERATION:
            raise ValueError(f"generation {generation!r} out of range")
        return generation
    except FileNotFoundError:
        return 0
    except (ValueError, KeyError, TypeError, OSError) as exc:
        log.warning("ignoring unreadable %s (%s); the mesh corrects the generation if peers saw a higher one", path, exc)
        return 0


def store_generation(state_dir: Path, generation: int) -> None:
    """Persist ``generation`` (atomic write, fsync, mode 0600)."""
    write_private_file(Path(state_dir) / BOOT_FILE, json.dumps({"generation": generation}).encode() + b"\n")


def next_boot(state_dir: Path) -> Boot:
    """Start a new boot: read the stored generation, add one, store it, return the Boot."""
    state_dir = ensure_state_dir(Path(state_dir))
    generation = read_generation(state_dir) + 1
    store_generation(state_dir, generation)
    return Boot(generation=generation, nonce=new_nonce())
