"""What FastAPI cannot infer for the OpenAPI document: the node's bearer token as a ``securitySchemes`` entry
on the routes that need it (every method but the reads ``RequestGuard`` leaves open), and the links from a
session's open to the routes that take its id, so clients and stateful fuzzers can follow them."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

from .guard import READ_METHODS

__all__ = ["SCHEME", "complete_openapi"]

SCHEME = "bearerAuth"
_OPEN_SESSION = ("/v1/weights/sessions", "post")


def complete_openapi(app: FastAPI, *, token: bool) -> None:
    """Add the links, and the scheme where the node sets a ``token``, to ``app``'s OpenAPI document (built once,
    on first request, as FastAPI does)."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = build()
        _link_session_routes(schema)
        if not token:
            return schema
        schema.setdefault("components", {})["securitySchemes"] = {SCHEME: {
            "type": "http", "scheme": "bearer",
            "description": "the node config's token; mutating routes answer 401 without it, reads need none"}}
        for item in schema.get("paths", {}).values():
            for method, operation in item.items():
                if method.upper() not in READ_METHODS and isinstance(operation, dict):
                    operation["security"] = [{SCHEME: []}]
        return schema

    app.openapi = openapi  # type: ignore[method-assign]  # FastAPI's documented way to customise the document


def _link_session_routes(schema: dict[str, Any]) -> None:
    """``POST /v1/weights/sessions`` answers ``session_id``: link it to every operation with that path parameter."""
    paths = schema.get("paths", {})
    opened = paths.get(_OPEN_SESSION[0], {}).get(_OPEN_SESSION[1], {}).get("responses", {}).get("200")
    if opened is None:
        return
    links = opened.setdefault("links", {})
    for path, item in paths.items():
        if "{session_id}" not in path:
            continue
        for operation in item.values():
            if isinstance(operation, dict) and "operationId" in operation:
                links[operation["operationId"]] = {"operationId": operation["operationId"],
                                                   "parameters": {"path.session_id": "$response.body#/session_id"}}
