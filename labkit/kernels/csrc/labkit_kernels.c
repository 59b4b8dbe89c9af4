/* labkit's C kernels: the matrix-vector product for decode (labkit_gemv) and paged attention
   (labkit_paged_attention). labkit/kernels/native.py describes them, compiles this file on
   first use into $LABKIT_CACHE/kernels/ and calls it through ctypes. */

#include <math.h>

void labkit_bf16_widen(const unsigned short* src, float* dst, long count);  /* bf16.c */

/* Which code paths this build compiled (labkit.kernels.native.build_features): 1 = the
   AVX2 + FMA intrinsics of bf16.c and gguf_blocks.c, 2 = 16-lane vectors (AVX-512) in the
   attention kernel (8 lanes otherwise), 4 = F16C half-float conversion. The compiler
   decides from the -march the library was built with, so this reports what will run. */
long labkit_build_features(void) {
  long bits = 0;
#if defined(__AVX2__) && defined(__FMA__)
  bits |= 1;
#endif
#if defined(__AVX512F__)
  bits |= 2;
#endif
#if defined(__F16C__)
  bits |= 4;
#endif
  return bits;
}

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

/* Vector types (a GCC and Clang extension), as wide as the machine's registers: 16 lanes
   with AVX-512, 8 with AVX2. A type wider than the registers is legal but slow: without
   AVX-512 the compiler splits a 16-lane vector into halves and spills them to the stack,
   which once made this kernel six times slower than memory on an AVX2 machine. */
#if defined(__AVX512F__)
#define VL 16
#else
#define VL 8
#endif
typedef float vf __attribute__((vector_size(4 * VL)));
typedef int vfi __attribute__((vector_size(4 * VL)));

static inline vf loadv(const float* p) { vf v; __builtin_memcpy(&v, p, sizeof v); return v; }
static inline void storev(float* p, vf v) { __builtin_memcpy(p, &v, sizeof v); }
static inline vf selectv(vfi mask, vf yes, vf no) { return (vf)((mask & (vfi)yes) | (~mask & (vfi)no)); }

/* exp(x) for x <= 0 (softmax weights) on every lane, to float precision (Cephes' expf
   polynomial): written out so the compiler vectorizes it, which it will not do for libm's. */
static inline vf expv(vf x) {
  const vf zero = {0};
  x = selectv(x < -87.0f, zero - 87.0f, x);
  const vf n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  /* round to nearest */
  x -= n * 0.693359375f;
  x -= n * -2.12194440e-4f;
  const vf z = x * x;
  vf y = ((((1.9875691500e-4f * x + 1.3981999507e-3f) * x + 8.3334519073e-3f) * x
           + 4.1665795894e-2f) * x + 1.6666665459e-1f) * x + 5.0000001201e-1f;
  y = y * z + x + 1.0f;
  return y * (vf)((__builtin_convertvector(n, vfi) + 127) << 23);
}

static inline float exp_nonpositive(float x) {  /* the same for one value */
  const vf lanes = {x};
  return expv(lanes)[0];
}

static inline float lane_max(vf x) {
  float m = x[0];
  for (int i = 1; i < VL; i++) m = x[i] > m ? x[i] : m;
  return m;
}

static inline float lane_sum(vf x) {
  float t = 0.0f;
  for (int i = 0; i < VL; i++) t += x[i];
  return t;
}

/* SwiGLU's activation for each row of gate_up [rows, 2 * inter] (gate, then up):
   act[r, i] = silu(g) u with silu(g) = g / (1 + e^-g), VL lanes at a time. libm's expf,
   one value at a time, made this cost a decode step more than some of its matrix
   products. expv takes x <= 0, so e = exp(-|g|): silu(g) = g / (1 + e) for g >= 0 and
   g e / (1 + e) below. */
void labkit_silu_mul(const float* gate_up, float* act, long rows, long inter) {
  const vf zero = {0};
  for (long r = 0; r < rows; r++) {
    const float* g = gate_up + r * 2 * inter;
    const float* u = g + inter;
    float* a = act + r * inter;
    long i = 0;
    for (; i + VL <= inter; i += VL) {
      const vf gv = loadv(g + i), e = expv(selectv(gv < zero, gv, zero - gv));
      storev(a + i, selectv(gv >= zero, gv, gv * e) / (1.0f + e) * loadv(u + i));
    }
    for (; i < inter; i++) {
      const float e = exp_nonpositive(g[i] < 0.0f ? g[i] : -g[i]);
      a[i] = (g[i] >= 0.0f ? g[i] : g[i] * e) / (1.0f + e) * u[i];
    }
  }
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

/* The model's shape (block_size 16, head_dim 64). */
/* A block's key row (16 slots) is 16 / VL vectors, a value row 64 / VL. Queries go four at
   a time, so each key and value vector is loaded once per four queries and the partial sums
   stay in registers (4 queries x 2 vectors: 8 accumulators, 10 registers with the loads). */
static void scores_16x64(const float* k, const float (*qs)[64], float (*s)[16], long first, long padded) {
  for (long qi = first; qi < padded; qi += 4) {
    vf a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, b0 = {0}, b1 = {0}, b2 = {0}, b3 = {0};
    for (long d = 0; d < 64; d++) {  /* slots 0 .. VL-1 in a*, VL .. 15 in b* (AVX2 only) */
      const vf ka = loadv(k + d * 16);
      a0 += qs[qi][d] * ka, a1 += qs[qi + 1][d] * ka;
      a2 += qs[qi + 2][d] * ka, a3 += qs[qi + 3][d] * ka;
      if (VL < 16) {
        const vf kb = loadv(k + d * 16 + VL);
        b0 += qs[qi][d] * kb, b1 += qs[qi + 1][d] * kb;
        b2 += qs[qi + 2][d] * kb, b3 += qs[qi + 3][d] * kb;
      }
    }
    storev(s[qi], a0), storev(s[qi + 1], a1), storev(s[qi + 2], a2), storev(s[qi + 3], a3);
    if (VL < 16)
      storev(s[qi] + VL, b0), storev(s[qi + 1] + VL, b1), storev(s[qi + 2] + VL, b2),
      storev(s[qi + 3] + VL, b3);
  }
}

static inline void softmax_16(float* s, long visible, float* best, float* total, float* acc) {
  vfi lane;
  for (int i = 0; i < VL; i++) lane[i] = i;
  const vf zero = {0};
  vf scores[16 / VL];
  float found = -INFINITY;
  for (int c = 0; c < 16 / VL; c++) {
    scores[c] = selectv(lane + c * VL < (int)visible, loadv(s + c * VL), zero - INFINITY);
    const float m = lane_max(scores[c]);
    found = m > found ? m : found;
  }
  const float top = found > *best ? found : *best;
  float sum = 0.0f;
  for (int c = 0; c < 16 / VL; c++) {
    const vf p = selectv(lane + c * VL < (int)visible, expv(scores[c] - top), zero);
    storev(s + c * VL, p);
    sum += lane_sum(p);
  }
  const float rescale = *best == -INFINITY ? 0.0f : exp_nonpositive(*best - top);
  *total = *total * rescale + sum;
  *best = top;
  if (rescale != 1.0f)
    for (int d = 0; d < 64; d++) acc[d] *= rescale;
}

static void values_16x64(const float* v, const float (*s)[16], float (*acc)[64], long first, long padded) {
  for (long qi = first; qi < padded; qi += 4)
    for (long h = 0; h < 64; h += 2 * VL) {  /* two vectors of a row at a time */
      vf a0 = loadv(acc[qi] + h), b0 = loadv(acc[qi] + h + VL);
      vf a1 = loadv(acc[qi + 1] + h), b1 = loadv(acc[qi + 1] + h + VL);
      vf a2 = loadv(acc[qi + 2] + h), b2 = loadv(acc[qi + 2] + h + VL);
      vf a3 = loadv(acc[qi + 3] + h), b3 = loadv(acc[qi + 3] + h + VL);
      for (long t = 0; t < 16; t++) {
        const vf va = loadv(v + t * 64 + h), vb = loadv(v + t * 64 + h + VL);
        a0 += s[qi][t] * va, b0 += s[qi][t] * vb;
        a1 += s[qi + 1][t] * va, b1 += s[qi + 1][t] * vb;
        a2 += s[qi + 2][t] * va, b2 += s[qi + 2][t] * vb;
        a3 += s[qi + 3][t] * va, b3 += s[qi + 3][t] * vb;
      }
      storev(acc[qi] + h, a0), storev(acc[qi] + h + VL, b0);
      storev(acc[qi + 1] + h, a1), storev(acc[qi + 1] + h + VL, b1);
      storev(acc[qi + 2] + h, a2), storev(acc[qi + 2] + h + VL, b2);
      storev(acc[qi + 3] + h, a3), storev(acc[qi + 3] + h + VL, b3);
    }
}

/* One task: query rows 0 .. n-1 of a tile (one sequence, positions p0 .. p0+n-1) for the
   `group` query heads of KV head h, over the sequence's positions 0 .. p0+n-1, with the
   online softmax of chapter 13. Row i sees positions 0 .. p0+i (causal). Query vector
   qi = i * group + g is row i, head h * group + g; their count is padded to a multiple of
   4 with zero queries for the vector path. */
static inline void attend_tile(const void* keys, const void* values, int kv_bf16,
                               const long* table, const float* q, float* out, long n, long p0,
                               long h, long heads, long group, long bs, long dim, long head_stride,
                               long block_stride, float scale) {
  const int fast = bs == 16 && dim == 64;
  const long nq = n * group, padded = (nq + 3) / 4 * 4;
  const long entry = kv_bf16 ? 2 : 4, widened = kv_bf16 ? head_stride : 1;
  float qs[padded][dim], acc[padded][dim], s[padded][bs], best[padded], total[padded];
  float k_wide[widened], v_wide[widened];  /* a bfloat16 block, widened to float32 */
  for (long qi = 0; qi < padded; qi++) {
    const float* src = q + ((qi / group) * heads + h * group + qi % group) * dim;
    for (long d = 0; d < dim; d++) qs[qi][d] = qi < nq ? src[d] * scale : 0.0f, acc[qi][d] = 0.0f;
    best[qi] = -INFINITY, total[qi] = 0.0f;
  }
  const long last = p0 + n - 1;
  for (long j = 0; j * bs <= last; j++) {
    const long base = j * bs, offset = table[j] * block_stride + h * head_stride;
    const float* k = (const float*)keys + offset;   /* [dim][bs] */
    const float* v = (const float*)values + offset; /* [bs][dim] */
    if (kv_bf16) {
      labkit_bf16_widen((const unsigned short*)keys + offset, k_wide, head_stride);
      labkit_bf16_widen((const unsigned short*)values + offset, v_wide, head_stride);
      k = k_wide, v = v_wide;
    }
    if ((j + 1) * bs <= last) {  /* ask for the next block now: tables scatter blocks, so the
                                    hardware prefetcher cannot guess where it is */
      const char* next_k = (const char*)keys + (table[j + 1] * block_stride + h * head_stride) * entry;
      const char* next_v = (const char*)values + (next_k - (const char*)keys);
      for (long line = 0; line < head_stride * entry; line += 64)
        __builtin_prefetch(next_k + line, 0, 3), __builtin_prefetch(next_v + line, 0, 3);
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
static void paged_attention(const void* keys, const void* values, int kv_bf16, const long* tables,
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
        attend_tile(keys, values, kv_bf16, table, qt, ot, tile[2], tile[3], h, heads, group, 16, 64,
                    head_stride, block_stride, scale);
      else
        attend_tile(keys, values, kv_bf16, table, qt, ot, tile[2], tile[3], h, heads, group,
                    block_size, dim, head_stride, block_stride, scale);
    }
  }
}

void labkit_paged_attention(const float* keys, const float* values, const long* tables,
                            const long* tiles, const float* q, float* out, long num_tiles,
                            long width, long block_size, long kv_heads, long group, long dim,
                            float scale) {
  paged_attention(keys, values, 0, tables, tiles, q, out, num_tiles, width, block_size, kv_heads,
                  group, dim, scale);
}

/* The same over a pool of bfloat16 keys and values (each block widened as it is read). */
void labkit_paged_attention_bf16(const unsigned short* keys, const unsigned short* values,
                                 const long* tables, const long* tiles, const float* q, float* out,
                                 long num_tiles, long width, long block_size, long kv_heads,
                                 long group, long dim, float scale) {
  paged_attention(keys, values, 1, tables, tiles, q, out, num_tiles, width, block_size, kv_heads,
                  group, dim, scale);
}
