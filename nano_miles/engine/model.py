"""Qwen2 / Llama decoder over a paged KV cache, with Hugging Face's module and parameter names, so a
trainer's named_parameters() and safetensors files load by name.

One forward serves prefill and decode over rows padded to [B, Q] (Q = 1 for decode): each query token
writes its K/V at `slot_mapping`, then attends over its pages through `block_tables`. Padded rows use
position 0 and write into a spare "trash" block, so shapes stay static for CUDA graphs and no row is
ever fully masked. The Triton backend packs a prefill step instead: one row [1, T], split by `tiles`.
In true on-policy mode (`use_batch_invariant_ops`, docs/design.md) the trainer runs this same module.
"""
import json
import os
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn
from torch.utils.checkpoint import checkpoint

from nano_miles.engine import batch_invariant
from nano_miles.engine.batch_invariant import FastOps

SUPPORTED_ARCHITECTURES = ("Qwen2ForCausalLM", "LlamaForCausalLM")


@dataclass
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    attention_bias: bool
    tie_word_embeddings: bool
    max_position_embeddings: int
    eos_token_ids: tuple

    @classmethod
    def from_pretrained(cls, folder: str) -> "ModelConfig":
        path = os.path.join(folder, "config.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"no config.json in model folder {folder!r}")
        with open(path) as f:
            c = json.load(f)
        eos, gen_path = c.get("eos_token_id"), os.path.join(folder, "generation_config.json")
        if os.path.isfile(gen_path):  # generation_config's eos list (e.g. <|im_end|>) is the one generate uses
            with open(gen_path) as f:
                eos = json.load(f).get("eos_token_id", eos)
        return cls.from_dict(c, eos_token_id=eos)

    @classmethod
    def from_dict(cls, c: dict, architecture: str | None = None, eos_token_id=None) -> "ModelConfig":
        """From a config.json dict (or a transformers config's to_dict())."""
        arch = architecture or (c.get("architectures") or ["?"])[0]
        rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"unsupported architecture {arch!r}; supported: {SUPPORTED_ARCHITECTURES}")
        if rope.get("rope_type", rope.get("type", "default")) != "default":
            raise ValueError(f"unsupported rope_type {rope.get('rope_type', rope.get('type'))!r} (only 'default')")
        if c.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {c.get('hidden_act')!r} (only 'silu')")
        if arch == "Qwen2ForCausalLM" and c.get("use_sliding_window") and c.get("sliding_window"):
            raise ValueError("sliding-window attention is not supported")
        eos, heads = c.get("eos_token_id") if eos_token_id is None else eos_token_id, c["num_attention_heads"]
        return cls(
            architecture=arch, vocab_size=c["vocab_size"], hidden_size=c["hidden_size"],
            intermediate_size=c["intermediate_size"], num_layers=c["num_hidden_layers"], num_heads=heads,
            num_kv_heads=c.get("num_key_value_heads") or heads, head_dim=c.get("head_dim") or c["hidden_size"] // heads,
            rms_norm_eps=c.get("rms_norm_eps", 1e-6), rope_theta=float(rope.get("rope_theta", c.get("rope_theta", 1e4))),
            attention_bias=arch == "Qwen2ForCausalLM" or bool(c.get("attention_bias", False)),
            tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
            max_position_embeddings=c.get("max_position_embeddings", 2048),
            eos_token_ids=tuple(eos) if isinstance(eos, list) else (eos,) if eos is not None else ())


@dataclass
class Batch:
    """Inputs of one forward, on the model's device."""
    input_ids: torch.Tensor     # [B, Q] int64
    positions: torch.Tensor     # [B, Q] int64, absolute position of each query token
    slot_mapping: torch.Tensor  # [B, Q] int64, flat cache slot (block * block_size + offset) to write
    block_tables: torch.Tensor  # [B, N] int64, the sequence's blocks (padding: the trash block)
    last_index: torch.Tensor    # [B] int64, which query column to take logits from
    # Packed prefill (B = 1, Q = T tokens of S sequences): block_tables has S rows, last_index holds each
    # sequence's last token in the row, tiles [n, 3] int32 (block-table row, first token, tokens).
    tiles: torch.Tensor | None = None


class RMSNorm(nn.Module):
    ops = FastOps

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(dim)), eps

    def forward(self, x):
        return self.ops.rms_norm(x, self.weight, self.eps)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    ops = FastOps

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        H, KV, D, bias = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.attention_bias
        self.head_dim = D
        self.q_proj = nn.Linear(cfg.hidden_size, H * D, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, KV * D, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, KV * D, bias=bias)
        self.o_proj = nn.Linear(H * D, cfg.hidden_size, bias=False)

    def forward(self, x, cos, sin, attend):
        """attend(q [B, Q, H, D], k, v [B, Q, KV, D]) -> [B, Q, H * D]: paged (engine) or whole-sequence (trainer)."""
        B, Q, _ = x.shape
        lin = self.ops.linear
        q, k, v = (lin(x, proj.weight, proj.bias).view(B, Q, -1, self.head_dim)
                   for proj in (self.q_proj, self.k_proj, self.v_proj))
        return lin(attend(q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin, v), self.o_proj.weight)


class MLP(nn.Module):
    ops = FastOps

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        lin = self.ops.linear
        return lin(self.ops.silu_mul(lin(x, self.gate_proj.weight), lin(x, self.up_proj.weight)), self.down_proj.weight)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.self_attn, self.mlp = Attention(cfg), MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, attend):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attend)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(nn.Module):
    """model.* + lm_head (absent when tied: the logits use model.embed_tokens.weight, as HF does)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config, self.model = cfg, DecoderModel(cfg)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rope_cache = None        # (cos, sin) [max_pos, D], built on the right device by init_rope
        self.decode_attention = None  # optional paged kernel for Q == 1 batches (set by the engine)
        self.prefill_attention = None  # the paged kernel of packed prefill batches (set with decode_attention)
        self.batch_invariant = False  # true on-policy mode: see use_batch_invariant_ops
        self._lm_head_fp32 = self._lm_head_version = None  # FP32 copy of the output projection

    @classmethod
    def sharing_parameters(cls, hf_model: nn.Module) -> "CausalLM":
        """This module over a transformers Qwen2/Llama model's OWN parameters (the same tensors, by HF
        name): what the trainer runs in true on-policy mode, so gradients land in the HF model."""
        cfg = ModelConfig.from_dict(hf_model.config.to_dict(), architecture=type(hf_model).__name__)
        with torch.device("meta"):
            model = cls(cfg)
        theirs = dict(hf_model.named_parameters())
        ours = [name for name, _ in model.named_parameters()]
        missing = [name for name in ours if name not in theirs]
        if missing:
            raise ValueError(f"{type(hf_model).__name__} lacks parameters {missing[:3]}; cannot share them")
        for name in ours:
            owner, attr = name.rsplit(".", 1)
            setattr(model.get_submodule(owner), attr, theirs[name])
        return model

    def use_batch_invariant_ops(self) -> "CausalLM":
        """Switch every op to batch_invariant.py (true on-policy mode); before init_rope builds its table."""
        self.batch_invariant = True
        for module in self.modules():
            if hasattr(module, "ops"):
                module.ops = batch_invariant
        return self

    def init_rope(self, max_positions: int, device, dtype):
        D, theta = self.config.head_dim, self.config.rope_theta
        if self.batch_invariant:
            cos, sin = batch_invariant.rope_table(max_positions, D, theta)
        else:
            inv_freq = 1.0 / (theta ** (torch.arange(0, D, 2, dtype=torch.int64, device=device).float() / D))
            freqs = torch.outer(torch.arange(max_positions, device=device, dtype=torch.float32), inv_freq)
            cos, sin = torch.cat((freqs, freqs), dim=-1).cos(), torch.cat((freqs, freqs), dim=-1).sin()
        self.rope_cache = (cos.to(device=device, dtype=dtype), sin.to(device=device, dtype=dtype))

    def lm_head_weight(self):
        return self.model.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight

    def refresh_lm_head_fp32(self) -> torch.Tensor:
        """The output projection in FP32, refreshed in place (CUDA graphs hold its address) when the
        weight's _version moved; call it outside graph capture. FP32 logits, as the trainer's: a bf16
        logit keeps 8 bits of mantissa, so hidden states a last bit apart would round apart."""
        w = self.lm_head_weight()
        if w.dtype == torch.float32 or self.batch_invariant:  # batch-invariant logits read the bf16 weight itself
            return w
        if self._lm_head_fp32 is None:
            self._lm_head_fp32 = torch.empty(w.shape, dtype=torch.float32, device=w.device)
        if self._lm_head_version != w._version:
            self._lm_head_fp32.copy_(w)
            self._lm_head_version = w._version
        return self._lm_head_fp32

    def logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """FP32 logits of final-normed hidden states [..., hidden]; out: [B, vocab] to write them into
        (a CUDA graph's static buffer: no copy of [B, vocab] after the matmul)."""
        if self.batch_invariant:  # bf16 operands, FP32 products and sums: the same values as the FP32 copy
            logits = batch_invariant.linear(hidden, self.lm_head_weight(), out_dtype=torch.float32)
            return logits if out is None else out.copy_(logits)
        w = self.refresh_lm_head_fp32() if self._lm_head_fp32 is None else self._lm_head_fp32
        project = (lambda h: F.linear(h, w)) if out is None else (lambda h: torch.mm(h, w.t(), out=out))
        if self._lm_head_fp32 is None or w.device.type != "cuda":  # FP32 weights, or a CPU engine
            return project(hidden.float())
        # bf16-valued operands are exact in TF32: the FP32-accumulated result at bf16-like speed. Only
        # for this matmul: the process's own setting (an FP32 engine or trainer beside us) stays as it was.
        before = torch.get_float32_matmul_precision()
        torch.set_float32_matmul_precision("high")
        try:
            return project(hidden.float())
        finally:
            torch.set_float32_matmul_precision(before)

    def paged_attention(self, batch: Batch, k_caches, v_caches, layer, attn_info, q, k, v):
        """The engine's attention (layer `layer`'s `attend`): this step's keys/values into the cache,
        then read over its pages."""
        B, Q, H, D = q.shape
        KV = k.shape[2]
        write_kv(k_caches, v_caches, layer, batch.slot_mapping.reshape(-1), k, v)
        k_cache, v_cache = k_caches[layer], v_caches[layer]
        if batch.tiles is not None:  # packed prefill: [1, T] tokens of many sequences
            return self.prefill_attention(q.view(Q, H, D), k_cache, v_cache, batch.block_tables,
                                          batch.positions.view(Q), batch.tiles).view(B, Q, H * D)
        if self.batch_invariant:  # every query row, prefill or decode, through one batch-invariant loop over its pages
            return batch_invariant.paged_attention(q.reshape(B * Q, H, D), k_cache, v_cache, batch.block_tables,
                                                   batch.positions.reshape(-1), queries_per_table=Q).view(B, Q, H * D)
        if Q == 1 and self.decode_attention is not None:  # read the pages in place (triton_attention.py)
            out = self.decode_attention(q.view(B, H, D), k_cache, v_cache, batch.block_tables, attn_info)
            return out.view(B, Q, H * D)
        N, G = batch.block_tables.shape[1], H // KV
        keys = k_cache[batch.block_tables].view(B, N * k_cache.shape[1], KV, D).transpose(1, 2)
        vals = v_cache[batch.block_tables].view(B, N * v_cache.shape[1], KV, D).transpose(1, 2)
        # GQA without repeating K/V: each KV head's G query heads folded into the query axis, rows ordered
        # (query token, head in group), so one SDPA call covers prefill and decode.
        q = q.view(B, Q, KV, G, D).permute(0, 2, 1, 3, 4).reshape(B, KV, Q * G, D)
        out = F.scaled_dot_product_attention(q, keys, vals, attn_mask=attn_info)
        return out.view(B, KV, Q, G, D).permute(0, 2, 1, 3, 4).reshape(B, Q, H * D)

    def forward(self, batch: Batch, k_caches, v_caches) -> torch.Tensor:
        """FP32 logits [B, V] of the query column `batch.last_index` of each row (packed: [S, V], one a
        sequence)."""
        return self.logits(self.last_hidden(batch, k_caches, v_caches))

    def last_hidden(self, batch: Batch, k_caches, v_caches) -> torch.Tensor:
        """Final-normed hidden states [B, hidden] of those columns: the part torch.compile may fuse."""
        cos, sin = (c[batch.positions].unsqueeze(2) for c in self.rope_cache)  # [B, Q, 1, D]: over every head
        B, Q = batch.input_ids.shape
        if batch.tiles is not None or self.batch_invariant:
            attn_info = None  # the packed kernel masks by positions and tiles, the batch-invariant loop by positions
        elif Q == 1 and self.decode_attention is not None:
            attn_info = batch.positions[:, 0] + 1  # the paged kernel's context lengths (keys before them)
        else:  # [B, 1, Q*G, L]: query row (token q, head g) sees keys at positions <= positions[q]
            L, G = batch.block_tables.shape[1] * k_caches[0].shape[1], self.config.num_heads // self.config.num_kv_heads
            attn_info = torch.arange(L, device=batch.positions.device).view(1, 1, L) <= batch.positions.unsqueeze(-1)
            attn_info = attn_info.unsqueeze(2).expand(B, Q, G, L).reshape(B, 1, Q * G, L)
        x = self.model.embed_tokens(batch.input_ids)
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, partial(self.paged_attention, batch, k_caches, v_caches, i, attn_info))
        last = x[0, batch.last_index] if batch.tiles is not None else x[torch.arange(B, device=x.device), batch.last_index]
        return self.model.norm(last)

    def forward_sequences(self, input_ids: torch.Tensor, checkpoint_layers: bool = False) -> torch.Tensor:
        """The trainer's forward: final-normed hidden states [B, L, hidden] of whole right-padded
        sequences (no cache; causal, so a real token never sees the padding after it).
        checkpoint_layers recomputes each layer in backward instead of keeping its activations."""
        B, L = input_ids.shape
        if self.rope_cache is None or self.rope_cache[0].shape[0] < L:
            p = self.model.embed_tokens.weight
            self.init_rope(max(L, self.config.max_position_embeddings), p.device, p.dtype)
        cos, sin = (c[:L].view(1, L, 1, -1) for c in self.rope_cache)
        causal = batch_invariant.causal_attention if self.batch_invariant else FastOps.causal_attention
        attend = lambda q, k, v: causal(q, k, v).flatten(2)  # noqa: E731 - causal over whole right-padded sequences
        x = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            if checkpoint_layers and torch.is_grad_enabled():
                x = checkpoint(layer, x, cos, sin, attend, use_reentrant=False)
            else:
                x = layer(x, cos, sin, attend)
        return self.model.norm(x)


def write_kv(k_caches: torch.Tensor, v_caches: torch.Tensor, layer: int, slots: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor) -> None:
    """One layer's keys/values of this step [B, Q, KV, D] into their flat slots of the caches
    [layers, blocks, block_size, KV, D]. Under torch.compile an opaque op over the whole caches (not a
    layer's view), so the compiled forward writes them in place (it functionalises mutations of its
    inputs); eager, a plain call (the op's dispatch costs tens of microseconds a layer)."""
    if torch.compiler.is_compiling():
        return _write_kv_op(k_caches, v_caches, layer, slots, k, v)
    KV, D = k.shape[-2:]
    k_caches[layer].view(-1, KV, D).index_copy_(0, slots, k.reshape(-1, KV, D).to(k_caches.dtype))
    v_caches[layer].view(-1, KV, D).index_copy_(0, slots, v.reshape(-1, KV, D).to(v_caches.dtype))


_write_kv_op = torch.library.custom_op("nano_miles::write_kv", write_kv, mutates_args=("k_caches", "v_caches"))
_write_kv_op.register_fake(lambda k_caches, v_caches, layer, slots, k, v: None)


def load_safetensors(model: CausalLM, folder: str):
    """Load every *.safetensors in `folder` into `model` by HF name; missing or unexpected names raise."""
    files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {folder!r}")
    params, seen = dict(model.named_parameters()), set()
    with torch.no_grad():
        for fname in files:
            with safe_open(os.path.join(folder, fname), framework="pt") as f:
                for name in f.keys():
                    if name not in params and skip_weight_name(name, model.config):
                        continue
                    if name not in params:
                        raise ValueError(f"unexpected weight {name!r} in {fname}")
                    t = f.get_tensor(name)
                    if tuple(t.shape) != tuple(params[name].shape):
                        raise ValueError(f"weight {name!r}: shape {tuple(t.shape)} != {tuple(params[name].shape)}")
                    params[name].copy_(t)
                    seen.add(name)
    if set(params) - seen:
        raise ValueError(f"weights missing from {folder!r}: {sorted(set(params) - seen)[:5]}...")


def skip_weight_name(name: str, cfg: ModelConfig) -> bool:
    """Names a checkpoint may carry that have no parameter here (SGLang skips the same)."""
    return "rotary_emb.inv_freq" in name or (cfg.tie_word_embeddings and name == "lm_head.weight")
