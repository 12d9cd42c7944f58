"""SDK overhead, measured in one run: prints numbers and ratios, asserts nothing.

(a) ``log``     — ns per ``trainguard.log(step=i, loss=x, lr=y)`` call against a plain Python function with
                  the same signature, with the SDK disabled and enabled (``file://`` endpoint). Timed in
                  bursts below the worker's wake threshold with a flush between bursts, so the figure is
                  the cost on the calling thread; a "sustained" figure (no flushes: the worker thread
                  competes for the GIL) is printed beside it.
(b) ``train``   — real training steps with and without ``trainguard.watch()`` (default settings) plus a
                  per-step ``trainguard.log(loss=<tensor>)``: an MLP and an ``nn.TransformerEncoder`` on the
                  chosen device; on CUDA also a GPT-2-small-sized decoder (12 layers, d_model 768, 12 heads,
                  seq 1024, vocab 50257) under AMP (bf16, or fp16 with a GradScaler). The two conditions
                  alternate block by block (ABAB..., the first of each pair alternating) to cancel drift;
                  each block gives one sample (CPU: its median step time; CUDA: its mean step time between
                  two syncs). Printed: the median sample of each condition, their ratio, and the median of
                  the per-pair ratios (the most drift-proof figure).

    python bench/sdk_overhead.py                 # CPU: (a) + MLP + transformer
    python bench/sdk_overhead.py --device cuda   # adds GPT-2 small with AMP; --amp fp16 uses a GradScaler
    python bench/sdk_overhead.py --quick         # seconds-long smoke run (tests/bench runs it)

(c) ``sync``    — CUDA only, after each workload: watched steps under
                  ``torch.cuda.set_sync_debug_mode("error")`` prove the training thread never synchronises
                  (see :func:`check_sync`).
(d) ``runqueue`` — the step-timing run-queue delay (``time/runqueue_s``, issue 23) beside the step timer
                  without it (the previous commit's timer), in one run: ``--ab runqueue`` makes (b) alternate
                  blocks of watched steps with the run-queue clock off (A) and on (B) instead of unwatched /
                  watched, and part (d) times the timer's own per-step work (the marks of one step and its
                  ``phases``) with the clock off and on, in alternating blocks, in CPU time of the calling
                  thread (``time.thread_time_ns``: what the training thread pays, whatever the host runs).

    python bench/sdk_overhead.py --skip log,transformer --ab runqueue   # CPU: (b) as A/B + (d)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

import trainguard


# --- (a) the cost of one log call -------------------------------------------------------------------
def plain(step: Optional[int] = None, **metrics: Any) -> None:
    """The baseline: a Python function with log()'s signature that does nothing."""
    return None


def _time_calls(fn: Callable[..., Any], calls: int, burst: int, between: Callable[[], Any]) -> float:
    """ns per call of ``fn(step=i, loss=x, lr=y)``, timed in bursts of ``burst`` with ``between()``
    (untimed) after each burst."""
    loss, lr = 0.693, 3e-4
    total = 0
    done = 0
    while done < calls:
        n = min(burst, calls - done)
        start = time.perf_counter_ns()
        for i in range(done, done + n):
            fn(step=i, loss=loss, lr=lr)
        total += time.perf_counter_ns() - start
        done += n
        between()
    return total / calls


def bench_log(calls: int, report: Callable[[str], None]) -> None:
    burst = 400  # below max_batch_events (500): the worker is not woken inside a timed burst

    def idle() -> None:
        return None

    trainguard.shutdown()
    plain_ns = min(_time_calls(plain, calls, burst, idle) for _ in range(3))
    disabled_ns = min(_time_calls(trainguard.log, calls, burst, idle) for _ in range(3))
    with tempfile.TemporaryDirectory() as tmp:
        trainguard.init(endpoint=f"file://{tmp}/bench.jsonl", heartbeat_interval=0, spool_dir="",
                        capture_exit=False, capture_uncaught=False)

        def flush() -> None:
            trainguard.flush(10.0)

        enabled_ns = min(_time_calls(trainguard.log, calls, burst, flush) for _ in range(3))
        sustained_ns = _time_calls(trainguard.log, calls, calls, flush)
        client = trainguard.get_client()
        drops = client.stats.snapshot() if client is not None else {}
        trainguard.shutdown()
    report(f"log_call plain_fn_ns={plain_ns:.0f}")
    report(f"log_call disabled_ns={disabled_ns:.0f} ratio_vs_plain={disabled_ns / plain_ns:.2f}")
    report(f"log_call enabled_ns={enabled_ns:.0f} ratio_vs_plain={enabled_ns / plain_ns:.2f} "
           f"target_ns=5000 goal_ns=2000 {'OK' if enabled_ns < 5000 else 'OVER'}")
    report(f"log_call enabled_sustained_ns={sustained_ns:.0f} (worker thread competing for the GIL; "
           f"sdk_stats={drops})")


# --- (b) models -------------------------------------------------------------------------------------
def make_mlp(width: int, depth: int) -> nn.Module:
    layers: List[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.GELU()]
    layers.append(nn.Linear(width, 1))
    return nn.Sequential(*layers)


class Encoder(nn.Module):
    """A small nn.TransformerEncoder regression model."""

    def __init__(self, d_model: int, layers: int, heads: int) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(d_model, heads, 4 * d_model, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x).mean(dim=1))


class Block(nn.Module):
    """A GPT-2 block: pre-LN causal self-attention and a 4x GELU MLP."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln_1 = nn.LayerNorm(d)
        self.attn = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln_2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.fc_proj = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.attn(self.ln_1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.fc_proj(F.gelu(self.fc(self.ln_2(x)), approximate="tanh"))


class GPT(nn.Module):
    """GPT-2 (small by default), hand-written, random weights, tied embeddings."""

    def __init__(self, vocab: int = 50257, seq: int = 1024, layers: int = 12, d: int = 768,
                 heads: int = 12) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(seq, d)
        self.h = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.view(-1))


@dataclass
class Workload:
    """One training setup: a model, an optimizer, a batch and how to take one step."""

    name: str
    model: nn.Module
    optimizer: torch.optim.Optimizer
    step: Callable[[], torch.Tensor]
    scaler: Optional[Any] = None
    clip: Optional[float] = None


def regression_workload(name: str, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> Workload:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step() -> torch.Tensor:
        loss = F.mse_loss(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return loss.detach()

    return Workload(name, model, opt, step, clip=1.0)


def gpt_workload(device: torch.device, batch: int, amp: str, cfg: Dict[str, int]) -> Workload:
    model = GPT(**cfg).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, fused=device.type == "cuda")
    seq, vocab = cfg["seq"], cfg["vocab"]
    idx = torch.randint(0, vocab, (batch, seq), device=device)
    targets = torch.randint(0, vocab, (batch, seq), device=device)
    dtype = torch.float16 if amp == "fp16" else torch.bfloat16
    scaler = torch.amp.GradScaler(device.type) if amp == "fp16" else None

    def step() -> torch.Tensor:
        with torch.autocast(device.type, dtype=dtype):
            loss = model(idx, targets)
        opt.zero_grad(set_to_none=True)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
        return loss.detach()

    return Workload(f"gpt2_{amp}", model, opt, step, scaler=scaler, clip=1.0)


# --- (b) the interleaved measurement ----------------------------------------------------------------
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _block(work: Workload, steps: int, device: torch.device, log_loss: bool) -> float:
    """Seconds per step over one block of ``steps`` steps. CPU: the median of the per-step times (steps
    are synchronous there, and the median shrugs off a preempted step). CUDA: the block's mean, between
    two device syncs (the only honest figure without syncing every step)."""
    times: List[float] = []
    _sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        t0 = time.perf_counter()
        loss = work.step()
        if log_loss:
            trainguard.log(loss=loss)
        times.append(time.perf_counter() - t0)
    _sync(device)
    if device.type == "cuda":
        return (time.perf_counter() - start) / steps
    return statistics.median(times)


def bench_train(work: Workload, device: torch.device, blocks: int, block_steps: int, warmup: int,
                report: Callable[[str], None], ab: str = "") -> None:
    """Unwatched (A) against watched (B) blocks, alternating; ``ab="runqueue"``: both watched, A with the
    step timer's run-queue clock off (the timer before issue 23's signal), B with it on."""
    for _ in range(warmup):
        work.step()
    _sync(device)
    off: List[float] = []
    on: List[float] = []
    pair_ratios: List[float] = []
    handle = None
    for b in range(blocks):
        order: Tuple[bool, ...] = (False, True) if b % 2 == 0 else (True, False)
        pair: Dict[bool, float] = {}
        for watched in order:
            if watched or ab:
                handle = trainguard.watch(work.model, work.optimizer, scaler=work.scaler, clip=work.clip)
                if ab == "runqueue" and not watched and handle.timer is not None:
                    handle.timer.close()  # A: the timer without its run-queue clock
            pair[watched] = _block(work, block_steps, device, log_loss=watched or bool(ab))
            if handle is not None:
                handle.remove()
                handle = None
        off.append(pair[False])
        on.append(pair[True])
        pair_ratios.append(pair[True] / pair[False])
    med_off, med_on = statistics.median(off), statistics.median(on)
    label = f"train_step_ab_{ab}" if ab else "train_step"
    report(f"{label}[{work.name}] device={device} blocks={blocks}x{block_steps} "
           f"median_off_ms={med_off * 1e3:.3f} median_on_ms={med_on * 1e3:.3f} "
           f"overhead_ratio={med_on / med_off:.4f} pair_ratio_median={statistics.median(pair_ratios):.4f} "
           f"pair_ratio_range=[{min(pair_ratios):.4f},{max(pair_ratios):.4f}] target_ratio=1.01")


def bench_runqueue(blocks: int, steps: int, report: Callable[[str], None]) -> None:
    """(d): thread CPU ns per step of the step timer's own work (forward marks, end of backward, phases)
    with the run-queue clock off (A) and on (B), alternating blocks."""
    from trainguard.integrations.step_timing import StepTimer

    samples: Dict[bool, List[float]] = {False: [], True: []}
    reported = 0
    for b in range(blocks):
        for clock in ((False, True) if b % 2 == 0 else (True, False)):
            timer = StepTimer(runqueue=clock)
            previous = time.perf_counter()
            started = time.thread_time_ns()
            for _ in range(steps):
                timer.forward_start()
                timer.forward_end()
                timer.backward_end()
                now = time.perf_counter()
                reported += len(timer.phases(previous, now))
                previous = now
            samples[clock].append((time.thread_time_ns() - started) / steps)
            timer.close()
    off, on = statistics.median(samples[False]), statistics.median(samples[True])
    report(f"runqueue_timer blocks={blocks}x{steps} timer_ns_per_step_off={off:.0f} "
           f"timer_ns_per_step_on={on:.0f} added_ns_per_step={on - off:.0f} "
           f"added_range=[{min(samples[True]) - max(samples[False]):.0f},"
           f"{max(samples[True]) - min(samples[False]):.0f}] values={reported}")


def check_sync(work: Workload, device: torch.device, steps: int, tmp: str,
               report: Callable[[str], None]) -> None:
    """CUDA only: run steps under ``torch.cuda.set_sync_debug_mode("error")`` — first the bare step (the
    workload itself must be sync-free), then watched steps with every per-step path switched on
    (per-layer norms and memory every step) plus ``log(loss=<tensor>)``. The SDK's worker is told not to
    drain during the window (the debug mode is process-wide and the worker's read-back *is* a sync, by
    design off the training thread); it drains afterwards and the delivered points are counted."""
    trainguard.shutdown()
    trainguard.init(endpoint=f"file://{tmp}/sync.jsonl", spool_dir="", capture_exit=False,
                    capture_uncaught=False, heartbeat_interval=0, flush_interval=3600.0,
                    max_batch_events=1_000_000, max_queue_events=1_000_000)
    name = f"sync_check[{work.name}]"
    _sync(device)
    torch.cuda.set_sync_debug_mode("error")
    try:
        work.step()
    except RuntimeError as exc:
        torch.cuda.set_sync_debug_mode(0)
        report(f"{name} SKIPPED: the bare step itself synchronises ({str(exc).splitlines()[0][:120]})")
        return
    handle = None
    verdict = "OK"
    try:
        handle = trainguard.watch(work.model, work.optimizer, scaler=work.scaler, clip=work.clip,
                                  every=1, memory_every=1)
        for _ in range(steps):
            loss = work.step()
            trainguard.log(loss=loss)
    except RuntimeError as exc:
        verdict = f"FAILED: {str(exc).splitlines()[0][:160]}"
    finally:
        torch.cuda.set_sync_debug_mode(0)
    client = trainguard.get_client()
    pending = client.pending() if client is not None else -1
    if handle is not None:
        handle.remove()
    trainguard.flush(30.0)
    points = 0
    with open(f"{tmp}/sync.jsonl") as fh:
        for line in fh:
            points += len(json.loads(line).get("metrics", {}).get("points", []))
    report(f"{name} watched_steps={steps} training_thread_syncs={'0' if verdict == 'OK' else '>0'} "
           f"{verdict} queued_during_window={pending} points_delivered_after={points}")


# --- main -------------------------------------------------------------------------------------------
def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    parser.add_argument("--steps", type=int, default=None,
                        help="training steps per condition per model (default: 400 CPU, 200 CUDA)")
    parser.add_argument("--blocks", type=int, default=None, help="alternating blocks (default 10)")
    parser.add_argument("--log-calls", type=int, default=200_000, help="log() calls timed in (a)")
    parser.add_argument("--amp", choices=("bf16", "fp16"), default="bf16",
                        help="GPT-2 precision on CUDA: bf16 autocast, or fp16 autocast + GradScaler")
    parser.add_argument("--batch", type=int, default=48,
                        help="GPT-2 batch size in sequences of 1024 (48: a step of ~100 ms on an H200)")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads for CPU runs")
    parser.add_argument("--quick", action="store_true", help="tiny sizes and few steps (smoke test)")
    parser.add_argument("--config", choices=("default", "hf-gpt2"), default="default",
                        help="hf-gpt2: issue 21's exact configuration (HF GPT2LMHeadModel, 8 x 1024, bf16, "
                             "fused AdamW, clip 1.0; bare / watch / foreach-async / Lightning interleaved) "
                             "-- runs bench/sdk_overhead_hf_gpt2.py; needs --device cuda")
    parser.add_argument("--skip", default="",
                        help="comma list of parts to skip: log,mlp,transformer,gpt2,sync,runqueue")
    parser.add_argument("--ab", choices=("", "runqueue"), default="",
                        help="runqueue: (b) alternates watched blocks with the step timer's run-queue clock "
                             "off / on (issue 23's signal beside the timer without it), and (d) runs")
    args, rest = parser.parse_known_args(argv)
    if args.config == "hf-gpt2":
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import sdk_overhead_hf_gpt2  # the bench's sibling script

        return sdk_overhead_hf_gpt2.main(rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda but CUDA is not available", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    quick = args.quick
    blocks = args.blocks or (4 if quick else 10)
    steps = args.steps or (8 if quick else (200 if device.type == "cuda" else 400))
    block_steps = max(1, steps // blocks)

    def report(line: str) -> None:
        print(line, flush=True)

    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    report(f"env python={platform.python_version()} torch={torch.__version__} device={device} ({gpu}) "
           f"threads={torch.get_num_threads()} cpus={os.cpu_count()} quick={quick}")

    if "log" not in skip:
        bench_log(2_000 if quick else args.log_calls, report)
    if args.ab == "runqueue" and "runqueue" not in skip:
        bench_runqueue(4 if quick else 20, 500 if quick else 20_000, report)

    with tempfile.TemporaryDirectory() as tmp:
        # per_layer_every / memory_every keep their defaults: this is the "default settings" overhead
        trainguard.init(endpoint=f"file://{tmp}/train.jsonl", spool_dir="", capture_exit=False,
                        capture_uncaught=False)
        torch.manual_seed(0)
        workloads: List[Callable[[], Workload]] = []
        if "mlp" not in skip:
            width, depth, batch = (64, 2, 16) if quick else (512, 4, 128)

            def mlp() -> Workload:
                x = torch.randn(batch, width, device=device)
                y = torch.randn(batch, 1, device=device)
                return regression_workload("mlp", make_mlp(width, depth).to(device), x, y)

            workloads.append(mlp)
        if "transformer" not in skip:
            d, layers, heads, seq, batch_t = (32, 2, 2, 16, 4) if quick else (128, 4, 4, 64, 16)

            def transformer() -> Workload:
                x = torch.randn(batch_t, seq, d, device=device)
                y = torch.randn(batch_t, 1, device=device)
                return regression_workload("transformer", Encoder(d, layers, heads).to(device), x, y)

            workloads.append(transformer)
        if device.type == "cuda" and "gpt2" not in skip:
            cfg = (dict(vocab=1024, seq=128, layers=2, d=128, heads=4) if quick
                   else dict(vocab=50257, seq=1024, layers=12, d=768, heads=12))
            workloads.append(lambda: gpt_workload(device, 2 if quick else args.batch, args.amp, cfg))
        for make in workloads:
            work = make()
            bench_train(work, device, blocks, block_steps, warmup=2 if quick else 10, report=report,
                        ab=args.ab)
            if device.type == "cuda" and "sync" not in skip:
                check_sync(work, device, 3 if quick else 20, tmp, report)
                trainguard.shutdown()
                trainguard.init(endpoint=f"file://{tmp}/train.jsonl", spool_dir="", capture_exit=False,
                                capture_uncaught=False)
            del work
        trainguard.flush(30.0)
        client = trainguard.get_client()
        report(f"sdk_stats {client.stats.snapshot() if client is not None else {}}")
        trainguard.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
