/* bfloat16 weights and KV entries (labkit/kernels/native.py compiles this file with the
   others; labkit/kernels/bf16_weights.py puts the weights in the model).

   A bfloat16 is the top 16 bits of a float32: the same 8 exponent bits, 7 of the 23
   mantissa bits. Widening one back to float32 is a 16-bit shift; narrowing rounds to the
   nearest, halves to even (what PyTorch's `.to(torch.bfloat16)` does), a NaN stays a NaN.

   labkit_gemv_bf16: Y[r, o] = sum_i W[o, i] x[r, i] with W bfloat16 [out, n] and x rounded
   to bfloat16 first, every product and sum in float32. Two bfloat16 values multiply
   exactly in float32 (8 + 8 significant bits), so this is what a bfloat16 GEMM with float32
   accumulation computes (oneDNN's on AVX-512 BF16), up to the order of the sums; on a
   machine without bfloat16 instructions (AVX2) it reads half the bytes of float32 weights,
   which is what a decode step is bound by. */

#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define LABKIT_AVX2 1
#endif

#define ROW_TILE 4
#define PREFETCH_AHEAD 3072

unsigned short labkit_bf16_from_float(float x) {
  unsigned int bits;
  memcpy(&bits, &x, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;  /* NaN */
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return (unsigned short)(bits >> 16);
}

static inline float widen(unsigned short h) {
  const unsigned int bits = (unsigned int)h << 16;
  float x;
  memcpy(&x, &bits, 4);
  return x;
}

void labkit_bf16_widen(const unsigned short* src, float* dst, long count) {
  for (long i = 0; i < count; i++) dst[i] = widen(src[i]);
}

#ifdef LABKIT_AVX2
static inline __m256 widen8(const unsigned short* p) {
  const __m256i words = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(words, 16));
}

static inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

/* One weight row against R rows of x (R <= 4, a constant after inlining), 16 weights a
   turn in two independent sums per row. n is a multiple of 16. */
static inline __attribute__((always_inline)) void bf16_tile(const unsigned short* w, const float* X,
                                                            float* Y, int R, long n, long out) {
  __m256 a[ROW_TILE], b[ROW_TILE];
  for (int r = 0; r < R; r++) a[r] = _mm256_setzero_ps(), b[r] = _mm256_setzero_ps();
  for (long i = 0; i < n; i += 16) {
    _mm_prefetch((const char*)(w + i) + PREFETCH_AHEAD, _MM_HINT_T0);  /* gguf_blocks.c says why */
    const __m256 w0 = widen8(w + i), w1 = widen8(w + i + 8);
    for (int r = 0; r < R; r++) {
      a[r] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(X + r * n + i), a[r]);
      b[r] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(X + r * n + i + 8), b[r]);
    }
  }
  for (int r = 0; r < R; r++) Y[r * out] = hsum8(_mm256_add_ps(a[r], b[r]));
}
#else
static inline void bf16_tile(const unsigned short* w, const float* X, float* Y, int R, long n,
                             long out) {
  for (int r = 0; r < R; r++) {
    float total = 0.0f;
    for (long i = 0; i < n; i++) total += widen(w[i]) * X[r * n + i];
    Y[r * out] = total;
  }
}
#endif

void labkit_gemv_bf16(const unsigned short* W, const float* X, float* Y, long rows, long out,
                      long n) {
  float* rounded = malloc(sizeof(float) * rows * n);
  for (long i = 0; i < rows * n; i++) rounded[i] = widen(labkit_bf16_from_float(X[i]));
  #pragma omp parallel for schedule(static)
  for (long o = 0; o < out; o++)
    for (long r0 = 0; r0 < rows; r0 += ROW_TILE) {
      const unsigned short* w = W + o * n;
      const float* x = rounded + r0 * n;
      float* y = Y + r0 * out + o;
      switch (rows - r0 < ROW_TILE ? rows - r0 : ROW_TILE) {
        case 1: bf16_tile(w, x, y, 1, n, out); break;
        case 2: bf16_tile(w, x, y, 2, n, out); break;
        case 3: bf16_tile(w, x, y, 3, n, out); break;
        default: bf16_tile(w, x, y, 4, n, out); break;
      }
    }
  free(rounded);
}
