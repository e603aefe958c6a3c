"""The environment the stack launcher gives its workers: OpenMP's passive wait when the workers'
threads together outnumber the CPUs, its default otherwise, and a policy the user names
always wins. Read from the started worker process itself (/proc/<pid>/environ)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from services import launcher
from services.launcher import Stack, StackConfig


def _started_worker(cfg: StackConfig, role: str, what: str) -> tuple[Stack, bytes]:
    """/proc/<pid>/<what> (environ, cmdline) of a worker this config's stack starts (stopped
    right after). Popen may return while the kernel is still building the new image: the file
    reads empty until exec has set it up, so read until it is there."""
    stack = Stack(cfg)
    try:
        proc = stack.start_worker(role, 0)
        deadline = time.monotonic() + 10
        # (a command line reads as the parent's until exec: wait for the worker's own)
        there = (lambda raw: b"services.cli" in raw) if what == "cmdline" else bool
        while not there(raw := Path(f"/proc/{proc.popen.pid}/{what}").read_bytes()):
            assert proc.popen.poll() is None, (
                f"the worker exited ({proc.popen.returncode}) before it was read"
            )
            assert time.monotonic() < deadline, f"the worker's {what} stayed empty"
            time.sleep(0.001)
    finally:
        stack.stop()
    return stack, raw


def _worker_environ(cfg: StackConfig) -> dict[str, str]:
    """The environment of a decode worker this config's stack starts."""
    stack, raw = _started_worker(cfg, "decode", "environ")
    environ = dict(item.split("=", 1) for item in raw.decode().split("\0") if "=" in item)
    assert environ.get(launcher.env_vars.INTERNAL_TOKEN_VAR) == stack.token  # the worker's own
    return environ


@pytest.mark.parametrize(
    "cores, threads, colocated, policy",
    [
        (2, 2, 0, "PASSIVE"),  # a prefill and a decode worker of two threads each on two CPUs
        (2, 1, 0, None),  # one thread each: the CPUs suffice
        (4, 2, 0, None),
        (4, 2, 1, "PASSIVE"),  # a third worker tips it
    ],
)
def test_workers_wait_passively_only_when_they_share_the_cpus(
    tiny_model, monkeypatch, cores, threads, colocated, policy
):
    monkeypatch.setattr(launcher.env_vars, "available_cores", lambda: cores)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    cfg = StackConfig(tiny_model, threads_per_worker=threads, num_colocated=colocated)
    assert Stack(cfg).workers_share_cpus() is (policy is not None)
    environ = _worker_environ(cfg)
    assert environ.get("OMP_WAIT_POLICY") == policy
    assert environ["OMP_NUM_THREADS"] == str(threads)


def test_engines_own_defaults_stay_out_of_a_workers_environment(tiny_model, monkeypatch):
    """What importing engine set for this process (GOMP_SPINCOUNT: a short OpenMP spin) is not
    handed on: an inherited GOMP_SPINCOUNT would override the PASSIVE wait a worker on shared CPUs
    gets. One the user set is handed on."""
    import engine

    monkeypatch.setattr(launcher.env_vars, "available_cores", lambda: 1)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.setitem(engine.DEFAULTED_ENV, "GOMP_SPINCOUNT", "30000")
    monkeypatch.setenv("GOMP_SPINCOUNT", "30000")
    environ = _worker_environ(StackConfig(tiny_model, threads_per_worker=2))
    assert environ["OMP_WAIT_POLICY"] == "PASSIVE" and "GOMP_SPINCOUNT" not in environ
    monkeypatch.setenv("GOMP_SPINCOUNT", "777")  # the user's own
    assert _worker_environ(StackConfig(tiny_model, threads_per_worker=2))["GOMP_SPINCOUNT"] == "777"


def test_a_policy_the_user_names_is_kept(tiny_model, monkeypatch):
    monkeypatch.setattr(launcher.env_vars, "available_cores", lambda: 1)
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert _worker_environ(StackConfig(tiny_model, threads_per_worker=2))["OMP_WAIT_POLICY"] == "ACTIVE"
    monkeypatch.delenv("OMP_WAIT_POLICY")
    cfg = StackConfig(tiny_model, threads_per_worker=2, env={"OMP_WAIT_POLICY": "ACTIVE"})
    assert _worker_environ(cfg)["OMP_WAIT_POLICY"] == "ACTIVE"


@pytest.mark.parametrize("setting, policy", [("inherit", None), ("ACTIVE", "ACTIVE")])
def test_the_stacks_own_setting(tiny_model, monkeypatch, setting, policy):
    """omp_wait_policy "inherit" leaves OpenMP's default even on shared CPUs; a named one is set."""
    monkeypatch.setattr(launcher.env_vars, "available_cores", lambda: 1)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    cfg = StackConfig(tiny_model, threads_per_worker=2, omp_wait_policy=setting)
    assert _worker_environ(cfg).get("OMP_WAIT_POLICY") == policy


@pytest.mark.parametrize(
    "engine_args, worker_args, shared",
    [
        ([], {}, False),  # a prefill and a decode worker, a thread each, on 4 CPUs
        (["--dp", "2"], {}, False),  # two ranks each: 4 threads
        (["--dp=3"], {}, True),
        ([], {"decode": ["--dp", "4"]}, True),  # 1 + 4 ranks
        ([], {"prefill": ["--dp", "2"]}, False),
    ],
)
def test_a_worker_counts_its_ranks(monkeypatch, engine_args, worker_args, shared):
    """A worker started with --dp N runs N rank processes, each with the worker's threads."""
    monkeypatch.setattr(launcher.env_vars, "available_cores", lambda: 4)
    cfg = StackConfig("m", threads_per_worker=1, engine_args=engine_args, worker_args=worker_args)
    assert Stack(cfg).workers_share_cpus() is shared


def _worker_cmdline(cfg: StackConfig, role: str) -> list[str]:
    """The command line of a worker this config's stack starts."""
    return _started_worker(cfg, role, "cmdline")[1].decode().split("\0")


@pytest.mark.parametrize(
    "fields, role, local",
    [
        ({"num_prefill": 0, "num_decode": 0, "num_colocated": 1}, "colocated", True),
        ({"num_prefill": 0, "num_decode": 0, "num_colocated": 2}, "colocated", False),  # they may swap KV
        (
            {"num_prefill": 0, "num_decode": 1, "num_colocated": 1},
            "colocated",
            False,
        ),  # a decode worker reads it
        ({}, "prefill", False),
        (
            {"num_prefill": 0, "num_decode": 0, "num_colocated": 1, "registry": "redis://127.0.0.1:1/0"},
            "colocated",
            False,
        ),
        (
            {"num_prefill": 0, "num_decode": 0, "num_colocated": 1, "engine_args": ["--dp", "2"]},
            "colocated",
            False,
        ),
    ],
)
def test_a_worker_whose_kv_nobody_can_read_starts_no_nixl_agent(fields, role, local):
    assert Stack(StackConfig("m", **fields)).kv_stays_local(role) is local


def test_a_lone_colocated_worker_is_started_without_nixl_unless_the_flags_name_a_transport(tiny_model):
    lone = {"num_prefill": 0, "num_decode": 0, "num_colocated": 1}
    args = _worker_cmdline(StackConfig(tiny_model, **lone), "colocated")
    assert args[args.index("--kv-transport") + 1] == "grpc"
    named = StackConfig(tiny_model, **lone, worker_args={"colocated": ["--kv-transport", "nixl"]})
    args = _worker_cmdline(named, "colocated")
    assert args.count("--kv-transport") == 1 and args[args.index("--kv-transport") + 1] == "nixl"
    args = _worker_cmdline(StackConfig(tiny_model), "decode")  # the disaggregated stack's
    assert "--kv-transport" not in args
