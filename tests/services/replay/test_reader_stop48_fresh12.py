"""Stop 48 (hL3), from the TUNED side's misses of the twelfth fresh batch: an indent of one to three spaces
that every line of a paste shares is the paste's own -- dropped as a markdown code block's four spaces are --
when a line Python prints at column 0 (a traceback's header, an exception line) sits at it: the Lumina-mGPT
FSDP save error pasted under a sentence, ``  AssertionError: FSDP assumes model.norm.weight is in the
state_dict ...`` (Lumina-mGPT#18), opened nothing before. A traceback cut at the top keeps its frames' own
indent (no column-0 line sits at it)."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainguard_server.replay.logs import paste_indent

from .local_import import WILD, imported, pasted, shown

LUMINA = "proc-exception-fsdp-assumes-in-state-dict-save-ckpt-lumina-mgpt-18-1"
FACESHIFTER = "loss-nonfinite-lossd-lossg-nan-apex-scale-zero-traceback-faceshifter-55-1"


def test_the_tuned_paste_is_the_programs_exception() -> None:
    assert paste_indent(WILD / LUMINA / "log.txt") == "  "
    assert shown(imported(WILD / LUMINA / "log.txt")) == ["process/exception"]


def test_an_indented_traceback_with_losses_reads_as_before() -> None:
    assert paste_indent(WILD / FACESHIFTER / "log.txt") == "  "
    assert shown(imported(WILD / FACESHIFTER / "log.txt"))[:1] == ["loss/non_finite"]


def test_a_traceback_cut_at_the_top_keeps_its_frames_indent(tmp_path: Path) -> None:
    path = pasted(tmp_path, ['  File "train.py", line 3, in main', "    x = step()",
                             '  File "model.py", line 9, in step', "    raise ValueError('bad')"])
    assert paste_indent(path) == ""


@pytest.mark.parametrize("lines", [
    [" Traceback (most recent call last):", '   File "a.py", line 1, in <module>', "     f()",
     " ZeroDivisionError: division by zero"],
    ["   RuntimeError: CUDA error: an illegal memory access was encountered"],
])
def test_a_column_0_line_at_the_shared_indent_marks_it_the_pastes(tmp_path: Path, lines: list) -> None:
    path = pasted(tmp_path, lines)
    assert paste_indent(path) == lines[-1][:len(lines[-1]) - len(lines[-1].lstrip())]
    assert shown(imported(path)) != []


@pytest.mark.parametrize("lines", [
    ["  epoch 1 | loss 0.41 | lr 1e-4", "  epoch 2 | loss 0.37 | lr 1e-4", "  saved checkpoint epoch_2.pt"],
    ["  UserWarning: the dataloader has few workers", "  epoch 1 loss 0.4"],
])
def test_a_healthy_indented_log_opens_nothing(tmp_path: Path, lines: list) -> None:
    path = pasted(tmp_path, lines)
    assert paste_indent(path) == ""
    assert shown(imported(path)) == []
