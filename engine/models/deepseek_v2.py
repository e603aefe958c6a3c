"""DeepSeek-V2 and DeepSeek-V3 causal LMs (one class: V3 is V2 with sigmoid, bias-corrected routing).

Layer i: h += MLA(RMSNorm(h)); h += FFN(RMSNorm(h)) (each add fused into the next norm), where FFN is a dense SwiGLU MLP for the
first `first_k_dense_replace` layers and a DeepSeekMoE block after. The forward works on the
flat batch (see engine/forward_batch.py), never on padded [B, T] tensors.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from engine.config import ModelConfig
from engine.forward_batch import ForwardBatch
from engine.kv_cache.cache_group import CacheKind
from engine.kv_cache.spec import KVCaches, KVCacheSpec, mla_spec
from engine.models.layers import Embedding, GatedMLP, Linear, RMSNorm
from engine.models.mla import MLAttention
from engine.models.moe import DeepseekMoE
from engine.models.mtp import make_mtp_layer
from engine.models.registry import register_model
from engine.quant import QuantSpec
from engine.sampler import argmax
from kernels import native
from kernels.linear import FEW_ROWS, linear
from kernels.rotary import rope_cos_sin_cache


class DecoderLayer(nn.Module):
    attention = MLAttention
    """The attention block's class (DeepSeek-V3.2's layers subclass this with its sparse MLA)."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, *, dtype: torch.dtype, ep=None):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.self_attn = self.attention(cfg, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.mlp = (
            DeepseekMoE(cfg, dtype=dtype, layer_idx=layer_idx, ep=ep)
            if cfg.is_moe_layer(layer_idx)
            else GatedMLP(cfg.hidden_size, cfg.intermediate_size, dtype=dtype, quant=QuantSpec.of(cfg.quant))
        )

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        cos,
        sin,
        batch: ForwardBatch,
        kv_cache,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous sublayer's output, residual: the stream before it (None for layer 0).
        Each residual add is fused into the following RMSNorm. -> (mlp output, residual stream)."""
        if self.self_attn.takes_in_one_call(batch, x.shape[0], kv_cache):  # both norms in the call too
            norms = (self.input_layernorm, self.post_attention_layernorm)
            x, residual = self.self_attn.one_call(x, cos, sin, batch, kv_cache, norms, residual)
            return self.mlp(x), residual
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, cos, sin, batch, kv_cache)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


@register_model("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
class DeepseekV2ForCausalLM(nn.Module):
    decoder_layer = DecoderLayer
    """The class of the main decoder layers (DeepSeek-V3.2 sets its own)."""

    @staticmethod
    def kv_cache_spec(
        cfg: ModelConfig, *, num_mtp_layers: int, block_size: int, dtype: torch.dtype, fingerprint: str
    ) -> KVCacheSpec:
        """What the model's KV cache holds: every layer's MLA latent row per token, and the MTP
        layers' (model layers num_hidden_layers + j) when drafting."""
        return mla_spec(
            num_layers=cfg.num_hidden_layers,
            num_mtp_layers=num_mtp_layers,
            block_size=block_size,
            kv_lora_rank=cfg.kv_lora_rank,
            rope_dim=cfg.qk_rope_head_dim,
            dtype=dtype,
            fingerprint=fingerprint,
        )

    def __init__(
        self, cfg: ModelConfig, *, dtype: torch.dtype, max_positions: int, ep=None, num_mtp_layers: int = 0
    ):
        """ep: an engine.parallel.ep_moe.ExpertParallel when the routed experts are spread over ranks.
        num_mtp_layers: build (and load) the checkpoint's MTP layers, for speculative decoding."""
        super().__init__()
        self.cfg = cfg
        self.dtype = dtype
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(
            self.decoder_layer(cfg, i, dtype=dtype, ep=ep) for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, dtype=dtype)
        if num_mtp_layers and ep is not None:
            raise ValueError("MTP speculative decoding with expert parallelism is not supported yet")
        self.mtp = nn.ModuleList(
            make_mtp_layer(self.decoder_layer, cfg, cfg.num_hidden_layers + j, dtype)
            for j in range(num_mtp_layers)
        )
        cos, sin = rope_cos_sin_cache(cfg.rope, cfg.qk_rope_head_dim, max_positions)
        self.register_buffer("rope_cos", cos, persistent=False)  # [P, R/2] float32
        self.register_buffer("rope_sin", sin, persistent=False)
        self.native_stack: native.DecodeStack | None = None  # the one-call decode's, set by process_weights
        self.mtp_stack: native.DecodeStack | None = None  # the first MTP layer's, after its input
        self.mtp_drafter: native.MTPDrafter | None = None  # greedy_spec_step's, with both stacks
        self.draft_ids: torch.Tensor | None = None  # a draft vocabulary's tokens (use_draft_vocab)
        self.draft_head: torch.Tensor | None = None  # [len(draft_ids), H]: their LM head rows

    def process_weights(
        self, place: Callable[[torch.Tensor], torch.Tensor] = torch.Tensor.contiguous
    ) -> None:
        """Derive the kernels' forms of the loaded weights; place(t): a contiguous copy of t where
        derived weights live (WeightArena.place)."""
        for layer in [*self.layers, *self.mtp]:
            layer.self_attn.process_weights(place)
            if isinstance(layer.mlp, DeepseekMoE):
                layer.mlp.process_weights()
        self.native_stack = self._native_stack(self.layers, self.norm)
        if self.mtp:
            self.mtp_stack = self._native_stack(self.mtp[:1], self.mtp[0].shared_head.norm)
            self.mtp_drafter = self._mtp_drafter()

    def _mtp_drafter(self) -> native.MTPDrafter | None:
        """The first MTP layer and the LM head as greedy_spec_step takes them, where both stacks run
        natively and the weights are taken as they are."""
        mtp, lm_head = self.mtp[0], self.lm_head.weight
        if self.native_stack is None or self.mtp_stack is None:
            return None
        if not all(native.takes(t) and t.is_contiguous() for t in (mtp.eh_proj.weight, lm_head)):
            return None
        return native.MTPDrafter(
            self.mtp_stack,
            (mtp.enorm.weight, mtp.enorm.eps),
            (mtp.hnorm.weight, mtp.hnorm.eps),
            mtp.eh_proj.weight,
            lm_head,
            self.cfg.vocab_size,
            self.rope_cos,
            self.rope_sin,
            self.draft_head,
            self.draft_ids,
        )

    def use_draft_vocab(self, token_ids: torch.Tensor) -> None:
        """Draft from these tokens alone (int64 [N], each in [0, vocab)): the MTP layer's argmax
        reads the logits of their LM head rows, copied here as draft_head [N, H], instead of the
        whole vocabulary's (FR-Spec's frequency-ranked drafting, SGLang's speculative token map). A
        draft outside them is never proposed; the verification keeps every output token the
        target's."""
        if self.draft_ids is not None:
            raise ValueError("a draft vocabulary is already in use")
        weight = self.lm_head.weight
        self.draft_ids = token_ids.to(device=weight.device, dtype=torch.long).contiguous()
        self.draft_head = weight[self.draft_ids].contiguous()
        if self.mtp_drafter is not None:
            self.mtp_drafter = self._mtp_drafter()

    def _native_stack(self, decoder_layers, norm: RMSNorm) -> native.DecodeStack | None:
        """Decoder layers and the norm after them as one native call (native.decode_stack) for a
        decode step's few tokens, where every layer's attention and MLP take the native kernels as
        they are."""
        layers = []
        for layer in decoder_layers:
            mlp = layer.mlp
            if isinstance(mlp, DeepseekMoE):
                mlp_weights = mlp.native_weights
            else:
                mlp_weights = (mlp.gate_up_proj.w, mlp.down_proj.w)
                if not all(native.takes_weight(w) for w in mlp_weights):
                    mlp_weights = None
            if layer.self_attn.native_weights is None or mlp_weights is None:
                return None
            norms = [(n.weight, n.eps) for n in (layer.input_layernorm, layer.post_attention_layernorm)]
            layers.append(native.StackLayer(layer.self_attn.native_weights, *norms, mlp_weights))
        if not native.takes(self.embed_tokens.weight, norm.weight):
            return None
        return native.DecodeStack(layers, self.embed_tokens.weight, (norm.weight, norm.eps))

    def runs_in_one_call(self, batch: ForwardBatch, kv_caches: KVCaches) -> bool:
        """Whether this step runs the whole stack as one native call: decode tokens of one query
        length, as many as the native products take (native.max_rows(): FEW_ROWS through
        VDPBF16PS, AMX_ROWS on the AMX tile unit, any number through VDPBF16PS's emulation)."""
        return self._takes(self.native_stack, batch, kv_caches.layer(CacheKind.LATENT, 0))

    def _takes(self, stack: native.DecodeStack | None, batch: ForwardBatch, cache: torch.Tensor) -> bool:
        n = batch.input_ids.shape[0]
        if stack is None or batch.prefills or len(batch.decodes) != 1 or not n:
            return False
        return native.takes(cache) and stack.takes_rows(n)

    def mtp_forward(
        self, next_ids: torch.Tensor, hidden: torch.Tensor, batch: ForwardBatch, kv_cache: torch.Tensor
    ) -> torch.Tensor:
        """The first MTP layer over the batch: next_ids [N] (t_{i+1}), hidden [N, H] (h_i, after
        the final norm) -> g [N, H]; compute_logits(g) predicts t_{i+2}."""
        cos, sin = self.rope_cos[batch.positions], self.rope_sin[batch.positions]
        latent, keys = self.mtp[0].self_attn.split_cache(kv_cache)
        if self._takes(self.mtp_stack, batch, latent):  # its input, then the layer and norm in one call
            u = self.mtp[0].layer_input(next_ids, hidden, self.embed_tokens)
            tables, lens = batch.decodes[0].per_token
            return native.decode_stack(
                self.mtp_stack, None, cos, sin, [latent], batch.slot_mapping, tables, lens, u,
                key_caches=None if keys is None else [keys],
            )  # fmt: skip
        return self.mtp[0].draft(next_ids, hidden, self.embed_tokens, cos, sin, batch, kv_cache)

    def greedy_spec_step(
        self, batch: ForwardBatch, kv_caches: KVCaches, caps: list[int], k: int
    ) -> tuple[list[int], list[int], list[list[int]]] | None:
        """A greedy speculative decode step (the forward, each row's greedy token, the acceptance and
        the MTP layer's cache rows and drafts) as one native call (native.greedy_spec_step), for a
        batch of decodes of one query length (kv_caches: the layers' latent caches and the MTP
        layer's) -> (tokens, accepted, drafts) as lists, or None: the step takes forward,
        greedy_tokens and mtp_forward one by one."""
        drafter = self.mtp_drafter
        if drafter is None or not self.runs_in_one_call(batch, kv_caches):
            return None
        group = batch.decodes[0]
        tables, lens = group.per_token
        mtp_latent, mtp_keys = self.mtp[0].self_attn.split_cache(self.mtp_cache(kv_caches))
        result = native.greedy_spec_step(
            self.native_stack, drafter, batch.input_ids, batch.positions, kv_caches.group(CacheKind.LATENT),
            mtp_latent, batch.slot_mapping, tables, lens, group.query_len, caps, k,
            key_caches=self.stack_key_caches(kv_caches), mtp_key_cache=mtp_keys,
        )  # fmt: skip
        return tuple(t.tolist() for t in result)

    def mtp_store_kv(
        self,
        next_ids: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        kv_cache: torch.Tensor,
    ) -> None:
        """The first MTP layer's cache rows at positions (cache slots `slots`), from next_ids [N]
        and hidden [N, H] as in mtp_forward, without computing its output."""
        cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        self.mtp[0].store_kv(next_ids, hidden, self.embed_tokens, cos, sin, slots, kv_cache)

    def mtp_cache(self, kv_caches: KVCaches) -> torch.Tensor:
        """The first MTP layer's cache (model layer num_hidden_layers, as the checkpoint numbers it)."""
        return kv_caches.layer(CacheKind.MTP_LATENT, len(self.layers))

    def stack_key_caches(self, kv_caches: KVCaches) -> list[torch.Tensor] | None:
        """The layers' indexer-key caches as decode_stack takes them (DeepSeek-V3.2's), or None."""
        return None

    def layer_caches(self, kv_caches: KVCaches) -> list:
        """What each decoder layer's attention takes as its cache: its latent cache."""
        return kv_caches.group(CacheKind.LATENT)

    def forward(self, batch: ForwardBatch, kv_caches: KVCaches) -> torch.Tensor:
        """-> hidden states [N, hidden] after the final norm."""
        cos, sin = self.rope_cos[batch.positions], self.rope_sin[batch.positions]
        if self.runs_in_one_call(batch, kv_caches):
            tables, lens = batch.decodes[0].per_token
            ids, slots, layer_caches = batch.input_ids, batch.slot_mapping, kv_caches.group(CacheKind.LATENT)
            return native.decode_stack(
                self.native_stack, ids, cos, sin, layer_caches, slots, tables, lens,
                key_caches=self.stack_key_caches(kv_caches),
            )  # fmt: skip
        x, residual = self.embed_tokens(batch.input_ids), None
        for layer, kv_cache in zip(self.layers, self.layer_caches(kv_caches), strict=True):
            x, residual = layer(x, residual, cos, sin, batch, kv_cache)
        return self.norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [M, hidden] -> logits [M, vocab] float32."""
        if hidden.shape[0] >= FEW_ROWS and hidden.device.type == "cpu" and hidden.dtype == torch.float32:
            # Linear takes x @ w^T from FEW_ROWS rows on; in float32 the LM head's [V, H] @ [H, M]
            # still ran ~1.8x faster (2-core EPYC). In bf16 it is the other way round: x @ w^T took
            # 2.35 / 6.7 / 17.7 ms at 16 / 64 / 256 rows against 6.4 / 17.8 / 68.5 (2-core Xeon, AMX).
            return torch.mm(self.lm_head.weight, hidden.t()).t().float().contiguous()
        return self.lm_head(hidden).float()

    def greedy_tokens(self, hidden: torch.Tensor, vocab_size: int) -> list[int]:
        """hidden [M, hidden] -> argmax(compute_logits(hidden)[:, :vocab_size]) per row, from the
        bf16 logits where the native kernels take them (widening to float32 is exact, so the
        tokens are the same; at 256 rows of a 32k vocabulary the widening and torch's max took
        ~10 ms, the native argmax ~1)."""
        if native.loaded() and native.takes(hidden, self.lm_head.weight):
            return native.argmax_bf16(self.lm_head(hidden)[:, :vocab_size]).tolist()  # [M, V] bf16
        return argmax(self.compute_logits(hidden)[:, :vocab_size]).tolist()

    def draft_tokens(self, hidden: torch.Tensor, vocab_size: int) -> list[int]:
        """The MTP layer's greedy drafts from its outputs hidden [M, hidden]: greedy_tokens, or with
        a draft vocabulary (use_draft_vocab) the argmax of its tokens' logits alone, as token ids."""
        if self.draft_head is None:
            return self.greedy_tokens(hidden, vocab_size)
        logits = linear(hidden, self.draft_head)  # [M, N]
        if native.loaded() and native.takes(logits):
            best = native.argmax_bf16(logits)
        else:
            best = argmax(logits.float())
        return self.draft_ids[best].tolist()
