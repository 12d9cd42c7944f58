"""Starting TrainGuard's processes for end-to-end tests and reading what they wrote."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any, Dict


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
