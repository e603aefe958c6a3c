"""One client against another, on two revisions in one run: what a heavy client does to a light one.

For each side (a git worktree of --baseline, then this tree or --candidate) a stack (router with
two API keys, a prefill and a decode worker; the tiny model in float32, 2048 KV blocks of 16) runs
three attacks from the attacker's key while the victim's key measures:

- grammar: 12 completions at once, each constrained by its own 55 K-character JSON schema (1,500
  `format: uri` strings); the victim's small completion's latency and its running stream's largest
  gap between chunks;
- echo: one completion echoing 48 x 800-token prompts with 20 logprobs each (23.8 MB of JSON when
  served), then one of 16 such prompts; /health's largest latency and the victim stream's largest
  gap meanwhile;
- pins: 4 attacker threads each echoing 60 x 400-token prompts (6,000 KV blocks to pin in all,
  four times what the prefill worker pins), again and again, while 46 victim completions of
  100-token prompts run one after another: how each side's requests end (200 / 429 / ...) and the
  victim's latency.

    python benchmarks/fairness.py --baseline e3d3b12

Writes benchmarks/results/fairness_<hardware>_<date>.json.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import openai  # noqa: E402

from benchmarks.ab_revisions import checkouts  # noqa: E402
from benchmarks.common import git_revision, hardware, save  # noqa: E402
from services.launcher import Stack, StackConfig  # noqa: E402

ATTACKER, VICTIM = "sk-bench-attacker", "sk-bench-victim"
ENGINE = ["--dtype", "float32", "--num-kv-blocks", "2048", "--block-size", "16"]


def _client(stack: Stack, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.http_url + "/v1", api_key=key, max_retries=0, timeout=600)


def _outcome(fn) -> str:
    try:
        fn()
        return "200"
    except openai.APIStatusError as e:
        return str(e.status_code)
    except openai.APIError as e:  # an error event in a stream, a dropped connection
        return type(e).__name__


class _Stream(threading.Thread):
    """The victim's stream while an attack runs: its largest gap between chunks."""

    def __init__(self, client: openai.OpenAI, model: str):
        super().__init__(daemon=True)
        self.client, self.model, self.gaps = client, model, [0.0]

    def run(self):
        last = None
        stream = self.client.completions.create(
            model=self.model, prompt="def f(x):", max_tokens=600, stream=True, extra_body={"ignore_eos": True}
        )
        for _ in stream:
            now = time.monotonic()
            if last is not None:
                self.gaps.append(now - last)
            last = now


class _Health(threading.Thread):
    def __init__(self, url: str):
        super().__init__(daemon=True)
        self.url, self.stop, self.latencies = url + "/health", threading.Event(), [0.0]

    def run(self):
        while not self.stop.is_set():
            start = time.monotonic()
            urllib.request.urlopen(self.url, timeout=60).read()
            self.latencies.append(time.monotonic() - start)
            time.sleep(0.01)


def _all_at_once(jobs) -> list[str]:
    outcomes = [None] * len(jobs)
    threads = [
        threading.Thread(target=lambda i=i: outcomes.__setitem__(i, _outcome(jobs[i])))
        for i in range(len(jobs))
    ]
    for t in threads:
        t.start()
    return threads, outcomes


def grammar_attack(stack: Stack, model: str) -> dict:
    attacker, victim = _client(stack, ATTACKER), _client(stack, VICTIM)
    schema = lambda i: {  # noqa: E731
        "type": "array",
        "prefixItems": [{"type": "string", "format": "uri"}] * 1500,
        "items": False,
        "minItems": i,
    }
    stream = _Stream(victim, model)
    stream.start()
    time.sleep(0.5)
    jobs = [
        lambda i=i: attacker.completions.create(
            model=model, prompt="x", max_tokens=2, extra_body={"guided_json": schema(i)}
        )
        for i in range(12)
    ]
    threads, outcomes = _all_at_once(jobs)
    time.sleep(0.3)
    start = time.monotonic()
    victim.completions.create(model=model, prompt="def g(y):", max_tokens=4)
    victim_s = time.monotonic() - start
    for t in threads:
        t.join()
    stream.join()
    return {
        "victim_completion_s": victim_s,
        "victim_stream_max_gap_s": max(stream.gaps),
        "attacker": dict(collections.Counter(outcomes)),
    }


def echo_attack(stack: Stack, model: str) -> dict:
    attacker, victim = _client(stack, ATTACKER), _client(stack, VICTIM)
    prompts = [[5 + (i * 7 + j) % 3000 for j in range(800)] for i in range(48)]
    out = {}
    for name, batch in (("48x800", prompts), ("16x800", prompts[:16])):
        stream, health = _Stream(victim, model), _Health(stack.http_url)
        stream.start()
        health.start()
        time.sleep(0.5)
        start = time.monotonic()
        size = {}

        def call(batch=batch, size=size):
            raw = attacker.completions.with_raw_response.create(
                model=model, prompt=batch, max_tokens=0, echo=True, logprobs=20
            )
            size["bytes"] = len(raw.content)

        outcome = _outcome(call)
        took = time.monotonic() - start
        health.stop.set()
        stream.join()
        health.join()
        out[name] = {
            "attacker": outcome,
            "response_bytes": size.get("bytes", 0),
            "attacker_s": took,
            "health_max_s": max(health.latencies),
            "victim_stream_max_gap_s": max(stream.gaps),
        }
    return out


def pin_attack(stack: Stack, model: str) -> dict:
    attacker, victim = _client(stack, ATTACKER), _client(stack, VICTIM)
    batches = [[[5 + (b * 997 + i * 31 + j) % 3000 for j in range(400)] for i in range(60)] for b in range(4)]
    stop, outcomes = threading.Event(), []

    def attack(b: int) -> None:  # the same batch again and again, until the victim is done
        while not stop.is_set():
            outcomes.append(
                _outcome(
                    lambda: attacker.completions.create(
                        model=model, prompt=batches[b], max_tokens=0, echo=True
                    )
                )
            )

    threads = [threading.Thread(target=attack, args=(b,)) for b in range(4)]
    for t in threads:
        t.start()
    time.sleep(1.0)
    victims, seconds = [], []
    for i in range(46):
        start = time.monotonic()
        victims.append(
            _outcome(
                lambda i=i: victim.completions.create(
                    model=model, prompt=[7 + (i * 13 + j) % 3000 for j in range(100)], max_tokens=4
                )
            )
        )
        seconds.append(time.monotonic() - start)
    stop.set()
    for t in threads:
        t.join()
    return {
        "attacker": dict(collections.Counter(outcomes)),
        "victim": dict(collections.Counter(victims)),
        "victim_p50_s": statistics.median(seconds),
        "victim_max_s": max(seconds),
    }


def run_side(tree: Path, model: str, logs: Path) -> dict:
    cfg = StackConfig(
        model=model,
        engine_args=ENGINE,
        threads_per_worker=1,
        log_dir=str(logs),
        cwd=str(tree),
        api_key=VICTIM,
        router_args=["--api-key", ATTACKER],
    )
    name = Path(model).name
    with Stack(cfg) as stack:
        return {
            "revision": git_revision(tree),
            "grammar": grammar_attack(stack, name),
            "echo": echo_attack(stack, name),
            "pins": pin_attack(stack, name),
        }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline", required=True, help="git revision to compare with")
    p.add_argument("--candidate", default=None, help="git revision (default: this working tree)")
    p.add_argument(
        "--model", default=None, help="model folder (default: pdserve make-model tiny, built here)"
    )
    p.add_argument("--tag", default="", help="added to the results file's name")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="pdserve-fair-") as tmp:
        model = args.model
        if model is None:
            from modelkit.make_model import make_model

            model = str(make_model("tiny", Path(tmp) / "pdserve-tiny"))
        results = {}
        with checkouts(args.baseline, args.candidate, prefix="pdserve-fair-") as (base, cand):
            for side, tree in (("baseline", base), ("candidate", cand)):
                results[side] = run_side(tree, model, Path(tmp) / f"logs-{side}")
                print(f"{side}: {json.dumps(results[side], indent=1)}", flush=True)
    payload = {"hardware": hardware(), "date": time.strftime("%Y-%m-%d"), **results}
    path = save(f"fairness{'_' + args.tag if args.tag else ''}", payload)
    print(f"saved {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
