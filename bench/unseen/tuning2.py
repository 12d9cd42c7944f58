#!/usr/bin/env python3
"""Stop 36's TUNING set of unseen training shapes (set ``tuning36``): written, with its expectations and
its scoring rules (probe.py's trace rules), before any of it ran and before the stop's detector changes.
The detectors may be tuned on these (and only on these and the corpus's dev half); the held-out set of the
stop is :mod:`bench.unseen.heldout2`.

Each model/framework pair comes healthy and with planted faults: an LR too high (x10 .. x1000 the healthy
one, with and without ``clip_grad_norm_``), bad data (a NaN target, labels all masked out), a frozen
network, a schedule that vanishes. New against the other sets: a patch Transformer (ViT-like) on images, a
convolutional autoencoder, a bidirectional-LSTM tagger, a tabular MLP with embeddings, a tiny Llama under
the HF Trainer and under peft LoRA, a BERT classifier with transformers' Adafactor, a dilated 1-D CNN
forecaster under Lightning; AdamW, Adafactor, SGD + Nesterov, a Lion-style optimizer, RMSprop; warmup +
cosine, linear decay, constant; bf16 autocast.

Expected kinds are decided from what was done to each run. A planted fault whose cause does not show in
the run's loss is not scored (probe.py's trace rules: an LR / data fault must reach >= 2x the initial loss
or a non-finite one; a stalling fault -- frozen, vanishing schedule -- must leave the loss unlearned).
"""

from __future__ import annotations

from typing import Any, Tuple

from bench.unseen.sets import HEALTHY, LR_TOO_HIGH, Expectations

NAN = "gradient/nan-source|loss/non_finite"
STALL = "loss/plateau"

SHAPES: Expectations = {
    # plain loops
    "tu_plain_vit_adamw_cosine_ok": (
        HEALTHY,
        "patch Transformer on 12x12 images, AdamW 1e-3, warmup 30 + cosine, clip 1",
    ),
    "tu_plain_vit_adamw_lr100x_clip": (LR_TOO_HIGH, "the same at AdamW 0.1 (100x), clip 1"),
    "tu_plain_vit_frozen": (
        STALL,
        "the same, AdamW 1e-3, but every parameter frozen save the class token (a freeze bug)",
    ),
    "tu_plain_ae_rmsprop_const_ok": (HEALTHY, "conv autoencoder (MSE), RMSprop 1e-3, constant LR"),
    "tu_plain_ae_rmsprop_lr1000x": (LR_TOO_HIGH, "the same at RMSprop 1.0 (1000x), no clip"),
    "tu_plain_ae_vanishing_sched": (
        STALL,
        "the same, RMSprop 1e-3 with ExponentialLR 0.8 (LR ~0 by step 40)",
    ),
    "tu_plain_tagger_nesterov_linear_ok": (HEALTHY, "BiLSTM tagger, SGD Nesterov 0.1, linear decay, clip 5"),
    "tu_plain_tagger_nesterov_lr30x_clip": (LR_TOO_HIGH, "the same at SGD Nesterov 3.0 (30x), clip 0.5"),
    "tu_plain_tab_lion_bf16_ok": (HEALTHY, "tabular MLP with embeddings, Lion 3e-4, bf16 autocast, constant"),
    "tu_plain_tab_lion_bf16_lr300x": (LR_TOO_HIGH, "the same at Lion 0.1 (300x)"),
    "tu_plain_tab_lion_bf16_lr30x_clip": (LR_TOO_HIGH, "the same at Lion 0.01 (30x), clip 1"),
    "tu_plain_tab_adamw_nan_target": (
        NAN,
        "the tabular MLP, AdamW 1e-3, a NaN target in one row from step 200",
    ),
    # HF Trainer (max_grad_norm 1 by default: clipping on)
    "tu_hf_llama_adamw_cosine_ok": (
        HEALTHY,
        "HF Trainer, tiny Llama LM, AdamW 1e-3, warmup 20 + cosine, logging 10",
    ),
    "tu_hf_llama_lr300x": (LR_TOO_HIGH, "the same at 0.3 (300x)"),
    "tu_hf_llama_lr30x_const": (LR_TOO_HIGH, "the same at 0.03 (30x), constant after warmup, logging 25"),
    "tu_hf_llama_masked_labels": (
        NAN,
        "the same at 1e-3: from step 150 every label is -100 (a masking bug): loss NaN",
    ),
    "tu_hf_bert_adafactor_const_ok": (
        HEALTHY,
        "HF Trainer, tiny BERT classifier, Adafactor 1e-3 constant, logging 10",
    ),
    "tu_hf_bert_adafactor_lr1000x": (LR_TOO_HIGH, "the same at Adafactor 1.0 (1000x)"),
    # Lightning
    "tu_pl_wavenet_rmsprop_ok": (HEALTHY, "Lightning, dilated 1-D CNN forecaster, RMSprop 1e-3"),
    "tu_pl_wavenet_rmsprop_lr100x_clip": (LR_TOO_HIGH, "the same at RMSprop 0.1 (100x), gradient_clip_val 1"),
    "tu_pl_wavenet_vanishing_sched": (
        STALL,
        "the same at 1e-3, a linear decay whose total is 15 steps (LR 0 after)",
    ),
    "tu_pl_mlp_nesterov_bf16_ok": (
        HEALTHY,
        "Lightning, MLP classifier, SGD Nesterov 0.05, warmup + cosine, bf16-mixed",
    ),
    "tu_pl_mlp_nesterov_bf16_lr100x": (LR_TOO_HIGH, "the same at SGD Nesterov 5.0 (100x)"),
    # peft LoRA (HF Trainer)
    "tu_lora_llama_ok": (
        HEALTHY,
        "peft LoRA r=8 on q/v of a pre-trained tiny Llama, a new pattern, AdamW 2e-3 linear",
    ),
    "tu_lora_llama_lr500x": (LR_TOO_HIGH, "the same at 1.0 (500x)"),
    # added after the set's first run (09:20 UTC), which had no LR too high beside clipping whose loss rose
    # slowly (stop 35's held-out misses, the lead of this stop): new shapes of that family, plain loops
    "tu_plain_tanh_cls_adagrad_lr_high_clip": (
        LR_TOO_HIGH,
        "tanh MLP classifier on blobs, Adagrad 3.0, clip 0.5",
    ),
    "tu_plain_lstm_adamw_lr_high_clip": (LR_TOO_HIGH, "LSTM LM, AdamW 0.2, clip 0.25"),
    "tu_plain_resmlp_sgd_lr_high_clip": (LR_TOO_HIGH, "residual MLP regression, SGD momentum 1.0, clip 1"),
    "tu_plain_enc_adam_lr_high_clip": (
        LR_TOO_HIGH,
        "Transformer-encoder tagger-classifier, Adam 0.2, clip 0.5",
    ),
}


def run(name: str) -> None:
    """Run one shape of this set (``trainguard.init`` already called)."""
    {"plain": _plain, "hf": _hf, "pl": _lightning, "lora": _lora}[name.split("_")[1]](name)


def _plain(name: str) -> None:
    import torch
    import torch.nn.functional as F
    from torch import nn

    from bench.unseen import kit

    loop, ce = kit.loop, kit.ce
    sched_lambda = torch.optim.lr_scheduler.LambdaLR

    class PatchTransformer(nn.Module):
        def __init__(self, side: int = 12, patch: int = 4, width: int = 64, classes: int = 5) -> None:
            super().__init__()
            self.patch = patch
            self.embed = nn.Linear(patch * patch, width)
            self.cls = nn.Parameter(torch.zeros(1, 1, width))
            self.pos = nn.Parameter(0.02 * torch.randn(1, (side // patch) ** 2 + 1, width))
            layer = nn.TransformerEncoderLayer(
                width, 4, 2 * width, dropout=0.0, batch_first=True, norm_first=True
            )
            self.t, self.head = (
                nn.TransformerEncoder(layer, 2),
                nn.Sequential(nn.LayerNorm(width), nn.Linear(width, classes)),
            )

        def forward(self, x: Any) -> Any:
            p = (
                x.unfold(2, self.patch, self.patch)
                .unfold(3, self.patch, self.patch)
                .reshape(x.shape[0], -1, self.patch**2)
            )
            h = torch.cat([self.cls.expand(x.shape[0], -1, -1), self.embed(p)], 1) + self.pos
            return self.head(self.t(h)[:, 0])

    class ConvAE(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.enc = nn.Sequential(
                nn.Conv2d(1, 16, 3, 2, 1), nn.ReLU(), nn.Conv2d(16, 8, 3, 2, 1), nn.ReLU()
            )
            self.dec = nn.Sequential(
                nn.ConvTranspose2d(8, 16, 4, 2, 1), nn.ReLU(), nn.ConvTranspose2d(16, 1, 4, 2, 1)
            )

        def forward(self, x: Any) -> Any:
            return self.dec(self.enc(x))

    class Tagger(nn.Module):
        def __init__(self, vocab: int = 30, tags: int = 3) -> None:
            super().__init__()
            self.e, self.r = nn.Embedding(vocab, 32), nn.LSTM(32, 48, batch_first=True, bidirectional=True)
            self.o = nn.Linear(96, tags)

        def forward(self, x: Any) -> Any:
            return self.o(self.r(self.e(x))[0])

    class Tabular(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.cat = nn.ModuleList(nn.Embedding(n, 8) for n in (7, 12, 5))
            self.body = kit.mlp([8 * 3 + 10, 128, 64, 1], nn.GELU)

        def forward(self, x: Any) -> Any:
            cats = [e(x[:, 10 + i].long()) for i, e in enumerate(self.cat)]
            return self.body(torch.cat([x[:, :10], *cats], 1))

    images = kit.image_batches(5, 12, 0.9, seed=11)

    def ae_batch() -> Tuple[Any, Any]:
        x = images()[0]
        return x, x

    def tag_batch(
        bs: int = 32,
    ) -> Tuple[Any, Any]:  # tag 1: a token equal to the one two back; 2: a token < 5
        x = torch.randint(0, 30, (bs, 20))
        y = (x < 5).long() * 2
        y[:, 2:] = torch.where(x[:, 2:] == x[:, :-2], torch.ones_like(y[:, 2:]), y[:, 2:])
        return x, y

    w_num, w_cat = torch.randn(10, 1, generator=kit.seeded(21)), torch.randn(3, 12, generator=kit.seeded(22))
    step_seen = [0]

    def tab_batch(bs: int = 64, nan_from: int = -1) -> Tuple[Any, Any]:
        num = torch.randn(bs, 10)
        cats = torch.stack([torch.randint(0, n, (bs,)) for n in (7, 12, 5)], 1)
        y = torch.tanh(num @ w_num) + sum(w_cat[i][cats[:, i]] for i in range(3)).unsqueeze(1) / 2
        y = y + 0.1 * torch.randn(bs, 1)
        if 0 <= nan_from <= step_seen[0]:
            y[3] = float("nan")
        return torch.cat([num, cats.float()], 1), y

    def count(step: int) -> None:
        step_seen[0] = step

    if name.startswith("tu_plain_vit"):
        m: nn.Module = PatchTransformer()
        lr = {
            "tu_plain_vit_adamw_cosine_ok": 1e-3,
            "tu_plain_vit_adamw_lr100x_clip": 0.1,
            "tu_plain_vit_frozen": 1e-3,
        }[name]
        o = torch.optim.AdamW(m.parameters(), lr, weight_decay=0.05)
        if name == "tu_plain_vit_frozen":
            for pname, p in m.named_parameters():
                p.requires_grad_(pname == "cls")
        loop(m, o, images, ce, 400, sched_lambda(o, kit.warmup_cosine(30, 400)), clip=1.0)
    elif name.startswith("tu_plain_ae"):
        m = ConvAE()
        lr = 1.0 if name.endswith("lr1000x") else 1e-3
        o = torch.optim.RMSprop(m.parameters(), lr)
        s = torch.optim.lr_scheduler.ExponentialLR(o, 0.8) if name.endswith("vanishing_sched") else None
        loop(m, o, ae_batch, F.mse_loss, 400, s)
    elif name.startswith("tu_plain_tagger"):
        m = Tagger()
        high = name.endswith("lr30x_clip")
        o = torch.optim.SGD(m.parameters(), 3.0 if high else 0.1, momentum=0.9, nesterov=True)
        s = sched_lambda(o, lambda t: max(0.0, 1 - t / 400))
        loop(m, o, tag_batch, ce, 400, s, clip=0.5 if high else 5.0)
    elif name == "tu_plain_tab_adamw_nan_target":
        m = Tabular()
        loop(
            m,
            torch.optim.AdamW(m.parameters(), 1e-3),
            lambda: tab_batch(nan_from=200),
            F.mse_loss,
            400,
            hook=count,
        )
    elif name.startswith("tu_plain_tab_lion"):
        m = Tabular()
        lr, clip = {
            "tu_plain_tab_lion_bf16_ok": (3e-4, None),
            "tu_plain_tab_lion_bf16_lr300x": (0.1, None),
            "tu_plain_tab_lion_bf16_lr30x_clip": (0.01, 1.0),
        }[name]
        loop(
            m,
            kit.Lion(m.parameters(), lr, weight_decay=0.01),
            tab_batch,
            F.mse_loss,
            400,
            clip=clip,
            autocast=torch.bfloat16,
        )
    elif name.endswith("lr_high_clip"):
        _plain_clip_family(name)
    else:
        raise SystemExit(f"unknown tuning plain shape {name}")


def _plain_clip_family(name: str) -> None:
    """The LR-too-high-beside-clipping shapes added after the set's first run."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    from bench.unseen import kit

    centres = torch.randn(6, 16, generator=kit.seeded(61))

    def blobs(bs: int = 64) -> Tuple[Any, Any]:
        y = torch.randint(0, 6, (bs,))
        return centres[y] + 0.7 * torch.randn(bs, 16), y

    def text(bs: int = 32) -> Tuple[Any, Any]:
        a = torch.randint(0, 30, (bs, 1))
        s = (a * torch.arange(1, 26) + 7) % 30
        return s[:, :-1], s[:, 1:]

    w = torch.randn(16, 1, generator=kit.seeded(62))

    def reg(bs: int = 64) -> Tuple[Any, Any]:
        x = torch.randn(bs, 16)
        return x, torch.relu(x @ w) + 0.1 * torch.randn(bs, 1)

    def seqs(bs: int = 32) -> Tuple[Any, Any]:
        x = torch.randint(0, 20, (bs, 16))
        return x, (x[:, :8].sum(1) > x[:, 8:].sum(1)).long() + 2 * (x == 3).any(1).long()

    if name == "tu_plain_tanh_cls_adagrad_lr_high_clip":
        m: nn.Module = kit.mlp([16, 64, 64, 6], nn.Tanh)
        kit.loop(m, torch.optim.Adagrad(m.parameters(), 3.0), blobs, kit.ce, 400, clip=0.5)
    elif name == "tu_plain_lstm_adamw_lr_high_clip":
        m = kit.RecurrentLM(30, 32, 64)
        kit.loop(m, torch.optim.AdamW(m.parameters(), 0.2), text, kit.ce, 400, clip=0.25)
    elif name == "tu_plain_resmlp_sgd_lr_high_clip":
        m = kit.ResMLP(inputs=16, width=48, blocks=2)
        kit.loop(m, torch.optim.SGD(m.parameters(), 1.0, momentum=0.9), reg, F.mse_loss, 400, clip=1.0)
    else:
        m = kit.Encoder(20, 4, positions=16)
        kit.loop(m, torch.optim.Adam(m.parameters(), 0.2), seqs, kit.ce, 400, clip=0.5)


def _hf(name: str) -> None:
    import torch
    from transformers import TrainerCallback

    from bench.unseen import kit

    vocab = 64
    callbacks: list = []
    if name.startswith("tu_hf_llama"):
        model = kit.hf_model("llama", vocab)
        lr, extra = {
            "tu_hf_llama_adamw_cosine_ok": (1e-3, {"lr_scheduler_type": "cosine", "logging_steps": 10}),
            "tu_hf_llama_lr300x": (0.3, {"lr_scheduler_type": "cosine", "logging_steps": 10}),
            "tu_hf_llama_lr30x_const": (
                0.03,
                {"lr_scheduler_type": "constant_with_warmup", "logging_steps": 25},
            ),
            "tu_hf_llama_masked_labels": (1e-3, {"lr_scheduler_type": "cosine", "logging_steps": 10}),
        }[name]
        extra["warmup_steps"] = 20
        base = kit.lm_rows(vocab, 32, 4)
        broken = [False]

        def row(i: int) -> dict:
            r = base(i)
            if broken[0]:
                r["labels"] = torch.full_like(r["labels"], -100)
            return r

        class BreakAt(TrainerCallback):  # type: ignore[misc]
            def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
                broken[0] = state.global_step >= 150

        if name == "tu_hf_llama_masked_labels":
            callbacks.append(BreakAt())
    else:
        model = kit.hf_model("bert", vocab, labels=3)

        def row(i: int) -> dict:
            ids = torch.randint(0, vocab, (24,), generator=kit.seeded(i))
            return {"input_ids": ids, "labels": torch.tensor(int((ids < 3).sum() >= 2) + int(ids[0] > 40))}

        lr = 1.0 if name.endswith("lr1000x") else 1e-3
        extra = {"optim": "adafactor", "lr_scheduler_type": "constant", "logging_steps": 10}
    kit.hf_train(
        model, kit.Rows(100_000, row), "/tmp/trainguard-tuning36-hf", 300, lr, callbacks=callbacks, **extra
    )


def _lightning(name: str) -> None:
    import pytorch_lightning as pl
    import torch
    import torch.nn.functional as F
    from torch import nn

    from bench.unseen import kit

    wave = name.startswith("tu_pl_wavenet")
    steps, precision, clip = 400, "32-true", None
    if name == "tu_pl_wavenet_rmsprop_lr100x_clip":
        clip = 1.0
    if not wave:
        precision = "bf16-mixed"
    freqs = torch.rand(3, generator=kit.seeded(31)) * 0.5 + 0.1

    def row(i: int) -> Any:
        g = kit.seeded(1000 + i)
        if wave:
            t = torch.arange(33, dtype=torch.float32) + 100 * torch.rand(1, generator=g)
            s = sum(torch.sin(f * t) for f in freqs) / 3 + 0.05 * torch.randn(33, generator=g)
            return s[:32].unsqueeze(0), s[32:]
        y = int(torch.randint(0, 4, (1,), generator=g))
        x = torch.randn(16, generator=g)
        x[y * 4 : y * 4 + 4] += 1.0
        return x, y

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            if wave:
                self.net: Any = nn.Sequential(
                    nn.Conv1d(1, 24, 3, padding=1),
                    nn.ReLU(),
                    nn.Conv1d(24, 24, 3, padding=2, dilation=2),
                    nn.ReLU(),
                    nn.Conv1d(24, 24, 3, padding=4, dilation=4),
                    nn.ReLU(),
                    nn.AdaptiveAvgPool1d(1),
                    nn.Flatten(),
                    nn.Linear(24, 1),
                )
            else:
                self.net = kit.mlp([16, 64, 64, 4])

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            x, y = batch
            out = self.net(x)
            return F.mse_loss(out.float(), y) if wave else F.cross_entropy(out.float(), y)

        def configure_optimizers(self) -> Any:
            if wave:
                lr = 0.1 if name.endswith("lr100x_clip") else 1e-3
                o: Any = torch.optim.RMSprop(self.parameters(), lr)
                if not name.endswith("vanishing_sched"):
                    return o
                factor = lambda t: max(0.0, 1 - t / 15)  # noqa: E731
            else:
                lr = 5.0 if name.endswith("lr100x") else 0.05
                o = torch.optim.SGD(self.parameters(), lr, momentum=0.9, nesterov=True)
                factor = kit.warmup_cosine(20, steps)
            s = torch.optim.lr_scheduler.LambdaLR(o, factor)
            return {"optimizer": o, "lr_scheduler": {"scheduler": s, "interval": "step"}}

    kit.lightning_fit(Model(), kit.Rows(32 * steps, row), steps, gradient_clip_val=clip, precision=precision)


def _lora(name: str) -> None:
    from peft import LoraConfig, get_peft_model

    from bench.unseen import kit

    vocab = 64
    base = kit.pretrained(kit.hf_model("llama", vocab), kit.lm_rows(vocab, 32, 2, seed=500))  # strides 1-2
    model = get_peft_model(
        base, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    )
    lr = 1.0 if name.endswith("lr500x") else 2e-3
    fine = kit.lm_rows(vocab, 32, 6, seed=90_000)  # fine-tune on strides 1-6
    kit.hf_train(
        model,
        kit.Rows(100_000, fine),
        "/tmp/trainguard-tuning36-lora",
        300,
        lr,
        lr_scheduler_type="linear",
        warmup_steps=10,
        logging_steps=10,
    )
