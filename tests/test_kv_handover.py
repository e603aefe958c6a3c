"""Disaggregated prefill inside one process: a producer EngineCore prefills with kv_export=True,
its prompt KV is moved block by block (KV port -> import sink, what a KvTransfer pull
does) into a consumer EngineCore that continues the request (STYLE 9: disaggregated gives the
same tokens as colocated).

Exact throughout: block ids, prefix-cache hits and free-block counts are asserted. Every test
starts from pristine engines (no requests, nothing cached, free queue in id order) whose KV caches
are filled with noise, so a block that should have been written and was not shows up as wrong
tokens rather than as stale-but-right values.

The transfer runs both ways a worker moves KV (`TRANSPORTS`): slabs read through the producer's
KV port and written through the consumer's import sink (what the gRPC chunk stream does), and a
NIXL READ of the producer's registered blocks straight into the sink's (engine/kv_cache/nixl.py,
with the producer's checksums verified).

Legend: BS tokens per block; `n` a prompt's block count; `hits` leading prompt blocks the
consumer already had in its prefix cache (not transferred).
"""

from __future__ import annotations

import dataclasses
import random
import threading
import time
from collections import OrderedDict
from types import SimpleNamespace

import pytest
import torch

from engine.config import EngineConfig
from engine.engine_core import EngineCore
from engine.kv_cache import nixl
from engine.kv_cache.codec import Slab, read_slab
from engine.kv_cache.export import ExportOptions
from engine.kv_cache.hashing import hash_blocks
from engine.kv_cache.transfer import ImportClosed
from engine.outputs import RequestOutput
from engine.request import Request
from engine.sampling_params import SamplingParams
from tests.engine_testing import run_finished

BS = 4
NUM_BLOCKS = 64
VOCAB = 4096  # the tiny preset's
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=2)
SEEDED = SamplingParams(temperature=0.8, seed=7, max_tokens=10, ignore_eos=True, logprobs=2)
PARAMS = {"greedy": GREEDY, "seeded": SEEDED}
# Shorter than a block, an exact block multiple, a multiple plus a partial block.
PROMPT_LENS = {"prompt3-short": 3, "prompt8-exact": 8, "prompt13-partial": 13}
TRANSPORTS = ["slabs", "nixl"]


def _core(model: str, **kw) -> EngineCore:
    cfg = EngineConfig(
        model=model, dtype="float32", block_size=BS, num_kv_blocks=NUM_BLOCKS, num_threads=1, **kw
    )
    return EngineCore(cfg)


def _reset(core: EngineCore, noise_seed: int) -> None:
    """Back to a pristine engine: no requests, no exports, empty prefix cache, free queue in id
    order (so block ids are predictable) and noise in every KV block."""
    for rid in list(core.requests):
        core.abort_request(rid)
    core.handover.exports.abort_all()
    core.handover.free_ended_exports()
    assert not core.scheduler.importing and not core.has_unfinished_requests()
    pool = core.kv.pools[0]
    assert pool.num_free_blocks == pool.num_blocks, "a test leaked blocks"
    pool.reset_prefix_cache()
    assert pool.cached == {}
    pool.free_queue = OrderedDict((i, None) for i in range(pool.num_blocks))
    gen = torch.Generator().manual_seed(noise_seed)
    for cache in core.runner.kv_caches:  # [num_blocks, BS, width]
        cache.copy_(torch.randn(cache.shape, generator=gen) * 3)


@pytest.fixture(scope="module")
def engines(tiny_model):
    producer, consumer = _core(tiny_model), _core(tiny_model)
    producer_agent = nixl.NixlAgent("handover-producer", producer.kv_port)
    consumer_agent = nixl.NixlAgent("handover-consumer", consumer.kv_port)
    a = producer_agent
    yield SimpleNamespace(
        producer=producer,
        consumer=consumer,
        # The whole request, colocated; no prefix cache, so no state carries between tests.
        reference=_core(tiny_model, enable_prefix_caching=False),
        producer_agent=producer_agent,
        consumer_agent=consumer_agent,
        peer=consumer_agent.add_peer(a.name, a.metadata, list(a.regions), a.num_blocks, a.mem_type),
    )
    consumer_agent.close()
    producer_agent.close()


@pytest.fixture
def pd(engines):
    for seed, core in enumerate((engines.producer, engines.consumer, engines.reference)):
        _reset(core, noise_seed=seed)
    return engines


def _prompt(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed * 1000 + n)
    return [rng.randrange(5, 4000) for _ in range(n)]


def _whole(core: EngineCore, prompt: list[int], params: SamplingParams, rid: str = "whole") -> RequestOutput:
    core.add_request(rid, prompt, params)
    return run_finished(core)[rid]


def _export(producer: EngineCore, rid: str, prompt: list[int], params: SamplingParams) -> RequestOutput:
    producer.add_request(rid, prompt, params, kv_export=True)
    out = run_finished(producer)[rid]
    assert out.finish_reason == "exported"
    assert out.exported_kv is producer.handover.exports.find(rid)
    return out


def _num_layers(core: EngineCore) -> int:
    return core.model_cfg.num_hidden_layers


def _transfer(producer: EngineCore, consumer: EngineCore, kv, rid: str, first_block: int, end=None) -> None:
    """What a KvTransfer pull does: every layer of the producer's blocks [first_block, end), read
    through its KV port, written through the consumer's import sink at the same positions."""
    sink = consumer.handover.import_sink(rid)
    assert sink.num_blocks == len(kv.block_ids)
    end = sink.num_blocks if end is None else end
    if first_block < end:
        for group in producer.kv_spec.groups:
            slab = Slab(producer.kv_spec.slot_start(group), group.num_layers, first_block, end - first_block)
            sink.write(slab, producer.kv_port.read_exported(kv, slab))


def _nixl_transfer(pd, kv, rid: str, first_block: int) -> None:
    """What a NIXL pull does: the producer's checksums taken inside a read of the export (as its
    Prefill handler does before the handle goes out), the consumer READs the producer's blocks
    [first_block, end) into its sink's and verifies them."""
    export = pd.producer.handover.exports.begin_read(kv.export_id)
    digests = pd.producer.kv_port.checksum_exported(export, first_block)
    pd.producer.handover.exports.end_read(export)
    sink = pd.consumer.handover.import_sink(rid)
    pd.consumer_agent.read(
        pd.peer, sink, first_block, kv.block_ids[first_block:], 30.0, threading.Event(), digests
    )


def _move(pd, kv, rid: str, first_block: int, transport: str) -> None:
    if transport == "nixl":
        _nixl_transfer(pd, kv, rid, first_block)
    else:
        _transfer(pd.producer, pd.consumer, kv, rid, first_block)


def _hand_over(
    pd, rid: str, prompt: list[int], params: SamplingParams, transport: str = "slabs"
) -> tuple[RequestOutput, RequestOutput, int]:
    """Prefill on the producer, import on the consumer, run it there -> (first, final, hits)."""
    first = _export(pd.producer, rid, prompt, params)
    kv = first.exported_kv
    pd.consumer.begin_import(rid, prompt, first.token_ids, params, kv.generator_state)
    hits = pd.consumer.handover.allocate_import(rid)
    _move(pd, kv, rid, hits, transport)
    pd.consumer.handover.finish_import(rid)
    assert pd.producer.handover.release_export(rid)
    return first, run_finished(pd.consumer)[rid], hits


def _assert_same(first: RequestOutput, final: RequestOutput, ref: RequestOutput) -> None:
    """The handed-over request (first token on the producer, the rest on the consumer) equals
    the whole request: token ids and text exactly, logprobs within 1e-5."""
    assert final.token_ids == ref.token_ids
    assert final.text == ref.text
    assert final.finish_reason == ref.finish_reason
    logprobs = first.logprobs + final.logprobs
    assert len(logprobs) == len(ref.logprobs) == len(ref.token_ids)
    for i, (got, want) in enumerate(zip(logprobs, ref.logprobs, strict=True)):
        assert got.keys() == want.keys(), f"token {i}"
        for tok, lp in want.items():
            assert got[tok] == pytest.approx(lp, abs=1e-5), f"token {i}, id {tok}"


def _hit_ids(core: EngineCore, prompt: list[int]) -> list[int]:
    """Block ids a new request with this prompt would reuse from the prefix cache."""
    hits = core.kv.get_computed_blocks(Request("probe", list(prompt), SamplingParams())).blocks[0]
    return [b.block_id for b in hits]


# ---- handover equals the whole request ---------------------------------------------------------


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("mode", PARAMS)
@pytest.mark.parametrize("n", PROMPT_LENS.values(), ids=PROMPT_LENS.keys())
def test_handover_matches_whole_request(pd, n, mode, transport):
    params = PARAMS[mode]
    prompt = _prompt(n)
    ref = _whole(pd.reference, prompt, params)
    first, final, hits = _hand_over(pd, "r", prompt, params, transport)
    assert hits == 0
    assert first.token_ids == ref.token_ids[:1]
    _assert_same(first, final, ref)
    assert final.num_cached_tokens == 0
    # Everything went back; the imported full prompt blocks are now the consumer's prefix cache.
    assert pd.consumer.kv.num_free_blocks == NUM_BLOCKS
    assert pd.producer.kv.num_free_blocks == NUM_BLOCKS
    num_hits = (n - 1) // BS
    assert _hit_ids(pd.consumer, prompt) == list(range(num_hits))  # its blocks were 0..n-1


def test_seeded_handover_carries_the_generator_state(pd):
    prompt = _prompt(13)
    first = _export(pd.producer, "r", prompt, SEEDED)
    state = first.exported_kv.generator_state
    assert state.dtype == torch.uint8
    assert not torch.equal(state, torch.Generator().manual_seed(7).get_state())  # draws were made
    # Without the state the consumer restarts the seed's stream: a different continuation,
    # which is what makes the state handover in the test above necessary.
    pd.consumer.begin_import("r", prompt, first.token_ids, SEEDED, None)
    assert pd.consumer.handover.allocate_import("r") == 0
    _transfer(pd.producer, pd.consumer, first.exported_kv, "r", 0)
    pd.consumer.handover.finish_import("r")
    final = run_finished(pd.consumer)["r"]
    assert final.token_ids[0] == first.token_ids[0]
    assert final.token_ids != _whole(pd.reference, prompt, SEEDED).token_ids


def test_greedy_export_has_no_generator_state(pd):
    assert _export(pd.producer, "r", _prompt(13), GREEDY).exported_kv.generator_state is None


def test_handover_without_the_kv_write_goes_wrong(pd):
    """Control for the handover tests: the consumer really decodes from the written blocks (its
    cache holds noise), so skipping the write changes the tokens."""
    prompt = _prompt(13)
    first = _export(pd.producer, "r", prompt, GREEDY)
    pd.consumer.begin_import("r", prompt, first.token_ids, GREEDY)
    assert pd.consumer.handover.allocate_import("r") == 0
    pd.consumer.handover.finish_import("r")  # no _transfer
    final = run_finished(pd.consumer)["r"]
    assert final.token_ids != _whole(pd.reference, prompt, GREEDY).token_ids


# ---- producer: pinned blocks --------------------------------------------------------------------


def test_export_pins_blocks_until_release(pd):
    p = pd.producer
    bm = p.kv
    prompt = _prompt(13)
    out = _export(p, "x", prompt, GREEDY)
    kv = out.exported_kv
    assert kv.block_ids == [0, 1, 2, 3]
    assert kv.block_hashes == hash_blocks(prompt, BS) and len(kv.block_hashes) == 3
    assert kv.num_tokens == 13
    assert out.token_ids == _whole(pd.reference, prompt, GREEDY).token_ids[:1]
    assert len(p.handover.exports) == 1 and p.handover.exports.find("x") is kv
    assert "x" not in p.requests and not p.has_unfinished_requests()
    assert bm.num_free_blocks == NUM_BLOCKS - 4
    assert [bm.pools[0].blocks[b].ref_count for b in kv.block_ids] == [1, 1, 1, 1]
    assert p.abort_request("x") is None  # the request is over; only release_export unpins
    assert bm.num_free_blocks == NUM_BLOCKS - 4

    # Pinned blocks are never handed out: a request that needs every other block (238 + 2 tokens
    # = 60 blocks) runs without touching their contents.
    pinned = read_slab(p.kv_spec, p.runner.kv_caches, kv.block_ids, 0, _num_layers(p))
    filler = _whole(p, _prompt(238, seed=1), SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    assert filler.metrics.num_preemptions == 0
    assert read_slab(p.kv_spec, p.runner.kv_caches, kv.block_ids, 0, _num_layers(p)) == pinned
    assert bm.num_free_blocks == NUM_BLOCKS - 4

    assert p.handover.release_export("x") is True
    assert bm.num_free_blocks == NUM_BLOCKS
    assert len(p.handover.exports) == 0
    assert p.handover.release_export("x") is False
    assert p.handover.release_export("never-exported") is False
    # Released, still cached: the 3 full prompt blocks are hits (a hit never covers the last token).
    assert _hit_ids(p, prompt) == [0, 1, 2]
    again = _whole(p, prompt, GREEDY, rid="again")
    assert again.num_cached_tokens == 12
    assert again.token_ids == _whole(pd.reference, prompt, GREEDY).token_ids


def test_export_of_a_cached_prefix_shares_its_blocks(pd):
    p = pd.producer
    bm = p.kv
    prompt = _prompt(13)
    _whole(p, prompt, GREEDY)  # 23 tokens in blocks 0..5, freed tail first
    assert list(bm.pools[0].free_queue)[-6:] == [5, 4, 3, 2, 1, 0]
    x = _export(p, "x", prompt, GREEDY)
    assert x.num_cached_tokens == 12
    assert x.exported_kv.block_ids == [0, 1, 2, 6]  # 3 hits + the queue head for the partial block
    assert bm.num_free_blocks == NUM_BLOCKS - 4
    y = _export(p, "y", prompt, GREEDY)
    assert y.exported_kv.block_ids == [0, 1, 2, 7]
    assert [bm.pools[0].blocks[b].ref_count for b in (0, 1, 2, 6, 7)] == [2, 2, 2, 1, 1]
    assert bm.num_free_blocks == NUM_BLOCKS - 5
    assert p.handover.release_export("x")
    assert [bm.pools[0].blocks[b].ref_count for b in (0, 1, 2, 6, 7)] == [1, 1, 1, 0, 1]
    assert bm.num_free_blocks == NUM_BLOCKS - 4
    assert p.handover.release_export("y")
    assert bm.num_free_blocks == NUM_BLOCKS


@pytest.mark.parametrize("end", ["expired", "released", "aborted during a read"])
def test_every_end_of_an_export_frees_its_blocks_once_on_the_engine_thread(pd, end):
    """Whichever way an export ends, its blocks stay allocated until the engine thread takes it
    (free_ended_exports, which every step starts with), are freed then exactly once, and only
    then may its request id be used again."""
    p = pd.producer
    bm = p.kv
    prompt = _prompt(13)
    p.add_request("x", prompt, GREEDY, kv_export=ExportOptions(lease_s=0.05))
    kv = run_finished(p)["x"].exported_kv
    ids = list(kv.block_ids)
    refs = [bm.pools[0].blocks[b].ref_count for b in ids]
    if end == "expired":
        time.sleep(0.1)
        assert p.handover.exports.expire_due() == 1
    elif end == "released":
        p.handover.exports.release(kv.export_id, done=True)
    else:
        p.handover.exports.begin_read(kv.export_id)
        p.handover.exports.release(kv.export_id, done=False)
        assert p.handover.free_ended_exports() == 0  # not under the read
        p.handover.exports.end_read(kv)
    assert bm.num_free_blocks == NUM_BLOCKS - 4  # the table only marks it ended
    assert p.handover.exports.find("x") is None and p.handover.exports.holds("x")
    with pytest.raises(ValueError, match="already in use"):
        p.add_request("x", prompt, GREEDY)
    assert p.step() == []  # the step frees them
    assert bm.num_free_blocks == NUM_BLOCKS
    assert [bm.pools[0].blocks[b].ref_count for b in ids] == [r - 1 for r in refs] and kv.block_ids == []
    assert p.handover.free_ended_exports() == 0 and p.handover.release_export("x") is False
    assert bm.num_free_blocks == NUM_BLOCKS
    assert _whole(p, prompt, GREEDY, rid="x").num_cached_tokens == 12  # the id is free; the blocks cached


STOPS = {
    "max_tokens1": (lambda tok: dataclasses.replace(GREEDY, max_tokens=1), "length", False),
    "stop_token": (lambda tok: dataclasses.replace(GREEDY, stop_token_ids=[tok]), "stop", True),
}


@pytest.mark.parametrize("case", STOPS)
def test_export_whose_first_token_ends_it_finishes_normally(pd, case):
    make_params, reason, stopped_by_token = STOPS[case]
    prompt = _prompt(13)
    tok = _whole(pd.reference, prompt, GREEDY).token_ids[0]
    pd.producer.add_request("x", prompt, make_params(tok), kv_export=True)
    out = run_finished(pd.producer)["x"]
    assert (out.token_ids, out.finish_reason) == ([tok], reason)
    assert out.stop_reason == (tok if stopped_by_token else None)
    assert out.exported_kv is None
    assert len(pd.producer.handover.exports) == 0
    assert pd.producer.handover.release_export("x") is False
    assert pd.producer.kv.num_free_blocks == NUM_BLOCKS


def test_export_aborted_before_it_runs_pins_nothing(pd):
    pd.producer.add_request("x", _prompt(13), GREEDY, kv_export=True)
    assert pd.producer.abort_request("x").finish_reason == "abort"
    assert pd.producer.step() == []
    assert len(pd.producer.handover.exports) == 0
    assert pd.producer.kv.num_free_blocks == NUM_BLOCKS


def test_a_byte_flipped_after_the_checksums_were_taken_is_caught_and_recomputed(pd):
    """NIXL: a producer block changes after its handle (and checksums) went out; the consumer's
    verification catches it before the blocks join the batch, the import is recomputed, the tokens
    are the whole request's, and both sides free every block once."""
    prompt = _prompt(13)
    first = _export(pd.producer, "r", prompt, GREEDY)
    kv = first.exported_kv
    export = pd.producer.handover.exports.begin_read(kv.export_id)
    digests = pd.producer.kv_port.checksum_exported(export)
    pd.producer.handover.exports.end_read(export)
    pd.producer.runner.kv_caches[1][kv.block_ids[2], 0, 5] += 1.0  # [blocks, BS, width]
    c = pd.consumer
    c.begin_import("r", prompt, first.token_ids, GREEDY, None)
    assert c.handover.allocate_import("r") == 0
    with pytest.raises(
        nixl.ChecksumMismatch, match="KV block 2 read from handover-producer fails its checksum"
    ):
        pd.consumer_agent.read(
            pd.peer, c.handover.import_sink("r"), 0, kv.block_ids, 30.0, threading.Event(), digests
        )
    c.handover.recompute_import("r")
    assert pd.producer.handover.release_export("r")
    final = run_finished(c)["r"]
    _assert_same(first, final, _whole(pd.reference, prompt, GREEDY))
    assert c.kv.num_free_blocks == NUM_BLOCKS
    assert pd.producer.kv.num_free_blocks == NUM_BLOCKS


# ---- consumer: prefix reuse, abort, recompute, room -------------------------------------------


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("mode", PARAMS)
def test_import_reuses_the_consumers_cached_prefix(pd, mode, transport):
    params = PARAMS[mode]
    c = pd.consumer
    warm = _prompt(13)
    _whole(c, warm, GREEDY, rid="warm")  # blocks 0..5; prompt blocks 0, 1, 2 cached
    prompt = warm[:8] + _prompt(9, seed=1)  # 17 tokens, 5 blocks: the first 2 are warm's
    first = _export(pd.producer, "r", prompt, params)
    kv = first.exported_kv
    c.begin_import("r", prompt, first.token_ids, params, kv.generator_state)
    assert c.handover.allocate_import("r") == 2
    # The hits are warm's blocks; the 3 new ones come from the head of the free queue.
    assert c.requests["r"].block_ids == [[0, 1, 6, 7, 8]]
    assert c.kv.num_free_blocks == NUM_BLOCKS - 5
    _move(pd, kv, "r", 2, transport)
    c.handover.finish_import("r")
    pd.producer.handover.release_export("r")
    final = run_finished(c)["r"]
    assert final.num_cached_tokens == 8
    _assert_same(first, final, _whole(pd.reference, prompt, params))
    assert c.kv.num_free_blocks == NUM_BLOCKS


def test_import_of_a_fully_cached_prompt_transfers_nothing(pd):
    c = pd.consumer
    prompt = _prompt(8)
    _whole(c, prompt, GREEDY, rid="warm")  # prompt blocks 0, 1 cached
    first = _export(pd.producer, "r", prompt, GREEDY)
    c.begin_import("r", prompt, first.token_ids, GREEDY)
    assert c.handover.allocate_import("r") == 2 == len(first.exported_kv.block_ids)
    assert c.requests["r"].block_ids == [[0, 1]]
    c.handover.finish_import("r")
    pd.producer.handover.release_export("r")
    _assert_same(first, run_finished(c)["r"], _whole(pd.reference, prompt, GREEDY))


@pytest.mark.parametrize("warm", [False, True], ids=["cold", "warm2"])
def test_abort_of_an_importing_request_frees_blocks_and_caches_nothing(pd, warm):
    c = pd.consumer
    bm = c.kv
    base = _prompt(13)
    if warm:
        _whole(c, base, GREEDY, rid="warm")
    prompt = base[:8] + _prompt(9, seed=1)  # 17 tokens: 4 full blocks + 1 partial
    cached_before = dict(bm.pools[0].cached)
    first = _export(pd.producer, "r", prompt, GREEDY)
    c.begin_import("r", prompt, first.token_ids, GREEDY)
    hits = c.handover.allocate_import("r")
    assert hits == (2 if warm else 0)
    assert bm.num_free_blocks == NUM_BLOCKS - 5
    _transfer(pd.producer, c, first.exported_kv, "r", hits, end=3)  # the stream broke after block 2
    out = c.abort_request("r")
    assert out.finish_reason == "abort"
    assert "r" not in c.requests and "r" not in c.scheduler.importing
    assert bm.num_free_blocks == NUM_BLOCKS
    # Only blocks that were cached before are findable: none of the import's own.
    assert bm.pools[0].cached == cached_before
    assert _hit_ids(c, prompt) == ([0, 1] if warm else [])
    # And the same prompt run here computes (or reuses) only real KV.
    again = _whole(c, prompt, GREEDY, rid="again")
    assert again.num_cached_tokens == (8 if warm else 0)
    assert again.token_ids == _whole(pd.reference, prompt, GREEDY).token_ids


def _importing(pd, rid: str, prompt: list[int]):
    """A prompt exported by the producer and begun, with blocks, on the consumer (no prefix hit)
    -> (the producer's output, the consumer's import sink)."""
    first = _export(pd.producer, rid, prompt, GREEDY)
    pd.consumer.begin_import(rid, prompt, first.token_ids, GREEDY)
    assert pd.consumer.handover.allocate_import(rid) == 0
    return first, pd.consumer.handover.import_sink(rid)


def test_abort_waits_for_a_write_in_flight_and_then_refuses_writes(pd, monkeypatch):
    """A transfer cancelled mid-write (its handler gone, the engine aborting the request) cannot
    land in blocks that were freed and handed to another request: the abort waits for the write,
    and a write after it is refused."""
    import threading
    import time

    import engine.kv_cache.transfer as transfer

    c = pd.consumer
    first, sink = _importing(pd, "r", _prompt(13))
    started, written = threading.Event(), threading.Event()
    real_write = transfer.write_slab

    def slow_write(*args):
        started.set()
        time.sleep(0.3)
        real_write(*args)
        written.set()

    monkeypatch.setattr(transfer, "write_slab", slow_write)
    slab = Slab(0, _num_layers(c), 0, 4)
    data = pd.producer.kv_port.read_exported(first.exported_kv, slab)
    writer = threading.Thread(target=sink.write, args=(slab, data))
    writer.start()
    assert started.wait(5)
    c.abort_request("r")
    assert written.is_set(), "the abort returned while a write into its blocks was in flight"
    writer.join()
    assert c.kv.num_free_blocks == NUM_BLOCKS
    with pytest.raises(ImportClosed, match="the import of request 'r' has ended"):
        sink.write(slab, data)
    pd.producer.handover.release_export("r")


def test_abort_during_a_remote_read_does_not_wait_on_the_peer(pd):
    """An abort while a one-sided READ holds the sink's remote-write slot (a NIXL READ being
    cancelled, which may take the peer's time): the engine thread returns at once with the
    request aborted, the READ is told to cancel, its blocks stay held -- a READ may still land in
    them -- and the id stays taken; once the READ has left its slot, the next step frees them."""
    c = pd.consumer
    prompt = _prompt(13)
    first, sink = _importing(pd, "r", prompt)
    in_slot, leave = threading.Event(), threading.Event()

    def remote_read() -> None:
        with sink.remote_write() as cancel:
            in_slot.set()
            assert cancel.wait(5)  # the close asks it to cancel...
            leave.wait(5)  # ...and the peer takes its time

    reader = threading.Thread(target=remote_read)
    reader.start()
    assert in_slot.wait(5)
    start = time.monotonic()
    assert c.abort_request("r").finish_reason == "abort"
    assert time.monotonic() - start < 1.0, "the abort waited for the peer"
    assert "r" not in c.requests and c.kv.num_free_blocks == NUM_BLOCKS - 4
    assert c.has_unfinished_requests() and c.handover.holds("r")
    with pytest.raises(ValueError, match="'r' is already in use"):
        c.begin_import("r", prompt, first.token_ids, GREEDY)
    c.step()
    assert c.kv.num_free_blocks == NUM_BLOCKS - 4  # still in its slot: nothing freed
    leave.set()
    reader.join(5)
    c.step()
    assert c.kv.num_free_blocks == NUM_BLOCKS and not c.has_unfinished_requests()
    assert not c.handover.holds("r")
    pd.producer.handover.release_export("r")


def test_once_the_import_joined_the_batch_its_sink_refuses_writes(pd):
    """A late duplicate chunk cannot overwrite KV the model is already reading."""
    c = pd.consumer
    prompt = _prompt(13)
    first = _export(pd.producer, "r", prompt, GREEDY)
    c.begin_import("r", prompt, first.token_ids, GREEDY)
    assert c.handover.allocate_import("r") == 0
    sink = c.handover.import_sink("r")
    _transfer(pd.producer, c, first.exported_kv, "r", 0)
    c.handover.finish_import("r")
    slab = Slab(0, _num_layers(c), 0, 1)
    with pytest.raises(ImportClosed):
        sink.write(slab, bytes(len(pd.producer.kv_port.read_exported(first.exported_kv, slab))))
    with pytest.raises(KeyError):
        c.handover.import_sink("r")
    assert pd.producer.handover.release_export("r")
    _assert_same(first, run_finished(c)["r"], _whole(pd.reference, prompt, GREEDY))


def test_abort_before_allocate_import_leaves_no_trace(pd):
    c = pd.consumer
    c.begin_import("r", _prompt(13), [7], GREEDY)
    assert c.abort_request("r").finish_reason == "abort"
    assert (c.requests, c.scheduler.importing, c.detokenizers) == ({}, {}, {})
    assert c.kv.num_free_blocks == NUM_BLOCKS


@pytest.mark.parametrize("mode", PARAMS)
def test_recompute_import_after_a_failed_transfer(pd, mode):
    params = PARAMS[mode]
    c = pd.consumer
    prompt = _prompt(13)
    first = _export(pd.producer, "r", prompt, params)
    kv = first.exported_kv
    c.begin_import("r", prompt, first.token_ids, params, kv.generator_state)
    assert c.handover.allocate_import("r") == 0
    _transfer(pd.producer, c, kv, "r", 0, end=2)  # half the blocks arrived, then the pull failed
    assert pd.producer.handover.release_export("r")
    c.handover.recompute_import("r")
    assert "r" not in c.scheduler.importing
    assert c.kv.num_free_blocks == NUM_BLOCKS  # the blocks wait for the scheduler
    assert c.kv.pools[0].cached == {}  # the half-written blocks were never registered
    final = run_finished(c)["r"]
    _assert_same(first, final, _whole(pd.reference, prompt, params))
    assert final.num_cached_tokens == 0
    assert c.kv.num_free_blocks == NUM_BLOCKS


def test_allocate_import_waits_for_room(pd):
    c = pd.consumer
    bm = c.kv
    c.add_request("big", _prompt(199, seed=2), SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    c.step()  # prefill: 199 tokens in 50 blocks
    assert bm.num_free_blocks == 14
    c.begin_import("b", _prompt(57), [7], GREEDY)  # needs 15 blocks
    assert c.handover.allocate_import("b") is None
    assert c.requests["b"].block_ids == [] and "b" in c.scheduler.importing
    assert bm.num_free_blocks == 14
    c.begin_import("c", _prompt(56), [7], GREEDY)  # needs exactly the 14 left
    assert c.handover.allocate_import("c") == 0
    assert c.requests["c"].block_ids == [list(range(50, 64))]
    assert bm.num_free_blocks == 0
    assert c.handover.allocate_import("b") is None
    c.step()  # "big" decodes its last token into block 49 and finishes
    assert "big" not in c.requests
    assert bm.num_free_blocks == 50
    assert c.handover.allocate_import("b") == 0
    assert len(c.requests["b"].block_ids[0]) == 15
    assert bm.num_free_blocks == 35


# ---- begin_import validation -------------------------------------------------------------------


VALID_STATE = torch.Generator().manual_seed(3).get_state()
LONG = dataclasses.replace(GREEDY, max_tokens=2)
REJECTS = {
    "outputs-empty": ([], GREEDY, None, r"output_token_ids must hold"),
    "output-out-of-vocab": (
        [VOCAB],
        GREEDY,
        None,
        r"output_token_ids\[0\] = 4096 is outside the vocabulary \[0, 4096\)",
    ),
    "output-negative": ([7, -1], GREEDY, None, r"output_token_ids\[1\] = -1 is outside"),
    "output-not-int": ([7.0], GREEDY, None, r"output_token_ids\[0\] = 7.0 is outside"),
    "outputs-reach-max-tokens": ([7, 8], LONG, None, r"2 tokens already generated, max_tokens is 2"),
    "state-wrong-size": (
        [7],
        SEEDED,
        torch.zeros(3, dtype=torch.uint8),
        r"sampler_state is not a valid generator state",
    ),
    "state-invalid-mt19937": (
        [7],
        SEEDED,
        torch.zeros(5056, dtype=torch.uint8),
        r"sampler_state is not a valid generator state",
    ),
    "state-not-bytes": ([7], SEEDED, torch.zeros(5056), r"sampler_state"),
    "state-without-seed": ([7], GREEDY, VALID_STATE, r"sampler_state is set but the request has no seed"),
}


@pytest.mark.parametrize("case", REJECTS)
def test_begin_import_rejects_and_leaves_no_trace(pd, case):
    outputs, params, state, message = REJECTS[case]
    c = pd.consumer
    c.begin_import("other", _prompt(5), [7], GREEDY)
    with pytest.raises(ValueError, match=message):
        c.begin_import("r", _prompt(13), outputs, params, state)
    assert (list(c.requests), list(c.scheduler.importing), list(c.detokenizers)) == (
        ["other"],
        ["other"],
        ["other"],
    )
    assert c.kv.num_free_blocks == NUM_BLOCKS
    # The id is free again: a correct import under it is accepted.
    c.begin_import("r", _prompt(13), [7], GREEDY)
    assert c.handover.allocate_import("r") == 0


@pytest.mark.parametrize(
    "prompt, message",
    [([], r"prompt must not be empty"), ([5, VOCAB], r"prompt_token_ids\[1\] = 4096 is outside")],
    ids=["prompt-empty", "prompt-out-of-vocab"],
)
def test_begin_import_validates_the_prompt_like_add_request(pd, prompt, message):
    c = pd.consumer
    with pytest.raises(ValueError, match=message):
        c.begin_import("r", prompt, [7], GREEDY)
    assert (c.requests, c.scheduler.importing, c.detokenizers) == ({}, {}, {})


def test_begin_import_rejects_an_id_in_use(pd):
    c = pd.consumer
    c.begin_import("r", _prompt(13), [7], GREEDY)
    with pytest.raises(ValueError, match=r"request_id 'r' is already in use"):
        c.begin_import("r", _prompt(5), [8], GREEDY)
    assert list(c.requests) == ["r"] and c.requests["r"].prompt_token_ids == _prompt(13)
