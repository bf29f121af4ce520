/* Matmuls for decode steps on x86 CPUs with AVX2 and FMA (and AVX-512 where the CPU has it) (engine/models/cpu_kernels.py).

   out[r, n] = sum_k x[r, k] * w[n, k]  (times scale[n] for int8), for a few rows r of float32
   activations against bfloat16, int8, int4 (a scale and a minimum a group of 32 inputs) or
   float32 weights [n, k], k a multiple of 32. A decode step is
   bound by reading the weights: each weight row is read from memory once (asked for ahead of use)
   and converted to float32 in registers (AVX2: once for each pair of activation rows; AVX-512:
   once for up to 4), and the output rows are
   shared among OpenMP's threads (the team torch's kernels use). Every output is summed in one
   fixed order whatever the number of rows, so a row's result never depends on its company. int4
   instead rounds each row's inputs to int8 and multiplies bytes by default, with the AVX2 kernels
   and with the AVX-512 ones where the CPU has VNNI (below: int4_matmul_avx2_int8, int4_matmul_vnni,
   whose blocks take up to 4 rows); int8 likewise with the AVX-512 ones on a VNNI CPU
   (int8_matmul_vnni). */

#include <float.h>
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "weight_only.h"

/* A loop over a block's rows (a constant count once inlined), unrolled whole so that each row's
   accumulators stay in registers: without it gcc kept them in memory, storing each one an iteration. */
#define EACH_ROW _Pragma("GCC unroll 16")

static inline __m256 int8_to_float(const int8_t *w) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)w)));
}

static inline __m256 bf16_to_float(const uint16_t *w) {
    __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)w));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

static inline float bf16_value(uint16_t bits) {
    union {
        uint32_t u;
        float f;
    } v = {.u = (uint32_t)bits << 16};
    return v.f;
}

/* Asks for `bytes` from `at` on to be brought into the cache. */
static inline void prefetch(const void *at, long bytes) {
    for (long b = 0; b < bytes; b += 64) _mm_prefetch((const char *)at + b, _MM_HINT_T0);
}

/* The same, into the second-level cache, as the AVX-512 kernels for bf16, int8 and float32 weights
   (and int8 on int8 inputs) and the VNNI kernel's blocks of 1, 2 and 4 rows read ahead. On 2 Zen 4
   cores it read one row's weights 1.2-1.45x as fast there, and 4 rows (two blocks of 4 for 8 rows
   since a9352c2) in 0.89 of the time; int4 on float inputs and the AVX2 kernels ran as fast or
   faster with `prefetch` (docs/studies/quantize.md). */
static inline void prefetch_l2(const void *at, long bytes) {
    for (long b = 0; b < bytes; b += 64) _mm_prefetch((const char *)at + b, _MM_HINT_T1);
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
    static void name(const float *x, long rows, long k, const type *w, const float *scale, long n, float *out) { \
        _Pragma("omp parallel for schedule(static)")                                        \
        for (long j = 0; j < n; j++) {                                                      \
            const type *row = w + j * k;                                                    \
            if (j + 2 < n) prefetch(row + 2 * k, k * sizeof(type)); /* read ahead */        \
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
MATMUL(int8_float_matmul_avx2, int8_t, dot_int8, BY_SCALE)
MATMUL(bf16_matmul_avx2, uint16_t, dot_bf16, AS_IS)
MATMUL(f32_matmul_avx2, float, dot_f32, AS_IS)

/* Each row's group sums of its inputs into sums [rows, k / 32], 32 inputs added in one order. */
static void group_sums(const float *x, long rows, long k, float *sums) {
    for (long r = 0; r < rows; r++)
        for (long g = 0; g < k / 32; g++) {
            float total = 0.0f;
            for (long t = 0; t < 32; t++) total += x[r * k + g * 32 + t];
            sums[r * (k / 32) + g] = total;
        }
}

/* int4 with AVX2, as with AVX-512 below: the codes widened and multiplied as they are, each
   group's partial sum scaled once, the minimums' part from the inputs' group sums; the (scale,
   minimum) pairs of 8 groups read as one vector. Rows of x (`rows`: 1 or 2, k apart) against one
   weight row; each row summed alone, in one order. */
static inline void dot_int4(const float *x, const float *sums, long rows, const uint8_t *w, const uint16_t *groups, long k,
                            float *out) {
    long count = k / 32;
    __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    const __m256i low4 = _mm256_set1_epi32(15), high16 = _mm256_set1_epi32((int)0xFFFF0000);
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    for (long g0 = 0; g0 < count; g0 += 8) {
        long c = count - g0 < 8 ? count - g0 : 8;
        __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)c), lanes);
        __m256i pairs = _mm256_maskload_epi32((const int *)(groups + 2 * g0), mask);
        __m256 scale = _mm256_castsi256_ps(_mm256_slli_epi32(pairs, 16));
        __m256 mins = _mm256_castsi256_ps(_mm256_and_si256(pairs, high16));
        EACH_ROW for (long r = 0; r < rows; r++)
            acc[r] = _mm256_fmadd_ps(mins, _mm256_maskload_ps(sums + r * count + g0, mask), acc[r]);
        for (long g = 0; g < c; g++) {
            long i = (g0 + g) * 32;
            __m256i c0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(w + i / 2)));
            __m256i c1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(w + i / 2 + 8)));
            __m256 q0 = _mm256_cvtepi32_ps(_mm256_and_si256(c0, low4)), q2 = _mm256_cvtepi32_ps(_mm256_srli_epi32(c0, 4));
            __m256 q1 = _mm256_cvtepi32_ps(_mm256_and_si256(c1, low4)), q3 = _mm256_cvtepi32_ps(_mm256_srli_epi32(c1, 4));
            __m256 sk = _mm256_permutevar8x32_ps(scale, _mm256_set1_epi32((int)g));
            EACH_ROW for (long r = 0; r < rows; r++) {
                const float *xr = x + r * k + i;
                __m256 p = _mm256_mul_ps(_mm256_loadu_ps(xr), q0);
                p = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 8), q1, p);
                p = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 16), q2, p);
                p = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 24), q3, p);
                acc[r] = _mm256_fmadd_ps(p, sk, acc[r]);
            }
        }
    }
    EACH_ROW for (long r = 0; r < rows; r++) out[r] = sum8(acc[r]);
}

static void int4_matmul_avx2(const float *x, const float *sums, long rows, long k, const uint8_t *w, const uint16_t *groups,
                             long n, float *out) {
    _Pragma("omp parallel for schedule(static)")
    for (long j = 0; j < n; j++) {
        const uint8_t *row = w + j * (k / 2);
        if (j + 2 < n) prefetch(row + k, k / 2); /* read ahead */
        float two[2];
        for (long r = 0; r < rows; r += 2) {
            long take = rows - r >= 2 ? 2 : 1;
            dot_int4(x + r * k, sums + r * (k / 32), take, row, groups + j * (k / 16), k, two);
            for (long t = 0; t < take; t++) out[(r + t) * n + j] = two[t];
        }
    }
}

/* int4 on inputs rounded to int8 with AVX2 (no VNNI): the rounding of int4_matmul_vnni below, in
   a layout of its own (quads of groups, a quarter of a group a lane, as the VNNI kernel's was
   before a9352c2), 8 lanes at a time. Each row's inputs are rounded as quantize_inputs rounds them,
   and a quad's codes are taken as two pairs of groups: 32 bytes of codes, unpacked
   into their inputs 0-15 and 16-31, are multiplied by the rounded inputs as bytes (vpmaddubsw:
   unsigned codes by signed inputs, two products summed into 16 bits; the two halves added there,
   four products at most 4 * 15 * 127 in size, so exact; vpmaddwd by ones sums two of those into an
   int32 lane), so a lane holds an exact sum of 8 products. The pair of groups g, g + 1 of a quad
   adds into the row's first 8-lane sum, g + 2, g + 3 into its second. */
static void quantize_inputs_avx2(const float *x, long rows, long k, int8_t *quantized, float *lane_scales) {
    long groups = k / 32, quads = (groups + 3) / 4;
    memset(quantized, 0, (size_t)(rows * quads * 128));
    memset(lane_scales, 0, (size_t)(rows * quads * 16) * sizeof(float));
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7); /* undoes the packs' lane interleaving */
    for (long r = 0; r < rows; r++)
        for (long g = 0; g < groups; g++) {
            const float *xg = x + r * k + g * 32;
            __m256 v[4], biggest = _mm256_setzero_ps();
            for (int c = 0; c < 4; c++) {
                v[c] = _mm256_loadu_ps(xg + 8 * c);
                biggest = _mm256_max_ps(biggest, _mm256_and_ps(v[c], magnitude));
            }
            __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(biggest), _mm256_extractf128_ps(biggest, 1));
            m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
            m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
            float d = _mm_cvtss_f32(m4) / 127.0f, inverse = d > FLT_MIN ? 1.0f / d : 0.0f;
            __m256 by = _mm256_set1_ps(inverse);
            __m256i i[4]; /* to nearest, ties to even (the default rounding mode), as the VNNI kernel's */
            for (int c = 0; c < 4; c++) i[c] = _mm256_cvtps_epi32(_mm256_mul_ps(v[c], by));
            __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]), _mm256_packs_epi32(i[2], i[3]));
            bytes = _mm256_permutevar8x32_epi32(bytes, order); /* inputs 0-31 in order */
            int8_t *q = quantized + (r * quads + g / 4) * 128 + (g % 4) * 16;
            _mm_storeu_si128((__m128i *)q, _mm256_castsi256_si128(bytes));
            _mm_storeu_si128((__m128i *)(q + 64), _mm256_extracti128_si256(bytes, 1));
            for (int t = 0; t < 4; t++) lane_scales[(r * quads + g / 4) * 16 + (g % 4) * 4 + t] = d;
        }
}

/* The (scale, minimum) pairs of weight row w's (up to) 16 groups from g0 on as two 8-lane halves:
   scales into `scale`, and the minimums' part of `rows` rows added into acc[r][0..1]. Returns how
   many groups there are. */
static inline long group_block_avx2(const uint16_t *gw, const float *sums, long groups, long g0, int rows, __m256 (*acc)[2],
                                    __m256 *scale) {
    long count = groups - g0 < 16 ? groups - g0 : 16;
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), high16 = _mm256_set1_epi32((int)0xFFFF0000);
    for (int h = 0; h < 2; h++) {
        __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(count - 8 * h)), lanes);
        __m256i pairs = _mm256_maskload_epi32((const int *)(gw + 2 * (g0 + 8 * h)), mask);
        scale[h] = _mm256_castsi256_ps(_mm256_slli_epi32(pairs, 16));
        __m256 mins = _mm256_castsi256_ps(_mm256_and_si256(pairs, high16));
        EACH_ROW for (int r = 0; r < rows; r++)
            acc[r][h] = _mm256_fmadd_ps(mins, _mm256_maskload_ps(sums + r * groups + g0 + 8 * h, mask), acc[r][h]);
    }
    return count;
}

/* A pair of groups' 32 bytes of codes (`count` groups of 2, the rest read as zeros) as their
   inputs 0-15 (`low`) and 16-31 (`high`), 16 bytes a group. */
static inline void unpack_pair(const uint8_t *codes, long count, __m256i *low, __m256i *high) {
    __m256i packed = count >= 2 ? _mm256_loadu_si256((const __m256i *)codes)
                                : _mm256_inserti128_si256(_mm256_setzero_si256(), _mm_loadu_si128((const __m128i *)codes), 0);
    const __m256i low4 = _mm256_set1_epi8(15);
    *low = _mm256_and_si256(packed, low4);
    *high = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low4);
}

/* ROWS rows against weight row w, a pair of groups at a time; UNROLL, a pragma for the loop over a
   block's quads (unrolled where more than one row shares the unpacked codes: measured faster there,
   the same for one row). */
#define BLOCK_INT8_AVX2(ROWS, UNROLL)                                                                      \
    static inline void block_int8_avx2_##ROWS(const int8_t *q, const float *ls, const float *sums, long k,    \
                                              const uint8_t *w, const uint16_t *gw, const uint8_t *next,      \
                                              float *out) {                                                  \
        long groups = k / 32, quads = (groups + 3) / 4, xstride = quads * 128, sstride = quads * 16;         \
        __m256 acc[ROWS][2];                                                                                 \
        EACH_ROW for (int r = 0; r < ROWS; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();                 \
        const __m256i ones = _mm256_set1_epi16(1), quarters = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);     \
        for (long g0 = 0; g0 < groups; g0 += 16) {                                                           \
            __m256 scale[2];                                                                                 \
            long count = group_block_avx2(gw, sums, groups, g0, ROWS, acc, scale);                           \
            UNROLL                                                                                           \
            for (long g = 0; g < count; g += 4) {                                                            \
                long m = (g0 + g) / 4, at = (g0 + g) * 16;                                                   \
                prefetch(next + at, 64);                                                                     \
                for (int h = 0; h < 2 && g + 2 * h < count; h++) {                                           \
                    long first = g + 2 * h; /* the pair's first group in this block of 16 */                 \
                    __m256i low, high;                                                                       \
                    unpack_pair(w + at + 32 * h, count - first, &low, &high);                                \
                    __m256 sk = _mm256_permutevar8x32_ps(scale[first / 8],                                   \
                                                         _mm256_add_epi32(quarters, _mm256_set1_epi32((int)(first % 8)))); \
                    const int8_t *xq0 = q + m * 128 + 32 * h;                                                \
                    const float *xs0 = ls + m * 16 + 8 * h;                                                  \
                    EACH_ROW for (int r = 0; r < ROWS; r++) {                                                \
                        const int8_t *xq = xq0 + r * xstride;                                                \
                        __m256i xl = _mm256_loadu_si256((const __m256i *)xq);                                \
                        __m256i xh = _mm256_loadu_si256((const __m256i *)(xq + 64));                         \
                        __m256 xs = _mm256_loadu_ps(xs0 + r * sstride);                                      \
                        __m256i sum = _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(low, xl),      \
                                                                         _mm256_maddubs_epi16(high, xh)), ones); \
                        acc[r][h] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(sum), xs), sk, acc[r][h]); \
                    }                                                                                        \
                }                                                                                            \
            }                                                                                                \
        }                                                                                                    \
        EACH_ROW for (int r = 0; r < ROWS; r++) out[r] = sum8(_mm256_add_ps(acc[r][1], acc[r][0]));          \
    }
BLOCK_INT8_AVX2(4, _Pragma("GCC unroll 4"))
BLOCK_INT8_AVX2(2, _Pragma("GCC unroll 4"))
BLOCK_INT8_AVX2(1, )

/* A call's inputs rounded to int8 (`quantize_inputs_avx2`, `quantize_inputs` or
   `quantize_int8_inputs` below) into buffers of their own, 64-byte aligned: `codes` bytes and
   `steps` floats a row (int4 on AVX2: [quads, 128] and [quads, 16]; with VNNI: [spans, 512] and
   [spans, 16]). */
typedef void (*Rounding)(const float *x, long rows, long k, int8_t *quantized, float *lane_scales);
typedef struct {
    int8_t *quantized;
    float *lane_scales;
} Rounded;

static Rounded rounded(Rounding round, const float *x, long rows, long k, long codes, long steps) {
    Rounded r = {aligned_alloc(64, (size_t)(rows * codes)), aligned_alloc(64, (size_t)(rows * steps) * sizeof(float))};
    if (r.quantized == NULL || r.lane_scales == NULL) abort();
    round(x, rows, k, r.quantized, r.lane_scales);
    return r;
}

static void free_rounded(Rounded r) {
    free(r.quantized);
    free(r.lane_scales);
}

static void int4_matmul_avx2_int8(const float *x, const float *sums, long rows, long k, const uint8_t *w,
                                  const uint16_t *groups, long n, float *out) {
    long bytes = k / 2, values = k / 16, count = k / 32, quads = (count + 3) / 4;
    Rounded in = rounded(quantize_inputs_avx2, x, rows, k, quads * 128, quads * 16);
    _Pragma("omp parallel for schedule(static)")
    for (long j = 0; j < n; j++) {
        const uint8_t *row = w + j * bytes, *next = w + (j + 2 < n ? j + 2 : j) * bytes;
        float out4[4];
        for (long r = 0; r < rows;) {
            long take = rows - r >= 4 ? 4 : rows - r >= 2 ? 2 : 1;
            const int8_t *qr = in.quantized + r * quads * 128;
            const float *lr = in.lane_scales + r * quads * 16, *sr = sums + r * count;
            if (take == 4) block_int8_avx2_4(qr, lr, sr, k, row, groups + j * values, next, out4);
            else if (take == 2) block_int8_avx2_2(qr, lr, sr, k, row, groups + j * values, next, out4);
            else block_int8_avx2_1(qr, lr, sr, k, row, groups + j * values, next, out4);
            for (long t = 0; t < take; t++) out[(r + t) * n + j] = out4[t];
            r += take;
        }
    }
    free_rounded(in);
}

/* The same matmuls with AVX-512, where the CPU has it. Each output of a row is summed in two
   16-float sums over 32 inputs at a time, added, then reduced in one order; a block takes 4, 2 or
   1 rows against 2 weight rows, so each weight is converted once for up to 4 rows and each input
   loaded once for 2 outputs (the AVX2 kernel converts it once for each pair of rows: at 8 rows
   its step is bound by that work, not by the read). A row's sums are the same in any block. */
#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl"))) /* a function attribute: gcc and clang both take it */

AVX512 static inline __m512 int8_to_float16(const int8_t *w) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)w)));
}

AVX512 static inline __m512 bf16_to_float16(const uint16_t *w) {
    __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)w));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

/* ROWS rows of x (k apart) against weight rows a and b: out[r] and out[ROWS + r]. */
#define BLOCK(name, type, convert, ROWS)                                                     \
    AVX512 static inline void name##_##ROWS(const float *x, long k, const type *a, const type *b, const type *next, float *out) { \
        __m512 sa[ROWS][2], sb[ROWS][2];                                                    \
        EACH_ROW for (int r = 0; r < ROWS; r++) sa[r][0] = sa[r][1] = sb[r][0] = sb[r][1] = _mm512_setzero_ps(); \
        for (long i = 0; i < k; i += 32) {                                                  \
            prefetch_l2(next + i, 32 * sizeof(type));                                        \
            prefetch_l2(next + k + i, 32 * sizeof(type));                                    \
            __m512 a0 = convert(a + i), a1 = convert(a + i + 16);                           \
            __m512 b0 = convert(b + i), b1 = convert(b + i + 16);                           \
            EACH_ROW for (int r = 0; r < ROWS; r++) {                                       \
                __m512 x0 = _mm512_loadu_ps(x + r * k + i), x1 = _mm512_loadu_ps(x + r * k + i + 16); \
                sa[r][0] = _mm512_fmadd_ps(x0, a0, sa[r][0]);                               \
                sa[r][1] = _mm512_fmadd_ps(x1, a1, sa[r][1]);                               \
                sb[r][0] = _mm512_fmadd_ps(x0, b0, sb[r][0]);                               \
                sb[r][1] = _mm512_fmadd_ps(x1, b1, sb[r][1]);                               \
            }                                                                               \
        }                                                                                   \
        EACH_ROW for (int r = 0; r < ROWS; r++) {                                           \
            out[r] = _mm512_reduce_add_ps(_mm512_add_ps(sa[r][0], sa[r][1]));               \
            out[ROWS + r] = _mm512_reduce_add_ps(_mm512_add_ps(sb[r][0], sb[r][1]));        \
        }                                                                                   \
    }

#define BLOCKS(name, type, convert) BLOCK(name, type, convert, 4) BLOCK(name, type, convert, 2) BLOCK(name, type, convert, 1)
#define FLOATS16(w) _mm512_loadu_ps(w)
BLOCKS(block_int8, int8_t, int8_to_float16)
BLOCKS(block_bf16, uint16_t, bf16_to_float16)
BLOCKS(block_f32, float, FLOATS16)

/* Outputs in pairs shared among the threads (an odd last output paired with itself), rows 4, then
   2, then 1 at a time. */
#define MATMUL512(name, type, block, scaled)                                                 \
    AVX512 static void name(const float *x, long rows, long k, const type *w, const float *scale, long n, float *out) { \
        _Pragma("omp parallel for schedule(static)")                                        \
        for (long pair = 0; pair < (n + 1) / 2; pair++) {                                   \
            long j = 2 * pair, second = j + 1 < n ? j + 1 : j;                              \
            const type *next = w + (j + 3 < n ? j + 2 : j) * k; /* the next pair's rows, read ahead */ \
            float sums[8];                                                                  \
            for (long r = 0; r < rows;) {                                                   \
                long take = rows - r >= 4 ? 4 : rows - r >= 2 ? 2 : 1;                      \
                if (take == 4) block##_4(x + r * k, k, w + j * k, w + second * k, next, sums);    \
                else if (take == 2) block##_2(x + r * k, k, w + j * k, w + second * k, next, sums); \
                else block##_1(x + r * k, k, w + j * k, w + second * k, next, sums);              \
                for (long t = 0; t < take; t++) {                                           \
                    out[(r + t) * n + j] = scaled(sums[t], j);                              \
                    out[(r + t) * n + second] = scaled(sums[take + t], second);             \
                }                                                                           \
                r += take;                                                                  \
            }                                                                               \
        }                                                                                   \
    }

#define BY_SCALE_AT(v, at) ((v) * scale[at])
#define AS_IS_AT(v, at) (v)
MATMUL512(int8_float_matmul_avx512, int8_t, block_int8, BY_SCALE_AT)
MATMUL512(bf16_matmul_avx512, uint16_t, block_bf16, AS_IS_AT)
MATMUL512(f32_matmul_avx512, float, block_f32, AS_IS_AT)

/* The (scale, minimum) pairs of weight row w for the (up to) 16 groups from g0 on, read as one
   vector: their scales into `scale`, and the minimums' part of `rows` rows (their inputs' group sums
   times the minimums) added into `acc`. Returns how many groups there are. */
AVX512 static inline long group_row(const uint16_t *gw, const float *sums, long groups, long g0, int rows, __m512 *acc,
                                    __m512 *scale) {
    long count = groups - g0 < 16 ? groups - g0 : 16;
    __mmask16 mask = (__mmask16)((1u << count) - 1);
    __m512i pairs = _mm512_maskz_loadu_epi32(mask, gw + 2 * g0);
    *scale = _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16));
    __m512 mins = _mm512_castsi512_ps(_mm512_and_si512(pairs, _mm512_set1_epi32((int)0xFFFF0000)));
    EACH_ROW for (int r = 0; r < rows; r++) acc[r] = _mm512_fmadd_ps(mins, _mm512_maskz_loadu_ps(mask, sums + r * groups + g0), acc[r]);
    return count;
}

/* The same for weight rows a and b (into `sa`, `scale_a` and `sb`, `scale_b`). */
AVX512 static inline long group_block(const uint16_t *ga, const uint16_t *gb, const float *sums, long groups, long g0,
                                      int rows, __m512 *sa, __m512 *sb, __m512 *scale_a, __m512 *scale_b) {
    group_row(ga, sums, groups, g0, rows, sa, scale_a);
    return group_row(gb, sums, groups, g0, rows, sb, scale_b);
}

/* int4 with AVX-512. A weight is scale * code + minimum, so a row's product is, over its groups,
   scale * (the inputs times the codes) + minimum * (the sum of the group's inputs): the codes are
   widened to float32 and multiplied as they are (no scaling a weight at a time), each group's
   partial sum scaled once, and the minimums' part taken from the inputs' group sums (`sums`,
   computed once a call). The bfloat16 (scale, minimum) pairs of 16 groups are read as one vector. */
#define BLOCK4(ROWS)                                                                                  \
    AVX512 static inline void block_int4_##ROWS(const float *x, const float *sums, long k, const uint8_t *a, \
                                                const uint16_t *ga, const uint8_t *b, const uint16_t *gb,  \
                                                const uint8_t *next, float *out) {                         \
        long groups = k / 32;                                                                        \
        __m512 sa[ROWS], sb[ROWS];                                                                   \
        EACH_ROW for (int r = 0; r < ROWS; r++) sa[r] = sb[r] = _mm512_setzero_ps();                 \
        const __m512i low4 = _mm512_set1_epi32(15);                                                  \
        for (long g0 = 0; g0 < groups; g0 += 16) {                                                   \
            __m512 scale_a, scale_b;                                                                 \
            long count = group_block(ga, gb, sums, groups, g0, ROWS, sa, sb, &scale_a, &scale_b);   \
            for (long g = 0; g < count; g++) {                                                       \
                long i = (g0 + g) * 32;                                                              \
                if (g % 4 == 0) {                                                                    \
                    prefetch(next + i / 2, 64);                                                      \
                    prefetch(next + k / 2 + i / 2, 64);                                              \
                }                                                                                    \
                __m512i ca = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(a + i / 2)));    \
                __m512i cb = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(b + i / 2)));    \
                __m512 a0 = _mm512_cvtepi32_ps(_mm512_and_si512(ca, low4));                          \
                __m512 a1 = _mm512_cvtepi32_ps(_mm512_srli_epi32(ca, 4));                            \
                __m512 b0 = _mm512_cvtepi32_ps(_mm512_and_si512(cb, low4));                          \
                __m512 b1 = _mm512_cvtepi32_ps(_mm512_srli_epi32(cb, 4));                            \
                __m512i lane = _mm512_set1_epi32((int)g);                                            \
                __m512 ska = _mm512_permutexvar_ps(lane, scale_a);                                   \
                __m512 skb = _mm512_permutexvar_ps(lane, scale_b);                                   \
                EACH_ROW for (int r = 0; r < ROWS; r++) {                                            \
                    __m512 x0 = _mm512_loadu_ps(x + r * k + i), x1 = _mm512_loadu_ps(x + r * k + i + 16); \
                    sa[r] = _mm512_fmadd_ps(_mm512_fmadd_ps(x1, a1, _mm512_mul_ps(x0, a0)), ska, sa[r]); \
                    sb[r] = _mm512_fmadd_ps(_mm512_fmadd_ps(x1, b1, _mm512_mul_ps(x0, b0)), skb, sb[r]); \
                }                                                                                    \
            }                                                                                        \
        }                                                                                            \
        EACH_ROW for (int r = 0; r < ROWS; r++) {                                                    \
            out[r] = _mm512_reduce_add_ps(sa[r]);                                                    \
            out[ROWS + r] = _mm512_reduce_add_ps(sb[r]);                                             \
        }                                                                                            \
    }
BLOCK4(4)
BLOCK4(2)
BLOCK4(1)

AVX512 static void int4_matmul_avx512(const float *x, const float *sums, long rows, long k, const uint8_t *w,
                                      const uint16_t *groups, long n, float *out) {
    long bytes = k / 2, pairs = k / 16, count = k / 32; /* a weight row's bytes, bfloat16 values and groups */
    _Pragma("omp parallel for schedule(static)")
    for (long pair = 0; pair < (n + 1) / 2; pair++) {
        long j = 2 * pair, second = j + 1 < n ? j + 1 : j;
        const uint8_t *next = w + (j + 3 < n ? j + 2 : j) * bytes; /* the next pair's two rows, both inside w */
        const uint8_t *a = w + j * bytes, *b = w + second * bytes;
        const uint16_t *ga = groups + j * pairs, *gb = groups + second * pairs;
        float out8[8];
        for (long r = 0; r < rows;) {
            long take = rows - r >= 4 ? 4 : rows - r >= 2 ? 2 : 1;
            const float *xr = x + r * k, *sr = sums + r * count;
            if (take == 4) block_int4_4(xr, sr, k, a, ga, b, gb, next, out8);
            else if (take == 2) block_int4_2(xr, sr, k, a, ga, b, gb, next, out8);
            else block_int4_1(xr, sr, k, a, ga, b, gb, next, out8);
            for (long t = 0; t < take; t++) {
                out[(r + t) * n + j] = out8[t];
                out[(r + t) * n + second] = out8[take + t];
            }
            r += take;
        }
    }
}

/* int4 with AVX-512 VNNI (llama.cpp's Q4 x Q8 way): each row's inputs are rounded to int8, a
   step a group of 32 (the group's largest magnitude / 127), and each group's codes are multiplied
   by them as bytes (vpdpbusd: unsigned codes by signed inputs, four products summed a lane). A
   weight row's product is then, over its groups, code scale * input step * (the codes times the
   rounded inputs) + minimum * (the sum of the group's inputs as they are).

   The groups go in spans of 16, and a lane of a span's vectors holds one group: its 32 products are
   summed exactly into one int32 lane by 8 vpdpbusd, then converted and scaled once. (Before
   a9352c2 a lane held a quarter of a group, converted and scaled every 8 products: on Zen 4 the
   multiplies and FMAs share vpdpbusd's two pipes, so with 8 rows those, not the byte products,
   bounded the kernel; docs/studies/quantize.md.) A span's 256 bytes of codes are 4 vectors of 4
   groups' 16 bytes each; a 4 x 4 transpose of their 4-byte words within each 128-bit lane turns
   them into 4 vectors whose lane L holds word q (codes 4q..4q+3 in the low halves, 16+4q..16+4q+3
   in the high ones) of group `SPAN_LANE`(L) = 4 (L % 4) + L / 4 of the span. The rounded inputs
   are laid out that way once a call (`quantized`), and each group's input step on its lane
   (`lane_scales`). A last span short of groups is padded with zeros. */

#define VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))
#define SPAN_LANE(g) (4 * ((g) % 4) + (g) / 4) /* the lane of a span's g-th group, and the group of lane g */

/* Row r's inputs rounded to int8 as above (`quantized` [rows, spans, 8, 64] bytes: a span's vectors
   low_0, high_0, ..., low_3, high_3, where lane L of low_q holds inputs 4q..4q+3 of the span's group
   SPAN_LANE(L) and of high_q its inputs 16+4q..16+4q+3) and each group's step on its lane
   (`lane_scales` [rows, spans, 16] floats); the rounding is to nearest, ties to even (the default
   rounding mode). A group whose largest magnitude is too small to invert rounds to zeros; the lanes
   of a last span's missing groups are zeros, their steps zero (no stale NaN may reach the sums). */
VNNI static void quantize_inputs(const float *x, long rows, long k, int8_t *quantized, float *lane_scales) {
    long groups = k / 32, spans = (groups + 15) / 16;
    for (long r = 0; r < rows; r++) {
        int8_t *q = quantized + r * spans * 512;
        float *s = lane_scales + r * spans * 16;
        if (spans == 0) break; /* no inputs */
        memset(q + (spans - 1) * 512, 0, 512);
        memset(s + (spans - 1) * 16, 0, 16 * sizeof(float));
        for (long g = 0; g < groups; g++) {
            const float *xg = x + r * k + g * 32;
            __m512 lo = _mm512_loadu_ps(xg), hi = _mm512_loadu_ps(xg + 16);
            __m512 biggest = _mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi));
            float d = _mm512_reduce_max_ps(biggest) / 127.0f, inverse = d > FLT_MIN ? 1.0f / d : 0.0f;
            __m512 by = _mm512_set1_ps(inverse);
            int8_t low[16], high[16];
            _mm_storeu_si128((__m128i *)low, _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(lo, by))));
            _mm_storeu_si128((__m128i *)high, _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(hi, by))));
            long lane = SPAN_LANE(g % 16);
            int8_t *span = q + (g / 16) * 512 + 4 * lane;
            for (int w = 0; w < 4; w++) {
                memcpy(span + 2 * w * 64, low + 4 * w, 4);
                memcpy(span + (2 * w + 1) * 64, high + 4 * w, 4);
            }
            s[(g / 16) * 16 + lane] = d;
        }
    }
}

/* A span's codes (16 bytes a group; `count` groups, the rest read as zeros) as 4 vectors of 4-byte
   words: lane L of words[w] holds word w of the span's group SPAN_LANE(L), whose low halves meet
   the inputs' low_w and high halves their high_w. */
VNNI static inline void span_words(const uint8_t *codes, long count, __m512i *words) {
    __m512i p[4];
    for (int v = 0; v < 4; v++) {
        long have = count - 4 * v;
        p[v] = have >= 4  ? _mm512_loadu_si512((const void *)(codes + 64 * v))
               : have > 0 ? _mm512_maskz_loadu_epi8((__mmask64)((1ull << (16 * have)) - 1), codes + 64 * v)
                          : _mm512_setzero_si512();
    }
    __m512i t0 = _mm512_unpacklo_epi32(p[0], p[1]), t1 = _mm512_unpackhi_epi32(p[0], p[1]);
    __m512i t2 = _mm512_unpacklo_epi32(p[2], p[3]), t3 = _mm512_unpackhi_epi32(p[2], p[3]);
    words[0] = _mm512_unpacklo_epi64(t0, t2), words[1] = _mm512_unpackhi_epi64(t0, t2);
    words[2] = _mm512_unpacklo_epi64(t1, t3), words[3] = _mm512_unpackhi_epi64(t1, t3);
}

/* Code vector v (0-7) of a span's words: the low nibbles of words[v / 2] for an even v, its high
   nibbles for an odd one (they meet the inputs' low_w and high_w). */
VNNI static inline __m512i span_codes(const __m512i *words, int v) {
    __m512i word = words[v / 2];
    return _mm512_and_si512(v % 2 ? _mm512_srli_epi16(word, 4) : word, _mm512_set1_epi8(15));
}

/* A span's 16 groups' values, given in the groups' order, in the lanes' order (lane L: group SPAN_LANE(L)). */
VNNI static inline __m512 in_lanes(__m512 by_group) {
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), by_group);
}

/* A span's int32 sums (a group a lane) converted once, times the groups' input steps `xs` and code
   scales `scale` (both in the lanes' order), added into `acc`. */
VNNI static inline __m512 scaled_sums(__m512i sum, __m512 xs, __m512 scale, __m512 acc) {
    return _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(sum), xs), scale, acc);
}

/* ROWS (up to 4) rows against weight rows a and b, a span of 16 groups at a time: the minimums'
   part first, by group_block, in the groups' order; then the span's products, in the lanes' order,
   by scaled_sums. The byte products go a code vector at a time over the rows, so that each row's
   int32 sums wait a pass of the rows between two vpdpbusd (their order does not change them: int32
   sums are exact). A row's sums are the same in any block. Eight rows go as two blocks of 4: in one
   block of 8 the rows' sums no longer fit the registers (0.83 of its time on 2 Zen 4 cores). */
#define BLOCK_VNNI(ROWS)                                                                                         \
    VNNI static inline void block_vnni_##ROWS(const int8_t *q, const float *ls, const float *sums, long k, \
                                              const uint8_t *a, const uint16_t *ga, const uint8_t *b,     \
                                              const uint16_t *gb, const uint8_t *next, float *out) {      \
        long groups = k / 32, spans = (groups + 15) / 16;                                              \
        __m512 sa[ROWS], sb[ROWS];                                                                     \
        EACH_ROW for (int r = 0; r < ROWS; r++) sa[r] = sb[r] = _mm512_setzero_ps();                   \
        for (long g0 = 0; g0 < groups; g0 += 16) {                                                     \
            __m512 scale_a, scale_b;                                                                   \
            long count = group_block(ga, gb, sums, groups, g0, ROWS, sa, sb, &scale_a, &scale_b);     \
            long s = g0 / 16, at = g0 * 16;                                                            \
            prefetch_l2(next + at, 256);                                                               \
            prefetch_l2(next + k / 2 + at, 256);                                                       \
            __m512i wa[4], wb[4], ia[ROWS], ib[ROWS];                                                  \
            span_words(a + at, count, wa);                                                             \
            span_words(b + at, count, wb);                                                             \
            EACH_ROW for (int r = 0; r < ROWS; r++) ia[r] = ib[r] = _mm512_setzero_si512();            \
            for (int v = 0; v < 8; v++) {                                                              \
                __m512i ca = span_codes(wa, v), cb = span_codes(wb, v);                                \
                EACH_ROW for (int r = 0; r < ROWS; r++) {                                              \
                    __m512i x = _mm512_loadu_si512((const void *)(q + (r * spans + s) * 512 + 64 * v)); \
                    ia[r] = _mm512_dpbusd_epi32(ia[r], ca, x);                                         \
                    ib[r] = _mm512_dpbusd_epi32(ib[r], cb, x);                                         \
                }                                                                                      \
            }                                                                                          \
            __m512 ska = in_lanes(scale_a), skb = in_lanes(scale_b);                                   \
            EACH_ROW for (int r = 0; r < ROWS; r++) {                                                  \
                __m512 xs = _mm512_loadu_ps(ls + (r * spans + s) * 16);                                \
                sa[r] = scaled_sums(ia[r], xs, ska, sa[r]);                                            \
                sb[r] = scaled_sums(ib[r], xs, skb, sb[r]);                                            \
            }                                                                                          \
        }                                                                                              \
        EACH_ROW for (int r = 0; r < ROWS; r++) {                                                      \
            out[r] = _mm512_reduce_add_ps(sa[r]);                                                      \
            out[ROWS + r] = _mm512_reduce_add_ps(sb[r]);                                               \
        }                                                                                              \
    }
BLOCK_VNNI(4)
BLOCK_VNNI(2)
BLOCK_VNNI(1)

/* ROWS (1 or 2) rows against weight row a alone: block_vnni_ROWS's sums for a, in the same order,
   so the same bits. One or two rows stream the weights a row at a time (on 2 Zen 4 cores, measured
   before a9352c2, in 0.76-0.82 of the time pairs took for one row, 0.85-0.91 for two:
   docs/studies/quantize.md); more rows share each pair's codes. */
#define ONE_VNNI(ROWS)                                                                                   \
    VNNI static inline void one_vnni_##ROWS(const int8_t *q, const float *ls, const float *sums, long k, \
                                            const uint8_t *a, const uint16_t *ga, const uint8_t *next, float *out) { \
        long groups = k / 32, spans = (groups + 15) / 16;                                               \
        __m512 sa[ROWS];                                                                                \
        EACH_ROW for (int r = 0; r < ROWS; r++) sa[r] = _mm512_setzero_ps();                            \
        for (long g0 = 0; g0 < groups; g0 += 16) {                                                      \
            __m512 scale_a;                                                                             \
            long count = group_row(ga, sums, groups, g0, ROWS, sa, &scale_a);                           \
            long s = g0 / 16, at = g0 * 16;                                                             \
            prefetch_l2(next + at, 256);                                                                \
            __m512i wa[4], ia[ROWS];                                                                    \
            span_words(a + at, count, wa);                                                              \
            EACH_ROW for (int r = 0; r < ROWS; r++) ia[r] = _mm512_setzero_si512();                     \
            for (int v = 0; v < 8; v++) {                                                               \
                __m512i ca = span_codes(wa, v);                                                         \
                EACH_ROW for (int r = 0; r < ROWS; r++) {                                               \
                    const void *x = q + (r * spans + s) * 512 + 64 * v;                                 \
                    ia[r] = _mm512_dpbusd_epi32(ia[r], ca, _mm512_loadu_si512(x));                      \
                }                                                                                       \
            }                                                                                           \
            __m512 ska = in_lanes(scale_a);                                                             \
            EACH_ROW for (int r = 0; r < ROWS; r++)                                                     \
                sa[r] = scaled_sums(ia[r], _mm512_loadu_ps(ls + (r * spans + s) * 16), ska, sa[r]);     \
        }                                                                                               \
        EACH_ROW for (int r = 0; r < ROWS; r++) out[r] = _mm512_reduce_add_ps(sa[r]);                   \
    }
ONE_VNNI(1)
ONE_VNNI(2)

VNNI static void int4_matmul_vnni(const float *x, const float *sums, long rows, long k, const uint8_t *w,
                                  const uint16_t *groups, long n, float *out) {
    /* a weight row's bytes, bfloat16 (scale, minimum) values, groups and spans of groups */
    long bytes = k / 2, values = k / 16, count = k / 32, spans = (count + 15) / 16;
    Rounded in = rounded(quantize_inputs, x, rows, k, spans * 512, spans * 16);
    if (rows <= 2) {
        _Pragma("omp parallel for schedule(static)")
        for (long j = 0; j < n; j++) {
            const uint8_t *a = w + j * bytes, *next = w + (j + 2 < n ? j + 2 : j) * bytes;
            float two[2];
            if (rows == 2) one_vnni_2(in.quantized, in.lane_scales, sums, k, a, groups + j * values, next, two);
            else one_vnni_1(in.quantized, in.lane_scales, sums, k, a, groups + j * values, next, two);
            for (long r = 0; r < rows; r++) out[r * n + j] = two[r];
        }
        free_rounded(in);
        return;
    }
    _Pragma("omp parallel for schedule(static)")
    for (long pair = 0; pair < (n + 1) / 2; pair++) {
        long j = 2 * pair, second = j + 1 < n ? j + 1 : j;
        const uint8_t *next = w + (j + 3 < n ? j + 2 : j) * bytes; /* the next pair's two rows, both inside w */
        const uint8_t *a = w + j * bytes, *b = w + second * bytes;
        const uint16_t *ga = groups + j * values, *gb = groups + second * values;
        float out8[8];
        for (long r = 0; r < rows;) {
            long take = rows - r >= 4 ? 4 : rows - r >= 2 ? 2 : 1;
            const int8_t *qr = in.quantized + r * spans * 512;
            const float *lr = in.lane_scales + r * spans * 16, *sr = sums + r * count;
            if (take == 4) block_vnni_4(qr, lr, sr, k, a, ga, b, gb, next, out8);
            else if (take == 2) block_vnni_2(qr, lr, sr, k, a, ga, b, gb, next, out8);
            else block_vnni_1(qr, lr, sr, k, a, ga, b, gb, next, out8);
            for (long t = 0; t < take; t++) {
                out[(r + t) * n + j] = out8[t];
                out[(r + t) * n + second] = out8[take + t];
            }
            r += take;
        }
    }
    free_rounded(in);
}

/* int8 weights with AVX-512 VNNI, on inputs rounded to int8 (llama.cpp's Q8 x Q8 way). A row's k
   inputs go in spans of 512 (8 vectors of 64; the last span may be shorter, its last vector half
   empty), and within a span a lane's inputs are one group: lane l of its vectors, 4 inputs each
   (inputs 64v + 4l .. 64v + 4l + 3), up to 32 inputs, rounded at a step of their largest magnitude /
   127. So vpdpbusd adds a whole group's products into one int32 lane, exactly, and each group is
   converted and scaled once. vpdpbusd multiplies unsigned bytes by signed ones: the inputs are kept
   as q + 128 and the weights' sums times 128, which the same instruction computes once a weight row
   and span, taken back off. A row's numbers never depend on the other rows. */

#define INT8_SPAN 512

/* Row r's inputs rounded as above: `codes` [rows, spans * 512] bytes, q + 128 in the inputs' order
   (128 past k), `steps` [rows, spans, 16] floats, a lane's group's step (0 where the group is empty
   or too small to invert, its inputs then 0; NaN where one of its inputs is infinite or NaN, so
   the row's outputs are NaN, as the float kernels' would be). Rounding to nearest, ties to even, as
   int4's. */
static void quantize_int8_inputs(const float *x, long rows, long k, int8_t *codes, float *steps) {
    long spans = (k + INT8_SPAN - 1) / INT8_SPAN;
    uint8_t *biased = (uint8_t *)codes; /* unsigned, as vpdpbusd reads them */
    for (long r = 0; r < rows; r++)
        for (long s = 0; s < spans; s++) {
            const float *xs = x + r * k + s * INT8_SPAN;
            uint8_t *bs = biased + (r * spans + s) * INT8_SPAN;
            long width = k - s * INT8_SPAN < INT8_SPAN ? k - s * INT8_SPAN : INT8_SPAN;
            for (long i = width; i < INT8_SPAN; i++) bs[i] = 128;
            for (int l = 0; l < 16; l++) {
                float biggest = 0.0f;
                int finite = 1;
                for (long v = 0; v * 64 + 4 * l < width; v++)
                    for (int t = 0; t < 4; t++) {
                        float size = fabsf(xs[v * 64 + 4 * l + t]);
                        finite &= size <= FLT_MAX; /* false for an infinity or a NaN */
                        biggest = fmaxf(biggest, size);
                    }
                float d = biggest / 127.0f, inverse = d > FLT_MIN && finite ? 1.0f / d : 0.0f;
                for (long v = 0; v * 64 + 4 * l < width; v++)
                    for (int t = 0; t < 4; t++) {
                        float q = fminf(fmaxf(nearbyintf(xs[v * 64 + 4 * l + t] * inverse), -127.0f), 127.0f);
                        bs[v * 64 + 4 * l + t] = (uint8_t)(128 + (int)q);
                    }
                steps[(r * spans + s) * 16 + l] = !finite ? NAN : inverse > 0.0f ? d : 0.0f; /* NaN: carried to the outputs */
            }
        }
}

/* ROWS rows against weight rows a and b: out[r] and out[ROWS + r], before the rows' scales. */
#define BLOCK_INT8_VNNI(ROWS)                                                                                  \
    VNNI static inline void block_int8_vnni_##ROWS(const uint8_t *u, const float *steps, long k, const int8_t *a, \
                                                   const int8_t *b, const int8_t *next, float *out) {           \
        long spans = (k + INT8_SPAN - 1) / INT8_SPAN;                                                         \
        const __m512i bias = _mm512_set1_epi8((char)128);                                                     \
        __m512 fa[ROWS], fb[ROWS];                                                                            \
        EACH_ROW for (int r = 0; r < ROWS; r++) fa[r] = fb[r] = _mm512_setzero_ps();                          \
        for (long s = 0; s < spans; s++) {                                                                    \
            __m512i ia[ROWS], ib[ROWS], ca = _mm512_setzero_si512(), cb = _mm512_setzero_si512();            \
            EACH_ROW for (int r = 0; r < ROWS; r++) ia[r] = ib[r] = _mm512_setzero_si512();                   \
            for (long i = s * INT8_SPAN; i < k && i < (s + 1) * INT8_SPAN; i += 64) {                         \
                prefetch_l2(next + i, 64);                                                                    \
                prefetch_l2(next + k + i, 64);                                                                \
                __mmask64 mask = k - i >= 64 ? ~0ull : (1ull << (k - i)) - 1;                                 \
                __m512i wa = _mm512_maskz_loadu_epi8(mask, a + i), wb = _mm512_maskz_loadu_epi8(mask, b + i); \
                ca = _mm512_dpbusd_epi32(ca, bias, wa);                                                       \
                cb = _mm512_dpbusd_epi32(cb, bias, wb);                                                       \
                EACH_ROW for (int r = 0; r < ROWS; r++) {                                                     \
                    __m512i xu = _mm512_load_si512((const void *)(u + r * spans * INT8_SPAN + i));            \
                    ia[r] = _mm512_dpbusd_epi32(ia[r], xu, wa);                                               \
                    ib[r] = _mm512_dpbusd_epi32(ib[r], xu, wb);                                               \
                }                                                                                             \
            }                                                                                                 \
            EACH_ROW for (int r = 0; r < ROWS; r++) {                                                         \
                __m512 step = _mm512_load_ps(steps + (r * spans + s) * 16);                                   \
                fa[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(ia[r], ca)), step, fa[r]);       \
                fb[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(ib[r], cb)), step, fb[r]);       \
            }                                                                                                 \
        }                                                                                                     \
        EACH_ROW for (int r = 0; r < ROWS; r++) {                                                             \
            out[r] = _mm512_reduce_add_ps(fa[r]);                                                             \
            out[ROWS + r] = _mm512_reduce_add_ps(fb[r]);                                                      \
        }                                                                                                     \
    }
BLOCK_INT8_VNNI(4)
BLOCK_INT8_VNNI(2)
BLOCK_INT8_VNNI(1)

VNNI static void int8_matmul_vnni(const float *x, long rows, long k, const int8_t *w, const float *scale, long n,
                                  float *out) {
    long spans = (k + INT8_SPAN - 1) / INT8_SPAN;
    Rounded in = rounded(quantize_int8_inputs, x, rows, k, spans * INT8_SPAN, spans * 16);
    const uint8_t *u = (const uint8_t *)in.quantized;
    const float *steps = in.lane_scales;
    _Pragma("omp parallel for schedule(static)")
    for (long pair = 0; pair < (n + 1) / 2; pair++) {
        long j = 2 * pair, second = j + 1 < n ? j + 1 : j;
        const int8_t *next = w + (j + 3 < n ? j + 2 : j) * k; /* the next pair's rows, read ahead */
        float sums[8];
        for (long r = 0; r < rows;) {
            long take = rows - r >= 4 ? 4 : rows - r >= 2 ? 2 : 1;
            const uint8_t *ur = u + r * spans * INT8_SPAN;
            const float *sr = steps + r * spans * 16;
            if (take == 4) block_int8_vnni_4(ur, sr, k, w + j * k, w + second * k, next, sums);
            else if (take == 2) block_int8_vnni_2(ur, sr, k, w + j * k, w + second * k, next, sums);
            else block_int8_vnni_1(ur, sr, k, w + j * k, w + second * k, next, sums);
            for (long t = 0; t < take; t++) {
                out[(r + t) * n + j] = sums[t] * scale[j];
                out[(r + t) * n + second] = sums[take + t] * scale[second];
            }
            r += take;
        }
    }
    free_rounded(in);
}

/* The float32 weight [n, k] an int4 weight stands for (scale * code + minimum, as torch computes
   `quantize.int4_weight`), its rows shared among the threads: a prompt's pass over a float32 model
   multiplies by it. The same bits whether or not the compiler fuses the two into an FMA: a code
   (4 bits) times a bfloat16 scale (8) is exact in float32. */
void int4_dequantize(const uint8_t *w, const uint16_t *groups, long n, long k, float *out) {
    const __m256i low4 = _mm256_set1_epi32(15);
    _Pragma("omp parallel for schedule(static)")
    for (long j = 0; j < n; j++)
        for (long g = 0; g < k / 32; g++) {
            const uint8_t *codes = w + j * (k / 2) + g * 16;
            const uint16_t *pair = groups + (j * (k / 32) + g) * 2;
            __m256 scale = _mm256_set1_ps(bf16_value(pair[0])), low = _mm256_set1_ps(bf16_value(pair[1]));
            float *at = out + j * k + g * 32;
            for (int half = 0; half < 2; half++) { /* bytes 0-7, then 8-15: inputs 0-7 and 16-23, 8-15 and 24-31 */
                __m256i c = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(codes + 8 * half)));
                __m256 lo = _mm256_cvtepi32_ps(_mm256_and_si256(c, low4)), hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(c, 4));
                _mm256_storeu_ps(at + 8 * half, _mm256_add_ps(_mm256_mul_ps(lo, scale), low));
                _mm256_storeu_ps(at + 16 + 8 * half, _mm256_add_ps(_mm256_mul_ps(hi, scale), low));
            }
        }
}

/* Set between steps (a step that saw it change would mix the two sets); -1: not yet decided. */
static long avx512 = -1;

long matmul_avx512(long wanted) {
    if (wanted >= 0 || avx512 < 0)
        avx512 = wanted != 0 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                 __builtin_cpu_supports("avx512vl");
    return avx512;
}

/* Whether int4 rounds its inputs to int8 where it can (the VNNI kernel with the AVX-512 ones on a
   CPU with VNNI, the AVX2 int8 kernel with the AVX2 ones), and int8 (with the AVX-512 ones on a
   CPU with VNNI); -1: not yet decided. */
static long int8_inputs = -1;

long matmul_int8_inputs(long wanted) {
    if (wanted >= 0 || int8_inputs < 0) int8_inputs = wanted != 0;
    return int8_inputs;
}

long int4_rounds_inputs(void) {
    return matmul_int8_inputs(-1) && (!matmul_avx512(-1) || __builtin_cpu_supports("avx512vnni"));
}

long int8_rounds_inputs(void) {
    return matmul_int8_inputs(-1) && matmul_avx512(-1) && __builtin_cpu_supports("avx512vnni");
}

#define DISPATCH(name, type)                                                                 \
    void name(const float *x, long rows, long k, const type *w, const float *scale, long n, float *out) { \
        if (matmul_avx512(-1)) name##_avx512(x, rows, k, w, scale, n, out);                 \
        else name##_avx2(x, rows, k, w, scale, n, out);                                     \
    }
DISPATCH(int8_float_matmul, int8_t)
DISPATCH(bf16_matmul, uint16_t)
DISPATCH(f32_matmul, float)

void int8_matmul(const float *x, long rows, long k, const int8_t *w, const float *scale, long n, float *out) {
    if (rows == 0 || n == 0) return;
    if (int8_rounds_inputs()) int8_matmul_vnni(x, rows, k, w, scale, n, out);
    else int8_float_matmul(x, rows, k, w, scale, n, out);
}

void int4_matmul(const float *x, long rows, long k, const uint8_t *w, const uint16_t *groups, long n, float *out) {
    if (rows == 0 || n == 0) return;
    long count = rows * (k / 32);
    float small[4096]; /* a decode step's rows fit; a longer call takes the heap */
    float *sums = count <= 4096 ? small : malloc((size_t)count * sizeof(float));
    if (sums == NULL) abort();
    group_sums(x, rows, k, sums);
    long rounds = int4_rounds_inputs(), wide = matmul_avx512(-1); /* read once: one kernel a call */
    if (rounds && wide) int4_matmul_vnni(x, sums, rows, k, w, groups, n, out);
    else if (rounds) int4_matmul_avx2_int8(x, sums, rows, k, w, groups, n, out);
    else if (wide) int4_matmul_avx512(x, sums, rows, k, w, groups, n, out);
    else int4_matmul_avx2(x, sums, rows, k, w, groups, n, out);
    if (sums != small) free(sums);
}
void weight_matmul(const Weight *w, const float *x, long rows, float *out) {
    if (w->kind == KIND_INT8) int8_matmul(x, rows, w->in, w->data, w->scale, w->out, out);
    else if (w->kind == KIND_INT4) int4_matmul(x, rows, w->in, w->data, w->scale, w->out, out);
    else if (w->kind == KIND_BF16) bf16_matmul(x, rows, w->in, w->data, w->scale, w->out, out);
    else f32_matmul(x, rows, w->in, w->data, w->scale, w->out, out);
    if (w->bias != NULL)
        for (long r = 0; r < rows; r++)
            for (long j = 0; j < w->out; j++) out[r * w->out + j] += w->bias[j];
}
