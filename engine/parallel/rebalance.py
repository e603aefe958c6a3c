"""Building a rank's expert parallelism, and EPLB applied live.

Every `eplb_interval` steps all ranks (in lockstep) sum their per-expert token counts over the
window, compute the same new placement with DeepSeek's algorithm (eplb.py), and move expert
weights between ranks with point-to-point sends; then the new placement takes effect for the
next step. No request is touched: the KV cache and the batch stay where they are.
"""

from __future__ import annotations

import logging
from collections import deque

import torch
import torch.distributed as dist

from engine.config import EngineConfig, ModelConfig
from engine.parallel.ep_moe import ExpertParallel
from engine.parallel.groups import ParallelGroup
from engine.parallel.placement import ExpertPlacement

logger = logging.getLogger(__name__)


def make_expert_parallel(cfg: EngineConfig, model_cfg: ModelConfig, group: ParallelGroup) -> ExpertParallel:
    moe_layers = [i for i in range(model_cfg.num_hidden_layers) if model_cfg.is_moe_layer(i)]
    num_experts = model_cfg.n_routed_experts
    if not moe_layers or not num_experts:
        raise ValueError("enable_expert_parallel needs a model with routed experts")
    if cfg.expert_placement_file:
        placement = ExpertPlacement.from_file(
            cfg.expert_placement_file, len(moe_layers), num_experts, group.size
        )
    else:
        physical = num_experts + cfg.num_redundant_experts
        if physical % group.size:
            raise ValueError(
                f"{num_experts} experts + num_redundant_experts ({cfg.num_redundant_experts}) = {physical} "
                f"must divide over the {group.size} expert-parallel ranks"
            )
        placement = ExpertPlacement.round_robin(
            len(moe_layers), num_experts, cfg.num_redundant_experts, group.size
        )
    return ExpertParallel(group, placement, moe_layers, track_load=cfg.eplb_interval > 0)


def rank_loads(load: torch.Tensor, placement: ExpertPlacement) -> torch.Tensor:
    """load [L, E] tokens per logical expert -> [L, ranks] tokens per rank, each expert's tokens
    split evenly over its replicas (as the round-robin replica choice does)."""
    per_replica = load.double() / placement.logcnt.double()  # [L, E]
    per_slot = torch.gather(per_replica, 1, placement.phy2log)  # [L, R]
    return per_slot.view(placement.num_layers, placement.num_ranks, -1).sum(-1)


def balance_ratio(load: torch.Tensor, placement: ExpertPlacement) -> float:
    """max / mean tokens per rank, over all MoE layers (1.0 is perfect)."""
    ranks = rank_loads(load, placement)  # [L, ranks]
    mean = ranks.mean(dim=1).clamp_min(1e-9)
    return float((ranks.max(dim=1).values / mean).mean())


class Rebalancer:
    def __init__(self, ep: ExpertParallel, model: torch.nn.Module, cfg: EngineConfig):
        self.ep = ep
        self.model = model
        self.interval = cfg.eplb_interval
        self.window: deque[torch.Tensor] = deque(
            maxlen=max(1, cfg.eplb_window // cfg.eplb_interval) if cfg.eplb_window else 1
        )
        self.steps = 0
        self.num_rebalances = 0
        self.last_ratio: tuple[float, float] | None = None
        """Balance ratio (max/mean tokens per rank) of the window before and after the last rebalance."""
        self.last_rank_load: list[float] = []
        self.num_groups = self._groups(ep, model)

    @staticmethod
    def _groups(ep: ExpertParallel, model) -> int:
        n_group = getattr(model.cfg, "n_group", 1) or 1
        return n_group if ep.placement.num_logical % n_group == 0 else 1

    def after_step(self) -> None:
        self.steps += 1
        if self.steps % self.interval == 0:
            self.rebalance()

    def rebalance(self) -> None:
        from engine.parallel.eplb import rebalance_experts

        group, old = self.ep.group, self.ep.placement
        self.window.append(self.ep.take_load())
        load = group.all_reduce_sum(torch.stack(list(self.window)).sum(0))  # [L, E] the same on every rank
        if load.sum() == 0:
            return
        phy2log, _, _ = rebalance_experts(load.float(), old.num_physical, self.num_groups, 1, group.size)
        new = ExpertPlacement.from_phy2log(phy2log, old.num_logical, group.size)
        before, after = balance_ratio(load, old), balance_ratio(load, new)
        self.last_ratio = (before, after)
        self.last_rank_load = rank_loads(load, new).sum(0).tolist()
        if torch.equal(new.phy2log, old.phy2log):
            return
        self._move_weights(old, new)
        self.ep.placement = new
        self.num_rebalances += 1
        logger.info("EPLB: rebalanced experts, balance ratio %.3f -> %.3f", before, after)

    def _moe_modules(self):
        for layer_idx in sorted(self.ep.moe_index):
            yield self.ep.moe_index[layer_idx], self.model.layers[layer_idx].mlp.experts

    @torch.inference_mode()
    def _move_weights(self, old: ExpertPlacement, new: ExpertPlacement) -> None:
        """Every rank runs the same plan: a slot whose expert changes takes it from a local slot
        if it has one, else from the lowest-numbered rank that held it."""
        rank, size, slots = self.ep.group.rank, self.ep.group.size, old.slots_per_rank
        for moe, experts in self._moe_modules():
            # Bytes: float8 weights (and e8m0 scales) travel as what they are; gloo has no float8.
            params = tuple(p.detach().view(torch.uint8) for p in experts.slot_params())
            before = [p.clone() for p in params]  # sources stay intact while slots change
            ops, received = [], []
            old_row, new_row = old.phy2log[moe].tolist(), new.phy2log[moe].tolist()
            for dst in range(size):
                for s in range(slots):
                    p = dst * slots + s
                    expert = new_row[p]
                    if old_row[p] == expert:
                        continue
                    local = [q for q in range(dst * slots, (dst + 1) * slots) if old_row[q] == expert]
                    if local:
                        if dst == rank:
                            for param, src in zip(params, before, strict=True):
                                param[s].copy_(src[local[0] - dst * slots])
                        continue
                    q = old_row.index(expert)  # it has at least one replica somewhere
                    src_rank = q // slots
                    for k, (param, src) in enumerate(zip(params, before, strict=True)):
                        tag = ((moe * size + dst) * slots + s) * len(params) + k
                        if rank == src_rank:
                            ops.append(
                                dist.P2POp(dist.isend, src[q - src_rank * slots].contiguous(), dst, tag=tag)
                            )
                        if rank == dst:
                            buf = torch.empty_like(param[s])
                            ops.append(dist.P2POp(dist.irecv, buf, src_rank, tag=tag))
                            received.append((param, s, buf))
            if ops:
                for req in dist.batch_isend_irecv(ops):
                    req.wait()
            for param, s, buf in received:
                param[s].copy_(buf)
