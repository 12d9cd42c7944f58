"""Run the shell of deploy/ci's GitHub Actions workflow and GitLab CI job on this machine, the way each
runner would (there is no runner here): the tests that use it execute the real scripts end to end.

GitHub Actions (:func:`run_github_job`): the workflow's ``env`` and each step's ``if:`` are evaluated with a
small interpreter of the expression language (strings, numbers, ``context.path`` lookups, ``==``/``!=``,
``!``, ``&&``/``||`` with their value semantics -- ``c && 'a' || 'b'`` --, ``always()``/``success()``/
``failure()``); ``${{ }}`` in ``run`` scripts and ``env`` is substituted; each ``run`` is one ``bash -e``
process (GitHub's default shell on Linux; ``bash -eo pipefail`` for ``shell: bash``) with ``GITHUB_ENV``/``GITHUB_STEP_SUMMARY``/``RUNNER_TEMP`` as on a runner, and lines appended to
``GITHUB_ENV`` reach later steps. ``uses:`` steps are replaced by what they do here: checkout = the
caller's clone, setup-python = this interpreter first on PATH, upload-artifact = its paths recorded.
GitLab CI (:func:`run_gitlab_job`): ``variables`` and ``CI_*`` into the environment, every ``script`` entry
in one ``bash -eo pipefail`` session (as GitLab's shell executor does), ``allow_failure.exit_codes``.

What is not run: the install lines (``pip install`` of torch from download.pytorch.org and of the clone;
``apt-get``): this machine has no network beyond the package registries, so the caller provides the
installed project (its interpreter, ``PYTHONPATH`` on the clone's sources, as ``pip install -e`` would).
Processes a step leaves running (the embedded backend) are killed when the job ends, as runners do.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

_TOKEN_RE = re.compile(r"\s*(?:(?P<str>'(?:[^']|'')*')|(?P<num>\d+(?:\.\d+)?)|(?P<op>==|!=|&&|\|\||!|\(|\)|,)"
                       r"|(?P<name>[A-Za-z_][A-Za-z0-9_.\-]*))")
_EXPR_RE = re.compile(r"\$\{\{(.*?)\}\}")


class Expression:
    """One GitHub Actions expression, evaluated against ``context`` (``{"github": {...}, "env": {...}}``).
    Values are strings, numbers, None or bools; comparisons of strings ignore case, as GitHub's do."""

    def __init__(self, text: str, context: Mapping[str, Any], status: str = "success") -> None:
        self.tokens: List[Tuple[str, str]] = []
        pos, text = 0, text.strip()
        while pos < len(text):
            match = _TOKEN_RE.match(text, pos)
            if match is None or match.end() == pos:
                raise ValueError(f"cannot read the expression {text!r} at {text[pos:]!r}")
            kind = match.lastgroup or ""
            self.tokens.append((kind, match.group(kind)))
            pos = match.end()
        self.context, self.status, self.i = context, status, 0

    def value(self) -> Any:
        result = self._or()
        if self.i != len(self.tokens):
            raise ValueError(f"unexpected {self.tokens[self.i][1]!r}")
        return result

    def _peek(self) -> str:
        return self.tokens[self.i][1] if self.i < len(self.tokens) else ""

    def _or(self) -> Any:
        left = self._and()
        while self._peek() == "||":
            self.i += 1
            right = self._and()
            left = left if truthy(left) else right
        return left

    def _and(self) -> Any:
        left = self._compare()
        while self._peek() == "&&":
            self.i += 1
            right = self._compare()
            left = right if truthy(left) else left
        return left

    def _compare(self) -> Any:
        left = self._unary()
        while self._peek() in ("==", "!="):
            op = self._peek()
            self.i += 1
            right = self._unary()
            same = _loose(left) == _loose(right)
            left = same if op == "==" else not same
        return left

    def _unary(self) -> Any:
        if self._peek() == "!":
            self.i += 1
            return not truthy(self._unary())
        return self._primary()

    def _primary(self) -> Any:
        if self.i >= len(self.tokens):
            raise ValueError("the expression ends where a value was expected")
        kind, text = self.tokens[self.i]
        self.i += 1
        if kind == "str":
            return text[1:-1].replace("''", "'")
        if kind == "num":
            return float(text)
        if text == "(":
            inner = self._or()
            self._expect(")")
            return inner
        if kind == "name" and self._peek() == "(":  # a status function
            self.i += 1
            self._expect(")")
            calls: Dict[str, Callable[[], bool]] = {
                "always": lambda: True, "success": lambda: self.status == "success",
                "failure": lambda: self.status == "failure", "cancelled": lambda: False}
            return calls[text]()
        if text in ("true", "false"):
            return text == "true"
        if text == "null":
            return None
        node: Any = self.context
        for part in text.split("."):
            node = node.get(part) if isinstance(node, Mapping) else None
        return "" if node is None and text.split(".")[0] in ("env", "secrets") else node

    def _expect(self, token: str) -> None:
        if self._peek() != token:
            raise ValueError(f"expected {token!r}, found {self._peek()!r}")
        self.i += 1


def truthy(value: Any) -> bool:
    return value not in (None, False, "", 0, 0.0)


def _loose(value: Any) -> Any:
    return value.lower() if isinstance(value, str) else value


def evaluate(text: str, context: Mapping[str, Any], status: str = "success") -> Any:
    return Expression(text, context, status).value()


def substitute(text: str, context: Mapping[str, Any]) -> str:
    """``${{ expr }}`` replaced by the expression's value, as text (GitHub does it before the shell runs)."""
    def one(match: re.Match[str]) -> str:
        value = evaluate(match.group(1), context)
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        return "" if value is None else str(value).lower() if isinstance(value, bool) else str(value)
    return _EXPR_RE.sub(one, text)


@dataclass
class StepResult:
    name: str
    ran: bool
    code: int = 0
    output: str = ""


@dataclass
class JobResult:
    passed: bool
    steps: List[StepResult] = field(default_factory=list)
    artifacts: List[Path] = field(default_factory=list)
    summary: str = ""
    env: Dict[str, str] = field(default_factory=dict)

    def output(self) -> str:
        return "\n".join(f"--- {s.name} (ran={s.ran}, exit {s.code})\n{s.output}" for s in self.steps)


def _run_shell(args: List[str], script: str, cwd: Path, env: Mapping[str, str], groups: List[int],
               timeout_s: float) -> Tuple[int, str]:
    proc = subprocess.Popen([*args, script], cwd=cwd, env=dict(env), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    groups.append(proc.pid)  # its background children (the embedded backend) stay in this group
    out, _ = proc.communicate(timeout=timeout_s)
    return proc.returncode, out


def _kill_groups(groups: List[int]) -> None:
    for pgid in groups:
        try:
            os.killpg(pgid, signal.SIGTERM)
        except ProcessLookupError:
            pass


def _parse_env_file(path: Path) -> Dict[str, str]:
    """``GITHUB_ENV`` lines ``NAME=value`` (the single-line form the workflow uses)."""
    found: Dict[str, str] = {}
    for line in path.read_text().splitlines():
        if "=" in line:
            name, _, value = line.partition("=")
            found[name] = value
    return found


def run_github_job(workflow: Mapping[str, Any], job: str, clone: Path, base_env: Mapping[str, str],
                   github: Mapping[str, Any], secrets: Mapping[str, str], temp: Path, *,
                   skip: Optional[Callable[[str], bool]] = None, timeout_s: float = 600) -> JobResult:
    """Run ``job`` of ``workflow`` in ``clone`` (see the module doc). ``github`` is the github context
    (event_name, ref, run_id, run_attempt, run_number, base_ref); ``secrets`` the repository secrets;
    ``run`` steps for which ``skip(script)`` is true are left out (recorded as not run)."""
    runner_temp = temp / "runner"
    runner_temp.mkdir(parents=True)
    github_env, summary = temp / "github_env", temp / "step_summary"
    github_env.touch()
    summary.touch()
    context: Dict[str, Any] = {"github": dict(github), "secrets": dict(secrets), "env": {}}
    env: Dict[str, str] = dict(base_env)
    env.update(GITHUB_ENV=str(github_env), GITHUB_STEP_SUMMARY=str(summary), RUNNER_TEMP=str(runner_temp),
               GITHUB_WORKSPACE=str(clone), GITHUB_BASE_REF=str(github.get("base_ref", "")),
               GITHUB_EVENT_NAME=str(github.get("event_name", "")), GITHUB_REF=str(github.get("ref", "")),
               CI="true", GITHUB_ACTIONS="true")
    for name, value in (workflow.get("env") or {}).items():
        env[name] = context["env"][name] = substitute(str(value), context)
    result = JobResult(passed=True)
    groups: List[int] = []
    try:
        for number, step in enumerate(workflow["jobs"][job]["steps"]):
            name = step.get("name") or step.get("uses") or f"step {number}"
            status = "success" if result.passed else "failure"
            condition = step.get("if", "success()")
            run_it = truthy(evaluate(str(condition), context, status))
            if run_it and not result.passed and "always()" not in str(condition) \
                    and "failure()" not in str(condition):
                run_it = False  # a step without a status function runs only while the job succeeds
            if not run_it or ("run" in step and skip is not None and skip(step["run"])):
                result.steps.append(StepResult(name, False))
                continue
            if "uses" in step:
                result.steps.append(StepResult(name, True, 0, _uses(step, clone, context, result)))
                continue
            script = substitute(step["run"], context)
            code, out = _run_shell(_github_shell(step), script, clone, env, groups, timeout_s)
            result.steps.append(StepResult(name, True, code, out))
            added = _parse_env_file(github_env)
            env.update(added)
            context["env"].update(added)
            if code != 0:
                result.passed = False
    finally:
        _kill_groups(groups)
    result.summary = summary.read_text()
    result.env = env
    return result


def _github_shell(step: Mapping[str, Any]) -> List[str]:
    """The command GitHub runs a ``run`` script with on Linux: ``bash -e {0}`` when no shell is named,
    ``bash --noprofile --norc -eo pipefail {0}`` for ``shell: bash``."""
    shell = step.get("shell")
    if shell is None:
        return ["bash", "-e", "-c"]
    if shell == "bash":
        return ["bash", "--noprofile", "--norc", "-eo", "pipefail", "-c"]
    raise ValueError(f"no stand-in for shell {shell!r}")


def _uses(step: Mapping[str, Any], clone: Path, context: Mapping[str, Any], result: JobResult) -> str:
    action = str(step["uses"]).split("@")[0]
    if action == "actions/checkout":
        return f"the clone at {clone}"
    if action == "actions/setup-python":
        return "this interpreter"
    if action == "actions/upload-artifact":
        paths = [line.strip() for line in substitute(str(step["with"]["path"]), context).splitlines()
                 if line.strip()]
        result.artifacts += [clone / p for p in paths]
        return f"artifact {step['with'].get('name')}: {paths}"
    raise ValueError(f"no stand-in for the action {action}")


def run_gitlab_job(pipeline: Mapping[str, Any], job: str, clone: Path, base_env: Mapping[str, str],
                   predefined: Mapping[str, str], variables: Mapping[str, str], *,
                   skip: Optional[Callable[[str], bool]] = None, timeout_s: float = 600) -> Tuple[int, bool, str]:
    """Run ``job``'s ``before_script`` + ``script`` in ``clone``: ``predefined`` (the CI_* variables), then
    the YAML's ``variables`` (expanded from those), then ``variables`` (project CI/CD variables, which take
    precedence over the YAML's); entries for which ``skip(entry)`` is true are left out. Returns (exit code,
    whether the job counts as passed -- 0, or an allowed failure code --, output)."""
    spec = pipeline[job]
    env: Dict[str, str] = dict(base_env)
    env.update(predefined)
    env.update(CI="true", GITLAB_CI="true")
    for name, value in {**(pipeline.get("variables") or {}), **(spec.get("variables") or {})}.items():
        env[name] = _expand(str(value), env)
    env.update(variables)
    entries = [e for e in [*spec.get("before_script", []), *spec["script"]] if not (skip and skip(e))]
    groups: List[int] = []
    try:
        code, out = _run_shell(["bash", "--noprofile", "--norc", "-eo", "pipefail", "-c"], "\n".join(entries),
                               clone, env, groups, timeout_s)
    finally:
        _kill_groups(groups)
    allowed = (spec.get("allow_failure") or {}).get("exit_codes", []) if isinstance(
        spec.get("allow_failure"), dict) else []
    return code, code == 0 or code in allowed, out


def _expand(value: str, env: Mapping[str, str]) -> str:
    """GitLab expands ``$VAR`` / ``${VAR}`` in variables from the variables defined so far."""
    return re.sub(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?", lambda m: env.get(m.group(1), ""), value)
