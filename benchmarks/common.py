"""Shared pieces of the benchmark harnesses: hardware description, timing, result files."""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import statistics
import subprocess
import time
from collections.abc import AsyncIterator
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).parent / "results"


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def hardware() -> dict:
    info = {
        "cpu": cpu_name(),
        "cores": len(os.sched_getaffinity(0)),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def hardware_slug() -> str:
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name()
    else:
        name = f"{cpu_name()}-{len(os.sched_getaffinity(0))}core"
    return "".join(c if c.isalnum() else "-" for c in name.lower()).strip("-").replace("--", "-")


def git_revision(repo: Path = REPO) -> str:
    """repo's HEAD as a short hash, with "-dirty" when tracked files differ from it (as `git
    describe --dirty`): a result then names code that no commit holds."""
    try:
        head = subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], cwd=repo, text=True).strip()
        dirty = (
            subprocess.run(["git", "diff", "--quiet", "HEAD", "--"], cwd=repo, check=False).returncode != 0
        )
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("-dirty" if dirty else "")


def result_path(name: str, suffix: str = "json") -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    return RESULTS / f"{name}_{hardware_slug()}_{_dt.date.today().isoformat()}.{suffix}"


def save(name: str, payload: dict, path: Path | None = None) -> Path:
    """Write payload with the date, git revision and hardware to results/<name>_<hw>_<date>.json
    (or to path)."""
    path = path or result_path(name)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "date": _dt.datetime.now().isoformat(timespec="seconds"),
        "git": git_revision(),
        "hardware": hardware(),
        **payload,
    }
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path


async def sse_chunks(lines) -> AsyncIterator[dict]:
    """The JSON chunks of an OpenAI-compatible server-sent event stream (aiohttp's `resp.content`)
    up to `data: [DONE]`, each parsed with json.loads as vLLM's serving benchmark reads them;
    RuntimeError on a chunk that reports an error."""
    async for line in lines:
        if not line.startswith(b"data: "):
            continue
        data = line[len(b"data: ") :].strip()
        if data == b"[DONE]":
            return
        chunk = json.loads(data)
        if "error" in chunk:
            raise RuntimeError(f"stream error: {chunk['error']}")
        yield chunk


class Timer:
    def __enter__(self) -> Timer:
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.seconds = time.perf_counter() - self.start


def ratios(values: list[float], baseline: list[float]) -> tuple[float, float]:
    """Runs of a candidate against a baseline's, run for run in alternation -> (the ratio of their
    medians, the median of each run's ratio to the baseline's run beside it: the same machine
    state)."""
    median = statistics.median
    return median(values) / median(baseline), median(v / b for v, b in zip(values, baseline, strict=True))


def plot_decode_curves(series: dict[str, list[tuple[int, float]]], title: str, png: Path) -> Path:
    """Decode tokens/s against batch size (log2 axis), one line per label; a legend when there are
    several. Needs matplotlib (ImportError without it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, points in series.items():
        xs, ys = zip(*points, strict=True)
        ax.plot(xs, ys, marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size (requests decoding together)")
    ax.set_ylabel("decode tokens / s")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    if len(series) > 1:
        ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png
