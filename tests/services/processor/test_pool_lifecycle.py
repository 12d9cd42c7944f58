"""Issue 15: a pipeline worker (processor/pool.py) never outlives the processor process -- it exits when its
pipe closes, also when the processor is killed outright (SIGKILL: no stop, no atexit) -- and a pool's
``close`` leaves no process behind."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import List

import pytest

from trainguard_engine.catalogue import DetectionSettings
from trainguard_server.processor.pool import PipelinePool, PoolFailed

REPO = Path(__file__).resolve().parents[3]

PARENT = """
import os, sys, time
from trainguard_engine.catalogue import DetectionSettings
from trainguard_server.processor.pool import PipelinePool

if __name__ == "__main__":
    pool = PipelinePool(2, DetectionSettings(), lambda partition: {})
    pool.ready()
    print(" ".join(str(w.process.pid) for w in pool.workers), flush=True)
    time.sleep(60)
"""


def _gone(pid: int) -> bool:
    """Exited (a zombie waiting for a reaper counts as exited: it runs nothing)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def test_workers_exit_when_the_processor_is_killed(tmp_path: Path) -> None:
    script = tmp_path / "parent.py"
    script.write_text(PARENT)
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        assert parent.stdout is not None
        pids = [int(p) for p in parent.stdout.readline().split()]
        assert len(pids) == 2 and not any(_gone(pid) for pid in pids)
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        deadline = time.monotonic() + 10
        while not all(_gone(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert all(_gone(pid) for pid in pids), "a pipeline worker outlived its processor"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()


def test_close_leaves_no_process() -> None:
    pool = PipelinePool(2, DetectionSettings(), lambda partition: {})
    pool.build(3, {})
    workers = list(pool.workers)
    pool.close()
    with pytest.raises(PoolFailed, match="closed"):  # a call after close says so
        pool.advance([3], 0)
    for worker in workers:
        assert not worker.process.is_alive() and worker.process.exitcode == 0
        try:  # reaped by close: no zombie
            os.waitpid(worker.process.pid or 0, os.WNOHANG)
            raise AssertionError("the worker was not reaped")
        except ChildProcessError:
            pass


def test_workers_ignore_the_terminal_interrupt() -> None:
    """Ctrl-C reaches the whole process group: the processor drains and stops its workers itself."""
    pool = PipelinePool(1, DetectionSettings(), lambda partition: {})
    try:
        pool.ready()
        os.kill(pool.workers[0].process.pid or 0, signal.SIGINT)
        time.sleep(0.2)
        assert pool.workers[0].process.is_alive()
        pool.build(0, {})  # still answers
    finally:
        pool.close()


NEVER_CLOSED = """
import sys
from trainguard_engine.catalogue import DetectionSettings
from trainguard_server.processor.pool import PipelinePool

if __name__ == "__main__":
    pool = PipelinePool(2, DetectionSettings(), lambda partition: {})
    pool.ready()  # started: SIGTERM (multiprocessing's exit hook) is ignored from here on
    print(" ".join(str(w.process.pid) for w in pool.workers), flush=True)
    raise RuntimeError("a start failing after the processor was built")
"""


def test_the_process_exits_with_a_pool_never_closed(tmp_path: Path) -> None:
    """hR2's G2 (/tmp/hR2/exit_hang2.py): the interpreter's exit closed nothing and joined workers that
    ignore SIGTERM and wait on their open pipe -- forever. The pool's own exit hook closes the pipes first."""
    script = tmp_path / "never_closed.py"
    script.write_text(NEVER_CLOSED)
    child = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                             text=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    pids: List[int] = []
    try:
        assert child.stdout is not None
        pids = [int(p) for p in child.stdout.readline().split()]
        assert child.wait(30) == 1, "the process did not exit"
        assert len(pids) == 2 and all(_gone(pid) for pid in pids)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        for pid in pids:
            if not _gone(pid):
                os.kill(pid, signal.SIGKILL)


def test_a_server_start_failing_after_the_processor_was_built_ends_its_workers(tmp_path: Path) -> None:
    """hR2's G2 (/tmp/hR2/serve_port_race.py): the gRPC port taken when serve binds it, after the processor
    and its workers started -- start raises, and no worker is left (before: left up, the exit then hung)."""
    import socket

    from trainguard_server.config import Settings
    from trainguard_server.server import EmbeddedServer

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    try:
        settings = Settings(data_dir=tmp_path / "data", host="127.0.0.1", http_port=0,
                            grpc_port=taken.getsockname()[1], processor_workers=2)
        server = EmbeddedServer(settings)
        with pytest.raises(OSError, match="cannot bind"):
            server.start()
        assert server.processor is not None and server.processor.pool is not None
        assert server.processor.pool.workers == [] and not server.processor.alive
        assert not [p for p in multiprocessing.active_children() if p.name.startswith("trainguard-pipeline")]
    finally:
        taken.close()


def test_a_hung_worker_does_not_hold_the_stop(tmp_path: Path) -> None:
    """hR2's probe /tmp/hR2/hung_worker_stop.py: a worker that never answers (SIGSTOPped, as a detector stuck
    in a loop) held ``stop(timeout=3)`` forever (the processor thread in its recv, holding the round lock). A
    wait for a reply now gives up at the stop's deadline: the worker is replaced for the checkpoint, then
    ended; nothing it did not answer for is committed -- a restart reports the run's explosion once."""
    import threading

    from tests.scenarios.corpus import BY_NAME, retimed
    from trainguard import wire
    from trainguard_server.processor.embedded import EmbeddedProcessor
    from trainguard_server.queue.sqlite import QUEUE_DB, SqliteQueue
    from trainguard_server.storage.sqlite import SqliteEventStore, SqliteIncidentStore, SqliteMetricStore

    queue = SqliteQueue(tmp_path / QUEUE_DB, partitions=4)
    stores = (SqliteEventStore(tmp_path / "e.db"), SqliteMetricStore(tmp_path / "m.db"),
              SqliteIncidentStore(tmp_path / "i.db"))
    events = retimed(BY_NAME["explosion"].events(), time.time_ns() - 10**9)
    queue.publish("r", [wire.prepare_batch(events[a:a + 50]).request.SerializeToString()
                        for a in range(0, len(events), 50)])
    processor = EmbeddedProcessor(queue, *stores, snapshot_every_s=1e9, tick_interval_s=1e15, processor_workers=1)
    assert processor.pool is not None
    processor.pool.ready()
    hung = processor.pool.workers[0].process
    os.kill(hung.pid or 0, signal.SIGSTOP)
    try:
        processor.start()
        time.sleep(1.0)
        started = time.monotonic()
        stopper = threading.Thread(target=processor.stop, kwargs={"drain": True, "timeout": 3.0}, daemon=True)
        stopper.start()
        stopper.join(30)
        assert not stopper.is_alive(), "stop() did not return"
        assert time.monotonic() - started < 3.0 + 2 * processor.pool.stop_timeout_s
        assert not hung.is_alive() and processor.pool.workers == []
    finally:
        if hung.is_alive():
            os.kill(hung.pid or 0, signal.SIGKILL)
    again = EmbeddedProcessor(queue, *stores, snapshot_every_s=1e9, tick_interval_s=1e15)
    again.stop(drain=True, timeout=30)
    found = [(i.category, i.subtype) for i in stores[2].list_incidents(str(events[0]["project"]),
                                                                       run_id=str(events[0]["run_id"])).items]
    assert found == [("gradient", "explosion")]
