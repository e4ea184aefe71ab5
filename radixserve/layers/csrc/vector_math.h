/* Vector arithmetic that the CPU attention kernels share (attention.c): eight
 * floats as one vector value, horizontal sums, dot products of one row with
 * four, and an exponential that vectorizes. Header-only: the functions are
 * inlined into the loops that call them. */
#ifndef RADIXSERVE_VECTOR_MATH_H
#define RADIXSERVE_VECTOR_MATH_H

#include <math.h>
#include <stdint.h>
#include <string.h>

/* Eight floats as one vector value (GCC's and Clang's vector extension: one
 * AVX register where the ISA has it, two SSE ones or scalars elsewhere); its
 * 4-byte alignment lets it load from any float. Dot products sum eight lanes
 * each in registers, then fold the lanes once: an OpenMP simd reduction goes
 * through memory for the fold, which cost more than the products here. */
typedef float v8 __attribute__((vector_size(32), aligned(4)));

static inline float hsum8(v8 x) {
#if defined(__clang__) || __GNUC__ >= 12
    v8 y = x + __builtin_shufflevector(x, x, 4, 5, 6, 7, 0, 1, 2, 3);
    y += __builtin_shufflevector(y, y, 2, 3, 0, 1, 6, 7, 4, 5);
    y += __builtin_shufflevector(y, y, 1, 0, 3, 2, 5, 4, 7, 6);
    return y[0];
#else
    float r = 0.0f;
    for (int i = 0; i < 8; i++) r += x[i];
    return r;
#endif
}

/* Four vector sums folded into their four totals: [hsum8(a0), .., hsum8(a3)]
 * in six in-lane shuffles and four adds, where four hsum8 take twelve
 * shuffles and twelve adds. */
static inline void fold4(v8 a0, v8 a1, v8 a2, v8 a3, float d[4]) {
#if defined(__clang__) || __GNUC__ >= 12
    const v8 t0 = __builtin_shufflevector(a0, a1, 0, 8, 2, 10, 4, 12, 6, 14) +
                  __builtin_shufflevector(a0, a1, 1, 9, 3, 11, 5, 13, 7, 15);
    const v8 t1 = __builtin_shufflevector(a2, a3, 0, 8, 2, 10, 4, 12, 6, 14) +
                  __builtin_shufflevector(a2, a3, 1, 9, 3, 11, 5, 13, 7, 15);
    const v8 u = __builtin_shufflevector(t0, t1, 0, 1, 8, 9, 4, 5, 12, 13) +
                 __builtin_shufflevector(t0, t1, 2, 3, 10, 11, 6, 7, 14, 15);
    for (int i = 0; i < 4; i++) d[i] = u[i] + u[i + 4];
#else
    d[0] = hsum8(a0), d[1] = hsum8(a1), d[2] = hsum8(a2), d[3] = hsum8(a3);
#endif
}

/* exp(x) to about 2 ulp over [-87, 88] (Cephes' expf polynomial), without a
 * call, so that loops over it vectorize; 0 below -87 (-inf included), exp(88)
 * above 88. */
static inline float exp_approx(float x) {
    if (x < -87.0f) return 0.0f;
    float v = x > 88.0f ? 88.0f : x;
    float fn = floorf(v * 1.44269504088896341f + 0.5f);
    float r = v - fn * 0.693359375f + fn * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int32_t bits = ((int32_t)fn + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

/* d[u] = x . y[u] over n floats for u < 4: four independent vector sums
 * folded once (a plain loop where n is not a multiple of 8). */
static inline void dot4(const float *x, const float *y0, const float *y1, const float *y2, const float *y3, int n,
                        float d[4]) {
    if (n % 8 == 0) {
        v8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
        for (int i = 0; i < n; i += 8) {
            const v8 xv = *(const v8 *)(x + i);
            a0 += xv * *(const v8 *)(y0 + i);
            a1 += xv * *(const v8 *)(y1 + i);
            a2 += xv * *(const v8 *)(y2 + i);
            a3 += xv * *(const v8 *)(y3 + i);
        }
        fold4(a0, a1, a2, a3, d);
        return;
    }
    float d0 = 0.0f, d1 = 0.0f, d2 = 0.0f, d3 = 0.0f;
#pragma omp simd reduction(+ : d0, d1, d2, d3)
    for (int i = 0; i < n; i++) {
        d0 += x[i] * y0[i];
        d1 += x[i] * y1[i];
        d2 += x[i] * y2[i];
        d3 += x[i] * y3[i];
    }
    d[0] = d0, d[1] = d1, d[2] = d2, d[3] = d3;
}

#endif
