"""Operator mistakes end in one line saying what is wrong and how to fix it, exit code 2, no traceback.

Every case checks the whole of stderr (one line, the exact text), so a traceback or a second line fails it.
A few run the real ``trainguard`` process (``python -m trainguard_server``: its exit status as a shell sees
it); the rest call the same ``main()`` in-process (an exception escaping it fails the test), which keeps the
file to a few seconds.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path
from typing import Dict, Iterator, Optional

import pytest

REPO = Path(__file__).resolve().parents[2]
OVERRIDES_HELP = 'python -c "from trainguard_engine.catalogue import settings_table as t; print(t())"'


def cli(*argv: str, env: Optional[Dict[str, str]] = None, cwd: Optional[Path] = None,
        timeout: float = 60) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD_")}
    full["PYTHONPATH"] = os.pathsep.join(str(REPO / d / "src") for d in ("sdk", "engine", "services"))
    full.update(env or {})
    return subprocess.run([sys.executable, "-m", "trainguard_server", *argv], capture_output=True, text=True,
                          env=full, cwd=cwd, timeout=timeout)


def in_process(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], *argv: str,
               env: Optional[Dict[str, str]] = None, cwd: Optional[Path] = None
               ) -> subprocess.CompletedProcess[str]:
    """``trainguard ARGV`` through ``main()`` here, as a CompletedProcess."""
    from trainguard_server.cli import main

    for key in [k for k in os.environ if k.startswith("TRAINGUARD_")]:
        monkeypatch.delenv(key)
    for key, value in (env or {}).items():
        monkeypatch.setenv(key, value)
    if cwd is not None:
        monkeypatch.chdir(cwd)
    capsys.readouterr()
    code = main(list(argv))
    out = capsys.readouterr()
    return subprocess.CompletedProcess(list(argv), code, out.out, out.err)


def one_line(done: subprocess.CompletedProcess[str], expected: str) -> None:
    """Exit 2, nothing on stdout, and stderr exactly ``expected`` (one line: no traceback)."""
    assert (done.returncode, done.stdout, done.stderr) == (2, "", expected + "\n")


@pytest.fixture()
def taken_port() -> Iterator[int]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def test_http_port_in_use(tmp_path: Path, taken_port: int) -> None:
    done = cli("serve", "--data-dir", str(tmp_path / "d"), "--http-port", str(taken_port), "--grpc-port", "0")
    one_line(done, f"trainguard serve: 127.0.0.1:{taken_port} (HTTP) is already in use: stop what listens "
                   "there or choose another port with --http-port (TRAINGUARD_HTTP_PORT)")
    assert not (tmp_path / "d").exists(), "nothing was started or written"


def test_grpc_port_in_use_from_the_environment(tmp_path: Path, taken_port: int, monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    done = in_process(monkeypatch, capsys, "gateway", "--data-dir", str(tmp_path / "d"), "--http-port", "0",
               env={"TRAINGUARD_GRPC_PORT": str(taken_port)})
    one_line(done, f"trainguard gateway: 127.0.0.1:{taken_port} (gRPC) is already in use: stop what listens "
                   "there or choose another port with --grpc-port (TRAINGUARD_GRPC_PORT)")


@pytest.mark.parametrize("env, expected", [
    ({"TRAINGUARD_QUEUE": "rabbitmq"},
     "TRAINGUARD_QUEUE='rabbitmq' is not valid: Input should be 'sqlite' or 'kafka'; fix or unset it"),
    ({"TRAINGUARD_HTTP_PORT": "http"},
     "TRAINGUARD_HTTP_PORT='http' is not valid: Input should be a valid integer, unable to parse string as an "
     "integer; fix or unset it"),
    ({"TRAINGUARD_DETECTION_OVERRIDES": '{"stall_min": 30}'},
     "TRAINGUARD_DETECTION_OVERRIDES: unknown detection setting 'stall_min'; did you mean 'stall_min_s'? "
     f"(every threshold: {OVERRIDES_HELP})"),
    ({"TRAINGUARD_DETECTION_OVERRIDES": "stall_min_s=30"},
     "TRAINGUARD_DETECTION_OVERRIDES is not JSON (Expecting value: line 1 column 1 (char 0)): give an object "
     "such as '{\"stall_min_s\": 30}'"),
    ({"TRAINGUARD_ROLES": "gateway,ui"},
     "TRAINGUARD_ROLES: roles must be a comma list of gateway, processor, api; got 'gateway,ui'"),
], ids=["queue", "port", "override-name", "override-json", "roles"])
def test_bad_settings(tmp_path: Path, env: Dict[str, str], expected: str, monkeypatch: pytest.MonkeyPatch,
                      capsys: pytest.CaptureFixture[str]) -> None:
    done = in_process(monkeypatch, capsys, "serve", "--data-dir", str(tmp_path / "d"),
                      env={"TRAINGUARD_HTTP_PORT": "0", "TRAINGUARD_GRPC_PORT": "0", **env})
    one_line(done, f"trainguard serve: {expected}")


def test_a_bad_setting_as_the_shell_sees_it(tmp_path: Path) -> None:
    done = cli("serve", "--data-dir", str(tmp_path / "d"), env={"TRAINGUARD_QUEUE": "rabbitmq"})
    one_line(done, "trainguard serve: TRAINGUARD_QUEUE='rabbitmq' is not valid: Input should be 'sqlite' or "
                   "'kafka'; fix or unset it")


def test_bad_data_dirs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                       capsys: pytest.CaptureFixture[str]) -> None:
    a_file = tmp_path / "notes.txt"
    a_file.write_text("x")
    one_line(in_process(monkeypatch, capsys, "serve", "--data-dir", str(a_file), "--http-port", "0"),
             f"trainguard serve: --data-dir (TRAINGUARD_DATA_DIR) {a_file} is a file, not a directory: give a "
             "directory (it is created when missing)")
    # /proc/sys is read-only to everyone, root included (a mount flag, not permissions)
    assert not os.access("/proc/sys", os.W_OK)
    one_line(in_process(monkeypatch, capsys, "processor", env={"TRAINGUARD_DATA_DIR": "/proc/sys/tg"}),
             "trainguard processor: TRAINGUARD_DATA_DIR /proc/sys/tg cannot be created (/proc/sys is not "
             "writable) by this user: give a directory you can write in")


def test_a_host_that_is_not_this_machine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    one_line(in_process(monkeypatch, capsys, "api", "--data-dir", str(tmp_path), "--host", "192.0.2.1", "--http-port", "4318"),
             "trainguard api: 192.0.2.1 is not an address of this machine (HTTP port 4318): give one with "
             "--host (TRAINGUARD_HOST), such as 127.0.0.1 or 0.0.0.0")


def test_token_commands_in_a_directory_without_a_server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    # the default data directory (.data/trainguard of the current directory) holds no server here; the
    # dashboard's login hint, token create --kind read, is said the same
    for action in (("list",), ("revoke", "--token-id", "abc"), ("create", "--kind", "read")):
        one_line(in_process(monkeypatch, capsys, "token", *action, cwd=tmp_path),
                 "trainguard token: no token store in .data/trainguard (no projects.db): give the server's "
                 "directory with --data-dir DIR (the 'data in DIR' line `trainguard serve` printed; "
                 "TRAINGUARD_DATA_DIR)")
    made = tmp_path / "made-before-the-server"  # a store with projects but no server's bootstrap file
    assert in_process(monkeypatch, capsys, "token", "create", "--project", "p", "--data-dir", str(made)
                      ).returncode == 0
    one_line(in_process(monkeypatch, capsys, "token", "create", "--kind", "read", "--data-dir", str(made)),
             f"trainguard token: token create needs --project P (no bootstrap project in "
             f"{made / 'bootstrap-tokens.json'})")
    one_line(in_process(monkeypatch, capsys, "token", "revoke", cwd=tmp_path),
             "trainguard token: token revoke needs --token-id ID (trainguard token list shows them)")


def test_token_create_takes_the_servers_project_as_the_hint_prints(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    # what serve's banner and the dashboard's login hint print: token create --data-dir D --kind read
    data = tmp_path / "tg-data"
    done = in_process(monkeypatch, capsys, "token", "create", "--project", "ml", "--kind", "ingest",
                      "--data-dir", str(data))
    assert done.returncode == 0, done.stderr
    (data / "bootstrap-tokens.json").write_text(json.dumps({"project": "ml", "ingest": "", "read": ""}))
    done = in_process(monkeypatch, capsys, "token", "create", "--data-dir", str(data), "--kind", "read")
    assert done.returncode == 0 and done.stdout.startswith("tg_read_"), done.stderr
    listing = in_process(monkeypatch, capsys, "token", "list", "--data-dir", str(data))
    assert [row.split("\t")[1:3] for row in listing.stdout.splitlines()] == [["ml", "ingest"], ["ml", "read"]]
    nothing = in_process(monkeypatch, capsys, "token", "list", "--data-dir", str(data), "--project", "other")
    assert (nothing.returncode, nothing.stdout, nothing.stderr) == (0, "", f"no tokens of project 'other' in "
                                                                           f"{data}\n")


def test_version() -> None:
    done = cli("--version")
    assert done.returncode == 0 and done.stderr == ""
    assert re.fullmatch(r"trainguard 0\.1\.0 \(trainguard-server 0\.1\.0, trainguard-engine \S+, SDK 0\.1\.0; "
                        r"Python 3\.\d+\.\d+\)\n", done.stdout), done.stdout


def test_replay_to_a_stopped_server_says_so_at_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    # it used to retry silently for minutes; now one line within the 3 s connect timeout
    metrics = tmp_path / "m.jsonl"
    metrics.write_text('{"step": 0, "loss": 1.0}\n')
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed when the block ends: nothing listens there
    done = in_process(monkeypatch, capsys, "replay", "--run-id", "r1", "--metrics", str(metrics), "--token", "t",
                      env={"TRAINGUARD_ENDPOINT": f"http://127.0.0.1:{port}"})
    one_line(done, f"trainguard replay: cannot reach http://127.0.0.1:{port} (Connection refused): is the "
                   "TrainGuard backend running there? (--endpoint URL, TRAINGUARD_ENDPOINT)")

