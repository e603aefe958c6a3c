"""Layers point one way, checked on the source itself (ast, not grep): kernels import nothing from
the engine, the services or the model-making package; the engine imports nothing from the
services or the model-making package (it serves HF-format folders, whoever made them); what all
services share (services/common) imports no service, and the worker and the KV transfer import
nothing of the router's; and the services reach
the KV cache only through the engine's KV port and import sinks (engine/kv_cache/transfer.py
states which thread may touch it), never through the cache tensors."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _modules(package: str) -> list[Path]:
    return sorted((REPO / package).rglob("*.py"))


def _parse(path: Path) -> ast.Module:
    """ast.parse of the file. CPython 3.11 keeps ast.parse's recursion count per interpreter, not per
    thread, and raises a spurious "AST constructor recursion depth mismatch" SystemError when
    another thread of the process (a library's, left from an earlier test) parses at the same time
    (python/cpython#106905, fixed in 3.12): that error, and only it, is parsed again."""
    for attempt in range(3):
        try:
            return ast.parse(path.read_text(), str(path))
        except SystemError as e:
            if "recursion depth mismatch" not in str(e) or attempt == 2:
                raise
    raise AssertionError("unreachable")


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(_parse(path)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


OTHER_SERVICES = (
    "services.router",
    "services.worker",
    "services.kv_transfer",
    "services.openai",
    "services.registry",
)
LAYERS = {
    "kernels": ("engine", "services", "modelkit"),
    "engine": ("services", "modelkit"),
    "services/common": OTHER_SERVICES + ("services.cli", "services.demo", "services.launcher"),
    "services/worker": ("services.router", "services.openai"),
    "services/kv_transfer": ("services.router", "services.worker", "services.openai"),
}


@pytest.mark.parametrize("package", LAYERS)
def test_imports_point_one_way(package):
    forbidden = LAYERS[package]

    def bad(name: str) -> bool:
        return any(name == f or name.startswith(f + ".") for f in forbidden)

    offenders = {
        str(path.relative_to(REPO)): sorted(filter(bad, _imports(path))) for path in _modules(package)
    }
    assert {k: v for k, v in offenders.items() if v} == {}


def test_services_never_touch_the_cache_tensors():
    touching = []
    for path in _modules("services"):
        for node in ast.walk(_parse(path)):
            if isinstance(node, ast.Attribute) and node.attr in ("kv_caches", "runner"):
                touching.append(f"{path.relative_to(REPO)}:{node.lineno} .{node.attr}")
    assert touching == []


def test_one_step_loop():
    """Every driver (the offline LLM, the worker's engine thread, the DP ranks) steps an engine
    through engine/client.py's step_outputs; the worker's `_step` is the override it hands in
    (benchmarks time single steps on purpose)."""
    steppers = []
    for package in ("engine", "services"):
        for path in _modules(package):
            tree = _parse(path)
            for func in ast.walk(tree):
                if not isinstance(func, ast.FunctionDef):
                    continue
                for node in ast.walk(func):
                    if (
                        isinstance(node, ast.Call)
                        and isinstance(node.func, ast.Attribute)
                        and node.func.attr == "step"
                        and "detok" not in ast.unparse(node.func.value)
                    ):
                        steppers.append((str(path.relative_to(REPO)), func.name))
    assert sorted(set(steppers)) == [
        ("engine/client.py", "step_outputs"),
        ("services/worker/async_engine.py", "_step"),
    ]


def _callers(matches) -> list[tuple[str, str]]:
    """(file, function) of every call in engine/ and services/ that matches(call node) accepts."""
    found = set()
    for package in ("engine", "services"):
        for path in _modules(package):
            for func in ast.walk(_parse(path)):
                if isinstance(func, ast.FunctionDef) and any(
                    isinstance(node, ast.Call) and matches(node) for node in ast.walk(func)
                ):
                    found.add((str(path.relative_to(REPO)), func.name))
    return sorted(found)


def test_blocks_are_freed_in_one_place():
    """Finish, preemption, recompute and the end of an export all free KV blocks (and state
    slots) through Scheduler.free_blocks -> KVCacheManager.free; the one other place a block goes
    back to its pool is a sliding window's table giving back what falls behind the window."""

    def frees(call: ast.Call) -> bool:
        f = call.func
        return (
            isinstance(f, ast.Attribute)
            and f.attr == "free"
            and ast.unparse(f.value).endswith(("kv", "pool", "states"))
        )

    assert _callers(frees) == [
        ("engine/kv_cache/manager.py", "free"),
        ("engine/kv_cache/single_type.py", "free"),
        ("engine/kv_cache/single_type.py", "free_behind"),
        ("engine/scheduler.py", "free_blocks"),
    ]


def test_the_scheduler_plans_kv_loads_and_never_writes_blocks():
    """Scheduler.admit plans what a connector supplies (KVLoad); decoding, checking and copying
    the blocks (KVConnector.load, through run_load) happens only on the worker side: EngineCore
    before the forward, and an import's allocation."""

    def loads(call: ast.Call) -> bool:
        f = call.func
        if isinstance(f, ast.Name):
            return f.id == "run_load"
        return (
            isinstance(f, ast.Attribute) and f.attr == "load" and ast.unparse(f.value).endswith("connector")
        )

    assert _callers(loads) == [
        ("engine/engine_core.py", "_load_kv"),
        ("engine/kv_cache/connector.py", "run_load"),
        ("engine/kv_handover.py", "allocate_import"),
    ]
