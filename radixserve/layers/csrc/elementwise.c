/* Two of a decoder layer's elementwise steps on the CPU, each one pass over
 * its rows where torch's CPU operators make several: RMSNorm with its
 * residual add (the add, the norm's statistics, its scaling, the weight) and
 * rotary (four products, two sums and a concatenation, on q and on k).
 * float32 throughout, with the same formulas, in the same order per element,
 * as the torch reference of each module (layernorm.py, rotary_embedding.py);
 * only the sum of squares is added up in another order. Rows are shared out
 * over OpenMP threads (torch's). Built with attention.c by
 * cpu_kernels.py. (silu-and-mul stays on torch: a pass of this kind with a
 * polynomial exp was slower than torch's two.) */
#include <math.h>
#include <stdint.h>

/* With add: sum = x + residual, out = weight * (sum * 1 / sqrt(mean(sum^2) + eps));
 * without: the same over x (sum and residual unused). x and residual: [rows,
 * cols] with row strides; sum and out: [rows, cols], contiguous. */
void rs_add_rms_norm(const float *x, int64_t x_stride, const float *residual, int64_t r_stride, float *sum,
                     const float *weight, float *out, int64_t rows, int cols, float eps, int add, int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * x_stride;
        float *orow = out + r * cols;
        float ss = 0.0f;
        if (add) {
            const float *rr = residual + r * r_stride;
            float *sr = sum + r * cols;
#pragma omp simd reduction(+ : ss)
            for (int i = 0; i < cols; i++) {
                const float v = xr[i] + rr[i];
                sr[i] = v;
                ss += v * v;
            }
            xr = sr;
        } else {
#pragma omp simd reduction(+ : ss)
            for (int i = 0; i < cols; i++) ss += xr[i] * xr[i];
        }
        const float inv = 1.0f / sqrtf(ss / (float)cols + eps);
#pragma omp simd
        for (int i = 0; i < cols; i++) orow[i] = weight[i] * (xr[i] * inv);
    }
}

/* For each row t and each head of q ([rows, q_heads * head_dim], row stride
 * q_stride) and of k, into q_out and k_out (contiguous): with (c, s) the
 * halves of cos_sin[positions[t]], x1' = x1 * c - x2 * s and
 * x2' = x2 * c + x1 * s (NeoX style, as HF's rotate_half). Returns the
 * number of positions outside [0, max_pos) (their rows are left unwritten). */
int64_t rs_rotary(const float *q, int64_t q_stride, float *q_out, int q_heads, const float *k, int64_t k_stride,
                  float *k_out, int k_heads, const int64_t *positions, const float *cos_sin, int64_t max_pos,
                  int64_t rows, int head_dim, int num_threads) {
    const int half = head_dim / 2;
    int64_t bad = 0;
#pragma omp parallel for num_threads(num_threads) schedule(static) reduction(+ : bad)
    for (int64_t t = 0; t < rows; t++) {
        if (positions[t] < 0 || positions[t] >= max_pos) {
            bad++;
            continue;
        }
        const float *c = cos_sin + positions[t] * head_dim, *s = c + half;
        for (int which = 0; which < 2; which++) {
            const int heads = which == 0 ? q_heads : k_heads;
            const float *src = which == 0 ? q + t * q_stride : k + t * k_stride;
            float *dst = which == 0 ? q_out + t * q_heads * head_dim : k_out + t * k_heads * head_dim;
            for (int h = 0; h < heads; h++) {
                const float *x1 = src + h * head_dim, *x2 = x1 + half;
                float *y1 = dst + h * head_dim, *y2 = y1 + half;
#pragma omp simd
                for (int i = 0; i < half; i++) {
                    y1[i] = x1[i] * c[i] - x2[i] * s[i];
                    y2[i] = x2[i] * c[i] + x1[i] * s[i];
                }
            }
        }
    }
    return bad;
}
