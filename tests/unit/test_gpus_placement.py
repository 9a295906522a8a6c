"""On-GPU verification: the pure decision, the /proc readers, and the monitor end to end."""

from __future__ import annotations

import copy
import os
import subprocess
import time

import pytest

from support.gpu_hosts import nvml_recording, write_drm_card, write_fake_proc
from viiwork.agent.host.gpus.amd import AmdSysfsReader
from viiwork.agent.host.gpus.inventory import read_inventory
from viiwork.agent.host.gpus.monitor import GpuMonitor
from viiwork.agent.host.gpus.nvml import NvmlReader
from viiwork.agent.host.gpus.nvml_record import ReplayNvml
from viiwork.agent.host.gpus.placement import PlacementVerdict, gpu_pids, process_tree, verify_placement
from viiwork.agent.supervision.backends import Backend, BackendId, BackendState

OK, MISMATCH, UNKNOWN = PlacementVerdict.OK, PlacementVerdict.MISMATCH, PlacementVerdict.UNKNOWN
A, B, C = "GPU-a", "GPU-b", "GPU-c"
TREE = frozenset({10, 11, 12})
HOST = frozenset({1, 10, 11, 12, 500, 501})

CASES = [
    # id, expected, gpu_pids, host_pids, verdict, reason fragment
    ("on-its-gpu", (A,), {A: {10}, B: {500}}, HOST, OK, "exactly"),
    ("workers-on-two-gpus", (A, B), {A: {11}, B: {12}, C: set()}, HOST, OK, "exactly"),
    ("also-on-another-gpu", (A,), {A: {10}, B: {11}}, HOST, MISMATCH, "not given: GPU-b"),
    ("on-the-wrong-gpu", (A,), {A: {500}, B: {10}}, HOST, MISMATCH, "absent from GPU(s) it was given: GPU-a"),
    ("absent-from-one-of-two", (A, B), {A: {10}, B: set()}, HOST, MISMATCH, "absent from GPU(s) it was given: GPU-b"),
    ("assigned-gpu-gone", (A, C), {A: {10}, B: set()}, HOST, MISMATCH, "not on this host any more: GPU-c"),
    ("cpu-backend-clean", (), {A: {500}, B: set()}, HOST, OK, "CPU backend"),
    ("cpu-backend-grabbed-a-gpu", (), {A: {11}}, HOST, MISMATCH, "not given: GPU-a"),
    ("cpu-backend-no-gpu-host", (), {}, HOST, OK, "CPU backend"),
    ("assigned-list-unreadable", (A,), {A: None, B: set()}, HOST, UNKNOWN, "unreadable for GPU(s) GPU-a"),
    ("nothing-readable", (), {A: None, B: None}, HOST, UNKNOWN, "no GPU process list"),
    ("unreadable-other-gpu-is-fine", (A,), {A: {10}, B: None}, HOST, OK, "exactly"),
    ("other-pid-namespace", (A,), {A: {90001}, B: {90002}}, HOST, UNKNOWN, "PID namespace"),
    ("namespace-unknown-without-host-pids", (A,), {A: {90001}}, None, MISMATCH, "absent from"),
]


@pytest.mark.parametrize(("expected", "pids", "host", "verdict", "fragment"), [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_verify_placement(expected, pids, host, verdict, fragment):
    frozen = {k: None if v is None else frozenset(v) for k, v in pids.items()}
    result = verify_placement(TREE, expected, frozen, host)
    assert result.verdict is verdict, result.reason
    assert fragment in result.reason


def test_process_gone_is_unknown():
    result = verify_placement(frozenset(), (A,), {A: frozenset({10})}, HOST)
    assert result.verdict is UNKNOWN and "not running" in result.reason


def test_verdict_lists_where_it_was_seen():
    result = verify_placement(TREE, (A,), {A: frozenset(), B: frozenset({12})}, HOST)
    assert result.to_json() == {
        "verdict": "mismatch",
        "reason": "runs on GPU(s) it was not given: GPU-b; absent from GPU(s) it was given: GPU-a",
        "expected": ["GPU-a"], "seen_on": ["GPU-b"], "missing_on": ["GPU-a"], "unexpected_on": ["GPU-b"],
        "unreadable": [],
    }


def _full_tree(pid):
    """process_tree(pid) once the shell has started both children (None before)."""
    tree, host = process_tree(pid)
    return (tree, host) if len(tree) == 3 else None


def _wait_for(predicate, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError("condition not met before the deadline")


@pytest.fixture
def engine_tree():
    """A real process with two children (stands in for an engine and its workers)."""
    proc = subprocess.Popen(["sh", "-c", "sleep 60 & sleep 60 & wait"], start_new_session=True)
    try:
        yield proc
    finally:
        os.killpg(proc.pid, 9)
        proc.wait(timeout=10)


def test_process_tree_of_a_real_process(engine_tree):
    tree, host = _wait_for(lambda: _full_tree(engine_tree.pid))
    assert engine_tree.pid in tree and tree <= host and os.getpid() not in tree


def test_process_tree_of_a_missing_pid():
    tree, host = process_tree(2 ** 22 + 12345)
    assert tree == frozenset() and os.getpid() in host


def test_process_tree_survives_parentheses_in_names(tmp_path):
    proc = write_fake_proc(tmp_path, {7: (1, {}), 8: (7, {}), 9: (8, {}), 20: (1, {})})
    (proc / "8" / "stat").write_text("8 (python (worker) 1) S 7 8 8 0 -1 0\n")
    tree, host = process_tree(7, proc)
    assert tree == {7, 8, 9} and host == {7, 8, 9, 20}


def test_gpu_pids_nvidia_from_nvml_and_amd_from_fdinfo(tmp_path):
    write_drm_card(tmp_path, 0, "0000:43:00.0", files={"unique_id": "00000000000000a0"})
    write_drm_card(tmp_path, 1, "0000:c3:00.0", files={"unique_id": "00000000000000c0"})
    inventory = read_inventory([NvmlReader(ReplayNvml(nvml_recording("nvml-2x-h100"))), AmdSysfsReader(tmp_path)])
    proc = write_fake_proc(tmp_path, {300: (1, {5: "0000:43:00.0"}), 301: (300, {6: None})})
    pids = gpu_pids(inventory, {300, 301}, proc)
    assert pids == {
        "GPU-5b1c7a4e-91f3-2d6e-8a0b-3c4d5e6f7a8b": frozenset({41234}),
        "GPU-0e6f2a19-4c7d-8b3a-5f1e-9d2c6b8a4e70": frozenset(),
        "GPU-00000000000000a0": frozenset({300}),
        "GPU-00000000000000c0": frozenset(),
    }
    # fdinfo unreadable for every tree process: AMD lists are unknown, not empty.
    assert gpu_pids(inventory, {999}, proc)["GPU-00000000000000a0"] is None


def _recording_with_pid(pid, device):
    rec = copy.deepcopy(nvml_recording("nvml-2x-h100"))
    for d in rec["devices"]:
        d["nvmlDeviceGetComputeRunningProcesses"] = []
    rec["devices"][device]["nvmlDeviceGetComputeRunningProcesses"] = [{"pid": pid, "usedGpuMemory": 1 << 30}]
    return rec


@pytest.mark.parametrize(("assigned", "device", "verdict"), [(("0",), 0, OK), (("1",), 0, MISMATCH)],
                         ids=["on-its-gpu", "on-another-gpu"])
async def test_monitor_verifies_a_real_process_tree(tmp_path, engine_tree, assigned, device, verdict):
    # NVML (replayed) lists one of the real tree's children on GPU `device`.
    tree, _ = _wait_for(lambda: _full_tree(engine_tree.pid))
    child = max(tree - {engine_tree.pid})
    backend = Backend(id=BackendId("m-0"), model="m", index=0, gpus=assigned, state=BackendState.HEALTHY,
                      pid=engine_tree.pid)
    monitor = GpuMonitor([NvmlReader(ReplayNvml(_recording_with_pid(child, device))), AmdSysfsReader(tmp_path)],
                         backends=lambda: [backend])
    await monitor.async_refresh()
    assert monitor.pending_verification() == [backend]
    placement = await monitor.async_verify(backend)
    assert placement.verdict is verdict, placement.reason
    assert monitor.pending_verification() == []
    section = monitor.status_section()
    assert section["placements"][0]["backend"] == "m-0"
    assert section["placements"][0]["verdict"] == verdict.value


async def test_monitor_verify_without_pid_is_unknown(tmp_path):
    backend = Backend(id=BackendId("m-0"), model="m", index=0, gpus=("0",), state=BackendState.HEALTHY)
    monitor = GpuMonitor([NvmlReader(ReplayNvml(nvml_recording("nvml-2x-h100"))), AmdSysfsReader(tmp_path)],
                         backends=lambda: [backend])
    await monitor.async_refresh()
    assert (await monitor.async_verify(backend)).verdict is UNKNOWN
