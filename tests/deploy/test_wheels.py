"""The wheels ``make dist`` builds, installed as a user would: a fresh venv, ``pip install --find-links dist
trainguard-server``, then ``import trainguard``, ``trainguard --version``, ``trainguard serve`` from the wheel
with the dashboard's charts served, and a small real torch training instrumented with the SDK wheel whose
run, metrics and crash incident the server reports.

The server's dependencies come from the package index as pip finds them (constrained to the versions of the
development venv, so pip's cache serves them); the job's torch is the development venv's (a ``.pth`` line
after the install: the SDK never installs torch, and pip is checked to have installed none).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import sysconfig
import textwrap
import urllib.request
import zipfile
from pathlib import Path
from typing import Any, Dict, Iterator, List

import pytest

from tests.support.waiting import poll
from tools.build_dist import VENDOR_MEMBER, build

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 180

JOB = """
import sys, torch, trainguard
assert trainguard.__file__.startswith(sys.prefix), trainguard.__file__  # the wheel, not the checkout
trainguard.init(endpoint=sys.argv[1], token=sys.argv[2], run_name="wheel-job", run_id="wheel-1",
                announce=True, spool_dir="")
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
trainguard.watch(model, opt)
x, y = torch.randn(64, 8), torch.randn(64, 1)
for step in range(30):
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad(); loss.backward(); opt.step()
    trainguard.log(step=step, loss=loss)
model(torch.randn(4, 7))  # the crash: a malformed batch
"""


def _run(argv: List[str], **kw: Any) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=TIMEOUT_S, **kw)
    assert done.returncode == 0, f"{argv}: {done.stdout[-2000:]}{done.stderr[-3000:]}"
    return done


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv with the three wheels installed from a fresh ``tools/build_dist.py`` build."""
    root = tmp_path_factory.mktemp("wheels")
    wheels = build(root / "dist")
    assert [w.name for w in wheels] == ["trainguard-0.1.0-py3-none-any.whl",
                                        "trainguard_engine-0.1.0-py3-none-any.whl",
                                        "trainguard_server-0.1.0-py3-none-any.whl"]
    with zipfile.ZipFile(wheels[0]) as sdk:
        metadata = sdk.read("trainguard-0.1.0.dist-info/METADATA").decode()
    requires = [line for line in metadata.splitlines() if line.startswith("Requires-Dist:")]
    assert requires and not [r for r in requires if re.search(r"torch|lightning|transformers", r)], requires
    constraints = root / "constraints.txt"
    frozen = _run([sys.executable, "-m", "pip", "freeze", "--exclude-editable"]).stdout.splitlines()
    constraints.write_text("\n".join(line for line in frozen if "==" in line and not line.startswith("trainguard")))
    venv = root / "venv"
    _run([sys.executable, "-m", "venv", str(venv)])
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    _run([*pip, "--find-links", str(root / "dist"), "-c", str(constraints), "trainguard-server"])
    installed = _run([str(venv / "bin" / "python"), "-m", "pip", "list", "--format=json"]).stdout
    names = {p["name"].lower() for p in json.loads(installed)}
    assert {"trainguard", "trainguard-engine", "trainguard-server", "fastapi", "grpcio"} <= names
    assert "torch" not in names, "installing TrainGuard must never install torch"
    return venv


@pytest.fixture(scope="module")
def server(venv: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Dict[str, str]]:
    """``trainguard serve`` of the venv (no checkout on its path), its banner parsed."""
    data = tmp_path_factory.mktemp("serve-data")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRAINGUARD_", "PYTHON"))}
    proc = subprocess.Popen([str(venv / "bin" / "trainguard"), "serve", "--data-dir", str(data), "--http-port",
                             "0", "--grpc-port", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, cwd=str(data))
    banner: List[str] = []
    assert proc.stdout is not None
    for line in proc.stdout:
        banner.append(line.rstrip("\n"))
        if "tokens are kept in" in line:
            break
    text = "\n".join(banner)
    try:
        dashboard = re.search(r"^  dashboard +(http://\S+/ui/)$", text, re.M)
        ingest = re.search(r"ingest token (\S+)", text)
        read = re.search(r"read token +(\S+)", text)
        assert dashboard and ingest and read, text + (proc.stderr.read() if proc.poll() is not None and
                                                      proc.stderr else "")
        yield {"dashboard": dashboard.group(1), "base": dashboard.group(1)[: -len("/ui/")],
               "ingest": ingest.group(1), "read": read.group(1)}
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)


def _get(url: str, token: str = "") -> bytes:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    with urllib.request.urlopen(request, timeout=10) as response:
        body: bytes = response.read()
        return body


def test_import_and_version(venv: Path) -> None:
    python = str(venv / "bin" / "python")
    where = _run([python, "-c", "import trainguard, trainguard_server; print(trainguard.__file__, "
                  "trainguard_server.__file__)"], cwd="/").stdout.split()
    purelib = _run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip()
    assert all(p.startswith(purelib) for p in where), where
    version = _run([str(venv / "bin" / "trainguard"), "--version"]).stdout
    assert version.startswith("trainguard 0.1.0 (trainguard-server 0.1.0, trainguard-engine 0.1.0, SDK 0.1.0;")


def test_the_server_from_the_wheel_serves_the_dashboard_with_its_charts(venv: Path,
                                                                         server: Dict[str, str]) -> None:
    page = _get(server["dashboard"]).decode()
    assert '<script src="/ui/static/vendor/echarts.min.js"></script>' in page
    served = _get(server["base"] + "/ui/static/vendor/echarts.min.js")
    purelib = Path(_run([str(venv / "bin" / "python"), "-c",
                         "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip())
    shipped = (purelib / VENDOR_MEMBER).read_bytes()
    assert len(served) > 500_000 and served == shipped and b"echarts" in served[:4000]
    docs = _get(server["base"] + "/docs").decode()  # /docs: Swagger UI from the wheel, not a CDN
    assert "/ui/static/vendor/swagger-ui-bundle.js" in docs and "https://" not in docs
    assert len(_get(server["base"] + "/ui/static/vendor/swagger-ui-bundle.js")) > 500_000


def test_a_training_with_the_sdk_wheel_reaches_the_server(venv: Path, server: Dict[str, str]) -> None:
    # the job's torch: the development venv's, on the path after the venv's own packages
    purelib = Path(_run([str(venv / "bin" / "python"), "-c",
                         "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip())
    (purelib / "zz-dev-torch.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRAINGUARD_", "PYTHON"))}
    job = subprocess.run([str(venv / "bin" / "python"), "-c", textwrap.dedent(JOB), server["base"],
                          server["ingest"]], capture_output=True, text=True, timeout=TIMEOUT_S, env=env, cwd="/")
    assert job.returncode == 1 and "RuntimeError: mat1 and mat2 shapes cannot be multiplied" in job.stderr
    assert job.stderr.splitlines()[0] == (f"trainguard: run wheel-job (wheel-1): {server['base']}"
                                          "/ui/#/runs/wheel-1"), job.stderr

    def failed_with_incident() -> Any:
        run = json.loads(_get(server["base"] + "/api/v1/runs/wheel-1", server["read"]))
        incidents = json.loads(_get(server["base"] + "/api/v1/runs/wheel-1/incidents", server["read"]))
        return run["status"] == "failed" and incidents["items"] and (run, incidents["items"])

    found = poll(failed_with_incident, timeout=60)
    assert found, _get(server["base"] + "/api/v1/runs/wheel-1", server["read"])
    run, incidents = found
    assert run["run_name"] == "wheel-job"
    crash = [i for i in incidents if (i["category"], i["subtype"]) == ("process", "exception")]
    assert crash and "mat1 and mat2 shapes cannot be multiplied" in crash[0]["title"], incidents
    series = json.loads(_get(server["base"] + "/api/v1/runs/wheel-1/metrics?names=loss,grad/global_norm"
                             "&max_points=100", server["read"]))["series"]
    steps = {name: sum(b["count"] for b in series[name]["0"]) for name in ("loss", "grad/global_norm")}
    assert steps["loss"] == 30 and steps["grad/global_norm"] >= 4, steps  # (the norm: adaptive cadence)
