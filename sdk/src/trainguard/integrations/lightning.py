"""PyTorch Lightning: ``TrainGuardCallback`` watches the LightningModule and reports loss and crashes.

    import trainguard
    from trainguard.integrations.lightning import TrainGuardCallback

    trainguard.init(endpoint=...)
    trainer = lightning.pytorch.Trainer(callbacks=[TrainGuardCallback()], gradient_clip_val=1.0)

- ``on_fit_start``: ``trainguard.watch(pl_module, trainer.optimizers, scaler=<the precision plugin's
  GradScaler, if any>, clip=<gradient_clip_val when clipping by norm>)``. Lightning runs backward inside
  the optimizer's closure; the watch reads gradients at the end of backward, so the norms are the
  pre-clip ones and the step ends at the optimizer (or scaler) step as usual.
- ``on_train_batch_end``: the training loss, once per optimizer step, as ``loss`` (a tensor; read back
  on the SDK's thread), at the SDK's optimizer-step count (0-based, i.e. ``trainer.global_step - 1``
  after the step), the same numbering as the watch's gradient metrics. Under automatic optimization
  Lightning hands this hook ``outputs["loss"]`` divided by ``accumulate_grad_batches`` (the value it
  backpropagates); the callback keeps the micro-batches' values and, on the batch whose optimizer step
  ran, reports their mean loss -- what ``training_step`` returned, as ``self.log`` shows it -- not the
  last micro-batch's share. Under manual optimization each batch's ``outputs["loss"]`` is reported as
  returned.
- ``on_exception``: the exception, as unhandled (mechanism ``lightning``), before Lightning re-raises it.
- ``on_fit_end`` / ``teardown``: the watch is removed.

Uses ``lightning.pytorch`` when installed, else ``pytorch_lightning``; without either, importing this
module raises ImportError saying what to install. Never raises into training: every hook is guarded.
"""

from __future__ import annotations

from typing import Any, List, Optional

try:
    from lightning.pytorch.callbacks import Callback
except ImportError:
    try:
        from pytorch_lightning.callbacks import Callback  # type: ignore[no-redef]
    except ImportError as exc:
        raise ImportError(
            "trainguard.integrations.lightning needs PyTorch Lightning (lightning or pytorch_lightning)"
        ) from exc

from .. import api
from ..guard import never_raise

__all__ = ["TrainGuardCallback"]

MAX_MICRO_BATCHES = 4096
"""Most micro-batch losses kept waiting for their optimizer step (then reported anyway)."""


class TrainGuardCallback(Callback):  # type: ignore[misc]
    """Lightning callback reporting gradient/AMP/memory signals, the training loss and crashes.

    ``clip``: overrides the clip threshold read from the trainer. ``log_loss``: log
    ``outputs["loss"]`` after each training batch (default True). Other keyword arguments go to
    ``trainguard.watch`` (``every``, ``layer_depth``, ``memory_every``, ``norm_every``, ``log_lr``).
    """

    def __init__(self, clip: Optional[float] = None, log_loss: bool = True, **watch_kwargs: Any) -> None:
        super().__init__()
        self.clip = clip
        self.log_loss = log_loss
        self.watch_kwargs = watch_kwargs
        self.handle: Any = None
        self._parts: List[Any] = []  #: the pending optimizer step's micro-batch losses (each / accumulate)
        self._global_step: Optional[int] = None

    @never_raise()
    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        self._remove()
        self._parts, self._global_step = [], int(getattr(trainer, "global_step", 0))
        scaler = getattr(_precision_plugin(trainer), "scaler", None)
        self.handle = api.watch(pl_module, list(getattr(trainer, "optimizers", []) or []) or None,
                                scaler=scaler, clip=self.clip if self.clip is not None else _clip(trainer),
                                **self.watch_kwargs)

    @never_raise()
    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if not self.log_loss:
            return
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if loss is None or not hasattr(loss, "detach"):
            return
        global_step = int(getattr(trainer, "global_step", 0))
        step = None if self._watching() else global_step
        accumulate = int(getattr(trainer, "accumulate_grad_batches", 1) or 1)
        if accumulate == 1 or not getattr(pl_module, "automatic_optimization", True):
            api.log(step=step, loss=loss.detach())  # the loss training_step returned, as returned
            return
        parts = self._parts
        parts.append(loss.detach())
        if global_step == self._global_step and len(parts) < MAX_MICRO_BATCHES:
            return  # only accumulated: its optimizer step is still to come
        self._global_step, self._parts = global_step, []
        import torch

        total = torch.stack([p.float().reshape(()) for p in parts]).sum()
        api.log(step=step, loss=total * (accumulate / len(parts)))  # each part is loss / accumulate

    @never_raise()
    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        client = api.get_client()
        if client is not None:
            client.capture_exception(exception, handled=False, mechanism="lightning")

    @never_raise()
    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        self._remove()

    @never_raise()
    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage == "fit":
            self._remove()

    def _watching(self) -> bool:
        return self.handle is not None and not getattr(self.handle, "removed", True)

    def _remove(self) -> None:
        if self.handle is not None:
            self.handle.remove()
            self.handle = None


def _precision_plugin(trainer: Any) -> Any:
    plugin = getattr(trainer, "precision_plugin", None)
    if plugin is None:
        plugin = getattr(getattr(trainer, "strategy", None), "precision_plugin", None)
    return plugin


def _clip(trainer: Any) -> Optional[float]:
    """``gradient_clip_val`` when Lightning clips by norm (its default algorithm), else None."""
    value = getattr(trainer, "gradient_clip_val", None)
    algorithm = getattr(trainer, "gradient_clip_algorithm", None)
    if not value or (algorithm is not None and str(getattr(algorithm, "value", algorithm)) != "norm"):
        return None
    return float(value)
