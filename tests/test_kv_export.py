"""The exports' lease state machine (engine/kv_cache/export.py) under a fake clock: every way an
export ends (release done/abort, expiry, abort_all) ends it once and hands its blocks to the
engine once, never under a read; leases and per-caller pinned blocks are bounded. The engine and
worker paths around it are tested in test_kv_handover.py and test_services_e2e.py."""

from __future__ import annotations

import pytest

import engine.kv_cache.export as export_mod
from engine.kv_cache.export import (
    Export,
    ExportNotFound,
    ExportOptions,
    ExportReleasing,
    ExportState,
    ExportTable,
    PinLimitExceeded,
)
from engine.request import Request
from engine.sampling_params import SamplingParams
from services.common.grpc_utils import caller_key

# ---- the lease state machine --------------------------------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def time(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(export_mod, "time", fake)  # the module's `time`, not the global one
    return fake


@pytest.fixture
def freed() -> list[str]:
    return []


def _table(freed: list[str], **limits) -> ExportTable:
    """A table whose ended exports are taken (as the engine thread frees them) as soon as
    on_end says one ended; `freed` records their request ids in order."""

    def on_end() -> None:
        freed.extend(e.request_id for e in table.take_ended())

    table = ExportTable(**limits, on_end=on_end)
    return table


@pytest.fixture
def table(clock, freed) -> ExportTable:
    return _table(freed, max_lease_s=60.0)


def _export(table: ExportTable, request_id: str, lease_s: float = 10.0, caller: str = "") -> Export:
    """Export a finished 11-token request that holds blocks 4, 5, 6."""
    req = Request(request_id, list(range(11)), SamplingParams())
    req.block_ids = [[4, 5, 6]]
    return table.add(req, [b"h0", b"h1"], None, ExportOptions(lease_s, caller))


def _counts(table: ExportTable) -> dict[str, int]:
    return {s.value: n for s, n in table.counts.items() if n}


def test_create_records_the_transfer(table, clock):
    t = _export(table, "a", lease_s=2.5)
    assert (t.request_id, t.block_ids, t.block_hashes, t.num_tokens) == ("a", [4, 5, 6], [b"h0", b"h1"], 11)
    assert t.state is ExportState.PENDING
    assert t.lease_expiry == 1002.5
    assert table.get(t.export_id) is t
    assert len(table) == 1
    assert _export(table, "b").export_id != t.export_id


def test_unknown_transfer_is_not_found(table, freed):
    for call in (
        lambda: table.get("nope"),
        lambda: table.begin_read("nope"),
        lambda: table.release("nope", done=True),
        lambda: table.renew("nope", 1.0),
    ):
        with pytest.raises(ExportNotFound, match=r"unknown transfer 'nope'"):
            call()
    assert freed == []


@pytest.mark.parametrize("done, state", [(True, ExportState.SUCCEEDED), (False, ExportState.ABORTED)])
def test_release_frees_once_and_ends_the_transfer(table, freed, done, state):
    t = _export(table, "a")
    table.release(t.export_id, done=done)
    assert freed == ["a"]
    assert t.state is state
    assert _counts(table) == {state.value: 1}
    assert len(table) == 0
    ended = rf"transfer '{t.export_id}' has ended \({state.value}\)"
    for call in (
        lambda: table.get(t.export_id),
        lambda: table.begin_read(t.export_id),
        lambda: table.release(t.export_id, done=True),
        lambda: table.renew(t.export_id, 1.0),
    ):
        with pytest.raises(ExportNotFound, match=ended):
            call()
    assert freed == ["a"]
    assert _counts(table) == {state.value: 1}


def test_release_during_a_pull_waits_for_the_pull_to_end(table, freed):
    t = _export(table, "a")
    assert table.begin_read(t.export_id) is t
    assert t.state is ExportState.READING
    table.release(t.export_id, done=True)
    assert freed == []
    assert t.state is ExportState.READING and t.pending_end is ExportState.SUCCEEDED
    assert table.get(t.export_id) is t
    with pytest.raises(ExportNotFound, match="is being released"):
        table.begin_read(t.export_id)
    with pytest.raises(ExportReleasing, match="is being released"):
        table.renew(t.export_id, 1.0)
    table.end_read(t)
    assert freed == ["a"]
    assert t.state is ExportState.SUCCEEDED
    assert _counts(table) == {"succeeded": 1}
    assert len(table) == 0


def test_release_waits_for_every_concurrent_pull(table, freed):
    t = _export(table, "a")
    table.begin_read(t.export_id)
    table.begin_read(t.export_id)
    table.release(t.export_id, done=False)
    table.end_read(t)
    assert freed == [] and t.active_reads == 1
    table.end_read(t)
    assert freed == ["a"]
    assert _counts(table) == {"aborted": 1}


def test_expire_due_frees_expired_transfers_not_pulled_ones(table, freed, clock):
    a = _export(table, "a", lease_s=0.05)
    b = _export(table, "b", lease_s=10.0)
    c = _export(table, "c", lease_s=0.05)
    table.begin_read(c.export_id)
    clock.now = 1000.05  # exactly at the expiry: not yet past it
    assert table.expire_due() == 0
    clock.now = 1001.0
    assert table.expire_due() == 1
    assert freed == ["a"]
    assert a.state is ExportState.EXPIRED
    with pytest.raises(ExportNotFound, match=r"has ended \(expired\)"):
        table.get(a.export_id)
    assert table.get(b.export_id) is b
    assert table.get(c.export_id) is c  # past its lease, but streaming
    # The end of a pull leaves 5 s for the Release that follows.
    table.end_read(c)
    assert c.lease_expiry == 1006.0
    clock.now = 1006.0
    assert table.expire_due() == 0
    clock.now = 1006.1
    assert table.expire_due() == 1
    assert freed == ["a", "c"]
    clock.now = 1010.1
    assert table.expire_due() == 1
    assert freed == ["a", "c", "b"]
    assert _counts(table) == {"expired": 3}
    assert table.expire_due() == 0 and len(table) == 0


def test_get_of_an_expired_transfer_ends_it_once(table, freed, clock):
    t = _export(table, "a", lease_s=1.0)
    clock.now = 1002.0
    with pytest.raises(ExportNotFound, match=r"has ended \(expired\)"):
        table.get(t.export_id)
    assert freed == ["a"]
    assert table.expire_due() == 0
    with pytest.raises(ExportNotFound, match=r"has ended \(expired\)"):
        table.begin_read(t.export_id)
    assert freed == ["a"]
    assert _counts(table) == {"expired": 1}


def test_renew_extends_and_never_shortens(table, freed, clock):
    t = _export(table, "a", lease_s=1.0)
    clock.now = 1000.5
    assert table.renew(t.export_id, 10.0) == 1010.5
    assert t.lease_expiry == 1010.5
    clock.now = 1005.0
    assert table.expire_due() == 0
    assert table.renew(t.export_id, 1.0) == 1010.5  # a shorter lease keeps the longer one
    clock.now = 1010.6
    assert table.expire_due() == 1
    assert freed == ["a"]


def test_leases_are_capped_at_max_lease_s(clock, freed):
    table = _table(freed, max_lease_s=2.0)
    t = _export(table, "a", lease_s=100.0)
    assert t.lease_expiry == 1002.0
    clock.now = 1001.0
    assert table.renew(t.export_id, 100.0) == 1003.0
    clock.now = 1003.5
    assert table.expire_due() == 1
    assert freed == ["a"]


def test_abort_all_frees_every_transfer(table, freed):
    ts = [_export(table, rid) for rid in ("a", "b", "c")]
    table.abort_all()
    assert freed == ["a", "b", "c"]
    assert [t.state for t in ts] == [ExportState.ABORTED] * 3
    assert _counts(table) == {"aborted": 3}
    assert len(table) == 0
    with pytest.raises(ExportNotFound, match=r"has ended \(aborted\)"):
        table.get(ts[0].export_id)


def test_abort_all_does_not_free_a_transfer_under_its_pull(table, freed):
    """The module's contract: "A transfer that is being streamed is not freed under the stream"
    (its blocks would go back to the engine while the Pull still reads them)."""
    a, b = _export(table, "a"), _export(table, "b")
    table.begin_read(b.export_id)
    table.abort_all()
    assert freed == ["a"]
    table.end_read(b)
    assert freed == ["a", "b"]
    assert [a.state, b.state] == [ExportState.ABORTED, ExportState.ABORTED]
    assert _counts(table) == {"aborted": 2}


# ---- bounds on pinned KV ------------------------------------------------------------------------


def test_renewals_cannot_pin_past_max_total_lease_s(clock, freed):
    table = _table(freed, max_lease_s=60.0, max_total_lease_s=100.0)
    t = _export(table, "a", lease_s=10.0)
    assert t.created == 1000.0
    clock.now = 1005.0
    assert table.renew(t.export_id, 60.0) == 1065.0
    clock.now = 1050.0
    assert table.renew(t.export_id, 60.0) == 1100.0  # 1110 capped at created + 100
    for now in (1060.0, 1090.0, 1099.0):
        clock.now = now
        assert table.renew(t.export_id, 60.0) == 1100.0
    clock.now = 1100.0
    assert table.expire_due() == 0
    clock.now = 1100.1
    assert table.expire_due() == 1
    assert freed == ["a"]


def test_a_first_lease_is_capped_at_max_total_lease_s(clock, freed):
    table = _table(freed, max_lease_s=300.0, max_total_lease_s=20.0)
    assert _export(table, "a", lease_s=100.0).lease_expiry == 1020.0


def test_pulls_cannot_pin_past_max_total_lease_s(clock, freed):
    """The end of a pull leaves room for the Release, but not past the total; no pull starts
    after the lease ran out, even while another one is still streaming."""
    table = _table(freed, max_lease_s=60.0, max_total_lease_s=10.0)
    t = _export(table, "a", lease_s=10.0)
    clock.now = 1008.0
    table.begin_read(t.export_id)
    table.end_read(t)
    assert t.lease_expiry == 1010.0  # not 1013
    table.begin_read(t.export_id)
    clock.now = 1012.0  # the pull ran past the lease: a second one may not start
    with pytest.raises(ExportNotFound, match="has run out of lease"):
        table.begin_read(t.export_id)
    assert t.active_reads == 1
    table.end_read(t)
    assert t.lease_expiry == 1010.0
    assert table.expire_due() == 1
    assert freed == ["a"]


def test_bad_max_total_lease_s_is_refused(freed):
    with pytest.raises(ValueError, match="max_total_lease_s must be > 0, got 0"):
        _table(freed, max_total_lease_s=0)


def test_pinned_blocks_are_shared_fairly_among_callers(table, freed):
    """Every caller's transfers and reservations together stay within the limit, each block counted
    once; past it, a caller under its fair share (limit / callers pinning) may still pin up to its
    share (every caller's together then up to the ceiling), and one over its share may not."""
    a = _export(table, "r1", caller="client-a")  # 3 blocks: 0, 1, 2
    assert a.caller == "client-a"
    assert table.pinned_blocks("client-a") == table.pinned_blocks() == 3
    table.reserve("client-a", 5, limit=8)
    assert table.pinned_blocks("client-a") == 8
    with pytest.raises(PinLimitExceeded, match=r"has 8 KV blocks pinned; 1 more would pass its share of 8"):
        table.reserve("client-a", 1, limit=8)
    # client-b: its share is 8 / 2 = 4 while client-a pins; the pool may then hold up to 12.
    table.reserve("client-b", 4, limit=8, ceiling=12)
    with pytest.raises(
        PinLimitExceeded, match=r"client-b has 4 KV blocks pinned; 1 more would pass its share of 4"
    ):
        table.reserve("client-b", 1, limit=8, ceiling=12)
    with pytest.raises(PinLimitExceeded, match=r"client-a has 8 KV blocks pinned.* share of 4 .*2 caller"):
        table.reserve("client-a", 1, limit=8, ceiling=12)  # over its share: refused
    assert table.pinned_blocks() == 12  # nothing changed
    with pytest.raises(PinLimitExceeded, match="share of 2"):  # a third client: its share is 8 / 3
        table.reserve("client-c", 3, limit=8, ceiling=20)
    table.reserve("client-c", 2, limit=8, ceiling=20)
    table.unreserve("client-c", 2)
    table.unreserve("client-a", 5)
    table.release(a.export_id, done=True)
    assert freed == ["r1"]
    assert table.pinned_blocks("client-a") == 0 and table.pinned_blocks() == 4
    table.reserve("client-a", 4, limit=8)  # room again under the limit
    table.unreserve("client-a", 4)
    table.unreserve("client-b", 4)
    assert table.pinned_blocks() == 0 and table._reserved == {}


def test_blocks_several_exports_share_are_pinned_once(table):
    """The n samples of one prompt export the same prompt blocks: they count once."""
    first = _export(table, "r1", caller="client-a")
    second = _export(table, "r2", caller="client-a")  # the same blocks 4, 5, 6
    assert second.block_ids == first.block_ids
    assert table.pinned_blocks("client-a") == table.pinned_blocks() == 3
    _export(table, "r3", caller="client-b")
    assert table.pinned_blocks("client-b") == 3 and table.pinned_blocks() == 3


@pytest.mark.parametrize(
    "peer, key",
    [
        ("ipv4:127.0.0.1:51234", "127.0.0.1"),
        ("ipv6:[::1]:51234", "::1"),
        ("ipv6:[fe80::1%eth0]:80", "fe80::1%eth0"),
        ("unix:/tmp/pdserve.sock", "unix:/tmp/pdserve.sock"),
    ],
)
def test_caller_key_is_the_peer_host_without_its_port(peer, key):
    assert caller_key(peer) == key


# ---- remote reads (a peer READs the blocks itself, over NIXL) ------------------------------------------


@pytest.mark.parametrize("done, state", [(True, ExportState.SUCCEEDED), (False, ExportState.ABORTED)])
def test_the_peers_release_ends_its_remote_read_and_the_export_once(table, freed, done, state):
    t = _export(table, "a")
    assert table.begin_remote_read(t.export_id, hold_s=5.0) is t
    assert t.state is ExportState.READING and t.active_reads == 1 and t.remote_read_until == 1005.0
    assert table.expire_due() == 0 and freed == []
    table.release(t.export_id, done=done)
    assert freed == ["a"] and t.state is state and t.remote_read_until is None
    assert _counts(table) == {state.value: 1}


def test_a_remote_read_the_peer_never_ends_ends_at_its_deadline_with_its_export(table, freed, clock):
    t = _export(table, "a", lease_s=1.0)
    table.begin_remote_read(t.export_id, hold_s=5.0)
    clock.now += 4.9  # past the lease, not past the read's deadline: still pinned
    assert table.expire_due() == 0 and freed == [] and t.state is ExportState.READING
    clock.now += 0.2  # the read's deadline passed: it ends, and the export whose lease ran out
    assert table.expire_due() == 1 and freed == ["a"]
    assert t.remote_read_until is None and _counts(table) == {"expired": 1}
    with pytest.raises(ExportNotFound, match=r"has ended \(expired\)"):
        table.release(t.export_id, done=True)  # a peer that wakes up late: a clear error, no double free
    assert freed == ["a"]


def test_a_remote_read_that_ends_at_its_deadline_leaves_a_running_lease_running(table, freed, clock):
    t = _export(table, "a", lease_s=30.0)
    table.begin_remote_read(t.export_id, hold_s=5.0)
    clock.now += 5.1
    assert table.expire_due() == 0 and t.state is ExportState.PENDING and t.lease_expiry == 1030.0
    table.release(t.export_id, done=False)
    assert freed == ["a"]


def test_a_retried_remote_read_extends_the_one_in_progress(table, freed, clock):
    t = _export(table, "a")
    table.begin_remote_read(t.export_id, hold_s=5.0)
    clock.now += 2.0
    table.begin_remote_read(t.export_id, hold_s=5.0)
    assert t.active_reads == 1 and t.remote_read_until == 1007.0
    table.release(t.export_id, done=True)
    assert freed == ["a"]


def test_a_remote_read_is_capped_by_the_total_lease(clock, freed):
    table = _table(freed, max_lease_s=300.0, max_total_lease_s=20.0)
    t = _export(table, "a")
    table.begin_remote_read(t.export_id, hold_s=250.0)
    assert t.remote_read_until == 1020.0


def test_release_during_a_pull_and_a_remote_read_waits_for_the_pull(table, freed):
    t = _export(table, "a")
    table.begin_read(t.export_id)  # a gRPC pull of the same export, still streaming
    table.begin_remote_read(t.export_id, hold_s=5.0)
    table.release(t.export_id, done=True)
    assert freed == [] and t.active_reads == 1 and t.pending_end is ExportState.SUCCEEDED
    table.end_read(t)
    assert freed == ["a"] and t.state is ExportState.SUCCEEDED


def test_abort_all_ends_remote_reads(table, freed):
    t = _export(table, "a")
    table.begin_remote_read(t.export_id, hold_s=5.0)
    table.abort_all()
    assert freed == ["a"] and t.state is ExportState.ABORTED


def test_remote_read_refusals(table, freed, clock):
    t = _export(table, "a", lease_s=1.0)
    with pytest.raises(ValueError, match="hold_s must be > 0"):
        table.begin_remote_read(t.export_id, hold_s=0)
    with pytest.raises(ExportNotFound, match="unknown transfer 'nope'"):
        table.begin_remote_read("nope", hold_s=1.0)
    clock.now += 2.0
    with pytest.raises(ExportNotFound, match=r"has ended \(expired\)"):
        table.begin_remote_read(t.export_id, hold_s=1.0)
    assert freed == ["a"]


def test_the_producers_own_read_leaves_the_lease_as_it_was(table, freed, clock):
    t = _export(table, "a", lease_s=0.5)
    table.begin_read(t.export_id)  # the producer taking its checksums before the handle goes out
    table.end_read(t, room=False)
    assert t.lease_expiry == 1000.5
    clock.now += 0.6
    assert table.expire_due() == 1 and freed == ["a"]
