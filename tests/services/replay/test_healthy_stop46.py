"""Stop 46 (hL): the ninth fresh batch's healthy pastes open nothing, and its tuned-side readings hold through
``trainguard replay`` as a user imports a paste.

* tests/fixtures/healthy46: five real pastes of runs that were training (Flax Stable Diffusion epoch loss
  lines, Lightning epoch bars with a PossibleUserWarning, HF Trainer dict lines with grad_norm bumps, a
  skorch epoch table with torch's EPOCH_DEPRECATION UserWarning, mmcls epoch INFO records with a validation
  progress bar; each source.txt cites its thread) -- none opens an incident;
* Composer's launcher line ``Rank N crashed with exit code C`` / ``Global rank N (PID P) exited with code C``
  is that rank's exit (process/exit, the culprit N);
* Horovod's ``Horovod has been shut down. This was caused by an exception on one of the ranks ...`` is the
  survivors' view of a peer gone (comm/rank-lost)."""

from __future__ import annotations

from pathlib import Path

import pytest

from .local_import import WILD, imported, shown

HEALTHY = Path(__file__).resolve().parents[2] / "fixtures" / "healthy46"


@pytest.mark.parametrize("case", sorted(p.name for p in HEALTHY.iterdir() if p.is_dir()))
def test_healthy_paste_opens_nothing(case: str) -> None:
    assert (HEALTHY / case / "source.txt").read_text(encoding="utf-8").startswith("URL: https://github.com/")
    assert shown(imported(HEALTHY / case / "log.txt")) == []


@pytest.mark.parametrize("case, kind", [
    ("proc-exit1-composer-launcher-rank1-crashed-resource-tracker-mosaicml-examples-292-1", "process/exit"),
    ("proc-exit1-composer-engine-closed-rank0-exited-code-1-llm-foundry-726-1", "process/exit"),
    ("comm-rank-lost-horovod-shut-down-early-stopping-opennmt-tf-985-1", "comm/rank-lost"),
    ("comm-rank-lost-horovod-shut-down-op-requires-ncf-deeplearningexamples-972-1", "comm/rank-lost"),
])
def test_batch9_tuned_pastes_read_their_kind(case: str, kind: str) -> None:
    assert shown(imported(WILD / case / "log.txt"))[:1] == [kind]
