"""Expert-parallel MoE: dispatch tokens to the ranks that own their experts, compute, combine.

For one MoE layer on one rank, with T local tokens routed top-K:

    pairs (token, k) [T*K] -> physical slot (a replica of the logical expert) -> owning rank
    1. sort pairs by owning rank; exchange per-rank counts (all_to_all of [world] ints)
    2. all_to_all the pairs' hidden rows and their slot ids on the owner
    3. the owner runs every received row through its local expert (fused_moe with top-1, weight 1)
    4. all_to_all the results back in the same order
    5. out[token] += routing weight * result, in float32

The routing weights never travel. The result equals the single-process layer up to the order of
the top-K sum. Every rank calls this once per MoE layer per step (a rank without work runs a
dummy batch), so the collectives always match. Tokens per logical expert are counted for EPLB.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.parallel.groups import ParallelGroup
from engine.parallel.placement import ExpertPlacement
from kernels.moe import fused_moe


class ExpertParallel:
    """Owned by one rank's model runner; only the engine thread calls it."""

    def __init__(
        self,
        group: ParallelGroup,
        placement: ExpertPlacement,
        moe_layers: list[int],
        track_load: bool = False,
    ):
        """track_load: count tokens per logical expert (EPLB needs them; the step skips it otherwise)."""
        if placement.num_ranks != group.size:
            raise ValueError(f"placement is for {placement.num_ranks} ranks, the group has {group.size}")
        if placement.num_layers != len(moe_layers):
            raise ValueError(
                f"placement has {placement.num_layers} layers, the model {len(moe_layers)} MoE layers"
            )
        self.group = group
        self.placement = placement
        self.moe_index = {layer: i for i, layer in enumerate(moe_layers)}
        """Model layer index -> MoE layer index (the placement's row)."""
        self.track_load = track_load
        self.load = torch.zeros(
            placement.num_layers, placement.num_logical, dtype=torch.int64, device=group.device
        )
        """Tokens routed to each logical expert by this rank since the counters were last taken,
        kept on the device so counting never syncs the step."""

    @property
    def placement(self) -> ExpertPlacement:
        return self._placement

    @placement.setter
    def placement(self, placement: ExpertPlacement) -> None:
        self._placement = placement
        self._on_device = placement.to(self.group.device)  # what every MoE layer reads each step

    @property
    def slots_per_rank(self) -> int:
        return self.placement.slots_per_rank

    def local_experts(self, layer: int) -> list[int]:
        """Logical expert of each local slot of model layer `layer`."""
        return self.placement.local_experts(self.moe_index[layer], self.group.rank)

    def take_load(self) -> torch.Tensor:
        load, self.load = self.load, torch.zeros_like(self.load)
        return load.cpu()

    def forward(
        self,
        layer: int,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        w13: torch.Tensor,
        w2: torch.Tensor,
        experts: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """x [T, H], topk_weights/topk_ids [T, K] (logical ids), w13/w2 the local slots -> [T, H].
        experts(rows [M, H], slots [M, 1]) -> [M, H]: each row through its local slot's expert
        (default: fused_moe's SwiGLU; DeepSeek-V4 gives its clamped one)."""
        moe = self.moe_index[layer]
        num_tokens, top_k = topk_ids.shape
        flat_ids = topk_ids.reshape(-1)  # [T*K]
        if self.track_load:
            self.load[moe] += torch.bincount(flat_ids, minlength=self.placement.num_logical)
        phys = self._on_device.physical(moe, flat_ids)  # [T*K]
        owner = phys // self.slots_per_rank
        order = torch.argsort(owner, stable=True)  # pairs grouped by owning rank
        send_counts = torch.bincount(owner, minlength=self.group.size)  # [world]
        recv_counts = self.group.exchange_counts(send_counts)
        send_list, recv_list = send_counts.tolist(), recv_counts.tolist()

        rows = self.group.all_to_all(x[order // top_k], send_list, recv_list)  # [M, H]
        slots = self.group.all_to_all((phys[order] % self.slots_per_rank).unsqueeze(1), send_list, recv_list)
        if rows.shape[0] and experts is not None:
            computed = experts(rows, slots)
        elif rows.shape[0]:
            ones = torch.ones(rows.shape[0], 1, dtype=torch.float32, device=x.device)
            computed = fused_moe(rows, w13, w2, ones, slots)  # [M, H]
        else:
            computed = rows
        back = self.group.all_to_all(computed, recv_list, send_list)  # [T*K, H] in `order`

        weights = topk_weights.reshape(-1)[order].unsqueeze(1)  # [T*K, 1] float32
        out = torch.zeros(num_tokens, x.shape[1], dtype=torch.float32, device=x.device)
        out.index_add_(0, order // top_k, back.float() * weights)
        return out.to(x.dtype)
