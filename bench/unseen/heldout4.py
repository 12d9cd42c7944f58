#!/usr/bin/env python3
"""Stop 38's HELD-OUT set of unseen training shapes (set ``heldout38``): written and committed, with its
expectations, seeds and scoring rules (probe.py's trace rules, unchanged), BEFORE any of it ran and before
the stop's detector changes; recorded before those changes with its verdict lines thrown away unread; to be
judged ONCE, at the end, with the engine kept and the stop's starting engine (aggregates only). Never tuned
on.

The same families as stop 37's held-out set and stop 38's tuning set (HF Trainer + transformers' Adafactor,
bad batches mid-run, frozen LoRA B, Lightning bf16-mixed, OneCycle + SGD momentum), in a new mix of models
and seeds: a GRU regressor under SGD momentum + OneCycle, a 1-D CNN regressor under SGD momentum hit by a
bad batch, an MLP classifier under AdamW + clipping hit by a bad batch, a BERT classifier under the HF
Trainer with Adafactor, a BERT regressor under the HF Trainer hit by a bad batch, peft LoRA on a tiny
GPT-2 in a plain loop and on every linear of a tiny Llama under the HF Trainer (each also with lora_B
frozen), a Lightning causal Transformer in bf16-mixed, a Lightning residual MLP under SGD momentum +
OneCycle in bf16-mixed (healthy, a bad batch), a Lightning CNN under SGD momentum + OneCycle with clipping.

Every shape is seeded: ``torch.manual_seed(0)`` (bench.unseen.shapes.main) and the fixed data seeds below
(38_000+: none used by another set).
"""

from __future__ import annotations

from typing import Any, Dict, Tuple

from bench.unseen.sets import HEALTHY, LR_TOO_HIGH, Expectations

DEAD_ADAPTER = "adapter/lora-grad-break|loss/plateau"
BAD_BATCH = (
    "loss/divergence|loss/rise-after-fall|loss/oscillation|gradient/explosion"
    "|loss/non_finite|gradient/nan-source"
)
"""A bad batch whose huge update knocks the model off: any of the curve / gradient kinds that say so."""

SHAPES: Expectations = {
    # plain loops
    "ho8_plain_gru_sgdm_onecycle_ok": (
        HEALTHY,
        "GRU regressor (a sequence's weighted sum), SGD momentum 0.9, OneCycle peak 0.05, clip 1, 300 steps",
    ),
    "ho8_plain_gru_sgdm_onecycle_lr100x": (LR_TOO_HIGH, "the same at a OneCycle peak 5.0 (100x), no clip"),
    "ho8_plain_tcn_sgdm_ok": (HEALTHY, "1-D CNN regressor (no norm), SGD momentum 0.9 lr 0.005, constant"),
    "ho8_plain_tcn_sgdm_bad_batch": (BAD_BATCH, "the same, one batch at step 160 with targets x1000"),
    "ho8_plain_mlp_adamw_ok": (HEALTHY, "GELU MLP classifier, AdamW 2e-3, warmup 15 + cosine, clip 1"),
    "ho8_plain_mlp_adamw_bad_batch_clip": (
        BAD_BATCH,
        "the same, one batch at step 200 with inputs x10000 (a unit bug in one shard), clip 1",
    ),
    # HF Trainer
    "ho8_hf_bert_adafactor_ok": (
        HEALTHY,
        "HF Trainer, tiny BERT classifier, Adafactor 2e-3, linear + warmup 10, accumulation 2, logging 5",
    ),
    "ho8_hf_bert_adafactor_lr1000x": (LR_TOO_HIGH, "the same at 2.0 (1000x)"),
    "ho8_hf_bertreg_adamw_ok": (
        HEALTHY,
        "HF Trainer, tiny BERT regressor (num_labels 1), AdamW 1e-3, linear, no clipping, logging 1",
    ),
    "ho8_hf_bertreg_adamw_bad_batch": (
        BAD_BATCH,
        "the same, the batch fetched during step 150 with labels x1000",
    ),
    # peft LoRA, lora_B frozen at its zero init in the dead ones
    "ho8_lora_gpt2_plain_ok": (
        HEALTHY,
        "peft LoRA r=8 on a pre-trained tiny GPT-2's c_attn + c_proj, plain loop AdamW 2e-3, warmup + cosine",
    ),
    "ho8_lora_gpt2_plain_dead_adapter": (DEAD_ADAPTER, "the same, every lora_B frozen at zero"),
    "ho8_lora_llama_hf_ok": (
        HEALTHY,
        "peft LoRA r=4 on every linear of a pre-trained tiny Llama, HF Trainer AdamW 1e-3, linear, logging 5",
    ),
    "ho8_lora_llama_hf_dead_adapter": (DEAD_ADAPTER, "the same, every lora_B frozen at zero"),
    # Lightning
    "ho8_pl_gpt_adamw_bf16_ok": (
        HEALTHY,
        "Lightning causal Transformer LM 2x48, AdamW 1e-3, warmup 20 + cosine, bf16-mixed, 300 steps",
    ),
    "ho8_pl_gpt_adamw_bf16_lr200x": (LR_TOO_HIGH, "the same at AdamW 0.2 (200x)"),
    "ho8_pl_resmlp_sgdm_onecycle_bf16_ok": (
        HEALTHY,
        "Lightning residual MLP regressor, SGD momentum 0.9, OneCycle peak 0.01, bf16-mixed, accumulate 2",
    ),
    "ho8_pl_resmlp_sgdm_onecycle_bf16_bad_batch": (
        BAD_BATCH,
        "the same, the 32 dataset rows of batch 260 (optimizer step 130) with targets x1000, no clip",
    ),
    "ho8_pl_cnn_sgdm_onecycle_lr50x_clip": (
        LR_TOO_HIGH,
        "Lightning BatchNorm CNN, SGD momentum 0.9, OneCycle peak 5.0 (50x), gradient_clip_val 1",
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

    bad = [False]
    at_step = {"tcn": 160, "mlp": 200}.get(name.split("_")[2], -1)

    def hook(step: int) -> None:
        bad[0] = "bad_batch" in name and step == at_step

    if name.startswith("ho8_plain_gru"):

        class GRUReg(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.rnn, self.o = nn.GRU(3, 32, batch_first=True), nn.Linear(32, 1)

            def forward(self, x: Any) -> Any:
                return self.o(self.rnn(x)[0][:, -1])

        wts = torch.tensor([0.5, -1.0, 0.8])

        def seqs(bs: int = 32) -> Tuple[Any, Any]:
            x = torch.randn(bs, 12, 3)
            return x, (x @ wts).sum(1, keepdim=True) / 3

        m: Any = GRUReg()
        peak = 5.0 if name.endswith("lr100x") else 0.05
        o: Any = torch.optim.SGD(m.parameters(), peak / 25, momentum=0.9)
        s: Any = torch.optim.lr_scheduler.OneCycleLR(o, peak, total_steps=300)
        kit.loop(m, o, seqs, F.mse_loss, 300, s, clip=None if name.endswith("lr100x") else 1.0)
    elif name.startswith("ho8_plain_tcn"):
        k = torch.randn(1, 1, 5, generator=kit.seeded(38_001))

        def series(bs: int = 32) -> Tuple[Any, Any]:
            x = torch.randn(bs, 1, 24)
            y = F.conv1d(x, k).relu().mean(2) + 0.05 * torch.randn(bs, 1)
            return x, (y * 1000.0 if bad[0] else y)

        m = nn.Sequential(
            nn.Conv1d(1, 16, 5),
            nn.ReLU(),
            nn.Conv1d(16, 16, 3, padding=1),
            nn.ReLU(),
            nn.AdaptiveAvgPool1d(1),
            nn.Flatten(),
            nn.Linear(16, 1),
        )
        o = torch.optim.SGD(m.parameters(), 0.005, momentum=0.9)
        kit.loop(m, o, series, F.mse_loss, 300, hook=hook)
    elif name.startswith("ho8_plain_mlp"):
        centres = 1.5 * torch.randn(5, 20, generator=kit.seeded(38_002))

        def blobs(bs: int = 32) -> Tuple[Any, Any]:
            y = torch.randint(0, 5, (bs,))
            x = centres[y] + torch.randn(bs, 20)
            return (x * 10_000.0 if bad[0] else x), y

        m = kit.mlp([20, 64, 64, 5], nn.GELU)
        o = torch.optim.AdamW(m.parameters(), 2e-3)
        s = torch.optim.lr_scheduler.LambdaLR(o, kit.warmup_cosine(15, 350))
        kit.loop(m, o, blobs, kit.ce, 350, s, clip=1.0, hook=hook)
    else:
        raise SystemExit(f"unknown held-out plain shape {name}")


def _hf(name: str) -> None:
    import torch
    from transformers import TrainerCallback

    from bench.unseen import kit

    vocab = 40
    bad = [False]
    callbacks: Any = ()
    if name.startswith("ho8_hf_bertreg"):
        model = kit.hf_model("bert", vocab, width=48, labels=1, positions=24)
        wts = torch.randn(vocab, generator=kit.seeded(38_100))

        def row(i: int) -> dict:
            ids = torch.randint(0, vocab, (16,), generator=kit.seeded(38_200 + i))
            y = float(wts[ids[:6]].mean())
            return {"input_ids": ids, "labels": torch.tensor(y * 1000.0 if bad[0] else y)}

        class BadBatch(TrainerCallback):  # type: ignore[misc]
            def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
                bad[0] = name.endswith("bad_batch") and state.global_step == 150

        callbacks = (BadBatch(),)
        lr = 1e-3
        extra: Dict[str, Any] = {"lr_scheduler_type": "linear", "max_grad_norm": 0.0, "logging_steps": 1}
    else:
        model = kit.hf_model("bert", vocab, width=48, labels=4, positions=24)

        def row(i: int) -> dict:
            ids = torch.randint(0, vocab, (16,), generator=kit.seeded(38_300 + i))
            return {"input_ids": ids, "labels": torch.tensor(int(ids[-3:].sum()) % 4)}

        lr = 2.0 if name.endswith("lr1000x") else 2e-3
        extra = {
            "optim": "adafactor",
            "lr_scheduler_type": "linear",
            "warmup_steps": 10,
            "gradient_accumulation_steps": 2,
            "logging_steps": 5,
        }
    kit.hf_train(
        model, kit.Rows(100_000, row), "/tmp/trainguard-heldout38-hf", 300, lr, callbacks=callbacks, **extra
    )


def _lora(name: str) -> None:
    import torch
    from peft import LoraConfig, get_peft_model

    from bench.unseen import kit

    vocab = 40
    gpt2 = "_gpt2_" in name
    base = kit.pretrained(
        kit.hf_model("gpt2" if gpt2 else "llama", vocab, width=48), kit.lm_rows(vocab, 32, 3, seed=38_400)
    )
    if gpt2:
        config = LoraConfig(
            r=8, lora_alpha=16, target_modules=["c_attn", "c_proj"], fan_in_fan_out=True, lora_dropout=0.0
        )
    else:
        config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0)
    model = get_peft_model(base, config)
    if name.endswith("dead_adapter"):
        for pname, p in model.named_parameters():
            if "lora_B" in pname:
                p.requires_grad_(False)
    row = kit.lm_rows(vocab, 32, 7, seed=38_500)
    if not gpt2:
        kit.hf_train(
            model,
            kit.Rows(100_000, row),
            "/tmp/trainguard-heldout38-lora",
            300,
            1e-3,
            lr_scheduler_type="linear",
            logging_steps=5,
        )
        return

    batch = kit.lm_batches(row)
    o = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], 2e-3)
    s = torch.optim.lr_scheduler.LambdaLR(o, kit.warmup_cosine(15, 300))
    kit.loop(kit.HFLogits(model), o, batch, kit.ce, 300, s)


def _lightning(name: str) -> None:
    import pytorch_lightning as pl
    import torch
    import torch.nn.functional as F

    from bench.unseen import kit

    steps = 300
    kind = name.split("_")[2]
    proto = torch.randn(5, 1, 12, 12, generator=kit.seeded(38_600))
    w = torch.randn(16, 1, generator=kit.seeded(38_601))
    bad_rows = range(32 * 260, 32 * 261) if name.endswith("bad_batch") else range(0)
    lm_row = kit.lm_rows(40, 32, 5, seed=38_700)

    def row(i: int) -> Any:
        g = kit.seeded(38_800 + i)
        if kind == "gpt":
            ids = lm_row(i)["input_ids"]
            return ids[:-1], ids[1:]
        if kind == "cnn":
            y = int(torch.randint(0, 5, (1,), generator=g))
            return proto[y] + 1.0 * torch.randn(1, 12, 12, generator=g), y
        x = torch.randn(16, generator=g)
        y = (torch.tanh(x @ w / 2) + 0.2 * x[0] * x[1]).reshape(1)
        return x, y * 1000.0 if i in bad_rows else y

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            nets = {
                "gpt": lambda: kit.CausalLM(40, length=31, width=48, layers=2),
                "cnn": lambda: kit.bn_cnn(5),
                "resmlp": lambda: kit.ResMLP(inputs=16, width=48, blocks=2, out=1),
            }
            self.net: Any = nets[kind]()

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            x, y = batch
            out = self.net(x).float()
            if kind == "gpt":
                return kit.ce(out, y)
            return F.cross_entropy(out, y) if kind == "cnn" else F.mse_loss(out, y)

        def configure_optimizers(self) -> Any:
            if kind == "gpt":
                lr = 0.2 if name.endswith("lr200x") else 1e-3
                o: Any = torch.optim.AdamW(self.parameters(), lr)
                s: Any = torch.optim.lr_scheduler.LambdaLR(o, kit.warmup_cosine(20, steps))
            else:
                peak = 5.0 if kind == "cnn" else 0.01
                o = torch.optim.SGD(self.parameters(), peak / 25, momentum=0.9)
                s = torch.optim.lr_scheduler.OneCycleLR(o, peak, total_steps=steps)
            return {"optimizer": o, "lr_scheduler": {"scheduler": s, "interval": "step"}}

    trainer: Dict[str, Any] = {"precision": "bf16-mixed"}
    if kind == "resmlp":
        trainer["accumulate_grad_batches"] = 2
    if kind == "cnn":
        trainer = {"gradient_clip_val": 1.0}
    batches = steps * (2 if kind == "resmlp" else 1)
    kit.lightning_fit(Model(), kit.Rows(32 * batches, row), steps, **trainer)
