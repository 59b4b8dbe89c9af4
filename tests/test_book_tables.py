"""Readable table headers and the hidden 0..n-1 index (labkit.book.tables)."""

import pandas as pd
import pytest

from labkit.book.results import Results
from labkit.book.tables import BookTable, readable_header, table_html


@pytest.mark.parametrize("name, shown", [
    ("median_us", "median (µs)"),
    ("request_s", "request (s)"),
    ("one_thread_s", "one thread (s)"),
    ("decode_tok_s", "decode (tokens/s)"),
    ("tokens_per_s", "tokens/s"),
    ("bits_per_parameter", "bits per parameter"),
    ("kv_bytes_per_token", "KV bytes per token"),
    ("ttft_ms", "TTFT (ms)"),
    ("bandwidth_gb_s", "bandwidth (GB/s)"),
    ("speedup", "speedup"),
    ("s", "s"),                       # a lone unit-like name is left alone
    ("share (%)", "share (%)"),       # already readable: unchanged
    ("Tokens", "Tokens"),
])
def test_readable_header(name, shown):
    assert readable_header(name) == shown


def test_plain_index_hidden_meaningful_index_kept():
    df = pd.DataFrame({"median_us": [1.0, 2.0], "name": ["a", "b"]})
    html = table_html(df)
    assert "<th>median (µs)</th>" in html and "median_us" not in html
    assert "<th>0</th>" not in html  # no row numbers
    labelled = df.set_index("name")
    assert "<th>a</th>" in table_html(labelled)  # a named index carries information


def test_results_table_returns_a_book_table_and_keeps_csv_names(tmp_path):
    (tmp_path / "_config.yml").write_text("title: t\n")
    res = Results("ch01", profile="ci", root=tmp_path, glue_values=False)
    shown = res.table(pd.DataFrame({"median_us": [1.23456]}), "t")
    assert isinstance(shown, BookTable) and isinstance(shown.round(2), BookTable)
    assert "1.23" in shown.round(2)._repr_html_()
    assert (res.dir / "t.csv").read_text().splitlines()[0] == "median_us"
