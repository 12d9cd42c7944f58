"""Wordings the classifier reads since stop 50 (hL8), from the TUNED side's misses of the seventeenth fresh
batch (c723b30c, measured once before any change), and the batch's healthy pastes:

* TensorFlow's collective executor reporting that the members of one collective instance brought tensors of
  different shapes -- ``Shape mismatch in the collective instance 106. Op at device ... expected shape [49]
  but another member in the group expected shape [64]`` -- bare after ``OP_REQUIRES failed``
  (tensorflow/tensorflow#34156) or inside ``Collective ops is aborted by:`` and a gRPC ``grpc_message``
  (tensorflow/tensorflow#56885): comm/mismatch. The cancellations around it alone are not a mismatch.
* tests/fixtures/healthy50b: five real pastes of runs that were training (DDP's find_unused_parameters
  warning three times -- after detectron2's start line, hard-wrapped, in markdown bold --, DDP's grad-strides
  warning, the scheduler-before-optimizer warning), judged healthy from their threads before the
  classifier ran on them.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.engine.test_classify_stop47_fresh11 import _log, _reading
from tests.engine.test_classify_stop49_fresh15 import five_healthy_pastes, opens_nothing
from trainguard_engine.classify import classify_text

HEALTHY = Path(__file__).resolve().parents[1] / "fixtures" / "healthy50b"

_SENTENCE = ("Shape mismatch in the collective instance 7. Op at device /job:worker/replica:0/task:0/device:GPU:0 "
             "expected shape [8,128] but another member in the group expected shape [6,128]. This is likely due "
             "to different input shapes at different members of the collective op.")
_CPU = "/job:worker/replica:0/task:1/device:CPU:0"


@pytest.mark.parametrize(("case", "facts"), [
    # tensorflow#34156 (tuned): the RingReduce's cancellation first, the bare OP_REQUIRES shape mismatch after it
    ("comm-mismatch-tf2-ringreduce-shape-mismatch-op-requires-grpc-cancelled-tensorflow-34156-1",
     {"backend": "tensorflow", "instance": 106, "device": _CPU, "shape": "[49]", "other_shape": "[64]"}),
    # tensorflow#56885 (tuned): inside a gRPC grpc_message and 'Collective ops is aborted by:' -- the
    # vocabulary fallback read it as a generic comm/failure before
    ("comm-mismatch-tf-collective-shape-mismatch-grpc-ringgather-ordering-token-tensorflow-56885-1",
     {"backend": "tensorflow", "instance": 244, "device": _CPU, "shape": "[98]", "other_shape": "[102]"}),
])
def test_the_tuned_pastes_read_as_a_collective_mismatch(case: str, facts: dict) -> None:
    found = classify_text(_log(case))
    assert found is not None and (found.kind, found.rule, found.facts) == (
        "comm/mismatch", "tensorflow.collective-shape-mismatch", facts)


@pytest.mark.parametrize("prefix", ["", "2022-01-05 10:00:00.000001: W tensorflow/core/framework/op_kernel.cc:1745] "
                                        "OP_REQUIRES failed at collective_ops.cc:466 : Invalid argument: ",
                                    "[1,0]<stderr>:tensorflow.python.framework.errors_impl.InvalidArgumentError: "
                                    "Collective ops is aborted by: "])
def test_the_sentence_reads_the_same_wherever_it_is_printed(prefix: str) -> None:
    assert _reading(prefix + _SENTENCE + "\n") == ("comm/mismatch", "tensorflow.collective-shape-mismatch")


@pytest.mark.parametrize("text", [
    "2019-11-11 11:45:07.181990: E tensorflow/core/common_runtime/ring_alg.cc:279] Aborting RingReduce with "
    "Cancelled: [_Derived_]Cancelled\n",
    "2019-11-11 11:45:07.182013: W tensorflow/core/common_runtime/base_collective_executor.cc:217] "
    "BaseCollectiveExecutor::StartAbort Cancelled: [_Derived_]Cancelled\n",
    "We saw a shape mismatch in the collective instance once; padding the last batch fixed it.\n",
    "INFO:tensorflow:Collective all_reduce tensors: 12 all_reduces, num_devices = 2, group_size = 4, "
    "implementation = CommunicationImplementation.NCCL, num_packs = 1\n",
])
def test_cancellations_prose_and_healthy_collective_lines_are_not_a_mismatch(text: str) -> None:
    assert _reading(text)[0] != "comm/mismatch"


def test_the_batch_has_its_five_healthy_pastes() -> None:
    five_healthy_pastes(HEALTHY)


@pytest.mark.parametrize("case", sorted(p.name for p in HEALTHY.iterdir()))
def test_healthy50b_pastes_open_nothing(case: str) -> None:
    opens_nothing(HEALTHY / case / "log.txt")
