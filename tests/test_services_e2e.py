"""The disaggregated stack end to end: a router, a prefill and a decode worker as real processes.

Outputs are compared with the offline engine (the reference the parity tests tie to HF), through
gRPC and through the `openai` client; KV really moves; cancellation, lease expiry and a corrupt
KV chunk leave no block behind.

The shared stack's workers move KV over NIXL (--kv-transport auto, NIXL installed); the tests
where the transport matters also run against a stack whose workers move it over the gRPC chunk
stream (`transport_stack`), and give the same tokens; that stack's router also gathers tokens
into fewer messages (--stream-interval).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import urllib.request
import zlib
from concurrent import futures

import grpc
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine import LLM, SamplingParams
from engine.kv_cache.checksum import block_checksums
from engine.kv_cache.hashing import hash_blocks
from engine.kv_cache.nixl import NixlAgent
from engine.kv_cache.transfer import KVPort
from pdserve.v1 import inference_pb2 as pb
from pdserve.v1 import kv_transfer_pb2 as kv_pb
from pdserve.v1 import kv_transfer_pb2_grpc as kv_grpc
from pdserve.v1 import worker_pb2 as wpb
from pdserve.v1 import worker_pb2_grpc as wgrpc
from services.common.security import handle_mac
from services.kv_transfer.nixl_pull import agent_info
from services.kv_transfer.wire import spec_from_proto
from services.launcher import free_port
from tests.service_testing import (
    generate,
    inference,
    kv_transfer,
    load,
    metric,
    start_stack,
    wait_until,
    worker,
)

PROMPTS = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "import os\nimport sys\n\nclass Config:\n    def __init__(self, path):\n        self.path = path\n        self.values = {}\n",
    "The quick brown fox",
    "for i in range(10):\n    print(i * i)\n# and now the squares of the odd numbers only, in reverse order, one per line\n",
    "x = [1, 2, 3]\ny = {'a': 1}\n",
    "while True:\n    line = input()\n    if not line:\n        break\n    total += int(line)\nprint(total)\n",
]
MODES = {"disaggregated": pb.SERVING_MODE_DISAGGREGATED, "colocated": pb.SERVING_MODE_COLOCATED}


@pytest.fixture(scope="module")
def stack(serving_stack):
    return serving_stack


STREAM_INTERVAL = 3


@pytest.fixture(scope="module")
def grpc_stack(tiny_model, tmp_path_factory, stack):
    """A stack whose workers move KV over the gRPC chunk stream only (the shared stack's token:
    its workers and the shared stack's may hand KV over to each other), and whose router gathers
    STREAM_INTERVAL tokens a message."""
    grpc_only = ["--kv-transport", "grpc"]
    st = start_stack(
        tiny_model,
        tmp_path_factory.mktemp("grpc-stack"),
        router_args=["--colocate-max-tokens", "0", "--stream-interval", str(STREAM_INTERVAL)],
        worker_args={"prefill": grpc_only, "decode": grpc_only},
        env={"PDSERVE_INTERNAL_TOKEN": stack.token},
    )
    yield st
    codes = st.stop()
    assert codes == {name: 0 for name in codes}, f"unclean exits: {codes}"


TRANSPORTS = ["nixl", "grpc"]


@pytest.fixture(params=TRANSPORTS)
def transport(request) -> str:
    return request.param


@pytest.fixture
def transport_stack(request, transport, stack):
    """The shared stack (KV over NIXL), then the gRPC-only one."""
    return stack if transport == "nixl" else request.getfixturevalue("grpc_stack")


def _moved_over(st, transport: str) -> bool:
    """The decode worker said, once per producer, how KV from it moves."""
    log = st.workers("decode")[0].log_path.read_text()
    producer = st.workers("prefill")[0].endpoint
    nixl_lines = log.count(f"KV from producer {producer} moves over NIXL")
    return nixl_lines == 1 if transport == "nixl" else nixl_lines == 0 and "gRPC only" in log


@pytest.fixture(scope="module")
def offline(tiny_model) -> LLM:
    return LLM(tiny_model, dtype="float32", num_kv_blocks=256)


@pytest.fixture(scope="module")
def token(stack) -> str:
    """The stack's internal token: calling a worker directly needs it."""
    return stack.token


@pytest.fixture(scope="module")
def prefill_ep(stack) -> str:
    return stack.workers("prefill")[0].endpoint


@pytest.fixture(scope="module")
def decode_ep(stack) -> str:
    return stack.workers("decode")[0].endpoint


def _reference(offline: LLM, prompts: list[str], **params):
    return offline.generate(prompts, SamplingParams(**params))


def _parallel(fn, items):
    with futures.ThreadPoolExecutor(len(items)) as pool:
        return list(pool.map(fn, items))


@pytest.mark.parametrize("mode", list(MODES))
def test_grpc_batch_matches_the_offline_engine(transport_stack, transport, offline, mode):
    """Different prompts at once: every greedy token and top-3 logprob equals the offline engine's."""
    stack = transport_stack
    stub = inference(stack)
    sampling = pb.SamplingParams(temperature=0.0, max_tokens=12, logprobs=3)
    results = _parallel(lambda p: generate(stub, text=p, sampling=sampling, mode=MODES[mode]), PROMPTS)
    refs = _reference(offline, PROMPTS, temperature=0.0, max_tokens=12, logprobs=3)
    for (tokens, msgs), ref in zip(results, refs, strict=True):
        assert tokens == ref.token_ids
        assert "".join(m.text for m in msgs) == ref.text
        got = [dict(zip(lp.token_ids, lp.logprobs, strict=True)) for m in msgs for lp in m.logprobs]
        assert [list(g) for g in got] == [list(r) for r in ref.logprobs]  # same tokens, same order
        for g, r in zip(got, ref.logprobs, strict=True):
            assert g == pytest.approx(r, abs=1e-4)
        last = msgs[-1]
        assert last.finish_reason == pb.FINISH_REASON_LENGTH
        assert last.usage.prompt_tokens == len(ref.prompt_token_ids)
        assert last.usage.completion_tokens == 12
        assert last.disaggregated == (mode == "disaggregated")
        assert (last.usage.kv_transfer_bytes > 0) == (
            mode == "disaggregated"
        )  # fresh prompts: all of their KV moves
        if transport == "grpc":  # its router gathers tokens; the first and the last go at once
            assert all(len(m.token_ids) >= STREAM_INTERVAL for m in msgs[1:-1]), msgs
            assert len(msgs) <= 2 + (12 - 1) // STREAM_INTERVAL
    if mode == "disaggregated":
        assert _moved_over(stack, transport)


def test_seeded_sampling_is_the_same_disaggregated_colocated_and_offline(transport_stack, offline):
    """The prefill rank's generator state travels with the KV, so the random stream continues."""
    stub = inference(transport_stack)
    kw = dict(temperature=0.9, top_p=0.95, seed=1234, max_tokens=16)
    ref = _reference(offline, [PROMPTS[1]], **kw)[0].token_ids
    for mode in MODES.values():
        tokens, _ = generate(stub, text=PROMPTS[1], sampling=pb.SamplingParams(**kw), mode=mode)
        assert tokens == ref


def test_stop_string_and_first_token_finish(stack, offline):
    stub = inference(stack)
    ref = _reference(offline, [PROMPTS[0]], temperature=0.0, max_tokens=12)[0]
    stop = ref.text[4:7]
    want = _reference(offline, [PROMPTS[0]], temperature=0.0, max_tokens=12, stop=[stop])[0]
    tokens, msgs = generate(
        stub,
        text=PROMPTS[0],
        sampling=pb.SamplingParams(temperature=0, max_tokens=12, stop=[stop]),
        mode=MODES["disaggregated"],
    )
    assert "".join(m.text for m in msgs) == want.text and msgs[-1].stop_string == stop
    assert msgs[-1].finish_reason == pb.FINISH_REASON_STOP and tokens == want.token_ids
    # max_tokens=1 ends at the prefill rank: no KV moves, no decode.
    tokens, msgs = generate(
        stub,
        text=PROMPTS[1],
        sampling=pb.SamplingParams(temperature=0, max_tokens=1),
        mode=MODES["disaggregated"],
    )
    assert (
        len(tokens) == 1
        and msgs[-1].usage.kv_transfer_bytes == 0
        and msgs[-1].finish_reason == pb.FINISH_REASON_LENGTH
    )


def test_openai_client_matches_the_offline_engine(stack, offline):
    client = openai.OpenAI(base_url=stack.http_url + "/v1", api_key="unused")
    refs = _reference(offline, PROMPTS[:3], temperature=0.0, max_tokens=10, logprobs=2)
    extra = {"mode": "disaggregated"}
    for prompt, ref in zip(PROMPTS[:3], refs, strict=True):
        r = client.completions.create(
            model="pdserve-tiny", prompt=prompt, max_tokens=10, temperature=0, logprobs=2, extra_body=extra
        )
        choice = r.choices[0]
        assert choice.text == ref.text and choice.finish_reason == "length"
        assert choice.logprobs.token_logprobs == pytest.approx(
            [lp[t] for lp, t in zip(ref.logprobs, ref.token_ids, strict=True)], abs=1e-4
        )
        assert r.usage.completion_tokens == 10 and r.usage.prompt_tokens == len(ref.prompt_token_ids)
        stream = client.completions.create(
            model="pdserve-tiny", prompt=prompt, max_tokens=10, temperature=0, stream=True, extra_body=extra
        )
        assert "".join(c.choices[0].text for c in stream if c.choices) == ref.text

    messages = [{"role": "user", "content": "Write a function that reverses a list."}]
    tok = offline.tokenizer
    ids = tok.encode(tok.apply_chat_template(messages), add_special_tokens=False)
    ref = offline.generate(
        prompt_token_ids=[ids], sampling_params=SamplingParams(temperature=0, max_tokens=12)
    )[0]
    chat = client.chat.completions.create(
        model="pdserve-tiny", messages=messages, max_tokens=12, temperature=0, extra_body=extra
    )
    assert chat.choices[0].message.content == ref.text
    chunks = client.chat.completions.create(
        model="pdserve-tiny", messages=messages, max_tokens=12, temperature=0, stream=True, extra_body=extra
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref.text


def test_kv_bytes_moved_are_reported_and_counted(transport_stack, tiny_model):
    """A fresh 40-token prompt: 3 blocks of 16 tokens x layers x (kv_lora_rank + rope) x fp32 move,
    the usage says so and the router's counter grows by as much."""
    stack = transport_stack
    cfg = json.load(open(f"{tiny_model}/config.json"))
    width = cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]
    before = metric(
        urllib.request.urlopen(stack.http_url + "/metrics").read().decode(), "pdserve_kv_transfer_bytes_total"
    )
    prompt = [7 + (i * 31) % 3000 for i in range(40)]
    _, msgs = generate(
        inference(stack),
        token_ids=pb.TokenIds(ids=prompt),
        sampling=pb.SamplingParams(temperature=0, max_tokens=3),
        mode=MODES["disaggregated"],
    )
    expected = 3 * cfg["num_hidden_layers"] * 16 * width * 4
    assert msgs[-1].usage.kv_transfer_bytes == expected
    assert msgs[-1].timings.kv_transfer_ns > 0 and msgs[-1].timings.prefill_ns > 0
    after = metric(
        urllib.request.urlopen(stack.http_url + "/metrics").read().decode(), "pdserve_kv_transfer_bytes_total"
    )
    assert after - before == expected
    # The same prompt again: the decode rank holds its 2 full blocks, only the partial one moves.
    _, msgs = generate(
        inference(stack),
        token_ids=pb.TokenIds(ids=prompt),
        sampling=pb.SamplingParams(temperature=0, max_tokens=3),
        mode=MODES["disaggregated"],
    )
    assert msgs[-1].usage.kv_transfer_bytes == expected // 3
    assert msgs[-1].usage.cached_tokens == 32  # the prefill rank's prefix cache


def test_cancel_after_three_tokens_frees_blocks_on_both_workers(transport_stack):
    stack = transport_stack
    token = stack.token
    prefill_ep, decode_ep = stack.workers("prefill")[0].endpoint, stack.workers("decode")[0].endpoint
    base_p, base_d = load(prefill_ep, token).num_free_blocks, load(decode_ep, token).num_free_blocks
    prompt = [11 + (i * 17) % 3000 for i in range(50)]
    call = inference(stack).Generate(
        pb.GenerateRequest(
            token_ids=pb.TokenIds(ids=prompt),
            sampling=pb.SamplingParams(temperature=0, max_tokens=400, ignore_eos=True),
            mode=MODES["disaggregated"],
        ),
        timeout=60,
    )
    seen = 0
    for msg in call:
        seen += len(msg.token_ids)
        if seen >= 3:
            break
    assert load(decode_ep, token).num_free_blocks < base_d  # the request is running there
    call.cancel()
    t0 = time.monotonic()
    assert wait_until(
        lambda: (
            load(decode_ep, token).num_free_blocks == base_d
            and load(prefill_ep, token).num_free_blocks == base_p
        ),
        1.0,
    ), (load(prefill_ep, token), load(decode_ep, token), base_p, base_d)
    assert time.monotonic() - t0 <= 1.0
    assert load(prefill_ep, token).num_pinned_transfers == 0 and load(decode_ep, token).num_running == 0


def test_decode_side_gone_after_prefill_lease_expiry_frees_blocks(prefill_ep, token):
    """The decode rank never pulls (it died): the prefill rank frees the blocks when the lease
    runs out, and a late Pull gets NOT_FOUND."""
    base = load(prefill_ep, token).num_free_blocks
    prompt = [5 + (i * 13) % 3000 for i in range(45)]
    resp = worker(prefill_ep, token).Prefill(
        wpb.PrefillRequest(
            request_id="lease-test",
            prompt_token_ids=prompt,
            sampling=pb.SamplingParams(temperature=0, max_tokens=8),
            lease_ms=600,
        ),
        timeout=30,
    )
    handle = resp.kv_handle
    assert handle.num_blocks == 3 and handle.num_tokens == 45
    assert (
        load(prefill_ep, token).num_pinned_transfers == 1
        and load(prefill_ep, token).num_free_blocks == base - 3
    )
    assert wait_until(lambda: load(prefill_ep, token).num_pinned_transfers == 0, 3.0)
    assert load(prefill_ep, token).num_free_blocks == base
    kv = kv_transfer(prefill_ep, token)
    with pytest.raises(grpc.RpcError) as err:
        list(
            kv.Pull(kv_pb.PullRequest(transfer_id=handle.transfer_id, epoch=handle.producer.epoch), timeout=5)
        )
    assert err.value.code() == grpc.StatusCode.NOT_FOUND and "expired" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:  # nor can a NIXL reader begin
        kv.BeginRead(
            kv_pb.BeginReadRequest(
                transfer_id=handle.transfer_id, epoch=handle.producer.epoch, read_timeout_ms=1000
            ),
            timeout=5,
        )
    assert err.value.code() == grpc.StatusCode.NOT_FOUND and "expired" in err.value.details()
    for bad in ("no-such-transfer", ""):
        with pytest.raises(grpc.RpcError) as err:
            kv.Release(kv_pb.ReleaseRequest(transfer_id=bad), timeout=5)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.RpcError) as err:  # a handle from another epoch
        list(
            kv.Pull(
                kv_pb.PullRequest(transfer_id=handle.transfer_id, epoch=handle.producer.epoch - 1), timeout=5
            )
        )
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION


def _prefill(prefill_ep: str, token: str, prompt: list[int], **kw) -> wpb.PrefillResponse:
    return worker(prefill_ep, token).Prefill(
        wpb.PrefillRequest(
            prompt_token_ids=prompt, sampling=pb.SamplingParams(temperature=0, max_tokens=6), **kw
        ),
        timeout=30,
    )


def _decode(decode_ep: str, token: str, prompt: list[int], first: wpb.PrefillResponse) -> list[int]:
    """Continue a Prefill on a decode worker -> every token (the prefill's first included)."""
    request = wpb.DecodeRequest(
        prompt_token_ids=prompt,
        sampling=pb.SamplingParams(temperature=0, max_tokens=6),
        output_token_ids=first.output.token_ids,
        kv_handle=first.kv_handle,
        kv_handle_mac=handle_mac(token, first.kv_handle),
    )
    stream = worker(decode_ep, token).Decode(request, timeout=30)
    return list(first.output.token_ids) + [t for m in stream for t in m.token_ids]


def test_a_worker_without_nixl_and_one_with_it_fall_back_to_grpc_and_say_so(stack, grpc_stack, offline):
    """Across the two stacks (one token): a NIXL decode worker pulling from a gRPC-only producer,
    and a gRPC-only decode worker pulling from a NIXL producer, both give the offline tokens; the
    NIXL worker says once that this producer's KV moves over gRPC; the gRPC-only producer refuses
    BeginRead; nothing stays pinned or allocated."""
    token = stack.token
    nixl_prefill, nixl_decode = stack.workers("prefill")[0], stack.workers("decode")[0]
    grpc_prefill, grpc_decode = grpc_stack.workers("prefill")[0], grpc_stack.workers("decode")[0]
    for i, (prefill, decode) in enumerate([(grpc_prefill, nixl_decode), (nixl_prefill, grpc_decode)] * 2):
        prompt = [3 + (i * 7 + j * 11) % 3000 for j in range(37)]
        ref = offline.generate(
            prompt_token_ids=[prompt], sampling_params=SamplingParams(temperature=0, max_tokens=6)
        )[0]
        assert (
            _decode(decode.endpoint, token, prompt, _prefill(prefill.endpoint, token, prompt))
            == ref.token_ids
        )
    said = f"KV from producer {grpc_prefill.endpoint} moves over gRPC: it does not serve KV over NIXL"
    assert nixl_decode.log_path.read_text().count(said) == 1
    assert "KV transport: gRPC only (--kv-transport grpc)" in grpc_decode.log_path.read_text()
    assert (
        worker(grpc_prefill.endpoint, token)
        .GetEngineInfo(wpb.GetEngineInfoRequest(), timeout=5)
        .HasField("nixl")
        is False
    )
    with pytest.raises(grpc.RpcError) as err:
        kv_transfer(grpc_prefill.endpoint, token).BeginRead(
            kv_pb.BeginReadRequest(transfer_id="x", read_timeout_ms=1000), timeout=5
        )
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "Pull" in err.value.details()
    for w in (nixl_prefill, grpc_prefill):
        assert wait_until(lambda w=w: load(w.endpoint, token).num_pinned_transfers == 0, 5.0)


def test_nixl_metadata_goes_to_authenticated_callers_only(prefill_ep, token):
    info = worker(prefill_ep, token).GetEngineInfo(wpb.GetEngineInfoRequest(), timeout=5)
    assert info.nixl.metadata and info.nixl.checksums and len(info.nixl.regions) == info.kv_cache.num_layers
    for caller in (worker(prefill_ep), worker(prefill_ep, "not-the-token")):
        with pytest.raises(grpc.RpcError) as err:
            caller.GetEngineInfo(wpb.GetEngineInfoRequest(), timeout=5)
        assert err.value.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)


def test_a_nixl_reader_that_never_releases_ends_by_itself_and_frees_the_blocks_once(prefill_ep, token):
    """A decode worker that died mid-read (BeginRead, then nothing): the producer ends the read at
    the reader's deadline plus its margin, the export with it once its lease ran out; the blocks
    are freed once and a late Release is NOT_FOUND."""
    base = load(prefill_ep, token).num_free_blocks
    prompt = [4 + (i * 19) % 3000 for i in range(33)]
    handle = _prefill(prefill_ep, token, prompt, lease_ms=200).kv_handle
    kv = kv_transfer(prefill_ep, token)
    begun = kv.BeginRead(
        kv_pb.BeginReadRequest(
            transfer_id=handle.transfer_id, epoch=handle.producer.epoch, first_block=1, read_timeout_ms=500
        ),
        timeout=5,
    )
    assert len(begun.block_ids) == len(begun.block_checksums) == handle.num_blocks - 1 == 2
    assert 0 < begun.read_hold_ms <= 1500  # the reader's 500 ms and the producer's 1 s margin
    time.sleep(0.4)  # past the lease, inside the read: still pinned
    assert load(prefill_ep, token).num_pinned_transfers == 1
    assert wait_until(lambda: load(prefill_ep, token).num_pinned_transfers == 0, 5.0)
    assert load(prefill_ep, token).num_free_blocks == base
    with pytest.raises(grpc.RpcError) as err:
        kv.Release(kv_pb.ReleaseRequest(transfer_id=handle.transfer_id), timeout=5)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND and "expired" in err.value.details()


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(read_timeout_ms=0), "read_timeout_ms must be > 0"),
        (dict(first_block=4), r"first_block 4 outside \[0, 3\]"),
        (dict(epoch=1), "is from epoch 1"),
        (dict(transfer_id="nope"), "unknown transfer 'nope'"),
    ],
    ids=["no-timeout", "first-block", "epoch", "unknown"],
)
def test_begin_read_refuses_what_does_not_fit_and_pins_nothing(prefill_ep, token, change, message):
    prompt = [6 + (i * 23) % 3000 for i in range(40)]
    handle = _prefill(prefill_ep, token, prompt).kv_handle
    kv = kv_transfer(prefill_ep, token)
    request = dict(transfer_id=handle.transfer_id, epoch=handle.producer.epoch, read_timeout_ms=1000)
    with pytest.raises(grpc.RpcError) as err:
        kv.BeginRead(kv_pb.BeginReadRequest(**{**request, **change}), timeout=5)
    assert re.search(message, err.value.details())
    kv.Release(
        kv_pb.ReleaseRequest(transfer_id=handle.transfer_id, reason=kv_pb.RELEASE_REASON_ABORT), timeout=5
    )
    assert wait_until(lambda: load(prefill_ep, token).num_pinned_transfers == 0, 5.0)


class CorruptProducer(kv_grpc.KvTransferServicer):
    """An in-process KvTransfer that serves well-formed chunks with one flipped byte."""

    def __init__(self, info: wpb.EngineInfo):
        self.geo = info.kv_cache
        self.releases: list[kv_pb.ReleaseRequest] = []

    def Pull(self, request, context):
        g = self.geo
        data = bytearray(b"\x00" * (g.num_layers * g.block_size * g.width * 4))
        crc = zlib.crc32(bytes(data))
        data[len(data) // 2] ^= 0x40
        yield kv_pb.KvChunk(
            layer_start=0,
            num_layers=g.num_layers,
            block_start=request.first_block,
            num_blocks=1,
            dtype=g.dtype,
            shape=[g.num_layers, 1, g.block_size, g.width],
            data=bytes(data),
            crc32=crc,
        )

    def Release(self, request, context):
        self.releases.append(request)
        return kv_pb.ReleaseResponse()


def _decode_from(decode_ep, token, info, endpoint, engine_id, transfer_id, prompt, ref, policy):
    """Decode on the real decode worker with a signed handle to a 20-token prompt's 2 blocks on
    a fake producer at endpoint, continuing after ref's first token, under kv_failure_policy."""
    handle = kv_pb.KvHandle(
        transfer_id=transfer_id,
        producer=kv_pb.KvProducer(engine_id=engine_id, epoch=1, endpoint=endpoint),
        block_hashes=hash_blocks(prompt, 16),
        num_tokens=20,
        num_blocks=2,
        block_size=16,
        compat_hash=info.compat_hash,
    )
    request = wpb.DecodeRequest(
        request_id=transfer_id,
        prompt_token_ids=prompt,
        sampling=pb.SamplingParams(temperature=0, max_tokens=6),
        output_token_ids=ref.token_ids[:1],
        kv_handle=handle,
        kv_handle_mac=handle_mac(token, handle),
        kv_failure_policy=pb.KV_FAILURE_POLICY_RECOMPUTE
        if policy == "recompute"
        else pb.KV_FAILURE_POLICY_FAIL,
    )
    return worker(decode_ep, token).Decode(request, timeout=30)


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_corrupt_kv_chunk_is_data_loss_or_recomputed(decode_ep, offline, policy, token):
    info = worker(decode_ep, token).GetEngineInfo(wpb.GetEngineInfoRequest(), timeout=5)
    producer = CorruptProducer(info)
    server = grpc.server(futures.ThreadPoolExecutor(2))
    kv_grpc.add_KvTransferServicer_to_server(producer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        prompt = [9 + (i * 29) % 3000 for i in range(20)]
        ref = offline.generate(
            prompt_token_ids=[prompt], sampling_params=SamplingParams(temperature=0, max_tokens=6)
        )[0]
        base = load(decode_ep, token).num_free_blocks
        stream = _decode_from(
            decode_ep, token, info, f"127.0.0.1:{port}", "fake", "corrupt-1", prompt, ref, policy
        )
        if policy == "fail":
            with pytest.raises(grpc.RpcError) as err:
                list(stream)
            assert err.value.code() == grpc.StatusCode.DATA_LOSS and "checksum" in err.value.details()
        else:
            tokens = [t for m in stream for t in m.token_ids]
            assert ref.token_ids[:1] + tokens == ref.token_ids
        assert wait_until(lambda: load(decode_ep, token).num_free_blocks == base, 1.0)
        assert wait_until(lambda: len(producer.releases) == 1, 2.0)
        assert producer.releases[0].reason == kv_pb.RELEASE_REASON_ABORT
    finally:
        server.stop(0)


class FlippedNixlProducer(kv_grpc.KvTransferServicer, wgrpc.WorkerServicer):
    """An in-process producer with a real NIXL agent over KV caches of the decode worker's spec:
    it takes its blocks' checksums, then a byte of block 1 flips (after the handle was issued)."""

    def __init__(self, info: wpb.EngineInfo, name: str):
        import torch

        self.engine_id = name
        self.info = info
        self.spec = spec_from_proto(info.kv_cache_spec)
        self.caches = self.spec.allocate(4, "cpu")
        for c in self.caches:
            c.copy_(torch.randn(c.shape))
        self.agent = NixlAgent(name, KVPort(self.spec, self.caches))
        self.block_ids = [2, 0]
        self.digests = block_checksums(self.spec, self.caches, self.block_ids)
        self.caches[0][0].view(torch.uint8)[3, 7] ^= 0x08  # block 0: the handle's second block
        self.releases: list[kv_pb.ReleaseRequest] = []

    def GetEngineInfo(self, request, context):
        info = wpb.EngineInfo()
        info.CopyFrom(self.info)
        info.identity.CopyFrom(kv_pb.KvProducer(engine_id=self.engine_id, epoch=1))
        info.nixl.CopyFrom(agent_info(self.agent, checksums=True))
        return info

    def BeginRead(self, request, context):
        first = request.first_block
        return kv_pb.BeginReadResponse(
            block_ids=self.block_ids[first:],
            block_checksums=self.digests[first:],
            read_deadline_unix_ms=1,
            read_hold_ms=30_000,
        )

    def Release(self, request, context):
        self.releases.append(request)
        return kv_pb.ReleaseResponse()


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_a_byte_flipped_after_the_handle_was_issued_is_data_loss_or_recomputed(
    stack, decode_ep, offline, policy, token
):
    """Over NIXL: the decode worker's checksum catches the flipped byte before the blocks join
    its batch; DATA_LOSS naming the block, or the offline tokens after a recompute; its blocks
    are freed and the producer released (abort) once."""
    info = worker(decode_ep, token).GetEngineInfo(wpb.GetEngineInfoRequest(), timeout=5)
    producer = FlippedNixlProducer(info, f"flipped-producer-{policy}")
    server = grpc.server(futures.ThreadPoolExecutor(2))
    kv_grpc.add_KvTransferServicer_to_server(producer, server)
    wgrpc.add_WorkerServicer_to_server(producer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        prompt = [9 + (i * 41) % 3000 for i in range(20)]
        ref = offline.generate(
            prompt_token_ids=[prompt], sampling_params=SamplingParams(temperature=0, max_tokens=6)
        )[0]
        base = load(decode_ep, token).num_free_blocks
        stream = _decode_from(
            decode_ep,
            token,
            info,
            f"127.0.0.1:{port}",
            producer.engine_id,
            f"flipped-{policy}",
            prompt,
            ref,
            policy,
        )
        if policy == "fail":
            with pytest.raises(grpc.RpcError) as err:
                list(stream)
            assert err.value.code() == grpc.StatusCode.DATA_LOSS
            assert f"KV block 1 read from {producer.engine_id} fails its checksum" in err.value.details()
        else:
            tokens = [t for m in stream for t in m.token_ids]
            assert ref.token_ids[:1] + tokens == ref.token_ids
            log = stack.workers("decode")[0].log_path.read_text()
            assert (
                f"KV block 1 read from {producer.engine_id} fails its checksum" in log
            )  # recomputed for that
        assert wait_until(lambda: load(decode_ep, token).num_free_blocks == base, 1.0)
        assert wait_until(lambda: len(producer.releases) == 1, 2.0)
        assert producer.releases[0].reason == kv_pb.RELEASE_REASON_ABORT
        time.sleep(0.2)
        assert len(producer.releases) == 1
    finally:
        server.stop(0)
        producer.agent.close()


def test_decode_rejects_an_incompatible_handle(decode_ep, token):
    prompt = list(range(100, 120))
    handle = kv_pb.KvHandle(
        transfer_id="x",
        producer=kv_pb.KvProducer(endpoint="127.0.0.1:1"),
        block_hashes=hash_blocks(prompt, 16),
        num_tokens=20,
        num_blocks=2,
        block_size=16,
        compat_hash="not-the-same",
    )
    request = wpb.DecodeRequest(
        request_id="incompatible",
        prompt_token_ids=prompt,
        sampling=pb.SamplingParams(max_tokens=4),
        output_token_ids=[5],
        kv_handle=handle,
        kv_handle_mac=handle_mac(token, handle),
    )
    with pytest.raises(grpc.RpcError) as err:
        list(worker(decode_ep, token).Decode(request, timeout=10))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION


def test_bad_requests_are_invalid_argument_and_the_stack_keeps_serving(stack):
    stub = inference(stack)
    cases = {
        "temperature": pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(temperature=-1)),
        "prompt_token_ids[1]": pb.GenerateRequest(
            token_ids=pb.TokenIds(ids=[1, 999999]), sampling=pb.SamplingParams()
        ),
        "max_model_len": pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(max_tokens=10**6)),
        "prompt": pb.GenerateRequest(sampling=pb.SamplingParams()),
        "top_k": pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(top_k=0)),
    }
    for field, request in cases.items():
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(request, timeout=10))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in err.value.details(), (
            err.value.details()
        )
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(pb.GenerateRequest(text="hi", model="other-model"), timeout=10))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    tokens, _ = generate(stub, text="still here", sampling=pb.SamplingParams(temperature=0, max_tokens=3))
    assert len(tokens) == 3


def test_tokenize_models_and_server_info(stack, offline):
    stub = inference(stack)
    resp = stub.Tokenize(pb.TokenizeRequest(text=PROMPTS[0]), timeout=5)
    assert list(resp.token_ids) == offline.tokenizer.encode(PROMPTS[0]) and resp.max_model_len > 0
    models = stub.ListModels(pb.ListModelsRequest(), timeout=5).models
    assert [m.id for m in models] == ["pdserve-tiny"]
    info = stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=5)
    assert sorted(w.role for w in info.workers) == ["decode", "prefill"] and all(
        w.healthy for w in info.workers
    )
    health = health_pb2_grpc.HealthStub(grpc.insecure_channel(stack.grpc_endpoint))
    for service in ("liveness", "readiness"):
        assert (
            health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status
            == health_pb2.HealthCheckResponse.SERVING
        )


def test_worker_readiness_is_not_serving_until_the_model_is_loaded(tiny_model):
    """The health service answers as soon as the port is bound; readiness turns SERVING only once
    the engine has loaded (a 2 GiB KV cache written in full at start-up makes that take a while),
    and work sent before then is UNAVAILABLE."""
    port = free_port()
    endpoint = f"127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "services.cli", "worker", "--role", "decode", "--model", tiny_model]
    cmd += ["--port", str(port), "--num-threads", "1", "--num-kv-blocks", "131072", "--dtype", "float32"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def readiness():
        with grpc.insecure_channel(endpoint) as ch:  # a fresh channel: no reconnect backoff
            request = health_pb2.HealthCheckRequest(service="readiness")
            return health_pb2_grpc.HealthStub(ch).Check(request, timeout=1).status

    statuses, early_decode = [], None
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and health_pb2.HealthCheckResponse.SERVING not in statuses:
            try:
                statuses.append(readiness())
            except grpc.RpcError:
                time.sleep(0.01)
                continue
            if statuses[-1] == health_pb2.HealthCheckResponse.NOT_SERVING and early_decode is None:
                try:
                    list(worker(endpoint).Decode(wpb.DecodeRequest(prompt_token_ids=[1, 2]), timeout=5))
                except grpc.RpcError as e:
                    early_decode = e.code()
        assert statuses[0] == health_pb2.HealthCheckResponse.NOT_SERVING
        assert statuses[-1] == health_pb2.HealthCheckResponse.SERVING
        assert early_decode == grpc.StatusCode.UNAVAILABLE
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0


def test_reflection_lists_the_services(stack, prefill_ep):
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    def services(endpoint):
        stub = reflection_pb2_grpc.ServerReflectionStub(grpc.insecure_channel(endpoint))
        responses = stub.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5
        )
        return {s.name for r in responses for s in r.list_services_response.service}

    assert {"pdserve.v1.Inference", "grpc.health.v1.Health"} <= services(stack.grpc_endpoint)
    assert {"pdserve.v1.Worker", "pdserve.v1.KvTransfer", "grpc.health.v1.Health"} <= services(prefill_ep)


def test_a_burst_beyond_the_prefill_backlog_runs_partly_colocated(tiny_model, tmp_path, offline):
    """--colocate-prefill-backlog 1: while a prompt waits on the prefill worker, the next runs
    colocated on the decode worker (which has fewer waiting), so a burst is prefilled on both;
    every output is still the offline engine's, and once the burst is over the router's counts
    are back to zero: a lone prompt goes through the prefill worker again."""
    st = start_stack(
        tiny_model, tmp_path, router_args=["--colocate-max-tokens", "0", "--colocate-prefill-backlog", "1"]
    )
    try:
        stub = inference(st)
        sampling = pb.SamplingParams(temperature=0.0, max_tokens=6)
        for burst in range(2):  # the second: nothing was left counted by the first
            # 12 fresh prompts and a lone one (no prefix cached anywhere: none runs colocated for that)
            prompts = [[(7 * i + 1000 * burst + j) % 4000 + 10 for j in range(160)] for i in range(13)]
            refs = offline.generate(
                prompt_token_ids=prompts, sampling_params=SamplingParams(temperature=0.0, max_tokens=6)
            )
            results = _parallel(
                lambda p: generate(stub, token_ids=pb.TokenIds(ids=p), sampling=sampling), prompts[:12]
            )
            tokens, msgs = generate(stub, token_ids=pb.TokenIds(ids=prompts[12]), sampling=sampling)
            results.append((tokens, msgs))
            assert [tokens for tokens, _ in results] == [r.token_ids for r in refs]
            routes = [msgs[-1].disaggregated for _, msgs in results]
            assert any(routes[:12]) and not all(routes[:12]), routes
            assert routes[12]  # alone: through the prefill worker
    finally:
        codes = st.stop()
    assert codes == {name: 0 for name in codes}, f"unclean exits: {codes}"
