"""HF safetensors checkpoint -> model, tensor by tensor.

Reads a single `model.safetensors` or shards listed in `model.safetensors.index.json`, in two
passes. The plan reads only the files' headers and checks every tensor against the model (its
name, dtype, shape, and for a quantized weight its scale grid) before anything is copied, so a
checkpoint that does not fit is refused naming the tensor while the model's parameters are still
untouched (`torch.empty`: no memory committed). The copy then reads each tensor from the
memory-mapped file and copies (casts) it straight into its parameter, one at a time: the
checkpoint is never held in memory a second time (peak: the model plus the largest tensor).

Names: HF's ("model.layers.0.self_attn.q_a_proj.weight", "lm_head.weight") or DeepSeek's own
("layers.0.attn.wq_a.weight", "head.weight"; `deepseek_to_hf`). The engine fuses gate and up
projections into one [2I, H] weight and stacks per-expert weights into w13[E, 2I, H] / w2[E, H, I]
(checkpoints already fused by transformers 5, `experts.gate_up_proj` / `experts.down_proj`, are
accepted too).

Quantized checkpoints (engine/quant.py) keep their bytes: an FP8 weight is copied as e4m3 and its
block grid (`weight_scale_inv`, or `scale` in DeepSeek's names; float32 or e8m0 bytes) expanded to
one float32 scale per row; MXFP4 experts keep their packed bytes and e8m0 scales.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.config import ModelConfig
from engine.progress import Progress
from engine.quant import expand_scale_rows
from engine.safetensors_io import SafetensorsFile
from kernels.quant import e8m0_to_float

logger = logging.getLogger(__name__)

REQUIRED_FILES = ("config.json", "tokenizer.json")
_FLOAT_DTYPES = ("BF16", "F16", "F32")
SCALE = "weight_scale_inv"
"""A quantized weight's block scales, HF's name (DeepSeek's: `scale`)."""


@dataclass(frozen=True)
class Target:
    """Where one checkpoint tensor goes: a parameter, and the region of it (None = whole)."""

    param: str
    region: tuple | None = None
    rows: tuple[int, ...] | None = None
    """Take these rows of the checkpoint tensor (its local experts) instead of all of it."""
    block_rows: int = 0
    """A quantized weight's scales: each row of the checkpoint's grid covers this many rows of the
    weight (expanded to one scale per row); 0: not scales."""


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


def iter_checkpoint(folder: Path) -> Iterator[tuple[str, Path, SafetensorsFile]]:
    """Every tensor name in the folder's safetensors, with its file and the open file to read it."""
    for file in checkpoint_files(folder):
        with SafetensorsFile(file) as f:
            for name in f.keys():
                yield name, file, f


# DeepSeek's own names (its inference code and V4's checkpoints) against HF's, a name component
# at a time; the leaf's `scale` is HF's `weight_scale_inv`, a router gate's `bias` its
# `e_score_correction_bias`.
_DEEPSEEK_NAMES = {
    "self_attn": "attn",
    "mlp": "ffn",
    "embed_tokens": "embed",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "q_proj": "wq",
    "q_a_proj": "wq_a",
    "q_a_layernorm": "q_norm",
    "q_b_proj": "wq_b",
    "kv_a_proj_with_mqa": "wkv_a",
    "kv_a_layernorm": "kv_norm",
    "kv_b_proj": "wkv_b",
    "o_proj": "wo",
    "gate_proj": "w1",
    "down_proj": "w2",
    "up_proj": "w3",
}
_HF_NAMES = {v: k for k, v in _DEEPSEEK_NAMES.items()}


def hf_to_deepseek(name: str) -> str:
    """An HF tensor name -> DeepSeek's ("model.layers.0.self_attn.q_a_proj.weight_scale_inv" ->
    "layers.0.attn.wq_a.scale")."""
    if name == "lm_head.weight":
        return "head.weight"
    *path, leaf = name.removeprefix("model.").split(".")
    if leaf == SCALE:
        leaf = "scale"
    elif leaf == "e_score_correction_bias":
        leaf = "bias"
    return ".".join([*_renamed(path, _DEEPSEEK_NAMES), leaf])


def deepseek_to_hf(name: str) -> str:
    """A checkpoint's tensor name in HF's form: DeepSeek's names translated (`hf_to_deepseek`
    undone), HF's kept."""
    if name.startswith("model.") or name == "lm_head.weight":
        return name
    if name == "head.weight":
        return "lm_head.weight"
    *path, leaf = name.split(".")
    if leaf == "scale":
        leaf = SCALE
    elif leaf == "bias" and path[-1:] == ["gate"]:
        leaf = "e_score_correction_bias"
    return "model." + ".".join([*_renamed(path, _HF_NAMES), leaf])


# DeepSeek-V4's names (its release, and what transformers writes back) -> HF's module names, in
# order: the indexer's modules move under the compressor first, then the blocks, then the leaves.
_V4_RENAMES = [
    (r"\.indexer\.compressor\.", ".compressor.indexer."),
    (r"\.indexer\.weights_proj\.", ".compressor.indexer.scorer.weights_proj."),
    (r"\.indexer\.wq_b\.", ".compressor.indexer.q_b_proj."),
    (r"\.attn\.", ".self_attn."),
    (r"\.ffn\.", ".mlp."),
    (r"^embed\.weight$", "embed_tokens.weight"),
    (r"^head\.weight$", "lm_head.weight"),
    (r"^hc_head_(fn|base|scale)$", r"hc_head.hc_\1"),
    (r"\.attn_norm\.", ".input_layernorm."),
    (r"\.ffn_norm\.", ".post_attention_layernorm."),
    (r"\.hc_(attn|ffn)_(fn|base|scale)$", r".\1_hc.\2"),
    (r"\.attn_sink$", ".sinks"),
    (r"(self_attn|compressor|indexer)\.norm\.", r"\1.kv_norm."),
    (r"\.ape$", ".position_bias"),
    (r"\.wq_a\.", ".q_a_proj."),
    (r"\.wq_b\.", ".q_b_proj."),
    (r"\.wkv\.", ".kv_proj."),
    (r"\.wgate\.", ".gate_proj."),
    (r"\.wo_a\.", ".o_a_proj."),
    (r"\.wo_b\.", ".o_b_proj."),
    (r"\.q_norm\.", ".q_a_norm."),
    (r"\.gate\.bias$", ".gate.e_score_correction_bias"),
    (r"\.w1\.", ".gate_proj."),
    (r"\.w2\.", ".down_proj."),
    (r"\.w3\.", ".up_proj."),
    (r"(?<!_hc)\.scale$", "." + SCALE),  # a quantized weight's, not the hyper-connections'
]
_V4_RENAMES = [(re.compile(a), b) for a, b in _V4_RENAMES]


# DeepSeek-V4's MTP layer j (`mtp.j.*`) is model layer num_hidden_layers + j; its own head, norm
# and hc_head take the names the model gives them, its copy of the embedding the shared one's.
_V4_MTP_LEAVES = [
    (re.compile(r"^head\.weight$"), "shared_head.head.weight"),
    (re.compile(r"^norm\.weight$"), "shared_head.norm.weight"),
    (re.compile(r"^hc_head_(fn|base|scale)$"), r"hc_head.hc_\1"),
    (re.compile(r"^emb\.tok_emb\.weight$"), "embed_tokens.weight"),
]
_V4_MTP = re.compile(r"^mtp\.(\d+)\.(.+)$")


def v4_to_hf(name: str, num_layers: int = 0) -> str:
    """A DeepSeek-V4 checkpoint's tensor name in HF's form ("layers.0.attn.wkv.weight" or
    "model.layers.0.attn.wkv.weight" -> "model.layers.0.self_attn.kv_proj.weight"; "mtp.0.e_proj.weight"
    -> "model.layers.{num_layers}.e_proj.weight"); HF's names kept."""
    bare = name.removeprefix("model.")
    mtp = _V4_MTP.match(bare)
    if mtp:
        rest = mtp.group(2)
        for pattern, repl in _V4_MTP_LEAVES:
            rest = pattern.sub(repl, rest)
        bare = f"layers.{num_layers + int(mtp.group(1))}.{rest}"
    for pattern, repl in _V4_RENAMES:
        bare = pattern.sub(repl, bare)
    return bare if bare == "lm_head.weight" else "model." + bare


def checkpoint_to_hf(name: str, cfg: ModelConfig) -> str:
    return v4_to_hf(name, cfg.num_hidden_layers) if cfg.v4 is not None else deepseek_to_hf(name)


def _renamed(path: list[str], names: dict[str, str]) -> list[str]:
    """A name's modules translated, up to DeepSeek-V3.2's `indexer`, whose own modules (wq_b, wk,
    k_norm, weights_proj) both spell alike."""
    cut = path.index("indexer") if "indexer" in path else len(path)
    return [*(names.get(c, c) for c in path[:cut]), *path[cut:]]


def expected_tensors(
    cfg: ModelConfig, params: dict[str, torch.Tensor], expert_map: ExpertMap | None = None
) -> tuple[dict[str, list[Target]], set[str]]:
    """HF tensor name -> Targets, in the per-expert layout of DeepSeek's own checkpoints, and the
    names of routed experts this rank does not hold (expert parallelism: skipped, not errors).
    A logical expert held in several local slots (redundant replicas) has one Target per slot. A
    quantized weight's scales (parameter `<weight>_scale`, one row per weight row) take the
    weight's regions from the checkpoint's `weight_scale_inv`."""
    expected: dict[str, list[Target]] = {}
    not_local: set[str] = set()

    for name, tensor in params.items():
        scales = name.endswith("_scale") and name.removesuffix("_scale") in params  # not V4's hc_scale
        block_rows = 0
        if scales:
            quantized = params[name.removesuffix("_scale")]
            fp4 = quantized.dtype == torch.uint8
            block_rows = 1 if fp4 else cfg.quant.block_n  # MXFP4: a scale per row already
        for hf, target in _weight_targets(
            name.removesuffix("_scale") if scales else name, tensor, cfg, expert_map
        ):
            if scales:
                hf = hf.removesuffix("weight") + SCALE
                target = target and Target(name, target.region, block_rows=block_rows)
            if target is None:
                not_local.add(hf)
            else:
                expected.setdefault(hf, []).append(target)
    return expected, not_local


def _weight_targets(
    name: str, tensor: torch.Tensor, cfg: ModelConfig, expert_map: ExpertMap | None
) -> Iterator[tuple[str, Target | None]]:
    """The checkpoint tensors of parameter `name` and their regions of it; None: an expert this
    rank does not hold."""
    if name == "lm_head.weight":
        yield name, Target(name)
        return
    hf = _hf_name(name, cfg)
    if name.endswith("gate_up_proj.weight"):  # dense MLP or shared experts
        inter = tensor.shape[0] // 2
        base = hf.removesuffix("gate_up_proj.weight")
        yield base + "gate_proj.weight", Target(name, (slice(0, inter),))
        yield base + "up_proj.weight", Target(name, (slice(inter, 2 * inter),))
    elif name.endswith(("experts.w13", "experts.w2")):
        w13 = name.endswith("w13")
        base = hf.removesuffix("w13" if w13 else "w2")
        slots = _slots(name, tensor.shape[0], cfg, expert_map)
        inter = tensor.shape[1] // 2
        for slot, e in enumerate(slots):
            if w13:
                yield f"{base}{e}.gate_proj.weight", Target(name, (slot, slice(0, inter)))
                yield f"{base}{e}.up_proj.weight", Target(name, (slot, slice(inter, 2 * inter)))
            else:
                yield f"{base}{e}.down_proj.weight", Target(name, (slot,))
        for e in sorted(set(range(cfg.n_routed_experts or 0)) - set(slots)):
            for proj in ("gate_proj", "up_proj") if w13 else ("down_proj",):
                yield f"{base}{e}.{proj}.weight", None
    else:
        yield hf, Target(name)


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


@dataclass(frozen=True)
class _Entry:
    """A checkpoint tensor the plan accepted: where it is and where it goes."""

    name: str
    """As the checkpoint names it (for messages)."""
    file: Path
    targets: list[Target]


def load_weights(
    model: torch.nn.Module, cfg: ModelConfig, folder: str | Path, expert_map: ExpertMap | None = None
) -> None:
    """Fill the model's parameters from the folder's safetensors; with expert_map (expert
    parallelism) only this rank's routed experts are read. ValueError naming the tensor, before
    anything is copied, for a checkpoint that does not fit the model."""
    folder = check_model_folder(folder)
    params = {name: p.data for name, p in model.named_parameters()}
    entries, mtp_skipped = _plan(params, cfg, folder, expert_map)
    progress = Progress(
        logger, f"loading weights from {folder}", sum(f.stat().st_size for f in checkpoint_files(folder))
    )
    by_file: dict[Path, list[_Entry]] = {}
    for entry in entries:
        by_file.setdefault(entry.file, []).append(entry)
    for file, file_entries in by_file.items():
        with SafetensorsFile(file) as handle:
            for entry in file_entries:
                _load(handle, entry, params)
                progress.advance(handle.tensors[entry.name].nbytes)
    if cfg.tie_word_embeddings and "lm_head.weight" in params and not _filled(entries, "lm_head.weight"):
        params["lm_head.weight"].copy_(params["embed_tokens.weight"])
    progress.done()
    if mtp_skipped:
        logger.info("skipped %d MTP-layer tensors", mtp_skipped)


def _filled(entries: list[_Entry], param: str) -> bool:
    return any(t.param == param for e in entries for t in e.targets)


def _plan(
    params: dict[str, torch.Tensor], cfg: ModelConfig, folder: Path, expert_map: ExpertMap | None
) -> tuple[list[_Entry], int]:
    """Every checkpoint tensor to copy, checked from the files' headers alone: ValueError naming
    the tensor for one that is unexpected, twice, of a dtype or shape its parameter cannot take,
    a quantized weight without its scales or scales without their weight, or for tensors missing."""
    expected, not_local = expected_tensors(cfg, params, expert_map)
    has_mtp = any(name.startswith("mtp.") for name in params)
    entries: list[_Entry] = []
    stored: dict[str, str] = {}  # HF name -> the checkpoint's
    filled: dict[str, int] = {name: 0 for name in params}
    unexpected: list[str] = []
    mtp_skipped = 0
    for file in checkpoint_files(folder):
        with SafetensorsFile(file) as handle:
            for name in handle.keys():
                if cfg.v4 is not None and not has_mtp and name.removeprefix("model.").startswith("mtp."):
                    mtp_skipped += 1  # DeepSeek-V4's MTP layers: loaded only for speculative decoding
                    continue
                hf = checkpoint_to_hf(name, cfg)
                if hf in stored:
                    raise ValueError(f"checkpoint tensor {name!r} appears twice (second time in {file.name})")
                stored[hf] = name
                if hf in not_local:
                    continue
                targets = expected.get(hf) or _fused_expert_target(hf, expert_map)
                if targets is None or targets[0].param not in params:
                    m = _LAYER.match(hf)
                    if (
                        m
                        and int(m.group(1)) >= cfg.num_hidden_layers
                        and (not has_mtp or hf.endswith(_MTP_SHARED))
                    ):
                        mtp_skipped += (
                            1  # MTP layers follow the main layers; loaded only for speculative decoding
                        )
                        continue
                    unexpected.append(name)
                    continue
                info = handle.tensors[name]
                for target in targets:
                    _check(name, info.dtype, list(info.shape), params, target, cfg)
                    filled[target.param] += _region(params, target).numel()
                entries.append(_Entry(name, file, targets))
    quantized_unexpected = [n for n in unexpected if checkpoint_to_hf(n, cfg).endswith(SCALE)]
    for name in quantized_unexpected:
        weight = _weight_name(name)
        raise ValueError(
            f"checkpoint tensor {name!r} is the scales of {weight!r}, "
            + (
                "which is missing"
                if checkpoint_to_hf(weight, cfg) not in stored
                else "which the model keeps unquantized"
            )
        )
    if unexpected:
        raise ValueError(
            f"checkpoint has {len(unexpected)} unexpected tensor(s): {', '.join(sorted(unexpected)[:10])}"
        )
    tied = cfg.tie_word_embeddings and "lm_head.weight" not in stored
    missing = [
        hf
        for hf, targets in expected.items()
        if hf not in stored
        and not (tied and hf == "lm_head.weight")
        and any(filled[t.param] < params[t.param].numel() for t in targets)
    ]
    for hf in missing:
        if hf.endswith(SCALE) and (weight := hf.removesuffix(SCALE) + "weight") in stored:
            raise ValueError(
                f"checkpoint tensor {stored[weight]!r} is quantized but its scales "
                f"({_scale_name(stored[weight])!r}) are missing"
            )
        if hf.endswith(".weight") and (scale := hf.removesuffix("weight") + SCALE) in stored:
            raise ValueError(
                f"checkpoint tensor {stored[scale]!r} is the scales of {_weight_name(stored[scale])!r}, which is missing"
            )
    if missing:
        names = [hf if not _deepseek_named(stored) else hf_to_deepseek(hf) for hf in missing]
        raise ValueError(f"checkpoint is missing {len(missing)} tensor(s): {', '.join(names[:10])}")
    return entries, mtp_skipped


def _deepseek_named(stored: dict[str, str]) -> bool:
    return any(hf != name for hf, name in stored.items())


def _weight_name(scale_name: str) -> str:
    """The weight a scale tensor belongs to, in the checkpoint's own naming."""
    if scale_name.endswith("." + SCALE):
        return scale_name.removesuffix(SCALE) + "weight"
    return scale_name.removesuffix("scale") + "weight"


def _scale_name(weight_name: str) -> str:
    """The scales a quantized weight needs, in the checkpoint's own naming."""
    base = weight_name.removesuffix("weight")
    return base + (SCALE if weight_name.startswith("model.") else "scale")


def _region(params: dict[str, torch.Tensor], target: Target) -> torch.Tensor:
    dest = params[target.param]
    return dest if target.region is None else dest[target.region]


_SOURCE_DTYPES = {
    torch.float8_e4m3fn: ("F8_E4M3",),
    torch.uint8: ("U8", "I8"),
    torch.int64: ("I64", "I32"),  # DeepSeek-V4's hash-routing table, tid2eid
}


def _check(
    name: str, dtype: str, shape: list[int], params: dict[str, torch.Tensor], target: Target, cfg: ModelConfig
) -> None:
    """ValueError naming the checkpoint tensor where it cannot go to target."""
    dest = _region(params, target)
    param_dtype = params[target.param].dtype
    if target.block_rows:  # a weight's scales: float32 grids (e8m0 bytes widened), or MXFP4's bytes
        allowed = ("F32", "F8_E8M0") if param_dtype == torch.float32 else ("F8_E8M0", "U8")
    elif param_dtype in _SOURCE_DTYPES:
        allowed = _SOURCE_DTYPES[param_dtype]
    else:
        allowed = _FLOAT_DTYPES
    if dtype not in allowed:
        if dtype == "F8_E4M3" and cfg.quant is None:
            raise ValueError(
                f"checkpoint tensor {name!r} is quantized ({dtype}) but config.json has no quantization_config"
            )
        kept = {torch.float8_e4m3fn: "as FP8", torch.uint8: "as MXFP4"}.get(param_dtype, "unquantized")
        raise ValueError(
            f"checkpoint tensor {name!r} has dtype {dtype}; the model keeps it {kept}, from {list(allowed)}"
        )
    if target.block_rows:
        rows, cols = dest.shape[-2:]
        want = [*dest.shape[:-2], -(-rows // target.block_rows), cols]
        if shape != want:
            quantized = params[target.param.removesuffix("_scale")]
            k = quantized.shape[-1] * (2 if quantized.dtype == torch.uint8 else 1)
            block = (target.block_rows, -(-k // cols))
            raise ValueError(
                f"checkpoint tensor {name!r} has a scale grid {shape}; a [{rows}, {k}] weight in "
                f"{list(block)} blocks needs {want}"
            )
        return
    if target.rows is not None:
        shape = [len(target.rows), *shape[1:]]
    if tuple(shape) != tuple(dest.shape):
        raise ValueError(
            f"checkpoint tensor {name!r} has shape {shape}, expected {list(dest.shape)} "
            f"(for parameter {target.param})"
        )


def _load(handle: SafetensorsFile, entry: _Entry, params: dict[str, torch.Tensor]) -> None:
    """One checkpoint tensor into its targets: read straight into the parameter where it is kept
    as stored, else read once and converted into each target (peak: that tensor's bytes)."""
    if len(entry.targets) == 1:
        target = entry.targets[0]
        if target.rows is None and not target.block_rows:
            if handle.read_into(entry.name, _region(params, target)):
                return
    tensor = handle.read(entry.name)
    for target in entry.targets:
        _copy(tensor, params, target)


def _copy(tensor: torch.Tensor, params: dict[str, torch.Tensor], target: Target) -> None:
    dest = _region(params, target)
    if target.rows is not None:
        tensor = tensor[list(target.rows)]
    if tensor.dtype in (torch.float8_e8m0fnu, torch.int8):
        tensor = tensor.view(torch.uint8)  # bytes as stored (a numeric cast would lose them)
    if target.block_rows:
        if dest.dtype == torch.float32 and tensor.dtype == torch.uint8:
            tensor = e8m0_to_float(tensor)
        tensor = expand_scale_rows(tensor, dest.shape[-2], target.block_rows)
    dest.copy_(tensor)
