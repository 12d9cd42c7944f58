"""loss/oscillation against a noisy loss (stop 44: ``oscillation_min_serial``, ``oscillation_iid_level``), on
real recordings (``tests/fixtures/tuning44``, the SDK's streams unedited, replayed one envelope at a time).
The test is on by default since stop 50 (stops 44-49: opt-in), gated so that the dev corpus's unshaped
LR-too-high swings near the start still open: swings new to the run (``oscillation_shape_new_factor``) or
units the updates killed (docs/detectors.md).

Stop 43: the oscillation rule (a robust spread >= 0.3 of the level, near or above the start, no trend) opened
on healthy runs whose per-step loss is heavy-tailed or noisy -- values drawn independently, however wide,
are not swings. The rule now opens only on swings with a shape (the values run in stretches or alternate)
or on a window thrown up far above the start as a whole.
"""

from __future__ import annotations

import random
from pathlib import Path

from tests.engine.test_unseen_streams import _incidents
from trainguard_engine.catalogue import DetectionSettings
from trainguard_engine.detectors.loss import _lag1_rank_autocorrelation

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "tuning44"
OSC = "loss/oscillation"
ON = DetectionSettings()
"""The default since stop 50: stop 44's shape test asked of every window, with its two gates."""
BEFORE = DetectionSettings(oscillation_min_serial=0.0)
"""Off (any spread opens), the default of stops 44-49."""


def test_a_heavy_tailed_healthy_run_gets_no_oscillation() -> None:
    """Huber loss on Student-t (df 2) noise at batch 2: a robust spread ~1 of its level, its level 2-4x a
    lucky-low start. It opened loss/oscillation (seen at step 41) and kept it open to the end."""
    stream = FIXTURES / "pl_tdf2_huber_bs2_ok.jsonl.gz"
    assert OSC not in _incidents(stream, ON)
    assert OSC in _incidents(stream, BEFORE)


def test_a_sparse_reward_td_loss_gets_no_oscillation() -> None:
    """A DQN-like Huber TD loss with sparse rewards: it opened loss/oscillation (ongoing to the end)."""
    stream = FIXTURES / "plain_dqn_huber_adam_ok.jsonl.gz"
    assert OSC not in _incidents(stream, ON)
    assert OSC in _incidents(stream, BEFORE)


def test_an_lr_too_high_that_swings_in_stretches_is_still_an_oscillation() -> None:
    """The ViT at AdamW 0.1 swings near its start (0.84x), values running in stretches: still caught, at
    the same step as before."""
    stream = FIXTURES / "tuning36_vit_adamw_lr100x_clip.jsonl.gz"
    assert _incidents(stream, ON)[OSC].first_step == _incidents(stream, BEFORE)[OSC].first_step
    # the shape is what opens it here: with an impossible autocorrelation bar it does not open
    never = DetectionSettings(oscillation_min_serial=1.0, oscillation_heavy_tail=1.0,
                              oscillation_shape_new_factor=0.0)
    assert OSC not in _incidents(stream, never)


def test_an_lr_thrown_up_far_above_its_start_is_still_an_oscillation() -> None:
    """BERT at Adafactor 1.0: the loss thrown up to ~5x its start, its swings unshaped: still caught, from
    the same step (its window's lower quartile is ~4x its start)."""
    stream = FIXTURES / "tuning36_hf_bert_adafactor_lr1000x.jsonl.gz"
    assert _incidents(stream, ON)[OSC].first_step == _incidents(stream, BEFORE)[OSC].first_step


def test_lag1_rank_autocorrelation() -> None:
    rng = random.Random(44)
    alternating = [(5.0 if i % 2 else 1.0) + rng.random() for i in range(40)]
    assert _lag1_rank_autocorrelation(alternating) < -0.6
    stretches = [(5.0 if i % 10 < 5 else 1.0) + rng.random() for i in range(40)]
    assert _lag1_rank_autocorrelation(stretches) >= ON.oscillation_min_serial
    draws = [abs(_lag1_rank_autocorrelation([rng.paretovariate(1.5) for _ in range(40)])) for _ in range(400)]
    assert sum(d >= ON.oscillation_min_serial for d in draws) <= 12  # ~1 % of iid windows
    assert _lag1_rank_autocorrelation([1.0, 2.0]) == 0.0
