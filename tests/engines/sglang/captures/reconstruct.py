"""Write the reconstructed SGLang 0.5.23 responses in this folder (see README.md).

Not a test and not run by the test suite. It needs ``prometheus_client`` (any environment
with vLLM or SGLang installed has it): ``python reconstruct.py``.

The /metrics documents are rendered by prometheus_client's multiprocess collector, which is
how SGLang serves /metrics (``PROMETHEUS_MULTIPROC_DIR`` + ``MultiProcessCollector``), from
gauges declared with SGLang 0.5.23's names, help strings, label names and
``multiprocess_mode="mostrecent"`` (``srt/observability/metrics_collector.py``). Only the
scheduler gauges the adapter reads, and a few beside them, are declared; a real document has
many more families (counters, histograms, the tokenizer manager's metrics).
"""

from __future__ import annotations

import importlib
import os
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
PREFIX = "sglang-0.5.23-reconstructed-"
DATE = "Mon, 30 Nov 2026 12:40:00 GMT"
MODEL = "qwen3-8b"

# name -> help, as declared by SGLang 0.5.23's SchedulerMetricsCollector.
GAUGES = {
    "sglang:num_running_reqs": "The number of running requests.",
    "sglang:num_queue_reqs": "The number of requests in the waiting queue.",
    "sglang:num_grammar_queue_reqs": "The number of requests in the grammar waiting queue.",
    "sglang:gen_throughput": "The generation throughput (token/s).",
    "sglang:token_usage": "The token usage.",
    "sglang:max_total_num_tokens": "Maximum total number of tokens in the KV cache pool.",
    "sglang:context_len": "Maximum context length.",
}
CONSTANTS = ("sglang:max_total_num_tokens", "sglang:context_len")


def rank_labels(tp: int = 0, dp: int | None = None, priority: str | None = None) -> dict[str, str]:
    """The label set of one scheduler (SchedulerMetricsCollector's ``labels``)."""
    labels = {"model_name": MODEL, "engine_type": "unified", "tp_rank": str(tp), "pp_rank": "0", "moe_ep_rank": "0"}
    if priority is not None:
        labels["priority"] = priority
    if dp is not None:
        labels["dp_rank"] = str(dp)
    return labels


def render(series: list[tuple[str, dict[str, str], float]]) -> bytes:
    """Exposition text of ``series`` as SGLang's /metrics renders it (fresh multiprocess dir)."""
    with tempfile.TemporaryDirectory() as d:
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = d
        for mod in [m for m in sys.modules if m.startswith("prometheus_client")]:
            del sys.modules[mod]
        pc = importlib.import_module("prometheus_client")
        multiprocess = importlib.import_module("prometheus_client.multiprocess")
        gauges: dict[tuple[str, tuple[str, ...]], object] = {}
        for name, labels, value in series:
            key = (name, tuple(labels))
            if key not in gauges:
                gauges[key] = pc.Gauge(name, GAUGES[name], labelnames=list(labels), multiprocess_mode="mostrecent",
                                       registry=None)
            gauges[key].labels(**labels).set(value)
        registry = pc.CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        return pc.generate_latest(registry)


def http(status: str, body: bytes, content_type: str | None) -> bytes:
    head = [f"HTTP/1.1 {status}", f"date: {DATE}", "server: uvicorn", f"content-length: {len(body)}"]
    if content_type:
        head.append(f"content-type: {content_type}")
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


def scheduler(labels: dict[str, str], running: float, queued: float, grammar: float = 0.0) -> list:
    return [
        ("sglang:num_running_reqs", labels, running),
        ("sglang:num_queue_reqs", labels, queued),
        ("sglang:num_grammar_queue_reqs", labels, grammar),
        ("sglang:gen_throughput", labels, 0.0 if running == 0 else 412.7),
        ("sglang:token_usage", labels, 0.0 if running == 0 else 0.31),
    ]


def constants(labels: dict[str, str]) -> list:
    return [("sglang:max_total_num_tokens", labels, 412328.0), ("sglang:context_len", labels, 32768.0)]


def main() -> None:
    metrics_type = importlib.import_module("prometheus_client").CONTENT_TYPE_LATEST
    r0 = rank_labels()
    docs = {
        "health_generate_starting": http("503 Service Unavailable", b"", None),
        "health_generate_ready": http("200 OK", b"", None),
        "metrics_disabled": http("404 Not Found", b'{"detail":"Not Found"}', "application/json"),
        # emit_constants() runs at scheduler start; the first statistics come with the
        # server's own warm-up request.
        "metrics_before_first_stats": http("200 OK", render(constants(r0)), metrics_type),
        "metrics_idle": http("200 OK", render(constants(r0) + scheduler(r0, 0, 0)), metrics_type),
        "metrics_busy": http("200 OK", render(constants(r0) + scheduler(r0, 8, 3, 1)), metrics_type),
        # --tp-size 2 --enable-metrics-for-all-schedulers: both ranks report one scheduler.
        "metrics_tp2_all_schedulers": http(
            "200 OK",
            render(constants(r0) + constants(rank_labels(tp=1)) + scheduler(r0, 5, 2)
                   + scheduler(rank_labels(tp=1), 5, 2)),
            metrics_type,
        ),
        # --dp-size 2: two schedulers with their own requests.
        "metrics_dp2": http(
            "200 OK",
            render(constants(rank_labels(dp=0)) + constants(rank_labels(dp=1)) + scheduler(rank_labels(dp=0), 4, 1)
                   + scheduler(rank_labels(dp=1), 3, 0)),
            metrics_type,
        ),
        # --enable-priority-scheduling: totals under priority="", a breakdown per priority.
        "metrics_priority": http(
            "200 OK",
            render(constants(rank_labels(priority="")) + scheduler(rank_labels(priority=""), 6, 4)
                   + [("sglang:num_running_reqs", rank_labels(priority="0"), 2.0),
                      ("sglang:num_running_reqs", rank_labels(priority="5"), 4.0),
                      ("sglang:num_queue_reqs", rank_labels(priority="0"), 3.0),
                      ("sglang:num_queue_reqs", rank_labels(priority="5"), 1.0)]),
            metrics_type,
        ),
    }
    for name, data in docs.items():
        (HERE / f"{PREFIX}{name}.txt").write_bytes(data)


if __name__ == "__main__":
    main()
