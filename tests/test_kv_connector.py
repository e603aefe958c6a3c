"""The engine against its KV connector interface, with test doubles of the interface (not of Redis):
a connector whose lookup is slow, one that loses blocks, and one that fails outright. Every request
gives the tokens a plain engine gives; a pending lookup never holds up other requests; aborts and
failures release the connector's state and the blocks exactly once.

And with the real Redis tier: the engine thread itself never talks to Redis, even while Redis is
down (the lookups run on the fetch thread).
"""

from __future__ import annotations

import threading

import pytest
import redis

from engine.config import EngineConfig
from engine.engine_core import EngineCore
from engine.kv_cache.codec import decode_block, encode_block
from engine.kv_cache.connector import KVConnector
from engine.kv_cache.hashing import hash_blocks
from engine.request import RequestStatus
from engine.sampling_params import SamplingParams
from tests.engine_testing import run_finished
from tests.redis_server import RedisServer

BS = 4
PREFIX = [5 + (j * 7) % 3000 for j in range(24)]  # 6 full blocks
PROMPT = PREFIX + [9]
PARAMS = SamplingParams(temperature=0, max_tokens=4, logprobs=2, ignore_eos=True)
OTHER = SamplingParams(temperature=0, max_tokens=3, logprobs=1, ignore_eos=True)


class Store:
    """Stored blocks: what a plain engine computed for PROMPT, in the codec's stored form."""

    def __init__(self, core: EngineCore):
        core.add_request("fill", PROMPT, PARAMS)
        run_finished(core)
        hashes = hash_blocks(PROMPT, BS)
        hit = core.kv.get_computed_blocks(_probe(core)).blocks[0]
        self.blobs = {
            h: encode_block(core.kv_spec, core.runner.kv_caches, b.block_id)
            for h, b in zip(hashes, hit, strict=False)
        }
        assert len(self.blobs) == len(PREFIX) // BS


class FakeConnector(KVConnector):
    """Holds `store`'s blocks (all of them, or the first `keep`); its lookup is answered only once
    `gate` is set (an off-thread lookup in flight until then)."""

    def __init__(self, spec, caches, store: Store, keep: int | None = None, fail: bool = False):
        self.spec, self.caches, self.store = spec, caches, store
        self.keep, self.fail = keep, fail
        self.gate = threading.Event()
        self.pending: set[str] = set()
        self.released: list[str] = []
        self.loaded: list[int] = []
        """Blocks each load call was asked for."""

    def lookup(self, request_id, block_hashes, first_block=0, device_states=None):
        if not self.gate.is_set():
            self.pending.add(request_id)
            return None
        self.pending.discard(request_id)
        run = 0
        while run < len(block_hashes) and block_hashes[run] in self.store.blobs:
            run += 1
        return run

    def on_evict(self, block_hash, block_id, table=0):
        pass

    def release(self, request_id):
        self.pending.discard(request_id)
        self.released.append(request_id)

    def load(self, request_id, load):
        block_hashes, block_ids = load.block_hashes, load.block_ids
        if self.fail:
            raise OSError("the connector's source went away")
        limit = len(block_hashes) if self.keep is None else min(self.keep, len(block_hashes))
        for h, b in zip(block_hashes[:limit], block_ids, strict=False):
            assert decode_block(self.spec, self.store.blobs[h], self.caches, b)
        self.loaded.append(len(block_hashes))  # blocks asked for
        return limit

    def poll(self):
        return set(self.pending) if self.gate.is_set() else set()


def _core(model: str, connector=None) -> EngineCore:
    cfg = EngineConfig(model=model, dtype="float32", block_size=BS, num_kv_blocks=32, num_threads=1)
    return EngineCore(cfg, connector=connector)


def _probe(core: EngineCore):
    from engine.request import Request

    return Request("probe", list(PROMPT), SamplingParams())


@pytest.fixture(scope="module")
def plain(tiny_model):
    core = _core(tiny_model)
    store = Store(core)
    core.add_request("ref", PROMPT, PARAMS)
    core.add_request("other-ref", [7, 8, 9], OTHER)
    refs = run_finished(core)
    return store, refs["ref"], refs["other-ref"]


def _with(tiny_model, plain, **kw) -> tuple[EngineCore, FakeConnector]:
    store = plain[0]
    made = []

    def factory(spec, caches):
        made.append(FakeConnector(spec, caches, store, **kw))
        return made[0]

    return _core(tiny_model, connector=factory), made


def _same(out, ref) -> None:
    assert out.token_ids == ref.token_ids
    for got, want in zip(out.logprobs, ref.logprobs, strict=True):
        assert list(got) == list(want) and got == pytest.approx(want, abs=1e-4)


def _idle(core: EngineCore) -> None:
    assert not core.has_unfinished_requests() and not core.requests
    assert core.kv.num_free_blocks == core.num_kv_blocks
    assert not core.scheduler.waiting_for_kv


def test_a_pending_lookup_holds_up_no_one_and_its_blocks_load_exactly(tiny_model, plain):
    _, ref, other_ref = plain
    core, made = _with(tiny_model, plain)
    conn = made[0]
    core.add_request("slow", PROMPT, PARAMS)
    core.add_request("other", [7, 8, 9], OTHER)  # shorter than a block: nothing to look up
    finished = run_finished(core, steps=10)
    assert list(finished) == ["other"]
    _same(finished["other"], other_ref)
    assert [r.request_id for r in core.scheduler.waiting_for_kv] == ["slow"]
    assert core.requests["slow"].status is RequestStatus.WAITING_FOR_REMOTE_KV
    assert core.requests["slow"].block_ids == []  # nothing allocated while it waits
    conn.gate.set()
    finished = run_finished(core)
    _same(finished["slow"], ref)
    assert finished["slow"].num_cached_tokens == len(PREFIX)
    assert conn.loaded == [len(PREFIX) // BS]
    assert conn.released.count("slow") == 2  # at admission, and when it finished
    _idle(core)


def test_abort_while_the_lookup_is_pending_releases_once_and_holds_nothing(tiny_model, plain):
    core, made = _with(tiny_model, plain)
    core.add_request("slow", PROMPT, PARAMS)
    run_finished(core, steps=3)
    assert core.requests["slow"].status is RequestStatus.WAITING_FOR_REMOTE_KV
    out = core.abort_request("slow")
    assert out.finish_reason == "abort"
    assert made[0].released == ["slow"] and made[0].loaded == []
    _idle(core)
    made[0].gate.set()  # a lookup that finishes after the abort changes nothing
    assert core.step() == []
    _idle(core)


def test_blocks_the_connector_cannot_give_are_recomputed(tiny_model, plain):
    _, ref, _ = plain
    core, made = _with(tiny_model, plain, keep=2)
    made[0].gate.set()
    core.add_request("r", PROMPT, PARAMS)
    out = run_finished(core)["r"]
    _same(out, ref)
    assert out.num_cached_tokens == 2 * BS and made[0].loaded == [len(PREFIX) // BS]
    _idle(core)


def test_a_connector_that_fails_fails_the_step_not_the_blocks(tiny_model, plain):
    """A load that raises surfaces from step() (the services turn that into a dead engine); the
    request's blocks are still accounted for: aborting it frees every one, once."""
    core, made = _with(tiny_model, plain, fail=True)
    made[0].gate.set()
    core.add_request("r", PROMPT, PARAMS)
    with pytest.raises(OSError, match="went away"):
        core.step()
    core.abort_request("r")
    _idle(core)


def test_the_engine_thread_never_talks_to_redis_even_when_it_is_down(tiny_model, monkeypatch):
    """Every Redis command the client sends, alone or in a pipeline, is recorded with the thread
    that sent it."""
    engine_thread = threading.get_ident()
    calls: list[tuple[str, bool]] = []
    command, pipeline = redis.Redis.execute_command, redis.client.Pipeline.execute

    def spy_command(self, *args, **kw):
        calls.append((str(args[0]), threading.get_ident() == engine_thread))
        return command(self, *args, **kw)

    def spy_pipeline(self, *args, **kw):
        calls.append(("PIPELINE", threading.get_ident() == engine_thread))
        return pipeline(self, *args, **kw)

    monkeypatch.setattr(redis.Redis, "execute_command", spy_command)
    monkeypatch.setattr(redis.client.Pipeline, "execute", spy_pipeline)
    with RedisServer() as server:
        url = server.url
        cfg = EngineConfig(
            model=tiny_model,
            dtype="float32",
            block_size=BS,
            num_kv_blocks=16,
            num_threads=1,
            kv_offload="redis",
            kv_redis_url=url,
        )
        core = EngineCore(cfg)
        core.add_request("a", PROMPT, PARAMS)
        first = run_finished(core)["a"]
        core.add_request("evict", [100 + j for j in range(60)], SamplingParams(max_tokens=2, temperature=0))
        run_finished(core)
        assert core.connector.tiers[0].flush()
        core.add_request("b", PROMPT, PARAMS)
        again = run_finished(core)["b"]
        assert again.num_cached_tokens == len(PREFIX) and again.token_ids == first.token_ids
        server.stop()
        core.add_request("evict2", [2000 + j for j in range(60)], SamplingParams(max_tokens=2, temperature=0))
        run_finished(core)
        core.add_request("c", PROMPT, PARAMS)
        down = run_finished(core)
        assert down["c"].token_ids == first.token_ids and down["c"].num_cached_tokens == 0
        assert core.connector.tiers[0].errors > 0
        core.connector.close()
    assert {"MGET", "SET"} <= {name for name, _ in calls}  # the lookups and the write-behind ran
    assert not [name for name, on_engine_thread in calls if on_engine_thread]
