#!/usr/bin/env python3
"""Stop 36's HELD-OUT set of unseen training shapes (set ``heldout36``): written and committed, with its
expectations, seeds and scoring rules (probe.py's trace rules), BEFORE any of it ran and before the stop's
detector changes; to be run ONCE, at the end, with the engine kept. Never tuned on.

New against every other set and bench/corpus: an MLP-Mixer on images, a GRU copy tagger, a depthwise-
separable CNN, a residual MLP classifier under a Lion-style optimizer, a GPT-2 with a polynomial schedule
and weight decay under the HF Trainer, a BERT classifier under HF's Adagrad, a Transformer regressor and an
Adadelta CNN under Lightning, a LoRA on GPT-2's attention and MLP; OneCycle, StepLR, polynomial, warmup +
cosine, constant; bf16 autocast. Faults: an LR too high (x30 .. x2000, with and without clipping), NaN /
Inf inputs, a frozen network, a schedule typo that takes the LR to ~0.

Every shape is seeded: ``torch.manual_seed(0)`` (bench.unseen.shapes.main) and the fixed data seeds below.
"""

from __future__ import annotations

from typing import Any, Tuple

from bench.unseen.sets import HEALTHY, LR_TOO_HIGH, Expectations

NAN = "gradient/nan-source|loss/non_finite"
STALL = "loss/plateau"

SHAPES: Expectations = {
    # plain loops
    "ho2_plain_mixer_adamw_onecycle_ok": (
        HEALTHY,
        "MLP-Mixer on 16x16 images, AdamW, OneCycle peak 2e-3, clip 1",
    ),
    "ho2_plain_mixer_adamw_lr100x_clip": (LR_TOO_HIGH, "the same at a OneCycle peak 0.2 (100x), clip 1"),
    "ho2_plain_gru_tagger_adagrad_ok": (HEALTHY, "GRU tagger (the token 3 back), Adagrad 0.05"),
    "ho2_plain_gru_tagger_sgd_lr_high": (LR_TOO_HIGH, "the same with plain SGD at LR 50, no clip"),
    "ho2_plain_dwcnn_nesterov_bf16_ok": (
        HEALTHY,
        "depthwise-separable CNN, SGD Nesterov 0.05, warmup + cosine, bf16",
    ),
    "ho2_plain_dwcnn_nan_input": (NAN, "the same, one NaN input row from step 180"),
    "ho2_plain_dwcnn_steplr_typo": (STALL, "the same, StepLR(step_size=10, gamma=0.01): LR ~0 from step 20"),
    "ho2_plain_resmlp_lion_ok": (HEALTHY, "residual MLP classifier, Lion 1e-4, clip 1"),
    "ho2_plain_resmlp_lion_lr1000x_clip": (LR_TOO_HIGH, "the same at Lion 0.1 (1000x), clip 1"),
    # HF Trainer (max_grad_norm 1 by default)
    "ho2_hf_gpt2_poly_wd_ok": (
        HEALTHY,
        "HF Trainer, GPT-2 2x64, AdamW 2e-3 wd 0.1, polynomial decay, logging 5",
    ),
    "ho2_hf_gpt2_poly_lr500x": (LR_TOO_HIGH, "the same at 1.0 (500x)"),
    "ho2_hf_bert_adagrad_ok": (
        HEALTHY,
        "HF Trainer, tiny BERT classifier, HF adagrad 1e-2, linear, logging 10",
    ),
    "ho2_hf_bert_frozen": (
        STALL,
        "the same, every parameter frozen save the classifier's bias (a freeze bug)",
    ),
    # Lightning
    "ho2_pl_transformer_reg_ok": (
        HEALTHY,
        "Lightning, Transformer-encoder regressor, AdamW 1e-3 warmup + cosine, clip 1",
    ),
    "ho2_pl_transformer_reg_lr300x_clip": (
        LR_TOO_HIGH,
        "the same at AdamW 0.3 (300x), gradient_clip_val 0.5",
    ),
    "ho2_pl_cnn_adadelta_inf_input": (
        NAN,
        "Lightning, CNN classifier, Adadelta 1.0, one +Inf input row from step 150",
    ),
    # peft LoRA (HF Trainer)
    "ho2_lora_gpt2_const_ok": (
        HEALTHY,
        "peft LoRA r=4 on GPT-2's c_attn + c_fc, a new pattern, 1e-3 constant",
    ),
    "ho2_lora_gpt2_lr2000x": (LR_TOO_HIGH, "the same at 2.0 (2000x)"),
}


def run(name: str) -> None:
    """Run one held-out shape (``trainguard.init`` already called)."""
    {"plain": _plain, "hf": _hf, "pl": _lightning, "lora": _lora}[name.split("_")[1]](name)


def _plain(name: str) -> None:
    import torch
    from torch import nn

    from bench.unseen import kit

    loop, ce = kit.loop, kit.ce

    class Mixer(nn.Module):
        def __init__(self, patches: int = 16, width: int = 48, classes: int = 6, blocks: int = 3) -> None:
            super().__init__()
            self.embed = nn.Linear(16, width)
            self.token = nn.ModuleList(kit.mlp([patches, 64, patches], nn.GELU) for _ in range(blocks))
            self.channel = nn.ModuleList(kit.mlp([width, 96, width], nn.GELU) for _ in range(blocks))
            self.norms = nn.ModuleList(nn.LayerNorm(width) for _ in range(2 * blocks))
            self.head = nn.Linear(width, classes)

        def forward(self, x: Any) -> Any:
            h = self.embed(x.unfold(2, 4, 4).unfold(3, 4, 4).reshape(x.shape[0], -1, 16))
            for i, (tok, chan) in enumerate(zip(self.token, self.channel)):
                h = h + tok(self.norms[2 * i](h).transpose(1, 2)).transpose(1, 2)
                h = h + chan(self.norms[2 * i + 1](h))
            return self.head(h.mean(1))

    class DWCNN(nn.Module):
        def __init__(self, classes: int = 6) -> None:
            super().__init__()

            def block(a: int, b: int, stride: int) -> nn.Module:
                return nn.Sequential(
                    nn.Conv2d(a, a, 3, stride, 1, groups=a),
                    nn.BatchNorm2d(a),
                    nn.ReLU(),
                    nn.Conv2d(a, b, 1),
                    nn.BatchNorm2d(b),
                    nn.ReLU(),
                )

            self.stem = nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU())
            self.body = nn.Sequential(block(16, 32, 2), block(32, 64, 2))
            self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, classes))

        def forward(self, x: Any) -> Any:
            return self.head(self.body(self.stem(x)))

    images = kit.image_batches(6, 16, 1.0, seed=41)

    def copy_batch(bs: int = 32) -> Tuple[Any, Any]:  # predict the token 3 back (0 for the first 3)
        x = torch.randint(1, 20, (bs, 24))
        y = torch.zeros_like(x)
        y[:, 3:] = x[:, :-3]
        return x, y

    blob_centres = torch.randn(8, 24, generator=kit.seeded(42)) * 1.2

    def blobs(bs: int = 64) -> Tuple[Any, Any]:
        y = torch.randint(0, 8, (bs,))
        return blob_centres[y] + torch.randn(bs, 24), y

    if name.startswith("ho2_plain_mixer"):
        m: nn.Module = Mixer()
        peak = 0.2 if name.endswith("lr100x_clip") else 2e-3
        o = torch.optim.AdamW(m.parameters(), peak / 25)
        loop(m, o, images, ce, 400, torch.optim.lr_scheduler.OneCycleLR(o, peak, total_steps=400), clip=1.0)
    elif name.startswith("ho2_plain_gru_tagger"):
        m = kit.RecurrentLM(20, 32, 64, "gru")
        high = name.endswith("sgd_lr_high")
        o = torch.optim.SGD(m.parameters(), 50.0) if high else torch.optim.Adagrad(m.parameters(), 0.05)
        loop(m, o, copy_batch, ce, 400)
    elif name.startswith("ho2_plain_dwcnn"):
        m = DWCNN()
        o = torch.optim.SGD(m.parameters(), 0.05, momentum=0.9, nesterov=True)
        if name.endswith("steplr_typo"):
            s: Any = torch.optim.lr_scheduler.StepLR(o, 10, 0.01)
        else:
            s = torch.optim.lr_scheduler.LambdaLR(o, kit.warmup_cosine(25, 400))
        nan_at = 180 if name.endswith("nan_input") else None
        loop(m, o, images, ce, 400, s, autocast=torch.bfloat16, nan_at=nan_at)
    elif name.startswith("ho2_plain_resmlp_lion"):
        m = kit.ResMLP(inputs=24, width=64, blocks=2, out=8)
        lr = 0.1 if name.endswith("lr1000x_clip") else 1e-4
        loop(m, kit.Lion(m.parameters(), lr), blobs, ce, 400, clip=1.0)
    else:
        raise SystemExit(f"unknown held-out plain shape {name}")


def _hf(name: str) -> None:
    import torch

    from bench.unseen import kit

    vocab = 48
    if name.startswith("ho2_hf_gpt2"):
        model = kit.hf_model("gpt2", vocab, width=64)
        row = kit.lm_rows(vocab, 32, 5, seed=7_000)
        lr = 1.0 if name.endswith("lr500x") else 2e-3
        extra = {
            "lr_scheduler_type": "polynomial",
            "weight_decay": 0.1,
            "warmup_steps": 10,
            "logging_steps": 5,
        }
    else:
        model = kit.hf_model("bert", vocab, width=64, labels=4, positions=32)
        if name.endswith("frozen"):
            for pname, p in model.named_parameters():
                p.requires_grad_(pname == "classifier.bias")

        def row(i: int) -> dict:
            ids = torch.randint(0, vocab, (20,), generator=kit.seeded(8_000 + i))
            return {"input_ids": ids, "labels": torch.tensor(int((ids % 4 == 0).sum()) // 3 % 4)}

        lr, extra = 1e-2, {"optim": "adagrad", "lr_scheduler_type": "linear", "logging_steps": 10}
    kit.hf_train(model, kit.Rows(100_000, row), "/tmp/trainguard-heldout36-hf", 300, lr, **extra)


def _lightning(name: str) -> None:
    import pytorch_lightning as pl
    import torch
    import torch.nn.functional as F
    from torch import nn

    from bench.unseen import kit

    steps, clip = 400, None
    reg = name.startswith("ho2_pl_transformer")
    if reg:
        clip = 0.5 if name.endswith("lr300x_clip") else 1.0
    proto = torch.randn(4, 1, 12, 12, generator=kit.seeded(51))
    w = torch.randn(16, generator=kit.seeded(52))
    inf_from = [10**9]

    def row(i: int) -> Any:
        g = kit.seeded(9_000 + i)
        if reg:
            x = torch.randn(16, 1, generator=g)
            return x, (torch.tanh(x.squeeze(1) * w).sum() / 4).reshape(1)
        y = int(torch.randint(0, 4, (1,), generator=g))
        return proto[y] + 0.8 * torch.randn(1, 12, 12, generator=g), y

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            if reg:
                layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
                self.net: Any = nn.ModuleDict(
                    {"i": nn.Linear(1, 32), "t": nn.TransformerEncoder(layer, 2), "o": nn.Linear(32, 1)}
                )
            else:
                self.net = kit.bn_cnn(4, channels=(8, 16))

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            x, y = batch
            if reg:
                return F.mse_loss(self.net["o"](self.net["t"](self.net["i"](x)).mean(1)), y)
            if self.global_step >= inf_from[0]:
                x = x.clone()
                x[0] = float("inf")
            return F.cross_entropy(self.net(x), y)

        def configure_optimizers(self) -> Any:
            if not reg:
                return torch.optim.Adadelta(self.parameters(), 1.0)
            o = torch.optim.AdamW(self.parameters(), 0.3 if name.endswith("lr300x_clip") else 1e-3)
            s = torch.optim.lr_scheduler.LambdaLR(o, kit.warmup_cosine(30, steps))
            return {"optimizer": o, "lr_scheduler": {"scheduler": s, "interval": "step"}}

    if name.endswith("inf_input"):
        inf_from[0] = 150
    kit.lightning_fit(Model(), kit.Rows(32 * steps, row), steps, gradient_clip_val=clip)


def _lora(name: str) -> None:
    from peft import LoraConfig, get_peft_model

    from bench.unseen import kit

    vocab = 48
    base = kit.pretrained(kit.hf_model("gpt2", vocab, width=64), kit.lm_rows(vocab, 32, 3, seed=600))
    model = get_peft_model(
        base,
        LoraConfig(
            r=4, lora_alpha=8, target_modules=["c_attn", "c_fc"], lora_dropout=0.0, fan_in_fan_out=True
        ),
    )
    lr = 2.0 if name.endswith("lr2000x") else 1e-3
    kit.hf_train(
        model,
        kit.Rows(100_000, kit.lm_rows(vocab, 32, 7, seed=60_000)),
        "/tmp/trainguard-heldout36-lora",
        300,
        lr,
        lr_scheduler_type="constant_with_warmup",
        warmup_steps=10,
        logging_steps=10,
    )
