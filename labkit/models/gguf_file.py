"""Reading a GGUF file: its metadata becomes our config, its tensors our weights.

GGUF stores a header (key/value metadata, including the whole tokenizer), a table of
tensor descriptions, padding to the data alignment, then the tensor bytes. Quantized
tensors (Q8_0, Q4_1, ...) are dequantized to float32 with the `gguf` package.

Two facts about llama.cpp's conversion matter here:
- `attn_q` and `attn_k` are stored with their rows permuted for llama.cpp's interleaved
  RoPE layout; we undo the permutation so the weights match the Hugging Face layout
  (RoPE on two halves of each head), exactly as `transformers` does on load.
- there is no `output.weight` when the LM head is tied to the token embedding.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool = True
    bos_token_id: int | None = None
    eos_token_id: int | None = None

    @property
    def group_size(self) -> int:
        """How many query heads share one key/value head (grouped-query attention)."""
        return self.num_heads // self.num_kv_heads

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class TensorEntry:
    """One tensor as the file stores it (before dequantization)."""

    name: str
    quant_type: str
    shape: tuple[int, ...]  # PyTorch order: [rows, cols]
    n_elements: int
    n_bytes: int
    data_offset: int  # absolute offset of the first byte in the file


def open_reader(path: str | Path):
    import gguf

    return gguf.GGUFReader(str(path))


def field_value(reader, key: str, default=None):
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


def read_metadata(reader) -> dict:
    """All key/value metadata except the large tokenizer arrays (summarised by length)."""
    big = {"tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type",
           "tokenizer.ggml.scores"}
    out = {}
    for key, field in reader.fields.items():
        if key in big:
            out[key] = f"<{len(field.data)} entries>"
        elif not key.startswith("GGUF."):
            out[key] = field.contents()
    return out


def llama_config_from_gguf(reader) -> LlamaConfig:
    arch = field_value(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"expected a llama GGUF, this file's architecture is {arch!r}")
    hidden = int(field_value(reader, "llama.embedding_length"))
    heads = int(field_value(reader, "llama.attention.head_count"))
    tokens = reader.fields["tokenizer.ggml.tokens"]
    vocab = int(field_value(reader, "llama.vocab_size", len(tokens.data)))
    names = {t.name for t in reader.tensors}
    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(field_value(reader, "llama.feed_forward_length")),
        num_layers=int(field_value(reader, "llama.block_count")),
        num_heads=heads,
        num_kv_heads=int(field_value(reader, "llama.attention.head_count_kv", heads)),
        head_dim=int(field_value(reader, "llama.rope.dimension_count", hidden // heads)),
        rope_theta=float(field_value(reader, "llama.rope.freq_base", 10000.0)),
        rms_norm_eps=float(field_value(reader, "llama.attention.layer_norm_rms_epsilon")),
        max_position_embeddings=int(field_value(reader, "llama.context_length")),
        tie_word_embeddings="output.weight" not in names,
        bos_token_id=field_value(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=field_value(reader, "tokenizer.ggml.eos_token_id"),
    )


def tensor_entries(reader) -> list[TensorEntry]:
    entries = []
    for t in reader.tensors:
        # GGUF lists dimensions fastest-first; PyTorch wants them slowest-first.
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        entries.append(TensorEntry(
            name=t.name, quant_type=t.tensor_type.name, shape=shape,
            n_elements=int(t.n_elements), n_bytes=int(t.n_bytes),
            data_offset=int(t.data_offset),
        ))
    return entries


def unpermute_rope_rows(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's row permutation of a Q or K projection (interleaved -> halves)."""
    rows = weight.shape[0]
    half = rows // n_heads // 2
    w = weight.reshape(n_heads, half, 2, *weight.shape[1:])
    return w.swapaxes(1, 2).reshape(weight.shape)


_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def hf_name(gguf_name: str, layer_names: dict[str, str] | None = None) -> str:
    """Map a GGUF tensor name to the Hugging Face name (our cache uses HF names): a layer's
    tensors through `layer_names` (GGUF part -> HF module path; default the Llama's)."""
    layer_names = _LAYER_NAMES if layer_names is None else layer_names
    if gguf_name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if gguf_name == "output_norm.weight":
        return "model.norm.weight"
    if gguf_name == "output.weight":
        return "lm_head.weight"
    block, index, part, kind = gguf_name.split(".")
    if block != "blk" or part not in layer_names:
        raise KeyError(f"unexpected tensor {gguf_name!r}")
    return f"model.layers.{index}.{layer_names[part]}.{kind}"


def dequantized_state_dict(reader, config: LlamaConfig) -> dict[str, np.ndarray]:
    """Every tensor of the file as float32, in Hugging Face names and layout."""
    import gguf

    state = {}
    for t in reader.tensors:
        weight = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        weight = weight.reshape(shape)
        if ".attn_q." in t.name:
            weight = unpermute_rope_rows(weight, config.num_heads)
        elif ".attn_k." in t.name:
            weight = unpermute_rope_rows(weight, config.num_kv_heads)
        state[hf_name(t.name)] = np.ascontiguousarray(weight)
    return state


def raw_blocks(reader, config: LlamaConfig) -> dict[str, tuple[str, np.ndarray]]:
    """Every quantized tensor of the file as the file stores it, in Hugging Face names:
    name -> (quantization type, uint8 array [rows, bytes per row]). A row's blocks cover
    consecutive inputs, so the rows of `attn_q` and `attn_k` are put back in Hugging Face
    order (the permutation `dequantized_state_dict` undoes) by moving whole rows: the same
    weights as the float32 state dict, still in their blocks. Float tensors are left out."""
    out = {}
    for t in reader.tensors:
        kind = t.tensor_type.name
        if kind in ("F32", "F16", "BF16"):
            continue
        data = np.array(t.data, dtype=np.uint8)  # a copy: the reader's arrays map the file read-only
        if ".attn_q." in t.name or ".attn_k." in t.name:
            heads = config.num_heads if ".attn_q." in t.name else config.num_kv_heads
            data = data[unpermute_rope_rows(np.arange(data.shape[0]), heads)]
        out[hf_name(t.name)] = (kind, np.ascontiguousarray(data))
    return out


def byte_accounting(path: str | Path, reader=None) -> dict:
    """Account for every byte of a GGUF file; the parts add up to the file size exactly.

    header (magic, version, counts) + metadata (tokenizer and other key/values) + tensor
    descriptions + padding + tensor data (by quantization type) = file size.
    """
    reader = reader or open_reader(path)
    size = Path(path).stat().st_size
    fields = reader.fields.values()

    def nbytes(field) -> int:
        return sum(part.nbytes for part in field.parts)

    header = 4 + sum(nbytes(f) for f in fields if f.name.startswith("GGUF."))  # 4: magic
    tokenizer = sum(nbytes(f) for f in fields if f.name.startswith("tokenizer."))
    other_meta = sum(nbytes(f) for f in fields
                     if not f.name.startswith(("GGUF.", "tokenizer.")))
    tensor_info = sum(nbytes(t.field) for t in reader.tensors)
    by_type: dict[str, int] = {}
    params_by_type: dict[str, int] = {}
    for t in reader.tensors:
        by_type[t.tensor_type.name] = by_type.get(t.tensor_type.name, 0) + int(t.n_bytes)
        params_by_type[t.tensor_type.name] = params_by_type.get(t.tensor_type.name, 0) + int(t.n_elements)
    tensor_bytes = sum(by_type.values())
    padding = size - header - tokenizer - other_meta - tensor_info - tensor_bytes
    return {
        "file_bytes": size,
        "header_bytes": header,
        "tokenizer_bytes": tokenizer,
        "other_metadata_bytes": other_meta,
        "tensor_info_bytes": tensor_info,
        "alignment_padding_bytes": padding,
        "tensor_bytes": tensor_bytes,
        "tensor_bytes_by_type": by_type,
        "parameters_by_type": params_by_type,
        "parameters_stored": sum(params_by_type.values()),
        "alignment": int(reader.alignment),
        "data_offset": int(reader.data_offset),
    }
