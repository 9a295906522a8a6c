"""Doctor: facts gathered from recorded hosts, conflicts derived from them, verdicts and exit
codes, crashing checks, the generated docs, and `viiworkctl doctor` as a real subprocess."""

from __future__ import annotations

import datetime as dt
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO

from support.agent import render_config, run_agent
from support.engines import fake_engine_binary
from support.gpu_hosts import nvml_recording, write_drm_card
from support.procs import free_port
from viiwork.agent.config.load import parse_config
from viiwork.agent.host.doctor import (
    REGISTRY,
    Check,
    CheckResult,
    Skip,
    Verdict,
    derive_conflicts,
    exit_code_for,
    render_markdown,
    run_checks,
)
from viiwork.agent.host.facts import (
    AgentFacts,
    BinaryState,
    DiskFact,
    FactUnavailable,
    HostFacts,
    gather_facts,
    read_binary_facts,
    read_node_id,
    resolve_binary,
    version_at_least,
)
from viiwork.agent.host.gpus.amd import AmdSysfsReader
from viiwork.agent.host.gpus.inventory import Vendor
from viiwork.agent.host.gpus.nvml import NvmlReader
from viiwork.agent.host.gpus.nvml_record import ReplayNvml
from viiwork.agent.host.gpus.udev import PciGpu
from viiwork.engines.llamacpp import LlamaCppEngine

NOW = dt.datetime(2025, 6, 1, 12, 0, tzinfo=dt.UTC)
F, D, OK, S = Verdict.FAIL, Verdict.DEGRADED, Verdict.OK, Verdict.SKIPPED
LLAMA = Path(sys.executable).parent / "llama-server-vulkan"
VIIWORKCTL = Path(sys.executable).parent / "viiworkctl"


# -- building hosts -------------------------------------------------------------------------


def write_config(tmp_path: Path, models: list[dict] | None = None, mesh: dict | None = None,
                 port: int = 1) -> Path:
    """A config with state in tmp_path; models default to one CPU model whose file exists."""
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    if models is None:
        models = [model()]
    models = [{**m, "path": str(tmp_path / "m.gguf")} if m["path"] == "./m.gguf" else m for m in models]
    sections = {"node": {"name": "box", "state_dir": str(tmp_path / "state")},
                "api": {"listen": f"127.0.0.1:{port}", "admin_socket": str(tmp_path / "admin.sock")}}
    if mesh is not None:
        sections["mesh"] = mesh
    path = tmp_path / "viiwork.toml"
    path.write_text(render_config(sections, models))
    return path


def model(name: str = "m", gpus: list | None = None, binary: str = str(LLAMA), path: str | None = None) -> dict:
    out = {"name": name, "engine": "llamacpp", "path": path or "./m.gguf", "llamacpp": {"binary": binary}}
    if gpus is not None:
        out["gpus"] = gpus
    return out


def host(tmp_path: Path, config: Path, *, nvml: str = "nvml-driver-not-loaded", amd_cards: int = 0,
         dev: tuple[str, ...] = (), pci: tuple[PciGpu, ...] = (), net: dict[str, tuple[int, str]] | None = None,
         url: str | None = None, now: dt.datetime = NOW) -> HostFacts:
    """Gather real facts about a recorded host: NVML from a recording, sysfs/dev/net from trees."""
    root = tmp_path / "root"
    root.mkdir(exist_ok=True)
    for i in range(amd_cards):
        write_drm_card(root, i, f"0000:{0x43 + i:02x}:00.0", files={"unique_id": f"{i:016x}"})
    devdir = tmp_path / "dev"
    devdir.mkdir(exist_ok=True)
    for node in dev:
        target = devdir / node
        target.parent.mkdir(parents=True, exist_ok=True)
        target.touch()
    netdir = tmp_path / "net"
    for name, (flags, operstate) in (net or {"eth0": (0x1003, "up"), "lo": (0x9, "unknown")}).items():
        (netdir / name).mkdir(parents=True, exist_ok=True)
        (netdir / name / "flags").write_text(f"{flags:#x}\n")
        (netdir / name / "operstate").write_text(operstate + "\n")
    return gather_facts(config, url=url, gpu_sources=[NvmlReader(ReplayNvml(nvml_recording(nvml))),
                                                     AmdSysfsReader(root)],
                        pci_gpus=lambda: pci, dev_root=devdir, net_root=netdir, read_versions=False, now=now)


def found(results) -> set[tuple[str, str, str]]:
    return {(r.check, r.verdict.value, r.subject) for r in results}


NVIDIA_PCI = PciGpu(Vendor.NVIDIA, "0000:17:00.0", "10DE:2330", None)
AMD_PCI = PciGpu(Vendor.AMD, "0000:43:00.0", "1002:744C", "vfio-pci")
UUID1 = "GPU-0e6f2a19-4c7d-8b3a-5f1e-9d2c6b8a4e70"

# id, host kwargs, models (None = one CPU model), expected conflicts {(check, verdict, subject)}
CONFLICTS = [
    ("cpu-box-cpu-model", {}, None, set()),
    ("cpu-box-no-model", {}, [], set()),
    ("gpus-visible-all-models-on-cpu", {"nvml": "nvml-2x-h100"}, None, {("gpu.cpu_only", "degraded", "")}),
    ("gpus-visible-no-model-configured", {"nvml": "nvml-2x-h100"}, [], set()),
    ("gpus-used", {"nvml": "nvml-2x-h100"}, [model(gpus=[0]), model("n", gpus=[UUID1])], set()),
    ("device-node-without-nvml", {"dev": ("nvidia0", "nvidiactl")}, None, {("gpu.nvidia", "degraded", "")}),
    ("nvidia-on-pci-without-driver", {"pci": (NVIDIA_PCI,)}, None, {("gpu.nvidia", "degraded", "")}),
    ("nvml-version-mismatch", {"nvml": "nvml-init-version-mismatch", "dev": ("nvidia0",)}, None,
     {("gpu.nvidia", "degraded", "")}),
    ("nvml-version-mismatch-gpu-configured", {"nvml": "nvml-init-version-mismatch", "dev": ("nvidia0",)},
     [model(gpus=[0])], {("gpu.nvidia", "degraded", ""), ("config.gpus", "fail", "models[0].gpus")}),
    ("gpu-fell-off-the-bus", {"nvml": "nvml-gpu-lost"}, [model(gpus=[0])], {("gpu.nvidia", "fail", "GPU 1")}),
    ("pci-gpu-invisible-to-nvml",
     {"nvml": "nvml-2x-h100", "pci": (PciGpu(Vendor.NVIDIA, "0000:e3:00.0", "10DE:2330", "vfio-pci"),)},
     [model(gpus=[0])], {("gpu.nvidia", "degraded", "0000:e3:00.0")}),
    ("kfd-without-amd-card", {"dev": ("kfd",)}, None, {("gpu.amd", "degraded", "")}),
    ("amd-on-pci-bound-elsewhere", {"pci": (AMD_PCI,)}, None, {("gpu.amd", "degraded", "")}),
    ("amd-box-model-on-amd", {"amd_cards": 2, "dev": ("kfd", "dri/renderD128")}, [model(gpus=[1])], set()),
    ("gpu-index-missing", {"nvml": "nvml-2x-h100"}, [model(gpus=[2])], {("config.gpus", "fail", "models[0].gpus")}),
    ("binary-missing", {}, [model(binary="/nonexistent/llama-server")],
     {("engine.binary", "fail", "llamacpp: /nonexistent/llama-server")}),
    ("model-file-missing", {}, [model(path="/nonexistent/model.gguf")],
     {("model.path", "fail", "models[0].path")}),
]


def _model_path(tmp_path: Path, kind: str) -> str:
    """A model path of ``kind``, made for real: a FIFO, a directory, a device, /proc's size-0 file."""
    if kind == "fifo":
        os.mkfifo(tmp_path / "m.fifo")
        return str(tmp_path / "m.fifo")
    if kind == "directory":
        (tmp_path / "hf").mkdir()
        (tmp_path / "hf" / "config.json").write_text("{}")
        return str(tmp_path / "hf")
    if kind == "empty":
        (tmp_path / "empty.gguf").write_bytes(b"")
        return str(tmp_path / "empty.gguf")
    if kind == "symlink":
        (tmp_path / "real.gguf").write_bytes(b"GGUF")
        (tmp_path / "link.gguf").symlink_to(tmp_path / "real.gguf")
        return str(tmp_path / "link.gguf")
    return {"dev-zero": "/dev/zero", "proc-self-mem": "/proc/self/mem", "file": str(tmp_path / "m.gguf")}[kind]


@pytest.mark.parametrize(("engine", "kind", "says"), [
    ("llamacpp", "fifo", "is not a GGUF file: it is a FIFO (named pipe)"),
    ("llamacpp", "dev-zero", "is not a GGUF file: it is a character device"),
    ("llamacpp", "proc-self-mem", "is empty: 0 bytes"),
    ("llamacpp", "directory", "is not a GGUF file: it is a directory"),
    ("llamacpp", "empty", "is empty: 0 bytes"),
    ("llamacpp", "symlink", None),
    ("llamacpp", "file", None),
    ("vllm", "directory", None),
    ("sglang", "directory", None),
    ("vllm", "fifo", "is not a model file or folder: it is a FIFO (named pipe)"),
    ("sglang", "dev-zero", "is not a model file or folder: it is a character device"),
], ids=lambda v: v if isinstance(v, str) and " " not in v else "")
def test_a_model_path_must_be_what_its_engine_loads(tmp_path: Path, engine: str, kind: str, says: str | None) -> None:
    """llama.cpp loads a GGUF file; vLLM and SGLang also a Hugging Face folder; never a FIFO or
    a device (the check only stats: a FIFO without a writer would block an open)."""
    path = _model_path(tmp_path, kind)
    models = [{"name": "m", "engine": engine, "path": path}]
    config = write_config(tmp_path, models)
    (result,) = run_checks(host(tmp_path, config), [c for c in REGISTRY if c.id == "model.path"]).results
    if says is None:
        assert (result.verdict, result.summary) == (Verdict.OK, path)
    else:
        assert result.verdict is Verdict.FAIL and result.summary == f"{path} {says} (model m)", result
        assert result.subject == "models[0].path" and "models[0].path" in result.remedy


@pytest.mark.parametrize(("engine", "hosts", "checked"), [
    ("llamacpp", ["other", "box"], False),  # an rpc-server worker reads no model file
    ("llamacpp", ["box", "other"], True),   # the head does
    ("llamacpp", ["other", "third"], False),  # a host the entry does not name ignores it
    ("sglang", ["other", "box"], True),     # every SGLang rank loads its shard
], ids=["llamacpp-worker", "llamacpp-head", "not-named", "sglang-rank"])
def test_a_gang_worker_that_reads_no_model_file_is_not_checked(tmp_path: Path, engine: str, hosts: list[str],
                                                                  checked: bool) -> None:
    """A missing file fails the check only on a host that reads it (docs/configuration.md, "Gangs")."""
    entry = {"name": "m", "engine": engine, "path": str(tmp_path / "absent.gguf"), "hosts": hosts,
             "gang_port": 50052, "gpus": [0] if engine == "sglang" else []}
    config = write_config(tmp_path, [entry], mesh={"trust": "ca", "ca_certificate": str(tmp_path / "ca.crt")})
    facts = host(tmp_path, config)
    assert [p.model for p in facts.model_paths] == (["m"] if checked else [])
    (result,) = run_checks(facts, [c for c in REGISTRY if c.id == "model.path"]).results
    assert result.verdict is (Verdict.FAIL if checked else Verdict.SKIPPED), result


@pytest.mark.parametrize(("engine", "firewall", "nft", "verdict"), [
    ("sglang", True, True, Verdict.OK),
    ("sglang", True, False, Verdict.FAIL),
    ("vllm", True, False, Verdict.FAIL),
    ("sglang", False, False, Verdict.SKIPPED),   # gang_firewall = false: no rules, no nft needed
    ("llamacpp", True, False, Verdict.SKIPPED),  # rpc-server on loopback behind the agents' tunnel
], ids=["sglang", "sglang-no-nft", "vllm-no-nft", "firewall-off", "llamacpp"])
def test_gang_entries_whose_parts_need_rules_need_nft(tmp_path: Path, engine: str, firewall: bool, nft: bool,
                                                     verdict: Verdict) -> None:
    """gang.firewall: a vLLM or SGLang gang with gang_firewall on needs nft (agent/gang/firewall.py)."""
    from dataclasses import replace

    from viiwork.agent.host.facts import read_gang_firewall

    entry = {"name": "m", "engine": engine, "path": str(tmp_path), "hosts": ["box", "other"], "gang_port": 29500,
             "gpus": [] if engine == "llamacpp" else [0], "gang_firewall": firewall}
    config = write_config(tmp_path, [entry], mesh={"trust": "ca", "ca_certificate": str(tmp_path / "ca.crt")})
    bin_dir = tmp_path / "sbin"
    bin_dir.mkdir()
    if nft:
        (bin_dir / "nft").write_text("#!/bin/sh\n")
        (bin_dir / "nft").chmod(0o755)
    facts = host(tmp_path, config)
    facts = replace(facts, gang_firewall=read_gang_firewall(parse_config(config.read_text()), path=str(bin_dir)))
    (result,) = run_checks(facts, [c for c in REGISTRY if c.id == "gang.firewall"]).results
    assert result.verdict is verdict, result
    if verdict is Verdict.FAIL:
        assert result.summary == "nft is not installed; model(s) m need it"
        assert "apt install nftables" in result.remedy and "gang_firewall = false" in result.remedy
    if verdict is Verdict.OK:
        assert result.summary == f"{bin_dir / 'nft'}, for model(s) m"


def test_a_gang_worker_named_by_its_node_id_finds_itself(tmp_path: Path) -> None:
    """The doctor reads the node id from the node key, so a host listed by id is found too."""
    from viiwork.mesh.identity import load_or_create_identity

    node_id = load_or_create_identity(tmp_path / "state").node_id
    entry = {"name": "m", "engine": "llamacpp", "path": str(tmp_path / "absent.gguf"),
             "hosts": ["other", node_id], "gang_port": 50052}
    config = write_config(tmp_path, [entry], mesh={"trust": "ca", "ca_certificate": str(tmp_path / "ca.crt")})
    assert read_node_id(parse_config(config.read_text())) == node_id
    assert host(tmp_path, config).model_paths == ()
    (tmp_path / "state" / "node.key").chmod(0o644)  # a key others may read is refused: id unknown
    assert read_node_id(parse_config(config.read_text())) is None


def test_config_check_fails_a_fifo_model_path_without_opening_it(tmp_path: Path) -> None:
    """`viiworkctl config check` runs model.path: a FIFO used to pass as ok."""
    config = write_config(tmp_path, [model(path=_model_path(tmp_path, "fifo"))])
    done = subprocess.run([sys.executable, "-m", "viiwork.agent.cli", "config", "check", "--json", str(config)],
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 1, done.stderr
    errors = json.loads(done.stdout)["errors"]
    assert [e["path"] for e in errors] == ["models[0].path"] and "FIFO" in errors[0]["message"], errors


@pytest.mark.parametrize(("kwargs", "models", "expected"), [c[1:] for c in CONFLICTS], ids=[c[0] for c in CONFLICTS])
def test_conflicts_from_recorded_hosts(tmp_path, kwargs, models, expected):
    facts = host(tmp_path, write_config(tmp_path, models), **kwargs)
    assert found(derive_conflicts(facts)) == expected


def test_not_executable_binary(tmp_path):
    binary = tmp_path / "llama-server"
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o644)
    facts = host(tmp_path, write_config(tmp_path, [model(binary=str(binary))]))
    (result,) = [r for r in derive_conflicts(facts) if r.check == "engine.binary"]
    assert result.verdict is F and "is not executable" in result.summary
    assert result.remedy == f"`chmod +x {binary}` or set models[0].llamacpp.binary to its full path"


def test_binary_on_path_resolution(tmp_path):
    good, bad = tmp_path / "a", tmp_path / "b"
    good.mkdir()
    bad.mkdir()
    (bad / "tool").write_text("")
    (good / "tool").write_text("#!/bin/sh\n")
    (good / "tool").chmod(0o755)
    assert resolve_binary("tool", f"{bad}:{good}")[:2] == (BinaryState.OK, str(good / "tool"))
    assert resolve_binary("tool", str(bad))[0] is BinaryState.NOT_EXECUTABLE
    assert resolve_binary("tool", str(tmp_path))[0] is BinaryState.MISSING
    assert resolve_binary(str(tmp_path), "")[0] is BinaryState.NOT_EXECUTABLE


# -- engine versions ------------------------------------------------------------------------


class VersionedLlamaCpp(LlamaCppEngine):
    """llama.cpp with the Version capability, to drive the capability path with the real binary."""

    minimum_version = "0.0.5"

    def version_command(self, options):
        return (options.binary, "--version")

    def parse_version(self, output):
        for line in output.splitlines():
            if line.startswith("version: "):
                return line.split()[1]
        return None


def test_version_from_the_real_binary_without_capability(tmp_path):
    config = parse_config(render_config({}, [model()]))
    (fact,) = read_binary_facts(config)
    assert fact.state is BinaryState.OK and fact.version_source == "--version"
    assert fact.version.startswith("version: ")


@pytest.mark.parametrize(("minimum", "verdict"), [("0.0.5", OK), ("0.1.0", OK), ("9.0", F)])
def test_version_capability_compared_with_minimum(tmp_path, minimum, verdict):
    engine = VersionedLlamaCpp()
    engine.minimum_version = minimum
    config = parse_config(render_config({}, [model()]))
    (fact,) = read_binary_facts(config, engines={"llamacpp": engine})
    assert fact.version_source == "engine" and fact.version == "0.1.0-dev" and fact.minimum_version == minimum
    facts = HostFacts(NOW, host(tmp_path, write_config(tmp_path)).config, binaries=(fact,))
    (result,) = [r for r in run_checks(facts, [c for c in REGISTRY if c.id == "engine.version"]).results]
    assert result.verdict is verdict, result.summary


def test_version_command_that_fails_is_degraded(tmp_path):
    broken = tmp_path / "llama-server"
    broken.write_text("#!/bin/sh\necho 'error while loading shared libraries: libvulkan.so.1' >&2\nexit 127\n")
    broken.chmod(0o755)
    config = parse_config(render_config({}, [model(binary=str(broken))]))
    (fact,) = read_binary_facts(config)
    assert fact.version is None
    assert fact.version_error == (f"`{broken} --version` exited with status 127: "
                                  "error while loading shared libraries: libvulkan.so.1")
    facts = HostFacts(NOW, host(tmp_path, write_config(tmp_path)).config, binaries=(fact,))
    (result,) = run_checks(facts, [c for c in REGISTRY if c.id == "engine.version"]).results
    assert result.verdict is D and "libvulkan.so.1" in result.summary


@pytest.mark.parametrize(("version", "minimum", "expected"), [
    ("0.6.3", "0.6.0", True), ("0.6", "0.6.0", True), ("v0.5.9", "0.6", False), ("b4520", "4000", True),
    ("dev", "0.6", None), ("12.1.post1", "12.1", True),
])
def test_version_at_least(version, minimum, expected):
    assert version_at_least(version, minimum) is expected


# -- disks and mesh -------------------------------------------------------------------------

GiB = 1024 ** 3


@pytest.mark.parametrize(("free", "verdict"), [(50 * GiB, OK), (GiB, D), (10 * 1024 ** 2, F)],
                         ids=["plenty", "low", "critical"])
def test_disk_space(tmp_path, free, verdict):
    base = host(tmp_path, write_config(tmp_path))
    facts = HostFacts(NOW, base.config, disks=(DiskFact(("state dir /var/lib/viiwork",), "/var/lib", free, 100 * GiB),))
    (result,) = run_checks(facts, [c for c in REGISTRY if c.id == "disk.space"]).results
    assert result.verdict is verdict and result.subject == "state dir /var/lib/viiwork"


def test_real_disk_facts(tmp_path):
    facts = host(tmp_path, write_config(tmp_path))
    (disk,) = facts.disks  # state dir and model share tmp_path's filesystem
    assert disk.roles == (f"state dir {tmp_path / 'state'}", "model m") and 0 < disk.free_bytes <= disk.total_bytes


OPEN = {"trust": "open", "mesh_id": "lab"}
NET = {"eth0": (0x1003, "up"), "eth1": (0x1003, "down"), "wg0": (0x91, "unknown"), "lo": (0x9, "unknown")}
DISCOVERY = [
    ("all-interfaces", {}, set()),
    ("chosen-up", {"interfaces": ["eth0"]}, set()),
    ("chosen-down-no-seeds", {"interfaces": ["eth1"]},
     {("mesh.discovery", "degraded", "eth1"), ("mesh.discovery", "fail", "")}),
    ("no-multicast-with-seeds", {"interfaces": ["wg0"], "seeds": ["10.0.0.2:8087"]},
     {("mesh.discovery", "degraded", "wg0"), ("mesh.discovery", "degraded", "")}),
    ("missing-interface", {"interfaces": ["eth9", "eth0"]}, {("mesh.discovery", "degraded", "eth9")}),
    ("loopback-address-only", {"interfaces": ["127.0.0.1"]},
     {("mesh.discovery", "degraded", "127.0.0.1"), ("mesh.discovery", "fail", "")}),
    ("address-not-here", {"interfaces": ["192.0.2.77"], "seeds": ["10.0.0.2:8087"]},
     {("mesh.discovery", "degraded", "192.0.2.77"), ("mesh.discovery", "degraded", "")}),
    ("seeds-only-empty", {"discovery": ["seeds"]}, {("mesh.discovery", "fail", "")}),
    ("seeds-only", {"discovery": ["seeds"], "seeds": ["10.0.0.2:8087"]}, set()),
]


@pytest.mark.parametrize(("mesh", "expected"), [c[1:] for c in DISCOVERY], ids=[c[0] for c in DISCOVERY])
def test_mdns_discovery(tmp_path, mesh, expected):
    facts = host(tmp_path, write_config(tmp_path, mesh={**OPEN, **mesh}), net=NET)
    conflicts = found(r for r in derive_conflicts(facts) if r.check == "mesh.discovery")
    assert conflicts == expected


def test_no_multicast_interface_at_all(tmp_path):
    facts = host(tmp_path, write_config(tmp_path, mesh=OPEN), net={"lo": (0x9, "unknown"), "wg0": (0x91, "unknown")})
    (result,) = [r for r in derive_conflicts(facts) if r.check == "mesh.discovery"]
    assert result.verdict is F and "mDNS impossible on wg0 and no seeds" in result.summary


def test_open_trust_is_degraded(tmp_path):
    facts = host(tmp_path, write_config(tmp_path, mesh=OPEN))
    assert found(r for r in derive_conflicts(facts) if r.check == "mesh.trust") == {("mesh.trust", "degraded", "")}


def test_mesh_without_trust_is_a_config_fail(tmp_path):
    facts = host(tmp_path, write_config(tmp_path, mesh={"listen": "0.0.0.0:8087"}))
    report = run_checks(facts, agent=False)
    (config,) = [r for r in report.results if r.check == "config"]
    assert config.verdict is F and "mesh.trust: " in config.summary
    assert {r.verdict for r in report.results if r.check.startswith("mesh.")} == {S}


def _enrol(tmp_path: Path, *, days: int = 365, now: dt.datetime | None = None, other_ca: bool = False):
    from viiwork.mesh import identity, trust

    ca = trust.init_ca(tmp_path / "ca")
    state = tmp_path / "state"
    me = identity.load_or_create_identity(state)
    key, cert = trust.load_ca(tmp_path / "ca")
    signer = (key, cert)
    if other_ca:
        other = trust.init_ca(tmp_path / "other-ca")
        signer = trust.load_ca(other.cert_path.parent)
    pem = trust.sign_request(*signer, trust.make_signing_request(me, "box"), days=days, now=now)
    (state / trust.NODE_CERT_FILE).write_bytes(pem)
    return ca.cert_path


def _replace_node_key(state: Path) -> None:
    from viiwork.mesh import identity

    (state / identity.KEY_FILE).unlink()
    identity.load_or_create_identity(state)


MESH_TRUST = [
    ("enrolled", {}, lambda s: None, set()),
    ("not-enrolled", {}, lambda s: (s / "node.crt").unlink(), {("mesh.trust", "fail", "node certificate")}),
    ("other-ca", {"other_ca": True}, lambda s: None, {("mesh.trust", "fail", "node certificate")}),
    ("expiring", {"days": 7}, lambda s: None, {("mesh.trust", "degraded", "node certificate")}),
    ("key-readable-by-others", {}, lambda s: (s / "node.key").chmod(0o644), {("mesh.trust", "fail", "node key")}),
    ("key-of-another-node", {}, _replace_node_key, {("mesh.trust", "fail", "node key")}),
]


@pytest.mark.parametrize(("enrol", "damage", "expected"), [c[1:] for c in MESH_TRUST], ids=[c[0] for c in MESH_TRUST])
def test_mesh_trust_with_real_certificates(tmp_path, enrol, damage, expected):
    ca_path = _enrol(tmp_path, **enrol)
    damage(tmp_path / "state")
    config = write_config(tmp_path, mesh={"trust": "ca", "ca_certificate": str(ca_path)})
    facts = host(tmp_path, config, now=dt.datetime.now(dt.UTC))
    assert found(r for r in derive_conflicts(facts) if r.check == "mesh.trust") == expected


def test_expired_certificate_is_a_fail(tmp_path):
    ca_path = _enrol(tmp_path, days=30)
    facts = host(tmp_path, write_config(tmp_path, mesh={"trust": "ca", "ca_certificate": str(ca_path)}),
                 now=dt.datetime.now(dt.UTC))
    later = dt.datetime.now(dt.UTC) + dt.timedelta(days=60)
    from viiwork.agent.host.facts import read_mesh_facts

    mesh = read_mesh_facts(facts.config.config, tmp_path / "net", later)
    results = derive_conflicts(HostFacts(later, facts.config, mesh=mesh))
    (cert,) = [r for r in results if r.subject == "node certificate"]
    assert cert.verdict is F and "CertificateExpired" in cert.summary


# -- the running agent's report (pure, from status documents) -------------------------------


def status(models, gpus=None, name="box"):
    doc = {"node": {"name": name, "version": "0.1.0", "uptime_s": 12.5}, "models": models}
    if gpus is not None:
        doc["gpus"] = gpus
    return doc


def backend(state, reason="", progress=-1.0, phase=""):
    return {"id": f"b-{state}", "state": state, "reason": reason, "progress": progress, "phase": phase}


AGENT = [
    ("all-healthy", status([{"name": "m", "state": "running", "slots": 4, "busy": 1, "backends": [backend("healthy")]}]),
     set()),
    ("one-dead-one-healthy",
     status([{"name": "m", "state": "running", "backends": [backend("healthy"), backend("dead", "exit 1")]}]),
     {("agent.backends", "degraded", "m")}),
    ("all-dead", status([{"name": "m", "state": "dead", "backends": [backend("dead", "exited with status 1")]}]),
     {("agent.backends", "fail", "m")}),
    ("unhealthy", status([{"name": "m", "state": "running", "backends": [backend("unhealthy", "probe refused")]}]),
     {("agent.backends", "degraded", "m")}),
    ("down-on-purpose", status([{"name": "m", "state": "down", "backends": [backend("stopped")]}]), set()),
    ("starting",
     status([{"name": "m", "state": "running", "backends": [backend("starting", progress=0.4, phase="loading model")]}]),
     set()),
    ("config-not-reloaded", status([{"name": "old", "state": "running", "backends": [backend("healthy")]}]),
     {("agent.config", "degraded", "")}),
    ("gpu-vanished", status([{"name": "m", "state": "running", "backends": [backend("healthy")]}],
                            {"gpus": [], "lost_backends": [{"backend": "m-0", "model": "m", "gpu": "1 (...)", "age_s": 3}],
                             "placements": []}), {("agent.gpus", "fail", "m-0")}),
    ("placement-mismatch", status([{"name": "m", "state": "running", "backends": [backend("healthy")]}],
                                  {"gpus": [{}], "lost_backends": [], "placements": [
                                      {"backend": "m-0", "verdict": "mismatch",
                                       "reason": "runs on GPU(s) it was not given: GPU-b"}]}),
     {("agent.gpus", "degraded", "m-0")}),
]


@pytest.mark.parametrize(("doc", "expected"), [c[1:] for c in AGENT], ids=[c[0] for c in AGENT])
def test_agent_checks(tmp_path, doc, expected):
    base = host(tmp_path, write_config(tmp_path))
    facts = HostFacts(NOW, base.config, agent=AgentFacts("http://127.0.0.1:8086", True, doc))
    report = run_checks(facts, [c for c in REGISTRY if c.agent])
    assert found(r for r in report.results if r.verdict in (D, F)) == expected


@pytest.mark.parametrize(("conflict", "verdict", "words"), [
    (None, OK, "no other agent publishes node id n1"),
    ({"other_address": "10.0.0.2:8087", "other_boot": "ff", "this_boot": "11", "this_boot_leaves": False}, F,
     "also run by the agent at 10.0.0.2:8087"),
], ids=["alone", "copied state dir"])
def test_mesh_identity_conflict_is_reported(tmp_path, conflict, verdict, words):
    doc = status([]) | {"mesh": {"self": {"id": "n1", "identity_conflict": conflict}}}
    facts = HostFacts(NOW, host(tmp_path, write_config(tmp_path)).config, agent=AgentFacts("http://127.0.0.1:1", True, doc))
    (result,) = [r for r in run_checks(facts).results if r.check == "agent.mesh_identity"]
    assert result.verdict is verdict and words in result.summary
    if verdict is F:
        assert "own node.state_dir" in result.remedy and "the other agent stops" in result.summary


@pytest.mark.parametrize(("pending", "verdict", "words"), [
    ([], OK, "every write into /s succeeded"),
    ([{"what": "name pins", "path": "/s/known_nodes.json", "error": "No space left on device", "errno": "ENOSPC",
       "since": 1.0, "attempts": 3}], D, "1 write into /s pending: name pins: No space left on device (ENOSPC, 3 attempts)"),
    ([{"what": "name pins", "path": "/s/known_nodes.json", "error": "Read-only file system", "errno": "EROFS",
       "since": 1.0, "attempts": 1}], D, "(EROFS, 1 attempt)"),
], ids=["none", "disk full", "one attempt"])
def test_pending_state_dir_writes_are_reported(tmp_path, pending, verdict, words):
    doc = status([]) | {"state_dir": {"path": "/s", "pending_writes": pending}}
    facts = HostFacts(NOW, host(tmp_path, write_config(tmp_path)).config, agent=AgentFacts("http://127.0.0.1:1", True, doc))
    (result,) = [r for r in run_checks(facts).results if r.check == "agent.state_dir"]
    assert result.verdict is verdict and words in result.summary, result.summary


@pytest.mark.parametrize(("usage", "verdict", "words"), [
    ({"path": "/s/usage.sqlite3", "rows_written": 12, "backlog": 0, "dropped": 0, "last_error": ""}, OK,
     "12 rows written to /s/usage.sqlite3 since start"),
    ({"path": "/s/usage.sqlite3", "rows_written": 12, "backlog": 40, "dropped": 0,
      "last_error": "OperationalError: database or disk is full"}, D,
     "40 rows waiting in memory for /s/usage.sqlite3: OperationalError: database or disk is full"),
    ({"path": "/s/usage.sqlite3", "rows_written": 12, "backlog": 100000, "dropped": 7, "last_error": "full"}, F,
     "7 rows dropped since start; 100000 rows waiting in memory: full"),
], ids=["writing", "backlog", "dropped"])
def test_usage_ledger_backlog_is_reported(tmp_path, usage, verdict, words):
    doc = status([]) | {"usage": usage}
    facts = HostFacts(NOW, host(tmp_path, write_config(tmp_path)).config, agent=AgentFacts("http://127.0.0.1:1", True, doc))
    (result,) = [r for r in run_checks(facts).results if r.check == "agent.usage"]
    assert result.verdict is verdict and words in result.summary, result.summary


def seed(address, answered=False, attempts=1, error="connection refused"):
    return {"address": address, "node_id": "nb" if answered else None, "attempts": attempts,
            "failures": 0 if answered else attempts, "answered": answered, "last_error": None if answered else error,
            "retry_in_ms": 0 if answered else 4000}


DEAD7 = [seed(f"10.0.0.{i}:8087") for i in range(1, 8)]


@pytest.mark.parametrize(("seeds", "alive", "verdict", "words"), [
    ([seed("10.0.0.2:8087", answered=True), seed("10.0.0.3:8087", attempts=0, error=None)], 1, OK,
     "1 of 2 seeds answered (1 not dialed yet)"),
    ([seed("10.0.0.2:8087", answered=True), seed("10.0.0.9:8087", error="timed out")], 1, D,
     "1 of 2 seeds never answered: 10.0.0.9:8087 (timed out)"),
    ([seed("10.0.0.9:8087", error="no route to host")], 2, D, "1 of 1 seed never answered: 10.0.0.9:8087"),
    (DEAD7, 0, F, "7 of 7 seeds never answered: 10.0.0.1:8087 (connection refused), 10.0.0.2:8087 (connection "
                  "refused), 10.0.0.3:8087 (connection refused), 10.0.0.4:8087 (connection refused), 10.0.0.5:8087 "
                  "(connection refused) and 2 more; no peer is alive"),
    ([], 0, S, "the agent dials no seeds"),
    (None, 0, S, "older version"),
], ids=["all-answered", "one-dead-one-answered", "dead-but-peers-alive", "none-answered", "no-seeds", "old-agent"])
def test_seeds_that_never_answered_are_named(tmp_path, seeds, alive, verdict, words):
    mesh = {"self": {"id": "n1"}, "peers": {"alive": alive} if alive else {}}
    if seeds is not None:
        mesh["seeds"] = seeds
    doc = status([]) | {"mesh": mesh}
    facts = HostFacts(NOW, host(tmp_path, write_config(tmp_path)).config, agent=AgentFacts("http://127.0.0.1:1", True, doc))
    (result,) = [r for r in run_checks(facts).results if r.check == "agent.mesh_seeds"]
    assert result.verdict is verdict and words in result.summary, result.summary
    if verdict in (D, F):
        assert "remove dead seeds from mesh.seeds" in result.remedy and "host:port" in result.remedy
        assert "10.0.0.6:8087" not in result.summary  # at most 5 named


def test_a_standalone_agent_has_no_seeds_to_check(tmp_path):
    facts = HostFacts(NOW, host(tmp_path, write_config(tmp_path)).config,
                      agent=AgentFacts("http://127.0.0.1:1", True, status([])))
    (result,) = [r for r in run_checks(facts).results if r.check == "agent.mesh_seeds"]
    assert result.verdict is S and "no mesh" in result.summary


def test_starting_backend_shows_phase_and_progress(tmp_path):
    doc = AGENT[5][1]
    facts = HostFacts(NOW, host(tmp_path, write_config(tmp_path)).config, agent=AgentFacts("http://127.0.0.1:1", True, doc))
    (result,) = [r for r in run_checks(facts).results if r.check == "agent.backends"]
    assert result.summary == "0/1 healthy, ?/? slots busy; starting: loading model 40%"


def test_remote_agent_is_not_compared_with_the_local_config(tmp_path):
    doc = AGENT[6][1]
    facts = HostFacts(NOW, host(tmp_path, write_config(tmp_path)).config, agent=AgentFacts("http://10.1.2.3:8086", True, doc))
    (result,) = [r for r in run_checks(facts).results if r.check == "agent.config"]
    assert result.verdict is S and "not this host" in result.summary


def test_agent_down_is_degraded_and_its_checks_skip(tmp_path):
    facts = HostFacts(NOW, host(tmp_path, write_config(tmp_path)).config,
                      agent=AgentFacts("http://127.0.0.1:1", False, None, "Connection refused"))
    report = run_checks(facts, [c for c in REGISTRY if c.agent])
    assert [(r.check, r.verdict) for r in report.results] == [
        ("agent.reachable", D), ("agent.backends", S), ("agent.config", S), ("agent.state_dir", S), ("agent.usage", S),
        ("agent.gpus", S),
        ("agent.mesh_identity", S), ("agent.mesh_seeds", S)]


# -- verdicts, exit codes, crashing checks --------------------------------------------------


@pytest.mark.parametrize(("verdicts", "code"), [
    ([], 0), ([OK], 0), ([OK, S], 0), ([S], 0), ([OK, D], 2), ([D, D, S], 2), ([OK, F], 1), ([D, F], 1), ([F], 1),
])
def test_exit_codes(verdicts, code):
    assert exit_code_for(verdicts) == code


def _facts(tmp_path):
    return host(tmp_path, write_config(tmp_path))


def test_a_check_that_raises_becomes_fail(tmp_path):
    def boom(facts):
        raise RuntimeError("sysfs exploded")

    def skip(facts):
        raise Skip("not here")

    def unavailable(facts):
        raise FactUnavailable("could not read gpus: OSError: boom")

    checks = [Check("t.boom", "boom", boom), Check("t.skip", "skip", skip), Check("t.gone", "gone", unavailable),
              Check("t.ok", "ok", lambda f: CheckResult("t.ok", OK, "fine"))]
    report = run_checks(_facts(tmp_path), checks)
    assert [(r.check, r.verdict) for r in report.results] == [("t.boom", F), ("t.skip", S), ("t.gone", F), ("t.ok", OK)]
    crashed = report.results[0]
    assert crashed.summary == "check crashed: RuntimeError: sysfs exploded"
    assert crashed.consequence and crashed.remedy
    assert report.exit_code == 1


def test_a_section_that_could_not_be_gathered_fails_its_checks_only(tmp_path):
    base = _facts(tmp_path)
    facts = HostFacts(NOW, base.config, gpus=None, binaries=base.binaries, model_paths=base.model_paths,
                      disks=base.disks, errors={"gpus": "PermissionError: /dev/nvidiactl"})
    report = run_checks(facts, agent=False)
    by_check = {r.check: r for r in report.results}
    assert by_check["gpu.nvidia"].verdict is F
    assert by_check["gpu.nvidia"].summary == "could not read gpus: PermissionError: /dev/nvidiactl"
    assert by_check["engine.binary"].verdict is OK


def test_a_broken_gpu_reader_does_not_stop_gathering(tmp_path):
    class Exploding:
        vendor = Vendor.AMD

        def read(self):
            raise OSError("sysfs went away")

    facts = gather_facts(write_config(tmp_path), gpu_sources=[NvmlReader(ReplayNvml(nvml_recording("nvml-2x-h100"))),
                                                            Exploding()],
                         pci_gpus=lambda: (), dev_root=tmp_path, read_versions=False)
    assert len(facts.gpus.gpus) == 2
    assert facts.gpus.source(Vendor.AMD).detail == "reader failed: OSError: sysfs went away"


def test_every_non_ok_result_says_consequence_and_remedy(tmp_path):
    results = []
    for case, kwargs, models, _ in CONFLICTS:
        sub = tmp_path / case
        sub.mkdir()
        results += derive_conflicts(host(sub, write_config(sub, models), **kwargs))
    assert results
    for r in results:
        assert r.consequence and r.remedy, r


def test_registry_ids_unique_and_documented():
    ids = [c.id for c in REGISTRY]
    assert len(ids) == len(set(ids))
    for c in REGISTRY:
        assert c.doc and "**" in c.doc, f"{c.id} has no verdict list in its docstring"


def test_docs_doctor_md_is_generated_from_the_registry():
    doc = REPO / "docs" / "doctor.md"
    assert doc.read_text() == render_markdown(), (
        "docs/doctor.md differs from the check registry: run "
        "`python -m viiwork.agent.host.doctor --markdown > docs/doctor.md`")


# -- viiworkctl doctor as a real subprocess -------------------------------------------------


def viiworkctl(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([str(VIIWORKCTL), *args], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "COLUMNS": "160", **(env or {})}, check=False)


def test_viiworkctl_doctor_on_this_machine_with_the_agent_down(tmp_path):
    config = write_config(tmp_path, [model(path=str(tmp_path / "m.gguf"))], port=free_port())
    done = viiworkctl("doctor", "--config", str(config), "--json")
    report = json.loads(done.stdout)
    verdicts = {(r["check"], r["subject"]): r["verdict"] for r in report["results"]}
    # No GPU here: the GPU checks are ok and say so; the only problem is the stopped agent.
    assert verdicts[("gpu.nvidia", "")] == "ok" and verdicts[("gpu.amd", "")] == "ok"
    assert verdicts[("agent.reachable", "")] == "degraded"
    assert verdicts[("engine.binary", f"llamacpp: {LLAMA}")] == "ok"
    version = next(r for r in report["results"] if r["check"] == "engine.version")
    assert version["verdict"] == "ok" and version["summary"].startswith("version: ")
    assert report["exit_code"] == done.returncode == 2, done.stderr
    assert report["gpus"]["sources"][0]["detail"].startswith("no NVIDIA driver") or report["gpus"]["gpus"]


def test_viiworkctl_doctor_table_without_a_config(tmp_path):
    done = viiworkctl("doctor", "--config", str(tmp_path / "nope.toml"), "--url", f"http://127.0.0.1:{free_port()}")
    assert done.returncode == 1, done.stderr
    assert "fail" in done.stdout and f"{tmp_path / 'nope.toml'} does not exist" in done.stdout
    assert "remedy: create" in done.stdout
    assert done.stdout.rstrip().endswith("exit status 1")


def test_viiworkctl_doctor_against_a_running_agent(tmp_path):
    """A real agent with a fake engine: one model healthy, one whose engine cannot start."""
    engine = fake_engine_binary(tmp_path / "bin")
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    models = [
        {"name": "good", "engine": "llamacpp", "path": str(tmp_path / "m.gguf"), "llamacpp": {"binary": str(engine)}},
        {"name": "bad", "engine": "llamacpp", "path": str(tmp_path / "m.gguf"), "llamacpp": {"binary": str(engine)},
         "env": {"FAKE_START_FAIL": "1"}},
    ]
    extra = {"health": {"max_respawns": 0}, "supervisor": {"max_parallel_loads": 2}}
    with run_agent(tmp_path, models, extra=extra) as agent:
        agent.wait_healthy("good")
        agent.wait_for(lambda doc: next(m for m in doc["models"] if m["name"] == "bad")["state"] == "dead",
                       30, "model bad to be dead")
        done = viiworkctl("doctor", "--config", str(tmp_path / "node-a.toml"), "--json")
    report = json.loads(done.stdout)
    by = {(r["check"], r["subject"]): r for r in report["results"]}
    assert by[("agent.reachable", "")]["verdict"] == "ok"
    assert by[("agent.backends", "good")]["verdict"] == "ok"
    assert by[("agent.backends", "bad")]["verdict"] == "fail"
    assert "viiworkctl up bad" in by[("agent.backends", "bad")]["remedy"]
    assert by[("agent.config", "")]["verdict"] == "ok"
    assert done.returncode == report["exit_code"] == 1


async def test_startup_conflicts_are_logged(tmp_path, caplog):
    from viiwork.agent.host.doctor import async_startup_conflicts

    config = write_config(tmp_path, [model(binary="/nonexistent/llama-server")])
    with caplog.at_level("WARNING", logger="viiwork.agent.host.doctor"):
        conflicts = await async_startup_conflicts(
            config, gpu_sources=[NvmlReader(ReplayNvml(nvml_recording("nvml-2x-h100")))], pci_gpus=lambda: (),
            read_versions=False)
    assert found(conflicts) == {("engine.binary", "fail", "llamacpp: /nonexistent/llama-server"),
                                ("gpu.cpu_only", "degraded", "")}
    assert "host conflict engine.binary fail" in caplog.text


def test_gpus_module_prints_this_machine(tmp_path):
    done = subprocess.run([sys.executable, "-m", "viiwork.agent.host.gpus", "--json"], capture_output=True, text=True,
                          timeout=60, check=True)
    doc = json.loads(done.stdout)
    assert {s["vendor"] for s in doc["sources"]} == {"nvidia", "amd"}
    assert isinstance(doc["pci"], list)


def test_report_for_a_recorded_nvidia_box_is_actionable(tmp_path):
    import io

    from rich.console import Console

    from viiwork.agent.cli.doctor import print_report

    facts = host(tmp_path, write_config(tmp_path), nvml="nvml-gpu-lost")
    report = run_checks(facts, agent=False)
    out = io.StringIO()
    print_report(report, Console(file=out, width=200, color_system=None))
    text = out.getvalue()
    assert "fail gpu.nvidia (GPU 1): the driver reports this GPU lost (fallen off the bus)" in text
    assert "remedy: check `dmesg` for Xid errors" in text
    assert "degraded gpu.cpu_only: 1 GPU visible, but every configured model runs on the CPU (1 model)" in text
    assert text.rstrip().endswith("exit status 1")


# -- client keys (issue 17 items 5 and 9) ---------------------------------------------------


def _issuer_pub(path: Path) -> Path:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from viiwork.agent.auth.keyset import public_pem

    path.write_bytes(public_pem(Ed25519PrivateKey.generate().public_key()))
    return path


# id, api.listen, [auth] (None: no section), mesh, issuer file ("good", "garbage", None: absent),
# expected {(check, verdict, subject)}
AUTH = [
    ("off-on-loopback", "127.0.0.1:8086", None, None, None, {("auth", "ok", "")}),
    ("off-beyond-loopback", "0.0.0.0:8086", None, None, None, {("auth", "degraded", "")}),
    ("none-beyond-loopback", "10.0.0.5:8086", {"mode": "none"}, None, None, {("auth", "degraded", "")}),
    ("keys-no-issuer-key", "0.0.0.0:8086", {"mode": "keys"}, None, None, {("auth", "fail", "issuer key")}),
    ("keys-not-a-key", "0.0.0.0:8086", {"mode": "keys"}, None, "garbage", {("auth", "fail", "issuer key")}),
    ("keys-on", "0.0.0.0:8086", {"mode": "keys"}, None, "good", {("auth", "ok", "issuer key")}),
    ("keys-in-an-open-mesh", "0.0.0.0:8086", {"mode": "keys", "allow_open_mesh": True}, OPEN, "good",
     {("auth", "degraded", "mesh"), ("auth", "ok", "issuer key")}),
]


@pytest.mark.parametrize(("listen", "auth", "mesh", "issuer", "expected"), [c[1:] for c in AUTH],
                         ids=[c[0] for c in AUTH])
def test_client_keys_verdicts(tmp_path, listen, auth, mesh, issuer, expected):
    pub = tmp_path / "issuer.pub"
    if issuer == "good":
        _issuer_pub(pub)
    elif issuer == "garbage":
        pub.write_text("not a key\n")
    sections: dict = {"node": {"name": "box", "state_dir": str(tmp_path / "state")},
                      "api": {"listen": listen, "admin_socket": str(tmp_path / "admin.sock")}}
    if auth is not None:
        sections["auth"] = {**auth, "issuer_keys": str(pub)}
    if mesh is not None:
        sections["mesh"] = mesh
    config = tmp_path / "viiwork.toml"
    config.write_text(render_config(sections, []))
    results = [r for r in run_checks(host(tmp_path, config), agent=False).results if r.check == "auth"]
    assert found(results) == expected
    for r in results:
        if r.verdict is not OK:
            assert r.consequence and r.remedy, r
        if r.verdict is F:  # the remedy is the one the agent's 401 gives
            assert "viiworkctl keys issuer init" in r.remedy and str(pub) in r.remedy
            assert "docs/install.md" in r.remedy
        if r.verdict is D and not mesh:
            assert listen in r.summary and "[auth] mode = \"keys\"" in r.remedy
    if ("auth", "ok", "issuer key") in expected:
        (ok,) = [r for r in results if r.subject == "issuer key"]
        assert "aud 'box'" in ok.summary or "aud 'lab'" in ok.summary


def test_an_agent_refusing_the_doctor_for_its_key_is_degraded_naming_api_key(tmp_path):
    facts = HostFacts(NOW, host(tmp_path, write_config(tmp_path)).config,
                      agent=AgentFacts("http://127.0.0.1:1", True, None, "/v1/status answered HTTP 401: no API key",
                                       401))
    report = run_checks(facts, [c for c in REGISTRY if c.agent])
    reachable = report.results[0]
    assert (reachable.check, reachable.verdict) == ("agent.reachable", D)
    assert "--api-key" in reachable.remedy and "VIIWORK_API_KEY" in reachable.remedy
    assert all(r.verdict is S for r in report.results[1:])


def test_a_gang_worker_serves_no_model_and_that_is_its_config(tmp_path):
    """A worker of a gang runs parts, not the model: agent.config is ok on it (the newcomer's
    worker was told it ran an older config); on the head the model must be served."""
    gang = {"name": "big", "engine": "llamacpp", "path": "./m.gguf", "hosts": ["head-1", "box"], "gang_port": 50052}
    ca = {"trust": "ca", "ca_certificate": str(tmp_path / "ca.crt")}
    config = host(tmp_path, write_config(tmp_path, [model(), gang], mesh=ca)).config
    served = status([{"name": "m", "state": "running", "backends": [backend("healthy")]}])
    facts = HostFacts(NOW, config, agent=AgentFacts("http://127.0.0.1:1", True, served))
    (result,) = [r for r in run_checks(facts).results if r.check == "agent.config"]
    assert result.verdict is Verdict.OK, result
    head = {**gang, "hosts": ["box", "worker-1"]}
    config = host(tmp_path, write_config(tmp_path, [model(), head], mesh=ca)).config
    facts = HostFacts(NOW, config, agent=AgentFacts("http://127.0.0.1:1", True, served))
    (result,) = [r for r in run_checks(facts).results if r.check == "agent.config"]
    assert result.verdict is D and "configured but not served: big" in result.summary


def test_a_gang_worker_checks_the_binary_it_runs(tmp_path):
    """A llama.cpp gang's worker runs rpc-server, not llama-server: engine.binary checks
    `rpc_binary` there (the newcomer's worker was told llama-server was fine and never that
    rpc-server was missing); the head checks llama-server; a host the entry does not name, none."""
    ca = {"trust": "ca", "ca_certificate": str(tmp_path / "ca.crt")}
    gang = {"name": "big", "engine": "llamacpp", "path": str(tmp_path / "m.gguf"), "gang_port": 50052,
            "llamacpp": {"rpc_binary": str(tmp_path / "no-rpc-server")}}
    sections = {"node": {"name": "box", "state_dir": str(tmp_path / "state")}, "mesh": ca}
    worker = parse_config(render_config(sections, [{**gang, "hosts": ["head-1", "box"]}]))
    (fact,) = read_binary_facts(worker, read_versions=False)
    assert (fact.binary, fact.state, fact.option_path) == (str(tmp_path / "no-rpc-server"), BinaryState.MISSING,
                                                           "models[0].llamacpp.rpc_binary")
    config = host(tmp_path, write_config(tmp_path, [{**gang, "hosts": ["head-1", "box"]}], mesh=ca)).config
    facts = HostFacts(NOW, config, binaries=(fact,))
    (result,) = run_checks(facts, [c for c in REGISTRY if c.id == "engine.binary"]).results
    assert result.verdict is F and "models[0].llamacpp.rpc_binary" in result.remedy
    head = parse_config(render_config(sections, [{**gang, "hosts": ["box", "worker-1"]}]))
    (fact,) = read_binary_facts(head, read_versions=False)
    assert fact.option_path == "models[0].llamacpp.binary" and fact.binary != str(tmp_path / "no-rpc-server")
    elsewhere = parse_config(render_config(sections, [{**gang, "hosts": ["head-1", "worker-1"]}]))
    assert read_binary_facts(elsewhere, read_versions=False) == ()
