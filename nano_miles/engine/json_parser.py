"""Large JSON request bodies, parsed in a child process (http_io.BodyParser runs it).

Why a process: json.loads is one C call holding the GIL for its whole run (most of a second for a
large /generate body), so even in a thread it would stall the event loop, /health included. The child
writes every long int list (token ids) back into the spooled file as raw int32/int64 and answers with
the rest; the server reads them back, and frees them, a slice at a time in a thread. This module
imports nothing heavy: the child imports only it.
"""
from __future__ import annotations

import ctypes
import json
import signal
import sys
import time
from array import array
from typing import NamedTuple

MAX_DEPTH = 64    # our bodies nest 4 deep; anything deeper is refused, not recursed into
_PACK_MIN = 64    # int lists at least this long go back through the file
_SLICE = 1 << 15  # ints per slice when the server reads or frees them


class BodyError(ValueError):
    """The body is not acceptable JSON; the message goes back with HTTP 400."""


class Packed(NamedTuple):
    """A list of ints the child wrote to the file: `count` items of array typecode `typecode` at `offset`."""
    offset: int
    typecode: str
    count: int


def die_with_parent():
    """In a child (the body parser, or an engine before exec): SIGTERM when the thread that started it
    dies, even by SIGKILL."""
    if sys.platform == "linux":
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def loads(raw: bytes | bytearray):
    """json.loads with one-line errors (BodyError), a too-deep body included."""
    try:
        return json.loads(raw)
    except RecursionError:
        raise BodyError("the JSON is nested too deeply") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise BodyError(f"invalid JSON: {e}") from None


def parse_file(path: str):
    """In the child: parse the body in `path`, write its long int lists back into `path`, return the rest."""
    with open(path, "rb") as f:
        body = loads(f.read())
    with open(path, "wb") as f:
        return _pack(body, 0, f)


def _pack(x, depth: int, f):
    if depth > MAX_DEPTH:
        raise BodyError(f"the JSON is nested too deeply (more than {MAX_DEPTH} levels)")
    if isinstance(x, dict):
        return {k: _pack(v, depth + 1, f) for k, v in x.items()}
    if not isinstance(x, list):
        return x
    if len(x) >= _PACK_MIN and all(type(v) is int for v in x):
        for typecode in ("i", "q"):  # token ids fit int32: half the bytes
            try:
                a = array(typecode, x)
            except OverflowError:
                continue
            offset = f.tell()
            a.tofile(f)
            return Packed(offset, typecode, len(a))
        # beyond int64: kept as a list, the validation will say why
    return [_pack(v, depth + 1, f) for v in x]


def unpack_file(skeleton, path: str):
    """In a thread of the server: the body, its packed lists read back from `path` a slice at a time."""
    with open(path, "rb", buffering=0) as f:
        return _unpack(skeleton, f)


def _unpack(x, f):
    if isinstance(x, list):
        return [_unpack(v, f) for v in x]
    if isinstance(x, dict):
        return {k: _unpack(v, f) for k, v in x.items()}
    if not isinstance(x, Packed):
        return x
    out = []
    f.seek(x.offset)
    for start in range(0, x.count, _SLICE):
        part = array(x.typecode)
        try:  # the read releases the GIL; the slice's tolist is well under a millisecond
            part.fromfile(f, min(_SLICE, x.count - start))
        except EOFError:
            raise BodyError("the parsed body could not be read back") from None
        out += part.tolist()
        time.sleep(0)  # hand the GIL over now rather than after the 5 ms switch interval
    return out


def release(x) -> None:
    """In a thread of the server: empty a large body's lists a slice at a time, from the end (no
    memmove): dropping millions of ints at once is one C call holding the GIL for a second."""
    if isinstance(x, dict):
        for v in x.values():
            release(v)
    elif isinstance(x, list):
        nested = bool(x) and isinstance(x[0], (list, dict))  # a batch of prompts, not one prompt's ids
        while x:
            tail = x[-_SLICE:]
            del x[-_SLICE:]
            if nested:
                for v in tail:
                    release(v)
            del tail
            time.sleep(0)
