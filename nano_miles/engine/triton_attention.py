"""Decode attention straight over the paged KV cache (Triton; CUDA only).

The torch path gathers every sequence's pages into a padded [B, L, KV, D] copy before SDPA; this
kernel reads each page once where it lies. One program per (sequence, KV head) computes all G query
heads of that KV head with an online softmax over TILE-key tiles (flash-decoding without the split).
Used by the model for Q == 1 batches when `triton` imports and the cache is on a GPU.
"""

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch path serves
    triton = None


def available(device: torch.device) -> bool:
    return triton is not None and device.type == "cuda"


if triton is not None:
    @triton.jit
    def _paged_decode_kernel(q_ptr, k_ptr, v_ptr, bt_ptr, ctx_ptr, o_ptr, scale,
                             stride_qb, stride_qh, stride_cblk, stride_cpos, stride_chead, stride_btb,
                             stride_ob, stride_oh,
                             G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
                             TILE: tl.constexpr, PRECISION: tl.constexpr):
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        g = tl.arange(0, G_PAD)
        d = tl.arange(0, D)
        heads = kvh * G + g
        q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=(g < G)[:, None], other=0.0)
        ctx = tl.load(ctx_ptr + b)
        m = tl.full([G_PAD], float("-inf"), tl.float32)
        l = tl.zeros([G_PAD], tl.float32)
        acc = tl.zeros([G_PAD, D], tl.float32)
        offs = tl.arange(0, TILE)
        for start in range(0, ctx, TILE):  # ctx is read at run time, so a replayed graph loops right
            pos = start + offs
            valid = pos < ctx
            blk = tl.load(bt_ptr + b * stride_btb + pos // BS, mask=valid, other=0)
            base = blk[:, None] * stride_cblk + (pos % BS)[:, None] * stride_cpos + kvh * stride_chead + d[None, :]
            k = tl.load(k_ptr + base, mask=valid[:, None], other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
            s = tl.where(valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            p = tl.exp(s - m_new[:, None])
            alpha = tl.exp(m - m_new)
            l = l * alpha + tl.sum(p, 1)
            v = tl.load(v_ptr + base, mask=valid[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m = m_new
        out = acc / l[:, None]
        tl.store(o_ptr + b * stride_ob + heads[:, None] * stride_oh + d[None, :], out.to(o_ptr.dtype.element_ty),
                 mask=(g < G)[:, None])


def paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens):
    """q: [B, H, D]; k_cache/v_cache: [num_blocks, block_size, KV, D]; block_tables: [B, N];
    context_lens: [B] (keys at positions < context_len are attended). Returns [B, H, D]."""
    B, H, D = q.shape
    _, BS, KV, _ = k_cache.shape
    G = H // KV
    q = q.contiguous()
    out = torch.empty_like(q)
    tile = max(16, min(64, 4096 // D))
    _paged_decode_kernel[(B, KV)](
        q, k_cache, v_cache, block_tables, context_lens, out, D ** -0.5,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        out.stride(0), out.stride(1),
        G=G, G_PAD=max(16, triton.next_power_of_2(G)), D=D, BS=BS, TILE=tile,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )
    return out
