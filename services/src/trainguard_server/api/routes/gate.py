"""The CI gate: named baselines (a set of runs summarised into a profile) and the verdict for a canary run.

Like the incident workflow's actions, defining or deleting a baseline takes the project's read token
(whoever can read a project's runs can profile them; there is no finer role yet). A project holds at most
``project_max_baselines`` (a new name past it is 409: redefine or delete one); the listing is paged. The
gate answers 200 with a verdict for every outcome it can describe -- including ``undecided`` (an unknown
baseline or run, a run still running): the verdict's ``exit_code`` and ``reason`` say what a CI job should
do. A malformed request or policy is a 422 naming the field.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

from fastapi import APIRouter, HTTPException, Query, Response
from pydantic import BaseModel, ConfigDict, Field

from ...gate.baselines import Baseline
from ...gate.policy import Policy, policy_from_dict
from ...gate.service import GateError, GateService, TooManyBaselines
from ...storage.common import decode_cursor, encode_cursor
from ..deps import ProjectDep, ServicesDep
from ..preflight import ReadTokenFirstRoute
from .common import MAX_LIMIT, CursorQuery, not_found
from .stream import setting

router = APIRouter(prefix="/api/v1", tags=["CI gate"], route_class=ReadTokenFirstRoute)


class BaselineDefine(BaseModel):
    model_config = ConfigDict(extra="forbid")
    tag: str = Field("", max_length=256, description="the runs carrying this tag (key=value or key), "
                     "resolved now: later runs with the tag do not join")
    runs: List[str] = Field([], max_length=200, description="or these runs")
    description: str = Field("", max_length=2000)
    policy: Optional[Dict[str, Any]] = Field(None, description="policy overrides; its profile keys (loss "
                                             "metric, transform, smoothing, grid, metrics) shape the profile")


class BaselinePublic(BaseModel):
    project: str
    name: str
    runs: List[str] = Field(description="the runs it was defined from")
    tag: str = ""
    description: str = ""
    created_ns: int
    updated_ns: int
    profile: Dict[str, Any] = Field(description="summary: runs used, runs left out and why, incident kinds, "
                                    "fingerprints, loss envelope range, step-time and peak-memory values")


class BaselineList(BaseModel):
    items: List[BaselinePublic]
    next_cursor: Optional[str] = Field(None, description="the `cursor` of the next page (null on the last)")


#: baselines in one page of ``GET /baselines`` unless ``limit`` says otherwise: each answer is bounded by the
#: page, not by how many the project defined (stop 44: 2,000 baselines were one 5.1 MB answer of 0.47 s)
BASELINES_PAGE = 50


class GateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    baseline: str = Field(..., min_length=1, max_length=128)
    candidate: str = Field(..., min_length=1, max_length=256, description="the canary's run id")
    policy: Optional[Dict[str, Any]] = Field(None, description="policy overrides (the YAML file as JSON)")


class CheckPublic(BaseModel):
    name: str
    status: str = Field(description="pass | warn | fail | undecided | skip")
    summary: str
    details: List[str] = []
    figures: Dict[str, Any] = {}


class VerdictPublic(BaseModel):
    verdict: str = Field(description="pass | warn | fail | undecided")
    exit_code: int = Field(description="0 pass (or warn), 1 fail, 2 could not decide")
    reason: str
    baseline: str
    candidate: str
    checks: List[CheckPublic] = []
    plot: Dict[str, Any] = Field({}, description="loss envelope (centre, band) and the candidate's smoothed "
                                 "loss at the matched steps, in the metric's units")
    notes: List[str] = []
    policy: Dict[str, Any] = Field({}, description="the effective policy")


def _policy(data: Optional[Dict[str, Any]]) -> Policy:
    try:
        return policy_from_dict(data)
    except ValueError as exc:
        raise HTTPException(422, str(exc)) from None


def _service(project: str, services: Any) -> GateService:
    return GateService(services.incidents, services.metrics, services.events, project)


def _public(baseline: Baseline) -> BaselinePublic:
    return BaselinePublic(project=baseline.project, name=baseline.name, runs=baseline.runs, tag=baseline.tag,
                          description=baseline.description, created_ns=baseline.created_ns,
                          updated_ns=baseline.updated_ns, profile=baseline.get_profile().summary())


@router.put("/baselines/{name}", response_model=BaselinePublic,
            responses={409: {"description": "a new name while the project holds project_max_baselines"}},
            summary="Define (or redefine) a named baseline from a tag or a list of runs")
def define_baseline(name: str, body: BaselineDefine, project: ProjectDep,
                    services: ServicesDep) -> BaselinePublic:
    policy = _policy(body.policy)
    limit = int(setting(services, "project_max_baselines"))
    try:
        baseline = _service(project, services).define(name, policy, tag=body.tag, runs=body.runs,
                                                       description=body.description, max_baselines=limit)
    except TooManyBaselines as exc:
        raise HTTPException(409, str(exc)) from None
    except GateError as exc:
        raise HTTPException(422, str(exc)) from None
    return _public(baseline)


@router.delete("/baselines/{name}", status_code=204, response_class=Response,
               responses={404: {"description": "unknown"}}, summary="Delete a named baseline")
def delete_baseline(name: str, project: ProjectDep, services: ServicesDep) -> Response:
    if not _service(project, services).delete(name):
        raise not_found("baseline", name)
    return Response(status_code=204)


@router.get("/baselines", response_model=BaselineList, responses={400: {"description": "invalid cursor"}},
            summary="The project's baselines, by name, a page at a time")
def list_baselines(project: ProjectDep, services: ServicesDep,
                   limit: int = Query(BASELINES_PAGE, ge=1, le=MAX_LIMIT,
                                      description=f"page size, 1..{MAX_LIMIT}"),
                   cursor: Optional[str] = CursorQuery) -> BaselineList:
    """Baselines in name order; ``next_cursor`` (null on the last page) is the ``cursor`` of the next page.
    Only the page's baselines are read and summarised, not every one the project has."""
    service = _service(project, services)
    names = sorted(service.names())
    if cursor is not None:
        try:
            after = decode_cursor(cursor, "baselines", [project], [str])[0]
        except ValueError as exc:
            raise HTTPException(400, str(exc)) from None
        names = [n for n in names if n > after]
    page = names[:limit]
    found = [service.get(n) for n in page]
    more = encode_cursor("baselines", [project], [page[-1]]) if len(names) > limit else None
    return BaselineList(items=[_public(b) for b in found if b is not None], next_cursor=more)


@router.get("/baselines/{name}", response_model=BaselinePublic, responses={404: {"description": "unknown"}})
def get_baseline(name: str, project: ProjectDep, services: ServicesDep) -> BaselinePublic:
    baseline = _service(project, services).get(name)
    if baseline is None:
        raise not_found("baseline", name)
    return _public(baseline)


@router.post("/gate", response_model=VerdictPublic,
             summary="Gate a canary run against a baseline: pass / warn / fail / undecided")
def gate(body: GateRequest, project: ProjectDep, services: ServicesDep) -> VerdictPublic:
    policy = _policy(body.policy)
    verdict = _service(project, services).gate(body.baseline, body.candidate, policy)
    return VerdictPublic(**verdict.to_dict(), policy=policy.to_dict())
