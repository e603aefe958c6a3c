"""Worker registry against a real redis-server: round trip, validation, TTL expiry, deregistration,
refill after a Redis restart, last-known state through an outage, and the static registry."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterator

import pytest
import redis
import redis.asyncio as aioredis

from services.registry import Heartbeat, RedisRegistry, StaticRegistry, WorkerRecord, make_registry
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
