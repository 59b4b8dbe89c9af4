"""The Llama forward pass, written out by hand (SmolLM2 is a small Llama).

    tokens -> embedding -> N x [RMSNorm -> attention (RoPE, grouped KV) -> +residual
                                RMSNorm -> SwiGLU MLP -> +residual]
           -> RMSNorm -> tied LM head -> logits

The weights are frozen `nn.Parameter`s (and the RoPE tables non-persistent buffers), so
`.to()`, `.parameters()` and `state_dict()` see them; a weight can also be replaced by a
module that multiplies by it (a packed or quantized kernel, see `linear`). The Q/K/V
projections are fused into one matrix and the MLP's gate/up projections into another, so
a decode step makes fewer, larger calls.
Grouped-query attention never copies the shared key/value heads: SDPA reads each one for
the query heads that share it (see `grouped_attention`).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from labkit.models.gguf_file import LlamaConfig


@dataclass
class KVCache:
    """A contiguous KV cache: room for `max_len` positions, the first `length` filled. One
    of the three caches behind the `KVCacheView` contract (`labkit.engine.interfaces`)."""

    keys: torch.Tensor  # [layers, batch, kv_heads, max_len, head_dim]
    values: torch.Tensor
    length: int = 0

    @classmethod
    def empty(cls, config: LlamaConfig, batch: int, max_len: int,
              dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> "KVCache":
        shape = (config.num_layers, batch, config.num_kv_heads, max_len, config.head_dim)
        return cls(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))

    @property
    def max_len(self) -> int:
        return self.keys.shape[3]

    def nbytes(self, positions: int | None = None) -> int:
        """Bytes the cache holds for `positions` tokens (default: the filled length)."""
        per_position = self.keys[:, :, :, :1].nbytes + self.values[:, :, :, :1].nbytes
        return per_position * (self.length if positions is None else positions)

    # -- what the forward pass asks of a cache (the paged cache of labkit.engine answers
    #    the same three questions) ------------------------------------------------------
    def positions(self, steps: int, limit: int) -> torch.Tensor:
        """Positions of the `steps` new tokens: they follow the cached ones (all < limit)."""
        check_positions(self.length + steps, limit)
        return torch.arange(self.length, self.length + steps, device=self.keys.device)

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new keys and values of `layer` (in the cache's dtype) after the cached
        ones; return that layer's filled keys and values, new ones included."""
        batch, start, end = k.shape[0], self.length, self.length + k.shape[2]
        self.keys[layer, :batch, :, start:end] = k
        self.values[layer, :batch, :, start:end] = v
        return self.keys[layer, :batch, :, :end], self.values[layer, :batch, :, :end]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Store the new keys and values of `layer`, then attend over everything cached,
        read back in q's dtype."""
        keys, values = self.store(layer, k, v)
        return grouped_attention(q, keys.to(q.dtype), values.to(q.dtype), self.length)

    def advance(self, steps: int) -> None:
        self.length += steps


def check_positions(end: int, limit: int) -> None:
    if end > limit:
        raise ValueError(f"{end} positions exceed the model's {limit}-position RoPE table")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Normalise in float32 whatever the activation dtype, as the reference does.
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def rope_tables(config: LlamaConfig, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin for every position: the buffers of a Llama that were never learned."""
    half = config.head_dim // 2
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, half, dtype=torch.float32) / half))
    angles = torch.outer(torch.arange(max_len, dtype=torch.float32), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)  # [max_len, head_dim]
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (i, i + head_dim/2) of every head by its position's angle."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def grouped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      q_start: int) -> torch.Tensor:
    """Causal attention where `group` query heads share each KV head, without repeating K/V.

    q: [B, kv_heads, group, T, D] for positions q_start .. q_start+T-1
    k, v: [B, kv_heads, S, D] for positions 0 .. S-1
    returns [B, kv_heads, group, T, D]

    Query head kv * group + g reads KV head kv: SDPA's `enable_gqa` layout, so K/V are read
    in place. A prompt attending to itself (q_start 0) passes `is_causal`, which lets the
    kernel skip the key blocks wholly above the diagonal (PyTorch's CPU flash kernel works in
    512-key blocks, so a prompt of 512 tokens or fewer skips none; chapter 4 times the flag);
    a chunk after cached positions passes its [T, S] mask (the kernel then scores the whole
    rectangle). The path this replaced, one [group x T, S] mask for every prefill, was measured
    in commit 2929be7's note; chapter 8 times a mask against the flag."""
    batch, kv_heads, group, steps, dim = q.shape
    keys = k.shape[2]
    if q_start + steps != keys:
        raise ValueError(f"queries at {q_start}..{q_start + steps - 1} must end at the last of {keys} keys")
    heads = q.reshape(batch, kv_heads * group, steps, dim)
    if steps == 1 or q_start == 0:
        out = F.scaled_dot_product_attention(heads, k, v, is_causal=steps > 1, enable_gqa=True)
    else:
        positions = torch.arange(keys, device=q.device)
        mask = positions[None, :] <= positions[q_start:, None]  # [T, S]: query i sees keys j <= i
        out = F.scaled_dot_product_attention(heads, k, v, attn_mask=mask, enable_gqa=True)
    return out.reshape(batch, kv_heads, group, steps, dim)


def linear(x: torch.Tensor, weight) -> torch.Tensor:
    """x W^T for a weight tensor, or the weight's own kernel when it is a module (the
    quantized layers of labkit.models.quantized plug in here)."""
    return F.linear(x, weight) if isinstance(weight, torch.Tensor) else weight(x)


def decoder_layer(c: LlamaConfig, layer: "LayerWeights", x: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor, cache=None, index: int = 0) -> torch.Tensor:
    """One decoder layer on hidden states x [B, T, hidden] at the positions whose RoPE
    tables are `cos`, `sin`: attention (through layer `index` of `cache` if given) and the
    SwiGLU MLP, each added to the residual stream. Head counts come from `c`, so a config
    with fewer heads runs a layer that holds only those heads (a tensor-parallel shard)."""
    batch, steps, _ = x.shape
    q_width, kv_width = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    h = rms_norm(x, layer.attn_norm, c.rms_norm_eps)
    q, k, v = linear(h, layer.qkv).split([q_width, kv_width, kv_width], dim=-1)
    # [B, T, heads*D] -> [B, kv_heads, group, T, D] for q; [B, kv_heads, T, D] for k, v
    q = q.view(batch, steps, c.num_kv_heads, c.group_size, c.head_dim).permute(0, 2, 3, 1, 4)
    k = k.view(batch, steps, c.num_kv_heads, c.head_dim).transpose(1, 2)
    v = v.view(batch, steps, c.num_kv_heads, c.head_dim).transpose(1, 2)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    if cache is not None:
        attn = cache.attend(index, q, k, v)
    else:
        attn = grouped_attention(q, k, v, 0)  # [B, kv, group, T, D]
    attn = attn.permute(0, 3, 1, 2, 4).reshape(batch, steps, q_width)
    x = x + linear(attn, layer.o_proj)
    h = rms_norm(x, layer.mlp_norm, c.rms_norm_eps)
    gate, up = linear(h, layer.gate_up).chunk(2, dim=-1)
    return x + linear(F.silu(gate) * up, layer.down)


MATRICES = ("qkv", "o_proj", "gate_up", "down")  # the matrices of each layer (the rest: norms)


class Weights(torch.nn.Module):
    """A module whose weight slots (the names in `WEIGHTS`) each hold either a tensor, kept
    as a frozen `nn.Parameter` sharing the tensor's storage, or a module (any callable) that
    multiplies by it in its place (see `linear`). Assigning either to a slot works: a plain
    tensor is wrapped, and a module evicts the parameter of that name (`nn.Module` itself
    refuses to put a module where a parameter was)."""

    WEIGHTS: tuple[str, ...] = ()

    def __setattr__(self, name: str, value) -> None:
        if name in self.WEIGHTS:
            if isinstance(value, torch.Tensor):
                if not isinstance(value, torch.nn.Parameter):
                    value = torch.nn.Parameter(value, requires_grad=False)  # no copy
            else:
                self.__dict__.get("_parameters", {}).pop(name, None)
                if not isinstance(value, torch.nn.Module):
                    self.__dict__.get("_modules", {}).pop(name, None)
        super().__setattr__(name, value)

    def _apply(self, fn, recurse: bool = True):
        # As nn.Module._apply (what .to(), .cuda(), .half() call), but a converted weight
        # becomes a new Parameter where nn.Module converts it in place (`param.data = ...`):
        # a copy (`shallow_copy`, `LayerWeights.replaced`) shares its Parameters with the
        # original, and moving one must leave the other alone. One new Parameter per old
        # one keeps a tied weight tied.
        if recurse:
            for module in self.children():
                module._apply(fn)
        converted: dict[int, torch.nn.Parameter] = {}
        for key, param in self._parameters.items():
            if param is None:
                continue
            if id(param) not in converted:
                with torch.no_grad():
                    applied = fn(param)
                converted[id(param)] = (param if applied is param else
                                        torch.nn.Parameter(applied, param.requires_grad))
            self._parameters[key] = converted[id(param)]
        for key, buf in self._buffers.items():
            if buf is not None:
                self._buffers[key] = fn(buf)
        return self


class LayerWeights(Weights):
    """The weights of one decoder layer: two norm vectors and four (fused) matrices."""

    WEIGHTS = ("attn_norm", "qkv", "o_proj", "mlp_norm", "gate_up", "down")

    def __init__(self, attn_norm, qkv, o_proj, mlp_norm, gate_up, down):
        super().__init__()
        self.attn_norm = attn_norm
        self.qkv = qkv  # [(heads + 2 kv_heads) * head_dim, hidden]
        self.o_proj = o_proj
        self.mlp_norm = mlp_norm
        self.gate_up = gate_up  # [2 * intermediate, hidden]
        self.down = down

    @classmethod
    def from_state(cls, state: dict[str, torch.Tensor], prefix: str,
                   dtype: torch.dtype = torch.float32) -> "LayerWeights":
        """The layer whose Hugging Face names start with `prefix` ("model.layers.3."), with
        q/k/v and gate/up fused."""
        def w(name: str) -> torch.Tensor:
            return _aligned(state[prefix + name].to(dtype))

        return cls(attn_norm=w("input_layernorm.weight"),
                   qkv=_aligned(torch.cat([w(f"self_attn.{n}_proj.weight") for n in "qkv"])),
                   o_proj=w("self_attn.o_proj.weight"),
                   mlp_norm=w("post_attention_layernorm.weight"),
                   gate_up=_aligned(torch.cat([w("mlp.gate_proj.weight"),
                                               w("mlp.up_proj.weight")])),
                   down=w("mlp.down_proj.weight"))

    def weights(self) -> dict:
        """Name -> tensor (or the module standing in for it), in `WEIGHTS` order."""
        return {name: getattr(self, name) for name in self.WEIGHTS}

    def replaced(self, **changes) -> "LayerWeights":
        """A new LayerWeights holding `changes` (tensors or modules, by weight name) and
        sharing every other weight with this one, which is left unchanged."""
        unknown = set(changes) - set(self.WEIGHTS)
        if unknown:
            raise TypeError(f"LayerWeights has no weight {sorted(unknown)}; it has {self.WEIGHTS}")
        return type(self)(**{**self.weights(), **changes})

    def extra_repr(self) -> str:
        return ", ".join(f"{name}={tuple(w.shape)}" if isinstance(w, torch.Tensor) else name
                         for name, w in self.weights().items() if name not in self._modules)


class Llama(Weights):
    """A Llama decoder. Call it on token ids [batch, seq] to get logits [batch, seq, vocab].

    `embed`, `final_norm` (and `lm_head`, the very Parameter `embed` when the embeddings
    are tied) are parameters, `layers` a ModuleList of `LayerWeights`, `rope_cos` and
    `rope_sin` buffers left out of the state dict: `.to(dtype)` / `.to(device)` moves them
    all. `lm_head` may also be a module (see `linear`)."""

    WEIGHTS = ("embed", "lm_head", "final_norm")

    def __init__(self, config: LlamaConfig, state: dict[str, torch.Tensor],
                 dtype: torch.dtype = torch.float32, rope_len: int | None = None):
        super().__init__()
        self.config = config
        c = config

        def w(name: str) -> torch.Tensor:
            return _aligned(state[name].to(dtype))

        self.embed = w("model.embed_tokens.weight")
        self.lm_head = self.embed if c.tie_word_embeddings else w("lm_head.weight")
        self.final_norm = w("model.norm.weight")
        self.layers = torch.nn.ModuleList(
            LayerWeights.from_state(state, f"model.layers.{i}.", dtype) for i in range(c.num_layers))
        cos, sin = rope_tables(c, rope_len or c.max_position_embeddings)
        self.register_buffer("rope_cos", cos.to(dtype), persistent=False)
        self.register_buffer("rope_sin", sin.to(dtype), persistent=False)
        self.tokenizer = None  # set by the loader

    def __setattr__(self, name: str, value) -> None:
        if name == "layers" and isinstance(value, (list, tuple)):
            value = torch.nn.ModuleList(value)
        super().__setattr__(name, value)

    # -- the forward pass -------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, cache: KVCache | None = None,
                last_only: bool = False, rows: torch.Tensor | None = None) -> torch.Tensor:
        # Logits [batch, seq, vocab] for token ids [batch, seq]. `cache` holds the earlier
        # tokens' keys and values (KVCache, or labkit.engine's paged cache): it gives the new
        # tokens' positions and does their attention. last_only / rows: logits for the last
        # position only / for these positions only.
        c = self.config
        batch, steps = input_ids.shape
        limit = self.rope_cos.shape[0]
        if cache is not None:
            positions = cache.positions(steps, limit)
        else:
            check_positions(steps, limit)
            positions = torch.arange(steps, device=input_ids.device)
        cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        x = F.embedding(input_ids, self.embed)
        for index, layer in enumerate(self.layers):
            x = decoder_layer(c, layer, x, cos, sin, cache, index)
        if cache is not None:
            cache.advance(steps)
        if last_only:
            x = x[:, -1:]
        elif rows is not None:
            x = x[:, rows]
        x = rms_norm(x, self.final_norm, c.rms_norm_eps)
        return linear(x, self.lm_head)

    @property
    def max_positions(self) -> int:
        """How many positions the RoPE table covers: the longest sequence this model runs."""
        return self.rope_cos.shape[0]

    @property
    def device(self) -> torch.device:
        return self.embed.device

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the weights (of the embedding): what `.to(dtype)` last set."""
        return self.embed.dtype

    # -- accounting -------------------------------------------------------------------
    def num_parameters(self) -> int:
        """Learned parameters, counting the tied embedding/LM head once."""
        c = self.config
        per_layer = sum(_numel(w) for w in self.layers[0].weights().values())
        head = 0 if c.tie_word_embeddings else _numel(self.lm_head)
        return self.embed.numel() + head + self.final_norm.numel() + c.num_layers * per_layer

    def new_cache(self, batch: int = 1, max_len: int = 2048) -> KVCache:
        return KVCache.empty(self.config, batch, max_len, self.dtype, self.device)


def shallow_copy(model: Llama, layers: int | None = None) -> Llama:
    """A copy of `model` that shares its tensors, keeping only its first `layers` layers if
    given. Attributes set on the copy (its layers, a layer's weights, its embedding or head,
    even a module in place of a tensor) and `.to()` on the copy leave the original alone,
    so experiments can swap weights or kernels on a copy."""
    out = copy.copy(model)
    out.__dict__ = dict(model.__dict__)
    # nn.Module's own registries: not shared
    for registry in ("_parameters", "_buffers", "_modules", "_non_persistent_buffers_set"):
        out.__dict__[registry] = copy.copy(model.__dict__[registry])
    kept = model.layers if layers is None else model.layers[:layers]
    out.layers = [layer.replaced() if isinstance(layer, LayerWeights) else layer for layer in kept]
    if layers is not None:
        out.config = replace(model.config, num_layers=layers)
    return out


def _numel(weight) -> int:
    return weight.numel() if isinstance(weight, torch.Tensor) else math.prod(weight.shape)


def _aligned(t: torch.Tensor, alignment: int = 64) -> torch.Tensor:
    """Return a contiguous tensor whose data starts on a 64-byte boundary.

    A weight loaded from a file can start at any byte offset; an unaligned weight made a
    decode step about 30% slower on these machines, so we copy such tensors once.
    """
    t = t.contiguous()
    if t.data_ptr() % alignment:
        t = t.clone()
    return t
