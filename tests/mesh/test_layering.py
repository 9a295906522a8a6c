"""The mesh imports neither the agent nor the engines (docs/architecture.md)."""

from __future__ import annotations

import ast
from pathlib import Path

MESH = Path(__file__).resolve().parents[2] / "mesh"


def test_mesh_imports_neither_agent_nor_engines():
    offenders = []
    for path in sorted(MESH.glob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for name in names:
                if name.startswith(("viiwork.agent", "viiwork.engines")):
                    offenders.append(f"{path.name}: {name}")
    assert offenders == []
    assert len(list(MESH.glob("*.py"))) > 10
