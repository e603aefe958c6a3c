"""bf16 / fp32 checkpoints to the formats DeepSeek releases (`pdserve quantize`): FP8 e4m3 with block
scales (128 x 128 or 32 x 32; float32, or powers of two with ue8m0) and MXFP4 routed experts, under
HF names (`weight_scale_inv`) or DeepSeek's own (`scale`)."""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from engine.loader import SCALE, check_model_folder, deepseek_to_hf, hf_to_deepseek, iter_checkpoint
from engine.safetensors_io import SafetensorsFile
from kernels.quant import E2M1_VALUES, MXFP4_BLOCK, float_to_e8m0
from modelkit.make_model import FINGERPRINT_KEY

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0


def quantize_fp8(w: torch.Tensor, block: tuple[int, int], ue8m0: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] (any float) -> (e4m3 [N, K], scale float32 [ceil(N / bn), ceil(K / bk)]) as DeepSeek's
    conversion makes them: each block's scale its largest magnitude / 448 (with ue8m0, rounded up
    to a power of two), the values w / scale rounded to nearest e4m3. Partial edge blocks take the
    scale of what they hold."""
    bn, bk = block
    n, k = w.shape
    nb, kb = -(-n // bn), -(-k // bk)
    padded = torch.zeros(nb * bn, kb * bk, dtype=torch.float32)
    padded[:n, :k] = w.float()
    blocks = padded.view(nb, bn, kb, bk)
    amax = blocks.abs().amax(dim=(1, 3))  # [nb, kb]
    scale = (amax / E4M3_MAX).clamp(min=2.0**-126)
    if ue8m0:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    q = (blocks / scale[:, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return q.view(nb * bn, kb * bk)[:n, :k].contiguous(), scale


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] (K a multiple of 32) -> (packed uint8 [N, K / 2], e8m0 uint8 [N, K / 32]) as the OCP MX
    format makes them: each 32's scale 2^(floor(log2(amax)) - 2), the values w / scale rounded to
    the nearest e2m1 value (a tie to the smaller magnitude), clamped at 6."""
    n, k = w.shape
    if k % MXFP4_BLOCK:
        raise ValueError(f"MXFP4 needs K a multiple of {MXFP4_BLOCK}, got {k}")
    groups = w.float().view(n, k // MXFP4_BLOCK, MXFP4_BLOCK)
    amax = groups.abs().amax(dim=-1).clamp(min=2.0**-126)
    exp = torch.floor(torch.log2(amax)) - 2
    scaled = (groups / torch.exp2(exp)[..., None]).clamp(-6.0, 6.0)
    magnitudes = torch.tensor(E2M1_VALUES)
    code = (scaled.abs()[..., None] - magnitudes).abs().argmin(dim=-1)  # ties: the smaller magnitude
    code = code | ((scaled < 0) & (code > 0)).long() << 3
    code = code.view(n, k)
    packed = (code[:, 0::2] | (code[:, 1::2] << 4)).to(torch.uint8)
    return packed, (exp + 127).to(torch.uint8)


@dataclass(frozen=True)
class QuantOptions:
    """How `pdserve quantize` writes a checkpoint."""

    block: int = 128
    """FP8 block edge: 128 (V3 / R1 / V3.1 / V3.2 / V4) or 32 (V4.1)."""
    ue8m0: bool = False
    """Scales rounded up to powers of two (V3.1 and later: scale_fmt ue8m0)."""
    scale_dtype: str = "f32"
    """How scales are stored: "f32", or "e8m0" (one byte, V4's; needs ue8m0)."""
    experts_fp4: bool = False
    """Routed experts as MXFP4 (V4's expert_dtype fp4)."""
    names: str = "hf"
    """Tensor names: "hf" (model.layers.0.self_attn.q_a_proj.weight_scale_inv) or "deepseek"
    (layers.0.attn.wq_a.scale)."""

    def __post_init__(self) -> None:
        if not 1 <= self.block <= 4096:
            raise ValueError(f"block must be 1 to 4096, got {self.block}")
        if self.scale_dtype not in ("f32", "e8m0"):
            raise ValueError(f"scale_dtype must be 'f32' or 'e8m0', got {self.scale_dtype!r}")
        if self.scale_dtype == "e8m0" and not self.ue8m0:
            raise ValueError("scale_dtype 'e8m0' stores powers of two: it needs ue8m0")
        if self.names not in ("hf", "deepseek"):
            raise ValueError(f"names must be 'hf' or 'deepseek', got {self.names!r}")

    def config(self, raw: dict) -> dict:
        """config.json's contents with this quantization."""
        out = dict(raw)
        q = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"}
        q["weight_block_size"] = [self.block, self.block]
        if self.ue8m0:
            q["scale_fmt"] = "ue8m0"
        out["quantization_config"] = q
        if self.experts_fp4:
            out["expert_dtype"] = "fp4"
        return out


# The linears DeepSeek's checkpoints quantize: every attention and MLP projection (dense, routed and
# shared experts, the MTP layers' too) and DeepSeek-V3.2's indexer wq_b and wk; never the embedding,
# LM head, norms, router gate, the indexer's weights_proj or the MTP layer's eh_proj.
_QUANTIZED = re.compile(
    r"^model\.layers\.\d+\.((self_attn|mlp)\.(experts\.\d+\.|shared_experts\.)?\w+_proj\w*"
    r"|self_attn\.indexer\.(wq_b|wk))\.weight$"
)
_ROUTED = re.compile(r"^model\.layers\.\d+\.mlp\.experts\.\d+\.")

# DeepSeek-V4 (its own names, as V4-Flash ships): the attention's projections, the indexer's query
# projection, routed and shared experts, the MTP layer's e_proj and h_proj; never the compressors, the indexer's weights_proj, the
# router, the hyper-connections, the sinks, norms, embedding or head.
_V4_QUANTIZED = re.compile(
    r"^(layers|mtp)\.\d+\.(attn\.(wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)|ffn\.(experts\.\d+|shared_experts)\.w[123]"
    r"|[eh]_proj)\.weight$"
)
_V4_ROUTED = re.compile(r"^(layers|mtp)\.\d+\.ffn\.experts\.\d+\.")


def quantize_tensor(
    name: str, tensor: torch.Tensor, opts: QuantOptions, v4: bool = False
) -> list[tuple[str, torch.Tensor]]:
    """One checkpoint tensor (an HF or DeepSeek name) -> the tensors the quantized checkpoint stores
    for it, named as opts.names says (DeepSeek-V4's, `v4`, keep DeepSeek's names): the weight and
    its scales where DeepSeek quantizes it, else the tensor as it is."""
    if v4:
        bare = name.removeprefix("model.")
        if not _V4_QUANTIZED.match(bare):
            return [(bare, tensor)]
        return _quantized(
            bare, bare.removesuffix("weight") + "scale", tensor, opts, bool(_V4_ROUTED.match(bare))
        )
    hf = deepseek_to_hf(name)
    if re.match(r"^model\.layers\.\d+\.mlp\.experts\.(gate_up_proj|down_proj)$", hf):
        raise ValueError(
            f"checkpoint tensor {name!r}: experts stored fused are not quantized here (store them per expert)"
        )
    rename = hf_to_deepseek if opts.names == "deepseek" else (lambda n: n)
    if not _QUANTIZED.match(hf):
        return [(rename(hf), tensor)]
    return _quantized(
        rename(hf), rename(hf.removesuffix("weight") + SCALE), tensor, opts, bool(_ROUTED.match(hf))
    )


def _quantized(
    name: str, scale_name: str, tensor: torch.Tensor, opts: QuantOptions, routed: bool
) -> list[tuple[str, torch.Tensor]]:
    if opts.experts_fp4 and routed:
        if tensor.shape[-1] % MXFP4_BLOCK:
            raise ValueError(
                f"checkpoint tensor {name!r} has {tensor.shape[-1]} columns: MXFP4 needs a multiple of 32"
            )
        data, scale = quantize_mxfp4(tensor)
        return [(name, data.view(torch.int8)), (scale_name, scale.view(torch.float8_e8m0fnu))]
    data, scale = quantize_fp8(tensor, (opts.block, opts.block), opts.ue8m0)
    if opts.scale_dtype == "e8m0":
        scale = float_to_e8m0(scale).view(torch.float8_e8m0fnu)
    return [(name, data), (scale_name, scale)]


def quantize_folder(
    src: str | Path, dst: str | Path, opts: QuantOptions, *, shard_bytes: int = 4 << 30
) -> Path:
    """Writes the HF folder src (bf16 / fp16 / fp32 safetensors) to dst in DeepSeek's quantized
    format, a tensor at a time, in shards of about shard_bytes (model.safetensors when one is
    enough); dst must not exist, or be empty. The other files (tokenizer, generation config) are
    copied."""
    src, dst = check_model_folder(src), Path(dst).absolute()
    raw = json.loads((src / "config.json").read_text())
    if raw.get("quantization_config") is not None:
        raise ValueError(
            f"model folder {str(src)!r} is already quantized (config.json has a quantization_config)"
        )
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise ValueError(f"output folder {str(dst)!r} exists and is not empty")
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.tmp-", dir=dst.parent))
    try:
        shards: list[dict[str, torch.Tensor]] = [{}]
        size = 0
        paths: list[Path] = []

        def flush() -> None:
            path = tmp / f"shard-{len(paths):05d}.safetensors"
            save_file(shards[-1], str(path), metadata={"format": "pt"})
            paths.append(path)
            shards.append({})

        v4 = raw.get("model_type") == "deepseek_v4"
        for name, file, handle in iter_checkpoint(src):
            del file
            for out_name, tensor in quantize_tensor(name, handle.read(name), opts, v4):
                if size and size + tensor.nbytes > shard_bytes:
                    flush()
                    size = 0
                shards[-1][out_name] = tensor.contiguous()
                size += tensor.nbytes
        flush()
        _name_shards(tmp, paths)
        for f in src.iterdir():
            if (
                f.is_file()
                and not f.name.endswith(".safetensors")
                and f.name
                not in (
                    "config.json",
                    "model.safetensors.index.json",
                )
            ):
                shutil.copy2(f, tmp / f.name)
        raw.pop(FINGERPRINT_KEY, None)  # not the preset's build any more
        (tmp / "config.json").write_text(json.dumps(opts.config(raw), indent=2, sort_keys=True) + "\n")
        tmp.chmod(0o755)
        if dst.exists():
            dst.rmdir()
        os.rename(tmp, dst)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dst


def _name_shards(folder: Path, paths: list[Path]) -> None:
    """One shard: model.safetensors; several: model-0000i-of-0000n.safetensors and the index."""
    if len(paths) == 1:
        paths[0].rename(folder / "model.safetensors")
        return
    weight_map: dict[str, str] = {}
    for i, path in enumerate(paths):
        final = f"model-{i + 1:05d}-of-{len(paths):05d}.safetensors"
        path.rename(folder / final)
        with SafetensorsFile(folder / final) as f:
            weight_map.update({name: final for name in f.keys()})
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2) + "\n"
    )
