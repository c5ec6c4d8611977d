"""SGLang's /generate body (GenerateReqInput), parsed and validated without touching the engine.

Anything wrong raises RequestError with the message of the 400 answer. As SGLang (io_struct.py,
sampling_params.py): input_ids is one list of ints or a batch of them, and per-request fields are
then one value or a list; unknown top-level keys are ignored, unknown sampling keys refused. SGLang's
other sampling keys are taken only at their no-op value (n=1, no penalties, no grammar...): anything
else would silently change the distribution.
"""
from __future__ import annotations

import math
import uuid
from dataclasses import dataclass

from nano_miles.engine.sampling import SamplingParams

DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's default
DEFAULT_GROUP_NAME = "weight_update_group"  # SGLang's weight-update group name when a request names none
API_KEY_ENV = "NANO_MILES_API_KEY"  # the api key of `serve` and of the clients when none is given (keeps it out of `ps`)

# sampling key -> the only value taken (None too); "", [] and {} also mean "none" for the _EMPTY_OK ones
_NOOP_DEFAULTS = {"min_p": 0.0, "frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0, "n": 1,
                  "json_schema": None, "regex": None, "ebnf": None, "structural_tag": None, "custom_params": None,
                  "stop_regex": None, "logit_bias": None}
_EMPTY_OK = ("logit_bias", "stop_regex")
_IGNORED = ("stream_interval",)  # only shapes streamed chunks; we do not stream
_SUPPORTED = ("max_new_tokens", "temperature", "top_p", "top_k", "stop_token_ids", "ignore_eos", "sampling_seed",
              "min_new_tokens", "no_stop_trim", "skip_special_tokens", "spaces_between_special_tokens", "stop")
MAX_STOP_STRINGS, MAX_STOP_CHARS = 16, 256
# Top-level keys that ask for something we do not do: refused unless absent/false/empty.
_UNSUPPORTED_TOP = ("text", "input_embeds", "image_data", "video_data", "audio_data", "return_hidden_states",
                    "top_logprobs_num", "token_ids_logprob", "lora_path", "lora_id", "session_params")


class RequestError(ValueError):
    """A bad request: the message goes back to the caller with HTTP `status`."""
    status = 400


@dataclass
class GenerateItem:  # one request of a /generate call, validated
    rid: str
    input_ids: list[int]
    sampling: SamplingParams
    return_logprob: bool = False
    no_stop_trim: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _value(d: dict, key: str, default, ok, what: str, where: str):
    """d[key] (default when absent or null) if ok(value), else RequestError "{where}{key} must be {what}"."""
    value = d.get(key)
    value = default if value is None else value
    if not ok(value):
        raise RequestError(f"{where}{key} must be {what}, got {str(value)[:100]}")
    return value


def _bool(d: dict, key: str, default: bool, where: str) -> bool:
    return _value(d, key, default, lambda v: isinstance(v, bool), "true or false", where)


def _number(x) -> bool:  # an int too large for a float is no number either (math.isfinite would raise)
    return isinstance(x, (int, float)) and not isinstance(x, bool) and abs(x) <= 1e308 and math.isfinite(x)


def parse_sampling_params(sp, prompt_len: int, vocab_size: int, max_model_len: int, where: str = "") -> SamplingParams:
    """SGLang sampling_params -> the engine's SamplingParams, validated (the only place that does)."""
    sp = {} if sp is None else sp
    if not isinstance(sp, dict):
        raise RequestError(f"{where}sampling_params must be an object, got {type(sp).__name__}")
    unknown = sorted(k for k in sp if k not in (*_SUPPORTED, *_NOOP_DEFAULTS, *_IGNORED))
    if unknown:
        raise RequestError(f"{where}unknown sampling_params keys: {', '.join(unknown)}")
    for key, noop in _NOOP_DEFAULTS.items():
        value = sp.get(key)
        if not (value is None or value == noop or (key in _EMPTY_OK and value in ("", [], {}))):
            raise RequestError(f"{where}sampling_params.{key}={value!r} is not supported by this engine (only {noop!r})")
    temperature = _value(sp, "temperature", 1.0, lambda v: _number(v) and v >= 0, "a finite number >= 0", where)
    top_p = _value(sp, "top_p", 1.0, lambda v: _number(v) and 0 < v <= 1, "in (0, 1]", where)
    top_k = -1 if sp.get("top_k") == 1 << 30 else sp.get("top_k")
    top_k = _value({"top_k": top_k}, "top_k", -1, lambda v: _is_int(v) and (v >= 1 or v == -1),
                   "-1 (off) or an integer >= 1", where)
    top_k = -1 if top_k >= vocab_size else top_k  # keeps every token: off (and no int64 overflow in the step)
    room = max_model_len - prompt_len
    if room < 1:
        raise RequestError(f"{where}the prompt has {prompt_len} tokens; the model's context is {max_model_len} "
                           "tokens, which leaves no room for a completion")
    # null means "up to the context limit" (SGLang); absent, the default
    default = room if "max_new_tokens" in sp else min(DEFAULT_MAX_NEW_TOKENS, room)
    max_new = _value(sp, "max_new_tokens", default, lambda v: _is_int(v) and v >= 1, "a positive integer", where)
    if max_new > room:
        raise RequestError(f"{where}requested {prompt_len + max_new} tokens ({prompt_len} prompt + {max_new} "
                           f"max_new_tokens), more than the model's context of {max_model_len} tokens")
    min_new = _value(sp, "min_new_tokens", 0, lambda v: _is_int(v) and 0 <= v <= max_new,
                     "an integer in [0, max_new_tokens]", where)
    stop_ids = _value(sp, "stop_token_ids", [], lambda v: isinstance(v, list) and all(_is_int(t) for t in v),
                      "a list of integers", where)
    bad = [t for t in stop_ids if not 0 <= t < vocab_size]
    if bad:
        raise RequestError(f"{where}stop_token_ids {bad} are outside the vocabulary [0, {vocab_size})")
    stop = sp.get("stop") or []
    stop = _value({"stop": [stop] if isinstance(stop, str) else stop}, "stop", [],
                  lambda v: isinstance(v, list) and len(v) <= MAX_STOP_STRINGS
                  and all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in v),
                  f"a string or a list of at most {MAX_STOP_STRINGS} non-empty strings of at most "
                  f"{MAX_STOP_CHARS} characters", where)
    seed = _value(sp, "sampling_seed", None, lambda v: v is None or _is_int(v), "an integer or null", where)
    return SamplingParams(max_new_tokens=max_new, temperature=float(temperature), top_p=float(top_p), top_k=top_k,
                          stop_token_ids=sorted(set(stop_ids)), ignore_eos=_bool(sp, "ignore_eos", False, where),
                          sampling_seed=seed, min_new_tokens=min_new, stop=tuple(dict.fromkeys(stop)))


def _per_request(body: dict, key: str, n: int, batched: bool, default) -> list:
    """A field that may be one value for all requests, or (in a batch) a list with one per request."""
    value = body.get(key, default)
    if batched and isinstance(value, list):
        if len(value) != n:
            raise RequestError(f"{key} has {len(value)} entries for a batch of {n} requests")
        return [default if v is None else v for v in value]
    return [default if value is None else value] * n


def parse_generate(body, vocab_size: int, max_model_len: int) -> tuple[list[GenerateItem], bool]:
    """A /generate body (a JSON object: json_body checked) -> (requests, batched). batched: answer with a list."""
    if body.get("stream"):
        raise RequestError("stream=true is not supported by this engine; send stream=false")
    for key in _UNSUPPORTED_TOP:
        if body.get(key) not in (None, False, 0, [], {}, ""):
            raise RequestError(f"{key} is not supported by this engine{'; send input_ids' if key == 'text' else ''}")
    ids = body.get("input_ids")
    if ids is None:
        raise RequestError("input_ids is required")
    batched = isinstance(ids, list) and bool(ids) and isinstance(ids[0], list)
    prompts = ids if batched else [ids]
    n = len(prompts)
    wheres = [f"request {i}: " if batched else "" for i in range(n)]
    for p, where in zip(prompts, wheres):
        if isinstance(p, list) and len(p) >= max_model_len:  # before looking at every id of a huge prompt
            raise RequestError(f"{where}the prompt has {len(p)} tokens; the model's context is {max_model_len} "
                               "tokens, which leaves no room for a completion")
        if not isinstance(p, list) or not p or not all(_is_int(t) for t in p):
            raise RequestError(f"{where}input_ids must be a non-empty list of token ids (integers)")
        bad = [t for t in p if not 0 <= t < vocab_size]
        if bad:
            raise RequestError(f"{where}input_ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")
    rids = body.get("rid")
    if rids is None:
        rids = [uuid.uuid4().hex for _ in range(n)]
    elif isinstance(rids, str):
        rids = [rids] if n == 1 else [f"{rids}_{i}" for i in range(n)]
    elif not (isinstance(rids, list) and len(rids) == n and all(isinstance(r, str) and r for r in rids)):
        raise RequestError(f"rid must be a string or a list of {n} strings")
    if len(set(rids)) != n:
        raise RequestError("rids within one batch must be distinct")
    items = []
    for i, (sp, lp, start) in enumerate(zip(_per_request(body, "sampling_params", n, batched, {}),
                                            _per_request(body, "return_logprob", n, batched, False),
                                            _per_request(body, "logprob_start_len", n, batched, -1))):
        where = wheres[i]
        sampling = parse_sampling_params(sp, len(prompts[i]), vocab_size, max_model_len, where)
        _bool({"return_logprob": lp}, "return_logprob", False, where)
        if not _is_int(start) or (start != -1 and start < len(prompts[i])):
            raise RequestError(f"{where}logprob_start_len={start!r}: input-token logprobs are not supported by this "
                               "engine; use -1 (output tokens only)")
        items.append(GenerateItem(rids[i], prompts[i], sampling, lp, _bool(sp, "no_stop_trim", False, where),
                                  _bool(sp, "skip_special_tokens", True, where),
                                  _bool(sp, "spaces_between_special_tokens", True, where)))
    return items, batched
