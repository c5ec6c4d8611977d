"""The OpenAI-compatible routes, used through the `openai` client library against the real server
(the session's `nano-miles serve`, tiny-random-qwen2 on CPU), and against a trained policy's final/
folder served the way a user would."""
import openai
import pytest
from transformers import AutoTokenizer

from nano_miles.engine.process import start_engine_process

CHAT = [{"role": "system", "content": "You answer briefly."}, {"role": "user", "content": "List the files."}]


@pytest.fixture(scope="module")
def tok(tiny_model_path):
    return AutoTokenizer.from_pretrained(str(tiny_model_path))


def openai_client(server, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=server.api_key, max_retries=0, **kw)


def template_ids(tok, messages) -> list[int]:
    return list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"])


def test_models_lists_the_served_model(engine_server, tiny_model_path):
    [model] = openai_client(engine_server).models.list().data
    assert model.id == str(tiny_model_path) and model.owned_by == "nano-miles"


def test_a_greedy_chat_is_the_chat_template_through_generate(engine_server, engine_client, tok):
    reply = openai_client(engine_server).chat.completions.create(model="any", messages=CHAT, temperature=0,
                                                                 max_tokens=12)
    prompt = template_ids(tok, CHAT)
    raw = engine_client.generate(prompt, {"max_new_tokens": 12, "temperature": 0})
    [choice] = reply.choices
    assert choice.message.role == "assistant" and choice.message.content == raw["text"]
    assert choice.finish_reason == {"length": "length", "stop": "stop"}[raw["meta_info"]["finish_reason"]["type"]]
    assert reply.usage.prompt_tokens == len(prompt)
    assert reply.usage.completion_tokens == raw["meta_info"]["completion_tokens"] <= 12
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens
    assert reply.object == "chat.completion" and reply.id.startswith("chatcmpl-")


def test_n_samples_with_a_seed_are_reproducible(engine_server):
    client = openai_client(engine_server)
    ask = dict(model="any", messages=CHAT, temperature=1.0, top_p=0.95, max_tokens=8, n=3, seed=11)
    first, again = client.chat.completions.create(**ask), client.chat.completions.create(**ask)
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert [c.message.content for c in first.choices] == [c.message.content for c in again.choices]
    assert len({c.message.content for c in first.choices}) > 1  # n samples, not n copies


def test_the_text_ends_before_a_stop_string(engine_server):
    client = openai_client(engine_server)
    free = client.chat.completions.create(model="any", messages=CHAT, temperature=0, max_tokens=24)
    text = free.choices[0].message.content
    assert len(text) >= 6, text
    stop = text[3:6]
    cut = client.chat.completions.create(model="any", messages=CHAT, temperature=0, max_tokens=24, stop=[stop])
    assert cut.choices[0].message.content == text[:text.find(stop)]
    assert cut.choices[0].finish_reason == "stop"
    # the engine stopped there, not at max_tokens with the text cut afterwards
    assert cut.usage.completion_tokens < free.usage.completion_tokens


def test_max_tokens_holds_beside_a_null_max_completion_tokens(engine_server):
    """null means "not given" in OpenAI's API: max_tokens still bounds the completion."""
    reply = openai_client(engine_server).chat.completions.create(model="any", messages=CHAT, temperature=0,
                                                                 max_completion_tokens=None, max_tokens=3)
    assert reply.usage.completion_tokens <= 3


def test_stream_gives_the_same_text_as_server_sent_events(engine_server):
    client = openai_client(engine_server)
    whole = client.chat.completions.create(model="any", messages=CHAT, temperature=0, max_tokens=10)
    chunks = list(client.chat.completions.create(model="any", messages=CHAT, temperature=0, max_tokens=10,
                                                 stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


@pytest.mark.parametrize("extra,needle", [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tools"),
    ({"logprobs": True}, "logprobs"),
    ({"n": 0}, "n must be"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "text parts"),
    ({"max_tokens": 10**6}, "context"),
    ({"stream": True, "stream_options": True}, "stream_options"),  # refused before the stream starts
])
def test_what_it_cannot_do_is_a_clear_400(engine_server, extra, needle):
    with pytest.raises(openai.BadRequestError, match=needle):
        openai_client(engine_server).chat.completions.create(**{"model": "any", "messages": CHAT, **extra})


def test_an_oversized_message_is_refused_by_its_length_before_any_tokenising(engine_server, engine_client):
    """4 MB of text cannot fit a 4096-token context: refused for its length (the answer counts
    characters, not tokens: nothing was tokenised), and the server serves on."""
    context = engine_client.model_info()["max_model_len"]
    huge = [{"role": "user", "content": "a few plain words. " * 200_000}]
    with pytest.raises(openai.BadRequestError) as refused:
        openai_client(engine_server).chat.completions.create(model="any", messages=huge, max_tokens=1)
    message = refused.value.body["message"]
    assert message.startswith("the chat is 3800") and "characters once templated" in message, message
    assert f"a prompt of at most {context} tokens" in message
    assert openai_client(engine_server).chat.completions.create(model="any", messages=CHAT, max_tokens=1).choices


def test_more_characters_than_the_context_has_tokens_can_still_fit(engine_server, engine_client, tok):
    """The length rule refuses only what cannot fit: a token may stand for many characters (here a
    13-character special token), so a chat longer in characters than the context in tokens is served."""
    context = engine_client.model_info()["max_model_len"]
    long = [{"role": "user", "content": "<|endoftext|>" * (context // 4)}]
    assert len(long[0]["content"]) > context and len(template_ids(tok, long)) < context
    reply = openai_client(engine_server).chat.completions.create(model="any", messages=long, max_tokens=1)
    assert reply.usage.prompt_tokens == len(template_ids(tok, long))


def test_the_api_key_is_required(engine_server):
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=engine_server.url + "/v1", api_key="wrong", max_retries=0).models.list()


def test_a_trained_final_folder_serves_openai_clients(tiny_model_path, tmp_path):
    from nano_miles.trainer.checkpoint import export_model
    from nano_miles.trainer.trainer import Trainer, TrainerConfig

    final = export_model(Trainer(TrainerConfig(model=str(tiny_model_path))), str(tiny_model_path), tmp_path / "final")
    with start_engine_process(str(final), dtype="float32", extra_args=("--num-kv-blocks", "64", "--threads", "1",
                                                                      "--served-model-name", "my-policy")) as engine:
        client = openai_client(engine)
        assert [m.id for m in client.models.list().data] == ["my-policy"]
        reply = client.chat.completions.create(model="my-policy", messages=CHAT, max_tokens=4)
    assert reply.model == "my-policy" and reply.usage.completion_tokens <= 4
    assert isinstance(reply.choices[0].message.content, str)
