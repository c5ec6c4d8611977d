"""OpenAI-compatible routes, /v1/models and /v1/chat/completions, so a served model (a trained
`final/` folder too) works from any OpenAI client (README.md shows one). The messages go through the
model's own chat template, then the engine generates as for /generate.
Taken: temperature, top_p, max_tokens (max_completion_tokens), n, stop (up to 4 strings), seed.
Refused with a 400 rather than ignored: tools, non-text response_format, logprobs, penalties,
logit_bias. The model field is not checked (one model per server, as SGLang). stream=true is
answered as server-sent events with the whole completion in one chunk, once it is done.
"""
from __future__ import annotations

import asyncio
import functools
import time
import uuid

from aiohttp import web

from nano_miles.engine.http_io import dumps, json_body, json_response
from nano_miles.engine.protocol import GenerateItem, RequestError, parse_sampling_params

ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_N, MAX_STOPS = 128, 4  # MAX_STOPS: OpenAI's limit
# Keys that ask for something this server does not do, with the value that means "nothing asked".
_REFUSED = {"tools": None, "tool_choice": None, "functions": None, "function_call": None, "logprobs": False,
            "top_logprobs": None, "frequency_penalty": 0, "presence_penalty": 0, "logit_bias": None, "audio": None}


def _messages(messages) -> list[dict]:
    """The chat as the template takes it: roles checked, text parts joined."""
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list of {role, content}")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise RequestError(f"messages[{i}] must be an object with role one of {', '.join(ROLES)}")
        content = m.get("content")
        if isinstance(content, list):  # content parts: only text ones
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise RequestError(f"messages[{i}].content: only text parts are supported")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, (str, type(None))):
            raise RequestError(f"messages[{i}].content must be a string or a list of text parts")
        out.append({"role": m["role"], "content": content or ""})
    return out


def _check_request(body: dict) -> tuple[int, list[str], bool]:
    """(n, stop strings, stream) of a chat request whose other keys are known not to ask for more."""
    for key, nothing in _REFUSED.items():
        if body.get(key) not in (None, nothing, [], {}):
            raise RequestError(f"{key} is not supported by this server")
    fmt = body.get("response_format")
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "text"):
        raise RequestError("response_format: only {\"type\": \"text\"} is supported")
    n = 1 if body.get("n") is None else body["n"]
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_N:
        raise RequestError(f"n must be an integer in [1, {MAX_N}], got {n!r}")
    stop = body.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if not (isinstance(stop, list) and len(stop) <= MAX_STOPS and all(isinstance(s, str) and s for s in stop)):
        raise RequestError(f"stop must be a string or a list of at most {MAX_STOPS} non-empty strings")
    stream = body.get("stream") or False
    if not isinstance(stream, bool):
        raise RequestError("stream must be true or false")
    if not isinstance(body.get("stream_options") or {}, dict):  # read once the stream has begun: checked now
        raise RequestError("stream_options must be an object")
    seed = body.get("seed")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        raise RequestError(f"seed must be an integer, got {seed!r}")
    return n, stop, stream


class OpenAIRoutes:
    def __init__(self, worker, model_name: str, created: float):
        self.worker, self.model_name, self.created = worker, model_name, int(created)

    def add_routes(self, router) -> None:
        router.add_get("/v1/models", self.models)
        router.add_post("/v1/chat/completions", self.chat_completions)

    async def models(self, request):
        return json_response({"object": "list", "data": [{
            "id": self.model_name, "object": "model", "created": self.created, "owned_by": "nano-miles",
            "max_model_len": self.worker.engine.max_model_len}]})

    @functools.cached_property
    def _max_token_chars(self) -> int:
        """The most characters one token can stand for: its longest token's text, added and special
        tokens included (byte-level BPE writes one character per byte: never fewer than they encode)."""
        tok = self.worker.engine.tokenizer
        return max(len(t) for t in tok.convert_ids_to_tokens(list(range(len(tok)))) if t)

    def _prompt(self, messages: list[dict]) -> list[int]:
        """The chat through the template, then tokenised, unless its text is too long for ANY
        tokenisation to fit the context (T tokens cover at most T * _max_token_chars characters; twice
        that is refused, for normalisers that merge characters): what a request costs before its 400
        is bounded by the context, not by the body (tokenising takes seconds per megabyte)."""
        tok = self.worker.engine.tokenizer
        if tok is None:
            raise RequestError("this model folder has no tokenizer, so no chat template: use /generate with input_ids")
        try:
            text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except Exception as e:  # no template, or one that refuses this chat (e.g. roles out of order)
            raise RequestError(f"the model's chat template cannot render these messages: {e}") from None
        context = self.worker.engine.max_model_len
        most = 2 * context * self._max_token_chars
        if len(text) > most:
            raise RequestError(f"the chat is {len(text)} characters once templated; a prompt of at most {context} "
                               f"tokens (the model's context) holds at most {most} with this tokenizer: shorten it")
        return list(tok(text, add_special_tokens=False)["input_ids"])

    async def chat_completions(self, request):
        body = await json_body(request)
        n, stop, stream = _check_request(body)
        prompt = await asyncio.to_thread(self._prompt, _messages(body.get("messages")))
        # no max_tokens: up to the context length, as OpenAI's API; the engine stops at a stop string
        max_tokens = body.get("max_completion_tokens")  # null: not given, max_tokens then holds
        sampling = {"temperature": body.get("temperature"), "top_p": body.get("top_p"), "stop": stop,
                    "max_new_tokens": body.get("max_tokens") if max_tokens is None else max_tokens}
        eng, rid, seed = self.worker.engine, f"chatcmpl-{uuid.uuid4().hex}", body.get("seed")
        items = [GenerateItem(f"{rid}-{i}", prompt, parse_sampling_params(  # n samples: distinct seeds
            {**sampling, "sampling_seed": None if seed is None else seed + i}, len(prompt), eng.vocab_size,
            eng.max_model_len)) for i in range(n)]
        results = await self.worker.run(items)
        choices = [self._choice(i, fin, stop) for i, (fin, *_) in enumerate(results)]
        usage = {"prompt_tokens": len(prompt), "completion_tokens": sum(fin.completion_tokens for fin, *_ in results)}
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        answer = {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": self.model_name,
                  "choices": choices, "usage": usage}
        return await self._stream(request, answer, body) if stream else json_response(answer)

    def _choice(self, index: int, fin, stop: list[str]) -> dict:
        ids, reason = fin.output_ids, fin.finish_reason.get("type")
        if reason == "stop" and isinstance(fin.finish_reason.get("matched"), int) and ids:
            ids = ids[:-1]  # the end-of-turn token is not part of the text (a stop string is cut below)
        text = self.worker.engine.tokenizer.decode(ids, skip_special_tokens=True) if ids else ""
        cuts = [i for i in (text.find(s) for s in stop) if i >= 0]
        return {"index": index, "message": {"role": "assistant", "content": text[:min(cuts)] if cuts else text},
                "logprobs": None, "finish_reason": "stop" if cuts else reason}

    async def _stream(self, request, answer: dict, body: dict) -> web.StreamResponse:
        """The completion as server-sent events: per choice its text in one chunk, then [DONE]."""
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        head = {k: answer[k] for k in ("id", "created", "model")} | {"object": "chat.completion.chunk"}
        chunks = []
        for c in answer["choices"]:
            delta = {"role": "assistant", "content": c["message"]["content"]}
            chunks.append({**head, "choices": [{"index": c["index"], "delta": delta, "finish_reason": None}]})
            chunks.append({**head, "choices": [{"index": c["index"], "delta": {}, "finish_reason": c["finish_reason"]}]})
        if (body.get("stream_options") or {}).get("include_usage"):
            chunks.append({**head, "choices": [], "usage": answer["usage"]})
        for data in [*map(dumps, chunks), "[DONE]"]:
            await response.write(f"data: {data}\n\n".encode())
        await response.write_eof()
        return response
