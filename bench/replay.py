#!/usr/bin/env python3
"""Throughput and memory of ``trainguard replay``'s readers, beside the importer before issue 19, in one run.

Inputs (generated in a temporary folder, seeded):

* a **metrics JSON-lines file of ``--rows`` (1,000,000) rows** as users write them: ``step``, ``time``,
  ``train/loss``, ``grad_norm``, ``learning_rate``, per-layer norms nested under ``grad_norms`` (4 layers),
  a boolean ``clipped``, ``rss_mib``, ``step_time_ms`` (~250 bytes a row);
* a **TensorBoard log of ``--tb-mb`` (100) MB**: one run written with
  ``torch.utils.tensorboard.SummaryWriter`` (8 scalars a step), its event file's records repeated until
  the size is reached (a valid TFRecord stream: the steps start again, as after a restart).

Each measurement runs ``Importer(...).run()`` in a fresh child process against a backend that accepts and
drops every batch (reading, recognition, envelopes and batching are measured; no store), and prints rows/s,
MB/s, the child's RSS after its imports and its peak RSS (``VmHWM``): a streamed import's peak stays
near the baseline whatever the file size. ``--ref`` (default: the commit before issue 19's first) is
checked out in a ``git worktree`` and its importer measured on the JSON-lines file in the same run (it
has no TensorBoard reader). Alternating this / ref, ``--repeat`` (1) times each.

    python bench/replay.py [--rows 1000000] [--tb-mb 100] [--ref COMMIT] [--repeat 1]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

REPO = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------------------------ child


def _hwm_kb() -> float:
    """This process's peak RSS (``VmHWM``; ``ru_maxrss`` would include the parent's size at the fork)."""
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return float(line.split()[1])
    except OSError:
        pass
    return float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)


def child(kind: str, path: str) -> None:
    """In a fresh process: import one input with a dropping backend, print a JSON result line."""
    from trainguard.transport.base import SendResult
    from trainguard_server.replay import Importer, ReplayOptions
    from trainguard_server.replay.backends import Backend

    class Drop(Backend):
        description = "nowhere"

        def send(self, events: Sequence[Dict[str, Any]], timeout: float) -> SendResult:
            return SendResult(accepted=len(events), duplicates=0, rejected=[])

    if kind == "jsonl":
        options = ReplayOptions(run_id="bench", metrics=[(0, Path(path))])
    else:
        options = ReplayOptions(run_id="bench", inputs=[(0, Path(path), kind)])  # type: ignore[call-arg]
    base_kb = _hwm_kb()
    started = time.perf_counter()
    summary = Importer(options, Drop()).run()
    seconds = time.perf_counter() - started
    peak_kb = _hwm_kb()
    src = summary.sources[0]
    rows = src.metrics.records if src.metrics is not None else 0
    print(
        json.dumps(
            {
                "rows": rows,
                "seconds": seconds,
                "events": summary.sent,
                "error": summary.error,
                "base_mb": base_kb / 1024,
                "peak_mb": peak_kb / 1024,
            }
        )
    )


def measure(checkout: Path, kind: str, path: Path) -> Dict[str, Any]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(str(checkout / d / "src") for d in ("sdk", "engine", "services"))
    for key in [k for k in env if k.startswith("TRAINGUARD_")]:
        del env[key]
    done = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--child", kind, str(path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=3600,
    )
    if done.returncode != 0:
        return {"error": (done.stderr.strip().splitlines() or ["failed"])[-1]}
    result: Dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


# ----------------------------------------------------------------------------------------------- inputs


def write_jsonl(path: Path, rows: int) -> None:
    rng = random.Random(19)
    t0 = 1_772_366_400.0
    with open(path, "w", encoding="utf-8") as fh:
        for step in range(rows):
            loss = 2.0 * math.exp(-step / 200_000) + 0.05 * rng.random()
            row = {
                "step": step,
                "time": round(t0 + 0.25 * step, 6),
                "train/loss": loss,
                "grad_norm": 1.0 + 0.1 * rng.random(),
                "learning_rate": 3e-4,
                "grad_norms": {
                    f"model.layers.{i}.mlp.weight": 0.1 * (i + 1) * rng.random() for i in range(4)
                },
                "clipped": rng.random() < 0.1,
                "rss_mib": 2048.0 + step / 1e4,
                "step_time_ms": 250.0 + rng.random(),
            }
            fh.write(json.dumps(row) + "\n")


def write_tensorboard(folder: Path, megabytes: float) -> Path:
    from tensorboard.compat.tensorflow_stub import pywrap_tensorflow
    from torch.utils.tensorboard import SummaryWriter

    try:
        import crc32c

        pywrap_tensorflow.crc32c = crc32c.crc32c  # the writer's checksum in C (same CRC-32C)
    except ImportError:
        pass
    rng = random.Random(19)
    one = folder / "one"
    writer = SummaryWriter(str(one))
    for step in range(20_000):
        writer.add_scalar("train/loss", 2.0 * math.exp(-step / 5000) + 0.05 * rng.random(), step)
        writer.add_scalar("train/grad_norm", 1.0 + 0.1 * rng.random(), step)
        writer.add_scalar("train/learning_rate", 3e-4, step)
        for i in range(4):
            writer.add_scalar(f"grad_norm/model.layers.{i}.weight", 0.1 * (i + 1) * rng.random(), step)
        writer.add_scalar("rss_mib", 2048.0 + step / 100, step)
    writer.close()
    (source,) = list(one.iterdir())
    data = source.read_bytes()
    run = folder / "tb"
    run.mkdir()
    target = run / "events.out.tfevents.1772366400.bench.1"
    with open(target, "wb") as fh:
        while fh.tell() < megabytes * 1e6:
            fh.write(data)
    return run


def _size(path: Path) -> int:
    return (
        sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
        if path.is_dir()
        else path.stat().st_size
    )


def first_issue_commit() -> str:
    log = subprocess.run(
        ["git", "-C", str(REPO), "log", "--reverse", "--format=%H", "--grep", "^Issue 19:"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    ref = f"{log[0]}^" if log else "HEAD"
    return subprocess.run(["git", "-C", str(REPO), "rev-parse", ref], capture_output=True, text=True,
                          check=True).stdout.strip()


def report(name: str, got: Dict[str, Any], size: int) -> Optional[float]:
    if got.get("error"):
        print(f"  {name:<40} ERROR {got['error']}")
        return None
    s = got["seconds"]
    print(
        f"  {name:<40} {got['rows']:>9,} rows in {s:6.1f} s: {got['rows'] / s:>9,.0f} rows/s, "
        f"{size / 1e6 / s:6.2f} MB/s; RSS after imports {got['base_mb']:.0f} MB, "
        f"peak {got['peak_mb']:.0f} MB "
        f"(file {size / 1e6:.0f} MB)"
    )
    return float(got["rows"] / s)


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--tb-mb", type=float, default=100.0)
    ap.add_argument("--ref", help="the importer to compare with (default: before issue 19)")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--child", nargs=2, metavar=("KIND", "PATH"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(*args.child)
        return 0
    ref = args.ref or first_issue_commit()
    with tempfile.TemporaryDirectory(prefix="tg-replay-bench-") as tmp:
        folder = Path(tmp)
        jsonl = folder / "metrics.jsonl"
        started = time.perf_counter()
        write_jsonl(jsonl, args.rows)
        tb = write_tensorboard(folder, args.tb_mb)
        print(
            f"inputs: {jsonl.name} {args.rows:,} rows, {_size(jsonl) / 1e6:.0f} MB; TensorBoard "
            f"{_size(tb) / 1e6:.0f} MB ({time.perf_counter() - started:.0f} s to write)"
        )
        wt = folder / "ref"
        subprocess.run(
            ["git", "-C", str(REPO), "worktree", "add", "--detach", str(wt), ref],
            check=True,
            capture_output=True,
        )
        try:
            rates: Dict[str, List[float]] = {"this": [], "ref": []}
            for _ in range(args.repeat):
                rate = report("JSONL, this checkout", measure(REPO, "jsonl", jsonl), _size(jsonl))
                if rate:
                    rates["this"].append(rate)
                rate = report(f"JSONL, importer at {ref[:12]}", measure(wt, "jsonl", jsonl), _size(jsonl))
                if rate:
                    rates["ref"].append(rate)
                report("TensorBoard, this checkout", measure(REPO, "tensorboard", tb), _size(tb))
                print(f"  TensorBoard, importer at {ref[:12]}: no TensorBoard reader (JSON lines only)")
            if rates["this"] and rates["ref"]:
                print(f"JSONL rows/s this / {ref[:12]}: {max(rates['this']) / max(rates['ref']):.2f}x")
        finally:
            subprocess.run(
                ["git", "-C", str(REPO), "worktree", "remove", "--force", str(wt)], capture_output=True
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
