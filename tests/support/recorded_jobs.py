"""What TrainGuard receives from a recorded multi-rank job: each rank's SDK stream, plus what only the
rank's output and its launcher saw -- the text of errors raised in C++ threads (an NCCL watchdog aborts the
process from its own thread: no Python exception, no EXIT event) and the exit codes of ranks killed by a
signal. In production the sidecar agent (issue 7) or ``trainguard replay`` read those; here the replay's
importer turns the recorded ``rank<N>.log`` files into the same log/exception envelopes, and torchrun's
per-rank exit codes (parsed from its summary into ``scenario.json``) become EXIT events for the ranks that
did not send one themselves.

A job folder holds ``rank<N>.events.jsonl`` (the SDK's ``file://`` stream), ``rank<N>.log`` and
``scenario.json`` (tests/fixtures/nccl/README.md).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
from datetime import datetime
from pathlib import Path
from typing import Any, Dict, List, Sequence

from tests.scenarios.corpus import load_events
from tests.scenarios.dist import parse_facts
from trainguard.transport.base import SendResult
from trainguard_server.replay.backends import Backend
from trainguard_server.replay.importer import Importer, ReplayOptions

Event = Dict[str, Any]


class Collect(Backend):
    """A replay backend that keeps what it is sent."""

    description = "collect"

    def __init__(self) -> None:
        self.events: List[Event] = []

    def send(self, events: Sequence[Event], timeout: float) -> SendResult:
        self.events.extend(events)
        return SendResult(accepted=len(events))


def record(folder: Path) -> Dict[str, Any]:
    data: Dict[str, Any] = json.loads((folder / "scenario.json").read_text())
    return data


def facts(folder: Path) -> Dict[str, Any]:
    """What the ranks said they did and how each ended (tests/scenarios/dist.py's parse)."""
    return parse_facts(folder, record(folder))


def sdk_events(folder: Path) -> List[Event]:
    return load_events(sorted(folder.glob("rank*.events.jsonl")))


def launcher_exit_codes(folder: Path, events: Sequence[Event]) -> Dict[int, int]:
    """rank -> exit code (shell convention: 128 + signal) for the ranks whose SDK sent no EXIT: torchrun's
    summary, or SIGKILL for a job the recorder's timeout killed."""
    exited = {int(e.get("rank") or 0) for e in events if e.get("lifecycle", {}).get("phase") == "EXIT"}
    ranks = {int(e.get("rank") or 0) for e in events}
    codes = {int(r): (128 - c if c < 0 else c) for r, c in facts(folder)["exit_codes"].items()}
    if record(folder).get("hung_killed"):
        codes.update({r: 128 + int(signal.SIGKILL) for r in ranks if r not in codes})
    return {r: c for r, c in codes.items() if r not in exited}


def agent_view(folder: Path, tmp: Path) -> List[Event]:
    """Every envelope TrainGuard gets for the recorded job in ``folder`` (see the module doc), merged in
    event-time order. ``tmp`` is scratch space: the logs are copied there with their recording date as
    modification time (glog lines carry no year; the reader takes it from the file)."""
    events = sdk_events(folder)
    first = events[0]
    finished = datetime.fromisoformat(record(folder)["finished_utc"]).timestamp()
    logs = []
    for path in sorted(folder.glob("rank*.log")):
        rank = int(re.fullmatch(r"rank(\d+)\.log", path.name).group(1))  # type: ignore[union-attr]
        copy = tmp / f"{folder.name}-{path.name}"
        shutil.copyfile(path, copy)
        os.utime(copy, (finished, finished))
        logs.append((rank, copy))
    options = ReplayOptions(run_id=str(first["run_id"]), project=str(first.get("project") or ""),
                            logs=logs, exit_codes=launcher_exit_codes(folder, events),
                            world_size=int(first.get("world_size") or 1), host=str(first.get("host") or ""),
                            max_past_age_s=1e12)  # recorded times as they are: no shift into a window
    backend = Collect()
    summary = Importer(options, backend).run()
    if summary.error:
        raise AssertionError(f"replay of {folder}: {summary.error}")
    added = [e for e in backend.events if e.get("lifecycle", {}).get("phase") != "START"]
    merged = [(int(e.get("time_unix_nano") or 0), i, e) for i, e in enumerate([*events, *added])]
    merged.sort(key=lambda item: (item[0], item[1]))
    return [e for _t, _i, e in merged]
