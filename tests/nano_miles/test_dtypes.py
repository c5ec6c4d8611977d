"""One dtype table and one rule for "auto" (bfloat16 on a GPU, float32 on the CPU)."""
import pytest
import torch

from nano_miles.dtypes import DTYPE_NAMES, DTYPES, TRAINABLE, dtype_name, resolve_dtype, resolve_dtype_name


def test_auto_is_bfloat16_on_gpu_and_float32_on_cpu():
    assert resolve_dtype("auto", "cpu") is torch.float32
    assert resolve_dtype("auto", torch.device("cuda:1")) is torch.bfloat16  # decided from the name, no GPU needed
    assert resolve_dtype_name("auto", "cuda") == "bfloat16"


def test_named_dtypes_pass_through_and_round_trip():
    for name, dtype in DTYPES.items():
        assert resolve_dtype(name, "cuda") is dtype and resolve_dtype(name, "cpu") is dtype
        assert dtype_name(dtype) == name
    assert set(TRAINABLE) < set(DTYPES) and DTYPE_NAMES[0] == "auto"


def test_an_unknown_name_is_one_clear_error():
    with pytest.raises(ValueError, match=r"dtype must be one of \['auto', 'float32', 'bfloat16', 'float16'\], got 'fp8'"):
        resolve_dtype("fp8", "cpu")
