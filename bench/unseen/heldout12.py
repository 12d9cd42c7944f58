#!/usr/bin/env python3
"""Stop 47's HELD-OUT set of unseen training shapes (set ``heldout47``): written and committed, with its
expectations, seeds and scoring rules, BEFORE any of it ran (a 3-step smoke at most: TRAINGUARD_SMOKE_STEPS=3,
only its recorded / FAILED lines read); recorded once (nice 10, --jobs 2); judged once with the default
``DetectionSettings()`` (``python -m bench.unseen.probe --set heldout47 --rejudge``), summary lines only.
Never tuned on.

Scoring: probe.py's trace rules and stop 44's jump rule (:data:`bench.unseen.sets.JUMP_RULE`, heldout47
added with this file: a failing shape also manifests on a one-step jump >= 10x the median of the 20 values
before it -- the corrupted batches below land on runs that learned far below their start). The frozen shape
expects only ``loss/plateau`` (a stalling kind: scored when its loss did not learn).

Expectations, from the catalogue's kinds (engine/.../catalogue): an LR too high -> the 'LR too high' family
(``sets.LR_TOO_HIGH``); a forgotten ``zero_grad`` (gradients summed over every step: an effective step that
keeps growing, the sum never decays) -> the same family or a rise after the fall; NaN input ->
``loss/non_finite|gradient/nan-source``; exploding gradients without clipping ->
``gradient/explosion|loss/divergence|loss/non_finite``; corrupted batches -> any curve / gradient kind that
says the run was hit; LR 0 (a frozen net) -> ``loss/plateau``. Stop 47's brief also named a data loader that
repeats one batch (the loss collapses to ~0): the catalogue has no kind for a loss that falls too well (no
data/* kind; plateau, divergence, oscillation, rise-after-fall and spike all need a loss that stays up or goes
up), so it is not a detectable kind and is not in this set; the forgotten ``zero_grad`` takes its place.

16 shapes, 8 healthy / 8 planted faults. Optimisers, schedules, models and framework modes new to every
earlier set (bench/unseen/*.py grepped): Rprop (full batch), Adam / AdamW with amsgrad, NAdam with decoupled
weight decay, SGD with dampening; MultiplicativeLR, ChainedScheduler(ConstantLR, ExponentialLR), CyclicLR
'triangular2', HF ``cosine_warmup_with_min_lr``, HF ``adamw_torch_fused`` with a squared ``polynomial``;
GroupNorm CNN with mixup, an InfoNCE contrastive encoder, a tanh RNN LM, GLU MLP; HF T5 (encoder-decoder),
HF StableLM, peft IA3 on a pre-trained tiny Bloom, Lightning manual optimisation.

* plain loops: GroupNorm CNN + mixup (alpha 0.4), SGD momentum 0.9 dampening 0.1 wd 5e-4, MultiplicativeLR
  0.996 (healthy; and at LR 5.0, 100x); InfoNCE encoder (two noisy views, temperature 0.2), AdamW amsgrad,
  ChainedScheduler (healthy; and the ConstantLR factor typed 0.0 for the whole run: LR 0, frozen); a tanh
  RNN LM, Adam amsgrad, CyclicLR triangular2, clip 1 (healthy; and three batches of random tokens: corrupted
  batches); a full-batch Rprop regressor (healthy; and a NaN input row from step 150); a deep ReLU MLP, He
  init x1.5 per layer, SGD momentum, no clipping (exploding gradients);
* the HF Trainer: T5 2+2 layers learning to reverse 12 tokens, adamw_torch, cosine_warmup_with_min_lr
  (healthy; and at LR 0.3, 300x); StableLM from scratch, adamw_torch_fused, polynomial power 2, gradient
  accumulation 2 (healthy);
* peft: IA3 on a pre-trained tiny Bloom, HF Trainer (healthy; and two batches of random tokens: corrupted);
* Lightning, manual optimisation: a GLU MLP classifier, NAdam decoupled wd, ReduceLROnPlateau stepped by
  hand (healthy; and ``opt.zero_grad()`` forgotten).

Every shape is seeded: ``torch.manual_seed(0)`` (bench.unseen.shapes.main) and the fixed data seeds below
(57_000+: none used by another set).
"""

from __future__ import annotations

from typing import Any, Dict, List, Sequence, Tuple

from bench.unseen.sets import HEALTHY, LR_TOO_HIGH, Expectations

CORRUPT = (
    "loss/divergence|loss/rise-after-fall|loss/oscillation|gradient/explosion"
    "|loss/non_finite|gradient/nan-source|loss/spike|gradient/spike"
)
"""Corrupted batches: any curve / gradient kind that says the run was hit (a one-step spike kind included)."""
NAN = "loss/non_finite|gradient/nan-source"
EXPLODE = "gradient/explosion|loss/divergence|loss/non_finite"
NO_ZERO_GRAD = LR_TOO_HIGH + "|loss/rise-after-fall|loss/non_finite"
"""A forgotten ``zero_grad``: the summed gradient keeps pushing (the LR-too-high family, or a rise after the
fall, or a blow-up to a non-finite loss)."""
FROZEN = "loss/plateau"

SHAPES: Expectations = {
    # plain loops
    "ho16_plain_gncnn_mixup_sgdd_ok": (
        HEALTHY,
        "GroupNorm CNN on noisy 12x12 prototype images (6 classes), mixup alpha 0.4, SGD 0.05 momentum 0.9 "
        "dampening 0.1 wd 5e-4, MultiplicativeLR 0.996, batch 32, 250 steps",
    ),
    "ho16_plain_gncnn_mixup_lr100x": (LR_TOO_HIGH, "the same at LR 5.0 (100x)"),
    "ho16_plain_infonce_amsgrad_ok": (
        HEALTHY,
        "MLP encoder, InfoNCE on two noisy views of 64 prototypes (temperature 0.2, batch 32), AdamW "
        "amsgrad 1e-3 wd 1e-2, ChainedScheduler(ConstantLR 0.3 for 30 steps, ExponentialLR 0.998), 250 steps",
    ),
    "ho16_plain_infonce_lr_zero": (FROZEN, "the same with the ConstantLR factor typed 0.0 for 10,000 steps"),
    "ho16_plain_rnn_lm_cyclic2_ok": (
        HEALTHY,
        "tanh RNN LM (2 layers, 64 wide) on arithmetic sequences mod 32, Adam amsgrad, CyclicLR "
        "triangular2 5e-4..4e-3 (40 up), clip 1, batch 32, 300 steps",
    ),
    "ho16_plain_rnn_lm_corrupt": (CORRUPT, "the same, steps 150, 151 and 220's batches random tokens"),
    "ho16_plain_rprop_fullbatch_ok": (
        HEALTHY,
        "tanh MLP regressor on one fixed batch of 512 rows (full batch), Rprop (defaults), 300 steps",
    ),
    "ho16_plain_rprop_nan_input": (NAN, "the same, one input row NaN from step 150"),
    "ho16_plain_deep_mlp_explode": (
        EXPLODE,
        "8-layer ReLU MLP regressor, no normalisation, He init x1.5, SGD 5e-3 momentum 0.9, no clipping",
    ),
    # HF Trainer
    "ho16_hf_t5_reverse_cwmin_ok": (
        HEALTHY,
        "HF Trainer, T5 (d 48, 2+2 layers) reversing 12 tokens, adamw_torch 1e-3, cosine_warmup_with_min_lr "
        "(warmup 20, min 0.1), batch 16, log 1, 200 steps",
    ),
    "ho16_hf_t5_reverse_lr300x": (LR_TOO_HIGH, "the same at lr 0.3 (300x)"),
    "ho16_hf_stablelm_fused_poly_ok": (
        HEALTHY,
        "HF Trainer, StableLM 2x48 (rotary on half of each head) from scratch on arithmetic sequences, "
        "adamw_torch_fused 2e-3, polynomial power 2 (warmup 10), batch 8 x accumulation 2, log 1, 150 steps",
    ),
    # peft
    "ho16_ia3_bloom_ok": (
        HEALTHY,
        "peft IA3 (Bloom's default modules) on a pre-trained tiny Bloom, HF Trainer adamw_torch 1e-2, "
        "cosine (warmup 10), batch 8, log 1, 200 steps",
    ),
    "ho16_ia3_bloom_corrupt": (CORRUPT, "the same, steps 120 and 170's batches random tokens"),
    # Lightning, manual optimisation
    "ho16_pl_manual_glu_nadamw_ok": (
        HEALTHY,
        "Lightning manual optimisation, GLU MLP classifier (16 features, 5 classes), NAdam 2e-3 decoupled wd "
        "1e-2, ReduceLROnPlateau stepped by hand every 20 batches, batch 32, 300 steps",
    ),
    "ho16_pl_manual_glu_no_zero_grad": (NO_ZERO_GRAD, "the same with opt.zero_grad() forgotten"),
}


def run(name: str) -> None:
    """Run one held-out shape (``trainguard.init`` already called)."""
    {"plain": _plain, "hf": _hf, "ia3": _ia3, "pl": _lightning}[name.split("_")[1]](name)


def _plain(name: str) -> None:
    """The plain-loop shapes (kit.loop)."""
    family = name.split("_")[2]
    {"gncnn": _gncnn, "infonce": _infonce, "rnn": _rnn, "rprop": _rprop, "deep": _deep}[family](name)


def _gncnn(name: str) -> None:
    import torch
    import torch.nn.functional as F
    from torch import nn

    from bench.unseen import kit

    images = kit.image_batches(6, 12, 0.8, 57_001)

    def mixed() -> Tuple[Any, Any]:
        x, y = images()
        lam = float(torch.distributions.Beta(0.4, 0.4).sample())
        perm = torch.randperm(x.shape[0])
        return lam * x + (1 - lam) * x[perm], (y, y[perm], lam)

    def mix_loss(out: Any, target: Any) -> Any:
        y, y2, lam = target
        return lam * F.cross_entropy(out, y) + (1 - lam) * F.cross_entropy(out, y2)

    m = nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1),
        nn.GroupNorm(4, 16),
        nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1, stride=2),
        nn.GroupNorm(8, 32),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(32, 6),
    )
    lr = 5.0 if name.endswith("lr100x") else 0.05
    o = torch.optim.SGD(m.parameters(), lr, momentum=0.9, dampening=0.1, weight_decay=5e-4)
    s = torch.optim.lr_scheduler.MultiplicativeLR(o, lambda t: 0.996)
    kit.loop(m, o, mixed, mix_loss, 250, s)


def _infonce(name: str) -> None:
    import torch
    import torch.nn.functional as F
    from torch import nn

    from bench.unseen import kit

    protos = torch.randn(64, 24, generator=kit.seeded(57_002))

    def views(bs: int = 32) -> Tuple[Any, Any]:
        base = protos[torch.randperm(64)[:bs]]
        return torch.stack([base + 0.3 * torch.randn(bs, 24), base + 0.3 * torch.randn(bs, 24)]), None

    class Encoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = kit.mlp([24, 64, 64, 32])

        def forward(self, pair: Any) -> Any:
            return F.normalize(self.net(pair), dim=-1)

    def info_nce(z: Any, _: Any) -> Any:
        logits = z[0] @ z[1].T / 0.2
        target = torch.arange(z.shape[1])
        return (F.cross_entropy(logits, target) + F.cross_entropy(logits.T, target)) / 2

    m = Encoder()
    o = torch.optim.AdamW(m.parameters(), 1e-3, weight_decay=1e-2, amsgrad=True)
    frozen = name.endswith("lr_zero")
    warm = torch.optim.lr_scheduler.ConstantLR(
        o, factor=0.0 if frozen else 0.3, total_iters=10_000 if frozen else 30
    )
    s = torch.optim.lr_scheduler.ChainedScheduler([warm, torch.optim.lr_scheduler.ExponentialLR(o, 0.998)])
    kit.loop(m, o, views, info_nce, 250, s)


def _rnn(name: str) -> None:
    import torch
    from torch import nn

    from bench.unseen import kit

    vocab = 32
    clean = kit.lm_batches(kit.lm_rows(vocab, 25, 4, seed=57_003), bs=32)
    corrupt_at = (150, 151, 220) if name.endswith("corrupt") else ()
    step = [0]

    def batch() -> Tuple[Any, Any]:
        x, y = clean()
        step[0] += 1
        if step[0] - 1 in corrupt_at:
            noise = torch.randint(
                0, vocab, (x.shape[0], x.shape[1] + 1), generator=kit.seeded(57_004 + step[0])
            )
            return noise[:, :-1], noise[:, 1:]
        return x, y

    class TanhLM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.e, self.rnn = nn.Embedding(vocab, 16), nn.RNN(16, 64, 2, batch_first=True)
            self.o = nn.Linear(64, vocab)

        def forward(self, x: Any) -> Any:
            return self.o(self.rnn(self.e(x))[0])

    m = TanhLM()
    o = torch.optim.Adam(m.parameters(), 1e-3, amsgrad=True)
    s = torch.optim.lr_scheduler.CyclicLR(
        o, 5e-4, 4e-3, step_size_up=40, mode="triangular2", cycle_momentum=False
    )
    kit.loop(m, o, batch, kit.ce, 300, s, clip=1.0)


def _rprop(name: str) -> None:
    import torch
    import torch.nn.functional as F
    from torch import nn

    from bench.unseen import kit

    g = kit.seeded(57_005)
    x = torch.randn(512, 8, generator=g)
    y = torch.tanh(x[:, :4].sum(1)) + 0.5 * x[:, 4] * x[:, 5] + 0.05 * torch.randn(512, generator=g)
    y = y.unsqueeze(1)

    def full() -> Tuple[Any, Any]:
        return x.clone(), y

    m = kit.mlp([8, 64, 64, 1], nn.Tanh)
    nan_at = 150 if name.endswith("nan_input") else None
    kit.loop(m, torch.optim.Rprop(m.parameters()), full, F.mse_loss, 300, nan_at=nan_at)


def _deep(name: str) -> None:
    import torch
    import torch.nn.functional as F

    from bench.unseen import kit

    w = torch.randn(16, generator=kit.seeded(57_006))

    def rows(bs: int = 32) -> Tuple[Any, Any]:
        x = torch.randn(bs, 16)
        return x, (2 * torch.sin(x @ w / 3) + 0.1 * torch.randn(bs)).unsqueeze(1)

    m = kit.mlp([16] + [64] * 7 + [1])
    with torch.no_grad():
        for layer in m:
            if isinstance(layer, torch.nn.Linear):
                torch.nn.init.kaiming_normal_(layer.weight, nonlinearity="relu")
                layer.weight.mul_(1.5)
                layer.bias.zero_()
    kit.loop(m, torch.optim.SGD(m.parameters(), 5e-3, momentum=0.9), rows, F.mse_loss, 300)


def _corrupting(inner: Any, at: Sequence[int], vocab: int, seed: int) -> Any:
    """An ``nn.Module`` that hands ``inner`` (an HF model taking ``input_ids`` and ``labels``) its batch, but
    a batch of random tokens (inputs and labels alike) on the forwards numbered ``a + 1`` for ``a`` in ``at``
    (one forward per optimizer step here: steps ``at``)."""
    import torch

    from bench.unseen import kit

    class Corrupting(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner, self.forwards = inner, 0

        def forward(self, input_ids: Any, labels: Any = None) -> Any:
            if self.forwards in at:
                noise = torch.randint(0, vocab, input_ids.shape, generator=kit.seeded(seed + self.forwards))
                input_ids, labels = noise, noise.clone()
            self.forwards += 1
            return self.inner(input_ids=input_ids, labels=labels)

    return Corrupting()


def _hf(name: str) -> None:
    """The HF Trainer shapes: T5 (``t5`` in the name) or StableLM, one ``kit.hf_train`` call."""
    import torch
    import transformers as tf

    from bench.unseen import kit

    vocab = 40
    if "t5" in name:

        def row(i: int) -> Dict[str, Any]:
            ids = torch.randint(3, vocab, (12,), generator=kit.seeded(57_100 + i))
            return {"input_ids": ids, "labels": ids.flip(0)}

        sizes = dict(d_model=48, d_kv=12, d_ff=96, num_layers=2, num_decoder_layers=2, num_heads=4)
        model: Any = tf.T5ForConditionalGeneration(
            tf.T5Config(vocab_size=vocab, pad_token_id=0, decoder_start_token_id=0, eos_token_id=1, **sizes)
        )
        data, n_steps, lr = kit.Rows(100_000, row), 200, 0.3 if name.endswith("lr300x") else 1e-3
        extra: Dict[str, Any] = dict(
            optim="adamw_torch",
            lr_scheduler_type="cosine_warmup_with_min_lr",
            lr_scheduler_kwargs={"min_lr_rate": 0.1},
            warmup_steps=20,
        )
    else:
        sizes = dict(hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4)
        model = tf.StableLmForCausalLM(
            tf.StableLmConfig(
                vocab_size=vocab,
                num_key_value_heads=4,
                max_position_embeddings=32,
                partial_rotary_factor=0.5,
                **sizes,
            )
        )
        data, n_steps, lr = kit.Rows(100_000, kit.lm_rows(vocab, 32, 4, seed=57_200)), 150, 2e-3
        extra = dict(
            batch=8,
            gradient_accumulation_steps=2,
            optim="adamw_torch_fused",
            lr_scheduler_type="polynomial",
            lr_scheduler_kwargs={"power": 2.0},
            warmup_steps=10,
        )
    out_dir = f"/tmp/trainguard-heldout47-{name.split('_')[2]}"
    kit.hf_train(model, data, out_dir, n_steps, lr, logging_steps=1, **extra)


def _ia3(name: str) -> None:
    import transformers as tf
    from peft import IA3Config, get_peft_model

    from bench.unseen import kit

    vocab = 40
    base = kit.pretrained(
        tf.BloomForCausalLM(tf.BloomConfig(vocab_size=vocab, hidden_size=48, n_layer=2, n_head=4)),
        kit.lm_rows(vocab, 32, 3, seed=57_300),
    )
    model = get_peft_model(base, IA3Config(task_type="CAUSAL_LM"))
    at = (120, 170) if name.endswith("corrupt") else ()
    kit.hf_train(
        _corrupting(model, at, vocab, 57_400),
        kit.Rows(100_000, kit.lm_rows(vocab, 32, 3, seed=57_500)),
        "/tmp/trainguard-heldout47-ia3-bloom",
        200,
        1e-2,
        batch=8,
        optim="adamw_torch",
        lr_scheduler_type="cosine",
        warmup_steps=10,
        logging_steps=1,
    )


def _lightning(name: str) -> None:
    import pytorch_lightning as pl
    import torch
    import torch.nn.functional as F
    from torch import nn

    from bench.unseen import kit

    g = kit.seeded(57_600)
    w, v = torch.randn(16, 5, generator=g), torch.randn(16, 5, generator=g)

    def row(i: int) -> Any:
        x = torch.randn(16, generator=kit.seeded(57_700 + i))
        return x, int(torch.argmax(x @ w + 1.5 * torch.sin(x @ v)))

    forget = name.endswith("no_zero_grad")

    class GLU(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False
            self.net = nn.Sequential(
                nn.Linear(16, 128), nn.GLU(), nn.Linear(64, 128), nn.GLU(), nn.Linear(64, 5)
            )
            self.seen: List[float] = []

        def training_step(self, b: Any, batch_idx: int) -> Any:
            opt = self.optimizers()
            x, y = b
            loss = F.cross_entropy(self.net(x), y)
            if not forget:
                opt.zero_grad()
            self.manual_backward(loss)
            opt.step()
            self.seen.append(float(loss))
            if len(self.seen) % 20 == 0:
                self.plateau.step(sum(self.seen[-20:]) / 20)
            return loss

        def configure_optimizers(self) -> Any:
            o = torch.optim.NAdam(self.parameters(), 2e-3, weight_decay=1e-2, decoupled_weight_decay=True)
            self.plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(o, factor=0.5, patience=2)
            return o

    kit.lightning_fit(GLU(), kit.Rows(32 * 300, row), 300, batch=32)
