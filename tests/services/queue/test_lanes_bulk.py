"""common.Lanes' bulk paths -- ``extend`` (a lane's consecutive records at once, as the SQLite queue reads
them) and ``take``'s one-lane shortcut -- hand out exactly what ``add`` one record at a time and the
round-robin turns do, through random interleavings of adds, takes and commits."""

from __future__ import annotations

import random
from typing import List, Tuple

import pytest

from trainguard_server.queue.common import Lanes


class _Reference(Lanes[int]):
    """Lanes with the bulk paths replaced by the one-record-at-a-time ones."""

    def extend(self, lane: int, entries):  # type: ignore[no-untyped-def,override]
        for offset, item in entries:
            self.add(lane, offset, item)

    def take(self, n: int) -> List[Tuple[int, int, int]]:
        out: List[Tuple[int, int, int]] = []
        turns, waiting = self._turns, self._waiting
        while len(out) < n and turns:
            lane = turns.popleft()
            mine = waiting[lane]
            offset, item = mine.popleft()
            out.append((lane, offset, item))
            if mine:
                turns.append(lane)
            else:
                del waiting[lane]
        self._count -= len(out)
        return out


@pytest.mark.parametrize("seed", range(40))
def test_bulk_paths_hand_out_what_one_at_a_time_does(seed: int) -> None:
    rng = random.Random(seed)
    lanes_used = rng.choice([1, 1, 2, 3, 8])
    mine, ref = Lanes[int](), _Reference()
    nxt = {lane: 1 for lane in range(lanes_used)}
    for _ in range(200):
        op = rng.random()
        if op < 0.45:
            lane = rng.randrange(lanes_used)
            k = rng.randint(0, 12)
            start = nxt[lane] - (rng.randint(0, 3) if rng.random() < 0.2 else 0)  # some already committed
            entries = [(start + i, rng.randint(0, 9)) for i in range(k)]
            nxt[lane] = max(nxt[lane], start + k)
            mine.extend(lane, entries)
            ref.extend(lane, entries)
        elif op < 0.85:
            n = rng.randint(1, 20)
            assert mine.take(n) == ref.take(n)
        else:
            lane = rng.randrange(lanes_used)
            top = rng.randint(0, nxt[lane])
            assert mine.committed(lane, top) == ref.committed(lane, top)
        assert len(mine) == len(ref)
    assert mine.take(10_000) == ref.take(10_000)
    assert len(mine) == 0
