"""CUDA graphs for decode steps: replaying a captured graph removes the launch cost of a step's many
small kernels. One graph per (batch-size bucket, block-table-width bucket), captured lazily over static
input buffers; the engine pads a decode batch to its bucket (padded rows write into the trash block).
All graphs share one memory pool and one logits buffer: replayed one at a time, the logits consumed
before the next replay.
"""

import torch

from nano_miles.engine.model import Batch


def batch_size_buckets(max_bs: int) -> list:
    sizes = [1, 2, 4, 8, 16, 24, 32] + list(range(48, max_bs + 1, 16))
    return sorted({s for s in sizes if s < max_bs} | {max_bs})


class DecodeGraphs:
    def __init__(self, engine):
        self.engine = engine
        self.bs_buckets = batch_size_buckets(engine.config.max_running_requests)
        self.max_blocks = engine.blocks.blocks_needed(engine.max_model_len)
        max_bs, dev = self.bs_buckets[-1], engine.device
        trash = engine.kv.trash_block
        self.input_ids = torch.zeros(max_bs, 1, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(max_bs, 1, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.full((max_bs, 1), trash * engine.config.block_size, dtype=torch.int64, device=dev)
        self.block_tables = torch.full((max_bs, self.max_blocks), trash, dtype=torch.int64, device=dev)
        self.last_index = torch.zeros(max_bs, dtype=torch.int64, device=dev)
        self.logits = torch.empty(max_bs, engine.vocab_size, dtype=torch.float32, device=dev)
        self.graphs: dict = {}
        self.pool = None

    def bucket(self, batch_size: int, num_blocks: int):
        """(rows, blocks) to pad a decode batch to, or None if it is too large for a graph."""
        if batch_size > self.bs_buckets[-1] or num_blocks > self.max_blocks:
            return None
        rows = next(b for b in self.bs_buckets if b >= batch_size)
        return rows, min(max(8, 1 << (num_blocks - 1).bit_length()), self.max_blocks)  # a power of two

    def _static(self, rows, blocks) -> Batch:
        return Batch(self.input_ids[:rows], self.positions[:rows], self.slot_mapping[:rows],
                     self.block_tables[:rows, :blocks], self.last_index[:rows])

    def run(self, batch: Batch) -> torch.Tensor:
        rows, blocks = batch.block_tables.shape
        key = (rows, blocks)
        if key not in self.graphs:
            self.graphs[key] = self._capture(rows, blocks)
        static = self._static(rows, blocks)
        for name in ("input_ids", "positions", "slot_mapping", "block_tables"):  # last_index: 0 in every decode row
            getattr(static, name).copy_(getattr(batch, name))
        self.graphs[key].replay()
        return self.logits[:rows]

    def _capture(self, rows, blocks) -> torch.cuda.CUDAGraph:
        eng = self.engine
        static = self._static(rows, blocks)  # still padding values: warm-up writes only into the trash block
        static.input_ids.zero_()
        static.positions.zero_()
        static.slot_mapping.fill_(eng.kv.trash_block * eng.config.block_size)
        static.block_tables.fill_(eng.kv.trash_block)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                eng.decode_forward(static, out=self.logits[:rows])
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            eng.decode_forward(static, out=self.logits[:rows])
        if self.pool is None:
            self.pool = graph.pool()
        return graph
