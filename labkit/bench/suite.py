"""`labkit bench`: the serving engine's figures, each a ratio against a baseline run in the
same process, with every request's record written beside the summary.

    decode    single-stream greedy tokens/s: our engine vs transformers generate
    batch     32 requests: continuous batching vs transformers static batches of 8 and
              vs our engine one request at a time; every request's tokens vs its solo run
    ttft      median time to first token at half of capacity: continuous vs static batching
    paging    concurrent sequences at an equal KV budget: paged vs contiguous reservation
    prefix    time to first token of a follow-up after a cached prefix vs the same prompt cold
    serve     the batch workload from 32 streaming HTTP clients against `labkit serve` vs the
              same engine in process: output tokens/s, TTFT overhead, tokens identical
    lowbit    the engine on the model file's own blocks vs float32 and vs llama.cpp on the same
              file: decode tokens/s, batch tokens/s, quality (`labkit.bench.lowbit`)
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from labkit.bench.serving import RunResult, agreement_with_solo, greedy_params, run_engine, run_hf_static
from labkit.bench.workloads import Workload, chat_lengths, poisson_arrivals, text_prompts
from labkit.engine.llm_engine import EngineConfig, LLMEngine
from labkit.engine.scheduler import SchedulerConfig

FIGURES = ("decode", "batch", "ttft", "paging", "prefix", "serve", "lowbit")
FRONT_END_STAGES = ("read", "parse", "tokenize", "submit", "to-engine", "to-front-end", "serialize")
# The largest logit difference of a request's steps in a float32 batch from its run alone
# (other row counts, other summation orders): 2.2e-5 on the chosen tokens of the quick batch
# workload (an AVX-512/AMX Xeon); twice the bound is the widest top-two gap at which a request
# may part from its solo run.
BATCH_LOGIT_ERROR = 1e-3
SERVE_STAGGER_S = 0.004  # between the HTTP clients' first requests: the server sees the send order


@dataclass
class Figure:
    name: str
    what: str
    value: float
    baseline: float
    unit: str
    ratio: float
    target: str            # e.g. ">= 2" or "<= 0.2"
    passed: bool | None    # None: NOT_RUN
    details: dict = field(default_factory=dict)
    not_run: str | None = None  # why it could not run here

    def line(self) -> str:
        if self.not_run:
            return f"[NOT_RUN] {self.name:7s} {self.what}: {self.not_run}"
        mark = "ok  " if self.passed else "MISS"
        return (f"[{mark}] {self.name:7s} {self.what}: {self.value:.4g} vs {self.baseline:.4g} {self.unit}"
                f" -> ratio {self.ratio:.2f} (target {self.target})")


def _meets(ratio: float, target: str) -> bool:
    op, bound = target.split()
    return ratio >= float(bound) if op == ">=" else ratio <= float(bound)


def figure(name, what, value, baseline, unit, ratio, target, not_run: str | None = None, **details) -> Figure:
    passed = None if not_run else _meets(ratio, target)
    return Figure(name, what, value, baseline, unit, ratio, target, passed, details, not_run)


@dataclass
class Bench:
    model: object
    text_ids: list[int]              # token ids of the evaluation text, the prompt source
    reference: object | None = None  # transformers model with the same weights
    quick: bool = False              # small sizes: checks the plumbing, not the claims
    runs: dict[str, RunResult] = field(default_factory=dict)
    records: dict[str, dict] = field(default_factory=dict)  # other per-request records, by run
    model_name: str = "smollm2-135m"
    threads: int | None = None

    def size(self, full, quick):
        return quick if self.quick else full

    # -- decode -----------------------------------------------------------------------------
    def decode(self) -> Figure:
        tokens, rounds = self.size(128, 8), self.size(3, 1)
        prompt = self.text_ids[:16]
        engine = LLMEngine(self.model, EngineConfig(kv_cache_tokens=1024))
        ours, theirs = [], []
        for _ in range(rounds + 1):  # the first round warms both up and is dropped
            start = time.perf_counter()
            out = engine.generate([prompt], greedy_params(tokens))[0]
            ours.append(time.perf_counter() - start)
            assert len(out.token_ids) == tokens
            if self.reference is not None:
                start = time.perf_counter()
                with torch.inference_mode():
                    self.reference.generate(torch.tensor([prompt]), max_new_tokens=tokens, min_new_tokens=tokens,
                                            do_sample=False, pad_token_id=0)
                theirs.append(time.perf_counter() - start)
        ours_tps = tokens / statistics.median(ours[1:])
        base_tps = tokens / statistics.median(theirs[1:]) if theirs else float("nan")
        return figure("decode", "single-stream greedy decode, ours vs transformers generate", ours_tps,
                      base_tps, "tokens/s", ours_tps / base_tps, ">= 2", prompt_tokens=len(prompt),
                      output_tokens=tokens, rounds=rounds, ours_s=ours, transformers_s=theirs)

    # -- batch --------------------------------------------------------------------------------
    def batch_workload(self) -> Workload:
        count, out = self.size(32, 6), self.size(64, 8)
        return Workload(text_prompts(self.text_ids, count, 16, self.size(256, 48), seed=1), [out] * count)

    def continuous_config(self, **sched) -> EngineConfig:
        settings = {"max_num_seqs": 64, "max_batched_tokens": 512, **sched}
        return EngineConfig(kv_cache_tokens=16_384, scheduler=SchedulerConfig(**settings))

    def batch(self) -> list[Figure]:
        work = self.batch_workload()
        cont = self.runs["continuous"] = run_engine(self.model, work, self.continuous_config(), "continuous batching")
        serial = self.runs["serial"] = run_engine(self.model, work, self.continuous_config(max_num_seqs=1),
                                                  "our engine, one request at a time")
        agreement = agreement_with_solo(self.model, work, cont, serial, self.continuous_config(max_num_seqs=1),
                                        BATCH_LOGIT_ERROR)
        same = agreement.exact + agreement.excused
        figures = []
        if self.reference is not None:
            hf = self.runs["hf_static"] = run_hf_static(self.reference, work, batch_size=8)
            figures.append(figure("batch", "32 requests, continuous batching vs transformers static batches of 8",
                                  cont.tokens_per_s, hf.tokens_per_s, "output tokens/s",
                                  cont.tokens_per_s / hf.tokens_per_s, ">= 3", workload=work.describe()))
        figures.append(figure("batch", "32 requests, continuous batching vs our engine one request at a time",
                              cont.tokens_per_s, serial.tokens_per_s, "output tokens/s",
                              cont.tokens_per_s / serial.tokens_per_s, ">= 5", workload=work.describe()))
        figures.append(figure("batch", "requests whose tokens agree with their solo run (near-ties excused)", same,
                              len(work), "requests", same / len(work), ">= 1", workload=work.describe(),
                              equal=agreement.exact, excused=agreement.excused,
                              tolerance=agreement.sequences[0].tolerance, agreement=agreement.describe()))
        return figures

    # -- ttft ---------------------------------------------------------------------------------
    def ttft(self) -> Figure:
        if "continuous" not in self.runs:
            self.batch()
        base = self.batch_workload()
        capacity = len(base) / self.runs["continuous"].wall_s  # requests/s with all of them queued
        rate = capacity / 2
        work = Workload(base.prompts, base.max_tokens, poisson_arrivals(len(base), rate, seed=2))
        cont = self.runs["ttft_continuous"] = run_engine(self.model, work, self.continuous_config(),
                                                         "continuous batching, Poisson arrivals")
        static = self.runs["ttft_static"] = run_engine(
            self.model, work, self.continuous_config(batching="static", static_batch_size=8, chunked_prefill=False),
            "static batches of 8, Poisson arrivals")
        c50, s50 = cont.ttft_quantile(0.5), static.ttft_quantile(0.5)
        return figure("ttft", "median time to first token at half of capacity, continuous vs static", c50, s50, "s",
                      c50 / s50, "<= 0.2", capacity_rps=capacity, offered_rps=rate, workload=work.describe(),
                      p99_continuous_s=cont.ttft_quantile(0.99), p99_static_s=static.ttft_quantile(0.99))

    # -- paging -------------------------------------------------------------------------------
    def paging(self) -> Figure:
        count, budget, context = self.size(48, 24), self.size(8192, 512), self.size(1024, 128)
        lengths = chat_lengths(count, seed=3, cap=context,
                               prompt_median=self.size(160, 24), output_median=self.size(120, 16))
        prompts = [text_prompts(self.text_ids, 1, p, p, seed=300 + i)[0] for i, (p, _) in enumerate(lengths)]
        work = Workload(prompts, [o for _, o in lengths])

        def run(reserve):
            cfg = EngineConfig(kv_cache_tokens=budget, max_model_len=context, prefix_caching=False,
                               scheduler=SchedulerConfig(max_num_seqs=256, max_batched_tokens=512,
                                                         reserve_tokens=reserve))
            return run_engine(self.model, work, cfg, f"reserve {reserve}" if reserve else "paged")

        paged = self.runs["paging_paged"] = run(None)
        reserved = self.runs["paging_reserved"] = run(context)

        def saturated_mean(r: RunResult) -> float:
            # While requests are still waiting after a step, the KV budget alone limits how
            # many sequences run: that is what each scheme can hold.
            held = [n for n, w in zip(r.running_per_step, r.waiting_per_step) if w > 0]
            return statistics.mean(held) if held else max(r.running_per_step)  # never full: all of them

        p, c = saturated_mean(paged), saturated_mean(reserved)
        return figure("paging", "concurrent sequences at an equal KV budget, paged vs contiguous reservation",
                      p, c, "sequences", p / c, ">= 2.5", kv_budget_tokens=budget, reserved_per_sequence=context,
                      block_size=16, workload=work.describe(), preemptions_paged=paged.stats["preemptions"])

    # -- prefix -------------------------------------------------------------------------------
    def prefix(self) -> Figure:
        trials, prefix_len, follow = self.size(5, 2), self.size(512, 64), 32
        engine = LLMEngine(self.model, EngineConfig(kv_cache_tokens=8192))
        one = greedy_params(1)
        cold, warm = [], []
        starts = text_prompts(self.text_ids, trials, prefix_len + 2 * follow, prefix_len + 2 * follow, seed=4)
        for ids in starts:
            shared, first, second = ids[:prefix_len], ids[prefix_len:prefix_len + follow], ids[prefix_len + follow:]
            for prompt, sink in ((shared + first, cold), (shared + second, warm)):
                t0 = time.perf_counter()
                engine.generate([prompt], one)
                sink.append(time.perf_counter() - t0)
        c, w = statistics.median(cold), statistics.median(warm)
        return figure("prefix", f"time to first token, {follow}-token follow-up after a cached {prefix_len}-token "
                      "prefix vs the same length cold", w, c, "s", w / c, "<= 0.3", trials=trials, cold_s=cold,
                      warm_s=warm, prefix_hits=engine.stats().prefix_hits)


    # -- lowbit -------------------------------------------------------------------------------
    def lowbit(self) -> list[Figure]:
        from labkit.bench import lowbit

        return [*lowbit.decode(self, figure), *lowbit.batch(self, figure), *lowbit.quality(self, figure)]

    # -- serve --------------------------------------------------------------------------------
    def serve(self) -> list[Figure]:
        """Rounds of the batch workload over HTTP (32 clients at once), each followed by the
        same engine in process fed the same requests at the moments the clients sent them, so
        the two differ only by the service's path. Each HTTP round has its own cache salt, so no
        round finds an earlier one's prefixes (the in-process engine is new every round)."""
        from labkit.bench.http_load import records_dict, run_closed_loop, summarize
        from labkit.serve.server import ServerProcess

        work, rounds = self.batch_workload(), self.size(3, 1)
        config = self.continuous_config()
        warm = Workload(work.prompts[:2], [4, 4])
        args = ["--model", self.model_name, "--kv-cache-tokens", str(config.kv_cache_tokens),
                "--max-num-seqs", str(config.scheduler.max_num_seqs),
                "--max-batched-tokens", str(config.scheduler.max_batched_tokens), "--weights", config.weights]
        args += ["--threads", str(self.threads)] if self.threads else []
        inproc, served = [], []
        with ServerProcess(*args) as server:
            run_engine(self.model, warm, config, "warm-up")
            run_closed_loop(server.url, self.model_name, warm.prompts, warm.max_tokens, 2)
            for round_ in range(rounds):
                records, wall = run_closed_loop(server.url, self.model_name, work.prompts, work.max_tokens,
                                                len(work), extra={"ignore_eos": True, "cache_salt": f"r{round_}"},
                                                stagger=SERVE_STAGGER_S)
                served.append((records, summarize(records, wall)))
                replay = Workload(work.prompts, work.max_tokens, [r.sent_s for r in records])
                inproc.append(run_engine(self.model, replay, config, f"engine in process, round {round_}"))
            # The service's own account of the time it adds, from the same workload sent whole:
            # the stages before the engine and the hop back (Server-Timing).
            whole, _ = run_closed_loop(server.url, self.model_name, work.prompts, work.max_tokens, len(work),
                                       extra={"ignore_eos": True, "cache_salt": "whole", "stream": False},
                                       stagger=SERVE_STAGGER_S)
        added_ms = [sum(r.server_timing.get(k, 0.0) for k in FRONT_END_STAGES) for r in whole if r.ok]
        self.records["serve_http_whole"] = {"records": records_dict(whole)}
        # The foil, once, under the same clients: it serves one request at a time (a global
        # lock). It samples at temperature 1 because it passes temperature 0 straight to
        # `generate`, which refuses it (a 500).
        with ServerProcess(*(["--naive"] + (["--threads", str(self.threads)] if self.threads else []))) as naive:
            run_closed_loop(naive.url, self.model_name, warm.prompts, warm.max_tokens, 2, extra={"temperature": 1.0})
            naive_records, naive_wall = run_closed_loop(naive.url, self.model_name, work.prompts, work.max_tokens,
                                                        len(work), extra={"temperature": 1.0})
        naive_summary = summarize(naive_records, naive_wall)
        self.records["serve_naive_http"] = {"summary": naive_summary, "records": records_dict(naive_records)}
        self.runs["serve_in_process"] = inproc[-1]
        self.records["serve_http"] = {"rounds": [summary for _, summary in served],
                                      "records": records_dict(served[-1][0])}
        tokenizer = self.model.tokenizer
        same = sum(r.ok and r.text == tokenizer.decode(ref.token_ids)
                   for records, _ in served for r, ref in zip(records, inproc[0].records))
        in_tps = [r.tokens_per_s for r in inproc]
        http_tps = [summary["output_tokens_per_s"] for _, summary in served]
        in_ttft = [r.ttft_quantile(0.5) for r in inproc]
        http_ttft = [summary["ttft_s"]["p50"] for _, summary in served]
        over_ms = [(h - i) * 1e3 for h, i in zip(http_ttft, in_ttft)]
        shared = {"workload": work.describe(), "concurrency": len(work), "rounds": rounds,
                  "arrivals": "in process: the moments the HTTP clients sent each request",
                  "client_stagger_s": SERVE_STAGGER_S,
                  "http_tokens_per_s": http_tps, "in_process_tokens_per_s": in_tps,
                  "http_ttft_p50_s": http_ttft, "in_process_ttft_p50_s": in_ttft, "ttft_overhead_ms": over_ms,
                  "http_last_round": served[-1][1]}
        median = statistics.median
        return [
            figure("serve", f"{len(work)} streaming HTTP clients vs the same engine in process",
                   median(http_tps), median(in_tps), "output tokens/s", median(http_tps) / median(in_tps), ">= 0.9",
                   **shared),
            figure("serve", "median time to first token over HTTP minus in process (ratio column: ms)",
                   median(http_ttft), median(in_ttft), "s", median(over_ms), "<= 20", **shared),
            figure("serve", "median time the service adds around the engine per request (Server-Timing, ms)",
                   median(added_ms), 0.0, "ms", median(added_ms), "<= 20", stages=FRONT_END_STAGES,
                   p90_ms=sorted(added_ms)[int(0.9 * (len(added_ms) - 1))], requests=len(added_ms)),
            figure("serve", "streams whose text equals the in-process run's", same, len(work) * rounds, "requests",
                   same / (len(work) * rounds), ">= 1"),
            figure("serve", f"{len(work)} streaming HTTP clients, labkit serve vs transformers served naively",
                   median(http_tps), naive_summary["output_tokens_per_s"], "output tokens/s",
                   median(http_tps) / naive_summary["output_tokens_per_s"], ">= 1", naive=naive_summary,
                   naive_errors=naive_summary["errors"]),
        ]


def run_bench(figures: list[str] | None = None, *, quick: bool = False, out: str | Path = "results/bench",
              model_name: str = "smollm2-135m", threads: int | None = None) -> list[Figure]:
    import labkit
    from labkit.util.environment import capture
    from labkit.util.timing import num_threads
    from labkit.eval import eval_text
    from labkit.models.reference import load_reference
    from labkit.models.registry import artefact_record

    figures = list(figures or FIGURES)
    unknown = set(figures) - set(FIGURES)
    if unknown:
        raise ValueError(f"unknown figure(s) {sorted(unknown)}: choose from {FIGURES}")
    model = labkit.load_model(model_name)
    needs_reference = {"decode", "batch"} & set(figures)
    bench = Bench(model, model.tokenizer.encode(eval_text()),
                  load_reference(model_name) if needs_reference else None, quick,
                  model_name=model_name, threads=threads)
    results: list[Figure] = []
    with num_threads(threads):
        for name in figures:
            got = getattr(bench, name)()
            for f in got if isinstance(got, list) else [got]:
                print(f.line(), flush=True)
                results.append(f)
        used_threads = torch.get_num_threads()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    summary = {"figures": [asdict(f) for f in results], "quick": quick, "threads": used_threads,
               "model": model_name, "dtype": str(model.dtype), "environment": capture(artefact_record(model_name)),
               "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    for key, run in bench.runs.items():
        (out / f"{key}.json").write_text(json.dumps(run.to_dict(), default=str))
    for key, record in bench.records.items():
        (out / f"{key}.json").write_text(json.dumps(record, default=str))
    return results
