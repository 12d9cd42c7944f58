"""Worker processes that run the detection pipelines of a partitioned queue's partitions (issue 15).

The processor process (processor/embedded.py) keeps the queue, the stores, snapshots and everything else;
each of ``W`` workers hosts the real :class:`~trainguard_engine.pipeline.Pipeline` of the partitions
``p`` with ``p % W`` its index, and a :class:`RemotePipeline` stands for each in the processor. A chunk's
partitions are sent to their workers first and gathered after (:meth:`PipelinePool.process`), so the
workers run in parallel; a worker gets a partition's record values (bytes) and reads them itself
(decode.read_request), so nothing decoded crosses the pipe but the pipelines' outputs.

Exactness: the pipeline is deterministic (no clock, no randomness) and a partition's state is the stored
snapshot (``PARTITION_PREFIX``) plus what was handed to it since that snapshot was saved. The pool keeps
that second part -- per partition, the operations since its last :meth:`PipelinePool.saved` (record values
processed, ``advance`` times, ``changed_parts`` calls) -- so when a worker dies (killed, out of memory) or a
call fails half-way, the pool is *broken*: the call raises :class:`PoolFailed` (the processor's round fails
as for an unavailable store and is retried) and the next call first rebuilds every partition -- dead
workers started again, each pipeline restored from the store and fed its logged operations again (their
outputs dropped: the processor already holds them) -- so the state ends exactly as without the failure.

Workers are started with the ``spawn`` context (the server has threads: never fork it), ignore SIGINT and
SIGTERM (the processor stops them, after its drain), and exit when their pipe closes: a worker never
outlives the processor process.
"""

from __future__ import annotations

import atexit
import gc
import logging
import multiprocessing
import signal
import time
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any, Callable, Dict, List, Mapping, NamedTuple, Optional, Sequence, Tuple, TypeVar

from trainguard_engine.catalogue import DetectionSettings
from trainguard_engine.pipeline import Pipeline, PipelineOutput, Quarantined, merge_outputs

log = logging.getLogger("trainguard.processor")

ISOLATE_AFTER = 2
"""Chunks in a row whose pool call failed (a worker died) before the next is run one run at a time
(:meth:`PipelinePool.process_runs`): a run whose records kill its worker every time (its state grown past
memory, a bug it triggers) is then found and left out, and every other run goes on (hR's F8 of stop 46)."""
STRIKES = 2
"""Calls of a run, alone and each after a fresh rebuild, that must fail before
:meth:`PipelinePool.process_runs` blames it: one failure may be another cause's (the OOM killer, a worker's
MemoryError) -- hR2's G1."""
STOP_TIMEOUT_S = 5.0
POLL_S = 0.1
"""How often a wait for a worker's reply looks at :attr:`PipelinePool.deadline` (set while stopping)."""
"""How long :meth:`PipelinePool.close` waits for a worker to exit after asking it to (then it is killed)."""

Parts = Dict[str, Optional[bytes]]
RunKey = TypeVar("RunKey")  # how process_runs's caller names a run (hashable)
Op = Tuple[Any, ...]  # ("process", records) | ("advance", now_ns) | ("changed",): a partition's logged call
CHANGED: Op = ("changed",)
"""A logged ``changed_parts`` call. Two in a row leave the pipeline as one does (the second assigns no new
sequence numbers and encodes no rank again), so the log keeps one: a checkpoint failing every round (a store
down) would otherwise add one per partition per retry, each replayed by a rebuild (hR's M1 of stop 47)."""
JobRecord = bytes
"""A record for a worker: its queue value (the worker reads it itself; map fields read in sorted key order in
any process: trainguard.wire)."""


class PoolFailed(RuntimeError):
    """A worker died or a call failed in it: the pool rebuilds its partitions before its next call."""


@dataclass
class Info:
    """What a worker reports of a partition's pipeline after each call (read without asking it)."""

    next_timer_ns: int = 0
    counters: Dict[str, int] = field(default_factory=dict)
    quota_evictions: Dict[Tuple[str, str], int] = field(default_factory=dict)
    quarantined: List[Quarantined] = field(default_factory=list)


# --- the worker's side -------------------------------------------------------------------------------
class _Host:
    """A worker's pipelines, by partition, and the calls it answers."""

    def __init__(self, settings: DetectionSettings) -> None:
        from .rank_parts import RankParts

        self.settings = settings
        self.pipelines: Dict[int, Pipeline] = {}
        self.splitters: Dict[int, RankParts] = {}
        self._splitter = RankParts

    def info(self, partition: int) -> Info:
        pipeline = self.pipelines[partition]
        return Info(pipeline.next_timer_ns, dict(pipeline.counters), dict(pipeline.quota_evictions),
                    pipeline.take_quarantined())

    def build(self, partition: int, stored: Mapping[str, bytes]) -> Info:
        """``partition``'s pipeline from its stored parts (none: empty; unreadable: empty, logged)."""
        splitter = self.splitters[partition] = self._splitter()
        try:
            pipeline = (Pipeline.restore_parts(splitter.from_store(stored), self.settings) if stored
                        else Pipeline(self.settings))
        except Exception as exc:  # as EmbeddedProcessor._restore: the stores keep the history
            log.error("pipeline snapshot of partition %d unreadable (%s); starting from an empty state",
                      partition, exc)
            pipeline = Pipeline(self.settings)
        self.pipelines[partition] = pipeline
        return self.info(partition)

    def process(self, jobs: Sequence[Tuple[int, Sequence[JobRecord]]]) -> List[Tuple[PipelineOutput, Info]]:
        from .decode import read_request

        out = []
        for partition, records in jobs:
            envelopes: List[Any] = []
            points: List[Any] = []
            for record in records:
                try:
                    decoded, decoded_points = read_request(record)
                except Exception:  # the processor counted and logged it (its own decode failed too)
                    continue
                envelopes.extend(decoded)
                points.extend(decoded_points)
            pipeline = self.pipelines[partition]
            output = pipeline.process(envelopes, points) if envelopes else PipelineOutput()
            out.append((output, self.info(partition)))
        return out

    def advance(self, partitions: Sequence[int], now_ns: int) -> List[Tuple[PipelineOutput, Info]]:
        return [(self.pipelines[p].advance(now_ns), self.info(p)) for p in partitions]

    def changed(self, partitions: Sequence[int]) -> List[Tuple[Parts, Info]]:
        return [(self.splitters[p].to_store(self.pipelines[p].changed_parts()), self.info(p))
                for p in partitions]

    def saved(self, partitions: Sequence[int]) -> None:
        for p in partitions:
            self.pipelines[p].parts_saved()
            self.splitters[p].saved()

    def drop(self, partitions: Sequence[int]) -> None:
        for p in partitions:
            self.pipelines.pop(p, None)
            self.splitters.pop(p, None)

    def runs(self, partition: int) -> Any:
        return self.pipelines[partition].runs()

    def replay(self, partition: int, ops: Sequence[Op]) -> Info:
        """``partition``'s logged operations again (after :meth:`build`), outputs dropped."""
        for op in ops:
            if op[0] == "process":
                self.process([(partition, op[1])])
            elif op[0] == "advance":
                self.pipelines[partition].advance(op[1])
            else:
                self.pipelines[partition].changed_parts()
        return self.info(partition)


def serve(conn: Connection, settings: DetectionSettings, pause_gc: bool, gc_threshold: int) -> None:
    """A worker's loop: answer ``(call, *args)`` with ``("ok", result)`` or ``("error", text)`` until
    ``("stop",)`` or until the pipe closes (the processor process ended)."""
    from .embedded import tune_gc

    signal.signal(signal.SIGINT, signal.SIG_IGN)   # the processor stops its workers after its drain
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    tune_gc(gc_threshold)
    host = _Host(settings)
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        if message[0] == "stop":
            conn.send(("ok", None))
            return
        paused = pause_gc and gc.isenabled()
        if paused:  # as in the processor's rounds, the collector rests during a call (GC_GEN0_THRESHOLD)
            gc.disable()
        try:
            reply: Tuple[str, Any] = ("ok", getattr(host, message[0])(*message[1:]))
        except Exception:
            reply = ("error", traceback.format_exc(limit=8))
        finally:
            if paused:
                gc.enable()
        try:
            conn.send(reply)
        except (EOFError, OSError):
            return


# --- the processor's side ----------------------------------------------------------------------------
class RemotePipeline:
    """Stands in the processor for a partition's pipeline hosted by a worker: what the processor reads
    between calls (timers, counters, quota evictions, quarantined runs), as last reported."""

    def __init__(self, pool: PipelinePool, partition: int, info: Info) -> None:
        self.pool = pool
        self.partition = partition
        self._quarantined: List[Quarantined] = []
        self.update(info)

    def update(self, info: Info) -> None:
        self.next_timer_ns = info.next_timer_ns
        self.counters = info.counters
        self.quota_evictions = info.quota_evictions
        self._quarantined.extend(info.quarantined)

    def take_quarantined(self) -> List[Quarantined]:
        out, self._quarantined = self._quarantined, []
        return out

    def runs(self) -> Any:
        """The pipeline's run records (asks the worker)."""
        return self.pool.call_one(self.partition, "runs", self.partition)


class Started(NamedTuple):
    """Jobs sent to the workers (:meth:`PipelinePool.start`): what :meth:`PipelinePool.collect` reads."""

    jobs: Sequence[Tuple[int, List[JobRecord]]]
    per: Dict[int, List[Tuple[int, List[JobRecord]]]]
    sending: Tuple[List[int], List[str]]


class _Worker:
    """One worker process and the processor's end of its pipe."""

    def __init__(self, context: Any, index: int, args: Tuple[Any, ...]) -> None:
        self.conn, child = context.Pipe()
        self.process = context.Process(target=serve, args=(child, *args), daemon=True,
                                       name=f"trainguard-pipeline-{index}")
        self.process.start()
        child.close()  # the worker's end lives in the worker only: its death is EOF here
        self.waiting = 0  # replies sent for and not read (left by an interrupted call: out of step)

    def send(self, *message: Any) -> None:
        self.conn.send(message)
        self.waiting += 1

    def receive(self, deadline: Callable[[], Optional[float]]) -> Any:
        """The next reply; raises :class:`PoolFailed` when ``deadline()`` (time.monotonic()) passes first."""
        while not self.conn.poll(POLL_S):
            until = deadline()
            if until is not None and time.monotonic() >= until:
                raise PoolFailed(f"pipeline worker {self.process.name} did not answer in time (hung?)")
        status, result = self.conn.recv()
        self.waiting -= 1
        if status != "ok":
            raise PoolFailed(f"pipeline worker {self.process.name} failed: {result}")
        return result

    def stop(self) -> None:
        try:
            self.send("stop")
            if self.conn.poll(STOP_TIMEOUT_S):
                self.conn.recv()
        except (EOFError, OSError):
            pass
        self.process.join(STOP_TIMEOUT_S)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self.conn.close()


class PipelinePool:
    """``workers`` processes hosting the pipelines of the partitions handed to :meth:`build`; ``load(p)``
    reads partition ``p``'s stored snapshot parts (for a rebuild after a failure: module doc)."""

    stop_timeout_s = STOP_TIMEOUT_S

    def __init__(self, workers: int, settings: DetectionSettings,
                 load: Callable[[int], Mapping[str, Optional[bytes]]],
                 *, pause_gc: bool = True, gc_threshold: int = 0, context: str = "spawn",
                 call_timeout_s: float = 0.0) -> None:
        if workers < 1:
            raise ValueError("a pipeline pool needs at least one worker")
        self._context = multiprocessing.get_context(context)
        self._args = (settings, pause_gc, gc_threshold)
        self._load = load
        self.workers: List[_Worker] = [_Worker(self._context, i, self._args) for i in range(workers)]
        self.pipelines: Dict[int, RemotePipeline] = {}
        self._log: Dict[int, List[Op]] = {}  # per partition: its calls since its last saved snapshot
        self._broken = False
        self.rebuilds = 0  # how many times the partitions were rebuilt after a failure
        #: while stopping: when (time.monotonic()) a wait for a worker's reply gives up -- a worker that
        #: hangs fails the call (the pool broken: it is replaced) instead of holding the stop forever;
        #: None: no bound
        self.deadline: Optional[float] = None
        #: > 0: a call whose replies take longer fails as a dead worker's would (the worker, hung, is
        #: replaced; a run that hangs it every time is then found and left out: hR2's G4); 0: no bound
        self.call_timeout_s = max(0.0, float(call_timeout_s))
        # at interpreter exit, before multiprocessing's own hook (registered earlier: run later) SIGTERMs the
        # workers -- which ignore it -- and joins them while their pipes are open here (hR2's G2)
        atexit.register(self._at_exit)

    def _bound(self) -> Callable[[], Optional[float]]:
        """When the waits for a call's replies, from now, give up: the stop's :attr:`deadline` or
        :attr:`call_timeout_s` from now, whichever comes first (None: never)."""
        limit = time.monotonic() + self.call_timeout_s if self.call_timeout_s > 0 else None

        def until() -> Optional[float]:
            stop = self.deadline
            return stop if limit is None else limit if stop is None else min(stop, limit)
        return until

    def _owner(self, partition: int) -> int:
        if not self.workers:
            raise PoolFailed("the pipeline pool is closed (the processor was stopped)")
        return partition % len(self.workers)

    def _gather(self, calls: Mapping[int, Tuple[Any, ...]]) -> Dict[int, Any]:
        """Send each worker index its call, then read every reply (:meth:`_send`, :meth:`_receive`)."""
        return self._receive(self._send(calls))

    def _send(self, calls: Mapping[int, Tuple[Any, ...]]) -> Tuple[List[int], List[str]]:
        """Send each worker index its call (rebuilding the partitions first after a failure): the indices
        sent to and the errors met."""
        if not self.workers:
            raise PoolFailed("the pipeline pool is closed (the processor was stopped)")
        if any(worker.waiting for worker in self.workers):  # a call was interrupted before its replies
            self._broken = True
        self._mend()
        sent: List[int] = []
        errors: List[str] = []
        for index, message in calls.items():
            try:
                self.workers[index].send(*message)
                sent.append(index)
            except (EOFError, OSError, ValueError) as exc:
                errors.append(f"worker {index}: {exc!r}")
        return sent, errors

    def _receive(self, sending: Tuple[List[int], List[str]]) -> Dict[int, Any]:
        """Every reply of a :meth:`_send` (so no reply is left in a pipe); any failure breaks the pool and
        raises :class:`PoolFailed` once all replies are read."""
        sent, errors = sending
        results: Dict[int, Any] = {}
        bound = self._bound()
        for index in sent:
            try:
                results[index] = self.workers[index].receive(bound)
            except (EOFError, OSError, PoolFailed) as exc:
                errors.append(f"worker {index}: {exc!r}")
        if errors:
            self._broken = True
            raise PoolFailed("pipeline worker call failed (partitions are rebuilt from the last snapshot "
                             "before the next call): " + "; ".join(errors))
        return results

    def _by_worker(self, partitions: Sequence[int]) -> Dict[int, List[int]]:
        out: Dict[int, List[int]] = {}
        for p in partitions:
            out.setdefault(self._owner(p), []).append(p)
        return out

    def ready(self) -> None:
        """Wait until every worker answers (started, its imports done)."""
        self._gather({index: ("drop", []) for index in range(len(self.workers))})

    def call_one(self, partition: int, *message: Any) -> Any:
        return self._gather({self._owner(partition): message})[self._owner(partition)]

    def build(self, partition: int, stored: Mapping[str, bytes]) -> RemotePipeline:
        """Host ``partition``'s pipeline, restored from its ``stored`` parts (raw, as the store has them)."""
        info = self.call_one(partition, "build", partition, dict(stored))
        self._log[partition] = []
        pipeline = self.pipelines[partition] = RemotePipeline(self, partition, info)
        return pipeline

    def process(self, jobs: Sequence[Tuple[int, List[JobRecord]]]) -> List[PipelineOutput]:
        """Each ``(partition, records)`` (record values) through its pipeline, the workers in parallel;
        the outputs in the order of ``jobs``."""
        return self.collect(self.start(jobs))

    def process_runs(self, jobs: Sequence[Tuple[int, List[Tuple[RunKey, JobRecord]]]],
                     strikes: int = STRIKES) -> Tuple[List[PipelineOutput], List[RunKey]]:
        """:meth:`process` of ``(partition, [(run key, record), ...])`` jobs one run at a time (a partition's
        runs in the order they first appear, each run's records in order): the outputs per job (merged), and
        the runs whose call failed ``strikes`` times in a row, alone, each time after a fresh rebuild -- their
        records left out (a run whose call fails fewer times goes on: the failure was not its own). A failure
        before a run's call (the rebuild) raises: no run is blamed for it. Slower, and a partition's runs no
        longer interleave within the chunk (only their own order counts for a run; cross-run state --
        clusters, quotas -- may see another order than in the thread): for after :data:`ISOLATE_AFTER`
        failed chunks. All or nothing, as :meth:`process`: should anything else fail part-way (a rebuild
        raising), the runs already through are undone too (:meth:`_undo_from`) before it raises."""
        outputs: List[PipelineOutput] = []
        culprits: List[RunKey] = []
        marks = self._marks([partition for partition, _ in jobs])
        try:
            for partition, records in jobs:
                runs: Dict[RunKey, List[JobRecord]] = {}
                for key, record in records:
                    runs.setdefault(key, []).append(record)
                merged = PipelineOutput()
                for key, mine in runs.items():
                    output = self._run_alone(partition, mine, max(1, strikes))
                    if output is None:
                        culprits.append(key)
                    else:
                        merged = merge_outputs(merged, output)
                outputs.append(merged)
        except BaseException:
            self._undo_from(marks)
            raise
        return outputs, culprits

    def _marks(self, partitions: Sequence[int]) -> Dict[int, Tuple[int, int]]:
        """Where ``partitions``' logs and unreported quarantined runs stand now (for :meth:`_undo_from`)."""
        return {p: (len(self._log[p]), len(self.pipelines[p]._quarantined)) for p in partitions}

    def _undo_from(self, marks: Mapping[int, Tuple[int, int]]) -> None:
        """Forget the calls since ``marks`` (:meth:`_marks`): their outputs never reach the caller, so the
        pipelines are rebuilt without them before the next call, and what they quarantined is dropped (a
        retry reports it) -- hR2's G1: a per-run pass failing part-way left earlier runs' records in the
        pipelines, their retry a replay that emits nothing (incidents lost)."""
        for partition, (logged, quarantined) in marks.items():
            del self._log[partition][logged:]
            del self.pipelines[partition]._quarantined[quarantined:]
        self._broken = True

    def _run_alone(self, partition: int, records: List[JobRecord], strikes: int) -> Optional[PipelineOutput]:
        """``records`` (one run's) through ``partition``'s pipeline, up to ``strikes`` times, each after the
        rebuild the failure before it asks for (:meth:`_mend`: its own failure raises); None: every call
        failed."""
        for _ in range(strikes):
            self._mend()
            try:
                return self.process([(partition, records)])[0]
            except PoolFailed:
                continue
        return None

    def start(self, jobs: Sequence[Tuple[int, List[JobRecord]]]) -> Started:
        """:meth:`process`'s first half: the jobs sent, the workers at them while the caller does other work;
        then :meth:`collect` (or :meth:`abandon`) it, before any other call."""
        per: Dict[int, List[Tuple[int, List[JobRecord]]]] = {}
        for job in jobs:
            per.setdefault(self._owner(job[0]), []).append(job)
        return Started(jobs, per, self._send({i: ("process", mine) for i, mine in per.items()}))

    def abandon(self, started: Started) -> None:
        """Drop a :meth:`start`'s outputs (the caller failed meanwhile): its replies are read, and the
        partitions rebuilt before the next call -- without those records."""
        try:
            self._receive(started.sending)
        except PoolFailed:
            pass
        self._broken = True

    def collect(self, started: Started) -> List[PipelineOutput]:
        """:meth:`process`'s second half: the outputs of a :meth:`start`, in the order of its jobs."""
        jobs, per = started.jobs, started.per
        replies = self._receive(started.sending)
        got: Dict[int, PipelineOutput] = {}
        for index, mine in per.items():
            for (partition, values), (output, info) in zip(mine, replies[index]):
                self.pipelines[partition].update(info)
                self._log[partition].append(("process", values))
                got[partition] = output
        return [got[p] for p, _ in jobs]

    def advance(self, partitions: Sequence[int], now_ns: int) -> List[PipelineOutput]:
        """``advance(now_ns)`` of every one of ``partitions``, in parallel; outputs in their order."""
        return [out for out, _ in self._each(partitions, "advance", ("advance", now_ns), now_ns)]

    def changed(self, partitions: Sequence[int]) -> List[Parts]:
        """Each partition's changed snapshot parts, split for the store (rank_parts), in parallel."""
        return [parts for parts, _ in self._each(partitions, "changed", CHANGED)]

    def _each(self, partitions: Sequence[int], call: str, op: Op, *args: Any) -> List[Tuple[Any, Info]]:
        groups = self._by_worker(partitions)
        replies = self._gather({i: (call, mine, *args) for i, mine in groups.items()})
        got: Dict[int, Tuple[Any, Info]] = {}
        for index, mine in groups.items():
            for partition, reply in zip(mine, replies[index]):
                self.pipelines[partition].update(reply[1])
                logged = self._log[partition]
                if not (op == CHANGED and logged and logged[-1] == CHANGED):
                    logged.append(op)  # (a changed_parts right after another changes nothing: one kept)
                got[partition] = reply
        return [got[p] for p in partitions]

    def saved(self, partitions: Sequence[int]) -> None:
        """The parts of the last :meth:`changed` of ``partitions`` are stored: their logs start afresh (first:
        should this call fail, the rebuild starts from those stored parts)."""
        for p in partitions:
            self._log[p] = []
        self._gather({i: ("saved", mine) for i, mine in self._by_worker(partitions).items()})

    def drop(self, partitions: Sequence[int]) -> None:
        """Stop hosting ``partitions`` (given up: another processor owns them now)."""
        for p in partitions:
            self.pipelines.pop(p, None)
            self._log.pop(p, None)
        if not self._broken:  # a rebuild hosts only what is left
            self._gather({i: ("drop", mine) for i, mine in self._by_worker(partitions).items()})

    def _mend(self) -> None:
        """After a failure: start dead workers again, then every partition restored from the store and fed
        its logged calls (module doc). Raises while that fails (the store unavailable, a worker dying)."""
        if not self._broken:
            return
        for index, worker in enumerate(self.workers):
            if worker.waiting and worker.process.is_alive():  # its pipe is out of step: replaced
                worker.process.kill()
                worker.process.join()
            if not worker.process.is_alive():
                log.error("pipeline worker %s ended (exit code %s); starting it again and rebuilding its "
                          "partitions from the last snapshot", worker.process.name, worker.process.exitcode)
                worker.conn.close()
                worker.process.join()
                self.workers[index] = _Worker(self._context, index, self._args)
        self._broken = False
        try:
            for partition, pipeline in self.pipelines.items():
                stored = {k: v for k, v in self._load(partition).items() if v is not None}
                index = self._owner(partition)
                self._gather({index: ("build", partition, stored)})
                info = self._gather({index: ("replay", partition, self._log[partition])})[index]
                info.quarantined = []  # reported when they first happened
                pipeline.update(info)
        except BaseException:
            self._broken = True
            raise
        self.rebuilds += 1

    def close(self) -> None:
        """Stop every worker (each exits; one that does not within STOP_TIMEOUT_S is killed)."""
        atexit.unregister(self._at_exit)
        for worker in self.workers:
            worker.stop()
        self.workers = []

    def _at_exit(self) -> None:
        """The process exits with the pool not closed (e.g. a server start failing after the processor was
        built): every worker's pipe closed first -- each ends at that EOF, after its call in hand -- then
        reaped (killed after STOP_TIMEOUT_S), so the exit never waits on a worker."""
        for worker in self.workers:
            worker.conn.close()
        for worker in self.workers:
            worker.process.join(STOP_TIMEOUT_S)
            if worker.process.is_alive():
                worker.process.kill()
                worker.process.join()
        self.workers = []
