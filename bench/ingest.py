"""Ingest throughput and event → incident latency of the embedded server, measured in one run.

Prints numbers and ratios, asserts nothing. The server is a real ``trainguard serve`` subprocess (its own
interpreter, so its CPU is not shared with this script's GIL), a fresh data directory per phase:

(1) ``grpc_prebuilt`` — K client processes (``--clients``) send batches of B metric envelopes
    (``--batch``; the SDK's identity fields + ``--points`` points, unique event ids) to
    ``IngestService.Send``, ``--inflight`` calls outstanding per client, for ``--duration`` s. The
    ``IngestRequest`` bytes are built and serialized *before* the timed window and sent as raw bytes
    without compression, so a client's cost in the window is the gRPC send alone. Reported: accepted
    events/s (the sum of the acks' ``accepted`` that arrived inside the window), ack round trip p50/p99,
    the server's CPU (100% = one core; threads grouped by component from /proc, named through
    ``py-spy dump`` when py-spy is installed) and the clients', and whether the processor kept up: what it
    processed in the window, queue depth and processing lag (``/metrics``) at the end; then its rate with
    ingest stopped (``processor_alone``: whole processing rounds over >= 8 s while it works off the
    backlog).
(2) ``grpc_sdk`` — the same, but each client builds every batch in the window the way the SDK does:
    envelope dicts (:func:`trainguard.core.events.envelope`) sent through the SDK's own
    :class:`~trainguard.transport.grpc.GrpcTransport` (``wire.prepare_batch`` + gzip + ``Send``): what a
    real SDK client costs, client CPU included.
(3) ``http_json`` — ``POST /v1/ingest`` with pre-encoded JSON bodies (the SDK's ``encode_batch``),
    keep-alive connections, ``--inflight`` per client; ``http_protobuf`` the same events as a serialized
    ``IngestRequest`` (``application/x-protobuf``).
(4) ``latency`` — while one background client sends pre-built gRPC batches at ``--bg-fraction`` of the
    rate measured in (1) (or ``--bg-rate``), a probe sends every ``--probe-interval`` s one metric batch
    with ``loss = NaN`` (and the SDK's ``non_finite:loss`` alert) for a fresh run, then polls
    ``GET /api/v1/runs/{run}/incidents`` (read token) every ``--poll-ms`` until the incident is there.
    latency = (when the poll that saw it returned) minus (just before the Send). p50/p99 over
    ``--probes`` probes (120: the p99 is the second highest, not the max); ``ack`` is the Send's own round
    trip (durably queued). A reading is late by at most one poll interval. The embedded queue hands out
    one record of each run in turn and the processor's rounds are bounded by time (issue 15 (b)), so
    the probes do not wait behind the background run's backlog; that run's own events still do when the
    processor is past capacity: ``backlog_events_end`` (acknowledged, not processed, when the probes
    ended) and ``backlog_s`` (that over the processing rate: how long its newest event waits), beside
    ``processing_lag_s`` (/metrics: the last chunk's oldest record). When the processor does not keep up
    with that background, the probes run again on a fresh server at half the processor's solo rate:
    ``latency_within_capacity``.
(5) ``latency_sdk`` — a subprocess with the real SDK: ``trainguard.init(endpoint="grpc://...")``, a few
    finite steps, then ``trainguard.log(loss=nan)``; latency from that call to the incident being
    visible (the SDK sends a non-finite batch at once, through its worker thread). A handful of probes,
    one fresh run each, no background load.

(6) ``processor_alone`` -- bench/processor.py: the processor alone (queue → pipeline → stores, no
    server) on SDK-shaped streams (one request per rank and step: 16 and 4,096 ranks) and on this file's
    500-envelope stream, for this checkout and for ``--processor-baseline`` (a git ref, checked out in a
    temporary worktree) in the same run, with the speed-up and issue 15's target per shape; then the
    500-envelope figure over the gRPC ingest rate of (1), the same stream shape (target ≥ 0.5).

(7) ``gateway_alone`` -- the gateway's own cost per envelope, in process (no server, no gRPC, a queue that
    keeps nothing): pre-built requests of ``--batch`` metric envelopes decoded and ingested
    (``batch_from_protobuf`` / ``batch_from_json`` + ``Gateway.ingest_batch``, ``serve``'s default settings:
    the backlog bound and the metric-name bound on), for this checkout and each ``--gateway-baseline`` ref
    (``git archive`` into a temporary directory, imported in a subprocess of its own), alternating over
    ``--gateway-rounds`` rounds; best per tree, the ratios, and the load average beside each figure.
    Target: protobuf within 1.3x of the gateway before the per-run name bound and the points-counted
    backlog (ea01d7d, the commit before 79a51a3).

    python bench/ingest.py                          # the full run (~2 minutes)
    python bench/ingest.py --skip grpc,sdk,http,latency,latency_sdk,processor \
        --gateway-baseline HEAD,ea01d7d             # gateway_alone only, beside HEAD and ea01d7d
    python bench/ingest.py --duration 20 --clients 3
    python bench/ingest.py --profile /tmp/prof      # + py-spy over the server in (1), by component
    python bench/ingest.py --profile /tmp/prof --gil          # ... sampling only the GIL holder
    python bench/ingest.py --server-env TRAINGUARD_PROCESSOR_BATCH=8   # try a server setting
    python bench/ingest.py --quick                  # seconds; what tests/bench/test_ingest_smoke.py runs

Targets (issue 3, this 2-core machine): ≥ 120,000 metric events/s through batched gRPC; event → incident
p99 < 1 s. The final ``summary`` block prints each figure next to its target.
"""

from __future__ import annotations

import argparse
import collections
import http.client
import json
import math
import multiprocessing as mp
import os
import platform
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
import processor as processor_bench  # noqa: E402  (bench/processor.py: processor-alone beside a baseline)

for _src in (REPO / "sdk" / "src", REPO / "engine" / "src", REPO / "services" / "src"):
    # a --gateway-worker of another tree (TRAINGUARD_BENCH_TREE) imports that tree's sources (PYTHONPATH)
    if _src.is_dir() and str(_src) not in sys.path and not os.environ.get("TRAINGUARD_BENCH_TREE"):
        sys.path.insert(0, str(_src))

GRPC_TARGET = 120_000      # metric events/s through batched gRPC
P99_TARGET_S = 1.0         # event → incident
SEND_METHOD = "/trainguard.v1.IngestService/Send"
METRIC_NAMES = ("loss", "lr", "grad/global_norm", "throughput/samples_per_s", "amp/scale", "loss/aux",
                "data/wait_s", "mem/allocated_gb")
SDK_NAME = "trainguard-python/bench"


# ----------------------------------------------------------------------------------------- server

@dataclass
class Server:
    """A ``trainguard serve`` subprocess on free ports with its own data directory."""

    proc: subprocess.Popen  # type: ignore[type-arg]
    data_dir: Path
    http_port: int
    grpc_port: int
    project: str
    ingest_token: str
    read_token: str
    log_path: Path

    @property
    def pid(self) -> int:
        return int(self.proc.pid)

    @property
    def grpc_target(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def cpu_s(self) -> float:
        """User + system CPU seconds of the server so far: all its threads, and any live child process."""
        return proc_cpu_s(self.pid) + sum(proc_cpu_s(child) for child in descendants(self.pid))

    def metrics(self) -> Dict[str, float]:
        """The server's ``/metrics`` as {name: value} (labelled series summed)."""
        status, body = http_get(self.http_port, "/metrics")
        if status != 200:
            raise RuntimeError(f"/metrics answered {status}")
        out: Dict[str, float] = collections.defaultdict(float)
        for line in body.decode().splitlines():
            if not line or line.startswith("#"):
                continue
            name, _, value = line.rpartition(" ")
            out[name.split("{", 1)[0]] += float(value)
        return dict(out)

    def stop(self) -> None:
        """SIGTERM (the server starts draining what it holds), then SIGKILL after a second: a benchmark does
        not wait for a backlog; acknowledged records are durable either way (redelivered at next start)."""
        if self.proc.poll() is None:
            children = descendants(self.pid)
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(1.0)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
            for child in children:
                try:
                    os.kill(child, signal.SIGKILL)
                except OSError:
                    pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def proc_cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat", "rb") as fh:
        fields = fh.read().rsplit(b")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks  # utime, stime


def machine_busy_s() -> float:
    """CPU seconds the whole machine has been busy (all cores, /proc/stat): to tell how much CPU other
    processes took during a window (the bench shares the machine with whatever else runs)."""
    with open("/proc/stat") as fh:
        fields = [int(x) for x in fh.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    busy = sum(fields[:8]) - idle  # user nice system idle iowait irq softirq steal
    return busy / os.sysconf("SC_CLK_TCK")


def descendants(pid: int) -> List[int]:
    """Live child processes of ``pid``, recursively."""
    out: List[int] = []
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return out
    for task in tasks:
        try:
            children = [int(x) for x in (task / "children").read_text().split()]
        except (OSError, ValueError):
            continue
        for child in children:
            out.append(child)
            out.extend(descendants(child))
    return out


def thread_cpu_s(pid: int) -> Dict[int, Tuple[str, float]]:
    """{tid: (comm, user + system CPU seconds)} of every thread of ``pid``; a child process counts as one
    entry (key: minus its pid, comm ``child:<comm>``)."""
    ticks = os.sysconf("SC_CLK_TCK")
    out: Dict[int, Tuple[str, float]] = {}
    for child in descendants(pid):
        try:
            comm = Path(f"/proc/{child}/comm").read_text().strip()
            out[-child] = (f"child:{comm}", proc_cpu_s(child))
        except OSError:
            continue
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            raw = (task / "stat").read_bytes()
        except OSError:
            continue
        comm = raw[raw.index(b"(") + 1:raw.rindex(b")")].decode(errors="replace")
        fields = raw.rsplit(b")", 1)[1].split()
        out[int(task.name)] = (comm, (int(fields[11]) + int(fields[12])) / ticks)
    return out


def python_thread_names(pid: int) -> Dict[int, str]:
    """{native tid: Python thread name} from ``py-spy dump`` (empty when py-spy is not installed)."""
    exe = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(exe).exists():
        return {}
    try:
        text = subprocess.run([exe, "dump", "--pid", str(pid)], capture_output=True, text=True,
                              timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return {}
    pattern = re.compile(r'^Thread (\S+) \([^)]*\): "([^"]*)"', re.MULTILINE)
    return {int(m.group(1), 0): m.group(2) for m in pattern.finditer(text)}


#: thread name pattern → the server component it belongs to (per-thread CPU accounting)
THREAD_GROUPS: Tuple[Tuple[str, str], ...] = (
    (r"^grpc-ingest", "gateway: gRPC handlers (decode, validate, queue publish)"),
    (r"^trainguard-processor", "processor (decode, pipeline, stores)"),
    (r"\(_serve\)", "grpc python server loop"),
    (r"^trainguard-http|^AnyIO|^asyncio", "http/api (uvicorn event loop + threadpool)"),
    (r"^event_engine|^grpc_|^lifeguard|^default-exec|^resolver|^timer", "grpc C-core threads"),
    (r"^MainThread", "main thread"),
    (r"^child:", "child processes of the server"),
)


def group_threads(before: Dict[int, Tuple[str, float]], after: Dict[int, Tuple[str, float]],
                  names: Dict[int, str], seconds: float) -> List[Tuple[str, float]]:
    """CPU % (100 = one core) per component over a window, from two :func:`thread_cpu_s` readings."""
    groups: Dict[str, float] = collections.defaultdict(float)
    for tid, (comm, cpu) in after.items():
        delta = cpu - before.get(tid, (comm, 0.0))[1]
        name = names.get(tid, comm)
        unnamed = "python threads (unnamed: py-spy not installed)" if name == "python" else f"other ({name})"
        group = next((g for pattern, g in THREAD_GROUPS if re.search(pattern, name)), unnamed)
        groups[group] += delta
    shares = [(g, 100.0 * cpu / seconds) for g, cpu in groups.items() if cpu > 0]
    return sorted(shares, key=lambda kv: -kv[1])


def http_get(port: int, path: str, token: Optional[str] = None,
             conn: Optional[http.client.HTTPConnection] = None) -> Tuple[int, bytes]:
    own = conn is None
    c = conn or http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        c.request("GET", path, headers=headers)
        resp = c.getresponse()
        return resp.status, resp.read()
    finally:
        if own:
            c.close()


def start_server(data_dir: Path, serve_cmd: Optional[List[str]] = None,
                 server_env: Sequence[str] = ()) -> Server:
    data_dir.mkdir(parents=True, exist_ok=True)
    http_port, grpc_port = free_port(), free_port()
    log_path = data_dir / "serve.log"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / d / "src") for d in ("sdk", "engine", "services")]
                                        + [env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    for key in [k for k in env if k.startswith("TRAINGUARD_")]:
        del env[key]
    # the gateway's and the processor's own rates: one project's backlog is not bounded here (serve's
    # per-project bound, 40,000 events by default, would turn the gateway's rate into the processor's)
    env["TRAINGUARD_PROJECT_MAX_BACKLOG_EVENTS"] = "0"
    for item in server_env:
        key, _, value = item.partition("=")
        env[key] = value
    cmd = list(serve_cmd or [sys.executable, "-m", "trainguard_server", "serve"])
    cmd += ["--data-dir", str(data_dir), "--http-port", str(http_port), "--grpc-port", str(grpc_port)]
    with open(log_path, "wb") as log_fh:
        proc = subprocess.Popen(cmd, stdout=log_fh, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    tokens_path = data_dir / "bootstrap-tokens.json"
    deadline = time.monotonic() + 60
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"trainguard serve exited with {proc.returncode}:\n"
                               f"{log_path.read_text(errors='replace')[-3000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError("trainguard serve did not become ready in 60 s")
        try:
            if tokens_path.exists() and http_get(http_port, "/readyz")[0] == 200:
                break
        except OSError:
            pass
        time.sleep(0.05)
    tokens = json.loads(tokens_path.read_text())
    return Server(proc, data_dir, http_port, grpc_port, tokens["project"], tokens["ingest"], tokens["read"],
                  log_path)


# --------------------------------------------------------------------------------- event building

def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def identity(project: str, run_id: str, rank: int, world: int) -> Dict[str, Any]:
    """The identity fields the SDK stamps on every envelope of one process."""
    return {"project": project, "run_id": run_id, "trace_id": run_id, "host": f"bench-node-{rank // 8}",
            "pid": 40_000 + rank, "rank": rank, "local_rank": rank % 8, "world_size": world,
            "run_name": "ingest-bench", "sdk": SDK_NAME, "group_rank": rank // 8}


def metric_values(step: int, points: int) -> Dict[str, float]:
    """A realistic set of ``points`` scalars for one training step (periodic in the step: 16 value sets,
    which lets :class:`BatchFactory` pre-serialize the bodies)."""
    step %= BatchFactory.VARIANTS
    values = {"loss": 2.5 - 0.01 * step + 0.003 * ((step * 7919) % 13),
              "lr": 3e-4 * min(1.0, step / 1000.0), "grad/global_norm": 0.5 + 0.05 * ((step * 31) % 7),
              "throughput/samples_per_s": 1200.0 + (step % 17), "amp/scale": 65536.0,
              "loss/aux": 0.1 + 0.001 * (step % 11), "data/wait_s": 0.002 * (step % 5),
              "mem/allocated_gb": 21.5 + 0.01 * (step % 3)}
    return {name: values[name] for name in METRIC_NAMES[:points]}


def event_dicts(ident: Dict[str, Any], first_step: int, count: int, points: int, prefix: str,
                now_ns: int) -> List[Dict[str, Any]]:
    """``count`` metric envelopes as the SDK builds them (one per step), ids ``prefix`` + a counter."""
    from trainguard.core import events as ev

    return [ev.envelope(ident, "metrics", ev.metrics_payload(metric_values(s, points)), step=s,
                        time_unix_nano=now_ns, event_id=f"{prefix}{s:016x}")
            for s in range(first_step, first_step + count)]


class BatchFactory:
    """Serialized ``IngestRequest`` bytes of B metric envelopes, fast (~0.5 µs/event): each envelope is a
    fixed serialized body (identity, time, severity, payload: one of a few value sets) plus its own
    ``event_id`` and ``step`` fields in front (protobuf accepts fields in any order). Equal, after
    parsing, to what the SDK would send for those steps (checked once per factory)."""

    VARIANTS = 16

    def __init__(self, ident: Dict[str, Any], points: int, prefix: str, now_ns: int) -> None:
        from trainguard import wire

        self.prefix = prefix
        self.bodies: List[bytes] = []
        for v in range(self.VARIANTS):
            d = event_dicts(ident, v, 1, points, prefix, now_ns)[0]
            env = wire.envelope_from_dict(d)
            env.ClearField("event_id")
            env.ClearField("step")
            self.bodies.append(env.SerializeToString())
        self._check(ident, points, now_ns)

    def envelope(self, step: int) -> bytes:
        event_id = f"{self.prefix}{step:016x}".encode()
        inner = (b"\x0a" + _varint(len(event_id)) + event_id + b"\x50" + _varint(step)
                 + self.bodies[step % self.VARIANTS])
        return b"\x0a" + _varint(len(inner)) + inner  # IngestRequest.events (field 1)

    def request(self, first_step: int, count: int) -> bytes:
        return b"".join([self.envelope(s) for s in range(first_step, first_step + count)])

    def _check(self, ident: Dict[str, Any], points: int, now_ns: int) -> None:
        from trainguard import wire
        from trainguard.v1 import ingest_pb2

        got = ingest_pb2.IngestRequest.FromString(self.request(16, 3))
        want = wire.prepare_batch(event_dicts(ident, 16, 3, points, self.prefix, now_ns)).request
        for a, b in zip(got.events, want.events):
            a.metrics.points.sort(key=lambda p: p.name)
            b.metrics.points.sort(key=lambda p: p.name)
        if got != want:
            raise AssertionError("BatchFactory does not reproduce the SDK's envelopes")


def probe_request(project: str, run_id: str, now_ns: int) -> bytes:
    """One metric batch with ``loss = NaN`` as the SDK sends it (alert + recent history)."""
    from trainguard import wire
    from trainguard.core import events as ev

    ident = identity(project, run_id, 0, 1)
    recent = [(name, 99, value) for name, value in metric_values(99, 3).items()]
    values = dict(metric_values(100, 3), loss=float("nan"))
    d = ev.envelope(ident, "metrics", ev.metrics_payload(values, alert="non_finite:loss", recent=recent),
                    step=100, time_unix_nano=now_ns, severity="ERROR")
    return bytes(wire.prepare_batch([d]).request.SerializeToString())


# ------------------------------------------------------------------------------------ client workers

@dataclass
class ClientResult:
    accepted: int = 0
    batches: int = 0
    errors: Dict[str, int] = field(default_factory=dict)
    rtts: List[float] = field(default_factory=list)
    cpu_s: float = 0.0
    exhausted: bool = False
    build_s: float = 0.0


def _percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def _grpc_channel(target: str) -> Any:
    import grpc

    return grpc.insecure_channel(target, options=[("grpc.max_send_message_length", 64 << 20),
                                                  ("grpc.max_receive_message_length", 64 << 20)])


def grpc_client(kind: str, target: str, token: str, project: str, client: int, clients: int, batch: int,
                points: int, inflight: int, n_batches: int, ready: Any, window: Any, out: Any,
                runs: int = 1) -> None:
    """One client process. ``kind``: ``prebuilt`` (raw bytes built before the window), ``sdk`` (the SDK's
    converter + GrpcTransport in the window) or ``rate:<events/s>`` (prebuilt, paced; background load).
    ``runs`` (prebuilt and paced): the client's batches go to that many runs in turn (``--runs-per-client``),
    each run's steps in order -- a platform's many runs, which a partitioned processor spreads over its
    workers; 1: one run per client, as before."""
    import grpc

    from trainguard.v1 import ingest_pb2

    res = ClientResult()
    now_ns = time.time_ns()
    run_id = f"bench-{kind.split(':')[0]}-{os.getpid()}-{client}"
    ident = identity(project, run_id, client, clients)
    prefix = f"{client:04x}{os.getpid() & 0xFFFFFFFF:08x}"  # + 16 hex digits of the step: 28 chars
    metadata = (("authorization", f"Bearer {token}"),)
    t0 = time.perf_counter()
    requests: List[bytes] = []
    transport = None
    if kind == "sdk":
        from trainguard.transport.grpc import GrpcTransport

        transport = GrpcTransport(target, token)  # gzip on, as the SDK's default
        transport.send(event_dicts(ident, 0, 1, points, prefix + "w", now_ns), 10.0)  # warm the channel
    elif runs <= 1:
        factory = BatchFactory(ident, points, prefix, now_ns)
        requests = [factory.request(i * batch, batch) for i in range(n_batches)]
    else:  # run r's event ids: the client's prefix with r in place of the pid's top byte (still unique)
        factories = [BatchFactory(identity(project, f"{run_id}-{r}", client, clients), points,
                                  f"{client:04x}{r:02x}{os.getpid() & 0xFFFFFF:06x}", now_ns)
                     for r in range(runs)]
        requests = [factories[i % runs].request((i // runs) * batch, batch) for i in range(n_batches)]
    res.build_s = time.perf_counter() - t0
    channel = _grpc_channel(target)
    send = channel.unary_unary(SEND_METHOD, request_serializer=None,
                               response_deserializer=ingest_pb2.IngestResponse.FromString)
    if kind != "sdk":
        send(requests[0][:0], metadata=metadata, timeout=10)  # an empty batch: connects and authenticates
    ready.wait()
    start_at, end_at = window[0], window[1]
    time.sleep(max(0.0, start_at - time.time()))
    cpu0 = time.process_time()

    def note_error(code: str) -> None:
        res.errors[code] = res.errors.get(code, 0) + 1

    if kind == "sdk":
        assert transport is not None
        step = 0
        while time.time() < end_at:
            events = event_dicts(ident, step, batch, points, prefix, time.time_ns())
            step += batch
            t = time.perf_counter()
            try:
                result = transport.send(events, 30.0)
            except Exception as exc:  # TransportError: counted, the window goes on
                note_error(getattr(exc, "status", type(exc).__name__))
                continue
            if time.time() <= end_at:
                res.accepted += result.accepted
                res.batches += 1
                res.rtts.append(time.perf_counter() - t)
    else:
        interval = 0.0
        if kind.startswith("rate:"):
            interval = batch / float(kind.split(":", 1)[1])
        pending: collections.deque = collections.deque()  # (future, sent perf_counter)
        nxt = 0
        next_send = time.perf_counter()
        while True:
            now = time.time()
            end_at = window[1]  # re-read: the latency phase ends its background client early
            if now >= end_at:
                break
            while len(pending) < inflight and now < end_at:
                if nxt >= len(requests):
                    res.exhausted = True
                    break
                if interval:
                    delay = next_send - time.perf_counter()
                    if delay > 0:
                        if pending:
                            break
                        time.sleep(delay)
                    next_send += interval
                pending.append((send.future(requests[nxt], metadata=metadata, timeout=60),
                                time.perf_counter()))
                nxt += 1
                now = time.time()
            if not pending:
                if res.exhausted:
                    break
                continue
            fut, sent = pending.popleft()
            try:
                resp = fut.result()
            except grpc.RpcError as err:
                note_error(err.code().name)
                continue
            if time.time() <= end_at:
                res.accepted += resp.accepted
                res.batches += 1
                res.rtts.append(time.perf_counter() - sent)
        for fut, _ in pending:  # answered after the window: not counted
            try:
                fut.result()
            except grpc.RpcError:
                pass
    res.cpu_s = time.process_time() - cpu0
    if transport is not None:
        transport.close()
    channel.close()
    out.put(res)


def http_client(kind: str, port: int, token: str, project: str, client: int, clients: int, batch: int,
                points: int, inflight: int, n_batches: int, ready: Any, window: Any, out: Any) -> None:
    """One HTTP client process: ``inflight`` keep-alive connections (a thread each) posting pre-encoded
    bodies (``json``: the SDK's encode_batch; ``protobuf``: serialized IngestRequest)."""
    from trainguard.core import events as ev

    res = ClientResult()
    now_ns = time.time_ns()
    run_id = f"bench-http-{kind}-{os.getpid()}-{client}"
    ident = identity(project, run_id, client, clients)
    prefix = f"{client:04x}{os.getpid() & 0xFFFFFFFF:08x}"
    t0 = time.perf_counter()
    if kind == "json":
        bodies = [ev.encode_batch(event_dicts(ident, i * batch, batch, points, prefix, now_ns))
                  for i in range(n_batches)]
        ctype = "application/json"
    else:
        factory = BatchFactory(ident, points, prefix, now_ns)
        bodies = [factory.request(i * batch, batch) for i in range(n_batches)]
        ctype = "application/x-protobuf"
    res.build_s = time.perf_counter() - t0
    headers = {"Authorization": f"Bearer {token}", "Content-Type": ctype}
    lock = threading.Lock()
    counter = iter(range(len(bodies)))
    conns = [http.client.HTTPConnection("127.0.0.1", port, timeout=60) for _ in range(inflight)]
    for c in conns:
        c.connect()
    ready.wait()
    start_at, end_at = window[0], window[1]
    time.sleep(max(0.0, start_at - time.time()))
    cpu0 = time.process_time()

    def run(conn: http.client.HTTPConnection) -> None:
        while time.time() < end_at:
            with lock:
                i = next(counter, None)
            if i is None:
                res.exhausted = True
                return
            t = time.perf_counter()
            try:
                conn.request("POST", "/v1/ingest", body=bodies[i], headers=headers)
                resp = conn.getresponse()
                body = resp.read()
            except OSError as exc:
                with lock:
                    res.errors[type(exc).__name__] = res.errors.get(type(exc).__name__, 0) + 1
                return
            with lock:
                if resp.status != 200:
                    res.errors[str(resp.status)] = res.errors.get(str(resp.status), 0) + 1
                elif time.time() <= end_at:
                    if kind == "json":
                        res.accepted += int(json.loads(body)["accepted"])
                    else:
                        from trainguard.v1 import ingest_pb2
                        res.accepted += ingest_pb2.IngestResponse.FromString(body).accepted
                    res.batches += 1
                    res.rtts.append(time.perf_counter() - t)

    threads = [threading.Thread(target=run, args=(c,)) for c in conns]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    res.cpu_s = time.process_time() - cpu0
    for c in conns:
        c.close()
    out.put(res)


# ------------------------------------------------------------------------------------------ phases

@dataclass
class LoadResult:
    label: str
    duration: float
    accepted: int
    batches: int
    errors: Dict[str, int]
    rtts: List[float]
    server_cpu_pct: float
    clients_cpu_pct: float
    exhausted: bool
    build_s: float
    before: Dict[str, float]
    after: Dict[str, float]
    threads: List[Tuple[str, float]] = field(default_factory=list)
    others_cpu_pct: float = 0.0

    @property
    def events_per_s(self) -> float:
        return self.accepted / self.duration


class Profiler:
    """py-spy over the server for the length of a window (``--profile``): raw collapsed stacks."""

    def __init__(self, directory: Optional[Path], gil: bool = False) -> None:
        self.directory = directory
        self.gil = gil
        self.proc: Optional[subprocess.Popen] = None  # type: ignore[type-arg]
        self.path: Optional[Path] = None

    def start(self, pid: int, seconds: float, name: str) -> None:
        if self.directory is None:
            return
        exe = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
        if not Path(exe).exists():
            print("profile skipped: py-spy not found (pip install py-spy)", flush=True)
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        self.path = self.directory / f"{name}.txt"
        self.proc = subprocess.Popen(
            [exe, "record", "--pid", str(pid), "--duration", str(max(1, int(seconds))), "--rate", "200",
             "--format", "raw", "--threads", "--nonblocking", "-o", str(self.path)]
            + (["--gil"] if self.gil else []),
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    def finish(self) -> Optional[Path]:
        if self.proc is None:
            return None
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.proc = None
        return self.path if self.path is not None and self.path.exists() else None


def run_load(label: str, target: Any, server: Server, args: argparse.Namespace, kind: str, clients: int,
             duration: float, n_batches: int, profiler: Optional[Profiler] = None) -> LoadResult:
    """Start ``clients`` processes running ``target``, open the window when all are ready, collect."""
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    window = ctx.Array("d", 2)
    out = ctx.Queue()
    conn_arg: Any = server.grpc_target if target is grpc_client else server.http_port
    # bench/pipeline.py calls this with its own arguments, which have no --runs-per-client
    extra = (getattr(args, "runs_per_client", 1),) if target is grpc_client else ()
    procs = [ctx.Process(target=target, args=(kind, conn_arg, server.ingest_token, server.project, i, clients,
                                              args.batch, args.points, args.inflight, n_batches, ready,
                                              window, out, *extra), daemon=True)
             for i in range(clients)]
    for p in procs:
        p.start()
    # the clients build their batches, connect, then wait for ``ready``; give them until they are idle
    wait_idle(procs, timeout=300)
    start_at = time.time() + 0.3
    window[0], window[1] = start_at, start_at + duration
    ready.set()
    time.sleep(max(0.0, start_at - time.time()))
    busy0, cpu0, threads0 = machine_busy_s(), server.cpu_s(), thread_cpu_s(server.pid)
    before = server.metrics()
    if profiler is not None:
        profiler.start(server.pid, duration, label)
    time.sleep(max(0.0, start_at + duration - time.time()))
    busy1, cpu1, threads1 = machine_busy_s(), server.cpu_s(), thread_cpu_s(server.pid)
    after = server.metrics()
    threads = group_threads(threads0, threads1, python_thread_names(server.pid), duration)
    results: List[ClientResult] = []
    for _ in procs:
        results.append(out.get(timeout=120))
    for p in procs:
        p.join(30)
    errors: collections.Counter[str] = collections.Counter()
    for r in results:
        errors.update(r.errors)
    clients_cpu = sum(r.cpu_s for r in results)
    others = max(0.0, (busy1 - busy0) - (cpu1 - cpu0) - clients_cpu)  # + this script's own main loop
    return LoadResult(label, duration, sum(r.accepted for r in results), sum(r.batches for r in results),
                      dict(errors), [x for r in results for x in r.rtts], 100.0 * (cpu1 - cpu0) / duration,
                      100.0 * clients_cpu / duration, any(r.exhausted for r in results),
                      max(r.build_s for r in results), before, after, threads, 100.0 * others / duration)


def wait_idle(procs: Sequence[Any], timeout: float) -> None:
    """Wait until every client process has finished building (its CPU stops growing) or died."""
    deadline = time.monotonic() + timeout
    last: Dict[int, float] = {}
    steady = 0
    while time.monotonic() < deadline:
        time.sleep(0.25)
        dead = [p for p in procs if not p.is_alive()]
        if dead:
            raise RuntimeError(f"a client process exited early (exit code {dead[0].exitcode})")
        now = {p.pid: proc_cpu_s(p.pid) for p in procs}
        if last and all(now[pid] - last.get(pid, 0.0) < 0.02 for pid in now):
            steady += 1
            if steady >= 2:
                return
        else:
            steady = 0
        last = now
    raise RuntimeError("client processes did not get ready in time")


def print_load(r: LoadResult, batch: int) -> None:
    rtt = [x * 1000 for x in r.rtts]
    errors = ",".join(f"{k}:{v}" for k, v in sorted(r.errors.items())) or "0"
    print(f"{r.label} events_per_s={r.events_per_s:.0f} batches_per_s={r.batches / r.duration:.1f} "
          f"batch={batch} ack_p50_ms={_percentile(rtt, 0.5):.1f} ack_p99_ms={_percentile(rtt, 0.99):.1f} "
          f"server_cpu_pct={r.server_cpu_pct:.0f} clients_cpu_pct={r.clients_cpu_pct:.0f} "
          f"others_cpu_pct={r.others_cpu_pct:.0f} errors={errors}"
          + (" exhausted=yes(lower bound)" if r.exhausted else ""), flush=True)
    for group, pct in r.threads:
        print(f"{r.label} server_threads cpu_pct={pct:5.1f} {group}", flush=True)


def processor_report(label: str, server: Server, r: LoadResult, alone_s: float,
                     profiler: Optional[Profiler] = None) -> Dict[str, float]:
    """Did the processor keep up during the window, and how fast is it with ingest stopped?"""
    b, a = r.before, r.after
    processed = a.get("trainguard_processed_events_total", 0) - b.get("trainguard_processed_events_total", 0)
    ingested = a.get("trainguard_ingest_events_total", 0) - b.get("trainguard_ingest_events_total", 0)
    depth = a.get("trainguard_queue_depth", 0)
    lag = a.get("trainguard_processing_lag_seconds", 0)
    rate = processed / r.duration
    kept_up = lag < 1.0 and processed >= 0.9 * ingested
    alone = alone_cpu = backlog_events = drain_s = float("nan")
    if alone_s > 0 and depth > 0:
        # The processor's counters move once per round (up to processor_batch records), so measure from
        # one round's end to another's, at least ``alone_s`` apart: whole rounds only.
        if profiler is not None:
            profiler.start(server.pid, alone_s, label + "_processor_alone")
        first: Optional[Tuple[float, float, float]] = None
        last: Optional[Tuple[float, float, float]] = None
        seen = server.metrics()["trainguard_processed_events_total"]
        give_up = time.monotonic() + 4 * alone_s + 10
        while time.monotonic() < give_up:
            time.sleep(0.05)
            n = server.metrics()["trainguard_processed_events_total"]
            if n == seen:
                continue
            seen = n
            point = (time.monotonic(), n, server.cpu_s())
            if first is None:
                first = point
                # each /metrics read costs the server ~1.6 ms of CPU (~1 us/event at 50 ms polls): wait out
                # most of the window unobserved, then poll finely for the round boundary that ends it
                time.sleep(max(0.0, alone_s - 0.25))
            else:
                last = point
                if last[0] - first[0] >= alone_s:
                    break
        if first is not None and last is not None:
            alone = (last[1] - first[1]) / (last[0] - first[0])
            alone_cpu = 100.0 * (last[2] - first[2]) / (last[0] - first[0])
            m = server.metrics()
            backlog_events = (m.get("trainguard_ingest_events_total", 0)
                              - m["trainguard_processed_events_total"])
            drain_s = backlog_events / alone if alone > 0 else float("inf")
    print(f"{label} processor events_per_s={rate:.0f} ingested_per_s={ingested / r.duration:.0f} "
          f"queue_depth_end={depth:.0f} processing_lag_s={lag:.2f} kept_up={'yes' if kept_up else 'no'}",
          flush=True)
    if not math.isnan(alone):
        print(f"{label} processor_alone events_per_s={alone:.0f} server_cpu_pct={alone_cpu:.0f} "
              f"backlog_events={backlog_events:.0f} drain_eta_s={drain_s:.0f}", flush=True)
    return {"processed_per_s": rate, "alone": alone, "depth": depth, "lag": lag}


def latency_phase(server: Server, args: argparse.Namespace, bg_rate: float,
                  label: str = "latency") -> Dict[str, Any]:
    """Probes while a paced background client runs; see the module docstring (4)."""
    from trainguard.v1 import ingest_pb2

    ctx = mp.get_context("spawn")
    ready, window, out = ctx.Event(), ctx.Array("d", 2), ctx.Queue()
    probe_span = args.probes * args.probe_interval + 5.0
    bg_batches = int(bg_rate * (probe_span + 30) / args.batch) + 2 if bg_rate > 0 else 0
    bg = None
    if bg_rate > 0:
        bg = ctx.Process(target=grpc_client,
                         args=(f"rate:{bg_rate}", server.grpc_target, server.ingest_token, server.project,
                               0, 1, args.batch, args.points, 2, bg_batches, ready, window, out), daemon=True)
        bg.start()
        wait_idle([bg], timeout=300)
    start_at = time.time() + 0.3
    window[0], window[1] = start_at, start_at + probe_span + 30
    ready.set()
    time.sleep(max(0.0, start_at - time.time()) + 1.0)  # let the background load settle
    m0, c0, t0w = server.metrics(), server.cpu_s(), time.monotonic()

    channel = _grpc_channel(server.grpc_target)
    send = channel.unary_unary(SEND_METHOD, request_serializer=None,
                               response_deserializer=ingest_pb2.IngestResponse.FromString)
    metadata = (("authorization", f"Bearer {server.ingest_token}"),)
    send(b"", metadata=metadata, timeout=10)
    poll_s = args.poll_ms / 1000.0
    tag = os.urandom(3).hex()

    def probe(i: int, at: float) -> Tuple[float, float, str]:
        time.sleep(max(0.0, at - time.monotonic()))
        run_id = f"probe-{tag}-{i:04d}"
        body = probe_request(server.project, run_id, time.time_ns())
        conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=30)
        t_sent = time.monotonic()
        resp = send(body, metadata=metadata, timeout=30)
        t_ack = time.monotonic()
        if resp.accepted != 1:
            raise RuntimeError(f"probe batch not accepted: {resp}")
        path = f"/api/v1/runs/{run_id}/incidents"
        try:
            while True:
                status, data = http_get(server.http_port, path, server.read_token, conn)
                if status == 200:
                    items = json.loads(data)["items"]
                    if items:
                        kind = f"{items[0].get('category')}/{items[0].get('subtype')}"
                        return time.monotonic() - t_sent, t_ack - t_sent, kind
                elif status != 404:
                    raise RuntimeError(f"GET {path} answered {status}: {data[:200]!r}")
                if time.monotonic() - t_sent > args.probe_timeout:
                    return float("inf"), t_ack - t_sent, "timeout"
                time.sleep(poll_s)
        finally:
            conn.close()

    begin = time.monotonic() + 0.1
    with ThreadPoolExecutor(max_workers=32) as pool:
        futures = [pool.submit(probe, i, begin + i * args.probe_interval) for i in range(args.probes)]
        results = [f.result() for f in futures]
    m1, c1, t1w = server.metrics(), server.cpu_s(), time.monotonic()
    channel.close()
    if bg is not None:
        window[1] = time.time()  # end the background client now
        out.get(timeout=120)
        bg.join(30)
    lat = [r[0] for r in results]
    acks = [r[1] for r in results]
    kinds = collections.Counter(r[2] for r in results)
    ingested = (m1["trainguard_ingest_events_total"] - m0["trainguard_ingest_events_total"]) / (t1w - t0w)
    processed = ((m1["trainguard_processed_events_total"] - m0["trainguard_processed_events_total"])
                 / (t1w - t0w))
    lag = m1.get("trainguard_processing_lag_seconds", 0.0)
    # the background run's own backlog when the probes ended: acknowledged, not yet processed (the probes'
    # records are processed within their latency), and how long its newest event waits at this rate
    backlog = m1["trainguard_ingest_events_total"] - m1["trainguard_processed_events_total"]
    backlog_s = backlog / processed if processed > 0 else float("inf")
    out_d: Dict[str, Any] = {"p50": _percentile(lat, 0.5), "p99": _percentile(lat, 0.99), "max": max(lat),
                             "ack_p50": _percentile(acks, 0.5), "ack_p99": _percentile(acks, 0.99),
                             "bg": ingested, "processed": processed, "cpu": 100.0 * (c1 - c0) / (t1w - t0w),
                             "kinds": dict(kinds), "n": len(lat), "lag": lag, "backlog": backlog,
                             "backlog_s": backlog_s,
                             "kept_up": lag < 1.0 and processed >= 0.9 * ingested}
    print(f"{label} background_events_per_s={ingested:.0f} (asked {bg_rate:.0f}) "
          f"processed_per_s={processed:.0f} processing_lag_s={out_d['lag']:.2f} "
          f"kept_up={'yes' if out_d['kept_up'] else 'no'} server_cpu_pct={out_d['cpu']:.0f} "
          f"backlog_events_end={backlog:.0f} backlog_s={backlog_s:.1f}", flush=True)
    print(f"{label} event_to_incident probes={len(lat)} p50_ms={out_d['p50'] * 1000:.0f} "
          f"p99_ms={out_d['p99'] * 1000:.0f} max_ms={out_d['max'] * 1000:.0f} "
          f"ack_p50_ms={out_d['ack_p50'] * 1000:.1f} ack_p99_ms={out_d['ack_p99'] * 1000:.1f} "
          f"poll_ms={args.poll_ms:g} incidents={','.join(f'{k}:{v}' for k, v in sorted(kinds.items()))}",
          flush=True)
    return out_d


SDK_PROBE = r"""
import json, math, sys, time
import trainguard
endpoint, token, project, tag, n = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])
for i in range(n):
    run_id = f"sdkprobe-{tag}-{i:03d}"
    trainguard.init(endpoint=endpoint, token=token, project=project, run_id=run_id, run_name="ingest-bench")
    for step in range(5):
        trainguard.log(step=step, loss=2.0 - 0.1 * step, lr=3e-4)
    time.sleep(0.3)
    t = time.time()
    trainguard.log(step=5, loss=math.nan, lr=3e-4)
    print(json.dumps({"run_id": run_id, "t": t}), flush=True)
    sys.stdin.readline()
    trainguard.shutdown()
"""


def sdk_latency_phase(server: Server, args: argparse.Namespace) -> Dict[str, Any]:
    """Real SDK probes in one subprocess (init → log finite → log NaN), see the module docstring (5)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "sdk" / "src"),
                                         env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    for key in [k for k in env if k.startswith("TRAINGUARD_")]:
        del env[key]
    tag = os.urandom(3).hex()
    proc = subprocess.Popen([sys.executable, "-c", SDK_PROBE, f"grpc://{server.grpc_target}",
                             server.ingest_token, server.project, tag, str(args.sdk_probes)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)
    assert proc.stdin is not None and proc.stdout is not None
    lat: List[float] = []
    conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=30)
    try:
        for _ in range(args.sdk_probes):
            line = proc.stdout.readline()
            if not line:
                err = proc.stderr.read()[-2000:] if proc.stderr else ""
                raise RuntimeError(f"SDK probe process ended: {err}")
            info = json.loads(line)
            path = f"/api/v1/runs/{info['run_id']}/incidents"
            while True:
                status, data = http_get(server.http_port, path, server.read_token, conn)
                if status == 200 and json.loads(data)["items"]:
                    lat.append(time.time() - info["t"])
                    break
                if time.time() - info["t"] > args.probe_timeout:
                    lat.append(float("inf"))
                    break
                time.sleep(args.poll_ms / 1000.0)
            proc.stdin.write("next\n")
            proc.stdin.flush()
        proc.stdin.close()
        proc.wait(60)
    finally:
        conn.close()
        if proc.poll() is None:
            proc.kill()
    out = {"p50": _percentile(lat, 0.5), "max": max(lat), "n": len(lat)}
    print(f"latency_sdk event_to_incident probes={len(lat)} p50_ms={out['p50'] * 1000:.0f} "
          f"max_ms={out['max'] * 1000:.0f} values_ms={','.join(f'{x * 1000:.0f}' for x in lat)}", flush=True)
    return out


# ------------------------------------------------------------------------------------------ profile

#: (component, fragment): the deepest frame of a sample that matches names its component. A fragment
#: ``path:function`` matches that function in a file whose path contains ``path``; a bare fragment matches a
#: path containing it or a function of that name.
COMPONENTS: Tuple[Tuple[str, str], ...] = (
    ("queue.publish (SQLite insert + COMMIT, fsync)", "queue/sqlite.py:publish"),
    ("queue.consume/commit", "queue/sqlite.py"),
    ("gateway.validate", "gateway/validate.py"),
    ("gateway.auth (token lookup)", "authenticate"),
    ("gateway.decode (IngestRequest.FromString)", "batch_from_protobuf"),
    ("gateway.decode json (json + wire.prepare_batch)", "batch_from_json"),
    ("gateway.other (ingest_batch: list(events), split, stats)", "gateway/"),
    ("processor.decode (wire.envelope_to_dict)", "envelope_to_dict"),
    ("processor.extract (metric points from dicts)", "trainguard_engine/extract.py"),
    ("processor.pipeline (trainguard_engine detectors, state)", "trainguard_engine/"),
    ("stores (SQLite writes: metrics, runs, incidents)", "storage/sqlite.py"),
    ("dataclass __init__ (MetricPoint rows, records)", "<string>"),
    ("processor.other (_store_raw loop, _process)", "processor/embedded.py"),
    ("grpc python server (_server.py)", "grpc/_server.py"),
    ("http/api (uvicorn, starlette, fastapi)", "uvicorn/"),
    ("http/api (uvicorn, starlette, fastapi)", "starlette/"),
    ("http/api (uvicorn, starlette, fastapi)", "fastapi/"),
    ("http/api (uvicorn, starlette, fastapi)", "anyio/"),
)


def summarise_profile(path: Path, top: int = 12) -> None:
    """Samples by component and by thread, and the hottest leaf frames, from py-spy's raw output."""
    by_component: collections.Counter[str] = collections.Counter()
    by_thread: collections.Counter[str] = collections.Counter()
    leaves: collections.Counter[str] = collections.Counter()
    total = 0
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count_s = line.rpartition(" ")
        if not stack or not count_s.isdigit():
            continue
        count = int(count_s)
        frames = stack.split(";")
        thread = re.sub(r"\(0x[0-9a-f]+\)|\d+", "", frames[0]).strip(' "') if frames else "?"
        frames = frames[1:]
        component = "other (threading, idle waits, interpreter)"
        for raw in reversed(frames):
            name = raw.split(" (", 1)[0]
            where = raw.split(" (", 1)[-1]
            hit = next((c for c, frag in COMPONENTS
                        if (":" in frag and frag.split(":")[0] in where
                            and name.rsplit(".", 1)[-1] == frag.split(":")[1])
                        or (":" not in frag and (frag in where or name.rsplit(".", 1)[-1] == frag))), None)
            if hit:
                component = hit
                break
        by_component[component] += count
        by_thread[thread] += count
        leaves[frames[-1] if frames else "?"] += count
        total += count
    if not total:
        print(f"profile {path}: no samples", flush=True)
        return
    print(f"profile samples={total} file={path}", flush=True)
    for name, n in sorted(by_component.items(), key=lambda kv: -kv[1]):
        print(f"profile component {100.0 * n / total:5.1f}% {name}", flush=True)
    for name, n in sorted(by_thread.items(), key=lambda kv: -kv[1])[:8]:
        print(f"profile thread    {100.0 * n / total:5.1f}% {name}", flush=True)
    for name, n in leaves.most_common(top):
        print(f"profile leaf      {100.0 * n / total:5.1f}% {name}", flush=True)


# --------------------------------------------------------------------------------------------- main

# ------------------------------------------------------------------------------ gateway alone, in process

GATEWAY_TARGET_RATIO = 1.3  # protobuf decode+ingest per envelope, over the pre-79a51a3 gateway's


def gateway_worker(kind: str, batch: int, points: int, requests: int, repeats: int, runs: int,
                   profile: Optional[str]) -> Dict[str, Any]:
    """(In a subprocess whose ``PYTHONPATH`` names one tree's sources.) The gateway's own cost per envelope:
    ``requests`` pre-built request bodies of ``batch`` metric envelopes (``points`` points, the SDK's names,
    the same every step; one run per request, ``runs`` runs in turn; unique event ids) decoded
    (``batch_from_protobuf`` / ``batch_from_json``) and ingested (``Gateway.ingest_batch``: validation,
    de-duplication, the per-project backlog, the per-run metric-name bound where the tree has them, the
    publish's grouping) into a queue that keeps nothing. ``serve``'s default settings. One untimed pass
    first (the steady state: every run's names known), then the best of ``repeats`` timed passes."""
    import inspect

    from trainguard.core import events as ev
    from trainguard_server.config import Settings
    from trainguard_server.gateway import ingest as gw
    from trainguard_server.gateway.backlog import ProjectBacklog
    from trainguard_server.queue.base import Queue
    from trainguard_server.storage.base import TokenInfo

    class NullQueue(Queue):
        """Takes every record, keeps none (the queue's cost is not the gateway's)."""

        def publish(self, key: str, values: Sequence[bytes]) -> List[int]:
            return [0] * len(values)

        def consume(self, max_records: int, timeout: float) -> List[Any]:
            return []

        def commit(self, records: Sequence[Any]) -> None:
            return None

        def depth(self) -> int:
            return 0  # what the backlog counted is released when it reaches its bound

    settings = Settings()
    queue = NullQueue()
    kwargs: Dict[str, Any] = {"backlog": ProjectBacklog(settings.project_max_backlog_events,
                                                        settings.retry_after_s, queue.depth)}
    if "metric_names" in inspect.signature(gw.Gateway).parameters:
        kwargs["metric_names"] = lambda project, run_id: ()
    gateway = gw.Gateway(queue, None, settings, **kwargs)  # type: ignore[arg-type]
    project = "bench"
    auth = TokenInfo("bench-token", project, "ingest", 0)
    now_ns = time.time_ns()
    bodies: List[bytes] = []
    factories = [BatchFactory(identity(project, f"gw-run-{r}", r, runs), points, f"{r:04x}gw", now_ns)
                 for r in range(runs)]
    for i in range(requests):
        r, step = i % runs, (i // runs) * batch
        if kind == "protobuf":
            bodies.append(factories[r].request(step, batch))
        else:
            ident = identity(project, f"gw-run-{r}", r, runs)
            bodies.append(ev.encode_batch(event_dicts(ident, step, batch, points, f"{r:04x}gw", now_ns)))
    max_events = settings.max_batch_events

    def one_pass() -> float:
        t0 = time.perf_counter()
        for body in bodies:
            b = gw.batch_from_protobuf(body) if kind == "protobuf" else \
                gw.batch_from_json(body, max_events=max_events)
            result = gateway.ingest_batch(auth, b)
            if result.accepted != batch:
                raise AssertionError(f"accepted {result.accepted} of {batch}: {result.rejected[:2]}")
        return time.perf_counter() - t0

    one_pass()
    profiler = None
    if profile:
        import cProfile
        profiler = cProfile.Profile()
        profiler.enable()
    best = min(one_pass() for _ in range(repeats))
    if profiler is not None and profile:
        profiler.disable()
        profiler.dump_stats(profile)
    return {"us_per_envelope": best / (requests * batch) * 1e6, "source": gw.__file__,
            "loadavg_1m": os.getloadavg()[0]}


def tree_of(ref: str, into: Path) -> Path:
    """``ref``'s sources (``git archive``) under ``into``; ``.`` is this checkout as it is."""
    if ref == ".":
        return REPO
    into.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "-C", str(REPO), "archive", "--format=tar", ref],
                             check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def gateway_alone(baseline: str, batch: int, points: int, rounds: int, profile: Optional[Path],
                  quick: bool = False) -> Dict[str, Dict[str, List[Dict[str, Any]]]]:
    """The gateway in process (:func:`gateway_worker`) for this checkout and ``baseline`` (git refs, comma
    separated; 'none': this checkout alone), alternating per round, one subprocess per figure;
    ``{tree: {kind: [figure per round]}}``. ``profile``: cProfile files of this checkout's protobuf runs.
    ``quick``: a few requests, one timed pass (seconds; the figures mean little)."""
    out: Dict[str, Dict[str, List[Dict[str, Any]]]] = {}
    with tempfile.TemporaryDirectory(prefix="trainguard-gateway-bench-") as tmp:
        trees = {"this": REPO}
        for i, ref in enumerate(r for r in baseline.split(",") if r and r != "none"):
            trees[ref] = tree_of(ref, Path(tmp) / f"baseline{i}")
        sizes = (("protobuf", 16), ("json", 4)) if quick else (("protobuf", 200), ("json", 40))
        for rnd in range(rounds):
            for kind, requests in sizes:
                for name, tree in trees.items():
                    prof = str(profile / f"gateway_{kind}_{rnd}.prof") \
                        if profile is not None and name == "this" and kind == "protobuf" else ""
                    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
                        str(tree / d / "src") for d in ("sdk", "engine", "services")),
                        TRAINGUARD_BENCH_TREE=str(tree))
                    cmd = [sys.executable, str(Path(__file__).resolve()), "--gateway-worker",
                           json.dumps({"kind": kind, "batch": batch, "points": points, "requests": requests,
                                       "repeats": 1 if quick else 5, "runs": 8, "profile": prof})]
                    done = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True)
                    fig = json.loads(done.stdout.strip().splitlines()[-1])
                    if not fig["source"].startswith(str(tree)):
                        raise AssertionError(f"{name}: imported {fig['source']}, not from {tree}")
                    out.setdefault(name, {}).setdefault(kind, []).append(fig)
                    print(f"gateway_alone round={rnd} tree={name} kind={kind} "
                          f"us_per_envelope={fig['us_per_envelope']:.3f} "
                          f"loadavg_1m={fig['loadavg_1m']:.2f}", flush=True)
    return out


def print_gateway(figures: Dict[str, Dict[str, List[Dict[str, Any]]]], baseline: str, label: str) -> None:
    """Best per tree and kind, and this checkout over the baseline (protobuf's target ratio beside it)."""
    for kind in ("protobuf", "json"):
        best = {name: min(f["us_per_envelope"] for f in kinds[kind]) for name, kinds in figures.items()}
        loads = [f["loadavg_1m"] for kinds in figures.values() for f in kinds[kind]]
        line = f"{label} kind={kind} this_us_per_envelope={best['this']:.3f}"
        for ref in (r for r in baseline.split(",") if r in best):
            ratio = best["this"] / best[ref]
            line += f" | {ref}={best[ref]:.3f} this/{ref}={ratio:.2f}"
            if kind == "protobuf" and ref == baseline.split(",")[-1]:
                line += f" target<={GATEWAY_TARGET_RATIO} {'OK' if ratio <= GATEWAY_TARGET_RATIO else 'OVER'}"
        print(f"{line} loadavg_1m={min(loads):.2f}-{max(loads):.2f} (best of {len(loads) // len(best)})",
              flush=True)


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=None, help="seconds per throughput window (10)")
    p.add_argument("--clients", type=int, default=2, help="client processes per throughput phase")
    p.add_argument("--runs-per-client", type=int, default=1,
                   help="runs each gRPC client's prebuilt batches go to in turn (1: one run per client)")
    p.add_argument("--batch", type=int, default=500, help="envelopes per request")
    p.add_argument("--points", type=int, default=5, help="metric points per envelope (3-8)")
    p.add_argument("--inflight", type=int, default=2, help="requests outstanding per client")
    p.add_argument("--max-rate", type=float, default=250_000,
                   help="events/s the pre-built batches can sustain (memory: ~270 B/event)")
    p.add_argument("--probes", type=int, default=None,
                   help="event → incident probes (120: a p99 that is not the max)")
    p.add_argument("--probe-interval", type=float, default=0.1, help="seconds between probes")
    p.add_argument("--poll-ms", type=float, default=10.0, help="query API poll interval of a probe")
    p.add_argument("--probe-timeout", type=float, default=None,
                   help="seconds a probe waits for its incident before it counts as lost (60; --quick 15)")
    p.add_argument("--bg-fraction", type=float, default=0.2,
                   help="background load during the probes, as a fraction of the gRPC rate measured")
    p.add_argument("--bg-rate", type=float, default=None,
                   help="background load during the probes in events/s (overrides --bg-fraction)")
    p.add_argument("--sdk-probes", type=int, default=None, help="probes through the real SDK (5)")
    p.add_argument("--skip", default="",
                   help="comma list of: grpc,sdk,http,latency,latency_sdk,processor,gateway")
    p.add_argument("--processor-shapes", default=None,
                   help="bench/processor.py's streams for processor_alone (sdk16,sdk4096,env500; "
                        "--quick: sdk16,env500)")
    p.add_argument("--processor-baseline", default="HEAD",
                   help="git ref whose processor is measured beside this checkout's ('none': skip)")
    p.add_argument("--profile", type=Path, default=None,
                   help="directory: py-spy the server during the gRPC window and print a breakdown")
    p.add_argument("--data-dir", type=Path, default=None, help="parent of the servers' data dirs")
    p.add_argument("--serve-cmd", default=None,
                   help="command that runs the server, split on spaces (default: <python> -m "
                        "trainguard_server serve); --data-dir/--http-port/--grpc-port are appended")
    p.add_argument("--server-env", action="append", default=[], metavar="KEY=VALUE",
                   help="environment for the server, e.g. TRAINGUARD_PROCESSOR_BATCH=512 (repeatable)")
    p.add_argument("--gil", action="store_true", help="with --profile: sample only the GIL holder")
    p.add_argument("--summarise-profile", type=Path, default=None, metavar="RAW",
                   help="print the breakdown of an earlier --profile file (py-spy raw format) and exit")
    p.add_argument("--keep-data", action="store_true", help="keep the servers' data directories")
    p.add_argument("--quick", action="store_true", help="a few seconds per phase (smoke test)")
    p.add_argument("--gateway-baseline", default="none",
                   help="git refs, comma separated, whose gateways are measured in process beside this "
                        "checkout's (gateway_alone; the last one is the target's baseline; 'none': this "
                        "checkout alone)")
    p.add_argument("--gateway-rounds", type=int, default=3, help="alternating rounds of gateway_alone")
    p.add_argument("--gateway-worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.gateway_worker is not None:  # one figure of gateway_alone, as a JSON line
        print(json.dumps(gateway_worker(**json.loads(args.gateway_worker))), flush=True)
        return 0
    if args.summarise_profile is not None:
        summarise_profile(args.summarise_profile)
        return 0
    if not 3 <= args.points <= len(METRIC_NAMES):
        p.error(f"--points must be 3..{len(METRIC_NAMES)}")
    if args.duration is None:
        args.duration = 1.0 if args.quick else 10.0
    if args.probes is None:
        args.probes = 8 if args.quick else 120
    if args.sdk_probes is None:
        args.sdk_probes = 1 if args.quick else 5
    if args.probe_timeout is None:
        args.probe_timeout = 15.0 if args.quick else 60.0
    if args.quick:
        args.max_rate = min(args.max_rate, 150_000)
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    alone_s = 0.0 if args.quick else 8.0

    import google.protobuf
    import grpc

    print(f"env python={platform.python_version()} grpcio={grpc.__version__} "
          f"protobuf={google.protobuf.__version__} cpus={os.cpu_count()} duration_s={args.duration:g} "
          f"clients={args.clients} runs_per_client={args.runs_per_client} batch={args.batch} "
          f"points={args.points} inflight={args.inflight} "
          f"loadavg_1m={os.getloadavg()[0]:.2f}", flush=True)
    root = args.data_dir or Path(tempfile.mkdtemp(prefix="trainguard-ingest-bench-"))
    root.mkdir(parents=True, exist_ok=True)
    n_grpc = max(2, math.ceil(args.duration * args.max_rate / args.clients / args.batch))
    n_http = max(2, math.ceil(args.duration * min(args.max_rate, 80_000) / args.clients / args.batch))
    summary: Dict[str, Any] = {}
    profiler = Profiler(args.profile, gil=args.gil)
    serve_cmd = args.serve_cmd.split() if args.serve_cmd else None

    shared: List[Server] = []

    def serve(name: str) -> Server:
        """A fresh server per phase, so a phase never inherits the previous one's backlog; --quick: one
        server for the throughput phases (seconds matter there, the figures do not) and a fresh one for the
        latency probes (a backlog would only make them wait for the processor)."""
        if args.quick and shared and not name.startswith("latency"):
            return shared[0]
        server = start_server(root / name, serve_cmd, args.server_env)
        if args.quick and not name.startswith("latency"):
            shared.append(server)
        return server

    def release(server: Server) -> None:
        if server not in shared:
            server.stop()

    try:
        if "grpc" not in skip:
            server = serve("grpc")
            profiles: List[Path] = []
            try:
                r = run_load("grpc_prebuilt", grpc_client, server, args, "prebuilt", args.clients,
                             args.duration, n_grpc, profiler)
                print_load(r, args.batch)
                summary["grpc"] = r.events_per_s
                prof = profiler.finish()
                profiles += [prof] if prof is not None else []
                summary["grpc_proc"] = processor_report("grpc_prebuilt", server, r, alone_s, profiler)
                prof = profiler.finish()
                profiles += [prof] if prof is not None else []
            finally:
                release(server)
            for prof in profiles:
                summarise_profile(prof)
        if "sdk" not in skip:
            server = serve("grpc-sdk")
            try:
                r = run_load("grpc_sdk", grpc_client, server, args, "sdk", args.clients, args.duration, 0)
                print_load(r, args.batch)
                summary["grpc_sdk"] = r.events_per_s
            finally:
                release(server)
        if "http" not in skip:
            for kind in ("json", "protobuf"):
                server = serve(f"http-{kind}")
                try:
                    r = run_load(f"http_{kind}", http_client, server, args, kind, args.clients,
                                 args.duration, n_http)
                    print_load(r, args.batch)
                    summary[f"http_{kind}"] = r.events_per_s
                finally:
                    release(server)
        if "latency" not in skip or "latency_sdk" not in skip:
            server = serve("latency")
            try:
                if "latency" not in skip:
                    bg = args.bg_rate if args.bg_rate is not None else \
                        args.bg_fraction * summary.get("grpc", GRPC_TARGET)
                    if args.quick and args.bg_rate is None:
                        bg = min(bg, 1000.0)
                    summary["latency"] = latency_phase(server, args, bg)
                if "latency_sdk" not in skip:
                    summary["latency_sdk"] = sdk_latency_phase(server, args)
            finally:
                release(server)
            # Past the processor's capacity the backlog, not the path, sets the latency: measure again
            # at half of what the processor did alone, so both regimes are on record.
            capacity = summary.get("grpc_proc", {}).get("alone", float("nan"))
            if not capacity > 0 and "latency" in summary:  # no solo figure: what it managed under the probes
                capacity = summary["latency"]["processed"]
            if "latency" in summary and not summary["latency"]["kept_up"] and capacity > 0 and not args.quick:
                server = serve("latency-within-capacity")
                try:
                    summary["latency_within"] = latency_phase(server, args, 0.5 * capacity,
                                                              "latency_within_capacity")
                finally:
                    release(server)
        if "gateway" not in skip:
            summary["gateway"] = gateway_alone(args.gateway_baseline, args.batch, args.points,
                                               1 if args.quick else args.gateway_rounds, args.profile,
                                               args.quick)
        if "processor" not in skip:
            shapes = (args.processor_shapes or ("sdk16,env500" if args.quick else
                                                ",".join(processor_bench.SHAPES))).split(",")
            summary["processor"] = processor_bench.compare(shapes, args.processor_baseline, args.quick)
            summary["processor_shapes"] = shapes
            processor_bench.print_table(summary["processor"], shapes, args.processor_baseline)
    finally:
        for server in shared:
            server.stop()
        if args.keep_data:
            print(f"data kept in {root}", flush=True)
        elif args.data_dir is None:
            shutil.rmtree(root, ignore_errors=True)

    print("summary", flush=True)
    if "grpc" in summary:
        g = summary["grpc"]
        print(f"summary grpc_events_per_s={g:.0f} target={GRPC_TARGET} ratio={g / GRPC_TARGET:.2f} "
              f"{'OK' if g >= GRPC_TARGET else 'BELOW'}", flush=True)
        pr = summary["grpc_proc"]
        print(f"summary processor_events_per_s={pr['processed_per_s']:.0f} (during ingest) "
              f"alone={pr['alone']:.0f} queue_depth_end={pr['depth']:.0f} lag_s={pr['lag']:.2f}",
              flush=True)
    if "grpc_sdk" in summary:
        print(f"summary grpc_sdk_events_per_s={summary['grpc_sdk']:.0f} "
              f"(SDK converter + gzip in the clients)", flush=True)
    for kind in ("json", "protobuf"):
        if f"http_{kind}" in summary:
            print(f"summary http_{kind}_events_per_s={summary[f'http_{kind}']:.0f}", flush=True)
    first = ("background = --bg-rate" if args.bg_rate is not None else
             "--quick: background capped at 1000 events/s" if args.quick else
             "background = --bg-fraction of the gRPC rate")
    for key, what in (("latency", first), ("latency_within", "background = half the processor's solo rate")):
        if key in summary:
            lat = summary[key]
            ok = lat["p99"] < P99_TARGET_S
            print(f"summary event_to_incident_p50_ms={lat['p50'] * 1000:.0f} p99_ms={lat['p99'] * 1000:.0f} "
                  f"target_p99_ms={P99_TARGET_S * 1000:.0f} {'OK' if ok else 'OVER'} "
                  f"background_events_per_s={lat['bg']:.0f} processor_kept_up="
                  f"{'yes' if lat['kept_up'] else 'no'} ({what})", flush=True)
    if "processor" in summary:
        processor_bench.print_table(summary["processor"], summary["processor_shapes"],
                                    args.processor_baseline, label="summary processor_alone")
        alone = summary["processor"]["this"].get("env500", {}).get("events_per_s", float("nan"))
        if "grpc" in summary and alone > 0:  # the same stream shape: 500 envelopes of 5 points a request
            ratio = alone / summary["grpc"]
            print(f"summary processor_alone_env500_over_grpc_ingest={ratio:.3f} target=0.5 "
                  f"{'OK' if ratio >= 0.5 else 'BELOW'}", flush=True)
    if "gateway" in summary:
        print_gateway(summary["gateway"], args.gateway_baseline, "summary gateway_alone")
    if "latency_sdk" in summary:
        s = summary["latency_sdk"]
        print(f"summary sdk_event_to_incident_p50_ms={s['p50'] * 1000:.0f} max_ms={s['max'] * 1000:.0f}",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
