#!/usr/bin/env python3
"""Stop 41's TUNING set of unseen training shapes (set ``tuning41``): written, with its expectations and
its scoring rules (probe.py's trace rules, unchanged), before any of it ran, after heldout40
(:mod:`bench.unseen.heldout6`) was spent. The detectors may be tuned on these.

Two families heldout40 missed on, in other models, frameworks, optimisers and schedules:

* one bad batch, then recovery (a recovered run must not keep a WARNING+ alarm): a residual MLP regressor
  under RMSprop (inputs x1000), an MLP autoencoder under Adam (inputs x1000; with its healthy twin, added
  after the set's first run, in which no shape had left an explosion open), a GRU regressor under AdamW +
  OneCycleLR (inputs x1000), the HF Trainer
  with a BERT regressor whose labels come x1000 on one batch, a Lightning CNN without
  BatchNorm under AdamW (pixels x1000), a Lightning MLP classifier under SGD momentum with
  gradient_clip_val (inputs x1000), a plain-loop LoRA on a pre-trained Llama whose loss is summed instead
  of averaged on one batch;
* step time that changes while the training is healthy: a data loader that sometimes sleeps, a neighbour
  process burning both cores for a while (the run slower for tens of seconds, then back), a checkpoint-like
  pause and a short stretch of slower steps under the HF Trainer, a Lightning dataset whose items
  sometimes take longer; and, as its faults, two sustained regressions that last to the end of the run (an
  evaluation forward added to every step, a synchronous per-step upload). probe.py's trace rules leave a
  perf fault unscored (its loss does not move): their incidents are read from the verdict lines.

Every shape is seeded: ``torch.manual_seed(0)`` (bench.unseen.shapes.main) and the fixed data seeds below
(41_000+: none used by another set).
"""

from __future__ import annotations

import random
import subprocess
import sys
import time
from typing import Any, Callable, Dict, List, Tuple

from bench.unseen.sets import HEALTHY, Expectations

BAD_BATCH = (
    "loss/divergence|loss/rise-after-fall|loss/oscillation|gradient/explosion"
    "|loss/non_finite|gradient/nan-source|loss/spike"
)
# (loss/spike added at stop 43: the kind made for one bad batch at stop 42, after this set was written; a
#  one-value blow-up that came back is now that kind alone, where it had been loss/divergence and loss/spike)
"""A bad batch whose huge update knocks the model off: any of the curve / gradient kinds that say so."""
SLOWER = "perf/throughput-regression"

SHAPES: Expectations = {
    # plain loops
    "tu11_plain_resmlp_rmsprop_bad_batch": (
        BAD_BATCH,
        "residual MLP regressor (3 blocks x128), RMSprop 1e-3, constant, batch 64; step 150's inputs x1000",
    ),
    "tu11_plain_resmlp_rmsprop_slowloader_ok": (
        HEALTHY,
        "the same, no bad batch; its loader sleeps 0.1-0.4 s on ~1 batch in 10 (seeded)",
    ),
    "tu11_plain_resmlp_rmsprop_sustained_upload": (
        SLOWER,
        "the same, no bad batch; from step 150 to the end a synchronous 0.3 s 'upload' after every step",
    ),
    "tu11_plain_gru_adamw_onecycle_bad_batch": (
        BAD_BATCH,
        "GRU regressor over 24 steps x 4 features, AdamW 3e-3, OneCycleLR, batch 48; step 140's inputs x1000",
    ),
    "tu11_plain_gru_adamw_onecycle_neighbour_ok": (
        HEALTHY,
        "the same, no bad batch; from step 80 two neighbour processes burn both cores for 25 s",
    ),
    "tu11_plain_gru_adamw_onecycle_eval_every_step": (
        SLOWER,
        "the same, no bad batch; from step 120 to the end an evaluation forward on 512 rows every step",
    ),
    "tu11_plain_ae_adam_bad_batch": (
        BAD_BATCH,
        "MLP autoencoder 20-48-3-48-20 (MSE) on rank-3 data, Adam 1e-3, constant, 300 steps; step 200's "
        "inputs x1000 (added after the set's first run: no shape of it had left an explosion open)",
    ),
    "tu11_plain_ae_adam_ok": (HEALTHY, "the same, no bad batch (added with it)"),
    "tu11_plain_gnll_adam_bad_batch": (
        BAD_BATCH,
        "ReLU MLP with a mean and a log-variance head (Gaussian NLL), Adam 1e-3, 300 steps; step 200's "
        "inputs x1000 (added with the autoencoder, whose run then closed its incident)",
    ),
    "tu11_plain_cvae_adam_bad_batch": (
        BAD_BATCH,
        "plain-loop conditional VAE (ReLU MLPs, MSE + 0.01 KL, 6-d latent, 32-d data, 4 classes), Adam 2e-3, "
        "300 steps; step 200's inputs x1000 (added with it)",
    ),
    # HF Trainer
    "tu11_hf_bert_regress_bad_batch": (
        BAD_BATCH,
        "HF Trainer, BERT 2x48 regressor (num_labels 1, MSE), adamw_torch 1e-3, linear, warmup 10, log 1; "
        "batch 100's labels x1000 (a pipeline bug)",
    ),
    "tu11_hf_bert_regress_hiccup_ok": (
        HEALTHY,
        "the same, no bad batch; a 1.5 s pause at steps 60 and 61, then steps 120-150 each 0.15 s slower",
    ),
    # Lightning
    "tu11_pl_cnn_adamw_bad_batch": (
        BAD_BATCH,
        "Lightning CNN (no BatchNorm) on 12x12 prototypes, AdamW 2e-3, StepLR(100, 0.5); batch 150 x1000",
    ),
    "tu11_pl_cnn_adamw_wobble_ok": (
        HEALTHY,
        "the same, no bad batch; each dataset item sleeps 20 ms with probability 0.02 (seeded)",
    ),
    "tu11_pl_mlp_sgdm_clip_bad_batch": (
        BAD_BATCH,
        "Lightning GELU MLP classifier on blobs, SGD momentum 0.9 lr 0.02, gradient_clip_val 1; batch 120's "
        "inputs x1000",
    ),
    # peft
    "tu11_lora_llama_plain_bad_batch": (
        BAD_BATCH,
        "peft LoRA r=8 on a pre-trained tiny Llama's q/k_proj, plain loop AdamW 2e-3, warmup+cosine; "
        "step 140's loss summed over tokens instead of averaged (x496)",
    ),
    "tu11_lora_llama_plain_neighbour_ok": (
        HEALTHY,
        "the same, no bad batch; from step 60 two neighbour processes burn both cores for 40 s",
    ),
}


def run(name: str) -> None:
    """Run one tuning shape (``trainguard.init`` already called)."""
    {"plain": _plain, "hf": _hf, "pl": _lightning, "lora": _lora}[name.split("_")[1]](name)


class Neighbours:
    """``n`` processes spinning on the CPU from :meth:`start` for ``seconds`` (each stops itself then;
    :meth:`stop` kills what is left when the training ends first): a co-tenant's burst on a shared host."""

    def __init__(self, seconds: float, n: int = 2) -> None:
        self.seconds, self.n = seconds, n
        self.procs: List[subprocess.Popen] = []  # type: ignore[type-arg]

    def start(self) -> None:
        self.procs = [
            subprocess.Popen([sys.executable, "-c", f"import time\nt = time.time() + {self.seconds}\n"
                              "while time.time() < t: pass"])
            for _ in range(self.n)
        ]

    def stop(self) -> None:
        for proc in self.procs:
            proc.kill()
            proc.wait()
        self.procs = []


def neighbour_hook(at: int, seconds: float) -> Tuple[Callable[[int], None], Neighbours]:
    """A ``kit.loop`` hook starting :class:`Neighbours` at step ``at``."""
    burst = Neighbours(seconds)

    def hook(step: int) -> None:
        if step == at:
            burst.start()

    return hook, burst


def _plain(name: str) -> None:
    import torch
    import torch.nn.functional as F
    from torch import nn

    from bench.unseen import kit

    step = [0]
    if name.startswith("tu11_plain_resmlp"):
        w = torch.randn(16, 4, generator=kit.seeded(41_001))
        pace = random.Random(41_002)

        def rows(bs: int = 64) -> Tuple[Any, Any]:
            x = torch.randn(bs, 16)
            y = torch.sin(x @ w).sum(-1, keepdim=True)
            if name.endswith("bad_batch") and step[0] == 150:
                x = x * 1000.0
            if name.endswith("slowloader_ok") and pace.random() < 0.1:
                time.sleep(pace.uniform(0.1, 0.4))
            return x, y

        def upload(t: int) -> None:
            step[0] = t
            if name.endswith("sustained_upload") and t > 150:
                time.sleep(0.3)

        m: Any = kit.ResMLP(16, 128, 3, 1)
        o: Any = torch.optim.RMSprop(m.parameters(), 1e-3)
        kit.loop(m, o, rows, F.mse_loss, 300, hook=upload)
    elif name.startswith("tu11_plain_gru"):
        mix = torch.randn(4, generator=kit.seeded(41_003))

        class GRUReg(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.rnn, self.o = nn.GRU(4, 96, batch_first=True), nn.Linear(96, 1)

            def forward(self, x: Any) -> Any:
                return self.o(self.rnn(x)[0][:, -1])

        def seqs(bs: int = 48) -> Tuple[Any, Any]:
            x = torch.randn(bs, 24, 4)
            y = torch.tanh((x @ mix).cumsum(1)[:, -1:] / 5)
            if name.endswith("bad_batch") and step[0] == 140:
                x = x * 1000.0
            return x, y

        m = GRUReg()
        o = torch.optim.AdamW(m.parameters(), 3e-3)
        s: Any = torch.optim.lr_scheduler.OneCycleLR(o, max_lr=3e-3, total_steps=300)
        hook: Callable[[int], None] = lambda t: None  # noqa: E731
        burst = None
        if name.endswith("neighbour_ok"):
            hook, burst = neighbour_hook(80, 25.0)

        def each(t: int) -> None:
            step[0] = t
            hook(t)
            if name.endswith("eval_every_step") and t >= 120:
                with torch.no_grad():
                    m(torch.randn(512, 24, 4))

        try:
            kit.loop(m, o, seqs, F.mse_loss, 300, s, hook=each)
        finally:
            if burst is not None:
                burst.stop()
    elif name.startswith("tu11_plain_ae"):
        basis = torch.randn(3, 20, generator=kit.seeded(41_800))

        def codes(bs: int = 32) -> Tuple[Any, Any]:
            x = torch.randn(bs, 3) @ basis + 0.05 * torch.randn(bs, 20)
            if name.endswith("bad_batch") and step[0] == 200:
                x = x * 1000.0
            return x, x

        def at(t: int) -> None:
            step[0] = t

        m = kit.mlp([20, 48, 3, 48, 20], nn.Tanh)
        o = torch.optim.Adam(m.parameters(), 1e-3)
        kit.loop(m, o, codes, F.mse_loss, 300, hook=at)
    elif name.startswith("tu11_plain_gnll"):
        w2 = torch.randn(12, 1, generator=kit.seeded(41_900))

        def noisy(bs: int = 32) -> Tuple[Any, Any]:
            x = torch.randn(bs, 12)
            y = x @ w2 + (0.1 + x[:, :1].abs()) * torch.randn(bs, 1)
            if name.endswith("bad_batch") and step[0] == 200:
                x = x * 1000.0
            return x, y

        def gnll(out: Any, y: Any) -> Any:
            mu, logvar = out.chunk(2, -1)
            return 0.5 * (logvar + (y - mu) ** 2 / logvar.exp()).mean()

        def at2(t: int) -> None:
            step[0] = t

        m = kit.mlp([12, 64, 64, 2])
        o = torch.optim.Adam(m.parameters(), 1e-3)
        kit.loop(m, o, noisy, gnll, 300, hook=at2)
    elif name.startswith("tu11_plain_cvae"):
        basis = torch.randn(4, 3, 32, generator=kit.seeded(41_950))

        def labelled(bs: int = 32) -> Tuple[Any, Any]:
            c = torch.randint(0, 4, (bs,))
            x = torch.einsum("bk,bkd->bd", torch.randn(bs, 3), basis[c]) + 0.05 * torch.randn(bs, 32)
            if name.endswith("bad_batch") and step[0] == 200:
                x = x * 1000.0
            return (x, c), x

        class CVAE(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.enc, self.dec = kit.mlp([32 + 4, 64, 12]), kit.mlp([6 + 4, 64, 32])

            def forward(self, xc: Any) -> Any:
                x, c = xc
                onehot = F.one_hot(c, 4).float()
                mu, logvar = self.enc(torch.cat([x, onehot], -1)).chunk(2, -1)
                z = mu + torch.randn_like(mu) * (0.5 * logvar).exp()
                kl = -0.5 * (1 + logvar - mu**2 - logvar.exp()).sum(-1).mean()
                return self.dec(torch.cat([z, onehot], -1)), kl

        def elbo(out: Any, x: Any) -> Any:
            recon, kl = out
            return F.mse_loss(recon, x) + 0.01 * kl

        def at3(t: int) -> None:
            step[0] = t

        m = CVAE()
        o = torch.optim.Adam(m.parameters(), 2e-3)
        kit.loop(m, o, labelled, elbo, 300, hook=at3)
    else:
        raise SystemExit(f"unknown tuning plain shape {name}")


def _hf(name: str) -> None:
    import torch
    from transformers import TrainerCallback

    from bench.unseen import kit

    vocab = 40
    model = kit.hf_model("bert", vocab, width=48, positions=32, labels=1)

    calls = [0]

    def row(i: int) -> Dict[str, Any]:
        ids = torch.randint(0, vocab, (24,), generator=kit.seeded(41_100 + i))
        label = torch.tensor(2.0 * float((ids < 12).float().mean()) - 0.6)
        calls[0] += 1  # the Trainer's loader (no workers) fetches the rows of batch k as calls 16k+1..16k+16
        if name.endswith("bad_batch") and 16 * 100 < calls[0] <= 16 * 101:
            label = label * 1000.0  # a pipeline bug on one batch (batch 100): its labels in other units
        return {"input_ids": ids, "labels": label}

    class Hiccups(TrainerCallback):  # type: ignore[misc]
        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if state.global_step in (60, 61):
                time.sleep(1.5)
            elif 120 <= state.global_step <= 150:
                time.sleep(0.15)

    kit.hf_train(
        model,
        kit.Rows(100_000, row),
        "/tmp/trainguard-tuning41-hf",
        240,
        1e-3,
        callbacks=[Hiccups()] if name.endswith("hiccup_ok") else [],
        optim="adamw_torch",
        lr_scheduler_type="linear",
        warmup_steps=10,
        logging_steps=1,
    )


def _lora(name: str) -> None:
    import torch
    import torch.nn.functional as F
    from peft import LoraConfig, get_peft_model

    from bench.unseen import kit

    vocab = 40
    base = kit.pretrained(kit.hf_model("llama", vocab, width=64), kit.lm_rows(vocab, 32, 3, seed=41_200))
    config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj"], lora_dropout=0.0)
    model = get_peft_model(base, config)
    o = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], 2e-3)
    s = torch.optim.lr_scheduler.LambdaLR(o, kit.warmup_cosine(20, 260, 0.1))
    step = [0]

    def loss_fn(out: Any, y: Any) -> Any:
        summed = name.endswith("bad_batch") and step[0] == 140
        return F.cross_entropy(
            out.reshape(-1, out.shape[-1]), y.reshape(-1), reduction="sum" if summed else "mean"
        )

    hook: Callable[[int], None] = lambda t: None  # noqa: E731
    burst = None
    if name.endswith("neighbour_ok"):
        hook, burst = neighbour_hook(60, 40.0)

    def each(t: int) -> None:
        step[0] = t
        hook(t)

    batch = kit.lm_batches(kit.lm_rows(vocab, 32, 6, seed=41_300), bs=24)
    try:
        kit.loop(kit.HFLogits(model), o, batch, loss_fn, 260, s, hook=each)
    finally:
        if burst is not None:
            burst.stop()


def _lightning(name: str) -> None:
    import pytorch_lightning as pl
    import torch
    import torch.nn.functional as F
    from torch import nn

    from bench.unseen import kit

    kind = name.split("_")[2]
    if kind == "cnn":
        proto = torch.randn(6, 1, 12, 12, generator=kit.seeded(41_400))
        bad_rows = range(32 * 150, 32 * 151) if name.endswith("bad_batch") else range(0)
        pace = random.Random(41_401)

        def row(i: int) -> Any:
            g = kit.seeded(41_500 + i)
            y = int(torch.randint(0, 6, (1,), generator=g))
            x = proto[y] + 0.8 * torch.randn(1, 12, 12, generator=g)
            if name.endswith("wobble_ok") and pace.random() < 0.02:
                time.sleep(0.02)
            return (x * 1000.0 if i in bad_rows else x), y

        net: Any = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(32, 6),
        )
        n_steps, extra = 300, {}
    else:
        centres = 2.0 * torch.randn(5, 10, generator=kit.seeded(41_600))
        bad_rows = range(32 * 120, 32 * 121)

        def row(i: int) -> Any:
            g = kit.seeded(41_700 + i)
            y = int(torch.randint(0, 5, (1,), generator=g))
            x = centres[y] + torch.randn(10, generator=g)
            return (x * 1000.0 if i in bad_rows else x), y

        net = kit.mlp([10, 64, 64, 5], nn.GELU)
        n_steps, extra = 300, {"gradient_clip_val": 1.0}

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = net

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            x, y = batch
            loss = F.cross_entropy(self.net(x), y)
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self) -> Any:
            if kind == "cnn":
                o: Any = torch.optim.AdamW(self.parameters(), 2e-3)
                s = torch.optim.lr_scheduler.StepLR(o, 100, 0.5)
                return {"optimizer": o, "lr_scheduler": {"scheduler": s, "interval": "step"}}
            return torch.optim.SGD(self.parameters(), 0.02, momentum=0.9)

    kit.lightning_fit(Model(), kit.Rows(32 * n_steps, row), n_steps, **extra)
