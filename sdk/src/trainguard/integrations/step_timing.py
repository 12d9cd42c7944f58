"""Where a step's time goes, per rank, from host clocks only: no device call, no extra sync.

:class:`StepTimer` is driven by ``watch()`` (:mod:`.torch`): a forward pre-hook and a forward hook on the
watched module, the end-of-backward callback ``watch()`` already queues, and the step boundary. At each
boundary it returns, beside ``time/step_s`` (boundary to boundary):

* ``time/data_s`` -- the time blocked fetching the batch: from the previous boundary to the first forward
  of this step (the DataLoader's ``next()``, the host-to-device copy, ``zero_grad``), or, when the batches
  come through :func:`timed_batches`, exactly the time spent inside the iterator's ``__next__``;
* ``time/forward_s`` -- inside the module's forward (every forward of the step: gradient accumulation);
* ``time/backward_s`` -- from the end of the first forward to the end of the last backward, less the
  other forwards: backward compute **and**, under DDP, the wait for the gradient all-reduce (where a fast
  rank waits for a straggler);
* ``time/backward_wait_s`` -- the tail of the backward after the rank's own gradients were computed: from
  the last gradient of ``watch()``'s sentinel parameters (the first parameter of the model's first layer
  among them, whose gradient the backward computes last) to the end of the backward. Under DDP this is the
  wait for the gradient all-reduce to finish -- where a fast rank waits for a straggler -- so
  ``backward_s - backward_wait_s`` is the rank's own backward compute. Reported only when a sentinel's
  gradient was seen between the forward and the end of the backward;
* ``time/optimizer_s`` -- from the end of the backward to the boundary (clipping, ``optimizer.step``);
* ``time/runqueue_s`` -- Linux only: how long the training thread (the one that runs the step boundary) was
  runnable but waiting for a core since the previous boundary (the kernel's run-queue delay, field 2 of
  ``/proc/thread-self/schedstat``, read at each boundary). CPU contention -- a co-tenant process on the
  rank's core, a rank pinned to a busy core -- shows here; a rank that is slow in its own work (a slower
  device, more compute, a CPU-bound loader on the same thread) does not wait for a core and shows ~0.
  Not reported on the first boundary, after the boundary moved to another thread (or process: a fork),
  elsewhere than Linux, or when the kernel does not account it (schedstat reads all zeros).

The first three phases hold no collective in a plain DDP loop (the forward of a module without buffers,
the loader, the optimizer), so they are a rank's *own* time: the engine compares them across ranks to
name a straggler (``perf/straggler``), and the data share to find a loader bottleneck. On CUDA, host
times of asynchronous kernels are launch times until something waits for the device (``loss.item()``,
the all-reduce finaliser): a slow GPU then shows in the phase that waits (and the backward's tail holds
the device's queued backward work as well as the all-reduce). A phase whose marks are missing
(no forward hook ran: the model was called outside the watched module) is not reported.

Cost: two ``perf_counter`` calls per forward and a few float operations per step (measured by
``bench/sdk_overhead.py``); nothing is allocated per step but the metric values. The run-queue delay is one
``pread`` of a file descriptor kept open on the thread's schedstat (~1.2 us of CPU per step on the 2-core VM;
opening the file per read costs 7-13 us) plus a thread-id check. Never raises, never blocks (procfs).
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any, Dict, Generic, Iterable, Iterator, Optional, TypeVar

T = TypeVar("T")

DATA_S = "time/data_s"
FORWARD_S = "time/forward_s"
BACKWARD_S = "time/backward_s"
BACKWARD_WAIT_S = "time/backward_wait_s"
OPTIMIZER_S = "time/optimizer_s"
RUNQUEUE_S = "time/runqueue_s"
PHASES = (DATA_S, FORWARD_S, BACKWARD_S, BACKWARD_WAIT_S, OPTIMIZER_S)


class RunQueueClock:
    """The calling thread's cumulative run-queue delay (seconds runnable but not running), from a file
    descriptor kept open on its ``/proc/thread-self/schedstat`` and re-read with ``pread`` (Linux). The
    descriptor belongs to the thread that opened it: a read from another thread (or from a forked child,
    whose thread id differs) reopens it for that thread and starts over. After a failure to open, it stays
    off (``read()`` returns None). Never raises."""

    __slots__ = ("_fd", "_off", "_tid")

    def __init__(self) -> None:
        self._fd = -1
        self._tid = -1
        self._off = not hasattr(os, "pread")

    def read(self) -> Optional[float]:
        """Cumulative run-queue delay of the calling thread in seconds; None when unknown. The second
        value returned after a thread change is the first that a caller may difference."""
        if self._off:
            return None
        try:
            tid = threading.get_native_id()
            if tid != self._tid:
                self.close()
                self._fd = os.open("/proc/thread-self/schedstat", os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
                self._tid = tid
            fields = os.pread(self._fd, 96, 0).split(None, 2)
            if fields[0] == b"0":  # the kernel does not account it (sched_info off): all zeros
                return None
            return int(fields[1]) * 1e-9
        except Exception:  # no procfs, the thread's entry gone, an odd line
            self.close()
            self._off = True
            return None

    @property
    def thread(self) -> int:
        """The native id of the thread whose delay was last read (-1: none)."""
        return self._tid

    def close(self) -> None:
        fd, self._fd, self._tid = self._fd, -1, -1
        if fd >= 0:
            try:
                os.close(fd)
            except OSError:
                pass

    def __del__(self) -> None:  # a watch dropped without remove(): its descriptor does not leak
        try:
            self.close()
        except Exception:  # interpreter shutdown
            pass


class StepTimer:
    """Phase marks of the current step (one per watched module). Called on the training thread only."""

    __slots__ = ("_backward_end", "_first_forward", "_forward_end", "_forward_s", "_forward_start",
                 "_grad_last", "_loader_used", "_loader_wait", "_rq_last", "_rq_thread", "_runqueue")

    def __init__(self, runqueue: bool = True) -> None:
        self._first_forward = 0.0   #: perf_counter at the first forward of this step (0: none yet)
        self._forward_start = 0.0   #: start of the forward in progress
        self._forward_end = 0.0     #: end of the first forward of the step
        self._forward_s = 0.0       #: summed forward time of the step
        self._backward_end = 0.0    #: end of the last backward of the step
        self._grad_last = 0.0       #: the last sentinel gradient of the step (its own backward done)
        self._loader_wait = 0.0     #: time inside timed_batches' __next__ since the last boundary
        self._loader_used = False   #: timed_batches fed this step
        self._runqueue: Optional[RunQueueClock] = RunQueueClock() if runqueue else None
        self._rq_last = -1.0        #: the boundary thread's run-queue delay at the previous boundary
        self._rq_thread = -1        #: ... and that thread's native id

    # --- marks ---------------------------------------------------------------------------------
    def forward_start(self, *_args: Any) -> None:
        now = time.perf_counter()
        self._forward_start = now
        if not self._first_forward:
            self._first_forward = now

    def forward_end(self, *_args: Any) -> None:
        start = self._forward_start
        if start:
            now = time.perf_counter()
            self._forward_s += now - start
            self._forward_start = 0.0
            if not self._forward_end:
                self._forward_end = now

    def backward_end(self) -> None:
        self._backward_end = time.perf_counter()

    def grad_ready(self) -> None:
        """A sentinel parameter's gradient was accumulated (the latest one marks the end of the rank's
        own backward compute)."""
        self._grad_last = time.perf_counter()

    def loader_wait(self, seconds: float) -> None:
        """:func:`timed_batches` spent ``seconds`` inside the iterator's ``__next__``."""
        self._loader_wait += seconds
        self._loader_used = True

    # --- the boundary ----------------------------------------------------------------------------
    def phases(self, previous: float, now: float) -> Dict[str, float]:
        """The phases of the step that ran from ``previous`` to ``now`` (perf_counter values; previous 0:
        the first step, whose data wait is unknown), with the calling thread's run-queue delay since the
        previous boundary (``time/runqueue_s``, when known), and reset for the next step."""
        out: Dict[str, float] = {}
        first, fwd_end, bwd_end = self._first_forward, self._forward_end, self._backward_end
        if first and fwd_end:
            if self._loader_used:
                out[DATA_S] = self._loader_wait
            elif previous and first >= previous:
                out[DATA_S] = first - previous
            out[FORWARD_S] = self._forward_s
            if bwd_end > fwd_end:
                out[BACKWARD_S] = max(0.0, bwd_end - first - self._forward_s)
                if fwd_end < self._grad_last <= bwd_end:
                    out[BACKWARD_WAIT_S] = min(bwd_end - self._grad_last, out[BACKWARD_S])
                if now >= bwd_end:
                    out[OPTIMIZER_S] = now - bwd_end
        clock = self._runqueue
        if clock is not None:
            delay = clock.read()
            if delay is not None:
                if self._rq_last >= 0.0 and previous and clock.thread == self._rq_thread:
                    out[RUNQUEUE_S] = max(0.0, delay - self._rq_last)
                self._rq_last, self._rq_thread = delay, clock.thread
            else:
                self._rq_last = -1.0
        self._first_forward = self._forward_start = self._forward_end = 0.0
        self._forward_s = self._loader_wait = 0.0
        self._backward_end = self._grad_last = 0.0
        self._loader_used = False
        return out

    def close(self) -> None:
        """Close the run-queue clock's descriptor (``watch``'s ``remove()``). Idempotent."""
        if self._runqueue is not None:
            self._runqueue.close()
            self._runqueue = None


_timers_lock = threading.Lock()
_current: Optional[StepTimer] = None


def set_current(timer: Optional[StepTimer], only_if: Optional[StepTimer] = None) -> None:
    """Make ``timer`` the one :func:`timed_batches` reports to (the last ``watch()``'s; None: nobody's);
    with ``only_if``, only when that one is the current timer (a removed watch clears only its own)."""
    global _current
    with _timers_lock:
        if only_if is None or _current is only_if:
            _current = timer


def current() -> Optional[StepTimer]:
    return _current


class timed_batches(Generic[T]):  # used like a function: for batch in timed_batches(loader)
    """Iterate ``iterable`` and report the time blocked in each ``__next__`` as the step's data wait
    (``time/data_s``) of the current ``watch()``; without a watch it is a plain pass-through. Never
    raises anything the iterable itself does not."""

    def __init__(self, iterable: Iterable[T]) -> None:
        self._iterable = iterable

    def __iter__(self) -> Iterator[T]:
        iterator = iter(self._iterable)
        clock = time.perf_counter
        while True:
            started = clock()
            try:
                item = next(iterator)
            except StopIteration:
                return
            timer = _current
            if timer is not None:
                timer.loader_wait(clock() - started)
            yield item

    def __len__(self) -> int:
        return len(self._iterable)  # type: ignore[arg-type]
