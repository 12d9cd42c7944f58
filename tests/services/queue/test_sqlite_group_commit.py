"""SqliteQueue's group commit: concurrent publishes share a transaction (one fsync) and each still gets
exactly its own contiguous offsets, acknowledged only once committed; the depth limit and a publish
SIGKILLed mid-group keep their contracts (the kill test is in test_sqlite_queue_durability.py)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Dict, List, Tuple

from trainguard_server.queue.base import QueueFull
from trainguard_server.queue.sqlite import QUEUE_DB, SqliteQueue, _Waiting


class CountingQueue(SqliteQueue):
    """The real queue, counting its transactions (how many publishes each one carried)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        self.transactions: List[int] = []
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]

    def _insert(self, waiters: List[_Waiting]) -> None:
        super()._insert(waiters)
        if waiters:
            self.transactions.append(len(waiters))


def test_concurrent_publishes_share_commits_and_keep_their_own_offsets(tmp_path: Path) -> None:
    queue = CountingQueue(tmp_path / QUEUE_DB, max_depth=10**9)
    got: Dict[Tuple[int, int], List[int]] = {}
    threads_n, each = 16, 40

    def publisher(t: int) -> None:
        for i in range(each):
            got[(t, i)] = queue.publish(f"run-{t}", [f"{t}:{i}:{j}".encode() for j in range(1 + i % 3)])

    threads = [threading.Thread(target=publisher, args=(t,)) for t in range(threads_n)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    try:
        assert sum(queue.transactions) == threads_n * each          # every publish committed once
        assert len(queue.transactions) < threads_n * each            # and some commits carried several
        records = {r.offset: r for r in queue.consume(10_000, 0.5)}
        assert len(records) == sum(1 + i % 3 for i in range(each)) * threads_n == queue.depth()
        for (t, i), offsets in got.items():
            assert offsets == list(range(offsets[0], offsets[0] + 1 + i % 3))   # contiguous, its own
            assert [records[o].value for o in offsets] == [f"{t}:{i}:{j}".encode() for j in range(1 + i % 3)]
            assert all(records[o].key == f"run-{t}" for o in offsets)
    finally:
        queue.close()


def test_the_depth_limit_holds_inside_a_group(tmp_path: Path) -> None:
    queue = SqliteQueue(tmp_path / QUEUE_DB, max_depth=10)
    results: List[object] = []
    lock = threading.Lock()

    def publisher(t: int) -> None:
        try:
            out: object = queue.publish(f"run-{t}", [b"x"] * 4)
        except QueueFull as exc:
            out = exc
        with lock:
            results.append(out)

    threads = [threading.Thread(target=publisher, args=(t,)) for t in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    try:
        accepted = [r for r in results if isinstance(r, list)]
        refused = [r for r in results if isinstance(r, QueueFull)]
        assert len(accepted) == 3 and len(refused) == 5     # 0, 4, 8 < 10 let in whole; then full
        assert queue.depth() == 12
        assert "max 10" in str(refused[0])
    finally:
        queue.close()
