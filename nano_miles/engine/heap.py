"""The C heap of a CPU process that trains or serves: what glibc's malloc keeps after torch frees a tensor.

glibc serves a request of at least M_MMAP_THRESHOLD bytes with its own mmap (returned to the kernel on
free) and smaller ones from the heap, and by default raises that threshold to the size of every mmapped
block freed, up to 32 MB. So after the first backward a trainer's per-layer gradients and activations
(1-32 MB each for a 0.5B model) come from the heap, where freed blocks between live ones stay resident.

`return_large_frees()` fixes the threshold (which also turns the raising off), so every block of
1 MiB or more is its own mapping and goes back to the kernel when freed; `release_free_heap()` hands
back the free pages left inside the heap. A CPU engine wants the opposite: `keep_step_buffers()`.
glibc only: elsewhere they do nothing.
"""
from __future__ import annotations

import ctypes
import os

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt's parameters, from glibc's malloc.h
MMAP_THRESHOLD_BYTES = 1 << 20
# A CPU engine's step: blocks up to 32 MB from the heap, and up to 256 MB of it kept free before glibc
# trims it (the worker trims it itself when it goes idle). The environment names glibc reads at start.
ENGINE_MALLOC = {"MALLOC_MMAP_THRESHOLD_": (M_MMAP_THRESHOLD, 32 << 20),
                 "MALLOC_TRIM_THRESHOLD_": (M_TRIM_THRESHOLD, 256 << 20)}


def _libc():
    libc = ctypes.CDLL(None)
    return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None


def return_large_frees() -> bool:
    """For the rest of this process; whether it took effect (False off glibc)."""
    libc = _libc()
    return bool(libc is not None and libc.mallopt(M_MMAP_THRESHOLD, ctypes.c_int(MMAP_THRESHOLD_BYTES)))


def release_free_heap() -> None:
    if (libc := _libc()) is not None:
        libc.malloc_trim(ctypes.c_size_t(0))


def keep_step_buffers() -> None:
    """A CPU engine's step allocates and frees tensors of a few MB in most ops; by default glibc hands
    them back to the kernel (their own mmap, or the heap's top trimmed at twice the raised threshold)
    and the next step faults them in again, page by page. A setting made in the environment stays."""
    if (libc := _libc()) is not None:
        for name, (param, value) in ENGINE_MALLOC.items():
            if name not in os.environ:
                libc.mallopt(param, ctypes.c_int(value))
