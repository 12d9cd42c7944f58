"""A blow-up on the first updates that left a dead model (stop 37, ``divergence_early_blowup_factor``), on a real
recording (``tests/fixtures/unseen/plain_enc_adam_lr_high_clip.jsonl.gz``, bench/unseen's tuning set, the SDK's
stream unedited), replayed one envelope at a time.

A Transformer-encoder classifier under Adam at 0.2 beside ``clip_grad_norm_`` 0.5: the loss goes 1.35 -> 19 in
4 steps (14x its first value, far under the 1000x blow-up bar), then sits near its start (~1.4, a constant
predictor). Before stop 37 only gradient/vanishing opened (at 149), with no word of the LR.
"""

from __future__ import annotations

from tests.engine.test_unseen_streams import _incidents
from trainguard_engine.catalogue import DetectionSettings

DEAD = "plain_enc_adam_lr_high_clip.jsonl.gz"


def test_an_early_blow_up_that_left_a_dead_model_opens_a_divergence() -> None:
    found = _incidents(DEAD)
    divergence = found["loss/divergence"]
    assert divergence.first_step <= 5  # from the blown-up value's step
    blowup = [ev for ev in divergence.evidence if ev.rule == "loss.blowup"]
    assert blowup and blowup[0].threshold == 10.0 and blowup[0].value is not None and blowup[0].value >= 10
    assert "learning rate far too high" in divergence.summary
    assert divergence.status == "resolved"  # the dead loss sits in its band
    assert "gradient/vanishing" in found  # what the gradients say stays said


def test_without_the_early_bar_only_the_vanishing_is_found() -> None:
    found = _incidents(DEAD, DetectionSettings(divergence_early_blowup_factor=0.0))
    assert "loss/divergence" not in found
    assert "gradient/vanishing" in found
