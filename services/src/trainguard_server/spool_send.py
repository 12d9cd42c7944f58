"""``trainguard spool send``: deliver by hand what SDK processes left in a spool directory.

A job that ran while its backend was down, or died, leaves its batches in the SDK's spool
(``TRAINGUARD_SPOOL_DIR``, default ``~/.cache/trainguard/spool``). The next SDK process with the same spool,
endpoint and project, or ``trainguard agent``, delivers them; this command does it now, e.g. from a login
node after a job on a cluster whose backend was away.

Contract: every process directory under ``<spool>/<endpoint key>/`` whose owner is dead (its lock free:
:func:`trainguard.transport.orphans.find_orphans`, which also seals write-ahead events and crash stacks into
batches) is sent oldest batch first to ``--endpoint`` (default: the endpoint the process was sending to)
with ``--token`` (default ``TRAINGUARD_TOKEN``), through the SDK's own transports. A batch leaves the spool
once acknowledged. Directories of live processes are left alone. The server unreachable: the directory is
kept whole and the command exits 1 with the reason; the token refused: exit 2; a batch the server refuses
as a whole (malformed, too large) is dropped and counted. Re-sending is safe: the server keeps each event
id once. Prints one line per directory and a total.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, List, Optional, TextIO

from trainguard.client import make_transport
from trainguard.options import Options, default_spool_dir
from trainguard.transport.base import TransportError
from trainguard.transport.orphans import Orphan, find_orphans

from .preflight import UsageError

AUTH_STATUSES = ("401", "403", "UNAUTHENTICATED", "PERMISSION_DENIED")


@dataclass
class Sent:
    """What one run of the command did."""

    directories: int = 0
    batches: int = 0
    events: int = 0
    dropped: int = 0
    failed: str = ""  # why delivery stopped (the server unreachable), else ""


def send_orphan(orphan: Orphan, endpoint: str, token: Optional[str], out: TextIO, sent: Sent,
                timeout: float = 10.0) -> None:
    """Send ``orphan``'s batches in order; stops at the first retryable failure (``sent.failed``)."""
    target = endpoint or orphan.endpoint
    if not target:
        raise UsageError(f"{orphan.directory} does not say where its events were going: give --endpoint URL")
    spool = orphan.spool()
    transport = make_transport(Options(endpoint=target, token=token, connect_timeout=min(3.0, timeout),
                                       read_timeout=timeout))
    batches = events = 0
    try:
        while len(spool):
            batch = spool.peek()
            if batch is None:
                break
            try:
                transport.send(batch, timeout)
            except TransportError as exc:
                if exc.retryable:
                    sent.failed = f"{target} cannot take them now ({exc})"
                    break
                if str(exc.status or "") in AUTH_STATUSES:
                    raise UsageError(f"{target} refused the token ({exc}): give an ingest token of the run's "
                                     "project with --token (TRAINGUARD_TOKEN)") from None
                sent.dropped += len(batch)  # refused whole: re-sending cannot help
                out.write(f"dropped a batch of {len(batch)} events the server refused: {exc}\n")
            else:
                batches += 1
                events += len(batch)
            spool.pop()
    finally:
        transport.close()
    sent.directories += 1
    sent.batches += batches
    sent.events += events
    out.write(f"{Path(orphan.directory).name}: sent {events} events in {batches} batches to {target}"
              + (" (stopped: the rest is kept)" if sent.failed else "") + "\n")


def send_spool(root: Path, endpoint: str, token: Optional[str], out: TextIO) -> Sent:
    """Every dead process's directory under ``root``; see the module doc."""
    if not root.is_dir():
        raise UsageError(f"no spool directory at {root}: give the job's spool with --spool-dir DIR "
                         "(TRAINGUARD_SPOOL_DIR of the job)")
    sent = Sent()
    parents = sorted(p for p in root.iterdir() if p.is_dir())
    for parent in parents:
        for orphan in find_orphans(str(parent)):
            try:
                if not sent.failed:
                    send_orphan(orphan, endpoint, token, out, sent)
            finally:
                orphan.release()
    return sent


def cmd_spool(args: argparse.Namespace) -> int:
    root = Path(args.spool_dir or os.environ.get("TRAINGUARD_SPOOL_DIR") or default_spool_dir())
    endpoint = args.endpoint or ""
    sent = send_spool(root, endpoint, args.token or os.environ.get("TRAINGUARD_TOKEN"), sys.stdout)
    if sent.failed:
        print(f"trainguard spool: not everything was sent: {sent.failed}; what is left stays in {root}",
              file=sys.stderr)
        return 1
    print(f"sent {sent.events} events from {sent.directories} spool directories of finished processes"
          + (f"; dropped {sent.dropped} the server refused" if sent.dropped else ""))
    return 0


def add_spool_parser(sub: Any) -> None:
    spool = sub.add_parser("spool", help="send what SDK processes left in a spool directory",
                           description=__doc__.split("\n\n")[1] if __doc__ else None)
    spool.add_argument("action", choices=["send"])
    spool.add_argument("--spool-dir", help="the job's SDK spool (TRAINGUARD_SPOOL_DIR; default "
                       "~/.cache/trainguard/spool)")
    spool.add_argument("--endpoint", help="where to send (default: where each process was sending; "
                       "http(s)://host:4318 or grpc(s)://host:4317)")
    spool.add_argument("--token", help="ingest token (TRAINGUARD_TOKEN)")
    spool.set_defaults(func=cmd_spool)


__all__: List[str] = ["Sent", "add_spool_parser", "send_spool"]
