#!/usr/bin/env python3
"""Run the corpus's trainings (or some of them) and keep what each one's SDK sent and its ground truth.

Each run is its own process, as a user's job is: a child forked from this one (torch, transformers, peft
and Lightning imported once, before the fork, so a run costs its training and not the imports), configured
only through ``TRAINGUARD_*`` variables (``trainings.environment_for``: a ``file://`` endpoint, the SDK's
defaults for everything else, its overhead budget included), ending through the interpreter's exit
functions (the SDK's exit capture sends the EXIT event). Per run ``OUT/<id>.jsonl`` is the stream the SDK
wrote, ``OUT/<id>.truth.json`` the trace measured beside it, ``OUT/<id>.log`` what it printed.

    python -m bench.corpus.record                     # all 678 runs, 2 at a time (~20 min on 2 cores)
    python -m bench.corpus.record --only r000,r101    # some
    python -m bench.corpus.record --split dev --jobs 2
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Dict, List, Optional, Sequence

REPO = Path(__file__).resolve().parents[2]
DEFAULT_OUT = REPO / "bench" / "corpus" / "out"


def _child(spec_dict: Dict[str, object], out: Path) -> None:
    """In the forked child: train, write the truth, exit like a process does (never returns)."""
    code = 0
    try:
        log = os.open(out / f"{spec_dict['id']}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        from bench.corpus import trainings
        from bench.corpus.manifest import RunSpec

        spec = RunSpec.from_dict(spec_dict)
        stream = out / f"{spec.id}.jsonl"
        if stream.exists():
            stream.unlink()
        spool = out / "spool" / spec.id
        spool.mkdir(parents=True, exist_ok=True)
        os.environ.update(trainings.environment_for(stream.resolve().as_uri(), str(spool)))
        started = time.perf_counter()
        truth = trainings.run(spec)
        truth_doc = {"spec": spec.to_dict(), "seconds": time.perf_counter() - started, "truth": truth}
        (out / f"{spec.id}.truth.json").write_text(json.dumps(truth_doc), encoding="utf-8")
    except BaseException:
        traceback.print_exc()
        code = 1
    try:
        atexit._run_exitfuncs()  # what the interpreter does on exit: the SDK's exit event and flush
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def record(specs: Sequence[Dict[str, object]], out: Path, jobs: int = 2) -> Dict[str, int]:
    """Run every spec in its own forked process, ``jobs`` at a time; the exit code of each."""
    import peft  # noqa: F401
    import pytorch_lightning  # noqa: F401
    import torch  # noqa: F401  imported once, before the forks
    import transformers  # noqa: F401

    out.mkdir(parents=True, exist_ok=True)
    pending = list(specs)
    running: Dict[int, str] = {}
    codes: Dict[str, int] = {}
    while pending or running:
        while pending and len(running) < jobs:
            spec = pending.pop(0)
            pid = os.fork()
            if pid == 0:
                _child(spec, out)
            running[pid] = str(spec["id"])
        pid, status = os.wait()
        run_id = running.pop(pid, None)
        if run_id is not None:
            codes[run_id] = os.waitstatus_to_exitcode(status)
            done = len(codes)
            print(f"[{done}/{len(specs)}] {run_id} exit {codes[run_id]}", flush=True)
    return codes


def main(argv: Optional[Sequence[str]] = None) -> int:
    sys.path.insert(0, str(REPO))
    from bench.corpus import manifest

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--only", default="", help="comma-separated run ids")
    parser.add_argument("--split", choices=("dev", "test", "all"), default="all")
    parser.add_argument("--cause", default="", help="only runs of these planted causes (comma-separated)")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    specs: List[manifest.RunSpec] = manifest.load()
    if args.only:
        wanted = set(args.only.split(","))
        specs = [s for s in specs if s.id in wanted]
    if args.split != "all":
        specs = [s for s in specs if s.split == args.split]
    if args.cause:
        causes = set(args.cause.split(","))
        specs = [s for s in specs if s.cause in causes]
    started = time.perf_counter()
    codes = record([s.to_dict() for s in specs], args.out, args.jobs)
    failed = sorted(k for k, v in codes.items() if v != 0)
    print(f"{len(codes)} runs in {time.perf_counter() - started:.0f} s; failed: {failed or 'none'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
