"""The error answers of the served OpenAPI, made to say what the app does.

Every error body of this API is ``{"detail": "<one readable sentence>"}`` (:class:`~.schemas.ErrorPublic`):
a 422 too -- the app's validation handler joins pydantic's errors into one sentence naming the fields
(``query.limit: Input should be ...``) -- where FastAPI's generated schema says an array of error objects.
:func:`document_errors` rewrites the generated schema, in place:

* ``HTTPValidationError`` (what every 422 refers to) becomes ``{"detail": string}``;
* a read route (it declares the ``Authorization`` header) documents 401 (with ``WWW-Authenticate``) and 403,
  and, but a run's live stream, 429 with ``Retry-After`` (its project's requests in flight:
  :mod:`.project_slots`);
* a route with a path parameter under ``/api/`` documents 404 (no such run / incident / cluster / baseline);
* a route with a query parameter or a body documents 400 (a value it cannot use: a cursor from another
  listing, an unknown status, bad search syntax, an empty step range, a body that cannot be parsed);
* every error response without content gets the ``{"detail": string}`` body.

What a route documents itself is kept (its description wins).
"""

from __future__ import annotations

from typing import Any, Dict

from .schemas import ErrorPublic

__all__ = ["document_errors"]

_ERROR_REF = {"$ref": "#/components/schemas/ErrorPublic"}
_DESCRIPTIONS = {
    "400": "a parameter or body value this route cannot use (the detail says which)",
    "401": "missing, unknown, revoked or expired read token",
    "403": "not a read token",
    "404": "no such object in the token's project",
    "429": "this project has api_max_requests_per_project requests in flight and none finished within "
           "api_request_wait_s: retry after Retry-After seconds",
}


def _add(responses: Dict[str, Any], status: str) -> None:
    responses.setdefault(status, {"description": _DESCRIPTIONS[status]})


def document_errors(schema: Dict[str, Any]) -> None:
    """Rewrite ``schema`` (the app's generated OpenAPI) as the module doc says."""
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    components["ErrorPublic"] = ErrorPublic.model_json_schema()
    components["HTTPValidationError"] = {
        "title": "HTTPValidationError", "type": "object", "required": ["detail"],
        "properties": {"detail": {"type": "string", "title": "Detail",
                                  "description": "the invalid fields and why, in one sentence: "
                                                 "'query.limit: Input should be ...; body.by: ...'"}}}
    components.pop("ValidationError", None)
    for path, operations in schema.get("paths", {}).items():
        for operation in operations.values():
            if not isinstance(operation, dict) or "responses" not in operation:
                continue
            responses: Dict[str, Any] = operation["responses"]
            params = operation.get("parameters", [])
            where = {p.get("in") for p in params}
            if any(p.get("in") == "header" and p.get("name", "").lower() == "authorization" for p in params):
                _add(responses, "401")
                responses["401"].setdefault("headers", {"WWW-Authenticate": {
                    "description": "Bearer", "schema": {"type": "string"}}})
                _add(responses, "403")
                if not path.endswith("/stream"):
                    _add(responses, "429")
                    responses["429"].setdefault("headers", {"Retry-After": {
                        "description": "seconds", "schema": {"type": "integer"}}})
            if "path" in where and path.startswith("/api/"):
                _add(responses, "404")
            if "query" in where or "requestBody" in operation:
                _add(responses, "400")
            for status, response in responses.items():
                if status[:1] in ("4", "5") and not response.get("content"):
                    response["content"] = {"application/json": {"schema": dict(_ERROR_REF)}}
