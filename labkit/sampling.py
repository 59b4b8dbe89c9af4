"""Turning logits into tokens: sampling parameters, logits processors, random streams.

The pipeline for one sequence at one decode step is

    logits --logit bias--> --repetition penalty--> --presence/frequency penalties--> --grammar mask-->
           --temperature--> --top-k--> --top-p--> --min-p--> softmax --> draw

in that order, which is the order Hugging Face ``generate`` applies the knobs it shares with
us in, so a request gives the same distribution here as there; OpenAI's logit bias and its
presence and frequency penalties, which Hugging Face lacks, go where vLLM puts them (the bias
first, among the processors that can move the argmax, before the penalties). A
structured-output request's grammar mask (`labkit.structured`: the tokens its grammar allows
next) comes after the bias and the penalties and before everything that picks: no bias,
temperature, filter or greedy choice can then reach a token the grammar refuses. Each processor is a
plain function from a ``[V]`` or ``[B, V]`` float tensor to a *new* tensor; filtered tokens
get ``-inf``.

Randomness is per (request seed, step): the token at step ``k`` of a request with seed ``s``
is a deterministic function of the logits and of one uniform drawn from stream ``(s, k)``.
That makes a request reproducible no matter which other requests share its batch. The obvious
way to get such a stream, ``torch.manual_seed(s + k)``, is a real bug: request ``s + 1`` at
step ``k`` reuses request ``s``'s stream at step ``k + 1``, so two requests with adjacent seeds
and similar logits emit one-step-shifted copies of each other. ``naive_step_generator`` keeps
that scheme so the book can show the bug; ``step_generator`` is the fix (hash the pair).
"""

from __future__ import annotations

import hashlib
import math
import numbers
import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from labkit.structured.contract import ResponseFormat

__all__ = [
    "SamplingParams",
    "apply_logit_bias",
    "apply_repetition_penalty",
    "apply_presence_frequency_penalties",
    "apply_temperature",
    "apply_top_k",
    "apply_top_p",
    "apply_min_p",
    "apply_allowed",
    "process_logits",
    "probabilities",
    "naive_step_generator",
    "step_generator",
    "draw_uniform",
    "sample",
    "sample_batch",
]

_U64 = 1 << 64
MAX_LOGPROBS = 20  # OpenAI's limit on top_logprobs
_SCHEMES = ("independent", "naive")


# --------------------------------------------------------------------------- parameters


def _check_real(name: str, value, *, low=None, high=None, low_open=False, high_open=False) -> float:
    """Return ``value`` as a float, or raise ValueError naming the field and its allowed range."""
    lo = "-inf" if low is None else f"{low}"
    hi = "inf" if high is None else f"{high}"
    allowed = f"{'(' if low_open or low is None else '['}{lo}, {hi}{')' if high_open or high is None else ']'}"
    # bool is an int subclass; temperature=True is always a caller bug, never a number.
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a real number in {allowed}, got {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite and in {allowed}, got {value!r}")
    if low is not None and (value <= low if low_open else value < low):
        raise ValueError(f"{name} must be in {allowed}, got {value!r}")
    if high is not None and (value >= high if high_open else value > high):
        raise ValueError(f"{name} must be in {allowed}, got {value!r}")
    return value


def _check_int(name: str, value, *, low: int, high: int | None = None) -> int:
    """Return ``value`` as an int in ``[low, high)``, or raise ValueError naming the field."""
    allowed = f">= {low}" if high is None else f"in [{low}, {high})"
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an integer {allowed}, got {value!r}")
    value = int(value)
    if value < low or (high is not None and value >= high):
        raise ValueError(f"{name} must be an integer {allowed}, got {value!r}")
    return value


def _check_logit_bias(value) -> tuple[tuple[int, float], ...]:
    """``value`` (a mapping or an iterable of pairs) as ``((token_id, bias), ...)`` sorted by id."""
    pairs = value.items() if isinstance(value, Mapping) else value
    if isinstance(pairs, (str, bytes)) or not isinstance(pairs, Iterable):
        raise ValueError(f"logit_bias must be (token_id, bias) pairs or a mapping, got {value!r}")
    out: dict[int, float] = {}
    for pair in pairs:
        if isinstance(pair, (str, bytes)) or not isinstance(pair, Sequence) or len(pair) != 2:
            raise ValueError(f"logit_bias must be (token_id, bias) pairs, got the item {pair!r}")
        token = _check_int("logit_bias token id", pair[0], low=0)
        if token in out:
            raise ValueError(f"logit_bias names the token id {token} twice")
        out[token] = _check_real(f"logit_bias[{token}]", pair[1])
    return tuple(sorted(out.items()))


@dataclass(frozen=True)
class SamplingParams:
    """How to pick the next token of one request.

    ``temperature == 0`` means greedy (argmax, lowest token id on ties); the other knobs are
    off at their defaults (``top_k=0``, ``top_p=1``, ``min_p=0``, ``repetition_penalty=1``,
    ``presence_penalty=0``, ``frequency_penalty=0``). ``seed=None`` means nondeterministic
    sampling. ``stop``, ``stop_token_ids`` and ``ignore_eos`` are carried here for the
    engine's stopping logic; sampling ignores them. Lists given for ``stop``/``stop_token_ids``
    are stored as tuples so the params stay hashable.

    ``presence_penalty`` and ``frequency_penalty`` (each in [-2, 2]) are OpenAI's: they count
    the sample's *output* tokens only (see ``apply_presence_frequency_penalties``), whereas
    ``repetition_penalty`` also looks at the prompt.

    ``logit_bias`` is OpenAI's: ``(token_id, bias)`` pairs whose bias is added to the token's
    raw logit before anything else (see ``apply_logit_bias``). A mapping or any iterable of
    pairs is taken and stored as a tuple sorted by token id, so the params stay hashable and
    two equal biases compare equal; a token id may appear once. Biases are finite reals (the
    HTTP service holds them to OpenAI's [-100, 100]); whether the ids are in the vocabulary is
    checked against the logits (and by the engine's admission, ``EngineLimits``).

    ``response_format`` (a `labkit.structured.ResponseFormat`) constrains the output to a
    grammar; the engine compiles it and hands the sampler each step's allowed tokens.

    ``logprobs`` asks the engine to report, for every output token, its log-probability and
    the ``logprobs`` (0 to 20) most likely alternatives; ``None`` computes nothing. These
    are *raw* log-probabilities: ``log_softmax`` of the model's logits for that position,
    in float32, before any penalty, temperature or filter (vLLM's default), so they describe
    the model, not the sampler. The alternatives are the largest raw log-probabilities in
    descending order, lower token id first on ties, as ``(token_id, logprob)`` pairs.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int = 16
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    response_format: ResponseFormat | None = None

    def __post_init__(self) -> None:
        # Frozen dataclass: normalise through object.__setattr__ (e.g. temperature=0 -> 0.0).
        def put(name, value):
            object.__setattr__(self, name, value)

        put("temperature", _check_real("temperature", self.temperature, low=0.0))
        put("top_k", _check_int("top_k", self.top_k, low=0))
        put("top_p", _check_real("top_p", self.top_p, low=0.0, high=1.0, low_open=True))
        put("min_p", _check_real("min_p", self.min_p, low=0.0, high=1.0, high_open=True))
        put(
            "repetition_penalty",
            _check_real("repetition_penalty", self.repetition_penalty, low=0.0, low_open=True),
        )
        put("max_tokens", _check_int("max_tokens", self.max_tokens, low=1))
        if self.seed is not None:
            put("seed", _check_int("seed", self.seed, low=0, high=_U64))
        # A bare string would iterate as single characters: stop="\n\n" must not mean stop="\n".
        if isinstance(self.stop, str) or not isinstance(self.stop, Iterable):
            raise ValueError(f"stop must be a tuple of non-empty strings, got {self.stop!r}")
        stop = tuple(self.stop)
        if not all(isinstance(s, str) and s for s in stop):
            raise ValueError(f"stop must be a tuple of non-empty strings, got {self.stop!r}")
        put("stop", stop)
        if isinstance(self.stop_token_ids, (str, bytes)) or not isinstance(self.stop_token_ids, Iterable):
            raise ValueError(f"stop_token_ids must be a tuple of integers >= 0, got {self.stop_token_ids!r}")
        put("stop_token_ids", tuple(_check_int("stop_token_ids[i]", t, low=0) for t in self.stop_token_ids))
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            put(name, _check_real(name, getattr(self, name), low=-2.0, high=2.0))
        if self.logprobs is not None:
            put("logprobs", _check_int("logprobs", self.logprobs, low=0, high=MAX_LOGPROBS + 1))
        put("logit_bias", _check_logit_bias(self.logit_bias))
        if self.response_format is not None:
            if not isinstance(self.response_format, ResponseFormat):
                raise ValueError(f"response_format must be a ResponseFormat, got {self.response_format!r}")
            if self.ignore_eos:
                # The grammar's end is the end-of-sequence token: going on past it has no meaning.
                raise ValueError("ignore_eos cannot be combined with a response format")

    @property
    def greedy(self) -> bool:
        """True when the next token is the argmax (temperature 0)."""
        return self.temperature == 0.0


# --------------------------------------------------------------------------- processors


def _check_logits(logits: torch.Tensor) -> None:
    if not isinstance(logits, torch.Tensor) or logits.dim() not in (1, 2) or not logits.is_floating_point():
        raise ValueError("logits must be a 1-D [V] or 2-D [B, V] floating-point tensor")


def _token_counts(logits: torch.Tensor, token_ids, name: str) -> torch.Tensor:
    """How often each token id occurs in ``token_ids`` (one id sequence per row of 2-D
    logits), as a tensor shaped like ``logits`` with its dtype and device."""
    vocab = logits.shape[-1]
    rows = [token_ids] if logits.dim() == 1 else list(token_ids)
    if logits.dim() == 2 and len(rows) != logits.shape[0]:
        raise ValueError(f"{name} has {len(rows)} rows but logits has {logits.shape[0]}")
    counts = torch.zeros((len(rows), vocab), dtype=logits.dtype, device=logits.device)
    for row, ids in enumerate(rows):
        ids = torch.as_tensor(ids if isinstance(ids, torch.Tensor) else list(ids), dtype=torch.long).reshape(-1)
        if ids.numel() == 0:
            continue
        if int(ids.min()) < 0 or int(ids.max()) >= vocab:
            raise ValueError(f"{name} must be in [0, {vocab}), got min {int(ids.min())} max {int(ids.max())}")
        counts[row] = torch.bincount(ids, minlength=vocab).to(counts)
    return counts.reshape(logits.shape)


def _seen_mask(logits: torch.Tensor, seen_token_ids) -> torch.Tensor:
    """Boolean mask shaped like ``logits``: True where the token id was seen (prompt + output)."""
    # Duplicates are fine: the repetition penalty applies once per distinct token.
    return _token_counts(logits, seen_token_ids, "seen_token_ids") > 0


def apply_logit_bias(logits: torch.Tensor, logit_bias) -> torch.Tensor:
    """Add each ``(token_id, bias)`` pair's bias to that token's logit, in every row.

    OpenAI's definition ("the bias is added to the logits generated by the model prior to
    sampling"): in probability terms, a token's odds against every other token are multiplied
    by ``exp(bias)``, so +100 all but forces a token and -100 all but bans it (exactly, under
    greedy decoding, unless logits differ by as much).
    Ids outside the vocabulary raise ValueError: a bias that could never apply is a caller bug.
    """
    _check_logits(logits)
    pairs = _check_logit_bias(logit_bias)  # a few hundred pairs at most: cheap beside the step
    if not pairs:
        return logits.clone()
    vocab = logits.shape[-1]
    ids = [t for t, _ in pairs]
    if ids[-1] >= vocab:  # sorted: the last id is the largest
        raise ValueError(f"logit_bias token ids must be in [0, {vocab}), got {[t for t in ids if t >= vocab]}")
    bias = torch.zeros(vocab, dtype=logits.dtype, device=logits.device)
    bias[torch.tensor(ids, dtype=torch.long, device=logits.device)] = torch.tensor(
        [b for _, b in pairs], dtype=logits.dtype, device=logits.device)
    return logits + bias


def apply_repetition_penalty(logits: torch.Tensor, seen_token_ids, penalty: float) -> torch.Tensor:
    """CTRL / Hugging Face repetition penalty, applied once per distinct seen token.

    For every token id in ``seen_token_ids`` a positive logit is divided by ``penalty`` and a
    negative one multiplied by it, so ``penalty > 1`` always makes a seen token less likely
    (plain division would make a negative logit *more* likely). For 2-D logits pass one id
    sequence per row (a list of sequences, or a ``[B, T]`` LongTensor like HF's ``input_ids``).
    """
    _check_logits(logits)
    penalty = _check_real("repetition_penalty", penalty, low=0.0, low_open=True)
    if penalty == 1.0 or seen_token_ids is None:
        return logits.clone()
    seen = _seen_mask(logits, seen_token_ids)
    penalised = torch.where(logits < 0, logits * penalty, logits / penalty)
    return torch.where(seen, penalised, logits)


def apply_presence_frequency_penalties(
    logits: torch.Tensor, output_token_ids, presence_penalty: float, frequency_penalty: float
) -> torch.Tensor:
    """OpenAI's presence and frequency penalties (each in [-2, 2]).

    ``logit[j] -= count[j] * frequency_penalty + (count[j] > 0) * presence_penalty``, where
    ``count[j]`` is how often token ``j`` occurs in the sample's output so far. The prompt
    does not count: that is OpenAI's documented formula and what vLLM does. Positive values
    discourage repeats (the frequency term more so the more often a token recurs), negative
    ones encourage them. For 2-D logits pass one id sequence per row.
    """
    _check_logits(logits)
    presence_penalty = _check_real("presence_penalty", presence_penalty, low=-2.0, high=2.0)
    frequency_penalty = _check_real("frequency_penalty", frequency_penalty, low=-2.0, high=2.0)
    if (presence_penalty == 0.0 and frequency_penalty == 0.0) or output_token_ids is None:
        return logits.clone()
    counts = _token_counts(logits, output_token_ids, "output_token_ids")
    return logits - (counts * frequency_penalty + (counts > 0).to(logits.dtype) * presence_penalty)


def apply_temperature(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Divide logits by ``temperature`` (> 0). Greedy (0) is not a scaling; callers handle it."""
    _check_logits(logits)
    temperature = _check_real("temperature", temperature, low=0.0, low_open=True)
    return logits / temperature


def apply_top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the ``k`` largest logits per row (``k == 0`` or ``k >= V``: keep all).

    Tokens tied with the k-th largest value are all kept, as in Hugging Face's TopK warper:
    which of two equal logits to drop would otherwise depend on sort internals.
    """
    _check_logits(logits)
    k = _check_int("top_k", k, low=0)
    if k == 0 or k >= logits.shape[-1]:
        return logits.clone()
    kth_largest = torch.topk(logits, k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth_largest, float("-inf"))


def apply_top_p(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Nucleus filter: keep the smallest set of most probable tokens whose mass is >= ``top_p``.

    A token survives when the probability mass of the tokens ranked strictly above it is
    < ``top_p``; the most probable token therefore always survives. Equal probabilities are
    ranked by token id (stable sort) so the cut is deterministic.
    """
    _check_logits(logits)
    top_p = _check_real("top_p", top_p, low=0.0, high=1.0, low_open=True)
    if top_p == 1.0:
        # Not just a shortcut: in floating point the mass above a tail token can round to 1.0.
        return logits.clone()
    # float32 at least: half-precision cumsums over a 100k vocab lose the tail entirely.
    probs = torch.softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    mass_above = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    keep_sorted = mass_above < top_p
    keep_sorted[..., 0] = True
    keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
    return logits.masked_fill(~keep, float("-inf"))


def apply_min_p(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """Keep tokens whose probability is >= ``min_p`` times the top token's probability.

    Done in log space (``logit - max_logit >= log(min_p)``): it is the same test, needs no
    softmax, and cannot underflow when the top probability is itself tiny.
    """
    _check_logits(logits)
    min_p = _check_real("min_p", min_p, low=0.0, high=1.0, high_open=True)
    if min_p == 0.0:
        return logits.clone()
    max_logit = logits.amax(dim=-1, keepdim=True)
    return logits.masked_fill(logits - max_logit < math.log(min_p), float("-inf"))


def apply_allowed(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Set every token outside ``allowed`` (a bool tensor shaped like ``logits``) to -inf."""
    _check_logits(logits)
    if allowed.shape != logits.shape or allowed.dtype != torch.bool:
        raise ValueError(f"allowed must be a bool tensor of shape {tuple(logits.shape)}")
    if not bool(allowed.any(dim=-1).all()):
        raise ValueError("allowed leaves a row without any token")
    return logits.masked_fill(~allowed.to(logits.device), float("-inf"))


def _greedy_mask(logits: torch.Tensor) -> torch.Tensor:
    """All but the argmax set to -inf. torch.argmax returns the first maximum: lowest id wins ties."""
    winner = torch.argmax(logits, dim=-1, keepdim=True)
    out = torch.full_like(logits, float("-inf"))
    return out.scatter(-1, winner, logits.gather(-1, winner))


def _has_output_penalties(params: SamplingParams) -> bool:
    return params.presence_penalty != 0.0 or params.frequency_penalty != 0.0


def process_logits(
    logits: torch.Tensor, params: SamplingParams, seen_token_ids=None, *, output_token_ids=None,
    allowed: torch.Tensor | None = None,
) -> torch.Tensor:
    """Apply ``params`` to raw logits: logit bias, repetition penalty (over ``seen_token_ids``,
    prompt and output), presence/frequency penalties (over ``output_token_ids``, the output
    only), the grammar mask (``allowed``, a bool tensor shaped like ``logits``: tokens outside
    get -inf), temperature, top-k, top-p, min-p.

    The order is Hugging Face's, with OpenAI's bias and penalties where vLLM applies them
    (the bias first: a penalty then acts on the biased logit, as in vLLM). It
    matters: top-p after temperature sees the sharpened (or flattened) distribution, and
    min-p after top-p leaves the nucleus unchanged whereas the reverse would not. Logits are
    upcast to at least float32 first. Under greedy params only the bias and penalties apply (the
    filters always keep the argmax) and everything but the argmax is set to -inf, so a
    softmax of the result is the greedy one-hot. A penalty whose token ids are ``None`` is
    skipped.
    """
    _check_logits(logits)
    out = logits.to(torch.promote_types(logits.dtype, torch.float32))
    if params.logit_bias:
        out = apply_logit_bias(out, params.logit_bias)
    if params.repetition_penalty != 1.0 and seen_token_ids is not None:
        out = apply_repetition_penalty(out, seen_token_ids, params.repetition_penalty)
    if _has_output_penalties(params) and output_token_ids is not None:
        out = apply_presence_frequency_penalties(
            out, output_token_ids, params.presence_penalty, params.frequency_penalty
        )
    if allowed is not None:
        out = apply_allowed(out, allowed)
    if params.greedy:
        return _greedy_mask(out)
    if params.temperature != 1.0:
        out = apply_temperature(out, params.temperature)
    out = apply_top_k(out, params.top_k)
    out = apply_top_p(out, params.top_p)
    out = apply_min_p(out, params.min_p)
    return out


def probabilities(
    logits: torch.Tensor, params: SamplingParams, seen_token_ids=None, *, output_token_ids=None,
    allowed: torch.Tensor | None = None,
) -> torch.Tensor:
    """The distribution ``sample`` draws from: softmax of ``process_logits`` (one-hot if greedy)."""
    processed = process_logits(logits, params, seen_token_ids, output_token_ids=output_token_ids,
                               allowed=allowed)
    return torch.softmax(processed, dim=-1)


# --------------------------------------------------------------------------- random streams


def naive_step_generator(seed: int, step: int) -> torch.Generator:
    """THE BUGGY SCHEME, kept for the book: stream for (seed, step) is ``manual_seed(seed + step)``.

    This is what ``torch.manual_seed(s + k)`` before each step gives. Streams only depend on
    ``seed + step``, so request ``s + 1`` at step ``k`` reuses request ``s``'s stream at step
    ``k + 1``: adjacent-seed requests produce one-step-shifted copies. Use ``step_generator``.
    """
    seed = _check_int("seed", seed, low=0, high=_U64)
    step = _check_int("step", step, low=0, high=_U64)
    return torch.Generator().manual_seed((seed + step) % _U64)


def _stream_seed(seed: int, step: int) -> int:
    # Fixed-width packing makes (seed, step) -> bytes injective, and the hash makes streams of
    # neighbouring pairs unrelated; `person` keeps these hashes apart from any other use of blake2b.
    payload = struct.pack("<QQ", seed, step)
    digest = hashlib.blake2b(payload, digest_size=8, person=b"labkit.sampling").digest()
    return int.from_bytes(digest, "little")


def step_generator(seed: int, step: int) -> torch.Generator:
    """The fix: a CPU generator seeded with a 64-bit hash of the pair ``(seed, step)``.

    ``(s, k)`` and ``(s + 1, k - 1)`` now hash to unrelated seeds, so every (request, step)
    gets its own stream while staying reproducible.
    """
    seed = _check_int("seed", seed, low=0, high=_U64)
    step = _check_int("step", step, low=0, high=_U64)
    return torch.Generator().manual_seed(_stream_seed(seed, step))


def _generator(seed: int | None, step: int, scheme: str) -> torch.Generator:
    if scheme not in _SCHEMES:
        raise ValueError(f"scheme must be one of {_SCHEMES}, got {scheme!r}")
    if seed is None:
        gen = torch.Generator()
        gen.seed()  # fresh nondeterministic seed from the OS
        return gen
    return step_generator(seed, step) if scheme == "independent" else naive_step_generator(seed, step)


def _uniform(gen: torch.Generator) -> float:
    # The one uniform a step consumes. Always drawn on the CPU, so the same (seed, step) picks
    # the same token whichever device produced the logits.
    return float(torch.rand((), generator=gen, dtype=torch.float64))


def draw_uniform(seed: int, step: int, scheme: str = "independent") -> float:
    """The uniform in [0, 1) that ``sample`` uses at ``step`` of request ``seed``.

    Counting distinct values over many (seed, step) pairs counts distinct streams: the naive
    scheme collapses 100 requests x 32 steps onto 131 streams, the independent one keeps 3200.
    """
    if seed is None:
        raise ValueError("draw_uniform needs an integer seed")
    return _uniform(_generator(seed, step, scheme))


# --------------------------------------------------------------------------- sampling


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Token ids with P(id) = probs[..., id], one per row, from uniforms ``u`` in [0, 1).

    Picks the first id whose cumulative mass exceeds ``u * total``. Normalising by the actual
    total (not 1) absorbs softmax rounding, and "exceeds" (right-sided search) means a
    zero-probability token can never be picked: its cumulative mass equals its predecessor's.
    """
    cdf = torch.cumsum(probs.to(torch.float64), dim=-1)
    total = cdf[..., -1:]
    if not bool(torch.all(torch.isfinite(total) & (total > 0))):
        raise ValueError("no token has finite, positive probability (all logits -inf or NaN?)")
    target = (u.to(torch.float64).reshape(total.shape) * total).contiguous()
    ids = torch.searchsorted(cdf.contiguous(), target, right=True)
    return ids.clamp_(max=probs.shape[-1] - 1).squeeze(-1)


def sample(
    logits: torch.Tensor,
    params: SamplingParams,
    *,
    seed: int | None,
    step: int,
    seen_token_ids=None,
    output_token_ids=None,
    generator: torch.Generator | None = None,
    scheme: str = "independent",
    allowed: torch.Tensor | None = None,
) -> int:
    """Pick the next token for one sequence from its ``[V]`` logits.

    ``seen_token_ids`` (prompt + output) feed the repetition penalty, ``output_token_ids``
    (output only) the presence and frequency penalties.
    Greedy params: the argmax of the (penalised) logits, lowest id on ties; seeds
    are ignored. Otherwise: process the logits, softmax, and invert the CDF at ONE uniform
    from stream ``(seed, step)``, so a token depends only on its own request and step. An
    explicit ``generator`` overrides the stream; ``seed=None`` uses a fresh nondeterministic
    one. ``scheme="naive"`` reproduces the shifted-stream bug (see ``naive_step_generator``).
    """
    _check_logits(logits)
    if logits.dim() != 1:
        raise ValueError("sample takes 1-D [V] logits; use sample_batch for [B, V]")
    step = _check_int("step", step, low=0, high=_U64)
    if params.greedy:
        processed = process_logits(logits, params, seen_token_ids, output_token_ids=output_token_ids,
                                   allowed=allowed)
        return int(torch.argmax(processed))
    probs = probabilities(logits, params, seen_token_ids, output_token_ids=output_token_ids, allowed=allowed)
    gen = generator if generator is not None else _generator(seed, step, scheme)
    u = torch.tensor(_uniform(gen), dtype=torch.float64)
    return int(_inverse_cdf(probs.cpu(), u))


def sample_batch(
    logits: torch.Tensor,
    params_list: Sequence[SamplingParams],
    seeds: Sequence[int | None],
    steps: Sequence[int],
    seen_list: Sequence | None = None,
    *,
    output_token_ids: Sequence | None = None,
    scheme: str = "independent",
    allowed: torch.Tensor | None = None,
) -> list[int]:
    """``sample`` for each row of ``[B, V]`` logits; row ``i`` gives exactly ``sample(logits[i], ...)``.

    ``seen_list`` and ``output_token_ids`` hold one id sequence (or ``None``) per row, for the
    repetition penalty and the presence/frequency penalties respectively; ``allowed`` (bool
    ``[B, V]``) is each row's grammar mask.

    When every row shares one ``SamplingParams`` (the common case) the processors run once on
    the whole batch; the uniforms still come from one stream per (seed, step) row.
    """
    _check_logits(logits)
    if logits.dim() != 2:
        raise ValueError("sample_batch takes 2-D [B, V] logits")
    batch = logits.shape[0]
    seen_list = [None] * batch if seen_list is None else list(seen_list)
    outputs = [None] * batch if output_token_ids is None else list(output_token_ids)
    params_list, seeds, steps = list(params_list), list(seeds), list(steps)
    for name, seq in (("params_list", params_list), ("seeds", seeds), ("steps", steps), ("seen_list", seen_list),
                      ("output_token_ids", outputs)):
        if len(seq) != batch:
            raise ValueError(f"{name} has {len(seq)} entries but logits has {batch} rows")
    steps = [_check_int("step", s, low=0, high=_U64) for s in steps]

    # One batched pass is only equal to the row-wise one when no row would skip a penalty
    # (ids None) that another row applies.
    first = params_list[0]
    if (
        all(p == first for p in params_list)
        and (first.repetition_penalty == 1.0 or all(s is not None for s in seen_list))
        and (not _has_output_penalties(first) or all(o is not None for o in outputs))
    ):
        seen = seen_list if first.repetition_penalty != 1.0 else None
        out_ids = outputs if _has_output_penalties(first) else None
        probs = probabilities(logits, first, seen, output_token_ids=out_ids, allowed=allowed)
    else:
        probs = torch.stack([
            probabilities(logits[i], params_list[i], seen_list[i], output_token_ids=outputs[i],
                          allowed=None if allowed is None else allowed[i])
            for i in range(batch)
        ])

    # Greedy rows have one-hot probs; an inverse CDF then returns the argmax whatever the uniform,
    # but skipping the draw keeps greedy rows from touching any generator.
    u = torch.tensor(
        [0.0 if p.greedy else _uniform(_generator(s, k, scheme)) for p, s, k in zip(params_list, seeds, steps)],
        dtype=torch.float64,
    ).unsqueeze(-1)
    return [int(t) for t in _inverse_cdf(probs.cpu(), u).reshape(batch)]
