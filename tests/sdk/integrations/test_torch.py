"""watch(): real torch training on CPU; what the SDK reports is checked against independent computations."""

from __future__ import annotations

import math
import os
import socket
from typing import Any, Dict, Iterator, List, Optional, Tuple

import pytest
import torch
from torch import nn

import trainguard
from tests.support.sdk_events import events, series
from trainguard.guard import reset_warnings
from trainguard.integrations import torch as tg_torch


@pytest.fixture(autouse=True)
def _sdk() -> Iterator[None]:
    reset_warnings()
    torch.manual_seed(0)
    trainguard.init(endpoint="memory://", spool_dir="", heartbeat_interval=0, capture_exit=False,
                    watch_overhead_budget=0,  # exact per-step semantics; the budget has its own test
                    capture_uncaught=False)
    yield
    tg_torch.unwatch_all()
    trainguard.shutdown(timeout=2)






def ref_norm(grads: List[torch.Tensor]) -> float:
    """The global L2 norm computed independently (float64, no foreach)."""
    return math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads))


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1))


def batch(n: int = 16) -> Tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(n, 8)
    return x, x.sum(dim=1, keepdim=True).sin()


def rel_close(a: float, b: float, tol: float = 1e-4) -> bool:
    return abs(a - b) <= tol * max(abs(b), 1e-12)


# --- layers ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(("name", "depth", "layer"), [
    ("0.weight", 2, "0"),
    ("encoder.layers.3.self_attn.in_proj_weight", 2, "encoder.layers.3"),
    ("transformer.h.0.attn.c_attn.weight", 2, "transformer.h.0"),
    ("bert.encoder.layer.11.output.dense.bias", 2, "bert.encoder.layer.11"),
    ("bert.embeddings.word_embeddings.weight", 2, "bert.embeddings"),
    ("bert.embeddings.word_embeddings.weight", 1, "bert"),
    ("bert.embeddings.word_embeddings.weight", 3, "bert.embeddings.word_embeddings"),
    ("lm_head.weight", 2, "lm_head"),
    ("pos_emb", 2, "pos_emb"),
])
def test_layer_rule(name: str, depth: int, layer: str) -> None:
    assert tg_torch.layer_of(name, depth) == layer


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ff = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16))
        self.norm = nn.LayerNorm(16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x + self.ff(x))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 16)
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(16, 1)
        self.scale = nn.Parameter(torch.ones(1))
        self.frozen = nn.Linear(16, 16).requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(self.frozen(h)) * self.scale


# --- norms -----------------------------------------------------------------------------------------
def test_global_norm_equals_clip_grad_norm_over_30_steps() -> None:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    handle = trainguard.watch(model, opt)
    assert isinstance(handle, tg_torch.WatchHandle) and handle.boundary == "optimizer.step"
    refs, clip_refs = [], []
    for _ in range(30):
        x, y = batch()
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        refs.append(ref_norm([p.grad for p in model.parameters()]))
        clip_refs.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)))
        opt.step()
    got = series(events(), "grad/global_norm")
    assert [s for s, _ in got] == list(range(30))
    for (_, value), ref, clip_ref in zip(got, refs, clip_refs):
        assert rel_close(value, ref) and rel_close(value, clip_ref)
    assert trainguard.get_client().step == 29  # type: ignore[union-attr]


def test_norms_are_taken_before_clipping_and_clip_triggers_are_counted() -> None:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    clip = 0.8
    trainguard.watch(model, opt, clip=clip)
    returned = []
    for _ in range(30):
        x, y = batch()
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        returned.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
    evs = events()
    norms = [v for _, v in series(evs, "grad/global_norm")]
    triggered = [v for _, v in series(evs, "grad/clip_triggered")]
    assert all(rel_close(a, b) for a, b in zip(norms, returned))  # pre-clip, as clip_grad_norm_ says
    expected = [1.0 if r > clip else 0.0 for r in returned]
    assert triggered == expected
    assert 0 < sum(expected) < 30  # the threshold really splits the run


def test_per_layer_names_and_values() -> None:
    model = Net()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    handle = trainguard.watch(model, opt, every=5)
    assert handle.layout.layer_names == ("scale", "embed", "blocks.0", "blocks.1", "blocks.2", "head")
    per_step: List[Dict[str, float]] = []
    for _ in range(10):
        x = torch.randn(8, 4)
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        by_layer: Dict[str, List[torch.Tensor]] = {}
        for name, p in model.named_parameters():
            if p.grad is not None:
                by_layer.setdefault(tg_torch.layer_of(name, 2), []).append(p.grad)
        per_step.append({k: ref_norm(v) for k, v in by_layer.items()})
        opt.step()
    evs = events()
    names = sorted({p["name"] for e in evs for p in e.get("metrics", {}).get("points", [])
                    if p["name"].startswith("grad/layer/")})
    assert names == sorted(f"grad/layer/{n}" for n in handle.layout.layer_names)
    assert "grad/layer/frozen" not in names
    for layer in handle.layout.layer_names:
        got = series(evs, f"grad/layer/{layer}")
        assert [s for s, _ in got] == [0, 4, 9]  # first step, then every 5th
        for step, value in got:
            assert rel_close(value, per_step[step][layer])


def test_gradient_accumulation_reports_the_accumulated_gradient() -> None:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    trainguard.watch(model, opt)
    refs = []
    for _ in range(5):
        opt.zero_grad()
        for _ in range(3):  # three micro-batches per optimizer step
            x, y = batch(4)
            (nn.functional.mse_loss(model(x), y) / 3).backward()
        refs.append(ref_norm([p.grad for p in model.parameters()]))
        opt.step()
    got = series(events(), "grad/global_norm")
    assert [s for s, _ in got] == [0, 1, 2, 3, 4]
    assert all(rel_close(v, r) for (_, v), r in zip(got, refs))


def test_without_an_optimizer_each_backward_is_a_step() -> None:
    model = mlp()
    handle = trainguard.watch(model)
    assert handle.boundary == "backward"
    refs = []
    for _ in range(4):
        model.zero_grad()
        x, y = batch()
        nn.functional.mse_loss(model(x), y).backward()
        refs.append(ref_norm([p.grad for p in model.parameters()]))
    got = series(events(), "grad/global_norm")
    assert [s for s, _ in got] == [0, 1, 2, 3]
    assert all(rel_close(v, r) for (_, v), r in zip(got, refs))


def test_sparse_gradients_take_the_general_path() -> None:
    emb = nn.Embedding(50, 8, sparse=True)
    head = nn.Linear(8, 1)
    model = nn.ModuleDict({"emb": emb, "head": head})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    trainguard.watch(model, opt)
    refs = []
    for _ in range(3):
        idx = torch.randint(0, 50, (16,))
        opt.zero_grad()
        head(emb(idx)).pow(2).mean().backward()
        dense = [emb.weight.grad.to_dense(), head.weight.grad, head.bias.grad]
        refs.append(ref_norm(dense))
        opt.step()
    got = series(events(), "grad/global_norm")
    assert len(got) == 3 and all(rel_close(v, r) for (_, v), r in zip(got, refs))


@pytest.mark.parametrize("dtypes", [(torch.float64,), (torch.bfloat16,), (torch.float16,),
                                    (torch.float32, torch.float64)], ids=["fp64", "bf16", "fp16", "mixed"])
def test_norms_for_every_gradient_dtype(dtypes: Tuple[torch.dtype, ...]) -> None:
    model = mlp()
    for i, layer in enumerate(m for m in model if isinstance(m, nn.Linear)):
        layer.to(dtypes[i % len(dtypes)])
    handle = trainguard.watch(model)
    refs = []
    for _ in range(3):
        model.zero_grad()
        h = torch.randn(16, 8)
        for layer in model:
            h = layer(h.to(layer.weight.dtype)) if isinstance(layer, nn.Linear) else layer(h)
        h.float().pow(2).mean().backward()
        refs.append(ref_norm([p.grad for p in model.parameters()]))
    got = series(events(), "grad/global_norm")
    assert len(got) == 3 and all(rel_close(v, r) for (_, v), r in zip(got, refs))
    assert handle._norms._general == (len(dtypes) > 1)  # one fused call unless fp64 is mixed in


def test_norm_every_samples_the_global_norm() -> None:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    trainguard.watch(model, opt, norm_every=3, every=0)
    _train(model, opt, 7)
    assert [s for s, _ in series(events(), "grad/global_norm")] == [0, 2, 5]  # first, then every 3rd


def test_a_disabled_scaler_leaves_the_optimizer_step_as_the_boundary() -> None:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    handle = trainguard.watch(model, opt, scaler=scaler)
    assert handle.boundary == "optimizer.step" and "update" not in scaler.__dict__
    _train(model, opt, 2)  # never calls scaler.update()
    evs = events()
    assert len(series(evs, "grad/global_norm")) == 2 and series(evs, "amp/scale") == []


def test_ddp_norms_are_read_after_the_all_reduce(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setitem(os.environ, "MASTER_ADDR", "127.0.0.1")
    monkeypatch.setitem(os.environ, "MASTER_PORT", str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        model = nn.parallel.DistributedDataParallel(mlp())
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        handle = trainguard.watch(model, opt)
        assert handle.layout.layer_names == ("0", "2", "4")  # unwrapped: no "module." prefix
        refs = []
        for _ in range(3):
            opt.zero_grad()
            x, y = batch()
            nn.functional.mse_loss(model(x), y).backward()
            refs.append(ref_norm([p.grad for p in model.parameters()]))
            opt.step()
    finally:
        dist.destroy_process_group()
    got = series(events(), "grad/global_norm")
    assert len(got) == 3 and all(rel_close(v, r) for (_, v), r in zip(got, refs))


# --- non-finite values -----------------------------------------------------------------------------
def test_a_diverging_run_is_alerted_with_recent_history() -> None:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e6)  # diverges within a few steps
    trainguard.watch(model, opt)
    for _ in range(12):
        x, y = batch()
        loss = nn.functional.mse_loss(model(x), y)
        trainguard.log(loss=loss.detach())  # a tensor: read back on the worker thread
        opt.zero_grad()
        loss.backward()
        opt.step()
    evs = events()
    alerts = [e["metrics"] for e in evs if e.get("metrics", {}).get("alert")]
    kinds = {a["alert"] for a in alerts}
    assert "non_finite:loss" in kinds
    assert "non_finite:grad/global_norm" in kinds
    first_loss_alert = next(a for a in alerts if a["alert"] == "non_finite:loss")
    recent_names = {r["name"] for r in first_loss_alert["recent"]}
    assert {"loss", "grad/global_norm", "opt/lr"} <= recent_names
    assert any(r["name"] == "loss" and not isinstance(r["value"], str) for r in first_loss_alert["recent"])
    severities = {e["severity"] for e in evs if e.get("metrics", {}).get("alert")}
    assert severities == {"ERROR"}


# --- AMP -------------------------------------------------------------------------------------------
def test_grad_scaler_on_cpu_reports_scale_overflow_and_unscaled_norms() -> None:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 24, growth_interval=1000)
    handle = trainguard.watch(model, opt, scaler=scaler)
    assert handle.boundary == "scaler.update" and "update" in scaler.__dict__
    scales, refs, skipped = [], [], []
    for _ in range(14):  # fp16 activations' gradients overflow at this scale until it backs off
        x, y = batch()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = nn.functional.mse_loss(model(x).float(), y)
        opt.zero_grad()
        scales.append(float(scaler.get_scale()))  # the test may sync; the SDK does not
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        grads = [p.grad for p in model.parameters()]
        refs.append(ref_norm(grads))
        skipped.append(not all(bool(torch.isfinite(g).all()) for g in grads))
        scaler.step(opt)
        scaler.update()
    evs = events()
    assert [v for _, v in series(evs, "amp/scale")] == scales
    overflow = [v for _, v in series(evs, "amp/overflow")]
    assert overflow == [1.0 if s else 0.0 for s in skipped]
    assert overflow[0] == 1.0 and overflow[-1] == 0.0  # the scale backed off until gradients fit
    norms = series(evs, "grad/global_norm")
    assert [s for s, _ in norms] == list(range(14))  # skipped optimizer steps still count
    for (_, value), ref, skip in zip(norms, refs, skipped):
        assert (not math.isfinite(value)) if skip else rel_close(value, ref)
    handle.remove()
    assert "update" not in scaler.__dict__


# --- step time, progress ---------------------------------------------------------------------------
def test_step_time_is_recorded_and_fed_to_the_client() -> None:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    trainguard.watch(model, opt)
    for _ in range(6):
        x, y = batch()
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    times = series(events(), "time/step_s")
    assert [s for s, _ in times] == [1, 2, 3, 4, 5]  # the first step has no previous boundary
    assert all(0 < v < 5 for _, v in times)
    client = trainguard.get_client()
    assert client is not None and client.step_time_ewma > 0 and client.step == 5


# --- never raise -----------------------------------------------------------------------------------
def test_a_failing_hook_is_disabled_once_and_training_continues(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("injected failure")

    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    handle = trainguard.watch(model, opt)
    monkeypatch.setattr(torch, "_foreach_norm", broken)
    before = [p.detach().clone() for p in model.parameters()]
    for _ in range(5):
        x, y = batch()
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))  # it trained
    assert "gradients" in handle.disabled and "injected failure" in handle.disabled["gradients"]
    err = capsys.readouterr().err
    assert err.count("the gradients hook failed") == 1
    evs = events()
    assert series(evs, "grad/global_norm") == []
    assert len(series(evs, "time/step_s")) == 4  # the rest of the watch keeps working


def test_a_failing_step_hook_never_reaches_the_optimizer(monkeypatch: pytest.MonkeyPatch) -> None:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    handle = trainguard.watch(model, opt)
    client = trainguard.get_client()
    assert client is not None

    def broken(*args: Any, **kwargs: Any) -> int:
        raise ValueError("client broke")

    monkeypatch.setattr(client, "note_optimizer_step", broken)
    for _ in range(3):
        x, y = batch()
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    assert "step" in handle.disabled


# --- lifecycle of a watch --------------------------------------------------------------------------
def _train(model: nn.Module, opt: Optional[torch.optim.Optimizer], steps: int) -> None:
    for _ in range(steps):
        x, y = batch()
        model.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        if opt is not None:
            opt.step()


def test_watching_twice_replaces_the_first_watch() -> None:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    first = trainguard.watch(model, opt)
    second = trainguard.watch(model, opt, clip=1.0)
    assert first.removed and not second.removed
    _train(model, opt, 3)
    evs = events()
    assert [s for s, _ in series(evs, "grad/global_norm")] == [0, 1, 2]  # once per step, not twice
    assert len(series(evs, "grad/clip_triggered")) == 3  # the second watch's settings


def test_remove_stops_reporting_and_is_idempotent() -> None:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    handle = trainguard.watch(model, opt)
    _train(model, opt, 2)
    handle.remove()
    handle.remove()
    _train(model, opt, 3)
    assert len(series(events(), "grad/global_norm")) == 2
    assert tg_torch.unwatch_all() == 0


def test_watch_refuses_what_is_not_a_module(capsys: pytest.CaptureFixture[str]) -> None:
    client = trainguard.get_client()
    assert client is not None
    with pytest.raises(TypeError, match=r"torch\.nn\.Module"):
        tg_torch.watch(client, object())
    assert trainguard.watch(object()) is None  # the public API reports instead of raising
    assert "watch() needs a torch.nn.Module" in capsys.readouterr().err


# --- CUDA (run on the GPU machine; skipped where there is no GPU) -----------------------------------
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@needs_cuda
def test_on_cuda_the_training_thread_never_synchronises() -> None:
    """Every per-step path on (norms, per-layer every step, clip, memory every step, a tensor loss) under
    ``set_sync_debug_mode("error")``; the worker does not drain during the window (the debug mode is
    process-wide and the worker's read-back is a sync by design), then the values are checked."""
    trainguard.shutdown()
    trainguard.init(endpoint="memory://", spool_dir="", heartbeat_interval=0, capture_exit=False,
                    watch_overhead_budget=0,  # exact per-step semantics; the budget has its own test
                    capture_uncaught=False, flush_interval=3600.0, max_batch_events=100_000,
                    max_queue_events=100_000)
    device = torch.device("cuda")
    model = Net().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    xs = [torch.randn(32, 4, device=device) for _ in range(6)]
    torch.cuda.synchronize()
    refs = []
    torch.cuda.set_sync_debug_mode("error")
    try:
        trainguard.watch(model, opt, clip=0.5, every=1, memory_every=1)
        for x in xs:
            loss = model(x).pow(2).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            refs.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5))  # stays on the device
            opt.step()
            trainguard.log(loss=loss.detach())
    finally:
        torch.cuda.set_sync_debug_mode(0)
    evs = events()
    got = series(evs, "grad/global_norm")
    assert [s for s, _ in got] == list(range(6))
    assert all(rel_close(v, float(r)) for (_, v), r in zip(got, refs))
    assert [v for _, v in series(evs, "grad/clip_triggered")] == [1.0 if float(r) > 0.5 else 0.0 for r in refs]
    assert len(series(evs, "grad/layer/blocks.1")) == 6 and len(series(evs, "mem/allocated")) == 6
    assert len(series(evs, "loss")) == 6


@needs_cuda
def test_on_cuda_fp16_grad_scaler_overflows_are_reported() -> None:
    device = torch.device("cuda")
    model = mlp().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0 ** 24)
    trainguard.watch(model, opt, scaler=scaler)
    skipped = []
    for _ in range(14):
        x = torch.randn(16, 8, device=device)
        with torch.autocast("cuda", dtype=torch.float16):
            loss = nn.functional.mse_loss(model(x).float(), x.sum(1, keepdim=True).sin())
        opt.zero_grad()
        scaler.scale(loss).backward()
        before = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        skipped.append(scaler.get_scale() < before)
    evs = events()
    assert [v for _, v in series(evs, "amp/overflow")] == [1.0 if s else 0.0 for s in skipped]
    assert any(skipped) and [s for s, _ in series(evs, "grad/global_norm")] == list(range(14))


def test_overhead_budget_stretches_the_norm_cadence_and_keeps_values_exact() -> None:
    """A tiny model on CPU: one norm pass is a visible share of the step, so with a budget the global
    norm is read every few steps — and the values it reports are still exact for their steps."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    handle = trainguard.watch(model, opt, overhead_budget=0.0001, every=0)
    refs = []
    for _ in range(60):
        x, y = batch()
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        refs.append(ref_norm([p.grad for p in model.parameters()]))
        opt.step()
    assert handle.adaptive_every > 1
    got = series(events(), "grad/global_norm")
    steps = [s for s, _ in got]
    assert 0 in steps and len(steps) < 60  # the first step always, then sampled
    for step, value in got:
        assert rel_close(value, refs[step])
    handle.remove()
    trainguard.shutdown()
    trainguard.init(endpoint="memory://", spool_dir="", heartbeat_interval=0, capture_exit=False,
                    capture_uncaught=False)  # the default budget: 0.5% of the step
    generous = trainguard.watch(model, opt, overhead_budget=1.0, every=0)
    for _ in range(20):
        x, y = batch()
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    assert generous.adaptive_every == 1
    assert len(series(events(), "grad/global_norm")) == 20


def test_a_cadence_change_at_the_boundary_never_reports_the_clipped_norm(monkeypatch: pytest.MonkeyPatch) -> None:
    """The budget decides at the end of backward whether a step's norm is read; when it shortens the
    cadence at the step boundary (after clip_grad_norm_ ran), that step has no norm -- it must not read
    the gradients there, which are the clipped ones (a norm of exactly the clip threshold)."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    clip = 1e-3  # every step clipped: a clipped norm would read exactly 1e-3
    handle = trainguard.watch(model, opt, clip=clip, overhead_budget=0.01, every=0)
    cadences = iter([4, 4, 1, 4, 4, 1, 4, 4, 1, 4, 4, 1] * 3)

    def adapt() -> None:  # the boundary's cadence decision, made to flip between the two calls
        handle.adaptive_every = next(cadences)

    monkeypatch.setattr(handle, "_adapt_cadence", adapt)
    returned: Dict[int, float] = {}
    for step in range(30):
        x, y = batch()
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        returned[step] = float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip))
        opt.step()
    got = series(events(), "grad/global_norm")
    assert 1 < len(got) < 30  # sampled
    for step, value in got:
        assert rel_close(value, returned[step]), (step, value, returned[step])  # pre-clip, never 1e-3
    assert all(v > 10 * clip for _s, v in got)
    assert {v for _s, v in series(events(), "grad/clip_threshold")} == {clip}


def test_with_the_default_budget_every_reported_norm_is_clip_grad_norms_return() -> None:
    """A plain loop as users write it (default overhead budget, clipping on): wherever the SDK reports a
    norm, it is the value clip_grad_norm_ returned for that step."""
    trainguard.shutdown()
    trainguard.init(endpoint="memory://", spool_dir="", heartbeat_interval=0, capture_exit=False,
                    capture_uncaught=False)  # the default budget
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    trainguard.watch(model, opt, clip=0.5)
    returned: Dict[int, float] = {}
    for step in range(80):
        x, y = batch()
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        returned[step] = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5))
        opt.step()
    got = series(events(), "grad/global_norm")
    assert got and got[0][0] == 0
    for step, value in got:
        assert rel_close(value, returned[step]), (step, value, returned[step])


def test_memory_is_sampled_by_time_as_well_as_by_step_count() -> None:
    """A short run of slow steps: by step count alone (memory_every=50) 60 steps give 2 samples, too few
    for a leak verdict; with memory_interval_s the watch also samples once that much training time has
    passed. memory_interval_s=0 keeps the step cadence exactly."""
    import time as time_mod

    def run(interval: float) -> int:
        model = mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        handle = trainguard.watch(model, opt, memory_every=50, memory_interval_s=interval)
        for _ in range(60):
            x, y = batch()
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            time_mod.sleep(0.01)
        handle.remove()
        return len({s for s, _v in series(events(), "mem/rss")})

    by_steps = run(0.0)
    assert by_steps == 2  # steps 0 and 49 (the first step, then every 50)
    trainguard.shutdown()
    trainguard.init(endpoint="memory://", spool_dir="", heartbeat_interval=0, capture_exit=False,
                    watch_overhead_budget=0, capture_uncaught=False)
    assert run(0.05) >= 5  # ~0.6 s of training, a sample every 0.05 s at most


class _SubclassedSGD(torch.optim.SGD):
    """A custom optimizer whose step() calls its base's, as many do."""

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        return super().step(closure)


def test_a_subclassed_optimizer_step_is_one_step() -> None:
    """torch wraps each optimizer class's step() with the step hooks once an instance of it exists, so a
    subclass calling super().step() runs the hooks twice: still one boundary (it counted two before)."""
    torch.optim.SGD(mlp().parameters(), lr=0.1)  # any plain SGD earlier in the process wraps SGD.step
    model = mlp()
    opt = _SubclassedSGD(model.parameters(), lr=0.05)
    trainguard.watch(model, opt)
    for _ in range(6):
        x, y = batch()
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    assert [s for s, _ in series(events(), "grad/global_norm")] == list(range(6))
    assert trainguard.get_client().step == 5  # type: ignore[union-attr]
