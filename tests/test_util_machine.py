"""The machine record (`labkit.util.machine`): caches read from sysfs or set by
LABKIT_CACHE_SIZES, the ISA flags, a measured memory read rate, the one-line summary."""

import pytest

from labkit.util import machine
from labkit.util.environment import capture


def fake_sysfs(root, entries):
    for i, (level, kind, size) in enumerate(entries):
        folder = root / "cpu0" / "cache" / f"index{i}"
        folder.mkdir(parents=True)
        (folder / "level").write_text(f"{level}\n")
        (folder / "type").write_text(f"{kind}\n")
        (folder / "size").write_text(f"{size}\n")


def test_caches_are_read_from_sysfs_skipping_instruction_caches(tmp_path, monkeypatch):
    monkeypatch.delenv(machine.CACHE_SIZES_ENV, raising=False)
    fake_sysfs(tmp_path, [(1, "Data", "48K"), (1, "Instruction", "32K"), (2, "Unified", "2048K"),
                          (3, "Unified", "307200K")])
    assert machine.cpu_caches(root=str(tmp_path)) == {"L1": 48 * 2**10, "L2": 2 * 2**20, "L3": 300 * 2**20}
    assert machine.cpu_caches(root=str(tmp_path / "missing")) == {}


def test_an_environment_variable_pretends_to_be_another_machine(monkeypatch):
    monkeypatch.setenv(machine.CACHE_SIZES_ENV, "L2=512KiB, L3=32MiB")
    assert machine.cpu_caches() == {"L2": 512 * 2**10, "L3": 32 * 2**20}
    assert machine.last_level_cache_bytes() == 32 * 2**20
    record = machine.machine_record(measure=False)
    assert record["cache_sizes_overridden"]
    assert "(set by LABKIT_CACHE_SIZES)" in machine.machine_line("CPU", 2, record)
    monkeypatch.setenv(machine.CACHE_SIZES_ENV, "L3")
    with pytest.raises(ValueError, match="LEVEL=SIZE"):
        machine.cpu_caches()


def test_sizes_parse_as_linux_writes_them():
    assert machine.parse_size("32768K") == 32 * 2**20
    assert machine.parse_size(" 300 MiB ") == 300 * 2**20
    assert machine.parse_size("2M") == 2 * 2**20
    with pytest.raises(ValueError):
        machine.parse_size("lots")


def test_the_line_names_caches_isa_and_bandwidth():
    record = {"caches": {"L1": 32 * 2**10, "L2": 2**20, "L3": 32 * 2**20},
              "isa": ["avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16", "amx_int8"],
              "memory_read": {"gb_s": 17.04, "threads": 2}}
    line = machine.machine_line("AMD EPYC", 2, record)
    assert line == ("Measured on AMD EPYC, 2 cores; caches L1 32 KiB, L2 1 MiB, L3 32 MiB; "
                    "AVX2, AVX-512, AVX512-BF16, AMX; memory read 17.0 GB/s (2 threads).")
    assert "none of AVX2" in machine.machine_line(None, None, {"caches": {}, "isa": []})


def test_the_memory_read_buffer_is_four_caches_within_bounds():
    MiB = 2**20
    assert machine.memory_read_buffer_bytes(32 * MiB) == 256 * MiB     # a 32 MiB L3: the floor
    assert machine.memory_read_buffer_bytes(100 * MiB) == 400 * MiB    # four times the cache
    assert machine.memory_read_buffer_bytes(300 * MiB) == 2**30        # the ceiling
    assert machine.memory_read_buffer_bytes(None) == 256 * MiB         # unknown: the floor
    assert machine.memory_read_buffer_bytes(10**8 + 2) % 4 == 0        # whole float32s


def test_the_memory_read_rate_is_measured_once_and_plausible():
    first = machine.memory_read_gb_s()
    assert 0.5 < first["gb_s"] < 2000 and first["buffer_mib"] >= 256
    assert machine.memory_read_gb_s() == first  # once per process


def test_every_record_carries_the_machine():
    env = capture()
    assert set(env["machine"]) >= {"caches", "isa", "memory_read"}
    assert set(env["cpu"]["isa"]) == set(env["machine"]["isa"])
