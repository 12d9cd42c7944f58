"""``watch_lora()``: do the LoRA adapters still get gradients? (DESIGN §4 adapter/lora-grad-break.)

**Which parameters.** Adapter parameters are found by name: a dotted component of the parameter's name in
``a_names`` (default ``lora_A``, ``lora_embedding_A``: peft's naming, e.g.
``base_model.model.layers.0.attn.q_proj.lora_A.default.weight``) is an A matrix, one in ``b_names``
(``lora_B``, ``lora_embedding_B``) a B matrix. ``name_filter`` (a regular expression searched in the name,
or a callable ``name -> bool``) narrows them further. Adapters with ``requires_grad=False`` (another
adapter of a multi-adapter model, say) are left out, unless no adapter is trainable at all: then they are
watched, and all of them report "no gradient" (``requires_grad`` off on the adapters is itself the bug).

**When.** At the end of every ``every``-th backward pass: a ``register_post_accumulate_grad_hook`` on a few
*sentinel* parameters -- trainable parameters spread over the adapters **and** over the model's other
trainable parameters (a head), because a broken adapter's own hook never fires -- queues an autograd
final callback once per backward pass, re-queued once so that it runs after DDP's all-reduce finaliser
(as :mod:`.torch`'s ``watch`` does). A backward nested in another one -- the recomputation of a reentrant
activation checkpoint (``torch.utils.checkpoint(..., use_reentrant=True)``), whose own end-of-backward
callbacks run while only that segment's gradients exist -- is recognised (the autograd engine is still
evaluating the outer pass's node) and not reported: the outer pass reports, once, with every gradient.
With ``optimizer`` given, its step pre-hook is the fallback when no backward pass reported since the last
step (no sentinel outside the checkpointed segments got a gradient, say).

**What** (metrics, at the step this backward belongs to: the client's step + 1, i.e. the step the next
``log(step=...)`` / optimizer step will carry; see :func:`.sequence.check_batch`):

==========================  ==============================================================================
``lora/grad_mean_A``        mean |grad| over every element of the A matrices that have a gradient (0 when
                            none has one)
``lora/grad_mean_B``        the same for the B matrices
``lora/no_grad_params``     adapter parameters with no gradient at all: ``.grad is None``, or exactly 0
                            everywhere (what ``zero_grad(set_to_none=False)`` leaves on an unused one)
``lora/params``             adapter parameters watched
==========================  ==============================================================================

The sums are fused on the gradients' device (``torch._foreach_norm(grads, 1)``: one kernel per device and
dtype, fp32 accumulation for fp16/bf16) and queued as 0-d tensors; the SDK's worker thread reads them back
(one stacked copy per device). The training thread never waits for the device. Note: LoRA initialises B to
0, so A's gradient is exactly 0 on the very first step of a healthy run; the detector asks for a sustained
condition. With gradient accumulation every micro-batch's backward reports (at the same step).

Every hook body is guarded: an exception disables the watch with one warning and never reaches the
training step.
"""

from __future__ import annotations

import re
import weakref
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence, Set, Tuple, Union

from ..guard import warn_once
from .base import DidNotEnable, WatchRegistry, remove_hooks

try:
    import torch
    from torch import nn
except ImportError as _exc:  # pragma: no cover - exercised only without torch
    raise DidNotEnable("torch is not installed (the SDK uses the job's own)") from _exc

from .torch import _graph_task_id, _queue_callback, unwrap_model, unwrap_optimizer

if TYPE_CHECKING:
    from ..client import Client

A_NAMES = ("lora_A", "lora_embedding_A")
B_NAMES = ("lora_B", "lora_embedding_B")
GRAD_MEAN_A = "lora/grad_mean_A"
GRAD_MEAN_B = "lora/grad_mean_B"
NO_GRAD = "lora/no_grad_params"
PARAMS = "lora/params"
NameFilter = Union[str, Callable[[str], bool], None]

_active: WatchRegistry[LoraWatch] = WatchRegistry()
_LOW_PRECISION = (torch.float16, torch.bfloat16)
#: The autograd node being evaluated on this thread (None outside a backward pass): in an end-of-backward
#: callback it is not None only when that backward is nested in another one.
_current_node: Optional[Callable[[], Any]] = getattr(torch._C, "_current_autograd_node", None)


def find_adapters(model: nn.Module, name_filter: NameFilter = None, a_names: Sequence[str] = A_NAMES,
                  b_names: Sequence[str] = B_NAMES) -> Tuple[List[Tuple[str, nn.Parameter]],
                                                             List[Tuple[str, nn.Parameter]], int]:
    """``(A params, B params, frozen adapters left out)`` of ``model``, as ``(name, parameter)`` lists."""
    keep: Callable[[str], bool]
    if isinstance(name_filter, str):
        pattern = re.compile(name_filter)
        keep = lambda name: pattern.search(name) is not None  # noqa: E731
    elif callable(name_filter):
        keep = name_filter
    else:
        keep = lambda name: True  # noqa: E731
    a_set, b_set = set(a_names), set(b_names)
    found: Dict[str, List[Tuple[str, nn.Parameter]]] = {"A": [], "B": [], "fA": [], "fB": []}
    for name, param in model.named_parameters():
        parts = name.split(".")
        side = "A" if a_set.intersection(parts) else "B" if b_set.intersection(parts) else ""
        if not side or not keep(name):
            continue
        found[side if param.requires_grad else "f" + side].append((name, param))
    if not found["A"] and not found["B"]:
        return found["fA"], found["fB"], 0
    return found["A"], found["B"], len(found["fA"]) + len(found["fB"])


def _abs_sums(grads: List[torch.Tensor]) -> torch.Tensor:
    """Per-gradient sums of |g| (1-D, on the first gradient's device): one fused kernel per device/dtype."""
    first = grads[0].device
    groups: Dict[Tuple[torch.device, torch.dtype], List[torch.Tensor]] = {}
    for g in grads:
        if g.layout != torch.strided:
            g = g.coalesce().values() if g.layout == torch.sparse_coo else g.values()
        groups.setdefault((g.device, g.dtype), []).append(g)
    parts: List[torch.Tensor] = []
    for (_device, dtype), members in groups.items():
        acc = torch.float32 if dtype in _LOW_PRECISION else None
        sums = torch.stack(torch._foreach_norm(members, 1, dtype=acc))
        parts.append(sums.to(first, torch.float64 if dtype == torch.float64 else torch.float32))
    if len(parts) == 1:
        return parts[0]
    out_dtype = torch.float64 if any(p.dtype == torch.float64 for p in parts) else torch.float32
    return torch.cat([p.to(out_dtype) for p in parts])


class LoraWatch:
    """What :func:`watch_lora` returns: the hooks and their state. ``remove()`` undoes it all."""

    def __init__(self, client: Client, model: nn.Module, every: int, name_filter: NameFilter,
                 a_names: Sequence[str], b_names: Sequence[str], optimizer: Any = None) -> None:
        self._client = client
        self._model_ref = weakref.ref(model)
        a, b, frozen = find_adapters(model, name_filter, a_names, b_names)
        self.a_names = tuple(n for n, _ in a)
        self.b_names = tuple(n for n, _ in b)
        self._a = [p for _, p in a]
        self._b = [p for _, p in b]
        self.frozen_left_out = frozen
        self.every = max(1, int(every))
        self.backwards = 0  #: backward passes seen
        self.reports = 0
        self.removed = False
        self.disabled = ""
        self._queued: Set[int] = set()  # graph tasks whose callback is queued and has not run yet
        self._seen_since_step = False
        self._reported_since_step = False
        self._handles: List[Any] = []
        if not self._a and not self._b:
            warn_once("watch_lora:none", "watch_lora(): no LoRA adapter parameters found (looked for "
                      f"components {tuple(a_names) + tuple(b_names)} in parameter names); nothing watched")
            return
        self._install(model, optimizer)

    @property
    def params(self) -> int:
        return len(self._a) + len(self._b)

    # --- installation ---------------------------------------------------------------------------
    def _sentinels(self, model: nn.Module) -> List[nn.Parameter]:
        adapters = [p for p in self._a + self._b if p.requires_grad]
        ids = {id(p) for p in self._a + self._b}
        others = [p for p in model.parameters() if p.requires_grad and id(p) not in ids]
        picks: List[nn.Parameter] = []
        for group in (adapters, others):
            if group:
                for i in sorted({0, len(group) // 2, len(group) - 1}):
                    if all(group[i] is not q for q in picks):
                        picks.append(group[i])
        return picks

    def _install(self, model: nn.Module, optimizer: Any) -> None:
        if _queue_callback is not None:
            for param in self._sentinels(model):
                try:
                    self._handles.append(param.register_post_accumulate_grad_hook(self._on_grad_ready))
                except Exception as exc:  # a non-leaf parameter (parametrizations)
                    warn_once(f"watch_lora:sentinel:{type(exc).__name__}",
                              f"watch_lora(): cannot hook a parameter ({exc})")
        if optimizer is not None:
            opt = unwrap_optimizer(optimizer)
            try:
                self._handles.append(opt.register_step_pre_hook(self._on_step))
            except Exception as exc:
                warn_once(f"watch_lora:optimizer:{type(opt).__name__}",
                          f"watch_lora(): cannot hook {type(opt).__name__}.step ({exc})")
        if not self._handles:
            warn_once("watch_lora:hooks", "watch_lora(): no hook could be installed; nothing is reported")

    def remove(self) -> None:
        """Remove every hook. Idempotent."""
        if self.removed:
            return
        self.removed = True
        remove_hooks(self._handles)
        model = self._model_ref()
        if model is not None:
            _active.forget(model, self)

    def _guard(self, fn: Callable[..., Any], *args: Any) -> None:
        if self.removed or self.disabled:
            return
        try:
            fn(*args)
        except Exception as exc:  # never into the training step
            self.disabled = f"{type(exc).__name__}: {str(exc)[:200]}"
            warn_once(f"watch_lora:{type(exc).__name__}",
                      f"watch_lora(): a hook failed ({self.disabled}); it is disabled, training continues")

    # --- hooks -------------------------------------------------------------------------------------
    def _on_grad_ready(self, _param: Any) -> None:
        self._guard(self._queue_once)

    def _queue_once(self) -> None:
        """Queue the end-of-backward callback once per backward pass (graph task)."""
        task = _graph_task_id() if _graph_task_id is not None else -1
        if task == -1:
            if self._seen_since_step:
                return
        elif task in self._queued:
            return
        if len(self._queued) > 16:  # tasks that raised before their callbacks ran
            self._queued.clear()
        self._queued.add(task)
        self._seen_since_step = True
        _queue_callback(self._requeue)  # type: ignore[misc]

    def _requeue(self) -> None:
        try:
            _queue_callback(self._after_backward)  # type: ignore[misc]
        except Exception:
            self._after_backward()

    def _after_backward(self) -> None:
        self._seen_since_step = False
        if _graph_task_id is not None:
            self._queued.discard(_graph_task_id())
        if _current_node is not None and _current_node() is not None:
            # a backward nested in another one (a reentrant checkpoint's recomputation): only part of the
            # gradients exist yet; the outer pass reports (or, failing that, the optimizer's step)
            return
        self._guard(self._backward_done)

    def _on_step(self, _optimizer: Any, _args: Any, _kwargs: Any) -> None:
        if not self._reported_since_step:  # no end of backward was seen since the last step
            self._guard(self._backward_done)
        self._reported_since_step = False
        self._seen_since_step = False

    def _backward_done(self) -> None:
        self._reported_since_step = True
        count = self.backwards
        self.backwards += 1
        if count % self.every == 0:
            self.report(count)

    def report(self, backward_index: Optional[int] = None) -> None:
        """Queue the adapters' gradient metrics now (the hooks call this; callable by hand)."""
        client = self._client
        if client.step >= 0 or client._user_steps:
            step = client.step + 1
        else:  # nothing counts steps: neither watch() nor log(step=...)
            step = self.backwards - 1 if backward_index is None else backward_index
        metrics: Dict[str, Any] = {}
        zero_count: Any = None
        missing = 0
        with torch.no_grad():
            for name, group in ((GRAD_MEAN_A, self._a), (GRAD_MEAN_B, self._b)):
                grads = [p.grad for p in group if p.grad is not None]
                missing += len(group) - len(grads)
                if not grads:
                    metrics[name] = 0.0
                    continue
                sums = _abs_sums(grads)
                metrics[name] = sums.sum() / float(sum(g.numel() for g in grads))
                zeros = (sums == 0).sum()
                zero_count = zeros if zero_count is None else zero_count + zeros.to(zero_count.device)
        metrics[NO_GRAD] = float(missing) if zero_count is None else zero_count.to(torch.float32) + missing
        metrics[PARAMS] = float(self.params)
        client.record_metrics(step, metrics)
        self.reports += 1


def watch_lora(client: Client, model: Any, every: int = 1, *, name_filter: NameFilter = None,
               a_names: Sequence[str] = A_NAMES, b_names: Sequence[str] = B_NAMES,
               optimizer: Any = None) -> LoraWatch:
    """Hook ``model``'s LoRA adapters (see the module docstring). Watching a model again replaces the
    previous watch of it. Raises TypeError when ``model`` is not an ``nn.Module``."""
    module = unwrap_model(model)
    if not isinstance(module, nn.Module):
        raise TypeError(f"watch_lora() needs a torch.nn.Module, got {type(model).__name__}")
    handle = LoraWatch(client, module, every, name_filter, a_names, b_names, optimizer)
    _active.replace(module, handle)
    return handle


def unwatch_all(client: Optional[Client] = None) -> int:
    """Remove every active LoRA watch (of ``client`` only, when given); returns how many were removed."""
    return _active.remove_all(client)
