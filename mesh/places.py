"""Places held per source address: how many connections (or handshakes) are open in all and
from each address, for listeners that cap both (mesh/transport.py, agent/serving/api_listener.py).
Counting only: each listener compares with its own caps and decides."""

from __future__ import annotations


class AddressPlaces:
    """``open`` places in all and ``held_by(address)`` per source address; ``take`` and
    ``give_back`` move one. An address holding none is forgotten, so the map stays as large
    as the number of addresses holding a place."""

    def __init__(self) -> None:
        self.open = 0
        self._by_address: dict[str, int] = {}

    def held_by(self, address: str) -> int:
        return self._by_address.get(address, 0)

    def take(self, address: str) -> None:
        self.open += 1
        self._by_address[address] = self._by_address.get(address, 0) + 1

    def give_back(self, address: str) -> None:
        self.open -= 1
        left = self._by_address.get(address, 1) - 1
        if left > 0:
            self._by_address[address] = left
        else:
            self._by_address.pop(address, None)
