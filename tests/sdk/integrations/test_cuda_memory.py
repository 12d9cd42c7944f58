"""Memory signals on a CPU-only machine: RSS snapshots, periodic reports from watch(), and the OOM enricher
on real torch out-of-memory errors (a real CPU allocation failure and the real ``torch.OutOfMemoryError``
class with the CUDA allocator's message)."""

from __future__ import annotations

import json
from typing import Any, Dict, Iterator, List

import pytest
import torch
from torch import nn

import trainguard
from tests.support.sdk_events import events
from trainguard.guard import reset_warnings
from trainguard.integrations import cuda_memory
from trainguard.integrations import torch as tg_torch

CUDA_OOM_TEXT = ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.11 GiB "
                 "of which 1.05 GiB is free. Of the allocated memory 74.2 GiB is allocated by PyTorch")


@pytest.fixture(autouse=True)
def _sdk() -> Iterator[None]:
    reset_warnings()
    trainguard.init(endpoint="memory://", spool_dir="", heartbeat_interval=0, capture_exit=False,
                    watch_overhead_budget=0,  # exact per-step semantics; the budget has its own test
                    capture_uncaught=False)
    yield
    tg_torch.unwatch_all()
    trainguard.shutdown(timeout=2)




def vm_rss() -> int:
    """RSS from /proc/self/status, independently of the module's /proc/self/statm reading."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


# --- snapshots -------------------------------------------------------------------------------------
def test_cpu_snapshot_is_rss_only() -> None:
    snap = cuda_memory.memory_snapshot("cpu")
    assert set(snap) == {"device", "rss"} and snap["device"] == "cpu"
    assert abs(snap["rss"] - vm_rss()) < 0.2 * vm_rss()
    assert cuda_memory.memory_snapshot()["device"] == "cpu"  # no CUDA here: the default is the host
    # asking for a CUDA device on a machine without CUDA never initialises it: RSS only
    assert set(cuda_memory.memory_snapshot("cuda:0")) == {"device", "rss"}


def test_fragmentation() -> None:
    assert cuda_memory.fragmentation(0, 0) == 0.0
    assert cuda_memory.fragmentation(100, 25) == 0.75
    assert cuda_memory.fragmentation(100, 100) == 0.0


def test_watch_reports_rss_every_memory_every_steps_on_cpu() -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    trainguard.watch(model, opt, memory_every=3)
    for _ in range(7):
        opt.zero_grad()
        model(torch.randn(4, 4)).sum().backward()
        opt.step()
    evs = events()
    memory = [e for e in evs if "memory" in e]
    assert [e["step"] for e in memory] == [0, 2, 5]  # the first step, then every 3rd
    assert all(set(e["memory"]) == {"device", "rss"} and e["memory"]["rss"] > 0 for e in memory)
    names = {p["name"] for e in evs for p in e.get("metrics", {}).get("points", [])}
    assert "mem/rss" in names and not {"mem/allocated", "mem/reserved", "mem/fragmentation"} & names


# --- out of memory ---------------------------------------------------------------------------------
def _capture(exc: BaseException) -> List[Dict[str, Any]]:
    try:
        raise exc
    except BaseException as raised:
        trainguard.capture_exception(raised)
    return events()


def test_oom_enricher_on_the_real_cuda_oom_class() -> None:
    client = trainguard.get_client()
    assert client is not None
    cuda_memory.install_oom_enricher(client)
    cuda_memory.install_oom_enricher(client)  # idempotent: one enricher, one snapshot per OOM
    evs = _capture(torch.OutOfMemoryError(CUDA_OOM_TEXT))
    exc = next(e["exception"] for e in evs if "exception" in e)
    assert exc["type"] == "torch.OutOfMemoryError"
    context = exc["context"]
    assert {"oom_device", "memory_summary", "host_rss"} <= set(context)
    assert context["oom_device"] == "cpu"  # CUDA is not initialised on this machine
    snapshots = [e for e in evs if "memory" in e]
    assert len(snapshots) == 1 and snapshots[0]["severity"] == "ERROR"
    assert snapshots[0]["memory"]["rss"] > 0


def test_a_real_cpu_allocation_failure_is_attributed_to_the_watched_model() -> None:
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 1))
    model[1].requires_grad_(False)  # frozen parameters count too
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    trainguard.watch(model, opt)  # installs the enricher and registers the model's attribution
    opt.zero_grad()
    model(torch.randn(2, 64)).sum().backward()
    opt.step()
    try:
        torch.empty(2 ** 60, dtype=torch.uint8)  # a real allocator failure, raised by torch
    except RuntimeError as real:
        oom: RuntimeError = real
    evs = _capture(oom)
    context = next(e["exception"] for e in evs if "exception" in e)["context"]
    assert context["oom_device"] == "cpu"
    attribution = json.loads(context["memory_attribution"])
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    grad_bytes = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters() if p.grad is not None)
    assert attribution == {"params_bytes": param_bytes, "grads_bytes": grad_bytes,
                           "optimizer_state_bytes": 2 * grad_bytes + 8}  # exp_avg, exp_avg_sq, step
    snapshot = next(e["memory"] for e in evs if "memory" in e and e["severity"] == "ERROR")
    assert snapshot["stats"]["attribution.params_bytes"] == float(param_bytes)


def test_an_oom_wrapped_in_another_error_is_still_recognised() -> None:
    client = trainguard.get_client()
    assert client is not None
    cuda_memory.install_oom_enricher(client)
    try:
        try:
            raise torch.OutOfMemoryError(CUDA_OOM_TEXT)
        except torch.OutOfMemoryError as inner:
            raise RuntimeError("training step failed") from inner
    except RuntimeError as outer:
        evs = _capture(outer)
    exc = next(e["exception"] for e in evs if "exception" in e)
    assert "memory_summary" in exc["context"]
    old_style = RuntimeError("CUDA out of memory. Tried to allocate 20.00 MiB")  # torch < 2.1 raised this
    assert cuda_memory.is_oom(old_style)


def test_other_errors_get_no_memory_context() -> None:
    client = trainguard.get_client()
    assert client is not None
    cuda_memory.install_oom_enricher(client)
    evs = _capture(ValueError("shape mismatch"))
    exc = next(e["exception"] for e in evs if "exception" in e)
    assert "context" not in exc or "memory_summary" not in exc["context"]
    assert not [e for e in evs if "memory" in e]


def test_a_removed_watch_no_longer_attributes() -> None:
    model = nn.Linear(4, 4)
    handle = trainguard.watch(model, torch.optim.SGD(model.parameters(), lr=0.1))
    handle.remove()
    evs = _capture(torch.OutOfMemoryError(CUDA_OOM_TEXT))
    context = next(e["exception"] for e in evs if "exception" in e)["context"]
    assert "memory_summary" in context and "memory_attribution" not in context


# --- CUDA (run on the GPU machine; skipped where there is no GPU) -----------------------------------
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@needs_cuda
def test_cuda_snapshot_fields() -> None:
    keep = [torch.empty(1 << 20, device="cuda") for _ in range(4)]
    del keep[1]  # a hole: reserved but inactive
    snap = cuda_memory.memory_snapshot("cuda")
    stats = torch.cuda.memory_stats()
    assert snap["device"] == f"cuda:{torch.cuda.current_device()}"
    assert snap["allocated"] == stats["allocated_bytes.all.current"] > 0
    assert snap["reserved"] >= snap["active"] >= snap["allocated"] - 1
    assert snap["total_capacity"] == torch.cuda.get_device_properties(0).total_memory
    assert 0.0 <= snap["fragmentation"] < 1.0 and "free" not in snap and "summary" not in snap
    assert "allocated_bytes.all.peak" in snap["stats"] and snap["rss"] > 0
    assert 0 < cuda_memory.memory_snapshot("cuda", with_free=True)["free"] <= snap["total_capacity"]


@needs_cuda
def test_a_real_cuda_oom_carries_summary_stats_and_attribution() -> None:
    model = nn.Linear(1024, 1024).cuda()
    trainguard.watch(model, torch.optim.SGD(model.parameters(), lr=0.1))
    try:
        torch.empty(1 << 50, dtype=torch.uint8, device="cuda")  # 1 PiB: a real allocator failure
    except torch.OutOfMemoryError as real:
        oom: torch.OutOfMemoryError = real
    evs = _capture(oom)
    context = next(e["exception"] for e in evs if "exception" in e)["context"]
    assert context["oom_device"].startswith("cuda:")
    assert "memory summary" in context["memory_summary"].lower()
    assert json.loads(context["memory_stats"])["num_ooms"] >= 1
    assert int(context["memory_free"]) > 0
    assert json.loads(context["memory_attribution"])["params_bytes"] == (1024 * 1024 + 1024) * 4
    snapshot = next(e for e in evs if "memory" in e and e["severity"] == "ERROR")["memory"]
    assert snapshot["num_ooms"] >= 1 and "summary" in snapshot and snapshot["free"] > 0


@needs_cuda
def test_watch_reports_cuda_memory_metrics() -> None:
    model = nn.Linear(64, 64).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    trainguard.watch(model, opt, memory_every=2)
    for _ in range(4):
        opt.zero_grad()
        model(torch.randn(8, 64, device="cuda")).sum().backward()
        opt.step()
    evs = events()
    memory = [e["memory"] for e in evs if "memory" in e]
    assert len(memory) == 3
    assert all(m["device"].startswith("cuda") and m["allocated"] > 0 and m["free"] > 0 for m in memory)
    names = {p["name"] for e in evs for p in e.get("metrics", {}).get("points", [])}
    assert {"mem/allocated", "mem/reserved", "mem/fragmentation", "mem/rss"} <= names
