"""The gang plan: in which order a gang's parts start, and when the gang serves (sans-IO).

``plan_gang(shape, size)`` gives the ordered steps of a gang of ``size`` hosts, each step the
parts to start together and what each must reach before the next step starts:

- ``RANKS``: one step, every rank at once (torch's rendezvous waits for all of them); rank 0's
  server must answer its probe, the other ranks must be running.
- ``WORKERS_THEN_HEAD``: the workers, each until its port accepts connections (llama-server
  fails at start when an ``--rpc`` server is unreachable); then the head's server, until its
  probe answers ready.
- ``CLUSTER_RUNTIME``: the head's runtime until its port accepts connections (Ray's GCS);
  the workers' runtimes, running (``ray start --block`` exits when it cannot join); then
  the head's server, until its probe answers ready (vLLM waits for the workers' GPUs in
  its placement group itself).

``GangLaunch`` follows one start of a plan, fed what the launcher observes (a part reached a
``Ready`` level, a part exited) and answering with actions (start these parts, the gang
serves, the gang failed). Nothing it is fed raises: a part reported before its step started,
or any part's exit, fails the whole gang (no half-gangs serving: docs/engines.md, "Gangs").
The agent's gang launcher (coming) and the tests' fake-engine driver are both driven by it.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from viiwork.engines.gang import MAX_GANG_HOSTS, GangPart, LaunchShape, PartRole


class Ready(StrEnum):
    """How far a part has come, in order: PROCESS < PORT < PROBE.

    PROCESS: its process runs (the unit is active). PORT: ``GangEngine.gang_listen`` accepts a
    TCP connection from the part's own host. PROBE: the adapter's ``probe`` answers ready
    (only the SERVER part; the gang's readiness is this)."""

    PROCESS = "process"
    PORT = "port"
    PROBE = "probe"

    @property
    def level(self) -> int:
        return _LEVELS[self]


_LEVELS = {Ready.PROCESS: 1, Ready.PORT: 2, Ready.PROBE: 3}


@dataclass(frozen=True, slots=True)
class GangStep:
    """Parts started together; ``ready[i]`` is what ``parts[i]`` must reach before the next step."""

    parts: tuple[GangPart, ...]
    ready: tuple[Ready, ...]

    def __post_init__(self) -> None:
        if not self.parts or len(self.parts) != len(self.ready):
            raise ValueError("GangStep needs one Ready per part, and at least one part")

    def ready_of(self, part: GangPart) -> Ready:
        return self.ready[self.parts.index(part)]


@dataclass(frozen=True, slots=True)
class GangPlan:
    """The steps of one gang: ``shape``, ``size`` hosts, ``steps`` in start order."""

    shape: LaunchShape
    size: int
    steps: tuple[GangStep, ...]

    @property
    def serving(self) -> GangPart:
        """The part that serves HTTP: rank 0's SERVER."""
        return GangPart(0, PartRole.SERVER)

    @property
    def parts(self) -> tuple[GangPart, ...]:
        """Every part, in start order."""
        return tuple(p for step in self.steps for p in step.parts)

    def parts_on(self, rank: int) -> tuple[GangPart, ...]:
        """The parts the host of ``rank`` runs, in start order."""
        return tuple(p for p in self.parts if p.rank == rank)

    def stop_order(self) -> tuple[GangPart, ...]:
        """Every part in the order to stop them: the reverse of the start order (the server
        first, the head's runtime last)."""
        return tuple(reversed(self.parts))


def plan_gang(shape: LaunchShape, size: int) -> GangPlan:
    """The plan of a gang of ``shape`` over ``size`` hosts (2..MAX_GANG_HOSTS; ValueError
    otherwise). See the module docstring for each shape's steps."""
    if not 2 <= size <= MAX_GANG_HOSTS:
        raise ValueError(f"a gang spans 2..{MAX_GANG_HOSTS} hosts, got {size}")
    others = range(1, size)
    server = GangPart(0, PartRole.SERVER)
    steps: tuple[GangStep, ...]
    if shape is LaunchShape.RANKS:
        ranks = tuple(GangPart(r, PartRole.RANK) for r in others)
        steps = (GangStep((server, *ranks), (Ready.PROBE, *(Ready.PROCESS for _ in ranks))),)
    elif shape is LaunchShape.WORKERS_THEN_HEAD:
        workers = tuple(GangPart(r, PartRole.WORKER) for r in others)
        steps = (GangStep(workers, tuple(Ready.PORT for _ in workers)), GangStep((server,), (Ready.PROBE,)))
    elif shape is LaunchShape.CLUSTER_RUNTIME:
        joining = tuple(GangPart(r, PartRole.RUNTIME) for r in others)
        steps = (GangStep((GangPart(0, PartRole.RUNTIME),), (Ready.PORT,)),
                 GangStep(joining, tuple(Ready.PROCESS for _ in joining)),
                 GangStep((server,), (Ready.PROBE,)))
    else:  # pragma: no cover - StrEnum exhausted
        raise ValueError(f"unknown launch shape {shape!r}")
    return GangPlan(shape, size, steps)


class LaunchState(StrEnum):
    """PENDING (not started), STARTING (steps under way), SERVING, FAILED (final)."""

    PENDING = "pending"
    STARTING = "starting"
    SERVING = "serving"
    FAILED = "failed"


@dataclass(frozen=True, slots=True)
class StartParts:
    """Start these parts now (together: the launcher does not wait between them)."""

    parts: tuple[GangPart, ...]


@dataclass(frozen=True, slots=True)
class GangServing:
    """Every step is done: the gang serves (its server answered its probe)."""


@dataclass(frozen=True, slots=True)
class GangFailed:
    """The gang failed: stop every part (``GangPlan.stop_order``) and start it again whole.
    ``part``: the part it failed on."""

    part: GangPart
    reason: str


GangAction = StartParts | GangServing | GangFailed


class GangLaunch:
    """One start of a ``GangPlan``, fed observations, answering actions (module docstring).

    ``start()`` -> ``[StartParts(first step)]``. ``part_reached(part, level)``: the launcher saw
    ``part`` reach ``level``; when every part of the current step reached what the step
    needs, the answer is the next ``StartParts``, or ``GangServing`` after the last step.
    ``part_exited(part, reason)``: ``GangFailed`` (also after ``SERVING``). A part reported
    before its step was started fails the gang ("out of order"); reports of parts the plan
    does not have are counted in ``ignored`` and change nothing; after ``FAILED`` everything
    answers ``[]``.
    """

    def __init__(self, plan: GangPlan) -> None:
        self.plan = plan
        self.state = LaunchState.PENDING
        self.ignored = 0
        self._step = -1
        self._reached: dict[GangPart, Ready] = {}
        self._known = frozenset(plan.parts)

    @property
    def started(self) -> tuple[GangPart, ...]:
        """The parts whose start has been asked for, in start order."""
        return tuple(p for step in self.plan.steps[:self._step + 1] for p in step.parts)

    def reached(self, part: GangPart) -> Ready | None:
        """The furthest level ``part`` was reported at, or None."""
        return self._reached.get(part)

    def start(self) -> list[GangAction]:
        """Begin: the first step's parts. RuntimeError when called twice."""
        if self.state is not LaunchState.PENDING:
            raise RuntimeError("GangLaunch.start() called twice")
        self.state = LaunchState.STARTING
        self._step = 0
        return [StartParts(self.plan.steps[0].parts)]

    def part_reached(self, part: GangPart, level: Ready) -> list[GangAction]:
        if self.state is LaunchState.FAILED:
            return []
        if part not in self._known:
            self.ignored += 1
            return []
        if part not in self.started:
            return self._fail(part, f"{part} reported {level.value} before it was started (out of order)")
        previous = self._reached.get(part)
        if previous is None or level.level > previous.level:
            self._reached[part] = level
        if self.state is not LaunchState.STARTING:
            return []
        step = self.plan.steps[self._step]
        if not all(self._reached.get(p, None) is not None and self._reached[p].level >= step.ready_of(p).level
                   for p in step.parts):
            return []
        if self._step + 1 < len(self.plan.steps):
            self._step += 1
            return [StartParts(self.plan.steps[self._step].parts)]
        self.state = LaunchState.SERVING
        return [GangServing()]

    def part_exited(self, part: GangPart, reason: str) -> list[GangAction]:
        if self.state is LaunchState.FAILED:
            return []
        if part not in self._known:
            self.ignored += 1
            return []
        return self._fail(part, f"{part} exited: {reason}")

    def _fail(self, part: GangPart, reason: str) -> list[GangAction]:
        self.state = LaunchState.FAILED
        return [GangFailed(part, reason)]
