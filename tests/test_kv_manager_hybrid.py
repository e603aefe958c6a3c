"""The KV cache manager on a hybrid spec, exact: a full-attention table, a sliding-window table, a
compressed table and a per-request state, driven through the scheduler the way the engine drives
them (DeepSeek-V4's shape: a window over the recent tokens, compressed entries for the rest,
compressor state carried between steps).

Legend: block size BS = 4 tokens; window W = 10 tokens (a token reads the 9 before it: 3 blocks
before a block boundary); the compressed group keeps one entry per 4 tokens, one entry per block.
Tables: 0 full, 1 window, 2 compressed. "Steps" run no model: a step's tokens are appended by the
test, as the engine's update does, and the state is written as the runner would write it.
"""

from __future__ import annotations

import random

import pytest
import torch

from engine.kv_cache.cache_group import CacheGroupSpec, CacheKind, StateSpec
from engine.kv_cache.manager import KVCacheManager, size_tables
from engine.kv_cache.spec import KVCacheSpec
from engine.request import Request, RequestStatus
from engine.runner import table_inputs
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from tests.engine_testing import table

BS, W = 4, 10
FULL = CacheGroupSpec(CacheKind.LATENT, (0, 1), BS, 8, torch.float32)
WINDOW = CacheGroupSpec(CacheKind.SLIDING_WINDOW, (0, 1), BS, 8, torch.float32, window=W)
COMPRESSED = CacheGroupSpec(CacheKind.COMPRESSED, (0,), 1, 8, torch.float32, tokens_per_entry=4)
STATE = StateSpec("compressor", (0,), (2, 3), torch.float32)
SPEC = KVCacheSpec((FULL, WINDOW, COMPRESSED), "hybrid", (STATE,))
TABLES = ("full", "window", "compressed")


def manager(full: int = 64, window: int = 32, slots: int = 4, snapshots: int = 16, **kw) -> KVCacheManager:
    return KVCacheManager(
        SPEC,
        (full, window, full),
        num_state_slots=slots,
        num_state_snapshots=snapshots,
        num_draft_positions=3,
        **kw,
    )


def make_req(rid: str, prompt: list[int], max_tokens: int = 4) -> Request:
    return Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens))


def write_state(kv: KVCacheManager, req: Request) -> None:
    """What the runner does after a step: the compressor state becomes a function of the tokens
    computed so far (so a restored state can be checked against the one it should be)."""
    n = req.num_computed_tokens
    kv.states.state(req.request_id, "compressor").copy_(
        torch.full((1, 2, 3), float(sum(req.token_ids[:n]) + n))
    )


def run(sched: Scheduler, on_step=None, max_steps: int = 10_000) -> None:
    """The engine's loop without a model: schedule, compute, append a token where a chunk samples
    (a function of the history), write the state, snapshot it at block boundaries, finish at max_tokens."""
    kv = sched.kv
    for _ in range(max_steps):
        if not sched.num_unfinished:
            return
        out = sched.schedule()
        for item in out.scheduled:
            req = item.request
            req.num_computed_tokens += item.num_new_tokens
            write_state(kv, req)
            kv.snapshot_state(req)
            if item.samples:
                req.append_token((sum(req.token_ids[-3:]) * 7) % 1000)
                if req.num_output_tokens >= req.params.max_tokens:
                    sched.finish(req, RequestStatus.FINISHED_LENGTH)
        if on_step is not None:
            on_step(out)
    raise AssertionError("did not finish")


def held(kv: KVCacheManager) -> list[int]:
    """Blocks in use per table."""
    return [p.num_usable_blocks - p.num_free_blocks for p in kv.pools]


# ---- the window holds a window ----------------------------------------------------------------


def test_a_10k_token_request_holds_a_window_of_blocks_at_every_step():
    """A 10,000-token prompt in 64-token chunks, then decodes: at every step the window table
    holds at most the blocks of W - 1 tokens before a chunk plus the chunk's (and one where they
    straddle), the blocks behind it are back in the window pool while the request runs, and the
    full and compressed tables hold the whole history."""
    n, chunk = 10_000, 64
    kv = manager(full=2600, window=24)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=chunk)
    req = make_req("long", [i % 997 for i in range(n)], max_tokens=20)
    sched.add(req)
    bound = -(-(W - 1) // BS) + chunk // BS + 1
    seen = []

    def check(out) -> None:
        if req.status is not RequestStatus.RUNNING:
            return
        full, window, compressed = kv.num_held(req)
        need = -(-(req.num_computed_tokens + 1) // BS)  # blocks of the tokens so far and the next one's
        assert full == compressed == len(table(req, 0)) >= need - 1
        assert window <= bound, (req.num_computed_tokens, window)
        assert held(kv) == [full, window, compressed]  # nothing else holds a block
        # Given back at this step's allocation: every block behind the window of its first token.
        start = out.scheduled[0].num_computed_tokens
        behind = max(0, start - (W - 1)) // BS
        null = kv.pools[1].null_block.block_id
        assert table(req, 1)[:behind] == [null] * behind and null not in table(req, 1)[behind:]
        seen.append(window)

    run(sched, on_step=check)
    assert len(seen) > n // chunk and max(seen) <= bound < 2600 // 100  # O(window), never O(history)
    assert req.status is RequestStatus.FINISHED_LENGTH and req.num_output_tokens == 20
    assert held(kv) == [0, 0, 0] and kv.states.num_free_slots == 4


def test_blocks_behind_the_window_are_freed_exactly_as_the_window_passes():
    kv = manager()
    req = make_req("a", list(range(40)))
    assert kv.allocate_slots(req, 20)  # 5 blocks in every table
    assert [len(t) for t in req.block_ids] == [5, 5, 5] and held(kv) == [5, 5, 5]
    req.num_computed_tokens = 20
    # The token at 20 reads tokens 11..20: blocks 2.. of the window; blocks 0 and 1 go back.
    assert kv.allocate_slots(req, 1)
    null = kv.pools[1].null_block.block_id
    assert table(req, 1)[:2] == [null, null] and held(kv) == [6, 4, 6]
    assert kv.num_held(req) == [6, 4, 6]
    kv.free(req)
    assert held(kv) == [0, 0, 0] and req.block_ids == []


# ---- prefix hits: every table or none ---------------------------------------------------------


def _finished(kv: KVCacheManager, prompt: list[int], chunk: int = 8) -> Request:
    """Run a request to the end through a scheduler whose chunks end on block boundaries."""
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=chunk)
    req = make_req("first", prompt, max_tokens=1)
    sched.add(req)
    run(sched)
    return req


def test_an_aligned_hit_serves_every_table_with_the_window_as_null_blocks():
    kv = manager()
    prompt = list(range(100, 126))  # 26 tokens: 6 full blocks; chunks end at 8, 16, 24, 26
    first = _finished(kv, prompt)
    hashes = first.block_hashes[:6]
    again = make_req("again", prompt + [5])
    hit = kv.get_computed_blocks(again)
    assert hit.num_tokens == 24 and [len(b) for b in hit.blocks] == [6, 6, 6]
    assert hit.blocks[1][:3] == [None, None, None]  # behind the window: not needed
    assert [b.block_hash for b in hit.blocks[1][3:]] == hashes[3:]
    assert [b.block_hash for b in hit.blocks[0]] == [b.block_hash for b in hit.blocks[2]] == hashes
    assert kv.allocate_slots(again, again.num_tokens - 24, hit)
    null = kv.pools[1].null_block.block_id
    assert table(again, 1)[:3] == [null] * 3 and len(table(again, 1)) == 7
    # The state starts where the first request's was after its 24 tokens.
    assert kv.states.state("again", "compressor")[0, 0, 0].item() == sum(prompt[:24]) + 24


def test_an_unaligned_hit_shrinks_to_where_a_state_snapshot_exists():
    """A prompt that shares 21 tokens with the first: the full and compressed tables could serve 5
    blocks, but the first request's chunks ended at 8, 16 and 24 tokens only, so the state exists
    after blocks 2 and 4 (and 6): the hit is 16 tokens in every table."""
    kv = manager()
    prompt = list(range(100, 126))
    _finished(kv, prompt)
    other = make_req("other", prompt[:21] + [9] * 10)
    hit = kv.get_computed_blocks(other)
    assert hit.num_tokens == 16 and [len(b) for b in hit.blocks] == [4, 4, 4]
    assert hit.blocks[1][0] is None and None not in hit.blocks[1][1:]


def test_a_hit_the_window_cannot_serve_is_no_hit_in_any_table():
    """The window blocks of the first request are evicted by another (the window pool is small);
    its full and compressed blocks are still cached, but a hit needs the window's last blocks: none."""
    kv = manager(window=8)
    prompt = list(range(100, 126))
    _finished(kv, prompt)
    filler = make_req("filler", list(range(500, 528)))
    assert kv.allocate_slots(filler, 28)  # 7 window blocks: every free one, cached ones evicted first
    assert kv.pools[0].lookup(kv_hash := filler.block_hashes[0]) is not None and kv_hash
    probe = make_req("probe", prompt + [5])
    hit = kv.get_computed_blocks(probe)
    assert hit.num_tokens == 0 and hit.blocks == ([], [], [])


def test_prefix_caching_off_or_prompt_logprobs_hit_nothing():
    kv = manager(enable_prefix_caching=False)
    prompt = list(range(100, 126))
    _finished(kv, prompt)
    assert kv.get_computed_blocks(make_req("b", prompt + [1])).num_tokens == 0
    kv = manager()
    _finished(kv, prompt)
    wants = Request("c", prompt + [1], SamplingParams(prompt_logprobs=1))
    assert kv.get_computed_blocks(wants).num_tokens == 0


# ---- state: slots, snapshots, rollback --------------------------------------------------------


def test_state_slots_are_allocated_at_admission_and_refused_when_none_is_free():
    kv = manager(slots=2)
    a, b, c = (make_req(r, list(range(8))) for r in "abc")
    assert kv.allocate_slots(a, 4) and kv.allocate_slots(b, 4)
    before = (held(kv), [list(p.free_queue) for p in kv.pools])
    assert not kv.allocate_slots(c, 4)  # blocks enough, no state slot: nothing changes
    assert (held(kv), [list(p.free_queue) for p in kv.pools]) == before and c.block_ids == []
    kv.states.state("a", "compressor").fill_(7.0)
    kv.free(a)
    assert kv.allocate_slots(c, 4)
    assert not kv.states.state("c", "compressor").any()  # a fresh slot is zeroed


def test_a_rejected_drafts_state_is_rolled_back_to_the_accepted_one():
    kv = manager()
    req = make_req("s", list(range(8)))
    assert kv.allocate_slots(req, 8)
    state = kv.states.state("s", "compressor")
    state.fill_(1.0)
    drafts = kv.states.draft_states("s", "compressor")  # [k + 1, layers, 2, 3]
    assert drafts.shape == (3, 1, 2, 3)
    for i in range(3):
        drafts[i].fill_(10.0 + i)
    kv.states.accept("s", 1)  # the known token and one draft accepted, the second rejected
    assert torch.equal(state, torch.full((1, 2, 3), 11.0))


def test_snapshots_are_evicted_least_recently_used():
    kv = manager(snapshots=2)
    pool = kv.states
    req = make_req("s", list(range(8)))
    assert kv.allocate_slots(req, 8)
    for i, h in enumerate((b"h0", b"h1", b"h2")):
        pool.state("s", "compressor").fill_(float(i))
        pool.snapshot("s", h)
    assert pool.longest_snapshot([b"h0", b"h1", b"h2"], 3) == 3 and pool.num_cached_snapshots == 2
    assert pool.longest_snapshot([b"h0"], 1) == 0  # the oldest went
    pool.restore("s", b"h1")
    assert pool.state("s", "compressor")[0, 0, 0].item() == 1.0


# ---- preemption and abort at every phase free every table exactly once ------------------------


@pytest.mark.parametrize("seed", range(6))
def test_preemption_and_abort_at_every_phase_free_every_table_once(seed):
    """Random prompts (shared prefixes, so hits happen) on pools small enough to preempt, with
    aborts of random requests in every phase (waiting, mid-prefill, decoding): after every step
    each pool's references are exactly the running requests' blocks, and at the end every pool
    and every state slot is free."""
    rng = random.Random(seed)
    kv = manager(full=40, window=24, slots=6)
    sched = Scheduler(kv, max_num_seqs=6, max_num_batched_tokens=rng.choice([8, 16, 24]))
    stem = [rng.randrange(1000) for _ in range(40)]
    reqs = []
    for i in range(14):
        prompt = stem[: rng.randrange(0, 40)] + [rng.randrange(1000) for _ in range(rng.randrange(1, 30))]
        reqs.append(make_req(f"r{i}", prompt, max_tokens=rng.randrange(1, 12)))
        sched.add(reqs[-1])
    phases = set()

    def check(out) -> None:
        if rng.random() < 0.15:
            live = [r for r in reqs if not r.status.finished]
            if live:
                victim = rng.choice(live)
                phases.add(
                    "waiting"
                    if victim.status is not RequestStatus.RUNNING
                    else "prefill"
                    if victim.num_computed_tokens < victim.num_prompt_tokens
                    else "decode"
                )
                sched.finish(victim, RequestStatus.FINISHED_ABORTED)
        for t, pool in enumerate(kv.pools):
            refs = sum(b.ref_count for b in pool.blocks if b is not pool.null_block)
            null = pool.null_block.block_id if pool.null_block is not None else None
            owned = sum(1 for r in sched.running for b in table(r, t) if b != null)
            assert refs == owned, (TABLES[t], refs, owned)
        assert kv.states.num_free_slots == 6 - len(sched.running)
        for r in sched.waiting:
            assert r.block_ids == [] and not kv.states.holds(r.request_id)

    run(sched, on_step=check)
    assert held(kv) == [0, 0, 0] and kv.states.num_free_slots == 6
    assert all(r.status.finished for r in reqs)
    assert phases and sum(r.metrics.num_preemptions for r in reqs) + len(phases) > 1


# ---- where entries are written, and sizing ----------------------------------------------------


def test_the_compressed_table_writes_an_entry_when_it_completes():
    kv = manager()
    req = make_req("a", list(range(12)))
    assert kv.allocate_slots(req, 12)
    blocks = table(req, 2)
    # One entry per block (4 tokens per entry, 4 tokens per block): written by tokens 3, 7, 11.
    assert kv.slot_mapping(req, 2, range(12)) == [
        -1,
        -1,
        -1,
        blocks[0],
        -1,
        -1,
        -1,
        blocks[1],
        -1,
        -1,
        -1,
        blocks[2],
    ]
    full = table(req, 0)
    assert kv.slot_mapping(req, 0, range(5, 7)) == [full[1] * BS + 1, full[1] * BS + 2]


def test_tables_are_sized_by_what_they_hold():
    """A window table holds what max_num_seqs requests can hold at once (not their history); the
    full and compressed tables share the rest of the budget, covering the same tokens."""
    per = {t.manager: SPEC.table_bytes_per_block(t) for t in SPEC.tables}
    counts = size_tables(SPEC, 1 << 20, max_num_seqs=8, max_model_len=4096, max_num_batched_tokens=64)
    window_blocks = 8 * (3 + 2) + 16 + 1  # each request's window and straddle, one step's tokens, null
    assert counts[1] == window_blocks
    expect = ((1 << 20) - window_blocks * per["sliding_window"]) // (per["full"] + per["compressed"])
    assert counts[0] == counts[2] == expect
    assert size_tables(SPEC, 1 << 20, 8, 4096, 64, num_blocks=100)[::2] == (100, 100)
    # A short max_model_len caps both: no request could use more.
    assert size_tables(SPEC, 1 << 30, 2, 16, 64) == (8, 2 * 4 + 1, 8)


def test_a_request_is_bounded_by_the_history_tables_not_the_window():
    """validate_request bounds prompt + max_tokens by the blocks of the tables that keep a whole
    history; a window table's few blocks bound nothing, and a spec of windows alone has no bound."""
    from engine.kv_cache.manager import history_blocks
    from engine.sampling_params import validate_request

    assert history_blocks(SPEC, (40, 9, 50)) == 40
    window_only = KVCacheSpec((WINDOW,), "w")
    assert history_blocks(window_only, (9,)) is None
    long = list(range(1000))
    validate_request(long, SamplingParams(max_tokens=8), 2000, 4096, BS, history_blocks(window_only, (9,)))
    with pytest.raises(ValueError, match=r"needs 252 KV blocks, more than num_kv_blocks \(40\)"):
        validate_request(
            long, SamplingParams(max_tokens=8), 2000, 4096, BS, history_blocks(SPEC, (40, 9, 50))
        )


def test_a_prompt_chunk_ends_on_its_last_block_boundary_so_its_state_is_kept():
    """With states, a 26-token prompt under a 64-token budget runs as 24 tokens (ending on a block
    boundary, where the state is snapshotted) and then 2 that sample; the same prompt later starts
    from 24 tokens in every table. A spec without states keeps the one 26-token chunk."""
    kv = manager()
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64)
    prompt = list(range(100, 126))
    first = make_req("first", prompt, max_tokens=1)
    sched.add(first)
    chunks = []
    run(
        sched,
        on_step=lambda out: chunks.extend((s.num_computed_tokens, s.num_new_tokens) for s in out.scheduled),
    )
    assert chunks == [(0, 24), (24, 2)]
    assert kv.get_computed_blocks(make_req("again", prompt + [5])).num_tokens == 24

    no_state = KVCacheManager(KVCacheSpec((FULL, WINDOW, COMPRESSED), "hybrid"), (64, 32, 64))
    sched = Scheduler(no_state, max_num_seqs=4, max_num_batched_tokens=64)
    sched.add(make_req("first", prompt, max_tokens=1))
    assert [(s.num_computed_tokens, s.num_new_tokens) for s in sched.schedule().scheduled] == [(0, 26)]


def test_the_runner_sees_every_table_of_a_step_in_the_batchs_order():
    """runner.table_inputs: each table's slot mapping and each request's blocks there, decode
    groups (by query length) then prefills, as the manager holds them -- a window's behind its
    window are the null block, which no token's entry is ever written to."""
    kv = manager()
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=16)
    for i, n in enumerate((30, 7, 19)):
        sched.add(make_req(f"r{i}", [(i * 13 + j) % 97 + 1 for j in range(n)], max_tokens=6))
    seen = []

    def check(out) -> None:
        # The batch's order: decodes first (one group here: every decode runs one token), then prefills.
        items = [it for it in out.scheduled if it.is_decode] + [
            it for it in out.scheduled if not it.is_decode
        ]
        for t in range(len(SPEC.tables)):
            got = table_inputs(SPEC, t, items, "cpu")
            want = []
            for it in items:
                positions = range(it.num_computed_tokens, it.num_computed_tokens + it.query_len)
                want += kv.slot_mapping(it.request, t, positions)
            assert got.slot_mapping.tolist() == want
            decodes = [it.request.block_ids[t] for it in items if it.is_decode]
            assert [
                row[: len(b)] for g in got.decode_tables for row, b in zip(g.tolist(), decodes, strict=True)
            ] == decodes
            prefills = [it for it in items if not it.is_decode]
            assert [b.tolist() for b in got.prefill_blocks] == [
                it.request.block_ids[t][: -(-(it.num_computed_tokens + it.query_len) // BS)]
                for it in prefills
            ]
            if SPEC.tables[t].windowed:  # nothing lands in the null block
                assert all(s >= BS for s in want)
            seen.append((t, len(decodes), len(prefills)))

    # `check` sees each step's items as scheduled, before `run` computes them.
    original = sched.schedule

    def schedule():
        out = original()
        check(out)
        return out

    sched.schedule = schedule
    run(sched)
    assert any(d and p for _, d, p in seen)  # a step with decodes and prefills together was checked
