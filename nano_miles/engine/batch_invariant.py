"""Batch-invariant ops: the ONE implementation engine and trainer share in true on-policy mode
(docs/design.md). Each output row's arithmetic depends only on that row's inputs, never on how many
rows are in the call, where the row sits or how a sequence was split, so a token's log-prob has the
same bits in a decode batch of 1 or 64, after a prefix-cache hit or a chunked prefill, and in the trainer.

CUDA runs batch_invariant_triton.py; the CPU runs torch ops in an order written out here. A library
GEMM rounds a row differently with the row count, but not with its neighbours or its place within
one fixed call shape, so every GEMM runs on tiles of one shape. Other reductions are pairwise trees
(`tree_sum`). torch's exp and log give an element the same bits wherever it sits, unlike sigmoid (its
loop's tail is scalar libm), so silu is written with exp. Forward VALUES come from these kernels,
gradients from the usual fast ops (analytic for linear and log_softmax, else the fast expression's).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from nano_miles.engine import batch_invariant_triton  # triton itself only where it is installed

KEY_BLOCK = 64             # attention reduces over keys in blocks of this many, from position 0, in order
ROW_TILE = 32              # torch backend: linear runs the library GEMM on tiles of exactly this many rows
QUERY_TILE = 16            # torch backend: attention's GEMMs take query rows in tiles of this many
_ATTENTION_CHUNK = 1 << 20  # torch backend: attention scores held at once (bounds its memory)


def _triton(t: torch.Tensor):
    if t.device.type != "cuda":
        return None
    if not batch_invariant_triton.available():
        raise RuntimeError("true on-policy mode on CUDA needs triton (pip install triton)")
    return batch_invariant_triton


def tree_sum(x: torch.Tensor, dim: int = -1, inplace: bool = False) -> torch.Tensor:
    """Sum over `dim` in a fixed order: element i is added to element i + width/2 (width the length
    rounded up to a power of two; one without a partner stays as it is), halving until one is left.
    Zero elements past the end change nothing, so the order is the length's alone. With inplace the
    partial sums are written over x."""
    x = x.movedim(dim, 0)
    n = x.shape[0]
    half = (1 << max(0, (n - 1).bit_length())) >> 1
    if n > 1 and not inplace:
        x = torch.cat((x[:n - half] + x[half:n], x[n - half:half]))
        n = half
        half >>= 1
    while n > 1:
        x[:n - half] += x[half:n]
        n = half
        half >>= 1
    return x[0]


def _linear_value(x, weight, bias, out_dtype):
    if (tk := _triton(x)) is not None:
        return tk.linear(x, weight, bias, out_dtype)
    K, N = x.shape[-1], weight.shape[0]
    rows = x.reshape(-1, K).float()
    M = rows.shape[0]
    if M % ROW_TILE:
        rows = torch.cat((rows, rows.new_zeros(ROW_TILE - M % ROW_TILE, K)))
    wt = weight.float().t()
    # Every GEMM call has the one shape [ROW_TILE, K] x [K, N], so the library picks the same blocking
    # (and K order) for every tile, and a row's bits do not depend on its neighbours or its place.
    out = torch.cat([rows[r:r + ROW_TILE] @ wt for r in range(0, rows.shape[0], ROW_TILE)])[:M]
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype or x.dtype).view(*x.shape[:-1], N)


def _rms_norm_value(x, weight, eps):
    if (tk := _triton(x)) is not None:
        return tk.rms_norm(x, weight, eps)
    xf = x.float()
    y = xf * (1.0 / torch.sqrt(tree_sum(xf * xf) / x.shape[-1] + eps)).unsqueeze(-1)
    return weight * y.to(x.dtype)  # HF's order: normalise in fp32, cast, then scale


def _silu_mul_value(gate, up):
    if (tk := _triton(gate)) is not None:
        return tk.silu_mul(gate, up)
    g = gate.float()
    return (g / (1.0 + torch.exp(-g))).to(gate.dtype) * up


def _log_softmax_value(logits):
    if (tk := _triton(logits)) is not None:
        return tk.log_softmax(logits)
    z = logits.float() - logits.float().amax(-1, keepdim=True)  # max is exact in any order
    return z - torch.log(tree_sum(torch.exp(z))).unsqueeze(-1)


def paged_attention(q, k_cache, v_cache, block_tables, positions, queries_per_table: int = 1):
    """Causal attention of query rows over paged keys, batch-invariant (forward only). q: [R, H, D];
    k_cache/v_cache: [num_blocks, block_size, KV, D]; row r reads table r // queries_per_table of
    block_tables and attends to the keys at positions 0..positions[r]. Returns [R, H, D] in q's dtype."""
    if (tk := _triton(q)) is not None:
        return tk.paged_attention(q, k_cache, v_cache, block_tables, positions, queries_per_table, KEY_BLOCK)
    R, H, D = q.shape
    _, BS, KV, _ = k_cache.shape
    G, S = H // KV, R // queries_per_table                      # S sequences of queries_per_table rows
    # Keys 0..max position in whole KEY_BLOCKs, gathered page by page, per (sequence, KV head): keys
    # [KEY_BLOCK, D] (the GEMM reads them transposed), values [KEY_BLOCK, D + 1] with a column of
    # ones, so the GEMM that weights a block's values also sums its weights.
    num_keys = KEY_BLOCK * (int(positions.max()) // KEY_BLOCK + 1)
    page = torch.arange(-(-num_keys // BS), device=q.device).clamp(max=block_tables.shape[1] - 1)  # masked below
    pages = block_tables[:S, page].reshape(-1)
    keys, vals = (c.index_select(0, pages).view(S, -1, KV, D)[:, :num_keys].view(S, -1, KEY_BLOCK, KV, D)
                  for c in (k_cache, v_cache))
    blocks = num_keys // KEY_BLOCK
    keys_b = torch.empty(S * KV, blocks, KEY_BLOCK, D, dtype=torch.float32, device=q.device)
    keys_b.view(S, KV, blocks, KEY_BLOCK, D).copy_(keys.permute(0, 3, 1, 2, 4))
    vals_1 = torch.empty(S * KV, blocks, KEY_BLOCK, D + 1, dtype=torch.float32, device=q.device)
    vals_1.view(S, KV, blocks, KEY_BLOCK, D + 1)[..., :D] = vals.permute(0, 3, 1, 2, 4)
    vals_1[..., D] = 1.0
    # Query rows per (sequence, KV head): its G heads at each position, in tiles of QUERY_TILE rows,
    # scaled before the GEMM (D ** -0.5 is a power of two for the usual head sizes: exact).
    M = queries_per_table * G
    tiles = -(-M // QUERY_TILE)
    rows = (q.float() * D ** -0.5).view(S, queries_per_table, KV, G, D).permute(0, 2, 1, 3, 4).reshape(S, KV, M, D)
    rows = F.pad(rows, (0, 0, 0, tiles * QUERY_TILE - M)).view(S * KV * tiles, QUERY_TILE, D)
    row_pos = positions.view(S, 1, queries_per_table).repeat_interleave(G, -1).expand(S, KV, M)
    row_pos = F.pad(row_pos, (0, tiles * QUERY_TILE - M)).reshape(S * KV * tiles, QUERY_TILE)
    # A decode tile holds only its G heads' rows: the softmax skips the padding rows (they are the
    # last; a GEMM row depends on its own row of the operand alone, so theirs are left as they are).
    used = M if tiles == 1 else QUERY_TILE
    out = torch.empty(rows.shape[0], used, D, dtype=torch.float32, device=q.device)
    per_chunk = max(1, _ATTENTION_CHUNK // (QUERY_TILE * num_keys))
    # Chunks of tiles: of several (sequence, KV head) units when each has one tile (decode), else
    # within one unit, whose keys every tile of the chunk then shares.
    step = tiles if tiles > 1 else rows.shape[0]
    chunks = [(t, min(t + per_chunk, u0 + step)) for u0 in range(0, rows.shape[0], step)
              for t in range(u0, u0 + step, per_chunk)]
    for t0, t1 in chunks:
        n, pos = t1 - t0, row_pos[t0:t1, :used]
        nb = int(pos.max()) // KEY_BLOCK + 1                    # key blocks wholly after every row: skipped
        if tiles == 1:
            k, v = keys_b[t0:t1, :nb], vals_1[t0:t1, :nb]       # each tile's keys [n, nb, KB, D], values [n, nb, KB, D+1]
        else:
            k, v = (x[t0 // tiles, :nb].expand(n, nb, *x.shape[2:]) for x in (keys_b, vals_1))
        # Every GEMM is one [QUERY_TILE, D] x [D, KEY_BLOCK] tile (then [QUERY_TILE, KEY_BLOCK] x
        # [KEY_BLOCK, D + 1]): one call shape, so a row's bits depend on neither its tile-mates nor its place.
        s = torch.bmm(rows[t0:t1, None].expand(n, nb, QUERY_TILE, D).reshape(-1, QUERY_TILE, D),
                      k.reshape(-1, KEY_BLOCK, D).transpose(1, 2)).view(n, nb, QUERY_TILE, KEY_BLOCK)
        p = s[:, :, :used]
        first = int(pos.min()) // KEY_BLOCK                     # blocks before it are wholly visible to every row
        key_pos = torch.arange(first * KEY_BLOCK, nb * KEY_BLOCK, device=q.device).view(nb - first, 1, KEY_BLOCK)
        p[:, first:].masked_fill_(key_pos > pos[:, None, :, None], float("-inf"))
        # Softmax over all of a row's keys at once. Keys after its position give p = 0 exactly, so
        # a sum padded with them (a longer call, a longer trainer sequence) adds only exact zeros.
        p.sub_(p.amax((1, 3), keepdim=True)).exp_()
        pv = torch.bmm(s.view(-1, QUERY_TILE, KEY_BLOCK), v.reshape(-1, KEY_BLOCK, D + 1)).view(n, nb, QUERY_TILE, D + 1)
        acc = tree_sum(pv, dim=1, inplace=True)[:, :used]      # over blocks, in position order's tree
        out[t0:t1] = acc[..., :D] / acc[..., D:]
    out = out.view(S, KV, tiles * used, D)[:, :, :M].reshape(S, KV, queries_per_table, G, D)
    return out.permute(0, 2, 1, 3, 4).reshape(R, H, D).to(q.dtype)


def _causal_attention_value(q, k, v):
    B, L, H, D = q.shape
    tables = torch.arange(B, device=q.device).unsqueeze(1)  # sequence b is "page" b of L keys
    out = paged_attention(q.reshape(B * L, H, D), k, v, tables, torch.arange(L, device=q.device).repeat(B), L)
    return out.view(B, L, H, D)


class FastOps:
    """The ordinary kernels (library GEMMs, fused reductions): the model's default ops, and the
    expressions whose gradients true on-policy training takes."""
    linear = staticmethod(F.linear)

    @staticmethod
    def rms_norm(x, weight, eps):
        xf = x.float()  # HF's order: normalise in fp32, cast back, then scale
        return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)

    @staticmethod
    def silu_mul(gate, up):
        return F.silu(gate) * up

    @staticmethod
    def causal_attention(q, k, v):
        G = q.shape[2] // k.shape[2]
        k, v = k.repeat_interleave(G, dim=2), v.repeat_interleave(G, dim=2)  # query head h reads KV head h // G
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                              is_causal=True).transpose(1, 2)


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, out_dtype):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return _linear_value(x, weight, bias, out_dtype)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        g, gx, gw, gb = grad.reshape(-1, grad.shape[-1]), None, None, None
        if ctx.needs_input_grad[0]:
            gx = (g @ weight.to(g.dtype)).to(x.dtype).view(x.shape)
        if ctx.needs_input_grad[1]:
            gw = (g.t() @ x.reshape(-1, x.shape[-1]).to(g.dtype)).to(weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            gb = g.sum(0)
        return gx, gw, gb, None


class _LogSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits):
        out = _log_softmax_value(logits)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, grad):
        (out,) = ctx.saved_tensors
        return grad - out.exp() * grad.sum(-1, keepdim=True)


class _ExactForward(torch.autograd.Function):
    """Returns exact(*tensors); its backward recomputes fast(*tensors) and differentiates that."""

    @staticmethod
    def forward(ctx, exact, fast, *tensors):
        ctx.fast = fast
        ctx.save_for_backward(*tensors)
        return exact(*tensors)

    @staticmethod
    def backward(ctx, grad):
        inputs = [t.detach().requires_grad_(need) for t, need in zip(ctx.saved_tensors, ctx.needs_input_grad[2:])]
        with torch.enable_grad():
            grads = iter(torch.autograd.grad(ctx.fast(*inputs), [t for t in inputs if t.requires_grad], grad))
        return (None, None, *[next(grads) if t.requires_grad else None for t in inputs])


def _tracked(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _exact(exact, fast, *tensors):
    """exact(*tensors), with fast's gradient when autograd tracks any of them."""
    return _ExactForward.apply(exact, fast, *tensors) if _tracked(*tensors) else exact(*tensors)


# The API (the engine's model and the trainer call these; same signatures as the fast ops).

def linear(x, weight, bias=None, out_dtype=None):
    """x @ weight.T (+ bias), each element reduced over K in one fixed order, in out_dtype (default
    x's): bf16 inputs with out_dtype float32 give FP32 logits from bf16 values."""
    value = _Linear.apply if _tracked(x, weight, bias) else _linear_value
    return value(x, weight, bias, out_dtype)


def rms_norm(x, weight, eps: float):
    return _exact(lambda a, w: _rms_norm_value(a, w, eps), lambda a, w: FastOps.rms_norm(a, w, eps), x, weight)


def silu_mul(gate, up):
    return _exact(_silu_mul_value, FastOps.silu_mul, gate, up)


def log_softmax(logits):
    """FP32 log_softmax over the last dimension."""
    return _LogSoftmax.apply(logits) if _tracked(logits) else _log_softmax_value(logits)


def causal_attention(q, k, v):
    """Full-sequence causal attention, q [B, L, H, D], k/v [B, L, KV, D] -> [B, L, H, D]: the same
    per-row computation as paged_attention (each sequence is one page of L keys)."""
    return _exact(_causal_attention_value, FastOps.causal_attention, q, k, v)


def rope_table(max_positions: int, head_dim: int, theta: float):
    """RoPE cos/sin [max_positions, head_dim] in float32, each entry math.cos/sin of a float64 angle:
    the same value at a position whatever the table's length or thread count."""
    inv_freq = [1.0 / theta ** (i / head_dim) for i in range(0, head_dim, 2)]
    angles = [t * f for t in range(max_positions) for f in inv_freq]
    cos = torch.tensor([math.cos(a) for a in angles], dtype=torch.float64).view(max_positions, -1)
    sin = torch.tensor([math.sin(a) for a in angles], dtype=torch.float64).view(max_positions, -1)
    return torch.cat((cos, cos), -1).float(), torch.cat((sin, sin), -1).float()
