"""A pre-NaN gradient explosion resolves once the norm settled at a new level (stop 41,
``explosion_settled_spread`` / ``explosion_settled_level``), on a real recording of bench/unseen's tuning set
tuning41 (``tests/fixtures/tuning41/plain_cvae_adam_bad_batch.jsonl.gz``, the SDK's stream unedited),
replayed one envelope at a time.

A plain-loop conditional VAE (ReLU MLPs, MSE + 0.01 KL) under Adam 2e-3 gets one batch of inputs x1000 at
step 200: the loss 0.8 -> 8.4e5 -> 0.8, then, Adam's second moments thrown off, the norm climbs from ~0.6 to
4-9 by step 215 and stays there to the end (300 steps) while the loss sits at 2-3.5, under its start (2.9).
Before stop 41 the gradient/explosion flagged at step 215 stayed open (ERROR) to the end: the norm never came
back under 2x its median before the climb, the rule that resolved a pre-NaN explosion. The same shape of
stream as stop 40's held-out Lightning VAE (Adam, one batch x1000: the norm 0.4 -> 5-12 to the end).
"""

from __future__ import annotations

from pathlib import Path

from tests.engine.test_unseen_streams import _incidents
from trainguard_engine.catalogue import DetectionSettings

STREAM = Path(__file__).resolve().parents[1] / "fixtures" / "tuning41" / "plain_cvae_adam_bad_batch.jsonl.gz"
EXPLOSION = "gradient/explosion"


def test_an_explosion_whose_norm_settled_at_a_new_level_resolves() -> None:
    found = _incidents(STREAM)
    explosion = found[EXPLOSION]
    assert explosion.status == "resolved", explosion.status
    # stop 43: the batch at step 200 (>= the blow-up bar, back in its range on the next value) is loss/spike's,
    # no longer a divergence blow-up that the explosion re-classified (first_step 200); the explosion of the
    # norm that followed it opens on its own climb, at 204
    assert explosion.first_step == 204
    assert found["loss/spike"].first_step == 200
    last = explosion.timeline[-1].what
    assert "stopped climbing" in last and "no rising trend" in last, last


def test_without_the_settled_rule_the_explosion_stays_open() -> None:
    found = _incidents(STREAM, DetectionSettings(explosion_settled_spread=0.0))
    assert found[EXPLOSION].status != "resolved"


def test_a_loss_that_did_not_fall_far_enough_keeps_it_open() -> None:
    """The settled rule asks the run to have learned: a level bar under where the loss now sits keeps it."""
    found = _incidents(STREAM, DetectionSettings(explosion_settled_level=0.5))
    assert found[EXPLOSION].status != "resolved"
