"""A step's inputs: the scheduler's work, [(seq, new tokens)], laid out as the model's Batch on the
device. Padded rows (a CPU engine, decode steps, CUDA graph buckets) or one packed row (the Triton
prefill kernel). Padding writes into the trash block and reads position 0.
"""
from itertools import chain

import numpy as np

from nano_miles.engine import triton_attention
from nano_miles.engine.model import Batch
from nano_miles.engine.sampling import to_device


def blocks_spanned(work, block_size: int) -> int:
    """The width of the block tables `work` needs: its longest sequence after this step."""
    return -(-max(s.num_computed_tokens + n for s, n in work) // block_size)


def padded(work, block_size: int, trash: int, device, rows: int | None = None, blocks: int | None = None) -> Batch:
    """`rows` x max-new-tokens queries over `blocks`-wide block tables (the defaults: what work needs)."""
    bs, Q, R = block_size, max(n for _, n in work), rows or len(work)
    ids, pos = np.zeros((R, Q), dtype=np.int64), np.zeros((R, Q), dtype=np.int64)
    slots = np.full((R, Q), trash * bs, dtype=np.int64)
    tables = np.full((R, blocks or blocks_spanned(work, bs)), trash, dtype=np.int64)
    last = np.zeros(R, dtype=np.int64)
    if Q == 1:  # a decode step: each row's one token and its blocks laid out at once, not row by row
        _decode_rows(work, bs, ids, pos, slots, tables)
    else:
        for i, (seq, n) in enumerate(work):
            start, table = seq.num_computed_tokens, seq.block_table
            used = (start + n + bs - 1) // bs
            tables[i, :used], last[i] = table[:used], n - 1
            p = np.arange(start, start + n)
            ids[i, :n], pos[i, :n], slots[i, :n] = seq.token_ids[start:start + n], p, tables[i, p // bs] * bs + p % bs
    return Batch(*(to_device(x, device) for x in (ids, pos, slots, tables, last)))


def _decode_rows(work, bs: int, ids, pos, slots, tables) -> None:
    """The first len(work) rows of a step of one new token a sequence (decode), written in a few numpy
    operations: at 256 rows the host's work bounds an overlapped GPU step (docs/design.md)."""
    n = len(work)
    start = np.fromiter((seq.num_computed_tokens for seq, _ in work), np.int64, n)
    used = start // bs + 1  # blocks the sequence spans with its new token
    total = int(used.sum())
    flat = np.fromiter(chain.from_iterable(seq.block_table[:u] for (seq, _), u in zip(work, used.tolist())),
                       np.int64, total)
    row = np.repeat(np.arange(n), used)
    tables[row, np.arange(total) - np.repeat(np.cumsum(used) - used, used)] = flat
    ids[:n, 0] = [seq.token_ids[seq.num_computed_tokens] for seq, _ in work]
    pos[:n, 0] = start
    slots[:n, 0] = tables[np.arange(n), start // bs] * bs + start % bs


def packed(work, block_size: int, trash: int, device) -> Batch:
    """Every sequence's new tokens side by side in one row, cut into tiles of at most TILE_ROWS tokens
    of one sequence for the prefill kernel (model.py, triton_attention.py)."""
    bs, rows = block_size, triton_attention.TILE_ROWS
    T = sum(n for _, n in work)
    ids, pos, slots = (np.empty(T, dtype=np.int64) for _ in range(3))
    tables = np.full((len(work), blocks_spanned(work, bs)), trash, dtype=np.int64)
    last, tiles, at = np.empty(len(work), dtype=np.int64), [], 0
    for i, (seq, n) in enumerate(work):
        start, table = seq.num_computed_tokens, seq.block_table
        used = (start + n + bs - 1) // bs
        tables[i, :used] = table[:used]
        p = np.arange(start, start + n)
        ids[at:at + n], pos[at:at + n], slots[at:at + n] = seq.token_ids[start:start + n], p, tables[i, p // bs] * bs + p % bs
        tiles.extend((i, at + j, min(rows, n - j)) for j in range(0, n, rows))
        at += n
        last[i] = at - 1
    arrays = (ids[None], pos[None], slots[None], tables, last, np.array(tiles, dtype=np.int32))
    return Batch(*(to_device(x, device) for x in arrays))
