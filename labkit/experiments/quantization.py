"""Chapter 12's measurements of quantized models: perplexity per window with paired
differences and their standard errors, greedy agreement with the float32 model (teacher
forced, and where free-running decoding first parts from it), and decode speed timed in
turns, of the engine's own weights modes and of PyTorch's paths, request by
request. The quantized models themselves are built by :mod:`labkit.models.quantized`."""

from __future__ import annotations

import math

import torch

from labkit.engine.loop import greedy_decode

# The engine's weights modes (EngineConfig.weights) as the speed comparison names them; the
# baseline is the engine's float32 path
ENGINE_MODES = {"f32": "engine float32", "bf16": "engine bf16",
                "gguf": "engine Q4_1 blocks, float32 act.",
                "gguf-int8": "engine Q4_1 blocks, int8 act."}
ENGINE_FLOAT32 = ENGINE_MODES["f32"]


def window_scores(model, ids: list[int], window: int = 512) -> list[tuple[float, int]]:
    """(summed NLL in nats, tokens scored) for each window of `window` tokens.

    Consecutive windows overlap by one token, so every token after the first is scored
    exactly once; the sums equal `labkit.eval.score_tokens(model, ids, window,
    stride=window - 1)`, and the per-window values give the noise of a paired comparison.
    """
    from labkit.eval import score_tokens

    step = window - 1
    return [((s := score_tokens(model, ids[start:start + window], window=window)).nll_nats,
             s.tokens_scored) for start in range(0, len(ids) - 1, step)]


def greedy_tokens(model, prompt_ids: list[int], new_tokens: int) -> list[int]:
    """`new_tokens` greedy tokens (EOS not treated specially), with a KV cache."""
    return greedy_decode(model, prompt_ids, new_tokens).token_ids


@torch.inference_mode()
def teacher_forced_matches(model, prompt_ids: list[int], reference: list[int]) -> list[bool]:
    """For each position of `reference` (a greedy continuation of `prompt_ids` by another
    model): does `model`'s argmax, reading the same reference tokens, pick the same token?
    One forward pass. Free-running greedy decoding by `model` reproduces the reference up to
    the first False (there the two continuations part)."""
    ids = torch.tensor([prompt_ids + reference[:-1]])
    choices = model(ids)[0, len(prompt_ids) - 1:].argmax(-1)
    return (choices == torch.tensor(reference)).tolist()


def paired_difference(scores: list[tuple[float, int]], baseline: list[tuple[float, int]]):
    """(difference in nats per token, its standard error) between two `window_scores` of
    the same text: the windows are the units, so the noise shared by both is cancelled."""
    d = torch.tensor([a - b for (a, _), (b, _) in zip(scores, baseline)], dtype=torch.float64)
    n = torch.tensor([c for _, c in baseline], dtype=torch.float64)
    mean = d.sum() / n.sum()
    windows = len(d)
    if windows < 2:
        return mean.item(), float("nan")
    var = ((d - mean * n) ** 2).sum() / (windows * (windows - 1))
    return mean.item(), (var.sqrt() * windows / n.sum()).item()


def score_table(scores: dict, baseline: str) -> list[dict]:
    """One row per model of `scores` (name -> `window_scores` on the same text): bits per
    token, perplexity, and the paired difference from `baseline` with its standard error."""
    rows = []
    for name, windows in scores.items():
        nll, tokens = sum(x for x, _ in windows), sum(n for _, n in windows)
        diff, se = paired_difference(windows, scores[baseline])
        rows.append({"model": name, "tokens": tokens, "bits_per_token": nll / tokens / math.log(2),
                     "perplexity": math.exp(nll / tokens),
                     "delta_bits": diff / math.log(2), "delta_bits_se": se / math.log(2)})
    return rows


def greedy_agreement(model, prompts: list[list[int]], references: list[list[int]]) -> dict:
    """Teacher-forced agreement with reference greedy continuations, over all prompts, and
    where each free-running continuation would first part from its reference."""
    matches = [teacher_forced_matches(model, p, r) for p, r in zip(prompts, references)]
    flat = [m for row in matches for m in row]
    return {"agreement": sum(flat) / len(flat),
            "first_divergence": [row.index(False) if False in row else len(row) for row in matches]}


def request_runner(model, prompt_ids: list[int], new_tokens: int):
    """A function that runs one whole greedy request on `model` each time it is called: the
    prompt prefilled into a fresh cache, then `new_tokens` tokens (the same every call). The
    PyTorch-path systems of the speed comparison are timed with it, as the engine's modes
    are timed with :func:`engine_runner`: both count a request from its prompt to its last
    token, so their ratios compare like with like."""
    def run() -> list[int]:
        return greedy_tokens(model, prompt_ids, new_tokens)

    return run


def engine_runner(model, weights: str, prompt_ids: list[int], new_tokens: int):
    """A function that runs one greedy request of `new_tokens` tokens after `prompt_ids`
    through the serving engine in weights mode `weights` (`EngineConfig.weights`: "f32",
    "bf16", "gguf", "gguf-int8"), as `LLM` runs it: the mode's matrices, the paged KV pool and
    labkit's C attention, one C call a layer where the mode has one. Prefix caching is off, so
    every call prefills the whole prompt again and runs the same steps. A mode that cannot run
    here raises ValueError (`prepare_weights` never substitutes float32 for a named mode)."""
    from labkit.engine.llm_engine import EngineConfig, LLMEngine
    from labkit.sampling import SamplingParams

    slots = len(prompt_ids) + new_tokens + 16  # one spare block
    config = EngineConfig(kv_cache_tokens=16 * -(-slots // 16), prefix_caching=False,
                          weights=weights)
    engine = LLMEngine(model, config)
    if engine.weights != weights:
        raise ValueError(f"asked for weights {weights!r}, the engine runs {engine.weights!r}")
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)

    def run() -> list[int]:
        return list(engine.generate([prompt_ids], params)[0].samples[0].token_ids)

    run.engine = engine  # the engine behind the runner: its model is the mode's model
    return run


def per_byte(speed, bytes_ratio: float) -> str:
    """Did a system consume its weight bytes faster or slower than its baseline? `speed` is
    a `labkit.util.compare.Comparison` of the system against the baseline (ratio above 1:
    the system faster), `bytes_ratio` the baseline's weight bytes a token over the system's.
    A system that read its bytes exactly as fast would be `bytes_ratio` times as fast:
    "slower per byte" when the whole interval lies below that, "faster per byte" when it
    lies above, else "within the noise"."""
    if bytes_ratio <= 0:
        raise ValueError(f"a byte ratio must be positive, got {bytes_ratio}")
    if speed.high < bytes_ratio:
        return "slower per byte"
    if speed.low > bytes_ratio:
        return "faster per byte"
    return "within the noise"


def gains_differ(gain_a, gain_b) -> bool:
    """Whether two thread gains (Comparisons of two threads against one, each for its own
    system) differ beyond the noise: only when their intervals do not overlap."""
    return gain_a.low > gain_b.high or gain_b.low > gain_a.high


def changed_tokens_order(changed_a: int, changed_b: int, positions: int,
                         alpha: float = 0.05) -> str:
    """Whether format a changed fewer or more of the reference's greedy tokens than format
    b, out of `positions` each: "fewer" or "more" only when Fisher's exact test (two-sided)
    puts the difference below `alpha`, else "too few to order" (3 against 6 of 96 is not a
    difference)."""
    from scipy.stats import fisher_exact

    if not (0 <= changed_a <= positions and 0 <= changed_b <= positions):
        raise ValueError(f"changed tokens must lie in 0..{positions}")
    table = [[changed_a, positions - changed_a], [changed_b, positions - changed_b]]
    if fisher_exact(table).pvalue >= alpha:
        return "too few to order"
    return "fewer" if changed_a < changed_b else "more"
