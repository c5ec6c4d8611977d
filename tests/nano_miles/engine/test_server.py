"""The engine server over real HTTP (the session's `nano-miles serve` on CPU with tiny-random-qwen2):
SGLang's /generate shapes, batching, concurrency, stop tokens, the logprob contract, prefix caching,
pause/abort, and every bad input answered with 400 while the server keeps serving."""
import json
import threading
import time

import pytest
import requests
import torch

PROMPT = [5, 17, 42, 99, 7, 300, 12, 8]


def hf_model(folder, state_dict=None):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    if state_dict is not None:
        model.load_state_dict(state_dict, strict=False)
    return model


@torch.no_grad()
def teacher_forced_logprobs(model, prompt, output):
    """log p(output[i] | prompt + output[:i]) from a plain HF forward."""
    ids = torch.tensor([prompt + output])
    logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(output)[:, None])[:, 0]


def auth(server) -> dict:
    return {"Authorization": f"Bearer {server.api_key}"}


def post(server, path, body=None, data=None):
    return requests.post(server.url + path, json=body, data=data, headers=auth(server), timeout=120)


def greedy(client, prompt, n=12, **sp):
    return client.generate(prompt, {"max_new_tokens": n, "temperature": 0, **sp})


def test_generate_returns_sglang_response_shape(engine_client):
    out = engine_client.generate(PROMPT, {"max_new_tokens": 6, "ignore_eos": True}, rid="shape-1")
    assert set(out) == {"text", "output_ids", "meta_info"}
    meta = out["meta_info"]
    assert meta["id"] == "shape-1"
    assert meta["finish_reason"] == {"type": "length", "length": 6}
    assert meta["prompt_tokens"] == len(PROMPT)
    assert meta["completion_tokens"] == len(out["output_ids"]) == 6
    assert meta["cached_tokens"] == 0 or meta["cached_tokens"] <= len(PROMPT)
    assert isinstance(meta["weight_version"], str)
    lps = meta["output_token_logprobs"]
    assert [t for _, t, _ in lps] == out["output_ids"]
    assert all(isinstance(lp, float) and lp <= 0 and x is None for lp, _, x in lps)
    assert isinstance(out["text"], str)


def test_logprobs_omitted_unless_asked(engine_client):
    out = engine_client.generate(PROMPT, {"max_new_tokens": 2}, return_logprob=False)
    assert "output_token_logprobs" not in out["meta_info"]


def test_batch_is_a_list_in_order(engine_client):
    prompts = [PROMPT, PROMPT[:3], [9, 9, 9, 9]]
    outs = engine_client.generate(prompts, {"max_new_tokens": 4, "temperature": 0}, rid=["b0", "b1", "b2"])
    assert isinstance(outs, list) and [o["meta_info"]["id"] for o in outs] == ["b0", "b1", "b2"]
    assert [o["meta_info"]["prompt_tokens"] for o in outs] == [8, 3, 4]
    for prompt, out in zip(prompts, outs):  # same as each prompt alone
        assert out["output_ids"] == greedy(engine_client, prompt, 4)["output_ids"]


def test_64_concurrent_requests_match_one_at_a_time(engine_server, engine_client):
    import asyncio

    from nano_miles.engine.client import AsyncEngineClient

    prompts = [[(7 * i + j) % 1000 + 3 for j in range(5 + i % 7)] for i in range(8)]
    alone = [greedy(engine_client, p, 10, ignore_eos=True)["output_ids"] for p in prompts]

    async def many():
        client = AsyncEngineClient(engine_server.url)
        try:
            return await asyncio.gather(*[
                client.generate(prompts[i % 8], {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True},
                                rid=f"conc-{i}") for i in range(64)])
        finally:
            await client.close()

    outs = asyncio.run(many())
    assert [o["meta_info"]["id"] for o in outs] == [f"conc-{i}" for i in range(64)]
    for i, out in enumerate(outs):
        assert out["output_ids"] == alone[i % 8]


def test_stop_token_ends_generation_and_is_trimmed_from_text_only(engine_client):
    from transformers import AutoTokenizer

    free = greedy(engine_client, PROMPT, 12, ignore_eos=True)["output_ids"]
    eos = set(engine_client.model_info()["eos_token_ids"])
    k = next(i for i, t in enumerate(free) if i >= 2 and t not in eos and t not in free[:i])
    stop = free[k]
    trimmed = greedy(engine_client, PROMPT, 12, stop_token_ids=[stop], skip_special_tokens=False)
    assert trimmed["output_ids"] == free[: k + 1]  # raw ids include the stop token
    assert trimmed["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    kept = greedy(engine_client, PROMPT, 12, stop_token_ids=[stop], no_stop_trim=True, skip_special_tokens=False)
    tok = AutoTokenizer.from_pretrained(engine_client.model_info()["tokenizer_path"])
    assert kept["text"] == tok.decode(free[: k + 1], skip_special_tokens=False)
    assert trimmed["text"] == tok.decode(free[:k], skip_special_tokens=False)
    # ignore_eos ignores stop tokens too (SGLang): generation runs to max_new_tokens
    assert len(greedy(engine_client, PROMPT, 12, stop_token_ids=[stop], ignore_eos=True)["output_ids"]) == 12


def test_stop_string_ends_generation_and_is_cut_from_text_only(engine_client):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(engine_client.model_info()["tokenizer_path"])
    free = greedy(engine_client, PROMPT, 16, ignore_eos=True)["output_ids"]
    text = tok.decode(free)
    stop = next(text[i:i + 4] for i in range(2, len(text) - 4) if text[i:i + 4].isprintable())
    n = next(j for j in range(1, len(free) + 1) if stop in tok.decode(free[:j]))
    cut = greedy(engine_client, PROMPT, 16, ignore_eos=True, stop=stop)  # one string, or a list
    assert cut["output_ids"] == free[:n]  # the ids run to the token that completed the string
    assert cut["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert cut["text"] == text[:text.index(stop)]
    kept = greedy(engine_client, PROMPT, 16, ignore_eos=True, stop=[stop], no_stop_trim=True)
    assert kept["text"] == tok.decode(free[:n]) and stop in kept["text"]


def test_logprob_contract_matches_teacher_forced_hf_forward(engine_client, tiny_model_path):
    out = engine_client.generate(PROMPT, {"max_new_tokens": 16, "temperature": 1.0, "ignore_eos": True,
                                          "sampling_seed": 1234})
    got = torch.tensor([lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]])
    want = teacher_forced_logprobs(hf_model(tiny_model_path), PROMPT, out["output_ids"])
    assert torch.allclose(got, want.double().float(), atol=1e-5, rtol=0), (got - want).abs().max()
    again = engine_client.generate(PROMPT, {"max_new_tokens": 16, "temperature": 1.0, "ignore_eos": True,
                                            "sampling_seed": 1234})
    assert again["output_ids"] == out["output_ids"]  # sampling_seed makes a request reproducible


def test_prefix_cache_reports_cached_tokens_and_same_logprobs(engine_client):
    prompt = [(13 * i) % 900 + 4 for i in range(48)]  # three full KV blocks of 16
    first = engine_client.generate(prompt, {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True})
    second = engine_client.generate(prompt, {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True})
    assert second["meta_info"]["cached_tokens"] >= 32
    assert second["output_ids"] == first["output_ids"]
    a = [lp for lp, _, _ in first["meta_info"]["output_token_logprobs"]]
    b = [lp for lp, _, _ in second["meta_info"]["output_token_logprobs"]]
    assert a == pytest.approx(b, abs=1e-5)


def test_flush_cache_drops_prefixes(engine_client):
    prompt = [(11 * i) % 800 + 5 for i in range(40)]
    engine_client.generate(prompt, {"max_new_tokens": 1})
    assert engine_client.flush_cache()["success"] is True
    assert engine_client.generate(prompt, {"max_new_tokens": 1})["meta_info"]["cached_tokens"] == 0


def _long_request(client, rid, box, n=3000):
    def go():
        box[rid] = client.generate([3, 4, 5], {"max_new_tokens": n, "ignore_eos": True}, rid=rid)
    t = threading.Thread(target=go)
    t.start()
    return t


def _wait_running(client, n=1, timeout=30):
    deadline = time.time() + timeout
    while time.time() < deadline:
        state = client.server_info()["internal_states"][0]
        if state["running"] + state["waiting"] >= n:
            return
        time.sleep(0.05)
    raise AssertionError("request never started")


def test_abort_request_finishes_it_with_abort(engine_server, engine_client):
    box = {}
    t = _long_request(engine_server.client(), "to-abort", box)
    _wait_running(engine_client)
    assert engine_client.abort(rid="to-abort")["num_aborted"] == 1
    t.join(30)
    out = box["to-abort"]
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    assert out["meta_info"]["completion_tokens"] == len(out["output_ids"]) < 3000


def test_flush_cache_refused_while_requests_run(engine_server, engine_client):
    from nano_miles.engine.client import EngineRequestError

    box = {}
    t = _long_request(engine_server.client(), "busy", box)
    _wait_running(engine_client)
    with pytest.raises(EngineRequestError, match="running"):
        engine_client.flush_cache()
    engine_client.abort(abort_all=True)
    t.join(30)


def test_pause_abort_mode_aborts_running_and_holds_new_requests(engine_server, engine_client):
    box = {}
    t1 = _long_request(engine_server.client(), "p-running", box)
    _wait_running(engine_client)
    assert engine_client.pause("abort")["num_aborted"] >= 1
    t1.join(30)
    assert box["p-running"]["meta_info"]["finish_reason"]["type"] == "abort"
    t2 = _long_request(engine_server.client(), "p-queued", box, n=5)
    time.sleep(0.5)  # a negative check: 5 tokens take milliseconds, so one not held would be answered by now
    assert "p-queued" not in box  # held while paused
    engine_client.resume()
    t2.join(30)
    assert box["p-queued"]["meta_info"]["finish_reason"]["type"] == "length"


def test_a_top_k_beyond_int64_samples_unfiltered_and_fails_no_other_request(engine_server, engine_client):
    """A top_k over the vocabulary filters nothing, however large: 2**63 must not fail the engine's
    step (an int64 tensor cannot hold it), which would abort every request running beside it."""
    box = {}
    t = _long_request(engine_server.client(), "bystander", box, n=200)
    _wait_running(engine_client)
    r = post(engine_server, "/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2,
                                                                                    "top_k": 2**63}})
    assert r.status_code == 200, r.text
    t.join(60)
    assert box["bystander"]["meta_info"]["finish_reason"] == {"type": "length", "length": 200}


@pytest.mark.parametrize("mode", ["in_place", "retract"])
def test_pause_keeps_requests_and_continue_finishes_them(engine_server, engine_client, mode):
    box = {}
    t = _long_request(engine_server.client(), f"keep-{mode}", box, n=1000)
    _wait_running(engine_client)
    engine_client.pause(mode)
    time.sleep(0.5)  # a negative check: an aborted request would be answered within this window
    assert f"keep-{mode}" not in box  # frozen, not aborted
    engine_client.resume()
    t.join(60)
    out = box[f"keep-{mode}"]
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 1000}
    assert len(out["output_ids"]) == 1000


def test_health_and_info_routes(engine_server, engine_client):
    url = engine_server.url
    assert requests.get(url + "/health", timeout=10).status_code == 200
    assert requests.get(url + "/health_generate", headers=auth(engine_server), timeout=30).status_code == 200
    info = engine_client.model_info()
    assert info["model_path"] and info["vocab_size"] == 1024 and info["dtype"] == "float32"
    assert requests.get(url + "/get_model_info", headers=auth(engine_server),
                        timeout=10).json()["weight_version"] == info["weight_version"]
    server = engine_client.server_info()
    assert server["internal_states"][0]["paused"] is False and server["max_total_num_tokens"] > 0


def test_stop_strings_without_a_tokenizer_are_one_400_line(tiny_model_path, tmp_path):
    """A model folder without tokenizer files cannot decode text to match: the request is refused in
    one line, and the server keeps serving requests without stop strings."""
    import shutil

    from nano_miles.engine.process import start_engine_process
    from tests.conftest import ENGINE_ARGS

    bare = tmp_path / "no-tokenizer"
    bare.mkdir()
    for f in tiny_model_path.iterdir():
        if not f.name.startswith(("tokenizer", "chat_template")):
            shutil.copy(f, bare)
    with start_engine_process(str(bare), device="cpu", dtype="float32", extra_args=ENGINE_ARGS,
                              ready_timeout=180) as proc:
        r = post(proc, "/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2, "stop": "x"}})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["message"] == ("stop strings need a tokenizer and this model folder has none: "
                                                "use stop_token_ids")
        assert post(proc, "/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}}).ok


BAD_GENERATE = [
    ({"input_ids": []}, "input_ids"),
    ({"input_ids": [[1, 2], []]}, "input_ids"),
    ({"input_ids": [1, 5000]}, "vocabulary"),
    ({"input_ids": [1, -1]}, "vocabulary"),
    ({"input_ids": [1, "a"]}, "integers"),
    ({"sampling_params": {"max_new_tokens": 2}}, "input_ids is required"),
    ({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2, "no_such_key": 1}}, "unknown sampling_params"),
    ({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 0}}, "positive"),
    ({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": -3}}, "positive"),
    ({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 10**6}}, "context"),
    ({"input_ids": [1, 2], "sampling_params": {"temperature": -1}}, "temperature"),
    ({"input_ids": [1, 2], "sampling_params": {"top_p": 0}}, "top_p"),
    ({"input_ids": [1, 2], "sampling_params": {"top_k": 0}}, "top_k"),
    ({"input_ids": [1, 2], "sampling_params": {"temperature": 10**400}}, "temperature"),  # no float holds it
    ({"input_ids": [1, 2], "sampling_params": {"top_p": 10**400}}, "top_p"),
    ({"input_ids": [1, 2], "sampling_params": {"n": 4}}, "not supported"),
    ({"input_ids": [1, 2], "sampling_params": {"stop_token_ids": [99999]}}, "vocabulary"),
    ({"input_ids": [1, 2], "sampling_params": {"stop": [""]}}, "stop must be"),
    ({"input_ids": [1, 2], "sampling_params": {"stop": 7}}, "stop must be"),
    ({"input_ids": [1, 2], "sampling_params": {"stop": ["x" * 257]}}, "stop must be"),
    ({"input_ids": [1, 2], "sampling_params": {"stop_regex": "a+"}}, "not supported"),
    ({"input_ids": [1, 2], "stream": True}, "stream"),
    ({"input_ids": [1, 2], "logprob_start_len": 0}, "logprob_start_len"),
    ({"text": "hello"}, "input_ids"),
    ({"input_ids": [[1, 2], [3]], "rid": ["same", "same"]}, "distinct"),
]


@pytest.mark.parametrize("body,needle", BAD_GENERATE, ids=[n for _, n in BAD_GENERATE])
def test_bad_generate_input_is_400_and_server_keeps_serving(engine_server, body, needle):
    r = post(engine_server, "/generate", body)
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"]
    assert post(engine_server, "/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}}).ok


def strict_json(text: str):
    """JSON as RFC 8259 defines it: NaN and Infinity are not JSON (Python's json.loads takes them)."""
    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


def test_the_servers_json_encoder_writes_null_for_nan_and_infinities():
    from nano_miles.engine.http_io import dumps, json_response

    value = {"lp": [[float("nan"), 3, None], (float("-inf"), 1.5)], "t": {"ms": float("inf")}, "n": 2}
    assert strict_json(dumps(value)) == {"lp": [[None, 3, None], [None, 1.5]], "t": {"ms": None}, "n": 2}
    assert strict_json(json_response([float("nan")], status=400).text) == [None]
    assert dumps({"x": 0.1}) == '{"x": 0.1}'


def test_non_finite_logprobs_are_null_in_valid_json(engine_server, engine_client, restore_engine_weights):
    """Finite weights can still overflow (a norm weight of 3e38 makes the hidden states inf and the
    logits NaN): the answer stays valid JSON, with null where a log-prob is not a number."""
    from nano_miles.engine import weights as W

    norm = [("model.norm.weight", torch.full((64,), 3e38))]
    engine_client.update_weights_from_tensor(W.serialize(norm), load_format="direct")
    r = post(engine_server, "/generate", {"input_ids": PROMPT, "return_logprob": True,
                                          "sampling_params": {"max_new_tokens": 3, "temperature": 0}})
    assert r.status_code == 200
    out = strict_json(r.text)
    assert [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]] == [None] * len(out["output_ids"]) != []


@pytest.mark.parametrize("raw", [b"{not json", b"", b"[1, 2]", b"\xff\xfe"])
def test_invalid_json_is_400(engine_server, raw):
    r = requests.post(engine_server.url + "/generate", data=raw, headers=auth(engine_server), timeout=30)
    assert r.status_code == 400 and r.json()["error"]["message"]
    assert post(engine_server, "/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}}).ok


def test_duplicate_rid_in_flight_is_refused(engine_server, engine_client):
    from nano_miles.engine.client import EngineRequestError

    box = {}
    t = _long_request(engine_server.client(), "dup", box)
    _wait_running(engine_client)
    with pytest.raises(EngineRequestError, match="already in flight"):
        engine_client.generate([1, 2], {"max_new_tokens": 1}, rid="dup")
    engine_client.abort(rid="dup")
    t.join(30)


@pytest.mark.parametrize("path,body,needle", [
    ("/pause_generation", {"mode": "sideways"}, "mode"),
    ("/abort_request", {}, "rid"),
    ("/abort_request", {"rid": 5}, "rid"),
])
def test_bad_control_input_is_400(engine_server, path, body, needle):
    r = post(engine_server, path, body)
    assert r.status_code == 400 and needle in r.json()["error"]["message"]


def test_a_client_that_goes_away_frees_its_request(engine_server, engine_client):
    with pytest.raises(requests.exceptions.ReadTimeout):
        requests.post(engine_server.url + "/generate", timeout=1.0, headers=auth(engine_server),
                      json={"input_ids": [3, 4, 5], "rid": "gone", "sampling_params": {"max_new_tokens": 4000,
                                                                                         "ignore_eos": True}})
    deadline = time.time() + 2.5  # far less than 4000 tokens take: it was aborted, not finished
    while engine_client.server_info()["internal_states"][0]["running"] and time.time() < deadline:
        time.sleep(0.05)
    assert engine_client.server_info()["internal_states"][0]["running"] == 0


def test_abort_a_request_held_by_a_pause(engine_server, engine_client):
    engine_client.pause("in_place")
    box = {}
    held = [_long_request(engine_server.client(), rid, box, n=4) for rid in ("held-a", "held-b")]
    deadline = time.time() + 30  # until both reach the engine, which parks them while paused
    while engine_client.server_info()["internal_states"][0]["parked"] < 2:
        assert time.time() < deadline, "the held requests never reached the engine"
        time.sleep(0.02)
    assert engine_client.abort(rid="held-a")["num_aborted"] == 1
    held[0].join(10)
    out = box["held-a"]
    assert out["meta_info"]["finish_reason"]["type"] == "abort" and out["output_ids"] == []
    assert "held-b" not in box
    engine_client.resume()
    held[1].join(30)
    assert box["held-b"]["meta_info"]["finish_reason"] == {"type": "length", "length": 4}
