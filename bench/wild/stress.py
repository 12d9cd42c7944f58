"""Stress variants of the TUNED part's pastes (issue 17): the same paste with another rank's watchdog timeout
before / inside / after it, a torchrun banner or DeepSpeed launcher lines around it, Ray / rank / timestamp
prefixes on every line, Windows line endings, wrapped at 80 / 120 columns, its traceback cut at the top.

Each variant is imported as its own run (in process, ``judge.replay_all``); prints every variant that loses
the category the paste's recorded verdict got right, and a count per variant. Only tuned logs whose recorded
verdict has the right category are used; the held-out part is never read. Variants live in a temporary
directory, never in the corpus.

    python bench/wild/stress.py memory/cuda-error
    python bench/wild/stress.py comm/timeout,process/exit
    python bench/wild/stress.py --formats memory/oom,process/exit   # a launcher / runner tag on every line
    python bench/wild/stress.py --formats --only=vllm_record,pdsh_host memory/oom   # those tags only

A tuned paste added after the last ``bench/logs.py --record`` (no recorded verdict yet) is left out.
"""

from __future__ import annotations

import json
import re
import sys
import tempfile
from collections import Counter
from datetime import datetime, timedelta
from pathlib import Path
from typing import Iterator, List, Optional, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.wild import corpus, judge

PEER_TIMEOUT = [
    "[rank5]:[E ProcessGroupNCCL.cpp:563] [Rank 5] Watchdog caught collective operation timeout: WorkNCCL("
    "SeqNum=1201, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=1800000) ran for 1800431 milliseconds "
    "before timing out.",
    "[rank5]:[E ProcessGroupNCCL.cpp:577] [Rank 5] Some NCCL operations have failed or timed out. Due to the "
    "asynchronous nature of CUDA kernels, subsequent GPU operations might run on corrupted/incomplete data."]
TORCHRUN_BANNER = [
    "WARNING:torch.distributed.run:", "*****************************************",
    "Setting OMP_NUM_THREADS environment variable for each process to be 1 in default, to avoid your "
    "system being overloaded, please further tune the variable for optimal performance in your application "
    "as needed.",
    "*****************************************"]
DS_BEFORE = [
    "[{t},123] [INFO] [launch.py:146:main] WORLD INFO DICT: {{'localhost': [0, 1, 2, 3]}}",
    "[{t},124] [INFO] [launch.py:163:main] dist_world_size=4"]
DS_AFTER = [
    "[{t},123] [INFO] [launch.py:315:sigkill_handler] Killing subprocess 1234",
    "[{t},125] [ERROR] [launch.py:321:sigkill_handler] ['/usr/bin/python', '-u', 'train.py', "
    "'--local_rank=3'] exits with return code = 1"]
DS_DEFAULT = (datetime(2024, 3, 1, 10, 0, 1), datetime(2024, 3, 1, 10, 0, 2))
"""Where DeepSpeed's launcher lines go when the paste carries no full date of its own."""
_DATE_RE = re.compile(r"(?<!\d)(20\d\d)[-/](\d\d)[-/](\d\d)[ T_](\d\d):(\d\d):(\d\d)")
_GLOG_RE = re.compile(r"(?<![\w.])[IWEF](\d{1,2})(\d\d) (\d\d):(\d\d):(\d\d)")
"""c10's yearless glog stamp (``[E131 16:15:16.707 ...``): the reader gives it the year of the file's
modification time when no line carries a full date -- a variant's file is written now."""
Variant = Tuple[str, Optional[List[str]]]


def _paste_span(lines: List[str]) -> Tuple[datetime, datetime]:
    """The first and last full date-times a paste prints (``2023-05-20 12:09:28``, ISO ``T``, torchrun's
    ``2023-06-14_22:36:10``), else its glog stamps' (:data:`_GLOG_RE`), else :data:`DS_DEFAULT`."""
    seen: List[datetime] = []
    for s in lines:
        for m in _DATE_RE.finditer(s):
            try:
                y, mo, d, h, mi, sec = (int(g) for g in m.groups())
                seen.append(datetime(y, mo, d, h, mi, sec))
            except ValueError:
                continue
    if not seen:
        year = datetime.now().year
        for s in lines:
            for m in _GLOG_RE.finditer(s):
                try:
                    mo, d, h, mi, sec = (int(g) for g in m.groups())
                    seen.append(datetime(year, mo, d, h, mi, sec))
                except ValueError:
                    continue
    return (min(seen), max(seen)) if seen else DS_DEFAULT


def ds_around(lines: List[str]) -> List[str]:
    """DeepSpeed's launcher banner one second before the paste's first date and its teardown one second after
    its last (stop 38's variant stamped them 2024-03-01, months from most pastes' own dates, and five minutes
    apart: the earliest-signal rules read the launcher's lines as far from the error, a bench artefact)."""
    first, last = _paste_span(lines)
    before = (first - timedelta(seconds=1)).strftime("%Y-%m-%d %H:%M:%S")
    after = (last + timedelta(seconds=1)).strftime("%Y-%m-%d %H:%M:%S")
    return [x.format(t=before) for x in DS_BEFORE] + lines + [x.format(t=after) for x in DS_AFTER]


def variants(lines: List[str]) -> Iterator[Variant]:
    """(name, lines) per variant; lines None: the paste with Windows line endings."""
    yield "rankprefix", ["[rank3]: " + s for s in lines]
    yield "raypid", ["(RayTrainWorker pid=4321) " + s for s in lines]
    yield "raypid_ip", ["(pid=4321, ip=10.0.0.2) " + s for s in lines]
    yield "stamp", [f"2024-03-01 10:00:{i % 60:02d},123 - " + s for i, s in enumerate(lines)]
    yield "crlf", None
    yield "wd_after", lines + PEER_TIMEOUT
    yield "wd_before", PEER_TIMEOUT + lines
    mid = len(lines) // 2
    yield "wd_mid", lines[:mid] + PEER_TIMEOUT + lines[mid:]
    yield "torchrun_banner", TORCHRUN_BANNER + lines
    yield "ds_around", ds_around(lines)
    tb = [i for i, s in enumerate(lines) if "Traceback (most recent call last)" in s]
    if tb:
        yield "cut_top", lines[tb[0] + 3:]
    for width in (80, 120):
        out: List[str] = []
        for s in lines:
            out.extend([s[i:i + width] for i in range(0, max(len(s), 1), width)])
        yield f"wrap{width}", out


FORMATS: Tuple[Tuple[str, str], ...] = (
    ("default", "[default0]:"),
    ("default_rank", "[default0]:[rank3]: "),
    ("tasklabel", "3: "),
    ("mpi_tag", "[1,3]<stderr>:"),
    ("iso", "{iso}.123456789Z "),
    ("ansi_ray", "\x1b[36m(RayTrainWorker pid=4321, ip=10.0.0.2)\x1b[0m "),
    ("ray_residue", "[36m(RayTrainWorker pid=4321, ip=10.0.0.2)[0m "),
    ("host_rank", "worker-5: [rank3]: "),
    ("quote", "> "),
    ("stderr", "stderr: "),
    ("syslog", "Oct 16 02:07:00 "),
    ("aml", "{t} [job-x-worker-1, unknown_ip] "),
    ("trainer_tag", "[trainer0|0]:"),
    ("skypilot", "(task-name, pid=18593) "),
    ("vllm_worker", "(VllmWorker rank=1 pid=12231) "),
    ("compose", "trainer-worker-1  | "),
    ("kubectl_prefix", "[pod/train-worker-0/pytorch] "),
    ("bracket_stamp", "[{t}] "),
    ("vllm_record", "ERROR {md} [multiproc_executor.py:374] "),
    ("vllm_worker_record", "(VllmWorker rank=1 pid=12231) ERROR {md} [multiproc_executor.py:374] "),
    ("sglang", "[{t} DP4 TP4] "),
    ("pdsh_host", "gpu-q-13: "),
    ("vllm_v1_worker", "(Worker_DP0_TP0_EP0 pid=5609) "),
    ("vllm_v1_record", "(Worker_DP0_TP0_EP0 pid=5609) ERROR {md} [v1/executor/multiproc_executor.py:932] "),
    ("metaflow", "{t}.977 [177/train/578 (pid 28936)] [09c561ee-a44c-4795-967c-7183a83b3160] "),
)
"""``--formats``: a launcher's, runner's or collector's tag on EVERY line of the paste (torchrun's
``[default0]:``, srun --label's ``3: ``, Open MPI's ``--tag-output``, a collector's ISO stamp, Ray's coloured
worker column with and without its escape bytes, pdsh's host, markdown quotes, a relayed stream name, syslog,
Azure ML's ``<date> [<node>, <ip>]``, TorchX roles, SkyPilot, vLLM's workers, docker compose, ``kubectl logs
--prefix``, a bracketed stamp, vLLM's logger record header ``ERROR 03-25 21:13:53 [file.py:374] `` (alone and
under its worker column), SGLang's ``[<date> DP4 TP4] ``, pdsh's host column alone ``gpu-q-13: ``
(DeepSpeed's multi-node runner without torch's rank tag), vLLM v1's worker column
``(Worker_DP0_TP0_EP0 pid=5609) `` alone and before a header naming the file's path, Metaflow's
``<date> [run/step/task (pid N)] [<log id>] ``):
the reading must not depend on how the lines were
carried. A stamp in a tag is the paste's first date (:func:`_paste_span`), as a collector stamps the lines
when they were written (a stamp years from the paste's own dates would only test the import's time window)."""


def format_variants(lines: List[str]) -> Iterator[Variant]:
    first = _paste_span(lines)[0]
    t, iso = first.strftime("%Y-%m-%d %H:%M:%S"), first.strftime("%Y-%m-%dT%H:%M:%S")
    for name, tag in FORMATS:
        md = first.strftime("%m-%d %H:%M:%S")
        tag = tag.replace("{t}", t).replace("{iso}", iso).replace("{md}", md)
        yield name, [tag + s for s in lines]


def main(kinds: List[str], formats: bool = False, only: Optional[List[str]] = None) -> None:
    recorded = json.loads((corpus.WILD / "verdicts.json").read_text(encoding="utf-8"))
    cases = [c for c in corpus.load() if c.part == "tune" and c.label.kind in kinds and c.case_id in recorded
             and recorded[c.case_id]["kind"].split("/")[0] == c.label.category]
    print(len(cases), "tuned pastes with the right category", file=sys.stderr)
    tmp = Path(tempfile.mkdtemp(prefix="tg-stress-"))
    made = []
    for case in cases:
        raw = case.log.read_bytes().decode("utf-8", "replace")
        for name, lines in (format_variants if formats else variants)(raw.splitlines()):
            if only and name not in only:
                continue
            path = tmp / f"{case.case_id}__{name}"
            path.mkdir()
            if lines is None:
                (path / "log.txt").write_bytes(raw.replace("\r\n", "\n").replace("\n", "\r\n").encode())
            else:
                (path / "log.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
            made.append((corpus.Case(path.name, path, case.label), case, name))
    verdicts = judge.replay_all([m[0] for m in made])
    lost: Counter = Counter()
    total: Counter = Counter()
    for variant, case, name in made:
        got = verdicts[variant.case_id]
        total[name] += 1
        if got.kind.split("/")[0] != case.label.category:
            lost[name] += 1
            print(f"LOST {name:16s} {case.case_id}  want {case.label.kind}  got {got.kind or '-'}")
    for name in total:
        print(f"{name:16s} lost {lost[name]} / {total[name]}")


if __name__ == "__main__":
    picked = [a.split("=", 1)[1].split(",") for a in sys.argv[1:] if a.startswith("--only=")]
    args = [a for a in sys.argv[1:] if a != "--formats" and not a.startswith("--only=")]
    main(args[0].split(",") if args else ["memory/cuda-error"], formats="--formats" in sys.argv[1:],
         only=picked[0] if picked else None)
