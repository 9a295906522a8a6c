"""Requests to a gang's head while the gang is lost to a frozen worker (docs/mesh.md, "No half-gangs").

Two real agents on loopback with the systemd runner on one real ``systemd --user``, as in
tests/systemd/test_gang_adoption_real.py (a real ``rpc-server`` on the worker, a real
``llama-server --rpc`` on the head). The worker's agent is frozen (SIGSTOP) until the head
holds it ``dead``: the gang is lost, its backend leaves service at once, and its engine and
parts are stopped in the background (agent/gang/head.py ``GangHandle``). A request sent once
the loss is known is answered 503 with Retry-After, never sent to the engine being stopped
(it was: while the engine's stop took up to a second, a request was sent to it and got a
502, hundreds of them when its slot was free).
"""

from __future__ import annotations

import threading
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest
import requests
from systemd.test_gang_adoption_real import BODY, complete, entry, frozen, snapshot, start_pair, wait_log

from support.systemd import UserManager

pytestmark = [pytest.mark.systemd, pytest.mark.engine, pytest.mark.timeout(420)]

__all__ = ["entry"]  # the fixture, shared


def test_requests_while_a_gang_is_lost_never_hang_nor_reach_the_stopped_engine(
        systemd_user: UserManager, tmp_path: Path, entry: dict[str, Any]) -> None:
    """Requests sent one after another while the worker's agent is frozen until the gang is
    lost: each is answered 200 or 503 (with Retry-After), or 502 only when it was sent before
    the head logged the loss; none takes longer than the queue's timeout plus a margin."""
    with ExitStack() as stack:
        worker, head = start_pair(stack, tmp_path, entry, systemd_user, {"stop_timeout_s": 5})
        first = snapshot(head, worker)
        complete(head.url)
        results: list[tuple[float, float, int, str]] = []
        halt = threading.Event()

        def hammer() -> None:
            while not halt.is_set():
                began = time.monotonic()
                try:
                    r = requests.post(f"{head.url}/v1/completions", json={**BODY, "max_tokens": 4}, timeout=60)
                    code, retry = r.status_code, r.headers.get("Retry-After", "")
                except requests.RequestException as exc:
                    code, retry = -1, repr(exc)
                results.append((began, time.monotonic(), code, retry))

        threads = [threading.Thread(target=hammer) for _ in range(2)]
        for t in threads:
            t.start()
        try:
            with frozen(worker.proc.pid):
                deadline = time.monotonic() + 30
                while "stopping the gang" not in head.log_text():
                    assert time.monotonic() < deadline
                    time.sleep(0.02)
                lost_at = time.monotonic()
                wait_log(head, f"engine unit {first['engine'][0]} (pid {first['engine'][1]}) ended", 30)
                time.sleep(4)
        finally:
            halt.set()
            for t in threads:
                t.join(90)
        late = [(round(b - lost_at, 2), round(e - b, 2), c, r) for b, e, c, r in results if b > lost_at]
        # A request sent as the loss is logged may still reach the engine before its backend
        # leaves service, and be cut when it stops: one per client at most.
        cut = [x for x in late if x[2] == 502]
        bad = [x for x in late if x[2] not in (200, 502, 503) or (x[2] == 503 and not x[3])]
        slow = [(round(b - lost_at, 2), round(e - b, 2), c) for b, e, c, _ in results if e - b > 25]
        assert len(cut) <= len(threads), f"requests sent after the loss was known got a 502: {cut[:20]}"
        assert not bad, f"requests sent after the loss answered badly: {bad}"
        assert not slow, f"requests that hung: {slow}"
        assert any(x[2] == 503 for x in late), "no request was refused while the gang was lost"
        # Whether a request reaches the engine being stopped depends on its slot being free
        # then; the order does not: the backend left service before the engine was stopped.
        text = head.log_text()
        left = text.index("backend smol-0 unhealthy: exited: gang: part lost")
        ended = text.index(f"engine unit {first['engine'][0]} (pid {first['engine'][1]}) ended")
        assert left < ended, "the lost gang's backend stayed in service until its engine was stopped"
