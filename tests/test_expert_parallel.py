"""DP attention + expert parallelism with real rank processes joined by gloo: the same tokens as
one process, ranks that idle while others work, live EPLB, and a rank dying mid-step."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.client import EngineClient
from engine.parallel.placement import ExpertPlacement

# Uneven lengths, so one rank runs out of work while the other still decodes.
PROMPTS = [
    [5 + (i * 13 + j * 7) % 3000 for j in range(length)] for i, length in enumerate((9, 40, 17, 3, 28, 61))
]
MAX_TOKENS = [20, 3, 12, 30, 6, 9]
ENGINE = dict(dtype="float32", num_kv_blocks=128, num_threads=1)


def _params(logprobs: int | None = 3) -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0.0, max_tokens=n, logprobs=logprobs, ignore_eos=True) for n in MAX_TOKENS
    ]


@pytest.fixture(scope="module")
def reference(tiny_model):
    return LLM(tiny_model, **ENGINE).generate(prompt_token_ids=PROMPTS, sampling_params=_params())


def _assert_same(outs, refs):
    for out, ref in zip(outs, refs, strict=True):
        assert out.token_ids == ref.token_ids
        for got, want in zip(out.logprobs, ref.logprobs, strict=True):
            assert list(got) == list(want)
            assert got == pytest.approx(want, abs=1e-4)


def test_dp2_ep2_matches_one_process(tiny_model, reference):
    llm = LLM(tiny_model, data_parallel_size=2, enable_expert_parallel=True, **ENGINE)
    try:
        assert isinstance(llm.engine, EngineClient)  # the interface EngineCore implements too
        outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=_params())
        _assert_same(outs, reference)
        assert set(llm.engine.requests) == set() and not llm.engine.has_request("0")
        # Streaming works too, with the other rank idle (it runs dummy batches to keep step).
        streamed = list(llm.stream(prompt_token_ids=PROMPTS[1], sampling_params=_params()[1]))
        assert streamed[-1].finished and streamed[-1].token_ids == reference[1].token_ids
    finally:
        llm.engine.shutdown()
    assert all(p.exitcode == 0 for p in llm.engine.procs)


def test_redundant_experts_static_placement_and_live_eplb_keep_the_tokens(tiny_model, reference, tmp_path):
    cfg = json.load(open(f"{tiny_model}/config.json"))
    num_moe = cfg["num_hidden_layers"] - cfg["first_k_dense_replace"]
    experts = cfg["n_routed_experts"]
    # A deliberately lopsided static layout: rank 0 holds experts 0..7 twice over, rank 1 the rest.
    rows = [list(range(experts // 2)) * 2 + list(range(experts // 2, experts)) + [0, 1, 2, 3] * 2] * num_moe
    placement = tmp_path / "placement.json"
    placement.write_text(json.dumps({"phy2log": rows}))
    llm = LLM(
        tiny_model,
        data_parallel_size=2,
        enable_expert_parallel=True,
        num_redundant_experts=len(rows[0]) - experts,
        expert_placement_file=str(placement),
        eplb_interval=4,
        **ENGINE,
    )
    try:
        outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=_params())
        _assert_same(outs, reference)
    finally:
        llm.engine.shutdown()
    stats = llm.engine.final_stats
    assert stats[0]["phy2log"] == stats[1]["phy2log"] != rows  # every rank moved to the same new placement
    assert stats[0]["eplb_rebalances"] >= 1
    before, after = stats[0]["balance_ratio"]
    assert after <= before
    assert all(s["gc_frozen_objects"] > 10_000 for s in stats.values())  # each rank's startup heap


def test_a_rank_killed_mid_generation_fails_the_group_with_a_clear_error(tiny_model):
    llm = LLM(tiny_model, data_parallel_size=2, enable_expert_parallel=True, dist_timeout_s=20, **ENGINE)
    params = SamplingParams(temperature=0.0, max_tokens=2000, ignore_eos=True)
    stream = llm.stream(prompt_token_ids=PROMPTS[1], sampling_params=params)
    next(stream)
    victim = llm.engine.procs[1 - llm.engine.requests[next(iter(llm.engine.requests))]]  # the idle rank
    os.kill(victim.pid, signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="data-parallel rank"):
        for _ in stream:
            pass
    assert time.monotonic() - t0 < 25
    assert not any(p.is_alive() for p in llm.engine.procs)


def test_a_script_without_a_main_guard_is_told_to_add_one(tiny_model, tmp_path):
    """spawn re-imports the script in every rank; unguarded, the script builds the engine again
    there. The parent's error says so and how to fix it (it was an AttributeError from the
    failure path); a guarded script runs."""
    import subprocess
    import sys

    body = f"from engine import LLM\nllm = LLM({tiny_model!r}, data_parallel_size=2, num_threads=1)\n"
    unguarded = tmp_path / "unguarded.py"
    unguarded.write_text(body + "print('built')\n")
    guarded = tmp_path / "guarded.py"
    indented = "".join(f"    {line}\n" for line in body.splitlines())
    guarded.write_text(
        f'if __name__ == "__main__":\n{indented}    print("built")\n    llm.engine.shutdown()\n'
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}

    # Both scripts at once: each imports torch in one process, then again in each of its two
    # ranks; one script alone leaves a core idle while its first process imports.
    def start(script: Path) -> subprocess.Popen:
        with open(script.with_suffix(".out"), "w") as out, open(script.with_suffix(".err"), "w") as err:
            return subprocess.Popen([sys.executable, str(script)], stdout=out, stderr=err, text=True, env=env)

    procs = [start(unguarded), start(guarded)]
    try:
        codes = [proc.wait(timeout=240) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    stdout, stderr = (
        {p: p.with_suffix(ext).read_text() for p in (unguarded, guarded)} for ext in (".out", ".err")
    )

    assert codes[0] == 1 and "built" not in stdout[unguarded]
    last = stderr[unguarded].strip().splitlines()[-1]
    assert last.startswith("RuntimeError: data-parallel rank ")
    assert "re-imports the main module" in last and str(unguarded) in last
    assert 'if __name__ == "__main__":' in last
    assert "AttributeError" not in stderr[unguarded]

    assert codes[1] == 0 and stdout[guarded].strip() == "built", stderr[guarded]


def test_placement_round_robin_and_file_validation(tmp_path):
    p = ExpertPlacement.round_robin(num_layers=2, num_logical=6, num_redundant=2, num_ranks=2)
    assert p.phy2log.tolist() == [[0, 1, 2, 3, 4, 5, 0, 1]] * 2
    assert p.local_experts(0, 1) == [4, 5, 0, 1] and p.logcnt[0].tolist() == [2, 2, 1, 1, 1, 1]
    assert p.physical(0, torch.tensor([0, 0, 3, 0])).tolist() == [0, 6, 3, 6]  # replicas in turn
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"phy2log": [[0, 1, 2, 2]]}))
    with pytest.raises(ValueError, match="without a replica"):
        ExpertPlacement.from_file(bad, num_layers=1, num_logical=4, num_ranks=2)
    with pytest.raises(ValueError, match="rows"):
        ExpertPlacement.from_file(bad, num_layers=2, num_logical=4, num_ranks=2)


# ---- the services: `pdserve worker --dp 2 --ep 2` ------------------------------------------------


def _start_group(tiny_model, port: int, log_path, *extra: str):
    """`pdserve worker --dp 2 --ep 2` on ports port, port + 1, its output in log_path (shown when a
    rank exits before it is ready)."""
    import subprocess
    import sys

    from services.launcher import wait_ready

    cmd = [sys.executable, "-m", "services.cli", "worker", "--role", "colocated", "--model", tiny_model]
    cmd += ["--port", str(port), "--dp", "2", "--ep", "2", "--num-threads", "1", "--dtype", "float32"]
    cmd += ["--num-kv-blocks", "128", "--dist-timeout-s", "60", *extra]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        for i in range(2):
            wait_ready(f"127.0.0.1:{port + i}", 90, proc)
    except RuntimeError as e:
        proc.kill()
        raise RuntimeError(f"{e}; the group's output ends:\n{log_path.read_text()[-4000:]}") from None
    return proc


def test_worker_group_serves_each_rank_as_its_own_endpoint(tiny_model, reference, tmp_path):
    import urllib.request

    import grpc

    from pdserve.v1 import inference_pb2 as pb
    from pdserve.v1 import worker_pb2 as wpb
    from services.launcher import free_port
    from tests.service_testing import metric, worker

    port = free_port(count=2)
    metrics_port = free_port(taken={port, port + 1}, count=2)
    proc = _start_group(
        tiny_model, port, tmp_path / "group.log", "--metrics-port", str(metrics_port), "--eplb-interval", "3"
    )
    try:
        for rank in range(2):
            info = worker(f"127.0.0.1:{port + rank}").GetEngineInfo(wpb.GetEngineInfoRequest(), timeout=5)
            assert (info.dp_rank, info.dp_size, info.ep_size) == (rank, 2, 2)

        # Requests on both ranks at once, and on one rank while the other idles.
        def run(i):
            rank = i % 2
            sampling = pb.SamplingParams(temperature=0, max_tokens=MAX_TOKENS[i], logprobs=3, ignore_eos=True)
            request = wpb.DecodeRequest(request_id=f"ep-{i}", prompt_token_ids=PROMPTS[i], sampling=sampling)
            return [
                t for m in worker(f"127.0.0.1:{port + rank}").Decode(request, timeout=60) for t in m.token_ids
            ]

        from concurrent import futures

        with futures.ThreadPoolExecutor(4) as pool:
            tokens = list(pool.map(run, range(len(PROMPTS))))
        assert tokens == [r.token_ids for r in reference]
        text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics").read().decode()
        before, after = (metric(text, f"pdserve_eplb_balance_ratio_{w}") for w in ("before", "after"))
        assert before >= 1.0 and after <= before  # EPLB ran on the observed load, and did not make it worse
    finally:
        proc.terminate()
        assert proc.wait(timeout=60) == 0
    del grpc


def test_a_killed_rank_takes_the_worker_group_down_instead_of_hanging_it(tiny_model, tmp_path):
    import subprocess

    import psutil

    from services.launcher import free_port

    proc = _start_group(tiny_model, free_port(count=2), tmp_path / "group.log")
    try:
        ranks = psutil.Process(proc.pid).children()
        assert len(ranks) == 2
        ranks[1].kill()
        assert proc.wait(timeout=45) != 0  # rank 0's next collective fails; the parent reports it
        assert not ranks[0].is_running() or ranks[0].status() == psutil.STATUS_ZOMBIE
    finally:
        if proc.poll() is None:
            proc.kill()
    del subprocess


def test_ranks_started_separately_join_by_rank_offset(tiny_model, reference, tmp_path):
    """How a multi-node group starts: one command per machine with its --dp-rank-offset and the
    shared master address; here two one-rank "machines" on loopback."""
    import subprocess
    import sys

    from pdserve.v1 import inference_pb2 as pb
    from pdserve.v1 import worker_pb2 as wpb
    from services.launcher import free_port, wait_ready
    from tests.service_testing import worker

    master, ports = free_port(), [free_port(), free_port()]
    procs = []
    for offset, port in enumerate(ports):
        cmd = [sys.executable, "-m", "services.cli", "worker", "--role", "colocated", "--model", tiny_model]
        cmd += [
            "--port",
            str(port),
            "--ep",
            "2",
            "--dp-rank-offset",
            str(offset),
            "--dist-master-port",
            str(master),
        ]
        cmd += ["--num-threads", "1", "--dtype", "float32", "--num-kv-blocks", "128"]
        log = tmp_path / f"rank{offset}.log"
        with log.open("w") as f:  # the child keeps its own descriptor
            procs.append(subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT))
    try:
        for port, proc in zip(ports, procs, strict=True):
            wait_ready(f"127.0.0.1:{port}", 90, proc)
        sampling = pb.SamplingParams(temperature=0, max_tokens=MAX_TOKENS[2], logprobs=3, ignore_eos=True)
        request = wpb.DecodeRequest(request_id="offset", prompt_token_ids=PROMPTS[2], sampling=sampling)
        tokens = [t for m in worker(f"127.0.0.1:{ports[1]}").Decode(request, timeout=60) for t in m.token_ids]
        assert tokens == reference[2].token_ids
        assert (
            worker(f"127.0.0.1:{ports[1]}").GetEngineInfo(wpb.GetEngineInfoRequest(), timeout=5).dp_rank == 1
        )
    finally:
        for proc in procs:
            proc.terminate()
        codes = [proc.wait(timeout=90) for proc in procs]
        logs = "\n".join(
            f"--- rank {r} ---\n{(tmp_path / f'rank{r}.log').read_text()[-4000:]}" for r in range(2)
        )
        assert codes == [0, 0], logs
