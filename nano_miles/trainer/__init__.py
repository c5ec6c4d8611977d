"""The trainer: the GRPO loss, FP32 log-probs, the optimizer step, checkpoints, weight sync, ranks."""
