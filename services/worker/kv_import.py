"""The decode side of a handover: check the handle against the prompt, give the request blocks
(reusing the ones this worker holds by block hash), pull the missing prompt KV over NIXL or the
gRPC chunk stream (one more try on a fresh connection when the producer is UNAVAILABLE), then join
the request to the batch -- or, when the pull fails, fail it or recompute the prompt here
(`kv_failure_policy`). Releasing the producer (done or abort) is the caller's once the import
succeeded; a failed one releases it (abort) itself."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Coroutine

import grpc
import torch

from engine.kv_cache.hashing import hash_blocks
from engine.kv_cache.spec import KVCacheSpec
from pdserve.v1 import inference_pb2 as pb
from pdserve.v1 import kv_transfer_pb2 as kv_pb
from pdserve.v1 import worker_pb2 as wpb
from services.common.errors import FailedPrecondition, InvalidArgument, ServiceError
from services.common.metrics import Metrics
from services.kv_transfer import consumer, nixl_pull
from services.kv_transfer.nixl_pull import Transports
from services.kv_transfer.peers import PeerStubs
from services.worker.async_engine import AsyncEngine
from services.worker.settings import WorkerSettings

logger = logging.getLogger(__name__)

DEFAULT_PULL_TIMEOUT_S = 60.0


class KvImporter:
    """Only the event loop calls this."""

    def __init__(
        self,
        settings: WorkerSettings,
        engine: AsyncEngine,
        metrics: Metrics,
        peers: PeerStubs,
        transports: Transports,
        background: Callable[[Coroutine], None],
    ):
        """background: runs a cleanup that must finish even when the Decode is cancelled."""
        self.settings = settings
        self.engine = engine
        self.metrics = metrics
        self.peers = peers
        self.transports = transports
        self.background = background
        self.kv_spec: KVCacheSpec | None = None
        self.compat_hash = ""

    def engine_ready(self, kv_spec: KVCacheSpec) -> None:
        self.kv_spec, self.compat_hash = kv_spec, kv_spec.compat_hash()

    async def release_producer(self, handle: kv_pb.KvHandle, done: bool) -> None:
        reason = kv_pb.RELEASE_REASON_DONE if done else kv_pb.RELEASE_REASON_ABORT
        try:
            await self.peers.kv(handle.producer.endpoint).Release(
                kv_pb.ReleaseRequest(transfer_id=handle.transfer_id, reason=reason), timeout=5.0
            )
        except Exception as e:  # noqa: BLE001 - the producer's lease frees the blocks anyway
            logger.info("release of transfer %s failed: %s", handle.transfer_id, e)

    def check(self, handle: kv_pb.KvHandle, prompt: list[int]) -> None:
        """The handle fits the prompt and our cache: FAILED_PRECONDITION / INVALID_ARGUMENT."""
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

    async def run(
        self, rid: str, label: str, request: wpb.DecodeRequest, prompt, params, timeout
    ) -> tuple[int, float, bool]:
        """Allocate blocks, pull the missing prompt KV and join the batch -> (bytes, seconds,
        pulled). pulled is False when the pull failed and the prompt is recomputed instead."""
        handle = request.kv_handle
        self.check(handle, prompt)
        state = (
            torch.frombuffer(bytearray(request.sampler_state), dtype=torch.uint8)
            if request.sampler_state
            else None
        )
        outputs = list(request.output_token_ids)
        begun = False

        def begin_and_allocate(core):
            # One trip to the engine thread, not two: each waits for the step under way to end
            # (~35 ms at 32 requests on 2 cores), all of it in the stream's pause after its
            # first token. Run again after every step while there is no room (`begun` is only
            # touched on the engine thread).
            nonlocal begun
            if not begun:
                core.begin_import(rid, prompt, outputs, params, state)
                begun = True
            hits = core.handover.allocate_import(rid)
            return None if hits is None else (hits, core.handover.import_sink(rid))

        first_block, sink = await self.engine.call(begin_and_allocate, retry_until_set=True)
        start = time.monotonic()
        pull_timeout = timeout if timeout is not None else DEFAULT_PULL_TIMEOUT_S
        transport = "grpc"
        timings = nixl_pull.PullTimings()

        async def pull() -> int:
            nonlocal transport
            peer = await self.transports.choose(handle.producer, pull_timeout)
            transport = "grpc" if peer is None else "nixl"
            if peer is not None:
                return await nixl_pull.pull(
                    self.transports,
                    peer,
                    handle,
                    sink,
                    first_block,
                    pull_timeout,
                    self.settings.kv_checksums,
                    timings,
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
            self.background(self.release_producer(handle, done=False))
            logger.warning(
                "request %s (engine id %s): KV transfer failed (%s); recomputing the prompt", label, rid, e
            )
            await self.engine.call(lambda core: core.handover.recompute_import(rid))
            return 0, time.monotonic() - start, False
        seconds = time.monotonic() - start
        self.metrics.labels(self.metrics.kv_transfer_bytes, "received").inc(received)
        self.metrics.labels(self.metrics.kv_transfer_seconds).observe(seconds)
        self.metrics.labels(self.metrics.kv_transfers, transport).inc()
        if transport == "nixl":
            for phase, phase_s in timings.phases().items():
                self.metrics.labels(self.metrics.kv_transfer_phase_seconds, phase).observe(phase_s)
        await self.engine.call(lambda core: core.handover.finish_import(rid))
        return received, seconds, True
