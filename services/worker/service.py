"""The `Worker` gRPC service: Prefill (export KV under a lease), Decode (import KV or run
colocated, then stream), load and engine info. Handlers are thin: the KV handover's two sides
are services/worker/kv_export.py and kv_import.py, a Decode's messages and every request's
metrics services/worker/outputs.py; engine work runs on the engine thread through AsyncEngine.

A caller's `request_id` is a label only (logs, and echoed in the responses): every Prefill and
Decode call runs under a fresh engine request id of its own, so two calls that share a label
never touch each other's engine state or exported KV."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable

from engine.kv_cache.codec import DTYPE_CODES
from engine.kv_cache.export import ExportOptions, ExportTable
from engine.kv_cache.nixl import NixlAgent
from engine.kv_cache.spec import KVCacheSpec
from engine.kv_cache.transfer import KVPort
from pdserve.v1 import inference_pb2 as pb
from pdserve.v1 import kv_transfer_pb2 as kv_pb
from pdserve.v1 import worker_pb2 as wpb
from pdserve.v1 import worker_pb2_grpc as wgrpc
from services.common import convert
from services.common.errors import FailedPrecondition, Unavailable
from services.common.grpc_utils import caller_key, remaining
from services.common.metrics import Metrics
from services.common.security import Security
from services.kv_transfer.nixl_pull import Transports, agent_info
from services.kv_transfer.peers import PeerStubs, check_handle
from services.kv_transfer.wire import spec_to_proto
from services.worker.async_engine import AsyncEngine, EngineDead
from services.worker.kv_export import KvExporter
from services.worker.kv_import import KvImporter
from services.worker.outputs import DecodeMessages, observe
from services.worker.settings import ROLES, WorkerSettings
from services.worker.subscriptions import Subscriptions

logger = logging.getLogger(__name__)


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
        self.nixl: NixlAgent | None = None
        """This worker's NIXL agent (None: KV moves over gRPC only)."""
        self.transports = Transports(settings.kv_transport, None, self.peers, verify=settings.kv_checksums)
        self.exporter = KvExporter(settings, engine, exports, identity)
        self.importer = KvImporter(settings, engine, metrics, self.peers, self.transports, self.background)
        self._tasks: set[asyncio.Task] = set()
        self.subscriptions = Subscriptions()

    def engine_ready(
        self, kv_spec: KVCacheSpec, port: KVPort | None = None, agent: NixlAgent | None = None
    ) -> None:
        self.kv_spec, self.compat_hash = kv_spec, kv_spec.compat_hash()
        self.nixl = agent
        self.transports.agent = agent
        self.exporter.engine_ready(kv_spec, port, nixl=agent is not None)
        self.importer.engine_ready(kv_spec)

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
            core.handover.release_export(request_id)

        try:
            await self.engine.call(abort)
        except EngineDead:
            pass

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
                num_layers=spec.num_caches,
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
            max_pinned_blocks=self.exporter.pin_limit,
            # Only callers that passed the internal token / mutual TLS get here (the interceptor
            # guards every Worker method): the metadata lets its holder READ all of our KV memory.
            nixl=agent_info(self.nixl, self.settings.kv_checksums) if self.nixl is not None else None,
        )

    async def GetLoad(self, request, context) -> wpb.Load:
        core = self.engine.core
        if core is None:
            return wpb.Load(draining=self.draining)
        stats = core.stats
        return wpb.Load(
            num_running=stats.num_running,
            num_waiting=stats.num_waiting,
            kv_usage=stats.kv.usage,
            num_free_blocks=stats.kv.num_free_blocks,
            num_total_blocks=stats.kv.num_blocks,
            num_pinned_transfers=len(self.exports),
            prefix_hit_rate=stats.kv.prefix_hit_rate,
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
        caller = request.client or caller_key(context.peer())  # the end client, where a router says
        num_blocks = -(-len(prompt) // self.kv_spec.block_size)
        with self.exporter.reserved(caller, num_blocks):  # RESOURCE_EXHAUSTED before the prompt runs
            lease_s = request.lease_ms / 1000 if request.lease_ms > 0 else None
            export_options = ExportOptions(lease_s, caller)
            stream = self.engine.open_stream(rid)
            exported = False
            try:
                await self.engine.call(
                    lambda core: core.add_request(
                        rid, prompt, params, kv_export=export_options, client=caller
                    )
                )
                out = await stream.get()
                if isinstance(out, BaseException):
                    raise Unavailable(f"engine failed: {out}")
                assert out.finished, "a prefill-only request ends with its first token"
                observe(self.metrics, out)
                response = wpb.PrefillResponse(output=convert.output_to_proto(out, first=True))
                response.output.request_id = label
                response.output.usage.CopyFrom(
                    pb.Usage(
                        prompt_tokens=len(prompt),
                        completion_tokens=len(out.token_ids),
                        cached_tokens=out.num_cached_tokens,
                    )
                )
                if out.exported_kv is not None:
                    exported = True
                    await self.exporter.describe(out.exported_kv, response)
                return response
            except BaseException:
                if not exported:  # cancelled or failed before the handle went out: end the export too
                    self.background(self._abort(rid))
                raise
            finally:
                self.engine.close_stream(rid)

    async def Subscribe(self, request: wpb.SubscribeRequest, context):
        """One caller's Decode outputs, a message per engine step (services/worker/subscriptions.py)."""
        self._admit("decode", "colocated")
        sub = self.subscriptions.open(caller_key(context.peer()))
        try:
            yield wpb.DecodeOutputs(subscription_id=sub.id)
            while (msg := await sub.queue.get()) is not None:
                while not sub.queue.empty():  # steps that went out together go in one message
                    more = sub.queue.get_nowait()
                    if more is None:
                        yield msg
                        return
                    msg.outputs.extend(more.outputs)
                yield msg
        finally:
            self.subscriptions.close(sub)

    def end_subscriptions(self) -> None:
        """Graceful stop, once no call is left: every Subscribe stream sends what it holds and ends."""
        for sub in self.subscriptions.all():
            self.subscriptions.close(sub)

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
        kv_bytes, kv_seconds, released = 0, 0.0, handle is None
        member = None  # the call's place in the subscription it names, if it names one
        if request.subscription_id:
            sub = self.subscriptions.get(request.subscription_id, caller_key(context.peer()))
            member = sub.join(request.request_id)
        try:
            if member is None:
                stream = self.engine.open_stream(rid)
            else:
                self.engine.open_sink(rid, member)
            if handle is None:
                await self.engine.call(
                    lambda core: core.add_request(rid, prompt, params, client=request.client)
                )
            else:
                kv_bytes, kv_seconds, pulled = await self.importer.run(
                    rid, label, request, prompt, params, remaining(context)
                )
                released = True  # on failure the importer released it (abort) already
                if pulled:
                    self.background(self.importer.release_producer(handle, done=True))
            messages = DecodeMessages(
                self.metrics, label, handle is not None, len(prompt), kv_bytes, kv_seconds, start
            )
            if member is not None:  # the messages go to the subscription; this call ends with the request
                member.start(messages.message)
                await member.done
                return
            while True:
                batch = [await stream.get()]
                while not stream.empty():  # tokens that are ready together go in one message
                    batch.append(stream.get_nowait())
                msg, finished = messages.message(batch)
                yield msg
                if finished:
                    return
        except BaseException:
            self.background(self._abort(rid))
            if not released:
                self.background(self.importer.release_producer(handle, done=False))
            raise
        finally:
            self.engine.close_stream(rid)
            if member is not None:
                member.subscription.leave(member)
