"""A clip-stale incident whose loss went up ranks "learning rate too high" first (stop 37,
``diagnosis_clip_stale_loss_rise``), on a real recording (corpus dev r207: HF GPT-2, Adam at 308x its usual LR,
``max_grad_norm`` 1, the SDK's stream unedited), replayed one envelope at a time.

The loss goes 4.2 -> 50-86 while every step clips. With the divergence rule on, the divergence incident already
makes the LR the clip-stale's lead (``diverged_at``); here that rule is turned off (its factors out of reach), so
only the loss's rise, kept in the rank's history, can say that the updates were too large for the model.
"""

from __future__ import annotations

from tests.engine.test_unseen_streams import FIXTURES, _incidents
from trainguard_engine.catalogue import DetectionSettings

R207 = FIXTURES.parent / "corpus_dev" / "r207.jsonl.gz"
NO_DIVERGENCE = dict(divergence_factor=1e12, divergence_far_factor=1e12, divergence_blowup_factor=0.0)
LR_FIRST = "learning rate too high, so every step clips"


def test_a_clip_stale_whose_loss_rose_ranks_the_lr_first() -> None:
    found = _incidents(R207, DetectionSettings(**NO_DIVERGENCE))  # type: ignore[arg-type]
    assert "loss/divergence" not in found
    stale = found["gradient/clip-stale"]
    assert stale.hypotheses[0]["cause"] == LR_FIRST
    assert any("went up to" in why for why in stale.hypotheses[0]["why"])
    assert "raise the clip threshold" in stale.checks[-1]  # moved last: it lets the too-large updates through


def test_with_the_rise_rule_off_the_threshold_leads() -> None:
    found = _incidents(R207, DetectionSettings(diagnosis_clip_stale_loss_rise=0.0, **NO_DIVERGENCE))  # type: ignore[arg-type]
    stale = found["gradient/clip-stale"]
    assert stale.hypotheses[0]["cause"] != LR_FIRST
