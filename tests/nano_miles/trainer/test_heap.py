"""A CPU trainer gives the memory of freed tensors back to the kernel (nano_miles/trainer/heap.py).

Each case runs in a fresh Python (glibc's malloc state is per process): a 16 MB tensor is freed, which
raises glibc's mmap threshold to 16 MB, then 100 tensors of 2 MB are allocated and all but the last
freed, as a backward pass frees its per-layer tensors. Then it prints how much resident memory the
process kept beyond what it had before.
"""
import subprocess
import sys
import textwrap

import pytest

from nano_miles.trainer import heap

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
    assert kept_bytes("from nano_miles.trainer import heap; assert heap.return_large_frees()") < 20 * MB


def test_a_cpu_trainer_sets_it_up():
    setup = ("from nano_miles.models.prepare import resolve_model; from nano_miles.trainer.trainer import Trainer, TrainerConfig; "
             "Trainer(TrainerConfig(model=str(resolve_model('tiny-random-qwen2')), device='cpu'))")
    assert kept_bytes(setup) < 20 * MB


def test_release_free_heap_gives_back_the_free_pages_inside_the_heap():
    assert kept_bytes("pass", "from nano_miles.trainer import heap; heap.release_free_heap()") < 20 * MB
