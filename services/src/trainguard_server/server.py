"""``trainguard serve``: gateway (gRPC + HTTP), queue, processor, stores and query API in one process.

Start order: stores → queue → processor → gateway → listeners. Stop order (SIGTERM/SIGINT): stop
accepting (listeners), drain the queue through the processor, checkpoint, close the stores — so nothing
that was acknowledged is left unprocessed.

The stop is bounded (issue 18, finding 6): it takes at most ``shutdown_timeout_s``. When draining or the
checkpoint fails (a full disk, a store away) or the deadline passes (a store call that blocks), the process
exits with code 1 after a log line saying what was not committed; that stays in the queue and is processed
at the next start (nothing acknowledged is lost: at-least-once).
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import resource
import signal
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

from trainguard_engine.catalogue import DetectionSettings

from .api.app import create_app
from .api.deps import Services
from .config import Settings, parse_roles
from .gateway.backlog import ProjectBacklog
from .gateway.grpc import build_grpc_server
from .gateway.http import ingest_router
from .gateway.ingest import Gateway
from .http_thread import HttpThread
from .memory_trim import MemoryTrim
from .notify import WebhookNotifier
from .processor.embedded import EmbeddedProcessor, tune_gc
from .queue import open_queue
from .storage.select import open_stores

log = logging.getLogger("trainguard.server")

TOKENS_FILE = "bootstrap-tokens.json"
SHUTDOWN_GRACE_S = 5.0
"""How long past ``shutdown_timeout_s`` a stop that blocks is waited for before the process exits anyway (the
stop gives its last steps, closing the queue and stores, this long)."""
BOOTSTRAP_LOCK = ".bootstrap.lock"
PROCESSOR_LOCK = "processor.lock"
"""Held (flock) by the process that runs the processor on the embedded SQLite queue, for its whole life."""


OPEN_FILES_WANTED = 65536
"""The open-files limit serve raises its soft limit to (at most the hard limit): every connection held open is
a descriptor, and at the usual soft limit of 1,024 a thousand idle connections stopped it accepting any."""
ACCEPT_ERROR_LOG_EVERY_S = 10.0
"""asyncio's 'socket.accept() out of system resource' (a traceback per failed accept: 125 MB of log in 30 s
under a connection flood) is logged at most once per this many seconds, with how many were left out."""


def _check_workers(workers: int, queue: Any, auto: bool = False) -> None:
    """Say so when ``processor_workers`` cannot all be used: a queue of one partition runs the pipeline in
    the processor's thread (no workers at all), and a worker beyond the partition count gets none. Auto's
    pick (``auto``) over a queue someone made one partition is said at INFO: nobody asked for workers."""
    if workers <= 0:
        return
    if not getattr(queue, "partitioned", False):
        say = log.info if auto else log.warning
        say("processor_workers=%d is ignored: the queue has one partition, so the pipeline runs in the "
            "processor's thread (TRAINGUARD_QUEUE_PARTITIONS 0 -- auto -- or above 1 partitions it)", workers)
        return
    partitions = getattr(queue, "partitions", None)  # Kafka: the group shares the topic's, told later
    if isinstance(partitions, int) and workers > partitions:
        log.warning("processor_workers=%d: only %d have work -- the queue has %d partitions, one worker each "
                    "at most", workers, partitions, partitions)


class DataDirInUse(RuntimeError):
    """Another live process runs the processor on this data directory (it holds :data:`PROCESSOR_LOCK`)."""


@dataclass
class BootstrapTokens:
    project: str
    ingest: str
    read: str


class EmbeddedServer:
    """The all-in-one backend. ``start()`` returns once every listener is bound."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.data_dir = Path(settings.data_dir)
        self.tokens: Optional[BootstrapTokens] = None
        self.notifier: Optional[WebhookNotifier] = None
        self.http_port = 0
        self.grpc_port = 0
        self._http: Optional[HttpThread] = None
        self._grpc: Any = None
        self._stopped = threading.Event()
        self._stop_lock = threading.Lock()
        self.exit_code = 0  # of the stop: 1 when something acknowledged was not committed
        self._lock_fd: Optional[int] = None  # PROCESSOR_LOCK while this process consumes the SQLite queue

    # --- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        s = self.settings
        raise_open_files_limit()
        _limit_accept_error_logs()
        self.data_dir.mkdir(parents=True, exist_ok=True)
        roles = self.roles = parse_roles(s.roles)
        if "processor" in roles and s.queue != "kafka":  # one consumer of the SQLite queue and its state
            self._lock_fd = _processor_lock(self.data_dir)
        try:
            self._start(s, roles)
        except BaseException:
            self._release_lock()
            raise

    def _release_lock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # closing the descriptor releases the flock
            self._lock_fd = None

    def _start(self, s: Settings, roles: Tuple[str, ...]) -> None:
        self.stores = open_stores(s, self.data_dir)  # SQLite unless TRAINGUARD_EVENT_STORE/METRIC_STORE
        # SQLite under data_dir unless TRAINGUARD_QUEUE=kafka; only a processor joins the consumer group
        self.queue = open_queue(s, self.data_dir, consume="processor" in roles)
        self.tokens = self._bootstrap_tokens()
        detection = DetectionSettings.from_overrides(json.loads(s.detection_overrides or "{}"))
        backlog = None  # a project's events waiting for the processor: counted where both share this process
        # and its queue (over Kafka other processes may consume what this gateway published)
        if ({"gateway", "processor"} <= set(roles) and s.processor_runtime != "flink" and s.queue != "kafka"
                and s.project_max_backlog_events > 0):
            backlog = ProjectBacklog(s.project_max_backlog_events, s.retry_after_s, self.queue.depth)
        self.gateway = Gateway(self.queue, self.stores.projects, s, backlog=backlog,
                               metric_names=self.stores.metrics.names) if "gateway" in roles else None
        gateway = self.gateway
        self.processor: Optional[EmbeddedProcessor] = None
        if "processor" in roles:
            tune_gc(s.processor_gc_gen0_threshold)  # before the processor: its pipeline workers take it too
            if s.processor_runtime != "flink":  # the Flink job runs the pipelines: no workers here
                _check_workers(s.processor_workers, self.queue, auto=s.processor_workers_auto)
        if "processor" in roles and s.processor_runtime == "flink":
            self.processor = self._flink_stores()
        elif "processor" in roles:
            self.processor = EmbeddedProcessor(
                self.queue, self.stores.events, self.stores.metrics, self.stores.incidents, detection,
                batch=s.processor_batch, round_events=s.processor_round_events,
                round_target_s=s.processor_round_target_s, snapshot_every_s=s.snapshot_every_s,
                tick_interval_s=s.tick_interval_s, quota_log_interval_s=s.quota_log_interval_s,
                yield_to=(lambda: gateway.busy) if gateway is not None else None,
                processed=backlog.processed if backlog is not None else None,
                pause_gc=s.processor_gc_pause, metric_write_chunks=s.processor_metric_write_chunks,
                metric_write_delay_s=s.processor_metric_write_delay_s, processor_workers=s.processor_workers,
                pool_isolate_after=s.processor_pool_isolate_after,
                pool_left_out_s=s.processor_pool_left_out_s,
                pool_call_timeout_s=s.processor_pool_call_timeout_s,
                uncommitted_max_bytes=s.processor_uncommitted_max_mb * 1024 * 1024)
        try:
            self._serve(s, roles)
        except BaseException:  # its pipeline workers end too (else the exit waits on them forever: G2)
            if self.processor is not None:
                self.processor.halt()
            raise

    def _serve(self, s: Settings, roles: Tuple[str, ...]) -> None:
        """:meth:`_start`'s second half, after the processor is built: the processor started, the gRPC
        and HTTP servers bound and started."""
        if self.processor is not None and s.webhook_url:
            self.notifier = WebhookNotifier(s.webhook_url, min_severity=s.webhook_min_severity,
                                            max_per_minute=s.webhook_max_per_minute,
                                            dashboard_url=s.dashboard_url, state=self.stores.incidents)
            self.processor.listeners.append(self.notifier)
        # ingest threads and the processor share one interpreter: switch often so an ingest request
        # waiting for the GIL is not held for the default 5 ms at every hand-over
        sys.setswitchinterval(0.0005)
        self.services = Services(events=self.stores.events, metrics=self.stores.metrics,
                                 incidents=self.stores.incidents, projects=self.stores.projects,
                                 queue=self.queue, gateway=self.gateway, processor=self.processor,
                                 settings=s)
        if self.processor is not None:
            self.processor.start()
        if self.gateway is not None:
            self._grpc, self.grpc_port = build_grpc_server(self.gateway, s.host, s.grpc_port,
                                                           max_message_bytes=s.max_batch_bytes)
            self._grpc.start()
        elif "api" not in roles:
            return  # a processor alone serves nothing
        app = create_app(self.services, ingest_router(self.gateway) if self.gateway is not None else None)
        self._http = HttpThread(app, s.host, s.http_port, "trainguard-http")
        self.http_port = self._http.port
        self._http.start(self._stopped.wait)

    def _flink_stores(self) -> EmbeddedProcessor:
        """``processor_runtime=flink``: the Flink job runs the pipeline; this stores (flink_stores.py)."""
        s = self.settings
        if s.queue != "kafka":
            raise ValueError("TRAINGUARD_PROCESSOR_RUNTIME=flink needs TRAINGUARD_QUEUE=kafka (the job reads "
                             "the gateway's topic)")
        from .processor.flink_stores import FlinkStoresProcessor, open_results_queue

        results = open_results_queue(s.kafka_bootstrap_servers, s.kafka_results_topic, s.kafka_group_id,
                                     json.loads(s.kafka_client_config or "{}"), s.kafka_session_timeout_ms,
                                     s.kafka_create_topics)
        return FlinkStoresProcessor(self.queue, results, self.stores.events, self.stores.metrics,
                                    self.stores.incidents, batch=s.processor_batch,
                                    snapshot_every_s=s.snapshot_every_s)

    def stop(self, drain: bool = True) -> int:
        """Stop accepting, drain what was acknowledged, checkpoint, close -- each step attempted even when
        one before failed, the processor's within ``shutdown_timeout_s``. Idempotent. Returns the exit code:
        0 when everything was committed, 1 when not (logged, with what was not committed)."""
        with self._stop_lock:
            if self._stopped.is_set():
                return self.exit_code
            end = time.monotonic() + self.settings.shutdown_timeout_s
            failed = []
            if self._grpc is not None:
                failed += _attempt("stopping gRPC ingest", lambda: self._grpc.stop(grace=2).wait(5))
            if self._http is not None:
                failed += _attempt("stopping HTTP", lambda: self._http.stop(10) if self._http else None)
            processor = self.processor
            if processor is not None:
                left = max(1.0, end - time.monotonic() - 2.0)  # leave a little for the closes
                drained = _attempt("draining and checkpointing",
                                   lambda: processor.stop(drain=drain, timeout=left))
                if drained:
                    log.error("shutdown: %s; the queue holds %s uncommitted batch(es) in all -- they stay "
                              "queued and are processed at the next start", processor.not_committed(),
                              _depth_or_unknown(self.queue))
                failed += drained
            if self.notifier is not None:
                failed += _attempt("closing notifications", self.notifier.close)
            failed += _attempt("closing the queue", self.queue.close)
            failed += _attempt("closing the stores", self.stores.close)
            self._release_lock()
            if failed:
                self.exit_code = 1
                log.error("shutdown incomplete (exit code 1): %s", "; ".join(failed))
            self._stopped.set()
            return self.exit_code

    def serve_forever(self) -> int:
        """Block until SIGTERM/SIGINT, then stop (draining the queue) within ``shutdown_timeout_s``; returns
        the exit code (see :meth:`stop`). Past the deadline (a store call that blocks) the process exits at
        once, code 1, after logging what was not committed."""
        asked: List[float] = []

        def _on_signal(signum: int, _frame: Any) -> None:
            if asked:
                log.warning("signal %s: already stopping (at most %.0f s in all)", signum,
                            self.settings.shutdown_timeout_s)
                return
            asked.append(time.monotonic())
            log.warning("signal %s: draining and stopping (at most %.0f s: shutdown_timeout_s)", signum,
                        self.settings.shutdown_timeout_s)
            threading.Thread(target=self.stop, name="trainguard-stop", daemon=True).start()

        signal.signal(signal.SIGTERM, _on_signal)
        signal.signal(signal.SIGINT, _on_signal)
        trim = self.memory_trim()
        while not self._stopped.wait(0.5):
            if asked and time.monotonic() - asked[0] > self.settings.shutdown_timeout_s + SHUTDOWN_GRACE_S:
                self._overran()
            if not asked:
                trim.tick()
        return self.exit_code

    def memory_trim(self) -> MemoryTrim:
        """The give-back of freed heap memory after a burst (memory_trim.py, security.md H42), from the
        settings ``memory_trim_interval_s`` (0: off) and ``memory_trim_min_growth_mb``."""
        s = self.settings
        return MemoryTrim(s.memory_trim_interval_s, s.memory_trim_min_growth_mb * 2**20)

    def _overran(self) -> None:
        """The stop blocked past the deadline: log what was not committed (from memory: the stores may be
        what blocks) and exit now with code 1."""
        held = self.processor.not_committed() if self.processor is not None else "nothing processed"
        log.error("shutdown did not finish within shutdown_timeout_s (%.0f s): %s; that and every batch "
                  "still queued stay in the queue and are processed at the next start; exiting with code 1",
                  self.settings.shutdown_timeout_s, held)
        for handler in logging.getLogger().handlers:
            handler.flush()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)

    # --- URLs -----------------------------------------------------------------------------------
    @property
    def http_url(self) -> str:
        return f"http://{_url_host(self.settings.host)}:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"grpc://{_url_host(self.settings.host)}:{self.grpc_port}"

    # --- tokens ---------------------------------------------------------------------------------
    def _bootstrap_tokens(self) -> BootstrapTokens:
        """The bootstrap project's tokens: from settings, else from the data dir, else new (saved 0600).

        Roles started together on one data dir (``--roles`` split, Helm's split mode) each run this at
        once: an exclusive lock on the data dir serializes them, so the first creates or registers the
        tokens and the others find them (no duplicate registration, no half-written file read)."""
        with _data_dir_lock(self.data_dir / BOOTSTRAP_LOCK):
            return self._bootstrap_tokens_locked()

    def _bootstrap_tokens_locked(self) -> BootstrapTokens:
        s = self.settings
        path = self.data_dir / TOKENS_FILE
        saved: Dict[str, str] = {}
        if path.exists():
            saved = json.loads(path.read_text(encoding="utf-8"))
        project = saved.get("project", s.bootstrap_project)
        tokens: Dict[str, str] = {}
        for kind, explicit in (("ingest", s.bootstrap_ingest_token), ("read", s.bootstrap_read_token)):
            token = explicit or saved.get(kind)
            if token is None or self.stores.projects.authenticate(token) is None:
                if token is not None:
                    self._register_bootstrap(project, kind, token)
                else:
                    token = self.stores.projects.create_token(project, kind, "bootstrap")
            tokens[kind] = token
        if saved != {"project": project, **tokens}:  # written whole, then renamed: never read half-written
            tmp = path.with_name(f".{path.name}.{os.getpid()}")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                json.dump({"project": project, **tokens}, fh)
            os.replace(tmp, path)
        return BootstrapTokens(project, tokens["ingest"], tokens["read"])

    def _register_bootstrap(self, project: str, kind: str, token: str) -> None:
        """Register an operator-given bootstrap token. Processes with data dirs of their own sharing one
        state store (PostgreSQL: pods on different nodes) are not serialized by the data-dir lock: another
        may register the same token between our check and our insert. "Already exists" is then fine when
        the token now authenticates as this kind; any other refusal (malformed, revoked, another secret or
        kind under that id) is raised."""
        try:
            self.stores.projects.add_token(project, kind, token, "bootstrap")
        except ValueError:
            info = self.stores.projects.authenticate(token)
            if info is None or info.kind != kind:
                raise
            log.info("bootstrap %s token %s was registered by another process at the same time",
                     kind, info.token_id)


def raise_open_files_limit(wanted: int = OPEN_FILES_WANTED) -> int:
    """Raise this process's soft RLIMIT_NOFILE to ``wanted`` (at most the hard limit); returns the soft limit
    now in force. Never raises (a limit that cannot be changed stays as it is)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft == resource.RLIM_INFINITY or soft >= target:
        return soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError):
        return soft
    return target


class _AcceptErrorLimiter(logging.Filter):
    """Lets one 'socket.accept() out of system resource' record through per ``every_s``, without its
    traceback, saying what it means, the limit and how many were left out; other records pass."""

    def __init__(self, every_s: float) -> None:
        super().__init__()
        self.every_s = every_s
        self._last: Dict[str, float] = {}
        self._left_out: Dict[str, int] = {}
        self._lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        text = str(record.msg)
        if text.startswith("socket.accept() out of system resource"):
            key = "accept"
        elif text.startswith("Exception in callback BaseSelectorEventLoop._start_serving"):
            key = "retry"  # the accepts asyncio retries (one per failed accept) meeting a closed listener
        else:
            return True
        now = time.monotonic()
        with self._lock:
            if now - self._last.get(key, -float("inf")) < self.every_s:
                self._left_out[key] = self._left_out.get(key, 0) + 1
                return False
            self._last[key], left_out, self._left_out[key] = now, self._left_out.get(key, 0), 0
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        error = record.exc_info[1] if record.exc_info else None
        if key == "accept":
            record.msg = (f"cannot accept connections: {error or 'out of system resource'} -- this "
                          f"process holds its open-files limit ({soft} descriptors; connections held open "
                          "count): new connections wait until some close; raise the limit (ulimit -n, "
                          "LimitNOFILE=) or find the clients holding connections "
                          f"({left_out} more like this in the last {self.every_s:g} s)")
        else:
            record.msg = (f"an accept retried after the open-files limit ({soft}) found its listener closed: "
                          f"{error!r} ({left_out} more like this in the last {self.every_s:g} s)")
        record.args = ()
        record.exc_info = None
        record.exc_text = None
        return True


def _limit_accept_error_logs() -> None:
    """Install :class:`_AcceptErrorLimiter` on asyncio's logger, once per process."""
    logger = logging.getLogger("asyncio")
    if not any(isinstance(f, _AcceptErrorLimiter) for f in logger.filters):
        logger.addFilter(_AcceptErrorLimiter(ACCEPT_ERROR_LOG_EVERY_S))


def _processor_lock(data_dir: Path) -> int:
    """Take ``data_dir/processor.lock`` (flock, not blocking) and write this pid in it; the descriptor holds
    it until closed or the process dies (a kill -9 leaves no stale lock). DataDirInUse when another process
    holds it: two processors on one SQLite queue would each process it and overwrite each other's state."""
    path = data_dir / PROCESSOR_LOCK
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        holder = os.read(fd, 32).decode("ascii", "replace").strip() or "unknown"
        os.close(fd)
        raise DataDirInUse(f"data directory {data_dir} is in use by another trainguard process (pid "
                           f"{holder}) that runs its processor ({path} is locked): stop that process, or "
                           "give this one another --data-dir (TRAINGUARD_DATA_DIR); a gateway or api alone "
                           "(TRAINGUARD_ROLES=gateway,api) may share it") from None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return fd


@contextmanager
def _data_dir_lock(path: Path) -> Iterator[None]:
    """An exclusive advisory lock (flock) on ``path`` for the block, released when the block ends or the
    process dies."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock


def _attempt(what: str, step: Callable[[], Any]) -> List[str]:
    """Run one shutdown step: ``[]``, or ``["<what>: <error>"]`` (logged with its traceback) if it raised."""
    try:
        step()
    except Exception as exc:
        log.exception("shutdown: %s failed", what)
        return [f"{what}: {type(exc).__name__}: {exc}"]
    return []


def _depth_or_unknown(queue: Any) -> str:
    try:
        return str(queue.depth())
    except Exception:  # the queue may be what failed
        return "an unknown number of"


def _url_host(host: str) -> str:
    if host in ("0.0.0.0", "::", ""):
        return "127.0.0.1"
    return f"[{host}]" if ":" in host else host
