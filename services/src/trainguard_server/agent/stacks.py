"""The Python stacks of a stuck process, from outside it: ``py-spy dump`` (no cooperation from the job).

:func:`python_stacks` returns ``(method, text)``: ``("py-spy", <dump>)`` on success, else ``("<why not>",
"")``. py-spy reads the process's memory with ptrace: the agent must be its parent (wrapper mode) or share
its PID namespace with ``SYS_PTRACE`` (a Kubernetes sidecar with ``shareProcessNamespace: true``). Child
processes (torchrun's ranks, DataLoader workers) are included (``--subprocesses``). py-spy ships as a wheel
with its binary (``pip install 'trainguard-server[agent]'``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from typing import Optional, Tuple

MAX_STACK_CHARS = 40_000


def find_py_spy() -> Optional[str]:
    """The py-spy executable beside this Python (a venv's bin) or on PATH."""
    beside = os.path.join(os.path.dirname(sys.executable), "py-spy")
    if os.access(beside, os.X_OK):
        return beside
    return shutil.which("py-spy")


def python_stacks(pid: int, timeout_s: float = 20.0) -> Tuple[str, str]:
    exe = find_py_spy()
    if exe is None:
        return "py-spy not installed (pip install 'trainguard-server[agent]')", ""
    try:
        done = subprocess.run([exe, "dump", "--pid", str(pid), "--subprocesses"], capture_output=True,
                              text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return f"py-spy dump timed out after {timeout_s:g} s", ""
    except OSError as exc:
        return f"py-spy failed to start: {exc}", ""
    text = done.stdout.strip()
    if done.returncode != 0 or not text:
        why = (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[-1]
        return f"py-spy dump failed: {why[:300]}", ""
    if len(text) > MAX_STACK_CHARS:
        text = text[:MAX_STACK_CHARS] + "\n... (truncated)"
    return "py-spy", text
