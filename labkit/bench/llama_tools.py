"""llama.cpp's own tools as peers, for `labkit bench lowbit`.

llama-cpp-python calls llama.cpp through Python; llama.cpp's own `llama-bench` times
generation with nothing around it, so it is the fairer, harder number to beat. The wheel
ships only the library; `make peers` builds `llama-bench`, `llama-server` and
`llama-quantize` with cmake from the llama.cpp tree in llama-cpp-python's source
distribution (the same release as the binding) into `.peers/llama.cpp-build/bin`, or
`$LABKIT_LLAMA_TOOLS` names another folder.

`llama-quantize` also makes the like-for-like float32 row: requantizing the model file to
F32 writes its blocks' values as float32, the very weights labkit's f32 mode multiplies by.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path

from labkit.bench.peers import REPO_ROOT
from labkit.models import registry
from labkit.util.paths import cache_root

TOOLS_VARIABLE = "LABKIT_LLAMA_TOOLS"
NEEDED = ("llama-bench", "llama-quantize")


def tools_dir() -> Path:
    chosen = os.environ.get(TOOLS_VARIABLE)
    return Path(chosen).expanduser() if chosen else REPO_ROOT / ".peers" / "llama.cpp-build" / "bin"


def why_not_llama_tools() -> str | None:
    """None when llama-bench and llama-quantize are there to run, else why not."""
    missing = [name for name in NEEDED if not os.access(tools_dir() / name, os.X_OK)]
    if missing:
        return f"llama.cpp's {' and '.join(missing)} not built in {tools_dir()}: make peers (or set {TOOLS_VARIABLE})"
    return None


def f32_gguf(model_name: str) -> Path:
    """The registry's model file requantized to F32 by llama-quantize, made once and kept in
    the labkit cache (written beside its place, then renamed: a file there is complete)."""
    target = cache_root() / "gguf-f32" / f"{model_name}-f32.gguf"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    handle, staging = tempfile.mkstemp(dir=target.parent, suffix=".gguf")
    os.close(handle)
    try:
        subprocess.run([str(tools_dir() / "llama-quantize"), "--allow-requantize", str(registry.fetch(model_name)),
                        staging, "F32"], check=True, capture_output=True, text=True)
        os.replace(staging, target)
    finally:
        if os.path.exists(staging):
            os.remove(staging)
    return target


def llama_bench(path: Path, threads: int, tokens: int, repetitions: int = 1) -> dict:
    """llama-bench's text-generation test on `path` (`tokens` tokens after an empty prompt,
    `repetitions` times, `threads` threads): its JSON record, whose `avg_ts` is tokens/s
    and which names the build (commit, number, backends, CPU)."""
    command = [str(tools_dir() / "llama-bench"), "-m", str(path), "-t", str(threads), "-p", "0",
               "-n", str(tokens), "-r", str(repetitions), "-o", "json"]
    done = subprocess.run(command, check=True, capture_output=True, text=True)
    records = [r for r in json.loads(done.stdout) if r.get("n_gen") == tokens and r.get("n_prompt") == 0]
    if len(records) != 1:
        raise RuntimeError(f"llama-bench gave no single tg{tokens} record: {done.stdout[:500]}")
    return records[0]


def describe(record: dict) -> dict:
    """What a bench record says of llama-bench's build and the test it ran."""
    keys = ("build_commit", "build_number", "cpu_info", "backends", "model_type", "n_threads", "type_k", "type_v")
    return {"engine": "llama.cpp llama-bench", "folder": str(tools_dir()),
            **{k: record.get(k) for k in keys}}
