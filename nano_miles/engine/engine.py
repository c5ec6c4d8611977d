"""Engine: the in-process API the HTTP server wraps (docs/design.md, "Engine contract"): add_request,
then step() while has_unfinished(). Single-threaded by design: the caller serialises
add/step/abort/load_weights.
"""
import os
import time
from dataclasses import dataclass

import torch

from nano_miles.dtypes import DTYPE_NAMES, resolve_dtype
from nano_miles.engine import batch_invariant, inputs, triton_attention
from nano_miles.engine.cuda_graph import DecodeGraphs
from nano_miles.engine.flat_params import FlatParameters, wait_for_copies
from nano_miles.engine.kv_cache import BlockManager, KVCache, auto_num_blocks
from nano_miles.engine.model import CausalLM, ModelConfig, load_safetensors, skip_weight_name
from nano_miles.engine.sampling import SamplingParams, compiled_draws, sample, to_device
from nano_miles.engine.scheduler import Scheduler, Sequence

__all__ = ["Engine", "EngineConfig", "SamplingParams", "FinishedRequest"]


@dataclass
class EngineConfig:
    """The engine's knobs; `nano-miles serve` takes them as the engine.* config keys."""
    model: str = ""                     # the model: a local HF folder (serve also takes a registered name or a hub id)
    device: str = "cpu"                 # cpu | cuda | cuda:N
    dtype: str = "auto"                 # float32 | bfloat16 | float16 | auto (bfloat16 on GPU, float32 on CPU)
    max_running_requests: int = 256     # requests decoded at once (more wait in the queue)
    block_size: int = 16                # tokens per KV-cache block (the prefix cache's granularity)
    num_kv_blocks: int | None = None    # KV-cache blocks; none = kv_cache_memory_fraction of free GPU memory, or cpu_kv_cache_bytes
    max_model_len: int | None = None    # context length; none = the model's max_position_embeddings, capped at 32768
    max_num_batched_tokens: int = 8192  # prefill token budget of one step (longer prompts are chunked)
    num_continuous_decode_steps: int = 1  # decode steps run back to back before a waiting prefill is taken (SGLang's); 1 = prefill at once
    cuda_graph: bool = True             # capture decode steps as CUDA graphs (GPU only)
    enable_torch_compile: bool = False  # torch.compile the decode forward (fused norms, RoPE, SiLU*mul), under the CUDA graphs; normal mode only
    overlap_schedule: bool = False      # SGLang's overlap scheduler: step n+1 is scheduled and launched while step n runs on the GPU
    attention_backend: str = "auto"     # decode attention: torch (gather + SDPA) | triton (paged kernel, GPU) | auto
    packed_prefill: bool | None = None  # prefill steps packed (no padding), decoding sequences riding in them; none = wherever the triton backend runs in normal mode
    kv_cache_memory_fraction: float = 0.85  # share of the GPU's free memory for the KV cache (ignored on CPU)
    cpu_kv_cache_bytes: int = 2 << 30   # KV-cache bytes on CPU when num_kv_blocks is none
    seed: int = 0                       # seed of the sampling generator (requests may bring their own sampling_seed)
    true_on_policy: bool = False        # batch-invariant kernels: log-probs equal a true on-policy trainer's bit for bit

    def __post_init__(self):
        if self.dtype not in DTYPE_NAMES:
            raise ValueError(f"engine.dtype must be one of {list(DTYPE_NAMES)}, got {self.dtype!r}")
        try:
            device = torch.device(self.device)
        except (RuntimeError, ValueError):
            device = torch.device("meta")
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"engine.device must be cpu, cuda or cuda:N, got {self.device!r}")
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"engine.device={self.device}: this torch ({torch.__version__}) sees no CUDA GPU; "
                             "use --device cpu, or install a CUDA build of torch on a machine with a GPU")
        if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"engine.device={self.device}: only {torch.cuda.device_count()} CUDA device(s) are visible")
        if self.attention_backend not in ("auto", "torch", "triton"):
            raise ValueError(f"engine.attention_backend must be auto, torch or triton, got {self.attention_backend!r}")
        if self.packed_prefill and (self.true_on_policy or self.attention_backend == "torch"):
            raise ValueError("engine.packed_prefill needs the triton attention backend and normal mode "
                             "(true on-policy serves every row through its batch-invariant loop)")
        if self.enable_torch_compile and self.true_on_policy:
            raise ValueError("engine.enable_torch_compile needs normal mode: fused kernels are not batch-invariant")
        if not 0 < self.kv_cache_memory_fraction <= 1:
            raise ValueError(f"engine.kv_cache_memory_fraction must be in (0, 1], got {self.kv_cache_memory_fraction}")
        for key in ("max_running_requests", "block_size", "max_num_batched_tokens", "num_kv_blocks", "max_model_len",
                    "num_continuous_decode_steps"):
            if getattr(self, key) is not None and getattr(self, key) < 1:
                raise ValueError(f"engine.{key} must be >= 1, got {getattr(self, key)}")


@dataclass
class FinishedRequest:
    rid: str
    output_ids: list
    output_logprobs: list | None
    finish_reason: dict  # {"type": "stop", "matched": id or string} | {"type": "length", "length": n} | {"type": "abort", "message": s, "status_code": None or 500}
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


class Engine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.device = torch.device(config.device)
        if self.device.type == "cuda":
            if self.device.index is None:  # "cuda" means the current device; pin it so graphs/generators agree
                self.device = torch.device("cuda", torch.cuda.current_device())
            torch.cuda.set_device(self.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.model_config = mc = ModelConfig.from_pretrained(config.model)
        self.vocab_size, self.eos_token_ids = mc.vocab_size, list(mc.eos_token_ids)
        self.max_model_len = min(config.max_model_len or 32768, mc.max_position_embeddings)
        self.weight_version = "default"
        self.tokenizer = None
        if any(os.path.exists(os.path.join(config.model, f)) for f in ("tokenizer.json", "tokenizer_config.json")):
            from transformers import AutoTokenizer  # deferred: heavy, and a folder may have no tokenizer
            self.tokenizer = AutoTokenizer.from_pretrained(config.model)
        self._token_texts: dict[int, str] = {}  # token id -> its text alone (stop strings)
        # built on meta and given uninitialised memory: load_safetensors writes every parameter (it raises
        # on one missing), so a random init would be thrown away (seconds of CPU for 0.5B)
        with torch.device("meta"):
            self.model = CausalLM(mc).to(self.dtype)
        self.model.to_empty(device=self.device)
        if config.true_on_policy:
            self.model.use_batch_invariant_ops()
        load_safetensors(self.model, config.model)
        self.model.eval().requires_grad_(False)
        self.weight_specs = {n: (tuple(p.shape), p.dtype) for n, p in self.model.named_parameters()}
        # One flat buffer behind every parameter, so a matching weight-update bucket is one copy.
        self.flat_params = FlatParameters(self.model) if FlatParameters.packable(self.model) else None
        if self.flat_params is not None and self.device.type == "cuda":
            torch.cuda.empty_cache()  # the unpacked copies are free now; let the KV-cache sizing see it
        self.model.init_rope(self.max_model_len, self.device, self.dtype)
        self.model.refresh_lm_head_fp32()
        D = mc.head_dim
        usable = triton_attention.available(self.device) and D >= 16 and D & (D - 1) == 0
        if config.attention_backend == "triton" and not usable:
            raise ValueError("attention_backend='triton' needs triton, a CUDA device and a power-of-two head_dim >= 16")
        self.attention_backend = "triton" if usable and config.attention_backend != "torch" else "torch"
        if self.attention_backend == "triton":
            self.model.decode_attention = triton_attention.paged_decode_attention
        if config.packed_prefill and self.attention_backend != "triton":
            raise ValueError("engine.packed_prefill needs triton, a CUDA device and a power-of-two head_dim >= 16")
        # On by default where it can run: the ninth recipe's loop step took half the time with it (docs/design.md)
        self.packed_prefill = config.packed_prefill if config.packed_prefill is not None else \
            self.attention_backend == "triton" and not config.true_on_policy
        if self.packed_prefill:
            self.model.prefill_attention = triton_attention.packed_prefill_attention
        self.num_kv_blocks = config.num_kv_blocks or auto_num_blocks(config, mc, self.dtype, self.device, self.max_model_len)
        self.kv = KVCache(mc.num_layers, self.num_kv_blocks, config.block_size, mc.num_kv_heads, mc.head_dim,
                          self.dtype, self.device)
        self.blocks = BlockManager(self.num_kv_blocks, config.block_size)
        self.scheduler = Scheduler(self.blocks, config.max_running_requests, config.max_num_batched_tokens,
                                   budget_pads_rows=self.device.type == "cpu", mix_decode=self.packed_prefill,
                                   continuous_decode_steps=config.num_continuous_decode_steps)
        self.seqs: dict[str, Sequence] = {}
        self.pending: list[FinishedRequest] = []  # aborted requests, returned by the next step()
        self._inflight: _Launched | None = None   # overlap_schedule: the step launched, its tokens not yet read
        self.busy_s = {"prefill": 0.0, "decode": 0.0}  # seconds spent in step() per phase, since start
        self.generator = torch.Generator(device=self.device).manual_seed(config.seed)
        # dynamic: one compiled graph serves every batch-size and block-table bucket
        self._decode_hidden = torch.compile(self.model.last_hidden, dynamic=True) if config.enable_torch_compile \
            else self.model.last_hidden
        self._fused_sample = compiled_draws() if config.enable_torch_compile else None
        self.graphs = DecodeGraphs(self) if config.cuda_graph and self.device.type == "cuda" else None

    # ---- requests -------------------------------------------------------------------------------
    def add_request(self, rid: str, input_ids: list, params: SamplingParams, return_logprob: bool = True):
        """Input is validated where it comes in (protocol.py); the asserts guard in-process calls. ValueError
        for a request that can never fit the KV cache (only the engine knows its size)."""
        assert isinstance(rid, str) and rid and rid not in self.seqs, f"rid {rid!r} is empty or already running"
        assert input_ids and all(isinstance(t, int) and 0 <= t < self.vocab_size for t in input_ids), \
            "input_ids must be token ids in [0, vocab_size)"
        assert params.max_new_tokens >= 1 and params.temperature >= 0 and 0 < params.top_p <= 1, params
        assert (params.top_k == -1 or params.top_k >= 0) and 0 <= params.min_new_tokens <= params.max_new_tokens, params
        assert all(0 <= t < self.vocab_size for t in params.stop_token_ids), "stop_token_ids outside the vocabulary"
        assert not params.stop or self.tokenizer is not None, "stop strings need the model folder's tokenizer"
        total = len(input_ids) + params.max_new_tokens
        assert total <= self.max_model_len, f"{total} tokens exceed the context length {self.max_model_len}"
        if (needed := self.blocks.blocks_needed(total)) > self.num_kv_blocks:
            raise ValueError(f"request needs {needed} KV blocks; the cache has {self.num_kv_blocks}")
        seq = Sequence(rid=rid, token_ids=list(input_ids), num_prompt_tokens=len(input_ids), params=params,
                       return_logprob=return_logprob)
        if params.sampling_seed is not None:
            seq.generator = torch.Generator(device=self.device).manual_seed(params.sampling_seed)
        self.seqs[rid] = seq
        self.scheduler.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.pending) or self._inflight is not None or self.scheduler.has_unfinished()

    def drain(self) -> list:
        """overlap_schedule: wait for the step in flight and take in its tokens; the requests it finished
        (with any aborted ones). Pause, weight loads and aborts drain first: no token is left unknown."""
        launched, self._inflight = self._inflight, None
        if launched is not None:
            self.pending += self._complete(launched)
        finished, self.pending = self.pending, []
        return finished

    def abort_request(self, rid: str, message: str = "aborted by request", status_code: int | None = None) -> bool:
        """status_code (SGLang's field): None when asked for, 500 when the engine failed."""
        self.pending = self.drain()
        seq = self.seqs.get(rid)
        if seq is None:
            return False
        self.scheduler.finish(seq)
        self.pending.append(self._finish(seq, {"type": "abort", "message": message, "status_code": status_code}))
        return True

    def abort_all(self, message: str = "aborted by request", status_code: int | None = None) -> int:
        return sum(self.abort_request(rid, message, status_code) for rid in list(self.seqs))

    # ---- weights ---------------------------------------------------------------------------------
    def load_weights(self, named_tensors) -> None:
        """Copy (name, tensor) pairs into the parameters (casting floats), then flush the KV cache; the
        asserts all run before the first copy. Returns once the copies are complete (the sources may be
        another process's GPU memory)."""
        params, todo = dict(self.model.named_parameters()), []
        for name, t in named_tensors:
            if name not in params and skip_weight_name(name, self.model_config):
                continue
            p = params.get(name)
            assert p is not None, f"unknown weight name {name!r}"
            assert isinstance(t, torch.Tensor) and t.is_floating_point() and t.shape == p.shape, \
                f"weight {name!r} is not a float tensor of shape {tuple(p.shape)}"
            todo.append((p, t))
        with torch.no_grad():
            for p, t in todo:
                p.copy_(t)
        wait_for_copies(self.device, [t for _, t in todo])
        self.flush_cache()

    def load_flat(self, start: int, buffer: torch.Tensor) -> None:
        """Apply a bucket that FlatParameters.match found equal to bytes [start, start + len) of
        flat_params with ONE copy."""
        self.flat_params.load(start, buffer)
        self.flush_cache()

    def flush_cache(self) -> None:
        self.pending = self.drain()  # (load_weights and load_flat end here: the step in flight used the old weights)
        self.blocks.flush()

    # ---- the step -------------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list:
        """Schedule and run one forward; the requests that finished. With overlap_schedule the step is
        launched before the one in flight is read back, so the host's work for step n+1 (scheduling,
        inputs, and taking in step n's tokens) runs while the GPU computes: a decode row's input token is
        then the previous step's, gathered on the device, and a request is found finished one step late
        (its extra row is dropped). Without it, a step is launched and read back at once."""
        t0 = time.perf_counter()
        finished, self.pending = self.pending, []
        self.model.refresh_lm_head_fp32()  # a no-op unless the weights changed since the last step
        kind, work = self.scheduler.schedule()
        previous, self._inflight = self._inflight, None
        if previous is not None and kind != "decode":  # a prefill step reads its tokens from the host
            finished += self._complete(previous)
            previous, work = None, [(seq, n) for seq, n in work if not seq.finished]
        # a row whose length limit its in-flight token reaches would run past its blocks and positions
        work = [(seq, n) for seq, n in work if not self._length_reached(seq)]
        if not work:
            return finished + (self._complete(previous) if previous is not None else [])
        launched = self._launch(kind, work, previous)
        if previous is not None:
            finished += self._complete(previous)
        if self.config.overlap_schedule:
            self._inflight = launched
        else:
            finished += self._complete(launched)
        self.busy_s[kind] += time.perf_counter() - t0  # busy seconds per phase, in every /generate answer (busy_s)
        return finished

    def _launch(self, kind, work, previous) -> "_Launched":
        """Run the forward and the draw of `work`; each sampling row gets a placeholder token for now."""
        bs, trash = self.config.block_size, self.kv.trash_block
        pad = self.graphs.bucket(len(work), inputs.blocks_spanned(work, bs)) if kind == "decode" and self.graphs else None
        batch = inputs.packed(work, bs, trash, self.device) if kind == "prefill" and self.packed_prefill else \
            inputs.padded(work, bs, trash, self.device, *(pad or ()))
        if previous is not None:  # rows whose input token is the one in flight: taken on the device
            rows = [(i, seq.pending_row) for i, (seq, _) in enumerate(work) if seq.pending_step is previous]
            if rows:
                dst, src = to_device(rows, self.device, torch.int64).unbind(1)
                batch.input_ids[dst, 0] = previous.tokens[src]
        if pad is not None:
            logits = self.graphs.run(batch)[:len(work)]
        elif kind == "prefill" and self.packed_prefill:
            logits = self.model(batch, self.kv.k, self.kv.v)
        elif kind == "decode":
            logits = self.decode_forward(batch)
        else:
            logits = self.model(batch, self.kv.k, self.kv.v).float()
        rows = []
        for i, (seq, n) in enumerate(work):
            seq.num_computed_tokens += n
            if previous is None or seq.pending_step is not previous:  # (else its input token is not known yet)
                self.blocks.publish(seq)  # now, so that a request admitted at the next step finds them
            if seq.num_computed_tokens == len(seq.token_ids):
                rows.append(i)  # its prompt is done: it samples a token
        seqs = [work[i][0] for i in rows]
        launched = _Launched([seq for seq, _ in work], seqs, [len(seq.token_ids) for seq in seqs])
        if not rows:
            return launched
        launched.tokens, logprobs = self._sample(logits if len(rows) == len(work) else
                                                 logits[to_device(rows, self.device)], seqs)
        out = torch.stack([launched.tokens.double(), logprobs.double()])
        if self.device.type == "cuda" and self.config.overlap_schedule:
            launched.out = torch.empty(out.shape, dtype=out.dtype, pin_memory=True).copy_(out, non_blocking=True)
            launched.ready = torch.cuda.Event()
            launched.ready.record()
        else:
            launched.out = out.cpu()  # the step's one host sync
        for j, seq in enumerate(seqs):
            seq.token_ids.append(-1)  # until _complete: an id no embedding takes, should one ever read it
            if seq.return_logprob:
                seq.output_logprobs.append(0.0)
            seq.pending_step, seq.pending_row = launched, j
        return launched

    def _complete(self, launched: "_Launched") -> list:
        """Take in a launched step's tokens: placeholders filled, full blocks published to the prefix
        cache, finished requests (cut at their last token) returned."""
        if launched.ready is not None:
            launched.ready.synchronize()
        tokens, logprobs = ([int(x) for x in launched.out[0].tolist()], launched.out[1].tolist()) if launched.seqs \
            else ([], [])
        rows = [(seq, at, tok, lp) for seq, at, tok, lp in zip(launched.seqs, launched.at, tokens, logprobs)
                if not seq.finished]  # one that ended at the step before ran this row on its last token for nothing
        for seq, at, tok, lp in rows:
            seq.token_ids[at] = tok
            if seq.return_logprob:
                seq.output_logprobs[at - seq.num_prompt_tokens] = lp
            if seq.pending_step is launched:
                seq.pending_step = None
        for seq in launched.work:
            if not seq.finished:  # finishing too: a later turn's prompt reuses its blocks
                self.blocks.publish(seq)  # rows whose input token was this step's: their blocks now
        finished = []
        for seq, at, tok, _ in rows:
            reason = self._finish_reason(seq, tok, at + 1)
            if reason is not None:
                del seq.token_ids[at + 1:]  # the next step's row, if one was launched
                del seq.output_logprobs[max(0, at + 1 - seq.num_prompt_tokens):]
                self.scheduler.finish(seq)
                finished.append(self._finish(seq, reason))
        return finished

    def _length_reached(self, seq) -> bool:
        n = len(seq.token_ids)
        return n - seq.num_prompt_tokens >= seq.params.max_new_tokens or n >= self.max_model_len

    def decode_forward(self, batch, out: torch.Tensor | None = None) -> torch.Tensor:
        """FP32 logits of a decode batch (into out, if given): the compiled forward where
        enable_torch_compile is on."""
        return self.model.logits(self._decode_hidden(batch, self.kv.k, self.kv.v), out=out)

    def _sample(self, logits, seqs):
        masked = []  # (row, token): stop tokens held back by min_new_tokens
        for i, seq in enumerate(seqs):
            p = seq.params  # ignore_eos turns every stop token off (as in SGLang): nothing to mask then
            if not p.ignore_eos and len(seq.token_ids) - seq.num_prompt_tokens < p.min_new_tokens:
                masked += [(i, t) for t in list(p.stop_token_ids or []) + self.eos_token_ids]
        if masked:
            rows, cols = to_device(masked, self.device, torch.int64).unbind(1)
            logits[rows, cols] = float("-inf")
        return sample(logits, [s.params.temperature for s in seqs], [s.params.top_p for s in seqs],
                      [s.params.top_k for s in seqs], [s.generator for s in seqs], self.generator,
                      log_softmax=batch_invariant.log_softmax if self.config.true_on_policy else None,
                      fused=self._fused_sample)  # (tokens, logprobs), on the device

    def _finish_reason(self, seq, tok, end: int):
        """Why seq ends at its token tok, token_ids[end - 1], or None."""
        p, n_out = seq.params, end - seq.num_prompt_tokens
        if n_out >= p.max_new_tokens:
            return {"type": "length", "length": p.max_new_tokens}
        if not p.ignore_eos and (tok in (p.stop_token_ids or ()) or tok in self.eos_token_ids):
            return {"type": "stop", "matched": tok}
        matched = self._completed_stop_string(seq, tok, end) if p.stop and n_out >= p.min_new_tokens else None
        if matched is not None:
            return {"type": "stop", "matched": matched}
        return {"type": "length", "length": n_out} if end >= self.max_model_len else None

    def _completed_stop_string(self, seq, tok, end: int) -> str | None:
        """The stop string the newest token completes (SGLang's rule: it is in the decoded tail of the
        output), else None. A match must end inside the newest token's text, so the tail is decoded
        only when that text holds the string's last character."""
        piece = self._token_texts.get(tok)
        if piece is None:
            piece = self._token_texts[tok] = self.tokenizer.decode([tok])
        for s in seq.params.stop:
            # a non-ASCII character may span several byte tokens; a lone token's text may drop its spaces
            if s[-1] in piece or not s[-1].isascii() or s[-1].isspace():
                start = max(seq.num_prompt_tokens, end - 4 * len(s) - 1)  # <= 4 byte tokens a char
                if s in self.tokenizer.decode(seq.token_ids[start:end]):
                    return s
        return None

    def _finish(self, seq, reason) -> FinishedRequest:
        del self.seqs[seq.rid]
        seq.finished = True
        while seq.token_ids[-1] == -1:  # aborted with a token not taken in (a step that failed)
            seq.token_ids.pop()
            if seq.return_logprob:
                seq.output_logprobs.pop()
        out = list(seq.output_ids)
        return FinishedRequest(seq.rid, out, list(seq.output_logprobs) if seq.return_logprob else None, reason,
                               seq.num_prompt_tokens, len(out), seq.num_cached_tokens)


class _Launched:
    """A step on its way: the sequences it ran (work), those it samples a token for (seqs) and where in
    their token_ids each token goes (at); the tokens on the device (tokens), and read back (out, once
    the ready event has fired: overlap_schedule on a GPU)."""

    def __init__(self, work: list, seqs: list, at: list):
        self.work, self.seqs, self.at = work, seqs, at
        self.tokens, self.out, self.ready = None, None, None
