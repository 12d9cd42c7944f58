#!/usr/bin/env python3
"""GPU scenario trainings: small, real, seeded PyTorch runs on one CUDA device whose memory or
mixed-precision behaviour really goes wrong, instrumented with the TrainGuard SDK exactly like a user's
job (``trainguard.init()`` from the environment, ``trainguard.watch(model, optimizer, ...)``,
``trainguard.log(step=..., loss=...)``). They need a GPU, so they are run on the lent H200 machine and
committed as recorded event streams in ``streams_gpu/`` (see its README for the command and versions).

    python tests/scenarios/gpu.py --out DIR            # run all of them, one subprocess each
    python tests/scenarios/gpu.py --out DIR gpu_oom    # some of them
    python tests/scenarios/gpu.py --dry-run            # import check; exits 0 when CUDA is unavailable
    python tests/scenarios/gpu.py --scenario NAME      # one training in this process (what --out runs)

``--out DIR`` writes ``<name>.jsonl`` (what the SDK wrote through its ``file://`` endpoint, unedited),
``<name>.log`` (the process's stdout and stderr: one line per step, and the real traceback for the OOM)
and ``summary.json`` (exit codes, durations). Nothing is injected: every anomaly comes from the
training's own allocations or numerics.

=================  =====================================================================================
scenario           what really happens
=================  =====================================================================================
gpu_oom            a causal transformer block with a hand-written (materialised, fp32) attention and a
                   sequence-length curriculum that doubles the context every 4 steps (512, 1024, ...):
                   the L x L score matrices grow 4x per doubling until the caching allocator cannot
                   serve a request and raises a real ``torch.OutOfMemoryError``. Nothing catches it:
                   the process dies with the real traceback; the SDK's excepthook captures it with the
                   ``memory_summary`` / ``memory_stats`` context. ``memory_every=1``.
gpu_fragmentation  an MLP token model trained on dynamically padded batches whose length is drawn at
                   random from a range that widens over the run (a length curriculum), while the loop
                   keeps the last 24 steps' hidden-state features (``.clone()``, for a logging EMA) alive:
                   the ever-changing activation sizes and the pinned small blocks leave the caching
                   allocator with reserved memory that no live tensor uses; reserved - active grows
                   and (reserved - active) / reserved ends well above 0.5. 100 steps, ``memory_every=1``.
gpu_amp_overflow   fp16 autocast + ``torch.amp.GradScaler`` (default init scale 2**16) on a regression
                   whose targets are in raw units (~1e3) and whose loss is summed, not averaged, over
                   the batch: the scaled gradients overflow fp16 at every scale the scaler tries, the
                   steps are skipped and the scale halves step after step, far below 1.
                   ``watch(model, opt, scaler=scaler)``.
gpu_leak           an MLP classifier (1000 classes, batch 1024) whose loop keeps every step's logits and
                   targets on the GPU "for the epoch-end accuracy and calibration report"
                   (``epoch_logits.append(logits)``, no ``.detach().cpu()``): 4 MB of logits per step
                   stay allocated, so allocated device memory grows steadily while the step's working
                   set does not. AdamW, no clipping; 80 steps, ``memory_every=1``.
gpu_healthy_amp    fp16 autocast + GradScaler (clip 1.0) on a normalised regression: the scaler skips its first
                   steps while it calibrates down from 2**16, then the loss falls. Healthy (a hard negative).
gpu_context_leak   a previous job (its own process, no TrainGuard) starts an evaluation worker with
                   ``subprocess.Popen(..., start_new_session=True)`` that initialises CUDA and loads its
                   evaluation set (3 GiB) onto the GPU, trains 5 steps and exits normally -- without
                   stopping the worker, which lives on as an orphan holding its CUDA context and the
                   3 GiB. The new training (a healthy MLP, 30 steps, ``memory_every=1``, TrainGuard from
                   the environment) then starts on the same GPU. The orphan is ended (SIGTERM, by its
                   pid) once the new training is done; it also exits by itself after 240 s.
=================  =====================================================================================
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, Optional, Sequence

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]

SCENARIOS = ("gpu_oom", "gpu_fragmentation", "gpu_amp_overflow", "gpu_leak", "gpu_context_leak",
             "gpu_healthy_amp")
HELD_OUT_MEMORY_INTERVAL_S = "0.005"
"""Held-out recordings (``--seed`` N != 0) keep the SDK's default memory cadence (no ``memory_every=1``)
and sample memory by time instead, at an interval scaled to these toy steps (~1 ms on an H200, where a
real model's step takes ~0.1-1 s against the default 1 s): a short run must get its verdict that way."""
#: set in every process (NVLink multicast stays off on the lent machines).
NV_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
for _k, _v in NV_ENV.items():
    os.environ.setdefault(_k, _v)

TIMEOUT_S = 120


def _log(msg: str) -> None:
    print(msg, flush=True)


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f}GiB"


def _start(name: str, model, optimizer, **watch_kwargs) -> None:  # type: ignore[no-untyped-def]
    import trainguard

    if os.environ.get("SCENARIO_SEED", "0") != "0":  # held out: the SDK's defaults for the cadence
        watch_kwargs.pop("memory_every", None)
    trainguard.init(run_name=f"scenario-{name}", tags={"scenario": name, "device": "gpu"})
    trainguard.watch(model, optimizer, **watch_kwargs)


def _mem_line(device) -> str:  # type: ignore[no-untyped-def]
    import torch

    if device.type != "cuda":
        return ""
    reserved = torch.cuda.memory_reserved(device)
    stats = torch.cuda.memory_stats(device)
    active = stats.get("active_bytes.all.current", 0)
    frag = (reserved - active) / reserved if reserved else 0.0
    return (f" allocated {_gib(torch.cuda.memory_allocated(device))} active {_gib(active)} reserved "
            f"{_gib(reserved)} frag {frag:.3f} peak {_gib(torch.cuda.max_memory_allocated(device))}")


# --- gpu_oom -----------------------------------------------------------------------------------------
def gpu_oom(device, small: bool = False, seed: int = 0) -> None:  # type: ignore[no-untyped-def]
    """Naive attention + doubling context: a real CUDA OOM after ~16-20 steps."""
    import math

    import torch
    from torch import nn

    import trainguard

    torch.manual_seed(seed)
    dim, heads, batch, vocab = 256, 8, 8, 1024

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(vocab, dim)
            self.qkv = nn.Linear(dim, 3 * dim)
            self.proj = nn.Linear(dim, dim)
            self.norm = nn.LayerNorm(dim)
            self.head = nn.Linear(dim, vocab)

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            b, t = tokens.shape
            h = self.embed(tokens)
            q, k, v = self.qkv(self.norm(h)).view(b, t, 3, heads, dim // heads).permute(2, 0, 3, 1, 4)
            scores = (q @ k.transpose(-2, -1)) / math.sqrt(dim // heads)   # (b, heads, t, t), fp32
            causal = torch.ones(t, t, dtype=torch.bool, device=tokens.device).triu(1)
            probs = scores.masked_fill(causal, float("-inf")).softmax(dim=-1)
            att = (probs @ v).transpose(1, 2).reshape(b, t, dim)
            return self.head(h + self.proj(att))  # type: ignore[no-any-return]

    model = Block().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _start("gpu_oom", model, optimizer, clip=1.0, memory_every=1)
    gen = torch.Generator(device=device).manual_seed(seed)
    max_steps = 12 if small else 40
    for step in range(max_steps):
        context = 512 * 2 ** (step // 4)
        if small:
            context = 32 * 2 ** (step // 4)
        tokens = torch.randint(vocab, (batch, context + 1), device=device, generator=gen)
        logits = model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, vocab), tokens[:, 1:].reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        optimizer.step()
        trainguard.log(step=step, loss=loss)
        _log(f"step {step:3d} context {context:6d} loss {loss.item():.4f}" + _mem_line(device))


# --- gpu_fragmentation -------------------------------------------------------------------------------
def gpu_fragmentation(device, small: bool = False, seed: int = 0) -> None:  # type: ignore[no-untyped-def]
    """Dynamic padding with a widening length range + pinned feature clones: reserved - active grows."""
    import random

    import torch
    from torch import nn

    import trainguard

    torch.manual_seed(seed)
    rng = random.Random(seed)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    dim, hidden, layers, batch, vocab = (64, 128, 2, 4, 256) if small else (1024, 4096, 6, 16, 4096)
    steps = 20 if small else 100
    max_len = 64 if small else 3072

    class TokenMLP(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(vocab, dim)
            self.blocks = nn.ModuleList(
                nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim))
                for _ in range(layers))
            self.head = nn.Linear(dim, vocab)

        def forward(self, tokens: torch.Tensor) -> tuple:
            h = self.embed(tokens)
            for block in self.blocks:
                h = h + block(h)
            return self.head(h), h

    model = TokenMLP().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    _start("gpu_fragmentation", model, optimizer, clip=1.0, memory_every=1)
    kept: collections.deque = collections.deque(maxlen=24)   # "features for a logging EMA"
    gen = torch.Generator(device=device).manual_seed(seed)
    for step in range(steps):
        upper = int(16 + (max_len - 16) * (step + 1) / steps)      # the curriculum widens the range
        length = rng.randint(8, upper)                            # dynamic padding: the batch's longest
        tokens = torch.randint(vocab, (batch, length + 1), device=device, generator=gen)
        logits, h = model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, vocab), tokens[:, 1:].reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        kept.append(h[:, : max(1, length // 2)].detach().clone())  # a sliver of this step's features
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        optimizer.step()
        trainguard.log(step=step, loss=loss)
        _log(f"step {step:3d} length {length:5d} loss {loss.item():.4f}" + _mem_line(device))


# --- gpu_amp_overflow --------------------------------------------------------------------------------
def gpu_amp_overflow(device, small: bool = False, seed: int = 0) -> None:  # type: ignore[no-untyped-def]
    """fp16 autocast, summed loss on raw-unit targets: the GradScaler's scale collapses."""
    import torch
    from torch import nn

    import trainguard

    torch.manual_seed(seed)
    gen = torch.Generator(device=device).manual_seed(seed)
    features, outputs, batch = 64, 32, 512
    steps = 20 if small else 150
    amp_dtype = torch.float16 if device.type == "cuda" else torch.bfloat16
    teacher = nn.Linear(features, outputs).to(device)
    model = nn.Sequential(nn.Linear(features, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                          nn.Linear(512, outputs)).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler(device.type)
    _start("gpu_amp_overflow", model, optimizer, scaler=scaler)
    for step in range(steps):
        x = torch.randn(batch, features, device=device, generator=gen)
        with torch.no_grad():
            y = 1000.0 * teacher(x) + 1500.0        # targets in raw units (e.g. prices), not normalised
        with torch.autocast(device_type=device.type, dtype=amp_dtype):
            pred = model(x)
            loss = nn.functional.mse_loss(pred.float(), y, reduction="sum")   # summed, not averaged
        optimizer.zero_grad(set_to_none=True)
        scale_before = scaler.get_scale()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        trainguard.log(step=step, loss=loss)
        skipped = scaler.get_scale() < scale_before
        _log(f"step {step:3d} loss {loss.item():.6g} scale {scale_before:.6g} -> {scaler.get_scale():.6g}"
             f"{' (overflow, step skipped)' if skipped else ''}")


# --- gpu_healthy_amp ---------------------------------------------------------------------------------
def gpu_healthy_amp(device, small: bool = False, seed: int = 0) -> None:  # type: ignore[no-untyped-def]
    """fp16 autocast + GradScaler on a normalised regression: the scaler skips its first few steps while
    it calibrates down from 2**16 (what it is for), then the loss falls. Healthy."""
    import torch
    from torch import nn

    import trainguard

    torch.manual_seed(seed)
    gen = torch.Generator(device=device).manual_seed(seed)
    features, batch = 64, 512
    steps = 20 if small else 150
    amp_dtype = torch.float16 if device.type == "cuda" else torch.bfloat16
    teacher = nn.Linear(features, 8).to(device)
    model = nn.Sequential(nn.Linear(features, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                          nn.Linear(512, 8)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler(device.type)
    _start("gpu_healthy_amp", model, optimizer, scaler=scaler, clip=1.0)
    for step in range(steps):
        x = torch.randn(batch, features, device=device, generator=gen)
        with torch.no_grad():
            y = torch.tanh(teacher(x))
        with torch.autocast(device_type=device.type, dtype=amp_dtype):
            loss = nn.functional.mse_loss(model(x).float(), y)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        trainguard.log(step=step, loss=loss)
        _log(f"step {step:3d} loss {loss.item():.5f} scale {scaler.get_scale():.6g}")


# --- gpu_leak ----------------------------------------------------------------------------------------
def gpu_leak(device, small: bool = False, seed: int = 0) -> None:  # type: ignore[no-untyped-def]
    """Every step's logits and targets kept on the GPU for an epoch-end report: allocated grows."""
    import torch
    from torch import nn

    import trainguard

    torch.manual_seed(seed)
    gen = torch.Generator(device=device).manual_seed(seed)
    features, hidden, classes, batch = (32, 64, 10, 16) if small else (256, 2048, 1000, 1024)
    steps = 20 if small else 80
    teacher = nn.Linear(features, classes).to(device)
    model = nn.Sequential(nn.Linear(features, hidden), nn.GELU(), nn.Linear(hidden, hidden), nn.GELU(),
                          nn.Linear(hidden, classes)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _start("gpu_leak", model, optimizer, memory_every=1)
    epoch_logits: list = []   # "for the epoch-end accuracy / calibration report"
    epoch_targets: list = []
    for step in range(steps):
        x = torch.randn(batch, features, device=device, generator=gen)
        with torch.no_grad():
            y = teacher(x).argmax(dim=1)
        logits = model(x)
        loss = nn.functional.cross_entropy(logits, y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        epoch_logits.append(logits)      # the bug: kept on the device (and with its graph) until the epoch ends
        epoch_targets.append(y)
        trainguard.log(step=step, loss=loss)
        _log(f"step {step:3d} loss {loss.item():.4f} kept {len(epoch_logits)} logits" + _mem_line(device))


# --- gpu_context_leak --------------------------------------------------------------------------------
WORKER_BYTES = 3 * 2**30
WORKER_LIFETIME_S = 240.0


def _eval_worker(pid_file: str) -> None:
    """The previous job's evaluation worker: loads its evaluation set onto the GPU, then waits for
    checkpoints that never come (until WORKER_LIFETIME_S)."""
    import torch

    started = time.monotonic()
    device = torch.device("cuda", 0)
    eval_set = torch.empty(WORKER_BYTES // 4, dtype=torch.float32, device=device).normal_()
    torch.cuda.synchronize(device)
    with open(pid_file + ".tmp", "w", encoding="utf-8") as fh:
        fh.write(f"{os.getpid()} {eval_set.numel() * 4}\n")
    os.replace(pid_file + ".tmp", pid_file)
    while time.monotonic() - started < WORKER_LIFETIME_S:   # "poll for new checkpoints to evaluate"
        time.sleep(0.5)


def _previous_job(pid_file: str) -> None:
    """A previous training job: starts its evaluation worker, trains a few steps, exits normally without
    stopping the worker (which is in its own session, so nothing stops it)."""
    import torch
    from torch import nn

    worker = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--eval-worker", pid_file],
                              start_new_session=True, stdin=subprocess.DEVNULL, cwd=REPO)
    device = torch.device("cuda", 0)
    model = nn.Linear(512, 512).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(5):
        opt.zero_grad()
        model(torch.randn(64, 512, device=device)).square().mean().backward()
        opt.step()
    deadline = time.monotonic() + 60
    while not os.path.exists(pid_file) and time.monotonic() < deadline and worker.poll() is None:
        time.sleep(0.1)
    _log(f"previous job: done, exiting; its evaluation worker {worker.pid} keeps running")


def gpu_context_leak(device, small: bool = False, seed: int = 0) -> None:  # type: ignore[no-untyped-def]
    """A previous job's orphaned evaluation worker holds a CUDA context and 3 GiB on the GPU; a new,
    healthy training starts on it."""
    import signal

    import torch
    from torch import nn

    import trainguard

    orphan = 0
    if device.type == "cuda":
        with tempfile.TemporaryDirectory(prefix="tg-prev-job-") as tmp:
            pid_file = os.path.join(tmp, "eval_worker.pid")
            env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD_")}
            prev = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--previous-job", pid_file],
                                  env=env, cwd=REPO, timeout=TIMEOUT_S)
            text = open(pid_file, encoding="utf-8").read().split() if os.path.exists(pid_file) else []
        orphan = int(text[0]) if text else 0
        alive = bool(orphan) and os.path.exists(f"/proc/{orphan}")
        free, total = torch.cuda.mem_get_info(device)
        _log(f"previous job exited with {prev.returncode}; orphaned worker pid {orphan} alive={alive} "
             f"holding {_gib(float(text[1])) if len(text) > 1 else '?'} of tensors; driver: used "
             f"{_gib(total - free)} of {_gib(total)} before this training allocates")
        try:
            _log(torch.cuda.list_gpu_processes(device))
        except Exception as err:  # NVML (pynvml) missing or not answering here
            _log(f"list_gpu_processes: {err!r}")
        try:
            smi = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv"],
                                 capture_output=True, text=True, timeout=30)
            _log("nvidia-smi --query-compute-apps: " + " | ".join((smi.stdout + smi.stderr).splitlines()))
        except Exception as err:
            _log(f"nvidia-smi: {err!r}")
    try:
        torch.manual_seed(seed)
        gen = torch.Generator(device=device).manual_seed(seed)
        features, hidden = (16, 32) if small else (256, 1024)
        teacher = nn.Linear(features, 1).to(device)
        model = nn.Sequential(nn.Linear(features, hidden), nn.ReLU(), nn.Linear(hidden, 1)).to(device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        _start("gpu_context_leak", model, optimizer, clip=1.0, memory_every=1)
        for step in range(30):
            x = torch.randn(256, features, device=device, generator=gen)
            with torch.no_grad():
                y = teacher(x)
            loss = nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
            optimizer.step()
            trainguard.log(step=step, loss=loss)
            _log(f"step {step:3d} loss {loss.item():.4f}" + _mem_line(device))
        trainguard.flush(10.0)
    finally:
        if orphan:
            try:
                os.kill(orphan, signal.SIGTERM)
                _log(f"ended the orphaned worker {orphan}")
            except OSError as err:
                _log(f"could not end the orphaned worker {orphan}: {err}")


RUNNERS = {"gpu_healthy_amp": gpu_healthy_amp, "gpu_oom": gpu_oom, "gpu_fragmentation": gpu_fragmentation, "gpu_amp_overflow": gpu_amp_overflow,
           "gpu_leak": gpu_leak, "gpu_context_leak": gpu_context_leak}


def _run_one(name: str, small: bool) -> None:
    import torch

    if small:
        device = torch.device("cpu")
    else:
        if not torch.cuda.is_available():
            raise SystemExit("CUDA is not available (use --dry-run or --small-cpu)")
        device = torch.device("cuda", 0)
        torch.cuda.init()
        props = torch.cuda.get_device_properties(0)
        _log(f"# torch {torch.__version__} cuda {torch.version.cuda} device {props.name} "
             f"capacity {_gib(props.total_memory)} PYTORCH_CUDA_ALLOC_CONF="
             f"{os.environ.get('PYTORCH_CUDA_ALLOC_CONF', '')!r}")
    RUNNERS[name](device, small=small, seed=int(os.environ.get("SCENARIO_SEED", "0")))
    import trainguard

    trainguard.flush(10.0)


# --- orchestration -----------------------------------------------------------------------------------
def _env(endpoint: Path, spool: str) -> Dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD_")}
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID",
                 "PYTORCH_CUDA_ALLOC_CONF"):
        env.pop(name, None)
    env.update(NV_ENV)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "sdk" / "src"), str(REPO)])
    env["PYTHONUNBUFFERED"] = "1"
    env["TRAINGUARD_ENDPOINT"] = endpoint.resolve().as_uri()
    env["TRAINGUARD_PROJECT"] = "scenarios"
    env["TRAINGUARD_SPOOL_DIR"] = spool
    env["TRAINGUARD_FLUSH_INTERVAL"] = "0.25"
    return env


def run_all(out: Path, names: Sequence[str], small: bool = False, seed: int = 0) -> Dict[str, object]:
    out.mkdir(parents=True, exist_ok=True)
    summary: Dict[str, object] = {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                  "command": " ".join([Path(sys.executable).name, *sys.argv]),
                                  "scenarios": {}}
    for name in names:
        endpoint = out / (f"{name}.jsonl" if seed == 0 else f"{name}.seed{seed}.jsonl")
        if endpoint.exists():
            endpoint.unlink()
        cmd = [sys.executable, str(Path(__file__).resolve()), "--scenario", name]
        if small:
            cmd.append("--small-cpu")
        with tempfile.TemporaryDirectory(prefix=f"tg-{name}-") as spool, \
                open(out / f"{endpoint.stem}.log", "w", encoding="utf-8") as log:
            started = time.monotonic()
            env = _env(endpoint, spool)
            env["SCENARIO_SEED"] = str(seed)
            if seed:
                env["TRAINGUARD_MEMORY_INTERVAL_S"] = HELD_OUT_MEMORY_INTERVAL_S
            try:
                proc = subprocess.run(cmd, env=env, cwd=REPO, stdout=log,
                                      stderr=subprocess.STDOUT, timeout=TIMEOUT_S)
                code: Optional[int] = proc.returncode
            except subprocess.TimeoutExpired:
                code = None
            duration = time.monotonic() - started
        events = 0
        if endpoint.exists():
            with open(endpoint, encoding="utf-8") as fh:
                events = sum(1 for line in fh if line.strip())
        entry = {"exit_code": code, "timed_out": code is None, "duration_s": round(duration, 2),
                 "events": events}
        summary["scenarios"][name] = entry  # type: ignore[index]
        _log(f"{name}: {json.dumps(entry)}")
    with open(out / "summary.json", "w", encoding="utf-8") as fh:
        json.dump(summary, fh, indent=2)
        fh.write("\n")
    return summary


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("only", nargs="*", help=f"scenarios (default: all of {', '.join(SCENARIOS)})")
    parser.add_argument("--out", type=Path, help="folder for <name>.jsonl, <name>.log, summary.json")
    parser.add_argument("--scenario", choices=SCENARIOS, help="run one training in this process")
    parser.add_argument("--dry-run", action="store_true", help="check imports; exit 0 without CUDA")
    parser.add_argument("--small-cpu", action="store_true",
                        help="tiny CPU versions (no OOM, no fp16): checks the code paths, records nothing real")
    parser.add_argument("--seed", type=int, default=0, help="seed of the trainings; N != 0: a held-out "
                        "recording <name>.seed<N>.jsonl with the SDK's default memory cadence")
    parser.add_argument("--previous-job", metavar="PID_FILE", help=argparse.SUPPRESS)  # gpu_context_leak
    parser.add_argument("--eval-worker", metavar="PID_FILE", help=argparse.SUPPRESS)   # gpu_context_leak
    args = parser.parse_args(argv)
    if args.previous_job:
        _previous_job(args.previous_job)
        return
    if args.eval_worker:
        _eval_worker(args.eval_worker)
        return
    unknown = sorted(set(args.only) - set(SCENARIOS))
    if unknown:
        parser.error(f"unknown scenarios {unknown}; choose from {list(SCENARIOS)}")
    if args.dry_run:
        import torch

        import trainguard  # noqa: F401

        available = torch.cuda.is_available()
        _log(f"torch {torch.__version__}, CUDA available: {available}")
        if not available:
            return
    if args.scenario:
        _run_one(args.scenario, args.small_cpu)
        return
    if args.out is None:
        parser.error("--out DIR (or --scenario NAME, --dry-run)")
    summary = run_all(args.out, args.only or SCENARIOS, small=args.small_cpu, seed=args.seed)
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
