#!/usr/bin/env python3
"""The pieces every set of unseen training shapes shares: one plain training loop, the model builders, the
map-style dataset, and the HF Trainer / Lightning launchers, each instrumented the way the README tells a
user to. Imported only inside a shape's own process (it imports torch).

``TRAINGUARD_SMOKE_STEPS`` (a test of a set's code only, nothing worth recording): every shape stops after
that many steps (:func:`steps`).
"""

from __future__ import annotations

import math
import os
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

SMOKE = int(os.environ.get("TRAINGUARD_SMOKE_STEPS", "0") or 0)


def steps(n: int) -> int:
    """``n``, or the smoke-test cap when one is set."""
    return min(n, SMOKE) if SMOKE else n


def loop(
    model: nn.Module,
    opt: Any,
    batch: Callable[[], Tuple[Any, Any]],
    loss_fn: Callable[..., Any],
    n_steps: int,
    sched: Any = None,
    clip: Optional[float] = None,
    accum: int = 1,
    autocast: Any = None,
    scaler: Any = None,
    lr_at: Optional[Callable[[int], float]] = None,
    plateau: bool = False,
    nan_at: Optional[int] = None,
    eval_every: Optional[int] = None,
    hook: Optional[Callable[[int], None]] = None,
) -> None:
    """A plain PyTorch training loop reporting through ``trainguard.log``.

    ``accum`` micro-batches an optimizer step (the loss reported is their mean); ``autocast`` a CPU
    autocast dtype (None: off); ``scaler`` a GradScaler (the gradients are unscaled before clipping);
    ``lr_at(step)`` sets every group's LR before the step; ``plateau``: ``sched.step(loss)``
    (ReduceLROnPlateau); ``nan_at``: from that step on, one input row is NaN; ``eval_every``: an
    ``eval_loss`` on a fresh batch; ``hook(step)`` runs before each step (a planted fault). Stops at the
    first non-finite loss."""
    import trainguard

    trainguard.watch(model, opt, scaler=scaler, clip=clip)
    for step in range(steps(n_steps)):
        if hook is not None:
            hook(step)
        if lr_at is not None:
            for group in opt.param_groups:
                group["lr"] = lr_at(step)
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for _ in range(accum):
            x, y = batch()
            if nan_at is not None and step >= nan_at:
                x[0].fill_(float("nan"))
            with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
                loss = loss_fn(model(x), y) / accum
            if scaler is not None:
                scaler.scale(loss).backward()
            else:
                loss.backward()
            total += float(loss)
        if scaler is not None:
            scaler.unscale_(opt)
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        if sched is not None:
            sched.step(total) if plateau else sched.step()
        trainguard.log(step=step, loss=total, lr=opt.param_groups[0]["lr"])
        if eval_every and step % eval_every == 0:
            with torch.no_grad():
                x, y = batch()
                trainguard.log(step=step, eval_loss=float(loss_fn(model(x), y)))
        if not math.isfinite(total):
            break


def ce(out: Any, y: Any) -> Any:
    """Cross-entropy over the last axis (sequence outputs flattened)."""
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


# ----------------------------------------------------------------------------------------- models


class RecurrentLM(nn.Module):
    """Embedding -> LSTM/GRU -> Linear over the vocabulary (a next-token model)."""

    def __init__(self, vocab: int, embed: int = 32, hidden: int = 64, cell: str = "lstm") -> None:
        super().__init__()
        rnn = {"lstm": nn.LSTM, "gru": nn.GRU}[cell]
        self.e, self.rnn = nn.Embedding(vocab, embed), rnn(embed, hidden, batch_first=True)
        self.o = nn.Linear(hidden, vocab)

    def forward(self, x: Any) -> Any:
        return self.o(self.rnn(self.e(x))[0])


class Encoder(nn.Module):
    """A Transformer-encoder sequence classifier (mean-pooled); ``positions``: a learned position table."""

    def __init__(
        self,
        vocab: int,
        classes: int,
        positions: int = 0,
        width: int = 64,
        layers: int = 2,
        dropout: float = 0.1,
    ) -> None:
        super().__init__()
        self.e = nn.Embedding(vocab, width)
        self.p = nn.Parameter(torch.zeros(1, positions, width)) if positions else None
        layer = nn.TransformerEncoderLayer(width, 4, 2 * width, dropout=dropout, batch_first=True)
        self.t, self.o = nn.TransformerEncoder(layer, layers), nn.Linear(width, classes)

    def forward(self, x: Any) -> Any:
        h = self.e(x)
        return self.o(self.t(h if self.p is None else h + self.p).mean(1))


class CausalLM(nn.Module):
    """A pre-norm causal Transformer LM over ``vocab`` tokens, sequences of ``length``."""

    def __init__(self, vocab: int, length: int = 32, width: int = 64, layers: int = 2) -> None:
        super().__init__()
        self.e, self.p = nn.Embedding(vocab, width), nn.Parameter(0.02 * torch.randn(1, length, width))
        layer = nn.TransformerEncoderLayer(
            width, 4, 2 * width, dropout=0.0, batch_first=True, norm_first=True
        )
        self.t, self.o = nn.TransformerEncoder(layer, layers), nn.Linear(width, vocab)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(length))

    def forward(self, x: Any) -> Any:
        return self.o(self.t(self.e(x) + self.p, mask=self.mask, is_causal=True))


class ResMLP(nn.Module):
    """Linear in, ``blocks`` pre-LayerNorm residual blocks, Linear out."""

    def __init__(self, inputs: int = 16, width: int = 64, blocks: int = 3, out: int = 1) -> None:
        super().__init__()
        self.i = nn.Linear(inputs, width)
        self.b = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width), nn.SiLU(), nn.Linear(width, width))
            for _ in range(blocks)
        )
        self.o = nn.Linear(width, out)

    def forward(self, x: Any) -> Any:
        h = self.i(x)
        for block in self.b:
            h = h + block(h)
        return self.o(h)


def mlp(sizes: Sequence[int], act: Callable[[], nn.Module] = nn.ReLU) -> nn.Sequential:
    """Linear layers of ``sizes`` (in, hidden..., out) with ``act`` between them."""
    layers: List[nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes, sizes[1:])):
        layers += [nn.Linear(a, b)] + ([act()] if i < len(sizes) - 2 else [])
    return nn.Sequential(*layers)


def bn_cnn(classes: int, pool: bool = True, channels: Tuple[int, int] = (16, 32)) -> nn.Sequential:
    """Two conv + BatchNorm + ReLU blocks (the second after a max-pool, or strided when ``pool`` is off),
    global average pooling, a linear head."""
    a, b = channels
    down: List[nn.Module] = (
        [nn.MaxPool2d(2), nn.Conv2d(a, b, 3, padding=1)]
        if pool
        else [nn.Conv2d(a, b, 3, padding=1, stride=2)]
    )
    return nn.Sequential(
        nn.Conv2d(1, a, 3, padding=1),
        nn.BatchNorm2d(a),
        nn.ReLU(),
        *down,
        nn.BatchNorm2d(b),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(b, classes),
    )


def hf_model(
    kind: str,
    vocab: int,
    width: int = 64,
    layers: int = 2,
    heads: int = 4,
    positions: int = 32,
    labels: int = 2,
) -> Any:
    """A tiny, randomly initialised Hugging Face model: ``gpt2`` (causal LM), ``bert`` (sequence
    classifier) or ``llama`` (causal LM, RMSNorm + rotary + SwiGLU)."""
    import transformers as tf

    if kind == "gpt2":
        return tf.GPT2LMHeadModel(
            tf.GPT2Config(vocab_size=vocab, n_positions=positions, n_embd=width, n_layer=layers, n_head=heads)
        )
    sizes = dict(
        vocab_size=vocab,
        hidden_size=width,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=2 * width,
        max_position_embeddings=positions,
    )
    if kind == "bert":
        return tf.BertForSequenceClassification(tf.BertConfig(num_labels=labels, **sizes))
    if kind == "llama":
        return tf.LlamaForCausalLM(tf.LlamaConfig(num_key_value_heads=heads, **sizes))
    raise ValueError(f"unknown model kind {kind!r}")


class Lion(torch.optim.Optimizer):
    """A Lion-style optimizer (sign of an interpolated momentum; our own few lines, for shapes that want one:
    torch has none): ``p -= lr * (sign(b1 m + (1 - b1) g) + wd p)``, then ``m = b2 m + (1 - b2) g``."""

    def __init__(
        self,
        params: Any,
        lr: float = 1e-4,
        betas: Tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0.0,
    ) -> None:
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                m = self.state[p].setdefault("exp_avg", torch.zeros_like(p))
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(torch.sign(m * b1 + p.grad * (1 - b1)), alpha=-group["lr"])
                m.mul_(b2).add_(p.grad, alpha=1 - b2)
        return loss


def warmup_cosine(warmup: int, total: int, floor: float = 0.0) -> Callable[[int], float]:
    """An LR factor: linear warmup over ``warmup`` steps, then a cosine to ``floor`` at ``total``."""

    def factor(t: int) -> float:
        if t < warmup:
            return (t + 1) / warmup
        return floor + (1 - floor) * 0.5 * (
            1 + math.cos(math.pi * min(1.0, (t - warmup) / max(1, total - warmup)))
        )

    return factor


# ------------------------------------------------------------------------------ data and launchers


def image_batches(
    classes: int, side: int, noise: float, seed: int, bs: int = 32
) -> Callable[[], Tuple[Any, Any]]:
    """Batches of 1-channel images: a fixed prototype per class (seeded) plus Gaussian noise."""
    proto = torch.randn(classes, 1, side, side, generator=seeded(seed))

    def batch() -> Tuple[Any, Any]:
        y = torch.randint(0, classes, (bs,))
        return proto[y] + noise * torch.randn(bs, 1, side, side), y

    return batch


class Rows(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """``n`` rows, row ``i`` made by ``row(i)`` (seeded by ``i``: the same rows every run)."""

    def __init__(self, n: int, row: Callable[[int], Any]) -> None:
        self.n, self.row = n, row

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        return self.row(i)


def lm_rows(vocab: int, length: int, stride_max: int, seed: int = 0) -> Callable[[int], Dict[str, Any]]:
    """Row ``i`` of a language-model set: an arithmetic sequence mod ``vocab`` whose start and stride
    (1 .. ``stride_max``) are seeded by ``seed + i``; labels = inputs (the model shifts them)."""

    def row(i: int) -> Dict[str, Any]:
        g = seeded(seed + i)
        a = int(torch.randint(0, vocab, (1,), generator=g))
        b = int(torch.randint(1, stride_max + 1, (1,), generator=g))
        ids = (a + b * torch.arange(length)) % vocab
        return {"input_ids": ids, "labels": ids.clone()}

    return row


class HFLogits(nn.Module):
    """An HF causal LM (``inner``, a peft model too) as ``ids -> logits``, for :func:`loop`'s ``model(x)``."""

    def __init__(self, inner: Any) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, ids: Any) -> Any:
        return self.inner(input_ids=ids).logits


def lm_batches(row: Callable[[int], Dict[str, Any]], bs: int = 16) -> Callable[[], Tuple[Any, Any]]:
    """Batches of ``bs`` consecutive ``row``s (rows 0, 1, 2 ... in turn) as next-token pairs: the ids
    without their last token, and without their first."""
    at = [0]

    def batch() -> Tuple[Any, Any]:
        ids = torch.stack([row(at[0] + k)["input_ids"] for k in range(bs)])
        at[0] += bs
        return ids[:, :-1], ids[:, 1:]

    return batch


def pretrained(model: Any, row: Callable[[int], Dict[str, Any]], n_steps: int = 120, lr: float = 3e-3) -> Any:
    """``model`` (an HF causal LM) after ``n_steps`` Adam steps on batches of 32 ``row``s (no SDK)."""
    opt = torch.optim.Adam(model.parameters(), lr)
    for i in range(n_steps):
        ids = torch.stack([row(32 * i + k)["input_ids"] for k in range(32)])
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model


def hf_train(
    model: Any,
    data: Any,
    out_dir: str,
    n_steps: int,
    lr: float,
    batch: int = 16,
    callbacks: Sequence[Any] = (),
    **extra: Any,
) -> None:
    """Train ``model`` on ``data`` with the HF ``Trainer`` on the CPU (``extra``: more
    ``TrainingArguments``), with the SDK's ``TrainGuardCallback`` (after ``callbacks``)."""
    from transformers import Trainer, TrainingArguments

    from trainguard.integrations.transformers import TrainGuardCallback

    args = TrainingArguments(
        output_dir=out_dir,
        max_steps=steps(n_steps),
        per_device_train_batch_size=batch,
        learning_rate=lr,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
        **extra,
    )
    Trainer(model=model, args=args, train_dataset=data, callbacks=[*callbacks, TrainGuardCallback()]).train()


def lightning_fit(module: Any, data: Any, n_steps: int, batch: int = 32, **trainer: Any) -> None:
    """Fit a LightningModule for ``n_steps`` optimizer steps on the CPU with the SDK's callback
    (``trainer``: more ``pl.Trainer`` arguments: accumulate_grad_batches, gradient_clip_val, precision)."""
    import pytorch_lightning as pl

    from trainguard.integrations.lightning import TrainGuardCallback

    quiet = dict.fromkeys(
        ("logger", "enable_checkpointing", "enable_progress_bar", "enable_model_summary"), False
    )
    pl.Trainer(
        max_steps=steps(n_steps),
        accelerator="cpu",
        devices=1,
        callbacks=[TrainGuardCallback()],
        **quiet,
        **trainer,
    ).fit(module, torch.utils.data.DataLoader(data, batch_size=batch))


def seeded(i: int) -> torch.Generator:
    """A generator seeded by ``i`` (a dataset row's own randomness)."""
    return torch.Generator().manual_seed(i)


Batch = Callable[[], Tuple[Any, Any]]
Extra = Dict[str, Any]
