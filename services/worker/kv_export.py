"""The prefill side of a handover: how much one caller may pin (checked before the prompt runs),
the export's checksums for NIXL readers, and the KvHandle that names the export to the decode
side. The export itself and its lease are the engine's (engine/kv_cache/export.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager

from engine.kv_cache.export import Export, ExportTable, PinLimitExceeded
from engine.kv_cache.spec import KVCacheSpec
from engine.kv_cache.transfer import KVPort
from pdserve.v1 import kv_transfer_pb2 as kv_pb
from pdserve.v1 import worker_pb2 as wpb
from services.common.errors import InvalidArgument, ResourceExhausted
from services.worker.async_engine import AsyncEngine
from services.worker.settings import WorkerSettings


class KvExporter:
    """Only the event loop calls this."""

    def __init__(
        self, settings: WorkerSettings, engine: AsyncEngine, exports: ExportTable, identity: kv_pb.KvProducer
    ):
        self.settings = settings
        self.engine = engine
        self.exports = exports
        self.identity = identity
        self.kv_spec: KVCacheSpec | None = None
        self.compat_hash = ""
        self.port: KVPort | None = None
        self.nixl = False
        """This worker serves KV over NIXL: its handles name their blocks (a reader posts its READ
        while BeginRead is under way)."""
        self.checksums = False
        """Take per-block checksums for NIXL readers (this worker serves NIXL and checks are on)."""

    def engine_ready(self, kv_spec: KVCacheSpec, port: KVPort | None, nixl: bool) -> None:
        self.kv_spec, self.compat_hash, self.port = kv_spec, kv_spec.compat_hash(), port
        self.nixl = nixl
        self.checksums = nixl and self.settings.kv_checksums

    @property
    def pin_limit(self) -> int:
        """The blocks this worker pins for transfers, every caller's together (its fair-share
        pool: ExportTable.reserve)."""
        return int(self.settings.max_pinned_fraction * self.engine.core.num_kv_blocks)

    @contextmanager
    def reserved(self, caller: str, num_blocks: int) -> Iterator[None]:
        """Hold a prompt's blocks against the caller's share of the pinned blocks while its
        Prefill runs (RESOURCE_EXHAUSTED before it runs; INVALID_ARGUMENT for a prompt that could
        never be pinned); once the Prefill ends, its export (if any) counts its blocks itself.
        Callers under their fair share may pin past the limit up to halfway to the whole cache."""
        limit, total = self.pin_limit, self.engine.core.num_kv_blocks
        if num_blocks > limit:
            raise InvalidArgument(
                f"prompt needs {num_blocks} KV blocks pinned until its transfer, more than this worker's "
                f"limit of {limit} (max_pinned_fraction of {total} blocks)"
            )
        try:
            self.exports.reserve(caller, num_blocks, limit, ceiling=limit + (total - limit) // 2)
        except PinLimitExceeded as e:
            raise ResourceExhausted(str(e)) from None
        try:
            yield
        finally:
            self.exports.unreserve(caller, num_blocks)

    async def describe(self, kv: Export, response: wpb.PrefillResponse) -> None:
        """Fill the response's kv_handle (and sampler state) for an export, its checksums taken
        first when NIXL readers verify them."""
        if self.checksums:
            await self._take_checksums(kv.export_id)
        response.kv_handle.CopyFrom(
            kv_pb.KvHandle(
                transfer_id=kv.export_id,
                producer=self.identity,
                block_hashes=kv.block_hashes,
                num_tokens=kv.num_tokens,
                num_blocks=kv.num_blocks,
                block_size=self.kv_spec.block_size,
                lease_expiry_unix_ms=int(kv.lease_expiry * 1000),
                compat_hash=self.compat_hash,
                block_ids=self.port.exported_blocks(kv) if self.nixl else (),
                block_checksums=(kv.block_checksums or ()) if self.nixl else (),
            )
        )
        if kv.generator_state is not None:
            response.sampler_state = kv.generator_state.numpy().tobytes()

    async def _take_checksums(self, export_id: str) -> None:
        """The export's per-block checksums, taken before its handle goes out (inside a read:
        the blocks are pinned and the engine writes them no more), for NIXL readers to verify."""
        export = self.exports.begin_read(export_id)
        try:
            export.block_checksums = await asyncio.to_thread(self.port.checksum_exported, export)
        finally:
            self.exports.end_read(export, room=False)
