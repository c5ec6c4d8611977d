"""Batch-invariant kernels: the ONE implementation the engine and the trainer share in true on-policy mode.

Every op here computes each output row with arithmetic that depends only on that row's inputs, never
on how many rows are in the call, where the row sits in it, or how a sequence was split into calls:

- linear: a fixed reduction order over K per output element (no batch-dependent split-K);
- rms_norm, log_softmax: each row reduced the same way whatever the batch;
- attention: each query row reduces over its keys in blocks of KEY_BLOCK keys, in order from
  position 0, with an online softmax; keys come from KV pages (engine prefill and decode) or from a
  contiguous tensor (the trainer's full-sequence forward) through the same code.

So a token's log-prob is the same bits whether the engine decoded it in a batch of 1 or 64, after
a prefix-cache hit or a chunked prefill, and when the trainer recomputes it over the whole sequence.

Two backends, chosen by the tensor's device (both sides of a run use the same device kind):
- CUDA with triton: nano_miles/engine/batch_invariant_triton.py, one fixed launch configuration per kernel.
- anything else (CPU): plain torch elementwise ops in an order written out here. An elementwise IEEE
  op (+ - * / sqrt, comparisons) gives the same bits wherever the element sits; library GEMMs and
  reductions do not (MKL rounds a row differently with the row count), and on CPU torch finishes a
  vectorised loop with the scalar libm routine, so exp/log/sigmoid may differ in the last bit with
  the element's position. Reductions are therefore pairwise trees of adds (`tree_sum`), and exp/log
  are polynomials evaluated with + and * only. Exact by construction, and slow (K times the memory
  traffic of a GEMM): meant for small models and tests; the real model runs it on GPU.

Training: the forward VALUES come from these kernels; gradients come from the usual fast ops (an
autograd Function per op: linear and log_softmax with their analytic backward, rms_norm, silu_mul
and attention by recomputing the ordinary torch expression in backward). See docs/design.md.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

KEY_BLOCK = 64          # attention reduces over keys in blocks of this many, from position 0, in order
_CHUNK_ELEMENTS = 1 << 24  # torch backend: at most this many products materialised at once


def _triton(t: torch.Tensor):
    """The triton backend module when `t` is on a CUDA device and triton imports, else None."""
    if t.device.type != "cuda":
        return None
    from nano_miles import batch_invariant_triton as tk# imported here: it needs triton, CPU installs lack it

    if not tk.available():
        raise RuntimeError("true on-policy mode on CUDA needs triton (pip install triton)")
    return tk


# ----------------------------------------------------------------------------------------------
# The torch backend's building blocks: fixed-order sums, exp and log from + and * only.

def tree_sum(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Sum over `dim` in a fixed order: pad with zeros to a power of two, then add the two halves
    until one element is left. The order depends only on the length of `dim`. (The summed dim is
    moved outermost, so each half is one contiguous block and every add is one vectorised pass.)"""
    x = x.movedim(dim, 0)
    n = x.shape[0]
    width = 1 << max(0, (n - 1).bit_length())
    if width != n:
        x = torch.cat((x, x.new_zeros((width - n, *x.shape[1:]))))
    while x.shape[0] > 1:
        half = x.shape[0] // 2
        x = x[:half] + x[half:]
    return x[0]


_LOG2E = 1.4426950408889634
_LN2 = 0.6931471805599453
_LN2_HI, _LN2_LO = 6.93147180369123816490e-01, 1.90821492927058770002e-10  # n * _LN2_HI is exact
_EXP_COEFFS = [1.0 / math.factorial(k) for k in range(14)]               # Taylor to r^13, |r| <= ln2/2
_LOG_COEFFS = [2.0 / (2 * k + 1) for k in range(12)]                     # 2 atanh(z) = sum 2 z^(2k+1)/(2k+1)


def _exp(x: torch.Tensor) -> torch.Tensor:
    """exp of a float32 tensor, the same bits for an element wherever it sits (see the module doc)."""
    if x.device.type != "cpu":
        return torch.exp(x)  # CUDA applies one per-element routine to every position
    d = x.double().clamp(-200.0, 200.0)  # exp(-inf) -> 0 and exp(+big) -> inf once rounded to float32
    n = torch.round(d * _LOG2E)
    r = (d - n * _LN2_HI) - n * _LN2_LO
    p = torch.full_like(r, _EXP_COEFFS[-1])
    for c in reversed(_EXP_COEFFS[:-1]):
        p = p * r + c
    two_n = ((n.to(torch.int64) + 1023) << 52).view(torch.float64)  # 2**n from its bits
    return (p * two_n).float()


def _log(x: torch.Tensor) -> torch.Tensor:
    """log of a positive float32 tensor (same guarantee as _exp)."""
    if x.device.type != "cpu":
        return torch.log(x)
    mant, expo = torch.frexp(x.double())          # x = mant * 2**expo, mant in [0.5, 1)
    low = mant < math.sqrt(0.5)
    mant = torch.where(low, mant * 2.0, mant)     # mant in [sqrt(1/2), sqrt(2)): |z| <= 0.172
    expo = torch.where(low, expo - 1, expo)
    z = (mant - 1.0) / (mant + 1.0)
    z2 = z * z
    s = torch.full_like(z, _LOG_COEFFS[-1])
    for c in reversed(_LOG_COEFFS[:-1]):
        s = s * z2 + c
    return (expo.double() * _LN2 + z * s).float()


# ----------------------------------------------------------------------------------------------
# Forward values (no autograd).

def _linear_value(x, weight, bias, out_dtype):
    tk = _triton(x)
    if tk is not None:
        return tk.linear(x, weight, bias, out_dtype)
    K, N = x.shape[-1], weight.shape[0]
    xt = x.reshape(-1, K).float().t().contiguous()  # [K, M]: products laid out [K, rows, cols], summed over K
    wt = weight.float().t().contiguous()             # [K, N]
    M = xt.shape[1]
    width = 1 << max(0, (K - 1).bit_length())
    cols = max(1, min(N, _CHUNK_ELEMENTS // width))
    rows = max(1, _CHUNK_ELEMENTS // (width * cols))
    out = torch.empty(M, N, dtype=torch.float32, device=x.device)
    for r in range(0, M, rows):
        for c in range(0, N, cols):
            out[r:r + rows, c:c + cols] = tree_sum(xt[:, r:r + rows, None] * wt[:, None, c:c + cols], dim=0)
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype or x.dtype).view(*x.shape[:-1], N)


def _rms_norm_value(x, weight, eps):
    tk = _triton(x)
    if tk is not None:
        return tk.rms_norm(x, weight, eps)
    xf = x.float()
    var = tree_sum(xf * xf) / x.shape[-1]
    y = xf * (1.0 / torch.sqrt(var + eps)).unsqueeze(-1)
    return weight * y.to(x.dtype)  # HF's order: normalise in fp32, cast, then scale


def _silu_mul_value(gate, up):
    tk = _triton(gate)
    if tk is not None:
        return tk.silu_mul(gate, up)
    g = gate.float()
    return (g / (1.0 + _exp(-g))).to(gate.dtype) * up


def _log_softmax_value(logits):
    tk = _triton(logits)
    if tk is not None:
        return tk.log_softmax(logits)
    x = logits.float()
    z = x - x.amax(-1, keepdim=True)  # max is exact in any order
    return z - _log(tree_sum(_exp(z))).unsqueeze(-1)


def paged_attention(q, k_cache, v_cache, block_tables, positions, queries_per_table: int = 1):
    """Causal attention of query rows over paged keys, batch-invariant (forward only).

    q: [R, H, D]; k_cache/v_cache: [num_blocks, block_size, KV, D]; block_tables: [R / queries_per_table, N]
    (query row r reads table r // queries_per_table); positions: [R], row r attends to the keys at
    positions 0..positions[r]. Returns [R, H, D] in q's dtype."""
    tk = _triton(q)
    if tk is not None:
        return tk.paged_attention(q, k_cache, v_cache, block_tables, positions, queries_per_table, KEY_BLOCK)
    R, H, D = q.shape
    _, BS, KV, _ = k_cache.shape
    G = H // KV
    rows = torch.arange(R, device=q.device) // queries_per_table
    tables = block_tables[rows]                                   # [R, N]
    capacity = tables.shape[1] * BS
    qf = q.float().view(R, KV, G, 1, D)
    m = torch.full((R, KV, G), float("-inf"), device=q.device)
    l = torch.zeros(R, KV, G, device=q.device)
    acc = torch.zeros(R, KV, G, D, device=q.device)
    # Rows of this call may have shorter contexts than the longest: a block entirely after a row's
    # position is an exact no-op for it (p = 0, alpha = exp(0) = 1), so looping to the longest
    # context gives each row the result of looping to its own.
    for start in range(0, int(positions.max()) + 1, KEY_BLOCK):
        pos = torch.arange(start, start + KEY_BLOCK, device=q.device)
        slot = pos.clamp(max=capacity - 1)                          # masked below; any real key will do
        blocks = tables[:, slot // BS]                              # [R, T]
        k = k_cache[blocks, slot % BS].float().permute(0, 2, 1, 3)  # [R, KV, T, D]
        v = v_cache[blocks, slot % BS].float().permute(0, 2, 1, 3)
        s = tree_sum(qf * k.unsqueeze(2)) * D ** -0.5              # [R, KV, G, T]
        s = s.masked_fill((pos[None, :] > positions[:, None])[:, None, None, :], float("-inf"))
        m_new = torch.maximum(m, s.amax(-1))
        p = _exp(s - m_new.unsqueeze(-1))
        alpha = _exp(m - m_new)
        l = l * alpha + tree_sum(p)
        acc = acc * alpha.unsqueeze(-1) + tree_sum(p.unsqueeze(-1) * v.unsqueeze(2), dim=-2)
        m = m_new
    return (acc / l.unsqueeze(-1)).view(R, H, D).to(q.dtype)


def _causal_attention_value(q, k, v):
    B, L, H, D = q.shape
    tables = torch.arange(B, device=q.device).unsqueeze(1)        # sequence b is "page" b of L keys
    positions = torch.arange(L, device=q.device).repeat(B)
    out = paged_attention(q.reshape(B * L, H, D), k, v, tables, positions, queries_per_table=L)
    return out.view(B, L, H, D)


# ----------------------------------------------------------------------------------------------
# The fast expressions whose backward the trainer uses.

def _rms_norm_fast(x, weight, eps):
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _silu_mul_fast(gate, up):
    return F.silu(gate) * up


def _causal_attention_fast(q, k, v):
    G = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(G, dim=2), v.repeat_interleave(G, dim=2)  # query head h reads KV head h // G
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
    return out.transpose(1, 2)


# ----------------------------------------------------------------------------------------------
# Autograd: exact forward values, fast gradients.

class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, out_dtype):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return _linear_value(x, weight, bias, out_dtype)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        g = grad.reshape(-1, grad.shape[-1])
        gx = gw = gb = None
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
        wanted = [t for t in inputs if t.requires_grad]
        with torch.enable_grad():
            out = ctx.fast(*inputs)
        grads = iter(torch.autograd.grad(out, wanted, grad))
        return (None, None, *[next(grads) if t.requires_grad else None for t in inputs])


def _tracks_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


# ----------------------------------------------------------------------------------------------
# The API (the engine's model and the trainer call these; same signatures as the fast ops).

def linear(x, weight, bias=None, out_dtype=None):
    """x @ weight.T (+ bias), each output element reduced over K in one fixed order; the result in
    out_dtype (default x's). bf16 inputs with out_dtype float32 give FP32 logits from bf16 values."""
    if _tracks_grad(x, weight, bias):
        return _Linear.apply(x, weight, bias, out_dtype)
    return _linear_value(x, weight, bias, out_dtype)


def rms_norm(x, weight, eps: float):
    if _tracks_grad(x, weight):
        return _ExactForward.apply(lambda a, w: _rms_norm_value(a, w, eps), lambda a, w: _rms_norm_fast(a, w, eps),
                                   x, weight)
    return _rms_norm_value(x, weight, eps)


def silu_mul(gate, up):
    """silu(gate) * up."""
    if _tracks_grad(gate, up):
        return _ExactForward.apply(_silu_mul_value, _silu_mul_fast, gate, up)
    return _silu_mul_value(gate, up)


def log_softmax(logits):
    """FP32 log_softmax over the last dimension."""
    if _tracks_grad(logits):
        return _LogSoftmax.apply(logits)
    return _log_softmax_value(logits)


def causal_attention(q, k, v):
    """Full-sequence causal attention, q [B, L, H, D], k/v [B, L, KV, D] -> [B, L, H, D]: the same
    per-row computation as paged_attention (each sequence is one page of L keys)."""
    if _tracks_grad(q, k, v):
        return _ExactForward.apply(_causal_attention_value, _causal_attention_fast, q, k, v)
    return _causal_attention_value(q, k, v)


def rope_table(max_positions: int, head_dim: int, theta: float):
    """RoPE cos/sin [max_positions, head_dim] in float32, each entry math.cos/sin of a float64 angle:
    the same value at a position whatever the table's length, process or thread count (torch's
    vectorised CPU cos would not promise that for the table's tail)."""
    inv_freq = [1.0 / theta ** (i / head_dim) for i in range(0, head_dim, 2)]
    angles = [t * f for t in range(max_positions) for f in inv_freq]
    cos = torch.tensor([math.cos(a) for a in angles], dtype=torch.float64).view(max_positions, -1)
    sin = torch.tensor([math.sin(a) for a in angles], dtype=torch.float64).view(max_positions, -1)
    return torch.cat((cos, cos), -1).float(), torch.cat((sin, sin), -1).float()
