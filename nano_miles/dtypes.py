"""Dtypes by name (as the trainer, the engine and weight payloads name them), and the one rule for
"auto": bfloat16 on a GPU (the tensor cores' format, FP32's range), float32 on the CPU (no fast bf16
matmuls there, and exact parity between trainer and engine).
"""
from __future__ import annotations

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_NAMES = ("auto", *DTYPES)  # what a config key or a --dtype flag accepts
# The trainer keeps FP32 masters and has no loss scaling, which float16's narrow range would need.
TRAINABLE = ("float32", "bfloat16")


def resolve_dtype_name(name: str, device: torch.device | str) -> str:
    if name == "auto":
        return "bfloat16" if torch.device(device).type == "cuda" else "float32"
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {list(DTYPE_NAMES)}, got {name!r}")
    return name


def resolve_dtype(name: str, device: torch.device | str) -> torch.dtype:
    return DTYPES[resolve_dtype_name(name, device)]


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> "bfloat16" (the inverse of DTYPES)."""
    return str(dtype).removeprefix("torch.")
