"""The shape of the source tree: dependency direction, packaging completeness, import names.

docs/architecture.md: ``agent`` may import ``mesh`` and ``engines``; ``mesh`` and ``engines`` import
neither ``agent`` nor each other. pyproject.toml lists every import package explicitly, so a
sub-package missing from that list would be missing from the installed wheel and the .deb
while every test of the editable tree still passed: this file catches both.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

# Top-level folder -> import name (pyproject's package-dir).
PACKAGE_ROOTS = {
    "viiwork": "viiwork",
    "agent": "viiwork.agent",
    "mesh": "viiwork.mesh",
    "engines": "viiwork.engines",
}

# Who may not import whom (docs/architecture.md).
FORBIDDEN = {
    "mesh": ("viiwork.agent", "viiwork.engines"),
    "engines": ("viiwork.agent", "viiwork.mesh"),
}


def _py_files(folder: str) -> list[Path]:
    return sorted(p for p in (REPO / folder).rglob("*.py") if "__pycache__" not in p.parts)


def _module_name(path: Path) -> str:
    rel = path.relative_to(REPO)
    parts = [PACKAGE_ROOTS[rel.parts[0]], *rel.parts[1:]]
    parts[-1] = parts[-1][: -len(".py")]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path) -> list[tuple[int, str]]:
    return _imports_in(path.read_text(encoding="utf-8"), _module_name(path), path.name == "__init__.py")


def _imports_in(source: str, module: str, is_package: bool) -> list[tuple[int, str]]:
    """Absolute module names that ``source`` (module ``module``) imports, with their lines.

    Relative imports are resolved; ``importlib.import_module("x")`` and ``__import__("x")``
    with a constant name count too.
    """
    tree = ast.parse(source)
    package = module if is_package else module.rpartition(".")[0]
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.append((node.lineno, target))
            # `from viiwork import agent` imports viiwork.agent.
            found.extend((node.lineno, f"{target}.{alias.name}") for alias in node.names)
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                found.append((node.lineno, node.args[0].value))
    return found


def _hits(imported: str, prefix: str) -> bool:
    return imported == prefix or imported.startswith(prefix + ".")


@pytest.mark.parametrize("folder", sorted(FORBIDDEN))
def test_dependency_direction(folder: str) -> None:
    files = _py_files(folder)
    assert files, f"{folder}/ has no Python files: is the repository root right?"
    bad = [
        f"{path.relative_to(REPO)}:{line} imports {name}"
        for path in files
        for line, name in _imports(path)
        if any(_hits(name, prefix) for prefix in FORBIDDEN[folder])
    ]
    assert not bad, f"{folder}/ must import neither {' nor '.join(FORBIDDEN[folder])} (docs/architecture.md):\n" + "\n".join(bad)


@pytest.mark.parametrize("folder", sorted(PACKAGE_ROOTS))
def test_no_bare_top_level_imports(folder: str) -> None:
    """The folders are installed as viiwork.*: `import agent` only works from a checkout."""
    bad = [
        f"{path.relative_to(REPO)}:{line} imports {name} (use viiwork.{name})"
        for path in _py_files(folder)
        for line, name in _imports(path)
        if any(_hits(name, bare) for bare in ("agent", "mesh", "engines"))
    ]
    assert not bad, "\n".join(bad)


def test_the_scanner_sees_relative_and_dynamic_imports() -> None:
    """The direction test is only as good as _imports_in: check it on known text."""
    source = (
        "from ..agent import config\n"
        "from .. import mesh\n"
        "from viiwork import agent\n"
        "import importlib\n"
        "importlib.import_module('viiwork.agent.serving.api')\n"
        "import viiwork.mesh.gossip as g\n"
    )
    names = [name for _, name in _imports_in(source, "viiwork.engines.probe", is_package=False)]
    assert "viiwork.agent" in names
    assert "viiwork.mesh" in names
    assert "viiwork.agent.serving.api" in names
    assert "viiwork.mesh.gossip" in names
    forbidden = [n for n in names if any(_hits(n, p) for p in FORBIDDEN["engines"])]
    assert len(forbidden) == 6, forbidden


def _pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))


def test_package_dir_maps_the_top_level_folders() -> None:
    package_dir = _pyproject()["tool"]["setuptools"]["package-dir"]
    assert package_dir == {name: folder for folder, name in PACKAGE_ROOTS.items()}


def _source_packages() -> dict[str, Path]:
    found = {}
    for folder in PACKAGE_ROOTS:
        for init in (REPO / folder).rglob("__init__.py"):
            if "__pycache__" not in init.parts:
                found[_module_name(init)] = init.parent
    return found


def test_every_package_is_listed_in_pyproject() -> None:
    listed = set(_pyproject()["tool"]["setuptools"]["packages"])
    on_disk = _source_packages()
    missing = sorted(set(on_disk) - listed)
    assert not missing, (
        "pyproject.toml [tool.setuptools] packages lacks (the wheel and the .deb would miss "
        "them): " + ", ".join(f'"{m}"' for m in missing)
    )
    stale = sorted(listed - set(on_disk))
    assert not stale, "pyproject.toml lists packages with no folder/__init__.py: " + ", ".join(stale)


def test_no_python_folder_lacks_an_init() -> None:
    """A folder of .py files without __init__.py is a namespace package setuptools skips."""
    bad = sorted(
        str(py.parent.relative_to(REPO))
        for folder in PACKAGE_ROOTS
        for py in _py_files(folder)
        if not (py.parent / "__init__.py").exists()
    )
    assert not bad, "folders with Python files but no __init__.py: " + ", ".join(sorted(set(bad)))


def test_data_files_in_packages_are_declared() -> None:
    """Non-Python files inside the packages ship only when package-data names them."""
    package_data = _pyproject()["tool"]["setuptools"].get("package-data", {})
    undeclared = []
    for name, folder in _source_packages().items():
        globs = package_data.get(name, []) + package_data.get("*", [])
        for f in folder.iterdir():
            if f.is_file() and f.suffix not in (".py", ".pyc") and not any(f.match(g) for g in globs):
                undeclared.append(str(f.relative_to(REPO)))
    assert not undeclared, (
        "add these to [tool.setuptools.package-data] in pyproject.toml: " + ", ".join(sorted(undeclared))
    )


@pytest.mark.parametrize("bare", ["agent", "mesh", "engines"])
def test_bare_top_level_folders_are_not_importable(bare: str) -> None:
    """Under a bare name the engine registry would load twice and see each engine twice."""
    spec = importlib.util.find_spec(bare)
    if spec is not None and spec.origin and Path(spec.origin).resolve().is_relative_to(REPO):
        pytest.fail(f"`import {bare}` finds the repository's {bare}/ ({spec.origin}): tests must see only viiwork.*")
    if spec is None:
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(bare)


def test_engine_registry_is_loaded_once() -> None:
    importlib.import_module("viiwork.agent.config.schema")  # imports the registry itself
    registry = importlib.import_module("viiwork.engines.registry")
    source = (REPO / "engines" / "registry.py").resolve()
    assert Path(registry.__file__).resolve() == source, "tests must import this working tree's viiwork"
    holders = sorted(
        name for name, mod in list(sys.modules.items())
        if getattr(mod, "__file__", None) and Path(mod.__file__).resolve() == source
    )
    assert holders == ["viiwork.engines.registry"]


def test_every_repo_module_has_one_name() -> None:
    """No source file of the packages is loaded under two module names."""
    roots = [(REPO / folder).resolve() for folder in PACKAGE_ROOTS]
    by_file: dict[Path, list[str]] = {}
    for name, mod in list(sys.modules.items()):
        file = getattr(mod, "__file__", None)
        if not file:
            continue
        path = Path(file).resolve()
        if any(path.is_relative_to(root) for root in roots):
            by_file.setdefault(path, []).append(name)
    assert by_file, "no viiwork module loaded: the check would prove nothing"
    doubles = {str(p.relative_to(REPO)): names for p, names in by_file.items() if len(names) > 1}
    assert not doubles
    assert all(name.startswith("viiwork") for names in by_file.values() for name in names)


#: "About 400 lines" (issue 15): a module longer than this says at its top why it stays one.
LONG_MODULE_LINES = 420


def test_long_modules_say_why_they_stay_one() -> None:
    """docs/architecture.md: a module over about 400 lines gives the reason in its docstring
    ("One module ... because ..."), so a long file is a decision, not an accident."""
    unexplained = []
    for folder in ("agent", "mesh", "engines", "viiwork"):
        for path in _py_files(folder):
            text = path.read_text()
            if text.count("\n") <= LONG_MODULE_LINES:
                continue
            doc = ast.get_docstring(ast.parse(text)) or ""
            if "one module" not in doc.lower():
                unexplained.append(f"{path.relative_to(REPO)} ({text.count(chr(10))} lines)")
    assert not unexplained, "modules over ~400 lines without a reason at the top: " + ", ".join(unexplained)
