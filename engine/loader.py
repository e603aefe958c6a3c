"""HF safetensors checkpoint -> model, tensor by tensor.

Reads a single `model.safetensors` or shards listed in `model.safetensors.index.json`. Each
tensor is read from the memory-mapped file and copied (cast) straight into its parameter, so the
checkpoint is never held in memory a second time. HF names are mapped onto the engine's layout:
the "model." prefix is dropped, gate and up projections are fused into one [2I, H] weight, and
per-expert weights are stacked into w13[E, 2I, H] / w2[E, H, I] (checkpoints already fused by
transformers 5, `experts.gate_up_proj` / `experts.down_proj`, are accepted too). Missing,
unexpected and mis-shaped tensors are reported by name.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from engine.config import ModelConfig

logger = logging.getLogger(__name__)

REQUIRED_FILES = ("config.json", "tokenizer.json")
_LOADABLE_DTYPES = {"BF16", "F16", "F32"}


@dataclass(frozen=True)
class Target:
    """Where one checkpoint tensor goes: a parameter, and the region of it (None = whole)."""

    param: str
    region: tuple | None = None


def check_model_folder(path: str | Path) -> Path:
    folder = Path(path)
    if not folder.is_dir():
        raise ValueError(f"model folder {str(path)!r} does not exist")
    missing = [name for name in REQUIRED_FILES if not (folder / name).is_file()]
    if (
        not (folder / "model.safetensors").is_file()
        and not (folder / "model.safetensors.index.json").is_file()
    ):
        missing.append("model.safetensors (or model.safetensors.index.json)")
    if missing:
        raise ValueError(f"model folder {str(path)!r} is missing {', '.join(missing)}")
    return folder


def checkpoint_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        missing = [s for s in shards if not (folder / s).is_file()]
        if missing:
            raise ValueError(f"model folder {str(folder)!r} is missing shard(s) {', '.join(missing)}")
        return [folder / s for s in shards]
    return [folder / "model.safetensors"]


def expected_tensors(cfg: ModelConfig, params: dict[str, torch.Tensor]) -> dict[str, Target]:
    """HF tensor name -> Target, in the per-expert layout of DeepSeek's own checkpoints."""
    expected: dict[str, Target] = {}
    for name, tensor in params.items():
        if name == "lm_head.weight":
            expected[name] = Target(name)
            continue
        hf = f"model.{name}"
        if name.endswith("gate_up_proj.weight"):  # dense MLP or shared experts
            inter = tensor.shape[0] // 2
            base = hf.removesuffix("gate_up_proj.weight")
            expected[base + "gate_proj.weight"] = Target(name, (slice(0, inter),))
            expected[base + "up_proj.weight"] = Target(name, (slice(inter, 2 * inter),))
        elif name.endswith("experts.w13"):
            inter = tensor.shape[1] // 2
            base = hf.removesuffix("w13")
            for e in range(tensor.shape[0]):
                expected[f"{base}{e}.gate_proj.weight"] = Target(name, (e, slice(0, inter)))
                expected[f"{base}{e}.up_proj.weight"] = Target(name, (e, slice(inter, 2 * inter)))
        elif name.endswith("experts.w2"):
            base = hf.removesuffix("w2")
            for e in range(tensor.shape[0]):
                expected[f"{base}{e}.down_proj.weight"] = Target(name, (e,))
        else:
            expected[hf] = Target(name)
    return expected


_FUSED_EXPERTS = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def _fused_expert_target(name: str) -> Target | None:
    m = _FUSED_EXPERTS.match(name)
    if m is None:
        return None
    return Target(f"layers.{m.group(1)}.mlp.experts.{'w13' if m.group(2) == 'gate_up_proj' else 'w2'}")


def iter_checkpoint(folder: Path) -> Iterator[tuple[str, Path, object]]:
    for file in checkpoint_files(folder):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                yield name, file, f


def load_weights(model: torch.nn.Module, cfg: ModelConfig, folder: str | Path) -> None:
    folder = check_model_folder(folder)
    params = {name: p.data for name, p in model.named_parameters()}
    expected = expected_tensors(cfg, params)
    filled: dict[str, int] = {name: 0 for name in params}
    seen: set[str] = set()
    unexpected: list[str] = []
    mtp_skipped = 0
    for name, file, handle in iter_checkpoint(folder):
        target = expected.get(name) or _fused_expert_target(name)
        if target is None or target.param not in params:
            m = _LAYER.match(name)
            if m and int(m.group(1)) >= cfg.num_hidden_layers:
                mtp_skipped += 1  # MTP layers follow the main layers; the MTP drafter loads them
                continue
            unexpected.append(name)
            continue
        if name in seen:
            raise ValueError(f"checkpoint tensor {name!r} appears twice (second time in {file.name})")
        seen.add(name)
        slc = handle.get_slice(name)
        if slc.get_dtype() not in _LOADABLE_DTYPES:
            raise ValueError(
                f"checkpoint tensor {name!r} has dtype {slc.get_dtype()}; supported: {sorted(_LOADABLE_DTYPES)}"
            )
        dest = params[target.param]
        if target.region is not None:
            dest = dest[target.region]
        shape = tuple(slc.get_shape())
        if shape != tuple(dest.shape):
            raise ValueError(
                f"checkpoint tensor {name!r} has shape {list(shape)}, expected {list(dest.shape)} "
                f"(for parameter {target.param})"
            )
        dest.copy_(handle.get_tensor(name))
        filled[target.param] += dest.numel()
    if unexpected:
        raise ValueError(
            f"checkpoint has {len(unexpected)} unexpected tensor(s): {', '.join(sorted(unexpected)[:10])}"
        )
    if cfg.tie_word_embeddings and filled.get("lm_head.weight") == 0:
        params["lm_head.weight"].copy_(params["embed_tokens.weight"])
        filled["lm_head.weight"] = params["lm_head.weight"].numel()
        seen.add("lm_head.weight")
    missing = [
        hf for hf, t in expected.items() if hf not in seen and filled[t.param] < params[t.param].numel()
    ]
    if missing:
        raise ValueError(f"checkpoint is missing {len(missing)} tensor(s): {', '.join(missing[:10])}")
    if mtp_skipped:
        logger.info("skipped %d MTP-layer tensors", mtp_skipped)
