"""integrations/clip_tap.py: watch() takes the norms clip_grad_norm_ computes instead of a second gradient read.

Real torch training on CPU. The job must see torch's clip_grad_norm_ exactly (the same returned total and
the same parameters after every step, bit for bit, as an unwatched twin), the gradients must be read once
per step instead of twice, and what the SDK reports must still be the pre-clip global and per-layer norms.
"""

from __future__ import annotations

import copy
import math
from typing import Any, Iterator, List, Tuple

import pytest
import torch
from torch import nn

import trainguard
from tests.support.sdk_events import events, series
from trainguard.guard import reset_warnings
from trainguard.integrations import clip_tap
from trainguard.integrations import torch as tg_torch

TORCH_CLIP = torch.nn.utils.clip_grad_norm_


@pytest.fixture(autouse=True)
def _sdk() -> Iterator[None]:
    reset_warnings()
    torch.manual_seed(0)
    trainguard.init(endpoint="memory://", spool_dir="", heartbeat_interval=0, capture_exit=False,
                    watch_overhead_budget=0, capture_uncaught=False)
    yield
    tg_torch.unwatch_all()
    trainguard.shutdown(timeout=2)
    assert torch.nn.utils.clip_grad_norm_ is TORCH_CLIP  # every watch removed: torch's own is back


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32))
        self.head = nn.Linear(32, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.encoder(x)))


def _batches(n: int) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        x = torch.randn(16, 8, generator=g) * 3
        out.append((x, x.sum(dim=1, keepdim=True) ** 2))
    return out


def _train(model: nn.Module, opt: torch.optim.Optimizer, batches: List[Tuple[torch.Tensor, torch.Tensor]],
           clip: float, clip_on: Any = None) -> List[float]:
    totals = []
    for i, (x, y) in enumerate(batches):
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        if clip_on is None or clip_on(i):
            totals.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
    return totals


def test_the_job_sees_torchs_clip_exactly_and_the_sdk_reports_pre_clip_norms() -> None:
    model = Net()
    twin = copy.deepcopy(model)
    batches = _batches(25)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    twin_opt = torch.optim.SGD(twin.parameters(), lr=0.01)
    handle = trainguard.watch(model, opt, clip=0.5, every=1)
    assert handle._tap and torch.nn.utils.clip_grad_norm_ is clip_tap.clip_grad_norm_
    got = _train(model, opt, batches, 0.5)
    handle.remove()
    want = _train(twin, twin_opt, batches, 0.5)  # torch's own clip_grad_norm_, no SDK
    assert got == want  # the same totals, bit for bit
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.equal(a, b)  # the same training, bit for bit
    evs = events()
    norms = series(evs, "grad/global_norm")
    assert [s for s, _ in norms] == list(range(25))
    assert [v for _, v in norms] == pytest.approx(got, rel=1e-6)  # pre-clip: clip_grad_norm_'s total
    assert all(v > 0.5 for v in got)  # so every report differs from the clipped gradients' norm
    triggered = [v for _, v in series(evs, "grad/clip_triggered")]
    assert triggered == [1.0] * 25
    # per-layer norms (every step) add up to the global norm: sqrt(sum of squares)
    for step in (0, 12, 24):
        layers = [v for name in ("grad/layer/encoder.0", "grad/layer/encoder.2", "grad/layer/head")
                  for s, v in series(evs, name) if s == step]
        assert len(layers) == 3
        assert math.sqrt(sum(v * v for v in layers)) == pytest.approx(got[step], rel=1e-5)


def _count_foreach_norm(monkeypatch: pytest.MonkeyPatch) -> List[int]:
    calls = [0]
    real = torch._foreach_norm

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return real(*args, **kwargs)
    monkeypatch.setattr(torch, "_foreach_norm", counting)
    return calls


@pytest.mark.parametrize(("take", "frozen"), [(True, False), (False, False), (True, True)])
def test_gradients_are_read_once_per_step_when_the_job_clips(monkeypatch: pytest.MonkeyPatch, take: bool,
                                                             frozen: bool) -> None:
    """``frozen``: the first layer does not train (as a LoRA base model) while the job clips over all of
    ``model.parameters()``, as HF Trainer does: the watched set is the trained ones."""
    model = Net()
    if frozen:
        model.encoder[0].requires_grad_(False)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.01)
    trainguard.watch(model, opt, clip=1.0, take_clip_norms=take)
    batches = _batches(12)
    _train(model, opt, batches[:2], 1.0)  # the first step reads them itself: the tap is learned
    calls = _count_foreach_norm(monkeypatch)
    _train(model, opt, batches[2:], 1.0)
    assert calls[0] == (10 if take else 20)  # one pass per step (clip's) instead of two
    assert len(series(events(), "grad/global_norm")) == 12


def test_stale_gradients_of_frozen_parameters_are_not_reported_as_the_trained_ones(
        capsys: pytest.CaptureFixture[str]) -> None:
    """A base model trained earlier in the same process, then frozen for an adapter, keeps its old ``.grad``:
    torch's ``clip_grad_norm_`` over ``model.parameters()`` counts it in its total. The reported norm is the
    trained parameters' (the watched set), so a dead adapter (every trained gradient 0) reads 0, not the
    stale constant: the tap is not taken while a frozen parameter in the clip carries a gradient."""
    model = Net()
    base = model.encoder[0]
    base.requires_grad_(False)
    base.weight.grad = torch.full_like(base.weight, 0.5)  # left over from the earlier training
    trained = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(trained, lr=0.01)
    trainguard.watch(model, opt, clip=1e6, every=1)  # a bar nothing reaches: the stale gradient stays as is
    want = []
    for x, y in _batches(6):
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        want.append(float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in trained]))))
        total = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e6))
        assert total > want[-1] + 1e-3  # torch's total counts the stale gradient (its norm alone: 8.0)
        opt.step()
    got = [v for _, v in series(events(), "grad/global_norm")]
    assert got == pytest.approx(want, rel=1e-5)
    assert "failed" not in capsys.readouterr().err  # no hook disabled (the per-layer norms kept their shape)


def test_a_step_without_the_clip_costs_at_most_that_steps_norm() -> None:
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    trainguard.watch(model, opt, clip=1.0)
    _train(model, opt, _batches(20), 1.0, clip_on=lambda i: i != 9)  # step 9: no clip
    steps = [s for s, _ in series(events(), "grad/global_norm")]
    assert steps == [s for s in range(20) if s != 9]  # read again after backward from step 10 on


def test_other_clip_calls_go_to_torch_untouched() -> None:
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    trainguard.watch(model, opt, clip=1.0)
    x, y = _batches(1)[0]
    nn.functional.mse_loss(model(x), y).backward()
    some = list(model.parameters())[:2]  # not the watched set: nothing taken, torch's result
    twin_grads = [p.grad.clone() for p in some]
    total = torch.nn.utils.clip_grad_norm_(some, 0.1, norm_type=1.0)
    assert float(total) == pytest.approx(float(sum(g.abs().sum() for g in twin_grads)), rel=1e-6)
    nn.functional.mse_loss(model(x), y).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    grads[0][0, 0] = float("inf")
    for p, g in zip(model.parameters(), grads):
        p.grad = g
    with pytest.raises(RuntimeError, match="non-finite"):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, error_if_nonfinite=True)
