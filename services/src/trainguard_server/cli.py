"""``trainguard`` command line: serve, demo, token (admin), replay (import a run that had no SDK)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from .config import Settings


def _overrides(args: argparse.Namespace) -> Dict[str, Any]:
    """The settings given as flags (the rest come from TRAINGUARD_* variables)."""
    return {k: v for k, v in {"data_dir": getattr(args, "data_dir", None),
                              "host": getattr(args, "host", None),
                              "http_port": getattr(args, "http_port", None),
                              "grpc_port": getattr(args, "grpc_port", None),
                              "roles": getattr(args, "roles", None),
                              "processor_runtime": getattr(args, "processor_runtime", None)}.items()
            if v is not None}


def _settings(args: argparse.Namespace) -> Settings:
    """Settings from flags over the environment; UsageError (one line, exit 2) naming a refused value."""
    from .preflight import settings_from

    return settings_from(_overrides(args))


def _detection_where(server: Any) -> str:
    """Where the detection pipeline runs, for serve's banner: in worker processes (processor_workers) or in
    the processor's own thread."""
    if server.settings.processor_runtime == "flink":
        return "detection in the Flink job"
    pool = getattr(server.processor, "pool", None)
    if pool is not None:
        return f"detection in {len(pool.workers)} worker processes (TRAINGUARD_PROCESSOR_WORKERS)"
    return "detection in the processor's thread"


def cmd_serve(args: argparse.Namespace) -> int:
    from .preflight import UsageError, check_serve, port_error
    from .server import DataDirInUse, EmbeddedServer
    from .storage.sqlite import StoreOpenError

    settings = _settings(args)
    check_serve(settings, flagged=_overrides(args))
    server = EmbeddedServer(settings)
    try:
        server.start()
    except (DataDirInUse, StoreOpenError) as exc:  # another serve on the directory, a damaged file
        raise UsageError(str(exc)) from None
    except OSError as exc:  # a port taken between the check and the bind
        if exc.errno is None:
            raise
        raise UsageError(str(port_error(exc, settings.host, settings.http_port, "HTTP",
                                        "--http-port N (TRAINGUARD_HTTP_PORT)"))) from None
    tokens = server.tokens
    assert tokens is not None
    roles = server.roles
    lines = [f"TrainGuard serving ({', '.join(roles)}): data in {server.data_dir}"]
    if "api" in roles:
        lines.append(f"  dashboard          {server.http_url}/ui/")
    if "gateway" in roles or "api" in roles:
        what = " + ".join(w for w, r in (("HTTP ingest", "gateway"), ("API", "api")) if r in roles)
        lines.append(f"  {what:<18} {server.http_url}   (OpenAPI: {server.http_url}/docs)")
    if "gateway" in roles:
        lines.append(f"  gRPC ingest        {server.grpc_url}")
    if "processor" in roles:
        st = server.settings
        lines.append(f"  processor          queue {st.queue} -> events {st.event_store}, "
                     f"metrics {st.metric_store}; {_detection_where(server)}")
    lines += [f"  project {tokens.project!r}: ingest token {tokens.ingest}",
              f"                      read token   {tokens.read}",
              f"  tokens are kept in {server.data_dir / 'bootstrap-tokens.json'} (mode 0600); more: "
              f"trainguard token create --data-dir {server.data_dir} --kind read"]
    print("\n".join(lines), flush=True)
    code = server.serve_forever()
    if code == 0:
        print("stopped: queue drained, state checkpointed", flush=True)
    else:
        print("stopped: NOT everything was committed (see the log above); it stays queued for the next "
              "start", flush=True)
    return code


def cmd_demo(args: argparse.Namespace) -> int:
    from .demo.runner import run_demo

    return run_demo(data_dir=args.data_dir, quick=args.quick)


def _token_store(settings: Settings, creates: bool) -> Path:
    """The data directory of a server's token store; UsageError when none is there (a typo'd or default
    ``--data-dir`` would otherwise list nothing and exit 0), unless ``creates``: ``token create --project``
    makes the store (projects and tokens made before the server's first start)."""
    from .preflight import UsageError
    from .storage.sqlite import PROJECTS_DB

    data_dir = Path(settings.data_dir)
    if settings.state_store == "sqlite" and not (data_dir / PROJECTS_DB).is_file() and not creates:
        raise UsageError(f"no token store in {data_dir} (no {PROJECTS_DB}): give the server's directory with "
                         "--data-dir DIR (the 'data in DIR' line `trainguard serve` printed; "
                         "TRAINGUARD_DATA_DIR)")
    return data_dir


def _default_project(data_dir: Path) -> str:
    """The project of the data directory's bootstrap tokens (what ``serve`` created at first start)."""
    from .preflight import UsageError
    from .server import TOKENS_FILE

    try:
        return str(json.loads((data_dir / TOKENS_FILE).read_text(encoding="utf-8"))["project"])
    except (OSError, ValueError, KeyError, TypeError):
        raise UsageError(f"token create needs --project P (no bootstrap project in {data_dir / TOKENS_FILE})"
                         ) from None


def cmd_token(args: argparse.Namespace) -> int:
    """Tokens in the state store the settings name: the data directory's ``projects.db``, or PostgreSQL
    under ``TRAINGUARD_STATE_STORE=postgres`` (where every pod reads them)."""
    from .preflight import UsageError
    from .storage.base import format_ns
    from .storage.select import open_state_stores

    settings = _settings(args)
    data_dir = _token_store(settings, creates=args.action == "create" and bool(args.project))
    project = args.project or (_default_project(data_dir) if args.action == "create" else None)
    try:
        incidents, projects = open_state_stores(settings, data_dir)
    except (ValueError, RuntimeError) as exc:  # no DSN, PostgreSQL unreachable, a newer schema
        if settings.state_store != "postgres":
            raise
        raise UsageError(str(exc)) from None
    where = (f"PostgreSQL schema {settings.postgres_schema!r}" if settings.state_store == "postgres"
             else str(data_dir))
    try:
        if args.action == "create":
            expires = time.time_ns() + int(parse_duration(args.expires_in) * 1e9) if args.expires_in else 0
            token = projects.create_token(project or "", args.kind, args.description or "",
                                          expires_ns=expires)
            print(token)
        elif args.action == "list":
            infos = list(projects.list_tokens(project))
            if not infos:
                print(f"no tokens{f' of project {project!r}' if project else ''} in {where}",
                      file=sys.stderr)
            for info in infos:
                state = "revoked" if info.revoked else "expired" if info.expired() else "active"
                until = f"until {format_ns(info.expires_ns)}" if info.expires_ns else "no expiry"
                print(f"{info.token_id}\t{info.project}\t{info.kind}\t{state}\t{until}\t{info.description}")
        elif args.action == "revoke":
            if not projects.revoke(args.token_id):
                print(f"no such token: {args.token_id}", file=sys.stderr)
                return 1
            print(f"revoked {args.token_id}")
    finally:
        projects.close()
        incidents.close()
    return 0


_DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_duration(text: str) -> float:
    """``"90s"``, ``"15m"``, ``"12h"``, ``"30d"``, ``"2w"`` → seconds (> 0); ValueError with the forms."""
    m = _DURATION_RE.match(text)
    if m is None or float(m.group(1)) <= 0:
        raise ValueError(f"a duration is a positive number with a unit s, m, h, d or w (e.g. 30d), "
                         f"got {text!r}")
    return float(m.group(1)) * _UNIT_S[m.group(2)]


def _rank_value(text: str, what: str) -> Tuple[int, str]:
    """``RANK=VALUE`` → (rank, value); ValueError naming the flag otherwise."""
    rank, sep, value = text.partition("=")
    if not sep or not rank.strip().isdigit() or not value.strip():
        raise ValueError(f"{what} wants RANK=VALUE (e.g. 1={'rank1.log' if 'log' in what else '137'}), "
                         f"got {text!r}")
    return int(rank), value.strip()


def _replay_options(args: argparse.Namespace) -> Any:
    """The ReplayOptions of the parsed ``replay`` flags; ValueError with a message for the user."""
    from .replay import ReplayOptions
    from .replay.signals import parse_map_rule
    from .replay.times import parse_time_value

    metrics = [(0, Path(p)) for p in args.metrics or []]
    metrics += [(r, Path(p)) for r, p in (_rank_value(t, "--metrics-rank") for t in args.metrics_rank or [])]
    logs = [(0, Path(p)) for p in args.log or []]
    logs += [(r, Path(p)) for r, p in (_rank_value(t, "--log-rank") for t in args.log_rank or [])]
    if not metrics and not logs and not getattr(args, "inputs", None):
        raise ValueError("nothing to import: give PATH (a metrics file, run folder or tree of runs), "
                         "--metrics and/or --log (or their -rank forms)")
    if not args.run_id and not getattr(args, "inputs", None):
        raise ValueError("--run-id is required unless PATH is given (then run ids derive from the paths)")
    for _, path in metrics + logs:
        if not path.is_file():
            raise ValueError(f"no such file: {path}")
    exit_codes = {}
    for text in args.exit_code_rank or []:
        rank, value = _rank_value(text, "--exit-code-rank")
        exit_codes[rank] = int(value)
    tags = {}
    for text in args.tag or []:
        key, sep, value = text.partition("=")
        if not sep or not key:
            raise ValueError(f"--tag wants KEY=VALUE, got {text!r}")
        tags[key] = value
    end_time_ns = None
    if args.end_time:
        end_time_ns = parse_time_value(args.end_time)
        if end_time_ns is None:
            raise ValueError(f"--end-time: not an ISO 8601 time or unix timestamp: {args.end_time!r}")
    if args.step_seconds <= 0:
        raise ValueError("--step-seconds must be > 0")
    if args.batch_size < 1:
        raise ValueError("--batch-size must be >= 1")
    return ReplayOptions(
        run_id=args.run_id or "", run_name=args.run_name or "", project=args.project or "", metrics=metrics,
        logs=logs, exit_code=args.exit_code, exit_codes=exit_codes, world_size=args.world_size,
        mapping=[parse_map_rule(t) for t in args.map or []], auto_map=not args.no_auto_map,
        step_field=args.step_field, time_field=args.time_field, step_seconds=args.step_seconds,
        end_time_ns=end_time_ns, min_log_level="" if args.log_level == "all" else args.log_level,
        host=args.host or "", tags=tags, batch_size=args.batch_size, tail_lines=max(0, args.tail_lines))


def cmd_replay(args: argparse.Namespace) -> int:
    from .preflight import check_reachable
    from .replay import Importer, LocalBackend, RemoteBackend, wait_for_run
    from .replay.backends import Backend, DryRunBackend
    from .replay.report import Progress, print_status, print_summary
    from .replay.sources.discover import import_runs

    try:
        options = _replay_options(args)
        endpoint = args.endpoint or os.environ.get("TRAINGUARD_ENDPOINT")
        if args.data_dir and args.endpoint:
            raise ValueError("give --endpoint or --data-dir, not both")
        backend: Backend
        if args.dry_run:
            backend = DryRunBackend()
        elif args.data_dir:
            backend = LocalBackend(Path(args.data_dir), project=args.project, token=args.token)
        elif endpoint:
            check_reachable(endpoint, "--endpoint URL, TRAINGUARD_ENDPOINT")  # at once, not after retries
            backend = RemoteBackend(endpoint, args.token or os.environ.get("TRAINGUARD_TOKEN"),
                                    read_token=args.read_token or os.environ.get("TRAINGUARD_READ_TOKEN"),
                                    api=args.api, user_agent="trainguard-replay")
        else:
            raise ValueError("where to? give --endpoint URL --token T (a running backend) or --data-dir D")
    except ValueError as exc:
        print(f"trainguard replay: {exc}", file=sys.stderr)
        return 2
    if args.inputs:
        try:
            return import_runs(args.inputs, args.format, options, backend, quiet=args.quiet,
                               wait=not args.no_wait and not args.dry_run, wait_timeout=args.wait_timeout)
        except ValueError as exc:
            print(f"trainguard replay: {exc}", file=sys.stderr)
            return 2
        finally:
            backend.close()
    progress = Progress(sys.stderr, enabled=not args.quiet)
    try:
        summary = Importer(options, backend, progress=progress).run()
        progress.finish()
        print_summary(summary, sys.stdout)
        if summary.accepted and not args.no_wait and not args.dry_run:
            if backend.can_report:
                if not args.quiet:
                    print(f"waiting up to {args.wait_timeout:g} s for the backend to process run "
                          f"{options.run_id} (--no-wait: do not wait)", file=sys.stderr, flush=True)
                run, complete = wait_for_run(backend, summary, timeout_s=args.wait_timeout)
                incidents = backend.incidents(options.run_id) if run is not None else []
                print_status(run, incidents, sys.stdout, complete=complete, origins=summary.origins)
            else:
                backend.finish()
                print("not waiting for the result: give --read-token (and --api for a gRPC endpoint) to "
                      "see the run's status and incidents")
        sys.stdout.flush()
    finally:
        backend.close()
    return 0 if summary.ok else 1


REPLAY_EPILOG = """\
PATH: a metrics file, a run folder or a tree of runs, in any of the formats: TensorBoard event files,
W&B run folders (.wandb / wandb-history.jsonl), MLflow file store runs (mlruns/), HF Trainer
trainer_state.json, Lightning CSVLogger metrics.csv (any CSV), Megatron-LM and DeepSpeed text logs,
JSON lines (detected by shape; --format to say). A tree imports every run found, one run id each
(deterministic: re-importing changes nothing). Field names and units are recognised by a synonym
table (docs/replay-formats.md); the summary says which field each signal came from, what is missing
and what was ignored, and why. --dry-run prints that without importing.

metrics JSON-lines: one object per step; the step is the first of step, global_step,
trainer/global_step, iteration, iter, _step (or --step-field); the time the first of time, timestamp,
_timestamp, wall_time, walltime, time_unix_nano holding a unix time (s/ms/us/ns) or ISO 8601 text
(or --time-field); a "rank" field routes the object to that rank. Other numeric fields are metrics,
nested objects are flattened with "/", NaN/Infinity and "nan"/"inf" are values.

automatic renames (off with --no-auto-map): the synonym table of docs/replay-formats.md -- e.g.
train/loss, lm loss -> loss; grad_norm -> grad/global_norm; grad_norm/<layer> -> grad/layer/<layer>;
lr, learning_rate -> opt/lr; loss_scale -> amp/scale; peak_memory_mib -> mem/max_allocated (bytes);
step_time_ms -> time/step_s; booleans are 0/1.

examples:
  trainguard replay --data-dir ./tg-data ./runs/            # every run under ./runs, any format
  trainguard replay --dry-run lightning_logs/version_0/metrics.csv
  trainguard replay --data-dir ./tg-data --run-id job-42 --metrics metrics.jsonl --log train.log \\
      --exit-code 1
  trainguard replay --endpoint http://127.0.0.1:4318 --token $INGEST --read-token $READ \\
      --run-id job-43 --metrics-rank 0=r0.jsonl --metrics-rank 1=r1.jsonl --log torchrun.log \\
      --exit-code 1 --exit-code-rank 1=137 --map 'val/ppl=eval/perplexity' --map 'epoch='
"""


def _add_replay(sub: Any) -> None:
    replay = sub.add_parser(
        "replay", help="import finished runs that had no SDK: TensorBoard, W&B, MLflow, HF, Lightning, "
                       "Megatron/DeepSpeed logs, JSON-lines/CSV metrics, logs, exit codes",
        description="Import a finished run (metrics JSON-lines, log files, exit codes, optionally per\n"
                    "rank) as a TrainGuard run and run detection on it. Re-importing the same files under\n"
                    "the same --run-id changes nothing (event ids derive from run, rank, file and line).",
        epilog=REPLAY_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    what = replay.add_argument_group("the run")
    replay.add_argument("inputs", nargs="*", metavar="PATH", type=Path,
                        help="metrics file, run folder or tree of runs (formats: see below)")
    replay.add_argument("--format", default="", help="the format of every PATH (default: detected): "
                        "tensorboard, mlflow, wandb, hf-trainer, hf-log, megatron, deepspeed, csv, jsonl")
    replay.add_argument("--dry-run", action="store_true", help="read and recognise, print what would be "
                        "imported (per signal its field, what is missing, what is ignored), send nothing")
    what.add_argument("--run-id", help="the run's id (re-use it to re-import idempotently; with PATH: the "
                      "prefix of the run ids, default derived from the paths)")
    what.add_argument("--run-name", help="display name (default: the run id)")
    what.add_argument("--project",
                      help="project (default: the token's; with --data-dir its bootstrap project)")
    what.add_argument("--metrics", action="append", metavar="FILE", help="metrics JSON-lines of rank 0 "
                      "(repeatable; objects with a \"rank\" field go to that rank)")
    what.add_argument("--metrics-rank", action="append", metavar="RANK=FILE", help="metrics of one rank")
    what.add_argument("--log", action="append", metavar="FILE", help="log file (stdout/stderr) of rank 0 "
                      "-- or, with no rank prefix, of the one rank its text names as its own; "
                      "[rankN]: prefixed lines go to rank N (repeatable)")
    what.add_argument("--log-rank", action="append", metavar="RANK=FILE", help="log file of one rank")
    what.add_argument("--exit-code", type=int, help="every rank's exit code (default: 1 for a rank whose "
                      "log has a traceback, else 0; 128+N = killed by signal N)")
    what.add_argument("--exit-code-rank", action="append", metavar="RANK=CODE", help="one rank's exit code")
    what.add_argument("--world-size", type=int, help="number of ranks (default: highest rank seen + 1)")
    what.add_argument("--host", help="host name to record")
    what.add_argument("--tag", action="append", metavar="KEY=VALUE", help="tag for the run (repeatable)")
    fields = replay.add_argument_group("fields and times")
    fields.add_argument("--map", action="append", metavar="SOURCE=TARGET[*FACTOR]",
                        help="rename a metric (after flattening); 'prefix/*=new/*' renames a prefix; an "
                             "empty TARGET drops the field; '*FACTOR' multiplies the value "
                             "('gpu_mem_mb=mem/allocated*1048576'); wins over the automatic renames "
                             "(repeatable)")
    fields.add_argument("--no-auto-map", action="store_true", help="keep field names as they are")
    fields.add_argument("--step-field", help="the field that holds the step")
    fields.add_argument("--time-field", help="the field that holds the time (unit by magnitude: s/ms/us/ns)")
    fields.add_argument("--step-seconds", type=float, default=1.0,
                        help="spacing of steps when the file has no times (default 1.0)")
    fields.add_argument("--end-time", help="time of the last step when the file has no times (ISO 8601 "
                        "or unix seconds; default: the logs' last timestamp, else the file's "
                        "modification time)")
    fields.add_argument("--log-level", default="WARNING",
                        choices=["all", "DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"],
                        help="keep log lines at or above this level (default WARNING, as the SDK forwards; "
                             "tracebacks and lines the classifier recognises -- a watchdog timeout, an "
                             "OOM, NCCL errors printed without a level -- are always kept; 'all' keeps "
                             "every line)")
    fields.add_argument("--tail-lines", type=int, default=50,
                        help="a log of which no line is kept sends its last N lines instead, so the run "
                             "shows what the job printed last (default 50; 0: none)")
    where = replay.add_argument_group("where to")
    where.add_argument("--endpoint", help="ingest URL of a running backend: http(s)://host:4318 or "
                       "grpc(s)://host:4317 (TRAINGUARD_ENDPOINT)")
    where.add_argument("--token", help="ingest token (TRAINGUARD_TOKEN); optional with --data-dir")
    where.add_argument("--data-dir", help="write into this embedded data directory with an in-process "
                       "gateway and processor (no server; not while a server uses it)")
    where.add_argument("--read-token", help="read token, to wait for and print the result over the query API "
                       "(TRAINGUARD_READ_TOKEN)")
    where.add_argument("--api", help="query API base URL (default: the endpoint when it is HTTP)")
    where.add_argument("--batch-size", type=int, default=500, help="envelopes per request (default 500)")
    where.add_argument("--no-wait", action="store_true", help="do not wait for the result")
    where.add_argument("--wait-timeout", type=float, default=120.0,
                       help="seconds to wait for it (default 120)")
    where.add_argument("--quiet", action="store_true", help="no progress display")
    replay.set_defaults(func=cmd_replay)


def version_line() -> str:
    """``trainguard 0.1.0 (trainguard-server 0.1.0, trainguard-engine 0.1.0, SDK 0.1.0; Python 3.11.7)``."""
    import platform
    from importlib import metadata

    from trainguard import __version__ as sdk
    from trainguard_server import __version__ as server

    try:
        engine = metadata.version("trainguard-engine")
    except metadata.PackageNotFoundError:
        engine = "?"
    return (f"trainguard {server} (trainguard-server {server}, trainguard-engine {engine}, SDK {sdk}; "
            f"Python {platform.python_version()})")


class _Version(argparse.Action):
    """``--version``: one unwrapped line (argparse's own action wraps it to the terminal)."""

    def __call__(self, parser: argparse.ArgumentParser, *_: Any) -> None:
        print(version_line())
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trainguard", description="TrainGuard backend")
    parser.add_argument("--version", action=_Version, nargs=0, help="print the versions and exit")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run gateway + queue + processor + stores + API in one process")
    serve.add_argument("--data-dir", help="where the embedded stores live (TRAINGUARD_DATA_DIR)")
    serve.add_argument("--host", help="interface to bind (TRAINGUARD_HOST)")
    serve.add_argument("--http-port", type=int, help="HTTP ingest + API port (TRAINGUARD_HTTP_PORT)")
    serve.add_argument("--grpc-port", type=int, help="gRPC ingest port (TRAINGUARD_GRPC_PORT)")
    serve.set_defaults(func=cmd_serve)
    for role, text in (("gateway", "gRPC + HTTP ingest only: publishes to the queue (TRAINGUARD_QUEUE)"),
                       ("processor", "the processor only: queue -> pipeline -> stores"),
                       ("api", "the query API only, over the stores")):
        one = sub.add_parser(role, help=text)
        one.add_argument("--data-dir", help="SQLite stores (incidents, tokens) shared by the processes")
        one.add_argument("--host", help="interface to bind (TRAINGUARD_HOST)")
        if role != "processor":
            one.add_argument("--http-port", type=int, help="HTTP port (TRAINGUARD_HTTP_PORT)")
        if role == "gateway":
            one.add_argument("--grpc-port", type=int, help="gRPC ingest port (TRAINGUARD_GRPC_PORT)")
        if role == "processor":
            one.add_argument("--runtime", dest="processor_runtime", choices=["embedded", "flink"],
                             help="embedded: run the pipeline here; flink: the Flink job runs it, this "
                                  "stores its results (TRAINGUARD_PROCESSOR_RUNTIME)")
        one.set_defaults(func=cmd_serve, roles=role)

    demo = sub.add_parser("demo", help="start the embedded server and watch real failing trainings")
    demo.add_argument("--data-dir", default=".data/demo", help="demo data (wiped at start)")
    demo.add_argument("--quick", action="store_true", help="fewer, shorter trainings (tests)")
    demo.set_defaults(func=cmd_demo)

    token = sub.add_parser("token", help="create, list or revoke project tokens")
    token.add_argument("action", choices=["create", "list", "revoke"])
    token.add_argument("--project", default=None,
                       help="create: default the server's bootstrap project (bootstrap-tokens.json)")
    token.add_argument("--kind", choices=["ingest", "read"], default="ingest")
    token.add_argument("--description", default="")
    token.add_argument("--expires-in", default=None, metavar="DURATION",
                       help="create: the token stops working after this long (90s, 15m, 12h, 30d, 2w)")
    token.add_argument("--token-id", dest="token_id", default=None)
    token.add_argument("--data-dir", help="the server's data directory (TRAINGUARD_DATA_DIR; default "
                       ".data/trainguard, as trainguard serve)")
    token.set_defaults(func=cmd_token)

    _add_replay(sub)
    from .agent.cli import add_agent_parser
    from .gate.cli import add_gate_parser
    from .look import add_look_parsers
    from .spool_send import add_spool_parser

    add_agent_parser(sub)
    add_gate_parser(sub)
    add_spool_parser(sub)
    add_look_parsers(sub)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    args = build_parser().parse_args(argv)
    from .preflight import UsageError

    if args.command == "token" and args.action == "revoke" and not args.token_id:
        print("trainguard token: token revoke needs --token-id ID (trainguard token list shows them)",
              file=sys.stderr)
        return 2
    if args.command == "token" and args.expires_in is not None:
        try:
            parse_duration(args.expires_in)
        except ValueError as exc:
            print(f"trainguard token: --expires-in: {exc}", file=sys.stderr)
            return 2
    try:
        code: int = args.func(args)
    except UsageError as exc:  # what the operator got wrong, in one line: no traceback
        print(f"trainguard {args.command}: {exc}", file=sys.stderr)
        return 2
    return code


if __name__ == "__main__":
    sys.exit(main())
