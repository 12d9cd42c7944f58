"""A tool's own report of a PyTorch exception without its type (``Error running job: element 0 of tensors does
not require grad ...``, ``Training failed: mat1 and mat2 shapes cannot be multiplied ...``) is read as the
exception PyTorch raised: before, such a line was log text, and log text classified process/exception opens
no incident (only exception events do), so the run showed nothing."""

from __future__ import annotations

from pathlib import Path
from typing import List

import pytest

from trainguard_server.replay import Importer, LocalBackend, ReplayOptions
from trainguard_server.replay.logs import LogItem, LogReader, reported_exception

NOGRAD = "element 0 of tensors does not require grad and does not have a grad_fn"


@pytest.mark.parametrize("line, expected", [
    (f"Error running job: {NOGRAD}", f"RuntimeError: {NOGRAD}"),
    # glued to a progress bar whose own fields hold colons (ostris/ai-toolkit#403's shape)
    (f"|###6      | 908/2500 [11:18<19:50,  1.34it/s, lr: 1.8e-04 loss: 8.973e-02]Error running job: {NOGRAD}",
     f"RuntimeError: {NOGRAD}"),
    ("Training failed: mat1 and mat2 shapes cannot be multiplied (4x4 and 8x8)",
     "RuntimeError: mat1 and mat2 shapes cannot be multiplied (4x4 and 8x8)"),
    ("2025-07-22 01:04:13,084 - opt - ERROR - step failed: Trying to backward through the graph a second time",
     "RuntimeError: Trying to backward through the graph a second time"),
    ("exception in forward: index out of range in self", "IndexError: index out of range in self"),
    (NOGRAD, f"RuntimeError: {NOGRAD}"),  # the message alone (print(e))
])
def test_a_reported_torch_message_reads_as_its_exception_line(line: str, expected: str) -> None:
    assert reported_exception(line) == expected


@pytest.mark.parametrize("line", [
    f"[WARN] GradCAM generation failed: {NOGRAD}, using fallback",  # handled: a level below ERROR
    f"Warning: OCR loss computation failed: {NOGRAD}",
    f"INFO - step 3 failed: {NOGRAD}",
    f"note: {NOGRAD}",  # no word of an error before the colon
    f"the docs say '{NOGRAD}' means a frozen graph",  # quoted in prose
    "Error running job: the dataset is empty",  # not one of PyTorch's messages
    "step 10 loss: 0.51 lr: 1e-4",
])
def test_other_lines_are_not_reported_exceptions(line: str) -> None:
    assert reported_exception(line) is None


def _items(tmp_path: Path, lines: List[str]) -> List[LogItem]:
    path = tmp_path / "log.txt"
    path.write_text("\n".join(lines) + "\n")
    return list(LogReader(path, 0, min_level=""))


def test_the_reader_opens_an_exception_of_the_reported_message(tmp_path: Path) -> None:
    items = _items(tmp_path, ["step 907 loss 0.09", f"Error running job: {NOGRAD}", "Result: 1 failure"])
    exceptions = [i for i in items if i.kind == "exception"]
    assert len(exceptions) == 1
    # the lines after it go on its message, as after a bare 'RuntimeError: ...' line
    assert exceptions[0].payload["type"] == "RuntimeError"
    assert exceptions[0].payload["message"].startswith(NOGRAD)
    assert exceptions[0].line == 2


def test_a_handled_report_stays_a_log_line(tmp_path: Path) -> None:
    items = _items(tmp_path, [f"[WARN] GradCAM generation failed: {NOGRAD}, using fallback"])
    assert [i.kind for i in items] == ["log"]


def test_the_import_shows_the_crash(tmp_path: Path) -> None:
    path = tmp_path / "log.txt"
    path.write_text("\n".join(["Running 1 job", f"Error running job: {NOGRAD}", "Result:", " - 1 failure"]) + "\n")
    backend = LocalBackend(tmp_path / "data")
    try:
        Importer(ReplayOptions(run_id="nograd", logs=[(0, path)]), backend).run()
        backend.finish()
        kinds = [f"{i['category']}/{i['subtype']}" for i in backend.incidents("nograd")]
    finally:
        backend.close()
    assert "process/exception" in kinds


def test_every_known_message_holds_a_needle_of_the_prefilter() -> None:
    from trainguard_server.replay.logs import _TORCH_MESSAGE_NEEDLES, _TORCH_MESSAGES

    for _type, pattern in _TORCH_MESSAGES:
        assert any(needle in pattern.replace("\\", "") for needle in _TORCH_MESSAGE_NEEDLES), pattern
