"""Run a real ``viiwork-agent --config`` process for tests, and talk to it."""

from __future__ import annotations

import http.client
import json
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import aiohttp

from support.netns import Host
from support.procs import free_port, stop_process

T = TypeVar("T")


def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(k)} = {toml_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(type(value))


def render_config(sections: dict[str, dict[str, Any]], models: list[dict[str, Any]]) -> str:
    """A TOML config from plain dicts (tables of scalars; models may hold sub-tables)."""
    out: list[str] = []
    for name, table in sections.items():
        out.append(f"[{name}]")
        out += [f"{k} = {toml_value(v)}" for k, v in table.items()]
        out.append("")
    for model in models:
        out.append("[[models]]")
        out += [f"{k} = {toml_value(v)}" for k, v in model.items()]
        out.append("")
    return "\n".join(out)


class Agent:
    """A running agent: ``url``, ``status()``, ``wait_for(predicate)``, ``log_text()``; ``host``:
    where it runs (support/netns.py; None: this machine), ``call(fn)`` runs ``fn`` from there
    (how a test reaches an agent whose API listens inside a network namespace)."""

    def __init__(self, proc: subprocess.Popen, url: str, log: Path, state_dir: Path | None = None,
                 api_key: str | None = None, host: Host | None = None) -> None:
        self.proc = proc
        self.host = host
        self.api_key = api_key  # a client key with the read scope, for an agent in keys mode
        self.url = url
        self.log = log
        self.state_dir = state_dir

    def engine_headers(self, model: str, index: int = 0) -> dict[str, str]:
        """The ``Authorization`` header that backend ``index`` of ``model`` accepts (its key
        file under the state dir: viiwork.agent.supervision.engine_keys), for tests that call an engine
        directly."""
        assert self.state_dir is not None
        from viiwork.agent.supervision.engine_keys import auth_headers, read_key
        from viiwork.agent.supervision.launch import escape_name

        return auth_headers(read_key(self.state_dir / "engines" / f"{escape_name(model)}-{index}"))

    def engine_socket(self, model: str, index: int = 0) -> str:
        """The Unix socket backend ``index`` of ``model`` listens on (llama.cpp engines)."""
        path = self.model(model)["backends"][index]["socket"]
        assert path, f"backend {index} of {model} has no socket: {self.model(model)['backends'][index]}"
        return str(path)

    def engine_session(self, model: str, index: int = 0, *, key: bool = True,
                       timeout_s: float = 60) -> aiohttp.ClientSession:
        """An aiohttp session to the engine itself (base URL ``ENGINE_URL``) over its socket,
        with its key unless ``key`` is False."""
        return aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=self.engine_socket(model, index)),
                                     headers=self.engine_headers(model, index) if key else {},
                                     timeout=aiohttp.ClientTimeout(total=timeout_s))

    def engine_request(self, model: str, method: str, path: str, body: dict[str, Any] | None = None,
                       index: int = 0, headers: dict[str, str] | None = None,
                       key: bool = True) -> tuple[int, bytes]:
        """One request to the engine itself over its socket (blocking): (status, body)."""
        conn = UnixHTTPConnection(self.engine_socket(model, index), timeout=10)
        try:
            all_headers = {**(self.engine_headers(model, index) if key else {}), **(headers or {})}
            data = None
            if body is not None:
                data = json.dumps(body).encode()
                all_headers["Content-Type"] = "application/json"
            conn.request(method, path, body=data, headers=all_headers)
            resp = conn.getresponse()
            return resp.status, resp.read()
        finally:
            conn.close()

    def engine_stats(self, model: str, index: int = 0) -> dict[str, Any]:
        """The fake engine's ``/fake/stats`` (support/fake_engine.py)."""
        status, raw = self.engine_request(model, "GET", "/fake/stats", index=index)
        assert status == 200, raw
        return json.loads(raw)



    def call(self, fn: Callable[[], T], timeout_s: float = 60) -> T:
        return fn() if self.host is None else self.host.call(fn, timeout_s)

    def status(self) -> dict[str, Any]:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

        def fetch() -> dict[str, Any]:
            with urllib.request.urlopen(urllib.request.Request(f"{self.url}/v1/status", headers=headers),
                                        timeout=5) as r:
                return json.load(r)
        return self.call(fetch, 10)

    def model(self, name: str) -> dict[str, Any]:
        return next(m for m in self.status()["models"] if m["name"] == name)

    def wait_for(self, predicate: Callable[[dict[str, Any]], bool], timeout_s: float = 60, what: str = "") -> dict:
        deadline = time.monotonic() + timeout_s
        last: Any = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"agent exited ({self.proc.returncode}); log:\n{self.log_text()[-3000:]}")
            try:
                last = self.status()
                if predicate(last):
                    return last
            except (urllib.error.URLError, OSError, ValueError, StopIteration, KeyError, IndexError):
                pass
            time.sleep(0.05)
        raise AssertionError(f"timed out after {timeout_s} s waiting for {what or predicate}; "
                             f"last status: {json.dumps(last)[:2000]}\nlog:\n{self.log_text()[-3000:]}")

    def wait_healthy(self, model: str, count: int | None = None, timeout_s: float = 60) -> dict:
        def ok(doc: dict) -> bool:
            m = next(m for m in doc["models"] if m["name"] == model)
            healthy = [b for b in m["backends"] if b["state"] == "healthy"]
            return len(healthy) == (count if count is not None else len(m["backends"]))
        return self.wait_for(ok, timeout_s, f"{model} healthy")

    def log_text(self) -> str:
        try:
            return self.log.read_text(errors="replace")
        except OSError:
            return ""


@contextmanager
def run_agent(workdir: Path, models: list[dict[str, Any]], name: str = "node-a",
              extra: dict[str, dict[str, Any]] | None = None, port: int | None = None,
              api_key: str | None = None, host: Host | None = None) -> Iterator[Agent]:
    """Write a config for ``models`` and run ``viiwork-agent --config`` on a free port.

    ``host``: run it there (support/netns.py: in a network namespace, the API on that
    namespace's loopback, reached through ``Agent.call``); None: on this machine.

    A port found free can be taken by another process before the agent binds it (engines of
    other agents pick loopback ports too): when the agent exits because its API port was
    taken, it is started again on a new one (up to 3 tries; not when ``port`` is given).
    ``api_key``: a client key with the read scope, for an agent in keys mode (``Agent.status``).
    """
    fixed = port is not None
    log = workdir / f"{name}.log"
    for attempt in range(3):
        port = port if fixed else free_port()
        config = write_config(workdir, models, name, extra, port)
        agent_bin = Path(sys.executable).parent / "viiwork-agent"
        with open(log, "ab") as out:
            argv = [str(agent_bin), "--config", str(config), "--log-level", "debug"]
            popen = subprocess.Popen if host is None else host.popen
            proc = popen(argv, stdout=out, stderr=subprocess.STDOUT)
        agent = Agent(proc, f"http://127.0.0.1:{port}", log, workdir / name, api_key, host)
        try:
            agent.wait_for(lambda doc: True, 30, "the API to answer")
        except AssertionError:
            stop_process(proc, 30)
            if fixed or attempt == 2 or "cannot listen" not in agent.log_text():
                raise
            continue
        try:
            yield agent
        finally:
            stop_process(proc, 30)
        return


def node_ids(workdir: Path, *names: str) -> list[str]:
    """The node ids of the agents ``names`` that run_agent will start in ``workdir``: each
    one's key made now in its state dir, where its agent finds it. A gang's ``hosts`` name
    the other hosts by id under open trust (agent/config/schema.py)."""
    from viiwork.mesh.identity import load_or_create_identity

    return [str(load_or_create_identity(workdir / name).node_id) for name in names]


def write_config(workdir: Path, models: list[dict[str, Any]], name: str,
                 extra: dict[str, dict[str, Any]] | None, port: int) -> Path:
    state = workdir / name
    sections: dict[str, dict[str, Any]] = {
        "node": {"name": name, "state_dir": str(state)},
        "api": {"listen": f"127.0.0.1:{port}", "admin_socket": str(state / "admin.sock")},
        "supervisor": {"runner": "process"},
        "health": {"interval_s": 0.5, "respawn_backoff_s": 0.2},
    }
    for key, table in (extra or {}).items():
        sections[key] = {**sections.get(key, {}), **table}
    config = workdir / f"{name}.toml"
    config.write_text(render_config(sections, models))
    return config


#: The base URL of an engine session (a Unix socket: the host is only a label).
ENGINE_URL = "http://localhost"


class UnixHTTPConnection(http.client.HTTPConnection):
    """http.client over a Unix socket."""

    def __init__(self, path: str, timeout: float = 10) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        sock.connect(self._path)
        self.sock = sock
