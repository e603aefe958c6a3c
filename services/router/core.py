"""The router's request path: validate, route, prefill, hand the KV over to decode, stream back.

    generate ─► choose(prefill rank, decode rank) ─► Prefill ─► first token (streamed at once)
                                                 └─► Decode(KvHandle, first token) ─► tokens ...

Colocated requests go straight to Decode without a handle. Cancelling the generator (client
gone) cancels the worker call in flight; a handle the decode side may not have received (its
stream ended before sending anything) is released (abort), so the prefill rank does not wait
for its lease to run out. Every generation gets its own internal request id: the client's id
is only a label, so two clients (or one client twice) using the same id never share state on
a worker. With an internal token, every handle passed to a decode worker is signed with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc

from engine.kv_cache.hashing import hash_blocks, redis_key
from engine.sampling_params import SamplingParams, validate_request
from engine.tokenizer import Tokenizer
from pdserve.v1 import kv_transfer_pb2 as kv_pb
from pdserve.v1 import worker_pb2 as wpb
from services.common import convert
from services.common.errors import InvalidArgument, ServiceError, Unavailable
from services.common.metrics import Metrics
from services.common.security import handle_mac
from services.router import api_proto
from services.router.admission import Admission
from services.router.api import (
    Delta,
    Frontend,
    GenerateInput,
    ServingMode,
    Timings,
    Usage,
    check_api_limits,
    score_only_delta,
)
from services.router.pins import PinBudget
from services.router.policy import Route, RoutingConfig, choose
from services.router.pool import WorkerHandle, WorkerPool

logger = logging.getLogger(__name__)

WORKER_FAULTS = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.DATA_LOSS,
}
"""Errors that count against a worker's circuit breaker (not the client's or the request's fault)."""


@dataclass(frozen=True)
class RouterSettings:
    model_name: str
    routing: RoutingConfig = RoutingConfig()
    default_timeout_s: float = 600.0
    """Deadline of a request that names none."""
    lease_ms: int = 0
    """Lease asked of prefill ranks (0: theirs)."""
    max_in_flight: int = 256
    """Requests routed at once; more wait in the admission queue."""
    max_queued: int = 1024
    """Requests waiting for a slot; beyond it RESOURCE_EXHAUSTED (HTTP 429) at once."""
    queue_timeout_s: float = 60.0
    """Longest wait in the admission queue."""
    max_generations_per_request: int = 64
    """Most generations (prompts x n) one request may hold; capped at max_in_flight."""
    max_attempts: int = 3
    """Tries per request when a worker is UNAVAILABLE before the first token was sent."""
    retry_backoff_s: float = 0.05
    """First retry's backoff (doubled each time, jittered +-50%)."""
    kv_redis_url: str | None = None
    """The workers' shared KV offload tier: prompt blocks found there count as cached everywhere."""
    stream_interval: int = 1
    """Tokens a stream's message gathers before it goes out (its first and its last go at once),
    as SGLang's and vLLM's --stream-interval: fewer, larger messages cost the router and each
    client less per token, and each token waits up to stream_interval - 1 more decode steps."""

    def __post_init__(self) -> None:
        if self.stream_interval < 1:
            raise ValueError(f"stream_interval must be >= 1, got {self.stream_interval}")


class RouterCore(Frontend):
    def __init__(self, settings: RouterSettings, tokenizer: Tokenizer, pool: WorkerPool, metrics: Metrics):
        self.settings = settings
        self.model_name = settings.model_name
        self.tokenizer = tokenizer
        self.pool = pool
        self.metrics = metrics
        self.admission = Admission(settings.max_in_flight, settings.max_queued, settings.queue_timeout_s)
        self.pins = PinBudget(self._pin_capacity)
        """The prefill workers' pinned KV blocks, shared fairly among clients (services/router/pins.py)."""
        self.max_generations_per_request = min(settings.max_generations_per_request, settings.max_in_flight)
        self.kv_redis = None
        if settings.kv_redis_url:
            import redis.asyncio

            self.kv_redis = redis.asyncio.Redis.from_url(settings.kv_redis_url, socket_timeout=0.2)
        self._tasks: set[asyncio.Task] = set()

    def not_ready(self) -> str | None:
        """A request in the default (auto) mode can be routed once a worker that decodes (a decode
        or colocated one) has reported its engine and answers its probes: without a prefill worker
        it runs colocated there (services/router/policy.py)."""
        if self.pool.healthy("decode"):
            return None
        if not self.pool.workers:
            return "no worker is registered"
        states = {
            w.endpoint: "unhealthy" if w.info is not None else "starting" for w in self.pool.workers.values()
        }
        return "no decode worker is ready (" + ", ".join(f"{e}: {s}" for e, s in sorted(states.items())) + ")"

    # ---- model limits, from the workers ---------------------------------------------------------

    def _infos(self) -> list[wpb.EngineInfo]:
        infos = [w.info for w in self.pool.workers.values() if w.info is not None]
        if not infos:
            raise Unavailable("no worker has reported its engine yet")
        return infos

    @property
    def max_model_len(self) -> int:
        return min(i.max_model_len for i in self._infos())

    @property
    def vocab_size(self) -> int:
        return min(i.vocab_size for i in self._infos())

    @property
    def block_size(self) -> int:
        return self._infos()[0].kv_cache.block_size

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        check_api_limits(params)
        infos = self._infos()
        validate_request(
            prompt_token_ids,
            params,
            min(i.vocab_size for i in infos),
            min(i.max_model_len for i in infos),
            infos[0].kv_cache.block_size,
            min(i.kv_cache.num_blocks for i in infos),
        )

    def _pin_capacity(self) -> int:
        """The KV blocks the healthy prefill workers pin for hand-overs, together."""
        return sum(w.info.max_pinned_blocks for w in self.pool.healthy("prefill") if w.role == "prefill")

    def check_fits(self, prompts: list[list[int]], n: int, mode: ServingMode) -> None:
        """A request whose prompts the prefill workers could never hold pinned at once (each prompt
        handed over pins its blocks until the decode side has them; its n samples share the full
        blocks and take one more each) is refused: ValueError naming prompt or n and the limit,
        not a retryable 429 from every worker. Prompts that run colocated pin nothing."""
        limit = self._pin_capacity()
        if mode is ServingMode.COLOCATED or not limit:  # no prefill worker (or none that says)
            return
        block = self.block_size
        shortest = 0 if mode is ServingMode.DISAGGREGATED else self.settings.routing.colocate_max_tokens
        handed = [len(p) for p in prompts if len(p) > shortest]
        need = sum(-(-tokens // block) + n - 1 for tokens in handed)
        if need > limit:
            field = "n" if n > 1 and sum(-(-t // block) for t in handed) <= limit else "prompt"
            raise ValueError(
                f"{field}: {len(handed)} prompt(s) of up to {max(handed)} tokens with n = {n} need {need:,} KV "
                f"blocks pinned at once for their hand-over, more than the prefill workers hold for it "
                f"({limit:,} blocks, max_pinned_fraction)"
            )

    # ---- the request path -----------------------------------------------------------------------

    def admit(self, weight: int, timeout: float | None):
        return self.admission.slot(weight, timeout)

    def _background(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _release(self, w: WorkerHandle, handle: kv_pb.KvHandle) -> None:
        try:
            req = kv_pb.ReleaseRequest(transfer_id=handle.transfer_id, reason=kv_pb.RELEASE_REASON_ABORT)
            await w.kv.Release(req, timeout=5.0)
        except grpc.aio.AioRpcError as e:
            logger.info("release of %s on %s failed: %s", handle.transfer_id, w.endpoint, e.code().name)

    def _check_rpc_error(self, w: WorkerHandle, e: grpc.aio.AioRpcError) -> ServiceError:
        if e.code() == grpc.StatusCode.UNAVAILABLE:
            self.pool.mark_unhealthy(w, e.details() or "UNAVAILABLE")
        return ServiceError(f"{w.endpoint}: {e.details()}", e.code(), endpoint=w.endpoint)

    async def generate(self, inp: GenerateInput) -> AsyncIterator[Delta]:
        """One generation; the caller holds its admission (see Frontend.admit)."""
        params, prompt = inp.params, inp.prompt_token_ids
        self.validate(prompt, params)
        start = time.monotonic()
        deadline = start + (inp.timeout if inp.timeout is not None else self.settings.default_timeout_s)
        rid = uuid.uuid4().hex  # ours: the client's request_id is a label only
        logger.debug("request %s is %s", inp.request_id, rid)
        hashes = hash_blocks(prompt, self.block_size)
        m = self.metrics
        m.labels(m.queue_time).observe(inp.queued)
        finish = "abort"
        failed: set[str] = set()
        try:
            if inp.after is not None:  # another sample of this prompt computes its KV first
                try:
                    await asyncio.wait_for(inp.after.wait(), max(deadline - time.monotonic(), 0.001))
                except TimeoutError:
                    raise ServiceError(
                        "the request's deadline passed before it ran", grpc.StatusCode.DEADLINE_EXCEEDED
                    ) from None
            for attempt in range(self.settings.max_attempts):
                delivered = False
                try:
                    async for delta in self._attempt(rid, inp, hashes, start, deadline, failed):
                        delivered = delivered or bool(delta.token_ids or delta.text)
                        finish = delta.finish_reason or finish
                        yield score_only_delta(delta) if inp.score_only else delta
                    return
                except ServiceError as e:
                    # Retry only what cannot have reached the client: a worker that was
                    # unavailable before the first token, on another worker, with backoff.
                    last = attempt + 1 == self.settings.max_attempts
                    backoff = self.settings.retry_backoff_s * 2**attempt * random.uniform(0.5, 1.5)
                    if (
                        e.code != grpc.StatusCode.UNAVAILABLE
                        or delivered
                        or last
                        or time.monotonic() + backoff >= deadline
                    ):
                        raise
                    logger.info("request %s: %s; retrying elsewhere (attempt %d)", rid, e, attempt + 2)
                    if e.endpoint:
                        failed.add(e.endpoint)
                    m.labels(m.retries).inc()
                    await asyncio.sleep(backoff)
        finally:
            if inp.prefilled is not None:
                inp.prefilled.set()
            m.labels(m.requests, finish).inc()

    async def _shared_blocks(self, hashes: list[bytes]) -> int:
        """Leading prompt blocks the shared KV tier holds for the workers' model (0 if unknown)."""
        if self.kv_redis is None or not hashes:
            return 0
        compat = self._infos()[0].compat_hash
        try:
            pipe = self.kv_redis.pipeline(transaction=False)
            for h in hashes:
                pipe.exists(redis_key(compat, h))
            found = await pipe.execute()
        except Exception:  # noqa: BLE001 - routing without it is still correct
            return 0
        run = 0
        while run < len(found) and found[run]:
            run += 1
        return run

    async def _attempt(self, rid, inp: GenerateInput, hashes, start, deadline, failed: set[str]):
        """One try on one route; updates the workers' circuit breakers."""
        prompt = inp.prompt_token_ids
        shared = await self._shared_blocks(hashes)
        route = choose(
            self.pool,
            self.settings.routing,
            inp.mode,
            hashes,
            len(prompt),
            self.block_size,
            exclude=failed,
            shared_blocks=shared,
        )
        m = self.metrics
        itl = m.labels(m.itl)  # observed every token: its labels looked up once
        first_token_time = last_token_time = None
        usage = Usage(prompt_tokens=len(prompt))
        timings = Timings(queue=inp.queued)
        route.decode.in_flight += 1
        try:
            async for delta in self._run(rid, inp, route, hashes, deadline, usage, timings):
                if delta.error:  # a worker could not go on (a constraint failed at run time)
                    raise InvalidArgument(delta.error)
                if inp.prefilled is not None:  # the prompt's KV is in a worker's prefix cache now
                    inp.prefilled.set()
                now = time.monotonic()
                if delta.token_ids:
                    if first_token_time is None:
                        first_token_time = now
                    elif last_token_time is not None:
                        gap = (now - last_token_time) / len(delta.token_ids)
                        for _ in delta.token_ids:
                            itl.observe(gap)
                    last_token_time = now
                if delta.finish_reason is not None:
                    timings.queue += inp.queued
                    timings.ttft = (first_token_time or now) - start
                    timings.e2e = now - start
                    delta.usage, delta.timings = usage, timings
                    delta.disaggregated = route.prefill is not None
                    m.labels(m.kv_transfer_bytes, "routed").inc(usage.kv_transfer_bytes)
                    m.labels(m.prompt_tokens).inc(usage.prompt_tokens)
                    m.labels(m.generation_tokens).inc(usage.completion_tokens)
                    m.labels(m.cached_tokens).inc(usage.cached_tokens)
                    m.observe_request(timings.ttft, timings.e2e, None)
                    for w in (route.decode, route.prefill):
                        if w is not None:
                            w.breaker.success()
                yield delta
        except ServiceError as e:
            for w in (route.decode, route.prefill):
                if w is not None and w.endpoint == e.endpoint and e.code in WORKER_FAULTS:
                    w.breaker.failure()
            raise
        finally:
            route.decode.in_flight -= 1

    async def _run(
        self, rid, inp: GenerateInput, route: Route, hashes, deadline, usage: Usage, timings: Timings
    ):
        prompt = inp.prompt_token_ids
        if route.prefill is not None:
            async with contextlib.AsyncExitStack() as pinned:
                # The prompt's blocks, held in the router's budget while the worker pins them.
                blocks = -(-len(prompt) // self.block_size)
                timeout = min(self.settings.queue_timeout_s, max(deadline - time.monotonic(), 0.001))
                await pinned.enter_async_context(self.pins.hold(inp.client, blocks, timeout))
                async for delta in self._handed_over(
                    rid, inp, route, hashes, deadline, usage, timings, pinned
                ):
                    yield delta
        else:
            decode_req = self._decode_request(rid, inp)
            w, waiting = route.decode, len(prompt)  # until the first token: the prompt's prefill
            w.prompt_tokens_in_flight += waiting
            try:
                async for delta in self._decode(
                    w, decode_req, deadline, usage, timings, prefilled=False, client=inp.client
                ):
                    if waiting and delta.token_ids:
                        w.prompt_tokens_in_flight -= waiting
                        waiting = 0
                    yield delta
            finally:
                w.prompt_tokens_in_flight -= waiting
        route.decode.prefix.add(hashes)

    def _decode_request(self, rid: str, inp: GenerateInput) -> wpb.DecodeRequest:
        return wpb.DecodeRequest(
            request_id=rid,
            prompt_token_ids=inp.prompt_token_ids,
            sampling=convert.sampling_to_proto(inp.params),
            kv_failure_policy=api_proto.KV_FAILURE_POLICY_TO_PROTO[inp.kv_failure_policy],
            client=inp.client,
        )

    async def _handed_over(
        self, rid, inp: GenerateInput, route: Route, hashes, deadline, usage, timings, pinned
    ):
        """A disaggregated generation: the prefill, the first token, the decode taking the KV over;
        `pinned` (the prompt's blocks in the router's budget) is closed once the decode side has
        the KV, or the prefill ended the request."""
        prompt = inp.prompt_token_ids
        decode_req = self._decode_request(rid, inp)
        p = route.prefill
        t0 = time.monotonic()
        p.in_flight += 1
        p.prompt_tokens_in_flight += len(prompt)
        try:
            resp = await p.worker.Prefill(
                wpb.PrefillRequest(
                    request_id=rid,
                    prompt_token_ids=prompt,
                    sampling=decode_req.sampling,
                    lease_ms=self.settings.lease_ms,
                    client=inp.client,
                ),
                timeout=max(deadline - time.monotonic(), 0.001),
            )
        except grpc.aio.AioRpcError as e:
            raise self._check_rpc_error(p, e) from None
        finally:
            p.in_flight -= 1
            p.prompt_tokens_in_flight -= len(prompt)
        timings.prefill = time.monotonic() - t0
        p.prefix.add(hashes)
        first = await self._delta(inp.client, resp.output)
        usage.cached_tokens = resp.output.usage.cached_tokens
        usage.completion_tokens = len(first.token_ids)
        if not resp.HasField("kv_handle"):  # finished at its first token
            await pinned.aclose()
            yield first
            return
        # The decode worker releases the producer once it holds the KV, and on its own
        # failures; until its stream has said something we cannot know it got the request
        # (a cancel right after the first token may stop the call before it left), so then
        # we release. A second release of the same transfer is answered NOT_FOUND, harmlessly.
        decode_answered = False
        try:
            yield first  # the first token reaches the client before the KV moves
            decode_req.kv_handle.CopyFrom(resp.kv_handle)
            token = self.pool.security.token if self.pool.security is not None else None
            if token:
                decode_req.kv_handle_mac = handle_mac(token, resp.kv_handle)
            decode_req.output_token_ids.extend(first.token_ids)
            decode_req.sampler_state = resp.sampler_state
            async for delta in self._decode(
                route.decode, decode_req, deadline, usage, timings, prefilled=True, client=inp.client
            ):
                if not decode_answered:  # it holds the KV: the producer's pins are released
                    decode_answered = True
                    await pinned.aclose()
                yield delta
        finally:
            if not decode_answered:
                self._background(self._release(p, resp.kv_handle))

    async def _decode(
        self,
        w: WorkerHandle,
        req: wpb.DecodeRequest,
        deadline,
        usage: Usage,
        timings: Timings,
        prefilled: bool,
        client: str = "",
    ):
        try:
            joined = await w.subscription.join(req.request_id)
        except grpc.aio.AioRpcError as e:
            raise self._check_rpc_error(w, e) from None
        timeout = max(deadline - time.monotonic(), 0.001)
        if joined is None:  # a worker without subscriptions: the messages come on the call
            messages = self._streamed(w, req, timeout)
        else:
            req.subscription_id, queue = joined
            messages = self._subscribed(w, req, timeout, queue)
        if self.settings.stream_interval > 1:
            messages = self._gathered(messages, first_at_once=not prefilled)
        async for msg in messages:
            if prefilled:
                msg.ClearField("prompt_logprobs")  # the prefill rank sent them
            delta = await self._delta(client, msg)
            if msg.HasField("usage"):
                usage.completion_tokens = msg.usage.completion_tokens
                usage.kv_transfer_bytes = msg.usage.kv_transfer_bytes
                if not prefilled:
                    usage.cached_tokens = msg.usage.cached_tokens
                timings.kv_transfer = msg.timings.kv_transfer_ns / 1e9
                timings.queue = msg.timings.queue_ns / 1e9
                delta.usage = delta.timings = None
            yield delta

    async def _delta(self, client: str, msg) -> Delta:
        """A worker's message as a Delta; one carrying a prompt's logprobs (thousands of entries,
        tens of milliseconds) is converted off the event loop, in the client's turn."""
        if len(msg.prompt_logprobs):
            return await self.prepare(client, api_proto.delta_from_proto, msg)
        return api_proto.delta_from_proto(msg)

    async def _gathered(self, messages, first_at_once: bool):
        """The messages merged into runs of at least stream_interval tokens; the first at once
        when first_at_once (a colocated request's first token), the request's last at once."""
        interval, held = self.settings.stream_interval, None
        async for msg in messages:
            if held is not None:
                convert.merge(held, msg)
                msg, held = held, None
            if len(msg.token_ids) < interval and not msg.HasField("usage") and not first_at_once:
                held = msg
                continue
            first_at_once = False
            yield msg
        if held is not None:  # a stream that ended without its last message
            yield held

    async def _streamed(self, w: WorkerHandle, req: wpb.DecodeRequest, timeout: float):
        call = w.worker.Decode(req, timeout=timeout)
        try:
            async for msg in call:
                yield msg
        except grpc.aio.AioRpcError as e:
            raise self._check_rpc_error(w, e) from None
        finally:
            call.cancel()  # no-op when finished; otherwise the worker aborts the request

    async def _subscribed(
        self, w: WorkerHandle, req: wpb.DecodeRequest, timeout: float, queue: asyncio.Queue
    ):
        """The call's messages from the worker's subscription (services/router/subscription.py);
        the call itself only ends, and its error, if any, joins the queue."""
        call = w.worker.Decode(req, timeout=timeout)

        async def watch() -> None:
            try:
                async for _ in call:
                    pass
            except grpc.aio.AioRpcError as e:
                queue.put_nowait(e)

        watcher = asyncio.ensure_future(watch())
        try:
            while True:
                items = [await queue.get()]
                while not queue.empty():  # steps that came while we were busy go out as one
                    items.append(queue.get_nowait())
                msg = None
                for item in items:
                    if isinstance(item, BaseException):
                        if msg is not None:
                            yield msg  # the tokens before the error
                        if isinstance(item, grpc.aio.AioRpcError):
                            raise self._check_rpc_error(w, item) from None
                        raise item
                    if msg is None:
                        msg = item
                    else:
                        convert.merge(msg, item)
                    if msg.HasField("usage"):
                        break
                yield msg
                if msg.HasField("usage"):  # the request's last message
                    return
        finally:
            call.cancel()  # no-op when finished; otherwise the worker aborts the request
            watcher.cancel()
            w.subscription.leave(req.request_id)
