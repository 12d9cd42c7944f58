#!/usr/bin/env python3
"""Stop 43's TUNING set of unseen training shapes (set ``tuning43``): written, with its expectations and
scoring rules (probe.py's trace rules, unchanged), before it ran; committed with heldout43
(:mod:`bench.unseen.heldout9`, written first), before either ran (heldout43: a 3-step smoke). The detectors
may be tuned on these.

The question (hR's review of stop 42's loss/spike): healthy runs whose per-step loss is HEAVY-TAILED
(tiny batches, heavy-tailed or log-normal targets, noisy labels, sparse RL-like rewards, mixed easy and
hard rows at batch 1) have values 3-50x their window's median now and then and must stay quiet; one bad
batch of x10-x200 must still be caught, and x1000+ batches (which the divergence blow-up rule also sees)
must read as one story.

* plain loops: an MLP regressor on Student-t (df 4) targets under Adam, batch 2 (healthy; and step 200's
  loss x30); a DQN-like Q-network's TD loss with sparse rewards (5 %, +10) under SGD momentum, batch 4
  (healthy; and step 180's loss x100); a CNN on prototypes with 30 % random labels under SGD, batch 4
  (healthy, natural spikes) and batch 32 (step 160's loss x10); a residual MLP under Adam (step 140's
  loss x1000);
* the HF Trainer: GPT-2 at batch 1, rows 15 % all-random tokens (healthy, natural spikes; and step 150's
  loss x50; and x2000);
* Lightning: an MLP on log-normal targets under AdamW, batch 2 (healthy; and batch 150's loss x200);
* peft: LoRA on a pre-trained GPT-2's c_attn in a plain loop under AdamW, batch 1, 10 % random rows
  (healthy, natural spikes; and step 150's loss x20).

Every shape is seeded: ``torch.manual_seed(0)`` (bench.unseen.shapes.main) and the fixed data seeds below
(51_000+: none used by another set).
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
    "tu13_plain_student_adam_ok": (
        HEALTHY,
        "MLP regressor, targets + Student-t (df 4) noise (natural spikes), MSE, Adam 1e-3, batch 2, "
        "400 steps",
    ),
    "tu13_plain_student_adam_bad_batch": (BAD_BATCH, "the same, step 200's loss x30"),
    "tu13_plain_dqn_sgdm_ok": (
        HEALTHY,
        "Q-network TD loss (target net synced every 50 steps) with sparse rewards (5 %: +10), SGD momentum "
        "0.9 lr 1e-3, batch 4, 400 steps (natural spikes)",
    ),
    "tu13_plain_dqn_sgdm_bad_batch": (BAD_BATCH, "the same, step 180's loss x100"),
    "tu13_plain_cnn_sgd_noisy_labels_ok": (
        HEALTHY,
        "CNN (no norm) on noisy prototypes, 30 % of the labels random, SGD lr 0.02, batch 4, 300 steps",
    ),
    "tu13_plain_cnn_sgd_noisy_labels_b32_bad_batch": (
        BAD_BATCH,
        "the same at batch 32, step 160's loss x10",
    ),
    "tu13_plain_resmlp_adam_bad_batch": (
        BAD_BATCH,
        "residual MLP regressor, Adam 1e-3, step 140's loss x1000",
    ),
    # HF Trainer
    "tu13_hf_gpt2_bs1_ok": (
        HEALTHY,
        "HF Trainer, GPT-2 2x48, adamw_torch 5e-4, linear, batch 1, log 1; 15 % of the rows all random "
        "tokens (natural spikes)",
    ),
    "tu13_hf_gpt2_bs1_bad_batch": (BAD_BATCH, "the same, step 150's loss x50"),
    "tu13_hf_gpt2_bs1_x2000_bad_batch": (BAD_BATCH, "the same, step 150's loss x2000"),
    # Lightning
    "tu13_pl_lognormal_adamw_ok": (
        HEALTHY,
        "Lightning MLP, MSE on log-normal targets (sigma 0.8: natural spikes), AdamW 1e-3, batch 2, "
        "300 steps",
    ),
    "tu13_pl_lognormal_adamw_bad_batch": (BAD_BATCH, "the same, batch 150's loss x200"),
    # peft
    "tu13_lora_gpt2_adamw_bs1_ok": (
        HEALTHY,
        "peft LoRA r=8 on a pre-trained GPT-2's c_attn, plain loop AdamW 2e-3, batch 1, 10 % random rows",
    ),
    "tu13_lora_gpt2_adamw_bs1_bad_batch": (BAD_BATCH, "the same, step 150's loss x20"),
}


def run(name: str) -> None:
    """Run one tuning shape (``trainguard.init`` already called)."""
    {"plain": _plain, "hf": _hf, "pl": _lightning, "lora": _lora}[name.split("_")[1]](name)


def _weighted(name: str, step: Any, when: int, weight: float) -> Any:
    def wrap(loss_fn: Any) -> Any:
        def fn(out: Any, y: Any) -> Any:
            loss = loss_fn(out, y)
            return loss * weight if name.endswith("bad_batch") and step[0] == when else loss

        return fn

    return wrap


def _plain(name: str) -> None:
    import copy

    import torch
    import torch.nn.functional as F
    from torch import nn

    from bench.unseen import kit

    family = name.split("_")[2]
    step = [0]

    def at(t: int) -> None:
        step[0] = t

    if family == "student":
        w = torch.randn(8, generator=kit.seeded(51_001))
        t_noise = torch.distributions.StudentT(4.0)

        def rows(bs: int = 2) -> Tuple[Any, Any]:
            x = torch.randn(bs, 8)
            return x, torch.sin(x @ w).unsqueeze(1) + 0.5 * t_noise.sample((bs, 1))

        m: Any = kit.mlp([8, 64, 64, 1], nn.GELU)
        o: Any = torch.optim.Adam(m.parameters(), 1e-3)
        kit.loop(m, o, rows, _weighted(name, step, 200, 30.0)(F.mse_loss), 400, hook=at)
    elif family == "dqn":
        q = kit.mlp([6, 64, 4])
        target = copy.deepcopy(q)
        g = kit.seeded(51_002)
        proj = torch.randn(6, 4, generator=g)

        def transitions(bs: int = 4) -> Tuple[Any, Any]:
            s, s2 = torch.randn(bs, 6), torch.randn(bs, 6)
            a = torch.randint(0, 4, (bs,))
            r = 0.1 * (s @ proj).gather(1, a[:, None])[:, 0] + 10.0 * (torch.rand(bs) < 0.05).float()
            if step[0] % 50 == 0:
                target.load_state_dict(q.state_dict())
            with torch.no_grad():
                y = r + 0.9 * target(s2).max(1).values
            return torch.cat([s, a[:, None].float()], 1), y

        class Q(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.q = q

            def forward(self, sa: Any) -> Any:
                return self.q(sa[:, :6]).gather(1, sa[:, 6:].long())[:, 0]

        o = torch.optim.SGD(q.parameters(), 1e-3, momentum=0.9)
        kit.loop(Q(), o, transitions, _weighted(name, step, 180, 100.0)(F.mse_loss), 400, hook=at)
    elif family == "cnn":
        bs = 32 if "_b32_" in name else 4
        proto = torch.randn(10, 1, 10, 10, generator=kit.seeded(51_003))

        def images() -> Tuple[Any, Any]:
            y = torch.randint(0, 10, (bs,))
            x = proto[y] + 0.8 * torch.randn(bs, 1, 10, 10)
            noisy = torch.rand(bs) < 0.3
            return x, torch.where(noisy, torch.randint(0, 10, (bs,)), y)

        m = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(32, 10),
        )
        o = torch.optim.SGD(m.parameters(), 0.02)
        kit.loop(m, o, images, _weighted(name, step, 160, 10.0)(F.cross_entropy), 300, hook=at)
    elif family == "resmlp":
        w = torch.randn(16, generator=kit.seeded(51_004))

        def rows(bs: int = 32) -> Tuple[Any, Any]:
            x = torch.randn(bs, 16)
            return x, torch.tanh(x @ w).unsqueeze(1) + 0.1 * torch.randn(bs, 1)

        m = kit.ResMLP(16, 64, 3)
        o = torch.optim.Adam(m.parameters(), 1e-3)
        kit.loop(m, o, rows, _weighted(name, step, 140, 1000.0)(F.mse_loss), 250, hook=at)
    else:
        raise SystemExit(f"unknown tuning plain shape {name}")


def _hard_rows(vocab: int, length: int, seed: int, share: float) -> Any:
    import torch

    from bench.unseen import kit

    easy = kit.lm_rows(vocab, length, 4, seed=seed)

    def row(i: int) -> Dict[str, Any]:
        g = kit.seeded(seed + 500 + i)
        if float(torch.rand(1, generator=g)) < share:
            ids = torch.randint(0, vocab, (length,), generator=g)
            return {"input_ids": ids, "labels": ids.clone()}
        return easy(i)

    return row


def _hf(name: str) -> None:
    import torch

    from bench.unseen import kit

    vocab = 40
    weight = 2000.0 if "_x2000_" in name else 50.0 if name.endswith("bad_batch") else 1.0

    class Scaled(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner, self.calls = kit.hf_model("gpt2", vocab, width=48, positions=32), 0

        def forward(self, input_ids: Any, labels: Any = None) -> Any:
            out = self.inner(input_ids=input_ids, labels=labels)
            self.calls += 1
            if self.calls == 151:
                out["loss"] = out["loss"] * weight
            return out

    kit.hf_train(
        Scaled(),
        kit.Rows(100_000, _hard_rows(vocab, 24, 51_100, 0.15)),
        "/tmp/trainguard-tuning43-gpt2",
        300,
        5e-4,
        batch=1,
        optim="adamw_torch",
        lr_scheduler_type="linear",
        logging_steps=1,
    )


def _lora(name: str) -> None:
    import torch
    import transformers as tf
    from peft import LoraConfig, get_peft_model

    from bench.unseen import kit

    vocab = 40
    base = kit.pretrained(
        tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=vocab, n_positions=32, n_embd=48, n_layer=2, n_head=4)),
        kit.lm_rows(vocab, 32, 3, seed=51_300),
    )
    model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=["c_attn"], lora_dropout=0.0))
    o = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], 2e-3)
    step = [0]

    def at(t: int) -> None:
        step[0] = t

    batches = kit.lm_batches(_hard_rows(vocab, 32, 51_400, 0.10), bs=1)
    kit.loop(kit.HFLogits(model), o, batches, _weighted(name, step, 150, 20.0)(kit.ce), 300, hook=at)


def _lightning(name: str) -> None:
    import pytorch_lightning as pl
    import torch
    import torch.nn.functional as F

    from bench.unseen import kit

    w = torch.randn(6, generator=kit.seeded(51_500))

    def row(i: int) -> Any:
        g = kit.seeded(51_600 + i)
        x = torch.randn(6, generator=g)
        return x, torch.exp(0.3 * (x @ w) / 2 + 0.8 * torch.randn(1, generator=g))

    net = kit.mlp([6, 64, 64, 1])

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = net

        def training_step(self, b: Any, batch_idx: int) -> Any:
            x, y = b
            loss = F.mse_loss(self.net(x), y)
            if name.endswith("bad_batch") and batch_idx == 150:
                loss = loss * 200.0
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), 1e-3)

    kit.lightning_fit(Model(), kit.Rows(2 * 300, row), 300, batch=2)
