"""Run a program in a fresh interpreter and SIGKILL it mid-stream (the durability tests' tool)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import List

ROOT = Path(__file__).resolve().parents[2]


def run_until_killed(code: str, acks: int, timeout: float = 60.0) -> List[str]:
    """Run ``code`` in a fresh interpreter, SIGKILL it after ``acks`` lines starting with 'done ', and
    return the payload of every 'done' line it printed before dying."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "services" / "src"), str(ROOT / "engine" / "src"), str(ROOT / "sdk" / "src"),
                                         env.get("PYTHONPATH", "")])
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    assert proc.stdout is not None and proc.stderr is not None
    done: List[str] = []
    killer = threading.Timer(timeout, proc.kill)
    killer.start()
    try:
        for line in proc.stdout:
            if line.startswith("done "):
                done.append(line[5:].strip())
                if len(done) == acks:
                    os.kill(proc.pid, signal.SIGKILL)
                    break
        proc.wait(timeout)
        done += [line[5:].strip() for line in proc.stdout.read().splitlines() if line.startswith("done ")]
    finally:
        killer.cancel()
        proc.kill()
    assert proc.returncode == -signal.SIGKILL, proc.stderr.read()
    return done
