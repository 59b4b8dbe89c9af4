"""Per-component accounting (labkit.experiments.components): parameters, FLOPs, agreement, timing."""

import numpy as np
import pytest
import torch

from labkit.experiments import components as comp
from labkit.models.gguf_file import LlamaConfig, unpermute_rope_rows
from labkit.models.gpt2 import GPT2, GPT2Config
from labkit.models.llama import Llama

SMOLLM2 = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                      num_heads=9, num_kv_heads=3, head_dim=64, rope_theta=100000.0,
                      rms_norm_eps=1e-5, max_position_embeddings=8192)
TINY = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=48, num_layers=2,
                   num_heads=4, num_kv_heads=2, head_dim=8, rope_theta=10000.0,
                   rms_norm_eps=1e-5, max_position_embeddings=64)
TINY_GPT2 = GPT2Config(vocab_size=101, n_positions=32, n_embd=24, n_layer=2, n_head=3)


def random_llama_state(config: LlamaConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights under Hugging Face Llama names."""
    c, gen = config, torch.Generator().manual_seed(seed)
    E, D, I = c.hidden_size, c.head_dim, c.intermediate_size

    def r(*shape):
        return torch.randn(*shape, generator=gen) * 0.1

    state = {"model.embed_tokens.weight": r(c.vocab_size, E), "model.norm.weight": 1 + r(E)}
    if not c.tie_word_embeddings:
        state["lm_head.weight"] = r(c.vocab_size, E)
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        state |= {
            p + "input_layernorm.weight": 1 + r(E),
            p + "post_attention_layernorm.weight": 1 + r(E),
            p + "self_attn.q_proj.weight": r(c.num_heads * D, E),
            p + "self_attn.k_proj.weight": r(c.num_kv_heads * D, E),
            p + "self_attn.v_proj.weight": r(c.num_kv_heads * D, E),
            p + "self_attn.o_proj.weight": r(E, c.num_heads * D),
            p + "mlp.gate_proj.weight": r(I, E),
            p + "mlp.up_proj.weight": r(I, E),
            p + "mlp.down_proj.weight": r(E, I),
        }
    return state


@pytest.fixture(scope="module")
def tiny():
    return Llama(TINY, random_llama_state(TINY))


# --- parameters ---------------------------------------------------------------------------

def test_smollm2_parameters_sum_to_the_model_count():
    params = comp.llama_component_params(SMOLLM2)
    assert sum(params.values()) == 134_515_008
    assert params["lm_head"] == 0  # tied: the embedding is the head
    assert params["embedding"] == 49152 * 576
    assert set(params) == set(comp.LLAMA_COMPONENTS)


@pytest.mark.parametrize("tied", [True, False])
def test_tiny_llama_parameters_match_num_parameters(tied):
    from dataclasses import replace

    config = replace(TINY, tie_word_embeddings=tied)
    model = Llama(config, random_llama_state(config))
    assert sum(comp.llama_component_params(config).values()) == model.num_parameters()


def test_gpt2_parameters_sum_to_124m():
    params = comp.gpt2_component_params(GPT2Config())
    assert sum(params.values()) == 124_439_808
    for config in (GPT2Config(), TINY_GPT2):
        meta = GPT2(config, device="meta")
        assert sum(comp.gpt2_component_params(config).values()) == meta.num_parameters()


# --- FLOPs --------------------------------------------------------------------------------

@pytest.mark.parametrize("new_tokens,context,last_only", [
    (1, 0, True), (1, 9, True), (7, 0, True), (7, 0, False), (3, 5, False)])
def test_llama_matmul_flops_equal_flop_counter(tiny, new_tokens, context, last_only):
    call = comp.llama_forward_call(tiny, new_tokens, context, last_only=last_only)
    flops = comp.llama_component_flops(TINY, new_tokens, context, last_only=last_only,
                                       attention="rectangle")
    assert comp.counted_flops(call) == comp.matmul_flops(flops)


def test_llama_flops_closed_form_for_smollm2():
    decode = comp.llama_component_flops(SMOLLM2, 1, 100)
    # a decode step: 2 FLOPs per weight of every matrix, plus attention over 101 keys
    linear = 2 * (134_515_008 - sum(comp.llama_component_params(SMOLLM2)[k] for k in ("norms",)))
    attention = 30 * 2 * 2 * 9 * 64 * 101
    assert comp.matmul_flops(decode) == linear + attention
    # the causal count of a prefill is about half the rectangle's attention work
    causal = comp.llama_component_flops(SMOLLM2, 64, 0)
    rect = comp.llama_component_flops(SMOLLM2, 64, 0, attention="rectangle")
    assert causal["attn_scores"] * 128 == rect["attn_scores"] * 65
    assert causal["q_proj"] == rect["q_proj"]
    with pytest.raises(ValueError):
        comp.llama_component_flops(SMOLLM2, 1, 0, attention="square")


def test_gpt2_matmul_flops_equal_flop_counter():
    model = GPT2.random(TINY_GPT2, seed=3).eval()
    ids = torch.randint(0, TINY_GPT2.vocab_size, (1, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        counted = comp.counted_flops(lambda: model(ids))
    flops = comp.gpt2_component_flops(TINY_GPT2, 11, attention="rectangle")
    assert counted == comp.matmul_flops(flops)


# --- agreement ----------------------------------------------------------------------------

def test_agreement_identical_and_within_tolerance():
    ref = torch.tensor([[[1.0, 5.0, -2.0], [0.0, -1.0, 3.0]]])
    report = comp.agreement(ref.clone(), ref)
    assert report == {"max_abs_diff": 0.0, "max_abs_logit": 5.0, "argmax_equal": 2,
                      "argmax_excused": 0, "positions": 2, "passed": True}
    near = ref + torch.tensor([0.0, 5e-4, 0.0])
    report = comp.agreement(near, ref)
    assert report["passed"] and report["max_abs_diff"] == pytest.approx(5e-4, rel=1e-3)


def test_agreement_excuses_an_argmax_flip_at_a_near_tie_and_counts_it():
    ref = torch.tensor([[1.0, 1.0002, 0.0], [2.0, 0.0, 0.0]])
    ours = torch.tensor([[1.0003, 1.0002, 0.0], [2.0, 0.0, 0.0]])  # a near tie flips
    report = comp.agreement(ours, ref)
    assert report["max_abs_diff"] < 1e-3
    assert report["argmax_equal"] == 1 and report["positions"] == 2
    assert report["argmax_excused"] == 1 and report["passed"]  # the gap 2e-4 <= 2 x 3e-4
    # a flip needs a difference at least half the reference's gap, so a wide flip fails the
    # tolerance on the difference itself
    wide = torch.tensor([[1.5, 1.0002, 0.0], [2.0, 0.0, 0.0]])
    report = comp.agreement(wide, ref)
    assert not report["passed"] and report["argmax_excused"] == 1


def test_agreement_fails_beyond_tolerance_and_checks_shapes():
    ref = torch.tensor([[0.0, 4.0]])
    assert not comp.agreement(ref + 0.01, ref)["passed"]
    assert comp.agreement(ref + 0.01, ref, tol=0.1)["passed"]
    with pytest.raises(ValueError, match="shapes differ"):
        comp.agreement(ref, ref[:, :1])


# --- the GGUF row permutation -------------------------------------------------------------

@pytest.mark.parametrize("heads", [1, 3, 9])
def test_permute_is_the_inverse_of_unpermute(heads):
    w = torch.randn(heads * 8, 5)
    permuted = comp.permute_rope_rows(w, heads)
    assert not torch.equal(permuted, w)
    back = unpermute_rope_rows(permuted.numpy(), heads)
    assert np.array_equal(back, w.numpy())


def test_wrongly_permuted_qk_weights_change_the_output():
    state = random_llama_state(TINY)
    ids = torch.arange(10)[None] % TINY.vocab_size
    good = Llama(TINY, state)(ids)
    bad_state = dict(state)
    for i in range(TINY.num_layers):
        for proj, heads in (("q", TINY.num_heads), ("k", TINY.num_kv_heads)):
            key = f"model.layers.{i}.self_attn.{proj}_proj.weight"
            bad_state[key] = comp.permute_rope_rows(state[key], heads)
    bad = Llama(TINY, bad_state)(ids)
    assert (good - bad).abs().max() > 1e-3
    # position 0 is not rotated, so the first position's logits are unchanged there
    assert torch.allclose(good[:, 0], bad[:, 0], atol=1e-5)


# --- timing -------------------------------------------------------------------------------

def test_forward_call_is_repeatable_and_matches_a_plain_pass(tiny):
    ids_call = comp.llama_forward_call(tiny, 6, 0, last_only=False, seed=4)
    first, second = ids_call(), ids_call()
    assert torch.equal(first, second)
    ids, _ = comp._inputs(tiny, 6, 0, seed=4)
    assert torch.allclose(first, tiny(ids), atol=1e-5)


@pytest.mark.parametrize("new_tokens,context", [(1, 6), (5, 0)])
def test_time_components_covers_every_operation(tiny, new_tokens, context):
    rows = comp.time_llama_components(tiny, new_tokens, context, repeats=2, warmup=0)
    assert [r["component"] for r in rows] == list(comp.TIMED_COMPONENTS)
    assert all(r["median_s"] > 0 and r["repeats"] == 2 for r in rows)


def test_gguf_raw_rows_are_the_permuted_form_of_our_weights():
    from labkit.models.loader import load_state_dict

    raw = comp.gguf_raw_rope_rows("smollm2-135m")
    state, config = load_state_dict("smollm2-135m")
    assert len(raw) == 2 * config.num_layers
    for key, heads in (("model.layers.0.self_attn.q_proj.weight", config.num_heads),
                       ("model.layers.29.self_attn.k_proj.weight", config.num_kv_heads)):
        assert raw[key].shape == state[key].shape
        assert not torch.equal(raw[key], state[key])
        assert torch.equal(comp.permute_rope_rows(state[key], heads), raw[key])


def test_llama_decode_bytes():
    out = comp.llama_decode_bytes(TINY, 10)
    assert out["weights"] == 4 * sum(comp.llama_component_params(TINY).values())
    assert out["kv_cache"] == 2 * TINY.num_layers * 10 * TINY.num_kv_heads * TINY.head_dim * 4
    assert comp.llama_decode_bytes(TINY, 0, bytes_per_value=2)["kv_cache"] == 0
    # SmolLM2 at position 512 in float32: 538 MB of weights, 23.6 MB of keys and values
    smol = comp.llama_decode_bytes(SMOLLM2, 512)
    assert round(smol["weights"] / 1e6) == 538 and round(smol["kv_cache"] / 1e5) == 236


def test_share_follows_names_a_prediction_only_when_the_whole_range_is_near_it():
    predicted = {"bytes": 0.042, "FLOPs": 0.118}  # chapter 4's decode attention, 512 positions
    # gap 0.076, a third of it 0.0253: FLOPs' zone is 0.0927-0.1433, bytes' 0.0167-0.0673
    assert comp.share_follows(0.10, 0.12, predicted) == "FLOPs"
    assert comp.share_follows(0.04, 0.05, predicted) == "bytes"
    # the chapter's run: 8.4% lies in the middle third, nearer FLOPs by less than a point
    assert comp.share_follows(0.082, 0.087, predicted) is None
    # a range that reaches from one zone into the middle cannot name either
    assert comp.share_follows(0.088, 0.10, predicted) is None
    assert comp.share_follows(0.20, 0.25, predicted) == "above"
    assert comp.share_follows(0.001, 0.010, predicted) == "below"
    # the order of the dict does not matter, and equal predictions cannot be told apart
    assert comp.share_follows(0.10, 0.12, {"FLOPs": 0.118, "bytes": 0.042}) == "FLOPs"
    assert comp.share_follows(0.10, 0.12, {"a": 0.1, "b": 0.1}) is None
    with pytest.raises(ValueError):
        comp.share_follows(0.2, 0.1, predicted)
