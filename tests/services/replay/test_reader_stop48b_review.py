"""hR3's MEDIUM-4 on stop 48's paste indent (fixed by hL4): a 1-3-space indent every line shares is the
paste's only when a traceback header sits at it, or when the exception-shaped line at it is the last non-blank
line (where Python prints it) -- not for any ``XxxError: ...``-shaped line among others: a metric named by its
class, a retried request's warning, a config key."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainguard_server.replay.logs import paste_indent

from .local_import import WILD, imported, pasted, shown

STEPS = [f"  epoch 1 step {n} loss 0.{90 - n} lr 3.0e-04" for n in range(10, 60, 10)]


@pytest.mark.parametrize("middle", [
    ["  validation:", "  MeanSquaredError: 0.0213", "  MeanAbsoluteError: 0.1011"],
    ["  requests.exceptions.ConnectionError: HTTPSConnectionPool(host='api.wandb.ai', port=443): Read timed out. "
     "Retrying in 5s"],
    ["  model:", "    name: resnet50", "  LossException: none", "  SegmentationFailure: 0"],
])
def test_an_exception_shaped_line_among_a_healthy_logs_lines_keeps_the_indent(tmp_path: Path,
                                                                                middle: list) -> None:
    path = pasted(tmp_path, STEPS + middle + STEPS)
    assert paste_indent(path) == ""
    assert shown(imported(path)) == []


def test_the_lumina_paste_still_drops_its_indent() -> None:
    case = WILD / "proc-exception-fsdp-assumes-in-state-dict-save-ckpt-lumina-mgpt-18-1" / "log.txt"
    assert paste_indent(case) == "  "
    assert shown(imported(case)) == ["process/exception"]


def test_an_error_ending_an_indented_paste_is_the_pastes(tmp_path: Path) -> None:
    path = pasted(tmp_path, [*STEPS, "  RuntimeError: CUDA error: an illegal memory access was encountered"])
    assert paste_indent(path) == "  "
    assert shown(imported(path))[:1] == ["memory/cuda-error"]
