"""The engine keeps its parameters packed in one flat buffer (HF order), so a bucket laid out like it
is applied with one copy; a bucket that is not is recognised as such before anything changes."""
import pytest
import torch

from nano_miles.engine import weights as W
from nano_miles.engine.engine import Engine, EngineConfig, SamplingParams
from nano_miles.engine.flat_params import FlatParameters


@pytest.fixture(scope="module")
def engine(tiny_model_path):
    return Engine(EngineConfig(model=str(tiny_model_path), device="cpu", dtype="float32", num_kv_blocks=64))


def new_weights(engine, seed):
    g = torch.Generator().manual_seed(seed)
    return [(n, p.detach() + 0.01 * torch.randn(p.shape, generator=g)) for n, p in engine.model.named_parameters()]


def greedy_logprobs(engine, rid):
    engine.add_request(rid, [5, 6, 7, 8], SamplingParams(max_new_tokens=6, temperature=0.0))
    out = []
    while engine.has_unfinished():
        out += engine.step()
    return out[0].output_ids, out[0].output_logprobs


def test_every_parameter_is_a_view_into_one_buffer_in_hf_order(engine):
    flat = engine.flat_params
    assert flat is not None and [s.name for s in flat.slots] == [n for n, _ in engine.model.named_parameters()]
    assert flat.slots[0].name == "model.embed_tokens.weight" and flat.slots[-1].name == "model.norm.weight"
    base = flat.bytes.data_ptr()
    for slot, (name, p) in zip(flat.slots, engine.model.named_parameters()):
        assert p.data_ptr() - base == slot.start_idx and p.numel() * p.element_size() == slot.end_idx - slot.start_idx
    assert flat.slots[-1].end_idx == flat.bytes.numel()  # packed: no gaps


def test_packing_keeps_the_values_and_writes_move_every_parameter_version(tiny_model_path):
    from safetensors.torch import load_file

    eng = Engine(EngineConfig(model=str(tiny_model_path), device="cpu", dtype="float32", num_kv_blocks=16))
    state = {}
    for f in sorted(tiny_model_path.glob("*.safetensors")):
        state.update(load_file(str(f)))
    assert all(torch.equal(p, state[n]) for n, p in eng.model.named_parameters())
    # Caches of derived weights (the FP32 lm_head) watch param._version: a write through the flat
    # buffer must move it, which `param.data = view` would not.
    emb = eng.model.model.embed_tokens.weight
    before = emb._version
    eng.load_flat(eng.flat_params.slots[-1].start_idx, torch.zeros(64 * 4, dtype=torch.uint8))  # model.norm.weight
    assert emb._version != before and torch.equal(eng.model.model.norm.weight, torch.zeros(64))


def test_a_matching_bucket_is_one_copy_with_identical_weights(engine):
    named = new_weights(engine, 1)
    bucket = W.FlattenedTensorBucket(named_tensors=named)
    span = engine.flat_params.match(bucket.metadata)
    assert span == (0, engine.flat_params.bytes.numel())
    engine.load_flat(span[0], bucket.flattened_tensor)
    assert all(torch.equal(p, dict(named)[n]) for n, p in engine.model.named_parameters())
    # ...and the engine serves them: same tokens and log-probs as the per-tensor path gives.
    ids, lps = greedy_logprobs(engine, "flat")
    engine.load_weights(new_weights(engine, 2))
    engine.load_weights(named)
    assert greedy_logprobs(engine, "per-tensor") == (ids, lps)


def test_a_contiguous_run_matches_at_its_offset(engine):
    named = new_weights(engine, 3)
    run = [(n, t) for n, t in named if n.startswith("model.layers.1.")]
    bucket = W.FlattenedTensorBucket(named_tensors=run)
    start, end = engine.flat_params.match(bucket.metadata)
    slots = {s.name: s for s in engine.flat_params.slots}
    assert (start, end) == (slots[run[0][0]].start_idx, slots[run[-1][0]].end_idx)
    engine.load_flat(start, bucket.flattened_tensor)
    params = dict(engine.model.named_parameters())
    assert all(torch.equal(params[n], t) for n, t in run)


def mismatching_buckets(engine):
    named = new_weights(engine, 4)
    swapped = named[:1] + [named[2], named[1]] + named[3:]
    tied_extra = named + [("lm_head.weight", named[0][1])]
    gap = named[:3] + named[4:]
    half = [(n, t.to(torch.bfloat16)) if i == 2 else (n, t) for i, (n, t) in enumerate(named)]
    bent = [(n, t.reshape(-1) if t.dim() == 2 and i == 1 else t) for i, (n, t) in enumerate(named)]
    unknown = named + [("model.no_such.weight", torch.ones(4))]
    return {"order": swapped, "tied lm_head appended": tied_extra, "a gap": gap, "a bf16 tensor": half,
            "a reshaped tensor": bent, "an unknown name": unknown}


@pytest.mark.parametrize("case", ["order", "tied lm_head appended", "a gap", "a bf16 tensor",
                                  "a reshaped tensor", "an unknown name"])
def test_anything_else_does_not_match(engine, case):
    bucket = W.FlattenedTensorBucket(named_tensors=mismatching_buckets(engine)[case])
    assert engine.flat_params.match(bucket.metadata) is None


def test_metadata_with_wrong_offsets_or_garbage_does_not_match(engine):
    bucket = W.FlattenedTensorBucket(named_tensors=new_weights(engine, 5))
    meta = list(bucket.metadata)
    shifted = [W.FlattenedTensorMetadata(m.name, m.shape, m.dtype, m.start_idx + 4, m.end_idx + 4, m.numel)
               for m in meta]
    assert engine.flat_params.match(shifted) is None
    assert engine.flat_params.match([]) is None
    assert engine.flat_params.match(["not metadata"]) is None
    before = engine.flat_params.bytes.clone()
    with pytest.raises(ValueError, match="does not fit"):
        engine.load_flat(8, bucket.flattened_tensor)  # runs 8 bytes past the end: refused before any copy
    assert torch.equal(engine.flat_params.bytes, before)


def test_a_model_of_mixed_dtypes_is_not_packed(tiny_model_path):
    from nano_miles.engine.model import CausalLM, ModelConfig

    model = CausalLM(ModelConfig.from_pretrained(str(tiny_model_path)))
    model.model.norm.to(torch.bfloat16)
    assert not FlatParameters.packable(model)
    with pytest.raises(ValueError, match="several dtypes"):
        FlatParameters(model)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpu_one_copy_update_keeps_captured_graphs_valid(tiny_model_path, dtype):
    """Graph-replayed decode after a one-copy update (from another GPU when there is one, as CUDA
    IPC does) gives exactly what an engine updated tensor by tensor gives: the graphs read the
    packed parameters in place, and the bf16 engine's FP32 lm_head copy is refreshed."""
    src = torch.device("cuda", 1 if torch.cuda.device_count() > 1 else 0)
    prompt, sp = list(range(20, 50)), SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)

    def updated(one_copy: bool):
        eng = Engine(EngineConfig(model=str(tiny_model_path), device="cuda:0", dtype=dtype, num_kv_blocks=64))
        assert eng.flat_params is not None and eng.graphs is not None
        eng.add_request("before", prompt, sp)
        before = []
        while eng.has_unfinished():
            before += eng.step()  # captures decode graphs over the old weights
        assert eng.graphs.graphs
        named = [(n, (p.detach() * 1.5).to(src)) for n, p in eng.model.named_parameters()]
        if one_copy:
            bucket = W.FlattenedTensorBucket(named_tensors=named)
            start, _ = eng.flat_params.match(bucket.metadata)
            eng.load_flat(start, bucket.flattened_tensor)
        else:
            eng.load_weights(named)
        eng.add_request("after", prompt, sp)
        out = []
        while eng.has_unfinished():
            out += eng.step()
        assert out[0].output_logprobs != before[0].output_logprobs  # the new weights are served
        return out[0].output_ids, out[0].output_logprobs, out[0].cached_tokens

    assert updated(True) == updated(False)
