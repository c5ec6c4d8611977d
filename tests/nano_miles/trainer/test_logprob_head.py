"""The trainer's chunked log-prob head (nano_miles/trainer/logprob_head.py): the same values and gradients as
plain autograd over the whole [tokens, vocab] logits, without the per-chunk weight gradients."""
import pytest
import torch

from nano_miles.trainer.logprob_head import head_logprobs


def reference(hidden, targets, weight, with_entropy, temperature=1.0):
    logp_all = torch.log_softmax(hidden.float() @ weight.float().t() / temperature, dim=-1)
    logp = logp_all.gather(-1, targets[:, None]).squeeze(-1)
    ent = -(logp_all.exp() * logp_all).sum(-1) if with_entropy else torch.zeros_like(logp)
    return logp, ent


def inputs(dtype, n=37, h=16, v=50, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g).to(dtype).requires_grad_()
    weight = (0.3 * torch.randn(v, h, generator=g)).to(dtype).requires_grad_()
    targets = torch.randint(0, v, (n,), generator=g)
    coef_logp, coef_ent = torch.randn(n, generator=g), torch.randn(n, generator=g)
    return hidden, targets, weight, coef_logp, coef_ent


@pytest.mark.parametrize("chunk", [1, 8, 37, 100])
@pytest.mark.parametrize("entropy_in_loss", [False, True])
def test_values_and_gradients_equal_autograd_over_the_whole_logits(chunk, entropy_in_loss):
    hidden, targets, weight, c1, c2 = inputs(torch.float32)
    results = []
    for fn in (reference, lambda h, t, w, e: head_logprobs(h, t, w, chunk, e, need_grad=True)):
        hidden.grad = weight.grad = None
        logp, ent = fn(hidden, targets, weight, True)
        loss = (c1 * logp).sum() + ((c2 * ent).sum() if entropy_in_loss else 0.0)
        loss.backward()
        results.append((logp.detach(), ent.detach(), hidden.grad.clone(), weight.grad.clone()))
    for got, want in zip(results[1], results[0]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("temperature", [0.6, 1.3])
def test_a_sampling_temperature_gives_the_tempered_distribution_and_its_gradients(temperature):
    """Rollouts sampled at T have log-probs of softmax(logits / T) (the engine's sampler): the head
    computes those, and backpropagates through the division."""
    hidden, targets, weight, c1, c2 = inputs(torch.float32)
    results = []
    for fn in (lambda h, t, w, e: reference(h, t, w, e, temperature),
               lambda h, t, w, e: head_logprobs(h, t, w, 8, e, need_grad=True, temperature=temperature)):
        hidden.grad = weight.grad = None
        logp, ent = fn(hidden, targets, weight, True)
        ((c1 * logp).sum() + (c2 * ent).sum()).backward()
        results.append((logp.detach(), ent.detach(), hidden.grad.clone(), weight.grad.clone()))
    for got, want in zip(results[1], results[0]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    untempered, _ = head_logprobs(hidden, targets, weight, 8, False, need_grad=False)
    assert (results[1][0] - untempered).abs().max() > 0.05  # the temperature is not a no-op


def test_bf16_inputs_get_bf16_gradients_from_float32_arithmetic():
    hidden, targets, weight, c1, _ = inputs(torch.bfloat16)
    logp, _ = head_logprobs(hidden, targets, weight, 8, False, need_grad=True)
    assert logp.dtype == torch.float32
    (c1 * logp).sum().backward()
    assert hidden.grad.dtype == weight.grad.dtype == torch.bfloat16
    h32, w32 = hidden.detach().float().requires_grad_(), weight.detach().float().requires_grad_()
    want, _ = reference(h32, targets, w32, False)
    (c1 * want).sum().backward()
    torch.testing.assert_close(logp.detach(), want.detach())
    torch.testing.assert_close(weight.grad.float(), w32.grad, rtol=1e-2, atol=1e-3)  # one bf16 rounding


def test_entropy_off_returns_zeros_that_carry_no_gradient():
    hidden, targets, weight, c1, c2 = inputs(torch.float32)
    logp, ent = head_logprobs(hidden, targets, weight, 8, False, need_grad=True)
    assert torch.equal(ent, torch.zeros_like(ent))
    ((c1 * logp).sum() + (c2 * ent).sum()).backward()
    want_h, want_w = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    logp, _ = head_logprobs(hidden, targets, weight, 8, False, need_grad=True)
    (c1 * logp).sum().backward()
    assert torch.equal(hidden.grad, want_h) and torch.equal(weight.grad, want_w)


def test_no_grad_path_and_empty_input():
    hidden, targets, weight, _, _ = inputs(torch.float32)
    logp, ent = head_logprobs(hidden, targets, weight, 8, True, need_grad=False)
    want_logp, want_ent = reference(hidden, targets, weight, True)
    torch.testing.assert_close(logp, want_logp.detach())
    torch.testing.assert_close(ent, want_ent.detach())
    assert not logp.requires_grad
    logp, ent = head_logprobs(hidden[:0], targets[:0], weight, 8, True, need_grad=True)
    assert logp.shape == ent.shape == (0,)


def test_later_micro_batches_add_into_the_weights_grad_in_place():
    """Gradient-accumulation fusion: once weight.grad holds a gradient, the next micro-batch's is
    added into that same tensor (no second [V, H] buffer), and the sum is autograd's over both."""
    hidden, targets, weight, c1, _ = inputs(torch.float32)
    halves = [(hidden[:20], targets[:20], c1[:20]), (hidden[20:], targets[20:], c1[20:])]
    for h, t, c in halves:
        (c * reference(h, t, weight, False)[0]).sum().backward()
    want = weight.grad.clone()
    weight.grad = None
    (halves[0][2] * head_logprobs(*halves[0][:2], weight, 8, False, need_grad=True)[0]).sum().backward()
    first = weight.grad
    (halves[1][2] * head_logprobs(*halves[1][:2], weight, 8, False, need_grad=True)[0]).sum().backward()
    assert weight.grad is first  # the same storage, added to in place
    torch.testing.assert_close(weight.grad, want, rtol=1e-5, atol=1e-6)


def test_bf16_weights_keep_autograds_accumulation():
    """Only a float32 .grad is added to in place; a bf16 weight's gradients are summed by autograd."""
    hidden, targets, weight, c1, _ = inputs(torch.bfloat16)
    for _ in range(2):
        (c1 * head_logprobs(hidden, targets, weight, 8, False, need_grad=True)[0]).sum().backward()
    twice = weight.grad.clone()
    weight.grad = None
    (c1 * head_logprobs(hidden, targets, weight, 8, False, need_grad=True)[0]).sum().backward()
    torch.testing.assert_close(twice, 2 * weight.grad)
