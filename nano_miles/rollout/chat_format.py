"""ChatFormat: the chat-template knowledge the rollout needs at the token level: the prompt ids, the
stop tokens, and the observation turn encoded on its own (TITO: a rollout never re-encodes its history;
see episode.py and tests/nano_miles/rollout/test_tito.py).

The observation turn is everything the template puts between the end of the model's text and the start
of the next assistant text: (close the assistant turn) + tool turn + next assistant header. It is found
once by rendering a conversation with marker strings and cutting around them.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ChatFormat:
    tokenizer: object
    stop_ids: list[int] = field(default_factory=list)
    tool_role: str = "tool"
    obs_head: str = ""        # before the tool output, including the assistant turn's closing text
    obs_tail: str = ""        # after it, through the next assistant header
    close_text: str = ""      # text that closes an assistant turn (the stop token), part of obs_head
    close_id: int | None = None  # its token id: when the model's output ends with it, it is not repeated
    added_texts: list[str] = field(default_factory=list, repr=False)  # strings the tokenizer maps to one id

    def __post_init__(self):
        tok = self.tokenizer
        if not getattr(tok, "chat_template", None):
            raise ValueError("the tokenizer has no chat template; OpenShellEnv prompts need one")
        stop = {tok.eos_token_id} if tok.eos_token_id is not None else set()
        for t in ("<|im_end|>", "<|eot_id|>", "<|endoftext|>"):
            i = tok.convert_tokens_to_ids(t)
            if isinstance(i, int) and i >= 0 and i != tok.unk_token_id and t in tok.get_vocab():
                stop.add(i)
        self.stop_ids = sorted(stop)
        self.added_texts = [t.content for t in tok.added_tokens_decoder.values()]
        act, obs = "@@ACTION@@", "@@OBSERVATION@@"
        turns = [{"role": "user", "content": "q"}, {"role": "assistant", "content": act},
                 {"role": "tool", "content": obs}]
        probe = self.render(turns, add_generation_prompt=True)
        # Templates like Qwen2.5's render tool turns inside <tool_response> tags; plain ChatML ones
        # would say role "tool", which a model trained on Qwen's format has never seen: use a user
        # turn and wrap the output ourselves.
        if "<tool_response>" not in probe:
            self.tool_role = "user"
            probe = self.render(turns, add_generation_prompt=True)
        after = probe[probe.index(act) + len(act):]
        self.obs_head, self.obs_tail = after[:after.index(obs)], after[after.index(obs) + len(obs):]
        # The stop token that closes a turn: the eos, or another stop id (a base model's tokenizer, whose
        # eos is <|endoftext|>, ends ChatML turns with <|im_end|>)
        for i in [tok.eos_token_id, *self.stop_ids]:
            text = tok.convert_ids_to_tokens(i) if i is not None else ""
            if text and self.obs_head.startswith(text):
                self.close_text, self.close_id = text, i
                break

    def render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        """The conversation as text, tool messages in this template's tool form."""
        if self.tool_role == "user":
            messages = [{"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"}
                        if m["role"] == "tool" else m for m in messages]
        return self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        return self.encode(self.render(messages, add_generation_prompt=True))

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def observation_ids(self, content: str, last_model_id: int | None) -> list[int]:
        """The observation turn, encoded as one string (the ids the template would give the output),
        except that an added token's text in the output ('<|im_end|>' printed by a command) is encoded
        with special tokens split, so a command cannot forge a turn boundary."""
        head = self.obs_head
        if self.close_id is not None and last_model_id == self.close_id:
            head = head[len(self.close_text):]  # the model's own stop token already closed the turn
        # For a "user" tool role the <tool_response> tags were rendered around the marker, so they
        # are already in head and tail.
        if not any(t in content for t in self.added_texts):
            return self.encode(head + content + self.obs_tail)
        split = self.tokenizer.encode(content, add_special_tokens=False, split_special_tokens=True)
        return self.encode(head) + split + self.encode(self.obs_tail)
