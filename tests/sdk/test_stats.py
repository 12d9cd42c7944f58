"""SdkStats: door drops (lock-free) and locked drops are both counted exactly, whatever thread counts them."""

from __future__ import annotations

import threading

from trainguard.stats import SdkStats


def test_door_drops_from_many_threads_fold_exactly_while_read_concurrently() -> None:
    stats = SdkStats()
    threads, per_thread = 4, 20_000
    stop = threading.Event()
    seen = []

    def reader() -> None:  # reads fold the door counter while the droppers are still counting
        while not stop.is_set():
            seen.append(stats.dropped["queue_full"])

    def dropper() -> None:
        for _ in range(per_thread):
            stats.door_drop()
        stats.drop("encode_error")

    watcher = threading.Thread(target=reader)
    watcher.start()
    workers = [threading.Thread(target=dropper) for _ in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    stop.set()
    watcher.join()
    assert stats.dropped["queue_full"] == threads * per_thread
    assert stats.dropped["queue_full"] == threads * per_thread  # a second read adds nothing
    assert stats.dropped_total == threads * per_thread + threads
    assert stats.snapshot()["dropped.queue_full"] == float(threads * per_thread)
    assert seen == sorted(seen) and max(seen, default=0) <= threads * per_thread  # never over-counted


def test_queue_full_through_drop_and_door_add_up() -> None:
    stats = SdkStats()
    stats.door_drop()
    stats.drop("queue_full", 3)
    stats.door_drop()
    assert stats.dropped["queue_full"] == 5
    assert stats.snapshot()["dropped"] == 5.0
