"""Stop 45 (hL): healthy pastes open nothing, and two reader/classifier readings of the eighth fresh batch's
tuned side, through ``trainguard replay`` as a user imports a paste.

* tests/fixtures/healthy45: five real pastes of runs that were training (DeepSpeed step INFO records, nnU-Net
  epochs with matplotlib's WARNING, BAGEL loss lines with caret-escaped colours, DOPE epoch lines, TFTrainer's
  start with TensorFlow's deprecation WARNINGs; each source.txt cites its thread) -- none opens an incident;
* NCCL's ``NCCL INFO Call to connect returned Connection refused, retrying`` is one attempt: the reader holds
  it and drops it when NCCL's ``Init COMPLETE`` or training follows (it opened comm/init-failure before);
* a paste that starts inside a traceback with its first frame line flush left (``File "util/misc.py", line
  248, in init_distributed_mode`` -- copied from the middle of a row, or into backticks) keeps that frame,
  so an NCCL error raised in the program's start-up function reads comm/init-failure (it lost the frame and
  read comm/failure before)."""

from __future__ import annotations

from pathlib import Path
from typing import List

import pytest

from trainguard_server.replay.logs import LogSegmenter

from .local_import import imported, pasted, shown

HEALTHY = Path(__file__).resolve().parents[2] / "fixtures" / "healthy45"


@pytest.mark.parametrize("case", sorted(p.name for p in HEALTHY.iterdir() if p.is_dir()))
def test_healthy_paste_opens_nothing(case: str) -> None:
    assert (HEALTHY / case / "source.txt").read_text(encoding="utf-8").startswith("URL: https://github.com/")
    assert shown(imported(HEALTHY / case / "log.txt")) == []


RETRY = "gpu-a:7710:7764 [0] NCCL INFO Call to connect returned Connection refused, retrying"
COMPLETE = "gpu-a:7710:7764 [0] NCCL INFO comm 0x55d0 rank 0 nranks 4 cudaDev 0 busId 1b000 - Init COMPLETE"
TRAINING = [f"Epoch 0:  {i}%|##        | {i}/100 [00:0{i % 10}<01:30, 1.10it/s, loss=2.{i:02d}]" for i in
            range(10, 60, 10)]


@pytest.mark.parametrize("lines", [
    [RETRY, RETRY, COMPLETE, *TRAINING],
    [RETRY, COMPLETE],
    [RETRY, RETRY, *TRAINING],
])
def test_nccl_connect_retries_that_went_on_open_nothing(tmp_path: Path, lines: List[str]) -> None:
    assert shown(imported(pasted(tmp_path, lines))) == []


def test_nccl_connect_retries_a_paste_ends_in_still_open_it(tmp_path: Path) -> None:
    assert shown(imported(pasted(tmp_path, [RETRY] * 3)))[:1] == ["comm/init-failure"]


LOOSE_TRACEBACK = [
    'File "/home/u/mae/util/misc.py", line 248, in init_distributed_mode',
    "    torch.distributed.barrier()",
    '  File "/opt/venv/lib/python3.8/site-packages/torch/distributed/distributed_c10d.py", line 3696, in barrier',
    "    work = default_pg.barrier(opts=opts)",
    "torch.distributed.DistBackendError: NCCL error in: ../torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:1333, "
    "internal error - please report this issue to the NCCL developers, NCCL version 2.18.1",
    "ncclInternalError: Internal check failed.",
    "Last error:",
    "Socket recv failed while polling for opId=0x7f0011223344",
]


def test_paste_starting_at_a_flush_left_frame_keeps_it() -> None:
    seg = LogSegmenter(headless=True)
    for number, line in enumerate(LOOSE_TRACEBACK, 1):
        seg.feed(number, line, None)
    items = [item for item in seg.take() + seg.flush() if item.kind == "exception"]
    assert len(items) == 1 and items[0].line == 1
    assert [f["function"] for f in items[0].payload["frames"]] == ["init_distributed_mode", "barrier"]


def test_nccl_error_raised_in_the_start_up_function_reads_init_failure(tmp_path: Path) -> None:
    assert shown(imported(pasted(tmp_path, LOOSE_TRACEBACK)))[:1] == ["comm/init-failure"]


# ---- hR's review of 63b7fcf (stop 45), fixed by hL2: F3 and F6 through replay ----

HF_LOGS = ["{'loss': 2.3012, 'grad_norm': 1.53, 'learning_rate': 4.9e-05, 'epoch': 0.01}",
           "{'loss': 2.1003, 'grad_norm': 1.21, 'learning_rate': 4.8e-05, 'epoch': 0.02}",
           "{'train_runtime': 120.5, 'train_samples_per_second': 30.1, 'train_loss': 2.2, 'epoch': 1.0}"]
RINGS = ["gpu-a:7710:7764 [0] NCCL INFO Channel 00/02 :    0   1", "gpu-a:7710:7764 [0] NCCL INFO Connected all rings",
         "gpu-a:7710:7764 [0] NCCL INFO Connected all trees"]
C10D_RETRY = ("[W socket.cpp:663] [c10d] The client socket has failed to connect to [localhost]:29500 (errno: 99 - "
              "Cannot assign requested address).")


@pytest.mark.parametrize("lines", [[RETRY, RETRY, *RINGS, *HF_LOGS], [C10D_RETRY, *HF_LOGS]])
def test_retries_an_hf_trainer_run_went_on_from_open_nothing(tmp_path: Path, lines: List[str]) -> None:
    """F3: the HF Trainer's dict log lines (no tqdm bar, no Init COMPLETE in the paste) are training."""
    assert shown(imported(pasted(tmp_path, lines))) == []


MMCV_HEAD = [
    "Traceback (most recent call last):",
    '  File "tools/train.py", line 187, in <module>',
    "    main()",
    '  File "tools/train.py", line 102, in main',
    "    init_dist(args.launcher, **cfg.dist_params)",
    '  File "/usr/local/lib/python3.7/site-packages/mmcv/runner/dist_utils.py", line 18, in init_dist',
    "    _init_dist_pytorch(backend, **kwargs)"]


@pytest.mark.parametrize("tail", [
    ['  File "/usr/local/lib/python3.7/site-packages/mmcv/runner/dist_utils.py", line 29, in _init_dist_pytorch',
     "    rank = int(os.environ['RANK'])", '  File "/usr/lib/python3.7/os.py", line 679, in __getitem__',
     "    raise KeyError(key) from None", "KeyError: 'RANK'"],
    ['  File "/usr/local/lib/python3.7/site-packages/mmcv/runner/dist_utils.py", line 32, in _init_dist_pytorch',
     "    torch.cuda.set_device(rank % num_gpus)", "ZeroDivisionError: integer division or modulo by zero"],
])
def test_a_non_comm_exception_in_mmcv_init_dist_stays_an_exception(tmp_path: Path, tail: List[str]) -> None:
    """F6: only a comm error raised in a program's start-up function is the group not coming up."""
    assert shown(imported(pasted(tmp_path, [*MMCV_HEAD, *tail]))) == ["process/exception"]
