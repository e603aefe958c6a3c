"""Scheduler, without a model: drive schedule() and play the engine's update by hand
(num_computed_tokens += num_new_tokens; append a token when the chunk samples). Chunk sizes,
block ids, preemption victims and queue order are asserted exactly (STYLE.md item 9).

Legend: a scheduled item is written (request id, num_computed_tokens, num_new_tokens).
"""

from __future__ import annotations

import random

import pytest

from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerOutput
from tests.engine_testing import full_manager, table

VOCAB = 11


def fake_model(token_ids: list[int]) -> int:
    """The next token as a pure function of the history: a request recomputed after preemption,
    or two requests with the same prompt, produce the same tokens."""
    return (sum(token_ids[-3:]) * 7 + len(token_ids)) % VOCAB


def make_req(
    rid: str, prompt: list[int], max_tokens: int = 16, prompt_logprobs: int | None = None
) -> Request:
    return Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens, prompt_logprobs=prompt_logprobs))


def make_sched(num_blocks: int, bs: int = 4, max_num_seqs: int = 8, budget: int = 64) -> Scheduler:
    return Scheduler(full_manager(num_blocks, bs), max_num_seqs=max_num_seqs, max_num_batched_tokens=budget)


def update(sched: Scheduler, out: SchedulerOutput) -> list[Request]:
    """The engine's update; requests that reach max_tokens finish. -> the finished requests."""
    finished = []
    for item in out.scheduled:
        req = item.request
        samples = item.samples  # read before append_token changes req.num_tokens
        req.num_computed_tokens += item.num_new_tokens
        if samples:
            req.append_token(fake_model(req.token_ids))
            if req.num_output_tokens >= req.params.max_tokens:
                sched.finish(req, RequestStatus.FINISHED_LENGTH)
                finished.append(req)
    return finished


def step(sched: Scheduler) -> tuple[list[tuple[str, int, int]], list[str]]:
    """One step -> (scheduled items, preempted request ids)."""
    out = sched.schedule()
    items = [(s.request.request_id, s.num_computed_tokens, s.num_new_tokens) for s in out.scheduled]
    assert out.num_batched_tokens == sum(n for _, _, n in items) <= sched.max_num_batched_tokens
    preempted = [r.request_id for r in out.preempted]
    update(sched, out)
    return items, preempted


def ids(reqs) -> list[str]:
    return [r.request_id for r in reqs]


def free_queue(sched: Scheduler) -> list[int]:
    return list(sched.kv.pools[0].free_queue)


# ---- chunked prefill and batching ---------------------------------------------------------------

CHUNK_CASES = [
    # (prompt length, token budget, chunk sizes of the prefill)
    (10, 4, [4, 4, 2]),
    (8, 8, [8]),
    (9, 8, [8, 1]),
    (16, 5, [5, 5, 5, 1]),
    (3, 64, [3]),
]


@pytest.mark.parametrize(
    "n, budget, chunks", CHUNK_CASES, ids=[f"prompt{n}-budget{b}" for n, b, _ in CHUNK_CASES]
)
def test_chunked_prefill_splits_a_long_prompt_under_the_budget(n, budget, chunks):
    sched = make_sched(num_blocks=16, budget=budget)
    req = make_req("a", list(range(n)), max_tokens=3)
    sched.add(req)
    done = 0
    for size in chunks:
        out = sched.schedule()
        (item,) = out.scheduled
        assert (item.num_computed_tokens, item.num_new_tokens) == (done, size)
        done += size
        assert item.samples == (done == n)  # only the last chunk samples
        assert table(req) == list(range(-(-done // 4)))  # blocks grow with the chunks
        update(sched, out)
    # Then one token per step until max_tokens.
    assert [step(sched)[0] for _ in range(2)] == [[("a", n, 1)], [("a", n + 1, 1)]]
    assert req.status == RequestStatus.FINISHED_LENGTH
    assert req.num_output_tokens == 3
    assert sched.num_unfinished == 0 and sched.schedule().empty
    assert sched.kv.num_free_blocks == 16


def test_decodes_and_a_prefill_chunk_share_a_step():
    sched = make_sched(num_blocks=16, budget=6)
    sched.add(make_req("a", list(range(3))))
    sched.add(make_req("b", list(range(100, 110))))
    assert [step(sched)[0] for _ in range(4)] == [
        [("a", 0, 3), ("b", 0, 3)],
        [("a", 3, 1), ("b", 3, 5)],
        [("a", 4, 1), ("b", 8, 2)],
        [("a", 5, 1), ("b", 10, 1)],
    ]


def test_running_requests_past_the_budget_wait_without_preemption():
    sched = make_sched(num_blocks=16, budget=2)
    for rid in "abc":
        sched.add(make_req(rid, [ord(rid)]))
    assert step(sched) == ([("a", 0, 1), ("b", 0, 1)], [])
    assert step(sched) == ([("a", 1, 1), ("b", 1, 1)], [])  # c never gets the budget
    assert ids(sched.running) == ["a", "b"] and ids(sched.waiting) == ["c"]


def test_max_num_seqs_caps_running_requests():
    sched = make_sched(num_blocks=16, max_num_seqs=2)
    sched.add(make_req("a", [1, 2], max_tokens=1))
    sched.add(make_req("b", [3, 4], max_tokens=3))
    sched.add(make_req("c", [5, 6], max_tokens=1))
    assert step(sched)[0] == [("a", 0, 2), ("b", 0, 2)]  # c waits: two running
    assert ids(sched.running) == ["b"] and ids(sched.waiting) == ["c"]  # a finished
    assert step(sched)[0] == [("b", 2, 1), ("c", 0, 2)]
    assert ids(sched.running) == ["b"]


def test_waiting_request_blocks_the_queue_when_blocks_are_short():
    """Admission is first come, first served: a head that does not fit stops the ones behind it."""
    sched = make_sched(num_blocks=3)
    sched.add(make_req("a", list(range(8)), max_tokens=2))  # [0, 1]
    sched.add(make_req("b", list(range(100, 108))))  # needs 2 blocks: waits
    sched.add(make_req("c", [200]))  # would fit in block 2
    assert step(sched)[0] == [("a", 0, 8)]
    assert step(sched)[0] == [("a", 8, 1)]  # a takes block 2; b and c still wait
    assert ids(sched.waiting) == ["b", "c"]
    assert sched.running == [] and free_queue(sched) == [2, 1, 0]  # a finished
    assert step(sched)[0] == [("b", 0, 8), ("c", 0, 1)]
    assert [table(r) for r in sched.running] == [[2, 1], [0]]


# ---- preemption ---------------------------------------------------------------------------------


def test_newest_running_requests_are_preempted_first():
    sched = make_sched(num_blocks=4)
    reqs = {rid: make_req(rid, [10 * i + j for j in range(4)], max_tokens=3) for i, rid in enumerate("abcd")}
    for r in reqs.values():
        sched.add(r)
    assert step(sched) == ([("a", 0, 4), ("b", 0, 4), ("c", 0, 4), ("d", 0, 4)], [])
    assert [table(r) for r in reqs.values()] == [[0], [1], [2], [3]]
    # Every decode now needs a second block and none is free: a takes d's, b takes c's.
    items, preempted = step(sched)
    assert items == [("a", 4, 1), ("b", 4, 1)]
    assert preempted == ["d", "c"]
    assert ids(sched.running) == ["a", "b"]
    assert ids(sched.waiting) == ["c", "d"]  # arrival order kept at the front
    assert table(reqs["a"]) == [0, 3] and table(reqs["b"]) == [1, 2]
    for rid in "cd":
        r = reqs[rid]
        assert table(r) == [] and r.num_computed_tokens == 0
        assert r.status == RequestStatus.PREEMPTED
        assert r.metrics.num_preemptions == 1
        assert r.num_tokens == 5  # the generated token is kept
    assert sched.kv.pools[0].num_evictions == 2  # c's and d's full blocks were reused
    # a and b finish at the next step, then c and d are recomputed from scratch.
    assert step(sched) == ([("a", 5, 1), ("b", 5, 1)], [])
    assert ids(sched.running) == []
    assert step(sched) == ([("c", 0, 5), ("d", 0, 5)], [])
    assert reqs["c"].status == RequestStatus.RUNNING
    assert table(reqs["c"]) == [3, 0] and table(reqs["d"]) == [2, 1]


def test_preempted_request_recomputes_prompt_and_output_with_cache_hits():
    sched = make_sched(num_blocks=4)
    bm = sched.kv
    a = make_req("a", list(range(4)), max_tokens=3)  # [0]
    b = make_req("b", list(range(100, 109)), max_tokens=2)  # [1, 2 full, 3 partial]
    sched.add(a)
    sched.add(b)
    assert step(sched) == ([("a", 0, 4), ("b", 0, 9)], [])
    b_first_token = b.token_ids[-1]
    # a's decode needs a block: b goes, freeing 3, 2, 1; a takes the uncached partial block 3.
    assert step(sched) == ([("a", 4, 1)], ["b"])
    assert table(a) == [0, 3]
    assert free_queue(sched) == [2, 1]
    assert bm.pools[0].num_evictions == 0
    # b's 10 tokens: hits on its own blocks 1 and 2 need the last free block too. It waits.
    assert step(sched) == ([("a", 5, 1)], [])
    assert a.status == RequestStatus.FINISHED_LENGTH
    assert free_queue(sched) == [2, 1, 3, 0]
    # Readmitted: the prompt's first 8 tokens hit, the last prompt token and b's output are recomputed.
    out = sched.schedule()
    assert [(s.request, s.num_computed_tokens, s.num_new_tokens) for s in out.scheduled] == [(b, 8, 2)]
    assert table(b) == [1, 2, 3]
    assert free_queue(sched) == [0]
    update(sched, out)
    assert b.output_token_ids[0] == b_first_token and b.num_output_tokens == 2
    assert b.status == RequestStatus.FINISHED_LENGTH
    assert b.metrics.num_preemptions == 1
    assert b.metrics.num_cached_tokens == 0  # first scheduling found nothing cached
    assert bm.num_free_blocks == 4


def test_nothing_is_admitted_in_a_step_that_preempted():
    sched = make_sched(num_blocks=4)
    bm = sched.kv
    prompt = list(range(8))
    a = make_req("a", prompt, max_tokens=4)
    d = make_req("d", prompt, max_tokens=4)
    sched.add(a)
    sched.add(d)
    # d hits block 0, which a registered earlier in the same step, and recomputes a copy of block 1.
    assert step(sched) == ([("a", 0, 8), ("d", 4, 4)], [])
    assert (table(a), table(d)) == ([0, 1], [0, 2])
    assert d.metrics.num_cached_tokens == 4
    # a takes the last block; d, the newest, preempts itself.
    assert step(sched) == ([("a", 8, 1)], ["d"])
    assert (table(a), table(d)) == ([0, 1, 3], [])
    assert free_queue(sched) == [2]
    # d would fit now (hits on a's 0 and 1, plus block 2), yet was not readmitted in that step ...
    computed = bm.get_computed_blocks(d)
    hits, num_hit_tokens = computed.blocks[0], computed.num_tokens
    assert [h.block_id for h in hits] == [0, 1] and num_hit_tokens == 8
    # ... but is at the next one, recomputing only its generated token.
    assert step(sched) == ([("a", 9, 1), ("d", 8, 1)], [])
    assert table(d) == [0, 1, 2]
    assert [b.ref_count for b in bm.pools[0].blocks] == [2, 2, 1, 1]
    assert d.metrics.num_preemptions == 1 and a.metrics.num_preemptions == 0


def test_finish_frees_blocks_tail_first():
    sched = make_sched(num_blocks=8)
    a = make_req("a", list(range(9)))
    b = make_req("b", list(range(100, 104)))
    c = make_req("c", [7])
    for r in (a, b):
        sched.add(r)
    step(sched)
    sched.add(c)
    assert (table(a), table(b)) == ([0, 1, 2], [3])
    sched.finish(a, RequestStatus.FINISHED_ABORTED)
    assert table(a) == [] and a.status == RequestStatus.FINISHED_ABORTED
    assert a.metrics.finished_time is not None
    assert free_queue(sched) == [4, 5, 6, 7, 2, 1, 0]
    assert ids(sched.running) == ["b"]
    sched.finish(c, RequestStatus.FINISHED_ABORTED)  # still waiting: holds nothing
    assert ids(sched.waiting) == [] and free_queue(sched) == [4, 5, 6, 7, 2, 1, 0]
    sched.finish(b, RequestStatus.FINISHED_STOPPED)
    assert sched.num_unfinished == 0
    assert free_queue(sched) == [4, 5, 6, 7, 2, 1, 0, 3]
    assert [blk.ref_count for blk in sched.kv.pools[0].blocks] == [0] * 8


# ---- randomised workload: invariants every step -------------------------------------------------


def check_invariants(sched: Scheduler, kv: dict[tuple[int, int], int]) -> None:
    bm = sched.kv
    pool, bs = bm.pools[0], bm.block_size
    assert len(sched.running) <= sched.max_num_seqs
    holders: dict[int, list[tuple[Request, int]]] = {}
    for req in sched.running:
        assert len(set(table(req))) == len(table(req))
        assert len(table(req)) == -(-req.num_computed_tokens // bs)
        for i, block_id in enumerate(table(req)):
            holders.setdefault(block_id, []).append((req, i))
        # Every computed token's KV sits where the request's blocks say.
        for p in range(req.num_computed_tokens):
            assert kv[table(req)[p // bs], p % bs] == req.token_ids[p], (req.request_id, p)
    for req in sched.waiting:
        assert table(req) == [] and req.num_computed_tokens == 0
    for block in pool.blocks:
        assert block.ref_count == len(holders.get(block.block_id, []))
        assert (block.ref_count == 0) == (block.block_id in pool.free_queue)
        if block.block_hash is not None:
            assert pool.cached[block.block_hash] == block.block_id
    assert sum(b.ref_count for b in pool.blocks) == sum(len(table(r)) for r in sched.running)
    assert all(pool.blocks[b].block_hash == h for h, b in pool.cached.items())
    for block_id, owners in holders.items():
        block = pool.blocks[block_id]
        if len(owners) > 1:  # shared only as a cached full block, at the same position for all
            assert block.block_hash is not None
            assert {i for _, i in owners} == {owners[0][1]}
            assert all(req.block_hashes[i] == block.block_hash for req, i in owners)


def run_workload(
    seed: int, bs: int, num_blocks: int, budget: int, max_num_seqs: int, num_requests: int = 30
) -> dict:
    rng = random.Random(seed)
    sched = make_sched(num_blocks, bs=bs, max_num_seqs=max_num_seqs, budget=budget)
    bm = sched.kv
    prefixes = [[rng.randrange(VOCAB) for _ in range(rng.randrange(1, 3 * bs))] for _ in range(3)]
    pending = []
    for i in range(num_requests):
        max_tokens = rng.randrange(1, 8)
        max_len = num_blocks * bs - max_tokens  # the engine's admission check
        prompt = list(rng.choice(prefixes)) if rng.random() < 0.6 else []
        prompt += [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 3 * bs))]
        prompt = prompt[: rng.randrange(1, max_len + 1)] or [0]
        lp = 1 if rng.random() < 0.15 else None
        pending.append((rng.randrange(0, 2 * num_requests), make_req(f"r{i}", prompt, max_tokens, lp)))
    pending.sort(key=lambda p: p[0])
    all_reqs = [r for _, r in pending]
    kv: dict[tuple[int, int], int] = {}  # (block, offset) -> token whose KV the fake cache holds
    num_samples = {r.request_id: 0 for r in all_reqs}
    aborted = set()
    for t in range(2000):
        while pending and pending[0][0] <= t:
            sched.add(pending.pop(0)[1])
        if not pending and not sched.num_unfinished:
            break
        if t % 7 == 3 and rng.random() < 0.3 and sched.num_unfinished:
            victim = rng.choice(list(sched.running) + list(sched.waiting))
            sched.finish(victim, RequestStatus.FINISHED_ABORTED)
            aborted.add(victim.request_id)
        running_before = list(sched.running)
        out = sched.schedule()
        # Preemption takes the newest running requests, newest first, and puts them at the
        # front of the waiting queue in arrival order; a step that preempts admits nothing.
        k = len(out.preempted)
        assert out.preempted == running_before[::-1][:k]
        assert list(sched.waiting)[:k] == out.preempted[::-1]
        for r in out.preempted:
            assert r.status == RequestStatus.PREEMPTED and table(r) == []
        if out.preempted:
            assert all(s.request in running_before for s in out.scheduled)
        assert len({id(s.request) for s in out.scheduled}) == len(out.scheduled)
        assert all(s.request in sched.running for s in out.scheduled)
        assert out.num_batched_tokens == sum(s.num_new_tokens for s in out.scheduled) <= budget
        # The fake forward pass: write this step's KV first (as the model does, per layer), then
        # every scheduled request must read its whole context back, prefix hits included.
        written: dict[tuple[int, int], int] = {}
        for s in out.scheduled:
            req = s.request
            assert s.num_computed_tokens == req.num_computed_tokens and s.num_new_tokens >= 1
            for p in range(s.num_computed_tokens, s.num_computed_tokens + s.num_new_tokens):
                slot = (table(req)[p // bs], p % bs)
                assert written.setdefault(slot, req.token_ids[p]) == req.token_ids[p]
        kv.update(written)
        for s in out.scheduled:
            req = s.request
            for p in range(s.num_computed_tokens + s.num_new_tokens):
                assert kv[table(req)[p // bs], p % bs] == req.token_ids[p], (req.request_id, p)
            if s.samples:
                num_samples[req.request_id] += 1
        update(sched, out)
        check_invariants(sched, kv)
    else:
        raise AssertionError("workload did not drain in 2000 steps")

    assert bm.num_free_blocks == num_blocks
    assert all(b.ref_count == 0 for b in bm.pools[0].blocks)
    for r in all_reqs:
        assert r.status.finished
        if r.request_id not in aborted:
            # Sampled once per output token: a recomputed request never samples twice.
            assert r.num_output_tokens == num_samples[r.request_id] == r.params.max_tokens
            assert r.status == RequestStatus.FINISHED_LENGTH
    return {
        "preemptions": sum(r.metrics.num_preemptions for r in all_reqs),
        "prefix_hits": bm.prefix_hits,
        "evictions": bm.pools[0].num_evictions,
    }


WORKLOADS = [
    # (seed, block size, num_blocks, token budget, max_num_seqs)
    (0, 4, 8, 16, 4),
    (1, 4, 6, 8, 4),
    (2, 2, 12, 10, 5),
    (3, 4, 10, 32, 6),
    (4, 3, 9, 7, 3),
    (5, 1, 12, 12, 4),
]


@pytest.mark.parametrize(
    "seed, bs, num_blocks, budget, max_num_seqs",
    WORKLOADS,
    ids=[f"seed{s}-bs{bs}-blocks{n}-budget{b}-seqs{m}" for s, bs, n, b, m in WORKLOADS],
)
def test_random_workload_keeps_exact_block_accounting(seed, bs, num_blocks, budget, max_num_seqs):
    stats = run_workload(seed, bs, num_blocks, budget, max_num_seqs)
    assert stats["preemptions"] > 0, stats  # the workload is sized to force preemptions
    assert stats["prefix_hits"] > 0, stats


def test_many_random_workloads():
    totals = [run_workload(seed, 4, 7, 12, 4) for seed in range(10, 30)]
    assert sum(t["preemptions"] for t in totals) > 0
    assert sum(t["prefix_hits"] for t in totals) > 0
    assert sum(t["evictions"] for t in totals) > 0


def test_waiting_requests_are_taken_fairly_among_clients():
    """Start-time fair queuing by prompt tokens: a client's backlog queues behind itself, not in
    front of another client's next prompt; one client keeps arrival order; a request put back
    (preempted) keeps its place at the front."""
    sched = make_sched(num_blocks=64, max_num_seqs=8, budget=8)  # one 8-token prompt a step
    for i in range(4):
        sched.add(_client_req(f"heavy{i}", "heavy"))
    sched.add(_client_req("light0", "light"))
    sched.add(_client_req("light1", "light"))
    assert ids(sched.waiting) == ["heavy0", "light0", "heavy1", "light1", "heavy2", "heavy3"]
    admitted = []
    for _ in range(3):
        items, _ = step(sched)
        admitted += [rid for rid, computed, _ in items if computed == 0]
    assert admitted == ["heavy0", "light0", "heavy1"]
    late = _client_req("late0", "late")  # a client arriving now starts at the virtual time
    sched.add(late)
    assert ids(sched.waiting) == ["light1", "late0", "heavy2", "heavy3"]  # ahead of heavy's backlog
    offline = make_sched(num_blocks=64)
    for i in range(3):
        offline.add(_client_req(f"r{i}", ""))
    assert ids(offline.waiting) == ["r0", "r1", "r2"]


def _client_req(rid: str, client: str) -> Request:
    seed = sum(map(ord, rid))
    req = make_req(rid, [(seed + 3 * i) % VOCAB for i in range(8)], max_tokens=4)  # no prefix hits
    req.client = client
    return req
