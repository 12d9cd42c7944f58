"""The replay reader since stop 49 (hL5), from the TUNED side's misses of the fourteenth fresh batch
(e1e3408, measured once before any change):

* An NCCL error message a paste double-spaces (a blank line after each of its lines: NVIDIA-NeMo/Speech#15019)
  stays one log item over its blank lines, so its reason is read with its ``Last error:``.
* An exception line whose class is named for no error but qualified by a module of exceptions (``exc``,
  ``exceptions``, ``errors``) with a message is an exception line: ``torch._dynamo.exc.
  FailOnRecompileLimitHit: recompile_limit reached with fullgraph=True ...`` (microsoft/dion#23, nothing
  before). A warning class there stays a warning.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.services.replay.local_import import WILD, imported, kind, shown

NEMO = "comm-init-nccl-invalid-usage-bootstrap-no-socket-interface-tcpstore-recv-nemo-llm-pretrain-nemo-15019-1"
DION = "proc-exception-dynamo-recompile-limit-warnings-then-failonrecompilelimithit-fullgraph-optimizer-dion-23-1"


def _imported_text(tmp_path: Path, text: str) -> list:
    path = tmp_path / "log.txt"
    path.write_text(text, encoding="utf-8")
    return imported(path)


def test_the_double_spaced_nccl_message_is_read_with_its_last_error() -> None:
    kinds = [kind(i) for i in imported(WILD / NEMO / "log.txt")]
    assert "comm/init-failure" in kinds and "comm/mismatch" not in kinds


def test_a_double_spaced_message_that_ends_keeps_what_follows(tmp_path: Path) -> None:
    text = ("RuntimeError: NCCL error in: ProcessGroupNCCL.cpp:1191, unhandled system error, NCCL version 2.14.3\n"
            "\n"
            "ncclSystemError: System call (e.g. socket, malloc) or external library call failed.\n"
            "\n"
            "Last error:\n"
            "\n"
            "socketStartConnect: Connect to 10.1.1.5<36721> failed : Connection refused\n"
            "\n"
            "Epoch 1 done\n")
    assert shown(_imported_text(tmp_path, text)) == ["comm/init-failure"]


def test_a_version_line_then_blank_lines_opens_nothing(tmp_path: Path) -> None:
    text = "Using backend nccl, NCCL version 2.18.1\n\n\nEpoch 1: loss 0.52\n\nEpoch 2: loss 0.47\n"
    assert shown(_imported_text(tmp_path, text)) == []


def test_the_dynamo_exception_line_is_an_exception() -> None:
    assert shown(imported(WILD / DION / "log.txt"))[:1] == ["process/exception"]


@pytest.mark.parametrize("line", [
    "torch._dynamo.exc.BackendCompilerFailed: backend='inductor' raised:\n",
    "ray.exceptions.RayTaskError: ray::train_loop() (pid=4411, ip=10.0.0.7)\n",
])
def test_a_class_of_an_exceptions_module_is_an_exception(tmp_path: Path, line: str) -> None:
    assert shown(_imported_text(tmp_path, "step 10 loss 0.51\n" + line))[:1] == ["process/exception"]


@pytest.mark.parametrize("text", [
    "urllib3.exceptions.InsecureRequestWarning: Unverified HTTPS request is being made to host 'hub'\n",
    "Loading handlers from myproj.errors.Handler: ok\nstep 10 loss 0.5\n",
    "INFO: registered mypkg.exceptions.Retry: 3 attempts\nstep 10 loss 0.5\n",
    "myproj.errors.Handler\nstep 10 loss 0.5\n",
])
def test_warnings_and_prose_stay_quiet(tmp_path: Path, text: str) -> None:
    assert shown(_imported_text(tmp_path, "Epoch 1: loss 0.61\n" + text)) == []
