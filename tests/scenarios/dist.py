#!/usr/bin/env python3
"""Record the communication scenarios of the corpus (``source="dist"`` in tests/scenarios/corpus.py): real
two-process ``torch.distributed`` jobs on the CPU (gloo), every rank running the SDK.

The jobs are ``tests/fixtures/nccl/capture.py --backend gloo`` (the recorder of issue 9, whose NCCL run
needs GPUs; on the CPU the same code runs with gloo). This file runs capture.py for the named scenarios in
a temporary folder and copies, per scenario, into ``streams_dist/<name>/``:

* ``rank<N>.events.jsonl``: what the SDK of rank N wrote through its ``file://`` endpoint, unedited;
* ``rank<N>.log``: the rank's stdout+stderr (capture.py keeps the first 60 and last 300 lines of a log
  longer than 400), and ``launcher.log`` (torchrun's console) when there is one;
* ``scenario.json``: capture.py's own record of the job (command, environment, exit codes, wall time,
  process-group timeout, hung or not) plus ``corpus_name``, ``capture_scenario``, ``recorded_with``
  (versions) and ``facts``: what the ranks said they did, parsed from the logs' ``capture[rankN]`` lines
  (which rank was SIGKILLed, lagged, got the ``inf`` sample, ran out of data, which ``MASTER_PORT`` each
  used, the numel each passed to the mismatched all-reduce) and the exit code of each rank. The tests
  read their expectations from these facts, not from constants.

Usage, from the repository root (about 2 minutes for all six; each job is under 60 s)::

    .venv/bin/python tests/scenarios/dist.py                      # every dist scenario
    .venv/bin/python tests/scenarios/dist.py dist_hang dist_timeout

Recording again gives new ids, timestamps, ports and run ids; the trainings are seeded, so the values are
the same up to thread scheduling (which rank's event carries the earlier timestamp when both ranks report
the same step within microseconds is not fixed).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
STREAMS_DIST = HERE / "streams_dist"
CAPTURE = REPO / "tests" / "fixtures" / "nccl" / "capture.py"
MAX_STREAM_BYTES = 150_000
MAX_WALL_S = 60.0

#: corpus name -> capture.py scenario. ``dist_mismatch`` is capture.py's ``mismatch_detail_manual``: the
#: ranks' gradients are all-reduced by hand under ``TORCH_DISTRIBUTED_DEBUG=DETAIL``, which is what makes
#: gloo raise "Detected mismatch between collectives" on every rank. (Without DETAIL, gloo aborts the rank
#: that receives the larger message -- ``gloo::EnforceNotMet`` ... ``Received data size doesn't match
#: expected size``, SIGABRT, nothing an SDK in that process can report -- and its peer sees a reset
#: connection; under DETAIL, DDP's constructor segfaults on torch 2.13 CPU. See the README.)
CAPTURE_NAMES: Dict[str, str] = {
    "dist_timeout": "timeout",
    "dist_mismatch": "mismatch_detail_manual",
    "dist_rank_lost": "rank_lost",
    "dist_init_failure": "init_failure",
    "dist_nan_one_rank": "nan_one_rank",
    "dist_hang": "hang",
}

_SAY_RE = re.compile(r"^capture\[rank(?P<rank>\d+)\] (?P<what>.*)$", re.MULTILINE)
_EXIT_RE = re.compile(r"^(?P<code>-?\d+)")


def parse_facts(folder: Path, record: Dict[str, Any]) -> Dict[str, Any]:
    """What the ranks of one recorded job said they did (their ``capture[rankN]`` lines) and how each
    ended (torchrun's per-rank exit codes, or each process's own for a job started without torchrun)."""
    facts: Dict[str, Any] = {"killed_ranks": [], "lagging_ranks": [], "inf_ranks": [], "inf_steps": {},
                             "out_of_data_ranks": [], "extra_batch_ranks": [], "shard_batches": {},
                             "master_ports": {}, "all_reduce_numel": {}, "exit_codes": {}}
    for log in sorted(folder.glob("rank*.log")):
        text = log.read_text(errors="replace")
        for m in _SAY_RE.finditer(text):
            rank, what = int(m.group("rank")), m.group("what")
            if what.startswith("SIGKILL to self"):
                facts["killed_ranks"].append(rank)
            elif what.startswith("lagging:"):
                facts["lagging_ranks"].append(rank)
            elif "this rank's batch has an inf feature" in what:
                facts["inf_ranks"].append(rank)
                facts["inf_steps"][str(rank)] = int(what.split()[1].rstrip(":"))
            elif what.startswith("out of data after"):
                facts["out_of_data_ranks"].append(rank)
            elif "a batch the other rank does not have" in what:
                facts["extra_batch_ranks"].append(rank)
            elif what.startswith("this rank's shard has"):
                facts["shard_batches"][str(rank)] = int(what.split()[4])
            elif what.startswith("init_process_group: MASTER_ADDR="):
                port = re.search(r"MASTER_PORT=(\d+)", what)
                if port:
                    facts["master_ports"][str(rank)] = int(port.group(1))
            elif what.startswith("entering all_reduce numel="):
                facts["all_reduce_numel"][str(rank)] = int(what.split("numel=")[1].split()[0])
    for key in ("killed_ranks", "lagging_ranks", "inf_ranks", "out_of_data_ranks", "extra_batch_ranks"):
        facts[key] = sorted(set(facts[key]))
    for rank, info in (record.get("torchrun_failures") or {}).items():
        code = _EXIT_RE.match(str(info.get("exitcode", "")))
        if code:
            facts["exit_codes"][str(rank)] = int(code.group("code"))
    for rank, code in (record.get("rank_exit_codes") or {}).items():
        facts["exit_codes"][str(rank)] = code
    return facts


def _events(path: Path) -> int:
    with open(path, encoding="utf-8") as fh:
        return sum(1 for line in fh if line.strip())


def copy_scenario(name: str, source: Path, dest: Path, env: Dict[str, Any]) -> Dict[str, Any]:
    """Copy one recorded job from capture.py's folder into the corpus; return its scenario record."""
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    for path in sorted(source.iterdir()):
        if re.fullmatch(r"rank\d+\.events\.jsonl|rank\d+\.log|launcher\.log", path.name):
            shutil.copyfile(path, dest / path.name)
    record = json.loads((source / "scenario.json").read_text())
    record.update(corpus_name=name, capture_scenario=CAPTURE_NAMES[name],
                  recorded_with={k: env.get(k) for k in ("torch", "python", "platform", "date_utc", "backend")},
                  facts=parse_facts(dest, record),
                  streams={p.name: {"events": _events(p), "bytes": p.stat().st_size}
                           for p in sorted(dest.glob("rank*.events.jsonl"))})
    record["files"] = sorted([*(p.name for p in dest.iterdir()), "scenario.json"])
    (dest / "scenario.json").write_text(json.dumps(record, indent=1) + "\n")
    return record


def check(name: str, record: Dict[str, Any]) -> List[str]:
    """What is wrong with a recording for the corpus (empty: nothing)."""
    problems = []
    streams = record["streams"]
    if len(streams) < 2:
        problems.append(f"{len(streams)} rank stream(s), expected 2")
    for file, info in streams.items():
        if info["bytes"] >= MAX_STREAM_BYTES:
            problems.append(f"{file} is {info['bytes']} bytes (limit {MAX_STREAM_BYTES})")
    if record["wall_s"] >= MAX_WALL_S:
        problems.append(f"wall {record['wall_s']} s (limit {MAX_WALL_S:g})")
    if record["hung_killed"] and not record.get("hang_expected"):
        problems.append("the job hung and was killed")
    if record.get("hang_expected") and not record["hung_killed"]:
        problems.append("the job was meant to hang but ended by itself")
    return problems


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="*", help=f"scenarios (default: all of {', '.join(CAPTURE_NAMES)})")
    parser.add_argument("--out", default=str(STREAMS_DIST), help="corpus folder (default: %(default)s)")
    ns = parser.parse_args(argv)
    names = ns.names or list(CAPTURE_NAMES)
    unknown = [n for n in names if n not in CAPTURE_NAMES]
    if unknown:
        parser.error(f"unknown scenario(s) {unknown}; known: {', '.join(CAPTURE_NAMES)}")
    out = Path(ns.out).resolve()
    with tempfile.TemporaryDirectory(prefix="tg-dist-") as tmp:
        cmd = [sys.executable, str(CAPTURE), "--backend", "gloo", "--out", tmp,
               "--only", ",".join(CAPTURE_NAMES[n] for n in names)]
        print("$", " ".join(cmd), flush=True)
        rc = subprocess.run(cmd, cwd=REPO, check=False).returncode
        if rc != 0:
            print(f"capture.py exited with {rc}", file=sys.stderr)
            return 1
        env = json.loads((Path(tmp) / "env.json").read_text())
        failed = False
        for name in names:
            source = Path(tmp) / CAPTURE_NAMES[name]
            if not (source / "scenario.json").exists():
                print(f"{name}: capture.py recorded nothing", file=sys.stderr)
                failed = True
                continue
            record = copy_scenario(name, source, out / name, env)
            problems = check(name, record)
            failed = failed or bool(problems)
            print(f"{name}: wall {record['wall_s']} s, exit codes {record['facts']['exit_codes']}, "
                  f"hung_killed={record['hung_killed']}, streams "
                  f"{ {k: v['bytes'] for k, v in record['streams'].items()} }"
                  + (f"; PROBLEMS: {'; '.join(problems)}" if problems else ""), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
