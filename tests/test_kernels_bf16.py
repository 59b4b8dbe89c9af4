"""bfloat16 in the engine: the BF16 weight kernel (`csrc/bf16.c`), `weights="bf16"`
(`labkit.kernels.bf16_weights`) and a pool of bfloat16 keys and values
(`EngineConfig.kv_dtype`), held to float64 products of the rounded operands, to PyTorch's
rounding, and to the reference attention path."""

import pytest
import torch
import torch.nn.functional as F

from conftest import assert_argmax_near, assert_greedy_near, chosen_scores, needs_kernels
from labkit.engine.backends import KV_DTYPES, backend_for, kv_dtype_for
from labkit.engine.llm_engine import EngineConfig, LLMEngine
from labkit.engine.paged_cache import KVPool, PagedBatch
from labkit.kernels import native
from labkit.kernels.bf16_weights import bf16_model, bf16_rows, rounded_model
from labkit.kernels.gguf_blocks import round_to_bf16
from labkit.models.llama import Llama, decoder_layer
from labkit.sampling import SamplingParams

PORTABLE = ("-O2", "-march=x86-64", "-fopenmp", "-shared", "-fPIC")


def rounded_product(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """What a bfloat16 GEMM with float32 sums computes, summed in float64."""
    return F.linear(round_to_bf16(x).double(), round_to_bf16(w).double()).float()


@pytest.fixture(scope="module")
def portable_lib(tmp_path_factory):
    return native.compile_library(tmp_path_factory.mktemp("portable"), PORTABLE)


@needs_kernels
@pytest.mark.parametrize("rows", [1, 3, 4, 7])
def test_the_bf16_kernel_multiplies_the_rounded_operands(rows, portable_lib):
    g = torch.Generator().manual_seed(rows)
    w, x = torch.randn(72, 320, generator=g), torch.randn(rows, 320, generator=g)
    want = rounded_product(x, w)
    for lib in (None, portable_lib):  # AVX2 here, and the plain C loops other CPUs take
        got = native.gemv_blocks(x, bf16_rows(w), "BF16", lib=lib)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert (F.linear(x, w) - want).abs().max() > 1e-3  # the rounding is there to be seen


@needs_kernels
def test_the_kernel_rounds_x_as_pytorch_does():
    """An identity matrix returns x as the kernel rounded it: nearest, halves to even."""
    one_ulp = 2.0 ** -7  # bfloat16's step between 1 and 2
    ties = torch.tensor([1 + one_ulp / 2, 1 + 3 * one_ulp / 2, -(1 + one_ulp / 2), 1 + one_ulp * 0.51,
                         3.0e38, 1e-40, 0.0, -0.0])
    x = torch.cat([ties, torch.randn(24, generator=torch.Generator().manual_seed(1))])[None]
    eye = bf16_rows(torch.eye(32))
    assert torch.equal(native.gemv_blocks(x, eye, "BF16"), round_to_bf16(x))


@needs_kernels
def test_the_bf16_kernel_refuses_8_bit_activations():
    with pytest.raises(ValueError, match="bfloat16"):
        native.gemv_blocks(torch.zeros(1, 32), bf16_rows(torch.zeros(4, 32)), "BF16", quantize_x=True)


# Largest logit difference of the bf16 model (weights and activations rounded) from float32 on
# the decode steps below: 0.31 through the C kernels, 0.62 through oneDNN, measured on an
# AVX-512/AMX Xeon. The bound covers both with room; the near-tie tolerance is twice it.
BF16_MODEL_LOGIT_ERROR = 1.0


@needs_kernels
def test_bf16_model_decodes_as_the_rounded_model_does(model):
    """Decode steps through the C kernels (a few rows, one C call a layer) against the model
    with its weights rounded and x rounded before oneDNN's products (max_rows=0: every
    product there). Rounding x to bfloat16 makes the model chaotic at its own scale: a
    last-bit difference in the order of the sums moves a value to the next bfloat16 (0.4%)
    and the layers above carry it on, so two orders of the same sums part by about as much
    as bfloat16 parts from float32 (chapter 12 measures this for 8 bits). So the C path is
    held to float32 within twice the rounded model's distance, both paths to the same greedy
    tokens; the layers themselves are compared in `test_the_c_layer_...` below."""
    ids = model.tokenizer.encode("The capital of France is")
    fast, dense = bf16_model(model), bf16_model(model, max_rows=0)

    def step_logits(served):
        pool = KVPool(model.config, 4, 16)
        return torch.stack([served(torch.tensor([[t]]), cache=PagedBatch(pool, [[0, 1]], [i], [1]))[0, -1]
                            for i, t in enumerate(ids)])

    got, want, f32 = step_logits(fast), step_logits(dense), step_logits(model)
    apart, apart_dense = (got - f32).abs().mean(), (want - f32).abs().mean()
    # the C path is bfloat16 (a float32 path parts by ~1e-5) and parts from float32 no more
    # than twice as far as the rounded model does; which of the two lands closer depends on
    # the build (a baseline x86-64 build of the kernels: 0.06 against oneDNN's 0.11)
    assert 1e-2 < apart < 2 * apart_dense, (apart, apart_dense)
    # two numerical paths each: the argmax agrees at every position under the near-tie rule
    for path, logits in (("C kernels", got), ("oneDNN", want)):
        assert_argmax_near(f32, logits, BF16_MODEL_LOGIT_ERROR, what=f"bf16 weights ({path}) against float32")


def test_rounded_model_leaves_the_original_alone(model):
    before = model.layers[0].qkv.clone()
    rounded = rounded_model(model)
    assert torch.equal(model.layers[0].qkv, before)
    assert torch.equal(rounded.layers[0].qkv, round_to_bf16(before))
    assert rounded.lm_head is rounded.embed  # still tied


@needs_kernels
@pytest.mark.parametrize("lib", ["native", "portable"])
def test_attention_over_a_bf16_pool_is_attention_over_its_widened_values(lib, portable_lib):
    """The C kernel on bfloat16 keys and values against the float32 kernel on the same
    values widened: the same arithmetic once a block is read."""
    g = torch.Generator().manual_seed(3)
    keys = torch.randn(6, 3, 64, 16, generator=g).to(torch.bfloat16)
    values = torch.randn(6, 3, 16, 64, generator=g).to(torch.bfloat16)
    tables = torch.tensor([[4, 1, 5], [0, 2, 3]])
    tiles = native.tiles_for([(0, 0, 3, 37), (1, 3, 1, 20)])
    q = torch.randn(4, 3, 3, 64, generator=g)
    build = portable_lib if lib == "portable" else None
    got = native.paged_attention(keys, values, tables, tiles, q, lib=build)
    want = native.paged_attention(keys.float(), values.float(), tables, tiles, q, lib=build)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


# The largest difference, on the positions the two paths share, between the log-probabilities
# they give the chosen tokens: labkit's C attention over a bfloat16 pool (with these weights)
# against the reference path (float32 weights, gather + SDPA over a bfloat16 pool), on the
# prompts below. A last-bit difference of a key or value moves it to the next bfloat16 (0.4%),
# so even float32 weights part by more than float32 rounding. Measured on an AVX-512/AMX Xeon:
# 0.0096 (f32), 0.040 (bf16), 0.012 (gguf); each bound is about twice that, and the near-tie
# tolerance twice the bound (flip_tolerance). The f32 run there parts at the second prompt's
# 11th token, where the reference's top two are 0.0009 apart: excused, and counted.
POOL_LOGIT_ERROR = {"f32": 0.02, "bf16": 0.08, "gguf": 0.025}
TOP = 20  # the reference's top log-probabilities a step: its scores for the near-tie rule


@needs_kernels
@pytest.mark.parametrize("weights", ["f32", "bf16", "gguf"])
def test_a_bf16_pool_gives_the_tokens_of_the_reference_path(model, weights):
    """Prompts that share a prefix (the prefix cache shares their blocks), several decoding
    at once: the engine on labkit's C attention over a bfloat16 pool against PyTorch's
    gather + SDPA over one (fast_kernels=False, float32 weights). Two numerical paths: their
    greedy tokens agree under the near-tie rule (`labkit.util.near_tie`), parting only where
    the reference's top two are within twice the paths' logit error, which is measured on
    the positions they share and held to POOL_LOGIT_ERROR (so a broken kernel cannot hide
    behind the tolerance)."""
    shared = "An inference engine takes a trained model and a request, and it must decide, step by step, "
    prompts = [shared + "which", shared + "how much memory", "def fibonacci(n):\n    if n < 2:"]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=TOP)

    def samples(config: EngineConfig) -> tuple[list, LLMEngine]:
        engine = LLMEngine(model, config)  # the first prompt's blocks are cached when the others come
        first = engine.generate(prompts[:1], params)
        return [o.samples[0] for o in first + engine.generate(prompts[1:], params)], engine

    got, engine = samples(EngineConfig(kv_cache_tokens=512, kv_dtype="bf16", weights=weights))
    assert engine.pool.keys.dtype == torch.bfloat16 and engine.pool.native
    assert engine.stats().prefix_hits > 0
    want, reference = samples(EngineConfig(kv_cache_tokens=512, kv_dtype="bf16", fast_kernels=False))
    assert not reference.pool.native and reference.stats().prefix_hits > 0
    assert_greedy_near([s.token_ids for s in want], [s.token_ids for s in got], [s.top_logprobs for s in want],
                       POOL_LOGIT_ERROR[weights], [chosen_scores(s.token_ids, s.logprobs) for s in got],
                       what=f"{weights} weights on C attention over a bf16 pool against the reference path")


@needs_kernels
def test_the_c_layer_writes_and_reads_a_bf16_pool_as_pytorch_does(model):
    """Layer 0 of the bf16 model on three rows over a bfloat16 pool, in C and in PyTorch:
    the keys and values each stores are the same bfloat16 numbers (up to one bfloat16 step
    where a last bit decided the rounding), and the outputs agree to the few activations
    that such a last bit moved to the next bfloat16 (relative 2.6e-4 measured; a wrong
    rounding or layout is off by orders of magnitude more)."""
    blocked = bf16_model(model)
    x = model.embed[torch.tensor(model.tokenizer.encode("One two three"))[:3]].contiguous()
    cos, sin = model.rope_cos[:3].contiguous(), model.rope_sin[:3].contiguous()
    pools = [KVPool(model.config, 4, 16, torch.bfloat16) for _ in range(2)]
    python = decoder_layer(model.config, blocked.layers[0], x[None], cos, sin,
                           PagedBatch(pools[0], [[1]], [0], [3]), 0)[0]
    fused = x.clone()
    native.decoder_layer_blocks(fused, blocked.fused_layers()[0], model.config, cos, sin,
                                PagedBatch(pools[1], [[1]], [0], [3]).native_layer(0))
    assert (fused - python).abs().max() < 1e-3 * python.abs().max()
    for a, b in ((pools[0].keys, pools[1].keys), (pools[0].values, pools[1].values)):
        assert a[0].abs().sum() > 0
        assert (a.float() - b.float()).abs().max() <= 2 ** -7 * b.float().abs().max()


def test_a_bf16_pool_holds_half_the_bytes(model):
    f32, bf16 = KVPool(model.config, 4, 16), KVPool(model.config, 4, 16, torch.bfloat16)
    assert bf16.bytes_per_token * 2 == f32.bytes_per_token


def test_kv_dtype_and_weights_are_checked(model):
    assert kv_dtype_for(None, torch.float32) is torch.float32 and set(KV_DTYPES) == {"f32", "bf16"}
    with pytest.raises(ValueError, match="kv_dtype"):
        LLMEngine(model, EngineConfig(kv_cache_tokens=64, kv_dtype="fp8"))
    with pytest.raises(ValueError, match="fast kernels"):
        backend_for(False, "bf16")


@needs_kernels
def test_bf16_weights_through_generate_equal_step_by_step_decode(model):
    """The engine's bf16 tokens are the argmax of the bf16 model's logits, step by step on
    one sequence (prefill through oneDNN, decode through the C layers)."""
    prompt = model.tokenizer.encode("List three colours:")
    engine = LLMEngine(model, EngineConfig(kv_cache_tokens=256, weights="bf16"))
    tokens = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))[0].token_ids
    served = engine.model
    pool = KVPool(model.config, 4, 16)  # native attention, as the engine's: the same path, so exact
    logits = served(torch.tensor([prompt]), cache=PagedBatch(pool, [[0, 1, 2, 3]], [0], [len(prompt)]))[0, -1]
    want = [int(logits.argmax())]
    for i in range(7):
        batch = PagedBatch(pool, [[0, 1, 2, 3]], [len(prompt) + i], [1])
        want.append(int(served(torch.tensor([[want[-1]]]), cache=batch)[0, -1].argmax()))
    assert tokens == want
    assert isinstance(served, Llama)


# Largest logit difference between passes of 4 rows (a verification's) and steps of one row
# over the same tokens on the file's blocks with a bfloat16 cache: 0.034, measured on an
# AVX-512/AMX Xeon on the prompt below (the cache rounds each row's keys to bfloat16, which
# carries a last-bit difference on). The plain run's smallest top-two margin there is 0.0063.
SPECULATIVE_BF16_LOGIT_ERROR = 0.07


@needs_kernels
def test_speculative_decoding_over_a_bf16_cache_is_greedy_decoding_over_one(model):
    """Speculative decoding (prompt lookup, 3 guesses a verification) on the file's blocks
    with a bfloat16 KV cache gives the tokens of plain greedy decoding, one token a step,
    on the same blocks and the same cache dtype, up to the near-tie rule (other row counts
    are another numerical path); and the cache is bfloat16 indeed."""
    from labkit.engine.speculative import NgramDrafter, speculative_generate
    from labkit.models.llama import KVCache

    served = backend_for(True, "gguf").prepare(model)
    prompt = model.tokenizer.encode("one two three four, one two three four, one two")
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    got, stats = speculative_generate(served, prompt, params, NgramDrafter(), k=3, kv_dtype=torch.bfloat16)
    cache = KVCache.empty(model.config, 1, 64, torch.bfloat16)
    logits = served(torch.tensor([prompt]), cache=cache)[0, -1]
    want, scores = [int(logits.argmax())], [logits]
    while len(want) < 16:
        scores.append(served(torch.tensor([[want[-1]]]), cache=cache)[0, -1])
        want.append(int(scores[-1].argmax()))
    assert stats.accepted > 0 and cache.keys.dtype == torch.bfloat16
    # a verification reads 4 rows at once, plain decoding one: another order of the sums
    assert_greedy_near([want], [got], [torch.stack(scores)], SPECULATIVE_BF16_LOGIT_ERROR,
                       what="speculative against plain greedy over a bf16 cache")
