"""A process's spool directory (trainguard/transport/home.py, orphans.py, integrations/fatal.py): a live
owner's is never taken, a dead one's is taken by one finder at a time with its written-ahead events; the
write-ahead file stays bounded; faulthandler changes neither stderr nor the exit status and stays out of
forked children; a run that ends well leaves nothing behind. Real processes, real signals."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import List

from tests.sdk.scripting import REPO, run_python
from tests.support.net import free_port
from trainguard.core.events import new_event_id
from trainguard.transport.home import FAULT_NAME, WRITE_AHEAD_NAME, WriteAhead
from trainguard.transport.orphans import find_orphans, read_write_ahead

DOWN = "http://127.0.0.1:{port}"  # nobody listens there: every batch goes to the spool


def _dirs(root: Path) -> List[Path]:
    return sorted(p for p in root.glob("*/*") if p.is_dir())


def test_a_live_owners_spool_is_never_taken_and_a_dead_ones_is_taken_once(tmp_path: Path) -> None:
    code = (
        "import sys, time, trainguard\n"
        f"trainguard.init(endpoint={DOWN.format(port=free_port())!r}, spool_dir={str(tmp_path)!r},"
        " connect_timeout=0.2)\n"
        "trainguard.log(step=7, loss=float('nan'))\n"
        "print('ready', flush=True)\n"
        "time.sleep(60)\n"
    )
    env = dict(os.environ, PYTHONPATH=str(REPO / "sdk" / "src"))
    env.pop("TRAINGUARD_ENDPOINT", None)
    owner = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert owner.stdout is not None and owner.stdout.readline().strip() == "ready"
        (directory,) = _dirs(tmp_path)  # the alert is in its write-ahead file or already in a spooled batch
        assert find_orphans(str(directory.parent)) == [], "a live process's spool is its own"
    finally:
        owner.send_signal(signal.SIGKILL)
        owner.wait(30)

    (orphan,) = find_orphans(str(directory.parent))
    try:
        assert find_orphans(str(directory.parent)) == [], "one finder at a time"
        assert orphan.owner["pid"] == owner.pid and orphan.endpoint.startswith("http://127.0.0.1:")
        spool = orphan.spool()
        delivered = []
        while (batch := spool.peek()) is not None:
            delivered.extend(batch)
            spool.pop()
        alerts = {e["event_id"] for e in delivered if e.get("metrics", {}).get("alert") == "non_finite:loss"}
        assert len(alerts) == 1 and {e["step"] for e in delivered if e["event_id"] in alerts} == {7}
        assert not (directory / WRITE_AHEAD_NAME).exists(), "sealed into batches"
    finally:
        orphan.release()
    assert not directory.exists(), "an emptied orphan is removed when let go"


def test_the_write_ahead_file_is_bounded_and_emptied_once_everything_was_settled(tmp_path: Path) -> None:
    path = tmp_path / WRITE_AHEAD_NAME
    ahead = WriteAhead(str(path), max_pending=4)
    events = [{"event_id": new_event_id(), "run_id": "r", "step": i} for i in range(6)]
    assert [ahead.write(e) for e in events] == [True] * 4 + [False] * 2
    assert (ahead.written, ahead.skipped, ahead.pending) == (4, 2, 4)
    ahead.settle(events[:3])
    assert path.stat().st_size > 0, "kept while anything written is unsettled"
    ahead.settle(events[3:4])
    assert path.stat().st_size == 0 and ahead.pending == 0
    assert ahead.write(events[5])
    assert [e["step"] for e in read_write_ahead(str(path))] == [5]
    ahead.close()
    assert path.exists(), "an unsettled event stays on disk for the next process"


def test_the_same_alert_is_written_once_while_it_is_unsettled(tmp_path: Path) -> None:
    ahead = WriteAhead(str(tmp_path / WRITE_AHEAD_NAME), max_pending=64)
    first = {"event_id": new_event_id(), "run_id": "r", "step": 1}
    assert ahead.wants("non_finite:loss") and ahead.write(first, key="non_finite:loss")
    assert not ahead.wants("non_finite:loss"), "a NaN every step writes one alert per delivery"
    assert ahead.wants("non_finite:grad/global_norm") and ahead.coalesced == 1
    ahead.settle([first])
    assert ahead.wants("non_finite:loss")
    ahead.close()


def test_a_line_torn_by_a_death_mid_write_is_skipped(tmp_path: Path) -> None:
    path = tmp_path / WRITE_AHEAD_NAME
    whole = json.dumps({"event_id": "a" * 32, "run_id": "r", "step": 1})
    path.write_text(whole + "\n" + whole[: len(whole) // 2])
    assert [e["step"] for e in read_write_ahead(str(path))] == [1]


def test_faulthandler_changes_neither_stderr_nor_the_exit_status(tmp_path: Path) -> None:
    init = (f"import trainguard; trainguard.init(endpoint={DOWN.format(port=free_port())!r}, "
            f"spool_dir={str(tmp_path / 'spool')!r}, connect_timeout=0.2)\n")
    body = "import os\nos.abort()\n"
    plain, with_sdk = run_python(body), run_python(init + body)
    assert plain.returncode == with_sdk.returncode == -signal.SIGABRT
    assert with_sdk.stderr == plain.stderr == ""
    (directory,) = _dirs(tmp_path / "spool")
    assert (directory / FAULT_NAME).read_text().startswith("Fatal Python error: Aborted")

    # faulthandler already on (the user's): it stays theirs, printing to stderr; the SDK keeps no copy
    theirs = run_python(init + body, env={"PYTHONFAULTHANDLER": "1", "TRAINGUARD_SPOOL_DIR": ""})
    assert theirs.returncode == -signal.SIGABRT and "Fatal Python error: Aborted" in theirs.stderr
    assert all((d / FAULT_NAME).read_text() == "" for d in _dirs(tmp_path / "spool") if d != directory)


def test_a_forked_childs_crash_stays_out_of_the_parents_fault_file(tmp_path: Path) -> None:
    code = (
        "import os, trainguard\n"
        f"trainguard.init(endpoint={DOWN.format(port=free_port())!r}, spool_dir={str(tmp_path)!r},"
        " connect_timeout=0.2, shutdown_timeout=1)\n"
        "client = trainguard.get_client()\n"
        "fault = os.path.join(client.home.directory, 'fault.txt')\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    os.abort()\n"
        "_, status = os.waitpid(pid, 0)\n"
        "print(os.WTERMSIG(status), os.path.getsize(fault))\n"
    )
    out = run_python(code)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [str(int(signal.SIGABRT)), "0"]


def test_a_run_that_ends_well_leaves_no_directory_behind(tmp_path: Path) -> None:
    out = run_python(
        "import trainguard\n"
        f"trainguard.init(endpoint='file://{tmp_path / 'events.jsonl'}', spool_dir={str(tmp_path / 'spool')!r})\n"
        "trainguard.log(step=1, loss=float('nan'))\n"
        "try:\n    1 / 0\nexcept ZeroDivisionError:\n    trainguard.capture_exception()\n")
    assert out.returncode == 0, out.stderr
    assert _dirs(tmp_path / "spool") == []
    kinds = [k for line in (tmp_path / "events.jsonl").read_text().splitlines()
             for k in json.loads(line) if k in ("metrics", "exception", "lifecycle")]
    assert sorted(kinds) == ["exception", "lifecycle", "lifecycle", "metrics"], "each sent once"
