#!/usr/bin/env python3
"""Stop 42's HELD-OUT set of unseen training shapes (set ``heldout42``): written and committed, with its
expectations, seeds and scoring rules (probe.py's trace rules, unchanged), BEFORE any of it ran (a 3-step
smoke aside, keeping only its 'recorded'/'FAILED' lines) and before the stop's detector changes; recorded
once; judged ONCE with the stop's starting engine and ONCE with the engine kept at the end, aggregates
only. Never tuned on.

20 shapes, 10 healthy / 10 planted faults, each fault with a healthy counterpart. Models and combinations
of no earlier set's: a small convolutional encoder-decoder denoiser (ConvTranspose2d, one skip) under
AdamW + cosine (one batch of inputs x2000); an embedding dot-product recommender under Adagrad (one
batch's ratings x500, wrong units); a highway (gated) MLP regressor of heavy-tailed targets under NAdam
(healthy with natural loss spikes; and NAdam at 1000x); an Elman (tanh) RNN character model under Adagrad
(a label-smoothing term that takes log(0) from step 150); the HF Trainer with a Llama causal LM under
adamw_torch + polynomial decay, no clip (pauses; one step's loss x5000) and a BERT classifier under
rmsprop + constant_with_warmup (and at 1000x); peft LoRA on a pre-trained Qwen2's q/v_proj under the HF
Trainer with adafactor (one step's loss x1000) and on a pre-trained GPT-NeoX's query_key_value in a plain
loop under SGD momentum (healthy with an all-random batch now and then; an LR schedule that drops to 0
after step 10); in Lightning, a Transformer-encoder classifier under AdamW + OneCycleLR (batch 130's loss
x1000) and a pinball-loss (quantile) MLP on log-normal targets under RMSprop (healthy, natural spikes;
one input +Inf from batch 140).

Every shape is seeded: ``torch.manual_seed(0)`` (bench.unseen.shapes.main) and the fixed data seeds below
(47_000+: none used by another set).
"""

from __future__ import annotations

import time
from typing import Any, Dict, Tuple

from bench.unseen.sets import HEALTHY, LR_TOO_HIGH, Expectations

NAN = "loss/non_finite|gradient/nan-source"
STALL = "loss/plateau"
BAD_BATCH = (
    "loss/divergence|loss/rise-after-fall|loss/oscillation|gradient/explosion"
    "|loss/non_finite|gradient/nan-source|loss/spike|gradient/spike"
)
"""One bad batch: any curve / gradient kind that says the run was hit (a one-step spike kind included)."""

SHAPES: Expectations = {
    # plain loops
    "ho12_plain_unet_adamw_ok": (
        HEALTHY,
        "conv encoder-decoder denoiser (stride-2 conv down, ConvTranspose2d up, one skip) on noisy 12x12 "
        "prototypes, MSE, AdamW 1e-3, CosineAnnealingLR(250)",
    ),
    "ho12_plain_unet_adamw_bad_batch": (BAD_BATCH, "the same, step 140's inputs x2000"),
    "ho12_plain_recsys_adagrad_ok": (
        HEALTHY,
        "embedding dot-product recommender (200 users, 150 items, dim 16, biases) of rank-4 ratings, MSE, "
        "Adagrad 0.05, 250 steps",
    ),
    "ho12_plain_recsys_adagrad_bad_batch": (BAD_BATCH, "the same, step 120's ratings x500 (wrong units)"),
    "ho12_plain_highway_nadam_spiky_ok": (
        HEALTHY,
        "highway (gated) MLP regressor, targets + Student-t (df 2.2) noise (natural loss spikes), NAdam 2e-3",
    ),
    "ho12_plain_highway_nadam_lr1000x": (LR_TOO_HIGH, "the same at NAdam 2.0 (1000x)"),
    "ho12_plain_elman_adagrad_ok": (
        HEALTHY,
        "Elman (tanh) RNN character model (vocab 24, hidden 64), label-smoothed CE written by hand, "
        "Adagrad 0.05, 250 steps",
    ),
    "ho12_plain_elman_adagrad_log_zero": (
        NAN,
        "the same; from step 150 the smoothing term takes log of a softmax at temperature 1/200 (log 0)",
    ),
    # HF Trainer
    "ho12_hf_llama_adamw_pauses_ok": (
        HEALTHY,
        "HF Trainer, Llama 2x48 causal LM, adamw_torch 1e-3, polynomial decay, warmup 10, no clip, log 1; "
        "a 1.0 s pause every 60 steps",
    ),
    "ho12_hf_llama_adamw_bad_batch": (BAD_BATCH, "the same without pauses, step 130's loss x5000"),
    "ho12_hf_bert_rmsprop_ok": (
        HEALTHY,
        "HF Trainer, BERT 2x48 classifier (3 classes), rmsprop 2e-4, constant_with_warmup 10, log 1",
    ),
    "ho12_hf_bert_rmsprop_lr1000x": (LR_TOO_HIGH, "the same at 0.2 (1000x)"),
    # peft
    "ho12_lora_qwen2_hf_adafactor_ok": (
        HEALTHY,
        "peft LoRA r=8 on a pre-trained tiny Qwen2's q_proj/v_proj, HF Trainer adafactor 2e-3, linear, log 1",
    ),
    "ho12_lora_qwen2_hf_adafactor_bad_batch": (BAD_BATCH, "the same, step 150's loss x1000"),
    "ho12_lora_neox_plain_sgdm_hard_batches_ok": (
        HEALTHY,
        "peft LoRA r=8 on a pre-trained tiny GPT-NeoX's query_key_value, plain loop SGD momentum 0.9 "
        "lr 0.05; every 19th batch is random tokens (natural loss spikes)",
    ),
    "ho12_lora_neox_plain_sgdm_lr_vanishes": (
        STALL,
        "the same without random batches; its LR schedule drops to 0 after step 10 (a units bug)",
    ),
    # Lightning
    "ho12_pl_encoder_adamw_onecycle_ok": (
        HEALTHY,
        "Lightning Transformer-encoder classifier (2x48, mean-pooled) of token sequences, AdamW, "
        "OneCycleLR(max 2e-3) per step, 250 steps",
    ),
    "ho12_pl_encoder_adamw_onecycle_bad_batch": (BAD_BATCH, "the same, batch 130's loss x1000"),
    "ho12_pl_quantile_rmsprop_spiky_ok": (
        HEALTHY,
        "Lightning MLP quantile regressor (pinball loss, q 0.9) of log-normal targets (natural spikes), "
        "RMSprop 1e-3, 250 steps",
    ),
    "ho12_pl_quantile_rmsprop_inf_input": (NAN, "the same, from batch 140 one input feature +Inf"),
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

    if family == "unet":
        proto = torch.randn(6, 1, 12, 12, generator=kit.seeded(47_001))

        def noisy(bs: int = 32) -> Tuple[Any, Any]:
            clean = proto[torch.randint(0, 6, (bs,))]
            x = clean + 0.5 * torch.randn(bs, 1, 12, 12)
            if name.endswith("bad_batch") and step[0] == 140:
                x = x * 2000.0
            return x, clean

        class Denoiser(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.a = nn.Conv2d(1, 16, 3, padding=1)
                self.down = nn.Conv2d(16, 32, 3, stride=2, padding=1)
                self.up = nn.ConvTranspose2d(32, 16, 2, stride=2)
                self.o = nn.Conv2d(32, 1, 3, padding=1)

            def forward(self, x: Any) -> Any:
                h = F.relu(self.a(x))
                u = F.relu(self.up(F.relu(self.down(h))))
                return self.o(torch.cat([h, u], 1))

        m: Any = Denoiser()
        o: Any = torch.optim.AdamW(m.parameters(), 1e-3)
        s: Any = torch.optim.lr_scheduler.CosineAnnealingLR(o, 250)
        kit.loop(m, o, noisy, F.mse_loss, 250, s, hook=at)
    elif family == "recsys":
        g = kit.seeded(47_002)
        users, items = torch.randn(200, 4, generator=g), torch.randn(150, 4, generator=g)

        def ratings(bs: int = 128) -> Tuple[Any, Any]:
            u, i = torch.randint(0, 200, (bs,)), torch.randint(0, 150, (bs,))
            r = (users[u] * items[i]).sum(1) / 2 + 0.1 * torch.randn(bs)
            if name.endswith("bad_batch") and step[0] == 120:
                r = r * 500.0
            return torch.stack([u, i], 1), r

        class DotRec(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.u, self.i = nn.Embedding(200, 16), nn.Embedding(150, 16)
                self.ub, self.ib = nn.Embedding(200, 1), nn.Embedding(150, 1)
                for e in (self.u, self.i):
                    nn.init.normal_(e.weight, std=0.3)

            def forward(self, ui: Any) -> Any:
                u, i = ui[:, 0], ui[:, 1]
                return (self.u(u) * self.i(i)).sum(1) + self.ub(u)[:, 0] + self.ib(i)[:, 0]

        m = DotRec()
        o = torch.optim.Adagrad(m.parameters(), 0.05)
        kit.loop(m, o, ratings, F.mse_loss, 250, hook=at)
    elif family == "highway":
        w = torch.randn(10, 4, generator=kit.seeded(47_003))
        t_noise = torch.distributions.StudentT(2.2)

        def rows(bs: int = 64) -> Tuple[Any, Any]:
            x = torch.randn(bs, 10)
            return x, torch.sin(x @ w).sum(-1, keepdim=True) + 0.3 * t_noise.sample((bs, 1))

        class Highway(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.i, self.o = nn.Linear(10, 64), nn.Linear(64, 1)
                self.h = nn.ModuleList(nn.Linear(64, 64) for _ in range(3))
                self.t = nn.ModuleList(nn.Linear(64, 64) for _ in range(3))

            def forward(self, x: Any) -> Any:
                z = F.relu(self.i(x))
                for h, t in zip(self.h, self.t):
                    gate = torch.sigmoid(t(z))
                    z = gate * F.relu(h(z)) + (1 - gate) * z
                return self.o(z)

        m = Highway()
        o = torch.optim.NAdam(m.parameters(), 2.0 if name.endswith("lr1000x") else 2e-3)
        kit.loop(m, o, rows, F.mse_loss, 250)
    elif family == "elman":
        vocab = 24
        batch = kit.lm_batches(kit.lm_rows(vocab, 20, 3, seed=47_004), bs=24)

        class Elman(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.e, self.r = nn.Embedding(vocab, 32), nn.RNN(32, 64, batch_first=True)
                self.o = nn.Linear(64, vocab)

            def forward(self, x: Any) -> Any:
                return self.o(self.r(self.e(x))[0])

        def smoothed(out: Any, y: Any) -> Any:
            logits = out.reshape(-1, vocab)
            ce = F.cross_entropy(logits, y.reshape(-1))
            hot = name.endswith("log_zero") and step[0] >= 150
            logp = torch.log(torch.softmax(logits * (200.0 if hot else 1.0), -1))
            return 0.9 * ce - 0.1 * logp.mean()

        m = Elman()
        o = torch.optim.Adagrad(m.parameters(), 0.05)
        kit.loop(m, o, batch, smoothed, 250, hook=at)
    else:
        raise SystemExit(f"unknown held-out plain shape {name}")


class _Scaled:
    """Builds an ``nn.Module`` around an HF model whose loss is multiplied by ``weight`` on forward number
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
    from transformers import TrainerCallback

    from bench.unseen import kit

    vocab = 40
    if name.startswith("ho12_hf_llama"):
        inner = kit.hf_model("llama", vocab, width=48, positions=32)
        model = _Scaled.make(inner, 130, 5000.0 if name.endswith("bad_batch") else 1.0)

        class Pauses(TrainerCallback):  # type: ignore[misc]
            def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
                if state.global_step % 60 == 0:
                    time.sleep(1.0)

        kit.hf_train(
            model,
            kit.Rows(100_000, kit.lm_rows(vocab, 24, 5, seed=47_100)),
            "/tmp/trainguard-heldout42-llama",
            250,
            1e-3,
            callbacks=[Pauses()] if name.endswith("pauses_ok") else [],
            optim="adamw_torch",
            lr_scheduler_type="polynomial",
            warmup_steps=10,
            max_grad_norm=0.0,
            logging_steps=1,
        )
        return
    bert = kit.hf_model("bert", vocab, width=48, positions=32, labels=3)

    def row(i: int) -> Dict[str, Any]:
        ids = torch.randint(0, vocab, (16,), generator=kit.seeded(47_200 + i))
        label = int((ids < 13).sum() > 5) + int((ids > 30).sum() > 4)
        return {"input_ids": ids, "labels": label}

    kit.hf_train(
        bert,
        kit.Rows(100_000, row),
        "/tmp/trainguard-heldout42-bert",
        250,
        0.2 if name.endswith("lr1000x") else 2e-4,
        optim="rmsprop",
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
    sizes = dict(
        vocab_size=vocab,
        hidden_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=96,
        max_position_embeddings=32,
    )
    if name.startswith("ho12_lora_qwen2"):
        base = kit.pretrained(
            tf.Qwen2ForCausalLM(tf.Qwen2Config(num_key_value_heads=4, **sizes)),
            kit.lm_rows(vocab, 32, 3, seed=47_300),
        )
        config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
        model = _Scaled.make(get_peft_model(base, config), 150, 1000.0 if name.endswith("bad_batch") else 1.0)
        kit.hf_train(
            model,
            kit.Rows(100_000, kit.lm_rows(vocab, 32, 6, seed=47_400)),
            "/tmp/trainguard-heldout42-qwen2",
            250,
            2e-3,
            optim="adafactor",
            lr_scheduler_type="linear",
            logging_steps=1,
        )
        return
    base = kit.pretrained(
        tf.GPTNeoXForCausalLM(tf.GPTNeoXConfig(**sizes)), kit.lm_rows(vocab, 32, 3, seed=47_500)
    )
    config = LoraConfig(r=8, lora_alpha=16, target_modules=["query_key_value"], lora_dropout=0.0)
    model = get_peft_model(base, config)
    o = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], 0.05, momentum=0.9)
    vanish = name.endswith("lr_vanishes")
    s = torch.optim.lr_scheduler.LambdaLR(o, lambda t: 0.0 if vanish and t >= 10 else 1.0)
    easy = kit.lm_rows(vocab, 32, 6, seed=47_600)

    def row(i: int) -> Dict[str, Any]:
        if name.endswith("hard_batches_ok") and (i // 16) % 19 == 11:
            ids = torch.randint(0, vocab, (32,), generator=kit.seeded(47_700 + i))
            return {"input_ids": ids, "labels": ids.clone()}
        return easy(i)

    kit.loop(kit.HFLogits(model), o, kit.lm_batches(row), kit.ce, 250, s)


def _lightning(name: str) -> None:
    import pytorch_lightning as pl
    import torch
    import torch.nn.functional as F

    from bench.unseen import kit

    kind = name.split("_")[2]
    if kind == "encoder":
        vocab = 30

        def row(i: int) -> Any:
            g = kit.seeded(47_800 + i)
            ids = torch.randint(0, vocab, (20,), generator=g)
            return ids, int((ids[:10] < 15).sum() > 5) + int((ids[10:] < 10).sum() > 3)

        net: Any = kit.Encoder(vocab, 3, positions=20, width=48, layers=2, dropout=0.0)
    else:
        w = torch.randn(8, generator=kit.seeded(47_900))

        def row(i: int) -> Any:
            g = kit.seeded(48_000 + i)
            x = torch.randn(8, generator=g)
            y = torch.exp(0.5 * (x @ w) / 3 + 0.6 * torch.randn(1, generator=g))
            if name.endswith("inf_input") and i >= 32 * 140 and i % 32 == 7:
                x = x.clone()
                x[3] = float("inf")
            return x, y

        net = kit.mlp([8, 64, 64, 1])

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = net

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            x, y = batch
            out = self.net(x)
            if kind == "encoder":
                loss = F.cross_entropy(out, y)
                if name.endswith("bad_batch") and batch_idx == 130:
                    loss = loss * 1000.0
            else:
                err = y - out
                loss = torch.maximum(0.9 * err, -0.1 * err).mean()
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self) -> Any:
            if kind == "encoder":
                o: Any = torch.optim.AdamW(self.parameters(), 2e-3)
                s = torch.optim.lr_scheduler.OneCycleLR(o, 2e-3, total_steps=250)
                return {"optimizer": o, "lr_scheduler": {"scheduler": s, "interval": "step"}}
            return torch.optim.RMSprop(self.parameters(), 1e-3)

    kit.lightning_fit(Model(), kit.Rows(32 * 250, row), 250)
