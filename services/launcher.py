"""Start a whole pdserve stack as processes on one machine: prefill and decode workers, a router.

Used by `pdserve serve`, the demo (`make run`), the serving benchmark and the end-to-end tests.
Every process binds to the given host only; ports are picked free up front. The internal RPCs are
never open: every process gets the same PDSERVE_INTERNAL_TOKEN (from `cfg.env`, else the
environment, else a fresh random one), which tests use as `stack.token`. `start()` returns
once every process reports readiness SERVING over grpc.health.v1; `stop()` sends SIGTERM, then
SIGKILL to whatever outlives the grace period.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

import engine
from engine import env as env_vars

logger = logging.getLogger(__name__)


PICK_FROM = 10000
"""free_port's own picks lie from here up to the kernel's ephemeral range (below: well-known and
commonly configured ports)."""


def _ephemeral_start() -> int:
    """The first port of the kernel's ephemeral range, where it takes the local ports of outgoing
    connections and of binds to port 0 (Linux: ip_local_port_range, 32768 by default)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _offered(host: str) -> Iterator[int]:
    """Ports for free_port to try: random ones below the ephemeral range (while it leaves room), then
    the system's own choices (a bind to port 0, released)."""
    end = _ephemeral_start()
    if end - PICK_FROM >= 1000:
        for _ in range(64):
            yield random.randrange(PICK_FROM, end)
    while True:
        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        yield port


def free_port(host: str = "127.0.0.1", taken: set[int] | frozenset[int] = frozenset(), count: int = 1) -> int:
    """A port free on host now and not in `taken` (ports handed out but not bound yet). With count
    > 1, the first of `count` consecutive ports all free now (a worker group binds `--port + i` for
    each rank). Picked below the kernel's ephemeral range where it can be: between this pick and its
    process's bind (a worker's start-up), the system never hands such a port to another process's
    outgoing connection or bind to port 0 -- one from the range itself was taken so once, while
    its worker started."""
    for port in _offered(host):
        if taken.intersection(range(port, port + count)):
            continue
        with contextlib.ExitStack() as held:
            try:
                for i in range(count):
                    held.enter_context(socket.socket()).bind((host, port + i))
            except (OSError, OverflowError):  # held, or past 65535
                continue
        return port
    raise AssertionError("unreachable: _offered never ends")


def _serving(stub: health_pb2_grpc.HealthStub, service: str) -> bool:
    try:
        resp = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=1.0)
    except grpc.RpcError:
        return False
    return resp.status == health_pb2.HealthCheckResponse.SERVING


PROBE_CHANNEL_OPTIONS = [
    # A starting process binds its port only after it has imported torch: with gRPC's default
    # reconnect backoff (1 s, growing 1.6x a try) a probe opened before that saw it ready seconds
    # after it was (0-11 s late per stack measured in the test suite).
    ("grpc.initial_reconnect_backoff_ms", 50),
    ("grpc.min_reconnect_backoff_ms", 50),
    ("grpc.max_reconnect_backoff_ms", 250),
    ("grpc.use_local_subchannel_pool", 1),
]


def probe_channel(endpoint: str) -> grpc.Channel:
    """A channel for polling a starting process: it retries connecting every quarter second at most."""
    return grpc.insecure_channel(endpoint, options=PROBE_CHANNEL_OPTIONS)


def wait_ready(
    endpoint: str, timeout: float, proc: subprocess.Popen | None = None, service: str = "readiness"
) -> None:
    """Block until the gRPC server at endpoint reports `service` SERVING; RuntimeError on timeout
    or when proc exits first."""
    deadline = time.monotonic() + timeout
    with probe_channel(endpoint) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while True:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"{endpoint}: process exited with {proc.returncode} before it was ready")
            if _serving(stub, service):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"{endpoint} not ready after {timeout:.0f} s")
            time.sleep(0.1)


def _ranks(worker_args: list[str]) -> int:
    """Rank processes a worker started with these flags runs: N with `--dp N` (the last one
    given, as the worker's argparse reads it), else 1."""
    ranks = 1
    for i, arg in enumerate(worker_args):
        if arg == "--dp" and i + 1 < len(worker_args):
            ranks = int(worker_args[i + 1])
        elif arg.startswith("--dp="):
            ranks = int(arg.split("=", 1)[1])
    return ranks


@dataclass
class Proc:
    name: str
    endpoint: str
    popen: subprocess.Popen
    log_path: Path | None = None
    metrics_url: str | None = None


@dataclass
class StackConfig:
    model: str
    host: str = "127.0.0.1"
    num_prefill: int = 1
    num_decode: int = 1
    num_colocated: int = 0
    grpc_port: int = 0
    """Router gRPC port (0: a free one)."""
    http_port: int | None = 0
    """Router HTTP port (0: a free one; None: no HTTP)."""
    engine_args: list[str] = field(default_factory=list)
    """Extra `pdserve worker` flags (--dtype, --num-kv-blocks, ...)."""
    worker_args: dict[str, list[str]] = field(default_factory=dict)
    """Extra flags per role."""
    router_args: list[str] = field(default_factory=list)
    registry: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment of every process. PDSERVE_INTERNAL_TOKEN here (else in the environment)
    is the stack's token; without one the stack generates one."""
    log_dir: str | None = None
    """Write each process's output to <log_dir>/<name>.log (else inherit the terminal)."""
    threads_per_worker: int | None = None
    worker_metrics: bool = False
    """Give every worker a Prometheus /metrics port (Proc.metrics_url)."""
    ready_timeout_s: float = 180.0
    progress_every_s: float = 5.0
    """While the stack starts, `start(on_wait=...)` gets a line this often naming what is not ready."""
    cwd: str | None = None
    """Where the processes start, and so where `python -m services.cli` imports the code from
    (a git worktree of another revision, for an A/B run); None: this process's directory."""
    omp_wait_policy: str = "auto"
    """The workers' OMP_WAIT_POLICY: "auto" sets PASSIVE when their threads together outnumber
    the CPUs (Stack.workers_share_cpus) and the environment names none; "inherit" leaves the
    environment's (else the engine's default: a short spin after each region, then sleep;
    engine/__init__.py); another value is set as it is."""
    api_key: str | None = field(default=None, repr=False)
    """A key the router's public API requires (passed as PDSERVE_API_KEY, out of process
    listings); None: whatever PDSERVE_API_KEY the environment holds, else an open API."""


class Stack:
    def __init__(self, cfg: StackConfig):
        self.cfg = cfg
        self.procs: list[Proc] = []
        self._ports: set[int] = set()  # every port this stack handed out
        self.grpc_port = cfg.grpc_port or self._free_port()
        self.http_port = None if cfg.http_port is None else (cfg.http_port or self._free_port())
        self.token: str = (
            cfg.env.get(env_vars.INTERNAL_TOKEN_VAR) or env_vars.internal_token() or secrets.token_urlsafe(32)
        )
        """The internal token every process of this stack requires and presents."""
        self.api_key: str | None = cfg.api_key or cfg.env.get(env_vars.API_KEY_VAR) or env_vars.api_key()
        """The key the router's public API requires (None: open); its readiness probe sends it."""

    def _free_port(self) -> int:
        """A free port no process of this stack was given (the router's is bound only once its
        process is up, so the system could offer it to a worker started before)."""
        port = free_port(self.cfg.host, self._ports)
        self._ports.add(port)
        return port

    @property
    def grpc_endpoint(self) -> str:
        return f"{self.cfg.host}:{self.grpc_port}"

    @property
    def http_url(self) -> str:
        return f"http://{self.cfg.host}:{self.http_port}"

    def workers_share_cpus(self) -> bool:
        """Whether the workers' torch threads together (every rank of a `--dp N` worker's)
        outnumber the CPUs this machine gives us. Then each worker starts with OpenMP's passive
        wait (OMP_WAIT_POLICY=PASSIVE, under cfg.omp_wait_policy "auto") unless the environment
        names a policy: OpenMP's threads otherwise spin for milliseconds after every parallel
        region, taking turns the other processes need. A prefill's many small regions left its
        second thread spinning for a quarter of the prefill worker's CPU time (perf). On the
        2-core Zen 4, bench model, 32 streams of 64 + 128 tokens, four runs interleaved against
        stacks that spin (benchmarks/served_ab.py and the script it grew from, 2026-12-03): the
        prefill worker's CPU per output token 0.73-0.83 -> 0.50-0.57 ms, the whole workload
        1.01-1.12x, decode 0.94-1.09x (the decode worker runs its own pool, not OpenMP; within the
        VM's noise). A worker with CPUs of its own (a pod) keeps OpenMP's default, under which one
        prefill alone ran 1.3-2x faster."""
        cfg = self.cfg
        threads = cfg.threads_per_worker or env_vars.num_threads() or env_vars.available_cores()
        counts = {"prefill": cfg.num_prefill, "decode": cfg.num_decode, "colocated": cfg.num_colocated}
        ranks = sum(n * _ranks(cfg.engine_args + cfg.worker_args.get(role, [])) for role, n in counts.items())
        return ranks * threads > env_vars.available_cores()

    def kv_stays_local(self, role: str) -> bool:
        """Whether no worker can ever read this worker's KV: one colocated rank alone, no registry
        for others to join through. Its workers then start no NIXL agent (`--kv-transport grpc`,
        unless the flags name a transport): an agent nobody reads holds ~27 MiB of UCX and NIXL
        libraries and wakes a progress thread every 100 us on the engine's cores."""
        cfg = self.cfg
        flags = cfg.engine_args + cfg.worker_args.get(role, [])
        return (
            role == "colocated"
            and (cfg.num_prefill, cfg.num_decode, cfg.num_colocated) == (0, 0, 1)
            and cfg.registry is None
            and _ranks(flags) == 1
            and not any(f == "--kv-transport" or f.startswith("--kv-transport=") for f in flags)
        )

    def workers(self, role: str | None = None) -> list[Proc]:
        return [p for p in self.procs if p.name != "router" and (role is None or p.name.startswith(role))]

    def _spawn(
        self, name: str, args: list[str], endpoint: str, env: dict | None = None, api_key: str | None = None
    ) -> Proc:
        log_path = None
        out = None
        if self.cfg.log_dir:
            Path(self.cfg.log_dir).mkdir(parents=True, exist_ok=True)
            log_path = Path(self.cfg.log_dir) / f"{name}.log"
            out = open(log_path, "ab")  # noqa: SIM115 - owned by the child
        cmd = [sys.executable, "-m", "services.cli", "--log-level", env_vars.log_level(), *args]
        env = {**(env or os.environ), **self.stack_environ(api_key)}
        popen = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT if out else None, env=env, cwd=self.cfg.cwd
        )
        proc = Proc(name, endpoint, popen, log_path)
        self.procs.append(proc)
        return proc

    def start_worker(self, role: str, index: int, port: int | None = None) -> Proc:
        cfg = self.cfg
        port = port or self._free_port()
        args = [
            "worker",
            "--role",
            role,
            "--model",
            cfg.model,
            "--host",
            cfg.host,
            "--port",
            str(port),
            "--dp-rank",
            str(index),
        ]
        if cfg.registry:
            args += ["--registry", cfg.registry]
        env = {k: v for k, v in os.environ.items() if engine.DEFAULTED_ENV.get(k) != v}  # theirs to set
        if cfg.threads_per_worker:
            args += ["--num-threads", str(cfg.threads_per_worker)]
            env["OMP_NUM_THREADS"] = str(cfg.threads_per_worker)
        if cfg.omp_wait_policy == "auto":
            if self.workers_share_cpus():
                env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        elif cfg.omp_wait_policy != "inherit":
            env["OMP_WAIT_POLICY"] = cfg.omp_wait_policy
        metrics_url = None
        if cfg.worker_metrics:
            metrics_port = self._free_port()
            args += ["--metrics-port", str(metrics_port)]
            metrics_url = f"http://{cfg.host}:{metrics_port}/metrics"
        if self.kv_stays_local(role):
            args += ["--kv-transport", "grpc"]
        args += cfg.engine_args + cfg.worker_args.get(role, [])
        proc = self._spawn(f"{role}-{index}", args, f"{cfg.host}:{port}", env)
        proc.metrics_url = metrics_url
        return proc

    def start(self, on_wait: Callable[[str], None] | None = None, router: bool = True) -> Stack:
        """Start the workers and the router (router=False: the workers alone, for callers that call
        them directly); return once every process is ready and the router routes to every worker.
        While it waits, `on_wait` gets a line every few seconds naming what is still starting (a
        cold start says what it is doing)."""
        cfg = self.cfg
        try:
            for role, count in (
                ("prefill", cfg.num_prefill),
                ("decode", cfg.num_decode),
                ("colocated", cfg.num_colocated),
            ):
                for i in range(count):
                    self.start_worker(role, i)
            if router:
                self.start_router()
            deadline = time.monotonic() + cfg.ready_timeout_s
            self.wait_all_ready(deadline, on_wait, cfg.progress_every_s)
            if router:
                self.wait_routable(deadline)
        except BaseException:
            self.stop()
            raise
        return self

    def wait_all_ready(
        self, deadline: float, on_wait: Callable[[str], None] | None = None, every_s: float = 5.0
    ) -> None:
        """Until every process reports readiness SERVING; RuntimeError when one exits first or at
        the deadline. Every `every_s` seconds, `on_wait` gets a line naming those not ready yet."""
        start = last = time.monotonic()
        channels = {p.name: probe_channel(p.endpoint) for p in self.procs}
        try:
            pending = list(self.procs)
            while pending:
                for proc in list(pending):
                    if proc.popen.poll() is not None:
                        raise RuntimeError(
                            f"{proc.name} ({proc.endpoint}) exited with {proc.popen.returncode} before it was ready"
                        )
                    if _serving(health_pb2_grpc.HealthStub(channels[proc.name]), "readiness"):
                        pending.remove(proc)
                now = time.monotonic()
                if pending and now > deadline:
                    raise RuntimeError(
                        f"not ready after {now - start:.0f} s: {', '.join(p.name for p in pending)}"
                    )
                if pending and on_wait is not None and now - last >= every_s:
                    last = now
                    on_wait(f"  ... {now - start:.0f} s: waiting for {', '.join(p.name for p in pending)}")
                if pending:
                    time.sleep(0.1)
        finally:
            for ch in channels.values():
                ch.close()

    def router_command(self, workers: list[str] | None = None) -> list[str]:
        """The `pdserve router` command line (after `pdserve`) over the registry, else over
        `workers` (default: the workers started so far)."""
        cfg = self.cfg
        args = ["router", "--model", cfg.model, "--host", cfg.host, "--grpc-port", str(self.grpc_port)]
        args += ["--http-port", str(self.http_port)] if self.http_port is not None else ["--no-http"]
        if cfg.registry:
            args += ["--registry", cfg.registry]
        else:
            endpoints = [p.endpoint for p in self.workers()] if workers is None else workers
            args += ["--workers", ",".join(endpoints)]
        return args + cfg.router_args

    def start_router(self, workers: list[str] | None = None) -> Proc:
        """Start the router (router_command) as a process of its own; it may start before the
        workers do (its readiness waits for them)."""
        return self._spawn("router", self.router_command(workers), self.grpc_endpoint, api_key=self.api_key)

    def stack_environ(self, api_key: str | None = None) -> dict[str, str]:
        """What a process of this stack finds in its environment over the inherited one: the
        config's extra variables, the stack's internal token and (a router's) API key."""
        env = {**self.cfg.env, env_vars.INTERNAL_TOKEN_VAR: self.token}
        if api_key is not None:
            env[env_vars.API_KEY_VAR] = api_key
        return env

    def wait_routable(self, deadline: float) -> None:
        """Until the router reports readiness and has probed every worker (so routing sees all of
        them)."""
        from pdserve.v1 import inference_pb2 as pb
        from pdserve.v1 import inference_pb2_grpc as pb_grpc

        want = {p.endpoint for p in self.workers() if p.popen.poll() is None}
        key = [("authorization", f"Bearer {self.api_key}")] if self.api_key else None
        with probe_channel(self.grpc_endpoint) as ch:
            while not _serving(health_pb2_grpc.HealthStub(ch), "readiness"):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the router ({self.grpc_endpoint}) not ready by the deadline")
                time.sleep(0.1)
            stub = pb_grpc.InferenceStub(ch)
            while True:
                info = stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=5.0, metadata=key)
                if want <= {w.endpoint for w in info.workers if w.healthy}:
                    return
                if time.monotonic() > deadline:
                    raise RuntimeError(f"router sees {list(info.workers)}, expected {sorted(want)}")
                time.sleep(0.1)

    def kill(self, proc: Proc, sig: int = signal.SIGKILL) -> None:
        if proc.popen.poll() is None:
            proc.popen.send_signal(sig)
        if sig == signal.SIGKILL:
            proc.popen.wait()

    def stop(self, grace_s: float = 10.0) -> dict[str, int]:
        """SIGTERM everything (router first), wait, SIGKILL stragglers; returns exit codes."""
        for proc in reversed(self.procs):
            if proc.popen.poll() is None:
                proc.popen.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        codes = {}
        for proc in reversed(self.procs):
            try:
                codes[proc.name] = proc.popen.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                proc.popen.kill()
                codes[proc.name] = proc.popen.wait()
        return codes

    def __enter__(self) -> Stack:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
