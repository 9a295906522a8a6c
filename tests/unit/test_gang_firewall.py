"""The nftables rules of a gang part (agent/gang/firewall.py): golden text, bad input refused,
the config key, and the unit properties that make the systemd runner own the table.

The rules' effect on real packets is tests/mesh/test_gang_firewall_netns.py; the systemd
manager running them is tests/systemd/test_gang_firewall_pid1.py.
"""

from __future__ import annotations

import shutil

import pytest
from conftest import require
from pydantic import ValidationError

from viiwork.agent.config.schema import ModelConfig
from viiwork.agent.gang.firewall import FirewallError, part_firewall, render_ruleset, table_name
from viiwork.agent.gang.parts import PartFailed, part_firewall_of
from viiwork.agent.supervision.runners.base import LaunchRequest, NftTable, RunnerError
from viiwork.agent.supervision.runners.nft import NFT_PATH, nft_binary
from viiwork.agent.supervision.runners.process import ProcessRunner
from viiwork.agent.supervision.runners.systemd.units import engine_unit_properties
from viiwork.engines.gang import GangAddresses, GangPart, PartRole, PortRange
from viiwork.engines.sglang import SglangEngine
from viiwork.engines.vllm import VllmEngine

GANG = "abcdefgh2345"
RUNTIME_R0 = GangPart(0, PartRole.RUNTIME)

GOLDEN = """\
table inet viiwork_gang_abcdefgh2345_r0_runtime {}
delete table inet viiwork_gang_abcdefgh2345_r0_runtime
table inet viiwork_gang_abcdefgh2345_r0_runtime {
\tchain input {
\t\ttype filter hook input priority filter - 10; policy accept;
\t\tiif "lo" accept
\t\tct state established,related accept
\t\tip saddr { 10.0.0.1, 10.0.0.2 } accept
\t\tip6 saddr { fd00::3 } accept
\t\ttcp dport { 29500-29755 } drop
\t\tudp dport { 29500-29755 } drop
\t}
}
"""


def addresses(nodes: tuple[str, ...] = ("10.0.0.1", "10.0.0.2", "fd00::3"), rank: int = 0) -> GangAddresses:
    return GangAddresses(gang_id=GANG, rank=rank, size=len(nodes), node_addresses=nodes, port=29500)


def test_the_ruleset_admits_the_members_and_drops_the_rest_on_the_ports() -> None:
    table = part_firewall(RUNTIME_R0, addresses(), VllmEngine().gang_ports(PartRole.RUNTIME, addresses()))
    assert table is not None
    assert (table.family, table.name) == ("inet", "viiwork_gang_abcdefgh2345_r0_runtime")
    assert table.ruleset == GOLDEN
    assert table.delete_argv("/usr/sbin/nft") == ("/usr/sbin/nft", "delete", "table", "inet", table.name)
    assert table.apply_argv("/usr/sbin/nft") == ("/usr/sbin/nft", GOLDEN)


def test_several_ranges_and_ipv4_only_members() -> None:
    text = render_ruleset("t", ["10.0.0.2", "10.0.0.1", "10.0.0.2"], [PortRange(40000, 40000), PortRange(29500, 29515)])
    assert "\t\tip saddr { 10.0.0.2, 10.0.0.1 } accept\n" in text  # each once, in the gang's order
    assert "ip6" not in text
    assert "\t\ttcp dport { 29500-29515, 40000 } drop\n" in text


def test_a_part_without_ports_gets_no_table() -> None:
    assert part_firewall(GangPart(0, PartRole.SERVER), addresses(), VllmEngine().gang_ports(PartRole.SERVER,
                                                                                           addresses())) is None


@pytest.mark.parametrize(("members", "ports", "message"), [
    (["10.0.0.1", "gpu-02.lab"], [PortRange(29500, 29500)], "'gpu-02.lab' is not an IP address"),
    (["10.0.0.1", "10.0.0.2; flush ruleset"], [PortRange(29500, 29500)], "is not an IP address"),
    ([], [PortRange(29500, 29500)], "no gang members"),
    (["10.0.0.1"], [], "no ports"),
])
def test_bad_input_is_refused(members: list[str], ports: list[PortRange], message: str) -> None:
    with pytest.raises(FirewallError, match=message):
        render_ruleset("t", members, ports)


def test_a_table_name_needs_a_gang_id() -> None:
    with pytest.raises(FirewallError, match="is not 12 characters"):
        table_name("x; flush ruleset", RUNTIME_R0)
    assert table_name(GANG, GangPart(3, PartRole.RANK)) == "viiwork_gang_abcdefgh2345_r3_rank"


def _entry(**kw: object) -> ModelConfig:
    return ModelConfig.model_validate({"name": "big", "engine": "sglang", "path": "/models/big", "gpus": [0],
                                       "hosts": ["gpu-01", "gpu-02"], "gang_port": 29500, **kw})


def test_gang_firewall_is_on_by_default_and_can_be_turned_off() -> None:
    gang = addresses(("10.0.0.1", "10.0.0.2"), rank=1)
    on = part_firewall_of(_entry(), SglangEngine(), GangPart(1, PartRole.RANK), gang)
    assert on is not None and "tcp dport { 29500-29515 } drop" in on.ruleset
    assert part_firewall_of(_entry(gang_firewall=False), SglangEngine(), GangPart(1, PartRole.RANK), gang) is None


def test_a_member_that_is_not_an_address_fails_the_part_naming_the_way_out() -> None:
    gang = addresses(("10.0.0.1", "gpu-02.lab"), rank=1)
    with pytest.raises(PartFailed, match="not an IP address.*gang_firewall = false"):
        part_firewall_of(_entry(), SglangEngine(), GangPart(1, PartRole.RANK), gang)


def test_the_config_refuses_a_block_past_65535() -> None:
    with pytest.raises(ValidationError, match="gang_port must be at most 65520"):
        _entry(gang_port=65530)
    assert _entry(gang_port=65520).gang_port == 65520
    with pytest.raises(ValidationError, match="gang_port must be at most 65280"):
        _entry(engine="vllm", gang_port=65281)


def test_the_systemd_unit_creates_the_table_before_and_deletes_it_after_the_engine() -> None:
    table = part_firewall(RUNTIME_R0, addresses(), (PortRange(29500, 29755),))
    assert table is not None
    request = LaunchRequest(name="viiwork-gang-big-x", argv=("/usr/bin/ray", "start"), env={}, description="d",
                            firewall=table)
    props = {k: v.value for k, v in engine_unit_properties(
        request, "/usr/bin/ray", cache_root="/var/cache", slice_name="viiwork-engines.slice", engine_user="viiwork",
        supplementary_groups=[], output="journal", nft="/usr/sbin/nft")}
    assert props["ExecStartPreEx"] == [["/usr/sbin/nft", ["/usr/sbin/nft", GOLDEN], ["privileged", "no-env-expand"]]]
    assert props["ExecStopPostEx"] == [["/usr/sbin/nft", ["/usr/sbin/nft", "delete", "table", "inet", table.name],
                                        ["privileged", "ignore-failure"]]]
    plain = {k for k, _ in engine_unit_properties(
        LaunchRequest(name="n", argv=("/bin/true",), env={}, description="d"), "/bin/true", cache_root="/c",
        slice_name="s", engine_user=None, supplementary_groups=[], output="journal")}
    assert not plain & {"ExecStartPreEx", "ExecStopPostEx"}


def test_without_nft_a_part_with_rules_cannot_start_and_the_error_says_what_to_do() -> None:
    with pytest.raises(RunnerError, match="install Debian's nftables package, or set the model's gang_firewall = false"):
        nft_binary(path="/nonexistent")


async def test_the_process_runner_starts_no_engine_when_its_rules_fail(tmp_path) -> None:
    # A ruleset nft refuses (here: a chain with no table) fails the start before the engine
    # exists; nft checks the whole script before it changes anything.
    marker = tmp_path / "ran"
    bad = NftTable("inet", "viiwork_gang_test", "add chain inet viiwork_gang_missing_table input\n")
    request = LaunchRequest(name="fw-bad", argv=("/usr/bin/touch", str(marker)), env={"PATH": "/usr/bin:/bin"},
                            description="d", firewall=bad)
    require(shutil.which("nft", path=NFT_PATH) is not None, "nft is not installed (Debian's nftables)")
    with pytest.raises(RunnerError, match="fw-bad: its nftables rules: nft failed"):
        await ProcessRunner().start(request)
    assert not marker.exists()
