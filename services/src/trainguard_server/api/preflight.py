"""The app-wide dependency every query-API request passes first (``FastAPI(dependencies=[...])``), before
the route's own dependencies and parameters:

* a route that needs a read token checks it first (:func:`~.deps.ensure_read_token`; the route's own
  ``read_project`` then reuses the answer), so a request without a valid token gets its 401/403 whatever
  else is wrong with its parameters (a route taking a body also needs :class:`ReadTokenFirstRoute`:
  FastAPI reads the body before any dependency);
* an integer query parameter outside the signed 64-bit range is refused with a 422 naming it
  (``query.rank: Input should be less than or equal to 9223372036854775807``): every integer the API takes
  is bound by the stores as a 64-bit integer, and a bigger one used to reach SQLite and answer 500
  (``OverflowError``). The bounds are also written into the served OpenAPI (:func:`int64_bounds`).

A route's integer parameters are found once, from its dependency tree (the endpoint's and its dependencies'
``int`` / ``Optional[int]`` query parameters); a value is read with pydantic's own rules (``+1``, `` 2 ``,
``1_000``), and one that is not an integer at all is left to FastAPI's validation, which names it.
"""

from __future__ import annotations

import types
import typing
from dataclasses import dataclass
from typing import Any, Callable, Coroutine, Dict, Iterator, List, Sequence, Tuple

from fastapi.dependencies.models import Dependant
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from pydantic import TypeAdapter, ValidationError
from starlette.requests import Request
from starlette.responses import Response

from ..storage.common import INT64_MAX, INT64_MIN
from .deps import ensure_read_token, read_project

__all__ = ["ReadTokenFirstRoute", "int64_bounds", "int_query_params", "needs_read_token", "preflight"]

_INT = TypeAdapter(int)


def _dependants(root: Dependant) -> Iterator[Dependant]:
    stack = [root]
    while stack:
        current = stack.pop()
        yield current
        stack.extend(current.dependencies)


def _is_int(annotation: Any) -> bool:
    if annotation is int:
        return True
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return args == [int]
    return False


def int_query_params(route: APIRoute) -> List[str]:
    """The names (aliases) of ``route``'s integer query parameters, its dependencies' included."""
    names: List[str] = []
    for dependant in _dependants(route.dependant):
        names.extend(f.alias for f in dependant.query_params
                     if _is_int(f.field_info.annotation) and f.alias not in names)
    return names


def needs_read_token(route: APIRoute) -> bool:
    return any(d.call is read_project for d in _dependants(route.dependant))


def _out_of_range(request: Request, names: Sequence[str]) -> List[Dict[str, Any]]:
    errors: List[Dict[str, Any]] = []
    for name in names:
        for raw in request.query_params.getlist(name):
            try:
                value = _INT.validate_python(raw)
            except ValidationError:
                continue  # not an integer: FastAPI's own validation names it
            if value > INT64_MAX:
                errors.append({"type": "less_than_equal", "loc": ("query", name), "input": raw,
                               "msg": f"Input should be less than or equal to {INT64_MAX}",
                               "ctx": {"le": INT64_MAX}})
            elif value < INT64_MIN:
                errors.append({"type": "greater_than_equal", "loc": ("query", name), "input": raw,
                               "msg": f"Input should be greater than or equal to {INT64_MIN}",
                               "ctx": {"ge": INT64_MIN}})
    return errors


@dataclass(frozen=True)
class _Plan:
    needs_token: bool
    int_params: Tuple[str, ...]


_plans: Dict[int, Tuple[APIRoute, _Plan]] = {}


def _plan(route: APIRoute) -> _Plan:
    found = _plans.get(id(route))
    if found is None or found[0] is not route:
        found = _plans[id(route)] = (route, _Plan(needs_read_token(route), tuple(int_query_params(route))))
    return found[1]


async def preflight(request: Request) -> None:
    """The checks of the module doc, for the route ``request`` was routed to."""
    route = request.scope.get("route")
    if not isinstance(route, APIRoute):
        return
    plan = _plan(route)
    if plan.needs_token:
        await ensure_read_token(request)
    if plan.int_params:
        errors = _out_of_range(request, plan.int_params)
        if errors:
            raise RequestValidationError(errors)


class ReadTokenFirstRoute(APIRoute):
    """A route that checks its read token before FastAPI reads and validates the request body.

    FastAPI decodes a JSON body before it solves any dependency, so a route taking a body answered a
    malformed one with 422 even without a token. Routers whose routes take a body use this class
    (``APIRouter(route_class=ReadTokenFirstRoute)``): a request without a valid read token gets its 401/403
    first, whatever its body."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        if not needs_read_token(self):
            return handler

        async def token_first(request: Request) -> Response:
            await ensure_read_token(request)
            return await handler(request)

        return token_first


def int64_bounds(schema: Dict[str, Any]) -> None:
    """Write the 64-bit bounds :func:`preflight` enforces into ``schema`` (the app's OpenAPI), in place: every
    integer query parameter gets ``minimum``/``maximum`` within the int64 range."""
    for operations in schema.get("paths", {}).values():
        for operation in operations.values():
            for param in operation.get("parameters", []) if isinstance(operation, dict) else ():
                if param.get("in") != "query":
                    continue
                for sub in _int_schemas(param.get("schema", {})):
                    sub["maximum"] = min(sub.get("maximum", INT64_MAX), INT64_MAX)
                    sub["minimum"] = max(sub.get("minimum", INT64_MIN), INT64_MIN)


def _int_schemas(schema: Dict[str, Any]) -> Iterator[Dict[str, Any]]:
    if schema.get("type") == "integer":
        yield schema
    for sub in schema.get("anyOf", []):
        yield from _int_schemas(sub)
