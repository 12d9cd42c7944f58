"""What a paste carries, read since stop 44 (hL), found on the TUNED side of the sixth fresh batch (79dde67), and
the stop-44 classifier readings seen end to end through ``trainguard replay``. The lines are written for the
shape (not copied from the batch's pastes):

* a qualified exception line pasted at the end of a sentence without quotes (``I hit this too.
  tensorflow.python.framework.errors_impl.X: ...``) is that exception (:func:`quoted_exception`); an
  unqualified name in prose, or a warning's, is not;
* a ``Killed`` glued to an interrupted progress bar, bash's job report after one, submitit's preemption, a
  SIGHUP death signal, PaddlePaddle's allocator summary, HIP's missing code object, TensorFlow's CheckNumerics
  and a lost GPU open their incidents from a pasted log."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainguard_server.replay.logs import quoted_exception

from .local_import import imported, pasted, shown


@pytest.mark.parametrize("line, expected", [
    ("Same problem here.   tensorflow.python.framework.errors_impl.ResourceExhaustedError: /ckpt/model.tmp; No "
     "space left on device",
     "tensorflow.python.framework.errors_impl.ResourceExhaustedError: /ckpt/model.tmp; No space left on device"),
    ("after 3 epochs it crashed:  torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:1970",
     "torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:1970"),
])
def test_inline_qualified_exception(line: str, expected: str) -> None:
    assert quoted_exception(line) == expected


@pytest.mark.parametrize("line", [
    "I think RuntimeError: is raised here when the file is missing",   # unqualified, no error lead + quote
    "see the docs of torch.cuda for details: nothing here",            # no exception name
    "WARNING   retrying.  botocore.exceptions.ConnectionError: endpoint unreachable",   # a warning: handled
])
def test_not_an_inline_exception(line: str) -> None:
    assert quoted_exception(line) is None


def test_inline_exception_is_imported(tmp_path: Path) -> None:
    path = pasted(tmp_path, ["It fails the same way for me.    tensorflow.python.framework.errors_impl."
                             "ResourceExhaustedError: /data/run/variables_temp/part-00000; No space left on device"])
    assert shown(imported(path)) == ["process/exception"]


@pytest.mark.parametrize("lines, kind", [
    (["Epoch 2/5", " 9984/50000 [====>.........................] - ETA: 8:02 - loss: 1.0311Killed"],
     "process/killed"),
    (["eval:  3%|" + " " * 120 + "| 30/1000 [00:05<02:41,  6.01it/s]./run.sh: line 4: 777 Killed"
      "                 python main.py"], "process/killed"),
    (["submitit INFO (2024-05-01 02:59:00,000) - Starting with JobEnvironment(job_id=42, hostname=n7)",
      "submitit WARNING (2024-05-01 03:00:00,000) - Caught signal SIGUSR2 on n7: this job is preempted.",
      "submitit INFO (2024-05-01 03:00:00,010) - Exiting gracefully after preemption/timeout."],
     "process/terminated"),
    (["W0101 10:00:00.000000 4242 torch/distributed/elastic/agent/server/api.py:704] Received 1 death signal, "
      "shutting down workers",
      "W0101 10:00:00.001000 4242 torch/distributed/elastic/multiprocessing/api.py:897] Sending process 4243 "
      "closing signal SIGHUP"], "process/terminated"),
    (["Error Message Summary:", "----------------------", "ResourceExhaustedError: ", "",
      "Out of memory error on GPU 0. Cannot allocate 64.000244MB memory on GPU 0, available memory is only "
      "10.500000MB."], "memory/oom"),
    (["2021-01-01 00:00:00.000000: I tensorflow/stream_executor/platform/default/dso_loader.cc:53] Successfully "
      "opened dynamic library libamdhip64.so",
      '"hipErrorNoBinaryForGpu: Unable to find code object for all current devices!"', "Aborted (core dumped)"],
     "memory/cuda-error"),
    (["Traceback (most recent call last):", '  File "train.py", line 40, in <module>',
      "    sess.run(train_op)",
      "tensorflow.python.framework.errors_impl.InvalidArgumentError: Gradient for conv1/kernel:0 is NaN : Tensor "
      "had NaN values", "\t [[node CheckNumerics_7]]"], "gradient/nan-source"),
    (["$ nvidia-smi", "Unable to determine the device handle for GPU0000:65:00.0: Unknown Error"],
     "memory/cuda-error"),
])
def test_stop44_wordings_open_their_incidents(tmp_path: Path, lines: list, kind: str) -> None:
    assert shown(imported(pasted(tmp_path, lines)))[:1] == [kind]
