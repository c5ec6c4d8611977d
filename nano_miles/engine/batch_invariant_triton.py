"""Triton kernels with ONE launch configuration each: the CUDA backend of batch_invariant.py.

A GPU library picks its kernel (tile, split-K) from the problem's shape, so a row rounds differently at
batch 1 and batch 64. Here each output row comes from one program (or one row of a fixed tile) whose
reduction order depends only on its own data: linear walks K in BK steps from 0 (no split-K; M is not
specialised, so every M runs the same compiled kernel); rms_norm and log_softmax run a program per row;
attention a program per (query row, KV head) over its keys in tiles from position 0.
"""
from __future__ import annotations

import torch

from nano_miles.engine.triton_attention import dot_precision

try:
    import triton
    import triton.language as tl

    from nano_miles.engine.triton_attention import online_softmax_tile
except ImportError:  # CPU-only installs use the torch backend
    triton = None

MATMUL_TILE = dict(BM=64, BN=64, BK=64)  # fixed: changing it changes every true on-policy log-prob
MATMUL_WARPS, MATMUL_STAGES = 4, 3
LOG_SOFTMAX_BLOCK = 4096


def available() -> bool:
    return triton is not None


if triton is not None:
    @triton.jit(do_not_specialize=["M"])
    def _linear_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                       HAS_BIAS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                       PRECISION: tl.constexpr):
        rm = tl.program_id(0) * BM + tl.arange(0, BM)
        rn = tl.program_id(1) * BN + tl.arange(0, BN)
        rk = tl.arange(0, BK)
        x_rows = x_ptr + rm.to(tl.int64)[:, None] * stride_xm
        w_rows = w_ptr + rn.to(tl.int64)[:, None] * stride_wn
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, K, BK):
            kk = k0 + rk
            a = tl.load(x_rows + kk[None, :], mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
            b = tl.load(w_rows + kk[None, :], mask=(rn[:, None] < N) & (kk[None, :] < K), other=0.0)
            acc = tl.dot(a, tl.trans(b), acc, input_precision=PRECISION)
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        y = y_ptr + rm.to(tl.int64)[:, None] * stride_ym + rn[None, :]
        tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))

    @triton.jit
    def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, stride_x, stride_y, N, eps, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < N
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        var = tl.sum(x * x, axis=0) / N
        y = (x * (1.0 / tl.sqrt_rn(var + eps))).to(y_ptr.dtype.element_ty)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0)
        tl.store(y_ptr + row * stride_y + cols, (w * y).to(y_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _silu_mul_kernel(g_ptr, u_ptr, y_ptr, n, BLOCK: tl.constexpr):
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        g = tl.load(g_ptr + i, mask=i < n, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + i, mask=i < n, other=0.0)
        s = (g / (1.0 + tl.exp(-g))).to(y_ptr.dtype.element_ty)
        tl.store(y_ptr + i, (s * u).to(y_ptr.dtype.element_ty), mask=i < n)

    @triton.jit
    def _log_softmax_kernel(x_ptr, y_ptr, stride_x, stride_y, V, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        x_row, y_row = x_ptr + row * stride_x, y_ptr + row * stride_y
        m_lanes = tl.full([BLOCK], float("-inf"), tl.float32)
        for start in range(0, V, BLOCK):
            x = tl.load(x_row + start + cols, mask=start + cols < V, other=float("-inf")).to(tl.float32)
            m_lanes = tl.maximum(m_lanes, x)
        m = tl.max(m_lanes, axis=0)
        s_lanes = tl.zeros([BLOCK], tl.float32)
        for start in range(0, V, BLOCK):
            x = tl.load(x_row + start + cols, mask=start + cols < V, other=float("-inf")).to(tl.float32)
            s_lanes += tl.exp(x - m)
        log_s = tl.log(tl.sum(s_lanes, axis=0))
        for start in range(0, V, BLOCK):
            x = tl.load(x_row + start + cols, mask=start + cols < V, other=0.0).to(tl.float32)
            tl.store(y_row + start + cols, (x - m) - log_s, mask=start + cols < V)

    @triton.jit(do_not_specialize=["rows_per_table", "block_size"])
    def _attention_kernel(q_ptr, k_ptr, v_ptr, tables_ptr, pos_ptr, o_ptr, scale, rows_per_table, block_size,
                          stride_qr, stride_qh, stride_cblk, stride_cpos, stride_chead, stride_tr,
                          stride_or, stride_oh,
                          G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, TILE: tl.constexpr,
                          PRECISION: tl.constexpr):
        r = tl.program_id(0)
        kvh = tl.program_id(1)
        g = tl.arange(0, G_PAD)
        d = tl.arange(0, D)
        heads = kvh * G + g
        q = tl.load(q_ptr + r * stride_qr + heads[:, None] * stride_qh + d[None, :], mask=(g < G)[:, None], other=0.0)
        ctx = tl.load(pos_ptr + r) + 1  # read at run time: a replayed CUDA graph loops right
        table = tables_ptr + (r // rows_per_table) * stride_tr
        m = tl.full([G_PAD], float("-inf"), tl.float32)
        l = tl.zeros([G_PAD], tl.float32)
        acc = tl.zeros([G_PAD, D], tl.float32)
        for start in range(0, ctx, TILE):
            m, l, acc = online_softmax_tile(q, m, l, acc, start, ctx, table, 0, k_ptr, v_ptr, kvh * stride_chead, d,
                                            scale, stride_cblk, stride_cpos, block_size,
                                            TILE=TILE, CAUSAL=False, PRECISION=PRECISION)
        out = acc / l[:, None]
        tl.store(o_ptr + r * stride_or + heads[:, None] * stride_oh + d[None, :], out.to(o_ptr.dtype.element_ty),
                 mask=(g < G)[:, None])


def linear(x, weight, bias, out_dtype):
    if x.dtype != weight.dtype:
        raise ValueError(f"batch-invariant linear needs one dtype, got x {x.dtype} and weight {weight.dtype}")
    K, N = x.shape[-1], weight.shape[0]
    x2 = x.reshape(-1, K).contiguous()
    weight = weight.contiguous()
    M = x2.shape[0]
    y = torch.empty(M, N, dtype=out_dtype or x.dtype, device=x.device)
    if M:
        t = MATMUL_TILE
        grid = (triton.cdiv(M, t["BM"]), triton.cdiv(N, t["BN"]))
        _linear_kernel[grid](x2, weight, bias if bias is not None else weight, y, M, N, K,
                             x2.stride(0), weight.stride(0), y.stride(0), HAS_BIAS=bias is not None,
                             PRECISION=dot_precision(x.dtype), num_warps=MATMUL_WARPS, num_stages=MATMUL_STAGES, **t)
    return y.view(*x.shape[:-1], N)


def rms_norm(x, weight, eps):
    N = x.shape[-1]
    x2 = x.reshape(-1, N).contiguous()
    y = torch.empty_like(x2)
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](x2, weight, y, x2.stride(0), y.stride(0), N, eps,
                                         BLOCK=triton.next_power_of_2(N), num_warps=4)
    return y.view(x.shape)


def silu_mul(gate, up):
    gate, up = gate.contiguous(), up.contiguous()
    y = torch.empty_like(gate)
    n = gate.numel()
    if n:
        _silu_mul_kernel[(triton.cdiv(n, 1024),)](gate, up, y, n, BLOCK=1024, num_warps=4)
    return y


def log_softmax(logits):
    V = logits.shape[-1]
    x2 = logits.reshape(-1, V).contiguous()
    y = torch.empty(x2.shape, dtype=torch.float32, device=logits.device)
    if x2.shape[0]:
        _log_softmax_kernel[(x2.shape[0],)](x2, y, x2.stride(0), y.stride(0), V, BLOCK=LOG_SOFTMAX_BLOCK, num_warps=8)
    return y.view(logits.shape)


def paged_attention(q, k_cache, v_cache, block_tables, positions, rows_per_table, key_block):
    R, H, D = q.shape
    _, BS, KV, _ = k_cache.shape
    if D < 16 or D & (D - 1):
        raise ValueError(f"batch-invariant triton attention needs a power-of-two head_dim >= 16, got {D}")
    G = H // KV
    q = q.contiguous()
    k_cache, v_cache, positions = k_cache.contiguous(), v_cache.contiguous(), positions.contiguous()
    if block_tables.stride(-1) != 1:  # rows may be strided (a CUDA graph's static slice): the kernel takes the row stride
        block_tables = block_tables.contiguous()
    out = torch.empty_like(q)
    if R:
        _attention_kernel[(R, KV)](
            q, k_cache, v_cache, block_tables, positions, out, D ** -0.5, rows_per_table, BS,
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
            out.stride(0), out.stride(1),
            G=G, G_PAD=max(16, triton.next_power_of_2(G)), D=D, TILE=key_block, PRECISION=dot_precision(q.dtype))
    return out
