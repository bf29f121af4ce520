/* The matmuls of weight_only.c, for decode_step.c. */
#pragma once
#include <immintrin.h>
#include <stdint.h>

/* The sum of a vector's 8 floats, in one order. */
static inline float sum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

enum { KIND_F32 = 0, KIND_BF16 = 1, KIND_INT8 = 2, KIND_INT4 = 3 };

/* A linear layer's stored weight [out, in] (in a multiple of 32; int4: [out, in / 2] bytes), its
   scales (int8: float32 [out]; int4: bfloat16 [out, in / 32, 2], each group's scale and minimum;
   else NULL) and its bias [out] (else NULL). */
typedef struct {
    const void *data;
    const void *scale;
    const float *bias;
    long out, in;
    long kind;
} Weight;

void int8_matmul(const float *x, long rows, long k, const int8_t *w, const float *scale, long n, float *out);
void bf16_matmul(const float *x, long rows, long k, const uint16_t *w, const float *scale, long n, float *out);
void f32_matmul(const float *x, long rows, long k, const float *w, const float *scale, long n, float *out);
/* int4: w [n, k / 2] bytes, a group of 32 inputs in 16 bytes (byte j: input j in its low half,
   input j + 16 in its high half), each weight scale * code + minimum with the group's pair from
   groups [n, k / 32, 2] (bfloat16); where `int4_rounds_inputs`, the inputs are rounded to int8 a
   group of 32 first (weight_only.c: int4_matmul_vnni, int4_matmul_avx2_int8) */
void int4_matmul(const float *x, long rows, long k, const uint8_t *w, const uint16_t *groups, long n, float *out);
/* out [n, k] float32 = the int4 weight (w, groups as int4_matmul's) as scale * code + minimum */
void int4_dequantize(const uint8_t *w, const uint16_t *groups, long n, long k, float *out);
/* Whether the matmuls run their AVX-512 kernels: `wanted` 1 where the CPU has AVX-512 (the default),
   0 never (the AVX2 ones), -1 only asks. Returns the choice. */
long matmul_avx512(long wanted);
/* Whether int4 and int8 round their inputs to int8 where they can (the default): `wanted` as above. */
long matmul_int8_inputs(long wanted);
/* Whether int4's matmuls round their inputs now: the switch above on, and the AVX2 kernels or the
   AVX-512 ones on a CPU with VNNI. */
long int4_rounds_inputs(void);
/* Whether int8's matmuls round their inputs now (weight_only.c: int8_matmul_vnni): the switch on,
   the AVX-512 kernels on, on a CPU with VNNI. */
long int8_rounds_inputs(void);
/* out [rows, w->out] = x [rows, w->in] times the weight transposed, plus the bias */
void weight_matmul(const Weight *w, const float *x, long rows, float *out);
