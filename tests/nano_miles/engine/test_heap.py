"""A CPU trainer gives the memory of freed tensors back to the kernel, and a CPU engine keeps its
step's buffers in the heap (nano_miles/engine/heap.py).

The trainer's cases run in a fresh Python (glibc's malloc state is per process): a 16 MB tensor is freed, which
raises glibc's mmap threshold to 16 MB, then 100 tensors of 2 MB are allocated and all but the last
freed, as a backward pass frees its per-layer tensors. Then it prints how much resident memory the
process kept beyond what it had before.
"""
import json
import os
import subprocess
import sys
import textwrap

import pytest

from nano_miles.engine import heap

pytestmark = pytest.mark.skipif(heap._libc() is None, reason="glibc only")

MB = 1 << 20
PATTERN = textwrap.dedent("""
    import os, sys, torch
    def rss():
        return int(open('/proc/self/statm').read().split()[1]) * os.sysconf('SC_PAGE_SIZE')
    exec(sys.argv[1])  # the set-up under test
    big = torch.ones(16 << 20, dtype=torch.uint8); del big
    before = rss()
    blocks = [torch.ones(2 << 20, dtype=torch.uint8) for _ in range(100)]
    last = blocks[-1]; del blocks
    exec(sys.argv[2])  # what runs after the frees
    print(rss() - before)
""")


def kept_bytes(setup: str, after: str = "pass") -> int:
    out = subprocess.run([sys.executable, "-c", PATTERN, setup, after], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return int(out.stdout.split()[-1])


def test_without_it_freed_tensors_stay_resident():
    # what the trainer saw before: ~200 MB kept for a 2 MB tensor still alive
    assert kept_bytes("pass") > 150 * MB


def test_return_large_frees_gives_them_back():
    assert kept_bytes("from nano_miles.engine import heap; assert heap.return_large_frees()") < 20 * MB


def test_a_cpu_trainer_sets_it_up():
    setup = ("from nano_miles.models.prepare import resolve_model; from nano_miles.trainer.trainer import Trainer, TrainerConfig; "
             "Trainer(TrainerConfig(model=str(resolve_model('tiny-random-qwen2')), device='cpu'))")
    assert kept_bytes(setup) < 20 * MB


def test_release_free_heap_gives_back_the_free_pages_inside_the_heap():
    assert kept_bytes("pass", "from nano_miles.engine import heap; heap.release_free_heap()") < 20 * MB


# A CPU engine wants the opposite: its step's temporaries of a few MB from the heap, not mmap'd afresh.
# In a fresh Python, glibc's own count of mmap'd blocks (mallinfo2) says whether a block of 8 MB, then
# one of 24 MB, got its own mapping. After the 8 MB one is freed glibc's default serves blocks up to
# 8 MB from the heap, so the second one must be bigger to tell the two apart.
MMAPPED = textwrap.dedent("""
    import asyncio, ctypes, json, sys
    class MallInfo2(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                    "fsmblks", "uordblks", "fordblks", "keepcost")]
    libc = ctypes.CDLL(None)
    libc.mallinfo2.restype, libc.malloc.restype = MallInfo2, ctypes.c_void_p
    def mmapped(size):
        before, block = libc.mallinfo2().hblks, libc.malloc(size)
        held = libc.mallinfo2().hblks - before
        libc.free(ctypes.c_void_p(block))
        return held == 1
    first = mmapped(8 << 20)
    exec(sys.argv[1])  # the set-up under test
    print(json.dumps([first, mmapped(24 << 20)]))
""")


def mmapped(setup: str, **env) -> list:
    clean = {k: v for k, v in os.environ.items() if k not in heap.ENGINE_MALLOC}
    out = subprocess.run([sys.executable, "-c", MMAPPED, setup], capture_output=True, text=True, timeout=300,
                         env={**clean, **env})
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.split("\n")[-2])


def test_without_it_a_step_sized_block_gets_a_mapping_of_its_own():
    assert mmapped("pass") == [True, True]


def test_keep_step_buffers_serves_them_from_the_heap():
    assert mmapped("from nano_miles.engine import heap; heap.keep_step_buffers()") == [True, False]


def test_a_threshold_the_user_set_stays():
    assert mmapped("from nano_miles.engine import heap; heap.keep_step_buffers()",
                   MALLOC_MMAP_THRESHOLD_="65536") == [True, True]


def test_a_cpu_engine_sets_it_up(tiny_model_path):
    setup = ("from nano_miles.engine.engine import Engine, EngineConfig; from nano_miles.engine.worker import EngineWorker; "
             f"w = EngineWorker(lambda: Engine(EngineConfig(model={str(tiny_model_path)!r}, device='cpu', num_kv_blocks=64)), "
             "asyncio.new_event_loop()); w.thread.start(); assert w.loaded.wait(120) and w.error is None, w.error")
    assert mmapped(setup) == [True, False]
