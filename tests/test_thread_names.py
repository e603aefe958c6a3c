"""Pool threads carry their names into the OS, so a leak can be told from a bounded pool."""

import os
import threading

from services.common.threads import name_os_thread, named_pool


def _os_names() -> list[str]:
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f.read().strip())
        except FileNotFoundError:
            pass
    return names


def test_named_pool_threads_show_their_prefix_in_proc():
    pool = named_pool(2, "probe-pool")
    try:
        barrier = threading.Barrier(3)
        for _ in range(2):
            pool.submit(barrier.wait, 5)
        barrier.wait(5)  # both workers exist now
        assert sorted(n for n in _os_names() if n.startswith("probe-pool")) == [
            "probe-pool_0",
            "probe-pool_1",
        ]
    finally:
        pool.shutdown()


def test_long_names_are_cut_to_the_kernel_limit():
    seen = []
    t = threading.Thread(
        target=lambda: (name_os_thread(), seen.extend(_os_names())), name="a-very-long-thread-name"
    )
    t.start()
    t.join()
    assert "a-very-long-thr" in seen  # 15 bytes
