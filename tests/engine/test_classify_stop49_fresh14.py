"""Wordings the classifier reads since stop 49 (hL5), from the TUNED side's misses of the fourteenth fresh
batch (e1e3408, measured once before any change), and the batch's healthy pastes:

* NCCL 2.27 returns ``invalid usage`` (ncclInvalidUsage) when its bootstrap finds no network interface; its
  ``Last error:`` says so (``Bootstrap : no socket interface found``, NVIDIA-NeMo/Speech#15019): a set-up
  failure (comm/init-failure), as the same last error is under ``internal error`` / ``unhandled system
  error``. An ``invalid usage`` without such a last error keeps NCCL's mismatch reading.
* tests/fixtures/healthy49: five real pastes of runs that were training (DDP's grad-strides and
  find_unused_parameters warnings, RVC's epoch lines), judged healthy from their threads.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.engine.test_classify_stop47_fresh11 import _log, _reading
from tests.services.replay.local_import import imported, shown
from trainguard_engine.classify import classify_text

HEALTHY = Path(__file__).resolve().parents[1] / "fixtures" / "healthy49"

NEMO = "comm-init-nccl-invalid-usage-bootstrap-no-socket-interface-tcpstore-recv-nemo-llm-pretrain-nemo-15019-1"
GFPGAN = "comm-init-nccl-invalid-usage-runtimeerror-glued-gfpgan-154-1"

_HEAD = ("RuntimeError: NCCL error in: /opt/pytorch/pytorch/torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:2897, "
         "invalid usage (run with NCCL_DEBUG=WARN for details), NCCL version 2.27.3\n"
         "ncclInvalidUsage: This usually reflects invalid usage of NCCL library.\n")


def test_the_tuned_paste_reads_as_set_up() -> None:
    found = classify_text(_log(NEMO))
    assert found is not None and (found.kind, found.rule) == ("comm/init-failure", "nccl.error")
    assert found.facts["code"] == "ncclInvalidUsage"
    assert found.facts["last_error"] == "Bootstrap : no socket interface found"


@pytest.mark.parametrize("last", ["Bootstrap : no socket interface found",
                                  "socketStartConnect: Connect to 10.0.0.2<43125> failed : Connection refused"])
def test_an_invalid_usage_whose_last_error_is_the_bootstrap_is_set_up(last: str) -> None:
    assert _reading(_HEAD + f"Last error:\n{last}\n") == ("comm/init-failure", "nccl.error")


@pytest.mark.parametrize("tail", ["", "Last error:\nCommunicator was not initialized with a device\n"])
def test_an_invalid_usage_without_a_bootstrap_last_error_stays_a_mismatch(tail: str) -> None:
    assert _reading(_HEAD + tail) == ("comm/mismatch", "nccl.error")


def test_the_glued_invalid_usage_paste_keeps_its_reading() -> None:
    """GFPGAN#154 (tuned, labelled uncertain): ``invalid usage`` with no last error -- not read as set-up."""
    assert _reading(_log(GFPGAN)) == ("comm/mismatch", "nccl.error")


@pytest.mark.parametrize("case", sorted(p.name for p in HEALTHY.iterdir()))
def test_healthy49_pastes_open_nothing(case: str) -> None:
    """tests/fixtures/healthy49: five real pastes of runs that were training (judged from their threads)."""
    text = (HEALTHY / case / "log.txt").read_text(encoding="utf-8")
    assert classify_text(text) is None
    assert shown(imported(HEALTHY / case / "log.txt")) == []
