"""A live log record of c10d's warning for ONE failed connect attempt opens nothing (hR's review, stop 44).

torch prints ``[W socket.cpp:N] [c10d] The client socket has failed to connect to ...`` for each attempt while
the master comes up -- healthy runs print it (pytorch/PiPPy#158's CI, NeMo#7351) -- and a live record cannot
see whether training went on after it. The failure itself still reads: the raised ``DistNetworkError`` and an
error-level ``[E socket.cpp]`` line. A replayed log (run tag ``replay: true``) keeps the reading: its reader
passes the warning on only when the log did not go on training after it (tests/services/replay)."""

from __future__ import annotations

from typing import Dict

from trainguard_engine.catalogue import DetectionSettings
from trainguard_engine.detectors.process import on_log
from trainguard_engine.state import RankState, RunState

WARNING = ("[W socket.cpp:663] [c10d] The client socket has failed to connect to [localhost]:29500 (errno: 99 - "
           "Cannot assign requested address).")
WARNING_NEW = ("[W427 01:04:16.149509694 socket.cpp:752] [c10d] The client socket has failed to connect to "
               "[::ffff:198.18.0.1]:3254 (errno: 110 - Connection timed out).")
ERROR = ("[E socket.cpp:957] [c10d] The client socket has timed out after 1800s while trying to connect to "
         "(node1, 29500).")
RAISED = ("torch.distributed.DistNetworkError: The client socket has failed to connect to any network address of "
          "(node1, 29500). The client socket has failed to connect to node1:29500 (errno: 110 - Connection timed "
          "out).")


def _run(tags: Dict[str, str]) -> RunState:
    run = RunState(project="p", run_id="r")
    run.tags.update(tags)
    run.ranks[0] = RankState(rank=0)
    return run


def _kind(line: str, tags: Dict[str, str]) -> str:
    run = _run(tags)
    for source in ("stderr", "file:train.log", ""):
        body = {"message": line, "level": "WARNING", "source": source}
        found = on_log(run, run.ranks[0], {"event_id": f"e-{source}"}, body, 3, 1, DetectionSettings())
        if found is not None:
            return f"{found.category}/{found.subtype}"
    return "nothing"


def test_a_live_connect_attempt_warning_opens_nothing() -> None:
    assert _kind(WARNING, {}) == "nothing"
    assert _kind(WARNING_NEW, {"launcher": "torchrun"}) == "nothing"


def test_the_failure_itself_still_reads_live() -> None:
    assert _kind(RAISED, {}) == "comm/init-failure"
    assert _kind(ERROR, {}).startswith("comm/")


def test_a_replayed_log_keeps_the_warning_its_reader_passed_on() -> None:
    assert _kind(WARNING, {"replay": "true", "launcher": "replay"}) == "comm/init-failure"
