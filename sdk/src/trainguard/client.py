"""The client: turns calls on the training thread into envelopes and hands them to the worker.

Hot path (``log_metrics``): a few type checks and one ``deque.append`` of a tuple; envelope construction,
tensor read-back, history and JSON encoding all happen later on the worker thread. Everything else
(exceptions, lifecycle, logs, memory) is rare and built on the calling thread, where the traceback lives.

Urgent events -- a non-finite metric value, an exception, the START and EXIT events -- wake the worker at
once and are first written ahead to the process's spool directory on the calling thread
(:mod:`.transport.home`; a non-finite alert with the host values it has: a device tensor beside the NaN is
not waited for; the same alert or exception once while it is unsettled), so that a process killed before
the worker sent them (SIGKILL, ``os.abort()``, a C++ ``std::terminate``) leaves them for the next SDK
process or ``trainguard agent``; the copy the worker sends carries the same event id.
"""

from __future__ import annotations

import hashlib
import math
import os
import platform
import re
import sys
import threading
import time
import traceback
from collections import deque
from typing import Any, Callable, Deque, Dict, List, Mapping, Optional, Sequence, Tuple

from . import identity as identity_mod
from .core import events as ev
from .core import fingerprint as fp
from .crash import frame_dict
from .device_reader import DeviceReader
from .guard import warn_once
from .integrations import fatal
from .options import Options, default_spool_dir
from .read_back import K_EVENT, K_METRICS, K_VECTOR, read_back
from .stats import SdkStats
from .transport.base import Transport
from .transport.home import SpoolHome, WriteAhead
from .transport.orphans import Orphan, find_orphans
from .transport.spool import DiskSpool, MemorySpool
from .transport.worker import Spool, Worker
from .version import SDK_NAME, __version__

DEVICE_READ_WAIT_S = 0.05
"""How long one ``drain`` waits for device read-backs in flight (they finish in microseconds unless the
device stream is stuck; see :mod:`.device_reader`)."""
FINAL_DEVICE_READ_WAIT_S = 2.0
"""The same while a flush or the final drain at exit is waiting for everything queued."""
DEVICE_WAIT_REPORT_S = 1.0
"""A heartbeat reports ``sdk_stats["device_wait_s"]`` once the current read-back waited this long."""
HAND_LOCK_WAIT_S = 0.1
"""The longest an alert written ahead waits for the worker to finish popping a batch (microseconds; past it,
the context is read without the lock, best-effort)."""

ExceptionEnricher = Callable[[BaseException], Optional[Mapping[str, str]]]
_CAPTURED_ATTR = "__trainguard_captured__"


def make_transport(options: Options) -> Transport:
    """The transport for ``options.endpoint`` (http, https, grpc, grpcs, file, memory)."""
    endpoint = options.endpoint or ""
    scheme = endpoint.split("://", 1)[0].lower() if "://" in endpoint else ""
    user_agent = f"{SDK_NAME}/{__version__}"
    if scheme in ("http", "https"):
        from .transport.http import HttpTransport

        return HttpTransport(endpoint, options.token, user_agent, connect_timeout=options.connect_timeout,
                             read_timeout=options.read_timeout)
    if scheme in ("grpc", "grpcs"):
        from .transport.grpc import GrpcTransport

        return GrpcTransport(endpoint.split("://", 1)[1].rstrip("/"), options.token,
                             secure=scheme == "grpcs")
    if scheme == "file":
        from .transport.file import FileTransport

        return FileTransport(endpoint)
    if scheme == "memory":
        from .transport.file import MemoryTransport

        return MemoryTransport()
    raise ValueError(f"unsupported endpoint {endpoint!r}: use http(s)://, grpc(s)://, file:// or memory://")


class Client:
    """One per process (``trainguard.init`` creates it). Thread-safe for producers."""

    def __init__(self, options: Options, transport: Optional[Transport] = None) -> None:
        self.options = options
        self.stats = SdkStats()
        self.identity = identity_mod.detect(
            generated_run_id=os.urandom(8).hex(), run_id=options.run_id, trace_id=options.trace_id,
            run_name=options.run_name, rank=options.rank, local_rank=options.local_rank,
            world_size=options.world_size)
        self._base = self._envelope_base()
        self._queue: Deque[Tuple[Any, ...]] = deque()
        self._max_queue = options.max_queue_events  # 0 once closed: every later event is dropped, counted
        self._max_rare = options.max_queue_events + options.queue_reserve_events
        self._reader = DeviceReader(read_back, max_items=options.max_queue_events)
        self._final = False
        self._wake_at = options.max_batch_events
        self._history: Dict[str, Deque[Tuple[int, float]]] = {}
        # the metric items drain() has popped and not yet folded into _history (by id, in queue order), and
        # the lock under which it pops them and folds each: _recent_so_far reads history, hand and queue at
        # one moment, so every value is in exactly one of them
        self._in_hand: Dict[int, Tuple[Any, ...]] = {}
        self._hand_lock = threading.Lock()
        self._enrichers: List[ExceptionEnricher] = []
        self.step = -1
        self._user_steps = False
        self.last_progress_ns = 0
        self.step_time_ewma = 0.0
        self.started_at = time.time()
        self._next_heartbeat = time.monotonic() + options.heartbeat_interval
        self._pid = os.getpid()
        self._init_pid = self._pid  # the process that called init(): the rank (see forked_child)
        # built now, not lazily: a bad endpoint fails init() (and nothing gets imported at exit time,
        # where an import that exec()s code would make CPython forget an unhandled KeyboardInterrupt)
        self._transport: Optional[Transport] = transport or make_transport(options)
        self.home = self._new_home()
        if self.home is not None and options.capture_fatal_signals:
            fault = self.home.fault_file()
            if fault is not None:
                fatal.enable(fault)
        if self.home is not None and self.home.problem:
            warn_once("spool:home", f"{self.home.problem}; urgent events are not written ahead")
        self.worker = Worker(self, self._new_transport, self._new_spool, options, self.stats,
                             settle=self._settle, find_orphans=self._find_orphans)
        self.worker.start()

    # --- identity -------------------------------------------------------------------------------
    @property
    def forked_child(self) -> bool:
        """Whether this process is a fork of the one that created the client (a DataLoader worker). A
        forked child is not the rank: it sends what is logged or captured in it (under its own pid), but no
        heartbeat and no lifecycle event -- the rank's liveness, progress and exit are its parent's."""
        return os.getpid() != self._init_pid

    def _envelope_base(self) -> Dict[str, Any]:
        ident = self.identity
        return {"project": self.options.project, "run_id": ident.run_id, "trace_id": ident.trace_id,
                "host": ident.host, "pid": ident.pid, "rank": ident.rank,
                "local_rank": ident.local_rank, "world_size": ident.world_size,
                "group_rank": ident.group_rank, "run_name": ident.run_name,
                "sdk": f"{SDK_NAME}/{__version__}"}

    def _new_transport(self) -> Transport:
        transport, self._transport = self._transport, None
        return transport if transport is not None else make_transport(self.options)

    def _home_name(self) -> Tuple[str, Dict[str, Any]]:
        """This process's spool directory name and its ``.owner``."""
        run = re.sub(r"[^A-Za-z0-9_.-]", "_", self.identity.run_id)[:64]
        owner = dict(self._base, endpoint=self.options.endpoint or "", created_unix_nano=time.time_ns())
        return f"{run}-rank{self.identity.rank}-pid{os.getpid()}", owner

    def _new_home(self) -> Optional[SpoolHome]:
        """The spool directory of this process, claimed now (None: spooling is off, ``spool_dir=""``)."""
        if self.options.spool_dir == "":
            return None
        root = self.options.spool_dir or default_spool_dir()
        key = hashlib.sha1(f"{self.options.endpoint}|{self.options.project}".encode()).hexdigest()[:12]
        name, owner = self._home_name()
        home = SpoolHome(os.path.join(root, key), name, owner, self.options.write_ahead_max_pending)
        home.claim()
        return home

    def _new_spool(self) -> Spool:
        home = self.home
        if home is None:
            return MemorySpool(self.options.max_queue_events)
        directory = home.claim()
        if directory is None:
            raise OSError(home.problem)
        return DiskSpool(directory, self.options.spool_max_bytes)

    def _find_orphans(self) -> List[Orphan]:
        """Spools of dead processes with this endpoint and project on this host (worker thread; not in a
        forked child: a short-lived DataLoader worker would only take them from the rank for a moment)."""
        home = self.home
        if home is None or self.forked_child:
            return []
        return find_orphans(home.parent, own=home.directory)

    # --- write-ahead of urgent events -----------------------------------------------------------
    def _write_ahead(self) -> Optional[WriteAhead]:
        home = self.home
        if home is None or home.claim() is None:
            return None
        return home.write_ahead

    def _settle(self, events: Sequence[Dict[str, Any]]) -> None:
        """The worker settled ``events`` (acknowledged, rejected or spooled): not needed ahead any more."""
        ahead = self.home.write_ahead if self.home is not None else None
        if ahead is not None and ahead.pending:
            ahead.settle(events)

    def _write_metrics_ahead(self, step: int, t_ns: int, metrics: Mapping[str, Any]) -> Optional[str]:
        """Write a non-finite alert ahead (calling thread); its event id, or None when not written (no
        alert after all, write-ahead off or full, or the same alert still unsettled). Values in device
        tensors are left out of this copy."""
        ahead = self._write_ahead()
        if ahead is None:
            return None
        values: Dict[str, float] = {}
        for name, value in metrics.items():
            kind = type(value)
            if kind is float or kind is int:
                values[name] = float(value)
            elif getattr(getattr(value, "device", None), "type", None) == "cpu":
                try:
                    values[name] = float(value)
                except Exception:
                    continue
        alert = alert_of(values)
        if not alert or not ahead.wants(alert):
            return None
        payload = ev.metrics_payload(values, alert=alert, recent=self._recent_so_far())
        event = ev.envelope(self._base, "metrics", payload, step=step, time_unix_nano=t_ns, severity="ERROR")
        return str(event["event_id"]) if ahead.write(event, key=alert) else None

    def _recent_so_far(self) -> List[Tuple[str, int, float]]:
        """:meth:`recent_metrics` plus the host values the worker has not folded into it yet (still queued,
        or popped by :meth:`drain` and in hand): the context of an event written ahead, which may be all
        the backend ever gets. History, hand and queue are read at one moment, under the lock the worker
        pops and folds under (waited for briefly; past that, read without it, best-effort)."""
        keep = self.options.recent_metrics
        locked = self._hand_lock.acquire(timeout=HAND_LOCK_WAIT_S)  # never stuck, whatever holds it
        try:
            history = self.recent_metrics()
            unfolded = list(self._in_hand.values()) + list(self._queue)[-keep * 4:]  # atomic copies
        finally:
            if locked:
                self._hand_lock.release()
        series: Dict[str, Deque[Tuple[int, float]]] = {}
        for name, step, value in history:
            series.setdefault(name, deque(maxlen=keep)).append((step, value))
        for item in unfolded:
            if item[0] != K_METRICS or not item[3]:
                continue
            for name, value in item[3].items():
                if type(value) is float or type(value) is int:
                    series.setdefault(name, deque(maxlen=keep)).append((item[1], float(value)))
        return [(name, step, value) for name, values in series.items() for step, value in values]

    def _write_event_ahead(self, event: Dict[str, Any]) -> None:
        """Write an urgent rare event ahead (calling thread), an exception with its recent metric values;
        the same exception (fingerprint) coalesces while one is unsettled."""
        ahead = self._write_ahead()
        exc = event.get("exception")
        key = f"exception:{exc.get('fingerprint') or exc.get('type')}" if exc is not None else ""
        if ahead is None or not ahead.wants(key):
            return
        if exc is not None and "recent_metrics" in exc and exc["recent_metrics"] is None:
            exc = dict(exc)
            recent = self._recent_so_far()
            if recent:
                exc["recent_metrics"] = ev.recent_points(recent)
            else:
                del exc["recent_metrics"]
            event = dict(event, exception=exc)
        ahead.write(event, key=key)

    # --- hot path -------------------------------------------------------------------------------
    def log_metrics(self, step: Optional[int], metrics: Dict[str, Any]) -> None:
        """Queue scalar metrics the user logged at ``step`` (None: the current step). Never blocks."""
        if step is None:
            step = self.step
        else:
            if step != self.step:
                self.last_progress_ns = time.time_ns()
            self.step = step
            self._user_steps = True
        self.record_metrics(step, metrics)

    def record_metrics(self, step: int, metrics: Dict[str, Any]) -> None:
        """Queue metrics at ``step`` without touching step tracking (integrations use this)."""
        urgent = False
        for value in metrics.values():
            kind = type(value)
            if kind is float:
                if value - value != 0.0:
                    urgent = True
            elif kind is not int:
                metrics, urgent = self._normalise(metrics)
                break
        queue = self._queue
        if len(queue) >= self._max_queue:
            self.stats.door_drop()
            return
        t_ns = time.time_ns()
        mark: Any = urgent  # an urgent item written ahead carries the event id its envelope must keep
        if urgent:
            try:
                mark = self._write_metrics_ahead(step, t_ns, metrics) or True
            except Exception as exc:  # best effort: the alert itself is still queued
                warn_once(f"write-ahead:{type(exc).__name__}", f"could not write an alert ahead: {exc}")
        queue.append((K_METRICS, step, t_ns, metrics, mark))
        if urgent or len(queue) >= self._wake_at:
            self.worker.wake()

    def log_vector(self, step: int, names: Tuple[str, ...], values: Any) -> None:
        """Queue ``len(names)`` metrics held in one 1-D device tensor (e.g. stacked per-layer grad
        norms). The tensor is read back on the worker thread with a single copy; the caller must not
        modify it afterwards (pass a fresh tensor, e.g. the output of ``torch.stack``)."""
        queue = self._queue
        if len(queue) >= self._max_queue:
            self.stats.door_drop()  # one event (of len(names) metrics)
            return
        queue.append((K_VECTOR, step, time.time_ns(), names, values))
        if len(queue) >= self._wake_at:
            self.worker.wake()

    def _normalise(self, metrics: Dict[str, Any]) -> Tuple[Dict[str, Any], bool]:
        """Slow path: numpy scalars, tensors, bools, garbage. Returns (clean metrics, urgent)."""
        clean: Dict[str, Any] = {}
        urgent = False
        for name, value in metrics.items():
            kind = type(value)
            if kind is float or kind is int:
                clean[name] = value
            elif kind is bool:
                clean[name] = float(value)
            elif hasattr(value, "detach") and hasattr(value, "numel"):  # a torch tensor
                if value.numel() != 1:
                    self._invalid(name, f"a tensor with {value.numel()} elements")
                    continue
                clean[name] = value.detach() if value.requires_grad else value
                continue
            elif hasattr(value, "item") and hasattr(value, "dtype"):  # numpy scalar / 0-d array
                try:
                    clean[name] = float(value.item())
                except Exception:
                    self._invalid(name, f"a non-numeric {kind.__name__}")
                    continue
            elif hasattr(value, "__float__") and not isinstance(value, str):  # Decimal, Fraction, ...
                try:
                    clean[name] = float(value)
                except Exception:  # a user type whose __float__ raises anything at all
                    self._invalid(name, f"a {kind.__name__} that float() refuses")
                    continue
            else:
                self._invalid(name, f"{kind.__name__} value {ev.safe_str(value, 40)!r}")
                continue
            number = clean[name]
            if number - number != 0.0:
                urgent = True
        return clean, urgent

    def _invalid(self, name: str, what: str) -> None:
        self.stats.drop("invalid_value")
        warn_once(f"invalid:{name}", f"metric {name!r} is {what}, not a number; dropped (counted)")

    # --- progress (called by integrations) -------------------------------------------------------
    def note_optimizer_step(self, duration_s: Optional[float] = None) -> int:
        """An optimizer step finished: record progress for the heartbeat, fold ``duration_s`` into the
        step-time average, and return the step this optimizer step belongs to.

        Without user steps, optimizer steps are counted from 0. When the user passes ``step=`` to
        ``log``, the step is the last one they logged plus one: the usual loop logs *after*
        ``optimizer.step()`` (as do the Lightning and transformers callbacks), so that is the step their
        next ``log`` call will carry.
        """
        if not self._user_steps:
            self.step += 1
            step = self.step
        else:
            step = self.step + 1
        self.last_progress_ns = time.time_ns()
        if duration_s is not None and duration_s > 0:
            ewma = self.step_time_ewma
            self.step_time_ewma = duration_s if ewma == 0.0 else 0.9 * ewma + 0.1 * duration_s
        return step

    def add_exception_enricher(self, enricher: ExceptionEnricher) -> None:
        """Register ``enricher(exc) -> {key: text}``, merged into ExceptionEvent.context (e.g. OOM stats)."""
        self._enrichers.append(enricher)

    # --- rare events ----------------------------------------------------------------------------
    def capture_event(self, kind: str, payload: Mapping[str, Any], severity: str = "INFO",
                      step: Optional[int] = None, urgent: bool = False) -> str:
        """Queue a fully built payload of ``kind``; returns its event_id ("" when it was dropped).

        Rare events have ``queue_reserve_events`` of room beyond ``max_queue_events`` that metrics cannot
        take; beyond that they are dropped too (counted as ``queue_full``), so the queue stays bounded
        whatever the backend does. The lifecycle start and exit events always fit (one each).
        """
        if len(self._queue) >= self._max_rare and (kind != "lifecycle" or self._max_queue == 0):
            self.stats.door_drop()
            warn_once("queue_full:rare", f"the SDK's queue is full ({self._max_rare} events: the backend "
                                         f"is slow or unreachable); dropping {kind} events (counted)")
            return ""
        event = ev.envelope(self._base, kind, payload, step=self.step if step is None else step,
                            time_unix_nano=time.time_ns(), severity=severity)
        if urgent:
            try:
                self._write_event_ahead(event)
            except Exception as exc:  # best effort: the event itself is still queued
                warn_once(f"write-ahead:{type(exc).__name__}", f"could not write a {kind} event ahead: {exc}")
        self._queue.append((K_EVENT, event))
        if urgent or len(self._queue) >= self._wake_at:
            self.worker.wake()
        return str(event["event_id"])

    def capture_exception(self, exc: BaseException, *, handled: bool, mechanism: str,
                          severity: Optional[str] = None) -> Optional[str]:
        """Queue an ExceptionEvent for ``exc`` (once per exception object); returns its event_id."""
        try:
            if getattr(exc, _CAPTURED_ATTR, False):
                return None
            setattr(exc, _CAPTURED_ATTR, True)
        except Exception:  # exceptions with __slots__ or read-only attributes
            pass
        payload = self._exception_payload(exc, handled, mechanism)
        sev = severity or ("ERROR" if handled else "CRITICAL")
        return self.capture_event("exception", payload, severity=sev, urgent=True)

    def _exception_payload(self, exc: BaseException, handled: bool, mechanism: str) -> Dict[str, Any]:
        opts = self.options
        payload: Dict[str, Any] = {
            "type": fp.exception_type_name(type(exc)),
            "message": ev.safe_str(fp.exception_message(exc), opts.max_string_length),
            "handled": handled, "mechanism": mechanism,
            "thread": threading.current_thread().name,
        }
        try:
            text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
            payload["traceback"] = ev.safe_str(text, opts.max_traceback_chars)
        except Exception:
            pass
        try:
            # fingerprint the whole exception (equal to fingerprinting its printed text); ship only the
            # innermost max_frames frames, with the hints re-indexed to them
            frames = fp.frames_from_traceback(exc.__traceback__)
            print_ = fp.fingerprint(payload["type"], fp.exception_message(exc), frames).to_dict()
            offset = max(0, len(frames) - opts.max_frames)
            print_["hints"] = [dict(h, frame_index=h["frame_index"] - offset) for h in print_["hints"]
                               if h["frame_index"] >= offset]
            print_["message_template"] = ev.safe_str(print_["message_template"], opts.max_string_length)
            payload["frames"] = [frame_dict(f) for f in frames[offset:]]
            payload.update(print_)
            payload["chain"] = _chain(exc, opts.max_frames)
        except Exception as err:  # a fingerprint bug must not lose the exception itself
            warn_once("fingerprint", f"could not fingerprint {payload['type']}: {err}")
        context: Dict[str, str] = {}
        for enricher in list(self._enrichers):
            try:
                extra = enricher(exc)
            except Exception:
                continue
            if extra:
                context.update(ev.string_map(extra, opts.max_traceback_chars))
        if context:
            payload["context"] = context
        # filled in by drain(), in queue order, so metrics logged just before the error are included
        payload["recent_metrics"] = None
        return payload

    def recent_metrics(self) -> List[Tuple[str, int, float]]:
        """The last values of every metric, (name, step, value), oldest first per metric."""
        out: List[Tuple[str, int, float]] = []
        try:
            for name, values in list(self._history.items()):
                out.extend((name, step, value) for step, value in list(values))
        except RuntimeError:  # mutated by the worker while we read; the context is best-effort
            pass
        return out

    def capture_lifecycle_start(self) -> None:
        """The START event: argv, versions, tags, config, the launcher's identity (not in a forked child)."""
        if self.forked_child:
            return
        torch_mod = sys.modules.get("torch")
        tags = dict(self.identity.tags)
        tags.update(self.options.tags)
        tags["launcher"] = self.identity.launcher
        payload: Dict[str, Any] = {
            "phase": "START", "argv": [ev.safe_str(a, 1024) for a in sys.argv[:64]],
            "python": platform.python_version(), "tags": ev.string_map(tags),
            "config": ev.string_map(self.options.config),
        }
        if torch_mod is not None:
            payload["torch"] = str(getattr(torch_mod, "__version__", ""))
            cuda = getattr(getattr(torch_mod, "version", None), "cuda", None)
            if cuda:
                payload["cuda"] = str(cuda)
        # urgent: sent (and written ahead) at once, so that a run killed in its first seconds still says
        # what it was (argv, versions, tags, config)
        self.capture_event("lifecycle", payload, step=max(self.step, 0), urgent=True)

    def capture_lifecycle_exit(self, exit_code: int, signal_number: int, reason: str) -> None:
        """The EXIT event with the exit code (128+n when killed by signal n) and the SDK's counters; not in a
        forked child (a DataLoader worker terminated at shutdown is not the rank exiting)."""
        if self.forked_child:
            return
        payload = {"phase": "EXIT", "exit_code": exit_code, "signal": signal_number, "reason": reason,
                   "sdk_stats": self.stats_snapshot()}
        severity = "INFO" if exit_code == 0 else "ERROR"
        self.capture_event("lifecycle", payload, severity=severity, urgent=True)

    # --- worker side ----------------------------------------------------------------------------
    def pending(self) -> int:
        return len(self._queue) + self._reader.pending()

    def tick(self) -> None:
        """Heartbeat when due (runs on the worker thread; never in a forked child: see forked_child)."""
        interval = self.options.heartbeat_interval
        if interval <= 0 or self.forked_child:
            return
        now = time.monotonic()
        if now < self._next_heartbeat:
            return
        self._next_heartbeat = now + interval
        sdk_stats = self.stats_snapshot()
        device_wait = self._reader.waiting_s()
        if device_wait >= DEVICE_WAIT_REPORT_S:  # alive, but the device has not computed the last values
            sdk_stats["device_wait_s"] = round(device_wait, 3)
        self.capture_event("heartbeat", {
            "last_step": self.step, "last_step_time_unix_nano": self.last_progress_ns,
            "step_time_ewma_s": self.step_time_ewma, "uptime_s": time.time() - self.started_at,
            "sdk_stats": sdk_stats})

    def drain(self, max_events: int) -> List[Dict[str, Any]]:
        """Pop up to ``max_events`` queue items and build their envelopes (worker thread)."""
        queue = self._queue
        items: List[Tuple[Any, ...]] = []
        with self._hand_lock:  # see _recent_so_far: a popped item is in hand until it is in _history
            try:
                while len(items) < max_events:
                    items.append(queue.popleft())
            except IndexError:
                pass
            self._in_hand = {id(item): item for item in items if item[0] == K_METRICS}
        try:
            return self._build(items)
        finally:
            self._in_hand = {}  # what is left waits for the device (no host value in it) or was dropped

    def _build(self, items: List[Tuple[Any, ...]]) -> List[Dict[str, Any]]:
        """The envelopes of popped ``items`` and of device values read back since; folds the metric values
        into the recent history (worker thread)."""
        self.stats.drained += len(items)
        reader = self._reader
        if not items and not reader.pending():
            return []
        host: List[Tuple[Any, ...]] = []
        device: List[Tuple[Any, ...]] = []
        for item in items:
            (device if _on_device(item) else host).append(item)
        if device:  # read back on the reader's thread: a stuck device stream must not stop this one
            dropped = reader.submit(device)
            if dropped:
                self.stats.drop("device_stalled", dropped)
        ready: List[Tuple[Any, ...]] = []
        if reader.pending():
            final = self._final or self.worker.flushing
            ready = reader.collect(FINAL_DEVICE_READ_WAIT_S if final else DEVICE_READ_WAIT_S)
        items = ready + read_back(host)
        out: List[Dict[str, Any]] = []
        for item in items:
            if item[0] == K_EVENT:
                out.append(self._complete_event(item[1]))
                continue
            if item[3] is None:  # a vector whose tensor could not be read back
                self.stats.drop("encode_error", 1)
                continue
            try:
                out.append(self._metrics_envelope(item))
            except Exception as exc:
                self.stats.drop("encode_error")
                warn_once(f"encode:{type(exc).__name__}", f"could not encode metrics: {exc}")
        return out

    def _complete_event(self, event: Dict[str, Any]) -> Dict[str, Any]:
        """Worker-side completion of a rare event: an exception's recent metric values."""
        exc = event.get("exception")
        if exc is not None and "recent_metrics" in exc and exc["recent_metrics"] is None:
            recent = self.recent_metrics()
            if recent:
                exc["recent_metrics"] = ev.recent_points(recent)
            else:
                del exc["recent_metrics"]
        return event

    def _metrics_envelope(self, item: Tuple[Any, ...]) -> Dict[str, Any]:
        _, step, t_ns, values, mark = item
        alert = alert_of(values)
        recent = self.recent_metrics() if alert else ()
        keep = self.options.recent_metrics
        history = self._history
        with self._hand_lock:  # from the hand into the history at one moment (see _recent_so_far)
            for name, value in values.items():
                series = history.get(name)
                if series is None:
                    series = history[name] = deque(maxlen=keep)
                series.append((step, value))
            self._in_hand.pop(id(item), None)
        payload = ev.metrics_payload(values, alert=alert, recent=recent)
        return ev.envelope(self._base, "metrics", payload, step=step, time_unix_nano=t_ns,
                           severity="ERROR" if alert else "INFO",
                           event_id=mark if type(mark) is str else None)

    # --- lifecycle ------------------------------------------------------------------------------
    def flush(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s for delivery of everything queued; True if all was acknowledged."""
        return self.worker.flush(timeout)

    def close(self, timeout: float) -> bool:
        """Deliver or spool everything within ``timeout`` and stop the worker; True if it finished.

        From here on, new events are dropped at the door (counted as ``queue_full``). Whatever the worker
        could not settle (it was abandoned, or a device read-back never came back) is counted as
        ``dropped.shutdown``, so that afterwards ``sent + spooled + dropped == logged`` exactly.
        """
        self._final = True
        self._max_queue = 0
        finished = self.worker.close(timeout)
        left = self.accounting()["queued"]
        if left > 0:
            self.stats.drop("shutdown", left)
        if self.home is not None:
            if not self.forked_child:
                fatal.disable()
            self.home.close()  # what is left in it (spooled, unsettled) waits there for the next process
        return finished

    def accounting(self) -> Dict[str, int]:
        """Where every event went: ``logged == sent + spooled + dropped + queued``.

        ``logged``: events produced (queued, taken by the worker, or dropped at the door; plus any an
        earlier process left in the spool); ``sent``: acknowledged by the backend; ``spooled``: held in the
        spool now; ``dropped``: given up on (all reasons, counted in ``stats.dropped``); ``queued``: not
        settled yet (in the queue, waiting for a device read-back, or in flight). 0 after :meth:`close`.
        """
        stats = self.stats
        logged = stats.drained + stats.dropped["queue_full"] + len(self._queue)
        sent, spooled, dropped = stats.sent, stats.spooled, stats.dropped_total
        return {"logged": logged, "sent": sent, "spooled": spooled, "dropped": dropped,
                "queued": logged - sent - spooled - dropped}

    def stats_snapshot(self) -> Dict[str, float]:
        """The counters reported in heartbeats and the exit event, with ``logged`` and ``queued``."""
        out = self.stats.snapshot()
        accounting = self.accounting()
        out["logged"] = float(accounting["logged"])
        out["queued"] = float(accounting["queued"])
        return out

    def after_fork_in_child(self) -> None:
        """Called in a forked child (DataLoader workers): fresh queue, identity pid, worker and spool, for
        what the user logs or captures in it; no heartbeats or lifecycle events (:attr:`forked_child`)."""
        self._pid = os.getpid()
        self._queue = deque()
        self._in_hand = {}
        self._hand_lock = threading.Lock()  # the parent's worker may have held it at the fork
        self.identity = identity_mod.RunIdentity(**{**self.identity.__dict__, "pid": self._pid})
        self._base = self._envelope_base()
        if self.home is not None:  # a directory of its own, claimed when first needed
            self.home.forget_in_child(*self._home_name())
        self._transport = None  # the parent's connection is not ours to use
        self._reader.reset()
        self.worker.reset_after_fork()
        self.worker.start()


def _on_device(item: Tuple[Any, ...]) -> bool:
    """Whether reading ``item``'s values back waits for a device (a non-CPU tensor among them)."""
    if item[0] == K_VECTOR:
        device = getattr(item[4], "device", None)
        return device is not None and getattr(device, "type", "cpu") != "cpu"
    if item[0] != K_METRICS or item[3] is None:
        return False
    for value in item[3].values():
        if type(value) is not float and type(value) is not int:
            device = getattr(value, "device", None)
            if device is not None and getattr(device, "type", "cpu") != "cpu":
                return True
    return False


def alert_of(values: Mapping[str, Any]) -> str:
    """The alert of a metric batch: ``non_finite:<first non-finite name>``, or "" -- also for a non-finite
    gradient on a step the GradScaler skips (``amp/overflow`` 1: a routine fp16 overflow)."""
    alert = ""
    for name, value in values.items():
        if not math.isfinite(value):
            alert = f"non_finite:{name}"
            break
    if alert.startswith("non_finite:grad/") and values.get("amp/overflow") == 1.0:
        alert = ""
    return alert


def _chain(exc: BaseException, max_frames: int) -> List[Dict[str, Any]]:
    """Causes and contexts of ``exc``, outermost first (the order Python prints them)."""
    chain: List[Dict[str, Any]] = []
    seen = {id(exc)}
    current: Optional[BaseException] = exc
    while current is not None and len(chain) < 16:
        if current.__cause__ is not None:
            nxt, relation = current.__cause__, "cause"
        elif current.__context__ is not None and not current.__suppress_context__:
            nxt, relation = current.__context__, "context"
        else:
            break
        if id(nxt) in seen:
            break
        seen.add(id(nxt))
        frames = fp.frames_from_traceback(nxt.__traceback__)[-max_frames:]
        chain.append({"type": fp.exception_type_name(type(nxt)),
                      "message": ev.safe_str(fp.exception_message(nxt), 2048),
                      "relation": relation, "frames": [frame_dict(f) for f in frames]})
        current = nxt
    chain.reverse()
    return chain
