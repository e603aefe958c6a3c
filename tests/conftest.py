"""Shared fixtures. The Triton interpreter must be switched on before any kernel is defined."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
# Where the CPU has the AMX tile unit, the engines' decode attention stays on it, as the tests'
# `amx` products expect, instead of the faster path each engine would time at load (the default:
# tests/test_decode_attention_choice.py). Worker processes inherit it.
os.environ.setdefault("PDSERVE_NATIVE_AMX_ATTENTION", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

# Two cores on CI: more threads than cores makes torch dramatically slower.
torch.set_num_threads(min(2, os.cpu_count() or 1))


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
