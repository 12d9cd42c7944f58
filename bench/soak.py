"""Soak: several tenants ingest into one ``trainguard serve`` at once, one of them hostile (issue 18).

Prints numbers and ratios, asserts nothing. Two phases, one after the other, each on a fresh real
``trainguard serve`` subprocess (``bench/ingest.py``'s :func:`ingest.start_server`) with the same load except
for the hostile tenant:

* ``calm`` -- tenants ``calm`` (the well-behaved prober) and ``bg1``, ``bg2`` (background);
* ``hostile`` -- the same, plus tenant ``hostile``.

Each tenant is a project of its own with its own ingest token, made with the CLI (``trainguard token create
--project P --kind ingest|read --data-dir D``) before the server starts. What each does for ``--seconds``:

* ``bg1``, ``bg2``: one client process each (``ingest.grpc_client``), paced gRPC ``Send`` of
  ``--bg-batch`` metric envelopes at ``--bg-rate`` events/s.
* ``calm`` also keeps one run live for the whole phase (a finite step a second, from before the hostile
  tenant's flood), then logs a NaN loss: its incident must still come (``long_run``: finding 2's harm).
* ``calm``: every ``--probe-interval`` s a probe (at most ``--probe-inflight`` at once) starts a fresh run:
  ``NAN_STEP`` finite steps over gRPC, waits until the run is visible in the query API, opens the run's live
  stream (``GET /api/v1/runs/{run}/stream``, server-sent events, ``interval=--sse-interval``) and reads its
  first (empty) incident list, then, at a random moment of the stream's read cycle, sends step ``NAN_STEP``
  with ``loss = NaN`` (and the SDK's ``non_finite:loss`` alert). Latency = from just before that ``Send``
  until (a) the stream delivers a non-empty incident list (``sse``), (b) ``GET /api/v1/runs/{run}/incidents``,
  polled every ``--poll-ms``, shows it (``poll``). The stream reads the stores every ``--sse-interval`` s
  (the server's ``api_stream_min_interval_s`` is lowered to that for both phases), so the ``sse`` figure
  carries up to one interval of wait; ``poll`` is late by at most one poll. ``first_step`` checks the
  incident starts at the NaN step.
* ``hostile`` (one client process, a thread per attack, all at once):
  - ``poison``: every ``--poison-every`` s a run whose ``opt/lr`` goes 5e-324 -> 1.0 and whose loss then
    turns NaN, with NaN/+-Inf in every other metric, in the alert's recent values, in a heartbeat, a memory
    snapshot and an EXIT's SDK stats; in turn as HTTP JSON (proto3 strings ``"NaN"``/``"Infinity"``), HTTP
    JSON with bare ``NaN``/``Infinity`` tokens, and gRPC protobuf;
  - ``tiny_runs``: ``--tiny-runs`` one-event runs in gRPC batches of 500 at the start, then
    ``--tiny-rate`` more runs/s (past the per-project ``project_max_runs`` quota, 10,000 by default);
  - ``idle_streams``: ``--idle-streams`` gRPC ``Stream`` calls that never send a message, over
    ``--idle-connections`` connections, each re-opened 1 s after the server ends it;
  - ``gzip_bomb``: every ``--bomb-every`` s, ``POST /v1/ingest`` of ~8 MiB of ~419,000 empty gzip members and
    then a real batch (``Content-Encoding: gzip``);
  - ``deep_json``: every ``--deep-every`` s, a batch of two valid events and one whose ``tags`` nest
    ``--deep-levels`` deep (expected: 200, that one event ``invalid_field``), and a body nested that deep
    as a whole (expected: 400).

  ``--attacks`` picks some of them (``--phases hostile --attacks tiny_runs``: which one costs the others).

Reported per phase: the probes' latencies (p50/p99/max, found/probes, incident kinds, first step right), the
background tenants' accepted events and errors, the server's CPU, the queue depth and processing lag (max
over the phase, sampled each second from ``/metrics``) and ``/readyz`` at the end; for the hostile phase the
hostile tenant's answers (status counts per attack), whether its poison runs got their incident, and the
server's counters (``trainguard_runs_quarantined_total``, ``trainguard_project_quota_evictions_total``,
``trainguard_ingest_rejected_total``, ...). Then the two phases side by side (``summary``).

    python bench/soak.py                       # 2 x 60 s, ~3 minutes
    python bench/soak.py --seconds 20 --bg-rate 500
    python bench/soak.py --quick               # seconds; what tests/bench/test_soak_smoke.py runs
"""

from __future__ import annotations

import argparse
import collections
import gzip
import http.client
import json
import math
import multiprocessing as mp
import os
import platform
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

import ingest  # noqa: E402  (bench/ingest.py: the serve subprocess, event builders, paced gRPC clients)

for _src in (REPO / "sdk" / "src", REPO / "engine" / "src", REPO / "services" / "src"):
    if _src.is_dir() and str(_src) not in sys.path:
        sys.path.insert(0, str(_src))

NAN_STEP = 5
"""The probe run's step whose loss is NaN: its incident must start there."""
STREAM_METHOD = "/trainguard.v1.IngestService/Stream"
TINY_BATCH = 500
BOMB_MEMBERS = 419_000
"""Empty gzip members in the bomb: ~8 MiB, just under the default max_batch_bytes (issue 18, finding 8)."""
PHASES = ("calm", "hostile")
ATTACKS = ("poison", "tiny_runs", "idle_streams", "gzip_bomb", "deep_json")
TENANTS = ("calm", "bg1", "bg2", "hostile")


# -------------------------------------------------------------------------------------------- tenants

@dataclass
class Tenant:
    """A project with its own tokens."""

    project: str
    ingest: str
    read: str = ""


TOKENS_SCRIPT = """
import contextlib, io, json, sys
from trainguard_server.cli import main
tokens = []
for project, kind in json.loads(sys.argv[2]):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["token", "create", "--project", project, "--kind", kind, "--description", "soak bench",
                     "--data-dir", sys.argv[1]])
    if code != 0:
        sys.exit(f"trainguard token create --project {project} --kind {kind}: exit {code}")
    tokens.append(out.getvalue().strip().splitlines()[-1])
print(json.dumps(tokens))
"""


def cli_tokens(data_dir: Path, wanted: Sequence[Tuple[str, str]]) -> List[str]:
    """``trainguard token create --project P --kind K --data-dir D`` for each ``(P, K)`` of ``wanted``: the
    tokens it prints, in that order. The CLI's own ``main`` runs once per token, all in one interpreter (a
    subprocess per token cost ~1 s each: 6 per phase were half the quick calm phase)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / d / "src") for d in ("sdk", "engine", "services")]
                                        + [env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    for key in [k for k in env if k.startswith("TRAINGUARD_")]:
        del env[key]
    done = subprocess.run([sys.executable, "-c", TOKENS_SCRIPT, str(data_dir), json.dumps(list(wanted))],
                          capture_output=True, text=True, env=env, timeout=120)
    if done.returncode != 0:
        raise RuntimeError(f"trainguard token create failed: {done.stderr[-2000:]}")
    tokens: List[str] = json.loads(done.stdout.strip().splitlines()[-1])
    if len(tokens) != len(wanted) or not all(tokens):
        raise RuntimeError(f"trainguard token create: {len(tokens)} tokens for {len(wanted)} asked")
    return tokens


def make_tenants(data_dir: Path) -> Dict[str, Tenant]:
    """Every tenant's project and tokens, in ``data_dir`` (before the server starts)."""
    data_dir.mkdir(parents=True, exist_ok=True)
    wanted = [(name, kind) for name in TENANTS
              for kind in (("ingest", "read") if name in ("calm", "hostile") else ("ingest",))]
    made = dict(zip(wanted, cli_tokens(data_dir, wanted)))
    return {name: Tenant(name, made[(name, "ingest")], made.get((name, "read"), "")) for name in TENANTS}


# ----------------------------------------------------------------------------------------- /metrics

def metric_samples(port: int) -> List[Tuple[str, str, float]]:
    """``/metrics`` as (name, labels, value) rows."""
    status, body = ingest.http_get(port, "/metrics")
    if status != 200:
        raise RuntimeError(f"/metrics answered {status}")
    rows = []
    for line in body.decode().splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        name, _, labels = key.partition("{")
        rows.append((name, "{" + labels if labels else "", float(value)))
    return rows


def metric_value(rows: Sequence[Tuple[str, str, float]], name: str) -> float:
    return sum(v for n, _, v in rows if n == name)


class Sampler:
    """``/metrics`` every second in a thread: the largest queue depth and processing lag seen."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.depth_max = 0.0
        self.lag_max = 0.0
        self.errors = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="soak-sampler", daemon=True)

    def start(self) -> Sampler:
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            try:
                rows = metric_samples(self.port)
            except (OSError, RuntimeError):
                self.errors += 1
                continue
            self.depth_max = max(self.depth_max, metric_value(rows, "trainguard_queue_depth"))
            self.lag_max = max(self.lag_max, metric_value(rows, "trainguard_processing_lag_seconds"))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


# -------------------------------------------------------------------------------------- the prober

@dataclass
class ProbeResult:
    sse_s: float = math.inf
    poll_s: float = math.inf
    ack_s: float = math.inf
    kind: str = "timeout"
    first_step: int = -1
    error: str = ""
    sent_at: float = math.nan  # time.monotonic() just before the NaN step's Send


def _send(channel: Any, token: str, events: List[Dict[str, Any]], timeout: float) -> Any:
    from trainguard import wire
    from trainguard.v1 import ingest_pb2

    send = channel.unary_unary(ingest.SEND_METHOD, request_serializer=None,
                               response_deserializer=ingest_pb2.IngestResponse.FromString)
    body = wire.prepare_batch(events).request.SerializeToString()
    return send(body, metadata=(("authorization", f"Bearer {token}"),), timeout=timeout)


def probe_events(project: str, run_id: str) -> Tuple[List[Dict[str, Any]], Dict[str, Any]]:
    """The finite steps 0..NAN_STEP-1 of a probe run, and its NaN step (with the SDK's alert)."""
    from trainguard.core import events as ev

    ident = ingest.identity(project, run_id, 0, 1)
    now = time.time_ns()
    finite = [ev.envelope(ident, "metrics", ev.metrics_payload(ingest.metric_values(s, 3)), step=s,
                          time_unix_nano=now) for s in range(NAN_STEP)]
    recent = [(n, NAN_STEP - 1, v) for n, v in ingest.metric_values(NAN_STEP - 1, 3).items()]
    values = dict(ingest.metric_values(NAN_STEP, 3), loss=float("nan"))
    nan = ev.envelope(ident, "metrics", ev.metrics_payload(values, alert="non_finite:loss", recent=recent),
                      step=NAN_STEP, time_unix_nano=time.time_ns(), severity="ERROR")
    return finite, nan


def sse_messages(resp: http.client.HTTPResponse) -> Iterator[Tuple[str, str]]:
    """(event, data) of each server-sent event of ``resp`` (comments skipped), until the stream ends."""
    event = ""
    data: List[str] = []
    while True:
        raw = resp.readline()
        if not raw:
            return
        line = raw.decode().rstrip("\r\n")
        if not line:
            if event or data:
                yield event, "\n".join(data)
            event, data = "", []
        elif line.startswith("event:"):
            event = line[6:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].strip())


def run_probe(server: ingest.Server, tenant: Tenant, run_id: str, args: argparse.Namespace) -> ProbeResult:
    """One probe (see the module docstring): send, wait for the run, open its stream, send the NaN step,
    time the incident on the stream and on the polled listing."""
    res = ProbeResult()
    finite, nan = probe_events(tenant.project, run_id)
    channel = ingest._grpc_channel(server.grpc_target)
    poll_conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=args.probe_timeout)
    sse_conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=args.probe_timeout)
    poll_s = args.poll_ms / 1000.0
    deadline = time.monotonic() + args.probe_timeout
    try:
        ack = _send(channel, tenant.ingest, finite, args.probe_timeout)
        if ack.accepted != len(finite):
            res.error = f"finite steps: accepted {ack.accepted} of {len(finite)}"
            return res
        while ingest.http_get(server.http_port, f"/api/v1/runs/{run_id}", tenant.read, poll_conn)[0] != 200:
            if time.monotonic() > deadline:
                res.error = "run never visible"
                return res
            time.sleep(poll_s)
        sse_conn.request("GET", f"/api/v1/runs/{run_id}/stream?interval={args.sse_interval:g}",
                         headers={"Authorization": f"Bearer {tenant.read}", "Accept": "text/event-stream"})
        resp = sse_conn.getresponse()
        if resp.status != 200:
            res.error = f"stream answered {resp.status}: {resp.read()[:200]!r}"
            return res
        messages = sse_messages(resp)
        for event, _ in messages:  # the first message: the run and its (empty) incident list
            if event == "incidents":
                break
        sent_at: List[float] = []
        ready = threading.Event()

        def watch_stream() -> None:
            ready.wait()
            try:
                for event, data in messages:
                    if event == "incidents" and json.loads(data):
                        res.sse_s = time.monotonic() - sent_at[0]
                        return
                    if event == "error":
                        res.error = f"stream error: {data[:200]}"
                        return
            except OSError as exc:  # the stream's read timed out: counted as not seen
                res.error = res.error or f"stream: {type(exc).__name__}"

        watcher = threading.Thread(target=watch_stream, name="soak-sse", daemon=True)
        watcher.start()
        # a NaN arrives at any moment of the stream's read cycle, not just after a read
        time.sleep(random.uniform(0.0, args.sse_interval))
        sent_at.append(time.monotonic())
        res.sent_at = sent_at[0]
        ready.set()
        ack = _send(channel, tenant.ingest, [nan], args.probe_timeout)
        res.ack_s = time.monotonic() - sent_at[0]
        if ack.accepted != 1:
            res.error = f"NaN step not accepted: {ack}"
            return res
        path = f"/api/v1/runs/{run_id}/incidents"
        while time.monotonic() < deadline:
            status, body = ingest.http_get(server.http_port, path, tenant.read, poll_conn)
            items = json.loads(body)["items"] if status == 200 else []
            if items:
                res.poll_s = time.monotonic() - sent_at[0]
                res.kind = f"{items[0].get('category')}/{items[0].get('subtype')}"
                res.first_step = int(items[0].get("first_step", -1))
                break
            time.sleep(poll_s)
        watcher.join(max(0.0, deadline - time.monotonic()))
        return res
    except Exception as exc:  # a probe that broke is reported as such, the soak goes on
        res.error = f"{type(exc).__name__}: {exc}"[:300]
        return res
    finally:
        channel.close()
        poll_conn.close()
        sse_conn.close()


@dataclass
class LongRun:
    """The prober's one long-lived run: a step a second for the whole phase, then a NaN."""

    steps: int = 0
    poll_s: float = math.inf
    kind: str = "timeout"
    first_step: int = -1
    error: str = ""


def run_long(server: ingest.Server, tenant: Tenant, args: argparse.Namespace, phase: str, until: float,
             out: LongRun) -> None:
    """Issue 18's finding 2 as it hurt: a run live since before the hostile tenant's flood (one finite step
    a second until ``until``) then logs a NaN loss; time its incident (polled) and check its first step."""
    from trainguard.core import events as ev

    run_id = f"long-{phase}"
    ident = ingest.identity(tenant.project, run_id, 0, 1)
    channel = ingest._grpc_channel(server.grpc_target)
    conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=args.probe_timeout)
    try:
        while time.monotonic() < until:
            values = ingest.metric_values(out.steps, 3)
            _send(channel, tenant.ingest, [ev.envelope(ident, "metrics", ev.metrics_payload(values),
                                                       step=out.steps, time_unix_nano=time.time_ns())], 30)
            out.steps += 1
            time.sleep(max(0.0, min(1.0, until - time.monotonic())))
        values = dict(ingest.metric_values(out.steps, 3), loss=float("nan"))
        nan = ev.envelope(ident, "metrics", ev.metrics_payload(values, alert="non_finite:loss", recent=[]),
                          step=out.steps, time_unix_nano=time.time_ns(), severity="ERROR")
        sent = time.monotonic()
        _send(channel, tenant.ingest, [nan], 30)
        while time.monotonic() - sent < args.probe_timeout:
            status, body = ingest.http_get(server.http_port, f"/api/v1/runs/{run_id}/incidents", tenant.read,
                                           conn)
            items = json.loads(body)["items"] if status == 200 else []
            if items:
                out.poll_s = time.monotonic() - sent
                out.kind = f"{items[0].get('category')}/{items[0].get('subtype')}"
                out.first_step = int(items[0].get("first_step", -1))
                return
            time.sleep(args.poll_ms / 1000.0)
    except Exception as exc:  # reported, the soak goes on
        out.error = f"{type(exc).__name__}: {exc}"[:300]
    finally:
        channel.close()
        conn.close()


def run_probes(server: ingest.Server, tenant: Tenant, args: argparse.Namespace, phase: str,
               until: float) -> List[ProbeResult]:
    """Probes every ``--probe-interval`` s until ``until`` (time.monotonic), ``--probe-inflight`` at most."""
    results: List[ProbeResult] = []
    gate = threading.Semaphore(args.probe_inflight)
    with ThreadPoolExecutor(max_workers=args.probe_inflight) as pool:
        futures = []
        i = 0
        next_at = time.monotonic()
        while next_at < until:
            time.sleep(max(0.0, next_at - time.monotonic()))
            gate.acquire()
            fut = pool.submit(run_probe, server, tenant, f"probe-{phase}-{i:04d}", args)
            fut.add_done_callback(lambda _f: gate.release())
            futures.append(fut)
            i += 1
            next_at += args.probe_interval
        results = [f.result() for f in futures]
    return results


# ---------------------------------------------------------------------------------- hostile tenant

class Tally:
    """Thread-safe counts of answers, by attack and answer."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.counts: Dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
        self.notes: Dict[str, List[float]] = collections.defaultdict(list)
        self.samples: Dict[str, str] = {}

    def add(self, attack: str, answer: str, n: int = 1, sample: str = "") -> None:
        """Count ``n`` answers; ``sample``: what the first answer of its kind said (kept for the report)."""
        with self.lock:
            self.counts[attack][answer] += n
            if sample and f"{attack} {answer}" not in self.samples:
                self.samples[f"{attack} {answer}"] = sample[:200]

    def note(self, attack: str, value: float) -> None:
        with self.lock:
            self.notes[attack].append(value)


def poison_run(ident: Dict[str, Any]) -> List[List[Dict[str, Any]]]:
    """A poison run's three batches (steps 0-9: LR 5e-324, 10-19: LR 1.0, 20-29: NaN loss and NaN/Inf in
    every metric, with a heartbeat, a memory snapshot and an EXIT whose numbers are non-finite too)."""
    from trainguard.core import events as ev

    nan, inf = float("nan"), float("inf")
    now = time.time_ns()
    batches: List[List[Dict[str, Any]]] = [[], [], []]
    for step in range(30):
        if step < 20:
            values = {"opt/lr": 5e-324 if step < 10 else 1.0, "loss": 1.0, "grad/global_norm": 0.5}
            payload = ev.metrics_payload(values)
        else:
            values = {"loss": nan, "opt/lr": inf, "grad/global_norm": inf, "amp/scale": -inf,
                      "grad/layer/encoder.0": nan, "throughput/samples_per_s": inf, "mem/allocated_gb": nan,
                      "data/wait_s": -inf}
            payload = ev.metrics_payload(values, alert="non_finite:loss" if step == 20 else "",
                                         recent=[("loss", step - 1, nan), ("opt/lr", step - 1, inf),
                                                 ("grad/global_norm", step - 1, -inf)])
        batches[step // 10].append(ev.envelope(ident, "metrics", payload, step=step, time_unix_nano=now,
                                               severity="ERROR" if step >= 20 else "INFO"))
    weird = {"x": ev.wire_float(nan), "y": ev.wire_float(inf), "z": ev.wire_float(-inf)}
    batches[2] += [
        ev.envelope(ident, "heartbeat", {"last_step": 29, "last_step_time_unix_nano": now,
                                         "step_time_ewma_s": ev.wire_float(inf),
                                         "uptime_s": ev.wire_float(nan), "sdk_stats": weird},
                    step=29, time_unix_nano=now),
        ev.envelope(ident, "memory", {"device": "cuda:0", "allocated": 1, "reserved": 2,
                                      "fragmentation": ev.wire_float(nan), "stats": weird},
                    step=29, time_unix_nano=now),
        ev.envelope(ident, "lifecycle", {"phase": "EXIT", "exit_code": 1, "reason": "exception",
                                         "sdk_stats": weird}, step=29, time_unix_nano=now, severity="ERROR"),
    ]
    return batches


def _bare_tokens(events: List[Dict[str, Any]]) -> bytes:
    """The JSON body with non-finite numbers as bare ``NaN``/``Infinity`` tokens (not the proto3 strings)."""
    def back(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: back(v) for k, v in value.items()}
        if isinstance(value, list):
            return [back(v) for v in value]
        if value in ("NaN", "Infinity", "-Infinity"):
            return float(value.replace("Infinity", "inf"))
        return value
    return json.dumps({"events": back(events)}).encode()


class HttpPoster:
    """POST to ``/v1/ingest`` on one keep-alive connection (re-opened after an error or a close)."""

    def __init__(self, port: int, token: str) -> None:
        self.port, self.token = port, token
        self.conn: Optional[http.client.HTTPConnection] = None

    def post(self, body: bytes, ctype: str = "application/json", encoding: str = "") -> Tuple[str, bytes]:
        headers = {"Authorization": f"Bearer {self.token}", "Content-Type": ctype}
        if encoding:
            headers["Content-Encoding"] = encoding
        try:
            if self.conn is None:
                self.conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
            self.conn.request("POST", "/v1/ingest", body=body, headers=headers)
            resp = self.conn.getresponse()
            data = resp.read()
            if resp.getheader("connection", "").lower() == "close":
                self.close()
            return str(resp.status), data
        except OSError as exc:
            self.close()
            return type(exc).__name__, b""

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None


def _rejected_codes(status: str, body: bytes, tally: Tally, attack: str) -> None:
    """Count ``http:<status>`` and, for a 200, each per-item rejection's code."""
    tally.add(attack, f"http:{status}", sample="" if status == "200" else body.decode(errors="replace"))
    if status == "200":
        try:
            for item in json.loads(body).get("rejected", []):
                tally.add(attack, f"rejected:{item.get('code')}", sample=str(item.get("message", "")))
        except ValueError:
            tally.add(attack, "http:200-not-json")


def _grpc_answer(send: Callable[[bytes], Any], body: bytes, tally: Tally, attack: str) -> None:
    import grpc

    try:
        ack = send(body)
    except grpc.RpcError as err:
        tally.add(attack, f"grpc:{err.code().name}", sample=str(err.details()))
        return
    tally.add(attack, "grpc:OK")
    for item in ack.rejected:
        tally.add(attack, f"rejected:{item.code}", sample=item.message)


def attack_poison(ctx: Dict[str, Any], tally: Tally, runs: List[str]) -> None:
    from trainguard import wire
    from trainguard.core import events as ev

    http = HttpPoster(ctx["http_port"], ctx["token"])
    k = 0
    while time.time() < ctx["end"]:
        t0 = time.time()
        run_id = f"poison-{os.getpid()}-{k:04d}"
        ident = ingest.identity(ctx["project"], run_id, 0, 1)
        how = ("json", "json_bare", "grpc")[k % 3]
        for batch in poison_run(ident):
            if how == "json":
                status, body = http.post(ev.encode_batch(batch))
                _rejected_codes(status, body, tally, "poison")
            elif how == "json_bare":
                status, body = http.post(_bare_tokens(batch))
                _rejected_codes(status, body, tally, "poison")
            else:
                _grpc_answer(ctx["send"], wire.prepare_batch(batch).request.SerializeToString(), tally,
                             "poison")
        runs.append(f"{run_id}:{how}")
        k += 1
        time.sleep(max(0.0, ctx["poison_every"] - (time.time() - t0)))
    http.close()


def attack_tiny_runs(ctx: Dict[str, Any], tally: Tally) -> None:
    from trainguard import wire
    from trainguard.core import events as ev

    n = 0
    started = time.time()

    def batch(count: int) -> bytes:
        nonlocal n
        now = time.time_ns()
        events = [ev.envelope(ingest.identity(ctx["project"], f"tiny-{os.getpid()}-{n + i:06d}", 0, 1),
                              "metrics", ev.metrics_payload({"loss": 1.0}), step=0, time_unix_nano=now)
                  for i in range(count)]
        n += count
        return bytes(wire.prepare_batch(events).request.SerializeToString())

    while n < ctx["tiny_runs"] and time.time() < ctx["end"]:  # the burst
        _grpc_answer(ctx["send"], batch(min(TINY_BATCH, ctx["tiny_runs"] - n)), tally, "tiny_runs")
    tally.note("tiny_runs_burst_s", time.time() - started)
    burst_n, burst_end = n, time.time()
    per_batch = 50
    while time.time() < ctx["end"] and ctx["tiny_rate"] > 0:  # then a steady trickle of new runs
        due = burst_n + (time.time() - burst_end) * ctx["tiny_rate"]
        if n + per_batch <= due:
            _grpc_answer(ctx["send"], batch(per_batch), tally, "tiny_runs")
        else:
            time.sleep(per_batch / ctx["tiny_rate"] / 4)
    tally.note("tiny_runs_sent", n)


def idle(done: threading.Event, at_most_s: float) -> Iterator[bytes]:
    """A Stream call's requests: none, and no half-close, until ``done`` (or ``at_most_s``)."""
    done.wait(max(0.0, at_most_s))
    return
    yield b""  # a generator


def attack_idle_streams(ctx: Dict[str, Any], tally: Tally) -> None:
    import grpc

    from trainguard.v1 import ingest_pb2

    channels = [grpc.insecure_channel(ctx["target"], options=[("grpc.use_local_subchannel_pool", 1)])
                for _ in range(ctx["idle_connections"])]
    md = (("authorization", f"Bearer {ctx['token']}"),)

    def slot(i: int) -> None:
        stream = channels[i % len(channels)].stream_unary(
            STREAM_METHOD, request_serializer=None,
            response_deserializer=ingest_pb2.IngestResponse.FromString)
        while time.time() < ctx["end"]:
            done = threading.Event()
            opened = time.time()
            fut = stream.future(idle(done, ctx["end"] - time.time() + 30), metadata=md,
                                timeout=ctx["end"] - time.time() + 60)
            try:
                fut.result(timeout=max(0.1, ctx["end"] - time.time()))
                answer = "grpc:OK"
            except grpc.RpcError as err:
                answer = f"grpc:{err.code().name}"
                tally.add("idle_streams", answer, 0, sample=str(err.details()))
            except grpc.FutureTimeoutError:
                fut.cancel()
                answer = "open_at_end"
            done.set()
            tally.add("idle_streams", answer)
            if answer == "grpc:DEADLINE_EXCEEDED":
                tally.note("idle_stream_lived_s", time.time() - opened)
            if time.time() < ctx["end"]:
                time.sleep(1.0)

    threads = [threading.Thread(target=slot, args=(i,), daemon=True) for i in range(ctx["idle_streams"])]
    for t in threads:
        t.start()
    for t in threads:
        t.join(ctx["end"] - time.time() + 30)
    for ch in channels:
        ch.close()


def gzip_bomb(project: str) -> bytes:
    """~8 MiB of empty gzip members, then one member holding a real batch."""
    from trainguard.core import events as ev

    ident = ingest.identity(project, f"bomb-{os.getpid()}", 0, 1)
    real = ev.encode_batch([ev.envelope(ident, "metrics", ev.metrics_payload({"loss": 1.0}), step=0,
                                        time_unix_nano=time.time_ns())])
    return gzip.compress(b"", mtime=0) * BOMB_MEMBERS + gzip.compress(real, mtime=0)


def attack_gzip_bomb(ctx: Dict[str, Any], tally: Tally) -> None:
    http = HttpPoster(ctx["http_port"], ctx["token"])
    body = gzip_bomb(ctx["project"])
    while time.time() < ctx["end"]:
        t0 = time.time()
        status, _ = http.post(body, encoding="gzip")
        tally.add("gzip_bomb", f"http:{status}")
        tally.note("gzip_bomb_answer_s", time.time() - t0)
        time.sleep(max(0.0, ctx["bomb_every"] - (time.time() - t0)))
    http.close()


def attack_deep_json(ctx: Dict[str, Any], tally: Tally) -> None:
    from trainguard.core import events as ev

    http = HttpPoster(ctx["http_port"], ctx["token"])
    depth = ctx["deep_levels"]
    nested = "[" * depth + "]" * depth
    k = 0
    while time.time() < ctx["end"]:
        t0 = time.time()
        ident = ingest.identity(ctx["project"], f"deep-{os.getpid()}", 0, 1)
        good = [json.dumps(ev.envelope(ident, "metrics", ev.metrics_payload({"loss": 1.0}), step=2 * k + j,
                                       time_unix_nano=time.time_ns())) for j in range(2)]
        deep = f'{{"event_id": "deep-{os.getpid()}-{k}", "run_id": "deep", "tags": {{"a": {nested}}}}}'
        status, body = http.post(('{"events": [' + good[0] + ", " + deep + ", " + good[1] + "]}").encode())
        _rejected_codes(status, body, tally, "deep_event")
        status, body = http.post(nested.encode())  # the body itself too deep: not an IngestRequest
        _rejected_codes(status, body, tally, "deep_body")
        k += 1
        time.sleep(max(0.0, ctx["deep_every"] - (time.time() - t0)))
    http.close()


def hostile_worker(ctx: Dict[str, Any], ready: Any, window: Any, out: Any) -> None:
    """The hostile tenant's process: every attack in a thread of its own for the window; puts its tally."""
    ingest_target = ctx["target"]
    channel = ingest._grpc_channel(ingest_target)
    from trainguard.v1 import ingest_pb2

    raw_send = channel.unary_unary(ingest.SEND_METHOD, request_serializer=None,
                                   response_deserializer=ingest_pb2.IngestResponse.FromString)
    md = (("authorization", f"Bearer {ctx['token']}"),)
    ctx["send"] = lambda body: raw_send(body, metadata=md, timeout=60)
    raw_send(b"", metadata=md, timeout=30)  # connect and authenticate before the window
    ready.wait()
    time.sleep(max(0.0, window[0] - time.time()))
    ctx["end"] = window[1]
    tally = Tally()
    poison_runs: List[str] = []
    attacks: List[Tuple[str, Callable[..., None], Tuple[Any, ...]]] = [
        ("poison", attack_poison, (ctx, tally, poison_runs)),
        ("tiny_runs", attack_tiny_runs, (ctx, tally)),
        ("idle_streams", attack_idle_streams, (ctx, tally)),
        ("gzip_bomb", attack_gzip_bomb, (ctx, tally)),
        ("deep_json", attack_deep_json, (ctx, tally)),
    ]
    cpu0 = time.process_time()
    threads = [threading.Thread(target=fn, args=a, name=f"hostile-{name}", daemon=True)
               for name, fn, a in attacks if name in ctx["attacks"]]
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(1.0, window[1] - time.time()) + 90)
    channel.close()
    out.put({"counts": {k: dict(v) for k, v in tally.counts.items()},
             "notes": {k: list(v) for k, v in tally.notes.items()},
             "samples": dict(tally.samples), "poison_runs": poison_runs, "cpu_s": time.process_time() - cpu0,
             "alive": [t.name for t in threads if t.is_alive()]})


# ------------------------------------------------------------------------------------------- phases

@dataclass
class PhaseResult:
    name: str
    probes: List[ProbeResult]
    bg_accepted: int = 0
    bg_errors: Dict[str, int] = field(default_factory=dict)
    server_cpu_pct: float = 0.0
    machine_busy_pct: float = 0.0
    depth_max: float = 0.0
    lag_max: float = 0.0
    readyz: str = ""
    metrics: List[Tuple[str, str, float]] = field(default_factory=list)
    hostile: Optional[Dict[str, Any]] = None
    started: float = 0.0  # time.monotonic() at the window's start
    long_run: LongRun = field(default_factory=LongRun)
    poison_incidents: Dict[str, Tuple[int, int]] = field(default_factory=dict)
    lr_growth: List[str] = field(default_factory=list)

    def lat(self, which: str) -> List[float]:
        return [getattr(p, f"{which}_s") for p in self.probes]


def _pct(values: Sequence[float], q: float) -> float:
    return ingest._percentile(values, q)


def _ms(x: float) -> str:
    return "inf" if math.isinf(x) else "nan" if math.isnan(x) else f"{x * 1000:.0f}"


def poison_incidents(server: ingest.Server, tenant: Tenant,
                     runs: Sequence[str]) -> Tuple[Dict[str, Tuple[int, int]], List[str]]:
    """Per way of sending (``run_id:how`` entries): (runs with an incident, runs); the distinct
    ``trigger.lr_growth`` values the incidents show."""
    conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=30)
    counts: Dict[str, List[int]] = {}
    growth: set[str] = set()
    try:
        for entry in runs:
            run_id, _, how = entry.partition(":")
            status, body = ingest.http_get(server.http_port, f"/api/v1/runs/{run_id}/incidents", tenant.read,
                                           conn)
            items = json.loads(body)["items"] if status == 200 else []
            tally = counts.setdefault(how, [0, 0])
            tally[0] += 1 if items else 0
            tally[1] += 1
            growth.update(str(i["trigger"]["lr_growth"]) for i in items
                          if "lr_growth" in i.get("trigger", {}))
    finally:
        conn.close()
    return {how: (c[0], c[1]) for how, c in counts.items()}, sorted(growth)


def run_phase(name: str, root: Path, args: argparse.Namespace) -> PhaseResult:
    """One server, the background tenants and the prober (and the hostile tenant in ``hostile``)."""
    data_dir = root / name
    tenants = make_tenants(data_dir)
    env = [f"TRAINGUARD_API_STREAM_MIN_INTERVAL_S={args.sse_interval:g}", *args.server_env]
    server = ingest.start_server(data_dir, server_env=env)
    ctx_mp = mp.get_context("spawn")
    ready, window, out, hostile_out = ctx_mp.Event(), ctx_mp.Array("d", 2), ctx_mp.Queue(), ctx_mp.Queue()
    procs = []
    n_batches = int(args.bg_rate * (args.seconds + 30) / args.bg_batch) + 2
    try:
        for i, bg in enumerate(("bg1", "bg2")):
            t = tenants[bg]
            procs.append(ctx_mp.Process(target=ingest.grpc_client, daemon=True, args=(
                f"rate:{args.bg_rate}", server.grpc_target, t.ingest, t.project, i, 2, args.bg_batch, 5, 2,
                n_batches, ready, window, out)))
        hostile_proc = None
        if name == "hostile":
            h = tenants["hostile"]
            ctx = {"target": server.grpc_target, "http_port": server.http_port, "token": h.ingest,
                   "project": h.project, "poison_every": args.poison_every, "tiny_runs": args.tiny_runs,
                   "tiny_rate": args.tiny_rate, "idle_streams": args.idle_streams,
                   "idle_connections": args.idle_connections, "bomb_every": args.bomb_every,
                   "deep_every": args.deep_every, "deep_levels": args.deep_levels, "attacks": args.attacks}
            hostile_proc = ctx_mp.Process(target=hostile_worker, args=(ctx, ready, window, hostile_out),
                                          daemon=True)
            procs.append(hostile_proc)
        for p in procs:
            p.start()
        ingest.wait_idle(procs, timeout=300)
        start_at = time.time() + 0.3
        window[0], window[1] = start_at, start_at + args.seconds
        ready.set()
        time.sleep(max(0.0, start_at - time.time()))
        busy0, cpu0, t0 = ingest.machine_busy_s(), server.cpu_s(), time.monotonic()
        sampler = Sampler(server.http_port).start()
        long_run = LongRun()
        long_thread = threading.Thread(
            target=run_long, name="soak-long-run", daemon=True,
            args=(server, tenants["calm"], args, name, t0 + args.seconds, long_run))
        long_thread.start()
        probes = run_probes(server, tenants["calm"], args, name, t0 + args.seconds)
        long_thread.join(args.probe_timeout + 60)
        busy1, cpu1, t1 = ingest.machine_busy_s(), server.cpu_s(), time.monotonic()
        sampler.stop()
        res = PhaseResult(name, probes, started=t0, long_run=long_run,
                          server_cpu_pct=100.0 * (cpu1 - cpu0) / (t1 - t0),
                          machine_busy_pct=100.0 * (busy1 - busy0) / (t1 - t0), depth_max=sampler.depth_max,
                          lag_max=sampler.lag_max)
        window[1] = min(window[1], time.time())  # the background clients stop now (probes may run late)
        errors: collections.Counter[str] = collections.Counter()
        for _ in range(2):
            r = out.get(timeout=120)
            res.bg_accepted += r.accepted
            errors.update(r.errors)
        res.bg_errors = dict(errors)
        if hostile_proc is not None:
            res.hostile = hostile_out.get(timeout=300)
            res.poison_incidents, res.lr_growth = poison_incidents(server, tenants["hostile"],
                                                                   res.hostile["poison_runs"])
        status, body = ingest.http_get(server.http_port, "/readyz")
        res.readyz = f"{status}" + ("" if status == 200 else f" {body.decode(errors='replace')[:300]}")
        res.metrics = metric_samples(server.http_port)
        for p in procs:
            p.join(30)
        return res
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        server.stop()


# ------------------------------------------------------------------------------------------ report

REPORTED_METRICS = ("trainguard_runs_quarantined_total", "trainguard_project_quota_evictions_total",
                    "trainguard_ingest_rejected_total", "trainguard_ingest_backpressure_total",
                    "trainguard_processor_errors_total", "trainguard_checkpoint_failures",
                    "trainguard_processor_undecodable_total", "trainguard_queue_depth",
                    "trainguard_ingest_events_total", "trainguard_processed_events_total")


def print_phase(r: PhaseResult, args: argparse.Namespace) -> None:
    sse, poll = r.lat("sse"), r.lat("poll")
    found = sum(1 for p in r.probes if not math.isinf(p.poll_s))
    kinds = collections.Counter(p.kind for p in r.probes)
    right = sum(1 for p in r.probes if p.first_step == NAN_STEP)
    errors = collections.Counter(p.error.split(":")[0] for p in r.probes if p.error)
    print(f"{r.name} probes={len(r.probes)} incidents_found={found} first_step_ok={right}/{len(r.probes)} "
          f"kinds={','.join(f'{k}:{v}' for k, v in sorted(kinds.items()))} "
          f"probe_errors={','.join(f'{k}:{v}' for k, v in sorted(errors.items())) or '0'}", flush=True)
    for label, values in (("poll", poll), ("sse", sse)):
        print(f"{r.name} event_to_incident via={label} p50_ms={_ms(_pct(values, 0.5))} "
              f"p99_ms={_ms(_pct(values, 0.99))} max_ms={_ms(max(values) if values else math.nan)}",
              flush=True)
    last = max((p.sent_at - r.started for p in r.probes if not math.isnan(p.sent_at)), default=0.0)
    for lo in range(0, int(last) + 1, int(args.timeline_s)):
        part = [p.poll_s for p in r.probes if lo <= p.sent_at - r.started < lo + args.timeline_s]
        if part:
            print(f"{r.name} timeline from_s={lo} to_s={lo + int(args.timeline_s)} probes={len(part)} "
                  f"poll_p50_ms={_ms(_pct(part, 0.5))} poll_max_ms={_ms(max(part))}", flush=True)
    lr = r.long_run
    print(f"{r.name} long_run steps={lr.steps} nan_step={lr.steps} incident={lr.kind} "
          f"first_step_ok={'yes' if lr.first_step == lr.steps else 'no'} poll_ms={_ms(lr.poll_s)}"
          + (f" error={lr.error}" if lr.error else ""), flush=True)
    acks = [p.ack_s for p in r.probes]
    print(f"{r.name} nan_step_ack p50_ms={_ms(_pct(acks, 0.5))} p99_ms={_ms(_pct(acks, 0.99))}", flush=True)
    bg_err = ",".join(f"{k}:{v}" for k, v in sorted(r.bg_errors.items())) or "0"
    print(f"{r.name} background accepted_events={r.bg_accepted} "
          f"events_per_s={r.bg_accepted / args.seconds:.0f} (asked 2x{args.bg_rate:g}) errors={bg_err}",
          flush=True)
    print(f"{r.name} server cpu_pct={r.server_cpu_pct:.0f} machine_busy_pct={r.machine_busy_pct:.0f} "
          f"queue_depth_max={r.depth_max:.0f} processing_lag_max_s={r.lag_max:.2f} readyz={r.readyz}",
          flush=True)
    if r.hostile is not None:
        h = r.hostile
        for attack, counts in sorted(h["counts"].items()):
            answers = " ".join(f"{k}={v}" for k, v in sorted(counts.items()))
            print(f"{r.name} hostile_answers attack={attack} {answers}", flush=True)
        for key, sample in sorted(h["samples"].items()):
            print(f"{r.name} hostile_answer_text {key}: {sample}", flush=True)
        notes = h["notes"]
        bomb = notes.get("gzip_bomb_answer_s", [])
        lived = notes.get("idle_stream_lived_s", [])
        print(f"{r.name} hostile_notes tiny_runs_sent={int(sum(notes.get('tiny_runs_sent', [0])))} "
              f"tiny_burst_s={sum(notes.get('tiny_runs_burst_s', [math.nan])):.1f} "
              f"gzip_bomb_answer_p50_ms={_ms(_pct(bomb, 0.5))} "
              f"idle_stream_deadline_after_s={_pct(lived, 0.5):.1f} hostile_client_cpu_s={h['cpu_s']:.1f} "
              f"threads_still_running={','.join(h['alive']) or 'none'}", flush=True)
        for how, (found, total) in sorted(r.poison_incidents.items()):
            print(f"{r.name} hostile_poison sent_as={how} runs={total} with_incident={found}", flush=True)
        print(f"{r.name} hostile_poison incident_lr_growth={','.join(r.lr_growth) or 'none'}", flush=True)
    for name, labels, value in r.metrics:
        if name in REPORTED_METRICS:
            print(f"{r.name} metrics {name}{labels}={value:.0f}", flush=True)


def print_summary(results: Dict[str, PhaseResult]) -> None:
    calm, hostile = results.get("calm"), results.get("hostile")
    if calm is None or hostile is None:
        return
    print("summary figure                       without_hostile  with_hostile  ratio", flush=True)
    for via in ("poll", "sse"):
        for q, label in ((0.5, "p50"), (0.99, "p99")):
            a, b = _pct(calm.lat(via), q), _pct(hostile.lat(via), q)
            ratio = b / a if a > 0 and not math.isinf(a) and not math.isinf(b) else math.nan
            print(f"summary event_to_incident_{via}_{label}_ms  {_ms(a):>15}  {_ms(b):>12}  {ratio:5.2f}",
                  flush=True)
    fa = sum(1 for p in calm.probes if not math.isinf(p.poll_s))
    fb = sum(1 for p in hostile.probes if not math.isinf(p.poll_s))
    print(f"summary incidents_found                {fa}/{len(calm.probes):<11}  {fb}/{len(hostile.probes)}",
          flush=True)
    print(f"summary background_events_accepted      {calm.bg_accepted:>13}  {hostile.bg_accepted:>12}",
          flush=True)
    print(f"summary server_cpu_pct                  {calm.server_cpu_pct:>13.0f}  "
          f"{hostile.server_cpu_pct:>12.0f}", flush=True)
    print(f"summary queue_depth_max                 {calm.depth_max:>13.0f}  {hostile.depth_max:>12.0f}",
          flush=True)
    print(f"summary readyz_at_end                   {calm.readyz.split()[0]:>13}  "
          f"{hostile.readyz.split()[0]:>12}", flush=True)


# --------------------------------------------------------------------------------------------- main

def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=None, help="length of each phase's load window (60)")
    p.add_argument("--phases", default=",".join(PHASES), help="comma list of: calm,hostile")
    p.add_argument("--bg-rate", type=float, default=1000.0, help="events/s of each background tenant")
    p.add_argument("--bg-batch", type=int, default=100, help="envelopes per background request")
    p.add_argument("--probe-interval", type=float, default=0.5, help="seconds between probe starts")
    p.add_argument("--probe-inflight", type=int, default=4, help="probes running at once at most")
    p.add_argument("--probe-timeout", type=float, default=30.0, help="seconds a probe waits for its incident")
    p.add_argument("--poll-ms", type=float, default=10.0, help="incident listing poll interval")
    p.add_argument("--sse-interval", type=float, default=0.2,
                   help="the live stream's interval (the server's api_stream_min_interval_s is set to it)")
    p.add_argument("--attacks", default=",".join(ATTACKS),
                   help="what the hostile tenant does (comma list of: " + ",".join(ATTACKS) + "); one alone "
                        "tells which costs the others latency")
    p.add_argument("--poison-every", type=float, default=1.0, help="seconds between poison runs")
    p.add_argument("--tiny-runs", type=int, default=None, help="one-event runs in the opening burst (10000)")
    p.add_argument("--tiny-rate", type=float, default=None, help="new one-event runs/s after the burst (200)")
    p.add_argument("--idle-streams", type=int, default=None, help="idle gRPC Stream calls held open (64)")
    p.add_argument("--idle-connections", type=int, default=4, help="connections they are spread over")
    p.add_argument("--bomb-every", type=float, default=5.0, help="seconds between gzip member bombs")
    p.add_argument("--deep-every", type=float, default=1.0, help="seconds between over-deep JSON requests")
    p.add_argument("--deep-levels", type=int, default=5000, help="nesting depth of the over-deep JSON")
    p.add_argument("--timeline-s", type=float, default=10.0,
                   help="the probes' latency is also printed per window of this many seconds")
    p.add_argument("--server-env", action="append", default=[], metavar="KEY=VALUE",
                   help="environment for both servers (repeatable)")
    p.add_argument("--data-dir", type=Path, default=None, help="parent of the servers' data dirs")
    p.add_argument("--keep-data", action="store_true", help="keep the servers' data directories")
    p.add_argument("--quick", action="store_true", help="a few seconds per phase, fewer runs (smoke test)")
    args = p.parse_args(argv)
    if args.seconds is None:
        args.seconds = 4.0 if args.quick else 60.0
    if args.tiny_runs is None:
        args.tiny_runs = 1000 if args.quick else 10_000
    if args.tiny_rate is None:
        args.tiny_rate = 50.0 if args.quick else 200.0
    if args.idle_streams is None:
        args.idle_streams = 24 if args.quick else 64
    args.timeline_s = max(1.0, args.timeline_s)
    if args.quick:
        args.timeline_s = min(args.timeline_s, 2.0)
        args.bomb_every = min(args.bomb_every, 2.0)
        args.bg_rate = min(args.bg_rate, 200.0)
    args.attacks = [x.strip() for x in args.attacks.split(",") if x.strip()]
    if set(args.attacks) - set(ATTACKS):
        p.error(f"unknown attack(s): {', '.join(sorted(set(args.attacks) - set(ATTACKS)))}")
    phases = [x.strip() for x in args.phases.split(",") if x.strip()]
    unknown = set(phases) - set(PHASES)
    if unknown:
        p.error(f"unknown phase(s): {', '.join(sorted(unknown))}")

    import google.protobuf
    import grpc

    print(f"env python={platform.python_version()} grpcio={grpc.__version__} "
          f"protobuf={google.protobuf.__version__} cpus={os.cpu_count()} loadavg_1m={os.getloadavg()[0]:.2f}",
          flush=True)
    print(f"config seconds_per_phase={args.seconds:g} "
          f"tenants=calm(prober),bg1,bg2,hostile(hostile phase only) "
          f"bg_rate={args.bg_rate:g}x2 bg_batch={args.bg_batch} probe_interval_s={args.probe_interval:g} "
          f"probe_inflight={args.probe_inflight} poll_ms={args.poll_ms:g} "
          f"sse_interval_s={args.sse_interval:g} "
          f"poison_every_s={args.poison_every:g} tiny_runs={args.tiny_runs} tiny_rate={args.tiny_rate:g} "
          f"idle_streams={args.idle_streams}/{args.idle_connections}conn bomb_every_s={args.bomb_every:g} "
          f"bomb_members={BOMB_MEMBERS} deep_every_s={args.deep_every:g} deep_levels={args.deep_levels} "
          f"attacks={','.join(args.attacks)} server_env={','.join(args.server_env) or 'defaults'}",
          flush=True)
    root = args.data_dir or Path(tempfile.mkdtemp(prefix="trainguard-soak-"))
    root.mkdir(parents=True, exist_ok=True)
    results: Dict[str, PhaseResult] = {}
    try:
        for name in phases:
            results[name] = run_phase(name, root, args)
            print_phase(results[name], args)
    finally:
        if args.keep_data:
            print(f"data kept in {root}", flush=True)
        elif args.data_dir is None:
            shutil.rmtree(root, ignore_errors=True)
    print_summary(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
