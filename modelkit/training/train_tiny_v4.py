"""Train a small DeepSeek-V4 on the stdlib docs, on CPU: `pdserve train-tiny --arch v4 --out DIR`.

The model is transformers' `DeepseekV4ForCausalLM` (the class the engine is tested against for
logits parity) at the width of the shipped V3 model: every attention type (sliding window, CSA with
its indexer, HCA), hash-routed and score-routed MoE, hyper-connections. transformers has no V4 MTP
layer, so none is trained: the loss is the next token's cross-entropy. The run shares the V3
recipe's data, schedule, optimizer and aux-loss-free balancing of the score-routed layers
(modelkit/training/train_tiny.py); the hash layers' token -> expert table is drawn once (distinct
experts per token, as DeepSeek's are fixed) and never trained. The folder is written as
transformers writes V4 (DeepSeek's tensor names), bf16, with the project's tokenizer files and
training.json, and installed by renaming a finished temporary folder.
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import tokenizers
import torch
import torch.nn.functional as F
import transformers
from tokenizers import Tokenizer
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4TopKRouter

from modelkit.bpe_tokenizer import tokenizer_config, train_tokenizer
from modelkit.make_model import V4Preset, generation_config, v4_config
from modelkit.training.data import build_corpus, fixed_windows, sample_windows
from modelkit.training.train_tiny import ExpertLoad, TrainConfig, _hardware, _json, install, lr_at

logger = logging.getLogger(__name__)

PRESET_NAME = "trained-tiny-v4"

MODEL = V4Preset(
    vocab_size=4096,
    hidden_size=256,
    compress_ratios=(0, 4, 32, 4),
    hca_rate=32,
    num_attention_heads=4,
    head_dim=128,
    qk_rope_head_dim=32,
    q_lora_rank=128,
    o_groups=2,
    o_lora_rank=128,
    sliding_window=64,
    n_routed_experts=16,
    num_experts_per_tok=2,
    moe_intermediate_size=128,
    index_n_heads=16,
    index_head_dim=32,
    index_topk=16,
    max_position_embeddings=4096,
)
"""4 layers (sliding, CSA, HCA, CSA; the first hash-routed) of 16 experts, 2 routed + 1 shared."""

SECONDS_PER_STEP = 1.3
"""Seconds per step of the default run (validation included) on the reference machine: a 2-core AMD
EPYC (AVX2) with 2 torch threads."""


@dataclass(frozen=True)
class V4TrainConfig:
    base: TrainConfig = replace(TrainConfig(), steps=300)
    model: V4Preset = MODEL


def build_model(raw: dict[str, Any], seed: int) -> DeepseekV4ForCausalLM:
    """transformers' model and init (torch's global RNG), float32; the hash table drawn distinct."""
    keys = {
        k: v
        for k, v in raw.items()
        if k not in ("architectures", "pdserve_preset", "pdserve_build_fingerprint")
    }
    model = DeepseekV4ForCausalLM(DeepseekV4Config(**keys)).float()
    model.set_attn_implementation("eager")
    model.set_experts_implementation("eager")
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in model.model.layers:
            gate = layer.mlp.gate
            if hasattr(gate, "tid2eid"):
                rows = torch.rand(
                    gate.tid2eid.shape[0], model.config.n_routed_experts, generator=gen
                ).argsort(-1)
                gate.tid2eid.copy_(rows[:, : gate.tid2eid.shape[1]])
    return model


def train(
    cfg: V4TrainConfig, max_wall_s: float | None = None
) -> tuple[DeepseekV4ForCausalLM, Tokenizer, dict, dict]:
    base = cfg.base
    torch.set_num_threads(base.threads)
    torch.manual_seed(base.seed)
    start = time.perf_counter()
    tokenizer = train_tokenizer(cfg.model.vocab_size)
    corpus = build_corpus(tokenizer, base.max_files)
    raw = v4_config(cfg.model, "trained", PRESET_NAME)
    model = build_model(raw, base.seed)
    load = ExpertLoad()
    load.attach([m for m in model.modules() if isinstance(m, DeepseekV4TopKRouter)])
    params = list(model.parameters())
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": base.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=base.lr, betas=(0.9, 0.95), eps=1e-8, foreach=True)
    gen = torch.Generator().manual_seed(base.seed)
    val = fixed_windows(corpus.val, base.val_windows, base.seq_len + 1)

    def loss_of(windows: torch.Tensor) -> torch.Tensor:
        logits = model(input_ids=windows[:, :-1]).logits
        return F.cross_entropy(logits.flatten(0, 1), windows[:, 1:].flatten())

    hist: dict[str, list] = {"step": [], "lr": [], "train": [], "step_s": []}
    vals: dict[str, list] = {"step": [], "val": []}
    for step in range(1, base.steps + 1):
        t0 = time.perf_counter()
        lr = lr_at(step - 1, base)
        for group in opt.param_groups:
            group["lr"] = lr
        model.train()
        load.counting = True
        loss = loss_of(sample_windows(corpus.train, base.batch_size, base.seq_len + 1, gen))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, base.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        load.update_biases(base.bias_update_speed)
        for key, value in zip(hist, (step, lr, loss.item(), time.perf_counter() - t0), strict=True):
            hist[key].append(value)
        late = max_wall_s is not None and time.perf_counter() - start > max_wall_s
        if step % base.eval_every == 0 or step == base.steps or late:
            model.eval()
            load.counting = False
            with torch.no_grad():
                v = sum(loss_of(chunk).item() * len(chunk) for chunk in val.split(base.batch_size)) / len(val)
            vals["step"].append(step)
            vals["val"].append(v)
            logger.info(
                "step %d/%d lr %.2e train %.3f val %.3f (%.2f s/step)",
                step,
                base.steps,
                lr,
                loss.item(),
                v,
                hist["step_s"][-1],
            )
        if late and step < base.steps:
            logger.warning(
                "stopping after %d of %d steps: past max_wall_s=%.0f", step, base.steps, max_wall_s
            )
            break
    done = hist["step"][-1]
    record = {
        "model": {"total": sum(p.numel() for p in params)},
        "data": corpus.describe(),
        "train_config": asdict(base),
        "steps": done,
        "stopped_early": done < base.steps,
        "tokens_seen": done * base.tokens_per_step,
        "wall_time_s": round(time.perf_counter() - start, 1),
        "mean_step_s": round(sum(hist["step_s"]) / done, 3),
        "final": {
            "train_mean_last_20": round(sum(hist["train"][-20:]) / len(hist["train"][-20:]), 4),
            "val": round(vals["val"][-1], 4),
        },
        "history": {k: [round(x, 5) for x in v] for k, v in hist.items()},
        "val": {k: [round(x, 5) for x in v] for k, v in vals.items()},
    }
    return model, tokenizer, raw, record


def write_folder(
    model: DeepseekV4ForCausalLM, tokenizer: Tokenizer, raw: dict, record: dict, out: Path, command: str
) -> Path:
    out = Path(out).absolute()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        record = {
            "command": command,
            "date": datetime.now(UTC).isoformat(timespec="seconds"),
            "hardware": _hardware(record["train_config"]["threads"]),
            "versions": {"python": platform.python_version(), "torch": torch.__version__,
                         "transformers": transformers.__version__, "tokenizers": tokenizers.__version__},
            **record,
        }  # fmt: skip
        model.to(torch.bfloat16).save_pretrained(tmp, safe_serialization=True)
        tokenizer.save(str(tmp / "tokenizer.json"))
        _json(tmp / "tokenizer_config.json", tokenizer_config(raw["max_position_embeddings"]))
        _json(tmp / "generation_config.json", generation_config())
        _json(tmp / "training.json", record)
        config = json.loads((tmp / "config.json").read_text())
        config["pdserve_preset"] = PRESET_NAME
        _json(tmp / "config.json", config)
        install(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def run(args: argparse.Namespace, command: str) -> Path:
    steps = args.steps if args.steps is not None else max(1, round(args.minutes * 60 / SECONDS_PER_STEP))
    cfg = V4TrainConfig(base=replace(TrainConfig(), steps=steps, seed=args.seed, threads=args.threads))
    model, tokenizer, raw, record = train(cfg, max_wall_s=args.max_minutes * 60)
    out = write_folder(model, tokenizer, raw, record, args.out, command)
    logger.info("wrote %s in %.1f min: %s", out, record["wall_time_s"] / 60, record["final"])
    return out
