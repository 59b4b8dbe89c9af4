"""The engine's written contracts: the three caches are one KVCacheView, the Llama is a
ServedModel, the two backends are Backends, and the engine reaches the model, the KV pool
and attention only through them (a stand-in backend sees every step)."""

import torch

from conftest import assert_solo_greedy, make_tiny_llama
from labkit.engine.backends import FastBackend, ReferenceBackend
from labkit.engine.interfaces import Backend, KVCacheView, KVPoolLike, ModelShape, ServedModel
from labkit.engine.llm_engine import EngineConfig, LLMEngine
from labkit.engine.paged_cache import PagedBatch
from labkit.experiments.compilation import StaticCache
from labkit.sampling import SamplingParams


def test_the_three_caches_are_one_contract():
    model = make_tiny_llama()
    pool = ReferenceBackend().new_pool(model.config, 8, 4, model.dtype, model.device)
    caches = [model.new_cache(1, 16), StaticCache.for_model(model, 1, 16),
              PagedBatch(pool, [[0, 1]], [0], [3])]
    assert all(isinstance(c, KVCacheView) for c in caches)
    assert isinstance(pool, KVPoolLike) and pool.device == model.device
    assert not isinstance(object(), KVCacheView)


def test_the_model_and_backends_conform():
    model = make_tiny_llama()
    assert isinstance(model, ServedModel) and isinstance(model.config, ModelShape)
    assert model.max_positions == model.rope_cos.shape[0]
    assert isinstance(ReferenceBackend(), Backend) and isinstance(FastBackend(), Backend)


class CountingBackend(ReferenceBackend):
    """The reference backend, counting what the engine asks of it."""
    name = "counting"

    def __init__(self):
        self.prepared = self.pools = self.batches = 0

    def prepare(self, model):
        self.prepared += 1
        return super().prepare(model)

    def new_pool(self, *args):
        self.pools += 1
        return super().new_pool(*args)

    def batch(self, *args):
        self.batches += 1
        return super().batch(*args)


def test_the_engine_runs_through_its_backend():
    model = make_tiny_llama()
    backend = CountingBackend()
    engine = LLMEngine(model, EngineConfig(block_size=4, kv_cache_tokens=128, backend=backend))
    ids = [5, 6, 7, 8, 9]
    out = engine.generate([ids], SamplingParams(temperature=0.0, max_tokens=6, logprobs=0))[0]
    assert_solo_greedy(model, [ids], out.samples, 6)  # a paged pool: another path than one contiguous cache
    assert (backend.prepared, backend.pools) == (1, 1)
    assert backend.batches == engine.steps == 6
    assert engine.pool.device == torch.device("cpu") and engine.runner.device == engine.pool.device
