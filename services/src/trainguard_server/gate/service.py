"""Defining baselines and gating candidates over the stores: what the API route and
``trainguard gate --data-dir`` call (fetch -> pure profile / comparison -> persist)."""

from __future__ import annotations

import time
from typing import List, Optional, Sequence

from ..storage.base import EventStore, IncidentStore, MetricStore
from ..storage.common import parse_tag_filter
from .baselines import Baseline, BaselineRepo, check_name
from .compare import Verdict, evaluate, undecided
from .fetch import MAX_RUNS, StoreReader
from .policy import Policy
from .profile import RunData, build_profile


class GateError(ValueError):
    """A request the gate refuses (bad name, no runs, unknown runs): the message says why."""


class TooManyBaselines(GateError):
    """A new baseline for a project already holding ``project_max_baselines`` (HTTP 409)."""


class GateService:
    """The gate over one project's stores."""

    def __init__(self, incidents: IncidentStore, metrics: MetricStore, events: EventStore,
                 project: str) -> None:
        self.reader = StoreReader(incidents, metrics, events, project)
        self.repo = BaselineRepo(incidents)
        self.project = project

    @staticmethod
    def _metrics(policy: Policy) -> List[str]:
        return [policy.loss.metric, *policy.step_time.metrics, *policy.peak_memory.metrics]

    def define(self, name: str, policy: Policy, *, tag: str = "", runs: Sequence[str] = (),
               description: str = "", max_baselines: int = 0) -> Baseline:
        """(Re)define ``name`` from the runs carrying ``tag`` or the ``runs`` listed, profile them under
        ``policy`` and store it. GateError when the name is bad, both or neither source is given, the tag
        has no key (only white space before any '=') or matches no run, or a listed run does not exist;
        :class:`TooManyBaselines` when ``name`` is new and the project already holds ``max_baselines`` (0: no
        bound; checked before anything is profiled; concurrent definitions may pass it by how many run at
        once)."""
        try:
            check_name(name)
        except ValueError as exc:
            raise GateError(str(exc)) from None
        if max_baselines and self.repo.get(self.project, name) is None:
            held = len(self.repo.names(self.project))
            if held >= max_baselines:
                raise TooManyBaselines(
                    f"project {self.project!r} holds {held} baselines, the most project_max_baselines="
                    f"{max_baselines} (TRAINGUARD_PROJECT_MAX_BASELINES) allows: redefine one, or delete one "
                    f"(DELETE /api/v1/baselines/{{name}}) first")
        if bool(tag) == bool(runs):
            raise GateError("define a baseline from a tag or from a list of runs (one of them)")
        if tag:
            try:
                parse_tag_filter(tag)  # a key of only white space is the caller's error, not the store's
            except ValueError as exc:
                raise GateError(str(exc)) from None
            run_ids = self.reader.runs_with_tag(tag)
            if not run_ids:
                raise GateError(f"no run of project {self.project!r} has the tag {tag!r}")
        else:
            run_ids = list(dict.fromkeys(r for r in runs if r))
            if len(run_ids) > MAX_RUNS:
                raise GateError(f"a baseline holds at most {MAX_RUNS} runs, got {len(run_ids)}")
        data: List[RunData] = []
        missing = []
        for run_id in run_ids:
            found = self.reader.run_data(run_id, self._metrics(policy))
            if found is None:
                missing.append(run_id)
            else:
                data.append(found)
        if missing:
            raise GateError(f"unknown run(s) in project {self.project!r}: {', '.join(missing)}")
        profile = build_profile(data, policy)
        now = time.time_ns()
        old = self.repo.get(self.project, name)
        baseline = Baseline(project=self.project, name=name, runs=run_ids, tag=tag, description=description,
                            created_ns=old.created_ns if old else now, updated_ns=now,
                            profile=profile.to_dict())
        self.repo.save(baseline)
        return baseline

    def get(self, name: str) -> Optional[Baseline]:
        return self.repo.get(self.project, name)

    def names(self) -> List[str]:
        return self.repo.names(self.project)

    def delete(self, name: str) -> bool:
        """Remove baseline ``name``; False when there is none."""
        return self.repo.delete(self.project, name)

    def gate(self, baseline_name: str, candidate: str, policy: Policy) -> Verdict:
        """The verdict for run ``candidate`` against baseline ``baseline_name``; undecided (exit 2) with the
        reason when the baseline or the run is unknown."""
        baseline = self.repo.get(self.project, baseline_name)
        if baseline is None:
            known = self.names()
            return undecided(baseline_name, candidate, f"no baseline {baseline_name!r} in project "
                             f"{self.project!r}" + (f" (defined: {', '.join(known)})" if known else
                                                    " (none defined: define one first)"))
        profile = baseline.get_profile()
        metrics = [m for m in (profile.loss.metric if profile.loss else "",
                               profile.step_time.metric if profile.step_time else "",
                               profile.peak_memory.metric if profile.peak_memory else "") if m]
        data = self.reader.run_data(candidate, metrics)
        if data is None:
            return undecided(baseline_name, candidate,
                             f"no run {candidate!r} in project {self.project!r} (has it sent anything yet?)")
        return evaluate(profile, data, policy, baseline_name)
