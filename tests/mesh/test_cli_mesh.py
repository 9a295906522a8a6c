"""viiworkctl mesh: CA tools, enrolment, and the peer table from a live node."""

from __future__ import annotations

import asyncio
import json
import stat

from aiohttp import web

from support.mesh_crypto import chat_model
from support.mesh_nodes import loopback_settings, wait_for
from viiwork.agent.cli import main
from viiwork.mesh.extensions import SPEEDS, Extensions, ModelSpeed, Speeds
from viiwork.mesh.membership import Liveness
from viiwork.mesh.node import MeshNode
from viiwork.mesh.pins import PINS_FILE


def test_ca_init_request_sign_install_by_the_commands(tmp_path, capsys):
    ca, state = tmp_path / "ca", tmp_path / "state"
    assert main(["mesh", "ca", "init", "--out", str(ca)]) == 0
    assert stat.S_IMODE((ca / "ca.key").stat().st_mode) == 0o600
    assert "mesh id" in capsys.readouterr().out
    assert main(["mesh", "ca", "init", "--out", str(ca)]) == 1
    assert "refusing to replace" in capsys.readouterr().err

    assert main(["mesh", "request", "--state-dir", str(state), "--name", "gpu-07", "--out", str(tmp_path / "req.pem")]) == 0
    assert stat.S_IMODE((state / "node.key").stat().st_mode) == 0o600
    capsys.readouterr()
    assert main(["mesh", "sign", "--ca", str(ca), str(tmp_path / "req.pem"), "--days", "30"]) == 0
    out = capsys.readouterr()
    assert "signed node 'gpu-07'" in out.err and out.out.startswith("-----BEGIN CERTIFICATE-----")
    (tmp_path / "node.pem").write_text(out.out)
    assert main(["mesh", "install", "--state-dir", str(state), str(tmp_path / "node.pem"),
                 "--ca-cert", str(ca / "ca.crt")]) == 0
    assert "checked against the mesh CA" in capsys.readouterr().out
    assert (state / "node.crt").exists()


def test_install_refuses_another_nodes_certificate(tmp_path, capsys):
    ca = tmp_path / "ca"
    main(["mesh", "ca", "init", "--out", str(ca)])
    main(["mesh", "request", "--state-dir", str(tmp_path / "a"), "--name", "a", "--out", str(tmp_path / "a.req")])
    main(["mesh", "sign", "--ca", str(ca), str(tmp_path / "a.req"), "--out", str(tmp_path / "a.crt")])
    capsys.readouterr()
    assert main(["mesh", "install", "--state-dir", str(tmp_path / "b"), str(tmp_path / "a.crt")]) == 1
    assert "not this node" in capsys.readouterr().err


def test_sign_refuses_garbage_and_a_missing_ca(tmp_path, capsys):
    (tmp_path / "junk").write_text("hello")
    main(["mesh", "ca", "init", "--out", str(tmp_path / "ca")])
    assert main(["mesh", "sign", "--ca", str(tmp_path / "ca"), str(tmp_path / "junk")]) == 1
    assert "signing request" in capsys.readouterr().err
    assert main(["mesh", "sign", "--ca", str(tmp_path / "nowhere"), str(tmp_path / "junk")]) == 1
    assert "cannot read certificate" in capsys.readouterr().err


async def test_enroll_then_a_ca_mesh_forms_and_mesh_lists_it(tmp_path, capsys):
    ca = tmp_path / "ca"
    assert main(["mesh", "ca", "init", "--out", str(ca)]) == 0
    for name in ("a", "b"):
        assert main(["mesh", "enroll", "--ca", str(ca), "--state-dir", str(tmp_path / name), "--name", name]) == 0
    a = MeshNode(loopback_settings(tmp_path / "a", "a", ca_dir=ca))
    a.set_local_summary([chat_model("llama", busy=1)])
    await a.start()
    b = MeshNode(loopback_settings(tmp_path / "b", "b", ca_dir=ca, seeds=(f"127.0.0.1:{a.listen_port}",)))
    b.set_local_summary([chat_model("qwen", busy=2)])
    # The speeds extension, through b's signed summary over mutual TLS to a's /v1/mesh.
    b.set_local_extensions(Extensions.of({SPEEDS: Speeds((ModelSpeed("qwen", 900, 45),))}))
    await b.start()
    async def mesh_view(request):
        return web.json_response(a.view())

    api = web.Application()
    api.router.add_get("/v1/mesh", mesh_view)
    runner = web.AppRunner(api)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        await wait_for(lambda: any(p.liveness is Liveness.ALIVE for p in a.peers()), 10, "b on a")
        capsys.readouterr()
        url = f"http://127.0.0.1:{port}"
        assert await asyncio.to_thread(main, ["mesh", "--json", "--url", url]) == 0
        doc = json.loads(capsys.readouterr().out)
        assert doc["self"]["name"] == "a" and doc["nodes"][0]["name"] == "b"
        assert doc["nodes"][0]["trust"] == "ca" and doc["nodes"][0]["models"][0]["busy"] == 2
        assert doc["nodes"][0]["models"][0]["speed"] == {"prefill_tps": 900, "decode_tps": 45}
        assert doc["self"]["models"][0]["speed"] is None  # a published none
        assert await asyncio.to_thread(main, ["mesh", "--url", url]) == 0
        table = capsys.readouterr().out
        assert "qwen 2/4" in table and "alive" in table and b.node_id not in table  # the id: --wide only
        assert "900/45" not in table and "tok/s" not in table  # speeds: --wide only
        assert all(len(row) <= 100 for row in table.splitlines() if "│" in row)  # the default table fits 100
        assert await asyncio.to_thread(main, ["mesh", "--wide", "--url", url]) == 0
        wide = capsys.readouterr().out
        assert b.node_id in wide and "qwen 900/45" in wide
    finally:
        await runner.cleanup()
        await b.stop(leave=False)
        await a.stop(leave=False)


def test_mesh_without_an_agent_says_how_to_point_at_one(capsys):
    assert main(["mesh", "--url", "http://127.0.0.1:9", "--timeout", "1"]) == 1
    assert "cannot reach the agent" in capsys.readouterr().err


def test_forget_drops_an_open_mode_pin(tmp_path, capsys):
    state = tmp_path / "s"
    state.mkdir(mode=0o700)
    (state / PINS_FILE).write_text(json.dumps({"version": 1, "pins": {"gpu-01": "abcdefghijklmnop"}}))
    assert main(["mesh", "forget", "--state-dir", str(state), "gpu-01"]) == 0
    assert json.loads((state / PINS_FILE).read_text())["pins"] == {}
    assert main(["mesh", "forget", "--state-dir", str(state), "gpu-01"]) == 1
    assert "no pin" in capsys.readouterr().err


def test_config_supplies_state_dir_and_name(tmp_path, capsys):
    config = tmp_path / "viiwork.toml"
    config.write_text(f'[node]\nname = "from-config"\nstate_dir = "{tmp_path / "st"}"\n')
    assert main(["mesh", "request", "--config", str(config), "--out", str(tmp_path / "r.pem")]) == 0
    from viiwork.mesh.trust import read_signing_request

    _, info = read_signing_request((tmp_path / "r.pem").read_bytes())
    assert info.name == "from-config" and (tmp_path / "st" / "node.key").exists()


def test_mesh_id_prints_the_id_the_agent_will_have(tmp_path, capsys):
    """A gang under open trust names its hosts by node id: `mesh id` gives a node's before its
    agent ever ran (the key made as the agent would make it), the same again after."""
    from viiwork.mesh.identity import load_or_create_identity

    assert main(["mesh", "id", "--state-dir", str(tmp_path / "s")]) == 0
    first = capsys.readouterr().out.strip()
    assert first == load_or_create_identity(tmp_path / "s").node_id
    config = tmp_path / "v.toml"
    config.write_text(f'[node]\nname = "n"\nstate_dir = "{tmp_path / "s"}"\n')
    assert main(["mesh", "id", "--config", str(config)]) == 0
    assert capsys.readouterr().out.strip() == first
    config.write_text("[node\n")
    assert main(["mesh", "id", "--config", str(config)]) == 1
    assert "--state-dir" in capsys.readouterr().err
