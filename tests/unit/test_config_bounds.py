"""Every number in the config has a range, the loader enforces it and names field and line.

Issue 14, part 6. The ranges are documented in docs/configuration.md (the Type column).
A meta-test walks every pydantic model of the config (the sections, ``[[models]]`` and each
registered engine's options block) and feeds each numeric key a huge value, its negation,
and for floats inf, -inf and nan, through the real loader: a key added later without an
upper bound, or a float key that lets inf or nan through, fails it. Configs are written as
TOML text and read by ``parse_config``, so each error also carries its line.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import typing
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import pytest
from annotated_types import Ge, Gt, Le, Lt
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from viiwork.agent.config.load import ConfigError, ConfigIssue, parse_config
from viiwork.agent.config.schema import Config, ModelConfig
from viiwork.engines.registry import ENGINES

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "configuration.md"

HUGE_INT = 10**20  # the issue's `parallel = 99999999999999999999`, near enough
HUGE_FLOAT = 1e300


# --- a small TOML writer (the loader reads text, so errors get their lines) ---------------

def _value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return repr(v)  # inf, -inf, nan, 1e+300 and 86400.00000000001 are TOML floats
    if isinstance(v, int):
        return str(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, list):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{k} = {_value(x)}" for k, x in v.items()) + " }"
    raise TypeError(v)


def _is_table_array(v: Any) -> bool:
    return isinstance(v, list) and bool(v) and all(isinstance(x, dict) for x in v)


def to_toml(data: dict[str, Any], prefix: str = "") -> str:
    out = [f"{k} = {_value(v)}" for k, v in data.items() if not isinstance(v, dict) and not _is_table_array(v)]
    for k, v in data.items():
        name = f"{prefix}.{k}" if prefix else k
        if isinstance(v, dict):
            out += ["", f"[{name}]", to_toml(v, name)]
        elif _is_table_array(v):
            for entry in v:
                out += ["", f"[[{name}]]", to_toml(entry, name)]
    return "\n".join(out).strip("\n") + "\n"


def base_config() -> dict[str, Any]:
    """A valid config that reaches every section: a mesh, and one model per engine."""
    return {
        "mesh": {"trust": "open", "mesh_id": "bounds"},
        "models": [{"name": f"m-{name}", "engine": name, "path": "/m.gguf", name: {}} for name in ENGINES],
    }


def with_value(loc: tuple[str | int, ...], value: Any, extra: dict[str, Any] | None = None) -> str:
    """base_config() with ``value`` at ``loc`` (and ``extra`` keys in the same table), as TOML."""
    data = base_config()
    table: Any = data
    for part in loc[:-1]:
        table = table[part] if isinstance(part, int) else table.setdefault(part, {})
    table[loc[-1]] = value
    table.update(extra or {})
    return to_toml(data)


def issues_of(text: str) -> list[ConfigIssue]:
    try:
        parse_config(text, "bounds.toml")
    except ConfigError as exc:
        return exc.issues
    return []


def line_of_key(text: str, key: str, after: int = 0) -> int:
    lines = text.splitlines()
    return next(i for i, line in enumerate(lines, 1) if i > after and line.startswith(f"{key} = "))


# --- walking the models ----------------------------------------------------------------

def _models_in(annotation: Any) -> list[tuple[type[BaseModel], bool]]:
    """Models a field holds: (model, inside a list)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [(annotation, False)]
    found = []
    for arg in get_args(annotation):
        for model, listed in _models_in(arg):
            found.append((model, listed or get_origin(annotation) is list))
    return found


def sections(model: type[BaseModel] = Config,
             loc: tuple[str | int, ...] = ()) -> list[tuple[tuple[str | int, ...], type[BaseModel]]]:
    """Every model of the config with the location of one instance of it in base_config()."""
    found = [(loc, model)]
    for name, field in model.model_fields.items():
        for sub, listed in _models_in(field.annotation):
            found += sections(sub, loc + ((name, 0) if listed else (name,)))
    if model is ModelConfig:
        # The engine block is stored in `options` (Any) and written as a table named for the engine.
        for index, (engine_name, engine) in enumerate(ENGINES.items()):
            found += sections(engine.options_model, loc[:-1] + (index, engine_name))
    return found


Shape = tuple[type, str]  # (int or float, "scalar" | "list" | "dict")


def numeric(annotation: Any, shape: str = "scalar") -> Shape | None:
    """(int or float, how the number sits in the value), or None for a non-numeric field."""
    if annotation is bool or get_origin(annotation) is Literal:
        return None
    if annotation in (int, float):
        return (annotation, shape)
    origin = get_origin(annotation)
    if origin is typing.Annotated:
        return numeric(get_args(annotation)[0], shape)
    inner = "list" if origin is list else "dict" if origin is dict else shape
    args = get_args(annotation)[1:] if origin is dict else get_args(annotation)
    kinds = [k for k in (numeric(a, inner) for a in args) if k is not None]
    if not kinds:
        return None
    return next((k for k in kinds if k[0] is float), kinds[0])


NUMERIC_KEYS = [
    (loc + (name,), kind, field)
    for loc, model in sections()
    for name, field in model.model_fields.items()
    if (kind := numeric(field.annotation)) is not None
]


def dotted(loc: tuple[str | int, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else part)
    return out


def _wrap(value: Any, shape: str) -> Any:
    return [value] if shape == "list" else {"k": value} if shape == "dict" else value


def _reported_at(issues: list[ConfigIssue], path: str) -> bool:
    return any(i.dotted == path or i.dotted.startswith((path + ".", path + "[")) for i in issues)


def test_the_walk_finds_the_sections() -> None:
    locs = {dotted(loc) for loc, _ in sections()}
    assert {"api", "health", "mesh", "models[0]", "routing", "supervisor"} <= locs
    assert {dotted(("models", i, name)) for i, name in enumerate(ENGINES)} <= locs
    keys = {dotted(loc) for loc, _, _ in NUMERIC_KEYS}
    assert {"models[0].parallel", "routing.queue_timeout_s", "models[0].gpus", "models[0].llamacpp.gpu_layers"} <= keys
    assert issues_of(to_toml(base_config())) == []


@pytest.mark.parametrize(("loc", "kind"), [(loc, kind) for loc, kind, _ in NUMERIC_KEYS],
                         ids=[dotted(loc) for loc, _, _ in NUMERIC_KEYS])
def test_every_numeric_key_is_bounded(loc: tuple[str | int, ...], kind: Shape) -> None:
    """Meta-test: a number past any sane range, or its negation, is an error at its key."""
    number, shape = kind
    path = dotted(loc)
    for value in (HUGE_INT, -HUGE_INT) if number is int else (HUGE_FLOAT, -HUGE_FLOAT):
        issues = issues_of(with_value(loc, _wrap(value, shape)))
        assert _reported_at(issues, path), f"{path} = {value!r} is accepted: give it a bound (Field(ge=, le=))"


FLOAT_KEYS = [(loc, shape) for loc, (number, shape), _ in NUMERIC_KEYS if number is float]


@pytest.mark.parametrize(("loc", "shape"), FLOAT_KEYS, ids=[dotted(loc) for loc, _ in FLOAT_KEYS])
@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan], ids=["inf", "-inf", "nan"])
def test_no_float_key_takes_inf_or_nan(loc: tuple[str | int, ...], shape: str, value: float) -> None:
    text = with_value(loc, _wrap(value, shape))
    issues = [i for i in issues_of(text) if _reported_at([i], dotted(loc))]
    assert issues, f"{dotted(loc)} = {value!r} is accepted"
    assert "finite number" in issues[0].message, str(issues[0])
    assert issues[0].line == line_of_key(text, loc[-1]), str(issues[0])


def _upper(field: Any) -> float | None:
    for meta in field.metadata:
        if isinstance(meta, Le):
            return meta.le
        if isinstance(meta, Lt):
            return meta.lt
    return None


def _doc_type_cells() -> dict[str, str]:
    """`section.key` (models.llamacpp.threads) -> the Type cell of its row."""
    cells, section = {}, None
    for line in DOC.read_text(encoding="utf-8").splitlines():
        if line.startswith("#"):
            section = line.strip("# `[]") if "`[" in line else None
            continue
        if section and line.startswith("| `"):
            row = [c.strip() for c in line.strip().strip("|").split("|")]
            cells[f"{section}.{row[0].strip('`')}"] = row[1]
    return cells


DOC_CASES = [(loc, field) for loc, _, field in NUMERIC_KEYS if _upper(field) is not None]


@pytest.mark.parametrize(("loc", "field"), DOC_CASES, ids=[dotted(loc) for loc, _ in DOC_CASES])
def test_the_docs_give_each_upper_bound(loc: tuple[str | int, ...], field: Any) -> None:
    key = ".".join(p for p in loc if isinstance(p, str))
    cell = _doc_type_cells().get(key)
    assert cell is not None, f"docs/configuration.md has no row for {key}"
    bound = _upper(field)
    assert f"{bound:g}" in cell.replace(",", "") or str(bound) in cell.replace(",", ""), (
        f"docs/configuration.md: the Type of {key} ({cell!r}) does not name its upper bound {bound}"
    )


# --- each bound, just inside and just outside --------------------------------------------

DAY_S, DAY_MS = 86_400.0, 86_400_000
DURATIONS_S = [
    ("api", "stream_idle_timeout_s", 0.0), ("api", "client_stall_timeout_s", 0.0),
    ("health", "interval_s", 0.0), ("health", "timeout_s", 0.0), ("health", "respawn_backoff_s", 0.0),
    ("health", "respawn_backoff_max_s", 0.0), ("health", "healthy_refill_s", 0.0),
    ("supervisor", "stop_timeout_s", 0.0), ("supervisor", "load_poll_interval_s", 0.0),
    ("supervisor", "load_stale_after_s", 0.0), ("routing", "queue_timeout_s", 0.0),
    ("models", "startup_timeout_s", 0.0),
]
# (table, key, lowest valid, highest valid); gt=0 floats are in DURATIONS_S.
INT_BOUNDS = [
    ("api", "max_body_bytes", 1024, 2**30),
    ("health", "max_failures", 1, 1000),
    ("health", "max_respawns", 0, 1000),
    ("supervisor", "max_parallel_loads", 1, 1024),
    ("routing", "queue_max", 0, 65536),
    ("routing", "forward_retry", 0, 64),
    ("routing", "stale_after_ms", 1, DAY_MS),
    ("mesh", "gossip_interval_ms", 10, DAY_MS // 3),  # suspect >= 2 rounds, dead >= 3 rounds, <= a day
    ("mesh", "fanout", 1, 1024),
    # low: 2 rounds of the shortest gossip_interval_ms; just outside: DAY_MS + 1 (it is also below dead_after_ms)
    ("mesh", "suspect_after_ms", 20, DAY_MS),
    ("mesh", "dead_after_ms", 2001, DAY_MS),  # above suspect_after_ms (2000)
    ("mesh", "max_peers", 1, 65536),
    ("models", "parallel", 1, 1024),
    ("models", "ctx_per_slot", 1, 2**31 - 1),
    ("models", "gpus_per_backend", 1, 1024),
    ("models", "backends", 1, 64),
    ("models", "memory_max_bytes", 2**20, 2**50),
    ("models", "cpu_weight", 1, 10000),
    ("models", "tasks_max", 1, 4_194_304),
    ("models.llamacpp", "threads", 1, 4096),
    ("models.llamacpp", "gpu_layers", 0, 10_000),
    ("models.vllm", "cpu_kv_cache_gib", 1, 16384),
]
FLOAT_BOUNDS = [  # (table, key, low, low valid?, high, high valid?)
    ("health", "drain_timeout_s", 0.0, True, DAY_S, True),
    ("models.vllm", "gpu_memory_utilization", 0.0, False, 1.0, True),
    ("models.sglang", "mem_fraction_static", 0.0, False, 1.0, False),
]
# Keys that must be set alongside, so the value under test is the only problem.
ALONGSIDE = {"ctx_per_slot": {"parallel": 1}, "suspect_after_ms": {"dead_after_ms": DAY_MS, "gossip_interval_ms": 10},
             "gossip_interval_ms": {"suspect_after_ms": DAY_MS - 1, "dead_after_ms": DAY_MS}}
# Just inside, where the field bound meets a rule between fields (suspect < dead <= a day).
INSIDE_HIGH = {"suspect_after_ms": DAY_MS - 1}


def _loc(table: str, key: str) -> tuple[str | int, ...]:
    if table == "models":
        return ("models", 0, key)
    if table.startswith("models."):
        engine = table.split(".", 1)[1]
        return ("models", list(ENGINES).index(engine), engine, key)
    return (table, key)


def _check(table: str, key: str, value: Any, valid: bool) -> None:
    loc = _loc(table, key)
    text = with_value(loc, value, ALONGSIDE.get(key))
    issues = issues_of(text)
    if valid:
        assert issues == [], f"{dotted(loc)} = {value!r}: {[str(i) for i in issues]}"
        return
    (issue,) = issues
    assert issue.dotted == dotted(loc), str(issue)
    assert issue.line == line_of_key(text, key), str(issue)


def _cases() -> list[Any]:
    cases = []
    for table, key, low, high in INT_BOUNDS:
        for value, valid in ((low, True), (low - 1, False), (INSIDE_HIGH.get(key, high), True), (high + 1, False)):
            cases.append(pytest.param(table, key, value, valid, id=f"{table}.{key}={value}"))
    for table, key, low in DURATIONS_S:
        cases += [
            pytest.param(table, key, low, False, id=f"{table}.{key}=0"),
            pytest.param(table, key, math.nextafter(low, 1.0), True, id=f"{table}.{key}=just-above-0"),
            pytest.param(table, key, DAY_S, True, id=f"{table}.{key}=86400"),
            pytest.param(table, key, math.nextafter(DAY_S, math.inf), False, id=f"{table}.{key}=just-above-86400"),
        ]
    for table, key, low, low_ok, high, high_ok in FLOAT_BOUNDS:
        for value, valid in (
            (low, low_ok), (math.nextafter(low, -math.inf) if low_ok else math.nextafter(low, math.inf), not low_ok),
            (high, high_ok), (math.nextafter(high, math.inf) if high_ok else math.nextafter(high, -math.inf), not high_ok),
        ):
            cases.append(pytest.param(table, key, value, valid, id=f"{table}.{key}={value!r}"))
    return cases


@pytest.mark.parametrize(("table", "key", "value", "valid"), _cases())
def test_bound_just_inside_and_just_outside(table: str, key: str, value: Any, valid: bool) -> None:
    _check(table, key, value, valid)


def test_the_issues_parallel_is_refused_with_field_and_line() -> None:
    text = '[[models]]\nname = "a"\nengine = "llamacpp"\npath = "/m.gguf"\nparallel = 99999999999999999999\n'
    (issue,) = issues_of(text)
    assert str(issue) == (
        "models[0].parallel: Input should be less than or equal to 1024, got 99999999999999999999 (line 5)"
    )


def test_the_issues_infinite_queue_timeout_is_refused() -> None:
    (issue,) = issues_of("[routing]\nqueue_max = 8\nqueue_timeout_s = inf\n")
    assert str(issue) == "routing.queue_timeout_s: Input should be a finite number, got inf (line 3)"


@pytest.mark.parametrize(("ctx", "parallel", "valid"), [
    (2**21 - 1, 1024, True),   # 2^31 - 1024
    (2**21, 1024, False),      # 2^31 exactly
    (2**31 - 1, 1, True),
    (2**30, 2, False),
    (65536, 32768 // 1024, True),
])
def test_ctx_per_slot_times_parallel_stays_below_2_31(ctx: int, parallel: int, valid: bool) -> None:
    text = f'[[models]]\nname = "a"\nengine = "llamacpp"\npath = "/m.gguf"\nparallel = {parallel}\nctx_per_slot = {ctx}\n'
    issues = issues_of(text)
    if valid:
        assert issues == []
        return
    (issue,) = issues
    assert issue.dotted == "models[0].ctx_per_slot" and issue.line == 6, str(issue)
    assert "ctx_per_slot * parallel" in issue.message and str(ctx * parallel) in issue.message, str(issue)


def test_the_product_is_checked_per_model_entry() -> None:
    fine = '[[models]]\nname = "a"\nengine = "llamacpp"\npath = "/m.gguf"\n'
    text = fine + '\n[[models]]\nname = "b"\nengine = "llamacpp"\npath = "/m.gguf"\nctx_per_slot = 4194304\nparallel = 512\n'
    (issue,) = issues_of(text)
    assert (issue.dotted, issue.line) == ("models[1].ctx_per_slot", 10), str(issue)


@pytest.mark.parametrize(("gpus", "valid"), [([1023], True), ([1024], False), ([-1], False), ([0, 5000], False)])
def test_gpu_indexes_are_bounded(gpus: list[int], valid: bool) -> None:
    text = with_value(("models", 0, "gpus"), gpus)
    issues = issues_of(text)
    assert (issues == []) is valid, [str(i) for i in issues]
    if not valid:
        assert [(i.dotted, i.line) for i in issues] == [("models[0].gpus", line_of_key(text, "gpus"))]


# --- ports ------------------------------------------------------------------------------

@pytest.mark.parametrize(("table", "key", "value", "valid"), [
    ("api", "listen", "127.0.0.1:0", True),  # 0 = any free port, which tests bind
    ("api", "listen", "127.0.0.1:65535", True),
    ("api", "listen", "127.0.0.1:65536", False),
    ("api", "listen", "127.0.0.1:-1", False),
    ("mesh", "listen", "[::1]:0", True),
    ("mesh", "listen", "[::1]:65536", False),
    ("mesh", "seeds", ["10.0.0.2:1"], True),
    ("mesh", "seeds", ["10.0.0.2:65535"], True),
    ("mesh", "seeds", ["10.0.0.2:0"], False),  # a seed is dialled: port 0 means nothing there
    ("mesh", "seeds", ["10.0.0.2:65536"], False),
])
def test_ports(table: str, key: str, value: Any, valid: bool) -> None:
    _check(table, key, value, valid)


# --- properties ---------------------------------------------------------------------------

def _model_text(ctx: int, parallel: int) -> str:
    return f'[[models]]\nname = "a"\nengine = "llamacpp"\npath = "/m.gguf"\nparallel = {parallel}\nctx_per_slot = {ctx}\n'


@settings(max_examples=300, deadline=None)
@given(ctx=st.integers(-2**40, 2**40) | st.sampled_from([2**21, 2**21 - 1, 2**31 - 1, 2**31]),
       parallel=st.integers(-2**12, 2**12) | st.sampled_from([0, 1, 1024, 1025]))
def test_a_model_is_accepted_iff_both_in_range_and_the_product_fits(ctx: int, parallel: int) -> None:
    accepted = not issues_of(_model_text(ctx, parallel))
    assert accepted == (1 <= parallel <= 1024 and 1 <= ctx and ctx * parallel < 2**31)


@settings(max_examples=300, deadline=None)
@given(value=st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from([0.0, DAY_S, math.nextafter(DAY_S, math.inf)]))
def test_a_duration_is_accepted_iff_finite_positive_and_at_most_a_day(value: float) -> None:
    accepted = not issues_of(f"[routing]\nqueue_timeout_s = {value!r}\n")
    assert accepted == (0 < value <= DAY_S)


# --- no models: valid, but `config check` warns and exits 2 ------------------------------

def viiworkctl(*args: str) -> subprocess.CompletedProcess[str]:
    # -m: the tree under test (the console script imports the venv's editable install).
    return subprocess.run([sys.executable, "-m", "viiwork.agent.cli", *args], capture_output=True, text=True,
                          timeout=30)


SHIPPED = REPO / "packaging" / "viiwork.toml"


@pytest.mark.parametrize("content", ["", "\n# nothing yet\n", '[api]\nlisten = "127.0.0.1:9086"\n', "shipped"],
                         ids=["empty", "comments", "no-models", "shipped"])
def test_config_check_warns_and_exits_2_without_models(tmp_path: Path, content: str) -> None:
    path = tmp_path / "viiwork.toml"
    path.write_text(SHIPPED.read_text() if content == "shipped" else content)
    cfg = parse_config(path.read_text())  # valid: the agent starts, and waits for a model
    assert cfg.models == []
    # --offline: the file only (its listen port may be taken on this host).
    result = viiworkctl("config", "check", "--offline", str(path))
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert result.stdout.startswith(f"{path}: ok") and "0 models" in result.stdout
    assert result.stderr == f"{path}: warning: no [[models]] configured: the agent starts but serves nothing\n"
    if content:
        return
    as_json = viiworkctl("config", "check", "--offline", "--json", str(path))
    assert as_json.returncode == 2
    body = json.loads(as_json.stdout)
    assert body["ok"] is True and body["models"] == [] and len(body["warnings"]) == 1


def test_config_check_with_a_model_exits_0_without_warning(tmp_path: Path) -> None:
    path = tmp_path / "viiwork.toml"
    path.write_text('[[models]]\nname = "a"\nengine = "llamacpp"\npath = "/m.gguf"\n')
    result = viiworkctl("config", "check", "--offline", "--json", str(path))
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["warnings"] == []


def test_the_documented_example_is_valid() -> None:
    text = DOC.read_text(encoding="utf-8")
    example = text.split("## A complete example", 1)[1].split("```toml\n", 1)[1].split("```", 1)[0]
    cfg = parse_config(example, "docs/configuration.md")
    assert [m.name for m in cfg.models] == ["llama-3.1-8b", "nomic-embed"]


def test_lower_bounds_are_known() -> None:
    """Every numeric key with a Field bound also has a lower one (counts >= 0)."""
    missing = [dotted(loc) for loc, _, field in NUMERIC_KEYS
               if _upper(field) is not None and not any(isinstance(m, (Ge, Gt)) for m in field.metadata)]
    assert not missing, f"numeric keys without a lower bound: {missing}"
