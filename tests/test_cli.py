"""`pdserve` as a user runs it: real subprocesses of `python -m services.cli`.

Exit codes and streams are asserted: 0 and the completion on stdout for a good run, 2 and an
error naming the culprit on stderr for bad input. Generation reuses the session's default model.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from modelkit.make_model import OUTPUT_FILES

REPO = Path(__file__).resolve().parents[1]
PROMPT = "def f(x):"
MAX_TOKENS = 8
THROUGHPUT = re.compile(
    rf"\[{MAX_TOKENS} tokens in [\d.]+ s: [\d.]+ tok/s overall, TTFT \d+ ms, decode [\d.]+ tok/s; "
    r"finish_reason=length\]"
)


def pdserve(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-m", "services.cli", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture(scope="module")
def llm(tiny_model) -> LLM:
    """In-process reference for what the CLI prints (the CLI is greedy by default)."""
    return LLM(tiny_model, dtype="float32", num_kv_blocks=16, block_size=4)


def _made(stdout: str) -> tuple[str, float]:
    """`make-model` output -> (folder, seconds it took)."""
    match = re.fullmatch(r"tiny: (.+) \(([\d.]+) s\)\n", stdout)
    assert match, stdout
    return match.group(1), float(match.group(2))


def test_train_tiny_without_transformers_says_which_extra_to_install(tmp_path):
    """A plain install (no test/bench/train extras) has no transformers: the command says so."""
    code = (
        "import sys; sys.modules['transformers'] = None; from services.cli import main; "
        f"sys.exit(main(['train-tiny', '--out', {str(tmp_path / 'out')!r}, '--steps', '1']))"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2, proc.stderr
    assert "install the 'train' extra (pip install -e '.[train]'" in proc.stderr
    assert not (tmp_path / "out").exists()


def test_make_model_builds_a_deepseek_v3_folder_then_reuses_it(tiny_model, tmp_path):
    out = tmp_path / "pdserve-tiny"
    first = pdserve("make-model", "tiny", "--out", str(out))
    assert first.returncode == 0, first.stderr
    assert _made(first.stdout)[0] == str(out)
    assert sorted(p.name for p in out.iterdir()) == sorted(OUTPUT_FILES)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "deepseek_v3"
    assert cfg["architectures"] == ["DeepseekV3ForCausalLM"]
    assert (cfg["vocab_size"], cfg["bos_token_id"], cfg["eos_token_id"]) == (4096, 0, 1)
    # The build is deterministic: the same bytes as the session's in-process build.
    for name in OUTPUT_FILES:
        assert (out / name).read_bytes() == (Path(tiny_model) / name).read_bytes(), name

    before = {name: (out / name).stat() for name in OUTPUT_FILES}
    second = pdserve("make-model", "tiny", "--out", str(out))
    assert second.returncode == 0, second.stderr
    folder, seconds = _made(second.stdout)
    assert folder == str(out)
    assert seconds < min(1.0, _made(first.stdout)[1]), "a complete build is reused, not rebuilt"
    for name, stat in before.items():
        after = (out / name).stat()
        assert (after.st_ino, after.st_mtime_ns) == (stat.st_ino, stat.st_mtime_ns), f"{name} was rewritten"


def generate(model: str, prompt: str, *flags: str) -> subprocess.CompletedProcess:
    """`pdserve generate`, greedy (the CLI's default) in float32 like the in-process reference."""
    args = ["generate", "--model", model, "--prompt", prompt, "--max-tokens", str(MAX_TOKENS)]
    return pdserve(*args, "--dtype", "float32", *flags)


def test_generate_prints_the_completion_then_throughput(tiny_model, llm):
    res = generate(tiny_model, PROMPT)
    assert res.returncode == 0, res.stderr
    (expected,) = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    assert expected.text
    completion, sep, summary = res.stdout.rpartition("\n\n")
    assert sep
    assert completion == expected.text
    assert THROUGHPUT.fullmatch(summary.rstrip("\n")), summary


def test_generate_chat_wraps_the_prompt_in_the_template(tiny_model, llm):
    res = generate(tiny_model, "hi", "--chat")
    assert res.returncode == 0, res.stderr
    rendered = llm.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    # The rendered text starts with its own BOS: one BOS in the prompt, not two.
    ids = llm.tokenizer.encode(rendered, add_special_tokens=False)
    assert ids.count(0) == 1
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    (expected,) = llm.generate(prompt_token_ids=[ids], sampling_params=params)
    completion, _, summary = res.stdout.rpartition("\n\n")
    assert completion == expected.text
    assert THROUGHPUT.fullmatch(summary.rstrip("\n")), summary


def _error_line(stderr: str) -> str:
    """The CLI's one error line (logged warnings, e.g. about bfloat16 on this CPU, may precede it)."""
    errors = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, stderr
    return errors[0]


def test_bad_sampling_argument_exits_2_naming_the_field(tiny_model):
    res = pdserve("generate", "--model", tiny_model, "--prompt", PROMPT, "--temperature", "-1")
    assert res.returncode == 2
    assert res.stdout == ""
    assert _error_line(res.stderr) == "error: prompt 0: temperature must be a number >= 0, got -1.0"
    assert "Traceback" not in res.stderr


def test_missing_model_folder_exits_2_naming_the_folder(tmp_path):
    missing = tmp_path / "no-such-model"
    res = pdserve("generate", "--model", str(missing), "--prompt", PROMPT)
    assert res.returncode == 2
    assert res.stdout == ""
    assert _error_line(res.stderr) == f"error: model folder {str(missing)!r} does not exist"
    assert "Traceback" not in res.stderr


def test_router_with_a_stream_interval_below_one_exits_2_naming_it(tiny_model):
    res = pdserve("router", "--model", tiny_model, "--workers", "127.0.0.1:1", "--stream-interval", "0")
    assert res.returncode == 2
    assert _error_line(res.stderr) == "error: stream_interval must be >= 1, got 0"
    assert "Traceback" not in res.stderr


def test_router_with_a_negative_prefill_backlog_exits_2_naming_it(tiny_model):
    res = pdserve(
        "router", "--model", tiny_model, "--workers", "127.0.0.1:1", "--colocate-prefill-backlog", "-1"
    )
    assert res.returncode == 2
    assert _error_line(res.stderr) == "error: colocate_prefill_backlog must be >= 0 tokens, got -1"
    assert "Traceback" not in res.stderr


def test_serve_passes_its_router_flags_on():
    from services.cli import _router_flags, build_parser

    args = build_parser().parse_args(
        ["serve", "--stream-interval", "4", "--colocate-prefill-backlog", "4096"]
    )
    flags = build_parser().parse_args(["router", "--model", "m", *_router_flags(args)])
    assert (flags.stream_interval, flags.colocate_prefill_backlog) == (4, 4096)


def test_batch_invariant_flag_reaches_the_engine_config(tiny_model):
    """--batch-invariant: the worker's engine config has it; `pdserve serve` passes it to its workers."""
    from services.cli import _engine_config, _serve_engine_args, build_parser

    worker = build_parser().parse_args(
        ["worker", "--role", "decode", "--model", tiny_model, "--batch-invariant"]
    )
    assert _engine_config(worker).batch_invariant is True
    plain = build_parser().parse_args(["worker", "--role", "decode", "--model", tiny_model])
    assert _engine_config(plain).batch_invariant is False
    serve = build_parser().parse_args(["serve", "--batch-invariant", "--num-kv-blocks", "64"])
    started = build_parser().parse_args(
        ["worker", "--role", "prefill", "--model", tiny_model, *_serve_engine_args(serve)]
    )
    config = _engine_config(started)
    assert config.batch_invariant is True and config.num_kv_blocks == 64 and config.dtype == "bfloat16"


def test_serve_starts_colocated_or_disaggregated_workers_with_their_kv_space(tiny_model):
    """`pdserve serve --colocated N` starts N colocated workers and nothing else; a disaggregated
    stack needs a prefill and a decode worker; every engine flag given reaches each worker."""
    from engine.config import EngineConfig
    from services.cli import _engine_config, _serve_engine_args, _serve_roles, build_parser

    def roles(*flags):
        return _serve_roles(build_parser().parse_args(["serve", *flags]))

    assert roles() == {"prefill": 1, "decode": 1, "colocated": 0}
    assert roles("--colocated", "2") == {"prefill": 0, "decode": 0, "colocated": 2}
    assert roles("--num-prefill", "2", "--num-decode", "3") == {"prefill": 2, "decode": 3, "colocated": 0}
    for flags in (["--num-prefill", "0"], ["--num-decode", "0"], ["--colocated", "-1"]):
        with pytest.raises(SystemExit, match="--num-prefill|--colocated"):
            roles(*flags)
    assert _serve_engine_args(build_parser().parse_args(["serve"])) == ["--dtype", "bfloat16"]
    flags = ["--kv-cache-memory-gib", "0.5", "--max-num-batched-tokens", "512", "--kv-offload", "host"]
    serve = build_parser().parse_args(["serve", "--colocated", "1", *flags])
    worker = build_parser().parse_args(
        ["worker", "--role", "colocated", "--model", tiny_model, *_serve_engine_args(serve)]
    )
    config = _engine_config(worker)
    assert config.kv_cache_memory_gib == 0.5 and config.num_kv_blocks is None
    assert config.max_num_batched_tokens == 512 and config.kv_offload == "host"
    with pytest.raises(ValueError, match="kv_cache_memory_gib must be > 0, got 0"):
        EngineConfig(model=tiny_model, kv_cache_memory_gib=0)
