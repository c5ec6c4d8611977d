"""Continuous batching: which sequences run in the next forward, and with how many tokens.

A step is a PREFILL step (uncomputed tokens, chunked under a token budget; with a packed forward the
decoding sequences ride in it too, as in vLLM and SGLang) or a DECODE step. When decode runs out of
blocks, the latest admitted sequence is preempted: its blocks freed, recomputed later, tokens kept.
"""

from collections import deque
from dataclasses import dataclass, field

from nano_miles.engine.kv_cache import BlockManager


@dataclass(eq=False)  # identity semantics: `seq in running` must not compare token lists
class Sequence:
    rid: str
    token_ids: list            # prompt + generated so far
    num_prompt_tokens: int
    params: object             # SamplingParams
    return_logprob: bool = True
    output_logprobs: list = field(default_factory=list)
    generator: object = None   # torch.Generator for a per-request sampling_seed
    # cache state (owned by BlockManager)
    block_table: list = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0     # prompt tokens served from the prefix cache at first admission
    num_hashed_blocks: int = 0
    prefix_hash: int = 0
    cache_epoch: int = -1
    admitted: bool = False
    finished: bool = False
    # overlap_schedule (engine.py): the launched step whose token is this sequence's last, and its row there
    pending_step: object = None
    pending_row: int = 0

    @property
    def output_ids(self):
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_uncomputed(self):
        return len(self.token_ids) - self.num_computed_tokens


class Scheduler:
    def __init__(self, blocks: BlockManager, max_running: int, max_batched_tokens: int, budget_pads_rows: bool = True,
                 mix_decode: bool = False, continuous_decode_steps: int = 1):
        self.blocks, self.max_running, self.max_batched_tokens = blocks, max_running, max_batched_tokens
        # The budget bounds the padded rows (rows x longest chunk: what a CPU forward costs) or the
        # tokens alone (a GPU, where fewer, fuller steps win); docs/design.md has the figures.
        self.budget_pads_rows = budget_pads_rows
        self.mix_decode = mix_decode  # decoding sequences join prefill steps (a packed forward only)
        # SGLang's num_continuous_decode_steps: after a prefill step, N - 1 decode steps run before the
        # next one while sequences decode, so turns that arrive meanwhile share one prefill step.
        self.continuous_decode_steps, self.decode_steps_due = continuous_decode_steps, 0
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self):
        """Returns ("prefill" | "decode", [(seq, num_tokens)]) or (None, []) when idle."""
        self._admit()
        decoding = self.decode_steps_due > 0 and any(seq.num_uncomputed == 1 for seq in self.running)
        prefill = [] if decoding else self._prefill()
        if prefill:
            self.decode_steps_due = self.continuous_decode_steps - 1
            return "prefill", self._decoding_beside(prefill) + prefill if self.mix_decode else prefill
        self.decode_steps_due -= 1
        decode, preempted = [], set()
        for seq in list(self.running):
            if seq in preempted:  # preempted below while making room for an earlier one
                continue
            while not self.blocks.ensure_slots(seq, len(seq.token_ids)):
                victim = self.running[-1]
                self.preempt(victim)
                preempted.add(victim)
                if victim is seq:
                    break
            else:
                decode.append((seq, 1))
        return ("decode", decode) if decode else (None, [])

    def _decoding_beside(self, prefill) -> list:
        """The decoding sequences that can join a prefill step: one token each, outside the token budget
        (at most max_running of them). One the cache has no block for waits for a decode step, where
        preemption makes room."""
        chunked = {id(seq) for seq, _ in prefill}
        return [(seq, 1) for seq in self.running if seq.num_uncomputed == 1 and id(seq) not in chunked
                and self.blocks.ensure_slots(seq, len(seq.token_ids))]

    def _prefill(self) -> list:
        """The next prefill step. With budget_pads_rows, the oldest sequence with tokens to compute sets
        the row length (its chunk, at most the budget), and the others whose tokens fit in it join while
        rows x length stays within the budget. Longer ones wait for a step they lead: a 40-token
        observation in the row of a 1,500-token prompt would cost the forward 37 times its work."""
        todo = [seq for seq in self.running if seq.num_uncomputed > 1]
        if not todo:
            return []
        if not self.budget_pads_rows:  # the tokens alone, in admission order, the last one chunked
            step, budget = [], self.max_batched_tokens
            for seq in todo:
                if budget <= 0:
                    break
                step.append((seq, min(seq.num_uncomputed, budget)))
                budget -= step[-1][1]
            return step
        length = min(todo[0].num_uncomputed, self.max_batched_tokens)
        step = [(todo[0], length)]
        for seq in todo[1:]:
            if (len(step) + 1) * length > self.max_batched_tokens:
                break
            if seq.num_uncomputed <= length:
                step.append((seq, seq.num_uncomputed))
        return step

    def _admit(self):
        while self.waiting and len(self.running) < self.max_running:
            seq = self.waiting[0]
            # Keep one free block per running sequence so admitting does not force an immediate preemption.
            if not self.blocks.can_allocate(seq.token_ids, reserve=len(self.running)):
                if not self.running and not self.blocks.can_allocate(seq.token_ids):
                    raise RuntimeError(
                        f"request {seq.rid!r} needs {self.blocks.blocks_needed(len(seq.token_ids))} KV blocks, "
                        f"the cache has {self.blocks.num_blocks}")
                break
            self.waiting.popleft()
            cached = self.blocks.allocate(seq)
            if not seq.admitted:  # a preempted sequence keeps its first admission's figure
                seq.admitted = True
                seq.num_cached_tokens = cached
            self.running.append(seq)

    def preempt(self, seq: Sequence):
        self.num_preemptions += 1
        self.running.remove(seq)
        self.blocks.free_seq(seq)
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence):
        if seq in self.running:
            self.running.remove(seq)
            self.blocks.free_seq(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
