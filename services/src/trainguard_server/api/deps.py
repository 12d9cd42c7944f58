"""Request dependencies: the services container and read-token authentication (project scoping)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Annotated, Any, Optional, Tuple

from fastapi import Depends, Header, HTTPException, Request
from starlette.concurrency import run_in_threadpool

from ..request_headers import HeaderConflict, one_authorization
from ..storage.base import EventStore, IncidentStore, MetricStore, ProjectStore, format_ns


@dataclass
class Services:
    """Everything a route may use; built once by the server and put on ``app.state.services``."""

    events: EventStore
    metrics: MetricStore
    incidents: IncidentStore
    projects: ProjectStore
    queue: Any = None
    gateway: Any = None
    processor: Any = None
    settings: Any = None
    data_dir_id: Optional[Tuple[int, int]] = field(default=None, init=False)
    """(device, inode) of the data directory when the services were built: /readyz tells when it was deleted
    or replaced under the running server (its stores would write on into unlinked files)."""

    def __post_init__(self) -> None:
        self.data_dir_id = directory_id(getattr(self.settings, "data_dir", None))


def directory_id(path: Any) -> Optional[Tuple[int, int]]:
    """(st_dev, st_ino) of the directory at ``path``; None when there is none (or no path)."""
    if path is None:
        return None
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino) if os.path.isdir(path) else None


def get_services(request: Request) -> Services:
    services: Services = request.app.state.services
    return services


ServicesDep = Annotated[Services, Depends(get_services)]


def authenticate_read(services: Services, authorization: Optional[str]) -> str:
    """The project a read token grants (``authorization`` is the header's value). HTTPException 401 without a
    valid token, 403 for an ingest token."""
    if not authorization:
        raise HTTPException(401, "missing Authorization: Bearer <read token>",
                            headers={"WWW-Authenticate": "Bearer"})
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise HTTPException(401, "Authorization must be 'Bearer <read token>'",
                            headers={"WWW-Authenticate": "Bearer"})
    info = services.projects.authenticate(token.strip())
    if info is None:
        expired = services.projects.expired_at(token.strip())
        detail = f"token expired at {format_ns(expired)}: create a new one" if expired else \
            "unknown or revoked token"
        raise HTTPException(401, detail, headers={"WWW-Authenticate": "Bearer"})
    if info.kind != "read":
        raise HTTPException(403, f"{info.kind} tokens cannot read; use a read token")
    return info.project


_PROJECT_STATE = "trainguard_read_project"


async def ensure_read_token(request: Request) -> str:
    """:func:`authenticate_read` for ``request``, once per request (the answer is kept in its state)."""
    project: Optional[str] = getattr(request.state, _PROJECT_STATE, None)
    if project is None:
        try:  # which token counts would be a guess (a proxy may read another one): ingest's rule too
            value = one_authorization(request.headers.getlist("authorization"), "read", sent_as="headers")
        except HeaderConflict as exc:
            raise HTTPException(401, str(exc), headers={"WWW-Authenticate": "Bearer"}) from None
        project = await run_in_threadpool(authenticate_read, get_services(request), value)
        setattr(request.state, _PROJECT_STATE, project)
    return project


async def read_project(request: Request,
                       authorization: Annotated[Optional[str], Header()] = None) -> str:
    """The project a read token grants. 401 without a valid token, 403 for an ingest token.
    (``authorization`` is declared so the OpenAPI shows the header; the value is read from ``request``.)"""
    return await ensure_read_token(request)


ProjectDep = Annotated[str, Depends(read_project)]
