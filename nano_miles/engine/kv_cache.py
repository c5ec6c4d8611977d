"""Paged KV cache: the tensors, and a block manager with prefix caching.

A block holds `block_size` consecutive tokens of one sequence. A FULL block is identified by a chain
hash of (the previous block's hash, its token ids), so sequences sharing a prefix share blocks
(refcounted). Freed blocks keep their hash until reused, so a later request with the same prefix can
revive them. `flush()` forgets every hash: nothing computed before a weight update is found again.
"""

import ctypes
import mmap
from collections import OrderedDict

import torch

_libc = ctypes.CDLL(None, use_errno=True)


def block_hash(prev_hash: int, token_ids) -> int:
    return hash((prev_hash, tuple(token_ids)))



def auto_num_blocks(config, mc, dtype: torch.dtype, device: torch.device, max_model_len: int) -> int:
    """KV-cache blocks when engine.num_kv_blocks is none (config: the EngineConfig, mc: the ModelConfig):
    enough for max_running_requests full contexts, within kv_cache_memory_fraction of the GPU's free
    memory (less a reserve) or cpu_kv_cache_bytes on CPU."""
    bs = config.block_size
    per_block = 2 * mc.num_layers * bs * mc.num_kv_heads * mc.head_dim * dtype.itemsize  # K and V
    wanted = config.max_running_requests * -(-max_model_len // bs)
    budget = config.cpu_kv_cache_bytes
    if device.type == "cuda":
        # leave room for activations, logits of a full prefill chunk, sampling and CUDA graphs
        reserve = 4 * config.max_num_batched_tokens * mc.vocab_size + (2 << 30)
        budget = int(torch.cuda.mem_get_info(device)[0] * config.kv_cache_memory_fraction) - reserve
    return max(1, min(wanted, budget // per_block))

class KVCache:
    """K and V for every layer: [num_layers, num_blocks + 1, block_size, kv_heads, head_dim].
    The extra last block is the trash block that padded rows write into."""

    def __init__(self, num_layers, num_blocks, block_size, kv_heads, head_dim, dtype, device):
        shape = (num_layers, num_blocks + 1, block_size, kv_heads, head_dim)
        self.k, self.v = torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device)
        self.trash_block = num_blocks

    def drop_pages(self) -> int:
        """Hand the whole pages of a CPU cache back to the kernel (madvise MADV_DONTNEED): they read
        as zeros again, as torch.zeros left them, and come back as generation writes them. Only once
        nothing cached is wanted (flush the prefix cache first). Returns the bytes dropped."""
        dropped = 0
        for t in (self.k, self.v):
            start = t.data_ptr()
            first = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE
            last = (start + t.numel() * t.element_size()) // mmap.PAGESIZE * mmap.PAGESIZE
            if last > first and _libc.madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), 4) != 0:
                raise OSError(ctypes.get_errno(), "madvise(MADV_DONTNEED) failed")
            dropped += max(0, last - first)
        return dropped


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.ref_count = [0] * num_blocks
        self.block_hash = [None] * num_blocks    # hash of the full block's content, or None
        self.block_tokens = [None] * num_blocks  # its token ids, to rule out hash collisions
        self.hash_to_block: dict[int, int] = {}
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))  # LRU first
        self.epoch = 0  # bumped by flush(); sequences from an older epoch never publish hashes

    @property
    def num_free(self) -> int:
        return len(self.free)

    def blocks_needed(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    def _take_free(self) -> int:
        block, _ = self.free.popitem(last=False)
        h = self.block_hash[block]
        if h is not None and self.hash_to_block.get(h) == block:  # its cached content is forgotten
            del self.hash_to_block[h]
        self.block_hash[block] = self.block_tokens[block] = None
        self.ref_count[block] = 1
        return block

    def match_prefix(self, token_ids) -> list[int]:
        """Cached blocks for the longest full-block prefix of token_ids[:-1] (the last token is always
        computed: its logits are needed). Does not take references."""
        blocks, h, usable = [], 0, len(token_ids) - 1
        for start in range(0, usable - usable % self.block_size, self.block_size):
            chunk = token_ids[start:start + self.block_size]
            h = block_hash(h, chunk)
            block = self.hash_to_block.get(h)
            if block is None or self.block_tokens[block] != tuple(chunk):
                break
            blocks.append(block)
        return blocks

    def can_allocate(self, token_ids, reserve: int = 0) -> bool:
        cached = self.match_prefix(token_ids)
        revived = sum(1 for b in cached if self.ref_count[b] == 0)
        return self.blocks_needed(len(token_ids)) - len(cached) + revived + reserve <= self.num_free

    def allocate(self, seq) -> int:
        """Give `seq` blocks for all its tokens, reusing cached prefix blocks. Returns the number of
        tokens whose KV was found in the cache (they count as computed)."""
        cached = self.match_prefix(seq.token_ids)
        for b in cached:
            if self.ref_count[b] == 0:
                del self.free[b]
            self.ref_count[b] += 1
        seq.block_table = list(cached)
        seq.prefix_hash = self.block_hash[cached[-1]] if cached else 0
        seq.num_hashed_blocks = len(cached)
        seq.num_computed_tokens = len(cached) * self.block_size
        seq.cache_epoch = self.epoch
        self.ensure_slots(seq, len(seq.token_ids))  # can_allocate said the blocks are there
        return seq.num_computed_tokens

    def ensure_slots(self, seq, num_tokens: int) -> bool:
        """Make seq's blocks cover num_tokens tokens. False (nothing taken) if out of blocks."""
        need = self.blocks_needed(num_tokens) - len(seq.block_table)
        if need <= 0:  # the common case: the last block has room
            return True
        if need > self.num_free:
            return False
        seq.block_table += [self._take_free() for _ in range(need)]
        return True

    def publish(self, seq) -> None:
        """Register hashes of seq's blocks that are now full and computed."""
        if seq.cache_epoch != self.epoch:
            return
        for i in range(seq.num_hashed_blocks, seq.num_computed_tokens // self.block_size):
            chunk = tuple(seq.token_ids[i * self.block_size:(i + 1) * self.block_size])
            h = seq.prefix_hash = block_hash(seq.prefix_hash, chunk)
            if h not in self.hash_to_block:
                block = seq.block_table[i]
                self.block_hash[block], self.block_tokens[block] = h, chunk
                self.hash_to_block[h] = block
            seq.num_hashed_blocks = i + 1

    def free_seq(self, seq) -> None:
        # Release in reverse so a sequence's tail is recycled before its (more shareable) head.
        for b in reversed(seq.block_table):
            self.ref_count[b] -= 1
            if self.ref_count[b] == 0:
                self.free[b] = None
        seq.block_table = []
        seq.num_computed_tokens = seq.num_hashed_blocks = 0

    def flush(self) -> None:
        self.hash_to_block.clear()
        self.block_hash, self.block_tokens = [None] * self.num_blocks, [None] * self.num_blocks
        self.epoch += 1
