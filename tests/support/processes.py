"""Starting TrainGuard's processes for end-to-end tests and reading what they wrote."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any, Dict, Sequence


def start_role(role: str, env: Dict[str, str], log: Path, *extra: str) -> subprocess.Popen[str]:
    """``python -m trainguard_server <role> [extra]`` with ``env``, output appended to ``log``."""
    return subprocess.Popen([sys.executable, "-m", "trainguard_server", role, *extra], env=env,
                            stdout=open(log, "a"), stderr=subprocess.STDOUT, text=True)


def healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1) as answer:
            return answer.status == 200
    except OSError:
        return False


def bootstrap_tokens(data_dir: Path) -> Any:
    """The tokens a first start wrote to ``data_dir`` (None before)."""
    path = data_dir / "bootstrap-tokens.json"
    return json.loads(path.read_text()) if path.exists() else None


def stop_all(procs: Sequence[subprocess.Popen[str]], *, groups: Sequence[subprocess.Popen[str]] = (),
             wait_s: float = 20.0) -> None:
    """SIGTERM every live process (the whole process group for those in ``groups``: started with
    ``start_new_session``, e.g. a Flink job and its workers), wait, SIGKILL what is left."""
    for proc in procs:
        if proc.poll() is None:
            try:
                if proc in groups:
                    os.killpg(proc.pid, signal.SIGTERM)
                else:
                    proc.send_signal(signal.SIGTERM)
            except OSError:
                pass
    for proc in procs:
        try:
            proc.wait(wait_s)
        except subprocess.TimeoutExpired:
            proc.kill()
