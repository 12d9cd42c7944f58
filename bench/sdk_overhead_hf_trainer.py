#!/usr/bin/env python3
"""What the Hugging Face callback costs a real ``Trainer`` step, with and without its per-step loss.

GPT-2 small (``GPT2Config()``, 124 M parameters, random init) trained by the real ``transformers.Trainer``
(bf16, its default AdamW and ``max_grad_norm=1.0``, ``logging_steps=50``), batch ``--batch`` x ``--seq``
tokens of random ids, on one CUDA device (or CPU with ``--device cpu`` and a tiny config). Variants, built
afresh and trained for ``--steps`` steps each round, the order rotating from round to round, in one process:

* ``bare``      -- the Trainer alone;
* ``callback``  -- ``TrainGuardCallback(step_loss=False)``: the watch (norms, timing, memory) and on_log;
* ``step_loss`` -- ``TrainGuardCallback()``: the same plus the loss of every step from the model's output
  (a forward hook; the value read back off the step path).

A variant's figure is the median over rounds of its mean step time between the 10th step and the last
(timed by a callback with CUDA events: no sync added inside the window). Nothing is asserted.

    python3 bench/sdk_overhead_hf_trainer.py --rounds 4 --steps 60          # one H200: ~2 minutes
    python3 bench/sdk_overhead_hf_trainer.py --device cpu --rounds 3 --steps 40
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from typing import Any, Dict, List

import torch

import trainguard


class StepClock:
    """Times steps [warm, last] of a Trainer run: CUDA events on a device, else the wall clock."""

    def __init__(self, warm: int, cuda: bool) -> None:
        self.warm, self.cuda = warm, cuda
        self.start: Any = None
        self.end: Any = None
        self.steps = 0

    def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if state.global_step == self.warm:
            self.start = self._mark()

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if state.global_step > self.warm:
            self.end = self._mark()
            self.steps = state.global_step - self.warm

    def _mark(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def ms_per_step(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
            return self.start.elapsed_time(self.end) / self.steps
        return (self.end - self.start) * 1000 / self.steps


def run(variant: str, args: argparse.Namespace) -> float:
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

    from trainguard.integrations.transformers import TrainGuardCallback

    cuda = args.device != "cpu"
    torch.manual_seed(0)
    config = GPT2Config() if cuda else GPT2Config(n_embd=128, n_layer=2, n_head=4, n_positions=args.seq)
    model = GPT2LMHeadModel(config)
    ids = torch.randint(0, config.vocab_size, (args.batch * (args.steps + 1), args.seq))
    data = [{"input_ids": row, "labels": row} for row in ids]
    clock = StepClock(10, cuda)
    callbacks: List[Any] = [type("Clock", (TrainerCallback,), {
        "on_step_begin": clock.on_step_begin, "on_step_end": clock.on_step_end})()]
    if variant != "bare":
        callbacks.append(TrainGuardCallback(step_loss=variant == "step_loss"))
    with tempfile.TemporaryDirectory() as out:
        targs = TrainingArguments(output_dir=out, max_steps=args.steps,
                                  per_device_train_batch_size=args.batch,
                                  bf16=cuda, logging_steps=50, report_to=[], save_strategy="no",
                                  use_cpu=not cuda, disable_tqdm=True, dataloader_num_workers=0)
        Trainer(model=model, args=targs, train_dataset=data, callbacks=callbacks).train()
    return clock.ms_per_step()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=512)
    args = parser.parse_args()
    trainguard.init(endpoint="memory://", spool_dir="", heartbeat_interval=0, capture_exit=False,
                    capture_uncaught=False)
    variants = ["bare", "callback", "step_loss"]
    results: Dict[str, List[float]] = {v: [] for v in variants}
    for r in range(args.rounds):
        for v in variants[r % 3:] + variants[:r % 3]:
            results[v].append(run(v, args))
    base = statistics.median(results["bare"])
    for v in variants:
        med = statistics.median(results[v])
        print(f"variant={v} step_ms={med:.3f} overhead={100 * (med / base - 1):+.2f}% "
              f"rounds_ms={[round(x, 2) for x in results[v]]}")
    stats = trainguard.get_client().stats.snapshot() if trainguard.get_client() else {}  # type: ignore[union-attr]
    print(f"sdk_stats {stats}")
    trainguard.shutdown(timeout=5)


if __name__ == "__main__":
    main()
