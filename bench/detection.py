#!/usr/bin/env python3
"""Detection quality on the whole scenario corpus (tests/scenarios/corpus.py), judged through the backend.

Every run of the corpus manifest goes through a real embedded server (``EmbeddedServer``: gRPC and HTTP on
127.0.0.1, a temporary data directory) in one or both of two ways, and what the query API then says about
the run is compared with the kind the manifest expects:

* ``sdk``: ``cpu`` scenarios run **live** -- the real training subprocess with the SDK configured from the
  environment (``tests/scenarios/record.py``'s ``scenario_env``) and ``TRAINGUARD_ENDPOINT`` pointing at the
  server, as ``trainguard demo`` does. ``gpu``/``dist`` scenarios, recorded on machines this one is not,
  are sent as their recorded envelopes through the gateway's ingest API (one transport client per rank, in
  event-time order across ranks), the envelopes unchanged except for their times, which are shifted by one
  constant so that the run ends now (as ``trainguard replay`` shifts old runs; otherwise the server's
  processing-time timers would call a run recorded hours ago lost at once, and its gateway rejects events
  older than 30 days).
* ``replay``: each recorded stream (cpu runs: the committed ``streams/<name>.jsonl``, or a fresh recording
  for ``--seed`` N != 0) is converted to what a user without the SDK has -- per rank a metrics JSON-lines
  file (one object per step with its time), a log (a timestamped progress line per step, the SDK's log
  records as timestamped lines, exception tracebacks as printed text) and the exit codes (the EXIT event's;
  for a rank that never sent one, the launcher's from ``scenario.json`` when the recording has one) --
  heartbeats and memory events are dropped (a user has none) -- and imported with ``trainguard replay``'s
  in-process API (``Importer`` + ``RemoteBackend`` over HTTP, one envelope per request).

Recorded envelopes and replayed records are delivered **step-synchronously**: after each request the bench
waits until the server processed everything it ingested and reads the run's incidents, so the step at
which an incident first became visible is exact. Live runs are watched by a poller (``--poll-ms``). A run
one of whose ranks never reported an exit (SIGKILLed, or a hang killed from outside) is watched ``--settle``
seconds more, because the server judges such runs with processing-time timers too (a silent rank leads a
collective failure after its grace); the verdict is read after that, and what changed is noted.

Figures, per way: the confusion matrix (expected kind x found kinds: a run counts once per distinct kind
found, so every extra kind is a false positive; ``-`` = nothing found; an incident the backend resolved as
``explained_by`` another incident of the run -- a consequence its correlation folded into the cause -- is
listed but not counted: the run's verdict is its other incidents), precision and recall per subtype and
per category, incidents on healthy runs, dist runs' lead rank, the lead time of gradient explosions (first
non-finite loss, from the metrics API, minus the step at which the explosion incident was first visible),
the time to detection of hangs (last progress to the stall incident in the API, against max(2 x step time,
stall floor)) and of crashes (the EXIT event to the classified incident being queryable, against 1 s).
Targets are printed beside the figures; a missed one reads MISSED. Exit status: 0 unless the harness
failed (server, a scenario that did not run as recorded, a missing stream), never for a missed target.

    python bench/detection.py                                   # everything, both ways (~3 min on 2 cores)
    python bench/detection.py --only crash,gpu_oom --ways sdk   # some scenarios, one way
    python bench/detection.py --seed 1 --json /tmp/seed1.json   # unseen cpu runs (a generalisation check)
    python bench/detection.py --corpus varied                   # the 320-run corpus (bench/corpus), 2 halves
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import urllib.parse
import urllib.request
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

REPO = Path(__file__).resolve().parents[1]
for _src in (REPO, REPO / "sdk" / "src", REPO / "engine" / "src", REPO / "services" / "src"):
    if _src.is_dir() and str(_src) not in sys.path:
        sys.path.insert(0, str(_src))

from tests.scenarios import record as recorder  # noqa: E402
from tests.scenarios.corpus import SCENARIOS, Scenario, load_events, retimed  # noqa: E402
from trainguard.transport.base import SendResult, Transport  # noqa: E402
from trainguard.transport.grpc import GrpcTransport  # noqa: E402
from trainguard.transport.http import HttpTransport  # noqa: E402
from trainguard_engine.catalogue import DetectionSettings  # noqa: E402
from trainguard_engine.extract import batch_points, payload  # noqa: E402
from trainguard_server.api.read_client import ReadClient  # noqa: E402
from trainguard_server.config import Settings  # noqa: E402
from trainguard_server.replay import Importer, RemoteBackend, ReplayOptions, wait_for_run  # noqa: E402
from trainguard_server.server import EmbeddedServer  # noqa: E402

Event = Dict[str, Any]
WAYS = ("sdk", "replay")
PROJECT = "scenarios"          # the project record.py's environment names; recorded envelopes' own or ""
EXPLOSION = "gradient/explosion"
STALL = "progress/stalled"
LEAD_TARGET_STEPS = 10
CRASH_TARGET_S = 1.0
EXIT_PHASES = ("EXIT", 2, "2")


# ------------------------------------------------------------------------------------------------ results

@dataclass
class Sighting:
    """When an incident kind was first visible in the API."""

    wall: float                  # time.time() of the poll that saw it
    incident_last_step: int      # the incident's last_step then: the step it was visible at
    run_last_step: int           # the run's last step then
    sent_step: int = -1          # step-synchronous delivery: the step of the last envelope delivered
    sent_time_ns: int = 0        # ... and the latest event time delivered


@dataclass
class Trace:
    """What the delivery of one run observed, for the measurements."""

    watcher: Watcher
    process_end: Optional[float] = None                            # live: when the training ended
    exit_acked: Dict[int, float] = field(default_factory=dict)     # delivered: rank -> EXIT acknowledged
    heartbeat_s: Optional[float] = None                            # the run's heartbeat interval


LIVE_PACING: Dict[str, Dict[str, str]] = {
    # The explosion's lead time is measured in steps, live. Its toy step takes ~0.6 ms, so the whole run
    # fits in one SDK flush and nothing can be seen "before" anything. A real step is at least as long as
    # the SDK's flush interval (1 s by default; LLM steps take seconds): pace it to 50 ms per step with a
    # 50 ms flush -- the same ratio -- so the live figure means what it means for a real job.
    "explosion": {"SCENARIO_STEP_SECONDS": "0.05", "TRAINGUARD_FLUSH_INTERVAL": "0.05"},
}
"""Environment added to a live cpu scenario in the SDK way only (not to its recording)."""


@dataclass
class Outcome:
    """One scenario through one way."""

    name: str
    source: str
    way: str
    expected: str                        # "category/subtype" or "healthy"
    run_id: str = ""
    transport: str = ""
    delivery: str = ""                   # "live" | "step-synchronous" | "real-time" (recorded, paced)
    kinds: List[str] = field(default_factory=list)      # distinct kinds found (incidents not explained by
    #                                                     another: the run's verdict)
    consequences: List[str] = field(default_factory=list)  # kinds of incidents explained by another
    incidents: List[Dict[str, Any]] = field(default_factory=list)
    run: Dict[str, Any] = field(default_factory=dict)
    sightings: Dict[str, Dict[str, Any]] = field(default_factory=dict)
    exit_codes: Dict[str, int] = field(default_factory=dict)
    process_exit: Optional[int] = None   # live: the training's return code
    lead_rank: Optional[Dict[str, Any]] = None
    lead: Optional[Dict[str, Any]] = None
    hang: Optional[Dict[str, Any]] = None
    crash: Optional[Dict[str, Any]] = None
    wall_s: float = 0.0
    notes: List[str] = field(default_factory=list)
    error: str = ""

    @property
    def detected(self) -> bool:
        return self.expected in self.kinds

    @property
    def exact(self) -> bool:
        return self.kinds == [self.expected] if self.expected != "healthy" else not self.kinds


# ------------------------------------------------------------------------------------------------ the API

class Api:
    """The query API (read token) and the server's ``/metrics`` counters."""

    def __init__(self, base: str, read_token: str) -> None:
        self.base = base
        self.client = ReadClient(base, read_token, timeout=10)

    def run(self, run_id: str) -> Optional[Dict[str, Any]]:
        found: Optional[Dict[str, Any]] = self.client.get(f"/api/v1/runs/{_quote(run_id)}")
        return found

    def incidents(self, run_id: str) -> List[Dict[str, Any]]:
        page = self.client.get(f"/api/v1/runs/{_quote(run_id)}/incidents", limit=500)
        return list(page["items"]) if page else []

    def first_nonfinite_loss(self, run_id: str) -> Optional[Tuple[int, int]]:
        """(step, rank) of the first non-finite value of a loss metric in the metrics store."""
        quoted = _quote(run_id)
        summary = self.client.get(f"/api/v1/runs/{quoted}/metrics/summary") or []
        settings = DetectionSettings()
        names = [m["name"] for m in summary if settings.is_loss(m["name"]) and m.get("nonfinite")]
        if not names:
            return None
        series = self.client.get(f"/api/v1/runs/{quoted}/metrics", names=",".join(names), max_points=10000)
        found: List[Tuple[int, int]] = []
        for by_rank in (series or {}).get("series", {}).values():
            for rank, buckets in by_rank.items():
                steps = [b["step_start"] for b in buckets if b.get("nonfinite")]
                if steps:
                    found.append((min(steps), int(rank)))
        return min(found) if found else None

    def counter(self, name: str) -> float:
        with urllib.request.urlopen(f"{self.base}/metrics", timeout=10) as response:
            text = response.read().decode("utf-8", "replace")
        for line in text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        raise RuntimeError(f"/metrics has no {name}")

    def wait_processed(self, timeout: float = 60.0, poll: float = 0.002) -> None:
        """Until the processor ran everything the gateway had accepted when called (the queue is ordered)."""
        ingested = self.counter("trainguard_ingest_events_total")
        deadline = time.monotonic() + timeout
        while self.counter("trainguard_processed_events_total") < ingested:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the processor did not catch up within {timeout:.0f} s")
            time.sleep(poll)


class Watcher:
    """Polls one run's record and incidents; remembers when each incident kind was first visible (and
    the first time the run showed an exit)."""

    def __init__(self, api: Api, run_id: str) -> None:
        self.api = api
        self.run_id = run_id
        self.first: Dict[str, Sighting] = {}
        self.exited_at: Optional[float] = None      # first poll showing exit codes
        self.seen_with_exit: Dict[str, float] = {}  # kind -> first poll showing it and an exit
        self.sent_step = -1
        self.sent_time_ns = 0
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.errors = 0

    def observe(self) -> None:
        try:
            run = self.api.run(self.run_id)
            incidents = self.api.incidents(self.run_id) if run is not None else []
        except OSError:
            self.errors += 1
            return
        now = time.time()  # when the bench knew (a few ms late at most: it errs against the targets)
        if run is None:
            return
        exited = bool(run.get("exit_codes"))
        if exited and self.exited_at is None:
            self.exited_at = now
        for inc in incidents:
            kind = f"{inc['category']}/{inc['subtype']}"
            if kind not in self.first:
                self.first[kind] = Sighting(now, int(inc.get("last_step", -1)), int(run.get("last_step", -1)),
                                            self.sent_step, self.sent_time_ns)
            if exited and kind not in self.seen_with_exit:
                self.seen_with_exit[kind] = now

    def delivered(self, events: Sequence[Event]) -> None:
        """Step-synchronous delivery: ``events`` were acknowledged."""
        for event in events:
            self.sent_time_ns = max(self.sent_time_ns, int(event.get("time_unix_nano") or 0))
            if "metrics" in event:
                self.sent_step = max(self.sent_step, int(event.get("step") or 0))

    def start(self, interval: float) -> None:
        def loop() -> None:
            while not self._stop.is_set():
                self.observe()
                self._stop.wait(interval)

        self._thread = threading.Thread(target=loop, name=f"watch-{self.run_id}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)


# ------------------------------------------------------------------------------------------------ streams

def _is_exit(event: Event) -> bool:
    return event.get("lifecycle", {}).get("phase") in EXIT_PHASES


def step_batches(events: Sequence[Event], most: int = 64) -> List[List[Event]]:
    """The delivery units: consecutive metrics/memory envelopes of one rank and one step (at most
    ``most``) travel together; every other envelope (heartbeat, exception, log, lifecycle) alone."""
    out: List[List[Event]] = []
    previous: Optional[Tuple[int, int]] = None
    for event in events:
        kind, _body = payload(event)
        key = (int(event.get("rank") or 0), int(event.get("step") or 0)) if kind in ("metrics", "memory") \
            else None
        if key is not None and key == previous and len(out[-1]) < most:
            out[-1].append(event)
        else:
            out.append([event])
        previous = key
    return out


def heartbeat_interval(events: Sequence[Event]) -> Optional[float]:
    """The median spacing of one rank's heartbeats in a stream, seconds (None without two)."""
    times: Dict[Tuple[int, int], List[int]] = defaultdict(list)
    for event in events:
        if "heartbeat" in event:
            key = (int(event.get("rank") or 0), int(event.get("pid") or 0))
            times[key].append(int(event["time_unix_nano"]))
    gaps = [(b - a) / 1e9 for ts in times.values() for a, b in zip(sorted(ts), sorted(ts)[1:])]
    return round(statistics.median(gaps), 3) if gaps else None


def _ts(ns: int) -> str:
    """``logging``'s default asctime (local time, milliseconds after a comma)."""
    stamp = datetime.fromtimestamp(ns / 1e9)
    return stamp.strftime("%Y-%m-%d %H:%M:%S") + f",{stamp.microsecond // 1000:03d}"


def replay_files(scenario: Scenario, events: Sequence[Event], folder: Path) -> Tuple[
        List[Tuple[int, Path]], List[Tuple[int, Path]], Dict[int, int], Dict[int, str], int]:
    """Write what a user without the SDK has for this run: per rank a metrics JSON-lines file and a log;
    (metrics files, log files, exit codes, where each exit code came from, world size)."""
    folder.mkdir(parents=True, exist_ok=True)
    by_rank: Dict[int, List[Event]] = defaultdict(list)
    world = 1
    for event in events:
        by_rank[int(event.get("rank") or 0)].append(event)
        world = max(world, int(event.get("world_size") or 1))
    metrics_files: List[Tuple[int, Path]] = []
    log_files: List[Tuple[int, Path]] = []
    exits: Dict[int, int] = {}
    exit_from: Dict[int, str] = {}
    for rank, rank_events in sorted(by_rank.items()):
        steps: Dict[int, Dict[str, Any]] = {}
        lines: List[Tuple[int, int, str]] = []      # (time, order, text)
        settings = DetectionSettings()
        for event in rank_events:
            kind, body = payload(event)
            t = int(event.get("time_unix_nano") or 0)
            if kind == "metrics":
                for name, step, value in batch_points(body, int(event.get("step") or 0)):
                    record = steps.get(step)
                    if record is None:
                        record = steps[step] = {"step": step, "time": round(t / 1e9, 6)}
                        lines.append((t, len(lines), f"{_ts(t)} INFO train: step {step}"))
                    record[name] = value
            elif kind == "log":
                level = str(event.get("severity") or body.get("level") or "INFO").upper()
                logger = body.get("logger") or "train"
                lines.append((t, len(lines), f"{_ts(t)} {level} {logger}: {body.get('message', '')}"))
            elif kind == "exception":
                text = body.get("traceback") or f"{body.get('type', 'Exception')}: {body.get('message', '')}"
                lines.append((t, len(lines), str(text).rstrip("\n")))
            elif kind == "memory":  # what a user's own memory logging gives: torch.cuda.memory_stats()
                record = steps.get(int(event.get("step") or 0))
                for field in ("allocated", "reserved", "max_allocated", "total_capacity"):
                    if record is not None and field in body and f"mem/{field}" not in record:
                        record[f"mem/{field}"] = float(body[field])
                used = (body.get("stats") or {}).get("device_used")  # NVML's "used", as system monitors log
                if record is not None and used is not None:
                    record["mem/device_used"] = float(used)
            elif kind == "lifecycle" and _is_exit(event):
                exits[rank] = int(body.get("exit_code") or 0)
                exit_from[rank] = "EXIT event"
                if exits[rank]:  # the launcher's (torchrun's, the scheduler's) line when a rank fails
                    lines.append((t, len(lines), f"{_ts(t)} WARNING launcher: rank {rank} exited with code "
                                                 f"{exits[rank]}"))
        # the loss on each progress line, as training logs print it
        for i, (t, order, text) in enumerate(lines):
            match = re.fullmatch(r"(.* INFO train: step )(\d+)", text)
            if match:
                record = steps[int(match.group(2))]
                losses = [f"{n} {record[n]:.6g}" for n in record if settings.is_loss(n)]
                if losses:
                    lines[i] = (t, order, text + " " + " ".join(losses))
        if steps:
            path = folder / f"metrics_rank{rank}.jsonl"
            with open(path, "w", encoding="utf-8") as fh:
                for record in steps.values():
                    fh.write(json.dumps(record) + "\n")  # NaN / Infinity literals, as json.dumps writes them
            metrics_files.append((rank, path))
        if rank not in exits and scenario.source == "dist":  # killed: the launcher saw it go (below)
            t = max(int(e.get("time_unix_nano") or 0) for e in rank_events)
            lines.append((t, len(lines), f"{_ts(t)} WARNING launcher: rank {rank} was killed"))
        if lines:
            path = folder / f"rank{rank}.log"
            with open(path, "w", encoding="utf-8") as fh:
                for _t, _o, text in sorted(lines):
                    fh.write(text + "\n")
            log_files.append((rank, path))
    if scenario.source == "dist":  # a rank killed by a signal sends no EXIT: the launcher saw its code
        meta = scenario.stream_files()[0].parent / "scenario.json" if scenario.stream_files() else None
        if meta is not None and meta.is_file():
            doc = json.loads(meta.read_text(encoding="utf-8"))
            codes = doc.get("facts", {}).get("exit_codes", {})
            for rank_text, code in codes.items():
                rank = int(rank_text)
                if rank not in exits and isinstance(code, int):
                    exits[rank] = 128 - code if code < 0 else code
                    exit_from[rank] = "launcher (scenario.json)"
            if doc.get("hung_killed"):  # the recorder's timeout SIGKILLed the whole job
                for rank in range(world):
                    if rank not in exits:
                        exits[rank] = 128 + int(signal.SIGKILL)
                        exit_from[rank] = "SIGKILLed by the recorder's timeout (scenario.json)"
    return metrics_files, log_files, exits, exit_from, world


# ------------------------------------------------------------------------------------------------ the bench

class Bench:
    """One embedded server on 127.0.0.1 (temporary data dir; the stall floor as its one detection
    override) and the three ways of getting a run into it: live, recorded envelopes, replay."""

    def __init__(self, args: argparse.Namespace, tmp: Path) -> None:
        self.args = args
        self.tmp = tmp
        self.stamp = time.strftime("%H%M%S")
        self.floor = float(args.stall_floor)
        self.overrides = {"stall_min_s": self.floor}
        settings = Settings(data_dir=tmp / "server", host="127.0.0.1", http_port=0, grpc_port=0,
                            detection_overrides=json.dumps(self.overrides))
        self.server = EmbeddedServer(settings)
        self.ingest: Dict[str, str] = {}
        self.read: Dict[str, str] = {}
        self.errors: List[str] = []
        self.index = 0

    # -- server ------------------------------------------------------------------------------------------
    def start(self) -> None:
        self.server.start()
        self.tokens(PROJECT)

    def stop(self) -> None:
        self.server.stop()

    def tokens(self, project: str) -> Tuple[str, str]:
        """An ingest and a read token of ``project`` (created in the server's project store)."""
        if project not in self.ingest:
            projects = self.server.stores.projects
            self.ingest[project] = projects.create_token(project, "ingest", "bench/detection.py")
            self.read[project] = projects.create_token(project, "read", "bench/detection.py")
        return self.ingest[project], self.read[project]

    def api(self, project: str = PROJECT) -> Api:
        return Api(self.server.http_url, self.tokens(project)[1])

    def transport_name(self) -> str:
        choice = self.args.transport
        if choice != "alternate":
            return str(choice)
        self.index += 1
        return "grpc" if self.index % 2 else "http"

    def transport(self, name: str, token: str) -> Transport:
        if name == "grpc":
            return GrpcTransport(self.server.grpc_url.split("://", 1)[1], token)
        return HttpTransport(self.server.http_url, token, "trainguard-bench")

    # -- one scenario, one way ---------------------------------------------------------------------------
    def run(self, scenario: Scenario, way: str) -> Outcome:
        out = Outcome(scenario.name, scenario.source, way, scenario.label)
        started = time.monotonic()
        try:
            if way == "sdk" and scenario.source == "cpu":
                trace = self._live(scenario, out)
            elif way == "sdk":
                trace = self._recorded(scenario, out)
            else:
                trace = self._replay(scenario, out)
            self._measure(scenario, out, trace)
        except Exception as exc:  # a harness failure: report it, go on with the others
            out.error = f"{type(exc).__name__}: {exc}"
            self.errors.append(f"{way}/{scenario.name}: {out.error}")
            if self.args.verbose:
                traceback.print_exc()
        out.wall_s = round(time.monotonic() - started, 2)
        return out

    def _finish(self, out: Outcome, api: Api, watcher: Watcher) -> None:
        """Read the verdict once the server processed everything. A run with a rank that never exited (a
        SIGKILLed rank, a hang killed from outside) is judged by the server's processing-time timers too
        (a silent rank becomes the lead of a collective failure after its grace): keep watching it for up
        to ``--settle`` seconds, and note what changed."""
        api.wait_processed()
        watcher.observe()
        out.run = api.run(out.run_id) or {}
        at_end = _verdict_of(api.incidents(out.run_id))
        if self.args.settle > 0 and _unfinished(out.run):
            started = time.monotonic()
            settled, changed_after = at_end, None
            while time.monotonic() - started < self.args.settle and _unfinished(out.run):
                time.sleep(0.5)
                watcher.observe()
                out.run = api.run(out.run_id) or out.run
                settled = _verdict_of(api.incidents(out.run_id))
                if settled != at_end and changed_after is None:
                    changed_after = time.monotonic() - started
            waited = time.monotonic() - started
            if changed_after is not None:
                out.notes.append(f"at the end of the run: {at_end or 'nothing'}; {changed_after:.1f} s later "
                                 f"(processing-time timers): {settled or 'nothing'}")
            else:
                out.notes.append(f"unchanged after {waited:.0f} s of processing-time timers (a rank never "
                                 f"exited)")
        out.incidents = [_brief(i) for i in api.incidents(out.run_id)]
        out.kinds = sorted({i["kind"] for i in out.incidents if not i["explained_by"]})
        out.consequences = sorted({i["kind"] for i in out.incidents if i["explained_by"]})
        out.exit_codes = {str(k): int(v) for k, v in (out.run.get("exit_codes") or {}).items()}
        out.sightings = {k: asdict(s) for k, s in watcher.first.items()}

    def _live(self, scenario: Scenario, out: Outcome) -> Trace:
        ingest, _read = self.tokens(PROJECT)
        api = self.api(PROJECT)
        out.transport = self.transport_name()
        out.delivery = "live"
        out.run_id = f"bench-{scenario.name}-s{self.args.seed}-{self.stamp}"
        endpoint = self.server.grpc_url if out.transport == "grpc" else self.server.http_url
        spool = self.tmp / "spool"
        env = recorder.scenario_env(scenario.name, endpoint, str(spool))
        env.update(TRAINGUARD_TOKEN=ingest, TRAINGUARD_PROJECT=PROJECT, TRAINGUARD_RUN_ID=out.run_id)
        env.update(LIVE_PACING.get(scenario.name, {}))
        log_path = self.tmp / f"{scenario.name}-s{self.args.seed}.log"
        watcher = Watcher(api, out.run_id)
        watcher.start(self.args.poll_ms / 1000)
        with open(log_path, "wb") as log:
            proc = subprocess.Popen([sys.executable, "-m", scenario.module, scenario.name, "--seed",
                                     str(self.args.seed)], env=env, cwd=REPO, stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True)
            deadline = time.monotonic() + self.args.timeout
            try:
                while proc.poll() is None:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"the training did not end within {self.args.timeout:.0f} s "
                                           f"(log: {log_path})")
                    time.sleep(0.01)
                process_end = time.time()
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
                try:  # DataLoader workers or anything else the training left in its session
                    os.killpg(proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        out.process_exit = proc.returncode
        try:
            self._finish(out, api, watcher)
        finally:
            watcher.stop()
        out.notes.append(f"process exit {proc.returncode}")
        expected_exit = recorder.EXIT_CODES.get(scenario.name, 0)
        if proc.returncode != expected_exit:
            tail = log_path.read_text(errors="replace")[-1500:]
            raise RuntimeError(f"the training exited {proc.returncode}, not {expected_exit} as recorded:\n"
                               f"{tail}")
        return Trace(watcher, process_end=process_end,
                     heartbeat_s=float(env.get("TRAINGUARD_HEARTBEAT_INTERVAL") or 15.0))

    def _recorded(self, scenario: Scenario, out: Outcome) -> Trace:
        paths = scenario.stream_files()
        missing = [str(p) for p in paths if not p.is_file()] or ([] if paths else ["no stream files"])
        if missing:
            raise FileNotFoundError(f"recorded stream missing: {', '.join(missing)}")
        events = load_events(paths)
        # a hang is judged against the clock (the processor's stall timer): deliver it as it happened, in
        # real time from now; everything else step by step as fast as the processor takes it
        paced = scenario.expected is not None and "/".join(scenario.expected) == STALL
        span = max(int(e.get("time_unix_nano") or 0) for e in events) - \
            min(int(e.get("time_unix_nano") or 0) for e in events)
        events = retimed(events, time.time_ns() + (10**9 + span if paced else -10**9))
        run_ids = {e.get("run_id") for e in events}
        if len(run_ids) != 1:
            raise ValueError(f"expected one run id in the recorded stream, found {sorted(map(str, run_ids))}")
        out.run_id = str(run_ids.pop())
        project = next((str(e["project"]) for e in events if e.get("project")), PROJECT)
        ingest, _read = self.tokens(project)
        api = self.api(project)
        out.transport = self.transport_name()
        out.delivery = "real-time" if paced else "step-synchronous"
        clients: Dict[int, Transport] = {}
        trace = Trace(Watcher(api, out.run_id), heartbeat_s=heartbeat_interval(events))
        if paced:  # what the processor decides between deliveries (its timers) shows as it happens
            trace.watcher.start(self.args.poll_ms / 1000)
        try:
            for batch in step_batches(events):
                if paced:
                    wait = (int(batch[0].get("time_unix_nano") or 0) - time.time_ns()) / 1e9
                    if wait > 0:
                        time.sleep(wait)
                rank = int(batch[0].get("rank") or 0)
                client = clients.get(rank)
                if client is None:
                    client = clients[rank] = self.transport(out.transport, ingest)
                result = client.send(batch, 30.0)
                acked = time.time()
                _check(result, len(batch), scenario.name)
                if any(_is_exit(e) for e in batch):
                    trace.exit_acked[rank] = acked
                trace.watcher.delivered(batch)
                api.wait_processed()
                trace.watcher.observe()
            self._finish(out, api, trace.watcher)
        finally:
            if paced:
                trace.watcher.stop()
            for client in clients.values():
                client.close()
        out.notes.append(f"{len(events)} envelopes from {len(clients)} rank client(s)"
                         + (", delivered in real time" if paced else ""))
        return trace

    def _replay(self, scenario: Scenario, out: Outcome) -> Trace:
        if scenario.source == "cpu" and self.args.seed != 0:
            folder = self.tmp / f"seed{self.args.seed}"
            path = folder / f"{scenario.name}.seed{self.args.seed}.jsonl"
            if not path.is_file():
                with tempfile.TemporaryDirectory(prefix="tg-record-") as record_tmp:
                    recorder.record(scenario.name, record_tmp, self.args.seed, folder)
            paths = [path]
            out.notes.append(f"stream recorded now with seed {self.args.seed}")
        else:
            paths = scenario.stream_files()
            missing = [str(p) for p in paths if not p.is_file()] or ([] if paths else ["no stream files"])
            if missing:
                raise FileNotFoundError(f"recorded stream missing: {', '.join(missing)}")
        events = retimed(load_events(paths), time.time_ns() - 10**9)  # a finished run, replayed now
        folder = self.tmp / "replay" / scenario.name
        metrics, logs, exits, exit_from, world = replay_files(scenario, events, folder)
        out.run_id = f"replay-{scenario.name}-s{self.args.seed}-{self.stamp}"
        out.transport = "http"
        out.delivery = "step-synchronous"
        ingest, read = self.tokens(PROJECT)
        api = self.api(PROJECT)
        trace = Trace(Watcher(api, out.run_id), heartbeat_s=None)  # a user's files have no heartbeats
        watcher = trace.watcher

        class SteppedBackend(RemoteBackend):
            """``trainguard replay``'s HTTP backend, waiting for the server after each request."""

            def send(self, batch: Sequence[Event], timeout: float) -> SendResult:
                result = super().send(batch, timeout)
                acked = time.time()
                for event in batch:
                    if _is_exit(event):
                        trace.exit_acked[int(event.get("rank") or 0)] = acked
                watcher.delivered(batch)
                api.wait_processed()
                watcher.observe()
                return result

        backend = SteppedBackend(self.server.http_url, ingest, read_token=read, api=self.server.http_url,
                                 user_agent="trainguard-bench")
        options = ReplayOptions(run_id=out.run_id, run_name=f"replay-{scenario.name}", metrics=metrics,
                                logs=logs, exit_codes=exits, world_size=world, batch_size=1,
                                tags={"scenario": scenario.name, "bench": "detection"})
        try:
            summary = Importer(options, backend).run()
            if not summary.ok:
                raise RuntimeError(f"replay failed: {summary.error or 'nothing accepted'}")
            if summary.rejected:
                out.notes.append(f"replay: {sum(summary.rejected.values())} rejected "
                                 f"({'; '.join(summary.rejected_samples[:2])})")
            wait_for_run(backend, summary, timeout_s=60)
            self._finish(out, api, watcher)
        finally:
            backend.close()
        said = ", ".join(f"rank {r}: {c} ({exit_from.get(r, 'inferred')})" for r, c in sorted(exits.items()))
        out.notes.append(f"replayed {len(metrics)} metrics file(s), {len(logs)} log(s); exit codes "
                         f"{said or 'inferred'}")
        return trace

    # -- measurements ------------------------------------------------------------------------------------
    def _measure(self, scenario: Scenario, out: Outcome, trace: Trace) -> None:
        watcher = trace.watcher
        api = watcher.api
        by_kind = {i["kind"]: i for i in out.incidents}
        expected = by_kind.get(out.expected)
        if scenario.source == "dist" and scenario.lead_rank >= 0:
            found = expected["lead_rank"] if expected else None
            out.lead_rank = {"expected": scenario.lead_rank, "found": found,
                             "ok": found == scenario.lead_rank}
        if out.expected == EXPLOSION:
            out.lead = self._lead(out, api, watcher)
        if out.expected == STALL and expected is not None:
            out.hang = self._hang(out, expected, trace)
        crashed = any(c != 0 for c in out.exit_codes.values())
        if out.expected not in ("healthy", STALL) and crashed and expected is not None:
            out.crash = self._crash(out, expected, trace)

    def _lead(self, out: Outcome, api: Api, watcher: Watcher) -> Dict[str, Any]:
        first = api.first_nonfinite_loss(out.run_id)
        seen = watcher.first.get(EXPLOSION)
        lead: Dict[str, Any] = {"first_nonfinite_step": first[0] if first else None,
                                "nonfinite_rank": first[1] if first else None,
                                "visible_step": seen.incident_last_step if seen else None,
                                "run_step_then": seen.run_last_step if seen else None,
                                "delivery": out.delivery}
        if first is not None and seen is not None:
            lead["lead_steps"] = first[0] - seen.incident_last_step
            lead["ok"] = lead["lead_steps"] >= LEAD_TARGET_STEPS
        else:
            lead["lead_steps"] = None
            lead["ok"] = False
        return lead

    def _hang(self, out: Outcome, incident: Dict[str, Any], trace: Trace) -> Dict[str, Any]:
        """Last progress (where the stall incident begins) -> the stall incident visible in the API: by the
        wall clock for a live run; for a delivered stream, by event time (the latest event delivered when
        it became visible)."""
        step_time = float(out.run.get("step_time_s") or 0.0)
        began = int(incident["first_ns"])
        hang: Dict[str, Any] = {"step_time_s": step_time, "floor_s": self.floor,
                                "target_s": max(2 * step_time, self.floor), "heartbeat_s": trace.heartbeat_s,
                                "ttd_s": None}
        seen = trace.watcher.first.get(STALL)
        if seen is not None and out.delivery in ("live", "real-time"):
            hang["ttd_s"] = round(seen.wall - began / 1e9, 3)
            hang["measured"] = "wall clock, last progress -> incident visible in the API"
        elif seen is not None:
            hang["ttd_s"] = round((seen.sent_time_ns - began) / 1e9, 3)
            hang["measured"] = "event time, last progress -> the event that made it visible"
        # when the pipeline decided: the timeline entry that declared the stall (the SDK's clock or the
        # processor's), against the incident's start (the last progress)
        decided = [int(t["time_ns"]) for t in incident.get("timeline", []) if str(t.get("what", "")).endswith(
            ": stalled")]
        hang["decided_s"] = round((min(decided) - began) / 1e9, 3) if decided else None
        judged = hang["decided_s"] if hang["decided_s"] is not None else hang["ttd_s"]
        hang["ok"] = judged is not None and judged <= hang["target_s"] + 0.001
        if out.way == "replay":  # a user's files carry no heartbeats: the stall shows when it was stopped
            hang["applies"] = False
        return hang

    def _crash(self, out: Outcome, incident: Dict[str, Any], trace: Trace) -> Dict[str, Any]:
        seen = trace.watcher.seen_with_exit.get(out.expected)
        crash: Dict[str, Any] = {"target_s": CRASH_TARGET_S}
        if out.delivery == "live":
            exits = [int(e["time_ns"]) for e in incident.get("evidence", []) if e.get("rule") == "exit.code"]
            if exits:
                reference, crash["from"] = min(exits) / 1e9, "the EXIT event (SDK clock)"
            elif trace.process_end is not None:
                reference, crash["from"] = trace.process_end, "the process's end"
            else:
                return {"target_s": CRASH_TARGET_S, "ttd_s": None, "ok": False, "from": "no exit seen"}
        else:
            acked = trace.exit_acked
            if not acked:
                return {"target_s": CRASH_TARGET_S, "ttd_s": None, "ok": False, "from": "no EXIT sent"}
            reference, crash["from"] = min(acked.values()), "the gateway's ack of the first EXIT"
        crash["ttd_s"] = round(seen - reference, 3) if seen is not None else None
        crash["ok"] = crash["ttd_s"] is not None and crash["ttd_s"] < CRASH_TARGET_S
        return crash


def _unfinished(run: Dict[str, Any]) -> bool:
    """Some rank of the run has not reported an exit."""
    ranks = max(int(run.get("world_size") or 1), len(run.get("ranks") or []))
    return len(run.get("exit_codes") or {}) < ranks


def _verdict_of(incidents: Sequence[Dict[str, Any]]) -> str:
    return ", ".join(sorted(f"{i['category']}/{i['subtype']} led by rank {i.get('lead_rank')}"
                            for i in incidents if not i.get("explained_by")))


def _quote(run_id: str) -> str:
    return urllib.parse.quote(run_id, safe="")


def _check(result: SendResult, sent: int, name: str) -> None:
    if result.rejected:
        raise RuntimeError(f"{name}: the gateway rejected {len(result.rejected)} of {sent} envelopes: "
                           f"{result.rejected[:2]}")


def _brief(inc: Dict[str, Any]) -> Dict[str, Any]:
    keep = ("incident_id", "category", "subtype", "severity", "status", "title", "first_step", "last_step",
            "first_ns", "last_ns", "lead_rank", "ranks", "count", "evidence", "timeline", "consequences",
            "explained_by")
    out = {k: inc.get(k) for k in keep}
    out["kind"] = f"{inc['category']}/{inc['subtype']}"
    out["explained_by"] = out["explained_by"] or ""
    return out


# ------------------------------------------------------------------------------------------------ scoring

def confusion(outcomes: Sequence[Outcome]) -> Tuple[List[str], List[str], Dict[str, Counter[str]]]:
    rows: Dict[str, Counter[str]] = {}
    for o in outcomes:
        if o.error:
            continue
        row = rows.setdefault(o.expected, Counter())
        for kind in o.kinds or ["-"]:
            row[kind] += 1
    labels = sorted(rows, key=lambda k: (k == "healthy", k))
    columns = [*sorted({k for r in rows.values() for k in r if k != "-"}), "-"]
    return labels, columns, rows


def precision_recall(outcomes: Sequence[Outcome], level: str) -> List[Dict[str, Any]]:
    """TP/FP/FN per label (``level`` "subtype": the kind; "category": its first part). A run counts as
    TP for its expected label when found, FN when not; every other label found on it is an FP."""
    def label(kind: str) -> str:
        return kind if level == "subtype" else kind.split("/", 1)[0]

    tp: Counter[str] = Counter()
    fp: Counter[str] = Counter()
    fn: Counter[str] = Counter()
    for o in outcomes:
        if o.error:
            continue
        want = None if o.expected == "healthy" else label(o.expected)
        found = {label(k) for k in o.kinds}
        if want is not None:
            if want in found:
                tp[want] += 1
            else:
                fn[want] += 1
        for other in found - ({want} if want else set()):
            fp[other] += 1
    rows = []
    for name in sorted(set(tp) | set(fp) | set(fn)):
        p = tp[name] / (tp[name] + fp[name]) if tp[name] + fp[name] else None
        r = tp[name] / (tp[name] + fn[name]) if tp[name] + fn[name] else None
        rows.append({"label": name, "tp": tp[name], "fp": fp[name], "fn": fn[name], "precision": p,
                     "recall": r})
    return rows


def summary(outcomes: Sequence[Outcome]) -> Dict[str, Any]:
    ok = [o for o in outcomes if not o.error]
    healthy = [o for o in ok if o.expected == "healthy"]
    anomalous = [o for o in ok if o.expected != "healthy"]
    lead_ranks = [o for o in ok if o.lead_rank is not None]
    return {
        "runs": len(outcomes), "harness_errors": len(outcomes) - len(ok),
        "anomalous": len(anomalous),
        "detected": sum(o.detected for o in anomalous),
        "exact": sum(o.exact for o in anomalous),
        "missed": [f"{o.name} (expected {o.expected}, found {', '.join(o.kinds) or 'nothing'})"
                   for o in anomalous if not o.detected],
        "extra": [f"{o.name} (+{', '.join(k for k in o.kinds if k != o.expected)})"
                  for o in anomalous if o.detected and not o.exact],
        "healthy": len(healthy),
        "healthy_incidents": sum(len([i for i in o.incidents if not i["explained_by"]]) for o in healthy),
        "healthy_kinds": [f"{o.name}: {', '.join(o.kinds)}" for o in healthy if o.kinds],
        "consequences": [f"{o.name}: {', '.join(o.consequences)}" for o in ok if o.consequences],
        "lead_rank_ok": sum(bool(o.lead_rank and o.lead_rank["ok"]) for o in lead_ranks),
        "lead_rank_runs": len(lead_ranks),
    }


# ------------------------------------------------------------------------------------------------ report

def _fmt(value: Optional[float], digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _verdict(ok: bool) -> str:
    return "OK" if ok else "MISSED"


def report(way: str, outcomes: Sequence[Outcome], bench: Bench, w: Callable[[str], None]) -> Dict[str, Any]:
    title = {"sdk": "SDK -> gateway -> query API (cpu: live trainings; gpu/dist: recorded envelopes, one "
                    "client per rank)",
             "replay": "trainguard replay (metrics JSON-lines + logs + exit codes per rank) -> query "
                       "API"}[way]
    w(f"\n== way {way}: {title}")
    w(f"{'scenario':<20} {'source':<6} {'via':<5} {'expected':<26} {'found':<44} verdict")
    for o in outcomes:
        found = ", ".join(o.kinds) or "-"
        verdict = "ERROR" if o.error else ("OK" if o.exact else "DETECTED+EXTRA" if o.detected else
                                           "FALSE POSITIVE" if o.expected == "healthy" else "MISSED")
        w(f"{o.name:<20} {o.source:<6} {o.transport:<5} {o.expected:<26} {found:<44} {verdict}")
        if o.error:
            w(f"    harness error: {o.error.splitlines()[0]}")
            continue
        kinds_by_id = {i["incident_id"]: i["kind"] for i in o.incidents}
        for inc in o.incidents:
            cause = (f" [consequence of {kinds_by_id.get(inc['explained_by'], inc['explained_by'])}: not "
                     f"counted]" if inc["explained_by"] else "")
            w(f"    {inc['kind']} {inc['status']} from step {inc['first_step']} (rank {inc['lead_rank']}): "
              f"{inc['title']}{cause}")
        extras = []
        if o.lead_rank is not None:
            extras.append(f"lead rank {o.lead_rank['found']} (expected {o.lead_rank['expected']}: "
                          f"{_verdict(o.lead_rank['ok'])})")
        extras.extend(o.notes)
        extras.append(f"{o.wall_s:.1f} s")
        w("    " + "; ".join(extras))
    labels, columns, rows = confusion(outcomes)
    w("\nconfusion matrix (rows: expected; columns: kinds found, numbered below; a run counts once per "
      "distinct kind found, so every extra kind is a false positive; '-' = nothing found; consequences "
      "explained by another incident are not counted)")
    number = {c: str(i + 1) if c != "-" else "-" for i, c in enumerate(columns)}
    w(f"{'expected':<26} " + "".join(f"{number[c]:>3}" for c in columns))
    for label in labels:
        w(f"{label:<26} " + "".join(f"{(rows[label].get(c) or '.'):>3}" for c in columns))
    legend = [f"{number[c]} {c}" for c in columns if c != "-"]
    for i in range(0, len(legend), 5):
        w("  " + ", ".join(legend[i:i + 5]))
    pr_sub = precision_recall(outcomes, "subtype")
    pr_cat = precision_recall(outcomes, "category")
    for name, table in (("subtype", pr_sub), ("category", pr_cat)):
        w(f"\nprecision / recall per {name}")
        w(f"{name:<26} {'TP':>3} {'FP':>3} {'FN':>3} {'precision':>9} {'recall':>6}")
        for row in table:
            w(f"{row['label']:<26} {row['tp']:>3} {row['fp']:>3} {row['fn']:>3} {_fmt(row['precision']):>9} "
              f"{_fmt(row['recall']):>6}")
    s = summary(outcomes)
    w("\ntargets")
    w(f"  anomalous runs detected with the right category and subtype: {s['detected']}/{s['anomalous']} "
      f"(target: all) {_verdict(s['detected'] == s['anomalous'])}")
    for line in s["missed"]:
        w(f"    missed: {line}")
    w(f"  ... and with no other kind: {s['exact']}/{s['anomalous']}")
    for line in s["extra"]:
        w(f"    extra kind: {line}")
    if s["consequences"]:
        w(f"  incidents the backend explains by another of the run (consequences, not counted): "
          f"{'; '.join(s['consequences'])}")
    w(f"  incidents on healthy runs: {s['healthy_incidents']} on {s['healthy']} runs (target 0) "
      f"{_verdict(s['healthy_incidents'] == 0)}")
    for line in s["healthy_kinds"]:
        w(f"    {line}")
    if s["lead_rank_runs"]:
        w(f"  dist runs whose incident names the expected lead rank: {s['lead_rank_ok']}/"
          f"{s['lead_rank_runs']}")
    for o in outcomes:
        if o.lead is not None:
            L = o.lead
            if L["first_nonfinite_step"] is None:
                w(f"  explosion lead {o.name}: no non-finite loss in the metrics store; "
                  f"explosion visible at step {L['visible_step']} -> {_verdict(False)}")
            elif L["visible_step"] is None:
                w(f"  explosion lead {o.name}: first non-finite loss at step {L['first_nonfinite_step']}; no "
                  f"gradient/explosion incident -> {_verdict(False)}")
            else:
                how = "step-synchronous delivery"
                if o.delivery == "live":
                    span = (int(o.run.get("last_event_ns") or 0) - int(o.run.get("started_ns") or 0)) / 1e9
                    how = (f"live, polled every {bench.args.poll_ms:g} ms; the run's last step then "
                           f"{L['run_step_then']}; the whole run took {span:.2f} s")
                w(f"  explosion lead {o.name}: first non-finite loss at step {L['first_nonfinite_step']}, "
                  f"gradient/explosion visible at step {L['visible_step']} ({how}): {L['lead_steps']} steps "
                  f"(target >= {LEAD_TARGET_STEPS}) {_verdict(L['ok'])}")
        if o.hang is not None and o.hang["ttd_s"] is not None and o.hang.get("applies") is False:
            w(f"  hang {o.name}: seen at the kill, {o.hang['ttd_s']:.2f} s after the last progress (a replay "
              f"has no heartbeats: the time target applies to live runs)")
        elif o.hang is not None and o.hang["ttd_s"] is not None:
            H = o.hang
            late = H["decided_s"] if H.get("decided_s") is not None else H["ttd_s"]
            over = "" if H["ok"] else f" by {late - H['target_s']:.2f} s"
            beat = f"; heartbeat every {H['heartbeat_s']:g} s" if H["heartbeat_s"] else ""
            decided = "" if H.get("decided_s") is None else f"decided {H['decided_s']:.3f} s after it; "
            w(f"  hang {o.name}: last progress -> {decided}{H['measured']}: {H['ttd_s']:.2f} s; target: "
              f"decided within max(2 x step time {H['step_time_s']:.3g} s, floor {H['floor_s']:g} s) = "
              f"{H['target_s']:.2f} s {_verdict(H['ok'])}{over}{beat}")
        elif o.expected == STALL and not o.error:
            w(f"  hang {o.name}: no {STALL} incident -> {_verdict(False)}")
        if o.crash is not None:
            C = o.crash
            w(f"  crash {o.name}: {C.get('from')} -> {o.expected} incident with the exit, queryable: "
              f"{_fmt(C['ttd_s'], 3)} s (target < {CRASH_TARGET_S:g} s) {_verdict(C['ok'])}")
    return {"scenarios": [asdict(o) for o in outcomes], "confusion": {k: dict(v) for k, v in rows.items()},
            "precision_recall": {"subtype": pr_sub, "category": pr_cat}, "summary": s}


def _finite(obj: Any) -> Any:
    """``obj`` with non-finite floats spelled as the JSON mapping does ("NaN", "Infinity", "-Infinity")."""
    if isinstance(obj, float) and obj != obj:
        return "NaN"
    if isinstance(obj, float) and obj in (float("inf"), float("-inf")):
        return "Infinity" if obj > 0 else "-Infinity"
    if isinstance(obj, dict):
        return {str(k): _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def _git() -> str:
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                             text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return f"{rev}{' (working tree modified)' if dirty else ''}"
    except (OSError, subprocess.SubprocessError):
        return "?"


def select(only: Optional[str]) -> List[Scenario]:
    if not only:
        return list(SCENARIOS)
    names = [n.strip() for n in only.split(",") if n.strip()]
    known = {s.name: s for s in SCENARIOS}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise SystemExit(f"unknown scenarios {unknown}; the corpus has {sorted(known)}")
    return [known[n] for n in names]


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", help="comma-separated scenario names (default: the whole corpus)")
    parser.add_argument("--ways", default="sdk,replay", help="comma-separated: sdk, replay (default both)")
    parser.add_argument("--json", type=Path, help="write the machine-readable results here")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the cpu trainings (0: the recorded ones; others: unseen runs)")
    parser.add_argument("--stall-floor", type=float, default=5.0,
                        help="the server's stall_min_s (the hang target's floor), seconds (default 5; "
                             "production default 120)")
    parser.add_argument("--transport", choices=("alternate", "http", "grpc"), default="alternate",
                        help="SDK way: the transport of live runs and recorded sends (default: alternate)")
    parser.add_argument("--poll-ms", type=float, default=20.0, help="live runs: API poll interval (ms)")
    parser.add_argument("--timeout", type=float, default=180.0, help="live runs: seconds before giving up")
    parser.add_argument("--settle", type=float, default=30.0,
                        help="seconds to keep watching a run one of whose ranks never exited, for the "
                             "server's processing-time timers (a silent rank's grace is 20 s; default 30)")
    parser.add_argument("--verbose", action="store_true", help="tracebacks of harness errors")
    parser.add_argument("--corpus", choices=("scenarios", "varied"), default="scenarios",
                        help="varied: the 320-run corpus of bench/corpus instead (dev and test halves, "
                             "confusion per category and subtype, healthy alert rate with its 95%% "
                             "interval, explosion lead, HF/Lightning apart); needs bench/corpus/record.py")
    args = parser.parse_args(argv)
    if args.corpus == "varied":
        from bench.corpus import evaluate as varied

        return varied.main((["--json", str(args.json)] if args.json else [])
                           + (["--only", args.only] if args.only else []) + (["-v"] if args.verbose else []))
    ways = [w.strip() for w in args.ways.split(",") if w.strip()]
    if not ways or any(w not in WAYS for w in ways):
        parser.error(f"--ways takes a comma-separated subset of {','.join(WAYS)}")
    scenarios = select(args.only)

    lines: List[str] = []

    def w(text: str) -> None:
        print(text, flush=True)
        lines.append(text)

    import torch

    results: Dict[str, Any] = {"ways": {}}
    with tempfile.TemporaryDirectory(prefix="tg-detection-") as tmp:
        bench = Bench(args, Path(tmp))
        bench.start()
        try:
            sources = Counter(s.source for s in scenarios)
            w(f"env python={platform.python_version()} torch={torch.__version__} cpus={os.cpu_count()} "
              f"commit={_git()} date={time.strftime('%Y-%m-%dT%H:%M:%S%z')}")
            counts = ", ".join(f"{n} {s}" for s, n in sorted(sources.items()))
            w(f"corpus: {len(scenarios)} scenarios ({counts}), "
              f"ways {','.join(ways)}, cpu seed {args.seed}; server {bench.server.http_url} / "
              f"{bench.server.grpc_url}, detection overrides {json.dumps(bench.overrides)}")
            results.update(env={"python": platform.python_version(), "torch": torch.__version__,
                                "cpus": os.cpu_count(), "commit": _git()},
                           settings={"seed": args.seed, "stall_floor_s": args.stall_floor,
                                     "settle_s": args.settle,
                                     "overrides": bench.overrides, "transport": args.transport,
                                     "poll_ms": args.poll_ms})
            for way in ways:
                outcomes = []
                for scenario in scenarios:
                    outcome = bench.run(scenario, way)
                    outcomes.append(outcome)
                    print(f"  [{way}] {scenario.name}: {', '.join(outcome.kinds) or '-'}"
                          f"{' ERROR ' + outcome.error.splitlines()[0] if outcome.error else ''} "
                          f"({outcome.wall_s:.1f} s)", file=sys.stderr, flush=True)
                results["ways"][way] = report(way, outcomes, bench, w)
            if len(ways) > 1:
                w("\n== both ways")
                for way in ways:
                    s = results["ways"][way]["summary"]
                    w(f"  {way:<7} detected {s['detected']}/{s['anomalous']}, exact {s['exact']}/"
                      f"{s['anomalous']}, incidents on healthy runs {s['healthy_incidents']}, harness errors "
                      f"{s['harness_errors']}")
        finally:
            bench.stop()
    results["harness_errors"] = bench.errors
    if bench.errors:
        w("\nHARNESS ERRORS")
        for line in bench.errors:
            w(f"  {line.splitlines()[0]}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(_finite(results), indent=1, default=str, allow_nan=False) + "\n",
                             encoding="utf-8")
    return 1 if bench.errors else 0


if __name__ == "__main__":
    sys.exit(main())
