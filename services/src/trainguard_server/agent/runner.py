"""``trainguard agent``: relay + log tailer + process watch, in wrapper or sidecar mode.

Contract of :class:`Agent`:

* **Wrapper mode** (``run_command(argv)``): starts the job as a child with the same environment plus
  ``TRAINGUARD_RUN_ID`` (generated when neither it nor a launcher's run id is set, so the SDK inside and
  the agent name the same run), ``TRAINGUARD_ENDPOINT`` (the agent's loopback listener, unless set) and
  ``TRAINGUARD_TOKEN``, ``PYTHONUNBUFFERED=1`` (unless set: a pipe would otherwise hold Python's output
  back in 8 KiB blocks, hiding progress and the last lines before a crash). The child's stdout and
  stderr pass through to the agent's, byte for byte. SIGTERM, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2 (and
  SIGINT when stdin is not a terminal, which delivers it to the whole group itself) are forwarded to the
  child. Returns the child's wait status as :class:`ExitStatus`; the CLI ends the agent the same way
  (the same exit code, or the same signal), so a launcher or Kubernetes sees what it would have seen.
* **Sidecar mode** (``run_sidecar()``): follows ``log_files`` (globs); the job's end is an exit-code
  file (``exit_file``: the job writes its exit code there), the training container's termination in the
  pod's status (``pod_container``: read from the Kubernetes API every ``pod_poll_s``, :mod:`.kube`; it
  also gives the reason, ``OOMKilled``, which goes into the EXIT event, and the termination message) or,
  with a shared process namespace, the disappearance of the process whose command line matches
  ``watch_process``. When the job's end was seen another way (or SIGTERM came), the exit file is still
  read for up to :data:`EXIT_FILE_GRACE_S` and the pod for up to :data:`POD_STATUS_GRACE_S` (the kubelet
  records the end a moment later); with neither, the exit code is reported as unknown in a log line.
  SIGTERM ends it too (a Kubernetes native sidecar is terminated right after the main container exits):
  from ``run_sidecar()`` until ``stop()`` has delivered what is left, SIGTERM/SIGINT only ask it to
  finish. Returns 0 once what it captured is delivered (or ``drain_timeout_s`` passed).
* **Reports**: START once the job is known; every traceback and every notable line
  (:mod:`.capture`); a hang report when the :mod:`.watchdog` says so, with the last lines of output and
  the Python stacks (:mod:`.stacks`), and its end when progress resumes; EXIT with the exit code and
  signal -- unless the SDK in the job already reported the same EXIT for that rank. A traceback the SDK
  reported too (same rank and stack fingerprint) is not sent again: while the SDK is active in a rank,
  the agent holds its tracebacks for ``exception_hold_s`` (and until the job ended) before deciding.
* **What a dead SDK process left** (:mod:`.sdk_spools`): the job's SDK spool (``sdk_spool_dir``; in wrapper
  mode the job gets ``TRAINGUARD_SPOOL_DIR=<spool_dir>/sdk`` unless its environment names one, and that
  one is read) is searched every ``sdk_spool_scan_s``, at the start and when the job ended (before its
  tracebacks are de-duplicated against the SDK's): the urgent events a rank killed by SIGKILL / an abort /
  a native crash wrote ahead, faulthandler's dump, and batches a rank spooled at exit go through the relay.
* Nothing here raises into the job: the agent's own failures are logged, and the job runs on.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Deque, Dict, List, Mapping, Optional, Set, Tuple

from trainguard.core import events as ev
from trainguard_engine.catalogue import signal_of_exit_code

from ..config import Settings
from ..gateway.ingest import GatewayError, batch_from_json
from ..queue.sqlite import SqliteQueue
from .capture import OutputCapture
from .events import Event, EventBuilder, agent_identity
from .kube import ContainerEnd, KubeConfig, PodStatusReader
from .local import LocalServers
from .relay import Forwarder, RelayGateway, open_spool_queue
from .sdk_spools import SdkSpools
from .sources import FileFollower, PipePump
from .stacks import python_stacks
from .upstream import open_upstream
from .watchdog import DEFAULT_POLICY, Hang, HangPolicy, ProgressWatch

log = logging.getLogger("trainguard.agent")

EXIT_FILE_GRACE_S = 5.0
POD_STATUS_GRACE_S = 15.0
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
MAX_OUTBOX = 10_000
TAIL_IN_REPORT = 30
_LAUNCHER_RUN_IDS = ("TRAINGUARD_RUN_ID", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID")


def default_spool_dir() -> Path:
    system = Path("/var/lib/trainguard-agent")
    if os.access(system.parent, os.W_OK) or (system.exists() and os.access(system, os.W_OK)):
        return system
    return Path.home() / ".cache" / "trainguard" / "agent"


@dataclass
class AgentConfig:
    """What ``trainguard agent`` is told (flags / ``TRAINGUARD_AGENT_*``; see cli.py)."""

    upstream: str
    token: str
    listen: str = "127.0.0.1:4318"
    listen_grpc: str = "127.0.0.1:4317"
    spool_dir: Path = field(default_factory=default_spool_dir)
    log_files: List[str] = field(default_factory=list)
    exit_file: str = ""
    watch_process: str = ""
    policy: HangPolicy = DEFAULT_POLICY
    min_level: str = "WARNING"
    drain_timeout_s: float = 10.0
    max_spool_records: int = 50_000
    exception_hold_s: float = 2.0
    stacks: bool = True
    run_id: str = ""
    poll_s: float = 0.2
    pod_container: str = ""      # sidecar: the training container, whose end the pod's status gives
    kube_api: str = ""           # the Kubernetes API ("" = in-cluster)
    pod_poll_s: float = 2.0
    sdk_spool_dir: Optional[Path] = None  # the job's SDK spool (None: TRAINGUARD_SPOOL_DIR, else <spool>/sdk)
    sdk_spool_scan_s: float = 5.0


@dataclass(frozen=True)
class ExitStatus:
    code: int       # the exit code a shell would show (128 + n for signal n)
    signal: int     # the signal that ended the job, 0 if none

    @classmethod
    def from_code(cls, code: int) -> ExitStatus:
        """From a shell-convention code (an exit-code file): 128 + n says signal n."""
        return cls(code, signal_of_exit_code(code))


class Agent:
    def __init__(self, config: AgentConfig, env: Optional[Mapping[str, str]] = None) -> None:
        self.config = config
        self.env: Dict[str, str] = dict(os.environ if env is None else env)
        if config.run_id:
            self.env["TRAINGUARD_RUN_ID"] = config.run_id
        elif not any(self.env.get(name) for name in _LAUNCHER_RUN_IDS):
            self.env["TRAINGUARD_RUN_ID"] = f"run-{uuid.uuid4().hex[:12]}"
        self.identity = agent_identity(self.env)
        self.builder = EventBuilder(self.identity)
        self.rank = self.identity.rank
        self.watch = ProgressWatch(config.policy)
        self.settings = Settings()
        self._lock = threading.Lock()
        self.captures: Dict[str, OutputCapture] = {}
        self.tail: Deque[str] = deque(maxlen=TAIL_IN_REPORT)
        self.sdk_ranks: Set[int] = set()
        self.sdk_fingerprints: Set[Tuple[int, str]] = set()
        self.sdk_exits: Dict[int, int] = {}
        self.rank_steps: Dict[int, int] = {}
        self._held: List[Tuple[int, Event]] = []
        self._outbox: Deque[Event] = deque()
        self.counters: Counter[str] = Counter()
        self.hangs: List[Hang] = []
        self.child_pid = 0
        self.exceptions_seen = 0
        self._started = False
        self._stop = threading.Event()
        self._restore_signals: Dict[int, Any] = {}
        self.queue: Optional[SqliteQueue] = None
        self.gateway: Optional[RelayGateway] = None
        self.forwarder: Optional[Forwarder] = None
        self.servers: Optional[LocalServers] = None
        self.sdk_spool_root = config.sdk_spool_dir or (Path(self.env["TRAINGUARD_SPOOL_DIR"])
                                                       if self.env.get("TRAINGUARD_SPOOL_DIR")
                                                       else config.spool_dir / "sdk")
        self.sdk_spools: Optional[SdkSpools] = None
        self._next_sdk_scan = 0.0

    # ------------------------------------------------------------------------------------- lifecycle
    def start(self) -> None:
        """Open the spool, start forwarding and the loopback listeners."""
        cfg = self.config
        self.queue = open_spool_queue(cfg.spool_dir, cfg.max_spool_records)
        self.gateway = RelayGateway(self.queue, cfg.token, self.settings, observer=self._observe)
        self.forwarder = Forwarder(self.queue, open_upstream(cfg.upstream, cfg.token))
        self.forwarder.start()
        gateway = self.gateway
        self.sdk_spools = SdkSpools(self.sdk_spool_root, cfg.upstream,
                                    lambda batch: gateway.ingest_batch(gateway.info, batch),
                                    self.settings.max_batch_events)
        self.servers = LocalServers(self.gateway, self.status)
        if cfg.listen:
            self.servers.start_http(cfg.listen)
        if cfg.listen_grpc:
            self.servers.start_grpc(cfg.listen_grpc)
        self._deliver_sdk_spools(force=True)  # what an earlier job left

    def stop(self) -> bool:
        """Deliver what is left (up to drain_timeout_s), stop. True when nothing was left undelivered."""
        self._release_held(force=True)
        self._flush_outbox()
        delivered = self.forwarder.drain(self.config.drain_timeout_s) if self.forwarder else True
        if self.servers is not None:
            self.servers.stop()
        if self.forwarder is not None:
            self.forwarder.stop()
        if self.queue is not None:
            left = self.queue.depth()
            if left:
                log.warning("%d spooled records not delivered yet: kept in %s for the next start", left,
                            self.config.spool_dir)
            self.queue.close()
        for sig, handler in self._restore_signals.items():
            signal.signal(sig, handler)
        self._restore_signals = {}
        return delivered

    def status(self) -> Dict[str, Any]:
        forwarder = self.forwarder
        return {"run_id": self.identity.run_id, "rank": self.rank, "child_pid": self.child_pid,
                "spooled_records": self.queue.depth() if self.queue else 0,
                "upstream": self.config.upstream,
                "upstream_ok": forwarder.upstream_ok if forwarder else False,
                "relay": forwarder.stats.snapshot() if forwarder else {},
                "gateway": self.gateway.stats.snapshot() if self.gateway else {},
                "captured": {k: {"lines": c.lines, "sent": c.sent} for k, c in self.captures.items()},
                "hangs": len(self.hangs), "counters": dict(self.counters),
                "sdk_spools": dict(self.sdk_spools.counters) if self.sdk_spools else {},
                "last_progress_ns": self.watch.last_progress_ns, "hang_threshold_s": self.watch.threshold_s()}

    # ------------------------------------------------------------------------------------ wrapper mode
    def child_environment(self) -> Dict[str, str]:
        env = dict(self.env)
        env.setdefault("PYTHONUNBUFFERED", "1")
        if not env.get("TRAINGUARD_ENDPOINT") and self.servers is not None and self.servers.http_port:
            host = self.config.listen.rpartition(":")[0].strip("[]") or "127.0.0.1"
            env["TRAINGUARD_ENDPOINT"] = f"http://{'127.0.0.1' if host in ('0.0.0.0', '') else host}:" \
                                         f"{self.servers.http_port}"
        if self.config.token:
            env.setdefault("TRAINGUARD_TOKEN", self.config.token)
        env.setdefault("TRAINGUARD_SPOOL_DIR", str(self.sdk_spool_root))
        return env

    def run_command(self, argv: List[str]) -> ExitStatus:
        child = subprocess.Popen(argv, env=self.child_environment(), stdin=None, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE)
        self.child_pid = self.builder.pid = child.pid
        self._job_started(argv)
        assert child.stdout is not None and child.stderr is not None
        pumps = [PipePump(os.dup(child.stdout.fileno()), 1, self._line_handler("stdout"), "stdout"),
                 PipePump(os.dup(child.stderr.fileno()), 2, self._line_handler("stderr"), "stderr")]
        child.stdout.close()
        child.stderr.close()
        for pump in pumps:
            pump.start()
        previous = self._forward_signals(child)
        try:
            while child.poll() is None:
                self._stop.wait(self.config.poll_s)
                self.tick()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        for pump in pumps:  # a grandchild that kept the pipes open must not hold the agent forever
            pump.join(timeout=5.0)
        code = child.returncode
        sig = -code if code < 0 else 0
        status = ExitStatus(128 + sig if sig else code, sig)
        self._job_ended(status)
        return status

    def _forward_signals(self, child: subprocess.Popen[bytes]) -> Dict[int, Any]:
        if threading.current_thread() is not threading.main_thread():
            return {}
        signals = list(FORWARDED_SIGNALS)
        if not sys.stdin or not sys.stdin.isatty():
            signals.append(signal.SIGINT)
        previous: Dict[int, Any] = {}

        def forward(signum: int, _frame: Any) -> None:
            try:
                child.send_signal(signum)
            except OSError:
                pass

        for sig in signals:
            previous[sig] = signal.signal(sig, forward)
        return previous

    # ------------------------------------------------------------------------------------ sidecar mode
    def run_sidecar(self) -> int:
        cfg = self.config
        follower = FileFollower(cfg.log_files, self._file_line) if cfg.log_files else None
        if follower is not None:
            follower.start()
        pattern = re.compile(cfg.watch_process) if cfg.watch_process else None
        pod = self._pod_reader()
        status: Optional[ExitStatus] = None
        pod_end: Optional[ContainerEnd] = None
        next_pod_read = 0.0
        # SIGTERM/SIGINT only set _stop from here until stop() has delivered what is left: a native sidecar
        # gets SIGTERM right after the trainer exits, while the agent still sends its EXIT and drains
        self._restore_signals = self._stop_on_signals()
        while not self._stop.is_set():
            self._stop.wait(cfg.poll_s)
            self.tick()
            code = read_exit_file(cfg.exit_file) if cfg.exit_file else None
            if code is not None:
                status = ExitStatus.from_code(code)
                break
            if pod is not None and time.monotonic() >= next_pod_read:
                next_pod_read = time.monotonic() + cfg.pod_poll_s
                pod_end = self._read_pod(pod)
                if pod_end is not None:
                    break
            if pattern is not None:
                if not self.child_pid:
                    pid = find_process(pattern)
                    if pid:
                        self.child_pid = self.builder.pid = pid
                        self._job_started(read_cmdline(pid))
                elif not os.path.exists(f"/proc/{self.child_pid}"):
                    break
        if pod_end is None and ((status is None and cfg.exit_file) or pod is not None):
            # the job ended (or we were stopped): the file and the pod are asked a while longer -- the pod
            # also after the exit file, for the reason (a wrapper shell writes 137, Kubernetes OOMKilled);
            # the log files are still followed meanwhile (a tee finishing the last lines)
            status, pod_end = self._await_exit(status, pod)
        if follower is not None:
            follower.stop()
        if pod_end is not None:
            status = ExitStatus(pod_end.exit_code, pod_end.signal)
        if status is None and (self.child_pid or self._started):
            why = f" ({pod.error})" if pod is not None and pod.error else ""
            self._emit([self._note("WARNING", "trainguard agent: the job ended (or the agent was stopped) "
                                   "and its exit code is unknown: set TRAINGUARD_AGENT_EXIT_FILE or "
                                   f"TRAINGUARD_AGENT_POD_CONTAINER{why}")])
        self._job_ended(status, pod_end)
        return 0

    def _pod_reader(self) -> Optional[PodStatusReader]:
        """The Kubernetes pod-status reader when ``pod_container`` is set; a configuration problem is
        reported in a log event (the sidecar then does without)."""
        if not self.config.pod_container:
            return None
        try:
            return PodStatusReader(KubeConfig.from_environment(self.env, api=self.config.kube_api),
                                   self.config.pod_container)
        except (ValueError, OSError) as exc:
            log.warning("pod status: %s", exc)
            self._emit([self._note("WARNING", f"trainguard agent: cannot read the pod's status: {exc}")])
            return None

    def _read_pod(self, pod: PodStatusReader) -> Optional[ContainerEnd]:
        """One read of the pod; a new problem with it (no RBAC, no such container) is reported once."""
        before = pod.error
        end = pod.read()
        if pod.error and pod.error != before:
            self._emit([self._note("WARNING", f"trainguard agent: pod status: {pod.error}")])
        return end

    def _await_exit(self, status: Optional[ExitStatus], pod: Optional[PodStatusReader]
                    ) -> Tuple[Optional[ExitStatus], Optional[ContainerEnd]]:
        """What the exit file (while ``status`` is unknown, up to EXIT_FILE_GRACE_S) and the pod (while
        configured, up to POD_STATUS_GRACE_S: the kubelet records an end a moment after it) say of it."""
        start = time.monotonic()
        end: Optional[ContainerEnd] = None
        while True:
            waited = time.monotonic() - start
            if status is None and self.config.exit_file:
                code = read_exit_file(self.config.exit_file)
                status = ExitStatus.from_code(code) if code is not None else None
            if end is None and pod is not None:
                end = self._read_pod(pod)
            file_done = status is not None or not self.config.exit_file or waited >= EXIT_FILE_GRACE_S
            pod_done = end is not None or pod is None or pod.misconfigured or waited >= POD_STATUS_GRACE_S
            if file_done and pod_done:
                return status, end
            time.sleep(min(0.5, self.config.pod_poll_s))

    def _stop_on_signals(self) -> Dict[int, Any]:
        if threading.current_thread() is not threading.main_thread():
            return {}
        previous: Dict[int, Any] = {}
        for sig in (signal.SIGTERM, signal.SIGINT):
            previous[sig] = signal.signal(sig, lambda _s, _f: self._stop.set())
        return previous

    # --------------------------------------------------------------------------------------- lines
    def _line_handler(self, source: str) -> Any:
        def on_line(number: int, text: str) -> None:
            self._on_line(source, source, number, text)
        return on_line

    def _file_line(self, key: str, number: int, text: str) -> None:
        path = key.rpartition("@")[0]
        self._on_line(key, f"file:{os.path.basename(path)}", number, text, id_source=f"file:{key}")

    def _on_line(self, key: str, source: str, number: int, text: str, id_source: str = "") -> None:
        now = time.time_ns()
        capture = self.captures.get(key)
        if capture is None:
            with self._lock:
                capture = self.captures.get(key)
                if capture is None:
                    capture = self.captures[key] = OutputCapture(
                        source, self.rank, self.builder, self._emit_captured, step_of=self._step_of,
                        min_level=self.config.min_level, id_source=id_source or source)
        if not self._started:  # sidecar mode: the first line of output says the job is there
            self._job_started([])
        cleaned = capture.line(number, text, now)
        with self._lock:
            if cleaned.strip():
                self.tail.append(cleaned)
            ended = self.watch.line(now)
        if ended is not None:
            self._resumed(ended, now)

    def _step_of(self, rank: int) -> int:
        return self.rank_steps.get(rank, -1)

    # --------------------------------------------------------------------------------- SDK traffic
    def _observe(self, env: Any) -> None:
        """An SDK envelope the relay accepted (called from the listener threads, after it was queued)."""
        kind = env.WhichOneof("payload")
        rank = env.rank
        now = time.time_ns()
        ended: Optional[Hang] = None
        with self._lock:
            self.sdk_ranks.add(rank)
            step = env.step
            if kind == "metrics":
                step = max([step] + [p.step for p in env.metrics.points if p.step >= 0])
            elif kind == "heartbeat":
                step = max(step, env.heartbeat.last_step)
                if rank == self.rank:
                    self.watch.sdk_step_time(env.heartbeat.step_time_ewma_s)
            elif kind == "exception" and env.exception.fingerprint:
                self.sdk_fingerprints.add((rank, env.exception.fingerprint))
            elif kind == "lifecycle" and env.lifecycle.phase == 2:  # EXIT
                self.sdk_exits[rank] = env.lifecycle.exit_code
            if step > self.rank_steps.get(rank, -1):
                self.rank_steps[rank] = step
                if rank == self.rank or kind in ("metrics", "heartbeat"):
                    ended = self.watch.step(step, now)
        if ended is not None:
            self._resumed(ended, now)

    # --------------------------------------------------------------------------------------- ticks
    def tick(self) -> None:
        """Periodic work: close quiet tracebacks, release held ones, retry the outbox, check for a hang."""
        now = time.time_ns()
        for capture in list(self.captures.values()):
            capture.idle(now)
        self._release_held()
        self._flush_outbox()
        self._deliver_sdk_spools()
        with self._lock:
            hang = self.watch.check(now) if self._started else None
        if hang is not None:
            self._report_hang(hang)

    def _deliver_sdk_spools(self, force: bool = False) -> None:
        """Dead SDK processes' spools into the relay, every sdk_spool_scan_s (or now)."""
        spools = self.sdk_spools
        now = time.monotonic()
        if spools is None or (not force and now < self._next_sdk_scan):
            return
        self._next_sdk_scan = now + self.config.sdk_spool_scan_s
        try:
            spools.deliver()
        except Exception as exc:  # the agent's own failure must not end the job's watch
            log.warning("delivering the SDK's spools failed: %s", exc)

    def _report_hang(self, hang: Hang) -> None:
        self.hangs.append(hang)
        method, stacks = ("disabled (--no-stacks)", "")
        if self.config.stacks:
            method, stacks = python_stacks(self.child_pid) if self.child_pid else \
                ("no process to inspect (set TRAINGUARD_AGENT_WATCH_PROCESS)", "")
        with self._lock:
            tail = list(self.tail)
        log.warning("no progress for %.0f s (threshold %.0f s): reporting a hang", hang.quiet_s,
                    hang.threshold_s)
        self._emit([self.builder.hang(hang, len(self.hangs), tail, stacks, method)])

    def _resumed(self, hang: Hang, now: int) -> None:
        self._emit([self.builder.resumed(hang, len(self.hangs), now, self.rank_steps.get(self.rank, -1))])

    # ------------------------------------------------------------------------------------- job ends
    def _job_started(self, argv: List[str]) -> None:
        with self._lock:
            if self._started:
                return
            self._started = True
            now = time.time_ns()
            self.watch.started(now)
        self._emit([self.builder.start(argv, now, {"agent": "true"})])

    def _job_ended(self, status: Optional[ExitStatus], pod_end: Optional[ContainerEnd] = None) -> None:
        self._deliver_sdk_spools(force=True)  # what a killed rank wrote ahead: its exceptions are the SDK's
        for capture in list(self.captures.values()):
            capture.close()
        self._release_held(force=True)
        if pod_end is not None and (pod_end.telling_reason or pod_end.message):
            self._emit([self._note("ERROR" if pod_end.exit_code or pod_end.signal else "INFO",
                                   _pod_end_text(pod_end))])
        if status is None:
            return
        if self.sdk_exits.get(self.rank) == status.code and not (pod_end and pod_end.telling_reason):
            self.counters["exit_reported_by_sdk"] += 1
            return
        reason = ("normal" if status.code == 0 else "signal" if status.signal
                  else "exception" if self.exceptions_seen else "sys.exit")
        if pod_end is not None and pod_end.telling_reason:
            reason = pod_end.telling_reason  # "OOMKilled": what the exit code 137 alone cannot say
        self._emit([self.builder.exit(status.code, status.signal, reason, self.rank_steps.get(self.rank, -1),
                                      time.time_ns())])

    # --------------------------------------------------------------------------------------- output
    def _emit_captured(self, events: List[Event]) -> None:
        """Events from a capture: tracebacks of ranks with an active SDK wait to be de-duplicated."""
        now = time.time_ns()
        ready: List[Event] = []
        with self._lock:
            for event in events:
                if "exception" in event:
                    self.exceptions_seen += 1
                    if self.sdk_ranks:  # the SDK is in the job: it may report this one itself
                        self._held.append((now + int(self.config.exception_hold_s * 1e9), event))
                        continue
                ready.append(event)
        if ready:
            self._emit(ready)

    def _release_held(self, force: bool = False) -> None:
        now = time.time_ns()
        ready: List[Event] = []
        with self._lock:
            keep: List[Tuple[int, Event]] = []
            for due, event in self._held:
                if not force and due > now:
                    keep.append((due, event))
                elif (event["rank"], event["exception"].get("fingerprint", "")) in self.sdk_fingerprints:
                    self.counters["exceptions_reported_by_sdk"] += 1
                else:
                    ready.append(event)
            self._held = keep
        if ready:
            self._emit(ready)

    def _note(self, level: str, message: str) -> Event:
        payload = {"logger": "trainguard.agent", "level": level, "message": message, "source": "agent"}
        return ev.envelope(self.builder.base(), "log", payload, step=self.rank_steps.get(self.rank, -1),
                           time_unix_nano=time.time_ns(), severity=level)

    def _emit(self, events: List[Event]) -> None:
        """Queue the agent's own events through the relay's gateway (validated like any client's)."""
        with self._lock:
            self._outbox.extend(events)
            while len(self._outbox) > MAX_OUTBOX:
                self._outbox.popleft()
                self.counters["dropped_outbox_full"] += 1
        self._flush_outbox()

    def _flush_outbox(self) -> None:
        gateway = self.gateway
        if gateway is None:
            return
        with self._lock:
            if not self._outbox:
                return
            events = list(self._outbox)
            self._outbox.clear()
        try:
            batch = batch_from_json(ev.encode_batch(events), max_events=len(events) + 1)
            result = gateway.ingest_batch(gateway.info, batch)
        except GatewayError as exc:  # spool full or failing: keep them for the next tick
            with self._lock:
                self._outbox.extendleft(reversed(events))
            self.counters["outbox_retries"] += 1
            log.debug("agent events wait: %s", exc)
            return
        self.counters["events_sent"] += result.accepted
        for item in result.rejected:
            self.counters[f"rejected_{item.code}"] += 1
            log.warning("agent event rejected by validation: %s", item.message)


def _pod_end_text(end: ContainerEnd) -> str:
    text = (f"Kubernetes: container {end.container!r} terminated: reason {end.reason or 'unknown'}, "
            f"exit code {end.exit_code}" + (f", signal {end.signal}" if end.signal else "")
            + (f", restarts {end.restart_count}" if end.restart_count else ""))
    if end.message:
        text += "\ntermination message:\n" + end.message[-4000:]
    return text


def read_exit_file(path: str) -> Optional[int]:
    """The exit code written to ``path`` (None while it is absent, empty or not a number yet)."""
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read().strip()
    except OSError:
        return None
    try:
        return int(text.split()[0]) if text else None
    except ValueError:
        return None


def read_cmdline(pid: int) -> List[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return [a.decode("utf-8", "replace") for a in fh.read().split(b"\0") if a]
    except OSError:
        return []


def find_process(pattern: re.Pattern[str]) -> int:
    """The lowest pid (other than the agent's own) whose command line matches ``pattern``; 0 if none."""
    own = os.getpid()
    found: List[int] = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == own:
            continue
        if pattern.search(" ".join(read_cmdline(int(name)))):
            found.append(int(name))
    return min(found) if found else 0
