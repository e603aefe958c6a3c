"""Train the project's small DeepSeek-V3 model (MLA, MoE, one MTP layer) on the stdlib docs, on CPU.

`pdserve train-tiny --out assets/pdserve-tiny [--minutes 12] [--seed 0]` (or `python -m
modelkit.training.train_tiny ...`). The main model is transformers' `DeepseekV3ForCausalLM`, the class
the engine is tested against for logits parity, so the checkpoint means the same thing to both; the
MTP head is `modelkit.training.mtp.MTPLayer`. Loss = CE(next token) + mtp_weight * CE(token after next).
Routing is DeepSeek-V3's auxiliary-loss-free balancing: after each step every router's
e_score_correction_bias moves by `bias_update_speed` towards its under-loaded experts.

Everything is seeded and the step count is fixed before training starts (--minutes is converted with
`SECONDS_PER_STEP`, measured on the reference 2-core machine), so the same command on the same machine
gives the same loss curve and the same weights. The folder is written like `make_model`'s (config.json,
bf16 model.safetensors in DeepSeek's per-expert layout, the project's tokenizer files,
generation_config.json) plus training.json and loss.png, and is installed by renaming a finished
temporary folder.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import math
import os
import platform
import shlex
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import tokenizers
import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

from modelkit.bpe_tokenizer import tokenizer_config, train_tokenizer
from modelkit.make_model import ModelPreset, _replace, generation_config, hf_config
from modelkit.training import add_arguments
from modelkit.training.data import build_corpus, fixed_windows, sample_windows
from modelkit.training.mtp import MTPLayer, mtp_logits

logger = logging.getLogger(__name__)

PRESET_NAME = "trained-tiny"
"""`pdserve_preset` of the written config.json (marks the folder as a pdserve build)."""

MODEL = ModelPreset(
    vocab_size=4096,
    hidden_size=256,
    num_hidden_layers=4,
    first_k_dense_replace=1,
    num_attention_heads=4,
    q_lora_rank=128,
    kv_lora_rank=64,
    qk_nope_head_dim=32,
    qk_rope_head_dim=16,
    v_head_dim=32,
    n_routed_experts=16,
    num_experts_per_tok=2,
    n_group=4,
    topk_group=2,
    n_shared_experts=1,
    moe_intermediate_size=128,
    intermediate_size=512,
    max_position_embeddings=4096,
)
"""The shipped model: 4 layers (1 dense + 3 MoE of 16 experts, 2 routed + 1 shared) plus one MTP layer."""

SECONDS_PER_STEP = 1.2
"""Seconds per step of the default TrainConfig (validation included) on the reference machine: a
2-core AMD EPYC (AVX2) with 2 torch threads and no other load."""


@dataclass(frozen=True)
class TrainConfig:
    """One training run; every field is recorded in training.json."""

    model: ModelPreset = MODEL
    """Architecture (its `seed` is unused: the run's seed draws the initial weights)."""
    steps: int = 600
    """Optimizer steps."""
    batch_size: int = 8
    """Sequences per step."""
    seq_len: int = 256
    """Tokens per sequence the main model reads (each window holds seq_len + 1 tokens)."""
    lr: float = 3e-3
    """Peak learning rate (AdamW)."""
    min_lr_ratio: float = 0.1
    """The cosine decay ends at lr * min_lr_ratio."""
    warmup_steps: int = 40
    """Linear warmup from lr / warmup_steps."""
    weight_decay: float = 0.1
    """AdamW decoupled weight decay on matrices (not on norms)."""
    grad_clip: float = 1.0
    """Global gradient-norm clip."""
    mtp_weight: float = 0.3
    """lambda in loss = CE(main) + lambda * CE(MTP)."""
    bias_update_speed: float = 1e-3
    """gamma of DeepSeek-V3's aux-loss-free balancing (0 keeps every correction bias at 0)."""
    eval_every: int = 40
    """Validation loss every this many steps (and after the last)."""
    val_windows: int = 32
    """Held-out windows the validation loss averages over."""
    seed: int = 0
    """Seeds the initial weights and the order of the training windows."""
    threads: int = 2
    """torch.set_num_threads."""
    max_files: int | None = None
    """Only the first stdlib files' docstrings (tests); None uses the whole corpus."""

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "seq_len", "eval_every", "val_windows", "threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.seq_len


def model_config(cfg: TrainConfig) -> dict[str, Any]:
    """config.json: make_model's fields for the preset, one MTP layer, and a fingerprint of the recipe."""
    recipe = {
        "train": asdict(cfg),
        "torch": torch.__version__.split("+")[0],
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
        "python": platform.python_version(),
    }
    fp = hashlib.sha256(json.dumps(recipe, sort_keys=True, default=str).encode()).hexdigest()
    raw = hf_config(cfg.model, fp, PRESET_NAME)
    raw["num_nextn_predict_layers"] = 1
    return raw


def build_models(raw: dict[str, Any]) -> tuple[DeepseekV3ForCausalLM, MTPLayer]:
    """The main model (transformers' init, drawn from torch's global RNG) and its MTP layer, float32."""
    config = DeepseekV3Config(**{k: v for k, v in raw.items() if k != "architectures"})
    model = DeepseekV3ForCausalLM(config).float()
    model.set_attn_implementation("sdpa")
    model.set_experts_implementation("eager")
    assert model.lm_head.weight is not model.model.embed_tokens.weight, "lm_head must not be tied"
    mtp = MTPLayer(model.config).float()
    for module in mtp.modules():  # the layer is built outside post_init: give it the same init
        model._init_weights(module)
    return model, mtp


# --- checkpoint <-> modules ----------------------------------------------------------------------


def _module_tensors(state: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """A module's state under checkpoint names: fused experts split into DeepSeek's per-expert layout."""
    out = {}
    for name, t in state.items():
        if name.endswith("mlp.experts.gate_up_proj"):  # [E, 2I, H]: gate rows, then up rows
            base = prefix + name.removesuffix("gate_up_proj")
            gate, up = t.chunk(2, dim=1)
            for e in range(t.shape[0]):
                out[f"{base}{e}.gate_proj.weight"] = gate[e]
                out[f"{base}{e}.up_proj.weight"] = up[e]
        elif name.endswith("mlp.experts.down_proj"):  # [E, H, I]
            base = prefix + name.removesuffix("down_proj")
            for e in range(t.shape[0]):
                out[f"{base}{e}.down_proj.weight"] = t[e]
        else:
            out[prefix + name] = t
    return out


def checkpoint_tensors(model: DeepseekV3ForCausalLM, mtp: MTPLayer) -> dict[str, torch.Tensor]:
    """Every tensor to save: bf16, except e_score_correction_bias (float32, as in DeepSeek-V3)."""
    tensors = _module_tensors(model.state_dict(), "")
    tensors |= _module_tensors(mtp.state_dict(), f"model.layers.{model.config.num_hidden_layers}.")
    return {
        name: (t.float() if name.endswith("e_score_correction_bias") else t.to(torch.bfloat16)).contiguous()
        for name, t in tensors.items()
    }


def _fused_state(
    module: torch.nn.Module, tensors: dict[str, torch.Tensor], prefix: str
) -> dict[str, torch.Tensor]:
    """The inverse of _module_tensors for one module's state_dict."""
    state = {}
    for name, t in module.state_dict().items():
        if name.endswith("mlp.experts.gate_up_proj"):
            base = prefix + name.removesuffix("gate_up_proj")
            state[name] = torch.stack(
                [
                    torch.cat((tensors[f"{base}{e}.gate_proj.weight"], tensors[f"{base}{e}.up_proj.weight"]))
                    for e in range(t.shape[0])
                ]
            )
        elif name.endswith("mlp.experts.down_proj"):
            base = prefix + name.removesuffix("down_proj")
            state[name] = torch.stack([tensors[f"{base}{e}.down_proj.weight"] for e in range(t.shape[0])])
        else:
            state[name] = tensors[prefix + name]
    return state


def load_trained(folder: str | Path) -> tuple[DeepseekV3ForCausalLM, MTPLayer, dict[str, Any]]:
    """A written folder back as (main model, MTP layer, config.json), float32, eval mode."""
    folder = Path(folder)
    raw = json.loads((folder / "config.json").read_text())
    model, mtp = build_models(raw)
    tensors = load_file(str(folder / "model.safetensors"))
    used = 0
    for module, prefix in ((model, ""), (mtp, f"model.layers.{raw['num_hidden_layers']}.")):
        state = _fused_state(module, tensors, prefix)
        module.load_state_dict({k: v.float() for k, v in state.items()}, strict=True)
        used += len(_module_tensors(state, prefix))
    assert used == len(tensors), f"{len(tensors) - used} checkpoint tensors belong to no module"
    return model.eval(), mtp.eval(), raw


# --- training ------------------------------------------------------------------------------------


@dataclass
class ExpertLoad:
    """Counts the tokens each router sends to each expert while `counting` (training forwards only)."""

    counts: dict[DeepseekV3TopkRouter, torch.Tensor] = field(default_factory=dict)
    counting: bool = True

    def attach(self, routers: list[DeepseekV3TopkRouter]) -> None:
        for router in routers:
            self.counts[router] = torch.zeros(router.num_experts)
            router.register_forward_hook(self._hook)

    def _hook(self, router: DeepseekV3TopkRouter, _inputs, outputs) -> None:
        if self.counting:
            indices = outputs[2]  # (router_logits, topk_weights, topk_indices [N, k])
            self.counts[router] += torch.bincount(indices.flatten(), minlength=router.num_experts)

    @torch.no_grad()
    def update_biases(self, speed: float) -> None:
        """bias += speed * sign(mean load - load): over-loaded experts become less likely, then reset."""
        for router, load in self.counts.items():
            if speed:
                router.e_score_correction_bias.add_(speed * torch.sign(load.mean() - load))
            load.zero_()


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup, then cosine decay to lr * min_lr_ratio at the last step."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - 1 - cfg.warmup_steps)
    return cfg.lr * (
        cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    )


def losses(
    model: DeepseekV3ForCausalLM, mtp: MTPLayer, windows: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """windows [B, T + 1] -> (main CE over T predictions, MTP CE over T - 1 predictions)."""
    ids = windows[:, :-1]  # [B, T]
    hidden = model.model(input_ids=ids).last_hidden_state  # [B, T, H], after the final norm
    logits = model.lm_head(hidden)  # [B, T, V]
    main = F.cross_entropy(logits.flatten(0, 1), windows[:, 1:].flatten())
    mtp_out = mtp_logits(model, mtp, ids, hidden)  # [B, T - 1, V], row i predicts ids[i + 2]
    return main, F.cross_entropy(mtp_out.flatten(0, 1), windows[:, 2:].flatten())


@torch.no_grad()
def evaluate(model, mtp, windows: torch.Tensor, batch_size: int) -> tuple[float, float]:
    """Mean (main, MTP) loss over the windows."""
    totals = [0.0, 0.0]
    for chunk in windows.split(batch_size):
        main, extra = losses(model, mtp, chunk)
        totals[0] += main.item() * len(chunk)
        totals[1] += extra.item() * len(chunk)
    return totals[0] / len(windows), totals[1] / len(windows)


def _optimizer(model, mtp, cfg: TrainConfig) -> torch.optim.AdamW:
    params = [p for m in (model, mtp) for p in m.parameters()]
    assert all(p.requires_grad for p in params)
    decay = [p for p in params if p.ndim >= 2]  # matrices, embeddings and fused experts
    no_decay = [p for p in params if p.ndim < 2]  # norm weights
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8, foreach=True)


@dataclass
class TrainResult:
    """A finished run."""

    model: DeepseekV3ForCausalLM
    """The main model, float32."""
    mtp: MTPLayer
    """Its MTP layer, float32."""
    tokenizer: Tokenizer
    """The project's BPE tokenizer the data was encoded with."""
    config: dict[str, Any]
    """config.json."""
    record: dict[str, Any]
    """training.json without the run's metadata (command, date, hardware)."""


def train(
    cfg: TrainConfig, tokenizer: Tokenizer | None = None, max_wall_s: float | None = None
) -> TrainResult:
    """Train from scratch. max_wall_s is a safety net, not the budget: a run past it stops early (its
    curve then differs from a full run's) and says so in the record."""
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    start = time.perf_counter()
    tokenizer = train_tokenizer(cfg.model.vocab_size) if tokenizer is None else tokenizer
    if tokenizer.get_vocab_size() != cfg.model.vocab_size:
        raise ValueError(
            f"tokenizer has {tokenizer.get_vocab_size()} tokens, model.vocab_size={cfg.model.vocab_size}"
        )
    corpus = build_corpus(tokenizer, cfg.max_files)
    raw = model_config(cfg)
    model, mtp = build_models(raw)
    load = ExpertLoad()
    load.attach([m for m in [*model.modules(), *mtp.modules()] if isinstance(m, DeepseekV3TopkRouter)])
    opt = _optimizer(model, mtp, cfg)
    gen = torch.Generator().manual_seed(cfg.seed)
    val = fixed_windows(corpus.val, cfg.val_windows, cfg.seq_len + 1)  # [W, T + 1]
    hist: dict[str, list] = {"step": [], "lr": [], "train_main": [], "train_mtp": [], "step_s": []}
    vals: dict[str, list] = {"step": [], "main": [], "mtp": []}
    setup_s = time.perf_counter() - start
    logger.info("setup %.1f s; training %d steps of %d tokens", setup_s, cfg.steps, cfg.tokens_per_step)

    for step in range(1, cfg.steps + 1):
        t0 = time.perf_counter()
        lr = lr_at(step - 1, cfg)
        for group in opt.param_groups:
            group["lr"] = lr
        model.train()
        mtp.train()
        load.counting = True
        main, extra = losses(model, mtp, sample_windows(corpus.train, cfg.batch_size, cfg.seq_len + 1, gen))
        (main + cfg.mtp_weight * extra).backward()
        torch.nn.utils.clip_grad_norm_([p for m in (model, mtp) for p in m.parameters()], cfg.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        load.update_biases(cfg.bias_update_speed)
        for key, value in zip(
            hist, (step, lr, main.item(), extra.item(), time.perf_counter() - t0), strict=True
        ):
            hist[key].append(value)
        late = max_wall_s is not None and time.perf_counter() - start > max_wall_s
        if step % cfg.eval_every == 0 or step == cfg.steps or late:
            model.eval()
            mtp.eval()
            load.counting = False
            for key, value in zip(vals, (step, *evaluate(model, mtp, val, cfg.batch_size)), strict=True):
                vals[key].append(value)
            logger.info(
                "step %d/%d lr %.2e train %.3f / mtp %.3f  val %.3f / mtp %.3f  (%.2f s/step)",
                step, cfg.steps, lr, main.item(), extra.item(), vals["main"][-1], vals["mtp"][-1], hist["step_s"][-1],
            )  # fmt: skip
        if late and step < cfg.steps:
            logger.warning("stopping after %d of %d steps: past max_wall_s=%.0f", step, cfg.steps, max_wall_s)
            break

    done = hist["step"][-1]
    tail = max(1, min(20, done // 5))
    record = {
        "model": _param_counts(model, mtp, cfg.model),
        "data": corpus.describe(),
        "train_config": asdict(cfg),
        "steps": done,
        "stopped_early": done < cfg.steps,
        "tokens_seen": done * cfg.tokens_per_step,
        "epochs": round(done * cfg.tokens_per_step / corpus.train.numel(), 2),
        "wall_time_s": round(time.perf_counter() - start, 1),
        "setup_s": round(setup_s, 1),
        "mean_step_s": round(sum(hist["step_s"]) / done, 3),
        "final": {
            f"train_main_mean_last_{tail}": round(sum(hist["train_main"][-tail:]) / tail, 4),
            f"train_mtp_mean_last_{tail}": round(sum(hist["train_mtp"][-tail:]) / tail, 4),
            "val_main": round(vals["main"][-1], 4),
            "val_mtp": round(vals["mtp"][-1], 4),
        },
        "expert_bias_range": _bias_range(load),
        "history": {k: [round(x, 5) for x in v] for k, v in hist.items()},
        "val": {k: [round(x, 5) for x in v] for k, v in vals.items()},
    }
    return TrainResult(model, mtp, tokenizer, raw, record)


def _bias_range(load: ExpertLoad) -> list[list[float]]:
    """[min, max] of each router's e_score_correction_bias (main MoE layers, then the MTP layer)."""
    return [
        [round(r.e_score_correction_bias.min().item(), 4), round(r.e_score_correction_bias.max().item(), 4)]
        for r in load.counts
    ]


def _param_counts(model, mtp, p: ModelPreset) -> dict[str, int]:
    main = sum(t.numel() for t in model.parameters())
    extra = sum(t.numel() for t in mtp.parameters())
    moe_layers = p.num_hidden_layers - p.first_k_dense_replace
    inactive = (
        moe_layers
        * (p.n_routed_experts - p.num_experts_per_tok)
        * 3
        * p.hidden_size
        * p.moe_intermediate_size
    )
    return {"main": main, "mtp": extra, "total": main + extra, "main_active_per_token": main - inactive}


# --- output --------------------------------------------------------------------------------------


def plot_losses(record: dict[str, Any], path: Path) -> None:
    """loss.png: per-step train losses (faint) with their moving average, and the validation points."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    h, v = record["history"], record["val"]
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
    for key, color, label in (
        ("train_main", "tab:blue", "train (next token)"),
        ("train_mtp", "tab:orange", "train MTP (token after next)"),
    ):
        ys = h[key]
        avg = [sum(ys[max(0, i - 9) : i + 1]) / (i + 1 - max(0, i - 9)) for i in range(len(ys))]
        ax.plot(h["step"], ys, color=color, alpha=0.25, linewidth=0.8)
        ax.plot(h["step"], avg, color=color, label=label)
    ax.plot(v["step"], v["main"], "o-", color="tab:green", markersize=3, label="validation (next token)")
    ax.plot(v["step"], v["mtp"], "s-", color="tab:red", markersize=3, label="validation MTP")
    m = record["model"]
    ax.set_title(
        f"pdserve-tiny: {m['total'] / 1e6:.1f}M params (MTP {m['mtp'] / 1e6:.1f}M), "
        f"{record['tokens_seen'] / 1e6:.2f}M tokens, {record['wall_time_s'] / 60:.1f} min on {record['hardware']['torch_threads']} threads"
    )
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, metadata={"Software": None})
    plt.close(fig)


def _hardware(threads: int) -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(
            line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")
        )
    except (OSError, StopIteration):
        pass
    return {
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "torch_threads": threads,
        "platform": platform.platform(),
    }


def write_folder(result: TrainResult, out: str | Path, command: str) -> Path:
    """Write the checkpoint, tokenizer, training.json and loss.png to a temp folder, then install it at out."""
    out = Path(out).absolute()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        raw = result.config
        record = {
            "command": command,
            "date": datetime.now(UTC).isoformat(timespec="seconds"),
            "hardware": _hardware(result.record["train_config"]["threads"]),
            "versions": {
                "python": platform.python_version(),
                "torch": torch.__version__,
                "transformers": transformers.__version__,
                "tokenizers": tokenizers.__version__,
            },
            **result.record,
        }
        result.tokenizer.save(str(tmp / "tokenizer.json"))
        _json(tmp / "tokenizer_config.json", tokenizer_config(raw["max_position_embeddings"]))
        _json(tmp / "generation_config.json", generation_config())
        save_file(
            checkpoint_tensors(result.model, result.mtp),
            str(tmp / "model.safetensors"),
            metadata={"format": "pt"},
        )
        _json(tmp / "training.json", record)
        plot_losses(record, tmp / "loss.png")
        _json(tmp / "config.json", raw)
        install(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # no-op after a successful rename
    return out


def install(tmp: Path, out: Path) -> None:
    """Give the finished folder the usual umask modes (mkdtemp made it 0700) and rename it to out."""
    umask = os.umask(0)
    os.umask(umask)
    tmp.chmod(0o777 & ~umask)
    for f in tmp.iterdir():
        f.chmod(0o666 & ~umask)
    _replace(tmp, out)


def _json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=False, ensure_ascii=False) + "\n", encoding="utf-8")


def steps_for_minutes(minutes: float) -> int:
    """The fixed step count --minutes stands for (not a wall-clock limit: runs must be reproducible)."""
    if minutes <= 0:
        raise ValueError(f"minutes must be > 0, got {minutes}")
    return max(1, round(minutes * 60 / SECONDS_PER_STEP))


def run(args: argparse.Namespace, command: str) -> Path:
    steps = args.steps if args.steps is not None else steps_for_minutes(args.minutes)
    cfg = replace(TrainConfig(), steps=steps, seed=args.seed, threads=args.threads)
    result = train(cfg, max_wall_s=args.max_minutes * 60)
    out = write_folder(result, args.out, command)
    logger.info("wrote %s in %.1f min: %s", out, result.record["wall_time_s"] / 60, result.record["final"])
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    train_run = run
    if args.arch == "v4":
        from modelkit.training.train_tiny_v4 import run as train_run
    train_run(
        args,
        shlex.join(
            ["python", "-m", "modelkit.training.train_tiny", *(sys.argv[1:] if argv is None else argv)]
        ),
    )


if __name__ == "__main__":
    main()
