"""A step's inputs as the model reads them: each row's tokens, positions, cache slots and block table."""
import torch

from nano_miles.engine import inputs
from nano_miles.engine.sampling import SamplingParams
from nano_miles.engine.scheduler import Sequence

BS, TRASH = 4, 99


def sequence(length: int, computed: int, first_block: int) -> Sequence:
    """A sequence of `length` tokens whose first `computed` are in the cache, its blocks numbered on
    from first_block (as many as its length needs)."""
    seq = Sequence(rid=f"s{first_block}", token_ids=list(range(1000, 1000 + length)), num_prompt_tokens=length,
                   params=SamplingParams())
    seq.block_table = list(range(first_block, first_block + -(-length // BS)))
    seq.num_computed_tokens = computed
    return seq


def test_a_decode_step_lays_out_each_rows_token_slot_and_blocks():
    # one token a row; starts on a block's first slot, in its middle, on its last, and past several blocks
    seqs = [sequence(1, 0, 10), sequence(7, 6, 20), sequence(8, 7, 30), sequence(14, 13, 40)]
    batch = inputs.padded([(s, 1) for s in seqs], BS, TRASH, torch.device("cpu"), rows=6, blocks=5)
    assert batch.input_ids[:, 0].tolist() == [1000, 1006, 1007, 1013, 0, 0]
    assert batch.positions[:, 0].tolist() == [0, 6, 7, 13, 0, 0]
    assert batch.slot_mapping[:, 0].tolist() == [10 * BS, 21 * BS + 2, 31 * BS + 3, 43 * BS + 1, TRASH * BS, TRASH * BS]
    assert batch.block_tables.tolist() == [[10, TRASH, TRASH, TRASH, TRASH], [20, 21, TRASH, TRASH, TRASH],
                                           [30, 31, TRASH, TRASH, TRASH], [40, 41, 42, 43, TRASH]] + [[TRASH] * 5] * 2
    assert batch.last_index.tolist() == [0] * 6


def test_a_prefill_step_lays_out_every_new_token():
    seqs = [sequence(6, 0, 10), sequence(9, 4, 20)]  # the second has its first block cached
    batch = inputs.padded([(seqs[0], 6), (seqs[1], 5)], BS, TRASH, torch.device("cpu"))
    assert batch.input_ids.tolist() == [list(range(1000, 1006)), list(range(1004, 1009)) + [0]]
    assert batch.positions.tolist() == [list(range(6)), list(range(4, 9)) + [0]]
    assert batch.slot_mapping.tolist() == [[40, 41, 42, 43, 44, 45], [84, 85, 86, 87, 88, TRASH * BS]]
    assert batch.block_tables.tolist() == [[10, 11, TRASH], [20, 21, 22]]
    assert batch.last_index.tolist() == [5, 4]
