"""Transport negotiation on the decode side (services/kv_transfer/nixl_pull.py Transports), against
fake producers' GetEngineInfo and two real NIXL agents over the hybrid spec: auto takes NIXL from a
producer that offers it (with checksums, when we verify them) and gRPC otherwise, saying so once
per producer; nixl refuses a producer without it by name; grpc never asks; concurrent first pulls
ask once; a producer that cannot be asked is not remembered."""

from __future__ import annotations

import asyncio
import logging
import threading

import grpc
import pytest

from engine.kv_cache import nixl
from engine.kv_cache.transfer import KVPort
from pdserve.v1 import kv_transfer_pb2 as kv_pb
from pdserve.v1 import worker_pb2 as wpb
from services.common.errors import FailedPrecondition, ServiceError
from services.kv_transfer.nixl_pull import Transports, agent_info, pull
from tests.test_kv_hybrid import SPEC, _filled

PRODUCER = kv_pb.KvProducer(engine_id="e1", epoch=7, endpoint="10.0.0.1:50061")


@pytest.fixture(scope="module")
def agents():
    producer = nixl.NixlAgent("transports-producer", KVPort(SPEC, _filled(seed=4)))
    consumer = nixl.NixlAgent("transports-consumer", KVPort(SPEC, _filled(seed=5)))
    yield producer, consumer
    consumer.close()
    producer.close()


class FakePeers:
    """PeerStubs' worker(): a GetEngineInfo that answers `info` (or raises `error`), counted."""

    def __init__(self, info: wpb.EngineInfo | None, error: grpc.StatusCode | None = None):
        self.info, self.error, self.asked = info, error, 0

    def worker(self, endpoint: str):
        peers = self

        class Stub:
            async def GetEngineInfo(self, request, timeout=None):
                peers.asked += 1
                await asyncio.sleep(0.01)
                if peers.error is not None:
                    raise grpc.aio.AioRpcError(peers.error, None, None, details="down")
                return peers.info

        return Stub()


def _info(producer: nixl.NixlAgent | None, checksums: bool = True) -> wpb.EngineInfo:
    info = wpb.EngineInfo(identity=PRODUCER)
    if producer is not None:
        info.nixl.CopyFrom(agent_info(producer, checksums))
    return info


def _choose(transports: Transports, n: int = 1):
    async def go():
        return await asyncio.gather(*(transports.choose(PRODUCER, 5.0) for _ in range(n)))

    return asyncio.run(go())


def test_auto_takes_nixl_from_a_producer_that_offers_it_asking_once(agents, caplog):
    producer, consumer = agents
    peers = FakePeers(_info(producer))
    t = Transports("auto", consumer, peers)
    with caplog.at_level(logging.INFO, "services.kv_transfer.nixl_pull"):
        chosen = _choose(t, n=4) + _choose(t)
    assert peers.asked == 1
    assert {p.name for p in chosen} == {"transports-producer"}
    assert caplog.text.count(f"KV from producer {PRODUCER.endpoint} moves over NIXL") == 1
    t.close()


@pytest.mark.parametrize(
    "case, reason",
    [
        ("no-nixl", "it does not serve KV over NIXL"),
        ("no-checksums", "it takes no checksums (--no-kv-checksum) and this worker verifies them"),
    ],
)
def test_auto_falls_back_to_grpc_and_says_so_nixl_refuses(agents, caplog, case, reason):
    producer, consumer = agents
    info = _info(None) if case == "no-nixl" else _info(producer, checksums=False)
    auto = Transports("auto", consumer, FakePeers(info))
    with caplog.at_level(logging.INFO, "services.kv_transfer.nixl_pull"):
        assert _choose(auto, n=3) == [None, None, None]
    assert caplog.text.count(f"KV from producer {PRODUCER.endpoint} moves over gRPC: {reason}") == 1
    strict = Transports("nixl", consumer, FakePeers(info))
    with pytest.raises(
        FailedPrecondition, match=rf"KV producer {PRODUCER.endpoint} cannot be read over NIXL"
    ):
        _choose(strict)
    # not verifying: a producer without checksums is read over NIXL
    if case == "no-checksums":
        assert _choose(Transports("auto", consumer, FakePeers(info), verify=False))[0].name == producer.name
    for t in (auto, strict):
        t.close()


def test_grpc_never_asks_and_an_unreachable_producer_is_not_remembered(agents):
    producer, consumer = agents
    peers = FakePeers(_info(producer))
    assert _choose(Transports("grpc", consumer, peers)) == [None] and peers.asked == 0
    down = FakePeers(None, error=grpc.StatusCode.UNAVAILABLE)
    auto = Transports("auto", consumer, down)
    assert _choose(auto) == [None] and _choose(auto) == [None]
    assert down.asked == 2  # asked again: the gRPC pull reports the producer's real state
    with pytest.raises(Exception, match="GetEngineInfo of KV producer 10.0.0.1:50061 failed"):
        _choose(Transports("nixl", consumer, down))


def test_a_producer_whose_agent_does_not_fit_our_spec_is_read_over_grpc(agents, caplog):
    producer, consumer = agents
    info = _info(producer)
    del info.nixl.regions[-1]
    with caplog.at_level(logging.INFO, "services.kv_transfer.nixl_pull"):
        assert _choose(Transports("auto", consumer, FakePeers(info))) == [None]
    assert "its NIXL agent is refused: nixl.regions has 4 entries" in caplog.text
    # the same agent name again, with other metadata: refused, not taken for the known agent
    assert _choose(Transports("auto", consumer, FakePeers(_info(producer))))[0].name == producer.name
    info = _info(producer)
    info.nixl.regions[0].addr += 64
    with caplog.at_level(logging.INFO, "services.kv_transfer.nixl_pull"):
        assert _choose(Transports("auto", consumer, FakePeers(info))) == [None]
    assert "nixl.agent_name 'transports-producer' is already known with other metadata" in caplog.text


class HeldRead:
    """An agent whose read holds until cancelled (as a READ in flight does), recording when it ends."""

    spec = SPEC

    def __init__(self):
        self.started, self.events, self.timeouts = threading.Event(), [], []

    def read(self, peer, sink, first_block, block_ids, timeout_s, cancel, expected, timings=None):
        self.timeouts.append(timeout_s)
        self.started.set()
        assert cancel.wait(30), "never cancelled"
        self.events.append("read ended: handle released")
        raise nixl.NixlCancelled("cancelled")


class BeginReadStub:
    def __init__(self, hold_ms: int = 60_000):
        self.hold_ms = hold_ms

    async def BeginRead(self, request, timeout=None):
        return kv_pb.BeginReadResponse(block_ids=[5, 6], block_checksums=[1, 2], read_hold_ms=self.hold_ms)


def test_a_cancelled_pull_waits_for_its_read_before_the_cancellation_goes_on():
    """The Decode that started the pull is cancelled mid-READ: the read is cancelled and has
    released its handle before the cancellation reaches the code that releases the producer;
    closing the transports cancels what is still in flight."""
    agent = HeldRead()
    handle = kv_pb.KvHandle(transfer_id="t", producer=PRODUCER, num_blocks=2, num_tokens=2 * SPEC.block_size)

    class Peers:
        def kv(self, endpoint):
            return BeginReadStub()

    transports = Transports("auto", agent, Peers())

    async def go():
        task = asyncio.ensure_future(pull(transports, None, handle, None, 0, 30.0, verify=True))
        await asyncio.get_running_loop().run_in_executor(None, agent.started.wait, 30)
        assert len(transports.reading) == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        agent.events.append("cancellation went on")

    asyncio.run(go())
    assert agent.events == ["read ended: handle released", "cancellation went on"]
    assert transports.reading == set()
    # closing cancels a read still in flight
    agent2 = HeldRead()
    transports2 = Transports("auto", agent2, Peers())

    async def closing():
        task = asyncio.ensure_future(pull(transports2, None, handle, None, 0, 30.0, verify=True))
        await asyncio.get_running_loop().run_in_executor(None, agent2.started.wait, 30)
        await asyncio.get_running_loop().run_in_executor(None, transports2.close)
        with pytest.raises(ServiceError) as err:
            await task
        assert err.value.code == grpc.StatusCode.CANCELLED

    asyncio.run(closing())
    assert agent2.events == ["read ended: handle released"]
    assert agent.timeouts == [30.0]  # the producer held the blocks longer than we asked


@pytest.mark.parametrize("hold_ms, posted", [(10_000, 9.5), (400, None)], ids=["capped", "too-short"])
def test_a_read_ends_before_the_producers_hold_on_the_blocks(hold_ms, posted):
    """The producer may grant a shorter hold than the reader asked for (its lease limits): the
    READ's deadline is the hold less a margin, and a hold shorter than the margin posts nothing."""

    class Ends(HeldRead):
        def read(self, *args):
            self.timeouts.append(args[4])
            return 123

    agent = Ends()
    handle = kv_pb.KvHandle(transfer_id="t", producer=PRODUCER, num_blocks=2, num_tokens=2 * SPEC.block_size)

    class Peers:
        def kv(self, endpoint):
            return BeginReadStub(hold_ms)

    transports = Transports("auto", agent, Peers())
    go = pull(transports, None, handle, None, 0, 30.0, verify=True)
    if posted is None:
        with pytest.raises(ServiceError, match="is held for a read only 400 ms") as err:
            asyncio.run(go)
        assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED and agent.timeouts == []
    else:
        assert asyncio.run(go) == 123
        # the hold counts from when BeginRead was sent (the producer answered later)
        assert len(agent.timeouts) == 1 and posted - 0.5 < agent.timeouts[0] <= posted
    transports.close()


class SlowBeginRead:
    """A BeginRead that answers once the READ has started (or fails with `error` then), so a pull
    that waits for the answer before it reads never gets one."""

    def __init__(self, agent, answer: kv_pb.BeginReadResponse | None, error: grpc.StatusCode | None = None):
        self.agent, self.answer, self.error = agent, answer, error

    def kv(self, endpoint):
        return self

    async def BeginRead(self, request, timeout=None):
        started = await asyncio.get_running_loop().run_in_executor(None, self.agent.started.wait, 5)
        assert started, "the READ waited for BeginRead"
        if self.error is not None:
            raise grpc.aio.AioRpcError(self.error, None, None, details="transfer 't' has run out of lease")
        return self.answer


class Reads(HeldRead):
    """A read that lands at once unless `hold` (then it holds until cancelled)."""

    def __init__(self, hold: bool = False):
        super().__init__()
        self.hold, self.posted = hold, []

    def read(self, peer, sink, first_block, block_ids, timeout_s, cancel, expected, timings=None):
        self.posted.append((first_block, block_ids, expected))
        if self.hold:
            return super().read(peer, sink, first_block, block_ids, timeout_s, cancel, expected)
        self.started.set()
        return 64 * len(block_ids)


NAMED = kv_pb.KvHandle(
    transfer_id="t",
    producer=PRODUCER,
    num_blocks=3,
    num_tokens=3 * SPEC.block_size,
    block_ids=[4, 5, 6],
    block_checksums=[10, 11, 12],
)


def test_a_handle_that_names_its_blocks_is_read_while_begin_read_is_under_way():
    agent = Reads()
    answer = kv_pb.BeginReadResponse(block_ids=[5, 6], block_checksums=[11, 12], read_hold_ms=60_000)
    transports = Transports("auto", agent, SlowBeginRead(agent, answer))
    assert asyncio.run(pull(transports, None, NAMED, None, 1, 30.0, verify=True)) == 128
    assert agent.posted == [(1, [5, 6], [11, 12])]  # from the handle, from block 1 on
    transports.close()


@pytest.mark.parametrize(
    "answer, error, code, message",
    [
        (
            kv_pb.BeginReadResponse(block_ids=[5, 7], block_checksums=[11, 12], read_hold_ms=60_000),
            None,
            grpc.StatusCode.DATA_LOSS,
            "names other blocks or checksums than its handle",
        ),
        (
            kv_pb.BeginReadResponse(block_ids=[5, 6], block_checksums=[11, 13], read_hold_ms=60_000),
            None,
            grpc.StatusCode.DATA_LOSS,
            "names other blocks or checksums than its handle",
        ),
        (None, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.NOT_FOUND, "has run out of lease"),
    ],
    ids=["other-blocks", "other-checksums", "lease-gone"],
)
def test_what_was_read_early_is_kept_only_once_begin_read_confirms_it(answer, error, code, message):
    """A BeginRead that disagrees with the handle, or fails (the export ended before our READ was
    confirmed), fails the pull with its reason, after the READ in flight was cancelled and had
    released its handle."""
    agent = Reads(hold=True)
    transports = Transports("auto", agent, SlowBeginRead(agent, answer, error))
    with pytest.raises(ServiceError, match=message) as err:
        asyncio.run(pull(transports, None, NAMED, None, 1, 30.0, verify=True))
    assert err.value.code == code
    assert agent.events == ["read ended: handle released"] and transports.reading == set()
    transports.close()


def test_an_early_read_that_outlasts_the_hold_is_cancelled():
    agent = Reads(hold=True)
    answer = kv_pb.BeginReadResponse(block_ids=[5, 6], block_checksums=[11, 12], read_hold_ms=600)
    transports = Transports("auto", agent, SlowBeginRead(agent, answer))
    with pytest.raises(ServiceError, match="outlasted the hold BeginRead granted") as err:
        asyncio.run(pull(transports, None, NAMED, None, 1, 30.0, verify=True))
    assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert agent.events == ["read ended: handle released"]
    transports.close()
