"""Shared pieces of the benchmark harnesses: hardware description, timing, result files."""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import subprocess
import time
from pathlib import Path

import torch

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


def git_revision() -> str:
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


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


class Timer:
    def __enter__(self) -> Timer:
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.seconds = time.perf_counter() - self.start
