/* Matrix-vector products on a GGUF file's own quantized blocks (labkit/kernels/gguf_blocks.py
   describes their use; labkit/kernels/native.py compiles this file with labkit_kernels.c and
   gguf_layer.c, which runs a whole decoder layer on them).

   The weights stay as the file stores them, 32 weights a block, a row of W being n / 32
   blocks one after another:
     Q4_1 (20 bytes): f16 step d, f16 minimum m, 16 bytes of 4-bit values; weight j < 16 is
                      the low nibble of byte j, weight 16 + j its high nibble; w = d q + m.
     Q8_0 (34 bytes): f16 scale d, 32 signed bytes; w = d q.
   Y[r, o] = sum_i W[o, i] X[r, i] for the `rows` rows of X (float32, row-major).

   Two ways to treat the activations:
   - float32 (labkit_gemv_q4_1, labkit_gemv_q8_0): the 4- or 8-bit values become floats in
     registers and meet x in float32 multiply-adds. Per block,
       sum_j w_j x_j = d (sum_j q_j x_j) + m (sum_j x_j),
     with each block's sum of x computed once per call. The result is the float32 product
     up to the order of the sums.
   - 8-bit (the _q8 kernels): x is first quantized per block of 32 to signed bytes with a
     float scale (the scheme llama.cpp calls Q8_1: dx = max |x| / 127, qx = round(x / dx),
     and s = dx sum qx), so a block's products are integer multiply-adds of bytes,
       sum_j w_j x_j ~ d dx (sum_j q_j qx_j) + m s,
     32 at a time (AVX2's vpmaddubsw). Cheaper arithmetic, at the cost of rounding x to
     8 bits.
   A thread takes a band of weight rows; every row of X is served from each block while
   it is in registers (up to ROW_TILE rows of X at a time).

   With AVX2 the loops are written with its intrinsics (used on AVX-512 machines as well);
   elsewhere plain C loops compute the same sums. */

#include <math.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif
#if defined(__AVX2__) && defined(__FMA__)
#define LABKIT_AVX2 1
#endif

#define ROW_TILE 4
/* Bytes ahead of the block being read that a kernel asks the memory for (a thread reads its
   band of weights front to back): on this book's machine (AMD EPYC, 2 cores) the hardware
   prefetchers alone left decode at 210 tokens/s in gguf-int8, 240 with this. */
#define PREFETCH_AHEAD 3072
#define Q4_1_BYTES 20
#define Q8_0_BYTES 34

/* Without AVX-512 FP16, GCC converts a _Float16 by calling a library routine; F16C's
   instruction does it in one step. */
static inline float half_to_float(const unsigned char* p) {
#if defined(__F16C__)
  unsigned short bits;
  memcpy(&bits, p, 2);
  return _cvtsh_ss(bits);
#else
  _Float16 h;
  memcpy(&h, p, 2);
  return (float)h;
#endif
}

/* x quantized per block of 32: the scale, the scaled sum and the 32 bytes. */
typedef struct {
  float d, s;
  signed char q[32];
} xblock;

/* Rounds half to even (the rounding mode's nearest), as AVX2's vroundps does. */
static void quantize_rows(const float* X, xblock* out, long rows, long n) {
  const long nb = n / 32;
  #pragma omp parallel for schedule(static) if (rows >= 8)
  for (long r = 0; r < rows; r++)
    for (long b = 0; b < nb; b++) {
      const float* x = X + r * n + b * 32;
      xblock* o = out + r * nb + b;
#ifdef LABKIT_AVX2
      const __m256 sign = _mm256_set1_ps(-0.0f);
      __m256 v[4], amax8 = _mm256_setzero_ps();
      for (int i = 0; i < 4; i++) {
        v[i] = _mm256_loadu_ps(x + 8 * i);
        amax8 = _mm256_max_ps(amax8, _mm256_andnot_ps(sign, v[i]));
      }
      __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax8), _mm256_extractf128_ps(amax8, 1));
      m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
      m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
      const float amax = _mm_cvtss_f32(m4);
      const float d = amax / 127.0f, id = d > 0.0f ? 1.0f / d : 0.0f;
      __m256i q[4];
      for (int i = 0; i < 4; i++)
        q[i] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[i], _mm256_set1_ps(id)),
                                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
      /* 32 int32 -> 32 int8, undoing the lane interleaving of the packs */
      const __m256i words = _mm256_packs_epi32(q[0], q[1]), words2 = _mm256_packs_epi32(q[2], q[3]);
      const __m256i bytes = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(words, words2),
                                                        _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
      _mm256_storeu_si256((__m256i*)o->q, bytes);
      const __m256i sums = _mm256_madd_epi16(_mm256_add_epi16(words, words2), _mm256_set1_epi16(1));
      __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sums), _mm256_extracti128_si256(sums, 1));
      s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
      s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
      o->d = d;
      o->s = d * (float)_mm_cvtsi128_si32(s4);
#else
      float amax = 0.0f;
      for (int j = 0; j < 32; j++) amax = fmaxf(amax, fabsf(x[j]));
      const float d = amax / 127.0f, id = d > 0.0f ? 1.0f / d : 0.0f;
      int sum = 0;
      for (int j = 0; j < 32; j++) {
        o->q[j] = (signed char)nearbyintf(x[j] * id);
        sum += o->q[j];
      }
      o->d = d;
      o->s = d * (float)sum;
#endif
    }
}

static void block_sums(const float* X, float* sums, long rows, long n) {
  const long nb = n / 32;
  for (long r = 0; r < rows; r++)
    for (long b = 0; b < nb; b++) {
      float s = 0.0f;
      for (int j = 0; j < 32; j++) s += X[r * n + b * 32 + j];
      sums[r * nb + b] = s;
    }
}

#ifdef LABKIT_AVX2

static inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

/* 16 bytes of nibbles as 32 bytes 0..15, in weight order (low nibbles, then high ones). */
static inline __m256i nibbles(const unsigned char* p) {
  const __m128i b = _mm_loadu_si128((const __m128i*)p), mask = _mm_set1_epi8(15);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), mask), _mm_and_si128(b, mask));
}

static inline __m256 bytes_to_floats(__m128i eight_low_bytes, int is_signed) {
  return _mm256_cvtepi32_ps(is_signed ? _mm256_cvtepi8_epi32(eight_low_bytes)
                                      : _mm256_cvtepu8_epi32(eight_low_bytes));
}

/* sum_j q_j x_j of one block for R rows of X, the block's 32 weights as 4 x 8 floats. */
#define DOT_F32_ROWS(R, W0, W1, W2, W3, XB, STRIDE, DOT)                                    \
  for (int r = 0; r < (R); r++) {                                                           \
    const float* x_ = (XB) + r * (STRIDE);                                                  \
    __m256 t_ = _mm256_mul_ps(W0, _mm256_loadu_ps(x_));                                     \
    t_ = _mm256_fmadd_ps(W1, _mm256_loadu_ps(x_ + 8), t_);                                  \
    t_ = _mm256_fmadd_ps(W2, _mm256_loadu_ps(x_ + 16), t_);                                 \
    DOT[r] = _mm256_fmadd_ps(W3, _mm256_loadu_ps(x_ + 24), t_);                             \
  }

static inline __attribute__((always_inline)) void q4_1_f32_tile(
    const unsigned char* w, const float* X, const float* sums, float* Y, int R, long nb,
    long n, long out) {
  __m256 acc[ROW_TILE], dot[ROW_TILE];
  float low[ROW_TILE];
  for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps(), low[r] = 0.0f;
  for (long b = 0; b < nb; b++, w += Q4_1_BYTES) {
    _mm_prefetch((const char*)w + PREFETCH_AHEAD, _MM_HINT_T0);
    const __m256 d = _mm256_set1_ps(half_to_float(w));
    const float m = half_to_float(w + 2);
    const __m128i bytes = _mm_loadu_si128((const __m128i*)(w + 4)), mask = _mm_set1_epi8(15);
    const __m128i lo = _mm_and_si128(bytes, mask), hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
    const __m256 w0 = bytes_to_floats(lo, 0), w1 = bytes_to_floats(_mm_srli_si128(lo, 8), 0);
    const __m256 w2 = bytes_to_floats(hi, 0), w3 = bytes_to_floats(_mm_srli_si128(hi, 8), 0);
    DOT_F32_ROWS(R, w0, w1, w2, w3, X + b * 32, n, dot)
    for (int r = 0; r < R; r++) {
      acc[r] = _mm256_fmadd_ps(d, dot[r], acc[r]);
      low[r] += m * sums[r * nb + b];
    }
  }
  for (int r = 0; r < R; r++) Y[r * out] = hsum8(acc[r]) + low[r];
}

static inline __attribute__((always_inline)) void q8_0_f32_tile(
    const unsigned char* w, const float* X, float* Y, int R, long nb, long n, long out) {
  __m256 acc[ROW_TILE], dot[ROW_TILE];
  for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
  for (long b = 0; b < nb; b++, w += Q8_0_BYTES) {
    _mm_prefetch((const char*)w + PREFETCH_AHEAD, _MM_HINT_T0);
    const __m256 d = _mm256_set1_ps(half_to_float(w));
    const __m128i q0 = _mm_loadu_si128((const __m128i*)(w + 2));
    const __m128i q1 = _mm_loadu_si128((const __m128i*)(w + 18));
    const __m256 w0 = bytes_to_floats(q0, 1), w1 = bytes_to_floats(_mm_srli_si128(q0, 8), 1);
    const __m256 w2 = bytes_to_floats(q1, 1), w3 = bytes_to_floats(_mm_srli_si128(q1, 8), 1);
    DOT_F32_ROWS(R, w0, w1, w2, w3, X + b * 32, n, dot)
    for (int r = 0; r < R; r++) acc[r] = _mm256_fmadd_ps(d, dot[r], acc[r]);
  }
  for (int r = 0; r < R; r++) Y[r * out] = hsum8(acc[r]);
}

/* 32 products of unsigned bytes u and signed bytes s, summed in 8 int32 lanes, as floats. */
static inline __m256 dot_u8_i8(__m256i u, __m256i s) {
  const __m256i pairs = _mm256_maddubs_epi16(u, s);  /* |pair| <= 2 * 255 * 127: no overflow */
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}

static inline __attribute__((always_inline)) void q4_1_q8_tile(
    const unsigned char* w, const xblock* X, float* Y, int R, long nb, long out) {
  __m256 acc[ROW_TILE];
  float low[ROW_TILE];
  for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps(), low[r] = 0.0f;
  for (long b = 0; b < nb; b++, w += Q4_1_BYTES) {
    _mm_prefetch((const char*)w + PREFETCH_AHEAD, _MM_HINT_T0);
    const float d = half_to_float(w), m = half_to_float(w + 2);
    const __m256i q = nibbles(w + 4);
    for (int r = 0; r < R; r++) {
      const xblock* x = X + r * nb + b;
      const __m256 dots = dot_u8_i8(q, _mm256_loadu_si256((const __m256i*)x->q));
      acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d * x->d), dots, acc[r]);
      low[r] += m * x->s;
    }
  }
  for (int r = 0; r < R; r++) Y[r * out] = hsum8(acc[r]) + low[r];
}

static inline __attribute__((always_inline)) void q8_0_q8_tile(
    const unsigned char* w, const xblock* X, float* Y, int R, long nb, long out) {
  __m256 acc[ROW_TILE];
  for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
  for (long b = 0; b < nb; b++, w += Q8_0_BYTES) {
    _mm_prefetch((const char*)w + PREFETCH_AHEAD, _MM_HINT_T0);
    const float d = half_to_float(w);
    const __m256i q = _mm256_loadu_si256((const __m256i*)(w + 2));
    const __m256i magnitude = _mm256_sign_epi8(q, q);  /* |q| as unsigned bytes (|-128| = 128) */
    for (int r = 0; r < R; r++) {
      const xblock* x = X + r * nb + b;
      const __m256i signed_x = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i*)x->q), q);
      acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d * x->d), dot_u8_i8(magnitude, signed_x), acc[r]);
    }
  }
  for (int r = 0; r < R; r++) Y[r * out] = hsum8(acc[r]);
}

#else /* plain C: the same sums, one weight at a time */

static inline void q4_1_f32_tile(const unsigned char* w, const float* X, const float* sums,
                                 float* Y, int R, long nb, long n, long out) {
  for (int r = 0; r < R; r++) {
    float total = 0.0f;
    for (long b = 0; b < nb; b++) {
      const unsigned char* blk = w + b * Q4_1_BYTES;
      const float* x = X + r * n + b * 32;
      float dot = 0.0f;
      for (int j = 0; j < 16; j++) dot += (blk[4 + j] & 15) * x[j] + (blk[4 + j] >> 4) * x[16 + j];
      total += half_to_float(blk) * dot + half_to_float(blk + 2) * sums[r * nb + b];
    }
    Y[r * out] = total;
  }
}

static inline void q8_0_f32_tile(const unsigned char* w, const float* X, float* Y, int R,
                                 long nb, long n, long out) {
  for (int r = 0; r < R; r++) {
    float total = 0.0f;
    for (long b = 0; b < nb; b++) {
      const unsigned char* blk = w + b * Q8_0_BYTES;
      float dot = 0.0f;
      for (int j = 0; j < 32; j++) dot += (signed char)blk[2 + j] * X[r * n + b * 32 + j];
      total += half_to_float(blk) * dot;
    }
    Y[r * out] = total;
  }
}

static inline void q4_1_q8_tile(const unsigned char* w, const xblock* X, float* Y, int R,
                                long nb, long out) {
  for (int r = 0; r < R; r++) {
    float total = 0.0f;
    for (long b = 0; b < nb; b++) {
      const unsigned char* blk = w + b * Q4_1_BYTES;
      const xblock* x = X + r * nb + b;
      int dot = 0;
      for (int j = 0; j < 16; j++) dot += (blk[4 + j] & 15) * x->q[j] + (blk[4 + j] >> 4) * x->q[16 + j];
      total += half_to_float(blk) * x->d * (float)dot + half_to_float(blk + 2) * x->s;
    }
    Y[r * out] = total;
  }
}

static inline void q8_0_q8_tile(const unsigned char* w, const xblock* X, float* Y, int R,
                                long nb, long out) {
  for (int r = 0; r < R; r++) {
    float total = 0.0f;
    for (long b = 0; b < nb; b++) {
      const unsigned char* blk = w + b * Q8_0_BYTES;
      const xblock* x = X + r * nb + b;
      int dot = 0;
      for (int j = 0; j < 32; j++) dot += (signed char)blk[2 + j] * x->q[j];
      total += half_to_float(blk) * x->d * (float)dot;
    }
    Y[r * out] = total;
  }
}

#endif

/* Row tiles of R = 4, then the 1-3 rows left; each call with a constant R so the
   accumulators stay in registers. */
#define FOR_ROW_TILES(rows, CALL)                                                           \
  for (long r0 = 0; r0 < (rows); r0 += ROW_TILE) {                                          \
    switch ((rows) - r0 < ROW_TILE ? (rows) - r0 : ROW_TILE) {                              \
      case 1: CALL(1); break;                                                               \
      case 2: CALL(2); break;                                                               \
      case 3: CALL(3); break;                                                               \
      default: CALL(4); break;                                                              \
    }                                                                                       \
  }

/* ---- Q4_1 regrouped eight rows at a time, for 8-bit activations ---------------------------

   The same bytes as the file's blocks, reordered once at load (labkit.kernels.gguf_blocks.
   regroup_q4_1): for each eight weight rows and each block, the eight steps d (f16), the
   eight minimums m (f16), then four runs of 32 bytes, run g holding bytes 4g .. 4g+3 of each
   row's block, row after row. One 32-byte load then feeds eight rows at once: its low
   nibbles are weights 4g .. 4g+3 of the eight rows and its high nibbles weights 16+4g ..,
   each multiplied by the same four bytes of x (broadcast), so the products land in one
   lane per row and no horizontal sums are needed; a block's sums stay in 16-bit lanes
   (at most 8 x 2 x 15 x 127 = 30,480) until its one conversion to float. */

#define X8_BYTES 160

#ifdef LABKIT_AVX2
/* R rows of x (R <= 4, a constant after inlining) against eight weight rows: each block's
   nibbles are unpacked once for all R rows; a row's arithmetic is the same whatever R. */
static inline __attribute__((always_inline)) void q4_1x8_tile(
    const unsigned char* w, const xblock* X, float* Y, int R, long nb, long out) {
  const __m256i mask = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
  __m256 acc[ROW_TILE];
  for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
  for (long b = 0; b < nb; b++, w += X8_BYTES) {
    _mm_prefetch((const char*)w + PREFETCH_AHEAD, _MM_HINT_T0);
    _mm_prefetch((const char*)w + PREFETCH_AHEAD + 64, _MM_HINT_T0);
    _mm_prefetch((const char*)w + PREFETCH_AHEAD + 128, _MM_HINT_T0);
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)w));
    const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(w + 16)));
    __m256i lo[4], hi[4];
    for (int g = 0; g < 4; g++) {
      const __m256i bytes = _mm256_loadu_si256((const __m256i*)(w + 32 + 32 * g));
      lo[g] = _mm256_and_si256(bytes, mask);
      hi[g] = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), mask);
    }
    for (int r = 0; r < R; r++) {
      const xblock* x = X + r * nb + b;
      const int* xq = (const int*)x->q;
      __m256i sums = _mm256_maddubs_epi16(lo[0], _mm256_set1_epi32(xq[0]));
      sums = _mm256_add_epi16(sums, _mm256_maddubs_epi16(hi[0], _mm256_set1_epi32(xq[4])));
      for (int g = 1; g < 4; g++) {
        sums = _mm256_add_epi16(sums, _mm256_maddubs_epi16(lo[g], _mm256_set1_epi32(xq[g])));
        sums = _mm256_add_epi16(sums, _mm256_maddubs_epi16(hi[g], _mm256_set1_epi32(xq[4 + g])));
      }
      const __m256 dots = _mm256_cvtepi32_ps(_mm256_madd_epi16(sums, ones));
      acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(x->d)), dots, acc[r]);
      acc[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(x->s), acc[r]);
    }
  }
  for (int r = 0; r < R; r++) _mm256_storeu_ps(Y + r * out, acc[r]);
}

static inline void q4_1x8_rows(const unsigned char* w, const xblock* X, float* Y, long rows,
                               long nb, long out) {
#define CALL(R) q4_1x8_tile(w, X + r0 * nb, Y + r0 * out, R, nb, out)
  FOR_ROW_TILES(rows, CALL)
#undef CALL
}
#else
static inline void q4_1x8_rows(const unsigned char* w, const xblock* X, float* Y, long rows,
                               long nb, long out) {
  for (long r = 0; r < rows; r++)
    for (int i = 0; i < 8; i++) {
      float total = 0.0f;
      for (long b = 0; b < nb; b++) {
        const unsigned char* p = w + b * X8_BYTES;
        const xblock* x = X + r * nb + b;
        int dot = 0;
        for (int g = 0; g < 4; g++)
          for (int k = 0; k < 4; k++) {
            const unsigned char byte = p[32 + 32 * g + 4 * i + k];
            dot += (byte & 15) * x->q[4 * g + k] + (byte >> 4) * x->q[16 + 4 * g + k];
          }
        total += half_to_float(p + 2 * i) * x->d * (float)dot + half_to_float(p + 16 + 2 * i) * x->s;
      }
      Y[r * out + i] = total;
    }
}
#endif

void labkit_gemv_q4_1x8_q8(const unsigned char* W, const float* X, float* Y, long rows,
                           long out, long n) {
  const long nb = n / 32;
  xblock* qx = malloc(sizeof(xblock) * rows * nb);
  quantize_rows(X, qx, rows, n);
  #pragma omp parallel for schedule(static)
  for (long o = 0; o < out / 8; o++) q4_1x8_rows(W + o * nb * X8_BYTES, qx, Y + 8 * o, rows, nb, out);
  free(qx);
}

void labkit_gemv_q4_1(const unsigned char* W, const float* X, float* Y, long rows, long out,
                      long n) {
  const long nb = n / 32;
  float* sums = malloc(sizeof(float) * rows * nb);
  block_sums(X, sums, rows, n);
  #pragma omp parallel for schedule(static)
  for (long o = 0; o < out; o++) {
#define CALL(R) q4_1_f32_tile(W + o * nb * Q4_1_BYTES, X + r0 * n, sums + r0 * nb, Y + r0 * out + o, R, nb, n, out)
    FOR_ROW_TILES(rows, CALL)
#undef CALL
  }
  free(sums);
}

void labkit_gemv_q8_0(const unsigned char* W, const float* X, float* Y, long rows, long out,
                      long n) {
  const long nb = n / 32;
  #pragma omp parallel for schedule(static)
  for (long o = 0; o < out; o++) {
#define CALL(R) q8_0_f32_tile(W + o * nb * Q8_0_BYTES, X + r0 * n, Y + r0 * out + o, R, nb, n, out)
    FOR_ROW_TILES(rows, CALL)
#undef CALL
  }
}

void labkit_gemv_q4_1_q8(const unsigned char* W, const float* X, float* Y, long rows,
                         long out, long n) {
  const long nb = n / 32;
  xblock* qx = malloc(sizeof(xblock) * rows * nb);
  quantize_rows(X, qx, rows, n);
  #pragma omp parallel for schedule(static)
  for (long o = 0; o < out; o++) {
#define CALL(R) q4_1_q8_tile(W + o * nb * Q4_1_BYTES, qx + r0 * nb, Y + r0 * out + o, R, nb, out)
    FOR_ROW_TILES(rows, CALL)
#undef CALL
  }
  free(qx);
}

void labkit_gemv_q8_0_q8(const unsigned char* W, const float* X, float* Y, long rows,
                         long out, long n) {
  const long nb = n / 32;
  xblock* qx = malloc(sizeof(xblock) * rows * nb);
  quantize_rows(X, qx, rows, n);
  #pragma omp parallel for schedule(static)
  for (long o = 0; o < out; o++) {
#define CALL(R) q8_0_q8_tile(W + o * nb * Q8_0_BYTES, qx + r0 * nb, Y + r0 * out + o, R, nb, out)
    FOR_ROW_TILES(rows, CALL)
#undef CALL
  }
  free(qx);
}
