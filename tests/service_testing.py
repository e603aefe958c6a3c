"""Helpers for the end-to-end service tests: stacks of real processes on loopback ports."""

from __future__ import annotations

import collections
import time

import grpc

from pdserve.v1 import inference_pb2 as pb
from pdserve.v1 import inference_pb2_grpc as pb_grpc
from pdserve.v1 import kv_transfer_pb2_grpc as kv_grpc
from pdserve.v1 import worker_pb2 as wpb
from pdserve.v1 import worker_pb2_grpc as wgrpc
from services.launcher import Stack, StackConfig

# Each process gets one thread: several share the CI machine's two cores.
ENGINE_ARGS = ["--dtype", "float32", "--num-kv-blocks", "256", "--block-size", "16"]


def stack_config(model: str, tmp_path, **kw) -> StackConfig:
    kw.setdefault("engine_args", ENGINE_ARGS)
    kw.setdefault("threads_per_worker", 1)
    return StackConfig(model=model, log_dir=str(tmp_path / "logs"), **kw)


def start_stack(model: str, tmp_path, **kw) -> Stack:
    return Stack(stack_config(model, tmp_path, **kw)).start()


def inference(stack: Stack) -> pb_grpc.InferenceStub:
    return pb_grpc.InferenceStub(grpc.insecure_channel(stack.grpc_endpoint))


def _channel(endpoint: str, token: str | None) -> grpc.Channel:
    ch = grpc.insecure_channel(endpoint)
    return grpc.intercept_channel(ch, _TokenInterceptor(token)) if token else ch


def worker(endpoint: str, token: str | None = None) -> wgrpc.WorkerStub:
    """A Worker stub; with a token (a stack's: `stack.token`), every call carries it (as the
    router's do)."""
    return wgrpc.WorkerStub(_channel(endpoint, token))


def kv_transfer(endpoint: str, token: str | None = None) -> kv_grpc.KvTransferStub:
    """A KvTransfer stub; with a token, every call carries it (as a decode worker's do)."""
    return kv_grpc.KvTransferStub(_channel(endpoint, token))


class _TokenInterceptor(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    def __init__(self, token: str):
        self.pair = ("authorization", f"Bearer {token}")

    def _details(self, d):
        return _Details(
            d.method,
            d.timeout,
            [*(d.metadata or ()), self.pair],
            d.credentials,
            d.wait_for_ready,
            d.compression,
        )

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._details(details), request)


class _Details(
    collections.namedtuple(
        "_Details", ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression")
    ),
    grpc.ClientCallDetails,
):
    pass


def load(endpoint: str, token: str | None = None) -> wpb.Load:
    return worker(endpoint, token).GetLoad(wpb.GetLoadRequest(), timeout=5)


def generate(stub: pb_grpc.InferenceStub, **kw) -> tuple[list[int], list[pb.GenerateResponse]]:
    """Run one Generate to the end -> (all token ids, the messages)."""
    msgs = list(stub.Generate(pb.GenerateRequest(**kw), timeout=60))
    return [t for m in msgs for t in m.token_ids], msgs


def wait_until(predicate, timeout: float, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def metric(text: str, name: str, **labels) -> float:
    """Sum of the samples of a Prometheus metric (text format) whose labels include `labels`."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        head, value = line.rsplit(" ", 1)
        if all(f'{k}="{v}"' in head for k, v in labels.items()):
            total += float(value)
    return total
