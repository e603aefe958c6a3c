"""The decode side of a NIXL transfer: which transport each producer gets, and the pull itself.

Negotiation (`--kv-transport`): "grpc" never uses NIXL; "nixl" requires it of every producer
(FAILED_PRECONDITION naming the producer otherwise); "auto" uses NIXL with a producer whose
GetEngineInfo carries a NIXL agent (taking checksums, when this worker verifies them) and the
gRPC chunk stream with one that does not. The choice
is made once per producer incarnation (engine id and epoch: a restarted producer is asked again)
and logged once.

The pull: BeginRead pins the blocks for the read and names them (the producer's block ids and
checksums), the engine's NixlAgent READs them into the import sink's blocks off the event loop,
verifies the checksums, and returns; the caller then releases the producer (done or abort), which
ends the read there. A NIXL producer's handle already names the blocks and their checksums, so
the READ is posted at once and BeginRead's round trip (~2 ms here) runs under it; what was read
is kept only once BeginRead confirms (see pull). Cancelling the pull cancels the READ and waits
until its transfer handle is released before the cancellation goes on, so no Release reaches the
producer while our READ may still be in flight.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import grpc

from engine.kv_cache import nixl
from engine.kv_cache.transfer import ImportClosed, ImportSink, MemoryRegion, from_block
from pdserve.v1 import kv_transfer_pb2 as kv_pb
from pdserve.v1 import worker_pb2 as wpb
from services.common.errors import DataLoss, FailedPrecondition, ServiceError
from services.common.threads import named_pool
from services.kv_transfer import consumer
from services.kv_transfer.peers import PeerStubs

logger = logging.getLogger(__name__)

KV_TRANSPORTS = ("auto", "nixl", "grpc")
INFO_TIMEOUT_S = 10.0
MAX_KNOWN_PRODUCERS = 256
HOLD_MARGIN_S = 0.5
"""Our READ is cancelled this long before the producer's hold on the blocks ends."""
READ_THREADS = 8
"""NIXL reads waited on at once (each holds a thread while it polls)."""


@dataclass
class PullTimings:
    """Where one NIXL pull's time went, in seconds (pull fills it in)."""

    begin_read: float = 0.0
    """The BeginRead round trip (under the READ, when the handle names the blocks)."""
    read: nixl.ReadTimings = field(default_factory=nixl.ReadTimings)
    """The read thread's own time."""
    handoff: float = 0.0
    """To the read thread and back to the event loop: from the READ's start to the pull's end,
    less the thread's time (and so also any wait for BeginRead's answer once the READ is done)."""

    def phases(self) -> dict[str, float]:
        r = self.read
        return {
            "begin_read": self.begin_read,
            "prepare": r.prepare,
            "transfer": r.transfer,
            "verify": r.verify,
            "release": r.release,
            "handoff": self.handoff,
        }


def agent_info(agent: nixl.NixlAgent, checksums: bool) -> kv_pb.NixlAgentInfo:
    """What GetEngineInfo hands to authenticated callers (see engine/kv_cache/nixl.py: Security)."""
    return kv_pb.NixlAgentInfo(
        agent_name=agent.name,
        metadata=agent.metadata,
        regions=[kv_pb.NixlRegion(addr=r.addr, length=r.length, device_id=r.device) for r in agent.regions],
        mem_type=agent.mem_type,
        num_blocks=agent.num_blocks,
        checksums=checksums,
        table_blocks=agent.table_blocks if len(agent.table_blocks) > 1 else (),
    )


class Transports:
    """Per producer: NIXL (its PeerAgent) or the gRPC chunk stream (None). Only the event loop
    calls this."""

    def __init__(self, mode: str, agent: nixl.NixlAgent | None, peers: PeerStubs, verify: bool = True):
        """verify: this worker checks the producer's checksums; a producer that takes none is
        then read over gRPC (auto) or refused (nixl)."""
        if mode not in KV_TRANSPORTS:
            raise ValueError(f"kv_transport must be one of {KV_TRANSPORTS}, got {mode!r}")
        self.mode = mode
        self.verify = verify
        self.agent = agent
        self.peers = peers
        self._known: OrderedDict[tuple[str, int], nixl.PeerAgent | None] = OrderedDict()
        self._asking: dict[tuple[str, int], asyncio.Future] = {}
        self.reading: set[threading.Event] = set()
        """The cancel events of the reads in flight (close cancels them)."""
        self.executor = named_pool(READ_THREADS, "nixl-read")

    async def choose(self, producer: kv_pb.KvProducer, timeout: float | None) -> nixl.PeerAgent | None:
        """The producer's agent when KV from it moves over NIXL; None: over gRPC."""
        if self.mode == "grpc" or self.agent is None:
            return None
        key = (producer.engine_id, producer.epoch)
        if key in self._known:
            self._known.move_to_end(key)
            return self._known[key]
        asking = self._asking.get(key)
        if asking is None:  # the first pulls from a producer ask it once, together
            asking = self._asking[key] = asyncio.ensure_future(self._ask(producer, key, timeout))
            asking.add_done_callback(lambda _: self._asking.pop(key, None))
        return await asyncio.shield(asking)

    async def _ask(
        self, producer: kv_pb.KvProducer, key: tuple[str, int], timeout: float | None
    ) -> nixl.PeerAgent | None:
        try:
            info = await self.peers.worker(producer.endpoint).GetEngineInfo(
                wpb.GetEngineInfoRequest(), timeout=min(timeout or INFO_TIMEOUT_S, INFO_TIMEOUT_S)
            )
        except grpc.aio.AioRpcError as e:
            if self.mode == "nixl":
                raise ServiceError(
                    f"GetEngineInfo of KV producer {producer.endpoint} failed: {e.details()}", e.code()
                ) from None
            # auto: not remembered; the gRPC pull meets the same producer and says what is wrong
            logger.info(
                "KV from producer %s over gRPC: GetEngineInfo failed (%s)", producer.endpoint, e.code()
            )
            return None
        if (info.identity.engine_id, info.identity.epoch) != key:
            return None  # not the worker that issued the handle: the pull says why (epoch)
        peer = None
        if not info.HasField("nixl"):
            reason = "it does not serve KV over NIXL"
        elif self.verify and not info.nixl.checksums:
            reason = "it takes no checksums (--no-kv-checksum) and this worker verifies them"
        else:
            n = info.nixl
            try:
                peer = self.agent.add_peer(
                    n.agent_name,
                    n.metadata,
                    [MemoryRegion(r.addr, r.length, r.device_id) for r in n.regions],
                    list(n.table_blocks) or n.num_blocks,
                    n.mem_type,
                )
            except ValueError as e:
                reason = f"its NIXL agent is refused: {e}"
        if peer is None:
            if self.mode == "nixl":
                raise FailedPrecondition(
                    f"KV producer {producer.endpoint} cannot be read over NIXL ({reason}) and this worker "
                    "runs --kv-transport nixl"
                )
            logger.warning("KV from producer %s moves over gRPC: %s", producer.endpoint, reason)
        else:
            logger.info("KV from producer %s moves over NIXL (agent %s)", producer.endpoint, peer.name)
        self._remember(key, peer)
        return peer

    def forget(self, producer: kv_pb.KvProducer) -> None:
        """A NIXL read from this producer failed: drop its agent (asked again next time)."""
        peer = self._known.pop((producer.engine_id, producer.epoch), None)
        if peer is not None and self.agent is not None:
            self.agent.forget_peer(peer.name)

    def _remember(self, key: tuple[str, int], peer: nixl.PeerAgent | None) -> None:
        self._known[key] = peer
        while len(self._known) > MAX_KNOWN_PRODUCERS:
            _, old = self._known.popitem(last=False)
            if old is not None and self.agent is not None:
                self.agent.forget_peer(old.name)

    def close(self) -> None:
        """Cancel the reads in flight and wait for them (each releases its transfer handle
        within a poll)."""
        for cancel in list(self.reading):
            cancel.set()
        self.executor.shutdown(wait=True)


async def pull(
    transports: Transports,
    peer: nixl.PeerAgent,
    handle: kv_pb.KvHandle,
    sink: ImportSink,
    first_block: int,
    timeout: float,
    verify: bool,
    timings: PullTimings | None = None,
) -> int:
    """READ blocks [first_block, handle.num_blocks) of the handle's export into the sink's over
    NIXL, checked against the producer's checksums when verify; returns the bytes read (and
    fills timings in, when given). Raises ServiceError: DATA_LOSS (a checksum, or block ids that
    do not fit), FAILED_PRECONDITION (no checksums offered while verify), DEADLINE_EXCEEDED,
    CANCELLED, UNAVAILABLE (the READ failed).

    A handle that names its blocks (and their checksums, when verify) is read at once, BeginRead
    under way meanwhile: what was read is kept only once BeginRead has answered with the same
    ids and checksums, which proves the export still held the blocks (an export that ran out of
    lease or was released never comes back, so it held them through a READ that began before);
    a READ still going when the hold BeginRead grants runs out is cancelled. Otherwise the READ
    waits for BeginRead's answer."""
    t = timings if timings is not None else PullTimings()
    stub = transports.peers.kv(handle.producer.endpoint)
    spec = transports.agent.spec
    want = sum(end - start for start, end in spec.transfer_ranges(handle.num_tokens, first_block))
    whole = sum(end - start for start, end in spec.transfer_ranges(handle.num_tokens))
    loop = asyncio.get_running_loop()
    sent = time.monotonic()
    begin = asyncio.ensure_future(
        stub.BeginRead(
            kv_pb.BeginReadRequest(
                transfer_id=handle.transfer_id,
                epoch=handle.producer.epoch,
                first_block=first_block,
                read_timeout_ms=max(1, int(timeout * 1000)),
            ),
            timeout=min(timeout, INFO_TIMEOUT_S),
        )
    )
    early = len(handle.block_ids) == whole and (not verify or len(handle.block_checksums) == whole)
    cancel = threading.Event()
    expired = threading.Event()  # the hold ran out under our READ
    read: asyncio.Future | None = None
    posted = 0.0  # when the READ was handed to the read thread
    hold_timer: asyncio.TimerHandle | None = None
    transports.reading.add(cancel)

    def start_read(block_ids: list[int], digests: list[int] | None, read_timeout: float) -> asyncio.Future:
        nonlocal posted
        posted = time.monotonic()
        return loop.run_in_executor(
            transports.executor,
            transports.agent.read,
            peer,
            sink,
            first_block,
            block_ids,
            read_timeout,
            cancel,
            digests,
            t.read,
        )

    try:
        if early:
            block_ids = from_block(spec, handle.num_tokens, handle.block_ids, first_block)
            digests = (
                from_block(spec, handle.num_tokens, handle.block_checksums, first_block) if verify else None
            )
            read = start_read(block_ids, digests, timeout)
        begun = await _answer(begin, handle)
        t.begin_read = time.monotonic() - sent
        # The hold counts from the producer's answer, which came after we asked: counted from
        # then, our READ ends before the producer's hold does (it may grant less than we asked).
        hold = begun.read_hold_ms / 1000 - HOLD_MARGIN_S - (time.monotonic() - sent)
        if hold <= 0:
            raise ServiceError(
                f"transfer {handle.transfer_id} at {handle.producer.endpoint} is held for a read only "
                f"{begun.read_hold_ms} ms",
                grpc.StatusCode.DEADLINE_EXCEEDED,
            )
        if len(begun.block_ids) != want:
            raise DataLoss(
                f"BeginRead gave {len(begun.block_ids)} block_ids, the handle leaves {want} to read"
            )
        if verify and len(begun.block_checksums) != want:
            raise FailedPrecondition(
                f"KV producer {handle.producer.endpoint} offers {len(begun.block_checksums)} block checksums "
                f"for {want} blocks: start it with checksums on, or this worker with --no-kv-checksum"
            )
        if read is None:
            digests = list(begun.block_checksums) if verify else None
            read = start_read(list(begun.block_ids), digests, min(timeout, hold))
        else:
            if list(begun.block_ids) != block_ids or (verify and list(begun.block_checksums) != digests):
                raise DataLoss(
                    f"BeginRead of transfer {handle.transfer_id} names other blocks or checksums than its handle"
                )
            if not read.done():
                hold_timer = loop.call_later(hold, lambda: (expired.set(), cancel.set()))
        received = await asyncio.shield(read)
        r = t.read
        t.handoff = max(0.0, time.monotonic() - posted - (r.prepare + r.transfer + r.verify + r.release))
        if spec.states:  # not in the registered caches: pulled, and nothing else with them
            received += await consumer.pull(stub, handle, sink, handle.num_blocks, 0, timeout)
        return received
    except BaseException as e:
        cancel.set()
        if read is not None:
            await asyncio.wait([read])  # the READ's handle is released before anyone releases the producer
            if not read.cancelled():
                read.exception()  # taken: what is raised below is e, the READ's error or its cause
        if isinstance(e, nixl.NixlCancelled) and expired.is_set():
            raise ServiceError(
                f"NIXL READ of transfer {handle.transfer_id} outlasted the hold BeginRead granted",
                grpc.StatusCode.DEADLINE_EXCEEDED,
            ) from None
        raise _status(e, handle, transports) from None
    finally:
        if hold_timer is not None:
            hold_timer.cancel()
        if not begin.done():
            begin.cancel()
        transports.reading.discard(cancel)


async def _answer(begin: asyncio.Future, handle: kv_pb.KvHandle) -> kv_pb.BeginReadResponse:
    try:
        return await begin
    except grpc.aio.AioRpcError as e:
        raise ServiceError(
            f"BeginRead of transfer {handle.transfer_id} at {handle.producer.endpoint} failed: {e.details()}",
            e.code(),
        ) from None


def _status(e: BaseException, handle: kv_pb.KvHandle, transports: Transports) -> BaseException:
    """What a failed pull raises: a read's error as its status; anything else as it is."""
    if isinstance(e, nixl.ChecksumMismatch):
        return DataLoss(str(e))
    if isinstance(e, ValueError):  # the producer's block ids do not fit its own geometry
        return DataLoss(f"BeginRead of transfer {handle.transfer_id}: {e}")
    if isinstance(e, nixl.NixlTimeout):
        return ServiceError(str(e), grpc.StatusCode.DEADLINE_EXCEEDED)
    if isinstance(e, (ImportClosed, nixl.NixlCancelled)):
        return ServiceError(str(e), grpc.StatusCode.CANCELLED)
    if isinstance(e, nixl.NixlError):
        transports.forget(handle.producer)
        return ServiceError(str(e), grpc.StatusCode.UNAVAILABLE)
    return e
