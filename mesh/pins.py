"""Open-mode name pins: the first node id seen with a node name keeps that name.

Stored in ``<state_dir>/known_nodes.json`` as ``{"version": 1, "pins": {name: node_id}}``
(mode 0600, written atomically by :meth:`PinStore.save` when something changed). A node
whose state dir was wiped comes back with a new key and therefore a new id: its peers
refuse it by name until the operator deletes that name's line on each of them (or
``viiworkctl mesh forget NAME`` does). The store is bounded (``max_pins``); past the bound
new names are accepted without being pinned, and that is logged once.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from viiwork.mesh.identity import is_node_id, write_private_file

log = logging.getLogger(__name__)

PINS_FILE = "known_nodes.json"


class NameConflict(Exception):
    """A node name is pinned to another node id (open mode)."""

    def __init__(self, name: str, pinned: str, presented: str):
        super().__init__(
            f"node name {name!r} is pinned to node {pinned}, but node {presented} presents it; if the node "
            f"was reinstalled, remove {name!r} from {PINS_FILE} in the state dir (or `viiworkctl mesh forget {name}`)"
        )
        self.name, self.pinned, self.presented = name, pinned, presented


class PinStore:
    """Name -> node id pins, in memory, persisted on :meth:`save` (see module doc)."""

    def __init__(self, path: Path | None = None, max_pins: int = 10_000):
        self.path = Path(path) if path is not None else None
        self.max_pins = max_pins
        self.pins: dict[str, str] = {}
        self.dirty = False
        self._full_logged = False
        if self.path is not None and self.path.exists():
            self._load()

    def _load(self) -> None:
        assert self.path is not None
        try:
            data = json.loads(self.path.read_text())
            pins = data["pins"]
            if not isinstance(pins, dict):
                raise ValueError("pins is not an object")
            self.pins = {str(k): str(v) for k, v in pins.items() if is_node_id(v)}
        except (OSError, ValueError, KeyError, TypeError) as exc:
            # Refusing to start over a corrupt pin file would lock the operator out; starting
            # empty loses the pins, which is what deleting the file would do. Say so loudly.
            log.warning("ignoring unreadable pin store %s (%s): names will be pinned afresh", self.path, exc)
            self.pins = {}

    def check_and_pin(self, name: str, node_id: str) -> None:
        """Raise NameConflict when ``name`` is pinned to another id; pin it when new."""
        pinned = self.pins.get(name)
        if pinned is None:
            if len(self.pins) >= self.max_pins:
                if not self._full_logged:
                    log.warning("pin store full (%d names): new names are not pinned", self.max_pins)
                    self._full_logged = True
                return
            self.pins[name] = node_id
            self.dirty = True
        elif pinned != node_id:
            raise NameConflict(name, pinned, node_id)

    def forget(self, name: str) -> bool:
        """Remove a pin; True when it existed."""
        if self.pins.pop(name, None) is None:
            return False
        self.dirty = True
        return True

    def save(self) -> None:
        """Write the pins when they changed (atomic, 0600)."""
        if self.path is None or not self.dirty:
            return
        body = json.dumps({"version": 1, "pins": self.pins}, indent=1, sort_keys=True).encode() + b"\n"
        write_private_file(self.path, body)
        self.dirty = False
