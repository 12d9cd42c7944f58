"""The vocabulary fallback (classify/vocab.py, stop 44, hL2): a general reading of error text no specific rule
recognised, by small vocabularies written from the catalogue's definitions of each kind.

* each vocabulary reads a wording no specific rule knows (written for the vocabulary, not copied from any log),
  and with the layer switched off the same text is nothing / a plain Python exception;
* healthy lines (progress, metrics, INFO / WARNING records, a clean exit, a best-so-far ``inf``, counters of
  OOMs or NaN iterations, quoted source lines) stay quiet;
* the layer never moves what a specific rule says: every line and every whole log of the wild corpus classifies
  the same with it on and off wherever the answer without it is neither nothing nor ``python.exception``."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator, Optional, Tuple

import pytest

import trainguard_engine.classify as classify
from trainguard_engine.classify import Classification, classify_exception, classify_text

WILD = Path(__file__).resolve().parents[1] / "fixtures" / "wild"


def _kind(found: Optional[Classification]) -> str:
    return "" if found is None else f"{found.category}/{found.subtype}"


def _off(fn, *args):  # type: ignore[no-untyped-def]
    saved = classify.VOCABULARY
    classify.VOCABULARY = False
    try:
        return fn(*args)
    finally:
        classify.VOCABULARY = saved


@pytest.mark.parametrize("text, kind, rule", [
    # memory: other stacks' allocators and Python's own
    ("RuntimeError: NPU allocator: insufficient memory on device 3 while loading the shard", "memory/oom",
     "vocab.memory"),
    ("E0412 12:00:01.123 alloc.cc:88] Fatal: failed to allocate 8589934592 bytes on accelerator 0", "memory/oom",
     "vocab.memory"),
    ("Error: device malloc failed for the activation buffer (requested 2.00 GiB)", "memory/oom", "vocab.memory"),
    ("mlx.core error: not enough memory to complete the operation", "memory/oom", "vocab.memory"),
    # comm: a collective word and a failure word on one error-bearing line
    ("MPI_ABORT was invoked on rank 3 in communicator MPI_COMM_WORLD with errorcode 1", "comm/failure",
     "vocab.comm"),
    ("horovod.common.exceptions.HorovodInternalError: ncclAllReduce failed: connection reset by peer",
     "comm/rank-lost", "vocab.comm"),
    ("RuntimeError: HCCL rendezvous failed: could not connect to the root rank at 10.0.0.2", "comm/init-failure",
     "vocab.comm"),
    ("ERROR: oneCCL allreduce timed out after 1800 seconds", "comm/timeout", "vocab.comm"),
    # loss: 'loss' with a non-finite value on an error-bearing line
    ("FATAL: reconstruction loss diverged to -inf (step 12)", "loss/non_finite", "vocab.loss"),
    ("[fatal] step 40: loss tensor contains NaN; aborting", "loss/non_finite", "vocab.loss"),
    # process: how the process ended, through the catalogue's exit table
    ("Process finished with exit code 137", "process/killed", "vocab.process"),
    ("job step 12: worker exited with status 143", "process/terminated", "vocab.process"),
    ("fatal: runner received SIGSEGV in libfoo.so", "process/exit", "vocab.process"),
    ("[job 77] task failed, exit value 3", "process/exit", "vocab.process"),
    ("error: trainer aborted by SIGABRT while the CUDA context was being torn down", "memory/oom-or-cuda-error",
     "vocab.process"),
    ("error: worker 3 got SIGBUS while reading the memmap", "process/exit", "vocab.process"),
    # io: a file system refusing a write is the catalogue's Python exception, not memory
    ("ResourceExhaustedError: /ckpt/model.tmp; No space left on device [Op:SaveV2]", "process/exception",
     "vocab.io"),
])
def test_each_vocabulary_reads_a_wording_no_rule_knows(text: str, kind: str, rule: str) -> None:
    found = classify_text(text)
    assert _kind(found) == kind and found is not None and found.rule == rule
    assert found.confidence in (classify.vocab.CONFIDENCE, classify.vocab.UNMARKED_CONFIDENCE) and found.lines
    without = _off(classify_text, text)
    assert without is None or without.rule == "python.exception"


@pytest.mark.parametrize("exc_type, message, kind", [
    ("paddle.base.core.EnforceNotMet", "ResourceExhaustedError: cannot allocate 2.5 GiB on Place(gpu:0)",
     "memory/oom"),
    ("mindspore.RuntimeError", "Collective allgather failed: HCCL timed out waiting for rank 2", "comm/timeout"),
    ("OSError", "[Errno 122] Disk quota exceeded: '/scratch/run/ckpt.pt'", "process/exception"),
])
def test_an_exception_no_rule_knows_is_read_by_its_message(exc_type: str, message: str, kind: str) -> None:
    found = classify_exception(exc_type, message)
    assert _kind(found) == kind and found.rule.startswith("vocab.")
    assert _off(classify_exception, exc_type, message).rule == "python.exception"


@pytest.mark.parametrize("text", [
    "Epoch 3/10 - loss: 0.4123 - accuracy: 0.8812 - val_loss: 0.5012",
    "Epoch 1: val_loss improved from inf to 0.53421, saving model to best.h5",
    "| epoch 027 | loss 6.343 | nll_loss 4.984 | ppl 31.65 | oom 0 | loss_scale 0.500 | wall 230",
    "iteration 10/100 | lm loss: 7.3E-01 | number of skipped iterations: 0 | number of nan iterations: 0 |",
    "100%|██████████| 500/500 [01:02<00:00,  8.01it/s]",
    "NCCL INFO Bootstrap : Using eth0:10.0.0.1<0>",
    "node0:123:123 [0] misc/ibvwrap.cc:63 NCCL WARN Failed to open libibverbs.so[.1]",
    "I0425 17:05:53.758841  4566 ProcessGroupNCCL.cpp:686] NCCL_ASYNC_ERROR_HANDLING: 1",
    "WARNING: the process group timeout is set to 1800 s; a slow data loader may be killed",
    "UserWarning: this may run out of memory on small GPUs",
    "W tensorflow/core/common_runtime/bfc_allocator.cc:275] Ran out of memory trying to allocate 39.81MiB.",
    "    pg = ProcessGroupGloo(prefix_store, rank, world_size, timeout=timeout)",
    '    raise RuntimeError("Failed to initialize NCCL")',
    "SeqNum=7, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=1800000",
    "Process finished with exit code 0",
    "trainer exited with code 1",
    "[  +0.000005] pcieport 0000:00:03.0: PCIe Bus Error: severity=Corrected, type=Data Link Layer",
    "Saved checkpoint to /ckpt/step_1000 (no errors)",
    "All ranks reached the barrier; training starts",
    "MemoryError: Unable to allocate 74.5 GiB for an array with shape (100000, 100000)",  # host memory
    "OSError: [Errno 12] Cannot allocate memory",
    "the job was killed by the scheduler",  # prose: launcher.signal's words, left as it leaves them
    "Aborted (core dumped)",  # a shell's abort: left to the exit path
    "capture[rank1] scenario=timeout backend=nccl world=2 device=cuda:1 pid=869",  # a configuration line
    "/work/jobs/nccl/train.py FAILED",  # a path's words are not a collective's
    "  exitcode  : -6 (pid: 868)",  # torchrun's table: torchrun.* reads it
])
def test_healthy_lines_stay_quiet(text: str) -> None:
    assert classify_text(text) is None


@pytest.mark.parametrize("text", [
    # hR's review of ecae859: what live WARNING records and healthy prints say (the SDK's record carries no
    # level word): a setting, a retry, a fallback, a hypothetical -- no reading
    "NCCL timeout set to 1800 s; a collective that takes longer will fail",
    "Not enough memory to run cudnn benchmark for this shape, falling back to the default algorithm",
    "The barrier timed out after 30 s on the first attempt, retrying",
    "Failed to connect to the process group store, retrying in 1 s",
    "NCCL timeout: 1800 s (collective ops fail after that)",
])
def test_a_retry_a_fallback_or_a_setting_is_no_failure(text: str) -> None:
    found = classify_text(text)
    assert found is None or not found.rule.startswith("vocab."), found


def test_only_a_marked_line_or_an_exception_reads_at_the_log_threshold() -> None:
    from trainguard_engine.catalogue import DetectionSettings
    threshold = DetectionSettings().log_min_confidence
    unmarked = classify_text("Could not allocate the full KV cache for 64 sequences (insufficient memory)")
    assert unmarked is not None and unmarked.rule == "vocab.memory" and unmarked.confidence < threshold
    marked = classify_text("[ERROR] kv_cache.cc:88 Could not allocate the KV cache (insufficient memory)")
    assert marked is not None and marked.rule == "vocab.memory" and marked.confidence >= threshold
    glog = classify_text("E0412 12:00:01.123 alloc.cc:88] failed to allocate 8589934592 bytes on device 0")
    assert glog is not None and glog.confidence >= threshold
    raised = classify_exception("mlx.core.RuntimeError", "not enough memory to complete the operation")
    assert raised.rule == "vocab.memory" and raised.confidence >= threshold


def test_a_specific_rule_wins_over_the_vocabulary() -> None:
    text = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 79.15 GiB total capacity)"
    assert classify_text(text).rule == "cuda.oom"  # type: ignore[union-attr]


def _texts() -> Iterator[Tuple[str, str]]:
    for log in sorted(WILD.glob("*/log.txt")):
        text = log.read_text(encoding="utf-8", errors="replace")
        yield log.parent.name, text
        for line in text.splitlines():
            yield log.parent.name, line


def test_the_layer_moves_no_specific_reading_of_the_wild_corpus() -> None:
    assert WILD.is_dir()
    moved, read = [], 0
    for case, text in _texts():
        without = _off(classify_text, text)
        if without is None or without.rule == "python.exception":
            continue
        read += 1
        with_it = classify_text(text)
        if with_it != without:
            moved.append(f"{case}: {without.rule} -> {with_it.rule if with_it else None}")
    assert read > 2_000 and not moved, f"{len(moved)} specific readings moved"  # ids unlisted: held-out logs


def test_the_fast_reading_of_error_marks_is_the_regex_on_every_wild_line() -> None:
    vocab = classify.vocab
    lines = [line for _case, text in _texts() for line in text.splitlines()[:400]]
    assert len(lines) > 5_000
    for line in lines:
        assert vocab._error_bearing(line, line.lower()) == (vocab.ERROR_MARKERS.search(line) is not None), line
        if vocab.ERROR_MARKERS.search(line) or (vocab._LOSS_MARKERS.search(line) and vocab._LOSS.search(line)):
            assert any(needle in line.lower() for needle in vocab._NEEDLES), line
