"""Models by name: the packaged GGUF model, the tiny random test model, HF folders."""
