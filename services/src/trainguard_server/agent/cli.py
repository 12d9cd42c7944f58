"""``trainguard agent``: flags and environment (``TRAINGUARD_AGENT_*``), and how the agent process ends."""

from __future__ import annotations

import argparse
import logging
import math
import os
import signal
import sys
from pathlib import Path
from typing import Any, List

from .watchdog import DEFAULT_POLICY, HangPolicy

EPILOG = """\
modes:
  wrapper   trainguard agent [options] -- python train.py ...
            runs the job, passes its output through untouched, ends with its exit code or signal
  sidecar   trainguard agent [options]   (with --log-file and --exit-file / --pod-container / --watch-process)
            follows the job's log files next to it (a Kubernetes sidecar), ends when the job does

every option can come from the environment: TRAINGUARD_AGENT_<OPTION> (e.g. TRAINGUARD_AGENT_UPSTREAM,
TRAINGUARD_AGENT_LOG_FILES=a.log,b/*.log); the token is TRAINGUARD_TOKEN, as for the SDK.

examples:
  trainguard agent --upstream http://trainguard:4318 -- torchrun --nproc-per-node 8 train.py
  TRAINGUARD_AGENT_UPSTREAM=grpc://trainguard:4317 TRAINGUARD_AGENT_LOG_FILES='/var/log/train/*.log' \\
      TRAINGUARD_AGENT_EXIT_FILE=/var/log/train/exit-code trainguard agent
"""


def _env(name: str, default: str = "") -> str:
    return os.environ.get(f"TRAINGUARD_AGENT_{name}", default)


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
NUMBER_OPTIONS = {"hang_factor": ("HANG_FACTOR", DEFAULT_POLICY.factor),
                  "hang_floor_s": ("HANG_FLOOR_S", DEFAULT_POLICY.floor_s),
                  "hang_ceiling_s": ("HANG_CEILING_S", DEFAULT_POLICY.ceiling_s),
                  "drain_timeout_s": ("DRAIN_TIMEOUT_S", 10.0),
                  "sdk_spool_scan_s": ("SDK_SPOOL_SCAN_S", 5.0),
                  "pod_poll_s": ("POD_POLL_S", 2.0)}
"""Numeric options: attribute -> (environment suffix, default). Read from the environment only when the
agent runs (a bad value there must not break the parser, which every ``trainguard`` command builds)."""


def resolve_env(args: argparse.Namespace) -> str:
    """Fill the options not given as flags from ``TRAINGUARD_AGENT_*``; the problem, or "" when none."""
    for attr, (name, default) in NUMBER_OPTIONS.items():
        if getattr(args, attr) is not None:
            continue
        raw = _env(name)
        try:
            setattr(args, attr, float(raw) if raw else default)
        except ValueError:
            return f"TRAINGUARD_AGENT_{name}={raw!r} is not a number"
    if args.log_level is None:
        args.log_level = _env("LOG_LEVEL", "WARNING").upper()
        if args.log_level not in LOG_LEVELS:
            return f"TRAINGUARD_AGENT_LOG_LEVEL={args.log_level!r} is not one of {', '.join(LOG_LEVELS)}"
    return ""


def add_agent_parser(sub: Any) -> None:
    agent = sub.add_parser(
        "agent", help="sidecar / wrapper: relay SDK traffic, tail the job's output, watch its process",
        description="Relay the SDK's events through a disk spool, capture tracebacks and error text from the "
                    "job's output (jobs without the SDK too), report its exit code and signal, and report "
                    "a hang (no step and no output) with the last lines and the Python stacks.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    agent.add_argument("--upstream", default=_env("UPSTREAM") or None,
                       help="the platform's gateway: http(s)://host:4318 or grpc(s)://host:4317")
    agent.add_argument("--token", default=os.environ.get("TRAINGUARD_TOKEN"),
                       help="ingest token (TRAINGUARD_TOKEN): forwarded with, and required of the SDK")
    agent.add_argument("--listen", default=_env("LISTEN", "127.0.0.1:4318"),
                       help="local HTTP ingest + /healthz (default 127.0.0.1:4318; '' turns it off)")
    agent.add_argument("--listen-grpc", default=_env("LISTEN_GRPC", "127.0.0.1:4317"),
                       help="local gRPC ingest (default 127.0.0.1:4317; '' turns it off)")
    agent.add_argument("--spool-dir", default=_env("SPOOL_DIR") or None,
                       help="disk spool (default /var/lib/trainguard-agent, else ~/.cache/trainguard/agent)")
    agent.add_argument("--sdk-spool-dir", default=_env("SDK_SPOOL_DIR") or None,
                       help="the job's SDK spool (TRAINGUARD_SPOOL_DIR of the job), where a rank that died "
                            "hard (SIGKILL, abort, native crash) left its last events; wrapper mode default: "
                            "<spool-dir>/sdk, given to the job")
    agent.add_argument("--sdk-spool-scan-s", type=float,
                       help="look for what dead SDK processes left this often (default 5)")
    agent.add_argument("--log-file", action="append", default=None, metavar="GLOB",
                       help="sidecar: follow these files (repeatable; TRAINGUARD_AGENT_LOG_FILES, "
                            "comma-separated)")
    agent.add_argument("--exit-file", default=_env("EXIT_FILE"),
                       help="sidecar: the job writes its exit code here when it ends")
    agent.add_argument("--watch-process", default=_env("WATCH_PROCESS"), metavar="REGEX",
                       help="sidecar with a shared process namespace: the job's command line")
    agent.add_argument("--pod-container", default=_env("POD_CONTAINER"), metavar="NAME",
                       help="sidecar in Kubernetes: the training container; its exit code, signal and reason "
                            "(OOMKilled) are read from the pod's status (needs 'get' on pods, POD_NAME and "
                            "POD_NAMESPACE from the downward API)")
    agent.add_argument("--kube-api", default=_env("KUBE_API"), metavar="URL",
                       help="the Kubernetes API (default: in-cluster; e.g. http://127.0.0.1:8001 for kubectl "
                            "proxy)")
    agent.add_argument("--pod-poll-s", type=float, help="read the pod's status this often (default 2)")
    agent.add_argument("--run-id", default=_env("RUN_ID"),
                       help="the run (default TRAINGUARD_RUN_ID / the launcher's / generated in wrapper "
                            "mode)")
    agent.add_argument("--log-level", default=None, choices=LOG_LEVELS,
                       help="send output lines at or above this level (default WARNING; tracebacks and error "
                            "text the classifier knows are always sent)")
    hang = agent.add_argument_group("hang watchdog: clamp(factor x interval, floor, ceiling)")
    hang.add_argument("--hang-factor", type=float, help=f"default {DEFAULT_POLICY.factor:g}")
    hang.add_argument("--hang-floor-s", type=float, help=f"default {DEFAULT_POLICY.floor_s:g}")
    hang.add_argument("--hang-ceiling-s", type=float, help=f"default {DEFAULT_POLICY.ceiling_s:g}")
    hang.add_argument("--no-stacks", action="store_true", help="do not dump Python stacks with py-spy")
    agent.add_argument("--drain-timeout-s", type=float,
                       help="at the end, wait this long for the spool to be delivered (default 10)")
    agent.add_argument("command", nargs=argparse.REMAINDER,
                       help="wrapper mode: the job's command line, after --")
    agent.set_defaults(func=cmd_agent)


def cmd_agent(args: argparse.Namespace) -> int:
    from .runner import Agent, AgentConfig, default_spool_dir

    logging.getLogger("trainguard.agent").setLevel(logging.INFO)
    problem = resolve_env(args)
    if problem:
        print(f"trainguard agent: {problem}", file=sys.stderr)
        return 2
    command: List[str] = list(args.command or [])
    if command and command[0] == "--":
        command = command[1:]
    if not args.upstream and os.environ.get("TRAINGUARD_ENDPOINT"):
        # what the SDK uses: the job's own endpoint becomes the upstream, and the job sends to this agent
        args.upstream = os.environ.pop("TRAINGUARD_ENDPOINT")
    missing = [what for what, value in (
        ("--upstream (TRAINGUARD_AGENT_UPSTREAM or TRAINGUARD_ENDPOINT)", args.upstream),
        ("--token (TRAINGUARD_TOKEN)", args.token)) if not value]
    if missing and command:  # the job comes first: run it as it is, and say so loudly
        print(f"trainguard agent: WARNING: {' and '.join(missing)} not given: running the job WITHOUT "
              "TrainGuard (nothing is captured)", file=sys.stderr, flush=True)
        try:
            os.execvp(command[0], command)  # the job's own exit status and signals, as without the agent
        except OSError as exc:
            print(f"trainguard agent: cannot run {command[0]!r}: {exc}", file=sys.stderr)
            return 127
    if missing:
        print(f"trainguard agent: {missing[0]} is required", file=sys.stderr)
        return 2
    log_files = args.log_file or [p.strip() for p in _env("LOG_FILES").split(",") if p.strip()]
    if not command and not log_files and not args.exit_file and not args.watch_process \
            and not args.pod_container:
        print("trainguard agent: give a command after -- (wrapper mode) or --log-file / --exit-file / "
              "--pod-container / --watch-process (sidecar mode)", file=sys.stderr)
        return 2
    try:
        policy = HangPolicy(args.hang_factor, args.hang_floor_s, args.hang_ceiling_s)
        for flag in ("pod_poll_s", "sdk_spool_scan_s"):
            value = getattr(args, flag)
            if not math.isfinite(value) or value <= 0:
                raise ValueError(f"--{flag.replace('_', '-')} must be > 0, got {value:g}")
        config = AgentConfig(upstream=args.upstream, token=args.token, listen=args.listen,
                             listen_grpc=args.listen_grpc,
                             spool_dir=Path(args.spool_dir) if args.spool_dir else default_spool_dir(),
                             log_files=log_files, exit_file=args.exit_file, watch_process=args.watch_process,
                             policy=policy, min_level=args.log_level, drain_timeout_s=args.drain_timeout_s,
                             stacks=not args.no_stacks, run_id=args.run_id,
                             pod_container=args.pod_container, kube_api=args.kube_api,
                             pod_poll_s=args.pod_poll_s,
                             sdk_spool_dir=Path(args.sdk_spool_dir) if args.sdk_spool_dir else None,
                             sdk_spool_scan_s=args.sdk_spool_scan_s)
        agent = Agent(config)
        agent.start()
    except (ValueError, OSError) as exc:
        print(f"trainguard agent: cannot start: {exc}", file=sys.stderr)
        return 2
    if not command:
        code = agent.run_sidecar()
        agent.stop()
        return code
    try:
        status = agent.run_command(command)
    except OSError as exc:  # the command does not exist / is not executable: as a shell would say
        agent.stop()
        print(f"trainguard agent: cannot run {command[0]!r}: {exc}", file=sys.stderr)
        return 127
    agent.stop()
    return end_like(status.code, status.signal)


def end_like(code: int, sig: int) -> int:
    """End this process the way the job ended: by the same signal (default action), else its code."""
    if sig:
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            signal.signal(sig, signal.SIG_DFL)
            os.kill(os.getpid(), sig)
        except (OSError, ValueError):
            pass
    return code

