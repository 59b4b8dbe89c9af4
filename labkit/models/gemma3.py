"""The Gemma 3 forward pass, written out by hand (Gemma 3 270M, the registry's second model).

    tokens -> embedding * sqrt(hidden)
           -> N x [RMSNorm -> attention (q/k RMSNorm, RoPE, local or global) -> RMSNorm -> +residual
                   RMSNorm -> GeGLU MLP -> RMSNorm -> +residual]
           -> RMSNorm -> tied LM head -> logits

What differs from the Llama of `labkit.models.llama`:
- every RMSNorm scales by (1 + w), w stored zero-centred as in Hugging Face (llama.cpp's
  GGUF stores 1 + w; `gemma3_state_dict` subtracts the 1, as transformers does on load);
- each sublayer's output is normalised before it joins the residual stream (four norms per
  layer), and queries and keys are RMS-normalised per head before RoPE;
- the embedding is multiplied by sqrt(hidden_size), rounded to the model's dtype first;
- attention scores are scaled by query_pre_attn_scalar ** -0.5 (256 ** -0.5 here, which
  happens to equal 1 / sqrt(head_dim)); the MLP is GeGLU, gelu(gate, tanh approx.) * up;
- five layers in six are local: they attend only to the last `sliding_window` positions
  (512), with RoPE base 10,000; every sixth (5, 11, 17) is global: every earlier position,
  base 1,000,000. `new_cache` keeps a ring of 512 slots per local layer
  (`RollingKVCache`), or, with rolling=False, every position with the window as a mask
  (`WindowedKVCache`, the reference semantics); the serving engine gives a local layer
  group's blocks back as the window passes them (`labkit.engine.kv_groups`);
- one KV head serves all four query heads, and head_dim (256) exceeds hidden / heads (160).

The GGUF stores neither the layer pattern, the local RoPE base nor the attention scalar:
`gemma3_config_from_gguf` assumes what transformers' GGUF loader assumes (see the constants).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from types import SimpleNamespace

import numpy as np
import torch
import torch.nn.functional as F

from labkit.models import gguf_file
from labkit.models.gguf_file import field_value
from labkit.models.llama import Weights, apply_rope, check_positions, linear, rms_norm, rope_tables
from labkit.models.window_cache import RollingKVCache, WindowedKVCache, windowed_attention

# Not in the GGUF: transformers (5.24) builds Gemma3TextConfig from the file with these
# defaults, and llama.cpp assumes the same values.
# - every 6th layer global: Gemma3TextConfig's sliding_window_pattern (6) sets layer_types;
#   llama.cpp: load_swa_pattern(ml, 6) in src/models/gemma3.cpp;
# - local RoPE base: Gemma3TextConfig.default_theta["local"]; llama.cpp: the default of
#   rope_freq_base_train_swa (src/llama-hparams.h), which a `gemma3.rope.freq_base_swa`
#   key overrides (newer converters write it; transformers ignores it);
# - query_pre_attn_scalar: Gemma3TextConfig's default; llama.cpp scales queries by
#   1 / sqrt(head_dim) for every Gemma 3 but the 27B: the same 1/16 here.
SLIDING_WINDOW_PATTERN = 6
LOCAL_ROPE_THETA = 10_000.0
QUERY_PRE_ATTN_SCALAR = 256.0


@dataclass(frozen=True)
class Gemma3Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    layer_windows: tuple[int | None, ...]  # per layer: keys a query sees (its own included), None: all
    local_rope_theta: float  # RoPE base of the sliding-window layers
    global_rope_theta: float  # RoPE base of the global layers
    query_pre_attn_scalar: float
    tie_word_embeddings: bool = True
    bos_token_id: int | None = None
    eos_token_id: int | None = None

    def __post_init__(self):
        # config.json gives a list back: keep the config hashable and equal to the GGUF's.
        object.__setattr__(self, "layer_windows", tuple(self.layer_windows))

    @property
    def group_size(self) -> int:
        """How many query heads share one key/value head."""
        return self.num_heads // self.num_kv_heads

    @property
    def attention_scale(self) -> float:
        return self.query_pre_attn_scalar ** -0.5

    def to_dict(self) -> dict:
        return asdict(self)


def gemma3_config_from_gguf(reader) -> Gemma3Config:
    arch = field_value(reader, "general.architecture")
    if arch != "gemma3":
        raise ValueError(f"expected a gemma3 GGUF, this file's architecture is {arch!r}")

    def meta(key: str, default=None):
        return field_value(reader, f"gemma3.{key}", default)

    layers, window = int(meta("block_count")), int(meta("attention.sliding_window"))
    tokens = reader.fields["tokenizer.ggml.tokens"]
    return Gemma3Config(
        vocab_size=int(meta("vocab_size", len(tokens.data))),
        hidden_size=int(meta("embedding_length")),
        intermediate_size=int(meta("feed_forward_length")),
        num_layers=layers,
        num_heads=int(meta("attention.head_count")),
        num_kv_heads=int(meta("attention.head_count_kv")),
        head_dim=int(meta("attention.key_length")),
        rms_norm_eps=float(meta("attention.layer_norm_rms_epsilon")),
        max_position_embeddings=int(meta("context_length")),
        layer_windows=tuple(None if (i + 1) % SLIDING_WINDOW_PATTERN == 0 else window
                            for i in range(layers)),
        local_rope_theta=float(meta("rope.freq_base_swa", LOCAL_ROPE_THETA)),
        global_rope_theta=float(meta("rope.freq_base")),
        query_pre_attn_scalar=QUERY_PRE_ATTN_SCALAR,
        tie_word_embeddings="output.weight" not in {t.name for t in reader.tensors},
        bos_token_id=field_value(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=field_value(reader, "tokenizer.ggml.eos_token_id"),
    )


GGUF_TO_HF_LAYER = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_output": "self_attn.o_proj",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "post_ffw_norm": "post_feedforward_layernorm",
}


def hf_name(gguf_name: str) -> str:
    """A GGUF tensor name -> the Hugging Face Gemma 3 name (our cache uses HF names)."""
    return gguf_file.hf_name(gguf_name, GGUF_TO_HF_LAYER)


def gemma3_state_dict(reader) -> dict[str, np.ndarray]:
    """Every tensor of the file as float32, in Hugging Face names and conventions.

    llama.cpp's converter stores every norm weight as 1 + w; we subtract the 1 back, as
    transformers does on load. No row permutation to undo: llama.cpp runs Gemma with the
    same RoPE layout as Hugging Face (pairs i, i + head_dim/2), so it stores q/k unpermuted.
    """
    import gguf

    state = {}
    for t in reader.tensors:
        weight = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        weight = weight.reshape(tuple(int(d) for d in reversed(t.shape.tolist())))
        if t.name.endswith("norm.weight"):
            weight = weight - np.float32(1.0)
        state[hf_name(t.name)] = np.ascontiguousarray(weight)
    return state


# -- the forward pass ------------------------------------------------------------------------
def gemma_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm: scale by (1 + weight) in float32 and round to x's dtype only after
    the scale, as transformers' Gemma3RMSNorm does (Llama's rounds before it)."""
    return rms_norm(x.float(), 1.0 + weight.float(), eps).to(x.dtype)


def decoder_layer(c: Gemma3Config, layer: "Gemma3LayerWeights", x: torch.Tensor,
                  rope: tuple[torch.Tensor, torch.Tensor], index: int,
                  cache: RollingKVCache | WindowedKVCache | None = None) -> torch.Tensor:
    """Layer `index` on hidden states x [B, T, hidden]; `rope` holds the cos/sin of the new
    positions in this layer's RoPE base."""
    batch, steps, _ = x.shape
    q_width, kv_width = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    h = gemma_norm(x, layer.attn_norm, c.rms_norm_eps)
    q, k, v = linear(h, layer.qkv).split([q_width, kv_width, kv_width], dim=-1)
    # [B, T, heads*D] -> [B, kv_heads, group, T, D] for q; [B, kv_heads, T, D] for k, v
    q = q.view(batch, steps, c.num_kv_heads, c.group_size, c.head_dim).permute(0, 2, 3, 1, 4)
    k = k.view(batch, steps, c.num_kv_heads, c.head_dim).transpose(1, 2)
    v = v.view(batch, steps, c.num_kv_heads, c.head_dim).transpose(1, 2)
    q = apply_rope(gemma_norm(q, layer.q_norm, c.rms_norm_eps), *rope)
    k = apply_rope(gemma_norm(k, layer.k_norm, c.rms_norm_eps), *rope)
    if cache is not None:
        attn = cache.attend(index, q, k, v)
    else:
        attn = windowed_attention(q, k, v, 0, c.layer_windows[index], c.attention_scale)
    attn = attn.permute(0, 3, 1, 2, 4).reshape(batch, steps, q_width)
    x = x + gemma_norm(linear(attn, layer.o_proj), layer.post_attn_norm, c.rms_norm_eps)
    h = gemma_norm(x, layer.mlp_norm, c.rms_norm_eps)
    gate, up = linear(h, layer.gate_up).chunk(2, dim=-1)
    mlp = linear(F.gelu(gate, approximate="tanh") * up, layer.down)
    return x + gemma_norm(mlp, layer.post_mlp_norm, c.rms_norm_eps)


def _own_copy(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # Tensors read from safetensors sit at unaligned offsets of one buffer; a fresh
    # allocation is 64-byte aligned (an unaligned weight slows matmuls, see llama.py).
    return t.to(dtype=dtype, memory_format=torch.contiguous_format, copy=True)


class Gemma3LayerWeights(Weights):
    """One decoder layer: six norm vectors and four matrices (q/k/v and gate/up fused)."""

    WEIGHTS = ("attn_norm", "qkv", "q_norm", "k_norm", "o_proj", "post_attn_norm",
               "mlp_norm", "gate_up", "down", "post_mlp_norm")

    def __init__(self, state: dict[str, torch.Tensor], prefix: str, dtype: torch.dtype):
        super().__init__()

        def w(name: str) -> torch.Tensor:
            return _own_copy(state[prefix + name], dtype)

        self.attn_norm = w("input_layernorm.weight")
        self.qkv = torch.cat([w(f"self_attn.{n}_proj.weight") for n in "qkv"])
        self.q_norm = w("self_attn.q_norm.weight")
        self.k_norm = w("self_attn.k_norm.weight")
        self.o_proj = w("self_attn.o_proj.weight")
        self.post_attn_norm = w("post_attention_layernorm.weight")
        self.mlp_norm = w("pre_feedforward_layernorm.weight")
        self.gate_up = torch.cat([w("mlp.gate_proj.weight"), w("mlp.up_proj.weight")])
        self.down = w("mlp.down_proj.weight")
        self.post_mlp_norm = w("post_feedforward_layernorm.weight")


class Gemma3(Weights):
    """A Gemma 3 decoder. Call it on token ids [batch, seq] for logits [batch, seq, vocab].

    As `Llama`: frozen parameters (`lm_head` is the `embed` Parameter itself), and the RoPE
    tables (one pair per base) and the embedding scale are buffers left out of the state
    dict, so `.to(dtype)` / `.to(device)` moves them all."""

    WEIGHTS = ("embed", "lm_head", "final_norm")

    def __init__(self, config: Gemma3Config, state: dict[str, torch.Tensor],
                 dtype: torch.dtype = torch.float32, rope_len: int | None = None):
        super().__init__()
        self.config = c = config
        self.embed = _own_copy(state["model.embed_tokens.weight"], dtype)
        self.lm_head = self.embed if c.tie_word_embeddings else _own_copy(state["lm_head.weight"], dtype)
        self.final_norm = _own_copy(state["model.norm.weight"], dtype)
        self.layers = torch.nn.ModuleList(
            Gemma3LayerWeights(state, f"model.layers.{i}.", dtype) for i in range(c.num_layers))
        # transformers multiplies by sqrt(hidden) rounded to the weights' dtype (55.5, not
        # 55.43, for a 3072-wide Gemma in bfloat16); a buffer in that dtype does the same.
        self.register_buffer("embed_scale", torch.tensor(c.hidden_size ** 0.5).to(dtype),
                             persistent=False)
        length = rope_len or c.max_position_embeddings
        for kind, theta in (("local", c.local_rope_theta), ("global", c.global_rope_theta)):
            # rope_tables reads only head_dim and rope_theta from its config
            cos, sin = rope_tables(SimpleNamespace(head_dim=c.head_dim, rope_theta=theta), length)
            self.register_buffer(f"rope_cos_{kind}", cos.to(dtype), persistent=False)
            self.register_buffer(f"rope_sin_{kind}", sin.to(dtype), persistent=False)
        self.tokenizer = None  # set by the loader

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, cache: RollingKVCache | WindowedKVCache | None = None,
                last_only: bool = False, rows: torch.Tensor | None = None) -> torch.Tensor:
        # Logits [batch, seq, vocab] for token ids [batch, seq], as `Llama.forward`.
        c = self.config
        steps = input_ids.shape[1]
        if cache is not None:
            positions = cache.positions(steps, self.max_positions)
        else:
            check_positions(steps, self.max_positions)
            positions = torch.arange(steps, device=input_ids.device)
        local_rope = self.rope_cos_local[positions], self.rope_sin_local[positions]
        global_rope = self.rope_cos_global[positions], self.rope_sin_global[positions]
        x = F.embedding(input_ids, self.embed) * self.embed_scale
        for index, layer in enumerate(self.layers):
            rope = global_rope if c.layer_windows[index] is None else local_rope
            x = decoder_layer(c, layer, x, rope, index, cache)
        if cache is not None:
            cache.advance(steps)
        if last_only:
            x = x[:, -1:]
        elif rows is not None:
            x = x[:, rows]
        x = gemma_norm(x, self.final_norm, c.rms_norm_eps)
        return linear(x, self.lm_head)

    @property
    def max_positions(self) -> int:
        """How many positions the RoPE tables cover: the longest sequence this model runs."""
        return self.rope_cos_local.shape[0]

    @property
    def device(self) -> torch.device:
        return self.embed.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    def num_parameters(self) -> int:
        """Learned parameters, counting the tied embedding/LM head once."""
        return sum(p.numel() for p in self.parameters())

    def new_cache(self, batch: int = 1, max_len: int = 2048, rolling: bool = True) -> RollingKVCache | WindowedKVCache:
        """A cache for `max_len` positions: a ring of `window` slots per sliding-window layer
        (`rolling`), or every position in every layer with the windows as masks."""
        if rolling:
            return RollingKVCache(self.config, batch, max_len, self.dtype, self.device)
        return WindowedKVCache.empty(self.config, batch, max_len, self.dtype, self.device)
