"""The catalogue as data, the exit-code decision path, the error-text rules and DetectionSettings."""

from __future__ import annotations

import dataclasses
import importlib
from pathlib import Path
from typing import Any, Optional, Tuple

import pytest

from trainguard_engine.catalogue import (
    EXIT_RULES,
    KINDS,
    LAYERS,
    SEVERITIES,
    DetectionSettings,
    classify_exception,
    classify_exit,
    kind,
    settings_table,
)

TRACEBACKS = Path(__file__).resolve().parents[1] / "fixtures" / "tracebacks"

DESIGN_ROWS = (
    "loss/oscillation", "loss/rise-after-fall", "loss/plateau", "gradient/explosion", "gradient/vanishing",
    "gradient/clip-stale", "gradient/nan-source", "memory/oom", "memory/fragmentation", "memory/leak",
    "memory/amp-overflow", "memory/context-leak", "comm/init-failure", "comm/timeout", "comm/mismatch",
    "comm/rank-lost", "sequence/truncation", "adapter/lora-grad-break",
)


def test_every_design_row_is_in_the_catalogue_and_every_kind_is_detected() -> None:
    assert set(DESIGN_ROWS) <= set(KINDS)
    assert [name for name, k in KINDS.items() if not k.detected] == []


@pytest.mark.parametrize("module", ["memory", "sequence", "adapter"])
def test_detector_module_defaults_are_the_settings_defaults(module: str) -> None:
    """Detector modules keep their defaults as constants named after the setting (``leak_window`` ->
    ``LEAK_WINDOW``) for documentation; they must not drift from DetectionSettings, which is what runs."""
    mod = importlib.import_module(f"trainguard_engine.detectors.{module}")
    defaults = DetectionSettings()
    compared = 0
    for f in dataclasses.fields(DetectionSettings):
        constant = getattr(mod, f.name.upper(), None)
        if constant is not None and isinstance(constant, (int, float)):
            assert getattr(defaults, f.name) == constant, f.name
            compared += 1
    assert compared >= 5


@pytest.mark.parametrize("name", sorted(KINDS))
def test_kinds_are_complete_and_checks_go_hardware_framework_model(name: str) -> None:
    spec = KINDS[name]
    assert spec.name == name and spec.severity in SEVERITIES
    assert spec.title and spec.description and spec.signals and spec.causes and spec.checks
    layers = [LAYERS.index(c.layer) for c in spec.checks]
    assert layers == sorted(layers)
    assert all(line.split(": ", 1)[0] in LAYERS for line in spec.checklist())
    assert "{" not in spec.render_title({}).replace("{}", "")  # every placeholder renders


def test_title_placeholders_render_and_missing_ones_show_a_question_mark() -> None:
    assert kind("loss", "non_finite").render_title({"value": "NaN", "step": 12}) == "Loss became NaN at step 12"
    assert kind("loss", "non_finite").render_title({}) == "Loss became ? at step ?"
    with pytest.raises(KeyError, match="unknown incident kind nope/x"):
        kind("nope", "x")


def test_killed_says_oom_killer_and_preemption() -> None:
    spec = kind("process", "killed")
    text = " ".join([spec.title, spec.description, *spec.causes])
    assert "OOM-killer" in text and "preemption" in text.lower()


@pytest.mark.parametrize(("code", "signal", "expected"), [
    (0, 0, None),
    (1, 0, ("process", "exception")),
    (134, 0, ("memory", "oom-or-cuda-error")),
    (134, 6, ("memory", "oom-or-cuda-error")),
    (135, 7, ("memory", "oom-or-cuda-error")),
    (-6, 0, ("memory", "oom-or-cuda-error")),
    (255, 0, ("comm", "failure")),
    (137, 9, ("process", "killed")),
    (137, 0, ("process", "killed")),
    (-9, 0, ("process", "killed")),
    (143, 15, ("process", "terminated")),
    (-15, 0, ("process", "terminated")),
    (130, 2, ("process", "terminated")),
    (129, 1, ("process", "terminated")),  # SIGHUP: a closed terminal / ssh session, a stop from outside
    (-1, 0, ("process", "terminated")),
    (129, 0, ("process", "terminated")),
    (139, 11, ("process", "exit")),
    (2, 0, ("process", "exit")),
])
def test_exit_decision_path(code: int, signal: int, expected: Optional[Tuple[str, str]]) -> None:
    verdict = classify_exit(code, signal)
    if expected is None:
        assert verdict is None
        return
    assert verdict is not None and (verdict.category, verdict.subtype) == expected
    assert verdict.exit_code == (code if code >= 0 else 128 - code)
    assert verdict.refine == (expected in (("process", "exception"), ("memory", "oom-or-cuda-error")))


def test_exit_descriptions_name_the_signal() -> None:
    verdict = classify_exit(139, 11)
    assert verdict is not None and verdict.describe() == "exit code 139, SIGSEGV"
    assert "SIGSEGV" in verdict.meaning
    killed = classify_exit(-9)
    assert killed is not None and killed.describe() == "exit code 137, SIGKILL"


def test_every_exit_rule_names_a_catalogue_kind() -> None:
    for rule in EXIT_RULES:
        assert kind(rule.category, rule.subtype).detected


def _last_line(name: str) -> Tuple[str, str]:
    line = (TRACEBACKS / name).read_text(encoding="utf-8").rstrip().splitlines()[-1]
    exc_type, message = line.split(": ", 1)
    return exc_type, message


@pytest.mark.parametrize("name", ["gpu_cuda_oom_a.txt", "synthetic_from_source_cuda_oom_legacy.txt"])
def test_real_cuda_oom_texts_are_memory_oom(name: str) -> None:
    exc_type, message = _last_line(name)
    assert classify_exception(exc_type, message) == ("memory", "oom")
    assert classify_exception("RuntimeError" if exc_type != "RuntimeError" else exc_type, message) == \
        ("memory", "oom")


def test_other_exceptions_are_process_exception() -> None:
    assert classify_exception("torch.OutOfMemoryError", "") == ("memory", "oom")
    exc_type, message = _last_line("shape_mismatch_linear.txt")
    assert classify_exception(exc_type, message) == ("process", "exception")
    assert classify_exception("MemoryError", "out of memory") == ("process", "exception")  # host, not CUDA


# ------------------------------------------------------------------------------------------------------
# DetectionSettings


def test_defaults_and_documentation() -> None:
    settings = DetectionSettings()
    assert (settings.stall_factor, settings.stall_min_s, settings.stall_max_s) == (2.0, 120.0, 600.0)
    names = [f.name for f in dataclasses.fields(DetectionSettings)]
    docs = DetectionSettings.documentation()
    assert [n for n, _d, _doc in docs] == names and all(doc for _n, _d, doc in docs)
    assert [row["name"] for row in settings_table()] == names
    assert settings.overrides() == {}
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.stall_min_s = 1.0  # type: ignore[misc]


@pytest.mark.parametrize(("step_time", "threshold"), [
    (0.0, 600.0),      # unknown: the DESIGN's 10 minutes
    (0.5, 120.0),      # fast steps: the floor
    (100.0, 200.0),    # 2x the step time
    (1000.0, 600.0),   # the ceiling
])
def test_stall_threshold_is_clamped_twice_the_step_time(step_time: float, threshold: float) -> None:
    assert DetectionSettings().stall_threshold_s(step_time) == threshold


def test_overrides_are_applied_and_coerced() -> None:
    settings = DetectionSettings.from_overrides(
        {"stall_min_s": 2, "loss_metrics": ["loss", "val/loss"], "history_len": 16.0,
         "incident_on_handled_exceptions": True})
    assert settings.stall_min_s == 2.0 and isinstance(settings.stall_min_s, float)
    assert settings.loss_metrics == ("loss", "val/loss") and settings.history_len == 16
    assert settings.overrides() == {"stall_min_s": 2.0, "loss_metrics": ("loss", "val/loss"),
                                    "history_len": 16, "incident_on_handled_exceptions": True}
    layered = DetectionSettings.from_overrides({"lost_after_s": 30}, base=settings)
    assert layered.stall_min_s == 2.0 and layered.lost_after_s == 30.0
    assert DetectionSettings.from_overrides(settings.to_dict()) == settings


@pytest.mark.parametrize(("overrides", "message"), [
    ({"stal_min_s": 1.0}, "unknown detection setting 'stal_min_s'; did you mean 'stall_min_s'?"),
    ({"zzz": 1}, "unknown detection setting 'zzz'$"),
    ({"stall_min_s": "2s"}, "stall_min_s must be a number, got '2s'"),
    ({"stall_min_s": True}, "stall_min_s must be a number, got True"),
    ({"stall_min_s": float("nan")}, "stall_min_s must be finite"),
    ({"history_len": 2.5}, "history_len must be an integer, got 2.5"),
    ({"history_len": True}, "history_len must be an integer, got True"),
    ({"incident_on_handled_exceptions": 1}, "incident_on_handled_exceptions must be true or false, got 1"),
    ({"loss_metrics": "loss"}, "loss_metrics must be a list of non-empty strings"),
    ({"loss_metrics": ["loss", 3]}, "loss_metrics must be a list of non-empty strings"),
    ({"stall_min_s": -1}, "stall_min_s must be >= 0.0, got -1.0"),
    ({"history_len": 1}, "history_len must be >= 4, got 1"),
    ({"stall_min_s": 700}, r"stall_min_s \(700.0\) must be <= stall_max_s \(600.0\)"),
])
def test_bad_overrides_are_refused_with_the_setting_named(overrides: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        DetectionSettings.from_overrides(overrides)


def test_overrides_must_be_a_mapping() -> None:
    with pytest.raises(ValueError, match="must be a mapping, got list"):
        DetectionSettings.from_overrides([("stall_min_s", 1)])  # type: ignore[arg-type]


def test_history_patterns() -> None:
    settings = DetectionSettings()
    assert settings.keeps_history("loss") and settings.keeps_history("grad/global_norm")
    assert settings.keeps_history("amp/scale") and settings.keeps_history("lr")
    assert not settings.keeps_history("grad/layer/0") and not settings.keeps_history("lr2")
