"""The pure parts of mesh-wide limits (agent/peering/usage_share.py): the report's format and
the receiving book, fed to a real Limiter on an injected wall clock. The exchange between real
agents is tests/mesh/test_mesh_limits.py's."""

from __future__ import annotations

import pytest

from viiwork.agent.auth.claims import KeyClaims
from viiwork.agent.auth.limits import Limiter, LimitExceeded
from viiwork.agent.peering.usage_share import (
    MAX_KEYS_PER_REPORT,
    KeyUsage,
    PeerUsageBook,
    UsageReport,
    UsageReportError,
)
from viiwork.mesh.identity import NodeId

SELF, P1, P2 = NodeId("self"), NodeId("peer-1"), NodeId("peer-2")
MEMBERS = frozenset({P1, P2})  # the mesh's live members as this node sees them
EPOCH = "0123456789abcdef"
WINDOW = 100  # seconds 6000..6059


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def report(seq: int, *usage: tuple[str, int, int], window: int = WINDOW, epoch: str = EPOCH) -> UsageReport:
    return UsageReport(epoch, seq, window, tuple(KeyUsage(*u) for u in usage))


def test_report_round_trips_through_its_json() -> None:
    sent = report(7, ("k1", 3, 120), ("k2", 0, 9))
    assert UsageReport.parse(sent.doc()) == sent


@pytest.mark.parametrize(("doc", "reason", "names"), [
    ([], "malformed", "JSON object"),
    ({"epoch": "x", "seq": 1, "window": 1, "usage": []}, "malformed", "report.epoch"),
    ({"epoch": EPOCH, "seq": "1", "window": 1, "usage": []}, "malformed", "report.seq"),
    ({"epoch": EPOCH, "seq": 1, "window": -1, "usage": []}, "malformed", "report.window"),
    ({"epoch": EPOCH, "seq": 1, "window": 1}, "malformed", "report.usage"),
    ({"epoch": EPOCH, "seq": 1, "window": 1, "usage": [["k", 1, False]]}, "malformed", "report.usage[0]"),
    ({"epoch": EPOCH, "seq": 1, "window": 1, "usage": [["k", 1, 1], ["k", 1, 1]]}, "malformed", "again"),
    ({"epoch": EPOCH, "seq": 1, "window": 1, "usage": [[f"k{i}", 1, 1] for i in range(MAX_KEYS_PER_REPORT + 1)]},
     "too_many_keys", str(MAX_KEYS_PER_REPORT)),
], ids=["not-object", "epoch", "seq-string", "window-negative", "usage-missing", "count-bool", "key-twice",
        "too-many-keys"])
def test_malformed_reports_are_refused_with_their_reason(doc: object, reason: str, names: str) -> None:
    with pytest.raises(UsageReportError) as refused:
        UsageReport.parse(doc)
    assert refused.value.reason == reason and names in str(refused.value)


def test_a_report_replaces_its_senders_figures_and_peers_add_up() -> None:
    book = PeerUsageBook(SELF, max_keys_per_sender=10)
    assert book.accept(P1, report(1, ("k", 4, 40)), WINDOW, MEMBERS) == ([KeyUsage("k", 4, 40)], 0)
    assert book.accept(P1, report(2, ("k", 5, 30)), WINDOW, MEMBERS) == ([KeyUsage("k", 5, 30)], 0)  # replaced
    assert book.accept(P2, report(1, ("k", 2, 7)), WINDOW, MEMBERS) == ([KeyUsage("k", 7, 37)], 0)  # summed over peers
    assert book.peers() == 2 and len(book) == 1


@pytest.mark.parametrize(("sender", "sent", "reason"), [
    (SELF, report(1, ("k", 1, 1)), "self"),
    (P1, report(9, ("k", 1, 1), window=WINDOW - 1), "window"),
    (P1, report(9, ("k", 1, 1), window=WINDOW + 1), "window"),
    (P1, report(3, ("k", 0, 0)), "stale"),
    (P1, report(2, ("k", 0, 0)), "stale"),
    (NodeId("stranger"), report(9, ("k", 1, 1)), "not_member"),
], ids=["own-report", "previous-window", "next-window", "older", "same-seq", "not-a-member"])
def test_reports_that_would_change_nothing_right_are_refused(sender: NodeId, sent: UsageReport, reason: str) -> None:
    book = PeerUsageBook(SELF, max_keys_per_sender=10)
    book.accept(P1, report(3, ("k", 4, 40)), WINDOW, MEMBERS)
    with pytest.raises(UsageReportError) as refused:
        book.accept(sender, sent, WINDOW, MEMBERS)
    assert refused.value.reason == reason
    assert book.accept(P2, report(1, ("k", 0, 0)), WINDOW, MEMBERS)[0] == [KeyUsage("k", 4, 40)]  # P1's 4 still there


def test_a_restarted_sender_starts_a_new_sequence() -> None:
    book = PeerUsageBook(SELF, max_keys_per_sender=10)
    book.accept(P1, report(50, ("k", 4, 40)), WINDOW, MEMBERS)
    assert book.accept(P1, report(1, ("k", 1, 10), epoch="fedcba9876543210"), WINDOW, MEMBERS)[0] == [KeyUsage("k", 1, 10)]


def test_each_sender_fills_only_its_own_part_and_a_new_window_starts_from_nothing() -> None:
    book = PeerUsageBook(SELF, max_keys_per_sender=2)
    sums, left_out = book.accept(P1, report(1, ("a", 1, 1), ("b", 1, 1), ("c", 1, 1)), WINDOW, MEMBERS)
    assert [u.jti for u in sums] == ["a", "b"] and left_out == 1  # "c": P1's part is full
    sums, left_out = book.accept(P2, report(1, ("c", 1, 1), ("d", 1, 1)), WINDOW, MEMBERS)
    assert sums == [KeyUsage("c", 1, 1), KeyUsage("d", 1, 1)] and left_out == 0  # P1 took none of P2's part
    sums, left_out = book.accept(P1, report(2, ("a", 3, 3), ("e", 1, 1)), WINDOW, MEMBERS)
    assert sums == [KeyUsage("a", 3, 3)] and left_out == 1  # its own keys still update; a third is left out
    assert book.senders[P1]["keys_full"] == 2 and book.senders[P1]["keys"] == 2 and book.senders[P2]["keys"] == 2
    sums, left_out = book.accept(P2, report(2, ("e", 1, 1), window=WINDOW + 1), WINDOW + 1, MEMBERS)
    assert sums == [KeyUsage("e", 1, 1)] and left_out == 0 and len(book) == 1


def test_a_sender_that_is_not_a_live_member_is_refused() -> None:
    """A certificate of the mesh's CA alone does not make a member: a probe with no agent
    behind it, or a node the mesh has declared dead, adds nothing."""
    book = PeerUsageBook(SELF, max_keys_per_sender=10)
    stranger = NodeId("stranger")
    with pytest.raises(UsageReportError) as refused:
        book.accept(stranger, report(1, ("k", 5, 5)), WINDOW, MEMBERS)
    assert refused.value.reason == "not_member" and len(book) == 0 and stranger not in book.senders
    assert book.accept(stranger, report(2, ("k", 5, 5)), WINDOW, MEMBERS | {stranger})[0] == [KeyUsage("k", 5, 5)]


def test_peers_figures_never_evict_this_nodes_own_counts() -> None:
    """The t3 flood, in small: a member names many made-up keys; the real key keeps its count
    (before, the least recently used own state was dropped, which reset its rpm)."""
    clock = Clock(WINDOW * 60 + 5)
    limiter = Limiter(max_keys=4, clock=clock)
    claims = KeyClaims(iss="viiwork-issuer", aud=("m",), jti="real", exp=2**40, tenant="acme", rpm=3)
    for _ in range(3):
        limiter.finish(limiter.admit(claims, 1))  # ended: nothing in flight holds its state
    kept = [limiter.note_peer_usage(f"bogus-{i}", WINDOW, 0, 0) for i in range(100)]
    assert kept.count(True) == 4  # made-up keys: at most max_keys of them, the rest left out
    with pytest.raises(LimitExceeded):
        limiter.admit(claims, 1)
    assert limiter.own_usage() == {"real": (WINDOW, 3, 3)}
    # A key with own traffic still takes its peers' figures once the table of unseen keys is full.
    assert limiter.note_peer_usage("real", WINDOW, 1, 1) and limiter.usage_of("real") == (3, 3, 1, 1)


def test_an_over_report_counts_at_most_the_keys_limit() -> None:
    """A member may exhaust a key by over-reporting (docs/security.md, "A hostile member"); what
    it reports beyond the key's limit says nothing more."""
    limiter = Limiter(clock=Clock(WINDOW * 60 + 5))
    claims = KeyClaims(iss="viiwork-issuer", aud=("m",), jti="k", exp=2**40, tenant="acme", rpm=5, tpm=50)
    limiter.note_peer_usage("k", WINDOW, 10**12, 10**12)
    with pytest.raises(LimitExceeded) as refused:
        limiter.admit(claims, 1)
    quota = refused.value.quota
    assert (quota.remaining_requests, quota.remaining_tokens) == (0, 0)


def test_peer_sums_hold_the_limit_and_own_usage_never_includes_them() -> None:
    clock = Clock(WINDOW * 60 + 5)
    limiter = Limiter(clock=clock)
    changes: list[None] = []
    limiter.listeners.append(lambda: changes.append(None))
    claims = KeyClaims(iss="viiwork-issuer", aud=("m",), jti="k", exp=2**40, tenant="acme", rpm=5)
    book = PeerUsageBook(SELF, max_keys_per_sender=10)
    for peer, count in ((P1, 2), (P2, 1)):
        for usage in book.accept(peer, report(1, ("k", count, 0)), limiter.current_window(), MEMBERS)[0]:
            limiter.note_peer_usage(usage.jti, WINDOW, usage.requests, usage.tokens)
    limiter.admit(claims, 1)
    admitted = limiter.admit(claims, 1)
    assert admitted.quota.remaining_requests == 0 and len(changes) == 2
    with pytest.raises(LimitExceeded):
        limiter.admit(claims, 1)
    assert limiter.own_usage() == {"k": (WINDOW, 2, 2)}  # what this node admitted, not its peers' 3
    limiter.finish(admitted, tokens_used=7)  # a real count: this node's figures changed again
    assert limiter.own_usage() == {"k": (WINDOW, 2, 8)} and len(changes) == 3
