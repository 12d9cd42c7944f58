#!/usr/bin/env python3
"""The held-out training shapes of stop 35 (``shapes.HELDOUT_SHAPES``): written and committed, with their
expectations, before any of them ran and before the stop's detector changes; run once, at the end, with the
engine kept. Never used to tune anything.

New against ``SHAPES`` and bench/corpus: a 1-D CNN, a residual MLP, a causal Transformer LM, a deep MLP
without normalisation, a tiny BERT classifier, an LSTM under Lightning; NAdam, Adamax, AdamW, Adafactor,
Adagrad under Lightning; CosineAnnealingWarmRestarts, ExponentialLR, ReduceLROnPlateau, an LR range test
gone wrong, an LR spike from a bad schedule edit, warmup + linear decay at 100x; fp16 autocast with a
GradScaler, bf16 under the HF Trainer and Lightning (``bf16-mixed``); clipping active on most steps of a
healthy run, clipping beside an LR too high for it.

``TRAINGUARD_SMOKE_STEPS`` (a test of this file's code only, nothing recorded): every shape stops after that
many steps.
"""

from __future__ import annotations

import math
import os
from typing import Any, Callable, Optional, Tuple

SMOKE = int(os.environ.get("TRAINGUARD_SMOKE_STEPS", "0") or 0)


def _steps(n: int) -> int:
    return min(n, SMOKE) if SMOKE else n


def _plain(name: str) -> None:
    import torch
    import torch.nn.functional as F
    from torch import nn

    import trainguard

    def loop(
        model: nn.Module,
        opt: Any,
        batch: Callable[[], Tuple[Any, Any]],
        loss_fn: Callable[..., Any],
        steps: int,
        sched: Any = None,
        clip: Optional[float] = None,
        autocast: Any = None,
        scaler: Any = None,
        lr_at: Optional[Callable[[int], float]] = None,
        plateau: bool = False,
    ) -> None:
        trainguard.watch(model, opt, scaler=scaler, clip=clip)
        for step in range(_steps(steps)):
            if lr_at is not None:
                for group in opt.param_groups:
                    group["lr"] = lr_at(step)
            opt.zero_grad(set_to_none=True)
            x, y = batch()
            with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
                loss = loss_fn(model(x), y)
            if scaler is not None:
                scaler.scale(loss).backward()
                scaler.unscale_(opt)
            else:
                loss.backward()
            if clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            if scaler is not None:
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
            value = float(loss)
            if sched is not None:
                sched.step(value) if plateau else sched.step()
            trainguard.log(step=step, loss=value, lr=opt.param_groups[0]["lr"])
            if not math.isfinite(value):
                break

    def ce(out: Any, y: Any) -> Any:
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))

    def seq_cls(bs: int = 32) -> Tuple[Any, Any]:  # is there a rising run of 3 among 32 tokens of 0..15?
        x = torch.randint(0, 16, (bs, 32))
        up = ((x[:, 1:-1] == x[:, :-2] + 1) & (x[:, 2:] == x[:, 1:-1] + 1)).any(1).long()
        return x, up + 2 * (x[:, :4].sum(1) > 34).long()

    class TCN(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.e = nn.Embedding(16, 32)
            self.c = nn.Sequential(
                nn.Conv1d(32, 64, 3, padding=1),
                nn.GELU(),
                nn.Conv1d(64, 64, 3, padding=2, dilation=2),
                nn.GELU(),
            )
            self.o = nn.Linear(64, 4)

        def forward(self, x: Any) -> Any:
            return self.o(self.c(self.e(x).transpose(1, 2)).amax(2))

    class GRUReg(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.g, self.o = nn.GRU(1, 48, batch_first=True), nn.Linear(48, 1)

        def forward(self, x: Any) -> Any:
            return self.o(self.g(x)[0])

    def running_mean(bs: int = 32) -> Tuple[Any, Any]:
        x = torch.randn(bs, 20, 1)
        return x, torch.cumsum(x, 1) / torch.arange(1, 21).view(1, 20, 1)

    class ResMLP(nn.Module):
        def __init__(self, width: int = 64, blocks: int = 3, out: int = 1) -> None:
            super().__init__()
            self.i = nn.Linear(16, width)
            self.b = nn.ModuleList(
                nn.Sequential(
                    nn.LayerNorm(width), nn.Linear(width, width), nn.SiLU(), nn.Linear(width, width)
                )
                for _ in range(blocks)
            )
            self.o = nn.Linear(width, out)

        def forward(self, x: Any) -> Any:
            h = self.i(x)
            for block in self.b:
                h = h + block(h)
            return self.o(h)

    w_true = torch.randn(16, 1)

    def smooth_reg(bs: int = 64) -> Tuple[Any, Any]:
        x = torch.randn(bs, 16)
        return x, torch.sin(x @ w_true) + 0.05 * torch.randn(bs, 1)

    def blob_cls(bs: int = 64) -> Tuple[Any, Any]:
        y = torch.randint(0, 6, (bs,))
        centres = torch.Generator().manual_seed(5)
        return torch.randn(6, 16, generator=centres)[y] * 1.5 + torch.randn(bs, 16), y

    vocab = 32

    class CausalLM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.e, self.p = nn.Embedding(vocab, 64), nn.Parameter(0.02 * torch.randn(1, 32, 64))
            layer = nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True, norm_first=True)
            self.t, self.o = nn.TransformerEncoder(layer, 2), nn.Linear(64, vocab)
            self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(32))

        def forward(self, x: Any) -> Any:
            return self.o(self.t(self.e(x) + self.p, mask=self.mask, is_causal=True))

    def lm_batch(bs: int = 32) -> Tuple[Any, Any]:
        a = torch.randint(0, vocab, (bs, 1))
        b = torch.randint(1, 4, (bs, 1))
        s = (a + b * torch.arange(33)) % vocab
        return s[:, :-1], s[:, 1:]

    class Enc(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.e = nn.Embedding(16, 64)
            layer = nn.TransformerEncoderLayer(64, 4, 128, dropout=0.1, batch_first=True)
            self.t, self.o = nn.TransformerEncoder(layer, 2), nn.Linear(64, 4)

        def forward(self, x: Any) -> Any:
            return self.o(self.t(self.e(x)).mean(1))

    w_lin = torch.randn(16, 1)

    def lin_reg(bs: int = 64) -> Tuple[Any, Any]:
        x = torch.randn(bs, 16)
        return x, x @ w_lin + 0.1 * torch.randn(bs, 1)

    if name == "ho_plain_tcn_adamw_warmrestarts_ok":
        m = TCN()
        o = torch.optim.AdamW(m.parameters(), 2e-3, weight_decay=0.05)
        loop(m, o, seq_cls, ce, 400, torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(o, 100))
    elif name == "ho_plain_gru_nadam_explr_ok":
        m = GRUReg()
        o = torch.optim.NAdam(m.parameters(), 3e-3)
        loop(m, o, running_mean, F.mse_loss, 400, torch.optim.lr_scheduler.ExponentialLR(o, 0.995))
    elif name == "ho_plain_mlp_fp16_scaler_ok":
        m = ResMLP(out=6)
        o = torch.optim.Adam(m.parameters(), 1e-3)
        scaler = torch.amp.GradScaler("cpu")
        loop(m, o, blob_cls, ce, 400, clip=1.0, autocast=torch.float16, scaler=scaler)
    elif name == "ho_plain_resmlp_adamax_plateau_ok":
        m = ResMLP()
        o = torch.optim.Adamax(m.parameters(), 2e-3)
        s = torch.optim.lr_scheduler.ReduceLROnPlateau(o, factor=0.5, patience=20)
        loop(m, o, smooth_reg, F.mse_loss, 400, s, plateau=True)
    elif name == "ho_plain_causal_lm_clip_active_ok":
        m = CausalLM()
        o = torch.optim.AdamW(m.parameters(), 1e-3, weight_decay=0.01)
        warm = lambda t: min(1.0, (t + 1) / 40) * max(0.05, 1 - t / 400)  # noqa: E731
        loop(m, o, lm_batch, ce, 400, torch.optim.lr_scheduler.LambdaLR(o, warm), clip=0.25)
    elif name == "ho_plain_enc_adam_lr_high_clip":
        m = Enc()
        loop(m, torch.optim.Adam(m.parameters(), 0.3), seq_cls, ce, 400, clip=1.0)
    elif name == "ho_plain_mlp_lr_spike_recover":
        m = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))
        o = torch.optim.SGD(m.parameters(), 0.01)
        loop(m, o, lin_reg, F.mse_loss, 400, lr_at=lambda t: 0.1 if 150 <= t < 158 else 0.01)
    elif name == "ho_plain_deep_mlp_bf16_sgd_explode":
        layers: list = []
        for i in range(8):
            layers += [nn.Linear(16 if i == 0 else 64, 64), nn.ReLU()]
        m = nn.Sequential(*layers, nn.Linear(64, 1))
        o = torch.optim.SGD(m.parameters(), 1e-3)
        loop(m, o, lin_reg, F.mse_loss, 400, autocast=torch.bfloat16, lr_at=lambda t: 1e-3 * 1.03**t)
    else:
        raise SystemExit(f"unknown held-out plain shape {name}")


def _hf(name: str) -> None:
    import torch
    from transformers import Trainer, TrainingArguments

    from trainguard.integrations.transformers import TrainGuardCallback

    vocab = 64
    extra: dict = {}
    if name == "ho_hf_bert_cls_ok":
        from transformers import BertConfig, BertForSequenceClassification

        model: Any = BertForSequenceClassification(
            BertConfig(
                vocab_size=vocab,
                hidden_size=64,
                num_hidden_layers=2,
                num_attention_heads=4,
                intermediate_size=128,
                max_position_embeddings=32,
                num_labels=3,
            )
        )

        def row(i: int) -> dict:
            ids = torch.randint(0, vocab, (24,), generator=torch.Generator().manual_seed(i))
            label = int((ids == 5).any()) + int((ids == 9).any())
            return {"input_ids": ids, "labels": torch.tensor(label)}

        lr, extra = 5e-4, {"warmup_steps": 30, "lr_scheduler_type": "linear", "logging_steps": 20}
    else:
        from transformers import GPT2Config, GPT2LMHeadModel

        model = GPT2LMHeadModel(GPT2Config(vocab_size=vocab, n_positions=32, n_embd=64, n_layer=2, n_head=4))

        def row(i: int) -> dict:
            g = torch.Generator().manual_seed(i)
            a, b = (
                int(torch.randint(0, vocab, (1,), generator=g)),
                int(torch.randint(1, 5, (1,), generator=g)),
            )
            ids = torch.tensor([(a + b * k) % vocab for k in range(32)])
            return {"input_ids": ids, "labels": ids}

        if name == "ho_hf_gpt2_lr100x_warmup_clip":
            lr, extra = 0.05, {"warmup_steps": 50, "lr_scheduler_type": "linear", "logging_steps": 25}
        elif name == "ho_hf_gpt2_bf16_adafactor_ok":
            lr, extra = (
                1e-3,
                {
                    "bf16": True,
                    "optim": "adafactor",
                    "lr_scheduler_type": "cosine",
                    "warmup_steps": 20,
                    "logging_steps": 10,
                },
            )
        else:
            raise SystemExit(f"unknown held-out hf shape {name}")

    class Rows(torch.utils.data.Dataset):  # type: ignore[type-arg]
        def __len__(self) -> int:
            return 100_000

        def __getitem__(self, i: int) -> dict:
            return row(i)

    args = TrainingArguments(
        output_dir="/tmp/trainguard-heldout-hf",
        max_steps=_steps(300),
        per_device_train_batch_size=16,
        learning_rate=lr,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
        **extra,
    )
    Trainer(model=model, args=args, train_dataset=Rows(), callbacks=[TrainGuardCallback()]).train()


def _lightning(name: str) -> None:
    import pytorch_lightning as pl
    import torch
    import torch.nn.functional as F
    from torch import nn

    from trainguard.integrations.lightning import TrainGuardCallback

    vocab = 40
    steps, accum, precision, clip = 400, 1, "32-true", None
    if name == "ho_pl_lstm_adamw_accum2_lr_high":
        accum = 2
    elif name == "ho_pl_cnn_sgd_bf16_accum2_ok":
        accum, precision = 2, "bf16-mixed"
    elif name == "ho_pl_mlp_adagrad_lr_high_clip":
        clip = 0.5
    else:
        raise SystemExit(f"unknown held-out lightning shape {name}")

    proto = torch.randn(5, 1, 10, 10, generator=torch.Generator().manual_seed(3))
    w = torch.randn(12, 1, generator=torch.Generator().manual_seed(4))

    class Rows(torch.utils.data.Dataset):  # type: ignore[type-arg]
        def __len__(self) -> int:
            return 32 * steps

        def __getitem__(self, i: int) -> Any:
            g = torch.Generator().manual_seed(i)
            if "lstm" in name:
                a = int(torch.randint(0, vocab, (1,), generator=g))
                s = torch.tensor([(a * (k + 1) + k * k) % vocab for k in range(25)])
                return s[:-1], s[1:]
            if "cnn" in name:
                y = int(torch.randint(0, 5, (1,), generator=g))
                return proto[y] + 0.9 * torch.randn(1, 10, 10, generator=g), y
            x = torch.randn(12, generator=g)
            return x, (x @ w).squeeze(0) ** 2 / 4

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            if "lstm" in name:
                self.net: Any = nn.ModuleDict(
                    {
                        "e": nn.Embedding(vocab, 48),
                        "r": nn.LSTM(48, 96, batch_first=True),
                        "o": nn.Linear(96, vocab),
                    }
                )
            elif "cnn" in name:
                self.net = nn.Sequential(
                    nn.Conv2d(1, 16, 3, padding=1),
                    nn.BatchNorm2d(16),
                    nn.ReLU(),
                    nn.Conv2d(16, 32, 3, padding=1, stride=2),
                    nn.BatchNorm2d(32),
                    nn.ReLU(),
                    nn.AdaptiveAvgPool2d(1),
                    nn.Flatten(),
                    nn.Linear(32, 5),
                )
            else:
                self.net = nn.Sequential(
                    nn.Linear(12, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1)
                )

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            x, y = batch
            if "lstm" in name:
                out = self.net["o"](self.net["r"](self.net["e"](x))[0])
                return F.cross_entropy(out.reshape(-1, vocab).float(), y.reshape(-1))
            if "cnn" in name:
                return F.cross_entropy(self.net(x).float(), y)
            return F.mse_loss(self.net(x).squeeze(1).float(), y)

        def configure_optimizers(self) -> Any:
            if "lstm" in name:
                return torch.optim.AdamW(self.parameters(), 0.1)
            if "cnn" in name:
                o = torch.optim.SGD(self.parameters(), 0.05, momentum=0.9, nesterov=True)
                s = torch.optim.lr_scheduler.CosineAnnealingLR(o, steps // accum)
                return {"optimizer": o, "lr_scheduler": {"scheduler": s, "interval": "step"}}
            return torch.optim.Adagrad(self.parameters(), 5.0)

    trainer = pl.Trainer(
        max_steps=_steps(steps // accum),
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[TrainGuardCallback()],
        accumulate_grad_batches=accum,
        gradient_clip_val=clip,
        precision=precision,  # type: ignore[arg-type]
    )
    trainer.fit(Model(), torch.utils.data.DataLoader(Rows(), batch_size=32))


def run(name: str) -> None:
    """Run one held-out shape (``trainguard.init`` already called by the caller)."""
    {"plain": _plain, "hf": _hf, "pl": _lightning}[name.split("_")[1]](name)
