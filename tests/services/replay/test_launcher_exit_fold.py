"""A launcher's exit line for rank R, then R's own error text: the error leads, the exit is its consequence
(``correlate._own_error_after``); and the ``traceback :`` field of a torchrun failure entry is the entry's
rank's traceback (the replay reader). Built from pastes of the wild corpus's tuned part (each thread in
``tests/fixtures/wild/<id>/source.txt``); where a test puts lines of two pastes in one file, each line is
verbatim and the test says where it comes from."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import List, Optional, Tuple

from bench.wild import judge
from trainguard_server.replay import Importer, LocalBackend, ReplayOptions
from trainguard_server.replay.logs import LogItem, LogReader

WILD = Path(__file__).resolve().parents[2] / "fixtures" / "wild"
ENTRY = "comm-mismatch-barrier-torchrun-summary-148976-1"  # pytorch/pytorch#148976
TEARDOWN = "proc-ds-killing-subprocess-launcher-tb-1581-1"  # deepspeedai/DeepSpeed#1581


def _lines(case: str) -> List[str]:
    return (WILD / case / "log.txt").read_text(encoding="utf-8").splitlines()


def _shown(path: Path) -> Tuple[Tuple[str, ...], Optional[int]]:
    """The kinds of the incidents no other one explains (most severe, then earliest first) after
    ``trainguard replay``'s defaults, and the top one's lead rank."""
    with tempfile.TemporaryDirectory(prefix="tg-fold-") as tmp:
        backend = LocalBackend(Path(tmp))
        try:
            Importer(ReplayOptions(run_id="fold", logs=[(0, path)]), backend).run()
            backend.finish()
            top = judge.ordered(backend.incidents("fold"))
        finally:
            backend.close()
    lead = top[0].get("lead_rank") if top else None
    return tuple(f"{i['category']}/{i['subtype']}" for i in top), lead if isinstance(lead, int) else None


def _pasted(tmp_path: Path, lines: List[str]) -> Path:
    path = tmp_path / "log.txt"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_an_entrys_traceback_field_is_that_ranks_exception() -> None:
    # torchrun's entry for rank 1 ('rank : 1', 'exitcode : 1', then 'traceback : Traceback (most recent call
    # last):' and the worker's frames and exception two spaces further in): before, the field's lines were
    # plain lines of the file's rank 0 and the mismatch a log line
    got: List[LogItem] = list(LogReader(WILD / ENTRY / "log.txt", 0, min_level=""))
    (exc,) = [i for i in got if i.kind == "exception"]
    assert exc.rank == 1 and exc.payload["type"] == "RuntimeError"
    assert exc.payload["message"].startswith("Detected mismatch between collectives on ranks. Rank 1 is running")
    assert [f["function"] for f in exc.payload["frames"]] == ["wrapper", "main", "wrapper", "barrier"]
    assert not [i for i in got if i.kind == "log" and 'File "' in i.message]


def test_an_entrys_traceback_field_ends_where_the_summary_goes_on(tmp_path: Path) -> None:
    # the same entry followed by a summary's 'Root Cause' section (verbatim from zai-org/GLM-130B#100's
    # table, proc-exit1-table-two-ranks-glm130b-1): those lines are the summary's, not the exception's
    table = _lines("proc-exit1-table-two-ranks-glm130b-1")
    got = list(LogReader(_pasted(tmp_path, _lines(ENTRY) + table[table.index("Root Cause (first observed "
                                                                              "failure):") - 1:]), 0))
    (exc,) = [i for i in got if i.kind == "exception"]
    assert "Root Cause" not in exc.payload["message"] and "----" not in exc.payload["message"]
    exits = [i for i in got if i.kind == "log" and "exitcode  :" in i.message]
    assert [i.rank for i in exits] == [1, 6]


def test_a_torchrun_entrys_exit_then_that_ranks_own_error_the_error_leads() -> None:
    # the entry's 'exitcode : 1' (process/exit, rank 1) comes before its traceback field's mismatch: the
    # mismatch leads and the exit is folded in (before: process/exit led, the mismatch second)
    kinds, _lead = _shown(WILD / ENTRY / "log.txt")
    assert kinds == ("comm/mismatch",)



def test_a_launchers_exit_line_then_the_same_ranks_timeout_is_not_the_timeouts_cause(tmp_path: Path) -> None:
    # torchrun's 'failed (exitcode: 1) local_rank: 0' (llijiang/GuidedContrast#2,
    # comm-aborted-watchdog-reason-exit1-guidedcontrast-2-1), then rank 0's "what():  [Rank 0] Watchdog caught
    # collective operation timeout" (comm-watchdog-first-allgather-accelerate-test-1), as a paste interleaving
    # the launcher's stream with the worker's shows them: the timeout is what rank 0 died of, so it is not the
    # exit's consequence (rule 1 would fold it into the exit, which then led); the exit is the timeout's
    exit_line = _lines("comm-aborted-watchdog-reason-exit1-guidedcontrast-2-1")[1]
    timeout = _lines("comm-watchdog-first-allgather-accelerate-test-1")[0]
    assert "local_rank: 0" in exit_line and "[Rank 0] Watchdog caught" in timeout
    assert _shown(_pasted(tmp_path, [exit_line, timeout])) == (("comm/timeout",), 0)
    assert _shown(_pasted(tmp_path, [exit_line])) == (("process/exit",), 0)


def test_deepspeeds_teardown_then_a_workers_oom_the_oom_leads(tmp_path: Path) -> None:
    # DeepSpeed #1581's eight 'Killing subprocess PID' lines, then the OutOfMemoryError line of
    # deepspeedai/DeepSpeed#3869 (mem-oom-quoted-deepspeed-launcher-1, '> '-quoted as pasted): the launcher's
    # teardown is the worker's OOM's consequence, not a process/exit of its own
    killing = [ln for ln in _lines(TEARDOWN) if "Killing subprocess" in ln]
    oom = _lines("mem-oom-quoted-deepspeed-launcher-1")[0]
    assert len(killing) == 8 and "OutOfMemoryError" in oom
    assert _shown(_pasted(tmp_path, [*killing, oom]))[0] == ("memory/oom",)


def test_deepspeeds_teardown_alone_is_the_launchers_exit_and_names_no_rank() -> None:
    # #1581 pastes only the teardown and the launcher's own (cut) traceback: process/exit, and no lead rank
    # (the lines name PIDs; before, the paste opened nothing)
    assert _shown(WILD / TEARDOWN / "log.txt") == (("process/exit",), -1)
    # with DeepSpeed's 'exits with return code = 1' line naming --local_rank=4 (comm-root-exit1-rank4-1,
    # deepspeed teardown lines first): rank 4 leads, not the stream the teardown was read on
    assert _shown(WILD / "comm-root-exit1-rank4-1" / "log.txt") == (("process/exit",), 4)


def test_deepspeeds_teardown_then_its_signal_line_for_a_rank_that_rank_was_killed(tmp_path: Path) -> None:
    # DeepSpeed prints its teardown before the failed worker's exit line (proc-segv-deepspeed-launcher-1:
    # 'Killing subprocess' x2, then '... --local_rank=1 ...] exits with return code = -11'); with the worker
    # SIGKILLed (-9, the exit line of LLaVA's WSL run, proc-sigkill-deepspeed-llava-wsl-1) the run is that
    # kill, led as the kill alone is -- the teardown folds into it instead of leading with no rank
    killing = [ln for ln in _lines("proc-segv-deepspeed-launcher-1") if "Killing subprocess" in ln]
    killed = _lines("proc-sigkill-deepspeed-llava-wsl-1")  # one line, as the terminal wrapped it
    assert len(killing) == 2 and killed[-1].endswith("return code = -9")
    alone = _shown(WILD / "proc-sigkill-deepspeed-llava-wsl-1" / "log.txt")
    assert alone[0] == ("process/killed",)
    assert _shown(_pasted(tmp_path, killing + killed)) == alone


def test_an_exit_line_naming_a_local_rank_is_explained_by_any_ranks_own_error(tmp_path: Path) -> None:
    # torchrun's 'failed (exitcode: 1) local_rank: 2' (proc-exit1-launch-repvit-1) names a local rank -- on a
    # second node that is not global rank 2 -- so the OutOfMemoryError printed after it (DeepSpeed#3869's line,
    # mem-oom-quoted-deepspeed-launcher-1, read as the paste's rank 0) is what the worker died of: the OOM
    # leads, the exit is folded in (before, the rank numbers differed and the exit led)
    (exit_line,) = [ln for ln in _lines("proc-exit1-launch-repvit-1") if "local_rank: 2 (pid" in ln]
    oom = _lines("mem-oom-quoted-deepspeed-launcher-1")[0]
    assert _shown(_pasted(tmp_path, [exit_line, oom]))[0] == ("memory/oom",)
    # a failure entry's 'rank : 1' field is a global rank (pytorch/pytorch#148976's entry, its fields only):
    # another rank's error does not explain that exit
    entry = _lines(ENTRY)[4:10]
    assert entry[0] == "[1]:" and entry[-1].startswith("  error_file:")
    assert _shown(_pasted(tmp_path, [*entry, oom]))[0] == ("process/exit", "memory/oom")
