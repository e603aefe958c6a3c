"""Shared fixtures. The Triton interpreter must be switched on before any kernel is defined."""

from __future__ import annotations

import gc
import logging
import os

os.environ.setdefault("TRITON_INTERPRET", "1")
# Where the CPU has the AMX tile unit, the engines' decode attention stays on it, as the tests'
# `amx` products expect, instead of the faster path each engine would time at load (the default:
# tests/test_decode_attention_choice.py). Worker processes inherit it.
os.environ.setdefault("PDSERVE_NATIVE_AMX_ATTENTION", "1")
# Two test workers, each with torch's two OpenMP threads, and the stacks' processes share two cores:
# threads spinning after a parallel region kept the cores from the threads they waited for (an
# equivalence file took 11.5 s in one run and 88 s in the next; 12-13 s with PASSIVE). So, as the
# launcher does for workers sharing their cores, the suite's threads sleep while they wait
# (libgomp reads this when torch loads it, just below). Processes the tests start inherit it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402

# Two cores on CI: more threads than cores makes torch dramatically slower.
torch.set_num_threads(min(2, os.cpu_count() or 1))


# The longest files (about a minute each on two cores) first: `make test` hands files to its
# workers in collection order (pytest-xdist, --dist loadfile), so the last ones handed out are
# short and the two workers finish together.
LONG_FILES = (
    "test_soak.py",
    "test_reliability.py",
    "test_served_vs_offline_bench.py",
    "test_expert_parallel.py",
    "test_native_install.py",
    "test_products_ab_bench.py",
    "test_kv_transfer_bench.py",
    "test_fairness.py",
    "test_v32_serving.py",
    "test_parity_v4.py",
    "test_engine_triton.py",
    "test_v4_serving.py",
)


def pytest_collection_modifyitems(session, config, items) -> None:
    rank = {name: i for i, name in enumerate(LONG_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order


class _DroppedErrors(logging.Handler):
    """asyncio's report of a future or task dropped with an exception nobody retrieved. Besides
    hiding an error, the report formats its traceback when the future is collected, which can be
    inside another test's `ast.parse` (Triton's interpreter parses every kernel): CPython 3.11's
    parser then fails with "AST constructor recursion depth mismatch"."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if "never retrieved" in record.getMessage():
            self.messages.append(self.format(record))


@pytest.fixture(scope="session", autouse=True)
def no_dropped_async_errors():
    """Fails the session (at the teardown of its last test) if any test dropped an asyncio future
    or task holding an exception: whoever awaits one takes its result or its exception."""
    dropped = _DroppedErrors()
    logging.getLogger("asyncio").addHandler(dropped)
    yield
    gc.collect()  # the futures held in reference cycles
    logging.getLogger("asyncio").removeHandler(dropped)
    assert not dropped.messages, "\n\n".join(dropped.messages)


def pytest_sessionstart(session) -> None:
    """Load the native CPU kernels (kernels/native) once, here, before any test starts engines in
    several processes at once: in a checkout edited since its install (no `make native`), the one
    this CPU runs is compiled here, before the processes that would wait on its lock."""
    from engine.platform import use_native_kernels

    use_native_kernels(torch.bfloat16, torch.device("cpu"))


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    """The project's default model, built once per test session."""
    from modelkit.make_model import make_model

    return str(make_model("tiny", tmp_path_factory.mktemp("models") / "pdserve-tiny"))


@pytest.fixture(scope="session")
def serving_stack(tiny_model, tmp_path_factory):
    """One disaggregated stack (router, a prefill and a decode worker as processes) shared by the
    service tests that leave it as they found it. Disaggregation is never skipped for short prompts."""
    from tests.service_testing import start_stack

    st = start_stack(tiny_model, tmp_path_factory.mktemp("stack"), router_args=["--colocate-max-tokens", "0"])
    yield st
    codes = st.stop()
    assert codes == {name: 0 for name in codes}, f"unclean exits: {codes}"
