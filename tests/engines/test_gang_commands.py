"""Golden command lines of every gang part, per engine and launch shape (docs/engines.md, "Gangs").

vLLM and SGLang: tensor-parallel over 2 nodes (1 GPU each), pipeline-parallel over 2 nodes,
and TP x PP (2 GPUs on each of 2 nodes). llama.cpp: RPC with 2 and 3 hosts. Literal
expectations: a flag renamed or reordered shows up here.
"""

from __future__ import annotations

import pytest
from pydantic import BaseModel

from viiwork.engines.contract import BackendSpec, EngineOptionsError, Kind
from viiwork.engines.gang import GangAddresses, LaunchShape, PartRole, PortRange, gang_shape
from viiwork.engines.llamacpp import LlamaCppEngine, LlamaCppOptions
from viiwork.engines.registry import ENGINES
from viiwork.engines.sglang import SglangEngine, SglangOptions
from viiwork.engines.vllm import VllmEngine, VllmOptions

GANG = "abcdefgh2345"
# Ray's own ports pinned inside the gang's block (gang_port 29500 .. 29755).
RAY_PINNED = ("--node-manager-port", "29501", "--object-manager-port", "29502", "--runtime-env-agent-port", "29503",
              "--dashboard-agent-grpc-port", "29504", "--dashboard-agent-listen-port", "29505",
              "--metrics-export-port", "29506")
RAY_WORKERS = ("--min-worker-port", "29516", "--max-worker-port", "29755")
SOCKET = "/run/viiwork/engines/big-0/engine.sock"
KEY = "/run/viiwork/engines/big-0/key"


def spec(options: BaseModel, gpus: tuple[str, ...], *, socket: bool = False) -> BackendSpec:
    return BackendSpec(model="big", kind=Kind.CHAT, path="/models/big", port=0 if socket else 8100,
                       ctx_per_slot=4096, parallel=4, options=options, gpus=gpus, vendor="nvidia",
                       api_key_file=KEY, socket_path=SOCKET if socket else None, host_cpus=16)


def gang(rank: int, size: int, worker_endpoints: tuple[str, ...] = ()) -> GangAddresses:
    return GangAddresses(gang_id=GANG, rank=rank, size=size,
                         node_addresses=tuple(f"10.0.0.{i + 1}" for i in range(size)), port=29500,
                         worker_endpoints=worker_endpoints)


def test_every_engine_declares_its_shape() -> None:
    assert {name: gang_shape(engine) for name, engine in ENGINES.items()} == {
        "llamacpp": LaunchShape.WORKERS_THEN_HEAD, "vllm": LaunchShape.CLUSTER_RUNTIME, "sglang": LaunchShape.RANKS}


# --- vLLM: Ray runtime on every host, then vllm serve on the head ----------------------------

VLLM_CASES = [  # id, tensor_parallel, pipeline_parallel, this host's GPUs
    ("tp2-over-2-nodes", 2, 1, ("0",)),
    ("pp2-over-2-nodes", 1, 2, ("0",)),
    ("tp2xpp2-over-2-nodes", 2, 2, ("0", "1")),
]


@pytest.mark.parametrize(("tp", "pp", "gpus"), [c[1:] for c in VLLM_CASES], ids=[c[0] for c in VLLM_CASES])
def test_vllm_gang_commands(tp: int, pp: int, gpus: tuple[str, ...]) -> None:
    engine, opts = VllmEngine(), VllmOptions(tensor_parallel=tp, pipeline_parallel=pp)
    n = str(len(gpus))
    head_runtime = engine.gang_command(spec(opts, gpus), PartRole.RUNTIME, gang(0, 2))
    assert head_runtime.argv == ("ray", "start", "--head", "--port", "29500", "--node-ip-address", "10.0.0.1",
                                 "--num-gpus", n, *RAY_PINNED, "--ray-client-server-port", "29507", *RAY_WORKERS,
                                 "--include-dashboard", "false", "--disable-usage-stats", "--block")
    assert head_runtime.env == {"VLLM_HOST_IP": "10.0.0.1", "VLLM_NO_USAGE_STATS": "1"}
    worker_runtime = engine.gang_command(spec(opts, gpus), PartRole.RUNTIME, gang(1, 2))
    assert worker_runtime.argv == ("ray", "start", "--address", "10.0.0.1:29500", "--node-ip-address", "10.0.0.2",
                                   "--num-gpus", n, *RAY_PINNED, *RAY_WORKERS, "--disable-usage-stats", "--block")
    assert worker_runtime.env == {"VLLM_HOST_IP": "10.0.0.2", "VLLM_NO_USAGE_STATS": "1"}
    server = engine.gang_command(spec(opts, gpus, socket=True), PartRole.SERVER, gang(0, 2))
    assert server.argv == ("vllm", "serve", "/models/big", "--served-model-name", "big", "--uds", SOCKET,
                           "--max-num-seqs", "4", "--max-model-len", "4096", "--tensor-parallel-size", str(tp),
                           "--pipeline-parallel-size", str(pp), "--distributed-executor-backend", "ray")
    assert server.env == {"VLLM_NO_USAGE_STATS": "1", "VLLM_HOST_IP": "10.0.0.1", "RAY_ADDRESS": "10.0.0.1:29500",
                          "VLLM_PORT": "29508"}
    assert server.key_env == "VLLM_API_KEY"
    assert engine.gang_listen(PartRole.RUNTIME, gang(0, 2)) == "10.0.0.1:29500"
    assert engine.gang_listen(PartRole.RUNTIME, gang(1, 2)) is None
    # Every port above lies in the runtime's declared block, which the agent confines.
    assert engine.gang_ports(PartRole.RUNTIME, gang(0, 2)) == (PortRange(29500, 29755),)
    assert engine.gang_ports(PartRole.RUNTIME, gang(1, 2)) == (PortRange(29500, 29755),)
    assert engine.gang_ports(PartRole.SERVER, gang(0, 2)) == ()
    for command in (head_runtime, worker_runtime):
        ports = [int(a) for flag, a in zip(command.argv, command.argv[1:], strict=False) if flag.endswith("-port")]
        assert ports and all(29500 <= p <= 29755 for p in ports)


def test_vllm_gang_server_defaults_to_tp_per_host_and_pp_over_hosts() -> None:
    server = VllmEngine().gang_command(spec(VllmOptions(), ("0", "1")), PartRole.SERVER, gang(0, 3))
    i = server.argv.index("--tensor-parallel-size")
    assert server.argv[i:i + 6] == ("--tensor-parallel-size", "2", "--pipeline-parallel-size", "3",
                                    "--distributed-executor-backend", "ray")


def test_vllm_gang_has_no_server_on_a_worker() -> None:
    with pytest.raises(EngineOptionsError, match="no server part at rank 1"):
        VllmEngine().gang_command(spec(VllmOptions(), ("0",)), PartRole.SERVER, gang(1, 2))


# --- SGLang: every host runs the server with its rank -----------------------------------------

SGLANG_TAIL = {  # id -> the flags after --enable-metrics, before the rank's own
    "tp2-over-2-nodes": ("--tp-size", "2"),
    "pp2-over-2-nodes": ("--tp-size", "1", "--pp-size", "2"),
    "tp2xpp2-over-2-nodes": ("--tp-size", "2", "--pp-size", "2"),
}


@pytest.mark.parametrize(("case", "tp", "pp", "gpus"), VLLM_CASES, ids=[c[0] for c in VLLM_CASES])
@pytest.mark.parametrize(("rank", "role"), [(0, PartRole.SERVER), (1, PartRole.RANK)], ids=["rank0", "rank1"])
def test_sglang_gang_commands(case: str, tp: int, pp: int, gpus: tuple[str, ...], rank: int, role: PartRole) -> None:
    opts = SglangOptions(tensor_parallel=tp, pipeline_parallel=pp, mem_fraction_static=0.8)
    cmd = SglangEngine().gang_command(spec(opts, gpus), role, gang(rank, 2))
    assert cmd.argv == ("python3", "-m", "sglang.launch_server", "--model-path", "/models/big",
                        "--served-model-name", "big", "--host", "127.0.0.1", "--port", "8100",
                        "--max-running-requests", "4", "--context-length", "4096", "--enable-metrics",
                        *SGLANG_TAIL[case], "--nnodes", "2", "--node-rank", str(rank),
                        "--dist-init-addr", "10.0.0.1:29500", "--mem-fraction-static", "0.8")
    assert cmd.env == {}
    assert SglangEngine().gang_listen(role, gang(rank, 2)) is None
    # The rendezvous and the ports SGLang derives from it, on every rank.
    assert SglangEngine().gang_ports(role, gang(rank, 2)) == (PortRange(29500, 29515),)


@pytest.mark.parametrize(("rank", "role"), [(0, PartRole.RANK), (1, PartRole.SERVER), (1, PartRole.WORKER)])
def test_sglang_gang_refuses_a_role_it_has_not(rank: int, role: PartRole) -> None:
    with pytest.raises(EngineOptionsError, match=f"no {role.value} part at rank {rank}"):
        SglangEngine().gang_command(spec(SglangOptions(), ("0",)), role, gang(rank, 2))


# --- llama.cpp: rpc-server workers, then llama-server --rpc on the head ----------------------

def _head_argv(rpc: str) -> tuple[str, ...]:
    return ("llama-server", "--model", "/models/big", "--alias", "big", "--host", SOCKET, "--ctx-size", "16384",
            "--parallel", "4", "--threads", "16", "--rpc", rpc, "--n-gpu-layers", "all", "--split-mode", "layer",
            "--metrics", "--cors-origins", "localhost", "--no-cors-credentials", "--api-key-file", KEY)


@pytest.mark.parametrize("size", [2, 3], ids=["2-hosts", "3-hosts"])
def test_llamacpp_rpc_gang_commands(size: int) -> None:
    engine, opts = LlamaCppEngine(), LlamaCppOptions(split_mode="layer")
    endpoints = tuple(f"127.0.0.1:{41000 + r}" for r in range(1, size))
    head = engine.gang_command(spec(opts, ("0",), socket=True), PartRole.SERVER, gang(0, size, endpoints))
    assert head.argv == _head_argv(",".join(endpoints))
    assert head.env == {}
    for rank in range(1, size):
        worker = engine.gang_command(spec(opts, ("0",)), PartRole.WORKER, gang(rank, size))
        assert worker.argv == ("rpc-server", "-H", "127.0.0.1", "-p", "29500")
        assert engine.gang_listen(PartRole.WORKER, gang(rank, size)) == "127.0.0.1:29500"
        # Loopback only, reached through the agents' tunnel: nothing to confine on the gang's address.
        assert engine.gang_ports(PartRole.WORKER, gang(rank, size)) == ()
    assert engine.gang_listen(PartRole.SERVER, gang(0, size, endpoints)) is None


def test_llamacpp_cpu_gang_head_offloads_to_its_rpc_servers() -> None:
    # The one-host CPU rule (--n-gpu-layers 0 --device none) would turn the RPC devices off too.
    opts = LlamaCppOptions(device_selection="vulkan", rpc_binary="/opt/llama/ggml-rpc-server")
    head = LlamaCppEngine().gang_command(spec(opts, ()), PartRole.SERVER, gang(0, 2, ("127.0.0.1:41001",)))
    assert "--device" not in head.argv
    i = head.argv.index("--rpc")
    assert head.argv[i:i + 4] == ("--rpc", "127.0.0.1:41001", "--n-gpu-layers", "all")
    assert head.env == {"GGML_VK_VISIBLE_DEVICES": ""}  # no local Vulkan device on a CPU head
    worker = LlamaCppEngine().gang_command(spec(opts, ()), PartRole.WORKER, gang(1, 2))
    assert worker.argv == ("/opt/llama/ggml-rpc-server", "-H", "127.0.0.1", "-p", "29500", "-t", "16")
    assert worker.env == {"GGML_VK_VISIBLE_DEVICES": ""}


def test_llamacpp_vulkan_gpu_worker_sees_its_own_gpus() -> None:
    worker = LlamaCppEngine().gang_command(spec(LlamaCppOptions(device_selection="vulkan"), ("1", "2")),
                                           PartRole.WORKER, gang(1, 2))
    assert worker.env == {"GGML_VK_VISIBLE_DEVICES": "1,2"}


def test_llamacpp_one_host_split_options() -> None:
    cmd = LlamaCppEngine().build_command(spec(LlamaCppOptions(split_mode="row", tensor_split=[3, 1.5]), ("0", "1")))
    i = cmd.argv.index("--n-gpu-layers")
    assert cmd.argv[i:i + 6] == ("--n-gpu-layers", "all", "--split-mode", "row", "--tensor-split", "3,1.5")


def test_llamacpp_gang_head_needs_every_worker_endpoint() -> None:
    with pytest.raises(EngineOptionsError, match="endpoints of its 2 rpc-server workers"):
        LlamaCppEngine().gang_command(spec(LlamaCppOptions(), ()), PartRole.SERVER, gang(0, 3))
    with pytest.raises(EngineOptionsError, match="no worker part at rank 0"):
        LlamaCppEngine().gang_command(spec(LlamaCppOptions(), ()), PartRole.WORKER, gang(0, 2))


@pytest.mark.parametrize(("field", "value", "message"), [
    ("gang_id", "NOT-AN-ID", "gang_id"),
    ("rank", 2, "rank must be 0..1"),
    ("size", 1, "size must be 2.."),
    ("node_addresses", ("10.0.0.1",), "node_addresses"),
    ("node_addresses", ("10.0.0.1", "10.0.0.2:80"), "node_addresses"),
    ("port", 0, "port must be 1..65535"),
    ("worker_endpoints", ("127.0.0.1",), "not host:port"),
    ("worker_endpoints", ("127.0.0.1:1", "127.0.0.1:2"), "must list the 1 workers"),
])
def test_gang_addresses_refuse_inconsistent_values(field: str, value: object, message: str) -> None:
    fields: dict[str, object] = {"gang_id": GANG, "rank": 1, "size": 2, "node_addresses": ("10.0.0.1", "fd00::2"),
                                 "port": 29500}
    fields[field] = value
    with pytest.raises(ValueError, match=message):
        GangAddresses(**fields)  # type: ignore[arg-type]


def test_ipv6_head_endpoint_is_bracketed() -> None:
    g = GangAddresses(gang_id=GANG, rank=1, size=2, node_addresses=("fd00::1", "fd00::2"), port=29500)
    assert g.head_endpoint == "[fd00::1]:29500"
    assert g.self_address == "fd00::2"
