#!/usr/bin/env python3
"""Record every CPU scenario training of the corpus (tests/scenarios/corpus.py) as a real event stream in
``streams/``.

Each ``streams/<scenario>.jsonl`` is exactly what the SDK of the real training process wrote through its
``file://`` endpoint (one envelope per line, the JSON mapping of docs/wire-format.md), nothing edited.
The SDK is configured only through the environment, as a user's job would be; the one option set here is
``TRAINGUARD_WATCH_OVERHEAD_BUDGET=0`` (read the gradient norm at every step: these models are so small
that the norm pass is a visible share of a CPU step, so the default budget would thin the norms out; a
user debugging a run does the same).

Usage, from the repository root (about 30 s for all)::

    .venv/bin/python tests/scenarios/record.py                 # every scenario
    .venv/bin/python tests/scenarios/record.py explosion       # some of them

Recording again gives new ids, timestamps and run ids, and (thread scheduling aside) the same values:
every training is seeded. The tests assert what the trainings guarantee, read from the streams.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, List, Optional, Sequence

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
STREAMS = HERE / "streams"
MAX_STREAM_BYTES = 150_000

sys.path.insert(0, str(REPO))
from tests.scenarios.corpus import BY_NAME, of_source  # noqa: E402

SCENARIOS = tuple(s.name for s in of_source("cpu"))

SCENARIO_ENV: Dict[str, Dict[str, str]] = {
    # a hang (tests/scenarios/trainings_process.py): a heartbeat every second, so that the stall is seen
    # within a second of the detection threshold; the scenario's watchdog SIGTERMs the hung process after
    # 12 s without a step (long enough for a 5 s stall floor, the benchmark's default)
    "stall": {"TRAINGUARD_HEARTBEAT_INTERVAL": "1", "SCENARIO_STALL_LIMIT_S": "12"},
}
"""Environment added for one scenario, on top of :func:`scenario_env`'s."""
EXIT_CODES: Dict[str, int] = {"crash": 1, "stall": -signal.SIGTERM}
"""How a scenario's process ends (``subprocess`` return code) when it is not 0."""


def scenario_env(name: str, endpoint: str, spool: str) -> Dict[str, str]:
    """The environment a scenario training runs with: the SDK configured only through ``TRAINGUARD_*``
    variables, sending to ``endpoint`` (a URL), plus :data:`SCENARIO_ENV`'s for ``name``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD_")}
    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "SCENARIO_DEBUG"):
        env.pop(var, None)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "sdk" / "src"), str(REPO)])
    env["TRAINGUARD_ENDPOINT"] = endpoint
    env["TRAINGUARD_PROJECT"] = "scenarios"
    env["TRAINGUARD_SPOOL_DIR"] = spool
    env["TRAINGUARD_FLUSH_INTERVAL"] = "0.25"
    env["TRAINGUARD_WATCH_OVERHEAD_BUDGET"] = "0"
    env.update(SCENARIO_ENV.get(name, {}))
    return env


def _read(path: Path) -> List[Dict[str, object]]:
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def record(name: str, tmp: str, seed: int = 0, out_dir: Path = STREAMS) -> Path:
    """Run scenario ``name`` (with ``seed``) with the SDK writing to a file; copy the stream into
    ``out_dir`` (default ``streams/``, where only seed 0 belongs)."""
    endpoint = Path(tmp) / f"{name}-{seed}.jsonl"
    proc = subprocess.run([sys.executable, "-m", BY_NAME[name].module, name, "--seed", str(seed)],
                          env=scenario_env(name, endpoint.resolve().as_uri(), tmp), cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    if proc.returncode != EXIT_CODES.get(name, 0):
        raise SystemExit(f"{name}: exit code {proc.returncode} (expected {EXIT_CODES.get(name, 0)})\n"
                         f"{proc.stderr[-2000:]}")
    events = _read(endpoint)
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / (f"{name}.jsonl" if seed == 0 else f"{name}.seed{seed}.jsonl")
    with open(out, "w", encoding="utf-8") as fh:
        for event in events:
            fh.write(json.dumps(event, separators=(",", ":"), ensure_ascii=False) + "\n")
    size = out.stat().st_size
    if size > MAX_STREAM_BYTES:
        raise SystemExit(f"{out} is {size} bytes (> {MAX_STREAM_BYTES}): use fewer steps")
    return out


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("only", nargs="*", help=f"scenarios to record (default: all of {', '.join(SCENARIOS)})")
    parser.add_argument("--seed", type=int, default=0, help="seed offset of the trainings (0: the committed "
                        "streams); other seeds go to --out as <scenario>.seed<N>.jsonl")
    parser.add_argument("--out", type=Path, default=STREAMS, help="output folder (default: streams/)")
    args = parser.parse_args(argv)
    if args.seed != 0 and args.out.resolve() == STREAMS:
        parser.error("other seeds are for evaluation: write them elsewhere with --out")
    unknown = sorted(set(args.only) - set(SCENARIOS))
    if unknown:
        parser.error(f"unknown scenarios {unknown}; choose from {list(SCENARIOS)}")
    with tempfile.TemporaryDirectory(prefix="tg-scenarios-") as tmp:
        for name in args.only or SCENARIOS:
            out = record(name, tmp, args.seed, args.out)
            print(f"{out}: {len(_read(out))} events, {out.stat().st_size} bytes", flush=True)


if __name__ == "__main__":
    main()
