"""Lightning callback: real Lightning training on CPU when Lightning is installed; the clean refusal always."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from typing import Any, Callable, Dict, Iterator, List

import pytest
import torch
from torch import nn

import trainguard
from trainguard.guard import reset_warnings

HAVE_LIGHTNING = (importlib.util.find_spec("lightning") is not None
                  or importlib.util.find_spec("pytorch_lightning") is not None)
BLOCKED = ("lightning", "lightning.pytorch", "lightning.pytorch.callbacks", "pytorch_lightning",
           "pytorch_lightning.callbacks")


def test_import_without_lightning_raises_a_clear_import_error(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in BLOCKED:
        monkeypatch.setitem(sys.modules, name, None)  # what `import` sees when a package is absent
    monkeypatch.delitem(sys.modules, "trainguard.integrations.lightning", raising=False)
    with pytest.raises(ImportError, match=r"needs PyTorch Lightning \(lightning or pytorch_lightning\)"):
        importlib.import_module("trainguard.integrations.lightning")


def test_the_test_install_has_the_real_library() -> None:
    """requirements/dev.txt pins pytorch-lightning: the real-training checks below must run, not only the
    refusal (a missing install step fails here instead of quietly testing less)."""
    assert HAVE_LIGHTNING


def usable_or_refused() -> bool:
    """True when Lightning is installed (the caller then runs its real check); otherwise asserts the
    clean refusal and returns False, so a missing install is tested, never skipped."""
    if HAVE_LIGHTNING:
        module = importlib.import_module("trainguard.integrations.lightning")
        assert module.TrainGuardCallback.__mro__[1].__name__ == "Callback"
        return True
    with pytest.raises(ImportError, match=r"needs PyTorch Lightning \(lightning or pytorch_lightning\)"):
        importlib.import_module("trainguard.integrations.lightning")
    return False


# --- real Lightning where installed; elsewhere each test asserts the refusal instead -------------
@pytest.fixture
def sdk() -> Iterator[Callable[[], List[Dict[str, Any]]]]:
    """Starts the SDK on an in-memory transport; yields ``events()`` (flushes, then every envelope)."""
    reset_warnings()
    torch.manual_seed(0)
    trainguard.init(endpoint="memory://", spool_dir="", heartbeat_interval=0, capture_exit=False,
                    watch_overhead_budget=0,  # exact per-step semantics; the budget has its own test
                    capture_uncaught=False)

    def events() -> List[Dict[str, Any]]:
        assert trainguard.flush(5)
        client = trainguard.get_client()
        assert client is not None
        return list(client.worker._transport.events)  # type: ignore[attr-defined]

    yield events
    trainguard.shutdown(timeout=2)


def _series(evs: List[Dict[str, Any]], name: str) -> List[Any]:
    return [(e["step"], p["value"]) for e in evs for p in e.get("metrics", {}).get("points", [])
            if p["name"] == name]


def _fit(fail_at: int = -1, steps: int = 6) -> Dict[str, Any]:
    try:
        import lightning.pytorch as pl
    except ImportError:  # the standalone distribution (requirements/dev.txt pins pytorch-lightning)
        import pytorch_lightning as pl  # type: ignore[no-redef]
    from torch.utils.data import DataLoader, TensorDataset

    from trainguard.integrations.lightning import TrainGuardCallback

    class Lit(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            if batch_idx == fail_at:
                raise RuntimeError(f"bad batch {batch_idx}")
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.05)

    class Reference(pl.Callback):
        """Pre-clip gradient norms, from Lightning's own hook that runs just before clipping."""

        def __init__(self) -> None:
            self.norms: List[float] = []

        def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
            grads = [p.grad.double() for p in pl_module.parameters() if p.grad is not None]
            self.norms.append(float(torch.sqrt(sum(g.pow(2).sum() for g in grads))))

    x = torch.randn(64, 8)
    loader = DataLoader(TensorDataset(x, x.sum(1, keepdim=True).sin()), batch_size=8)
    ref = Reference()
    callback = TrainGuardCallback()
    trainer = pl.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         gradient_clip_val=0.5, callbacks=[ref, callback])
    error = None
    try:
        trainer.fit(Lit(), loader)
    except RuntimeError as exc:
        error = exc
    return {"ref": ref.norms, "callback": callback, "error": error}


def test_fit_reports_loss_grad_norms_and_clip_triggers(sdk: Callable[[], List[Dict[str, Any]]]) -> None:
    if not usable_or_refused():
        return
    out = _fit()
    assert out["error"] is None
    assert out["callback"].handle is None  # removed at the end of fit
    evs = sdk()
    norms = _series(evs, "grad/global_norm")
    assert [s for s, _ in norms] == list(range(6))
    for (_, value), ref in zip(norms, out["ref"]):
        assert abs(value - ref) <= 1e-4 * ref
    assert [v for _, v in _series(evs, "grad/clip_triggered")] == [
        1.0 if r > 0.5 - 1e-6 else 0.0 for r in out["ref"]]
    losses = _series(evs, "loss")
    assert [s for s, _ in losses] == list(range(6))  # the watch's numbering
    assert all(isinstance(v, float) and v > 0 for _, v in losses)


def test_an_exception_in_training_step_is_captured_as_unhandled(
        sdk: Callable[[], List[Dict[str, Any]]]) -> None:
    if not usable_or_refused():
        return
    out = _fit(fail_at=3)
    assert isinstance(out["error"], RuntimeError)
    exceptions = [e["exception"] for e in sdk() if "exception" in e]
    assert len(exceptions) == 1
    assert exceptions[0]["mechanism"] == "lightning" and exceptions[0]["handled"] is False
    assert "bad batch 3" in exceptions[0]["message"]


def test_with_gradient_accumulation_each_step_reports_its_mean_training_loss(
        sdk: Callable[[], List[Dict[str, Any]]]) -> None:
    """accumulate_grad_batches=4 (the last window of the epoch short: 10 batches): Lightning hands
    on_train_batch_end the loss divided by 4; the callback reports, once per optimizer step and at the
    step's number, the mean of what training_step returned for that step's micro-batches."""
    if not usable_or_refused():
        return
    try:
        import lightning.pytorch as pl
    except ImportError:
        import pytorch_lightning as pl  # type: ignore[no-redef]
    from torch.utils.data import DataLoader, TensorDataset

    from trainguard.integrations.lightning import TrainGuardCallback

    returned: List[float] = []

    class Lit(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            loss = nn.functional.mse_loss(self.net(x), y)
            returned.append(float(loss.detach()))
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.05)

    x = torch.randn(80, 8)
    loader = DataLoader(TensorDataset(x, 3 * x.sum(1, keepdim=True)), batch_size=8)  # 10 batches/epoch
    trainer = pl.Trainer(max_epochs=2, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, accumulate_grad_batches=4,
                         callbacks=[TrainGuardCallback()])
    trainer.fit(Lit(), loader)
    losses = dict(_series(sdk(), "loss"))
    assert trainer.global_step == 6 and sorted(losses) == list(range(6))  # windows 4, 4, 2 per epoch
    windows = [returned[0:4], returned[4:8], returned[8:10], returned[10:14], returned[14:18], returned[18:20]]
    for step, window in enumerate(windows):
        assert losses[step] == pytest.approx(sum(window) / len(window), rel=1e-5), (step, losses, windows)
