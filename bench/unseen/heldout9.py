#!/usr/bin/env python3
"""Stop 43's HELD-OUT set of unseen training shapes (set ``heldout43``): written and committed, with its
expectations, seeds and scoring rules (probe.py's trace rules, unchanged), BEFORE any of it ran (a 3-step
smoke at most) and before the stop's detector changes; recorded once from a clean archive; judged ONCE
with the stop's starting engine (a11e7e4) and ONCE with the engine kept at the end, aggregates only.
Never tuned on.

16 shapes, 8 healthy / 8 planted faults. The stop's question: one bad batch of x10-x200 (and one of
x1000) must be caught, and healthy runs whose loss spikes NATURALLY (tiny batches, heavy-tailed targets,
noisy labels, an RL-like critic) must stay quiet. Models of no earlier set's: a value-function (critic)
MLP on heavy-tailed returns, an RBF-network regressor, a noisy-label spiral classifier, an HF OPT causal
LM, peft LoRA on a pre-trained Mistral, a dilated causal-conv (WaveNet-like) forecaster, a Lightning
DeepSets set classifier and a Lightning MLP on Student-t noise.

* plain loops: the critic under ASGD, batch 2, returns with Student-t (df 4) noise (healthy, natural
  spikes; and one step's returns x10 -- the loss ~x100); the RBF regressor under Adamax, batch 64 (healthy;
  and one step's loss x20, a sum over 20 micro-batches not averaged); the noisy-label (25 %) spiral
  classifier under SGD momentum, batch 2 (healthy, natural spikes; and at LR 300x); the WaveNet-like
  forecaster under Adam + ExponentialLR (healthy; and at LR 50x -- swings -- with step 150's loss x100,
  a bad batch while the run swings);
* the HF Trainer: OPT under adamw_torch + cosine_with_restarts, batch 2, 30 % of the tokens random
  (healthy, natural spikes; and one step's loss x50);
* peft: LoRA r=8 on a pre-trained tiny Mistral's k_proj/o_proj in a plain loop under RAdam, batch 4
  (healthy; and one step's loss x200);
* Lightning: an MLP on Student-t (df 5) noise under SGD momentum + MultiStepLR, batch 4 (healthy, natural
  spikes; and batch 120's loss x30); DeepSets under Adamax (healthy; and batch 140's loss x1000).

Every shape is seeded: ``torch.manual_seed(0)`` (bench.unseen.shapes.main) and the fixed data seeds below
(53_000+: none used by another set).
"""

from __future__ import annotations

from typing import Any, Dict, Tuple

from bench.unseen.sets import HEALTHY, LR_TOO_HIGH, Expectations

BAD_BATCH = (
    "loss/divergence|loss/rise-after-fall|loss/oscillation|gradient/explosion"
    "|loss/non_finite|gradient/nan-source|loss/spike|gradient/spike"
)
"""One bad batch: any curve / gradient kind that says the run was hit (a one-step spike kind included)."""

SHAPES: Expectations = {
    # plain loops
    "ho13_plain_critic_asgd_spiky_ok": (
        HEALTHY,
        "value-function MLP regressing returns (a smooth function + Student-t df 4 noise: natural spikes), "
        "MSE, ASGD 0.01, batch 2, 300 steps",
    ),
    "ho13_plain_critic_asgd_bad_batch": (BAD_BATCH, "the same, step 150's returns x10 (loss ~x100)"),
    "ho13_plain_rbf_adamax_ok": (
        HEALTHY,
        "RBF-network regressor (32 learned centres), targets + Gaussian noise, MSE, Adamax 1e-2, batch 64",
    ),
    "ho13_plain_rbf_adamax_bad_batch": (BAD_BATCH, "the same, step 160's loss x20 (summed, not averaged)"),
    "ho13_plain_spiral_sgdm_noisy_labels_ok": (
        HEALTHY,
        "MLP classifier of 3 spirals, 25 % of the labels random (natural spikes), SGD momentum 0.8 lr 0.02, "
        "batch 2, 300 steps",
    ),
    "ho13_plain_spiral_sgdm_lr300x": (LR_TOO_HIGH, "the same at lr 6.0 (300x)"),
    "ho13_plain_wavenet_adam_ok": (
        HEALTHY,
        "dilated causal Conv1d stack (WaveNet-like, 4 layers) forecasting noisy sines, MSE, Adam 1e-3, "
        "ExponentialLR 0.995, batch 32",
    ),
    "ho13_plain_wavenet_adam_swings_bad_batch": (
        LR_TOO_HIGH + "|loss/spike",
        "the same at Adam 0.05 (50x: swings), step 150's loss x100 (a bad batch while the run swings)",
    ),
    # HF Trainer
    "ho13_hf_opt_adamw_noisy_ok": (
        HEALTHY,
        "HF Trainer, OPT 2x48 causal LM, adamw_torch 1e-3, cosine_with_restarts, warmup 10, batch 2, log 1; "
        "30 % of the tokens random (natural spikes)",
    ),
    "ho13_hf_opt_adamw_bad_batch": (BAD_BATCH, "the same, step 140's loss x50"),
    # peft
    "ho13_lora_mistral_radam_ok": (
        HEALTHY,
        "peft LoRA r=8 on a pre-trained tiny Mistral's k_proj/o_proj, plain loop RAdam 3e-3, batch 4",
    ),
    "ho13_lora_mistral_radam_bad_batch": (BAD_BATCH, "the same, step 130's loss x200"),
    # Lightning
    "ho13_pl_tnoise_sgdm_spiky_ok": (
        HEALTHY,
        "Lightning MLP regressor, targets + Student-t (df 5) noise (natural spikes), MSE, SGD momentum 0.9 "
        "lr 5e-3, MultiStepLR [150, 220] x0.3, batch 4, 300 steps",
    ),
    "ho13_pl_tnoise_sgdm_bad_batch": (BAD_BATCH, "the same, batch 120's loss x30"),
    "ho13_pl_deepsets_adamax_ok": (
        HEALTHY,
        "Lightning DeepSets classifier (per-point MLP, sum, MLP) of 2-D point sets, Adamax 2e-3, batch 16",
    ),
    "ho13_pl_deepsets_adamax_bad_batch": (BAD_BATCH, "the same, batch 140's loss x1000"),
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
    step = [0]

    def at(t: int) -> None:
        step[0] = t

    def weighted(loss_fn: Any, when: int, weight: float) -> Any:
        def fn(out: Any, y: Any) -> Any:
            loss = loss_fn(out, y)
            return loss * weight if name.endswith("bad_batch") and step[0] == when else loss

        return fn

    if family == "critic":
        w = torch.randn(6, generator=kit.seeded(53_001))
        t_noise = torch.distributions.StudentT(4.0)

        def returns(bs: int = 2) -> Tuple[Any, Any]:
            s = torch.randn(bs, 6)
            r = torch.tanh(s @ w).unsqueeze(1) * 2 + 0.5 * t_noise.sample((bs, 1))
            if name.endswith("bad_batch") and step[0] == 150:
                r = r * 10.0
            return s, r

        m: Any = kit.mlp([6, 64, 64, 1], nn.Tanh)
        o: Any = torch.optim.ASGD(m.parameters(), 0.01)
        kit.loop(m, o, returns, F.mse_loss, 300, hook=at)
    elif family == "rbf":
        g = kit.seeded(53_002)
        true_c, true_a = torch.randn(8, 3, generator=g), torch.randn(8, generator=g)

        def rows(bs: int = 64) -> Tuple[Any, Any]:
            x = torch.randn(bs, 3)
            y = (torch.exp(-torch.cdist(x, true_c) ** 2) @ true_a).unsqueeze(1) + 0.1 * torch.randn(bs, 1)
            return x, y

        class RBF(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.c = nn.Parameter(torch.randn(32, 3))
                self.log_width = nn.Parameter(torch.zeros(32))
                self.o = nn.Linear(32, 1)

            def forward(self, x: Any) -> Any:
                d2 = torch.cdist(x, self.c) ** 2
                return self.o(torch.exp(-d2 * torch.exp(-self.log_width)))

        m = RBF()
        o = torch.optim.Adamax(m.parameters(), 1e-2)
        kit.loop(m, o, rows, weighted(F.mse_loss, 160, 20.0), 250, hook=at)
    elif family == "spiral":

        def spirals(bs: int = 2) -> Tuple[Any, Any]:
            y = torch.randint(0, 3, (bs,))
            r = torch.rand(bs)
            theta = 4.0 * r + y * 2.094 + 0.2 * torch.randn(bs)
            x = torch.stack([r * torch.cos(theta), r * torch.sin(theta)], 1)
            noisy = torch.rand(bs) < 0.25
            return x, torch.where(noisy, torch.randint(0, 3, (bs,)), y)

        m = kit.mlp([2, 64, 64, 3])
        o = torch.optim.SGD(m.parameters(), 6.0 if name.endswith("lr300x") else 0.02, momentum=0.8)
        kit.loop(m, o, spirals, F.cross_entropy, 300)
    elif family == "wavenet":
        phase = torch.rand(4, generator=kit.seeded(53_004)) * 6.28

        def series(bs: int = 32) -> Tuple[Any, Any]:
            t0 = torch.rand(bs, 1) * 100
            t = t0 + torch.arange(33) * 0.3
            z = sum(torch.sin(t * (k + 1) * 0.7 + phase[k]) / (k + 1) for k in range(4))
            z = z + 0.05 * torch.randn_like(z)
            return z[:, None, :32], z[:, 32:]

        class WaveNet(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.convs = nn.ModuleList(
                    nn.Conv1d(1 if i == 0 else 24, 24, 2, dilation=2**i) for i in range(4)
                )
                self.o = nn.Linear(24, 1)

            def forward(self, x: Any) -> Any:
                h = x
                for i, conv in enumerate(self.convs):
                    out = torch.tanh(conv(F.pad(h, (2**i, 0))))
                    h = out if i == 0 else h + out
                return self.o(h[:, :, -1])

        m = WaveNet()
        o = torch.optim.Adam(m.parameters(), 0.05 if "swings" in name else 1e-3)
        s: Any = torch.optim.lr_scheduler.ExponentialLR(o, 0.995)
        kit.loop(m, o, series, weighted(F.mse_loss, 150, 100.0), 250, s, hook=at)
    else:
        raise SystemExit(f"unknown held-out plain shape {name}")


class _Scaled:
    """Builds an ``nn.Module`` around an HF model whose loss is multiplied by ``weight`` on forward number
    ``at`` + 1 (one forward per optimizer step: step ``at``)."""

    @staticmethod
    def make(inner: Any, at: int, weight: float) -> Any:
        import torch

        class Scaled(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.inner, self.calls = inner, 0

            def forward(self, input_ids: Any, labels: Any = None) -> Any:
                out = self.inner(input_ids=input_ids, labels=labels)
                self.calls += 1
                if self.calls == at + 1:
                    out["loss"] = out["loss"] * weight
                return out

        return Scaled()


def _hf(name: str) -> None:
    import torch
    import transformers as tf

    from bench.unseen import kit

    vocab = 40
    opt = tf.OPTForCausalLM(
        tf.OPTConfig(
            vocab_size=vocab,
            hidden_size=48,
            num_hidden_layers=2,
            ffn_dim=96,
            num_attention_heads=4,
            max_position_embeddings=32,
            word_embed_proj_dim=48,
        )
    )
    clean = kit.lm_rows(vocab, 24, 4, seed=53_100)

    def row(i: int) -> Dict[str, Any]:
        ids = clean(i)["input_ids"].clone()
        g = kit.seeded(53_200 + i)
        noisy = torch.rand(24, generator=g) < 0.3
        ids[noisy] = torch.randint(0, vocab, (int(noisy.sum()),), generator=g)
        return {"input_ids": ids, "labels": ids.clone()}

    model = _Scaled.make(opt, 140, 50.0 if name.endswith("bad_batch") else 1.0)
    kit.hf_train(
        model,
        kit.Rows(100_000, row),
        "/tmp/trainguard-heldout43-opt",
        250,
        1e-3,
        batch=2,
        optim="adamw_torch",
        lr_scheduler_type="cosine_with_restarts",
        warmup_steps=10,
        logging_steps=1,
    )


def _lora(name: str) -> None:
    import torch
    import transformers as tf
    from peft import LoraConfig, get_peft_model

    from bench.unseen import kit

    vocab = 40
    base = kit.pretrained(
        tf.MistralForCausalLM(
            tf.MistralConfig(
                vocab_size=vocab,
                hidden_size=48,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                intermediate_size=96,
                max_position_embeddings=32,
            )
        ),
        kit.lm_rows(vocab, 32, 3, seed=53_300),
    )
    config = LoraConfig(r=8, lora_alpha=16, target_modules=["k_proj", "o_proj"], lora_dropout=0.0)
    model = get_peft_model(base, config)
    o = torch.optim.RAdam([p for p in model.parameters() if p.requires_grad], 3e-3)
    step = [0]

    def at(t: int) -> None:
        step[0] = t

    def loss(out: Any, y: Any) -> Any:
        value = kit.ce(out, y)
        return value * 200.0 if name.endswith("bad_batch") and step[0] == 130 else value

    batches = kit.lm_batches(kit.lm_rows(vocab, 32, 6, seed=53_400), bs=4)
    kit.loop(kit.HFLogits(model), o, batches, loss, 250, hook=at)


def _lightning(name: str) -> None:
    import pytorch_lightning as pl
    import torch
    import torch.nn.functional as F
    from torch import nn

    from bench.unseen import kit

    kind = name.split("_")[2]
    if kind == "tnoise":
        w = torch.randn(8, generator=kit.seeded(53_500))
        t_noise = torch.distributions.StudentT(5.0)

        def row(i: int) -> Any:
            g = kit.seeded(53_600 + i)
            x = torch.randn(8, generator=g)
            noise = t_noise.sample((1,))
            return x, torch.sin(x @ w).reshape(1) + 0.5 * noise

        net: Any = kit.mlp([8, 64, 64, 1])
        batch, n_steps, when, weight = 4, 300, 120, 30.0
    else:

        def row(i: int) -> Any:
            g = kit.seeded(53_700 + i)
            pts = torch.randn(10, 2, generator=g) * (0.6 + torch.rand(1, generator=g))
            return pts, int(pts.norm(dim=1).mean() > 1.0)

        class DeepSets(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.phi, self.rho = kit.mlp([2, 32, 32]), kit.mlp([32, 32, 2])

            def forward(self, x: Any) -> Any:
                return self.rho(torch.relu(self.phi(x)).sum(1))

        net = DeepSets()
        batch, n_steps, when, weight = 16, 250, 140, 1000.0

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = net

        def training_step(self, b: Any, batch_idx: int) -> Any:
            x, y = b
            out = self.net(x)
            loss = F.mse_loss(out, y) if kind == "tnoise" else F.cross_entropy(out, y)
            if name.endswith("bad_batch") and batch_idx == when:
                loss = loss * weight
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self) -> Any:
            if kind == "tnoise":
                o: Any = torch.optim.SGD(self.parameters(), 5e-3, momentum=0.9)
                s = torch.optim.lr_scheduler.MultiStepLR(o, [150, 220], 0.3)
                return {"optimizer": o, "lr_scheduler": {"scheduler": s, "interval": "step"}}
            return torch.optim.Adamax(self.parameters(), 2e-3)

    kit.lightning_fit(Model(), kit.Rows(batch * n_steps, row), n_steps, batch=batch)
