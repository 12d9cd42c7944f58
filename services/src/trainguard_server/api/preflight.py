"""The app-wide dependency every query-API request passes first (``FastAPI(dependencies=[...])``), before
the route's own dependencies and parameters:

* a route that needs a read token checks it first (:func:`~.deps.ensure_read_token`; the route's own
  ``read_project`` then reuses the answer), so a request without a valid token gets its 401/403 whatever
  else is wrong with its parameters (a route taking a body also needs :class:`ReadTokenFirstRoute`:
  FastAPI reads the body before any dependency);
* a request with a read token (a run's live stream aside) takes one of its project's
  ``api_max_requests_per_project`` slots, or waits for one, then 429 (:mod:`.project_slots`);
* an integer query parameter outside the signed 64-bit range is refused with a 422 naming it
  (``query.rank: Input should be less than or equal to 9223372036854775807``): every integer the API takes
  is bound by the stores as a 64-bit integer, and a bigger one used to reach SQLite and answer 500
  (``OverflowError``). The bounds are also written into the served OpenAPI (:func:`int64_bounds`); a
  parameter's own tighter bound is the one named (``query.limit: ... less than or equal to 500``).
* a query parameter given more than once (``?names=loss&names=lr``, ``?limit=1&limit=500``) is refused with a
  422 naming it and its values: no parameter of this API is a list, and FastAPI would read the last value and
  ignore the others without a word;
* a route taking a body (:class:`ReadTokenFirstRoute`: the incident workflow, the CI gate) reads at most
  :data:`MAX_BODY_BYTES` and refuses a JSON key given twice (422; ingest refuses it too): a bigger body is
  a 413 once that much has arrived (or at once, from its ``Content-Length``). FastAPI would buffer any
  body whole and decode it (a 300 MB note took ~560 MB of the server's memory before its 4,000-character
  limit refused it), so one read token could starve every
  project's ingest of memory.

A route's integer parameters are found once, from its dependency tree (the endpoint's and its dependencies'
``int`` / ``Optional[int]`` query parameters); a value is read with pydantic's own rules (``+1``, `` 2 ``,
``1_000``), and one that is not an integer at all is left to FastAPI's validation, which names it.
"""

from __future__ import annotations

import collections.abc
import json
import types
import typing
from dataclasses import dataclass
from typing import Any, Callable, Coroutine, Dict, Iterator, List, Optional, Sequence, Tuple

from fastapi import HTTPException
from fastapi.dependencies.models import Dependant
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from pydantic import TypeAdapter, ValidationError
from starlette.requests import Request
from starlette.responses import Response

from ..json_keys import DuplicateKey, unique_keys
from ..storage.common import INT64_MAX, INT64_MIN
from .deps import ensure_read_token, read_project
from .project_slots import take_slot

__all__ = ["MAX_BODY_BYTES", "ReadTokenFirstRoute", "int64_bounds", "int_query_params", "needs_read_token",
           "preflight", "single_query_params"]

#: the most bytes a query-API request body may have (its bodies are small JSON objects: a note, a root
#: cause, a gate request with its policy)
MAX_BODY_BYTES = 1 << 20

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
    return list(_int_query_bounds(route))


def _int_query_bounds(route: APIRoute) -> Dict[str, Tuple[int, int]]:
    """``{alias: (lowest, highest)}`` of ``route``'s integer query parameters: their own ``ge``/``le`` (or
    ``gt``/``lt``) within the int64 range, so a value beyond int64 is told the bound the route declares."""
    bounds: Dict[str, Tuple[int, int]] = {}
    for dependant in _dependants(route.dependant):
        for f in dependant.query_params:
            if not _is_int(f.field_info.annotation) or f.alias in bounds:
                continue
            lo, hi = INT64_MIN, INT64_MAX
            for rule in f.field_info.metadata:
                if isinstance(getattr(rule, "ge", None), int):
                    lo = max(lo, rule.ge)
                if isinstance(getattr(rule, "gt", None), int):
                    lo = max(lo, rule.gt + 1)
                if isinstance(getattr(rule, "le", None), int):
                    hi = min(hi, rule.le)
                if isinstance(getattr(rule, "lt", None), int):
                    hi = min(hi, rule.lt - 1)
            bounds[f.alias] = (lo, hi)
    return bounds


def needs_read_token(route: APIRoute) -> bool:
    return any(d.call is read_project for d in _dependants(route.dependant))


def _out_of_range(request: Request, bounds: Sequence[Tuple[str, int, int]]) -> List[Dict[str, Any]]:
    errors: List[Dict[str, Any]] = []
    for name, lo, hi in bounds:
        for raw in request.query_params.getlist(name):
            try:
                value = _INT.validate_python(raw)
            except ValidationError:
                continue  # not an integer: FastAPI's own validation names it
            if value > INT64_MAX:  # the route's own bound when tighter (``limit``: 500, not 2**63 - 1)
                errors.append({"type": "less_than_equal", "loc": ("query", name), "input": raw,
                               "msg": f"Input should be less than or equal to {hi}", "ctx": {"le": hi}})
            elif value < INT64_MIN:
                errors.append({"type": "greater_than_equal", "loc": ("query", name), "input": raw,
                               "msg": f"Input should be greater than or equal to {lo}", "ctx": {"ge": lo}})
    return errors


_SEQUENCES = (list, tuple, set, frozenset, collections.abc.Sequence, collections.abc.Set)


def _is_sequence(annotation: Any) -> bool:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return any(_is_sequence(a) for a in typing.get_args(annotation))
    origin = typing.get_origin(annotation) or annotation
    return isinstance(origin, type) and issubclass(origin, _SEQUENCES) and origin not in (str, bytes)


def single_query_params(route: APIRoute) -> Dict[str, str]:
    """``{alias: hint}`` of ``route``'s query parameters that take one value (all of this API's: ``names`` is
    comma-separated), its dependencies' included; ``hint`` is said when one is repeated."""
    found: Dict[str, str] = {}
    for dependant in _dependants(route.dependant):
        for f in dependant.query_params:
            if f.alias in found or _is_sequence(f.field_info.annotation):
                continue
            comma = "comma-separated" in (f.field_info.description or "")
            found[f.alias] = f" ({f.alias}: comma-separated)" if comma else ""
    return found


def _repeated(request: Request, params: Sequence[Tuple[str, str]]) -> List[Dict[str, Any]]:
    """A 422 error for each one-value parameter given more than once: FastAPI reads the last and ignores the
    others without a word (``names=loss&names=lr`` answered lr alone), and a proxy or cache keyed on the
    first would see another request than the one answered."""
    errors: List[Dict[str, Any]] = []
    if len(request.query_params.multi_items()) == len(request.query_params):
        return errors  # no key repeated (the common case: one comparison)
    for name, hint in params:
        values = request.query_params.getlist(name)
        if len(values) > 1:
            shown = ", ".join(repr(v[:40]) for v in values[:4]) + (", ..." if len(values) > 4 else "")
            errors.append({"type": "repeated", "loc": ("query", name), "input": values,
                           "msg": f"given {len(values)} times ({shown}); give it once{hint}"})
    return errors


@dataclass(frozen=True)
class _Plan:
    needs_token: bool
    int_params: Tuple[Tuple[str, int, int], ...]
    bounded: bool  # takes one of its project's request slots (project_slots.py): not a live stream
    single_params: Tuple[Tuple[str, str], ...] = ()


_plans: Dict[int, Tuple[APIRoute, _Plan]] = {}


def _plan(route: APIRoute) -> _Plan:
    found = _plans.get(id(route))
    if found is None or found[0] is not route:
        token = needs_read_token(route)
        found = _plans[id(route)] = (route, _Plan(token, tuple(
            (name, lo, hi) for name, (lo, hi) in _int_query_bounds(route).items()),
            token and not route.path.endswith("/stream"), tuple(single_query_params(route).items())))
    return found[1]


async def preflight(request: Request) -> None:
    """The checks of the module doc, for the route ``request`` was routed to."""
    route = request.scope.get("route")
    if not isinstance(route, APIRoute):
        return
    plan = _plan(route)
    if plan.needs_token:
        project = await ensure_read_token(request)
        if plan.bounded:
            await take_slot(request, project)
    errors = _repeated(request, plan.single_params)
    if plan.int_params:
        errors += _out_of_range(request, plan.int_params)
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
            await _read_bounded_body(request, MAX_BODY_BYTES)
            return await handler(request)

        return token_first


def _too_large(size: str, limit: int) -> HTTPException:
    return HTTPException(413, f"request body {size} is larger than {limit} bytes, the most this API takes "
                              f"(its bodies are small JSON objects)")


async def _read_bounded_body(request: Request, limit: int) -> None:
    """Read ``request``'s body into the request (where FastAPI then takes it from), refusing with a 413 to
    hold more than ``limit`` bytes: a declared ``Content-Length`` over it at once, a chunked one when it
    gets there."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(f"of {int(declared)} bytes", limit)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise _too_large("of more bytes", limit)
    request._body = bytes(body)  # Request.body() returns it from here
    if body and _media_type(request.headers.get("content-type")).endswith("json"):
        try:
            request._json = json.loads(body, object_pairs_hook=unique_keys)  # Request.json() returns it
        except DuplicateKey as exc:
            raise HTTPException(422, f"body: {exc}") from None
        except (ValueError, RecursionError):
            pass  # FastAPI's own decoding says what is wrong (see app.py)


def _media_type(value: Optional[str]) -> str:
    return (value or "").split(";", 1)[0].strip().lower()


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
