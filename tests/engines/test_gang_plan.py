"""The gang plan (engines/gang_plan.py): its steps per launch shape, the launch tracker, and the
plan driven with real fake-engine processes honouring each shape (support/fake_gang.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
from pydantic import BaseModel

from support.gang_driver import GangRun, drive_gang, gang_binaries
from support.procs import free_port
from viiwork.engines.contract import BackendSpec, Engine, Kind
from viiwork.engines.gang import GangAddresses, GangPart, LaunchShape, PartRole, new_gang_id, roles_at
from viiwork.engines.gang_plan import (
    GangFailed,
    GangLaunch,
    GangPlan,
    GangServing,
    GangStep,
    LaunchState,
    Ready,
    StartParts,
    plan_gang,
)
from viiwork.engines.llamacpp import LlamaCppEngine, LlamaCppOptions
from viiwork.engines.sglang import SglangEngine, SglangOptions
from viiwork.engines.vllm import VllmEngine, VllmOptions

S, R, W, RT = PartRole.SERVER, PartRole.RANK, PartRole.WORKER, PartRole.RUNTIME


def p(rank: int, role: PartRole) -> GangPart:
    return GangPart(rank, role)


# --- the plan (sans-IO) ----------------------------------------------------------------------

def test_ranks_start_together_and_rank_0_serves() -> None:
    plan = plan_gang(LaunchShape.RANKS, 3)
    assert plan.steps == (GangStep((p(0, S), p(1, R), p(2, R)), (Ready.PROBE, Ready.PROCESS, Ready.PROCESS)),)
    assert plan.serving == p(0, S)


def test_workers_start_first_and_must_listen_before_the_head() -> None:
    plan = plan_gang(LaunchShape.WORKERS_THEN_HEAD, 3)
    assert plan.steps == (GangStep((p(1, W), p(2, W)), (Ready.PORT, Ready.PORT)), GangStep((p(0, S),), (Ready.PROBE,)))
    assert plan.stop_order() == (p(0, S), p(2, W), p(1, W))


def test_cluster_runtime_head_then_workers_join_then_the_server() -> None:
    plan = plan_gang(LaunchShape.CLUSTER_RUNTIME, 2)
    assert plan.steps == (GangStep((p(0, RT),), (Ready.PORT,)), GangStep((p(1, RT),), (Ready.PROCESS,)),
                          GangStep((p(0, S),), (Ready.PROBE,)))
    assert plan.parts_on(0) == (p(0, RT), p(0, S))
    assert plan.parts_on(1) == (p(1, RT),)
    assert plan.stop_order()[0] == p(0, S) and plan.stop_order()[-1] == p(0, RT)


@pytest.mark.parametrize("shape", list(LaunchShape))
def test_each_host_runs_what_roles_at_says(shape: LaunchShape) -> None:
    plan = plan_gang(shape, 4)
    for rank in range(4):
        assert tuple(part.role for part in plan.parts_on(rank)) == roles_at(shape, rank)


@pytest.mark.parametrize("size", [1, 18])
def test_a_plan_needs_2_to_17_hosts(size: int) -> None:
    with pytest.raises(ValueError, match="2..17 hosts"):
        plan_gang(LaunchShape.RANKS, size)


def test_the_tracker_starts_each_step_when_the_previous_one_is_ready() -> None:
    launch = GangLaunch(plan_gang(LaunchShape.CLUSTER_RUNTIME, 3))
    assert launch.start() == [StartParts((p(0, RT),))]
    assert launch.part_reached(p(0, RT), Ready.PROCESS) == []  # running, not yet listening
    assert launch.part_reached(p(0, RT), Ready.PORT) == [StartParts((p(1, RT), p(2, RT)))]
    assert launch.part_reached(p(1, RT), Ready.PROCESS) == []
    assert launch.part_reached(p(2, RT), Ready.PORT) == [StartParts((p(0, S),))]  # past what the step needs
    assert launch.part_reached(p(0, S), Ready.PORT) == []
    assert launch.part_reached(p(0, S), Ready.PROBE) == [GangServing()]
    assert launch.state is LaunchState.SERVING
    assert launch.part_reached(p(0, S), Ready.PROCESS) == []  # a lower report never goes back
    assert launch.reached(p(0, S)) is Ready.PROBE


def test_a_part_reported_before_its_step_fails_the_gang() -> None:
    launch = GangLaunch(plan_gang(LaunchShape.WORKERS_THEN_HEAD, 2))
    launch.start()
    [failed] = launch.part_reached(p(0, S), Ready.PROCESS)
    assert isinstance(failed, GangFailed) and failed.part == p(0, S)
    assert "before it was started (out of order)" in failed.reason
    assert launch.state is LaunchState.FAILED
    assert launch.part_reached(p(1, W), Ready.PORT) == []  # final


def test_any_part_exiting_fails_the_whole_gang_also_when_serving() -> None:
    launch = GangLaunch(plan_gang(LaunchShape.RANKS, 2))
    launch.start()
    launch.part_reached(p(1, R), Ready.PROCESS)
    assert launch.part_reached(p(0, S), Ready.PROBE) == [GangServing()]
    assert launch.part_exited(p(1, R), "killed") == [GangFailed(p(1, R), "r1-rank exited: killed")]
    assert launch.part_exited(p(0, S), "killed") == []


def test_reports_of_parts_the_plan_has_not_are_counted_and_ignored() -> None:
    launch = GangLaunch(plan_gang(LaunchShape.RANKS, 2))
    launch.start()
    assert launch.part_reached(p(5, R), Ready.PROCESS) == []
    assert launch.part_exited(p(1, W), "gone") == []
    assert launch.ignored == 2 and launch.state is LaunchState.STARTING
    with pytest.raises(RuntimeError):
        launch.start()


def test_gang_ids_are_fresh_and_well_formed() -> None:
    assert new_gang_id(bytes(8)) == "aaaaaaaaaaaa"
    assert new_gang_id() != new_gang_id()


# --- the plan driven with fake engines (real processes) -------------------------------------

GANG = "abcdefgh2345"


@pytest.fixture
def run() -> Iterator[GangRun]:
    gang_run = GangRun()
    yield gang_run
    gang_run.stop()


def _specs(options: BaseModel, size: int, gpus: tuple[str, ...]) -> dict[int, BackendSpec]:
    return {rank: BackendSpec(model="big", kind=Kind.CHAT, path="/models/big", port=free_port(), ctx_per_slot=512,
                              parallel=2, options=options, gpus=gpus, host_cpus=2) for rank in range(size)}


def _addresses(size: int, port: int, worker_endpoints: tuple[str, ...] = ()) -> dict[int, GangAddresses]:
    nodes = tuple(f"127.0.0.{i + 1}" for i in range(size))  # one loopback address per "host"
    return {rank: GangAddresses(gang_id=GANG, rank=rank, size=size, node_addresses=nodes, port=port,
                                worker_endpoints=worker_endpoints if rank == 0 else ()) for rank in range(size)}


async def _drive(engine: Engine, plan: GangPlan, options: BaseModel, size: int, gpus: tuple[str, ...],
                 run: GangRun, tmp_path: Path, *, worker_endpoints: bool = False, **env: str) -> list[str]:
    port = free_port()
    # On one machine the llama.cpp workers' rpc-servers share 127.0.0.1, so each "host" gets
    # its own gang port and the head reaches them there (what the agents' tunnels stand for).
    addresses = _addresses(size, port)
    if worker_endpoints:
        ports = {rank: free_port() for rank in range(1, size)}
        endpoints = tuple(f"127.0.0.1:{ports[r]}" for r in range(1, size))
        addresses = {rank: GangAddresses(gang_id=GANG, rank=rank, size=size, node_addresses=a.node_addresses,
                                         port=ports.get(rank, port), worker_endpoints=endpoints if rank == 0 else ())
                     for rank, a in addresses.items()}
    log = tmp_path / "gang.log"
    await drive_gang(engine, plan, _specs(options, size, gpus), addresses, run,
                     env={"FAKE_GANG_LOG": str(log), **env})
    return log.read_text().splitlines() if log.exists() else []


def _bins(tmp_path: Path) -> dict[str, str]:
    return gang_binaries(tmp_path / "bin")


@pytest.mark.parametrize("size", [2, 3], ids=["2-hosts", "3-hosts"])
async def test_llamacpp_rpc_gang_serves_when_started_by_the_plan(size: int, run: GangRun, tmp_path: Path) -> None:
    bins = _bins(tmp_path)
    options = LlamaCppOptions(binary=bins["llama-server"], rpc_binary=bins["rpc-server"])
    log = await _drive(LlamaCppEngine(), plan_gang(LaunchShape.WORKERS_THEN_HEAD, size), options, size, (), run,
                       tmp_path, worker_endpoints=True)
    assert run.outcome == GangServing(), (run.actions, log)
    assert run.started[-1] == p(0, S)
    assert sum(line.startswith("rpc-server listening") for line in log) == size - 1
    assert log[-1].startswith("llama-server serving 127.0.0.1:")


async def test_llamacpp_head_started_before_its_workers_fails(run: GangRun, tmp_path: Path) -> None:
    bins = _bins(tmp_path)
    options = LlamaCppOptions(binary=bins["llama-server"], rpc_binary=bins["rpc-server"])
    wrong = GangPlan(LaunchShape.WORKERS_THEN_HEAD, 2, (GangStep((p(0, S),), (Ready.PROBE,)),
                                                         GangStep((p(1, W),), (Ready.PORT,))))
    log = await _drive(LlamaCppEngine(), wrong, options, 2, (), run, tmp_path, worker_endpoints=True)
    assert isinstance(run.outcome, GangFailed) and run.outcome.part == p(0, S), (run.actions, log)
    assert any("unreachable" in line for line in log)
    assert p(1, W) not in run.started


async def test_sglang_ranks_meet_at_the_heads_rendezvous(run: GangRun, tmp_path: Path) -> None:
    options = SglangOptions(python=_bins(tmp_path)["python"], tensor_parallel=2)
    log = await _drive(SglangEngine(), plan_gang(LaunchShape.RANKS, 2), options, 2, ("0",), run, tmp_path)
    assert run.outcome == GangServing(), (run.actions, log)
    assert "sglang-r0 rank-joined 1" in log and "sglang-r1 running" in log


async def test_a_rank_dying_fails_the_serving_gang(run: GangRun, tmp_path: Path) -> None:
    options = SglangOptions(python=_bins(tmp_path)["python"])
    specs, addresses = _specs(options, 3, ("0",)), _addresses(3, free_port())
    plan = plan_gang(LaunchShape.RANKS, 3)
    watching = drive_gang(SglangEngine(), plan, specs, addresses, run, until_failed=True,
                          env={"FAKE_GANG_LOG": str(tmp_path / "gang.log")})
    task = asyncio.ensure_future(watching)
    async with asyncio.timeout(15):
        while GangServing() not in run.actions:
            await asyncio.sleep(0.05)
        run.processes[p(2, R)].kill()
        await task
    assert isinstance(run.outcome, GangFailed) and run.outcome.part == p(2, R)


async def test_sglang_rank_with_another_gang_size_is_refused(run: GangRun, tmp_path: Path) -> None:
    # Rank 1 told the gang has 3 hosts while rank 0 runs a gang of 2: the rendezvous refuses it.
    options = SglangOptions(python=_bins(tmp_path)["python"])
    specs = _specs(options, 2, ("0",))
    port = free_port()
    addresses = _addresses(2, port)
    addresses[1] = GangAddresses(gang_id=GANG, rank=1, size=3, node_addresses=("127.0.0.1", "127.0.0.2", "127.0.0.3"),
                                 port=port)
    await drive_gang(SglangEngine(), plan_gang(LaunchShape.RANKS, 2), specs, addresses, run,
                     env={"FAKE_GANG_LOG": str(tmp_path / "gang.log")})
    assert isinstance(run.outcome, GangFailed), run.actions
    assert "joined a gang of 2" in (tmp_path / "gang.log").read_text()


@pytest.mark.parametrize(("tp", "pp", "gpus"), [(2, 1, ("0",)), (2, 2, ("0", "1"))], ids=["tp2", "tp2xpp2"])
async def test_vllm_serves_once_the_ray_workers_joined(tp: int, pp: int, gpus: tuple[str, ...], run: GangRun,
                                                       tmp_path: Path) -> None:
    bins = _bins(tmp_path)
    options = VllmOptions(binary=bins["vllm"], ray_binary=bins["ray"], tensor_parallel=tp, pipeline_parallel=pp)
    log = await _drive(VllmEngine(), plan_gang(LaunchShape.CLUSTER_RUNTIME, 2), options, 2, gpus, run, tmp_path)
    assert run.outcome == GangServing(), (run.actions, log)
    assert run.started == [p(0, RT), p(1, RT), p(0, S)]
    assert log.index("ray-head joined node1") < next(i for i, line in enumerate(log) if line.startswith("vllm serving"))
    assert any(line.startswith(f"vllm serving 2 nodes, {2 * len(gpus)} GPUs") for line in log), log


async def test_vllm_server_started_before_the_workers_join_fails(run: GangRun, tmp_path: Path) -> None:
    bins = _bins(tmp_path)
    options = VllmOptions(binary=bins["vllm"], ray_binary=bins["ray"])
    wrong = GangPlan(LaunchShape.CLUSTER_RUNTIME, 2, (GangStep((p(0, RT),), (Ready.PORT,)),
                                                      GangStep((p(0, S),), (Ready.PROBE,)),
                                                      GangStep((p(1, RT),), (Ready.PROCESS,))))
    log = await _drive(VllmEngine(), wrong, options, 2, ("0",), run, tmp_path, FAKE_GANG_TIMEOUT_S="1")
    assert isinstance(run.outcome, GangFailed) and run.outcome.part == p(0, S), (run.actions, log)
    assert any("placement group of 2 GPUs not ready" in line for line in log)
