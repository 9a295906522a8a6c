"""Per-key limits on one node (agent/auth/limits.py) and the [auth] section's cross-checks.

The limiter runs on an injected wall clock (windows are wall-clock minutes); the config
checks go through the real loader, as an operator's file would.
"""

from __future__ import annotations

import pytest

from viiwork.agent.auth.claims import KeyClaims
from viiwork.agent.auth.limits import Limiter, LimitExceeded, estimate_tokens, format_duration
from viiwork.agent.config.load import ConfigError, parse_config
from viiwork.agent.config.schema import auth_audience


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def key(jti: str = "k1", **limits: int) -> KeyClaims:
    return KeyClaims(iss="viiwork-issuer", aud=("node-a",), jti=jti, exp=2**40, tenant="acme", **limits)


def test_rpm_is_a_fixed_wall_clock_minute() -> None:
    clock = Clock(6000.0 + 10)  # 10 s into window 100
    limiter = Limiter(clock=clock)
    claims = key(rpm=2)
    first = limiter.admit(claims, 1)
    assert first.quota.headers()["x-ratelimit-remaining-requests"] == "1"
    assert first.quota.headers()["x-ratelimit-reset-requests"] == "50s"
    limiter.admit(claims, 1)
    with pytest.raises(LimitExceeded) as refused:
        limiter.admit(claims, 1)
    assert refused.value.limit == "requests" and refused.value.retry_after_s == 50
    assert refused.value.quota.headers()["x-ratelimit-remaining-requests"] == "0"
    assert limiter.refused["requests"] == 1
    clock.now = 6060.0  # the next window: counts start again
    limiter.admit(claims, 1)


def test_tpm_counts_the_estimate_then_the_real_usage() -> None:
    limiter = Limiter(clock=Clock(6000.0))
    claims = key(tpm=100)
    admitted = limiter.admit(claims, 80)
    with pytest.raises(LimitExceeded) as refused:
        limiter.admit(claims, 30)
    assert refused.value.limit == "tokens"
    limiter.finish(admitted, tokens_used=20)  # it used fewer than estimated: 80 tokens freed
    again = limiter.admit(claims, 30)
    assert again.quota.headers()["x-ratelimit-remaining-tokens"] == "50"


def test_concurrency_counts_requests_in_flight() -> None:
    limiter = Limiter(clock=Clock(6000.0))
    claims = key(concurrency=1)
    first = limiter.admit(claims, 1)
    with pytest.raises(LimitExceeded) as refused:
        limiter.admit(claims, 1)
    assert refused.value.limit == "concurrency" and refused.value.retry_after_s == 1
    limiter.finish(first)
    limiter.finish(first)  # once only: a second finish frees nothing more
    second = limiter.admit(claims, 1)
    with pytest.raises(LimitExceeded):
        limiter.admit(claims, 1)
    limiter.finish(second)


def test_a_key_without_limits_is_not_tracked_and_memory_is_bounded() -> None:
    limiter = Limiter(max_keys=2, clock=Clock(6000.0))
    for _ in range(100):
        limiter.admit(key("free"), 1)
    assert len(limiter) == 0
    busy = limiter.admit(key("busy", concurrency=5), 1)
    for i in range(10):
        limiter.finish(limiter.admit(key(f"k{i}", rpm=5), 1))
    assert len(limiter) == 2  # the cap; the key in flight is kept
    with pytest.raises(LimitExceeded):  # its in-flight count survived the evictions
        for _ in range(5):
            limiter.admit(key("busy", concurrency=5), 1)
    limiter.finish(busy)


def test_peers_usage_counts_here_and_is_not_reported_onward() -> None:
    clock = Clock(6000.0)
    limiter = Limiter(clock=clock)
    claims = key(rpm=10)
    limiter.admit(claims, 1)
    limiter.note_peer_usage("k1", 100, requests=9, tokens=0)
    with pytest.raises(LimitExceeded):
        limiter.admit(claims, 1)
    assert limiter.own_usage() == {"k1": (100, 1, 1)}
    limiter.note_peer_usage("k1", 99, requests=50, tokens=0)  # an old window: ignored
    clock.now = 6060.0
    limiter.admit(claims, 1)


def test_estimate_and_duration_formats() -> None:
    assert estimate_tokens({"messages": [{"role": "user", "content": "x" * 40}], "max_tokens": 10}) == 20
    assert estimate_tokens({"messages": [{"content": [{"type": "text", "text": "abcd"}]}]}) == 1
    assert estimate_tokens({"prompt": ["abcd", "efgh"], "max_completion_tokens": 5}) == 7
    assert estimate_tokens({"input": "a" * 9}) == 3
    assert estimate_tokens({"max_tokens": True}) == 1  # a boolean is not a count


def test_the_estimate_takes_the_first_bound_given_n_choices_and_token_ids() -> None:
    # A null max_tokens does not hide max_completion_tokens (issue 17 attack: estimated at 0).
    assert estimate_tokens({"max_tokens": None, "max_completion_tokens": 1000}) == 1000
    assert estimate_tokens({"max_tokens": 10, "max_completion_tokens": 1000}) == 10
    # n choices each may reach the bound.
    assert estimate_tokens({"prompt": "abcd", "max_tokens": 10, "n": 4}) == 41
    # A prompt of token ids: one token per id (a flat list, or a list of lists).
    assert estimate_tokens({"prompt": list(range(300)), "max_tokens": 1}) == 301
    assert estimate_tokens({"prompt": [[1, 2, 3], [4, 5]], "max_tokens": 1}) == 6
    # No bound: what the caller gives for an unbounded answer (all choices together), else none.
    assert estimate_tokens({"prompt": "abcd", "n": 3}, unbounded=60) == 61
    assert estimate_tokens({"prompt": "abcd"}) == 1
    assert [format_duration(s) for s in (0.012, 7.5, 60.0, 59.9996)] == ["12ms", "7.5s", "1m0s", "1m0s"]


BASE = '[node]\nname = "n1"\nstate_dir = "/var/lib/viiwork"\n'


def test_keys_in_an_open_mesh_needs_allow_open_mesh() -> None:
    mesh = '[mesh]\ntrust = "open"\nmesh_id = "lab"\n'
    with pytest.raises(ConfigError) as refused:
        parse_config(BASE + mesh + '[auth]\nmode = "keys"\n', "t.toml")
    assert "auth.mode" in str(refused.value) and "allow_open_mesh" in str(refused.value)
    config = parse_config(BASE + mesh + '[auth]\nmode = "keys"\nallow_open_mesh = true\n', "t.toml")
    assert auth_audience(config) == "lab"


def test_audience_defaults() -> None:
    assert parse_config(BASE, "t.toml").auth.mode == "none"  # absent section
    assert auth_audience(parse_config(BASE + '[auth]\nmode = "keys"\n', "t.toml")) == "n1"
    ca = '[mesh]\ntrust = "ca"\nca_certificate = "/etc/viiwork/mesh-ca.crt"\n'
    with pytest.raises(ConfigError) as refused:
        parse_config(BASE + ca + '[auth]\nmode = "keys"\n', "t.toml")
    assert "auth.audience" in str(refused.value)
    config = parse_config(BASE + ca + '[auth]\nmode = "keys"\naudience = "fleet"\n', "t.toml")
    assert auth_audience(config) == "fleet"
