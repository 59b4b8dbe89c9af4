"""Drive serving systems with a workload and keep one record per request.

`run_engine` feeds a `Workload` to an `LLMEngine` (all at once, or open-loop at the
workload's arrival times on the wall clock) and records arrival, first token and finish
of every request, and the number of running sequences after every step. `run_hf_static`
is the baseline: `transformers` `generate` on static, left-padded batches.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

import torch

from labkit.bench.workloads import Workload
from labkit.engine.llm_engine import EngineConfig, LLMEngine
from labkit.sampling import SamplingParams
from labkit.util.near_tie import AgreementSummary, GreedyAgreement, flip_tolerance, greedy_agreement
from labkit.util.timing import quantile


@dataclass
class RequestRecord:
    request: int
    prompt_tokens: int
    output_tokens: int
    arrival_s: float                 # from the start of the run
    first_token_s: float | None
    finish_s: float
    cached_prompt_tokens: int = 0
    preemptions: int = 0
    token_ids: list[int] = field(default_factory=list, repr=False)

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s


@dataclass
class RunResult:
    system: str
    wall_s: float
    records: list[RequestRecord]
    running_per_step: list[int] = field(default_factory=list)
    waiting_per_step: list[int] = field(default_factory=list)
    stats: dict = field(default_factory=dict)

    @property
    def output_tokens(self) -> int:
        return sum(r.output_tokens for r in self.records)

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s

    def ttft_quantile(self, q: float) -> float:
        """Quantile q of the time to first token (linear interpolation between records)."""
        values = [r.ttft_s for r in self.records if r.ttft_s is not None]
        if not values:
            raise ValueError(f"{self.system} recorded no first-token times")
        return quantile(values, q)

    def to_dict(self) -> dict:
        return {"system": self.system, "wall_s": self.wall_s, "output_tokens": self.output_tokens,
                "tokens_per_s": self.tokens_per_s, "stats": self.stats,
                "running_per_step": self.running_per_step, "waiting_per_step": self.waiting_per_step,
                "records": [{**asdict(r), "ttft_s": r.ttft_s} for r in self.records]}


def greedy_params(max_tokens: int, logprobs: int | None = None) -> SamplingParams:
    # ignore_eos: every system produces exactly the tokens asked for, so throughputs compare
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=logprobs)


def run_engine(model, workload: Workload, config: EngineConfig, system: str) -> RunResult:
    engine = LLMEngine(model, config)
    start = time.perf_counter()
    arrivals = workload.arrivals or [0.0] * len(workload)
    order = sorted(range(len(workload)), key=lambda i: arrivals[i])
    ids: dict[int, str] = {}
    running, waiting, pending = [], [], list(order)
    while pending or engine.has_unfinished():
        now = time.perf_counter() - start
        while pending and arrivals[pending[0]] <= now:
            i = pending.pop(0)
            ids[i] = engine.add_request(workload.prompts[i], greedy_params(workload.max_tokens[i]),
                                        arrival_time=start + arrivals[i])
        if engine.has_unfinished():
            engine.step()
            running.append(len(engine.scheduler.running))
            waiting.append(len(engine.scheduler.waiting))
        elif pending:
            time.sleep(max(0.0, arrivals[pending[0]] - (time.perf_counter() - start)))
    wall = time.perf_counter() - start
    records = []
    for i in range(len(workload)):
        out = engine.release(ids[i])
        records.append(RequestRecord(
            i, len(out.prompt_token_ids), len(out.token_ids), out.arrival_time - start,
            None if out.first_token_time is None else out.first_token_time - start,
            out.finish_time - start, out.cached_prompt_tokens, out.preemptions, out.token_ids))
    return RunResult(system, wall, records, running, waiting, asdict(engine.stats()))


# Scores of the reference's top tokens a step, for the near-tie rule: a flip to a token below
# them is excused only if even the last of them is within the tolerance.
SOLO_TOP_LOGPROBS = 20


def agreement_with_solo(model, workload: Workload, batched: RunResult, solo: RunResult,
                        solo_config: EngineConfig, max_logit_error: float) -> AgreementSummary:
    """Each request's greedy tokens in a batched run against its run alone, under the near-tie
    rule (`labkit.util.near_tie`): other batch shapes sum in other orders, so where the solo
    run's best two tokens are within `flip_tolerance(max_logit_error)` either may win. Only a
    request whose tokens differ is run alone again (untimed, `solo_config`) with its top
    log-probabilities, the scores the rule reads at the divergence."""
    tolerance = flip_tolerance(max_logit_error)
    agreements: list[GreedyAgreement] = []
    for i, (got, want) in enumerate(zip(batched.records, solo.records)):
        if got.token_ids == want.token_ids:
            n = len(want.token_ids)
            agreements.append(GreedyAgreement(n, n, None, None, None, None, tolerance, None))
            continue
        engine = LLMEngine(model, solo_config)
        again = engine.generate([workload.prompts[i]], greedy_params(workload.max_tokens[i], SOLO_TOP_LOGPROBS))[0]
        sample = again.samples[0]
        if sample.token_ids != want.token_ids:
            raise RuntimeError(f"request {i} alone gave other tokens on a second run: the solo path is not deterministic")
        agreements.append(greedy_agreement(want.token_ids, got.token_ids, sample.top_logprobs, tolerance))
    return AgreementSummary(tuple(agreements))


@torch.inference_mode()
def run_hf_static(reference, workload: Workload, batch_size: int = 8, pad_id: int = 0) -> RunResult:
    """`generate` (greedy) on batches of `batch_size` requests in arrival order, each batch
    left-padded to its longest prompt and run until its longest output is done."""
    start = time.perf_counter()
    records = []
    for first in range(0, len(workload), batch_size):
        index = list(range(first, min(first + batch_size, len(workload))))
        longest = max(len(workload.prompts[i]) for i in index)
        ids = torch.full((len(index), longest), pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, i in enumerate(index):
            p = workload.prompts[i]
            ids[row, longest - len(p):] = torch.tensor(p)
            mask[row, longest - len(p):] = 1
        new = max(workload.max_tokens[i] for i in index)
        out = reference.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new,
                                 min_new_tokens=new, do_sample=False, pad_token_id=pad_id)
        done = time.perf_counter() - start
        for row, i in enumerate(index):
            tokens = out[row, longest:longest + workload.max_tokens[i]].tolist()
            records.append(RequestRecord(i, len(workload.prompts[i]), len(tokens), 0.0, None, done,
                                         token_ids=tokens))
    return RunResult(f"transformers generate, static batches of {batch_size}", time.perf_counter() - start, records)
