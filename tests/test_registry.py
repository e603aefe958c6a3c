"""Worker registry against a real redis-server: round trip, validation, TTL expiry, deregistration,
refill after a Redis restart, last-known state through an outage, and the static registry."""

from __future__ import annotations

import asyncio
import logging
import time
import types
from collections.abc import Awaitable, Callable, Iterator

import pytest
import redis
import redis.asyncio as aioredis

from services.registry import (
    Heartbeat,
    RedisRegistry,
    Registry,
    StaticRegistry,
    WorkerRecord,
    make_registry,
)
from tests.redis_server import RedisServer

REDIS_LOGGER = "services.registry.redis_registry"


def make_record(endpoint: str = "127.0.0.1:50051", **overrides: object) -> WorkerRecord:
    fields: dict[str, object] = dict(
        endpoint=endpoint,
        role="prefill",
        model="pdserve-tiny",
        dp_rank=1,
        epoch=3,
        load={"num_running": 2, "num_waiting": 0, "kv_usage": 0.25},
        updated_unix_ms=1_700_000_000_123,
    )
    fields.update(overrides)
    return WorkerRecord(**fields)  # type: ignore[arg-type]


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server


async def wait_until(
    predicate: Callable[[], Awaitable[bool]], timeout_s: float, poll_s: float = 0.05
) -> float:
    """Seconds until `predicate()` is true; fails the test after `timeout_s`."""
    start = time.monotonic()
    while not await predicate():
        elapsed = time.monotonic() - start
        assert elapsed < timeout_s, f"condition not met within {timeout_s}s"
        await asyncio.sleep(poll_s)
    return time.monotonic() - start


# -- WorkerRecord ---------------------------------------------------------------------------------


def test_record_hash_round_trip_accepts_bytes() -> None:
    record = make_record()
    raw = {k.encode(): v.encode() for k, v in record.to_hash().items()}
    assert WorkerRecord.from_hash(raw) == record
    assert WorkerRecord.from_hash(record.to_hash()) == record


@pytest.mark.parametrize(
    "field, value",
    [
        ("dp_rank", "one"),
        ("epoch", "-1"),
        ("updated_unix_ms", ""),
        ("role", "router"),
        ("endpoint", "no-port"),
        ("load", "{not json"),
        ("load", '{"num_running": "2"}'),
        ("load", '{"nested": {"a": 1}}'),
        ("load", '{"kv_usage": NaN}'),
        ("load", "[1, 2]"),
    ],
)
def test_from_hash_names_the_malformed_field(field: str, value: str) -> None:
    raw = make_record().to_hash() | {field: value}
    with pytest.raises(ValueError, match=repr(field)):
        WorkerRecord.from_hash(raw)


def test_from_hash_names_a_missing_field() -> None:
    raw = make_record().to_hash()
    del raw["epoch"]
    with pytest.raises(ValueError, match="missing field 'epoch'"):
        WorkerRecord.from_hash(raw)


def test_record_rejects_non_finite_load() -> None:
    with pytest.raises(ValueError, match="'load'"):
        make_record(load={"kv_usage": float("inf")})


# -- RedisRegistry --------------------------------------------------------------------------------


def test_round_trip_through_redis(redis_server: RedisServer) -> None:
    async def main() -> None:
        registry = RedisRegistry(redis_server.url)
        try:
            records = [make_record("10.0.0.2:7000", role="decode", dp_rank=0), make_record("10.0.0.1:7000")]
            for record in records:
                await registry.register(record, ttl_s=30)
            assert await registry.list_workers() == sorted(records, key=lambda r: r.endpoint)
            updated = make_record("10.0.0.1:7000", load={"num_running": 9}, epoch=4)
            await registry.register(updated, ttl_s=30)
            assert (await registry.list_workers())[0] == updated
        finally:
            await registry.close()

    asyncio.run(main())


def test_malformed_entry_skipped_and_logged_once(redis_server: RedisServer, caplog) -> None:
    async def main() -> None:
        registry = RedisRegistry(redis_server.url, prefix="t:")
        client = aioredis.Redis.from_url(redis_server.url)
        try:
            good = make_record("127.0.0.1:1001")
            await registry.register(good, ttl_s=30)
            await client.hset(
                "t:127.0.0.1:1002", mapping=make_record("127.0.0.1:1002").to_hash() | {"dp_rank": "x"}
            )
            # A hash whose endpoint field disagrees with its key is malformed too.
            await client.hset("t:127.0.0.1:1003", mapping=make_record("127.0.0.1:9999").to_hash())
            await client.set("t:not-a-hash", "1")  # other key types under the prefix are ignored
            with caplog.at_level(logging.WARNING, logger=REDIS_LOGGER):
                assert await registry.list_workers() == [good]
                assert await registry.list_workers() == [good]
            warnings = [r.getMessage() for r in caplog.records if r.name == REDIS_LOGGER]
            assert len(warnings) == 2, warnings
            assert any("'dp_rank'" in w and "1002" in w for w in warnings)
            assert any("'endpoint'" in w and "1003" in w for w in warnings)
        finally:
            await client.aclose()
            await registry.close()

    asyncio.run(main())


def test_worker_drops_out_within_ttl_when_heartbeats_stop(redis_server: RedisServer) -> None:
    async def main() -> None:
        registry = RedisRegistry(redis_server.url)
        record = make_record()
        heartbeat = Heartbeat(registry, lambda: record, ttl_s=1.0, interval_s=0.2)
        try:
            heartbeat.start()
            await wait_until(lambda: _listed(registry, record.endpoint), timeout_s=1.0)
            await asyncio.sleep(1.3)  # longer than the TTL: the heartbeat keeps it alive
            assert await _listed(registry, record.endpoint)
            await heartbeat.stop(deregister=False)
            gone_after = await wait_until(lambda: _absent(registry, record.endpoint), timeout_s=1.5)
            assert gone_after > 0.5  # it was the TTL, not a deregistration
        finally:
            await heartbeat.stop(deregister=False)
            await registry.close()

    asyncio.run(main())


def test_deregister_removes_worker(redis_server: RedisServer) -> None:
    async def main() -> None:
        registry = RedisRegistry(redis_server.url)
        try:
            await registry.register(make_record("127.0.0.1:1"), ttl_s=30)
            await registry.register(make_record("127.0.0.1:2"), ttl_s=30)
            await registry.deregister("127.0.0.1:1")
            await registry.deregister("127.0.0.1:404")  # absent: not an error
            assert [r.endpoint for r in await registry.list_workers()] == ["127.0.0.1:2"]
            # Heartbeat.stop deregisters by default.
            heartbeat = Heartbeat(registry, lambda: make_record("127.0.0.1:3"), ttl_s=30)
            heartbeat.start()
            await wait_until(lambda: _listed(registry, "127.0.0.1:3"), timeout_s=1.0)
            await heartbeat.stop()
            assert [r.endpoint for r in await registry.list_workers()] == ["127.0.0.1:2"]
        finally:
            await registry.close()

    asyncio.run(main())


def test_registry_refills_after_redis_restarts_empty(redis_server: RedisServer) -> None:
    async def main() -> None:
        interval_s = 0.5
        registry = RedisRegistry(redis_server.url)
        record = make_record()
        heartbeat = Heartbeat(registry, lambda: record, ttl_s=5.0, interval_s=interval_s)
        try:
            heartbeat.start()
            await wait_until(lambda: _listed(registry, record.endpoint), timeout_s=1.0)
            redis_server.restart()  # blocks the loop: the next beat finds an empty Redis
            with redis.Redis.from_url(redis_server.url) as probe:
                assert probe.dbsize() == 0
            refilled_after = await wait_until(lambda: _listed(registry, record.endpoint), timeout_s=5.0)
            # One interval, plus slack for a loaded 2-core machine.
            assert refilled_after <= interval_s + 0.5, refilled_after
        finally:
            await heartbeat.stop()
            await registry.close()

    asyncio.run(main())


def test_redis_down_serves_last_known_state(redis_server: RedisServer, caplog) -> None:
    async def main() -> None:
        registry = RedisRegistry(redis_server.url)
        record = make_record()
        try:
            await registry.register(record, ttl_s=30)
            assert await registry.list_workers() == [record]
            redis_server.stop()
            with caplog.at_level(logging.WARNING, logger=REDIS_LOGGER):
                for _ in range(3):
                    assert await asyncio.wait_for(registry.list_workers(), timeout=3.0) == [record]
            outage_warnings = [
                r for r in caplog.records if r.name == REDIS_LOGGER and "unreachable" in r.message
            ]
            assert len(outage_warnings) == 1
            with pytest.raises(ConnectionError):
                await asyncio.wait_for(registry.register(record, ttl_s=30), timeout=3.0)
            # Back, but empty: the live (empty) state replaces the last-known one.
            redis_server.start()
            assert await asyncio.wait_for(registry.list_workers(), timeout=3.0) == []
        finally:
            await registry.close()

    asyncio.run(main())


async def _listed(registry: RedisRegistry, endpoint: str) -> bool:
    return any(r.endpoint == endpoint for r in await registry.list_workers())


async def _absent(registry: RedisRegistry, endpoint: str) -> bool:
    return not await _listed(registry, endpoint)


# -- StaticRegistry, make_registry, Heartbeat arguments ------------------------------------------


def test_static_registry_lists_its_endpoints() -> None:
    async def main() -> None:
        registry = StaticRegistry(["127.0.0.1:7001", "127.0.0.1:7000", "127.0.0.1:7001"])
        await registry.register(make_record(), ttl_s=1)  # no-op
        await registry.deregister("127.0.0.1:7000")  # no-op
        workers = await registry.list_workers()
        assert [w.endpoint for w in workers] == ["127.0.0.1:7000", "127.0.0.1:7001"]
        assert all(w.role == "" and w.model == "" for w in workers)
        await registry.close()

    asyncio.run(main())


def test_static_registry_rejects_bad_endpoint() -> None:
    with pytest.raises(ValueError, match="'endpoint'"):
        StaticRegistry(["localhost"])


def test_make_registry_picks_by_url() -> None:
    async def main() -> None:
        static = make_registry(None, ["127.0.0.1:7000"])
        assert isinstance(static, StaticRegistry)
        assert isinstance(make_registry("", None), StaticRegistry)
        redis_registry = make_registry("redis://127.0.0.1:1/0", None)
        assert isinstance(redis_registry, RedisRegistry)
        await redis_registry.close()
        with pytest.raises(ValueError, match="scheme"):
            make_registry("http://127.0.0.1:6379", None)

    asyncio.run(main())


def test_heartbeat_rejects_interval_not_below_ttl() -> None:
    registry = StaticRegistry([])
    with pytest.raises(ValueError, match="interval_s"):
        Heartbeat(registry, make_record, ttl_s=1.0, interval_s=1.0)
    assert Heartbeat(registry, make_record, ttl_s=3.0).interval_s == pytest.approx(1.0)


# -- Signed records ------------------------------------------------------------------------------

KEY = "registry-test-token"


def test_signed_record_round_trips_and_a_changed_field_breaks_the_mac() -> None:
    record = make_record()
    signed = record.to_hash(KEY)
    assert len(signed["mac"]) == 64 and signed.keys() - record.to_hash().keys() == {"mac"}
    raw = {k.encode(): v.encode() for k, v in signed.items()}
    assert WorkerRecord.from_hash(raw, KEY) == record
    assert WorkerRecord.from_hash(signed) == record  # unkeyed readers ignore the mac
    for field, value in [("endpoint", "10.6.6.6:50051"), ("load", '{"num_running":0}'), ("epoch", "4")]:
        with pytest.raises(ValueError, match="'mac' does not match"):
            WorkerRecord.from_hash(signed | {field: value}, KEY)
    with pytest.raises(ValueError, match="'mac' does not match"):
        WorkerRecord.from_hash(record.to_hash("another-key"), KEY)
    with pytest.raises(ValueError, match="missing field 'mac'"):
        WorkerRecord.from_hash(record.to_hash(), KEY)
    with pytest.raises(ValueError, match="'mac' must be 64 lowercase hex"):
        WorkerRecord.from_hash(signed | {"mac": "zz" * 32}, KEY)


def test_keyed_registry_lists_signed_records_and_skips_rogue_ones(redis_server: RedisServer, caplog) -> None:
    """Whoever can write Redis but lacks the token cannot advertise a worker: records without a
    mac or with a wrong one are skipped (logged once each)."""

    async def main() -> None:
        registry = RedisRegistry(redis_server.url, prefix="s:", key=KEY)
        client = aioredis.Redis.from_url(redis_server.url)
        try:
            good = make_record("127.0.0.1:2001")
            await registry.register(good, ttl_s=30)
            assert (await client.hgetall("s:127.0.0.1:2001"))[b"mac"] == good.to_hash(KEY)["mac"].encode()
            unsigned = make_record("10.6.6.6:2002").to_hash()
            await client.hset("s:10.6.6.6:2002", mapping=unsigned)
            forged = make_record("10.6.6.6:2003").to_hash() | {"mac": "0" * 64}
            await client.hset("s:10.6.6.6:2003", mapping=forged)
            other_key = make_record("10.6.6.6:2004").to_hash("guessed-token")
            await client.hset("s:10.6.6.6:2004", mapping=other_key)
            with caplog.at_level(logging.WARNING, logger=REDIS_LOGGER):
                assert await registry.list_workers() == [good]
                assert await registry.list_workers() == [good]
            warnings = [r.getMessage() for r in caplog.records if r.name == REDIS_LOGGER]
            assert len(warnings) == 3, warnings
            assert any("missing field 'mac'" in w and "2002" in w for w in warnings)
            assert sum("'mac' does not match" in w for w in warnings) == 2
        finally:
            await client.aclose()
            await registry.close()

    asyncio.run(main())


def test_keyed_registry_still_rejects_an_endpoint_that_disagrees_with_its_key(
    redis_server: RedisServer,
) -> None:
    async def main() -> None:
        registry = RedisRegistry(redis_server.url, prefix="e:", key=KEY)
        client = aioredis.Redis.from_url(redis_server.url)
        try:
            # Correctly signed, but filed under another worker's key.
            await client.hset("e:127.0.0.1:3001", mapping=make_record("127.0.0.1:9999").to_hash(KEY))
            assert await registry.list_workers() == []
        finally:
            await client.aclose()
            await registry.close()

    asyncio.run(main())


def test_unkeyed_registry_writes_and_lists_unsigned_records(redis_server: RedisServer) -> None:
    async def main() -> None:
        registry = make_registry(redis_server.url, None)
        client = aioredis.Redis.from_url(redis_server.url)
        try:
            record = make_record("127.0.0.1:4001")
            await registry.register(record, ttl_s=30)
            assert b"mac" not in await client.hgetall("pdserve:worker:127.0.0.1:4001")
            await client.hset(
                "pdserve:worker:127.0.0.1:4002", mapping=make_record("127.0.0.1:4002").to_hash()
            )
            assert [r.endpoint for r in await registry.list_workers()] == ["127.0.0.1:4001", "127.0.0.1:4002"]
            # A keyed registry over the same Redis (make_registry passes the key) sees neither.
            keyed = make_registry(redis_server.url, None, key=KEY)
            try:
                assert await keyed.list_workers() == []
            finally:
                await keyed.close()
        finally:
            await client.aclose()
            await registry.close()

    asyncio.run(main())


def test_registry_key_must_not_be_empty() -> None:
    with pytest.raises(ValueError, match="key"):
        RedisRegistry("redis://127.0.0.1:1/0", key="")


# -- WorkerPool over a registry that loses its entries ---------------------------------------------


class FakeRegistry(Registry):
    """In-process registry whose listing the test sets directly."""

    def __init__(self, endpoints: list[str]) -> None:
        self.endpoints = endpoints

    async def register(self, record: WorkerRecord, ttl_s: float) -> None:
        return None

    async def deregister(self, endpoint: str) -> None:
        return None

    async def list_workers(self) -> list[WorkerRecord]:
        return [make_record(endpoint) for endpoint in sorted(self.endpoints)]

    async def close(self) -> None:
        return None


def test_pool_keeps_workers_through_an_empty_listing_until_the_grace_runs_out(monkeypatch) -> None:
    """Redis restarted empty must not drop every worker at once: they stay (and are probed, so a
    dead one is unhealthy) until absent for longer than `absent_grace_s`."""
    from services.router import pool as pool_module

    clock = types.SimpleNamespace(now=100.0)
    monkeypatch.setattr(pool_module, "time", types.SimpleNamespace(monotonic=lambda: clock.now))

    async def main() -> None:
        registry = FakeRegistry(["127.0.0.1:5001", "127.0.0.1:5002"])
        pool = pool_module.WorkerPool(registry, absent_grace_s=10.0)
        probed: list[str] = []

        async def probe(w) -> None:
            probed.append(w.endpoint)

        pool._probe = probe  # no gRPC: only membership is under test
        try:
            await pool.refresh()
            assert sorted(pool.workers) == ["127.0.0.1:5001", "127.0.0.1:5002"]
            registry.endpoints = []  # Redis came back empty
            for clock.now in (101.0, 105.0, 110.0):
                await pool.refresh()
                assert sorted(pool.workers) == ["127.0.0.1:5001", "127.0.0.1:5002"], clock.now
            assert probed.count("127.0.0.1:5001") == 4  # still probed while absent
            registry.endpoints = ["127.0.0.1:5002"]  # its heartbeat re-registered it
            clock.now = 110.5
            await pool.refresh()
            registry.endpoints = []
            clock.now = 110.6  # 5001 absent 10.6 s > 10 s; 5002 listed 0.1 s ago
            await pool.refresh()
            assert sorted(pool.workers) == ["127.0.0.1:5002"]
            clock.now = 120.5
            await pool.refresh()
            assert sorted(pool.workers) == ["127.0.0.1:5002"]  # exactly the grace: kept
            clock.now = 120.6
            await pool.refresh()
            assert pool.workers == {}
        finally:
            await pool.close()

    asyncio.run(main())


def test_pool_rejects_a_negative_grace() -> None:
    from services.router.pool import WorkerPool

    with pytest.raises(ValueError, match="absent_grace_s"):
        WorkerPool(FakeRegistry([]), absent_grace_s=-1.0)
