"""Faults of the data directory at start, on real ``trainguard serve`` processes.

- A second ``serve`` on a data directory another one is serving ran too (before: both consumed the SQLite
  queue and checkpointed their pipeline state over each other). Now it exits 2 with one line naming the
  directory, the other process and the fix, and the first goes on serving; a serve killed with -9 leaves no
  stale lock.
- A damaged SQLite file (a store's or the queue's) ended the start in a traceback. Now: one line naming the
  file and what to do, exit code 2.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.services.e2e.serve_process import ServeProcess
from tests.services.test_server_readyz import _readyz


def _serve(data_dir: Path) -> subprocess.CompletedProcess[str]:
    """``trainguard serve`` expected to refuse at start: its exit and output."""
    cmd = [sys.executable, "-m", "trainguard_server", "serve", "--data-dir", str(data_dir), "--http-port", "0",
           "--grpc-port", "0"]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, PYTHONUNBUFFERED="1"))


def test_a_second_serve_on_the_same_data_dir_is_refused_and_the_first_goes_on(tmp_path: Path) -> None:
    data = tmp_path / "data"
    first = ServeProcess(data).start()
    try:
        assert first.proc is not None
        second = _serve(data)
        assert second.returncode == 2, second.stdout + second.stderr  # before: it ran, a second processor
        assert second.stderr.strip() == (
            f"trainguard serve: data directory {data} is in use by another trainguard process (pid "
            f"{first.proc.pid}) that runs its processor ({data / 'processor.lock'} is locked): stop that "
            "process, or give this one another --data-dir (TRAINGUARD_DATA_DIR); a gateway or api alone "
            "(TRAINGUARD_ROLES=gateway,api) may share it")
        assert "Traceback" not in second.stdout + second.stderr
        assert _readyz(first.http_url) == (200, {"status": "ready"})
        first.proc.send_signal(signal.SIGKILL)  # dies holding the lock: the kernel releases it
        first.proc.wait(30)
    finally:
        first.stop()
    again = ServeProcess(data).start()  # no stale lock after a kill -9
    try:
        assert _readyz(again.http_url) == (200, {"status": "ready"})
    finally:
        again.stop()


@pytest.mark.parametrize("name", ["incidents.db", "queue.db"])
def test_a_damaged_sqlite_file_is_named_in_one_line(tmp_path: Path, name: str) -> None:
    data = tmp_path / "data"
    ServeProcess(data).start().stop()  # a real data directory, then one of its files overwritten
    for leftover in (data / f"{name}-wal", data / f"{name}-shm"):
        leftover.unlink(missing_ok=True)
    (data / name).write_bytes(b"\x07" * 8192)  # not SQLite's header: what a torn copy or a bad disk leaves
    done = _serve(data)
    assert done.returncode == 2, done.stdout + done.stderr  # before: 1, a traceback ending in DatabaseError
    assert "Traceback" not in done.stderr, done.stderr
    assert done.stderr.strip() == (
        f"trainguard serve: {data / name} is not a readable SQLite database (file is not a database): it is "
        "damaged or not TrainGuard's; restore it from a backup, or move it aside and the server starts with "
        "an empty one (what it held is lost)")
