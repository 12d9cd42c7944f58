#!/usr/bin/env python3
"""Stop 44's HELD-OUT set of unseen training shapes (set ``heldout44``): written and committed, with its
expectations, seeds and scoring rules (probe.py's trace rules plus stop 44's jump rule,
:data:`bench.unseen.sets.JUMP_RULE`), BEFORE any of it ran (a 3-step smoke at most) and before the stop's
detector changes; recorded once from a clean archive; judged ONCE with the stop's starting engine (8a4d3d8)
and ONCE with the engine kept at the end, aggregates only. Never tuned on.

16 shapes, 8 healthy / 8 planted faults. The stop's questions: healthy runs whose per-step loss is noisy or
heavy-tailed (tiny batches, noisy labels or preferences, heavy-tailed targets) must not read as
loss/oscillation while a learning rate far too high still does; one bad batch on a run that learned far
below its start must be caught while converged runs stay quiet. Models of no earlier set's: an
embedding-table tabular classifier, a pairwise ranking (RankNet) scorer, an L1 regressor on heavy-tailed
targets, a convolutional autoencoder, a SIREN (sine-activation) signal fitter, an HF RoBERTa classifier,
peft LoRA on a pre-trained tiny Gemma, a Lightning 1-D CNN sequence classifier and a Lightning GRU regressor.

* plain loops: the tabular classifier with 35 % random labels under RMSprop, batch 2 (healthy; and at LR
  100x); RankNet with 30 % flipped preferences under Adam, batch 2 (healthy); the L1 regressor on Student-t
  (df 2.5) targets under Adagrad, batch 2 (healthy); the autoencoder under AdamW (healthy, converges far
  below its start; and step 230's loss x100); the SIREN under Adam (step 220's loss x200);
* the HF Trainer: RoBERTa at batch 2 with 25 % random labels (healthy; and at LR 5e-2, batch 8); the same
  on clean labels, batch 8, converged far below its start (step 200's loss x30);
* peft: LoRA r=8 on a pre-trained tiny Gemma's q_proj/v_proj, batch 2, 20 % random rows (healthy; and at LR
  0.5);
* Lightning: the 1-D CNN with 30 % random labels under SGD momentum, batch 4 (healthy; and at LR 1.0,
  100x); the GRU regressor under Adam, batch 16 (healthy, converges far below its start; and batch 200's loss
  x50).

Every shape is seeded: ``torch.manual_seed(0)`` (bench.unseen.shapes.main) and the fixed data seeds below
(55_000+: none used by another set).
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
    "ho14_plain_tabular_rmsprop_noisy_bs2_ok": (
        HEALTHY,
        "tabular classifier (3 categorical features through embedding tables + 4 numeric), 6 classes, "
        "35 % of the labels random, RMSprop 1e-3, batch 2, 300 steps",
    ),
    "ho14_plain_tabular_rmsprop_noisy_bs2_lr100x": (LR_TOO_HIGH, "the same at RMSprop 0.1 (100x)"),
    "ho14_plain_ranknet_adam_noisy_bs2_ok": (
        HEALTHY,
        "RankNet scorer (BCE on score differences of item pairs), 30 % of the preferences flipped, "
        "Adam 1e-3, batch 2, 300 steps",
    ),
    "ho14_plain_l1_adagrad_heavy_bs2_ok": (
        HEALTHY,
        "MLP regressor, L1 loss, targets + Student-t (df 2.5) noise, Adagrad 0.05, batch 2, 300 steps",
    ),
    "ho14_plain_autoenc_adamw_ok": (
        HEALTHY,
        "convolutional autoencoder of noisy prototype images, MSE, AdamW 2e-3, batch 16, 300 steps "
        "(converges far below its start)",
    ),
    "ho14_plain_autoenc_adamw_far_bad_batch": (BAD_BATCH, "the same, step 230's loss x100"),
    "ho14_plain_siren_adam_far_bad_batch": (
        BAD_BATCH,
        "SIREN (sine activations) fitting a 1-D signal, MSE, Adam 1e-3, batch 64, 300 steps, step 220's "
        "loss x200",
    ),
    # HF Trainer
    "ho14_hf_roberta_noisy_bs2_ok": (
        HEALTHY,
        "HF Trainer, RoBERTa 2x48 classifier, 25 % of the labels random, adamw_torch 1e-3, "
        "constant_with_warmup (10), batch 2, log 1, 250 steps",
    ),
    "ho14_hf_roberta_lr_high": (LR_TOO_HIGH, "the same at lr 5e-2 (50x), batch 8"),
    "ho14_hf_roberta_clean_far_bad_batch": (
        BAD_BATCH,
        "the same on clean labels, batch 8 (converges far below its start), step 200's loss x30",
    ),
    # peft
    "ho14_lora_gemma_bs2_ok": (
        HEALTHY,
        "peft LoRA r=8 on a pre-trained tiny Gemma's q_proj/v_proj, plain loop Adam 2e-3, batch 2, 20 % "
        "random rows, 250 steps",
    ),
    "ho14_lora_gemma_lr_high": (LR_TOO_HIGH, "the same at Adam 0.5 (250x)"),
    # Lightning
    "ho14_pl_conv1d_sgdm_noisy_bs4_ok": (
        HEALTHY,
        "Lightning 1-D CNN classifying noisy sequences (3 classes), 30 % of the labels random, SGD momentum "
        "0.9 lr 0.01, batch 4, 300 steps",
    ),
    "ho14_pl_conv1d_sgdm_lr100x": (LR_TOO_HIGH, "the same at lr 1.0 (100x)"),
    "ho14_pl_gru_adam_ok": (
        HEALTHY,
        "Lightning GRU regressing a noisy sequence's weighted sum, MSE, Adam 3e-3, batch 16, 300 steps "
        "(converges far below its start)",
    ),
    "ho14_pl_gru_adam_far_bad_batch": (BAD_BATCH, "the same, batch 200's loss x50"),
}


def run(name: str) -> None:
    """Run one held-out shape (``trainguard.init`` already called)."""
    {"plain": _plain, "hf": _hf, "pl": _lightning, "lora": _lora}[name.split("_")[1]](name)


def _plain(name: str) -> None:
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

    if family == "tabular":
        g = kit.seeded(55_001)
        table = torch.randn(3, 10, 6, generator=g)
        mix = torch.randn(4, 6, generator=g)

        def rows(bs: int = 2) -> Tuple[Any, Any]:
            cats = torch.randint(0, 10, (bs, 3))
            num = torch.randn(bs, 4)
            score = sum(table[k][cats[:, k]] for k in range(3)) + num @ mix
            y = score.argmax(1)
            y = torch.where(torch.rand(bs) < 0.35, torch.randint(0, 6, (bs,)), y)
            return torch.cat([cats.float(), num], 1), y

        class Tabular(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.emb = nn.ModuleList(nn.Embedding(10, 8) for _ in range(3))
                self.head = kit.mlp([3 * 8 + 4, 64, 6])

            def forward(self, x: Any) -> Any:
                parts = [e(x[:, k].long()) for k, e in enumerate(self.emb)]
                return self.head(torch.cat([*parts, x[:, 3:]], 1))

        m: Any = Tabular()
        o: Any = torch.optim.RMSprop(m.parameters(), 0.1 if name.endswith("lr100x") else 1e-3)
        kit.loop(m, o, rows, F.cross_entropy, 300)
    elif family == "ranknet":
        w = torch.randn(10, generator=kit.seeded(55_002))

        def pairs(bs: int = 2) -> Tuple[Any, Any]:
            a, b = torch.randn(bs, 10), torch.randn(bs, 10)
            pref = ((a - b) @ w > 0).float()
            pref = torch.where(torch.rand(bs) < 0.3, 1 - pref, pref)
            return torch.cat([a, b], 1), pref

        scorer = kit.mlp([10, 32, 32, 1], nn.Tanh)

        class RankNet(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.s = scorer

            def forward(self, ab: Any) -> Any:
                return (self.s(ab[:, :10]) - self.s(ab[:, 10:]))[:, 0]

        m = RankNet()
        o = torch.optim.Adam(m.parameters(), 1e-3)
        kit.loop(m, o, pairs, F.binary_cross_entropy_with_logits, 300)
    elif family == "l1":
        w = torch.randn(8, generator=kit.seeded(55_003))
        t_noise = torch.distributions.StudentT(2.5)

        def rows(bs: int = 2) -> Tuple[Any, Any]:
            x = torch.randn(bs, 8)
            return x, (torch.tanh(x @ w) * 2).unsqueeze(1) + 0.5 * t_noise.sample((bs, 1))

        m = kit.mlp([8, 64, 64, 1])
        o = torch.optim.Adagrad(m.parameters(), 0.05)
        kit.loop(m, o, rows, F.l1_loss, 300)
    elif family == "autoenc":
        proto = torch.randn(5, 1, 12, 12, generator=kit.seeded(55_004))

        def images(bs: int = 16) -> Tuple[Any, Any]:
            x = proto[torch.randint(0, 5, (bs,))] + 0.1 * torch.randn(bs, 1, 12, 12)
            return x, x

        m = nn.Sequential(
            nn.Conv2d(1, 8, 3, padding=1, stride=2),
            nn.ReLU(),
            nn.Conv2d(8, 16, 3, padding=1, stride=2),
            nn.ReLU(),
            nn.ConvTranspose2d(16, 8, 2, stride=2),
            nn.ReLU(),
            nn.ConvTranspose2d(8, 1, 2, stride=2),
        )
        o = torch.optim.AdamW(m.parameters(), 2e-3)
        kit.loop(m, o, images, weighted(F.mse_loss, 230, 100.0), 300, hook=at)
    elif family == "siren":
        freq = 1.0 + 4.0 * torch.rand(3, generator=kit.seeded(55_005))

        def signal(bs: int = 64) -> Tuple[Any, Any]:
            t = torch.rand(bs, 1) * 2 - 1
            return t, sum(torch.sin(f * 3.1416 * t) / (k + 1) for k, f in enumerate(freq))

        class Sine(nn.Module):
            def forward(self, x: Any) -> Any:
                return torch.sin(3.0 * x)

        m = nn.Sequential(nn.Linear(1, 64), Sine(), nn.Linear(64, 64), Sine(), nn.Linear(64, 1))
        o = torch.optim.Adam(m.parameters(), 1e-3)
        kit.loop(m, o, signal, weighted(F.mse_loss, 220, 200.0), 300, hook=at)
    else:
        raise SystemExit(f"unknown held-out plain shape {name}")


class _Scaled:
    """An ``nn.Module`` around an HF classifier whose loss is multiplied by ``weight`` on forward number
    ``at`` + 1 (one forward per optimizer step: step ``at``)."""

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
    import transformers as tf

    from bench.unseen import kit

    vocab = 48
    noisy = "noisy" in name

    def row(i: int) -> Dict[str, Any]:
        g = kit.seeded(55_100 + i)
        label = int(torch.randint(0, 3, (1,), generator=g))
        ids = torch.randint(4, 4 + 14, (16,), generator=g) + label * 14
        ids[0] = 0
        if noisy and float(torch.rand(1, generator=g)) < 0.25:
            label = int(torch.randint(0, 3, (1,), generator=g))
        return {"input_ids": ids, "labels": torch.tensor(label)}

    roberta = tf.RobertaForSequenceClassification(
        tf.RobertaConfig(
            vocab_size=vocab,
            hidden_size=48,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=96,
            max_position_embeddings=40,
            num_labels=3,
            pad_token_id=1,
        )
    )
    model = _Scaled.make(roberta, 200, 30.0 if name.endswith("bad_batch") else 1.0)
    high = name.endswith("lr_high")
    kit.hf_train(
        model,
        kit.Rows(100_000, row),
        "/tmp/trainguard-heldout44-roberta",
        250,
        5e-2 if high else 1e-3,
        batch=2 if noisy else 8,
        optim="adamw_torch",
        lr_scheduler_type="constant_with_warmup",
        warmup_steps=10,
        logging_steps=1,
    )


def _lora(name: str) -> None:
    import torch
    import transformers as tf
    from peft import LoraConfig, get_peft_model

    from bench.unseen import kit

    vocab = 40
    base = kit.pretrained(
        tf.GemmaForCausalLM(
            tf.GemmaConfig(
                vocab_size=vocab,
                hidden_size=48,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=12,
                intermediate_size=96,
                max_position_embeddings=32,
            )
        ),
        kit.lm_rows(vocab, 32, 3, seed=55_300),
    )
    config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    model = get_peft_model(base, config)
    o = torch.optim.Adam(
        [p for p in model.parameters() if p.requires_grad], 0.5 if name.endswith("lr_high") else 2e-3
    )
    clean = kit.lm_rows(vocab, 32, 5, seed=55_400)

    def row(i: int) -> Dict[str, Any]:
        g = kit.seeded(55_500 + i)
        if float(torch.rand(1, generator=g)) < 0.2:
            ids = torch.randint(0, vocab, (32,), generator=g)
            return {"input_ids": ids, "labels": ids.clone()}
        return clean(i)

    kit.loop(kit.HFLogits(model), o, kit.lm_batches(row, bs=2), kit.ce, 250)


def _lightning(name: str) -> None:
    import pytorch_lightning as pl
    import torch
    import torch.nn.functional as F
    from torch import nn

    from bench.unseen import kit

    if "conv1d" in name:
        bank = torch.randn(3, 24, generator=kit.seeded(55_600))

        def row(i: int) -> Any:
            g = kit.seeded(55_700 + i)
            label = int(torch.randint(0, 3, (1,), generator=g))
            x = bank[label] + 1.0 * torch.randn(24, generator=g)
            if float(torch.rand(1, generator=g)) < 0.3:
                label = int(torch.randint(0, 3, (1,), generator=g))
            return x[None, :], label

        net: Any = nn.Sequential(
            nn.Conv1d(1, 16, 5, padding=2),
            nn.ReLU(),
            nn.Conv1d(16, 16, 5, padding=2),
            nn.ReLU(),
            nn.AdaptiveAvgPool1d(1),
            nn.Flatten(),
            nn.Linear(16, 3),
        )
        batch, n_steps, loss_fn = 4, 300, F.cross_entropy
    else:
        wts = torch.linspace(-1, 1, 12)

        def row(i: int) -> Any:
            x = torch.randn(12, 1, generator=kit.seeded(55_800 + i))
            return x, (x[:, 0] * wts).sum().reshape(1)

        class GRU(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.rnn, self.o = nn.GRU(1, 32, batch_first=True), nn.Linear(32, 1)

            def forward(self, x: Any) -> Any:
                return self.o(self.rnn(x)[0][:, -1])

        net = GRU()
        batch, n_steps, loss_fn = 16, 300, F.mse_loss

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = net

        def training_step(self, b: Any, batch_idx: int) -> Any:
            x, y = b
            loss = loss_fn(self.net(x), y)
            if name.endswith("bad_batch") and batch_idx == 200:
                loss = loss * 50.0
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self) -> Any:
            if "conv1d" in name:
                lr = 1.0 if name.endswith("lr100x") else 0.01
                return torch.optim.SGD(self.parameters(), lr, momentum=0.9)
            return torch.optim.Adam(self.parameters(), 3e-3)

    kit.lightning_fit(Model(), kit.Rows(batch * n_steps, row), n_steps, batch=batch)
