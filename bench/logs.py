"""The wild-log corpus through ``trainguard replay`` into ``trainguard serve``, as a user would.

Prints, for the tuned part and the held-out part separately (``bench/wild/corpus.py`` fixes the split by
a hash of each log's id), per category and per kind: right category, right subtype, culprit rank right
where the label names one, root cause vs consequence right on multi-rank logs, and how many logs
imported nothing. Then the classifier's cost in µs per log line over the whole corpus, this checkout
beside a git ref (default ``HEAD~1``) in one run, in wall-clock time and in the child's CPU time (the
figure to read on a loaded machine, whose scheduling inflates wall-clock passes). Asserts nothing.

    python bench/logs.py                     # serve + replay CLI per log, cost vs HEAD~1
    python bench/logs.py --local             # in process (the test's path), faster
    python bench/logs.py --ref 3c85af7       # cost beside another commit
    python bench/logs.py --record            # write tests/fixtures/wild/verdicts.json (in process)
    python bench/logs.py --show-heldout-misses   # only after the held-out figures are final
    python bench/logs.py --local --tuned-only --no-cost   # while tuning: the held-out part not even judged
    python bench/logs.py --local --no-cost --ids-since e4e97de~1   # also the logs added since a commit alone

``--ids-since REV`` reports, after the whole corpus, the logs whose ``label.json`` was added after ``REV``
(committed since, or not yet committed) as a table of their own: the "fresh" figure of logs nobody tuned on,
tuned-side and held-out-side apart (held-out misses still unlisted).

Held-out misses are not listed by default: tuning reads the tuned part's misses only.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any, Dict, List

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO))

import ingest  # noqa: E402  (bench/ingest.py: a trainguard serve subprocess on free ports)

from bench.wild import corpus, judge  # noqa: E402

VERDICTS = corpus.WILD / "verdicts.json"
_EVENTS_RE = re.compile(r"events: \d+ sent \(([^)]*)\)")


def _built(summary_text: str) -> Dict[str, int]:
    """The envelope counts by kind from the summary ``trainguard replay`` prints."""
    m = _EVENTS_RE.search(summary_text)
    out: Dict[str, int] = {}
    for part in (m.group(1).split(", ") if m and m.group(1) != "none" else []):
        n, _, kind = part.partition(" ")
        out[kind] = int(n)
    return out


def _incidents(server: Any, run_id: str) -> List[Dict[str, Any]]:
    url = (f"http://127.0.0.1:{server.http_port}/api/v1/runs/{urllib.parse.quote(run_id, safe='')}"
           "/incidents?limit=200")
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {server.read_token}"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            items: List[Dict[str, Any]] = json.loads(resp.read())["items"]
    except urllib.error.HTTPError as exc:
        if exc.code == 404:  # the import sent nothing: there is no run
            return []
        raise
    return items


def verdicts_served(cases: List[corpus.Case]) -> Dict[str, judge.Verdict]:
    """Each case through the ``trainguard replay`` command into one ``trainguard serve``."""
    out = {}
    with tempfile.TemporaryDirectory(prefix="tg-logs-") as tmp:
        server = ingest.start_server(Path(tmp) / "data")
        try:
            for case in cases:
                run_id = f"wild-{case.case_id}"
                done = subprocess.run(
                    [sys.executable, "-m", "trainguard_server", "replay", "--run-id", run_id,
                     "--log", str(case.log), "--endpoint", f"http://127.0.0.1:{server.http_port}",
                     "--token", server.ingest_token, "--read-token", server.read_token, "--quiet"],
                    capture_output=True, text=True, timeout=300, env=_env(REPO))
                out[case.case_id] = judge.verdict_of(_incidents(server, run_id), _built(done.stdout))
        finally:
            server.proc.terminate()
            server.proc.wait(60)
    return out


def verdicts_local(cases: List[corpus.Case]) -> Dict[str, judge.Verdict]:
    """Every case as its own run through one in-process backend (see ``judge.replay_all``)."""
    return judge.replay_all(cases)


def _env(checkout: Path) -> Dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(str(checkout / d / "src") for d in ("sdk", "engine", "services"))
    for key in [k for k in env if k.startswith("TRAINGUARD_")]:
        del env[key]
    return env


def classify_cost(checkout: Path) -> Dict[str, Any]:
    """µs per line of the classifier (reader + classify) of ``checkout`` over this corpus, in a child."""
    done = subprocess.run([sys.executable, str(HERE / "wild" / "classify_cost.py"), str(corpus.WILD)],
                          capture_output=True, text=True, env=_env(checkout), timeout=900)
    if done.returncode != 0:
        return {"error": done.stderr.strip().splitlines()[-1:] or ["failed"]}
    result: Dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def cost_beside(ref: str) -> None:
    """The classifier's µs/line here and at ``ref`` (a worktree), alternating, twice each."""
    with tempfile.TemporaryDirectory(prefix="tg-logs-ref-") as tmp:
        wt = Path(tmp) / "ref"
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(wt), ref],
                       check=True, capture_output=True)
        try:
            rows: Dict[str, List[float]] = {"this": [], ref: []}
            cpu: Dict[str, List[float]] = {"this": [], ref: []}
            for _ in range(2):
                for name, checkout in (("this", REPO), (ref, wt)):
                    got = classify_cost(checkout)
                    if "error" in got:
                        print(f"classifier cost [{name}]: {got['error']}")
                        continue
                    rows[name].append(got["us_per_line"])
                    if "cpu_us_per_line" in got:
                        cpu[name].append(got["cpu_us_per_line"])
                    print(f"classifier cost [{name}]: {got['us_per_line']:.2f} µs/line "
                          + (f"(CPU {got['cpu_us_per_line']:.2f}) " if "cpu_us_per_line" in got else "")
                          + f"({got['lines']} lines, {got['logs']} logs, best of 5 passes)")
            if rows["this"] and rows[ref]:
                print(f"classifier cost ratio this/{ref}: {min(rows['this']) / min(rows[ref]):.2f}x")
            if cpu["this"] and cpu[ref]:
                print(f"classifier CPU-time ratio this/{ref}: {min(cpu['this']) / min(cpu[ref]):.2f}x")
        finally:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(wt)],
                           capture_output=True)


def ids_since(rev: str) -> List[str]:
    """Ids of the cases whose ``label.json`` was added after ``rev``: committed since (``git diff
    --diff-filter=A rev``) or present in the working tree but not in ``rev``."""
    wild = corpus.WILD.relative_to(REPO).as_posix()
    done = subprocess.run(["git", "-C", str(REPO), "ls-tree", "-r", "--name-only", rev, "--", wild],
                          capture_output=True, text=True, check=True)
    before = {Path(p).parent.name for p in done.stdout.splitlines() if p.endswith("/label.json")}
    return sorted(p.parent.name for p in corpus.WILD.glob("*/label.json") if p.parent.name not in before)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--local", action="store_true", help="in process instead of serve + the replay CLI")
    ap.add_argument("--record", action="store_true", help="write tests/fixtures/wild/verdicts.json")
    ap.add_argument("--ref", default="HEAD~1", help="git ref for the classifier-cost baseline")
    ap.add_argument("--no-cost", action="store_true")
    ap.add_argument("--show-heldout-misses", action="store_true")
    ap.add_argument("--ids-since", metavar="REV",
                    help="also report the logs added after this git revision alone (the fresh figure)")
    ap.add_argument("--tuned-only", action="store_true",
                    help="judge and report the tuned part only (while tuning; not with --record)")
    args = ap.parse_args()
    if args.tuned_only and (args.record or args.show_heldout_misses):
        ap.error("--tuned-only judges no held-out log: it cannot record or show held-out misses")
    cases = corpus.load(kinds=corpus.catalogue_kinds())
    if args.tuned_only:
        cases = [c for c in cases if c.part == "tune"]
    print(f"wild corpus: {len(cases)} logs ({sum(c.part == 'heldout' for c in cases)} held out); "
          f"{platform.python_version()}, {os.cpu_count()} cores, {time.strftime('%Y-%m-%d')}")
    t0 = time.perf_counter()
    in_process = args.local or args.record
    verdicts = verdicts_local(cases) if in_process else verdicts_served(cases)
    how = "in process" if in_process else "serve + replay CLI"
    print(f"judged in {time.perf_counter() - t0:.1f} s ({how})")
    scores = [judge.score(c, verdicts[c.case_id]) for c in cases]
    shown = ("tune", "heldout") if args.show_heldout_misses else ("tune",)
    print(judge.report(scores, show_misses=shown))
    if args.ids_since:
        fresh = set(ids_since(args.ids_since))
        picked = [s for c, s in zip(cases, scores) if c.case_id in fresh]
        print(f"== fresh: the {len(picked)} logs added after {args.ids_since} "
              f"({sum(s.part == 'heldout' for s in picked)} held out) ==")
        print(judge.report(picked, show_misses=shown))
    if args.record:
        VERDICTS.write_text(json.dumps({k: v.to_dict() for k, v in sorted(verdicts.items())}, indent=1)
                            + "\n", encoding="utf-8")
        print(f"recorded {len(verdicts)} verdicts in {VERDICTS.relative_to(REPO)}")
    if not args.no_cost:
        cost_beside(args.ref)


if __name__ == "__main__":
    main()
