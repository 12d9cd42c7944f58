#!/usr/bin/env python3
"""What the SDK still says while a rank's CUDA stream is stuck (a hung collective, a hung kernel).

On two H200s (tests/fixtures/nccl/rank_lost) a DDP rank whose peer had died sent nothing more -- not even
heartbeats -- because the SDK's delivery thread waited in the read-back of a gradient norm queued behind
the hung all-reduce. The read-back now runs on a thread of its own (trainguard/device_reader.py). This
script stands a spin kernel (``torch.cuda._sleep``) in for the stuck collective, queues a watched step's
metrics behind it, and counts, in one process:

* ``inline``: the read-back on the delivery thread (the old behaviour; reproduced by treating device
  values as host values);
* ``reader``: the read-back on the reader thread (what the SDK does).

Per mode it prints the heartbeats delivered while the stream was stuck (``heartbeats_during_stall``), the
largest ``sdk_stats.device_wait_s`` a heartbeat carried, whether the step's loss and grad norm arrived
after the stream resumed, and how long after. Nothing is asserted; run on a CUDA machine::

    PYTHONPATH=sdk/src python3 bench/stuck_stream.py --stall-s 8
"""

from __future__ import annotations

import argparse
import time
from typing import Any, Dict, List

import torch
from torch import nn

import trainguard
from trainguard import client as tg_client
from trainguard.integrations import torch as tg_torch


def _delivered(client: Any) -> List[Dict[str, Any]]:
    transport = client.worker._transport
    return list(transport.events) if transport is not None else []


def _cycles_per_second() -> float:
    """The spin kernel's cycles per second on this GPU (measured with CUDA events)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    cycles = 200_000_000
    torch.cuda._sleep(1000)  # warm-up
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    torch.cuda.synchronize()
    return cycles / (start.elapsed_time(end) / 1000.0)


def run(mode: str, stall_s: float, rate: float) -> Dict[str, Any]:
    trainguard.init(endpoint="memory://", spool_dir="", heartbeat_interval=0.5, flush_interval=0.1,
                    capture_exit=False, capture_uncaught=False, watch_overhead_budget=0)
    client = trainguard.get_client()
    original = tg_client._on_device
    if mode == "inline":
        tg_client._on_device = lambda item: False  # type: ignore[assignment]
    try:
        model = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 1)).cuda()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        trainguard.watch(model, opt)
        x = torch.randn(64, 256, device="cuda")
        for step in range(3):  # healthy steps first
            loss = model(x).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            trainguard.log(step=step, loss=loss)
        torch.cuda.synchronize()
        time.sleep(0.5)
        torch.cuda._sleep(int(stall_s * rate))  # the stream is stuck from here for stall_s
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        trainguard.log(step=3, loss=loss)
        queued = time.time_ns()
        before = len([e for e in _delivered(client) if "heartbeat" in e])
        time.sleep(stall_s * 0.8)  # the training thread is free; the device is not
        during = [e for e in _delivered(client) if "heartbeat" in e][before:]
        torch.cuda.synchronize()
        resumed = time.monotonic()
        arrived = None
        while time.monotonic() - resumed < 10:
            evs = _delivered(client)
            steps = {e["step"] for e in evs if "metrics" in e and any(
                p["name"] == "grad/global_norm" for p in e["metrics"]["points"])}
            if 3 in steps and any(e["step"] == 3 and "metrics" in e and any(
                    p["name"] == "loss" for p in e["metrics"]["points"]) for e in evs):
                arrived = time.monotonic() - resumed
                break
            time.sleep(0.01)
        waits = [float(e["heartbeat"]["sdk_stats"].get("device_wait_s", 0.0)) for e in during]
        return {"mode": mode, "heartbeats_during_stall": len(during),
                "max_device_wait_s": max(waits, default=0.0),
                "step3_metrics_arrived": arrived is not None,
                "arrived_after_resume_s": round(arrived, 3) if arrived is not None else None,
                "queued_ns": queued, "dropped": client.stats.dropped_total}
    finally:
        tg_client._on_device = original  # type: ignore[assignment]
        tg_torch.unwatch_all()
        trainguard.shutdown(timeout=5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stall-s", type=float, default=8.0)
    ns = parser.parse_args()
    rate = _cycles_per_second()
    print(f"env torch={torch.__version__} device={torch.cuda.get_device_name()} "
          f"spin_cycles_per_s={rate:.3g} stall_s={ns.stall_s:g} heartbeat_interval=0.5")
    results = [run("inline", ns.stall_s, rate), run("reader", ns.stall_s, rate)]
    for r in results:
        print(f"stuck_stream[{r['mode']}] heartbeats_during_stall={r['heartbeats_during_stall']} "
              f"max_device_wait_s={r['max_device_wait_s']:.2f} "
              f"step3_metrics_arrived={r['step3_metrics_arrived']} "
              f"arrived_after_resume_s={r['arrived_after_resume_s']} dropped={r['dropped']}")
    expected = int(ns.stall_s * 0.8 / 0.5)
    print(f"heartbeats expected during the stall at 0.5 s: ~{expected}; ratio reader/inline = "
          f"{results[1]['heartbeats_during_stall']}/{results[0]['heartbeats_during_stall']}")


if __name__ == "__main__":
    main()
