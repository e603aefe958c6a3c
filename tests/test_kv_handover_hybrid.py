"""A hybrid request's KV crossing engines, exact: two engines' KV halves (each its own KV cache
manager, scheduler, caches, state pool and KVHandover) on the full + sliding-window + compressed +
state spec of tests/test_kv_manager_hybrid.py, the producer's export served by the real
KvTransferService over gRPC, the consumer's import pulled by services/kv_transfer/consumer.py, or
read by a real NIXL agent (the state then pulled alone).

No model runs: a "step" writes, at every table's slot mapping, entries that are a function of the
token, its position and the cache, and the state as a function of the history, so every byte the
consumer ends with can be checked against what the producer computed. What must hold:
- the producer's export pins, of the window table, only the blocks the next token reads; the
  rest of its window blocks are back in the pool when the prefill ends;
- the consumer gets exactly those window blocks (null entries before them), every block of the
  full and compressed tables after its own prefix hit, and the state after the prompt;
- both sides free every table's blocks and the state slots exactly once, whatever the end.
"""

from __future__ import annotations

import asyncio
import threading

import grpc
import pytest
import torch

from engine.kv_cache import nixl
from engine.kv_cache.codec import Slab, crc32
from engine.kv_cache.export import ExportOptions, ExportTable
from engine.kv_cache.transfer import KVPort
from engine.kv_handover import KVHandover
from engine.request import Request, RequestStatus
from engine.scheduler import Scheduler
from pdserve.v1 import kv_transfer_pb2 as kv_pb
from pdserve.v1 import kv_transfer_pb2_grpc as kv_grpc
from services.common.errors import DataLoss
from services.common.grpc_utils import new_server
from services.common.metrics import Metrics
from services.kv_transfer import consumer
from services.kv_transfer.producer import KvTransferService
from services.kv_transfer.wire import check_chunk, make_state_chunk
from tests.test_kv_manager_hybrid import BS, SPEC, W, make_req, manager

PROMPT = [(i * 37) % 500 + 1 for i in range(45)]  # 12 blocks, the last partial
FIRST_TOKEN = 777
STATE_BYTES = SPEC.states[0].slot_bytes


class Unconstrained:
    """The structured-output manager's admit for requests without a grammar."""

    def admit(self, req: Request, enqueue) -> None:
        enqueue(req)


class Side:
    """One engine's KV half, stepped without a model."""

    def __init__(self, full: int = 64, window: int = 16):
        self.kv = manager(full, window)
        self.caches = SPEC.allocate((full, window, full), "cpu")
        self.port = KVPort(SPEC, self.caches, self.kv.states)
        self.sched = Scheduler(self.kv, max_num_seqs=4, max_num_batched_tokens=8)
        self.handover = KVHandover(self.sched, self.port, Unconstrained(), ExportTable())

    def compute(self, req: Request, positions: range) -> None:
        """What the runner writes for these positions: each table's entries at its slot mapping."""
        for t, table in enumerate(SPEC.tables):
            slots = self.kv.slot_mapping(req, t, positions)
            for pos, slot in zip(positions, slots, strict=True):
                if slot < 0:
                    continue
                for g in table.groups:
                    for i, layer in enumerate(g.layers):
                        cache = self.caches.layer(g.kind, layer).view(-1, g.storage_width)
                        cache[slot] = entry(req.token_ids[pos], pos, t, i)
        req.num_computed_tokens = positions.stop
        n = req.num_computed_tokens
        self.kv.states.state(req.request_id, "compressor").fill_(float(sum(req.token_ids[:n]) + n))
        self.kv.snapshot_state(req)

    def step(self, on_sample=None) -> None:
        for item in self.sched.schedule().scheduled:
            req = item.request
            self.compute(req, range(item.num_computed_tokens, item.num_computed_tokens + item.num_new_tokens))
            if item.samples:
                if on_sample is not None:
                    on_sample(req)
                else:
                    req.append_token((sum(req.token_ids[-3:]) * 7) % 1000)
                    if req.num_output_tokens >= req.params.max_tokens:
                        self.sched.finish(req, RequestStatus.FINISHED_LENGTH)

    def entries(self, req_tables: list[list[int]], t: int, blocks: range) -> list[torch.Tensor]:
        """Every layer's rows of table t's blocks `blocks` (of a request's block tables)."""
        ids = [req_tables[t][b] for b in blocks]
        out = []
        for g in SPEC.tables[t].groups:
            rows = SPEC.group_block_ids(g, ids)
            out += [self.caches.layer(g.kind, layer)[rows].clone() for layer in g.layers]
        return out

    def all_free(self) -> bool:
        return self.kv.num_free_blocks == self.kv.num_blocks and self.kv.states.num_free_slots == 4


def entry(token: int, pos: int, table: int, layer: int) -> torch.Tensor:
    return torch.arange(8, dtype=torch.float32) + token * 1000 + pos + table * 0.25 + layer * 0.125


def prefill_and_export(producer: Side):
    """Run a prefill-only request to its first token: -> (its export, the producer's state after the prompt)."""
    req = make_req("p", PROMPT, max_tokens=8)
    req.kv_export = ExportOptions()
    producer.sched.add(req)
    exported = []

    def on_sample(r: Request) -> None:
        r.append_token(FIRST_TOKEN)
        exported.append(producer.handover.export(r))

    while not exported:
        producer.step(on_sample)
    export = exported[0]
    return export, export.states[0].clone()


def serve(producer: Side):
    """The producer's KvTransferService on a loopback port -> (server, address)."""
    service = KvTransferService(
        producer.handover.exports, kv_pb.KvProducer(engine_id="p", epoch=1), Metrics("prefill")
    )
    service.engine_ready(producer.port)
    server = new_server()
    kv_grpc.add_KvTransferServicer_to_server(service, server)
    port = server.add_insecure_port("127.0.0.1:0")
    return server, f"127.0.0.1:{port}"


def handle_of(export, endpoint: str) -> kv_pb.KvHandle:
    return kv_pb.KvHandle(
        transfer_id=export.export_id,
        producer=kv_pb.KvProducer(engine_id="p", epoch=1, endpoint=endpoint),
        num_tokens=export.num_tokens,
        num_blocks=export.num_blocks,
        block_size=BS,
    )


async def pull_into(producer: Side, sink, handle_export, first_block: int, max_chunk_bytes: int) -> int:
    server, endpoint = serve(producer)
    await server.start()
    try:
        async with grpc.aio.insecure_channel(endpoint) as channel:
            return await consumer.pull(
                kv_grpc.KvTransferStub(channel),
                handle_of(handle_export, endpoint),
                sink,
                first_block,
                max_chunk_bytes,
                timeout=30,
            )
    finally:
        await server.stop(0)


def begin_import(side: Side, rid: str = "c") -> tuple[Request, int | None]:
    req = make_req(rid, PROMPT, max_tokens=8)
    req.append_token(FIRST_TOKEN)
    side.handover.begin_import(req)
    return req, side.handover.allocate_import(rid)


def test_the_export_pins_only_the_window_the_next_token_reads():
    producer = Side()
    export, _ = prefill_and_export(producer)
    live = SPEC.tables[1].first_needed(len(PROMPT), BS)
    assert live == (len(PROMPT) - (W - 1)) // BS == 9
    assert export.num_blocks == 12 and [len(t) for t in export.tables] == [12, 12, 12]
    assert export.tables[1][:live] == [0] * live and 0 not in export.tables[1][live:]
    assert producer.kv.num_held(export.request) == [12, 12 - live, 12]
    assert producer.kv.pools[1].num_free_blocks == producer.kv.pools[1].num_usable_blocks - (12 - live)
    assert len(export.pinned()) == 12 + (12 - live) + 12
    assert SPEC.transfer_ranges(len(PROMPT)) == ((0, 12), (live, 12), (0, 12))
    # Ended: every table's blocks and the state slot go back, once.
    producer.handover.exports.release(export.export_id, done=True)
    producer.handover.free_ended_exports()
    assert producer.all_free()


@pytest.mark.parametrize("max_chunk_bytes", [200, 1 << 30], ids=["one-block-chunks", "one-chunk-per-group"])
def test_a_hybrid_prompt_moves_every_table_and_the_state(max_chunk_bytes):
    producer, receiver = Side(), Side(window=8)
    export, state = prefill_and_export(producer)
    req, first_block = begin_import(receiver)
    assert first_block == 0
    live = SPEC.tables[1].first_needed(len(PROMPT), BS)
    # The consumer's window table holds only the blocks the next token reads: O(window), not O(prompt).
    assert receiver.kv.num_held(req) == [12, 12 - live, 12]
    sink = receiver.handover.import_sink("c")

    received = asyncio.run(pull_into(producer, sink, export, first_block, max_chunk_bytes))

    per_block = [SPEC.table_bytes_per_block(t) for t in SPEC.tables]
    assert received == 12 * per_block[0] + (12 - live) * per_block[1] + 12 * per_block[2] + STATE_BYTES
    for t, (start, end) in enumerate(SPEC.transfer_ranges(len(PROMPT))):
        got = receiver.entries(req.block_ids, t, range(start, end))
        want = producer.entries(export.tables, t, range(start, end))
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), t
    receiver.handover.finish_import("c")
    assert torch.equal(receiver.kv.states.state("c", "compressor"), state)

    # It decodes on from there (the window slides, blocks behind it go back) and ends freeing all.
    while receiver.sched.num_unfinished:
        receiver.step()
        assert receiver.kv.num_held(req)[1] <= -(-(W - 1) // BS) + 2
    assert receiver.all_free()
    producer.handover.exports.release(export.export_id, done=True)
    producer.handover.free_ended_exports()
    assert producer.all_free()


def test_after_a_prefix_hit_only_the_rest_moves():
    """The consumer computed the prompt's first blocks before (a prefix hit with its window blocks
    and a state snapshot): the transfer starts there, the window's from where its token reads."""
    producer, receiver = Side(), Side(window=16)
    warm = make_req("warm", PROMPT[:29], max_tokens=1)
    receiver.sched.add(warm)
    while receiver.sched.num_unfinished:
        receiver.step()
    export, state = prefill_and_export(producer)
    req, first_block = begin_import(receiver)
    assert first_block == 7  # 28 tokens: 7 full blocks, each with its state snapshot
    sink = receiver.handover.import_sink("c")
    received = asyncio.run(pull_into(producer, sink, export, first_block, 1 << 30))
    ranges = SPEC.transfer_ranges(len(PROMPT), first_block)
    assert ranges == ((7, 12), (9, 12), (7, 12))
    per_block = [SPEC.table_bytes_per_block(t) for t in SPEC.tables]
    assert received == 5 * per_block[0] + 3 * per_block[1] + 5 * per_block[2] + STATE_BYTES
    for t, (_, end) in enumerate(ranges):
        start = SPEC.tables[t].first_needed(len(PROMPT), BS)  # the hit's blocks and the pulled ones
        got = receiver.entries(req.block_ids, t, range(start, end))
        want = producer.entries(export.tables, t, range(start, end))
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), t
    receiver.handover.finish_import("c")
    assert torch.equal(receiver.kv.states.state("c", "compressor"), state)
    receiver.sched.finish(req, RequestStatus.FINISHED_ABORTED)
    assert receiver.all_free()


def test_an_import_aborted_or_recomputed_frees_every_table_once():
    receiver = Side()
    req, _ = begin_import(receiver, "a")
    # The scheduler holds it, counted among the waiting; no step moves it (its transfer does).
    assert receiver.sched.importing == {"a": req} and req.status is RequestStatus.LOADING_REMOTE_KV
    assert receiver.sched.num_waiting == 1 and receiver.sched.num_unfinished == 0
    assert receiver.kv.num_free_blocks < receiver.kv.num_blocks
    assert receiver.handover.abort_import("a") is False  # nothing in flight: the caller frees
    receiver.sched.finish(req, RequestStatus.FINISHED_ABORTED)  # what EngineCore.abort_request does
    assert receiver.all_free() and not receiver.sched.importing and receiver.sched.num_waiting == 0

    req, _ = begin_import(receiver, "b")
    receiver.handover.recompute_import("b")  # computed here instead, through the scheduler
    while receiver.sched.num_unfinished:
        receiver.step()
    assert receiver.all_free()


def test_a_state_chunk_is_checked_against_the_spec():
    data = bytes(STATE_BYTES)
    chunk = make_state_chunk(SPEC, 0, data)
    ranges = SPEC.transfer_ranges(len(PROMPT))
    assert check_chunk(SPEC, kv_pb.KvChunk.FromString(chunk.SerializeToString()), ranges) == 0
    for mutate, message in [
        (lambda c: setattr(c, "data", data[:-4]), "checksum"),
        (lambda c: setattr(c, "state", 1), "outside the spec's 1 states"),
        (lambda c: c.shape.__setitem__(0, 2), "shape"),
        (lambda c: setattr(c, "dtype", kv_pb.KV_DTYPE_BFLOAT16), "dtype"),
    ]:
        bad = kv_pb.KvChunk.FromString(chunk.SerializeToString())
        mutate(bad)
        with pytest.raises(DataLoss, match=message):
            check_chunk(SPEC, bad, ranges)


def test_a_window_slab_before_what_the_next_token_reads_is_refused():
    receiver = Side()
    begin_import(receiver)
    sink = receiver.handover.import_sink("c")
    window_slot = SPEC.slot_start(SPEC.tables[1].groups[0])
    behind = Slab(window_slot, 1, 8, 1)  # block 8 fell behind the window of token 45
    with pytest.raises(ValueError, match=r"outside \[9, 12\) of block table 1"):
        sink.write(behind, bytes(SPEC.layer_bytes_per_block(SPEC.tables[1].groups[0])))
    with pytest.raises(DataLoss, match=r"outside \[9, 12\)"):
        chunk = kv_pb.KvChunk(
            layer_start=window_slot,
            num_layers=1,
            block_start=8,
            num_blocks=1,
            dtype=kv_pb.KV_DTYPE_FLOAT32,
            shape=[1, 1, BS, 8],
            data=bytes(BS * 8 * 4),
        )
        chunk.crc32 = crc32(chunk.data)
        check_chunk(SPEC, chunk, SPEC.transfer_ranges(len(PROMPT)))


@pytest.fixture(scope="module")
def nixl_sides():
    """A producer and a receiver with NIXL agents over their caches (the hybrid spec's tables of
    different block counts), the receiver knowing the producer's agent."""
    producer, receiver = Side(), Side(window=8)
    agents = (
        nixl.NixlAgent("hybrid-producer", producer.port),
        nixl.NixlAgent("hybrid-receiver", receiver.port),
    )
    peer = agents[1].add_peer(
        agents[0].name,
        agents[0].metadata,
        list(agents[0].regions),
        agents[0].table_blocks,
        agents[0].mem_type,
    )
    assert peer.table_blocks == (64, 16, 64)
    yield producer, receiver, agents[1], peer
    for agent in agents:
        agent.close()


def test_a_nixl_read_moves_every_table_in_read_order_and_the_state_is_pulled(nixl_sides):
    producer, receiver, agent, peer = nixl_sides
    export, state = prefill_and_export(producer)
    req, first_block = begin_import(receiver, "n")
    sink = receiver.handover.import_sink("n")
    remote = producer.port.exported_blocks(export, first_block)
    digests = producer.port.checksum_exported(export, first_block)
    ranges = SPEC.transfer_ranges(len(PROMPT), first_block)
    assert len(remote) == len(digests) == sum(end - start for start, end in ranges) == 12 + 3 + 12
    n = agent.read(peer, sink, first_block, remote, 30.0, threading.Event(), digests)
    per_block = [SPEC.table_bytes_per_block(t) for t in SPEC.tables]
    assert n == 12 * per_block[0] + 3 * per_block[1] + 12 * per_block[2]
    for t, (start, end) in enumerate(ranges):
        got = receiver.entries(req.block_ids, t, range(start, end))
        want = producer.entries(export.tables, t, range(start, end))
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), t
    # The state is not in the registered caches: a pull from block num_blocks on brings it alone.
    assert asyncio.run(pull_into(producer, sink, export, export.num_blocks, 1 << 30)) == STATE_BYTES
    receiver.handover.finish_import("n")
    assert torch.equal(receiver.kv.states.state("n", "compressor"), state)
    receiver.sched.finish(req, RequestStatus.FINISHED_ABORTED)
    producer.handover.exports.release(export.export_id, done=True)
    producer.handover.free_ended_exports()
    assert receiver.all_free() and producer.all_free()


def test_a_nixl_read_names_the_table_of_a_block_that_fails_its_checksum(nixl_sides):
    producer, receiver, agent, peer = nixl_sides
    export, _ = prefill_and_export(producer)
    digests = producer.port.checksum_exported(export)
    window = SPEC.tables[1].groups[0]
    producer.caches.layer(window.kind, window.layers[0])[export.tables[1][10]] += 1  # after the checksums
    req, _ = begin_import(receiver, "bad")
    sink = receiver.handover.import_sink("bad")
    with pytest.raises(nixl.ChecksumMismatch, match="KV block 10 of table 1"):
        agent.read(peer, sink, 0, producer.port.exported_blocks(export), 30.0, threading.Event(), digests)
    assert receiver.handover.abort_import("bad") is False
    receiver.sched.finish(req, RequestStatus.FINISHED_ABORTED)
    producer.handover.exports.release(export.export_id, done=False)
    producer.handover.free_ended_exports()
    assert receiver.all_free() and producer.all_free()
