"""The eighteenth fresh batch (stop 50, hL9; e9d34ef0, measured once before any change) and its healthy pastes:

* the batch's TUNED pastes that its first measurement read right keep their reading through the replay path
  (``trainguard replay``'s defaults), its one tuned miss -- a TensorFlow DeepLab step-loss series labelled
  loss/divergence from its thread's title, which the replay path reads line by line and cannot judge as a
  series -- still reads nothing (a change that makes it read something is to be looked at, not assumed);
  held-out pastes are not named here;
* tests/fixtures/healthy50c: five real pastes of runs that were training (Caffe2's thread-pool-after-fork
  warning x2, TensorFlow's BFC allocator 'ran out of memory ... this is not a failure', a negative RLE loss
  on a tqdm bar, wandb's 'step is less than current step. Dropping entry' warnings), judged healthy from
  their threads before any classifier run: the replay path opens nothing for any of them, and
  ``classify_text`` over the whole paste recognises nothing -- except TinyCLIP's INFO train line, whose
  printed ``loss_scale: 131072.0000`` is read as the scale rule's fact-only reading (the rules only parse:
  whether a scale is a collapse is the process detector's call, ``amp_text_max_scale``), and the replay
  path opens nothing for it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.wild import corpus
from tests.engine.test_classify_stop49_fresh15 import five_healthy_pastes, opens_nothing
from tests.services.replay.local_import import imported, shown
from trainguard_engine.classify import classify_text

HEALTHY = Path(__file__).resolve().parents[1] / "fixtures" / "healthy50c"
WILD = Path(__file__).resolve().parents[1] / "fixtures" / "wild"
BATCH_SOURCE = "fresh batch 18"
LOSS_SERIES = "loss-divergence-tf-deeplab-step-loss-tab-lines-spike-after-checkpoint-uncertain-deeplab-lfov-5-1"
SCALE_LINE = "wandb-step-less-than-current-dropping-entry-warnings-after-info-train-line-cream-252-1"


def _batch_tuned() -> list:
    """The batch's cases on the tuned side (the hash split), by their source.txt's batch note."""
    return [c for c in corpus.load(WILD)
            if BATCH_SOURCE in (c.path / "source.txt").read_text(encoding="utf-8") and c.part == "tune"]


def test_the_batch_has_its_tuned_and_held_out_sides() -> None:
    tuned = _batch_tuned()
    assert len(tuned) == 13
    assert LOSS_SERIES in {c.case_id for c in tuned}


@pytest.mark.parametrize("case", sorted(c.case_id for c in _batch_tuned() if c.case_id != LOSS_SERIES))
def test_the_tuned_pastes_read_their_label_through_replay(case: str) -> None:
    kind = next(c.label.kind for c in corpus.load(WILD) if c.case_id == case)
    assert shown(imported(WILD / case / "log.txt"))[:1] == [kind]


def test_the_loss_series_reads_nothing_line_by_line() -> None:
    assert shown(imported(WILD / LOSS_SERIES / "log.txt")) == []


def test_the_batch_has_its_five_healthy_pastes() -> None:
    five_healthy_pastes(HEALTHY)


@pytest.mark.parametrize("case", sorted(p.name for p in HEALTHY.iterdir() if p.name != SCALE_LINE))
def test_healthy50c_pastes_open_nothing(case: str) -> None:
    opens_nothing(HEALTHY / case / "log.txt")


def test_a_printed_steady_loss_scale_is_a_fact_the_replay_does_not_open() -> None:
    log = HEALTHY / SCALE_LINE / "log.txt"
    found = classify_text(log.read_text(encoding="utf-8"))
    assert found is not None and found.rule == "numeric.loss-scale"
    assert found.facts == {"scale": 131072.0}
    assert shown(imported(log)) == []
