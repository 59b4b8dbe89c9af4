"""labkit.kernels.gguf_blocks and the block kernels of labkit.kernels.native: the model's
matrices multiplied in the GGUF file's own Q4_1 / Q8_0 blocks, held to `gguf`'s reference
dequantization and to float32 products."""

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest import GGUF_LOGIT_ERROR, assert_greedy_near, chosen_scores, needs_kernels
from labkit.engine.backends import PREFERRED_WEIGHTS, GGUFBackend, backend_for, prepare_weights
from labkit.engine.llm_engine import EngineConfig, LLMEngine
from labkit.kernels import gguf_blocks as gb
from labkit.kernels import native
from labkit.models import registry
from labkit.models.gguf_file import open_reader, raw_blocks
from labkit.sampling import SamplingParams

KINDS = {"Q4_1": gguf.GGMLQuantizationType.Q4_1, "Q8_0": gguf.GGMLQuantizationType.Q8_0}


def random_blocks(kind: str, out: int, n: int, seed: int = 0) -> tuple[torch.Tensor, np.ndarray]:
    """Blocks that `gguf` itself quantized from random weights, and `gguf`'s dequantization."""
    weights = np.random.default_rng(seed).standard_normal((out, n)).astype(np.float32)
    blocks = gguf.quants.quantize(weights, KINDS[kind])
    return torch.from_numpy(np.ascontiguousarray(blocks)), gguf.quants.dequantize(blocks, KINDS[kind])


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_dequantize_equals_ggufs_reference(kind):
    blocks, reference = random_blocks(kind, 24, 128)
    assert torch.equal(gb.dequantize(kind, blocks), torch.from_numpy(reference.reshape(24, 128)))


@needs_kernels
@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("rows", [1, 3, 4])
def test_the_block_kernel_computes_the_float_product(kind, rows):
    blocks, reference = random_blocks(kind, 96, 576, seed=rows)
    x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(rows))
    want = F.linear(x, torch.from_numpy(reference.reshape(96, 576)))
    torch.testing.assert_close(native.gemv_blocks(x, blocks, kind), want, rtol=1e-5, atol=1e-4)


def int8_product(x: torch.Tensor, kind: str, blocks: torch.Tensor) -> torch.Tensor:
    """llama.cpp's scheme written out in PyTorch, apart from the kernels: x rounded per block
    of 32 to bytes (step max |x| / 127 and its inverse in float32, halves to even), integer
    dot products with the weights' 4- or 8-bit values, then the scales (and Q4_1's minimum)."""
    per_block, block_bytes = native.BLOCK_FORMATS[kind]
    out = blocks.shape[0]
    xb = x.reshape(x.shape[0], -1, per_block)                                # [rows, nb, 32]
    step = xb.abs().amax(-1, keepdim=True) / 127
    qx = torch.round(xb * torch.where(step > 0, 1 / step, 0)).double()
    dx = step[..., 0].double()
    b = blocks.reshape(out, -1, block_bytes)
    d = b[..., 0:2].contiguous().view(torch.float16).double()[..., 0]       # [out, nb]
    if kind == "Q8_0":
        qw = b[..., 2:].contiguous().view(torch.int8).double()
        return torch.einsum("rbj,obj,rb,ob->ro", qx, qw, dx, d).float()
    m = b[..., 2:4].contiguous().view(torch.float16).double()[..., 0]
    qw = torch.cat([b[..., 4:] & 15, b[..., 4:] >> 4], dim=-1).double()
    scaled = torch.einsum("rbj,obj,rb,ob->ro", qx, qw, dx, d)
    return (scaled + torch.einsum("rb,ob->ro", dx * qx.sum(-1), m)).float()


@needs_kernels
@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("rows", [1, 3, 6])
def test_the_int8_kernel_computes_llama_cpps_scheme(kind, rows):
    blocks, reference = random_blocks(kind, 96, 576, seed=rows)
    x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(rows))
    got = native.gemv_blocks(x, blocks, kind, quantize_x=True)
    torch.testing.assert_close(got, int8_product(x, kind, blocks), rtol=1e-5, atol=1e-4)
    exact = F.linear(x, torch.from_numpy(reference.reshape(96, 576)))
    assert (got - exact).abs().max() > 1e-3  # x really was rounded: not the float32 product


@needs_kernels
@pytest.mark.slow
def test_the_portable_build_computes_the_same(tmp_path):
    """The plain C loops that replace the AVX2 ones on other CPUs, built here without AVX2."""
    lib = native.compile_library(tmp_path, ("-O2", "-march=x86-64", "-fopenmp", "-shared", "-fPIC"))
    for kind in KINDS:
        blocks, reference = random_blocks(kind, 40, 256, seed=7)
        x = torch.randn(5, 256, generator=torch.Generator().manual_seed(7))
        want = F.linear(x, torch.from_numpy(reference.reshape(40, 256)))
        torch.testing.assert_close(native.gemv_blocks(x, blocks, kind, lib=lib), want, rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(native.gemv_blocks(x, blocks, kind, True, lib=lib), int8_product(x, kind, blocks),
                                   rtol=1e-5, atol=1e-4)
    blocks, _ = random_blocks("Q4_1", 40, 256, seed=7)
    torch.testing.assert_close(native.gemv_blocks(x, gb.regroup_q4_1(blocks), "Q4_1x8", True, lib=lib),
                               int8_product(x, "Q4_1", blocks), rtol=1e-5, atol=1e-4)


@needs_kernels
def test_the_block_kernel_refuses_what_it_cannot_read():
    blocks, _ = random_blocks("Q4_1", 8, 64)
    with pytest.raises(ValueError):
        native.gemv_blocks(torch.randn(1, 32), blocks, "Q4_1")  # 64 inputs, not 32
    with pytest.raises(ValueError):
        native.gemv_blocks(torch.randn(1, 64), blocks, "Q5_K")
    with pytest.raises(ValueError):
        native.gemv_blocks(torch.randn(1, 64).double(), blocks, "Q4_1")


@pytest.fixture(scope="module")
def blocks_of_the_file(model):
    return raw_blocks(open_reader(registry.fetch(model.name)), model.config)


def test_the_files_blocks_are_the_models_weights_exactly(model, blocks_of_the_file):
    """Fused and with the Q/K rows put back in Hugging Face order, the blocks dequantize to
    the float32 weights the model was loaded with, bit for bit."""
    for index in (0, model.config.num_layers - 1):
        for matrix in ("qkv", "o_proj", "gate_up", "down"):
            kind, blocks = gb.fused_blocks(blocks_of_the_file, index, matrix)
            assert kind == "Q4_1"
            assert torch.equal(gb.dequantize(kind, blocks), getattr(model.layers[index], matrix))
    kind, head = blocks_of_the_file["model.embed_tokens.weight"]
    assert kind == "Q8_0" and torch.equal(gb.dequantize(kind, torch.from_numpy(head)), model.lm_head)


@needs_kernels
def test_the_block_model_gives_the_models_logits(model, blocks_of_the_file):
    blocked = gb.block_model(model, blocks_of_the_file)
    assert isinstance(blocked.layers[0].qkv, gb.BlockLinear) and isinstance(blocked.lm_head, gb.BlockLinear)
    ids = torch.tensor([model.tokenizer.encode("The capital of France is")])
    torch.testing.assert_close(blocked(ids), model(ids), rtol=0, atol=1e-3)  # prefill: the dense path
    x = torch.randn(2, model.config.hidden_size)
    torch.testing.assert_close(blocked.lm_head(x), F.linear(x, model.lm_head), rtol=1e-5, atol=1e-4)
    read = sum(getattr(layer, m).nbytes for layer in blocked.layers for m in ("qkv", "o_proj", "gate_up", "down"))
    assert 5 * (read + blocked.lm_head.nbytes) < 4 * model.num_parameters()  # under a fifth of float32's


@needs_kernels
def test_gguf_weights_keep_the_greedy_tokens_of_float32(model):
    prompts = ["The capital of France is", "def fibonacci(n):\n    if n < 2:\n        return n\n",
               "An inference engine takes a trained model and a request, and it must"]
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=20)
    outputs = {w: [o.samples[0] for o in LLMEngine(model, EngineConfig(kv_cache_tokens=2048, weights=w))
                   .generate(prompts, greedy)]
               for w in ("f32", "gguf")}
    # two numerical paths: equal up to the near-tie rule, float32's top-20 as its scores
    f32, blocks = outputs["f32"], outputs["gguf"]
    assert_greedy_near([s.token_ids for s in f32], [s.token_ids for s in blocks], [s.top_logprobs for s in f32],
                       GGUF_LOGIT_ERROR, [chosen_scores(s.token_ids, s.logprobs) for s in blocks],
                       what="the file's blocks against float32")


@needs_kernels
def test_decode_logits_on_the_blocks_stay_within_1e_3_of_float32(model, blocks_of_the_file):
    """One token at a time (the steps that read the blocks), the float32-activation kernels
    keep every logit within 1e-3 of the float32 model's; rounding x to 8 bits does not."""
    ids = model.tokenizer.encode("An inference engine takes a trained model and a request")
    exact, rounded = gb.block_model(model, blocks_of_the_file), gb.block_model(model, blocks_of_the_file, True)
    caches = {name: m.new_cache(batch=1, max_len=len(ids)) for name, m in
              (("f32", model), ("exact", exact), ("rounded", rounded))}
    worst = {"exact": 0.0, "rounded": 0.0}
    for i in range(len(ids)):
        step = torch.tensor([[ids[i]]])
        want = model(step, cache=caches["f32"])[0, -1]
        for name, m in (("exact", exact), ("rounded", rounded)):
            worst[name] = max(worst[name], (m(step, cache=caches[name])[0, -1] - want).abs().max().item())
    assert worst["exact"] < 1e-3 < worst["rounded"]


def test_weights_are_checked(model, monkeypatch):
    with pytest.raises(ValueError):
        backend_for(True, "int3")
    with pytest.raises(ValueError):
        backend_for(False, "gguf")  # the reference path is float32 only
    monkeypatch.setattr(native, "load", lambda: None)
    with pytest.raises(ValueError, match="C kernels"):
        GGUFBackend().prepare(model)


@needs_kernels
def test_no_named_mode_runs_the_preferred_one_or_float32_saying_why(model, monkeypatch):
    """EngineConfig(weights=None), what `labkit serve` and `labkit generate` pass without
    --weights: the file's blocks where they run; float32 with the reason where they cannot; a
    mode named that cannot run is an error, never a quiet substitute."""
    engine = LLMEngine(model, EngineConfig(kv_cache_tokens=256, weights=None))
    assert (engine.weights, engine.weights_fallback) == (PREFERRED_WEIGHTS, None) == ("gguf", None)
    assert isinstance(engine.model, gb.BlockLlama)
    assert LLMEngine(model, EngineConfig(kv_cache_tokens=256)).weights == "f32"  # the library's default

    class NotALlama(torch.nn.Module):
        name, dtype, device = "smollm2-135m", torch.float32, torch.device("cpu")

    with pytest.raises(ValueError, match="Llama"):
        GGUFBackend().prepare(NotALlama())
    monkeypatch.setattr(native, "load", lambda: None)
    fallback = prepare_weights(model, None)
    assert fallback.weights == "f32" and "C kernels" in fallback.fallback
    assert not isinstance(fallback.model, gb.BlockLlama)
    with pytest.raises(ValueError, match="C kernels"):
        prepare_weights(model, "gguf")


@needs_kernels
def test_rounded_activations_give_the_same_product_on_both_paths():
    """Where a BlockLinear is told to hand big steps to float32 weights, it multiplies them
    by x rounded the kernels' way: one model on both paths."""
    blocks, reference = random_blocks("Q4_1", 64, 256, seed=3)
    linear = gb.BlockLinear("Q4_1", blocks, torch.from_numpy(reference.reshape(64, 256)), quantize_x=True,
                            max_rows=4)
    x = torch.randn(9, 256, generator=torch.Generator().manual_seed(3))
    many = linear(x)  # 9 rows: the float32 path
    few = torch.cat([linear(x[i:i + 3]) for i in range(0, 9, 3)])  # 3 rows at a time: the kernel
    torch.testing.assert_close(many, few, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(many, int8_product(x, "Q4_1", blocks), rtol=1e-5, atol=1e-4)



@needs_kernels
def test_the_c_layers_compute_what_the_python_layers_compute(model, blocks_of_the_file):
    """A decode step of two sequences on a paged pool: `BlockLlama`'s one C call a layer
    against `Llama.forward` on the same blocks (PyTorch between the block products), both
    after the same prefill. The logits and the keys and values each writes agree, and the
    logits are within 1e-3 of the float32 model's."""
    from labkit.engine.paged_cache import KVPool, PagedBatch
    from labkit.models.llama import Llama

    blocked = gb.block_model(model, blocks_of_the_file)
    prompts = [model.tokenizer.encode("The capital of France is"), model.tokenizer.encode("def add(a, b):")]
    pools = [KVPool(model.config, 8, 16) for _ in range(3)]
    assert pools[0].native
    tables = [[0, 1], [2, 3]]
    for pool, runs in zip(pools, (blocked, blocked, model)):  # the prefill: many rows, one path
        runs(torch.tensor([prompts[0] + prompts[1]]), cache=PagedBatch(pool, tables, [0, 0], [len(p) for p in prompts]))
    step = torch.tensor([[11, 29]])
    starts = [len(p) for p in prompts]
    fused = blocked(step, cache=PagedBatch(pools[0], tables, starts, [1, 1]))
    python = Llama.forward(blocked, step, cache=PagedBatch(pools[1], tables, starts, [1, 1]))
    f32 = model(step, cache=PagedBatch(pools[2], tables, starts, [1, 1]))
    assert (fused - python).abs().max() < 1e-4 and (fused - f32).abs().max() < 1e-3
    for a, b in ((pools[0].keys, pools[1].keys), (pools[0].values, pools[1].values)):
        assert (a - b).abs().max() < 1e-5 * b.abs().max()
    assert pools[0].keys[-1, 0, :, :, starts[0]].abs().sum() > 0  # the new key was written


@needs_kernels
def test_one_c_layer_computes_one_python_layer(model, blocks_of_the_file):
    """Layer 0 on the same three rows, in C and in PyTorch, with x in float32 and rounded to
    bytes. In float32 the two agree to rounding. Rounded, a last-bit difference upstream can
    move a value to the next step, which the rest of the layer carries on, so the two
    int8 paths are held to the float32 layer instead: each as close to it as the other."""
    from labkit.engine.paged_cache import KVPool, PagedBatch
    from labkit.models.llama import decoder_layer

    x = model.embed[torch.tensor(model.tokenizer.encode("One two three"))[:3]].contiguous()
    cos, sin = model.rope_cos[:3].contiguous(), model.rope_sin[:3].contiguous()

    def layer_zero(quantize_x: bool, in_c: bool) -> torch.Tensor:
        blocked = gb.block_model(model, blocks_of_the_file, quantize_x)
        batch = PagedBatch(KVPool(model.config, 4, 16), [[1]], [0], [3])
        if not in_c:
            return decoder_layer(model.config, blocked.layers[0], x[None], cos, sin, batch, 0)[0]
        out = x.clone()
        native.decoder_layer_blocks(out, blocked.fused_layers()[0], model.config, cos, sin, batch.native_layer(0))
        return out

    exact = layer_zero(False, False)
    scale = exact.abs().max()
    assert (layer_zero(False, True) - exact).abs().max() < 1e-5 * scale
    rounded_c, rounded_python = ((layer_zero(True, c) - exact).abs().max() / scale for c in (True, False))
    assert 1e-4 < rounded_c < 1.5 * rounded_python  # rounded, and no further from float32 than PyTorch


@needs_kernels
@pytest.mark.parametrize("rows", [1, 3, 6])
def test_regrouped_q4_1_gives_the_same_int8_product(rows):
    blocks, _ = random_blocks("Q4_1", 96, 576, seed=rows)
    regrouped = gb.regroup_q4_1(blocks)
    by_eight = (lambda b: b.reshape(-1, 8 * b.shape[1]).sort().values)  # each eight rows' bytes
    assert regrouped.shape == blocks.shape and torch.equal(by_eight(regrouped), by_eight(blocks))
    x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(rows))
    got = native.gemv_blocks(x, regrouped, "Q4_1x8", quantize_x=True)
    torch.testing.assert_close(got, int8_product(x, "Q4_1", blocks), rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError):
        native.gemv_blocks(x, regrouped, "Q4_1x8")  # float32 x: no kernel for this order


@needs_kernels
@pytest.mark.slow
def test_gguf_int8_gives_a_request_its_solo_tokens_in_a_batch(model):
    """In gguf-int8 every step, prefill and decode, any batch, runs the same per-row kernels,
    so a request's tokens do not depend on the requests it shares its steps with."""
    prompts = ["List three colours:", "def fibonacci(n):", "The capital of France is", "Once upon a time",
               "The history of the printing press", "An inference engine takes a trained model and"]
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    engine = LLMEngine(model, EngineConfig(kv_cache_tokens=2048, weights="gguf-int8"))
    together = engine.generate(prompts, greedy)  # six rows a decode step, one prefill for all
    for prompt, out in zip(prompts, together):  # the same per-row kernels alone: exact
        assert out.samples[0].token_ids == engine.generate([prompt], greedy)[0].samples[0].token_ids
