"""The bf16 log-prob contract on the project's default model, Qwen2.5-Coder-0.5B-Instruct, on CPU.

The engine samples at temperature 1 from real chat prompts (batched); its log-probs are compared
with teacher-forced forwards of the same weights: HF's bf16 body + an FP32 head (the engine's own
head precision) and the same bf16-rounded weights computed in FP32 (the exact value).

Issue 3's bf16 bound (2e-2 max / 2e-3 mean against a bf16 teacher-forced pass) is NOT met on this
model, and HF's own KV-cached decoding misses it too (docs/benchmarks.md has the figures): the
engine's teacher-forced prefill is bit-identical to HF's forward, but a decode step runs the same
rows through SDPA and GEMM calls of other shapes, whose bf16 results differ by one ulp here and
there; over 24 layers that moves a log-prob by ~6e-3 nats on average and up to ~0.1. HF's KV-cached
decoding against its own teacher-forced pass differs just as much (0.09-0.105 max, 0.0062-0.0066
mean). What holds, and is asserted: the engine is as close to the exact value as HF's bf16 forward.
"""
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from nano_miles.engine.engine import Engine, EngineConfig, SamplingParams
from nano_miles.models.prepare import DEFAULT_MODEL, resolve_model

QUESTIONS = ["Write a shell command that counts the lines in the file notes.txt.",
             "What does `ls -la` print?",
             "Write a Python function that reverses a string.",
             "How do I find every file larger than 1 MB under /var/log?"]
NEW_TOKENS = 32


def teacher_forced(body, w_head, prompt, output):
    """log p(output[i] | prompt + output[:i]) from one forward: `body`'s hidden states, FP32 head."""
    with torch.no_grad():
        h = body(torch.tensor([prompt + output])).last_hidden_state[0, len(prompt) - 1:-1]
    lp = torch.log_softmax(F.linear(h.float(), w_head), dim=-1)
    return lp.gather(1, torch.tensor(output).unsqueeze(1)).squeeze(1)


def test_bf16_logprobs_on_qwen_are_as_exact_as_hf_bf16():
    # The shared default cache (CI prepares it); a failed preparation raises ModelError saying why.
    path = str(resolve_model(DEFAULT_MODEL))
    eng = Engine(EngineConfig(model=path, device="cpu", dtype="bfloat16", block_size=4, num_kv_blocks=256))
    tok = eng.tokenizer
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                                  add_generation_prompt=True), add_special_tokens=False)
               for q in QUESTIONS]
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, SamplingParams(max_new_tokens=NEW_TOKENS, temperature=1.0, sampling_seed=i))
    done = {}
    while eng.has_unfinished():
        for r in eng.step():
            done[r.rid] = r
    del eng  # one model in memory at a time
    runs = [(p, done[f"r{i}"]) for i, p in enumerate(prompts)]
    assert all(len(r.output_ids) == len(r.output_logprobs) >= 8 for _, r in runs)
    ours = torch.cat([torch.tensor(r.output_logprobs) for _, r in runs])

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    w_head = hf.lm_head.weight.detach().float()
    hf_bf16 = torch.cat([teacher_forced(hf.model, w_head, p, r.output_ids) for p, r in runs])
    hf.float()  # the same bf16-rounded weights, now computed in FP32: the exact value
    exact = torch.cat([teacher_forced(hf.model, w_head, p, r.output_ids) for p, r in runs])

    ours_err, hf_err = (ours - exact).abs(), (hf_bf16 - exact).abs()
    # measured over 3 sampling seeds: ours 0.051-0.114 max / 0.0058-0.0075 mean, HF bf16
    # 0.065-0.123 max / 0.0064-0.0074 mean. The maximum is one token of 128 and moves with the
    # environment's random draws, so the tail is compared at its 95th percentile (ours 0.029, HF 0.031).
    # Mutations this catches: decode attending without the newest or the first key (mean 0.14 / 0.074),
    # logits rounded to bf16 (mean 0.0091).
    assert ours_err.mean() <= 1.25 * hf_err.mean(), (ours_err.mean(), hf_err.mean())
    assert ours_err.quantile(0.95) <= 1.25 * hf_err.quantile(0.95), (ours_err.quantile(0.95), hf_err.quantile(0.95))
    assert ours_err.mean() < 1e-2 and ours_err.max() < 0.2, (ours_err.mean(), ours_err.max())
    # the engine vs HF's bf16 teacher-forced pass, the comparison, for the record
    vs_hf = (ours - hf_bf16).abs()
    assert vs_hf.mean() < 1e-2 and vs_hf.max() < 0.25, (vs_hf.mean(), vs_hf.max())
