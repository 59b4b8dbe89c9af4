"""The KV handoff: the payload round-trips exactly, decoding from a received cache gives the
single-process tokens, and the real two-process run agrees with one process."""

import json

import pytest
import torch

from conftest import make_tiny_llama
from labkit.engine.loop import greedy_decode
from labkit.experiments import kv_handoff as kh
from labkit.sim.disaggregation import kv_bytes_per_token


@pytest.fixture(scope="module")
def tiny():
    return make_tiny_llama(vocab=97)


def _prefill(model, ids, room):
    cache = model.new_cache(1, len(ids) + room)
    logits = model(torch.tensor([ids]), cache=cache, last_only=True)[:, -1]
    return cache, int(logits.argmax(-1)[0])


def test_payload_round_trips_keys_values_token_and_position(tiny):
    ids = torch.randint(0, 97, (23,), generator=torch.Generator().manual_seed(0)).tolist()
    cache, first = _prefill(tiny, ids, 5)
    payload = kh.pack_cache(cache, first)
    c = tiny.config
    kv = kv_bytes_per_token(c.num_layers, c.num_kv_heads, c.head_dim, 4) * len(ids)
    (size,) = kh.HEADER.unpack_from(payload)
    assert len(payload) == kh.HEADER.size + size + kv
    assert json.loads(payload[kh.HEADER.size:kh.HEADER.size + size])["position"] == len(ids)
    got, token, position = kh.unpack_cache(payload, tiny, len(ids) + 5)
    assert (token, position, got.length, got.max_len) == (first, len(ids), len(ids), len(ids) + 5)
    assert torch.equal(got.keys[:, :, :, :position], cache.keys[:, :, :, :position])
    assert torch.equal(got.values[:, :, :, :position], cache.values[:, :, :, :position])
    assert not got.keys[:, :, :, position:].any()


def test_decoding_from_a_received_cache_gives_the_one_process_tokens(tiny):
    for seed, n, new in ((1, 9, 12), (2, 40, 20)):
        ids = torch.randint(0, 97, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
        cache, first = _prefill(tiny, ids, new)
        received, token, _ = kh.unpack_cache(kh.pack_cache(cache, first), tiny, n + new)
        # the same bytes in a cache of the same size, the same decode steps: one path, exact
        assert kh.continue_greedy(tiny, received, token, new) == greedy_decode(tiny, ids, new).token_ids


def test_a_payload_of_another_dtype_is_refused(tiny):
    cache, first = _prefill(tiny, [1, 2, 3], 2)
    cache.keys, cache.values = cache.keys.double(), cache.values.double()
    with pytest.raises(ValueError):
        kh.unpack_cache(kh.pack_cache(cache, first), tiny, 5)


@pytest.mark.slow
def test_two_processes_hand_off_a_real_cache(model):
    ids = model.tokenizer.encode("The keys and values of a prompt can be computed on one machine "
                                 "and used on another, if every byte arrives.")
    result = kh.run_handoff(model, "smollm2-135m", ids, 12, repeats=2)
    assert result.identical, (result.tokens, result.reference)
    assert result.cache_identical, result.hashes
    assert result.closed_form_bytes_per_token == 46_080
    assert result.kv_bytes == 46_080 * len(ids) and result.payload_bytes > result.kv_bytes
    assert len(result.transfer_s) == 2 and all(t > 0 for t in result.transfer_s)
