"""The trainer's head: hidden states -> float32 log p(target) (and entropy), chunk by chunk, so the
[tokens, vocab] logits exist one chunk at a time (the backward recomputes them).

The backward is written out for the lm_head weight's gradient: under autograd every chunk of every
micro-batch makes its own full [vocab, hidden] gradient (0.54 GB for Qwen2.5-0.5B) that is then added
to `.grad`, three copies alive at once; here each chunk's product is added in place (addmm_) into one
buffer, from the second micro-batch on the float32 `.grad` itself (Megatron's accumulation fusion).
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from nano_miles.engine import batch_invariant


def tempered_logits(hidden, weight, temperature: float = 1.0):
    """[N, V] float32 logits, divided by the sampling temperature after the FP32 matmul, as the
    engine's sampler divides them (a temperature folded into bf16 hidden states would round them)."""
    # FP32 lm_head, like the engine: bf16 logits would be rounded to 8 mantissa bits, and a hidden
    # state that differs from the engine's in its last bit would then round to a different logit.
    logits = F.linear(hidden.float(), weight.float())
    return logits if temperature == 1.0 else logits.div_(temperature)  # in place: no second [N, V] buffer


def chunk_logprobs(hidden, targets, weight, with_entropy: bool, temperature: float = 1.0):
    """(log p(target), entropy or zeros) in float32 for hidden [N, H] at `temperature`."""
    return _pick(torch.log_softmax(tempered_logits(hidden, weight, temperature), dim=-1), targets, with_entropy)


def _pick(logp_all, targets, with_entropy: bool):
    logp = logp_all.gather(-1, targets[:, None]).squeeze(-1)
    return logp, -(logp_all.exp() * logp_all).sum(-1) if with_entropy else torch.zeros_like(logp)


def chunk_logit_grads(hidden, targets, weight, grad_logp, grad_entropy, temperature: float = 1.0):
    """d(loss)/d(lm_head's output) [N, V] of one chunk, recomputed, given the loss's gradients with
    respect to its log-probs and entropies (grad_entropy None: not differentiated)."""
    logp_all = torch.log_softmax(tempered_logits(hidden, weight, temperature), dim=-1)
    probs = logp_all.exp()
    # d/d(logp_all): the gather puts grad_logp at each target; entropy = -sum(p * logp) gives
    # -grad_entropy * p * (logp + 1). Then log_softmax's backward: g - p * sum(g).
    grad = torch.zeros_like(logp_all)
    if grad_entropy is not None:
        grad = (logp_all + 1.0).mul_(probs).mul_(-grad_entropy[:, None])
    grad.scatter_add_(-1, targets[:, None], grad_logp[:, None])
    grad.sub_(probs.mul_(grad.sum(-1, keepdim=True)))
    return grad if temperature == 1.0 else grad.div_(temperature)  # logits / T: the chain rule's 1 / T


def _chunked(hidden, targets, weight, chunk: int, with_entropy: bool, temperature: float, head=None):
    head = head or chunk_logprobs
    parts = [head(hidden[s:s + chunk], targets[s:s + chunk], weight, with_entropy, temperature)
             for s in range(0, hidden.shape[0], chunk)]
    if not parts:  # nothing scored: still of hidden's graph (a micro-batch's loss must backward)
        empty = hidden.float().sum(-1)
        return empty, empty
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


class ChunkedLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, targets, weight, chunk: int, with_entropy: bool, temperature: float):
        ctx.save_for_backward(hidden, targets, weight)
        ctx.chunk, ctx.with_entropy, ctx.temperature = chunk, with_entropy, temperature
        ctx.set_materialize_grads(False)  # an output the loss does not use comes back as None
        return _chunked(hidden, targets, weight, chunk, with_entropy, temperature)

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        hidden, targets, weight = ctx.saved_tensors
        need_hidden, _, need_weight = ctx.needs_input_grad[:3]
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        # Gradient-accumulation fusion (Megatron's main_grad): a float32 weight that already holds a
        # gradient (a later micro-batch) takes this one in place, and autograd gets None for it, so
        # no second [V, H] buffer exists at the peak. Not under create_graph (then grads are graphs).
        into_grad = (need_weight and weight.dtype == torch.float32 and weight.grad is not None
                     and not torch.is_grad_enabled())
        grad_weight = None
        if need_weight:
            grad_weight = weight.grad if into_grad else torch.zeros(weight.shape, dtype=torch.float32,
                                                                    device=weight.device)
        w32 = weight.float()
        if grad_logp is None:
            grad_logp = torch.zeros(hidden.shape[0], device=hidden.device)
        if not ctx.with_entropy:
            grad_entropy = None  # the zeros returned in its place depend on nothing
        for s in range(0, hidden.shape[0], ctx.chunk):
            h = hidden[s:s + ctx.chunk]
            g = chunk_logit_grads(h, targets[s:s + ctx.chunk], w32, grad_logp[s:s + ctx.chunk].float(),
                                  None if grad_entropy is None else grad_entropy[s:s + ctx.chunk].float(),
                                  ctx.temperature)
            if need_hidden:
                grad_hidden[s:s + ctx.chunk] = (g @ w32).to(hidden.dtype)
            if need_weight:
                grad_weight.addmm_(g.t(), h.float())  # in place: one [V, H] buffer for every chunk
        if into_grad:
            grad_weight = None  # already in weight.grad
        elif grad_weight is not None and weight.dtype != torch.float32:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, None, grad_weight, None, None, None


def head_logprobs(hidden, targets, weight, chunk: int, with_entropy: bool, need_grad: bool,
                  temperature: float = 1.0, exact: bool = False):
    """(log-probs [N], entropies [N] or zeros), float32, for hidden [N, H] against lm_head `weight`, of
    softmax(logits / T), the distribution the engine samples. exact: through the engine's
    batch-invariant head (true on-policy mode), whose backward recomputes each chunk (checkpoint)."""
    head = _exact_chunk if exact else None
    if not need_grad:
        with torch.no_grad():
            return _chunked(hidden, targets, weight, chunk, with_entropy, temperature, head)
    if exact:
        head = functools.partial(checkpoint, _exact_chunk, use_reentrant=False)
        return _chunked(hidden, targets, weight, chunk, with_entropy, temperature, head)
    return ChunkedLogprobs.apply(hidden, targets, weight, chunk, with_entropy, temperature)


def _exact_chunk(hidden, targets, weight, with_entropy: bool, temperature: float):
    """chunk_logprobs bit for bit as the engine computes them (of the untempered distribution)."""
    if temperature != 1.0:
        raise ValueError("true on-policy log-probs are of the model's distribution: temperature must be 1")
    logp_all = batch_invariant.log_softmax(batch_invariant.linear(hidden, weight, out_dtype=torch.float32))
    return _pick(logp_all, targets, with_entropy)
