#!/usr/bin/env python3
"""Stop 41's HELD-OUT set of unseen training shapes (set ``heldout41``): written and committed, with its
expectations, seeds and scoring rules (probe.py's trace rules, unchanged), BEFORE any of it ran (a 3-step
smoke aside, keeping only its 'recorded'/'FAILED' lines) and before the stop's detector changes; recorded
once; judged ONCE with the stop's starting engine and ONCE with the engine kept at the end, aggregates
only. Never tuned on.

Families the earlier sets lack, each fault with a healthy counterpart: a dilated causal 1-D conv
(WaveNet-like) forecaster under Adam + LinearLR decay (one batch of inputs x1000; a neighbour process
burning both cores for a while), an MLP autoencoder under Adamax (an LR far too high), a tiny MLP-Mixer
under SGD Nesterov + cosine whose loader stalls now and then (and a weight-normalising helper that divides
by a norm that reached 0), the HF Trainer with a ViT image classifier under Adafactor (one batch of pixels
x1000) and a GPT-2 under torch SGD + linear decay with logging pauses and a stretch of slower steps (and
the same at 1000x), peft LoRA on a BERT classifier under the HF Trainer (and at 1000x), a plain-loop LoRA
on a pre-trained GPT-2's c_attn + c_proj under RMSprop (one batch's per-token loss weights in the wrong
units; a neighbour burst; lora_alpha 0: the adapters scaled to nothing), and in Lightning a temporal conv
classifier under RMSprop + ExponentialLR whose dataset items sometimes take longer (and one batch x1000)
and a DeepSets regressor under Adagrad (and one target turning +Inf).

Every shape is seeded: ``torch.manual_seed(0)`` (bench.unseen.shapes.main) and the fixed data seeds below
(42_000+: none used by another set).
"""

from __future__ import annotations

import random
import subprocess
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

from bench.unseen.sets import HEALTHY, LR_TOO_HIGH, Expectations

NAN = "loss/non_finite|gradient/nan-source"
DEAD_ADAPTER = "adapter/lora-grad-break|loss/plateau"
BAD_BATCH = (
    "loss/divergence|loss/rise-after-fall|loss/oscillation|gradient/explosion"
    "|loss/non_finite|gradient/nan-source"
)
"""A bad batch whose huge update knocks the model off: any of the curve / gradient kinds that say so."""

SHAPES: Expectations = {
    # plain loops
    "ho11_plain_wavenet_adam_ok": (
        HEALTHY,
        "dilated causal 1-D conv forecaster (4 layers, dilations 1-8) on sine mixtures, Adam 1e-3, "
        "LinearLR(1.0 -> 0.2 over 300)",
    ),
    "ho11_plain_wavenet_adam_neighbour_ok": (
        HEALTHY,
        "the same; from step 90 two neighbour processes burn both cores for 30 s",
    ),
    "ho11_plain_wavenet_adam_bad_batch": (BAD_BATCH, "the same, step 160's inputs x1000"),
    "ho11_plain_autoenc_adamax_ok": (
        HEALTHY,
        "MLP autoencoder 32-64-6-64-32 on rank-6 data, Adamax 2e-3, constant, 300 steps",
    ),
    "ho11_plain_autoenc_adamax_lr1000x": (LR_TOO_HIGH, "the same at Adamax 2.0 (1000x)"),
    "ho11_plain_mixer_sgdn_stall_loader_ok": (
        HEALTHY,
        "MLP-Mixer (16 patches of 4x4, 2 blocks), SGD Nesterov 0.9 lr 0.05, CosineAnnealingLR; its loader "
        "stalls 0.2-0.6 s on ~1 batch in 12 (seeded)",
    ),
    "ho11_plain_mixer_sgdn_zero_norm": (
        NAN,
        "the same without stalls; from step 170 a weight-normalising helper divides the head's rows by "
        "their norms after a row was zeroed (0/0)",
    ),
    # HF Trainer
    "ho11_hf_vit_adafactor_ok": (
        HEALTHY,
        "HF Trainer, ViT 2x48 (4x4 patches of 16x16 images, 5 classes), adafactor 1e-3, constant, log 1",
    ),
    "ho11_hf_vit_adafactor_bad_batch": (BAD_BATCH, "the same, batch 120's pixels x1000"),
    "ho11_hf_gpt2_sgd_hiccup_ok": (
        HEALTHY,
        "HF Trainer, GPT-2 2x48, torch SGD 0.1 (momentum 0.9), linear, warmup 10, log 1; a 0.8 s pause "
        "every 50 steps and steps 150-175 each 0.12 s slower",
    ),
    "ho11_hf_gpt2_sgd_lr1000x": (LR_TOO_HIGH, "the same at 100 (1000x), no pauses"),
    # peft
    "ho11_lora_bert_hf_ok": (
        HEALTHY,
        "peft LoRA r=8 on a BERT 2x48 classifier's query/value (classifier head trained), HF Trainer AdamW "
        "1e-3, cosine, log 2",
    ),
    "ho11_lora_bert_hf_lr1000x": (LR_TOO_HIGH, "the same at 1.0 (1000x)"),
    "ho11_lora_gpt2_plain_neighbour_ok": (
        HEALTHY,
        "peft LoRA r=16 on a pre-trained tiny GPT-2's c_attn + c_proj, plain loop RMSprop 5e-4, constant "
        "after warmup 15; from step 70 two neighbour processes burn both cores for 30 s",
    ),
    "ho11_lora_gpt2_plain_bad_batch": (
        BAD_BATCH,
        "the same without neighbours, step 150's per-token loss weights 1000 instead of 1 (wrong units)",
    ),
    "ho11_lora_gpt2_plain_alpha_zero": (
        DEAD_ADAPTER,
        "the same without neighbours, lora_alpha 0: the adapters are scaled by 0 (no gradient reaches them)",
    ),
    # Lightning
    "ho11_pl_tcn_rmsprop_wobble_ok": (
        HEALTHY,
        "Lightning temporal conv classifier (3 conv1d layers) on 3-class waveforms, RMSprop 1e-3, "
        "ExponentialLR(0.997) per step; each dataset item sleeps 15 ms with probability 0.03 (seeded)",
    ),
    "ho11_pl_tcn_rmsprop_bad_batch": (BAD_BATCH, "the same without sleeps, batch 170 x1000"),
    "ho11_pl_deepset_adagrad_ok": (
        HEALTHY,
        "Lightning DeepSets regressor (sets of 12 points in 3-D, sum pooling) of a set statistic, Adagrad "
        "2e-2, constant, 300 steps",
    ),
    "ho11_pl_deepset_adagrad_inf_target": (NAN, "the same, from batch 150 one target +Inf (a 1/0 upstream)"),
}


def run(name: str) -> None:
    """Run one held-out shape (``trainguard.init`` already called)."""
    {"plain": _plain, "hf": _hf, "pl": _lightning, "lora": _lora}[name.split("_")[1]](name)


class Burst:
    """Two processes spinning on the CPU for ``seconds`` from :meth:`start` (each stops itself then;
    :meth:`stop` kills what is left when the training ends first): a co-tenant's burst on a shared host."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.procs: List[subprocess.Popen] = []  # type: ignore[type-arg]

    def start(self) -> None:
        code = f"import time\nt = time.time() + {self.seconds}\nwhile time.time() < t: pass"
        self.procs = [subprocess.Popen([sys.executable, "-c", code]) for _ in range(2)]

    def stop(self) -> None:
        for proc in self.procs:
            proc.kill()
            proc.wait()
        self.procs = []


def _with_burst(at: Optional[int], seconds: float, train: Callable[[Callable[[int], None]], None]) -> None:
    """``train(hook)`` with a :class:`Burst` started by the hook at step ``at`` (None: never)."""
    burst = Burst(seconds)

    def hook(step: int) -> None:
        if step == at:
            burst.start()

    try:
        train(hook)
    finally:
        burst.stop()


def _plain(name: str) -> None:
    import torch
    import torch.nn.functional as F
    from torch import nn

    from bench.unseen import kit

    family = name.split("_")[2]
    step = [0]
    if family == "wavenet":
        freqs = 0.05 + 0.4 * torch.rand(3, generator=kit.seeded(42_001))

        def waves(bs: int = 32) -> Tuple[Any, Any]:
            t = torch.arange(65.0)
            phase = 6.3 * torch.rand(bs, 3, 1)
            amp = torch.rand(bs, 3, 1)
            s = (amp * torch.sin(freqs[None, :, None] * t + phase)).sum(1, keepdim=True)
            s = s + 0.05 * torch.randn_like(s)
            x, y = s[..., :-1], s[..., 1:]
            if name.endswith("bad_batch") and step[0] == 160:
                x = x * 1000.0
            return x, y

        class WaveNet(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.i = nn.Conv1d(1, 32, 1)
                self.d = nn.ModuleList(nn.Conv1d(32, 32, 2, dilation=k) for k in (1, 2, 4, 8))
                self.o = nn.Conv1d(32, 1, 1)

            def forward(self, x: Any) -> Any:
                h = self.i(x)
                for conv in self.d:
                    k = conv.dilation[0]
                    h = h + torch.tanh(conv(F.pad(h, (k, 0))))
                return self.o(h)

        m: Any = WaveNet()
        o: Any = torch.optim.Adam(m.parameters(), 1e-3)
        s: Any = torch.optim.lr_scheduler.LinearLR(o, 1.0, 0.2, total_iters=300)

        def train(burst_hook: Callable[[int], None]) -> None:
            def each(t: int) -> None:
                step[0] = t
                burst_hook(t)

            kit.loop(m, o, waves, F.mse_loss, 300, s, hook=each)

        _with_burst(90 if name.endswith("neighbour_ok") else None, 30.0, train)
    elif family == "autoenc":
        basis = torch.randn(6, 32, generator=kit.seeded(42_002))

        def codes(bs: int = 64) -> Tuple[Any, Any]:
            x = torch.randn(bs, 6) @ basis / 2.5 + 0.02 * torch.randn(bs, 32)
            return x, x

        m = kit.mlp([32, 64, 6, 64, 32], nn.ELU)
        o = torch.optim.Adamax(m.parameters(), 2.0 if name.endswith("lr1000x") else 2e-3)
        kit.loop(m, o, codes, F.mse_loss, 300)
    elif family == "mixer":
        proto = torch.randn(4, 16, 16, generator=kit.seeded(42_003))
        pace = random.Random(42_004)

        def images(bs: int = 32) -> Tuple[Any, Any]:
            y = torch.randint(0, 4, (bs,))
            x = proto[y] + 0.9 * torch.randn(bs, 16, 16)
            patches = x.unfold(1, 4, 4).unfold(2, 4, 4).reshape(bs, 16, 16)
            if name.endswith("stall_loader_ok") and pace.random() < 1 / 12:
                time.sleep(pace.uniform(0.2, 0.6))
            return patches, y

        class Block(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.n1, self.n2 = nn.LayerNorm(32), nn.LayerNorm(32)
                self.tok, self.ch = kit.mlp([16, 32, 16], nn.GELU), kit.mlp([32, 64, 32], nn.GELU)

            def forward(self, h: Any) -> Any:
                h = h + self.tok(self.n1(h).transpose(1, 2)).transpose(1, 2)
                return h + self.ch(self.n2(h))

        class Mixer(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.i, self.b, self.o = nn.Linear(16, 32), nn.Sequential(Block(), Block()), nn.Linear(32, 4)

            def forward(self, x: Any) -> Any:
                return self.o(self.b(self.i(x)).mean(1))

        m = Mixer()
        o = torch.optim.SGD(m.parameters(), 0.05, momentum=0.9, nesterov=True)
        s = torch.optim.lr_scheduler.CosineAnnealingLR(o, 300)

        def renorm(t: int) -> None:
            if name.endswith("zero_norm") and t >= 170:
                with torch.no_grad():
                    if t == 170:
                        m.o.weight[0].zero_()  # "reset a dead class row" -- then normalised every step
                    m.o.weight.div_(m.o.weight.norm(dim=1, keepdim=True))

        kit.loop(m, o, images, kit.ce, 300, s, hook=renorm)
    else:
        raise SystemExit(f"unknown held-out plain shape {name}")


def _hf(name: str) -> None:
    import torch
    from transformers import TrainerCallback

    from bench.unseen import kit

    if name.startswith("ho11_hf_vit"):
        import transformers as tf

        config = tf.ViTConfig(
            image_size=16,
            patch_size=4,
            num_channels=1,
            hidden_size=48,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=96,
            num_labels=5,
        )
        model: Any = tf.ViTForImageClassification(config)
        proto = torch.randn(5, 1, 16, 16, generator=kit.seeded(42_100))
        calls = [0]

        def image(i: int) -> Dict[str, Any]:
            g = kit.seeded(42_101 + i)
            y = int(torch.randint(0, 5, (1,), generator=g))
            x = proto[y] + 0.9 * torch.randn(1, 16, 16, generator=g)
            calls[0] += 1  # the loader (no workers) fetches batch k's rows as calls 16k+1 .. 16k+16
            if name.endswith("bad_batch") and 16 * 120 < calls[0] <= 16 * 121:
                x = x * 1000.0
            return {"pixel_values": x, "labels": y}

        kit.hf_train(
            model,
            kit.Rows(100_000, image),
            "/tmp/trainguard-heldout41-vit",
            300,
            1e-3,
            optim="adafactor",
            lr_scheduler_type="constant",
            logging_steps=1,
        )
        return
    vocab = 40
    model = kit.hf_model("gpt2", vocab, width=48, positions=32)

    class Pauses(TrainerCallback):  # type: ignore[misc]
        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if state.global_step % 50 == 0:
                time.sleep(0.8)
            elif 150 <= state.global_step <= 175:
                time.sleep(0.12)

    kit.hf_train(
        model,
        kit.Rows(100_000, kit.lm_rows(vocab, 32, 5, seed=42_200)),
        "/tmp/trainguard-heldout41-gpt2",
        300,
        100.0 if name.endswith("lr1000x") else 0.1,
        callbacks=[Pauses()] if name.endswith("hiccup_ok") else [],
        optim="sgd",
        optim_args="momentum=0.9",
        lr_scheduler_type="linear",
        warmup_steps=10,
        max_grad_norm=0.0,
        logging_steps=1,
    )


def _lora(name: str) -> None:
    import torch
    import torch.nn.functional as F
    from peft import LoraConfig, get_peft_model

    from bench.unseen import kit

    vocab = 40
    if name.startswith("ho11_lora_bert"):
        model = kit.hf_model("bert", vocab, width=48, positions=32, labels=3)

        def row(i: int) -> Dict[str, Any]:
            ids = torch.randint(0, vocab, (20,), generator=kit.seeded(42_300 + i))
            label = int((ids[:10] < 20).sum() - (ids[10:] < 20).sum() > 0) + int(ids[0] < 8)
            return {"input_ids": ids, "labels": label}

        config = LoraConfig(
            r=8,
            lora_alpha=16,
            target_modules=["query", "value"],
            modules_to_save=["classifier"],
            lora_dropout=0.0,
            task_type="SEQ_CLS",
        )
        kit.hf_train(
            get_peft_model(model, config),
            kit.Rows(100_000, row),
            "/tmp/trainguard-heldout41-lora",
            300,
            1.0 if name.endswith("lr1000x") else 1e-3,
            lr_scheduler_type="cosine",
            logging_steps=2,
        )
        return
    base = kit.pretrained(kit.hf_model("gpt2", vocab, width=48), kit.lm_rows(vocab, 32, 3, seed=42_400))
    config = LoraConfig(
        r=16,
        lora_alpha=0 if name.endswith("alpha_zero") else 32,
        target_modules=["c_attn", "c_proj"],
        fan_in_fan_out=True,
        lora_dropout=0.0,
    )
    model = get_peft_model(base, config)
    o = torch.optim.RMSprop([p for p in model.parameters() if p.requires_grad], 5e-4)
    s = torch.optim.lr_scheduler.LambdaLR(o, lambda t: min(1.0, (t + 1) / 15))
    step = [0]

    def loss_fn(out: Any, y: Any) -> Any:
        per_token = F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1), reduction="none")
        weight = 1000.0 if name.endswith("bad_batch") and step[0] == 150 else 1.0
        return (weight * per_token).mean()

    batch = kit.lm_batches(kit.lm_rows(vocab, 32, 6, seed=42_500))

    def train(burst_hook: Callable[[int], None]) -> None:
        def each(t: int) -> None:
            step[0] = t
            burst_hook(t)

        kit.loop(kit.HFLogits(model), o, batch, loss_fn, 300, s, hook=each)

    _with_burst(70 if name.endswith("neighbour_ok") else None, 30.0, train)


def _lightning(name: str) -> None:
    import pytorch_lightning as pl
    import torch
    import torch.nn.functional as F
    from torch import nn

    from bench.unseen import kit

    kind = name.split("_")[2]
    pace = random.Random(42_600)
    if kind == "tcn":
        bad_rows = range(32 * 170, 32 * 171) if name.endswith("bad_batch") else range(0)

        def row(i: int) -> Any:
            g = kit.seeded(42_700 + i)
            y = int(torch.randint(0, 3, (1,), generator=g))
            t = torch.arange(48.0)
            base = [torch.sin(0.3 * t), torch.sign(torch.sin(0.2 * t)), (t % 12) / 6 - 1][y]
            x = (base + 0.5 * torch.randn(48, generator=g)).unsqueeze(0)
            if name.endswith("wobble_ok") and pace.random() < 0.03:
                time.sleep(0.015)
            return (x * 1000.0 if i in bad_rows else x), y

        net: Any = nn.Sequential(
            nn.Conv1d(1, 16, 5, padding=2),
            nn.ReLU(),
            nn.Conv1d(16, 32, 5, padding=4, dilation=2),
            nn.ReLU(),
            nn.Conv1d(32, 32, 3, padding=1),
            nn.AdaptiveMaxPool1d(1),
            nn.Flatten(),
            nn.Linear(32, 3),
        )
    else:
        inf_from = 32 * 150 if name.endswith("inf_target") else None

        def row(i: int) -> Any:
            g = kit.seeded(42_800 + i)
            pts = torch.randn(12, 3, generator=g)
            y = pts.norm(dim=1).max() - pts.mean(0).norm()
            if inf_from is not None and i >= inf_from and i % 32 == 0:
                y = torch.tensor(float("inf"))
            return pts, y.reshape(1)

        class DeepSets(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.phi, self.rho = kit.mlp([3, 64, 64]), kit.mlp([64, 64, 1])

            def forward(self, x: Any) -> Any:
                return self.rho(self.phi(x).sum(1) / 12)

        net = DeepSets()

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = net

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            x, y = batch
            out = self.net(x)
            loss = F.cross_entropy(out, y) if kind == "tcn" else F.mse_loss(out, y)
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self) -> Any:
            if kind == "tcn":
                o: Any = torch.optim.RMSprop(self.parameters(), 1e-3)
                s = torch.optim.lr_scheduler.ExponentialLR(o, 0.997)
                return {"optimizer": o, "lr_scheduler": {"scheduler": s, "interval": "step"}}
            return torch.optim.Adagrad(self.parameters(), 2e-2)

    kit.lightning_fit(Model(), kit.Rows(32 * 300, row), 300)
