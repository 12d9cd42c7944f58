"""The SDK changes nothing about how a process ends: same stderr, same exit status — and it reports it."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from tests.sdk.scripting import of_kind, read_jsonl, run_python

INIT = "import trainguard; trainguard.init(endpoint='file://{out}', project='t', spool_dir='')\n"

CASES = {
    "normal": ("x = 1\n", 0),
    "exception": ("def train():\n    raise ValueError('bad batch 17')\ntrain()\n", 1),
    "sys_exit_3": ("import sys\nsys.exit(3)\n", 3),
    "sys_exit_message": ("import sys\nsys.exit('giving up')\n", 1),
    "abort": ("import os\nos.abort()\n", -signal.SIGABRT),
    "sigterm": ("import os, signal\nos.kill(os.getpid(), signal.SIGTERM)\nimport time\ntime.sleep(30)\n",
                -signal.SIGTERM),
    "keyboard_interrupt": ("raise KeyboardInterrupt\n", -signal.SIGINT),
    "chained": ("try:\n    {}['k']\nexcept KeyError as e:\n"
                "    raise RuntimeError('lookup failed') from e\n", 1),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_exit_status_and_stderr_unchanged(case: str, tmp_path: Path) -> None:
    body, expected = CASES[case]
    plain = run_python(body)
    out = tmp_path / "events.jsonl"
    with_sdk = run_python(INIT.format(out=out) + body)
    assert plain.returncode == expected
    assert with_sdk.returncode == plain.returncode
    # the original handler prints exactly what it printed before (modulo the line numbers our one
    # extra line of init shifts)
    assert _strip_lines(with_sdk.stderr) == _strip_lines(plain.stderr)


def _strip_lines(text: str) -> str:
    import re

    return re.sub(r'File "<string>", line \d+', 'File "<string>", line N', text)


@pytest.mark.parametrize("case,code,sig,reason", [
    ("normal", 0, 0, "normal"),
    ("exception", 1, 0, "exception"),
    ("sys_exit_3", 3, 0, "sys.exit"),
    ("sigterm", 128 + signal.SIGTERM, signal.SIGTERM, "signal"),
    ("keyboard_interrupt", 130, signal.SIGINT, "signal"),
])
def test_exit_event_reports_code_and_signal(case: str, code: int, sig: int, reason: str,
                                            tmp_path: Path) -> None:
    out = tmp_path / "events.jsonl"
    run_python(INIT.format(out=out) + CASES[case][0])
    events = read_jsonl(out)
    exits = [e["lifecycle"] for e in of_kind(events, "lifecycle") if e["lifecycle"]["phase"] == "EXIT"]
    assert len(exits) == 1
    assert (exits[0]["exit_code"], exits[0]["signal"], exits[0]["reason"]) == (code, sig, reason)
    starts = [e for e in of_kind(events, "lifecycle") if e["lifecycle"]["phase"] == "START"]
    assert len(starts) == 1
    assert events[0] is starts[0] or events[0]["event_id"] == starts[0]["event_id"]


def test_uncaught_exception_is_captured_with_chain(tmp_path: Path) -> None:
    out = tmp_path / "events.jsonl"
    run_python(INIT.format(out=out) + CASES["chained"][0])
    [exc] = [e["exception"] for e in of_kind(read_jsonl(out), "exception")]
    assert exc["type"] == "RuntimeError"
    assert exc["message"] == "lookup failed"
    assert exc["handled"] is False and exc["mechanism"] == "excepthook"
    assert exc["chain"][0]["type"] == "KeyError" and exc["chain"][0]["relation"] == "cause"
    assert "The above exception was the direct cause" in exc["traceback"]


def test_thread_exception_is_captured_and_still_printed(tmp_path: Path) -> None:
    out = tmp_path / "events.jsonl"
    body = ("import threading\n"
            "def work():\n    raise OSError('disk gone')\n"
            "t = threading.Thread(target=work, name='loader'); t.start(); t.join()\n")
    result = run_python(INIT.format(out=out) + body)
    assert result.returncode == 0
    assert "OSError: disk gone" in result.stderr
    [exc] = [e["exception"] for e in of_kind(read_jsonl(out), "exception")]
    assert (exc["type"], exc["mechanism"], exc["thread"]) == ("OSError", "threading", "loader")


def test_sigkill_of_a_child_is_not_altered(tmp_path: Path) -> None:
    """A training child killed with SIGKILL reports -9 to its parent with or without the SDK in it."""
    out = tmp_path / "events.jsonl"
    child = tmp_path / "child.py"
    child.write_text(INIT.format(out=out) + (
        "import time\n"
        "for i in range(10**6):\n"
        "    trainguard.log(step=i, loss=1.0)\n"
        "    time.sleep(0.001)\n"))
    parent = f"""
        import subprocess, sys, time, signal
        import os
        child = subprocess.Popen([sys.executable, {str(child)!r}])
        deadline = time.monotonic() + 60  # killed once metrics reached the disk (a slow start needs longer)
        while time.monotonic() < deadline and not (os.path.exists({str(out)!r}) and
                                                   '"metrics"' in open({str(out)!r}).read()):
            time.sleep(0.05)
        time.sleep(0.2)
        child.send_signal(signal.SIGKILL)
        print(child.wait())
    """
    result = run_python(parent)
    assert result.stdout.strip() == str(-signal.SIGKILL), result.stderr
    events = read_jsonl(out)
    assert of_kind(events, "metrics"), "metrics sent before the kill are on disk"
    assert not [e for e in of_kind(events, "lifecycle") if e["lifecycle"]["phase"] == "EXIT"]


def test_user_sigterm_handler_still_runs(tmp_path: Path) -> None:
    out = tmp_path / "events.jsonl"
    body = """
import signal, os, sys
def graceful(signum, frame):
    print("saving checkpoint", flush=True)
    sys.exit(0)
signal.signal(signal.SIGTERM, graceful)
""" + INIT.format(out=out) + "os.kill(os.getpid(), signal.SIGTERM)\nimport time; time.sleep(30)\n"
    result = run_python(body)
    assert result.returncode == 0
    assert "saving checkpoint" in result.stdout
    lifecycle = [e["lifecycle"] for e in of_kind(read_jsonl(out), "lifecycle")]
    [end] = [e for e in lifecycle if e["phase"] == "EXIT"]
    assert (end["exit_code"], end["reason"]) == (0, "sys.exit")


def test_captured_fingerprint_equals_the_printed_tracebacks(tmp_path: Path) -> None:
    """The SDK's live fingerprint and the fingerprint of what Python printed agree (the agent parses
    printed tracebacks), even past the frames the SDK ships (a deep recursion)."""
    from trainguard.core.tracebacks import fingerprint_text

    out = tmp_path / "events.jsonl"
    body = "import sys\nsys.setrecursionlimit(400)\ndef down(n):\n    return down(n + 1)\ndown(0)\n"
    result = run_python(INIT.format(out=out) + body)
    [exc] = [e["exception"] for e in of_kind(read_jsonl(out), "exception")]
    assert exc["type"] == "RecursionError"
    assert len(exc["frames"]) == 128  # max_frames shipped
    printed = fingerprint_text(result.stderr)
    assert printed is not None and exc["fingerprint"] == printed.hash
    assert all(0 <= h["frame_index"] < 128 for h in exc["hints"])
