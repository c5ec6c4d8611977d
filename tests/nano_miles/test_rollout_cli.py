"""`nano-miles rollout` and `eval` take the same config keys as `train` (docs/config.md): their flags
are aliases of keys, `--config` / `--set` set any key, `--print-config` shows the result."""
import tomllib

import pytest

from nano_miles import cli
from nano_miles.evaluate import EvalConfig
from nano_miles.rollout_cli import RolloutCommandConfig
from nano_miles.train import TrainConfig


def _printed_config(capsys, argv) -> dict:
    assert cli.main([*argv, "--print-config"]) == 0
    return tomllib.loads(capsys.readouterr().out)


def test_flags_set_the_same_keys_as_set(capsys, tmp_path):
    by_flags = _printed_config(capsys, [
        "rollout", "--model", "tiny-random-qwen2", "--tasks", "kernel_name", "--group-size", "3", "--max-turns", "2",
        "--max-new-tokens", "16", "--max-total-tokens", "512", "--temperature", "0.5", "--seed", "7",
        "--max-concurrency", "4", "--request-timeout", "30", "--device", "cpu", "--dtype", "float32",
        "--engine-url", "http://a:1", "--engine-url", "http://b:2"])
    path = tmp_path / "rollout.toml"
    path.write_text('model = "tiny-random-qwen2"\ntasks = "kernel_name"\nseed = 7\ndtype = "float32"\n'
                    '[engine]\nurl = "http://a:1,http://b:2"\ndevice = "cpu"\n'
                    '[rollout]\ngroup_size = 3\nmax_new_tokens = 16\ntemperature = 0.5\nmax_concurrency = 4\n'
                    'request_timeout = 30.0\n[rollout.env]\nmax_turns = 2\nmax_total_tokens = 512\n')
    assert _printed_config(capsys, ["rollout", "--config", str(path)]) == by_flags
    by_set = _printed_config(capsys, ["rollout", *(a for kv in (
        "model=tiny-random-qwen2", "tasks=kernel_name", "rollout.group_size=3", "rollout.env.max_turns=2",
        "rollout.max_new_tokens=16", "rollout.env.max_total_tokens=512", "rollout.temperature=0.5", "seed=7",
        "rollout.max_concurrency=4", "rollout.request_timeout=30", "engine.device=cpu", "dtype=float32",
        "engine.url=http://a:1,http://b:2") for a in ("--set", kv))])
    assert by_set == by_flags


def test_one_default_per_key_across_commands(capsys):
    rollout, evaluate, train = (_printed_config(capsys, [c]) for c in ("rollout", "eval", "train"))
    assert (rollout["tasks"], evaluate["tasks"], train["tasks"]) == ("seed", "heldout", "train")
    for section in ("rollout", "engine"):
        assert rollout[section] == evaluate[section] == train[section]
    assert train["rollout"]["group_size"] == 4 and train["rollout"]["env"]["max_turns"] == 6
    # eval's --samples is the group size; set it and the TOML says so.
    assert _printed_config(capsys, ["eval", "--samples", "8"])["rollout"]["group_size"] == 8
    assert issubclass(EvalConfig, RolloutCommandConfig) and issubclass(TrainConfig, RolloutCommandConfig)


@pytest.mark.parametrize("argv, message", [
    (["rollout", "--group-size", "0"], "group_size must be >= 1, got 0"),
    (["eval", "--samples", "two"], "rollout.group_size: expected an integer, got 'two'"),
    (["rollout", "--max-turns", "0"], "max_turns must be >= 1"),
    (["eval", "--dtype", "fp8"], "dtype must be one of"),
    (["rollout", "--set", "rollout.group_sise=2"], "did you mean 'rollout.group_size'?"),
])
def test_bad_values_are_one_line_and_exit_2(capsys, argv, message):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err
