"""A model entry served by a gang: hosts, gang_port, parallelism, rank, and the shared part
(agent/config/gang.py, docs/configuration.md "Gangs")."""

from __future__ import annotations

import pytest

from viiwork.agent.config.gang import (
    PER_HOST_ENTRY_KEYS,
    SHARED_ENTRY_KEYS,
    GangConfigError,
    differing_keys,
    gang_rank,
    mismatch_message,
    needs_model_file,
    parse_digests,
    shared_digests,
    shared_hash,
    takes_part,
)
from viiwork.agent.config.load import ConfigError, parse_config
from viiwork.agent.config.schema import ModelConfig

NODE_B_ID = "abcdefghijklmnop"  # the shape of a node id
# A gang needs the mesh; hosts named by name need trust = "ca" (names bound by the CA).
MESH = '[mesh]\ntrust = "ca"\nca_certificate = "/etc/viiwork/mesh-ca.crt"\n'
OPEN_MESH = '[mesh]\ntrust = "open"\nmesh_id = "gangs"\n'


def entry(engine: str = "llamacpp", block: str = "", **keys: str) -> str:
    fields = {"name": '"big"', "engine": f'"{engine}"', "path": '"/models/big.gguf"',
              "hosts": f'["gpu-a", "{NODE_B_ID}", "gpu-c"]', "gang_port": "50052", **keys}
    lines = "\n".join(f"{k} = {v}" for k, v in fields.items() if v != "")
    return (f'{MESH}[[models]]\n{lines}\n' + (f"[models.{engine}]\n{block}\n" if block else ""))


def model(text: str) -> ModelConfig:
    return parse_config(text).models[0]


def issues(text: str) -> list[str]:
    with pytest.raises(ConfigError) as err:
        parse_config(text)
    return [str(i) for i in err.value.issues]


def test_a_gang_entry_loads_as_one_part_over_all_its_gpus() -> None:
    m = model(entry(gpus="[0, 1]"))
    assert m.hosts == ["gpu-a", NODE_B_ID, "gpu-c"]
    assert m.gang_port == 50052
    assert m.backend_count == 1
    assert m.backend_gpus(0) == ("0", "1")


@pytest.mark.parametrize(("keys", "expected"), [
    ({"hosts": '["gpu-a"]'}, "models[0].hosts: a gang spans at least 2 hosts (the first is the head), got 1"),
    ({"hosts": str([f"h{i}" for i in range(18)]).replace("'", '"')}, "models[0].hosts: a gang spans at most 17 hosts"),
    ({"hosts": '["gpu-a", "gpu b"]'}, "models[0].hosts[1]: not a node id or node name: 'gpu b'"),
    ({"hosts": '["gpu-a", ""]'}, "models[0].hosts[1]: not a node id or node name: ''"),
    ({"hosts": '["gpu-a", "gpu-b", "gpu-a"]'},
     "models[0].hosts[2]: 'gpu-a' is listed twice (hosts[0] and hosts[2]): a host runs one part"),
    ({"gang_port": ""}, "models[0].gang_port: a gang needs gang_port"),
    ({"gang_port": "80"}, "models[0].gang_port: Input should be greater than or equal to 1024"),
    ({"hosts": "", "gang_port": "50052"}, "models[0].gang_port: is for a model served by a gang (set hosts)"),
    ({"gpus": "[0, 1]", "gpus_per_backend": "1"}, "models[0].gpus_per_backend: not with hosts"),
    ({"backends": "2"}, "models[0].backends: not with hosts"),
], ids=["one-host", "too-many", "bad-name", "empty-name", "duplicate", "no-port", "low-port", "port-without-hosts",
        "gpus-per-backend", "backends"])
def test_bad_gang_entries_name_the_key(keys: dict[str, str], expected: str) -> None:
    found = issues(entry(**keys))
    assert any(i.startswith(expected) for i in found), found


@pytest.mark.parametrize(("engine", "block", "keys", "expected"), [
    ("vllm", "tensor_parallel = 2", {"hosts": "", "gang_port": "", "gpus": "[0, 1]"},
     "models[0].vllm.tensor_parallel: is for a model served by a gang (set hosts)"),
    ("sglang", "pipeline_parallel = 2", {"hosts": "", "gang_port": ""},
     "models[0].sglang.pipeline_parallel: is for a model served by a gang (set hosts)"),
    ("vllm", "tensor_parallel = 2\npipeline_parallel = 2", {"gpus": "[0, 1]"},
     "models[0].vllm.tensor_parallel: tensor_parallel x pipeline_parallel = 2 x 2 = 4 must equal the gang's GPUs, "
     "hosts x gpus = 3 x 2 = 6"),
    ("sglang", "tensor_parallel = 4", {"gpus": "[0]"},
     "models[0].sglang.tensor_parallel: tensor_parallel x pipeline_parallel = 4 x 3 = 12 must equal"),
    ("vllm", "", {}, "models[0].gpus: a vllm gang runs on GPUs"),
    ("vllm", "tensor_parallel = 0", {"gpus": "[0]"}, "models[0].vllm.tensor_parallel: Input should be greater"),
    ("llamacpp", 'split_mode = "none"', {}, "models[0].llamacpp.split_mode: must be one of"),
    ("llamacpp", "tensor_split = [0, 0]", {}, "models[0].llamacpp.tensor_split: tensor_split needs at least one"),
    ("llamacpp", "tensor_split = [-1, 1]", {}, "models[0].llamacpp.tensor_split[0]: Input should be greater"),
], ids=["tp-without-hosts", "pp-without-hosts", "tp-pp-mismatch", "sglang-mismatch", "vllm-cpu-gang", "tp-zero",
        "split-none", "split-all-zero", "split-negative"])
def test_bad_parallelism_is_refused_per_engine(engine: str, block: str, keys: dict[str, str], expected: str) -> None:
    found = issues(entry(engine, block, **keys))
    assert any(i.startswith(expected) for i in found), found


def test_parallel_sizes_that_multiply_to_the_gangs_gpus_load() -> None:
    m = model(entry("vllm", "tensor_parallel = 2\npipeline_parallel = 3", gpus="[0, 1]"))
    assert (m.options.tensor_parallel, m.options.pipeline_parallel) == (2, 3)
    assert model(entry("sglang", "", gpus="[0]")).options.tensor_parallel is None


def test_a_gang_on_an_engine_without_the_capability_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from viiwork.engines.llamacpp import LlamaCppEngine
    monkeypatch.delattr(LlamaCppEngine, "launch_shape")
    assert any(i.startswith("models[0].hosts: engine 'llamacpp' cannot serve one model across hosts")
               for i in issues(entry()))


# --- who takes part, as which rank ------------------------------------------------------------

def test_rank_is_the_index_in_hosts_by_id_or_by_name() -> None:
    m = model(entry())
    assert gang_rank(m, "zzzzzzzzzzzzzzzz", "gpu-a") == 0
    assert gang_rank(m, NODE_B_ID, "some-name") == 1
    assert gang_rank(m, None, "gpu-c") == 2
    assert gang_rank(m, "zzzzzzzzzzzzzzzz", "gpu-x") is None
    assert not takes_part(m, None, "gpu-x")
    assert takes_part(m, None, "gpu-a")


def test_a_host_listed_by_id_and_by_name_is_an_error() -> None:
    m = model(entry(hosts=f'["gpu-a", "{NODE_B_ID}", "gpu-b"]'))
    with pytest.raises(GangConfigError, match=r"names this node twice \(hosts\[1\] and hosts\[2\]"):
        gang_rank(m, NODE_B_ID, "gpu-b")


def test_a_one_host_entry_is_everyones() -> None:
    m = model(entry(hosts="", gang_port=""))
    assert gang_rank(m, None, "any") is None
    assert takes_part(m, None, "any")
    assert needs_model_file(m, None, "any")


@pytest.mark.parametrize(("engine", "block", "gpus", "node", "needs"), [
    ("llamacpp", "", "[0]", "gpu-a", True),       # the head loads the GGUF
    ("llamacpp", "", "[0]", "gpu-c", False),      # an rpc-server worker does not
    ("vllm", "", "[0]", "gpu-c", True),           # a Ray worker loads its shard
    ("sglang", "", "[0]", "gpu-c", True),         # every rank does
    ("llamacpp", "", "[0]", "gpu-x", False),      # a host not named ignores the entry
])
def test_which_hosts_need_the_model_file(engine: str, block: str, gpus: str, node: str, needs: bool) -> None:
    assert needs_model_file(model(entry(engine, block, gpus=gpus)), None, node) is needs


# --- the shared part ----------------------------------------------------------------------------

def test_every_entry_key_is_either_shared_or_per_host() -> None:
    assert set(SHARED_ENTRY_KEYS) | set(PER_HOST_ENTRY_KEYS) == set(ModelConfig.model_fields)
    assert not set(SHARED_ENTRY_KEYS) & set(PER_HOST_ENTRY_KEYS)


@pytest.mark.parametrize(("engine", "head", "worker"), [
    ("llamacpp", entry(gpus="[0]"), entry(gpus="[0, 1]", env='{ A = "1" }', sandbox='"strict"')),
    ("llamacpp", entry(block='binary = "/opt/a/llama-server"'),
     entry(block='binary = "/opt/b/llama-server"\nrpc_binary = "/opt/b/ggml-rpc-server"\nthreads = 8\n'
                 'device_selection = "vulkan"\nmetrics = false')),
    ("vllm", entry("vllm", "", gpus="[0]"),
     entry("vllm", 'python = "/opt/vllm/bin/python"\nray_binary = "/opt/vllm/bin/ray"', gpus="[3]",
           startup_timeout_s="3600.0")),
    ("sglang", entry("sglang", "", gpus="[0]"), entry("sglang", 'python = "/opt/sg/bin/python"', gpus="[1]")),
    # The sizes in force agree: unset on one host, written out on the other.
    ("vllm", entry("vllm", "", gpus="[0, 1]"), entry("vllm", "tensor_parallel = 2\npipeline_parallel = 3",
                                                     gpus="[4, 5]")),
], ids=["gpus-env-sandbox", "llamacpp-per-host-block", "vllm-per-host", "sglang-per-host", "sizes-in-force"])
def test_per_host_keys_leave_the_shared_hash_alone(engine: str, head: str, worker: str) -> None:
    a, b = model(head), model(worker)
    assert shared_hash(a) == shared_hash(b)
    assert differing_keys(shared_digests(a), shared_digests(b)) == ()


@pytest.mark.parametrize(("head", "worker", "keys"), [
    (entry(args='["--temp", "0"]'), entry(args='["--temp", "1"]'), ("args",)),
    (entry(), entry(block='split_mode = "row"'), ("llamacpp.split_mode",)),
    (entry(), entry(path='"/models/other.gguf"', gang_port="50053"), ("gang_port", "path")),
    (entry(), entry(hosts=f'["gpu-a", "{NODE_B_ID}"]'), ("hosts",)),
    (entry(ctx_per_slot="8192"), entry(ctx_per_slot="4096", parallel="8"), ("ctx_per_slot", "parallel")),
    (entry("vllm", "", gpus="[0, 1]"), entry("vllm", "", gpus="[0]"),
     ("vllm.tensor_parallel",)),
    (entry("vllm", "", gpus="[0]"), entry("sglang", "", gpus="[0]"),
     ("engine", "sglang.mem_fraction_static", "sglang.pipeline_parallel", "sglang.tensor_parallel",
      "vllm.gpu_memory_utilization", "vllm.pipeline_parallel", "vllm.tensor_parallel")),
], ids=["args", "split-mode", "path-and-port", "hosts", "ctx-and-parallel", "different-gpu-counts", "engine"])
def test_a_mismatch_names_the_differing_keys(head: str, worker: str, keys: tuple[str, ...]) -> None:
    a, b = model(head), model(worker)
    assert shared_hash(a) != shared_hash(b)
    found = differing_keys(shared_digests(a), parse_digests(shared_digests(b)))
    assert found == keys
    assert mismatch_message("big", "gpu-c", found) == (
        f"model 'big': host 'gpu-c' has a different gang entry: {', '.join(keys)} "
        "(write the same in every host's config; only gpus and per-host keys may differ)")


def test_digests_do_not_carry_the_values() -> None:
    digests = shared_digests(model(entry(args='["--api-key", "s3cret-value"]')))
    assert all(len(d) == 32 for d in digests.values())
    assert "s3cret" not in repr(digests)


@pytest.mark.parametrize(("value", "message"), [
    ([], "must be an object"),
    ({"args": "XYZ"}, "args: not 32 lowercase hex"),
    ({"Args": "0" * 32}, "bad key"),
    ({"a.b.c": "0" * 32}, "bad key"),
    ({f"k{i}": "0" * 32 for i in range(129)}, "at most 128 keys"),
])
def test_a_peers_digests_are_checked(value: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_digests(value)


def test_a_gang_entry_needs_the_mesh() -> None:
    (issue,) = issues(entry().removeprefix(MESH))
    assert "models[0].hosts" in issue and "needs [mesh]" in issue


def test_open_trust_needs_the_other_hosts_by_node_id() -> None:
    """Under open trust any member can take a name first (the attacker pass's finding): another
    host named by name is refused; node ids, and this node's own name, are fine."""
    text = entry().replace(MESH, OPEN_MESH)
    (issue,) = issues(text)
    assert issue.startswith("models[0].hosts: 'gpu-a', 'gpu-c' are not node ids (16 characters of a-z and 2-7) "
                            "under mesh trust \"open\"")
    assert "`viiworkctl mesh id`" in issue and 'trust = "ca"' in issue
    # Not even this host's own name: the entry must read the same on every host (its shared part).
    own = f'[node]\nname = "gpu-a"\n{entry(hosts=f"""["gpu-a", "{NODE_B_ID}"]""").replace(MESH, OPEN_MESH)}'
    assert issues(own)[0].startswith("models[0].hosts: 'gpu-a' is not a node id (16 characters of a-z and 2-7)")
    ids = entry(hosts=f'["{"a" * 16}", "{NODE_B_ID}"]').replace(MESH, OPEN_MESH)
    assert model(ids).hosts == ["a" * 16, NODE_B_ID]


@pytest.mark.parametrize(("extra", "port", "expected"), [
    ('[api]\nlisten = "127.0.0.1:50052"\n', "50052", "the gang's ports 50052..50052 hold api.listen's port 50052"),
    ("", "8087", "the gang's ports 8087..8087 hold mesh.listen's port 8087"),
], ids=["api-port", "mesh-port"])
def test_gang_port_must_not_hold_the_agents_own_ports(extra: str, port: str, expected: str) -> None:
    assert any(i.startswith(f"models[0].gang_port: {expected}") for i in issues(extra + entry(gang_port=port)))


def test_two_gangs_ports_must_not_overlap() -> None:
    second = entry().split("[[models]]\n", 1)[1].replace('name = "big"', 'name = "other"')
    two = entry() + "[[models]]\n" + second
    assert any(i.startswith("models[1].gang_port: the gang's ports 50052..50052 overlap model 'big'")
               for i in issues(two))
    ok = entry() + "[[models]]\n" + second.replace("gang_port = 50052", "gang_port = 50053")
    assert [m.gang_port for m in parse_config(ok).models] == [50052, 50053]
