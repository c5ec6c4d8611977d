"""Sampling parameters, and sampling of one token per row with its log-prob.

The log-prob is SGLang's: log_softmax(logits / temperature) in FP32 at the sampled token, WITHOUT
renormalising over the top-p/top-k survivors; at temperature 1 with neither, exactly the model's
log-prob, which is what RL needs. Temperature 0 is greedy, its log-prob log_softmax(logits) (SGLang
turns it into temperature 1 + top_k 1).
"""

from dataclasses import dataclass, field

import torch


@dataclass
class SamplingParams:
    """Validated where requests come in (protocol.parse_sampling_params); the engine only asserts."""
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1                    # -1 (or 0) = off
    stop_token_ids: list = field(default_factory=list)
    ignore_eos: bool = False           # as in SGLang: also disables stop_token_ids
    sampling_seed: int | None = None   # per-request reproducible sampling
    min_new_tokens: int = 0            # stop tokens are masked out until this many were generated
    stop: tuple = ()                   # stop strings (SGLang's "stop"): generation ends at the token that completes one


def sample(logits: torch.Tensor, temperatures: list, top_ps: list, top_ks: list, generators: list,
           default_generator: torch.Generator | None, log_softmax=None, fused=None):
    """logits: [B, V] fp32. temperatures, top_ps, top_ks (<= 0 = off), generators (a torch.Generator or
    None = default_generator): per-row Python lists, so deciding what to do needs no device sync.
    log_softmax: the function over the last dim (true on-policy mode passes the batch-invariant one).
    fused: (gumbel_max, gumbel_max_hashed) compiled (engine.enable_torch_compile), taken where no row
    filters by top-k/top-p; the hashed one where no row brings its own generator either.
    Returns (tokens [B] int64, logprobs [B] fp32), both still on the device."""
    device = logits.device
    greedy_rows = [t == 0 for t in temperatures]
    filtered = any(k > 0 for k in top_ks) or any(p < 1 for p in top_ps)
    use_fused = fused is not None and log_softmax is None and not filtered and not all(greedy_rows)
    if use_fused or any(t not in (0, 1) for t in temperatures):
        # greedy rows divide by 1: their log-prob is the model's own (SGLang: temperature 1 + top_k 1)
        temps = to_device([1.0 if t == 0 else float(t) for t in temperatures], device, torch.float32)
        if use_fused:
            with_noise, hashed = fused
            greedy = to_device(greedy_rows, device)
            if all(g is None for g in generators):
                seed = torch.randint(1 << 32, (1,), generator=default_generator, device=device)
                return hashed(logits, temps, seed, greedy)
            return with_noise(logits, temps, _noise(logits, generators, default_generator, clamp=False), greedy)
        logits = logits / temps.unsqueeze(1)
    logprobs = log_softmax(logits) if log_softmax is not None else torch.log_softmax(logits, dim=-1)
    if all(greedy_rows):
        tokens = logits.argmax(dim=-1)
    else:
        probs = logprobs.exp()
        if filtered:
            probs = filter_top_k_top_p(probs, to_device(top_ks, device, torch.int64),
                                       to_device(top_ps, device, torch.float32))
        # Gumbel-max in its exponential form: argmax(p / E), E ~ Exp(1), is a draw from p.
        tokens = (probs / _noise(probs, generators, default_generator)).argmax(dim=-1)
        if any(greedy_rows):
            tokens = torch.where(to_device(greedy_rows, device), logits.argmax(dim=-1), tokens)
    return tokens, logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)


def compiled_draws() -> tuple:
    """sample()'s `fused` pair, compiled (engine.enable_torch_compile): the draw from noise for batches
    with seeded rows, the hashed draw for the rest. dynamic: one graph serves every batch size."""
    return torch.compile(gumbel_max, dynamic=True), torch.compile(gumbel_max_hashed, dynamic=True)


def gumbel_max(logits: torch.Tensor, temps: torch.Tensor, noise: torch.Tensor, greedy: torch.Tensor):
    """sample()'s common case as one traceable function, for torch.compile to fuse into a few passes
    over the vocabulary: log_softmax(logits / T) and the draw argmax(log p - log E) (= argmax(p / E));
    greedy rows (T = 0, temps 1 there) take argmax(logits)."""
    logprobs = torch.log_softmax(logits / temps.unsqueeze(1), dim=-1)
    # the clamp is _noise's, here where it fuses into the pass (one pass less over [rows, vocab])
    tokens = torch.where(greedy, logits.argmax(dim=-1), (logprobs - noise.clamp_min(1e-20).log()).argmax(dim=-1))
    return tokens, logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)


def gumbel_max_hashed(logits: torch.Tensor, temps: torch.Tensor, seed: torch.Tensor, greedy: torch.Tensor):
    """gumbel_max with its noise made inside the pass instead of read from a [rows, vocab] tensor of
    draws: Gumbel noise from a hash of (seed, row, column), so that compiled, the draw and the log-prob
    are one read of the logits. seed: int64 [1], a new one each step from the engine's generator.
    argmax(logits / T + G) is a draw from softmax(logits / T) (the Gumbel-max trick); greedy rows add
    no noise. The log-prob is logits / T at the token less their logsumexp."""
    rows, vocab = logits.shape
    scaled = logits / temps.unsqueeze(1)
    key = _hash32((seed + torch.arange(rows, device=logits.device)) & _MASK32).unsqueeze(1)  # one a row
    # a second key of the row's, mixed in after the column: with the same key twice, H(0 ^ key) ^ H(key)
    # would be 0 in every row, and column 0 would always draw the least noise
    bits = _hash32(_hash32(torch.arange(vocab, device=logits.device).unsqueeze(0) ^ key) ^ _hash32(key ^ 0x9E3779B9))
    uniform = ((bits >> 8).float() + 0.5) * 2.0 ** -24  # 24 bits, in (0, 1): both logs are finite
    noise = torch.where(greedy.unsqueeze(1), 0.0, -torch.log(-torch.log(uniform)))
    tokens = (scaled + noise).argmax(dim=-1)
    return tokens, scaled.gather(1, tokens.unsqueeze(1)).squeeze(1) - torch.logsumexp(scaled, dim=-1)


_MASK32 = 0xFFFFFFFF


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """Wellons' lowbias32, a bijective hash of 32-bit integers held in int64 (no int64 overflow)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """x * c mod 2^32, in two halves of c so that no product passes 2^63."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _MASK32


def to_device(values, device: torch.device, dtype=None) -> torch.Tensor:
    """values (a list or a numpy array) on device without waiting for the GPU: CUDA syncs the stream
    before a copy from pageable memory, which would stall an overlapped step (engine.overlap_schedule),
    so on a GPU the copy goes through pinned memory (torch's caching host allocator)."""
    t = torch.as_tensor(values, dtype=dtype)
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t


def _noise(like: torch.Tensor, generators: list, default_generator, clamp: bool = True) -> torch.Tensor:
    """Exp(1) draws shaped like `like`: each row from its request's generator, else the default one.
    clamp=False leaves the clamp to the caller (gumbel_max fuses it)."""
    noise = _exponential(torch.empty_like(like), default_generator)
    for i, g in enumerate(generators):
        if g is not None:
            _exponential(noise[i], g)
    return noise.clamp_min_(1e-20) if clamp else noise  # an exact 0 would pick its token whatever its probability


def _exponential(noise: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Fill noise with Exp(1) draws in place. torch's CPU exponential_ draws one double at a time, about
    6x slower than a uniform draw and a log (20 ms a step for 8 rows of Qwen's 152k vocabulary), so on
    the CPU E = -log(U); CUDA's exponential_ is one fused kernel already."""
    if noise.device.type == "cuda":
        return noise.exponential_(generator=generator)
    return noise.uniform_(generator=generator).log_().neg_()  # U = 0 gives E = inf: p / E = 0, never drawn


def filter_top_k_top_p(probs: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor) -> torch.Tensor:
    """Zero the probabilities outside each row's top-k and top-p nucleus (the top token always stays)."""
    V = probs.shape[-1]
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    rank = torch.arange(V, device=probs.device).unsqueeze(0)
    k = torch.where(top_ks > 0, top_ks, torch.full_like(top_ks, V)).unsqueeze(1)
    # a token is outside the nucleus when the mass before it already exceeds top_p (SGLang's rule);
    # rows with top_p == 1 skip the test, so FP32 cumsum drift above 1.0 cannot cut their tail
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    drop = (rank >= k) | ((mass_before > top_ps.unsqueeze(1)) & (top_ps < 1).unsqueeze(1))
    sorted_probs = sorted_probs.masked_fill(drop, 0.0)
    return torch.zeros_like(probs).scatter_(1, order, sorted_probs)
