"""What a paste carries, read since stop 43 (hL), found on the TUNED side of the fifth fresh batch (c470137) and
by ``bench/wild/stress.py --formats`` (new tag ``metaflow``), and the stop-43 classifier readings seen end to end
through ``trainguard replay``. The lines are written for the shape (not copied from the batch's pastes):

* Metaflow's column before every line a task prints, ``2023-04-29 06:01:12.977 [177/train/578 (pid 28936)]
  [<log id>] `` -- a stamp and up to three bracketed sources -- is dropped like a collector's column, so the
  traceback under it reads as one (``metaflow`` lost 48 of 660 tuned pastes, now 2);
* a sentence that quotes an exception line after saying it is an error (``it report a error:"RuntimeError:
  ..."``) is that exception (:func:`quoted_exception`); a warning's does not count;
* ``rank N died from signal S``, Ray's ``RayTaskError(OutOfMemoryError)`` and XLA's ``RESOURCE_EXHAUSTED: Out of
  memory`` open their incidents from a pasted log."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainguard_server.replay.logs import line_level, paste_relay_prefix, quoted_exception

from .local_import import imported, pasted, shown

METAFLOW = "2023-04-29 06:01:{s:02d}.977 [177/train/578 (pid 28936)] [09c561ee-a44c-4795-967c-7183a83b3160] "
TRACEBACK = [
    "Traceback (most recent call last):",
    '  File "/opt/app/train.py", line 88, in <module>',
    "    trainer.save_checkpoint(path)",
    '  File "/opt/app/train.py", line 61, in save_checkpoint',
    "    torch.save(state, path)",
    "OSError: [Errno 28] No space left on device",
]


def test_metaflow_column_is_a_relay_column(tmp_path: Path) -> None:
    lines = [METAFLOW.format(s=i) + line for i, line in enumerate(TRACEBACK)]
    path = pasted(tmp_path, lines)
    assert paste_relay_prefix(path) == len(METAFLOW.format(s=0))
    assert shown(imported(path)) == ["process/exception"]


def test_metaflow_column_without_a_log_id(tmp_path: Path) -> None:
    column = "2023-04-29 06:01:12.977 [177/train/578 (pid 28936)] "
    path = pasted(tmp_path, [column + line for line in TRACEBACK])
    assert paste_relay_prefix(path) == len(column)
    assert shown(imported(path)) == ["process/exception"]


def test_a_bracketed_level_still_ends_the_column(tmp_path: Path) -> None:
    # a logger's own record: stamp, a source in brackets, then its level in brackets -- the level is the
    # record's, so the column ends before it
    lines = [f"2024-01-01 10:00:0{i} [worker-1] [INFO] step {i} loss 0.5" for i in range(4)]
    assert paste_relay_prefix(pasted(tmp_path, lines)) == len("2024-01-01 10:00:00 [worker-1] ")


@pytest.mark.parametrize("line, expected", [
    (' when i resume from my checkpoint,it report a error:"RuntimeError: PytorchStreamReader failed reading zip '
     'archive: failed finding central directory"',
     "RuntimeError: PytorchStreamReader failed reading zip archive: failed finding central directory"),
    ("Training failed with this exception: 'ValueError: too many values to unpack (expected 2)'",
     "ValueError: too many values to unpack (expected 2)"),
    ("I got the error: \u201ctorch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\u201d",
     "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"),
])
def test_quoted_exception(line: str, expected: str) -> None:
    assert quoted_exception(line) == expected


@pytest.mark.parametrize("line", [
    "the docs say: \"RuntimeError: ...\" is raised when",   # no error lead before the colon
    "[WARNING] loading failed: 'KeyError: step' (using defaults)",   # a warning: handled
    "error: RuntimeError: no quote, read by the other readers",
])
def test_not_a_quoted_exception(line: str) -> None:
    assert quoted_exception(line) is None


def test_quoted_exception_is_imported(tmp_path: Path) -> None:
    path = pasted(tmp_path, [' when i resume training it report a error:"RuntimeError: [enforce fail at '
                             'inline_container.cc:144] . PytorchStreamReader failed reading zip archive: failed '
                             'finding central directory"'])
    assert shown(imported(path)) == ["process/exception"]


def test_rank_died_from_signal_opens_an_exit(tmp_path: Path) -> None:
    incidents = imported(pasted(tmp_path, ["rank 1 died from signal 11 and dumped core",
                                           "rank 3 died from signal 9"]))
    assert shown(incidents)[0] == "process/exit"


def test_ray_task_error_line_opens_an_oom(tmp_path: Path) -> None:
    path = pasted(tmp_path, [
        "ray.exceptions.RayTaskError(OutOfMemoryError): ray::PolicyWorker.train_step() (pid=4242, ip=10.0.0.7, "
        "actor_id=0123456789abcdef, repr=PolicyWorker[rank=1])",
        '  File "/opt/app/worker.py", line 200, in train_step',
        "    loss = self.model(batch)",
    ])
    assert shown(imported(path)) == ["memory/oom"]


def test_xla_out_of_memory_exception_is_an_oom(tmp_path: Path) -> None:
    path = pasted(tmp_path, [
        '  File "/opt/app/train.py", line 31, in step',
        "    out = compiled(*args)",
        "jaxlib.xla_extension.XlaRuntimeError: RESOURCE_EXHAUSTED: Out of memory while trying to allocate "
        "1073741824 bytes.",
        "BufferAssignment OOM Debugging.",
    ])
    assert shown(imported(path)) == ["memory/oom"]


@pytest.mark.parametrize("line, level", [
    ("[NeMo W 2024-03-20 18:55:16 nemo_logging:349] /opt/nemo/utils/model_utils.py:311: deprecated call", "WARNING"),
    ("[NeMo I 2024-03-20 18:55:16 exp_manager:394] Experiments will be logged at /results/run", "INFO"),
    ("[NeMo E 2024-03-20 18:55:17 exp_manager:812] Could not save the checkpoint to /results/run", "ERROR"),
    ("E1129 08:12:43.123456 1234 file.cpp:12] glog still reads", "ERROR"),
    ("[NeMo X 2024-03-20 18:55:16 nemo_logging:349] not a level letter", ""),
])
def test_nemo_record_level(line: str, level: str) -> None:
    assert line_level(line) == level


def test_a_nemo_warning_quoting_an_error_is_not_an_exception(tmp_path: Path) -> None:
    # NeMo's W record of an error the code handled is not the job's failure
    assert quoted_exception("[NeMo W 2024-03-20 18:55:16 optimizers:55] Apex failed to load: 'ImportError: "
                            "cannot import name fused_adam'") is None
