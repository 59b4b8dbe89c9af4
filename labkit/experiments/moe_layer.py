"""Mixture-of-experts inference on one layer built to Mixtral's shape (chapter 19).

A Mixtral feed-forward layer is ``E = 8`` SwiGLU experts and a router. Each token's router
logits pick its ``k = 2`` experts; the token's output is the weighted sum of those two
experts' outputs. The layer holds ``E`` experts' weights but a token only *computes* with
``k`` of them, so per token the FLOPs are those of a dense MLP of width ``k * f``
(:func:`dense_equivalent`), while a batch step must *read* every expert that any of its
tokens chose (:func:`expert_bytes_read`). At batch size 1 that is ``k`` experts; as the
batch grows the union of chosen experts quickly covers all ``E``
(:func:`expected_distinct_experts`), and decode, which is bound by bytes read, pays for the
whole layer while computing a quarter of it.

Routing is Mixtral's (:func:`route`, matching ``transformers``' ``MixtralTopKRouter``):
softmax over the ``E`` logits in float32, top ``k`` of the probabilities, then the ``k``
weights renormalised to sum to 1.

Five ways to run the experts on tokens ``x [T, d]``, all returning ``[T, d]`` and all equal
up to rounding::

    from labkit.experiments.moe_layer import random_moe, route, IMPLEMENTATIONS
    w = random_moe(hidden=64, ffn=128, seed=0)
    x = torch.randn(16, 64)
    r = route(x, w)
    outs = {name: run(x, w, r) for name, run in IMPLEMENTATIONS.items()}

- :func:`dense_loop`: each token, its ``k`` experts one at a time (the obvious reference;
  ``T * k`` matrix-vector products);
- :func:`gather_by_expert`: for each expert, gather its tokens, one matrix product, and
  scatter-add the weighted results back (``transformers``' ``"eager"`` experts
  implementation; transformers 5 picks ``"grouped_mm"`` by default where it can);
- :func:`padded_batched`: the tokens of each expert padded to the busiest expert's count
  into ``[E, C, d]`` and one batched product (``torch.bmm``) over all experts; the padding
  rows are computed and thrown away (:func:`padding_fraction` says how much work that is);
- :func:`grouped`: the assignments sorted by expert into one contiguous buffer and a grouped
  GEMM over its segments (``torch._grouped_mm`` where this torch has it, else a loop over
  the segments that reads each expert's weights once);
- :func:`dense_masked`: every expert on every token, the outputs summed with a ``[T, E]``
  gate matrix that is zero for the experts a token did not choose (the layer as one dense
  computation: ``E / k`` times the FLOPs of the active width, every expert read at any T).

What the time is made of past one token (the cost of one expert on a few rows, summed
over the batch's union) is measured by :mod:`labkit.experiments.moe_costs`.

A capacity limit (:func:`capacity_forward`) is what training-time MoE systems (GShard,
Switch) used to give every expert a fixed-size buffer: an expert takes at most
``C = ceil(capacity_factor * T * k / E)`` assignments and drops the rest. Then a token's
output depends on which other tokens share its batch (:func:`neighbour_dependence`), which
is why inference engines (and transformers' Mixtral block) run without one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F


@dataclass
class MoEWeights:
    """One Mixtral MoE layer: the router and ``E`` SwiGLU experts, in Mixtral's names.

    ``router [E, d]``; per expert ``w1`` (gate) and ``w3`` (up) ``[E, f, d]`` and ``w2``
    (down) ``[E, d, f]``, so that expert ``e`` computes
    ``w2[e] @ (silu(w1[e] @ x) * (w3[e] @ x))``.
    """

    router: torch.Tensor
    w1: torch.Tensor
    w3: torch.Tensor
    w2: torch.Tensor
    top_k: int = 2

    @property
    def experts(self) -> int:
        return self.w1.shape[0]

    @property
    def hidden(self) -> int:
        return self.w1.shape[2]

    @property
    def ffn(self) -> int:
        return self.w1.shape[1]

    @property
    def bytes_per_expert(self) -> int:
        """Bytes of one expert's three matrices."""
        return sum(w[0].numel() * w.element_size() for w in (self.w1, self.w3, self.w2))

    @property
    def router_bytes(self) -> int:
        return self.router.numel() * self.router.element_size()


@dataclass
class Routing:
    """Where each token goes: ``logits [T, E]`` (the router's, in the weights' dtype),
    ``experts [T, k]`` (indices, highest probability first) and ``weights [T, k]`` (float32,
    each row summing to 1)."""

    logits: torch.Tensor
    experts: torch.Tensor
    weights: torch.Tensor

    @property
    def tokens(self) -> int:
        return self.experts.shape[0]

    @property
    def top_k(self) -> int:
        return self.experts.shape[1]


def random_moe(hidden: int, ffn: int, experts: int = 8, top_k: int = 2, seed: int = 0,
               dtype: torch.dtype = torch.float32) -> MoEWeights:
    """Random weights with std ``1 / sqrt(fan_in)`` for every matrix: for inputs of unit
    variance the router logits, the expert activations and the outputs all stay of order 1
    (so routing is neither uniform nor one-hot, and float32 comparisons are meaningful)."""
    g = torch.Generator().manual_seed(seed)

    def normal(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) / math.sqrt(shape[-1])).to(dtype)

    return MoEWeights(router=normal(experts, hidden), w1=normal(experts, ffn, hidden),
                      w3=normal(experts, ffn, hidden), w2=normal(experts, hidden, ffn), top_k=top_k)


# --- transformers' MixtralSparseMoeBlock ------------------------------------------------

def from_transformers(block) -> MoEWeights:
    """The weights of a ``transformers`` ``MixtralSparseMoeBlock``.

    In transformers 5 the experts are one module with fused 3-D parameters:
    ``gate_up_proj [E, 2f, d]`` (the gate rows ``w1`` first, then the up rows ``w3``, which
    the block splits with ``chunk(2)``) and ``down_proj [E, d, f]`` (``w2``).
    """
    experts = block.experts
    # Other MoE models reuse this class with interleaved or transposed layouts; reading one
    # of those as Mixtral's would silently scramble the experts.
    if not getattr(experts, "is_concatenated", True) or getattr(experts, "is_transposed", False):
        raise ValueError("expected Mixtral's layout: gate_up_proj [E, 2f, d] with gate rows first")
    w1, w3 = experts.gate_up_proj.detach().chunk(2, dim=1)
    return MoEWeights(router=block.gate.weight.detach().clone(), w1=w1.clone(), w3=w3.clone(),
                      w2=experts.down_proj.detach().clone(), top_k=block.top_k)


def to_transformers(weights: MoEWeights):
    """A ``MixtralSparseMoeBlock`` (eval mode, eager experts) holding ``weights``."""
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    config = MixtralConfig(hidden_size=weights.hidden, intermediate_size=weights.ffn,
                           num_local_experts=weights.experts, num_experts_per_tok=weights.top_k,
                           hidden_act="silu", router_jitter_noise=0.0)
    # The eager experts loop is the reference; other registered implementations may be
    # picked by default in some versions.
    config._experts_implementation = "eager"
    block = MixtralSparseMoeBlock(config).to(weights.w1.dtype).eval()
    with torch.no_grad():
        block.gate.weight.copy_(weights.router)
        block.experts.gate_up_proj.copy_(torch.cat([weights.w1, weights.w3], dim=1))
        block.experts.down_proj.copy_(weights.w2)
    return block


# --- routing ------------------------------------------------------------------------------

def route(x: torch.Tensor, weights: MoEWeights) -> Routing:
    """Mixtral's routing, in transformers' order: logits, softmax in float32, top k of the
    probabilities, the k renormalised to sum to 1 (the same experts and weights as a
    softmax over the top-k logits, but this order is the one to match bit for bit)."""
    logits = F.linear(x, weights.router)
    probs = torch.softmax(logits.float(), dim=-1)
    top_probs, top_experts = torch.topk(probs, weights.top_k, dim=-1)
    top_probs = top_probs / top_probs.sum(dim=-1, keepdim=True)
    return Routing(logits=logits, experts=top_experts, weights=top_probs)


def uniform_random_routing(tokens: int, experts: int = 8, top_k: int = 2,
                           generator: torch.Generator | None = None) -> Routing:
    """Each token's ``k`` experts a uniformly random set of distinct experts, equal weights:
    the model behind :func:`expected_distinct_experts` (a trained router is not uniform)."""
    chosen = torch.rand(tokens, experts, generator=generator).argsort(dim=-1)[:, :top_k]
    return Routing(logits=torch.zeros(tokens, experts), experts=chosen,
                   weights=torch.full((tokens, top_k), 1.0 / top_k))


@dataclass
class Assignments:
    """The ``T * k`` (token, expert) pairs flattened in token order: pair ``i`` sends token
    ``token[i]`` to expert ``expert[i]`` with gate weight ``weight[i]``."""

    token: torch.Tensor
    expert: torch.Tensor
    weight: torch.Tensor

    def sorted_by_expert(self) -> "Assignments":
        """The same pairs grouped by expert; stable, so token order survives in each group."""
        order = torch.argsort(self.expert, stable=True)
        return Assignments(self.token[order], self.expert[order], self.weight[order])

    def where(self, keep: torch.Tensor) -> "Assignments":
        return Assignments(self.token[keep], self.expert[keep], self.weight[keep])


def assignments(routing: Routing) -> Assignments:
    """The routing as a flat list of (token, expert, weight) pairs, token by token."""
    tokens, k = routing.experts.shape
    return Assignments(token=torch.arange(tokens).repeat_interleave(k),
                       expert=routing.experts.reshape(-1), weight=routing.weights.reshape(-1))


def expert_load(routing: Routing, experts: int) -> torch.Tensor:
    """Tokens routed to each expert, ``[E]``."""
    return torch.bincount(routing.experts.reshape(-1), minlength=experts)


# --- the expert computation, five ways ----------------------------------------------------

def swiglu(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """One expert (or any SwiGLU MLP) on rows ``x [n, d]``: ``w1``/``w3`` are ``[f, d]``,
    ``w2`` is ``[d, f]``."""
    return F.linear(F.silu(F.linear(x, w1)) * F.linear(x, w3), w2)


def combine(x: torch.Tensor, pairs: Assignments, expert_rows: torch.Tensor,
            into: torch.Tensor | None = None) -> torch.Tensor:
    """Scatter-add each pair's expert output, times its gate weight, into its token's row
    (of ``into``, or of a new zero ``[T, d]``).

    The weight multiply is done in float32 like transformers (the gate weights are float32)
    and cast back to ``x``'s dtype before the sum."""
    out = torch.zeros_like(x) if into is None else into
    weighted = (expert_rows * pairs.weight[:, None]).to(x.dtype)
    return out.index_add_(0, pairs.token, weighted)


def dense_loop(x: torch.Tensor, weights: MoEWeights, routing: Routing | None = None) -> torch.Tensor:
    """Token by token, each of its ``k`` experts in turn: the reference."""
    routing = route(x, weights) if routing is None else routing
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for slot in range(routing.top_k):
            e = int(routing.experts[t, slot])
            y = swiglu(x[t:t + 1], weights.w1[e], weights.w3[e], weights.w2[e])
            out[t] += (y[0] * routing.weights[t, slot]).to(x.dtype)
    return out


def gather_by_expert(x: torch.Tensor, weights: MoEWeights, routing: Routing | None = None,
                     pairs: Assignments | None = None) -> torch.Tensor:
    """Expert by expert: gather the rows routed to it, one product, scatter-add back.

    ``pairs`` (default: all of ``routing``'s) lets :func:`capacity_forward` pass only the
    assignments it keeps."""
    routing = route(x, weights) if routing is None else routing
    pairs = assignments(routing) if pairs is None else pairs
    out = torch.zeros_like(x)
    for e in range(weights.experts):
        mine = pairs.where(pairs.expert == e)
        if mine.token.numel() == 0:
            continue  # an expert no token chose is never read
        y = swiglu(x[mine.token], weights.w1[e], weights.w3[e], weights.w2[e])
        combine(x, mine, y, into=out)
    return out


def padded_batched(x: torch.Tensor, weights: MoEWeights, routing: Routing | None = None) -> torch.Tensor:
    """Every expert's tokens padded to the busiest expert's count ``C`` in ``[E, C, d]``,
    then three batched products over all experts at once.

    The padding rows are zeros; their outputs are computed (that is the cost of the
    rectangle) and never read back, which is the masking. Every expert's weights are read,
    even those of experts no token chose."""
    routing = route(x, weights) if routing is None else routing
    pairs = assignments(routing).sorted_by_expert()
    load = expert_load(routing, weights.experts)
    slot = slot_in_expert(pairs.expert, load)
    capacity = int(load.max())
    buffer = x.new_zeros(weights.experts, capacity, weights.hidden)
    buffer[pairs.expert, slot] = x[pairs.token]
    h = F.silu(torch.bmm(buffer, weights.w1.transpose(1, 2))) * torch.bmm(buffer, weights.w3.transpose(1, 2))
    y = torch.bmm(h, weights.w2.transpose(1, 2))
    return combine(x, pairs, y[pairs.expert, slot])


def slot_in_expert(expert_sorted: torch.Tensor, load: torch.Tensor) -> torch.Tensor:
    """For pairs already sorted by expert: each one's position inside its expert's group."""
    group_start = torch.cumsum(load, 0) - load
    return torch.arange(expert_sorted.numel()) - group_start[expert_sorted]


def padding_fraction(routing: Routing, experts: int) -> float:
    """The share of :func:`padded_batched`'s rows that are padding: ``1 - T k / (E C)``."""
    load = expert_load(routing, experts)
    return 1.0 - float(load.sum()) / (experts * float(load.max()))


GROUPED_MM = hasattr(torch, "_grouped_mm")


def grouped(x: torch.Tensor, weights: MoEWeights, routing: Routing | None = None,
            use_grouped_mm: bool | None = None) -> torch.Tensor:
    """A grouped GEMM: the gathered rows sorted by expert into one buffer, each expert's
    contiguous segment multiplied by its own matrices, no padding.

    With ``torch._grouped_mm`` (``use_grouped_mm`` default: whenever this torch has it; it
    runs on the CPU in torch 2.13, float32 and bfloat16) each of the three products is one call given the
    segment ends ``offs``. Without it, a loop over the segments of the same buffer, which
    reads each chosen expert's weights exactly once (and skips the others)."""
    routing = route(x, weights) if routing is None else routing
    use_grouped_mm = GROUPED_MM if use_grouped_mm is None else use_grouped_mm
    pairs = assignments(routing).sorted_by_expert()
    load = expert_load(routing, weights.experts)
    rows = x[pairs.token]
    if use_grouped_mm:
        ends = torch.cumsum(load, 0).to(torch.int32)
        # _grouped_mm computes rows[segment e] @ b[e]; our weights are [out, in], so pass
        # transposed views (no copies).
        gate = torch._grouped_mm(rows, weights.w1.transpose(1, 2), offs=ends)
        up = torch._grouped_mm(rows, weights.w3.transpose(1, 2), offs=ends)
        y = torch._grouped_mm(F.silu(gate) * up, weights.w2.transpose(1, 2), offs=ends)
    else:
        y = torch.empty_like(rows)
        start = 0
        for e, n in enumerate(load.tolist()):
            if n:
                y[start:start + n] = swiglu(rows[start:start + n], weights.w1[e], weights.w3[e], weights.w2[e])
            start += n
    return combine(x, pairs, y)


def dense_masked(x: torch.Tensor, weights: MoEWeights, routing: Routing | None = None) -> torch.Tensor:
    """Every expert on every token (three batched products over ``[E, T, d]``), then each
    token's ``E`` outputs summed with its gate row: its routing weights at the experts it
    chose, zero elsewhere. The zeros are the mask: nothing is gathered or scattered, and
    every expert's weights are read and multiplied whatever the routing."""
    routing = route(x, weights) if routing is None else routing
    gate = torch.zeros(x.shape[0], weights.experts, dtype=routing.weights.dtype)
    gate.scatter_(1, routing.experts, routing.weights)
    every = x.expand(weights.experts, *x.shape)
    h = F.silu(torch.bmm(every, weights.w1.transpose(1, 2))) * torch.bmm(every, weights.w3.transpose(1, 2))
    y = torch.bmm(h, weights.w2.transpose(1, 2))  # [E, T, d]
    # the gate multiply in float32, as combine() and transformers do
    return torch.einsum("te,etd->td", gate, y.to(gate.dtype)).to(x.dtype)


IMPLEMENTATIONS: dict[str, Callable[..., torch.Tensor]] = {
    "dense loop": dense_loop,
    "gather by expert": gather_by_expert,
    "padded batched (bmm)": padded_batched,
    "grouped GEMM": grouped,
    "dense masked": dense_masked,
}


# --- what a step reads ----------------------------------------------------------------------

def distinct_experts(routing: Routing) -> int:
    """How many different experts the batch chose between its tokens."""
    return int(torch.unique(routing.experts).numel())


def expert_bytes_read(routing: Routing, weights: MoEWeights) -> int:
    """Bytes of weights one step over this batch must read: every expert some token chose,
    once (the gather-by-expert and grouped paths read no other), plus the router."""
    return distinct_experts(routing) * weights.bytes_per_expert + weights.router_bytes


def expected_distinct_experts(tokens: int, experts: int = 8, top_k: int = 2) -> float:
    """The expected number of distinct experts ``T`` tokens choose under uniform routing.

    One token picks ``k`` distinct experts of ``E``, all sets equally likely, so a given
    expert is missed by it with probability ``C(E-1, k) / C(E, k) = (E - k) / E``; the
    tokens choose independently, so it is missed by all ``T`` with ``((E - k) / E) ** T``,
    and by linearity of expectation the union has ``E * (1 - ((E - k) / E) ** T)`` experts
    (``k`` at ``T = 1``, tending to ``E``)."""
    return experts * (1.0 - ((experts - top_k) / experts) ** tokens)


def mean_distinct_experts(tokens: int, trials: int, experts: int = 8, top_k: int = 2,
                          seed: int = 0) -> float:
    """:func:`distinct_experts` averaged over ``trials`` uniform random routings: the
    measured side of :func:`expected_distinct_experts`."""
    g = torch.Generator().manual_seed(seed)
    chosen = torch.rand(trials, tokens, experts, generator=g).argsort(dim=-1)[..., :top_k]
    used = torch.zeros(trials, experts, dtype=torch.bool)
    used.scatter_(1, chosen.reshape(trials, -1), True)
    return float(used.sum(dim=1).float().mean())


# --- the dense layer of the same active width --------------------------------------------

@dataclass
class DenseSwiGLU:
    """A plain SwiGLU MLP: ``w1``, ``w3`` ``[F, d]``, ``w2`` ``[d, F]``."""

    w1: torch.Tensor
    w3: torch.Tensor
    w2: torch.Tensor

    @property
    def ffn(self) -> int:
        return self.w1.shape[0]

    @property
    def nbytes(self) -> int:
        return sum(w.numel() * w.element_size() for w in (self.w1, self.w3, self.w2))


def dense_equivalent(weights: MoEWeights, experts: list[int] | None = None) -> DenseSwiGLU:
    """A dense MLP of width ``k * f``, the MoE layer's active width: ``k`` experts (default
    the first ``k``) stacked side by side. Per token it does the same FLOPs as the MoE layer
    and always reads ``k`` experts' bytes, whatever the batch; its output is the plain sum of
    those experts' outputs (no gate weights), which is how a test can check it."""
    chosen = list(range(weights.top_k)) if experts is None else list(experts)
    return DenseSwiGLU(w1=torch.cat([weights.w1[e] for e in chosen], dim=0),
                       w3=torch.cat([weights.w3[e] for e in chosen], dim=0),
                       w2=torch.cat([weights.w2[e] for e in chosen], dim=1))


def dense_forward(x: torch.Tensor, mlp: DenseSwiGLU) -> torch.Tensor:
    return swiglu(x, mlp.w1, mlp.w3, mlp.w2)


# --- capacity ------------------------------------------------------------------------------

@dataclass
class CapacityRecord:
    """What a capacity limit did: the per-expert ``capacity``, each expert's ``load`` before
    the limit, and ``kept [T, k]`` (False where token ``t``'s ``slot``-th choice was
    dropped)."""

    capacity: int
    load: torch.Tensor
    kept: torch.Tensor
    routing: Routing

    @property
    def dropped(self) -> int:
        return int((~self.kept).sum())

    @property
    def dropped_assignments(self) -> list[tuple[int, int]]:
        """(token, expert) for every dropped assignment, in token order."""
        tokens, slots = torch.nonzero(~self.kept, as_tuple=True)
        return [(int(t), int(self.routing.experts[t, s])) for t, s in zip(tokens, slots)]


def expert_capacity(tokens: int, experts: int, top_k: int, capacity_factor: float) -> int:
    """``C = ceil(capacity_factor * T * k / E)``: the even share of the ``T k`` assignments,
    times the factor."""
    return math.ceil(capacity_factor * tokens * top_k / experts)


def capacity_forward(x: torch.Tensor, weights: MoEWeights, capacity_factor: float,
                     routing: Routing | None = None) -> tuple[torch.Tensor, CapacityRecord]:
    """The layer with every expert taking at most ``C`` assignments, first come first
    served in token order (earlier tokens first, as Switch does; GShard serves all first
    choices before any second choice, which is the same thing for top-1). A token's ``k``
    experts are distinct, so an expert's queue is simply its tokens in order.

    A dropped assignment contributes zero: the token gets only its kept experts' weighted
    outputs (not renormalised), or zero if both were dropped. In a transformer block the
    residual connection still carries the token past the layer, so a dropped token is
    passed through unchanged rather than lost."""
    routing = route(x, weights) if routing is None else routing
    capacity = expert_capacity(x.shape[0], weights.experts, routing.top_k, capacity_factor)
    pairs = assignments(routing)
    # Rank of each pair within its expert, counting in token order.
    arrivals = F.one_hot(pairs.expert, weights.experts).cumsum(dim=0)
    rank = arrivals[torch.arange(pairs.expert.numel()), pairs.expert] - 1
    kept = rank < capacity
    out = gather_by_expert(x, weights, routing, pairs=pairs.where(kept))
    record = CapacityRecord(capacity=capacity, load=expert_load(routing, weights.experts),
                            kept=kept.view_as(routing.experts), routing=routing)
    return out, record


def expected_drops(load: torch.Tensor, capacity: int) -> int:
    """Assignments over capacity: ``sum over experts of max(0, load - C)``."""
    return int((load - capacity).clamp(min=0).sum())


@dataclass
class NeighbourDependence:
    """The same token's output in two batches of the same size under the same capacity:
    ``first`` (it comes before its neighbours and always gets its experts) and ``last`` (it
    comes after them and may find its experts full)."""

    first: torch.Tensor
    last: torch.Tensor
    dropped_first: int
    dropped_last: int

    @property
    def max_abs_diff(self) -> float:
        return float((self.first - self.last).abs().max())


def neighbour_dependence(token: torch.Tensor, neighbours: torch.Tensor, weights: MoEWeights,
                         capacity_factor: float) -> NeighbourDependence:
    """Run ``[token, *neighbours]`` and ``[*neighbours, token]`` with a capacity limit and
    return the token's row from each (and how many of its own ``k`` assignments were
    dropped). Without a limit the two rows are equal up to rounding; with one, they differ
    when the neighbours fill the token's experts first."""
    ahead, ahead_record = capacity_forward(torch.cat([token[None], neighbours]), weights, capacity_factor)
    behind, behind_record = capacity_forward(torch.cat([neighbours, token[None]]), weights, capacity_factor)
    return NeighbourDependence(first=ahead[0], last=behind[-1],
                               dropped_first=int((~ahead_record.kept[0]).sum()),
                               dropped_last=int((~behind_record.kept[-1]).sum()))


# --- measuring a sweep (what the chapter's cells call) ------------------------------------

def time_layers(layers: dict[str, Callable[[torch.Tensor], torch.Tensor]], hidden: int,
                batch_sizes: list[int], rounds: int, *, warmup: int = 1,
                max_tokens: dict[str, int] | None = None, seed: int = 0,
                threads: int | None = None, keep_samples: bool = False) -> list[dict]:
    """Time every layer of ``layers`` (each a function of the tokens ``x [T, hidden]``) at
    every batch size ``T``, on the same seeded random tokens, the layers in turns in the
    order of ``layers`` (:func:`labkit.util.timing.measure_interleaved`) so that a slow
    spell of a shared machine falls on all of them alike. The order is fixed, so a layer
    may find in a cache what the layer before it read (the same experts' weights). ``max_tokens`` leaves a layer out above a size
    (the dense loop, whose cost only grows).

    Returns one record per (T, layer): ``tokens``, ``layer``, ``median_ms``, ``min_ms``,
    ``p25_ms``, ``p75_ms``, ``max_ms``, ``repeats``; with ``keep_samples`` also
    ``samples_ms``, every round's time, for :func:`labkit.util.compare.compare`."""
    from labkit.util.timing import measure_interleaved

    limits = max_tokens or {}
    records = []
    for tokens, x in sweep_tokens(hidden, batch_sizes, seed).items():
        runners = {name: (lambda fn=fn: fn(x)) for name, fn in layers.items()
                   if tokens <= limits.get(name, tokens)}
        with torch.no_grad():
            timings = measure_interleaved(runners, rounds=rounds, warmup=warmup, threads=threads)
        for name, t in timings.items():
            records.append({"tokens": tokens, "layer": name, "median_ms": 1e3 * t.median,
                            "min_ms": 1e3 * t.min, "p25_ms": 1e3 * t.quantile(0.25),
                            "p75_ms": 1e3 * t.quantile(0.75), "max_ms": 1e3 * t.max,
                            "repeats": len(t.samples)})
            if keep_samples:
                records[-1]["samples_ms"] = [1e3 * s for s in t.samples]
    return records


def sweep_tokens(hidden: int, batch_sizes: list[int], seed: int = 0) -> dict[int, torch.Tensor]:
    """The seeded random tokens :func:`time_layers` times at each batch size, so that their
    routing (what each expert got) can be read after the timing."""
    g = torch.Generator().manual_seed(seed)
    return {tokens: torch.randn(tokens, hidden, generator=g) for tokens in batch_sizes}


@dataclass(frozen=True)
class CacheFit:
    """A layer's experts against one cache size (a fact about the machine, not the layer)."""

    cache_bytes: int
    expert_bytes: int
    experts_that_fit: int     # whole experts the cache could hold at once
    expert_over_cache: float  # one expert's bytes / the cache's
    token_experts_fit: bool   # the k experts one token reads fit together
    layer_fits: bool          # every expert of the layer fits together


def cache_fit(weights: MoEWeights, cache_bytes: int | None) -> CacheFit | None:
    """How `weights`' experts compare with a cache of `cache_bytes` (None where the size is
    unknown): a timing loop that reads the same experts again finds them in a cache that
    holds them, so what fits decides whether a time measures reads from memory."""
    if not cache_bytes:
        return None
    size = weights.bytes_per_expert
    return CacheFit(cache_bytes=cache_bytes, expert_bytes=size,
                    experts_that_fit=cache_bytes // size, expert_over_cache=size / cache_bytes,
                    token_experts_fit=weights.top_k * size <= cache_bytes,
                    layer_fits=weights.experts * size <= cache_bytes)


def router_distinct_experts(weights: MoEWeights, tokens: int, trials: int, seed: int = 0) -> list[int]:
    """:func:`distinct_experts` under the layer's own router for ``trials`` batches of
    ``tokens`` random tokens (standard normal): what a step over such a batch must read,
    to set beside the uniform closed form :func:`expected_distinct_experts`."""
    g = torch.Generator().manual_seed(seed)
    return [distinct_experts(route(torch.randn(tokens, weights.hidden, generator=g), weights))
            for _ in range(trials)]


def capacity_drops(weights: MoEWeights, tokens: int, factors: list[float], batches: int,
                   seed: int = 0) -> list[dict]:
    """Run :func:`capacity_forward` on ``batches`` seeded batches of ``tokens`` random tokens
    at every capacity factor, and count what the limit did.

    One record per (factor, batch): ``factor``, ``batch``, ``capacity``, ``dropped``
    (assignments), ``dropped_share`` (of the ``T k``), ``tokens_lost`` (tokens that lost
    every expert, passed through only by the residual), ``as_expected`` (the count equals
    :func:`expected_drops` from the loads)."""
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(tokens, weights.hidden, generator=g) for _ in range(batches)]
    records = []
    for factor in factors:
        for b, x in enumerate(xs):
            _, record = capacity_forward(x, weights, factor)
            records.append({"factor": factor, "batch": b, "capacity": record.capacity,
                            "dropped": record.dropped,
                            "dropped_share": record.dropped / record.kept.numel(),
                            "tokens_lost": int((~record.kept).all(dim=1).sum()),
                            "as_expected": record.dropped == expected_drops(record.load, record.capacity)})
    return records
