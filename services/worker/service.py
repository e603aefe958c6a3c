"""The `Worker` gRPC service: Prefill (export KV under a lease), Decode (import KV or run
colocated, then stream), load and engine info. Handlers are thin; engine work runs on the
engine thread through AsyncEngine.

A caller's `request_id` is a label only (logs, and echoed in the responses): every Prefill and
Decode call runs under a fresh engine request id of its own, so two calls that share a label
never touch each other's engine state or exported KV."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import torch

from engine.kv_cache.codec import DTYPE_CODES
from engine.kv_cache.export import DEFAULT_MAX_TOTAL_LEASE_S, ExportOptions, ExportTable, PinLimitExceeded
from engine.kv_cache.hashing import hash_blocks
from engine.kv_cache.nixl import NixlAgent
from engine.kv_cache.spec import KVCacheSpec
from engine.kv_cache.transfer import KVPort
from engine.outputs import RequestOutput
from pdserve.v1 import inference_pb2 as pb
from pdserve.v1 import kv_transfer_pb2 as kv_pb
from pdserve.v1 import worker_pb2 as wpb
from pdserve.v1 import worker_pb2_grpc as wgrpc
from services.common import convert
from services.common.errors import (
    FailedPrecondition,
    InvalidArgument,
    ResourceExhausted,
    ServiceError,
    Unavailable,
)
from services.common.grpc_utils import caller_key, remaining
from services.common.metrics import Metrics
from services.common.security import Security
from services.kv_transfer import consumer, nixl_pull
from services.kv_transfer.nixl_pull import KV_TRANSPORTS, Transports, agent_info
from services.kv_transfer.peers import PeerStubs, check_handle
from services.kv_transfer.wire import MAX_CHUNK_BYTES, spec_to_proto
from services.worker.async_engine import AsyncEngine, EngineDead

logger = logging.getLogger(__name__)

ROLES = {
    "prefill": wpb.WORKER_ROLE_PREFILL,
    "decode": wpb.WORKER_ROLE_DECODE,
    "colocated": wpb.WORKER_ROLE_COLOCATED,
}
DEFAULT_PULL_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class WorkerSettings:
    role: str
    """"prefill", "decode" or "colocated" (answers both Prefill and Decode)."""
    model_name: str
    dp_rank: int = 0
    dp_size: int = 1
    """Ranks in this worker's data-parallel group."""
    ep_size: int = 1
    """Expert-parallel ranks (the group, when experts are spread; else 1)."""
    lease_s: float = 30.0
    """How long a prefill worker keeps exported KV pinned waiting for the decode side."""
    kv_chunk_bytes: int = MAX_CHUNK_BYTES
    """Largest KV chunk this worker asks a producer for."""
    max_total_lease_s: float = DEFAULT_MAX_TOTAL_LEASE_S
    """No transfer stays pinned longer than this after its Prefill, however often it is renewed."""
    max_pinned_fraction: float = 0.75
    """Most of this worker's KV blocks one caller (host) may hold pinned in transfers; a Prefill
    past it is RESOURCE_EXHAUSTED before it runs."""
    kv_producers: tuple[str, ...] | None = None
    """host:port of the prefill workers a decode worker may pull KV from; None: any producer
    (whose handle is signed, when the worker has an internal token)."""
    kv_transport: str = "auto"
    """How KV moves: "nixl" (this worker's caches registered with a NIXL agent; producers must
    offer theirs), "grpc" (the KvTransfer chunk stream only), "auto" (NIXL when installed here and
    offered by the producer, gRPC otherwise)."""
    kv_checksums: bool = True
    """Take (producer) and verify (consumer) an end-to-end checksum of every block moved over
    NIXL; off only on trusted fabrics."""

    def __post_init__(self) -> None:
        if self.kv_transport not in KV_TRANSPORTS:
            raise ValueError(f"kv_transport must be one of {KV_TRANSPORTS}, got {self.kv_transport!r}")
        if not 0 < self.max_pinned_fraction <= 1:
            raise ValueError(f"max_pinned_fraction must be in (0, 1], got {self.max_pinned_fraction}")
        if self.max_total_lease_s <= 0:
            raise ValueError(f"max_total_lease_s must be > 0, got {self.max_total_lease_s}")


class WorkerService(wgrpc.WorkerServicer):
    def __init__(
        self,
        settings: WorkerSettings,
        engine: AsyncEngine,
        exports: ExportTable,
        identity: kv_pb.KvProducer,
        metrics: Metrics,
        security: Security | None = None,
        on_drain: Callable[[], None] | None = None,
    ):
        self.settings = settings
        self.engine = engine
        self.exports = exports
        """The engine's exports (their leases are the engine's; this service hands them out)."""
        self.identity = identity
        self.metrics = metrics
        self.security = security
        self.peers = PeerStubs(security)
        self.on_drain = on_drain
        """Called by Drain: starts the process's graceful stop (the same as SIGTERM)."""
        self.draining = False
        self.kv_spec: KVCacheSpec | None = None
        self.compat_hash = ""
        self.port: KVPort | None = None
        self.nixl: NixlAgent | None = None
        """This worker's NIXL agent (None: KV moves over gRPC only)."""
        self.transports = Transports(settings.kv_transport, None, self.peers, verify=settings.kv_checksums)
        self._tasks: set[asyncio.Task] = set()

    def engine_ready(
        self, kv_spec: KVCacheSpec, port: KVPort | None = None, agent: NixlAgent | None = None
    ) -> None:
        self.kv_spec, self.compat_hash = kv_spec, kv_spec.compat_hash()
        self.port, self.nixl = port, agent
        self.transports.agent = agent

    # ---- helpers -------------------------------------------------------------------------------

    def background(self, coro) -> None:
        """Run a cleanup that must finish even when the handler that started it is cancelled."""
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _admit(self, *roles: str) -> None:
        if self.settings.role not in roles:
            raise FailedPrecondition(
                f"this is a {self.settings.role} worker; the call needs role {' or '.join(roles)}"
            )
        if self.draining:
            raise Unavailable("worker is draining")
        if self.kv_spec is None or not self.engine.alive:
            raise Unavailable("engine is not ready")

    async def _abort(self, request_id: str) -> None:
        def abort(core) -> None:
            core.abort_request(request_id)
            core.release_export(request_id)

        try:
            await self.engine.call(abort)
        except EngineDead:
            pass

    async def _release_producer(self, handle: kv_pb.KvHandle, done: bool) -> None:
        reason = kv_pb.RELEASE_REASON_DONE if done else kv_pb.RELEASE_REASON_ABORT
        try:
            await self.peers.kv(handle.producer.endpoint).Release(
                kv_pb.ReleaseRequest(transfer_id=handle.transfer_id, reason=reason), timeout=5.0
            )
        except Exception as e:  # noqa: BLE001 - the producer's lease frees the blocks anyway
            logger.info("release of transfer %s failed: %s", handle.transfer_id, e)

    def _observe(self, out: RequestOutput) -> None:
        m, metrics = self.metrics, out.metrics
        m.labels(m.requests, out.finish_reason or "unknown").inc()
        if metrics is not None:
            m.observe_request(metrics.time_to_first_token, metrics.e2e_latency, metrics.queue_time)
            m.labels(m.cached_tokens).inc(metrics.num_cached_tokens)

    # ---- RPCs ----------------------------------------------------------------------------------

    async def GetEngineInfo(self, request, context) -> wpb.EngineInfo:
        core = await self.engine.wait_ready() if self.engine.core is None else self.engine.core
        spec = self.kv_spec
        first = spec.groups[0]
        return wpb.EngineInfo(
            role=ROLES[self.settings.role],
            model=self.settings.model_name,
            dp_rank=self.settings.dp_rank,
            identity=self.identity,
            kv_cache=wpb.KvCacheGeometry(
                num_layers=spec.num_layers,
                num_blocks=core.num_kv_blocks,
                block_size=spec.block_size,
                width=first.width,
                dtype=DTYPE_CODES[first.dtype],
            ),
            kv_cache_spec=spec_to_proto(spec),
            compat_hash=self.compat_hash,
            max_model_len=core.max_model_len,
            vocab_size=core.model_cfg.vocab_size,
            dp_size=self.settings.dp_size,
            ep_size=self.settings.ep_size,
            # Only callers that passed the internal token / mutual TLS get here (the interceptor
            # guards every Worker method): the metadata lets its holder READ all of our KV memory.
            nixl=agent_info(self.nixl, self.settings.kv_checksums) if self.nixl is not None else None,
        )

    async def GetLoad(self, request, context) -> wpb.Load:
        core = self.engine.core
        if core is None:
            return wpb.Load(draining=self.draining)
        bm = core.block_manager
        return wpb.Load(
            num_running=len(core.scheduler.running),
            num_waiting=len(core.scheduler.waiting) + len(core.importing),
            kv_usage=bm.usage,
            num_free_blocks=bm.num_free_blocks,
            num_total_blocks=core.num_kv_blocks,
            num_pinned_transfers=len(self.exports),
            prefix_hit_rate=bm.prefix_hits / bm.prefix_queries if bm.prefix_queries else 0.0,
            draining=self.draining,
        )

    async def Drain(self, request, context) -> wpb.DrainResponse:
        """Refuse new work at once and stop the way SIGTERM does: readiness NOT_SERVING,
        deregistration, in-flight streams finish within the grace period, exit 0."""
        self.draining = True
        if self.on_drain is not None:
            self.on_drain()
        return wpb.DrainResponse(num_in_flight=self.engine.num_streams)

    async def Prefill(self, request: wpb.PrefillRequest, context) -> wpb.PrefillResponse:
        self._admit("prefill", "colocated")
        rid = uuid.uuid4().hex  # the engine's id; the caller's request_id is only a label
        label = request.request_id or rid
        prompt = list(request.prompt_token_ids)
        params = convert.sampling_from_proto(request.sampling)
        caller = caller_key(context.peer())
        num_blocks = -(-len(prompt) // self.kv_spec.block_size)
        limit = int(self.settings.max_pinned_fraction * self.engine.core.num_kv_blocks)
        try:  # RESOURCE_EXHAUSTED before the prompt runs
            self.exports.reserve(caller, num_blocks, limit)
        except PinLimitExceeded as e:
            raise ResourceExhausted(str(e)) from None
        lease_s = request.lease_ms / 1000 if request.lease_ms > 0 else None
        export_options = ExportOptions(lease_s, caller)
        stream = self.engine.open_stream(rid)
        exported = False
        try:
            await self.engine.call(
                lambda core: core.add_request(rid, prompt, params, kv_export=export_options)
            )
            out = await stream.get()
            if isinstance(out, BaseException):
                raise Unavailable(f"engine failed: {out}")
            assert out.finished, "a prefill-only request ends with its first token"
            self._observe(out)
            response = wpb.PrefillResponse(output=convert.output_to_proto(out, first=True))
            response.output.request_id = label
            response.output.usage.CopyFrom(
                pb.Usage(
                    prompt_tokens=len(prompt),
                    completion_tokens=len(out.token_ids),
                    cached_tokens=out.num_cached_tokens,
                )
            )
            kv = out.exported_kv
            if kv is not None:
                exported = True
                if self.nixl is not None and self.settings.kv_checksums:
                    await self._take_checksums(kv.export_id)
                response.kv_handle.CopyFrom(
                    kv_pb.KvHandle(
                        transfer_id=kv.export_id,
                        producer=self.identity,
                        block_hashes=kv.block_hashes,
                        num_tokens=kv.num_tokens,
                        num_blocks=len(kv.block_ids),
                        block_size=self.kv_spec.block_size,
                        lease_expiry_unix_ms=int(kv.lease_expiry * 1000),
                        compat_hash=self.compat_hash,
                    )
                )
                if kv.generator_state is not None:
                    response.sampler_state = kv.generator_state.numpy().tobytes()
            return response
        except BaseException:
            if not exported:  # cancelled or failed before the handle went out: end the export too
                self.background(self._abort(rid))
            raise
        finally:
            self.exports.unreserve(caller, num_blocks)  # the export (if any) counts its blocks now
            self.engine.close_stream(rid)

    async def _take_checksums(self, export_id: str) -> None:
        """The export's per-block checksums, taken before its handle goes out (inside a read:
        the blocks are pinned and the engine writes them no more), for NIXL readers to verify."""
        export = self.exports.begin_read(export_id)
        try:
            export.block_digests = await asyncio.to_thread(self.port.digest_exported, export)
        finally:
            self.exports.end_read(export, room=False)

    async def Decode(self, request: wpb.DecodeRequest, context):
        self._admit("decode", "colocated")
        handle = request.kv_handle if request.HasField("kv_handle") else None
        if handle is not None:  # before any connection to the producer or engine state
            token = self.security.token if self.security is not None else None
            check_handle(handle, request.kv_handle_mac, token, self.settings.kv_producers)
        rid = uuid.uuid4().hex  # the engine's id; the caller's request_id is only a label
        label = request.request_id or rid
        prompt = list(request.prompt_token_ids)
        params = convert.sampling_from_proto(request.sampling)
        start = time.monotonic()
        stream = self.engine.open_stream(rid)
        kv_bytes, kv_seconds, released = 0, 0.0, handle is None
        try:
            if handle is None:
                await self.engine.call(lambda core: core.add_request(rid, prompt, params))
            else:
                kv_bytes, kv_seconds, pulled = await self._import(
                    rid, label, request, prompt, params, remaining(context)
                )
                released = True  # on failure _import released it (abort) already
                if pulled:
                    self.background(self._release_producer(handle, done=True))
            first, last_token_time, gaps = True, None, []
            while True:
                item = await stream.get()
                batch = [item]
                while not stream.empty():  # tokens that are ready together go in one message
                    batch.append(stream.get_nowait())
                msg = None
                for out in batch:
                    if isinstance(out, BaseException):
                        raise Unavailable(f"engine failed: {out}")
                    part = convert.output_to_proto(out, first and handle is None)
                    first = False
                    if msg is None:
                        msg = part
                        msg.request_id = label
                    else:
                        convert.merge(msg, part)
                now = time.monotonic()
                if last_token_time is not None and msg.token_ids:
                    gaps.append((now - last_token_time) / len(msg.token_ids))
                last_token_time = now
                if out.finished:
                    self._observe(out)
                    for gap in gaps:
                        self.metrics.labels(self.metrics.itl).observe(gap)
                    msg.usage.CopyFrom(
                        pb.Usage(
                            prompt_tokens=len(prompt),
                            completion_tokens=len(out.token_ids),
                            cached_tokens=out.num_cached_tokens,
                            kv_transfer_bytes=kv_bytes,
                        )
                    )
                    m = out.metrics
                    msg.timings.CopyFrom(
                        pb.Timings(
                            queue_ns=int((m.queue_time or 0) * 1e9),
                            kv_transfer_ns=int(kv_seconds * 1e9),
                            ttft_ns=int((m.time_to_first_token or 0) * 1e9) if handle is None else 0,
                            e2e_ns=int((time.monotonic() - start) * 1e9),
                        )
                    )
                    msg.disaggregated = handle is not None
                    yield msg
                    return
                yield msg
        except BaseException:
            self.background(self._abort(rid))
            if not released:
                self.background(self._release_producer(handle, done=False))
            raise
        finally:
            self.engine.close_stream(rid)

    async def _import(
        self, rid: str, label: str, request: wpb.DecodeRequest, prompt, params, timeout
    ) -> tuple[int, float, bool]:
        """Allocate blocks, pull the missing prompt KV and join the batch -> (bytes, seconds,
        pulled). pulled is False when the pull failed and the prompt is recomputed instead."""
        handle = request.kv_handle
        block_size = self.kv_spec.block_size
        if handle.compat_hash != self.compat_hash:
            raise FailedPrecondition(
                f"KV from {handle.producer.endpoint} has compat hash {handle.compat_hash}, ours is {self.compat_hash}"
            )
        if (
            handle.block_size != block_size
            or handle.num_tokens != len(prompt)
            or handle.num_blocks != -(-len(prompt) // block_size)
        ):
            raise InvalidArgument(
                f"kv_handle covers {handle.num_tokens} tokens in {handle.num_blocks} blocks of {handle.block_size}; "
                f"the prompt has {len(prompt)} tokens and our blocks hold {block_size}"
            )
        if list(handle.block_hashes) != hash_blocks(prompt, block_size):
            raise FailedPrecondition("kv_handle block hashes do not match the prompt's")
        state = (
            torch.frombuffer(bytearray(request.sampler_state), dtype=torch.uint8)
            if request.sampler_state
            else None
        )
        outputs = list(request.output_token_ids)
        await self.engine.call(lambda core: core.begin_import(rid, prompt, outputs, params, state))

        def allocate(core):
            hits = core.allocate_import(rid)
            return None if hits is None else (hits, core.import_sink(rid))

        first_block, sink = await self.engine.call(allocate, retry_until_set=True)
        start = time.monotonic()
        pull_timeout = timeout if timeout is not None else DEFAULT_PULL_TIMEOUT_S
        transport = "grpc"

        async def pull() -> int:
            nonlocal transport
            peer = await self.transports.choose(handle.producer, pull_timeout)
            transport = "grpc" if peer is None else "nixl"
            if peer is not None:
                return await nixl_pull.pull(
                    self.transports, peer, handle, sink, first_block, pull_timeout, self.settings.kv_checksums
                )
            return await consumer.pull(
                self.peers.kv(handle.producer.endpoint),
                handle,
                sink,
                first_block,
                self.settings.kv_chunk_bytes,
                pull_timeout,
            )

        try:
            try:
                received = await pull()
            except ServiceError as e:
                if e.code != grpc.StatusCode.UNAVAILABLE:
                    raise
                self.peers.forget(handle.producer.endpoint)  # one more try on a fresh connection
                received = await pull()
        except ServiceError as e:
            self.metrics.labels(self.metrics.kv_transfer_failures, e.code.name).inc()
            if request.kv_failure_policy != pb.KV_FAILURE_POLICY_RECOMPUTE:
                raise  # Decode aborts the request and releases the producer
            self.background(self._release_producer(handle, done=False))
            logger.warning(
                "request %s (engine id %s): KV transfer failed (%s); recomputing the prompt", label, rid, e
            )
            await self.engine.call(lambda core: core.recompute_import(rid))
            return 0, time.monotonic() - start, False
        seconds = time.monotonic() - start
        self.metrics.labels(self.metrics.kv_transfer_bytes, "received").inc(received)
        self.metrics.labels(self.metrics.kv_transfer_seconds).observe(seconds)
        self.metrics.labels(self.metrics.kv_transfers, transport).inc()
        await self.engine.call(lambda core: core.finish_import(rid))
        return received, seconds, True
