"""The torch range watch() supports: stated once (trainguard.version), checked at watch() with one warning."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import trainguard
from tests.sdk.scripting import REPO
from trainguard.guard import reset_warnings
from trainguard.version import torch_version_problem


@pytest.mark.parametrize("version", ["2.1.0", "2.13.0+cpu", "2.6.0a0+git1234", "2.11.0.dev20250101+cu130"])
def test_supported_releases(version: str) -> None:
    assert torch_version_problem(version) is None


@pytest.mark.parametrize("version", ["1.13.1", "2.0.1+cu118", "3.0.0"])
def test_unsupported_releases_get_one_line(version: str) -> None:
    problem = torch_version_problem(version)
    assert problem is not None and "\n" not in problem
    assert problem.startswith(f"torch {version} is outside the releases watch() supports (2.1 up to 3.0")


def test_the_sdk_declares_no_torch_anywhere() -> None:
    # the SDK must never install or upgrade the job's torch: no dependency, no extra pulls it in
    text = (Path(__file__).resolve().parents[2] / "sdk" / "pyproject.toml").read_text()
    declared = text.split("[project.optional-dependencies]", 1)[1].split("[tool.", 1)[0]
    assert "torch" not in text.split("dependencies = [", 1)[1].split("]", 1)[0]
    assert "torch" not in declared and "lightning" not in declared and "transformers" not in declared


def test_watch_warns_once_and_still_watches_an_unsupported_torch(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    reset_warnings()
    monkeypatch.setattr(torch, "__version__", "2.0.1")
    trainguard.init(endpoint=f"file://{tmp_path / 'e.jsonl'}", spool_dir="", capture_exit=False,
                    capture_uncaught=False, announce=False)
    try:
        model = torch.nn.Linear(2, 2)
        assert trainguard.watch(model) is not None  # no exception into user code, the watch still on
        trainguard.watch(model)
    finally:
        trainguard.shutdown(timeout=2)
    lines = [line for line in capsys.readouterr().err.splitlines() if "outside the releases" in line]
    assert lines == [f"trainguard: {torch_version_problem('2.0.1')}"]


def test_watch_without_torch_says_so_in_one_line() -> None:
    # python -S: no site-packages, so no torch -- the stdlib-only SDK from sdk/src still imports
    code = ("import trainguard\n"
            "trainguard.init(endpoint='file:///dev/null', spool_dir='', capture_exit=False, announce=False)\n"
            "print(trainguard.watch(object()))\n")
    out = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, timeout=60,
                         env={"PYTHONPATH": str(REPO / "sdk" / "src"), "PATH": os.environ.get("PATH", "")})
    assert (out.returncode, out.stdout) == (0, "None\n"), out.stderr
    assert out.stderr == ("trainguard: watch(): torch is not installed in this process (TrainGuard uses the "
                          "job's torch and never installs one); not watching\n")
