"""Device values to host floats: one copy per device for a whole batch of queue items.

Runs on the device reader's thread (:mod:`.device_reader`), never on the training thread. Contract of
:func:`read_back`: it takes queue items (``K_METRICS`` with tensor values, ``K_VECTOR`` with a 1-D
tensor), returns them with every value a float (vectors expanded into ``K_METRICS`` items, a vector that
cannot be read becomes ``(K_METRICS, step, t_ns, None, False)``) and never raises.

How a CUDA batch is read: every device value of the batch -- 0-d metrics and whole vectors -- is
flattened and concatenated on its device (one kernel), converted to float64, copied **without blocking**
into a pinned host buffer, and waited for with a blocking-sync CUDA event: the reader's thread sleeps
until the copy is done. No pageable ``.cpu()`` copy (which waits inside the copy call, once per vector),
no spinning core. Values on the CPU are read directly; other devices (MPS, XLA) take ``.cpu()``.
"""

from __future__ import annotations

import math
import sys
from typing import Any, Dict, List, Tuple

K_METRICS = 0
K_EVENT = 1
K_VECTOR = 2  # (K_VECTOR, step, t_ns, names, 1-D tensor): many metrics read back with one copy

Item = Tuple[Any, ...]


class _Slot:
    """Where one device value's floats go: a metric of a values dict, or a whole vector item."""

    __slots__ = ("index", "name", "names", "tensor", "values")

    def __init__(self, values: Any, name: Any, tensor: Any, index: int = -1, names: Any = None) -> None:
        self.values, self.name, self.tensor, self.index, self.names = values, name, tensor, index, names


def read_back(items: List[Item]) -> List[Item]:
    """``items`` with their tensor values read back as floats (vectors expanded); never raises."""
    out: List[Item] = list(items)
    by_device: Dict[str, List[_Slot]] = {}
    for i, item in enumerate(out):
        kind = item[0]
        if kind == K_VECTOR:
            tensor = item[4]
            by_device.setdefault(_device_of(tensor), []).append(_Slot(None, None, tensor, i, item[3]))
        elif kind == K_METRICS and item[3] is not None:
            values = item[3]
            for name, value in values.items():
                vtype = type(value)
                if vtype is int:
                    values[name] = float(value)
                elif vtype is not float:
                    by_device.setdefault(_device_of(value), []).append(_Slot(values, name, value))
    for device, slots in by_device.items():
        floats = _floats(device, [s.tensor for s in slots])
        for slot, numbers in zip(slots, floats):
            if slot.index < 0:
                slot.values[slot.name] = numbers[0] if numbers else math.nan
                continue
            _, step, t_ns, names, _ = out[slot.index]
            if numbers is None or len(numbers) != len(names):
                out[slot.index] = (K_METRICS, step, t_ns, None, False)
            else:
                out[slot.index] = (K_METRICS, step, t_ns, dict(zip(names, numbers)), False)
    return out


def _device_of(value: Any) -> str:
    device = getattr(value, "device", None)
    return "cpu" if device is None else str(device)


def _floats(device: str, tensors: List[Any]) -> List[Any]:
    """Each tensor's elements as a list of floats (None for a vector that could not be read)."""
    try:
        if device.startswith("cuda"):
            return _cuda_floats(tensors)
        if device == "cpu":  # nothing to wait for: each on its own
            return [_tensor_floats(t) for t in tensors]
        return [t.detach().reshape(-1).double().cpu().tolist() for t in tensors]
    except Exception:
        return [_tensor_floats(t) for t in tensors]


def _tensor_floats(tensor: Any) -> Any:
    """One tensor's elements, forgiving (NaN / None if unreadable): CPU values, and the path after a
    device batch read failed."""
    try:
        if hasattr(tensor, "dim") and tensor.dim() > 0:
            return tensor.detach().reshape(-1).double().cpu().tolist()
        return [float(tensor)]
    except Exception:
        return None if hasattr(tensor, "dim") and tensor.dim() > 0 else [math.nan]


def _cuda_floats(tensors: List[Any]) -> List[List[float]]:
    """One concatenation, one non-blocking copy into pinned memory, one blocking-sync event wait."""
    torch = sys.modules["torch"]
    flat = [t.detach().reshape(-1) for t in tensors]
    lengths = [f.numel() for f in flat]
    with torch.cuda.device(flat[0].device):
        # one kernel for the batch (dtypes promote: bool/half/bf16 -> float32 exactly), one to float64
        joined = (torch.cat(flat) if len(flat) > 1 else flat[0]).to(torch.float64)
        host = torch.empty(joined.numel(), dtype=torch.float64, pin_memory=True)
        host.copy_(joined, non_blocking=True)
        done = torch.cuda.Event(blocking=True)
        done.record()
        done.synchronize()  # sleeps (blocking sync), with the GIL released
    numbers = host.tolist()
    out: List[List[float]] = []
    at = 0
    for n in lengths:
        out.append(numbers[at:at + n])
        at += n
    return out
