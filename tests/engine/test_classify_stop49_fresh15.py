"""The fifteenth fresh batch's healthy pastes (stop 49, hL6): tests/fixtures/healthy49b, five real pastes of
runs that were training, judged healthy from their threads before the classifier ran on them -- PyTorch's
``lr_scheduler.step()`` before ``optimizer.step()`` UserWarning four ways (fenced; python-fenced, wrapped and
indented; run on from a progress value in a ``> `` block quote; single backticks) and ``torch.meshgrid``'s
indexing UserWarning under multi-GPU training. Each must open nothing: neither ``classify_text`` over the
whole paste nor the replay path as ``trainguard replay`` imports it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.services.replay.local_import import imported, shown
from trainguard_engine.classify import classify_text

HEALTHY = Path(__file__).resolve().parents[1] / "fixtures" / "healthy49b"


def five_healthy_pastes(folder: Path) -> None:
    """``folder`` holds five pastes, each citing its thread and why it is healthy (a batch's healthy set)."""
    cases = sorted(p.name for p in folder.iterdir())
    assert len(cases) == 5
    for case in cases:
        source = (folder / case / "source.txt").read_text(encoding="utf-8")
        assert "github.com/" in source and "Healthy:" in source, case


def opens_nothing(log: Path) -> None:
    """Neither ``classify_text`` over the whole paste nor the replay path opens anything for ``log``."""
    text = log.read_text(encoding="utf-8")
    assert text.strip()
    assert classify_text(text) is None
    assert shown(imported(log)) == []


def test_the_batch_has_its_five_healthy_pastes() -> None:
    five_healthy_pastes(HEALTHY)


@pytest.mark.parametrize("case", sorted(p.name for p in HEALTHY.iterdir()))
def test_healthy49b_pastes_open_nothing(case: str) -> None:
    opens_nothing(HEALTHY / case / "log.txt")
