"""`nano-miles serve` on the one config system: every flag (SGLang's names and ours) is an alias of
one config key with one default; `--config FILE` and `--set key=value` reach the real server; a
server that cannot start says why in one line and exits non-zero."""
import argparse
import socket
import subprocess
import sys

import requests
import torch

from nano_miles.config import config_from_args
from nano_miles.engine.engine import EngineConfig
from nano_miles.engine.server import FLAGS, SWITCHES, ServerConfig, add_arguments


def parse(*argv) -> ServerConfig:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return config_from_args(ServerConfig, parser.parse_args(list(argv)))


def serve(*argv, timeout=120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "nano_miles.cli", "serve", *argv], capture_output=True, text=True,
                          timeout=timeout)


def test_defaults_come_from_the_dataclasses_only():
    assert parse("--model", "m") == ServerConfig(engine=EngineConfig(model="m"))


def test_sglang_flags_are_aliases_of_config_keys():
    cfg = parse("--model-path", "m", "--mem-fraction-static", "0.3", "--context-length", "128", "--random-seed", "7",
                "--disable-cuda-graph", "--max-running-requests", "8", "--port", "0", "--host", "127.0.0.2")
    assert (cfg.engine.model, cfg.engine.kv_cache_memory_fraction, cfg.engine.max_model_len, cfg.engine.seed) == \
        ("m", 0.3, 128, 7)
    assert (cfg.engine.cuda_graph, cfg.engine.max_running_requests, cfg.port, cfg.host) == (False, 8, 0, "127.0.0.2")
    assert parse("--model", "m", "--mem-fraction-static", "0.3",
                 "--set", "engine.kv_cache_memory_fraction=0.5").engine.kv_cache_memory_fraction == 0.5  # --set wins
    assert parse("--model", "m", "--enable-torch-compile", "--enable-overlap-schedule").engine.overlap_schedule
    assert not parse("--model", "m", "--disable-overlap-schedule").engine.overlap_schedule
    keys = set(FLAGS.values()) | {key for key, _ in SWITCHES.values()}
    assert {"engine.model", "engine.device", "engine.dtype", "host", "port", "engine.kv_cache_memory_fraction",
            "engine.max_running_requests"} <= keys


def test_config_file_and_set_reach_the_real_server(tiny_model_path, tmp_path):
    from nano_miles.engine.process import start_engine_process

    (tmp_path / "serve.toml").write_text("threads = 1\nmax_body_mb = 1\n[engine]\nmax_running_requests = 8\n"
                                         "num_kv_blocks = 64\n")
    with start_engine_process(str(tiny_model_path), dtype="float32",
                              extra_args=("--config", tmp_path / "serve.toml",
                                          "--set", "engine.kv_cache_memory_fraction=0.5")) as engine:
        info = engine.client().server_info()
        too_big = requests.post(engine.url + "/generate", data=b" " * (2 << 20), timeout=60,
                                headers={"Authorization": f"Bearer {engine.api_key}"})
    assert (info["kv_cache_memory_fraction"], info["max_running_requests"], info["threads"]) == (0.5, 8, 1)
    assert info["internal_states"][0]["num_kv_blocks"] == 64
    assert "api_key" not in info  # never echoed
    assert too_big.status_code == 413 and "at most 1 MiB (config key max_body_mb)" in too_big.json()["error"]["message"]


def test_a_port_in_use_is_one_clear_line(tiny_model_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = serve("--model", str(tiny_model_path), "--port", str(port))
    assert out.returncode != 0
    assert out.stderr.strip().splitlines() == [f"nano-miles serve: cannot listen on 127.0.0.1:{port}: "
                                               "the address is already in use"], out.stderr


def test_a_cuda_device_this_torch_cannot_see_is_one_clear_line(tiny_model_path):
    device = "cuda" if not torch.cuda.is_available() else f"cuda:{torch.cuda.device_count()}"
    out = serve("--model", str(tiny_model_path), "--device", device)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    [line] = out.stderr.strip().splitlines()
    assert line.startswith(f"nano-miles serve: engine.device={device}: "), line
