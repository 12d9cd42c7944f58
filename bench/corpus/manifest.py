"""The specs of the varied-training corpus and its fixed dev/test split.

Every run is a :class:`RunSpec`: a model family, an optimiser, a schedule, clipping, batch size, precision,
the framework that drives the loop (a plain loop, the real Hugging Face ``Trainer``, the real Lightning
``Trainer``) and the **planted cause** -- what was done to the training (nothing, for the healthy runs).
:func:`build` draws the specs from one master seed, so the corpus is the same on every machine; the split
is part of the spec (``split``), drawn with it, and ``manifest.json`` beside this file records every spec
as committed **before any detector was tuned on the corpus**: ``python -m bench.corpus.manifest --check``
fails when the code would draw a different corpus than the recorded one.

The label a run is scored against is not the planted cause alone: :mod:`bench.corpus.labels` reads the
run's own ground-truth trace (loss, pre-clip gradient norm, LR per step, measured beside the SDK) and says
which kind the planted cause produced, by rules written down there and independent of the detectors.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

HERE = Path(__file__).resolve().parent
MANIFEST = HERE / "manifest.json"
MASTER_SEED = 20261201
TEST_SHARE = 0.5

Kind = Tuple[str, str]

HEALTHY_CAUSES = ("healthy", "healthy_warmup_plateau", "healthy_noisy", "healthy_spike", "healthy_late_drop")
"""Healthy runs, and the hard negatives among them: a warmup that starts from (almost) zero, tiny noisy
batches, a few outlier batches whose loss spikes and recovers, a first stage at a low LR then a drop."""

CAUSES: Dict[str, Tuple[str, ...]] = {
    # planted cause -> the kinds its training can end in (labels.py picks one from the run's trace)
    "healthy": (),
    "healthy_warmup_plateau": (),
    "healthy_noisy": (),
    "healthy_spike": (),
    "healthy_late_drop": (),
    # the LR far too high: which failure it becomes depends on the model and optimiser
    "lr_explode": ("gradient/explosion", "loss/divergence", "loss/oscillation"),  # LR grows (schedule bug)
    "lr_diverge": (
        "loss/divergence",
        "gradient/explosion",
        "loss/oscillation",
        "loss/rise-after-fall",
        "loss/plateau",
    ),  # LR 100x-300x too high (Adam collapses to a flat loss)
    "warmup_too_high": (
        "loss/rise-after-fall",
        "loss/divergence",
        "gradient/explosion",
        "loss/oscillation",
        "loss/plateau",
    ),
    "oscillation": ("loss/oscillation", "loss/divergence"),  # SGD far above its stable LR, classification
    "dead_relu": ("loss/plateau",),  # hidden biases initialised very negative: every ReLU dead
    "lr_zero": ("loss/plateau",),  # a schedule that returns 0 (the optimiser steps, nothing moves)
    "vanishing": ("gradient/vanishing",),  # deep sigmoid MLP, default init
    "clip_stale": ("gradient/clip-stale",),  # SGD with max_norm ~1/100 of the gradient norm
    "nan_data": ("gradient/nan-source",),  # one corrupted sample (log(0) target / Inf input)
    "lora_dead": ("adapter/lora-grad-break",),  # frozen base, LoRA adapters that cannot learn
    # batch 5 only: an LR raised 10-100x mid-run after the loss fell (a step schedule written the wrong way
    # round, a restart at the warmup peak) -- the rise after a fall, or worse
    "lr_jump": (
        "loss/rise-after-fall",
        "loss/divergence",
        "gradient/explosion",
        "loss/oscillation",
        "loss/plateau",
    ),
    "lr_tiny": ("loss/plateau",),  # an LR 1,000-10,000x too low (a unit slip): nothing moves
}

FRAMEWORKS = ("plain", "hf", "lightning")
FAMILIES = ("mlp", "cnn", "gpt", "lora", "deep", "linear", "huber")
OPTIMIZERS = ("sgd", "sgdm", "adam", "adamw")
SCHEDULES = ("constant", "warmup_cosine", "linear", "step")

# (framework, family) pairs each cause is planted in; the optimiser choices that make the cause real
WHERE: Dict[str, Sequence[Tuple[str, str]]] = {
    "healthy": [
        ("plain", "mlp"),
        ("plain", "cnn"),
        ("plain", "gpt"),
        ("plain", "lora"),
        ("hf", "gpt"),
        ("hf", "lora"),
        ("hf", "mlp"),
        ("lightning", "mlp"),
        ("lightning", "cnn"),
        ("lightning", "gpt"),
    ],
    "lr_explode": [
        ("plain", "mlp"),
        ("plain", "mlp"),
        ("plain", "cnn"),
        ("plain", "gpt"),
        ("hf", "mlp"),
        ("lightning", "mlp"),
        ("lightning", "mlp"),
        ("lightning", "cnn"),
    ],
    "lr_diverge": [
        ("plain", "gpt"),
        ("plain", "cnn"),
        ("hf", "gpt"),
        ("hf", "lora"),
        ("lightning", "gpt"),
        ("lightning", "cnn"),
    ],
    "warmup_too_high": [
        ("plain", "mlp"),
        ("plain", "gpt"),
        ("hf", "gpt"),
        ("lightning", "mlp"),
        ("lightning", "cnn"),
    ],
    "oscillation": [("plain", "cnn"), ("plain", "linear"), ("lightning", "cnn"), ("lightning", "linear")],
    "dead_relu": [("plain", "mlp"), ("lightning", "mlp"), ("hf", "mlp")],
    "lr_zero": [("plain", "mlp"), ("plain", "cnn"), ("plain", "gpt"), ("hf", "gpt"), ("lightning", "mlp")],
    "vanishing": [("plain", "deep"), ("lightning", "deep")],
    "clip_stale": [("plain", "mlp"), ("plain", "cnn"), ("plain", "gpt"), ("lightning", "mlp"), ("hf", "mlp")],
    "nan_data": [("plain", "mlp"), ("plain", "cnn"), ("lightning", "mlp"), ("hf", "mlp")],
    "lora_dead": [("plain", "lora"), ("hf", "lora")],
}
OPTIMIZERS_FOR: Dict[str, Sequence[str]] = {
    "lr_explode": ("sgd", "sgdm"),
    "oscillation": ("sgd",),
    "clip_stale": ("sgd", "sgdm"),
    "vanishing": ("sgd", "sgdm"),
    "lr_diverge": ("adam", "adamw", "sgdm"),
}

COUNTS: Dict[str, int] = {
    "healthy": 88,
    "healthy_warmup_plateau": 18,
    "healthy_noisy": 18,
    "healthy_spike": 18,
    "healthy_late_drop": 18,
    "lr_explode": 22,
    "lr_diverge": 26,
    "warmup_too_high": 18,
    "oscillation": 14,
    "dead_relu": 12,
    "lr_zero": 10,
    "vanishing": 12,
    "clip_stale": 16,
    "nan_data": 16,
    "lora_dead": 14,
}
"""Runs per planted cause: 160 healthy (50 %) of 320."""


@dataclass(frozen=True)
class RunSpec:
    """One training of the corpus. ``lr_scale`` multiplies the family/optimiser's sane LR."""

    id: str
    split: str  # "dev" | "test"
    cause: str
    framework: str
    family: str
    optimizer: str
    schedule: str
    clip: Optional[float]
    batch: int
    bf16: bool
    steps: int
    seed: int
    lr_scale: float = 1.0
    variant: int = 0  # which way a cause is planted, where there are several (see trainings.py)

    @property
    def healthy(self) -> bool:
        return self.cause in HEALTHY_CAUSES

    def to_dict(self) -> Dict[str, object]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Dict[str, object]) -> RunSpec:
        return cls(**data)  # type: ignore[arg-type]


def _draw(
    rng: random.Random, cause: str, index: int, where: Optional[Sequence[Tuple[str, str]]] = None
) -> RunSpec:
    """One spec of ``cause``; its (framework, family) from ``where`` when given, else from :data:`WHERE`."""
    if where is None:
        where = WHERE["healthy" if cause in HEALTHY_CAUSES else cause]
    framework, family = rng.choice(list(where))
    optimizer = rng.choice(list(OPTIMIZERS_FOR.get(cause, OPTIMIZERS)))
    if family in ("gpt", "lora") and cause in HEALTHY_CAUSES:
        optimizer = rng.choice(["adam", "adamw", "adamw"])  # transformers are trained with Adam(W)
    if framework == "hf" and optimizer == "sgdm":
        optimizer = "sgd"  # Trainer's optim="sgd" has no momentum knob: plain SGD
    schedule = rng.choice(list(SCHEDULES))
    clip: Optional[float] = rng.choice([None, 1.0, 1.0, 5.0])
    if framework == "hf":
        clip = 1.0  # Trainer's default max_grad_norm
    batch = rng.choice([16, 32, 64])
    steps = rng.choice([160, 200, 240, 300])
    lr_scale = 10 ** rng.uniform(-0.3, 0.3)  # a sane LR, give or take a factor of two
    variant = rng.randrange(3)
    if cause == "healthy_noisy":
        batch = rng.choice([2, 4])
    elif cause == "healthy_late_drop":
        schedule = "late_drop"
    elif cause == "healthy_warmup_plateau":
        schedule = "delayed_warmup"
    elif cause in ("lr_diverge",):
        lr_scale = 10 ** rng.uniform(2.0, 2.5)  # 100x-300x too high
    elif cause == "warmup_too_high":
        schedule = "warmup_constant"
        lr_scale = 10 ** rng.uniform(1.5, 2.5)
    elif cause == "lr_explode":
        schedule = "exponential_up"
        steps = 600  # room to overflow: the loop's NaN guard (or nothing, in HF) ends it
    elif cause == "oscillation":
        lr_scale = 10 ** rng.uniform(1.6, 2.2)
        schedule = "constant"
    elif cause == "lr_zero":
        schedule = "zero"
    elif cause == "clip_stale":
        clip = None  # trainings.py sets max_norm from the family's typical norm / 100
        schedule = rng.choice(["constant", "linear"])
    bf16 = framework == "plain" and family in ("mlp", "cnn", "gpt") and rng.random() < 0.2
    return RunSpec(
        id=f"r{index:03d}",
        split="",
        cause=cause,
        framework=framework,
        family=family,
        optimizer=optimizer,
        schedule=schedule,
        clip=clip,
        batch=batch,
        bf16=bf16,
        steps=steps,
        seed=rng.randrange(1_000_000),
        lr_scale=round(lr_scale, 4),
        variant=variant,
    )


BATCH2_SEED = 20261203
"""The second batch (issue 16, stop 29), drawn after the first had been tuned on: its own master seed,
its causes aimed where the first batch was thin (one gradual explosion with clipping off in its test
half; the flat-loss / explosion borderlines of an LR far too high with Adam), split by the same rule
(per planted cause, half drawn into the test half) and recorded in ``manifest.json`` before any of its
runs was looked at."""

BATCH2_COUNTS: Dict[str, int] = {
    "lr_explode": 24,
    "lr_diverge": 24,
    "warmup_too_high": 8,
    "healthy_spike": 4,
    "healthy_warmup_plateau": 4,
}
"""Runs per planted cause of the second batch (64, ids r320-r383)."""

BATCH2_WHERE: Dict[str, Sequence[Tuple[str, str]]] = {
    # gradual explosions as a user without clipping meets them: the plain loop (only the SDK's sampled
    # norm, no logged grad_norm) and Lightning (gradient_clip_val=None)
    "lr_explode": [("plain", "mlp"), ("plain", "cnn"), ("plain", "gpt"), ("lightning", "mlp"),
                   ("lightning", "cnn")],
}


def _split(rng: random.Random, drawn: Sequence[RunSpec]) -> List[RunSpec]:
    """``drawn`` (the runs of one planted cause) with half of them, drawn by ``rng``, in the test half."""
    count = len(drawn)
    test = set(rng.sample(range(count), round(count * TEST_SHARE)))
    return [
        RunSpec(**{**s.to_dict(), "split": "test" if i in test else "dev"})  # type: ignore[arg-type]
        for i, s in enumerate(drawn)
    ]


def _batch2(first_index: int) -> List[RunSpec]:
    """The second batch: drawn as the first (:func:`_draw`), with clipping off for the growing-LR runs
    (their framework and family drawn from ``BATCH2_WHERE``; bf16 autocast only in the plain loop, as
    in the first batch)."""
    rng = random.Random(BATCH2_SEED)
    specs: List[RunSpec] = []
    for cause, count in BATCH2_COUNTS.items():
        drawn = []
        for i in range(count):
            spec = _draw(rng, cause, first_index + len(specs) + i)
            if cause in BATCH2_WHERE:
                framework, family = rng.choice(list(BATCH2_WHERE[cause]))
                changed = {"framework": framework, "family": family, "clip": None,
                           "bf16": spec.bf16 and framework == "plain"}
                spec = RunSpec(**{**spec.to_dict(), **changed})  # type: ignore[arg-type]
            drawn.append(spec)
        specs.extend(_split(rng, drawn))
    return specs


BATCH3_SEED = 20261204
"""The third batch (issue 16, stop 29, drawn after batch 2 had been tuned on): an LR far too high with
Adam(W) or a warmup to a too-high peak -- where a loss can stay flat at its initial level while the
gradient norm climbs (a plateau whose label is not an explosion) -- split by the same rule."""

BATCH3_COUNTS: Dict[str, int] = {"lr_diverge": 12, "warmup_too_high": 12}
"""Runs per planted cause of the third batch (24, ids r384-r407)."""


def _batch3(first_index: int) -> List[RunSpec]:
    """The third batch, drawn as the first (:func:`_draw`) from its own seed."""
    rng = random.Random(BATCH3_SEED)
    specs: List[RunSpec] = []
    for cause, count in BATCH3_COUNTS.items():
        specs.extend(_split(rng, [_draw(rng, cause, first_index + len(specs) + i) for i in range(count)]))
    return specs


BATCH4_SEED = 20261205
"""The fourth batch (issue 16, stop 29, drawn after batches 1-3 had been tuned on): HF ``Trainer`` and
Lightning runs only -- where the test half's generalisation gap was (HF category ~76 %, Lightning subtype
~77 %) -- with the planted causes that are weakest there (an LR far too high, a warmup to a too-high peak,
a growing LR) and healthy HF/Lightning runs, split per planted cause by the same rule."""

BATCH4_COUNTS: Dict[str, int] = {"lr_diverge": 12, "warmup_too_high": 12, "lr_explode": 8, "healthy": 16}
"""Runs per planted cause of the fourth batch (48, ids r408-r455)."""


def _framework_only(cause: str) -> List[Tuple[str, str]]:
    """The (framework, family) pairs :data:`WHERE` plants ``cause`` in, HF and Lightning only."""
    return [fw for fw in WHERE["healthy" if cause in HEALTHY_CAUSES else cause] if fw[0] != "plain"]


def _batch4(first_index: int) -> List[RunSpec]:
    """The fourth batch, drawn as the first (:func:`_draw`) from its own seed, HF/Lightning pairs only."""
    rng = random.Random(BATCH4_SEED)
    specs: List[RunSpec] = []
    for cause, count in BATCH4_COUNTS.items():
        where = _framework_only(cause)
        drawn = [_draw(rng, cause, first_index + len(specs) + i, where) for i in range(count)]
        specs.extend(_split(rng, drawn))
    return specs


BATCH5_SEED = 20261206
"""The fifth batch (issue 16, stop 30, drawn after batches 1-4 had been tuned on): rich in the LOSS-SHAPE
failures whose boundaries (divergence / oscillation / rise-after-fall / plateau) did not generalise from
the dev half, across the three frameworks and more optimisers and schedules than batches 1-4 had
(RMSprop and Adagrad beside SGD(+momentum) and Adam(W); OneCycle and linear warmup + linear decay beside
cosine, step and linear): an LR far too high, SGD/momentum/RMSprop far above their stable LR, a warmup or a
OneCycle to a too-high peak, an LR raised mid-run (``lr_jump``), an LR far too low (``lr_tiny``), dead
ReLUs, and healthy runs under the new optimisers and schedules (so the new material has its negatives),
split per planted cause by the same rule and recorded in ``manifest.json`` before any of its runs was
trained."""

BATCH5_COUNTS: Dict[str, int] = {
    "lr_diverge": 16,
    "oscillation": 14,
    "lr_jump": 16,
    "warmup_too_high": 10,
    "lr_tiny": 8,
    "dead_relu": 6,
    "healthy": 12,
}
"""Runs per planted cause of the fifth batch (82, ids r456-r537)."""

BATCH5_OPTIMIZERS = ("sgd", "sgdm", "adam", "adamw", "rmsprop", "adagrad")
BATCH5_SCHEDULES = ("constant", "warmup_cosine", "linear", "step", "onecycle", "warmup_linear")

BATCH5_WHERE: Dict[str, Sequence[Tuple[str, str]]] = {
    "lr_diverge": [("plain", "gpt"), ("plain", "cnn"), ("plain", "mlp"), ("hf", "gpt"), ("hf", "lora"),
                   ("lightning", "gpt"), ("lightning", "cnn"), ("lightning", "lora")],
    "oscillation": [("plain", "cnn"), ("plain", "linear"), ("plain", "mlp"), ("hf", "linear"),
                    ("lightning", "cnn"), ("lightning", "linear")],
    "lr_jump": [("plain", "mlp"), ("plain", "cnn"), ("plain", "gpt"), ("hf", "gpt"), ("hf", "mlp"),
                ("lightning", "mlp"), ("lightning", "cnn"), ("lightning", "gpt")],
    "warmup_too_high": [("plain", "mlp"), ("plain", "gpt"), ("hf", "gpt"), ("hf", "lora"),
                        ("lightning", "mlp"), ("lightning", "cnn")],
    "lr_tiny": [("plain", "mlp"), ("plain", "cnn"), ("hf", "gpt"), ("lightning", "mlp"),
                ("lightning", "cnn")],
    "dead_relu": [("plain", "mlp"), ("lightning", "mlp"), ("hf", "mlp")],
    "healthy": [("plain", "mlp"), ("plain", "cnn"), ("plain", "gpt"), ("hf", "gpt"), ("hf", "lora"),
                ("lightning", "mlp"), ("lightning", "cnn"), ("lightning", "gpt")],
}

BATCH5_OPTIMIZERS_FOR: Dict[str, Sequence[str]] = {
    "oscillation": ("sgd", "sgdm", "rmsprop"),
    "lr_diverge": ("adam", "adamw", "sgdm", "rmsprop", "adagrad"),
    "lr_jump": BATCH5_OPTIMIZERS,
}


def _batch5_spec(rng: random.Random, cause: str, index: int) -> RunSpec:
    """One spec of the fifth batch: :func:`_draw`'s, then its optimiser and schedule drawn again from
    ``rng`` among the batch's wider choices (so batches 1-4, drawn by :func:`_draw` alone, are unchanged)."""
    spec = _draw(rng, cause, index, BATCH5_WHERE[cause])
    optimizer = rng.choice(list(BATCH5_OPTIMIZERS_FOR.get(cause, BATCH5_OPTIMIZERS)))
    if spec.family in ("gpt", "lora") and cause == "healthy":
        optimizer = rng.choice(["adam", "adamw", "rmsprop"])
    schedule = rng.choice(list(BATCH5_SCHEDULES))
    lr_scale = spec.lr_scale
    if cause == "oscillation":
        schedule = "constant"
        if optimizer != "sgd":
            lr_scale = round(10 ** rng.uniform(1.0, 1.7), 4)  # momentum / RMSprop: unstable sooner
    elif cause == "warmup_too_high":
        schedule = rng.choice(["warmup_constant", "onecycle", "warmup_linear"])
    elif cause == "lr_jump":
        schedule = "jump_up"
    elif cause == "lr_tiny":
        lr_scale = round(10 ** rng.uniform(-4.0, -3.0), 8)
    changed = {"optimizer": optimizer, "schedule": schedule, "lr_scale": lr_scale}
    return RunSpec(**{**spec.to_dict(), **changed})  # type: ignore[arg-type]


def _batch5(first_index: int) -> List[RunSpec]:
    """The fifth batch (:func:`_batch5_spec`) from its own seed, split per planted cause."""
    rng = random.Random(BATCH5_SEED)
    specs: List[RunSpec] = []
    for cause, count in BATCH5_COUNTS.items():
        drawn = [_batch5_spec(rng, cause, first_index + len(specs) + i) for i in range(count)]
        specs.extend(_split(rng, drawn))
    return specs


BATCH6_SEED = 20261207
"""The sixth batch (issue 16, stop 31, drawn after batches 1-5 had been tuned on): the planted causes whose
loss-shape labels (oscillation, plateau) ended with no incident at all on the test half at stop 30 --
the biggest category loss -- and on the dev half came from an LR raised mid-run (dev r494: swings at a
level the run had learned down to) and a warmup / OneCycle to a too-high peak (dev r506: a LoRA LM flat a
little under its random-init start), with an LR far too low, SGD far above its stable LR and an LR far
too high beside them, and healthy runs (the negatives a looser plateau or oscillation rule would alarm
on). Drawn as the fifth batch (:func:`_batch5_spec`, its frameworks, optimisers and schedules) from its own
seed, split per planted cause by the same rule, recorded in ``manifest.json`` before any of its runs was
trained."""

BATCH6_COUNTS: Dict[str, int] = {
    "lr_jump": 16,
    "warmup_too_high": 14,
    "lr_tiny": 6,
    "oscillation": 8,
    "lr_diverge": 8,
    "healthy": 12,
}
"""Runs per planted cause of the sixth batch (64, ids r538-r601)."""


def _batch6(first_index: int) -> List[RunSpec]:
    """The sixth batch (:func:`_batch5_spec`) from its own seed, split per planted cause."""
    rng = random.Random(BATCH6_SEED)
    specs: List[RunSpec] = []
    for cause, count in BATCH6_COUNTS.items():
        drawn = [_batch5_spec(rng, cause, first_index + len(specs) + i) for i in range(count)]
        specs.extend(_split(rng, drawn))
    return specs


BATCH7_SEED = 20261208
"""The seventh batch (issue 16, stop 32, drawn after batches 1-6 had been tuned on): **dev only** -- material
to study where detection gets the category right and the SUBTYPE wrong (divergence / explosion /
oscillation / plateau / rise-after-fall borderlines) on trainings unlike those tuned on so far: optimisers no
earlier batch had (NAdam, RAdam, Adamax, SGD with Nesterov momentum) beside the old ones, schedules no earlier
batch had (SGDR cosine restarts, inverse-sqrt with warmup, polynomial and exponential decay) beside cosine /
OneCycle / step, (framework, family) pairs no earlier batch had (HF Trainer on the CNN and the MLP with an LR
far too high, Lightning on LoRA for healthy runs, bf16 autocast under Lightning too). Every run's ``split``
is ``"dev"``: the test half stays the one fixed before tuning (batches 1-6), so its figures measure
generalisation to trainings of a kind this batch added to dev and it never saw. Drawn from its own seed;
recorded in ``manifest.json`` before any of its runs was trained."""

BATCH7_COUNTS: Dict[str, int] = {
    "lr_diverge": 14,
    "oscillation": 12,
    "lr_jump": 10,
    "warmup_too_high": 12,
    "lr_explode": 8,
    "lr_tiny": 4,
    "healthy": 12,
    "healthy_noisy": 4,
}
"""Runs per planted cause of the seventh batch (76, ids r602-r677, all dev)."""

BATCH7_OPTIMIZERS = ("sgd", "sgdm", "nesterov", "adam", "adamw", "nadam", "radam", "adamax", "rmsprop")
BATCH7_SCHEDULES = ("constant", "warmup_cosine", "cosine_restarts", "inverse_sqrt", "polynomial", "exp_decay",
                    "onecycle", "step")

BATCH7_WHERE: Dict[str, Sequence[Tuple[str, str]]] = {
    "lr_diverge": [("plain", "gpt"), ("plain", "cnn"), ("plain", "mlp"), ("hf", "gpt"), ("hf", "lora"),
                   ("hf", "mlp"), ("hf", "cnn"), ("lightning", "gpt"), ("lightning", "cnn"),
                   ("lightning", "mlp")],
    "oscillation": [("plain", "cnn"), ("plain", "linear"), ("plain", "mlp"), ("hf", "linear"), ("hf", "cnn"),
                    ("lightning", "cnn"), ("lightning", "linear")],
    "lr_jump": BATCH5_WHERE["lr_jump"],
    "warmup_too_high": [("plain", "mlp"), ("plain", "gpt"), ("plain", "cnn"), ("hf", "gpt"), ("hf", "lora"),
                        ("lightning", "mlp"), ("lightning", "cnn"), ("lightning", "gpt")],
    "lr_explode": [("plain", "mlp"), ("plain", "cnn"), ("plain", "gpt"), ("hf", "mlp"), ("lightning", "mlp"),
                   ("lightning", "cnn")],
    "lr_tiny": BATCH5_WHERE["lr_tiny"],
    "healthy": [("plain", "mlp"), ("plain", "cnn"), ("plain", "gpt"), ("plain", "linear"), ("hf", "gpt"),
                ("hf", "cnn"), ("lightning", "mlp"), ("lightning", "lora"), ("lightning", "gpt")],
    "healthy_noisy": [("plain", "mlp"), ("plain", "cnn"), ("lightning", "mlp"), ("hf", "mlp")],
}

BATCH7_OPTIMIZERS_FOR: Dict[str, Sequence[str]] = {
    "oscillation": ("sgd", "sgdm", "nesterov", "rmsprop"),
    "lr_diverge": ("adam", "adamw", "nadam", "radam", "adamax", "sgdm", "nesterov", "rmsprop"),
    "lr_explode": ("sgd", "sgdm", "nesterov"),
}


def _batch7_spec(rng: random.Random, cause: str, index: int) -> RunSpec:
    """One spec of the seventh batch: :func:`_draw`'s, then its optimiser, schedule and precision drawn
    again from ``rng`` among the batch's choices; ``split`` is ``"dev"``."""
    spec = _draw(rng, cause, index, BATCH7_WHERE[cause])
    optimizer = rng.choice(list(BATCH7_OPTIMIZERS_FOR.get(cause, BATCH7_OPTIMIZERS)))
    if spec.family in ("gpt", "lora") and cause in HEALTHY_CAUSES:
        optimizer = rng.choice(["adam", "adamw", "nadam", "radam", "adamax"])
    if spec.framework == "hf" and optimizer in ("sgdm", "nesterov"):
        optimizer = "sgd"  # as _draw: the HF runs' SGD has no momentum
    schedule = rng.choice(list(BATCH7_SCHEDULES))
    lr_scale = spec.lr_scale
    if cause == "oscillation":
        schedule = "constant"
        if optimizer != "sgd":
            lr_scale = round(10 ** rng.uniform(1.0, 1.7), 4)  # momentum / RMSprop: unstable sooner
    elif cause == "warmup_too_high":
        schedule = rng.choice(
            ["warmup_constant", "onecycle", "warmup_linear", "inverse_sqrt", "warmup_cosine"]
        )
    elif cause == "lr_jump":
        schedule = "jump_up"
    elif cause == "lr_explode":
        schedule = "exponential_up"
    elif cause == "lr_tiny":
        lr_scale = round(10 ** rng.uniform(-4.0, -3.0), 8)
    bf16 = (spec.framework in ("plain", "lightning") and spec.family in ("mlp", "cnn", "gpt")
            and rng.random() < 0.2)
    changed = {"optimizer": optimizer, "schedule": schedule, "lr_scale": lr_scale, "bf16": bf16,
               "split": "dev"}
    return RunSpec(**{**spec.to_dict(), **changed})  # type: ignore[arg-type]


def _batch7(first_index: int) -> List[RunSpec]:
    """The seventh batch (:func:`_batch7_spec`) from its own seed: every run in the dev half."""
    rng = random.Random(BATCH7_SEED)
    specs: List[RunSpec] = []
    for cause, count in BATCH7_COUNTS.items():
        specs.extend([_batch7_spec(rng, cause, first_index + len(specs) + i) for i in range(count)])
    return specs


BATCH8_SEED = 20261209
"""The eighth batch (issue 16, stop 33, drawn after batches 1-7 had been tuned on): **dev only** -- trainings
that OSCILLATE in ways the dev half lacked (the test half's weakest subtype was oscillation, 11/17, while dev
had almost only plain SGD far above its stable LR on a classifier, 24/25 right): an LR too high by different
degrees for SGD, SGD-momentum, SGD-Nesterov, RMSprop, Adam and AdamW; cyclic (triangular) LR and SGDR warm
restarts whose peaks are too high; step decay from a too-high LR; tiny batches (2-8) with a high LR; every
family but the deep sigmoid MLP and LoRA; plus near-miss healthy runs (noisy tiny batches, cyclic LR and warm
restarts at a sane peak) that swing but converge. Every run's ``split`` is ``"dev"``: the test half stays the
one fixed before tuning (batches 1-6). Drawn from its own seed; recorded in ``manifest.json`` before any of
its runs was trained."""

BATCH8_COUNTS: Dict[str, int] = {"oscillation": 28, "healthy_noisy": 5, "healthy": 5}
"""Runs per planted cause of the eighth batch (38, ids r678-r715, all dev)."""

BATCH8_WHERE: Dict[str, Sequence[Tuple[str, str]]] = {
    "oscillation": [("plain", "cnn"), ("plain", "linear"), ("plain", "mlp"), ("plain", "gpt"),
                    ("hf", "linear"), ("hf", "cnn"), ("hf", "mlp"), ("lightning", "cnn"),
                    ("lightning", "linear"), ("lightning", "mlp"), ("lightning", "gpt")],
    "healthy_noisy": [("plain", "mlp"), ("plain", "cnn"), ("plain", "linear"), ("lightning", "cnn"),
                      ("hf", "linear")],
    "healthy": [("plain", "cnn"), ("plain", "linear"), ("plain", "mlp"), ("lightning", "mlp"), ("hf", "cnn")],
}

BATCH8_OPTIMIZERS = ("sgd", "sgdm", "nesterov", "rmsprop", "adam", "adamw")
BATCH8_OSC_SCHEDULES = ("constant", "constant", "cyclic", "cosine_restarts", "step")
BATCH8_HEALTHY_SCHEDULES = ("constant", "cyclic", "cosine_restarts", "warmup_cosine")
BATCH8_OSC_SCALE: Dict[str, Tuple[float, float]] = {
    "sgd": (1.2, 2.2), "sgdm": (0.8, 1.7), "nesterov": (0.8, 1.7), "rmsprop": (0.8, 1.8),
    "adam": (1.0, 2.0), "adamw": (1.0, 2.0),
}
"""log10 of ``lr_scale`` per optimiser for the oscillation runs: from "somewhat" to "far" too high
(momentum and RMSprop go unstable at a lower multiple than plain SGD)."""


def _batch8_spec(rng: random.Random, cause: str, index: int) -> RunSpec:
    """One spec of the eighth batch: :func:`_draw`'s, then its optimiser, schedule, batch and LR drawn again
    from ``rng`` among the batch's choices; ``split`` is ``"dev"``."""
    spec = _draw(rng, cause, index, BATCH8_WHERE[cause])
    optimizer = rng.choice(list(BATCH8_OPTIMIZERS))
    if spec.framework == "hf" and optimizer in ("sgdm", "nesterov"):
        optimizer = "sgd"  # as _draw: the HF runs' SGD has no momentum
    lr_scale, batch = spec.lr_scale, spec.batch
    if cause == "oscillation":
        schedule = rng.choice(list(BATCH8_OSC_SCHEDULES))
        low, high = BATCH8_OSC_SCALE[optimizer]
        lr_scale = round(10 ** rng.uniform(low, high), 4)
        batch = rng.choice([2, 4, 8, 16, 32, 64])
    else:
        schedule = rng.choice(list(BATCH8_HEALTHY_SCHEDULES))
        if cause == "healthy":
            batch = rng.choice([8, 16, 32])
    bf16 = spec.framework in ("plain", "lightning") and spec.family in ("mlp", "cnn") and rng.random() < 0.15
    changed = {"optimizer": optimizer, "schedule": schedule, "lr_scale": lr_scale, "batch": batch,
               "bf16": bf16, "split": "dev"}
    return RunSpec(**{**spec.to_dict(), **changed})  # type: ignore[arg-type]


def _batch8(first_index: int) -> List[RunSpec]:
    """The eighth batch (:func:`_batch8_spec`) from its own seed: every run in the dev half."""
    rng = random.Random(BATCH8_SEED)
    specs: List[RunSpec] = []
    for cause, count in BATCH8_COUNTS.items():
        specs.extend([_batch8_spec(rng, cause, first_index + len(specs) + i) for i in range(count)])
    return specs


BATCH9_SEED = 20261210
"""The ninth batch (issue 16, stop 33, round 3; drawn after batches 1-8 had been tuned on): **dev only** --
an LR high enough that the task does NOT learn yet does not blow up, the dev material batch 8 lacked (17 of
its 28 'oscillation' runs learned anyway at 7-100x the sane LR): the harder tasks weighted (the GPT configs,
the CNN), plain SGD, SGD-momentum, Nesterov, RMSprop, Adam and AdamW at higher degrees than batch 8, constant
and cyclic schedules, no clipping and clipping at 1 or 5 (the HF Trainer's is 1). Every run's ``split`` is
``"dev"``: the test half stays the one fixed before tuning (batches 1-6). Drawn from its own seed; recorded
in ``manifest.json`` before any of its runs was trained."""

BATCH9_COUNT = 30
"""Planted 'oscillation' runs of the ninth batch (ids r716-r745, all dev)."""

BATCH9_WHERE: Sequence[Tuple[str, str]] = [
    ("plain", "gpt"), ("plain", "gpt"), ("lightning", "gpt"), ("lightning", "gpt"), ("plain", "cnn"),
    ("lightning", "cnn"), ("hf", "cnn"), ("plain", "mlp"), ("hf", "mlp"), ("plain", "linear"),
]
BATCH9_OPTIMIZERS = ("sgd", "sgdm", "nesterov", "rmsprop", "adam", "adamw")
BATCH9_SCHEDULES = ("constant", "constant", "cyclic")
BATCH9_SCALE: Dict[str, Tuple[float, float]] = {
    "sgd": (1.8, 2.6), "sgdm": (1.4, 2.2), "nesterov": (1.4, 2.2), "rmsprop": (1.2, 2.0),
    "adam": (1.6, 2.4), "adamw": (1.6, 2.4),
}
"""log10 of ``lr_scale`` per optimiser: about 0.5 above batch 8's range (whose low end still learned)."""


def _batch9_spec(rng: random.Random, index: int) -> RunSpec:
    """One spec of the ninth batch: :func:`_draw`'s 'oscillation' spec, then its optimiser, schedule, LR,
    clipping and batch drawn again from ``rng`` among the batch's choices; ``split`` is ``"dev"``."""
    spec = _draw(rng, "oscillation", index, BATCH9_WHERE)
    optimizer = rng.choice(list(BATCH9_OPTIMIZERS))
    if spec.framework == "hf" and optimizer in ("sgdm", "nesterov"):
        optimizer = "sgd"  # as _draw: the HF runs' SGD has no momentum
    low, high = BATCH9_SCALE[optimizer]
    clip: Optional[float] = 1.0 if spec.framework == "hf" else rng.choice([None, None, 1.0, 5.0])
    changed = {"optimizer": optimizer, "schedule": rng.choice(list(BATCH9_SCHEDULES)),
               "lr_scale": round(10 ** rng.uniform(low, high), 4), "clip": clip,
               "batch": rng.choice([8, 16, 32, 64]), "bf16": False, "split": "dev"}
    return RunSpec(**{**spec.to_dict(), **changed})  # type: ignore[arg-type]


def _batch9(first_index: int) -> List[RunSpec]:
    """The ninth batch (:func:`_batch9_spec`) from its own seed: every run in the dev half."""
    rng = random.Random(BATCH9_SEED)
    return [_batch9_spec(rng, first_index + i) for i in range(BATCH9_COUNT)]


BATCH10_SEED = 20261211
"""The tenth batch (issue 16, stop 33, round 4; drawn after batches 1-9 had been tuned on): **dev only** --
runs that learn first and then swing: a mid-run LR jump of only 3-10x (``jump_mid``, at 35/45/55 % of the
run) after the loss has fallen, or SGDR warm restarts / a cyclic LR whose peak is 3-10x too high, for several
models and optimisers, clipping on and off; plus healthy runs whose mid-run jump is mild (1.5-2x). Every
run's ``split`` is ``"dev"``: the test half stays the one fixed before tuning (batches 1-6). Drawn from its
own seed; recorded in ``manifest.json`` before any of its runs was trained."""

BATCH10_COUNTS: Dict[str, int] = {"lr_jump": 24, "healthy": 6}
"""Runs per planted cause of the tenth batch (30, ids r746-r775, all dev)."""

BATCH10_WHERE: Sequence[Tuple[str, str]] = [
    ("plain", "mlp"), ("plain", "cnn"), ("plain", "gpt"), ("plain", "linear"), ("hf", "mlp"), ("hf", "gpt"),
    ("hf", "linear"), ("lightning", "mlp"), ("lightning", "cnn"), ("lightning", "gpt"),
]
BATCH10_OPTIMIZERS = ("sgd", "sgdm", "nesterov", "rmsprop", "adam", "adamw")
BATCH10_JUMP_SCHEDULES = ("jump_mid", "jump_mid", "jump_mid", "cosine_restarts", "cyclic")


def _batch10_spec(rng: random.Random, cause: str, index: int) -> RunSpec:
    """One spec of the tenth batch: :func:`_draw`'s, then its optimiser, schedule, LR, variant, clipping and
    batch drawn again from ``rng``. ``lr_jump``: ``jump_mid`` x3/5/10 from a sane LR, or restarts / cyclic
    with a peak 10^0.5-10^1 too high; ``healthy``: ``jump_mid`` x1.5/2 from a sane LR. ``split`` is dev."""
    spec = _draw(rng, cause, index, BATCH10_WHERE)
    optimizer = rng.choice(list(BATCH10_OPTIMIZERS))
    if spec.framework == "hf" and optimizer in ("sgdm", "nesterov"):
        optimizer = "sgd"  # as _draw: the HF runs' SGD has no momentum
    if spec.family == "gpt" and cause == "healthy":
        optimizer = rng.choice(["adam", "adamw"])
    lr_scale = round(10 ** rng.uniform(-0.2, 0.2), 4)
    where = rng.randrange(3)
    if cause == "lr_jump":
        schedule = rng.choice(list(BATCH10_JUMP_SCHEDULES))
        variant = 5 * where + rng.randrange(3)  # x3, x5 or x10
        if schedule != "jump_mid":
            lr_scale = round(10 ** rng.uniform(0.5, 1.0), 4)
            variant = rng.randrange(3)
    else:
        schedule, variant = "jump_mid", 5 * where + 3 + rng.randrange(2)  # x1.5 or x2
    clip: Optional[float] = 1.0 if spec.framework == "hf" else rng.choice([None, None, 1.0, 5.0])
    changed = {"optimizer": optimizer, "schedule": schedule, "lr_scale": lr_scale, "variant": variant,
               "clip": clip, "batch": rng.choice([16, 32, 64]), "bf16": False, "split": "dev"}
    return RunSpec(**{**spec.to_dict(), **changed})  # type: ignore[arg-type]


def _batch10(first_index: int) -> List[RunSpec]:
    """The tenth batch (:func:`_batch10_spec`) from its own seed: every run in the dev half."""
    rng = random.Random(BATCH10_SEED)
    specs: List[RunSpec] = []
    for cause, count in BATCH10_COUNTS.items():
        specs.extend([_batch10_spec(rng, cause, first_index + len(specs) + i) for i in range(count)])
    return specs


BATCH11_SEED = 20261212
"""The eleventh batch (issue 16, stop 34; drawn after batches 1-10 had been tuned on): **dev only** -- a
harder task family, ``huber`` (trainings.py: the MLP teacher with heavy-tailed label noise and a Huber
loss, whose bounded gradient leaves a wide LR band where the loss stops learning but does not blow up;
checked with throwaway local runs before this batch was drawn: SGD ~10^1.75-10^2.25, SGD-momentum / Nesterov
~10^1.9-10^2.5, Adam(W) ~10^2.0-10^2.6 x the sane LR swing around the start under constant, cyclic, SGDR and
warmup-to-a-constant schedules, while at the sane LR every optimiser learns to 0.25-0.55 x its start). Planted
'oscillation' runs in that band (constant / cyclic / SGDR), 'warmup_too_high' runs (a warmup to a peak in
that band: the loss first falls, then swings back up), and healthy runs of the family at a sane LR; plain,
HF and Lightning, clipping off or at 1 / 5 (the HF Trainer's is 1). Every run's ``split`` is ``"dev"``:
the test half stays the one fixed before tuning (batches 1-6). Drawn from its own seed; recorded in
``manifest.json`` before any of its runs was trained."""

BATCH11_COUNTS: Dict[str, int] = {"oscillation": 24, "warmup_too_high": 8, "healthy": 6}
"""Runs per planted cause of the eleventh batch (38, ids r776-r813, all dev)."""

BATCH11_WHERE: Sequence[Tuple[str, str]] = [
    ("plain", "huber"), ("plain", "huber"), ("hf", "huber"), ("lightning", "huber"), ("lightning", "huber"),
]
BATCH11_OPTIMIZERS = ("sgd", "sgdm", "nesterov", "sgdm", "nesterov", "adam", "adamw", "rmsprop")
BATCH11_OSC_SCHEDULES = ("constant", "constant", "cyclic", "cosine_restarts")
BATCH11_HEALTHY_SCHEDULES = ("constant", "warmup_cosine", "cosine_restarts", "cyclic", "linear")
BATCH11_SCALE: Dict[str, Tuple[float, float]] = {
    "sgd": (1.75, 2.25), "sgdm": (1.9, 2.5), "nesterov": (1.9, 2.5), "rmsprop": (2.0, 2.5),
    "adam": (2.0, 2.6), "adamw": (2.0, 2.6),
}
"""log10 of ``lr_scale`` per optimiser for the planted runs: the band the throwaway runs showed."""


def _batch11_spec(rng: random.Random, cause: str, index: int) -> RunSpec:
    """One spec of the eleventh batch: :func:`_draw`'s, then its optimiser, schedule, LR, clipping and batch
    drawn again from ``rng`` among the batch's choices; ``split`` is ``"dev"``."""
    spec = _draw(rng, cause, index, BATCH11_WHERE)
    optimizer = rng.choice(list(BATCH11_OPTIMIZERS))
    if spec.framework == "hf" and optimizer in ("sgdm", "nesterov"):
        optimizer = "sgd"  # as _draw: the HF runs' SGD has no momentum
    if cause == "healthy":
        schedule = rng.choice(list(BATCH11_HEALTHY_SCHEDULES))
        lr_scale = round(10 ** rng.uniform(-0.2, 0.2), 4)
    else:
        warmup = cause == "warmup_too_high"
        schedule = "warmup_constant" if warmup else rng.choice(list(BATCH11_OSC_SCHEDULES))
        low, high = BATCH11_SCALE[optimizer]
        lr_scale = round(10 ** rng.uniform(low, high), 4)
    clip: Optional[float] = 1.0 if spec.framework == "hf" else rng.choice([None, None, 1.0, 5.0])
    changed = {"optimizer": optimizer, "schedule": schedule, "lr_scale": lr_scale, "clip": clip,
               "batch": rng.choice([16, 32, 64]), "bf16": False, "split": "dev"}
    return RunSpec(**{**spec.to_dict(), **changed})  # type: ignore[arg-type]


def _batch11(first_index: int) -> List[RunSpec]:
    """The eleventh batch (:func:`_batch11_spec`) from its own seed: every run in the dev half."""
    rng = random.Random(BATCH11_SEED)
    specs: List[RunSpec] = []
    for cause, count in BATCH11_COUNTS.items():
        specs.extend([_batch11_spec(rng, cause, first_index + len(specs) + i) for i in range(count)])
    return specs


def build(master_seed: int = MASTER_SEED) -> List[RunSpec]:
    """Every spec of the corpus, split into dev and test per planted cause (half each, drawn): the first
    batch (320 runs from ``master_seed``), then the second (:func:`_batch2`), the third (:func:`_batch3`),
    the fourth (:func:`_batch4`), the fifth (:func:`_batch5`), the sixth (:func:`_batch6`), the seventh
    (:func:`_batch7`, dev only), the eighth (:func:`_batch8`, dev only), the ninth (:func:`_batch9`, dev
    only), the tenth (:func:`_batch10`, dev only) and the eleventh (:func:`_batch11`, dev only)."""
    rng = random.Random(master_seed)
    specs: List[RunSpec] = []
    for cause, count in COUNTS.items():
        specs.extend(_split(rng, [_draw(rng, cause, len(specs) + i) for i in range(count)]))
    specs += _batch2(len(specs))
    specs += _batch3(len(specs))
    specs += _batch4(len(specs))
    specs += _batch5(len(specs))
    specs += _batch6(len(specs))
    specs += _batch7(len(specs))
    specs += _batch8(len(specs))
    specs += _batch9(len(specs))
    specs += _batch10(len(specs))
    return specs + _batch11(len(specs))


def load(path: Path = MANIFEST) -> List[RunSpec]:
    """The recorded corpus (``manifest.json``)."""
    with open(path, encoding="utf-8") as fh:
        return [RunSpec.from_dict(item) for item in json.load(fh)["runs"]]


def write(specs: Sequence[RunSpec], path: Path = MANIFEST) -> None:
    doc = {
        "master_seed": MASTER_SEED,
        "note": "fixed before tuning; the test half is never tuned on",
        "runs": [s.to_dict() for s in specs],
    }
    path.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--write", action="store_true", help="(re)write manifest.json (only before tuning!)")
    parser.add_argument("--check", action="store_true", help="fail when the code draws another corpus")
    args = parser.parse_args(argv)
    specs = build()
    if args.write:
        write(specs)
    if args.check and [s.to_dict() for s in load()] != [s.to_dict() for s in specs]:
        print("manifest.json differs from what manifest.py draws", file=sys.stderr)
        return 1
    by = {(s.split, s.healthy) for s in specs}
    print(
        f"{len(specs)} runs; "
        + ", ".join(
            f"{split} {'healthy' if h else 'anomalous'}: "
            f"{sum(1 for s in specs if s.split == split and s.healthy == h)}"
            for split, h in sorted(by)
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
