"""Two kernels written in C and compiled on the reader's machine: a matrix-vector product
for decode, and paged attention for every step.

**gemv.** Decoding one token multiplies one activation row by every weight matrix, reading
each weight exactly once: the step is bound by how fast the kernel streams weights from
memory, not by arithmetic. The kernel below is the plainest one that streams well: every
thread takes a contiguous band of weight rows, and each row is one dot product with the
activation (which stays in L1), vectorized by the compiler (`omp simd`). On the book's
2-core machine it streamed the 30 layers' matrices at about 26 GB/s where MKL's `F.linear`
managed about 12 and oneDNN's packed kernel about 20 (chapter 18 times a decode step with
each).

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

Both are compiled once with the system C compiler (`$CC`, default `cc`) into
`$LABKIT_CACHE/kernels/` and loaded with ctypes. The OpenMP runtime they link is the one
PyTorch already loaded (same soname), so the kernels share PyTorch's threads and obey
`torch.set_num_threads`. Without a compiler (or on a platform where the build fails, or
with `LABKIT_NATIVE=0`) `load()` returns None and callers use the library kernels;
`why_unavailable()` says why.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

SOURCE = r"""
#include <math.h>

/* Y[m, o] = sum_i W[o, i] * X[m, i]   W: out x n, X: rows x n, Y: rows x out, all row-major */
void labkit_gemv(const float* W, const float* X, float* Y, long rows, long out, long n) {
  #pragma omp parallel for schedule(static)
  for (long o = 0; o < out; o++) {
    const float* w = W + o * n;
    for (long m = 0; m < rows; m++) {
      const float* x = X + m * n;
      float s = 0.0f;
      #pragma omp simd reduction(+:s)
      for (long i = 0; i < n; i++) s += w[i] * x[i];
      Y[m * out + o] = s;
    }
  }
}

/* ---- paged attention ----------------------------------------------------------------- */

/* Vector types (a GCC and Clang extension): the compiler maps them onto whatever vector
   registers the machine has. */
typedef float v16 __attribute__((vector_size(64)));
typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));
typedef int v16i __attribute__((vector_size(64)));
typedef int v8i __attribute__((vector_size(32)));
typedef int v4i __attribute__((vector_size(16)));

static inline v16 load16(const float* p) { v16 v; __builtin_memcpy(&v, p, sizeof v); return v; }
static inline void store16(float* p, v16 v) { __builtin_memcpy(p, &v, sizeof v); }
static inline v16 select16(v16i mask, v16 yes, v16 no) {
  return (v16)((mask & (v16i)yes) | (~mask & (v16i)no));
}
static inline v8 select8(v8i mask, v8 yes, v8 no) { return (v8)((mask & (v8i)yes) | (~mask & (v8i)no)); }
static inline v4 select4(v4i mask, v4 yes, v4 no) { return (v4)((mask & (v4i)yes) | (~mask & (v4i)no)); }

/* exp(x) for x <= 0 (softmax weights) on 16 lanes, to float precision (Cephes' expf
   polynomial): written out so the compiler vectorizes it, which it will not do for libm's. */
static inline v16 exp16(v16 x) {
  const v16 zero = {0};
  x = select16(x < -87.0f, zero - 87.0f, x);
  const v16 n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  /* round to nearest */
  x -= n * 0.693359375f;
  x -= n * -2.12194440e-4f;
  const v16 z = x * x;
  v16 y = ((((1.9875691500e-4f * x + 1.3981999507e-3f) * x + 8.3334519073e-3f) * x
            + 4.1665795894e-2f) * x + 1.6666665459e-1f) * x + 5.0000001201e-1f;
  y = y * z + x + 1.0f;
  return y * (v16)((__builtin_convertvector(n, v16i) + 127) << 23);
}

static inline float exp_nonpositive(float x) {  /* the same for one value */
  const v16 lanes = {x};
  return exp16(lanes)[0];
}

/* The maximum (max = 1) or the sum (max = 0) of 16 lanes, folding halves in registers. */
static inline float reduce16(v16 x, int max) {
  v8 a, b;
  __builtin_memcpy(&a, &x, 32), __builtin_memcpy(&b, (char*)&x + 32, 32);
  a = max ? select8(a > b, a, b) : a + b;
  v4 c, d;
  __builtin_memcpy(&c, &a, 16), __builtin_memcpy(&d, (char*)&a + 16, 16);
  c = max ? select4(c > d, c, d) : c + d;
  const float x01 = max ? (c[0] > c[1] ? c[0] : c[1]) : c[0] + c[1];
  const float x23 = max ? (c[2] > c[3] ? c[2] : c[3]) : c[2] + c[3];
  return max ? (x01 > x23 ? x01 : x23) : x01 + x23;
}

/* The generic shape: one query's scores against a block, s[t] = q . k[:, t] (q pre-scaled). */
static void block_scores(const float* k, const float* q, float* s, long bs, long dim) {
  for (long t = 0; t < bs; t++) s[t] = 0.0f;
  for (long d = 0; d < dim; d++) {
    const float x = q[d];
    #pragma omp simd
    for (long t = 0; t < bs; t++) s[t] += x * k[d * bs + t];
  }
}

/* The generic shape: one query's online-softmax step over a block whose first `visible`
   slots are in its past; s becomes the weights, acc is rescaled to the new maximum. */
static void block_softmax(float* s, long visible, long bs, long dim, float* best, float* total,
                          float* acc) {
  float top = *best;
  for (long t = 0; t < visible; t++) top = s[t] > top ? s[t] : top;
  float sum = 0.0f;
  for (long t = 0; t < bs; t++) {
    s[t] = t < visible ? exp_nonpositive(s[t] - top) : 0.0f;
    sum += s[t];
  }
  const float rescale = *best == -INFINITY ? 0.0f : exp_nonpositive(*best - top);
  *total = *total * rescale + sum;
  *best = top;
  for (long d = 0; d < dim; d++) acc[d] *= rescale;
}

/* The model's shape (block_size 16, head_dim 64): a block's key row (16 slots) is one
   vector, a value row four. Queries go four at a time, so each key and value row is loaded
   once per four queries and the partial sums stay in registers. */
static void scores_16x64(const float* k, const float (*qs)[64], float (*s)[16], long first, long padded) {
  for (long qi = first; qi < padded; qi += 4) {
    v16 s0 = {0}, s1 = {0}, s2 = {0}, s3 = {0};
    for (long d = 0; d < 64; d++) {
      const v16 kd = load16(k + d * 16);
      s0 += qs[qi][d] * kd;
      s1 += qs[qi + 1][d] * kd;
      s2 += qs[qi + 2][d] * kd;
      s3 += qs[qi + 3][d] * kd;
    }
    store16(s[qi], s0), store16(s[qi + 1], s1), store16(s[qi + 2], s2), store16(s[qi + 3], s3);
  }
}

static inline void softmax_16(float* s, long visible, float* best, float* total, float* acc) {
  const v16i lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  const v16i mask = lane < (int)visible;
  const v16 zero = {0};
  const v16 scores = select16(mask, load16(s), zero - INFINITY);
  const float found = reduce16(scores, 1), top = found > *best ? found : *best;
  const v16 p = select16(mask, exp16(scores - top), zero);
  store16(s, p);
  const float rescale = *best == -INFINITY ? 0.0f : exp_nonpositive(*best - top);
  *total = *total * rescale + reduce16(p, 0);
  *best = top;
  if (rescale != 1.0f)
    for (int d = 0; d < 64; d++) acc[d] *= rescale;
}

static void values_16x64(const float* v, const float (*s)[16], float (*acc)[64], long first, long padded) {
  for (long qi = first; qi < padded; qi += 4)
    for (long h = 0; h < 64; h += 32) {  /* half a row at a time: 8 accumulators */
      v16 a0 = load16(acc[qi] + h), b0 = load16(acc[qi] + h + 16);
      v16 a1 = load16(acc[qi + 1] + h), b1 = load16(acc[qi + 1] + h + 16);
      v16 a2 = load16(acc[qi + 2] + h), b2 = load16(acc[qi + 2] + h + 16);
      v16 a3 = load16(acc[qi + 3] + h), b3 = load16(acc[qi + 3] + h + 16);
      for (long t = 0; t < 16; t++) {
        const v16 va = load16(v + t * 64 + h), vb = load16(v + t * 64 + h + 16);
        a0 += s[qi][t] * va, b0 += s[qi][t] * vb;
        a1 += s[qi + 1][t] * va, b1 += s[qi + 1][t] * vb;
        a2 += s[qi + 2][t] * va, b2 += s[qi + 2][t] * vb;
        a3 += s[qi + 3][t] * va, b3 += s[qi + 3][t] * vb;
      }
      store16(acc[qi] + h, a0), store16(acc[qi] + h + 16, b0);
      store16(acc[qi + 1] + h, a1), store16(acc[qi + 1] + h + 16, b1);
      store16(acc[qi + 2] + h, a2), store16(acc[qi + 2] + h + 16, b2);
      store16(acc[qi + 3] + h, a3), store16(acc[qi + 3] + h + 16, b3);
    }
}

/* One task: query rows 0 .. n-1 of a tile (one sequence, positions p0 .. p0+n-1) for the
   `group` query heads of KV head h, over the sequence's positions 0 .. p0+n-1, with the
   online softmax of chapter 13. Row i sees positions 0 .. p0+i (causal). Query vector
   qi = i * group + g is row i, head h * group + g; their count is padded to a multiple of
   4 with zero queries for the vector path. */
static inline void attend_tile(const float* keys, const float* values, const long* table,
                               const float* q, float* out, long n, long p0, long h, long heads,
                               long group, long bs, long dim, long head_stride, long block_stride,
                               float scale) {
  const int fast = bs == 16 && dim == 64;
  const long nq = n * group, padded = (nq + 3) / 4 * 4;
  float qs[padded][dim], acc[padded][dim], s[padded][bs], best[padded], total[padded];
  for (long qi = 0; qi < padded; qi++) {
    const float* src = q + ((qi / group) * heads + h * group + qi % group) * dim;
    for (long d = 0; d < dim; d++) qs[qi][d] = qi < nq ? src[d] * scale : 0.0f, acc[qi][d] = 0.0f;
    best[qi] = -INFINITY, total[qi] = 0.0f;
  }
  const long last = p0 + n - 1;
  for (long j = 0; j * bs <= last; j++) {
    const long base = j * bs, offset = table[j] * block_stride + h * head_stride;
    const float* k = keys + offset;   /* [dim][bs] */
    const float* v = values + offset; /* [bs][dim] */
    if ((j + 1) * bs <= last) {  /* ask for the next block now: tables scatter blocks, so the
                                    hardware prefetcher cannot guess where it is */
      const long next = table[j + 1] * block_stride + h * head_stride;
      for (long line = 0; line < head_stride; line += 16)
        __builtin_prefetch(keys + next + line, 0, 3), __builtin_prefetch(values + next + line, 0, 3);
    }
    /* rows before base - p0 see none of this block; start at a multiple of 4 */
    const long first = (base > p0 ? base - p0 : 0) * group / 4 * 4;
    if (fast)
      scores_16x64(k, (const float (*)[64])qs, (float (*)[16])s, first, padded);
    else
      for (long qi = first; qi < nq; qi++) block_scores(k, qs[qi], s[qi], bs, dim);
    for (long qi = first; qi < padded; qi++) {
      long visible = p0 + qi / group - base + 1;
      visible = visible < bs ? visible : bs;
      if (qi >= nq || visible <= 0) {  /* padding, or a row before this block: no weight */
        for (long t = 0; t < bs; t++) s[qi][t] = 0.0f;
      } else if (fast) {
        softmax_16(s[qi], visible, best + qi, total + qi, acc[qi]);
      } else {
        block_softmax(s[qi], visible, bs, dim, best + qi, total + qi, acc[qi]);
      }
    }
    if (fast)
      values_16x64(v, (const float (*)[16])s, (float (*)[64])acc, first, padded);
    else
      for (long qi = first; qi < nq; qi++)
        for (long t = 0; t < bs; t++) {
          const float w = s[qi][t];
          #pragma omp simd
          for (long d = 0; d < dim; d++) acc[qi][d] += w * v[t * dim + d];
        }
  }
  for (long qi = 0; qi < nq; qi++) {
    float* dst = out + ((qi / group) * heads + h * group + qi % group) * dim;
    const float inv = 1.0f / total[qi];
    for (long d = 0; d < dim; d++) dst[d] = acc[qi][d] * inv;
  }
}

/* Causal attention of packed query rows over paged context.
   keys (one layer): [blocks, kv_heads, dim, block_size] (transposed in the block);
   values: [blocks, kv_heads, block_size, dim];
   q, out: [rows, kv_heads * group, dim] (query head r reads kv head r / group);
   tiles: [num_tiles, 4] of (table row b, first query row r0, row count n, position p0 of
   row r0): rows r0 .. r0+n-1 are positions p0 .. p0+n-1 of the sequence whose blocks
   tables[b] lists; tables: [batch, width]. Each (tile, KV head) is one task. */
void labkit_paged_attention(const float* keys, const float* values, const long* tables,
                            const long* tiles, const float* q, float* out, long num_tiles,
                            long width, long block_size, long kv_heads, long group, long dim,
                            float scale) {
  const long head_stride = dim * block_size, block_stride = kv_heads * head_stride;
  const long heads = kv_heads * group;
  #pragma omp parallel for collapse(2) schedule(dynamic)
  for (long i = 0; i < num_tiles; i++) {
    for (long h = 0; h < kv_heads; h++) {
      const long* tile = tiles + 4 * i;
      const long* table = tables + tile[0] * width;
      const float* qt = q + tile[1] * heads * dim;
      float* ot = out + tile[1] * heads * dim;
      if (block_size == 16 && dim == 64)  /* constants, so the compiler unrolls */
        attend_tile(keys, values, table, qt, ot, tile[2], tile[3], h, heads, group, 16, 64,
                    head_stride, block_stride, scale);
      else
        attend_tile(keys, values, table, qt, ot, tile[2], tile[3], h, heads, group, block_size,
                    dim, head_stride, block_stride, scale);
    }
  }
}
"""

FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")
MAX_ROWS = 4  # beyond a few rows a blocked GEMM (oneDNN, MKL) reuses weights better

_state: dict = {}
_SIGNATURES = {
    "labkit_gemv": [ctypes.c_void_p] * 3 + [ctypes.c_long] * 3,
    "labkit_paged_attention": [ctypes.c_void_p] * 6 + [ctypes.c_long] * 6 + [ctypes.c_float],
}


def _build(target: Path) -> None:
    compiler = os.environ.get("CC", "cc")
    if shutil.which(compiler) is None:
        raise RuntimeError(f"no C compiler {compiler!r} on PATH")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        source, built = Path(tmp) / "kernels.c", Path(tmp) / target.name
        source.write_text(SOURCE)
        result = subprocess.run([compiler, *FLAGS, str(source), "-o", str(built)],
                                capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {result.stderr.strip()[-500:]}")
        os.replace(built, target)  # atomic: a concurrent loader sees all of it or nothing


def load():
    """The compiled library (ctypes), or None when it cannot be built here."""
    if "lib" not in _state:
        from labkit.models.registry import cache_root
        digest = hashlib.sha256((SOURCE + " ".join(FLAGS)).encode()).hexdigest()[:16]
        target = cache_root() / "kernels" / f"labkit_kernels-{digest}.so"
        try:
            if os.environ.get("LABKIT_NATIVE", "1") == "0":
                raise RuntimeError("switched off by LABKIT_NATIVE=0")
            if not target.exists():
                _build(target)
            lib = ctypes.CDLL(str(target))
            for name, argtypes in _SIGNATURES.items():
                getattr(lib, name).argtypes = argtypes
                getattr(lib, name).restype = None
            _state["lib"], _state["why"] = lib, None
        except (OSError, RuntimeError) as error:
            _state["lib"], _state["why"] = None, str(error)
    return _state["lib"]


def why_unavailable() -> str | None:
    load()
    return _state["why"]


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


TILE_ROWS = 16  # query rows of one sequence that share each block read (x group heads)
TILE_SCRATCH_BYTES = 256 * 1024  # a tile's queries, accumulators and scores, on a thread's stack


def tiles_for(segments: list[tuple[int, int, int, int]], tile_rows: int = TILE_ROWS) -> torch.Tensor:
    """The kernel's work list: each segment (table row, first packed row, row count, position
    of its first row) cut into tiles of at most `tile_rows` rows. int64 [tiles, 4]."""
    out = [(b, row + i, min(tile_rows, count - i), start + i)
           for b, row, count, start in segments for i in range(0, count, tile_rows)]
    return torch.tensor(out, dtype=torch.long).reshape(-1, 4)


def paged_attention(keys: torch.Tensor, values: torch.Tensor, tables: torch.Tensor,
                    tiles: torch.Tensor, q: torch.Tensor, checked: bool = False) -> torch.Tensor:
    """Causal attention of packed query rows over their sequences' paged context.

    keys: one layer of the pool [blocks, kv_heads, D, block_size] (keys transposed in each
    block); values [blocks, kv_heads, block_size, D]; both contiguous float32.
    tables: int64 [batch, width], block ids (entries past what a tile reads are not read).
    tiles: int64 [T, 4] from `tiles_for`: (table row, first row, rows, first row's position);
    a row at position p attends to positions 0 .. p of its sequence, which must already be
    in the pool. The tiles must cover the rows of q exactly once.
    q: [rows, kv_heads, group, D]. Returns [rows, kv_heads, group, D].
    `checked=True` skips the checks (the caller ran `check_tiles` once for all layers)."""
    lib = _require()
    blocks, kv_heads, dim, block_size = keys.shape
    rows, heads, group, qdim = q.shape
    if (values.shape != (blocks, kv_heads, block_size, dim) or heads != kv_heads or qdim != dim
            or not keys.is_contiguous() or not values.is_contiguous()):
        raise ValueError("keys [blocks, kv_heads, D, block_size] and values [blocks, kv_heads, "
                         "block_size, D] must be contiguous and match q [rows, kv_heads, group, D]")
    if {keys.dtype, values.dtype, q.dtype} != {torch.float32}:
        raise ValueError("the C kernel takes float32 tensors")
    if not checked:
        tables, tiles = check_tiles(tables, tiles, rows, blocks, block_size, group, dim)
    q = q.contiguous()
    out = torch.empty_like(q)
    lib.labkit_paged_attention(keys.data_ptr(), values.data_ptr(), tables.data_ptr(), tiles.data_ptr(),
                               q.data_ptr(), out.data_ptr(), tiles.shape[0], tables.shape[1], block_size,
                               kv_heads, group, dim, dim ** -0.5)
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
