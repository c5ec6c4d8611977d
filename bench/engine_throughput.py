"""Output tokens/s of our engine against HF `generate` (static batch), in the same run.

Random-initialised Qwen2.5-0.5B shapes (hidden 896, 24 layers, 14 heads / 2 KV heads, intermediate
4864, vocab 151936, tied), PROMPT-token random prompts, NEW output tokens each (ignore_eos, temperature
1), at each concurrency. Also reports the bf16 log-prob gap of the engine against an HF teacher-forced
forward of the same weights (in the run's dtype). Prints a table, appends one JSON line to bench/results.jsonl, and writes
the table and the JSON line to $OUT when that is set.

--true-on-policy runs the same requests a second time through an engine in true on-policy mode
(batch-invariant kernels, nano_miles/engine/batch_invariant.py) in the same process, reports its slowdown
against the normal mode, and checks its log-probs against the true on-policy trainer's forward of the
same weights (must be exactly 0).

    PYTHONPATH=. python3 bench/engine_throughput.py                  # GPU defaults: 64 and 256 requests
    PYTHONPATH=. python3 bench/engine_throughput.py --true-on-policy --skip-hf
    PYTHONPATH=. python3 bench/engine_throughput.py --device cpu     # small CPU scale
"""

import argparse
import json
import os
import platform
import sys
import time

import torch
from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench.results import add_dry_run, git_commit, save, scratch_dir, utc_now  # noqa: E402
from nano_miles.engine import batch_invariant# noqa: E402
from nano_miles.engine.engine import Engine, EngineConfig, SamplingParams  # noqa: E402
from nano_miles.engine.model import CausalLM  # noqa: E402

QWEN25_05B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                  num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768, rope_theta=1000000.0,
                  tie_word_embeddings=True, rms_norm_eps=1e-6)
SHAPES = {"qwen2.5-0.5b": QWEN25_05B,  # --shapes tiny: a CPU rehearsal of the script (true on-policy's CPU path is slow)
          "tiny": dict(QWEN25_05B, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=1024)}


def sync(device):
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def make_model_folder(device, dtype, shapes) -> str:
    torch.manual_seed(0)
    folder = scratch_dir("bench_qwen05b_")
    with torch.device(device):
        model = Qwen2ForCausalLM(Qwen2Config(**shapes)).to(dtype)
    model.save_pretrained(folder)
    del model
    return folder


def prompts(n, length, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab - 10, (n, length), generator=g).tolist()


def bench_hf(hf, ps, new_tokens, device):
    ids = torch.tensor(ps, device=device)
    kw = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, eos_token_id=None, pad_token_id=0)
    warm = ids[:, :16]
    hf.generate(warm, attention_mask=torch.ones_like(warm), max_new_tokens=4, min_new_tokens=4, **kw)
    sync(device)
    t = time.perf_counter()
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                      min_new_tokens=new_tokens, **kw)
    sync(device)
    dt = time.perf_counter() - t
    return (out.shape[1] - ids.shape[1]) * len(ps) / dt


def run_engine(eng, ps, new_tokens, tag):
    sp = SamplingParams(max_new_tokens=new_tokens, temperature=1.0, ignore_eos=True)
    for i, p in enumerate(ps):
        eng.add_request(f"{tag}{i}", p, sp)
    done, steps, decode_steps, decode_time = [], 0, 0, 0.0
    sync(str(eng.device))
    t0 = time.perf_counter()
    while eng.has_unfinished():
        t = time.perf_counter()
        kind_before = "decode" if all(s.num_uncomputed == 1 for s in eng.scheduler.running) and not eng.scheduler.waiting else "mixed"
        done += eng.step()
        steps += 1
        if kind_before == "decode":
            decode_steps += 1
            decode_time += time.perf_counter() - t
    dt = time.perf_counter() - t0
    out_tokens = sum(r.completion_tokens for r in done)
    return done, out_tokens / dt, dt, (decode_time / max(decode_steps, 1)) * 1000


def logprob_gap(hf, done, ps_by_rid, device, n=4):
    errs = []
    for r in done[:n]:
        p = ps_by_rid[r.rid]
        with torch.no_grad():
            logits = hf(torch.tensor([p + r.output_ids], device=device)).logits[0].float()
        lp = torch.log_softmax(logits, -1)
        idx = torch.arange(len(p) - 1, len(p) - 1 + len(r.output_ids), device=device)
        ref = lp[idx, torch.tensor(r.output_ids, device=device)].cpu()
        errs.append((torch.tensor(r.output_logprobs) - ref).abs())
    e = torch.cat(errs)
    return e.max().item(), e.mean().item()


def trainer_parity(exact_model, done, ps_by_rid, device, n=4):
    """max |engine log-prob - true on-policy trainer log-prob| over n requests (must be 0.0)."""
    worst = 0.0
    for r in done[:n]:
        p = ps_by_rid[r.rid]
        with torch.no_grad():
            hidden = exact_model.forward_sequences(torch.tensor([p + r.output_ids], device=device))[0, :-1]
            logp = batch_invariant.log_softmax(exact_model.logits(hidden[len(p) - 1:]))
        mine = logp.gather(-1, torch.tensor(r.output_ids, device=device)[:, None]).squeeze(-1).cpu()
        worst = max(worst, (mine - torch.tensor(r.output_logprobs)).abs().max().item())
    return worst


def profile_decode(eng, n, plen, device):
    from torch.profiler import ProfilerActivity, profile
    for i, p in enumerate(prompts(n, plen, eng.vocab_size, seed=7)):
        eng.add_request(f"prof{i}", p, SamplingParams(max_new_tokens=16, ignore_eos=True))
    while any(s.num_uncomputed > 1 for s in eng.scheduler.running) or eng.scheduler.waiting:
        eng.step()
    eng.step()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    with profile(activities=acts) as prof:
        for _ in range(5):
            eng.step()
        sync(device)
    sort = "cuda_time_total" if device.startswith("cuda") else "cpu_time_total"
    text = prof.key_averages().table(sort_by=sort, row_limit=25)
    print(text)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "profile.txt"), "w") as f:
            f.write(text)
    while eng.has_unfinished():
        eng.step()


def machine(device):
    if device.startswith("cuda"):
        return f"{torch.cuda.get_device_name()} (torch {torch.__version__})"
    return f"{platform.processor() or platform.machine()} x{os.cpu_count()} cores (torch {torch.__version__})"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--concurrency", default=None, help="comma list; default 64,256 on GPU, 8 on CPU")
    ap.add_argument("--prompt-len", type=int, default=None)
    ap.add_argument("--new-tokens", type=int, default=None)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--no-cuda-graph", action="store_true")
    ap.add_argument("--attention", default="auto", choices=["auto", "torch", "triton"])
    ap.add_argument("--profile", action="store_true", help="profile a few decode steps; table to stdout and $OUT")
    ap.add_argument("--shapes", default="qwen2.5-0.5b", choices=sorted(SHAPES))
    ap.add_argument("--true-on-policy", action="store_true",
                    help="also run the requests in true on-policy mode (batch-invariant kernels) and report the slowdown")
    ap.add_argument("--enable-torch-compile", action="store_true",
                    help="also run the requests with engine.enable_torch_compile and report the decode step against normal mode")
    ap.add_argument("--overlap-schedule", action="store_true",
                    help="also run the requests with engine.overlap_schedule (with compile too, if asked for: mode "
                         "overlap_compile) and report the decode step against normal mode")
    add_dry_run(ap)
    args = ap.parse_args()
    gpu = args.device.startswith("cuda")
    conc = [int(c) for c in (args.concurrency or ("64,256" if gpu else "8")).split(",")]
    plen = args.prompt_len or (256 if gpu else 64)
    new = args.new_tokens or (256 if gpu else 32)
    dtype = torch.bfloat16 if gpu else torch.float32

    shapes = SHAPES[args.shapes]
    folder = make_model_folder(args.device, dtype, shapes)
    hf = None
    if not args.skip_hf or args.true_on_policy:
        hf = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(args.device).eval()

    rows = []
    overlap = ("overlap_compile" if args.enable_torch_compile else "overlap") if args.overlap_schedule else None
    modes = ["normal"] + ["torch_compile"] * args.enable_torch_compile + [overlap] * args.overlap_schedule + \
        ["true_on_policy"] * args.true_on_policy
    for mode in modes:
        top = mode == "true_on_policy"
        eng = Engine(EngineConfig(model=folder, device=args.device, dtype="bfloat16" if gpu else "float32",
                                  max_running_requests=max(conc), cuda_graph=not args.no_cuda_graph,
                                  max_model_len=plen + new + 16, attention_backend=args.attention,
                                  true_on_policy=top, enable_torch_compile=mode in ("torch_compile", "overlap_compile"),
                                  overlap_schedule=mode in ("overlap", "overlap_compile")))
        exact_model = CausalLM.sharing_parameters(hf).use_batch_invariant_ops() if top else None
        for c in conc:
            ps = prompts(c, plen, shapes["vocab_size"], seed=c)
            run_engine(eng, prompts(c, plen, shapes["vocab_size"], seed=c + 1000), new, "warm")  # graphs, allocator
            eng.flush_cache()
            done, tps, secs, decode_ms = run_engine(eng, ps, new, f"c{c}-")
            row = dict(mode=mode, concurrency=c, prompt_len=plen, new_tokens=new, engine_tok_s=round(tps, 1),
                       engine_seconds=round(secs, 3), decode_step_ms=round(decode_ms, 3))
            by_rid = {f"c{c}-{i}": p for i, p in enumerate(ps)}
            base = next(r for r in rows if r["mode"] == "normal" and r["concurrency"] == c) if mode != "normal" else None
            if base:
                row.update(slower_pct=round(100 * (base["engine_tok_s"] / tps - 1), 1))
            if top:
                row.update(trainer_parity_max=trainer_parity(exact_model, done, by_rid, args.device))
            elif not args.skip_hf:
                hf_tps = bench_hf(hf, ps, new, args.device) if mode == "normal" else base["hf_tok_s"]
                row.update(hf_tok_s=round(hf_tps, 1), ratio=round(tps / hf_tps, 2))
                gap_max, gap_mean = logprob_gap(hf, done, by_rid, args.device)
                row.update(logprob_gap_max=round(gap_max, 5), logprob_gap_mean=round(gap_mean, 5))
            rows.append(row)
            print(json.dumps(row), flush=True)
        if mode != modes[-1]:
            del eng
            if gpu:
                torch.cuda.empty_cache()

    if args.profile:
        profile_decode(eng, max(conc), plen, args.device)
    record = dict(bench="engine_throughput", date=utc_now(),
                  commit=git_commit(), machine=machine(args.device), device=args.device, dtype=str(dtype).removeprefix("torch."), shapes=args.shapes,
                  cuda_graph=eng.graphs is not None, attention=eng.attention_backend, num_kv_blocks=eng.num_kv_blocks, rows=rows)
    head = ("| mode | requests | prompt | new | engine tok/s | HF generate tok/s | ratio | decode step ms | "
            "logprob gap vs HF max / mean | slower than normal | parity vs true on-policy trainer |")
    lines = [head, "|" + "---|" * 11]
    for r in rows:
        gap = f"{r['logprob_gap_max']} / {r['logprob_gap_mean']}" if "logprob_gap_max" in r else "-"
        slower = f"{r['slower_pct']}%" if "slower_pct" in r else "-"
        lines.append(f"| {r['mode']} | {r['concurrency']} | {r['prompt_len']} | {r['new_tokens']} | {r['engine_tok_s']:,.0f} | "
                     f"{r.get('hf_tok_s', '-')} | {r.get('ratio', '-')} | {r['decode_step_ms']} | {gap} | {slower} | "
                     f"{r.get('trainer_parity_max', '-')} |")
    table = (f"{record['date']}, commit {record['commit']}, {record['machine']}, {record['dtype']}, "
             f"CUDA graphs {record['cuda_graph']}, decode attention {record['attention']}\n\n" + "\n".join(lines))
    print(table)
    save(record, "engine_throughput.md", extra_text=table, dry_run=args.dry_run)


if __name__ == "__main__":
    main()
