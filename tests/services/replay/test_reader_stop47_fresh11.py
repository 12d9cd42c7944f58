"""Stop 47 (hL2), from the TUNED side's misses: CPython's ``multiprocessing`` refusing to start a child while a
spawned child is still importing the main module -- ``RuntimeError: An attempt has been made to start a new
process before the`` / ``current process has finished its bootstrapping phase.`` (a script without the
``if __name__ == '__main__':`` guard under spawn: Windows / macOS DataLoader workers, ``mp.spawn``) -- is the
program's exception also when the paste holds only the message's indented lines, not its ``RuntimeError:``
line (pytorch-image-classification#6 on Windows opened nothing before)."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainguard_server.replay.logs import reported_exception

from .local_import import WILD, imported, pasted, shown

BOOTSTRAP = "        An attempt has been made to start a new process before the"


@pytest.mark.parametrize("case", [
    # the message alone, pasted with its indentation (the RuntimeError line not pasted)
    "proc-exception-windows-spawn-bootstrapping-no-prefix-train-image-classification-6-1",
    # with its RuntimeError line (read so before: unchanged)
    "py-bootstrapping-phase-ddp-spawn-no-main-guard-lightning-16900-1",
])
def test_the_bootstrapping_message_is_the_programs_exception(case: str) -> None:
    assert shown(imported(WILD / case / "log.txt"))[:1] == ["process/exception"]


@pytest.mark.parametrize("line", [BOOTSTRAP, BOOTSTRAP.strip(), " " + BOOTSTRAP.strip()])
def test_the_message_line_is_read_as_a_runtime_error(line: str) -> None:
    assert reported_exception(line) == f"RuntimeError: {line.strip()}"


@pytest.mark.parametrize("line", [
    "Note: An attempt has been made to start a new process before the main guard -- see the docs",
    "WARNING: error handler: An attempt has been made to start a new process before the pool was ready",
])
def test_prose_or_a_warning_about_it_is_not_the_exception(line: str) -> None:
    assert reported_exception(line) is None


def test_a_healthy_windows_run_with_the_guard_opens_nothing(tmp_path: Path) -> None:
    path = pasted(tmp_path, ["if __name__ == '__main__':  # needed on Windows (spawn)",
                             "Epoch 1/10: 100%|##########| 390/390 [00:41<00:00,  9.43it/s, loss=1.62]",
                             "Epoch 2/10: 100%|##########| 390/390 [00:40<00:00,  9.61it/s, loss=1.21]"])
    assert shown(imported(path)) == []
