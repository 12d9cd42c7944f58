"""``watch()``: gradient norms, clip triggers, GradScaler state, step time and memory of a torch model.

Hook design (all hooks are registered once, at ``watch`` time; the per-parameter work is cached):

1. **End of backward** — a ``register_post_accumulate_grad_hook`` on a few *sentinel* parameters (the
   first parameter of up to four layers spread over the model) queues an autograd-engine final callback
   (``Variable._execution_engine.queue_callback``) once per backward pass; that callback re-queues
   itself once so that it runs after every other final callback of the pass (DDP's gradient all-reduce
   finaliser among them). It then computes, on the gradients' device, ``torch._foreach_norm`` over all
   gradients (one fused kernel per device and dtype, fp32 accumulation for fp16/bf16), stacks the
   per-parameter norms and takes their L2 norm: exactly what ``clip_grad_norm_`` computes. Nothing is
   read back. The norms are those of the accumulated gradient **before clipping** (clipping happens
   after backward) and, with a GradScaler, divided on the device by the scale (i.e. unscaled). With
   gradient accumulation each micro-batch's backward recomputes them and the last one before the
   optimizer step wins. Final callbacks run on the streams that called ``backward()``.
2. **Step boundary** — with a GradScaler, a wrapper around the scaler's ``update`` (restored by
   ``remove()``): it is called once per iteration even when the scaler skips ``optimizer.step``
   because of an overflow, so overflows (and a collapsing scale) are seen. Otherwise
   ``register_step_post_hook`` on the optimizer (the last one, when several are given). Without
   optimizer and scaler, every end of backward is a step. At the boundary the host-measured step time
   (``perf_counter`` between boundaries) goes to ``client.note_optimizer_step`` and one ``record_metrics``
   call queues the step's values; device values are 0-d tensors that the client's worker thread reads
   back later — never the training thread. If no backward callback ran since the last step (no
   sentinel got a gradient), the norms are computed here from the gradients as they are now.
3. **Per-layer norms** every ``per_layer_every`` steps (and at the first step): the squared
   per-parameter norms are summed per layer with one ``index_add_`` on the device and queued with
   ``log_vector`` (one copy on the worker thread).
4. **Memory** every ``memory_every`` steps (and at the first step), and at least every
   ``memory_interval_s`` seconds of training: :func:`cuda_memory.report_memory`
   (host-side allocator counters and RSS; no device call).

Where host and device synchronise: nowhere on the training thread. The SDK's reader thread reads the
queued tensors back (one non-blocking copy into pinned memory per drain per device: :mod:`..read_back`).
Metrics: ``grad/global_norm``, ``grad/layer/<layer>``, ``grad/clip_triggered`` (1.0 when
``clip_grad_norm_(max_norm=clip)`` scales the gradients, i.e. norm > clip - 1e-6) and
``grad/clip_threshold`` (``clip``) beside each norm, ``amp/scale`` (the scale this step's backward used),
``amp/overflow`` (1.0 when the scaler found Inf/NaN gradients and skipped the step), ``time/step_s``,
``opt/lr``, ``mem/*``, and the step's phases ``time/data_s``, ``time/forward_s``, ``time/backward_s``,
``time/optimizer_s`` (host clocks at the forward hooks, the end-of-backward callback and the boundary:
:mod:`.step_timing`; ``step_timing=False`` turns them off) with, on Linux, ``time/runqueue_s``: how long
the training thread waited for a core since the previous boundary (its run-queue delay, one ``pread`` of
its schedstat per step: CPU contention). On CUDA with ``nvidia-ml-py`` installed, a
thread of the SDK samples the GPU's SM clock, temperature, power and throttle reasons every
``nvml_interval_s`` seconds (:mod:`.nvml`). The worker alerts on a non-finite norm with the recent
history of every metric.

A layer is the module path of a parameter up to and including its first numeric component (an element
of a ModuleList/Sequential: ``encoder.layers.3``, ``transformer.h.0``), or else its first
``layer_depth`` components (``bert.embeddings``, ``lm_head``); a root-module parameter is its own layer.

Every hook body is guarded: an exception disables that part of the watch (gradients, step, amp, layers,
memory) with one warning and never reaches the training step. Limits: under FSDP/ZeRO the gradients are
sharded, so the norms are of this rank's shard; with reentrant activation checkpointing a nested
backward may compute early norms, which the outer backward's callback then overwrites.
"""

from __future__ import annotations

import math
import time
import weakref
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence, Tuple

from ..guard import warn_once
from .base import DidNotEnable, WatchRegistry, remove_hooks

try:
    import torch
    from torch import nn
except ImportError as _exc:  # pragma: no cover - exercised only without torch
    raise DidNotEnable("torch is not installed (the SDK uses the job's own)") from _exc

from . import clip_tap, cuda_memory, nvml
from .step_timing import StepTimer, set_current

if TYPE_CHECKING:
    from ..client import Client

_WATCH_KWARGS = ("layer_depth", "memory_every", "memory_interval_s", "norm_every", "log_lr",
                 "overhead_budget", "step_timing", "nvml_interval_s", "take_clip_norms")
#: Most steps between two global-norm readings when the overhead budget stretches the cadence: small
#: enough that a gradient climbing over tens of steps is still seen climbing.
MAX_ADAPTIVE_EVERY = 8
#: After a norm this many times the running typical norm (or a non-finite one), every step is read
#: again for SUSPICIOUS_STEPS steps, whatever the budget says.
SUSPICIOUS_FACTOR = 2.0
SUSPICIOUS_STEPS = 32
_active: WatchRegistry[WatchHandle] = WatchRegistry()
_LOW_PRECISION = (torch.float16, torch.bfloat16)


def _engine_queue_callback() -> Optional[Callable[[Callable[[], None]], None]]:
    try:
        from torch.autograd import Variable

        return Variable._execution_engine.queue_callback  # type: ignore[attr-defined,no-any-return]
    except Exception:
        return None


_queue_callback = _engine_queue_callback()
_graph_task_id: Optional[Callable[[], int]] = getattr(torch._C, "_current_graph_task_id", None)


# --- layers ----------------------------------------------------------------------------------------
def layer_of(param_name: str, depth: int) -> str:
    """The layer a parameter belongs to (see the module docstring for the rule)."""
    parts = param_name.split(".")[:-1]
    if not parts:
        return param_name
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return ".".join(parts[: max(1, depth)])


def unwrap_model(model: Any) -> Any:
    """The user's module inside DDP / DataParallel / ``torch.compile`` wrappers."""
    for _ in range(8):
        inner = getattr(model, "_orig_mod", None)
        if isinstance(inner, nn.Module):
            model = inner
            continue
        if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
            model = model.module
            continue
        break
    return model


def unwrap_optimizer(optimizer: Any) -> Any:
    """The torch optimizer inside Lightning's ``LightningOptimizer`` / accelerate's wrapper."""
    for _ in range(8):
        inner = getattr(optimizer, "_optimizer", None) or getattr(optimizer, "optimizer", None)
        if inner is None or inner is optimizer or not hasattr(inner, "param_groups"):
            break
        optimizer = inner
    return optimizer


class ParamLayout:
    """The watched parameters (``requires_grad`` ones, in ``named_parameters`` order), the layer of
    each, and the layer names. Built once at ``watch`` time."""

    def __init__(self, model: nn.Module, depth: int) -> None:
        self.params: List[nn.Parameter] = []
        self.param_layer: List[int] = []
        names: List[str] = []
        index: Dict[str, int] = {}
        for name, param in model.named_parameters():
            if not param.requires_grad:
                continue
            layer = layer_of(name, depth)
            if layer not in index:
                index[layer] = len(names)
                names.append(layer)
            self.params.append(param)
            self.param_layer.append(index[layer])
        self.layer_names: Tuple[str, ...] = tuple(names)
        self.metric_names: Tuple[str, ...] = tuple(f"grad/layer/{n}" for n in names)
        self.shard_metric_names: Tuple[str, ...] = tuple(f"grad/shard_sumsq/layer/{n}" for n in names)

    def sentinels(self, most: int = 4) -> List[nn.Parameter]:
        """The first parameter of up to ``most`` layers spread over the model (first, last and evenly
        between): enough to notice that a backward pass ran, without a Python hook call per layer."""
        firsts: List[nn.Parameter] = []
        seen = set()
        for param, layer in zip(self.params, self.param_layer):
            if layer not in seen:
                seen.add(layer)
                firsts.append(param)
        if len(firsts) <= most:
            return firsts
        picks = sorted({round(i * (len(firsts) - 1) / (most - 1)) for i in range(most)})
        return [firsts[i] for i in picks]


# --- norms -----------------------------------------------------------------------------------------
class Norms:
    """One step's gradient norms, still on the device: ``total`` (0-d) and ``per_param`` (1-D, the
    norms of the parameters at ``positions`` in the layout; None = all of them). ``sharded``: the
    gradients are DTensors (FSDP2, tensor parallelism) and these are the norms of this rank's share of
    them only (see :func:`_shares`): reported as sums of squares for the processor to add up over the
    ranks of the step, never combined here (that would be a collective)."""

    __slots__ = ("per_param", "positions", "sharded", "total")

    def __init__(self, total: torch.Tensor, per_param: torch.Tensor,
                 positions: Optional[Tuple[int, ...]], sharded: bool = False) -> None:
        self.total = total
        self.per_param = per_param
        self.positions = positions
        self.sharded = sharded


def _is_dtensor(tensor: Any) -> bool:
    return type(tensor).__name__ == "DTensor" and hasattr(tensor, "to_local")


def _shares(grads: List[Any]) -> Optional[Tuple[List[torch.Tensor], List[float]]]:
    """Each DTensor gradient's local tensor and its weight in the sum of squares over all ranks: 1 where
    this rank holds a share nobody else holds (``Shard`` on every mesh dimension, or coordinate 0 on the
    ``Replicate`` ones), 0 for a replica another rank counts. None when a placement is ``Partial`` (a
    pending reduction: local squares do not add up to the full gradient's)."""
    locals_: List[torch.Tensor] = []
    weights: List[float] = []
    for g in grads:
        mesh = g.device_mesh
        weight = 1.0
        for dim, placement in enumerate(g.placements):
            kind = type(placement).__name__
            if kind == "Replicate":
                if mesh.get_local_rank(dim) != 0:
                    weight = 0.0
            elif kind != "Shard":
                return None
        locals_.append(g.to_local())
        weights.append(weight)
    return locals_, weights


class GradNormComputer:
    """Fused gradient norms over a :class:`ParamLayout`; no host-device sync.

    Fast path: all gradients dense on one device, fp32/fp16/bf16 (or all fp64) → one
    ``torch._foreach_norm`` call. Anything else (sparse gradients, several devices, mixed fp64) takes
    the general path, grouped by device and dtype; the choice is re-made when the first gradient's device
    or dtype changes, and the fast path falls back to the general one for good if it ever raises.
    """

    def __init__(self, layout: ParamLayout) -> None:
        self.layout = layout
        self._plan: Optional[Tuple[torch.device, torch.dtype, Optional[torch.dtype]]] = None
        self._general = False
        self._index_cache: Dict[Tuple[Optional[Tuple[int, ...]], torch.device], torch.Tensor] = {}

    def compute(self, divide_by: Optional[torch.Tensor] = None) -> Optional[Norms]:
        """Norms of the current ``.grad`` of the layout's parameters (None when no parameter has one),
        divided by ``divide_by`` (a GradScaler scale) when given."""
        grads = [p.grad for p in self.layout.params]
        present: List[torch.Tensor] = [g for g in grads if g is not None]
        if not present:
            return None
        positions = None
        if len(present) != len(grads):
            positions = tuple(i for i, g in enumerate(grads) if g is not None)
        weights: Optional[List[float]] = None
        if _is_dtensor(present[0]):  # sharded: this rank's share only, never a collective
            shares = _shares(present)
            if shares is None:
                return None
            present, weights = shares
        per_param = self._per_param_norms(present)
        if weights is not None and not all(w == 1.0 for w in weights):
            per_param = per_param * torch.tensor(weights, dtype=per_param.dtype).to(per_param.device)
        if divide_by is not None:
            per_param = per_param / divide_by.to(per_param.dtype)
        total = torch.linalg.vector_norm(per_param)
        return Norms(total, per_param, positions, sharded=weights is not None)

    def _per_param_norms(self, grads: List[torch.Tensor]) -> torch.Tensor:
        if not self._general:
            first = grads[0]
            plan = self._plan
            if plan is None or first.device != plan[0] or first.dtype != plan[1]:
                plan = self._plan = self._make_plan(grads)
            if plan is not None:
                try:
                    return torch.stack(torch._foreach_norm(grads, 2.0, dtype=plan[2]))
                except Exception:
                    self._general = True
            else:
                self._general = True
        return self._general_norms(grads)

    @staticmethod
    def _make_plan(grads: List[torch.Tensor]) -> Optional[Tuple[torch.device, torch.dtype,
                                                                 Optional[torch.dtype]]]:
        first = grads[0]
        device = first.device
        all_f64 = first.dtype == torch.float64
        for g in grads:
            if g.layout != torch.strided or g.device != device:
                return None
            if (g.dtype == torch.float64) != all_f64:
                return None
        return (device, first.dtype, None if all_f64 else torch.float32)

    def _general_norms(self, grads: List[torch.Tensor]) -> torch.Tensor:
        first_device = grads[0].device
        out_dtype = torch.float64 if any(g.dtype == torch.float64 for g in grads) else torch.float32
        norms: List[Optional[torch.Tensor]] = [None] * len(grads)
        groups: Dict[Tuple[torch.device, torch.dtype], List[int]] = {}
        for i, g in enumerate(grads):
            if g.layout != torch.strided:
                values = g.coalesce().values() if g.layout == torch.sparse_coo else g.values()
                norm = torch.linalg.vector_norm(values, dtype=_acc_dtype(values.dtype))
                norms[i] = norm.to(first_device, out_dtype)
            else:
                groups.setdefault((g.device, g.dtype), []).append(i)
        for (_device, dtype), members in groups.items():
            result = torch._foreach_norm([grads[i] for i in members], 2.0, dtype=_acc_dtype(dtype))
            for i, norm in zip(members, result):
                norms[i] = norm.to(first_device, out_dtype)
        return torch.stack([n for n in norms if n is not None])

    def layer_norms(self, norms: Norms) -> torch.Tensor:
        """Per-layer L2 norms (1-D, one per layer name; 0 for a layer without gradients), on device."""
        per_param = norms.per_param
        key = (norms.positions, per_param.device)
        index = self._index_cache.get(key)
        if index is None:
            layers = self.layout.param_layer
            chosen = layers if norms.positions is None else [layers[i] for i in norms.positions]
            index = torch.tensor(chosen, dtype=torch.long)
            if per_param.device.type == "cuda":  # pinned + non_blocking: no host-device sync
                index = index.pin_memory().to(per_param.device, non_blocking=True)
            else:
                index = index.to(per_param.device)
            if len(self._index_cache) > 16:
                self._index_cache.clear()
            self._index_cache[key] = index
        out = torch.zeros(len(self.layout.layer_names), dtype=per_param.dtype, device=per_param.device)
        return out.index_add_(0, index, per_param * per_param).sqrt_()


def _acc_dtype(dtype: torch.dtype) -> Optional[torch.dtype]:
    return torch.float32 if dtype in _LOW_PRECISION else None


# --- the watch -------------------------------------------------------------------------------------
class WatchHandle:
    """What :func:`watch` returns: the installed hooks and their state. ``remove()`` undoes it all."""

    def __init__(self, client: Client, model: nn.Module, optimizers: Sequence[Any], scaler: Any,
                 clip: Optional[float], per_layer_every: int, memory_every: int, layer_depth: int,
                 norm_every: int = 1, log_lr: bool = True, overhead_budget: float = 0.005,
                 memory_interval_s: float = 0.0, step_timing: bool = True,
                 hook_module: Optional[nn.Module] = None, nvml_interval_s: float = 0.0,
                 take_clip_norms: bool = True) -> None:
        self._client = client
        self._model_ref = weakref.ref(model)
        self.layout = ParamLayout(model, layer_depth)
        self._norms = GradNormComputer(self.layout)
        self._optimizers = list(optimizers)
        # a disabled GradScaler (enabled=False) has nothing to report, and code that shares one path for
        # bf16 and fp16 may not call its update(): the optimizer's step ends the iteration then
        self._scaler = scaler if getattr(scaler, "_enabled", True) else None
        self.clip = float(clip) if clip is not None and clip > 0 and math.isfinite(clip) else None
        self.per_layer_every = max(0, int(per_layer_every))
        self.memory_every = max(0, int(memory_every))
        self.memory_interval_s = max(0.0, float(memory_interval_s))
        self._last_memory = 0.0  #: perf_counter of the last memory sample
        self.norm_every = max(1, int(norm_every))
        #: Most of a step's time the norm computation may take (host-side time: the whole cost on CPU,
        #: the launch cost on CUDA); beyond it norms are read every few steps instead of every step.
        self.overhead_budget = max(0.0, float(overhead_budget))
        self.adaptive_every = 1  #: the cadence the budget currently asks for
        self._on_cpu = all(p.device.type == "cpu" for p in self.layout.params)
        self._norm_cost_s = 0.0  #: EWMA of the host time one norm computation takes
        self._typical_norm = 0.0  #: EWMA of the global norm (CPU models: read for free)
        self._every_step_until = 0  #: step count up to which the budget is suspended
        self._log_lr = log_lr and bool(self._optimizers)
        self.steps = 0  #: step boundaries seen
        self.removed = False
        self._disabled: Dict[str, str] = {}
        self._pending: Optional[Norms] = None
        self._backward_seen = False
        self._backward_ran = False  #: an end-of-backward callback ran since the last step boundary
        self._queued_task = -2
        self._last_boundary = 0.0
        self._handles: List[Any] = []
        self._scaler_update: Optional[Callable[..., Any]] = None
        self._scaler_wrapper: Optional[Callable[..., Any]] = None
        self._attribution = self._memory_attribution
        self.boundary = "backward"
        #: phase marks of the step (integrations/step_timing.py); None when step_timing=False
        self.timer: Optional[StepTimer] = StepTimer() if step_timing else None
        self._hook_module = hook_module if hook_module is not None else model
        self.nvml: Optional[nvml.Sampler] = None
        #: norms taken from the job's clip_grad_norm_ (integrations/clip_tap.py) instead of a second read
        #: of the gradients: wanted unless a GradScaler scales them (its norms are unscaled by hand)
        self._tap = take_clip_norms and self._scaler is None
        self._tap_live = False  #: the last clip_grad_norm_ call gave this watch its norms
        self._tap_step = -1     #: the step count whose norms the tap delivered
        self._step_depth = 0    #: optimizer step() calls in progress (a subclass's step calls its base's)
        self._install()
        if nvml_interval_s > 0 and not self._on_cpu:
            self.nvml = nvml.start(client, self._devices(), nvml_interval_s)

    # --- installation -------------------------------------------------------------------------
    def _install(self) -> None:
        if _queue_callback is not None:
            for param in self.layout.sentinels():
                try:
                    self._handles.append(param.register_post_accumulate_grad_hook(self._on_grad_ready))
                except Exception as exc:  # e.g. a non-leaf parameter (parametrizations)
                    warn_once(f"watch:sentinel:{type(exc).__name__}",
                              f"watch(): cannot hook a parameter ({exc}); norms read at the step instead")
        else:
            warn_once("watch:engine", "watch(): autograd callbacks unavailable; norms read at the step")
        if self._scaler is not None and callable(getattr(self._scaler, "update", None)):
            original = self._scaler.update
            self._scaler_update = original

            def update(*args: Any, **kwargs: Any) -> Any:
                amp = self._guard("amp", self._before_scaler_update)
                result = original(*args, **kwargs)
                self._guard("step", self._on_boundary, amp)
                return result

            self._scaler.update = update
            self._scaler_wrapper = update
            self.boundary = "scaler.update"
        elif self._optimizers:
            opt = self._optimizers[-1]
            try:
                self._handles.append(opt.register_step_pre_hook(self._before_optimizer_step))
                self._handles.append(opt.register_step_post_hook(self._on_optimizer_step))
                self.boundary = "optimizer.step"
            except Exception as exc:
                warn_once(f"watch:optimizer:{type(opt).__name__}",
                          f"watch(): cannot hook {type(opt).__name__}.step ({exc}); "
                          "each backward pass counts as a step")
        cuda_memory.add_attribution(self._client, self._attribution)
        if self._tap:
            self._tap = clip_tap.add(self)
        timer = self.timer
        if timer is not None:
            try:
                self._handles.append(self._hook_module.register_forward_pre_hook(timer.forward_start))
                self._handles.append(self._hook_module.register_forward_hook(timer.forward_end))
                set_current(timer)
            except Exception as exc:
                self.timer = None
                warn_once(f"watch:timing:{type(exc).__name__}",
                          f"watch(): cannot time the forward pass ({exc}); step phases not reported")

    def remove(self) -> None:
        """Remove every hook and restore the scaler's ``update``. Idempotent."""
        if self.removed:
            return
        self.removed = True
        remove_hooks(self._handles)
        scaler = self._scaler
        if scaler is not None and self._scaler_update is not None:
            if getattr(scaler, "__dict__", {}).get("update") is self._scaler_wrapper:
                try:
                    del scaler.update
                except AttributeError:
                    pass
        cuda_memory.remove_attribution(self._client, self._attribution)
        if self._tap:
            clip_tap.discard(self)
        if self.timer is not None:
            set_current(None, self.timer)
            self.timer.close()
        if self.nvml is not None:
            self.nvml.stop()
        self._pending = None
        model = self._model_ref()
        if model is not None:
            _active.forget(model, self)

    @property
    def disabled(self) -> Dict[str, str]:
        """Parts switched off after an internal error: {part: reason}."""
        return dict(self._disabled)

    # --- guard --------------------------------------------------------------------------------
    def _guard(self, part: str, fn: Callable[..., Any], *args: Any) -> Any:
        if self.removed or part in self._disabled:
            return None
        try:
            return fn(*args)
        except Exception as exc:  # never into the training step
            reason = f"{type(exc).__name__}: {str(exc)[:200]}"
            self._disabled[part] = reason
            warn_once(f"watch:{part}:{type(exc).__name__}",
                      f"watch(): the {part} hook failed ({reason}); it is disabled, training continues")
            return None

    # --- backward ------------------------------------------------------------------------------
    def _on_grad_ready(self, _param: Any) -> None:
        """Sentinel hook: queue the end-of-backward callback once per backward pass."""
        if self.removed or "gradients" in self._disabled:
            return
        timer = self.timer
        if timer is not None:
            timer.grad_ready()
        try:
            task = _graph_task_id() if _graph_task_id is not None else -1
            if task == self._queued_task and task != -1:
                return
            if task == -1 and self._backward_seen:
                return
            self._queued_task = task
            self._backward_seen = True
            _queue_callback(self._requeue)  # type: ignore[misc]
        except Exception as exc:
            self._guard("gradients", _raise, exc)

    def _requeue(self) -> None:
        """First final callback: go to the back of the queue, after DDP's finaliser and friends."""
        try:
            _queue_callback(self._after_backward)  # type: ignore[misc]
        except Exception:
            self._after_backward()

    def _adapt_cadence(self) -> None:
        """Stretch the global-norm cadence so its cost stays within ``overhead_budget`` of a step.

        Only for parameters on the CPU, where the host time measured is the norm pass itself (on CUDA it
        would only be the launch cost, and the pass is a sliver of a GPU step anyway)."""
        step_time = self._client.step_time_ewma
        if (self.overhead_budget <= 0 or step_time <= 0 or self._norm_cost_s <= 0
                or not self._on_cpu or self.steps < self._every_step_until):
            self.adaptive_every = 1
            return
        needed = math.ceil(self._norm_cost_s / (self.overhead_budget * step_time))
        self.adaptive_every = min(MAX_ADAPTIVE_EVERY, max(1, needed))

    def _norms_due(self, count: int) -> bool:
        """Whether the step numbered ``count`` (1-based) reports norms (global or per layer)."""
        every = self.per_layer_every
        norm_every = max(self.norm_every, self.adaptive_every)
        return count == 1 or count % norm_every == 0 or bool(every and count % every == 0)

    def _after_backward(self) -> None:
        if self.timer is not None:
            self.timer.backward_end()
        self._backward_seen = False
        self._backward_ran = True
        self._queued_task = -2
        if self._norms_due(self.steps + 1) and not self._tap_live:
            self._guard("gradients", self._compute_norms)
        if self.boundary == "backward":
            self._guard("step", self._on_boundary, None)

    def _compute_norms(self) -> None:
        scale = None
        scaler = self._scaler
        if scaler is not None and getattr(scaler, "_enabled", False):
            scale = getattr(scaler, "_scale", None)
        started = time.perf_counter()
        with torch.no_grad():
            self._pending = self._norms.compute(scale if isinstance(scale, torch.Tensor) else None)
        cost = time.perf_counter() - started
        self._norm_cost_s = cost if self._norm_cost_s == 0.0 else 0.8 * self._norm_cost_s + 0.2 * cost
        pending = self._pending
        if pending is not None and pending.total.device.type == "cpu":
            self._watch_for_climbs(float(pending.total))

    def take_clip_norms(self, params: Sequence[Any], per_param: List[torch.Tensor],
                        total: torch.Tensor) -> bool:
        """The norms ``clip_grad_norm_`` just computed over ``params`` (pre-clip; see clip_tap.py): this
        step's norms when ``params`` are exactly the watched parameters. True when taken. Not taken when a
        frozen parameter of the clip carries a gradient (a base model trained earlier in the same process,
        then frozen for an adapter): clip's total and norms count it, the watched set's do not -- the
        watch reads its own parameters' norms instead."""
        if self.removed or "gradients" in self._disabled:
            return False
        layout = self.layout.params
        trained = []
        for p in params:
            if getattr(p, "requires_grad", False):
                trained.append(p)
            elif getattr(p, "grad", None) is not None:  # frozen (LoRA's base) yet holding a stale gradient
                return False
        if len(trained) != len(layout) or any(a is not b for a, b in zip(trained, layout)):
            return False
        self._tap_live = True
        self._tap_step = self.steps + 1
        if not self._norms_due(self.steps + 1):
            return True
        present = len(per_param) == len(layout)
        positions = None if present else tuple(i for i, p in enumerate(layout) if p.grad is not None)
        device = total.device
        stacked = torch.stack([n.to(device, torch.float32) for n in per_param])
        self._pending = Norms(total, stacked, positions)
        if device.type == "cpu":
            self._watch_for_climbs(float(total))
        return True

    def _watch_for_climbs(self, norm: float) -> None:
        """A CPU norm is on the host already: when it jumps (or is not finite), read every step for a
        while, so a sampled cadence never hides the start of an explosion."""
        typical = self._typical_norm
        if not math.isfinite(norm) or (typical > 0 and norm > SUSPICIOUS_FACTOR * typical):
            self._every_step_until = self.steps + 1 + SUSPICIOUS_STEPS
        if math.isfinite(norm):
            self._typical_norm = norm if typical == 0 else 0.9 * typical + 0.1 * norm

    # --- step boundary -------------------------------------------------------------------------
    def _before_optimizer_step(self, _optimizer: Any, _args: Any, _kwargs: Any) -> None:
        self._step_depth += 1

    def _on_optimizer_step(self, _optimizer: Any, _args: Any, _kwargs: Any) -> None:
        # an optimizer whose step() calls super().step() runs the hooks once per class level: one boundary
        self._step_depth = max(0, self._step_depth - 1)
        if self._step_depth:
            return
        self._guard("step", self._on_boundary, None)

    def _before_scaler_update(self) -> Optional[Dict[str, Any]]:
        """The scale this step used and whether it overflowed, as device tensors (before update)."""
        scaler = self._scaler
        if not getattr(scaler, "_enabled", False):
            return None
        scale = getattr(scaler, "_scale", None)
        if not isinstance(scale, torch.Tensor):
            return None
        out: Dict[str, Any] = {"amp/scale": scale.detach().clone()}
        found: List[torch.Tensor] = []
        for state in getattr(scaler, "_per_optimizer_states", {}).values():
            found.extend(state.get("found_inf_per_device", {}).values())
        if len(found) == 1:
            out["amp/overflow"] = found[0]
        elif found:
            out["amp/overflow"] = torch.stack([f.to(found[0].device) for f in found]).amax()
        return out

    def _on_boundary(self, amp: Optional[Dict[str, Any]]) -> None:
        now = time.perf_counter()
        previous = self._last_boundary
        dt = now - previous if previous else None
        self._last_boundary = now
        self._backward_seen = False
        self.steps += 1
        count = self.steps
        client = self._client
        step = client.note_optimizer_step(dt)
        self._adapt_cadence()
        metrics: Dict[str, Any] = {}
        if dt is not None:
            metrics["time/step_s"] = dt
        if self.timer is not None:
            metrics.update(self.timer.phases(previous, now))
        norms = self._pending
        self._pending = None
        backward_ran, self._backward_ran = self._backward_ran, False
        if self._tap_live and self._tap_step != count:
            # the clip whose norms this watch waited for did not come this step: read them again
            # after backward from the next step on (this step's gradients may be clipped already)
            self._tap_live = False
        if (norms is None and not backward_ran and "gradients" not in self._disabled
                and self._norms_due(count)):
            # No backward callback ran since the last step (unhooked parameters, no autograd engine
            # callbacks): read the gradients as they are now (after any clipping / unscaling). Never
            # when one ran and found the step not due: the gradients here are the clipped ones.
            with torch.no_grad():
                norms = self._guard("gradients", self._norms.compute)
        if norms is not None and norms.sharded:
            # this rank's share: the processor adds the shares of the step's ranks (docs/sharded-norms.md)
            metrics["grad/shard_sumsq"] = norms.total * norms.total
        elif norms is not None:
            metrics["grad/global_norm"] = norms.total
            if self.clip is not None:
                metrics["grad/clip_triggered"] = torch.gt(norms.total, self.clip - 1e-6)
                metrics["grad/clip_threshold"] = self.clip
        if amp:
            metrics.update(amp)
        if self._log_lr:
            try:
                lr = self._optimizers[0].param_groups[0]["lr"]
                # a tensor lr is updated in place by schedulers: copy it (on the device) for the worker
                metrics["opt/lr"] = lr.detach().clone() if isinstance(lr, torch.Tensor) else lr
            except Exception:
                self._log_lr = False
        if metrics:
            client.record_metrics(step, metrics)
        every = self.per_layer_every
        if norms is not None and every and (count == 1 or count % every == 0):
            self._guard("layers", self._report_layers, step, norms)
        every, interval = self.memory_every, self.memory_interval_s
        if every and (count == 1 or count % every == 0
                      or (interval and now - self._last_memory >= interval)):
            self._last_memory = now
            self._guard("memory", self._report_memory)

    def _report_layers(self, step: int, norms: Norms) -> None:
        with torch.no_grad():
            vector = self._norms.layer_norms(norms)
            if norms.sharded:
                vector = vector * vector
        names = self.layout.shard_metric_names if norms.sharded else self.layout.metric_names
        self._client.log_vector(step, names, vector)

    def _devices(self) -> List[torch.device]:
        devices: List[torch.device] = []
        for param in self.layout.params:
            if param.device not in devices:
                devices.append(param.device)
        return devices or [torch.device("cpu")]

    def _report_memory(self) -> None:
        cuda_memory.report_memory(self._client, self._devices())

    def _memory_attribution(self, device_type: str) -> Dict[str, int]:
        """Bytes of parameters (frozen ones too), gradients and optimizer state on ``device_type``."""
        model = self._model_ref()
        params = list(model.parameters()) if model is not None else self.layout.params
        out = {"params_bytes": cuda_memory.tensor_bytes(params, device_type),
               "grads_bytes": cuda_memory.tensor_bytes((p.grad for p in params if p.grad is not None),
                                                       device_type)}
        state_bytes = 0
        for opt in self._optimizers:
            for state in getattr(opt, "state", {}).values():
                if isinstance(state, dict):
                    state_bytes += cuda_memory.tensor_bytes(state.values(), device_type)
        out["optimizer_state_bytes"] = state_bytes
        return out


def _raise(exc: BaseException) -> None:
    raise exc


# --- entry points ----------------------------------------------------------------------------------
def watch(client: Client, model: Any, optimizer: Any = None, scaler: Any = None,
          clip: Optional[float] = None, every: Optional[int] = None, **kwargs: Any) -> WatchHandle:
    """Hook ``model`` (and ``optimizer``, ``scaler``) to report gradient, AMP, step-time and memory signals.

    ``optimizer``: a torch optimizer (or a list of them; the last one's step ends an iteration),
    possibly wrapped by Lightning/accelerate. ``scaler``: a ``torch.amp.GradScaler``; its ``update`` then
    ends an iteration. ``clip``: the ``max_norm`` given to ``clip_grad_norm_``, enabling
    ``grad/clip_triggered``. ``every``: per-layer norms every N steps (default ``per_layer_every``).
    Keyword options: ``layer_depth``, ``memory_every`` and ``memory_interval_s`` (default: the client's
    options),
    ``norm_every`` (global norm at least every N steps, default 1), ``overhead_budget`` (default: the
    ``watch_overhead_budget`` option, 0.005: when computing the norms takes more than this fraction of a
    step — a small model on CPU, where the norm pass is a real read of every gradient — they are
    computed every few steps instead, at most every ``MAX_ADAPTIVE_EVERY``; 0 disables), ``log_lr``
    (default True), ``step_timing`` (default True: the phases of each step, see :mod:`.step_timing`),
    ``nvml_interval_s`` (default 5: NVML samples of a CUDA model's GPUs, see :mod:`.nvml`; 0 disables),
    ``take_clip_norms`` (default True: when the job calls ``torch.nn.utils.clip_grad_norm_`` on the
    watched parameters, its norms are reported instead of reading the gradients again, see
    :mod:`.clip_tap`).
    Watching a model
    again replaces the previous watch of it. Also installs the OOM enricher. Raises TypeError when
    ``model`` is not an ``nn.Module`` (``trainguard.watch`` reports it).
    """
    module = unwrap_model(model)
    if not isinstance(module, nn.Module):
        raise TypeError(f"watch() needs a torch.nn.Module, got {type(model).__name__}")
    for name in kwargs:
        if name not in _WATCH_KWARGS:
            warn_once(f"watch:kwarg:{name}", f"watch(): unknown option {name!r} ignored")
    opts = client.options
    memory_every = kwargs.get("memory_every")
    layer_depth = kwargs.get("layer_depth")
    if optimizer is None:
        optimizers: List[Any] = []
    elif isinstance(optimizer, (list, tuple)):
        optimizers = [unwrap_optimizer(o) for o in optimizer if o is not None]
    else:
        optimizers = [unwrap_optimizer(optimizer)]
    cuda_memory.install_oom_enricher(client)
    handle = WatchHandle(
        client, module, optimizers, scaler, clip,
        per_layer_every=opts.per_layer_every if every is None else int(every),
        memory_every=opts.memory_every if memory_every is None else int(memory_every),
        memory_interval_s=float(kwargs.get("memory_interval_s", opts.memory_interval_s)),
        layer_depth=opts.layer_depth if layer_depth is None else int(layer_depth),
        norm_every=int(kwargs.get("norm_every") or 1), log_lr=bool(kwargs.get("log_lr", True)),
        overhead_budget=float(kwargs.get("overhead_budget", opts.watch_overhead_budget)),
        step_timing=bool(kwargs.get("step_timing", True)), hook_module=_timed_module(model),
        nvml_interval_s=float(kwargs.get("nvml_interval_s", nvml.DEFAULT_INTERVAL_S)),
        take_clip_norms=bool(kwargs.get("take_clip_norms", True)))
    _active.replace(module, handle)
    return handle


def _timed_module(model: Any) -> Optional[nn.Module]:
    """The module whose forward is timed: the user's module inside DDP/DataParallel (DDP's own
    pre-forward may broadcast buffers: a collective, not this rank's compute), but a ``torch.compile``
    wrapper itself (hooks inside the compiled module would be traced)."""
    for _ in range(8):
        if isinstance(getattr(model, "_orig_mod", None), nn.Module):
            return model if isinstance(model, nn.Module) else None
        if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
            model = model.module
            continue
        break
    return model if isinstance(model, nn.Module) else None


def unwatch_all(client: Optional[Client] = None) -> int:
    """Remove every active watch (of ``client`` only, when given); returns how many were removed."""
    return _active.remove_all(client)
