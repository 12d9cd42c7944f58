"""Hugging Face transformers: ``TrainGuardCallback`` for ``Trainer``.

    import trainguard
    from trainguard.integrations.transformers import TrainGuardCallback

    trainguard.init(endpoint=...)
    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[TrainGuardCallback()])

- ``on_train_begin``: ``trainguard.watch(model, optimizer, scaler=<accelerate's GradScaler, if any>,
  clip=args.max_grad_norm)``. accelerate's optimizer wrapper is looked through; gradients are read at
  the end of each backward, so the norms are pre-clip and the last micro-batch of an accumulation wins.
- ``on_log``: every numeric entry of ``logs`` (``loss``, ``learning_rate``, ``grad_norm``, ``epoch``,
  ...; NaN and Inf included, they raise the SDK's alert) via ``trainguard.log``, at the SDK's
  optimizer-step count (0-based: ``state.global_step - 1``), the numbering of the watch's metrics.
  Without an active watch, at ``state.global_step``.
- ``on_train_end``: the watch is removed.

Exceptions escape ``Trainer.train`` and are captured by the SDK's excepthook integration.
Without ``transformers`` installed, importing this module raises ImportError saying what to install.
Never raises into training: every hook is guarded.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

try:
    from transformers import TrainerCallback
except ImportError as exc:
    raise ImportError(
        "trainguard.integrations.transformers needs Hugging Face transformers: "
        "pip install transformers (TrainGuard uses the job's own)"
    ) from exc

from .. import api
from ..guard import never_raise

__all__ = ["TrainGuardCallback"]


class TrainGuardCallback(TrainerCallback):  # type: ignore[misc]
    """``Trainer`` callback reporting gradient/AMP/memory signals and the trainer's logs.

    ``clip``: overrides ``args.max_grad_norm``. Other keyword arguments go to ``trainguard.watch``
    (``every``, ``layer_depth``, ``memory_every``, ``norm_every``, ``log_lr``).
    """

    def __init__(self, clip: Optional[float] = None, **watch_kwargs: Any) -> None:
        self.clip = clip
        self.watch_kwargs = watch_kwargs
        self.handle: Any = None

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

    @never_raise()
    def on_log(self, args: Any, state: Any, control: Any, logs: Optional[Dict[str, Any]] = None,
               **kwargs: Any) -> None:
        if not logs:
            return
        numeric = {str(k): float(v) for k, v in logs.items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if not numeric:
            return
        watching = self.handle is not None and not getattr(self.handle, "removed", True)
        api.log(step=None if watching else int(getattr(state, "global_step", 0)), **numeric)

    @never_raise()
    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._remove()

    def _remove(self) -> None:
        if self.handle is not None:
            self.handle.remove()
            self.handle = None
