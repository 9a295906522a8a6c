"""viiworkctl mesh: the mesh as an agent sees it, and the CA enrolment tools.

One module (about 430 lines) because the table and every sub-command of `viiworkctl mesh`
share its argument helpers (the node's config, state dir and name) and its output helpers.

    viiworkctl mesh [--json] [--url URL]            peers: name, address, liveness, state, age, models; gangs
    viiworkctl mesh ca init --out DIR [--days N]     a new mesh CA (ca.key 0600, ca.crt)
    viiworkctl mesh request [--out FILE]             this node's signing request (creates its key if new)
    viiworkctl mesh sign --ca DIR REQUEST [--days N] [--out FILE]   on the CA host: the node certificate
    viiworkctl mesh install CERT                     on the node: check it and put it in the state dir
    viiworkctl mesh enroll --ca DIR                  request + sign + install on one box (labs)
    viiworkctl mesh forget NAME                      open mode: drop a name's pin (a reinstalled node)

The node tools act on ``--state-dir`` (default: the config's ``node.state_dir``) and never
rewrite the config file. Keep the CA directory off the GPU boxes: whoever holds ``ca.key``
can admit any machine to the mesh (docs/mesh.md).
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from viiwork.agent.cli.agent_http import AgentAnswered, api_key, fetch_json
from viiwork.agent.cli.tables import cell, shown, table_console
from viiwork.agent.cli.target import add_target_args, agent_url
from viiwork.agent.config.load import DEFAULT_CONFIG_PATH, ConfigError, load_config
from viiwork.agent.config.schema import Config
from viiwork.mesh.identity import IdentityError, load_or_create_identity
from viiwork.mesh.pins import PINS_FILE, PinStore
from viiwork.mesh.trust import (
    DEFAULT_CA_DAYS,
    DEFAULT_NODE_DAYS,
    TrustError,
    init_ca,
    install_certificate,
    load_ca,
    load_certificate,
    make_signing_request,
    read_signing_request,
    sign_request,
)

DEFAULT_STATE_DIR = Path("/var/lib/viiwork")


def register(subparsers: argparse._SubParsersAction) -> None:
    mesh = subparsers.add_parser(
        "mesh", help="the mesh as an agent sees it; CA and enrolment tools",
        description="Without a sub-command: the peers an agent knows (table, or --json). "
                    "Sub-commands manage the mesh CA and this node's certificate.")
    add_target_args(mesh)
    mesh.add_argument("--json", action="store_true", help="print the agent's /v1/mesh document")
    mesh.add_argument("--wide", action="store_true",
                      help="every column: node id, summed slots, speeds (tokens/s), trust; no wrapping to the "
                      "terminal's width")
    mesh.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the agent (default 5)")
    mesh.set_defaults(func=run_show)
    sub = mesh.add_subparsers(dest="mesh_command", metavar="SUBCOMMAND")

    ca = sub.add_parser("ca", help="mesh CA tools", description="Mesh CA tools.")
    ca_sub = ca.add_subparsers(dest="ca_command", metavar="SUBCOMMAND")
    init = ca_sub.add_parser("init", help="create a mesh CA in DIR",
                             description="Create a mesh CA: DIR/ca.key (mode 0600) and DIR/ca.crt. Keep DIR on an "
                                         "admin machine, not on the GPU boxes; give every node ca.crt "
                                         "(mesh.ca_certificate).")
    init.add_argument("--out", required=True, type=Path, metavar="DIR")
    init.add_argument("--name", default="viiwork mesh CA", help="the CA certificate's common name")
    init.add_argument("--days", type=int, default=DEFAULT_CA_DAYS, help=f"validity (default {DEFAULT_CA_DAYS})")
    init.set_defaults(func=run_ca_init)
    ca.set_defaults(func=lambda args: (ca.print_help(), 2)[1])

    node_id = sub.add_parser("id", help="print this node's id (creating its key if needed)",
                             description="Print this node's id: the one a gang's `hosts` names it by under trust "
                                         "\"open\" (docs/configuration.md, \"Gangs\"). Creates the node key in the "
                                         "state dir if the agent has not run yet, as the agent would.")
    _node_args(node_id)
    node_id.set_defaults(func=run_id)

    request = sub.add_parser("request", help="print this node's certificate signing request",
                             description="Create the node key if needed and print (or write) a signing request "
                                         "for it, to be signed on the CA host with `viiworkctl mesh sign`.")
    _node_args(request)
    request.add_argument("--out", type=Path, help="write the request here instead of printing it")
    request.set_defaults(func=run_request)

    sign = sub.add_parser("sign", help="sign a node's request with the CA (on the CA host)",
                          description="Sign REQUEST with the CA in DIR and print (or write) the node certificate.")
    _signing_args(sign)
    sign.add_argument("request", type=Path, metavar="REQUEST")
    sign.add_argument("--out", type=Path, help="write the certificate here instead of printing it")
    sign.set_defaults(func=run_sign)

    install = sub.add_parser("install", help="install a signed node certificate into the state dir",
                             description="Check CERT against this node's key (and the mesh CA from --ca-cert or "
                                         "the config) and install it as STATE_DIR/node.crt.")
    _node_args(install)
    install.add_argument("cert", type=Path, metavar="CERT")
    install.add_argument("--ca-cert", type=Path, help="the mesh CA certificate (default: mesh.ca_certificate)")
    install.set_defaults(func=run_install)

    enroll = sub.add_parser("enroll", help="request, sign and install in one step (labs)",
                            description="For labs where the CA directory is on this box: make the request, sign "
                                        "it with the CA in DIR and install the certificate.")
    _node_args(enroll)
    _signing_args(enroll)
    enroll.set_defaults(func=run_enroll)

    forget = sub.add_parser("forget", help="open mode: forget the node id pinned to a name",
                            description="Open mode pins each node name to the first node id seen with it. After "
                                        "reinstalling a node (new key), forget its name on the other nodes, then "
                                        "restart their agents.")
    _node_args(forget)
    forget.add_argument("node_name", metavar="NAME")
    forget.set_defaults(func=run_forget)


def _node_args(parser: argparse.ArgumentParser) -> None:
    # SUPPRESS: a sub-command's unset option must not overwrite one given before it
    # (`viiworkctl mesh --config F request`).
    parser.add_argument("--config", type=Path, default=argparse.SUPPRESS,
                        help=f"agent config (default {DEFAULT_CONFIG_PATH})")
    parser.add_argument("--state-dir", type=Path, default=None,
                        help="node state dir (default: the config's node.state_dir)")
    parser.add_argument("--name", dest="node_name_opt", help="node name (default: the config's node.name)")


def _signing_args(parser: argparse.ArgumentParser) -> None:
    """``--ca DIR`` and ``--days``: the CA that signs a node certificate, and its validity."""
    parser.add_argument("--ca", required=True, type=Path, metavar="DIR", help="the directory made by `mesh ca init`")
    parser.add_argument("--days", type=int, default=DEFAULT_NODE_DAYS, help=f"validity (default {DEFAULT_NODE_DAYS})")


def _config(args: argparse.Namespace) -> Config | None:
    path = getattr(args, "config", None) or DEFAULT_CONFIG_PATH
    if not Path(path).exists():
        if getattr(args, "config", None):
            raise TrustError(f"config {path} not found")
        return None
    try:
        return load_config(path)
    except ConfigError as exc:
        raise TrustError(f"cannot use {path}: {exc}") from None


def _state_dir(args: argparse.Namespace, cfg: Config | None) -> Path:
    if args.state_dir:
        return args.state_dir
    return Path(cfg.node.state_dir) if cfg is not None else DEFAULT_STATE_DIR


def _node_name(args: argparse.Namespace, cfg: Config | None) -> str:
    if getattr(args, "node_name_opt", None):
        return args.node_name_opt
    return cfg.node.name if cfg is not None else socket.gethostname()


def _fail(message: str) -> int:
    print(f"viiworkctl mesh: {message}", file=sys.stderr)
    return 1


def _write_or_print(data: bytes, out: Path | None, what: str) -> None:
    if out is None:
        sys.stdout.write(data.decode("ascii"))
        return
    out.write_bytes(data)
    out.chmod(0o644)
    print(f"wrote {what} to {out}", file=sys.stderr)


# --- commands -----------------------------------------------------------------------------------


def run_ca_init(args: argparse.Namespace) -> int:
    try:
        files = init_ca(args.out, name=args.name, days=args.days)
    except (TrustError, IdentityError, OSError) as exc:
        return _fail(str(exc))
    print(f"created mesh CA in {args.out} (mesh id {files.mesh_id})\n"
          f"  {files.key_path}: the CA key; keep it here, off the GPU boxes (mode 0600)\n"
          f"  {files.cert_path}: copy to every node and set mesh.ca_certificate to its path")
    return 0


def run_id(args: argparse.Namespace) -> int:
    try:
        cfg = None if args.state_dir else _config(args)
        key = cfg.mesh.node_key if cfg is not None and cfg.mesh is not None else None
        identity = load_or_create_identity(_state_dir(args, cfg), key)
    except (TrustError, IdentityError, OSError) as exc:
        return _fail(f"{exc} (with a config that does not load yet, give --state-dir: the agent's node.state_dir)")
    print(identity.node_id)
    return 0


def run_request(args: argparse.Namespace) -> int:
    try:
        cfg = _config(args)
        identity = load_or_create_identity(_state_dir(args, cfg))
        pem = make_signing_request(identity, _node_name(args, cfg))
    except (TrustError, IdentityError, OSError) as exc:
        return _fail(str(exc))
    _write_or_print(pem, args.out, f"the signing request of node {identity.node_id}")
    return 0


def run_sign(args: argparse.Namespace) -> int:
    try:
        key, cert = load_ca(args.ca)
        csr_pem = args.request.read_bytes()
        _, info = read_signing_request(csr_pem)
        assert key is not None
        pem = sign_request(key, cert, csr_pem, days=args.days)
    except (TrustError, IdentityError, OSError) as exc:
        return _fail(str(exc))
    print(f"signed node {info.name!r} ({info.node_id}) for {args.days} days", file=sys.stderr)
    _write_or_print(pem, args.out, "the node certificate")
    return 0


def run_install(args: argparse.Namespace) -> int:
    try:
        cfg = _config(args)
        state = _state_dir(args, cfg)
        ca_path = args.ca_cert or (cfg.mesh.ca_certificate if cfg is not None and cfg.mesh is not None else None)
        ca_cert = load_certificate(ca_path) if ca_path else None
        identity = load_or_create_identity(state)
        path = install_certificate(state, args.cert.read_bytes(), identity, ca_cert)
    except (TrustError, IdentityError, OSError) as exc:
        return _fail(str(exc))
    checked = "checked against the mesh CA" if ca_cert is not None else "not checked against a CA (no --ca-cert)"
    print(f"installed {path} for node {identity.node_id} ({checked}); restart the agent to use it")
    return 0


def run_enroll(args: argparse.Namespace) -> int:
    try:
        cfg = _config(args)
        state = _state_dir(args, cfg)
        identity = load_or_create_identity(state)
        key, ca_cert = load_ca(args.ca)
        assert key is not None
        pem = sign_request(key, ca_cert, make_signing_request(identity, _node_name(args, cfg)), days=args.days)
        path = install_certificate(state, pem, identity, ca_cert)
    except (TrustError, IdentityError, OSError) as exc:
        return _fail(str(exc))
    print(f"enrolled node {identity.node_id}: {path} (valid {args.days} days); mesh.ca_certificate must name "
          f"{Path(args.ca) / 'ca.crt'} or a copy of it")
    return 0


def run_forget(args: argparse.Namespace) -> int:
    try:
        state = _state_dir(args, _config(args))
    except TrustError as exc:
        return _fail(str(exc))
    pins = PinStore(state / PINS_FILE)
    if not pins.forget(args.node_name):
        return _fail(f"no pin for {args.node_name!r} in {state / PINS_FILE}")
    pins.save()
    print(f"forgot {args.node_name!r}; restart the agent so it forgets it too")
    return 0


def run_show(args: argparse.Namespace) -> int:
    url = agent_url(args) + "/v1/mesh"
    try:
        doc = fetch_json(url, args.timeout, api_key(args))
    except AgentAnswered as exc:
        if exc.status == 404 and "standalone" in exc.message:  # agent/serving/api.py, handle_mesh
            if args.json:
                print(json.dumps({"mesh": None}))
            else:
                print(exc.message or "this node is standalone: its config has no [mesh] section")
            return 0
        return _fail(str(exc))
    except ConnectionError as exc:
        return _fail(str(exc))
    if args.json:
        print(json.dumps(doc, indent=2))
        return 0
    render(doc, table_console(wide=args.wide), wide=args.wide)
    return 0


def _age(ms: Any) -> str:
    if not isinstance(ms, (int, float)):
        return "?"
    return f"{ms / 1000:.1f} s" if ms < 120_000 else f"{ms / 60_000:.0f} min"


def _lines(lines: list[Text]) -> Text:
    return Text("\n").join(lines) if lines else Text("-")


def _models_cell(models: list[dict[str, Any]]) -> tuple[Text, str]:
    names, busy, slots = [], 0, 0
    for m in models:
        waiting = m.get("waiting")
        queue = "" if waiting is None else f", {shown(waiting)} waiting"
        line = Text(f"{shown(m.get('name', '?'))} {shown(m.get('busy', '?'))}/{shown(m.get('slots', '?'))}{queue}")
        if m.get("conflict"):
            line.append(" (conflict)", style="red")
        if m.get("ejected") is True:  # outlier ejection in the viewing node (docs/routing.md)
            line.append(" (ejected)", style="yellow")
        names.append(line)
        busy += _count(m.get("busy"))
        slots += _count(m.get("slots"))
    return _lines(names), f"{busy}/{slots}"


def _count(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _gib(mib: Any) -> str:
    return f"{mib / 1024:.0f}" if isinstance(mib, (int, float)) and not isinstance(mib, bool) else "?"


def gpus_cell(gpus: list[dict[str, Any]]) -> str:
    """One line per GPU: ``index name free/total GiB`` ("?" where memory is unknown); "-" for
    none. Control characters are escaped (``shown``); print it as text (``cell``), not markup."""
    return "\n".join(f"{shown(g.get('index', '?'))} {shown(g.get('name', '?'))} "
                     f"{_gib(g.get('memory_free_mib'))}/{_gib(g.get('memory_total_mib'))} GiB free"
                     for g in gpus) or "-"


def speeds_cell(models: list[dict[str, Any]]) -> str:
    """One line per model: ``name prefill/decode`` (tokens/s, "—" when not measured); control
    characters escaped, as in ``gpus_cell``."""
    def tps(value: Any) -> str:
        return str(value) if isinstance(value, int) and value > 0 else "\u2014"
    lines = []
    for m in models:
        speed = m.get("speed")
        if not isinstance(speed, dict):
            speed = {}
        lines.append(f"{shown(m.get('name', '?'))} {tps(speed.get('prefill_tps'))}/{tps(speed.get('decode_tps'))}")
    return "\n".join(lines) or "-"


def gang_lines(gangs: Any) -> list[str]:
    """One line per gang across the mesh, from /v1/mesh "gangs" (each node's ``gangs``
    extension, grouped): model, gang id, leader, and each rank's host; a rank no node publishes
    shows as missing (its part is not running). Strings escaped (``shown``): they come from peers."""
    lines = []
    for g in gangs if isinstance(gangs, list) else []:
        if not isinstance(g, dict):
            continue
        parts = [p for p in g.get("parts") or [] if isinstance(p, dict)]
        size = g.get("size")
        ranks = {p.get("rank") for p in parts}
        missing = [r for r in range(size) if r not in ranks] if isinstance(size, int) and 0 < size <= 1024 else []
        line = (f"{shown(g.get('model', '?'))}: gang {shown(g.get('gang', '?'))}, {len(parts)}/{shown(size)} parts, "
                f"leader {shown(g.get('leader_name') or g.get('leader', '?'))}: "
                + ", ".join(f"rank {shown(p.get('rank', '?'))} {shown(p.get('name', '?'))}" for p in parts))
        if missing:
            line += "; missing rank " + ", ".join(map(str, missing))
        lines.append(line)
    return lines


_LIVENESS_STYLE = {"alive": "green", "suspect": "yellow", "dead": "red", "left": "dim", "conflict": "bold red"}


def render(doc: dict[str, Any], console: Console, *, wide: bool = False) -> None:
    """Print the /v1/mesh document as a header line, a table of peers (``wide``: every
    column) and one line per gang across the mesh. Every string of the document is printed as text with control characters escaped
    (``cell``/``shown``, agent/cli/tables.py): names come from peers."""
    me = doc.get("self") or {}
    if me:
        models, load = _models_cell(me.get("models") or [])
        gpus = gpus_cell(me.get("gpus") or []).replace("\n", "; ")
        console.print(Text.assemble(
            "this node ", cell(me.get("name", "?"), "bold"),
            f" ({shown(me.get('id', '?'))}), mesh {shown(me.get('mesh_id', '?'))} ({shown(me.get('trust', '?'))} "
            f"trust), {shown(me.get('state', '?'))}, slots busy/total {load}, GPUs: {gpus}"))
        ejected = [f"{shown(b)} ({shown(m.get('name', '?'))})" for m in me.get("models") or []
                   for b in m.get("ejected_backends") or []]
        if ejected:  # outlier ejection: their slots are not published (docs/routing.md)
            console.print(Text.assemble(("ejected here", "yellow"), ": " + ", ".join(ejected)))
        clone = me.get("identity_conflict")
        if isinstance(clone, dict):
            console.print(Text.assemble(
                ("identity conflict", "bold red"),
                f": this node id is also run by the agent at {shown(clone.get('other_address', '?'))}; "
                f"{'this agent' if clone.get('this_boot_leaves') else 'that agent'} stops (docs/mesh.md)"))
    # The default columns fit 100 (and mostly 80) columns; --wide adds the node id, the summed
    # slots, the measured speeds and the trust mode. Cells wrap (overflow="fold") rather than end in "…".
    table = Table()
    cols = ["name", "address", "liveness", "state", "age", "models (busy/slots)", "GPUs"]
    if wide:
        cols[1:1] = ["id"]
        cols[-1:-1] = ["slots busy/total", "tok/s prefill/decode"]
        cols.append("trust")
    for col in cols:
        table.add_column(col, overflow="fold")
    for node in doc.get("nodes", []):
        models, load = _models_cell(node.get("models") or [])
        liveness = node.get("liveness", "?")
        cells: dict[str, Text] = {
            "name": cell(node.get("name", "?")), "id": cell(node.get("id", "?")),
            "address": cell(node.get("api") or node.get("mesh") or "-"),
            "liveness": cell(liveness, _LIVENESS_STYLE.get(liveness, "") if isinstance(liveness, str) else ""),
            "state": cell(node.get("state", "?")), "age": cell(_age(node.get("age_ms"))),
            "models (busy/slots)": models, "slots busy/total": cell(load),
            "tok/s prefill/decode": Text(speeds_cell(node.get("models") or [])),
            "GPUs": Text(gpus_cell(node.get("gpus") or [])), "trust": cell(node.get("trust", "?"))}
        table.add_row(*(cells[c] for c in cols))
    console.print(table)
    conflicts = doc.get("conflicts") or []
    for c in conflicts:
        console.print(Text.assemble(
            ("conflict", "red"),
            f": model {shown(repr(c.get('model')))} is served with different weights: "
            + ", ".join(f"{shown(nid)}={shown(fp)}" for nid, fp in (c.get("nodes") or {}).items())))
    for line in gang_lines(doc.get("gangs")):
        console.print(Text.assemble(("gang", "cyan"), " ", Text(line)))
    if not doc.get("nodes"):
        console.print("no peers known (standalone, or none found yet: check mesh.seeds and mDNS)")
