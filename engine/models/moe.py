"""DeepSeek MoE block: a router picks top-k routed experts per token, plus always-on shared experts."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from engine.config import ModelConfig
from engine.models.layers import GatedMLP, _param
from engine.quant import QuantSpec
from kernels import native
from kernels.gate import grouped_topk
from kernels.mla import NATIVE_MAX_BATCH
from kernels.moe import fused_moe
from kernels.quant import QuantWeight

if TYPE_CHECKING:
    from engine.parallel.ep_moe import ExpertParallel


class MoEGate(nn.Module):
    """Router weights kept in float32, as the reference computes routing in float32."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        assert cfg.n_routed_experts is not None
        self.weight = _param(cfg.n_routed_experts, cfg.hidden_size, dtype=torch.float32)
        self.e_score_correction_bias = (
            _param(cfg.n_routed_experts, dtype=torch.float32) if cfg.topk_method == "noaux_tc" else None
        )


class FusedExperts(nn.Module):
    def __init__(
        self, num_experts: int, hidden: int, inter: int, *, dtype: torch.dtype, quant: QuantSpec | None = None
    ):
        """quant: the weights kept as the checkpoint stores them (w13 / w2 their data, w13_scale /
        w2_scale their scales); None: plain in dtype."""
        super().__init__()
        self.quant = quant
        if quant is None:
            self.w13 = _param(num_experts, 2 * inter, hidden, dtype=dtype)  # gate rows, then up rows
            self.w2 = _param(num_experts, hidden, inter, dtype=dtype)
            return
        (rows13, cols13), (_, scales13) = quant.shapes(2 * inter, hidden)
        (rows2, cols2), (_, scales2) = quant.shapes(hidden, inter)
        self.w13 = _param(num_experts, rows13, cols13, dtype=quant.data_dtype)
        self.w13_scale = _param(num_experts, rows13, scales13, dtype=quant.scale_dtype)
        self.w2 = _param(num_experts, rows2, cols2, dtype=quant.data_dtype)
        self.w2_scale = _param(num_experts, rows2, scales2, dtype=quant.scale_dtype)

    def slot_params(self) -> tuple[torch.Tensor, ...]:
        """Every tensor with one entry per expert slot (EPLB moves an expert's entries together:
        its weights and, when quantized, their scales)."""
        if self.quant is None:
            return self.w13, self.w2
        return self.w13, self.w13_scale, self.w2, self.w2_scale

    def weights(self) -> tuple[torch.Tensor | QuantWeight, torch.Tensor | QuantWeight]:
        """(w13, w2) as the kernels take them: the tensors, or QuantWeights over data and scales."""
        if self.quant is None:
            return self.w13, self.w2
        return self.quant.weight(self.w13, self.w13_scale), self.quant.weight(self.w2, self.w2_scale)


class DeepseekMoE(nn.Module):
    def __init__(
        self, cfg: ModelConfig, *, dtype: torch.dtype, layer_idx: int = 0, ep: ExpertParallel | None = None
    ):
        """ep: expert parallelism; this rank then holds only its slots of the routed experts."""
        super().__init__()
        assert cfg.n_routed_experts is not None
        self.cfg = cfg
        self.layer_idx = layer_idx
        self.ep = ep
        self.gate = MoEGate(cfg)
        num_local = ep.slots_per_rank if ep is not None else cfg.n_routed_experts
        self.experts = FusedExperts(
            num_local,
            cfg.hidden_size,
            cfg.moe_intermediate_size,
            dtype=dtype,
            quant=QuantSpec.of(cfg.quant, experts=True),
        )
        self.shared_experts = (
            GatedMLP(
                cfg.hidden_size,
                cfg.moe_intermediate_size * cfg.n_shared_experts,
                dtype=dtype,
                quant=QuantSpec.of(cfg.quant),
            )
            if cfg.n_shared_experts
            else None
        )
        # V2's plain "greedy" routing ignores groups even when the config names some.
        self.n_group = 1 if cfg.topk_method == "greedy" else cfg.n_group
        self.topk_group = self.n_group if cfg.topk_method == "greedy" else cfg.topk_group
        # HF's V2 never renormalises the top-k weights; V3 and V3.2 do when norm_topk_prob.
        self.norm_topk_prob = cfg.norm_topk_prob and cfg.model_type != "deepseek_v2"
        self.native_weights: native.MoEWeights | None = None  # the one-call decode's, set by process_weights

    def process_weights(self) -> None:
        """The one-call native MoE of a decode step's few tokens (native.moe_block), where the
        kernels take the experts as they are (bf16, or kept quantized) and this rank holds them all."""
        shared = self.shared_experts
        shared_weights = None if shared is None else (shared.gate_up_proj.w, shared.down_proj.w)
        w13, w2 = self.experts.weights()
        if self.ep is not None or not native.loaded():
            return
        if not all(native.takes_weight(w) for w in (w13, w2, *(shared_weights or ()))):
            return
        if not self.gate.weight.is_contiguous():
            return
        self.native_weights = native.MoEWeights(
            gate=self.gate.weight,
            bias=self.gate.e_score_correction_bias,
            softmax=self.cfg.scoring_func == "softmax",
            n_group=self.n_group,
            topk_group=self.topk_group,
            top_k=self.cfg.num_experts_per_tok,
            norm_topk_prob=self.norm_topk_prob,
            routed_scaling_factor=self.cfg.routed_scaling_factor,
            w13=w13,
            w2=w2,
            shared=shared_weights,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, hidden] -> [N, hidden]."""
        if self.native_weights is not None and x.shape[0] <= NATIVE_MAX_BATCH and native.takes(x):
            return native.moe_block(x, self.native_weights)  # the whole path below in one native call
        cfg = self.cfg
        router_logits = torch.nn.functional.linear(x.float(), self.gate.weight)  # [N, E]
        topk_weights, topk_ids = grouped_topk(
            router_logits,
            self.gate.e_score_correction_bias,
            self.n_group,
            self.topk_group,
            cfg.num_experts_per_tok,
            self.norm_topk_prob,
            cfg.routed_scaling_factor,
            scoring=cfg.scoring_func,
        )
        shared = self.shared_experts
        w13, w2 = self.experts.weights()
        if self.ep is not None:
            out = self.ep.forward(self.layer_idx, x, topk_weights, topk_ids, w13, w2)
            return out if shared is None else out + shared(x)
        return fused_moe(
            x,
            w13,
            w2,
            topk_weights,
            topk_ids,
            shared=None if shared is None else (shared.gate_up_proj.w, shared.down_proj.w),
        )
