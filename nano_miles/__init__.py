"""nano_miles: the RL loop. Shell tasks, multi-turn token-in-token-out rollouts, GRPO, an
SGLang-compatible inference engine, FP32-correct training and weight hot-sync."""

__version__ = "0.1.0"

# The `nano-miles` commands: name -> (module, one-line help). Each module has add_arguments(parser)
# and run(args), and CONFIG, its root config dataclass, when it takes config keys. cli.py runs them;
# config.py documents their keys. Names only: a command's module is imported when it is used.
COMMANDS = {
    "prepare-model": ("nano_miles.models.prepare", "materialise a model into the local cache and print its path"),
    "serve": ("nano_miles.engine.server", "start the SGLang-compatible inference engine server"),
    "tasks": ("nano_miles.tasks.cli", "list the shell tasks and their splits"),
    "rollout": ("nano_miles.rollout_command", "run multi-turn rollouts and write trajectories as JSONL"),
    "eval": ("nano_miles.evaluate", "pass@1 / pass@K of a model on a task split"),
    "train": ("nano_miles.train", "GRPO training: rollout, update, weight sync, telemetry"),
}
