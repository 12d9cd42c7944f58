"""Take the gradient norms ``torch.nn.utils.clip_grad_norm_`` computes anyway (issue 21).

A job that clips already reads every gradient once per step to get their norms; ``watch()`` reading them a
second time is most of its cost on a large model (an extra pass over ~0.5 GB of fp32 gradients for GPT-2
on an H200: 0.2 ms of a 58 ms step). While a watch wants them, ``torch.nn.utils.clip_grad_norm_`` (both
names it is called by) is replaced by :func:`clip_grad_norm_`, which computes the per-parameter norms the
way torch does -- the same grouping by device and dtype, the same ``torch._foreach_norm`` calls, the same
stacking order and final ``vector_norm``, so the total is bit for bit torch's -- clips with
``torch.nn.utils.clip_grads_with_norm_`` and hands the norms (pre-clip, by definition) to the watches.

Anything unusual goes to torch's own function untouched: no watch wanting norms, a norm type other than
2, ``error_if_nonfinite=True``, ``foreach=False``, a torch without ``clip_grads_with_norm_`` (< 2.6), no
gradient, or any error while the norms are computed (nothing is modified before that point). A watch's
failure to take the norms never reaches the job.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Callable, List, Optional, Protocol, Sequence

import torch

from ..guard import warn_once

try:  # torch >= 2.6: the two halves of clip_grad_norm_; the grouping helpers of its foreach path
    from torch.nn.utils import clip_grads_with_norm_ as _clip_with_norm
    from torch.utils._foreach_utils import (
        _device_has_foreach_support,
        _group_tensors_by_device_and_dtype,
        _has_foreach_support,
    )
except ImportError:  # pragma: no cover - older torch: no tap, watches read the gradients themselves
    _clip_with_norm = None  # type: ignore[assignment]


class Listener(Protocol):
    """A watch that takes the norms a clip computed: True when it used them."""

    def take_clip_norms(self, params: Sequence[torch.Tensor], per_param: List[torch.Tensor],
                        total: torch.Tensor) -> bool: ...


_lock = threading.Lock()
_listeners: weakref.WeakSet[Any] = weakref.WeakSet()
_original: Callable[..., torch.Tensor] = torch.nn.utils.clip_grad_norm_
"""``torch.nn.utils.clip_grad_norm_`` as the tap found it (torch's own, or another wrapper)."""
_installed = False


def available() -> bool:
    """Whether this torch lets the norms be taken from ``clip_grad_norm_``."""
    return _clip_with_norm is not None


def _norms(params: List[torch.Tensor], foreach: Optional[bool]) -> Optional[tuple]:
    """``(per-parameter norms in the order of the parameters with a gradient, total)`` exactly as torch's
    ``clip_grad_norm_`` computes them; None when there is no gradient or foreach cannot run."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads or any(type(g) is not torch.Tensor for g in grads):
        return None  # none, or sharded/subclassed (DTensor: its norms would need a collective to read)
    first_device = grads[0].device
    grouped = _group_tensors_by_device_and_dtype([grads], with_indices=True)  # type: ignore[list-item]
    in_group_order: List[torch.Tensor] = []
    positions: List[int] = []
    for (device, _dtype), ([group], indices) in grouped.items():
        device_grads = [g for g in group if g is not None]  # all of them: only gradients were grouped
        if (foreach is None and _has_foreach_support(device_grads, device)) or (
                foreach and _device_has_foreach_support(device)):
            in_group_order.extend(torch._foreach_norm(device_grads, 2.0))
        elif foreach:
            return None
        else:
            in_group_order.extend([torch.linalg.vector_norm(g, 2.0) for g in device_grads])
        positions.extend(indices)
    total = torch.linalg.vector_norm(torch.stack([n.to(first_device) for n in in_group_order]), 2.0)
    per_param: List[Optional[torch.Tensor]] = [None] * len(grads)
    for index, norm in zip(positions, in_group_order):
        per_param[index] = norm
    return per_param, total


@torch.no_grad()
def clip_grad_norm_(parameters: Any, max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False, foreach: Optional[bool] = None) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_``, sharing its norms with the watches that want them."""
    original = _original
    listeners = list(_listeners)
    if (not listeners or float(norm_type) != 2.0 or error_if_nonfinite or foreach is False
            or _clip_with_norm is None):
        return original(parameters, max_norm, norm_type, error_if_nonfinite, foreach)
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    try:
        found = _norms(params, foreach)
    except Exception:  # nothing was modified yet: torch's own function does the job
        found = None
    if found is None:
        return original(params, max_norm, norm_type, error_if_nonfinite, foreach)
    per_param, total = found
    _clip_with_norm(params, max_norm, total, foreach)
    for listener in listeners:
        try:
            listener.take_clip_norms(params, per_param, total)
        except Exception as exc:  # never into the job: the watch reads the gradients itself next step
            warn_once(f"watch:clip_tap:{type(exc).__name__}",
                      f"watch(): taking clip_grad_norm_'s norms failed ({exc}); norms are read separately")
    return total


def _patch(fn: Callable[..., torch.Tensor]) -> None:
    torch.nn.utils.clip_grad_norm_ = fn  # type: ignore[assignment]
    torch.nn.utils.clip_grad.clip_grad_norm_ = fn  # type: ignore[assignment]


def add(listener: Listener) -> bool:
    """Give ``listener`` the norms of every ``clip_grad_norm_`` call from now on; False when this torch
    cannot (the watch then reads the gradients itself)."""
    global _original, _installed
    if not available():
        return False
    with _lock:
        if not _installed:
            _original = torch.nn.utils.clip_grad_norm_
            _patch(clip_grad_norm_)
            _installed = True
        _listeners.add(listener)
    return True


def discard(listener: Listener) -> None:
    """Stop giving ``listener`` norms; torch's function is put back when no watch wants them (unless
    somebody replaced it meanwhile: theirs is left in place)."""
    global _installed
    with _lock:
        _listeners.discard(listener)
        if _listeners or not _installed:
            return
        if torch.nn.utils.clip_grad_norm_ is clip_grad_norm_:
            torch.nn.utils.clip_grad_norm_ = _original  # type: ignore[assignment]
        if torch.nn.utils.clip_grad.clip_grad_norm_ is clip_grad_norm_:
            torch.nn.utils.clip_grad.clip_grad_norm_ = _original  # type: ignore[assignment]
        _installed = False  # a wrapper installed after ours that still calls us gets _original
