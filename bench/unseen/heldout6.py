#!/usr/bin/env python3
"""Stop 40's HELD-OUT set of unseen training shapes (set ``heldout40``): written and committed, with its
expectations, seeds and scoring rules (probe.py's trace rules, unchanged), BEFORE any of it ran and before
the stop's detector changes; recorded once (a 3-step smoke first, keeping only its 'recorded'/'FAILED'
line); judged ONCE with the stop's starting engine and ONCE with the engine kept at the end, aggregates
only. Never tuned on.

Families the earlier sets lack: a per-pixel segmentation net under PolynomialLR, a dense graph-convolution
node classifier under ExponentialLR (and one node feature turning +Inf), a triplet-margin embedding net
under CyclicLR (and the same with ``zero_grad`` overridden to do nothing: gradients pile up step after
step), a Huber regressor under SequentialLR (warmup, then cosine) whose targets change scale and sign
mid-run (a data-pipeline bug), the HF Trainer with a Llama under the polynomial schedule + weight decay
and a GPT-2 with torch Adagrad under constant-with-warmup, peft DoRA on a Llama under the HF Trainer, a
plain-loop LoRA whose adapters are frozen by a "freeze the backbone" helper run after the optimizer was
built, and in Lightning a tabular Transformer in bf16-mixed with gradient accumulation and a VAE (MSE +
KL) hit by one batch of inputs x1000.

Every shape is seeded: ``torch.manual_seed(0)`` (bench.unseen.shapes.main) and the fixed data seeds below
(40_000+: none used by another set).
"""

from __future__ import annotations

from typing import Any, Dict, Tuple

from bench.unseen.sets import HEALTHY, LR_TOO_HIGH, Expectations

NAN = "loss/non_finite|gradient/nan-source"
DEAD_ADAPTER = "adapter/lora-grad-break|loss/plateau"
BAD_BATCH = (
    "loss/divergence|loss/rise-after-fall|loss/oscillation|gradient/explosion"
    "|loss/non_finite|gradient/nan-source"
)
"""A bad batch whose huge update knocks the model off: any of the curve / gradient kinds that say so."""
SHIFT = "loss/rise-after-fall|loss/divergence|loss/oscillation"
"""Targets that change mid-run: the loss climbs back after it fell."""

SHAPES: Expectations = {
    # plain loops
    "ho10_plain_seg_adamw_poly_ok": (
        HEALTHY,
        "2-D conv encoder-decoder, per-pixel 2-class CE on 12x12 fields, AdamW 2e-3, PolynomialLR(300, 0.9)",
    ),
    "ho10_plain_seg_adamw_poly_lr500x": (LR_TOO_HIGH, "the same at AdamW 1.0 (500x), no clip"),
    "ho10_plain_gcn_adam_exp_ok": (
        HEALTHY,
        "dense 2-layer GCN node classifier on random 24-node graphs, Adam 1e-2, ExponentialLR(0.995)",
    ),
    "ho10_plain_gcn_adam_inf_feature": (NAN, "the same, one node feature +Inf from step 160"),
    "ho10_plain_triplet_sgdm_cyclic_ok": (
        HEALTHY,
        "MLP embedding net, TripletMarginLoss(1.0), SGD momentum 0.9, CyclicLR 1e-3..1e-2 (up 50)",
    ),
    "ho10_plain_triplet_sgdm_no_zero_grad": (
        LR_TOO_HIGH,
        "the same with zero_grad overridden to do nothing: gradients pile up, the step grows every step",
    ),
    "ho10_plain_huber_adamw_seqlr_ok": (
        HEALTHY,
        "GELU MLP regressor, HuberLoss, AdamW 3e-3, SequentialLR(LinearLR warmup 20, CosineAnnealingLR)",
    ),
    "ho10_plain_huber_adamw_target_shift": (
        SHIFT,
        "the same, from step 180 the targets come x-6 (a pipeline bug: another column, other units)",
    ),
    # HF Trainer
    "ho10_hf_llama_poly_wd_ok": (
        HEALTHY,
        "HF Trainer, Llama 2x48, adamw_torch 1e-3, polynomial (power 2), warmup 15, wd 0.1, log 3",
    ),
    "ho10_hf_llama_poly_wd_lr1000x": (LR_TOO_HIGH, "the same at 1.0 (1000x), max_grad_norm 1"),
    "ho10_hf_gpt2_adagrad_cwarmup_ok": (
        HEALTHY,
        "HF Trainer, GPT-2 2x48, torch Adagrad 1e-2, constant_with_warmup 15, no clip, log 1",
    ),
    "ho10_hf_gpt2_adagrad_lr1000x": (LR_TOO_HIGH, "the same at 10 (1000x)"),
    # peft
    "ho10_lora_llama_dora_hf_ok": (
        HEALTHY,
        "peft DoRA r=8 on a pre-trained tiny Llama's q/v/o_proj, HF Trainer AdamW 2e-3, cosine, log 2",
    ),
    "ho10_lora_llama_dora_hf_lr1000x": (LR_TOO_HIGH, "the same at 2.0 (1000x)"),
    "ho10_lora_gpt2_plain_cosine_ok": (
        HEALTHY,
        "peft LoRA r=4 alpha 32 on a pre-trained tiny GPT-2's c_attn, plain loop AdamW 2e-3, warmup+cosine",
    ),
    "ho10_lora_gpt2_plain_frozen_after_opt": (
        DEAD_ADAPTER,
        "the same, a 'freeze the backbone' helper run after the optimizer was built also freezes the "
        "adapters (no gradient reaches them)",
    ),
    # Lightning
    "ho10_pl_tabformer_adamw_bf16_ok": (
        HEALTHY,
        "Lightning Transformer over 8 feature tokens, AdamW 1e-3, CosineAnnealingLR, bf16-mixed, accum 2",
    ),
    "ho10_pl_tabformer_adamw_bf16_lr300x": (LR_TOO_HIGH, "the same at 0.3 (300x)"),
    "ho10_pl_vae_adam_ok": (HEALTHY, "Lightning MLP VAE (MSE + KL), Adam 1e-3, constant, 300 steps"),
    "ho10_pl_vae_adam_bad_batch": (BAD_BATCH, "the same, the 32 rows of batch 200 with inputs x1000"),
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
    if family == "seg":
        kernel = torch.ones(1, 1, 5, 5) / 25

        def fields(bs: int = 16) -> Tuple[Any, Any]:
            x = torch.randn(bs, 1, 12, 12)
            smooth = F.conv2d(x, kernel, padding=2)
            return x, (smooth > 0).long().squeeze(1)

        m: Any = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(16, 32, 3, stride=2, padding=1),
            nn.ReLU(),
            nn.ConvTranspose2d(32, 16, 2, stride=2),
            nn.ReLU(),
            nn.Conv2d(16, 2, 3, padding=1),
        )
        o: Any = torch.optim.AdamW(m.parameters(), 1.0 if name.endswith("lr500x") else 2e-3)
        s: Any = torch.optim.lr_scheduler.PolynomialLR(o, total_iters=300, power=0.9)
        kit.loop(m, o, fields, lambda out, y: F.cross_entropy(out, y), 300, s)
    elif family == "gcn":
        w_true = torch.randn(6, generator=kit.seeded(40_001))
        inf_from = 160 if name.endswith("inf_feature") else None
        step = [0]

        def graphs(bs: int = 8) -> Tuple[Any, Any]:
            x = torch.randn(bs, 24, 6)
            a = (torch.rand(bs, 24, 24) < 0.15).float()
            a = ((a + a.transpose(1, 2)) > 0).float() + torch.eye(24)
            a = a / a.sum(-1, keepdim=True)
            y = ((a @ (x @ w_true).unsqueeze(-1)).squeeze(-1) > 0).long()
            if inf_from is not None and step[0] >= inf_from:
                x[0, 0, 0] = float("inf")
            step[0] += 1
            return (x, a), y

        class GCN(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.l1, self.l2 = nn.Linear(6, 32), nn.Linear(32, 2)

            def forward(self, xa: Any) -> Any:
                x, a = xa
                return self.l2(a @ torch.relu(self.l1(a @ x)))

        m = GCN()
        o = torch.optim.Adam(m.parameters(), 1e-2)
        s = torch.optim.lr_scheduler.ExponentialLR(o, 0.995)
        kit.loop(m, o, graphs, kit.ce, 300, s)
    elif family == "triplet":
        centres = torch.randn(8, 16, generator=kit.seeded(40_002)) * 1.5

        def triplets(bs: int = 32) -> Tuple[Any, Any]:
            c = torch.randint(0, 8, (bs,))
            other = (c + torch.randint(1, 8, (bs,))) % 8
            pick = [centres[c] + torch.randn(bs, 16), centres[c] + torch.randn(bs, 16)]
            return torch.stack([*pick, centres[other] + torch.randn(bs, 16)]), c

        class Embed(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.net = kit.mlp([16, 64, 32])

            def forward(self, abc: Any) -> Any:
                return self.net(abc)

        triplet = nn.TripletMarginLoss(margin=1.0)
        m = Embed()
        sgd: Any = torch.optim.SGD
        if name.endswith("no_zero_grad"):

            class NoZeroSGD(torch.optim.SGD):
                def zero_grad(self, set_to_none: bool = True) -> None:
                    """The planted bug: nothing is cleared."""

            sgd = NoZeroSGD
        o = sgd(m.parameters(), 1e-3, momentum=0.9)
        s = torch.optim.lr_scheduler.CyclicLR(o, 1e-3, 1e-2, step_size_up=50)
        kit.loop(m, o, triplets, lambda e, y: triplet(e[0], e[1], e[2]), 300, s)
    elif family == "huber":
        w = torch.randn(10, 1, generator=kit.seeded(40_003))
        shift_from = 180 if name.endswith("target_shift") else None
        step = [0]

        def rows(bs: int = 32) -> Tuple[Any, Any]:
            x = torch.randn(bs, 10)
            y = torch.tanh(x @ w) + 0.2 * x[:, 1:2] * x[:, 2:3]
            if shift_from is not None and step[0] >= shift_from:
                y = -6.0 * y
            step[0] += 1
            return x, y

        m = kit.mlp([10, 64, 64, 1], nn.GELU)
        o = torch.optim.AdamW(m.parameters(), 3e-3)
        warm = torch.optim.lr_scheduler.LinearLR(o, 0.05, 1.0, total_iters=20)
        cos = torch.optim.lr_scheduler.CosineAnnealingLR(o, 280)
        s = torch.optim.lr_scheduler.SequentialLR(o, [warm, cos], milestones=[20])
        kit.loop(m, o, rows, nn.HuberLoss(delta=1.0), 300, s)
    else:
        raise SystemExit(f"unknown held-out plain shape {name}")


def _hf(name: str) -> None:
    from bench.unseen import kit

    vocab = 40
    extra: Dict[str, Any]
    if name.startswith("ho10_hf_llama"):
        model = kit.hf_model("llama", vocab, width=48, positions=32)
        row = kit.lm_rows(vocab, 32, 5, seed=40_100)
        lr = 1.0 if name.endswith("lr1000x") else 1e-3
        extra = {
            "optim": "adamw_torch",
            "lr_scheduler_type": "polynomial",
            "lr_scheduler_kwargs": {"power": 2.0},
            "warmup_steps": 15,
            "weight_decay": 0.1,
            "max_grad_norm": 1.0,
            "logging_steps": 3,
        }
    else:
        model = kit.hf_model("gpt2", vocab, width=48, positions=32)
        row = kit.lm_rows(vocab, 32, 4, seed=40_200)
        lr = 10.0 if name.endswith("lr1000x") else 1e-2
        extra = {
            "optim": "adagrad",
            "lr_scheduler_type": "constant_with_warmup",
            "warmup_steps": 15,
            "max_grad_norm": 0.0,
            "logging_steps": 1,
        }
    kit.hf_train(model, kit.Rows(100_000, row), "/tmp/trainguard-heldout40-hf", 300, lr, **extra)


def _lora(name: str) -> None:
    import torch
    from peft import LoraConfig, get_peft_model

    from bench.unseen import kit

    vocab = 40
    if name.startswith("ho10_lora_llama"):
        base = kit.pretrained(kit.hf_model("llama", vocab, width=48), kit.lm_rows(vocab, 32, 3, seed=40_300))
        config = LoraConfig(
            r=8,
            lora_alpha=16,
            use_dora=True,
            target_modules=["q_proj", "v_proj", "o_proj"],
            lora_dropout=0.0,
            task_type="CAUSAL_LM",
        )
        kit.hf_train(
            get_peft_model(base, config),
            kit.Rows(100_000, kit.lm_rows(vocab, 32, 6, seed=40_400)),
            "/tmp/trainguard-heldout40-lora",
            300,
            2.0 if name.endswith("lr1000x") else 2e-3,
            lr_scheduler_type="cosine",
            logging_steps=2,
        )
        return
    base = kit.pretrained(kit.hf_model("gpt2", vocab, width=48), kit.lm_rows(vocab, 32, 3, seed=40_500))
    config = LoraConfig(r=4, lora_alpha=32, target_modules=["c_attn"], fan_in_fan_out=True, lora_dropout=0.1)
    model = get_peft_model(base, config)
    o = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], 2e-3)
    if name.endswith("frozen_after_opt"):
        for p in model.parameters():  # "freeze the backbone": every parameter, the adapters with it
            p.requires_grad_(False)
        # With no parameter needing a gradient, backward() would raise: the way users "fix" that error --
        # embeddings' outputs that require grad (HF's enable_input_require_grads) -- keeps the run going.
        model.enable_input_require_grads()
    s = torch.optim.lr_scheduler.LambdaLR(o, kit.warmup_cosine(20, 300, 0.1))
    batch = kit.lm_batches(kit.lm_rows(vocab, 32, 6, seed=40_600))
    kit.loop(kit.HFLogits(model), o, batch, kit.ce, 300, s)


def _lightning(name: str) -> None:
    import pytorch_lightning as pl
    import torch
    import torch.nn.functional as F
    from torch import nn

    from bench.unseen import kit

    kind = name.split("_")[2]
    bad_rows = range(32 * 200, 32 * 201) if name.endswith("bad_batch") else range(0)
    w = torch.randn(8, generator=kit.seeded(40_700))
    basis = torch.randn(4, 24, generator=kit.seeded(40_800))

    def row(i: int) -> Any:
        g = kit.seeded(40_900 + i)
        if kind == "tabformer":
            x = torch.randn(8, generator=g)
            return x, torch.tensor(int((x * w).sum() + x[0] * x[1] > 0))
        x = torch.randn(4, generator=g) @ basis + 0.05 * torch.randn(24, generator=g)
        return x * 1000.0 if i in bad_rows else x

    class TabFormer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.value = nn.Linear(1, 32)
            self.pos = nn.Parameter(torch.zeros(8, 32))
            layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
            self.enc = nn.TransformerEncoder(layer, 2)
            self.head = nn.Linear(32, 2)

        def forward(self, x: Any) -> Any:
            return self.head(self.enc(self.value(x.unsqueeze(-1)) + self.pos).mean(1))

    class VAE(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.enc, self.dec = kit.mlp([24, 64, 2 * 4]), kit.mlp([4, 64, 24])

        def forward(self, x: Any) -> Any:
            mu, logvar = self.enc(x).chunk(2, -1)
            z = mu + torch.randn_like(mu) * (0.5 * logvar).exp()
            kl = -0.5 * (1 + logvar - mu**2 - logvar.exp()).sum(-1).mean()
            return F.mse_loss(self.dec(z), x) + 0.01 * kl

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net: Any = TabFormer() if kind == "tabformer" else VAE()

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            if kind == "tabformer":
                x, y = batch
                loss = F.cross_entropy(self.net(x), y)
            else:
                loss = self.net(batch)
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self) -> Any:
            if kind == "tabformer":
                o: Any = torch.optim.AdamW(self.parameters(), 0.3 if name.endswith("lr300x") else 1e-3)
                cos = torch.optim.lr_scheduler.CosineAnnealingLR(o, 150)
                return {"optimizer": o, "lr_scheduler": {"scheduler": cos, "interval": "step"}}
            return torch.optim.Adam(self.parameters(), 1e-3)

    if kind == "tabformer":
        kit.lightning_fit(
            Model(), kit.Rows(32 * 2 * 150, row), 150, accumulate_grad_batches=2, precision="bf16-mixed"
        )
    else:
        kit.lightning_fit(Model(), kit.Rows(32 * 300, row), 300)
