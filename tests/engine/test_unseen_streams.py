"""The engine on real runs of bench/unseen's training shapes (``tests/fixtures/unseen``, the SDK's stream,
unedited), replayed one envelope at a time as ``bench/corpus/evaluate.py`` judges them.

* HF Trainer GPT-2 at LR 0.5 (1000x) under the default ``max_grad_norm`` 1: the loss leaves its band at
  step 3 (4.1 -> ~30), then falls back towards ln(64) while every step clips at 10-30x the threshold. The
  clip-stale the curve then shows is the divergence's doing: its lead hypothesis is the learning rate, its
  advice lowers the LR, and "raise the clip threshold" is not its first check (stop 34's lead (a): a user
  reading "clip threshold too low" would raise ``max_grad_norm``).
* Lightning GRU LM, Adam at LR 0.3 with ``accumulate_grad_batches=4``: the grad norm climbs from 0.12 to
  74 by step 17 (an explosion, rightly flagged), the loss goes 3.9 -> 7.6 and then learns to ~2.5 while
  the norm stays spiky (1-10, never 20 readings in a row under 2x the climb's median). Once the loss is
  back under where it started and the norm's median is back, the explosion resolves (stop 34's lead (b):
  it stayed open to the end of a run that recovered); ``explosion_recovered_level`` 0 turns that off.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Optional, Union

from tests.scenarios.corpus import load_events
from trainguard_engine.catalogue import DetectionSettings
from trainguard_engine.pipeline import Pipeline

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "unseen"


def _incidents(name: Union[str, Path], settings: Optional[DetectionSettings] = None) -> Dict[str, Any]:
    """The run's final incidents by kind, its envelopes fed one by one, the timers a minute after
    (``name``: a file of ``tests/fixtures/unseen``, or any stream's path)."""
    pipeline = Pipeline(settings or DetectionSettings())
    last_ns = 0
    for event in load_events([name if isinstance(name, Path) else FIXTURES / name]):
        last_ns = max(last_ns, int(event.get("time_unix_nano") or 0))
        pipeline.process([event])
    pipeline.advance(last_ns + 60 * 10**9)
    out: Dict[str, Any] = {}
    for inc in pipeline.incidents():
        out.setdefault(f"{inc.category}/{inc.subtype}", inc)
    return out


def _causes(inc: Any) -> List[str]:
    return [h["cause"] for h in inc.hypotheses]


def test_clip_stale_after_a_divergence_leads_with_the_learning_rate() -> None:
    found = _incidents("hf_gpt2_lr1000x.jsonl.gz")
    assert found["loss/divergence"].first_step <= 9
    stale = found["gradient/clip-stale"]
    assert _causes(stale)[0] == "learning rate too high, so every step clips"
    assert stale.hypotheses[0]["confidence"] > 0.6
    assert any("diverged at step" in why for why in stale.hypotheses[0]["why"])
    advice = [ev.description for ev in stale.evidence if ev.rule == "gradient.clip_recommendation"]
    assert advice and "lower the LR" in advice[0] and "raise max_norm" not in advice[0]
    assert "lower the learning rate" in stale.summary or "lower the LR" in stale.summary
    assert "raise the clip threshold" not in stale.checks[0]
    assert "raise the clip threshold" in stale.checks[-1]


def test_an_explosion_the_run_learned_through_resolves() -> None:
    found = _incidents("pl_gru_adam_accum4_lr100x.jsonl.gz")
    explosion = found["gradient/explosion"]
    assert explosion.first_step <= 17
    assert explosion.status == "resolved"
    assert "learned through the blow-up" in explosion.timeline[-1].what
    assert explosion.timeline[-1].step <= 90
    assert not [k for k, inc in found.items() if inc.status != "resolved" and not k.startswith("perf/")]


def test_an_explosion_the_run_learned_through_stays_open_with_the_rule_off() -> None:
    found = _incidents("pl_gru_adam_accum4_lr100x.jsonl.gz", DetectionSettings(explosion_recovered_level=0.0))
    assert found["gradient/explosion"].status != "resolved"
