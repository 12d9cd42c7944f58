"""kill -9 mid-ingest, again and again: how many acknowledged events are lost or duplicated (issue 18).

Prints numbers, asserts nothing. For each backend (``--backends``):

* ``sqlite`` -- one ``trainguard serve`` subprocess (``bench/ingest.py``'s :func:`ingest.start_server`) on a
  data directory that survives it: the SQLite queue and stores. It is SIGKILLed ``--kills`` times mid-ingest
  and started again on the same data directory (new ports; the senders follow).
* ``kafka`` -- a Tansu broker as the test suite starts it (``tests/support/kafka.py``, memory storage; never
  killed), ``trainguard gateway`` and ``trainguard processor`` processes with ``TRAINGUARD_QUEUE=kafka``
  sharing one data directory for the SQLite stores. Each kill SIGKILLs the role(s) ``--kafka-targets`` names
  in turn (``processor``, ``gateway`` or ``both``), which are started again (the gateway on the same ports).

Meanwhile ``--senders`` threads send batches of ``--batch`` events (gRPC ``Send`` and HTTP protobuf ``POST
/v1/ingest`` in turn, ``--rate`` events/s in all): 1 in 10 an exception (all of one stack fingerprint), 5 a
log line, 4 a metric (``loss`` at the event's own step); a new run every ``--events-per-run`` events. An
event is *acknowledged* when the answer to its batch accepted the whole batch; a batch whose send failed
(the server died under it) is sent again, the same events with the same ids, until it is acknowledged, as
the SDK does. Each kill comes ``--min-up``..``--max-up`` s (uniform, ``--seed``) after the previous (re)start
was ready.

After the last kill the senders stop, the backlog is processed (until every acknowledged event is stored, or
nothing moved for ``--settle`` s) and the processes are stopped with SIGTERM; then the SQLite stores are read
directly:

* ``lost`` -- acknowledged log and exception events whose id is not in the event store, plus acknowledged
  metric events whose (run, step) point is not in the metric store;
* ``duplicated_rows`` -- event ids stored more than once, (series, step) points stored more than once;
* ``double_counted`` -- the exception cluster's count minus the exception events stored: the pipeline counting
  a redelivered exception twice (its state is checkpointed; records after the checkpoint are redelivered);
* ``resent_after_failure`` -- events sent again because a send failed around a kill (at-least-once delivery
  is what makes ``duplicated`` meaningful).

    python bench/kill9.py                                # both backends, 10 kills each, ~4 minutes
    python bench/kill9.py --backends kafka --kills 20    # 10 processor + 10 gateway kills
    python bench/kill9.py --quick                        # seconds; what tests/bench/test_kill9_smoke.py runs
"""

from __future__ import annotations

import argparse
import collections
import http.client
import json
import os
import platform
import random
import signal
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Set, Tuple

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO))

import ingest  # noqa: E402  (bench/ingest.py: trainguard serve on free ports, gRPC channel options)

for _src in (REPO / "sdk" / "src", REPO / "engine" / "src", REPO / "services" / "src"):
    if _src.is_dir() and str(_src) not in sys.path:
        sys.path.insert(0, str(_src))

BACKENDS = ("sqlite", "kafka")
KAFKA_TARGETS = ("processor", "gateway", "both")
EXC_TYPE = "ValueError"
"""Every exception the senders send has this type and the same frames: one cluster per project."""


# ------------------------------------------------------------------------------------------ events

def make_event(project: str, run_id: str, n: int) -> Dict[str, Any]:
    """Event number ``n`` of a sender (step ``n``): an exception, a log line or a metric, by ``n % 10``."""
    from trainguard.core import events as ev

    ident = ingest.identity(project, run_id, 0, 1)
    now = time.time_ns()
    kind = n % 10
    if kind == 0:
        payload: Dict[str, Any] = {"type": EXC_TYPE, "message": "bad batch", "frames": [
            {"filename": "/w/train.py", "module": "train", "function": "step", "lineno": 10, "in_app": True}]}
        return ev.envelope(ident, "exception", payload, step=n, time_unix_nano=now, severity="ERROR")
    if kind <= 5:
        return ev.envelope(ident, "log", {"logger": "train", "level": "WARNING", "message": f"line {n}"},
                           step=n, time_unix_nano=now, severity="WARNING")
    return ev.envelope(ident, "metrics", ev.metrics_payload({"loss": 2.0 + 0.001 * (n % 97)}), step=n,
                       time_unix_nano=now)


@dataclass
class Acked:
    """What the senders got acknowledged, thread-safe."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    raw_ids: Set[str] = field(default_factory=set)            # logs and exceptions: in the event store
    exception_ids: Set[str] = field(default_factory=set)
    metric_steps: Set[Tuple[str, int]] = field(default_factory=set)  # (run_id, step): in the metric store
    events: int = 0
    resent: int = 0          # events of batches acknowledged only after a failed send
    failures: collections.Counter[str] = field(default_factory=collections.Counter)  # failed sends

    def add(self, batch: List[Dict[str, Any]], resent: bool) -> None:
        with self.lock:
            self.events += len(batch)
            self.resent += len(batch) if resent else 0
            for e in batch:
                if "metrics" in e:
                    self.metric_steps.add((e["run_id"], int(e["step"])))
                else:
                    self.raw_ids.add(e["event_id"])
                    if "exception" in e:
                        self.exception_ids.add(e["event_id"])

    def failed(self, why: str) -> None:
        with self.lock:
            self.failures[why] += 1

    def failed_sends(self) -> int:
        with self.lock:
            return sum(self.failures.values())


class Endpoint:
    """Where the server is now (changed on every restart) and its ingest token; None while it is down."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.where: Optional[Tuple[str, int]] = None  # (grpc target, http port)
        self.token = ""
        self.project = ""

    def set(self, where: Optional[Tuple[str, int]]) -> None:
        with self.lock:
            self.where = where

    def get(self) -> Optional[Tuple[str, int]]:
        with self.lock:
            return self.where


def sender(i: int, endpoint: Endpoint, acked: Acked, args: argparse.Namespace, tag: str,
           stop: threading.Event) -> None:
    """Send batches until ``stop``; a batch is sent again (same events) until it is acknowledged."""
    import grpc

    from trainguard import wire
    from trainguard.v1 import ingest_pb2

    use_grpc = i % 2 == 0
    interval = args.batch / (args.rate / args.senders) if args.rate > 0 else 0.0
    n = 0
    batch: List[Dict[str, Any]] = []
    body = b""
    failed_once = False
    channel: Any = None
    channel_for: Optional[Tuple[str, int]] = None
    conn: Optional[http.client.HTTPConnection] = None
    next_at = time.monotonic()
    while not stop.is_set():
        if not batch:
            run_id = f"kill9-{tag}-s{i}-r{n // args.events_per_run}"
            batch = [make_event(endpoint.project, run_id, n + k) for k in range(args.batch)]
            n += args.batch
            body = wire.prepare_batch(batch).request.SerializeToString()
            failed_once = False
            if interval:
                next_at += interval
                time.sleep(max(0.0, next_at - time.monotonic()))
        where = endpoint.get()
        if where is None:
            time.sleep(0.02)
            continue
        try:
            if use_grpc:
                if channel_for != where:
                    if channel is not None:
                        channel.close()
                    channel, channel_for = ingest._grpc_channel(where[0]), where
                send = channel.unary_unary(ingest.SEND_METHOD, request_serializer=None,
                                           response_deserializer=ingest_pb2.IngestResponse.FromString)
                ack = send(body, metadata=(("authorization", f"Bearer {endpoint.token}"),), timeout=10)
                ok, why = ack.accepted + ack.duplicates == len(batch) and not ack.rejected, "grpc:partial"
            else:
                if conn is None or channel_for != where:
                    if conn is not None:
                        conn.close()
                    conn, channel_for = http.client.HTTPConnection("127.0.0.1", where[1], timeout=10), where
                conn.request("POST", "/v1/ingest", body=body, headers={
                    "Authorization": f"Bearer {endpoint.token}", "Content-Type": "application/x-protobuf"})
                resp = conn.getresponse()
                data = resp.read()
                ok, why = False, f"http:{resp.status}"
                if resp.status == 200:
                    ack = ingest_pb2.IngestResponse.FromString(data)
                    ok = ack.accepted + ack.duplicates == len(batch) and not ack.rejected
                    why = "http:partial"
        except grpc.RpcError as err:
            ok, why = False, f"grpc:{err.code().name}"
        except (OSError, http.client.HTTPException) as exc:
            ok, why = False, f"http:{type(exc).__name__}"
            if conn is not None:
                conn.close()
            conn = None
        if ok:
            acked.add(batch, failed_once)
            batch = []
        else:
            acked.failed(why)
            failed_once = True
            time.sleep(0.05)
    if channel is not None:
        channel.close()
    if conn is not None:
        conn.close()


# --------------------------------------------------------------------------------------- backends

class Backend:
    """The processes of one backend: start them, kill one kind, tell the senders where to send."""

    label = ""

    def start(self) -> None:
        raise NotImplementedError

    def kill(self, k: int) -> str:
        """SIGKILL the processes of kill number ``k``, start them again; what was killed."""
        raise NotImplementedError

    def depth(self) -> Optional[float]:
        return None

    def stop(self) -> int:
        """SIGTERM everything; the worst exit code."""
        raise NotImplementedError


def _env_for_roles() -> Dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / d / "src") for d in ("sdk", "engine", "services")]
                                        + [env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    for key in [k for k in env if k.startswith("TRAINGUARD_")]:
        del env[key]
    return env


def _terminate(proc: subprocess.Popen, wait_s: float = 60.0) -> int:  # type: ignore[type-arg]
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(wait_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    return int(proc.returncode)


class SqliteBackend(Backend):
    """``trainguard serve``: SQLite queue and stores in one data directory."""

    label = "sqlite"

    def __init__(self, data_dir: Path, endpoint: Endpoint) -> None:
        self.data_dir, self.endpoint = data_dir, endpoint
        self.server: Optional[ingest.Server] = None

    def start(self) -> None:
        self.server = ingest.start_server(self.data_dir)
        self.endpoint.token, self.endpoint.project = self.server.ingest_token, self.server.project
        self.endpoint.set((self.server.grpc_target, self.server.http_port))

    def kill(self, k: int) -> str:
        assert self.server is not None
        os.killpg(self.server.pid, signal.SIGKILL)  # the whole serve process, sends in flight or not
        self.server.proc.wait(30)
        self.start()
        return "serve"

    def depth(self) -> Optional[float]:
        assert self.server is not None
        try:
            return self.server.metrics().get("trainguard_queue_depth")
        except (OSError, RuntimeError):
            return None

    def stop(self) -> int:
        self.endpoint.set(None)
        return _terminate(self.server.proc) if self.server is not None else 0


class KafkaBackend(Backend):
    """Tansu + ``trainguard gateway`` + ``trainguard processor`` (TRAINGUARD_QUEUE=kafka)."""

    label = "kafka"

    def __init__(self, data_dir: Path, endpoint: Endpoint, targets: List[str]) -> None:
        from tests.support.kafka import Tansu

        self.data_dir, self.endpoint, self.targets = data_dir, endpoint, targets
        data_dir.mkdir(parents=True, exist_ok=True)
        self.broker = Tansu(data_dir / "tansu.log")
        self.http_port, self.grpc_port = ingest.free_port(), ingest.free_port()
        self.env = _env_for_roles()
        self.procs: Dict[str, subprocess.Popen] = {}  # type: ignore[type-arg]

    def _start_role(self, role: str) -> None:
        extra = ["--http-port", str(self.http_port), "--grpc-port", str(self.grpc_port)] \
            if role == "gateway" else []
        log = open(self.data_dir / f"{role}.log", "ab")
        try:
            self.procs[role] = subprocess.Popen(
                [sys.executable, "-m", "trainguard_server", role, "--data-dir", str(self.data_dir), *extra],
                env=self.env, stdout=log, stderr=subprocess.STDOUT)
        finally:
            log.close()
        if role == "gateway":
            deadline = time.monotonic() + 60
            while True:
                if self.procs[role].poll() is not None:
                    raise RuntimeError(f"gateway exited with {self.procs[role].returncode}: "
                                       f"{(self.data_dir / 'gateway.log').read_text()[-3000:]}")
                if time.monotonic() > deadline:
                    raise RuntimeError("gateway not healthy in 60 s")
                tokens = self.data_dir / "bootstrap-tokens.json"
                try:
                    if tokens.exists() and ingest.http_get(self.http_port, "/healthz")[0] == 200:
                        break
                except OSError:
                    pass
                time.sleep(0.05)
            doc = json.loads(tokens.read_text())
            self.endpoint.token, self.endpoint.project = doc["ingest"], doc["project"]
            self.endpoint.set((f"127.0.0.1:{self.grpc_port}", self.http_port))

    def start(self) -> None:
        self.broker.start()
        self.env.update(TRAINGUARD_QUEUE="kafka", TRAINGUARD_KAFKA_BOOTSTRAP_SERVERS=self.broker.bootstrap,
                        TRAINGUARD_KAFKA_TOPIC=f"kill9-{uuid.uuid4().hex[:8]}",
                        TRAINGUARD_KAFKA_PARTITIONS="2", TRAINGUARD_KAFKA_SESSION_TIMEOUT_MS="6000",
                        TRAINGUARD_HOST="127.0.0.1")
        self._start_role("gateway")
        self._start_role("processor")

    def kill(self, k: int) -> str:
        target = self.targets[k % len(self.targets)]
        roles = ["gateway", "processor"] if target == "both" else [target]
        for role in roles:
            self.procs[role].kill()
        for role in roles:
            self.procs[role].wait(30)
            self._start_role(role)
        if "processor" in roles:  # up again = processing again (it joins its consumer group first)
            seen = stored_seq(self.data_dir)
            deadline = time.monotonic() + 60
            while stored_seq(self.data_dir) == seen and time.monotonic() < deadline:
                time.sleep(0.05)
        return target

    def stop(self) -> int:
        self.endpoint.set(None)
        codes = [_terminate(p) for p in self.procs.values()]
        self.broker.stop(kill=True)
        return max(codes, key=abs) if codes else 0


# ---------------------------------------------------------------------------------------- counting

def stored_seq(data_dir: Path) -> int:
    """The event store's highest insertion number (grows while a processor stores events)."""
    try:
        with sqlite3.connect(f"file:{data_dir / 'events.db'}?mode=ro", uri=True, timeout=30) as db:
            return int(db.execute("SELECT COALESCE(MAX(seq), 0) FROM events").fetchone()[0])
    except sqlite3.Error:
        return -1


@dataclass
class Stored:
    raw_ids: Set[str]
    raw_rows: int
    exceptions: int
    metric_steps: Set[Tuple[str, int]]
    point_rows: int
    cluster_count: int


def read_stores(data_dir: Path, project: str, tag: str) -> Stored:
    """What the SQLite stores hold for this bench's runs (read-only connections; the processes may run)."""
    def connect(name: str) -> sqlite3.Connection:
        return sqlite3.connect(f"file:{data_dir / name}?mode=ro", uri=True, timeout=30)

    like = f"kill9-{tag}-%"
    with connect("events.db") as db:
        rows = db.execute("SELECT event_id, kind FROM events WHERE project = ? AND run_id LIKE ?",
                          (project, like)).fetchall()
    with connect("metrics.db") as db:
        points = db.execute("SELECT s.run_id, p.step FROM points p JOIN series s ON s.sid = p.sid "
                            "WHERE s.project = ? AND s.run_id LIKE ? AND s.name = 'loss'",
                            (project, like)).fetchall()
    with connect("incidents.db") as db:
        docs = db.execute("SELECT doc FROM clusters WHERE project = ?", (project,)).fetchall()
    clusters = [json.loads(r[0]) for r in docs]
    count = sum(int(d.get("count", 0)) for d in clusters if d.get("exc_type") == EXC_TYPE)
    return Stored({r[0] for r in rows}, len(rows), sum(1 for r in rows if r[1] == "exception"),
                  {(r[0], int(r[1])) for r in points}, len(points), count)


def settle(data_dir: Path, endpoint: Endpoint, acked: Acked, tag: str,
           quiet_s: float) -> Tuple[Stored, float]:
    """Wait until every acknowledged event is stored and the cluster has counted every stored exception,
    or nothing moved for ``quiet_s``; the last reading and how long it took."""
    t0 = time.monotonic()
    last_change, last_key = time.monotonic(), None
    while True:
        try:
            st = read_stores(data_dir, endpoint.project, tag)
        except sqlite3.Error:
            time.sleep(0.5)
            continue
        done = (acked.raw_ids <= st.raw_ids and acked.metric_steps <= st.metric_steps
                and st.cluster_count >= st.exceptions)
        key = (len(st.raw_ids), len(st.metric_steps), st.cluster_count)
        if key != last_key:
            last_key, last_change = key, time.monotonic()
        if done or time.monotonic() - last_change > quiet_s:
            return st, time.monotonic() - t0
        time.sleep(0.5)


# -------------------------------------------------------------------------------------------- main

def run_backend(name: str, root: Path, args: argparse.Namespace, rng: random.Random) -> Dict[str, Any]:
    data_dir = root / name
    endpoint = Endpoint()
    backend: Backend = SqliteBackend(data_dir, endpoint) if name == "sqlite" else \
        KafkaBackend(data_dir, endpoint, args.kafka_targets.split(","))
    acked = Acked()
    stop = threading.Event()
    tag = f"{name}{uuid.uuid4().hex[:4]}"
    threads: List[threading.Thread] = []
    exit_code = 0
    try:
        backend.start()
        threads = [threading.Thread(target=sender, args=(i, endpoint, acked, args, tag, stop), daemon=True,
                                    name=f"kill9-sender-{i}") for i in range(args.senders)]
        for t in threads:
            t.start()
        for k in range(args.kills):
            up = rng.uniform(args.min_up, args.max_up)
            time.sleep(up)
            before, depth, fails = acked.events, backend.depth(), acked.failed_sends()
            t0 = time.monotonic()
            what = backend.kill(k)
            print(f"kill backend={name} n={k + 1} target={what} up_s={up:.2f} acked_before={before} "
                  f"queue_depth_before={'-' if depth is None else f'{depth:.0f}'} "
                  f"back_after_s={time.monotonic() - t0:.2f} "
                  f"failed_sends_meanwhile={acked.failed_sends() - fails}", flush=True)
        time.sleep(args.tail)
        stop.set()
        for t in threads:
            t.join(30)
        stored, settle_s = settle(data_dir, endpoint, acked, tag, args.settle)
        exit_code = backend.stop()
        stored = read_stores(data_dir, endpoint.project, tag)  # after the stop: final
    finally:
        stop.set()
        try:
            backend.stop()
        except Exception:  # already stopped
            pass
    lost_raw = len(acked.raw_ids - stored.raw_ids)
    lost_metrics = len(acked.metric_steps - stored.metric_steps)
    dup_rows = (stored.raw_rows - len(stored.raw_ids)) + (stored.point_rows - len(stored.metric_steps))
    unacked = len(stored.raw_ids - acked.raw_ids) + len(stored.metric_steps - acked.metric_steps)
    out: Dict[str, Any] = {"backend": name, "kills": args.kills, "acked": acked.events,
                           "lost": lost_raw + lost_metrics,
                           "lost_raw": lost_raw, "lost_metrics": lost_metrics, "dup_rows": dup_rows,
                           "double_counted": stored.cluster_count - stored.exceptions,
                           "exceptions": stored.exceptions, "cluster_count": stored.cluster_count,
                           "resent": acked.resent, "failures": dict(acked.failures), "settle_s": settle_s,
                           "exit_code": exit_code, "stored_unacked": unacked}
    failed = ",".join(f"{why}:{n}" for why, n in sorted(acked.failures.items())) or "0"
    print(f"result backend={name} kills={args.kills} acked_events={acked.events} lost={out['lost']} "
          f"(raw {lost_raw}, metric {lost_metrics}) duplicated_rows={out['dup_rows']} "
          f"double_counted={out['double_counted']} (cluster count {stored.cluster_count}, exceptions stored "
          f"{stored.exceptions}) resent_after_failure={acked.resent} stored_unacked={out['stored_unacked']} "
          f"settle_s={settle_s:.1f} stop_exit_code={exit_code} failed_sends={failed}", flush=True)
    return out


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backends", default=",".join(BACKENDS), help="comma list of: sqlite,kafka")
    p.add_argument("--kills", type=int, default=None, help="SIGKILLs per backend (10)")
    p.add_argument("--kafka-targets", default="processor,gateway",
                   help="what each Kafka kill takes down, in turn: processor, gateway, both")
    p.add_argument("--senders", type=int, default=2, help="sender threads (gRPC and HTTP in turn)")
    p.add_argument("--batch", type=int, default=None, help="events per request (200)")
    p.add_argument("--rate", type=float, default=None, help="events/s of all senders together (0: unpaced)")
    p.add_argument("--events-per-run", type=int, default=5000, help="a sender starts a new run after these")
    p.add_argument("--min-up", type=float, default=None, help="least seconds between a start and a kill (1)")
    p.add_argument("--max-up", type=float, default=None, help="most seconds between a start and a kill (4)")
    p.add_argument("--tail", type=float, default=1.0, help="seconds of ingest after the last restart")
    p.add_argument("--settle", type=float, default=60.0,
                   help="give up waiting for the backlog after this long without progress")
    p.add_argument("--seed", type=int, default=0, help="seed of the kill times")
    p.add_argument("--data-dir", type=Path, default=None, help="parent of the backends' data dirs")
    p.add_argument("--keep-data", action="store_true", help="keep the data directories")
    p.add_argument("--quick", action="store_true", help="2 kills, small batches (smoke test)")
    args = p.parse_args(argv)
    args.kills = args.kills if args.kills is not None else (2 if args.quick else 10)
    args.batch = args.batch if args.batch is not None else (50 if args.quick else 200)
    args.rate = args.rate if args.rate is not None else (1000.0 if args.quick else 6000.0)
    args.min_up = args.min_up if args.min_up is not None else (0.5 if args.quick else 1.0)
    args.max_up = args.max_up if args.max_up is not None else (1.0 if args.quick else 4.0)
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    if set(backends) - set(BACKENDS):
        p.error(f"unknown backend(s): {', '.join(sorted(set(backends) - set(BACKENDS)))}")
    if set(args.kafka_targets.split(",")) - set(KAFKA_TARGETS):
        p.error(f"--kafka-targets: each of {', '.join(KAFKA_TARGETS)}")
    print(f"env python={platform.python_version()} cpus={os.cpu_count()} loadavg_1m={os.getloadavg()[0]:.2f}",
          flush=True)
    print(f"config backends={','.join(backends)} kills={args.kills} kafka_targets={args.kafka_targets} "
          f"senders={args.senders} batch={args.batch} rate={args.rate:g} "
          f"events_per_run={args.events_per_run} "
          f"up_s={args.min_up:g}..{args.max_up:g} tail_s={args.tail:g} seed={args.seed} "
          f"server=defaults", flush=True)
    root = args.data_dir or Path(tempfile.mkdtemp(prefix="trainguard-kill9-"))
    root.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    results = []
    try:
        for name in backends:
            results.append(run_backend(name, root, args, rng))
    finally:
        if args.keep_data:
            print(f"data kept in {root}", flush=True)
        elif args.data_dir is None:
            import shutil

            shutil.rmtree(root, ignore_errors=True)
    for r in results:
        print(f"summary backend={r['backend']} kills={r['kills']} acknowledged={r['acked']} lost={r['lost']} "
              f"duplicated={r['dup_rows']} double_counted={r['double_counted']} "
              f"resent_after_failure={r['resent']}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
