"""A loss blow-up the run came back from (stop 36, bench/unseen's tuning set ``tuning36``), on a real recording
(``tests/fixtures/unseen``, the SDK's stream, unedited), replayed one envelope at a time.

Lightning, a dilated 1-D CNN forecaster, RMSprop at LR 0.1 (100x) beside ``gradient_clip_val`` 1: the loss
goes 0.116 -> 8.0e6 on the first update and swings between 1 and 3e6 for ten steps (inside the run's first
values, which the rolling level and the initial median absorb), then sits flat at ~0.15: the model is dead,
a constant predictor. Before stop 36 only a loss/plateau opened (at step 360), with no word of the LR. The
divergence rule now opens at once on one value >= ``divergence_blowup_factor`` (1000) x the run's initial
level, once the loss is back under that bar (a blow-up it came back from); 0 turns that off.
"""

from __future__ import annotations

from tests.engine.test_unseen_streams import FIXTURES, _incidents
from trainguard_engine.catalogue import DetectionSettings

BLOWUP = "pl_wavenet_rmsprop_lr100x_clip.jsonl.gz"


def test_a_blow_up_the_loss_came_back_from_opens_a_divergence_at_once() -> None:
    found = _incidents(BLOWUP)
    divergence = found["loss/divergence"]
    assert divergence.first_step <= 5
    blowup = [ev for ev in divergence.evidence if ev.rule == "loss.blowup"]
    assert blowup and blowup[0].value is not None and blowup[0].value >= 1000
    assert "learning rate far too high" in divergence.summary
    assert divergence.status == "resolved"  # the loss came back into its band (a dead model, flat there)


def test_without_the_blow_up_rules_only_the_plateau_is_found() -> None:
    # both bars off: the blow-up is also one of the first updates' that left a dead model (stop 37's
    # divergence_early_blowup_factor, 10x), which alone still opens the divergence, later
    found = _incidents(BLOWUP, DetectionSettings(divergence_blowup_factor=0.0, divergence_early_blowup_factor=0.0))
    assert "loss/divergence" not in found
    assert "loss/plateau" in found
    early_only = _incidents(BLOWUP, DetectionSettings(divergence_blowup_factor=0.0))["loss/divergence"]
    assert [ev.threshold for ev in early_only.evidence if ev.rule == "loss.blowup"] == [10.0]


# --- the divergence rule beside an open clip-stale (``divergence_beside_stale``) ---------------------------

CORPUS_DEV = FIXTURES.parent / "corpus_dev"


def test_a_divergence_beside_an_open_clip_stale_is_still_judged_and_resolves() -> None:
    # HF GPT-2, Adam at 308x, max_grad_norm 1 (corpus dev r207): the loss leaves its band (4.2 -> 50-86), every
    # step clips, a clip-stale opens while the loss is out there, and the loss comes back to ~4.0. Judged
    # beside the clip-stale, the divergence resolves once the loss is back; muted, it stayed open to the end.
    found = _incidents(CORPUS_DEV / "r207.jsonl.gz")
    assert found["loss/divergence"].status == "resolved"
    stale = found["gradient/clip-stale"]
    assert stale.status != "resolved"
    assert stale.hypotheses[0]["cause"] == "learning rate too high, so every step clips"


def test_a_divergence_muted_beside_a_clip_stale_stays_open() -> None:
    found = _incidents(CORPUS_DEV / "r207.jsonl.gz", DetectionSettings(divergence_beside_stale=False))
    assert found["loss/divergence"].status != "resolved"
