"""gate.profile + gate.compare on synthetic runs: each check's pass/warn/fail/undecided edges, the verdict's
aggregation and the preconditions. (The real trainings are in test_gate_e2e.py.)"""

from __future__ import annotations

import json
import math
import random
from typing import Callable, Dict, List, Optional

import pytest

from trainguard_server.gate.compare import evaluate
from trainguard_server.gate.policy import Policy, policy_from_dict
from trainguard_server.gate.profile import IncidentBrief, Profile, RunData, build_profile

STEPS = 200
MIB = float(2**20)


def curve(seed: int, level: float = 1.0, noise: float = 0.25,
          change: Optional[Callable[[int, float], float]] = None) -> List[tuple[float, float]]:
    """A decaying loss with a per-seed offset (what seeds do) and multiplicative per-step noise."""
    rng = random.Random(seed)
    offset = rng.gauss(0.0, 0.15)
    points = []
    for step in range(STEPS):
        value = level * 0.4 * math.exp(-step / 50.0 + offset) + 0.003
        value *= math.exp(rng.gauss(0.0, noise))
        points.append((float(step), change(step, value) if change else value))
    return points


def run(run_id: str, seed: int, *, status: str = "finished", memory: float = 300 * MIB,
        step_s: float = 0.001, loss: Optional[List[tuple[float, float]]] = None,
        incidents: Optional[List[IncidentBrief]] = None, fingerprints: Optional[Dict[str, str]] = None,
        last_step: int = STEPS - 1) -> RunData:
    rng = random.Random(seed + 1000)
    return RunData(run_id=run_id, status=status, last_step=last_step,
                   series={"loss": loss if loss is not None else curve(seed),
                           "time/step_s": [(float(s), step_s * (1 + 0.05 * rng.random())) for s in range(STEPS)],
                           "mem/rss": [(float(s), memory) for s in range(0, STEPS, 10)]},
                   peaks={"mem/rss": memory + rng.random() * MIB}, incidents=incidents or [],
                   fingerprints=fingerprints or {})


@pytest.fixture(scope="module")
def profile() -> Profile:
    base = [run("b0", 0, fingerprints={"known": "ValueError: handled"},
                incidents=[IncidentBrief("loss/plateau", "warning", first_step=10, title="flat")]),
            run("b1", 1), run("b2", 2)]
    return build_profile(base, Policy())


def check(verdict: object, name: str) -> Dict[str, object]:
    found = {c.name: c for c in verdict.checks}  # type: ignore[attr-defined]
    return found[name].__dict__  # type: ignore[no-any-return]


def test_profile_summarises_the_runs(profile: Profile) -> None:
    assert profile.runs == ["b0", "b1", "b2"] and profile.total_steps == 3 * STEPS
    assert profile.loss is not None and profile.loss.transform == "log" and len(profile.loss.steps) == STEPS
    assert profile.kinds["loss/plateau"]["count"] == 1
    assert profile.kinds["loss/plateau"]["per_1k_steps"] == pytest.approx(1000 / (3 * STEPS))
    assert set(profile.fingerprints) == {"known"}
    assert profile.peak_memory is not None and profile.peak_memory.metric == "mem/rss"
    assert profile.step_time is not None and profile.step_time.metric == "time/step_s"
    # strict JSON (NaN/inf as strings), and back to an equal profile that judges the same way
    text = json.dumps(profile.to_dict(), allow_nan=False)
    again = Profile.from_dict(json.loads(text))
    assert again.to_dict() == profile.to_dict()
    candidate = run("c", 7)
    assert evaluate(again, candidate, Policy()).to_dict() == evaluate(profile, candidate, Policy()).to_dict()


@pytest.mark.parametrize("seed", range(10, 20))
def test_other_seeds_pass(profile: Profile, seed: int) -> None:
    verdict = evaluate(profile, run(f"c{seed}", seed), Policy(), "b")
    assert verdict.verdict == "pass" and verdict.exit_code == 0, verdict.reason


def test_a_slower_loss_fails_and_a_short_excursion_does_not(profile: Profile) -> None:
    slow = run("slow", 11, loss=curve(11, change=lambda s, v: v * (5.0 if s >= 60 else 1.0)))
    verdict = evaluate(profile, slow, Policy())
    loss = check(verdict, "loss")
    assert verdict.verdict == "fail" and loss["status"] == "fail"
    assert loss["figures"]["longest_outside_from"] >= 55  # type: ignore[index]
    def spike(length: int) -> RunData:
        return run("spike", 11, loss=curve(11, change=lambda s, v: v * (30.0 if 100 <= s < 100 + length else 1.0)))

    # the running median (15 steps) absorbs a burst of up to 7 wild steps; a longer one shows for its length
    assert check(evaluate(profile, spike(6), Policy()), "loss")["figures"]["longest_outside"] == 0  # type: ignore[index]
    loss = check(evaluate(profile, spike(9), Policy()), "loss")
    assert loss["status"] == "pass" and loss["figures"]["longest_outside"] == 9, loss["summary"]  # type: ignore[index]
    assert check(evaluate(profile, spike(14), Policy()), "loss")["status"] == "fail"
    strict = policy_from_dict({"loss": {"max_consecutive": 2}})
    assert check(evaluate(profile, spike(9), strict), "loss")["status"] == "fail"


def test_direction(profile: Profile) -> None:
    better = run("better", 12, loss=curve(12, change=lambda s, v: v / 4.0 if s >= 40 else v))
    assert check(evaluate(profile, better, Policy()), "loss")["status"] == "pass"
    both = policy_from_dict({"loss": {"direction": "both"}})
    assert check(evaluate(profile, better, both), "loss")["status"] == "fail"


def test_a_non_finite_loss_is_outside(profile: Profile) -> None:
    nan_tail = run("nan", 13, loss=curve(13, change=lambda s, v: math.nan if s >= 170 else v))
    verdict = evaluate(profile, nan_tail, Policy())
    loss = check(verdict, "loss")
    assert loss["status"] == "fail" and loss["figures"]["max_z"] == math.inf
    assert verdict.to_dict()["checks"][3]["figures"]["max_z"] == "Infinity"  # JSON-safe


def test_too_few_matched_steps_cannot_decide_unless_already_failing(profile: Profile) -> None:
    short = run("short", 14, loss=curve(14)[:12], last_step=11)
    verdict = evaluate(profile, short, Policy())
    assert verdict.verdict == "undecided" and verdict.exit_code == 2
    assert "only 12 matched steps" in check(verdict, "loss")["summary"]  # type: ignore[operator]
    bad = run("short-bad", 14, loss=curve(14, change=lambda s, v: v * 50)[:40], last_step=39)
    assert evaluate(profile, bad, Policy()).verdict == "fail"
    no_loss = run("no-loss", 14, loss=[])
    assert check(evaluate(profile, no_loss, Policy()), "loss")["status"] == "undecided"


def test_two_identical_baseline_runs_do_not_collapse_the_band() -> None:
    same = curve(3)
    profile = build_profile([run("a", 3, loss=same), run("b", 3, loss=list(same))], Policy())
    assert profile.loss is not None and max(profile.loss.between) == 0.0
    # the within-run noise and the floor still give a band: a re-noised copy passes
    rng = random.Random(5)
    renoised = [(s, v * math.exp(rng.gauss(0.0, 0.25))) for s, v in same]
    loss = check(evaluate(profile, run("c", 3, loss=renoised), Policy()), "loss")
    assert loss["status"] == "pass" and math.isfinite(loss["figures"]["max_z"])  # type: ignore[arg-type]


def test_a_loss_that_goes_negative_is_compared_linearly() -> None:
    shifted = [curve(s, change=lambda _s, v: v - 0.05) for s in range(3)]
    profile = build_profile([run(f"b{i}", i, loss=pts) for i, pts in enumerate(shifted)], Policy())
    assert profile.loss is not None and profile.loss.transform == "linear"
    assert evaluate(profile, run("c", 15, loss=curve(15, change=lambda _s, v: v - 0.05)),
                    Policy()).verdict == "pass"


def test_fingerprints(profile: Profile) -> None:
    known = run("known", 16, fingerprints={"known": "ValueError: handled"})
    assert check(evaluate(profile, known, Policy()), "fingerprints")["status"] == "pass"
    new = run("new", 16, fingerprints={"known": "ValueError: handled", "f00d": "KeyError: 'x'"})
    verdict = evaluate(profile, new, Policy())
    fp = check(verdict, "fingerprints")
    assert verdict.verdict == "fail" and fp["status"] == "fail" and fp["figures"]["new"] == ["f00d"]  # type: ignore[index]
    assert "KeyError" in fp["summary"]  # type: ignore[operator]
    assert check(evaluate(profile, new, policy_from_dict({"fingerprints": {"ignore": ["f00d"]}})),
                 "fingerprints")["status"] == "pass"
    assert check(evaluate(profile, new, policy_from_dict({"fingerprints": {"on_new": "warn"}})),
                 "fingerprints")["status"] == "warn"
    # an incident's fingerprint counts too
    crash = run("crash", 16, incidents=[IncidentBrief("process/exception", "error", "beef", 50, "Crashed")])
    assert check(evaluate(profile, crash, Policy()), "fingerprints")["figures"]["new"] == ["beef"]  # type: ignore[index]


def test_incidents(profile: Profile) -> None:
    critical = run("crit", 17, incidents=[IncidentBrief("gradient/explosion", "critical", first_step=90,
                                                        title="Gradient explosion")])
    inc = check(evaluate(profile, critical, Policy()), "incidents")
    assert inc["status"] == "fail" and "new kind gradient/explosion" in inc["summary"]  # type: ignore[operator]
    warning = run("warn", 17, incidents=[IncidentBrief("loss/oscillation", "warning")])
    assert check(evaluate(profile, warning, Policy()), "incidents")["status"] == "warn"
    info = run("info", 17, incidents=[IncidentBrief("memory/context-leak", "info")])
    assert check(evaluate(profile, info, Policy()), "incidents")["status"] == "pass"
    # a kind the baseline had once in 600 steps, 5 times in 200 steps: 9x its rate
    often = run("often", 17, incidents=[IncidentBrief("loss/plateau", "warning")] * 5)
    inc = check(evaluate(profile, often, Policy()), "incidents")
    assert inc["status"] == "warn" and "per 1,000 steps" in inc["summary"]  # type: ignore[operator]
    once = run("once", 17, incidents=[IncidentBrief("loss/plateau", "warning")])
    assert check(evaluate(profile, once, Policy()), "incidents")["status"] == "pass"


@pytest.mark.parametrize("extra,expected", [(0.05, "pass"), (0.15, "warn"), (0.30, "fail")])
def test_peak_memory(profile: Profile, extra: float, expected: str) -> None:
    candidate = run("mem", 18, memory=300 * MIB * (1 + extra))
    assert check(evaluate(profile, candidate, Policy()), "peak_memory")["status"] == expected


def test_a_regression_within_the_baselines_own_noise_does_not_trip() -> None:
    noisy = build_profile([run("a", 0, step_s=0.001), run("b", 1, step_s=0.002), run("c", 2, step_s=0.003)],
                          Policy())
    candidate = run("slow", 19, step_s=0.0028)  # +40% on the median, but within the runs' spread
    st = check(evaluate(noisy, candidate, Policy()), "step_time")
    assert st["status"] == "pass" and st["figures"]["change_pct"] > 25  # type: ignore[index,operator]
    steady = build_profile([run("a", 0), run("b", 1), run("c", 2)], Policy())
    assert check(evaluate(steady, run("slow", 19, step_s=0.0014), Policy()), "step_time")["status"] == "warn"
    failing = policy_from_dict({"step_time": {"fail_pct": 30}})
    assert check(evaluate(steady, run("slow", 19, step_s=0.0014), failing), "step_time")["status"] == "fail"


def test_step_time_is_a_runs_fast_steps_so_a_busy_machine_does_not_count(profile: Profile) -> None:
    busy = run("busy", 25)
    # another job shared the machine for 60% of the run: those steps took 3x as long
    busy.series["time/step_s"] = [(s, v * (3.0 if s % 5 < 3 else 1.0)) for s, v in busy.series["time/step_s"]]
    st = check(evaluate(profile, busy, Policy()), "step_time")
    assert st["status"] == "pass" and st["figures"]["quantile"] == 0.1, st["summary"]
    by_median = policy_from_dict({"step_time": {"quantile": 0.5}})
    profile_median = build_profile([run("b0", 0), run("b1", 1), run("b2", 2)], by_median)
    assert check(evaluate(profile_median, busy, by_median), "step_time")["status"] == "warn"
    slower = run("slower", 25, step_s=0.0014)  # the code itself 40% slower: every step
    assert check(evaluate(profile, slower, Policy()), "step_time")["status"] == "warn"


def test_status(profile: Profile) -> None:
    verdict = evaluate(profile, run("dead", 20, status="failed"), Policy())
    assert verdict.verdict == "fail" and check(verdict, "status")["status"] == "fail"
    assert evaluate(profile, run("stalled", 20, status="stalled"),
                    policy_from_dict({"status": {"fail_on": ["failed"]}})).verdict == "pass"


def test_preconditions_are_undecided_with_the_reason(profile: Profile) -> None:
    running = evaluate(profile, run("live", 21, status="running", last_step=50), Policy())
    assert running.exit_code == 2 and "still running" in running.reason and not running.checks
    assert "one of the baseline's runs" in evaluate(profile, run("b1", 1), Policy()).reason
    one = build_profile([run("a", 0), run("x", 1, status="failed")], Policy())
    verdict = evaluate(one, run("c", 22), Policy())
    assert verdict.exit_code == 2
    assert "1 usable run(s), the policy needs 2 (left out: x: status failed" in verdict.reason
    assert evaluate(one, run("c", 22), policy_from_dict({"baseline": {"min_runs": 1}})).exit_code != 2


def test_a_failure_wins_over_an_undecided_check(profile: Profile) -> None:
    verdict = evaluate(profile, run("crash-early", 23, loss=curve(23)[:5], last_step=4, status="failed",
                                    fingerprints={"dead": "RuntimeError: boom"}), Policy())
    assert check(verdict, "loss")["status"] == "undecided"
    assert verdict.verdict == "fail" and verdict.exit_code == 1
    assert verdict.reason.startswith("status: the candidate run failed; fingerprints:")


def test_profiled_with_other_settings_is_noted(profile: Profile) -> None:
    verdict = evaluate(profile, run("c", 24), policy_from_dict({"loss": {"smooth_window": 31}}))
    assert any("loss.smooth_window" in note for note in verdict.notes)
