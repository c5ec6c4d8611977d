"""Sampling: the distribution drawn from, the reported log-prob, top-k/top-p, per-request seeds."""

import torch
from transformers import AutoModelForCausalLM

from nano_miles.engine.engine import Engine, EngineConfig, SamplingParams
from nano_miles.engine.sampling import filter_top_k_top_p, gumbel_max, gumbel_max_hashed, sample


def draw(logits, n, temperature=1.0, top_p=1.0, top_k=-1, seed=0):
    B = logits.shape[0]
    rows = logits.repeat(n, 1)
    tokens, lps = sample(rows, [temperature] * (B * n), [top_p] * (B * n), [top_k] * (B * n), [None] * (B * n),
                         torch.Generator().manual_seed(seed))
    return tokens, lps


def test_samples_follow_the_temperature_scaled_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, -3.0]])
    tokens, lps = draw(logits, 20000, temperature=0.7)
    want = torch.softmax(logits[0] / 0.7, -1)
    freq = torch.bincount(tokens, minlength=5).float() / tokens.numel()
    assert torch.allclose(freq, want, atol=0.015), (freq, want)
    # the reported log-prob is log_softmax(logits / T) at the drawn token
    assert torch.allclose(lps, torch.log(want)[tokens], atol=1e-6)


def test_top_k_and_top_p_restrict_support_but_logprob_is_not_renormalised():
    logits = torch.tensor([[3.0, 2.5, 2.0, 0.0, -1.0]])
    tokens, lps = draw(logits, 4000, top_k=2)
    assert set(tokens.tolist()) == {0, 1}
    assert torch.allclose(lps, torch.log_softmax(logits[0], -1)[tokens], atol=1e-6)  # as SGLang reports it
    p = torch.softmax(logits[0], -1)  # [0.49, 0.30, 0.18, 0.02, 0.01]
    tokens, _ = draw(logits, 4000, top_p=0.7)  # mass before token 2 is 0.79 > 0.7: only {0, 1}
    assert set(tokens.tolist()) == {0, 1}
    assert p[:2].sum() > 0.7 > p[0]


def test_filter_keeps_top_token_and_zeroes_the_rest():
    probs = torch.tensor([[0.1, 0.6, 0.3], [0.2, 0.3, 0.5]])
    out = filter_top_k_top_p(probs, torch.tensor([1, -1]), torch.tensor([1.0, 0.1]))
    assert torch.equal(out, torch.tensor([[0.0, 0.6, 0.0], [0.0, 0.0, 0.5]]))


def test_greedy_rows_and_sampled_rows_mix_in_one_batch():
    logits = torch.tensor([[0.0, 5.0, 1.0], [0.0, 0.0, 0.0]])
    tokens, lps = sample(logits, [0.0, 1.0], [1.0, 1.0], [-1, -1], [None, None], torch.Generator().manual_seed(0))
    assert tokens[0] == 1
    assert torch.allclose(lps[0], torch.log_softmax(logits[0], -1)[1])


def test_the_fused_draw_picks_the_eager_tokens_and_logprobs_from_the_same_noise():
    """engine.enable_torch_compile samples through gumbel_max compiled: from the same generators it
    draws what the eager path draws (argmax(log p - log E) = argmax(p / E)), greedy and seeded rows too."""
    g = torch.Generator().manual_seed(5)
    logits = 3 * torch.randn(64, 300, generator=g)
    temps = [0.0, 1.0, 0.7, 1.3] * 16
    seeded = [torch.Generator().manual_seed(i) if i % 5 == 0 else None for i in range(64)]

    def draw(fused):
        gens = [None if s is None else torch.Generator().manual_seed(s.initial_seed()) for s in seeded]
        return sample(logits.clone(), temps, [1.0] * 64, [-1] * 64, gens, torch.Generator().manual_seed(9), fused=fused)

    eager_tokens, eager_lps = draw(None)
    tokens, lps = draw((torch.compile(gumbel_max, dynamic=True), None))  # seeded rows: the draw from noise
    assert torch.equal(tokens, eager_tokens) and len(set(tokens.tolist())) > 32  # draws, not one token
    assert torch.allclose(lps, eager_lps, atol=1e-5)


def test_the_hashed_draw_follows_the_temperature_scaled_distribution_and_reports_its_logprob():
    """With no request's own generator, the compiled draw hashes its Gumbel noise from (seed, row,
    column): a draw from softmax(logits / T) in every column, greedy rows take the argmax, and the
    log-prob is log_softmax(logits / T) at the token, as the draw from noise reports it."""
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, -3.0]]).repeat(40000, 1)
    temps, greedy = torch.full((40000,), 0.7), torch.arange(40000) % 8 == 0
    tokens, lps = gumbel_max_hashed(logits, temps.masked_fill(greedy, 1.0), torch.tensor([12345]), greedy)
    assert (tokens[greedy] == 0).all()
    want = torch.softmax(logits[0] / 0.7, -1)
    drawn = tokens[~greedy]
    freq = torch.bincount(drawn, minlength=5).float() / drawn.numel()
    assert torch.allclose(freq, want, atol=0.006), (freq, want)
    assert torch.allclose(lps[~greedy], torch.log(want)[drawn], atol=1e-6)
    assert torch.allclose(lps[greedy], torch.log_softmax(logits[0], -1)[0], atol=1e-6)


def test_the_hashed_draw_is_independent_across_rows_and_steps_and_the_same_compiled():
    """Rows of one step with the same logits (a GRPO group's first token) draw independently; the
    same seed draws the same tokens, another seed others; compiled it draws what it draws eagerly."""
    even = torch.zeros(20000, 2)  # two equally likely tokens: rows agree half the time if independent
    ones, no_greedy = torch.ones(20000), torch.zeros(20000, dtype=torch.bool)
    a, _ = gumbel_max_hashed(even, ones, torch.tensor([3]), no_greedy)
    b, _ = gumbel_max_hashed(even, ones, torch.tensor([4_000_000_000]), no_greedy)
    assert abs(a.float().mean() - 0.5) < 0.015
    assert abs((a[0::2] == a[1::2]).float().mean() - 0.5) < 0.015  # neighbouring rows
    assert abs((a == b).float().mean() - 0.5) < 0.015               # two steps
    assert torch.equal(a, gumbel_max_hashed(even, ones, torch.tensor([3]), no_greedy)[0])
    g = torch.Generator().manual_seed(5)
    logits, temps = 3 * torch.randn(64, 3000, generator=g), torch.tensor([1.0, 0.7, 1.3, 1.0] * 16)
    greedy = torch.arange(64) % 4 == 3
    tokens, lps = gumbel_max_hashed(logits, temps, torch.tensor([77]), greedy)
    compiled = torch.compile(gumbel_max_hashed, dynamic=True)(logits, temps, torch.tensor([77]), greedy)
    assert torch.equal(compiled[0], tokens) and len(set(tokens.tolist())) > 32
    assert torch.allclose(compiled[1], lps, atol=1e-5)


def test_sample_takes_the_hashed_draw_where_no_row_brings_a_generator():
    g = torch.Generator().manual_seed(1)
    logits, temps = 3 * torch.randn(16, 50, generator=g), [0.0, 0.7, 1.0, 1.3] * 4

    def fused_sample(logits, generators, seed):
        return sample(logits.clone(), temps, [1.0] * 16, [-1] * 16, generators, torch.Generator().manual_seed(seed),
                      fused=(gumbel_max, gumbel_max_hashed))

    tokens, lps = fused_sample(logits, [None] * 16, 0)
    seed = torch.randint(1 << 32, (1,), generator=torch.Generator().manual_seed(0))  # what sample draws
    hashed = gumbel_max_hashed(logits, torch.tensor([1.0 if t == 0 else t for t in temps]), seed,
                               torch.tensor([t == 0 for t in temps]))
    assert torch.equal(tokens, hashed[0]) and torch.equal(lps, hashed[1])
    seeded = fused_sample(logits, [torch.Generator().manual_seed(2)] + [None] * 15, 0)
    assert not torch.equal(seeded[0], tokens)  # one request's own generator: the draw from noise


def run(eng, reqs):
    for rid, ids, sp in reqs:
        eng.add_request(rid, ids, sp)
    done = {}
    while eng.has_unfinished():
        done.update({r.rid: r for r in eng.step()})
    return done


def test_engine_temperature_logprobs_match_hf(tiny):
    hf = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    eng = Engine(EngineConfig(model=tiny, dtype="float32", block_size=4, num_kv_blocks=64))
    p = [5, 9, 33, 71, 8, 100, 12]
    r = run(eng, [("t", p, SamplingParams(max_new_tokens=12, temperature=0.6, top_p=0.9, ignore_eos=True))])["t"]
    with torch.no_grad():
        logits = hf(torch.tensor([p + r.output_ids])).logits[0].float()
    ref = torch.log_softmax(logits / 0.6, -1)[torch.arange(len(p) - 1, len(p) - 1 + 12), torch.tensor(r.output_ids)]
    assert torch.allclose(torch.tensor(r.output_logprobs), ref, atol=1e-5)


def test_top_k_1_is_greedy(tiny):
    eng = Engine(EngineConfig(model=tiny, dtype="float32", block_size=4, num_kv_blocks=64))
    p = [7, 8, 9, 10, 11]
    done = run(eng, [("g", p, SamplingParams(max_new_tokens=10, temperature=0, ignore_eos=True)),
                     ("k", p, SamplingParams(max_new_tokens=10, temperature=1.3, top_k=1, ignore_eos=True))])
    assert done["g"].output_ids == done["k"].output_ids


def test_sampling_seed_reproducible_whatever_the_batch(tiny):
    eng = Engine(EngineConfig(model=tiny, dtype="float32", block_size=4, num_kv_blocks=128, seed=123))
    p = [40, 41, 42, 43]
    sp = lambda seed: SamplingParams(max_new_tokens=16, temperature=1.0, ignore_eos=True, sampling_seed=seed)
    alone = run(eng, [("a", p, sp(7))])["a"]
    crowd = run(eng, [("x", [3, 4, 5], sp(None)), ("b", p, sp(7)), ("c", p, sp(8)), ("y", [9] * 9, sp(None))])
    assert crowd["b"].output_ids == alone.output_ids
    assert crowd["c"].output_ids != alone.output_ids
