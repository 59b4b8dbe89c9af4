"""One Llama split across processes: tensor parallel and pipeline parallel.

Tensor parallel (Megatron style): every rank holds a slice of every layer.

    attention: KV-head groups [kv0, kv1) with their query heads; q/k/v rows and o_proj columns
    MLP:       intermediate columns [i0, i1); gate/up rows and down columns
    per layer: x + all_reduce(attn_shard @ o_proj_shard^T)     (one all-reduce)
               x + all_reduce(mlp_shard @ down_shard^T)        (one all-reduce)

The q/k/v and gate/up matrices are split by output rows, so a rank computes its own heads
and its own MLP columns with no communication; o_proj and down are split by input columns,
so each rank holds a partial sum of the layer's output, and one all-reduce adds them. A
shard is an ordinary `Llama` whose config counts only its own heads and MLP columns and
whose o_proj and down are `AllReduceLinear` modules: its forward pass is `Llama.forward`
itself (the trick of gpt-fast's tp.py). The embedding, final norm and LM head are not
split: every rank holds them and computes the same logits.

Head counts that do not divide: SmolLM2 has 3 KV heads (9 query heads). A degree up to the
KV-head count splits the KV groups as evenly as they go (degree 2: 2 groups and 1 group, an
uneven load but exact); a degree above it is refused, since a KV group is the smallest unit
that needs no communication inside attention. The MLP width is split the same way (sizes
differ by at most one).

Pipeline parallel: rank r holds a contiguous run of layers (`even_split` of the layer
count); rank 0 also the embedding, the last rank the final norm and the LM head (the
embedding matrix again when the embeddings are tied, as in SmolLM2). Activations go
forward with send/recv; the last rank sends each chosen token back to rank 0.

Each rank reads only its own slice of the weights (`SafetensorsReader` slices the file
without loading the rest), and `tensor_parallel_generate` / `pipeline_generate` run a greedy
loop with one KV cache per rank.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace
from typing import Protocol

import torch
import torch.nn.functional as F

from labkit.models.gguf_file import LlamaConfig
from labkit.models.llama import (KVCache, LayerWeights, Llama, Weights, check_positions, decoder_layer,
                                 linear, rms_norm, rope_tables)

Range = tuple[int, int]  # [start, stop)


def even_split(total: int, parts: int) -> list[Range]:
    """`parts` contiguous ranges covering range(total), sizes differing by at most one, the
    larger ones first: even_split(30, 4) -> [(0, 8), (8, 16), (16, 23), (23, 30)]."""
    if not 1 <= parts <= total:
        raise ValueError(f"cannot split {total} into {parts} non-empty parts")
    base, extra = divmod(total, parts)
    out, start = [], 0
    for part in range(parts):
        stop = start + base + (part < extra)
        out.append((start, stop))
        start = stop
    return out


# -- communication -----------------------------------------------------------------------

class Communicator(Protocol):
    """What a split model asks of its process group."""

    rank: int
    world: int

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor: ...   # sum over ranks, in place
    def send(self, t: torch.Tensor, dst: int) -> None: ...
    def recv(self, t: torch.Tensor, src: int) -> None: ...     # into t


@dataclass
class CallCount:
    calls: int = 0
    bytes: int = 0      # payload: the tensor's own bytes, whatever the wire carries
    seconds: float = 0.0

    def add(self, nbytes: int, seconds: float) -> None:
        self.calls, self.bytes, self.seconds = self.calls + 1, self.bytes + nbytes, self.seconds + seconds


@dataclass
class DistComm:
    """`torch.distributed` on the default group, every call counted and timed. With world 1
    no call is made (and no process group is needed). The time of an all-reduce includes the
    wait for the slowest rank to arrive: it is the cost a rank sees, not the wire's."""

    rank: int = 0
    world: int = 1
    counts: dict[str, CallCount] = field(default_factory=lambda: {
        "all_reduce": CallCount(), "send": CallCount(), "recv": CallCount()})

    @classmethod
    def from_default_group(cls) -> "DistComm":
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            return cls()
        return cls(dist.get_rank(), dist.get_world_size())

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        if self.world == 1:
            return t
        import torch.distributed as dist

        start = time.perf_counter()
        dist.all_reduce(t)
        self.counts["all_reduce"].add(t.nbytes, time.perf_counter() - start)
        return t

    def send(self, t: torch.Tensor, dst: int) -> None:
        import torch.distributed as dist

        start = time.perf_counter()
        dist.send(t.contiguous(), dst)
        self.counts["send"].add(t.nbytes, time.perf_counter() - start)

    def recv(self, t: torch.Tensor, src: int) -> None:
        import torch.distributed as dist

        start = time.perf_counter()
        dist.recv(t, src)
        self.counts["recv"].add(t.nbytes, time.perf_counter() - start)

    def summary(self) -> dict:
        return {name: vars(count).copy() for name, count in self.counts.items()}


# -- reading slices of the weights --------------------------------------------------------

class WeightReader(Protocol):
    """Rows [start, stop) (dim 0) or columns (dim 1) of a weight in Hugging Face names, or
    the whole tensor when `rows` and `cols` are both None."""

    def __call__(self, name: str, rows: Range | None = None,
                 cols: Range | None = None) -> torch.Tensor: ...


@dataclass
class DictReader:
    """Slices of an in-memory state dict (the slices are copies: a shard keeps no view of
    the full tensor alive)."""

    state: dict[str, torch.Tensor]

    def __call__(self, name, rows=None, cols=None):
        t = self.state[name]
        if rows is not None:
            t = t[rows[0]:rows[1]]
        if cols is not None:
            t = t[:, cols[0]:cols[1]]
        return t.clone()


class SafetensorsReader:
    """Slices read straight from a safetensors file: a rank never loads another's weights.
    Each slice is copied into memory of its own, which starts on a 64-byte boundary: a
    weight left at its offset in the file can start anywhere, and the matrix kernels then
    take another path (the LM head's logits moved by ~1e-5 when the embedding was not
    copied, against none with it)."""

    def __init__(self, path):
        from safetensors import safe_open

        self._file = safe_open(str(path), framework="pt")

    def __call__(self, name, rows=None, cols=None):
        part = self._file.get_slice(name)
        r = slice(*rows) if rows is not None else slice(None)
        c = slice(*cols) if cols is not None else slice(None)
        return (part[r] if cols is None else part[r, c]).clone()


# -- tensor parallel ------------------------------------------------------------------------

@dataclass(frozen=True)
class TensorShard:
    """Which KV-head groups and MLP columns rank `rank` of `world` holds."""

    rank: int
    world: int
    kv_heads: Range
    intermediate: Range

    @classmethod
    def plan(cls, config: LlamaConfig, rank: int, world: int) -> "TensorShard":
        if world > config.num_kv_heads:
            raise ValueError(
                f"tensor-parallel degree {world} exceeds the {config.num_kv_heads} KV heads: "
                "attention is split by whole KV-head groups")
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} outside world {world}")
        return cls(rank, world, even_split(config.num_kv_heads, world)[rank],
                   even_split(config.intermediate_size, world)[rank])

    def heads(self, config: LlamaConfig) -> Range:
        """The query heads of this rank's KV groups."""
        return self.kv_heads[0] * config.group_size, self.kv_heads[1] * config.group_size

    def local_config(self, config: LlamaConfig) -> LlamaConfig:
        kv = self.kv_heads[1] - self.kv_heads[0]
        return replace(config, num_kv_heads=kv, num_heads=kv * config.group_size,
                       intermediate_size=self.intermediate[1] - self.intermediate[0])


def tensor_shard_state(read: WeightReader, config: LlamaConfig,
                       shard: TensorShard) -> dict[str, torch.Tensor]:
    """The Hugging Face-named weights of one tensor-parallel rank: its heads' q/k/v rows and
    o_proj columns, its MLP's gate/up rows and down columns, all norms, the embedding (and
    the LM head when untied) whole."""
    d = config.head_dim
    h0, h1 = shard.heads(config)
    rows_q, rows_kv = (h0 * d, h1 * d), (shard.kv_heads[0] * d, shard.kv_heads[1] * d)
    state = {"model.embed_tokens.weight": read("model.embed_tokens.weight"),
             "model.norm.weight": read("model.norm.weight")}
    if not config.tie_word_embeddings:
        state["lm_head.weight"] = read("lm_head.weight")
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        for norm in ("input_layernorm", "post_attention_layernorm"):
            state[p + norm + ".weight"] = read(p + norm + ".weight")
        state[p + "self_attn.q_proj.weight"] = read(p + "self_attn.q_proj.weight", rows=rows_q)
        for kv in "kv":
            state[p + f"self_attn.{kv}_proj.weight"] = read(p + f"self_attn.{kv}_proj.weight",
                                                            rows=rows_kv)
        state[p + "self_attn.o_proj.weight"] = read(p + "self_attn.o_proj.weight", cols=rows_q)
        for name in ("gate_proj", "up_proj"):
            state[p + f"mlp.{name}.weight"] = read(p + f"mlp.{name}.weight", rows=shard.intermediate)
        state[p + "mlp.down_proj.weight"] = read(p + "mlp.down_proj.weight", cols=shard.intermediate)
    return state


class AllReduceLinear(torch.nn.Module):
    """x W^T summed over the ranks: the row-parallel half of a Megatron pair. Sits in a
    layer's weight slot; `labkit.models.llama.linear` calls it."""

    def __init__(self, weight: torch.Tensor, comm: Communicator):
        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=False)
        self.comm = comm

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.comm.all_reduce(F.linear(x, self.weight))


def tensor_parallel_model(read: WeightReader, config: LlamaConfig, comm: Communicator,
                          dtype: torch.dtype = torch.float32) -> Llama:
    """This rank's shard as a `Llama` (call it like the full model; every rank returns the
    full logits). Its `.shard` says what it holds."""
    shard = TensorShard.plan(config, comm.rank, comm.world)
    model = Llama(shard.local_config(config), tensor_shard_state(read, config, shard), dtype=dtype)
    model.layers = [layer.replaced(o_proj=AllReduceLinear(layer.o_proj, comm),
                                   down=AllReduceLinear(layer.down, comm))
                    for layer in model.layers]
    model.shard, model.full_config = shard, config
    return model


# -- pipeline parallel ----------------------------------------------------------------------

@dataclass(frozen=True)
class PipelineShard:
    """Which layers rank `rank` of `world` holds; the first also embeds, the last also norms
    and projects to the vocabulary."""

    rank: int
    world: int
    layers: Range

    @classmethod
    def plan(cls, config: LlamaConfig, rank: int, world: int) -> "PipelineShard":
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} outside world {world}")
        return cls(rank, world, even_split(config.num_layers, world)[rank])

    @property
    def first(self) -> bool:
        return self.rank == 0

    @property
    def last(self) -> bool:
        return self.rank == self.world - 1


class PipelineStage(Weights):
    """One pipeline rank: its layers, plus the embedding (first rank) and the final norm
    and LM head (last rank). Call it on token ids [B, T] (first rank) or hidden states
    [B, T, hidden] (the others); it returns hidden states, or on the last rank the logits
    of the last position [B, 1, vocab]."""

    WEIGHTS = ("embed", "final_norm", "lm_head")

    def __init__(self, read: WeightReader, config: LlamaConfig, shard: PipelineShard,
                 dtype: torch.dtype = torch.float32, rope_len: int | None = None):
        super().__init__()
        self.config, self.shard = config, shard
        self.layers = torch.nn.ModuleList(
            LayerWeights.from_state({n: read(n) for n in _layer_names(i)}, f"model.layers.{i}.", dtype)
            for i in range(*shard.layers))
        self.embed = read("model.embed_tokens.weight").to(dtype) if shard.first else None
        if shard.last:
            self.final_norm = read("model.norm.weight").to(dtype)
            if config.tie_word_embeddings and shard.first:
                self.lm_head = self.embed  # one rank: one tied Parameter, as in Llama
            elif config.tie_word_embeddings:
                self.lm_head = read("model.embed_tokens.weight").to(dtype)  # its own copy
            else:
                self.lm_head = read("lm_head.weight").to(dtype)
        else:
            self.final_norm = self.lm_head = None
        cos, sin = rope_tables(config, rope_len or config.max_position_embeddings)
        self.register_buffer("rope_cos", cos.to(dtype), persistent=False)
        self.register_buffer("rope_sin", sin.to(dtype), persistent=False)

    def new_cache(self, batch: int = 1, max_len: int = 2048) -> KVCache:
        local = replace(self.config, num_layers=len(self.layers))
        return KVCache.empty(local, batch, max_len, self.rope_cos.dtype, self.rope_cos.device)

    @torch.inference_mode()
    def forward(self, inputs: torch.Tensor, cache: KVCache) -> torch.Tensor:
        c, steps = self.config, inputs.shape[1]
        positions = cache.positions(steps, self.rope_cos.shape[0])
        cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        x = F.embedding(inputs, self.embed) if self.shard.first else inputs
        for index, layer in enumerate(self.layers):
            x = decoder_layer(c, layer, x, cos, sin, cache, index)
        cache.advance(steps)
        if not self.shard.last:
            return x
        return linear(rms_norm(x[:, -1:], self.final_norm, c.rms_norm_eps), self.lm_head)


def pipeline_stage(read: WeightReader, config: LlamaConfig, comm: Communicator,
                   dtype: torch.dtype = torch.float32) -> PipelineStage:
    return PipelineStage(read, config, PipelineShard.plan(config, comm.rank, comm.world), dtype)


def _layer_names(i: int) -> list[str]:
    p = f"model.layers.{i}."
    return [p + n + ".weight" for n in (
        "input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj",
        "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")]


# -- greedy generation ----------------------------------------------------------------------

@dataclass
class SplitRun:
    """What one rank saw of a greedy run: the tokens and the logits [new_tokens, vocab] that
    chose them (on the ranks that have them; empty / None elsewhere), and the seconds of
    the prefill and of each decode step on this rank, in all and inside communication
    calls (when the generate call was given a `comm_seconds` clock)."""

    tokens: list[int]
    logits: torch.Tensor | None
    prefill_seconds: float
    step_seconds: list[float]
    prefill_comm_seconds: float = 0.0
    step_comm_seconds: list[float] = field(default_factory=list)


class StepClock:
    """Wall time and communication time of each step. `comm_seconds()` returns the seconds
    spent in communication so far (e.g. the sum of a DistComm's counts), or is None."""

    def __init__(self, comm_seconds=None):
        self.comm_seconds = comm_seconds or (lambda: 0.0)
        self.wall: list[float] = []
        self.comm: list[float] = []

    def start(self) -> None:
        self._wall0, self._comm0 = time.perf_counter(), self.comm_seconds()

    def stop(self) -> None:
        self.wall.append(time.perf_counter() - self._wall0)
        self.comm.append(self.comm_seconds() - self._comm0)

    def run(self, tokens: list[int], logits: torch.Tensor | None) -> SplitRun:
        """The first step timed is the prefill, the others decode steps."""
        return SplitRun(tokens, logits, self.wall[0], self.wall[1:], self.comm[0], self.comm[1:])


def tensor_parallel_generate(model: Llama, prompt_ids: list[int], new_tokens: int,
                             comm_seconds=None) -> SplitRun:
    """Greedy tokens from a tensor-parallel shard (or any Llama). Every rank computes the
    same logits after the all-reduces, so every rank picks the same token with no further
    communication (the worker checks that the ranks agree)."""
    check_positions(len(prompt_ids) + new_tokens, model.max_positions)
    cache = model.new_cache(1, len(prompt_ids) + new_tokens)
    clock, tokens, kept = StepClock(comm_seconds), [], []
    ids = torch.tensor([list(prompt_ids)], device=model.device)
    while len(tokens) < new_tokens:
        clock.start()
        logits = model(ids, cache=cache, last_only=True)[0, -1]
        kept.append(logits.float().clone())
        tokens.append(int(logits.argmax()))
        ids = torch.tensor([[tokens[-1]]], device=model.device)
        clock.stop()
    return clock.run(tokens, torch.stack(kept))


def pipeline_generate(stage: PipelineStage, comm: Communicator, prompt_ids: list[int],
                      new_tokens: int, comm_seconds=None) -> SplitRun:
    """Greedy tokens through a pipeline: each step, rank 0 embeds the new token(s) and runs its
    layers, every rank hands its activations [1, T, hidden] to the next, and the last rank
    picks the token and sends it back to rank 0. One sequence keeps one stage busy at a time.
    Rank 0 and the last rank return the tokens, the last rank the logits; each rank's step
    time runs from its start of a step to its end (on rank 0: until the token is back)."""
    shard, hidden = stage.shard, stage.config.hidden_size
    device, dtype = stage.rope_cos.device, stage.rope_cos.dtype
    cache = stage.new_cache(1, len(prompt_ids) + new_tokens)
    clock, tokens, kept = StepClock(comm_seconds), [], []
    ids = torch.tensor([list(prompt_ids)], device=device)  # what rank 0 feeds in next
    with torch.inference_mode():
        for step in range(new_tokens):
            clock.start()
            if shard.first:
                inputs = ids
            else:
                steps = len(prompt_ids) if step == 0 else 1
                inputs = torch.empty(1, steps, hidden, dtype=dtype, device=device)
                comm.recv(inputs, shard.rank - 1)
            out = stage(inputs, cache)
            if not shard.last:
                comm.send(out, shard.rank + 1)
            else:
                kept.append(out[0, -1].float().clone())
                token = out[0, -1].argmax().reshape(1)
                if not shard.first:
                    comm.send(token, 0)
            if shard.first and not shard.last:
                token = torch.empty(1, dtype=torch.int64, device=device)
                comm.recv(token, shard.world - 1)
            if shard.first or shard.last:
                tokens.append(int(token))
                ids = token.reshape(1, 1)
            clock.stop()
    return clock.run(tokens, torch.stack(kept) if kept else None)


def weight_bytes(module: torch.nn.Module) -> int:
    """Bytes of the parameters a rank holds (a tied weight counted once)."""
    return sum(p.nbytes for p in module.parameters())


def hf_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """The shape of every weight of the full model, in Hugging Face names."""
    hidden, d, inter = config.hidden_size, config.head_dim, config.intermediate_size
    shapes = {"model.embed_tokens.weight": (config.vocab_size, hidden), "model.norm.weight": (hidden,)}
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, hidden)
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (hidden,), p + "post_attention_layernorm.weight": (hidden,),
            p + "self_attn.q_proj.weight": (config.num_heads * d, hidden),
            p + "self_attn.k_proj.weight": (config.num_kv_heads * d, hidden),
            p + "self_attn.v_proj.weight": (config.num_kv_heads * d, hidden),
            p + "self_attn.o_proj.weight": (hidden, config.num_heads * d),
            p + "mlp.gate_proj.weight": (inter, hidden), p + "mlp.up_proj.weight": (inter, hidden),
            p + "mlp.down_proj.weight": (hidden, inter)})
    return shapes


def planned_weight_bytes(config: LlamaConfig, mode: str, world: int, dtype_bytes: int = 4) -> list[int]:
    """Bytes of weights each rank of a `mode` ("tensor" or "pipeline") split holds, counted
    from the shapes (nothing read): the tensor shards sliced on the meta device, the
    pipeline stages from their layers, embedding and head."""
    shapes = hf_shapes(config)
    size = {name: math.prod(shape) * dtype_bytes for name, shape in shapes.items()}
    embed, head = "model.embed_tokens.weight", "lm_head.weight"
    meta = DictReader({name: torch.empty(shape, device="meta") for name, shape in shapes.items()})
    out = []
    for rank in range(world):
        if mode == "tensor":
            state = tensor_shard_state(meta, config, TensorShard.plan(config, rank, world))
            out.append(sum(t.numel() for t in state.values()) * dtype_bytes)
            continue
        shard = PipelineShard.plan(config, rank, world)
        total = sum(size[n] for i in range(*shard.layers) for n in _layer_names(i))
        total += size[embed] if shard.first else 0
        if shard.last:
            shared_head = config.tie_word_embeddings and shard.first
            total += size["model.norm.weight"] + (0 if shared_head else size[
                embed if config.tie_word_embeddings else head])
        out.append(total)
    return out
