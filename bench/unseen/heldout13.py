#!/usr/bin/env python3
"""Stop 49's HELD-OUT set of unseen training shapes (set ``heldout49``): written and committed, with its
expectations, seeds, per-fault manifestation checks and scoring, BEFORE any of it ran (a 3-step smoke at most:
TRAINGUARD_SMOKE_STEPS=3, only its recorded / FAILED lines read); recorded once (nice 19, --jobs 2); judged
once with the default ``DetectionSettings()``, summary lines only. Never tuned on.

Scoring (decided here, before recording). Healthy: no WARNING+ incident open at the end (probe.py's rule).
Faults: each planted fault has its own manifestation check (:data:`MANIFEST`), a rule on the recorded trace
(the ``loss`` the run reported and the SDK's ``grad/global_norm``, each in step order), independent of
TrainGuard's verdict. A fault is scored only when its check holds; it is right when one of its expected kinds
is among its incidents (open or resolved) and, as in probe.py, it does not end learned with an alarm still
open. ``python -m bench.unseen.heldout13 --out DIR`` prints these summary lines (healthy right/N, faults
right/scored, manifested/planted); ``python -m bench.unseen.probe --set heldout49 --rejudge`` gives probe.py's
trace-rule scoring beside it (heldout49 in ``sets.JUMP_RULE``), a secondary figure.

The checks: ``rose(onset)`` -- some loss at or after step index ``onset`` is non-finite or >= 2x the best
(lowest) median of 10 consecutive losses before it; ``non_finite(onset)`` -- a non-finite loss or grad norm at
or after ``onset``; ``grad_rose`` -- a non-finite loss / grad norm, or a grad norm >= 10x the median of the
first 10; ``stalled(onset)`` -- the median of the last 20 losses >= 0.9x the median of the 20 from ``onset``.

Expectations, from the catalogue's kinds: corrupted labels and an LR x100 at a step -> the 'LR too high'
family or a rise after the fall (or a one-step spike); a diverging schedule -> the same; Inf input / fp16
overflow -> ``loss/non_finite|gradient/nan-source`` (plus ``gradient/explosion`` for the overflow);
exploding gradients -> ``gradient/explosion|loss/divergence|loss/non_finite``; LR 0 mid-run (frozen) ->
``loss/plateau|gradient/vanishing``.

16 shapes, 8 healthy / 8 planted faults. New to every earlier set (bench/unseen/*.py grepped): focal loss on
imbalanced classes, Adagrad with lr_decay and an initial accumulator, a GAN pair (Adamax, betas 0.5), LBFGS
with a strong-Wolfe line search, a weight-tied (looped) deep linear net, pure fp16 training, AdamW with a
weight-decay schedule, SequentialLR(LinearLR warm-up, ExponentialLR), OneCycle three-phase, HF polynomial
power 0.5 with lr_end; HF BERT masked-LM, HF ConvNeXt; peft LoKr on a pre-trained tiny GPT-J; Lightning with
a custom weight-EMA callback (its depthwise-separable conv net is not new: heldout36 had a depthwise CNN).
Fault types used before, here in new models / frameworks: an LR schedule that drops to 0 (heldout42),
corrupted batches (heldout42, heldout47), NaN input (several sets).

* plain loops: tiny conv net (no normalisation), focal loss gamma 2 on 5 imbalanced classes, Adagrad
  (healthy; and labels drawn at random from step 120); Transformer encoder classifier, AdamW with a
  cosine-ramped weight decay, SequentialLR(LinearLR 25 steps, ExponentialLR 0.995) (healthy; and the
  ExponentialLR gamma typed 1.05: a diverging schedule); a GAN on a ring of 8 Gaussians, Adamax (healthy; and
  an Inf row in the real batch from step 150); LBFGS full batch (healthy); one 16x16 linear map applied 30
  times (weight-tied, no nonlinearity) learning y = 3x, SGD with a linear warm-up to an LR past the stable
  one, no clipping (exploding gradients); a pure fp16 MLP regressor, no GradScaler, targets unnormalised
  (x1000) from step 150 (fp16 overflow);
* the HF Trainer: BERT masked-LM on arithmetic sequences, polynomial power 0.5 (healthy; and the LR x100 from
  step 100: a callback scales the scheduler's base LRs); ConvNeXt on noisy prototype images (healthy);
* peft: LoKr on a pre-trained tiny GPT-J, HF Trainer (healthy; and labels drawn at random from step 100);
* Lightning: a depthwise-separable conv net, SGD nesterov, OneCycle three-phase, a weight-EMA callback
  (healthy; and a step-decay LambdaLR with its factor typed 0 instead of 0.1: LR 0 from step 25, frozen).

Every shape is seeded: ``torch.manual_seed(0)`` (bench.unseen.shapes.main) and the data seeds below (59_000+:
none used by another set).
"""

from __future__ import annotations

import argparse
import math
import statistics
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from bench.unseen.sets import HEALTHY, LR_TOO_HIGH, Expectations

RISE = LR_TOO_HIGH + "|loss/rise-after-fall|loss/spike"
"""A run hit mid-way (corrupted labels, an LR x100, a diverging schedule): the LR-too-high family, a rise
after the fall, or a one-step spike."""
NAN = "loss/non_finite|gradient/nan-source"
OVERFLOW = NAN + "|gradient/explosion"
EXPLODE = "gradient/explosion|loss/divergence|loss/non_finite"
FROZEN = "loss/plateau|gradient/vanishing"

SHAPES: Expectations = {
    # plain loops
    "ho17_plain_focal_cnn_adagrad_ok": (
        HEALTHY,
        "tiny conv net (no normalisation) on noisy 10x10 prototype images, 5 classes drawn 40/25/15/12/8 %, "
        "focal loss gamma 2, Adagrad 0.05 lr_decay 1e-3 initial accumulator 0.1, batch 32, 250 steps",
    ),
    "ho17_plain_focal_cnn_labels_random": (RISE, "the same, labels drawn at random from step 120 on"),
    "ho17_plain_enc_wd_seqlr_ok": (
        HEALTHY,
        "Transformer encoder classifier (4 classes, 2 layers, 48 wide), AdamW 2e-3 with weight decay ramped "
        "0 -> 0.05 (cosine), SequentialLR(LinearLR 0.1 -> 1 over 25, ExponentialLR 0.995), batch 32, "
        "250 steps",
    ),
    "ho17_plain_enc_exp_typo": (RISE, "the same, the ExponentialLR gamma typed 1.05: the LR keeps growing"),
    "ho17_plain_gan_adamax_ok": (
        HEALTHY,
        "GAN (MLP G and D, LeakyReLU) on a ring of 8 Gaussians, Adamax 1e-3 betas (0.5, 0.999) for both, "
        "the discriminator's loss reported as loss, batch 64, 300 steps",
    ),
    "ho17_plain_gan_inf_batch": (NAN, "the same, one row of the real batch +Inf from step 150"),
    "ho17_plain_lbfgs_wolfe_ok": (
        HEALTHY,
        "tanh MLP regressor on one fixed batch of 256 rows, LBFGS (history 10, 10 iterations a step, "
        "strong Wolfe), 80 steps",
    ),
    "ho17_plain_looped_explode": (
        EXPLODE,
        "one 16x16 linear map (orthogonal init) applied 30 times, learning y = 3x, SGD 0.02 after a linear "
        "warm-up from 0.05 % over 200 steps (the stable LR ~2e-3 at the solution, a rough estimate), no "
        "clipping, batch 32, 250 steps",
    ),
    "ho17_plain_fp16_overflow": (
        OVERFLOW,
        "pure fp16 MLP regressor (model.half(), fp16 loss), SGD 0.01 momentum 0.9, no GradScaler; from step "
        "150 the targets arrive unnormalised (x1000): the squared error overflows fp16",
    ),
    # HF Trainer
    "ho17_hf_bert_mlm_poly05_ok": (
        HEALTHY,
        "HF Trainer, BERT masked-LM (2 layers, 48 wide, 15 % masked) on arithmetic sequences, adamw_torch "
        "2e-3, polynomial power 0.5 lr_end 1e-5 (warmup 15), batch 16, log 1, 200 steps",
    ),
    "ho17_hf_bert_mlm_lr100x_at100": (RISE, "the same, a callback multiplies the LR by 100 at step 100"),
    "ho17_hf_convnext_ok": (
        HEALTHY,
        "HF Trainer, ConvNeXt (2 stages 16/32, patch 2) on noisy 16x16 prototype images (6 classes), "
        "adamw_torch 2e-3, cosine (warmup 15), batch 32, log 1, 150 steps",
    ),
    # peft
    "ho17_lokr_gptj_ok": (
        HEALTHY,
        "peft LoKr (r 4, q_proj/v_proj) on a pre-trained tiny GPT-J fine-tuned on new strides, HF Trainer "
        "adamw_torch 5e-3, linear (warmup 10), batch 8, log 1, 200 steps",
    ),
    "ho17_lokr_gptj_labels_random": (RISE, "the same, labels random tokens from step 100 on"),
    # Lightning
    "ho17_pl_dwconv_ema_ok": (
        HEALTHY,
        "Lightning, depthwise-separable conv net (BatchNorm) on noisy 12x12 prototype images (6 classes), "
        "SGD 0.05 nesterov momentum 0.9 wd 1e-4, OneCycleLR three_phase (max 0.1), a weight-EMA callback, "
        "clip 1, batch 32, 250 steps",
    ),
    "ho17_pl_dwconv_frozen": (
        FROZEN,
        "the same net and optimiser, LambdaLR step decay typed 0 ** (step // 25) for 0.1 ** ...: LR 0 from "
        "step 25",
    ),
}

# ------------------------------------------------------------------------- manifestation checks


Trace = Sequence[float]
Check = Callable[[Trace, Trace], bool]


def _bad(x: float) -> bool:
    return not math.isfinite(x)


def rose(onset: int, factor: float = 2.0, window: int = 10) -> Check:
    """Some loss at index >= ``onset`` is non-finite or >= ``factor`` x the lowest median of ``window``
    consecutive losses before it."""

    def check(loss: Trace, _: Trace) -> bool:
        best = math.inf
        for j in range(len(loss)):
            if j >= window and all(map(math.isfinite, loss[j - window : j])):
                best = min(best, statistics.median(loss[j - window : j]))
            if j >= onset and (_bad(loss[j]) or loss[j] >= factor * best):
                return True
        return False

    return check


def non_finite(onset: int) -> Check:
    """A non-finite loss or grad norm at index >= ``onset``."""
    return lambda loss, grad: any(map(_bad, list(loss[onset:]) + list(grad[onset:])))


def grad_rose(factor: float = 10.0, first: int = 10) -> Check:
    """A non-finite loss or grad norm, or a grad norm >= ``factor`` x the median of the first ``first``."""

    def check(loss: Trace, grad: Trace) -> bool:
        if non_finite(0)(loss, grad):
            return True
        return len(grad) > first and max(grad[first:]) >= factor * statistics.median(grad[:first])

    return check


def stalled(onset: int, ratio: float = 0.9) -> Check:
    """The median of the last 20 losses >= ``ratio`` x the median of the 20 from index ``onset``."""

    def check(loss: Trace, _: Trace) -> bool:
        if len(loss) < onset + 40:
            return False
        return statistics.median(loss[-20:]) >= ratio * statistics.median(loss[onset : onset + 20])

    return check


MANIFEST: Dict[str, Check] = {
    "ho17_plain_focal_cnn_labels_random": rose(120),
    "ho17_plain_enc_exp_typo": rose(30),
    "ho17_plain_gan_inf_batch": non_finite(150),
    "ho17_plain_looped_explode": grad_rose(),
    "ho17_plain_fp16_overflow": non_finite(150),
    "ho17_hf_bert_mlm_lr100x_at100": rose(99),
    "ho17_lokr_gptj_labels_random": rose(99),
    "ho17_pl_dwconv_frozen": stalled(25),
}
"""Each planted fault's manifestation check (decided before the set ran), on (loss, grad norm) traces."""

# ------------------------------------------------------------------------------------ trainings


def run(name: str) -> None:
    """Run one held-out shape (``trainguard.init`` already called)."""
    family = name.split("_")[1]
    if family == "plain":
        plain = {"focal": _focal, "enc": _enc, "gan": _gan, "lbfgs": _lbfgs, "looped": _looped, "fp16": _fp16}
        plain[name.split("_")[2]](name)
    else:
        {"hf": _hf, "lokr": _lokr, "pl": _lightning}[family](name)


def _focal(name: str) -> None:
    import torch
    import torch.nn.functional as F
    from torch import nn

    from bench.unseen import kit

    protos = torch.randn(5, 1, 10, 10, generator=kit.seeded(59_001))
    prior = torch.tensor([0.40, 0.25, 0.15, 0.12, 0.08])
    corrupt_from = 120 if name.endswith("labels_random") else None
    at = [0]

    def batch() -> Tuple[Any, Any]:
        y = torch.multinomial(prior, 32, replacement=True)
        x = protos[y] + 0.9 * torch.randn(32, 1, 10, 10)
        if corrupt_from is not None and at[0] >= corrupt_from:
            y = torch.randint(0, 5, (32,))
        at[0] += 1
        return x, y

    def focal(out: Any, y: Any) -> Any:
        ce = F.cross_entropy(out, y, reduction="none")
        return ((1 - torch.exp(-ce)) ** 2 * ce).mean()

    m = nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(8, 16, 3, padding=1, stride=2),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(16, 5),
    )
    o = torch.optim.Adagrad(m.parameters(), 0.05, lr_decay=1e-3, initial_accumulator_value=0.1)
    kit.loop(m, o, batch, focal, 250)


def _enc(name: str) -> None:
    import torch

    from bench.unseen import kit

    def batch(bs: int = 32) -> Tuple[Any, Any]:
        y = torch.randint(0, 4, (bs,))
        own = y.unsqueeze(1) * 6 + torch.randint(0, 6, (bs, 16))
        anyone = torch.randint(0, 24, (bs, 16))
        return torch.where(torch.rand(bs, 16) < 0.5, own, anyone), y

    m = kit.Encoder(24, 4, positions=16, width=48, layers=2, dropout=0.0)
    o = torch.optim.AdamW(m.parameters(), 2e-3, weight_decay=0.0)
    gamma = 1.05 if name.endswith("exp_typo") else 0.995
    s = torch.optim.lr_scheduler.SequentialLR(
        o,
        [
            torch.optim.lr_scheduler.LinearLR(o, 0.1, 1.0, total_iters=25),
            torch.optim.lr_scheduler.ExponentialLR(o, gamma),
        ],
        milestones=[25],
    )

    def decay(step: int) -> None:
        for group in o.param_groups:
            group["weight_decay"] = 0.05 * (1 - math.cos(math.pi * step / 250)) / 2

    kit.loop(m, o, batch, kit.ce, 250, s, hook=decay)


def _gan(name: str) -> None:
    import torch
    import torch.nn.functional as F
    from torch import nn

    import trainguard
    from bench.unseen import kit

    g = kit.seeded(59_002)
    angles = torch.arange(8) * (2 * math.pi / 8)
    centres = torch.stack([2 * torch.cos(angles), 2 * torch.sin(angles)], 1)
    gen, disc = kit.mlp([8, 64, 64, 2], nn.LeakyReLU), kit.mlp([2, 64, 64, 1], nn.LeakyReLU)
    opt_g = torch.optim.Adamax(gen.parameters(), 1e-3, betas=(0.5, 0.999))
    opt_d = torch.optim.Adamax(disc.parameters(), 1e-3, betas=(0.5, 0.999))
    trainguard.watch(disc, opt_d)
    inf_from = 150 if name.endswith("inf_batch") else None
    ones, zeros = torch.ones(64, 1), torch.zeros(64, 1)
    for step in range(kit.steps(300)):
        real = centres[torch.randint(0, 8, (64,), generator=g)] + 0.05 * torch.randn(64, 2, generator=g)
        if inf_from is not None and step >= inf_from:
            real[0] = float("inf")
        fake = gen(torch.randn(64, 8))
        d_loss = (
            F.binary_cross_entropy_with_logits(disc(real), ones)
            + F.binary_cross_entropy_with_logits(disc(fake.detach()), zeros)
        ) / 2
        opt_d.zero_grad()
        d_loss.backward()
        opt_d.step()
        g_loss = F.binary_cross_entropy_with_logits(disc(fake), ones)
        opt_g.zero_grad()
        g_loss.backward()
        opt_g.step()
        trainguard.log(step=step, loss=float(d_loss), g_loss=float(g_loss), lr=1e-3)
        if not math.isfinite(float(d_loss)):
            break


def _lbfgs(name: str) -> None:
    import torch
    import torch.nn.functional as F
    from torch import nn

    import trainguard
    from bench.unseen import kit

    g = kit.seeded(59_003)
    x = torch.randn(256, 6, generator=g)
    y = (torch.sin(x[:, 0]) + x[:, 1] * x[:, 2] + 0.05 * torch.randn(256, generator=g)).unsqueeze(1)
    m = kit.mlp([6, 32, 32, 1], nn.Tanh)
    o = torch.optim.LBFGS(m.parameters(), lr=1.0, history_size=10, max_iter=10, line_search_fn="strong_wolfe")
    trainguard.watch(m, o)

    def closure() -> Any:
        o.zero_grad()
        loss = F.mse_loss(m(x), y)
        loss.backward()
        return loss

    for step in range(kit.steps(80)):
        loss = float(o.step(closure))
        trainguard.log(step=step, loss=loss, lr=1.0)
        if not math.isfinite(loss):
            break


def _looped(name: str) -> None:
    import torch
    import torch.nn.functional as F
    from torch import nn

    from bench.unseen import kit

    class Looped(nn.Module):
        """``x -> W^30 x``: one linear map, weight-tied over 30 applications."""

        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.linalg.qr(torch.randn(16, 16, generator=kit.seeded(59_005)))[0])

        def forward(self, x: Any) -> Any:
            for _ in range(30):
                x = x @ self.w
            return x

    def batch() -> Tuple[Any, Any]:
        x = torch.randn(32, 16)
        return x, 3 * x

    m = Looped()
    o = torch.optim.SGD(m.parameters(), 0.02)
    s = torch.optim.lr_scheduler.LinearLR(o, 0.0005, 1.0, total_iters=200)
    kit.loop(m, o, batch, F.mse_loss, 250, s)


def _fp16(name: str) -> None:
    import torch
    import torch.nn.functional as F

    from bench.unseen import kit

    g = kit.seeded(59_004)
    w = torch.randn(8, generator=g)
    at = [0]

    def batch() -> Tuple[Any, Any]:
        x = torch.randn(32, 8)
        y = (torch.tanh(x @ w / 2) + 0.1 * torch.randn(32)).unsqueeze(1)
        if at[0] >= 150:
            y = 1000 * y
        at[0] += 1
        return x.half(), y.half()

    m = kit.mlp([8, 64, 64, 1]).half()
    kit.loop(m, torch.optim.SGD(m.parameters(), 0.01, momentum=0.9), batch, F.mse_loss, 250)


def _hf(name: str) -> None:
    """The HF Trainer shapes: BERT masked-LM (``bert`` in the name) or ConvNeXt."""
    import torch
    import transformers as tf

    from bench.unseen import kit

    if "bert" in name:
        vocab = 40

        def row(i: int) -> Dict[str, Any]:
            g = kit.seeded(59_100 + i)
            a, b = int(torch.randint(0, 38, (1,), generator=g)), int(torch.randint(1, 5, (1,), generator=g))
            ids = 2 + (a + b * torch.arange(24)) % 38
            masked = torch.rand(24, generator=g) < 0.15
            masked[int(torch.randint(0, 24, (1,), generator=g))] = True
            return {"input_ids": torch.where(masked, 1, ids), "labels": torch.where(masked, ids, -100)}

        config = kit.hf_model("bert", vocab, width=48, positions=32).config  # 2 layers, 4 heads, ffn 96
        jump = [lr_jump(100, 100.0)] if name.endswith("lr100x_at100") else []
        kit.hf_train(
            tf.BertForMaskedLM(config),
            kit.Rows(100_000, row),
            "/tmp/trainguard-heldout49-bert",
            200,
            2e-3,
            callbacks=jump,
            optim="adamw_torch",
            lr_scheduler_type="polynomial",
            lr_scheduler_kwargs={"power": 0.5, "lr_end": 1e-5},
            warmup_steps=15,
            logging_steps=1,
        )
        return
    protos = torch.randn(6, 1, 16, 16, generator=kit.seeded(59_200))

    def image(i: int) -> Dict[str, Any]:
        g = kit.seeded(59_300 + i)
        y = int(torch.randint(0, 6, (1,), generator=g))
        return {"pixel_values": protos[y] + 0.8 * torch.randn(1, 16, 16, generator=g), "labels": y}

    config = tf.ConvNextConfig(
        num_channels=1, patch_size=2, num_stages=2, hidden_sizes=[16, 32], depths=[1, 1], num_labels=6
    )
    kit.hf_train(
        tf.ConvNextForImageClassification(config),
        kit.Rows(100_000, image),
        "/tmp/trainguard-heldout49-convnext",
        150,
        2e-3,
        batch=32,
        optim="adamw_torch",
        lr_scheduler_type="cosine",
        warmup_steps=15,
        logging_steps=1,
    )


def lr_jump(at: int, factor: float) -> Any:
    """A ``TrainerCallback`` that, at optimizer step ``at``, multiplies every LR and the scheduler's base LRs
    (the schedule goes on from there) by ``factor``."""
    from transformers import TrainerCallback

    class LRJump(TrainerCallback):  # type: ignore[misc]
        def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if state.global_step != at:
                return
            sched, opt = kw.get("lr_scheduler"), kw.get("optimizer")
            if sched is not None:
                sched.base_lrs = [lr * factor for lr in sched.base_lrs]
            for group in opt.param_groups if opt is not None else ():
                group["lr"] *= factor

    return LRJump()


def _lokr(name: str) -> None:
    import torch
    import transformers as tf
    from peft import LoKrConfig, get_peft_model

    from bench.unseen import kit

    vocab = 40
    config = tf.GPTJConfig(vocab_size=vocab, n_embd=48, n_layer=2, n_head=4, rotary_dim=8, n_positions=32)
    base = kit.pretrained(tf.GPTJForCausalLM(config), kit.lm_rows(vocab, 32, 3, seed=59_400))
    model = get_peft_model(base, LoKrConfig(r=4, alpha=8, target_modules=["q_proj", "v_proj"]))
    random_from = 100 if name.endswith("labels_random") else None

    class RandomLabels(torch.nn.Module):
        """The peft model; from forward ``random_from`` on, its labels are random tokens."""

        def __init__(self) -> None:
            super().__init__()
            self.inner, self.calls = model, 0

        def forward(self, input_ids: Any, labels: Any = None) -> Any:
            if random_from is not None and self.calls >= random_from:
                labels = torch.randint(0, vocab, input_ids.shape, generator=kit.seeded(59_500 + self.calls))
            self.calls += 1
            return self.inner(input_ids=input_ids, labels=labels)

    kit.hf_train(
        RandomLabels(),
        kit.Rows(100_000, kit.lm_rows(vocab, 32, 6, seed=59_600)),
        "/tmp/trainguard-heldout49-lokr",
        200,
        5e-3,
        batch=8,
        optim="adamw_torch",
        lr_scheduler_type="linear",
        warmup_steps=10,
        logging_steps=1,
    )


def _lightning(name: str) -> None:
    import pytorch_lightning as pl
    import torch
    import torch.nn.functional as F
    from torch import nn

    from bench.unseen import kit

    protos = torch.randn(6, 1, 12, 12, generator=kit.seeded(59_700))
    frozen = name.endswith("frozen")

    def row(i: int) -> Any:
        g = kit.seeded(59_800 + i)
        y = int(torch.randint(0, 6, (1,), generator=g))
        return protos[y] + torch.randn(1, 12, 12, generator=g), y

    def separable(a: int, b: int) -> List[nn.Module]:
        return [nn.Conv2d(a, a, 3, padding=1, groups=a), nn.Conv2d(a, b, 1), nn.BatchNorm2d(b), nn.ReLU()]

    class Net(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(
                nn.Conv2d(1, 16, 3, padding=1),
                nn.BatchNorm2d(16),
                nn.ReLU(),
                *separable(16, 32),
                nn.MaxPool2d(2),
                *separable(32, 48),
                nn.AdaptiveAvgPool2d(1),
                nn.Flatten(),
                nn.Linear(48, 6),
            )

        def training_step(self, b: Any, batch_idx: int) -> Any:
            x, y = b
            return F.cross_entropy(self.net(x), y)

        def configure_optimizers(self) -> Any:
            o = torch.optim.SGD(self.parameters(), 0.05, momentum=0.9, nesterov=True, weight_decay=1e-4)
            if frozen:
                s: Any = torch.optim.lr_scheduler.LambdaLR(o, lambda t: 0.0 ** (t // 25))
            else:
                s = torch.optim.lr_scheduler.OneCycleLR(o, 0.1, total_steps=255, three_phase=True)
            return {"optimizer": o, "lr_scheduler": {"scheduler": s, "interval": "step"}}

        def configure_callbacks(self) -> Any:
            return [WeightEMA()]

    class WeightEMA(pl.Callback):
        """A shadow copy of the weights, 0.99 old + 0.01 new after every batch (never loaded back)."""

        def __init__(self) -> None:
            self.shadow: Optional[List[Any]] = None

        def on_train_batch_end(self, trainer: Any, module: Any, *args: Any) -> None:
            with torch.no_grad():
                now = [p.detach().clone() for p in module.parameters()]
                if self.shadow is None:
                    self.shadow = now
                else:
                    for s, p in zip(self.shadow, now):
                        s.mul_(0.99).add_(p, alpha=0.01)

    kit.lightning_fit(Net(), kit.Rows(32 * 250, row), 250, batch=32, gradient_clip_val=1.0)


# ----------------------------------------------------------------------------------------- scoring


def grad_trace(events: Sequence[Dict[str, Any]]) -> List[float]:
    """The SDK's ``grad/global_norm``, one per step (the last one sent for a step), in step order."""
    by_step: Dict[int, float] = {}
    for event in events:
        for point in (event.get("metrics") or {}).get("points") or ():
            if point.get("name") == "grad/global_norm" and isinstance(event.get("step"), int):
                by_step[event["step"]] = float(point.get("value"))
    return [by_step[k] for k in sorted(by_step)]


def summary(out: Path) -> List[str]:
    """The summary lines for the recorded set in ``out``: healthy right/N (and perf/* left out), faults
    right/scored by the per-fault checks (and perf/* left out), manifested/planted."""
    from bench.corpus.evaluate import read_events
    from bench.unseen import probe

    tally = {key: [0, 0] for key in ("healthy", "healthy_perf", "faults", "faults_perf")}
    planted = shown = 0
    for name, (expected, _) in SHAPES.items():
        stream = out / f"{name}.jsonl"
        if not stream.exists():
            continue
        v = probe.verdict(name, out, "heldout49")
        if expected == HEALTHY:
            for key, field in (("healthy", "right"), ("healthy_perf", "right_but_perf")):
                tally[key][0] += bool(v[field])
                tally[key][1] += 1
            continue
        planted += 1
        events = read_events(stream)
        if not MANIFEST[name](probe.loss_trace(events), grad_trace(events)):
            continue
        shown += 1
        found = any(str(k).split(":")[0] in expected.split("|") for k in v["incidents"])  # type: ignore[attr-defined]
        for key, skip_perf in (("faults", False), ("faults_perf", True)):
            still_open = [k for k in v["open_alerts"] if not (skip_perf and str(k).startswith("perf/"))]  # type: ignore[attr-defined]
            tally[key][0] += found and not (v["learned"] and still_open)
            tally[key][1] += 1
    return [
        f"summary healthy: {tally['healthy'][0]}/{tally['healthy'][1]} right",
        f"summary healthy (perf/* left out): {tally['healthy_perf'][0]}/{tally['healthy_perf'][1]} right",
        f"summary faults (per-fault checks): {tally['faults'][0]}/{tally['faults'][1]} right",
        f"summary faults (perf/* left out): {tally['faults_perf'][0]}/{tally['faults_perf'][1]} right",
        f"summary manifested: {shown}/{planted} planted",
    ]


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description="heldout49's summary (per-fault checks)")
    parser.add_argument("--out", type=Path, required=True, help="the recorded streams (probe.py --out)")
    print("\n".join(summary(parser.parse_args(argv).out)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
