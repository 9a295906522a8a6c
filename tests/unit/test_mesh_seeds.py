"""Which seeds a node dials, and when: the membership core's candidate selection and
per-address backoff (viiwork.mesh.candidates, docs/mesh.md "Seeds"), in virtual time.

No sockets: the core is fed an injected clock (tests/support/mesh_crypto.py ManualClock) and
told how each dial ended, as the transport does. The same rules with real processes and real
dead addresses: tests/mesh/test_dead_seeds.py. At the end, a named seed's lookup
(viiwork.mesh.lookups), with a lookup function standing for the DNS server.
"""

from __future__ import annotations

import random

import pytest

from support.mesh_crypto import ManualClock, TestCA, core, exchange
from viiwork.mesh.candidates import DROPPED_REPLY, Candidate, backoff_ms, unreachable_line
from viiwork.mesh.membership import GossipSettings

SETTINGS = GossipSettings(scale_with_size=False, probe_dead_per_round=0.0)
DEAD = [f"127.0.0.{i}:9" for i in range(2, 202)]  # 200 addresses that never answer


@pytest.fixture
def ca():
    return TestCA()


@pytest.fixture
def clock():
    return ManualClock()


def seeded(ca, clock, addresses, settings=SETTINGS, name="a"):
    m, pub = core(ca.node(name), ca, clock, settings=settings)
    for address in addresses:
        m.add_candidate(address, source="seed")
    return m, pub


def fail_all(m, targets, error="connection refused"):
    for t in targets:
        m.note_dial(t.address, error)


def test_backoff_doubles_from_min_to_max_with_jitter_below_each_step():
    rng = random.Random(1)
    assert backoff_ms(0, 1000, 60_000, rng) == 0.0
    for failures in range(1, 12):
        d = min(60_000, 1000 * 2 ** (failures - 1))
        waits = [backoff_ms(failures, 1000, 60_000, rng) for _ in range(200)]
        assert all(d / 2 <= w <= d for w in waits), failures
        assert max(waits) - min(waits) > d / 4  # jittered, not one value
    assert backoff_ms(10_000, 1000, 60_000, rng) <= 60_000  # no overflow for huge counts


def test_first_round_without_a_live_peer_dials_every_seed_at_once(ca, clock):
    live, _ = core(ca.node("live"), ca, clock)
    m, _ = seeded(ca, clock, [*DEAD, "live:8087"])  # the live seed listed last
    targets = m.select_targets()
    assert len(targets) == 201 and all(t.candidate and t.node_id is None for t in targets)
    assert {t.address for t in targets} == {*DEAD, "live:8087"}
    assert [t.address for t in targets] != [*DEAD, "live:8087"]  # random order, not the configured one
    # The live one answers in this same round: the node has a peer.
    exchange(m, live, "live:8087")
    assert live.node_id in m.records
    assert m.candidates["live:8087"].node_id == live.node_id


def test_dials_in_flight_are_not_repeated_and_failures_back_off(ca, clock):
    m, _ = seeded(ca, clock, DEAD[:10])
    first = m.select_targets()
    assert len(first) == 10
    in_flight = {t.address for t in first}
    clock.advance(5_000)  # past any first backoff, but still dialing (a silent address)
    assert m.select_targets(dialing=in_flight) == []
    fail_all(m, first)
    assert m.select_targets() == []  # each failure restarts its backoff from now: 0.5-1 s
    clock.advance(1_000)
    second = m.select_targets()
    assert {t.address for t in second} == in_flight
    fail_all(m, second)
    clock.advance(900)  # the second backoff is 1-2 s
    assert m.select_targets() == []
    clock.advance(1_100)
    assert len(m.select_targets()) == 10


def test_backoff_grows_to_the_cap_and_dead_seeds_cost_few_dials(ca, clock):
    m, _ = seeded(ca, clock, DEAD)
    dials = 0
    for _ in range(1200):  # 10 minutes of 500 ms rounds, every dial refused at once
        targets = m.select_targets()
        dials += len(targets)
        fail_all(m, targets)
        clock.advance(500)
    c = m.candidates[DEAD[0]]
    assert c.failures == c.attempts and 12 <= c.attempts <= 30
    assert c.next_try_at - clock() <= 60_000
    # Once backed off to the cap: each dead seed every 30-60 s, about 4-5 dials a second for 200.
    assert dials < 200 * 30
    views = m.candidate_views("seed")
    assert {v.last_error for v in views} == {"connection refused"} and not any(v.answered for v in views)


def test_an_answer_resets_the_backoff(ca, clock):
    other, other_pub = core(ca.node("other"), ca, clock)
    m, _ = seeded(ca, clock, ["other:8087"])
    for _ in range(6):  # the peer is down for a while: six refused dials, backed off
        targets = m.select_targets()
        fail_all(m, targets)
        clock.advance(40_000)
    cand = m.candidates["other:8087"]
    assert cand.failures == 6
    (target,) = m.select_targets()
    exchange(m, other, "other:8087")  # it is up again and answers
    m.note_dial(target.address, None)
    assert cand.failures == 0 and cand.last_error is None and cand.answered_at is not None
    assert m.candidate_views()[0].answered and m.candidate_views()[0].retry_in_ms == 0
    # It goes silent past dead_after_ms: the seed is due at once (no leftover backoff)...
    clock.advance(11_000)
    (again,) = m.select_targets()
    assert again.address == "other:8087" and again.candidate
    # ...and a failure then starts again from the shortest backoff (0.5-1 s).
    m.note_dial(again.address, "timed out")
    clock.advance(1_000)
    assert [t.address for t in m.select_targets()] == ["other:8087"]


def test_a_live_peer_leaves_seeds_only_free_places_and_only_due_ones(ca, clock):
    peer, peer_pub = core(ca.node("peer"), ca, clock)
    m, _ = seeded(ca, clock, DEAD)
    fail_all(m, m.select_targets())
    exchange(m, peer, "peer:8087")  # found through another way (mDNS, another seed)
    clock.advance(2_000)
    peer_pub.maybe_publish(force=True)
    exchange(m, peer, "peer:8087")
    targets = m.select_targets()
    assert sum(not t.candidate for t in targets) == 1
    assert sum(t.candidate for t in targets) == SETTINGS.fanout - 1  # the free places, not all 200
    fresh, _ = seeded(ca, clock, DEAD[:5], name="fresh")
    fail_all(fresh, fresh.select_targets())
    exchange(fresh, peer, "peer:8087")
    assert [t for t in fresh.select_targets() if t.candidate] == []  # none due yet


def test_an_exchange_whose_reply_is_dropped_counts_as_a_failure(ca, clock):
    m, _ = seeded(ca, clock, ["x:8087"])
    (target,) = m.select_targets()
    m.note_dial(target.address, None)  # completed, but no reply was accepted (another mesh)
    cand = m.candidates["x:8087"]
    assert cand.last_error == DROPPED_REPLY and cand.failures == 1 and cand.answered_at is None
    assert not m.candidate_views()[0].answered


def test_rediscovery_keeps_the_history_but_an_mdns_announcement_makes_it_due(ca, clock):
    m, _ = seeded(ca, clock, ["x:8087"])
    fail_all(m, m.select_targets())
    m.add_candidate("x:8087", source="seed")
    assert m.candidates["x:8087"].attempts == 1 and m.select_targets() == []
    m.add_candidate("x:8087", source="mdns")
    assert [t.address for t in m.select_targets()] == ["x:8087"]
    m.remove_candidate("x:8087")
    assert m.candidate_views() == []


def test_candidate_views_and_their_documents(ca, clock):
    m, _ = seeded(ca, clock, ["s1:8087", "s2:8087"])
    m.add_candidate("found:8087", source="mdns")
    targets = m.select_targets()
    m.note_dial("s1:8087", "connection refused")
    assert len(targets) == 3
    docs = [v.doc() for v in m.candidate_views("seed")]
    assert [d["address"] for d in docs] == ["s1:8087", "s2:8087"]  # configured order, seeds only
    assert set(docs[0]) == {"address", "node_id", "attempts", "failures", "answered", "last_error", "retry_in_ms"}
    assert docs[0]["attempts"] == 1 and docs[0]["last_error"] == "connection refused" and not docs[0]["answered"]
    assert 500 <= docs[0]["retry_in_ms"] <= 1000
    assert docs[1]["last_error"] is None  # still dialing


def test_the_unreachable_line_counts_and_names_a_few():
    c = Candidate(node_id=None, source="seed")
    c.dialed(0.0, 1000.0)
    c.failed(10.0, "connection refused", 1000.0)
    views = [c.view(f"10.0.0.{i}:8087", 20.0) for i in range(1, 201)]
    line = unreachable_line(views, 201, 1000, 60_000)
    assert line is not None
    assert line.startswith("mesh: 200 of 201 seeds did not answer: 10.0.0.1:8087 (connection refused), ")
    assert "and 197 more" in line and "1 s doubling to 60 s" in line and "10.0.0.4:8087" not in line
    assert unreachable_line([], 3, 1000, 60_000) is None


def test_backoff_settings_are_checked():
    with pytest.raises(ValueError, match="seed_backoff"):
        GossipSettings(seed_backoff_min_ms=5000, seed_backoff_max_ms=1000)
    with pytest.raises(ValueError, match="seed_backoff"):
        GossipSettings(seed_backoff_min_ms=0)


def test_a_seed_whose_name_does_not_resolve_says_so() -> None:
    """A seed's host name that does not resolve reads as a failed name lookup in the WARNING,
    /v1/mesh and the doctor (it read "unknown error -2": a lookup's errno is not an OS error's)."""
    import socket

    from viiwork.mesh.transport import _fault

    text = _fault(socket.gaierror(socket.EAI_NONAME, "Name or service not known"))
    assert text == "name lookup failed: name or service not known"
    assert _fault(ConnectionRefusedError(111, "Connection refused")) == "connection refused"


async def test_hanging_name_lookups_leave_the_default_executor_free() -> None:
    """Seeds whose names hang (a DNS server that does not answer: the lookup function stands
    for it) hold only the mesh's own lookup threads (viiwork.mesh.lookups): the loop's
    default executor, which asyncio.to_thread shares with GPU reads and state-dir writes,
    stays free (before: 200 such seeds held it for tens of seconds). Each dial fails at its
    deadline as "name lookup timed out"; a name whose lookup still hangs is not looked up
    again beside it."""
    import asyncio
    import threading
    import time

    from viiwork.mesh.lookups import MeshResolver, NameLookupTimeout

    answer = threading.Event()
    started: list[str] = []

    def slow_dns(host: str, port: int, **_: object) -> list:
        started.append(host)
        answer.wait(10)
        return []

    resolver = MeshResolver(timeout_s=0.5, lookup=slow_dns)
    try:
        lookups = [asyncio.ensure_future(resolver.resolve(f"nohost-{i}.invalid", 8087)) for i in range(50)]
        await asyncio.sleep(0.05)
        sent = time.monotonic()
        assert await asyncio.wait_for(asyncio.to_thread(lambda: 1), 0.1) == 1
        print(f"\nthe default executor answered in {(time.monotonic() - sent) * 1000:.1f} ms while 50 lookups hang")
        results = await asyncio.wait_for(asyncio.gather(*lookups, return_exceptions=True), 2.0)
        assert all(isinstance(r, NameLookupTimeout) for r in results), results[:3]
        assert str(results[0]) == "name lookup of nohost-0.invalid timed out after 0.5 s"
        assert len(started) == 50
        with pytest.raises(NameLookupTimeout):  # its first lookup still hangs: waited on, not repeated
            await resolver.resolve("nohost-0.invalid", 8087)
        assert len(started) == 50
    finally:
        answer.set()


async def test_a_lookup_that_never_got_a_thread_never_runs() -> None:
    """A lookup still waiting for one of the bounded threads when its callers give up is
    dropped, and the threads end with their lookups (none kept idle)."""
    import asyncio
    import threading

    from viiwork.mesh.lookups import LookupThreads, MeshResolver, NameLookupTimeout

    answer = threading.Event()
    started: list[str] = []

    def slow_dns(host: str, port: int, **_: object) -> list:
        started.append(host)
        answer.wait(10)
        return []

    threads = LookupThreads(2)
    resolver = MeshResolver(timeout_s=0.3, lookup=slow_dns, threads=threads)
    try:
        results = await asyncio.gather(*(resolver.resolve(f"n{i}.invalid", 1) for i in range(10)),
                                       return_exceptions=True)
        assert all(isinstance(r, NameLookupTimeout) for r in results)
        assert len(started) == 2 and threads.running == 2
    finally:
        answer.set()
    for _ in range(100):
        if threads.running == 0:
            break
        await asyncio.sleep(0.01)
    assert len(started) == 2 and threads.running == 0
    assert await MeshResolver(threads=threads).resolve("127.0.0.1", 80)  # a thread again when needed


async def test_a_lookups_failure_reads_as_its_own_text_through_aiohttp() -> None:
    """What a dial of a named seed reports (``last_error``, the WARNING): the lookup's own
    error through aiohttp's connector, its deadline as "name lookup timed out" (not "timed
    out", the exchange's); a name that resolves gets the addresses aiohttp's own resolver gives."""
    import asyncio
    import socket
    import time

    import aiohttp

    from viiwork.mesh.dialing import PeerConnector
    from viiwork.mesh.lookups import MeshResolver
    from viiwork.mesh.transport import _fault

    def no_such_name(host: str, port: int, **_: object) -> list:
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    def hangs(host: str, port: int, **_: object) -> list:
        time.sleep(0.5)
        return []

    for lookup, want in ((no_such_name, "name lookup failed: name or service not known"),
                         (hangs, "name lookup timed out")):
        connector = PeerConnector(resolver=MeshResolver(timeout_s=0.2, lookup=lookup))
        async with aiohttp.ClientSession(connector=connector) as http:
            try:
                async with http.get("http://seed.example:9/", timeout=aiohttp.ClientTimeout(total=2)):
                    raise AssertionError("answered")
            except aiohttp.ClientError as exc:
                assert _fault(exc) == want, exc
    connector = PeerConnector()  # the mesh's resolver by default, with its 2 s deadline
    assert isinstance(connector._resolver, MeshResolver) and connector._resolver.timeout_s == 2.0
    await connector.close()
    ours = await MeshResolver().resolve("localhost", 8087)
    theirs = await aiohttp.ThreadedResolver(asyncio.get_running_loop()).resolve("localhost", 8087)
    assert ours == theirs and ours and ours[0]["port"] == 8087
