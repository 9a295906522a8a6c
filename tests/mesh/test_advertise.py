"""Which address a node advertises: never one its listener is not bound to."""

from __future__ import annotations

import pytest

from viiwork.mesh.discovery import pick_advertised_host


@pytest.mark.parametrize(
    ("listen", "advertise", "expected"),
    [
        ("127.0.0.1", None, None),            # loopback listener: peers elsewhere cannot reach it
        ("127.0.0.1", "127.0.0.1", "127.0.0.1"),  # explicit: tests on one host
        ("10.99.0.1", None, "10.99.0.1"),     # a specific listen address is the one to dial
        ("169.254.3.4", None, None),          # link-local is never advertised
        ("10.99.0.1", "mesh.example", "mesh.example"),
    ],
    ids=["loopback-listener", "explicit-loopback", "specific-address", "link-local", "explicit-name"],
)
def test_advertised_host(listen: str, advertise: str | None, expected: str | None) -> None:
    assert pick_advertised_host(listen, advertise, []) == expected


def test_wildcard_listener_never_advertises_wildcard_or_loopback() -> None:
    host = pick_advertised_host("0.0.0.0", None, [])
    assert host is None or not (host.startswith("127.") or host in ("0.0.0.0", "::") or host.startswith("169.254."))
