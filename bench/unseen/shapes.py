#!/usr/bin/env python3
"""Training shapes that are NOT in bench/corpus: an outside check of the detectors and the integrations.

Each shape is a real training (plain loop, Hugging Face ``Trainer``, Lightning, peft LoRA) instrumented the
way the README tells a user to, run as its own process: ``python -m bench.unseen.shapes NAME`` with the
``TRAINGUARD_*`` variables set by :mod:`bench.unseen.probe`. The models, tasks, optimisers, schedules and
framework settings are ones the corpus does not use (LSTM / GRU / Transformer-encoder / BatchNorm CNN,
gradient accumulation, label smoothing, bf16 autocast, Adagrad / RAdam, OneCycle / StepLR / polynomial,
the HF Trainer's default ``logging_steps``, LoRA fine-tunes of a pre-trained GPT-2). ``SHAPES`` says what
each one is expected to give, decided from what was done to the run, not from the detector's answer.
"""

from __future__ import annotations

import importlib
import math
import sys
from typing import Any, Dict, Tuple

from bench.unseen.sets import HEALTHY, SETS, UNMANIFESTED, Expectations, set_of, shapes

SHAPES: Expectations = {
    # name: (expected: "healthy" or the incident kind that must be among the run's incidents, what it is)
    "plain_lstm_adam_onecycle": (HEALTHY, "LSTM LM, Adam, OneCycleLR"),
    "plain_mlp_accum_cosine_wd": (HEALTHY, "MLP regression, AdamW wd 0.1, accumulation 4, warmup + cosine"),
    "plain_bncnn_sgdm_steplr": (HEALTHY, "BatchNorm CNN, SGD momentum, StepLR /10 every 150 steps"),
    "plain_enc_labelsmooth_warmup": (
        HEALTHY,
        "Transformer encoder classifier, label smoothing 0.1, warmup, clip 1",
    ),
    "plain_mlp_bf16_adagrad_eval": (HEALTHY, "MLP, bf16 autocast on CPU, Adagrad, eval_loss every 25 steps"),
    "plain_lstm_rmsprop_clip": (HEALTHY, "LSTM LM, RMSprop, clip 0.5"),
    "plain_bncnn_noisy_labels": (HEALTHY, "BatchNorm CNN, 40 % label noise: learns to a high, noisy floor"),
    "plain_enc_sgd_too_high": (
        "gradient/explosion",
        "Transformer encoder, SGD momentum at LR 3: blows up at once",
    ),
    "plain_bncnn_shuffled_labels": (
        "loss/plateau",
        "BatchNorm CNN on labels drawn at random: nothing to learn",
    ),
    "plain_mlp_nan_input": ("gradient/nan-source", "MLP, a NaN in one input row from step 250 on"),
    "plain_mlp_lr_zero_bug": ("loss/plateau", "MLP, a scheduler whose factor is 0: the weights never move"),
    "hf_gpt2_default_logging_ok": (HEALTHY, "HF Trainer, GPT-2 2x64, LR 5e-4, logging_steps left at 500"),
    "hf_gpt2_default_logging_lr1000x": ("loss/divergence", "the same at LR 0.5 (1000x): loss 4.2 -> 29"),
    "hf_gpt2_log10_lr10000x": (
        "loss/divergence",
        "the same at LR 5, logging_steps 10: loss in the thousands",
    ),
    "pl_gru_adam_ok": (HEALTHY, "Lightning, GRU LM, Adam 3e-3"),
    "pl_gru_sgd_onecycle_ok": (HEALTHY, "Lightning, GRU LM, SGD momentum, OneCycleLR peak 0.5"),
    "pl_gru_radam_poly_accum4_ok": (
        HEALTHY,
        "Lightning, GRU LM, RAdam, PolynomialLR, accumulate_grad_batches 4",
    ),
    "pl_gru_sgd_clip_lr100x": ("loss/divergence", "Lightning, GRU LM, SGD momentum at LR 30, clip 1"),
    "pl_gru_adam_accum4_lr100x": (
        "loss/divergence|loss/oscillation|gradient/explosion|loss/rise-after-fall",
        "Lightning, GRU LM, Adam LR 0.3, accumulate_grad_batches 4 (stop 34's lead (b): the loss rises, then "
        "learns; a tuning shape of stop 35, not held out; first written 'loss/divergence' alone and widened "
        "to the LR-too-high kinds after its first run peaked at 1.96x its start -- disclosed)",
    ),
    "pl_gru_adam_lr30x": (
        "loss/divergence|loss/oscillation|gradient/explosion|loss/rise-after-fall",
        "Lightning, GRU LM, Adam LR 0.1 without accumulation (a tuning variant of the same, stop 35)",
    ),
    "lora_gpt2_ok": (
        HEALTHY,
        "HF Trainer + peft LoRA r=8 on a pre-trained GPT-2, a new pattern, LR 2e-3 cosine",
    ),
    "lora_gpt2_const_ok": (HEALTHY, "the same, constant LR 1e-3 after warmup, logging_steps 25"),
    "lora_gpt2_lr_high": (
        UNMANIFESTED,
        "the same LoRA at LR 0.5: the loss still falls 8.95 -> ~3.8 (the healthy one: 3.2), so a loss curve "
        "alone cannot tell it from learning; not scored",
    ),
}


def run(name: str) -> None:
    """Run one shape of this set (``trainguard.init`` already called)."""
    {"plain": _plain, "hf": _hf, "lora": _lora, "pl": _lightning}[name.split("_")[0]](name)


def _plain(name: str) -> None:
    import torch
    import torch.nn.functional as F
    from torch import nn

    from bench.unseen import kit

    vocab, classes = 40, 4

    def text_batch(bs: int = 32, length: int = 32) -> Tuple[Any, Any]:
        seq = [torch.randint(0, vocab, (bs, 1))]
        for _ in range(length):
            nxt = (seq[-1] * 3 + 1) % vocab
            seq.append(torch.where(torch.rand(bs, 1) < 0.1, torch.randint(0, vocab, (bs, 1)), nxt))
        s = torch.cat(seq, 1)
        return s[:, :-1], s[:, 1:]

    def cls_batch(bs: int = 32) -> Tuple[Any, Any]:
        x = torch.randint(0, 50, (bs, 24))
        return x, (x == 7).any(1).long() + 2 * (x == 11).any(1).long() + (x[:, 0] > 40).long()

    proto = torch.randn(classes, 1, 12, 12)

    def img_batch(bs: int = 32, label_noise: float = 0.0, random_labels: bool = False) -> Tuple[Any, Any]:
        y = torch.randint(0, classes, (bs,))
        x = proto[y] + 0.8 * torch.randn(bs, 1, 12, 12)
        if random_labels:
            return x, torch.randint(0, classes, (bs,))
        flip = torch.rand(bs) < label_noise
        return x, torch.where(flip, torch.randint(0, classes, (bs,)), y)

    w_true = torch.randn(20, 1)

    def reg_batch(bs: int = 64) -> Tuple[Any, Any]:
        x = torch.randn(bs, 20)
        return x, x @ w_true + 0.1 * torch.randn(bs, 1)

    loop, ce, lstm, enc = kit.loop, kit.ce, lambda: kit.RecurrentLM(vocab), lambda: kit.Encoder(50, 5, 24)
    sched_lambda = torch.optim.lr_scheduler.LambdaLR
    if name == "plain_lstm_adam_onecycle":
        m = lstm()
        o = torch.optim.Adam(m.parameters(), 3e-3)
        loop(m, o, text_batch, ce, 400, torch.optim.lr_scheduler.OneCycleLR(o, 1e-2, total_steps=400))
    elif name == "plain_mlp_accum_cosine_wd":
        m = kit.mlp([20, 64, 1], nn.GELU)
        o = torch.optim.AdamW(m.parameters(), 3e-3, weight_decay=0.1)
        s = sched_lambda(o, lambda t: min(1.0, (t + 1) / 40) * 0.5 * (1 + math.cos(math.pi * t / 500)))
        loop(m, o, reg_batch, F.mse_loss, 500, s, accum=4)
    elif name == "plain_bncnn_sgdm_steplr":
        m = kit.bn_cnn(classes)
        o = torch.optim.SGD(m.parameters(), 0.05, momentum=0.9)
        loop(m, o, img_batch, ce, 450, torch.optim.lr_scheduler.StepLR(o, 150, 0.1))
    elif name == "plain_enc_labelsmooth_warmup":
        m = enc()
        o = torch.optim.Adam(m.parameters(), 1e-3)
        smooth = lambda out, y: F.cross_entropy(out, y, label_smoothing=0.1)  # noqa: E731
        loop(m, o, cls_batch, smooth, 500, sched_lambda(o, lambda t: min(1.0, (t + 1) / 50)), clip=1.0)
    elif name == "plain_mlp_bf16_adagrad_eval":
        m = kit.mlp([20, 128, 1])
        o = torch.optim.Adagrad(m.parameters(), 0.05)
        loop(m, o, reg_batch, F.mse_loss, 400, autocast=torch.bfloat16, eval_every=25)
    elif name == "plain_lstm_rmsprop_clip":
        m = lstm()
        loop(m, torch.optim.RMSprop(m.parameters(), 2e-3), text_batch, ce, 400, clip=0.5)
    elif name == "plain_bncnn_noisy_labels":
        m = kit.bn_cnn(classes)
        loop(m, torch.optim.Adam(m.parameters(), 1e-3), lambda: img_batch(label_noise=0.4), ce, 400)
    elif name == "plain_enc_sgd_too_high":
        m = enc()
        loop(m, torch.optim.SGD(m.parameters(), 3.0, momentum=0.9), cls_batch, ce, 400)
    elif name == "plain_bncnn_shuffled_labels":
        m = kit.bn_cnn(classes)
        loop(m, torch.optim.Adam(m.parameters(), 1e-3), lambda: img_batch(random_labels=True), ce, 400)
    elif name == "plain_mlp_nan_input":
        m = kit.mlp([20, 64, 1])
        loop(m, torch.optim.Adam(m.parameters(), 1e-3), reg_batch, F.mse_loss, 400, nan_at=250)
    elif name == "plain_mlp_lr_zero_bug":
        m = kit.mlp([20, 64, 1])
        o = torch.optim.Adam(m.parameters(), 1e-3)
        loop(m, o, reg_batch, F.mse_loss, 400, sched_lambda(o, lambda t: 0.0))
    else:
        raise SystemExit(f"unknown plain shape {name}")


def _hf(name: str) -> None:
    import torch

    from bench.unseen import kit

    vocab = 64
    lr = {
        "hf_gpt2_default_logging_ok": 5e-4,
        "hf_gpt2_default_logging_lr1000x": 0.5,
        "hf_gpt2_log10_lr10000x": 5.0,
    }[name]

    def row(i: int) -> Dict[str, Any]:
        start = int(torch.randint(0, vocab, (1,), generator=kit.seeded(i)))
        ids = torch.tensor([(start * 5 + 3 * k) % vocab for k in range(32)])
        return {"input_ids": ids, "labels": ids}

    extra = {"logging_steps": 10} if "log10" in name else {}  # else the Trainer's default (500)
    model = kit.hf_model("gpt2", vocab)
    kit.hf_train(model, kit.Rows(100_000, row), "/tmp/trainguard-unseen-hf", 300, lr, **extra)


def _lora(name: str) -> None:
    import torch
    from peft import LoraConfig, get_peft_model

    from bench.unseen import kit

    vocab = 64

    def rows(n: int, seed: int, stride: int) -> Any:
        start = torch.randint(0, vocab, (n, 1), generator=kit.seeded(seed))
        return (start + stride * torch.arange(32)) % vocab

    base = kit.hf_model("gpt2", vocab)
    opt = torch.optim.Adam(base.parameters(), 3e-3)
    for i in range(120):  # pre-train on one pattern (stride 3)
        ids = rows(32, i, 3)
        loss = base(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model = get_peft_model(
        base,
        LoraConfig(r=8, lora_alpha=16, target_modules=["c_attn"], lora_dropout=0.05, fan_in_fan_out=True),
    )
    lr, logging, schedule = {
        "lora_gpt2_ok": (2e-3, 10, "cosine"),
        "lora_gpt2_const_ok": (1e-3, 25, "constant"),
        "lora_gpt2_lr_high": (0.5, 10, "cosine"),
    }[name]
    data = [{"input_ids": r, "labels": r} for r in rows(4800, 99, 7)]  # fine-tune on a new pattern (stride 7)
    kit.hf_train(
        model,
        data,
        "/tmp/trainguard-unseen-lora",
        300,
        lr,
        logging_steps=logging,
        lr_scheduler_type=schedule,
        warmup_steps=20,
    )


def _lightning(name: str) -> None:
    import pytorch_lightning as pl
    import torch

    from bench.unseen import kit

    vocab, length = 48, 24
    opt_name, lr, schedule, accum = {
        "pl_gru_adam_ok": ("adam", 3e-3, "none", 1),
        "pl_gru_sgd_onecycle_ok": ("sgd", 0.5, "onecycle", 1),
        "pl_gru_radam_poly_accum4_ok": ("radam", 3e-3, "poly", 4),
        "pl_gru_sgd_clip_lr100x": ("sgd", 30.0, "none", 1),
        "pl_gru_adam_accum4_lr100x": ("adam", 0.3, "none", 4),
        "pl_gru_adam_lr30x": ("adam", 0.1, "none", 1),
    }[name]

    def row(i: int) -> Any:
        a = int(torch.randint(0, vocab, (1,), generator=kit.seeded(i)))
        s = torch.tensor([(a + 7 * k * k) % vocab for k in range(length + 1)])
        return s[:-1], s[1:]

    class GRULM(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.lm = kit.RecurrentLM(vocab, 64, 96, "gru")

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            x, y = batch
            return kit.ce(self.lm(x), y)

        def configure_optimizers(self) -> Any:
            params = self.parameters()
            o = {
                "sgd": lambda: torch.optim.SGD(params, lr, momentum=0.9),
                "adam": lambda: torch.optim.Adam(params, lr),
                "radam": lambda: torch.optim.RAdam(params, lr),
            }[opt_name]()
            if schedule == "onecycle":
                s: Any = torch.optim.lr_scheduler.OneCycleLR(o, lr, total_steps=400 // accum + 5)
            elif schedule == "poly":
                s = torch.optim.lr_scheduler.PolynomialLR(o, 400, 2.0)
            else:
                return o
            return {"optimizer": o, "lr_scheduler": {"scheduler": s, "interval": "step"}}

    kit.lightning_fit(
        GRULM(),
        kit.Rows(64 * 400, row),
        400 // accum,
        accumulate_grad_batches=accum,
        gradient_clip_val=1.0 if "clip" in name else None,
    )


def main(name: str) -> None:
    """Run shape ``name`` of any set (:mod:`bench.unseen.sets`) as this process's training."""
    import torch

    import trainguard

    try:
        module = importlib.import_module(SETS[set_of(name)][0])
    except KeyError:
        raise SystemExit(
            f"unknown shape {name!r}; known: {', '.join(n for s in SETS for n in shapes(s))}"
        ) from None
    torch.manual_seed(0)
    trainguard.init(run_name=name)
    module.run(name)


if __name__ == "__main__":
    main(sys.argv[1])
