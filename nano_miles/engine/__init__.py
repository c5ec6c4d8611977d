"""The inference engine: paged KV cache, continuous batching, SGLang's HTTP protocol."""
