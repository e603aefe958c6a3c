"""Expert-parallel load balancing (EPLB): which experts to replicate and where to put the replicas.

This is DeepSeek's published algorithm (github.com/deepseek-ai/EPLB), written afresh. Given a load
estimate w[l, e] per MoE layer l and logical expert e (tokens routed to it, e.g. a moving average),
and R physical expert slots per layer spread over the EP ranks, it chooses

* a replica count c[e] >= 1 with sum_e c[e] = R. A token for expert e may go to any replica, so
  each replica carries w[e] / c[e]. Handing the next extra replica to the expert with the largest
  w[e] / c[e] (and repeating) minimises max_e w[e] / c[e], the heaviest single replica;
* a placement of the R replicas on the GPUs, each GPU taking exactly R / num_gpus of them, by
  "balanced packing": items in descending load order, each to the lightest pack that still has a
  free place (greedy longest-processing-time with a cardinality limit).

Hierarchical policy (num_groups % num_nodes == 0). DeepSeek-V3 routes each token to experts of at
most a few expert groups, so keeping a group's experts on one node keeps most token traffic on
the fast intra-node links. (1) Pack the expert groups onto nodes by group load, num_groups /
num_nodes groups per node; (2) within each node, replicate its experts up to R / num_nodes slots;
(3) pack each node's replicas onto that node's GPUs. Global policy (otherwise): the same with one
group and one node, i.e. replicate over all experts and pack onto all GPUs.

Layout conventions (all tensors int64, on the CPU):

* physical slot p of a layer lives on GPU p // (R / num_gpus); GPU g on node g // (num_gpus /
  num_nodes), so node n owns slots [n * R / num_nodes, (n + 1) * R / num_nodes);
* phy2log[l, p]: logical expert held by slot p;
* logcnt[l, e]: number of slots holding expert e (>= 1; sums to R over e);
* log2phy[l, e, r]: slot of replica r of expert e for r < logcnt[l, e], -1 after; the last
  dimension is the largest replica count of any expert in any layer.

Ties are broken exactly as the reference breaks them, so both give the same plan: loads are
float32 and packed in the order of torch's default (unstable) descending sort, an extra replica
goes to the first expert with the largest per-replica load, an item goes to the first of the
equally light packs, and packing with one item per pack keeps items in place. The CPU sort keeps
equal loads in index order only for rows of at most 16 items; beyond that their order is torch's
own, fixed for a given torch build. So compute a plan once (or with one torch build everywhere)
and broadcast it rather than letting every rank compute its own.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["balance_ratio", "default_placement", "rebalance_experts"]


def rebalance_experts(
    weight: Tensor, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int
) -> tuple[Tensor, Tensor, Tensor]:
    """Plan replicas and placement for every layer from the load estimate `weight` [L, E].

    num_replicas (R) is the number of physical slots per layer, a multiple of num_gpus and at
    least E; num_groups must divide E (experts e in [g * E/G, (g+1) * E/G) form group g);
    num_nodes must divide num_gpus. Returns (phy2log [L, R], log2phy [L, E, max_replicas],
    logcnt [L, E]) as described in the module docstring. Hierarchical when num_groups %
    num_nodes == 0, global otherwise. Raises ValueError on bad arguments.
    """
    _check_args(weight, num_replicas, num_groups, num_nodes, num_gpus)
    w = weight.detach().float().cpu()  # [L, E]
    if num_groups % num_nodes == 0:
        phy2log, phyrank, logcnt = _rebalance_hierarchical(w, num_replicas, num_groups, num_nodes, num_gpus)
    else:
        phy2log, phyrank, logcnt = _rebalance_hierarchical(w, num_replicas, 1, 1, num_gpus)
    return phy2log, _build_log2phy(phy2log, phyrank, logcnt), logcnt


def default_placement(
    num_layers: int, num_experts: int, num_redundant: int, num_gpus: int
) -> tuple[Tensor, Tensor, Tensor]:
    """The static layout without load information: slots hold experts 0..E-1 in order, and the
    num_redundant extra slots hold experts 0, 1, 2, ... (wrapping round). Same triple as
    rebalance_experts, identical for every layer."""
    if num_layers < 1 or num_experts < 1 or num_gpus < 1:
        raise ValueError(
            f"num_layers ({num_layers}), num_experts ({num_experts}) and num_gpus ({num_gpus}) must be >= 1"
        )
    if num_redundant < 0:
        raise ValueError(f"num_redundant must be >= 0, got {num_redundant}")
    num_slots = num_experts + num_redundant
    if num_slots % num_gpus:
        raise ValueError(
            f"num_experts + num_redundant ({num_slots}) must be a multiple of num_gpus ({num_gpus})"
        )
    slots = torch.arange(num_slots, dtype=torch.int64)
    phy2log = (slots % num_experts).expand(num_layers, -1).contiguous()  # [L, R]
    phyrank = (slots // num_experts).expand(num_layers, -1).contiguous()  # [L, R]
    logcnt = torch.zeros(num_layers, num_experts, dtype=torch.int64)  # [L, E]
    logcnt.scatter_add_(1, phy2log, torch.ones_like(phy2log))
    return phy2log, _build_log2phy(phy2log, phyrank, logcnt), logcnt


def balance_ratio(load: Tensor, phy2log: Tensor, logcnt: Tensor, num_gpus: int) -> Tensor:
    """max / mean of the per-GPU load [L] when expert e's load [L, E] is split evenly over its
    logcnt[l, e] replicas and slot p sits on GPU p // (R / num_gpus). 1.0 is perfect balance; a
    layer with no load counts as balanced. `load` may differ from the estimate the plan was made
    from (plan on past traffic, score on new traffic)."""
    num_layers, num_slots = phy2log.shape
    if num_slots % num_gpus:
        raise ValueError(f"phy2log has {num_slots} slots, not a multiple of num_gpus ({num_gpus})")
    per_slot = (load.double() / logcnt).gather(-1, phy2log)  # [L, R]
    gpu_load = per_slot.view(num_layers, num_gpus, -1).sum(-1)  # [L, num_gpus]
    mean = gpu_load.mean(-1)  # [L]
    ratio = gpu_load.max(-1).values / mean.clamp_min(torch.finfo(mean.dtype).tiny)
    return torch.where(mean > 0, ratio, torch.ones_like(ratio))


def _check_args(weight: Tensor, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int) -> None:
    if weight.dim() != 2:
        raise ValueError(f"weight must be [num_layers, num_experts], got shape {tuple(weight.shape)}")
    num_experts = weight.shape[1]
    for name, value in (("num_groups", num_groups), ("num_nodes", num_nodes), ("num_gpus", num_gpus)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if num_experts < 1:
        raise ValueError("weight must have at least one expert (num_experts >= 1)")
    if num_replicas < num_experts:
        raise ValueError(f"num_replicas ({num_replicas}) must be >= num_experts ({num_experts})")
    if num_replicas % num_gpus:
        raise ValueError(f"num_replicas ({num_replicas}) must be a multiple of num_gpus ({num_gpus})")
    if num_gpus % num_nodes:
        raise ValueError(f"num_gpus ({num_gpus}) must be a multiple of num_nodes ({num_nodes})")
    if num_experts % num_groups:
        raise ValueError(f"num_experts ({num_experts}) must be a multiple of num_groups ({num_groups})")
    if weight.is_floating_point() and not bool(torch.isfinite(weight).all()):
        raise ValueError("weight must be finite")
    if bool((weight < 0).any()):
        raise ValueError("weight must be >= 0")


def _rebalance_hierarchical(
    weight: Tensor, num_slots: int, num_groups: int, num_nodes: int, num_gpus: int
) -> tuple[Tensor, Tensor, Tensor]:
    """The three steps on float32 weight [L, E]; returns phy2log [L, R], the replica rank of each
    slot [L, R] and logcnt [L, E]. "Node order" numbers experts node by node: node n's experts
    get ids [n * E/N, (n+1) * E/N), a group's experts stay contiguous and in order."""
    num_layers, num_experts = weight.shape
    group_size = num_experts // num_groups
    groups_per_node = num_groups // num_nodes
    experts_per_node = num_experts // num_nodes
    slots_per_node = num_slots // num_nodes
    slots_per_gpu = num_slots // num_gpus

    # (1) Groups onto nodes.
    group_load = weight.view(num_layers, num_groups, group_size).sum(-1)  # [L, G]
    group_node, group_rank = _balanced_packing(group_load, num_nodes)  # [L, G]
    first_in_group = (group_node * groups_per_node + group_rank) * group_size  # [L, G]
    offset = torch.arange(group_size, dtype=torch.int64)
    log2node_order = (first_in_group.unsqueeze(-1) + offset).flatten(1)  # [L, E]
    node_order2log = _inverse(log2node_order)  # [L, E]

    # (2) Replicas within each node; one row per (layer, node).
    node_load = weight.gather(-1, node_order2log).view(-1, experts_per_node)  # [L*N, E/N]
    slot2local, slot_rank, local_cnt = _replicate(node_load, slots_per_node)  # [L*N, R/N] x2, [L*N, E/N]

    # (3) Each node's replicas onto its GPUs.
    replica_load = (node_load / local_cnt).gather(-1, slot2local)  # [L*N, R/N]
    gpu, place = _balanced_packing(replica_load, num_gpus // num_nodes)  # [L*N, R/N]
    placed2slot = _inverse(gpu * slots_per_gpu + place)  # [L*N, R/N]: final position -> replica

    # Back to global ids: node n's local expert i is node-order expert n * E/N + i.
    node_base = torch.arange(num_nodes, dtype=torch.int64).view(1, -1, 1) * experts_per_node  # [1, N, 1]
    placed2local = slot2local.gather(-1, placed2slot).view(num_layers, num_nodes, -1)  # [L, N, R/N]
    placed2node_order = (placed2local + node_base).flatten(1)  # [L, R]
    phy2log = node_order2log.gather(-1, placed2node_order)  # [L, R]
    phyrank = slot_rank.gather(-1, placed2slot).view(num_layers, -1)  # [L, R]
    logcnt = local_cnt.view(num_layers, -1).gather(-1, log2node_order)  # [L, E]
    return phy2log, phyrank, logcnt


def _balanced_packing(weight: Tensor, num_packs: int) -> tuple[Tensor, Tensor]:
    """Split each row's n items [X, n] into num_packs packs of exactly n / num_packs items with
    balanced total weight. Returns the pack of each item and its place in the pack, both [X, n].
    Rows are independent; the greedy runs over items, vectorised over rows."""
    num_rows, num_items = weight.shape
    per_pack = num_items // num_packs
    assert per_pack * num_packs == num_items, (num_items, num_packs)
    if per_pack == 1:
        pack = torch.arange(num_items, dtype=torch.int64).expand(num_rows, -1).contiguous()
        return pack, torch.zeros_like(pack)

    order = weight.float().sort(-1, descending=True).indices  # [X, n]; unstable, as the reference
    pack_load = torch.zeros(num_rows, num_packs, dtype=torch.float32)  # [X, packs]
    pack_size = torch.zeros(num_rows, num_packs, dtype=torch.int64)  # [X, packs]
    pack = torch.full((num_rows, num_items), -1, dtype=torch.int64)  # [X, n]
    place = torch.full_like(pack, -1)
    rows = torch.arange(num_rows)
    for k in range(num_items):
        item = order[:, k]  # [X]
        open_load = pack_load.masked_fill(pack_size >= per_pack, float("inf"))
        target = open_load.argmin(-1)  # [X]; first of equally light packs
        pack[rows, item] = target
        place[rows, item] = pack_size[rows, target]
        pack_load[rows, target] += weight[rows, item].float()
        pack_size[rows, target] += 1
    return pack, place


def _replicate(weight: Tensor, num_slots: int) -> tuple[Tensor, Tensor, Tensor]:
    """Give each of the n experts in a row [X, n] one slot, then hand the num_slots - n extra
    slots one at a time to the expert with the largest load per replica. Returns slot -> expert
    [X, num_slots], the replica rank of each slot [X, num_slots] and replicas per expert [X, n]."""
    num_rows, num_experts = weight.shape
    slot2expert = torch.arange(num_slots, dtype=torch.int64).repeat(num_rows, 1)  # [X, S]
    rank = torch.zeros(num_rows, num_slots, dtype=torch.int64)  # [X, S]
    count = torch.ones(num_rows, num_experts, dtype=torch.int64)  # [X, n]
    rows = torch.arange(num_rows)
    for s in range(num_experts, num_slots):
        hottest = (weight / count).argmax(-1)  # [X]; first of equal maxima
        slot2expert[:, s] = hottest
        rank[:, s] = count[rows, hottest]
        count[rows, hottest] += 1
    return slot2expert, rank, count


def _inverse(perm: Tensor) -> Tensor:
    """Row-wise inverse of permutations [X, n]."""
    inv = torch.empty_like(perm)
    inv.scatter_(1, perm, torch.arange(perm.shape[1], dtype=perm.dtype).expand_as(perm))
    return inv


def _build_log2phy(phy2log: Tensor, phyrank: Tensor, logcnt: Tensor) -> Tensor:
    """log2phy [L, E, max_replicas] from phy2log and replica ranks [L, R]; -1 pads."""
    num_layers, num_experts = logcnt.shape
    max_replicas = int(logcnt.max())
    log2phy = torch.full((num_layers, num_experts * max_replicas), -1, dtype=torch.int64)
    slots = torch.arange(phy2log.shape[1], dtype=torch.int64).expand_as(phy2log)  # [L, R]
    log2phy.scatter_(1, phy2log * max_replicas + phyrank, slots)
    return log2phy.view(num_layers, num_experts, max_replicas)
