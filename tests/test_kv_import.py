"""services/worker/kv_import.py: a handover's import reaches the engine thread as few times as it
can. Each trip waits for the step under way to end, and all of them fall in the stream's pause
between its first token (the prefill worker's) and its second (the decode worker's)."""

from __future__ import annotations

import asyncio

from engine.kv_cache.hashing import hash_blocks
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from pdserve.v1 import kv_transfer_pb2 as kv_pb
from pdserve.v1 import worker_pb2 as wpb
from services.common.metrics import Metrics
from services.kv_transfer import nixl_pull
from services.worker.async_engine import AsyncEngine
from services.worker.kv_import import KvImporter
from services.worker.settings import WorkerSettings

BLOCK = 4
PROMPT = list(range(10, 20))  # 3 blocks
FULL_STEPS = 2
"""Steps the fake cache has no room for the import."""


class _Spec:
    block_size = BLOCK

    @staticmethod
    def compat_hash() -> str:
        return "compat"


class _Core:
    """Logs, in order, what the engine thread runs: the import's calls and the steps between
    them. Another request keeps it stepping; the import's allocation finds no room for
    FULL_STEPS steps."""

    group = None

    def __init__(self) -> None:
        self.log: list[str] = []
        self.refusals = FULL_STEPS
        self.handover = self  # the import's calls past begin_import: KVHandover's

    def has_unfinished_requests(self) -> bool:
        return True

    def publish_stats(self) -> None:
        pass

    def step(self) -> list[RequestOutput]:
        if self.log and self.log[-1] != "step":
            self.log.append("step")
        return []

    def begin_import(self, rid, prompt, outputs, params, state) -> None:
        assert (rid, prompt, outputs, state) == ("r", PROMPT, [7], None)
        self.log.append("begin")

    def allocate_import(self, rid) -> int | None:
        self.log.append("allocate")
        if self.refusals:
            self.refusals -= 1
            return None
        return 1  # the first block is a prefix-cache hit

    def import_sink(self, rid) -> str:
        return "sink"

    def finish_import(self, rid) -> None:
        self.log.append("finish")


def test_begin_and_allocation_are_one_trip_and_only_the_allocation_waits_for_room(monkeypatch):
    pulled = []

    async def pull(transports, peer, handle, sink, first_block, timeout, verify, timings):
        pulled.append((sink, first_block))
        return 1234

    monkeypatch.setattr(nixl_pull, "pull", pull)

    class Transports:
        async def choose(self, producer, timeout):
            return "peer"

    handle = kv_pb.KvHandle(
        transfer_id="t",
        compat_hash="compat",
        block_size=BLOCK,
        num_tokens=len(PROMPT),
        num_blocks=3,
        block_hashes=hash_blocks(PROMPT, BLOCK),
    )
    request = wpb.DecodeRequest(kv_handle=handle, output_token_ids=[7])

    async def scenario():
        engine = AsyncEngine(_Core)
        engine.start()
        core = await engine.wait_ready()
        importer = KvImporter(
            WorkerSettings(role="decode", model_name="m"),
            engine,
            Metrics("decode"),
            peers=None,
            transports=Transports(),
            background=lambda coro: coro.close(),
        )
        importer.engine_ready(_Spec())
        try:
            result = await asyncio.wait_for(
                importer.run("r", "r", request, PROMPT, SamplingParams(max_tokens=8), None), 30
            )
        finally:
            engine.stop()
        return result, core.log

    (received, _, was_pulled), log = asyncio.run(scenario())
    assert (received, was_pulled, pulled) == (1234, True, [("sink", 1)])
    # begin and the first allocation in one trip; then one more allocation after each step
    # until there is room; begin never again; the import joins once the pull is done
    assert log[: 2 + 2 * FULL_STEPS] == ["begin", "allocate"] + ["step", "allocate"] * FULL_STEPS
    assert (log.count("begin"), log.count("allocate"), log.count("finish")) == (1, FULL_STEPS + 1, 1)
