/* Matmuls for decode steps on x86 CPUs with AVX2 and FMA (engine/models/cpu_kernels.py).

   out[r, n] = sum_k x[r, k] * w[n, k]  (times scale[n] for int8), for a few rows r of float32
   activations against bfloat16, int8 or float32 weights [n, k], k a multiple of 32. A decode step is
   bound by reading the weights: each weight row is read from memory once and converted to
   float32 in registers (once for each pair of activation rows), and the output rows are
   shared among OpenMP's threads (the team torch's kernels use). Every output is summed in one
   fixed order whatever the number of rows, so a row's result never depends on its company. */

#include <immintrin.h>
#include <stdint.h>

#include "weight_only.h"

static inline __m256 int8_to_float(const int8_t *w) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)w)));
}

static inline __m256 bf16_to_float(const uint16_t *w) {
    __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)w));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

/* Dot products of a weight row with one row of x (name_1) or two (name_2, the weights converted
   once for both), 32 at a time into four sums per row, then added in one order: a row gets the
   same bits from either. CONVERT turns 8 weights at an address into floats. */
#define DOTS(name, type, convert)                                                           \
    static inline float name##_1(const float *x, const type *w, long k) {                   \
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;                         \
        for (long i = 0; i < k; i += 32) {                                                  \
            a0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i), convert(w + i), a0);               \
            a1 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i + 8), convert(w + i + 8), a1);       \
            a2 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i + 16), convert(w + i + 16), a2);     \
            a3 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i + 24), convert(w + i + 24), a3);     \
        }                                                                                   \
        return sum8(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));           \
    }                                                                                       \
    static inline void name##_2(const float *x, const float *y, const type *w, long k, float *out) { \
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;                         \
        __m256 b0 = a0, b1 = a0, b2 = a0, b3 = a0;                                          \
        for (long i = 0; i < k; i += 32) {                                                  \
            __m256 w0 = convert(w + i), w1 = convert(w + i + 8);                            \
            __m256 w2 = convert(w + i + 16), w3 = convert(w + i + 24);                      \
            a0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i), w0, a0);                           \
            b0 = _mm256_fmadd_ps(_mm256_loadu_ps(y + i), w0, b0);                           \
            a1 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i + 8), w1, a1);                       \
            b1 = _mm256_fmadd_ps(_mm256_loadu_ps(y + i + 8), w1, b1);                       \
            a2 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i + 16), w2, a2);                      \
            b2 = _mm256_fmadd_ps(_mm256_loadu_ps(y + i + 16), w2, b2);                      \
            a3 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i + 24), w3, a3);                      \
            b3 = _mm256_fmadd_ps(_mm256_loadu_ps(y + i + 24), w3, b3);                      \
        }                                                                                   \
        out[0] = sum8(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));         \
        out[1] = sum8(_mm256_add_ps(_mm256_add_ps(b0, b1), _mm256_add_ps(b2, b3)));         \
    }

#define FLOATS(w) _mm256_loadu_ps(w)
DOTS(dot_int8, int8_t, int8_to_float)
DOTS(dot_bf16, uint16_t, bf16_to_float)
DOTS(dot_f32, float, FLOATS)

/* out[r, j] for every row r of x and output j, the outputs shared among the threads; rows in pairs
   and the odd one alone. */
#define MATMUL(name, type, dot, scaled)                                                      \
    void name(const float *x, long rows, long k, const type *w, const float *scale, long n, float *out) { \
        _Pragma("omp parallel for schedule(static)")                                        \
        for (long j = 0; j < n; j++) {                                                      \
            const type *row = w + j * k;                                                    \
            float two[2];                                                                   \
            long r = 0;                                                                     \
            for (; r + 1 < rows; r += 2) {                                                  \
                dot##_2(x + r * k, x + (r + 1) * k, row, k, two);                           \
                out[r * n + j] = scaled(two[0]);                                            \
                out[(r + 1) * n + j] = scaled(two[1]);                                      \
            }                                                                               \
            if (r < rows) out[r * n + j] = scaled(dot##_1(x + r * k, row, k));              \
        }                                                                                   \
    }

#define BY_SCALE(v) ((v) * scale[j])
#define AS_IS(v) (v)
MATMUL(int8_matmul, int8_t, dot_int8, BY_SCALE)
MATMUL(bf16_matmul, uint16_t, dot_bf16, AS_IS)
MATMUL(f32_matmul, float, dot_f32, AS_IS)

void weight_matmul(const Weight *w, const float *x, long rows, float *out) {
    if (w->kind == KIND_INT8) int8_matmul(x, rows, w->in, w->data, w->scale, w->out, out);
    else if (w->kind == KIND_BF16) bf16_matmul(x, rows, w->in, w->data, w->scale, w->out, out);
    else f32_matmul(x, rows, w->in, w->data, w->scale, w->out, out);
    if (w->bias != NULL)
        for (long r = 0; r < rows; r++)
            for (long j = 0; j < w->out; j++) out[r * w->out + j] += w->bias[j];
}
