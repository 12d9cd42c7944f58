"""hR3's review of stop 48's first classifier changes (96915fc), fixed by hL4: healthy lines those rules read
as failures, and what the fixes must keep.

* HIGH-1: a localized shell death word read anywhere a line starts with it, or after any ``xxx: `` prefix
  ('Episódio 12: Morto após 340 passos', 'INFO: Processus arrêté proprement ...'): now only bash's forms --
  the word alone on its line or after the job-report prefix ending in a pid, its core-dumped note in the
  locale's words, a command after two spaces -- and only zh_CN's words (the locale a real paste showed).
* MEDIUM-2: the pre-scan searches no needle with a non-ASCII character in an ASCII text.
* MEDIUM-3: XLA's ``Failed to allocate request`` in absl's ``W0000 00:00:<epoch>`` record, under a long
  autotuner warning, on a ``WARNING:absl:`` line or one that retries: no OOM.
* LOW-5: the bare PTX-toolchain string quoted, in a W record or a fallback line: no CUDA error.
* LOW-6: Horovod's ``Mismatched <what>`` only for controller.cc's own ``<what>``.
* LOW-8: ``problems such as this`` does not hide the failure the line states.
* (context in HIGH-1, pre-existing) the English whole-line form took any text after the word:
  ``INFO: Killed 2 stale dataloader workers before restart`` read process/killed.
"""

from __future__ import annotations

import pytest

from tests.engine.test_classify_stop47_fresh11 import _reading
from trainguard_engine.classify import classify_text
from trainguard_engine.classify.text import _Text

STEPS = "".join(f"epoch 1 step {n} loss 0.{90 - n} lr 3.0e-04\n" for n in range(10, 60, 10))


def _in_a_log(line: str) -> str:
    return STEPS + line + "\n" + STEPS


@pytest.mark.parametrize("line", [
    "W0000 00:00:1712345678.123456   12345 gemm_fusion_autotuner.cc:1045] Failed to compile config: "
    "RESOURCE_EXHAUSTED: Failed to allocate request for 64.00MiB (67108864B) on device ordinal 0",
    "W0000 00:00:1712345678.123456   12345 gpu_conv_algorithm_picker.cc:727] RESOURCE_EXHAUSTED: Out of memory "
    "while trying to allocate 2147483648 bytes.",
    "WARNING:absl:Autotuning skipped a config: RESOURCE_EXHAUSTED: Failed to allocate request for 64.00MiB "
    "(67108864B) on device ordinal 0; retrying with a smaller workspace",
])
def test_xla_allocation_wording_where_nothing_failed_is_no_oom(line: str) -> None:
    assert _reading(_in_a_log(line))[1] != "cuda.oom-plain"


def test_an_autotuner_candidates_failure_under_a_long_warning_is_no_oom() -> None:
    hlo = "%cudnn-conv = (f32[32,64,64,32]{2,1,3,0}, u8[0]{0}) custom-call(" + "f32[32,64,64,10] %copy.3, " * 60
    text = _in_a_log(
        "2022-12-12 14:17:37.451910: W external/org_tensorflow/tensorflow/compiler/xla/service/gpu/"
        f"gpu_conv_algorithm_picker.cc:727] All algorithms tried for {hlo}) failed. Falling back to default "
        "algorithm.  Per-algorithm errors:\n"
        "  Profiling failure on cuDNN engine 1#TC: RESOURCE_EXHAUSTED: Failed to allocate request for 2.00GiB "
        "(2147483648B) on device ordinal 0")
    assert _reading(text)[1] != "cuda.oom-plain"
    alone = "  Profiling failure on cuDNN engine 0: RESOURCE_EXHAUSTED: Failed to allocate request for 2.00GiB " \
            "(2147483648B) on device ordinal 0"  # as the replay reader passes the indented line on
    assert _reading(alone)[1] != "cuda.oom-plain"


def test_xlas_fatal_allocation_failure_is_still_an_oom() -> None:
    assert _reading("jaxlib.xla_extension.XlaRuntimeError: RESOURCE_EXHAUSTED: Failed to allocate request for "
                    "176.00MiB (184549376B) on device ordinal 0") == ("memory/oom", "cuda.oom-plain")


@pytest.mark.parametrize("line", [
    "2024-03-01 10:00:00.000: W external/xla/xla/stream_executor/cuda/cuda_asm_compiler.cc:200] Driver JIT "
    "failed: the provided PTX was compiled with an unsupported toolchain. Falling back to ptxas.",
    "[W] triton autotune: config BLOCK_M=128 skipped: the provided PTX was compiled with an unsupported "
    "toolchain; falling back to the eager kernel",
    "  * 'the provided PTX was compiled with an unsupported toolchain' means your driver is too old; update it.",
])
def test_the_ptx_string_where_nothing_failed_is_no_cuda_error(line: str) -> None:
    assert _reading(_in_a_log(line))[0] != "memory/cuda-error"


@pytest.mark.parametrize("line", [
    "Note: Mismatched learning rates: One rank may warm up faster, but another rank catches up after 100 steps.",
    "# Mismatched seeds: One rank uses seed 0, but another rank uses seed 1",
])
def test_free_text_mismatches_are_no_horovod_report(line: str) -> None:
    assert _reading(_in_a_log(line))[1] != "horovod.mismatch"


@pytest.mark.parametrize("line, what", [
    ("Mismatched prescale and/or postscale factors: One rank sent factors 1.0 and 1.0, but another rank sent "
     "factors 0.5 and 1.0.", "prescale and/or postscale factors"),
    ("Mismatched BROADCAST root ranks: One rank specified root rank 0, but another rank specified root rank 1.",
     "BROADCAST root ranks"),
    ("Mismatched operations: One rank did an ALLREDUCE, but another rank did an ALLGATHER.", "operations"),
])
def test_controller_cc_mismatches_are_read(line: str, what: str) -> None:
    found = classify_text(line)
    assert found is not None and found.rule == "horovod.mismatch" and found.facts["mismatch"] == what


def test_a_stated_failure_followed_by_such_as_this_is_read() -> None:
    line = "ERROR: Out of memory on GPU 0 while allocating activations; problems such as this go away with a " \
           "smaller batch"
    assert _reading(line)[0] == "memory/oom"
    assert _reading("Common problems such as out of memory are listed in the FAQ")[0] != "memory/oom"


def test_the_prescan_skips_non_ascii_needles_in_an_ascii_text() -> None:
    scan = frozenset({"killed", "已杀死"})
    ascii_text = _Text("epoch 1 loss 0.5\nKilled\n", scan)
    assert ascii_text.present == {"killed"} and not ascii_text.has("已杀死")
    wide = _Text("epoch 1 loss 0.5\n已杀死\n", scan)
    assert wide.present == {"已杀死"}


@pytest.mark.parametrize("line, kind", [
    ("Killed", "process/killed"),
    ("**Killed**", "process/killed"),
    ("Segmentation fault (core dumped)", "process/exit"),
    ("run.sh: line 12: 4242 Killed                  python train.py", "process/killed"),
    ("./train.sh: line 3:  1098 Floating point exception(core dumped) python train.py --x", "process/exit"),
    ("[good:02778] Signal: Segmentation fault (11)", "process/exit"),
    ("Killed  python train.py", "process/killed"),
])
def test_the_shells_english_reports_are_read(line: str, kind: str) -> None:
    assert _reading(_in_a_log(line)) == (kind, "launcher.signal")


@pytest.mark.parametrize("line", [
    "INFO: Killed 2 stale dataloader workers before restart",
    "Killed 3 enemies, reward 35.0",
    "Segmentation fault handler installed",
])
def test_sentences_starting_with_the_english_word_are_no_report(line: str) -> None:
    assert _reading(_in_a_log(line))[1] != "launcher.signal"
