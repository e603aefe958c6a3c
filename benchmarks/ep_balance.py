"""Expert-parallel load balance on a skewed synthetic routing trace: static layout vs EPLB.

Trace (DeepSeek-V3 shape by default): 58 MoE layers x 256 routed experts in 8 groups, each token
routed to 8 distinct experts. Expert popularity is Zipf, p[e] ~ 1 / rank(e)**s, with the ranks
shuffled independently per layer; a token's experts are drawn without replacement in proportion
to p (Gumbel top-k). No group-limited routing. Two independent windows of tokens are drawn: EPLB
plans on the first and every layout is scored on the second, as a served plan comes from past
traffic.

Score: max / mean of the per-rank load (routed token-expert pairs, an expert's load split evenly
over its replicas), averaged over layers; 1.0 is perfect. Columns, per EP size (num_nodes =
max(1, EP // 8), 8 GPUs a node):

* static: experts 0..E-1 in order, E / EP per rank, no spare slots;
* static+spare: the same plus `spare` slots holding experts 0, 1, 2, ... (default_placement);
* EPLB: rebalance_experts with the same slots. Spare slots: one per rank (--spare-per-rank 1),
  i.e. 2, 8, 32 and 64 for EP 2, 8, 32 and 64; 32 at EP 32 is DeepSeek-V3's prefill setting
  (9 experts per GPU), and 32 cannot be split over 64 ranks, so EP 64 gets 64.
  Multi-node sizes show both policies: hierarchical (groups packed onto nodes) and global.

    python benchmarks/ep_balance.py            # full; writes benchmarks/results/ep_balance_<hw>_<date>.json
    python benchmarks/ep_balance.py --smoke    # small shapes, prints the table, saves nothing
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import save  # noqa: E402
from engine.parallel.eplb import balance_ratio, default_placement, rebalance_experts  # noqa: E402

GPUS_PER_NODE = 8


def routed_counts(
    popularity: torch.Tensor, num_tokens: int, top_k: int, gen: torch.Generator, chunk: int = 4096
) -> torch.Tensor:
    """Token-expert pairs per expert [L, E] when each of num_tokens tokens per layer picks top_k
    distinct experts, drawn without replacement with probabilities popularity [L, E] (Gumbel
    top-k: the k largest of log p + Gumbel noise)."""
    num_layers, num_experts = popularity.shape
    counts = torch.zeros(num_layers, num_experts, dtype=torch.int64)  # [L, E]
    log_p = popularity.log()  # [L, E]
    for layer in range(num_layers):
        for start in range(0, num_tokens, chunk):
            n = min(chunk, num_tokens - start)
            u = torch.rand(n, num_experts, generator=gen).clamp_min(1e-20)  # [T, E]
            chosen = (log_p[layer] - (-u.log()).log()).topk(top_k, dim=-1).indices  # [T, k]
            counts[layer] += torch.bincount(chosen.flatten(), minlength=num_experts)
    return counts


def zipf_popularity(num_layers: int, num_experts: int, exponent: float, gen: torch.Generator) -> torch.Tensor:
    """[L, E] probabilities ~ 1 / rank**exponent, ranks permuted per layer."""
    base = 1.0 / torch.arange(1, num_experts + 1, dtype=torch.float64) ** exponent  # [E]
    base /= base.sum()
    return torch.stack([base[torch.randperm(num_experts, generator=gen)] for _ in range(num_layers)])


def evaluate(args, history: torch.Tensor, future: torch.Tensor, ep: int) -> list[dict]:
    """Rows of the table for one EP size."""
    num_layers, num_experts = history.shape
    nodes = max(1, ep // GPUS_PER_NODE)
    spare = args.spare_per_rank * ep
    static = balance_ratio(future, *default_placement(num_layers, num_experts, 0, ep)[::2], ep)
    with_spare = balance_ratio(future, *default_placement(num_layers, num_experts, spare, ep)[::2], ep)
    policies = [("hierarchical", args.groups)] + ([("global", 1)] if nodes > 1 else [])
    rows = []
    for policy, groups in policies:
        t0 = time.perf_counter()
        phy2log, _, logcnt = rebalance_experts(history, num_experts + spare, groups, nodes, ep)
        plan_s = time.perf_counter() - t0
        eplb = balance_ratio(future, phy2log, logcnt, ep)  # [L]
        rows.append(
            {
                "ep": ep,
                "nodes": nodes,
                "policy": policy,
                "spare": spare,
                "slots_per_rank": (num_experts + spare) // ep,
                "static": static.mean().item(),
                "static_worst_layer": static.max().item(),
                "static_spare": with_spare.mean().item(),
                "eplb": eplb.mean().item(),
                "eplb_worst_layer": eplb.max().item(),
                "eplb_in_sample": balance_ratio(history, phy2log, logcnt, ep).mean().item(),
                "plan_seconds": plan_s,
            }
        )
    return rows


def print_table(rows: list[dict]) -> None:
    head = ("EP", "nodes", "policy", "spare", "slots/rank", "static", "static+spare", "EPLB", "EPLB-worst")
    print("{:>3} {:>5}  {:<12} {:>5} {:>10} {:>7} {:>12} {:>6} {:>10}".format(*head))
    for r in rows:
        print(
            f"{r['ep']:>3} {r['nodes']:>5}  {r['policy']:<12} {r['spare']:>5} {r['slots_per_rank']:>10} "
            f"{r['static']:>7.3f} {r['static_spare']:>12.3f} {r['eplb']:>6.3f} {r['eplb_worst_layer']:>10.3f}"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="4 layers x 64 experts, EP 2/8/16; saves nothing")
    p.add_argument("--layers", type=int, default=58)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--groups", type=int, default=8, help="expert groups (DeepSeek-V3 n_group)")
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--tokens", type=int, default=16384, help="tokens per window per layer")
    p.add_argument("--zipf", type=float, default=1.0, help="popularity exponent s")
    p.add_argument("--ep", default="2,8,32,64", help="comma-separated EP sizes")
    p.add_argument("--spare-per-rank", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if args.smoke:
        args.layers, args.experts, args.top_k, args.tokens, args.ep = 4, 64, 4, 2048, "2,8,16"

    gen = torch.Generator().manual_seed(args.seed)
    popularity = zipf_popularity(args.layers, args.experts, args.zipf, gen)  # [L, E]
    history = routed_counts(popularity, args.tokens, args.top_k, gen)  # [L, E]
    future = routed_counts(popularity, args.tokens, args.top_k, gen)  # [L, E]
    rows = [row for ep in map(int, args.ep.split(",")) for row in evaluate(args, history, future, ep)]

    print(
        f"{args.layers} layers x {args.experts} experts ({args.groups} groups), top-{args.top_k}, "
        f"Zipf s={args.zipf}, {args.tokens} tokens per window; max/mean rank load, mean over layers"
    )
    print_table(rows)
    if args.smoke:
        return
    settings = {
        k: getattr(args, k) for k in ("layers", "experts", "groups", "top_k", "tokens", "zipf", "seed")
    }
    settings |= {"spare_per_rank": args.spare_per_rank, "gpus_per_node": GPUS_PER_NODE}
    path = save("ep_balance", {"settings": settings, "results": rows})
    print(f"saved {path}")


if __name__ == "__main__":
    main()
