"""Kernels written in C and compiled on the reader's machine: a matrix-vector product for
decode, paged attention for every step, and products on the model file's quantized blocks.

**gemv.** Decoding one token multiplies one activation row by every weight matrix, reading
each weight exactly once: the step is bound by how fast the kernel streams weights from
memory, not by arithmetic. The kernel here is the plainest one that streams well: every
thread takes a contiguous band of weight rows, and each row is one dot product with the
activation (which stays in L1), vectorized by the compiler (`omp simd`). On the book's
2-core machine it streamed the 30 layers' matrices at about 26 GB/s where MKL's `F.linear`
managed about 12 and oneDNN's packed kernel about 20 (chapter 18 times a decode step with
each). With a few rows (a short verification, a small batch) each weight row, read once,
serves every row's dot product, but the multiply-adds grow with the rows: beyond
`gemv_max_rows()` rows oneDNN's packed GEMM is the cheaper path (`GEMV_MAX_ROWS` says why the
cutoff is a setting).

**paged_attention.** An engine step packs the new tokens of many sequences into one batch:
one token for a sequence that is decoding, a chunk of prompt for one that is prefilling.
Each of them attends causally over its own sequence's keys and values, read in place from
the KV pool through the sequence's block table: nothing is gathered or padded, so each
cached key is read once per step. The work is cut into tiles of up to `TILE_ROWS`
consecutive rows of one sequence; a thread takes a (tile, KV head) pair and walks the
table block by block with the online softmax of chapter 13 (running maximum, running sum,
rescaled accumulator), so every block it loads serves all the tile's rows and the KV
head's query heads at once (grouped-query attention), and a row stops at its own position.
The pool stores each block's keys transposed ([head_dim, block_size]), so scoring a query
against a block's slots is vector multiply-adds over the slots, with no per-slot dot
product to reduce. For the model's shape (16-slot blocks, 64-dim heads) the inner loops
are written with vector types so four queries' partial sums stay in registers; other
shapes take plain loops. Decode is the one-row tile (`paged_decode_attention`).
`labkit.engine`'s reference path (gather the blocks; SDPA) computes the same numbers, and
the tests hold one to the other.

**gemv_blocks.** The matrix-vector product with the weights left in the GGUF file's Q4_1 or
Q8_0 blocks (32 weights with a 16-bit scale, and Q4_1's minimum), converted in registers:
with x in float32 it is the float32 product to rounding; with x rounded to 8 bits a block
it multiplies bytes by bytes as llama.cpp does (`csrc/gguf_blocks.c` explains both;
`labkit.kernels.gguf_blocks` puts them in the model).

**bfloat16.** The same product on bfloat16 weights with x rounded to bfloat16 (`"BF16"`,
`csrc/bf16.c`), and paged attention over a pool of bfloat16 keys and values, each block
widened to float32 as it is read.

The C sources are `labkit/kernels/csrc/labkit_kernels.c`, `gguf_blocks.c`, `gguf_layer.c`
(a decoder layer in one call, `decoder_layer_blocks`, and every layer of a step,
`decoder_layers_blocks`) and `bf16.c`, shipped with the package
as data and read with `importlib.resources` (so it is found in a checkout and in an
installed wheel alike). They are compiled once with the system C compiler (`$CC`, default
`cc`) into `$LABKIT_CACHE/kernels/` and loaded with ctypes; the library's file name
carries a digest of the source text and the compile flags, so an edited source is rebuilt.
The OpenMP runtime they link is the one PyTorch already loaded (same soname), so the
kernels share PyTorch's threads and obey `torch.set_num_threads`. Without a compiler (or
on a platform where the build fails, or with `LABKIT_NATIVE=0`) `load()` returns None and
callers use the library kernels; `why_unavailable()` says why.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch

SOURCE_FILES = ("labkit_kernels.c", "gguf_blocks.c", "gguf_layer.c", "bf16.c")  # in csrc/, as package data
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")
# LABKIT_NATIVE_ARCH replaces "native" in -march: "x86-64" builds the portable C loops a
# CPU without AVX2 takes (the test matrix runs the whole suite so, `make test-matrix`).
ARCH_ENV = "LABKIT_NATIVE_ARCH"
FEATURES = {1: "AVX2+FMA intrinsics", 2: "16-lane (AVX-512) attention vectors", 4: "F16C conversions"}
# Up to how many rows a product on the model file's blocks (`gguf_blocks`, `bf16_weights`) with
# float32 x reads the blocks; beyond a few rows a blocked GEMM (oneDNN, MKL) reuses weights better.
MAX_ROWS = 4
# Up to how many rows a float32 product takes `gemv` instead of oneDNN's packed GEMM
# (`labkit.kernels.packed`). gemv reads each weight once for all its rows but does every row's
# multiply-adds on its own, so its cost grows by a good part of a one-row product per row, while
# the packed GEMM costs more for one row and grows slowly: the two cross after a few rows, where
# depends on the machine (vector width, cores, caches). On the book's 2-core AVX-512 machine a
# 3- and a 4-token pass on the C kernel cost more than a 5-token one on oneDNN, and the products
# alone crossed at 2 to 3 rows; chapter 17 measures the crossover where it runs
# (`labkit.experiments.gemv_rows`) and says whether this default is it. A machine whose
# crossover lies elsewhere sets $LABKIT_GEMV_MAX_ROWS (0: every product to oneDNN).
GEMV_MAX_ROWS = 2
GEMV_ROWS_ENV = "LABKIT_GEMV_MAX_ROWS"

_state: dict = {}
_SIGNATURES = {
    "labkit_gemv": [ctypes.c_void_p] * 3 + [ctypes.c_long] * 3,
    "labkit_build_features": [],
    **{name: [ctypes.c_void_p] * 6 + [ctypes.c_long] * 6 + [ctypes.c_float]
       for name in ("labkit_paged_attention", "labkit_paged_attention_bf16")},
    **{f"labkit_gemv_{kind}{x}": [ctypes.c_void_p] * 3 + [ctypes.c_long] * 3
       for kind in ("q4_1", "q8_0") for x in ("", "_q8")},
    **{name: [ctypes.c_void_p] * 3 + [ctypes.c_long] * 3 for name in ("labkit_gemv_q4_1x8_q8", "labkit_gemv_bf16")},
    "labkit_decoder_layer_blocks": ([ctypes.c_void_p, ctypes.c_long] + [ctypes.c_long] * 5 + [ctypes.c_float]
                                    + [ctypes.c_void_p] * 4 + [ctypes.c_long] + [ctypes.c_void_p] * 8
                                    + [ctypes.c_long] * 4),
    "labkit_decoder_layers_blocks": ([ctypes.c_void_p] + [ctypes.c_long] * 7 + [ctypes.c_float]
                                     + [ctypes.c_void_p] * 4 + [ctypes.c_long] + [ctypes.c_void_p] * 4
                                     + [ctypes.c_long] + [ctypes.c_void_p] * 4 + [ctypes.c_long] * 4),
}
# Weight formats the kernels read in place: weights per block, bytes per block. Q4_1x8:
# Q4_1 with each eight rows' blocks regrouped (`gguf_blocks.regroup_q4_1`), 8-bit x only.
# BF16: plain bfloat16 rows (counted in blocks of 32 to share the checks), with x rounded to
# bfloat16 by the kernel (`csrc/bf16.c`; `labkit.kernels.bf16_weights`).
BLOCK_FORMATS = {"Q4_1": (32, 20), "Q8_0": (32, 34), "Q4_1x8": (32, 20), "BF16": (32, 64)}


def _read_sources() -> dict[str, str]:
    """The C sources, read from the installed package (a checkout or a wheel alike)."""
    folder = resources.files("labkit.kernels") / "csrc"
    return {name: (folder / name).read_text(encoding="utf-8") for name in SOURCE_FILES}


def compile_library(folder: Path, flags: tuple[str, ...] = FLAGS):
    """Compile the sources with `flags` into `folder` (once per source text and flags) and
    load the library (ctypes). RuntimeError where no compiler is found or the build fails."""
    sources = _read_sources()
    # an edited source or other flags: another digest, a fresh build
    digest = hashlib.sha256((" ".join(flags) + "".join(sources.values())).encode()).hexdigest()[:16]
    target = Path(folder) / f"labkit_kernels-{digest}.so"
    if not target.exists():
        _build(target, sources, flags)
    lib = ctypes.CDLL(str(target))
    for name, argtypes in _SIGNATURES.items():
        getattr(lib, name).argtypes = argtypes
        getattr(lib, name).restype = None
    lib.labkit_build_features.restype = ctypes.c_long
    return lib


def default_flags() -> tuple[str, ...]:
    """FLAGS, with -march from ``$LABKIT_NATIVE_ARCH`` where it is set."""
    arch = os.environ.get(ARCH_ENV, "").strip()
    if not arch:
        return FLAGS
    if not all(c.isalnum() or c in "-_." for c in arch):
        raise RuntimeError(f"{ARCH_ENV}={arch!r} is not an -march name")
    return tuple(f"-march={arch}" if flag.startswith("-march=") else flag for flag in FLAGS)


def build_features(lib=None) -> list[str]:
    """The code paths a build compiled (`FEATURES`); [] for the plain C loops alone."""
    lib = lib or _require()
    bits = int(lib.labkit_build_features())
    return [name for bit, name in FEATURES.items() if bits & bit]


def _build(target: Path, sources: dict[str, str], flags: tuple[str, ...]) -> None:
    compiler = os.environ.get("CC", "cc")
    if shutil.which(compiler) is None:
        raise RuntimeError(f"no C compiler {compiler!r} on PATH")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        # compile a copy of exactly the texts the digest was taken of
        paths = []
        for name, text in sources.items():
            paths.append(Path(tmp) / name)
            paths[-1].write_text(text, encoding="utf-8")
        built = Path(tmp) / target.name
        result = subprocess.run([compiler, *flags, *map(str, paths), "-o", str(built)],
                                capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {result.stderr.strip()[-500:]}")
        os.replace(built, target)  # atomic: a concurrent loader sees all of it or nothing


def load():
    """The compiled library (ctypes), or None when it cannot be built here."""
    if "lib" not in _state:
        from labkit.util.paths import cache_root
        try:
            if os.environ.get("LABKIT_NATIVE", "1") == "0":
                raise RuntimeError("switched off by LABKIT_NATIVE=0")
            _state["flags"] = default_flags()
            _state["lib"], _state["why"] = compile_library(cache_root() / "kernels", _state["flags"]), None
        except (OSError, RuntimeError) as error:
            _state["lib"], _state["why"] = None, str(error)
    return _state["lib"]


def why_unavailable() -> str | None:
    load()
    return _state["why"]


def build_flags() -> tuple[str, ...] | None:
    """The compiler flags of the loaded build (None where the kernels are not loaded)."""
    return _state.get("flags") if load() is not None else None


def gemv_max_rows() -> int:
    """Up to how many rows a float32 product takes `gemv` (see `GEMV_MAX_ROWS`): the value of
    ``$LABKIT_GEMV_MAX_ROWS`` where it is set, else `GEMV_MAX_ROWS`. ValueError for a value
    that is not a whole number >= 0 (a typo must not silently keep the default)."""
    text = os.environ.get(GEMV_ROWS_ENV, "").strip()
    if not text:
        return GEMV_MAX_ROWS
    if not (text.isascii() and text.isdigit()):
        raise ValueError(f"{GEMV_ROWS_ENV}={text!r}: give a whole number of rows >= 0")
    return int(text)


def gemv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x W^T for float32 CPU tensors, x [..., n], weight [out, n] (what `F.linear` computes)."""
    lib = _require()
    if x.dtype != torch.float32 or weight.dtype != torch.float32 or x.device.type != "cpu":
        raise ValueError("the C kernel takes float32 CPU tensors")
    out, n = weight.shape
    if x.shape[-1] != n:
        raise ValueError(f"x has {x.shape[-1]} features, the weight {n}")
    x, weight = x.contiguous(), weight.contiguous()
    y = torch.empty(*x.shape[:-1], out, dtype=torch.float32)
    lib.labkit_gemv(weight.data_ptr(), x.data_ptr(), y.data_ptr(), x.numel() // n, out, n)
    return y


def gemv_blocks(x: torch.Tensor, blocks: torch.Tensor, kind: str, quantize_x: bool = False,
                lib=None) -> torch.Tensor:
    """x W^T where W is stored as GGUF blocks of `kind` ("Q4_1" or "Q8_0"): `blocks` is
    uint8 [out, n / 32 * bytes per block], each row the file's blocks of one output; x is
    float32 [..., n] ("BF16": bfloat16 rows viewed as bytes, x rounded to bfloat16 by the
    kernel). The weights are never expanded to floats in memory. `quantize_x`
    rounds x to 8 bits per block of 32 first and multiplies bytes by bytes (llama.cpp's
    scheme: faster, less exact); otherwise x stays float32. `lib`: another build of the
    kernels (`compile_library`), for tests."""
    lib = lib or _require()
    if kind not in BLOCK_FORMATS:
        raise ValueError(f"no kernel for {kind!r} blocks (have {sorted(BLOCK_FORMATS)})")
    per_block, block_bytes = BLOCK_FORMATS[kind]
    out, row_bytes = blocks.shape
    n = row_bytes // block_bytes * per_block
    if blocks.dtype != torch.uint8 or row_bytes % block_bytes or x.dtype != torch.float32 \
            or x.device.type != "cpu" or blocks.device.type != "cpu":
        raise ValueError(f"{kind} blocks are uint8 rows of whole blocks, x float32, on the CPU")
    if x.shape[-1] != n:
        raise ValueError(f"x has {x.shape[-1]} features, the blocks hold {n}")
    if kind == "Q4_1x8" and not (quantize_x and out % 8 == 0):
        raise ValueError("Q4_1x8 blocks are read with 8-bit x only, eight rows at a time")
    if kind == "BF16" and quantize_x:
        raise ValueError("BF16 rows are read with x rounded to bfloat16, not to 8 bits")
    x, blocks = x.contiguous(), blocks.contiguous()
    y = torch.empty(*x.shape[:-1], out, dtype=torch.float32)
    kernel = getattr(lib, f"labkit_gemv_{kind.lower()}{'_q8' if quantize_x else ''}")
    kernel(blocks.data_ptr(), x.data_ptr(), y.data_ptr(), x.numel() // n, out, n)
    return y


@dataclass
class PagedLayer:
    """One layer of a paged KV pool as a step's kernels see it: the layer's keys [blocks,
    kv_heads, D, block_size] and values [blocks, kv_heads, block_size, D] (float32 or
    bfloat16, both the same; for `decoder_layers_blocks`, every layer's: [layers, blocks,
    ...]), where each new
    token goes (block and slot, int64 [rows]), and the step's checked tables and tiles
    (`check_tiles`)."""
    keys: torch.Tensor
    values: torch.Tensor
    new_blocks: torch.Tensor
    new_slots: torch.Tensor
    tables: torch.Tensor
    tiles: torch.Tensor


@dataclass
class BlockLayerWeights:
    """A decoder layer's weights for `decoder_layer_blocks`: the norms (float32 [hidden]) and
    the four matrices (qkv, o_proj, gate_up, down) as GGUF blocks with their kinds."""
    attn_norm: torch.Tensor
    mlp_norm: torch.Tensor
    matrices: tuple[torch.Tensor, ...]
    kinds: tuple[str, ...]
    quantize_x: bool

    def __post_init__(self):
        if len(self.matrices) != 4 or any(k not in BLOCK_FORMATS for k in self.kinds):
            raise ValueError(f"four matrices in {sorted(BLOCK_FORMATS)} blocks, got {self.kinds}")
        self.pointers = (ctypes.c_void_p * 4)(*(m.data_ptr() for m in self.matrices))
        self.kind_codes = torch.tensor([list(BLOCK_FORMATS).index(k) for k in self.kinds], dtype=torch.long)


def decoder_layer_blocks(x: torch.Tensor, weights: BlockLayerWeights, shape, cos: torch.Tensor,
                         sin: torch.Tensor, kv: PagedLayer) -> None:
    """One decoder layer (labkit.models.llama.decoder_layer) in one C call, for the rows of a
    paged decode step: x float32 [rows, hidden] is updated in place. `shape`: the model's
    config (hidden_size, num_heads, num_kv_heads, head_dim, intermediate_size, rms_norm_eps);
    cos, sin [rows, head_dim] for the rows' positions. The caller ran `check_tiles`."""
    lib = _require()
    rows, hidden = _checked_rows(x, shape, cos, sin, kv)
    lib.labkit_decoder_layer_blocks(
        x.data_ptr(), rows, hidden, shape.num_heads, shape.num_kv_heads, shape.head_dim,
        shape.intermediate_size, shape.rms_norm_eps, weights.attn_norm.data_ptr(), weights.mlp_norm.data_ptr(),
        weights.pointers, weights.kind_codes.data_ptr(), int(weights.quantize_x), cos.data_ptr(), sin.data_ptr(),
        kv.keys.data_ptr(), kv.values.data_ptr(), kv.new_blocks.data_ptr(), kv.new_slots.data_ptr(),
        kv.tables.data_ptr(), kv.tiles.data_ptr(), kv.tiles.shape[0], kv.tables.shape[1], kv.keys.shape[-1],
        int(_kv_bf16(kv.keys, kv.values)))


@dataclass
class BlockModelWeights:
    """Every layer's `BlockLayerWeights` gathered for `decoder_layers_blocks`: the pointers to
    their norms and matrices as C arrays, built once."""
    layers: list[BlockLayerWeights]

    def __post_init__(self):
        count = len(self.layers)
        if len({w.quantize_x for w in self.layers}) > 1:
            raise ValueError("every layer must treat its activations the same way")
        self.quantize_x = self.layers[0].quantize_x
        self.attn_norms = (ctypes.c_void_p * count)(*(w.attn_norm.data_ptr() for w in self.layers))
        self.mlp_norms = (ctypes.c_void_p * count)(*(w.mlp_norm.data_ptr() for w in self.layers))
        self.matrices = (ctypes.c_void_p * (4 * count))(*(p for w in self.layers for p in w.pointers))
        self.kind_codes = torch.cat([w.kind_codes for w in self.layers])


def decoder_layers_blocks(x: torch.Tensor, weights: BlockModelWeights, shape, cos: torch.Tensor,
                          sin: torch.Tensor, kv: PagedLayer) -> None:
    """Every decoder layer in one C call (`decoder_layer_blocks` layer after layer): kv holds
    every layer's keys and values ([layers, blocks, ...]), the step's slots, tables and tiles."""
    lib = _require()
    rows, hidden = _checked_rows(x, shape, cos, sin, kv)
    layers = len(weights.layers)
    if kv.keys.dim() != 5 or kv.keys.shape[0] != layers:
        raise ValueError(f"kv must hold the keys of all {layers} layers")
    lib.labkit_decoder_layers_blocks(
        x.data_ptr(), rows, layers, hidden, shape.num_heads, shape.num_kv_heads, shape.head_dim,
        shape.intermediate_size, shape.rms_norm_eps, weights.attn_norms, weights.mlp_norms, weights.matrices,
        weights.kind_codes.data_ptr(), int(weights.quantize_x), cos.data_ptr(), sin.data_ptr(),
        kv.keys.data_ptr(), kv.values.data_ptr(), kv.keys[0].numel(), kv.new_blocks.data_ptr(),
        kv.new_slots.data_ptr(), kv.tables.data_ptr(), kv.tiles.data_ptr(), kv.tiles.shape[0], kv.tables.shape[1],
        kv.keys.shape[-1], int(_kv_bf16(kv.keys, kv.values)))


def _checked_rows(x: torch.Tensor, shape, cos: torch.Tensor, sin: torch.Tensor, kv: PagedLayer) -> tuple[int, int]:
    """x's (rows, hidden), or ValueError where x, cos, sin and the new slots do not describe
    the same rows of this model in the layout the C layer reads."""
    rows, hidden = x.shape
    if not (x.is_contiguous() and cos.is_contiguous() and sin.is_contiguous()) or x.dtype != torch.float32:
        raise ValueError("x, cos and sin must be contiguous float32")
    if cos.shape != (rows, shape.head_dim) or len(kv.new_blocks) != rows or hidden != shape.hidden_size:
        raise ValueError("x, cos, sin and the new slots must describe the same rows")
    return rows, hidden


def _kv_bf16(keys: torch.Tensor, values: torch.Tensor) -> bool:
    """Whether the pool holds bfloat16 (else float32); ValueError for anything else."""
    dtypes = {keys.dtype, values.dtype}
    if dtypes not in ({torch.float32}, {torch.bfloat16}) or not (keys.is_contiguous() and values.is_contiguous()):
        raise ValueError("the C kernels read contiguous float32 or bfloat16 keys and values (the same)")
    return dtypes == {torch.bfloat16}


TILE_ROWS = 16  # query rows of one sequence that share each block read (x group heads)
TILE_SCRATCH_BYTES = 256 * 1024  # a tile's queries, accumulators and scores, on a thread's stack


def tiles_for(segments: list[tuple[int, int, int, int]], tile_rows: int = TILE_ROWS) -> torch.Tensor:
    """The kernel's work list: each segment (table row, first packed row, row count, position
    of its first row) cut into tiles of at most `tile_rows` rows. int64 [tiles, 4]."""
    out = [(b, row + i, min(tile_rows, count - i), start + i)
           for b, row, count, start in segments for i in range(0, count, tile_rows)]
    return torch.tensor(out, dtype=torch.long).reshape(-1, 4)


def paged_attention(keys: torch.Tensor, values: torch.Tensor, tables: torch.Tensor,
                    tiles: torch.Tensor, q: torch.Tensor, checked: bool = False, lib=None) -> torch.Tensor:
    """Causal attention of packed query rows over their sequences' paged context.

    keys: one layer of the pool [blocks, kv_heads, D, block_size] (keys transposed in each
    block); values [blocks, kv_heads, block_size, D]; both contiguous, float32 or both
    bfloat16 (widened a block at a time as they are read). q float32.
    tables: int64 [batch, width], block ids (entries past what a tile reads are not read).
    tiles: int64 [T, 4] from `tiles_for`: (table row, first row, rows, first row's position);
    a row at position p attends to positions 0 .. p of its sequence, which must already be
    in the pool. The tiles must cover the rows of q exactly once.
    q: [rows, kv_heads, group, D]. Returns [rows, kv_heads, group, D].
    `checked=True` skips the checks (the caller ran `check_tiles` once for all layers).
    `lib`: another build of the kernels (`compile_library`), for tests."""
    lib = lib or _require()
    blocks, kv_heads, dim, block_size = keys.shape
    rows, heads, group, qdim = q.shape
    if (values.shape != (blocks, kv_heads, block_size, dim) or heads != kv_heads or qdim != dim
            or not keys.is_contiguous() or not values.is_contiguous()):
        raise ValueError("keys [blocks, kv_heads, D, block_size] and values [blocks, kv_heads, "
                         "block_size, D] must be contiguous and match q [rows, kv_heads, group, D]")
    if q.dtype != torch.float32:
        raise ValueError("the C kernel takes float32 queries")
    kernel = lib.labkit_paged_attention_bf16 if _kv_bf16(keys, values) else lib.labkit_paged_attention
    if not checked:
        tables, tiles = check_tiles(tables, tiles, rows, blocks, block_size, group, dim)
    q = q.contiguous()
    out = torch.empty_like(q)
    kernel(keys.data_ptr(), values.data_ptr(), tables.data_ptr(), tiles.data_ptr(), q.data_ptr(), out.data_ptr(),
           tiles.shape[0], tables.shape[1], block_size, kv_heads, group, dim, dim ** -0.5)
    return out


def paged_decode_attention(keys: torch.Tensor, values: torch.Tensor, tables: torch.Tensor,
                           lengths: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """One query per sequence (its newest token, at position length - 1) over its paged
    context: `paged_attention` with one one-row tile per sequence. tables: [B, width];
    lengths: [B] (>= 1); q: [B, kv_heads, group, D]. Returns [B, kv_heads, group, D]."""
    lengths = torch.as_tensor(lengths, dtype=torch.long)
    if lengths.dim() != 1 or lengths.shape[0] != q.shape[0]:
        raise ValueError("one length per query")
    if len(lengths) and int(lengths.min()) < 1:
        raise ValueError("every length must be at least 1")
    tiles = tiles_for([(b, b, 1, int(n) - 1) for b, n in enumerate(lengths)])
    return paged_attention(keys, values, tables, tiles, q)


def check_tiles(tables: torch.Tensor, tiles: torch.Tensor, rows: int, blocks: int, block_size: int,
                group: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Contiguous int64 copies of tables and tiles, or ValueError if the kernel would read or
    write outside its tensors: a tile naming a missing table row, rows not covered exactly
    once, a position past the table's capacity, a block id outside [0, blocks), a tile too
    big for the kernel's per-thread scratch."""
    tables = torch.as_tensor(tables).to(torch.long).contiguous()
    tiles = torch.as_tensor(tiles).to(torch.long).contiguous()
    if tables.dim() != 2 or tiles.dim() != 2 or tiles.shape[1] != 4:
        raise ValueError("tables must be [batch, width] and tiles [T, 4]")
    if not len(tiles):
        if rows:
            raise ValueError("the tiles must cover every query row exactly once")
        return tables, tiles
    b, first, count, start = tiles.unbind(1)
    if int(b.min()) < 0 or int(b.max()) >= tables.shape[0]:
        raise ValueError("a tile names a table row that does not exist")
    if int(count.min()) < 1 or int(start.min()) < 0:
        raise ValueError("every tile needs at least one row and a position >= 0")
    if int(count.max()) * group * (2 * dim + block_size) * 4 > TILE_SCRATCH_BYTES:
        raise ValueError("a tile has too many rows for the kernel's scratch (see tiles_for)")
    if int((start + count).max()) > tables.shape[1] * block_size:
        raise ValueError("a tile's positions run past its table's capacity (length)")
    order = first.argsort()
    ends = (first + count)[order]
    if int(first[order[0]]) != 0 or int(ends[-1]) != rows or not torch.equal(first[order][1:], ends[:-1]):
        raise ValueError("the tiles must cover every query row exactly once")
    if tables.numel() and (int(tables.min()) < 0 or int(tables.max()) >= blocks):
        raise ValueError("block id outside the pool")
    return tables, tiles


def _require():
    lib = load()
    if lib is None:
        raise RuntimeError(f"the C kernels are unavailable: {why_unavailable()}")
    return lib
