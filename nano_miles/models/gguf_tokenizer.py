"""Build a Hugging Face tokenizer from a GGUF file's metadata, the same way on every transformers version.

transformers can do this itself (`AutoTokenizer.from_pretrained(dir, gguf_file=...)`), but its result
depends on the version: 5.17 drops most of Qwen2.5's added tokens (so `<tool_call>` is split into
pieces) and takes `<|endoftext|>` as EOS, where the GGUF says `<|im_end|>`. Our GPU machine and CI run
different versions and must produce the same token ids, so we read the metadata directly.
"""
from __future__ import annotations

import pathlib

from nano_miles.models.tiny import PRETOKENIZE_REGEX as QWEN2_REGEX

# GGUF token types (gguf.TokenType): 1 normal, 3 control (special), 4 user-defined (added, not special).
CONTROL, USER_DEFINED = 3, 4


def _pipeline(pre: str):
    """(normalizer, pre_tokenizer) matching llama.cpp's `tokenizer.ggml.pre` name."""
    from tokenizers import Regex, normalizers, pre_tokenizers

    if pre == "qwen2":
        return normalizers.NFC(), pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(QWEN2_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    if pre == "smollm":  # digits one by one, then GPT-2's split
        return None, pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
    raise ValueError(f"unsupported GGUF pre-tokenizer {pre!r} (known: qwen2, smollm)")


def tokenizer_from_gguf(path: str | pathlib.Path):
    """A transformers fast tokenizer with the GGUF's vocab, merges, added tokens, special tokens and chat template."""
    from gguf import GGUFReader
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors
    from transformers import PreTrainedTokenizerFast

    reader = GGUFReader(str(path))

    def meta(key, default=None):
        return reader.fields[key].contents() if key in reader.fields else default

    if meta("tokenizer.ggml.model") != "gpt2":
        raise ValueError(f"unsupported GGUF tokenizer model {meta('tokenizer.ggml.model')!r} (only byte-level BPE)")
    tokens, types = meta("tokenizer.ggml.tokens"), meta("tokenizer.ggml.token_type")
    vocab = {t: i for i, t in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ValueError("GGUF vocabulary has duplicate tokens")
    merges = [tuple(m.split(" ", 1)) for m in meta("tokenizer.ggml.merges")]

    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=False, fuse_unk=False))
    normalizer, tok.pre_tokenizer = _pipeline(meta("tokenizer.ggml.pre"))
    if normalizer is not None:
        tok.normalizer = normalizer
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    # Control and user-defined tokens match whole before BPE; they keep their vocab ids (added in id order).
    tok.add_tokens([AddedToken(tokens[i], special=types[i] == CONTROL, normalized=False)
                    for i in range(len(tokens)) if types[i] in (CONTROL, USER_DEFINED)])

    def token(key):
        i = meta(f"tokenizer.ggml.{key}_token_id")
        return tokens[i] if i is not None else None

    arch = meta("general.architecture")
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=token("bos"), eos_token=token("eos"), pad_token=token("padding"),
        unk_token=token("unknown"), chat_template=meta("tokenizer.chat_template"),
        model_max_length=meta(f"{arch}.context_length", 32768), clean_up_tokenization_spaces=False,
    )
