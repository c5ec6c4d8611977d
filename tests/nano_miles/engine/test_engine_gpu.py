"""The engine on a CUDA device: graph-replayed decode against eager decode and against HF."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from nano_miles.engine.engine import Engine, EngineConfig, SamplingParams
from nano_miles.engine.sampling import gumbel_max_hashed

from .test_engine import run_script

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def run(eng, reqs):
    for rid, ids, sp in reqs:
        eng.add_request(rid, ids, sp)
    done = {}
    while eng.has_unfinished():
        done.update({r.rid: r for r in eng.step()})
    return done


def requests(n, vocab, greedy=True, seeded=False):
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        length = int(torch.randint(3, 60, (1,), generator=g))
        ids = torch.randint(3, vocab, (length,), generator=g).tolist()
        out.append((f"r{i}", ids, SamplingParams(max_new_tokens=5 + 7 * (i % 5), temperature=0 if greedy else 1,
                                                 ignore_eos=True, sampling_seed=i if seeded else None)))
    return out


def teacher_forced_logprobs(hf, ids, output_ids):
    with torch.no_grad():
        lp = torch.log_softmax(hf(torch.tensor([ids + output_ids], device="cuda")).logits[0].float(), -1)
    return torch.tensor([lp[len(ids) - 1 + i, t].item() for i, t in enumerate(output_ids)])


def test_graph_decode_equals_eager_decode_fp32(tiny):
    reqs = requests(37, 1024)
    eager = run(Engine(EngineConfig(model=tiny, device="cuda", dtype="float32", cuda_graph=False, block_size=16)), reqs)
    eng = Engine(EngineConfig(model=tiny, device="cuda", dtype="float32", cuda_graph=True, block_size=16,
                              max_running_requests=64))
    graphed = run(eng, reqs)
    assert eng.graphs is not None and len(eng.graphs.graphs) > 1  # several buckets were captured and replayed
    for rid in eager:
        assert graphed[rid].output_ids == eager[rid].output_ids
        assert torch.allclose(torch.tensor(graphed[rid].output_logprobs), torch.tensor(eager[rid].output_logprobs), atol=1e-4)


@pytest.mark.parametrize("rows", ["greedy", "seeded"])
def test_a_compiled_graph_decode_equals_eager_decode_fp32(tiny, rows):
    """engine.enable_torch_compile: the inductor-fused forward (the paged Triton kernel inside it) under
    CUDA graphs decodes what eager decode does, and the fused draw from a request's own generator
    samples what the eager one does."""
    reqs = requests(37, 1024, greedy=rows == "greedy", seeded=rows == "seeded")
    eager = run(Engine(EngineConfig(model=tiny, device="cuda", dtype="float32", cuda_graph=False, block_size=16)), reqs)
    eng = Engine(EngineConfig(model=tiny, device="cuda", dtype="float32", block_size=16, max_running_requests=64,
                              enable_torch_compile=True))
    compiled = run(eng, reqs)
    assert eng.attention_backend == "triton" and len(eng.graphs.graphs) > 1
    for rid in eager:
        assert compiled[rid].output_ids == eager[rid].output_ids
        assert torch.allclose(torch.tensor(compiled[rid].output_logprobs), torch.tensor(eager[rid].output_logprobs), atol=1e-4)


def test_the_compiled_hashed_draw_reports_the_models_logprobs_of_what_it_draws(tiny):
    """Rows without a generator of their own take the hashed draw (noise made inside the fused pass):
    its tokens are draws, not the argmax, and each log-prob is HF's at the token drawn; on the GPU the
    compiled draw picks the tokens the eager one picks on the CPU from the same seed."""
    hf = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).cuda().eval()
    reqs = requests(37, 1024, greedy=False)
    eng = Engine(EngineConfig(model=tiny, device="cuda", dtype="float32", block_size=16, max_running_requests=64,
                              enable_torch_compile=True))
    drawn = run(eng, reqs)
    greedy = run(Engine(EngineConfig(model=tiny, device="cuda", dtype="float32", block_size=16)),
                 requests(37, 1024, greedy=True))
    assert sum(drawn[rid].output_ids != greedy[rid].output_ids for rid in drawn) > 30
    for rid, ids, _ in reqs:
        ref = teacher_forced_logprobs(hf, ids, drawn[rid].output_ids)
        assert torch.allclose(torch.tensor(drawn[rid].output_logprobs), ref, atol=1e-4), rid
    logits, temps = 3 * torch.randn(256, 151936, device="cuda"), torch.full((256,), 0.7, device="cuda")
    greedy_rows, seed = torch.arange(256, device="cuda") % 8 == 0, torch.tensor([99], device="cuda")
    tokens, lps = eng._fused_sample[1](logits, temps, seed, greedy_rows)
    cpu_tokens, cpu_lps = gumbel_max_hashed(logits.cpu(), temps.cpu(), seed.cpu(), greedy_rows.cpu())
    assert (tokens.cpu() == cpu_tokens).float().mean() > 0.99  # a last-bit tie of two logs may flip a row
    assert torch.allclose(lps.cpu(), cpu_lps, atol=1e-4)


@pytest.mark.parametrize("compiled", [False, True])
def test_an_overlapped_graph_decode_equals_the_plain_step_fp32(tiny, compiled):
    """engine.overlap_schedule on a GPU: step n+1 launched (its input tokens gathered on the device, its
    graph replayed) before step n's tokens are read back through pinned memory, as plain steps decode;
    and through stops, preemption, an abort and a weight update (test_engine.py's script)."""
    reqs = requests(37, 1024)
    kw = dict(model=tiny, device="cuda", dtype="float32", block_size=16, max_running_requests=64,
              enable_torch_compile=compiled)
    plain = run(Engine(EngineConfig(**kw)), reqs)
    eng = Engine(EngineConfig(**kw, overlap_schedule=True))
    overlapped = run(eng, reqs)
    assert len(eng.graphs.graphs) > 1 and eng._inflight is None
    for rid in plain:
        assert overlapped[rid].output_ids == plain[rid].output_ids
        assert torch.allclose(torch.tensor(overlapped[rid].output_logprobs), torch.tensor(plain[rid].output_logprobs), atol=1e-4)
    small = dict(kw, block_size=4, num_kv_blocks=48)
    a, b = run_script(Engine(EngineConfig(**small))), run_script(Engine(EngineConfig(**small, overlap_schedule=True)))
    assert sorted(a) == sorted(b)
    for rid in a:
        assert (b[rid].output_ids, b[rid].finish_reason, b[rid].cached_tokens) == \
            (a[rid].output_ids, a[rid].finish_reason, a[rid].cached_tokens), rid
        assert torch.allclose(torch.tensor(b[rid].output_logprobs), torch.tensor(a[rid].output_logprobs), atol=1e-4)


def test_gpu_logprobs_match_hf_teacher_forcing(tiny):
    hf = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).cuda().eval()
    eng = Engine(EngineConfig(model=tiny, device="cuda", dtype="float32"))
    reqs = requests(8, 1024, greedy=False)
    done = run(eng, reqs)
    for rid, ids, _ in reqs:
        ref = teacher_forced_logprobs(hf, ids, done[rid].output_ids)
        assert torch.allclose(torch.tensor(done[rid].output_logprobs), ref, atol=1e-4), rid


def test_gpu_weight_update_keeps_graphs_valid(tiny):
    """load_weights copies in place, so captured graphs see the new weights."""
    hf = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    eng = Engine(EngineConfig(model=tiny, device="cuda", dtype="float32"))
    p = list(range(20, 50))
    sp = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)
    run(eng, [("a", p, sp)])
    new = {n: t * 1.5 for n, t in hf.named_parameters()}
    eng.load_weights(new.items())
    hf.load_state_dict(new, strict=False)
    r = run(eng, [("b", p, sp)])["b"]
    ref = hf.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert r.cached_tokens == 0 and r.output_ids == ref[0, len(p):].tolist()


# bf16: one rounding flip moves a log-prob of this 64-wide random model by up to ~0.08 (HF's own cached
# decoding differs from its full forward that much); measured on an H200: 0.057 max.
@pytest.mark.parametrize("dtype,tol", [("float32", 1e-4), ("bfloat16", 0.1)])
def test_triton_paged_decode_equals_torch_decode(tiny, dtype, tol):
    """Greedy decoding with the paged Triton kernel gives the torch (gather + SDPA) path's tokens and
    log-probs (bf16: rounding may flip a near-tie, so most, not all, sequences must agree)."""
    greedy = requests(40, 1024, greedy=True)
    a = run(Engine(EngineConfig(model=tiny, device="cuda", dtype=dtype, attention_backend="torch")), greedy)
    eng = Engine(EngineConfig(model=tiny, device="cuda", dtype=dtype, attention_backend="triton"))
    assert eng.attention_backend == "triton"
    b = run(eng, greedy)
    same = [r for r in a if a[r].output_ids == b[r].output_ids]
    assert len(same) >= (40 if dtype == "float32" else 30), len(same)
    errs = torch.cat([(torch.tensor(a[r].output_logprobs) - torch.tensor(b[r].output_logprobs)).abs() for r in same])
    assert errs.max() < tol, errs.max()


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_packed_prefill_kernel_equals_attention_over_each_sequence(dtype, tol):
    """The packed kernel: chunks of four sequences (a long prompt, a chunk after cached keys, two decode
    rows) in one row; each token sees its own sequence's keys up to its position, as SDPA over that
    sequence alone computes."""
    from nano_miles.engine.triton_attention import TILE_ROWS, packed_prefill_attention
    torch.manual_seed(0)
    H, KV, D, BS, NB = 14, 2, 64, 16, 128
    kc, vc = (torch.randn(NB, BS, KV, D, device="cuda", dtype=dtype) for _ in range(2))
    chunks = [(0, 150), (37, 20), (300, 1), (5, 1)]  # (first position, tokens)
    blocks = torch.randperm(NB, device="cuda").tolist()
    tables, tiles, positions, at = [], [], [], 0
    for i, (start, n) in enumerate(chunks):
        tables.append([blocks.pop() for _ in range(-(-(start + n) // BS))])
        positions += range(start, start + n)
        tiles += [(i, at + j, min(TILE_ROWS, n - j)) for j in range(0, n, TILE_ROWS)]
        at += n
    width = max(map(len, tables))
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], device="cuda")
    q = torch.randn(at, H, D, device="cuda", dtype=dtype)
    out = packed_prefill_attention(q, kc, vc, bt, torch.tensor(positions, device="cuda"),
                                   torch.tensor(tiles, dtype=torch.int32, device="cuda"))
    at = 0
    for i, (start, n) in enumerate(chunks):
        keys = kc[bt[i]].reshape(-1, KV, D)[:start + n].float().repeat_interleave(H // KV, 1).transpose(0, 1)
        vals = vc[bt[i]].reshape(-1, KV, D)[:start + n].float().repeat_interleave(H // KV, 1).transpose(0, 1)
        mask = torch.arange(start + n, device="cuda")[None] <= torch.arange(start, start + n, device="cuda")[:, None]
        ref = torch.nn.functional.scaled_dot_product_attention(q[at:at + n].float().transpose(0, 1), keys, vals,
                                                               attn_mask=mask)
        assert (out[at:at + n].float() - ref.transpose(0, 1)).abs().max() < tol, i
        at += n


def test_packed_prefill_with_decoding_riders_equals_the_torch_path(tiny):
    """Requests arriving while others decode: the Triton engine packs each prefill step and lets the
    decoding sequences ride in it; tokens and log-probs are the torch path's (fp32)."""
    def staggered(eng):
        reqs, done = requests(48, 1024), {}
        for rid, ids, sp in reqs[:16]:
            eng.add_request(rid, ids, sp)
        for step in range(10_000):
            if step in (3, 6, 9):  # new turns land while the first ones decode
                for rid, ids, sp in reqs[16 + (step // 3 - 1) * 11: 16 + (step // 3) * 11]:
                    eng.add_request(rid, ids * 5, sp)  # longer prompts: chunks cut into several tiles
            done.update({r.rid: r for r in eng.step()})
            if not eng.has_unfinished() and step > 9:
                return done
    a = staggered(Engine(EngineConfig(model=tiny, device="cuda", dtype="float32", attention_backend="torch")))
    eng = Engine(EngineConfig(model=tiny, device="cuda", dtype="float32", attention_backend="triton",
                              packed_prefill=True, max_num_batched_tokens=256))
    assert eng.packed_prefill and eng.scheduler.mix_decode
    assert Engine(EngineConfig(model=tiny, device="cuda", dtype="float32", num_kv_blocks=64)).packed_prefill  # the default
    b = staggered(eng)
    assert len(a) == len(b) == 48
    for rid in a:
        assert b[rid].output_ids == a[rid].output_ids, rid
        assert torch.allclose(torch.tensor(b[rid].output_logprobs), torch.tensor(a[rid].output_logprobs), atol=1e-4)


def test_a_bf16_engine_leaves_the_processs_fp32_matmuls_as_it_found_them(tiny):
    """A bf16 engine runs its FP32 lm_head matmul in TF32 (bf16-valued operands are exact there), but an
    FP32 engine or trainer in the same process keeps IEEE FP32 matmuls."""
    torch.set_float32_matmul_precision("highest")  # as a fresh process has it (a bf16 trainer sets its own)
    eng = Engine(EngineConfig(model=tiny, device="cuda", dtype="bfloat16"))
    run(eng, requests(4, 1024))
    assert torch.get_float32_matmul_precision() == "highest"


def test_a_weight_bucket_is_packed_outside_expandable_segments(monkeypatch):
    """An engine opens and closes a CUDA IPC handle of an expandable segment ~2 ms slower each, and
    nano-miles runs its processes with expandable segments: a sync's bucket comes from plain ones."""
    from nano_miles.engine import weights as W

    def segment_of(t):
        ptr = t.data_ptr()
        return next(s for s in torch.cuda.memory_snapshot() if s["address"] <= ptr < s["address"] + s["total_size"])

    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    torch._C._accelerator_setAllocatorSettings("expandable_segments:True")
    try:
        _, bucket = W.serialize_bucket([("w", torch.randn(1024, 1024, device="cuda"))])
        assert segment_of(bucket.flattened_tensor)["is_expandable"] is False
        assert segment_of(torch.empty(16 << 20, device="cuda"))["is_expandable"] is True  # the rest stays expandable
    finally:
        torch._C._accelerator_setAllocatorSettings("expandable_segments:False")
