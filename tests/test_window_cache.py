"""The rolling KV cache (`labkit.models.window_cache`) against the cache that keeps every
position and applies the window as a mask (`WindowedKVCache`): the same attention on random
tensors for any mix of chunk sizes, and the same greedy tokens from Gemma 3 past its window
(two numerical paths: equal up to the near-tie rule, `conftest.assert_greedy_near`)."""

from dataclasses import replace

import pytest
import torch

from conftest import assert_greedy_near, chosen_scores, served_token_ids
from labkit.kernels import native
from labkit.models.gemma3 import Gemma3Config
from labkit.models.window_cache import RollingKVCache, WindowedKVCache

TINY = Gemma3Config(vocab_size=16, hidden_size=8, intermediate_size=16, num_layers=3, num_heads=4,
                    num_kv_heads=2, head_dim=8, rms_norm_eps=1e-6, max_position_embeddings=64,
                    layer_windows=(5, None, 8), local_rope_theta=10.0, global_rope_theta=100.0,
                    query_pre_attn_scalar=8.0)
# Gemma 3 270M's logits through two caches (or the paged engine and a cache) differ by float32
# rounding: held to this, the bound the rolling and the full cache's logits are held to below;
# the near-tie tolerance is twice it.
GEMMA_CACHE_LOGIT_ERROR = 1e-3


@pytest.mark.parametrize("chunks", [[1] * 20, [13, 1, 1, 4, 1, 9, 1], [3, 17, 2], [30]])
def test_the_ring_attends_as_the_masked_full_cache(chunks):
    """Each chunk's attention output, layer by layer, equals the full cache's, whether the
    chunk is a decode token, shorter than the window, or longer than it."""
    torch.manual_seed(0)
    total = sum(chunks)
    full, ring = WindowedKVCache.empty(TINY, 2, total), RollingKVCache(TINY, 2, total)
    group = TINY.num_heads // TINY.num_kv_heads
    for steps in chunks:
        for cache in (full, ring):
            cache.positions(steps, TINY.max_position_embeddings)
        for layer in range(TINY.num_layers):
            q = torch.randn(2, TINY.num_kv_heads, group, steps, TINY.head_dim)
            k, v = torch.randn(2, 2, TINY.num_kv_heads, steps, TINY.head_dim).unbind(0)
            want = full.attend(layer, q, k, v)
            torch.testing.assert_close(ring.attend(layer, q, k, v), want, rtol=1e-5, atol=1e-6)
        full.advance(steps)
        ring.advance(steps)


def test_the_ring_holds_a_window_per_local_layer():
    ring = RollingKVCache(TINY, 1, 40)
    per_position = 2 * TINY.num_kv_heads * TINY.head_dim * 4  # keys and values, float32
    assert ring.nbytes() == per_position * (5 + 40 + 8)
    assert RollingKVCache(TINY, 1, 4).nbytes() == per_position * 3 * 4  # shorter than a window
    with pytest.raises(ValueError):
        RollingKVCache(TINY, 1, 4).positions(5, 64)


def test_without_windows_the_ring_is_the_full_cache():
    """A config whose layers are all global: no ring, every position kept."""
    plain = replace(TINY, layer_windows=(None, None, None))
    assert RollingKVCache(plain, 1, 10).nbytes() == WindowedKVCache.empty(plain, 1, 10).nbytes(10)


@pytest.fixture(scope="module")
def gemma():
    from labkit.models import load_model

    return load_model("gemma3-270m", with_tokenizer=False)


@pytest.mark.slow
def test_gemma_past_its_window_gives_the_full_caches_greedy_tokens(gemma):
    """A 700-token prompt (longer than the 512-token window) prefilled whole and in chunks,
    then 24 greedy tokens: the rolling cache's tokens equal the full cache's (up to the
    near-tie rule), its logits stay within float32 noise of them, and it holds a fraction of
    the bytes."""
    torch.manual_seed(0)
    prompt = torch.randint(10, 200_000, (1, 700))
    window = gemma.config.layer_windows[0]
    assert window == 512 and prompt.shape[1] > window

    def greedy(cache, chunk: int):
        for s in range(0, prompt.shape[1], chunk):
            logits = gemma(prompt[:, s:s + chunk], cache=cache, last_only=True)[:, -1]
        tokens, all_logits = [], []
        for _ in range(24):
            token = logits.argmax(-1, keepdim=True)
            tokens.append(token.item())
            all_logits.append(logits)
            logits = gemma(token, cache=cache)[:, -1]
        return tokens, torch.cat(all_logits)

    length = prompt.shape[1] + 24
    full_tokens, full_logits = greedy(gemma.new_cache(1, length, rolling=False), 700)
    for chunk in (700, 256):
        ring = gemma.new_cache(1, length)  # the model's default cache
        assert isinstance(ring, RollingKVCache)
        tokens, logits = greedy(ring, chunk)
        # the logits are held to the bound on every step both read the same text
        assert_greedy_near([full_tokens], [tokens], [full_logits], GEMMA_CACHE_LOGIT_ERROR, [logits],
                           what=f"the rolling cache (chunks of {chunk}) against the full one")
    full_bytes = gemma.new_cache(1, length, rolling=False).nbytes(length)
    assert ring.nbytes() < 0.8 * full_bytes


def test_gemma_and_its_caches_meet_the_engines_contracts(gemma):
    """Gemma 3 is served through the written contracts alone: the model is a `ServedModel`
    whose config is a `ModelShape`, and both of its caches are `KVCacheView`s."""
    from labkit.engine.interfaces import KVCacheView, ModelShape, ServedModel

    assert isinstance(gemma, ServedModel) and isinstance(gemma.config, ModelShape)
    assert all(isinstance(gemma.new_cache(1, 8, rolling=r), KVCacheView) for r in (True, False))


@pytest.mark.slow
def test_the_paged_engine_runs_gemma_through_its_windows(gemma):
    """LLMEngine on Gemma: a 600-token prompt prefilled in chunks of 256 (past the window)
    beside a short prompt, then greedy tokens: each request's tokens and log-probabilities
    are those of the cache that keeps every position and applies the windows as masks, run
    alone. Meanwhile the local layers' groups hold only their window: with 606 positions
    cached, the long sequence holds all 38 blocks of the global group but 33 in each local one
    (blocks 5 to 37: position 606 sees positions 95 on through its window of 512)."""
    from labkit.engine.llm_engine import EngineConfig, LLMEngine
    from labkit.engine.loop import greedy_continue
    from labkit.engine.scheduler import SchedulerConfig
    from labkit.sampling import SamplingParams

    torch.manual_seed(1)
    prompts = [torch.randint(10, 200_000, (600,)).tolist(), [2, 818, 5279, 529, 7001, 563]]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0)
    engine = LLMEngine(gemma, EngineConfig(kv_cache_tokens=2048, scheduler=SchedulerConfig(max_batched_tokens=256)))
    assert not engine.pool.native  # the C kernel has no window
    assert engine.groups.num_groups == 6 and engine.groups.windows[0] is None
    ids = [engine.add_request(p, params) for p in prompts]
    held = None
    while engine.has_unfinished():
        engine.step()
        engine.check_invariants()
        long = engine.requests[ids[0]].seqs[0]
        if long.num_tokens == 607:  # its last token is sampled next
            held = long.blocks_held
    assert held == [38] + [33] * 5
    for request_id, prompt in zip(ids, prompts):
        cache = gemma.new_cache(1, len(prompt) + 8, rolling=False)
        logits = gemma(torch.tensor([prompt]), cache=cache, last_only=True)[:, -1]
        want = greedy_continue(gemma, cache, logits, 8, keep_logits=True)
        sample = engine.release(request_id).samples[0]
        # paged, chunked and batched against one contiguous cache: two paths; the chosen
        # tokens' log-probabilities are held to the bound on the steps both share
        want_scores = torch.log_softmax(torch.stack(want.logits), -1)
        assert_greedy_near([want.token_ids], [sample.token_ids], [want_scores], GEMMA_CACHE_LOGIT_ERROR,
                           [chosen_scores(sample.token_ids, sample.logprobs)],
                           what="the paged engine against the full cache alone")
    assert engine.blocks.num_used == 0


@pytest.mark.slow
def test_labkit_generate_runs_gemma_with_its_bos_and_the_rolling_cache(gemma):
    """`labkit generate --model gemma3-270m`: the prompt starts with Gemma's BOS, and the
    tokens are the greedy ones of the full cache with the window as a mask."""
    import json
    import subprocess
    import sys

    from labkit.engine.loop import greedy_continue

    out = subprocess.run([sys.executable, "-m", "labkit.cli", "generate", "The capital of France is",
                          "--model", "gemma3-270m", "--max-tokens", "8", "--json"],
                         capture_output=True, text=True, check=True)
    record = json.loads(out.stdout)
    # float32, saying why: the file's blocks run the Llama only, and need the C kernels first
    why = "Llama" if native.load() is not None else "needs labkit's C kernels"
    assert record["weights"] == "f32" and why in out.stderr, out.stderr
    assert record["prompt_token_ids"] == [2, 818, 5279, 529, 7001, 563]
    ids = torch.tensor([record["prompt_token_ids"]])
    cache = gemma.new_cache(1, 16, rolling=False)
    logits = gemma(ids, cache=cache, last_only=True)[:, -1]
    want = greedy_continue(gemma, cache, logits, 8, keep_logits=True)
    n = len(record["token_ids"])  # (an end of sequence ends it early)
    # the rolling cache against the full one: two paths, equal up to the near-tie rule
    assert_greedy_near([want.token_ids[:n]], [record["token_ids"]], [torch.stack(want.logits)[:n]],
                       GEMMA_CACHE_LOGIT_ERROR, what="`labkit generate` on Gemma against the full cache")


@pytest.mark.slow
def test_labkit_serve_answers_with_gemma_and_refuses_chat_it_has_no_template_for(gemma):
    """`labkit serve --model gemma3-270m`: a greedy completion (the official client) is the
    rolling cache's greedy run from the prompt with its BOS; a chat request, which needs a
    template this base model's file does not have, gets the documented 400, not a 500."""
    import httpx
    import openai

    from labkit.engine.loop import greedy_continue
    from labkit.models.loader import load_tokenizer
    from live_server import LiveServer

    prompt = [2, 818, 5279, 529, 7001, 563]  # <bos> "The capital of France is"
    cache = gemma.new_cache(1, 16)
    logits = gemma(torch.tensor([prompt]), cache=cache, last_only=True)[:, -1]
    expected_run = greedy_continue(gemma, cache, logits, 8, keep_logits=True)
    expected, expected_scores = expected_run.token_ids, torch.log_softmax(torch.stack(expected_run.logits), -1)
    with LiveServer("--model", "gemma3-270m", "--kv-cache-tokens", "2048") as live:
        client = openai.OpenAI(base_url=live.url + "/v1", api_key="none", max_retries=0, timeout=120)
        answer = client.completions.create(model="gemma3-270m", prompt="The capital of France is",
                                           max_tokens=8, temperature=0, logprobs=0)
        chat = httpx.post(live.url + "/v1/chat/completions", timeout=120, json={
            "model": "gemma3-270m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
        card = client.models.retrieve("gemma3-270m")
    assert answer.usage.prompt_tokens == len(prompt)
    # the engine's paged pool against the rolling cache: two paths, up to the near-tie rule,
    # the served tokens read from their spelling in the answer's logprobs
    tokenizer = load_tokenizer("gemma3-270m")
    logprobs = answer.choices[0].logprobs
    served = served_token_ids(logprobs.tokens, expected, expected_scores, tokenizer)
    agreement = assert_greedy_near([expected], [served], [expected_scores], GEMMA_CACHE_LOGIT_ERROR,
                                   [chosen_scores(served, logprobs.token_logprobs[:len(served)])],
                                   what="the served Gemma answer against the rolling cache")
    if agreement.exact:
        assert answer.choices[0].text == tokenizer.decode(expected)
    assert chat.status_code == 400 and "no chat template" in chat.json()["error"]["message"]
    assert "/" not in chat.json()["error"]["message"]  # no server path in an answer
    assert card.model_extra["weights"] == "f32"  # the file's blocks are the Llama's mode
