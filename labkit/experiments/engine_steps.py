"""The real engine beside the disaggregation simulator (chapter 29): the time of one
`LLMEngine.step()` on a grid of step compositions (prefill tokens, decoding sequences), to
fit `labkit.sim.disaggregation.StepTime`, and a whole workload queued at once, whose steps
the simulator must reproduce."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Sequence

from labkit.engine.llm_engine import EngineConfig, LLMEngine
from labkit.engine.scheduler import SchedulerConfig
from labkit.sampling import SamplingParams
from labkit.sim.disaggregation import Batching, StepRecord, StepSample


def record_compositions(engine) -> list[tuple[int, int]]:
    """Keep (prefill tokens, decoding sequences) of every step the engine's scheduler plans,
    in order (wraps its `schedule`; read at planning time, before the step moves the
    sequences on)."""
    found, schedule = [], engine.scheduler.schedule

    def recording():
        plan = schedule()
        found.append(plan_composition(plan))
        return plan

    engine.scheduler.schedule = recording
    return found


def plan_composition(plan) -> tuple[int, int]:
    """(prefill tokens, decoding sequences) of a `StepPlan` that has not run yet."""
    prefill = [s for s in plan.scheduled if s.seq.num_computed_tokens < s.seq.num_prompt_tokens]
    return sum(s.num_new_tokens for s in prefill), len(plan.scheduled) - len(prefill)


def _engine(model, lengths: Sequence[int], batching: Batching, block: int = 16) -> LLMEngine:
    """An engine whose KV pool holds sequences of `lengths` tokens all at once (no
    preemption), prefix caching off (a repeated prompt must cost what a new one does)."""
    sched = SchedulerConfig(max_num_seqs=batching.max_num_seqs,
                            max_batched_tokens=batching.max_batched_tokens)
    blocks = sum(-(-(n + 1) // block) for n in lengths) + 1
    return LLMEngine(model, EngineConfig(block_size=block, kv_cache_tokens=block * blocks,
                                         prefix_caching=False, scheduler=sched))


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def measure_step_times(model, prompt_ids: Sequence[int], prefill_tokens: Sequence[int],
                       decode_seqs: Sequence[int], *, repeats: int = 5, warmup: int = 1,
                       context: int = 64, seed: int = 0) -> list[StepSample]:
    """Time `LLMEngine.step()` for every (P, D) of the grid (except (0, 0)).

    One engine per D holds D sequences decoding, each started from a `context`-token prompt
    cut from `prompt_ids`. A step with P > 0 adds one P-token prompt (max_tokens=1, so it
    leaves after that step); the step's recorded plan is checked to hold exactly P prefill
    tokens and D decodes. Rounds visit every engine and every P in a seeded random order,
    so a slow spell of the machine spreads over the grid instead of hitting one point."""
    longest = max(prefill_tokens)
    if len(prompt_ids) < longest + context:
        raise ValueError(f"need at least {longest + context} prompt ids")
    rounds = warmup + repeats
    setup = {}
    for d in decode_seqs:
        batching = Batching(max_batched_tokens=max(longest + d, context), max_num_seqs=d + 1)
        # the decoders outlive every timed step and the steps that prefill them
        steps_each = rounds * len(prefill_tokens) + d * context // batching.max_batched_tokens + 2
        engine = _engine(model, [context + steps_each] * d + [longest], batching)
        plans = record_compositions(engine)
        for k in range(d):
            start = (k * 37) % (len(prompt_ids) - context)
            engine.add_request(list(prompt_ids[start:start + context]), _greedy(steps_each))
        while any(not s.token_ids[s.num_prompt_tokens:] for s in engine.scheduler.running) \
                or engine.scheduler.waiting:
            engine.step()
        setup[d] = (engine, plans)
    rng = random.Random(seed)
    cells = [(p, d) for d in decode_seqs for p in prefill_tokens if p or d]
    times: dict[tuple[int, int], list[float]] = {c: [] for c in cells}
    for r in range(rounds):
        for p, d in rng.sample(cells, len(cells)):
            engine, plans = setup[d]
            rid = None
            if p:
                start = rng.randrange(0, len(prompt_ids) - p + 1)
                rid = engine.add_request(list(prompt_ids[start:start + p]), _greedy(1))
            t0 = time.perf_counter()
            engine.step()
            took = time.perf_counter() - t0
            if plans[-1] != (p, d):
                raise AssertionError(f"step ran {plans[-1]}, not {(p, d)}")
            if rid is not None:
                engine.release(rid)
            if r >= warmup:
                times[(p, d)].append(took)
    return [StepSample(p, d, tuple(times[(p, d)])) for p, d in cells]


@dataclass
class EngineRun:
    wall_s: float
    steps: list[StepRecord]          # composition and measured seconds of every step
    token_ids: list[list[int]]

    @property
    def output_tokens_per_s(self) -> float:
        return sum(len(t) for t in self.token_ids) / self.wall_s


def engine_saturation(model, prompts: Sequence[Sequence[int]], outputs: Sequence[int],
                      batching: Batching) -> EngineRun:
    """Queue every prompt at once in one `LLMEngine` (greedy, exactly `outputs[i]` tokens,
    prefix caching off, a pool large enough that nothing is preempted) and run them all;
    the composition and measured time of every step."""
    engine = _engine(model, [len(p) + o for p, o in zip(prompts, outputs)], batching)
    plans = record_compositions(engine)
    ids = [engine.add_request(list(p), _greedy(o)) for p, o in zip(prompts, outputs)]
    steps = []
    start = time.perf_counter()
    while engine.has_unfinished():
        t0 = time.perf_counter()
        engine.step()
        steps.append(StepRecord("engine", t0 - start, *plans[-1],
                                time.perf_counter() - t0))
    wall = time.perf_counter() - start
    return EngineRun(wall, steps, [engine.release(i).token_ids for i in ids])
