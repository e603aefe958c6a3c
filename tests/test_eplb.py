"""EPLB (engine/parallel/eplb.py): DeepSeek's published example exactly, the layout invariants on
random and tied loads for hierarchical and global plans, balance on a skewed load, and the
static placement it is measured against."""

from __future__ import annotations

import pytest
import torch

from engine.parallel.eplb import balance_ratio, default_placement, rebalance_experts

# The example in github.com/deepseek-ai/EPLB's README ("Interface and Example"): 2 layers x 12
# experts, 4 redundant experts, 4 groups, 2 nodes of 4 GPUs. The expected phy2log is the output
# printed there (hierarchical policy).
README_WEIGHT = torch.tensor(
    [
        [90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
        [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27],
    ]
)
README_PHY2LOG = torch.tensor(
    [
        [5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1],
        [7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1],
    ]
)


def zipf_load(num_layers: int, num_experts: int, exponent: float = 1.0, seed: int = 0) -> torch.Tensor:
    """[L, E] loads proportional to 1 / rank**exponent, ranks shuffled per layer."""
    gen = torch.Generator().manual_seed(seed)
    base = 10_000.0 / torch.arange(1, num_experts + 1, dtype=torch.float64) ** exponent  # [E]
    return torch.stack([base[torch.randperm(num_experts, generator=gen)] for _ in range(num_layers)])


def check_plan(phy2log, log2phy, logcnt, num_experts: int, num_replicas: int, num_gpus: int) -> None:
    """The layout contract every plan must meet, whatever the policy."""
    num_layers = phy2log.shape[0]
    assert phy2log.dtype == log2phy.dtype == logcnt.dtype == torch.int64
    assert phy2log.shape == (num_layers, num_replicas)
    assert logcnt.shape == (num_layers, num_experts)
    assert log2phy.shape == (num_layers, num_experts, int(logcnt.max()))
    assert num_replicas % num_gpus == 0  # slot p on GPU p // (R / num_gpus): R / num_gpus slots each
    assert bool((logcnt >= 1).all()), "every logical expert needs a replica"
    assert logcnt.sum(-1).tolist() == [num_replicas] * num_layers
    for layer in range(num_layers):
        counts = torch.bincount(phy2log[layer], minlength=num_experts)
        assert torch.equal(counts, logcnt[layer])
        seen = []
        for expert in range(num_experts):
            n = int(logcnt[layer, expert])
            slots = log2phy[layer, expert]
            assert bool((slots[n:] == -1).all())
            assert bool((phy2log[layer, slots[:n]] == expert).all())
            seen += slots[:n].tolist()
        assert sorted(seen) == list(range(num_replicas)), "each slot is one replica of one expert"


def check_replication_is_min_max(weight, phy2log, logcnt, slot_node) -> None:
    """The greedy's exact optimality condition, per node: taking a replica away from any expert
    would leave it with a per-replica load at least the node's current maximum (float32, as the
    algorithm computes it), so no other split of the node's slots has a lower maximum."""
    per_replica = weight.float() / logcnt  # [L, E]
    for layer in range(weight.shape[0]):
        for node in slot_node.unique().tolist():
            experts = phy2log[layer, slot_node == node].unique()
            node_max = per_replica[layer, experts].max()
            for e in experts.tolist():
                c = int(logcnt[layer, e])
                if c > 1:
                    assert weight[layer, e].float() / (c - 1) >= node_max


def test_readme_example():
    phy2log, log2phy, logcnt = rebalance_experts(README_WEIGHT, 16, 4, 2, 8)
    assert torch.equal(phy2log, README_PHY2LOG)
    check_plan(phy2log, log2phy, logcnt, num_experts=12, num_replicas=16, num_gpus=8)


def test_zero_load_gives_spare_replicas_to_the_first_expert_and_keeps_order():
    # Derived by hand: all per-replica loads tie, so both spare slots go to expert 0 (first of
    # equal maxima), and packing the 6 equal replicas onto 2 GPUs keeps them in slot order.
    phy2log, log2phy, logcnt = rebalance_experts(torch.zeros(1, 4), 6, 1, 1, 2)
    assert phy2log.tolist() == [[0, 1, 2, 3, 0, 0]]
    assert logcnt.tolist() == [[3, 1, 1, 1]]
    assert log2phy.tolist() == [[[0, 4, 5], [1, -1, -1], [2, -1, -1], [3, -1, -1]]]


# (layers, experts, replicas, groups, nodes, gpus); hierarchical iff groups % nodes == 0.
CASES = [
    (2, 12, 16, 4, 2, 8),
    (3, 16, 24, 4, 2, 4),
    (2, 16, 32, 8, 4, 8),
    (2, 16, 16, 4, 4, 8),  # no spare slots, one group per node
    (1, 64, 96, 8, 1, 16),  # one node
    (2, 8, 64, 2, 2, 8),  # 8 slots per expert on average
    (2, 24, 32, 6, 4, 8),  # global
    (3, 16, 24, 4, 3, 6),  # global
    (2, 20, 40, 5, 2, 4),  # global
    (2, 7, 7, 1, 1, 7),  # one slot per GPU
]


@pytest.mark.parametrize("load_kind", ["ties", "uniform", "zipf"])
@pytest.mark.parametrize(
    "layers,experts,replicas,groups,nodes,gpus",
    CASES,
    ids=[f"L{c[0]}-E{c[1]}-R{c[2]}-G{c[3]}-N{c[4]}-gpu{c[5]}" for c in CASES],
)
def test_plan_invariants(layers, experts, replicas, groups, nodes, gpus, load_kind):
    gen = torch.Generator().manual_seed(layers * 1000 + experts)
    if load_kind == "ties":
        weight = torch.randint(0, 4, (layers, experts), generator=gen)
    elif load_kind == "uniform":
        weight = torch.rand(layers, experts, generator=gen) * 100
    else:
        weight = zipf_load(layers, experts, seed=experts)
    phy2log, log2phy, logcnt = rebalance_experts(weight, replicas, groups, nodes, gpus)
    check_plan(phy2log, log2phy, logcnt, experts, replicas, gpus)

    hierarchical = groups % nodes == 0
    slot_node = torch.arange(replicas) // (replicas // nodes) if hierarchical else torch.zeros(replicas)
    check_replication_is_min_max(weight, phy2log, logcnt, slot_node)
    if hierarchical:
        group_size = experts // groups
        for layer in range(layers):
            group_nodes = [set() for _ in range(groups)]
            for slot, expert in enumerate(phy2log[layer].tolist()):
                group_nodes[expert // group_size].add(int(slot_node[slot]))
            assert all(len(s) == 1 for s in group_nodes), "a group's replicas all sit on one node"
            per_node = torch.bincount(torch.tensor([min(s) for s in group_nodes]), minlength=nodes)
            assert per_node.tolist() == [groups // nodes] * nodes


@pytest.mark.parametrize(
    "groups,nodes", [(8, 1), (8, 2), (8, 3)], ids=["1node", "2nodes-hierarchical", "3nodes-global"]
)
def test_eplb_balances_a_skewed_load(groups, nodes):
    layers, experts, spare, gpus = 4, 64, 32, 12  # generous: 96 slots, 8 per GPU
    load = zipf_load(layers, experts, exponent=1.0, seed=1)  # top expert ~21% of a layer's load
    phy2log, _, logcnt = rebalance_experts(load, experts + spare, groups, nodes, gpus)
    eplb = balance_ratio(load, phy2log, logcnt, gpus)  # [L]
    static = balance_ratio(load, *default_placement(layers, experts, spare, gpus)[::2], gpus)  # [L]
    assert bool((static > 1.5).all()), static  # the skew is real
    assert bool((eplb < static).all()), (eplb, static)
    assert bool((eplb <= 1.3).all()), eplb


def test_default_placement_round_robin():
    phy2log, log2phy, logcnt = default_placement(2, 4, 6, 5)
    assert phy2log.tolist() == [[0, 1, 2, 3, 0, 1, 2, 3, 0, 1]] * 2
    assert logcnt.tolist() == [[3, 3, 2, 2]] * 2
    assert log2phy[0].tolist() == [[0, 4, 8], [1, 5, 9], [2, 6, -1], [3, 7, -1]]
    check_plan(phy2log, log2phy, logcnt, num_experts=4, num_replicas=10, num_gpus=5)


def test_balance_ratio_by_hand():
    load = torch.tensor([[3.0, 1.0], [0.0, 0.0]])
    one_each = torch.tensor([[0, 1], [0, 1]]), torch.ones(2, 2, dtype=torch.int64)
    assert balance_ratio(load, *one_each, num_gpus=2).tolist() == [1.5, 1.0]  # GPUs 3 and 1; idle layer
    split = torch.tensor([[0, 1, 0, 1], [0, 1, 0, 1]]), torch.full((2, 2), 2)
    assert balance_ratio(load, *split, num_gpus=2).tolist() == [1.0, 1.0]  # 1.5 + 0.5 on each GPU


@pytest.mark.parametrize(
    "shape,replicas,groups,nodes,gpus,message",
    [
        ((2, 12), 15, 4, 1, 8, r"num_replicas \(15\) must be a multiple of num_gpus \(8\)"),
        ((2, 12), 16, 4, 3, 8, r"num_gpus \(8\) must be a multiple of num_nodes \(3\)"),
        ((2, 12), 16, 5, 2, 8, r"num_experts \(12\) must be a multiple of num_groups \(5\)"),
        ((2, 12), 8, 4, 2, 8, r"num_replicas \(8\) must be >= num_experts \(12\)"),
        ((2, 12), 16, 4, 2, 0, r"num_gpus must be >= 1"),
        ((12,), 16, 4, 2, 8, r"weight must be \[num_layers, num_experts\]"),
    ],
    ids=["replicas-per-gpu", "gpus-per-node", "experts-per-group", "too-few-replicas", "no-gpus", "1d"],
)
def test_argument_errors_name_the_limit(shape, replicas, groups, nodes, gpus, message):
    with pytest.raises(ValueError, match=message):
        rebalance_experts(torch.ones(shape), replicas, groups, nodes, gpus)


def test_negative_or_infinite_load_is_rejected():
    with pytest.raises(ValueError, match="weight must be >= 0"):
        rebalance_experts(-torch.ones(1, 4), 4, 1, 1, 2)
    with pytest.raises(ValueError, match="weight must be finite"):
        rebalance_experts(torch.tensor([[1.0, float("inf"), 1.0, 1.0]]), 4, 1, 1, 2)


def test_default_placement_errors_name_the_limit():
    with pytest.raises(
        ValueError, match=r"num_experts \+ num_redundant \(10\) must be a multiple of num_gpus \(4\)"
    ):
        default_placement(1, 8, 2, 4)
    with pytest.raises(ValueError, match="num_redundant must be >= 0"):
        default_placement(1, 8, -1, 4)
