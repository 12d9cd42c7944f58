"""The committed sdk/src/trainguard/v1/*_pb2* files are exactly what tools/gen_proto.py generates."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tools" / "gen_proto.py"


def run(args: List[str], cwd: Path = REPO, env: Optional[Dict[str, str]] = None
        ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=120, check=False)


def ensure_tools() -> None:
    """Install the pinned generator into .venv-proto/ when it is not there yet (pip, ~2 s, once)."""
    proc = run([str(SCRIPT), "--check"])
    if proc.returncode == 2 and "--install-tools" in proc.stderr:
        install = run([str(SCRIPT), "--install-tools", "--check"])
        assert install.returncode in (0, 1), install.stderr


def test_committed_generated_code_is_reproducible() -> None:
    ensure_tools()
    proc = run([str(SCRIPT), "--check"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "up to date" in proc.stdout


def _copy_repo(tmp: Path) -> Path:
    for rel in ("tools", "proto", "sdk/src/trainguard/v1"):
        shutil.copytree(REPO / rel, tmp / rel, ignore=shutil.ignore_patterns("__pycache__"))
    return tmp


def test_check_reports_drift_and_regeneration_fixes_it(tmp_path: Path) -> None:
    ensure_tools()
    copy = _copy_repo(tmp_path)
    env = dict(os.environ, TRAINGUARD_PROTO_TOOLS=str(REPO / ".venv-proto"))
    out = copy / "sdk/src/trainguard/v1"
    proto = copy / "proto/trainguard/v1/events.proto"
    text = proto.read_text().replace("string run_name = 13;", "string run_name = 13;\n  string team = 16;")
    proto.write_text(text)
    (out / "ingest_pb2_grpc.py").unlink()
    (out / "old_pb2.py").write_text("# stale\n")
    script = str(copy / "tools/gen_proto.py")

    proc = run([script, "--check"], cwd=copy, env=env)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "differs:  sdk/src/trainguard/v1/events_pb2.py" in proc.stderr
    assert "+  team: str" in proc.stderr.replace("    ", "  ")  # the .pyi diff is shown
    assert "missing:  sdk/src/trainguard/v1/ingest_pb2_grpc.py" in proc.stderr
    assert "stale:    sdk/src/trainguard/v1/old_pb2.py" in proc.stderr

    assert run([script], cwd=copy, env=env).returncode == 0
    assert not (out / "old_pb2.py").exists() and (out / "__init__.py").exists()
    assert run([script, "--check"], cwd=copy, env=env).returncode == 0


def test_other_generator_version_is_refused(tmp_path: Path) -> None:
    copy = _copy_repo(tmp_path)
    empty = tmp_path / "no-tools"
    empty.mkdir()
    (copy / "tools/requirements-proto.txt").write_text("grpcio-tools==0.0.1\n")
    proc = run([str(copy / "tools/gen_proto.py"), "--check"], cwd=copy,
               env=dict(os.environ, TRAINGUARD_PROTO_TOOLS=str(empty)))
    assert proc.returncode == 2
    assert "pinned to grpcio-tools==0.0.1" in proc.stderr and "--install-tools" in proc.stderr
