"""Sequence detectors: truncation without a consistent attention mask, EOS cut off (DESIGN §4
sequence/truncation), from the ``seq/*`` metrics of ``trainguard.check_batch`` (see
:mod:`trainguard.integrations.sequence`: each a share of a checked batch's rows).

Pure and streaming. Per-rank state lives in ``RankState.detectors["seq"]`` (plain JSON): the last
``seq_window_checks`` checks (step, event time, the five shares), the rules already reported, and the last
step's event ids (replays of a check are recognised and ignored; several checks at one step -- gradient
accumulation -- all count). Thresholds are read with ``getattr(settings, name, DEFAULT)``; the defaults are
the module constants below. A rule *holds on a check* as listed; it *fires* when it holds on at least
``seq_confirm_checks`` of the last ``seq_window_checks`` checks (one odd batch is not a defect of the data
preparation; a collation bug shows on nearly every batch):

* ``sequence.truncation.pad_attended`` -- ``seq/pad_attended_frac`` > ``seq_pad_attended_max`` (0: any
  row attending a pad token; a correct mask never does).
* ``sequence.truncation.mask_mismatch`` -- ``seq/mask_mismatch_frac`` > ``seq_mask_mismatch_max`` (0):
  the mask disagrees with where the padding is (built for the other padding side, or before truncation).
* ``sequence.truncation.labels_on_pad`` -- ``seq/labels_on_pad_frac`` > ``seq_labels_on_pad_max`` (0):
  the loss is computed on padding (labels built from a wrong mask): the loss is offset from a correct run.
* ``sequence.truncation.eos_cut`` -- EOS cut off: ``seq/truncated_frac`` (rows reaching max_length without
  ending in EOS) > 0 on the check, **and** over the window its mean >= ``seq_eos_cut_min_frac`` (0.05: a
  systematic cut, not the odd overlong sample) **and** the rows that were not cut do end in EOS: (rows
  ending in EOS) / (rows not cut), summed over the window, >= ``seq_eos_kept_min_frac`` (0.9). The last
  condition tells "truncation removed the EOS the data has" from data that never appends one (packed
  pretraining chunks, where every row is at the cap and none ends in EOS).

The finding opens on the first rule that fires (``first_step`` = the earliest check of the window on which
a firing rule held: where it began, as far as the window remembers) and is refreshed (no new count) when
another rule fires later. Evidence per rule: threshold, value (the share on the confirming check, or the
window mean for eos_cut), the window of shares. Title placeholder ``{detail}``: what was found, e.g.
"padding attended (94% of sequences), mask/padding mismatch (94%), EOS cut off (10%)" (median shares of
the checks on which each rule held; for EOS, the window's mean).
"""

from __future__ import annotations

import math
import statistics
from typing import AbstractSet, Any, Dict, Final, List, Sequence, Tuple

from ..catalogue import DetectionSettings
from ..incidents import Finding
from ..records import Evidence, TimelineEntry
from ..state import RankState, RunState
from .base import Detector, MetricBatch

STATE_KEY: Final = "seq"
"""``RankState.detectors`` key of this family's per-rank state."""
KEY = "sequence:truncation"

PAD_ATTENDED = "seq/pad_attended_frac"
MASK_MISMATCH = "seq/mask_mismatch_frac"
TRUNCATED = "seq/truncated_frac"
EOS_MISSING = "seq/eos_missing_frac"
LABELS_ON_PAD = "seq/labels_on_pad_frac"
FIELDS = (PAD_ATTENDED, MASK_MISMATCH, TRUNCATED, EOS_MISSING, LABELS_ON_PAD)
"""The metrics of one check, in the order a check is stored (after its step and time)."""

# --- defaults (overridable by DetectionSettings fields of the same names) -------------------------
SEQ_WINDOW_CHECKS = 10
"""Checks (check_batch calls that were not sampled out) a rule is judged over."""
SEQ_CONFIRM_CHECKS = 3
"""Checks within the window on which a rule must hold before it fires."""
SEQ_PAD_ATTENDED_MAX = 0.0
"""seq/pad_attended_frac above this on a check: padding attended."""
SEQ_MASK_MISMATCH_MAX = 0.0
"""seq/mask_mismatch_frac above this on a check: the mask disagrees with the padding."""
SEQ_LABELS_ON_PAD_MAX = 0.0
"""seq/labels_on_pad_frac above this on a check: loss computed on padding."""
SEQ_EOS_CUT_MIN_FRAC = 0.05
"""EOS cut off: the window's mean share of rows cut at max_length without EOS must reach this."""
SEQ_EOS_KEPT_MIN_FRAC = 0.9
"""EOS cut off: ... while at least this share of the rows that were not cut end in EOS (the data has
one: truncation removed it)."""
MAX_IDS = 8
"""Event ids of the last step remembered to recognise a replayed check."""

RULES = {
    "pad_attended": (PAD_ATTENDED, "seq_pad_attended_max", SEQ_PAD_ATTENDED_MAX),
    "mask_mismatch": (MASK_MISMATCH, "seq_mask_mismatch_max", SEQ_MASK_MISMATCH_MAX),
    "labels_on_pad": (LABELS_ON_PAD, "seq_labels_on_pad_max", SEQ_LABELS_ON_PAD_MAX),
}
_ORDER = ("pad_attended", "mask_mismatch", "labels_on_pad", "eos_cut")


def _cfg(settings: DetectionSettings, name: str, default: Any) -> Any:
    return getattr(settings, name, default)


def rank_state(rank: RankState) -> Dict[str, Any]:
    """The family's state of ``rank``: ``checks`` [[step, time_ns, *FIELDS]], ``last`` [step, [ids]],
    ``reported`` {rule: first step}."""
    state: Dict[str, Any] = rank.detectors.setdefault(STATE_KEY, {})
    return state


def on_metrics(run: RunState, rank: RankState, points: Sequence[Any], step: int, time_ns: int,
               event_id: str, settings: DetectionSettings) -> List[Finding]:
    """Findings for one metric batch of ``rank`` (``points``: (name, step, value) tuples)."""
    checks: Dict[int, Dict[str, float]] = {}
    for name, s, value in points:
        if name in FIELDS and isinstance(value, float) and math.isfinite(value):
            # fractions: a value outside [0, 1] is clamped (a huge one would overflow the window's mean)
            checks.setdefault(int(s), {})[name] = min(1.0, max(0.0, value))
    if not checks:
        return []
    state = rank_state(rank)
    added = False
    for s in sorted(checks):
        last = state.get("last")
        if last is not None:
            if s < last[0] or (s == last[0] and event_id and event_id in last[1]):
                continue  # replayed or late: never counts twice
            if s == last[0]:
                last[1] = [*last[1], event_id][-MAX_IDS:]
            else:
                state["last"] = [s, [event_id]]
        else:
            state["last"] = [s, [event_id]]
        values = checks[s]
        state.setdefault("checks", []).append(
            [s, time_ns, *[None if values.get(f) is None else round(values[f], 6) for f in FIELDS]])
        del state["checks"][:-max(1, int(_cfg(settings, "seq_window_checks", SEQ_WINDOW_CHECKS)))]
        added = True
    if not added:
        return []
    return _judge(rank, state, time_ns, event_id, settings)


def _column(checks: List[List[Any]], field: str) -> List[Tuple[int, int, float]]:
    """(step, time_ns, value) of ``field`` on the checks that reported it."""
    i = 2 + FIELDS.index(field)
    return [(c[0], c[1], float(c[i])) for c in checks if c[i] is not None]


def _fired(checks: List[List[Any]], settings: DetectionSettings) -> Dict[str, Dict[str, Any]]:
    """The rules that fire on the window: rule -> {first, first_ns, value, threshold, field, holds, ...}."""
    confirm = int(_cfg(settings, "seq_confirm_checks", SEQ_CONFIRM_CHECKS))
    out: Dict[str, Dict[str, Any]] = {}
    for rule, (field, setting, default) in RULES.items():
        limit = float(_cfg(settings, setting, default))
        holds = [(s, t, v) for s, t, v in _column(checks, field) if v > limit]
        if len(holds) >= confirm:
            out[rule] = {"first": holds[0][0], "first_ns": holds[0][1], "value": holds[-1][2],
                         "threshold": limit, "field": field, "holds": len(holds),
                         "median": statistics.median(v for _s, _t, v in holds)}
    cut = _column(checks, TRUNCATED)
    missing = {s: v for s, _t, v in _column(checks, EOS_MISSING)}
    paired = [(s, t, v, missing[s]) for s, t, v in cut if s in missing]  # needs eos_id: both reported
    if paired:
        holds = [(s, t, v) for s, t, v, _m in paired if v > 0]
        mean_cut = statistics.fmean(v for _s, _t, v, _m in paired)
        uncut = sum(1.0 - v for _s, _t, v, _m in paired)
        ending = sum(1.0 - m for _s, _t, _v, m in paired)
        kept = ending / uncut if uncut > 0 else math.nan
        min_frac = float(_cfg(settings, "seq_eos_cut_min_frac", SEQ_EOS_CUT_MIN_FRAC))
        kept_min = float(_cfg(settings, "seq_eos_kept_min_frac", SEQ_EOS_KEPT_MIN_FRAC))
        if len(holds) >= confirm and mean_cut >= min_frac and kept >= kept_min:
            out["eos_cut"] = {"first": holds[0][0], "first_ns": holds[0][1], "value": round(mean_cut, 6),
                              "threshold": min_frac, "field": TRUNCATED, "holds": len(holds),
                              "median": mean_cut, "kept": kept, "kept_min": kept_min}
    return out


def _judge(rank: RankState, state: Dict[str, Any], time_ns: int, event_id: str,
           settings: DetectionSettings) -> List[Finding]:
    checks: List[List[Any]] = state["checks"]
    fired = _fired(checks, settings)
    reported: Dict[str, int] = state.setdefault("reported", {})
    new = [rule for rule in fired if rule not in reported]
    if not new:
        return []
    update = bool(reported)
    for rule in new:
        reported[rule] = int(fired[rule]["first"])
    shown = {rule: fired[rule] for rule in _ORDER if rule in fired}
    first_rule = min(shown, key=lambda r: (shown[r]["first"], _ORDER.index(r)))
    first, first_ns = int(shown[first_rule]["first"]), int(shown[first_rule]["first_ns"]) or time_ns
    if update:  # the incident is open: keep its first step
        first = min([first, *reported.values()])
    evidence = [_evidence(rank, rule, info, checks, event_id, settings) for rule, info in shown.items()
                if rule in new or not update]
    detail = _detail(shown)
    step = int(checks[-1][0])
    return [Finding(
        "sequence", "truncation", KEY, rank.rank, first, first_ns, seen_ns=time_ns, seen_step=step,
        host=rank.host, event_id=event_id, evidence=evidence,
        timeline=[TimelineEntry(time_ns=time_ns, step=step, rank=rank.rank,
                                what=f"rank {rank.rank}: {detail} (check_batch)")],
        values={"detail": detail, "step": first, "rank": rank.rank},
        counts=not update, update_values=update, summary=_summary(rank, shown))]


def _pct(value: float) -> str:
    return f"{value:.0%}" if value >= 0.01 or value == 0 else f"{value:.1%}"


def _detail(shown: Dict[str, Dict[str, Any]]) -> str:
    """"padding attended (94% of sequences), mask/padding mismatch (94%), EOS cut off (10%)"."""
    words = {"pad_attended": "padding attended", "mask_mismatch": "mask/padding mismatch",
             "labels_on_pad": "loss on padding", "eos_cut": "EOS cut off"}
    parts = [f"{words[rule]} ({_pct(float(info['median']))})" for rule, info in shown.items()]
    if parts:
        parts[0] = parts[0][:-1] + " of sequences)"
    return ", ".join(parts)


def _evidence(rank: RankState, rule: str, info: Dict[str, Any], checks: List[List[Any]], event_id: str,
              settings: DetectionSettings) -> Evidence:
    field = str(info["field"])
    window = [{"step": s, "value": v} for s, _t, v in _column(checks, field)]
    window = window[-int(_cfg(settings, "evidence_window", 20)):]
    n = len(_column(checks, field))
    confirm = int(_cfg(settings, "seq_confirm_checks", SEQ_CONFIRM_CHECKS))
    if rule == "eos_cut":
        description = (f"{_pct(float(info['value']))} of the sequences (mean over the last {n} checks; "
                       f"threshold {info['threshold']:g}) reach max_length without ending in EOS, on "
                       f"{info['holds']} checks since step {info['first']}, while "
                       f"{_pct(float(info['kept']))} of the sequences that were not cut end in EOS "
                       f"(>= {info['kept_min']:g}): "
                       "truncation removes the EOS the data has")
    else:
        what = {"pad_attended": "rows attending at least one pad token (mask != 0 on padding)",
                "mask_mismatch": "rows whose attention mask disagrees with where the padding is",
                "labels_on_pad": "rows with labels (not ignore_index) on pad tokens"}[rule]
        description = (f"{field} > {info['threshold']:g} ({what}) on {info['holds']} of the last {n} checks "
                       f"(>= {confirm} needed), first at step {info['first']}; median share "
                       f"{_pct(float(info['median']))}, last {_pct(float(info['value']))}")
    return Evidence(rule=f"sequence.truncation.{rule}", description=description, step=int(info["first"]),
                    time_ns=int(info["first_ns"]), rank=rank.rank, metric=field,
                    threshold=float(info["threshold"]), value=float(info["value"]), window=window,
                    event_id=event_id)


def _summary(rank: RankState, shown: Dict[str, Dict[str, Any]]) -> str:
    parts: List[str] = []
    if "pad_attended" in shown or "mask_mismatch" in shown:
        share = max(float(shown[r]["median"]) for r in ("pad_attended", "mask_mismatch") if r in shown)
        parts.append(f"the attention mask disagrees with the padding in {_pct(share)} of the sequences "
                     "(pad tokens attended, or content masked): a mask built for the other padding side, or "
                     "before truncation")
    if "labels_on_pad" in shown:
        parts.append(f"the loss is computed on padding in {_pct(float(shown['labels_on_pad']['median']))} "
                     "of them (labels follow the wrong mask)")
    if "eos_cut" in shown:
        parts.append(f"{_pct(float(shown['eos_cut']['median']))} of the sequences are cut at max_length "
                     "without EOS while the others end in EOS (the model never learns to stop on them)")
    what = "; ".join(parts)
    return (f"On rank {rank.rank}, {what}. Rebuild the mask from the ids after truncation and padding "
            "(tokenizer(..., truncation=True, padding=..., return_attention_mask=True) with the padding side "
            "the model expects), set labels to -100 on padding, and truncate before appending EOS.")


class Sequences(Detector):
    """``check_batch()`` reports: padding and truncation bugs (:func:`on_metrics`)."""

    name = "sequence"
    kinds: Tuple[str, ...] = ("sequence/truncation",)
    section = "sequence"
    names_only = True

    def wants(self, rank: RankState, names: AbstractSet[str], settings: DetectionSettings) -> bool:
        return not names.isdisjoint(FIELDS)

    def on_metrics(self, run: RunState, rank: RankState, batch: MetricBatch,
                   settings: DetectionSettings) -> List[Finding]:
        return on_metrics(run, rank, batch.points, batch.step, batch.time_ns, batch.event_id, settings)
