"""Memory signals: periodic CUDA allocator snapshots, host RSS, and context for out-of-memory errors.

The periodic path never synchronises with the device: ``torch.cuda.memory_stats`` reads the caching
allocator's host-side counters (about 0.13 ms on the H200 machine's host), the capacity comes from the
cached device properties, RSS from ``/proc/self/statm``, and ``free`` from ``torch.cuda.mem_get_info``
(``cudaMemGetInfo``): measured there at 0.09-0.10 ms, returning while 300 ms of queued GPU work was still
pending, i.e. a driver query that does not wait for the device. All of it runs every ``memory_every``
optimizer steps only.

Public functions:

- :func:`memory_snapshot` — a MemorySnapshot payload (proto3 JSON mapping) for one device or ``"cpu"``;
- :func:`report_memory` — send snapshots as ``memory`` events plus ``mem/*`` metrics (``watch`` calls it
  every ``memory_every`` optimizer steps);
- :func:`install_oom_enricher` — make every captured OOM carry ``memory_summary()``, the allocator's
  stats and a MemorySnapshot event; idempotent per client, usable without ``watch``;
- :func:`add_attribution` / :func:`remove_attribution` — let ``watch`` say how much of the memory is
  parameters, gradients and optimizer state, so an OOM can be attributed.
"""

from __future__ import annotations

import json
import os
import re
import sys
import threading
import weakref
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterable, List, Mapping, Optional, Union

from ..guard import warn_once

if TYPE_CHECKING:
    from ..client import Client

try:
    import torch
except ImportError as _exc:  # pragma: no cover - exercised only without torch
    from .base import DidNotEnable

    raise DidNotEnable("torch is not installed: pip install 'trainguard[torch]'") from _exc

DeviceLike = Union[str, int, "torch.device", None]
#: ``provider(device_type) -> {name: bytes}`` (params/grads/optimizer state on devices of that type,
#: "cuda" or "cpu"), called only on an OOM.
AttributionProvider = Callable[[str], Mapping[str, int]]

#: memory_stats() entries copied into MemorySnapshot.stats (the rest are in the OOM context's JSON).
SELECTED_STATS = (
    "allocated_bytes.all.peak", "reserved_bytes.all.peak", "active_bytes.all.peak",
    "requested_bytes.all.current", "inactive_split_bytes.all.current", "inactive_split.all.current",
    "allocation.all.current", "segment.all.current", "allocated_bytes.large_pool.current",
    "reserved_bytes.large_pool.current", "allocated_bytes.small_pool.current",
    "reserved_bytes.small_pool.current", "oversize_allocations.current", "oversize_segments.current",
    "num_device_alloc", "num_device_free", "num_sync_all_streams", "max_split_size",
)
OOM_MARKERS = ("CUDA out of memory", "out of memory", "DefaultCPUAllocator: can't allocate memory")
_GPU_IN_MESSAGE = re.compile(r"GPU (\d+)")
_PAGE_SIZE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096

_installed: weakref.WeakKeyDictionary[Client, List[AttributionProvider]] = weakref.WeakKeyDictionary()
_lock = threading.Lock()


# --- host ------------------------------------------------------------------------------------------
def host_rss() -> Optional[int]:
    """Resident set size of this process in bytes (``/proc/self/statm``; elsewhere the peak RSS from
    ``getrusage``, the best the platform offers); None when neither is available."""
    try:
        with open("/proc/self/statm", "rb") as fh:
            return int(fh.read().split()[1]) * _PAGE_SIZE
    except (OSError, ValueError, IndexError):
        pass
    try:
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return int(peak if sys.platform == "darwin" else peak * 1024)
    except Exception:
        return None


# --- snapshots -------------------------------------------------------------------------------------
def _cuda_ready() -> bool:
    """True when CUDA is initialised in this process (never initialises it ourselves)."""
    try:
        return bool(torch.cuda.is_available() and torch.cuda.is_initialized())
    except Exception:
        return False


def _as_device(device: DeviceLike) -> torch.device:
    if device is None:
        return torch.device("cuda", torch.cuda.current_device()) if _cuda_ready() else torch.device("cpu")
    if isinstance(device, int):
        return torch.device("cuda", device)
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device() if _cuda_ready() else 0)
    return dev


def memory_snapshot(device: DeviceLike = None, *, with_free: bool = False,
                    summary: bool = False) -> Dict[str, Any]:
    """A MemorySnapshot payload for ``device`` (``"cuda:N"``, an index, a torch.device or ``"cpu"``).

    CUDA: allocated, reserved, active, max_allocated, total_capacity, fragmentation =
    (reserved - active) / reserved (0 when nothing is reserved), num_alloc_retries, num_ooms, rss and
    ``stats`` (:data:`SELECTED_STATS`). Host-side only: no device sync, no kernel launch. ``with_free``
    adds ``free`` from ``torch.cuda.mem_get_info`` (a driver query, ~0.1 ms, no sync) and ``summary``
    adds ``torch.cuda.memory_summary()``. A CPU device, or CUDA not initialised, gives
    ``{"device": ..., "rss": ...}`` only. Never initialises CUDA.
    """
    dev = _as_device(device)
    payload: Dict[str, Any] = {"device": str(dev)}
    rss = host_rss()
    if rss is not None:
        payload["rss"] = rss
    if dev.type != "cuda" or not _cuda_ready():
        return payload
    stats = torch.cuda.memory_stats(dev)
    reserved = int(stats.get("reserved_bytes.all.current", 0))
    active = int(stats.get("active_bytes.all.current", 0))
    payload.update({
        "allocated": int(stats.get("allocated_bytes.all.current", 0)),
        "reserved": reserved,
        "active": active,
        "max_allocated": int(stats.get("allocated_bytes.all.peak", 0)),
        "total_capacity": int(_total_capacity(dev)),
        "fragmentation": fragmentation(reserved, active),
        "num_alloc_retries": int(stats.get("num_alloc_retries", 0)),
        "num_ooms": int(stats.get("num_ooms", 0)),
        "stats": {key: float(stats[key]) for key in SELECTED_STATS if key in stats},
    })
    if with_free:
        try:
            free, _total = torch.cuda.mem_get_info(dev)
            payload["free"] = int(free)
        except Exception:
            pass
    if summary:
        try:
            payload["summary"] = torch.cuda.memory_summary(dev, abbreviated=True)
        except Exception:
            pass
    return payload


def fragmentation(reserved: int, active: int) -> float:
    """(reserved - active) / reserved, the share of reserved memory no live block uses; 0 if none."""
    if reserved <= 0:
        return 0.0
    return max(0.0, (reserved - active) / reserved)


_capacity: Dict[int, int] = {}


def _total_capacity(dev: torch.device) -> int:
    index = dev.index or 0
    cap = _capacity.get(index)
    if cap is None:
        cap = _capacity[index] = int(torch.cuda.get_device_properties(index).total_memory)
    return cap


def report_memory(client: Client, devices: Iterable[DeviceLike]) -> None:
    """Send one ``memory`` event per device and the metrics ``mem/allocated``, ``mem/reserved``,
    ``mem/fragmentation`` (first CUDA device) and ``mem/rss``, at the client's current step. On CPU-only
    runs: the RSS only. (Uses ``record_metrics``, not ``log_metrics``, whose explicit step would
    switch the client to user-supplied steps.)"""
    metrics: Dict[str, Any] = {}
    sent_cpu = False
    for device in devices:
        snap = memory_snapshot(device, with_free=True)
        if "reserved" not in snap:  # CPU, or CUDA not initialised: one RSS snapshot is enough
            if sent_cpu:
                continue
            sent_cpu = True
            snap["device"] = "cpu"
        client.capture_event("memory", snap)
        if "reserved" in snap and "mem/reserved" not in metrics:
            metrics["mem/allocated"] = float(snap["allocated"])
            metrics["mem/reserved"] = float(snap["reserved"])
            metrics["mem/fragmentation"] = float(snap["fragmentation"])
        if "rss" in snap:
            metrics["mem/rss"] = float(snap["rss"])
    if metrics:
        client.record_metrics(client.step, metrics)


# --- out of memory ---------------------------------------------------------------------------------
def is_oom(exc: BaseException) -> bool:
    """True for ``torch.OutOfMemoryError`` and for errors (or their causes/contexts) whose message says
    the CUDA or CPU allocator ran out of memory."""
    seen = 0
    current: Optional[BaseException] = exc
    while current is not None and seen < 8:
        oom_type = getattr(torch, "OutOfMemoryError", None)
        if oom_type is not None and isinstance(current, oom_type):
            return True
        if isinstance(current, (RuntimeError, MemoryError)):
            text = str(current)
            if any(marker in text for marker in OOM_MARKERS):
                return True
        current = current.__cause__ or current.__context__
        seen += 1
    return False


def oom_device(exc: BaseException) -> torch.device:
    """The device an OOM message names ("... GPU 3 has a total capacity ..."), else the current one."""
    match = _GPU_IN_MESSAGE.search(str(exc))
    if match and _cuda_ready():
        return torch.device("cuda", int(match.group(1)))
    if "CPUAllocator" in str(exc):
        return torch.device("cpu")
    return _as_device(None)


def oom_context(exc: BaseException, client: Optional[Client] = None) -> Dict[str, str]:
    """ExceptionEvent.context for an OOM: ``memory_summary``, ``memory_stats`` (compact JSON of every
    allocator counter), ``memory_free``/``memory_total`` from the driver, ``host_rss`` and
    ``memory_attribution`` (JSON, when ``watch`` registered providers). Empty for other errors.
    With ``client``, also queues a MemorySnapshot event (severity ERROR) for the device."""
    if not is_oom(exc):
        return {}
    dev = oom_device(exc)
    context: Dict[str, str] = {"oom_device": str(dev)}
    snap = memory_snapshot(dev, with_free=True, summary=True)
    attribution = _attribution(client, dev.type) if client is not None else {}
    if attribution:
        context["memory_attribution"] = json.dumps(attribution, separators=(",", ":"), sort_keys=True)
        stats = snap.setdefault("stats", {})
        for key, value in attribution.items():
            stats[f"attribution.{key}"] = float(value)
    if "summary" in snap:
        context["memory_summary"] = str(snap["summary"])
    if dev.type == "cuda" and _cuda_ready():
        try:
            stats_all = torch.cuda.memory_stats(dev)
            context["memory_stats"] = json.dumps({k: stats_all[k] for k in sorted(stats_all)},
                                                 separators=(",", ":"))
        except Exception:
            pass
        if "free" in snap:
            context["memory_free"] = str(snap["free"])
            context["memory_total"] = str(snap.get("total_capacity", ""))
    else:
        context["memory_summary"] = context.get("memory_summary", f"no CUDA allocator in use ({dev})")
    if "rss" in snap:
        context["host_rss"] = str(snap["rss"])
    if client is not None:
        try:
            client.capture_event("memory", snap, severity="ERROR")
        except Exception:
            pass
    return context


def install_oom_enricher(client: Client) -> None:
    """Register, once per client, an exception enricher that adds :func:`oom_context` to every captured
    out-of-memory error and queues a MemorySnapshot event beside it. Cheap: nothing runs until an
    exception is captured. Safe to call repeatedly and without ``watch``."""
    with _lock:
        if client in _installed:
            return
        _installed[client] = []
    client_ref = weakref.ref(client)

    def enrich(exc: BaseException) -> Optional[Mapping[str, str]]:
        try:
            return oom_context(exc, client_ref())
        except Exception as err:  # the OOM itself matters more than our context
            warn_once("oom-context", f"could not collect OOM memory context: {err}")
            return None

    client.add_exception_enricher(enrich)


def add_attribution(client: Client, provider: AttributionProvider) -> None:
    """Have OOM context include ``provider(device_type)`` (bytes by category); installs the enricher
    if needed."""
    install_oom_enricher(client)
    with _lock:
        _installed[client].append(provider)


def remove_attribution(client: Client, provider: AttributionProvider) -> None:
    """Undo :func:`add_attribution` (no-op when absent)."""
    with _lock:
        providers = _installed.get(client)
        if providers and provider in providers:
            providers.remove(provider)


def _attribution(client: Client, device_type: str) -> Dict[str, int]:
    with _lock:
        providers = list(_installed.get(client, ()))
    out: Dict[str, int] = {}
    for provider in providers:
        try:
            for key, value in provider(device_type).items():
                out[key] = out.get(key, 0) + int(value)
        except Exception:
            continue
    return out


def tensor_bytes(tensors: Iterable[Any], device_type: str = "cuda") -> int:
    """Bytes held by the tensors on devices of ``device_type`` (host-side arithmetic, no sync)."""
    total = 0
    for tensor in tensors:
        if isinstance(tensor, torch.Tensor) and tensor.device.type == device_type:
            total += tensor.numel() * tensor.element_size()
    return total
