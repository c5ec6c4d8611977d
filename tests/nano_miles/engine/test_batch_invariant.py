"""The batch-invariant ops (torch backend, CPU): a row's result is the same bits whatever else is in
the call, and close to the ordinary op; gradients are the ordinary op's."""
import math

import pytest
import torch
import torch.nn.functional as F

from nano_miles.engine import batch_invariant as bi

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def randn(*shape, dtype=torch.float32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def assert_rows_invariant(fn, x, counts=(1, 2, 3, 8, 17)):
    """fn over any slice of x's rows gives exactly those rows of fn over all of x."""
    whole = fn(x)
    for count in counts:
        for start in (0, 5, x.shape[0] - count):
            assert torch.equal(fn(x[start:start + count]), whole[start:start + count]), (count, start)


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_rows_do_not_depend_on_the_batch(dtype):
    w, b, x = randn(96, 80, dtype=dtype, seed=1), randn(96, dtype=dtype, seed=2), randn(40, 80, dtype=dtype)
    assert_rows_invariant(lambda rows: bi.linear(rows, w, b), x)
    ref = F.linear(x.double(), w.double(), b.double())
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(bi.linear(x, w, b).double(), ref, rtol=tol, atol=tol)
    # bf16 operands with FP32 output: FP32 products and sums (the logits' head)
    logits = bi.linear(x, w, out_dtype=torch.float32)
    assert logits.dtype == torch.float32
    assert torch.allclose(logits.double(), F.linear(x.double(), w.double()), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", [(64, 1024), (64, 128), (128, 64), (80, 96)])
def test_linear_rows_do_not_depend_on_the_thread_count(shape):
    """Engine and trainer may run with different thread counts; the GEMM tiles must not care."""
    K, N = shape
    w, x = randn(N, K, seed=5), randn(70, K, seed=6)
    one = bi.linear(x, w)
    torch.set_num_threads(2)
    assert torch.equal(bi.linear(x, w), one)
    assert_rows_invariant(lambda rows: bi.linear(rows, w), x, counts=(1, 31, 32, 33, 65))


@pytest.mark.parametrize("dtype", DTYPES)
def test_norm_silu_and_log_softmax_rows_do_not_depend_on_the_batch(dtype):
    x, w = randn(40, 72, dtype=dtype), randn(72, dtype=dtype, seed=3)
    assert_rows_invariant(lambda rows: bi.rms_norm(rows, w, 1e-6), x)
    assert_rows_invariant(lambda rows: bi.silu_mul(rows, rows * 2), x)
    logits = randn(40, 1000, seed=4) * 8
    assert_rows_invariant(bi.log_softmax, logits)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    ref_norm = x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()
    assert torch.allclose(bi.rms_norm(x, w, 1e-6).double(), ref_norm, rtol=tol, atol=tol)
    assert torch.allclose(bi.silu_mul(x, x * 2).double(), F.silu(x.double()) * (x * 2).double(), rtol=tol, atol=tol)
    assert torch.allclose(bi.log_softmax(logits), torch.log_softmax(logits, -1), atol=1e-5)


def test_exp_and_log_give_an_element_the_same_bits_wherever_it_sits():
    """The kernels call torch's exp and log as elementwise ops: an element's bits may not depend on
    the call's length, the element's offset (a vectorised loop's tail) or the thread count."""
    x = torch.cat([randn(1 << 16) * 30, -randn(1 << 16).abs() * 60, torch.tensor([0.0, -math.inf, 100.0])])
    for fn, inp in ((torch.exp, x), (torch.log, x.abs() + 1e-30)):
        whole = fn(inp)
        for length in (1, 3, 7, 15, 17, 33, 100, 4099, 40000):
            for start in (0, 1, 5, 13, inp.numel() - length):
                assert torch.equal(fn(inp[start:start + length]), whole[start:start + length]), (fn, length, start)
        torch.set_num_threads(2)
        assert torch.equal(fn(inp[3:]), whole[3:])
        torch.set_num_threads(1)
    assert torch.exp(torch.tensor([-math.inf])).item() == 0.0  # a masked key's weight is exactly zero


def test_tree_sum_order_is_fixed_by_the_length_alone():
    x = randn(7, 300, 13)
    whole = bi.tree_sum(x, dim=1)
    assert torch.equal(bi.tree_sum(x[2:3], dim=1), whole[2:3])
    assert torch.equal(bi.tree_sum(x[:, :, 4:9], dim=1), whole[:, 4:9])
    assert torch.allclose(whole, x.double().sum(1).float(), atol=1e-4)


def paged(k, v, block_size, perm_seed):
    """Scatter one sequence's keys [L, KV, D] into shuffled pages of block_size; returns caches and table."""
    L = k.shape[0]
    n = (L + block_size - 1) // block_size
    order = torch.randperm(n + 3, generator=torch.Generator().manual_seed(perm_seed))[:n]
    k_cache = torch.zeros(n + 3, block_size, *k.shape[1:], dtype=k.dtype)
    v_cache = torch.zeros_like(k_cache)
    for i, blk in enumerate(order.tolist()):
        k_cache[blk, :min(block_size, L - i * block_size)] = k[i * block_size:(i + 1) * block_size]
        v_cache[blk, :min(block_size, L - i * block_size)] = v[i * block_size:(i + 1) * block_size]
    return k_cache, v_cache, order.unsqueeze(0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_rows_do_not_depend_on_pages_batch_or_split(dtype):
    L, H, KV, D = 150, 4, 2, 16
    q, k, v = randn(1, L, H, D, dtype=dtype, seed=5), randn(1, L, KV, D, dtype=dtype, seed=6), randn(1, L, KV, D, dtype=dtype, seed=7)
    whole = bi.causal_attention(q, k, v)[0]                     # the trainer: one contiguous sequence
    ref = bi.FastOps.causal_attention(q.double(), k.double(), v.double())[0]
    assert torch.allclose(whole.double(), ref, atol=1e-5 if dtype == torch.float32 else 3e-2)
    positions = torch.arange(L)
    for block_size, seed in ((4, 0), (16, 1), (64, 2)):        # the engine: pages in any order
        k_cache, v_cache, table = paged(k[0], v[0], block_size, seed)
        assert torch.equal(bi.paged_attention(q[0], k_cache, v_cache, table, positions, queries_per_table=L), whole)
        # decode: one query at a time, alone or next to another sequence's rows (here: padded copies)
        for t in (0, 63, 64, 65, 149):
            alone = bi.paged_attention(q[0, t:t + 1], k_cache, v_cache, table, positions[t:t + 1])
            assert torch.equal(alone, whole[t:t + 1]), t
            crowd = bi.paged_attention(torch.cat([q[0, t:t + 1], q[0, 149:]]), k_cache, v_cache,
                                       table.repeat(2, 1), torch.tensor([t, 149]))
            assert torch.equal(crowd[:1], whole[t:t + 1]), t
        # chunked prefill: the second half of the prompt after the first half is in the cache
        second = bi.paged_attention(q[0, 70:], k_cache, v_cache, table, positions[70:], queries_per_table=L - 70)
        assert torch.equal(second, whole[70:])


@pytest.mark.parametrize("threads", [1, 2])
def test_attention_rows_do_not_depend_on_chunks_threads_or_sequence_length(threads, monkeypatch):
    """The softmax is over all of a row's keys at once: a trainer sequence longer than the row's
    position, scores taken a few tiles at a time, or another thread count change no bit."""
    L, H, KV, D = 300, 4, 2, 16
    q, k, v = randn(1, L, H, D, seed=8), randn(1, L, KV, D, seed=9), randn(1, L, KV, D, seed=10)
    whole = bi.causal_attention(q, k, v)[0]
    torch.set_num_threads(threads)
    monkeypatch.setattr(bi, "_ATTENTION_CHUNK", bi.QUERY_TILE * 384)  # one tile at a time
    assert torch.equal(bi.causal_attention(q, k, v)[0], whole)
    assert torch.equal(bi.causal_attention(q[:, :90], k[:, :90], v[:, :90])[0], whole[:90])
    k_cache, v_cache, table = paged(k[0], v[0], 16, 3)
    rows = torch.tensor([0, 64, 200, 299])
    decode = bi.paged_attention(q[0, rows], k_cache, v_cache, table.repeat(4, 1), rows)
    assert torch.equal(decode, whole[rows])


def test_gradients_are_the_ordinary_ops_gradients():
    x = randn(6, 32, seed=8).requires_grad_()
    w = randn(48, 32, seed=9).requires_grad_()
    b = randn(48, seed=10).requires_grad_()
    g = randn(6, 48, seed=11)

    def grads(fn, *inputs):
        return torch.autograd.grad(fn(*inputs), inputs, g)

    for got, want in zip(grads(bi.linear, x, w, b), grads(F.linear, x, w, b)):
        assert torch.allclose(got, want, atol=1e-5)
    nw = randn(48, seed=12).requires_grad_()
    y = F.linear(x, w).detach().requires_grad_()
    for got, want in zip(grads(lambda a, c: bi.rms_norm(a, c, 1e-6), y, nw), grads(lambda a, c: bi.FastOps.rms_norm(a, c, 1e-6), y, nw)):
        assert torch.equal(got, want)  # recomputed by the very expression
    for got, want in zip(grads(bi.silu_mul, y, y * 3), grads(bi.FastOps.silu_mul, y, y * 3)):
        assert torch.equal(got, want)
    for got, want in zip(grads(bi.log_softmax, y), grads(lambda a: torch.log_softmax(a, -1), y)):
        assert torch.allclose(got, want, atol=1e-5)
    q, k, v = (randn(2, 9, *shape, seed=s).requires_grad_() for shape, s in (((4, 8), 13), ((2, 8), 14), ((2, 8), 15)))
    go = randn(2, 9, 4, 8, seed=16)
    got = torch.autograd.grad(bi.causal_attention(q, k, v), (q, k, v), go)
    want = torch.autograd.grad(bi.FastOps.causal_attention(q, k, v), (q, k, v), go)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_rope_table_entries_do_not_depend_on_its_length():
    short, long = bi.rope_table(40, 16, 1e6), bi.rope_table(300, 16, 1e6)
    assert torch.equal(short[0], long[0][:40]) and torch.equal(short[1], long[1][:40])
    t = torch.arange(300, dtype=torch.float64)[:, None]
    inv = 1.0 / 1e6 ** (torch.arange(0, 16, 2, dtype=torch.float64) / 16)
    assert torch.allclose(long[0].double(), torch.cat([(t * inv).cos()] * 2, -1), atol=1e-6)
