"""Request bodies in, JSON answers out: what every route of the engine server shares.

Errors: /generate and control routes answer 400 with {"error": {"message": ...}}; weight routes
answer {"success": false, "message": ...} with 400, both as SGLang does.
"""
from __future__ import annotations

import json

from aiohttp import web

from nano_miles.engine.protocol import RequestError


def error(message: str, status: int = 400) -> web.Response:
    return web.json_response({"error": {"message": message}}, status=status)


def weight_answer(success: bool, message: str) -> web.Response:
    return web.json_response({"success": success, "message": message}, status=200 if success else 400)


async def json_body(request: web.Request, default=None) -> dict:
    """The body as a JSON object; `default` for an empty body if given, else RequestError."""
    raw = await request.read()
    if not raw.strip():
        if default is not None:
            return default
        raise RequestError("the request body is empty; send a JSON object")
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RequestError(f"invalid JSON: {e}") from None
    if not isinstance(body, dict):
        raise RequestError("the body must be a JSON object")
    return body
