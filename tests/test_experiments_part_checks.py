"""The baseline's thread comparison, its memory-rate verdict and read size, and the near-tie rule of the loop check (labkit.experiments.part_checks),
on synthetic samples (the interleaving of the baseline runs the model)."""

import pytest
import torch

from labkit.experiments import part_checks as checks


def _row(scale: float, jitter: float = 0.01) -> dict:
    offsets = [0.0, jitter, -jitter, 2 * jitter, -2 * jitter]
    return {f"{stage}_samples_s": [scale * (1 + o) for o in offsets]
            for stage in checks.BASELINE_STAGES}


def test_thread_comparisons_ratio_is_the_speedup_of_two_threads():
    out = checks.thread_comparisons(_row(2.0), _row(1.0))  # two threads take half the time
    assert set(out) == set(checks.BASELINE_STAGES)
    for comparison in out.values():
        assert comparison.ratio == pytest.approx(2.0)
        assert comparison.verdict == "faster"


def test_thread_comparisons_calls_a_tie_within_the_noise_and_a_loss_slower():
    tie = checks.thread_comparisons(_row(1.0, jitter=0.05), _row(1.01, jitter=0.05))
    assert all(c.verdict == "within the noise" for c in tie.values())
    loss = checks.thread_comparisons(_row(1.0), _row(1.2))
    assert all(c.verdict == "slower" for c in loss.values())


def test_thread_comparisons_takes_extra_stages():
    one, two = _row(1.0), _row(0.5)
    one["memory_read_samples_s"], two["memory_read_samples_s"] = [1.0, 1.1, 0.9], [1.0, 1.1, 0.9]
    out = checks.thread_comparisons(one, two, stages=("memory_read",))
    assert list(out) == ["memory_read"] and out["memory_read"].verdict == "within the noise"


def test_memory_rate_verdict():
    assert "close to the memory's rate" in checks.memory_rate_verdict(9.0, 10.0)
    assert "did not set" in checks.memory_rate_verdict(3.0, 10.0)
    assert "did not set" in checks.memory_rate_verdict(7.9, 10.0)
    with pytest.raises(ValueError):
        checks.memory_rate_verdict(0.0, 10.0)


def test_comparison_rows():
    out = checks.thread_comparisons(_row(2.0), _row(1.0))
    rows = checks.comparison_rows(out, labels={"request": "whole request"})
    assert [r["stage"] for r in rows] == ["whole request", "prefill", "decode_step"]
    assert rows[0]["speedup_x"] == 2.0 and rows[0]["verdict"] == "faster"
    low, high = map(float, rows[0]["95% interval"].split("-"))
    assert low <= 2.0 <= high


def test_memory_read_bytes_is_four_caches_within_bounds():
    MiB = 2**20
    assert checks.memory_read_bytes(32 * MiB) == 256 * MiB       # a 32 MiB L3: the floor
    assert checks.memory_read_bytes(100 * MiB) == 400 * MiB      # 100 MiB: four times it
    assert checks.memory_read_bytes(300 * MiB) == 2**30           # 300 MiB: the ceiling
    assert checks.memory_read_bytes(16 * 2**30) == 2**30         # the ceiling
    assert checks.memory_read_bytes(None) == 256 * MiB           # unknown: the floor
    assert checks.memory_read_bytes(1_000_003) % 4 == 0


class _Table:
    """Logits [1, seq, vocab]: row k after the prompt is table[k] (earlier positions: row 0)."""

    def __init__(self, table, prompt_len, wrap=False):
        self.table, self.prompt_len, self.wrap = torch.as_tensor(table), prompt_len, wrap

    def __call__(self, ids):
        rows = [self.table[max(0, min(i - self.prompt_len + 1, len(self.table) - 1))]
                for i in range(ids.shape[1])]
        out = torch.stack(rows)[None]
        return type("Out", (), {"logits": out})() if self.wrap else out


def test_greedy_paths_agree_excuses_a_near_tie_and_fails_a_wide_divergence():
    table = [[0.0, 3.0, 1.0], [0.0, 2.0, 2.0001], [4.0, 0.0, 0.0]]
    reference = _Table(table, prompt_len=2, wrap=True)
    nudged = torch.tensor(table)
    nudged[1, 1] += 1e-4  # our rounding: step 1's near-tie goes the other way
    nudged[1, 2] -= 1e-4
    model = _Table(nudged, prompt_len=2)
    same = checks.greedy_paths_agree(model, reference, [7, 8], [1, 2, 0], [1, 2, 0])
    assert same.exact and same.ok
    flip = checks.greedy_paths_agree(model, reference, [7, 8], [1, 1, 0], [1, 2, 0])
    assert flip.ok and flip.excused and flip.diverged_at == 1
    assert flip.tolerance == pytest.approx(2e-4, rel=1e-3)
    # the same flip where the two backends' logits agree exactly: tolerance 0, so it fails
    exact = checks.greedy_paths_agree(_Table(table, prompt_len=2), reference, [7, 8], [1, 1, 0], [1, 2, 0])
    assert not exact.ok and exact.tolerance == 0.0
    wide = checks.greedy_paths_agree(model, reference, [7, 8], [2, 2, 0], [1, 2, 0])
    assert not wide.ok and wide.diverged_at == 0


class _CachedTable(_Table):
    """A `_Table` with a KV cache: through the cache (prefill, then one token per call, as the
    loop computes) its rows are `cached_table`'s, while one pass gives `table`'s."""

    def __init__(self, table, cached_table, prompt_len):
        super().__init__(table, prompt_len)
        self.cached = _Table(cached_table, prompt_len)

    def new_cache(self, batch=1, max_len=0):
        return {"length": 0}

    def __call__(self, ids, cache=None):
        if cache is None:
            return super().__call__(ids)
        start = cache["length"]
        cache["length"] += ids.shape[1]
        full = torch.zeros(1, cache["length"], dtype=torch.long)  # positions 0..length-1
        return self.cached(full)[:, start:]


def test_greedy_paths_agree_measures_the_tolerance_on_the_cached_path_too():
    # one pass bit-identical to the reference, the cached path 1e-4 off: the loop's tokens come
    # from the cached path, so its near-tie flip is excused (a one-pass tolerance would be 0)
    table = [[0.0, 3.0, 1.0], [0.0, 2.0, 2.0001], [4.0, 0.0, 0.0]]
    reference = _Table(table, prompt_len=2, wrap=True)
    nudged = torch.tensor(table)
    nudged[1, 1] += 1e-4
    nudged[1, 2] -= 1e-4
    model = _CachedTable(table, nudged, prompt_len=2)
    flip = checks.greedy_paths_agree(model, reference, [7, 8], [1, 1, 0], [1, 2, 0])
    assert flip.ok and flip.excused and flip.tolerance == pytest.approx(2e-4, rel=1e-3)
    # a divergence wider than the cached path's difference still fails
    wide = checks.greedy_paths_agree(model, reference, [7, 8], [2, 2, 0], [1, 2, 0])
    assert not wide.ok


def test_weight_stream_share_is_the_rate_ratio_with_its_interval():
    step = [0.020, 0.0202, 0.0198, 0.0204, 0.0196]   # s per decode step
    read = [0.040, 0.0404, 0.0396, 0.0408, 0.0392]   # s per sum over the read buffer
    row = {"decode_step_samples_s": step, "memory_read_samples_s": read}
    # 500 MB in 20 ms is 25 GB/s; 1,000 MB in 40 ms is 25 GB/s: the share is 1
    share, low, high = checks.weight_stream_share(row, 500_000_000, 1_000_000_000)
    assert share == pytest.approx(1.0)
    assert low <= share <= high and high - low < 0.1
    half, _, _ = checks.weight_stream_share(row, 250_000_000, 1_000_000_000)
    assert half == pytest.approx(0.5)


def test_memory_rate_verdict_with_an_interval_across_the_line_cannot_tell():
    assert "cannot say" in checks.memory_rate_verdict(7.9, 10.0, interval=(0.76, 0.82))
    assert "did not set" in checks.memory_rate_verdict(7.9, 10.0, interval=(0.76, 0.79))
    assert "close to the memory's rate" in checks.memory_rate_verdict(8.1, 10.0,
                                                                      interval=(0.80, 0.84))
    with pytest.raises(ValueError):
        checks.memory_rate_verdict(8.0, 10.0, interval=(0.9, 0.7))


def test_interleaved_baselines_alternate_thread_counts_round_by_round(model):
    # A drift of the machine's speed must fall on both thread counts: the requests (and the
    # extra call after each) must alternate 1, 2, 1, 2, ..., never all of 1 and then 2.
    from labkit.engine.loop import generate

    order = []

    def loop(m, prompt, params):
        order.append(("request", torch.get_num_threads()))
        return generate(m, prompt, params)

    def read():
        order.append(("read", torch.get_num_threads()))

    rows = checks.interleaved_baselines(model, "The capital of France is", threads=(1, 2), new_tokens=2,
                                        rounds=3, warmup=1, loop=loop, extras={"memory_read": read},
                                        extra_repeats=2)
    one_round = [("request", 1), ("read", 1), ("read", 1), ("request", 2), ("read", 2), ("read", 2)]
    assert order == one_round * 4  # the warm-up round, then three timed rounds
    assert [r["threads"] for r in rows] == [1, 2]
    for row in rows:
        assert row["new_tokens"] == 2 and row["repeats"] == 3
        assert len(row["request_samples_s"]) == len(row["decode_step_samples_s"]) == 3
        assert len(row["memory_read_samples_s"]) == 6  # the warm-up round's reads are not kept
    with pytest.raises(ValueError, match="at least 3 rounds"):
        checks.interleaved_baselines(model, "x", rounds=2)
