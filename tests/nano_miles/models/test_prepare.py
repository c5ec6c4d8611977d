"""prepare-model: registered names become local HF folders; bad parts never leave a cache entry."""
from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
import zipfile

import pytest
import torch

from nano_miles.models import prepare as models
from nano_miles.models.prepare import DEFAULT_MODEL, MODEL_NAMES, TINY_MODEL, GGUFModel, ModelError, Part

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "nano_miles.cli", "prepare-model", *args], cwd=REPO,
                          capture_output=True, text=True, env={**os.environ, **(env or {})}, timeout=120)


def assert_no_entry(root, name):
    """Neither a cache entry nor a leftover temp dir exists for `name`."""
    leftovers = sorted(p.name for p in root.iterdir() if p.name == name or p.name.startswith(f".{name}.tmp-")) \
        if root.exists() else []
    assert leftovers == []


# ---- tiny-random-qwen2 -------------------------------------------------------------------------


def test_tiny_model_is_a_real_small_qwen2_that_loads_offline(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    path = models.resolve_model(TINY_MODEL, cache_dir=tmp_path)
    assert path == tmp_path / TINY_MODEL
    info = json.loads((path / "config.json").read_text())
    assert info["model_type"] == "qwen2" and info["hidden_size"] == 64 and info["num_hidden_layers"] == 2
    assert (info["num_attention_heads"], info["num_key_value_heads"]) == (4, 2)
    assert info["tie_word_embeddings"] and info["max_position_embeddings"] == 4096

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    assert type(model).__name__ == "Qwen2ForCausalLM" and model.dtype == torch.float32
    assert len(tok) == model.config.vocab_size == info["vocab_size"]
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    assert model.config.eos_token_id == tok.eos_token_id and model.config.pad_token_id == tok.pad_token_id
    assert model.generation_config.eos_token_id == [tok.eos_token_id, tok.pad_token_id]

    ids = tok("ls -la /tmp | wc -l", return_tensors="pt").input_ids
    assert tok.decode(ids[0]) == "ls -la /tmp | wc -l"
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], len(tok)) and torch.isfinite(logits).all()
    # Weights are drawn peaked enough that the next-token distribution is far from uniform.
    assert torch.softmax(logits[0, -1], -1).max() > 10 / len(tok)


def test_tiny_model_is_byte_identical_across_preparations(tmp_path):
    a = models.prepare(TINY_MODEL, cache_dir=tmp_path / "a")
    b = models.prepare(TINY_MODEL, cache_dir=tmp_path / "b")
    files = sorted(p.name for p in a.iterdir())
    assert files == sorted(p.name for p in b.iterdir())
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json", "chat_template.jinja"} <= set(files)
    for name in files:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


def test_tiny_chat_template_renders_chatml(tmp_path):
    tok = models.load_tokenizer(TINY_MODEL, cache_dir=tmp_path)
    messages = [{"role": "system", "content": "You run shell commands."},
                {"role": "user", "content": "list the files"},
                {"role": "assistant", "content": "ls"}]
    text = tok.apply_chat_template(messages, tokenize=False)
    assert text == ("<|im_start|>system\nYou run shell commands.<|im_end|>\n"
                    "<|im_start|>user\nlist the files<|im_end|>\n<|im_start|>assistant\nls<|im_end|>\n")
    prompt = tok.apply_chat_template(messages[:2], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_end|>\n<|im_start|>assistant\n")
    # The special tokens are single ids, so a rollout can splice ids without re-tokenising.
    ids = tok(prompt).input_ids
    im_start, im_end = tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    assert ids.count(im_start) == 3 and ids.count(im_end) == 2
    assert tok.decode(ids) == prompt


def test_a_cache_entry_is_reused_and_rebuilt_when_forced_or_stale(tmp_path):
    path = models.prepare(TINY_MODEL, cache_dir=tmp_path)
    marker = path / "marker"
    marker.write_text("x")
    assert models.prepare(TINY_MODEL, cache_dir=tmp_path) == path and marker.exists()
    assert models.prepare(TINY_MODEL, cache_dir=tmp_path, force=True) == path and not marker.exists()
    manifest = json.loads((path / "nano_miles.json").read_text())
    # An entry written by older code (another folder format, or another tiny-model recipe) is rebuilt.
    for stale in ({"format": 0}, {"recipe": "made-by-other-code"}):
        (path / "nano_miles.json").write_text(json.dumps({**manifest, **stale}))
        marker.write_text("x")
        models.prepare(TINY_MODEL, cache_dir=tmp_path)
        assert not marker.exists() and json.loads((path / "nano_miles.json").read_text()) == manifest
    assert sorted(p.name for p in tmp_path.iterdir()) == [f".{TINY_MODEL}.lock", TINY_MODEL]


def test_two_processes_preparing_at_once_build_the_entry_once(tmp_path):
    # Two jobs (or two test workers) started together on an empty cache: the second waits for the
    # first and reuses its entry, rather than building it again and swapping the folder under it.
    cache = tmp_path / "cache"
    script = (f"import sys\nfrom nano_miles.models import prepare as models\nsys.stdin.readline()\n"
              f"print(models.prepare({TINY_MODEL!r}, cache_dir={str(cache)!r}))\n")
    procs = [subprocess.Popen([sys.executable, "-c", script], cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    for p in procs:  # release both at once (each reads its line once imported)
        p.stdin.write("go\n")
        p.stdin.flush()
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert {out.strip() for out, _ in outs} == {str(cache / TINY_MODEL)}
    assert sum(err.count(f"preparing {TINY_MODEL}") for _, err in outs) == 1, outs
    assert sorted(p.name for p in cache.iterdir()) == [f".{TINY_MODEL}.lock", TINY_MODEL]


def test_cache_dir_comes_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("NANO_MILES_CACHE", str(tmp_path / "env-cache"))
    assert models.resolve_model(TINY_MODEL) == tmp_path / "env-cache" / TINY_MODEL


# ---- names, folders, hub ids, CLI ----------------------------------------------------------------


def test_a_local_hf_folder_passes_through(tmp_path):
    folder = models.prepare(TINY_MODEL, cache_dir=tmp_path / "cache")
    assert models.resolve_model(str(folder)) == folder
    assert models.resolve_model(folder) == folder
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelError, match="not a Hugging Face model folder"):
        models.resolve_model(tmp_path / "empty")


def test_unknown_name_is_a_clear_error_listing_the_known_names(tmp_path):
    with pytest.raises(ModelError) as e:
        models.resolve_model("no-such-model", cache_dir=tmp_path)
    assert all(n in str(e.value) for n in MODEL_NAMES)
    r = cli("no-such-model", "--cache-dir", str(tmp_path))
    assert r.returncode == 2 and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "unknown model 'no-such-model'" in lines[0] and all(n in lines[0] for n in MODEL_NAMES)
    assert list(tmp_path.iterdir()) == []


def test_an_unreachable_hub_id_is_a_clear_error(tmp_path):
    r = cli("nobody-here/no-such-model-xyz", env={"HF_HUB_OFFLINE": "1"})
    assert r.returncode == 2 and r.stdout == ""
    assert "hub model 'nobody-here/no-such-model-xyz' could not be fetched" in r.stderr


def test_cli_prints_only_the_path_on_stdout(tmp_path):
    r = cli(TINY_MODEL, "--cache-dir", str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert r.stdout == f"{tmp_path / TINY_MODEL}\n"
    assert json.loads((tmp_path / TINY_MODEL / "nano_miles.json").read_text())["name"] == TINY_MODEL


# ---- parts: checksum, missing, corrupt, interrupt ----------------------------------------------


def fake_spec(name, payloads, sha256=None):
    """A GGUF spec over small fake parts, plus the bytes its parts are made of."""
    parts = tuple(Part(f"fake-part{i}", "1.0", f"fake_part{i}/data/part{i}.bin") for i in range(len(payloads)))
    return GGUFModel(name, parts, sha256 or hashlib.sha256(b"".join(payloads)).hexdigest())


def write_wheel(folder, part, data):
    wheel = folder / f"{part.package.replace('-', '_')}-{part.version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr(part.member, data)
    return wheel


def test_wrong_checksum_is_an_error_and_leaves_no_entry(tmp_path):
    payloads = [b"a" * 1000, b"b" * 1000]
    spec = fake_spec("fake-checksum", payloads, sha256="0" * 64)
    parts = tmp_path / "parts"
    parts.mkdir()
    write_wheel(parts, spec.parts[0], payloads[0])
    (parts / "part1.bin").write_bytes(payloads[1])  # a bare part file works as well as a wheel
    with pytest.raises(ModelError, match="checksum mismatch for fake-checksum"):
        models.prepare(spec, cache_dir=tmp_path / "cache", parts_dir=parts)
    assert_no_entry(tmp_path / "cache", "fake-checksum")


def test_truncated_part_is_an_error_and_leaves_no_entry(tmp_path):
    payloads = [os.urandom(5000), os.urandom(5000)]
    spec = fake_spec("fake-truncated", payloads)
    parts = tmp_path / "parts"
    parts.mkdir()
    write_wheel(parts, spec.parts[0], payloads[0])
    (parts / "part1.bin").write_bytes(payloads[1][:-100])  # a bare file cut short: only the checksum knows
    with pytest.raises(ModelError, match="checksum mismatch"):
        models.prepare(spec, cache_dir=tmp_path / "cache", parts_dir=parts)
    wheel = write_wheel(parts, spec.parts[1], payloads[1])
    wheel.write_bytes(wheel.read_bytes()[:3000])  # a wheel cut short is not a zip any more
    with pytest.raises(ModelError, match=r"fake-part1==1.0 is corrupt"):
        models.prepare(spec, cache_dir=tmp_path / "cache", parts_dir=parts)
    assert_no_entry(tmp_path / "cache", "fake-truncated")


def test_corrupt_bytes_inside_a_wheel_are_an_error(tmp_path):
    payloads = [bytes(range(256)) * 64]
    spec = fake_spec("fake-crc", payloads)
    parts = tmp_path / "parts"
    parts.mkdir()
    wheel = write_wheel(parts, spec.parts[0], payloads[0])
    data = bytearray(wheel.read_bytes())
    data[200] ^= 0xFF  # inside the compressed member: the zip's CRC check must catch it
    wheel.write_bytes(bytes(data))
    with pytest.raises(ModelError, match="is corrupt"):
        models.prepare(spec, cache_dir=tmp_path / "cache", parts_dir=parts)
    assert_no_entry(tmp_path / "cache", "fake-crc")


def test_missing_part_is_an_error_naming_it(tmp_path):
    payloads = [b"x" * 10, b"y" * 10, b"z" * 10]
    spec = fake_spec("fake-missing", payloads)
    parts = tmp_path / "parts"
    parts.mkdir()
    write_wheel(parts, spec.parts[0], payloads[0])
    write_wheel(parts, spec.parts[2], payloads[2])
    with pytest.raises(ModelError, match=r"lacks fake-part1==1.0"):
        models.prepare(spec, cache_dir=tmp_path / "cache", parts_dir=parts)
    with pytest.raises(ModelError, match="does not exist"):
        models.prepare(spec, cache_dir=tmp_path / "cache", parts_dir=tmp_path / "nowhere")
    assert_no_entry(tmp_path / "cache", "fake-missing")


def test_a_corrupt_gguf_with_the_right_checksum_is_an_error(tmp_path):
    payloads = [b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 64, b"not really a model"]
    spec = fake_spec("fake-gguf", payloads)  # the checksum matches: the parts joined in order
    parts = tmp_path / "parts"
    parts.mkdir()
    for part, data in zip(spec.parts, payloads):
        write_wheel(parts, part, data)
    with pytest.raises(ModelError, match="the GGUF file could not be loaded"):
        models.prepare(spec, cache_dir=tmp_path / "cache", parts_dir=parts)
    assert_no_entry(tmp_path / "cache", "fake-gguf")


def test_parts_of_installed_packages_are_found(tmp_path, monkeypatch):
    payloads = [b"GGUF-but-not-really"]
    spec = fake_spec("fake-installed", payloads)
    site = tmp_path / "site"
    (site / "fake_part0-1.0.dist-info").mkdir(parents=True)
    (site / "fake_part0-1.0.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: fake-part0\nVersion: 1.0\n")
    (site / "fake_part0" / "data").mkdir(parents=True)
    (site / "fake_part0" / "data" / "part0.bin").write_bytes(payloads[0])
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.delenv("NANO_MILES_PARTS_DIR", raising=False)
    # Found locally (pip is never asked), joined, checksum right; only the load fails.
    with pytest.raises(ModelError, match="the GGUF file could not be loaded"):
        models.prepare(spec, cache_dir=tmp_path / "cache")
    assert_no_entry(tmp_path / "cache", "fake-installed")


INTERRUPTED = """
import signal, sys
from nano_miles.models import prepare as models
# Ctrl-C's default, even when the test runner was started in the background by a shell without job
# control: such a shell starts it with SIGINT ignored, and every child inherits that.
signal.signal(signal.SIGINT, signal.default_int_handler)
spec = models.GGUFModel("fake-interrupt", (models.Part("fake-part0", "1.0", "fake_part0/data/part0.bin"),), "0" * 64)
try:
    models.prepare(spec, cache_dir=sys.argv[1], parts_dir=sys.argv[2])
except KeyboardInterrupt:
    sys.exit(130)
"""


def test_an_interrupt_mid_join_leaves_no_entry(tmp_path):
    # The part is a FIFO we feed by hand, so the interrupt lands while the join is half done.
    parts, cache = tmp_path / "parts", tmp_path / "cache"
    parts.mkdir()
    os.mkfifo(parts / "part0.bin")
    proc = subprocess.Popen([sys.executable, "-c", INTERRUPTED, str(cache), str(parts)], cwd=REPO,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while True:  # wait until the preparation opens the part for reading
            try:
                fd = os.open(parts / "part0.bin", os.O_WRONLY | os.O_NONBLOCK)
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, "preparation never read the part"
                time.sleep(0.05)
        os.set_blocking(fd, True)
        os.write(fd, b"\x00" * (5 << 20))  # more than one 4 MiB read of the join
        written = lambda: [p for p in cache.glob(".fake-interrupt.tmp-*/gguf/*.gguf") if p.stat().st_size > 0]
        while not written():  # half a GGUF is on disk in the staging dir
            assert time.monotonic() < deadline, "nothing was joined"
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        # The signal may land on a helper thread (tqdm's monitor), leaving the main thread asleep in
        # read(); closing our end wakes it and the pending KeyboardInterrupt is raised right there.
        os.close(fd)
        assert proc.wait(timeout=30) == 130, proc.stderr.read()
    finally:
        proc.kill()
    assert_no_entry(cache, "fake-interrupt")


# ---- the packaged GGUF models (real conversions) ---------------------------------------------------


def greedy(path, messages, max_new_tokens):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tok(ids, return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids).logits
        assert torch.isfinite(logits).all()
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
    return tok, model, tok.decode(out[0, ids.shape[1]:])


def test_smollm2_converts_from_its_gguf_and_answers(tmp_path):
    # Converted afresh every run (small: ~100 MB of parts) so the GGUF route itself is always tested.
    path = models.prepare("smollm2-135m-instruct", cache_dir=tmp_path)
    manifest = json.loads((path / "nano_miles.json").read_text())
    assert manifest["gguf_sha256"] == models.GGUF_MODELS["smollm2-135m-instruct"].sha256
    assert not (path / "config.json").read_text().count("quantization_config")
    tok, model, text = greedy(path, [{"role": "user", "content": "What is the capital of France?"}], 12)
    assert type(model).__name__ == "LlamaForCausalLM" and model.dtype == torch.float32
    assert "Paris" in text
    assert sorted(p.name for p in tmp_path.iterdir()) == [".smollm2-135m-instruct.lock", "smollm2-135m-instruct"]


def test_qwen_default_model_converts_and_writes_shell_commands():
    # The shared default cache: one preparation serves every test (and user) on this machine.
    path = models.resolve_model(DEFAULT_MODEL)
    info = json.loads((path / "config.json").read_text())
    assert info["model_type"] == "qwen2" and info["num_hidden_layers"] == 24 and info["vocab_size"] == 151936
    assert info.get("dtype", info.get("torch_dtype")) == "float32"
    assert json.loads((path / "nano_miles.json").read_text())["gguf_sha256"] == models.GGUF_MODELS[DEFAULT_MODEL].sha256
    tok, model, text = greedy(path, [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Write a shell command that counts the lines in the file notes.txt. "
                                    "Reply with only the command."}], 12)
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    assert "wc -l notes.txt" in text and text.endswith("<|im_end|>")
    # Qwen's own chat template (with its default system prompt) came along from the GGUF.
    rendered = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert rendered.startswith("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud.")


def test_a_rebuild_that_cannot_land_says_so_and_keeps_the_previous_entry(tmp_path):
    target = tmp_path / "cache" / TINY_MODEL
    target.mkdir(parents=True)
    (target / "weights").write_text("the previous entry")
    staging = tmp_path / "staging"
    staging.mkdir()
    # the new folder is gone before the rename (a full disk, a cleaner): the rename fails
    with pytest.raises(ModelError, match="cannot move the new .* the previous entry stays"):
        models._commit(staging / "model", target)
    assert (target / "weights").read_text() == "the previous entry"
