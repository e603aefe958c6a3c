"""Routing decisions on a pool of fake worker handles: load, prefix affinity, colocation."""

from __future__ import annotations

import pytest

from engine.kv_cache.hashing import hash_blocks
from pdserve.v1 import worker_pb2 as wpb
from services.common.errors import Unavailable
from services.registry import StaticRegistry
from services.router.api import ServingMode
from services.router.policy import RoutingConfig, choose
from services.router.pool import PrefixIndex, WorkerHandle, WorkerPool

BS = 16
ROLES = {
    "prefill": wpb.WORKER_ROLE_PREFILL,
    "decode": wpb.WORKER_ROLE_DECODE,
    "colocated": wpb.WORKER_ROLE_COLOCATED,
}


def _pool(*workers: tuple[str, str, int]) -> WorkerPool:
    pool = WorkerPool(StaticRegistry([]))
    for endpoint, role, in_flight in workers:
        w = WorkerHandle(
            endpoint,
            None,
            None,
            None,
            info=wpb.EngineInfo(role=ROLES[role]),
            healthy=True,
            in_flight=in_flight,
        )
        pool.workers[endpoint] = w
    return pool


PROMPT = list(range(100, 100 + 96))  # 6 full blocks
HASHES = hash_blocks(PROMPT, BS)


NEVER_COLOCATE = RoutingConfig(colocate_max_tokens=0, colocate_cached_fraction=0.8)


def _route(pool, mode=ServingMode.AUTO, cfg=NEVER_COLOCATE, prompt=PROMPT, shared_blocks=0):
    return choose(pool, cfg, mode, hash_blocks(prompt, BS), len(prompt), BS, shared_blocks=shared_blocks)


def test_least_loaded_prefill_and_decode_without_affinity():
    pool = _pool(("p0", "prefill", 3), ("p1", "prefill", 1), ("d0", "decode", 0), ("d1", "decode", 2))
    route = _route(pool)
    assert (route.prefill.endpoint, route.decode.endpoint) == ("p1", "d0")


def test_prefix_affinity_beats_load_above_the_threshold_only():
    pool = _pool(("p0", "prefill", 5), ("p1", "prefill", 0), ("d0", "decode", 0))
    pool.workers["p0"].prefix.add(HASHES[:2])  # 32 of 96 tokens = 1/3 >= 0.25
    assert _route(pool).prefill.endpoint == "p0"
    pool = _pool(("p0", "prefill", 5), ("p1", "prefill", 0), ("d0", "decode", 0))
    pool.workers["p0"].prefix.add(HASHES[:1])  # 16 of 96 < 0.25: load wins
    assert _route(pool).prefill.endpoint == "p1"


def test_short_or_mostly_cached_prompts_run_colocated_on_the_decode_rank():
    pool = _pool(("p0", "prefill", 0), ("d0", "decode", 0))
    assert _route(pool, cfg=RoutingConfig(colocate_max_tokens=32), prompt=PROMPT[:20]).prefill is None
    assert _route(pool, cfg=RoutingConfig(colocate_max_tokens=32)).prefill is not None
    pool.workers["d0"].prefix.add(HASHES[:5])  # 80 / 96 >= 0.8
    assert _route(pool).prefill is None
    assert _route(pool, mode=ServingMode.DISAGGREGATED).prefill.endpoint == "p0"


def test_prompts_run_colocated_once_every_prefill_rank_is_backed_up():
    cfg = RoutingConfig(colocate_max_tokens=0, colocate_prefill_backlog=1024)
    pool = _pool(("p0", "prefill", 4), ("p1", "prefill", 1), ("d0", "decode", 0))
    p0, p1, d0 = (pool.workers[e] for e in ("p0", "p1", "d0"))
    p0.prompt_tokens_in_flight, p1.prompt_tokens_in_flight = 4096, 1023
    assert _route(pool, cfg=cfg).prefill is p1  # one prefill rank has room
    p1.prompt_tokens_in_flight = 1024
    assert _route(pool, cfg=cfg).prefill is None  # every one is backed up: the decode rank prefills
    d0.prompt_tokens_in_flight = 1024
    assert _route(pool, cfg=cfg).prefill is p1  # as many wait there: no better
    d0.prompt_tokens_in_flight = 0
    assert _route(pool, cfg=NEVER_COLOCATE).prefill is p1  # off (0) by default
    assert _route(pool, mode=ServingMode.DISAGGREGATED, cfg=cfg).prefill is p1  # asked for: kept
    with pytest.raises(ValueError, match="colocate_prefill_backlog"):
        RoutingConfig(colocate_prefill_backlog=-1)


def test_modes_and_missing_roles():
    pool = _pool(("d0", "decode", 0))
    assert _route(pool).prefill is None  # AUTO without a prefill rank: colocated
    with pytest.raises(Unavailable, match="prefill"):
        _route(pool, mode=ServingMode.DISAGGREGATED)
    with pytest.raises(Unavailable, match="decode"):
        _route(_pool(("p0", "prefill", 0)))
    pool = _pool(("c0", "colocated", 0), ("c1", "colocated", 1))
    route = _route(pool, mode=ServingMode.DISAGGREGATED)
    assert (route.decode.endpoint, route.prefill.endpoint) == ("c0", "c1")  # never the same rank twice
    pool.workers["c0"].healthy = False
    assert _route(pool).decode.endpoint == "c1" and _route(pool).prefill is None


def test_draining_workers_get_nothing():
    pool = _pool(("p0", "prefill", 0), ("d0", "decode", 0), ("d1", "decode", 9))
    pool.workers["d0"].load = wpb.Load(draining=True)
    assert _route(pool).decode.endpoint == "d1"


def test_prefix_index_is_a_bounded_lru_matching_leading_blocks():
    index = PrefixIndex(capacity=4)
    index.add(HASHES[:3])
    assert index.match(HASHES) == 3 and index.match(hash_blocks(PROMPT[::-1], BS)) == 0
    index.add([b"x", b"y"])  # evicts the oldest
    assert index.match(HASHES) == 0


def test_blocks_in_the_shared_tier_count_as_cached_on_every_rank():
    pool = _pool(("p0", "prefill", 3), ("p1", "prefill", 0), ("d0", "decode", 0))
    # 5 of 6 blocks are in Redis: any decode rank can load them, so AUTO runs colocated.
    assert _route(pool, shared_blocks=5).prefill is None
    assert _route(pool, shared_blocks=2).prefill is not None
    # p0 caches 3 blocks, but the shared tier already has 3: affinity gains nothing, load wins.
    pool.workers["p0"].prefix.add(HASHES[:3])
    assert _route(pool, mode=ServingMode.DISAGGREGATED, shared_blocks=3).prefill.endpoint == "p1"
    assert _route(pool, mode=ServingMode.DISAGGREGATED, shared_blocks=0).prefill.endpoint == "p0"
