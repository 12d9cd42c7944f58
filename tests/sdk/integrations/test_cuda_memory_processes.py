"""Other processes on the device (memory/context-leak's inputs): ``device_used`` from the driver and the
optional NVML process list in a snapshot's ``stats``.

CPU-only tests drive the real functions with a stand-in NVML module (an object with pynvml's functions)
and, for the snapshot's CUDA branch, torch.cuda's query functions replaced by monkeypatch; the last tests
need a real CUDA device and skip without one."""

from __future__ import annotations

import os
from typing import Any, Dict, List, Optional

import pytest
import torch
from torch import nn

import trainguard
from trainguard.guard import reset_warnings
from trainguard.integrations import cuda_memory
from trainguard.integrations import torch as tg_torch


class Proc:
    def __init__(self, pid: int, used: Optional[int]) -> None:
        self.pid, self.usedGpuMemory = pid, used


class FakeNvml:
    """pynvml's surface used by cuda_memory: two GPUs, UUIDs as NVML spells them."""

    def __init__(self, procs: Dict[int, List[Proc]], fail: bool = False) -> None:
        self.procs, self.fail = procs, fail
        self.inits = self.queries = 0

    def nvmlInit(self) -> None:
        self.inits += 1

    def nvmlDeviceGetCount(self) -> int:
        return 2

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        return index

    def nvmlDeviceGetUUID(self, handle: int) -> str:
        return ["GPU-1111aaaa-0000", "GPU-2222BBBB-0000"][handle]

    def nvmlDeviceGetComputeRunningProcesses(self, handle: int) -> List[Proc]:
        self.queries += 1
        if self.fail:
            raise RuntimeError("NVML_ERROR_NOT_SUPPORTED")
        return self.procs[handle]


# --- pure parts ---------------------------------------------------------------------------------------
def test_own_pids_has_this_process() -> None:
    assert os.getpid() in cuda_memory.own_pids()


def test_process_stats_with_this_process_listed() -> None:
    me = os.getpid()
    stats = cuda_memory.nvml_process_stats([Proc(me, 900), Proc(4242, 3 << 30), Proc(4343, 100)], {me})
    assert stats == {"nvml_processes": 3.0, "nvml_own_found": 1.0, "nvml_other_processes": 2.0,
                     "nvml_used_bytes": float(900 + (3 << 30) + 100),
                     "nvml_other_bytes": float((3 << 30) + 100)}
    alone = cuda_memory.nvml_process_stats([Proc(me, 900)], {me})
    assert alone["nvml_other_processes"] == 0.0 and alone["nvml_other_bytes"] == 0.0


def test_process_stats_in_another_pid_namespace() -> None:
    """NVML gives host pids: this process is not recognisable, so it is taken to be one of the listed
    processes and no per-process bytes are claimed for the others."""
    stats = cuda_memory.nvml_process_stats([Proc(70001, 900), Proc(70002, 5000)], {12})
    assert stats["nvml_own_found"] == 0.0 and stats["nvml_other_processes"] == 1.0
    assert "nvml_other_bytes" not in stats and stats["nvml_used_bytes"] == 5900.0
    assert cuda_memory.nvml_process_stats([Proc(70001, 900)], {12})["nvml_other_processes"] == 0.0
    assert cuda_memory.nvml_process_stats([], {12})["nvml_other_processes"] == 0.0


def test_process_stats_when_nvml_cannot_tell_the_memory() -> None:
    me = os.getpid()
    stats = cuda_memory.nvml_process_stats([Proc(me, None), Proc(5, None)], {me})
    assert stats["nvml_other_processes"] == 1.0
    assert "nvml_used_bytes" not in stats and "nvml_other_bytes" not in stats


# --- the NVML reader ----------------------------------------------------------------------------------
def test_nvml_matches_the_device_by_uuid_and_caches_the_list() -> None:
    me = os.getpid()
    fake = FakeNvml({0: [Proc(1, 10)], 1: [Proc(me, 700), Proc(8, 300)]})
    now = [100.0]
    nvml = cuda_memory._Nvml(fake, clock=lambda: now[0], refresh_s=30.0)
    first = nvml.stats(0, "2222bbbb-0000")  # torch's spelling: no "GPU-", lower case -> NVML's device 1
    assert first["nvml_other_bytes"] == 300.0 and first["nvml_own_found"] == 1.0
    now[0] += 29.0
    assert nvml.stats(0, "2222bbbb-0000") == first and fake.queries == 1  # cached
    now[0] += 2.0
    fake.procs[1] = [Proc(me, 700)]
    assert nvml.stats(0, "2222bbbb-0000")["nvml_other_processes"] == 0.0 and fake.queries == 2
    assert fake.inits == 1


def test_nvml_errors_turn_it_off_quietly(capsys: pytest.CaptureFixture[str]) -> None:
    reset_warnings()
    fake = FakeNvml({0: [], 1: []}, fail=True)
    nvml = cuda_memory._Nvml(fake)
    assert nvml.stats(0, "1111aaaa-0000") == {}
    assert nvml.stats(0, "1111aaaa-0000") == {} and fake.queries == 1  # off: never asked again
    assert "NVML process listing unavailable" in capsys.readouterr().err


def test_nvml_unmatched_device_under_cuda_visible_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    fake = FakeNvml({0: [Proc(1, 1)], 1: []})
    assert cuda_memory._Nvml(fake).stats(0, "ffff-0000") == {}  # index 0 is not NVML's 0 here: no guess
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert cuda_memory._Nvml(fake).stats(0, None)["nvml_processes"] == 1.0  # no remapping: by index


# --- snapshots -----------------------------------------------------------------------------------------
def test_cuda_snapshot_reports_device_used_and_other_processes(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA branch of memory_snapshot, with torch.cuda's host-side queries standing in for a GPU."""

    class Props:
        total_memory = 80 << 30
        uuid = "1111aaaa-0000"

    stats = {"allocated_bytes.all.current": 10 << 30, "reserved_bytes.all.current": 12 << 30,
             "active_bytes.all.current": 10 << 30, "allocated_bytes.all.peak": 11 << 30,
             "allocated_bytes.all.allocated": 500 << 30, "allocation.all.allocated": 12345}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device=None: dict(stats))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (60 << 30, 80 << 30))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: Props())
    monkeypatch.setattr(cuda_memory, "_capacity", {})
    fake = FakeNvml({0: [Proc(os.getpid(), 13 << 30), Proc(4242, 7 << 30)], 1: []})
    monkeypatch.setattr(cuda_memory, "_NVML", cuda_memory._Nvml(fake))
    snap = cuda_memory.memory_snapshot("cuda:0", with_free=True)
    assert snap["free"] == 60 << 30 and snap["stats"]["device_used"] == float(20 << 30)
    assert snap["stats"]["nvml_other_bytes"] == float(7 << 30) and snap["stats"]["nvml_other_processes"] == 1
    assert snap["stats"]["allocated_bytes.all.allocated"] == float(500 << 30)  # for the allocation rate
    plain = cuda_memory.memory_snapshot("cuda:0")  # without free: no driver or NVML query at all
    assert "device_used" not in plain["stats"] and "nvml_processes" not in plain["stats"]
    assert fake.queries == 1


def test_cpu_runs_never_touch_nvml(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a machine without CUDA, watch()'s memory reports are RSS only and NVML is never loaded."""
    fresh = cuda_memory._Nvml()
    monkeypatch.setattr(cuda_memory, "_NVML", fresh)
    trainguard.init(endpoint="memory://", spool_dir="", heartbeat_interval=0, capture_exit=False,
                    watch_overhead_budget=0, capture_uncaught=False)
    try:
        model = nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        trainguard.watch(model, opt, memory_every=1)
        for _ in range(3):
            opt.zero_grad()
            model(torch.randn(2, 4)).sum().backward()
            opt.step()
        assert trainguard.flush(5)
        client = trainguard.get_client()
        assert client is not None
        memory = [e["memory"] for e in client.worker._transport.events  # type: ignore[attr-defined]
                  if "memory" in e]
        assert len(memory) == 3 and all(set(m) == {"device", "rss"} for m in memory)
        assert fresh._state == "unknown"
    finally:
        tg_torch.unwatch_all()
        trainguard.shutdown(timeout=2)


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@needs_cuda
def test_real_device_used_and_nvml_list() -> None:
    keep = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    snap = cuda_memory.memory_snapshot("cuda", with_free=True)
    free, total = torch.cuda.mem_get_info()
    used = snap["stats"]["device_used"]
    assert abs(used - (total - free)) <= 256 << 20  # other processes may move a little in between
    assert used >= snap["reserved"] >= keep.numel()
    try:
        import pynvml  # noqa: F401
    except ImportError:
        assert "nvml_processes" not in snap["stats"]
        return
    stats: Dict[str, Any] = snap["stats"]
    if "nvml_processes" in stats:  # NVML answered on this machine
        assert stats["nvml_processes"] >= stats["nvml_other_processes"]
        if stats["nvml_own_found"]:
            assert stats["nvml_other_processes"] == stats["nvml_processes"] - 1
