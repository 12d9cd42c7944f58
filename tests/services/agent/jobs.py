"""Small real torch trainings that the agent tests run under ``trainguard agent``, as a job would run.

    python tests/services/agent/jobs.py KIND [--steps N] [--sdk] [--log FILE] [--exit-file FILE]

No SDK unless ``--sdk`` (the agent must capture jobs that never import one). Every kind trains a small
MLP on seeded random data and prints ``step <n> loss <x>`` per step, then:

===============  =======================================================================================
healthy          exits 0 after ``--steps`` steps
crash            a bug in the batch code at step 8: ``IndexError`` from a list lookup (exit code 1)
oom              at step 8 the forward raises ``torch.OutOfMemoryError`` with the message an H200 printed
                 for a real CUDA OOM (tests/fixtures/tracebacks/gpu_cuda_oom_a.txt): the CPU cannot run
                 out of CUDA memory, the text and the exception type are the real ones
hang             at step 8 the data pipeline waits forever on an event nobody sets (``wait_for_batch``):
                 alive, silent, no progress -- until a signal ends it
comm_timeout     a worker of a two-rank torchrun job (gloo, process-group timeout 3 s): every step
                 all-reduces the gradients by hand; at step 6 rank 1 sleeps 60 s, so rank 0's gloo
                 all-reduce times out for real (``Timed out waiting 3000ms for recv operation``)
===============  =======================================================================================

``--log FILE`` sends stdout and stderr to FILE (a sidecar's view); ``--exit-file FILE`` writes the exit
code there at the end, as the Kubernetes example's shell wrapper does.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import threading
import time
from pathlib import Path

import torch
from torch import nn

HERE = Path(__file__).resolve().parent
OOM_FIXTURE = HERE.parents[1] / "fixtures" / "tracebacks" / "gpu_cuda_oom_a.txt"
FAIL_AT = 8


def recorded_oom_message() -> str:
    """The message of the real CUDA OOM recorded on an H200 (the text after the exception type)."""
    for line in reversed(OOM_FIXTURE.read_text().splitlines()):
        if line.startswith("torch.OutOfMemoryError: "):
            return line[len("torch.OutOfMemoryError: "):]
    raise RuntimeError(f"no OutOfMemoryError line in {OOM_FIXTURE}")


def wait_for_batch(ready: threading.Event) -> None:
    ready.wait()  # nobody sets it: the deadlocked data pipeline


def make_batch(generator: torch.Generator, step: int, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    if kind == "crash" and step == FAIL_AT:
        shards = [0, 1, 2]
        return shards[step], shards[step]  # type: ignore[return-value]  # the bug: IndexError
    if kind == "hang" and step == FAIL_AT:
        wait_for_batch(threading.Event())
    x = torch.randn(32, 16, generator=generator)
    return x, x.sum(dim=1, keepdim=True) * 0.1


def train(kind: str, steps: int, use_sdk: bool) -> None:
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    if use_sdk:
        import trainguard

        trainguard.init()
        trainguard.watch(model, optimizer)
    for step in range(steps):
        x, y = make_batch(generator, step, kind)
        if kind == "oom" and step == FAIL_AT:
            raise torch.OutOfMemoryError(recorded_oom_message())
        loss = nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if use_sdk:
            import trainguard

            trainguard.log(step=step, loss=loss)
        print(f"step {step} loss {loss.item():.6f}", flush=True)
        time.sleep(0.02)


def comm_worker(steps: int) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=3))
    rank = dist.get_rank()
    torch.manual_seed(rank)
    model = nn.Linear(16, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(steps):
        x = torch.randn(32, 16)
        loss = model(x).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        if rank == 1 and step == 6:
            time.sleep(60)  # the lagging rank
        for p in model.parameters():
            dist.all_reduce(p.grad)
        optimizer.step()
        print(f"step {step} loss {loss.item():.6f}", flush=True)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("kind", choices=["healthy", "crash", "oom", "hang", "comm_timeout"])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--sdk", action="store_true")
    parser.add_argument("--log", default="")
    parser.add_argument("--exit-file", default="")
    args = parser.parse_args()
    if args.log:
        fd = os.open(args.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        sys.stdout = os.fdopen(1, "w", buffering=1)
        sys.stderr = os.fdopen(2, "w", buffering=1)
    code = 0
    try:
        if args.kind == "comm_timeout":
            comm_worker(args.steps)
        else:
            train(args.kind, args.steps, args.sdk)
    except BaseException:
        code = 1
        raise
    finally:
        if args.exit_file:
            Path(args.exit_file).write_text(f"{code}\n")


if __name__ == "__main__":
    main()
