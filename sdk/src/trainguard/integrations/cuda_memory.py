"""Memory signals: periodic CUDA allocator snapshots, host RSS, and context for out-of-memory errors.

The periodic path never synchronises with the device: ``torch.cuda.memory_stats`` reads the caching
allocator's host-side counters (about 0.13 ms on the H200 machine's host), the capacity comes from the
cached device properties, RSS from ``/proc/self/statm``, and ``free`` from ``torch.cuda.mem_get_info``
(``cudaMemGetInfo``): measured there at 0.09-0.10 ms, returning while 300 ms of queued GPU work was still
pending, i.e. a driver query that does not wait for the device. All of it runs every ``memory_every``
optimizer steps only.

**Other processes on the device** (memory/context-leak). A snapshot with ``free`` also carries, in its
``stats`` map, ``device_used`` = total - free from the driver (every process's memory on the GPU, contexts
included), so the detector can compare it with this process's ``reserved``. When NVML is importable
(``pynvml``, from ``nvidia-ml-py``; never required, never installed by us) the compute processes that hold
a context on the device are listed too (:func:`nvml_process_stats`): ``nvml_processes``,
``nvml_own_found``, ``nvml_other_processes``, ``nvml_other_bytes``, ``nvml_used_bytes``. NVML is a
separate driver library: querying it creates no CUDA context. It is initialised once per process, at the
first CUDA snapshot, and the process list of a device is read at most every :data:`NVML_REFRESH_S`
seconds (cached in between); any NVML error turns it off for the process.

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
import time
import weakref
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterable, List, Mapping, Optional, Union

from ..guard import warn_once

if TYPE_CHECKING:
    from ..client import Client

try:
    import torch
except ImportError as _exc:  # pragma: no cover - exercised only without torch
    from .base import DidNotEnable

    raise DidNotEnable("torch is not installed (the SDK uses the job's own)") from _exc

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
    # cumulative counters: their deltas between snapshots give the allocation rate (fragmentation level 2)
    "allocated_bytes.all.allocated", "allocation.all.allocated",
)
#: Seconds between two reads of a device's NVML process list (the snapshots in between reuse it).
NVML_REFRESH_S = 30.0
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
            free, total = torch.cuda.mem_get_info(dev)
            payload["free"] = int(free)
            payload["stats"]["device_used"] = float(total - free)  # every process's, contexts included
        except Exception:
            pass
        payload["stats"].update(_NVML.device_stats(dev))
    if summary:
        try:
            payload["summary"] = torch.cuda.memory_summary(dev, abbreviated=True)
        except Exception:
            pass
    return payload

# --- other processes on the device (NVML, optional) ------------------------------------------------
def own_pids() -> frozenset:
    """This process's ids: ``os.getpid()`` and, in nested PID namespaces, every id ``NSpid`` lists."""
    pids = {os.getpid()}
    try:
        with open("/proc/self/status", encoding="ascii", errors="replace") as fh:
            for line in fh:
                if line.startswith("NSpid:"):
                    pids.update(int(p) for p in line.split()[1:] if p.isdigit())
                    break
    except OSError:
        pass
    return frozenset(pids)


def nvml_process_stats(processes: Iterable[Any], own: Iterable[int]) -> Dict[str, float]:
    """``stats`` entries from NVML's compute-process list of one device (objects with ``pid`` and
    ``usedGpuMemory``, None when NVML cannot tell): how many processes hold a context there
    (``nvml_processes``), whether this one is among them (``nvml_own_found``: 1/0), how many others
    (``nvml_other_processes``; when this process's id is not listed -- another PID namespace -- it is
    assumed to be one of them, so ``count - 1``) and the memory NVML attributes to all of them
    (``nvml_used_bytes``) and to the others (``nvml_other_bytes``, only when this process was found and
    every other process's usage is known)."""
    own_set = set(own)
    procs = list(processes)
    others = [p for p in procs if int(getattr(p, "pid", -1)) not in own_set]
    found = len(others) < len(procs)
    out: Dict[str, float] = {"nvml_processes": float(len(procs)), "nvml_own_found": 1.0 if found else 0.0,
                             "nvml_other_processes": float(len(others) if found else max(0, len(procs) - 1))}
    used = [getattr(p, "usedGpuMemory", None) for p in procs]
    if all(isinstance(u, int) for u in used):
        out["nvml_used_bytes"] = float(sum(used))  # type: ignore[arg-type]
    other_used = [getattr(p, "usedGpuMemory", None) for p in others]
    if found and all(isinstance(u, int) for u in other_used):
        out["nvml_other_bytes"] = float(sum(other_used))  # type: ignore[arg-type]
    return out


def _uuid_key(text: Any) -> str:
    value = text.decode() if isinstance(text, bytes) else str(text)
    value = value.strip().lower()
    for prefix in ("gpu-", "mig-"):
        if value.startswith(prefix):
            value = value[len(prefix):]
    return value


class _Nvml:
    """Optional NVML access: the module (``pynvml``) is imported and initialised lazily, once; a failure
    at any point turns it off for the process. Per device: the NVML handle (matched by UUID, so
    ``CUDA_VISIBLE_DEVICES`` remapping is handled) and the last process stats with their read time."""

    def __init__(self, module: Any = None, clock: Callable[[], float] = time.monotonic,
                 refresh_s: float = NVML_REFRESH_S) -> None:
        self._module = module
        self._state = "ready" if module is not None else "unknown"  # unknown | ready | off
        self._clock = clock
        self._refresh_s = refresh_s
        self._handles: Dict[int, Any] = {}
        self._cache: Dict[int, Any] = {}
        self._own: Optional[frozenset] = None
        self._lock = threading.Lock()

    def _start(self) -> bool:
        if self._state == "unknown":
            try:
                import pynvml  # nvidia-ml-py; optional

                self._module = pynvml
                self._state = "ready"
            except Exception:
                self._state = "off"
        if self._state == "ready":
            try:
                self._module.nvmlInit()
                self._state = "on"
            except Exception:
                self._state = "off"
        return self._state == "on"

    def _handle(self, index: int, uuid: Optional[str]) -> Any:
        if index in self._handles:
            return self._handles[index]
        nv = self._module
        handle = None
        count = int(nv.nvmlDeviceGetCount())
        if uuid:
            for i in range(count):
                candidate = nv.nvmlDeviceGetHandleByIndex(i)
                if _uuid_key(nv.nvmlDeviceGetUUID(candidate)) == _uuid_key(uuid):
                    handle = candidate
                    break
        if handle is None and not os.environ.get("CUDA_VISIBLE_DEVICES") and index < count:
            handle = nv.nvmlDeviceGetHandleByIndex(index)
        self._handles[index] = handle
        return handle

    def stats(self, index: int, uuid: Optional[str]) -> Dict[str, float]:
        """Process stats of CUDA device ``index`` (UUID ``uuid``), cached for ``refresh_s``; {} when
        NVML is unavailable or the device cannot be matched."""
        with self._lock:
            now = self._clock()
            cached = self._cache.get(index)
            if cached is not None and now - cached[0] < self._refresh_s:
                return dict(cached[1])
            if not self._start():
                return {}
            try:
                handle = self._handle(index, uuid)
                if handle is None:
                    return {}
                if self._own is None:
                    self._own = own_pids()
                out = nvml_process_stats(self._module.nvmlDeviceGetComputeRunningProcesses(handle),
                                         self._own)
            except Exception as err:
                self._state = "off"
                warn_once("nvml", f"NVML process listing unavailable ({err}); other processes on the GPU "
                                  "are judged from the driver's free memory only")
                return {}
            self._cache[index] = (now, out)
            return dict(out)

    def device_stats(self, dev: torch.device) -> Dict[str, float]:
        """:meth:`stats` for a torch CUDA device (UUID from its cached properties)."""
        if self._state == "off":
            return {}
        index = dev.index or 0
        try:
            uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
        except Exception:
            uuid = None
        return self.stats(index, str(uuid) if uuid is not None else None)


_NVML = _Nvml()


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
            if "max_allocated" in snap:  # the peak: what tells a cache sized by it from fragmentation
                metrics["mem/max_allocated"] = float(snap["max_allocated"])
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
