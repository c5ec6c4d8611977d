"""What the HTTP server costs: output tokens/s of the in-process Engine against the same engine behind
`nano-miles serve` (SGLang's /generate over HTTP, AsyncEngineClient, one request per prompt), same
prompts, same sampling (temperature 1, ignore_eos), at each concurrency. Prints a table, appends one
JSON line to bench/results.jsonl, and writes both to $OUT when that is set.

    PYTHONPATH=. python3 bench/server_throughput.py                        # CPU: tiny-random-qwen2
    PYTHONPATH=. python3 bench/server_throughput.py --device cuda:0        # GPU: random Qwen2.5-0.5B shapes
"""
import argparse
import asyncio
import gc
import os
import platform
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench.results import add_dry_run, git_commit, save, scratch_dir, utc_now  # noqa: E402
from nano_miles.engine.client import AsyncEngineClient  # noqa: E402
from nano_miles.engine.process import start_engine_process  # noqa: E402
from nano_miles.engine.engine import Engine, EngineConfig, SamplingParams  # noqa: E402

QWEN25_05B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                  num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768, rope_theta=1000000.0,
                  tie_word_embeddings=True, rms_norm_eps=1e-6)


def model_folder(args) -> str:
    if args.model:
        from nano_miles.models.prepare import resolve_model
        return str(resolve_model(args.model))
    if not args.device.startswith("cuda"):
        from nano_miles.models.prepare import resolve_model
        return str(resolve_model("tiny-random-qwen2"))
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(0)
    folder = scratch_dir("bench_server_qwen05b_")
    Qwen2ForCausalLM(Qwen2Config(**QWEN25_05B)).to(torch.bfloat16).save_pretrained(folder)
    return folder


def prompts(n, length, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab - 10, (n, length), generator=g).tolist()


def sampling(new_tokens):
    return {"max_new_tokens": new_tokens, "temperature": 1.0, "ignore_eos": True}


def bench_in_process(folder, args, concurrencies):
    if args.threads:
        torch.set_num_threads(args.threads)
    eng = Engine(EngineConfig(model=folder, device=args.device, dtype=args.dtype,
                              max_running_requests=max(concurrencies)))
    out = {}
    for n in [4] + concurrencies:  # the first (4) is a warm-up
        for rep in range(args.repeat):
            ps = prompts(n, args.prompt, eng.vocab_size, seed=n)
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
            t = time.perf_counter()
            for i, p in enumerate(ps):
                eng.add_request(f"r{n}-{rep}-{i}", p, SamplingParams(**sampling(args.new)), return_logprob=True)
            tokens = 0
            while eng.has_unfinished():
                tokens += sum(f.completion_tokens for f in eng.step())
            out[n] = max(out.get(n, 0.0), tokens / (time.perf_counter() - t))
            eng.flush_cache()
    vocab = eng.vocab_size
    del eng
    gc.collect()
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
    return out, vocab


def bench_server(folder, args, concurrencies, vocab):
    extra = ["--max-running-requests", str(max(concurrencies))] + (["--threads", str(args.threads)] if args.threads else [])
    out = {}
    with start_engine_process(folder, device=args.device, dtype=args.dtype, extra_args=extra,
                              ready_timeout=900) as engine:
        async def run(n):
            client = AsyncEngineClient(engine.url)
            try:
                ps = prompts(n, args.prompt, vocab, seed=n)
                t = time.perf_counter()
                outs = await asyncio.gather(*[client.generate(p, sampling(args.new)) for p in ps])
                dt = time.perf_counter() - t
                await client.flush_cache()
                return sum(o["meta_info"]["completion_tokens"] for o in outs) / dt
            finally:
                await client.close()

        for n in [4] + concurrencies:
            out[n] = max(asyncio.run(run(n)) for _ in range(args.repeat))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--model", default=None, help="default: tiny-random-qwen2 on CPU, random 0.5B shapes on GPU")
    ap.add_argument("--concurrency", type=int, nargs="+", default=None)
    ap.add_argument("--prompt", type=int, default=None)
    ap.add_argument("--new", type=int, default=None)
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads for both (default: torch's)")
    ap.add_argument("--repeat", type=int, default=3, help="runs per point; the best counts (shared machines are noisy)")
    add_dry_run(ap)
    args = ap.parse_args()
    gpu = args.device.startswith("cuda")
    concurrencies = args.concurrency or ([64, 256] if gpu else [16, 64])
    args.prompt = args.prompt or (256 if gpu else 32)
    args.new = args.new or (256 if gpu else 32)
    folder = model_folder(args)

    direct, vocab = bench_in_process(folder, args, concurrencies)
    served = bench_server(folder, args, concurrencies, vocab)

    lines = [f"server_throughput: {args.device}, {os.path.basename(folder.rstrip('/'))}, prompt {args.prompt}, "
             f"{args.new} new tokens", f"{'requests':>8} | {'in-process tok/s':>16} | {'HTTP server tok/s':>17} | ratio"]
    results = []
    for n in concurrencies:
        lines.append(f"{n:>8} | {direct[n]:>16.0f} | {served[n]:>17.0f} | {served[n] / direct[n]:.2f}")
        results.append({"requests": n, "in_process_tok_s": direct[n], "server_tok_s": served[n],
                        "ratio": served[n] / direct[n]})
    table = "\n".join(lines)
    print(table)
    machine = torch.cuda.get_device_name() if gpu else f"{platform.machine()} {os.cpu_count()} cores"
    record = {"bench": "server_throughput", "date": utc_now(), "commit": git_commit(), "machine": machine, "torch": torch.__version__,
        "load_average": round(os.getloadavg()[0], 1),
        "config": {"device": args.device, "dtype": args.dtype, "model": os.path.basename(folder.rstrip("/")),
                   "prompt": args.prompt, "new_tokens": args.new, "repeat": args.repeat,
                   "threads": args.threads}, "results": results}
    save(record, "server_throughput.txt", extra_text=table, dry_run=args.dry_run)


if __name__ == "__main__":
    main()
