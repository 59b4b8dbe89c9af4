"""LLMEngine: requests in, token events out.

    add_request -> step():  Scheduler.schedule -> ModelRunner.run (forward + sample)
                            -> postprocess (OutputProcessor per sample) -> events

`step()` runs one iteration of that pipeline for every scheduled sequence at once and
returns what happened: one `TokenEvent` per new token or finished sample. The engine
touches the model only through the `ServedModel` contract and leaves weight packing, KV
layout and attention to its `Backend` (`labkit.engine.interfaces`). `generate` drives
steps until a set of requests is done; `stream` yields one request's events as they
happen, and any number of streams may be open at once: each step's events are kept for
the stream they belong to. A server drives the engine through `labkit.engine.core`.

A request whose params have a `response_format` is compiled when it is added (a format the
grammar engine refuses is refused then, before any work: `labkit.structured.InvalidFormat`,
a ValueError); each of its samples gets its own matcher, which the runner's sampler masks
with and the sample's output processor advances. `mask_clock` adds up the time spent in
them.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Callable, Iterator, Sequence as Seq

from labkit.engine.backends import WEIGHTS, kv_dtype_for, prepare_weights
from labkit.engine.block_manager import BlockManager
from labkit.engine.interfaces import Backend, ServedModel
from labkit.engine.kv_groups import layer_groups
from labkit.engine.limits import EngineLimits
from labkit.engine.output import OutputProcessor, encode_prompt
from labkit.engine.runner import ModelRunner, SampledToken
from labkit.engine.scheduler import Scheduler, SchedulerConfig
from labkit.engine.sequence import Sequence, Status
from labkit.sampling import SamplingParams
from labkit.structured.contract import CompiledGrammar, MaskClock, SampleMatcher


@dataclass(frozen=True)
class EngineConfig:
    block_size: int = 16
    kv_cache_tokens: int = 32_768      # size of the KV pool, in token slots of every layer
    max_model_len: int | None = None   # prompt + output limit; None: the model's RoPE table
    prefix_caching: bool = True
    fast_kernels: bool = True          # oneDNN-packed weights, labkit's C kernels (where they
                                       # build); False: F.linear and gather + SDPA
    weights: str | None = "f32"        # backends.WEIGHTS; "gguf", "gguf-int8": matrices read in
                                       # the model file's own blocks; "bf16": bfloat16 matrices;
                                       # None: backends.PREFERRED_WEIGHTS where it runs, else f32.
                                       # "f32" by default: the path chapters 13-18 measure
    kv_dtype: str | None = None        # backends.KV_DTYPES ("f32", "bf16"); None: the model's
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    backend: Backend | None = None     # overrides fast_kernels (labkit.engine.backends)
    transition_log: int = 10_000       # the state changes kept in `transitions` (the newest)
    fit_context_to_pool: bool = False  # a service's choice: an unset max_model_len is capped
                                       # to the longest sequence the KV pool holds (and said
                                       # in `context_note`); a set one that does not fit is
                                       # refused. False: requests are refused one by one.

    @property
    def num_blocks(self) -> int:
        """Blocks of every layer the pool holds. A model with windowed layers splits them into
        layer groups (`labkit.engine.kv_groups`), and the pool into as many times more
        blocks of one group each: the same bytes."""
        return self.kv_cache_tokens // self.block_size


@dataclass
class TokenEvent:
    request_id: str
    index: int                  # which of the request's n samples
    token_id: int | None        # None when a sample finishes without a new token
    text: str                   # text that became final with this token
    finished: bool = False
    finish_reason: str | None = None  # "stop", "length" or "abort"
    time: float = 0.0
    # Raw log-probability of token_id and the most likely alternatives, when the request
    # asked for logprobs and a token was kept (see labkit.sampling.SamplingParams).
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] | None = None


@dataclass
class SampleOutput:
    index: int
    token_ids: list[int]
    text: str
    finish_reason: str | None
    logprobs: list[float] | None = None  # one per token id, when the request asked
    top_logprobs: list[tuple[tuple[int, float], ...]] | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    samples: list[SampleOutput]
    arrival_time: float
    first_token_time: float | None
    finish_time: float | None
    cached_prompt_tokens: int
    preemptions: int
    first_scheduled_time: float | None = None  # when its prompt first ran: arrival to this is queueing

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def token_ids(self) -> list[int]:
        return self.samples[0].token_ids

    @property
    def text(self) -> str:
        return self.samples[0].text


@dataclass
class EngineStats:
    blocks_total: int
    blocks_used: int
    blocks_free: int
    waiting: int
    running: int
    prefix_queries: int
    prefix_hits: int
    preemptions: int
    copies_on_write: int
    evictions: int
    steps: int
    tokens_computed: int
    prefix_query_tokens: int = 0   # tokens of the sequences looked up in the prefix cache
    prefix_hit_tokens: int = 0     # ... found there (hit rate: hits / queries, as vLLM counts)


@dataclass
class _Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    n: int
    arrival_time: float
    seqs: list[Sequence] = field(default_factory=list)
    outputs: dict[int, OutputProcessor] = field(default_factory=dict)  # by sample index
    grammar: CompiledGrammar | None = None  # the compiled response format, if any

    @property
    def done(self) -> bool:
        if self.seqs and self.seqs[0].status is Status.ABORTED:
            return True  # aborted, possibly before its other samples were forked
        return len(self.seqs) == self.n and all(s.status.done for s in self.seqs)


class LLMEngine:
    def __init__(self, model: ServedModel, config: EngineConfig | None = None, *,
                 clock: Callable[[], float] = time.perf_counter):
        self.config, self.clock = config or EngineConfig(), clock
        c = self.config
        if c.num_blocks < 1:
            raise ValueError(f"kv_cache_tokens {c.kv_cache_tokens} holds no block of {c.block_size}")
        kv_dtype = kv_dtype_for(c.kv_dtype, model.dtype)
        if c.backend is not None:
            self.backend, self.model = c.backend, c.backend.prepare(model)
            self.weights = c.backend.name if c.backend.name in WEIGHTS else "f32"
            self.weights_fallback = None
        else:
            prepared = prepare_weights(model, c.weights, c.fast_kernels)
            self.backend, self.model = prepared.backend, prepared.model
            self.weights, self.weights_fallback = prepared.weights, prepared.fallback
        self.max_model_len = min(c.max_model_len or model.max_positions, model.max_positions)
        self.groups = layer_groups(model.config.num_layers, getattr(model.config, "layer_windows", None))
        num_blocks = c.num_blocks * self.groups.num_groups
        self.blocks = BlockManager(num_blocks, c.block_size, c.prefix_caching, self.groups.windows)
        step_tokens = c.scheduler.max_batched_tokens if c.scheduler.chunked_prefill else None
        self.limits = EngineLimits(self.max_model_len, c.block_size, num_blocks, model.config.vocab_size,
                                   c.scheduler.max_num_seqs, self.groups.windows, step_tokens)
        self.context_note = self._fit_context_to_pool() if c.fit_context_to_pool else None
        self.pool = self.backend.new_pool(model.config, num_blocks, c.block_size, kv_dtype, model.device)
        self.transitions: deque[tuple[float, str, int, str, str]] = deque(maxlen=c.transition_log)
        self.scheduler = Scheduler(c.scheduler, self.blocks, self._record_transition)
        self.mask_clock = MaskClock()
        self.runner = ModelRunner(self.model, self.pool, self.backend, self.mask_clock)
        self._grammars = None  # the grammar backend, made by the first structured request
        self.requests: dict[str, _Request] = {}
        self._ids = itertools.count()
        self._seq_ids = itertools.count()
        self._streams: dict[str, deque[TokenEvent]] = {}  # events kept for open streams
        self.steps = self.tokens_computed = 0

    # -- requests in ------------------------------------------------------------------------
    def check_request(self, prompt: str | Seq[int], params: SamplingParams | None = None, *,
                      n: int = 1) -> list[int]:
        """The prompt's token ids, if the engine can serve this request; else ValueError (an
        empty or out-of-vocabulary prompt, n < 1) or its subclass `limits.Refused` (what the
        engine cannot do: more tokens than the model's context or the KV pool, more samples
        than it runs at once, a stop or logit-bias token the model does not have). Reads nothing that a
        step changes, so a front end may call it from its own thread before it sends the
        request to the engine."""
        params = params or SamplingParams(temperature=0.0)
        ids = encode_prompt(prompt, self.model.tokenizer, self.model.config.vocab_size)
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"n must be an integer >= 1, got {n!r}")
        self.limits.check(len(ids), params.max_tokens, n=n, stop_token_ids=params.stop_token_ids,
                          logit_bias_ids=tuple(t for t, _ in params.logit_bias))
        self.compile_format(params)
        return ids

    def compile_format(self, params: SamplingParams) -> CompiledGrammar | None:
        """The compiled response format of `params` (None without one), from the grammar
        backend's cache after the first time; `labkit.structured.InvalidFormat` if the
        grammar engine refuses it."""
        if params.response_format is None:
            return None
        if self._grammars is None:
            if self.model.tokenizer is None:
                raise ValueError("a response format needs the model's tokenizer")
            from labkit.structured.llg import backend_for  # llguidance loads on first use

            self._grammars = backend_for(self.model.tokenizer, self.model.config.vocab_size)
        return self._grammars.compile(params.response_format)

    def _matcher(self, request: _Request) -> SampleMatcher | None:
        if request.grammar is None:
            return None
        return SampleMatcher(request.grammar.new_matcher(), self.mask_clock, request.params.stop_token_ids)

    def add_request(self, prompt: str | Seq[int], params: SamplingParams | None = None, *,
                    request_id: str | None = None, n: int = 1, cache_salt: str | None = None,
                    arrival_time: float | None = None) -> str:
        """Queue a request; return its id. Raises ValueError (and changes nothing) for a
        request `check_request` refuses or a duplicate id."""
        params = params or SamplingParams(temperature=0.0)
        ids = self.check_request(prompt, params, n=n)
        request_id = str(next(self._ids)) if request_id is None else str(request_id)
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        now = self.clock() if arrival_time is None else arrival_time
        request = _Request(request_id, ids, params, n, now, grammar=self.compile_format(params))
        seq = Sequence(next(self._seq_ids), request_id, ids, params, cache_salt=cache_salt, arrival_time=now,
                       matcher=self._matcher(request))
        request.seqs.append(seq)
        request.outputs[0] = self._output_processor(ids, params, seq.matcher)
        self.requests[request_id] = request
        self.scheduler.add(seq)
        self._record_transition(seq, None, Status.WAITING)
        return request_id

    def _output_processor(self, prompt_ids: list[int], params: SamplingParams, matcher=None) -> OutputProcessor:
        return OutputProcessor(self.model.tokenizer, params, self.max_model_len - len(prompt_ids), matcher)

    def abort(self, request_id: str) -> bool:
        """Cancel a request: its samples stop and give back their blocks. False if there
        is no such unfinished request."""
        request = self.requests.get(request_id)
        if request is None or request.done:
            return False
        for seq in request.seqs:
            if not seq.status.done:
                seq.finish_reason, seq.finish_time = "abort", self.clock()
                self.scheduler.finish(seq, Status.ABORTED)
        return True

    def _record_transition(self, seq: Sequence, old: Status | None, new: Status) -> None:
        now = self.clock()
        if new is Status.RUNNING and seq.first_scheduled_time is None:
            seq.first_scheduled_time = now
        self.transitions.append((now, seq.request_id, seq.sample_index, old.value if old else "new", new.value))

    # -- one step: schedule, run, postprocess --------------------------------------------------
    def has_unfinished(self) -> bool:
        return self.scheduler.has_work

    def step(self) -> list[TokenEvent]:
        plan = self.scheduler.schedule()
        if not plan:
            return []
        samples = self._samples(plan)
        sampled = self.runner.run(plan, samples)
        events = self._postprocess(plan, samples, sampled)
        for event in events:
            kept = self._streams.get(event.request_id)
            if kept is not None:
                kept.append(event)
        return events

    def _samples(self, plan) -> list[tuple[Sequence, Sequence]]:
        """(row owner, sample) for every token this step samples. A request with n > 1
        prefills its prompt once: when the first sample's prompt is computed, the others
        are made here and draw from its logits; `_postprocess` forks them its blocks."""
        out = []
        for item in plan.scheduled:
            if not item.completes:
                continue
            seq = item.seq
            out.append((seq, seq))
            request = self.requests[seq.request_id]
            if len(request.seqs) < request.n and seq.sample_index == 0 and not seq.output_token_ids:
                for index in range(1, request.n):
                    child = Sequence(next(self._seq_ids), seq.request_id, seq.prompt_token_ids,
                                     seq.params, sample_index=index, cache_salt=seq.cache_salt,
                                     arrival_time=seq.arrival_time, matcher=self._matcher(request))
                    out.append((seq, child))
        return out

    def _postprocess(self, plan, samples: list[tuple[Sequence, Sequence]],
                     sampled: list[SampledToken]) -> list[TokenEvent]:
        for item in plan.scheduled:
            item.seq.num_computed_tokens += item.num_new_tokens
            self.blocks.computed(item.seq)  # full blocks findable; windowed groups' passed ones back
        self.steps += 1
        self.tokens_computed += plan.num_tokens
        for owner, seq in samples:
            if seq is not owner:
                request = self.requests[seq.request_id]
                self.blocks.fork(owner, seq)
                request.seqs.append(seq)
                request.outputs[seq.sample_index] = self._output_processor(seq.prompt_token_ids, seq.params,
                                                                           seq.matcher)
                self._record_transition(seq, None, Status.WAITING)
                self.scheduler.add_running(seq)
        now = self.clock()
        return [self._append(seq, token, now) for (_, seq), token in zip(samples, sampled)]

    def _append(self, seq: Sequence, sampled: SampledToken, now: float) -> TokenEvent:
        output = self.requests[seq.request_id].outputs[seq.sample_index]
        delta = output.add(sampled.token_id)
        kept = delta.token_id is not None
        if kept:
            seq.token_ids.append(sampled.token_id)
            if seq.logprobs is not None:
                seq.logprobs.append(sampled.logprob)
                seq.top_logprobs.append(sampled.top_logprobs)
            if seq.first_token_time is None:
                seq.first_token_time = now
        seq.text = output.text
        if delta.finish_reason is not None:
            seq.finish_reason, seq.finish_time = delta.finish_reason, now
            self.scheduler.finish(seq)
        return TokenEvent(seq.request_id, seq.sample_index, delta.token_id, delta.text,
                          delta.finish_reason is not None, delta.finish_reason, now,
                          sampled.logprob if kept else None, sampled.top_logprobs if kept else None)

    # -- results ------------------------------------------------------------------------------
    def output(self, request_id: str) -> RequestOutput:
        r = self.requests[request_id]
        firsts = [s.first_token_time for s in r.seqs if s.first_token_time is not None]
        finishes = [s.finish_time for s in r.seqs if s.finish_time is not None]
        return RequestOutput(
            r.request_id, r.prompt_token_ids,
            [SampleOutput(s.sample_index, s.output_token_ids, s.text, s.finish_reason,
                          None if s.logprobs is None else list(s.logprobs),
                          None if s.top_logprobs is None else list(s.top_logprobs)) for s in r.seqs],
            r.arrival_time, min(firsts) if firsts else None,
            max(finishes) if r.done and finishes else None,
            r.seqs[0].num_cached_prompt_tokens, sum(s.preemptions for s in r.seqs),
            r.seqs[0].first_scheduled_time)

    def release(self, request_id: str) -> RequestOutput:
        """The output of a finished request, forgetting the request."""
        if not self.requests[request_id].done:
            raise ValueError(f"request {request_id!r} has not finished")
        out = self.output(request_id)
        del self.requests[request_id]
        return out

    def generate(self, prompts: Seq[str | Seq[int]], params: SamplingParams | Seq[SamplingParams] | None = None,
                 *, n: int = 1) -> list[RequestOutput]:
        """Run a batch of prompts to completion; outputs in the order of `prompts`."""
        many = isinstance(params, (list, tuple))
        if many and len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        ids = [self.add_request(p, params[i] if many else params, n=n) for i, p in enumerate(prompts)]
        while not all(self.requests[i].done for i in ids):
            self.step()
        return [self.release(i) for i in ids]

    def stream(self, prompt: str | Seq[int], params: SamplingParams | None = None,
               **kwargs) -> Iterator[TokenEvent]:
        """Add a request and yield its events as steps produce them. Several streams may be
        open at once (each gets exactly its own events, whichever of them runs the step).
        Closing the iterator early (a client that went away) aborts the request."""
        request_id = self.add_request(prompt, params, **kwargs)
        kept = self._streams[request_id] = deque()
        try:
            while True:
                while kept:
                    yield kept.popleft()
                if self.requests[request_id].done:
                    return
                self.step()
        finally:
            self._streams.pop(request_id, None)
            self.abort(request_id)
            if request_id in self.requests:
                self.release(request_id)

    def _fit_context_to_pool(self) -> str | None:
        """Cap the context to what the pool holds for one sequence; None if it already fits."""
        c, fits = self.config, self.limits.longest_sequence()
        if fits >= self.max_model_len:
            return None
        if c.max_model_len is not None:
            raise ValueError(
                f"max_model_len {self.max_model_len} does not fit the KV pool: one sequence of that length "
                f"needs {self.limits.blocks_for(self.max_model_len)} blocks of {c.block_size} tokens and the "
                f"pool ({c.kv_cache_tokens} token slots) has {c.num_blocks}; it holds at most {fits} tokens. "
                "Raise kv_cache_tokens or lower max_model_len")
        if fits < 1:
            raise ValueError(f"the KV pool ({c.kv_cache_tokens} token slots) cannot hold one sequence")
        note = (f"context capped to {fits} tokens by the KV pool of {c.kv_cache_tokens} token slots (the "
                f"model's is {self.max_model_len}); raise kv_cache_tokens (serve: --kv-cache-tokens) for more")
        self.max_model_len = fits
        self.limits = replace(self.limits, max_model_len=fits)
        return note

    def stats(self) -> EngineStats:
        b = self.blocks
        return EngineStats(b.num_blocks, b.num_used, b.num_free, len(self.scheduler.waiting),
                           len(self.scheduler.running), b.counters.prefix_queries, b.counters.prefix_hits,
                           self.scheduler.preemptions, b.counters.copies_on_write, b.counters.evictions,
                           self.steps, self.tokens_computed, b.counters.prefix_query_tokens,
                           b.counters.prefix_hit_tokens)

    def check_invariants(self) -> None:
        """Raise AssertionError if any KV block is leaked or mis-counted."""
        live = [s for r in self.requests.values() for s in r.seqs if not s.status.done]
        self.blocks.check(live)
        if any(s.holds_blocks for s in self.scheduler.waiting):
            raise AssertionError("a waiting sequence holds blocks")
