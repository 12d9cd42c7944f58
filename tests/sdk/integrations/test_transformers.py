"""transformers callback: a real ``Trainer`` run on CPU when transformers is installed; the clean refusal
always (a missing install is tested, never skipped)."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List

import pytest
import torch
from torch import nn

import trainguard
from trainguard.guard import reset_warnings

HAVE_TRANSFORMERS = (importlib.util.find_spec("transformers") is not None
                     and importlib.util.find_spec("accelerate") is not None)


def test_import_without_transformers_raises_a_clear_import_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)  # what `import` sees when it is absent
    monkeypatch.delitem(sys.modules, "trainguard.integrations.transformers", raising=False)
    with pytest.raises(ImportError, match=r"needs Hugging Face transformers: pip install transformers"):
        importlib.import_module("trainguard.integrations.transformers")


def test_the_test_install_has_the_real_library() -> None:
    """requirements/dev.txt pins transformers and accelerate: the real Trainer checks below must run, not
    only the refusal (a missing install step fails here instead of quietly testing less)."""
    assert HAVE_TRANSFORMERS


def usable_or_refused() -> bool:
    """True when transformers (and the accelerate its Trainer needs) are installed; otherwise asserts the
    refusal when transformers itself is missing and returns False."""
    if HAVE_TRANSFORMERS:
        module = importlib.import_module("trainguard.integrations.transformers")
        assert module.TrainGuardCallback.__mro__[1].__name__ == "TrainerCallback"
        return True
    if importlib.util.find_spec("transformers") is None:
        with pytest.raises(ImportError, match=r"needs Hugging Face transformers: pip install transformers"):
            importlib.import_module("trainguard.integrations.transformers")
    return False


@pytest.fixture
def sdk() -> Iterator[Callable[[], List[Dict[str, Any]]]]:
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


class Regressor(nn.Module):
    """The smallest model ``Trainer`` accepts: returns a dict with ``loss``."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> Dict[str, torch.Tensor]:
        return {"loss": nn.functional.mse_loss(self.net(x), labels)}


def test_trainer_run_reports_logs_and_matching_grad_norms(
        sdk: Callable[[], List[Dict[str, Any]]], tmp_path: Path) -> None:
    if not usable_or_refused():
        return
    from transformers import Trainer, TrainingArguments

    from trainguard.integrations.transformers import TrainGuardCallback

    x = torch.randn(48, 8)
    data = [{"x": x[i], "labels": x[i].sum().sin().reshape(1)} for i in range(48)]
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=6, per_device_train_batch_size=4,
                             gradient_accumulation_steps=2, logging_steps=1, learning_rate=0.05,
                             max_grad_norm=0.5, report_to=[], save_strategy="no", use_cpu=True,
                             disable_tqdm=True, lr_scheduler_type="constant", dataloader_num_workers=0)
    callback = TrainGuardCallback()
    trainer = Trainer(model=Regressor(), args=args, train_dataset=data, callbacks=[callback])
    trainer.train()
    assert callback.handle is None  # removed at the end of training
    evs = sdk()

    def series(name: str) -> List[Any]:
        return [(e["step"], p["value"]) for e in evs for p in e.get("metrics", {}).get("points", [])
                if p["name"] == name]

    ours = dict(series("grad/global_norm"))
    theirs = dict(series("grad_norm"))  # Trainer's own (pre-clip) norm, logged through on_log
    assert sorted(ours) == list(range(6)) and sorted(theirs) == list(range(6))
    for step in range(6):
        assert abs(ours[step] - theirs[step]) <= 1e-4 * theirs[step]
    assert [v for _, v in series("grad/clip_triggered")] == [
        1.0 if theirs[s] > 0.5 - 1e-6 else 0.0 for s in range(6)]
    assert [s for s, _ in series("loss")] == list(range(6))
    assert {"learning_rate", "epoch"} <= {p["name"] for e in evs for p in e.get("metrics", {}).get("points", [])}


def test_with_the_default_budget_every_reported_norm_is_the_trainers_pre_clip_norm(tmp_path: Path) -> None:
    """The HF Trainer with its default clipping and the SDK's default overhead budget (the norm read every
    few steps on a tiny CPU model): on every step the SDK reports a norm, it equals the grad_norm the
    Trainer logs (what its clip_grad_norm_ returned) -- never the clipped value."""
    if not usable_or_refused():
        return
    from transformers import Trainer, TrainingArguments

    from trainguard.integrations.transformers import TrainGuardCallback

    reset_warnings()
    torch.manual_seed(1)
    trainguard.init(endpoint="memory://", spool_dir="", heartbeat_interval=0, capture_exit=False,
                    capture_uncaught=False)
    try:
        x = torch.randn(640, 8)
        data = [{"x": x[i], "labels": (3 * x[i].sum()).reshape(1)} for i in range(640)]
        args = TrainingArguments(output_dir=str(tmp_path), max_steps=80, per_device_train_batch_size=8,
                                 logging_steps=1, learning_rate=0.01, report_to=[], save_strategy="no",
                                 use_cpu=True, disable_tqdm=True, dataloader_num_workers=0)
        assert args.max_grad_norm == 1.0  # the Trainer's default clipping
        Trainer(model=Regressor(), args=args, train_dataset=data, callbacks=[TrainGuardCallback()]).train()
        assert trainguard.flush(5)
        client = trainguard.get_client()
        assert client is not None
        evs = list(client.worker._transport.events)  # type: ignore[attr-defined]
    finally:
        trainguard.shutdown(timeout=2)

    def series(name: str) -> Dict[int, float]:
        return {e["step"]: p["value"] for e in evs for p in e.get("metrics", {}).get("points", [])
                if p["name"] == name}

    ours, theirs = series("grad/global_norm"), series("grad_norm")
    assert sorted(theirs) == list(range(80)) and ours and set(ours) <= set(theirs)
    assert sum(1 for v in theirs.values() if v > 1.0) >= 40  # most steps clipped: a clipped read would show
    for step, value in ours.items():
        assert abs(value - theirs[step]) <= 1e-4 * theirs[step], (step, value, theirs[step])


def _points(evs: List[Dict[str, Any]], name: str) -> Dict[int, float]:
    return {e["step"]: p["value"] for e in evs for p in e.get("metrics", {}).get("points", [])
            if p["name"] == name}


def _interval_means(loss: Dict[int, float], logged: List[Dict[str, Any]]) -> List[tuple]:
    """Per Trainer log entry with a ``loss``: (its loss, the mean of the reported per-step losses of the
    steps it covers). Log entries count steps 1-based; the SDK's watch numbering is 0-based."""
    out, last = [], 0
    for entry in logged:
        if "loss" in entry:
            steps = range(last, entry["step"])
            out.append((entry["loss"], sum(loss[s] for s in steps) / len(steps)))
            last = entry["step"]
    return out


@pytest.mark.parametrize("model_kind", ["dict_mean", "gpt2_num_items"])
def test_the_loss_of_every_step_is_reported_whatever_logging_steps_is(
        sdk: Callable[[], List[Dict[str, Any]]], tmp_path: Path, model_kind: str) -> None:
    """logging_steps=5 with gradient accumulation 2: a ``loss`` at every optimizer step (from the model's
    own loss on the step's forwards), averaging over each logging interval to exactly the loss the
    Trainer logged -- for a model that returns a plain mean (the Trainer averages micro-batches) and for
    a GPT-2 normalised by ``num_items_in_batch`` (the Trainer sums them)."""
    if not usable_or_refused():
        return
    from transformers import Trainer, TrainingArguments

    from trainguard.integrations.transformers import TrainGuardCallback

    if model_kind == "dict_mean":
        x = torch.randn(160, 8)
        data: List[Dict[str, Any]] = [{"x": x[i], "labels": x[i].sum().sin().reshape(1)} for i in range(160)]
        model: Any = Regressor()
    else:
        from transformers import GPT2Config, GPT2LMHeadModel

        ids = torch.randint(0, 32, (160, 12))
        # some label positions ignored (-100): micro-batches count different numbers of tokens
        data = [{"input_ids": row, "labels": torch.where(row % 3 == 0, -100, row)} for row in ids]
        model = GPT2LMHeadModel(GPT2Config(vocab_size=32, n_positions=12, n_embd=16, n_layer=1, n_head=2))
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=20, per_device_train_batch_size=4,
                             gradient_accumulation_steps=2, logging_steps=5, learning_rate=0.01,
                             report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True,
                             dataloader_num_workers=0)
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[TrainGuardCallback()])
    trainer.train()
    loss = _points(sdk(), "loss")
    assert sorted(loss) == list(range(20))  # every step, not every 5th
    pairs = _interval_means(loss, trainer.state.log_history)
    assert len(pairs) == 4
    for logged, mean in pairs:
        assert abs(mean - logged) <= 1e-5 * abs(logged), pairs


def test_a_loss_the_trainer_changes_falls_back_to_the_logged_loss(
        sdk: Callable[[], List[Dict[str, Any]]], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A ``compute_loss`` override that adds to the model's loss: the first logging interval shows the
    mismatch, one warning says so, and from then on the reported ``loss`` is the Trainer's logged one."""
    if not usable_or_refused():
        return
    from transformers import Trainer, TrainingArguments

    from trainguard.integrations.transformers import TrainGuardCallback

    class Penalised(Trainer):  # type: ignore[misc]
        def compute_loss(self, model: Any, inputs: Any, return_outputs: bool = False, **kwargs: Any) -> Any:
            outputs = model(**inputs)
            loss = outputs["loss"] + 1.0  # e.g. a regulariser the model does not know of
            return (loss, outputs) if return_outputs else loss

    x = torch.randn(80, 8)
    data = [{"x": x[i], "labels": x[i].sum().sin().reshape(1)} for i in range(80)]
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=15, per_device_train_batch_size=4,
                             logging_steps=5, learning_rate=0.01, report_to=[], save_strategy="no",
                             use_cpu=True, disable_tqdm=True, dataloader_num_workers=0)
    trainer = Penalised(model=Regressor(), args=args, train_dataset=data, callbacks=[TrainGuardCallback()])
    trainer.train()
    assert capsys.readouterr().err.count("is not the loss the Trainer logs") == 1
    loss = _points(sdk(), "loss")
    logged = {entry["step"] - 1: entry["loss"] for entry in trainer.state.log_history if "loss" in entry}
    assert sorted(logged) == [4, 9, 14]
    assert sorted(loss) == [0, 1, 2, 3, 4, 9, 14]  # per-step until the first check, then the logged loss
    for step in (4, 9, 14):
        assert loss[step] == pytest.approx(logged[step], rel=1e-6)
    assert all(loss[s] < 1.0 + 2.0 for s in range(4))  # the model's own loss (the +1.0 is not in it)


def test_step_loss_sums_an_interval_in_one_tensor_and_never_writes_into_a_loss() -> None:
    """A logging interval holds one running sum, not a tensor per step (the per-step list grew host RSS
    ~360 KiB a step between the Trainer's logs: bench/results/unseen_probe_stop35.txt), and the sum has
    its own storage, so the first step's loss -- the tensor the job logged -- is never added into."""
    from trainguard.integrations.transformers import StepLoss

    class Out:
        def __init__(self, loss: torch.Tensor) -> None:
            self.loss = loss

    model = nn.Linear(1, 1).train()
    steps = StepLoss()
    losses = [torch.tensor(float(i), requires_grad=True) * 1.0 for i in range(1, 501)]
    returned = []
    for loss in losses:
        steps.hook(model, (), {}, Out(loss))
        returned.append(steps.take())
    assert steps.count == 500 and steps.total.dim() == 0
    assert not [v for v in vars(steps).values() if isinstance(v, list) and v]  # nothing kept per step
    assert float(returned[0]) == 1.0  # the first loss is not the running sum
    assert steps.interval_mean() == pytest.approx(250.5)
    assert steps.total is None and steps.count == 0 and steps.interval_mean() is None
