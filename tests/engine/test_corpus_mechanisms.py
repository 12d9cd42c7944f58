"""Detector mechanisms fixed on the varied corpus's tune half (issue 16), each judged on a real recorded run
(``tests/scenarios/streams_varied_cases/``: the SDK's stream and the ground-truth trace of one dev-half run
of ``bench/corpus``, unedited, gzipped), replayed through the engine as ``bench/corpus/evaluate.py`` does.

* r178 (plain CNN, SGD+momentum, an LR schedule that grows x1.15 per step, clip 5): the loss climbs from
  1.5 to 1e33 while a too-high LR has killed some units (zero-gradient layers): a zero-gradient layer
  does not make a significantly rising loss "batch noise" -- it is a divergence.
* r212 (Lightning CNN, warmup to an LR 40x too high, clip 1): one gradient spike (20x its median) at the
  end of warmup, then the loss flat at its initial level for 160 steps: the pre-NaN explosion the spike
  opened resolves once the norm is back, and the flat loss is the plateau the run really is.
* r239 (Lightning softmax regression, SGD with an LR ~100x too high): the first update throws the loss
  from 1.9 to 81, then it swings between ~10 and ~100 with no trend: an oscillation, not a divergence
  (the swings' decay from the first jump is not a rising trend).
* r109 (Lightning MLP, SGD, batch 4: a healthy, noisy run): its very first loss (0.044) is one lucky batch
  well below the next ones (~0.3-0.6); the loss then falls to ~0.05 and swings there as batch-4 losses do.
  The first value stands for the untrained level (a far-too-high LR swings above it from the first
  update) only while the loss has never been back at or below it -- here it has, so the swings are
  judged against the robust initial median, and no oscillation stays open on a healthy run.
* r114 (plain CNN, SGD, batch 2, linear LR decay: healthy, slow and noisy): flat at ~0.9x its start for
  its first ~100 steps (a plateau then, rightly), then down to ~0.8x. The plateau clears when the rule's
  own level test no longer holds over a full loss window (the run fell from where it started), not only
  after a further 20 % drop below the plateau's level.
* r301 (plain CNN, Adam, clip 5, a NaN planted in the data at step 134): the SDK read the grad norm every
  step at first, then (its overhead budget) every 2-6 steps; the loss went NaN at 134 with calm norms
  before it and the step's own norm never read. The cadence that decides "this step's norm is still to
  come" is the recent one, so the sudden NaN is the NaN source, not a bare non-finite loss.
* r232 (Lightning CNN, SGD with an LR ~90x too high, clip 1): the LR killed the first layers (exactly zero
  gradient) and the loss swings between ~2 and ~12, 5x its start, for 200 steps. Dead units alone do not
  make swings "batch noise" when the loss is that far above where it started (a constant predictor sits
  at most about there): the live layers are thrown around -- an oscillation, not a plateau.
* r166 (Lightning MLP, SGD, an LR schedule that grows exponentially, no clipping): the SDK read the grad
  norm at steps 0, 1, 7, 15, then every step from 23 (3.5x its median); the loss left its band at ~22
  and the norm went Inf at 35. The explosion rule needs several readings of a 6x climb (from 28 on);
  a loss divergence that the grad norm corroborates (>= explosion_onset_factor x its median) confirms on
  divergence_corroborated_points values instead of divergence_min_points: flagged 10 steps before.
* r205 (Lightning CNN, SGD+momentum with an LR ~300x too high, clip 5): the loss rises from 3.5 to ~15 in
  its first ~30 steps (a divergence, rightly), then swings between ~8 and ~25 with no trend for 250
  steps, about where it was when it left its band: the divergence settles into an oscillation (resolved,
  the oscillation open) -- a loss still growing after it left its band stays a divergence.
* r213 (Lightning MLP, AdamW, warmup to an LR ~70x too high, clip 1): the loss falls from 0.26 to ~0.05,
  then swings ever higher as the LR peaks (~0.1-0.6 at the end): the swings open an oscillation at first
  (their level just above the start), and once they sit on a significant rebound from the level the run
  had reached, the oscillation gives way to the rise-after-fall (resolved; the rise opens).
* r224 (Lightning CNN, SGD, warmup to an LR ~170x too high over 74 steps, clip 5): the loss leaves its
  band at ~9 during the warmup and keeps growing with it to ~18, swinging. A window in which the LR still
  grew has not "stopped rising" however rough it is: without that guard the divergence settled into an
  oscillation at step ~83 once oscillation_max_rise was 1.7 (the default 1.5 held it by a thin margin,
  1.54 -- then against the level at which the loss left its band; since stop 30 the swings' level is
  compared with the run's first full loss window, see r490).
* r187 (HF LoRA, SGD with an LR ~110x too high, clip 1): the loss falls from 4.8 to ~4.2 in its first ~40
  steps, then stays flat there (0.87x its start) while the global grad norm collapsed from ~0.9 to ~0.02:
  the run stopped learning. A window level below plateau_min_level (0.9) is still a plateau when it is
  >= plateau_stalled_min_level (0.8) x the start and the grad norm is <= plateau_grad_collapse (0.1) x
  its own early level; nothing was found before.
* r343 (Lightning MLP, SGD+momentum, an LR schedule that grows x1.15 per step, no clipping; batch 2 of the
  corpus): the loss jumps from ~0.3 to 6.7, 15, 19, 17, 18 at steps 27-31 while the grad norm (read
  every step) is 10-20x its median, and goes Inf at 42. Rough (each step ~doubles it), so the
  divergence rule handed it to the oscillation rule until its Mann-Kendall trend was significant
  (flagged at 33, lead 9); a level >= divergence_far_factor (5) x the start with the grad norm >=
  explosion_jump_factor x its median is diverged however it jumps: flagged at 31, lead 11.
* r330 (plain MLP, SGD, LR x1.06 per step, no clipping, only the SDK's sampled norm): the norm was read
  at 55 (2.9x its median), then not before 63; the loss climbs on every step from 56 (1.7, 3.9, 5.0,
  9.2, 22, 67 ...) and goes Inf at 66. A loss far above its band that rose on every value since it left
  the band, with the norm's last reading >= explosion_onset_factor x its median, is a divergence from
  its third value: flagged at 60 (lead 6) instead of 65 (lead 1) -- not 10: the climb is 10 steps long.
* r370 (plain MLP, SGD, warmup to an LR ~33x too high, clip 1): the loss falls from 0.75 to ~0.3, then
  rises back to ~1.0 as the LR peaks, swinging between 0.3 and 2.5. The rise-after-fall opened at 53;
  its "half of the rise given back" test read the 5-value rolling level, which one run of low batches
  takes there, so it resolved and the swings opened an oscillation that led. The rise is given back
  only when the median of a full loss_window is back too: the rise-after-fall stays open and leads.
* r201 (Lightning CNN, SGD+momentum with an LR ~110x too high, clip 1): the loss starts calm (1.35-1.6,
  robust spread ~0.05 of its level), rises to ~2 and swings there (1.2-4) with no trend for 160 steps --
  a robust spread of 0.17-0.30, mostly just under the fixed oscillation_min_cv (0.3), so the flat-looking
  window was a plateau. Judged against the run's own noise (oscillation_noise_factor 4 x its early
  spread, never below oscillation_calm_min_cv 0.2) the swings are an oscillation.
* r403 (plain GPT, Adam, warmup to an LR ~100x too high; batch 3 of the corpus): the loss falls from 4.0
  to ~1.5, then at ~110 the grad norm jumps 5-8x and the loss goes back to its start (~3.9-4.5) and stays
  flat there to the end, never non-finite. The pre-NaN explosion flagged at 119 stayed open to the end
  (the verdict, a gradient incident). An explosion that never reached a non-finite value, open over a
  flat loss within its band for plateau_min_steps, gives way (resolved) to the plateau: the right
  category now; its label is rise-after-fall (the rebound happened > 2 loss windows before the flat
  stretch was long enough, and the rise rule reads the last two) -- the subtype is still missed.
  Then (stop 29, second part): the rise rule's Mann-Kendall test over the values since the best level
  sees no rise in a spike settling on a high level (8.5 down to ~3.9: the later values fall) nor in a
  step up older than its window. A loss window that sits calm (spread under the oscillation bar) with
  its lower quartile >= best + rise_min_rise x the fall, the best older than the window, is a rebound
  held -- a whole window confirms it, so it opens at once; and a rise-after-fall in the numeric slot
  whose explosion had resolved re-classifies it (as a divergence already did): loss/rise-after-fall.
* r415 (HF Trainer, LoRA GPT, Adam with an LR ~216x too high, HF's default max_grad_norm 1; batch 4 of
  the corpus): the loss falls from 5.5 to ~4.3 in the first 10 steps, then sits flat there to the end
  (0.89x its initial level) while the pre-clip norm climbs 0.01 -> 79 and back, never non-finite. The
  pre-NaN explosion flagged at 58 stayed open to the end (the verdict): the gave-way rule needs the
  plateau rule, which took a level under plateau_min_level (0.9) x the start for converging. A loss
  that fell a little is stalled (plateau_stalled_min_level, 0.8) when the norm collapsed -- and now
  also when it climbed into an explosion flagged before any non-finite value: the explosion gives way
  to the plateau.
* r473 (plain MLP, SGD with an LR ~60x too high, clip 1; batch 5 of the corpus, stop 30): the loss jumps
  from 0.31 to 1.7-4.9 at once and swings there (an oscillation from step 41, rightly), then from ~80
  stops swinging and holds at ~2.9, 5x its start, to the end (robust spread 0.1-0.25, no trend): the
  oscillation stayed open to the end, as nothing let an oscillation give way. The counterpart of the
  divergence settling into an oscillation: the oscillation rule failing while the divergence rule holds
  on oscillation_held_points (40, a full loss window) values in a row is a divergence -- the
  oscillation resolves, the divergence opens.
* r477 (Lightning softmax regression, SGD+momentum with an LR ~11x too high, clip 5; batch 5): the loss
  swings between ~0 and ~9 from the first steps to the end, its level wandering (a window of low batches
  around 150-165, higher swings after 200). The rise rule read the fall from the 5-value rolling level,
  which one run of low batches takes to 0.6x under the start, and the later swings as a rebound: the
  oscillation gave way to a rise-after-fall at 220. A rise after a fall is a rebound from a level the run
  reached: the fall must also hold over rise_held_points (20, half a loss window) values in a row (their
  lowest median), here 0.47x of the start -- under rise_min_fall; the real rebounds of the corpus (r213,
  r370, r403) held theirs (0.80, 0.56, 0.63). Relabelled ``unmanifested`` at stop 45 (bench/corpus/labels.py
  NO_DETECTABLE_FAILURE: noisy from step 1 with no order, like healthy heavy-tailed noise; not scored);
  the mechanism -- a swinging loss's dip is no reached level -- is still checked on it.
* r490 (plain GPT, Adagrad, its LR raised 100x at 45 % of the run, clip 1; batch 5): the loss falls from
  4.2 to 2.1, then the jump throws it to 40-120 (a divergence from step 77, rightly), where it swings
  with no trend, slowly coming down to ~30 -- still 7x its start at the end. The divergence settled into
  an oscillation at 113: its swings sat within oscillation_max_rise of the level at which it left its
  band. What an oscillation is (the label's rule too) is swings with no trend *relative to where the run
  started*; the settling now compares the swings' level with the run's first full loss window (4.0 here;
  r205 and r239, thrown up within their first window, still settle): a loss that climbed far above its
  early level and swings there has not stopped diverging from it.
* r366 (Lightning GPT, Adam with an LR ~300x too high, no clipping; stop 31): the first update throws the
  loss from 4.2 to ~54 and it swings between ~50 and ~140 for 200 steps, never back under 2x its start.
  The label rule (decided on record at stop 31) calls that a divergence: an oscillation swings around a
  level the run can still reach, back into its band at times. The detector's oscillation rule (and the
  divergence rule's "rough with no trend: the oscillation's" exemption) now ask the same of the last two
  loss windows: swings held out of the band for 2 x loss_window values are a divergence. With the default
  swing bar r366's swings (robust spread ~0.2) never read as swings; under a lower bar (0.1) they did, and
  the divergence settled into an oscillation that led -- now the oscillation gives way to the divergence.
  r473's divergence is seen at ~110 instead of 138 for the same reason.
* r515 (plain MLP, Adagrad with an LR ~1,300x too low, clip 1; stop 31): nothing moves, and the loss is
  its batches' noise (robust spread ~0.25) around ~0.29 from the first step to the last; its first five
  losses' median (0.36) happened to land 1.25x above that, so every window read 0.78-0.89x "where it
  started" -- fallen, by plateau_min_level (0.9), and the swings opened an oscillation at 164. "Fell since
  the start" now also asks that the window's values be significantly lower than the run's first
  2 x loss_baseline_points values (a one-sided Mann-Whitney rank test, z >= trend_z): here they are not,
  and the flat loss is the plateau (open from 101). A plateau found under plateau_min_level does not
  clear by the level test it already failed when it opened (it would flap).
* r506 (HF Trainer, LoRA GPT, SGD with a OneCycle to an LR ~40x too high; stop 31): the loss falls from
  5.5 to ~3.3 in ~25 steps, rises to ~4.5 at the LR's peak, then sits at ~4.0 for 150 steps (0.80x its
  first median, under plateau_min_level): nothing was found. Its first values already went as low as
  3.2-3.5, so the flat stretch is not significantly below where the run started: a plateau (from 156).
  Since stop 31's second label decision r506 and r515 are unmanifested (their traces meet the healthy
  rule); the detector behaviour stays tested.
* r574, r576 (SGD on a softmax regression far above its stable LR; stop 31): the loss swings over its
  whole range (0.3-3.7; 0-135) with no trend for the whole run; the detector says oscillation, and since
  stop 31's third label decision (a level change is a trend only when a rank test finds it too) so does
  the label -- it read divergence before, from a ratio of two medians that crossed its bar by chance.
* r541 (plain CNN, Adagrad, its LR raised at ~45 % of the run; stop 31): the loss falls calmly from 1.4
  to ~0.8 (a held fall of 43 %: the lowest 20-value median), the jump throws it to 232 once, and it
  settles calm at ~1.3, back where it started: a plateau (0.93x the start) was its verdict, since the
  held fall was under rise_min_fall (50 %, against a swinging loss's dips: r477). A held rebound -- a
  calm window above the rebound bar -- now needs only rise_calm_min_fall (30 %) held: a swinging loss's
  window is not calm, so r477 stays an oscillation (lowering rise_min_fall itself to 0.3 lost it).
* r428 (Lightning CNN, SGD-momentum warmed up to an LR ~10x too high; stop 31): the loss leaves its band
  at ~104 (2.9x its start) and swings between ~2 and ~16 to the end; a run of low batches took the
  5-value rolling level under divergence_factor x the start at ~140, the divergence resolved and an
  oscillation at 3x the start opened and led. A divergence now clears only when the last loss_window
  values' median is under the bar too (as a rise-after-fall's give-back already must).
* r216 (plain GPT, SGD+momentum, a warmup to an LR ~190x too high, clip 1; recorded at stop 32): the
  pre-clip norm climbs with the warmup and a pre-NaN gradient explosion opens at step 13, as the loss
  leaves its band; the loss then climbs from 4.2 to ~2,000-3,000 and stays there to the end, never
  non-finite. The explosion stayed open to the end (the verdict). An explosion flagged from the climb that
  is followed by explosion_diverged_points (40) values with the loss out of its band and nothing
  non-finite is re-classified in place as the divergence it is (the label's rule: an explosion ends in a non-finite
  value); a later non-finite value would re-classify it back.
* r184 (plain GPT, SGD+momentum with an LR ~250x too high, clip 1; stop 32): the loss goes from 4.2 to
  ~3,000 within the first steps, then slowly comes down (~470 at the end) with every step clipped. A
  gradient/clip-stale opened beside the divergence, advising to raise max_norm: clipping never starves
  a loss that has left its band (its level >= divergence_factor x its start) -- no clip-stale there.
* r641 (plain MLP, NAdam, a warmup to an LR ~200x too high, clip 1; corpus batch 7, stop 32): the loss
  swings between ~0.14 and ~0.3 (1.4x its start) with no trend for 240 steps -- an oscillation from step
  41. It resolved on a run of low batches (the 5-value rolling level 20 % under its opening level) and
  the same swings then opened a plateau, the verdict. An oscillation clears only when the median of a
  full loss_window fell that far too (as a divergence and a rise already did): it stays open and leads.
* r656 (HF Trainer MLP, SGD, an LR schedule growing x1.1 per step, HF's max_grad_norm 1; batch 7, stop
  32): the loss leaves its band at ~46 (a divergence, rightly) and climbs to ~1e26 while the pre-clip norm
  grows slowly for 120 steps (1.7e5 -> 8e5 over the last 12), then the norm is Inf at 168. find_explosion
  sees no climb in its window (the norm has been far up for longer than it), so the Inf was a NaN source.
  A non-finite value that ends an open divergence of the rank is the explosion it grew into (the loss's
  departure was the warning): gradient/explosion, the divergence's incident re-classified.
* r326 (Lightning MLP, SGD, LR x1.06 per step, no clipping; batch 2): the norm goes 2.3 -> 46 -> 3,460 ->
  1.4e7 -> Inf in four steps; the divergence opened one step before the Inf, too few readings for a climb:
  a NaN source before, the explosion now.
* r606 (plain GPT, NAdam, a OneCycle to an LR ~120x too high, clip 1; batch 7, stop 33): the loss sits at
  its start (~4.1), the LR's peak throws it to 5-13 (an oscillation, rightly, resolved), and from ~105
  it is back at 4.0-4.1, flat, to the end (step 200): ~95 steps, under plateau_min_steps (100), so
  nothing stayed open. A flat stretch that began after the loss had left its start (a 20-value median
  more than plateau_resolve_drop from it) needs only plateau_moved_min_steps (50): no slow start is flat
  from there. r214 (HF GPT, Adam, warmup to an LR ~280x too high, HF's max_grad_norm 1) and r582 (HF
  GPT, Adam, OneCycle to ~200x) go 4.2 -> ~6 / ~5.5 and come back to ~4.5 / ~4.0 by the end, still
  drifting down slowly (0.3-0.4 % of the level per step, a significant Mann-Kendall trend in their calm
  windows): back within plateau_resolve_drop above the start, that drift is the loss settling back from
  where it was thrown, not learning -- a plateau (nothing at all was found before).
* r645 (plain CNN, SGD-Nesterov, OneCycle to an LR ~86x too high, clip 5; batch 7, stop 33): calm at its
  start (~1.3) until the LR's peak throws it about (1.0-3.7, an oscillation from 46, rightly), then from
  ~150 it settles back at ~1.4 (1.08x its start, robust spread 0.07-0.13) to the end (240). The
  oscillation stayed open to the end: it cleared only on a level 20 % under its opening level. An
  oscillation whose window spread stays under oscillation_calm_min_cv (the lowest spread that swings) for
  oscillation_held_points values has stopped: it resolves, and the flat loss is the plateau it is.
* r684 (plain GPT, SGD-momentum, a cyclic (triangular) LR peaking ~23x too high, batch 2, clip 1; batch 8,
  stop 33): each LR cycle throws the loss up and lets it back, and cycle after cycle the level climbs
  (window medians 4.5 at the start -> 8-18 at the end; label divergence: its second half is significantly
  higher than its early steps). Inside any one 40-value window the cycles hide the climb (no Mann-Kendall
  trend), so it read as an oscillation to the end. A window whose median is above oscillation_max_rise x
  the run's first full window's level (and its initial level), with values significantly higher than that
  window's (rank test, z >= trend_z), is a rising loss, not swings around a level.
* r709 (healthy, plain CNN, SGD at a sane LR with warmup+cosine, batch 4; batch 8, stop 33): calm at its
  start (robust spread 0.06, so its own swing bar is 4 x that = 0.24), it learns slowly (window medians
  1.38 -> 1.02) and its batches get noisier as predictions sharpen (spread 0.19-0.24): an oscillation
  opened at 172 and stayed open to the end. A window whose median is under oscillation_min_fall x the
  first full window's level, with values significantly lower (rank test), is a loss still converging.
* r717 (plain MLP, SGD-Nesterov with an LR ~54x too high, clip 5, batch 64; batch 9, stop 33): the loss
  (0.45 at the start) is thrown to ~10-40 and from step ~30 swings period-2 between ~10 and ~25 to the
  end, never back under 2x its start, while the too-high LR has killed some units (zero-gradient layer
  reports). The oscillation rule rightly fails on swings held out of the band, but the divergence rule
  read the dead units as "nothing moves the weights" and failed too, so the oscillation opened at ~46
  stayed open to the end. A constant predictor left by dead units sits about where it started; at
  >= divergence_factor x the start the live layers are thrown about (as _optimisation_stuck already
  argued for the oscillation rule, r232): a divergence.
* r794 (plain MLP on the Huber-loss 'huber' task, SGD-momentum with SGDR restarts at an LR ~200x too high, no
  clipping, batch 16; batch 11, stop 34): the loss swings 0.2-1.0 around its start (~0.5-0.8, robust spread
  0.31-0.45) to the end, while the steps have killed the hidden ReLUs (layer reports: a gradient on all
  three layers at step 0, zero on the two hidden ones from step 49). The dead units vetoed the swings
  ("nothing moves the weights: batch noise") and a plateau opened. Units dead from the first report leave a
  constant predictor from the start (its loss scatters as its batches do); units killed by the updates died
  of steps too large, and those steps keep throwing the live layers about: the swings are the optimiser's.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any, Dict

import pytest

from bench.corpus import evaluate, labels, manifest
from bench.corpus.trainings import clip_for

CASES = Path(__file__).resolve().parents[1] / "scenarios" / "streams_varied_cases"


def _outcome(run_id: str, **settings: Any) -> evaluate.Outcome:
    doc: Dict[str, Any] = json.loads(gzip.decompress((CASES / f"{run_id}.truth.json.gz").read_bytes()))
    spec = manifest.RunSpec.from_dict(doc["spec"])
    assert spec.split == "dev"  # tuned on the tune half only
    events = evaluate.read_events(CASES / f"{run_id}.jsonl.gz")
    out = evaluate.outcome_of(spec, doc["truth"], events, evaluate.DetectionSettings(**settings))
    assert out.label == labels.label(spec, doc["truth"], clip_for(spec))
    return out


def test_a_rising_loss_with_some_dead_units_is_a_divergence() -> None:
    out = _outcome("r178")
    assert out.label == "loss/divergence"
    assert out.verdict == "loss/divergence", out
    assert out.visible_step["loss/divergence"] <= 60  # the loss left its band at ~45 (1.5 -> 19 by 45)


def test_a_gradient_spike_that_recovered_resolves_and_the_flat_loss_is_a_plateau() -> None:
    out = _outcome("r212")
    assert out.label == "loss/plateau"
    assert "gradient/explosion" in out.transient and "gradient/explosion" not in out.open_alerts, out
    assert out.verdict == "loss/plateau", out


def test_a_loss_swinging_with_no_trend_after_a_first_jump_is_an_oscillation() -> None:
    out = _outcome("r239")
    assert out.label == "loss/oscillation"
    assert out.verdict == "loss/oscillation", out
    assert "loss/divergence" not in out.kinds


@pytest.mark.parametrize("run_id", ["r212"])
def test_the_resolved_explosion_does_not_come_back_without_a_new_climb(run_id: str) -> None:
    out = _outcome(run_id)
    assert out.open_alerts == ["loss/plateau"], out


def test_a_noisy_healthy_run_whose_first_batch_was_lucky_ends_with_nothing_open() -> None:
    out = _outcome("r109")
    assert out.label == labels.HEALTHY
    assert out.open_alerts == [], out


def test_a_plateau_clears_once_the_loss_window_is_below_the_rules_level() -> None:
    out = _outcome("r114")
    assert out.label == labels.HEALTHY
    assert "loss/plateau" in out.transient and out.open_alerts == [], out


def test_a_sudden_nan_after_the_norm_cadence_thinned_is_the_nan_source() -> None:
    out = _outcome("r301")
    assert out.label == "gradient/nan-source"
    assert out.verdict == "gradient/nan-source", out


def test_swings_far_above_the_start_with_dead_first_layers_are_an_oscillation() -> None:
    out = _outcome("r232")
    assert out.label == "loss/oscillation"
    assert out.verdict == "loss/oscillation", out
    assert "loss/plateau" not in out.kinds


def test_a_divergence_the_grad_norm_corroborates_is_flagged_ten_steps_before_the_inf() -> None:
    out = _outcome("r166")
    assert out.label == "gradient/explosion" and out.clip is None
    assert out.verdict == "gradient/explosion", out
    assert out.first_nonfinite is not None and out.flagged, out
    assert out.first_nonfinite - out.flagged["step"] >= 10, out  # flagged at 27 (lead 8) before the fix


def test_a_divergence_that_stopped_rising_and_swings_settles_into_an_oscillation() -> None:
    out = _outcome("r205")
    assert out.label == "loss/oscillation"
    assert "loss/divergence" in out.transient, out  # it did leave its band first (found, then resolved)
    assert out.verdict == "loss/oscillation" and out.open_alerts == ["loss/oscillation"], out


def test_swings_on_a_rebound_from_a_learned_level_give_way_to_the_rise_after_fall() -> None:
    out = _outcome("r213")
    assert out.label == "loss/rise-after-fall"
    assert out.verdict == "loss/rise-after-fall", out  # the oscillation stayed open and led before the fix
    assert "loss/oscillation" not in out.open_alerts, out


def test_a_divergence_does_not_settle_while_the_lr_still_grows() -> None:
    out = _outcome("r224", oscillation_max_rise=1.7)
    assert out.label == "loss/divergence"
    assert out.verdict == "loss/divergence" and "loss/oscillation" not in out.kinds, out


def test_a_flat_loss_a_little_below_its_start_with_a_collapsed_grad_norm_is_a_plateau() -> None:
    out = _outcome("r187")
    assert out.label == "loss/plateau"
    assert out.verdict == "loss/plateau", out  # nothing at all before the fix (0.87x its start >= 0.9 failed)
    assert out.open_alerts == ["loss/plateau"], out


def test_the_grad_collapse_plateau_is_off_with_plateau_grad_collapse_0() -> None:
    out = _outcome("r187", plateau_grad_collapse=0.0)
    assert "loss/plateau" not in out.kinds, out


def test_a_loss_far_above_its_start_with_the_grad_norm_exploding_is_diverged_however_rough() -> None:
    out = _outcome("r343")
    assert out.label == "gradient/explosion" and out.clip is None
    assert out.verdict == "gradient/explosion", out
    assert out.first_nonfinite is not None and out.flagged, out
    assert out.first_nonfinite - out.flagged["step"] >= 10, out  # lead 9 before the fix


def test_a_loss_climbing_on_every_step_under_a_sampled_norm_is_flagged_before_the_inf() -> None:
    out = _outcome("r330")
    assert out.label == "gradient/explosion" and out.clip is None
    assert out.verdict == "gradient/explosion", out
    assert out.first_nonfinite is not None and out.flagged, out
    assert out.first_nonfinite - out.flagged["step"] >= 5, out  # lead 1 before the fix


@pytest.mark.parametrize("run_id,lead", [("r343", 9), ("r330", 1)])
def test_the_far_divergence_rule_is_off_with_a_huge_divergence_far_factor(run_id: str, lead: int) -> None:
    # the blow-up bar (stop 36) off too: r330's last values before the Inf are >= 1000x its start, which that
    # rule flags on its own (lead 3)
    out = _outcome(run_id, divergence_far_factor=1e9, divergence_blowup_factor=0.0)
    assert out.first_nonfinite is not None and out.flagged, out
    assert out.first_nonfinite - out.flagged["step"] == lead, out


def test_a_rise_after_fall_is_not_given_back_by_one_dip_of_a_swinging_loss() -> None:
    out = _outcome("r370")
    assert out.label == "loss/rise-after-fall"
    assert out.verdict == "loss/rise-after-fall", out  # resolved at a dip, the oscillation led before the fix
    assert out.open_alerts == ["loss/rise-after-fall"], out


def test_swings_just_under_the_fixed_spread_bar_of_a_run_that_started_calm_are_an_oscillation() -> None:
    out = _outcome("r201")
    assert out.label == "loss/oscillation"
    assert out.verdict == "loss/oscillation", out  # loss/plateau before the fix
    assert "loss/plateau" not in out.kinds, out


def test_unshaped_swings_new_to_a_calm_run_open_without_a_shape() -> None:
    """The shape test (on since stop 50) lets r201's heavy-tailed swings open because they are new to the
    run: their spread is 5.4-8.3x its early spread (oscillation_shape_new_factor 3). Without that gate the
    verdict is lost, as stop 44 found."""
    assert _outcome("r201", oscillation_shape_new_factor=0.0).verdict != "loss/oscillation"


def test_the_own_noise_bar_is_off_when_it_equals_the_fixed_one() -> None:
    out = _outcome("r201", oscillation_calm_min_cv=0.3)
    assert out.verdict == "loss/plateau", out


def test_an_explosion_that_never_blew_up_gives_way_to_the_flat_loss_it_left() -> None:
    out = _outcome("r403", rise_min_rise=10.0)  # no rise-after-fall possible: the plateau mechanism alone
    assert out.label == "loss/rise-after-fall" and out.first_nonfinite is None
    assert "gradient/explosion" in out.transient, out  # open, and the verdict, before the fix
    assert "gradient/explosion" not in out.open_alerts, out
    assert out.verdict == "loss/plateau", out


def test_a_rebound_held_on_a_calm_level_older_than_the_trend_window_is_a_rise_after_fall() -> None:
    out = _outcome("r403")
    assert out.label == "loss/rise-after-fall" and out.first_nonfinite is None
    assert out.verdict == "loss/rise-after-fall", out  # loss/plateau before: the trend test saw no rise
    assert not out.open_alerts or out.open_alerts == ["loss/rise-after-fall"], out


def test_a_flat_loss_a_little_below_its_start_under_a_climbing_clipped_norm_is_a_plateau() -> None:
    out = _outcome("r415")
    assert out.label == "loss/plateau" and out.first_nonfinite is None
    assert "gradient/explosion" in out.transient, out  # open to the end, and the verdict, before the fix
    assert "gradient/explosion" not in out.open_alerts, out
    assert out.verdict == "loss/plateau", out


def test_the_climbed_stall_is_off_when_the_stalled_level_equals_the_plateau_level() -> None:
    out = _outcome("r415", plateau_stalled_min_level=0.9)  # = plateau_min_level: no stalled rule at all
    assert out.verdict == "gradient/explosion", out


def test_an_oscillation_that_stopped_swinging_far_above_the_start_gives_way_to_a_divergence() -> None:
    out = _outcome("r473")
    assert out.label == "loss/divergence" and out.first_nonfinite is None
    assert "loss/oscillation" in out.transient, out  # open to the end, and the verdict, before the fix
    assert out.verdict == "loss/divergence" and out.open_alerts == ["loss/divergence"], out
    assert out.visible_step["loss/divergence"] < 160  # held at ~2.9 from ~80: one window of holds later


def test_the_oscillation_gives_way_only_after_oscillation_held_points() -> None:
    out = _outcome("r473", oscillation_held_points=1000)  # longer than the run: never
    assert out.verdict == "loss/oscillation", out


def test_a_swinging_loss_whose_rolling_level_dipped_is_not_a_rise_after_fall() -> None:
    out = _outcome("r477")
    assert out.label == labels.UNMANIFESTED  # stop 45: loss/oscillation before (labels.NO_DETECTABLE_FAILURE)
    assert "loss/rise-after-fall" not in out.kinds, out  # the verdict, open, before the fix
    # its swings are heavy-tailed noise without a shape: since stop 50 (the shape test on) nothing opens;
    # with the test off (stops 44-49) they opened an oscillation, and still no rise-after-fall
    assert out.verdict == "-" and not out.open_alerts, out
    off = _outcome("r477", oscillation_min_serial=0.0)
    assert "loss/rise-after-fall" not in off.kinds, off
    assert off.verdict == "loss/oscillation" and off.open_alerts == ["loss/oscillation"], off


def test_the_held_fall_is_off_with_rise_held_points_1() -> None:
    out = _outcome("r477", rise_held_points=1)  # the lowest single value: any dip is a reached level
    assert out.verdict == "loss/rise-after-fall", out


def test_swings_far_above_the_runs_early_level_do_not_settle_the_divergence() -> None:
    out = _outcome("r490")
    assert out.label == "loss/divergence" and out.first_nonfinite is None
    assert "loss/oscillation" not in out.kinds, out  # the verdict, open, before the fix
    assert out.verdict == "loss/divergence" and "loss/divergence" in out.open_alerts, out
    assert out.visible_step["loss/divergence"] <= 80  # the jump came at 73


def test_with_a_loose_oscillation_max_rise_the_divergence_settles_again() -> None:
    out = _outcome("r490", oscillation_max_rise=100.0)
    assert out.visible_step.get("loss/oscillation", 999) <= 120, out  # settled (the default never does)
    # (until stop 32 the oscillation also stayed the verdict: a gradient/clip-stale opened at 116 on the
    # loss held 7x above its start and froze the curve rules; clipping never reads stale on a diverged loss
    # now, and the swings held far above the band give way to the divergence again, as the label says)
    assert "gradient/clip-stale" not in out.kinds, out


def test_swings_held_out_of_the_band_for_two_windows_are_a_divergence() -> None:
    out = _outcome("r366", oscillation_min_cv=0.15, oscillation_calm_min_cv=0.1)  # swings by this bar
    assert out.label == "loss/divergence" and out.first_nonfinite is None
    assert out.verdict == "loss/divergence" and out.open_alerts == ["loss/divergence"], out  # oscillation before
    assert "loss/oscillation" not in out.open_alerts, out


def test_an_oscillation_held_out_of_the_band_gives_way_sooner() -> None:
    out = _outcome("r473")
    assert out.visible_step["loss/divergence"] <= 120, out  # 138 before: the whole run's swings were out


def test_a_flat_noisy_loss_whose_first_median_landed_high_is_a_plateau() -> None:
    out = _outcome("r515")
    # labelled loss/plateau until stop 31's second label decision; its trace also meets the healthy rule,
    # so it is unmanifested now (not scored) -- the mechanism stands: a flat loss is not called "fell"
    assert out.label == labels.UNMANIFESTED and out.label_before == "loss/plateau", out
    assert out.first_nonfinite is None
    assert out.verdict == "loss/plateau" and out.open_alerts == ["loss/plateau"], out  # oscillation before
    assert "loss/oscillation" not in out.kinds, out


def test_a_flat_stretch_not_below_the_runs_first_values_is_a_plateau() -> None:
    out = _outcome("r506")
    # labelled loss/plateau until stop 31's second label decision; its trace also meets the healthy rule,
    # so it is unmanifested now (not scored) -- the mechanism stands: a flat loss is not called "fell"
    assert out.label == labels.UNMANIFESTED and out.label_before == "loss/plateau", out
    assert out.first_nonfinite is None
    assert out.verdict == "loss/plateau" and out.open_alerts == ["loss/plateau"], out  # nothing before



@pytest.mark.parametrize("run_id", ["r574", "r576"])
def test_a_loss_swinging_over_its_whole_range_with_no_significant_trend_is_an_oscillation(run_id: str) -> None:
    # the label's "no trend" compared two medians with fixed bars; a loss swinging 0.3-3.7 (r574) or
    # 0-135 (r576) crossed them by chance (0.849x, 1.59x) and was labelled a divergence before stop 31's
    # third label decision (a level change is a trend only when a rank test also finds it)
    out = _outcome(run_id)
    assert out.label == "loss/oscillation" and out.first_nonfinite is None, out
    assert out.verdict == "loss/oscillation" and out.open_alerts == ["loss/oscillation"], out


def test_a_calm_rebound_to_the_start_after_a_held_fall_of_a_third_is_a_rise_after_fall() -> None:
    out = _outcome("r541")
    assert out.label == "loss/rise-after-fall" and out.first_nonfinite is None
    assert out.verdict == "loss/rise-after-fall", out  # a plateau before (its held fall 43 % < 50 %)
    assert "loss/plateau" not in out.open_alerts, out


def test_the_calm_held_fall_is_off_with_rise_calm_min_fall_at_rise_min_fall() -> None:
    out = _outcome("r541", rise_calm_min_fall=0.5)
    assert out.verdict == "loss/plateau", out


def test_a_divergence_swinging_far_above_its_band_does_not_clear_on_a_run_of_low_batches() -> None:
    out = _outcome("r428")
    assert out.label == "loss/divergence" and out.first_nonfinite is None
    assert out.verdict == "loss/divergence" and out.open_alerts == ["loss/divergence"], out  # oscillation before
    assert "loss/divergence" not in out.transient, out


def test_an_explosion_flagged_before_any_nan_whose_loss_stays_diverged_becomes_the_divergence() -> None:
    out = _outcome("r216")
    assert out.label == "loss/divergence" and out.first_nonfinite is None
    assert out.visible_step.get("gradient/explosion", 999) <= 20, out  # the climb was flagged, as before
    assert out.verdict == "loss/divergence" and out.open_alerts == ["loss/divergence"], out  # explosion before


def test_the_re_classification_is_off_with_explosion_diverged_points_0() -> None:
    out = _outcome("r216", explosion_diverged_points=0)
    assert out.verdict == "gradient/explosion", out


def test_clipping_never_reads_stale_on_a_loss_that_left_its_band() -> None:
    out = _outcome("r184")
    assert out.label == "loss/divergence" and out.clip == 1.0
    assert out.verdict == "loss/divergence", out
    assert "gradient/clip-stale" not in out.kinds, out  # opened beside the divergence before


def test_an_oscillation_does_not_clear_on_a_run_of_low_batches() -> None:
    out = _outcome("r641")
    assert out.label == "loss/oscillation" and out.first_nonfinite is None
    assert out.verdict == "loss/oscillation" and out.open_alerts == ["loss/oscillation"], out  # plateau before
    assert "loss/plateau" not in out.kinds, out


@pytest.mark.parametrize("run_id", ["r656", "r326"])
def test_a_non_finite_value_that_ends_an_open_divergence_is_the_explosion(run_id: str) -> None:
    out = _outcome(run_id)
    assert out.label == "gradient/explosion" and out.first_nonfinite is not None
    assert out.verdict == "gradient/explosion", out  # gradient/nan-source before
    assert out.flagged.get("as") == "loss/divergence", out  # the divergence it grew from, one incident


@pytest.mark.parametrize("run_id", ["r606", "r214", "r582"])
def test_a_loss_back_flat_at_its_start_after_an_lr_threw_it_up_is_a_plateau(run_id: str) -> None:
    out = _outcome(run_id)
    assert out.label == "loss/plateau" and out.first_nonfinite is None
    assert out.verdict == "loss/plateau" and "loss/plateau" in out.open_alerts, out  # nothing open before


def test_the_shorter_stretch_after_the_loss_moved_is_off_at_plateau_min_steps() -> None:
    assert _outcome("r606").visible_step["loss/plateau"] <= 150  # ~50 steps into the stretch
    late = _outcome("r606", plateau_moved_min_steps=100)
    assert late.visible_step.get("loss/plateau", 10**9) >= 190, late  # a full plateau_min_steps
    assert "loss/plateau" not in _outcome("r214", plateau_moved_min_steps=100).kinds


def test_an_oscillation_that_calmed_down_near_the_start_resolves_and_the_flat_loss_is_a_plateau() -> None:
    out = _outcome("r645")
    assert out.label == "loss/plateau" and out.first_nonfinite is None
    assert "loss/oscillation" in out.transient, out  # open to the end before
    assert out.verdict == "loss/plateau" and out.open_alerts == ["loss/plateau"], out


def test_the_calm_oscillation_stays_open_with_oscillation_calm_min_cv_0() -> None:
    out = _outcome("r645", oscillation_calm_min_cv=0.0)
    assert out.verdict == "loss/oscillation" and out.open_alerts == ["loss/oscillation"], out


def test_swings_on_a_level_that_climbs_cycle_after_cycle_are_a_divergence() -> None:
    out = _outcome("r684")
    assert out.label == "loss/divergence" and out.first_nonfinite is None
    assert out.verdict == "loss/divergence" and "loss/divergence" in out.open_alerts, out  # oscillation before


def test_the_climbing_swings_stay_an_oscillation_without_the_rise_bar() -> None:
    out = _outcome("r684", oscillation_max_rise=1e9)
    assert out.verdict == "loss/oscillation" and out.open_alerts == ["loss/oscillation"], out


def test_noise_on_a_level_still_falling_is_not_an_oscillation() -> None:
    out = _outcome("r709")
    assert out.label == "healthy", out
    assert "loss/oscillation" not in out.kinds and not out.open_alerts, out  # oscillation open to the end before


def test_the_falling_noise_reads_as_an_oscillation_with_oscillation_min_fall_0() -> None:
    out = _outcome("r709", oscillation_min_fall=0.0)
    assert out.open_alerts == ["loss/oscillation"], out


def test_swings_held_far_above_the_band_with_dead_units_are_a_divergence() -> None:
    out = _outcome("r717")
    assert out.label == "loss/divergence" and out.first_nonfinite is None
    assert out.verdict == "loss/divergence" and out.open_alerts == ["loss/divergence"], out  # oscillation before
    assert "loss/oscillation" in out.kinds  # the swings' first stretch stays in the history, resolved
    text = gzip.decompress((CASES / "r717.jsonl.gz").read_bytes()).decode()
    assert '"grad/layer/net.0","value":0.0}' in text  # a zero-gradient layer report: dead units


def test_swings_at_the_start_after_the_steps_killed_the_hidden_units_are_an_oscillation() -> None:
    out = _outcome("r794")
    # r794's spread is no newer than healthy noise (0.7-1.0x its early spread): the dead units are what let
    # its unshaped swings open with the shape test on -- without either gate they do not
    assert _outcome("r794", oscillation_shape_new_factor=0.0).verdict != "loss/oscillation"
    assert out.label == "loss/oscillation" and out.first_nonfinite is None
    assert out.verdict == "loss/oscillation" and "loss/plateau" not in out.kinds, out  # plateau open before
    text = gzip.decompress((CASES / "r794.jsonl.gz").read_bytes()).decode()
    first = text.index('"grad/layer/net.0","value":')
    assert not text.startswith('"grad/layer/net.0","value":0.0}', first)  # alive on the first report
    assert '"grad/layer/net.0","value":0.0}' in text  # and dead later: units the updates killed
