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


WILD = Path(__file__).resolve().parents[1] / "fixtures" / "wild"


def _wild_line(case: str, needle: str) -> str:
    return next(x for x in (WILD / case / "log.txt").read_text(encoding="utf-8").splitlines() if needle in x)


def test_a_nan_loss_on_the_line_of_a_nan_grad_norm_is_the_loss() -> None:
    # num-mmdet3d-fp16-loss-heatmap-nan-bevdet-1 (tuned): 'loss_heatmap: nan, loss: nan, grad_norm: nan' --
    # a NaN loss makes every gradient NaN; a finite loss beside a NaN grad norm stays the gradient's
    found = classify_text(_wild_line("num-mmdet3d-fp16-loss-heatmap-nan-bevdet-1", "Epoch [1][50/"))
    assert found is not None and found.kind == "loss/non_finite", found
    assert found.facts["metric"] == "task0.loss_heatmap"
    hf = classify_text(_wild_line("num-hf-gradnorm-nan-loss-spike-gemma-1", "153318.95"))
    assert hf is not None and hf.kind == "gradient/nan-source", hf


def test_a_training_loops_own_nan_guards_are_the_loss() -> None:
    # num-megatron-forward-loss-nan-rank114-qwen-next-1, num-network-outputs-nan-jointnlt-1 (tuned)
    megatron = classify_text(_wild_line("num-megatron-forward-loss-nan-rank114-qwen-next-1", "AssertionError"))
    assert megatron is not None and megatron.kind == "loss/non_finite", megatron
    assert megatron.facts["rank"] == 114 and megatron.facts["metric"] == "local forward loss"
    outputs = classify_text((WILD / "num-network-outputs-nan-jointnlt-1" / "log.txt").read_text(encoding="utf-8"))
    assert outputs is not None and outputs.kind == "loss/non_finite", outputs
    for healthy in ("outputs are cached in ./nan_outputs", "the model outputs is a tuple"):
        assert classify_text(healthy) is None, healthy


def test_anomaly_modes_warning_alone_is_the_backward_nan() -> None:
    # num-anomaly-nan-3 (tuned): the paste ends inside the forward trace, before the RuntimeError
    text = (WILD / "num-anomaly-nan-3" / "log.txt").read_text(encoding="utf-8")
    found = classify_text(text)
    assert found is not None and found.kind == "gradient/nan-source", found
    assert found.facts["function"] == "DivBackward0"
    # with the error it announces in the text, the error decides (an in-place modification prints the same
    # warning)
    inplace = text + ("RuntimeError: one of the variables needed for gradient computation has been modified "
                      "by an inplace operation\n")
    decided = classify_text(inplace)
    assert decided is None or decided.kind != "gradient/nan-source", decided


def test_more_overflow_wordings_give_the_scale() -> None:
    # num-ds-fused-grad-overflow-iteration-2069-1 (DeepSpeed's fused optimizer) and
    # num-fairseq-gradient-overflow-ignoring-4755-1 (fairseq 0.12), tuned
    for case, needle, scale in (
            ("num-ds-fused-grad-overflow-iteration-2069-1", "Overflow detected. Skipping step", 134217728.0),
            ("num-ds-fused-grad-overflow-iteration-2069-1", "Reducing dynamic loss scale from 134217728.0",
             67108864.0),
            ("num-fairseq-gradient-overflow-ignoring-4755-1", "ignoring gradient", 4.0)):
        found = classify_text(_wild_line(case, needle))
        assert found is not None and found.kind == "memory/amp-overflow", (case, found)
        assert found.facts["scale"] == scale, (case, found.facts)


def test_a_printed_loss_scale_of_one_is_no_overflow() -> None:
    # num-megatron-ds-no-lm-loss-pr434-1 (tuned): Megatron prints 'loss scale: 1.0' on every iteration of a
    # bf16 run; a collapse to 1 is still read from an overflow line
    line = _wild_line("num-megatron-ds-no-lm-loss-pr434-1", "iteration")
    assert classify_text(line) is None
    collapse = classify_text("[deepspeed] OVERFLOW! Rank 0 Skipping step. Attempted loss scale: 2, reducing to 1")
    assert collapse is not None and collapse.facts["scale"] == 1.0


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


def test_a_deepspeed_overflow_line_wrapped_before_its_scale_is_a_skipped_step() -> None:
    # learnds: a terminal's wrap splits 'Attempted loss scal                e: 8192': no scale left to read
    text = (Path(__file__).resolve().parents[1] / "fixtures" / "wild" /
            "num-ds-overflow-hysteresis-wrapped-learnds-1" / "log.txt").read_text(encoding="utf-8")
    first = text.splitlines()[0]
    found = classify_text(first)
    assert found is not None and found.kind == "memory/amp-overflow" and found.facts == {"overflow": True}
