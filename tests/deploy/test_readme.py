"""The README's commands run as written: every block marked runnable (```bash runnable, ```python runnable
file=NAME) is extracted and run, in order, in an empty directory, with the development venv's ``trainguard``
and ``python`` first on the PATH (what ``make demo`` / ``pip install`` leave); and the trainer one-liners
work after a plain ``import trainguard``.

One substitution, so that a server on this machine's default ports cannot get in the way: the README's
``127.0.0.1:4318`` becomes a free port, which ``TRAINGUARD_HTTP_PORT`` / ``TRAINGUARD_GRPC_PORT`` give the
server it starts; and ``TRAINGUARD_ANNOUNCE=1``, because the session's stderr is a file here, not the terminal
on which ``init()`` prints its link by default. The shell session runs in its own process group, ended (by its
id) when the test ends.
Bounded: 150 s for the whole session.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import List, Tuple

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
FENCE = re.compile(r"^```(\w+)([^\n]*)\n(.*?)^```$", re.M | re.S)


def blocks() -> List[Tuple[str, str, str]]:
    """(language, info after it, body) of every fenced block of the README."""
    return [(m.group(1), m.group(2).strip(), m.group(3)) for m in FENCE.finditer(README.read_text())]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_the_runnable_blocks_run_as_written(tmp_path: Path) -> None:
    runnable = [(lang, info, body) for lang, info, body in blocks() if info.split()[:1] == ["runnable"]]
    shell = [body for lang, _, body in runnable if lang == "bash"]
    files = {re.search(r"file=(\S+)", info).group(1): body  # type: ignore[union-attr]
             for lang, info, body in runnable if lang == "python"}
    assert len(shell) >= 1 and "train.py" in files, "the README's first run is marked runnable"
    for name, body in files.items():
        (tmp_path / name).write_text(body)
    http, grpc = free_port(), free_port()
    script = "\n".join(shell).replace("127.0.0.1:4318", f"127.0.0.1:{http}")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRAINGUARD_", "PYTHONPATH"))}
    env.update(PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
               TRAINGUARD_HTTP_PORT=str(http), TRAINGUARD_GRPC_PORT=str(grpc), TRAINGUARD_ANNOUNCE="1")
    # files, not pipes: the server left in the background keeps its copies open after the session ends
    with open(tmp_path / "out.txt", "w") as stdout, open(tmp_path / "err.txt", "w") as stderr:
        proc = subprocess.Popen(["bash", "-euo", "pipefail", "-c", script], cwd=tmp_path, env=env,
                                stdout=stdout, stderr=stderr, start_new_session=True)
        try:
            proc.wait(timeout=150)
        finally:
            try:
                os.killpg(proc.pid, signal.SIGTERM)  # the server the README started in the background
            except ProcessLookupError:
                pass
    out, err = (tmp_path / "out.txt").read_text(), (tmp_path / "err.txt").read_text()
    assert proc.returncode == 0, f"{out[-3000:]}\n{err[-3000:]}"
    lines = out.splitlines()
    assert lines[0].startswith("trainguard 0.1.0 (trainguard-server 0.1.0"), out[:500]
    assert f"  dashboard          http://127.0.0.1:{http}/ui/" in lines, out[:1500]
    runs = json.loads(lines[-1])["items"]
    assert [r["run_name"] for r in runs] == ["quickstart"], runs
    run_id = runs[0]["run_id"]
    assert runs[0]["status"] in ("running", "finished") and runs[0]["last_step"] >= 0
    assert f"trainguard: run quickstart ({run_id}): http://127.0.0.1:{http}/ui/#/runs/{run_id}" in err, err


def test_the_trainer_one_liners_work_after_import_trainguard() -> None:
    text = README.read_text()
    one_liners = sorted(set(re.findall(r"trainguard\.integrations\.\w+\.TrainGuardCallback\(\)", text)))
    assert one_liners == ["trainguard.integrations.lightning.TrainGuardCallback()",
                          "trainguard.integrations.transformers.TrainGuardCallback()"]
    code = "import trainguard\n" + "".join(f"print(type({expr}).__mro__[1].__module__)\n" for expr in one_liners)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRAINGUARD_", "PYTHONPATH"))}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    # each is a real callback of its framework (the base class's module)
    lightning, transformers = done.stdout.split()
    assert lightning in ("lightning.pytorch.callbacks.callback", "pytorch_lightning.callbacks.callback")
    assert transformers == "transformers.trainer_callback"
