"""SIGTERM reaching a rank whose main thread is stuck in native code (the survivor of a dead NCCL peer,
blocked in a CUDA sync) ends it as it would end without the SDK -- killed by SIGTERM, at once -- and the
exit is still reported. Without the watch, the SDK's Python handler never runs there and the process
outlives SIGTERM until the launcher's SIGKILL (recorded on two H200s: tests/fixtures/nccl/rank_lost).

The stuck main thread here is a real native wait that ignores signals: ``pthread_mutex_lock`` on a mutex
the thread already holds (glibc's default mutex deadlocks; the call never returns EINTR), through ctypes,
which releases the GIL as a CUDA synchronisation does."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import List, Optional

from tests.sdk.scripting import REPO, of_kind, read_jsonl

STUCK = """
import ctypes, sys
{init}
libc = ctypes.CDLL(None)
mutex = ctypes.create_string_buffer(64)   # zeroed: PTHREAD_MUTEX_INITIALIZER
libc.pthread_mutex_lock(mutex)
print("stuck", flush=True)
libc.pthread_mutex_lock(mutex)             # never returns, never runs a Python signal handler
"""

FORKS = """
import os, signal, sys, time
{init}
child = os.fork()
if child == 0:
    time.sleep(30)
    os._exit(0)
print("forked", flush=True)
time.sleep(0.3)
os.kill(child, signal.SIGTERM)             # a DataLoader worker terminated: the rank goes on
os.waitpid(child, 0)
time.sleep(2.5)                            # past the watch's grace
print("alive", flush=True)
"""


def _init(out: Optional[Path]) -> str:
    if out is None:
        return ""
    return (f"import trainguard; trainguard.init(endpoint='file://{out}', project='t', spool_dir='', "
            f"heartbeat_interval=0.2, flush_interval=0.05)")


def _start(code: str) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO / "sdk" / "src"), str(REPO)]))
    env.pop("TRAINGUARD_ENDPOINT", None)
    return subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _terminate_when_stuck(out: Optional[Path]) -> tuple[int, float]:
    proc = _start(STUCK.format(init=_init(out)))
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "stuck"
        time.sleep(0.5)
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(20)
        except subprocess.TimeoutExpired:
            return 0, float("inf")  # outlived SIGTERM
        return code, time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_without_the_sdk_sigterm_ends_a_stuck_process_at_once() -> None:
    code, took = _terminate_when_stuck(None)
    assert code == -signal.SIGTERM and took < 5


def test_with_the_sdk_a_stuck_process_still_dies_of_sigterm_and_reports_it(tmp_path: Path) -> None:
    out = tmp_path / "events.jsonl"
    code, took = _terminate_when_stuck(out)
    assert code == -signal.SIGTERM, "the process outlived SIGTERM" if took == float("inf") else code
    assert took < 10  # the grace (1 s) plus a bounded flush, not the launcher's SIGKILL
    events = read_jsonl(out)
    exits: List[dict] = [e["lifecycle"] for e in of_kind(events, "lifecycle") if e["lifecycle"]["phase"] == "EXIT"]
    assert len(exits) == 1
    assert exits[0]["exit_code"] == 128 + signal.SIGTERM and exits[0]["signal"] == signal.SIGTERM
    assert of_kind(events, "heartbeat")  # alive and heartbeating while stuck, before the signal


def test_a_forked_childs_sigterm_does_not_end_the_parent(tmp_path: Path) -> None:
    proc = _start(FORKS.format(init=_init(tmp_path / "events.jsonl")))
    stdout, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 0, stderr
    assert stdout.split() == ["forked", "alive"]
