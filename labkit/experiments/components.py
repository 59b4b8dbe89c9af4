"""Where a transformer's parameters, FLOPs and time go, component by component (chapter 4).

Three kinds of accounting for the two hand-written forward passes
(:mod:`labkit.models.llama`, :mod:`labkit.models.gpt2`):

- **parameters** per component, in closed form from the config
  (:func:`llama_component_params`, :func:`gpt2_component_params`); they add up to
  ``model.num_parameters()``.
- **FLOPs** per component for ``new_tokens`` tokens that follow ``context`` cached tokens
  (:func:`llama_component_flops`, :func:`gpt2_component_flops`). A multiply-add is 2 FLOPs.
  Matrix products are counted exactly; element-wise work (norms, RoPE, softmax, the MLP
  activation, residual adds) by a stated convention (:data:`ELEMENTWISE_FLOPS`), since
  "how many FLOPs is an exp" has no single answer.
- **time** per component (:func:`time_llama_components`): each operation of the Llama
  forward pass run on its own, over all layers, with the model's real weights, through
  :func:`labkit.util.timing.measure`; and the whole pass (:func:`llama_forward_call`).
  :func:`share_follows` says which of two predicted shares (bytes, FLOPs) a measured time
  share follows, or that its range cannot tell.

Plus :func:`agreement`, the check of our logits against a reference's, and
:func:`gguf_raw_rope_rows`, the Q/K weights as a GGUF file stores them (before the
un-permutation that :func:`labkit.models.gguf_file.unpermute_rope_rows` performs).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from labkit.models.gguf_file import LlamaConfig

# FLOPs per element for element-wise work (a convention; exp and rsqrt count as one FLOP).
ELEMENTWISE_FLOPS = {
    "norm": 4,  # RMSNorm: square, sum, times rsqrt, times weight (LayerNorm: about the same)
    "rope": 3,  # x * cos + rotate(x) * sin
    "softmax": 5,  # max, subtract, exp, sum, divide (per attention score)
    "silu_mul": 5,  # sigmoid (negate-exp, add, divide), times gate, times up
    "gelu": 8,  # tanh approximation: cube, two mul, add, tanh, add, two mul
    "residual": 1,  # one add per element
}

# Components whose FLOPs are matrix products (what torch's FlopCounterMode counts).
MATMUL_COMPONENTS = ("q_proj", "k_proj", "v_proj", "o_proj", "attn_scores",
                     "attn_weighted_sum", "mlp_gate", "mlp_up", "mlp_down", "mlp_fc",
                     "mlp_proj", "lm_head")

LLAMA_COMPONENTS = ("embedding", "q_proj", "k_proj", "v_proj", "rope", "attn_scores",
                    "attn_softmax", "attn_weighted_sum", "o_proj", "mlp_gate", "mlp_up",
                    "mlp_act", "mlp_down", "norms", "residual", "lm_head")

GPT2_COMPONENTS = ("embedding", "positions", "q_proj", "k_proj", "v_proj", "attn_scores",
                   "attn_softmax", "attn_weighted_sum", "o_proj", "mlp_fc", "mlp_act",
                   "mlp_proj", "norms", "residual", "lm_head")


# --------------------------------------------------------------------------------------
# Parameters
# --------------------------------------------------------------------------------------


def llama_component_params(config: LlamaConfig) -> dict[str, int]:
    """Learned parameters per component of a Llama (all layers together).

    A tied LM head is the embedding matrix and adds 0; components without weights
    (RoPE, attention scores, softmax, activation, residual adds) are listed with 0.
    """
    c = config
    E, D, L = c.hidden_size, c.head_dim, c.num_layers
    params = dict.fromkeys(LLAMA_COMPONENTS, 0)
    params.update(
        embedding=c.vocab_size * E,
        q_proj=L * c.num_heads * D * E,
        k_proj=L * c.num_kv_heads * D * E,
        v_proj=L * c.num_kv_heads * D * E,
        o_proj=L * E * c.num_heads * D,
        mlp_gate=L * c.intermediate_size * E,
        mlp_up=L * c.intermediate_size * E,
        mlp_down=L * E * c.intermediate_size,
        norms=(2 * L + 1) * E,
        lm_head=0 if c.tie_word_embeddings else c.vocab_size * E,
    )
    return params


def llama_decode_bytes(config: LlamaConfig, context: int, *, bytes_per_value: int = 4) -> dict[str, int]:
    """Bytes one decode step at position ``context`` reads from memory, in two parts:
    ``weights``, every learned parameter once (a tied LM head is the embedding, read once
    for the logits; the embedding lookup itself reads one row and is not counted again), and
    ``kv_cache``, the cached keys and values of ``context`` positions in every layer."""
    c = config
    weights = sum(llama_component_params(c).values()) * bytes_per_value
    kv_cache = 2 * c.num_layers * context * c.num_kv_heads * c.head_dim * bytes_per_value
    return {"weights": weights, "kv_cache": kv_cache}


def gpt2_component_params(config) -> dict[str, int]:
    """Learned parameters per component of a GPT-2 (:class:`labkit.models.gpt2.GPT2Config`),
    biases included with their projection; the tied LM head adds 0."""
    E, H, L = config.n_embd, config.n_inner, config.n_layer
    params = dict.fromkeys(GPT2_COMPONENTS, 0)
    params.update(
        embedding=config.vocab_size * E,
        positions=config.n_positions * E,
        q_proj=L * (E * E + E),
        k_proj=L * (E * E + E),
        v_proj=L * (E * E + E),
        o_proj=L * (E * E + E),
        mlp_fc=L * (H * E + H),
        mlp_proj=L * (E * H + E),
        norms=(2 * L + 1) * 2 * E,
    )
    return params


# --------------------------------------------------------------------------------------
# FLOPs
# --------------------------------------------------------------------------------------


def _attended_keys(new_tokens: int, context: int, attention: str) -> int:
    """Sum over the new tokens of the number of keys each one's scores are computed for.

    ``"causal"``: token i (0-based among the new ones) sees context + i + 1 keys, what the
    mathematics needs. SDPA's CPU kernel, handed the causal flag for a whole prompt by
    :func:`labkit.models.llama.grouped_attention`, computes more: whole 512-key blocks up to
    the diagonal, so the whole square up to 512 tokens
    (:func:`labkit.experiments.causal_blocks.kernel_scored_pairs`). ``"rectangle"``: every
    new token is scored against all
    context + new_tokens keys and the future ones are masked afterwards, what a kernel
    given an explicit mask multiplies (ours for a chunk after cached positions, GPT-2's
    naive attention) and what SDPA's math backend multiplies even with the causal flag.
    """
    if attention == "causal":
        return new_tokens * context + new_tokens * (new_tokens + 1) // 2
    if attention == "rectangle":
        return new_tokens * (context + new_tokens)
    raise ValueError(f"attention must be 'causal' or 'rectangle', not {attention!r}")


def llama_component_flops(config: LlamaConfig, new_tokens: int, context: int = 0, *,
                          last_only: bool = False, attention: str = "causal") -> dict[str, int]:
    """FLOPs per component (all layers) of one Llama forward pass over ``new_tokens`` tokens
    at positions ``context .. context + new_tokens - 1`` (batch 1).

    A decode step is ``new_tokens=1, context=p``; a prefill of n tokens is
    ``new_tokens=n, context=0``. ``last_only=True`` applies the final norm and LM head to
    the last position only (what generation does in prefill). ``attention`` is
    ``"causal"`` or ``"rectangle"`` (see :func:`_attended_keys`). Matrix products count
    2 FLOPs per multiply-add; element-wise work follows :data:`ELEMENTWISE_FLOPS`;
    the embedding lookup is 0 FLOPs.
    """
    c = config
    T, E, D, L, I = new_tokens, c.hidden_size, c.head_dim, c.num_layers, c.intermediate_size
    Hq, Hkv = c.num_heads, c.num_kv_heads
    keys = _attended_keys(T, context, attention)
    head_tokens = 1 if last_only else T
    ew = ELEMENTWISE_FLOPS
    flops = dict.fromkeys(LLAMA_COMPONENTS, 0)
    flops.update(
        q_proj=L * 2 * T * E * Hq * D,
        k_proj=L * 2 * T * E * Hkv * D,
        v_proj=L * 2 * T * E * Hkv * D,
        rope=L * ew["rope"] * T * (Hq + Hkv) * D,
        attn_scores=L * 2 * Hq * D * keys,
        attn_softmax=L * ew["softmax"] * Hq * keys,
        attn_weighted_sum=L * 2 * Hq * D * keys,
        o_proj=L * 2 * T * Hq * D * E,
        mlp_gate=L * 2 * T * E * I,
        mlp_up=L * 2 * T * E * I,
        mlp_act=L * ew["silu_mul"] * T * I,
        mlp_down=L * 2 * T * I * E,
        norms=ew["norm"] * E * (2 * L * T + head_tokens),
        residual=L * ew["residual"] * 2 * T * E,
        lm_head=2 * head_tokens * E * c.vocab_size,
    )
    return flops


def gpt2_component_flops(config, tokens: int, *, attention: str = "causal") -> dict[str, int]:
    """FLOPs per component (all layers) of one GPT-2 forward pass over ``tokens`` tokens
    (no cache, logits at every position). Bias adds are left out of the matrix products
    (as torch's FlopCounterMode leaves them out of ``addmm``); the lookups are 0 FLOPs.
    GPT-2's own attention computes the full ``"rectangle"`` of scores, then masks it."""
    T, E, H, L, nh = tokens, config.n_embd, config.n_inner, config.n_layer, config.n_head
    keys = _attended_keys(T, 0, attention)
    ew = ELEMENTWISE_FLOPS
    flops = dict.fromkeys(GPT2_COMPONENTS, 0)
    flops.update(
        q_proj=L * 2 * T * E * E,
        k_proj=L * 2 * T * E * E,
        v_proj=L * 2 * T * E * E,
        attn_scores=L * 2 * E * keys,  # nh heads x head_dim = E
        attn_softmax=L * ew["softmax"] * nh * keys,
        attn_weighted_sum=L * 2 * E * keys,
        o_proj=L * 2 * T * E * E,
        mlp_fc=L * 2 * T * E * H,
        mlp_act=L * ew["gelu"] * T * H,
        mlp_proj=L * 2 * T * H * E,
        norms=ew["norm"] * E * (2 * L + 1) * T,
        residual=L * ew["residual"] * 2 * T * E,
        lm_head=2 * T * E * config.vocab_size,
    )
    return flops


def matmul_flops(flops: dict[str, int]) -> int:
    """The part of a per-component FLOP count that is matrix products."""
    return sum(v for k, v in flops.items() if k in MATMUL_COMPONENTS)


def counted_flops(fn: Callable[[], object], math_attention: bool = True) -> int:
    """FLOPs of ``fn()`` as torch's ``FlopCounterMode`` counts them (matrix products only).

    With ``math_attention`` the call runs under the math backend of
    ``scaled_dot_product_attention``, which is made of matmuls the counter sees; with the
    default CPU kernel the counter does not see attention at all.
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with counter:
        if math_attention:
            with sdpa_kernel(SDPBackend.MATH):
                fn()
        else:
            fn()
    return int(counter.get_total_flops())


# --------------------------------------------------------------------------------------
# Agreement with a reference
# --------------------------------------------------------------------------------------


def agreement(ours: torch.Tensor, reference: torch.Tensor, tol: float = 1e-3) -> dict:
    """Compare two logit tensors of the same shape ``[..., vocab]``.

    Returns ``max_abs_diff``, ``max_abs_logit`` (the reference's scale), ``argmax_equal``
    (positions whose highest-scoring entry is the same) out of ``positions``,
    ``argmax_excused`` (positions whose argmax differs at a near-tie: the reference's gap
    between its argmax and ours within twice the measured difference,
    :func:`labkit.util.near_tie.flip_tolerance`, which a difference of rounding can close),
    and ``passed``: max |difference| <= ``tol`` and the same argmax at every position but the
    excused ones (the near-tie rule: another machine's rounding may break such a tie the other
    way).
    """
    from labkit.util.near_tie import flip_tolerance

    if ours.shape != reference.shape:
        raise ValueError(f"shapes differ: {tuple(ours.shape)} vs {tuple(reference.shape)}")
    a, b = ours.detach().float(), reference.detach().float()
    diff = (a - b).abs().max().item()
    ours_best, ref_best = a.argmax(-1), b.argmax(-1)
    same = ours_best == ref_best
    equal, positions = int(same.sum()), same.numel()
    gap = b.gather(-1, ref_best.unsqueeze(-1)) - b.gather(-1, ours_best.unsqueeze(-1))
    excused = int(((~same) & (gap.squeeze(-1) <= flip_tolerance(diff))).sum())
    return {
        "max_abs_diff": diff,
        "max_abs_logit": b.abs().max().item(),
        "argmax_equal": equal,
        "argmax_excused": excused,
        "positions": positions,
        "passed": bool(diff <= tol and equal + excused == positions),
    }


# --------------------------------------------------------------------------------------
# The GGUF's raw Q/K rows (for the un-permutation experiment)
# --------------------------------------------------------------------------------------


def permute_rope_rows(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """llama.cpp's row permutation of a Q or K projection (halves -> interleaved): the
    inverse of :func:`labkit.models.gguf_file.unpermute_rope_rows`."""
    rows = weight.shape[0]
    half = rows // n_heads // 2
    w = weight.reshape(n_heads, 2, half, *weight.shape[1:])
    return w.transpose(1, 2).reshape(weight.shape)


def gguf_raw_rope_rows(name: str = "smollm2-135m") -> dict[str, torch.Tensor]:
    """Every layer's ``q_proj``/``k_proj`` weight (Hugging Face names, float32) exactly as the
    GGUF file stores it: dequantized, but with llama.cpp's interleaved row order left in."""
    import gguf

    from labkit.models import registry
    from labkit.models.gguf_file import hf_name, open_reader

    reader = open_reader(registry.fetch(name))
    out = {}
    for t in reader.tensors:
        if ".attn_q." in t.name or ".attn_k." in t.name:
            w = gguf.quants.dequantize(t.data, t.tensor_type).astype("float32", copy=False)
            shape = tuple(int(d) for d in reversed(t.shape.tolist()))
            out[hf_name(t.name)] = torch.from_numpy(w.reshape(shape).copy())
    return out


# --------------------------------------------------------------------------------------
# Time per component
# --------------------------------------------------------------------------------------

TIMED_COMPONENTS = ("embedding", "norms", "qkv_proj", "rope", "kv_cache_write", "attention",
                    "head_merge", "o_proj", "residual", "mlp_gate_up", "mlp_act", "mlp_down",
                    "lm_head")


def _inputs(model, new_tokens: int, context: int, seed: int):
    """Token ids and a cache holding ``context`` random positions (room for the new ones)."""
    c = model.config
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, c.vocab_size, (1, new_tokens), generator=gen)
    cache = model.new_cache(1, context + new_tokens)
    cache.keys.normal_(generator=gen)
    cache.values.normal_(generator=gen)
    cache.length = context
    return ids, cache


def llama_forward_call(model, new_tokens: int, context: int = 0, *, last_only: bool = True,
                       seed: int = 0) -> Callable[[], torch.Tensor]:
    """A no-argument callable running the whole forward pass over ``new_tokens`` random
    tokens after ``context`` cached positions (the cache is rewound before every call, so
    the call can be repeated). ``new_tokens=1`` is a decode step at position ``context``."""
    ids, cache = _inputs(model, new_tokens, context, seed)

    def run() -> torch.Tensor:
        cache.length = context
        return model(ids, cache=cache, last_only=last_only)

    return run


def llama_component_calls(model, new_tokens: int, context: int = 0, *, last_only: bool = True,
                          seed: int = 0) -> dict[str, Callable[[], object]]:
    """One callable per operation of :meth:`labkit.models.llama.Llama.forward`, each running
    that operation alone for every layer (with that layer's weights and KV cache), on
    inputs of the shapes and memory layouts the real pass gives it. Together the calls
    do the work of one forward pass, split by component (:data:`TIMED_COMPONENTS`)."""
    from labkit.models.llama import apply_rope, grouped_attention, rms_norm

    c = model.config
    layers = model.layers
    B, T, start, eps = 1, new_tokens, context, c.rms_norm_eps
    q_width, kv_width = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    ids, cache = _inputs(model, new_tokens, context, seed)
    with torch.inference_mode():
        # One pass through layer 0 gives activations of the right shape and layout.
        cos, sin = model.rope_cos[start:start + T], model.rope_sin[start:start + T]
        x = F.embedding(ids, model.embed)
        h = rms_norm(x, layers[0].attn_norm, eps)

        def split_heads(qkv):
            q, k, v = qkv.split([q_width, kv_width, kv_width], dim=-1)
            q = q.view(B, T, c.num_kv_heads, c.group_size, c.head_dim).permute(0, 2, 3, 1, 4)
            k = k.view(B, T, c.num_kv_heads, c.head_dim).transpose(1, 2)
            v = v.view(B, T, c.num_kv_heads, c.head_dim).transpose(1, 2)
            return q, k, v

        q, k, v = split_heads(F.linear(h, layers[0].qkv))
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        attn = grouped_attention(q, cache.keys[0, :B, :, :start + T],
                                 cache.values[0, :B, :, :start + T], start)
        merged = attn.permute(0, 3, 1, 2, 4).reshape(B, T, q_width)
        o = F.linear(merged, layers[0].o_proj)
        h2 = rms_norm(x + o, layers[0].mlp_norm, eps)
        gate, up = F.linear(h2, layers[0].gate_up).chunk(2, dim=-1)
        act = F.silu(gate) * up
        final_in = x[:, -1:] if last_only else x
        final = rms_norm(final_in, model.final_norm, eps)

    def per_layer(op):
        def run():
            with torch.inference_mode():
                for index, layer in enumerate(layers):
                    op(index, layer)
        return run

    def write(index, _):
        cache.keys[index, :B, :, start:start + T] = k
        cache.values[index, :B, :, start:start + T] = v

    def norms():
        with torch.inference_mode():
            for layer in layers:
                rms_norm(x, layer.attn_norm, eps)
                rms_norm(x, layer.mlp_norm, eps)
            rms_norm(final_in, model.final_norm, eps)

    def embedding():
        with torch.inference_mode():
            F.embedding(ids, model.embed)

    def lm_head():
        with torch.inference_mode():
            F.linear(final, model.lm_head)

    return {
        "embedding": embedding,
        "norms": norms,
        "qkv_proj": per_layer(lambda i, L: split_heads(F.linear(h, L.qkv))),
        "rope": per_layer(lambda i, L: (apply_rope(q, cos, sin), apply_rope(k, cos, sin))),
        "kv_cache_write": per_layer(write),
        "attention": per_layer(lambda i, L: grouped_attention(
            q, cache.keys[i, :B, :, :start + T], cache.values[i, :B, :, :start + T], start)),
        "head_merge": per_layer(lambda i, L: attn.permute(0, 3, 1, 2, 4).reshape(B, T, q_width)),
        "o_proj": per_layer(lambda i, L: F.linear(merged, L.o_proj)),
        "residual": per_layer(lambda i, L: (x + o, x + o)),
        "mlp_gate_up": per_layer(lambda i, L: F.linear(h2, L.gate_up).chunk(2, dim=-1)),
        "mlp_act": per_layer(lambda i, L: F.silu(gate) * up),
        "mlp_down": per_layer(lambda i, L: F.linear(act, L.down)),
        "lm_head": lm_head,
    }


def time_llama_components(model, new_tokens: int, context: int = 0, *, repeats: int = 5,
                          warmup: int = 1, last_only: bool = True, threads: int | None = None,
                          seed: int = 0) -> list[dict]:
    """Time every component of the Llama forward pass in isolation
    (:func:`llama_component_calls`, summed over layers), each through
    :func:`labkit.util.timing.measure`. Returns one row per component: ``component``,
    ``median_s``, ``p25_s``, ``p75_s``, ``spread``, ``repeats``."""
    from labkit.util.timing import measure

    calls = llama_component_calls(model, new_tokens, context, last_only=last_only, seed=seed)
    rows = []
    for name, fn in calls.items():
        t = measure(fn, name=name, repeats=repeats, warmup=warmup, threads=threads)
        rows.append({"component": name, "median_s": t.median, "p25_s": t.quantile(0.25),
                     "p75_s": t.quantile(0.75), "spread": t.spread, "repeats": len(t.samples)})
    return rows


def share_follows(low: float, high: float, predicted: dict[str, float]) -> str | None:
    """Which of two predicted shares a measured time share follows, judged on its measured
    range [``low``, ``high``] (an interquartile range, say) so that noise cannot decide it.

    ``predicted`` names two shares (e.g. ``{"bytes": 0.042, "FLOPs": 0.118}``). With ``gap``
    the distance between them, a prediction's name is returned only when the whole range lies
    within a third of ``gap`` of it; ``"above"`` or ``"below"`` when the whole range lies more
    than a third of ``gap`` beyond both; ``None`` otherwise (between the two, or spanning
    more than one of these zones): too close to both to name one."""
    if low > high:
        raise ValueError(f"low {low} exceeds high {high}")
    if len(predicted) != 2:
        raise ValueError(f"two predicted shares, got {len(predicted)}")
    (name_lo, lo), (name_hi, hi) = sorted(predicted.items(), key=lambda kv: kv[1])
    zone = (hi - lo) / 3
    if zone <= 0:
        return None  # the two predictions coincide: no measurement can tell them apart
    if lo - zone <= low and high <= lo + zone:
        return name_lo
    if hi - zone <= low and high <= hi + zone:
        return name_hi
    if low > hi + zone:
        return "above"
    if high < lo - zone:
        return "below"
    return None


__all__ = [
    "ELEMENTWISE_FLOPS", "MATMUL_COMPONENTS", "LLAMA_COMPONENTS", "GPT2_COMPONENTS",
    "TIMED_COMPONENTS", "llama_component_params", "gpt2_component_params",
    "llama_decode_bytes",
    "llama_component_flops", "gpt2_component_flops", "matmul_flops", "counted_flops",
    "agreement", "permute_rope_rows", "gguf_raw_rope_rows", "llama_forward_call",
    "llama_component_calls", "time_llama_components", "share_follows",
]
