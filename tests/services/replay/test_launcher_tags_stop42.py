"""What a line carries before the job's own text, read since stop 42 (hL; found by ``bench/wild/stress.py
--formats`` on TUNED pastes and on the fourth fresh batch's shapes), and two stop-42 classifier readings seen
end to end through ``trainguard replay``:

* vLLM's logger header repeated on the lines of a multi-line error message that are not a Python traceback's --
  a c10 error's C++ stack (``frame #2: c10::cuda::c10_cuda_check_implementation ...``, ``Exception raised from
  ...``), ``terminate called after throwing ...`` / ``what():``, NCCL's ``Last error:``, a frame line a paste set
  flush left (``File "x.py", line 3, in f``) -- is dropped as on a traceback's lines (``vllm_record`` lost 13 of
  639 tuned pastes, now 10; the rest put the header on lines vLLM's logger never prints: a loss table, a shell's
  ``Killed``, the interpreter's ``Fatal Python error``);
* a role's tag (``[trainer0|0]:``, ``[trainer3]:``) is glued to the line as torchelastic prints it: the spaces
  after it (more than one) are the line's own indentation, so a torchrun failure entry's fields and its worker's traceback keep their
  columns (``comm-mismatch-barrier-torchrun-summary-148976-1`` under ``[trainer0|0]:`` read process/exit, now
  comm/mismatch as without the tag); torch's ``[rank3]: `` and torchrun's ``[default0]:`` keep their space;
* a torchrun failure summary held without its ``ChildFailedError:`` line is read without the tags before its
  lines;
* a one-line (or two-line) ``srun --label`` paste whose lines all carry one task's label before a Python
  exception line (``3: RuntimeError: Expected to have finished reduction ...``) is labelled (the exception is
  read; ``tasklabel`` lost ``proc-exc-ddp-unused-params-reduction-bare-promptir-30-1``);
* pdsh's host column alone, ``gpu-q-13: `` on every line (DeepSpeed's multi-node runner without torch's rank
  tag, deepspeedai/DeepSpeed#2899), is dropped like a relay's column (``pdsh_host`` lost 46 of 639, now 2);
* glibc's heap-corruption abort and the raylet's dead-worker report open their process incidents from a pasted
  log (``launcher.signal`` is a rule whose process kinds a log line may open)."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainguard_server.replay.logs import LogReader, paste_relay_prefix, paste_task_labels, split_prefix

from .local_import import WILD, imported, lines_of, pasted, shown

HEADER = "ERROR 03-25 21:13:53 [multiproc_executor.py:374] "


@pytest.mark.parametrize("rest", [
    "frame #2: c10::cuda::c10_cuda_check_implementation(int, char const*, char const*, int, bool) + 0x3c2",
    "Exception raised from c10_cuda_check_implementation at ../c10/cuda/CUDAException.cpp:43 (most recent call "
    "first):",
    "terminate called after throwing an instance of 'c10::Error'",
    "what():  CUDA error: an illegal memory access was encountered",
    "Last error:",
    'File "/home/u/train.py", line 13, in <module>',
])
def test_vllm_header_over_an_error_message_line(rest: str) -> None:
    assert split_prefix(HEADER + rest) == (None, rest)
    assert split_prefix("(VllmWorker rank=1 pid=12231) " + HEADER + rest) == (None, rest)


def test_vllm_header_naming_the_files_path() -> None:
    header = "(Worker_DP0_TP0_EP0 pid=5609) ERROR 06-04 12:45:50 [v1/executor/multiproc_executor.py:932] "
    rest = '  File "/vllm-workspace/vllm_ascend/worker/model_runner_v1.py", line 1902, in _sync_batch_across_dp'
    assert split_prefix(header + rest) == (None, rest)
    record = "INFO 06-04 12:45:50 [v1/engine/core.py:61] Initializing a V1 LLM engine"
    assert split_prefix(record) == (None, record)


def test_dead_ray_actor_in_a_paste_opens_a_kill(tmp_path: Path) -> None:
    path = pasted(tmp_path, [
        "Traceback (most recent call last):",
        '  File "/home/u/verl/verl/single_controller/ray/base.py", line 49, in func',
        "    output = ray.get(output)",
        "ray.exceptions.ActorDiedError: The actor died unexpectedly before finishing this task.",
        "\tclass_name: create_colocated_worker_cls.<locals>.WorkerDict",
        "\tpid: 1373150",
        "The actor is dead because its worker process has died. Worker exit type: SYSTEM_ERROR Worker exit detail: "
        "Worker unexpectedly exits with a connection error code 2. End of file."])
    kinds = shown(imported(path))
    assert kinds and kinds[0] == "process/killed"


@pytest.mark.parametrize("line", [
    HEADER + "Added request chatcmpl-1.",
    HEADER + "frames seen: 12",
    "INFO 03-25 21:13:53 [metrics.py:455] Avg prompt throughput: 0.0 tokens/s",
])
def test_vllm_records_keep_their_header(line: str) -> None:
    assert split_prefix(line) == (None, line)


def test_c10_stack_under_vllm_headers_reads_as_a_cuda_error(tmp_path: Path) -> None:
    case = "mem-illegal-address-ddp-conv2d-watchdog-frames-180280-1"
    path = pasted(tmp_path, [HEADER + line for line in lines_of(case)])
    kinds = shown(imported(path))
    assert kinds and kinds[0] == "memory/cuda-error"


@pytest.mark.parametrize("line, rank, rest", [
    ("[trainer0|0]:  rank      : 1 (local_rank: 1)", None, "  rank      : 1 (local_rank: 1)"),
    ("[trainer3]:    File \"x.py\", line 3, in f", None, "    File \"x.py\", line 3, in f"),
    ("[trainer3]:twshared1016:1958:1958 [3] NCCL INFO x", None, "twshared1016:1958:1958 [3] NCCL INFO x"),
    ("[trainer0|0]: x", None, "x"),
    ("[rank3]:[trainer1|2]: z", 3, "z"),
    # unchanged: torch's rank tag and torchrun's default tag own one space after them
    ("[rank3]: Traceback (most recent call last):", 3, "Traceback (most recent call last):"),
    ("[default0]: x", 0, "x"),
    ("[default0]:[rank3]:   File \"x.py\"", 3, "  File \"x.py\""),
])
def test_role_tags_are_glued_to_the_line(line: str, rank: object, rest: str) -> None:
    assert split_prefix(line) == (rank, rest)


def test_torchrun_summary_under_a_role_tag(tmp_path: Path) -> None:
    case = "comm-mismatch-barrier-torchrun-summary-148976-1"
    path = pasted(tmp_path, ["[trainer0|0]:" + line for line in lines_of(case)])
    tagged = shown(imported(path))
    plain = shown(imported(WILD / case / "log.txt"))
    assert tagged and tagged[0] == "comm/mismatch" == plain[0]


def test_one_line_srun_label_before_an_exception(tmp_path: Path) -> None:
    line = ("3: RuntimeError: Expected to have finished reduction in the prior iteration before starting a new "
            "one. This error indicates that your module has parameters that were not used in producing loss.")
    path = pasted(tmp_path, [line])
    assert paste_task_labels(path)
    items = list(LogReader(path))
    assert [item.kind for item in items] == ["exception"] and items[0].rank == 3
    kinds = shown(imported(path))
    assert kinds and kinds[0] == "process/exception"


@pytest.mark.parametrize("lines", [
    ["3: hello"],                                  # no exception line: a number and text
    ["3: RuntimeError: x", "4: RuntimeError: y"],  # two tasks' labels in two lines: not enough to tell
    ["1: x = 1", "2: y = 2"],                      # a line-number gutter
])
def test_short_pastes_that_are_no_srun_labels(tmp_path: Path, lines: list) -> None:
    assert not paste_task_labels(pasted(tmp_path, lines))


def test_pdsh_host_column_alone(tmp_path: Path) -> None:
    path = pasted(tmp_path, [
        "gpu-q-13: ret = input.softmax(dim, dtype=dtype)",
        "gpu-q-13:     ret = input.softmax(dim, dtype=dtype)",
        "gpu-q-13: torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 896.00 MiB (GPU 2; 79.17 GiB "
        "total capacity; 76.68 GiB already allocated; 381.31 MiB free; 77.24 GiB reserved in total by PyTorch)"])
    assert paste_relay_prefix(path) == len("gpu-q-13: ")
    kinds = shown(imported(path))
    assert kinds and kinds[0] == "memory/oom"


@pytest.mark.parametrize("lines", [
    ["wandb: Run summary:", "wandb:     loss nan", "wandb:       lr 0.0"],      # a tool's own name
    ["stderr: a", "stderr: b", "stderr: c"],
    ["gpu-q-13: a", "gpu-q-14: b", "other: c"],                                  # not the same column
])
def test_columns_that_are_no_host(tmp_path: Path, lines: list) -> None:
    assert paste_relay_prefix(pasted(tmp_path, lines)) == 0


def test_glibc_abort_opens_a_process_exit(tmp_path: Path) -> None:
    path = pasted(tmp_path, ["step 120 loss 0.41", "double free or corruption (out)", "Aborted (core dumped)"])
    kinds = shown(imported(path))
    assert kinds and kinds[0] == "process/exit"


def test_raylet_dead_worker_opens_a_kill() -> None:
    kinds = shown(imported(WILD / "proc-killed-raylet-worker-died-system-error-verl-4921-1" / "log.txt"))
    assert kinds and kinds[0] == "process/killed"
