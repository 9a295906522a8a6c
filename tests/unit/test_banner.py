"""The ready banner (agent/banner.py): the curl it prints is one a user can run as shown."""

from __future__ import annotations

from viiwork.agent.banner import ready_lines
from viiwork.agent.config.schema import Config

MODEL = {"name": "m", "engine": "llamacpp", "path": "/dev/null"}


def test_with_keys_on_the_curl_sends_a_key_and_says_where_one_comes_from() -> None:
    """A newcomer copied the banner's curl on a keys-mode agent and got a 401: with keys on it
    carries the Bearer header and names `keys issue`; with keys off it has none."""
    keyed = ready_lines("127.0.0.1", 8086, Config.model_validate(
        {"auth": {"mode": "keys", "issuer_keys": "/etc/viiwork/issuer.pub"}, "models": [MODEL]}))
    assert 'Authorization: Bearer $KEY' in keyed and "keys issue" in keyed
    open_ = ready_lines("127.0.0.1", 8086, Config.model_validate({"models": [MODEL]}))
    assert "Authorization" not in open_ and "keys issue" not in open_
    assert "curl -s http://127.0.0.1:8086/v1/chat/completions" in open_
