"""`labkit bench lowbit`: the engine on the model file's own blocks against float32, and
against llama.cpp on the same file with the same threads.

    decode   single-stream greedy decode (16-token prompt, 128 tokens) of every weights mode
             (float32, bfloat16, the file's blocks with float32 or 8-bit activations)
             llama.cpp through llama-cpp-python, and llama.cpp's own llama-bench on the
             same file and on an F32 copy of it, taking turns round after round
             (the first round warms up and is dropped)
    batch    the batch workload (32 requests x 64 tokens, all at once) in every mode, the
             modes taking turns for three rounds; every request's tokens against its run
             alone in the fastest low-precision mode
    quality  perplexity on the evaluation text, greedy tokens on the test prompts against
             float32's, and the largest logit difference from float32 along those prompts
             (one token at a time on the paged pool, the path decode takes) for every mode,
             float32 weights over a bfloat16 KV pool, and llama.cpp

    batch also runs vLLM's CPU build (its own venv, `make peers`) on the batch workload in
             float32 and bfloat16, against the best labkit mode.

Where llama.cpp or vLLM is not installed its figures are NOT_RUN, with the reason; so are all
the figures where labkit's C kernels do not load (every low-precision mode runs on them).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import replace

import torch

from labkit.bench import llama_tools
from labkit.bench.peers import LlamaCpp, VLLMCpu, why_not_llama_cpp, why_not_vllm
from labkit.bench.serving import agreement_with_solo, greedy_params, run_engine
from labkit.engine.backends import WEIGHTS
from labkit.engine.llm_engine import EngineConfig, LLMEngine
from labkit.engine.paged_cache import KVPool, PagedBatch
from labkit.eval import eval_text, score_tokens
from labkit.kernels import native
from labkit.models import registry

LOW_BITS = tuple(w for w in WEIGHTS if w != "f32")
# Decode speed-up over float32 each mode is held to: the file's blocks read 5.6x fewer bytes
# a token than float32, bfloat16 half as many.
DECODE_TARGET = {"bf16": ">= 1.5", "gguf": ">= 2", "gguf-int8": ">= 2"}
# The largest logit difference between a request's steps in a batch and alone, in each mode:
# other row counts take other kernels (oneDNN's blocking, the C kernels' row tiles) and sum in
# other orders. Measured on the chosen tokens of the quick batch workload on an AVX-512/AMX
# Xeon: f32 2.2e-5, bf16 0.12 (one of six requests parted from its solo run where that run's
# top two were 0.038 apart), gguf 2.0e-5; gguf-int8 is held to gguf's bound. Twice the bound
# is the widest top-two gap at which a request may part from its solo run.
BATCH_LOGIT_ERROR = {"f32": 1e-3, "bf16": 0.25, "gguf": 1e-3, "gguf-int8": 1e-3}
LLAMA_BENCH, LLAMA_BENCH_F32 = "llama-bench", "llama-bench, F32 file"  # llama.cpp's own tool
KV_BF16 = "f32, bf16 KV"  # float32 weights over a bfloat16 KV pool, in the quality figures
TEST_PROMPTS = ("The capital of France is", "def fibonacci(n):\n    if n < 2:\n        return n\n",
                "An inference engine takes a trained model and a request, and it must",
                "List three colours:", "Once upon a time, in a small village by the sea,")


def why_not_low_bits() -> str | None:
    """Why the low-precision modes cannot run on this machine, or None where they can: each
    reads its weights through labkit's C kernels, and a mode named explicitly never falls
    back to float32, so without them there is nothing to compare."""
    if native.load() is not None:
        return None
    return f"the low-precision modes run on labkit's C kernels, which do not load here: {native.why_unavailable()}"


def _not_run(figure, reason: str, rows: list[tuple[str, str, str]]) -> list:
    return [figure("lowbit", what, float("nan"), float("nan"), unit, float("nan"), target, not_run=reason)
            for what, unit, target in rows]


def decode(bench, figure) -> list:
    if (why_not_modes := why_not_low_bits()) is not None:
        return _not_run(figure, why_not_modes, [(f"single-stream decode, {w} vs f32", "tokens/s", DECODE_TARGET[w])
                                                for w in LOW_BITS])
    tokens, rounds = bench.size(128, 8), bench.size(5, 1)
    prompt = bench.text_ids[:16]
    threads = torch.get_num_threads()
    engines = {w: LLMEngine(bench.model, EngineConfig(kv_cache_tokens=1024, weights=w)) for w in WEIGHTS}
    why_not = why_not_llama_cpp()
    peer = None if why_not else LlamaCpp(bench.model_name, threads)
    why_not_tools = llama_tools.why_not_llama_tools()
    files = {} if why_not_tools else {LLAMA_BENCH: registry.fetch(bench.model_name),
                                      LLAMA_BENCH_F32: llama_tools.f32_gguf(bench.model_name)}
    seconds = {name: [] for name in [*engines, *([] if peer is None else ["llama.cpp"])]}
    tool_rates, tool_records = {name: [] for name in files}, {}
    for _ in range(rounds + 1):  # every system once a round, in turn; round 0 is dropped
        for name, engine in engines.items():
            start = time.perf_counter()
            out = engine.generate([prompt], greedy_params(tokens))[0]
            seconds[name].append(time.perf_counter() - start)
            assert len(out.token_ids) == tokens
        if peer is not None:
            start = time.perf_counter()
            assert len(peer.generate(prompt, tokens)) == tokens
            seconds["llama.cpp"].append(time.perf_counter() - start)
        for name, path in files.items():  # its own timing of generation alone (no prompt)
            tool_records[name] = llama_tools.llama_bench(path, threads, tokens)
            tool_rates[name].append(tool_records[name]["avg_ts"])
    rates = {name: [tokens / s for s in runs[1:]] for name, runs in seconds.items()}
    rates.update({name: r[1:] for name, r in tool_rates.items()})
    median = {name: statistics.median(r) for name, r in rates.items()}
    best = max(LOW_BITS, key=median.get)
    shared = {"prompt_tokens": len(prompt), "output_tokens": tokens, "rounds": rounds, "tokens_per_s": rates,
              "seconds": seconds, "peer": None if peer is None else peer.describe(),
              "llama_bench": None if not files else llama_tools.describe(tool_records[LLAMA_BENCH])}
    out = [figure("lowbit", f"single-stream decode, {w} vs f32", median[w], median["f32"], "tokens/s",
                  median[w] / median["f32"], DECODE_TARGET[w], **shared) for w in LOW_BITS]
    for what, name, reason in ((f"single-stream decode, labkit {best} vs llama.cpp on the same file and threads",
                                "llama.cpp", why_not),
                               (f"single-stream decode, labkit {best} vs llama.cpp's llama-bench "
                                f"(tg{tokens}, no prompt) on the same file and threads", LLAMA_BENCH, why_not_tools)):
        if reason is not None:
            out.append(figure("lowbit", what, median[best], float("nan"), "tokens/s", float("nan"), ">= 1.25",
                              not_run=reason, **shared))
        else:
            out.append(figure("lowbit", what, median[best], median[name], "tokens/s", median[best] / median[name],
                              ">= 1.25", **shared))
    return out


def batch(bench, figure) -> list:
    if (why_not_modes := why_not_low_bits()) is not None:
        return _not_run(figure, why_not_modes, [("continuous batching, the best low-precision mode vs f32",
                                                 "output tokens/s", ">= 1.5")])
    work, rounds = bench.batch_workload(), bench.size(3, 1)
    runs = {w: [] for w in WEIGHTS}
    for round_ in range(rounds):  # the modes take turns, so a drift of the machine hits all
        for w in WEIGHTS:
            runs[w].append(run_engine(bench.model, work, _config(bench, w), f"continuous batching, {w}"))
            bench.runs[f"lowbit_batch_{w}_{round_}"] = runs[w][-1]
    rates = {w: [r.tokens_per_s for r in rs] for w, rs in runs.items()}
    median = {w: statistics.median(r) for w, r in rates.items()}
    best = max(LOW_BITS, key=median.get)
    solo = bench.runs[f"lowbit_solo_{best}"] = run_engine(bench.model, work, _config(bench, best, max_num_seqs=1),
                                                          f"one request at a time, {best}")
    agreement = agreement_with_solo(bench.model, work, runs[best][0], solo, _config(bench, best, max_num_seqs=1),
                                    BATCH_LOGIT_ERROR[best])
    same = agreement.exact + agreement.excused
    return [figure("lowbit", f"{len(work)} requests, continuous batching, {best} vs f32", median[best],
                   median["f32"], "output tokens/s", median[best] / median["f32"], ">= 1.5",
                   workload=work.describe(), rounds=rounds, tokens_per_s=rates),
            figure("lowbit", f"requests whose tokens in {best} agree with their solo run in {best} "
                   "(near-ties excused)", same, len(work), "requests", same / len(work), ">= 1",
                   equal=agreement.exact, excused=agreement.excused, tolerance=agreement.sequences[0].tolerance,
                   agreement=agreement.describe()),
            _against_vllm(bench, figure, work, rounds, best, median[best], rates,
                          [r.token_ids for r in runs["f32"][0].records])]


VLLM_DTYPES = ("float32", "bfloat16")


def _against_vllm(bench, figure, work, rounds: int, best: str, ours: float, rates: dict, f32_tokens: list) -> object:
    """vLLM's CPU build on the same workload, in process as labkit's runs are (one
    `LLM.generate` of every request at once a round), in each dtype, its default
    (compiled) graph mode, the scheduler limits labkit's batch runs use; after labkit's
    rounds, since its start-up takes minutes."""
    what = f"{len(work)} requests in process, labkit {best} vs vLLM-CPU's best dtype"
    why_not = why_not_vllm()
    if why_not is not None:
        return figure("lowbit", what, ours, float("nan"), "output tokens/s", float("nan"), ">= 1.25",
                      not_run=why_not)
    peer = VLLMCpu(bench.model_name, torch.get_num_threads(), kv_cache_gib=2)
    limits = bench.continuous_config().scheduler
    results = {d: peer.run_batch(work.prompts, work.max_tokens, d, rounds, enforce_eager=False,
                                 max_num_seqs=limits.max_num_seqs, max_num_batched_tokens=limits.max_batched_tokens)
               for d in VLLM_DTYPES}
    vllm_rates = {d: [r["output_tokens_per_s"] for r in res["rounds"]] for d, res in results.items() if res["ok"]}
    f32_run = results["float32"]
    details = {"workload": work.describe(), "rounds": rounds, "labkit_tokens_per_s": rates,
               "vllm_tokens_per_s": vllm_rates, "peer": peer.describe(),
               "vllm_f32_requests_equal_to_labkit_f32": (sum(a == b for a, b in zip(f32_run["token_ids"], f32_tokens))
                                                          if f32_run["ok"] else None)}
    if not vllm_rates:
        return figure("lowbit", what, ours, float("nan"), "output tokens/s", float("nan"), ">= 1.25",
                      not_run="vLLM failed in every dtype: " + "; ".join(r["error"] for r in results.values()),
                      **details)
    theirs = {d: statistics.median(r) for d, r in vllm_rates.items()}
    vbest = max(theirs, key=theirs.get)
    return figure("lowbit", f"{len(work)} requests in process, labkit {best} vs vLLM-CPU {vbest}", ours,
                  theirs[vbest], "output tokens/s", ours / theirs[vbest], ">= 1.25", **details)


def _config(bench, weights: str, **scheduling) -> EngineConfig:
    return replace(bench.continuous_config(**scheduling), weights=weights)


def quality(bench, figure) -> list:
    if (why_not_modes := why_not_low_bits()) is not None:
        return _not_run(figure, why_not_modes, [("largest logit difference from f32 along the test prompts, "
                                                 "gguf (float32 x)", "logit", "<= 0.001")])
    model = bench.model
    prompts = [model.tokenizer.encode(p) for p in TEST_PROMPTS]
    tokens = bench.size(32, 8)
    text_ids = model.tokenizer.encode(eval_text())[:bench.size(None, 1024)]
    why_not = why_not_llama_cpp()
    peer = None if why_not else LlamaCpp(bench.model_name, torch.get_num_threads())
    served = {w: LLMEngine(model, EngineConfig(kv_cache_tokens=2048, weights=w)) for w in WEIGHTS}
    kv_bf16 = LLMEngine(model, EngineConfig(kv_cache_tokens=2048, kv_dtype="bf16"))
    greedy = {w: [o.samples[0].token_ids for o in e.generate(prompts, greedy_params(tokens))]
              for w, e in [*served.items(), (KV_BF16, kv_bf16)]}
    if peer is not None:
        greedy["llama.cpp"] = [peer.generate(p, tokens) for p in prompts]
    reference = [model(torch.tensor([p + g]))[0] for p, g in zip(prompts, greedy["f32"])]
    logit_gap = {w: max(_paged_logits(e.model, model.config, p + g, e.pool.dtype).sub(r).abs().max().item()
                        for p, g, r in zip(prompts, greedy["f32"], reference))
                 for w, e in [*served.items(), (KV_BF16, kv_bf16)]}
    if peer is not None:
        logit_gap["llama.cpp"] = max(peer.logits(p + g).sub(r).abs().max().item()
                                     for p, g, r in zip(prompts, greedy["f32"], reference))
    perplexity = {w: score_tokens(e.model, text_ids).perplexity for w, e in served.items()}
    if peer is not None:
        perplexity["llama.cpp"] = score_tokens(lambda chunk: peer.logits(chunk[0].tolist())[None],
                                               text_ids).perplexity
    agreement = {name: sum(a == b for out, ref in zip(outs, greedy["f32"]) for a, b in zip(out, ref))
                 / (len(prompts) * tokens) for name, outs in greedy.items()}
    shared = {"perplexity": perplexity, "perplexity_tokens": len(text_ids), "greedy_agreement_with_f32": agreement,
              "max_logit_difference_from_f32": logit_gap, "prompts": list(TEST_PROMPTS), "greedy_tokens": tokens,
              "peer": None if peer is None else peer.describe()}
    return [figure("lowbit", "largest logit difference from f32 along the test prompts, gguf (float32 x)",
                   logit_gap["gguf"], 0.0, "logit", logit_gap["gguf"], "<= 0.001", **shared),
            figure("lowbit", "greedy tokens on the test prompts equal to f32's, gguf", agreement["gguf"], 1.0,
                   "fraction", agreement["gguf"], ">= 1", **shared),
            figure("lowbit", "perplexity on the evaluation text, bf16 vs f32", perplexity["bf16"], perplexity["f32"],
                   "perplexity", perplexity["bf16"] / perplexity["f32"], "<= 1.01", **shared)]


def _paged_logits(served_model, config, ids: list[int], kv_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Logits for every position of `ids`, fed one token a step through a native paged pool
    of `kv_dtype` (the path a decode step takes in the engine)."""
    blocks = -(-len(ids) // 16)
    pool = KVPool(config, blocks, 16, kv_dtype)
    table = [list(range(blocks))]
    step = [served_model(torch.tensor([[t]]), cache=PagedBatch(pool, table, [i], [1]))[0, -1]
            for i, t in enumerate(ids)]
    return torch.stack(step)
