"""The trainings of the varied corpus: one :class:`~bench.corpus.manifest.RunSpec` -> one real, seeded CPU run
with the TrainGuard SDK attached the way a careful user attaches it, plus its ground-truth trace.

Model families (all tiny, so a run takes a second or two on one core):

* ``mlp``  -- regression on a fixed random teacher (``tanh`` MLP) with label noise; MSE.
* ``cnn``  -- 12x12 one-channel images labelled by a fixed random conv teacher (4 classes); cross-entropy.
* ``gpt``  -- a 2-layer GPT-2 (``transformers.GPT2LMHeadModel`` from a ``GPT2Config``) on tokens of a fixed
  random Markov chain (64 tokens, 4 successors each); its own LM loss.
* ``lora`` -- the same GPT-2, pre-trained for 80 steps on another chain, then frozen, with ``peft`` LoRA
  adapters on ``c_attn`` and ``c_fc`` fine-tuned on the task's chain.
* ``deep`` -- a 16-24-layer sigmoid MLP (default init) on the ``mlp`` task.
* ``linear`` -- softmax regression on four Gaussian blobs with 10 % flipped labels.
* ``huber`` -- (batch 11) the ``mlp`` model and teacher (its output doubled) with heavy-tailed label noise
  (0.3 x Student-t, 2 degrees of freedom) and a Huber loss (``smooth_l1_loss``): the loss's gradient is
  bounded, so an LR ~60-300x too high (SGD family; Adam ~100-500x) keeps the loss swinging around its start
  without blowing up -- a wide band that stops learning but does not diverge, which the tiny tasks above lack.

Frameworks: ``plain`` (the usual loop: ``trainguard.watch(model, optimizer, clip=...)``,
``trainguard.log(step=, loss=, lr=)``, ``clip_grad_norm_`` where clipping is on, bf16 ``autocast`` on some
runs, ``watch_lora`` for LoRA), ``hf`` (the real ``transformers.Trainer`` with
``trainguard.integrations.transformers.TrainGuardCallback``, ``logging_steps=1``, its default
``max_grad_norm=1.0``) and ``lightning`` (the real ``pytorch_lightning.Trainer`` with
``trainguard.integrations.lightning.TrainGuardCallback``, ``gradient_clip_val`` where clipping is on).
Every framework gets its optimiser (SGD, SGD with momentum, Adam, AdamW; batch 5 also RMSprop and Adagrad)
and a ``LambdaLR`` of the spec's schedule from this module (batch 5 adds OneCycle's shape, a linear warmup
with a linear decay, and ``jump_up``: the LR raised 10-100x at 45 % of the run; batch 7 adds NAdam, RAdam,
Adamax and SGD with Nesterov momentum, and SGDR cosine restarts, inverse-sqrt with warmup, polynomial and
exponential decay; batch 8 adds ``cyclic``, CyclicLR's triangular shape; batch 10 adds ``jump_mid``, a
mid-run LR jump of only 1.5-10x).

Planted causes (``spec.cause``; nothing is injected into the SDK's data, everything happens in the training):
see ``manifest.CAUSES``. ``variant`` picks among the ways a cause is planted (e.g. LoRA: alpha 0, A and B
zero, dropout 1.0).

The ground truth (``truth`` of :func:`run`): per optimizer step the loss, the **pre-clip** global gradient
norm, the LR, and the first and last layers' gradient norms -- computed beside the SDK from the same
tensors (``torch.nn.utils.get_total_norm`` before clipping; HF: the ``grad_norm`` its ``clip_grad_norm_``
returned; Lightning: ``on_before_optimizer_step``, which runs before its clipping).
"""

from __future__ import annotations

import math
import tempfile
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

import trainguard

from .manifest import RunSpec

Truth = Dict[str, List[float]]

SANE_LR: Dict[str, Dict[str, float]] = {
    "mlp": {"sgd": 0.05, "sgdm": 0.02, "adam": 3e-3, "adamw": 3e-3, "rmsprop": 1e-3, "adagrad": 0.05,
            "nadam": 3e-3, "radam": 3e-3, "adamax": 6e-3, "nesterov": 0.02},
    "cnn": {"sgd": 0.3, "sgdm": 0.05, "adam": 3e-3, "adamw": 3e-3, "rmsprop": 1e-3, "adagrad": 0.05,
            "nadam": 3e-3, "radam": 3e-3, "adamax": 6e-3, "nesterov": 0.05},
    "linear": {"sgd": 0.5, "sgdm": 0.1, "adam": 1e-2, "adamw": 1e-2, "rmsprop": 3e-3, "adagrad": 0.1,
               "nadam": 1e-2, "radam": 1e-2, "adamax": 2e-2, "nesterov": 0.1},
    "gpt": {"sgd": 0.5, "sgdm": 0.1, "adam": 3e-3, "adamw": 3e-3, "rmsprop": 1e-3, "adagrad": 0.05,
            "nadam": 3e-3, "radam": 3e-3, "adamax": 6e-3, "nesterov": 0.1},
    "lora": {"sgd": 0.5, "sgdm": 0.1, "adam": 1e-2, "adamw": 1e-2, "rmsprop": 3e-3, "adagrad": 0.05,
             "nadam": 1e-2, "radam": 1e-2, "adamax": 2e-2, "nesterov": 0.1},
    "huber": {"sgd": 0.05, "sgdm": 0.01, "adam": 3e-3, "adamw": 3e-3, "rmsprop": 1e-3, "adagrad": 0.05,
              "nadam": 3e-3, "radam": 3e-3, "adamax": 6e-3, "nesterov": 0.01},
    "deep": {"sgd": 0.5, "sgdm": 0.2, "adam": 1e-3, "adamw": 1e-3, "rmsprop": 5e-4, "adagrad": 0.05,
             "nadam": 1e-3, "radam": 1e-3, "adamax": 2e-3, "nesterov": 0.2},
}
"""An LR each family learns well with, per optimiser (``spec.lr_scale`` multiplies it). Batch 7 adds NAdam,
RAdam, Adamax (about Adam's LR; Adamax twice it, its documented default being 2e-3 to Adam's 1e-3) and SGD
with Nesterov momentum (SGD-momentum's LR)."""

VOCAB, SEQ = 64, 32
DIM_IN = 16


# ------------------------------------------------------------------------------------------------ data


class Task:
    """A family's data: ``batch(step)`` -> the step's (inputs, targets), seeded, with the cause's bad rows."""

    def __init__(self, spec: RunSpec) -> None:
        self.spec = spec
        self.gen = torch.Generator().manual_seed(spec.seed)
        self.bad_step = -1
        self.spike_steps: Tuple[int, ...] = ()
        g = torch.Generator().manual_seed(spec.seed + 1)
        if spec.cause == "nan_data":
            self.bad_step = int(spec.steps * (0.3 + 0.5 * torch.rand(1, generator=g).item()))
        if spec.cause == "healthy_spike":
            picks = torch.randperm(spec.steps - 40, generator=g)[:3] + 30
            self.spike_steps = tuple(sorted(int(p) for p in picks))
        self._build(g)

    def _build(self, g: torch.Generator) -> None:
        family = self.spec.family
        if family in ("mlp", "deep"):
            self.w1 = torch.randn(DIM_IN, 32, generator=g) / math.sqrt(DIM_IN)
            self.w2 = torch.randn(32, 1, generator=g) / math.sqrt(32)
        elif family == "cnn":
            self.conv = torch.randn(4, 1, 5, 5, generator=g)
        elif family == "huber":
            self.w1 = torch.randn(DIM_IN, 32, generator=g) / math.sqrt(DIM_IN)
            self.w2 = torch.randn(32, 1, generator=g) / math.sqrt(32)
        elif family == "linear":
            self.centres = 1.5 * torch.randn(4, DIM_IN, generator=g)
        else:  # gpt, lora: a Markov chain, 4 successors per token
            self.next = torch.randint(0, VOCAB, (VOCAB, 4), generator=g)

    def batch(self, step: int) -> Tuple[torch.Tensor, torch.Tensor]:
        b, family, gen = self.spec.batch, self.spec.family, self.gen
        if family in ("mlp", "deep"):
            x = torch.randn(b, DIM_IN, generator=gen)
            y = torch.tanh(x @ self.w1) @ self.w2 + 0.1 * torch.randn(b, 1, generator=gen)
            if step in self.spike_steps:
                y = y * 12.0  # an outlier batch: big but finite targets
            if step == self.bad_step:
                if self.spec.variant % 2 == 0:
                    x[0, 3] = float("inf")  # a corrupted feature
                else:
                    y[0, 0] = float("-inf")  # the log-target of a zero label: log(0)
            return x, y
        if family == "huber":  # the mlp task's teacher with heavy-tailed (Student-t, 2 dof) label noise
            x = torch.randn(b, DIM_IN, generator=gen)
            z = torch.randn(b, 3, generator=gen)
            noise = z[:, :1] / torch.sqrt((z[:, 1:] ** 2).mean(dim=1, keepdim=True) + 1e-12)
            return x, 2.0 * torch.tanh(x @ self.w1) @ self.w2 + 0.3 * noise
        if family == "linear":  # Gaussian blobs around 4 centres, 10 % of the labels flipped
            y = torch.randint(0, 4, (b,), generator=gen)
            x = self.centres[y] + torch.randn(b, DIM_IN, generator=gen)
            flip = torch.rand(b, generator=gen) < 0.1
            y = torch.where(flip, torch.randint(0, 4, (b,), generator=gen), y)
            return x, y
        if family == "cnn":
            x = torch.randn(b, 1, 12, 12, generator=gen)
            logits = torch.nn.functional.conv2d(x, self.conv).mean(dim=(2, 3))
            y = logits.argmax(dim=1)
            if step in self.spike_steps:
                x = x * 8.0
            if step == self.bad_step:
                x[0, 0, 5, 5] = float("inf")
            return x, y
        start = torch.randint(0, VOCAB, (b,), generator=gen)
        choice = torch.randint(0, 4, (b, SEQ), generator=gen)
        ids = torch.empty(b, SEQ, dtype=torch.long)
        ids[:, 0] = start
        for t in range(1, SEQ):
            ids[:, t] = self.next[ids[:, t - 1], choice[:, t]]
        if step in self.spike_steps:
            ids[: max(1, b // 2)] = torch.randint(
                0, VOCAB, (max(1, b // 2), SEQ), generator=gen
            )  # noise rows
        return ids, ids


# ---------------------------------------------------------------------------------------------- models


class Regressor(nn.Module):
    """An MLP (or the deep sigmoid one) with an MSE loss, callable the way the HF Trainer calls models."""

    def __init__(self, spec: RunSpec) -> None:
        super().__init__()
        self.huber = spec.family == "huber"  # batch 11: the Huber loss (heavy-tailed targets)
        if spec.family == "deep":
            depth = (16, 20, 24)[spec.variant]
            layers: List[nn.Module] = []
            width = DIM_IN
            for _ in range(depth):
                layers += [nn.Linear(width, 32), nn.Sigmoid()]
                width = 32
            layers.append(nn.Linear(32, 1))
            self.net = nn.Sequential(*layers)
        else:
            self.net = nn.Sequential(
                nn.Linear(DIM_IN, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1)
            )
            if spec.cause == "dead_relu":
                with torch.no_grad():
                    for layer in [m for m in self.net if isinstance(m, nn.Linear)][:-1]:
                        layer.bias.fill_((-10.0, -5.0, -8.0)[spec.variant])  # every hidden unit dead

    def forward(self, x: torch.Tensor, y: Optional[torch.Tensor] = None) -> Dict[str, torch.Tensor]:
        out = self.net(x).float()
        if y is None:
            return {"loss": out.sum()}
        fn = nn.functional.smooth_l1_loss if self.huber else nn.functional.mse_loss
        return {"loss": fn(out, y.float())}


class Classifier(nn.Module):
    """The CNN (or, for ``linear``, softmax regression) with a cross-entropy loss."""

    def __init__(self, spec: RunSpec) -> None:
        super().__init__()
        if spec.family == "linear":
            self.net: nn.Module = nn.Linear(DIM_IN, 4)
            return
        self.net = nn.Sequential(
            nn.Conv2d(1, 8, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(8, 16, 3, stride=2),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(16, 4),
        )

    def forward(self, x: torch.Tensor, y: Optional[torch.Tensor] = None) -> Dict[str, torch.Tensor]:
        logits = self.net(x).float()
        loss = nn.functional.cross_entropy(logits, y) if y is not None else logits.sum()
        return {"loss": loss}


class LM(nn.Module):
    """The GPT-2 (and LoRA on it), returning ``{"loss"}`` for ``(input_ids, labels)``."""

    def __init__(self, spec: RunSpec) -> None:
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel

        torch.manual_seed(spec.seed + 2)
        config = GPT2Config(
            vocab_size=VOCAB,
            n_positions=SEQ,
            n_embd=32,
            n_layer=2,
            n_head=2,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )
        base = GPT2LMHeadModel(config)
        if spec.family == "lora":
            _pretrain(base, spec)
            from peft import LoraConfig, get_peft_model

            dead = spec.cause == "lora_dead"
            lora = LoraConfig(
                r=8,
                lora_alpha=0 if dead and spec.variant == 0 else 16,
                lora_dropout=1.0 if dead and spec.variant == 2 else 0.0,
                target_modules=["c_attn", "c_fc"],
                fan_in_fan_out=True,
            )
            base = get_peft_model(base, lora)
            if dead and spec.variant == 1:
                with torch.no_grad():
                    for name, p in base.named_parameters():
                        if "lora_A" in name:
                            p.zero_()  # A and B both zero: neither gets a gradient
        self.model = base

    def forward(
        self, input_ids: torch.Tensor, labels: Optional[torch.Tensor] = None
    ) -> Dict[str, torch.Tensor]:
        out = self.model(input_ids=input_ids, labels=labels)
        return {"loss": out.loss.float() if out.loss is not None else out.logits.sum()}


def _pretrain(model: nn.Module, spec: RunSpec, steps: int = 80) -> None:
    """Give the LoRA base something to know: 80 Adam steps on another Markov chain than the fine-tune's."""
    chain = torch.randint(0, VOCAB, (VOCAB, 4), generator=torch.Generator().manual_seed(spec.seed + 7))
    gen = torch.Generator().manual_seed(spec.seed + 8)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(steps):
        ids = torch.empty(32, SEQ, dtype=torch.long)
        ids[:, 0] = torch.randint(0, VOCAB, (32,), generator=gen)
        choice = torch.randint(0, 4, (32, SEQ), generator=gen)
        for t in range(1, SEQ):
            ids[:, t] = chain[ids[:, t - 1], choice[:, t]]
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.zero_grad(set_to_none=True)


def build_model(spec: RunSpec) -> nn.Module:
    torch.manual_seed(spec.seed + 3)
    if spec.family in ("mlp", "deep", "huber"):
        return Regressor(spec)
    if spec.family in ("cnn", "linear"):
        return Classifier(spec)
    return LM(spec)


# ------------------------------------------------------------------------------- optimiser and schedule


def base_lr(spec: RunSpec) -> float:
    return SANE_LR[spec.family][spec.optimizer] * spec.lr_scale


def make_optimizer(spec: RunSpec, params: Any) -> torch.optim.Optimizer:
    lr = base_lr(spec)
    params = [p for p in params if p.requires_grad]
    if spec.optimizer == "sgd":
        return torch.optim.SGD(params, lr=lr)
    if spec.optimizer == "sgdm":
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    if spec.optimizer == "adam":
        return torch.optim.Adam(params, lr=lr)
    if spec.optimizer == "rmsprop":
        return torch.optim.RMSprop(params, lr=lr)
    if spec.optimizer == "adagrad":
        return torch.optim.Adagrad(params, lr=lr)
    if spec.optimizer == "nadam":
        return torch.optim.NAdam(params, lr=lr)
    if spec.optimizer == "radam":
        return torch.optim.RAdam(params, lr=lr)
    if spec.optimizer == "adamax":
        return torch.optim.Adamax(params, lr=lr)
    if spec.optimizer == "nesterov":
        return torch.optim.SGD(params, lr=lr, momentum=0.9, nesterov=True)
    return torch.optim.AdamW(params, lr=lr, weight_decay=0.01)


def lr_factor(spec: RunSpec) -> Callable[[int], float]:
    """The schedule's multiplier of the base LR at each step (``LambdaLR``'s function)."""
    total, kind, v = spec.steps, spec.schedule, spec.variant
    if kind == "warmup_cosine":
        warmup = max(1, int(total * (0.25 if spec.cause == "warmup_too_high" else 0.1)))

        def f(s: int) -> float:
            if s < warmup:
                return (s + 1) / warmup
            return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, (s - warmup) / max(1, total - warmup))))

        return f
    if kind == "warmup_constant":  # a linear warmup to the peak, then the peak
        warmup = max(1, int(total * (0.25 + 0.05 * v)))
        return lambda s: min(1.0, (s + 1) / warmup)
    if kind == "linear":
        return lambda s: max(0.05, 1.0 - s / total)
    if kind == "warmup_linear":  # a linear warmup, then a linear decay (HF's get_linear_schedule_with_warmup)
        up = max(1, int(total * (0.25 if spec.cause == "warmup_too_high" else 0.1)))
        return lambda s: (s + 1) / up if s < up else max(0.05, 1.0 - (s - up) / max(1, total - up))
    if kind == "onecycle":  # OneCycleLR's shape (cosine annealing, pct_start 0.3, div 25, final div 1e4)
        up = max(1, int(total * 0.3))

        def one(s: int) -> float:
            if s < up:
                return 0.04 + 0.96 * 0.5 * (1 - math.cos(math.pi * s / up))
            frac = min(1.0, (s - up) / max(1, total - up))
            return 4e-6 + (1.0 - 4e-6) * 0.5 * (1 + math.cos(math.pi * frac))

        return one
    if kind == "jump_up":  # a step schedule written the wrong way round: x10/30/100 at 45 % of the run
        at, jump = int(total * 0.45), (10.0, 30.0, 100.0)[v]
        return lambda s: 1.0 if s < at else jump
    if kind == "jump_mid":  # batch 10: the LR raised x3/5/10 (x1.5/2: mild) at 35/45/55 % of the run
        at, jump = int(total * (0.35, 0.45, 0.55)[(v // 5) % 3]), (3.0, 5.0, 10.0, 1.5, 2.0)[v % 5]
        return lambda s: 1.0 if s < at else jump
    if kind == "step":
        return lambda s: 1.0 if s < total * 0.5 else 0.3 if s < total * 0.8 else 0.09
    if kind == "delayed_warmup":  # ~0 for a first stretch, then a warmup: a flat start that is healthy
        flat, ramp = int(total * (0.15 + 0.05 * v)), int(total * 0.1)
        return lambda s: 1e-3 if s < flat else min(1.0, (s - flat + 1) / ramp)
    if kind == "late_drop":  # a first stage at a low LR, then the real one: slow, then a drop
        return lambda s: 0.03 if s < total * 0.4 else 1.0
    if kind == "exponential_up":  # ExponentialLR(gamma > 1): a decay written the wrong way round
        gamma = (1.06, 1.1, 1.15)[v]
        return lambda s: gamma**s
    if kind == "cosine_restarts":  # SGDR (CosineAnnealingWarmRestarts): 3 cycles, each back at the peak
        period = max(1, total // 3)
        return lambda s: 0.02 + 0.98 * 0.5 * (1 + math.cos(math.pi * (s % period) / period))
    if kind == "cyclic":  # CyclicLR's triangular shape (batch 8): 10 % of the peak up and down, 4-6 cycles
        period = max(2, total // (4 + v))

        def tri(s: int) -> float:
            phase = (s % period) / period
            return 0.1 + 0.9 * (1.0 - abs(2.0 * phase - 1.0))

        return tri
    if kind == "inverse_sqrt":  # the transformer schedule: a linear warmup, then 1/sqrt(step) decay
        up = max(1, int(total * (0.25 if spec.cause == "warmup_too_high" else 0.1)))
        return lambda s: (s + 1) / up if s < up else math.sqrt(up / (s + 1))
    if kind == "polynomial":  # PolynomialLR(power=2) to 2 % of the peak
        return lambda s: max(0.02, (1.0 - s / total) ** 2)
    if kind == "exp_decay":  # ExponentialLR(gamma < 1): 5 % of the peak at the end
        gamma = 0.05 ** (1.0 / max(1, total))
        return lambda s: gamma**s
    if kind == "zero":
        return (lambda s: 0.0) if v % 2 == 0 else (lambda s: 1e-6)  # lr 0, or a typo of 1e-3 -> 1e-9
    return lambda s: 1.0


def clip_for(spec: RunSpec) -> Optional[float]:
    """The clip threshold: the spec's, or for clip-stale ~1/100 of the family's typical norm."""
    if spec.cause == "clip_stale":
        return {"mlp": 0.001, "cnn": 0.001, "gpt": 0.01, "deep": 0.001, "lora": 0.002, "linear": 0.01}[
            spec.family
        ]
    return spec.clip


# --------------------------------------------------------------------------------------------- truth


class TruthRecorder:
    """The per-step ground truth, computed from the model's tensors beside the SDK."""

    def __init__(self, model: nn.Module) -> None:
        self.truth: Truth = {
            "step": [],
            "loss": [],
            "grad_norm": [],
            "lr": [],
            "first_layer": [],
            "last_layer": [],
        }
        weights = [p for n, p in model.named_parameters() if p.requires_grad and p.dim() >= 2]
        self.first = weights[0] if weights else None
        self.last = weights[-1] if weights else None
        self.params = [p for p in model.parameters() if p.requires_grad]
        self._grad: Dict[str, float] = {}

    def grads(self) -> None:
        """Read the gradients now (before clipping)."""
        grads = [p.grad for p in self.params if p.grad is not None]
        self._grad = {
            "grad_norm": float(torch.nn.utils.get_total_norm(grads)) if grads else 0.0,
            "first_layer": _norm(self.first),
            "last_layer": _norm(self.last),
        }

    def step(self, step: int, loss: float, lr: float, grad_norm: Optional[float] = None) -> None:
        t = self.truth
        t["step"].append(step)
        t["loss"].append(loss)
        t["lr"].append(lr)
        t["grad_norm"].append(grad_norm if grad_norm is not None else self._grad.get("grad_norm", math.nan))
        t["first_layer"].append(self._grad.get("first_layer", math.nan))
        t["last_layer"].append(self._grad.get("last_layer", math.nan))


def _norm(p: Optional[torch.Tensor]) -> float:
    if p is None or p.grad is None:
        return 0.0
    return float(p.grad.detach().float().norm())


# -------------------------------------------------------------------------------------------- loops


def run(spec: RunSpec) -> Truth:
    """Train ``spec`` with the SDK (configured from the environment: ``trainguard.init()`` reads
    ``TRAINGUARD_ENDPOINT`` etc.) and return the ground truth."""
    torch.set_num_threads(1)
    torch.manual_seed(spec.seed)
    trainguard.init(
        run_name=f"corpus-{spec.id}",
        tags={"corpus": spec.id, "framework": spec.framework, "family": spec.family},
    )
    if spec.framework == "hf":
        return _run_hf(spec)
    if spec.framework == "lightning":
        return _run_lightning(spec)
    return _run_plain(spec)


def _log_norm(spec: RunSpec) -> bool:
    """Whether the plain loop also logs the norm ``clip_grad_norm_`` returned (half the users do)."""
    return spec.seed % 2 == 0


def _run_plain(spec: RunSpec) -> Truth:
    task, model = Task(spec), build_model(spec)
    optimizer = make_optimizer(spec, model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor(spec))
    clip = clip_for(spec)
    trainguard.watch(model, optimizer, clip=clip)
    if spec.family == "lora":
        trainguard.watch_lora(model, every=2)
    truth = TruthRecorder(model)
    nonfinite = 0
    for step in range(spec.steps):
        x, y = task.batch(step)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=spec.bf16):
            loss = model(x, y)["loss"]
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        truth.grads()
        returned = None
        if clip is not None:
            returned = float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=clip))
        lr = optimizer.param_groups[0]["lr"]
        optimizer.step()
        scheduler.step()
        value = float(loss.detach())
        extra = {"grad_norm": returned} if returned is not None and _log_norm(spec) else {}
        trainguard.log(step=step, loss=loss.detach(), lr=lr, **extra)
        truth.step(step, value, lr)
        if not math.isfinite(value):
            nonfinite += 1
            if nonfinite >= 3:  # the loop's own NaN guard
                break
    return truth.truth


class _Rows(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """A fixed dataset of a task's batches as rows (HF Trainer and Lightning draw their own batches)."""

    def __init__(self, spec: RunSpec) -> None:
        task = Task(spec)
        xs, ys = [], []
        for step in range(spec.steps):
            x, y = task.batch(step)
            xs.append(x)
            ys.append(y)
        self.x, self.y = torch.cat(xs), torch.cat(ys)
        self.keys = ("input_ids", "labels") if spec.family in ("gpt", "lora") else ("x", "y")

    def __len__(self) -> int:
        return int(self.x.shape[0])

    def __getitem__(self, i: int) -> Dict[str, torch.Tensor]:
        return {self.keys[0]: self.x[i], self.keys[1]: self.y[i]}


def _run_hf(spec: RunSpec) -> Truth:
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from trainguard.integrations.transformers import TrainGuardCallback

    model = build_model(spec)
    optimizer = make_optimizer(spec, model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor(spec))
    truth: Truth = {"step": [], "loss": [], "grad_norm": [], "lr": [], "first_layer": [], "last_layer": []}

    class Truths(TrainerCallback):  # type: ignore[misc]
        def on_log(
            self, args: Any, state: Any, control: Any, logs: Optional[Dict[str, Any]] = None, **kwargs: Any
        ) -> None:
            if logs and "loss" in logs:
                truth["step"].append(state.global_step - 1)
                truth["loss"].append(float(logs["loss"]))
                truth["grad_norm"].append(float(logs.get("grad_norm", math.nan)))
                truth["lr"].append(float(logs.get("learning_rate", math.nan)))
                truth["first_layer"].append(math.nan)
                truth["last_layer"].append(math.nan)

    with tempfile.TemporaryDirectory(prefix="tg-corpus-hf-") as out:
        args = TrainingArguments(
            output_dir=out,
            max_steps=spec.steps,
            per_device_train_batch_size=spec.batch,
            learning_rate=base_lr(spec),
            max_grad_norm=clip_for(spec) or 0.0,
            logging_steps=1,
            report_to=[],
            save_strategy="no",
            use_cpu=True,
            seed=spec.seed,
            dataloader_num_workers=0,
            disable_tqdm=True,
            remove_unused_columns=False,
            logging_nan_inf_filter=False,
        )
        trainer = Trainer(
            model=model,
            args=args,
            train_dataset=_Rows(spec),
            optimizers=(optimizer, scheduler),
            callbacks=[TrainGuardCallback(), Truths()],
        )
        if spec.family == "lora":
            trainguard.watch_lora(model, every=2)
        trainer.train()
    return truth


def _run_lightning(spec: RunSpec) -> Truth:
    import pytorch_lightning as pl

    from trainguard.integrations.lightning import TrainGuardCallback

    model = build_model(spec)
    recorder = TruthRecorder(model)
    clip = clip_for(spec)

    class Module(pl.LightningModule):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def training_step(self, batch: Dict[str, torch.Tensor], _i: int) -> torch.Tensor:
            keys = list(batch)
            return self.model(batch[keys[0]], batch[keys[1]])["loss"]

        def configure_optimizers(self) -> Any:
            opt = make_optimizer(spec, self.parameters())
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor(spec))
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    class Truths(pl.Callback):  # type: ignore[misc]
        def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
            recorder.grads()
            self.lr = optimizer.param_groups[0]["lr"]

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, i: int) -> None:
            loss = outputs["loss"] if isinstance(outputs, dict) else outputs
            recorder.step(trainer.global_step - 1, float(loss.detach()), getattr(self, "lr", math.nan))

    loader = torch.utils.data.DataLoader(
        _Rows(spec), batch_size=spec.batch, shuffle=True, generator=torch.Generator().manual_seed(spec.seed)
    )
    trainer = pl.Trainer(
        max_steps=spec.steps,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        gradient_clip_val=clip,
        callbacks=[TrainGuardCallback(), Truths()],
        precision="bf16-mixed" if spec.bf16 else "32-true",
        max_epochs=-1,
    )
    trainer.fit(Module(), loader)
    return recorder.truth


def environment_for(endpoint: str, spool: str) -> Dict[str, str]:
    """The ``TRAINGUARD_*`` variables a run is configured with (the SDK's defaults otherwise)."""
    return {
        "TRAINGUARD_ENDPOINT": endpoint,
        "TRAINGUARD_PROJECT": "corpus",
        "TRAINGUARD_SPOOL_DIR": spool,
        "TRAINGUARD_FLUSH_INTERVAL": "0.5",
    }
