"""Wordings the classifier reads since stop 48 (hL3), from the TUNED side's misses of the twelfth fresh batch
(8226d5b, measured once before any change):

* XLA's StreamExecutor allocator adapter, ``RESOURCE_EXHAUSTED: Failed to allocate request for 176.00MiB
  (184549376B) on device ordinal 0`` (its fixed format), is the device out of memory, as XLA's ``Out of memory
  while trying to allocate`` is (jax_privacy#10 read nothing through replay).
* Horovod's coordinator refusing a collective the ranks submitted differently -- its fixed ``Mismatched
  <what>: One rank ..., but another rank ...`` (data types, MPI operations, tensor shapes, root ranks, CPU/GPU
  device selection) -- is comm/mismatch (horovod#748 read comm/failure by vocabulary).
* The CUDA runtime's string for cudaErrorUnsupportedPtxVersion, ``the provided PTX was compiled with an
  unsupported toolchain``, is a CUDA error (the driver older than the toolchain) also without a ``CUDA error:``
  prefix (jaxlib's ``operation cudaGetLastError() failed: ...``; VaxNeRF#1 read process/exception).
* The shell's death report in its locale -- glibc's translated ``strsignal`` words (``已杀死`` for Killed,
  ``段错误`` for Segmentation fault; zh_CN only since hL4's fix of hR3's HIGH-1) -- is read as bash prints it (dreamerv3#203
  read nothing).
* A line naming failures by example (``an error such as OOM``: Ray Train's TrainingFailedError boilerplate) is
  no statement of one (ray#47974 read memory/oom from it).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.engine.test_classify_stop47_fresh11 import _log, _reading
from tests.services.replay.local_import import imported, shown
from trainguard_engine.classify import classify_text

WILD = Path(__file__).resolve().parents[1] / "fixtures" / "wild"
HEALTHY = Path(__file__).resolve().parents[1] / "fixtures" / "healthy48"

XLA_REQUEST = "mem-oom-xla-resource-exhausted-failed-to-allocate-request-jax-privacy-10-1"
HOROVOD = "comm-mismatch-horovod-allreduce-cpu-gpu-device-selection-horovod-748-1"
PTX = "mem-cuda-ptx-unsupported-toolchain-jax-prng-absl-app-vaxnerf-1-1"
ZH_KILLED = "proc-killed-dreamerv3-metrics-then-chinese-killed-dreamerv3-203-1"
RAY = "proc-exception-ray-train-trainingfailederror-ipython-frame-ray-47974-1"


@pytest.mark.parametrize("case, kind, rule", [
    (XLA_REQUEST, "memory/oom", "cuda.oom-plain"),
    (HOROVOD, "comm/mismatch", "horovod.mismatch"),
    (PTX, "memory/cuda-error", "cuda.error"),
    (ZH_KILLED, "process/killed", "launcher.signal"),
])
def test_the_tuned_pastes(case: str, kind: str, rule: str) -> None:
    assert _reading(_log(case)) == (kind, rule)
    assert shown(imported(WILD / case / "log.txt"))[:1] == [kind]


def test_ray_trainingfailederror_is_the_programs_exception_not_an_oom() -> None:
    assert _reading(_log(RAY))[0] != "memory/oom"
    assert shown(imported(WILD / RAY / "log.txt"))[:1] == ["process/exception"]


@pytest.mark.parametrize("line", [
    "RESOURCE_EXHAUSTED: Failed to allocate request for 2.00GiB (2147483648B) on device ordinal 1",
    "jaxlib.xla_extension.XlaRuntimeError: Resource exhausted: Failed to allocate request for 1.5GiB "
    "(1610612736B) on device ordinal 0",
])
def test_xla_failed_to_allocate_request_forms(line: str) -> None:
    assert _reading(line) == ("memory/oom", "cuda.oom-plain")


def test_xla_failed_to_allocate_request_inside_an_autotuner_warning_stays_quiet() -> None:
    line = ("2024-01-01 10:00:00.000: W external/xla/xla/service/gpu/gemm_algorithm_picker.cc:350] Failed to "
            "autotune: RESOURCE_EXHAUSTED: Failed to allocate request for 64.00MiB (67108864B) on device ordinal 0")
    assert _reading(line)[0] != "memory/oom"


@pytest.mark.parametrize("line, what", [
    ("Mismatched data types: One rank had type float32, but another rank had type float16.", "data types"),
    ("Mismatched MPI operations: One rank did an ALLREDUCE, but another rank did an ALLGATHER.",
     "MPI operations"),
    ("[1,0]<stderr>:RuntimeError: Mismatched ALLREDUCE tensor shapes: One rank sent a tensor of shape [10], "
     "but another rank sent a tensor of shape [12].", "ALLREDUCE tensor shapes"),
])
def test_horovod_mismatch_forms(line: str, what: str) -> None:
    found = classify_text(line)
    assert found is not None and (found.category, found.subtype, found.rule) == ("comm", "mismatch",
                                                                                 "horovod.mismatch")
    assert found.facts["mismatch"] == what


@pytest.mark.parametrize("line", [
    "Rank 0 and rank 1 sent the same shapes, but another rank was slower this epoch",
    "mismatched brackets: one rank of the table, but another rank of it is missing",
])
def test_prose_about_ranks_is_no_horovod_mismatch(line: str) -> None:
    assert _reading(line)[1] != "horovod.mismatch"


@pytest.mark.parametrize("line", [
    "RuntimeError: CUDA error: the provided PTX was compiled with an unsupported toolchain.",
    "INTERNAL: CustomCall failed: jaxlib/gpu_prng_kernels.cc:33: operation gpuGetLastError() failed: the "
    "provided PTX was compiled with an unsupported toolchain.",
])
def test_the_ptx_toolchain_string_is_a_cuda_error(line: str) -> None:
    found = classify_text(line)
    assert found is not None and (found.category, found.subtype) == ("memory", "cuda-error")
    assert found.facts["error_class"] == "driver-too-old"


@pytest.mark.parametrize("line, kind", [
    ("已杀死", "process/killed"),
    ("段错误 (核心已转储)", "process/exit"),
    ("段错误\uff08核心已转储\uff09 python train.py", "process/exit"),  # full-width brackets
    ("run.sh: 第 6 行\uff1a  3305 已杀死                  python train.py", "process/killed"),  # bash's job report
    ("**已杀死**", "process/killed"),
])
def test_localized_shell_death_reports(line: str, kind: str) -> None:
    assert _reading(f"epoch 3 step 120 loss 0.41\n{line}\n") == (kind, "launcher.signal")


@pytest.mark.parametrize("line", [
    "o processo foi Morto ontem",                      # a word of a sentence, not the shell's report
    "已杀死进程的数量: 0",                                  # a counter in a log line
    "已放弃 (核心已转储)",                                  # an abort: left to the exit path, as in English
    # hR3's HIGH-1 probes (stop 48): a word that starts a sentence, after a free 'xxx: ' prefix, or another
    # locale's word (only zh_CN's are read now)
    "提示: 段错误 时请尝试设置 num_workers=0",
    "  on_segfault: 段错误 (重启)",
    "已杀死 3 个僵尸进程",
    "Episódio 12: Morto após 340 passos, recompensa -1.0",
    "Status do agente: Morto",
    "INFO: Processus arrêté proprement après 10 époques, checkpoint sauvegardé",
    "Эпизод 45: Убито врагов 12, награда 35.0",
    "세그멘테이션 오류 방지를 위해 num_workers=0 으로 설정합니다",
    "強制終了 (Ctrl+C) で学習を中断できます",
    "Hinweis: Speicherzugriffsfehler beim DataLoader? Setze num_workers=0",
    "Partita 7: Ucciso dal nemico al passo 210, punteggio 120",
    "**Morto** é o estado do agente quando a vida chega a zero",
])
def test_localized_words_in_other_lines_are_no_death_report(line: str) -> None:
    text = f"epoch 1 step 40 loss 0.52 lr 3.0e-04\n{line}\nepoch 1 step 50 loss 0.50 lr 3.0e-04\n"
    assert _reading(text)[1] != "launcher.signal"
    assert _reading(line)[1] != "launcher.signal"


def test_a_later_report_is_read_after_an_earlier_mention() -> None:
    """Every occurrence is tried, not the first only (hR3 LOW-7c)."""
    text = "清理: 已杀死的僵尸进程数 0\n" + "epoch 1 step 2 loss 0.3\n" * 29 + "已杀死\n"
    assert _reading(text) == ("process/killed", "launcher.signal")


@pytest.mark.parametrize("line", [
    "ERROR: the job failed; restart it (assuming an error such as OOM, lower the batch size)",
    "Common problems such as out of memory are listed in the FAQ",
])
def test_failures_named_by_example_are_no_oom(line: str) -> None:
    assert _reading(line)[0] != "memory/oom"


def test_a_stated_oom_is_still_read() -> None:
    assert _reading("ERROR: OOM on rank 3 while allocating the KV cache")[0] == "memory/oom"


@pytest.mark.parametrize("case", sorted(p.name for p in HEALTHY.iterdir()))
def test_healthy48_pastes_open_nothing(case: str) -> None:
    """tests/fixtures/healthy48: five real pastes of runs that were training (judged from their threads)."""
    assert classify_text((HEALTHY / case / "log.txt").read_text(encoding="utf-8")) is None
    assert shown(imported(HEALTHY / case / "log.txt")) == []
