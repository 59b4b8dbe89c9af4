"""Training three small MoE language models and serving them with a fixed expert capacity
(chapter 20).

The model is the experiment's own, written here in plain torch: a byte-level (vocabulary
256) decoder-only transformer whose every feed-forward layer is a mixture of ``E`` SwiGLU
experts with Mixtral's routing (softmax, top ``k``, the ``k`` weights renormalised; see
:func:`labkit.experiments.moe_layer.route`). Three balancing methods differ only in how the
router is trained:

- ``"none"``: the language-modelling loss alone;
- ``"aux"``: plus the Switch Transformer's auxiliary loss (Fedus et al., 2021)
  ``alpha * E * sum_i f_i * P_i`` per layer (:func:`aux_loss`), with ``f_i`` the share of the
  ``T k`` assignments sent to expert ``i`` and ``P_i`` its mean router probability;
- ``"bias"``: DeepSeek-V3's auxiliary-loss-free balancing (arXiv 2412.19437): a per-expert
  bias added to the scores for the top-k *selection* only, the combine weights still the
  unbiased probabilities (:func:`route_with_bias`); after every step
  ``b_i += u * sign(mean load - load_i)`` (:func:`update_bias`).

Training runs without a capacity limit (every token reaches its ``k`` experts).
:func:`evaluate` scores held-out text in bits per character, either without a limit or with
every expert taking at most ``C = ceil(factor * G * k / E)`` assignments per routing group
of ``G`` tokens (:func:`labkit.experiments.moe_layer.capacity_forward`): a dropped
assignment contributes nothing and the token keeps its residual.

:func:`place_contiguous` and :func:`place_lpt` put experts on workers from measured loads;
:func:`all_to_all_bytes_per_token` is the arithmetic of expert-parallel communication.

Checkpoints (float16 safetensors plus a JSON of the config, seed, steps and the sha256 of
the training text) are written by :func:`save_checkpoint`; :func:`obtain_models` loads them
from ``data/moe-routing/`` or ``$LABKIT_CACHE/moe-routing/``, or trains. The shipped ones
were made with ``python -m labkit.experiments.moe_training --out data/moe-routing``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from labkit.experiments import moe_layer as ml

METHODS = ("none", "aux", "bias")
DATA_DIR = Path(__file__).resolve().parents[2] / "data" / "moe-routing"


@dataclass(frozen=True)
class Config:
    """The model, the balancing method and the training budget."""

    vocab: int = 256
    d_model: int = 64
    layers: int = 4
    heads: int = 4
    context: int = 128
    experts: int = 8
    ffn: int = 64
    top_k: int = 2
    method: str = "none"
    aux_alpha: float = 0.01
    bias_rate: float = 1e-3
    steps: int = 1000
    batch: int = 16
    lr: float = 3e-3
    warmup: int = 30
    seed: int = 0
    threads: int = 2
    train_share: float = 0.9

    @property
    def tokens_seen(self) -> int:
        return self.steps * self.batch * self.context

    @property
    def name(self) -> str:
        return f"{self.method}-seed{self.seed}"


# --- data ------------------------------------------------------------------------------------

def split_text(text: str, train_share: float = 0.9) -> tuple[torch.Tensor, torch.Tensor]:
    """The text's UTF-8 bytes as ``uint8`` ids: the first ``train_share`` for training, the
    rest held out."""
    data = torch.tensor(list(text.encode("utf-8")), dtype=torch.uint8)
    cut = int(train_share * data.numel())
    return data[:cut], data[cut:]


def text_sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def sample_batch(data: torch.Tensor, batch: int, context: int,
                 generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch`` windows at seeded random offsets: inputs and next-byte targets ``[B, T]``."""
    starts = torch.randint(0, data.numel() - context - 1, (batch,), generator=generator)
    rows = torch.stack([data[s:s + context + 1] for s in starts.tolist()]).long()
    return rows[:, :-1], rows[:, 1:]


def eval_windows(data: torch.Tensor, context: int, limit: int | None = None) -> torch.Tensor:
    """Non-overlapping windows of ``context + 1`` bytes (inputs plus targets), ``[N, T+1]``."""
    n = (data.numel() - 1) // context
    n = n if limit is None else min(n, limit)
    return torch.stack([data[i * context:i * context + context + 1] for i in range(n)]).long()


# --- routing and balancing --------------------------------------------------------------------

def route_with_bias(logits: torch.Tensor, top_k: int, bias: torch.Tensor | None = None) -> ml.Routing:
    """Mixtral's routing, with an optional per-expert ``bias`` that takes part in the top-k
    *selection* only. The combine weights are the unbiased softmax probabilities of the
    chosen experts, renormalised. With no bias this is exactly
    :func:`labkit.experiments.moe_layer.route`."""
    probs = torch.softmax(logits.float(), dim=-1)
    scores = probs if bias is None else probs + bias
    chosen = torch.topk(scores.detach(), top_k, dim=-1).indices
    weights = probs.gather(-1, chosen)
    return ml.Routing(logits=logits, experts=chosen, weights=weights / weights.sum(-1, keepdim=True))


def aux_loss(logits: torch.Tensor, experts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """The Switch auxiliary loss without its ``alpha``: ``E * sum_i f_i * P_i``, with
    ``f_i`` the share of the ``T k`` assignments routed to expert ``i`` (no gradient) and
    ``P_i`` the mean softmax probability of expert ``i``. It is 1 when both are uniform."""
    f = torch.bincount(experts.reshape(-1), minlength=num_experts).float() / experts.numel()
    p = torch.softmax(logits.float(), dim=-1).mean(dim=0)
    return num_experts * (f * p).sum()


def update_bias(bias: torch.Tensor, load: torch.Tensor, rate: float) -> torch.Tensor:
    """DeepSeek-V3's update, in place: ``b_i += rate * sign(mean load - load_i)``; an
    overloaded expert becomes less likely to be selected."""
    load = load.float()
    bias += rate * torch.sign(load.mean() - load)
    return bias


# --- the model --------------------------------------------------------------------------------

@dataclass
class LayerStats:
    """What one MoE layer saw in a forward pass: ``load [E]`` (assignments routed to each
    expert, before any limit), ``dropped`` assignments, ``assignments`` in all, and per
    routing group the ``max / mean`` expert load (``stragglers``)."""

    load: torch.Tensor
    dropped: int = 0
    assignments: int = 0
    stragglers: list[float] = field(default_factory=list)


class MoEFeedForward(nn.Module):
    """``E`` SwiGLU experts and a router, in moe_layer's weight layout."""

    def __init__(self, cfg: Config):
        super().__init__()
        d, f, e = cfg.d_model, cfg.ffn, cfg.experts
        self.top_k = cfg.top_k
        self.router = nn.Parameter(torch.randn(e, d) / math.sqrt(d))
        self.w1 = nn.Parameter(torch.randn(e, f, d) / math.sqrt(d))
        self.w3 = nn.Parameter(torch.randn(e, f, d) / math.sqrt(d))
        self.w2 = nn.Parameter(torch.randn(e, d, f) / math.sqrt(f) / math.sqrt(2 * cfg.layers))
        self.register_buffer("selection_bias", torch.zeros(e))

    def weights(self) -> ml.MoEWeights:
        """The layer as moe_layer weights (the parameters themselves: gradients flow)."""
        return ml.MoEWeights(router=self.router, w1=self.w1, w3=self.w3, w2=self.w2,
                             top_k=self.top_k)

    def route(self, x: torch.Tensor, use_bias: bool) -> ml.Routing:
        logits = F.linear(x, self.router)
        return route_with_bias(logits, self.top_k, self.selection_bias if use_bias else None)

    def forward(self, x: torch.Tensor, use_bias: bool = False, capacity_factor: float | None = None,
                group: int | None = None) -> tuple[torch.Tensor, ml.Routing, LayerStats]:
        """``x [T, d]``. Without ``capacity_factor`` every assignment is served; with it, the
        rows are cut into routing groups of ``group`` tokens in order and each group goes
        through :func:`~labkit.experiments.moe_layer.capacity_forward`."""
        w = self.weights()
        routing = self.route(x, use_bias)
        load = ml.expert_load(routing, w.experts)
        stats = LayerStats(load=load, assignments=routing.experts.numel())
        size = group or x.shape[0]
        for start in range(0, x.shape[0], size):
            g = ml.expert_load(group_routing(routing, start, start + size), w.experts).float()
            stats.stragglers.append(float(g.max() / g.mean()))
        if capacity_factor is None:
            return ml.gather_by_expert(x, w, routing), routing, stats
        outs = []
        for start in range(0, x.shape[0], size):
            part = group_routing(routing, start, start + size)
            out, record = ml.capacity_forward(x[start:start + size], w, capacity_factor, routing=part)
            stats.dropped += record.dropped
            outs.append(out)
        return torch.cat(outs), routing, stats


def group_routing(routing: ml.Routing, start: int, stop: int) -> ml.Routing:
    """Tokens ``start:stop`` of a routing (one routing group)."""
    return ml.Routing(logits=routing.logits[start:stop], experts=routing.experts[start:stop],
                      weights=routing.weights[start:stop])


class Block(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.heads = cfg.heads
        self.norm1 = nn.RMSNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.norm2 = nn.RMSNorm(cfg.d_model)
        self.moe = MoEFeedForward(cfg)

    def forward(self, x, **moe_args):
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        y, routing, stats = self.moe(self.norm2(x).reshape(b * t, d), **moe_args)
        return x + y.view(b, t, d), routing, stats


class TinyMoELM(nn.Module):
    """Byte embedding plus learned positions, ``layers`` blocks of attention and MoE, a final
    RMSNorm, and an output head tied to the embedding."""

    def __init__(self, cfg: Config):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.d_model)
        nn.init.normal_(self.embed.weight, std=0.02)
        self.pos = nn.Parameter(torch.zeros(cfg.context, cfg.d_model))
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = nn.RMSNorm(cfg.d_model)

    def forward(self, ids: torch.Tensor, **moe_args):
        """Logits ``[B, T, V]``, and per layer its routing and :class:`LayerStats`."""
        x = self.embed(ids) + self.pos[:ids.shape[1]]
        routings, stats = [], []
        for block in self.blocks:
            x, r, s = block(x, **moe_args)
            routings.append(r)
            stats.append(s)
        return F.linear(self.norm(x), self.embed.weight), routings, stats


# --- training ---------------------------------------------------------------------------------

@contextmanager
def torch_threads(n: int | None):
    before = torch.get_num_threads()
    if n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@dataclass
class Trained:
    """A model with how it was made: ``meta`` holds the config, the text's sha256, the
    final training losses and the training time."""

    model: TinyMoELM
    meta: dict


def train(cfg: Config, text: str, log_every: int = 0) -> Trained:
    """Train one model on the first ``train_share`` of ``text``: AdamW, linear warm-up then
    cosine decay, gradient clipping at 1, the sampler and the initial weights seeded by
    ``cfg.seed``, ``cfg.threads`` threads. No capacity limit."""
    if cfg.method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}")
    train_data, _ = split_text(text, cfg.train_share)
    with torch_threads(cfg.threads):
        torch.manual_seed(cfg.seed)
        model = TinyMoELM(cfg)
        g = torch.Generator().manual_seed(cfg.seed)
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.1)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / cfg.warmup)
                                                  * 0.5 * (1 + math.cos(math.pi * s / cfg.steps)))
        use_bias = cfg.method == "bias"
        t0 = time.perf_counter()
        lm_losses = []
        for step in range(cfg.steps):
            x, y = sample_batch(train_data, cfg.batch, cfg.context, g)
            logits, routings, _ = model(x, use_bias=use_bias)
            lm = F.cross_entropy(logits.reshape(-1, cfg.vocab), y.reshape(-1))
            loss = lm
            if cfg.method == "aux":
                loss = lm + cfg.aux_alpha * sum(aux_loss(r.logits, r.experts, cfg.experts)
                                                for r in routings)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            if use_bias:
                with torch.no_grad():
                    for block, r in zip(model.blocks, routings):
                        update_bias(block.moe.selection_bias,
                                    ml.expert_load(r, cfg.experts), cfg.bias_rate)
            lm_losses.append(float(lm.detach()))
            if log_every and (step + 1) % log_every == 0:
                print(f"{cfg.name} step {step + 1}/{cfg.steps} lm {lm_losses[-1]:.3f}"
                      f" ({time.perf_counter() - t0:.0f} s)", flush=True)
        seconds = time.perf_counter() - t0
    model.eval()
    tail = lm_losses[-max(1, cfg.steps // 10):]
    meta = {"config": asdict(cfg), "text_sha256": text_sha256(text), "train_seconds": seconds,
            "final_train_bits_per_char": sum(tail) / len(tail) / math.log(2),
            "tokens_seen": cfg.tokens_seen, "torch": torch.__version__}
    return Trained(model, meta)


# --- evaluation -------------------------------------------------------------------------------

@dataclass
class Evaluation:
    """Held-out bits per character and, per layer, the loads, drops and stragglers."""

    bits_per_char: float
    load: list[list[int]]
    dropped: int
    assignments: int
    straggler: list[float]

    @property
    def dropped_share(self) -> float:
        return self.dropped / self.assignments


@torch.no_grad()
def evaluate(model: TinyMoELM, windows: torch.Tensor, capacity_factor: float | None = None,
             group: int | None = None, batch: int = 16, use_bias: bool | None = None) -> Evaluation:
    """Score ``windows [N, T+1]`` (from :func:`eval_windows`) in bits per character.

    With ``capacity_factor``, each MoE layer serves the ``batch * T`` rows of a forward pass
    in routing groups of ``group`` consecutive tokens (a window's positions in order, then
    the next window's) with a fixed capacity per expert per group. ``straggler`` is, per
    layer, the mean over groups of max/mean expert load before the limit. A model trained
    with the bias method routes with its bias (``use_bias`` default: its method's)."""
    cfg = model.cfg
    use_bias = cfg.method == "bias" if use_bias is None else use_bias
    nll, count = 0.0, 0
    load = [torch.zeros(cfg.experts, dtype=torch.long) for _ in range(cfg.layers)]
    strag = [[] for _ in range(cfg.layers)]
    dropped = assignments = 0
    for start in range(0, windows.shape[0], batch):
        rows = windows[start:start + batch]
        logits, _, stats = model(rows[:, :-1], use_bias=use_bias, capacity_factor=capacity_factor,
                                 group=group)
        nll += float(F.cross_entropy(logits.reshape(-1, cfg.vocab), rows[:, 1:].reshape(-1),
                                     reduction="sum"))
        count += rows[:, 1:].numel()
        for i, s in enumerate(stats):
            load[i] += s.load
            strag[i].extend(s.stragglers)
            dropped += s.dropped
            assignments += s.assignments
    return Evaluation(bits_per_char=nll / count / math.log(2), load=[l.tolist() for l in load],
                      dropped=dropped, assignments=assignments,
                      straggler=[sum(s) / len(s) for s in strag])


@torch.no_grad()
def window_bits(model: TinyMoELM, windows: torch.Tensor, batch: int = 16) -> list[float]:
    """Held-out bits per character of each window of ``windows [N, T+1]``, no capacity
    limit: the samples that pair two models scored on the same text (their mean is
    :func:`evaluate`'s ``bits_per_char``, every window having ``T`` characters)."""
    use_bias = model.cfg.method == "bias"
    bits = []
    for start in range(0, windows.shape[0], batch):
        rows = windows[start:start + batch]
        logits, _, _ = model(rows[:, :-1], use_bias=use_bias)
        nll = F.cross_entropy(logits.transpose(1, 2), rows[:, 1:], reduction="none")
        bits += (nll.mean(dim=1) / math.log(2)).tolist()
    return bits


def capacity_sweep(models: dict[str, TinyMoELM], windows: torch.Tensor, factors: list[float],
                   groups: list[int], batch: int = 16) -> list[dict]:
    """Every model at every (group, factor), against its own unlimited score.

    One record per (model, group, factor): ``model``, ``method``, ``group``, ``factor``,
    ``bpc``, ``bpc_free`` (no limit), ``bpc_lost``, ``dropped_share``, ``straggler`` (the
    mean over layers of the per-group max/mean load)."""
    records = []
    for name, model in models.items():
        free = evaluate(model, windows, batch=batch).bits_per_char
        for group in groups:
            for factor in factors:
                ev = evaluate(model, windows, factor, group, batch=batch)
                records.append({"model": name, "method": model.cfg.method, "seed": model.cfg.seed,
                                "group": group, "factor": factor, "bpc": ev.bits_per_char,
                                "bpc_free": free, "bpc_lost": ev.bits_per_char - free,
                                "dropped_share": ev.dropped_share,
                                "straggler": sum(ev.straggler) / len(ev.straggler)})
    return records


# --- placement and communication ---------------------------------------------------------------

def place_contiguous(experts: int, workers: int) -> list[list[int]]:
    """Experts ``0..E-1`` in order, ``E / workers`` to a worker."""
    per = experts // workers
    return [list(range(w * per, (w + 1) * per)) for w in range(workers)]


def place_lpt(load: list[float], workers: int) -> list[list[int]]:
    """Longest processing time first: experts by load, heaviest first, each to the least
    loaded worker that still has a free slot (every worker holds ``E / workers``)."""
    per = len(load) // workers
    bins: list[list[int]] = [[] for _ in range(workers)]
    totals = [0.0] * workers
    for e in sorted(range(len(load)), key=lambda i: (-load[i], i)):
        w = min((w for w in range(workers) if len(bins[w]) < per), key=lambda w: (totals[w], w))
        bins[w].append(e)
        totals[w] += load[e]
    return bins


def busiest_share(load: list[float], placement: list[list[int]]) -> float:
    """The busiest worker's share of all assignments (``1 / workers`` is perfect)."""
    return max(sum(load[e] for e in experts) for experts in placement) / sum(load)


def all_to_all_bytes_per_token(top_k: int, d_model: int, dtype_bytes: int, layers: int = 1) -> int:
    """Bytes one token sends across workers with expert parallelism: its activation to each
    of its ``k`` experts and the result back (2 directions), per MoE layer; an upper bound
    that assumes every chosen expert is on another worker."""
    return top_k * d_model * 2 * dtype_bytes * layers


def placement_records(model: TinyMoELM, measure: torch.Tensor, check: torch.Tensor,
                      workers: int, batch: int = 16) -> list[dict]:
    """Per MoE layer: place the experts on ``workers`` from the loads measured on the windows
    ``measure`` (contiguous and LPT), then report each placement's busiest-worker share on
    the loads of other windows, ``check`` (so the placement is not judged on the text it was
    fitted to). One record per layer: ``layer``, ``contiguous``, ``lpt``, ``perfect``
    (``1 / workers``)."""
    fitted = evaluate(model, measure, batch=batch).load
    seen = evaluate(model, check, batch=batch).load
    e = model.cfg.experts
    return [{"layer": i, "contiguous": busiest_share(seen[i], place_contiguous(e, workers)),
             "lpt": busiest_share(seen[i], place_lpt(fitted[i], workers)),
             "lpt_in_sample": busiest_share(fitted[i], place_lpt(fitted[i], workers)),
             "perfect": 1 / workers, "assignments_fitted": sum(fitted[i]),
             "assignments_checked": sum(seen[i])} for i in range(model.cfg.layers)]


def share_difference(share_a: float, count_a: int, share_b: float, count_b: int,
                     z: float = 2.0) -> str:
    """"lower" (``share_a`` below ``share_b``), "higher", or "within the noise": a
    difference counts only beyond ``z`` binomial standard errors of the two shares, each
    share of ``count`` assignments. Neighbouring bytes choose alike, so the binomial error
    understates the real noise: "within the noise" is safe, a direction may still be noise."""
    se = math.sqrt(share_a * (1 - share_a) / count_a + share_b * (1 - share_b) / count_b)
    if share_b - share_a > z * se:
        return "lower"
    if share_a - share_b > z * se:
        return "higher"
    return "within the noise"


# --- checkpoints ------------------------------------------------------------------------------

def save_checkpoint(trained: Trained, folder: str | Path) -> Path:
    """``<name>.safetensors`` (float16) and ``<name>.json`` (``meta``) in ``folder``."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    name = trained.model.cfg.name
    state = {k: v.detach().to(torch.float16).contiguous() for k, v in trained.model.state_dict().items()}
    save_file(state, folder / f"{name}.safetensors")
    (folder / f"{name}.json").write_text(json.dumps(trained.meta, indent=1, sort_keys=True) + "\n")
    return folder / f"{name}.safetensors"


def load_checkpoint(path: str | Path) -> Trained:
    from safetensors.torch import load_file

    path = Path(path)
    meta = json.loads(path.with_suffix(".json").read_text())
    model = TinyMoELM(Config(**meta["config"]))
    model.load_state_dict({k: v.float() for k, v in load_file(path).items()})
    return Trained(model.eval(), meta)


def obtain_models(configs: list[Config], text: str, folders: list[Path],
                  save_to: list[Path] = (), log_every: int = 0, train_missing: bool = True
                  ) -> tuple[dict[str, Trained], dict[str, str]]:
    """For every config, the first checkpoint in ``folders`` made with that config from this
    text, else a freshly trained model (saved to every folder of ``save_to``). Returns the
    models by name and, by name, where each came from (a folder, or ``"trained now"``).
    With ``train_missing=False`` a config with no checkpoint is left out."""
    models, origin = {}, {}
    sha = text_sha256(text)
    for cfg in configs:
        for folder in folders:
            path = Path(folder) / f"{cfg.name}.safetensors"
            if path.is_file():
                got = load_checkpoint(path)
                if got.meta["config"] == asdict(cfg) and got.meta["text_sha256"] == sha:
                    models[cfg.name], origin[cfg.name] = got, str(folder)
                    break
        else:
            if not train_missing:
                continue
            models[cfg.name] = train(cfg, text, log_every=log_every)
            origin[cfg.name] = "trained now"
            for folder in save_to:
                save_checkpoint(models[cfg.name], folder)
    return models, origin


def models_for_profile(full: bool, seeds: list[int], text: str, toy_steps: int = 20,
                       log_every: int = 0) -> tuple[dict[str, Trained], dict[str, str]]:
    """The models a profile runs on.

    ``full``: the checkpoints in ``data/moe-routing/`` or ``$LABKIT_CACHE/moe-routing/`` made
    with the default config from this text, else trained now (minutes each) and saved to
    both folders. ci: the shipped checkpoints of ``seeds`` that are present, provided every
    method has at least one; otherwise toy models of the same shape trained for
    ``toy_steps`` steps and saved nowhere (their origin says so)."""
    from labkit.util.paths import cache_root

    real = configs(seeds)
    cache = cache_root() / "moe-routing"
    labels = {str(DATA_DIR): "shipped checkpoint", str(cache): "cache ($LABKIT_CACHE)"}
    if full:
        models, origin = obtain_models(real, text, [DATA_DIR, cache], save_to=[cache, DATA_DIR],
                                       log_every=log_every)
        for name, t in models.items():
            if origin[name] == str(cache):
                save_checkpoint(t, DATA_DIR)
        return models, {k: labels.get(v, v) for k, v in origin.items()}
    models, origin = obtain_models(real, text, [DATA_DIR], train_missing=False)
    if all(any(t.model.cfg.method == m for t in models.values()) for m in METHODS):
        return models, {k: labels[v] for k, v in origin.items()}
    toy = configs(seeds, steps=toy_steps, warmup=min(Config.warmup, toy_steps))
    models, _ = obtain_models(toy, text, [])
    return models, {k: f"toy, trained now for {toy_steps} steps" for k in models}


def configs(seeds: list[int], **overrides) -> list[Config]:
    """One config per (method, seed)."""
    return [replace(Config(**overrides), method=m, seed=s) for m in METHODS for s in seeds]


def main(argv: list[str] | None = None) -> None:
    from labkit.eval import eval_text
    from labkit.util.paths import cache_root

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=DATA_DIR)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--steps", type=int, default=Config.steps)
    args = p.parse_args(argv)
    text = eval_text()
    cache = cache_root() / "moe-routing"
    models, origin = obtain_models(configs(args.seeds, steps=args.steps), text, [args.out, cache],
                                   save_to=[cache], log_every=100)
    for name, t in models.items():
        save_checkpoint(t, args.out)
        print(name, origin[name], f"{t.meta['train_seconds']:.0f} s",
              f"train {t.meta['final_train_bits_per_char']:.3f} bits/char")


if __name__ == "__main__":
    main()
