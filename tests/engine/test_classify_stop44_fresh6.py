"""Wordings the classifier reads since stop 44 (hL), each a class of pastes, found on the TUNED side of the
sixth fresh batch (79dde67: 31 logs labelled and measured once, at 14a6704, before any of these rules existed).
The test lines are written for the wording (not copied from the batch's pastes):

* PyTorch's allocator message on the out-of-tree backends that reuse it -- Ascend's ``NPU out of memory. Tried
  to allocate ... (NPU 2; ... total capacity; ...)``, Cambricon's ``MLU``, Moore Threads' ``MUSA`` -- is the
  OOM it is on CUDA, with its device;
* other frameworks' allocators running out: PaddlePaddle's ``Out of memory error on GPU 0. Cannot allocate
  ...``, MXNet's ``cudaMalloc failed: out of memory`` / ``cudaMalloc retry failed: out of memory``, CuPy's
  ``out of memory to allocate N bytes`` / ``Out of memory allocating N bytes`` are memory/oom;
* the HIP runtime's enum before its text, ``hipErrorNoBinaryForGpu: Unable to find code object for all current
  devices!`` (also its older ``Coudn't find binary`` cut at the apostrophe), is the CUDA error a missing kernel
  image is (memory/cuda-error, ``no-kernel-image``);
* a GPU the driver lost, said without an ``NVRM: Xid`` line (nvidia-smi's ``Unable to determine the device
  handle for GPU...: Unknown Error`` / ``GPU is lost``, ``GPU has fallen off the bus``) is memory/cuda-error;
* a shell's ``Killed`` glued to the end of the progress line it interrupted, and bash's job report ``<script>:
  line N: PID Killed ...`` anywhere in a line, are the SIGKILL they report (process/killed); ``Killed`` inside a
  sentence is not;
* the elastic agent's ``Received N death signal`` for SIGHUP / SIGINT / SIGQUIT / SIGTERM is the launcher asked
  to stop from outside (process/terminated) -- SIGHUP read process/exit before;
* submitit's ``Caught signal SIGx on <host>: this job is preempted|timed-out`` is process/terminated;
* TensorFlow's CheckNumerics ``... : Tensor had NaN values`` is gradient/nan-source naming the tensor (a
  ``Gradient for <var> is NaN`` check or another tensor's), loss/non_finite when its message names a loss;
* torch.distributions' ``Expected parameter <p> (...) of distribution <D>(...) ... but found invalid values:
  tensor([[nan, ...`` is loss/non_finite (the model's output went NaN); invalid values that are numbers are not;
* c10d's last-resort 'timed out near rendezvous words' does not read a negated ``has not timed out``."""

from __future__ import annotations

import pytest

from trainguard_engine.classify import classify_text


def _kind(text: str) -> str:
    found = classify_text(text)
    return "" if found is None else f"{found.category}/{found.subtype}"


@pytest.mark.parametrize("text, backend, device", [
    ("RuntimeError: NPU out of memory. Tried to allocate 1.50 GiB (NPU 3; 29.50 GiB total capacity; 27.10 GiB "
     "already allocated; 27.10 GiB current active; 120.00 MiB free; 28.00 GiB reserved in total by PyTorch)",
     "NPU", 3),
    ("RuntimeError: MLU out of memory. Tried to allocate 20.00 MiB (MLU 0; 15.74 GiB total capacity; 15.20 GiB "
     "already allocated; 4.00 MiB free; 15.30 GiB reserved in total by PyTorch)", "MLU", 0),
    ("torch.OutOfMemoryError: MUSA out of memory. Tried to allocate 64.00 MiB", "MUSA", None),
])
def test_out_of_tree_backends_out_of_memory(text: str, backend: str, device: object) -> None:
    found = classify_text(text)
    assert found is not None and (found.category, found.subtype, found.rule) == ("memory", "oom", "cuda.oom")
    assert found.facts["backend"] == backend and found.facts.get("device") == device
    if device is not None:
        assert f"on {backend} {device}" in found.headline


@pytest.mark.parametrize("text", [
    "ResourceExhaustedError: \n\nOut of memory error on GPU 1. Cannot allocate 512.000244MB memory on GPU 1, "
    "available memory is only 100.500000MB.",
    "[10:20:30] src/storage/./pooled_storage_manager.h:157: cudaMalloc failed: out of memory",
    "mxnet.base.MXNetError: [10:20:30] src/storage/./pooled_storage_manager.h:161: cudaMalloc retry failed: "
    "out of memory",
    "Exception in main training loop: out of memory to allocate 8388608 bytes (total 4294967296 bytes)",
    "cupy.cuda.memory.OutOfMemoryError: Out of memory allocating 1,048,576 bytes (allocated so far: "
    "2,147,483,648 bytes).",
])
def test_more_framework_allocators_out_of_memory(text: str) -> None:
    found = classify_text(text)
    assert found is not None and (found.category, found.subtype) == ("memory", "oom")
    assert found.rule in ("cuda.oom-plain", "cuda.oom")


@pytest.mark.parametrize("text, error", [
    ('"hipErrorNoBinaryForGpu: Unable to find code object for all current devices!"\nAborted (core dumped)',
     "Unable to find code object for all current devices"),
    ("/build/rocclr/hip_code_object.cpp:92: guarantee(false && \"hipErrorNoBinaryForGpu: Coudn't find binary "
     "for current devices!\")", "hipErrorNoBinaryForGpu"),
])
def test_hip_no_binary_for_gpu_is_a_missing_kernel_image(text: str, error: str) -> None:
    found = classify_text(text)
    assert found is not None and (found.category, found.subtype) == ("memory", "cuda-error")
    assert found.facts["error_class"] == "no-kernel-image" and found.facts["error"] == error
    assert found.headline.startswith("HIP error")


@pytest.mark.parametrize("text", [
    "$ nvidia-smi\nUnable to determine the device handle for GPU0000:81:00.0: Unknown Error",
    "Unable to determine the device handle for GPU 0000:3B:00.0: GPU is lost.  Reboot the system to recover "
    "this GPU",
    "[ 8812.120000] NVRM: GPU 0000:17:00.0: GPU has fallen off the bus.",
])
def test_a_lost_gpu_without_an_xid_line(text: str) -> None:
    found = classify_text(text)
    assert found is not None and (found.category, found.subtype) == ("memory", "cuda-error")
    assert found.rule == "nvidia.xid" and found.facts["error_class"] == "gpu-lost"


@pytest.mark.parametrize("text", [
    "Epoch 3/10\n 5120/60000 [=>............................] - ETA: 9:41 - loss: 0.4123Killed",
    "train:  41%|████      | 410/1000 [12:01<17:18,  1.76s/it]Killed",
    # the bar is as wide as a terminal's: the script's name starts far into the line
    "valid:   7%|#" + " " * 140 + "| 71/1000 [00:09<02:03,  7.51it/s]/opt/tools/bin/launch.sh: line 12:  9121 "
    "Killed                  python train.py --cfg a.yaml",
])
def test_a_glued_killed_report_is_a_kill(text: str) -> None:
    found = classify_text(text)
    assert found is not None and (found.category, found.subtype) == ("process", "killed")
    assert found.rule == "launcher.signal" and found.facts["signal"] == 9


@pytest.mark.parametrize("text", [
    "The worker process was Killed by the scheduler yesterday, so I restarted",
    "step 20: 3 samples Killed off by the filter",
    "SelfKilled",
])
def test_killed_in_prose_is_not_a_kill(text: str) -> None:
    assert _kind(text) != "process/killed"


@pytest.mark.parametrize("signal, name", [(1, "SIGHUP"), (2, "SIGINT"), (3, "SIGQUIT"), (15, "SIGTERM")])
def test_a_death_signal_the_agent_received_is_a_termination(signal: int, name: str) -> None:
    text = (f"W0101 10:00:00.000000 4242 torch/distributed/elastic/agent/server/api.py:704] Received {signal} "
            f"death signal, shutting down workers\nW0101 10:00:00.001000 4242 torch/distributed/elastic/"
            f"multiprocessing/api.py:897] Sending process 4243 closing signal {name}")
    found = classify_text(text)
    assert found is not None and (found.category, found.subtype) == ("process", "terminated")
    assert found.facts["signal"] == signal


def test_a_rich_formatted_sighup_death_signal() -> None:
    text = ("[09:12:44] WARNING  Received 1 death signal, shutting down workers       api.py:699\n"
            "           WARNING  Sending process 101 closing signal SIGHUP            api.py:698")
    assert _kind(text) == "process/terminated"


@pytest.mark.parametrize("text, reason", [
    ("submitit WARNING (2024-05-01 03:00:00,000) - Caught signal SIGUSR2 on gpu-node-17: this job is preempted.",
     "preemption"),
    ("submitit WARNING (2024-05-01 03:00:00,000) - Caught signal SIGUSR2 on gpu-node-17: this job is timed-out.",
     "time limit"),
])
def test_submitit_preemption_is_a_termination(text: str, reason: str) -> None:
    found = classify_text(text)
    assert found is not None and (found.category, found.subtype) == ("process", "terminated")
    assert found.facts["reporter"] == "submitit" and found.facts["reason"] == reason


@pytest.mark.parametrize("text, kind, metric", [
    ("tensorflow.python.framework.errors_impl.InvalidArgumentError: Gradient for dense_3/kernel:0 is NaN : "
     "Tensor had NaN values\n\t [[node CheckNumerics_12]]", "gradient/nan-source", "dense_3/kernel:0"),
    ("InvalidArgumentError: encoder/block_2/ln/beta : Tensor had Inf values", "gradient/nan-source",
     "encoder/block_2/ln/beta"),
    ("InvalidArgumentError: LossTensor is inf or nan. : Tensor had NaN values", "loss/non_finite",
     "LossTensor is inf or nan."),
])
def test_tensorflow_check_numerics(text: str, kind: str, metric: str) -> None:
    found = classify_text(text)
    assert found is not None and f"{found.category}/{found.subtype}" == kind
    assert found.rule == "numeric.check-numerics" and found.facts["metric"] == metric


def test_a_distribution_rejecting_nan_parameters_is_a_non_finite_loss() -> None:
    text = ("ValueError: Expected parameter loc (Tensor of shape (64, 8)) of distribution Normal(loc: "
            "torch.Size([64, 8]), scale: torch.Size([64, 8])) to satisfy the constraint Real(), but found invalid "
            "values:\ntensor([[nan, nan, nan,  ..., nan, nan, nan],\n        [nan, nan, nan,  ..., nan, nan, nan]])")
    found = classify_text(text)
    assert found is not None and (found.category, found.subtype) == ("loss", "non_finite")
    assert found.facts["metric"].startswith("Normal loc")


def test_a_distribution_rejecting_finite_values_is_not_a_non_finite_loss() -> None:
    text = ("ValueError: Expected parameter probs (Tensor of shape (4,)) of distribution Bernoulli(probs: "
            "torch.Size([4])) to satisfy the constraint Interval(lower_bound=0.0, upper_bound=1.0), but found "
            "invalid values:\ntensor([ 0.2000,  1.3000, -0.1000,  0.5000])")
    assert _kind(text) != "loss/non_finite"


def test_a_negated_timeout_near_a_master_addr_is_not_a_rendezvous_failure() -> None:
    text = ("Setting up distributed environment with MASTER_ADDR=node1, MASTER_PORT=29500, RANK=0\n"
            "job INFO - Job has not timed out. Ran 3 minutes out of requested 60 minutes.")
    assert _kind(text) != "comm/init-failure"
    assert _kind("MASTER_ADDR=node1 MASTER_PORT=29500\nthe rendezvous timed out after 900 s") == "comm/init-failure"


# ------------------------------------------------------------------------------------------------------
# Second change of stop 44: an older tuned-side miss (NCCL's INFO trace without a WARN line) and wordings seen
# while collecting the batch, in threads not in the corpus (JAX's coordination service, Paddle's BadAlloc,
# MindSpore's memory pool)


def test_an_nccl_info_error_trace_through_the_bootstrap_is_an_init_failure() -> None:
    text = ("node7:4242:4300 [1] NCCL INFO misc/socket.cc:538 -> 2\n"
            "node7:4242:4300 [1] NCCL INFO bootstrap.cc:281 -> 2\n"
            "node7:4242:4300 [1] NCCL INFO init.cc:1400 -> 2\n"
            "node7:4242:4242 [1] NCCL INFO group.cc:109 -> 2")
    found = classify_text(text)
    assert found is not None and (found.category, found.subtype, found.rule) == ("comm", "init-failure",
                                                                                 "nccl.debug")
    assert found.facts["nccl_result"] == 2


def test_an_nccl_info_trace_through_init_alone_is_not_read_as_the_bootstrap() -> None:
    # the transport's set-up inside a first collective fails through init.cc too
    text = ("node7:4242:4300 [0] NCCL INFO transport/p2p.cc:275 -> 3\n"
            "node7:4242:4300 [0] NCCL INFO init.cc:1014 -> 3")
    assert _kind(text) != "comm/init-failure"


@pytest.mark.parametrize("text", [
    "jaxlib.xla_extension.XlaRuntimeError: DEADLINE_EXCEEDED: Barrier timed out. Barrier_id: PjRT_Client_Connect. "
    "Timed out task names:\n/job:jax_worker/replica:0/task:2",
    "Stopping coordination service as cluster registration failed.\nOriginal error: DEADLINE_EXCEEDED: Barrier "
    "timed out. Id: [Init]Wait_for_all_tasks_to_register::0. This usually happens because a task triggered the "
    "barrier too early or too slowly.",
    "Additional GRPC error information from remote target unknown_target_for_coordination_leader while calling "
    "/tensorflow.CoordinationService/RegisterTask:\nE0101 client.cc:96] Coordination service agent in error "
    "status: DEADLINE_EXCEEDED: Deadline Exceeded",
])
def test_jax_coordination_start_up_timeout_is_an_init_failure(text: str) -> None:
    found = classify_text(text)
    assert found is not None and (found.category, found.subtype, found.rule) == ("comm", "init-failure",
                                                                                 "xla.coordination")


def test_a_programs_own_jax_barrier_is_not_read_as_start_up() -> None:
    text = ("jaxlib.xla_extension.XlaRuntimeError: DEADLINE_EXCEEDED: Barrier timed out. Barrier_id: "
            "checkpoint_sync_7. Timed out task names:\n/job:jax_worker/replica:0/task:1")
    assert _kind(text) != "comm/init-failure"


@pytest.mark.parametrize("text, task", [
    ("E0101 coordination_service.cc:1170] /job:jax_worker/replica:0/task:5 has been set to ERROR in coordination "
     "service: UNAVAILABLE: Task /job:jax_worker/replica:0/task:5 heartbeat timeout. This indicates that the "
     "remote task has failed, got preempted, or crashed unexpectedly.", 5),
    ("F0101 client.h:77] Terminating process because the JAX distributed service detected fatal errors. This most "
     "likely indicates that another task died; see the other task logs for more details.", None),
])
def test_jax_coordination_lost_task_is_a_lost_rank(text: str, task: object) -> None:
    found = classify_text(text)
    assert found is not None and (found.category, found.subtype, found.rule) == ("comm", "rank-lost",
                                                                                 "xla.coordination")
    assert found.facts.get("lost_task") == task


@pytest.mark.parametrize("text", [
    "terminate called after throwing an instance of 'paddle::memory::allocation::BadAlloc'\n  what():  ",
    "[WARNING] PRE_ACT(4242,7f00,python):2024-01-01-10:00:00.000.000 [mindspore/ccsrc/backend/common/mem_reuse/"
    "mem_dynamic_allocator.cc:303] CalMemBlockAllocSize] Memory not enough: current free memory size[0] is "
    "smaller than required size[8388608].",
    "[ERROR] DEVICE(4242,7f00,python):2024-01-01-10:00:00.000.100 [mindspore/ccsrc/runtime/pynative/"
    "run_op_helper.cc:383] MallocForKernelOutput] Allocate output memory failed, node:Default/MatMul-op12",
])
def test_paddle_and_mindspore_allocators_out_of_memory(text: str) -> None:
    assert _kind(text) == "memory/oom"
