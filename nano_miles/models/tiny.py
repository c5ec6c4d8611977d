"""tiny-random-qwen2: a real Qwen2ForCausalLM with small dimensions, seeded random weights and its own
small byte-level BPE tokenizer, built offline in about a second. It exists for fast tests: the same
architecture, tokenizer features (special tokens, ChatML chat template) and file layout as
Qwen2.5-0.5B-Instruct, at a size that runs anywhere.

Everything is deterministic: the tokenizer is trained on the built-in corpus below and the weights are
drawn from one seeded generator in a fixed order, so two preparations give identical bytes.
"""
from __future__ import annotations

import pathlib

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [ENDOFTEXT, IM_START, IM_END]  # ids 0, 1, 2
VOCAB_SIZE = 1024  # 3 special tokens + 256 byte symbols + 765 merges
SEED = 20240611

# Plain ChatML, as Qwen2.5 renders it, without Qwen's default system prompt.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Qwen2's pre-tokenisation: split on this regex, then map bytes to printable symbols (GPT-2 style).
PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# Training text for the BPE merges: shell sessions and plain English, the two things the project's
# prompts are made of. Changing it changes the tokenizer (and so every id): leave it alone.
CORPUS = r"""
You are a helpful assistant that solves tasks in a Linux shell. Run one command at a time.
The user asks you to find all files larger than one megabyte in the current directory.
$ find . -type f -size +1M -print
$ ls -la /tmp && cat /etc/os-release | head -n 3
$ grep -rn "TODO" src/ --include="*.py" | wc -l
$ echo "hello world" > hello.txt; cat hello.txt
$ mkdir -p out/logs && touch out/logs/run.log
$ sed -i 's/foo/bar/g' config.ini && diff config.ini config.ini.bak
$ awk -F, '{ sum += $3 } END { print sum }' data.csv
$ sort -u names.txt | uniq -c | sort -rn | head -n 10
$ tar -czf backup.tar.gz docs/ && tar -tzf backup.tar.gz
$ chmod +x run.sh && ./run.sh --verbose
$ python3 -c "import sys; print(sys.version)"
$ cut -d: -f1 /etc/passwd | sort
$ du -sh * | sort -h; df -h /
$ export PATH="$HOME/bin:$PATH"; which python3
$ for f in *.txt; do wc -l "$f"; done
$ if [ -f answer.txt ]; then cat answer.txt; else echo missing; fi
$ head -c 100 /dev/urandom | base64 | tr -d '\n'
$ xargs -n 1 echo < list.txt
$ cp -r src dst && mv dst/old.txt dst/new.txt && rm -f dst/tmp.txt
$ printf '%s\n' alpha beta gamma delta > words.txt
$ git status && git log --oneline -n 5
$ ps aux | grep python | grep -v grep
$ curl -s http://127.0.0.1:8080/health
$ jq '.items[] | .name' data.json
$ ln -s /usr/bin/python3 python; readlink -f python
$ date +%Y-%m-%d; sleep 1; whoami; hostname; uname -a
$ find /var/log -name "*.log" -mtime -7 -exec ls -l {} \;
$ seq 1 100 | paste -sd+ | bc
$ tail -n 20 server.log | grep -i error
The command finished with exit code 0. The output was written to standard output.
The command failed with exit code 1: No such file or directory. Permission denied.
Please write the answer to the file answer.txt and then say that you are done.
I will count the lines in the file, then sort the words and remove the duplicates.
First, let us look at the directory listing to see which files are there.
The quick brown fox jumps over the lazy dog. This is a small test of the system.
Reward is given when the verifier checks that the final state of the workspace is correct.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 256 1024 2048 4096 65535 3.14 -1 +7 1e-5
Punctuation and symbols: ( ) [ ] { } < > = == != <= >= && || ; : , . ' " ` ~ ! @ # % ^ * _ - + / \ |
$ systemctl status nginx; journalctl -u nginx --since yesterday | less
$ wget -q -O - https://example.com/index.html | grep -o 'href="[^"]*"'
$ ssh user@server 'uptime'; scp report.pdf user@server:/home/user/documents/
$ docker run --rm -it ubuntu:22.04 bash; kill -9 12345; nohup ./worker &
$ apt-get update && apt-get install -y build-essential zip unzip
$ find . -empty -delete; stat -c '%s %n' *.md; file image.png; md5sum archive.zip
$ comm -12 <(sort a.txt) <(sort b.txt) > common.txt; join -t, left.csv right.csv
$ rev reversed.txt; fold -w 80 long.txt; nl -ba numbered.txt; tee copy.txt < input.txt
Assistant: I listed the directory and found three configuration files, two scripts and a README.
Assistant: The largest file is video.mp4, with a size of about twelve megabytes.
Assistant: Done. The report was saved in results/summary.json and every test passed.
Observation: total 8, drwxr-xr-x 2 root root 4096 Jan 1 00:00 workspace, -rw-r--r-- notes.
When a question is unclear, explain what you would check next and why it matters for the result.
Good engineers read the error message carefully, change one thing, and measure again.
Weights, gradients, tokens, prompts, responses, rewards, advantages and policies are updated.
Monday, Tuesday, Wednesday, Thursday, Friday, Saturday and Sunday; January through December.
Keep going until the job is finished; never give up because something went wrong once.
def main():
    for line in open("input.txt"):
        print(line.strip().upper())
if __name__ == "__main__":
    main()
"""


def build_tokenizer():
    """The tiny tokenizer as a transformers fast tokenizer (deterministic)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, special_tokens=SPECIAL_TOKENS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte encodable: no unknown tokens
    )
    # Repeat the corpus so common pieces clearly outrank rare ones; the merge order stays deterministic.
    tok.train_from_iterator([CORPUS] * 4, trainer=trainer)
    if tok.get_vocab_size() != VOCAB_SIZE:
        raise RuntimeError(f"tiny tokenizer has {tok.get_vocab_size()} tokens, expected {VOCAB_SIZE}")
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=IM_END, pad_token=ENDOFTEXT, unk_token=None,
        chat_template=CHAT_TEMPLATE, model_max_length=4096, clean_up_tokenization_spaces=False,
    )


def build_model(tokenizer):
    """A Qwen2ForCausalLM with small dims and weights drawn from one seeded generator."""
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    pad_id, eos_id = tokenizer.convert_tokens_to_ids([ENDOFTEXT, IM_END])
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
        rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,  # tied like Qwen2.5-0.5B
        bos_token_id=pad_id, eos_token_id=eos_id, pad_token_id=pad_id, dtype="float32",
    )
    model = Qwen2ForCausalLM(config).eval()
    # Draw every weight ourselves, in sorted-name order, instead of relying on transformers' init
    # (whose order and scales may change between versions). Scales: variance-preserving linears,
    # embeddings large enough (std 0.3 -> logit std ~2.4) that next-token distributions are peaked
    # rather than flat, so greedy decoding is not decided by float noise between implementations.
    gen = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[1] ** 0.5)
    model.generation_config = GenerationConfig(
        bos_token_id=pad_id, eos_token_id=[eos_id, pad_id], pad_token_id=pad_id, do_sample=False,
    )
    return model


def write_tiny_model(out_dir: pathlib.Path) -> None:
    """Write the full HF folder (config, safetensors, tokenizer, chat template, generation config)."""
    tokenizer = build_tokenizer()
    model = build_model(tokenizer)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
