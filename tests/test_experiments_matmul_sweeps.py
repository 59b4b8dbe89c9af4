"""The matmul sweeps: FLOP and byte arithmetic, both weight layouts, thread settings."""

import pytest
import torch

from labkit.experiments import matmul_sweeps as sweeps
from labkit.util.timing import Timing
from labkit.models.gguf_file import LlamaConfig

SMOLLM2 = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                      num_heads=9, num_kv_heads=3, head_dim=64, rope_theta=100000.0,
                      rms_norm_eps=1e-5, max_position_embeddings=8192)


@pytest.fixture
def fixed_timer(monkeypatch):
    """Replace `measure` in the sweeps with one that calls fn once and reports fixed samples
    (1, 2, 3, 4, 5 ms: median 3 ms, p25 2 ms, p75 4 ms), recording what it was asked."""
    calls = []

    def fake_measure(fn, *, name="call", repeats=7, warmup=2, min_seconds=0.0,
                     max_repeats=1000, threads=None, device=None, **meta):
        fn()
        calls.append({"name": name, "threads": threads, "device": device, "warmup": warmup})
        return Timing(name, [0.001, 0.002, 0.003, 0.004, 0.005], warmup=warmup,
                      threads=threads if threads is not None else torch.get_num_threads())

    monkeypatch.setattr(sweeps, "measure", fake_measure)
    return calls


def test_closed_forms():
    assert sweeps.matmul_flops(3, 5, 7) == 2 * 3 * 5 * 7
    assert sweeps.matmul_bytes(3, 5, 7) == 4 * (3 * 7 + 7 * 5 + 3 * 5)
    assert sweeps.matmul_bytes(3, 5, 7, torch.bfloat16) == 2 * (3 * 7 + 7 * 5 + 3 * 5)
    assert sweeps.weight_bytes(576, 49152) == 576 * 49152 * 4
    assert sweeps.dtype_bytes(torch.float16) == 2


def test_gemm_records_match_closed_forms(fixed_timer):
    records = sweeps.gemm_sweep([4, 8], threads_list=(1, 2))
    assert [(r["n"], r["threads"]) for r in records] == [(4, 1), (4, 2), (8, 1), (8, 2)]
    for r in records:
        n = r["n"]
        assert r["flops"] == 2 * n**3 and r["bytes"] == 3 * n * n * 4
        assert r["median_s"] == 0.003 and r["p25_s"] == 0.002 and r["p75_s"] == 0.004
        assert r["mean_s"] == pytest.approx(0.003)
        assert r["gflops"] == pytest.approx(2 * n**3 / 0.003 / 1e9)
        assert r["gbps"] == pytest.approx(12 * n * n / 0.003 / 1e9)
        assert r["spread"] == pytest.approx((0.004 - 0.002) / 0.003)
    assert [c["threads"] for c in fixed_timer] == [1, 2, 1, 2]


def test_gemv_records_match_closed_forms(fixed_timer):
    shapes = {"a": (6, 10), "b": (12, 3)}
    records = sweeps.gemv_sweep(shapes, threads_list=(1,), layout="out_in", batch=2)
    assert [r["name"] for r in records] == ["a", "b"]
    for r, (k, n) in zip(records, shapes.values()):
        assert (r["in_features"], r["out_features"], r["batch"]) == (k, n, 2)
        assert r["flops"] == 2 * 2 * k * n
        assert r["weight_bytes"] == 4 * k * n
        assert r["bytes"] == 4 * (k * n + 2 * k + 2 * n)
        assert r["gbps"] == pytest.approx(4 * k * n / 0.003 / 1e9)
        assert r["gflops"] == pytest.approx(4 * k * n / 0.003 / 1e9)
        assert r["layout"] == "out_in" and r["copies"] == 1


def test_cold_copies():
    assert sweeps.cold_copies(100, 0) == 1
    assert sweeps.cold_copies(100, 50) == 1
    assert sweeps.cold_copies(100, 250) == 3
    assert sweeps.cold_copies(100, 300) == 3


def test_cold_sweep_cycles_through_copies(fixed_timer):
    records = sweeps.gemv_sweep({"w": (8, 16)}, threads_list=(1,), cold_bytes=4 * 8 * 16 * 5)
    assert records[0]["copies"] == 5
    assert fixed_timer[0]["warmup"] >= 5  # every copy is touched before timing


@pytest.mark.parametrize("batch", [1, 4])
def test_both_layouts_compute_the_same_product(batch):
    w_in_out = sweeps.gemv_weight(48, 80, "in_out", generator=torch.Generator().manual_seed(3))
    w_out_in = sweeps.gemv_weight(48, 80, "out_in", generator=torch.Generator().manual_seed(3))
    assert w_in_out.shape == (48, 80) and w_out_in.shape == (80, 48)
    assert w_in_out.is_contiguous() and w_out_in.is_contiguous()
    x = torch.randn(batch, 48)
    a, b = sweeps.gemv(x, w_in_out, "in_out"), sweeps.gemv(x, w_out_in, "out_in")
    assert a.shape == (batch, 80)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(a, x @ w_out_in.t())


def test_bad_layout_is_refused():
    with pytest.raises(ValueError):
        sweeps.gemv_weight(4, 4, "rows")
    with pytest.raises(ValueError):
        sweeps.gemv_sweep({"w": (4, 4)}, layout="rows")


def test_thread_setting_is_respected():
    """Real timing on tiny sizes: each record reports the thread count it ran under, and the
    process's setting is restored afterwards."""
    before = torch.get_num_threads()
    gemm = sweeps.gemm_sweep([8], threads_list=(1, 2), repeats=2, warmup=1)
    gemv = sweeps.gemv_sweep({"w": (16, 8)}, threads_list=(2, 1), repeats=2, warmup=1)
    tiny = sweeps.call_overhead_sweep([2], threads=1, repeats=3, warmup=1, min_seconds=0.0,
                                      rounds=1)
    assert [r["threads"] for r in gemm] == [1, 2]
    assert [r["threads"] for r in gemv] == [2, 1]
    assert tiny[0]["threads"] == 1 and tiny[0]["flops"] == 16
    assert torch.get_num_threads() == before
    for r in gemm + gemv + tiny:
        assert r["p25_s"] <= r["median_s"] <= r["p75_s"] and r["repeats"] >= 2


def test_overhead_floor_and_where_it_is_left():
    records = [{"n": n, "median_s": t} for n, t in
               [(1, 1.0e-6), (2, 1.2e-6), (4, 1.1e-6), (8, 1.5e-6), (16, 2.5e-6), (32, 9e-6)]]
    floor = sweeps.overhead_floor(records, upto=4)
    assert floor == pytest.approx(1.0e-6)
    assert sweeps.leaves_floor(records, floor, factor=2.0) == 16
    assert sweeps.leaves_floor(records, floor, factor=10.0) is None
    with pytest.raises(ValueError):
        sweeps.overhead_floor(records[3:], upto=4)


def test_call_overhead_pools_rounds(fixed_timer):
    records = sweeps.call_overhead_sweep([1, 3], rounds=2)
    assert [c["name"] for c in fixed_timer] == ["mm 1", "mm 3", "mm 1", "mm 3"]
    assert [(r["n"], r["repeats"], r["flops"]) for r in records] == [(1, 10, 2), (3, 10, 54)]
    assert records[0]["median_us"] == pytest.approx(3000.0)


def test_compare_threads_pools_rounds_and_gives_speedups(monkeypatch):
    seen = []

    def fake_measure(fn, *, name, repeats, warmup, min_seconds, threads):
        seen.append((name, threads))
        t = {1: 0.004, 2: 0.002}[threads] if name == "big" else 0.001
        return Timing(name, [t] * repeats, warmup=warmup, threads=threads)

    monkeypatch.setattr(sweeps, "measure", fake_measure)
    records = sweeps.compare_threads({"big": lambda: None, "small": lambda: None},
                                     rounds=2, repeats=3)
    assert seen == [("big", 1), ("big", 2), ("small", 1), ("small", 2)] * 2
    assert [(r["name"], r["threads"], r["repeats"]) for r in records] == [
        ("big", 1, 6), ("big", 2, 6), ("small", 1, 6), ("small", 2, 6)]
    assert [r["speedup"] for r in records] == pytest.approx([1.0, 2.0, 1.0, 1.0])
    # constant samples: the bootstrap interval of the speedup is the speedup itself
    assert [r["speedup_low"] for r in records] == pytest.approx([1.0, 2.0, 1.0, 1.0])
    assert [r["speedup_high"] for r in records] == pytest.approx([1.0, 2.0, 1.0, 1.0])
    assert sweeps.slower_phrase(records) == "none of the 2 operations"


def test_slower_phrase_names_only_intervals_below_one():
    records = [{"name": "a", "speedup": 1.0, "speedup_low": 1.0, "speedup_high": 1.0},
               {"name": "a", "speedup": 0.95, "speedup_low": 0.93, "speedup_high": 0.97},
               {"name": "b", "speedup": 1.0, "speedup_low": 1.0, "speedup_high": 1.0},
               {"name": "b", "speedup": 0.99, "speedup_low": 0.96, "speedup_high": 1.02}]
    assert sweeps.slower_phrase(records) == "a (0.95x, 95% interval 0.93-0.97x)"


def test_model_shapes_are_smollm2s():
    shapes = sweeps.model_gemv_shapes(SMOLLM2)
    assert shapes == {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072),
                      "down": (1536, 576), "lm_head": (576, 49152)}
    counts = sweeps.gemv_calls_per_token(SMOLLM2)
    weights = sum(k * n * counts[name] for name, (k, n) in shapes.items())
    # every weight of the model but the norms (and the tied embedding counted once, as the head)
    assert weights == 30 * (576 * 960 + 576 * 576 + 576 * 3072 + 1536 * 576) + 576 * 49152


def test_decode_helpers_on_a_tiny_model():
    from labkit.models.llama import Llama

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2,
                         num_heads=4, num_kv_heads=2, head_dim=8, rope_theta=10000.0,
                         rms_norm_eps=1e-5, max_position_embeddings=64)
    g = torch.Generator().manual_seed(0)
    state = {"model.embed_tokens.weight": torch.randn(64, 32, generator=g),
             "model.norm.weight": torch.ones(32)}
    for i in range(2):
        p = f"model.layers.{i}."
        state.update({p + "input_layernorm.weight": torch.ones(32),
                      p + "post_attention_layernorm.weight": torch.ones(32),
                      p + "self_attn.q_proj.weight": torch.randn(32, 32, generator=g),
                      p + "self_attn.k_proj.weight": torch.randn(16, 32, generator=g),
                      p + "self_attn.v_proj.weight": torch.randn(16, 32, generator=g),
                      p + "self_attn.o_proj.weight": torch.randn(32, 32, generator=g),
                      p + "mlp.gate_proj.weight": torch.randn(48, 32, generator=g),
                      p + "mlp.up_proj.weight": torch.randn(48, 32, generator=g),
                      p + "mlp.down_proj.weight": torch.randn(32, 48, generator=g)})
    model = Llama(config, state)
    assert model.layers[0].qkv.shape[::-1] == sweeps.model_gemv_shapes(config)["qkv"]
    assert sweeps.decode_matmul_pass(model)().shape == (1, 64)
    assert sweeps.decode_matmul_pass(model, rows=3)().shape == (3, 64)  # a prefill's rows
    with pytest.raises(ValueError):
        sweeps.decode_matmul_pass(model, rows=0)
    # a prefill that keeps the last logits only runs the LM head on one row: the head's
    # output is the first row's, and the head sees exactly one row
    head_one = sweeps.decode_matmul_pass(model, rows=3, head_rows=1)()
    assert head_one.shape == (1, 64)
    torch.testing.assert_close(head_one, sweeps.decode_matmul_pass(model, rows=3)()[:1])
    with pytest.raises(ValueError):
        sweeps.decode_matmul_pass(model, rows=3, head_rows=4)
    from labkit.kernels.packed import pack_model

    packed = pack_model(model)  # the engine's kernels: the same products as F.linear
    for rows in (1, 3):
        torch.testing.assert_close(sweeps.decode_matmul_pass(packed, rows=rows)(),
                                   sweeps.decode_matmul_pass(model, rows=rows)(),
                                   rtol=1e-4, atol=1e-4)
    step = sweeps.decode_step_fn(model, [1, 2, 3], next_id=5)
    first, second = step(), step()
    assert first.shape == (1, 1, 64)
    torch.testing.assert_close(first, second)  # the cache is rewound: the same step again
    full = model(torch.tensor([[1, 2, 3, 5]]))[:, -1:]
    torch.testing.assert_close(first, full, rtol=1e-4, atol=1e-4)


def test_device_sweep_runs_all_three_on_the_cpu(fixed_timer):
    """The GPU section's code path, exercised on the CPU with the host's default threads."""
    out = sweeps.device_sweep("cpu", [4], {"w": (8, 4)}, [1, 2], cold_bytes=4 * 8 * 4 * 2)
    assert sorted(out) == ["gemm", "gemv", "tiny"]
    assert [r["n"] for r in out["gemm"]] == [4] and out["gemv"][0]["copies"] == 2
    assert out["gemv"][0]["layout"] == "out_in" and [r["n"] for r in out["tiny"]] == [1, 2]
    assert all(c["threads"] is None and c["device"] == "cpu" for c in fixed_timer)


def test_cpu_caches_reads_sysfs(tmp_path, monkeypatch):
    monkeypatch.delenv("LABKIT_CACHE_SIZES", raising=False)  # the override replaces sysfs (the test matrix sets it)
    for i, (level, kind, size) in enumerate([(1, "Data", "32K"), (1, "Instruction", "32K"),
                                              (2, "Unified", "1024K"), (3, "Unified", "32M")]):
        folder = tmp_path / "cpu0" / "cache" / f"index{i}"
        folder.mkdir(parents=True)
        (folder / "level").write_text(f"{level}\n")
        (folder / "type").write_text(f"{kind}\n")
        (folder / "size").write_text(f"{size}\n")
    assert sweeps.cpu_caches(root=str(tmp_path)) == {"L1": 32 * 2**10, "L2": 2**20, "L3": 32 * 2**20}
    assert sweeps.cpu_caches(root=str(tmp_path / "missing")) == {}


# -- find_step: a change of level in a timeline ------------------------------------------------

def _jitter(n, level, seed):
    g = torch.Generator().manual_seed(seed)
    return [level * (1 + 0.01 * float(v)) for v in torch.rand(n, generator=g)]


def test_find_step_finds_a_late_step_that_halves_miss():
    # 250 calls at 320 us, then 50 at 170 us: both halves' medians sit on the first level
    samples = [9e-4] + _jitter(249, 320e-6, 0) + _jitter(50, 170e-6, 1)
    step = sweeps.find_step(samples)
    assert step.found
    assert step.at == 251
    assert step.before_s == pytest.approx(320e-6, rel=0.02)
    assert step.after_s == pytest.approx(170e-6, rel=0.02)
    assert step.high < 1 / 1.2 and step.low <= step.ratio <= step.high
    assert sweeps.step_phrase(step).startswith("yes: from call 251 on, the calls took 17")
    assert sweeps.level_phrase(step, 340e-6, "the reference") == (
        f"{step.before_s / 340e-6:.2f}x the reference before the step and "
        f"{step.after_s / 340e-6:.2f}x after it")


def test_find_step_ignores_the_first_call_and_a_flat_run():
    samples = [5e-3] + _jitter(99, 300e-6, 2)  # a slow first call, then one level
    step = sweeps.find_step(samples)
    assert not step.found
    assert 2 <= step.at <= 100
    assert sweeps.step_phrase(step).startswith("no: the largest change of level (at call ")
    assert sweeps.level_phrase(step, 300e-6, "x") == f"{step.median_s / 300e-6:.2f}x x throughout"


def test_find_step_needs_a_change_beyond_min_change():
    # a 10% change is beyond the noise here but is not a step at min_change 0.2 ...
    samples = [1e-3] + _jitter(60, 100e-6, 3) + _jitter(60, 110e-6, 4)
    step = sweeps.find_step(samples)
    assert step.low > 1.0 and not step.found
    # ... and is one at min_change 0.05; a step up reads as a ratio above 1
    step = sweeps.find_step(samples, min_change=0.05)
    assert step.found and step.at == 62 and step.ratio == pytest.approx(1.1, rel=0.02)


def test_find_step_keeps_a_tenth_on_each_side_and_refuses_short_series():
    samples = [1e-3] + _jitter(95, 100e-6, 5) + _jitter(4, 300e-6, 6)  # 4 odd calls at the end
    step = sweeps.find_step(samples)
    assert step.at <= 1 + 99 - 10 + 1  # the after side keeps at least 10 calls
    with pytest.raises(ValueError):
        sweeps.find_step([1e-3] * 6)


def test_ratios_in_phrases_keep_small_values_readable():
    assert sweeps._times(0.004) == "0.004x"
    assert sweeps._times(0.54) == "0.54x"
    assert sweeps._times(162.0) == "162x"
    records = [{"name": "a", "speedup": 1.0, "speedup_low": 1.0, "speedup_high": 1.0},
               {"name": "a", "speedup": 0.004, "speedup_low": 0.003, "speedup_high": 0.005}]
    assert sweeps.slower_phrase(records) == "a (0.004x, 95% interval 0.003-0.005x)"


# -- the machine's caches in the chapter's facts ----------------------------------------------

def test_cold_pool_is_at_least_twice_the_last_level_cache():
    small = {"L1": 32 * 2**10, "L2": 2**20, "L3": 16 * 2**20}
    big = {"L1": 48 * 2**10, "L2": 2 * 2**20, "L3": 300 * 2**20}
    assert sweeps.cold_pool_bytes(64 * 2**20, small) == 64 * 2**20  # the floor already exceeds 2 x 16 MiB
    assert sweeps.cold_pool_bytes(64 * 2**20, big) == 600 * 2**20
    assert sweeps.cold_pool_bytes(64 * 2**20, big, factor=4) == 1200 * 2**20
    assert sweeps.cold_pool_bytes(64 * 2**20, {}) == 64 * 2**20  # no sizes: the floor


def test_cold_pool_reads_the_override(monkeypatch):
    monkeypatch.setenv("LABKIT_CACHE_SIZES", "L2=1MiB,L3=100MiB")
    assert sweeps.cold_pool_bytes(2**20) == 200 * 2**20


def test_cache_words_and_facts():
    caches = {"L1": 48 * 2**10, "L2": 2 * 2**20, "L3": 300 * 2**20}
    assert sweeps.cache_words(caches) == "48 KiB L1, 2 MiB L2, 300 MiB L3"
    assert sweeps.cache_words({}) == "sizes not readable here"
    assert sweeps.size_words(1.5 * 2**30) == "1.5 GiB" and sweeps.size_words(108 * 2**20) == "108 MiB"
    lm_head = 576 * 49152 * 4  # 108 MiB
    assert not sweeps.beyond_cache(lm_head, caches)  # a 300 MiB L3 holds it
    assert sweeps.beyond_cache(lm_head, {"L3": 32 * 2**20})
    assert not sweeps.beyond_cache(lm_head, {})  # unknown: the False sentence says so
    assert sweeps.llc_words(caches) == "this machine's 300 MiB last-level cache"
    assert "could not be read" in sweeps.llc_words({})
