"""``trainguard`` command line: serve, demo, token (admin)."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import List, Optional

from .config import Settings


def _settings(args: argparse.Namespace) -> Settings:
    overrides = {k: v for k, v in {"data_dir": getattr(args, "data_dir", None),
                                   "host": getattr(args, "host", None),
                                   "http_port": getattr(args, "http_port", None),
                                   "grpc_port": getattr(args, "grpc_port", None)}.items() if v is not None}
    return Settings(**overrides)


def cmd_serve(args: argparse.Namespace) -> int:
    from .server import EmbeddedServer

    server = EmbeddedServer(_settings(args))
    server.start()
    tokens = server.tokens
    assert tokens is not None
    print(f"TrainGuard serving (embedded): data in {server.data_dir}\n"
          f"  HTTP ingest + API  {server.http_url}   (OpenAPI: {server.http_url}/docs)\n"
          f"  gRPC ingest        {server.grpc_url}\n"
          f"  project {tokens.project!r}: ingest token {tokens.ingest}\n"
          f"                      read token   {tokens.read}\n"
          f"  tokens are kept in {server.data_dir / 'bootstrap-tokens.json'} (mode 0600)", flush=True)
    server.serve_forever()
    print("stopped: queue drained, state checkpointed", flush=True)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from .demo.runner import run_demo

    return run_demo(data_dir=args.data_dir, quick=args.quick)


def cmd_token(args: argparse.Namespace) -> int:
    from .storage.sqlite import open_sqlite_stores

    stores = open_sqlite_stores(_settings(args).data_dir)
    try:
        projects = stores.projects
        if args.action == "create":
            token = projects.create_token(args.project, args.kind, args.description or "")
            print(token)
        elif args.action == "list":
            for info in projects.list_tokens(args.project):
                state = "revoked" if info.revoked else "active"
                print(f"{info.token_id}\t{info.project}\t{info.kind}\t{state}\t{info.description}")
        elif args.action == "revoke":
            if not projects.revoke(args.token_id):
                print(f"no such token: {args.token_id}", file=sys.stderr)
                return 1
            print(f"revoked {args.token_id}")
    finally:
        stores.close()
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trainguard", description="TrainGuard backend")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run gateway + queue + processor + stores + API in one process")
    serve.add_argument("--data-dir", help="where the embedded stores live (TRAINGUARD_DATA_DIR)")
    serve.add_argument("--host", help="interface to bind (TRAINGUARD_HOST)")
    serve.add_argument("--http-port", type=int, help="HTTP ingest + API port (TRAINGUARD_HTTP_PORT)")
    serve.add_argument("--grpc-port", type=int, help="gRPC ingest port (TRAINGUARD_GRPC_PORT)")
    serve.set_defaults(func=cmd_serve)

    demo = sub.add_parser("demo", help="start the embedded server and watch real failing trainings")
    demo.add_argument("--data-dir", default=".data/demo", help="demo data (wiped at start)")
    demo.add_argument("--quick", action="store_true", help="fewer, shorter trainings (tests)")
    demo.set_defaults(func=cmd_demo)

    token = sub.add_parser("token", help="create, list or revoke project tokens")
    token.add_argument("action", choices=["create", "list", "revoke"])
    token.add_argument("--project", default=None)
    token.add_argument("--kind", choices=["ingest", "read"], default="ingest")
    token.add_argument("--description", default="")
    token.add_argument("--token-id", dest="token_id", default=None)
    token.add_argument("--data-dir")
    token.set_defaults(func=cmd_token)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    args = build_parser().parse_args(argv)
    if args.command == "token" and args.action == "create" and not args.project:
        print("token create needs --project", file=sys.stderr)
        return 2
    if args.command == "token" and args.action == "revoke" and not args.token_id:
        print("token revoke needs --token-id", file=sys.stderr)
        return 2
    code: int = args.func(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
