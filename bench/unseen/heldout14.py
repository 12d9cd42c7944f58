#!/usr/bin/env python3
"""Stop 50's HELD-OUT set of unseen training shapes (set ``heldout50``): written and committed, with its
expectations, seeds, per-fault manifestation checks and scoring, BEFORE any of it ran (a 3-step smoke at most:
TRAINGUARD_SMOKE_STEPS=3, only its recorded / FAILED lines read); recorded once (nice 19, --jobs 2); judged
once with the default ``DetectionSettings()``, summary lines only. Never tuned on.

Scoring (decided here, before recording; the form of heldout13 = heldout49). Healthy: no WARNING+ incident
open at the end (probe.py's rule). Faults: each planted fault has its own manifestation check
(:data:`MANIFEST`: heldout13's ``rose`` / ``non_finite`` / ``grad_rose`` / ``stalled``, imported, not copied),
a rule on the recorded trace (the ``loss`` the run reported and the SDK's ``grad/global_norm``, each in step
order), independent of TrainGuard's verdict. A fault is scored only when its check holds; it is right when one
of its expected kinds is among its incidents (open or resolved) and it does not end learned with an alarm
still open (probe.py's rule). ``python -m bench.unseen.heldout14 --out DIR`` prints the summary lines
(healthy right/N, faults right/scored, manifested/planted); ``python -m bench.unseen.probe --set heldout50
--rejudge`` gives probe.py's trace-rule scoring beside it (heldout50 in ``sets.JUMP_RULE``), a secondary
figure.

Expectations, from the catalogue's kinds (as heldout13): labels corrupted from a step, an LR x100 at a step
and a diverging schedule -> the 'LR too high' family, a rise after the fall or a one-step spike; Inf input /
a NaN weight -> ``loss/non_finite|gradient/nan-source``; exploding gradients ->
``gradient/explosion|loss/divergence|loss/non_finite``; a network frozen mid-run -> ``loss/plateau|
gradient/vanishing``.

16 shapes, 8 healthy / 8 planted faults. New to every earlier set (bench/unseen/*.py grepped, heldout13
included): SparseAdam on a sparse EmbeddingBag, Muon (torch.optim.Muon), SWA (swa_utils.AveragedModel +
SWALR), knowledge distillation (KL at temperature 2), an LSTMCell unrolled by hand, a Gaussian NLL loss (mean
+ variance heads), weight_norm, CosineEmbeddingLoss on a Siamese pair, a 16-block residual MLP without
normalisation (earlier sets' residual MLPs: kit.ResMLP, pre-LayerNorm), nn.MultiheadAttention (a set
classifier); HF ALBERT (with NEFTune noise and a warm-up ratio), HF BART (encoder-decoder); peft LoHa on a
pre-trained tiny GPTBigCode (multi-query); Lightning's StochasticWeightAveraging callback and a custom
freezing callback. Not new, disclosed: Adam / AdamW / SGD
momentum, CosineAnnealingWarmRestarts (heldout39 had T_mult 2; here T_mult 1), LinearLR warm-up (several),
HF cosine_with_restarts (one earlier set), the warmup-cosine factor of kit; the fault types corrupted labels
(heldout42/47/49), an LR x100 at a step (heldout49), Inf input (heldout49), a diverging schedule
(heldout49), exploding gradients without clipping (heldout45/47/49), a frozen net (LR 0: heldout42/49; here
requires_grad switched off mid-run, new), a NaN written into a weight (new).

* plain loops: a bag-of-words topic classifier (sparse EmbeddingBag + SparseAdam, AdamW head) (healthy; and
  the labels shifted by one class from step 150: a label-map bug in a new shard); a distilled student MLP
  (KL to a pre-trained teacher at T 2 + CE), SGD momentum, SWA from step 150 (healthy; and SWALR's swa_lr
  typed 2e1 for 2e-2: a diverging schedule); an LSTMCell sequence model with a Gaussian NLL (healthy; and a
  +Inf in one input sequence from step 140); a 16-block residual MLP without normalisation, SGD momentum, LR
  warmed up to 1.0 with no clipping (exploding gradients); a Siamese MLP, CosineEmbeddingLoss, Muon + AdamW
  (healthy);
* the HF Trainer: ALBERT sequence classifier, NEFTune alpha 5, linear with warm-up ratio 0.1 (healthy; and a
  callback writing NaN into one word-embedding row at step 100); BART learning a token cipher (seq2seq),
  cosine_with_restarts (healthy; and the labels random tokens from step 100);
* peft: LoHa (r 4) on a pre-trained tiny GPTBigCode, plain loop, AdamW, warm-up + cosine (healthy; and the LR
  x100 from step 100);
* Lightning: a self-attention set classifier (nn.MultiheadAttention), Adam, clip 1, the
  StochasticWeightAveraging callback from epoch 6 of 10 (healthy; and a callback that at step 30 freezes
  every parameter but the head's bias -- an unfreeze filter typed 'head.bias' for 'head.': frozen).

Every shape is seeded: ``torch.manual_seed(0)`` (bench.unseen.shapes.main) and the data seeds below (61_000+:
none used by another set).
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from bench.unseen.heldout13 import grad_rose, grad_trace, non_finite, rose, stalled
from bench.unseen.sets import HEALTHY, LR_TOO_HIGH, Expectations

RISE = LR_TOO_HIGH + "|loss/rise-after-fall|loss/spike"
"""A run hit mid-way (corrupted labels, an LR x100, a diverging schedule): the LR-too-high family, a rise
after the fall, or a one-step spike."""
NAN = "loss/non_finite|gradient/nan-source"
EXPLODE = "gradient/explosion|loss/divergence|loss/non_finite"
FROZEN = "loss/plateau|gradient/vanishing"
SET = "heldout50"

SHAPES: Expectations = {
    # plain loops
    "ho18_plain_bag_sparseadam_ok": (
        HEALTHY,
        "bag-of-words topic classifier (6 topics, vocabulary 200, 24-token documents 60 % topic words): a "
        "sparse EmbeddingBag (mean, 32 wide) under SparseAdam 1e-2, a linear head under AdamW 1e-2, "
        "batch 32, 300 steps",
    ),
    "ho18_plain_bag_sparseadam_labels_shift": (
        RISE,
        "the same, the labels shifted by one class (y + 1 mod 6) from step 150 on",
    ),
    "ho18_plain_distill_swa_ok": (
        HEALTHY,
        "student MLP 10-32-5 distilled from a pre-trained teacher MLP 10-128-128-5 (0.5 KL at T 2 x T^2 "
        "+ 0.5 CE), SGD 0.05 momentum 0.9, SWA from step 150 (AveragedModel, SWALR swa_lr 2e-2 over 20 "
        "steps), batch 64, 300 steps",
    ),
    "ho18_plain_distill_swalr_typo": (
        RISE,
        "the same, SWALR's swa_lr typed 2e1 for 2e-2: from step 150 the LR anneals up to 20",
    ),
    "ho18_plain_lstmcell_gnll_ok": (
        HEALTHY,
        "LSTMCell (32) unrolled over 24 steps of noisy sines (random frequency / phase, noise 0.05-0.3), a "
        "weight_norm head giving mean and variance, GaussianNLLLoss (full), Adam 3e-3, "
        "CosineAnnealingWarmRestarts(T_0 50, eta_min 1e-4), batch 32, 250 steps",
    ),
    "ho18_plain_lstmcell_inf_input": (NAN, "the same, one input sequence with a +Inf value from step 140 on"),
    "ho18_plain_resmlp_noclip_explode": (
        EXPLODE,
        "16 residual blocks h + W2 relu(W1 h), 64 wide, no normalisation, regression, SGD momentum 0.9 with "
        "LinearLR from 1e-4 x 1.0 up to 1.0 over 150 steps, no clipping, batch 32, 250 steps",
    ),
    "ho18_plain_siamese_muon_ok": (
        HEALTHY,
        "Siamese MLP encoder 16-64-64-16 on pairs of noisy prototype vectors (8 classes, half the pairs "
        "same-class), CosineEmbeddingLoss margin 0.2, Muon 0.02 on the 2-D weights + AdamW 3e-3 on the "
        "biases, batch 64, 250 steps",
    ),
    # HF Trainer
    "ho18_hf_albert_neftune_ok": (
        HEALTHY,
        "HF Trainer, ALBERT sequence classifier (embedding 16, hidden 48, 2 shared layers, 4 heads) on "
        "token sequences of 4 classes (half the tokens from the class's own range), adamw_torch 2e-3, linear "
        "with a warm-up ratio 0.1 (warmup_steps 0.1), NEFTune noise alpha 5, batch 16, log 1, 200 steps",
    ),
    "ho18_hf_albert_nan_weight": (
        NAN,
        "the same, a callback writes NaN into one word-embedding row (token 7) at step 100",
    ),
    "ho18_hf_bart_cipher_ok": (
        HEALTHY,
        "HF Trainer, BART (d_model 48, 2 + 2 layers, 4 heads) mapping 10-token sequences to their shift "
        "cipher (t -> t + 1 within 3..23), adamw_torch 3e-3, cosine_with_restarts (2 cycles, warmup 15), "
        "batch 16, log 1, 200 steps",
    ),
    "ho18_hf_bart_labels_random": (RISE, "the same, the labels random tokens from step 100 on"),
    # peft
    "ho18_loha_bigcode_ok": (
        HEALTHY,
        "peft LoHa (r 4, alpha 8, c_attn / c_fc) on a pre-trained tiny GPTBigCode (multi-query, 48 wide, 2 "
        "layers) fine-tuned on new strides, plain loop, AdamW 5e-3, warm-up 10 + cosine, batch 16, 200 steps",
    ),
    "ho18_loha_bigcode_lr100x": (RISE, "the same, the LR x100 from step 100 on"),
    # Lightning
    "ho18_pl_setattn_swa_ok": (
        HEALTHY,
        "Lightning, a set classifier (12 2-D points from one of 4 shapes; Linear, nn.MultiheadAttention "
        "self-attention, mean pool, Linear head), Adam 3e-3, clip 1, StochasticWeightAveraging from epoch 6 "
        "of 10 (swa_lrs 1e-3), 25 batches of 32 an epoch, 250 steps",
    ),
    "ho18_pl_setattn_frozen": (
        FROZEN,
        "the same, a callback that at step 30 sets requires_grad off on every parameter but 'head.bias' (an "
        "unfreeze filter typed for 'head.'): frozen from step 30",
    ),
}

MANIFEST: Dict[str, Callable[[Sequence[float], Sequence[float]], bool]] = {
    "ho18_plain_bag_sparseadam_labels_shift": rose(150),
    "ho18_plain_distill_swalr_typo": rose(150),
    "ho18_plain_lstmcell_inf_input": non_finite(140),
    "ho18_plain_resmlp_noclip_explode": grad_rose(),
    "ho18_hf_albert_nan_weight": non_finite(99),
    "ho18_hf_bart_labels_random": rose(99),
    "ho18_loha_bigcode_lr100x": rose(100),
    "ho18_pl_setattn_frozen": stalled(30),
}
"""Each planted fault's manifestation check (decided before the set ran), on (loss, grad norm) traces."""

# ------------------------------------------------------------------------------------ trainings


def run(name: str) -> None:
    """Run one held-out shape (``trainguard.init`` already called)."""
    part = name.split("_")
    if part[1] == "plain":
        {"bag": _bag, "distill": _distill, "lstmcell": _lstmcell, "resmlp": _resmlp, "siamese": _siamese}[
            part[2]
        ](name)
    elif part[1] == "hf":
        {"albert": _albert, "bart": _bart}[part[2]](name)
    else:
        {"loha": _loha, "pl": _lightning}[part[1]](name)


def two_optimizers(
    model: Any, opts: Sequence[Any], batch: Callable[[], Tuple[Any, Any]], loss_fn: Callable[..., Any], n: int
) -> None:
    """A plain loop stepping several optimizers (the first one watched; its LR reported); stops at the
    first non-finite loss."""
    import torch

    import trainguard
    from bench.unseen import kit

    trainguard.watch(model, opts[0])
    for step in range(kit.steps(n)):
        for o in opts:
            o.zero_grad(set_to_none=True)
        x, y = batch()
        loss = loss_fn(model(x), y)
        loss.backward()
        for o in opts:
            o.step()
        value = float(loss.detach().to(torch.float32))
        trainguard.log(step=step, loss=value, lr=opts[0].param_groups[0]["lr"])
        if not math.isfinite(value):
            break


def _bag(name: str) -> None:
    import torch
    import torch.nn.functional as F
    from torch import nn

    g = torch.Generator().manual_seed(61_001)
    own = torch.randperm(200, generator=g)[:120].reshape(6, 20)
    shift_from = 150 if name.endswith("labels_shift") else None
    at = [0]

    def batch() -> Tuple[Any, Any]:
        y = torch.randint(0, 6, (32,))
        words = torch.where(
            torch.rand(32, 24) < 0.6, own[y][:, torch.randint(0, 20, (24,))], torch.randint(0, 200, (32, 24))
        )
        if shift_from is not None and at[0] >= shift_from:
            y = (y + 1) % 6
        at[0] += 1
        return words, y

    class Bag(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bag, self.head = nn.EmbeddingBag(200, 32, mode="mean", sparse=True), nn.Linear(32, 6)

        def forward(self, words: Any) -> Any:
            return self.head(self.bag(words))

    m = Bag()
    opts = [
        torch.optim.SparseAdam(list(m.bag.parameters()), 1e-2),
        torch.optim.AdamW(m.head.parameters(), 1e-2),
    ]
    two_optimizers(m, opts, batch, F.cross_entropy, 300)


def _distill(name: str) -> None:
    import torch
    import torch.nn.functional as F

    from bench.unseen import kit

    g = kit.seeded(61_002)
    proj, mix = torch.randn(10, 16, generator=g), torch.randn(16, 5, generator=g)

    def batch(bs: int = 64) -> Tuple[Any, Any]:
        x = torch.randn(bs, 10)
        return x, (torch.tanh(x @ proj) @ mix + 0.5 * torch.randn(bs, 5)).argmax(1)

    teacher = kit.mlp([10, 128, 128, 5])
    t_opt = torch.optim.Adam(teacher.parameters(), 3e-3)
    for _ in range(300):
        x, y = batch()
        t_opt.zero_grad()
        F.cross_entropy(teacher(x), y).backward()
        t_opt.step()
    teacher.eval()
    student = kit.mlp([10, 32, 5])
    at: Dict[str, Any] = {}

    def loss_fn(out: Any, y: Any) -> Any:
        with torch.no_grad():
            soft = F.softmax(teacher(at["x"]) / 2, 1)
        kl = F.kl_div(F.log_softmax(out / 2, 1), soft, reduction="batchmean") * 4
        return 0.5 * kl + 0.5 * F.cross_entropy(out, y)

    def remembered() -> Tuple[Any, Any]:
        at["x"], y = batch()
        return at["x"], y

    o = torch.optim.SGD(student.parameters(), 0.05, momentum=0.9)
    swa_lr = 2e1 if name.endswith("swalr_typo") else 2e-2
    kit.loop(student, o, remembered, loss_fn, 300, SWA(student, o, swa_lr, start=150))


class SWA:
    """A scheduler-like ``step()``: from optimizer step ``start`` on, SWALR(``swa_lr``, 20 annealing steps)
    and an AveragedModel of ``model`` updated after every step (kept, never evaluated here)."""

    def __init__(self, model: Any, opt: Any, swa_lr: float, start: int) -> None:
        from torch.optim.swa_utils import SWALR, AveragedModel

        self.model, self.average = model, AveragedModel(model)
        self.sched, self.start, self.done = SWALR(opt, swa_lr, anneal_epochs=20), start, 0

    def step(self) -> None:
        self.done += 1
        if self.done >= self.start:
            self.average.update_parameters(self.model)
            self.sched.step()


def _lstmcell(name: str) -> None:
    import torch
    from torch import nn

    from bench.unseen import kit

    inf_from = 140 if name.endswith("inf_input") else None
    at = [0]

    def batch(bs: int = 32) -> Tuple[Any, Any]:
        t = torch.arange(25.0)
        freq, phase = 0.2 + 0.6 * torch.rand(bs, 1), 6.3 * torch.rand(bs, 1)
        noise = 0.05 + 0.25 * torch.rand(bs, 1)
        seq = torch.sin(freq * t + phase) + noise * torch.randn(bs, 25)
        x = seq[:, :-1].clone()
        if inf_from is not None and at[0] >= inf_from:
            x[0, 12] = float("inf")
        at[0] += 1
        return x, seq[:, 1:]

    class Cell(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.cell = nn.LSTMCell(1, 32)
            self.head = nn.utils.parametrizations.weight_norm(nn.Linear(32, 2))

        def forward(self, x: Any) -> Any:
            h = c = torch.zeros(x.shape[0], 32)
            outs = []
            for i in range(x.shape[1]):
                h, c = self.cell(x[:, i : i + 1], (h, c))
                outs.append(self.head(h))
            return torch.stack(outs, 1)

    nll = nn.GaussianNLLLoss(full=True)

    def loss_fn(out: Any, y: Any) -> Any:
        return nll(out[..., 0], y, nn.functional.softplus(out[..., 1]) + 1e-3)

    m = Cell()
    o = torch.optim.Adam(m.parameters(), 3e-3)
    s = torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(o, T_0=50, eta_min=1e-4)
    kit.loop(m, o, batch, loss_fn, 250, s)


def _resmlp(name: str) -> None:
    import torch
    import torch.nn.functional as F
    from torch import nn

    from bench.unseen import kit

    w = torch.randn(8, generator=kit.seeded(61_004))

    class Res(nn.Module):
        """Linear in, 16 blocks ``h + W2 relu(W1 h)`` (no normalisation), Linear out."""

        def __init__(self) -> None:
            super().__init__()
            self.i, self.o = nn.Linear(8, 64), nn.Linear(64, 1)
            self.b = nn.ModuleList(kit.mlp([64, 64, 64]) for _ in range(16))

        def forward(self, x: Any) -> Any:
            h = self.i(x)
            for block in self.b:
                h = h + block(h)
            return self.o(h)

    def batch() -> Tuple[Any, Any]:
        x = torch.randn(32, 8)
        return x, (torch.sin(x @ w) + 0.1 * torch.randn(32)).unsqueeze(1)

    m = Res()
    o = torch.optim.SGD(m.parameters(), 1.0, momentum=0.9)
    s = torch.optim.lr_scheduler.LinearLR(o, 1e-4, 1.0, total_iters=150)
    kit.loop(m, o, batch, F.mse_loss, 250, s)


def _siamese(name: str) -> None:
    import torch
    from torch import nn

    from bench.unseen import kit

    protos = torch.randn(8, 16, generator=kit.seeded(61_005))

    def batch(bs: int = 64) -> Tuple[Any, Any]:
        a = torch.randint(0, 8, (bs,))
        same = torch.rand(bs) < 0.5
        b = torch.where(same, a, (a + torch.randint(1, 8, (bs,))) % 8)
        pair = torch.stack([protos[a], protos[b]], 1) + 0.6 * torch.randn(bs, 2, 16)
        return pair, same.float() * 2 - 1

    class Siamese(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.enc = kit.mlp([16, 64, 64, 16])

        def forward(self, pair: Any) -> Any:
            return self.enc(pair[:, 0]), self.enc(pair[:, 1])

    m = Siamese()
    embedding = nn.CosineEmbeddingLoss(margin=0.2)
    matrices = [p for p in m.parameters() if p.ndim == 2]
    opts = [
        torch.optim.Muon(matrices, 0.02, weight_decay=0.01),
        torch.optim.AdamW([p for p in m.parameters() if p.ndim != 2], 3e-3),
    ]
    two_optimizers(m, opts, batch, lambda out, y: embedding(out[0], out[1], y), 250)


def _albert(name: str) -> None:
    import torch
    import transformers as tf
    from transformers import TrainerCallback

    from bench.unseen import kit

    def row(i: int) -> Dict[str, Any]:
        g = kit.seeded(61_100 + i)
        y = int(torch.randint(0, 4, (1,), generator=g))
        own = 4 + 9 * y + torch.randint(0, 9, (20,), generator=g)
        anyone = torch.randint(4, 40, (20,), generator=g)
        ids = torch.where(torch.rand(20, generator=g) < 0.5, own, anyone)
        return {"input_ids": ids, "labels": y}

    class NaNRow(TrainerCallback):  # type: ignore[misc]
        """At optimizer step 100, NaN into the word-embedding row of token 7."""

        def on_step_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any) -> None:
            if state.global_step == 100 and model is not None:
                with torch.no_grad():
                    model.get_input_embeddings().weight[7] = float("nan")

    config = tf.AlbertConfig(
        vocab_size=40,
        embedding_size=16,
        hidden_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=96,
        max_position_embeddings=32,
        num_labels=4,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    kit.hf_train(
        tf.AlbertForSequenceClassification(config),
        kit.Rows(100_000, row),
        "/tmp/trainguard-heldout50-albert",
        200,
        2e-3,
        callbacks=[NaNRow()] if name.endswith("nan_weight") else [],
        optim="adamw_torch",
        lr_scheduler_type="linear",
        warmup_steps=0.1,  # a ratio of the run (transformers 5: warmup_ratio folded into warmup_steps)
        neftune_noise_alpha=5.0,
        logging_steps=1,
    )


def _bart(name: str) -> None:
    import torch
    import transformers as tf

    from bench.unseen import kit

    def row(i: int) -> Dict[str, Any]:
        ids = torch.randint(3, 24, (10,), generator=kit.seeded(61_200 + i))
        return {"input_ids": ids, "labels": 3 + (ids - 3 + 1) % 21}

    config = tf.BartConfig(
        vocab_size=24,
        d_model=48,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=96,
        decoder_ffn_dim=96,
        max_position_embeddings=16,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        decoder_start_token_id=2,
        forced_eos_token_id=None,
        dropout=0.0,
    )
    model = tf.BartForConditionalGeneration(config)
    if name.endswith("labels_random"):
        calls = [0]

        def random_labels(module: Any, args: Any, kwargs: Dict[str, Any]) -> Any:
            """From forward 100 on, the labels are random tokens."""
            calls[0] += 1
            if calls[0] > 100 and kwargs.get("labels") is not None:
                shape = kwargs["labels"].shape
                kwargs["labels"] = torch.randint(3, 24, shape, generator=kit.seeded(61_300 + calls[0]))
            return args, kwargs

        model.register_forward_pre_hook(random_labels, with_kwargs=True)

    kit.hf_train(
        model,
        kit.Rows(100_000, row),
        "/tmp/trainguard-heldout50-bart",
        200,
        3e-3,
        optim="adamw_torch",
        lr_scheduler_type="cosine_with_restarts",
        lr_scheduler_kwargs={"num_cycles": 2},
        warmup_steps=15,
        logging_steps=1,
    )


def _loha(name: str) -> None:
    import torch
    import transformers as tf
    from peft import LoHaConfig, get_peft_model

    from bench.unseen import kit

    vocab = 40
    config = tf.GPTBigCodeConfig(
        vocab_size=vocab, n_embd=48, n_layer=2, n_head=4, n_positions=32, multi_query=True
    )
    base = kit.pretrained(tf.GPTBigCodeForCausalLM(config), kit.lm_rows(vocab, 32, 3, seed=61_400))
    model = kit.HFLogits(get_peft_model(base, LoHaConfig(r=4, alpha=8, target_modules=["c_attn", "c_fc"])))
    factor = kit.warmup_cosine(10, 200)
    jump = 100.0 if name.endswith("lr100x") else 1.0
    o = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], 5e-3)
    kit.loop(
        model,
        o,
        kit.lm_batches(kit.lm_rows(vocab, 32, 6, seed=61_500)),
        kit.ce,
        200,
        lr_at=lambda t: 5e-3 * factor(t) * (jump if t >= 100 else 1.0),
    )


def _lightning(name: str) -> None:
    import pytorch_lightning as pl
    import torch
    import torch.nn.functional as F
    from torch import nn

    from bench.unseen import kit

    def row(i: int) -> Any:
        g = kit.seeded(61_600 + i)
        y = int(torch.randint(0, 4, (1,), generator=g))
        t = 6.2832 * torch.rand(12, generator=g)
        u = 2 * torch.rand(12, generator=g) - 1
        points = [
            torch.stack([torch.cos(t), torch.sin(t)], 1),
            torch.stack([u, torch.sign(torch.rand(12, generator=g) - 0.5)], 1),
            torch.stack([u, 0.5 * u], 1),
            0.3 * torch.randn(12, 2, generator=g),
        ][y]
        return points + 0.1 * torch.randn(12, 2, generator=g), y

    class SetNet(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Linear(2, 32)
            self.attn = nn.MultiheadAttention(32, 4, batch_first=True)
            self.mix, self.head = kit.mlp([32, 32, 32], nn.GELU), nn.Linear(32, 4)

        def training_step(self, b: Any, batch_idx: int) -> Any:
            x, y = b
            h = self.embed(x)
            h = h + self.attn(h, h, h, need_weights=False)[0]
            return F.cross_entropy(self.head(self.mix(h).mean(1)), y)

        def configure_optimizers(self) -> Any:
            return torch.optim.Adam(self.parameters(), 3e-3)

        def configure_callbacks(self) -> Any:
            swa = pl.callbacks.StochasticWeightAveraging(swa_lrs=1e-3, swa_epoch_start=6)
            return [swa, TypoUnfreeze()] if name.endswith("frozen") else [swa]

    class TypoUnfreeze(pl.Callback):
        """At step 30, every parameter frozen but those named ``*head.bias``."""

        def on_train_batch_start(self, trainer: Any, module: Any, *args: Any) -> None:
            if trainer.global_step == 30:
                for n, p in module.named_parameters():
                    p.requires_grad_(n.endswith("head.bias"))

    kit.lightning_fit(SetNet(), kit.Rows(32 * 25, row), 250, batch=32, gradient_clip_val=1.0, max_epochs=10)


# ----------------------------------------------------------------------------------------- scoring


def summary(
    out: Path,
    set_name: str = SET,
    shapes: Optional[Expectations] = None,
    manifest: Optional[Dict[str, Callable[[Sequence[float], Sequence[float]], bool]]] = None,
) -> List[str]:
    """The summary lines for the recorded set ``set_name`` in ``out`` (its ``shapes`` and per-fault checks
    ``manifest``; default: this set's): healthy right/N (and perf/* left out), faults right/scored by the
    per-fault checks (and perf/* left out), manifested/planted. Any set with a ``MANIFEST`` can use it."""
    from bench.corpus.evaluate import read_events
    from bench.unseen import probe

    checks = manifest or MANIFEST
    rows = {
        "healthy": [0, 0],
        "healthy (perf/* left out)": [0, 0],
        "faults (per-fault checks)": [0, 0],
        "faults (perf/* left out)": [0, 0],
    }
    planted = shown = 0
    for name, (expected, _) in (shapes or SHAPES).items():
        if not (out / f"{name}.jsonl").exists():
            continue
        v: Dict[str, Any] = probe.verdict(name, out, set_name)
        if expected == HEALTHY:
            marks = [bool(v["right"]), bool(v["right_but_perf"]), None, None]
        else:
            planted += 1
            events = read_events(out / f"{name}.jsonl")
            if not checks[name](probe.loss_trace(events), grad_trace(events)):
                continue
            shown += 1
            found = bool({str(k).split(":")[0] for k in v["incidents"]} & set(expected.split("|")))
            opened = [str(k) for k in v["open_alerts"]]
            stale = [
                bool(v["learned"] and [k for k in opened if not (skip and k.startswith("perf/"))])
                for skip in (False, True)
            ]
            marks = [None, None, found and not stale[0], found and not stale[1]]
        for row, mark in zip(rows.values(), marks):
            if mark is not None:
                row[0], row[1] = row[0] + mark, row[1] + 1
    lines = [f"summary {label}: {k}/{n} right" for label, (k, n) in rows.items()]
    return [*lines, f"summary manifested: {shown}/{planted} planted"]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="heldout50's summary (per-fault checks)")
    parser.add_argument("--out", type=Path, required=True, help="the recorded streams (probe.py --out)")
    print("\n".join(summary(parser.parse_args().out)))
