import pytest


@pytest.fixture(scope="module")
def tiny(tiny_model_path):
    """tiny-random-qwen2's folder as a str, the form EngineConfig(model=...) takes."""
    return str(tiny_model_path)
