"""loss/spike: one bad batch the run absorbed at once (stop 42, ``spike_factor`` / ``spike_over_max`` /
``spike_start_level`` / ``spike_window`` / ``spike_resolve_points``), on real recordings of bench/unseen's
tuning sets (``tests/fixtures/tuning42``, the SDK's streams unedited, replayed one envelope at a time).

Before stop 42 such a run got NO incident at all (stop 41: tuning41's GRU, residual MLP and LoRA Llama; two
of heldout41's): the loss and the norm jump for one step, then all is normal -- under every curve rule's
bar, and the explosion rule wants a climb.
"""

from __future__ import annotations

from pathlib import Path

from tests.engine.test_unseen_streams import _incidents
from trainguard_engine.catalogue import DetectionSettings

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "tuning42"
SPIKE = "loss/spike"


def test_a_clipped_lightning_cnn_hit_by_one_batch_x100_gets_a_spike_that_resolves() -> None:
    """Lightning CNN, RMSprop, gradient_clip_val 0.5; batch 110's pixels x100: the loss 11.4x its median
    for one step (under stop 42's first factor, 20: tuned down to 10 on this shape)."""
    found = _incidents(FIXTURES / "pl_cnn_rmsprop_clip_bad_batch.jsonl.gz")
    spike = found[SPIKE]
    assert spike.first_step == 110
    assert spike.status == "resolved", spike.status
    assert spike.severity == "warning"
    assert "absorbed the bad batch" in spike.timeline[-1].what
    assert any(e.rule == "loss.spike" for e in spike.evidence)
    assert set(found) == {SPIKE}, sorted(found)  # nothing else: it was one batch


def test_without_the_spike_rule_the_bad_batch_gets_no_incident() -> None:
    assert _incidents(FIXTURES / "pl_cnn_rmsprop_clip_bad_batch.jsonl.gz", DetectionSettings(spike_factor=0.0)) == {}


def test_a_clipped_lstm_whose_loss_was_weighted_x10000_on_one_step() -> None:
    found = _incidents(FIXTURES / "plain_lstm_sgdm_clip_bad_batch.jsonl.gz")
    spike = found[SPIKE]
    assert spike.first_step == 130 and spike.status == "resolved"
    norm = [e for e in spike.evidence if e.rule == "loss.spike_grad_norm"]
    assert norm and "grad" in norm[0].metric, [e.rule for e in spike.evidence]


def test_a_healthy_trainer_run_with_random_rows_gets_no_spike() -> None:
    """A healthy HF Trainer GPT-2 run (tuning42) whose data carries random-token rows: the Trainer samples rows at
    random, so each batch holds ~1/17 of them and its loss stays within ~1.5x the window's median (hR's review,
    stop 42: the fixture does NOT hold 3-10x natural spikes, as this test's first docstring said -- a healthy
    stream with natural spikes >= 10x its median is still missing here; bench/results/unseen_probe_stop42.txt's
    earlier tuning sets are the evidence for those)."""
    assert SPIKE not in _incidents(FIXTURES / "hf_gpt2_adamw_hard_batches_ok.jsonl.gz")


def test_a_converged_classifiers_one_hard_batch_is_under_its_start() -> None:
    """tuning36's healthy ViT, converged at ~0.002: one batch at 0.074 is 32x its median and 7.5x the
    window's largest, but 0.04x where the run started (spike_start_level)."""
    stream = FIXTURES / "tuning36_plain_vit_adamw_cosine_ok.jsonl.gz"
    assert SPIKE not in _incidents(stream)
    # stop 43: the run's own noise keeps it out too -- its earlier hard batches reached 15.8x and 20.7x its
    # rolling level (spike_over_record: 34.7x and 41.1x are under 3 x 20.7) -- so all three bars must go
    assert SPIKE not in _incidents(stream, DetectionSettings(spike_start_level=0.0))
    assert SPIKE in _incidents(stream, DetectionSettings(spike_start_level=0.0, spike_over_record=0.0,
                                                         spike_tail_power=0.0))
