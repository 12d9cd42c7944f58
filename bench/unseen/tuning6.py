#!/usr/bin/env python3
"""Stop 42's TUNING set of unseen training shapes (set ``tuning42``): written, with its expectations and
its scoring rules (probe.py's trace rules, unchanged), before any of it ran and before heldout42
(:mod:`bench.unseen.heldout8`) was written. The detectors may be tuned on these.

The family stop 41 left with no incident at all -- ONE bad batch (x100 .. x10,000) that the run absorbs at
once (the loss and the gradient norm spike for one step, then all is normal) -- in other models,
frameworks, optimisers and schedules, with and without gradient clipping; and healthy runs whose loss and
gradient norm spike NATURALLY (a hard batch now and then, heavy-tailed targets) that must not alarm:

* plain loops: an LSTM language model under SGD momentum (one batch's loss weighted x1000; the same with
  clip 0.5 and x10,000) and its healthy twin; a pre-norm causal Transformer LM under RMSprop (one batch's
  logits at temperature 0.01); an MLP regressor of targets with Student-t noise under Adam (healthy, natural
  spikes; and one batch's inputs x300);
* the HF Trainer: a GPT-2 under adamw_torch + cosine with the Trainer's default clip (one step's loss
  x2000), and its twin whose data hold an all-random-token batch now and then (natural spikes);
* Lightning: a small CNN without BatchNorm under RMSprop + cosine (one batch x5000; the same x100 with
  gradient_clip_val 0.5) and its healthy twin;
* peft: LoRA on a pre-trained GPT-2's c_attn under torch's Adafactor (one batch's per-token loss weights
  x100) and its twin with random-token batches now and then (natural spikes).

Every shape is seeded: ``torch.manual_seed(0)`` (bench.unseen.shapes.main) and the fixed data seeds below
(46_000+: none used by another set).
"""

from __future__ import annotations

from typing import Any, Dict, Tuple

from bench.unseen.sets import HEALTHY, Expectations

BAD_BATCH = (
    "loss/divergence|loss/rise-after-fall|loss/oscillation|gradient/explosion"
    "|loss/non_finite|gradient/nan-source|loss/spike|gradient/spike"
)
"""One bad batch: any curve / gradient kind that says the run was hit (a one-step spike kind included)."""

SHAPES: Expectations = {
    # plain loops
    "tu12_plain_lstm_sgdm_bad_batch": (
        BAD_BATCH,
        "LSTM LM (vocab 30, 32-64), SGD momentum 0.9 lr 0.3, no clip, 250 steps; step 130's loss "
        "weighted x1000",
    ),
    "tu12_plain_lstm_sgdm_clip_bad_batch": (
        BAD_BATCH,
        "the same with clip_grad_norm 0.5; step 130's loss weighted x10,000",
    ),
    "tu12_plain_lstm_sgdm_ok": (HEALTHY, "the same, no clip, no bad batch"),
    "tu12_plain_tlm_rmsprop_bad_batch": (
        BAD_BATCH,
        "pre-norm causal Transformer LM (2x48), RMSprop 5e-4, 250 steps; step 100's logits divided by 0.01",
    ),
    "tu12_plain_student_adam_ok": (
        HEALTHY,
        "GELU MLP regressor, targets + Student-t (df 2.5) noise, Adam 2e-3, 250 steps (natural loss spikes)",
    ),
    "tu12_plain_student_adam_bad_batch": (BAD_BATCH, "the same; step 160's inputs x300"),
    # HF Trainer
    "tu12_hf_gpt2_adamw_bad_batch": (
        BAD_BATCH,
        "HF Trainer, GPT-2 2x48, adamw_torch 2e-3, cosine, warmup 10, default clip 1.0, log 1; step 120's "
        "loss x2000",
    ),
    "tu12_hf_gpt2_adamw_hard_batches_ok": (
        HEALTHY,
        "the same, no bad batch; every 17th batch is random tokens (natural loss / norm spikes)",
    ),
    # Lightning
    "tu12_pl_cnn_rmsprop_bad_batch": (
        BAD_BATCH,
        "Lightning CNN (no BatchNorm) on 10x10 prototypes, RMSprop 1e-3, CosineAnnealingLR per step; "
        "batch 110 x5000",
    ),
    "tu12_pl_cnn_rmsprop_clip_bad_batch": (BAD_BATCH, "the same with gradient_clip_val 0.5; batch 110 x100"),
    "tu12_pl_cnn_rmsprop_ok": (HEALTHY, "the same, no bad batch"),
    # peft
    "tu12_lora_gpt2_adafactor_bad_batch": (
        BAD_BATCH,
        "peft LoRA r=8 on a pre-trained tiny GPT-2's c_attn, plain loop torch Adafactor 1e-2, 250 steps; "
        "step 140's per-token loss weights 100",
    ),
    "tu12_lora_gpt2_adafactor_hard_batches_ok": (
        HEALTHY,
        "the same, no bad batch; every 17th batch is random tokens (natural loss / norm spikes)",
    ),
}


def run(name: str) -> None:
    """Run one tuning shape (``trainguard.init`` already called)."""
    {"plain": _plain, "hf": _hf, "pl": _lightning, "lora": _lora}[name.split("_")[1]](name)


def _plain(name: str) -> None:
    import torch
    import torch.nn.functional as F
    from torch import nn

    from bench.unseen import kit

    step = [0]

    def at(t: int) -> None:
        step[0] = t

    family = name.split("_")[2]
    if family in ("lstm", "tlm"):
        vocab = 30
        batch = kit.lm_batches(kit.lm_rows(vocab, 25, 4, seed=46_001 if family == "lstm" else 46_002))
        bad_at, weight = (130, 1000.0) if family == "lstm" else (100, 1.0)
        if "clip" in name:
            weight = 10_000.0

        def lm_loss(out: Any, y: Any) -> Any:
            hit = name.endswith("bad_batch") and step[0] == bad_at
            if hit and family == "tlm":
                out = out / 0.01
            return (weight if hit else 1.0) * kit.ce(out, y)

        if family == "lstm":
            m: Any = kit.RecurrentLM(vocab, 32, 64, "lstm")
            o: Any = torch.optim.SGD(m.parameters(), 0.3, momentum=0.9)
            kit.loop(m, o, batch, lm_loss, 250, clip=0.5 if "clip" in name else None, hook=at)
        else:
            m = kit.CausalLM(vocab, 24, 48, 2)
            o = torch.optim.RMSprop(m.parameters(), 5e-4)
            kit.loop(m, o, batch, lm_loss, 250, hook=at)
    elif family == "student":
        w = torch.randn(12, 3, generator=kit.seeded(46_003))
        t_noise = torch.distributions.StudentT(2.5)

        def rows(bs: int = 48) -> Tuple[Any, Any]:
            x = torch.randn(bs, 12)
            y = torch.tanh(x @ w).sum(-1, keepdim=True) + 0.3 * t_noise.sample((bs, 1))
            if name.endswith("bad_batch") and step[0] == 160:
                x = x * 300.0
            return x, y

        m = kit.mlp([12, 64, 64, 1], nn.GELU)
        o = torch.optim.Adam(m.parameters(), 2e-3)
        kit.loop(m, o, rows, F.mse_loss, 250, hook=at)
    else:
        raise SystemExit(f"unknown tuning plain shape {name}")


def _hard_rows(vocab: int, length: int, seed: int, bs: int) -> Any:
    """lm_rows, except that every row of every 17th batch (of ``bs`` rows) is random tokens."""
    import torch

    from bench.unseen import kit

    easy = kit.lm_rows(vocab, length, 4, seed=seed)

    def row(i: int) -> Dict[str, Any]:
        if (i // bs) % 17 == 9:
            ids = torch.randint(0, vocab, (length,), generator=kit.seeded(seed + 500_000 + i))
            return {"input_ids": ids, "labels": ids.clone()}
        return easy(i)

    return row


def _hf(name: str) -> None:
    import torch

    from bench.unseen import kit

    vocab = 40
    inner = kit.hf_model("gpt2", vocab, width=48, positions=32)
    hard = name.endswith("hard_batches_ok")
    row = _hard_rows(vocab, 24, 46_100, 16) if hard else kit.lm_rows(vocab, 24, 4, seed=46_100)

    class Scaled(torch.nn.Module):
        """The model, its loss x2000 on the 121st forward (step 120: one forward per step)."""

        def __init__(self) -> None:
            super().__init__()
            self.inner, self.calls = inner, 0

        def forward(self, input_ids: Any, labels: Any = None) -> Any:
            out = self.inner(input_ids=input_ids, labels=labels)
            self.calls += 1
            if name.endswith("bad_batch") and self.calls == 121:
                out["loss"] = out["loss"] * 2000.0
            return out

    kit.hf_train(
        Scaled(),
        kit.Rows(100_000, row),
        "/tmp/trainguard-tuning42-hf",
        250,
        2e-3,
        optim="adamw_torch",
        lr_scheduler_type="cosine",
        warmup_steps=10,
        logging_steps=1,
    )


def _lora(name: str) -> None:
    import torch
    import torch.nn.functional as F
    from peft import LoraConfig, get_peft_model

    from bench.unseen import kit

    vocab = 40
    base = kit.pretrained(kit.hf_model("gpt2", vocab, width=48), kit.lm_rows(vocab, 32, 3, seed=46_200))
    config = LoraConfig(r=8, lora_alpha=16, target_modules=["c_attn"], fan_in_fan_out=True, lora_dropout=0.0)
    model = get_peft_model(base, config)
    o = torch.optim.Adafactor([p for p in model.parameters() if p.requires_grad], 1e-2)
    step = [0]

    def loss_fn(out: Any, y: Any) -> Any:
        per_token = F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1), reduction="none")
        weight = 100.0 if name.endswith("bad_batch") and step[0] == 140 else 1.0
        return (weight * per_token).mean()

    def at(t: int) -> None:
        step[0] = t

    hard = name.endswith("hard_batches_ok")
    row = _hard_rows(vocab, 32, 46_300, 16) if hard else kit.lm_rows(vocab, 32, 6, seed=46_300)
    kit.loop(kit.HFLogits(model), o, kit.lm_batches(row), loss_fn, 250, hook=at)


def _lightning(name: str) -> None:
    import pytorch_lightning as pl
    import torch
    import torch.nn.functional as F
    from torch import nn

    from bench.unseen import kit

    proto = torch.randn(5, 1, 10, 10, generator=kit.seeded(46_400))
    scale = 100.0 if "clip" in name else 5000.0
    bad_rows = range(32 * 110, 32 * 111) if name.endswith("bad_batch") else range(0)

    def row(i: int) -> Any:
        g = kit.seeded(46_500 + i)
        y = int(torch.randint(0, 5, (1,), generator=g))
        x = proto[y] + 0.9 * torch.randn(1, 10, 10, generator=g)
        return (x * scale if i in bad_rows else x), y

    net = nn.Sequential(
        nn.Conv2d(1, 12, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(12, 24, 3, padding=1, stride=2),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(24, 5),
    )

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = net

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            x, y = batch
            loss = F.cross_entropy(self.net(x), y)
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self) -> Any:
            o = torch.optim.RMSprop(self.parameters(), 1e-3)
            s = torch.optim.lr_scheduler.CosineAnnealingLR(o, 250)
            return {"optimizer": o, "lr_scheduler": {"scheduler": s, "interval": "step"}}

    extra = {"gradient_clip_val": 0.5} if "clip" in name else {}
    kit.lightning_fit(Model(), kit.Rows(32 * 250, row), 250, **extra)
