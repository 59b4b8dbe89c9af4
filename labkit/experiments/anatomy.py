"""What arrives from training, taken apart: the bytes of a GGUF file, its tensors, the
buffers a runtime makes that training never stored, tied weights, and what a cold first
request pays that a warm one does not.

The functions here back chapter 2 ("From Training to Execution"):

- :func:`file_layout` walks the file by byte offset (header, every key/value, every tensor
  description, alignment padding, every tensor's data) and checks that the regions tile the
  file with no gap and no overlap; :func:`byte_parts` sums them into the parts a reader cares
  about. Unlike :func:`labkit.models.gguf_file.byte_accounting`, which gets the padding as a
  remainder, this accounting locates every byte, so "the parts add up to the file size" is a
  check and not a definition.
- :func:`tensor_inventory` groups the stored tensors (embedding, attention q/k/v/o, MLP
  gate/up/down, norms) with counts, shapes, parameters and bytes; :func:`quant_summary` sums
  them per quantization type with bits per parameter and the float32/bfloat16 sizes.
- :func:`runtime_buffers` lists what the runtime builds that the file does not hold (RoPE
  cos/sin tables, the causal mask, the KV cache) and :func:`rope_closed_form` is the formula
  the RoPE tables must equal.
- :func:`tied_weights` finds tensors that share storage (the tied embedding / LM head).
- :func:`cold_start_stages` times a cold first request in a fresh process with an empty
  cache, stage by stage, beside warm loads and warm calls.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np

from labkit.models import registry
from labkit.models.gguf_file import field_value, open_reader

# --------------------------------------------------------------------------------------------
# Every byte of the file
# --------------------------------------------------------------------------------------------

#: GGUF's fixed header: magic (4 bytes) + version (uint32) + tensor count + key/value count
#: (uint64 each). The reader exposes the last three as pseudo-fields named ``GGUF.*``.
MAGIC_BYTES = 4

_TOKENIZER_PARTS = {
    "tokenizer.ggml.tokens": "tokenizer: vocabulary strings",
    "tokenizer.ggml.merges": "tokenizer: BPE merges",
    "tokenizer.ggml.token_type": "tokenizer: token types",
    "tokenizer.ggml.scores": "tokenizer: token scores",
    "tokenizer.chat_template": "tokenizer: chat template",
}


def _reader(reader_or_path):
    if isinstance(reader_or_path, (str, os.PathLike)):
        return open_reader(reader_or_path)
    return reader_or_path


def _field_nbytes(field) -> int:
    return int(sum(part.nbytes for part in field.parts))


def metadata_category(key: str) -> str:
    """The part of the file a key/value belongs to (tokenizer keys split by what they hold)."""
    if key.startswith("GGUF."):
        return "header"
    if key in _TOKENIZER_PARTS:
        return _TOKENIZER_PARTS[key]
    if key.startswith("tokenizer."):
        return "tokenizer: ids and flags"
    return "other metadata"


def file_layout(path: str | os.PathLike, reader=None) -> dict:
    """Locate every byte of a GGUF file by its offset.

    Returns ``{"file_bytes", "regions", "contiguous", "covered_bytes"}``: ``regions`` is a
    list of dicts (start, bytes, category, name) sorted by start, covering the magic, the
    header counts, each key/value, each tensor description, every padding gap and each
    tensor's data. ``contiguous`` is True when every region starts where the previous one
    ended, there is no overlap, and the last one ends at the end of the file; padding is
    whatever lies between the end of one region and the start of the next (it must be
    smaller than the alignment and hold only zero bytes to count as padding).
    """
    reader = reader or open_reader(path)
    size = Path(path).stat().st_size
    alignment = int(reader.alignment)
    regions: list[dict] = [{"start": 0, "bytes": MAGIC_BYTES, "category": "header", "name": "magic"}]
    for field in reader.fields.values():
        regions.append({"start": int(field.offset), "bytes": _field_nbytes(field),
                        "category": metadata_category(field.name), "name": field.name})
    for tensor in reader.tensors:
        regions.append({"start": int(tensor.field.offset), "bytes": _field_nbytes(tensor.field),
                        "category": "tensor descriptions", "name": tensor.name})
        regions.append({"start": int(tensor.data_offset), "bytes": int(tensor.n_bytes),
                        "category": f"tensor data: {tensor.tensor_type.name}", "name": tensor.name})
    regions.sort(key=lambda r: r["start"])
    raw = np.memmap(path, dtype=np.uint8, mode="r")
    out: list[dict] = []
    position, contiguous = 0, True
    for region in regions + [{"start": size, "bytes": 0, "category": "end", "name": "end"}]:
        gap = region["start"] - position
        if gap < 0:
            contiguous = False  # overlap
        elif gap > 0:
            is_padding = gap < alignment and not raw[position:region["start"]].any()
            contiguous &= is_padding
            out.append({"start": position, "bytes": gap, "category": "alignment padding",
                        "name": f"padding before {region['name']}"})
            position = region["start"]
        if region["category"] != "end":
            out.append(region)
            position = max(position, region["start"] + region["bytes"])
    contiguous &= position == size
    return {"file_bytes": size, "regions": out, "contiguous": bool(contiguous),
            "covered_bytes": int(sum(r["bytes"] for r in out)), "alignment": alignment}


def byte_parts(layout: dict) -> list[dict]:
    """Sum :func:`file_layout` regions by category: rows (part, bytes, share, regions)."""
    totals: "OrderedDict[str, list[int]]" = OrderedDict()
    order = ["header", "other metadata", "tokenizer: vocabulary strings", "tokenizer: BPE merges",
             "tokenizer: token types", "tokenizer: token scores", "tokenizer: chat template",
             "tokenizer: ids and flags", "tensor descriptions", "alignment padding"]
    for name in order:
        totals[name] = [0, 0]
    for region in layout["regions"]:
        entry = totals.setdefault(region["category"], [0, 0])
        entry[0] += region["bytes"]
        entry[1] += 1
    size = layout["file_bytes"]
    return [{"part": part, "bytes": b, "share": b / size, "regions": n}
            for part, (b, n) in totals.items() if n or part == "alignment padding"]


def summarize_parts(parts: list[dict]) -> dict[str, int]:
    """Collapse :func:`byte_parts` rows into the five coarse parts of the file."""
    out = {"tensor data": 0, "tokenizer": 0, "other metadata": 0, "tensor descriptions": 0,
           "header": 0, "alignment padding": 0}
    for row in parts:
        part = row["part"]
        key = ("tensor data" if part.startswith("tensor data") else
               "tokenizer" if part.startswith("tokenizer") else part)
        out[key] += row["bytes"]
    return out


def plot_stacked_bar(ax, segments: list[tuple[str, float]], *, scale: float = 1.0,
                     unit_label: str = "bytes", min_label_share: float = 0.07,
                     colors: list[str] | None = None):
    """One horizontal stacked bar of ``(label, value)`` segments on ``ax``, in order.

    Values are divided by ``scale`` (1e6 for MB); a segment wider than ``min_label_share``
    of the total is labelled inside, and every segment appears, with its value, in a legend
    to the right of the axes.
    Returns the list of bar containers (one per segment).
    """
    from labkit.util.palette import OKABE_ITO

    colors = colors or (OKABE_ITO * 2)
    total = sum(v for _, v in segments) / scale
    left, bars = 0.0, []
    for (label, value), color in zip(segments, colors):
        width = value / scale
        bar = ax.barh([0], [width], left=left, color=color, edgecolor="white", linewidth=0.6,
                      label=f"{label} ({value / scale:,.3g})")
        if total and width / total >= min_label_share:
            ax.text(left + width / 2, 0, label, ha="center", va="center", fontsize=8,
                    color="white" if color in ("#0072B2", "#D55E00", "#000000", "#009E73") else "black")
        bars.append(bar)
        left += width
    ax.set_xlim(0, left)
    ax.set_yticks([])
    ax.set_xlabel(unit_label)
    ax.grid(axis="y", visible=False)
    ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), ncol=1, fontsize=8)
    return bars


# --------------------------------------------------------------------------------------------
# The stored tensors
# --------------------------------------------------------------------------------------------

_GROUPS = OrderedDict([
    ("token_embd", ("token embedding", "model.embed_tokens.weight")),
    ("attn_norm", ("attention RMSNorm", "model.layers.*.input_layernorm.weight")),
    ("attn_q", ("attention q projection", "model.layers.*.self_attn.q_proj.weight")),
    ("attn_k", ("attention k projection", "model.layers.*.self_attn.k_proj.weight")),
    ("attn_v", ("attention v projection", "model.layers.*.self_attn.v_proj.weight")),
    ("attn_output", ("attention o projection", "model.layers.*.self_attn.o_proj.weight")),
    ("ffn_norm", ("MLP RMSNorm", "model.layers.*.post_attention_layernorm.weight")),
    ("ffn_gate", ("MLP gate projection", "model.layers.*.mlp.gate_proj.weight")),
    ("ffn_up", ("MLP up projection", "model.layers.*.mlp.up_proj.weight")),
    ("ffn_down", ("MLP down projection", "model.layers.*.mlp.down_proj.weight")),
    ("output_norm", ("final RMSNorm", "model.norm.weight")),
    ("output", ("LM head", "lm_head.weight")),
])


def tensor_group(gguf_name: str) -> str:
    """The GGUF tensor-name stem that identifies a tensor's role: ``blk.3.attn_q.weight`` ->
    ``attn_q``, ``token_embd.weight`` -> ``token_embd``."""
    match = re.fullmatch(r"blk\.\d+\.([a-z_]+)\.(weight|bias)", gguf_name)
    if match:
        return match.group(1)
    return gguf_name.rsplit(".", 1)[0]


def tensor_inventory(reader_or_path) -> list[dict]:
    """The stored tensors grouped by role, one row per (role, quantization type).

    Each row: group (a readable name), gguf (name pattern), hf (Hugging Face name
    pattern), count, shape (of one tensor, PyTorch order), quant_type, parameters, bytes,
    bits_per_parameter, learned (always True: everything in the file came from training).
    Rows come in the order of a forward pass; their parameters and bytes add up to the
    file's tensor totals.
    """
    reader = _reader(reader_or_path)
    rows: dict[tuple[str, str], dict] = {}
    for t in reader.tensors:
        stem = tensor_group(t.name)
        label, hf = _GROUPS.get(stem, (stem, "?"))
        key = (stem, t.tensor_type.name)
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        row = rows.get(key)
        if row is None:
            pattern = re.sub(r"^blk\.\d+\.", "blk.*.", t.name)
            row = rows[key] = {"group": label, "gguf": pattern, "hf": hf, "count": 0,
                               "shape": shape, "quant_type": t.tensor_type.name,
                               "parameters": 0, "bytes": 0, "learned": True}
        elif row["shape"] != shape:
            row["shape"] = "mixed"
        row["count"] += 1
        row["parameters"] += int(t.n_elements)
        row["bytes"] += int(t.n_bytes)
    order = {stem: i for i, stem in enumerate(_GROUPS)}
    out = [rows[key] for key in sorted(rows, key=lambda k: (order.get(k[0], len(order)), k))]
    for row in out:
        row["bits_per_parameter"] = 8 * row["bytes"] / row["parameters"]
    return out


def quant_summary(reader_or_path) -> list[dict]:
    """Per quantization type: tensors, parameters, bytes, bits per parameter, and the bytes
    the same parameters take as float32 and as bfloat16. A last row, ``all``, sums them."""
    reader = _reader(reader_or_path)
    by_type: "OrderedDict[str, dict]" = OrderedDict()
    for t in reader.tensors:
        row = by_type.setdefault(t.tensor_type.name, {"quant_type": t.tensor_type.name,
                                                      "tensors": 0, "parameters": 0, "bytes": 0})
        row["tensors"] += 1
        row["parameters"] += int(t.n_elements)
        row["bytes"] += int(t.n_bytes)
    rows = sorted(by_type.values(), key=lambda r: -r["bytes"])
    rows.append({"quant_type": "all", "tensors": sum(r["tensors"] for r in rows),
                 "parameters": sum(r["parameters"] for r in rows),
                 "bytes": sum(r["bytes"] for r in rows)})
    for row in rows:
        row["bits_per_parameter"] = 8 * row["bytes"] / row["parameters"]
        row["float32_bytes"] = 4 * row["parameters"]
        row["bfloat16_bytes"] = 2 * row["parameters"]
    return rows


def metadata_table(reader_or_path, max_chars: int = 60) -> list[dict]:
    """Every key/value of the file: key, category, value (arrays summarised by length,
    long strings cut to ``max_chars``) and the bytes it takes in the file (key included)."""
    reader = _reader(reader_or_path)
    rows = []
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        if len(field.data) > 1 and not (len(field.types) == 1 and field.types[0].name == "STRING"):
            value = f"<array of {len(field.data)}>"
        else:
            value = field.contents()
            if isinstance(value, list):
                value = f"<array of {len(value)}>" if len(value) > 4 else value
            text = str(value)
            value = text if len(text) <= max_chars else text[: max_chars - 3] + "..."
        rows.append({"key": key, "category": metadata_category(key), "value": str(value),
                     "bytes": _field_nbytes(field)})
    return rows


def tokenizer_summary(reader_or_path) -> dict:
    """What the file says about its tokenizer: model, pre-tokenizer, vocabulary and merge
    counts, token types, the special ids (with their strings) and the BOS/EOS policy."""
    reader = _reader(reader_or_path)
    tokens = field_value(reader, "tokenizer.ggml.tokens")
    types = field_value(reader, "tokenizer.ggml.token_type") or []
    merges = field_value(reader, "tokenizer.ggml.merges") or []
    kinds = {1: "normal", 2: "unknown", 3: "control", 4: "user-defined", 5: "unused", 6: "byte"}
    counts: dict[str, int] = {}
    for kind in types:
        counts[kinds.get(int(kind), str(kind))] = counts.get(kinds.get(int(kind), str(kind)), 0) + 1

    def special(key: str):
        value = field_value(reader, f"tokenizer.ggml.{key}_token_id")
        return None if value is None else (int(value), tokens[int(value)])

    template = field_value(reader, "tokenizer.chat_template")
    return {
        "model": field_value(reader, "tokenizer.ggml.model"),
        "pre_tokenizer": field_value(reader, "tokenizer.ggml.pre"),
        "vocab_size": len(tokens),
        "merges": len(merges),
        "token_types": counts,
        "control_tokens": [tok for tok, kind in zip(tokens, types) if int(kind) == 3],
        "bos": special("bos"), "eos": special("eos"), "unknown": special("unknown"),
        "padding": special("padding"),
        "add_bos_token": field_value(reader, "tokenizer.ggml.add_bos_token"),
        "add_eos_token": field_value(reader, "tokenizer.ggml.add_eos_token"),
        "chat_template_chars": None if template is None else len(template),
    }


# --------------------------------------------------------------------------------------------
# What the runtime makes, and what is shared
# --------------------------------------------------------------------------------------------


def rope_closed_form(positions, theta: float, head_dim: int) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin of RoPE angles in float64, straight from the formula.

    Entry [p, j] uses angle ``pos_p * theta ** (-2 i / head_dim)`` with ``i = j mod
    head_dim/2``: the two halves of a head share the frequencies (the Hugging Face layout).
    """
    pos = np.asarray(positions, dtype=np.float64).reshape(-1, 1)
    i = np.arange(head_dim // 2, dtype=np.float64)
    freq = theta ** (-2.0 * i / head_dim)
    angles = np.concatenate([pos * freq, pos * freq], axis=1)
    return np.cos(angles), np.sin(angles)


def runtime_buffers(model, prompt_tokens: int = 16, max_len: int | None = None) -> list[dict]:
    """What our runtime builds for `model` that the file does not hold.

    Rows (name, shape, dtype, bytes, learned=False, lifetime, made_from): the RoPE cos and
    sin tables (built once per model, from rope_theta and head_dim), the causal mask of a
    `prompt_tokens`-token prefill (built per call; a one-token decode step needs none) and
    the KV cache of one request of `max_len` positions (default: prompt_tokens + 16).
    """
    import torch

    c = model.config
    max_len = max_len or prompt_tokens + 16
    rows = []
    for name in ("rope_cos", "rope_sin"):
        t = getattr(model, name)
        rows.append({"name": name, "shape": tuple(t.shape), "dtype": str(t.dtype).replace("torch.", ""),
                     "bytes": t.numel() * t.element_size(), "learned": False, "lifetime": "model",
                     "made_from": f"rope_theta={c.rope_theta:g}, head_dim={c.head_dim}, "
                                  f"{t.shape[0]} positions"})
    mask_shape = (c.group_size * prompt_tokens, prompt_tokens)
    rows.append({"name": "causal mask", "shape": mask_shape, "dtype": "bool",
                 "bytes": math.prod(mask_shape), "learned": False, "lifetime": "one prefill call",
                 "made_from": f"positions of a {prompt_tokens}-token prompt"})
    kv_shape = (c.num_layers, 1, c.num_kv_heads, max_len, c.head_dim)
    elem = torch.empty((), dtype=model.dtype).element_size()
    rows.append({"name": "KV cache (keys + values)", "shape": kv_shape,
                 "dtype": str(model.dtype).replace("torch.", ""),
                 "bytes": 2 * math.prod(kv_shape) * elem, "learned": False, "lifetime": "one request",
                 "made_from": f"{max_len} positions, 2 x layers x kv_heads x head_dim"})
    return rows


def _named_tensors(model) -> dict[str, Any]:
    """Name -> tensor for our `Llama` or any torch module: its parameters, a tied one under
    each of its names."""
    return dict(model.named_parameters(remove_duplicate=False))


def tied_weights(model) -> list[dict]:
    """Groups of named weights that share one storage (same data pointer, shape and dtype).

    Works on our `Llama` and on a `transformers` module. Each row: names, shape, dtype,
    bytes (of one copy: what tying saves in memory).
    """
    groups: dict[tuple, list[str]] = {}
    named = _named_tensors(model)
    for name, t in named.items():
        key = (t.data_ptr(), tuple(t.shape), t.dtype)
        groups.setdefault(key, []).append(name)
    rows = []
    for (_, shape, dtype), names in groups.items():
        if len(names) > 1:
            t = named[names[0]]
            rows.append({"names": names, "shape": shape, "dtype": str(dtype).replace("torch.", ""),
                         "bytes": t.numel() * t.element_size()})
    return rows


def first_divergence(a, b) -> int | None:
    """Index of the first position where two token sequences differ (None if one is a prefix
    of the other and they have the same length)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


# --------------------------------------------------------------------------------------------
# Cold first request vs warm requests
# --------------------------------------------------------------------------------------------

COLD_STAGES = ("import", "dequantize", "tokenizer_build", "read_weights", "assemble", "first_call")


def _cold_start_child(name: str, source: str, prompt: str, repeats: int, import_s: float) -> dict:
    """Runs inside a fresh process whose LABKIT_CACHE is an empty folder (see
    :func:`cold_start_stages`)."""
    import time

    import torch

    from labkit.util.timing import measure
    from labkit.models.loader import load_model

    out: dict[str, float] = {"import": import_s}
    target = registry.gguf_path(name)
    target.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    shutil.copyfile(source, target)  # stands in for the download, which we do not repeat
    out["copy_gguf"] = time.perf_counter() - t0
    model = load_model(name)
    report = model.load_report.seconds
    out.update(dequantize=report["fetch_and_dequantize"], tokenizer_build=report["tokenizer"],
               read_weights=report["read_weights"], assemble=report["assemble"])
    ids = torch.tensor([model.tokenizer.encode(prompt)])
    t0 = time.perf_counter()
    model(ids)
    out["first_call"] = time.perf_counter() - t0
    later = measure(lambda: model(ids), name="later_call", repeats=repeats, warmup=0)
    out.update(later_call=later.median, later_call_p25=later.quantile(0.25),
               later_call_p75=later.quantile(0.75))
    del model
    warm = load_model(name)
    report = warm.load_report.seconds
    out.update(warm_cache_check=report["fetch_and_dequantize"], warm_read_weights=report["read_weights"],
               warm_assemble=report["assemble"], warm_tokenizer=report["tokenizer"])
    out["warm_load"] = sum(report.values())
    out["cold_request"] = sum(out[k] for k in COLD_STAGES)
    out["prompt_tokens"] = int(ids.shape[1])
    out["threads"] = torch.get_num_threads()
    out["warm_cache_was_warm"] = bool(warm.load_report.warm_cache)
    return out


def cold_start_stages(name: str = registry.DEFAULT_MODEL, tmp_dir: str | os.PathLike | None = None,
                      prompt: str = "The capital of France is", repeats: int = 5,
                      threads: int | None = None, timeout: float = 900.0) -> dict[str, float]:
    """Time a cold first request, stage by stage, in a fresh Python process.

    The child process gets ``LABKIT_CACHE=tmp_dir`` (an empty folder), copies the already
    fetched GGUF to where the registry expects it under that root (``copy_gguf``, standing
    in for the download), then loads the model cold: ``dequantize`` (GGUF -> float32
    safetensors written to the cache), ``tokenizer_build``, ``read_weights``, ``assemble``;
    then ``first_call`` (the first prefill of `prompt`) and ``later_call`` (median of
    `repeats` identical calls, with p25/p75). Finally it loads the model again from the now
    warm cache (``warm_read_weights``, ``warm_assemble``, ``warm_tokenizer``, total
    ``warm_load``). ``import`` is the time to import torch and labkit in the fresh process;
    ``cold_request`` sums import, the cold load and the first call. Seconds throughout.
    """
    import tempfile

    source = registry.fetch(name)
    cleanup = tmp_dir is None
    tmp_dir = Path(tempfile.mkdtemp(prefix="labkit-cold-")) if cleanup else Path(tmp_dir)
    tmp_dir.mkdir(parents=True, exist_ok=True)
    if any(tmp_dir.iterdir()):
        raise ValueError(f"{tmp_dir} is not empty: a cold start needs an empty cache folder")
    env = dict(os.environ, LABKIT_CACHE=str(tmp_dir))
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    code = (
        "import time; t0 = time.perf_counter()\n"
        "import json, torch, labkit, labkit.models.loader\n"
        "import labkit.experiments.anatomy as a\n"
        f"threads = {threads!r}\n"
        "if threads: torch.set_num_threads(threads)\n"
        "t1 = time.perf_counter()\n"
        f"out = a._cold_start_child({name!r}, {str(source)!r}, {prompt!r}, {int(repeats)}, t1 - t0)\n"
        "print('COLD-START ' + json.dumps(out))\n"
    )
    try:
        proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                              timeout=timeout)
    finally:
        if cleanup:
            shutil.rmtree(tmp_dir, ignore_errors=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("COLD-START ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"cold-start process failed (exit {proc.returncode}): {proc.stderr[-2000:]}")
    return json.loads(lines[-1][len("COLD-START "):])


__all__ = [
    "file_layout", "byte_parts", "summarize_parts", "plot_stacked_bar", "metadata_category", "tensor_group",
    "tensor_inventory", "quant_summary", "metadata_table", "tokenizer_summary",
    "rope_closed_form", "runtime_buffers", "tied_weights", "first_divergence",
    "cold_start_stages", "COLD_STAGES",
]
