"""Wordings the classifier reads since stop 46 (hL), each a class of pastes, found on the TUNED side of the
ninth fresh batch (aa50343: 25 logs labelled and committed before the classifier ran on them, measured once at
that commit before any of these rules existed):

* MosaicML Composer's launcher reporting a rank's end -- ``ERROR:composer.cli.launcher:Rank 1 crashed with exit
  code 1.`` (older Composer) and ``Global rank 0 (PID 147193) exited with code 1`` (newer) -- is that rank's
  exit, as torchrun's ``failed (exitcode: 1) local_rank: 1`` and DeepSpeed's ``exits with return code = 1``
  are: a plain code is process/exit (the rank's own error, when printed, is an incident of its own), a
  negative code the signal it stands for; the culprit is the rank it names. Both batch-9 pastes (mosaicml/
  examples#292, llm-foundry#726) opened nothing before.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from trainguard_engine.classify import classify_text

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
    ("ERROR:composer.cli.launcher:Global rank 2 (PID 4410) exited with code -9", "process/killed", 2),
])
def test_composer_launcher_lines_read_by_their_code(line: str, kind: str, rank: int) -> None:
    text = ("2024-05-07 09:39:45,572: rank0[1003][MainThread]: INFO: composer.trainer.trainer: Run name: r1\n"
            f"{line}\nWaiting up to 30 seconds for all training processes to terminate. Press Ctrl-C to exit "
            "immediately.\n")
    assert _read(text) == (kind, rank)


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


@pytest.mark.parametrize("text", [
    "[1,0]<stdout>:Epoch 0/100, Batch 16/29316\n[1,0]<stdout>:Total loss is  236.61468505859375 ETA is  "
    "7:57:00.494483\n[1,1]<stdout>:Epoch 0/100, Batch 17/29316\n",
    "the FAQ: if Horovod has been shut down, look for the first rank's exception\n",
])
def test_no_horovod_shutdown_no_reading(text: str) -> None:
    found = classify_text(text)
    assert found is None or found.rule != "horovod.shut-down"
