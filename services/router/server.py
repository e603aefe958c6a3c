"""The router process: public gRPC `Inference` and the OpenAI-compatible HTTP API on one loop.

Readiness (gRPC `readiness`, HTTP /health) is SERVING once a request can be routed: a worker that
decodes is healthy (RouterCore.not_ready), and NOT_SERVING again when none is.
SIGTERM/SIGINT stops both servers after in-flight streams had a grace period.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from dataclasses import dataclass, field
from pathlib import Path

from engine.gc_heap import freeze_startup_heap
from engine.tokenizer import Tokenizer
from pdserve.v1 import inference_pb2_grpc as pb_grpc
from services.common.grpc_utils import add_health_and_reflection, bind_public, new_server, set_health
from services.common.metrics import Metrics
from services.common.security import ApiKeyInterceptor, ApiKeys, Security
from services.openai.server import build_app, server_ssl_context, start_http
from services.registry import make_registry
from services.router.core import RouterCore, RouterSettings
from services.router.grpc_service import InferenceService
from services.router.pool import WorkerPool

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RouterServerConfig:
    model: str
    """Model folder (the router needs its tokenizer and chat template)."""
    settings: RouterSettings
    host: str = "127.0.0.1"
    """Address both servers bind to; only this one."""
    grpc_port: int = 50051
    http_port: int | None = 8000
    """OpenAI-compatible HTTP API (and /metrics, /health); None: off."""
    registry: str | None = None
    """redis://host:port/db to discover workers in; None: `workers`."""
    workers: list[str] = field(default_factory=list)
    """Static worker endpoints (host:port) when there is no registry."""
    grace_s: float = 30.0
    probe_interval_s: float = 0.5
    """How often the router reads every worker's load and health."""
    security: Security = Security()
    """Internal token / client certificate presented to the workers."""
    public_tls_cert: str | None = None
    """PEM certificate chain both public servers (gRPC Inference, HTTP) present; None: plaintext.
    Clients are not asked for certificates (internal mutual TLS is `security`)."""
    public_tls_key: str | None = None
    """PEM private key of public_tls_cert; the two go together."""
    http_header_timeout_s: float = 10.0
    """An HTTP connection is closed when a request head has not fully arrived this long after it
    connected or after its previous response (slow clients)."""
    http_body_timeout_s: float = 30.0
    """A request body not fully received within this long gets 408."""
    http_max_connections: int = 1024
    """Open HTTP connections beyond this are answered 503 and closed at once."""
    api_keys: ApiKeys = field(default_factory=ApiKeys)
    """Keys the public API accepts as `Authorization: Bearer KEY` (every /v1/* route, every gRPC
    Inference method; health, reflection and /metrics stay open); none: the API is open."""

    def __post_init__(self):
        if (self.public_tls_cert is None) != (self.public_tls_key is None):
            raise ValueError(
                "public_tls_cert and public_tls_key (--public-tls-cert/--public-tls-key) go together"
            )


async def serve(cfg: RouterServerConfig, on_bound=None) -> int:
    metrics = Metrics("router")
    metrics.watch_gc()
    pool = WorkerPool(
        make_registry(cfg.registry, cfg.workers, key=cfg.security.token),
        probe_s=cfg.probe_interval_s,
        security=cfg.security,
    )
    core = RouterCore(cfg.settings, Tokenizer(Path(cfg.model)), pool, metrics)
    core.keyed = bool(cfg.api_keys)  # a client is then known by its key
    metrics.gauge(
        "pdserve_num_requests_running",
        "Requests in flight through the router",
        lambda: sum(w.in_flight for w in pool.workers.values()),
    )
    metrics.gauge(
        "pdserve_healthy_workers",
        "Workers that answered their last probe",
        lambda: sum(w.healthy for w in pool.workers.values()),
    )

    server = new_server(interceptors=[ApiKeyInterceptor(cfg.api_keys)] if cfg.api_keys else [])
    pb_grpc.add_InferenceServicer_to_server(InferenceService(core), server)
    health = add_health_and_reflection(server, ["pdserve.v1.Inference"])
    await set_health(health, live=True, ready=False)
    grpc_port = bind_public(server, cfg.host, cfg.grpc_port, cfg.public_tls_cert, cfg.public_tls_key)
    await server.start()
    http_runner = None
    http_port = None
    if cfg.http_port is not None:
        tls = (
            server_ssl_context(cfg.public_tls_cert, cfg.public_tls_key)
            if cfg.public_tls_cert is not None
            else None
        )
        http_runner = await start_http(
            build_app(core, metrics.registry, body_timeout_s=cfg.http_body_timeout_s, api_keys=cfg.api_keys),
            cfg.host,
            cfg.http_port,
            ssl_context=tls,
            header_timeout_s=cfg.http_header_timeout_s,
            max_connections=cfg.http_max_connections,
        )
        http_port = http_runner.addresses[0][1]
    if on_bound is not None:
        on_bound(grpc_port, http_port)
    logger.info(
        "router: gRPC on %s:%d, HTTP on %s; public API %s",
        cfg.host,
        grpc_port,
        http_port,
        f"needs one of {len(cfg.api_keys.keys)} API key(s)" if cfg.api_keys else "open (no API key)",
    )

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await pool.start()
    freeze_startup_heap()  # the tokenizer, the servers and their imports: kept until exit

    async def track_readiness() -> None:
        ready = None
        while True:
            now_ready = core.not_ready() is None
            if now_ready != ready:
                await set_health(health, live=True, ready=now_ready)
                logger.info("router readiness: %s", "SERVING" if now_ready else "NOT_SERVING")
                ready = now_ready
            await asyncio.sleep(0.2)

    tracker = asyncio.ensure_future(track_readiness())
    await stop.wait()
    tracker.cancel()
    await set_health(health, live=True, ready=False)
    await server.stop(cfg.grace_s)
    if http_runner is not None:
        await http_runner.cleanup()
    await pool.close()
    return 0
