"""Long-context inference: the five claims behind "a context of N tokens", measured.

A model card's context length is one number. Serving it is five separate claims:

1. it *accepts* the tokens (the engine admits them, the position table covers them);
2. it *behaves* at those positions (the loss does not blow up past some position);
3. it *fits* in memory (a prefill of N tokens, with its KV cache and its transients);
4. it *answers in time* (the time to first token, TTFT, at N tokens);
5. it *uses* what it is given (a fact planted anywhere in the N tokens can be found).

Chapter 23 measures each on SmolLM2-135M and Gemma 3 270M. The pieces here:

* :func:`admission` and :func:`forward_refusal`: what the engine's admission
  (`labkit.engine.limits`) and the model's own position check say about a prompt that
  fills the context and one a token longer.

* :func:`text_ids`: the book's evaluation text as token ids, with the model's BOS where its
  tokenizer wants one (Gemma does, SmolLM2 does not).
* :func:`token_losses` and :func:`loss_by_position`: the loss of every token of a passage
  given everything before it, computed chunk by chunk through the KV cache (so every token
  sees the whole passage before it, exactly as a one-pass forward would), then averaged in
  position buckets.
* :func:`prefill` and :func:`measure_prefill`: a whole-prompt or chunked prefill, and its
  peak resident memory and time. :func:`prefill_point` runs :func:`measure_prefill` in a
  fresh Python process, so that nothing earlier in the notebook sits in the heap; the peak
  is the kernel's own high-water mark (``VmHWM``), reset after the model is loaded by
  writing 5 to ``/proc/self/clear_refs``.
* :func:`kv_cache_bytes` and :func:`score_matrix_bytes`: the closed forms beside the
  measured memory; :func:`attention_scores`: the scores a whole or chunked prefill computes;
  :func:`slope_bounds`: the growth exponents that repeated timings allow.
* :func:`two_se_change` and :func:`loss_trend`: the verdict words on the loss curve, by
  the chapter's two-standard-error rule.
* :func:`needle_prompt`, :func:`needle_parts`, :func:`greedy_answer` and
  :func:`needle_grid`: needle-in-a-haystack retrieval. A sentence with a code is planted at
  a given depth of a passage of the evaluation text, the question comes at the end, and the
  answer counts if the code's digits appear in the first greedy tokens.
"""

from __future__ import annotations

import ctypes
import gc
import json
import math
import os
import re
import resource
import subprocess
import sys
import time
from typing import Sequence

import torch
import torch.nn.functional as F

from labkit.experiments.prefill_decode import eval_prompt_ids


# -- the text ----------------------------------------------------------------------------

def text_ids(tokenizer, n_tokens: int) -> list[int]:
    """`n_tokens` ids of the evaluation text, starting with BOS where the tokenizer adds one."""
    bos = tokenizer.bos_token_id if tokenizer.add_bos_token else None
    if bos is None:
        return eval_prompt_ids(tokenizer, n_tokens)
    return [bos, *eval_prompt_ids(tokenizer, n_tokens - 1)]


# -- 1. accepts the tokens: admission ------------------------------------------------------

def admission(engine, fits: Sequence[int], over: Sequence[int], params) -> dict:
    """Ask `engine.check_request` about two prompts: `fits` (expected to be admitted) and
    `over` (expected to be refused). No model work is done. Returns their lengths, whether
    `fits` was admitted, and the refusal's code and parameter for `over` (None if admitted)."""
    from labkit.engine.limits import Refused

    def ask(ids):
        try:
            engine.check_request(list(ids), params)
            return None
        except Refused as refused:
            return refused

    ok, refused = ask(fits), ask(over)
    return {"fits": len(fits), "admitted": ok is None, "over": len(over),
            "code": None if refused is None else refused.code,
            "param": None if refused is None else refused.param}


def forward_refusal(model, positions: int) -> str | None:
    """The error a forward pass over `positions` tokens raises (None if it runs). The
    position check comes before the embedding, so a refusal costs no model work."""
    try:
        model(torch.zeros(1, positions, dtype=torch.long), last_only=True)
    except ValueError as error:
        return str(error)
    return None


# -- 2. behaves at those positions: loss by position --------------------------------------

def token_losses(model, ids: Sequence[int], chunk: int = 512) -> torch.Tensor:
    """Loss in nats of each token ids[1:] given all the tokens before it ([len(ids) - 1]).

    The passage goes through the model `chunk` tokens at a time into one KV cache (never
    a sliding window): the logits of chunk c's positions see every earlier position, so the
    result equals one forward pass over the whole passage up to rounding, while only
    `chunk` x vocab logits exist at once."""
    ids = list(ids)
    cache = model.new_cache(1, len(ids))
    out = []
    for start in range(0, len(ids) - 1, chunk):
        end = min(start + chunk, len(ids))
        logits = model(torch.tensor([ids[start:end]]), cache=cache)[0]
        targets = torch.tensor(ids[start + 1:end + 1])
        out.append(F.cross_entropy(logits[:len(targets)].float(), targets, reduction="none"))
    return torch.cat(out)


def loss_by_position(losses: torch.Tensor, edges: Sequence[int]) -> list[dict]:
    """Mean loss (bits/token) of the tokens whose position p (1 = the second token, the first
    with a loss) lies in [edges[i], edges[i+1]), with the standard error of that mean."""
    bits = losses.double() / math.log(2)
    rows = []
    for lo, hi in zip(edges, edges[1:]):
        part = bits[max(lo - 1, 0):hi - 1]
        if len(part) == 0:
            continue
        se = float(part.std() / math.sqrt(len(part))) if len(part) > 1 else float("nan")
        rows.append({"start": lo, "end": hi, "tokens": len(part),
                     "bits_per_token": float(part.mean()), "stderr": se})
    return rows


def doubling_edges(first: int, last: int) -> list[int]:
    """0, first, 2 first, 4 first, ... up to and including `last` (the final edge is `last`)."""
    edges, e = [0], first
    while e < last:
        edges.append(e)
        e *= 2
    return edges + [last]


# -- 3 and 4. fits in memory, answers in time: prefill -----------------------------------

def prefill(model, ids: Sequence[int], chunk: int | None = None) -> torch.Tensor:
    """Prefill `ids` into a fresh cache, whole (`chunk=None`) or `chunk` tokens at a time;
    the logits of the last position ([vocab]): what the first token is chosen from."""
    ids = list(ids)
    cache = model.new_cache(1, len(ids))
    step = chunk or len(ids)
    for start in range(0, len(ids), step):
        logits = model(torch.tensor([ids[start:start + step]]), cache=cache, last_only=True)
    return logits[0, -1]


def _hwm_bytes() -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _reset_peak() -> bool:
    """Trim the heap and reset the kernel's peak-RSS mark to the current RSS (Linux >= 4.0)."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def measure_prefill(model, ids: Sequence[int], chunk: int | None = None, repeats: int = 1) -> dict:
    """Peak resident memory above the level before the first prefill (bytes, the kernel's
    high-water mark) and the seconds of each of `repeats` prefills of `ids`. A short prefill
    runs first, so that neither figure includes the kernels' one-time start-up."""
    prefill(model, ids[:16], None)
    reset = _reset_peak()
    base = _rss_bytes()
    base_maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    seconds = []
    for i in range(repeats):
        t0 = time.perf_counter()
        prefill(model, ids, chunk)
        seconds.append(time.perf_counter() - t0)
        if i == 0:
            peak = _hwm_bytes() if reset else None
            peak = peak if peak is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
            peak_bytes = peak - (base if reset else base_maxrss)
    return {"tokens": len(ids), "chunk": chunk, "peak_bytes": peak_bytes, "seconds": seconds,
            "peak_source": "VmHWM" if reset else "ru_maxrss", "threads": torch.get_num_threads()}


def prefill_points(name: str, points: Sequence[tuple[int, int | None, int]],
                   threads: int | None = None, timeout: float = 1800) -> list[dict]:
    """`measure_prefill` of each (length, chunk, repeats) in `points`, on the first `length`
    tokens of the evaluation text with registry model `name`, in one fresh Python process
    (the model loaded there first; the peak mark is reset before each point)."""
    plan = [f"{length}:{chunk or 0}:{repeats}" for length, chunk, repeats in points]
    args = [sys.executable, "-m", __name__, name, str(threads or torch.get_num_threads()), *plan]
    done = subprocess.run(args, capture_output=True, text=True, timeout=timeout, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"prefill_points {name} {plan} failed: {done.stderr[-2000:]}")
    return [json.loads(line) for line in done.stdout.strip().splitlines()[-len(plan):]]


def prefill_point(name: str, length: int, chunk: int | None = None, repeats: int = 1,
                  threads: int | None = None, timeout: float = 1800) -> dict:
    """`measure_prefill` of `length` tokens in a process of its own (see `prefill_points`)."""
    return prefill_points(name, [(length, chunk, repeats)], threads, timeout)[0]


def kv_cache_bytes(config, length: int, dtype_bytes: int = 4) -> int:
    """Bytes of keys and values for `length` positions: layers x 2 x KV heads x head dim x
    bytes per position; a layer with a sliding window (`config.layer_windows`, as in Gemma 3
    with a rolling cache) keeps at most `window` positions."""
    windows = getattr(config, "layer_windows", None) or (None,) * config.num_layers
    per_position = 2 * config.num_kv_heads * config.head_dim * dtype_bytes
    return sum(per_position * (length if w is None else min(w, length)) for w in windows)


def score_matrix_bytes(config, length: int, dtype_bytes: int = 4) -> int:
    """Bytes of one layer's attention scores for a whole prompt if materialised: query
    heads x length x length (what naive attention allocates; SDPA may not)."""
    return config.num_heads * length * length * dtype_bytes


def attention_scores(config, length: int, chunk: int | None = None) -> int:
    """Query-key scores labkit's attention computes in a prefill of `length` tokens, whole
    (`chunk=None`) or `chunk` tokens per pass, summed over layers and query heads.

    `llama.grouped_attention` and `window_cache.windowed_attention` take one of two SDPA
    paths. A pass whose queries start at its first key, in a layer whose window hides none
    of its keys, passes `is_causal`: the kernel scores only the visible triangle,
    T (T + 1) / 2 (it skips the tiles above the diagonal; the tiles on the diagonal add up
    to a tile's width per query row, not counted here). Every other pass hands SDPA a
    [T, S] mask, and the kernel scores the whole rectangle T x S, masked keys included: a
    chunk after cached positions, and a whole prompt longer than a layer's window. S is
    every position up to the chunk's last in a full layer; in a windowed layer with the
    rolling cache (Gemma 3's default, `config.layer_windows`), the window - 1 positions
    before the chunk and the chunk itself (`RollingKVCache.attend`)."""
    windows = getattr(config, "layer_windows", None) or (None,) * config.num_layers
    step = chunk or length
    total = 0
    for start in range(0, length, step):
        steps = min(step, length - start)
        for window in windows:
            before = start if window is None else min(start, window - 1)
            causal = before == 0 and (window is None or steps <= window)
            total += steps * (steps + 1) // 2 if causal else steps * (before + steps)
    return config.num_heads * total


def two_se_change(reference: dict, later: dict) -> str:
    """"rises", "falls" or "level": the mean of bucket `later` against bucket `reference`
    (rows of :func:`loss_by_position`), counted as a change only when the difference lies
    outside two standard errors of the difference, sqrt(se_a^2 + se_b^2)."""
    diff = later["bits_per_token"] - reference["bits_per_token"]
    noise = 2 * math.hypot(later["stderr"], reference["stderr"])
    return "level" if abs(diff) <= noise else "rises" if diff > 0 else "falls"


def loss_trend(rows: Sequence[dict], reference_from: int = 512) -> dict:
    """The end of a loss-by-position curve by the two-standard-error rule of
    :func:`two_se_change`: the last bucket against a reference (the first bucket that
    starts at `reference_from` or later, else the second bucket) and against the bucket
    just before it. `word` is "rises" if the last bucket rises against either, "falls" if
    it falls against the reference and does not rise against the one before, else
    "level". Returns the three buckets, the two changes and the word."""
    if len(rows) < 3:
        raise ValueError("a trend needs at least three buckets")
    reference = next((r for r in rows[:-1] if r["start"] >= reference_from), rows[1])
    last, previous = rows[-1], rows[-2]
    vs_reference, vs_previous = two_se_change(reference, last), two_se_change(previous, last)
    word = ("rises" if "rises" in (vs_reference, vs_previous)
            else "falls" if vs_reference == "falls" else "level")
    return {"reference": reference, "previous": previous, "last": last,
            "vs_reference": vs_reference, "vs_previous": vs_previous, "word": word}


def slope_bounds(lengths: Sequence[float], fastest: Sequence[float],
                 slowest: Sequence[float]) -> list[dict]:
    """The log-log slope between neighbouring lengths that the repeats allow: from
    (fastest at the longer) over (slowest at the shorter) up to (slowest at the longer)
    over (fastest at the shorter). One run per point gives a single slope."""
    out = []
    for i in range(len(lengths) - 1):
        step = math.log(lengths[i + 1] / lengths[i])
        out.append({"from": lengths[i], "to": lengths[i + 1],
                    "low": math.log(fastest[i + 1] / slowest[i]) / step,
                    "high": math.log(slowest[i + 1] / fastest[i]) / step})
    return out


# -- 5. uses what it is given: needle in a haystack ----------------------------------------

def needle_prompt(prefix: Sequence[int], haystack: Sequence[int], needle: Sequence[int],
                  suffix: Sequence[int], length: int, depth: float) -> tuple[list[int], int]:
    """A prompt of exactly `length` tokens: prefix, the first tokens of `haystack` with
    `needle` planted after a fraction `depth` (0 to 1) of them, then suffix. Returns the ids
    and the index where the needle starts."""
    room = length - len(prefix) - len(needle) - len(suffix)
    if room < 0 or room > len(haystack):
        raise ValueError(f"cannot fit {length} tokens from a {len(haystack)}-token haystack")
    if not 0 <= depth <= 1:
        raise ValueError("depth must lie in [0, 1]")
    at = round(depth * room)
    hay = list(haystack[:room])
    ids = [*prefix, *hay[:at], *needle, *hay[at:], *suffix]
    return ids, len(prefix) + at


QUESTION = "What is the secret code mentioned in the text above?"


def needle_parts(tokenizer, chat: bool) -> tuple[list[int], list[int]]:
    """Prefix and suffix ids around the haystack. `chat`: the tokenizer's chat template, the
    haystack and the question in one user message, the assistant's turn opened; else (a
    base model) BOS, the haystack, the question and the completion cue "The secret code is"."""
    if chat:
        marker = "\u0000HAYSTACK\u0000"
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": f"{marker}\n\n{QUESTION} Answer with the code only."}])
        before, after = text.split(marker)
        return tokenizer.encode(before), tokenizer.encode(after)
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    return bos, tokenizer.encode(f"\n\nQuestion: {QUESTION}\nAnswer: The secret code is")


def needle_ids(tokenizer, code: str) -> list[int]:
    return tokenizer.encode(f" The secret code is {code}. ")


@torch.inference_mode()
def greedy_answer(model, ids: Sequence[int], new_tokens: int, chunk: int | None = 512) -> list[int]:
    """`new_tokens` greedy tokens after `ids` (prefilled in chunks), through one KV cache."""
    ids = list(ids)
    cache = model.new_cache(1, len(ids) + new_tokens)
    step = chunk or len(ids)
    for start in range(0, len(ids), step):
        logits = model(torch.tensor([ids[start:start + step]]), cache=cache, last_only=True)
    out = []
    for i in range(new_tokens):
        token = int(logits[0, -1].argmax())
        out.append(token)
        if i + 1 < new_tokens:
            logits = model(torch.tensor([[token]]), cache=cache)
    return out


def found(code: str, text: str) -> bool:
    """Whether `code` appears as a whole number in `text`."""
    return code in re.findall(r"\d+", text)


def needle_grid(model, haystack: Sequence[int], lengths: Sequence[int], depths: Sequence[float],
                codes: Sequence[str], chat: bool, new_tokens: int = 8,
                chunk: int | None = 512) -> list[dict]:
    """Plant each code at each depth of a haystack cut to each length; ask; one row per try."""
    tok = model.tokenizer
    prefix, suffix = needle_parts(tok, chat)
    rows = []
    for length in lengths:
        for depth in depths:
            for code in codes:
                ids, at = needle_prompt(prefix, haystack, needle_ids(tok, code), suffix,
                                        length, depth)
                answer = tok.decode(greedy_answer(model, ids, new_tokens, chunk))
                rows.append({"length": length, "depth": depth, "code": code,
                             "needle_at": at, "answer": answer, "found": found(code, answer)})
    return rows


def _main(argv: list[str]) -> None:
    name, threads, *plan = argv
    torch.set_num_threads(int(threads))
    import labkit

    model = labkit.load_model(name)
    for point in plan:
        length, chunk, repeats = (int(x) for x in point.split(":"))
        ids = text_ids(model.tokenizer, length)
        print(json.dumps(measure_prefill(model, ids, chunk or None, repeats)), flush=True)


if __name__ == "__main__":
    _main(sys.argv[1:])
