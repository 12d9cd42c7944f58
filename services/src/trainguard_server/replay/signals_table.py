"""The synonym table of :mod:`.signals` (data only; docs/replay-formats.md prints it).

Each :class:`Signal` names a TrainGuard metric (what the SDK sends and the detectors read), the **unit
class** of its values (``bytes``, ``seconds``, ``fraction``, ``flag``, ``count`` or ``""`` for plain
numbers), the field names that mean it (compared after :func:`.signals.normalise`: lower case, the
training prefixes ``train/``, ``train_``, ``training/``, ``trainer/``, ``training_`` taken off, a Lightning
``_step`` suffix taken off, spaces, dashes and dots as ``_``, a unit suffix split off), the **prefixes** under
which a nested object or a family of fields is a per-layer series (``grad_norm/<layer>`` ->
``grad/layer/<layer>``), and what cannot be judged without it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple


@dataclass(frozen=True)
class Signal:
    target: str  # TrainGuard's metric name ("grad/layer/" ends with "/": a family)
    unit: str  # bytes | seconds | fraction | flag | count | ""
    names: Tuple[str, ...] = ()  # normalised synonyms
    prefixes: Tuple[str, ...] = ()  # normalised prefixes of a per-layer family (a family target only)
    without: str = ""  # what the detectors cannot judge when it is missing
    required: bool = False  # listed as missing in the import summary when absent


SIGNALS: Tuple[Signal, ...] = (
    Signal(
        "loss",
        "",
        (
            "loss",
            "lm_loss",
            "train_loss",
            "training_loss",
            "reduced_train_loss",
            "total_loss",
            "loss_value",
            "lm loss",
        ),
        without="loss/divergence, loss/plateau, loss/oscillation, loss/non_finite not judged",
        required=True,
    ),
    Signal(
        "opt/lr",
        "",
        (
            "lr",
            "learning_rate",
            "learningrate",
            "lr_adam",
            "lr_adamw",
            "lr_sgd",
            "lr_0",
            "lr_group_0",
            "lr_pg0",
            "lr_adamw_pg1",
            "lr_adam_pg1",
            "lr_sgd_pg1",
        ),
        without="LR-schedule causes not named in diagnoses",
    ),
    Signal(
        "grad/global_norm",
        "",
        (
            "grad_norm",
            "gradient_norm",
            "global_grad_norm",
            "total_grad_norm",
            "grad_norm_total",
            "grad_2_0_norm_total",
            "grad_l2_norm",
            "grad_norm_global",
            "global_norm",
            "grad/norm",
            "grad/global_norm",
            "gradnorm",
        ),
        without="gradient/explosion (global norm) not judged",
        required=True,
    ),
    Signal(
        "grad/layer/",
        "",
        prefixes=(
            "grad_norm/",
            "grad_norms/",
            "grad_norm_per_layer/",
            "layer_grad_norm/",
            "layer_grad_norms/",
            "grad_2_0_norm/",
            "grad_norm_layers/",
            "gradients/norm/",
            "grad/layer/",
            "grad/layers/",
        ),
        without="gradient/vanishing and per-layer gradient/explosion not judged",
        required=True,
    ),
    Signal(
        "grad/clip_triggered",
        "flag",
        (
            "clipped",
            "grad_clipped",
            "clip_triggered",
            "was_clipped",
            "grad_clip_triggered",
            "gradient_clipped",
            "clip_active",
            "grad/clip_triggered",
        ),
        without="clipping-masks-explosion not judged",
    ),
    Signal(
        "grad/clip_threshold",
        "",
        (
            "max_grad_norm",
            "clip_threshold",
            "grad_clip",
            "gradient_clip_val",
            "clip_grad_norm",
            "grad_clip_norm",
            "clip_value",
            "grad/clip_threshold",
        ),
    ),
    Signal(
        "amp/scale",
        "",
        (
            "loss_scale",
            "grad_scale",
            "scaler_scale",
            "scaler/scale",
            "amp_scale",
            "scale_factor",
            "loss_scaler",
            "amp/scale",
            "cur_scale",
        ),
        without="memory/amp-overflow (scale collapse) not judged",
    ),
    Signal(
        "amp/overflow",
        "flag",
        (
            "overflow",
            "amp_overflow",
            "grad_overflow",
            "found_inf",
            "skipped_step",
            "step_skipped",
            "skipped_iter",
            "number_of_skipped_iterations",
            "skipped_iterations",
            "amp/overflow",
        ),
    ),
    Signal(
        "mem/allocated",
        "bytes",
        (
            "memory_allocated",
            "mem_allocated",
            "allocated_memory",
            "gpu_mem_alloc", "gpu_mem_allocated", "cuda_mem_allocated", "torch_memory_allocated",
            "cuda_memory_allocated",
            "gpu_memory_allocated",
            "mem_alloc",
            "memory/allocated",
            "mem/allocated",
            "allocated",
            "cuda_allocated",
            "gpu_mem",
            "gpu_memory",
        ),
        without="memory/leak and memory/fragmentation (device) not judged",
        required=True,
    ),
    Signal(
        "mem/reserved",
        "bytes",
        (
            "memory_reserved",
            "mem_reserved",
            "reserved_memory",
            "memory_cached",
            "cuda_memory_reserved",
            "gpu_memory_reserved",
            "gpu_mem_reserved",
            "memory/reserved",
            "mem/reserved",
            "reserved",
            "cuda_reserved",
        ),
    ),
    Signal(
        "mem/max_allocated",
        "bytes",
        (
            "max_memory_allocated",
            "peak_memory",
            "peak_mem",
            "mem_peak",
            "max_mem_allocated",
            "mem_max_allocated",
            "memory_peak",
            "peak_memory_allocated",
            "mem/max_allocated",
            "max_allocated",
        ),
    ),
    Signal(
        "mem/rss",
        "bytes",
        (
            "rss",
            "mem_rss",
            "memory_rss",
            "proc_rss",
            "process_memory",
            "cpu_memory",
            "host_memory",
            "proc_memory_rss",
            "process_rss",
            "ram_used",
            "cpu_mem",
            "mem/rss",
            "memory/rss",
            "system/proc_memory_rss",
        ),
        without="memory/leak (host) not judged",
    ),
    Signal(
        "mem/fragmentation",
        "fraction",
        ("memory_fragmentation", "mem_fragmentation", "fragmentation", "mem/fragmentation"),
    ),
    Signal(
        "mem/total_capacity",
        "bytes",
        ("memory_total", "gpu_memory_total", "total_memory", "mem/total_capacity"),
    ),
    Signal(
        "time/step_s",
        "seconds",
        (
            "step_time",
            "iteration_time",
            "time_per_step",
            "step_duration",
            "batch_time",
            "iter_time",
            "elapsed_time_per_iteration",
            "time_per_iteration",
            "step_time_s",
            "time/step_s",
            "train_step_time",
        ),
    ),
    Signal("time/data_s", "seconds", ("data_time", "dataloader_time", "data_loading_time", "time/data_s")),
    Signal(
        "lora/grad_mean_A",
        "",
        ("lora_grad_mean_a", "lora_a_grad_mean", "lora_a_grad", "grad_mean_lora_a", "lora/grad_mean_a"),
    ),
    Signal(
        "lora/grad_mean_B",
        "",
        ("lora_grad_mean_b", "lora_b_grad_mean", "lora_b_grad", "grad_mean_lora_b", "lora/grad_mean_b"),
    ),
    Signal(
        "lora/params",
        "count",
        ("lora_params", "lora_trainable_params", "trainable_lora_params", "lora_param_count", "lora/params"),
    ),
    Signal(
        "lora/no_grad_params",
        "count",
        (
            "lora_no_grad_params",
            "lora_frozen_params",
            "lora_params_no_grad",
            "lora_without_grad",
            "lora/no_grad_params",
        ),
    ),
    Signal(
        "seq/truncated_frac",
        "fraction",
        (
            "truncated_frac",
            "truncation_rate",
            "frac_truncated",
            "truncated_fraction",
            "truncation_frac",
            "seq_truncated_frac",
            "truncated",
            "seq/truncated_frac",
        ),
        without="sequence/truncation not judged",
    ),
    Signal(
        "seq/pad_attended_frac",
        "fraction",
        (
            "pad_attended_frac",
            "padding_attended",
            "pad_attended",
            "attended_pad_frac",
            "seq/pad_attended_frac",
        ),
    ),
    Signal(
        "seq/mask_mismatch_frac",
        "fraction",
        ("mask_mismatch_frac", "mask_mismatch", "attention_mask_mismatch", "seq/mask_mismatch_frac"),
    ),
    Signal(
        "seq/eos_missing_frac",
        "fraction",
        ("eos_missing_frac", "missing_eos_frac", "no_eos_frac", "eos_missing", "seq/eos_missing_frac"),
    ),
    Signal(
        "seq/labels_on_pad_frac",
        "fraction",
        (
            "labels_on_pad_frac",
            "pad_label_frac",
            "labels_on_pad",
            "loss_on_pad_frac",
            "seq/labels_on_pad_frac",
        ),
    ),
)

IGNORED: Tuple[Tuple[str, str], ...] = (
    ("epoch", "bookkeeping (epoch counter)"),
    ("consumed_samples", "bookkeeping (sample counter)"),
    ("global_batch_size", "bookkeeping (batch size)"),
    ("_runtime", "bookkeeping (W&B seconds since start)"),
    ("total_flos", "end-of-training summary"),
    ("train_runtime", "end-of-training summary"),
    ("train_samples_per_second", "end-of-training summary"),
    ("train_steps_per_second", "end-of-training summary"),
    ("num_input_tokens_seen", "bookkeeping (token counter)"),
)
"""Normalised names that are bookkeeping, not signals: left out, with the reason, in the summary."""

EPOCH_AGGREGATE_SUFFIX = "_epoch"
"""Lightning's ``on_epoch=True`` copy of a per-step metric (``train_loss_epoch``): left out, the per-step
series is the signal."""

UNIT_SUFFIXES: Tuple[Tuple[str, str, float], ...] = (
    # (suffix after "_" or in parentheses, unit class, factor to the class's base unit)
    ("bytes", "bytes", 1.0),
    ("byte", "bytes", 1.0),
    ("b", "bytes", 1.0),
    ("kb", "bytes", 1e3),
    ("kib", "bytes", 2.0**10),
    ("mb", "bytes", 1e6),
    ("mib", "bytes", 2.0**20),
    ("gb", "bytes", 1e9),
    ("gib", "bytes", 2.0**30),
    ("ms", "seconds", 1e-3),
    ("us", "seconds", 1e-6),
    ("s", "seconds", 1.0),
    ("sec", "seconds", 1.0),
    ("secs", "seconds", 1.0),
    ("seconds", "seconds", 1.0),
    ("min", "seconds", 60.0),
    ("pct", "fraction", 0.01),
    ("percent", "fraction", 0.01),
    ("%", "fraction", 0.01),
    ("frac", "fraction", 1.0),
)
"""Unit suffixes (``peak_memory_mib``, ``step_time_ms``, ``elapsed time per iteration (ms)``,
``rssMB``): the value is multiplied by the factor. A suffix only counts when it fits the signal's unit
class (``_s`` is never a memory unit). Memory in MB/GB is read as decimal, MiB/GiB binary."""

MEMORY_MAGNITUDE: Tuple[Tuple[float, float], ...] = ((2.0**20, 1.0), (256.0, 2.0**20), (0.0, 2.0**30))
"""A memory field without a unit suffix, by the magnitude of its first finite non-zero value:
>= 1 MiB: bytes; >= 256: MiB; below: GiB (``memory_allocated: 12.5`` on a GPU is GiB, ``rss: 812`` MiB)."""
