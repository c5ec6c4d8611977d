"""nano_miles: the RL loop. Shell tasks, multi-turn token-in-token-out rollouts, GRPO, an
SGLang-compatible inference engine, FP32-correct training and weight hot-sync."""

__version__ = "0.1.0"
