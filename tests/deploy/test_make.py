"""The Makefile's first command installs only the embedded default; ``make test`` (what CI runs) all of it."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def dry_run(target: str) -> str:
    """What ``make -n TARGET`` would run from a fresh clone (every stamp missing: -B)."""
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")}
    # run as a top-level make: under `make test` (CI) a nested make would print "Entering directory" lines
    done = subprocess.run(["make", "--no-print-directory", "-n", "-B", target], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_make_demo_builds_no_flink_venv_and_no_test_tools() -> None:
    demo = dry_run("demo")
    assert "-r requirements/demo.txt" in demo and demo.rstrip().endswith(".venv/bin/trainguard demo")
    assert ".venv-flink" not in demo and "flink" not in demo
    assert "requirements/dev.txt" not in demo and "chromium" not in demo


def test_make_test_still_builds_everything() -> None:
    everything = dry_run("test")
    for needed in ("-r requirements/demo.txt", "-r requirements/dev.txt", ".venv-flink/bin/pip install",
                   "tools/flink_jars.py", "tools/fetch_assets.py", "tools/k8s_tools.py", "-m pytest"):
        assert needed in everything, needed
    assert "make test" in (REPO / ".ci" / "run").read_text()


def test_make_dist_builds_the_wheels() -> None:
    dist = dry_run("dist")
    assert "python3 tools/build_dist.py --out dist" in dist and ".venv" not in dist  # no venv needed


def test_the_demo_requirements_are_pinned_as_the_suites() -> None:
    # requirements/demo.txt is the embedded default's subset of requirements/dev.txt, at the same pins
    def lines(name: str) -> set[str]:
        text = (REPO / "requirements" / name).read_text()
        return {line.split("#")[0].strip() for line in text.splitlines() if line.split("#")[0].strip()}

    demo = lines("demo.txt")
    assert {"torch==2.13.0", "grpcio==1.85.3", "fastapi>=0.110"} <= demo
    assert demo <= lines("dev.txt"), demo - lines("dev.txt")
