"""What init() says on a user's first run: one line with the run's dashboard link, and a typo'd variable named."""

from __future__ import annotations

import os
import pty
import subprocess
import sys
import textwrap
from typing import Dict

import pytest

from tests.sdk.scripting import REPO, run_python
from trainguard.api import dashboard_link

JOB = """
    import trainguard
    trainguard.init(endpoint="http://127.0.0.1:9/", run_name="train", run_id="job-1", spool_dir="",
                    shutdown_timeout=0.2, connect_timeout=0.2)
    print("trained")
"""
LINE = "trainguard: run train (job-1): http://127.0.0.1:9/ui/#/runs/job-1"


def test_on_a_terminal_init_prints_the_dashboard_link_once() -> None:
    primary, secondary = pty.openpty()
    env = dict(os.environ, PYTHONPATH=str(REPO / "sdk" / "src"))
    env.pop("TRAINGUARD_ENDPOINT", None)
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(JOB)], stdout=subprocess.PIPE,
                          stderr=secondary, env=env, timeout=60, text=True)
    os.close(secondary)
    err = b""
    while True:
        try:
            chunk = os.read(primary, 4096)
        except OSError:  # EIO: the child's side is closed
            break
        if not chunk:
            break
        err += chunk
    os.close(primary)
    assert (proc.returncode, proc.stdout) == (0, "trained\n")
    lines = err.decode().replace("\r\n", "\n").splitlines()
    assert lines[0] == LINE and [line for line in lines if line.startswith("trainguard: run ")] == [LINE]


def test_a_batch_job_log_is_unchanged_unless_asked() -> None:
    quiet = run_python(JOB)
    assert (quiet.returncode, quiet.stdout) == (0, "trained\n")
    assert "trainguard: run " not in quiet.stderr  # (the unreachable backend at port 9 is still said)
    told = run_python(JOB, env={"TRAINGUARD_ANNOUNCE": "1"})
    assert told.stderr.splitlines()[0] == LINE  # then: the backend (port 9) is unreachable
    assert [line for line in told.stderr.splitlines() if line.startswith("trainguard: run ")] == [LINE]


@pytest.mark.parametrize("env, line", [
    ({"TRAINGUARD_ANNOUNCE": "1", "TRAINGUARD_DASHBOARD_URL": "https://tg.example.org/"},
     "trainguard: run train (job-1): https://tg.example.org/ui/#/runs/job-1"),
    ({"TRAINGUARD_ANNOUNCE": "1", "RANK": "1", "WORLD_SIZE": "2"}, None),  # rank 0 alone says it
])
def test_dashboard_url_and_ranks(env: Dict[str, str], line: str) -> None:
    out = run_python(JOB, env=env)
    assert out.returncode == 0
    assert [x for x in out.stderr.splitlines() if x.startswith("trainguard: run ")] == ([line] if line else [])


def test_links_per_endpoint_kind() -> None:
    assert dashboard_link("grpc://tg:4317", "r/1") == "http://tg:4318/ui/#/runs/r%2F1"
    assert dashboard_link("grpcs://tg:443", "r") == "https://tg:4318/ui/#/runs/r"
    assert dashboard_link("https://user:pw@tg/prefix/", "r") == "https://tg/prefix/ui/#/runs/r"
    assert dashboard_link("file:///tmp/run%201.jsonl", "r") == "/tmp/run 1.jsonl"
    out = run_python("""
        import trainguard
        trainguard.init(endpoint="file:///dev/null", run_name="offline", run_id="r2", announce=True,
                        spool_dir="")
    """)
    assert out.stderr.splitlines() == ["trainguard: run offline (r2): events in /dev/null"]


def test_a_misspelt_variable_is_named_with_the_right_one() -> None:
    out = run_python(JOB.replace('endpoint="http://127.0.0.1:9/", ', ""),
                     env={"TRAINGUARD_ENDPIONT": "http://127.0.0.1:9/"})
    assert (out.returncode, out.stdout) == (0, "trained\n")
    assert out.stderr.splitlines()[:1] == [
        "trainguard: TRAINGUARD_ENDPIONT is not a TrainGuard setting (ignored): did you mean "
        "TRAINGUARD_ENDPOINT?"]
