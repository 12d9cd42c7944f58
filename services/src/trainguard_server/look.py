"""``trainguard runs`` and ``trainguard incidents RUN``: the runs and a run's incidents, in a terminal.

Contract: both read the query API at ``--api`` (default ``TRAINGUARD_API``, else an ``http(s)://``
``TRAINGUARD_ENDPOINT``, else ``http://127.0.0.1:4318``) with a read token (``--read-token`` /
``TRAINGUARD_READ_TOKEN``) and print one line per run / incident, newest activity first, the dashboard link
last. What stops them is said in one line and exit code 2 (no token, the API unreachable or refusing the
token, no such run); nothing is retried, so a stopped server answers at once. What the server stores comes
from training jobs, so a control character in it (an ANSI escape in an exception message) is printed as its
escape (``\\x1b``), never sent to the terminal; a run id is percent-encoded in the URL.
"""

from __future__ import annotations

import argparse
import os
import re
import time
import urllib.error
import urllib.parse
from typing import Any, Dict, List

from .api.read_client import ReadClient
from .preflight import UsageError

DEFAULT_API = "http://127.0.0.1:4318"
TIMEOUT_S = 10.0
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f]")


def _plain(value: Any) -> str:
    """``value`` as text a terminal shows as is: control characters spelled as escapes (``\\x1b``)."""
    return _CONTROL.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), str(value))


def api_base(given: str | None) -> str:
    """Where the query API is (see the module doc)."""
    if given:
        return given.rstrip("/")
    if os.environ.get("TRAINGUARD_API"):
        return os.environ["TRAINGUARD_API"].rstrip("/")
    endpoint = os.environ.get("TRAINGUARD_ENDPOINT", "")
    return endpoint.rstrip("/") if endpoint.startswith(("http://", "https://")) else DEFAULT_API


def _client(args: argparse.Namespace) -> ReadClient:
    token = args.read_token or os.environ.get("TRAINGUARD_READ_TOKEN")
    if not token:
        raise UsageError("needs a read token: --read-token T or TRAINGUARD_READ_TOKEN (trainguard token "
                         "create --data-dir DIR --kind read makes one)")
    return ReadClient(api_base(args.api), token, timeout=TIMEOUT_S, user_agent="trainguard-cli")


def _get(client: ReadClient, path: str, **params: Any) -> Any:
    """GET ``path``; every failure a UsageError naming the API and what to do."""
    try:
        return client.request("GET", path, **params)
    except urllib.error.HTTPError as exc:
        if exc.code == 404 and path.startswith("/api/v1/runs/"):
            raise UsageError(f"no run {path.split('/')[4]!r} at {client.base} (trainguard runs lists them)"
                             ) from None
        if exc.code in (401, 403):
            raise UsageError(f"{client.base} refused the read token ({exc.code}): give a read token of the "
                             "project with --read-token (TRAINGUARD_READ_TOKEN)") from None
        raise UsageError(f"{client.base}{path} answered {exc.code} {exc.reason}") from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise UsageError(f"cannot reach the TrainGuard API at {client.base} ({reason}): is trainguard serve "
                         "running there? (--api URL, TRAINGUARD_API)") from None


def _ago(ns: int) -> str:
    if ns <= 0:
        return "-"
    seconds = max(0.0, time.time() - ns / 1e9)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f}{unit} ago"
    return f"{seconds:.0f}s ago"


def _table(rows: List[List[str]]) -> str:
    rows = [[_plain(cell) for cell in row] for row in rows]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)


def cmd_runs(args: argparse.Namespace) -> int:
    client = _client(args)
    page: Dict[str, Any] = _get(client, "/api/v1/runs", status=args.status, limit=args.limit)
    items = page.get("items", [])
    if not items:
        print(f"no runs{f' with status {args.status}' if args.status else ''} at {client.base}")
        return 0
    rows = [["RUN", "NAME", "STATUS", "HEALTH", "STEP", "OPEN", "LAST SEEN"]]
    rows += [[r["run_id"], r.get("run_name") or "-", r["status"], r.get("health", "-"),
              str(r.get("last_step", -1)), str(r.get("open_incidents", 0)),
              _ago(int(r.get("last_event_ns", 0)))] for r in items]
    print(_table(rows))
    print(f"dashboard: {client.base}/ui/#/runs")
    return 0


def cmd_incidents(args: argparse.Namespace) -> int:
    client = _client(args)
    segment = urllib.parse.quote(args.run_id, safe="")
    run = _get(client, f"/api/v1/runs/{segment}")
    page: Dict[str, Any] = _get(client, f"/api/v1/runs/{segment}/incidents")
    items = [i for i in page.get("items", []) if not i.get("explained_by")]
    print(_plain(f"run {run['run_id']} ({run.get('run_name') or '-'}): {run['status']}, "
                 f"{run.get('health', '-')}, last step {run.get('last_step', -1)}"))
    if not items:
        print("no incidents")
    else:
        rows = [["SEVERITY", "KIND", "FROM STEP", "RANK", "STATUS", "TITLE"]]
        rows += [[i["severity"].upper(), f"{i['category']}/{i['subtype']}", str(i.get("first_step", -1)),
                  str(i.get("lead_rank", -1)), i.get("status", "-"), i.get("title", "")] for i in items]
        print(_table(rows))
        for incident in items[:1]:
            for check in incident.get("checks", [])[:3]:
                print(_plain(f"  check first: {check}"))
    print(f"dashboard: {client.base}/ui/#/runs/{segment}")
    return 0


def add_look_parsers(sub: Any) -> None:
    for name, text in (("runs", "list the runs (newest activity first)"),
                       ("incidents", "a run's incidents, with what to check first")):
        one = sub.add_parser(name, help=text, description=__doc__.split("\n\n")[1] if __doc__ else None)
        if name == "incidents":
            one.add_argument("run_id", metavar="RUN", help="the run's id (trainguard runs lists them)")
        else:
            one.add_argument("--status", choices=["running", "finished", "failed", "stalled", "lost"])
            one.add_argument("--limit", type=int, default=20, help="most runs shown (default 20)")
        one.add_argument("--api", help=f"query API base URL (TRAINGUARD_API; default {DEFAULT_API})")
        one.add_argument("--read-token", help="read token (TRAINGUARD_READ_TOKEN)")
        one.set_defaults(func=cmd_runs if name == "runs" else cmd_incidents)


__all__ = ["add_look_parsers", "api_base"]

