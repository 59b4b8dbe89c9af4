"""Two decode kernels written in C and compiled on the reader's machine: a matrix-vector
product and paged attention.

**gemv.** Decoding one token multiplies one activation row by every weight matrix, reading
each weight exactly once: the step is bound by how fast the kernel streams weights from
memory, not by arithmetic. The kernel below is the plainest one that streams well: every
thread takes a contiguous band of weight rows, and each row is one dot product with the
activation (which stays in L1), vectorized by the compiler (`omp simd`). On the book's
2-core machine it streamed the 30 layers' matrices at about 26 GB/s where MKL's `F.linear`
managed about 12 and oneDNN's packed kernel about 20 (chapter 18 times a decode step with
each).

**paged_decode_attention.** One query per sequence (its newest token) attends over the
keys and values its block table names, read in place from the KV pool: for each sequence
a thread walks the table block by block with the online softmax of chapter 13 (running
maximum, running sum, rescaled accumulator). The pool stores each block's keys transposed
([head_dim, block_size]), so a query's scores against all slots of a block are vector
multiply-adds over the slots, with no per-slot dot product to reduce. Nothing is gathered
or padded, so a batch of sequences of different lengths reads each cached key once. `labkit.engine`'s
reference path (gather the blocks, pad, one `scaled_dot_product_attention` call) computes
the same numbers; the tests hold one to the other.

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

/* exp(x) for x <= 0 (softmax weights), to float precision (Cephes' expf polynomial):
   written out so the compiler can vectorize it, which it will not do for libm's expf. */
static inline float exp_nonpositive(float x) {
  x = x < -87.0f ? -87.0f : x;
  const float n = floorf(x * 1.44269504088896341f + 0.5f);
  x -= n * 0.693359375f;
  x -= n * -2.12194440e-4f;
  const float z = x * x;
  float y = ((((1.9875691500e-4f * x + 1.3981999507e-3f) * x + 8.3334519073e-3f) * x
              + 4.1665795894e-2f) * x + 1.6666665459e-1f) * x + 5.0000001201e-1f;
  y = y * z + x + 1.0f;
  union { int i; float f; } scale = { .i = ((int)n + 127) << 23 };
  return y * scale.f;
}

/* One query head against one block of n slots (n <= bs): scores, online-softmax update of
   (best, total, orow). k: [dim][bs] keys transposed, v: [bs][dim] values. */
static inline void attend_block(const float* qr, const float* k, const float* v, long n, long bs,
                                long dim, float scale, float* best, float* total, float* orow) {
  float p[bs];
  for (long t = 0; t < bs; t++) p[t] = 0.0f;
  for (long i = 0; i < dim; i++) {  /* the scores of every slot at once */
    const float qi = qr[i] * scale;
    #pragma omp simd
    for (long t = 0; t < bs; t++) p[t] += qi * k[i * bs + t];
  }
  float new_max = *best;
  for (long t = 0; t < n; t++) new_max = p[t] > new_max ? p[t] : new_max;
  const float rescale = *best == -INFINITY ? 0.0f : exp_nonpositive(*best - new_max);
  float sum = 0.0f;
  #pragma omp simd reduction(+:sum)
  for (long t = 0; t < bs; t++) {
    p[t] = t < n ? exp_nonpositive(p[t] - new_max) : 0.0f;
    sum += p[t];
  }
  *total = *total * rescale + sum;
  *best = new_max;
  for (long i = 0; i < dim; i++) orow[i] *= rescale;
  for (long t = 0; t < n; t++) {
    const float w = p[t];
    #pragma omp simd
    for (long i = 0; i < dim; i++) orow[i] += w * v[t * dim + i];
  }
}

/* out[b, r, :] = softmax(scale * q[b, r] . K) V over positions 0 .. lengths[b]-1 of sequence b,
   whose position p lives in block tables[b, p / block_size], slot p % block_size.
   keys (one layer): [blocks, kv_heads, dim, block_size] (transposed in the block);
   values: [blocks, kv_heads, block_size, dim];
   q, out: [batch, kv_heads * group, dim] (query head r reads kv head r / group);
   tables: [batch, width]; lengths: [batch] */
void labkit_paged_decode(const float* keys, const float* values, const long* tables,
                         const long* lengths, const float* q, float* out, long batch, long width,
                         long block_size, long kv_heads, long group, long dim, float scale) {
  const long head_stride = dim * block_size, block_stride = kv_heads * head_stride;
  const long heads = kv_heads * group;
  #pragma omp parallel for schedule(dynamic)
  for (long b = 0; b < batch; b++) {  /* one sequence per task: its blocks are read in order */
    const float* qb = q + b * heads * dim;
    float* ob = out + b * heads * dim;
    float best[heads], total[heads];  /* running maximum and sum per query head */
    for (long r = 0; r < heads; r++) best[r] = -INFINITY, total[r] = 0.0f;
    for (long i = 0; i < heads * dim; i++) ob[i] = 0.0f;
    const long length = lengths[b];
    for (long j = 0; j * block_size < length; j++) {
      const long n = length - j * block_size < block_size ? length - j * block_size : block_size;
      const long offset = tables[b * width + j] * block_stride;
      for (long r = 0; r < heads; r++) {
        const float* k = keys + offset + (r / group) * head_stride;
        const float* v = values + offset + (r / group) * head_stride;
        if (block_size == 16 && dim == 64)  /* the common shape, unrolled by the compiler */
          attend_block(qb + r * dim, k, v, n, 16, 64, scale, best + r, total + r, ob + r * dim);
        else
          attend_block(qb + r * dim, k, v, n, block_size, dim, scale, best + r, total + r, ob + r * dim);
      }
    }
    for (long r = 0; r < heads; r++)
      for (long i = 0; i < dim; i++) ob[r * dim + i] /= total[r];
  }
}
"""

FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")
MAX_ROWS = 4  # beyond a few rows a blocked GEMM (oneDNN, MKL) reuses weights better

_state: dict = {}
_SIGNATURES = {
    "labkit_gemv": [ctypes.c_void_p] * 3 + [ctypes.c_long] * 3,
    "labkit_paged_decode": [ctypes.c_void_p] * 6 + [ctypes.c_long] * 6 + [ctypes.c_float],
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


def paged_decode_attention(keys: torch.Tensor, values: torch.Tensor, tables: torch.Tensor,
                           lengths: torch.Tensor, q: torch.Tensor, checked: bool = False) -> torch.Tensor:
    """Attention of one query per sequence over its paged context (see the module docstring).

    keys: one layer of the pool [blocks, kv_heads, D, block_size] (keys transposed in
    each block); values [blocks, kv_heads, block_size, D]; both contiguous float32;
    tables: int64 [B, width], block ids (entries past a sequence's length are not read);
    lengths: int64 [B], context length of each sequence (>= 1);
    q: [B, kv_heads, group, D]. Returns [B, kv_heads, group, D].
    `checked=True` skips the checks of tables and lengths (the caller ran `check_tables`
    on them once for all layers)."""
    lib = _require()
    blocks, kv_heads, dim, block_size = keys.shape
    batch, heads, group, qdim = q.shape
    if (values.shape != (blocks, kv_heads, block_size, dim) or heads != kv_heads or qdim != dim
            or not keys.is_contiguous() or not values.is_contiguous()):
        raise ValueError("keys [blocks, kv_heads, D, block_size] and values [blocks, kv_heads, "
                         "block_size, D] must be contiguous and match q [B, kv_heads, group, D]")
    if {keys.dtype, values.dtype, q.dtype} != {torch.float32}:
        raise ValueError("the C kernel takes float32 tensors")
    if not checked:
        tables, lengths = check_tables(tables, lengths, batch, blocks, block_size)
    q = q.contiguous()
    out = torch.empty_like(q)
    lib.labkit_paged_decode(keys.data_ptr(), values.data_ptr(), tables.data_ptr(), lengths.data_ptr(),
                            q.data_ptr(), out.data_ptr(), batch, tables.shape[1], block_size,
                            kv_heads, group, dim, dim ** -0.5)
    return out


def check_tables(tables: torch.Tensor, lengths: torch.Tensor, batch: int, blocks: int,
                 block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Contiguous int64 copies of tables and lengths, or ValueError if the kernel would read
    outside the pool: a wrong shape, a length outside [1, width * block_size], a block id
    outside [0, blocks)."""
    tables = tables.to(torch.long).contiguous()
    lengths = lengths.to(torch.long).contiguous()
    if tables.dim() != 2 or tables.shape[0] != batch or lengths.shape != (batch,):
        raise ValueError("one table row and one length per query")
    if batch and (int(lengths.min()) < 1 or int(lengths.max()) > tables.shape[1] * block_size):
        raise ValueError("every length must be between 1 and the table's capacity")
    if tables.numel() and (int(tables.min()) < 0 or int(tables.max()) >= blocks):
        raise ValueError("block id outside the pool")
    return tables, lengths


def _require():
    lib = load()
    if lib is None:
        raise RuntimeError(f"the C kernels are unavailable: {why_unavailable()}")
    return lib
