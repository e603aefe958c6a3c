"""Layers point one way, checked on the source itself (ast, not grep): kernels import nothing from
the engine or the services; the engine imports nothing from the services; and the services reach
the KV cache only through the engine's KV port and import sinks (engine/kv_cache/transfer.py
states which thread may touch it), never through the cache tensors."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _modules(package: str) -> list[Path]:
    return sorted((REPO / package).rglob("*.py"))


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


@pytest.mark.parametrize(
    "package, forbidden",
    [("kernels", ("engine", "services")), ("engine", ("services",))],
)
def test_imports_point_one_way(package, forbidden):
    offenders = {
        str(path.relative_to(REPO)): sorted(n for n in _imports(path) if n.split(".")[0] in forbidden)
        for path in _modules(package)
    }
    assert {k: v for k, v in offenders.items() if v} == {}


def test_services_never_touch_the_cache_tensors():
    touching = []
    for path in _modules("services"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Attribute) and node.attr in ("kv_caches", "runner"):
                touching.append(f"{path.relative_to(REPO)}:{node.lineno} .{node.attr}")
    assert touching == []
