"""Tables as a reader sees them: headers in words with units, no pandas row numbers.

A chapter keeps machine-friendly column names (``median_us``, ``tokens_per_s``) in its data
and its CSV files; only the displayed table is rewritten. :func:`readable_header` turns a
snake_case name into words and moves a trailing unit into brackets::

    readable_header("median_us")          # 'median (µs)'
    readable_header("decode_tok_s")       # 'decode (tokens/s)'
    readable_header("bits_per_parameter") # 'bits per parameter'

:class:`BookTable` is a DataFrame that displays that way. :meth:`Results.table` returns one,
and pandas operations on it (``round``, column selection, ``T``) keep the class, so the
last line of a cell shows a readable table. A plain 0..n-1 row index is not shown; a
meaningful index (one with a name or labels, e.g. after ``pivot_table``) is.
"""

from __future__ import annotations

import re

import pandas as pd

# Trailing name parts that are units, and how a reader writes them.
UNITS: dict[tuple[str, ...], str] = {
    ("tok", "s"): "tokens/s",
    ("tokens", "per", "s"): "tokens/s",
    ("tokens", "s"): "tokens/s",
    ("gb", "s"): "GB/s",
    ("gbs",): "GB/s",
    ("gflops",): "GFLOP/s",
    ("gflop", "s"): "GFLOP/s",
    ("tflops",): "TFLOP/s",
    ("s",): "s",
    ("ms",): "ms",
    ("us",): "µs",
    ("ns",): "ns",
    ("mb",): "MB",
    ("mib",): "MiB",
    ("kb",): "kB",
    ("kib",): "KiB",
    ("gb",): "GB",
    ("gib",): "GiB",
    ("pct",): "%",
    ("percent",): "%",
    ("x",): "×",
}

# Words that are acronyms or names with a fixed spelling.
SPELLING: dict[str, str] = {
    "ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "kv": "KV", "gemm": "GEMM", "gemv": "GEMV",
    "gpu": "GPU", "cpu": "CPU", "fp32": "fp32", "bf16": "bf16", "fp16": "fp16", "lm": "LM",
    "mlp": "MLP", "sdpa": "SDPA", "rope": "RoPE", "rmsnorm": "RMSNorm", "id": "ID", "ids": "IDs",
    "gguf": "GGUF", "hf": "HF", "eos": "EOS", "flops": "FLOPs", "gflop": "GFLOP", "utf8": "UTF-8",
    "p50": "p50", "p90": "p90", "p95": "p95", "p99": "p99",
}

_SNAKE = re.compile(r"^[a-z0-9]+(_[a-z0-9]+)+$|^[a-z0-9]+$")


def readable_header(name) -> str:
    """A column name as words, with a trailing unit in brackets. Names that are not
    snake_case (they already have spaces, capitals or brackets) are returned unchanged."""
    if not isinstance(name, str) or not _SNAKE.match(name):
        return name if isinstance(name, str) else str(name)
    parts = name.split("_")
    unit = None
    for suffix, text in sorted(UNITS.items(), key=lambda item: -len(item[0])):
        whole_name_ok = len(suffix) > 1  # "tokens_per_s" is a unit by itself; "s" is not
        if (len(parts) > len(suffix) or (whole_name_ok and len(parts) == len(suffix))) \
                and tuple(parts[-len(suffix):]) == suffix:
            unit, parts = text, parts[:-len(suffix)]
            break
    words = " ".join(SPELLING.get(part, part) for part in parts)
    if unit and not words:
        return unit
    return f"{words} ({unit})" if unit else words


def _has_plain_index(df: pd.DataFrame) -> bool:
    index = df.index
    return (isinstance(index, pd.RangeIndex) and index.name is None
            and index.start == 0 and index.step == 1)


def readable(df: pd.DataFrame) -> pd.DataFrame:
    """A copy of ``df`` with readable column headers (every level) and index names."""
    out = pd.DataFrame(df).copy()
    if isinstance(out.columns, pd.MultiIndex):
        out.columns = pd.MultiIndex.from_tuples(
            [tuple(readable_header(v) for v in col) for col in out.columns],
            names=[readable_header(n) if n else n for n in out.columns.names])
    else:
        out.columns = [readable_header(c) for c in out.columns]
        if out.columns.name:
            out.columns.name = readable_header(out.columns.name)
    out.index.names = [readable_header(n) if n else n for n in out.index.names]
    return out


def table_html(df: pd.DataFrame) -> str:
    """The HTML a chapter shows for ``df``: readable headers; the row index only when it
    carries information."""
    shown = readable(df)
    return shown.to_html(index=not _has_plain_index(df), notebook=True, border=0,
                         max_rows=pd.get_option("display.max_rows"))


class BookTable(pd.DataFrame):
    """A DataFrame that displays with :func:`table_html`; pandas operations keep the class."""

    @property
    def _constructor(self):
        return BookTable

    def _repr_html_(self) -> str:
        return table_html(self)


def book_table(df: pd.DataFrame) -> BookTable:
    """``df`` as a :class:`BookTable` (same data, no copy of the values' meaning)."""
    return df if isinstance(df, BookTable) else BookTable(df)


__all__ = ["UNITS", "SPELLING", "readable_header", "readable", "table_html", "BookTable",
           "book_table"]
