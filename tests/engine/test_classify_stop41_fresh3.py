"""Wordings the classifier reads since stop 41 (hL2), each a class of pastes, found on the TUNED side of the
third fresh batch (5eb855d: 30 logs labelled and measured once before any of these rules existed); the lines
are cut from those wild-corpus logs (tests/fixtures/wild/<id>/source.txt names each thread):

* the ncclUniqueId store message without its leading ``[N] `` (a reader or a paste that took the tag for a
  line-number column, ``comm-init-uniqueid-store-get-socket-timeout-idle-kaito-135-1``) is still the set-up
  failure it is (comm/init-failure, the root rank named);
* NCCL's ``init.cc:N NCCL WARN Invalid rank requested : R/N`` is comm/init-failure (the communicator is never
  built: a wrong RANK / WORLD_SIZE; ``comm-init-nccl-warn-invalid-rank-aml-k8s-prefixed-58-1``);
* Open MPI's ``mpirun noticed that process rank N with PID P on node H exited on signal S (...)`` is that
  worker's signal death (by the exit decision path; the culprit N; horovod#298);
* Paddle's launcher ``Container rank N status failed cmd [...] code C`` is that worker's exit (the culprit N;
  PaddleDetection#7380);
* Slurm's ``Job N exceeded memory limit (A > B), being killed`` is a kill for host memory (process/killed),
  not the scheduler's cancellation its ``*** JOB N ... CANCELLED AT ... ***`` line would read as alone
  (coqui-ai/STT#2238)."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainguard_engine.classify import classify_text

WILD = Path(__file__).resolve().parents[1] / "fixtures" / "wild"


def _log(case_id: str) -> str:
    return (WILD / case_id / "log.txt").read_text(encoding="utf-8")


UNIQUE_ID = ("is setting up NCCL communicator and retrieving ncclUniqueId from [0] via c10d key-value store by key "
             "'0', but store->get('0') got error: Socket Timeout")


def test_unique_id_message_without_its_rank_tag() -> None:
    c = classify_text(UNIQUE_ID)
    assert c is not None and c.kind == "comm/init-failure" and c.rule == "c10d.rendezvous"
    assert c.facts["root_rank"] == 0 and "waiting_rank" not in c.facts
    tagged = classify_text("[1] " + UNIQUE_ID)
    assert tagged is not None and tagged.facts["waiting_rank"] == 1  # unchanged with the tag


def test_unique_id_paste_as_the_reader_leaves_it() -> None:
    text = "\n".join(line[4:] if line.startswith("[1] ") else line
                     for line in _log("comm-init-uniqueid-store-get-socket-timeout-idle-kaito-135-1").splitlines())
    c = classify_text(text)
    assert c is not None and c.kind == "comm/init-failure"


def test_nccl_invalid_rank_requested() -> None:
    line = ("job-pytorch-distr-nccl-1612503130-4b919e08-worker-1:25:25 [0] init.cc:981 NCCL WARN Invalid rank "
            "requested : 2/2")
    c = classify_text(line)
    assert c is not None and c.kind == "comm/init-failure" and c.rule == "nccl.debug"
    c = classify_text(_log("comm-init-nccl-warn-invalid-rank-aml-k8s-prefixed-58-1"))
    assert c is not None and c.kind == "comm/init-failure"


@pytest.mark.parametrize("signal, what, kind", [
    (4, "Illegal instruction: 4", "process/exit"),
    (11, "Segmentation fault", "process/exit"),
    (9, "Killed", "process/killed"),
])
def test_mpirun_noticed_a_signal(signal: int, what: str, kind: str) -> None:
    line = (f"mpirun noticed that process rank 1 with PID 0 on node tw-mbp-gbai exited on signal {signal} "
            f"({what}).")
    c = classify_text(line)
    assert c is not None and c.kind == kind and c.rule == "launcher.signal"
    assert c.facts["rank"] == 1 and c.facts["signal"] == signal


def test_mpirun_paste() -> None:
    c = classify_text(_log("proc-sigill-mpirun-noticed-rank1-signal4-horovod-298-1"))
    assert c is not None and c.kind == "process/exit" and c.facts["rank"] == 1


def test_paddle_container_failed() -> None:
    c = classify_text(_log("proc-exit1-paddle-launch-container-failed-rank0-ppdet-7380-1"))
    assert c is not None and c.kind == "process/exit" and c.facts == {"exitcode": 1, "rank": 0,
                                                                       "launcher": "paddle"}
    killed = classify_text("Container rank 3 status failed cmd ['python', '-u', 'train.py'] code -9 log "
                           "log/workerlog.3")
    assert killed is not None and killed.kind == "process/killed" and killed.facts["rank"] == 3


def test_slurm_memory_limit_is_a_kill_for_memory() -> None:
    c = classify_text(_log("proc-killed-slurmstepd-exceeded-memory-limit-cancelled-coqui-stt-2238-1"))
    assert c is not None and c.kind == "process/killed" and c.facts["killer"] == "slurm-memory-limit"
    # the cancellation alone stays what it was
    alone = classify_text("slurmstepd: error: *** JOB 7518 ON xantipa CANCELLED AT 2022-06-10T17:11:35 ***")
    assert alone is not None and alone.kind == "process/terminated"


_TRACEBACK = ('Traceback (most recent call last):\n  File "train.py", line 7, in main\n'
              '    raise ValueError("bad config: lr must be positive")\nValueError: bad config: lr must be positive\n')


@pytest.mark.parametrize("notice", ["slurmstepd: error: Exceeded step memory limit at some point.",
                                    "slurmstepd: error: Exceeded job memory limit at some point."])
def test_slurm_accounting_notice_is_not_a_kill(notice: str) -> None:
    """Slurm's ``Exceeded step memory limit at some point.`` is the accounting plugin's notice of a past peak, printed
    at the step's end whatever ended it: the traceback beside it stays the verdict (stop 41 review)."""
    c = classify_text(_TRACEBACK + notice + "\n")
    assert c is not None and c.kind == "process/exception"
    assert classify_text(notice) is None or classify_text(notice).kind != "process/killed"  # type: ignore[union-attr]


@pytest.mark.parametrize("text", [
    "the process exited on signal 4 (Illegal instruction: 4).",
    "Container rank 0 status ok cmd ['python'] code 0",
    "Container rank 0 status failed cmd ['python', '-u', 'train.py'] code 0 log log/workerlog.0",
    "memory usage exceeded the soft limit",
])
def test_near_misses_read_as_nothing(text: str) -> None:
    assert classify_text(text) is None
