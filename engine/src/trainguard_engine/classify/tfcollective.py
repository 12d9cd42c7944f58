"""Classifier rule for TensorFlow's collective ops (``MultiWorkerMirroredStrategy``, ``CollectiveAllReduce``,
``tf.raw_ops.CollectiveReduceV2`` ...): the collective executor's report that the members of one collective
instance brought tensors of different shapes,

    Shape mismatch in the collective instance 106. Op at device /job:worker/replica:0/task:1/device:CPU:0
    expected shape [49] but another member in the group expected shape [64]. This is likely due to different
    input shapes at different members of the collective op.

TensorFlow's fixed wording (its collective parameter resolver), printed bare by ``op_kernel.cc``'s
``OP_REQUIRES failed ... Invalid argument: Shape mismatch ...`` (tensorflow/tensorflow#34156) or inside the
abort every other member then sees, ``Collective ops is aborted by: Shape mismatch ...`` (also in a gRPC
error's ``grpc_message``, tensorflow/tensorflow#56885). The workers ran the same collective with
different inputs: comm/mismatch, TensorFlow's counterpart of c10d's ``Detected mismatch between
collectives``. The cancellations and aborts around it are its consequences.
"""

from __future__ import annotations

import re
from typing import Optional

from .text import Facts, _Hit, _on_rank, _rank_of, _search, _Text

_NEEDLE = "shape mismatch in the collective instance"
_SHAPE_RE = re.compile(r"Shape mismatch in the collective instance (?P<instance>\d{1,12})\. Op at device "
                       r"(?P<device>[^\s]{1,200}) expected shape (?P<shape>\[[^\]\n]{0,200}\]) but another "
                       r"member in the group expected shape (?P<other>\[[^\]\n]{0,200}\])")
"""The collective executor's sentence, every part bounded (the device a ``/job:.../device:...`` path)."""
_NOTE = ("the workers ran the same collective with tensors of different shapes: a worker-dependent input "
         "(an uneven last batch, a per-worker padding or model branch) or collectives issued in a different "
         "order on some worker")


def _rule_shape_mismatch(t: _Text) -> Optional[_Hit]:
    """TensorFlow's ``Shape mismatch in the collective instance N. Op at device D expected shape [a] but
    another member in the group expected shape [b]`` → comm/mismatch."""
    for pos in t.find_all(_NEEDLE):
        found = _search(_SHAPE_RE, t, pos, before=0, after=600)
        if found is None:
            continue
        m = found[1]
        facts: Facts = {"backend": "tensorflow", "instance": int(m.group("instance")),
                        "device": m.group("device"), "shape": m.group("shape"),
                        "other_shape": m.group("other")}
        rank = _rank_of(t, found[0] + m.start(), facts)
        return _Hit("comm", "mismatch", 0.85, found[0] + m.start(), facts,
                    f"TensorFlow collective instance {facts['instance']}: shape {facts['shape']} here, "
                    f"{facts['other_shape']} on another member{_on_rank(rank)}", _NOTE)
    return None


GATES = {"tensorflow.collective-shape-mismatch": (_NEEDLE,)}
"""The rule's needle (see ``classify.GATES``)."""

DOCS = {
    "tensorflow.collective-shape-mismatch": (
        "TensorFlow's collective executor ``Shape mismatch in the collective instance N. Op at device D "
        "expected shape [a] but another member in the group expected shape [b]`` (bare after ``OP_REQUIRES "
        "failed``, or inside ``Collective ops is aborted by:`` / a gRPC ``grpc_message``) → comm/mismatch"
    ),
}
"""What the rule recognises (docs/classifier.md is made of these)."""
