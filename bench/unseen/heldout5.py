#!/usr/bin/env python3
"""Stop 39's HELD-OUT set of unseen training shapes (set ``heldout39``): written and committed, with its
expectations, seeds and scoring rules (probe.py's trace rules, unchanged), BEFORE any of it ran and before
the stop's detector changes; recorded once (a 3-step smoke first, keeping only its 'recorded'/'FAILED'
line); judged ONCE with the stop's starting engine and ONCE with the engine kept at the end, aggregates
only. Never tuned on.

Families the earlier sets lack: cosine annealing with warm restarts (the LR jumps back up on purpose),
MultiStepLR drops, ReduceLROnPlateau in Lightning, a warmup whose cap was forgotten (the LR keeps climbing
linearly: a schedule typo), an optimizer built over a copy of the model (gradients flow, weights never
move), the HF Trainer with torch RMSprop under cosine-with-restarts and with SGD under inverse-sqrt plus
label smoothing, peft LoRA on a BERT classifier (modules_to_save head) under the HF Trainer, rsLoRA on a
GPT-2 in a plain loop, and a LoRA whose optimizer was built over the base model before ``get_peft_model``
froze it (the adapter is never stepped).

Every shape is seeded: ``torch.manual_seed(0)`` (bench.unseen.shapes.main) and the fixed data seeds below
(39_000+: none used by another set).
"""

from __future__ import annotations

import copy
from typing import Any, Dict, Tuple

from bench.unseen.sets import HEALTHY, LR_TOO_HIGH, Expectations

NAN = "loss/non_finite|gradient/nan-source"
STALL = "loss/plateau"
DEAD_ADAPTER = "adapter/lora-grad-break|loss/plateau"
BAD_BATCH = (
    "loss/divergence|loss/rise-after-fall|loss/oscillation|gradient/explosion"
    "|loss/non_finite|gradient/nan-source"
)
"""A bad batch whose huge update knocks the model off: any of the curve / gradient kinds that say so."""

SHAPES: Expectations = {
    # plain loops
    "ho9_plain_dae_adamw_restarts_ok": (
        HEALTHY,
        "1-D conv denoising autoencoder, AdamW 2e-3, CosineAnnealingWarmRestarts(T_0 60, T_mult 2)",
    ),
    "ho9_plain_dae_adamw_restarts_lr300x": (LR_TOO_HIGH, "the same at AdamW 0.6 (300x), no clip"),
    "ho9_plain_deepsets_nesterov_multistep_ok": (
        HEALTHY,
        "DeepSets set classifier (sum-pooled point MLP), Nesterov 0.9 lr 0.02, MultiStepLR [150, 250]",
    ),
    "ho9_plain_deepsets_nesterov_nan_input": (NAN, "the same, one NaN input row from step 170"),
    "ho9_plain_mlp_warmup_capped_ok": (
        HEALTHY,
        "tanh MLP regressor, AdamW 3e-3, linear warmup 5 then constant (min(1, (t+1)/5)), 300 steps",
    ),
    "ho9_plain_mlp_warmup_uncapped": (
        LR_TOO_HIGH,
        "the same with the cap forgotten: (t+1)/5, the LR climbs linearly to 60x by step 300",
    ),
    "ho9_plain_bncnn_adam_ok": (HEALTHY, "BatchNorm CNN on 10x10 images, Adam 1e-3, constant, 300 steps"),
    "ho9_plain_bncnn_adam_opt_on_copy": (
        STALL,
        "the same, the optimizer built over a deep copy of the model (gradients flow, weights never move)",
    ),
    # HF Trainer
    "ho9_hf_gpt2_rmsprop_restarts_ok": (
        HEALTHY,
        "HF Trainer, GPT-2 2x48, torch RMSprop 3e-4, cosine_with_restarts, warmup 10, accum 2, log 5",
    ),
    "ho9_hf_gpt2_rmsprop_lr1000x": (LR_TOO_HIGH, "the same at 0.3 (1000x), max_grad_norm 1"),
    "ho9_hf_bert_sgd_invsqrt_ok": (
        HEALTHY,
        "HF Trainer, tiny BERT 4-class classifier, SGD 0.05, inverse_sqrt + warmup 20, label smoothing 0.1",
    ),
    "ho9_hf_bert_sgd_lr1000x": (LR_TOO_HIGH, "the same at 50 (1000x), max_grad_norm 1"),
    # peft LoRA
    "ho9_lora_bert_hf_ok": (
        HEALTHY,
        "peft LoRA r=8 on a pre-trained tiny BERT's query/value, classifier head in modules_to_save, HF "
        "Trainer AdamW 2e-3, linear, logging 2",
    ),
    "ho9_lora_bert_hf_lr1000x": (LR_TOO_HIGH, "the same at 2.0 (1000x)"),
    "ho9_lora_gpt2_rslora_plain_ok": (
        HEALTHY,
        "peft rsLoRA r=16 on a pre-trained tiny GPT-2's c_attn + c_fc, dropout 0.05, plain loop Adam 3e-3",
    ),
    "ho9_lora_gpt2_opt_before_peft": (
        DEAD_ADAPTER,
        "the same, the optimizer built over the base model before get_peft_model froze it (adapter never "
        "stepped)",
    ),
    # Lightning
    "ho9_pl_convreg_adamw_plateau_ok": (
        HEALTHY,
        "Lightning 1-D CNN regressor, AdamW 2e-3, ReduceLROnPlateau(train_loss, patience 20), clip value",
    ),
    "ho9_pl_convreg_adamw_bad_batch": (
        BAD_BATCH,
        "the same, the 32 rows of batch 200 with targets x1000, no clip",
    ),
    "ho9_pl_gpt_nadam_step_ok": (
        HEALTHY,
        "Lightning causal Transformer LM 2x48, NAdam 2e-3 (decoupled wd), StepLR(100, 0.5), 300 steps",
    ),
    "ho9_pl_gpt_nadam_lr300x": (LR_TOO_HIGH, "the same at NAdam 0.6 (300x)"),
}


def run(name: str) -> None:
    """Run one held-out shape (``trainguard.init`` already called)."""
    {"plain": _plain, "hf": _hf, "pl": _lightning, "lora": _lora}[name.split("_")[1]](name)


def _plain(name: str) -> None:
    import torch
    import torch.nn.functional as F
    from torch import nn

    from bench.unseen import kit

    if name.startswith("ho9_plain_dae"):
        clean = torch.randn(4, 32, generator=kit.seeded(39_001)).cumsum(1) / 4

        def noisy(bs: int = 32) -> Tuple[Any, Any]:
            y = clean[torch.randint(0, 4, (bs,))].unsqueeze(1) * torch.rand(bs, 1, 1)
            return y + 0.3 * torch.randn(bs, 1, 32), y

        m: Any = nn.Sequential(
            nn.Conv1d(1, 16, 5, padding=2),
            nn.ReLU(),
            nn.Conv1d(16, 16, 5, stride=2, padding=2),
            nn.ReLU(),
            nn.ConvTranspose1d(16, 16, 4, stride=2, padding=1),
            nn.ReLU(),
            nn.Conv1d(16, 1, 5, padding=2),
        )
        o: Any = torch.optim.AdamW(m.parameters(), 0.6 if name.endswith("lr300x") else 2e-3)
        s: Any = torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(o, T_0=60, T_mult=2)
        kit.loop(m, o, noisy, F.mse_loss, 300, s)
    elif name.startswith("ho9_plain_deepsets"):
        centres = torch.randn(3, 2, generator=kit.seeded(39_002)) * 2

        class DeepSets(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.phi = kit.mlp([2, 32, 32])
                self.rho = kit.mlp([32, 32, 3])

            def forward(self, x: Any) -> Any:
                return self.rho(self.phi(x).sum(1))

        def sets(bs: int = 32) -> Tuple[Any, Any]:
            y = torch.randint(0, 3, (bs,))
            return centres[y].unsqueeze(1) + torch.randn(bs, 10, 2), y

        m = DeepSets()
        o = torch.optim.SGD(m.parameters(), 0.02, momentum=0.9, nesterov=True)
        s = torch.optim.lr_scheduler.MultiStepLR(o, [150, 250], 0.1)
        kit.loop(m, o, sets, kit.ce, 300, s, nan_at=170 if name.endswith("nan_input") else None)
    elif name.startswith("ho9_plain_mlp"):
        w = torch.randn(12, 1, generator=kit.seeded(39_003))

        def rows(bs: int = 32) -> Tuple[Any, Any]:
            x = torch.randn(bs, 12)
            return x, torch.sin(x @ w) + 0.1 * x[:, :1] ** 2

        m = kit.mlp([12, 64, 64, 1], nn.Tanh)
        o = torch.optim.AdamW(m.parameters(), 3e-3)
        if name.endswith("uncapped"):
            s = torch.optim.lr_scheduler.LambdaLR(o, lambda t: (t + 1) / 5)
        else:
            s = torch.optim.lr_scheduler.LambdaLR(o, lambda t: min(1.0, (t + 1) / 5))
        kit.loop(m, o, rows, F.mse_loss, 300, s)
    elif name.startswith("ho9_plain_bncnn"):
        m = kit.bn_cnn(4)
        params = copy.deepcopy(m).parameters() if name.endswith("opt_on_copy") else m.parameters()
        o = torch.optim.Adam(params, 1e-3)
        kit.loop(m, o, kit.image_batches(4, 10, 1.2, 39_004), kit.ce, 300)
    else:
        raise SystemExit(f"unknown held-out plain shape {name}")


def _hf(name: str) -> None:
    import torch

    from bench.unseen import kit

    vocab = 40
    if name.startswith("ho9_hf_gpt2"):
        model = kit.hf_model("gpt2", vocab, width=48, positions=32)
        row = kit.lm_rows(vocab, 32, 5, seed=39_100)
        lr = 0.3 if name.endswith("lr1000x") else 3e-4
        extra: Dict[str, Any] = {
            "optim": "rmsprop",
            "lr_scheduler_type": "cosine_with_restarts",
            "lr_scheduler_kwargs": {"num_cycles": 2},
            "warmup_steps": 10,
            "gradient_accumulation_steps": 2,
            "logging_steps": 5,
        }
    else:
        model = kit.hf_model("bert", vocab, width=48, labels=4, positions=24)

        def row(i: int) -> dict:
            ids = torch.randint(0, vocab, (16,), generator=kit.seeded(39_200 + i))
            return {"input_ids": ids, "labels": torch.tensor(int(ids[:4].sum()) % 4)}

        lr = 50.0 if name.endswith("lr1000x") else 0.05
        extra = {
            "optim": "sgd",
            "lr_scheduler_type": "inverse_sqrt",
            "warmup_steps": 20,
            "label_smoothing_factor": 0.1,
            "logging_steps": 1,
        }
    kit.hf_train(model, kit.Rows(100_000, row), "/tmp/trainguard-heldout39-hf", 300, lr, **extra)


def _lora(name: str) -> None:
    import torch
    from peft import LoraConfig, get_peft_model

    from bench.unseen import kit

    vocab = 40
    if name.startswith("ho9_lora_bert"):
        base = kit.hf_model("bert", vocab, width=48, labels=3, positions=24)

        def row(i: int) -> dict:
            ids = torch.randint(0, vocab, (16,), generator=kit.seeded(39_300 + i))
            return {"input_ids": ids, "labels": torch.tensor(int(ids[-4:].max()) % 3)}

        _pretrain_cls(base, row)
        config = LoraConfig(
            r=8, lora_alpha=16, target_modules=["query", "value"], lora_dropout=0.0,
            task_type="SEQ_CLS", modules_to_save=["classifier"],
        )
        kit.hf_train(
            get_peft_model(base, config),
            kit.Rows(100_000, row),
            "/tmp/trainguard-heldout39-lora",
            300,
            2.0 if name.endswith("lr1000x") else 2e-3,
            lr_scheduler_type="linear",
            logging_steps=2,
        )
        return
    base = kit.pretrained(kit.hf_model("gpt2", vocab, width=48), kit.lm_rows(vocab, 32, 3, seed=39_400))
    early = torch.optim.Adam(base.parameters(), 3e-3) if name.endswith("opt_before_peft") else None
    config = LoraConfig(
        r=16, lora_alpha=16, use_rslora=True, target_modules=["c_attn", "c_fc"], fan_in_fan_out=True,
        lora_dropout=0.05,
    )
    model = get_peft_model(base, config)
    o = early or torch.optim.Adam([p for p in model.parameters() if p.requires_grad], 3e-3)
    row = kit.lm_rows(vocab, 32, 6, seed=39_500)

    batch = kit.lm_batches(row)
    kit.loop(kit.HFLogits(model), o, batch, kit.ce, 300)


def _pretrain_cls(model: Any, row: Any, n_steps: int = 60) -> None:
    """``model`` (an HF sequence classifier) after ``n_steps`` Adam steps on batches of 32 ``row``s (no SDK):
    a base that already knows something, as a LoRA fine-tune starts from."""
    import torch

    opt = torch.optim.Adam(model.parameters(), 3e-3)
    for i in range(n_steps):
        rows = [row(10_000_000 + 32 * i + k) for k in range(32)]
        ids = torch.stack([r["input_ids"] for r in rows])
        labels = torch.stack([r["labels"] for r in rows])
        loss = model(input_ids=ids, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()


def _lightning(name: str) -> None:
    import pytorch_lightning as pl
    import torch
    import torch.nn.functional as F
    from torch import nn

    from bench.unseen import kit

    steps = 300
    kind = name.split("_")[2]
    k = torch.randn(1, 1, 7, generator=kit.seeded(39_600))
    bad_rows = range(32 * 200, 32 * 201) if name.endswith("bad_batch") else range(0)
    lm_row = kit.lm_rows(40, 32, 4, seed=39_700)

    def row(i: int) -> Any:
        if kind == "gpt":
            ids = lm_row(i)["input_ids"]
            return ids[:-1], ids[1:]
        x = torch.randn(1, 40, generator=kit.seeded(39_800 + i))
        y = F.conv1d(x.unsqueeze(0), k).squeeze(0).tanh().mean(1)
        return x, y * 1000.0 if i in bad_rows else y

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            if kind == "gpt":
                self.net: Any = kit.CausalLM(40, length=31, width=48, layers=2)
            else:
                self.net = nn.Sequential(
                    nn.Conv1d(1, 16, 7),
                    nn.GELU(),
                    nn.Conv1d(16, 16, 3, padding=1),
                    nn.GELU(),
                    nn.AdaptiveAvgPool1d(1),
                    nn.Flatten(),
                    nn.Linear(16, 1),
                )

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            x, y = batch
            loss = kit.ce(self.net(x), y) if kind == "gpt" else F.mse_loss(self.net(x), y)
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self) -> Any:
            if kind == "gpt":
                lr = 0.6 if name.endswith("lr300x") else 2e-3
                o: Any = torch.optim.NAdam(
                    self.parameters(), lr, weight_decay=0.01, decoupled_weight_decay=True
                )
                step_lr = torch.optim.lr_scheduler.StepLR(o, 100, 0.5)
                return {"optimizer": o, "lr_scheduler": {"scheduler": step_lr, "interval": "step"}}
            o = torch.optim.AdamW(self.parameters(), 2e-3)
            s = torch.optim.lr_scheduler.ReduceLROnPlateau(o, patience=20, factor=0.5)
            return {
                "optimizer": o,
                "lr_scheduler": {"scheduler": s, "interval": "step", "monitor": "train_loss"},
            }

    trainer: Dict[str, Any] = {}
    if kind == "convreg" and not name.endswith("bad_batch"):
        trainer = {"gradient_clip_val": 0.5, "gradient_clip_algorithm": "value"}
    kit.lightning_fit(Model(), kit.Rows(32 * steps, row), steps, **trainer)
