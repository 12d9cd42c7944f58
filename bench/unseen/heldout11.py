#!/usr/bin/env python3
"""Stop 45's HELD-OUT set of unseen training shapes (set ``heldout45``): written and committed, with its
expectations, seeds, scoring rules and the two engine settings it will be judged with, BEFORE any of it ran
(a 3-step smoke at most: TRAINGUARD_SMOKE_STEPS=3, only its recorded / FAILED lines read); recorded once
from a clean archive; judged once per setting below, summary lines only. Never tuned on.

Pre-registered judging (stop 45's question: should the opt-in loss/oscillation shape test of ac31db3 become
the default?). The streams are judged with ``python -m bench.unseen.probe --set heldout45 --rejudge`` twice:

* ``default``: ``DetectionSettings()`` (the shape test OFF: ``oscillation_min_serial`` 0);
* ``on``: ``--setting oscillation_min_serial=0.4 --setting oscillation_heavy_tail=1`` (the shape test on
  every window; ``oscillation_iid_level`` at its default 2).

"on" is called better only when it scores at least as many healthy AND at least as many faults right as
"default" and more of one of them (perf/* kept in; the perf/* left-out lines reported beside them).
The tuning sets it is weighed with: stop 44's recorded streams are gone (/tmp), so tuning44 and tuning43
(bench/unseen/tuning8.py, tuning7.py) are recorded again from the same archive as this set and judged with
the same two settings; "on" must not score fewer healthy or fewer faults right than "default" on either.

Scoring: probe.py's trace rules, stop 44's jump rule (:data:`bench.unseen.sets.JUMP_RULE`: a failing shape
also manifests on a one-step jump >= 10x the median of the 20 values before it), and stop 45's one addition
(:data:`bench.unseen.sets.VANISH_STALL`, decided with this file): ``gradient/vanishing`` counts as a
stalling kind, so the dead-ReLU net (expected ``gradient/vanishing|loss/plateau``) is scored when its loss
did not learn -- a dead net never rises 2x, so under the older rules it would never be scored.

16 shapes, 8 healthy / 8 planted faults. Models, optimisers and schedules new to the sets: an MLP
classifier with label smoothing under Lion (kit.Lion), a residual MLP regressor under SGD Nesterov with a
warmup-stable-decay LR, an identity-initialised ReLU RNN (IRNN) on the adding problem, a Poisson-count
regressor under Adagrad, HF DistilBERT with gradient accumulation and HF's warmup_stable_decay schedule,
HF ELECTRA under inverse_sqrt, peft LoRA on a pre-trained tiny Phi trained by the HF Trainer (Adagrad,
cosine_with_min_lr), and a Lightning MLP-Mixer under bf16-mixed autocast on the CPU with SGD Nesterov and a
warmup-then-exponential SequentialLR.

* plain loops: the Lion MLP (label smoothing 0.1, 20 % random labels, batch 4: healthy; and at LR 0.1,
  ~330x); the residual MLP (healthy; and one NaN input row from step 200); the IRNN (SGD 0.01, clip 1:
  healthy; and with its recurrent matrix 1.2 x identity and no clipping: exploding gradients); the Poisson
  regressor (batch 4: healthy); a ReLU MLP whose hidden biases start at -8 (every unit dead: gradients
  vanish, nothing learns);
* the HF Trainer: DistilBERT, batch 4 x accumulation 4, 20 % random labels (healthy; and at LR 0.1, 100x);
  ELECTRA at batch 2 with 25 % random labels (healthy); the same on clean labels, batch 8, with steps 150
  and 190's losses x40 (bad batches);
* peft: LoRA r=8 on a pre-trained tiny Phi's q_proj/v_proj, HF Trainer, 20 % random rows (healthy; and
  steps 160 and 200's losses x30: bad batches);
* Lightning: the MLP-Mixer on noisy prototype images, bf16-mixed (healthy; and at LR 5.0, 100x).

Every shape is seeded: ``torch.manual_seed(0)`` (bench.unseen.shapes.main) and the fixed data seeds below
(56_000+: none used by another set).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Sequence, Tuple

from bench.unseen.sets import HEALTHY, LR_TOO_HIGH, Expectations

BAD_BATCH = (
    "loss/divergence|loss/rise-after-fall|loss/oscillation|gradient/explosion"
    "|loss/non_finite|gradient/nan-source|loss/spike|gradient/spike"
)
"""Bad batches: any curve / gradient kind that says the run was hit (a one-step spike kind included)."""
NAN = "loss/non_finite|gradient/nan-source"
EXPLODE = "gradient/explosion|loss/divergence|loss/non_finite"
DEAD = "gradient/vanishing|loss/plateau"
"""A dead-ReLU net: its gradients vanish and its loss stays where it began (scored when it did not learn)."""

SETTINGS: Dict[str, Dict[str, float]] = {
    "default": {},
    "on": {"oscillation_min_serial": 0.4, "oscillation_heavy_tail": 1.0},
}
"""The two engine settings this set is judged with (pre-registered; module docstring)."""

SHAPES: Expectations = {
    # plain loops
    "ho15_plain_mlp_lion_ls_noisy_bs4_ok": (
        HEALTHY,
        "MLP classifier of 5 Gaussian blobs, cross-entropy with label smoothing 0.1, 20 % of the labels "
        "random, Lion 3e-4, batch 4, 300 steps",
    ),
    "ho15_plain_mlp_lion_ls_lr_high": (LR_TOO_HIGH, "the same at Lion 0.1 (~330x)"),
    "ho15_plain_resmlp_nesterov_wsd_ok": (
        HEALTHY,
        "residual MLP regressor, MSE, SGD Nesterov (momentum 0.9) 0.02 with warmup 20 / stable to 200 / "
        "linear decay to 0.1x at 300, batch 16, 300 steps",
    ),
    "ho15_plain_resmlp_nesterov_nan_input": (NAN, "the same, one NaN input row from step 200"),
    "ho15_plain_irnn_sgd_clip_ok": (
        HEALTHY,
        "IRNN (ReLU RNN, recurrent matrix = identity) on the adding problem (length 20), MSE, SGD 0.01, "
        "clip 1, batch 16, 300 steps",
    ),
    "ho15_plain_irnn_noclip_explode": (
        EXPLODE,
        "the same with the recurrent matrix 1.2 x identity and no clipping (exploding gradients)",
    ),
    "ho15_plain_poisson_adagrad_bs4_ok": (
        HEALTHY,
        "MLP Poisson regressor of counts (log-rate up to ~3), PoissonNLLLoss, Adagrad 0.05, batch 4, "
        "300 steps",
    ),
    "ho15_plain_relu_mlp_dead": (
        DEAD,
        "4-class blobs, 3-hidden-layer ReLU MLP whose hidden biases start at -8 (every unit dead), Adam "
        "1e-3, batch 32, 300 steps",
    ),
    # HF Trainer
    "ho15_hf_distilbert_accum_wsd_ok": (
        HEALTHY,
        "HF Trainer, DistilBERT 2x48 classifier, 20 % of the labels random, adamw_torch 1e-3, "
        "warmup_stable_decay (warmup 20, decay 60), batch 4 x gradient accumulation 4, log 1, 200 steps",
    ),
    "ho15_hf_distilbert_accum_lr_high": (LR_TOO_HIGH, "the same at lr 0.1 (100x)"),
    "ho15_hf_electra_invsqrt_noisy_bs2_ok": (
        HEALTHY,
        "HF Trainer, ELECTRA 2x48 classifier, 25 % of the labels random, adamw_torch 1e-3, inverse_sqrt "
        "(warmup 10), batch 2, log 1, 250 steps",
    ),
    "ho15_hf_electra_clean_bad_batches": (
        BAD_BATCH,
        "the same on clean labels, batch 8 (converges far below its start), steps 150 and 190's losses x40",
    ),
    # peft
    "ho15_lora_phi_hf_ok": (
        HEALTHY,
        "peft LoRA r=8 on a pre-trained tiny Phi's q_proj/v_proj, HF Trainer adagrad 0.05, "
        "cosine_with_min_lr (min 0.1), batch 4, 20 % random rows, log 1, 250 steps",
    ),
    "ho15_lora_phi_hf_bad_batches": (BAD_BATCH, "the same, steps 160 and 200's losses x30"),
    # Lightning
    "ho15_pl_mixer_bf16_nesterov_ok": (
        HEALTHY,
        "Lightning MLP-Mixer (4x4 patches of 12x12 images, 2 blocks) on noisy prototype images (6 classes), "
        "bf16-mixed on the CPU, SGD Nesterov 0.05, LinearLR warmup 20 then ExponentialLR 0.995, batch 16, "
        "300 steps",
    ),
    "ho15_pl_mixer_bf16_lr100x": (LR_TOO_HIGH, "the same at lr 5.0 (100x)"),
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
    if family == "mlp":
        centres = 3.0 * torch.randn(5, 10, generator=kit.seeded(56_001))

        def blobs(bs: int = 4) -> Tuple[Any, Any]:
            y = torch.randint(0, 5, (bs,))
            x = centres[y] + torch.randn(bs, 10)
            return x, torch.where(torch.rand(bs) < 0.2, torch.randint(0, 5, (bs,)), y)

        m: Any = kit.mlp([10, 64, 64, 5])
        o: Any = kit.Lion(m.parameters(), 0.1 if name.endswith("lr_high") else 3e-4)
        kit.loop(m, o, blobs, lambda out, y: F.cross_entropy(out, y, label_smoothing=0.1), 300)
    elif family == "resmlp":
        w = torch.randn(16, generator=kit.seeded(56_002))

        def rows(bs: int = 16) -> Tuple[Any, Any]:
            x = torch.randn(bs, 16)
            return x, (torch.sin(x @ w / 2) + 0.1 * torch.randn(bs)).unsqueeze(1)

        def wsd(t: int) -> float:
            if t < 20:
                return 0.02 * (t + 1) / 20
            if t < 200:
                return 0.02
            return 0.02 * (1 - 0.9 * (t - 200) / 100)

        m = kit.ResMLP(16, 64, 3, 1)
        o = torch.optim.SGD(m.parameters(), 0.02, momentum=0.9, nesterov=True)
        nan_at = 200 if name.endswith("nan_input") else None
        kit.loop(m, o, rows, F.mse_loss, 300, lr_at=wsd, nan_at=nan_at)
    elif family == "irnn":
        explode = name.endswith("explode")

        def adding(bs: int = 16) -> Tuple[Any, Any]:
            vals = torch.rand(bs, 20)
            marks = torch.zeros(bs, 20)
            for r in range(bs):
                i, j = torch.randperm(20)[:2]
                marks[r, i] = marks[r, j] = 1.0
            return torch.stack([vals, marks], 2), (vals * marks).sum(1, keepdim=True)

        class IRNN(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.rnn = nn.RNN(2, 32, nonlinearity="relu", batch_first=True)
                self.o = nn.Linear(32, 1)
                with torch.no_grad():
                    self.rnn.weight_hh_l0.copy_(torch.eye(32) * (1.2 if explode else 1.0))
                    self.rnn.bias_hh_l0.zero_()
                    self.rnn.bias_ih_l0.zero_()

            def forward(self, x: Any) -> Any:
                return self.o(self.rnn(x)[0][:, -1])

        torch.manual_seed(56_003)
        m = IRNN()
        o = torch.optim.SGD(m.parameters(), 0.01)
        kit.loop(m, o, adding, F.mse_loss, 300, clip=None if explode else 1.0)
    elif family == "poisson":
        w = 0.6 * torch.randn(6, generator=kit.seeded(56_004))

        def counts(bs: int = 4) -> Tuple[Any, Any]:
            x = torch.randn(bs, 6)
            rate = torch.exp((x @ w).clamp(max=3.0))
            return x, torch.poisson(rate).unsqueeze(1)

        m = kit.mlp([6, 32, 32, 1])
        o = torch.optim.Adagrad(m.parameters(), 0.05)
        kit.loop(m, o, counts, nn.PoissonNLLLoss(log_input=True), 300)
    elif family == "relu":
        centres = 2.0 * torch.randn(4, 8, generator=kit.seeded(56_005))

        def blobs4(bs: int = 32) -> Tuple[Any, Any]:
            y = torch.randint(0, 4, (bs,))
            return centres[y] + torch.randn(bs, 8), y

        m = kit.mlp([8, 64, 64, 64, 4])
        with torch.no_grad():
            for layer in list(m)[:-1]:
                if isinstance(layer, nn.Linear):
                    layer.bias.fill_(-8.0)
        o = torch.optim.Adam(m.parameters(), 1e-3)
        kit.loop(m, o, blobs4, F.cross_entropy, 300)
    else:
        raise SystemExit(f"unknown held-out plain shape {name}")


def _scaled(inner: Any, at: Sequence[int], weight: float, call: Callable[..., Any]) -> Any:
    """An ``nn.Module`` around an HF model whose loss is multiplied by ``weight`` on the forwards numbered
    ``a + 1`` for ``a`` in ``at`` (one forward per optimizer step here: steps ``at``)."""
    import torch

    class Scaled(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner, self.calls = inner, 0

        def forward(self, input_ids: Any, labels: Any = None) -> Any:
            out = call(self.inner, input_ids, labels)
            self.calls += 1
            if self.calls - 1 in at:
                out["loss"] = out["loss"] * weight
            return out

    return Scaled()


def _hf(name: str) -> None:
    import torch
    import transformers as tf

    from bench.unseen import kit

    vocab = 48
    noisy = "noisy" in name or "distilbert" in name
    share = 0.25 if "electra" in name else 0.2
    seed = 56_100 if "distilbert" in name else 56_200

    def row(i: int) -> Dict[str, Any]:
        g = kit.seeded(seed * 10 + i)
        label = int(torch.randint(0, 3, (1,), generator=g))
        ids = torch.randint(4, 4 + 14, (16,), generator=g) + label * 14
        ids[0] = 2
        if noisy and float(torch.rand(1, generator=g)) < share:
            label = int(torch.randint(0, 3, (1,), generator=g))
        return {"input_ids": ids, "labels": torch.tensor(label)}

    def classify(inner: Any, input_ids: Any, labels: Any) -> Any:
        return inner(input_ids=input_ids, labels=labels)

    if "distilbert" in name:
        distil = tf.DistilBertForSequenceClassification(
            tf.DistilBertConfig(
                vocab_size=vocab,
                dim=48,
                n_layers=2,
                n_heads=4,
                hidden_dim=96,
                max_position_embeddings=40,
                num_labels=3,
                pad_token_id=0,
            )
        )
        kit.hf_train(
            _scaled(distil, (), 1.0, classify),
            kit.Rows(100_000, row),
            "/tmp/trainguard-heldout45-distilbert",
            200,
            0.1 if name.endswith("lr_high") else 1e-3,
            batch=4,
            gradient_accumulation_steps=4,
            optim="adamw_torch",
            lr_scheduler_type="warmup_stable_decay",
            lr_scheduler_kwargs={"num_decay_steps": 60},
            warmup_steps=20,
            logging_steps=1,
        )
        return
    electra = tf.ElectraForSequenceClassification(
        tf.ElectraConfig(
            vocab_size=vocab,
            embedding_size=32,
            hidden_size=48,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=96,
            max_position_embeddings=40,
            num_labels=3,
            pad_token_id=0,
        )
    )
    bad = name.endswith("bad_batches")
    kit.hf_train(
        _scaled(electra, (150, 190) if bad else (), 40.0, classify),
        kit.Rows(100_000, row),
        "/tmp/trainguard-heldout45-electra",
        250,
        1e-3,
        batch=2 if noisy else 8,
        optim="adamw_torch",
        lr_scheduler_type="inverse_sqrt",
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
        tf.PhiForCausalLM(
            tf.PhiConfig(
                vocab_size=vocab,
                hidden_size=48,
                num_hidden_layers=2,
                num_attention_heads=4,
                intermediate_size=96,
                max_position_embeddings=32,
            )
        ),
        kit.lm_rows(vocab, 32, 3, seed=56_300),
    )
    config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    model = get_peft_model(base, config)
    clean = kit.lm_rows(vocab, 32, 5, seed=56_400)

    def row(i: int) -> Dict[str, Any]:
        g = kit.seeded(56_500 + i)
        if float(torch.rand(1, generator=g)) < 0.2:
            ids = torch.randint(0, vocab, (32,), generator=g)
            return {"input_ids": ids, "labels": ids.clone()}
        return clean(i)

    def lm(inner: Any, input_ids: Any, labels: Any) -> Any:
        return inner(input_ids=input_ids, labels=labels)

    bad = name.endswith("bad_batches")
    kit.hf_train(
        _scaled(model, (160, 200) if bad else (), 30.0, lm),
        kit.Rows(100_000, row),
        "/tmp/trainguard-heldout45-lora-phi",
        250,
        0.05,
        batch=4,
        optim="adagrad",
        lr_scheduler_type="cosine_with_min_lr",
        lr_scheduler_kwargs={"min_lr_rate": 0.1},
        logging_steps=1,
    )


def _lightning(name: str) -> None:
    import pytorch_lightning as pl
    import torch
    import torch.nn.functional as F
    from torch import nn

    from bench.unseen import kit

    proto = torch.randn(6, 1, 12, 12, generator=kit.seeded(56_600))

    def row(i: int) -> Any:
        g = kit.seeded(56_700 + i)
        label = int(torch.randint(0, 6, (1,), generator=g))
        return proto[label] + 0.8 * torch.randn(1, 12, 12, generator=g), label

    class MixerBlock(nn.Module):
        def __init__(self, tokens: int, width: int) -> None:
            super().__init__()
            self.n1, self.n2 = nn.LayerNorm(width), nn.LayerNorm(width)
            self.tok = nn.Sequential(nn.Linear(tokens, 2 * tokens), nn.GELU(), nn.Linear(2 * tokens, tokens))
            self.ch = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))

        def forward(self, x: Any) -> Any:
            x = x + self.tok(self.n1(x).transpose(1, 2)).transpose(1, 2)
            return x + self.ch(self.n2(x))

    class Mixer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.patch = nn.Conv2d(1, 32, 4, stride=4)
            self.blocks = nn.Sequential(MixerBlock(9, 32), MixerBlock(9, 32))
            self.head = nn.Linear(32, 6)

        def forward(self, x: Any) -> Any:
            z = self.patch(x).flatten(2).transpose(1, 2)
            return self.head(self.blocks(z).mean(1))

    lr = 5.0 if name.endswith("lr100x") else 0.05

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = Mixer()

        def training_step(self, b: Any, batch_idx: int) -> Any:
            x, y = b
            loss = F.cross_entropy(self.net(x), y)
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self) -> Any:
            o = torch.optim.SGD(self.parameters(), lr, momentum=0.9, nesterov=True)
            s = torch.optim.lr_scheduler.SequentialLR(
                o,
                [
                    torch.optim.lr_scheduler.LinearLR(o, 0.05, 1.0, total_iters=20),
                    torch.optim.lr_scheduler.ExponentialLR(o, 0.995),
                ],
                milestones=[20],
            )
            return {"optimizer": o, "lr_scheduler": {"scheduler": s, "interval": "step"}}

    kit.lightning_fit(Model(), kit.Rows(16 * 300, row), 300, batch=16, precision="bf16-mixed")
