"""Wordings the classifier reads since stop 46 (hL), each a class of pastes, found on the TUNED side of the
ninth fresh batch (aa50343: 25 logs labelled and committed before the classifier ran on them, measured once at
that commit before any of these rules existed):

* MosaicML Composer's launcher reporting a rank's end -- ``ERROR:composer.cli.launcher:Rank 1 crashed with exit
  code 1.`` (older Composer) and ``Global rank 0 (PID 147193) exited with code 1`` (newer) -- is that rank's
  exit, as torchrun's ``failed (exitcode: 1) local_rank: 1`` and DeepSpeed's ``exits with return code = 1``
  are: a plain code is process/exit (the rank's own error, when printed, is an incident of its own), a
  negative code the signal it stands for; the culprit is the rank it names. Both batch-9 pastes (mosaicml/
  examples#292, llm-foundry#726) opened nothing before.

Since hR's F2/F3 (hL2): a Composer ``Global rank N (PID P) exited with code -9/-15`` line is the launcher's own
kill of a survivor (read as nothing) beside its ``Killing`` / ``Failed to kill global rank N`` line or a ``Rank M
crashed`` line, and alone reads below ``log_min_confidence`` (replay and live capture read it as one record);
Horovod's rule steps aside for any exception line before the shutdown message, from the text's start, but
TensorFlow's ``N root error(s) found`` header of the shutdown itself.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.services.replay.local_import import imported, kind, pasted, shown
from trainguard_engine.catalogue import DetectionSettings
from trainguard_engine.classify import classify_text
from trainguard_engine.classify.torchrun import COMPOSER_BARE_KILL_CONFIDENCE

WILD = Path(__file__).resolve().parents[1] / "fixtures" / "wild"


def _read(text: str) -> tuple:
    found = classify_text(text)
    return () if found is None else (f"{found.category}/{found.subtype}", found.facts.get("rank"))


@pytest.mark.parametrize("case, rank", [
    ("proc-exit1-composer-launcher-rank1-crashed-resource-tracker-mosaicml-examples-292-1", 1),
    ("proc-exit1-composer-engine-closed-rank0-exited-code-1-llm-foundry-726-1", 0),
])
def test_composer_launcher_exit_pastes_read_process_exit(case: str, rank: int) -> None:
    assert _read((WILD / case / "log.txt").read_text(encoding="utf-8")) == ("process/exit", rank)


@pytest.mark.parametrize("line, kind, rank", [
    ("ERROR:composer.cli.launcher:Rank 3 crashed with exit code 1.", "process/exit", 3),
    ("ERROR:composer.cli.launcher:Global rank 5 (PID 208865) exited with code 2", "process/exit", 5),
    ("ERROR:composer.cli.launcher:Rank 0 crashed with exit code -11.", "process/exit", 0),  # SIGSEGV
    ("ERROR:composer.cli.launcher:Rank 2 crashed with exit code -9.", "process/killed", 2),  # its own SIGKILL
])
def test_composer_launcher_lines_read_by_their_code(line: str, kind: str, rank: int) -> None:
    text = ("2024-05-07 09:39:45,572: rank0[1003][MainThread]: INFO: composer.trainer.trainer: Run name: r1\n"
            f"{line}\nWaiting up to 30 seconds for all training processes to terminate. Press Ctrl-C to exit "
            "immediately.\n")
    assert _read(text) == (kind, rank)


# hR's F2 probes (/tmp/hR/replay_composer.py): Composer's launcher SIGTERMs the surviving ranks once one
# crashed, SIGKILLs those alive 30 s later, then logs the FIRST non-zero rank in rank order -- its own kill.
_RUN = ("2024-05-07 09:39:45,572: rank0[1003][MainThread]: INFO: composer.trainer.trainer: Run name: r1\n"
        "2024-05-07 09:40:01,000: rank0[1003][MainThread]: INFO: composer.trainer.trainer: epoch 0 batch 10 "
        "loss 2.31\n")
_WAIT = "Waiting up to 30 seconds for all training processes to terminate. Press Ctrl-C to exit immediately.\n"
_CRASH_THEN_SIGTERM = (_RUN + "ERROR:composer.cli.launcher:Rank 3 crashed with exit code 1.\n"
                       "Killing global rank 0 (PID 1003) with SIGTERM\nKilling global rank 1 (PID 1004) with "
                       "SIGTERM\n" + _WAIT + "Global rank 3 (PID 1006) exited with code 1\n"
                       "ERROR:composer.cli.launcher:Global rank 0 (PID 1003) exited with code -15\n")
_TAIL_ONLY = ("Killing global rank 0 (PID 1003) with SIGTERM\n" + _WAIT +
              "ERROR:composer.cli.launcher:Global rank 0 (PID 1003) exited with code -15\n")
_SIGKILL_AFTER_TIMEOUT = ("ERROR:composer.cli.launcher:Rank 2 crashed with exit code 1.\n"
                          "Killing global rank 0 (PID 1003) with SIGTERM\n" + _WAIT +
                          "WARNING:composer.cli.launcher:Failed to kill global rank 0 (PID 1003) with SIGTERM; "
                          "terminating with SIGKILL instead\n"
                          "ERROR:composer.cli.launcher:Global rank 0 (PID 1003) exited with code -9\n")
_SWAPPED = ("ERROR:composer.cli.launcher:Global rank 0 (PID 1003) exited with code -15\n"
            "ERROR:composer.cli.launcher:Rank 2 crashed with exit code 1.\n")  # streams interleaved


@pytest.mark.parametrize("text, read", [
    (_CRASH_THEN_SIGTERM, ("process/exit", 3)),
    (_SIGKILL_AFTER_TIMEOUT, ("process/exit", 2)),  # was process/killed of rank 0 in replay (OOM hint)
    (_SWAPPED, ("process/exit", 2)),
])
def test_the_launchers_kill_of_a_survivor_is_no_culprit(text: str, read: tuple) -> None:
    assert _read(text) == read


def test_the_launchers_kill_alone_names_no_culprit() -> None:
    found = classify_text(_TAIL_ONLY)  # was process/terminated, culprit rank 0 (the launcher's own SIGTERM)
    assert found is None or (found.rule != "launcher.signal" and "rank" not in found.facts)


@pytest.mark.parametrize("text, shown_kinds", [
    (_CRASH_THEN_SIGTERM, ["process/exit"]),
    (_SIGKILL_AFTER_TIMEOUT, ["process/exit"]),  # was ['process/exit', 'process/killed']
    (_TAIL_ONLY, []),  # was ['process/terminated']
    ("ERROR:composer.cli.launcher:Global rank 2 (PID 4410) exited with code -9\n", []),
    ("ERROR:composer.cli.launcher:Rank 2 crashed with exit code -9.\n", ["process/killed"]),
])
def test_replay_reads_the_launchers_kill_as_nothing(tmp_path: Path, text: str, shown_kinds: list) -> None:
    """``trainguard replay`` (as live capture) reads each line alone: a kill line's context is another record."""
    incidents = imported(pasted(tmp_path, text.splitlines()))
    assert shown(incidents) == shown_kinds
    assert sorted(kind(i) for i in incidents) == shown_kinds  # none left behind, explained or not


def test_a_bare_kill_code_line_is_the_ranks_death_below_the_live_threshold() -> None:
    """Without the launcher's kill lines or a ``Rank M crashed`` line the text shows the rank's own death,
    but Composer prints that first as ``Rank N crashed with exit code -9.``: the bare aggregate line reads at
    a confidence a log record alone does not open an incident with."""
    found = classify_text("ERROR:composer.cli.launcher:Global rank 2 (PID 4410) exited with code -9\n")
    assert found is not None and (found.kind, found.facts.get("rank")) == ("process/killed", 2)
    assert found.confidence == COMPOSER_BARE_KILL_CONFIDENCE < DetectionSettings().log_min_confidence
    assert found.note.startswith("Composer's launcher sends SIGTERM") and "Rank M crashed" in found.note


def test_composer_signal_keeps_its_name() -> None:
    found = classify_text("ERROR:composer.cli.launcher:Global rank 0 (PID 208865) exited with code -11\n")
    assert found is not None and found.facts.get("signal_name") == "SIGSEGV"


@pytest.mark.parametrize("text", [
    "ERROR:composer.cli.launcher:Global rank 0 (PID 208865) exited with code 0\n",
    # a healthy Composer run's own records: nothing ended
    "2023-04-24 16:03:12,379: rank0[1003409][MainThread]: DEBUG: composer.utils.dist: Initializing torch.dist: "
    "global_rank=0, local_rank=0, world_size=8, local_world_size=8, node_rank=0\n"
    "2023-04-24 16:05:40,101: rank0[1003409][MainThread]: INFO: composer.trainer.trainer: Spinning the "
    "dataloaders\n[batch=10/4800]:\n\t Train time/epoch: 0\n\t Train loss/train/total: 2.3012\n",
    # prose about a crash is not the launcher's line
    "the docs say a rank that crashed with exit code 1 should print its traceback first\n",
])
def test_no_composer_exit_no_reading(text: str) -> None:
    assert _read(text) == ()


# ---- Horovod's shutdown message (batch 9's tuned side: OpenNMT-tf#985, DeepLearningExamples#972) ----

_SHUT = ("Horovod has been shut down. This was caused by an exception on one of the ranks or an attempt to "
         "allreduce, allgather or broadcast a tensor after one of the ranks finished execution. If the shutdown "
         "was caused by an exception, you should see the exception in the log before the first shutdown "
         "message.")


@pytest.mark.parametrize("case", [
    "comm-rank-lost-horovod-shut-down-early-stopping-opennmt-tf-985-1",
    "comm-rank-lost-horovod-shut-down-op-requires-ncf-deeplearningexamples-972-1",
])
def test_horovod_shutdown_pastes_read_rank_lost(case: str) -> None:
    found = classify_text((WILD / case / "log.txt").read_text(encoding="utf-8"))
    assert found is not None and (found.kind, found.rule) == ("comm/rank-lost", "horovod.shut-down")


@pytest.mark.parametrize("text", [
    f"[1,0]<stderr>:tensorflow.python.framework.errors_impl.UnknownError: 2 root error(s) found.\n"
    f"[1,0]<stderr>:  (0) Unknown: {_SHUT}\n",
    "horovod.common.exceptions.HorovodInternalError: " + _SHUT.replace("was caused", "has been caused") + "\n",
])
def test_horovod_shutdown_wordings_read_rank_lost(text: str) -> None:
    assert _read(text)[:1] == ("comm/rank-lost",)


def test_an_exception_printed_before_the_shutdown_is_the_cause() -> None:
    text = ("[1,1]<stderr>:Traceback (most recent call last):\n"
            '[1,1]<stderr>:  File "train.py", line 88, in <module>\n'
            "[1,1]<stderr>:    batch = next(it)\n"
            "[1,1]<stderr>:KeyError: 'image'\n"
            "[1,1]<stderr>:\n[1,1]<stderr>:\n[1,1]<stderr>:\n"
            f"[1,0]<stderr>:W tensorflow/core/framework/op_kernel.cc:1651] OP_REQUIRES failed at mpi_ops.cc:316 : "
            f"Unknown: {_SHUT}\n")
    found = classify_text(text)  # the rule steps aside (what else the whole text reads is not this rule's)
    assert found is None or (found.rule != "horovod.shut-down" and found.kind != "comm/rank-lost")
    assert _read(text.split("[1,1]<stderr>:\n", 1)[1]) [:1] == ("comm/rank-lost",)  # without it: a peer gone


# hR's F3 probes (/tmp/hR/cls2.py): mpirun interleaves the ranks, so the culprit's own exception line is
# often right before a survivor's shutdown line, or kilobytes before it.
_CULPRIT = ("[1,0]<stderr>:Traceback (most recent call last):\n"
            '[1,0]<stderr>:  File "train.py", line 5, in <module>\n[1,0]<stderr>:    model.fit(x)\n'
            "[1,0]<stderr>:ValueError: Input 0 of layer dense is incompatible with the layer\n")
_SURVIVOR = f"[1,1]<stderr>:{_SHUT}\n"
_EPOCHS = "".join(f"[1,2]<stdout>:Epoch 1/10 step {i} - loss: 0.{i:04d}\n" for i in range(150))


@pytest.mark.parametrize("between", ["", "[1,0]<stdout>:a\n[1,0]<stdout>:b\n", _EPOCHS])
def test_the_culprits_exception_anywhere_before_the_shutdown_steps_aside(between: str) -> None:
    text = _CULPRIT + between + _SURVIVOR  # "" was comm/rank-lost (within 2 lines), _EPOCHS too (> 4 KB)
    assert len(_EPOCHS) > 4096
    found = classify_text(text)
    assert found is None or (found.rule != "horovod.shut-down" and found.kind != "comm/rank-lost")


def test_tensorflows_header_of_the_shutdown_is_no_culprit_however_far_the_log_goes() -> None:
    text = (_EPOCHS + "[1,0]<stderr>:tensorflow.python.framework.errors_impl.UnknownError: 2 root error(s) "
            f"found.\n[1,0]<stderr>:  (0) Unknown: {_SHUT}\n")
    assert _read(text)[:1] == ("comm/rank-lost",)


@pytest.mark.parametrize("before", [
    "a" * 1_000_000 + "\n", ("[" + "x" * 23) * 40_000 + "\n", "Error\n" * 200_000, "a." * 500_000 + "\n",
    "tensorflow.python.framework.errors_impl.UnknownError: 2 root error(s) found.\n" * 12_000,
])
def test_the_look_back_to_the_start_stays_linear(before: str) -> None:
    """The scan back to the text's start on ~1 MB of hostile text (hR's hostile.py) beside 1 MB of "x"."""
    def took(text: str) -> float:
        start = time.perf_counter()
        classify_text(text)
        return time.perf_counter() - start
    base = min(took("x" * len(before)) for _ in range(2))
    assert min(took(before + _SHUT) for _ in range(2)) < max(1.0, 20 * base)


@pytest.mark.parametrize("text", [
    "[1,0]<stdout>:Epoch 0/100, Batch 16/29316\n[1,0]<stdout>:Total loss is  236.61468505859375 ETA is  "
    "7:57:00.494483\n[1,1]<stdout>:Epoch 0/100, Batch 17/29316\n",
    "the FAQ: if Horovod has been shut down, look for the first rank's exception\n",
])
def test_no_horovod_shutdown_no_reading(text: str) -> None:
    found = classify_text(text)
    assert found is None or found.rule != "horovod.shut-down"
