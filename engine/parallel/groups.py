"""One DP/EP group of ranks joined by torch.distributed (gloo on CPU, NCCL on CUDA).

With DP attention every rank has its own scheduler, batch and KV cache; the MoE layers are
expert-parallel over the whole group (DP size == EP size, vLLM's "DEP" layout). Ranks step
together: each step starts with one all-reduce that tells every rank whether any rank has work,
so a rank without work runs a dummy batch and the MoE collectives always match.
"""

from __future__ import annotations

import datetime
import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GroupConfig:
    """How this process joins its group."""

    rank: int
    """This process's rank in the group (global: node offset + local index)."""
    world_size: int
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    timeout_s: float = 60.0
    """A collective waiting longer than this fails (a peer died or hangs) instead of hanging."""
    backend: str | None = None
    """"gloo" or "nccl"; None picks by device."""


class ParallelGroup:
    """The initialized group; the engine's collectives go through here."""

    def __init__(self, cfg: GroupConfig, device: torch.device):
        if not 0 <= cfg.rank < cfg.world_size:
            raise ValueError(f"rank {cfg.rank} is outside [0, world_size {cfg.world_size})")
        backend = cfg.backend or ("nccl" if device.type == "cuda" else "gloo")
        if not dist.is_initialized():
            dist.init_process_group(
                backend,
                init_method=f"tcp://{cfg.master_addr}:{cfg.master_port}",
                rank=cfg.rank,
                world_size=cfg.world_size,
                timeout=datetime.timedelta(seconds=cfg.timeout_s),
            )
        self.cfg = cfg
        self.rank = cfg.rank
        self.size = cfg.world_size
        self.device = device
        logger.info("rank %d/%d joined via %s (%s)", cfg.rank, cfg.world_size, backend, cfg.master_addr)

    def sync(self, busy: bool, stop: bool = False) -> tuple[bool, bool]:
        """The start of every step: (does any rank have work, do all ranks want to stop), the same
        answer on every rank, so they all run the step (or stop) together. A rank that wants to
        stop keeps stepping (dummy batches) until every rank does."""
        flags = torch.tensor([int(busy), int(not stop)], dtype=torch.int32, device=self.device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        any_busy, any_continues = flags.tolist()
        return bool(any_busy), not any_continues

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t

    def all_to_all(self, send: torch.Tensor, send_counts: list[int], recv_counts: list[int]) -> torch.Tensor:
        """Rows of `send` grouped by destination rank (send_counts[r] rows to rank r) -> the rows
        every rank sent here, grouped by source rank."""
        recv = send.new_empty((sum(recv_counts), *send.shape[1:]))
        dist.all_to_all_single(
            recv, send.contiguous(), output_split_sizes=recv_counts, input_split_sizes=send_counts
        )
        return recv

    def exchange_counts(self, send_counts: torch.Tensor) -> torch.Tensor:
        """send_counts[r] = rows this rank sends to rank r -> recv_counts[r] = rows rank r sends here."""
        recv = torch.empty_like(send_counts)
        dist.all_to_all_single(recv, send_counts)
        return recv

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
