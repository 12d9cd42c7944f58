"""The diagnosis' cheaper paths (issue 15) give exactly what the plain computation gives: the ranked
hypotheses remembered per kind and per rules that held, the series' min / max without a list, and the LR
change log's inline "nothing to record" test."""

from __future__ import annotations

import itertools
import math
from typing import Any, Dict, List

import pytest

from trainguard_engine import diagnosis
from trainguard_engine.catalogue import kind
from trainguard_engine.diagnosis import PRIORS, RULES, Facts
from trainguard_engine.state import RankState


def reference_hypotheses(category: str, subtype: str, facts: Facts, most: int = 5) -> List[Dict[str, Any]]:
    """The ranking as computed before it was remembered: every rule of RULES walked for every call."""
    spec = kind(category, subtype)
    weights: Dict[str, float] = {}
    why: Dict[str, List[str]] = {}
    for i, cause in enumerate(spec.causes):
        weights[cause] = PRIORS[min(i, len(PRIORS) - 1)]
        why[cause] = []
    for rule_kind, cause_id, predicate, factor, reason in diagnosis.RULES:
        if rule_kind != spec.name or not predicate(facts):
            continue
        cause = spec.cause_text(cause_id)
        if cause not in weights:
            weights[cause] = 1.0
            why[cause] = []
        weights[cause] *= factor
        why[cause].append(reason(facts))
    total = sum(weights.values()) or 1.0
    ranked = sorted(weights.items(), key=lambda kv: (-kv[1], list(weights).index(kv[0])))
    return [{"cause": cause, "confidence": round(w / total, 2),
             "why": why[cause] or ["prior: how often this is the cause of this kind"]}
            for cause, w in ranked[:most]]


def fact_grid() -> List[Facts]:
    """Facts that make every rule of RULES hold and fail, with reasons that differ in their numbers."""
    out = []
    for phase, growth, clip, amp, jump, lr, diverged in itertools.product(
            ("", "rising", "constant", "decaying", "zero"), (0.0, 30.0, math.inf), (None, 0.1, 0.6),
            (False, True), (0.0, 80.0), (None, 0.5), (None, 12)):
        out.append(Facts(lr_phase=phase, lr_growth=growth, clip_rate=clip, has_amp=amp, grad_jump=jump,
                         lr=lr, diverged_at=diverged))
    for facts in ({"reserved_unallocated": 10, "requested": 5}, {"requested": 90, "capacity": 100},
                  {"other_processes": [1]}, {"lagging_ranks": [3]}):
        out.append(Facts(facts=facts))
    out += [Facts(rules=("correlation.lagging_rank",)), Facts(silent_rank=True), Facts(world_size=8)]
    return out


KINDS = sorted({rule[0] for rule in RULES} | {"loss/plateau", "memory/leak"})


@pytest.mark.parametrize("name", KINDS)
def test_remembered_hypotheses_equal_the_plain_ranking(name: str) -> None:
    category, _, subtype = name.partition("/")
    for i, facts in enumerate(fact_grid()):
        most = 2 if i % 7 == 0 else 5
        want = reference_hypotheses(category, subtype, facts, most)
        assert diagnosis.hypotheses(category, subtype, facts, most) == want
        assert diagnosis.hypotheses(category, subtype, facts, most) == want  # remembered: the same


def test_every_call_returns_fresh_dicts_and_lists() -> None:
    facts = Facts(lr_phase="rising", lr_growth=40.0)
    first = diagnosis.hypotheses("gradient", "explosion", facts)
    first[0]["why"].append("changed by a caller")
    first[0]["confidence"] = 9.0
    first.append({"cause": "x"})
    assert diagnosis.hypotheses("gradient", "explosion", facts) == \
        reference_hypotheses("gradient", "explosion", facts)


def test_a_replaced_rule_table_is_read_again(monkeypatch: pytest.MonkeyPatch) -> None:
    facts = Facts(lr_phase="zero")
    before = diagnosis.hypotheses("loss", "plateau", facts)
    cause_ids = kind("loss", "plateau").cause_ids
    swapped = (*(rule for rule in RULES if rule[0] != "loss/plateau"),
               ("loss/plateau", cause_ids[-1], lambda f: f.lr_phase == "zero", 50.0, lambda f: "swapped"))
    monkeypatch.setattr(diagnosis, "RULES", swapped)
    after = diagnosis.hypotheses("loss", "plateau", facts)
    assert after != before and after[0]["why"] == ["swapped"]
    assert after == reference_hypotheses("loss", "plateau", facts)


def test_least_and_most_are_min_and_max_of_the_finite_values() -> None:
    series = [(1, 0.0, 0), (2, -0.0, 0), (3, math.nan, 0), (4, math.inf, 0), (5, -0.0, 0), (6, 0.0, 0)]
    for finite, values in ((False, series), (True, [p for p in series if p[1] - p[1] == 0.0])):
        plain = diagnosis._finite_values(values, finite)
        low, high = diagnosis._least(values, finite), diagnosis._most(values, finite)
        assert (low, math.copysign(1, low or 0.0)) == (min(plain), math.copysign(1, min(plain)))  # 0.0 first
        assert (high, math.copysign(1, high or 0.0)) == (max(plain), math.copysign(1, max(plain)))
    assert diagnosis._least([(1, math.nan, 0)], False) is None
    assert diagnosis._most([], True) is None


def test_the_lr_log_records_what_it_recorded_before() -> None:
    lrs = [0.1, 0.1, 0.104, 0.2, 0.2, 0.0, 0.0, 1e-9, 1e-9, 0.3, math.nan, 0.3, 0.5, 0.56, 0.55]
    fast, plain = RankState(rank=0), RankState(rank=0)
    for step, lr in enumerate(lrs):
        diagnosis.observe(fast, [("opt/lr", step, lr), ("mem/allocated", step, 5.0)])
        if lr - lr == 0.0:
            diagnosis._log_lr(plain, step, lr)
    diagnosis.observe(fast, [("lr", 3, 9.0)])  # an older step: nothing
    assert fast.detectors["diag"]["lr"] == plain.detectors["diag"]["lr"]
    assert [s for s, _v in fast.detectors["diag"]["lr"]] == [0, 3, 5, 7, 9, 12, 13]
