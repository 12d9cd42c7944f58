"""The classification catalogue as data, the exit-code decision path, and every detection threshold.

Three things live here, all pure data plus small lookups (no I/O, stdlib only):

1. :data:`KINDS` -- every incident kind of DESIGN §4 (and of the seeds in ``/shared/seeds``): category,
   subtype, severity, a title template, what it means, the likely root causes, and "what to check first",
   ordered **hardware → framework → model** (cheapest first; hardware checks rule out ~30% of cases).
   ``detected`` says whether this version of the pipeline raises it; the others are waiting for their
   detectors (issue 4) and are here so titles, checklists and the README table have one source.
2. The decision path for a process that ended (:data:`EXIT_RULES`, :func:`classify_exit`) and the
   exception-type rules (:data:`EXCEPTION_RULES`). The error-text classifier that uses them is
   :mod:`trainguard_engine.classify`; :func:`classify_exception` here is its ``(category, subtype)``.
3. :class:`DetectionSettings` -- every threshold and state bound of the pipeline with its documented
   default; :meth:`DetectionSettings.from_overrides` validates per-project overrides.

Subtype names: the DESIGN's hyphenated names (``rise-after-fall``, ``oom-or-cuda-error``), except
``loss/non_finite``, which mirrors the SDK's ``non_finite:<metric>`` alert.
"""

from __future__ import annotations

import difflib
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

# ----------------------------------------------------------------------------------------------------
# Incident kinds

LAYERS = ("hardware", "framework", "model")
"""Check layers, in the order a person should go through them."""

SEVERITIES = ("info", "warning", "error", "critical")


@dataclass(frozen=True)
class Check:
    """One thing to check, in one layer (``hardware`` | ``framework`` | ``model``)."""

    layer: str
    text: str

    def render(self) -> str:
        """``"hardware: <text>"`` -- the form stored in ``Incident.checks``."""
        return f"{self.layer}: {self.text}"


@dataclass(frozen=True)
class IncidentKind:
    """One row of the catalogue.

    ``title`` is a :meth:`str.format` template; the pipeline passes ``step``, ``value``, ``detail``,
    ``rank`` and kind-specific fields (missing ones render as ``?``). A title of just ``{detail}`` (the
    kinds the error-text classifier opens) takes the producer's ``detail`` as the whole title: the
    classifier's headline, e.g. "CUDA OOM on GPU 0: tried to allocate 20.00 MiB with 3.19 MiB free of
    79.15 GiB". ``checks`` are ordered hardware → framework → model (enforced when the module is
    imported).
    """

    category: str
    subtype: str
    severity: str
    title: str
    description: str
    signals: str
    causes: Tuple[str, ...]
    checks: Tuple[Check, ...]
    detected: bool = False

    @property
    def name(self) -> str:
        return f"{self.category}/{self.subtype}"

    def checklist(self) -> List[str]:
        """The checks as strings (``"framework: ..."``), cheapest layer first."""
        return [c.render() for c in self.checks]

    def render_title(self, values: Mapping[str, Any]) -> str:
        """The title with ``values`` filled in; a placeholder without a value renders as ``?``."""
        return self.title.format_map(_Defaulting(values))


class _Defaulting(dict):  # type: ignore[type-arg]
    def __init__(self, values: Mapping[str, Any]) -> None:
        super().__init__(values)

    def __missing__(self, key: str) -> str:
        return "?"


def _hw(text: str) -> Check:
    return Check("hardware", text)


def _fw(text: str) -> Check:
    return Check("framework", text)


def _model(text: str) -> Check:
    return Check("model", text)


_HW_GPU = _hw("GPU health: `nvidia-smi -q` temperatures, clocks, ECC/Xid errors in `dmesg`; swap the node "
              "if errors repeat")
_HW_NET = _hw("interconnect: `nvidia-smi topo -m` (NVLink present and up), `ethtool <nic>` link speed and "
              "errors, InfiniBand port state")
_FW_NCCL = _fw("NCCL: rerun with `NCCL_DEBUG=INFO` (and `TORCH_NCCL_ASYNC_ERROR_HANDLING=1`); check "
               "NCCL_SOCKET_IFNAME / NCCL_IB_* settings and the NCCL/driver versions match on every node")
_FW_DATA = _fw("data pipeline: DataLoader workers alive, no blocked filesystem (NFS/object store) read, "
               "no deadlock in a collate_fn or sampler")

_KIND_LIST: Tuple[IncidentKind, ...] = (
    # --- loss ---------------------------------------------------------------------------------------
    IncidentKind(
        "loss", "non_finite", "error", "Loss became {value} at step {step}",
        "The training loss is NaN or Inf; the weights are most likely corrupted from here on.",
        "a non-finite value of a loss metric (the SDK alerts at once with the recent history)",
        ("numerical instability: log(0), division by zero, sqrt of a negative, overflow in fp16",
         "a bad sample or label in the batch", "learning rate too high for the current phase"),
        (_fw("mixed precision: fp16 without a GradScaler, or a loss computed in fp16 (compute it in fp32)"),
         _fw("rerun the failing steps with `torch.autograd.set_detect_anomaly(True)` to find the op that "
             "produced the first NaN"),
         _model("the loss: log/div/sqrt of values that can reach 0 or below (add an epsilon, clamp)"),
         _model("the batch at the first non-finite step: NaN/Inf or extreme values in inputs and labels")),
        detected=True),
    IncidentKind(
        "loss", "oscillation", "warning", "Loss oscillating without a downward trend since step {step}",
        "The loss swings violently at a high level and does not trend down.",
        "large swings (robust spread of the loss over a window) with no downward trend",
        ("learning rate too high", "batch size and learning rate mismatched", "label noise"),
        (_fw("data order: shuffling on, no sampler repeating a few batches, labels aligned with inputs"),
         _model("learning rate: lower it (or lengthen warmup); scale it with the batch size"),
         _model("label noise: spot-check labels of the batches with the largest loss")),
        detected=True),
    IncidentKind(
        "loss", "rise-after-fall", "warning", "Loss rising again since step {step}",
        "The loss fell normally, then turned and keeps rising.",
        "a change point from a falling to a rising trend",
        ("warmup peak learning rate too high", "schedule bug (LR increasing instead of decaying)",
         "overfitting noisy samples"),
        (_fw("LR schedule: plot the logged LR around the turning step; check the scheduler is stepped once "
             "per optimizer step"),
         _model("peak LR after warmup: lower it"),
         _model("validation loss: if it diverges from the training loss, regularise or stop earlier")),
        detected=True),
    IncidentKind(
        "loss", "plateau", "warning", "Loss flat since step {step}",
        "The loss stays at one level for a long window, neither falling nor rising.",
        "flat loss over a long window; gradient statistics tell capacity from optimisation problems",
        ("sparse gradients: too few effective updates", "saturated activations (sigmoid/tanh)",
         "optimizer momentum mis-set", "model capacity too small"),
        (_fw("optimizer: parameters actually registered, LR not zero, momentum/betas sane"),
         _model("gradient norms per layer: tiny everywhere means optimisation is stuck, healthy norms mean "
                "capacity"),
         _model("activations: saturation of sigmoid/tanh layers; normalisation layers present")),
        detected=True),
    # --- gradient -----------------------------------------------------------------------------------
    IncidentKind(
        "gradient", "explosion", "error", "Gradient explosion: {detail}; loss became {value} at step {step}",
        "The gradient norm blew up and the loss followed into NaN/Inf: a numerical explosion, not a loss "
        "or communication problem (a NaN in one rank's gradients spreads to all ranks through AllReduce).",
        "loss NaN/Inf after grad-norm climbing (jump >= 4.5-6x its running median) or already non-finite; "
        "clip triggered on > 30% of steps; per-layer norm > 10",
        ("an outlier sample (z-score > 10) repeated in the data", "learning rate too high / schedule bug",
         "gradient clipping too loose, or global clipping hiding one exploding layer"),
        (_fw("AMP: with fp16 use a GradScaler; check the scale is not collapsing"),
         _fw("data loader: filter outlier samples (z-score > 10) and check no sample is over-sampled"),
         _model("learning rate and schedule around the climb: the LR logged at the first climbing steps"),
         _model("clipping: clip by global norm (or per layer if one layer explodes); lower max_norm"),
         _model("the layers whose gradient norm climbs first (per-layer norms)")),
        detected=True),
    IncidentKind(
        "gradient", "vanishing", "warning", "Vanishing gradients in the first layers since step {step}",
        "Shallow layers barely update: their gradient norms are orders of magnitude below the deep ones.",
        "first third of layers' grad norm >= 1000x smaller than the last third",
        ("deep stack without residuals/normalisation", "saturating activations", "bad initialisation"),
        (_fw("mixed precision: bf16/fp16 underflow of small gradients (check the GradScaler scale)"),
         _model("initialisation and normalisation layers of the first blocks"),
         _model("activations: replace saturating sigmoid/tanh, add residual connections")),
        detected=True),
    IncidentKind(
        "gradient", "clip-stale", "warning", "Gradient clipping is eating the update since step {step}",
        "The gradient norm sits at the clip threshold and the loss curve is flat: clipping removes the "
        "useful part of every update.",
        "mean grad norm of the last 5 steps > 0.98 x clip threshold and loss curvature < 1e-5; "
        "adaptive threshold: onset tau <- min(1.2 tau, 10), stale tau <- tau (1 + 0.05 stale_count)",
        ("clip threshold too low for this model/phase", "learning rate too high, so every step clips"),
        (_fw("confirm which clipping is applied (global vs per layer, before/after unscaling with AMP)"),
         _model("raise the clip threshold (the recommended adaptive value is in the evidence)"),
         _model("lower the learning rate if almost every step clips")),
        detected=True),
    IncidentKind(
        "gradient", "nan-source", "error", "First non-finite gradient in {detail} at step {step}",
        "Where the first NaN/Inf appeared: the layer and step, before it spread.",
        "first non-finite tensor and its layer; log(0), division by zero, a bad sample (z-score > 10)",
        ("log(0) / division by zero in the loss or a custom layer", "a bad sample"),
        (_fw("rerun the step with `torch.autograd.set_detect_anomaly(True)`"),
         _model("the named layer's forward: eps in norms/softmax, clamps before log/sqrt/div"),
         _model("the batch at that step: NaN/Inf or extreme values")),
        detected=True),
    # --- memory -------------------------------------------------------------------------------------
    IncidentKind(
        "memory", "oom", "error", "{detail}",
        "The CUDA caching allocator could not allocate: the process ran out of device memory.",
        '"CUDA out of memory" (torch.OutOfMemoryError; current and older message formats, amounts '
        'parsed); "CUDA error: out of memory", CUBLAS_STATUS_ALLOC_FAILED; memory_summary and memory_stats '
        'at the error',
        ("activations too large: batch size or sequence length beyond plan, checkpointing off",
         "optimizer state larger than expected (e.g. Adam states in fp32)",
         "fragmentation: enough free memory in total but no block large enough",
         "another process on the same GPU"),
        (_hw("`nvidia-smi`: no other process holding memory on this GPU; the GPU has the capacity you "
             "planned for"),
         _fw("allocator: `torch.cuda.memory_summary()` at the error -- reserved >> allocated means "
             "fragmentation (try `PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`)"),
         _fw("mixed precision and activation checkpointing enabled as planned"),
         _model("batch size / sequence length of the failing step; optimizer choice and state dtype")),
        detected=True),
    IncidentKind(
        "memory", "oom-or-cuda-error", "error", "Aborted ({detail}): out of memory or a CUDA error",
        "The process aborted (SIGABRT/SIGBUS, exit 134/135): typically a CUDA OOM or a CUDA error "
        "(device-side assert, illegal memory access) raised from C++.",
        "exit code 134/135 or signal 6/7; refined to memory/oom when the exception says so",
        ("CUDA out of memory in native code", "device-side assert (e.g. an index out of range in an "
         "embedding or a loss target)", "illegal memory access in a custom kernel", "a driver fault"),
        (_hw("`dmesg` for Xid errors and `nvidia-smi -q` for ECC errors on this GPU"),
         _fw("stderr of the rank: 'CUDA out of memory' vs 'device-side assert' vs 'illegal memory access'; "
             "rerun with `CUDA_LAUNCH_BLOCKING=1` to get the failing op"),
         _model("indices: embedding ids < vocabulary size, class targets < number of classes")),
        detected=True),
    IncidentKind(
        "memory", "cuda-error", "error", "{detail}",
        "A CUDA error on the device: an illegal memory access, a device-side assertion, an ECC / Xid "
        "hardware fault or a failed CUDA library call. Kernel errors are reported asynchronously: the Python "
        "stack may point past the op that failed.",
        '"CUDA error: ..." (illegal memory access, device-side assert triggered, uncorrectable ECC error, '
        "...), a kernel's \"Assertion `...` failed\" line, NVRM Xid lines, CUBLAS/CUDNN_STATUS_*_FAILED, "
        "ncclUnhandledCudaError",
        ("an index out of range in a kernel (embedding ids, class targets): a device-side assert",
         "an out-of-bounds access in a custom or fused kernel",
         "a GPU hardware fault (ECC, Xid 48/79/94/95, fallen off the bus)",
         "a PyTorch build without kernels for this GPU, or a driver older than its CUDA runtime"),
        (_hw("`dmesg | grep -i xid` and `nvidia-smi -q -d ECC,PAGE_RETIREMENT` on this node: an Xid or "
             "uncorrectable ECC error means drain the node"),
         _fw("rerun the failing step with `CUDA_LAUNCH_BLOCKING=1` to find the op that failed "
             "(`compute-sanitizer` for custom kernels)"),
         _fw("driver, CUDA runtime and PyTorch build match the GPU (`torch.cuda.get_arch_list()`)"),
         _model("indices: embedding ids < num_embeddings, class targets < number of classes, gather/scatter "
                "indices in range")),
        detected=True),
    IncidentKind(
        "memory", "fragmentation", "warning", "Allocator fragmentation {detail} since step {step}",
        "Much memory is reserved but not active: free memory exists only in small blocks.",
        "(reserved - active)/reserved: < 0.2 healthy, 0.2-0.5 mild, > 0.5 severe; early warning when "
        "> 0.7 with std > 0.15 over 60 s; alloc rate > 5 GB/s with few large free blocks is level 2",
        ("many differently sized allocations (dynamic shapes)", "caching allocator settings"),
        (_fw("`PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True` (or max_split_size_mb)"),
         _model("pad dynamic shapes to a few bucket sizes")),
        detected=True),
    IncidentKind(
        "memory", "leak", "warning", "Memory leak: {detail} since step {step}",
        "Allocated device memory (or host RSS) grows across steps instead of staying flat.",
        "allocated (or RSS) grows steadily across steps",
        ("tensors kept alive with their graph (losses appended to a list without .item()/.detach())",
         "autograd.grad results not detached", "a growing cache in user code"),
        (_fw("DataLoader workers' RSS (copy-on-write of Python objects in large datasets)"),
         _model("metrics accumulated as tensors: use `.item()` / `.detach()`"),
         _model("caches and lists that grow per step")),
        detected=True),
    IncidentKind(
        "memory", "amp-overflow", "warning", "AMP overflow: {detail} since step {step}",
        "fp16 gradients overflow repeatedly and the GradScaler's scale keeps collapsing.",
        "fp16 grads Inf/NaN with reserved > 90% of capacity; GradScaler scale collapsing repeatedly",
        ("fp16 range exceeded by activations or gradients", "loss scale growth too aggressive"),
        (_fw("switch to bf16 where the hardware supports it"),
         _fw("GradScaler settings: growth_interval, init_scale"),
         _model("layers with huge activations (attention logits, unnormalised outputs)")),
        detected=True),
    IncidentKind(
        "memory", "context-leak", "warning", "Other processes hold {detail} on {device} since step {step}",
        "Another process's CUDA context or device memory sits on this rank's GPU: usually what a previous "
        "job left behind when it exited.",
        "another CUDA context on the device (NVML): high; > 0.5% of capacity used by others: medium",
        ("zombie processes (DataLoader workers, spawned children)", "driver not releasing the context"),
        (_hw("`nvidia-smi` for leftover processes; reset the GPU if none is listed but memory is held"),
         _fw("child processes terminated on exit (DataLoader workers, multiprocessing)")),
        detected=True),
    # --- communication ------------------------------------------------------------------------------
    IncidentKind(
        "comm", "failure", "error", "Communication failure ({detail})",
        "A rank exited with code 255, the usual mark of an NCCL / communication failure.",
        "exit code 255",
        ("a peer rank died", "network fault between nodes", "NCCL misconfiguration"),
        (_HW_NET, _HW_GPU, _FW_NCCL,
         _fw("the other ranks' incidents: a crashed or killed rank explains its peers' failures")),
        detected=True),
    IncidentKind(
        "comm", "init-failure", "error", "{detail}",
        "Ranks could not connect to each other at start-up.",
        "rendezvous cannot connect; TCPStore / DistNetworkError / DistStoreError timeouts (\"k/n clients "
        "joined\"), client socket connect timeouts, port in use, NCCL bootstrap / socket connect failures",
        ("MASTER_ADDR/MASTER_PORT wrong", "firewall", "nodes isolated from each other",
         "a rank that never started (scheduler, image, crash before init)"),
        (_hw("reachability: from each node `nc -zv $MASTER_ADDR $MASTER_PORT`"),
         _fw("MASTER_ADDR / MASTER_PORT / WORLD_SIZE identical on every rank; the port is free"),
         _fw("firewall / security groups between the nodes; NCCL_SOCKET_IFNAME names an interface every "
             "node has"),
         _fw("every rank started: the scheduler's view of the job and the missing ranks' own logs")),
        detected=True),
    IncidentKind(
        "comm", "timeout", "error", "{detail}",
        "A collective (AllReduce, AllGather, ...) waited past its timeout in the middle of training.",
        "collective watchdog timeout mid-training (NCCL \"Watchdog caught collective operation timeout\", "
        "gloo \"Timed out waiting ... for recv\", monitoredBarrier); name the lagging rank (desync report)",
        ("a GPU dropped off the bus", "PCIe or network bandwidth degraded or contended",
         "one rank slower or stuck (data loading, a different code path)"),
        (_HW_GPU, _HW_NET, _FW_NCCL,
         _model("code paths that differ per rank (a collective skipped under a rank-dependent `if`)")),
        detected=True),
    IncidentKind(
        "comm", "mismatch", "error", "{detail}",
        "Ranks called a collective with different shapes, dtypes or operations.",
        '"Detected mismatch between collectives" (TORCH_DISTRIBUTED_DEBUG=DETAIL), gloo "Received data size '
        'doesn\'t match expected size", ncclInvalidUsage / ncclInvalidArgument',
        ("rank-dependent tensor shapes", "a collective skipped or reordered on some rank"),
        (_fw("run with `TORCH_DISTRIBUTED_DEBUG=DETAIL` to get the mismatching calls"),
         _model("shapes/dtypes of tensors passed to collectives on every rank; uneven last batches")),
        detected=True),
    IncidentKind(
        "comm", "rank-lost", "error", "{detail}",
        "A peer process died; the survivors' errors are consequences, not causes.",
        "a peer process died (exit, kill, OOM) before the others' communication errors: gloo \"Connection "
        "reset/closed by peer\", ncclRemoteError, the TCPStore server gone",
        ("the lost rank's own failure (see its incident)", "node failure or preemption",
         "a network partition between the nodes"),
        (_hw("the lost rank's node: power, kernel log, OOM-killer"), _HW_NET,
         _fw("the first failing rank's own incident: fix that, the rest follows")),
        detected=True),
    # --- sequence / adapter -------------------------------------------------------------------------
    IncidentKind(
        "sequence", "truncation", "warning", "Truncation without a consistent attention mask ({detail})",
        "Sequences are truncated while padding is attended or EOS is cut off.",
        "truncation without a consistent attention mask (padding attended), EOS cut off; loss offset vs "
        "reference",
        ("tokenizer truncation without regenerating the attention mask (mask built before truncation, or "
         "for the other padding side)", "max_length too small", "labels not set to -100 on padding"),
        (_fw("tokenizer call: truncation=True with return_attention_mask=True, padding side"),
         _model("max sequence length vs the data's length distribution; EOS kept after truncation")),
        detected=True),
    IncidentKind(
        "adapter", "lora-grad-break", "warning", "LoRA adapters not learning since step {step}",
        "The LoRA A/B gradients are ~0 while the loss still moves: the adapters are cut off from the graph.",
        "LoRA A/B grad mean < 1e-6 while the loss still moves",
        ("reentrant gradient checkpointing over a frozen base: the checkpointed input does not require "
         "grad, so no gradient reaches the adapters inside", "adapters not attached to the modules used in "
         "forward", "requires_grad off on the adapters", "base model in a no_grad/inference context"),
        (_fw("gradient checkpointing: `use_reentrant=False`, or `model.enable_input_require_grads()` with "
             "a frozen embedding"),
         _fw("peft: `print_trainable_parameters()`; target_modules match the model's module names"),
         _model("the forward path actually goes through the adapted modules")),
        detected=True),
    # --- process (the decision path for a process that ended) ----------------------------------------
    IncidentKind(
        "process", "exception", "error", "Crashed: {detail}",
        "A Python exception ended the process (exit code 1): read the traceback.",
        "an uncaught exception; exit code 1",
        ("a bug or a bad input at the failing line (see the traceback)",),
        (_fw("the traceback's innermost in-app frame and the library call it made"),
         _fw("library versions: the same code worked with which torch/transformers version?"),
         _model("the inputs at the failing step: shapes, dtypes, devices")),
        detected=True),
    IncidentKind(
        "process", "killed", "error", "Killed ({detail}): the OOM-killer or a preemption",
        "SIGKILL (exit 137): the kernel OOM-killer (host memory) or the scheduler preempting or "
        "evicting the job. The process had no chance to report anything.",
        "exit code 137 or signal 9",
        ("host memory exhausted (kernel OOM-killer; also cgroup/container memory limits)",
         "preemption or eviction by the scheduler (spot instance, priority, node drain)"),
        (_hw("`dmesg | grep -i -E 'killed process|out of memory'` on the node: OOM-killer or not"),
         _fw("scheduler events: Kubernetes pod events (OOMKilled, Evicted, Preempting), SLURM "
             "`sacct -j <job>`; container memory limit vs the process RSS"),
         _fw("host memory: DataLoader workers x dataset copies, pinned memory"),
         _model("anything that grows host memory per step (caches, metric lists)")),
        detected=True),
    IncidentKind(
        "process", "terminated", "warning", "Terminated ({detail})",
        "SIGTERM/SIGINT (exit 143/130): asked to stop from outside -- a person, the scheduler "
        "(time limit, cancellation, preemption notice) or the launcher after another rank failed.",
        "exit code 143 or signal 15; exit code 130 or signal 2",
        ("job cancelled or time limit reached", "preemption notice", "the launcher stopping the "
         "survivors after another rank failed"),
        (_fw("scheduler: time limit, cancellation, preemption notice for this job"),
         _fw("the other ranks' incidents: torchrun terminates the survivors when one rank fails")),
        detected=True),
    IncidentKind(
        "process", "exit", "error", "Exited with {detail}",
        "The process ended with a non-zero exit code outside the decision path's known codes.",
        "any other non-zero exit code or signal",
        ("`sys.exit(n)` in user code or a library", "a native crash (SIGSEGV: exit 139)"),
        (_hw("`dmesg` for segfaults and hardware errors on the node"),
         _fw("stderr of the rank; native crashes: rerun with `faulthandler` enabled "
             "(`PYTHONFAULTHANDLER=1`)"),
         _model("where user code calls sys.exit / os._exit with this code")),
        detected=True),
    # --- progress -----------------------------------------------------------------------------------
    IncidentKind(
        "progress", "stalled", "warning", "No progress for {stalled_for} after step {step}",
        "The process is alive (heartbeats arrive) but training makes no progress: a communication hang, "
        "a deadlock, or a blocked data pipeline.",
        "alive (heartbeats) but the step has not advanced for longer than clamp(stall_factor x step "
        "time, stall_min_s, stall_max_s)",
        ("a collective waiting for a rank that is stuck or slower (communication hang)",
         "a deadlock (DataLoader workers, locks, a collective skipped on one rank)",
         "a blocked read (NFS, object store)"),
        (_HW_NET, _FW_NCCL, _FW_DATA,
         _fw("stacks of the stuck processes: `py-spy dump --pid <pid>` on every rank"),
         _model("collectives under rank-dependent control flow")),
        detected=True),
    IncidentKind(
        "progress", "lost", "error", "Silent for over {silent_for} (last seen at step {step})",
        "Nothing arrives from a run that never reported an exit: the process (or its node) died "
        "without a word, or its network path to TrainGuard is broken.",
        "no event at all for longer than lost_after_s from a run that has not exited",
        ("process killed with SIGKILL (OOM-killer, preemption): no exit event can be sent",
         "node failure", "network partition between the job and TrainGuard"),
        (_hw("the node: up, reachable, `dmesg` for the OOM-killer and hardware faults"),
         _fw("the scheduler: job/pod state and events (OOMKilled, Evicted, NodeLost)"),
         _fw("the SDK's spool directory on the node: events waiting for the network")),
        detected=True),
)

KINDS: Dict[str, IncidentKind] = {k.name: k for k in _KIND_LIST}
"""Every incident kind, keyed ``"category/subtype"``."""


def kind(category: str, subtype: str) -> IncidentKind:
    """The catalogue row for ``category/subtype``; KeyError names the known kinds."""
    try:
        return KINDS[f"{category}/{subtype}"]
    except KeyError:
        raise KeyError(f"unknown incident kind {category}/{subtype}; known: {sorted(KINDS)}") from None


def _check_catalogue() -> None:
    for k in _KIND_LIST:
        if k.severity not in SEVERITIES:
            raise AssertionError(f"{k.name}: severity {k.severity!r}")
        order = [LAYERS.index(c.layer) for c in k.checks]
        if order != sorted(order):
            raise AssertionError(f"{k.name}: checks must be ordered hardware -> framework -> model")


_check_catalogue()

# ----------------------------------------------------------------------------------------------------
# The decision path for a process that ended

SIGNAL_NAMES = {1: "SIGHUP", 2: "SIGINT", 3: "SIGQUIT", 4: "SIGILL", 5: "SIGTRAP", 6: "SIGABRT",
                7: "SIGBUS", 8: "SIGFPE", 9: "SIGKILL", 10: "SIGUSR1", 11: "SIGSEGV", 12: "SIGUSR2",
                13: "SIGPIPE", 14: "SIGALRM", 15: "SIGTERM", 24: "SIGXCPU", 25: "SIGXFSZ"}
"""Linux signal numbers (the exit code of a process killed by signal n is 128 + n)."""


@dataclass(frozen=True)
class ExitRule:
    """Exit codes / signals that mean one incident kind. ``refine``: an exception the rank reported
    just before exiting explains the exit better (its classification wins; the exit is evidence)."""

    codes: Tuple[int, ...]
    signals: Tuple[int, ...]
    category: str
    subtype: str
    meaning: str
    refine: bool = False


EXIT_RULES: Tuple[ExitRule, ...] = (
    ExitRule((134, 135), (6, 7), "memory", "oom-or-cuda-error",
             "aborted: CUDA out of memory or a CUDA error", refine=True),
    ExitRule((255,), (), "comm", "failure", "NCCL / communication failure"),
    ExitRule((1,), (), "process", "exception", "Python exception", refine=True),
    ExitRule((137,), (9,), "process", "killed", "killed by SIGKILL: the OOM-killer or a preemption"),
    ExitRule((143, 130), (15, 2), "process", "terminated", "terminated by a signal asking it to stop"),
)
"""Seed 000 §3.5, in order; a signal match wins over a code match. Anything else non-zero: process/exit."""

EXIT_REASON_MEANINGS: Dict[str, str] = {
    "OOMKilled": "the kernel's OOM-killer, at the container's memory limit (Kubernetes reported OOMKilled): "
                 "host memory, not a preemption",
}
"""What an EXIT's ``reason`` says beyond its code, when the one who saw the end knew (the agent reads
Kubernetes' termination reason from the pod); it replaces the code's generic meaning."""


@dataclass(frozen=True)
class ExitVerdict:
    """What an exit means. ``signal`` is the signal that ended the process (0 if none is known)."""

    category: str
    subtype: str
    exit_code: int
    signal: int
    meaning: str
    refine: bool

    def describe(self) -> str:
        """``"exit code 137, SIGKILL"``."""
        text = f"exit code {self.exit_code}"
        if self.signal:
            text += f", {SIGNAL_NAMES.get(self.signal, f'signal {self.signal}')}"
        return text


def signal_of_exit_code(code: int) -> int:
    """The signal a shell-convention exit code names (``128 + n``, n up to 64), else 0."""
    return code - 128 if 128 < code <= 192 else 0


def classify_exit(exit_code: int, signal: int = 0) -> Optional[ExitVerdict]:
    """The decision path for an exit: None for a clean exit (code 0, no signal).

    A negative ``exit_code`` -n (Python's ``subprocess`` convention, what a watchdog sees) means killed by
    signal n and is reported as 128 + n.
    """
    sig = signal if signal > 0 else 0
    code = exit_code
    if code < 0:
        sig = sig or -code
        code = 128 + sig
    if code == 0 and sig == 0:
        return None
    chosen: Optional[ExitRule] = None
    if sig:
        chosen = next((r for r in EXIT_RULES if sig in r.signals), None)
    if chosen is None:
        chosen = next((r for r in EXIT_RULES if code in r.codes), None)
    if chosen is None:
        meaning = "killed by " + SIGNAL_NAMES.get(sig, f"signal {sig}") if sig else "a non-zero exit code"
        return ExitVerdict("process", "exit", code, sig, meaning, refine=False)
    return ExitVerdict(chosen.category, chosen.subtype, code, sig, chosen.meaning, chosen.refine)


@dataclass(frozen=True)
class ExceptionRule:
    """An exception means ``category/subtype`` when its type is one of ``types`` (qualified, as the SDK
    sends them, or bare: the last dotted component) or ``pattern`` (a case-insensitive regex) matches its
    message. ``confidence`` is what the classifier reports for a match by type alone."""

    category: str
    subtype: str
    types: Tuple[str, ...] = ()
    pattern: str = ""
    confidence: float = 0.9


EXCEPTION_RULES: Tuple[ExceptionRule, ...] = (
    ExceptionRule("memory", "oom",
                  ("torch.OutOfMemoryError", "torch.cuda.OutOfMemoryError", "OutOfMemoryError"),
                  confidence=0.95),
    ExceptionRule("process", "terminated", ("KeyboardInterrupt",), confidence=1.0),  # Ctrl-C / SIGINT: 130
    ExceptionRule("comm", "init-failure",
                  ("torch.distributed.DistNetworkError", "torch.distributed.DistStoreError",
                   "DistNetworkError", "DistStoreError", "RendezvousTimeoutError",
                   "RendezvousConnectionError", "RendezvousClosedError"), confidence=0.6),
    ExceptionRule("comm", "failure", ("torch.distributed.DistBackendError", "DistBackendError"),
                  confidence=0.6),
    ExceptionRule("memory", "cuda-error", ("torch.AcceleratorError", "AcceleratorError"), confidence=0.6),
)
"""Exception-type rules, first match wins. The classifier (:mod:`trainguard_engine.classify`) applies them
only when no text rule matched the message: a ``DistNetworkError`` saying "Failed to recv, got 0 bytes"
mid-training is a lost peer, not a rendezvous failure."""


def classify_exception(exc_type: str, message: str) -> Tuple[str, str]:
    """``(category, subtype)`` of an exception by the error-text classifier
    (:func:`trainguard_engine.classify.classify_exception`); ``("process", "exception")`` when nothing more
    specific matches."""
    from .classify import classify_exception as classify  # classify imports this module

    found = classify(exc_type, message)
    return found.category, found.subtype


# ----------------------------------------------------------------------------------------------------
# Detection settings


def _setting(default: Any, doc: str, *, minimum: Optional[float] = None,
             maximum: Optional[float] = None) -> Any:
    return field(default=default, metadata={"doc": doc, "min": minimum, "max": maximum})


@dataclass(frozen=True)
class DetectionSettings:
    """Every threshold and bound of the pipeline, with its documented default. Immutable.

    Build with keyword arguments or :meth:`from_overrides` (per-project overrides from the server's
    configuration, validated). :meth:`documentation` lists ``(name, default, doc)`` for the README.

    **Stall threshold, reconciled.** DESIGN §4 says "no progress for > 10 min (configurable; scale it to
    observed step time)"; the quality bar (§6) says "hang flagged within 2x the expected step time". A rank
    is stalled when its step has not advanced for longer than
    ``clamp(stall_factor x step_time, stall_min_s, stall_max_s)``: 2x the observed step time (the quality
    bar), never less than ``stall_min_s`` (a floor that absorbs heartbeat spacing, checkpoint saves and
    short evaluation pauses, which a 2x rule alone would flag for sub-second steps), and never more than
    ``stall_max_s`` = the DESIGN's 10 minutes, which is also the threshold while the step time is still
    unknown (no step completed yet). The floor is what makes fast runs' detection time: with the defaults a
    run of 0.5 s steps is flagged after 120 s of no progress (+ up to one heartbeat interval), a run of
    3-minute steps after 6 minutes, a run of unknown step time after 10 minutes. A demo sets
    ``stall_min_s`` to a few seconds. Runs with steps longer than ``stall_max_s / stall_factor`` should
    raise ``stall_max_s``.
    """

    # --- progress -------------------------------------------------------------------------------
    stall_factor: float = _setting(
        2.0, "A rank is stalled after stall_factor x its step time without progress (DESIGN §6: hang "
        "flagged within 2x the expected step time), clamped to [stall_min_s, stall_max_s].", minimum=1.0)
    stall_min_s: float = _setting(
        120.0, "Floor of the stall threshold, seconds: pauses shorter than this (heartbeat spacing, "
        "checkpoint saves, short evaluations) are never a stall. A demo uses a few seconds.", minimum=0.0)
    stall_max_s: float = _setting(
        600.0, "Ceiling of the stall threshold, seconds (DESIGN §4: 10 minutes); also the threshold "
        "while the run's step time is unknown.", minimum=0.0)
    rank_lost_grace_s: float = _setting(
        20.0, "Correlation: a rank that sent nothing since before its peers' collective failure began, "
        "and has not exited, is declared lost (comm/rank-lost, leading) once the failure is this many "
        "seconds old -- or 2.5x the rank's own heartbeat interval, if longer.", minimum=0.0)
    lost_after_s: float = _setting(
        300.0, "A run that has not exited and sent no event at all for this long (by the processor's "
        "clock, see Pipeline.advance) is lost: 20 missed heartbeats at the SDK's 15 s default.",
        minimum=1.0)
    # --- loss / gradient ------------------------------------------------------------------------
    loss_metrics: Tuple[str, ...] = _setting(
        ("loss", "train/loss", "train_loss", "training_loss"),
        "Metric names that are the training loss (a non-finite value opens loss/non_finite).")
    grad_norm_metrics: Tuple[str, ...] = _setting(
        ("grad/global_norm", "grad_norm", "train/grad_norm"),
        "Metric names that are the global gradient norm (used to tell gradient/explosion from "
        "loss/non_finite).")
    explosion_jump_factor: float = _setting(
        6.0, "The loss went non-finite after a gradient explosion when the grad norm peaked at >= this "
        "many times its running median in the window before (DESIGN §4: 4.5x ResNet-like, 6x BERT-like; "
        "the conservative end).", minimum=1.0)
    explosion_window_steps: int = _setting(
        50, "How many steps before the first non-finite loss are searched for a grad-norm climb or a "
        "non-finite grad norm (seed 000 §3.5: the norm climbed for 50 steps before the NaN).", minimum=1)
    explosion_min_points: int = _setting(
        4, "Finite grad-norm values needed in that window to judge a climb.", minimum=2)
    # --- loss curve and gradient detectors (core/detectors/loss.py, gradient.py) ----------------------
    # shared ---------------------------------------------------------------------------------------
    trend_z: float = _setting(
        2.33, "Mann-Kendall |z| that makes a trend significant (one-sided p ~ 0.01); used by every "
        "trend test below.", minimum=0.0)
    confirm_checks: int = _setting(
        3, "Consecutive steps a loss-curve or clip-stale condition must hold before it opens an incident "
        "(seed: 'after 3 steps').", minimum=1)
    # --- loss curve -----------------------------------------------------------------------------------
    loss_window: int = _setting(
        40, "Loss values (the rank's last ones, one per step) judged by the oscillation and plateau tests; "
        "at most DetectionSettings.history_len.", minimum=8)
    loss_baseline_points: int = _setting(
        5, "The run's initial loss level is the median of its first this-many finite loss values.", minimum=1)
    oscillation_min_cv: float = _setting(
        0.3, "loss/oscillation: robust spread 1.4826 x MAD / median of the window >= this (violent swings).")
    oscillation_min_level: float = _setting(
        0.8, "loss/oscillation: the window's median >= this x the initial level (swinging at a high "
        "level, no real progress); here the lower of the first value and the initial median, since a "
        "far-too-high LR moves the loss from the first update on.")
    plateau_min_level: float = _setting(
        0.9, "loss/plateau: the window's median >= this x the initial level (fell by less than 10% since "
        "the start: a run that fell and then flattened is converging, not on a plateau).")
    plateau_max_change: float = _setting(
        0.1, "loss/plateau: |Theil-Sen slope (through 4-value block medians)| x window <= this x the "
        "window's median (flat), with no significant Mann-Kendall trend and a spread below "
        "oscillation_min_cv.")
    plateau_small_grad: float = _setting(
        1e-2, "loss/plateau verdict: a median global grad norm below this, a layer with exactly zero "
        "gradient (last per-layer report) or an LR of 0 means 'optimisation stuck' (saturated or dead "
        "units, zero LR); otherwise 'capacity or data'.")
    rise_smooth: int = _setting(
        5, "loss/rise-after-fall: the loss level is a rolling median of this many values.", minimum=1)
    rise_min_fall: float = _setting(
        0.5, "loss/rise-after-fall: the level first fell by >= this x the initial level (to at most half of "
        "it: a real learning phase; the dips of a flat, noisy loss reach ~30%). Lower it for fine-tuning "
        "runs that start near their optimum.")
    rise_min_rise: float = _setting(
        0.5, "loss/rise-after-fall: then rose again by >= this x that fall above its lowest level.")
    rise_min_points: int = _setting(
        8, "loss/rise-after-fall: the fewest values in the Mann-Kendall test of the rebound (z >= "
        "trend_z), and how many values in a row the rebound must hold (a short spike is not a rebound).",
        minimum=3)
    # --- gradient explosion before the NaN --------------------------------------------------------------
    explosion_sustain: int = _setting(
        3, "gradient/explosion (before NaN): the last this-many grad norms all >= explosion_jump_factor x "
        "the running median (one spike is not an explosion).", minimum=1)
    explosion_trend_points: int = _setting(
        10, "gradient/explosion (before NaN): the last this-many grad norms rise (Mann-Kendall "
        "z >= trend_z).", minimum=3)
    explosion_onset_factor: float = _setting(
        2.0, "gradient/explosion: first_step is where the norm last rose above this x its running median "
        "and stayed there.", minimum=1.0)
    layer_norm_warn: float = _setting(
        10.0, "Per-layer grad norm above which a layer is named in explosion evidence (seed: > 10 warns).")
    clip_rate_warn: float = _setting(
        0.3, "Clip-trigger rate over the explosion window above which it is named in explosion evidence "
        "(seed: clipping on > 30% of steps).")
    # --- vanishing ----------------------------------------------------------------------------------------
    vanishing_ratio: float = _setting(
        1000.0, "gradient/vanishing: L2 grad norm of the last third of layers / of the first third >= this "
        "(seed: 3 orders of magnitude).", minimum=1.0)
    vanishing_min_layers: int = _setting(3, "gradient/vanishing: layers needed in a per-layer report.",
        minimum=3)
    vanishing_min_reports: int = _setting(
        3, "gradient/vanishing: consecutive per-layer reports over the ratio.", minimum=1)
    # --- clip-stale ---------------------------------------------------------------------------------------
    clip_stale_window: int = _setting(
        5, "gradient/clip-stale: steps whose grad norm is compared with the clip threshold (seed: 5).",
            minimum=1)
    clip_stale_norm_ratio: float = _setting(
        0.98, "gradient/clip-stale: mean pre-clip grad norm of the window > this x tau (seed: 0.98) when tau "
        "is reported; otherwise every step of the window clipped.")
    clip_stale_curvature: float = _setting(
        1e-5, "gradient/clip-stale: loss curvature (2nd derivative / loss level, per step^2) below this, or "
        "within trend_z standard errors of 0 (seed: < 1e-5).")
    clip_stale_curve_window: int = _setting(
        20, "gradient/clip-stale: loss values in the curvature fit.", minimum=4)
    clip_stale_growth: float = _setting(
        0.05, "Adaptive clip threshold recommended when stale: tau <- tau x (1 + this x stale_count) (seed).")
    clip_onset_growth: float = _setting(
        1.2, "Adaptive clip threshold at an explosion onset: tau <- min(this x tau, clip_max_tau) (seed).",
            minimum=1.0)
    clip_max_tau: float = _setting(10.0, "Cap of the adaptive clip threshold at an explosion onset (seed).")
    clip_threshold_metrics: Tuple[str, ...] = _setting(
        ("grad/clip_threshold", "grad/max_norm"),
        "Metric names carrying the clip threshold tau (max_norm), when the job reports it; without one, "
        "tau is bounded by the smallest clipped pre-clip norm.")
    # --- memory detectors (core/detectors/memory.py) ----------------------------------------------------
    frag_mild: float = _setting(0.2, "memory/fragmentation: (reserved - active) / reserved below this is "
                                "healthy (DESIGN §4).", minimum=0.0, maximum=1.0)
    frag_severe: float = _setting(0.5, "memory/fragmentation: above this is severe (DESIGN §4).",
                                  minimum=0.0, maximum=1.0)
    frag_sustain_samples: int = _setting(3, "memory/fragmentation: samples in a row above frag_severe before "
                                         "it opens.", minimum=1)
    frag_peak_headroom: float = _setting(0.5, "memory/fragmentation: (reserved - peak allocated) / reserved "
                                         "needed before anything opens (memory never needed even at the "
                                         "peak; a training step's own cached buffers are not fragmentation).",
                                         minimum=0.0, maximum=1.0)
    frag_warn: float = _setting(0.7, "memory/fragmentation early warning: fragmentation above this ...",
                                minimum=0.0, maximum=1.0)
    frag_warn_std: float = _setting(0.15, "... with its standard deviation over frag_window_s above this "
                                    "(DESIGN §4).", minimum=0.0)
    frag_window_s: float = _setting(60.0, "memory/fragmentation early-warning window, seconds (DESIGN §4).",
                                    minimum=1.0)
    frag_min_samples: int = _setting(5, "Fewest samples the early-warning standard deviation is computed on.",
                                     minimum=2)
    frag_max_samples: int = _setting(256, "Fragmentation samples kept per rank.", minimum=8)
    frag_update_step: float = _setting(0.05, "Rise in fragmentation that refreshes an open incident.",
                                       minimum=0.0)
    amp_overflow_consecutive: int = _setting(10, "memory/amp-overflow: GradScaler overflow steps in a row "
                                             "(scale halving each time) that open it.", minimum=2)
    amp_overflow_episodes: int = _setting(4, "memory/amp-overflow: separate overflow episodes within "
                                          "amp_overflow_window steps that open it (the scale collapsing "
                                          "repeatedly).", minimum=2)
    amp_overflow_window: int = _setting(200, "Steps over which overflow episodes are counted.", minimum=1)
    amp_reserved_ratio: float = _setting(
        0.9, "memory/amp-overflow near capacity (DESIGN §4): reserved / capacity above which an overflow "
        "episode counts as happening near capacity.", minimum=0.0, maximum=1.0)
    amp_near_capacity_episodes: int = _setting(
        2, "memory/amp-overflow near capacity: overflow episodes after the scaler's calibration, each "
        "starting with reserved > amp_reserved_ratio x capacity, within amp_overflow_window steps.",
        minimum=1)
    frag_l2_rate: float = _setting(
        5e9, "memory/fragmentation level 2 (DESIGN §4): allocation rate above this, bytes/s ...",
        minimum=0.0)
    frag_l2_split_share: float = _setting(
        0.5, "... with at least this share of the free cached memory in split blocks (few large free "
        "blocks).", minimum=0.0, maximum=1.0)
    leak_window: int = _setting(
        48, "memory/leak: samples (of allocated device memory, else host RSS) in the trend window; also "
        "the most coarse points kept.", minimum=8)
    leak_min_samples: int = _setting(12, "memory/leak: fewest samples before a window is judged.", minimum=4)
    leak_skip_samples: int = _setting(
        2, "memory/leak: first samples of each series not judged (allocator warm-up, optimizer state "
        "created at the first step).", minimum=0)
    leak_z: float = _setting(3.0, "memory/leak: Mann-Kendall z the window must reach.", minimum=0.0)
    leak_min_growth_bytes: float = _setting(
        67108864.0, "memory/leak: least Theil-Sen growth over the window, bytes (64 MiB); also the "
        "growth that refreshes an open incident.", minimum=0.0)
    leak_min_growth_ratio: float = _setting(
        0.1, "memory/leak: least growth relative to the first block's floor.", minimum=0.0)
    leak_blocks: int = _setting(4, "memory/leak: blocks of the window whose floors (minima) must each rise.",
                                minimum=2)
    leak_peak_ratio: float = _setting(
        2.0, "memory/leak working-set rule: the all-time peak (mem/reserved on the metrics-only path) may "
        "rise at most this many times as fast as allocated memory (growing inputs are not a leak).",
        minimum=1.0)
    leak_coarse_every: int = _setting(
        8, "memory/leak: samples folded into one coarse point (median), for slow leaks.", minimum=2)
    context_leak_memory_ratio: float = _setting(
        0.005, "memory/context-leak (DESIGN §4): other processes' memory on the rank's GPU above this "
        "share of capacity is level medium; another CUDA context listed by NVML is level high.",
        minimum=0.0, maximum=1.0)
    context_leak_allowance: float = _setting(
        1073741824.0, "memory/context-leak without NVML: bytes of the driver's 'used' allowed to this "
        "process beyond what its allocator reserved (its own context, cuBLAS/NCCL workspaces): 1 GiB.",
        minimum=0.0)
    context_leak_samples: int = _setting(
        2, "memory/context-leak: consecutive samples of one device before it opens.", minimum=1)
    # --- sequence / adapter (the SDK's check_batch and watch_lora reports) -------------------------
    seq_window_checks: int = _setting(
        10, "sequence/truncation: check_batch reports (not sampled out) a rule is judged over.", minimum=1)
    seq_confirm_checks: int = _setting(
        3, "sequence/truncation: reports within the window on which a rule must hold.", minimum=1)
    seq_pad_attended_max: float = _setting(
        0.0, "sequence/truncation: seq/pad_attended_frac above this on a report is padding attended.",
        minimum=0.0, maximum=1.0)
    seq_mask_mismatch_max: float = _setting(
        0.0, "sequence/truncation: seq/mask_mismatch_frac above this: the mask disagrees with the padding.",
        minimum=0.0, maximum=1.0)
    seq_labels_on_pad_max: float = _setting(
        0.0, "sequence/truncation: seq/labels_on_pad_frac above this: the loss is computed on padding.",
        minimum=0.0, maximum=1.0)
    seq_eos_cut_min_frac: float = _setting(
        0.05, "sequence/truncation EOS cut off: the window's mean share of rows cut at max_length without "
        "EOS must reach this ...", minimum=0.0, maximum=1.0)
    seq_eos_kept_min_frac: float = _setting(
        0.9, "... while at least this share of the rows that were not cut end in EOS (the data has one).",
        minimum=0.0, maximum=1.0)
    lora_grad_min: float = _setting(
        1e-6, "adapter/lora-grad-break: both adapter gradient means (lora/grad_mean_A, _B) below this "
        "(DESIGN §4), or adapter parameters without a gradient ...", minimum=0.0)
    lora_confirm_reports: int = _setting(
        5, "... on this many watch_lora reports in a row ...", minimum=1)
    lora_loss_window: int = _setting(
        32, "... while the loss still moves: Mann-Kendall |z| >= trend_z over the last this-many loss "
        "values since the break began ...", minimum=4)
    lora_loss_min_points: int = _setting(8, "... and at least this many of them.", minimum=3)
    # --- exceptions -----------------------------------------------------------------------------
    incident_on_handled_exceptions: bool = _setting(
        False, "Open a process/exception incident for exceptions the job caught and reported "
        "(capture_exception); by default they only count in their cluster.")
    # --- error text -----------------------------------------------------------------------------
    log_text_incidents: bool = _setting(
        True, "Classify the text of log records (NCCL/gloo/CUDA errors a process prints, forwarded by the "
        "logging integration or an agent's log tailer) and open or join comm/* and memory/* incidents "
        "from them.")
    log_min_confidence: float = _setting(
        0.6, "Least classifier confidence (0..1) for a log record to open or join an incident; generic "
        "phrases score ~0.5, exact PyTorch/NCCL messages ~0.9. Exceptions always open an incident.",
        minimum=0.0, maximum=1.0)
    # --- evidence and history bounds --------------------------------------------------------------
    history_metrics: Tuple[str, ...] = _setting(
        ("lr", "opt/lr", "amp/*", "grad/clip_triggered", "time/step_s", "seq/*", "batch/*"),
        "Metrics kept in the per-rank history besides the loss and grad-norm metrics; 'prefix*' "
        "matches a prefix.")
    history_len: int = _setting(
        64, "Steps kept per (rank, metric) history series: at least the last history_len, at most twice "
        "as many (trimmed in bulk).", minimum=4)
    history_max_series: int = _setting(32, "Most history series per rank (first come).", minimum=1)
    evidence_window: int = _setting(
        20, "Values around the trigger kept in an evidence window.", minimum=1)
    max_evidence: int = _setting(
        20, "Evidence entries per incident; beyond it the entry in the middle goes, so the first ones "
        "(how it started) and the latest (how it goes) stay.",
        minimum=2)
    max_timeline: int = _setting(
        50, "Timeline entries per incident (same policy as max_evidence).", minimum=2)
    max_incident_ranks: int = _setting(4096, "Ranks and hosts listed per incident.", minimum=1)
    max_incidents_per_run: int = _setting(
        100, "Incidents per run; further ones are counted (incidents_suppressed), not opened.", minimum=1)
    # --- clusters -------------------------------------------------------------------------------
    cluster_max_members: int = _setting(
        100, "Runs, 'run:rank' entries and hosts listed per cluster (first seen first).", minimum=1)
    max_clusters: int = _setting(
        10_000, "Clusters kept in state; beyond it the least recently seen is evicted.", minimum=1)
    sample_traceback_chars: int = _setting(
        8_000, "Characters of traceback kept in a cluster's sample (the innermost part).", minimum=0)
    # --- run state bounds -----------------------------------------------------------------------
    dedupe_ids_per_run: int = _setting(
        10_000, "Event ids remembered per run to drop replayed duplicates of exceptions, lifecycle, "
        "logs and alerts (plain metrics and heartbeats are idempotent by construction).", minimum=1)
    max_runs: int = _setting(
        10_000, "Runs kept in state; beyond it ended runs (then the least recently active) are evicted.",
        minimum=1)
    max_ranks_per_run: int = _setting(16_384, "Ranks tracked per run; events of further ranks are "
                                      "counted (ranks_dropped), not tracked.", minimum=1)
    ended_run_ttl_s: float = _setting(
        3600.0, "An ended run (every rank exited) is evicted this long after its last event.", minimum=0.0)
    idle_run_ttl_s: float = _setting(
        7 * 86400.0, "A run that never ended is evicted this long after its last event.", minimum=0.0)
    evicted_runs_remembered: int = _setting(
        10_000, "Evicted runs remembered so that late events for them are dropped rather than "
        "starting a new, partial record.", minimum=0)

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            lo, hi = f.metadata.get("min"), f.metadata.get("max")
            if lo is not None and value < lo:
                raise ValueError(f"detection setting {f.name} must be >= {lo}, got {value!r}")
            if hi is not None and value > hi:
                raise ValueError(f"detection setting {f.name} must be <= {hi}, got {value!r}")
        if self.stall_min_s > self.stall_max_s:
            raise ValueError(f"detection setting stall_min_s ({self.stall_min_s}) must be <= stall_max_s "
                             f"({self.stall_max_s})")
        object.__setattr__(self, "_history_memo", {})  # name -> keeps_history(name); not a field

    @classmethod
    def from_overrides(cls, overrides: Mapping[str, Any], base: Optional[DetectionSettings] = None
                       ) -> DetectionSettings:
        """``base`` (default: the defaults) with ``overrides`` applied. Raises ValueError naming the
        setting for an unknown name (with the closest known one), a value of the wrong type (booleans
        are not numbers; ints are accepted for floats; lists of strings for tuples) or out of range."""
        if not isinstance(overrides, Mapping):
            raise ValueError(f"detection overrides must be a mapping, got {type(overrides).__name__}")
        known = {f.name: f for f in fields(cls)}
        values = asdict(base) if base is not None else {}
        for name, value in overrides.items():
            if name not in known:
                close = difflib.get_close_matches(str(name), list(known), n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise ValueError(f"unknown detection setting {name!r}{hint}")
            values[name] = _coerce_setting(name, _default_of(known[name]), value)
        return cls(**values)

    def overrides(self) -> Dict[str, Any]:
        """The settings that differ from the defaults (what a project configured)."""
        default = DetectionSettings()
        return {f.name: getattr(self, f.name) for f in fields(self)
                if getattr(self, f.name) != getattr(default, f.name)}

    def to_dict(self) -> Dict[str, Any]:
        """Every setting (tuples as lists), JSON-ready."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}

    @classmethod
    def documentation(cls) -> List[Tuple[str, Any, str]]:
        """``(name, default, doc)`` for every setting, in declaration order."""
        return [(f.name, _default_of(f), str(f.metadata.get("doc", ""))) for f in fields(cls)]

    # --- derived --------------------------------------------------------------------------------
    def stall_threshold_s(self, step_time_s: float) -> float:
        """clamp(stall_factor x step_time_s, stall_min_s, stall_max_s); stall_max_s when unknown (<= 0)."""
        if step_time_s <= 0:
            return self.stall_max_s
        return min(max(self.stall_factor * step_time_s, self.stall_min_s), self.stall_max_s)

    def is_loss(self, name: str) -> bool:
        return name in self.loss_metrics

    def is_grad_norm(self, name: str) -> bool:
        return name in self.grad_norm_metrics

    def keeps_history(self, name: str) -> bool:
        """Whether ``name`` gets a per-rank history series (loss, grad norm, or history_metrics)."""
        memo: Dict[str, bool] = self._history_memo  # type: ignore[attr-defined]
        known = memo.get(name)
        if known is not None:
            return known
        keep = name in self.loss_metrics or name in self.grad_norm_metrics or any(
            name.startswith(p[:-1]) if p.endswith("*") else name == p for p in self.history_metrics)
        if len(memo) < 4096:
            memo[name] = keep
        return keep


def _default_of(f: Any) -> Any:
    return f.default if f.default is not MISSING else f.default_factory()


def _coerce_setting(name: str, default: Any, value: Any) -> Any:
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise ValueError(f"detection setting {name} must be true or false, got {value!r}")
        return value
    if isinstance(default, int):
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                return int(value)
            raise ValueError(f"detection setting {name} must be an integer, got {value!r}")
        return value
    if isinstance(default, float):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"detection setting {name} must be a number, got {value!r}")
        if value != value or value in (float("inf"), float("-inf")):
            raise ValueError(f"detection setting {name} must be finite, got {value!r}")
        return float(value)
    if isinstance(default, tuple):
        if isinstance(value, str) or not isinstance(value, Sequence) or \
                not all(isinstance(v, str) and v for v in value):
            raise ValueError(f"detection setting {name} must be a list of non-empty strings, got {value!r}")
        return tuple(value)
    raise ValueError(f"detection setting {name}: unsupported type")  # pragma: no cover


def settings_table() -> List[Dict[str, Any]]:
    """The settings as rows ``{"name", "default", "doc"}`` (the README table)."""
    return [{"name": n, "default": d, "doc": doc} for n, d, doc in DetectionSettings.documentation()]
