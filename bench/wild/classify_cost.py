"""Child of ``bench/logs.py``: the classifier's cost per log line over the whole wild corpus, for the
checkout whose ``sdk/src``, ``engine/src`` and ``services/src`` are on ``sys.path``.

Every log is read by the replay reader with every line kept (``min_level=""``), each log item goes to
``classify_text`` and each traceback to ``classify_chain``, as the pipeline does with them. Prints one
JSON object: lines, seconds (best of ``--repeat``), µs per line of wall-clock time and of this process's CPU
time (``cpu_us_per_line``: what a loaded machine's scheduling does not inflate).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def one_pass(logs: list) -> int:
    from trainguard_engine.classify import classify_chain, classify_text
    from trainguard_server.replay.logs import LogReader

    lines = 0
    for path in logs:
        reader = LogReader(path, 0, min_level="")
        for item in reader:
            if item.kind == "exception":
                classify_chain(str(item.payload.get("type", "")), str(item.payload.get("message", "")),
                               item.payload.get("chain") or ())
            else:
                classify_text(item.message)
        lines += reader.stats.lines
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("corpus", type=Path)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    logs = sorted(args.corpus.glob("*/log.txt"))
    one_pass(logs)  # warm: imports, compiled regexes
    best = best_cpu = float("inf")
    lines = 0
    for _ in range(args.repeat):
        t0, c0 = time.perf_counter(), time.process_time()
        lines = one_pass(logs)
        best = min(best, time.perf_counter() - t0)
        best_cpu = min(best_cpu, time.process_time() - c0)
    print(json.dumps({"logs": len(logs), "lines": lines, "seconds": best,
                      "us_per_line": 1e6 * best / max(lines, 1),
                      "cpu_us_per_line": 1e6 * best_cpu / max(lines, 1)}))


if __name__ == "__main__":
    main()
