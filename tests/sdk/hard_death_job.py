"""A small real torch training that dies hard right after its loss turns NaN, and the "next process".

    python tests/sdk/hard_death_job.py train HOW [--steps N] [--nan-at K]
    python tests/sdk/hard_death_job.py deliver [--wait S]

The SDK is configured from the environment (``TRAINGUARD_ENDPOINT``, ``TRAINGUARD_TOKEN``,
``TRAINGUARD_RUN_ID``, ``TRAINGUARD_SPOOL_DIR``), as a launcher or ``trainguard agent`` sets it.

``train``: an MLP trained with SGD on seeded random data, ``loss`` logged every step. At step ``K`` the batch
holds a NaN (a bad sample), so the model's loss is NaN; the loop checks its loss, raises
``FloatingPointError("loss is nan at step K")`` and reports it (``capture_exception``, as a script that
checks its loss does) -- then the process ends by HOW at once, before the SDK's worker had a chance to send
the last second:

==========  ==================================================================================
sigkill     ``SIGKILL`` to itself (the OOM killer, a launcher's grace period running out)
abort       ``os.abort()`` (SIGABRT)
terminate   a C++ ``std::terminate`` from libstdc++ (what an uncaught C++ exception, e.g. gloo's, does)
exit        returns normally (the control)
==========  ==================================================================================

``deliver``: an SDK process on the same host, endpoint and spool; it waits (up to ``--wait`` s) until no
other process's spool directory is left beside its own, then shuts down and prints its accounting and the
directories left (JSON). It trains nothing, so it does not import torch (``train`` does: ~2.5 s of CPU per
interpreter on the CI machine, paid once per test instead of twice).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import os
import signal
import sys
import time

import trainguard


def train(how: str, steps: int, nan_at: int) -> None:
    import torch
    from torch import nn

    trainguard.init(flush_interval=2.0)
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(steps):
        x = torch.randn(16, 8, generator=generator)
        y = x.sum(dim=1, keepdim=True) * 0.1
        if step == nan_at:
            x[3, 2] = math.nan  # the bad sample
        loss = nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        value = loss.item()
        trainguard.log(step=step, loss=value)
        if not math.isfinite(value):
            try:
                raise FloatingPointError(f"loss is {value} at step {step}")
            except FloatingPointError:
                trainguard.capture_exception()
            die(how)
            return
        time.sleep(0.002)


def die(how: str) -> None:
    if how == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif how == "abort":
        os.abort()
    elif how == "terminate":
        ctypes.CDLL("libstdc++.so.6")._ZSt9terminatev()
    elif how != "exit":
        raise SystemExit(f"unknown way to die: {how}")


def deliver(wait_s: float) -> None:
    trainguard.init()
    client = trainguard.get_client()
    assert client is not None
    home = getattr(client, "home", None)
    own = home.claim() if home is not None else None
    root = os.environ["TRAINGUARD_SPOOL_DIR"]

    def others() -> list[str]:
        return sorted(os.path.join(key, name) for key in _listdir(root) for name in _listdir(os.path.join(root, key))
                      if os.path.join(root, key, name) != own)

    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and others():
        trainguard.flush(1.0)
        time.sleep(0.1)
    trainguard.shutdown()
    print(json.dumps({"accounting": client.accounting(), "replayed": client.stats.replayed, "left": others()}))


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="mode", required=True)
    run = sub.add_parser("train")
    run.add_argument("how", choices=("sigkill", "abort", "terminate", "exit"))
    run.add_argument("--steps", type=int, default=400)
    run.add_argument("--nan-at", type=int, default=300)
    nxt = sub.add_parser("deliver")
    nxt.add_argument("--wait", type=float, default=30.0)
    args = parser.parse_args(argv)
    if args.mode == "train":
        train(args.how, args.steps, args.nan_at)
    else:
        deliver(args.wait)


if __name__ == "__main__":
    main(sys.argv[1:])
