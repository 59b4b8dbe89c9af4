"""labkit.experiments.attention_cost: formulas, sweep records, and measured memory that can fail."""

import json
import subprocess
import sys

import pytest
import torch

from labkit.experiments.attention_cost import (MHA12, SMOLLM2, AttentionShape, agreement,
                                               attention_inputs, default_schedule, formula_bytes,
                                               measure_attention, naive_peak_model, sdpa_enable_gqa,
                                               sweep, ulp)
from labkit.kernels.attention import naive_attention, sdpa_attention

MiB, GiB = 2**20, 2**30


def test_formula_bytes_closed_form():
    sizes = formula_bytes(MHA12, 1024, 1024, torch.float32)
    assert sizes["score"] == 12 * 1024 * 1024 * 4 == 48 * MiB
    assert sizes["score_softmax"] == 2 * sizes["score"]
    assert sizes["output"] == 12 * 1024 * 64 * 4
    assert sizes["kv"] == 2 * 12 * 1024 * 64 * 4
    gqa = formula_bytes(SMOLLM2, 1, 4096, torch.bfloat16)
    assert gqa["score"] == 9 * 4096 * 2 and gqa["kv"] == 2 * 3 * 4096 * 64 * 2


def test_source_figure_6_gib():
    """The source's figure: 16,384 tokens, 12 heads, fp16 -> 6.0 GiB per score tensor."""
    assert formula_bytes(MHA12, 16384, 16384, torch.float16)["score"] == 6 * GiB


def test_naive_peak_model():
    shape = AttentionShape("t", batch=2, heads=4, kv_heads=2, head_dim=8)
    n, mask = 2 * 4 * 10 * 10, 2 * 10 * 10  # scores; a [group * q_len, kv_len] bool mask
    assert naive_peak_model(shape, 10, 10, torch.float32) == 8 * n + 2 * mask
    assert naive_peak_model(shape, 10, 10, torch.bfloat16) == 10 * n + mask
    assert naive_peak_model(shape, 1, 10, torch.float32) == 8 * 2 * 4 * 10 + 2 * 2 * 10


def test_inputs_are_seeded_and_shaped():
    q, k, v = attention_inputs(2, 9, 3, 5, 7, 16, torch.bfloat16, seed=3)
    assert q.shape == (2, 9, 5, 16) and k.shape == v.shape == (2, 3, 7, 16)
    assert q.dtype == torch.bfloat16
    again = attention_inputs(2, 9, 3, 5, 7, 16, torch.float32, seed=3)
    assert torch.equal(q, again[0].to(torch.bfloat16))


def test_schedule_repeats_less_when_long_but_never_below_three():
    assert default_schedule(256) == (1, 5) and default_schedule(8192) == (0, 3)
    assert all(default_schedule(n)[1] >= 3 for n in (16, 1024, 2048, 4096, 8192, 65536))


def test_sweep_records_keys_and_formulas():
    records = sweep([32, 64], ["naive", "sdpa"], SMOLLM2, mode="prefill", repeats=2, warmup=0)
    assert [(r["impl"], r["kv_len"]) for r in records] == [
        ("naive", 32), ("sdpa", 32), ("naive", 64), ("sdpa", 64)]
    for r in records:
        for key in ("median_s", "spread", "peak_rss_bytes", "peak_bytes", "formula_bytes",
                    "formula_softmax_bytes", "kv_gb_per_s", "repeats", "threads"):
            assert key in r
        assert r["q_len"] == r["kv_len"] and r["mode"] == "prefill" and r["repeats"] == 2
        assert r["formula_bytes"] == 9 * r["kv_len"] ** 2 * 4
        assert r["median_s"] > 0 and r["peak_bytes"] >= 0 and r["skipped"] is None


def test_decode_sweep_is_one_query():
    (rec,) = sweep([128], ["sdpa"], MHA12, mode="decode", repeats=2, warmup=0)
    assert rec["q_len"] == 1 and rec["kv_len"] == 128 and rec["mode"] == "decode"
    assert rec["formula_bytes"] == 12 * 128 * 4
    assert rec["kv_gb_per_s"] == pytest.approx(rec["kv_bytes"] / rec["median_s"] / 1e9)


def test_bad_names_are_refused():
    with pytest.raises(ValueError):
        measure_attention("flash", SMOLLM2, 8)
    with pytest.raises(ValueError):
        sweep([8], ["naive"], SMOLLM2, mode="chunked")


def test_oversized_run_is_skipped_not_attempted():
    huge = AttentionShape("huge", batch=64, heads=64, kv_heads=64, head_dim=64)
    rec = measure_attention("naive", huge, 65536)  # ~8 TiB of scores: never allocated
    assert rec["skipped"] and rec["median_s"] is None and rec["peak_bytes"] is None


def measured_in_a_fresh_process(kind: str) -> dict:
    """`measure_attention` run by a new interpreter: the peak is read as growth of the
    process's resident memory, and in this process memory that earlier tests freed but the
    C heap kept could serve the score tensor without any growth (it once did). A call on 16
    tokens first sets up what any first call does (threads, operator tables: about 10 MB),
    which is not the attention's memory."""
    code = ("import json; from labkit.experiments.attention_cost import MHA12, measure_attention; "
            f"measure_attention({kind!r}, MHA12, 16, repeats=1, warmup=1); "
            f"print(json.dumps(measure_attention({kind!r}, MHA12, 1024, repeats=2, warmup=1)))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_naive_peak_memory_covers_the_score_tensor_and_sdpa_does_not():
    """1 x 12 heads x 1024^2 fp32 = 48 MiB per score tensor: naive attention must hold at
    least one (it holds two), fused SDPA far less (its output is 3 MiB)."""
    naive, fused = measured_in_a_fresh_process("naive"), measured_in_a_fresh_process("sdpa")
    assert naive["formula_bytes"] == 48 * MiB
    assert naive["peak_rss_bytes"] >= naive["formula_bytes"]
    assert naive["peak_rss_bytes"] <= 1.1 * naive["naive_model_bytes"]  # two tensors + masks
    assert fused["peak_rss_bytes"] < naive["formula_bytes"] / 4
    # and not vacuously: a fused call holds at least its output, or nothing was measured
    assert fused["peak_seen"] and fused["peak_rss_bytes"] >= fused["output_bytes"]


def test_enable_gqa_path_matches_labkit_sdpa():
    for q_len, kv_len in [(16, 16), (1, 16), (5, 16)]:
        q, k, v = attention_inputs(1, 9, 3, q_len, kv_len, 16)
        assert torch.allclose(sdpa_enable_gqa(q, k, v), sdpa_attention(q, k, v), atol=1e-6)
        q, k, v = attention_inputs(1, 4, 4, q_len, kv_len, 16)
        assert torch.allclose(sdpa_enable_gqa(q, k, v), naive_attention(q, k, v), atol=1e-6)


def test_ulp():
    assert ulp(1.0, torch.float32) == torch.finfo(torch.float32).eps
    assert ulp(3.0, torch.bfloat16) == 2 * 2**-7


def test_agreement_passes_and_can_fail():
    rows = agreement(SMOLLM2, [16, 64], [torch.float32, torch.bfloat16])
    assert len(rows) == 4 and all(r["passed"] for r in rows)
    assert all(r["max_abs_diff"] <= r["tolerance"] for r in rows)
    # an implementation that forgets the causal mask must fail the same check
    from labkit.experiments import attention_cost

    attention_cost.IMPLEMENTATIONS["unmasked"] = lambda q, k, v, causal=True: naive_attention(
        q, k, v, causal=False)
    try:
        bad = agreement(SMOLLM2, [16], [torch.float32], impls=("naive", "unmasked"))
    finally:
        del attention_cost.IMPLEMENTATIONS["unmasked"]
    assert not bad[0]["passed"]


def test_frames_speedups_and_plots_draw():
    import matplotlib

    matplotlib.use("Agg")
    from labkit.experiments.attention_cost import (last_level_cache_bytes, plot_decode_bandwidth,
                                                   plot_memory, plot_ratios, plot_times,
                                                   records_frame, speedups)
    from labkit.book.style import new_figure

    df = records_frame(sweep([32, 64], ["naive", "sdpa"], MHA12, repeats=1, warmup=0))
    assert list(df["length"]) == [32, 32, 64, 64]
    assert df["peak_over_formula"].tolist() == pytest.approx(
        (df["peak_bytes"] / df["formula_bytes"]).tolist())
    ratios = speedups(df)
    assert len(ratios) == 2 and set(ratios["impl"]) == {"sdpa"}
    naive = df[df["impl"] == "naive"]["median_s"].tolist()
    fused = df[df["impl"] == "sdpa"]["median_s"].tolist()
    assert ratios["ratio"].tolist() == pytest.approx([a / b for a, b in zip(naive, fused)])
    dec = records_frame(sweep([64], ["sdpa"], SMOLLM2, mode="decode", repeats=1, warmup=0))
    fig, axes = new_figure(2, 2)
    plot_memory(axes[0, 0], df)
    plot_times(axes[0, 1], df)
    plot_ratios(axes[1, 0], ratios)
    plot_decode_bandwidth(axes[1, 1], dec, last_level_cache_bytes())
    assert axes[0, 1].get_xscale() == "log" and len(axes[0, 1].lines) == 2
    import matplotlib.pyplot as plt

    plt.close(fig)


def test_formula_table():
    from labkit.experiments.attention_cost import formula_table

    table = formula_table([MHA12, SMOLLM2], [16384], [torch.float16, torch.float32])
    assert table.columns.tolist() == ["shape", "length", "float16", "float32"]
    assert table["float16"].tolist() == [6.0, 4.5] and table["float32"].tolist() == [12.0, 9.0]


def test_largest_complete_length_skips_a_length_with_a_skipped_run():
    import pandas as pd

    from labkit.experiments.attention_cost import largest_complete_length

    df = pd.DataFrame({"length": [256, 256, 512, 512, 1024, 1024],
                       "impl": ["naive", "sdpa"] * 3,
                       "skipped": [None, None, None, None, "needs about 6.6 GiB", None]})
    assert largest_complete_length(df) == 512  # naive skipped at 1,024: not a complete length
    df["skipped"] = None
    assert largest_complete_length(df) == 1024
    df["skipped"] = "no memory"
    with pytest.raises(ValueError):
        largest_complete_length(df)


def test_rate_fall_finds_where_the_rate_reached_its_large_size_level():
    from labkit.experiments.attention_cost import rate_fall

    sizes = [1.5, 3, 96, 192, 384, 768]  # MiB; the shape of chapter 8's decode sweep
    rates = [37.8, 26.8, 24.6, 12.2, 11.9, 11.9]
    assert rate_fall(sizes, rates) == 192  # 12.2 is within 15% of 11.9, 24.6 is not
    assert rate_fall(list(reversed(sizes)), list(reversed(rates))) == 192  # order-free
    assert rate_fall(sizes, rates, within=0.01) == 384
    assert rate_fall(sizes, [12.0] * 6) == 1.5  # no fall: the smallest size
    assert rate_fall(sizes, [12, 30, 12, 12, 12, 12]) == 96  # a bump in between ends it


def test_closer_phrase_names_only_a_consistent_winner():
    from labkit.experiments.attention_cost import closer_phrase

    assert closer_phrase([1.58, 1.49, 1.77]) == "SDPA was closer in every row, by 1.5 to 1.8 times"
    assert closer_phrase([0.5, 0.6]) == ("naive attention was closer in every row, by 1.7 to "
                                         "2.0 times")
    mixed = closer_phrase([0.94, 1.12, 1.05])
    assert mixed.startswith("neither was closer") and "0.94 to 1.12" in mixed
    assert closer_phrase([1.3, 1.1]).startswith("neither")  # one row within the margin


def test_fused_peak_after_a_naive_run_is_seen_in_the_same_process():
    """The failure chapter 8 once recorded: after naive attention freed its score tensors,
    SDPA's output came from heap pages the process still held, and every fused peak read
    0.0 MiB (less than the call's own 3 MiB output). With the heap's free pages released
    first, the high-water mark must see at least the output, and agree with a fresh
    process (the independent reference: nothing freed before it) within a few MiB."""
    # freeing 3 MiB inputs (mmapped) raises glibc's mmap threshold: smaller blocks come from its heap
    measure_attention("naive", MHA12, 1024, repeats=1, warmup=1)
    # what a long sweep leaves behind: freed heap chunks, still resident, below a live one
    chunks = [torch.ones(MiB // 2) for _ in range(24)]  # 2 MiB each: heap, written
    keep = chunks.pop()
    del chunks
    after_naive = measure_attention("sdpa", MHA12, 1024, repeats=1, warmup=1)
    del keep
    assert after_naive["memory_method"].startswith("high-water mark")
    assert after_naive["peak_seen"] and after_naive["peak_bytes"] >= after_naive["output_bytes"]
    fresh = measured_in_a_fresh_process("sdpa")
    assert fresh["peak_seen"]
    assert abs(after_naive["peak_bytes"] - fresh["peak_bytes"]) <= 4 * MiB


def test_a_peak_below_the_output_is_not_a_number():
    from labkit.experiments.attention_cost import records_frame

    (rec,) = sweep([64], ["sdpa"], MHA12, repeats=3, warmup=0)
    seen, unseen = dict(rec), dict(rec, peak_bytes=0, peak_rss_bytes=0, peak_seen=False)
    df = records_frame([seen, unseen])
    assert df["peak_mib"].iloc[0] == pytest.approx(seen["peak_bytes"] / MiB)
    assert df["peak_mib"].isna().tolist() == [False, True]
    assert df["peak_bytes"].isna().tolist() == [False, True]


def test_bf16_instruction_phrase_reads_the_flags():
    from labkit.experiments.attention_cost import bf16_instruction_phrase, sixteen_bit_arithmetic

    xeon = ["avx2", "f16c", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16"]
    assert sixteen_bit_arithmetic(xeon) == {"bfloat16": ["AVX512-BF16", "AMX-BF16"],
                                            "float16": ["AVX512-FP16"]}
    native, text = bf16_instruction_phrase(xeon)
    assert native and "has arithmetic instructions (AVX512-BF16, AMX-BF16)" in text
    assert "float16 (AVX512-FP16)" in text
    native, text = bf16_instruction_phrase(["avx2", "fma", "f16c"])  # F16C only converts
    assert not native and "no arithmetic instructions" in text and "float16" not in text
    native, text = bf16_instruction_phrase(["avx512f", "avx512_bf16"])
    assert native and "float16" not in text


def test_interleaved_attention_takes_turns(monkeypatch):
    """The decode verdicts compare calls timed in turns: A, B, A, B, ..., never all of A
    first. Recording implementations stand in for the real ones."""
    from labkit.experiments import attention_cost

    order = []
    for name in ("naive", "sdpa"):
        monkeypatch.setitem(attention_cost.IMPLEMENTATIONS, name,
                            lambda q, k, v, name=name: order.append(name))
    got = attention_cost.interleaved_attention([("naive", MHA12), ("sdpa", SMOLLM2)], 1, 16,
                                               rounds=3, warmup=1)
    assert order == ["naive", "sdpa"] + ["naive", "sdpa"] * 3
    assert sorted(got) == [f"naive, {MHA12.name}", f"sdpa, {SMOLLM2.name}"]
    assert all(len(samples) == 3 and min(samples) > 0 for samples in got.values())
    with pytest.raises(ValueError, match="unknown implementation"):
        attention_cost.interleaved_attention([("flash", MHA12)], 1, 16, rounds=3)


def test_time_ratio_words_let_the_samples_pick_the_winner():
    from labkit.experiments.attention_cost import time_ratio_words

    slow, fast = [2.0, 2.1, 1.9, 2.05, 1.95], [1.0, 1.05, 0.95, 1.02, 0.98]
    c, words = time_ratio_words(slow, fast)
    assert c.ratio == pytest.approx(2.0) and words.endswith("SDPA was faster")
    assert words.startswith("naive attention took 2.00 times as long as SDPA (95% interval")
    c, words = time_ratio_words(fast, slow)  # the "slow" name was the faster one
    assert c.ratio == pytest.approx(0.5) and words.endswith("naive attention was faster")
    _, words = time_ratio_words([1.0, 1.1, 0.9, 1.05], [1.02, 0.92, 1.08, 0.97])
    assert words.endswith("a tie within the noise")


def test_skipped_baseline_gives_no_ratio_and_no_number_in_the_table():
    """At 16,384 tokens naive attention is refused (memory) while SDPA runs: no ratio is made
    of the missing baseline, and the peak table says "not run", distinct from a failed
    measurement."""
    import pandas as pd
    from labkit.experiments.attention_cost import peak_cells, records_frame, speedups

    ran = measure_attention("sdpa", MHA12, 32, repeats=1, warmup=0)
    refused = measure_attention("naive", MHA12, 32, memory_fraction=0.0)
    unseen = dict(ran, peak_seen=False)
    df = records_frame([refused, ran])
    assert speedups(df).empty
    cells = list(peak_cells(records_frame([refused, ran, unseen])))
    assert cells[0].startswith("not run") and cells[2].startswith("not seen")
    assert float(cells[1]) == pytest.approx(ran["peak_bytes"] / MiB, abs=0.05)
    assert not pd.isna(ran["faults_per_call"]) and len(ran["samples_s"]) == 1


def test_fresh_memory_every_call_shows_in_the_faults_per_call(monkeypatch):
    """`faults_per_call` counts the pages a call maps in: a call that writes 64 MiB mapped
    fresh each time (above glibc's mmap threshold, so unmapped again on free) faults at
    least once per 2 MiB even with huge pages; a call that allocates nothing does not."""
    from labkit.experiments import attention_cost

    monkeypatch.setitem(attention_cost.IMPLEMENTATIONS, "naive",
                        lambda q, k, v, causal=True: torch.ones(16 * MiB).sum())
    monkeypatch.setitem(attention_cost.IMPLEMENTATIONS, "sdpa", lambda q, k, v, causal=True: q)
    fresh = measure_attention("naive", MHA12, 8, repeats=4, warmup=1)
    idle = measure_attention("sdpa", MHA12, 8, repeats=4, warmup=1)
    assert fresh["faults_per_call"] >= 32 > idle["faults_per_call"]


def test_a_series_keeps_its_colour_whatever_else_is_drawn():
    import pandas as pd
    from labkit.experiments import attention_cost

    def colours(pairs):
        df = pd.DataFrame([{"shape_name": s, "impl": i, "length": 1} for s, i in pairs])
        return {label: colour for _, label, _, _, colour in attention_cost.series_styles(df)}

    every = colours([(SMOLLM2.name, "naive"), (SMOLLM2.name, "sdpa"),
                     (SMOLLM2.name, "sdpa_gqa"), (MHA12.name, "naive"), (MHA12.name, "sdpa")])
    fewer = colours([(MHA12.name, "naive"), (SMOLLM2.name, "sdpa_gqa")])
    assert all(every[label] == colour for label, colour in fewer.items())
    assert len(set(every.values())) == 5
