#!/usr/bin/env python3
"""Stop 38's TUNING set of unseen training shapes (set ``tuning38``): written, with its expectations and its
scoring rules (probe.py's trace rules, unchanged), before any of it ran and before the stop's detector
changes. The detectors may be tuned on these (and on tuning36 and the corpus's dev half); the stop's
held-out set is :mod:`bench.unseen.heldout4` (``heldout38``).

The families stop 37's held-out set covered that tuning36 does not, each with a healthy counterpart (a
false alarm counts as much as a miss): transformers' Adafactor under the HF Trainer (a tiny Llama), a bad
batch mid-run (inputs x1000 into a ReLU MLP under SGD + momentum, targets x1000 into a residual MLP under
Adam, targets x1000 in one Lightning batch), a frozen LoRA B (dead adapter) under the HF Trainer (GPT-2's
``c_attn``) and under a plain loop (a tiny Llama's q/k/v/o), Lightning bf16-mixed (a BatchNorm CNN under
AdamW + cosine, an MLP under SGD + momentum + OneCycle), OneCycle + SGD momentum in a plain loop with and
without clipping.

Every shape is seeded: ``torch.manual_seed(0)`` (bench.unseen.shapes.main) and the fixed data seeds below
(12_000+: none used by another set).
"""

from __future__ import annotations

from typing import Any, Dict, Tuple

from bench.unseen.sets import HEALTHY, LR_TOO_HIGH, Expectations

NAN = "gradient/nan-source|loss/non_finite"
DEAD_ADAPTER = "adapter/lora-grad-break|loss/plateau"
BAD_BATCH = (
    "loss/divergence|loss/rise-after-fall|loss/oscillation|gradient/explosion"
    "|loss/non_finite|gradient/nan-source"
)
"""A bad batch whose huge update knocks the model off: any of the curve / gradient kinds that say so."""

SHAPES: Expectations = {
    # plain loops
    "tu8_plain_mlp_sgdm_onecycle_ok": (
        HEALTHY,
        "ReLU MLP classifier on 6 Gaussian blobs in 16-d, SGD momentum 0.9, OneCycle peak 0.1, 350 steps",
    ),
    "tu8_plain_mlp_sgdm_onecycle_lr50x": (LR_TOO_HIGH, "the same at a OneCycle peak 5.0 (50x), no clip"),
    "tu8_plain_mlp_sgdm_onecycle_lr50x_clip": (LR_TOO_HIGH, "the same at a peak 5.0 (50x), clip 1"),
    "tu8_plain_mlp_sgdm_bad_batch": (
        BAD_BATCH,
        "the healthy one, one batch at step 180 with inputs x1000 (a normalisation bug in one shard)",
    ),
    "tu8_plain_resmlp_adam_cosine_ok": (
        HEALTHY,
        "residual MLP regressor, Adam 1e-3, warmup 10 + cosine, no clip, 350 steps",
    ),
    "tu8_plain_resmlp_adam_bad_batch": (BAD_BATCH, "the same, one batch at step 200 with targets x1000"),
    # HF Trainer with transformers' Adafactor
    "tu8_hf_llama_adafactor_ok": (
        HEALTHY,
        "HF Trainer, tiny Llama LM 2x48, Adafactor 1e-3, linear + warmup 10, accumulation 2, logging 5",
    ),
    "tu8_hf_llama_adafactor_lr500x": (LR_TOO_HIGH, "the same at 0.5 (500x)"),
    "tu8_hf_llama_adafactor_lr500x_noclip": (LR_TOO_HIGH, "the same at 0.5 (500x), max_grad_norm 0"),
    # peft LoRA with lora_B frozen at its zero init (a dead adapter)
    "tu8_lora_gpt2_hf_ok": (
        HEALTHY,
        "peft LoRA r=8 on a pre-trained tiny GPT-2's c_attn, HF Trainer AdamW 2e-3 cosine, logging 5",
    ),
    "tu8_lora_gpt2_hf_dead_adapter": (DEAD_ADAPTER, "the same, every lora_B frozen at zero"),
    "tu8_lora_llama_plain_ok": (
        HEALTHY,
        "peft LoRA r=4 on a pre-trained tiny Llama's q/k/v/o, plain loop AdamW 3e-3 constant, clip 1",
    ),
    "tu8_lora_llama_plain_dead_adapter": (DEAD_ADAPTER, "the same, every lora_B frozen at zero"),
    # Lightning bf16-mixed
    "tu8_pl_cnn_adamw_bf16_ok": (
        HEALTHY,
        "Lightning BatchNorm CNN, AdamW 2e-3, cosine, bf16-mixed, 300 steps",
    ),
    "tu8_pl_cnn_adamw_bf16_lr300x": (LR_TOO_HIGH, "the same at AdamW 0.6 (300x)"),
    "tu8_pl_mlp_sgdm_onecycle_bf16_ok": (
        HEALTHY,
        "Lightning MLP regressor, SGD momentum 0.9, OneCycle peak 0.02, bf16-mixed, 300 steps",
    ),
    "tu8_pl_mlp_sgdm_onecycle_bf16_bad_batch": (
        BAD_BATCH,
        "the same, the batch of step 150 with targets x1000 (its 32 dataset rows), no clip",
    ),
}


def run(name: str) -> None:
    """Run one shape of this set (``trainguard.init`` already called)."""
    {"plain": _plain, "hf": _hf, "pl": _lightning, "lora": _lora}[name.split("_")[1]](name)


def _plain(name: str) -> None:
    import torch
    import torch.nn.functional as F

    from bench.unseen import kit

    bad = [False]
    if name.startswith("tu8_plain_mlp"):
        centres = 2.0 * torch.randn(6, 16, generator=kit.seeded(12_001))

        def blobs(bs: int = 32) -> Tuple[Any, Any]:
            y = torch.randint(0, 6, (bs,))
            x = centres[y] + 1.3 * torch.randn(bs, 16)
            return (x * 1000.0 if bad[0] else x), y

        m: Any = kit.mlp([16, 64, 64, 6])
        peak = 5.0 if "lr50x" in name else 0.1
        o: Any = torch.optim.SGD(m.parameters(), peak / 25, momentum=0.9)
        s: Any = torch.optim.lr_scheduler.OneCycleLR(o, peak, total_steps=350)

        def hook(step: int) -> None:
            bad[0] = name.endswith("bad_batch") and step == 180

        kit.loop(m, o, blobs, kit.ce, 350, s, clip=1.0 if name.endswith("clip") else None, hook=hook)
    elif name.startswith("tu8_plain_resmlp"):
        w = torch.randn(10, 1, generator=kit.seeded(12_002))

        def reg(bs: int = 48) -> Tuple[Any, Any]:
            x = torch.randn(bs, 10)
            y = torch.tanh(x @ w / 2) + 0.2 * x[:, :1] * x[:, 1:2] + 0.05 * torch.randn(bs, 1)
            return x, (y * 1000.0 if bad[0] else y)

        m = kit.ResMLP(inputs=10, width=48, blocks=2, out=1)
        o = torch.optim.Adam(m.parameters(), 1e-3)
        s = torch.optim.lr_scheduler.LambdaLR(o, kit.warmup_cosine(10, 350, 0.1))

        def hook2(step: int) -> None:
            bad[0] = name.endswith("bad_batch") and step == 200

        kit.loop(m, o, reg, F.mse_loss, 350, s, hook=hook2)
    else:
        raise SystemExit(f"unknown tuning38 plain shape {name}")


def _hf(name: str) -> None:
    from bench.unseen import kit

    vocab = 40
    model = kit.hf_model("llama", vocab, width=48, layers=2)
    extra: Dict[str, Any] = {
        "optim": "adafactor",
        "lr_scheduler_type": "linear",
        "warmup_steps": 10,
        "gradient_accumulation_steps": 2,
        "logging_steps": 5,
    }
    if name.endswith("noclip"):
        extra["max_grad_norm"] = 0.0
    lr = 0.5 if "lr500x" in name else 1e-3
    row = kit.lm_rows(vocab, 32, 5, seed=12_100)
    kit.hf_train(model, kit.Rows(100_000, row), "/tmp/trainguard-tuning38-hf", 300, lr, **extra)


def _lora(name: str) -> None:
    import torch
    from peft import LoraConfig, get_peft_model

    from bench.unseen import kit

    vocab = 40
    gpt2 = "_gpt2_" in name
    base = kit.pretrained(
        kit.hf_model("gpt2" if gpt2 else "llama", vocab, width=48), kit.lm_rows(vocab, 32, 2, seed=12_200)
    )
    if gpt2:
        config = LoraConfig(
            r=8, lora_alpha=16, target_modules=["c_attn"], fan_in_fan_out=True, lora_dropout=0.0
        )
    else:
        config = LoraConfig(
            r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], lora_dropout=0.0
        )
    model = get_peft_model(base, config)
    if name.endswith("dead_adapter"):
        for pname, p in model.named_parameters():
            if "lora_B" in pname:
                p.requires_grad_(False)
    row = kit.lm_rows(vocab, 32, 6, seed=12_300)
    if gpt2:
        kit.hf_train(
            model,
            kit.Rows(100_000, row),
            "/tmp/trainguard-tuning38-lora",
            300,
            2e-3,
            lr_scheduler_type="cosine",
            logging_steps=5,
        )
        return

    batch = kit.lm_batches(row)
    wrapped = kit.HFLogits(model)
    o = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], 3e-3)
    kit.loop(wrapped, o, batch, kit.ce, 300, clip=1.0)


def _lightning(name: str) -> None:
    import pytorch_lightning as pl
    import torch
    import torch.nn.functional as F

    from bench.unseen import kit

    steps = 300
    cnn = name.startswith("tu8_pl_cnn")
    proto = torch.randn(4, 1, 12, 12, generator=kit.seeded(12_400))
    w = torch.randn(12, 1, generator=kit.seeded(12_401))
    bad_rows = range(32 * 150, 32 * 151) if name.endswith("bad_batch") else range(0)

    def row(i: int) -> Any:
        g = kit.seeded(12_500 + i)
        if cnn:
            y = int(torch.randint(0, 4, (1,), generator=g))
            return proto[y] + 1.0 * torch.randn(1, 12, 12, generator=g), y
        x = torch.randn(12, generator=g)
        y = (torch.sin(x @ w) + 0.1 * x[:2].sum()).reshape(1)
        return x, y * 1000.0 if i in bad_rows else y

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net: Any = kit.bn_cnn(4) if cnn else kit.mlp([12, 64, 64, 1])

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            x, y = batch
            out = self.net(x).float()
            return F.cross_entropy(out, y) if cnn else F.mse_loss(out, y)

        def configure_optimizers(self) -> Any:
            if cnn:
                lr = 0.6 if name.endswith("lr300x") else 2e-3
                o: Any = torch.optim.AdamW(self.parameters(), lr)
                s: Any = torch.optim.lr_scheduler.CosineAnnealingLR(o, steps)
            else:
                o = torch.optim.SGD(self.parameters(), 0.02 / 25, momentum=0.9)
                s = torch.optim.lr_scheduler.OneCycleLR(o, 0.02, total_steps=steps)
            return {"optimizer": o, "lr_scheduler": {"scheduler": s, "interval": "step"}}

    kit.lightning_fit(Model(), kit.Rows(32 * steps, row), steps, precision="bf16-mixed")
