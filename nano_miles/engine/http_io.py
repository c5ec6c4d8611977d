"""Request bodies in, JSON answers out: what every route of the engine server shares.

A body is read under its route's cap (weight routes take large bodies, the others not), refused with
413 before it is read when its Content-Length is over it. A small body is parsed on the event loop,
a large one in a child process (json_parser.py says why), so that no request stalls the others.

Errors: /generate and control routes answer 400 with {"error": {"message": ...}}; weight routes
{"success": false, "message": ...} with 400, both as SGLang does. Every answer is valid JSON: a NaN
or an infinity (log-probs of weights that overflow) goes out as null.
"""
from __future__ import annotations

import asyncio
import json
import math
import multiprocessing
import tempfile
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

from aiohttp import web

from nano_miles.engine import json_parser
from nano_miles.engine.protocol import RequestError

MiB = 1 << 20
INLINE_PARSE_BYTES = 1 * MiB  # parsed on the event loop (a few ms at most); larger bodies in the child


class BodyTooLarge(RequestError):
    status = 413


def _finite(value):  # every NaN and infinity -> None
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    return [_finite(v) for v in value] if isinstance(value, (list, tuple)) else value


def dumps(value) -> str:
    """Always valid JSON: non-finite floats become null (the value is walked only when it holds one)."""
    try:
        return json.dumps(value, allow_nan=False)
    except ValueError:
        return json.dumps(_finite(value), allow_nan=False)


def json_response(value, status: int = 200) -> web.Response:
    return web.json_response(value, status=status, dumps=dumps)


def error(message: str, status: int = 400) -> web.Response:
    return json_response({"error": {"message": message}}, status=status)


def weight_answer(success: bool, message: str) -> web.Response:
    return json_response({"success": success, "message": message}, status=200 if success else 400)


def check_length(request: web.Request, limit: int, key: str) -> None:  # 413 before reading the body
    if request.content_length is not None and request.content_length > limit:
        raise BodyTooLarge(f"the body is {request.content_length / MiB:.1f} MiB; {request.path} takes at most "
                           f"{limit / MiB:g} MiB (config key {key})")


class BodyParser:
    """Parses JSON bodies for one server: small ones inline, large ones in ONE child process
    (spawned at start, not forked from a process that runs the engine's threads)."""

    def __init__(self):
        self._pool = None

    def start(self) -> None:
        self._pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"),
                                         initializer=json_parser.die_with_parent)
        self._pool.submit(json_parser.loads, b"{}")  # spawn it now, not on the first large body

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    async def json(self, request: web.Request, limit: int, key: str, default=None) -> dict:
        """The body as a JSON object of at most `limit` bytes (the middleware checked its Content-Length
        already); `default` for an empty body if given."""
        data, size, spool = bytearray(), 0, None
        try:
            async for chunk in request.content.iter_chunked(MiB):
                size += len(chunk)
                if size > limit:
                    raise BodyTooLarge(f"the body is over {limit / MiB:g} MiB, the most {request.path} takes "
                                       f"(config key {key})")
                data += chunk
                if size > INLINE_PARSE_BYTES:  # large: spooled to a file for the child
                    if spool is None:  # deleted when closed
                        spool = tempfile.NamedTemporaryFile(prefix="nano-miles-body-", suffix=".json")
                    spool.write(data)
                    data.clear()
            request["body_bytes"] = size
            if spool is None:
                if not data or data.isspace():
                    if default is not None:
                        return default
                    raise RequestError("the request body is empty; send a JSON object")
                body = json_parser.loads(data)
            else:
                spool.flush()
                body = await self._parse_in_child(spool.name)
        except json_parser.BodyError as e:
            raise RequestError(str(e)) from None
        finally:
            if spool is not None:
                await asyncio.to_thread(spool.close)
        if not isinstance(body, dict):
            raise RequestError("the body must be a JSON object")
        return body

    async def _parse_in_child(self, path: str):
        try:
            skeleton = await asyncio.get_running_loop().run_in_executor(self._pool, json_parser.parse_file, path)
        except BrokenProcessPool:  # the child died (killed for memory?): a fresh one for the next body
            self.close()
            self.start()
            raise RequestError("the body could not be parsed: the parser process died") from None
        return await asyncio.to_thread(json_parser.unpack_file, skeleton, path)


async def json_body(request: web.Request, default=None) -> dict:
    """The request's JSON object, read under the cap the server's middleware chose for its route."""
    return await request.config_dict["body_parser"].json(request, *request["body_limit"], default)


def is_large(request: web.Request) -> bool:  # then its validation should leave the event loop too
    return request.get("body_bytes", 0) > INLINE_PARSE_BYTES


async def release(request: web.Request, body) -> None:
    """Free a large body's lists off the event loop (json_parser.release); a small one frees itself."""
    if is_large(request):
        await asyncio.to_thread(json_parser.release, body)
