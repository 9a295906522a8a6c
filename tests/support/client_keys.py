"""Client keys for tests: the real ``viiworkctl keys`` of this checkout, and plain HTTP calls."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

AUD = "node-a"  # a standalone node's audience: its name (support.agent's default node)


def chat(model: str = "m", **extra: object) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], **extra}


def ctl(*args: str) -> str:
    """``viiworkctl`` from this checkout; its stdout."""
    done = subprocess.run([sys.executable, "-m", "viiwork.agent.cli", *args], capture_output=True, text=True,
                          timeout=30)
    assert done.returncode == 0, done.stderr
    return done.stdout


def issue(key: Path, *args: str, tenant: str = "acme", audience: str = AUD) -> str:
    return ctl("keys", "issue", "--issuer-key", str(key), "--tenant", tenant, "--audience", audience,
               *args).strip()


def jti_of(token: str) -> str:
    payload = token.split(".")[1]
    return json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))["jti"]


def request(url: str, doc: dict | None = None, headers: dict[str, str] | None = None,
            ) -> tuple[int, dict, dict[str, str]]:
    data = None if doc is None else json.dumps(doc).encode()
    req = urllib.request.Request(url, data=data, method="GET" if doc is None else "POST",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            raw, status, got = r.read(), r.status, dict(r.headers)
    except urllib.error.HTTPError as exc:
        raw, status, got = exc.read(), exc.code, dict(exc.headers)
    try:
        body = json.loads(raw)
    except ValueError:
        body = {"text": raw.decode(errors="replace")}
    return status, body, {k.lower(): v for k, v in got.items()}


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}
