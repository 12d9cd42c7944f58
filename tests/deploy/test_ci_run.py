"""deploy/ci run for real: the GitHub Actions workflow on a pull request and the GitLab CI job on a merge
request, their shell executed step by step by tests/deploy/ci_runner.py (no GitHub or GitLab runner here;
the install lines are left out -- no network -- and the clone's sources are put on PYTHONPATH as
``pip install -e`` would). Each job starts its own ``trainguard serve``, trains the baseline canaries on the
base branch's code from a git worktree, trains the pull request's canary, gates it and writes the reports.

- GitHub, a pull request that changes nothing the canary does: the job passes, the summary and the JUnit
  report say pass, the artifacts exist, the main-only baseline refresh is skipped.
- GitLab, a merge request that divides the canary's learning rate by 10: the job fails with exit 1 (not an
  allowed failure), on the loss envelope, and the JUnit report holds that failure.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Dict, Iterator, Tuple

import pytest
import yaml

from tests.deploy.ci_runner import evaluate, run_github_job, run_gitlab_job, substitute
from tests.support.net import free_port

ROOT = Path(__file__).resolve().parents[2]
CI = ROOT / "deploy" / "ci"
GIT = ["git", "-c", "user.name=TrainGuard tests", "-c", "user.email=tests@trainguard.invalid",
       "-c", "advice.detachedHead=false"]


def _git(cwd: Path, *args: str) -> str:
    return subprocess.run([*GIT, *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


def _repositories(tmp_path: Path) -> Path:
    """``origin`` (this checkout's HEAD as its ``main``) and a clone of it on a branch ``feature``."""
    origin = tmp_path / "origin"
    subprocess.run([*GIT, "clone", "-q", str(ROOT), str(origin)], check=True)
    _git(origin, "checkout", "-q", "-B", "main")
    clone = tmp_path / "clone"
    subprocess.run([*GIT, "clone", "-q", str(origin), str(clone)], check=True)
    _git(clone, "checkout", "-q", "-b", "feature")
    return clone


def _environment(clone: Path, tmp_path: Path) -> Dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRAINGUARD_", "GITHUB_", "CI_"))}
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["PYTHONPATH"] = os.pathsep.join([str(clone / "sdk" / "src"), str(clone / "engine" / "src"), str(clone / "services" / "src")])
    env["TMPDIR"] = str(tmp_path / "tmp")
    (tmp_path / "tmp").mkdir()
    return env


def _not_installable_here(script: str) -> bool:
    return bool(re.match(r"\s*(pip install|apt-get)", script))


def _junit(path: Path) -> ET.Element:
    return ET.parse(path).getroot()


def _github_pull_request(tmp_path: Path) -> Tuple[Path, Any]:
    """The GitHub workflow's canary-gate job on a pull request that changes nothing: (clone, job result)."""
    clone = _repositories(tmp_path)
    workflow: Dict[str, Any] = yaml.safe_load((CI / "github-actions.yml").read_text())
    workflow["env"].update(TRAINGUARD_HTTP_PORT=str(free_port()), TRAINGUARD_GRPC_PORT=str(free_port()))
    github = {"event_name": "pull_request", "ref": "refs/pull/7/merge", "base_ref": "main",
              "run_id": "4242", "run_attempt": "1", "run_number": "5"}
    result = run_github_job(workflow, "canary-gate", clone, _environment(clone, tmp_path), github,
                            secrets={}, temp=tmp_path / "gh", skip=_not_installable_here)
    return clone, result


def _gitlab_lr_regression(tmp_path: Path) -> Tuple[Path, int, bool, str]:
    """The GitLab trainguard-gate job on a merge request dividing the canary's LR by 10: (clone, exit code,
    passed, output)."""
    clone = _repositories(tmp_path)
    trainings = clone / "services" / "src" / "trainguard_server" / "demo" / "trainings.py"
    source = trainings.read_text()
    assert "CANARY_LR = 0.05\n" in source
    trainings.write_text(source.replace("CANARY_LR = 0.05\n", "CANARY_LR = 0.005\n"))
    _git(clone, "commit", "-qam", "a merge request with a learning-rate regression")
    pipeline: Dict[str, Any] = yaml.safe_load((CI / "gitlab-ci.yml").read_text())
    predefined = {"CI_PIPELINE_ID": "900", "CI_JOB_ID": "901", "CI_PIPELINE_IID": "11",
                  "CI_MERGE_REQUEST_TARGET_BRANCH_NAME": "main", "CI_DEFAULT_BRANCH": "main"}
    ports = {"TRAINGUARD_HTTP_PORT": str(free_port()), "TRAINGUARD_GRPC_PORT": str(free_port())}
    code, passed, output = run_gitlab_job(pipeline, "trainguard-gate", clone, _environment(clone, tmp_path),
                                          predefined, ports, skip=_not_installable_here)
    return clone, code, passed, output


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Dict[str, Future[Any]]]:
    """Both CI jobs, started together: they share nothing (own clones, servers on their own ports, own
    TMPDIR and spools), and each waits on torch start-ups and its server much of the time. Each test takes
    its own job's result (an error in one job fails only its test)."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        yield {"github": pool.submit(_github_pull_request, tmp_path_factory.mktemp("github")),
               "gitlab": pool.submit(_gitlab_lr_regression, tmp_path_factory.mktemp("gitlab"))}


def test_github_workflow_passes_a_pull_request_that_changes_nothing(jobs: Dict[str, Future[Any]]) -> None:
    clone, result = jobs["github"].result()
    ran = {s.name: s.ran for s in result.steps}
    assert result.passed, result.output()
    assert ran["Embedded backend (no TRAINGUARD_API secret)"] and ran["Baseline from the base branch's code "
                                                                        "(embedded backend)"]
    assert not ran["Install the SDK, the CLI and torch (CPU)"]  # no network here: the caller installed it
    assert not ran["Refresh the baseline from main's canaries (shared backend)"]  # main pushes only
    assert result.env["EMBEDDED"] == "1" and result.env["TRAINGUARD_READ_TOKEN"].startswith("tg_read_")
    # pass, or pass with a warning: a step-time warning is possible on a loaded machine, and exits 0 too
    assert "TrainGuard gate:" in result.summary
    assert re.search(r"(PASS|WARN) \(exit 0\)", result.summary), result.summary
    assert "canary-4242-1" in result.summary  # the candidate is the run this job trained
    assert sorted(p.name for p in result.artifacts) == ["gate-junit.xml", "gate.md"]
    assert all(p.exists() for p in result.artifacts)
    suite = _junit(clone / "gate-junit.xml")
    assert suite.get("failures") == "0" and suite.get("errors") == "0" and int(suite.get("tests", "0")) >= 4
    assert {case.get("name") for case in suite.iter("testcase")} >= {"loss", "fingerprints", "status"}


def test_gitlab_job_fails_a_merge_request_that_divides_the_learning_rate(jobs: Dict[str, Future[Any]]) -> None:
    clone, code, passed, output = jobs["gitlab"].result()
    assert (code, passed) == (1, False), output[-4000:]
    summary = (clone / "gate.md").read_text()
    assert "FAIL (exit 1)" in summary and "canary-900-901" in summary
    assert re.search(r"\| loss \| \S+ fail \|", summary), summary
    suite = _junit(clone / "gate-junit.xml")
    failed = [case.get("name") for case in suite.iter("testcase") if case.find("failure") is not None]
    assert failed == ["loss"], ET.tostring(suite, encoding="unicode")[:2000]


def test_the_runner_reads_github_expressions_as_github_does() -> None:
    pr = {"github": {"ref": "refs/pull/7/merge", "event_name": "pull_request"}, "env": {"EMBEDDED": "1"},
          "secrets": {}}
    main = {**pr, "github": {"ref": "refs/heads/main", "event_name": "push"}, "env": {}}
    choose = "github.ref == 'refs/heads/main' && 'canary-main' || 'candidate'"
    assert evaluate(choose, pr) == "candidate" and evaluate(choose, main) == "canary-main"
    assert evaluate("env.TRAINGUARD_API == ''", pr) is True  # an unset env or secret reads as ''
    assert evaluate("env.EMBEDDED != '1'", pr) is False and evaluate("env.EMBEDDED != '1'", main) is True
    refresh = "github.event_name == 'push' && github.ref == 'refs/heads/main' && env.EMBEDDED != '1'"
    assert evaluate(refresh, main) is True and evaluate(refresh, pr) is False
    assert evaluate("always()", pr, "failure") is True and evaluate("success()", pr, "failure") is False
    assert evaluate("github.event_name == 'PULL_REQUEST'", pr) is True  # string comparison ignores case
    assert substitute("seed ${{ github.ref }}-${{ 3 }}", pr) == "seed refs/pull/7/merge-3"
    with pytest.raises(ValueError):
        evaluate("github.ref ==", pr)
