"""Run small Python programs in a fresh interpreter, with or without the SDK, and read what they sent."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional

REPO = Path(__file__).resolve().parents[2]


@dataclass
class Outcome:
    returncode: int
    stdout: str
    stderr: str


def run_python(code: str, *, env: Optional[Mapping[str, str]] = None, timeout: float = 120,
               cwd: Optional[str] = None) -> Outcome:
    """Run ``code`` (dedented) with this interpreter; the SDK is importable from sdk/src."""
    full_env = dict(os.environ)
    full_env["PYTHONPATH"] = os.pathsep.join([str(REPO / "sdk" / "src"), str(REPO)])
    full_env.pop("TRAINGUARD_ENDPOINT", None)
    if env:
        full_env.update(env)
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=full_env, cwd=cwd,
                          capture_output=True, text=True, timeout=timeout)
    return Outcome(proc.returncode, proc.stdout, proc.stderr)


def read_jsonl(path: os.PathLike[str] | str) -> List[Dict[str, Any]]:
    """Every envelope in a ``file://`` endpoint's output, in order."""
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def of_kind(events: List[Dict[str, Any]], kind: str) -> List[Dict[str, Any]]:
    """The envelopes carrying a ``kind`` payload."""
    return [e for e in events if kind in e]
