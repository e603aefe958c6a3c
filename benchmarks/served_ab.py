"""Two or more stacks that differ in how they are started, up together, their served rounds
alternating, reported as ratios to the first (of the arms' medians, and the median of each
round's ratio to the first arm's round beside it): what a launcher setting (the workers' OpenMP
wait policy, their environment, their threads) buys when everything else is the same.

Each arm is NAME=JSON, the JSON holding StackConfig fields (services/launcher.py), e.g.
`spin='{"omp_wait_policy": "inherit"}'` or `env='{"env": {"OMP_WAIT_POLICY": "PASSIVE"}}'`;
`default={}` is the launcher as `pdserve serve` starts it. The workload and the clients are
served_vs_offline.py's: C streams opened at once, fresh prompts every round (the same for every
arm), decode tok/s = C / the streams' median time per token after their first piece, output
tok/s = C * output_len / the round's wall time. Every arm's stack stays up for the whole run (an
idle stack's threads sleep), so the machine's drift over the run falls on every arm alike.

    python benchmarks/served_ab.py --client openai --rounds 8 \\
        --arm spin='{"omp_wait_policy": "inherit"}' --arm default='{}'
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.served_vs_offline import (  # noqa: E402
    Served,
    add_workload_args,
    check_workload_args,
    workload,
)


def parse_arm(text: str) -> tuple[str, dict]:
    name, sep, fields = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"--arm {text!r}: expected NAME=JSON")
    try:
        value = json.loads(fields)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"--arm {name}: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"--arm {name}: the JSON must be an object of StackConfig fields")
    return name, value


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    add_workload_args(p)
    p.add_argument(
        "--arm", type=parse_arm, action="append", required=True, help="NAME=JSON (StackConfig fields)"
    )
    args = p.parse_args(argv)
    check_workload_args(args)
    names = [name for name, _ in args.arm]
    if len(set(names)) != len(names) or len(names) < 2:
        raise SystemExit("--arm: two or more, each named once")
    # Only once the arguments are good: it loads torch, seconds of a bad call's time. Still before
    # the stacks start, so the client's process is the same during the rounds.
    from benchmarks.common import ratios, save

    prompts = workload(args)
    with contextlib.ExitStack() as up:
        arms = [
            up.enter_context(
                Served(
                    args,
                    prompts(0),
                    **fields | ({"log_dir": f"{args.log_dir}/{name}"} if args.log_dir else {}),
                )
            )
            for name, fields in args.arm
        ]
        for r in range(args.rounds):
            for arm in arms:
                arm.round(prompts(2 * r + 1))
            print(
                f"round {r}: "
                + ", ".join(f"{n} {a.rates.decode_tok_s[-1]:.1f}" for n, a in zip(names, arms, strict=True))
            )

    median = statistics.median
    base = arms[0].rates
    results = {}
    for name, arm in zip(names, arms, strict=True):
        rates, cpu = arm.rates, arm.cpu_per_token()
        decode_ratio, paired_decode_ratio = ratios(rates.decode_tok_s, base.decode_tok_s)
        results[name] = {
            "stack": dict(args.arm)[name],
            "decode_tok_s": rates.decode_tok_s,
            "tok_s": rates.tok_s,
            "decode_ratio": decode_ratio,
            "paired_decode_ratio": paired_decode_ratio,  # by round: beside the first arm's round
            "ratio": ratios(rates.tok_s, base.tok_s)[0],
            "cpu_s_per_token": cpu,
            "first_pause_s": arm.pauses,
            "longest_gap_s": arm.longest_gaps,
        }
        pause = arm.median_pause()
        print(
            f"{name:12s} decode {median(rates.decode_tok_s):8.1f} tok/s ({results[name]['decode_ratio']:.3f}x, "
            f"{results[name]['paired_decode_ratio']:.3f}x by round), "
            f"whole {median(rates.tok_s):8.1f} ({results[name]['ratio']:.3f}x); "
            + (f"first pause {1000 * pause:.0f} ms; " if pause is not None else "")
            + f"longest gap {1000 * median(arm.longest_gaps):.0f} ms (rounds' median); "
            + "CPU ms per token: "
            + ", ".join(f"{proc} {1000 * s:.2f}" for proc, s in cpu.items())
        )
    settings = {k: v for k, v in vars(args).items() if k not in ("output", "log_dir", "arm")}
    path = save(
        "served_ab", {"settings": settings, "arms": results}, Path(args.output) if args.output else None
    )
    print(f"saved {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
