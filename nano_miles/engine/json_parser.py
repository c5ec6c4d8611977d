"""Large JSON request bodies, parsed in a child process (http_io.BodyParser runs it).

Why a process: json.loads is one C call that holds the GIL for its whole run (~0.7 s for a 64 MiB
/generate body), so in a thread of the server it would still stall the event loop, /health included.
The body goes to the child as a file (the server spools it there while it arrives); the child parses
it and writes every long list of ints (a prompt's token ids) back into the file as raw int32/int64,
answering with the rest of the body and, in their place, where to find them. The server reads them
back a slice at a time, in a thread, and frees them the same way, so its GIL is never held by one
long call. This module imports nothing heavy: the child imports only it.
"""
from __future__ import annotations

import ctypes
import json
import signal
import sys
import time
from array import array
from typing import NamedTuple

MAX_DEPTH = 64        # our bodies nest 4 deep; anything deeper is refused, not recursed into
_PACK_MIN = 64        # int lists at least this long go back through the file
_SLICE = 1 << 15      # ints per slice when the server reads or frees them


class BodyError(ValueError):
    """The body is not acceptable JSON; the message goes back with HTTP 400."""


class Packed(NamedTuple):
    """A list of ints that the child wrote to the file: `count` items of array typecode `typecode`
    at byte `offset`."""
    offset: int
    typecode: str
    count: int


def die_with_parent():
    """The child's initializer: SIGTERM when the server dies, however it dies."""
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


# ----------------------------------------------------------------------------- in the child

def parse_file(path: str):
    """Parse the body in `path`, write its long int lists back into `path`, return the rest."""
    with open(path, "rb") as f:
        body = loads(f.read())
    arrays: list[array] = []
    skeleton = _pack(body, 0, arrays, [0])
    with open(path, "wb") as f:
        for a in arrays:
            a.tofile(f)
    return skeleton


def _pack(x, depth: int, arrays: list, offset: list):
    if depth > MAX_DEPTH:
        raise BodyError(f"the JSON is nested too deeply (more than {MAX_DEPTH} levels)")
    if isinstance(x, list):
        if len(x) >= _PACK_MIN and all(type(v) is int for v in x):
            for typecode in ("i", "q"):  # token ids fit int32: half the bytes
                try:
                    a = array(typecode, x)
                except OverflowError:
                    continue
                arrays.append(a)
                offset[0] += len(a) * a.itemsize
                return Packed(offset[0] - len(a) * a.itemsize, typecode, len(a))
            # beyond int64: kept as a list, the validation will say why
        return [_pack(v, depth + 1, arrays, offset) for v in x]
    if isinstance(x, dict):
        return {k: _pack(v, depth + 1, arrays, offset) for k, v in x.items()}
    return x


# ----------------------------------------------------------------------------- in the server

def unpack_file(skeleton, path: str):
    """In a thread of the server: the body, its packed lists read back from `path` a slice at a time."""
    with open(path, "rb", buffering=0) as f:
        return _unpack(skeleton, f)


def _unpack(x, f):
    if isinstance(x, Packed):
        itemsize = array(x.typecode).itemsize
        buf = memoryview(bytearray(_SLICE * itemsize))
        out: list = []
        f.seek(x.offset)
        for start in range(0, x.count, _SLICE):
            n = min(_SLICE, x.count - start) * itemsize
            got = 0
            while got < n:  # the read releases the GIL; the slice's tolist is ~0.5 ms
                got += f.readinto(buf[got:n]) or _short_read()
            out += buf[:n].cast(x.typecode).tolist()
            time.sleep(0)  # hand the GIL over now rather than after the 5 ms switch interval
        return out
    if isinstance(x, list):
        return [_unpack(v, f) for v in x]
    if isinstance(x, dict):
        return {k: _unpack(v, f) for k, v in x.items()}
    return x


def _short_read():
    raise BodyError("the parsed body could not be read back")


def release(x) -> None:
    """In a thread of the server: empty a large body's lists a slice at a time, from the end (no
    memmove). Dropping a list of millions of ints at once is one C call that holds the GIL for a
    second; a slice at a time lets the event loop in between."""
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
