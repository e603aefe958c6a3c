"""KV offloading on a hybrid spec, exact: the full + sliding-window + compressed + state spec of
tests/test_kv_manager_hybrid.py, with the offload connector's host tier under the KV cache manager
and the scheduler, stepped without a model as the engine steps them (a planned load is written
before the step computes, and an all-or-none load that fails is taken back: EngineCore._load_kv).

Every table's evicted blocks are stored under their own key, and every evicted state snapshot;
a later request with the prefix loads, in every table, what a hit needs -- the history tables
every block, the window only the blocks its first computed token reads, and the state after the
hit -- or loads nothing. Entries are written with a salt per writer, so what was loaded can be
told from what was computed.
"""

from __future__ import annotations

import torch

from engine.kv_cache.connector import run_load
from engine.kv_cache.manager import KVCacheManager
from engine.kv_cache.offload import HostTier, KVOffloader
from engine.request import Request, RequestStatus
from engine.scheduler import Scheduler
from tests.test_kv_manager_hybrid import BS, SPEC, W, make_req

PROMPT = [(i * 41) % 600 + 1 for i in range(45)]  # 11 full blocks and one token
FULL, WINDOW = 24, 16  # blocks per pool: small, so other prompts evict the first one's
CHUNK = 48  # tokens a step computes or loads: the whole prompt's hit at once


class Engine:
    """A KV cache manager, scheduler and host-tier offloader over the hybrid spec."""

    def __init__(self, snapshots: int = 3):
        self.caches = SPEC.allocate((FULL, WINDOW, FULL), "cpu")
        self.offload = KVOffloader(SPEC, self.caches, [HostTier(capacity_blocks=512)])
        self.kv = KVCacheManager(
            SPEC,
            (FULL, WINDOW, FULL),
            on_evict=self.offload.on_evict,
            on_evict_state=self.offload.on_evict_state,
            num_state_slots=2,
            num_state_snapshots=snapshots,
        )
        self.sched = Scheduler(self.kv, max_num_seqs=2, max_num_batched_tokens=CHUNK, connector=self.offload)
        self.salt = 0.0
        self.loads: list[tuple[str, int, bool]] = []
        """(request, blocks planned, written whole) of every load."""

    def compute(self, req: Request, positions: range) -> None:
        for t, table in enumerate(SPEC.tables):
            for pos, slot in zip(positions, self.kv.slot_mapping(req, t, positions), strict=True):
                if slot >= 0:
                    for g in table.groups:
                        for i, layer in enumerate(g.layers):
                            row = self.caches.layer(g.kind, layer).view(-1, g.storage_width)
                            row[slot] = value(req.token_ids[pos], pos, t, i) + self.salt
        req.num_computed_tokens = positions.stop
        n = req.num_computed_tokens
        self.kv.states.state(req.request_id, "compressor").fill_(sum(req.token_ids[:n]) + n + self.salt)
        self.kv.snapshot_state(req)

    def run(self, *reqs: Request, on_step=None) -> None:
        for req in reqs:
            self.sched.add(req)
        for _ in range(1000):
            if not self.sched.num_unfinished:
                return
            out = self.sched.schedule()
            for item in list(out.scheduled):
                if item.kv_load is not None:  # EngineCore._load_kv
                    missing = run_load(self.offload, item.request.request_id, item.kv_load)
                    self.loads.append((item.request.request_id, len(item.kv_load.block_hashes), not missing))
                    if missing:
                        assert item.kv_load.all_or_none
                        self.sched.unadmit(item.request, item.kv_load)
                        out.scheduled.remove(item)
            for item in out.scheduled:
                req = item.request
                self.compute(
                    req, range(item.num_computed_tokens, item.num_computed_tokens + item.num_new_tokens)
                )
                if item.samples:
                    req.append_token(5)
                    if req.num_output_tokens >= req.params.max_tokens:
                        self.sched.finish(req, RequestStatus.FINISHED_LENGTH)
            if on_step is not None:
                on_step()
        raise AssertionError("did not finish")

    def rows(self, req: Request, t: int, block: int) -> list[torch.Tensor]:
        """Table t's rows of the request's block `block`, every layer of its groups."""
        b = req.block_ids[t][block]
        return [
            self.caches.layer(g.kind, layer)[SPEC.group_block_ids(g, [b])][0]
            for g in SPEC.tables[t].groups
            for layer in g.layers
        ]

    def all_free(self) -> bool:
        return self.kv.num_free_blocks == self.kv.num_blocks and self.kv.states.num_free_slots == 2


def value(token: int, pos: int, table: int, layer: int) -> torch.Tensor:
    return torch.arange(8, dtype=torch.float32) + token * 1000 + pos + table * 0.25 + layer * 0.125


def expected_rows(tokens: list[int], t: int, block: int, salt: float) -> list[torch.Tensor]:
    """What a writer with `salt` leaves in table t's block `block`: a row per token, or for the
    compressed table the entry the block's last token completes."""
    out = []
    for g in SPEC.tables[t].groups:
        for i, _ in enumerate(g.layers):
            if SPEC.tables[t].manager == "compressed":
                positions = [block * BS + BS - 1]
            else:
                positions = range(block * BS, block * BS + BS)
            out.append(torch.stack([value(tokens[p], p, t, i) + salt for p in positions]))
    return out


def evict_everything(engine: Engine) -> None:
    """Other prompts take every block and every snapshot row: the first prompt's go to the tier."""
    for i in range(3):
        engine.run(make_req(f"filler{i}", [700 + i * 97 + j for j in range(80)], max_tokens=1))


def admitted_with(engine: Engine, req: Request) -> tuple[int, list[int]]:
    """Admit req alone and stop before its first step computes: -> (tokens it starts with, blocks held per table)."""
    engine.sched.add(req)
    out = engine.sched.schedule()
    (item,) = out.scheduled
    assert run_load(engine.offload, req.request_id, item.kv_load) == 0 if item.kv_load else True
    return item.num_computed_tokens, engine.kv.num_held(req)


def test_every_table_and_the_state_go_to_the_tier_and_come_back():
    engine = Engine()
    engine.salt = 0.5  # what the first request computes
    first = make_req("a", PROMPT, max_tokens=1)
    engine.run(first)
    evict_everything(engine)
    stored = engine.offload.tiers[0]
    hashes = first.block_hashes[:11]
    for t in range(len(SPEC.tables)):  # every table's blocks under their own keys
        assert sum(engine.offload.key(h, t) in stored._blocks for h in hashes) >= 8, t
    assert any(engine.offload.key(h, "state") in stored._blocks for h in hashes)

    engine.salt = 0.0
    again = make_req("b", PROMPT, max_tokens=1)
    cached, held = admitted_with(engine, again)
    n = cached // BS
    assert n >= 8 and engine.offload.stats.loaded_blocks["host"] > 0
    # The window table took only what its first computed token reads, not the hit's blocks.
    first_read = SPEC.tables[1].first_needed(cached, BS)
    assert (
        again.block_ids[1][:first_read] == [0] * first_read
        and held[1] == len(again.block_ids[1]) - first_read
    )
    for t, table in enumerate(SPEC.tables):
        for b in range(table.first_needed(cached, BS), n):  # loaded: the first request's values
            got, want = engine.rows(again, t, b), expected_rows(PROMPT, t, b, salt=0.5)
            assert all(torch.equal(x, y) for x, y in zip(got, want, strict=True)), (t, b)
    state = engine.kv.states.state("b", "compressor")
    assert torch.all(state == sum(PROMPT[:cached]) + cached + 0.5)  # the snapshot at the hit, loaded
    engine.sched.finish(again, RequestStatus.FINISHED_ABORTED)
    assert engine.all_free()
    engine.offload.close()


def test_the_hit_ends_where_the_tier_holds_a_state_and_the_window():
    engine = Engine()
    first = make_req("a", PROMPT, max_tokens=1)
    engine.run(first)
    evict_everything(engine)
    offload, hashes = engine.offload, first.block_hashes[:11]
    held = {k for k in offload.tiers[0]._blocks}
    full = offload._longest(held, hashes, 0)
    assert full >= 8
    # Without the state after block full - 1, the hit ends at the last block with one.
    without_state = held - {offload.key(hashes[full - 1], "state")}
    shorter = offload._longest(without_state, hashes, 0)
    assert shorter < full and offload.key(hashes[shorter - 1], "state") in held
    # Without a window block the token after the hit reads, that hit is refused too; one the
    # window no longer reads is not needed.
    need = SPEC.tables[1].first_needed(full * BS, BS)
    assert offload._longest(held - {offload.key(hashes[need], 1)}, hashes, 0) < full
    if need:
        assert offload._longest(held - {offload.key(hashes[need - 1], 1)}, hashes, 0) == full
    # Without a full-attention block, nothing after it.
    assert offload._longest(held - {offload.key(hashes[2], 0)}, hashes, 0) <= 2
    offload.close()


def test_a_load_that_fails_is_taken_back_and_computed_and_nothing_leaks():
    engine = Engine()
    first = make_req("a", PROMPT, max_tokens=1)
    engine.run(first)
    evict_everything(engine)
    offload = engine.offload
    # Corrupt one window block the hit needs: the load must fail whole, not in part.
    n = offload._longest(set(offload.tiers[0]._blocks), first.block_hashes[:11], 0)
    key = offload.key(first.block_hashes[n - 1], 1)
    blob = bytearray(offload.tiers[0]._blocks[key])
    blob[-1] ^= 0xFF
    offload.tiers[0]._blocks[key] = bytes(blob)

    again = make_req("b", PROMPT, max_tokens=3)
    engine.run(again)
    ok = [(rid, planned) for rid, planned, whole in engine.loads if rid == "b" and whole]
    failed = [(rid, planned) for rid, planned, whole in engine.loads if rid == "b" and not whole]
    assert failed and failed[0][1] == n and offload.stats.checksum_failures >= 1
    assert all(planned < n for _, planned in ok)  # the retry was not planned onto the bad block
    assert again.status is RequestStatus.FINISHED_LENGTH and again.num_output_tokens == 3
    assert engine.all_free()
    offload.close()


def test_a_window_table_holds_o_window_blocks_when_a_long_prompt_loads():
    engine = Engine(snapshots=16)
    long_prompt = [(i * 7) % 300 + 1 for i in range(88)]  # 22 blocks, more than a chunk loads
    first = make_req("a", long_prompt, max_tokens=1)
    engine.run(first)
    evict_everything(engine)
    again = make_req("b", long_prompt, max_tokens=1)
    bound = -(-(W - 1) // BS) + -(-CHUNK // BS) + 1  # the window, a chunk, one straddling
    held = []
    engine.run(again, on_step=lambda: held.append(engine.kv.num_held(again)[1]))
    assert held and max(held) <= bound
    assert any(rid == "b" and whole for rid, _, whole in engine.loads)
    assert engine.all_free()
    engine.offload.close()
