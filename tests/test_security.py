"""Security of the serving path: nothing from the network is unpickled, internal RPCs can require
a shared token or mutual TLS, and health stays open for orchestrators."""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine import LLM, SamplingParams
from pdserve.v1 import inference_pb2 as pb
from pdserve.v1 import worker_pb2 as wpb
from pdserve.v1 import worker_pb2_grpc as wgrpc
from services.common.security import handle_mac
from services.launcher import Stack, StackConfig, free_port, wait_ready

ROOT = Path(__file__).resolve().parent.parent
UNSAFE = re.compile(
    r"\bimport (pickle|cPickle|dill|marshal|shelve)\b|\bfrom (pickle|dill|marshal) import"
    r"|\b(pickle|cPickle|dill|marshal)\.loads?\(|torch\.load\(|numpy\.load\(|np\.load\(|yaml\.(unsafe_)?load\("
    r"|(?<![.\w])eval\(|(?<![.\w])exec\("
)


def test_no_unpickling_or_eval_in_the_product():
    """Bytes from gRPC, HTTP or Redis are parsed by protobuf, json or raw frombuffer only."""
    hits = []
    for folder in ("engine", "services", "kernels", "pdserve"):
        for path in (ROOT / folder).rglob("*.py"):
            for n, line in enumerate(path.read_text().splitlines(), 1):
                code = line.split("#", 1)[0]
                if UNSAFE.search(code) and "weights_only=True" not in code:
                    hits.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not hits, "\n".join(hits)


def _worker(tiny_model, role: str, port: int, env: dict, *extra: str) -> subprocess.Popen:
    engine = ["--num-threads", "1", "--dtype", "float32", "--num-kv-blocks", "128", *extra]
    return Stack(StackConfig(tiny_model, engine_args=engine, env=env)).start_worker(role, 0, port).popen


def _get_load(ch: grpc.Channel, metadata=None):
    return wgrpc.WorkerStub(ch).GetLoad(wpb.GetLoadRequest(), timeout=5, metadata=metadata)


def test_internal_token_is_required_and_checked(tiny_model):
    port = free_port()
    proc = _worker(tiny_model, "colocated", port, {"PDSERVE_INTERNAL_TOKEN": "s3cret"})
    try:
        wait_ready(f"127.0.0.1:{port}", 60, proc)  # health is open without the token
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            with pytest.raises(grpc.RpcError) as err:
                _get_load(ch)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.RpcError) as err:
                _get_load(ch, [("authorization", "Bearer wrong")])
            assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
            with pytest.raises(grpc.RpcError) as err:  # admin action, streaming RPC too
                wgrpc.WorkerStub(ch).Drain(wpb.DrainRequest(), timeout=5)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.RpcError) as err:
                list(wgrpc.WorkerStub(ch).Decode(wpb.DecodeRequest(prompt_token_ids=[1, 2]), timeout=5))
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert _get_load(ch, [("authorization", "Bearer s3cret")]).num_total_blocks == 128
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> Path:
    """A CA, a certificate for the services (SAN 127.0.0.1) and one that another CA signed."""
    d = tmp_path_factory.mktemp("certs")
    (d / "san.cnf").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for ca in ("ca", "other-ca"):
        _openssl(
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            f"{ca}.key",
            "-out",
            f"{ca}.pem",
            "-days",
            "2",
            "-subj",
            f"/CN=pdserve-test-{ca}",
            cwd=d,
        )
    for name, ca in (("node", "ca"), ("rogue", "other-ca")):
        _openssl(
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            f"{name}.key",
            "-out",
            f"{name}.csr",
            "-subj",
            f"/CN={name}",
            cwd=d,
        )
        _openssl(
            "x509",
            "-req",
            "-in",
            f"{name}.csr",
            "-CA",
            f"{ca}.pem",
            "-CAkey",
            f"{ca}.key",
            "-CAcreateserial",
            "-out",
            f"{name}.pem",
            "-days",
            "2",
            "-extfile",
            "san.cnf",
            cwd=d,
        )
    return d


def _tls_channel(certs: Path, endpoint: str, name: str | None) -> grpc.Channel:
    creds = grpc.ssl_channel_credentials(
        root_certificates=(certs / "ca.pem").read_bytes(),
        private_key=(certs / f"{name}.key").read_bytes() if name else None,
        certificate_chain=(certs / f"{name}.pem").read_bytes() if name else None,
    )
    return grpc.secure_channel(endpoint, creds)


def test_mutual_tls_between_workers_and_against_strangers(tiny_model, certs):
    """A prefill and a decode worker with mutual TLS: the KV pull between them works, a client
    without a certificate or with one from another CA is refused."""
    tls = [
        "--tls-cert",
        str(certs / "node.pem"),
        "--tls-key",
        str(certs / "node.key"),
        "--tls-ca",
        str(certs / "ca.pem"),
    ]
    p_port, d_port = free_port(), free_port()
    env = {"PDSERVE_INTERNAL_TOKEN": "tls-s3cret"}  # launched workers always have a token too
    token = [("authorization", "Bearer tls-s3cret")]
    procs = [
        _worker(tiny_model, "prefill", p_port, env, *tls),
        _worker(tiny_model, "decode", d_port, env, *tls),
    ]
    try:
        prompt = [5 + (i * 7) % 3000 for i in range(40)]
        sampling = pb.SamplingParams(temperature=0, max_tokens=6)
        for port, proc in zip((p_port, d_port), procs, strict=True):
            ch = _tls_channel(certs, f"127.0.0.1:{port}", "node")
            for _ in range(600):
                try:
                    status = health_pb2_grpc.HealthStub(ch).Check(
                        health_pb2.HealthCheckRequest(service="readiness"), timeout=1
                    )
                    if status.status == health_pb2.HealthCheckResponse.SERVING:
                        break
                except grpc.RpcError:
                    pass
                assert proc.poll() is None

                time.sleep(0.1)
        prefill = wgrpc.WorkerStub(_tls_channel(certs, f"127.0.0.1:{p_port}", "node"))
        decode = wgrpc.WorkerStub(_tls_channel(certs, f"127.0.0.1:{d_port}", "node"))
        first = prefill.Prefill(
            wpb.PrefillRequest(request_id="tls", prompt_token_ids=prompt, sampling=sampling),
            timeout=30,
            metadata=token,
        )
        request = wpb.DecodeRequest(
            request_id="tls",
            prompt_token_ids=prompt,
            sampling=sampling,
            output_token_ids=first.output.token_ids,
            kv_handle=first.kv_handle,
            kv_handle_mac=handle_mac("tls-s3cret", first.kv_handle),
        )
        msgs = list(decode.Decode(request, timeout=30, metadata=token))
        tokens = list(first.output.token_ids) + [t for m in msgs for t in m.token_ids]
        ref = LLM(tiny_model, dtype="float32", num_kv_blocks=64).generate(
            prompt_token_ids=[prompt], sampling_params=SamplingParams(temperature=0, max_tokens=6)
        )[0]
        assert tokens == ref.token_ids and msgs[-1].usage.kv_transfer_bytes > 0
        for name in (None, "rogue"):
            with pytest.raises(grpc.RpcError) as err:
                _get_load(_tls_channel(certs, f"127.0.0.1:{d_port}", name), token)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE  # the handshake fails
        with grpc.insecure_channel(f"127.0.0.1:{d_port}") as plain, pytest.raises(grpc.RpcError):
            _get_load(plain, token)
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            assert proc.wait(timeout=30) == 0


# ---- secure by default: exposure check, launcher token --------------------------------------------


@pytest.mark.parametrize("host", ["127.0.0.1", "127.3.2.1", "::1", "[::1]", "localhost", "LOCALHOST"])
def test_loopback_hosts_need_neither_token_nor_tls(host):
    from services.common.security import Security, check_exposure

    check_exposure(host, Security(), insecure=False)


@pytest.mark.parametrize("host", ["10.0.0.5", "0.0.0.0", "::", "pod.example", "128.0.0.1"])
def test_exposed_host_without_token_or_tls_is_refused_unless_insecure(host):
    from services.common.security import Security, check_exposure

    with pytest.raises(ValueError) as err:
        check_exposure(host, Security(), insecure=False)
    message = str(err.value)
    assert f"binding {host} without" in message
    for flag in ("PDSERVE_INTERNAL_TOKEN", "--tls-cert/--tls-key/--tls-ca", "--insecure-internal"):
        assert flag in message
    check_exposure(host, Security(token="s3cret"), insecure=False)
    check_exposure(host, Security(tls_cert="c.pem", tls_key="k.pem", tls_ca="ca.pem"), insecure=False)
    check_exposure(host, Security(), insecure=True)


@pytest.mark.parametrize(
    "argv",
    [
        ["worker", "--role", "decode", "--model", "m", "--host", "10.0.0.5"],
        ["router", "--model", "m", "--host", "10.0.0.5", "--workers", "10.0.0.6:50061"],
    ],
    ids=["worker", "router"],
)
def test_cli_refuses_an_exposed_worker_or_router_with_exit_code_2(argv, monkeypatch, capsys):
    from services.cli import main

    monkeypatch.delenv("PDSERVE_INTERNAL_TOKEN", raising=False)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "binding 10.0.0.5 without an internal token (PDSERVE_INTERNAL_TOKEN)" in err
    assert "--insecure-internal" in err


def test_a_stack_always_has_a_token_and_passes_it_on(monkeypatch):
    monkeypatch.delenv("PDSERVE_INTERNAL_TOKEN", raising=False)
    first, second = (Stack(StackConfig("m")) for _ in range(2))
    assert first.token and len(first.token) >= 32 and first.token != second.token  # generated
    assert Stack(StackConfig("m", env={"PDSERVE_INTERNAL_TOKEN": "from-cfg"})).token == "from-cfg"
    monkeypatch.setenv("PDSERVE_INTERNAL_TOKEN", "from-env")
    assert Stack(StackConfig("m")).token == "from-env"
    assert Stack(StackConfig("m", env={"PDSERVE_INTERNAL_TOKEN": "from-cfg"})).token == "from-cfg"
