"""Where a request runs: a prefill rank and a decode rank, or one rank colocated.

Prefill goes where the prompt's prefix is most likely cached when that saves at least
`affinity_min_fraction` of the prompt, else to the least loaded prefill rank. Decode goes to the
least loaded decode rank (prefix reuse breaks ties: cached blocks need not be transferred).
A prompt runs colocated on its decode rank when it is short (at most `colocate_max_tokens`) or
mostly cached there (`colocate_cached_fraction`), or when no prefill rank is healthy; and, with
`colocate_prefill_backlog`, when every prefill rank has that many prompt tokens waiting for their
first token and the decode rank fewer (conditional disaggregation, as NVIDIA Dynamo's: a burst
of prompts is prefilled on both sides instead of queueing behind the prefill ranks).
"""

from __future__ import annotations

from dataclasses import dataclass

from services.common.errors import Unavailable
from services.router.api import ServingMode
from services.router.pool import WorkerHandle, WorkerPool


@dataclass(frozen=True)
class RoutingConfig:
    colocate_max_tokens: int = 32
    """AUTO mode: prompts of at most this many tokens skip disaggregation (0: never)."""
    colocate_cached_fraction: float = 0.8
    """AUTO mode: prompts at least this much cached on the decode rank run colocated there."""
    affinity_min_fraction: float = 0.25
    """Prefer a prefill rank holding at least this fraction of the prompt over a less loaded one."""
    colocate_prefill_backlog: int = 0
    """AUTO mode: when every prefill rank has at least this many prompt tokens in flight, a prompt
    runs colocated on its decode rank if fewer wait there (0: never)."""

    def __post_init__(self) -> None:
        if self.colocate_prefill_backlog < 0:
            raise ValueError(
                f"colocate_prefill_backlog must be >= 0 tokens, got {self.colocate_prefill_backlog}"
            )


@dataclass
class Route:
    decode: WorkerHandle
    prefill: WorkerHandle | None
    """None: colocated on the decode rank."""


def _least_loaded(workers: list[WorkerHandle], hashes: list[bytes]) -> WorkerHandle:
    return min(workers, key=lambda w: (w.score, -w.prefix.match(hashes), w.endpoint))


def choose(
    pool: WorkerPool,
    cfg: RoutingConfig,
    mode: ServingMode,
    hashes: list[bytes],
    num_tokens: int,
    block_size: int,
    exclude: set[str] | frozenset[str] = frozenset(),
    shared_blocks: int = 0,
) -> Route:
    """exclude: endpoints that just failed this request (a retry goes elsewhere). shared_blocks:
    leading prompt blocks the shared KV tier (Redis) holds: any worker can load those, so they
    count as cached on every rank."""
    decoders = [w for w in pool.healthy("decode") if w.endpoint not in exclude]
    if not decoders:
        raise Unavailable("no healthy decode worker")
    decode = _least_loaded(decoders, hashes)
    if mode is ServingMode.COLOCATED:
        return Route(decode, None)
    prefillers = [w for w in pool.healthy("prefill") if w is not decode and w.endpoint not in exclude]
    if not prefillers:
        if mode is ServingMode.DISAGGREGATED:
            raise Unavailable("no healthy prefill worker for a disaggregated request")
        return Route(decode, None)
    if mode is ServingMode.AUTO:
        cached = max(decode.prefix.match(hashes), shared_blocks) * block_size
        if num_tokens <= cfg.colocate_max_tokens or cached >= cfg.colocate_cached_fraction * num_tokens:
            return Route(decode, None)
        backlog = min(w.prompt_tokens_in_flight for w in prefillers)
        if 0 < cfg.colocate_prefill_backlog <= backlog and decode.prompt_tokens_in_flight < backlog:
            return Route(decode, None)
    best = max(prefillers, key=lambda w: (w.prefix.match(hashes), -w.score))
    # Affinity only pays for what the shared tier does not already give every rank.
    if (
        best.prefix.match(hashes) > shared_blocks
        and best.prefix.match(hashes) * block_size >= cfg.affinity_min_fraction * num_tokens > 0
    ):
        return Route(decode, best)
    return Route(decode, _least_loaded(prefillers, hashes))
