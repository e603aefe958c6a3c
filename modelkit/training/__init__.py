"""Training the project's small model on CPU: data (`data`), the MTP head (`mtp`), the run (`train_tiny`).

Only the command-line flags live here, so `pdserve --help` does not import torch or transformers.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of `pdserve train-tiny` and `python -m modelkit.training.train_tiny`."""
    p.add_argument("--out", type=Path, required=True, help="output folder (HF format)")
    p.add_argument(
        "--arch", choices=["v3", "v4"], default="v3", help="DeepSeek-V3 with MTP (default) or DeepSeek-V4"
    )
    p.add_argument(
        "--minutes", type=float, default=12.0, help="training budget, as a fixed step count (default 12)"
    )
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (overrides --minutes)")
    p.add_argument("--seed", type=int, default=0, help="seeds the initial weights and the data order")
    p.add_argument("--threads", type=int, default=2, help="torch threads (the step time depends on it)")
    p.add_argument(
        "--max-minutes",
        type=float,
        default=20.0,
        help="safety net: stop early (and record it) past this wall time, e.g. on a busy machine",
    )
