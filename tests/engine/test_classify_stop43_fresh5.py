"""Wordings the classifier reads since stop 43 (hL), each a class of pastes, found on the TUNED side of the
fifth fresh batch (c470137: 33 logs labelled and measured once before any of these rules existed). The test
lines are written for the wording (not copied from the batch's pastes):

* other frameworks' allocators running out of device memory: XLA's ``RESOURCE_EXHAUSTED: Out of memory while
  trying to allocate N bytes`` (JAX's ``XlaRuntimeError``; older XLA ``Resource exhausted: Out of memory ...``),
  TensorFlow's ``Resource exhausted: OOM when allocating tensor with shape[...]`` and Caffe's glog
  ``Check failed: error == cudaSuccess (2 vs. 0)  out of memory`` are memory/oom (they read nothing, or a plain
  process/exception, before); TensorFlow's BFC allocator warning ``ran out of memory trying to allocate ...
  The caller indicates that this is not a failure`` is not;
* Ray's ``RayTaskError(<Class>)`` / ``RayActorError(<Class>)`` with a class an exception-type rule names
  (``OutOfMemoryError``) is that class's kind; a generic class (``RuntimeError``) is left to the traceback;
* a launcher's ``rank N died from signal S [and dumped core]`` (ezpz) is the exit decision for S, the culprit N;
* torch < 1.8's bare ``RuntimeError: NCCL communicator was aborted.`` (no rank, no reason) is the abort
  ``... aborted on rank N`` already was (comm/failure), not a plain Python exception;
* an exception raised inside the model-parallel / serving stacks' group set-up (``initialize_model_parallel``,
  ``init_model_parallel_group``, ``init_distributed_environment``, pynccl's ``ncclCommInitRank``) is
  comm/init-failure through ``classify_chain``'s frames, as one inside ``init_process_group`` was."""

from __future__ import annotations

import pytest

from trainguard_engine.classify import INIT_FUNCTIONS, classify_chain, classify_text


def _kind(text: str) -> str:
    found = classify_text(text)
    return "" if found is None else f"{found.category}/{found.subtype}"


@pytest.mark.parametrize("text", [
    "jaxlib.xla_extension.XlaRuntimeError: RESOURCE_EXHAUSTED: Out of memory while trying to allocate "
    "1073741824 bytes.",
    "jax.errors.JaxRuntimeError: RESOURCE_EXHAUSTED: Out of memory allocating 2147483648 bytes.",
    "E1010 10:00:00.000 local_client.cc:672] Execution of replica 0 failed: Resource exhausted: Out of memory "
    "while trying to allocate 512 bytes.",
    "W tensorflow/core/framework/op_kernel.cc:1767] OP_REQUIRES failed at conv_ops.cc:539 : Resource "
    "exhausted: OOM when allocating tensor with shape[64,128,56,56] and type float",
    "F1201 09:00:00.000000  1234 syncedmem.cpp:71] Check failed: error == cudaSuccess (2 vs. 0)  out of memory",
])
def test_other_allocators_out_of_memory_are_oom(text: str) -> None:
    found = classify_text(text)
    assert found is not None and (found.category, found.subtype) == ("memory", "oom")
    assert found.rule == "cuda.oom-plain"


def test_tensorflow_bfc_retry_warning_is_not_oom() -> None:
    warning = ("W tensorflow/core/common_runtime/bfc_allocator.cc:243] Allocator (GPU_0_bfc) ran out of memory "
               "trying to allocate 2.26GiB with freed_by_count=0. The caller indicates that this is not a "
               "failure, but may mean that there could be performance gains if more memory were available.")
    assert _kind(warning) != "memory/oom"


def test_caffe_check_of_another_cuda_error_stays_a_cuda_error() -> None:
    text = "F1201 09:00:00.000000  1234 math_functions.cu:79] Check failed: error == cudaSuccess (74 vs. 0)  " \
           "misaligned address"
    assert _kind(text) == "memory/cuda-error"


def test_ray_task_error_names_the_worker_class() -> None:
    text = ("ray.exceptions.RayTaskError(OutOfMemoryError): ray::PolicyWorker.train_step() (pid=4242, "
            "ip=10.0.0.7, actor_id=0123456789abcdef, repr=PolicyWorker[rank=1])")
    found = classify_text(text)
    assert found is not None and (found.category, found.subtype) == ("memory", "oom")
    assert found.rule == "ray.task-error" and found.facts["exc_type"] == "OutOfMemoryError"
    actor = "ray.exceptions.RayActorError(OutOfMemoryError): The actor died because of an error raised in its " \
            "creation task"
    assert _kind(actor) == "memory/oom"


def test_ray_task_error_of_a_generic_class_is_left_to_the_traceback() -> None:
    text = "ray.exceptions.RayTaskError(RuntimeError): ray::TaskRunner.run() (pid=99, ip=10.0.0.1)"
    found = classify_text(text)
    assert found is None or found.rule != "ray.task-error"


def test_rank_died_from_signal_is_the_first_crash() -> None:
    text = "rank 2 died from signal 11 and dumped core\nrank 0 died from signal 9\nrank 1 died from signal 9"
    found = classify_text(text)
    assert found is not None and (found.category, found.subtype) == ("process", "exit")
    assert found.rule == "launcher.signal"
    assert found.facts["signal"] == 11 and found.facts["rank"] == 2
    killed = classify_text("rank 5 died from signal 9")
    assert killed is not None and (killed.category, killed.subtype) == ("process", "killed")
    assert killed.facts["rank"] == 5


def test_bare_communicator_abort_is_the_abort() -> None:
    found = classify_text("RuntimeError: NCCL communicator was aborted.")
    assert found is not None and (found.category, found.subtype) == ("comm", "failure")
    assert found.rule == "nccl.comm-aborted" and "rank" not in found.facts
    ranked = classify_text("RuntimeError: NCCL communicator was aborted on rank 3.")
    assert ranked is not None and ranked.rule == "nccl.comm-aborted" and ranked.facts["rank"] == 3


@pytest.mark.parametrize("function", ["ncclCommInitRank", "initialize_model_parallel",
                                      "init_model_parallel_group", "init_distributed_environment"])
def test_failure_inside_a_stack_group_set_up_is_init_failure(function: str) -> None:
    assert function in INIT_FUNCTIONS
    frames = [{"function": "main"}, {"function": "load_model"}, {"function": function},
              {"function": "NCCL_CHECK"}]
    found = classify_chain("RuntimeError", "NCCL error: unhandled system error (run with NCCL_DEBUG=INFO for "
                           "details)", frames=frames)
    assert (found.category, found.subtype) == ("comm", "init-failure")
    assert found.facts["raised_in"] == function
    later = classify_chain("RuntimeError", "NCCL error: unhandled system error (run with NCCL_DEBUG=INFO for "
                           "details)", frames=[{"function": "main"}, {"function": "all_reduce"}])
    assert (later.category, later.subtype) == ("comm", "failure")


# hR's review of f9c7ed1 (stop 43): two readings that outranked a Python error printed in the same text

_TRACEBACK = ("Traceback (most recent call last):\n"
              '  File "train.py", line 80, in <module>\n'
              "    main()\n"
              '  File "train.py", line 60, in main\n'
              "    batch = collate(samples)\n"
              "ValueError: too many values to unpack (expected 2)\n")
_STEPS = "".join(f"step {i} loss {2.3 - i * 0.01:.3f}\n" for i in range(20))


@pytest.mark.parametrize("warning", [
    "2023-05-05 11:11:11.123456: W external/xla/xla/service/gpu/conv_algorithm_picker.cc:852] Failed to "
    "determine best cudnn convolution algorithm for: %cudnn-conv = (f32[1,64,112,112]{3,2,1,0}) custom-call(...)\n"
    "Original error: RESOURCE_EXHAUSTED: Out of memory while trying to allocate 8589934592 bytes.\n"
    "To ignore this failure and try to use a fallback algorithm, use "
    "XLA_FLAGS=--xla_gpu_strict_conv_algorithm_picker=false.\n",
    "2024-01-01 00:00:00.000: W external/xla/xla/service/gpu/gemm_algorithm_picker.cc:300] Autotuning failed: "
    "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1073741824 bytes.\n",
    "W1010 10:00:00.000000  4242 autotuner_util.cc:100] RESOURCE_EXHAUSTED: Out of memory while trying to allocate "
    "512 bytes; falling back\n",
])
def test_xla_autotuner_recovered_oom_is_not_the_error(warning: str) -> None:
    found = classify_text(warning + _STEPS + _TRACEBACK)
    assert found is not None and (found.category, found.subtype) == ("process", "exception")
    assert "ValueError" in found.headline


def test_xla_error_record_out_of_memory_is_oom() -> None:
    text = ("2019-06-13 01:17:08.886805: E external/org_tensorflow/tensorflow/compiler/xla/python/"
            "local_client.cc:672] Execution of replica 0 failed: Resource exhausted: Out of memory while trying "
            "to allocate 5520758552 bytes.\n")
    assert _kind(text) == "memory/oom"


@pytest.mark.parametrize("tail, exception", [
    ("rank 1 died from signal 15\nrank 2 died from signal 15\nrank 3 died from signal 9\n", "ValueError"),
    ("process 2 died from signal 6\n", "ValueError"),
])
def test_died_from_signal_after_a_python_error_is_the_launchers_kill(tail: str, exception: str) -> None:
    found = classify_text(_TRACEBACK + tail)
    assert found is not None and (found.category, found.subtype) == ("process", "exception")
    assert exception in found.headline


def test_died_from_signal_prefers_a_crash_over_the_launchers_kills() -> None:
    found = classify_text("rank 0 died from signal 9\nrank 1 died from signal 15\nrank 3 died from signal 11 "
                          "and dumped core\n")
    assert found is not None and (found.category, found.subtype) == ("process", "exit")
    assert found.facts["signal"] == 11 and found.facts["rank"] == 3
