"""Which machine a figure was made on: caches, instruction sets, measured memory bandwidth.

The book's figures are measured on whatever machine runs them: an AVX2 laptop, a Xeon with
AVX-512 and AMX and 300 MiB of L3, Colab. What fits in a cache, which kernel runs and how
fast memory is differ between them, so every record names them and every chapter prints
one line (:func:`machine_line`) saying where its numbers come from.

- :func:`cpu_caches`: the data caches one core sees, by level, in bytes (Linux sysfs).
- :func:`isa_flags`: the vector extensions that decide which kernels run (AVX2, AVX-512,
  BF16, AMX, VNNI ...), as the kernel reports them.
- :func:`memory_read_gb_s`: a measured read rate from main memory (a buffer four times the
  last-level cache, summed), once per process.

A test or a reader can pretend to be another machine: ``LABKIT_CACHE_SIZES="L2=1MiB,L3=32MiB"``
replaces the sizes read from sysfs (every chapter that reasons about what fits in a cache
reads them here), so a check can be run with the machine fact flipped.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path
from typing import Any

CACHE_SIZES_ENV = "LABKIT_CACHE_SIZES"
_SYSFS_CPU = "/sys/devices/system/cpu"
_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}

# /proc/cpuinfo flag -> how the book names it; in the order the line prints them
ISA_NAMES = {
    "sse4_2": "SSE4.2", "avx": "AVX", "avx2": "AVX2", "fma": "FMA", "f16c": "F16C",
    "avx_vnni": "AVX-VNNI", "avx512f": "AVX-512", "avx512_vnni": "AVX512-VNNI",
    "avx512_bf16": "AVX512-BF16", "avx512_fp16": "AVX512-FP16", "amx_tile": "AMX",
    "amx_bf16": "AMX-BF16", "amx_int8": "AMX-INT8", "asimd": "NEON", "sve": "SVE",
}

# the few the one-line summary names: what decides which of the book's kernels can run
LINE_ISA = (("AVX2", {"avx2"}), ("AVX-512", {"avx512f"}), ("VNNI", {"avx512_vnni", "avx_vnni"}),
            ("AVX512-BF16", {"avx512_bf16"}), ("AMX", {"amx_bf16", "amx_int8"}), ("NEON", {"asimd"}),
            ("SVE", {"sve"}))

_state: dict[str, Any] = {}


def parse_size(text: str) -> int:
    """'32768K', '300 MiB', '2 MB', '48K' -> bytes (binary units, as Linux reports them)."""
    match = re.fullmatch(r"\s*([0-9.]+)\s*([KMG]?)(?:i?B)?\s*", str(text), re.IGNORECASE)
    if not match:
        raise ValueError(f"not a size: {text!r}")
    return int(float(match.group(1)) * _UNITS[match.group(2).upper()])


def _override() -> dict[str, int] | None:
    text = os.environ.get(CACHE_SIZES_ENV, "").strip()
    if not text:
        return None
    sizes: dict[str, int] = {}
    for part in text.split(","):
        level, equals, size = part.partition("=")
        if not equals or not re.fullmatch(r"L[1-4]", level.strip()):
            raise ValueError(f"{CACHE_SIZES_ENV}: {part!r} is not LEVEL=SIZE (e.g. L3=32MiB)")
        sizes[level.strip()] = parse_size(size)
    return sizes


def cpu_caches(cpu: int = 0, root: str = _SYSFS_CPU) -> dict[str, int]:
    """Sizes in bytes of the data (or unified) caches CPU `cpu` uses, one instance each:
    e.g. ``{"L1": 49152, "L2": 2097152, "L3": 314572800}``; ``{}`` where sysfs has no cache
    information (another OS, some containers). ``$LABKIT_CACHE_SIZES`` replaces them."""
    override = _override()
    if override is not None:
        return dict(sorted(override.items()))
    caches: dict[str, int] = {}
    for index in sorted(Path(root, f"cpu{cpu}", "cache").glob("index*")):
        try:
            kind = (index / "type").read_text().strip()
            level = int((index / "level").read_text())
            size = parse_size((index / "size").read_text())
        except (OSError, ValueError):
            continue
        if kind != "Instruction":
            caches[f"L{level}"] = size
    return caches


def last_level_cache_bytes(default: int | None = None) -> int | None:
    """The largest data cache, in bytes (`default` where none can be read)."""
    caches = cpu_caches()
    return max(caches.values()) if caches else default


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip().lower() in ("flags", "features"):
            return set(value.split())
    return set()


def isa_flags() -> list[str]:
    """The vector extensions of :data:`ISA_NAMES` this CPU has, as /proc/cpuinfo spells them."""
    flags = _cpu_flags()
    return [flag for flag in ISA_NAMES if flag in flags]


def memory_read_buffer_bytes(last_level_cache: int | None, *, floor: int = 256 * 2**20,
                             ceiling: int = 2**30) -> int:
    """The size of a buffer whose sum reads main memory rather than a cache: four times the
    last-level cache, at least `floor` (also where the cache size is unknown) and at most
    `ceiling` (a machine whose cache is larger than a quarter of it gets a buffer that the
    cache may hold). A multiple of 4 bytes (float32)."""
    size = floor if not last_level_cache else min(max(4 * int(last_level_cache), floor), ceiling)
    return size - size % 4


def memory_read_gb_s(repeats: int = 3) -> dict[str, Any]:
    """Measure, once per process, how fast this machine reads main memory: the best of
    `repeats` sums of a float32 buffer four times the last-level cache (between 256 MiB and
    1 GiB), on torch's threads. Returns ``{"gb_s", "buffer_mib", "threads", "repeats"}``.
    A figure for the record, not a ceiling the book builds on (chapter 11 measures those)."""
    if "memory_read" not in _state:
        import torch

        nbytes = memory_read_buffer_bytes(last_level_cache_bytes())
        buffer = torch.ones(nbytes // 4)
        buffer.sum()  # first touch and warm-up
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            buffer.sum()
            best = min(best, time.perf_counter() - start)
        del buffer
        _state["memory_read"] = {"gb_s": round(nbytes / best / 1e9, 2), "buffer_mib": nbytes // 2**20,
                                 "threads": torch.get_num_threads(), "repeats": repeats}
    return dict(_state["memory_read"])


def _size_text(nbytes: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            value = nbytes / scale
            return f"{value:.0f} {unit}" if value == int(value) else f"{value:.1f} {unit}"
    return f"{nbytes} B"


def machine_record(measure: bool = True) -> dict[str, Any]:
    """Caches, ISA flags and (with `measure`) the measured memory read rate."""
    record: dict[str, Any] = {"caches": cpu_caches(), "isa": isa_flags(),
                              "cache_sizes_overridden": CACHE_SIZES_ENV in os.environ}
    if measure:
        record["memory_read"] = memory_read_gb_s()
    return record


def machine_line(cpu_model: str | None, usable_cores: int | None, record: dict[str, Any]) -> str:
    """One sentence naming the machine: 'Measured on Intel(R) Xeon(R) Processor, 2 cores;
    caches L1 48 KiB, L2 2 MiB, L3 300 MiB; AVX2, AVX-512, VNNI, AVX512-BF16, AMX;
    memory read 18.2 GB/s (2 threads).' (the record keeps every flag)"""
    parts = [f"{cpu_model or 'an unnamed CPU'}, {usable_cores or '?'} cores"]
    caches = record.get("caches") or {}
    parts.append("caches " + ", ".join(f"{level} {_size_text(size)}" for level, size in caches.items())
                 if caches else "cache sizes not readable here")
    if record.get("cache_sizes_overridden"):
        parts[-1] += f" (set by {CACHE_SIZES_ENV})"
    flags = set(record.get("isa") or [])
    isa = [name for name, wanted in LINE_ISA if flags & wanted]
    parts.append(", ".join(isa) if isa else "none of AVX2, AVX-512, NEON reported")
    read = record.get("memory_read")
    if read:
        parts.append(f"memory read {read['gb_s']:.1f} GB/s ({read['threads']} threads)")
    return "Measured on " + "; ".join(parts) + "."


__all__ = ["CACHE_SIZES_ENV", "ISA_NAMES", "cpu_caches", "isa_flags", "last_level_cache_bytes",
           "machine_line", "machine_record", "memory_read_buffer_bytes", "memory_read_gb_s",
           "parse_size"]
