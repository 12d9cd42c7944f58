#!/usr/bin/env python3
"""The embedded SQLite queue's publish rate under concurrent publishers, this checkout beside a baseline
commit's ``queue/sqlite.py`` loaded in the same process (issue 15: small SDK-shaped requests were capped
by one fsynced transaction per publish).

    python bench/queue_publish.py                       # vs HEAD
    python bench/queue_publish.py --baseline 0454145    # vs a given commit (before group commit)

Each round: a fresh queue file (``synchronous=FULL``, the default), ``--threads`` threads publishing an
SDK-shaped request (2 records, ~900 bytes) for ``--seconds`` s; publishes/s for both, alternating.
Nothing is asserted.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, List

ROOT = Path(__file__).resolve().parent.parent
MODULE = "services/src/trainguard_server/queue/sqlite.py"


def load_baseline(ref: str) -> Any:
    source = subprocess.run(["git", "show", f"{ref}:{MODULE}"], cwd=ROOT, check=True,
                            capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp(prefix="tg-queue-base-")) / "sqlite_base.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("trainguard_server.queue.sqlite_base", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.SqliteQueue


def rate(cls: Any, threads: int, seconds: float) -> float:
    folder = tempfile.mkdtemp(prefix="tg-queue-")
    queue = cls(os.path.join(folder, "queue.db"), max_depth=10**9)
    payload = [os.urandom(600), os.urandom(300)]
    counts: List[int] = []
    stop = time.monotonic() + seconds

    def publish() -> None:
        n = 0
        while time.monotonic() < stop:
            queue.publish("run-x", payload)
            n += 1
        counts.append(n)

    workers = [threading.Thread(target=publish) for _ in range(threads)]
    started = time.monotonic()
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    elapsed = time.monotonic() - started
    queue.close()
    return sum(counts) / elapsed


def main(argv: Any = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline", default="HEAD")
    p.add_argument("--threads", type=int, default=16)
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    sys.path.insert(0, str(ROOT / "services" / "src"))
    from trainguard_server.queue.sqlite import SqliteQueue

    base = load_baseline(args.baseline)
    print(f"threads={args.threads} seconds={args.seconds} synchronous=FULL request=2 records (~900 B) "
          f"baseline={args.baseline} cpus={os.cpu_count()} load={os.getloadavg()[0]:.1f}")
    for r in range(args.rounds):
        before = rate(base, args.threads, args.seconds)
        now = rate(SqliteQueue, args.threads, args.seconds)
        print(f"round {r}: baseline {before:,.0f} publishes/s, this checkout {now:,.0f} publishes/s "
              f"({now / before:.2f}x)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
