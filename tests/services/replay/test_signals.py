"""Signal recognition (:mod:`trainguard_server.replay.signals`): the synonym table, units, booleans,
``--map SRC=DST*FACTOR``, and what the summary says is missing."""

from __future__ import annotations

import math

import pytest

from trainguard_server.replay.signals import Recognizer, flatten, parse_map_rule, split_unit
from trainguard_server.replay.signals_table import SIGNALS


def _apply(fields: dict, rules: tuple = ()) -> dict:
    rec = Recognizer([parse_map_rule(r) for r in rules])
    from collections import Counter

    return rec.apply(flatten(fields, Counter()))[0]


def test_what_the_issue_tried_is_recognised() -> None:
    """Issue 19's run: a global norm under its short name, per-layer norms nested by parameter name, a clip
    flag as a JSON boolean, process memory in MiB, the AMP scale, LoRA and padding statistics."""
    got = _apply({"grad_norm": 1.5, "grad_norms": {"encoder.layer.0.weight": 0.2, "head.bias": 0.0},
                  "clipped": True, "rss_mib": 812.5, "loss_scale": 65536.0, "lora_A_grad_mean": 1e-4,
                  "lora_B_grad_mean": 0.0, "truncated_pct": 12.5, "pad_attended_frac": 0.25, "loss": 2.0})
    assert got == {"grad/global_norm": 1.5, "grad/layer/encoder.layer.0.weight": 0.2, "grad/layer/head.bias": 0.0,
                   "grad/clip_triggered": 1.0, "mem/rss": 812.5 * 2**20, "amp/scale": 65536.0,
                   "lora/grad_mean_A": 1e-4, "lora/grad_mean_B": 0.0, "seq/truncated_frac": 0.125,
                   "seq/pad_attended_frac": 0.25, "loss": 2.0}


@pytest.mark.parametrize("name,value,target,expected", [
    ("peak_memory_gib", 1.5, "mem/max_allocated", 1.5 * 2**30),
    ("memory_allocated_gb", 2.0, "mem/allocated", 2e9),
    ("mem_reserved_bytes", 4096.0, "mem/reserved", 4096.0),
    ("rssMB", 300.0, "mem/rss", 300e6),
    ("memory_allocated", 3_000_000_000.0, "mem/allocated", 3e9),      # by magnitude: bytes
    ("memory_allocated", 2048.0, "mem/allocated", 2048.0 * 2**20),    # MiB
    ("memory_allocated", 12.5, "mem/allocated", 12.5 * 2**30),        # GiB
    ("step_time_ms", 250.0, "time/step_s", 0.25),
    ("elapsed time per iteration (ms)", 412.0, "time/step_s", 0.412),
    ("train/step_time", 0.5, "time/step_s", 0.5),
    ("lr-AdamW", 3e-4, "opt/lr", 3e-4),
    ("train_loss_step", 1.0, "loss", 1.0),
    ("lm loss", 3.0, "loss", 3.0),
    ("grad_2.0_norm_total", 1.0, "grad/global_norm", 1.0),
    ("mem/allocated", 512.0, "mem/allocated", 512.0),                 # TrainGuard's own name: as is
])
def test_units_and_synonyms(name: str, value: float, target: str, expected: float) -> None:
    assert _apply({name: value}) == {target: pytest.approx(expected)}


def test_flags_non_finite_and_unit_classes() -> None:
    assert _apply({"overflow": 3.0, "found_inf": False}) == {"amp/overflow": 0.0}  # first wins the target
    assert _apply({"overflow": 3.0}) == {"amp/overflow": 1.0}
    assert math.isnan(_apply({"loss": "nan"})["loss"])
    assert _apply({"loss_s": 1.0}) == {"loss_s": 1.0}          # "_s" is no unit of a loss: kept as is
    assert split_unit("grad_norm") is None


def test_map_with_factor_and_prefix_and_drop() -> None:
    got = _apply({"gpu_mb": 100.0, "my/ln.0": 0.3, "epoch": 1.0, "noise": 1.0},
                 ("gpu_mb=mem/allocated*1048576", "my/*=grad/layer/*", "noise="))
    assert got == {"mem/allocated": 100.0 * 2**20, "grad/layer/ln.0": 0.3}
    with pytest.raises(ValueError, match="factor"):
        parse_map_rule("a=b*lots")


def test_summary_says_what_is_missing_ignored_and_kept() -> None:
    rec = Recognizer()
    rec.apply({"train/loss": 1.0, "epoch": 0.5, "custom": 2.0})
    lines = rec.report.lines()
    assert "loss <- 'train/loss'" in lines
    assert "no grad/layer/*: gradient/vanishing and per-layer gradient/explosion not judged" in lines
    assert "ignored 'epoch': bookkeeping (epoch counter) (1 values)" in lines
    assert lines[-1] == "kept under their own names (no detector reads them): custom"


def test_table_targets_are_the_sdk_names() -> None:
    """Every target is a metric the SDK emits or the engine reads, and no synonym means two."""
    import re
    from pathlib import Path

    import trainguard
    import trainguard_engine

    roots = [Path(trainguard.__file__).parent, Path(trainguard_engine.__file__).parent]
    text = "\n".join(p.read_text() for root in roots for p in root.rglob("*.py"))
    for sig in SIGNALS:
        if sig.target != "loss":
            assert f'"{sig.target}' in text, sig.target
    seen: dict = {}
    for sig in SIGNALS:
        for name in sig.names:
            assert seen.setdefault(name, sig.target) == sig.target, name
    assert re.match(r"^[a-z]", SIGNALS[0].target)


def test_the_doc_lists_every_synonym_and_format() -> None:
    from pathlib import Path

    from trainguard_server.replay.sources.registry import FORMATS

    doc = (Path(__file__).resolve().parents[3] / "docs" / "replay-formats.md").read_text(encoding="utf-8")
    for sig in SIGNALS:
        assert f"`{sig.target}" in doc
        for name in sig.names + sig.prefixes:
            assert f"`{name}" in doc, name
    for name in FORMATS:
        assert f"| `{name}` |" in doc


def test_namespaces_are_looked_through_except_evaluation_ones() -> None:
    assert _apply({"perf/step_time_ms": 20.0, "system/rss_mib": 1.0}) == {
        "time/step_s": pytest.approx(0.02), "mem/rss": 2.0 ** 20}
    assert _apply({"val/loss": 1.0, "eval/grad_norm": 2.0}) == {"val/loss": 1.0, "eval/grad_norm": 2.0}
