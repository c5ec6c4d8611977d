"""Attention straight over the paged KV cache (Triton; CUDA only): where the torch path gathers the
pages into a padded copy before SDPA, these kernels read each page where it lies.
- Decode (Q == 1): one program per (sequence, KV head), all G query heads of that KV head, an online
  softmax over TILE-key tiles (flash-decoding without the split).
- Packed prefill (docs/design.md): one program per (tile of up to TILE_ROWS tokens of one sequence,
  query head), causally masked; decode rows ride in the same step as tiles of one.
"""

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch path serves
    triton = None


def available(device: torch.device) -> bool:
    return triton is not None and device.type == "cuda"


def dot_precision(dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # bf16/fp16 operands: the dot is exact products either way


TILE_ROWS = 64  # query tokens of one sequence a prefill program computes (the engine cuts its tiles to this)

if triton is not None:
    @triton.jit
    def online_softmax_tile(q, m, l, acc, start, ctx, table, q_pos, k_ptr, v_ptr, kv_offset, d, scale,
                            stride_cblk, stride_cpos, block_size,
                            TILE: tl.constexpr, CAUSAL: tl.constexpr, PRECISION: tl.constexpr):
        """The keys at positions start..start+TILE-1 below ctx, read through a block-table row (`table`,
        a pointer) from the paged cache, folded into the running softmax (max m, sum l, weighted values
        acc) of the query rows q; CAUSAL: row i sees only keys at positions <= q_pos[i]. Every kernel
        here and in batch_invariant_triton.py walks its keys this way, a tile at a time in order."""
        pos = start + tl.arange(0, TILE)
        valid = pos < ctx
        blk = tl.load(table + pos // block_size, mask=valid, other=0).to(tl.int64)
        base = blk[:, None] * stride_cblk + (pos % block_size)[:, None] * stride_cpos + kv_offset + d[None, :]
        k = tl.load(k_ptr + base, mask=valid[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        visible = valid[None, :]
        if CAUSAL:
            visible = visible & (pos[None, :] <= q_pos[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m - m_new)
        l = l * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + base, mask=valid[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        return m_new, l, acc

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
        for start in range(0, ctx, TILE):  # ctx is read at run time, so a replayed graph loops right
            m, l, acc = online_softmax_tile(q, m, l, acc, start, ctx, bt_ptr + b * stride_btb, 0, k_ptr, v_ptr,
                                            kvh * stride_chead, d, scale, stride_cblk, stride_cpos, BS,
                                            TILE=TILE, CAUSAL=False, PRECISION=PRECISION)
        out = acc / l[:, None]
        tl.store(o_ptr + b * stride_ob + heads[:, None] * stride_oh + d[None, :], out.to(o_ptr.dtype.element_ty),
                 mask=(g < G)[:, None])

    @triton.jit
    def _packed_prefill_kernel(q_ptr, k_ptr, v_ptr, bt_ptr, pos_ptr, tile_ptr, o_ptr, scale,
                               stride_qt, stride_qh, stride_cblk, stride_cpos, stride_chead, stride_btb,
                               stride_ot, stride_oh,
                               G: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, ROWS: tl.constexpr,
                               TILE: tl.constexpr, PRECISION: tl.constexpr):
        t = tl.program_id(0)
        h = tl.program_id(1)
        kvh = h // G
        seq = tl.load(tile_ptr + t * 3)          # its row of the block tables
        first = tl.load(tile_ptr + t * 3 + 1)    # its first token in the packed row
        n = tl.load(tile_ptr + t * 3 + 2)        # its tokens (<= ROWS)
        r = tl.arange(0, ROWS)
        d = tl.arange(0, D)
        live = r < n
        q = tl.load(q_ptr + (first + r)[:, None] * stride_qt + h * stride_qh + d[None, :], mask=live[:, None], other=0.0)
        q_pos = tl.load(pos_ptr + first + r, mask=live, other=0)  # a dead row sees key 0: never all masked
        ctx = tl.load(pos_ptr + first + n - 1) + 1                # a sequence's positions rise along its tile
        m = tl.full([ROWS], float("-inf"), tl.float32)
        l = tl.zeros([ROWS], tl.float32)
        acc = tl.zeros([ROWS, D], tl.float32)
        for start in range(0, ctx, TILE):
            m, l, acc = online_softmax_tile(q, m, l, acc, start, ctx, bt_ptr + seq * stride_btb, q_pos, k_ptr, v_ptr,
                                            kvh * stride_chead, d, scale, stride_cblk, stride_cpos, BS,
                                            TILE=TILE, CAUSAL=True, PRECISION=PRECISION)
        out = acc / l[:, None]
        tl.store(o_ptr + (first + r)[:, None] * stride_ot + h * stride_oh + d[None, :], out.to(o_ptr.dtype.element_ty),
                 mask=live[:, None])


def packed_prefill_attention(q, k_cache, v_cache, block_tables, positions, tiles):
    """q: [T, H, D], the packed tokens of S sequences; block_tables: [S, N]; positions: [T];
    tiles: [n, 3] int (block-table row, first token, tokens <= TILE_ROWS), covering every token once,
    a tile within one sequence. Token t attends to its sequence's keys at positions <= positions[t]
    (its own K/V already in the cache). Returns [T, H, D]."""
    T, H, D = q.shape
    _, BS, KV, _ = k_cache.shape
    q = q.contiguous()
    out = torch.empty_like(q)
    _packed_prefill_kernel[(tiles.shape[0], H)](
        q, k_cache, v_cache, block_tables, positions, tiles, out, D ** -0.5,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        out.stride(0), out.stride(1),
        G=H // KV, D=D, BS=BS, ROWS=TILE_ROWS, TILE=32,
        PRECISION=dot_precision(q.dtype),
    )
    return out


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                           context_lens: torch.Tensor) -> torch.Tensor:
    """q: [B, H, D]; k_cache/v_cache: [num_blocks, block_size, KV, D]; block_tables: [B, N];
    context_lens: [B] (keys at positions < context_len are attended). Returns [B, H, D]. Under
    torch.compile (engine.enable_torch_compile) an opaque op, which it fuses the work around."""
    if torch.compiler.is_compiling():
        return _paged_decode_attention_op(q, k_cache, v_cache, block_tables, context_lens)
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
        PRECISION=dot_precision(q.dtype),
    )
    return out


_paged_decode_attention_op = torch.library.custom_op("nano_miles::paged_decode_attention", paged_decode_attention,
                                                     mutates_args=())
_paged_decode_attention_op.register_fake(
    lambda q, k_cache, v_cache, block_tables, context_lens: torch.empty_like(q, memory_format=torch.contiguous_format))
