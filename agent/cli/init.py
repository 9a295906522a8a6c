"""viiworkctl init --out FILE: write a starter config from what this host has.

It looks at the GPUs (viiwork.agent.host.gpus inventory), the GGUF files under each
``--models-dir`` (recursively; a file counts when it starts with the GGUF magic), the engine
binaries installed (each engine's default ``binary`` on PATH, then next to this Python, where
``make venv`` puts llama-server), the mesh trust asked for (``--mesh``; default standalone:
no ``[mesh]``) and client keys (``--auth``; default on, as in the shipped config, except for
a lab's ``--mesh open``: docs/security.md, "Client keys"). It prints each choice and its reason (paths quoted by
viiwork.agent.cli.quoting: a file name cannot forge a line or send terminal escapes),
validates the result with the agent's own loader, and writes it through tomli-w. Only
regular files are probed (``stat`` decides; a FIFO named x.gguf is skipped, never opened
for reading). Every bad input is one ``viiworkctl init: ...`` line on stderr and exit 1.

FILE is written whole or not at all, by viiwork.agent.cli.out_file: without ``--force``
an existing FILE (a dangling symlink too) is kept; with it, a regular FILE is replaced
keeping its mode (a new FILE gets 0644) and a symlink is replaced by the new file, its
target untouched. A FILE that is a FIFO, device, socket or directory is refused.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import re
import socket
import stat
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tomli_w

from viiwork.agent.cli.command_path import command
from viiwork.agent.cli.out_file import OutFileError, check_out, write_whole
from viiwork.agent.cli.quoting import quote_path
from viiwork.agent.config.load import ConfigError, file_kind, parse_config
from viiwork.agent.config.schema import AuthConfig, parse_hostport
from viiwork.agent.host.config_host import bind_problem
from viiwork.agent.host.facts import BinaryState, resolve_binary
from viiwork.agent.host.gpus.inventory import GpuInventory
from viiwork.engines.registry import ENGINES
from viiwork.mesh.bounds import MAX_NAME_CHARS

GGUF_MAGIC = b"GGUF"
GGUF_ENGINE = "llamacpp"  # the engine that serves GGUF files
_SPLIT = re.compile(r"-(\d{5})-of-(\d{5})$")
_NAME_BAD = re.compile(r"[^A-Za-z0-9._-]+")


class InitError(Exception):
    """Bad input: the message is the whole one-line error."""


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "init",
        help="write a starter config from this host's GPUs, GGUF files and engines",
        description=(
            "Write a starter config to FILE from what this host has: its GPUs, the GGUF files "
            "under each --models-dir, the installed engine binaries, and the mesh trust asked "
            "for. Prints what it chose and why. The result passes `viiworkctl config check`. "
            "An existing FILE is kept unless --force. FILE is written whole or not at all "
            "(a temporary file in its directory, renamed onto it); --force keeps a replaced "
            "file's mode and replaces a symlink itself, not its target."
        ),
    )
    parser.add_argument("--out", type=Path, required=True, metavar="FILE", help="where to write the config")
    parser.add_argument("--models-dir", type=Path, action="append", default=[], metavar="DIR",
                        help="a directory searched (recursively) for .gguf files; repeatable")
    parser.add_argument("--force", action="store_true",
                        help="replace FILE if it exists (a symlink at FILE is replaced, its target kept)")
    parser.add_argument("--mesh", choices=("standalone", "open", "ca"), default="standalone",
                        help="standalone (default: no [mesh]), open (labs: --mesh-id) or ca (--ca-certificate)")
    parser.add_argument("--mesh-id", metavar="NAME",
                        help="the mesh's name, for --mesh open, and for --mesh ca with client keys (their audience)")
    parser.add_argument("--ca-certificate", type=Path, metavar="FILE", help="the mesh CA's certificate, for --mesh ca")
    parser.add_argument("--listen", default=DEFAULT_LISTEN, metavar="HOST:PORT",
                        help="the client API's host:port (default 0.0.0.0:8086: every address of this host; "
                             "127.0.0.1:8086 keeps it to this machine)")
    parser.add_argument("--auth", choices=("keys", "none"), default=None,
                        help="client keys: keys (the default, as in the shipped config: inference needs a key "
                             "signed by the issuer whose public key is --issuer-keys) or none (anyone who reaches the "
                             "API uses it; the default with --mesh open)")
    parser.add_argument("--issuer-keys", type=Path, default=DEFAULT_ISSUER_KEYS, metavar="FILE",
                        help=f"the issuer's public key, for --auth keys (default {DEFAULT_ISSUER_KEYS})")
    parser.add_argument("--no-gpus", action="store_true", help="put every model on the CPU")
    parser.set_defaults(func=run_init)


@dataclass(frozen=True)
class GgufFile:
    """A GGUF model file found: ``path`` (absolute), ``size`` bytes."""

    path: Path
    size: int


def find_ggufs(directory: Path, notes: list[str]) -> list[GgufFile]:
    """The GGUF models under ``directory`` (sorted); the first part of a split model only.

    InitError when ``directory`` is not a readable directory; files and subdirectories that
    cannot be read, projector files (mmproj) and later split parts are skipped, each with
    a line in ``notes``.
    """
    shown = quote_path(directory)
    if not directory.exists():
        raise InitError(f"--models-dir {shown}: does not exist")
    if not directory.is_dir():
        raise InitError(f"--models-dir {shown}: not a directory")
    if not os.access(directory, os.R_OK | os.X_OK):
        raise InitError(f"--models-dir {shown}: cannot be read (permission denied)")
    found = []

    def unreadable(exc: OSError) -> None:
        notes.append(f"skipped {quote_path(exc.filename)}: {exc.strerror}")

    for root, dirs, files in os.walk(directory, onerror=unreadable):
        dirs.sort()
        for name in sorted(files):
            if not name.lower().endswith(".gguf"):
                continue
            path = Path(root, name).absolute()
            split = _SPLIT.search(path.stem)
            if name.lower().startswith("mmproj"):
                notes.append(f"skipped {quote_path(path)}: a multimodal projector, not a model")
                continue
            if split and int(split.group(1)) != 1:
                continue  # llama.cpp is given the first part and finds the others
            try:
                os.fsencode(path).decode("utf-8")
            except UnicodeDecodeError:
                notes.append(f"skipped {quote_path(path)}: its name is not UTF-8, which a TOML config cannot hold")
                continue
            try:
                magic, size = _probe(path)
            except OSError as exc:
                notes.append(f"skipped {quote_path(path)}: {exc.strerror or exc}")
                continue
            if magic is None:
                notes.append(f"skipped {quote_path(path)}: not a regular file but {file_kind(size)}")
                continue
            if magic != GGUF_MAGIC:
                notes.append(f"skipped {quote_path(path)}: not a GGUF file (no GGUF magic)")
                continue
            found.append(GgufFile(path, size))
    return found


def _probe(path: Path) -> tuple[bytes | None, int]:
    """(the first 4 bytes, the size) of a regular file (a symlink to one counts); (None,
    st_mode) for anything else, which is never opened: opening a FIFO for reading waits for
    a writer, a device may never end. OSError when it cannot be read."""
    st = os.stat(path)
    if not stat.S_ISREG(st.st_mode):
        return None, st.st_mode
    # O_NONBLOCK: should a FIFO replace the file after the stat, the open does not wait.
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            return None, st.st_mode
        return f.read(4), st.st_size


def model_name(path: Path, taken: set[str]) -> str:
    """A model name from the file name: the stem without a split suffix, characters other
    than letters, digits, '.', '_', '-' replaced by '-', unique among ``taken``."""
    stem = _SPLIT.sub("", path.stem)
    base = _NAME_BAD.sub("-", stem).strip("-") or "model"
    base = base[:MAX_NAME_CHARS - 4]
    name, n = base, 2
    while name in taken:
        name, n = f"{base}-{n}", n + 1
    taken.add(name)
    return name


def find_engine_binary(engine_name: str) -> tuple[str | None, str]:
    """(the binary to write, or None when the default name on PATH will do; why)."""
    engine = ENGINES[engine_name]
    default = getattr(engine.options_model(), "binary", None)
    if not isinstance(default, str):
        return None, f"{engine.display_name}: no binary to look for"
    state, resolved, _ = resolve_binary(default)
    if state is BinaryState.OK:
        return None, f"{engine.display_name}: {default} found on PATH at {quote_path(str(resolved))}"
    beside = Path(sys.executable).parent / default
    state, resolved, _ = resolve_binary(str(beside))
    if state is BinaryState.OK:
        return str(beside), (f"{engine.display_name}: {default} is not on PATH; found next to this Python "
                             f"at {quote_path(beside)}")
    raise InitError(f"{engine.display_name}'s {default} is not on PATH nor next to {quote_path(sys.executable)}: "
                    f"install it, or edit models[].{engine_name}.binary after init")


def gpu_refs(inventory: GpuInventory) -> list[int | str]:
    """The usable GPUs as config entries: indexes on a one-vendor host, else UUIDs."""
    usable = [g for g in inventory.gpus if not g.lost]
    if len(inventory.vendors) > 1:
        return [g.uuid for g in usable if g.uuid]
    return [g.index for g in usable]


def _is_loopback(host: str) -> bool:
    """Whether a listen host is this machine only (``localhost`` or a loopback address)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


DEFAULT_LISTEN = "0.0.0.0:8086"
DEFAULT_ISSUER_KEYS: Path = AuthConfig.model_fields["issuer_keys"].default
#: Ports tried when the default one is held (8087 is the mesh's default port: skipped).
FALLBACK_PORTS = range(8088, 8100)


def _free_port(args: argparse.Namespace, host: str, port: int, say: list[str], notes: list[str]) -> int:
    """The API port to write: ``port`` when it can be bound now; when it is held and came from
    the default, the first free one of FALLBACK_PORTS (``args.listen`` rewritten, the reason
    in ``say``), so the result passes ``config check`` on this machine; a held ``--listen`` is
    kept with a note."""
    problem = bind_problem(host, port)
    if problem != "in use":
        return port
    if args.listen != DEFAULT_LISTEN:
        notes.append(f"port {port} of --listen is in use now: `config check` will say so until it is free")
        return port
    for other in FALLBACK_PORTS:
        if bind_problem(host, other) is None:
            args.listen = f"{host}:{other}"
            say.append(f"api.listen = {args.listen!r} (port {port}, the default, is in use now: another agent "
                       f"or the demo holds it; the next free port)")
            return other
    notes.append(f"port {port} and {FALLBACK_PORTS.start}-{FALLBACK_PORTS.stop - 1} are in use: pass --listen")
    return port


def auth_mode(args: argparse.Namespace) -> str:
    """``--auth``, else its default: ``keys`` (as the shipped config), ``none`` with ``--mesh open``
    (a lab's mesh: keys there would need auth.allow_open_mesh)."""
    chosen = getattr(args, "auth", None)
    return str(chosen) if chosen else ("none" if args.mesh == "open" else "keys")


def plan(files: list[GgufFile], gpus: list[int | str], binary: str | None, args: argparse.Namespace,
         say: list[str]) -> dict[str, Any]:
    """The config as a TOML document (a dict), each choice explained in ``say``."""
    doc: dict[str, Any] = {"api": {"listen": args.listen}}
    if not any(line.startswith("api.listen") for line in say):
        say.append(f"api.listen = {args.listen!r}"
                   + (" (--listen)" if args.listen != DEFAULT_LISTEN else " (the default port)"))
    if args.mesh == "open":
        if not args.mesh_id:
            raise InitError("--mesh open needs --mesh-id NAME (the name shared by the nodes of this mesh)")
        if auth_mode(args) == "keys":
            raise InitError("--auth keys needs --mesh ca: in an open mesh anyone who knows the mesh id receives "
                            "forwarded keys (or --auth none for a lab mesh)")
        doc["mesh"] = {"trust": "open", "mesh_id": args.mesh_id}
        say.append(f"mesh: trust open, mesh_id {args.mesh_id!r} (--mesh open; labs only: peers pinned on first use)")
    elif args.mesh == "ca":
        if args.ca_certificate is None:
            raise InitError("--mesh ca needs --ca-certificate FILE (create a CA with `viiworkctl mesh ca init --out DIR`)")
        if not args.ca_certificate.is_file():
            raise InitError(f"--ca-certificate {quote_path(args.ca_certificate)}: not a file")
        if auth_mode(args) == "keys" and not args.mesh_id:
            raise InitError("--mesh ca with client keys needs --mesh-id NAME (the audience every node's keys carry: "
                            "`viiworkctl keys issue --audience NAME`), or --auth none")
        doc["mesh"] = {"trust": "ca", "ca_certificate": str(args.ca_certificate.absolute())}
        if args.mesh_id:
            doc["mesh"]["mesh_id"] = args.mesh_id
        say.append(f"mesh: trust ca with {quote_path(args.ca_certificate.absolute())} (--mesh ca)"
                   + (f", mesh_id {args.mesh_id!r}" if args.mesh_id else ""))
    else:
        say.append("standalone: no [mesh] (--mesh open or ca to join a mesh)")
    if auth_mode(args) == "keys":
        issuer = Path(os.path.abspath(getattr(args, "issuer_keys", DEFAULT_ISSUER_KEYS)))
        doc["auth"] = {"mode": "keys", "issuer_keys": str(issuer), "open_loopback_reads": True}
        installed = "installed" if issuer.exists() else \
            "not installed yet: docs/install.md, \"Client keys\", says how; until then inference is refused with 401"
        say.append(f"client keys on: issuer key {quote_path(issuer)} ({installed}); reads open on loopback "
                   "(--auth none: keys off)")
    else:
        say.append("client keys off (--auth none" + (", the default with --mesh open" if args.mesh == "open" else "")
                   + "): anyone who reaches the API can use every model")
    models = []
    taken: set[str] = set()
    # The largest chat model gets the GPUs, one backend per GPU; the others run on the CPU.
    chat = [f for f in files if "embed" not in f.path.name.lower()]
    gpu_model = max(chat, key=lambda f: f.size) if chat and gpus else None
    for f in files:
        name = model_name(f.path, taken)
        entry: dict[str, Any] = {"name": name, "engine": GGUF_ENGINE, "path": str(f.path)}
        why = [f"{f.size / 2**20:.1f} MiB GGUF"]
        if "embed" in f.path.name.lower():
            entry["kind"] = "embedding"
            why.append("kind embedding (its file name says embed)")
        if f is gpu_model:
            entry["gpus"] = list(gpus)
            why.append(f"GPUs {', '.join(map(str, gpus))}, one backend each (the largest chat model)")
        else:
            why.append("on the CPU" + (" (the GPUs went to the largest chat model)" if gpu_model else ""))
        if binary is not None:
            entry[GGUF_ENGINE] = {"binary": binary}
        models.append(entry)
        say.append(f"model {name!r}: {quote_path(f.path)} ({'; '.join(why)})")
    if models:
        doc["models"] = models
    return doc


def run_init(args: argparse.Namespace) -> int:
    """Exit 0 with FILE written; 1 with one error line on stderr and nothing written."""
    try:
        return _init(args)
    except InitError as exc:
        print(f"viiworkctl init: {exc}", file=sys.stderr)
        return 1


def _init(args: argparse.Namespace) -> int:
    out: Path = args.out
    try:
        check_out(out, args.force)
    except OutFileError as exc:
        raise InitError(str(exc)) from None
    if not out.parent.is_dir():
        raise InitError(f"{quote_path(out.parent)} (the directory of --out) does not exist")
    if args.mesh_id is not None and args.mesh == "standalone":
        raise InitError("--mesh-id is for --mesh open or ca")
    if args.ca_certificate is not None and args.mesh != "ca":
        raise InitError("--ca-certificate is for --mesh ca")
    try:
        listen_host, listen_port = parse_hostport(args.listen, "--listen")
    except ValueError as exc:
        raise InitError(str(exc)) from None
    say: list[str] = []
    notes: list[str] = []
    listen_port = _free_port(args, listen_host, listen_port, say, notes)
    if not _is_loopback(listen_host) and auth_mode(args) == "none":
        notes.append(f"api.listen = {args.listen!r}: every machine that can reach this host on port {listen_port} "
                     f"can use the API (client keys are off); to keep it to this machine pass --listen "
                     f"127.0.0.1:{listen_port}, and reach it from elsewhere through `ssh -L "
                     f"{listen_port}:localhost:{listen_port} {socket.gethostname()}`")
    files = [f for d in args.models_dir for f in find_ggufs(d, notes)]
    if not args.models_dir:
        notes.append("no --models-dir given: no [[models]] written")
    elif not files:
        notes.append(f"no GGUF file under {', '.join(map(quote_path, args.models_dir))}: no [[models]] written")
    binary = None
    if files:
        binary, why = find_engine_binary(GGUF_ENGINE)
        say.append(why)
    gpus: list[int | str] = []
    if not args.no_gpus:
        inventory = read_gpus()
        gpus = gpu_refs(inventory)
        say.append(f"GPUs: {inventory.describe()}")
    doc = plan(files, gpus, binary, args, say)
    # quote_path: a newline in the host name or --out would end the comment and forge TOML.
    header = (f"# Written by `viiworkctl init` on {quote_path(socket.gethostname())}. "
              "Every key: docs/configuration.md;\n"
              f"# the effective config: `{command('viiworkctl')} config show --config {quote_path(out)}`.\n\n")
    text = header + tomli_w.dumps(doc)
    try:
        data = text.encode("utf-8")
    except UnicodeEncodeError:
        raise InitError("an argument is not UTF-8 text, which a TOML config cannot hold") from None
    try:
        parse_config(text, str(out))  # the very text written
    except ConfigError as exc:
        raise InitError("the config would be invalid: " + "; ".join(str(i) for i in exc.issues)) from None
    try:
        write_whole(out, data, replace=args.force)
    except OutFileError as exc:
        raise InitError(str(exc)) from None
    for line in say:
        print(line)
    for line in notes:
        print(f"note: {line}")
    print(f"wrote {quote_path(out)}; check it with `{command('viiworkctl')} config check {quote_path(out)}`")
    return 0


def read_gpus() -> GpuInventory:
    """This host's GPUs (NVML and amdgpu sysfs), as ``viiworkctl doctor`` reads them."""
    from viiwork.agent.host.gpus.amd import AmdSysfsReader
    from viiwork.agent.host.gpus.inventory import read_inventory_once
    from viiwork.agent.host.gpus.nvml import NvmlReader

    return read_inventory_once([NvmlReader(), AmdSysfsReader("/")])
