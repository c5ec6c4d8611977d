"""Parsing and validating SGLang's /generate body (GenerateReqInput) without touching the engine.

Everything wrong with a request raises RequestError with a message for the HTTP 400 answer. Rules,
matching SGLang where it defines them (io_struct.py GenerateReqInput, sampling_params.py):
- input_ids is a list of ints (one request) or a list of such lists (a batch); per-request fields
  (rid, sampling_params, return_logprob, logprob_start_len) are then a single value or a list.
- unknown top-level keys are ignored (as SGLang does); unknown sampling_params keys are refused.
- SGLang's other sampling keys are accepted only at their no-op default value (n=1, min_p=0, no
  penalties, no grammar, no stop regex...): anything else would silently change the distribution.
"""
from __future__ import annotations

import math
import uuid
from dataclasses import dataclass

from nano_miles.engine.sampling import SamplingParams

DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's default
DEFAULT_GROUP_NAME = "weight_update_group"  # SGLang's weight-update group name when a request names none
API_KEY_ENV = "NANO_MILES_API_KEY"  # the api key of `serve` and of the clients when none is given (keeps it out of `ps`)

# sampling key -> the only value we accept (None also accepted): keys that only matter away from it.
_NOOP_DEFAULTS = {
    "min_p": 0.0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "n": 1,
    "json_schema": None,
    "regex": None,
    "ebnf": None,
    "structural_tag": None,
    "custom_params": None,
    "stop_regex": None,
}
_EMPTY_OK = ("logit_bias", "stop_regex")  # "", [], {} mean "none" too
_IGNORED = ("stream_interval",)  # only shapes streamed chunks; we do not stream
_SUPPORTED = (
    "max_new_tokens", "temperature", "top_p", "top_k", "stop_token_ids", "ignore_eos", "sampling_seed",
    "min_new_tokens", "no_stop_trim", "skip_special_tokens", "spaces_between_special_tokens", "stop",
)
MAX_STOP_STRINGS, MAX_STOP_CHARS = 16, 256
# Top-level keys that ask for something we do not do: refused unless absent/false/empty.
_UNSUPPORTED_TOP = ("text", "input_embeds", "image_data", "video_data", "audio_data", "return_hidden_states",
                    "top_logprobs_num", "token_ids_logprob", "lora_path", "lora_id", "session_params")


class RequestError(ValueError):
    """A bad request: the message goes back to the caller with HTTP `status`."""

    status = 400


@dataclass
class GenerateItem:
    """One request of a /generate call, validated."""

    rid: str
    input_ids: list[int]
    sampling: SamplingParams
    return_logprob: bool = False
    no_stop_trim: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return (isinstance(x, (int, float)) and not isinstance(x, bool)) and math.isfinite(x)


def _bool(d: dict, key: str, default: bool, where: str) -> bool:
    value = d.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise RequestError(f"{where}{key} must be true or false, got {value!r}")
    return value


def _per_request(body: dict, key: str, n: int, batched: bool, default):
    """A field that may be one value for all requests, or (in a batch) a list with one per request."""
    value = body.get(key, default)
    if batched and isinstance(value, list) and key != "stop_token_ids":
        if len(value) != n:
            raise RequestError(f"{key} has {len(value)} entries for a batch of {n} requests")
        return value
    return [value] * n


def parse_sampling_params(sp, prompt_len: int, vocab_size: int, max_model_len: int, where: str = "") -> SamplingParams:
    """SGLang sampling_params -> the engine's SamplingParams, validated (the only place that does)."""
    if sp is None:
        sp = {}
    if not isinstance(sp, dict):
        raise RequestError(f"{where}sampling_params must be an object, got {type(sp).__name__}")
    unknown = sorted(k for k in sp if k not in _SUPPORTED and k not in _NOOP_DEFAULTS and k not in _EMPTY_OK
                     and k not in _IGNORED)
    if unknown:
        raise RequestError(f"{where}unknown sampling_params keys: {', '.join(unknown)}")
    for key, noop in _NOOP_DEFAULTS.items():
        value = sp.get(key)
        if value is None or value == noop or (key in _EMPTY_OK and value in ("", [], {})):
            continue
        raise RequestError(f"{where}sampling_params.{key}={value!r} is not supported by this engine (only {noop!r})")
    for key in _EMPTY_OK:
        if key not in _NOOP_DEFAULTS and sp.get(key) not in (None, "", [], {}):
            raise RequestError(f"{where}sampling_params.{key} is not supported by this engine; use stop or stop_token_ids")

    temperature = sp.get("temperature")
    temperature = 1.0 if temperature is None else temperature
    if not _is_number(temperature) or temperature < 0:
        raise RequestError(f"{where}temperature must be a finite number >= 0, got {temperature!r}")
    top_p = sp.get("top_p")
    top_p = 1.0 if top_p is None else top_p
    if not _is_number(top_p) or not 0.0 < top_p <= 1.0:
        raise RequestError(f"{where}top_p must be in (0, 1], got {top_p!r}")
    top_k = sp.get("top_k")
    top_k = -1 if top_k is None or top_k == 1 << 30 else top_k
    if not _is_int(top_k) or (top_k < 1 and top_k != -1):
        raise RequestError(f"{where}top_k must be -1 (off) or an integer >= 1, got {top_k!r}")

    room = max_model_len - prompt_len
    if room < 1:
        raise RequestError(
            f"{where}the prompt has {prompt_len} tokens; the model's context is {max_model_len} tokens, "
            "which leaves no room for a completion"
        )
    max_new = sp.get("max_new_tokens")
    if max_new is None and "max_new_tokens" in sp:
        max_new = room  # SGLang: null means "up to the context limit"
    elif max_new is None:
        max_new = min(DEFAULT_MAX_NEW_TOKENS, room)
    if not _is_int(max_new) or max_new < 1:
        raise RequestError(f"{where}max_new_tokens must be a positive integer, got {max_new!r}")
    if max_new > room:
        raise RequestError(
            f"{where}requested {prompt_len + max_new} tokens ({prompt_len} prompt + {max_new} max_new_tokens), "
            f"more than the model's context of {max_model_len} tokens"
        )
    min_new = sp.get("min_new_tokens") or 0
    if not _is_int(min_new) or not 0 <= min_new <= max_new:
        raise RequestError(f"{where}min_new_tokens must be an integer in [0, max_new_tokens], got {min_new!r}")

    stop_ids = sp.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or not all(_is_int(t) for t in stop_ids):
        raise RequestError(f"{where}stop_token_ids must be a list of integers, got {stop_ids!r}")
    bad = [t for t in stop_ids if not 0 <= t < vocab_size]
    if bad:
        raise RequestError(f"{where}stop_token_ids {bad} are outside the vocabulary [0, {vocab_size})")
    stop = sp.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if not (isinstance(stop, list) and len(stop) <= MAX_STOP_STRINGS
            and all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stop)):
        raise RequestError(f"{where}stop must be a string or a list of at most {MAX_STOP_STRINGS} non-empty strings "
                           f"of at most {MAX_STOP_CHARS} characters, got {str(stop)[:100]}")
    seed = sp.get("sampling_seed")
    if seed is not None and not _is_int(seed):
        raise RequestError(f"{where}sampling_seed must be an integer or null, got {seed!r}")

    return SamplingParams(
        max_new_tokens=max_new,
        temperature=float(temperature),
        top_p=float(top_p),
        top_k=top_k,
        stop_token_ids=sorted(set(stop_ids)),
        ignore_eos=_bool(sp, "ignore_eos", False, where),
        sampling_seed=seed,
        min_new_tokens=min_new,
        stop=tuple(dict.fromkeys(stop)),
    )


def _check_ids(ids, vocab_size: int, where: str) -> list[int]:
    if not isinstance(ids, list) or not ids:
        raise RequestError(f"{where}input_ids must be a non-empty list of token ids")
    if not all(_is_int(t) for t in ids):
        raise RequestError(f"{where}input_ids must contain only integers")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise RequestError(f"{where}input_ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")
    return ids


def parse_generate(body, vocab_size: int, max_model_len: int) -> tuple[list[GenerateItem], bool]:
    """A /generate JSON body -> (requests, batched). batched: answer with a list."""
    if not isinstance(body, dict):
        raise RequestError("the body must be a JSON object")
    if body.get("stream"):
        raise RequestError("stream=true is not supported by this engine; send stream=false")
    for key in _UNSUPPORTED_TOP:
        if body.get(key) not in (None, False, 0, [], {}, ""):
            hint = "; send input_ids" if key == "text" else ""
            raise RequestError(f"{key} is not supported by this engine{hint}")
    ids = body.get("input_ids")
    if ids is None:
        raise RequestError("input_ids is required")
    batched = isinstance(ids, list) and bool(ids) and isinstance(ids[0], list)
    prompts = ids if batched else [ids]
    n = len(prompts)
    for i, p in enumerate(prompts):
        where = f"request {i}: " if batched else ""
        if isinstance(p, list) and len(p) >= max_model_len:  # before looking at every id of a huge prompt
            raise RequestError(f"{where}the prompt has {len(p)} tokens; the model's context is {max_model_len} "
                               "tokens, which leaves no room for a completion")
        _check_ids(p, vocab_size, where)

    rids = body.get("rid")
    if rids is None:
        rids = [uuid.uuid4().hex for _ in range(n)]
    elif isinstance(rids, str):
        rids = [rids] if n == 1 else [f"{rids}_{i}" for i in range(n)]
    elif not (isinstance(rids, list) and len(rids) == n and all(isinstance(r, str) and r for r in rids)):
        raise RequestError(f"rid must be a string or a list of {n} strings")
    if len(set(rids)) != n:
        raise RequestError("rids within one batch must be distinct")

    sps = _per_request(body, "sampling_params", n, batched, None)
    lps = _per_request(body, "return_logprob", n, batched, False)
    starts = _per_request(body, "logprob_start_len", n, batched, -1)
    items = []
    for i in range(n):
        where = f"request {i}: " if batched else ""
        sp = sps[i] if sps[i] is not None else {}
        sampling = parse_sampling_params(sp, len(prompts[i]), vocab_size, max_model_len, where)
        rl = lps[i] if lps[i] is not None else False
        if not isinstance(rl, bool):
            raise RequestError(f"{where}return_logprob must be true or false")
        start = starts[i] if starts[i] is not None else -1
        if not _is_int(start) or (start != -1 and start < len(prompts[i])):
            raise RequestError(
                f"{where}logprob_start_len={start!r}: input-token logprobs are not supported by this engine; "
                "use -1 (output tokens only)"
            )
        items.append(
            GenerateItem(
                rid=rids[i],
                input_ids=prompts[i],
                sampling=sampling,
                return_logprob=rl,
                no_stop_trim=_bool(sp, "no_stop_trim", False, where),
                skip_special_tokens=_bool(sp, "skip_special_tokens", True, where),
                spaces_between_special_tokens=_bool(sp, "spaces_between_special_tokens", True, where),
            )
        )
    return items, batched
