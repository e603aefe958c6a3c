"""Where each logical expert's replicas live: physical slot p is on rank p // slots_per_rank.

    phy2log [L, R]          logical expert held by each physical slot
    log2phy [L, E, maxrep]  physical slots of each logical expert (-1 padded)
    logcnt  [L, E]          replicas per logical expert

A token's (logical) expert choice is mapped to one of its replicas round-robin by the token's
position in the batch, which spreads a hot expert's tokens over its replicas.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass
class ExpertPlacement:
    phy2log: torch.Tensor  # [L, R] int64
    log2phy: torch.Tensor  # [L, E, maxrep] int64
    logcnt: torch.Tensor  # [L, E] int64
    num_ranks: int

    @property
    def num_layers(self) -> int:
        return self.phy2log.shape[0]

    @property
    def num_physical(self) -> int:
        return self.phy2log.shape[1]

    @property
    def num_logical(self) -> int:
        return self.logcnt.shape[1]

    @property
    def slots_per_rank(self) -> int:
        return self.num_physical // self.num_ranks

    def local_experts(self, layer: int, rank: int) -> list[int]:
        """Logical expert of each of `rank`'s slots in MoE layer `layer`."""
        s = self.slots_per_rank
        return self.phy2log[layer, rank * s : (rank + 1) * s].tolist()

    @staticmethod
    def from_phy2log(phy2log: torch.Tensor, num_logical: int, num_ranks: int) -> ExpertPlacement:
        phy2log = phy2log.to(torch.int64)
        num_layers, num_physical = phy2log.shape
        if num_physical % num_ranks:
            raise ValueError(f"{num_physical} physical experts do not divide over {num_ranks} ranks")
        logcnt = torch.zeros(num_layers, num_logical, dtype=torch.int64)
        logcnt.scatter_add_(1, phy2log, torch.ones_like(phy2log))
        if (logcnt == 0).any():
            layer, expert = (logcnt == 0).nonzero()[0].tolist()
            raise ValueError(
                f"placement leaves logical expert {expert} of MoE layer {layer} without a replica"
            )
        log2phy = torch.full((num_layers, num_logical, int(logcnt.max())), -1, dtype=torch.int64)
        for layer in range(num_layers):
            seen = [0] * num_logical
            for p, e in enumerate(phy2log[layer].tolist()):
                log2phy[layer, e, seen[e]] = p
                seen[e] += 1
        return ExpertPlacement(phy2log, log2phy, logcnt, num_ranks)

    @staticmethod
    def round_robin(num_layers: int, num_logical: int, num_redundant: int, num_ranks: int) -> ExpertPlacement:
        """Experts in order over the ranks; redundant slots hold experts 0, 1, 2, ... again."""
        num_physical = num_logical + num_redundant
        phy2log = (torch.arange(num_physical) % num_logical).expand(num_layers, num_physical)
        return ExpertPlacement.from_phy2log(phy2log.clone(), num_logical, num_ranks)

    @staticmethod
    def from_file(path: str | Path, num_layers: int, num_logical: int, num_ranks: int) -> ExpertPlacement:
        """A static placement: JSON {"phy2log": [[...], ...]} with one row per MoE layer."""
        rows = json.loads(Path(path).read_text()).get("phy2log")
        if not isinstance(rows, list) or len(rows) != num_layers:
            raise ValueError(
                f"placement file {path}: phy2log must be a list of {num_layers} rows (one per MoE layer)"
            )
        phy2log = torch.tensor(rows, dtype=torch.int64)
        if phy2log.dim() != 2 or phy2log.min() < 0 or phy2log.max() >= num_logical:
            raise ValueError(f"placement file {path}: expert ids must be in [0, {num_logical})")
        return ExpertPlacement.from_phy2log(phy2log, num_logical, num_ranks)

    def to(self, device: torch.device | str) -> ExpertPlacement:
        return ExpertPlacement(
            self.phy2log.to(device), self.log2phy.to(device), self.logcnt.to(device), self.num_ranks
        )

    def physical(self, layer: int, logical_ids: torch.Tensor) -> torch.Tensor:
        """logical_ids [P] -> one physical slot per pair [P], replicas taken round-robin."""
        cnt = self.logcnt[layer].to(logical_ids.device)[logical_ids]  # [P]
        choice = torch.arange(logical_ids.numel(), device=logical_ids.device) % cnt
        return self.log2phy[layer].to(logical_ids.device)[logical_ids, choice]
