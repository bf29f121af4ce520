/* One decode step of a Llama-family model's layers for a few rows, each row at its own position
   with its own key/value cache (engine/models/native_step.py).

   Per layer, as the model's own modules compute it (transformers' Llama, Qwen2, Mistral):
     x = rms_norm(h) * input_norm
     q, k, v = x @ qkv^T (+ bias); q, k rotated (rotate_half convention) with the row's cos/sin
     k, v written at the row's position; each query head attends (softmax of q.k * scaling) to its
     key/value head's keys 0..position of its row
     h += attention @ o^T (+ bias)
     x = rms_norm(h) * post_norm
     h += (silu(x @ gate^T) * (x @ up^T)) @ down^T
   Matmuls share their output rows among the OpenMP team (weight_only.c); attention shares the
   (row, key/value head) pairs. A row's numbers never depend on the other rows.

   `before_attention`, where not NULL, is called once a layer, on the calling thread, with the
   layer's index and its q, k, v [rows, (heads + 2 kv_heads) head_dim] before rotary: it may
   rewrite the rows' caches below `length` (the kvcache memory places the segments a layer's
   queries select there) before the layer attends. */

#include <immintrin.h>
#include <math.h>
#include <stddef.h>

#include "weight_only.h"

typedef struct {
    const float *input_norm, *post_norm; /* [hidden] */
    Weight qkv;                          /* [(heads + 2 kv_heads) head_dim, hidden] */
    Weight o;                            /* [hidden, heads head_dim] */
    Weight gate_up;                      /* [2 intermediate, hidden] */
    Weight down;                         /* [hidden, intermediate] */
} Layer;

typedef struct {
    long layers, hidden, heads, kv_heads, head_dim, intermediate;
    float eps, scaling;
} Shape;

/* A row's cache: keys and values [layers, kv_heads, capacity, head_dim]; the step writes at
   `length`; cos and sin [head_dim] of that position. */
typedef struct {
    float *keys, *values;
    long capacity, length;
    const float *cos, *sin;
} Row;

static void rms_norm(const float *h, const float *weight, long n, float eps, float *out) {
    float sum = 0.0f;
    for (long i = 0; i < n; i++) sum += h[i] * h[i];
    float scale = 1.0f / sqrtf(sum / (float)n + eps);
    for (long i = 0; i < n; i++) out[i] = weight[i] * (h[i] * scale);
}

static void rotate(float *x, const float *cos, const float *sin, long d) {
    long half = d / 2;
    for (long i = 0; i < half; i++) {
        float a = x[i], b = x[i + half];
        x[i] = a * cos[i] - b * sin[i];
        x[i + half] = b * cos[i + half] + a * sin[i + half];
    }
}

/* e^x for 8 floats (Cephes' expf: x = n ln2 + r, |r| <= ln2 / 2, a degree-7 polynomial for e^r,
   2^n put in the exponent), within about 2 ulp; x is clamped to [-87.3, 88], where e^x stays a
   normal float. */
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.33654f)), _mm256_set1_ps(88.0f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i power = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(power));
}

/* s[j] = e^(s[j] - top) for j < count; returns their sum. */
static float exp_shifted(float *s, long count, float top) {
    __m256 shift = _mm256_set1_ps(top), sums = _mm256_setzero_ps();
    long j = 0;
    for (; j + 8 <= count; j += 8) {
        __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), shift));
        _mm256_storeu_ps(s + j, e);
        sums = _mm256_add_ps(sums, e);
    }
    float total = sum8(sums), tail[8] = {0};
    if (j < count) {
        for (long i = j; i < count; i++) tail[i - j] = s[i];
        _mm256_storeu_ps(tail, exp8(_mm256_sub_ps(_mm256_loadu_ps(tail), shift)));
        for (long i = j; i < count; i++) total += (s[i] = tail[i - j]);
    }
    return total;
}

/* act [n] = silu(gate) * up, n a multiple of 8. */
static void silu_times(const float *gate, const float *up, long n, float *act) {
    for (long i = 0; i < n; i += 8) {
        __m256 g = _mm256_loadu_ps(gate + i);
        __m256 silu = _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), g))));
        _mm256_storeu_ps(act + i, _mm256_mul_ps(silu, _mm256_loadu_ps(up + i)));
    }
}

static inline float dot(const float *a, const float *b, long d) {
    __m256 s0 = _mm256_setzero_ps(), s1 = s0;
    for (long i = 0; i < d; i += 16) {
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
        s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), s1);
    }
    return sum8(_mm256_add_ps(s0, s1));
}

/* The query heads of one key/value head of one row: scores over the row's keys 0..length,
   softmax, the weighted sum of the values into out [group, head_dim]. scores: [group, length + 1]. */
static void attend(const float *q, const float *keys, const float *values, long length, long group, long d,
                   float scaling, float *scores, float *out) {
    long count = length + 1, ahead = 8 * d; /* keys and values are read ahead, 8 positions on */
    for (long j = 0; j < count; j++) {
        for (long i = 0; i < d; i += 16) _mm_prefetch((const char *)(keys + j * d + ahead + i), _MM_HINT_T0);
        for (long g = 0; g < group; g++) scores[g * count + j] = dot(q + g * d, keys + j * d, d) * scaling;
    }
    for (long g = 0; g < group; g++) {
        float *s = scores + g * count, top = s[0];
        for (long j = 1; j < count; j++) top = s[j] > top ? s[j] : top;
        float inverse = 1.0f / exp_shifted(s, count, top);
        for (long j = 0; j < count; j++) s[j] *= inverse;
    }
    for (long i = 0; i < group * d; i++) out[i] = 0.0f;
    for (long j = 0; j < count; j++) { /* each value read once, for every query head of the group */
        const float *v = values + j * d;
        for (long i = 0; i < d; i += 16) _mm_prefetch((const char *)(v + ahead + i), _MM_HINT_T0);
        for (long g = 0; g < group; g++) {
            __m256 p = _mm256_set1_ps(scores[g * count + j]);
            float *o = out + g * d;
            for (long i = 0; i < d; i += 8) _mm256_storeu_ps(o + i, _mm256_fmadd_ps(p, _mm256_loadu_ps(v + i), _mm256_loadu_ps(o + i)));
        }
    }
}

/* scratch: at least decode_step_scratch(shape, rows, longest) floats. */
long decode_step_scratch(const Shape *s, long rows, long longest) {
    long qkv = (s->heads + 2 * s->kv_heads) * s->head_dim;
    return rows * (s->hidden + qkv + s->heads * s->head_dim + 3 * s->intermediate + s->hidden) + rows * s->heads * (longest + 1);
}

/* hidden [rows, hidden]: the tokens' embeddings in, the last layer's output out; logits
   [rows, head->out] from the final norm and the head. */
void decode_step(const Shape *s, const Layer *layers, const float *final_norm, const Weight *head, float *hidden, long rows,
                 const Row *row, float *scratch, float *logits, void (*before_attention)(long layer, const float *qkv)) {
    long d = s->head_dim, group = s->heads / s->kv_heads, qkv_width = (s->heads + 2 * s->kv_heads) * d;
    long longest = 0;
    for (long r = 0; r < rows; r++) longest = row[r].length > longest ? row[r].length : longest;
    float *x = scratch, *qkv = x + rows * s->hidden, *attn = qkv + rows * qkv_width;
    float *gate_up = attn + rows * s->heads * d, *act = gate_up + rows * 2 * s->intermediate;
    float *delta = act + rows * s->intermediate, *scores = delta + rows * s->hidden;
    for (long l = 0; l < s->layers; l++) {
        const Layer *layer = layers + l;
        for (long r = 0; r < rows; r++) rms_norm(hidden + r * s->hidden, layer->input_norm, s->hidden, s->eps, x + r * s->hidden);
        weight_matmul(&layer->qkv, x, rows, qkv);
        if (before_attention) before_attention(l, qkv);
        for (long r = 0; r < rows; r++) {
            float *q = qkv + r * qkv_width, *k = q + s->heads * d, *v = k + s->kv_heads * d;
            for (long h = 0; h < s->heads + s->kv_heads; h++) rotate(q + h * d, row[r].cos, row[r].sin, d);
            for (long h = 0; h < s->kv_heads; h++) {
                long at = ((l * s->kv_heads + h) * row[r].capacity + row[r].length) * d;
                for (long i = 0; i < d; i++) row[r].keys[at + i] = k[h * d + i], row[r].values[at + i] = v[h * d + i];
            }
        }
#pragma omp parallel for collapse(2) schedule(static)
        for (long r = 0; r < rows; r++)
            for (long h = 0; h < s->kv_heads; h++) {
                long base = (l * s->kv_heads + h) * row[r].capacity * d;
                attend(qkv + r * qkv_width + h * group * d, row[r].keys + base, row[r].values + base, row[r].length, group, d,
                       s->scaling, scores + (r * s->heads + h * group) * (longest + 1), attn + (r * s->heads + h * group) * d);
            }
        weight_matmul(&layer->o, attn, rows, delta);
        for (long i = 0; i < rows * s->hidden; i++) hidden[i] += delta[i];
        for (long r = 0; r < rows; r++) rms_norm(hidden + r * s->hidden, layer->post_norm, s->hidden, s->eps, x + r * s->hidden);
        weight_matmul(&layer->gate_up, x, rows, gate_up);
        long slices = s->intermediate / 32;  /* the MLP's width is a multiple of 32 (the down matmul's input) */
#pragma omp parallel for schedule(static)
        for (long at = 0; at < rows * slices; at++) {
            const float *gate = gate_up + (at / slices) * 2 * s->intermediate + (at % slices) * 32;
            silu_times(gate, gate + s->intermediate, 32, act + (at / slices) * s->intermediate + (at % slices) * 32);
        }
        weight_matmul(&layer->down, act, rows, delta);
        for (long i = 0; i < rows * s->hidden; i++) hidden[i] += delta[i];
    }
    for (long r = 0; r < rows; r++) rms_norm(hidden + r * s->hidden, final_norm, s->hidden, s->eps, x + r * s->hidden);
    weight_matmul(head, x, rows, logits);
}
