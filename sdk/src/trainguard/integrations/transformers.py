"""Hugging Face transformers: ``TrainGuardCallback`` for ``Trainer``.

    import trainguard
    from trainguard.integrations.transformers import TrainGuardCallback

    trainguard.init(endpoint=...)
    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[TrainGuardCallback()])

- ``on_train_begin``: ``trainguard.watch(model, optimizer, scaler=<accelerate's GradScaler, if any>,
  clip=args.max_grad_norm)``. accelerate's optimizer wrapper is looked through; gradients are read at
  the end of each backward, so the norms are pre-clip and the last micro-batch of an accumulation wins.
- Every optimizer step, the step's training loss as ``loss`` (``on_step_end``), whatever
  ``logging_steps`` is (the default, 500, would leave a 300-step run with no loss at all, and a run
  logged every 10 steps with a first value already averaged over a blow-up). It is read from the loss
  the model returns on the step's training forwards (a forward hook: ``outputs.loss``, detached, summed
  on its device -- no host sync; read back off the step path like ``log(loss=tensor)``) and combined
  the way ``Trainer.training_step`` combines it: the micro-batches' mean, or their sum when the model
  normalised by ``num_items_in_batch`` (times the world size under ``average_tokens_across_devices``).
  At each ``on_log`` of a single-process run the steps' mean is checked against the loss the Trainer
  logs (relative ``STEP_LOSS_TOLERANCE``); where they differ (a ``compute_loss`` override that changes
  the loss, say) the per-step loss stops and the Trainer's logged ``loss`` is reported instead, with
  one warning. Where the model returns no loss (label smoothing, ``compute_loss_func``) nothing is
  captured and the logged ``loss`` is reported. ``TrainGuardCallback(step_loss=False)``: the logged
  loss only.
- ``on_log``: every numeric entry of ``logs`` (``loss`` -- unless the per-step loss above reported the
  same values --, ``learning_rate``, ``grad_norm``, ``epoch``, ``eval_loss``, ...; NaN and Inf included,
  they raise the SDK's alert) via ``trainguard.log``, at the SDK's optimizer-step count (0-based:
  ``state.global_step - 1``), the numbering of the watch's metrics. Without an active watch, at
  ``state.global_step``.
- ``on_train_end``: the watch is removed.

Exceptions escape ``Trainer.train`` and are captured by the SDK's excepthook integration.
Without ``transformers`` installed, importing this module raises ImportError saying what to install.
Never raises into training: every hook is guarded.
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional

try:
    from transformers import TrainerCallback
except ImportError as exc:
    raise ImportError(
        "trainguard.integrations.transformers needs Hugging Face transformers: "
        "pip install transformers (TrainGuard uses the job's own)"
    ) from exc

from .. import api
from ..guard import never_raise, warn_once

__all__ = ["STEP_LOSS_TOLERANCE", "TrainGuardCallback"]

STEP_LOSS_TOLERANCE = 1e-3
"""Most relative difference between the mean of the per-step losses of a logging interval and the loss
the Trainer logs for it before the per-step loss is given up (float32 sums agree to ~1e-6)."""

MAX_KEPT_STEPS = 10_000
"""Most per-step losses summed for one logging interval's check; past it the interval is not checked."""


class StepLoss:
    """The training loss of each optimizer step, from the loss the model returns on its forwards.

    ``hook`` is a forward hook (``with_kwargs=True``) on the model: on a training forward under grad
    it keeps ``outputs.loss`` detached (no kernel, no sync). ``take`` returns the step's loss as a
    0-d tensor on the model's device (None when no forward of the step returned one) and adds it, in
    place, to one running sum for ``interval_mean`` -- one tensor per logging interval, not one per step
    (a list of per-step scalars held until ``on_log`` grew host RSS ~360 KiB a step on a GPT-2 Trainer at
    the default ``logging_steps``: bench/results/unseen_probe_stop35.txt). Never raises: a failing hook
    keeps nothing.
    """

    def __init__(self, scale: float = 1.0) -> None:
        import torch  # made at on_train_begin: the job's torch is loaded; the hook runs on every forward

        self._torch = torch
        self.scale = scale           #: Trainer's factor on a num_items_in_batch-normalised loss
        self.parts: List[Any] = []   #: the current step's micro-batch losses
        self.normalised = False      #: whether the model normalised by num_items_in_batch
        self.total: Any = None       #: the sum of the steps' losses since the last on_log (0-d tensor)
        self.count = 0               #: how many steps that sum holds
        self.overflow = False        #: more than MAX_KEPT_STEPS steps since the last on_log

    def hook(self, module: Any, args: Any, kwargs: Any, output: Any) -> None:
        try:
            torch = self._torch
            if not getattr(module, "training", False) or not torch.is_grad_enabled():
                return
            loss = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
            if loss is None or not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                return
            self.parts.append(loss.detach().reshape(()))
            if isinstance(kwargs, dict) and kwargs.get("num_items_in_batch") is not None:
                self.normalised = True
        except Exception:  # never into training
            self.parts = []

    def take(self) -> Any:
        parts, self.parts = self.parts, []
        if not parts:
            return None
        if len(parts) == 1:
            value = parts[0].float()
        else:
            stacked = self._torch.stack([p.float() for p in parts])
            value = stacked.sum() if self.normalised else stacked.mean()
        if self.normalised and self.scale != 1.0:
            value = value * self.scale
        if self.count >= MAX_KEPT_STEPS:
            self.overflow = True
        elif self.total is None:
            self.total = value.detach().clone()  # its own storage: the sum never writes into a loss
            self.count = 1
        else:
            self.total.add_(value)
            self.count += 1
        self.normalised = False
        return value

    def interval_mean(self) -> Optional[float]:
        """The mean of the steps' losses since the last call (a host read: once per ``on_log``, after
        the Trainer's own read of its loss), or None when there were none or too many to keep."""
        total, count, overflow = self.total, self.count, self.overflow
        self.total, self.count, self.overflow = None, 0, False
        if total is None or overflow:
            return None
        return float(total) / count


class TrainGuardCallback(TrainerCallback):  # type: ignore[misc]
    """``Trainer`` callback reporting gradient/AMP/memory signals and the trainer's logs.

    ``clip``: overrides ``args.max_grad_norm``. ``step_loss``: report the loss of every optimizer step
    (module docstring); False: only the loss the Trainer logs. Other keyword arguments go to
    ``trainguard.watch`` (``every``, ``layer_depth``, ``memory_every``, ``norm_every``, ``log_lr``).
    """

    def __init__(self, clip: Optional[float] = None, step_loss: bool = True, **watch_kwargs: Any) -> None:
        self.clip = clip
        self.step_loss = step_loss
        self.watch_kwargs = watch_kwargs
        self.handle: Any = None
        self._loss: Optional[StepLoss] = None   #: the per-step loss while it is reported
        self._loss_hook: Any = None
        self._single_process = True

    @never_raise()
    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None,
                       optimizer: Any = None, **kwargs: Any) -> None:
        self._remove()
        if model is None:
            return
        clip = self.clip
        if clip is None:
            max_norm = getattr(args, "max_grad_norm", None)
            clip = float(max_norm) if max_norm and max_norm > 0 else None
        scaler = getattr(optimizer, "scaler", None)  # accelerate's AcceleratedOptimizer
        self.handle = api.watch(model, optimizer, scaler=scaler, clip=clip, **self.watch_kwargs)
        if self.step_loss and hasattr(model, "register_forward_hook"):
            world = int(getattr(args, "world_size", 1) or 1)
            self._single_process = world == 1 and int(getattr(args, "n_gpu", 1) or 1) <= 1
            averaged = world > 1 and getattr(args, "average_tokens_across_devices", False)
            scale = float(world) if averaged else 1.0
            self._loss = StepLoss(scale)
            self._loss_hook = model.register_forward_hook(self._loss.hook, with_kwargs=True)

    @never_raise()
    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._loss is None:
            return
        value = self._loss.take()
        if value is not None:
            api.log(step=self._step(state), loss=value)

    @never_raise()
    def on_log(self, args: Any, state: Any, control: Any, logs: Optional[Dict[str, Any]] = None,
               **kwargs: Any) -> None:
        if not logs:
            return
        numeric = {str(k): float(v) for k, v in logs.items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if "loss" in numeric and self._loss is not None and self._same_loss(numeric["loss"]):
            del numeric["loss"]  # the steps' own losses, already reported, average to it
        if not numeric:
            return
        api.log(step=self._step(state), **numeric)

    def _same_loss(self, logged: float) -> bool:
        """Whether the per-step losses of this logging interval average to the Trainer's ``logged`` loss
        (multi-process runs log the ranks' mean: each rank's own steps are kept, unchecked). On a
        mismatch the per-step loss is given up for the rest of the run."""
        loss = self._loss
        assert loss is not None
        mean = loss.interval_mean()
        if mean is None:
            return False  # nothing captured this interval: the Trainer's loss is the only one
        if not self._single_process:
            return True
        if math.isfinite(logged) and math.isfinite(mean) and \
                abs(mean - logged) <= STEP_LOSS_TOLERANCE * max(abs(logged), 1e-12):
            return True
        if (math.isnan(logged) and math.isnan(mean)) or logged == mean:
            return True
        warn_once("transformers:step-loss",
                  f"TrainGuardCallback: the loss the model returns ({mean:.6g} averaged over the logging "
                  f"interval) is not the loss the Trainer logs ({logged:.6g}): a compute_loss override? "
                  f"Reporting the Trainer's logged loss from now on (TrainGuardCallback(step_loss=False) "
                  f"says so from the start)")
        self._drop_step_loss()
        return False

    def _step(self, state: Any) -> Optional[int]:
        watching = self.handle is not None and not getattr(self.handle, "removed", True)
        return None if watching else int(getattr(state, "global_step", 0))

    def _drop_step_loss(self) -> None:
        if self._loss_hook is not None:
            self._loss_hook.remove()
            self._loss_hook = None
        self._loss = None

    @never_raise()
    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._remove()

    def _remove(self) -> None:
        self._drop_step_loss()
        if self.handle is not None:
            self.handle.remove()
            self.handle = None
