"""The NIXL data plane (engine/kv_cache/nixl.py) between two agents in one process, over the
caches of a hybrid spec (a 4-token latent group and an 8-token indexer group, as in
test_kv_hybrid): exactly the blocks asked for arrive where the consumer's block ids say, in every
group; a block changed after its checksum was taken is caught; a closed import takes no READ and
a read in its slot is cancelled by the close; a producer's block ids or geometry that do not fit
are refused before anything is posted."""

from __future__ import annotations

import multiprocessing
import threading
import time

import pytest
import torch

from engine.kv_cache import nixl
from engine.kv_cache.checksum import block_checksums
from engine.kv_cache.transfer import ImportClosed, KVPort, MemoryRegion
from tests.test_kv_hybrid import NUM_BLOCKS, SPEC, _filled, _rows, _same

TIMEOUT_S = 30.0


@pytest.fixture(scope="module")
def pair():
    """A producer and a consumer agent, each over its own caches; the consumer knows the producer.
    As a decode worker's, the consumer's progress thread runs every READER_PROGRESS_DELAY_US."""
    producer_caches, consumer_caches = _filled(seed=1), _filled(seed=2)
    producer_port, consumer_port = KVPort(SPEC, producer_caches), KVPort(SPEC, consumer_caches)
    producer = nixl.NixlAgent("test-producer", producer_port)
    consumer = nixl.NixlAgent("test-consumer", consumer_port, nixl.READER_PROGRESS_DELAY_US)
    peer = consumer.add_peer(
        producer.name, producer.metadata, list(producer.regions), producer.num_blocks, producer.mem_type
    )
    yield producer_caches, consumer_caches, consumer_port, consumer, peer
    consumer.close()
    producer.close()  # held to here: its memory is read until the last test


def test_exactly_the_missing_blocks_arrive_in_every_group(pair):
    producer_caches, consumer_caches, port, consumer, peer = pair
    sink = port.sink("r", [[6, 1, 4]])  # the consumer's blocks for a 3-block prompt
    untouched = _rows(consumer_caches, [0, 2, 3, 5, 7, 6])  # 6: a prefix hit, not read
    before = _rows(consumer_caches, [6])
    expected = block_checksums(SPEC, producer_caches, [3, 7])
    n = consumer.read(peer, sink, 1, [3, 7], TIMEOUT_S, threading.Event(), expected)
    assert n == 2 * SPEC.bytes_per_block
    assert _same(_rows(consumer_caches, [1, 4]), _rows(producer_caches, [3, 7]))
    assert _same(_rows(consumer_caches, [6]), before)
    assert _same(_rows(consumer_caches, [0, 2, 3, 5, 7, 6]), untouched)
    assert sink.checksums(1) == expected


def test_a_block_changed_after_its_checksum_was_taken_is_caught(pair):
    producer_caches, consumer_caches, port, consumer, peer = pair
    expected = block_checksums(SPEC, producer_caches, [2, 5])
    flipped = producer_caches[4][5].view(torch.uint8)  # the indexer group's last layer, block 5
    flipped[0, 3] ^= 0x10
    try:
        sink = port.sink("r", [[0, 3]])
        with pytest.raises(
            nixl.ChecksumMismatch, match=r"KV block 1 read from test-producer fails its checksum"
        ):
            consumer.read(peer, sink, 0, [2, 5], TIMEOUT_S, threading.Event(), expected)
    finally:
        flipped[0, 3] ^= 0x10


def test_a_closed_import_takes_no_read(pair):
    producer_caches, consumer_caches, port, consumer, peer = pair
    sink = port.sink("r", [[2]])
    before = _rows(consumer_caches, [2])
    sink.close()
    with pytest.raises(ImportClosed):
        consumer.read(peer, sink, 0, [0], TIMEOUT_S, threading.Event())
    assert _same(_rows(consumer_caches, [2]), before)


def test_close_cancels_a_read_in_its_slot_and_waits_for_it(pair, monkeypatch):
    """The close comes while the transfer is (held) in flight: the read is cancelled and its
    handle released before close returns; the read raises ImportClosed; later reads are refused."""
    producer_caches, consumer_caches, port, consumer, peer = pair
    sink = port.sink("r", [[5]])
    posted, events = threading.Event(), []
    real_status, real_release = consumer._status, consumer._release

    def in_flight(call, *args):
        real_status(call, *args)
        posted.set()
        return consumer._b.NIXL_IN_PROG

    def release(handle):
        real_release(handle)
        events.append("handle released")

    monkeypatch.setattr(consumer, "_status", in_flight)
    monkeypatch.setattr(consumer, "_release", release)
    result = {}

    def read():
        try:
            consumer.read(peer, sink, 0, [1], TIMEOUT_S, threading.Event())
        except Exception as e:  # noqa: BLE001
            result["error"] = e

    t = threading.Thread(target=read)
    t.start()
    assert posted.wait(TIMEOUT_S)
    sink.close()
    events.append("closed")
    t.join(TIMEOUT_S)
    assert events == ["handle released", "closed"]
    assert isinstance(result.get("error"), ImportClosed)
    with pytest.raises(ImportClosed):
        consumer.read(peer, sink, 0, [1], TIMEOUT_S, threading.Event())


def test_blocks_allocated_tail_first_move_as_one_run_per_layer_and_a_bad_one_is_named(pair):
    """Both sides' blocks in descending order (a freed request's come back tail first): one
    descriptor per layer carries them all, each lands where the consumer's ids say, and a block
    changed after its checksum was taken is named by its index in the sink."""
    producer_caches, consumer_caches, port, consumer, peer = pair
    expected = block_checksums(SPEC, producer_caches, [6, 5, 4])
    timings = nixl.ReadTimings()
    sink = port.sink("r", [[7, 6, 5]])
    n = consumer.read(peer, sink, 0, [6, 5, 4], TIMEOUT_S, threading.Event(), expected, timings)
    assert n == 3 * SPEC.bytes_per_block
    assert _same(_rows(consumer_caches, [7, 6, 5]), _rows(producer_caches, [6, 5, 4]))
    assert timings.descriptors == SPEC.num_caches
    flipped = producer_caches[0][8].view(torch.uint8)  # the latent group's first layer, block 4's first row
    flipped[0, 3] ^= 0x10
    try:
        with pytest.raises(nixl.ChecksumMismatch, match=r"KV block 2 read from test-producer fails"):
            consumer.read(
                peer, port.sink("r", [[7, 6, 5]]), 0, [6, 5, 4], TIMEOUT_S, threading.Event(), expected
            )
    finally:
        flipped[0, 3] ^= 0x10


def test_a_read_held_at_the_gate_has_its_first_block_in_and_goes_on_once_it_opens(pair, tmp_path):
    """The reliability tests' hook: while the gate file exists, a read lands its first block
    and posts nothing more; removing the file lets it finish; closing the import ends a held
    read with ImportClosed."""
    producer_caches, consumer_caches, port, consumer, peer = pair
    gate = tmp_path / "gate"
    gate.touch()
    consumer.read_gate = gate
    try:
        expected = block_checksums(SPEC, producer_caches, [1, 3])
        sink = port.sink("r", [[5, 0]])
        untouched = _rows(consumer_caches, [0])
        result = {}

        def read(sink=sink):
            try:
                result["n"] = consumer.read(peer, sink, 0, [1, 3], TIMEOUT_S, threading.Event(), expected)
            except Exception as e:  # noqa: BLE001
                result["error"] = e

        t = threading.Thread(target=read)
        t.start()
        deadline = time.monotonic() + TIMEOUT_S
        while not _same(_rows(consumer_caches, [5]), _rows(producer_caches, [1])):
            assert time.monotonic() < deadline, "the first block never arrived"
            time.sleep(0.01)
        time.sleep(0.1)
        assert t.is_alive() and _same(_rows(consumer_caches, [0]), untouched)
        gate.unlink()
        t.join(TIMEOUT_S)
        assert result == {"n": 2 * SPEC.bytes_per_block}
        assert _same(_rows(consumer_caches, [5, 0]), _rows(producer_caches, [1, 3]))
        gate.touch()
        held = port.sink("r", [[6, 7]])
        t = threading.Thread(target=read, args=(held,))
        result.clear()
        t.start()
        while not _same(_rows(consumer_caches, [6]), _rows(producer_caches, [1])):
            assert time.monotonic() < deadline, "the first block never arrived"
            time.sleep(0.01)
        held.close()  # waits for the held read to leave its slot
        t.join(TIMEOUT_S)
        assert isinstance(result.get("error"), ImportClosed)
    finally:
        consumer.read_gate = None


@pytest.mark.parametrize(
    "ids, message",
    [
        ([1], r"block_ids: 1 from the producer, the handle leaves 2 to read"),
        ([1, NUM_BLOCKS], rf"block_ids\[1\] = {NUM_BLOCKS} outside the producer's \[0, {NUM_BLOCKS}\)"),
        ([-1, 2], r"block_ids\[0\] = -1 outside"),
    ],
    ids=["short", "past-the-end", "negative"],
)
def test_producer_block_ids_that_do_not_fit_are_refused_before_posting(pair, ids, message):
    producer_caches, consumer_caches, port, consumer, peer = pair
    sink = port.sink("r", [[3, 4]])
    before = _rows(consumer_caches, [3, 4])
    with pytest.raises(ValueError, match=message):
        consumer.read(peer, sink, 0, ids, TIMEOUT_S, threading.Event())
    assert _same(_rows(consumer_caches, [3, 4]), before)


def test_a_peer_whose_geometry_is_not_our_specs_is_refused(pair):
    *_, consumer, peer = pair
    regions = list(peer.regions)
    args = dict(name="p2", metadata=b"x", regions=regions, num_blocks=NUM_BLOCKS, mem_type="DRAM")
    cases = [
        (dict(regions=regions[:-1]), r"nixl.regions has 4 entries, the KV cache spec has 5 caches"),
        (
            dict(regions=[*regions[:3], MemoryRegion(regions[3].addr, 1, 0), regions[4]]),
            r"nixl.regions\[3\].length is 1",
        ),
        (dict(num_blocks=0), r"nixl.num_blocks must be in \(0, 2\^31\)"),
        (dict(mem_type="HBM"), r"nixl.mem_type must be one of"),
        (dict(metadata=b""), r"nixl.metadata must be 1 to"),
        (dict(name=""), r"nixl.agent_name must be 1 to 128 characters"),
    ]
    for change, message in cases:
        with pytest.raises(ValueError, match=message):
            consumer.add_peer(**{**args, **change})
    with pytest.raises(ValueError, match=r"nixl.metadata of 'p2' does not load"):
        consumer.add_peer(**args)


def test_descriptors_follow_each_groups_block_table():
    regions = tuple(MemoryRegion((i + 1) << 20, 1 << 20, 0) for i in range(SPEC.num_caches))
    theirs = tuple(MemoryRegion((i + 11) << 20, 1 << 20, 0) for i in range(SPEC.num_caches))
    local, remote = nixl.descriptors(SPEC, regions, theirs, [[5, 2]], [[7, 3]])
    latent, indexer = SPEC.groups
    lat, idx = SPEC.layer_bytes_per_block(latent), SPEC.layer_bytes_per_block(indexer)
    # pairs sorted by our block: (2, 3) then (5, 7), in every layer of every group
    want_l = [
        *[(regions[layer].addr + b * lat, lat, 0) for layer in latent.layers for b in (2, 5)],
        *[(regions[layer].addr + b * idx, idx, 0) for layer in indexer.layers for b in (2, 5)],
    ]
    want_r = [
        *[(theirs[layer].addr + b * lat, lat, 0) for layer in latent.layers for b in (3, 7)],
        *[(theirs[layer].addr + b * idx, idx, 0) for layer in indexer.layers for b in (3, 7)],
    ]
    assert [tuple(int(x) for x in r) for r in local] == want_l
    assert [tuple(int(x) for x in r) for r in remote] == want_r
    # an engine block of the latent group is its two 4-token rows, which lie back to back
    assert SPEC.group_block_ids(latent, [5]) == [10, 11] and lat == 2 * latent.block_bytes


@pytest.mark.parametrize(
    "local, remote, runs",
    [
        ([3, 4, 5], [7, 8, 9], [(3, 7, 3)]),
        ([10, 9, 8, 3], [20, 19, 18, 7], [(3, 7, 1), (8, 18, 3)]),  # freed tail first: descending
        ([1, 2, 3], [5, 6, 9], [(1, 5, 2), (3, 9, 1)]),  # the remote side breaks the run
        ([4, 5, 6], [9, 8, 7], [(4, 9, 1), (5, 8, 1), (6, 7, 1)]),  # opposite directions never merge
        ([], [], []),
    ],
    ids=["ascending", "descending", "remote-gap", "crossed", "empty"],
)
def test_block_runs_merge_pairs_contiguous_on_both_sides_in_either_order(local, remote, runs):
    assert [tuple(r) for r in nixl.block_runs(local, remote).tolist()] == runs


def test_cut_runs_caps_each_run_and_descriptors_cover_every_byte_once():
    runs = nixl.block_runs([8, 9, 10, 11, 12, 3], [18, 19, 20, 21, 22, 7])
    assert nixl.cut_runs(runs, 2).tolist() == [[3, 7, 1], [8, 18, 2], [10, 20, 2], [12, 22, 1]]
    regions = tuple(MemoryRegion((i + 1) << 20, 1 << 20, 0) for i in range(SPEC.num_caches))
    lat = SPEC.layer_bytes_per_block(SPEC.groups[0])
    local, remote = nixl.descriptors(SPEC, regions, regions, [[12, 11, 10, 9, 8]], [[2, 1, 0, 7, 6]], 2 * lat)
    assert (local[:, 1] == remote[:, 1]).all()
    assert int(local[:, 1].sum()) == 5 * SPEC.bytes_per_block
    assert int(local[:, 1].max()) <= 2 * lat


def _producer_process(conn) -> None:
    """A producer in its own process: an agent over the hybrid spec's caches, its metadata sent
    back; then it waits to be killed."""
    caches = _filled(seed=3)
    agent = nixl.NixlAgent("dying-producer", KVPort(SPEC, caches))
    conn.send((agent.metadata, [(r.addr, r.length, r.device) for r in agent.regions], agent.num_blocks))
    conn.recv()


def test_a_producer_that_dies_mid_transfer_fails_the_read_with_a_status_and_frees_its_slot(pair):
    """The producer process is killed after the consumer loaded its agent: the READ ends with
    NixlError (not a hang, not a success), the sink's slot is left (close does not wait), and
    the consumer's other blocks are untouched."""
    producer_caches, consumer_caches, port, consumer, peer = pair
    ctx = multiprocessing.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=_producer_process, args=(there,), daemon=True)
    proc.start()
    try:
        metadata, regions, num_blocks = here.recv()
        dying = consumer.add_peer(
            "dying-producer", metadata, [MemoryRegion(*r) for r in regions], num_blocks, "DRAM"
        )
        ok = port.sink("warm", [[7]])
        assert consumer.read(dying, ok, 0, [2], TIMEOUT_S, threading.Event()) == SPEC.bytes_per_block
    finally:
        proc.kill()
        proc.join()
    sink = port.sink("r", [[2, 6]])
    before = _rows(consumer_caches, [0, 1, 3, 4, 5])
    with pytest.raises(nixl.NixlError) as err:
        consumer.read(dying, sink, 0, [1, 5], TIMEOUT_S, threading.Event())
    assert not isinstance(err.value, nixl.NixlTimeout | nixl.ChecksumMismatch)
    sink.close()  # returns at once: no read holds the slot
    assert _same(_rows(consumer_caches, [0, 1, 3, 4, 5]), before)
    consumer.forget_peer("dying-producer")
