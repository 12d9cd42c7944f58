#!/usr/bin/env python3
"""The Flink job's run state at a bundle's end (issue 20): pickling a run's ``PipelineBox`` the way the
PyFlink state backend does, this checkout's way (the box merges the pipeline's changed snapshot parts: a run
re-encodes only the ranks touched since the last pickling) beside the previous way (the whole pipeline as
one ``Pipeline.snapshot()``, every rank encoded), in one process on the same box.

One ``--ranks``-rank run (bench/processor.py's SDK-shaped stream, kept live: no EXIT) is fed to a
``RunStage`` step by step; after the starts and ``--steps`` steps of every rank the box is pickled once
(everything is new: both ways encode every rank), then after one step of 1/16 of the ranks and after one
step of every rank it is pickled again, each way timed ``--repeat`` times (best). Printed per stop: the
seconds and bytes of each way and their ratio. The pickled state restores to the live pipeline byte for
byte (tests/services/processor/test_flink_stages.py asserts it; here it is checked once per stop).

    python bench/flink_state.py                  # 4,096 ranks, ~1-2 minutes on 2 cores
    python bench/flink_state.py --ranks 512      # smaller

Nothing is asserted beyond that check; numbers and ratios are printed.
"""

from __future__ import annotations

import argparse
import os
import pickle
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Tuple

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
for _src in (BENCH, REPO / "sdk" / "src", REPO / "engine" / "src", REPO / "services" / "src"):
    if str(_src) not in sys.path:
        sys.path.insert(0, str(_src))

from processor import sdk_requests  # noqa: E402  (bench/processor.py)

from trainguard import wire  # noqa: E402
from trainguard_server.processor.flink_stages import PipelineBox, RunStage  # noqa: E402


def whole_way(box: PipelineBox) -> bytes:
    """The state as pickled before this change: the whole pipeline as one snapshot."""
    return pickle.dumps({"snapshot": box.pipeline.snapshot(), "overrides": box.overrides,
                         "pending": box.pending, "pending_events": box.pending_events, "due_ms": box.due_ms,
                         "timer_ms": box.timer_ms, "tick_ms": box.tick_ms})


def best(fn: Callable[[], bytes], repeat: int) -> Tuple[float, int]:
    took, size = float("inf"), 0
    for _ in range(repeat):
        t0 = time.perf_counter()
        size = len(fn())
        took = min(took, time.perf_counter() - t0)
    return took, size


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=4096)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args()
    ranks = args.ranks
    requests = list(sdk_requests("bench", "flink-state", ranks, args.steps + 2))[:-ranks]  # no EXIT
    values = [wire.prepare_batch(batch).request.SerializeToString() for batch in requests]
    stage = RunStage(flush_events=1 << 30)  # folded at each stop, as a bundle's end would
    box = stage.box(None)
    partial = max(1, ranks // 16)
    first = (1 + args.steps) * ranks
    stops: List[Tuple[str, int]] = [(f"starts + {args.steps} steps, every rank new", first),
                                    ("one step of 1/16 of the ranks", first + partial),
                                    ("the rest of that step (15/16 of the ranks)", first + ranks)]
    print(f"# bench/flink_state.py ranks={ranks} steps={args.steps} repeat={args.repeat} "
          f"cpus={os.cpu_count()} loadavg_1m={os.getloadavg()[0]:.1f}", flush=True)
    done = 0
    figures: Dict[str, Any] = {}
    for label, end in stops:
        for payload in values[done:end]:
            stage.on_record(box, payload)
        stage.flush(box)
        done = end
        # the previous way first: it leaves the pipeline's touched ranks as they are
        whole_s, whole_b = best(lambda: whole_way(box), args.repeat)
        t0 = time.perf_counter()
        stored = pickle.dumps(box)  # this checkout's way, once: it marks the parts saved
        parts_s = time.perf_counter() - t0
        assert pickle.loads(stored).pipeline.snapshot() == box.pipeline.snapshot()
        figures[label] = (parts_s, whole_s)
        print(f"stop={label!r}: parts {parts_s:.3f} s {len(stored)} B | whole snapshot {whole_s:.3f} s "
              f"{whole_b} B | parts/whole time {parts_s / whole_s:.2f}x", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
