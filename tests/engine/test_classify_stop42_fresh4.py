"""Wordings the classifier reads since stop 42 (hL), each a class of pastes, found on the TUNED side of the
fourth fresh batch (c9f753c: 35 logs labelled and measured once before any of these rules existed); the lines
are cut from those wild-corpus logs (tests/fixtures/wild/<id>/source.txt names each thread):

* an NCCL system / internal error raised while a communicator is being created -- its traceback or its line
  names the set-up (``ncclCommInitRank``, ``init_process_group``, vLLM's ``Exception in worker ... while
  processing method init_device: NCCL error: unhandled system error``, ``init_worker_distributed_environment``,
  ``initialize_model_parallel``, pynccl's ``PyNcclCommunicator(``, a vLLM engine being built) -- is
  comm/init-failure (``comm-init-vllm-worker-init-device-nccl-unhandled-system-7800-1``); the same error inside a
  collective later in a run stays NCCL's failure (comm/failure);
* a CUDA extension's check macro ``Error <CUDA runtime string> at line N in file F`` (bitsandbytes'
  ``Error invalid device ordinal at line 393 in file .../pythonInterface.c``, the path wrapped by the terminal;
  artidoro/qlora#255) is a CUDA error, and ``invalid device function`` is the runtime's missing-kernel string;
* glibc's heap-corruption aborts (``double free or corruption (!prev)`` -- older glibc's ``*** Error in
  `python': ... ***`` with its backtrace, MendelXu/SAN#6 --, ``free(): invalid pointer``, ...) are a native
  crash, process/exit by SIGABRT -- not the OOM-or-CUDA-error the exit path reads an unexplained abort as;
* the raylet's ``A worker died or was killed while executing a task by an unexpected system error ... Worker
  exit type: SYSTEM_ERROR`` is a worker killed from outside (process/killed, at a lower confidence;
  verl-project/verl#4921), and so is a dead actor's ``The actor is dead because its worker process has died.
  Worker exit type: SYSTEM_ERROR`` as its caller's ``ray.exceptions.ActorDiedError`` prints it (verl#1633's
  shape; ``NODE_OUT_OF_MEMORY``: Ray's memory monitor; ``USER_ERROR`` is the actor's own exception);
* Megatron-LM's training-log row counting ``number of nan iterations: N`` above 0 is a non-finite loss (seen in
  NVIDIA/Megatron-LM#60's rows while collecting; no corpus log has a non-zero count), a zero count is not."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainguard_engine.classify import classify_text, cuda, nccl

WILD = Path(__file__).resolve().parents[1] / "fixtures" / "wild"


def _log(case_id: str) -> str:
    return (WILD / case_id / "log.txt").read_text(encoding="utf-8")


VLLM_7800 = "comm-init-vllm-worker-init-device-nccl-unhandled-system-7800-1"
QLORA_255 = "mem-cuda-bnb-invalid-device-ordinal-wrapped-path-qlora-255-1"
SAN_6 = "proc-exit-glibc-double-free-backtrace-dataloader-san-6-1"
VERL_4921 = "proc-killed-raylet-worker-died-system-error-verl-4921-1"

# ------------------------------------------------------------------------------------ NCCL at set-up


def test_vllm_worker_nccl_error_while_initialising_its_device() -> None:
    c = classify_text(_log(VLLM_7800))
    assert c is not None and c.kind == "comm/init-failure" and c.rule == "nccl.error"
    assert c.facts["code"] == "ncclSystemError" and c.facts["during"] == "communicator set-up"


@pytest.mark.parametrize("context", [
    "  File \"/x/torch/distributed/distributed_c10d.py\", line 1, in init_process_group",
    "  File \"/x/vllm/distributed/parallel_state.py\", line 943, in initialize_model_parallel",
    "    self.pynccl_comm = PyNcclCommunicator(",
    "    self.comm: ncclComm_t = self.nccl.ncclCommInitRank(",
    "  File \"/x/vllm/engine/multiprocessing/engine.py\", line 119, in from_engine_args",
])
def test_system_or_internal_error_in_a_set_up_traceback(context: str) -> None:
    for error in ("RuntimeError: NCCL error: unhandled system error (run with NCCL_DEBUG=INFO for details)",
                  "RuntimeError: NCCL error: internal error - please report this issue to the NCCL developers"):
        text = "\n".join(["Traceback (most recent call last):", context, error])
        c = classify_text(text)
        assert c is not None and c.kind == "comm/init-failure", (context, error)


def test_the_same_errors_inside_a_collective_stay_nccls_failure() -> None:
    text = "\n".join([
        "Traceback (most recent call last):",
        "  File \"/x/train.py\", line 80, in train_step",
        "    dist.all_reduce(loss)",
        "torch.distributed.DistBackendError: NCCL error in: /x/ProcessGroupNCCL.cpp:1970, unhandled system error "
        "(run with NCCL_DEBUG=INFO for details), NCCL version 2.21.5"])
    c = classify_text(text)
    assert c is not None and c.kind == "comm/failure" and "during" not in c.facts
    # a set-up frame far from the error (another traceback, earlier in the text) does not count
    far = "  File \"/x/a.py\", line 1, in init_process_group\n" + "x = 1\n" * (nccl.INIT_CONTEXT_WINDOW // 6 + 50)
    c = classify_text(far + text)
    assert c is not None and c.kind == "comm/failure"


def test_remote_and_cuda_errors_at_set_up_keep_their_kinds() -> None:
    remote = ("Traceback (most recent call last):\n  File \"/x/d.py\", line 1, in init_process_group\n"
              "RuntimeError: NCCL error: remote process exited or there was a network error, NCCL version 2.18.1")
    c = classify_text(remote)
    assert c is not None and c.kind == "comm/rank-lost"


# ------------------------------------------------------------------------ an extension's CUDA check


def test_bitsandbytes_check_macro_wrapped_path() -> None:
    c = classify_text(_log(QLORA_255))
    assert c is not None and c.kind == "memory/cuda-error" and c.rule == "cuda.error"
    assert c.facts["error"] == "invalid device ordinal" and c.facts["error_class"] == "invalid-device"


@pytest.mark.parametrize("line, error_class", [
    ("Error invalid device function at line 508 in file /home/u/bitsandbytes-main/csrc/ops.cu",
     "no-kernel-image"),
    ("Error an illegal memory access was encountered at line 87 in file /src/kernels.cu", "illegal-memory-access"),
])
def test_check_macro_with_a_cuda_runtime_string(line: str, error_class: str) -> None:
    c = classify_text(line)
    assert c is not None and c.kind == "memory/cuda-error" and c.facts["error_class"] == error_class


@pytest.mark.parametrize("line", [
    "Error parsing config at line 12 in file train.yaml",
    "Syntax Error unexpected token at line 3 in file model.json",
])
def test_other_errors_at_a_line_are_not_cuda(line: str) -> None:
    c = classify_text(line)
    assert c is None or c.kind != "memory/cuda-error"


def test_invalid_device_function_is_the_missing_kernel_string() -> None:
    assert next(k for needle, k in cuda._CUDA_CLASSES if needle in "invalid device function") == "no-kernel-image"
    c = classify_text("error in modulated_deformable_im2col_cuda: invalid device function")
    assert c is not None and c.kind == "memory/cuda-error" and c.facts["error_class"] == "no-kernel-image"


# ------------------------------------------------------------------------------ glibc's heap aborts


def test_old_glibc_double_free_with_its_backtrace() -> None:
    c = classify_text(_log(SAN_6))
    assert c is not None and c.kind == "process/exit" and c.rule == "launcher.signal"
    assert c.facts["error"] == "double free or corruption (!prev)" and c.facts["signal"] == 6
    assert c.facts["reporter"] == "glibc"


@pytest.mark.parametrize("text, said", [
    ("step 120 loss 0.41\ndouble free or corruption (fasttop)", "double free or corruption (fasttop)"),
    ("Loading data...\nfree(): invalid pointer\nAborted (core dumped)", "free(): invalid pointer"),
    ("munmap_chunk(): invalid pointer", "munmap_chunk(): invalid pointer"),
    ("corrupted size vs. prev_size\nAborted (core dumped)", "corrupted size vs. prev_size"),
    ("malloc(): corrupted top size", "malloc(): corrupted top size"),
    ("free(): double free detected in tcache 2", "free(): double free detected in tcache 2"),
])
def test_glibc_heap_aborts(text: str, said: str) -> None:
    c = classify_text(text)
    assert c is not None and c.kind == "process/exit" and c.facts["error"] == said


def test_glibc_abort_after_a_cuda_error_is_not_the_lead() -> None:
    text = "RuntimeError: CUDA error: an illegal memory access was encountered\ndouble free or corruption (out)"
    c = classify_text(text)
    assert c is not None and c.kind == "memory/cuda-error"


def test_words_that_are_no_glibc_abort() -> None:
    for text in ("we free(): the buffers at exit", "malloc(): allocated 12 bytes"):
        c = classify_text(text)
        assert c is None or c.facts.get("reporter") != "glibc", text


# ------------------------------------------------------------------------------- Ray's dead worker


def test_raylet_worker_died_system_error() -> None:
    c = classify_text(_log(VERL_4921))
    assert c is not None and c.kind == "process/killed" and c.rule == "launcher.signal"
    assert c.facts["reporter"] == "raylet" and c.facts["exit_type"] == "SYSTEM_ERROR"
    assert c.facts["pid"] == 87687 and c.confidence == pytest.approx(0.6)


def test_raylet_memory_monitor_still_names_its_kill() -> None:
    text = ("(raylet) node_manager.cc:3084: 4 Workers (tasks / actors) killed due to memory pressure (OOM), 0 "
            "Workers crashed due to other reasons at node (ID: 1, IP: 10.0.0.1) over the last time period.")
    c = classify_text(text)
    assert c is not None and c.kind == "process/killed" and c.facts["killer"] == "ray-memory-monitor"


ACTOR_DIED = "\n".join([
    "Traceback (most recent call last):",
    "  File \"/home/u/verl/verl/single_controller/ray/base.py\", line 49, in func",
    "    output = ray.get(output)",
    "ray.exceptions.ActorDiedError: The actor died unexpectedly before finishing this task.",
    "\tclass_name: create_colocated_worker_cls.<locals>.WorkerDict",
    "\tpid: 1373150",
    "The actor is dead because its worker process has died. Worker exit type: SYSTEM_ERROR Worker exit detail: "
    "Worker unexpectedly exits with a connection error code 2. End of file. There are some potential root causes. "
    "(1) The process is killed by SIGKILL by OOM killer due to high memory usage."])


def test_dead_actor_system_error_is_a_kill() -> None:
    c = classify_text(ACTOR_DIED)
    assert c is not None and c.kind == "process/killed" and c.rule == "launcher.signal"
    assert c.facts["exit_type"] == "SYSTEM_ERROR" and "killer" not in c.facts


def test_dead_actor_out_of_node_memory_names_rays_monitor() -> None:
    c = classify_text(ACTOR_DIED.replace("SYSTEM_ERROR", "NODE_OUT_OF_MEMORY"))
    assert c is not None and c.kind == "process/killed" and c.facts["killer"] == "ray-memory-monitor"


def test_dead_actor_of_its_own_error_is_no_kill() -> None:
    c = classify_text(ACTOR_DIED.replace("SYSTEM_ERROR", "USER_ERROR"))
    assert c is None or c.kind != "process/killed"


MEGATRON_ROW = (" iteration       20/  120000 | elapsed time per iteration (ms): 1993.9 | learning rate: 1.000E-04 | "
                "lm loss: 7.1E+00 | loss scale: 8388608.0 | number of skipped iterations:   0 | number of nan "
                "iterations:   {n} |")


def test_megatron_nan_iterations_counted() -> None:
    c = classify_text(MEGATRON_ROW.format(n=3))
    assert c is not None and c.kind == "loss/non_finite" and c.rule == "numeric.loss-non-finite"
    assert c.facts["nan_iterations"] == 3 and c.facts["step"] == 20


def test_megatron_row_without_nan_iterations_is_no_loss_failure() -> None:
    c = classify_text(MEGATRON_ROW.format(n=0))
    assert c is None or c.kind != "loss/non_finite"
