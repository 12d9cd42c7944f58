"""Numerical failures stated in words (classify/numeric.py) and when the process detector takes them.
The lines are cut from logs of the wild corpus (tests/fixtures/wild/<id>/source.txt names each thread)."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainguard_engine.catalogue import DetectionSettings
from trainguard_engine.classify import classify_text
from trainguard_engine.detectors.process import _numeric_text_wanted
from trainguard_engine.state import RankState, RunState


@pytest.mark.parametrize("line, kind", [
    ("2022-02-09 20:28:32,418 - mmdet - INFO - Epoch [1][658/742]     lr: 5.000e-05, eta: 2:15:01, "
     "loss_cls: nan, loss_bbox: nan, loss: nan", "loss/non_finite"),
    ("Loss is nan, stopping training", "loss/non_finite"),
    ("FloatingPointError: Loss became infinite or NaN at iteration=2137!", "loss/non_finite"),
    ("{'loss': 0.0, 'grad_norm': nan, 'learning_rate': 9.773696745450087e-06, 'epoch': 0.53}",
     "gradient/nan-source"),
    ("AssertionError: Rank 3: found NaN in local grad norm in backwards pass. Device: 3",
     "gradient/nan-source"),
    ("Current loss scale already at minimum - cannot decrease scale anymore. Exiting run.",
     "memory/amp-overflow"),
    ("Gradient overflow. Skipping step, loss scaler 0 reducing loss scale to 8.165126103939127e-202",
     "memory/amp-overflow"),
    # num-fairseq-min-scale-1: fairseq's "Minimum loss scale reached" message, split by the paste
    ("    ).format(self.args. scale reached (0.0001). Your loss is probably exploding. Try lowering the "
     "learning rate, using gradient clipping or increasing the batch size.min_loss_scale))",
     "memory/amp-overflow"),
    ("FloatingPointError: Minimum loss.", "memory/amp-overflow"),
])
def test_numeric_text_is_its_kind(line: str, kind: str) -> None:
    found = classify_text(line)
    assert found is not None and found.kind == kind, found


@pytest.mark.parametrize("line", [
    "| epoch 001 | loss 6.343 | nll_loss 4.984 | ppl 31.65 | gnorm 0.390 | loss_scale 128.000",
    "number of skipped iterations:   0 | number of nan iterations:   0 | lm loss: 2.301",
    "WARNING:tensorboardX.x2num:NaN or Inf found in input tensor.",
    "finance and banking loss ratios",
])
def test_healthy_progress_lines_are_not_numeric_failures(line: str) -> None:
    found = classify_text(line)
    assert found is None or (found.category not in ("loss", "gradient") and \
        (found.kind != "memory/amp-overflow" or found.facts.get("scale", 0) > 1))


def test_megatron_names_the_rank_and_the_scale_is_parsed() -> None:
    found = classify_text("AssertionError: Rank 3: found NaN in local grad norm in backwards pass.")
    assert found is not None and found.facts["rank"] == 3
    scale = classify_text("[deepspeed] OVERFLOW! Rank 0 Skipping step. Attempted loss scale: 2, reducing to 1")
    assert scale is not None and scale.facts["scale"] == 1.0 and scale.facts["rank"] == 0


def test_text_opens_a_numeric_kind_only_for_a_run_without_metrics_or_heartbeats() -> None:
    settings = DetectionSettings()
    nan = classify_text("Loss is nan, stopping training")
    low = classify_text("| WARNING: overflow detected, setting loss scale to: 0.25")
    high = classify_text("| WARNING: overflow detected, setting loss scale to: 64.0")
    assert nan is not None and low is not None and high is not None
    run = RunState(project="p", run_id="r")
    run.ranks[0] = RankState(rank=0)
    assert _numeric_text_wanted(run, nan, settings) and _numeric_text_wanted(run, low, settings)
    assert not _numeric_text_wanted(run, high, settings)  # a scaler calibrating, not a collapse
    assert _numeric_text_wanted(run, high, DetectionSettings(amp_text_max_scale=128.0))
    run.ranks[0].last_hb_ns = 1  # an instrumented job: its metrics are the loss detector's
    assert not _numeric_text_wanted(run, nan, settings)


def test_a_nan_in_a_progress_table_row_is_the_loss_going_non_finite() -> None:
    # rows of real tables (tuned wild logs): yanmtt's 'step loss' print, DeepXDE's bracketed columns, YOLO's
    # epoch row under its 'Epoch gpu_mem box obj cls total' header -- no 'loss' word on the line itself
    wild = Path(__file__).resolve().parents[1] / "fixtures" / "wild"
    for case, needle, step in (("num-loss-nan-step-column-yanmtt-1", "76980 nan", 76980),
                               ("num-loss-nan-deepxde-table-1", "2000 ", 2000),
                               ("num-yolo-loss-nan-2", "41/299", 41)):
        line = next(x for x in (wild / case / "log.txt").read_text(encoding="utf-8").splitlines() if needle in x)
        found = classify_text(line)
        assert found is not None and found.kind == "loss/non_finite", case
        assert found.facts["step"] == step, case
    for healthy in ("76970 2.6265104", "1000      [5.47e+03]    [6.44e+03]    [1.00e+00]",
                    "step 3: nan values skipped", "INFO 12 inference done"):
        assert classify_text(healthy) is None, healthy
