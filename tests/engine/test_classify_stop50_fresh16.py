"""Wordings the classifier reads since stop 50 (hL7), from the TUNED side's misses of the sixteenth fresh
batch (efc809f7, measured once before any change), and the batch's healthy pastes:

* NCCL's IB transport reporting a fatal asynchronous event of the local adapter -- ``NET/IB : Got async
  event : local catastrophic error`` (NCCL < 2.19 prints every event at WARN; only libibverbs' fatal ones
  are read: catastrophic error, port error, a queue pair's / completion queue's error) and NCCL 2.19+'s
  ``NET/IB : mlx5_ib0:1 async fatal event on QP (...): ...`` -- is the node's fabric failing under the job:
  comm/failure, tried before the completion errors that follow it (NVIDIA/nccl#230, #1905). Routine events
  (``GID table change``, ``port active``, NCCL's ``async non-fatal event``) stay quiet.
* tests/fixtures/healthy50: five real pastes of runs that were training (DataParallel's gather-scalars
  warning twice, the use_reentrant warning with a settings block, HF Trainer loss dicts with the gather
  warning run on from a progress bar, the use_cache / gradient-checkpointing notice), judged healthy from
  their threads before the classifier ran on them.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.engine.test_classify_stop47_fresh11 import _log, _reading
from tests.engine.test_classify_stop49_fresh15 import five_healthy_pastes, opens_nothing
from trainguard_engine.classify import classify_text

HEALTHY = Path(__file__).resolve().parents[1] / "fixtures" / "healthy50"

CATASTROPHIC = "comm-failure-nccl-ib-local-catastrophic-error-mpi-tagged-timestamps-830k-iterations-nccl-230-1"
QP_FATAL = "comm-failure-nccl-ib-fatal-error-ncclibtest-local-access-violation-status-4-tp16-nccl-1905-1"
_PREFIX = "gpu5:35917:35994 [0] transport/net_ib.cc:180 NCCL WARN NET/IB : "


def test_the_tuned_catastrophic_error_paste_reads_as_a_fabric_failure() -> None:
    found = classify_text(_log(CATASTROPHIC))
    assert found is not None and (found.kind, found.rule) == ("comm/failure", "nccl.ib-error")
    assert found.facts["ib_event"] == "local catastrophic error"


def test_the_fatal_queue_pair_event_is_read_before_the_completion_error_after_it() -> None:
    """nccl#1905 (tuned, labelled uncertain): the local QP's fatal event, then ``Got completion from peer ...
    status=4`` (a local protection error): the adapter's fault, not a peer that went away."""
    found = classify_text(_log(QP_FATAL))
    assert found is not None and (found.kind, found.rule) == ("comm/failure", "nccl.ib-error")
    assert found.facts == {"ib_event": "local access violation work queue error", "device": "mlx5_ib0"}


@pytest.mark.parametrize("event", ["Got async event : local catastrophic error", "mlx5_2:1 Got async event : port error",
                                   "Got async event : local work queue catastrophic error",
                                   "Got async event : CQ error",
                                   "mlx5_0:1 async fatal event on QP (0x7f69f01519a8): invalid request local work "
                                   "queue error"])
def test_fatal_async_events_are_a_fabric_failure(event: str) -> None:
    assert _reading(_PREFIX + event + "\n") == ("comm/failure", "nccl.ib-error")


@pytest.mark.parametrize("event", ["Got async event : GID table change", "mlx5_0:1 Got async event : port active",
                                   "Got async event : client reregistration", "Got async event : LID change",
                                   "mlx5_0:1 async non-fatal event on QP (0x7f69f01519a8): path migration "
                                   "request succeeded"])
def test_routine_async_events_stay_quiet(event: str) -> None:
    assert classify_text(_PREFIX + event + "\n") is None


def test_a_completion_error_alone_keeps_its_lost_peer_reading() -> None:
    text = (_PREFIX + "Got completion from peer 10.1.2.3<44206> with status=12 opcode=129 len=65536 vendor err 129 "
            "(Recv) localGid ::ffff:29.87.88.182 remoteGids::ffff:29.87.4.221\n")
    assert _reading(text) == ("comm/rank-lost", "nccl.ib-error")


def test_the_batch_has_its_five_healthy_pastes() -> None:
    five_healthy_pastes(HEALTHY)


@pytest.mark.parametrize("case", sorted(p.name for p in HEALTHY.iterdir()))
def test_healthy50_pastes_open_nothing(case: str) -> None:
    opens_nothing(HEALTHY / case / "log.txt")
