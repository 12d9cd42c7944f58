#!/usr/bin/env python3
"""Stop 44's TUNING set of unseen training shapes (set ``tuning44``): written, with its expectations and
scoring rules (probe.py's trace rules plus stop 44's jump rule, :data:`bench.unseen.sets.JUMP_RULE`), before
it ran; committed with heldout44 (:mod:`bench.unseen.heldout10`) before either ran (a 3-step smoke). The
detectors may be tuned on these.

The questions (stop 43's report): (1) loss/oscillation opens on healthy runs whose per-step loss is
HEAVY-TAILED or noisy (tiny batches, noisy labels, heavy-tailed targets, sparse TD rewards) -- they must stay
quiet -- while a learning rate far too high must still be caught; (2) one bad batch on a run that learned
far BELOW its start (x30-x100 lands under the initial level: ``spike_start_level``) must be caught, while a
converged run's natural hard batches stay quiet.

* plain loops: an MLP on 4 Gaussian blobs with 40 % random labels under SGD, batch 2 (healthy; and at LR
  40x); the same blobs with clean labels under Adam 0.3, batch 32 (LR far too high); two moons with 15 %
  flipped labels under Adam, batch 1 (healthy); a DQN-like Huber TD loss with sparse rewards under Adam,
  batch 8 (healthy); a CNN on prototypes under Adam, batch 8, that converges far below its start (healthy;
  and step 220's loss x100); a smooth MLP regressor under Adam, batch 32 (step 220's loss x50);
* the HF Trainer: BERT classifier at batch 2 with 30 % random labels (healthy; and at LR 3e-2, batch 8);
  GPT-2 on clean sequences, batch 8, converged far below its start (step 200's loss x100);
* Lightning: an MLP with a Huber loss on Student-t (df 2) noise, batch 2 (healthy); a smooth regressor under
  SGD momentum at LR 0.3 (far too high); the same under Adam 3e-3 (batch 220's loss x30);
* peft: LoRA on a pre-trained tiny Llama's q_proj/v_proj, batch 2, 20 % random rows (healthy; and at LR 0.3).

Every shape is seeded: ``torch.manual_seed(0)`` (bench.unseen.shapes.main) and the fixed data seeds below
(54_000+: none used by another set).
"""

from __future__ import annotations

from typing import Any, Dict, Tuple

from bench.unseen.sets import HEALTHY, LR_TOO_HIGH, Expectations

BAD_BATCH = (
    "loss/divergence|loss/rise-after-fall|loss/oscillation|gradient/explosion"
    "|loss/non_finite|gradient/nan-source|loss/spike|gradient/spike"
)
"""One bad batch: any curve / gradient kind that says the run was hit (a one-step spike kind included)."""

SHAPES: Expectations = {
    # plain loops
    "tu14_plain_blobs_sgd_noisy_bs2_ok": (
        HEALTHY,
        "MLP on 4 Gaussian blobs, 40 % of the labels random (noisy loss near its start), SGD 0.05, batch 2, "
        "300 steps",
    ),
    "tu14_plain_blobs_sgd_noisy_bs2_lr40x": (LR_TOO_HIGH, "the same at SGD 2.0 (40x)"),
    "tu14_plain_blobs_adam_b32_lr_high": (
        LR_TOO_HIGH,
        "the same blobs, clean labels, Adam 0.3 (300x the usual 1e-3), batch 32, 300 steps",
    ),
    "tu14_plain_moons_adam_noisy_bs1_ok": (
        HEALTHY,
        "MLP on two moons, 15 % of the labels flipped, Adam 3e-3, batch 1, 300 steps",
    ),
    "tu14_plain_dqn_huber_adam_ok": (
        HEALTHY,
        "Q-network Huber TD loss (target synced every 25 steps), sparse rewards (8 %: +5), Adam 1e-3, "
        "batch 8, 300 steps",
    ),
    "tu14_plain_cnn_adam_converged_ok": (
        HEALTHY,
        "CNN (BatchNorm) on noisy prototypes, Adam 2e-3, batch 8, 300 steps: converges far below its start",
    ),
    "tu14_plain_cnn_adam_converged_far_bad_batch": (BAD_BATCH, "the same, step 220's loss x100"),
    "tu14_plain_regress_adam_far_bad_batch": (
        BAD_BATCH,
        "MLP regressor of a smooth function (no noise), Adam 3e-3, batch 32, 300 steps, step 220's loss x50",
    ),
    # HF Trainer
    "tu14_hf_bert_noisy_bs2_ok": (
        HEALTHY,
        "HF Trainer, BERT 2x48 classifier, 30 % of the labels random, adamw_torch 5e-4, batch 2, log 1, "
        "250 steps",
    ),
    "tu14_hf_bert_lr_high": (LR_TOO_HIGH, "the same at lr 3e-2 (60x), batch 8"),
    "tu14_hf_gpt2_clean_far_bad_batch": (
        BAD_BATCH,
        "HF Trainer, GPT-2 2x48 on clean arithmetic rows, adamw_torch 3e-3, batch 8, 250 steps, step 200's "
        "loss x100",
    ),
    # Lightning
    "tu14_pl_tdf2_huber_bs2_ok": (
        HEALTHY,
        "Lightning MLP, Huber loss, targets + Student-t (df 2) noise, Adam 1e-3, batch 2, 300 steps",
    ),
    "tu14_pl_regress_sgdm_lr_high": (
        LR_TOO_HIGH,
        "Lightning MLP regressor of a smooth function, SGD momentum 0.9 lr 0.3 (far too high), batch 32",
    ),
    "tu14_pl_regress_adam_far_bad_batch": (
        BAD_BATCH,
        "Lightning MLP regressor of a smooth function, Adam 3e-3, batch 32, 300 steps, batch 220's loss x30",
    ),
    # peft
    "tu14_lora_llama_bs2_ok": (
        HEALTHY,
        "peft LoRA r=8 on a pre-trained tiny Llama's q_proj/v_proj, plain loop AdamW 2e-3, batch 2, 20 % "
        "random rows, 250 steps",
    ),
    "tu14_lora_llama_lr_high": (LR_TOO_HIGH, "the same at AdamW 0.3 (150x)"),
}


def run(name: str) -> None:
    """Run one tuning shape (``trainguard.init`` already called)."""
    {"plain": _plain, "hf": _hf, "pl": _lightning, "lora": _lora}[name.split("_")[1]](name)


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

    def weighted(loss_fn: Any, when: int, weight: float) -> Any:
        def fn(out: Any, y: Any) -> Any:
            loss = loss_fn(out, y)
            return loss * weight if name.endswith("bad_batch") and step[0] == when else loss

        return fn

    if family == "blobs":
        centres = 2.0 * torch.randn(4, 2, generator=kit.seeded(54_001))
        noisy = "noisy" in name

        def blobs(bs: int) -> Any:
            def batch() -> Tuple[Any, Any]:
                y = torch.randint(0, 4, (bs,))
                x = centres[y] + torch.randn(bs, 2)
                if noisy:
                    y = torch.where(torch.rand(bs) < 0.4, torch.randint(0, 4, (bs,)), y)
                return x, y

            return batch

        m: Any = kit.mlp([2, 64, 64, 4])
        if "adam" in name:
            o: Any = torch.optim.Adam(m.parameters(), 0.3)
            kit.loop(m, o, blobs(32), F.cross_entropy, 300)
        else:
            o = torch.optim.SGD(m.parameters(), 2.0 if name.endswith("lr40x") else 0.05)
            kit.loop(m, o, blobs(2), F.cross_entropy, 300)
    elif family == "moons":

        def moons(bs: int = 1) -> Tuple[Any, Any]:
            y = torch.randint(0, 2, (bs,))
            t = torch.rand(bs) * 3.1416
            x = torch.stack([torch.cos(t) + y, torch.sin(t) * (1 - 2 * y) + 0.5 * y], 1)
            x = x + 0.1 * torch.randn(bs, 2)
            return x, torch.where(torch.rand(bs) < 0.15, 1 - y, y)

        m = kit.mlp([2, 32, 32, 2])
        o = torch.optim.Adam(m.parameters(), 3e-3)
        kit.loop(m, o, moons, F.cross_entropy, 300)
    elif family == "dqn":
        q = kit.mlp([5, 64, 3])
        target = copy.deepcopy(q)
        proj = torch.randn(5, 3, generator=kit.seeded(54_002))

        def transitions(bs: int = 8) -> Tuple[Any, Any]:
            s, s2 = torch.randn(bs, 5), torch.randn(bs, 5)
            a = torch.randint(0, 3, (bs,))
            r = 0.2 * (s @ proj).gather(1, a[:, None])[:, 0] + 5.0 * (torch.rand(bs) < 0.08).float()
            if step[0] % 25 == 0:
                target.load_state_dict(q.state_dict())
            with torch.no_grad():
                y = r + 0.9 * target(s2).max(1).values
            return torch.cat([s, a[:, None].float()], 1), y

        class Q(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.q = q

            def forward(self, sa: Any) -> Any:
                return self.q(sa[:, :5]).gather(1, sa[:, 5:].long())[:, 0]

        m = Q()
        o = torch.optim.Adam(m.parameters(), 1e-3)
        kit.loop(m, o, transitions, F.smooth_l1_loss, 300, hook=at)
    elif family == "cnn":
        m = kit.bn_cnn(6)
        o = torch.optim.Adam(m.parameters(), 2e-3)
        batches = kit.image_batches(6, 12, 0.8, 54_003, bs=8)
        kit.loop(m, o, batches, weighted(F.cross_entropy, 220, 100.0), 300, hook=at)
    elif family == "regress":
        w = torch.randn(6, 3, generator=kit.seeded(54_004))

        def rows(bs: int = 32) -> Tuple[Any, Any]:
            x = torch.randn(bs, 6)
            return x, torch.sin(x @ w).sum(1, keepdim=True)

        m = kit.mlp([6, 64, 64, 1], nn.SiLU)
        o = torch.optim.Adam(m.parameters(), 3e-3)
        kit.loop(m, o, rows, weighted(F.mse_loss, 220, 50.0), 300, hook=at)
    else:
        raise SystemExit(f"unknown tuning plain shape {name}")


class _Scaled:
    """An ``nn.Module`` around an HF model whose loss is multiplied by ``weight`` on forward number ``at`` + 1
    (one forward per optimizer step: step ``at``)."""

    @staticmethod
    def make(inner: Any, at: int, weight: float) -> Any:
        import torch

        class Scaled(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.inner, self.calls = inner, 0

            def forward(self, input_ids: Any, labels: Any = None) -> Any:
                out = self.inner(input_ids=input_ids, labels=labels)
                self.calls += 1
                if self.calls == at + 1:
                    out["loss"] = out["loss"] * weight
                return out

        return Scaled()


def _hf(name: str) -> None:
    import torch

    from bench.unseen import kit

    vocab = 40
    if "bert" in name:

        def row(i: int) -> Dict[str, Any]:
            g = kit.seeded(54_100 + i)
            label = int(torch.randint(0, 2, (1,), generator=g))
            ids = torch.randint(0, vocab // 2, (16,), generator=g) + label * (vocab // 2)
            if float(torch.rand(1, generator=g)) < 0.3:
                label = int(torch.randint(0, 2, (1,), generator=g))
            return {"input_ids": ids, "labels": torch.tensor(label)}

        model = kit.hf_model("bert", vocab, width=48, positions=16)
        high = name.endswith("lr_high")
        kit.hf_train(
            model,
            kit.Rows(100_000, row),
            "/tmp/trainguard-tuning44-bert",
            250,
            3e-2 if high else 5e-4,
            batch=8 if high else 2,
            optim="adamw_torch",
            logging_steps=1,
        )
    else:
        model = _Scaled.make(kit.hf_model("gpt2", vocab, width=48), 200, 100.0)
        kit.hf_train(
            model,
            kit.Rows(100_000, kit.lm_rows(vocab, 24, 3, seed=54_200)),
            "/tmp/trainguard-tuning44-gpt2",
            250,
            3e-3,
            batch=8,
            optim="adamw_torch",
            logging_steps=1,
        )


def _lora(name: str) -> None:
    import torch
    from peft import LoraConfig, get_peft_model

    from bench.unseen import kit

    vocab = 40
    base = kit.pretrained(kit.hf_model("llama", vocab, width=48), kit.lm_rows(vocab, 32, 3, seed=54_300))
    config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    model = get_peft_model(base, config)
    o = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], 0.3 if name.endswith("lr_high") else 2e-3
    )
    clean = kit.lm_rows(vocab, 32, 6, seed=54_400)

    def row(i: int) -> Dict[str, Any]:
        g = kit.seeded(54_500 + i)
        if float(torch.rand(1, generator=g)) < 0.2:
            ids = torch.randint(0, vocab, (32,), generator=g)
            return {"input_ids": ids, "labels": ids.clone()}
        return clean(i)

    kit.loop(kit.HFLogits(model), o, kit.lm_batches(row, bs=2), kit.ce, 250)


def _lightning(name: str) -> None:
    import pytorch_lightning as pl
    import torch
    import torch.nn.functional as F

    from bench.unseen import kit

    if "tdf2" in name:
        w = torch.randn(8, generator=kit.seeded(54_600))
        t_noise = torch.distributions.StudentT(2.0)

        def row(i: int) -> Any:
            g = kit.seeded(54_700 + i)
            x = torch.randn(8, generator=g)
            return x, torch.sin(x @ w).reshape(1) + 0.5 * t_noise.sample((1,))

        batch, n_steps, loss_fn = 2, 300, F.smooth_l1_loss
    else:
        w = torch.randn(8, 3, generator=kit.seeded(54_800))

        def row(i: int) -> Any:
            x = torch.randn(8, generator=kit.seeded(54_900 + i))
            return x, torch.sin(x @ w).sum().reshape(1)

        batch, n_steps, loss_fn = 32, 300, F.mse_loss
    net = kit.mlp([8, 64, 64, 1], torch.nn.SiLU)

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = net

        def training_step(self, b: Any, batch_idx: int) -> Any:
            x, y = b
            loss = loss_fn(self.net(x), y)
            if name.endswith("bad_batch") and batch_idx == 220:
                loss = loss * 30.0
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self) -> Any:
            if name.endswith("lr_high"):
                return torch.optim.SGD(self.parameters(), 0.3, momentum=0.9)
            return torch.optim.Adam(self.parameters(), 3e-3 if "regress" in name else 1e-3)

    kit.lightning_fit(Model(), kit.Rows(batch * n_steps, row), n_steps, batch=batch)
