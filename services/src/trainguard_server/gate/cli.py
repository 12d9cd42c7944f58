"""``trainguard gate``: define a baseline and/or gate a canary run against it, over the query API
(``--api``/``--read-token``) or straight on a data directory (``--data-dir``); writes a markdown summary
and JUnit XML for CI. Exit codes: 0 pass (warnings included), 1 fail, 2 could not decide (the reason is
printed: unknown baseline or run, a run still running, too little data, a bad policy, an unreachable API)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

from . import report
from .policy import defaults_table, policy_from_dict

EPILOG = """\
examples:
  # define the baseline once from healthy runs tagged gate=mlp-main, then gate each canary run
  trainguard gate --api http://tg:4318 --read-token $READ --baseline mlp-main --baseline-tag gate=mlp-main
  trainguard gate --api http://tg:4318 --read-token $READ --baseline mlp-main --candidate $RUN_ID \\
      --policy gate.yaml --markdown gate.md --junit gate.xml
  # the same on an embedded data directory (no server needed)
  trainguard gate --data-dir ./tg-data --baseline mlp-main --candidate $RUN_ID
  # every policy key with its default and meaning
  trainguard gate --policy-defaults

exit codes: 0 pass (warnings included), 1 fail, 2 could not decide (reason printed)
"""


def _load_policy(path: Optional[str]) -> Optional[Dict[str, Any]]:
    """The policy file's mapping (YAML or JSON), validated; None without a file. ValueError otherwise."""
    if not path:
        return None
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise ValueError(f"cannot read the policy file {path}: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise ValueError(f"the policy file {path} is not valid YAML: {exc}") from None
    if data is None:
        return None
    if not isinstance(data, dict):
        raise ValueError(f"the policy file {path} must hold a mapping of sections, got {type(data).__name__}")
    policy_from_dict(data)  # validated here, so a typo stops the job before any request
    return data


class _Local:
    """The gate on an embedded data directory (the same service the API route runs)."""

    def __init__(self, data_dir: Path, project: Optional[str]) -> None:
        from ..config import Settings
        from ..replay.backends import default_project
        from ..storage.select import open_stores
        from .service import GateService

        if not data_dir.is_dir():
            raise ValueError(f"no such data directory: {data_dir}")
        self.stores = open_stores(Settings(data_dir=data_dir), data_dir)
        self.project = project or default_project(data_dir)
        stores = self.stores
        self.service = GateService(stores.incidents, stores.metrics, stores.events, self.project)

    def define(self, name: str, body: Dict[str, Any]) -> Dict[str, Any]:
        from ..api.routes.gate import _public

        policy = policy_from_dict(body.get("policy"))
        baseline = self.service.define(name, policy, tag=body.get("tag", ""), runs=body.get("runs", []),
                                       description=body.get("description", ""))
        return _public(baseline).model_dump()

    def get_baseline(self, name: str) -> Optional[Dict[str, Any]]:
        from ..api.routes.gate import _public

        baseline = self.service.get(name)
        return _public(baseline).model_dump() if baseline else None

    def run_status(self, run_id: str) -> Optional[str]:
        return self.service.reader.status(run_id)

    def gate(self, baseline: str, candidate: str, policy: Optional[Dict[str, Any]]) -> Dict[str, Any]:
        effective = policy_from_dict(policy)
        verdict = self.service.gate(baseline, candidate, effective).to_dict()
        verdict["policy"] = effective.to_dict()
        return verdict

    def close(self) -> None:
        self.stores.close()


class _Remote:
    def __init__(self, api: str, token: str) -> None:
        from .client import GateClient

        self.client = GateClient(api, token)

    def define(self, name: str, body: Dict[str, Any]) -> Dict[str, Any]:
        return self.client.define_baseline(name, body)

    def get_baseline(self, name: str) -> Optional[Dict[str, Any]]:
        return self.client.get_baseline(name)

    def run_status(self, run_id: str) -> Optional[str]:
        return self.client.run_status(run_id)

    def gate(self, baseline: str, candidate: str, policy: Optional[Dict[str, Any]]) -> Dict[str, Any]:
        return self.client.gate(baseline, candidate, policy)

    def close(self) -> None:
        pass


def _baseline_line(doc: Dict[str, Any]) -> str:
    profile = doc.get("profile") or {}
    runs = profile.get("runs") or []
    parts = [f"baseline {doc.get('name')!r} (project {doc.get('project')!r}): {len(runs)} usable run(s)"
             + (f" of {len(doc.get('runs') or [])}" if len(doc.get("runs") or []) != len(runs) else "")]
    for run, why in (profile.get("excluded") or {}).items():
        parts.append(f"  left out {run}: {why}")
    loss = profile.get("loss")
    if loss:
        parts.append(f"  loss envelope: {loss['metric']} ({loss['transform']}), {loss['matched_steps']} "
                     f"matched steps {loss['first_step']:g}-{loss['last_step']:g}")
    for name in ("step_time", "peak_memory"):
        if profile.get(name):
            parts.append(f"  {name}: {profile[name]['metric']} median {profile[name]['median']:.6g}")
    kinds = profile.get("incident_kinds") or {}
    parts.append(f"  incidents: {', '.join(f'{k} x{v}' for k, v in kinds.items()) or 'none'}; "
                 f"fingerprints: {profile.get('fingerprints', 0)}")
    parts += [f"  note: {n}" for n in profile.get("notes") or []]
    return "\n".join(parts)


def _wait(status: Callable[[str], Optional[str]], run_id: str, timeout_s: float) -> Optional[str]:
    """The run's status once it is known and no longer running, or the last seen after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        current = status(run_id)
        if current is not None and current != "running":
            return current
        if time.monotonic() >= deadline:
            return current
        time.sleep(min(1.0, max(0.05, deadline - time.monotonic())))


def _write(path: Optional[str], text: str) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(text, encoding="utf-8")


def _undecided(args: argparse.Namespace, reason: str) -> Dict[str, Any]:
    return {"verdict": "undecided", "exit_code": 2, "reason": reason, "baseline": args.baseline or "",
            "candidate": args.candidate or "", "checks": [], "plot": {}, "notes": []}


def _finish(args: argparse.Namespace, verdict: Dict[str, Any]) -> int:
    _write(args.markdown, report.markdown(verdict))
    _write(args.junit, report.junit(verdict))
    _write(args.json, json.dumps(verdict, indent=1) + "\n")
    sys.stdout.write(report.text(verdict))
    sys.stdout.flush()
    return int(verdict.get("exit_code", 2))


def cmd_gate(args: argparse.Namespace) -> int:
    """``trainguard gate``: see the module doc and ``--help``."""
    if args.policy_defaults:
        for key, default, meaning in defaults_table():
            print(f"{key:<36} {json.dumps(default):<26} {meaning}")
        return 0
    if not args.baseline:
        print("trainguard gate: --baseline NAME is required", file=sys.stderr)
        return 2
    define_runs = [r.strip() for text in args.baseline_runs or [] for r in text.split(",") if r.strip()]
    defining = bool(args.baseline_tag or define_runs)
    api = args.api or os.environ.get("TRAINGUARD_API")
    token = args.read_token or os.environ.get("TRAINGUARD_READ_TOKEN")
    backend: Any = None
    try:
        if args.baseline_tag and define_runs:
            raise ValueError("give --baseline-tag or --baseline-runs, not both")
        policy = _load_policy(args.policy)
        if args.data_dir and args.api:
            raise ValueError("give --api or --data-dir, not both")
        if args.data_dir:
            backend = _Local(Path(args.data_dir), args.project)
        elif api:
            if not token:
                raise ValueError("--api needs a read token: --read-token or TRAINGUARD_READ_TOKEN")
            backend = _Remote(api, token)
        else:
            raise ValueError("where? give --api URL --read-token T (TRAINGUARD_API, TRAINGUARD_READ_TOKEN) "
                             "or --data-dir D")
    except ValueError as exc:
        print(f"trainguard gate: {exc}", file=sys.stderr)
        return _finish(args, _undecided(args, str(exc))) if args.candidate else 2
    from .client import GateClientError
    from .service import GateError

    doc: Optional[Dict[str, Any]] = None
    try:
        if defining:
            body = {"tag": args.baseline_tag or "", "runs": define_runs,
                    "description": args.description or "", "policy": policy}
            doc = backend.define(args.baseline, body)
            running = [r for r in doc.get("runs") or [] if backend.run_status(r) == "running"]
            if running:  # the canary that just exited may not be processed yet: wait, then profile again
                print(f"waiting up to {args.wait_timeout:g} s for {len(running)} baseline run(s) still "
                      f"running: {', '.join(running)}", flush=True)
                deadline = time.monotonic() + args.wait_timeout
                for run_id in running:
                    _wait(backend.run_status, run_id, max(0.0, deadline - time.monotonic()))
                doc = backend.define(args.baseline, body)
            print(_baseline_line(doc), flush=True)
        if not args.candidate:
            if not defining:
                doc = backend.get_baseline(args.baseline)
            if doc is None:
                print(f"trainguard gate: no baseline {args.baseline!r}", file=sys.stderr)
                return 2
            if not defining:
                print(_baseline_line(doc))
            usable = len((doc.get("profile") or {}).get("runs") or [])
            minimum = policy_from_dict(policy).baseline.min_runs
            if usable < minimum:
                print(f"trainguard gate: the baseline has {usable} usable run(s), the policy needs {minimum}",
                      file=sys.stderr)
                return 2
            return 0
        status = _wait(backend.run_status, args.candidate, args.wait_timeout)
        if status is None:
            return _finish(args, _undecided(args, f"no run {args.candidate!r} after waiting "
                                                  f"{args.wait_timeout:g} s (has the canary sent anything?)"))
        verdict = backend.gate(args.baseline, args.candidate, policy)
        return _finish(args, verdict)
    except (GateClientError, GateError, ValueError) as exc:
        print(f"trainguard gate: {exc}", file=sys.stderr)
        return _finish(args, _undecided(args, str(exc))) if args.candidate else 2
    finally:
        backend.close()


def add_gate_parser(sub: Any) -> None:
    """Register ``trainguard gate`` on the ``trainguard`` command's subparsers."""
    gate = sub.add_parser(
        "gate", help="CI gate: compare a canary run with a baseline's anomaly profile (exit 0 pass, 1 fail, "
                     "2 undecided)",
        description="Compare a canary run with a named baseline (a set of healthy runs summarised into a\n"
                    "profile: incident rates, stack fingerprints, the loss envelope with its noise band,\n"
                    "step time and peak memory) under a policy, and say pass / warn / fail / undecided.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    what = gate.add_argument_group("what")
    what.add_argument("--baseline", metavar="NAME", help="the baseline's name")
    what.add_argument("--candidate", metavar="RUN",
                      help="the canary's run id (without it: only define / show the baseline)")
    what.add_argument("--baseline-tag", metavar="KEY=VALUE", help="(re)define the baseline from the runs "
                      "with this tag (resolved now; later runs with the tag do not join)")
    what.add_argument("--baseline-runs", metavar="RUN,RUN", action="append",
                      help="(re)define the baseline from these runs (comma-separated, repeatable)")
    what.add_argument("--description", help="the baseline's description")
    what.add_argument("--policy", metavar="FILE",
                      help="policy overrides, YAML or JSON (see --policy-defaults)")
    what.add_argument("--policy-defaults", action="store_true",
                      help="print every policy key with its default and meaning, and exit")
    what.add_argument("--wait-timeout", type=float, default=120.0, metavar="S",
                      help="wait up to S seconds for the candidate to exist and end, and for baseline runs "
                           "being defined to end (default 120)")
    where = gate.add_argument_group("where")
    where.add_argument("--api", help="query API base URL, e.g. http://tg:4318 (TRAINGUARD_API)")
    where.add_argument("--read-token", help="read token (TRAINGUARD_READ_TOKEN)")
    where.add_argument("--data-dir", help="an embedded data directory instead of an API")
    where.add_argument("--project",
                       help="with --data-dir: the project (default: the data dir's bootstrap one)")
    out = gate.add_argument_group("reports")
    out.add_argument("--markdown", metavar="FILE", help="markdown summary with a plot (e.g. "
                     "$GITHUB_STEP_SUMMARY)")
    out.add_argument("--junit", metavar="FILE", help="JUnit XML, one test case per check")
    out.add_argument("--json", metavar="FILE", help="the verdict as JSON")
    gate.set_defaults(func=cmd_gate)


__all__: List[str] = ["add_gate_parser", "cmd_gate"]
