"""What `make run` shows: one completion streamed through the disaggregated stack, by the
`openai` client over HTTP and by a gRPC client, with time to first token, decode speed and the
KV bytes the decode worker pulled from the prefill worker."""

from __future__ import annotations

import sys
import time

import grpc

from pdserve.v1 import inference_pb2 as pb
from pdserve.v1 import inference_pb2_grpc as pb_grpc

PROMPT = "The json module provides functions to read and write data. The function"


def _report(
    label: str, n: int, start: float, first: float | None, end: float, kv_bytes: int, extra: str = ""
) -> None:
    ttft = (first or end) - start
    rate = (n - 1) / max(end - (first or end), 1e-9) if n > 1 else 0.0
    print(
        f"\n[{label}: {n} tokens, TTFT {ttft * 1000:.0f} ms, {rate:.1f} tok/s after the first, "
        f"{kv_bytes:,} KV bytes moved prefill -> decode{extra}]\n",
        flush=True,
    )


def openai_stream(base_url: str, model: str, max_tokens: int, api_key: str | None = None) -> None:
    import openai

    client = openai.OpenAI(base_url=base_url + "/v1", api_key=api_key or "unused")
    print(f"--- openai client, /v1/completions, stream=True ---\n{PROMPT}", end="", flush=True)
    start, first, n, kv_bytes = time.perf_counter(), None, 0, 0
    stream = client.completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=max_tokens,
        temperature=0.8,
        top_p=0.95,
        seed=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"mode": "disaggregated"},
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            first = first or time.perf_counter()
            sys.stdout.write(chunk.choices[0].text)
            sys.stdout.flush()
        if chunk.usage is not None:
            n = chunk.usage.completion_tokens
            kv_bytes = (chunk.usage.model_extra or {}).get("kv_transfer_bytes", 0)
    _report("openai", n, start, first, time.perf_counter(), kv_bytes)


def grpc_stream(endpoint: str, max_tokens: int, api_key: str | None = None) -> None:
    print(f"--- gRPC pdserve.v1.Inference/Generate ---\n{PROMPT}", end="", flush=True)
    stub = pb_grpc.InferenceStub(grpc.insecure_channel(endpoint))
    request = pb.GenerateRequest(
        text=PROMPT,
        sampling=pb.SamplingParams(temperature=0.8, top_p=0.95, seed=0, max_tokens=max_tokens),
        mode=pb.SERVING_MODE_DISAGGREGATED,
    )
    start, first, last = time.perf_counter(), None, None
    key = [("authorization", f"Bearer {api_key}")] if api_key else None
    for msg in stub.Generate(request, timeout=120, metadata=key):
        if msg.token_ids:
            first = first or time.perf_counter()
            sys.stdout.write(msg.text)
            sys.stdout.flush()
        last = msg
    t = last.timings
    extra = f"; prefill {t.prefill_ns / 1e6:.0f} ms, KV pull {t.kv_transfer_ns / 1e6:.1f} ms"
    _report(
        "gRPC",
        last.usage.completion_tokens,
        start,
        first,
        time.perf_counter(),
        last.usage.kv_transfer_bytes,
        extra,
    )
