"""Agent overhead: CPU and memory of ``trainguard agent`` while the job writes 10,000 log lines/s.

    .venv/bin/python bench/agent.py [--rate 10000] [--seconds 10]

A writer process prints ``--rate`` lines per second for ``--seconds`` (1 % of them WARNING lines, which the
agent forwards; the rest INFO step lines, which it segments, keeps in its tail and counts as progress).
Three runs against a real ``trainguard serve`` (the upstream):

* ``baseline``: the writer alone, stdout to /dev/null (its own CPU, for the ratio);
* ``wrapper``: ``trainguard agent -- writer`` (the agent reads the pipes and passes every byte through);
* ``sidecar``: the writer appends to a file that ``trainguard agent --log-file`` follows.

Printed per run: the agent's CPU seconds per wall second (user + system of the agent process alone, from
/proc, sampled to its end), its peak RSS (VmHWM), lines captured and events forwarded, and the agent's CPU
against the writer's own.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.services.e2e.serve_process import ServeProcess  # noqa: E402

WRITER = r"""
import sys, time
rate, seconds = int(sys.argv[1]), float(sys.argv[2])
out = open(sys.argv[3], "a", buffering=1) if len(sys.argv) > 3 else sys.stdout
start = time.perf_counter()
n = 0
while n < rate * seconds:
    due = start + n / rate
    now = time.perf_counter()
    if due > now:
        time.sleep(due - now)
    if n % 100 == 0:
        out.write(f"WARNING: step {n} data loader queue is empty, waiting for workers ({n // 100})\n")
    else:
        out.write(f"step {n} loss {1.0 / (1 + n):.6f} lr 0.0003 tokens/s 123456 grad_norm 0.87\n")
    n += 1
out.flush()
"""

CLK = os.sysconf("SC_CLK_TCK")


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK


def _hwm_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _watch(proc: subprocess.Popen[bytes]) -> Dict[str, float]:
    """Sample the process's own CPU and peak RSS until it exits."""
    cpu = hwm = 0.0
    start = time.perf_counter()
    while proc.poll() is None:
        try:
            cpu, hwm = _cpu_s(proc.pid), max(hwm, _hwm_mb(proc.pid))
        except (OSError, IndexError):
            pass
        time.sleep(0.05)
    return {"cpu_s": cpu, "wall_s": time.perf_counter() - start, "rss_mb": hwm}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rate", type=int, default=10_000)
    parser.add_argument("--seconds", type=float, default=10.0)
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="tg-bench-agent-"))
    serve = ServeProcess(tmp / "data").start()
    token = serve.tokens["ingest"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD_")}
    env.update(TRAINGUARD_TOKEN=token)
    writer = [sys.executable, "-c", WRITER, str(args.rate), str(args.seconds)]
    agent = [sys.executable, "-m", "trainguard_server", "agent", "--upstream", serve.http_url, "--listen",
             "127.0.0.1:0", "--listen-grpc", "", "--no-stacks"]
    rows: List[str] = []
    try:
        t0 = time.perf_counter()
        base = subprocess.run(writer, stdout=subprocess.DEVNULL, env=env)
        import resource

        usage = resource.getrusage(resource.RUSAGE_CHILDREN)
        writer_cpu = usage.ru_utime + usage.ru_stime
        rows.append(f"baseline  writer alone: {time.perf_counter() - t0:.2f} s wall, {writer_cpu:.2f} s CPU "
                    f"({writer_cpu / args.seconds:.3f} CPU-s/s), exit {base.returncode}")

        proc = subprocess.Popen([*agent, "--spool-dir", str(tmp / "spool1"), "--run-id", "bench-wrapper",
                                 "--", *writer], env=env, stdout=subprocess.DEVNULL)
        wrapped = _watch(proc)
        rows.append(_row("wrapper", wrapped, args, writer_cpu))

        logs = tmp / "logs"
        logs.mkdir()
        proc = subprocess.Popen([*agent, "--spool-dir", str(tmp / "spool2"), "--run-id", "bench-sidecar",
                                 "--log-file", str(logs / "*.log"), "--exit-file", str(logs / "exit-code")],
                                env=env)
        time.sleep(3.0)
        startup = _cpu_s(proc.pid)  # imports and listeners, before the job writes anything
        subprocess.run([*writer, str(logs / "rank0.log")], env=env)
        (logs / "exit-code").write_text("0\n")
        sidecar = _watch(proc)
        rows.append(_row("sidecar", sidecar, args, writer_cpu))
        for name, m in (("wrapper", wrapped), ("sidecar", sidecar)):
            steady = (m["cpu_s"] - startup) / args.seconds
            rows.append(f"{name:<9} without the agent's start-up ({startup:.2f} CPU-s): {steady:.3f} CPU-s "
                        f"per "
                        f"second of job ({steady * 100:.1f} % of one core), "
                        f"{steady / args.rate * 1e6:.1f} us CPU per line")
        time.sleep(1.0)
        for run in ("bench-wrapper", "bench-sidecar"):
            logs_sent = len(serve.pages(f"/api/v1/runs/{run}/events", kinds="log"))
            expected = int(args.rate * args.seconds) // 100
            rows.append(f"  {run}: {logs_sent} WARNING lines stored of {expected}")
    finally:
        serve.stop()
    print(f"agent overhead at {args.rate:,} lines/s for {args.seconds:g} s (python {sys.version.split()[0]}, "
          f"{os.cpu_count()} CPUs)")
    print("\n".join(rows))


def _row(name: str, m: Dict[str, float], args: argparse.Namespace, writer_cpu: float) -> str:
    per_s = m["cpu_s"] / args.seconds
    return (f"{name:<9} agent: {m['cpu_s']:.2f} CPU-s in all = {per_s:.3f} CPU-s per "
            f"second of job ({per_s * 100:.1f} % of one core), peak RSS {m['rss_mb']:.0f} MB, "
            f"agent/writer CPU {m['cpu_s'] / max(writer_cpu, 1e-9):.2f}x")


if __name__ == "__main__":
    main()
