"""deploy/ci: the GitHub Actions workflow and the GitLab CI job that run a canary and gate it, validated
statically (no GitHub or GitLab runner here): both parse as YAML, every ``trainguard`` command line and
canary command they run is accepted by our own parsers, the policy file they pass is a valid policy, and
the reports go where each CI system shows them."""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any, Dict, Iterator, List

import pytest
import yaml

from trainguard_server.cli import build_parser
from trainguard_server.demo.trainings import build_parser as trainings_parser
from trainguard_server.gate.policy import policy_from_dict

ROOT = Path(__file__).resolve().parents[2]
CI = ROOT / "deploy" / "ci"
GITHUB: Dict[str, Any] = yaml.safe_load((CI / "github-actions.yml").read_text())
GITLAB: Dict[str, Any] = yaml.safe_load((CI / "gitlab-ci.yml").read_text())
ENV = {**GITHUB["env"], **GITLAB["variables"]}


def github_scripts() -> List[str]:
    return [step["run"] for job in GITHUB["jobs"].values() for step in job["steps"] if "run" in step]


def gitlab_scripts() -> List[str]:
    job = GITLAB["trainguard-gate"]
    return [*job["before_script"], *job["script"]]


def commands(script: str) -> Iterator[List[str]]:
    """Each command line of a shell script as argv: continuations joined, the workflow's own variables
    expanded, other variables and ``${{ }}`` expressions replaced by "7", leading VAR=value assignments
    dropped."""
    script = script.replace("\\\n", " ")
    for name in ("CANARY", "BASELINE", "RUN_ID"):
        script = script.replace(f"${name}", ENV[name])
    script = re.sub(r"\$\{\{[^}]*\}\}", "7", script)
    for line in script.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        line = re.sub(r"\$\{[^}]*\}|\$\(.*?\)|\$\w+", "7", line)
        argv = shlex.split(line, comments=True)
        ends = [i for i, a in enumerate(argv) if a in ("&", "&&", "||", "|", ";") or a.startswith(">")
                or a.startswith("2>")]
        argv = argv[:ends[0]] if ends else argv
        while argv and re.fullmatch(r"\w+=.*", argv[0]):
            argv.pop(0)
        if argv:
            yield argv


def tg_lines(scripts: List[str], sub: str) -> List[List[str]]:
    out = []
    for script in scripts:
        for argv in commands(script):
            if argv[:2] == ["trainguard", sub]:
                out.append(argv[1:])
    return out


def canary_lines(scripts: List[str]) -> List[List[str]]:
    return [argv[3:] for script in scripts for argv in commands(script)
            if argv[:3] == ["python", "-m", "trainguard_server.demo.trainings"]]


@pytest.mark.parametrize("scripts", [github_scripts(), gitlab_scripts()], ids=["github", "gitlab"])
def test_every_trainguard_command_is_one_our_cli_accepts(scripts: List[str]) -> None:
    parser = build_parser()
    gates = tg_lines(scripts, "gate")
    assert gates, "no trainguard gate command"
    gated = []
    for argv in gates:
        args = parser.parse_args(argv)
        assert args.command == "gate" and args.baseline
        if args.candidate:
            gated.append(args)
    [args] = gated  # exactly one gate of the canary
    assert args.markdown == "gate.md" and args.junit == "gate-junit.xml"
    assert (ROOT / args.policy).is_file()
    # the baseline is (re)defined from the tag the baseline runs carry
    definitions = [parser.parse_args(a) for a in gates if "--baseline-tag" in a]
    assert definitions and all(d.baseline_tag == "gate=canary-main" for d in definitions)
    for argv in tg_lines(scripts, "serve"):
        assert parser.parse_args(argv).command == "serve"


@pytest.mark.parametrize("scripts", [github_scripts(), gitlab_scripts()], ids=["github", "gitlab"])
def test_the_canary_commands_are_real_canaries(scripts: List[str]) -> None:
    lines = canary_lines(scripts)
    assert len(lines) == 2  # the baseline's seeds and the candidate
    for argv in lines:
        args = trainings_parser().parse_args(argv)
        assert args.kind == "canary" and args.steps == 200 and args.tag
    # the baseline's runs carry the tag the baseline is defined from
    assert ("gate", "canary-main") in trainings_parser().parse_args(lines[0]).tag


def test_the_policy_file_is_valid_and_says_the_defaults() -> None:
    data = yaml.safe_load((CI / "gate-policy.yaml").read_text())
    assert policy_from_dict(data).to_dict() == policy_from_dict(None).to_dict()


def test_github_reports_go_to_the_job_summary_and_an_artifact() -> None:
    steps = [s for job in GITHUB["jobs"].values() for s in job["steps"]]
    summary = [s for s in steps if "GITHUB_STEP_SUMMARY" in s.get("run", "")]
    assert summary and summary[0]["if"] == "always()" and "gate.md" in summary[0]["run"]
    upload = [s for s in steps if str(s.get("uses", "")).startswith("actions/upload-artifact@")]
    assert upload and upload[0]["if"] == "always()"
    assert set(upload[0]["with"]["path"].split()) == {"gate.md", "gate-junit.xml"}
    gate_step = next(s for s in steps if "--candidate" in s.get("run", ""))
    assert "set +e" in gate_step["run"] and '[ "$code" = 2 ]' in gate_step["run"]  # undecided warns
    assert set(GITHUB[True] if True in GITHUB else GITHUB["on"]) >= {"push", "pull_request"}


def test_gitlab_reports_junit_and_keeps_the_summary() -> None:
    job = GITLAB["trainguard-gate"]
    assert job["artifacts"]["reports"]["junit"] == "gate-junit.xml"
    assert job["artifacts"]["when"] == "always" and "gate.md" in job["artifacts"]["paths"]
    assert job["allow_failure"] == {"exit_codes": [2]}  # undecided warns, a failure fails
