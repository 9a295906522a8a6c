"""The conformance kit's gang checks (engines/conformance.py calls ``check_gang``).

For an adapter that declares a ``launch_shape`` (docs/engines.md, "Gangs"):

- ``gang.shape``: ``launch_shape`` is a ``LaunchShape`` and the adapter implements every
  ``GangEngine`` member; ``per_host_options`` is a frozenset of its options model's keys;
  ``workers_load_model`` is a bool.
- ``gang.options``: ``check_gang`` accepts the default options on one host (a one-host model
  is never refused for gang options it did not set); ``gang_shared`` answers a JSON object
  without the per-host keys.
- ``gang.command``: on a gang of 3 hosts, every part ``roles_at`` names builds a command
  (argv a non-empty tuple of strings, env str to str), the same twice (pure), with no
  wildcard address; the SERVER part answers to the model and its operator args are argv's
  tail; a role the shape does not have at a rank raises ``EngineOptionsError``;
  ``gang_listen`` answers None or ``host:port``; ``gang_ports`` answers ``PortRange`` values
  inside ``gang_port .. gang_port + gang_port_span - 1``, and a ``host:port`` that
  ``gang_listen`` names on the gang's address lies in them (a port the agent confines).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import replace

from viiwork.engines.contract import BackendSpec, Engine, EngineOptionsError, LaunchCommand
from viiwork.engines.gang import GangAddresses, GangEngine, LaunchShape, PartRole, PortRange, roles_at

Report = Callable[[str, str], None]
_WILDCARD_HOSTS = ("0.0.0.0", "::", "[::]", "*")
_SIZE = 3
_GANG_PORT = 29517


def _addresses(rank: int) -> GangAddresses:
    return GangAddresses(gang_id="conformx7aaa", rank=rank, size=_SIZE,
                         node_addresses=tuple(f"10.7.0.{i + 1}" for i in range(_SIZE)), port=_GANG_PORT,
                         worker_endpoints=tuple(f"127.0.0.1:{41000 + i}" for i in range(1, _SIZE)) if rank == 0 else ())


def check_gang(engine: Engine, specs: Sequence[BackendSpec], report: Report) -> None:
    """Call ``report(check, message)`` for every gang rule ``engine`` breaks
    (module docstring); nothing for an engine without ``launch_shape``."""
    shape = getattr(engine, "launch_shape", None)
    if shape is None:
        return
    if not isinstance(shape, LaunchShape):
        report("gang.shape", f"launch_shape must be a LaunchShape, got {shape!r}")
        return
    if not isinstance(engine, GangEngine):
        missing = [m for m in ("per_host_options", "workers_load_model", "check_gang", "gang_shared", "gang_command",
                               "gang_listen", "gang_port_span", "gang_ports") if not hasattr(engine, m)]
        report("gang.shape", f"declares launch_shape but lacks {', '.join(missing)} (GangEngine)")
        return
    fields = set(engine.options_model.model_fields)
    per_host = engine.per_host_options
    if not isinstance(per_host, frozenset) or not per_host <= fields:
        report("gang.shape", f"per_host_options must be a frozenset of option keys "
                             f"({', '.join(sorted(fields))}), got {per_host!r}")
    if not isinstance(engine.workers_load_model, bool):
        report("gang.shape", f"workers_load_model must be a bool, got {engine.workers_load_model!r}")
    span = engine.gang_port_span
    if type(span) is not int or not 1 <= span <= 1024:
        report("gang.shape", f"gang_port_span must be an int 1..1024, got {span!r}")
    _check_options(engine, report)
    spec = next((s for s in specs if s.gpus and s.socket_path is None), None)
    if spec is not None:
        _check_commands(engine, shape, spec, report)


def _check_options(engine: GangEngine, report: Report) -> None:
    options = engine.options_model()  # type: ignore[attr-defined]
    try:
        engine.check_gang(options, 1, 1)
        engine.check_gang(options, _SIZE, 1)
    except EngineOptionsError as exc:
        report("gang.options", f"check_gang refused the default options: {exc}")
    except Exception as exc:  # noqa: BLE001
        report("gang.options", f"check_gang raised {type(exc).__name__}, not EngineOptionsError")
    try:
        shared = engine.gang_shared(options, _SIZE, 1)
        json.dumps(shared)
    except Exception as exc:  # noqa: BLE001
        report("gang.options", f"gang_shared must answer a JSON object: {type(exc).__name__}: {exc}")
        return
    if not isinstance(shared, dict) or set(shared) & engine.per_host_options:
        report("gang.options", f"gang_shared must leave out the per-host keys, got {sorted(shared)}")


def _check_commands(engine: GangEngine, shape: LaunchShape, spec: BackendSpec, report: Report) -> None:
    for rank in range(_SIZE):
        gang = _addresses(rank)
        for role in PartRole:
            where = f"{role.value} part at rank {rank}"
            expected = role in roles_at(shape, rank)
            try:
                cmd = engine.gang_command(spec, role, gang)
            except EngineOptionsError:
                if expected:
                    report("gang.command", f"the {where} raised EngineOptionsError")
                continue
            except Exception as exc:  # noqa: BLE001
                report("gang.command", f"the {where} raised {type(exc).__name__}: {exc}")
                continue
            if not expected:
                report("gang.command", f"built a command for the {where}, which a {shape.value} gang "
                                       "has not: raise EngineOptionsError")
                continue
            _check_part(engine, spec, role, gang, cmd, where, report)


def _check_part(engine: GangEngine, spec: BackendSpec, role: PartRole, gang: GangAddresses, cmd: object,
                where: str, report: Report) -> None:
    if not (isinstance(cmd, LaunchCommand) and isinstance(cmd.argv, tuple) and cmd.argv
            and all(isinstance(a, str) for a in cmd.argv)
            and all(isinstance(k, str) and isinstance(v, str) for k, v in cmd.env.items())):
        report("gang.command", f"the {where}: argv must be a non-empty tuple of str, env str to str")
        return
    if engine.gang_command(replace(spec), role, gang) != cmd:
        report("gang.command", f"the {where}: not the same command twice (gang_command must be pure)")
    wild = [a for a in cmd.argv if a in _WILDCARD_HOSTS or any(a.startswith(w + ":") for w in _WILDCARD_HOSTS)]
    if wild:
        report("gang.command", f"the {where} binds a wildcard address: {wild}")
    if role is PartRole.SERVER:
        if spec.model not in cmd.argv and spec.model not in cmd.env.values():
            report("gang.command", f"the {where} does not answer to the model name {spec.model!r}")
        if spec.args and tuple(cmd.argv[-len(spec.args):]) != spec.args:
            report("gang.command", f"the {where}: the operator args must be argv's tail")
    listen = engine.gang_listen(role, gang)
    if listen is not None and not (isinstance(listen, str) and listen.rpartition(":")[2].isdigit()):
        report("gang.command", f"gang_listen for the {where} must be None or host:port, got {listen!r}")
        return
    _check_ports(engine, role, gang, listen, where, report)


def _check_ports(engine: GangEngine, role: PartRole, gang: GangAddresses, listen: str | None, where: str,
                 report: Report) -> None:
    ports = engine.gang_ports(role, gang)
    last = gang.port + engine.gang_port_span - 1
    if not (isinstance(ports, tuple) and all(isinstance(r, PortRange) for r in ports)):
        report("gang.command", f"gang_ports for the {where} must be a tuple of PortRange, got {ports!r}")
        return
    outside = [str(r) for r in ports if r.first < gang.port or r.last > last]
    if outside:
        report("gang.command", f"gang_ports for the {where}: {', '.join(outside)} outside the gang's block "
                               f"{gang.port}-{last} (gang_port_span)")
    if listen is not None:
        host, _, port = listen.rpartition(":")
        if host.strip("[]") == gang.self_address and not any(r.first <= int(port) <= r.last for r in ports):
            report("gang.command", f"the {where} listens on {listen} on the gang's address, outside its "
                                   "gang_ports: the agent would leave it open to everyone")
