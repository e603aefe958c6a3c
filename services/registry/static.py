"""A fixed list of worker endpoints: the embedded default, no Redis needed on one machine."""

from __future__ import annotations

from services.registry.base import Registry, WorkerRecord


class StaticRegistry(Registry):
    """Lists the endpoints it was built with; role and model are "" (the router asks each worker).

    `register` and `deregister` are no-ops: the list is configuration, not state.
    """

    def __init__(self, endpoints: list[str]) -> None:
        # Validate every endpoint up front (ValueError names it) and drop duplicates, keeping order.
        self._records = [
            WorkerRecord(endpoint=endpoint, role="", model="", dp_rank=0, epoch=0)
            for endpoint in dict.fromkeys(endpoints)
        ]

    async def register(self, record: WorkerRecord, ttl_s: float) -> None:
        return None

    async def deregister(self, endpoint: str) -> None:
        return None

    async def list_workers(self) -> list[WorkerRecord]:
        return sorted(self._records, key=lambda record: record.endpoint)

    async def close(self) -> None:
        return None
