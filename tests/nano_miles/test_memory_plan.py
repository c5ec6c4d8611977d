"""The start-up memory check, and the defaults that keep the main job inside a 24 GB, 2-core machine.

The refusal runs the real `nano-miles train` command with a small configured budget: one line with
the numbers, exit 1, before any engine or model is loaded. The estimate of the default job is checked
on Qwen2.5-0.5B's own config.json (written here: only its shapes are read).
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nano_miles.trainer.checkpoint import disk_line
from nano_miles.config import load_config, parse_set
from nano_miles.engine.layout import plan_layout
from nano_miles.memory_plan import GB, MemoryCheckError, estimate, machine_memory, plan_memory, uses_shared_weights
from nano_miles.models.prepare import resolve_model
from nano_miles.train import TrainConfig
from nano_miles.trainer.trainer import Trainer, TrainerConfig

REPO = Path(__file__).resolve().parents[2]
QWEN_05B = {"architectures": ["Qwen2ForCausalLM"], "vocab_size": 151936, "hidden_size": 896,
            "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
            "num_key_value_heads": 2, "max_position_embeddings": 32768, "rope_theta": 1000000.0,
            "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "hidden_act": "silu", "eos_token_id": 151645}


@pytest.fixture
def qwen_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN_05B))
    return str(tmp_path)


def cpu_config(*sets):
    return load_config(TrainConfig, overrides=parse_set(["trainer_device=cpu", "engine.device=cpu", *sets]))


def test_a_run_that_cannot_fit_is_refused_in_one_line_before_anything_loads(tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "nano_miles.cli", "train", "--set", "model=tiny-random-qwen2",
                           "--set", "memory_limit_gb=0.5", "--set", f"run_dir={run_dir}"], cwd=REPO,
                          capture_output=True, text=True, timeout=120, env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    line = lines[0]
    assert line.startswith("nano-miles train: this run needs about ") and "0.5 GB is available (memory_limit_gb)" in line
    assert "memory_check=false" in line and "trainer runtime" in line  # what it is made of, and the way out
    assert not run_dir.exists()  # refused before the run directory, the engine or the trainer


def test_memory_check_false_starts_anyway_and_says_the_numbers(tmp_path):
    cfg = cpu_config("memory_limit_gb=0.001", "memory_check=false", "model=tiny-random-qwen2")
    layout = plan_layout(cfg.dtype, cfg.engine, cfg.trainer_device)
    said = []
    plan = plan_memory(cfg, layout, str(resolve_model(cfg.model)), shared=True, echo=said.append)
    assert plan.peak > plan.available and said[0].startswith("memory: this run needs about")
    with pytest.raises(MemoryCheckError, match="0.0 GB is available"):
        plan_memory(cpu_config("memory_limit_gb=0.001", "model=tiny-random-qwen2"), layout,
                    str(resolve_model(cfg.model)), shared=True, echo=said.append)


def test_the_default_job_is_planned_under_12_gb_with_one_copy_of_the_weights(qwen_config):
    cfg = cpu_config()
    layout = plan_layout(cfg.dtype, cfg.engine, cfg.trainer_device)
    assert uses_shared_weights(cfg, layout)
    shared = estimate(cfg, layout, qwen_config, shared=True)
    assert shared.num_params == 494_032_768  # Qwen2.5-0.5B's published parameter count
    assert shared.resident["engine weights"] == 0 and shared.resident["trainer weights"] == 4 * shared.num_params
    assert shared.peak <= 12 * GB, shared.breakdown()
    # The engine's KV cache is sized for the job (every episode in flight at 4096 tokens), under the
    # engine's 2 GiB default: 2 (K, V) x 24 layers x 2 KV heads x 64 x 4 bytes a token.
    episodes = cfg.tasks_per_step * cfg.rollout.group_size
    assert shared.rollout["engine KV cache"] == episodes * 4096 * 2 * 24 * 2 * 64 * 4 < 2 << 30
    # mode=async needs a second copy of the weights and keeps the KV cache through the update.
    async_cfg = cpu_config("mode=async")
    assert not uses_shared_weights(async_cfg, layout)
    copied = estimate(async_cfg, layout, qwen_config, shared=False)
    assert copied.peak >= shared.peak + 4 * shared.num_params
    # Without gradient checkpointing a 4096-token episode's activations alone are ~12 GB.
    no_ckpt = estimate(cpu_config("trainer.gradient_checkpointing=false"), layout, qwen_config, shared=True)
    assert no_ckpt.update["activations"] > 10 * GB


def test_the_machine_figure_is_what_is_left(tmp_path):
    available, source = machine_memory()
    with open("/proc/meminfo") as f:
        total = int(next(line for line in f if line.startswith("MemTotal")).split()[1]) * 1024
    assert 0 < available <= total and source


def test_defaults_keep_the_cpu_job_small():
    cfg = TrainConfig()
    assert (cfg.checkpoint_every, cfg.checkpoint_minutes, cfg.keep_optimizer_state) == (0, 10.0, False)
    assert cfg.memory_check and cfg.memory_limit_gb == 0
    trainer = Trainer(TrainerConfig(model=str(resolve_model("tiny-random-qwen2"))))
    assert trainer.cfg.gradient_checkpointing is True and trainer.cfg.logprob_chunk == 128
    assert trainer.optimizer.defaults["fused"]  # no full-size temporaries in the AdamW step
    line = disk_line(494_032_768, Path("/"), keep_optimizer=False)
    assert "a checkpoint is 5.9 GB (11.9 GB while one replaces the last)" in line and "keeps 2.0 GB at the end" in line
    assert torch.device(trainer.device).type == "cpu"
