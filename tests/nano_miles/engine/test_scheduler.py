"""Which sequences the next forward runs (nano_miles/engine/scheduler.py), over a real block manager."""
from nano_miles.engine.kv_cache import BlockManager
from nano_miles.engine.scheduler import Scheduler, Sequence


def waiting(scheduler: Scheduler, *lengths: int) -> list[Sequence]:
    seqs = [Sequence(f"r{i}", list(range(10 + i * 1000, 10 + i * 1000 + n)), n, params=None)
            for i, n in enumerate(lengths)]
    scheduler.waiting.extend(seqs)
    return seqs


def test_a_prefill_step_pads_no_row_past_the_budget():
    """A forward pads each row to the step's longest chunk. The oldest sequence sets that length; the
    short ones that fit in it join while rows x length stays within the budget; a longer one waits for
    a step it leads instead of making every short row as long as itself."""
    s = Scheduler(BlockManager(512, 16), max_running=16, max_batched_tokens=256)
    short_a, long_one, short_b, short_c = waiting(s, 40, 900, 30, 64)
    kind, step = s.schedule()
    assert kind == "prefill"
    assert [(seq.rid, n) for seq, n in step] == [("r0", 40), ("r2", 30)]  # r3's 64 tokens do not fit in 40
    assert len(step) * max(n for _, n in step) <= 256
    for seq, n in step:
        seq.num_computed_tokens += n
    kind, step = s.schedule()
    assert [(seq.rid, n) for seq, n in step] == [("r1", 256)]  # chunked at the budget, alone
    long_one.num_computed_tokens += 256
    _, step = s.schedule()
    assert [(seq.rid, n) for seq, n in step] == [("r1", 256)]  # r3 (64) would make 2 x 256 rows


def test_the_rows_of_a_step_stop_at_the_budget():
    s = Scheduler(BlockManager(512, 16), max_running=64, max_batched_tokens=100)
    waiting(s, *[20] * 8)
    _, step = s.schedule()
    assert [n for _, n in step] == [20] * 5  # 5 x 20 = 100; the sixth row would pad past it


def test_on_a_gpu_the_budget_counts_tokens_alone():
    """A GPU step costs more than its padding: sequences join in admission order until the tokens
    fill the budget, the last one chunked to what is left."""
    s = Scheduler(BlockManager(512, 16), max_running=16, max_batched_tokens=256, budget_pads_rows=False)
    waiting(s, 40, 900, 30, 64)
    kind, step = s.schedule()
    assert kind == "prefill"
    assert [(seq.rid, n) for seq, n in step] == [("r0", 40), ("r1", 216)]
    for seq, n in step:
        seq.num_computed_tokens += n
    _, step = s.schedule()
    assert [(seq.rid, n) for seq, n in step] == [("r1", 256)]


def test_with_a_packed_forward_decoding_sequences_ride_in_a_prefill_step():
    """A new turn's prefill stalls nobody: every decoding sequence computes its newest token in the
    same step (outside the token budget), while a sequence still in its prompt keeps its chunk."""
    s = Scheduler(BlockManager(512, 16), max_running=16, max_batched_tokens=256, budget_pads_rows=False,
                  mix_decode=True)
    first, second = waiting(s, 40, 30)
    _, step = s.schedule()
    for seq, n in step:
        seq.num_computed_tokens += n
        seq.token_ids.append(7)  # each sampled a token: one uncomputed token, decoding
    newcomer, = waiting(s, 300)
    kind, step = s.schedule()
    assert kind == "prefill"
    assert [(seq, n) for seq, n in step] == [(first, 1), (second, 1), (newcomer, 256)]
    assert all(len(seq.block_table) * 16 >= len(seq.token_ids) for seq in (first, second))  # their slots exist


def test_without_a_packed_forward_a_prefill_step_holds_prefill_alone():
    s = Scheduler(BlockManager(512, 16), max_running=16, max_batched_tokens=256, budget_pads_rows=False)
    waiting(s, 40)
    _, step = s.schedule()
    for seq, n in step:
        seq.num_computed_tokens += n
        seq.token_ids.append(7)
    waiting(s, 300)
    kind, step = s.schedule()
    assert kind == "prefill" and [n for _, n in step] == [256]


def test_with_continuous_decode_steps_turns_that_arrive_meanwhile_share_one_prefill_step():
    """num_continuous_decode_steps=3: after a prefill step two decode steps run while sequences decode,
    so two turns arriving in them are prefilled together in the third; with nothing decoding a
    prefill never waits, and the default (1) prefills at once."""
    def run(n):
        s = Scheduler(BlockManager(512, 16), max_running=16, max_batched_tokens=256, budget_pads_rows=False,
                      mix_decode=True, continuous_decode_steps=n)
        first, = waiting(s, 40)
        kinds = []
        for arrivals in ([], [30], [20], []):
            waiting(s, *arrivals)
            kind, step = s.schedule()
            kinds.append((kind, sorted(n for seq, n in step if n > 1)))
            for seq, n in step:
                seq.num_computed_tokens += n
                seq.token_ids.append(7)  # each sampled a token: decoding
        return kinds
    assert run(3) == [("prefill", [40]), ("decode", []), ("decode", []), ("prefill", [20, 30])]
    assert run(1) == [("prefill", [40]), ("prefill", [30]), ("prefill", [20]), ("decode", [])]
    s = Scheduler(BlockManager(512, 16), max_running=16, max_batched_tokens=256, continuous_decode_steps=3)
    s.decode_steps_due = 2
    waiting(s, 50)
    assert s.schedule()[0] == "prefill"  # nothing decoding: no reason to hold it back
