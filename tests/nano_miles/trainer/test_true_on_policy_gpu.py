"""True on-policy mode on a CUDA device (the triton backend): the kernels against references and row by
row, the packaged Qwen in bf16 with engine log-probs equal to the trainer's at any batch (CUDA graphs
on and off), and a 20-step training run whose parity_max is 0.0 at every step.

    PYTHONPATH=. python -m pytest -m gpu tests/nano_miles/trainer/test_true_on_policy_gpu.py -x -q
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from nano_miles.engine import batch_invariant as bi
from nano_miles.rollout.batch import build_rollout_batch
from nano_miles.engine.engine import Engine, EngineConfig
from nano_miles.models.prepare import resolve_model
from nano_miles.trainer.trainer import Trainer, TrainerConfig
from tests.nano_miles.trainer.test_true_on_policy import assert_exact, params, prompt, rollouts, serve, single_turn

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
REPO = Path(__file__).resolve().parents[3]


def randn(*shape, dtype=torch.float32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype).cuda()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_kernels_are_row_invariant_and_right(dtype):
    x, w, b = randn(300, 896, dtype=dtype), randn(4864, 896, dtype=dtype, seed=1) * 0.03, randn(4864, dtype=dtype, seed=2)
    tol = 1e-3 if dtype == torch.float32 else 3e-2
    whole = bi.linear(x, w, b)
    assert torch.allclose(whole.double(), F.linear(x.double(), w.double(), b.double()), rtol=tol, atol=tol)
    norm_w = randn(896, dtype=dtype, seed=3)
    norms = bi.rms_norm(x, norm_w, 1e-6)
    assert torch.allclose(norms.double(), bi.FastOps.rms_norm(x.double(), norm_w.double(), 1e-6), rtol=tol, atol=tol)
    logits = bi.linear(x, w, out_dtype=torch.float32)
    logp = bi.log_softmax(logits)
    assert torch.allclose(logp, torch.log_softmax(logits, -1), atol=1e-4)
    up = randn(300, 896, dtype=dtype, seed=7)
    silu = bi.silu_mul(x, up)
    assert torch.allclose(silu.double(), F.silu(x.double()) * up.double(), rtol=tol, atol=tol)
    for start, count in ((0, 1), (7, 3), (64, 8), (1, 64), (200, 100)):
        rows = slice(start, start + count)
        assert torch.equal(bi.silu_mul(x[rows], up[rows]), silu[rows])
        assert torch.equal(bi.linear(x[rows], w, b), whole[rows])
        assert torch.equal(bi.rms_norm(x[rows], norm_w, 1e-6), norms[rows])
        assert torch.equal(bi.log_softmax(logits[rows]), logp[rows])

    L, H, KV, D = 700, 14, 2, 64
    q, k, v = randn(1, L, H, D, dtype=dtype, seed=4), randn(1, L, KV, D, dtype=dtype, seed=5), randn(1, L, KV, D, dtype=dtype, seed=6)
    full = bi.causal_attention(q, k, v)[0]
    ref = bi.FastOps.causal_attention(q.double(), k.double(), v.double())[0]
    assert torch.allclose(full.double(), ref, atol=1e-4 if dtype == torch.float32 else 3e-2)
    BS, n = 16, (L + 15) // 16
    order = torch.randperm(n + 5, generator=torch.Generator().manual_seed(0))[:n].cuda()
    k_cache = torch.zeros(n + 5, BS, KV, D, dtype=dtype, device="cuda")
    v_cache = torch.zeros_like(k_cache)
    k_cache[order] = F.pad(k[0], (0, 0, 0, 0, 0, n * BS - L)).view(n, BS, KV, D)
    v_cache[order] = F.pad(v[0], (0, 0, 0, 0, 0, n * BS - L)).view(n, BS, KV, D)
    table, positions = order.unsqueeze(0), torch.arange(L, device="cuda")
    assert torch.equal(bi.paged_attention(q[0], k_cache, v_cache, table, positions, queries_per_table=L), full)
    for t in (0, 63, 64, 699):
        decode = bi.paged_attention(q[0, t:t + 1], k_cache, v_cache, table, positions[t:t + 1])
        assert torch.equal(decode, full[t:t + 1])
    chunk = bi.paged_attention(q[0, 300:], k_cache, v_cache, table, positions[300:], queries_per_table=L - 300)
    assert torch.equal(chunk, full[300:])


@pytest.mark.parametrize("cuda_graph", [True, False])
def test_packaged_qwen_bf16_engine_and_trainer_agree_bit_for_bit(cuda_graph):
    path = str(resolve_model("qwen2.5-coder-0.5b-instruct"))
    engine = Engine(EngineConfig(model=path, device="cuda", dtype="bfloat16", true_on_policy=True, cuda_graph=cuda_graph,
                                 block_size=16, num_kv_blocks=4096, max_num_batched_tokens=64, max_running_requests=64))
    trainer = Trainer(TrainerConfig(model=path, device="cuda", dtype="bfloat16", true_on_policy=True, micro_batch_size=8))
    trajs = rollouts(engine)
    wide = serve(engine, [(prompt(100 + j), params(100 + j)) for j in range(64)])  # 64 at once
    trajs += [single_turn(prompt(100 + j), out, "wide") for j, out in enumerate(wide)]
    batch = assert_exact(trainer, trajs)
    adv = torch.tensor([1.0 if i % 2 else -1.0 for i in range(len(batch))])
    m = trainer.train_step(batch, adv, old_logprobs=batch.rollout_logprobs)
    assert m["ratio_max"] == 1.0 and m["clip_frac"] == 0.0 and m["logprob_diff_max"] == 0.0
    engine.load_weights(trainer.named_weights(engine.dtype))
    outs = serve(engine, [(prompt(200 + j), params(200 + j)) for j in range(8)])
    assert_exact(trainer, [single_turn(prompt(200 + j), out, "after") for j, out in enumerate(outs)])


def test_twenty_step_training_run_has_zero_parity_at_every_step(tmp_path):
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "nano_miles.cli", "train", "--set", "true_on_policy=true", "--set", "steps=20",
           "--set", f"run_dir={run_dir}", "--set", "tasks=seed", "--set", "checkpoint_every=20"]
    proc = subprocess.run(cmd, cwd=REPO, env=dict(os.environ, PYTHONUNBUFFERED="1"), capture_output=True, text=True,
                          timeout=3000)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 21))
    assert all(r["parity_max"] == 0.0 and r["parity_error"] is False for r in rows), [r["parity_max"] for r in rows]
    assert "ERROR" not in proc.stdout
