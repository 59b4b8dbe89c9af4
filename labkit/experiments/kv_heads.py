"""KV heads decide the cache: how many key/value heads a model keeps, and what that costs.

Chapter 21 runs these. The KV cache holds, per token and per layer, one key and one value
vector for every *KV head*, not for every query head. So the cache size is set by the
number of KV heads, and each way of cutting it is a choice about those heads:

* :func:`kv_bytes_per_token`, :func:`context_cache_bytes`, :func:`sequences_that_fit`: the
  arithmetic (with :func:`llama_parameters` for the weights that share the memory), ``2 x layers x kv_heads x head_dim x bytes`` per token, for SmolLM2 (9 query
  heads sharing 3 KV heads) and Gemma 3 270M (4 query heads sharing 1 KV head, and five of
  every six layers attending through a 512-token window, so a rolling cache keeps only 512
  positions there; see :class:`labkit.models.window_cache.RollingKVCache`).
* :func:`gqa_repeat_kv` and :func:`gqa_read_once`: two kernels for one grouped-query decode
  step. Many reference implementations (transformers' eager ``repeat_kv``) copy each shared KV
  head ``group`` times before an ordinary attention call; the copy is as large as a
  multi-head cache, so the step moves as many bytes as if the model had never shared its
  heads. Reading each KV head once for all the query heads that share it moves only the
  cache itself. :func:`repeat_kv_bytes_moved` and :func:`read_once_bytes_moved` count the
  bytes; :func:`gqa_inputs` builds inputs for a timing sweep over KV head counts and
  :func:`gqa_runners` the calls to time on them: the copy into fresh memory at every step
  (what a CPU allocator gives a tensor this large) and into buffers kept between steps
  (:func:`repeat_buffers`, what a caching allocator gives), and the read-once step.
* :func:`pool_kv_heads`: turn a trained model's KV heads into fewer by averaging the key and
  value projections of the heads that merge (the GQA paper's "uptraining" starting point,
  without the uptraining). The cache shrinks; the chapter measures what the logits lose.
* :class:`LatentAttention`, :func:`mla_naive`, :func:`mla_absorbed`: multi-head latent
  attention (DeepSeek-V2, arXiv 2405.04434, section 2.1). Every query head keeps its own
  key and value, but they are all up-projected from one small latent vector per token, and
  only that latent (plus one small RoPE key shared by every head) is cached. The naive
  decode step rebuilds every head's keys and values from the cached latents; the absorbed
  step folds the up-projections into the query and the output projection and attends
  over the latents directly. The two give the same output. :func:`mla_decode_runners`
  gives one decode step of each over a filled cache, to time.

Everything here runs on whatever device its tensors are on; nothing is timed here (the
notebook times the kernels with :mod:`labkit.util.timing`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from labkit.models.llama import Llama, shallow_copy


# -- 1. the arithmetic --------------------------------------------------------------------

def kv_bytes_per_token(config, dtype_bytes: int = 4) -> int:
    """Bytes a full (non-rolling) cache stores per token: ``2 x layers x kv_heads x head_dim
    x dtype_bytes``, the 2 being one key and one value vector per KV head per layer.

    Works for any config with ``num_layers``, ``num_kv_heads`` and ``head_dim``
    (:class:`~labkit.models.gguf_file.LlamaConfig`, :class:`~labkit.models.gemma3.Gemma3Config`).
    """
    return 2 * config.num_layers * config.num_kv_heads * config.head_dim * dtype_bytes


def llama_parameters(config) -> int:
    """Learned parameters of a Llama-shaped model from its config alone: per layer the
    query, key, value and output projections, the three MLP matrices and two norms; the
    embedding (counted once when tied to the LM head) and the final norm.

    For a model that is not on this machine (Llama-3.2-3B) this turns its published config
    into the bytes its weights take; the test holds it to SmolLM2's counted tensors.
    """
    c = config
    q_and_o = 2 * c.hidden_size * c.num_heads * c.head_dim
    k_and_v = 2 * c.hidden_size * c.num_kv_heads * c.head_dim
    per_layer = q_and_o + k_and_v + 3 * c.hidden_size * c.intermediate_size + 2 * c.hidden_size
    embeddings = c.vocab_size * c.hidden_size * (1 if c.tie_word_embeddings else 2)
    return embeddings + c.num_layers * per_layer + c.hidden_size


def layer_positions(config, context: int, rolling: bool) -> list[int]:
    """Positions each layer keeps for a sequence of ``context`` tokens.

    A layer with a window W (``config.layer_windows``, Gemma 3's local layers) needs only
    the last W keys, so a rolling cache keeps ``min(context, W)``; global layers, and every
    layer of a config without windows (SmolLM2), keep all ``context``.
    """
    windows = getattr(config, "layer_windows", None) or (None,) * config.num_layers
    return [context if (window is None or not rolling) else min(context, window)
            for window in windows]


def context_cache_bytes(config, context: int, dtype_bytes: int = 4, rolling: bool = False) -> int:
    """Bytes of the cache of one sequence of ``context`` tokens, full or rolling.

    Equals ``RollingKVCache(config, 1, context).nbytes()`` when ``rolling`` (the test holds
    them together), and ``context x kv_bytes_per_token(config)`` when not.
    """
    per_layer_position = 2 * config.num_kv_heads * config.head_dim * dtype_bytes
    return per_layer_position * sum(layer_positions(config, context, rolling))


def sequences_that_fit(budget_bytes: int, context: int, config, rolling: bool = False,
                       dtype_bytes: int = 4) -> int:
    """How many sequences of ``context`` tokens have their caches fit in ``budget_bytes``
    (the cache only: weights and activations are left out)."""
    return budget_bytes // context_cache_bytes(config, context, dtype_bytes, rolling)


@dataclass(frozen=True)
class ContextBytes:
    """A model's cache for one sequence of ``context`` tokens, full and rolling."""

    context: int
    full_bytes: int
    rolling_bytes: int

    @property
    def saving(self) -> float:
        """full / rolling: how many times smaller the rolling cache is."""
        return self.full_bytes / self.rolling_bytes


def context_bytes_table(config, contexts, dtype_bytes: int = 4) -> list[ContextBytes]:
    """One :class:`ContextBytes` per context length (for a table or a plot)."""
    return [ContextBytes(n, context_cache_bytes(config, n, dtype_bytes, rolling=False),
                         context_cache_bytes(config, n, dtype_bytes, rolling=True))
            for n in contexts]


# -- 2. two grouped-query decode kernels --------------------------------------------------

@dataclass
class GQAInputs:
    """One decode step's attention inputs: q [B, H, D], cached k, v [B, KV, S, D]."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor

    @property
    def group(self) -> int:
        """Query heads per KV head."""
        return self.q.shape[1] // self.k.shape[1]


def gqa_inputs(batch: int, q_heads: int, kv_heads: int, context: int, head_dim: int,
               seed: int = 0, dtype: torch.dtype = torch.float32,
               device: torch.device | str = "cpu") -> GQAInputs:
    """Seeded inputs of one grouped-query decode step.

    Grouping needs every KV head to serve the same number of query heads, so ``kv_heads``
    must divide ``q_heads``: for SmolLM2's 9 query heads only 1, 3 (SmolLM2 itself) and 9
    (multi-head attention) are valid, and a sweep over 1..9 KV heads skips the rest (or
    fixes a query head count with more divisors).
    """
    if kv_heads < 1 or q_heads % kv_heads:
        raise ValueError(f"{kv_heads} KV heads do not divide {q_heads} query heads")
    gen = torch.Generator().manual_seed(seed)

    def normal(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype=dtype, device=device)

    return GQAInputs(q=normal(batch, q_heads, head_dim),
                     k=normal(batch, kv_heads, context, head_dim),
                     v=normal(batch, kv_heads, context, head_dim))


def gqa_repeat_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  buffers: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Grouped-query decode by copying: each KV head is repeated ``group`` times, so query
    head h meets KV head h // group, then ordinary multi-head attention runs.

    q [B, H, D], k, v [B, KV, S, D] -> [B, H, D]. This is transformers' ``repeat_kv``
    before its eager attention call: the copy [B, H, S, D] is written and read once more,
    and at ``group == 1`` nothing is copied (``repeat_kv`` returns its input). Without
    ``buffers`` every step's copy is a new tensor, fresh memory from the allocator (glibc
    maps a block this large anew and the kernel zeroes each page on first write); with
    ``buffers`` (keys, values) from :func:`repeat_buffers`, kept between steps, the copy
    is written into memory the process already holds, as a caching allocator gives it.
    """
    group = q.shape[1] // k.shape[1]
    if group == 1:
        keys, values = k, v
    elif buffers is None:
        keys = k.repeat_interleave(group, dim=1)  # [B, H, S, D], a real copy
        values = v.repeat_interleave(group, dim=1)
    else:
        keys, values = buffers
        batch, kv_heads, context, dim = k.shape
        grouped = (batch, kv_heads, group, context, dim)  # head h -> (h // group, h % group)
        keys.view(grouped).copy_(k[:, :, None].expand(grouped))
        values.view(grouped).copy_(v[:, :, None].expand(grouped))
    return F.scaled_dot_product_attention(q[:, :, None], keys, values)[:, :, 0]


def repeat_buffers(x: "GQAInputs") -> tuple[torch.Tensor, torch.Tensor] | None:
    """Two [B, H, S, D] tensors for :func:`gqa_repeat_kv`'s copy, written once so their
    pages are already faulted in (None where the group is 1 and nothing is copied)."""
    if x.group == 1:
        return None
    shape = (x.q.shape[0], x.q.shape[1], *x.k.shape[2:])
    return tuple(torch.empty(shape, dtype=x.k.dtype, device=x.k.device).fill_(0.0)
                 for _ in range(2))


def gqa_read_once(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Grouped-query decode reading each cached KV head once: the ``group`` query heads that
    share a KV head become ``group`` query rows against it, so one matmul per KV head
    serves them all and nothing is copied (as :func:`labkit.models.llama.grouped_attention`).

    q [B, H, D], k, v [B, KV, S, D] -> [B, H, D].
    """
    batch, heads, dim = q.shape
    kv_heads = k.shape[1]
    rows = q.reshape(batch, kv_heads, heads // kv_heads, dim)  # head h -> (h // group, h % group)
    return F.scaled_dot_product_attention(rows, k, v).reshape(batch, heads, dim)


def gqa_runners(x: GQAInputs) -> dict:
    """The kernels as calls without arguments on the inputs ``x``, named as the chapter
    names them (for :func:`labkit.util.timing.measure_interleaved`): the copying step
    with its copy in fresh memory at every call and in buffers kept between calls, and
    the read-once step."""
    buffers = repeat_buffers(x)
    return {"repeat, fresh memory": lambda: gqa_repeat_kv(x.q, x.k, x.v),
            "repeat, reused memory": lambda: gqa_repeat_kv(x.q, x.k, x.v, buffers),
            "read once": lambda: gqa_read_once(x.q, x.k, x.v)}


@dataclass(frozen=True)
class BytesMoved:
    """Bytes one decode step moves to and from memory, by what they are.

    ``cache_read``: the cached keys and values, read once; ``copy_written`` and
    ``copy_read``: the repeated copy, written then read by the attention (zero when
    nothing is copied); ``query_and_output``: q read and the output written (small).
    """

    cache_read: int
    copy_written: int
    copy_read: int
    query_and_output: int

    @property
    def total(self) -> int:
        return self.cache_read + self.copy_written + self.copy_read + self.query_and_output


def _check_group(q_heads: int, kv_heads: int) -> None:
    if kv_heads < 1 or q_heads % kv_heads:
        raise ValueError(f"{kv_heads} KV heads do not divide {q_heads} query heads")


def repeat_kv_bytes_moved(batch: int, q_heads: int, kv_heads: int, context: int,
                          head_dim: int, dtype_bytes: int = 4) -> BytesMoved:
    """Bytes :func:`gqa_repeat_kv` moves: the cache read once, the [B, H, S, D] copy of k
    and v written and read again, ``1 + 2 x group`` times the cache; with one KV head per
    query head nothing is copied, so only the cache is read."""
    _check_group(q_heads, kv_heads)
    cache = 2 * batch * kv_heads * context * head_dim * dtype_bytes
    copy = 0 if kv_heads == q_heads else 2 * batch * q_heads * context * head_dim * dtype_bytes
    return BytesMoved(cache, copy, copy, 2 * batch * q_heads * head_dim * dtype_bytes)


def read_once_bytes_moved(batch: int, q_heads: int, kv_heads: int, context: int,
                          head_dim: int, dtype_bytes: int = 4) -> BytesMoved:
    """Bytes :func:`gqa_read_once` moves: each cached byte read once, no copy."""
    _check_group(q_heads, kv_heads)
    cache = 2 * batch * kv_heads * context * head_dim * dtype_bytes
    return BytesMoved(cache, 0, 0, 2 * batch * q_heads * head_dim * dtype_bytes)


# -- 3. fewer KV heads for a trained model ------------------------------------------------

def merge_groups(old_kv_heads: int, new_kv_heads: int) -> list[list[int]]:
    """Which old KV heads each new one averages: consecutive runs of ``old // new``.

    Consecutive, because query head h reads old KV head ``h // old_group``; merging
    consecutive KV heads keeps every query head on the merge of the head it read before
    (``h // new_group``), so no query head needs moving.
    """
    if new_kv_heads < 1 or old_kv_heads % new_kv_heads:
        raise ValueError(f"cannot merge {old_kv_heads} KV heads into {new_kv_heads}")
    size = old_kv_heads // new_kv_heads
    return [list(range(j * size, (j + 1) * size)) for j in range(new_kv_heads)]


def pool_kv_heads(model: Llama, new_kv_heads: int) -> Llama:
    """A copy of ``model`` with ``new_kv_heads`` KV heads, each new head's key and value
    projections the mean of the old heads it merges (:func:`merge_groups`); the query and
    output projections are untouched. ``model`` is left unchanged.

    The fused ``qkv`` matrix holds rows for H query heads, then KV key heads, then KV value
    heads, ``head_dim`` rows each; the new one holds the same query rows and
    ``new_kv_heads`` key and value heads. The config's ``num_kv_heads`` follows, so the KV
    cache the copy makes is ``old / new`` times smaller.
    """
    c = model.config
    groups = merge_groups(c.num_kv_heads, new_kv_heads)
    q_rows, kv_rows = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    out = shallow_copy(model)
    layers = []
    for layer in model.layers:
        if not isinstance(layer.qkv, torch.Tensor):
            raise TypeError("pool_kv_heads needs plain weight tensors, not a packed or quantized qkv")
        q, k, v = layer.qkv.detach().split([q_rows, kv_rows, kv_rows])

        def pooled(rows: torch.Tensor) -> torch.Tensor:
            heads = rows.reshape(c.num_kv_heads, c.head_dim, -1)  # [KV, D, hidden]
            merged = torch.stack([heads[group].mean(dim=0) for group in groups])
            return merged.reshape(new_kv_heads * c.head_dim, -1)

        layers.append(layer.replaced(qkv=torch.cat([q, pooled(k), pooled(v)]).contiguous()))
    out.layers = layers
    out.config = replace(c, num_kv_heads=new_kv_heads)
    return out


# -- 4. multi-head latent attention -------------------------------------------------------

@dataclass(frozen=True)
class MLAShape:
    """The sizes of one multi-head latent attention layer.

    ``head_dim``: each head's content key, query and value width (d_h in the paper);
    ``kv_lora_rank``: width of the cached latent c_KV (d_c); ``rope_dim``: width of the
    decoupled RoPE query per head and of the one RoPE key shared by all heads (d_h^R).
    """

    d_model: int
    n_heads: int
    head_dim: int
    kv_lora_rank: int
    rope_dim: int
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6

    @property
    def scale(self) -> float:
        # A score adds the content and the RoPE dot products, so it is scaled by the
        # width of both together (the paper, and transformers' DeepseekV2Attention).
        return (self.head_dim + self.rope_dim) ** -0.5

    def cache_bytes_per_token(self, dtype_bytes: int = 4) -> int:
        """Per layer: the latent and the shared RoPE key, whatever the head count."""
        return (self.kv_lora_rank + self.rope_dim) * dtype_bytes

    def mha_cache_bytes_per_token(self, dtype_bytes: int = 4) -> int:
        """Per layer, for multi-head attention of the same heads: a key and a value each."""
        return 2 * self.n_heads * self.head_dim * dtype_bytes


@dataclass
class LatentAttention:
    """The weights of one MLA layer (rows x columns as ``F.linear`` takes them).

    w_dkv  [kv_lora_rank, d_model]       down-projection to the latent c_KV (W^DKV)
    latent_norm [kv_lora_rank]           RMSNorm weight on c_KV: DeepSeek-V2's released code
                                         (kv_a_layernorm) has it, the paper's equations do not
    w_kr   [rope_dim, d_model]           the shared RoPE key k^R (W^KR)
    w_uk   [n_heads * head_dim, kv_lora_rank]  latent -> each head's content key (W^UK)
    w_uv   [n_heads * head_dim, kv_lora_rank]  latent -> each head's value (W^UV)
    w_q    [n_heads * head_dim, d_model] content queries (the paper's W^DQ then W^UQ; a
                                         plain projection here, as DeepSeek-V2-Lite)
    w_qr   [n_heads * rope_dim, d_model] RoPE queries (W^QR)
    w_o    [d_model, n_heads * head_dim] output projection (W^O)
    """

    shape: MLAShape
    w_dkv: torch.Tensor
    latent_norm: torch.Tensor
    w_kr: torch.Tensor
    w_uk: torch.Tensor
    w_uv: torch.Tensor
    w_q: torch.Tensor
    w_qr: torch.Tensor
    w_o: torch.Tensor

    @classmethod
    def random(cls, shape: MLAShape, seed: int = 0, dtype: torch.dtype = torch.float32) -> "LatentAttention":
        """Seeded weights, each matrix scaled by 1/sqrt(its input width) so activations
        stay near unit size."""
        gen = torch.Generator().manual_seed(seed)
        s = shape

        def matrix(rows: int, cols: int) -> torch.Tensor:
            return (torch.randn(rows, cols, generator=gen, dtype=torch.float64) / math.sqrt(cols)).to(dtype)

        return cls(shape, w_dkv=matrix(s.kv_lora_rank, s.d_model),
                   latent_norm=(1 + 0.1 * torch.randn(s.kv_lora_rank, generator=gen,
                                                      dtype=torch.float64)).to(dtype),
                   w_kr=matrix(s.rope_dim, s.d_model),
                   w_uk=matrix(s.n_heads * s.head_dim, s.kv_lora_rank),
                   w_uv=matrix(s.n_heads * s.head_dim, s.kv_lora_rank),
                   w_q=matrix(s.n_heads * s.head_dim, s.d_model),
                   w_qr=matrix(s.n_heads * s.rope_dim, s.d_model),
                   w_o=matrix(s.d_model, s.n_heads * s.head_dim))


@dataclass
class LatentCache:
    """What MLA caches: per token, the latent c_KV [kv_lora_rank] and the RoPE key k^R
    [rope_dim] (already rotated); ``length`` tokens so far."""

    latents: torch.Tensor  # [B, max_len, kv_lora_rank]
    rope_keys: torch.Tensor  # [B, max_len, rope_dim]
    length: int = 0

    @classmethod
    def empty(cls, shape: MLAShape, batch: int, max_len: int,
              dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> "LatentCache":
        return cls(torch.zeros(batch, max_len, shape.kv_lora_rank, dtype=dtype, device=device),
                   torch.zeros(batch, max_len, shape.rope_dim, dtype=dtype, device=device))

    def nbytes(self) -> int:
        """Bytes of the filled part."""
        return (self.latents[:, :self.length].nbytes + self.rope_keys[:, :self.length].nbytes)


def rope_interleaved(x: torch.Tensor, position: int, theta: float) -> torch.Tensor:
    """Rotate the pairs (2i, 2i+1) of the last axis by position x theta^(-2i/width): the
    complex-number form of DeepSeek-V2's RoPE (transformers' ``apply_rotary_emb``), where a
    Llama rotates the pairs (i, i + width/2) instead."""
    width = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, width, 2, dtype=torch.float64) / width)
    angle = position * inv_freq
    cos, sin = angle.cos().to(x), angle.sin().to(x)
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1).flatten(-2)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def mla_store(layer: LatentAttention, x: torch.Tensor, cache: LatentCache) -> int:
    """Compress the new token x [B, d_model] and append its latent and RoPE key to
    ``cache``; returns its position."""
    s, position = layer.shape, cache.length
    latent = _rms_norm(F.linear(x, layer.w_dkv), layer.latent_norm, s.norm_eps)
    rope_key = rope_interleaved(F.linear(x, layer.w_kr), position, s.rope_theta)
    cache.latents[:x.shape[0], position] = latent
    cache.rope_keys[:x.shape[0], position] = rope_key
    cache.length += 1
    return position


def _queries(layer: LatentAttention, x: torch.Tensor, position: int) -> tuple[torch.Tensor, torch.Tensor]:
    s, batch = layer.shape, x.shape[0]
    q_content = F.linear(x, layer.w_q).view(batch, s.n_heads, s.head_dim)
    q_rope = rope_interleaved(F.linear(x, layer.w_qr).view(batch, s.n_heads, s.rope_dim),
                              position, s.rope_theta)
    return q_content, q_rope


def mla_naive(layer: LatentAttention, x: torch.Tensor, cache: LatentCache) -> torch.Tensor:
    """One decode step of MLA that rebuilds the keys and values: every cached latent is
    up-projected to each head's content key and value, then ordinary attention runs.

    x [B, d_model], the new token's hidden state; it is appended to ``cache`` first (it
    attends to itself). Returns [B, d_model]. The rebuilt keys and values are as large as
    a multi-head cache, recomputed at every step: the saving is in memory, not in work.
    """
    s, batch = layer.shape, x.shape[0]
    position = mla_store(layer, x, cache)
    latents = cache.latents[:batch, :position + 1]  # [B, S, r]
    rope_keys = cache.rope_keys[:batch, :position + 1]  # [B, S, R]
    q_content, q_rope = _queries(layer, x, position)
    keys = F.linear(latents, layer.w_uk).view(batch, -1, s.n_heads, s.head_dim).transpose(1, 2)
    values = F.linear(latents, layer.w_uv).view(batch, -1, s.n_heads, s.head_dim).transpose(1, 2)
    # score = content part (per-head key) + RoPE part (one key shared by every head)
    scores = (torch.einsum("bhd,bhsd->bhs", q_content, keys)
              + torch.einsum("bhr,bsr->bhs", q_rope, rope_keys)) * s.scale
    weights = torch.softmax(scores, dim=-1)
    out = torch.einsum("bhs,bhsd->bhd", weights, values)  # [B, H, head_dim]
    return F.linear(out.reshape(batch, s.n_heads * s.head_dim), layer.w_o)


@dataclass
class AbsorbedWeights:
    """MLA's up-projections folded into their neighbours (computed once per layer).

    query_to_latent [H, head_dim, r]: W^UK per head; q_h^T W^UK_h is a query in latent
    space, so q_h . (W^UK_h c) = (W^UK_h^T q_h) . c.
    latent_to_output [d_model, H, r]: W^O_h W^UV_h, the value up-projection absorbed into
    the output projection: W^O_h (W^UV_h sum_s p_s c_s) = (W^O_h W^UV_h) sum_s p_s c_s.
    """

    query_to_latent: torch.Tensor
    latent_to_output: torch.Tensor


def absorb(layer: LatentAttention) -> AbsorbedWeights:
    """Fold W^UK into the queries and W^UV into W^O (see :class:`AbsorbedWeights`)."""
    s = layer.shape
    w_uk = layer.w_uk.view(s.n_heads, s.head_dim, s.kv_lora_rank)
    w_uv = layer.w_uv.view(s.n_heads, s.head_dim, s.kv_lora_rank)
    w_o = layer.w_o.view(s.d_model, s.n_heads, s.head_dim)
    return AbsorbedWeights(query_to_latent=w_uk,
                           latent_to_output=torch.einsum("mhd,hdr->mhr", w_o, w_uv))


def mla_absorbed(layer: LatentAttention, x: torch.Tensor, cache: LatentCache,
                 absorbed: AbsorbedWeights | None = None) -> torch.Tensor:
    """One decode step of MLA attending over the cached latents themselves.

    Same arguments and result as :func:`mla_naive` (``absorbed``: :func:`absorb`'s result,
    computed here if not given). No per-head key or value is ever built: each head's query
    is moved into latent space, scored against the latents, and the weighted sum of
    latents goes straight through the absorbed output projection. A step reads only the
    cache, ``kv_lora_rank + rope_dim`` numbers per token.
    """
    s, batch = layer.shape, x.shape[0]
    absorbed = absorb(layer) if absorbed is None else absorbed
    position = mla_store(layer, x, cache)
    latents = cache.latents[:batch, :position + 1]
    rope_keys = cache.rope_keys[:batch, :position + 1]
    q_content, q_rope = _queries(layer, x, position)
    q_latent = torch.einsum("bhd,hdr->bhr", q_content, absorbed.query_to_latent)
    scores = (torch.einsum("bhr,bsr->bhs", q_latent, latents)
              + torch.einsum("bhr,bsr->bhs", q_rope, rope_keys)) * s.scale
    weights = torch.softmax(scores, dim=-1)
    out_latent = torch.einsum("bhs,bsr->bhr", weights, latents)  # [B, H, r]
    return torch.einsum("bhr,mhr->bm", out_latent, absorbed.latent_to_output)


def mla_decode_runners(layer: LatentAttention, context: int, batch: int = 1,
                       seed: int = 0) -> dict:
    """One decode step of each MLA path at position ``context - 1``, as calls without
    arguments: {"naive": ..., "absorbed": ...} (for
    :func:`labkit.util.timing.measure_interleaved`).

    The cache is filled once with ``context - 1`` seeded latents and RoPE keys (random
    numbers: the work of a step does not depend on their values); every call resets its
    length, so each call appends the same token at the same position and attends over
    ``context`` positions. The absorbed weights are computed once, outside the timed call,
    as an engine would at load time.
    """
    s = layer.shape
    dtype = layer.w_dkv.dtype
    gen = torch.Generator().manual_seed(seed)
    cache = LatentCache.empty(s, batch, context, dtype)
    cache.latents.copy_(torch.randn(cache.latents.shape, generator=gen, dtype=torch.float64))
    cache.rope_keys.copy_(torch.randn(cache.rope_keys.shape, generator=gen, dtype=torch.float64))
    x = torch.randn(batch, s.d_model, generator=gen, dtype=torch.float64).to(dtype)
    absorbed = absorb(layer)

    def naive() -> torch.Tensor:
        cache.length = context - 1
        return mla_naive(layer, x, cache)

    def fast() -> torch.Tensor:
        cache.length = context - 1
        return mla_absorbed(layer, x, cache, absorbed)

    return {"naive": naive, "absorbed": fast}
