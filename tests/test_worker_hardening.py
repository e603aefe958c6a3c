"""The worker against callers that are wrong or hostile: request ids are labels only, Drain stops
the process the way SIGTERM does, pinned KV is bounded per caller, peer channels are bounded,
and a Decode pulls KV only from a signed handle naming a known producer.

The process checks share one prefill, one decode and one colocated worker (token-protected,
loopback); every test leaves their KV as it found it.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine.kv_cache.hashing import hash_blocks
from pdserve.v1 import inference_pb2 as pb
from pdserve.v1 import kv_transfer_pb2 as kv_pb
from pdserve.v1 import kv_transfer_pb2_grpc as kv_grpc
from pdserve.v1 import worker_pb2 as wpb
from pdserve.v1 import worker_pb2_grpc as wgrpc
from services.common.errors import ServiceError
from services.common.security import handle_mac, verify_handle_mac
from services.kv_transfer.peers import PeerStubs, PermissionDenied, check_handle
from services.launcher import Stack, StackConfig, free_port, wait_ready
from tests.service_testing import _TokenInterceptor, load, wait_until, worker

TOKEN = "hardening-test-token"
BLOCK_SIZE = 16
PREFILL_BLOCKS = 32  # the clients may pin 24 together (max_pinned_fraction 0.75)
DECODE_BLOCKS = 64
GREEDY = pb.SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def _prompt(seed: int, n: int) -> list[int]:
    return [5 + (seed * 131 + i * 17) % 4000 for i in range(n)]


# ---- PeerStubs: a bounded LRU of channels ---------------------------------------------------------


class FakeChannel:
    """Enough of grpc.aio.Channel for a KvTransferStub; records whether it was closed."""

    def __init__(self, endpoint: str, closed_order: list[str]):
        self.endpoint = endpoint
        self.closed = False
        self.closed_order = closed_order

    def unary_unary(self, *args, **kwargs):
        return None

    def unary_stream(self, *args, **kwargs):
        return None

    async def close(self, grace: float | None = None) -> None:
        self.closed = True
        self.closed_order.append(self.endpoint)


def test_peer_stubs_keep_at_most_n_channels_and_close_the_evicted():
    async def scenario():
        made: list[FakeChannel] = []
        closed: list[str] = []

        def connect(endpoint, security):
            made.append(FakeChannel(endpoint, closed))
            return made[-1]

        peers = PeerStubs(max_channels=3, connect=connect)
        endpoints = [f"10.0.0.{i}:5000" for i in range(10)]
        for e in endpoints[:3]:
            peers.kv(e)
        assert peers.kv(endpoints[0]) is peers.kv(endpoints[0])  # cached; now the most recent
        assert len(made) == 3
        for e in endpoints[3:]:  # 3000 dead endpoints, in small
            peers.kv(e)
            assert len(peers) <= 3
        await asyncio.sleep(0)  # the background closes run
        open_ = [c.endpoint for c in made if not c.closed]
        assert open_ == endpoints[7:]
        assert len(made) == 10 and sum(c.closed for c in made) == 7
        # endpoint 0 was used after 1 and 2, so they went first
        assert closed == [endpoints[i] for i in (1, 2, 0, 3, 4, 5, 6)]
        peers.forget(endpoints[8])
        await asyncio.sleep(0)
        assert made[8].closed and len(peers) == 2
        peers.kv(endpoints[8])  # a fresh channel after forget
        assert len(made) == 11 and not made[10].closed
        await peers.close()
        assert all(c.closed for c in made) and len(peers) == 0

    asyncio.run(scenario())


def test_peer_stubs_refuse_a_zero_bound():
    with pytest.raises(ValueError, match="max_channels must be >= 1, got 0"):
        PeerStubs(max_channels=0)


# ---- signed handles -------------------------------------------------------------------------------


def _handle(endpoint: str = "127.0.0.1:1", **fields) -> kv_pb.KvHandle:
    h = kv_pb.KvHandle(
        transfer_id="t1",
        producer=kv_pb.KvProducer(engine_id="e1", epoch=7, dp_rank=0, endpoint=endpoint),
        block_hashes=[b"\x01" * 8, b"\x02" * 8],
        num_tokens=20,
        num_blocks=2,
        block_size=16,
        lease_expiry_unix_ms=1_700_000_000_000,
        compat_hash="abc",
        block_ids=[4, 9],
        block_checksums=[0xDEADBEEF, 7],
    )
    for name, value in fields.items():
        target = h.producer if name in ("engine_id", "epoch", "dp_rank") else h
        if name in ("block_hashes", "block_ids", "block_checksums"):
            del getattr(h, name)[:]
            getattr(h, name).extend(value)
        else:
            setattr(target, name, value)
    return h


FIELD_CHANGES = {
    "transfer_id": {"transfer_id": "t2"},
    "engine_id": {"engine_id": "e2"},
    "epoch": {"epoch": 8},
    "dp_rank": {"dp_rank": 1},
    "endpoint": {"endpoint": "127.0.0.1:2"},
    "block_hashes-order": {"block_hashes": [b"\x02" * 8, b"\x01" * 8]},
    "block_hashes-split": {"block_hashes": [b"\x01" * 4, b"\x01" * 4 + b"\x02" * 8]},
    "block_hashes-fewer": {"block_hashes": [b"\x01" * 8]},
    "num_tokens": {"num_tokens": 21},
    "num_blocks": {"num_blocks": 3},
    "block_size": {"block_size": 32},
    "lease_expiry": {"lease_expiry_unix_ms": 1_700_000_000_001},
    "compat_hash": {"compat_hash": "abd"},
    "block_ids": {"block_ids": [9, 4]},
    "block_ids-none": {"block_ids": []},
    "block_checksums": {"block_checksums": [0xDEADBEEF, 8]},
    "checksums-as-ids": {"block_ids": [4, 9, 0xDEADBEEF, 7], "block_checksums": []},
}


@pytest.mark.parametrize("change", FIELD_CHANGES)
def test_handle_mac_covers_every_field(change):
    mac = handle_mac(TOKEN, _handle())
    assert len(mac) == 32 and verify_handle_mac(TOKEN, _handle(), mac)
    changed = _handle(**FIELD_CHANGES[change])
    assert handle_mac(TOKEN, changed) != mac
    assert not verify_handle_mac(TOKEN, changed, mac)


def test_handle_mac_is_keyed_and_unambiguous():
    assert not verify_handle_mac("another-token", _handle(), handle_mac(TOKEN, _handle()))
    # Moving bytes between adjacent string fields changes the MAC (length prefixes).
    a = _handle(transfer_id="ab", engine_id="c")
    b = _handle(transfer_id="a", engine_id="bc")
    assert handle_mac(TOKEN, a) != handle_mac(TOKEN, b)
    assert not verify_handle_mac(TOKEN, _handle(), b"")


@pytest.mark.parametrize(
    "mac, token, known, message",
    [
        (b"", TOKEN, None, "kv_handle_mac is missing"),
        (b"\x00" * 32, TOKEN, None, "kv_handle_mac does not match"),
        ("signed", TOKEN, ("127.0.0.1:9",), r"KV producer '127.0.0.1:1' is not one of"),
        (b"", None, ("127.0.0.1:9",), r"KV producer '127.0.0.1:1' is not one of"),
    ],
    ids=["no-mac", "wrong-mac", "unknown-producer", "unknown-producer-no-token"],
)
def test_check_handle_refuses(mac, token, known, message):
    mac = handle_mac(TOKEN, _handle()) if mac == "signed" else mac
    with pytest.raises(PermissionDenied, match=message) as err:
        check_handle(_handle(), mac, token, known)
    assert isinstance(err.value, ServiceError) and err.value.code == grpc.StatusCode.PERMISSION_DENIED


def test_check_handle_passes_a_signed_handle_from_a_known_producer():
    check_handle(_handle(), handle_mac(TOKEN, _handle()), TOKEN, ("127.0.0.1:1",))
    check_handle(_handle(), b"", None, None)  # no token, no list: as before


# ---- real workers ---------------------------------------------------------------------------------


class FakeProducer:
    """A TCP listener at an endpoint a forged handle names: did anyone connect?"""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.sock.setblocking(False)
        self.endpoint = f"127.0.0.1:{self.sock.getsockname()[1]}"

    def connected(self) -> bool:
        try:
            conn, _ = self.sock.accept()
        except BlockingIOError:
            return False
        conn.close()
        return True


class Workers:
    def __init__(
        self, stack: Stack, prefill, decode, colocated, allowed: FakeProducer, unlisted: FakeProducer
    ):
        self.stack, self.prefill, self.decode, self.colocated = stack, prefill, decode, colocated
        self.allowed, self.unlisted = allowed, unlisted


@pytest.fixture(scope="module")
def workers(tiny_model, tmp_path_factory):
    allowed, unlisted = FakeProducer(), FakeProducer()
    ports = {role: free_port() for role in ("prefill", "decode", "colocated")}
    producers = f"127.0.0.1:{ports['prefill']},{allowed.endpoint}"
    stack = Stack(
        StackConfig(
            tiny_model,
            engine_args=["--dtype", "float32", "--block-size", str(BLOCK_SIZE), "--grace-s", "10"],
            worker_args={
                "prefill": ["--num-kv-blocks", str(PREFILL_BLOCKS)],
                "decode": ["--num-kv-blocks", str(DECODE_BLOCKS), "--kv-producers", producers],
                "colocated": ["--num-kv-blocks", str(DECODE_BLOCKS)],
            },
            env={"PDSERVE_INTERNAL_TOKEN": TOKEN},
            log_dir=str(tmp_path_factory.mktemp("hardening") / "logs"),
            threads_per_worker=1,
        )
    )
    procs = {role: stack.start_worker(role, 0, port) for role, port in ports.items()}
    stack.procs.extend(procs.values())
    try:
        for p in procs.values():
            wait_ready(p.endpoint, 120, p.popen)
        yield Workers(stack, procs["prefill"], procs["decode"], procs["colocated"], allowed, unlisted)
    finally:
        for p in procs.values():
            if p.popen.poll() is None:
                p.popen.terminate()
        codes = {p.name: p.popen.wait(timeout=30) for p in procs.values()}
        allowed.sock.close()
        unlisted.sock.close()
    assert codes == {p.name: 0 for p in procs.values()}, codes


def _kv(endpoint: str) -> kv_grpc.KvTransferStub:
    return kv_grpc.KvTransferStub(
        grpc.intercept_channel(grpc.insecure_channel(endpoint), _TokenInterceptor(TOKEN))
    )


def _all_free(endpoint: str, total: int) -> bool:
    got = load(endpoint, TOKEN)
    return got.num_free_blocks == total and got.num_pinned_transfers == 0 and got.num_running == 0


def _prefill(w: Workers, request_id: str, prompt: list[int], client: str = "") -> wpb.PrefillResponse:
    return worker(w.prefill.endpoint, TOKEN).Prefill(
        wpb.PrefillRequest(request_id=request_id, prompt_token_ids=prompt, sampling=GREEDY, client=client),
        timeout=60,
    )


def _decode(w: Workers, request_id: str, prompt, first: wpb.PrefillResponse | None = None, mac=None, **kw):
    """Run a Decode on the decode worker to its end -> (token ids, messages); with first, from
    its kv_handle signed with the token (or the given mac)."""
    req = wpb.DecodeRequest(request_id=request_id, prompt_token_ids=prompt, sampling=GREEDY, **kw)
    if first is not None:
        req.output_token_ids.extend(first.output.token_ids)
        req.kv_handle.CopyFrom(first.kv_handle)
        req.kv_handle_mac = handle_mac(TOKEN, first.kv_handle) if mac is None else mac
    msgs = list(worker(w.decode.endpoint, TOKEN).Decode(req, timeout=60))
    head = list(first.output.token_ids) if first is not None else []
    return head + [t for m in msgs for t in m.token_ids], msgs


def test_prefills_sharing_a_request_id_do_not_touch_each_others_kv(workers):
    """Two concurrent Prefills and a later one with the same request_id all pin their own KV;
    releasing one transfer leaves the others whole, and releasing all frees every block."""
    w = workers
    assert wait_until(lambda: _all_free(w.prefill.endpoint, PREFILL_BLOCKS), 10)
    prompts = [_prompt(seed, 40) for seed in (1, 2, 3)]  # 3 blocks each
    with futures.ThreadPoolExecutor(2) as pool:
        firsts = list(pool.map(lambda p: _prefill(w, "dup", p), prompts[:2]))
    firsts.append(_prefill(w, "dup", prompts[2]))  # after the others ended: the old id is free again
    assert [f.output.request_id for f in firsts] == ["dup"] * 3  # the label is echoed
    assert len({f.kv_handle.transfer_id for f in firsts}) == 3
    got = load(w.prefill.endpoint, TOKEN)
    assert got.num_pinned_transfers == 3 and got.num_free_blocks == PREFILL_BLOCKS - 9
    _kv(w.prefill.endpoint).Release(
        kv_pb.ReleaseRequest(transfer_id=firsts[0].kv_handle.transfer_id, reason=kv_pb.RELEASE_REASON_DONE),
        timeout=5,
    )
    # Release ends the export at once; its blocks are freed on the engine thread just after.
    assert wait_until(lambda: load(w.prefill.endpoint, TOKEN).num_free_blocks == PREFILL_BLOCKS - 6, 10)
    got = load(w.prefill.endpoint, TOKEN)
    assert got.num_pinned_transfers == 2 and got.num_free_blocks == PREFILL_BLOCKS - 6
    # The others' KV is intact: a pull of each continues exactly as a colocated run would.
    for first, prompt in zip(firsts[1:], prompts[1:], strict=True):
        tokens, msgs = _decode(w, "dup", prompt, first)
        assert {m.request_id for m in msgs} == {"dup"}
        assert tokens == _decode(w, "dup", prompt)[0]
    assert wait_until(lambda: _all_free(w.prefill.endpoint, PREFILL_BLOCKS), 10)
    assert wait_until(lambda: _all_free(w.decode.endpoint, DECODE_BLOCKS), 10)


def test_decodes_sharing_a_request_id_run_side_by_side(workers):
    """A Decode whose request_id is that of a running one runs too, and neither disturbs the other."""
    w = workers
    prompt = _prompt(4, 30)
    stub = worker(w.decode.endpoint, TOKEN)
    long = pb.SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    running = stub.Decode(
        wpb.DecodeRequest(request_id="same", prompt_token_ids=prompt, sampling=long), timeout=60
    )
    first = [next(running)]  # it is running
    second = list(
        stub.Decode(
            wpb.DecodeRequest(request_id="same", prompt_token_ids=prompt, sampling=GREEDY), timeout=60
        )
    )
    assert load(w.decode.endpoint, TOKEN).num_running == 1  # the long one still runs
    first.extend(running)
    assert {m.request_id for m in first + second} == {"same"}
    first_tokens = [t for m in first for t in m.token_ids]
    assert len(first_tokens) == 400
    assert [t for m in second for t in m.token_ids] == first_tokens[:8]
    assert wait_until(lambda: _all_free(w.decode.endpoint, DECODE_BLOCKS), 10)


def _release(w: Workers, response: wpb.PrefillResponse) -> None:
    _kv(w.prefill.endpoint).Release(
        kv_pb.ReleaseRequest(transfer_id=response.kv_handle.transfer_id, reason=kv_pb.RELEASE_REASON_ABORT),
        timeout=5,
    )


def test_pinned_blocks_are_shared_fairly_among_the_clients_a_router_names(workers):
    """Pins are counted per end client (PrefillRequest.client; the calling peer without one): a
    client past the pool's limit is refused (RESOURCE_EXHAUSTED, nothing run), while another holding
    less than its share may still pin up to it; a prompt larger than the limit is INVALID_ARGUMENT."""
    w = workers
    assert wait_until(lambda: _all_free(w.prefill.endpoint, PREFILL_BLOCKS), 10)
    a, b = _prompt(5, 200), _prompt(6, 200)  # 13 blocks each; the limit is 24
    first = _prefill(w, "pin-a", a, client="heavy")
    with pytest.raises(grpc.RpcError) as err:
        _prefill(w, "pin-b", b, client="heavy")
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "caller heavy has 13 KV blocks pinned; 13 more would pass its share of 24" in err.value.details()
    got = load(w.prefill.endpoint, TOKEN)  # the refused prompt never ran
    assert got.num_pinned_transfers == 1 and got.num_free_blocks == PREFILL_BLOCKS - 13
    # Another client: its share is 24 / 2 = 12 blocks, room past the limit up to 24 + (32 - 24) / 2.
    with pytest.raises(grpc.RpcError, match="share of 12"):
        _prefill(w, "pin-c", b, client="light")
    light = _prefill(w, "pin-c", b[:190], client="light")  # 12 blocks: 25 pinned in all
    assert load(w.prefill.endpoint, TOKEN).num_pinned_transfers == 2
    with pytest.raises(grpc.RpcError) as err:
        _prefill(w, "pin-d", _prompt(7, 16 * 25), client="other")  # 25 blocks: never within 24
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "prompt needs 25 KV blocks pinned until its transfer, more than this worker's limit of 24" in (
        err.value.details()
    )
    _release(w, first)
    with pytest.raises(
        grpc.RpcError, match="heavy has 0 KV blocks pinned; 13 more would pass its share of 12"
    ):
        _prefill(w, "pin-b", b, client="heavy")  # 25 > 24 while light pins: heavy gets its share
    _release(w, light)
    second = _prefill(w, "pin-b", b, client="heavy")  # room again
    _release(w, second)
    assert wait_until(lambda: _all_free(w.prefill.endpoint, PREFILL_BLOCKS), 10)


def _forged(endpoint: str, prompt: list[int]) -> kv_pb.KvHandle:
    return kv_pb.KvHandle(
        transfer_id="forged",
        producer=kv_pb.KvProducer(engine_id="x", epoch=1, endpoint=endpoint),
        block_hashes=hash_blocks(prompt, BLOCK_SIZE),
        num_tokens=len(prompt),
        num_blocks=-(-len(prompt) // BLOCK_SIZE),
        block_size=BLOCK_SIZE,
        compat_hash="whatever",
    )


def test_forged_handles_are_refused_before_any_connection(workers):
    w = workers
    prompt = _prompt(7, 40)
    allowed, unlisted = _forged(w.allowed.endpoint, prompt), _forged(w.unlisted.endpoint, prompt)
    moved = kv_pb.KvHandle()
    moved.CopyFrom(unlisted)
    moved.producer.endpoint = w.allowed.endpoint  # signed for one endpoint, sent with another
    cases = {
        "no-mac": (allowed, b"", "kv_handle_mac is missing"),
        "wrong-mac": (allowed, b"\x00" * 32, "kv_handle_mac does not match"),
        "other-key": (allowed, handle_mac("not-the-token", allowed), "kv_handle_mac does not match"),
        "tampered": (moved, handle_mac(TOKEN, unlisted), "kv_handle_mac does not match"),
        "unknown-producer": (
            unlisted,
            handle_mac(TOKEN, unlisted),
            "is not one of this worker's --kv-producers",
        ),
    }
    stub = worker(w.decode.endpoint, TOKEN)
    for name, (handle, mac, message) in cases.items():
        req = wpb.DecodeRequest(
            request_id=name,
            prompt_token_ids=prompt,
            sampling=GREEDY,
            output_token_ids=[9],
            kv_handle=handle,
            kv_handle_mac=mac,
        )
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Decode(req, timeout=10))
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED, name
        assert message in err.value.details(), (name, err.value.details())
    time.sleep(0.5)  # a background Release would have dialed by now
    assert not w.allowed.connected() and not w.unlisted.connected()
    assert _all_free(w.decode.endpoint, DECODE_BLOCKS)
    # The control: a correctly signed handle naming the listed fake is dialed (and fails).
    req = wpb.DecodeRequest(
        request_id="control",
        prompt_token_ids=prompt,
        sampling=GREEDY,
        output_token_ids=[9],
        kv_handle=allowed,
        kv_handle_mac=handle_mac(TOKEN, allowed),
    )
    req.kv_handle.compat_hash = (
        worker(w.decode.endpoint, TOKEN).GetEngineInfo(wpb.GetEngineInfoRequest(), timeout=5).compat_hash
    )
    req.kv_handle_mac = handle_mac(TOKEN, req.kv_handle)
    with pytest.raises(grpc.RpcError):
        list(stub.Decode(req, timeout=2))
    assert wait_until(w.allowed.connected, 5)
    assert wait_until(lambda: _all_free(w.decode.endpoint, DECODE_BLOCKS), 10)


def _readiness(endpoint: str) -> int:
    with grpc.insecure_channel(endpoint) as ch:
        return (
            health_pb2_grpc.HealthStub(ch)
            .Check(health_pb2.HealthCheckRequest(service="readiness"), timeout=2)
            .status
        )


def test_drain_needs_the_token_then_stops_the_worker_gracefully(workers):
    """Drain without the token changes nothing; with it, readiness turns NOT_SERVING at once, a
    stream in flight finishes, and the process exits 0."""
    w, endpoint = workers, workers.colocated.endpoint
    with grpc.insecure_channel(endpoint) as ch:
        with pytest.raises(grpc.RpcError) as err:
            wgrpc.WorkerStub(ch).Drain(wpb.DrainRequest(), timeout=5)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert _readiness(endpoint) == health_pb2.HealthCheckResponse.SERVING
    assert not load(endpoint, TOKEN).draining
    stub = worker(endpoint, TOKEN)
    # Long enough to be still running when Drain lands (the colocated worker holds 1,024 tokens).
    long = pb.SamplingParams(temperature=0, max_tokens=600, ignore_eos=True)
    stream = stub.Decode(
        wpb.DecodeRequest(request_id="in-flight", prompt_token_ids=_prompt(8, 20), sampling=long)
    )
    tokens = list(next(stream).token_ids)
    rest: list[int] = []
    reader = threading.Thread(target=lambda: rest.extend(t for m in stream for t in m.token_ids))
    reader.start()
    assert stub.Drain(wpb.DrainRequest(), timeout=5).num_in_flight >= 1
    start = time.monotonic()
    assert wait_until(lambda: _readiness(endpoint) == health_pb2.HealthCheckResponse.NOT_SERVING, 1.0)
    assert time.monotonic() - start < 1.0
    reader.join(timeout=30)
    assert len(tokens + rest) == 600
    assert w.colocated.popen.wait(timeout=15) == 0


# ---- Decode subscriptions: one stream for many calls' outputs, a message per step -----------------


def _subscribe(stub: wgrpc.WorkerStub):
    """-> (the Subscribe call, its id)."""
    call = stub.Subscribe(wpb.SubscribeRequest(), timeout=120)
    first = next(call)
    assert first.subscription_id and not first.outputs
    return call, first.subscription_id


def _until_finished(call, labels: set[str]) -> tuple[list[wpb.DecodeOutputs], dict[str, list[int]]]:
    """Read a subscription until every label's last message (the one with usage) came."""
    msgs, tokens, left = [], {label: [] for label in labels}, set(labels)
    while left:
        msg = next(call)
        msgs.append(msg)
        for out in msg.outputs:
            tokens[out.request_id].extend(out.token_ids)
            if out.HasField("usage"):
                left.discard(out.request_id)
    return msgs, tokens


def test_subscribed_decodes_send_their_outputs_per_step_on_one_stream(workers):
    """Two Decode calls naming one subscription: each call's stream ends without a message once its
    request finished, and the subscription carries their tokens (equal to each call's own stream),
    both requests' outputs in one message for the steps they shared, each last one with usage."""
    w = workers
    stub = worker(w.decode.endpoint, TOKEN)
    prompts = {"a": _prompt(7, 30), "b": _prompt(8, 45)}
    sampling = pb.SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)  # long enough to overlap

    def own_stream(label: str, prompt: list[int]) -> list[int]:
        req = wpb.DecodeRequest(request_id=label, prompt_token_ids=prompt, sampling=sampling)
        return [t for m in stub.Decode(req, timeout=60) for t in m.token_ids]

    alone = {label: own_stream(label, prompt) for label, prompt in prompts.items()}
    sub, sid = _subscribe(stub)
    try:
        with futures.ThreadPoolExecutor(2) as pool:
            calls = [
                pool.submit(
                    lambda label, prompt: list(
                        stub.Decode(
                            wpb.DecodeRequest(
                                request_id=label,
                                prompt_token_ids=prompt,
                                sampling=sampling,
                                subscription_id=sid,
                            ),
                            timeout=60,
                        )
                    ),
                    label,
                    prompt,
                )
                for label, prompt in prompts.items()
            ]
            msgs, tokens = _until_finished(sub, set(prompts))
            assert [c.result(timeout=30) for c in calls] == [[], []]  # nothing on the calls themselves
    finally:
        sub.cancel()
    assert tokens == alone
    assert any({o.request_id for o in m.outputs} == {"a", "b"} for m in msgs)  # steps they shared
    assert sum(len(m.outputs) for m in msgs) > len(msgs)
    assert wait_until(lambda: _all_free(w.decode.endpoint, DECODE_BLOCKS), 10)


def test_subscriptions_refuse_unknown_ids_missing_or_busy_labels_and_too_many(workers):
    from services.worker.subscriptions import MAX_PER_CALLER

    w = workers
    stub = worker(w.decode.endpoint, TOKEN)
    prompt = _prompt(9, 20)

    def decode(sid: str, label: str, tokens: int = 8):
        sampling = pb.SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
        req = wpb.DecodeRequest(
            request_id=label, prompt_token_ids=prompt, sampling=sampling, subscription_id=sid
        )
        return stub.Decode(req, timeout=60)

    with pytest.raises(grpc.RpcError) as e:
        list(decode("0" * 32, "x"))
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    subs = [_subscribe(stub) for _ in range(MAX_PER_CALLER)]
    try:
        with pytest.raises(grpc.RpcError) as e:
            _subscribe(stub)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert str(MAX_PER_CALLER) in e.value.details()
        call, sid = subs[0]
        with pytest.raises(grpc.RpcError) as e:
            list(decode(sid, ""))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "request_id" in e.value.details()
        running = decode(sid, "busy", tokens=400)
        assert next(call).outputs[0].request_id == "busy"  # it runs
        with pytest.raises(grpc.RpcError) as e:
            list(decode(sid, "busy"))
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "busy" in e.value.details()
        running.cancel()  # the running call's request is aborted
    finally:
        for call, _ in subs:
            call.cancel()
    assert wait_until(lambda: _all_free(w.decode.endpoint, DECODE_BLOCKS), 10)
    _subscribe(stub)[0].cancel()  # the closed ones no longer count


def test_a_subscription_that_ends_fails_its_calls_and_frees_their_blocks(workers):
    w = workers
    stub = worker(w.decode.endpoint, TOKEN)
    sub, sid = _subscribe(stub)
    sampling = pb.SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    call = stub.Decode(
        wpb.DecodeRequest(
            request_id="r", prompt_token_ids=_prompt(10, 30), sampling=sampling, subscription_id=sid
        ),
        timeout=60,
    )
    assert next(sub).outputs[0].request_id == "r"  # it runs
    sub.cancel()
    with pytest.raises(grpc.RpcError) as e:
        list(call)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "subscription" in e.value.details()
    assert wait_until(lambda: _all_free(w.decode.endpoint, DECODE_BLOCKS), 10)


def test_the_routers_subscription_against_the_worker(workers):
    """The router's end (services/router/subscription.py) against a real decode worker: the
    outputs of a call that names it reach the generation's queue, the same tokens as a call's own
    stream; a worker without Subscribe (UNIMPLEMENTED) makes it stand aside."""
    from services.common.grpc_utils import channel
    from services.common.security import Security
    from services.router.subscription import DecodeSubscription

    w = workers
    prompt = _prompt(11, 30)

    async def scenario() -> list[int]:
        ch = channel(w.decode.endpoint, Security(token=TOKEN))
        stub = wgrpc.WorkerStub(ch)
        subscription = DecodeSubscription(stub, w.decode.endpoint)
        try:
            sid, queue = await subscription.join("g1")
            req = wpb.DecodeRequest(
                request_id="g1", prompt_token_ids=prompt, sampling=GREEDY, subscription_id=sid
            )
            assert [m async for m in stub.Decode(req, timeout=60)] == []
            tokens = []
            while True:
                out = await asyncio.wait_for(queue.get(), 30)
                tokens.extend(out.token_ids)
                if out.HasField("usage"):
                    return tokens
        finally:
            subscription.leave("g1")
            await subscription.close()
            await ch.close()

    assert asyncio.run(scenario()) == _decode(w, "g1", prompt)[0]
    assert wait_until(lambda: _all_free(w.decode.endpoint, DECODE_BLOCKS), 10)

    class Unimplemented:
        def Subscribe(self, request):
            class Call:
                async def read(self):
                    raise grpc.aio.AioRpcError(
                        grpc.StatusCode.UNIMPLEMENTED,
                        grpc.aio.Metadata(),
                        grpc.aio.Metadata(),
                        "no such method",
                    )

                def cancel(self):
                    pass

            return Call()

    async def older() -> tuple:
        subscription = DecodeSubscription(Unimplemented(), "older:1")
        return await subscription.join("g"), subscription.supported

    assert asyncio.run(older()) == (None, False)

    class EndsAtOnce:
        """A worker whose Subscribe stream ends before its first message."""

        opened = 0

        def Subscribe(self, request):
            EndsAtOnce.opened += 1

            class Call:
                async def read(self):
                    return grpc.aio.EOF

                def cancel(self):
                    pass

            return Call()

    async def ending() -> None:
        subscription = DecodeSubscription(EndsAtOnce(), "ending:1")
        for _ in range(2):  # UNAVAILABLE each time, and each join tries a new stream
            with pytest.raises(ServiceError) as e:
                await subscription.join("g")
            assert e.value.code == grpc.StatusCode.UNAVAILABLE and e.value.endpoint == "ending:1"
        assert subscription.supported

    asyncio.run(ending())
    assert EndsAtOnce.opened == 2
