"""A converged model's heavy-tailed gradient norm is no explosion (stop 38, ``explosion_climb_quantile``), on a
real recording (``tests/fixtures/unseen/plain_mlp_sgdm_onecycle_ok.jsonl.gz``, bench/unseen's tuning set
tuning38, the SDK's stream unedited), replayed one envelope at a time.

A healthy ReLU MLP classifier on well-separated blobs under SGD momentum 0.9 + OneCycle (peak 0.1): by step
~150 most batches give a loss of 1e-9..1e-4 and a grad norm of 1e-7..1e-3 (median ~3e-4), while a hard batch
now and then still gives 0.1-0.5 and a norm of 0.5-3. Before stop 38 three such batches among the last ten
steps (each >= 6x the collapsed median, the Mann-Kendall test rising) opened an ERROR gradient/explosion at
step 223 that resolved 20 steps later: a false alarm on a run that learned.
"""

from __future__ import annotations

from tests.engine.test_unseen_streams import _incidents
from trainguard_engine.catalogue import DetectionSettings

HEALTHY = "plain_mlp_sgdm_onecycle_ok.jsonl.gz"


def test_a_converged_models_heavy_tailed_norm_opens_nothing() -> None:
    assert _incidents(HEALTHY) == {}


def test_without_the_range_bar_the_spikes_read_as_an_explosion() -> None:
    found = _incidents(HEALTHY, DetectionSettings(explosion_climb_quantile=0.0))
    explosion = found["gradient/explosion"]
    assert explosion.status == "resolved"
    assert explosion.first_step >= 200
