#!/usr/bin/env python3
"""Black-box load of many concurrent small gRPC ``Send`` calls against a running ``trainguard serve``
(security.md H34: a ``Send`` reserves room in the bounds on ingest bytes in flight before its message is read,
so beyond a few at once of one project the others wait for room).

It starts a fresh ``trainguard serve`` (defaults, or ``--src`` another checkout's source, for an A/B) with
projects A (the noisy one) and B (the quiet one), then for ``--seconds``:

* ``--senders`` concurrent senders of project A, each sending Sends of ``--events`` small metric events one
  after another (``grpc.aio``, raw bytes, over ``senders / 50`` connections);
* one sender of project B (a process of its own), one Send of ``--events`` every ~50 ms (``--no-quiet``:
  none).

Prints per project: Sends answered OK / refused (by status), events accepted per second, ack latency p50 / p99
/ max (call start to answer), and the server's CPU seconds (utime + stime of the serve process over the run),
CPU per accepted event, and peak resident memory. One JSON line at the end for scripts.

    python bench/grpc_waiters.py --senders 256
    python bench/grpc_waiters.py --senders 1000 --src /tmp/wt/   # the same against another checkout
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any, Dict, List, Tuple

REPO = Path(__file__).resolve().parent.parent
for _src in (REPO / "sdk" / "src", REPO / "services" / "src", REPO / "engine" / "src", REPO):
    if str(_src) not in sys.path:
        sys.path.insert(0, str(_src))

SERVICE = "/trainguard.v1.IngestService/Send"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def spawn(data_dir: Path, src: Path, env_extra: Dict[str, str]) -> Tuple[subprocess.Popen[bytes], int, int,
                                                                            Dict[str, str]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD_")}
    env.update(env_extra)
    env["PYTHONPATH"] = os.pathsep.join(str(src / d / "src") for d in ("sdk", "engine", "services"))
    tokens: Dict[str, str] = {}
    for project in "AB":
        out = subprocess.run([sys.executable, "-m", "trainguard_server", "token", "create", "--project",
                              project,
                              "--kind", "ingest", "--data-dir", str(data_dir)], env=env, check=True,
                             capture_output=True, text=True).stdout
        tokens[project] = next(w for w in out.split() if w.startswith("tg_ingest_"))
    port, grpc_port = _free_port(), _free_port()
    log = open(data_dir / "serve.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "trainguard_server", "serve", "--data-dir", str(data_dir),
                             "--http-port", str(port), "--grpc-port", str(grpc_port)], stdout=log,
                            stderr=subprocess.STDOUT, env=env, start_new_session=True)
    deadline = time.monotonic() + 60
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2) as r:
                if r.status == 200:
                    return proc, port, grpc_port, tokens
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            tail = (data_dir / "serve.log").read_text()[-2000:]
            raise RuntimeError(f"trainguard serve did not start: {tail}")
        time.sleep(0.1)


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _request(project: str, sender: int, events: int) -> bytes:
    from trainguard import wire
    now = time.time_ns()
    return bytes(wire.ingest_request_from_dicts([
        {"event_id": uuid.uuid4().hex, "run_id": f"{project.lower()}-run-{sender % 16}", "rank": sender % 64,
         "world_size": 64, "step": i, "time_unix_nano": now + i, "severity": "INFO",
         "metrics": {"points": [{"name": "loss", "value": 1.0 + i % 7}, {"name": "lr", "value": 3e-4}]}}
        for i in range(events)]).SerializeToString())


class Tally:
    def __init__(self) -> None:
        self.lat: List[float] = []
        self.codes: Dict[str, int] = {}
        self.accepted = 0
        self.details: Dict[str, str] = {}  # the first answer's details per status

    def summary(self, seconds: float) -> Dict[str, Any]:
        lat = sorted(self.lat)

        def pct(p: float) -> float:
            return round(lat[min(len(lat) - 1, int(p * len(lat)))] * 1000, 1) if lat else float("nan")

        return {"sends": len(lat), "codes": self.codes, "details": self.details,
                "accepted_events": self.accepted,
                "events_per_s": round(self.accepted / seconds), "p50_ms": pct(0.5), "p90_ms": pct(0.9),
                "p99_ms": pct(0.99), "max_ms": round(lat[-1] * 1000, 1) if lat else float("nan"),
                # the first call connects (its channel's handshake): a slow first call is not a slow Send
                "first_ms": round(self.lat[0] * 1000, 1) if self.lat else float("nan")}


async def _sender(stub: Any, token: str, project: str, sender: int, events: int, stop_at: float,
                  tally: Tally, pause_s: float = 0.2) -> None:
    import grpc

    from trainguard.v1 import ingest_pb2
    md = (("authorization", f"Bearer {token}"),)
    while time.monotonic() < stop_at:
        data = _request(project, sender, events)
        started = time.monotonic()
        try:
            raw = await stub(data, metadata=md, timeout=60)
            reply = ingest_pb2.IngestResponse.FromString(raw)
            tally.accepted += reply.accepted
            code = "OK"
        except grpc.aio.AioRpcError as exc:
            code = exc.code().name
            tally.details.setdefault(code, str(exc.details())[:300])
        tally.lat.append(time.monotonic() - started)
        tally.codes[code] = tally.codes.get(code, 0) + 1
        if code != "OK" and pause_s:
            await asyncio.sleep(pause_s)
        elif code != "OK":
            await asyncio.sleep(0)  # an attacker: at once again (let the other senders run)


def _quiet(grpc_port: int, token: str, events: int, seconds: float, out: Any) -> None:
    """Project B's one sender, in a process of its own (sharing the noisy client's event loop and GIL would
    count the client's own delay as the server's)."""
    import grpc

    from trainguard.v1 import ingest_pb2
    tally = Tally()
    md = (("authorization", f"Bearer {token}"),)
    stop_at = time.monotonic() + seconds
    with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
        stub = channel.unary_unary(SERVICE)
        while time.monotonic() < stop_at:
            data = _request("B", 0, events)
            started = time.monotonic()
            try:
                reply = ingest_pb2.IngestResponse.FromString(stub(data, metadata=md, timeout=60))
                tally.accepted += reply.accepted
                code = "OK"
            except grpc.RpcError as exc:
                code = exc.code().name
                tally.details.setdefault(code, str(exc.details())[:300])
            tally.lat.append(time.monotonic() - started)
            tally.codes[code] = tally.codes.get(code, 0) + 1
            time.sleep(0.05 if code == "OK" else 0.2)  # one Send every ~50 ms: a quiet project
    out.put((tally.lat, tally.codes, tally.details, tally.accepted))


def bad_token(token: str) -> str:
    """``token`` with its secret's last characters changed: a well-formed token of an existing id whose
    secret does not match (the costliest refusal: a store lookup and a hash, twice)."""
    return token[:-6] + ("xxxxxx" if not token.endswith("xxxxxx") else "yyyyyy")


async def _load(grpc_port: int, tokens: Dict[str, str], senders: int, events: int, seconds: float,
                bad: bool = False) -> Tally:
    import grpc
    channels = [grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}",
                                          options=[("grpc.use_local_subchannel_pool", 1)])
                for _ in range(max(1, -(-senders // 50)))]
    stubs = [c.unary_unary(SERVICE) for c in channels]
    noisy = Tally()
    stop_at = time.monotonic() + seconds
    token, pause = (bad_token(tokens["A"]), 0.0) if bad else (tokens["A"], 0.2)
    await asyncio.gather(*(_sender(stubs[i % len(stubs)], token, "A", i, events, stop_at, noisy, pause)
                           for i in range(senders)))
    for c in channels:
        await c.close()
    return noisy


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--senders", type=int, default=256)
    ap.add_argument("--events", type=int, default=10, help="events per Send")
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--no-quiet", dest="quiet", action="store_false", help="no project-B sender")
    ap.add_argument("--bad-token", action="store_true",
                    help="A's senders use a token whose secret is wrong (refused UNAUTHENTICATED) and send "
                         "again at once: a flood of authentications (hR, stop 43: they shared one FIFO)")
    ap.add_argument("--src", type=Path, default=REPO, help="checkout whose server to run (A/B)")
    ap.add_argument("--env", action="append", default=[], help="KEY=VALUE for the server")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="tg-waiters-") as tmp:
        proc, _port, grpc_port, tokens = spawn(Path(tmp), args.src.resolve(),
                                               dict(kv.split("=", 1) for kv in args.env))
        try:
            peak = [_rss_mb(proc.pid)]
            done = threading.Event()

            def watch() -> None:
                while not done.wait(0.1):
                    peak[0] = max(peak[0], _rss_mb(proc.pid))

            threading.Thread(target=watch, daemon=True).start()
            rss0, cpu0, t0 = _rss_mb(proc.pid), _cpu_s(proc.pid), time.monotonic()
            calm, results = Tally(), multiprocessing.get_context("spawn").Queue()
            quiet = multiprocessing.get_context("spawn").Process(
                target=_quiet, args=(grpc_port, tokens["B"], args.events, args.seconds, results))
            if args.quiet:
                quiet.start()
            noisy = asyncio.run(_load(grpc_port, tokens, args.senders, args.events, args.seconds,
                                      args.bad_token))
            if args.quiet:
                calm.lat, calm.codes, calm.details, calm.accepted = results.get(timeout=120)
                quiet.join(30)
            took = time.monotonic() - t0
            cpu = _cpu_s(proc.pid) - cpu0
            done.set()
        finally:
            proc.terminate()
            proc.wait(30)
    out = {"src": str(args.src), "senders": args.senders, "bad_token": args.bad_token,
           "events": args.events, "seconds": round(took, 1),
           "A": noisy.summary(took), "B": calm.summary(took) if args.quiet else None,
           "server_cpu_s": round(cpu, 2),
           "server_cpu_us_per_event": round(cpu / max(1, noisy.accepted + calm.accepted) * 1e6, 1),
           "rss_mb_start": round(rss0), "rss_mb_peak": round(peak[0]),
           "load": os.getloadavg()[0]}
    print(f"A ({args.senders} senders): {out['A']}")
    if args.quiet:
        print(f"B (1 sender):  {out['B']}")
    print(f"server CPU {out['server_cpu_s']} s over {out['seconds']} s "
          f"({out['server_cpu_us_per_event']} us/event), RSS {out['rss_mb_start']} -> peak "
          f"{out['rss_mb_peak']} MB, load {out['load']:.1f}")
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
