"""The startup heap frozen out of the collector's scans (engine/gc_heap.py) and collections timed
into Prometheus (services/common/metrics.py GcPauses). The stacks' processes freeze theirs and
export both series: tests/test_services_scale.py."""

from __future__ import annotations

import gc
import weakref

import pytest

from engine.gc_heap import freeze_startup_heap
from services.common.metrics import Metrics
from tests.service_testing import metric


class _Node:
    def __init__(self):
        self.me = self  # a reference cycle: only the collector frees it


@pytest.fixture
def unfreeze():
    """This test process must not keep a frozen heap: other tests' cycles would never be freed."""
    assert gc.get_freeze_count() == 0
    yield
    gc.unfreeze()


def test_freeze_collects_garbage_first_then_takes_the_rest_out_of_every_scan(unfreeze):
    dead, kept = _Node(), _Node()
    dead_ref = weakref.ref(dead)
    del dead
    frozen = freeze_startup_heap()
    assert dead_ref() is None  # garbage then is not frozen in
    # A frozen object freed since (its last reference dropped, here or by another thread of this
    # process: a test worker's) leaves the count: a few may go, none may come.
    assert frozen > 0 and frozen - 1000 < gc.get_freeze_count() <= frozen
    assert all(o is not kept for o in gc.get_objects())  # no collection walks it now
    after = _Node()
    assert any(o is after for o in gc.get_objects())  # what comes later is scanned as before
    after_ref = weakref.ref(after)
    del after
    gc.collect()
    assert after_ref() is None


def test_collections_are_timed_by_generation_and_the_frozen_count_is_exported(unfreeze):
    m = Metrics("router")
    stop = m.watch_gc()
    try:
        before = metric(m.exposition().decode(), "pdserve_gc_pause_seconds_count", generation="2")
        gc.collect()
        gc.collect(1)
        text = m.exposition().decode()
        assert metric(text, "pdserve_gc_pause_seconds_count", generation="2") == before + 1
        assert metric(text, "pdserve_gc_pause_seconds_count", generation="1") >= 1
        assert metric(text, "pdserve_gc_pause_seconds_sum", generation="2") > 0
        assert metric(text, "pdserve_gc_frozen_objects") == 0
        inf = metric(text, "pdserve_gc_pause_seconds_bucket", generation="2", le="+Inf")
        assert inf == metric(text, "pdserve_gc_pause_seconds_count", generation="2")
        freeze_startup_heap()
        frozen = gc.get_freeze_count()
        text = m.exposition().decode()
        # Frozen objects that die leave the count (another thread's, meanwhile): it only falls.
        assert frozen >= metric(text, "pdserve_gc_frozen_objects") >= gc.get_freeze_count() > 0
    finally:
        stop()
    gc.collect()
    assert "pdserve_gc_pause_seconds" not in m.exposition().decode()
