"""GPU clocks, temperature, power and throttle reasons from NVML, sampled on a thread of the SDK.

Only when ``nvidia-ml-py`` (the ``pynvml`` module) is importable and the watched model is on CUDA:
``watch()`` starts one :class:`Sampler` (a daemon thread) that every ``interval_s`` seconds reads the
watched model's first GPU and queues, at the current step, ``gpu/sm_clock_mhz``, ``gpu/sm_clock_max_mhz``,
``gpu/temperature_c``, ``gpu/power_w``, ``gpu/power_limit_w`` and ``gpu/throttle_reasons`` (NVML's
``nvmlClocksEventReasons`` bit mask as a number: the engine's ``perf/throttling`` reads its thermal,
hardware-slowdown and power-brake bits). The training thread never calls NVML. A failing read stops the
sampler with one warning; nothing is ever raised.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Dict, List, Optional

from ..guard import warn_once

if TYPE_CHECKING:
    from ..client import Client

DEFAULT_INTERVAL_S = 5.0
"""Seconds between two samples (watch(nvml_interval_s=...)); NVML reads cost ~0.1 ms each."""


def _pynvml() -> Any:
    try:
        import pynvml  # nvidia-ml-py

        return pynvml
    except Exception:
        return None


def _handle(nv: Any, device: Any) -> Any:
    """The NVML handle of a torch CUDA device: by UUID, else PCI bus id, else index."""
    import torch

    index = device.index if device.index is not None else torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    uuid = getattr(props, "uuid", None)
    if uuid is not None:
        try:
            text = str(uuid)
            return nv.nvmlDeviceGetHandleByUUID(text if text.startswith("GPU-") else f"GPU-{text}")
        except Exception:
            pass
    bus = getattr(props, "pci_bus_id", None)
    if bus is not None:
        try:
            domain = int(getattr(props, "pci_domain_id", 0))
            slot = int(getattr(props, "pci_device_id", 0))
            return nv.nvmlDeviceGetHandleByPciBusId_v2(f"{domain:08x}:{int(bus):02x}:{slot:02x}.0")
        except Exception:
            pass
    return nv.nvmlDeviceGetHandleByIndex(index)


def sample(nv: Any, handle: Any) -> Dict[str, float]:
    """One reading of ``handle`` (the metrics listed in the module docstring; a value NVML does not
    give on this GPU is left out)."""
    out: Dict[str, float] = {}
    reads = (
        ("gpu/sm_clock_mhz", lambda: nv.nvmlDeviceGetClockInfo(handle, nv.NVML_CLOCK_SM)),
        ("gpu/sm_clock_max_mhz", lambda: nv.nvmlDeviceGetMaxClockInfo(handle, nv.NVML_CLOCK_SM)),
        ("gpu/temperature_c", lambda: nv.nvmlDeviceGetTemperature(handle, nv.NVML_TEMPERATURE_GPU)),
        ("gpu/power_w", lambda: nv.nvmlDeviceGetPowerUsage(handle) / 1000.0),
        ("gpu/power_limit_w", lambda: nv.nvmlDeviceGetEnforcedPowerLimit(handle) / 1000.0),
        ("gpu/throttle_reasons", lambda: _reasons(nv, handle)),
    )
    for name, read in reads:
        try:
            out[name] = float(read())
        except Exception:
            continue
    return out


def _reasons(nv: Any, handle: Any) -> int:
    get = getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None) or \
        nv.nvmlDeviceGetCurrentClocksThrottleReasons
    return int(get(handle))


class Sampler:
    """The sampling thread of one watch; :meth:`stop` ends it (idempotent)."""

    def __init__(self, client: Client, nv: Any, handle: Any, interval_s: float) -> None:
        self._client, self._nv, self._handle = client, nv, handle
        self.interval_s = max(0.5, float(interval_s))
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="trainguard-nvml", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                if self._client.forked_child:
                    return
                values = sample(self._nv, self._handle)
                if not values:
                    warn_once("nvml:empty", "watch(): NVML gave no reading; GPU sampling stopped")
                    return
                self._client.record_metrics(max(0, self._client.step), dict(values))
                self.samples += 1
            except Exception as exc:
                warn_once(f"nvml:{type(exc).__name__}", f"watch(): NVML sampling failed ({exc}); stopped")
                return

    def stop(self) -> None:
        self._stop.set()


def start(client: Client, devices: List[Any], interval_s: float) -> Optional[Sampler]:
    """A :class:`Sampler` of the first CUDA device in ``devices``; None without NVML or CUDA, or when
    NVML cannot be initialised (one warning)."""
    cuda = [d for d in devices if getattr(d, "type", "") == "cuda"]
    nv = _pynvml()
    if not cuda or nv is None or interval_s <= 0:
        return None
    try:
        nv.nvmlInit()
        return Sampler(client, nv, _handle(nv, cuda[0]), interval_s)
    except Exception as exc:
        warn_once(f"nvml:init:{type(exc).__name__}", f"watch(): NVML unavailable ({exc}); no GPU clocks")
        return None
