#!/usr/bin/env python3
"""Stop 37's HELD-OUT set of unseen training shapes (set ``heldout37``): written and committed, with its
expectations, seeds and scoring rules (probe.py's trace rules, unchanged), BEFORE any of it ran and before
the stop's detector changes; to be run ONCE, at the end, with the engine kept (and the stop's starting
engine beside it, on the same recordings). Never tuned on; only aggregates are read.

New against every other set and bench/corpus: a small pre-norm GPT trained by a plain loop, a ViT with a
class token and a 4x4 patch stem, a strided BatchNorm CNN under RMSprop + StepLR, an LSTM LM on a running-sum
task with gradient accumulation, a residual-free MLP regressor under SGD + momentum, a 3-layer GPT-2 under
the HF Trainer with transformers' Adafactor and gradient accumulation, a BERT classifier under the HF
Trainer without clipping, a Lightning residual MLP under RMSprop + OneCycle in bf16-mixed with gradient
accumulation, a Lightning CNN under SGD + momentum + StepLR, a peft LoRA on a tiny Llama's q/v projections.
Faults: an LR too high (x50 .. x1000, with and without clipping), NaN inputs, dead gradients (a frozen
network, a frozen LoRA B), an LR schedule that vanishes, a bad batch (targets x1000 for one step) that
knocks an SGD + momentum model off.

Every shape is seeded: ``torch.manual_seed(0)`` (bench.unseen.shapes.main) and the fixed data seeds below.
"""

from __future__ import annotations

from typing import Any, Dict, Tuple

from bench.unseen.sets import HEALTHY, LR_TOO_HIGH, Expectations

NAN = "gradient/nan-source|loss/non_finite"
STALL = "loss/plateau"
DEAD_ADAPTER = "adapter/lora-grad-break|loss/plateau"
BAD_BATCH = (
    "loss/divergence|loss/rise-after-fall|loss/oscillation|gradient/explosion"
    "|loss/non_finite|gradient/nan-source"
)
"""A bad batch whose one huge update knocks the model off: any of the curve / gradient kinds that say so."""

SHAPES: Expectations = {
    # plain loops
    "ho3_plain_gpt_adamw_cosine_bf16_ok": (
        HEALTHY,
        "small pre-norm GPT (2x48) on strided sequences, AdamW 1e-3, warmup 20 + cosine, bf16, clip 1",
    ),
    "ho3_plain_gpt_adamw_lr300x": (LR_TOO_HIGH, "the same at AdamW 0.3 (300x), fp32, no clip"),
    "ho3_plain_vit_sgdm_onecycle_ok": (
        HEALTHY,
        "ViT (class token, 4x4 patches, 3 blocks), 16x16 images, SGD mom. 0.9, OneCycle peak 0.05, accum 2",
    ),
    "ho3_plain_vit_sgdm_lr50x_clip": (LR_TOO_HIGH, "the same at a OneCycle peak 2.5 (50x), clip 1"),
    "ho3_plain_cnn_rmsprop_step_ok": (HEALTHY, "strided BatchNorm CNN, RMSprop 1e-3, StepLR(100, 0.5)"),
    "ho3_plain_cnn_rmsprop_nan_input": (NAN, "the same, one NaN input row from step 220"),
    "ho3_plain_lstm_adagrad_accum_ok": (
        HEALTHY,
        "LSTM LM on a running sum mod 16, Adagrad 0.05, linear decay, clip 1, accumulation 4",
    ),
    "ho3_plain_lstm_adagrad_frozen": (
        STALL,
        "the same, every parameter frozen save the output bias (a freeze bug: dead gradients)",
    ),
    "ho3_plain_mlp_sgdm_linear_ok": (
        HEALTHY,
        "MLP regressor (3 hidden), SGD momentum 0.9 lr 0.01, linear decay",
    ),
    "ho3_plain_mlp_sgdm_bad_batch": (
        BAD_BATCH,
        "the same, one batch at step 150 with targets x1000 (a unit bug in one shard), no clip",
    ),
    "ho3_plain_mlp_sgdm_vanishing": (STALL, "the same, LambdaLR 0.6**step (LR ~0 by step 15)"),
    # HF Trainer (max_grad_norm 1 unless said)
    "ho3_hf_gpt2_adafactor_ok": (
        HEALTHY,
        "HF Trainer, GPT-2 3x48, transformers' Adafactor 1e-3, cosine + warmup 15, accumulation 2, logging 5",
    ),
    "ho3_hf_gpt2_adafactor_lr1000x": (LR_TOO_HIGH, "the same at 1.0 (1000x)"),
    "ho3_hf_bert_adamw_linear_ok": (
        HEALTHY,
        "HF Trainer, tiny BERT classifier, AdamW 2e-3, linear, no clipping (max_grad_norm 0), logging 5",
    ),
    "ho3_hf_bert_adamw_lr100x": (LR_TOO_HIGH, "the same at 0.2 (100x)"),
    # Lightning
    "ho3_pl_resmlp_rmsprop_onecycle_ok": (
        HEALTHY,
        "Lightning residual MLP regressor, RMSprop OneCycle peak 3e-3, bf16-mixed, accumulate 2",
    ),
    "ho3_pl_resmlp_rmsprop_lr300x": (LR_TOO_HIGH, "the same at a OneCycle peak 0.9 (300x)"),
    "ho3_pl_cnn_sgdm_step_ok": (
        HEALTHY,
        "Lightning BatchNorm CNN classifier, SGD momentum 0.9 lr 0.02, StepLR(150, 0.3), gradient_clip_val 1",
    ),
    "ho3_pl_cnn_sgdm_nan_input": (NAN, "the same, one NaN input row from step 160, no clip"),
    # peft LoRA (HF Trainer)
    "ho3_lora_llama_adamw_linear_ok": (
        HEALTHY,
        "peft LoRA r=8 on a pre-trained tiny Llama's q_proj + v_proj, AdamW 2e-3, linear, logging 5",
    ),
    "ho3_lora_llama_lr500x": (LR_TOO_HIGH, "the same at 1.0 (500x)"),
    "ho3_lora_llama_dead_adapter": (
        DEAD_ADAPTER,
        "the same, every lora_B frozen at its zero init (dead adapter gradients)",
    ),
}


def run(name: str) -> None:
    """Run one held-out shape (``trainguard.init`` already called)."""
    {"plain": _plain, "hf": _hf, "pl": _lightning, "lora": _lora}[name.split("_")[1]](name)


def _plain(name: str) -> None:
    import torch
    import torch.nn.functional as F
    from torch import nn

    from bench.unseen import kit

    loop, ce = kit.loop, kit.ce

    class ViT(nn.Module):
        def __init__(self, classes: int = 5, width: int = 40, blocks: int = 3) -> None:
            super().__init__()
            self.stem = nn.Conv2d(1, width, 4, 4)
            self.cls = nn.Parameter(torch.zeros(1, 1, width))
            self.pos = nn.Parameter(0.02 * torch.randn(1, 17, width))
            layer = nn.TransformerEncoderLayer(
                width, 4, 2 * width, dropout=0.0, batch_first=True, norm_first=True
            )
            self.t, self.n, self.o = (
                nn.TransformerEncoder(layer, blocks),
                nn.LayerNorm(width),
                nn.Linear(width, classes),
            )

        def forward(self, x: Any) -> Any:
            h = self.stem(x).flatten(2).transpose(1, 2)
            h = torch.cat([self.cls.expand(x.shape[0], -1, -1), h], 1) + self.pos
            return self.o(self.n(self.t(h)[:, 0]))

    def seq_batches(seed: int, bs: int = 16) -> Any:
        return kit.lm_batches(kit.lm_rows(40, 32, 4, seed=seed), bs)

    def running_sum(bs: int = 24) -> Tuple[Any, Any]:
        x = torch.randint(0, 16, (bs, 20))
        return x, torch.cumsum(x, 1) % 16

    w1 = torch.randn(12, 1, generator=kit.seeded(71))
    w2 = torch.randn(12, 1, generator=kit.seeded(72))
    bad = [False]

    def reg_batch(bs: int = 64) -> Tuple[Any, Any]:
        x = torch.randn(bs, 12)
        y = torch.sin(x @ w1) + 0.5 * (x @ w2) / 3 + 0.05 * torch.randn(bs, 1)
        return x, y * 1000.0 if bad[0] else y

    if name.startswith("ho3_plain_gpt"):
        m: nn.Module = kit.CausalLM(40, length=31, width=48, layers=2)
        high = name.endswith("lr300x")
        o: Any = torch.optim.AdamW(m.parameters(), 0.3 if high else 1e-3, weight_decay=0.01)
        s: Any = torch.optim.lr_scheduler.LambdaLR(o, kit.warmup_cosine(20, 400))
        loop(
            m,
            o,
            seq_batches(91_000),
            ce,
            400,
            s,
            clip=None if high else 1.0,
            autocast=None if high else torch.bfloat16,
        )
    elif name.startswith("ho3_plain_vit"):
        m = ViT()
        peak = 2.5 if name.endswith("lr50x_clip") else 0.05
        o = torch.optim.SGD(m.parameters(), peak / 25, momentum=0.9)
        s = torch.optim.lr_scheduler.OneCycleLR(o, peak, total_steps=400)
        loop(
            m,
            o,
            kit.image_batches(5, 16, 0.9, seed=93, bs=24),
            ce,
            400,
            s,
            clip=1.0 if "clip" in name else None,
            accum=2,
        )
    elif name.startswith("ho3_plain_cnn"):
        m = kit.bn_cnn(6, pool=False, channels=(12, 24))
        o = torch.optim.RMSprop(m.parameters(), 1e-3)
        s = torch.optim.lr_scheduler.StepLR(o, 100, 0.5)
        nan_at = 220 if name.endswith("nan_input") else None
        loop(m, o, kit.image_batches(6, 14, 1.1, seed=95), ce, 400, s, nan_at=nan_at)
    elif name.startswith("ho3_plain_lstm"):
        m = kit.RecurrentLM(16, 24, 64, "lstm")
        if name.endswith("frozen"):
            for pname, p in m.named_parameters():
                p.requires_grad_(pname == "o.bias")
        o = torch.optim.Adagrad([p for p in m.parameters() if p.requires_grad], 0.05)
        s = torch.optim.lr_scheduler.LambdaLR(o, lambda t: max(0.05, 1 - t / 400))
        loop(m, o, running_sum, ce, 400, s, clip=1.0, accum=4)
    elif name.startswith("ho3_plain_mlp"):
        m = kit.mlp([12, 64, 64, 32, 1], nn.Tanh)
        o = torch.optim.SGD(m.parameters(), 0.01, momentum=0.9)
        if name.endswith("vanishing"):
            s = torch.optim.lr_scheduler.LambdaLR(o, lambda t: 0.6**t)
        else:
            s = torch.optim.lr_scheduler.LambdaLR(o, lambda t: max(0.1, 1 - t / 400))

        def hook(step: int) -> None:
            bad[0] = name.endswith("bad_batch") and step == 150

        loop(m, o, reg_batch, F.mse_loss, 400, s, hook=hook)
    else:
        raise SystemExit(f"unknown held-out plain shape {name}")


def _hf(name: str) -> None:
    import torch

    from bench.unseen import kit

    vocab = 40
    if name.startswith("ho3_hf_gpt2"):
        model = kit.hf_model("gpt2", vocab, width=48, layers=3)
        row = kit.lm_rows(vocab, 32, 6, seed=93_000)
        lr = 1.0 if name.endswith("lr1000x") else 1e-3
        extra: Dict[str, Any] = {
            "optim": "adafactor",
            "lr_scheduler_type": "cosine",
            "warmup_steps": 15,
            "gradient_accumulation_steps": 2,
            "logging_steps": 5,
        }
    else:
        model = kit.hf_model("bert", vocab, width=48, labels=3, positions=24)

        def row(i: int) -> dict:
            ids = torch.randint(0, vocab, (16,), generator=kit.seeded(95_000 + i))
            return {"input_ids": ids, "labels": torch.tensor(int(ids[:4].sum()) % 3)}

        lr = 0.2 if name.endswith("lr100x") else 2e-3
        extra = {"lr_scheduler_type": "linear", "max_grad_norm": 0.0, "logging_steps": 5}
    kit.hf_train(model, kit.Rows(100_000, row), "/tmp/trainguard-heldout37-hf", 300, lr, **extra)


def _lightning(name: str) -> None:
    import pytorch_lightning as pl
    import torch
    import torch.nn.functional as F

    from bench.unseen import kit

    steps = 400
    mlp = name.startswith("ho3_pl_resmlp")
    proto = torch.randn(5, 1, 12, 12, generator=kit.seeded(97))
    w = torch.randn(20, 1, generator=kit.seeded(98))
    nan_from = 160 if name.endswith("nan_input") else 10**9

    def row(i: int) -> Any:
        g = kit.seeded(97_000 + i)
        if mlp:
            x = torch.randn(20, generator=g)
            return x, (torch.tanh(x @ w) + 0.3 * (x[:3].prod())).reshape(1)
        y = int(torch.randint(0, 5, (1,), generator=g))
        return proto[y] + 0.9 * torch.randn(1, 12, 12, generator=g), y

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net: Any = kit.ResMLP(inputs=20, width=48, blocks=2, out=1) if mlp else kit.bn_cnn(5)

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            x, y = batch
            if mlp:
                return F.mse_loss(self.net(x).float(), y)
            if self.global_step >= nan_from:
                x = x.clone()
                x[0] = float("nan")
            return F.cross_entropy(self.net(x), y)

        def configure_optimizers(self) -> Any:
            if mlp:
                peak = 0.9 if name.endswith("lr300x") else 3e-3
                o: Any = torch.optim.RMSprop(self.parameters(), peak / 25)
                s: Any = torch.optim.lr_scheduler.OneCycleLR(o, peak, total_steps=steps)
            else:
                o = torch.optim.SGD(self.parameters(), 0.02, momentum=0.9)
                s = torch.optim.lr_scheduler.StepLR(o, 150, 0.3)
            return {"optimizer": o, "lr_scheduler": {"scheduler": s, "interval": "step"}}

    if mlp:
        trainer: Any = {"precision": "bf16-mixed", "accumulate_grad_batches": 2}
    else:
        trainer = {"gradient_clip_val": None if name.endswith("nan_input") else 1.0}
    batches = steps * (2 if mlp else 1)
    kit.lightning_fit(Model(), kit.Rows(32 * batches, row), steps, **trainer)


def _lora(name: str) -> None:
    from peft import LoraConfig, get_peft_model

    from bench.unseen import kit

    vocab = 40
    base = kit.pretrained(kit.hf_model("llama", vocab, width=48), kit.lm_rows(vocab, 32, 2, seed=700))
    model = get_peft_model(
        base,
        LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.0),
    )
    if name.endswith("dead_adapter"):
        for pname, p in model.named_parameters():
            if "lora_B" in pname:
                p.requires_grad_(False)
    lr = 1.0 if name.endswith("lr500x") else 2e-3
    kit.hf_train(
        model,
        kit.Rows(100_000, kit.lm_rows(vocab, 32, 5, seed=70_000)),
        "/tmp/trainguard-heldout37-lora",
        300,
        lr,
        lr_scheduler_type="linear",
        logging_steps=5,
    )
