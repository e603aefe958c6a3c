"""A worker process: one engine (in its own thread) behind the Worker and KvTransfer services.

Start-up order: bind and serve health at once (readiness NOT_SERVING), load the model in the
engine thread, then turn readiness to SERVING and register. SIGTERM/SIGINT or a `Drain` call:
readiness goes NOT_SERVING, the worker deregisters, in-flight streams get a grace period, pinned
transfers are aborted, the process exits 0.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from aiohttp import web

from engine.config import EngineConfig
from engine.engine_core import EngineCore
from engine.gc_heap import freeze_startup_heap
from engine.kv_cache import nixl
from engine.kv_cache.export import ExportTable
from engine.kv_cache.transfer import KVPort
from engine.parallel.groups import GroupConfig, ParallelGroup
from pdserve.v1 import kv_transfer_pb2_grpc as kv_grpc
from pdserve.v1 import worker_pb2_grpc as wgrpc
from services.common.grpc_utils import add_health_and_reflection, bind, new_server, set_health
from services.common.metrics import Metrics
from services.common.security import Security
from services.common.threads import IO_THREADS, named_pool
from services.kv_transfer.producer import KvTransferService
from services.registry import Heartbeat, WorkerRecord, make_registry
from services.worker.async_engine import AsyncEngine
from services.worker.identity import new_identity
from services.worker.service import WorkerService
from services.worker.settings import WorkerSettings

logger = logging.getLogger(__name__)

LEASE_SWEEP_S = 0.25


@dataclass(frozen=True)
class WorkerServerConfig:
    engine: EngineConfig
    settings: WorkerSettings
    host: str = "127.0.0.1"
    """Address to bind (and advertise); only this one is bound."""
    port: int = 0
    """gRPC port; 0 picks a free one."""
    metrics_port: int | None = None
    """Prometheus /metrics over HTTP on host:metrics_port; None: off."""
    registry: str | None = None
    """redis://host:port/db to register in; None: the router is told the endpoints statically."""
    heartbeat_ttl_s: float = 10.0
    grace_s: float = 30.0
    """How long in-flight requests may run after SIGTERM."""
    security: Security = Security()
    """Internal token / mutual TLS required of callers and presented to peers."""
    stall_timeout_s: float = 60.0
    """Liveness fails (and the process exits non-zero) when work is pending and the engine has not
    finished a step for this long."""
    fault: str | None = None
    """Fault injection for the reliability tests (PDSERVE_FAULT)."""
    kv_read_gate: str | None = None
    """A file that, while it exists, holds every NIXL read after its first block (the
    reliability tests' PDSERVE_KV_READ_GATE; engine/kv_cache/nixl.py)."""
    group: GroupConfig | None = None
    """This rank's place in its DP/EP group (expert parallelism); None: a lone engine."""


async def _metrics_http(metrics: Metrics, host: str, port: int) -> web.AppRunner:
    async def handle(_request):
        return web.Response(body=metrics.exposition(), content_type="text/plain")

    app = web.Application()
    app.router.add_get("/metrics", handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner


def start_nixl(
    mode: str, name: str, port: KVPort, read_gate: str | None = None, serves_reads: bool = True
) -> nixl.NixlAgent | None:
    """The worker's NIXL agent for --kv-transport mode: None for grpc, and for auto when NIXL is
    not installed or its agent cannot start (said once, here); nixl without it is an error.
    serves_reads: other workers READ this one's KV (it exports: prefill, colocated), so its
    progress thread runs every PROGRESS_DELAY_US; a decode worker only reads, and its thread
    runs every READER_PROGRESS_DELAY_US."""
    if mode == "grpc":
        logger.info("KV transport: gRPC only (--kv-transport grpc)")
        return None
    if not nixl.available():
        if mode == "nixl":
            raise RuntimeError("--kv-transport nixl, but NIXL is not installed: pip install 'pdserve[nixl]'")
        logger.warning("KV transport: gRPC only (NIXL is not installed; pip install 'pdserve[nixl]')")
        return None
    try:
        delay_us = nixl.PROGRESS_DELAY_US if serves_reads else nixl.READER_PROGRESS_DELAY_US
        return nixl.NixlAgent(name, port, delay_us, read_gate=Path(read_gate) if read_gate else None)
    except Exception as e:
        if mode == "nixl":
            raise
        logger.warning("KV transport: gRPC only (the NIXL agent did not start: %s)", e)
        return None


async def serve(cfg: WorkerServerConfig, on_bound=None) -> int:
    settings = cfg.settings
    metrics = Metrics(settings.role)
    metrics.watch_gc()
    server = new_server(cfg.security)
    port = bind(server, cfg.host, cfg.port, cfg.security)
    endpoint = f"{cfg.host}:{port}"
    identity = new_identity(endpoint, settings.dp_rank)

    loop = asyncio.get_running_loop()
    loop.set_default_executor(named_pool(IO_THREADS, "io"))  # asyncio.to_thread: KV chunk I/O

    def free_ended_exports() -> (
        None
    ):  # any thread: an export ended; its blocks are freed on the engine thread
        loop.call_soon_threadsafe(
            lambda: service.background(engine.call(lambda core: core.handover.free_ended_exports()))
        )

    exports = ExportTable(
        default_lease_s=settings.lease_s,
        max_total_lease_s=settings.max_total_lease_s,
        on_end=free_ended_exports,
    )

    def build_engine() -> EngineCore:
        group = ParallelGroup(cfg.group, torch.device(cfg.engine.device)) if cfg.group is not None else None
        return EngineCore(cfg.engine, group=group, exports=exports)

    engine = AsyncEngine(build_engine, fault=cfg.fault)
    stop = asyncio.Event()  # SIGTERM, SIGINT or Drain: the graceful stop below
    service = WorkerService(settings, engine, exports, identity, metrics, cfg.security, on_drain=stop.set)
    kv_service = KvTransferService(exports, identity, metrics)
    wgrpc.add_WorkerServicer_to_server(service, server)
    kv_grpc.add_KvTransferServicer_to_server(kv_service, server)
    health = add_health_and_reflection(server, ["pdserve.v1.Worker", "pdserve.v1.KvTransfer"])
    await set_health(health, live=True, ready=False)
    await server.start()
    try:  # with the gRPC port, before loading: a port picked for it is taken the sooner
        metrics_runner = (
            await _metrics_http(metrics, cfg.host, cfg.metrics_port) if cfg.metrics_port is not None else None
        )
    except OSError as e:
        logger.error("cannot serve metrics on %s:%s: %s", cfg.host, cfg.metrics_port, e)
        await server.stop(0)
        return 1
    if on_bound is not None:
        on_bound(port)
    logger.info("%s worker listening on %s (loading %s)", settings.role, endpoint, cfg.engine.model)

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    engine.start()
    try:
        core = await engine.wait_ready()
    except Exception:
        await set_health(health, live=False, ready=False)
        await server.stop(0)
        if metrics_runner is not None:
            await metrics_runner.cleanup()
        return 1
    try:  # on the loop, before it serves again: GetEngineInfo never answers without the agent
        agent = start_nixl(
            settings.kv_transport,
            f"pdserve-{identity.engine_id}",
            core.kv_port,
            cfg.kv_read_gate,
            serves_reads=settings.role != "decode",
        )
    except Exception:
        logger.exception("the NIXL agent did not start")
        await set_health(health, live=False, ready=False)
        await server.stop(0)
        engine.stop()
        if metrics_runner is not None:
            await metrics_runner.cleanup()
        return 1
    service.engine_ready(core.kv_spec, core.kv_port, agent)
    kv_service.engine_ready(core.kv_port, nixl=agent is not None)
    metrics.gauge(
        "pdserve_num_requests_running", "Requests in the running batch", lambda: core.stats.num_running
    )
    metrics.gauge("pdserve_num_requests_waiting", "Requests waiting", lambda: core.stats.num_waiting)
    metrics.gauge("pdserve_kv_cache_usage", "Fraction of KV blocks in use", lambda: core.stats.kv.usage)
    metrics.gauge(
        "pdserve_prefix_cache_hit_rate",
        "Prompt tokens found in the prefix cache / looked up",
        lambda: core.stats.kv.prefix_hit_rate,
    )
    metrics.gauge("pdserve_kv_transfers_pinned", "Transfers pinned on this worker", lambda: len(exports))
    metrics.gauge(
        "pdserve_decode_subscriptions",
        "Open Subscribe streams (a router keeps one per decode worker)",
        lambda: len(service.subscriptions.all()),
    )
    if core.connector is not None:
        for gauge in core.connector.gauges():
            metrics.gauge(gauge.name, gauge.help, gauge.read)
    if core.spec is not None:
        spec = core.spec_stats
        metrics.gauge(
            "pdserve_spec_draft_tokens",
            "Draft tokens proposed by the MTP layer",
            lambda: spec.num_draft_tokens,
        )
        metrics.gauge(
            "pdserve_spec_accepted_tokens", "Draft tokens accepted", lambda: spec.num_accepted_tokens
        )
        metrics.gauge(
            "pdserve_spec_acceptance_rate", "Accepted / proposed draft tokens", lambda: spec.acceptance_rate
        )
        metrics.gauge(
            "pdserve_spec_mean_accept_length",
            "Tokens emitted per verification",
            lambda: spec.mean_accept_length,
        )
        for i in range(core.spec.num_speculative_tokens):
            metrics.gauge(
                f"pdserve_spec_acceptance_rate_pos{i}",
                f"Share of verifications accepting draft {i}",
                lambda i=i: spec.per_position()[i],
            )
    if core.rebalancer is not None:
        eplb = core.rebalancer
        metrics.gauge(
            "pdserve_eplb_balance_ratio_before",
            "Max/mean tokens per EP rank of the last EPLB window, old placement",
            lambda: eplb.last_ratio[0] if eplb.last_ratio else 0.0,
        )
        metrics.gauge(
            "pdserve_eplb_balance_ratio_after",
            "The same under the placement EPLB chose",
            lambda: eplb.last_ratio[1] if eplb.last_ratio else 0.0,
        )
        metrics.gauge(
            "pdserve_eplb_rebalances", "Expert placements applied live", lambda: eplb.num_rebalances
        )
        metrics.gauge(
            "pdserve_expert_load_this_rank",
            "Tokens this rank's experts got in the last EPLB window (new placement)",
            lambda: (
                eplb.last_rank_load[settings.dp_rank] if len(eplb.last_rank_load) > settings.dp_rank else 0.0
            ),
        )
    freeze_startup_heap()  # the engine, its services and their imports: kept until exit
    if not stop.is_set():  # a Drain that came while loading: never turn ready
        await set_health(health, live=True, ready=True)
        logger.info("%s worker ready on %s", settings.role, endpoint)

    heartbeat = None
    registry = make_registry(cfg.registry, None, key=cfg.security.token) if cfg.registry else None
    if registry is not None:

        def record() -> WorkerRecord:
            stats = core.stats
            load = {
                "num_running": stats.num_running,
                "num_waiting": stats.num_waiting,
                "kv_usage": stats.kv.usage,
            }
            return WorkerRecord(
                endpoint,
                settings.role,
                settings.model_name,
                settings.dp_rank,
                identity.epoch,
                load,
                time.time_ns() // 1_000_000,
            )

        heartbeat = Heartbeat(registry, record, ttl_s=cfg.heartbeat_ttl_s)
        heartbeat.start()

    async def sweep_leases() -> None:
        expired = metrics.labels(metrics.kv_expired_leases)
        while True:
            await asyncio.sleep(LEASE_SWEEP_S)
            n = exports.expire_due()
            if n:
                expired.inc(n)
                logger.info("%d KV transfer lease(s) expired", n)

    sweeper = asyncio.ensure_future(sweep_leases())
    engine_died = asyncio.ensure_future(_watch_engine(engine, cfg.stall_timeout_s))
    stopped = asyncio.ensure_future(stop.wait())
    await asyncio.wait([stopped, engine_died], return_when=asyncio.FIRST_COMPLETED)
    code = 0 if stop.is_set() else 1

    # Drain: refuse new work, let in-flight streams finish, then stop.
    service.draining = True
    await set_health(health, live=code == 0, ready=False)
    if code:
        await asyncio.sleep(1.0)  # let probes see liveness NOT_SERVING before the process goes
    if heartbeat is not None:
        await heartbeat.stop(deregister=True)
    if registry is not None:
        await registry.close()
    deadline = time.monotonic() + cfg.grace_s
    while code == 0 and engine.num_streams and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    service.end_subscriptions()
    exports.abort_all()
    sweeper.cancel()
    engine_died.cancel()
    await server.stop(1.0)
    if metrics_runner is not None:
        await metrics_runner.cleanup()
    await service.peers.close()
    service.transports.close()
    engine.stop()
    if agent is not None:
        agent.close()
    logger.info("%s worker on %s stopped", settings.role, endpoint)
    return code


async def _watch_engine(engine: AsyncEngine, stall_timeout_s: float) -> None:
    """Returns when the engine thread died or stalled with work pending (liveness then fails)."""
    while engine.alive:
        stalled = engine.stalled_for()
        if stalled > stall_timeout_s:
            logger.error("engine made no progress for %.1f s with work pending; giving up", stalled)
            return
        await asyncio.sleep(min(0.5, stall_timeout_s / 4))
    logger.error("engine thread stopped: %s", engine.error)
