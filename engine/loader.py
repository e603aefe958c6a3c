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
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from engine.config import ModelConfig
from engine.progress import Progress

logger = logging.getLogger(__name__)

REQUIRED_FILES = ("config.json", "tokenizer.json")
_LOADABLE_DTYPES = {"BF16", "F16", "F32"}


@dataclass(frozen=True)
class Target:
    """Where one checkpoint tensor goes: a parameter, and the region of it (None = whole)."""

    param: str
    region: tuple | None = None
    rows: tuple[int, ...] | None = None
    """Take these rows of the checkpoint tensor (its local experts) instead of all of it."""


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


def expected_tensors(
    cfg: ModelConfig, params: dict[str, torch.Tensor], expert_map: ExpertMap | None = None
) -> tuple[dict[str, list[Target]], set[str]]:
    """HF tensor name -> Targets, in the per-expert layout of DeepSeek's own checkpoints, and the
    names of routed experts this rank does not hold (expert parallelism: skipped, not errors).
    A logical expert held in several local slots (redundant replicas) has one Target per slot."""
    expected: dict[str, list[Target]] = {}
    not_local: set[str] = set()

    def add(hf_name: str, target: Target) -> None:
        expected.setdefault(hf_name, []).append(target)

    for name, tensor in params.items():
        if name == "lm_head.weight":
            add(name, Target(name))
            continue
        hf = _hf_name(name, cfg)
        if name.endswith("gate_up_proj.weight"):  # dense MLP or shared experts
            inter = tensor.shape[0] // 2
            base = hf.removesuffix("gate_up_proj.weight")
            add(base + "gate_proj.weight", Target(name, (slice(0, inter),)))
            add(base + "up_proj.weight", Target(name, (slice(inter, 2 * inter),)))
        elif name.endswith(("experts.w13", "experts.w2")):
            w13 = name.endswith("w13")
            base = hf.removesuffix("w13" if w13 else "w2")
            slots = _slots(name, tensor.shape[0], cfg, expert_map)
            for slot, e in enumerate(slots):
                if w13:
                    inter = tensor.shape[1] // 2
                    add(f"{base}{e}.gate_proj.weight", Target(name, (slot, slice(0, inter))))
                    add(f"{base}{e}.up_proj.weight", Target(name, (slot, slice(inter, 2 * inter))))
                else:
                    add(f"{base}{e}.down_proj.weight", Target(name, (slot,)))
            for e in sorted(set(range(cfg.n_routed_experts or 0)) - set(slots)):
                if w13:
                    not_local.update({f"{base}{e}.gate_proj.weight", f"{base}{e}.up_proj.weight"})
                else:
                    not_local.add(f"{base}{e}.down_proj.weight")
        else:
            add(hf, Target(name))
    return expected, not_local


def _hf_name(param: str, cfg: ModelConfig) -> str:
    """Our parameter name -> the checkpoint's: MTP layer j is `model.layers.{num_hidden_layers + j}`."""
    if param.startswith("mtp."):
        j, rest = param.removeprefix("mtp.").split(".", 1)
        return f"model.layers.{cfg.num_hidden_layers + int(j)}.{rest}"
    return f"model.{param}"


# DeepSeek's MTP layers repeat the shared embedding and LM head; the model shares the main ones.
_MTP_SHARED = ("embed_tokens.weight", "shared_head.head.weight")

ExpertMap = Callable[[int], list[int]]
"""Model layer index -> the logical expert held in each local slot (expert parallelism)."""


def _slots(param: str, num_slots: int, cfg: ModelConfig, expert_map: ExpertMap | None) -> list[int]:
    if expert_map is None:
        return list(range(num_slots))
    layer = int(_LAYER.match("model." + param).group(1))
    slots = expert_map(layer)
    assert len(slots) == num_slots, (param, len(slots), num_slots)
    return slots


_FUSED_EXPERTS = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def _fused_expert_target(name: str, expert_map: ExpertMap | None) -> list[Target] | None:
    """transformers-5 checkpoints store each layer's experts fused: [E, 2I, H] / [E, H, I]."""
    m = _FUSED_EXPERTS.match(name)
    if m is None:
        return None
    param = f"layers.{m.group(1)}.mlp.experts.{'w13' if m.group(2) == 'gate_up_proj' else 'w2'}"
    rows = None if expert_map is None else tuple(expert_map(int(m.group(1))))
    return [Target(param, rows=rows)]


def iter_checkpoint(folder: Path) -> Iterator[tuple[str, Path, object]]:
    for file in checkpoint_files(folder):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                yield name, file, f


def load_weights(
    model: torch.nn.Module, cfg: ModelConfig, folder: str | Path, expert_map: ExpertMap | None = None
) -> None:
    """Fill the model's parameters from the folder's safetensors; with expert_map (expert
    parallelism) only this rank's routed experts are read."""
    folder = check_model_folder(folder)
    params = {name: p.data for name, p in model.named_parameters()}
    expected, not_local = expected_tensors(cfg, params, expert_map)
    has_mtp = any(name.startswith("mtp.") for name in params)
    filled: dict[str, int] = {name: 0 for name in params}
    seen: set[str] = set()
    unexpected: list[str] = []
    mtp_skipped = 0
    progress = Progress(
        logger, f"loading weights from {folder}", sum(f.stat().st_size for f in checkpoint_files(folder))
    )
    for name, file, handle in iter_checkpoint(folder):
        if name in not_local:
            seen.add(name)
            continue
        targets = expected.get(name) or _fused_expert_target(name, expert_map)
        if targets is None or targets[0].param not in params:
            m = _LAYER.match(name)
            if m and int(m.group(1)) >= cfg.num_hidden_layers and (not has_mtp or name.endswith(_MTP_SHARED)):
                mtp_skipped += 1  # MTP layers follow the main layers; loaded only for speculative decoding
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
        for target in targets:
            dest = params[target.param]
            if target.region is not None:
                dest = dest[target.region]
            shape = list(slc.get_shape())
            if target.rows is not None:
                shape[0] = len(target.rows)
            if tuple(shape) != tuple(dest.shape):
                raise ValueError(
                    f"checkpoint tensor {name!r} has shape {list(slc.get_shape())}, expected {list(dest.shape)} "
                    f"(for parameter {target.param})"
                )
            tensor = handle.get_tensor(name)
            dest.copy_(tensor if target.rows is None else tensor[list(target.rows)])
            filled[target.param] += dest.numel()
        progress.advance(tensor.numel() * tensor.element_size())
    if unexpected:
        raise ValueError(
            f"checkpoint has {len(unexpected)} unexpected tensor(s): {', '.join(sorted(unexpected)[:10])}"
        )
    if cfg.tie_word_embeddings and filled.get("lm_head.weight") == 0:
        params["lm_head.weight"].copy_(params["embed_tokens.weight"])
        filled["lm_head.weight"] = params["lm_head.weight"].numel()
        seen.add("lm_head.weight")
    missing = [
        hf
        for hf, targets in expected.items()
        if hf not in seen and any(filled[t.param] < params[t.param].numel() for t in targets)
    ]
    if missing:
        raise ValueError(f"checkpoint is missing {len(missing)} tensor(s): {', '.join(missing[:10])}")
    progress.done()
    if mtp_skipped:
        logger.info("skipped %d MTP-layer tensors", mtp_skipped)
