/* Attention on the CPU, straight from the paged KV pool: decode, then extend
 * (prefill), and at the end of this file decode with shared prefixes read
 * once per group.
 *
 * Decode: one query token per request attends to the request's whole context, whose
 * K/V rows sit at slots req_to_token[row, 0 .. seq_len) of the pool. The work
 * is split over (request, KV split) items; each item streams the K and V rows
 * of its keys once (all KV heads of a slot are contiguous) for every query
 * head, with a blocked online softmax, and splits of one request are merged
 * at the end (split-KV, for small batches with long contexts). Built at run time by cpu_kernels.py with
 * the host's vector ISA; OpenMP is the one torch already runs.
 *
 * q and out are float32; the pool is float32, or one-byte elements (fp8) that
 * a 256-entry table turns into float32, one slot's row at a time, as they are
 * read. Layouts (element strides):
 *   q       [bs, num_heads, head_dim], row stride q_stride (a view of qkv)
 *   k, v    [pool_rows, num_kv_heads, head_dim], contiguous
 *   req_to_token [*, rtt_stride] int32; rows [bs] int64; seq_lens [bs] int64
 *   out     [bs, num_heads, head_dim], contiguous
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vector_math.h"

#define BLOCK 32   /* keys scored before each softmax rescale */
#define PREFETCH 4 /* keys ahead whose K rows are prefetched */

/* A slot's row fetched into L2, not L1 (locality 1: prefetcht2). A step's K/V
 * are far larger than the caches, and the rows of keys ahead, fetched into
 * L1, compete there with the rows being scored: W6's decode step took 33 ms
 * of attention with them fetched into L1, 28 ms into L2
 * (benchmarks/cpu_decode_attention.py, cold; benchmarks/README.md). */
static inline void prefetch_row(const void *pool, const float *lut, int32_t slot, int kv_row) {
    int64_t bytes = lut == NULL ? (int64_t)kv_row * 4 : kv_row;
    const char *row = (const char *)pool + slot * bytes;
    for (int i = 0; i < bytes; i += 64) __builtin_prefetch(row + i, 0, 1);
}

/* Slot ``slot``'s row of ``pool`` as floats: in place for a float32 pool, else
 * decoded through ``lut`` into ``buf`` (kv_row floats). */
static inline const float *pool_row(const void *pool, const float *lut, int32_t slot, int kv_row, float *buf) {
    if (lut == NULL) return (const float *)pool + (int64_t)slot * kv_row;
    const uint8_t *bytes = (const uint8_t *)pool + (int64_t)slot * kv_row;
    for (int i = 0; i < kv_row; i++) buf[i] = lut[bytes[i]];
    return buf;
}

/* Online softmax over one block of n scores: sh becomes the weights
 * exp(score - max) (0 for a -inf score, a masked key), the running max m and
 * sum l take the block in; returns the factor by which the accumulator must
 * be scaled. A block of masked keys only leaves m and l as they were. */
static inline float softmax_block(float *sh, int n, float *m, float *l) {
    /* The max and the sum as vector reductions: one scalar chain of compares
     * or adds through the block cost more than its exponentials. */
    float bmax = *m;
#pragma omp simd reduction(max : bmax)
    for (int j = 0; j < n; j++) bmax = sh[j] > bmax ? sh[j] : bmax;
    if (bmax == -INFINITY) {
        for (int j = 0; j < n; j++) sh[j] = 0.0f;
        return 1.0f;
    }
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int j = 0; j < n; j++) {
        sh[j] = exp_approx(sh[j] - bmax);
        sum += sh[j];
    }
    const float alpha = *m == -INFINITY ? 0.0f : expf(*m - bmax);
    *l = *l * alpha + sum;
    *m = bmax;
    return alpha;
}

/* For rows r < nq of one head: acc[r] += sum_j p[r][j] * V_j[off ..]. Inlined with a
 * constant HD, the row's HD / 8 vectors stay in registers over the n keys. */
static inline __attribute__((always_inline)) void pv_rows(float *acc, int span, const float *const *vrows, int off,
                                                          const float *p, int pstride, int nq, int n, const int HD) {
    for (int r = 0; r < nq; r++) {
        v8 a[HD / 8];
        float *ah = acc + r * span;
        for (int i = 0; i < HD / 8; i++) a[i] = *(const v8 *)(ah + 8 * i);
        const float *pr = p + r * pstride;
        for (int j = 0; j < n; j++) {
            const float pj = pr[j];
            const float *vh = vrows[j] + off;
            for (int i = 0; i < HD / 8; i++) a[i] += pj * *(const v8 *)(vh + 8 * i);
        }
        for (int i = 0; i < HD / 8; i++) *(v8 *)(ah + 8 * i) = a[i];
    }
}

/* The scores of C query heads (rows of q, hd apart) that share one KV head
 * against four keys (that head's part of each key's row: k[u] + off): C x 4
 * independent vector sums, so a key's row is loaded once for the C heads.
 * hd is a multiple of 8. */
static inline __attribute__((always_inline)) void score_heads(const float *q, int hd, const float *const *k, int off,
                                                              float d[][4], const int C) {
    v8 a[3][4];
    for (int r = 0; r < C; r++)
        for (int u = 0; u < 4; u++) a[r][u] = (v8){0};
    for (int i = 0; i < hd; i += 8) {
        const v8 k0 = *(const v8 *)(k[0] + off + i), k1 = *(const v8 *)(k[1] + off + i),
                 k2 = *(const v8 *)(k[2] + off + i), k3 = *(const v8 *)(k[3] + off + i);
        for (int r = 0; r < C; r++) {
            const v8 qv = *(const v8 *)(q + r * hd + i);
            a[r][0] += qv * k0;
            a[r][1] += qv * k1;
            a[r][2] += qv * k2;
            a[r][3] += qv * k3;
        }
    }
    for (int r = 0; r < C; r++) fold4(a[r][0], a[r][1], a[r][2], a[r][3], d[r]);
}

/* Every query head's scaled score against four keys (rows kp[0..3]) into
 * s[hq * BLOCK + j + u], for j + u < n. The heads of one KV head go up to
 * three at a time. */
static void score_keys(const float *q, const float *const *kp, int num_heads, int group, int hd, float scale,
                       float *s, int j, int n) {
    for (int h = 0; h < num_heads;) {
        const int g = h / group, left = (g + 1) * group - h, c = left < 3 ? left : 3, off = g * hd;
        float d[3][4];
        if (hd % 8 != 0)
            for (int r = 0; r < c; r++)
                dot4(q + (h + r) * hd, kp[0] + off, kp[1] + off, kp[2] + off, kp[3] + off, hd, d[r]);
        else if (c == 3)
            score_heads(q + h * hd, hd, kp, off, d, 3);
        else if (c == 2)
            score_heads(q + h * hd, hd, kp, off, d, 2);
        else
            score_heads(q + h * hd, hd, kp, off, d, 1);
        for (int r = 0; r < c; r++)
            for (int u = 0; u < 4 && j + u < n; u++) s[(h + r) * BLOCK + j + u] = d[r][u] * scale;
        h += c;
    }
}

/* One item: every query head of one request over keys [begin, end), BLOCK
 * keys at a time. Each key's K row (all KV heads) is read once and scored,
 * four keys at a time, against every query head (score_keys); after the
 * block's softmax, each head's accumulator row stays in registers while the
 * block's V rows are added to it. Leaves per query head the running max m,
 * the sum l and the unnormalized acc [num_heads, head_dim]; s is scratch of
 * num_heads * BLOCK floats, rows of BLOCK * kv_row floats (fp8 rows decoded). */
static void attend_span(const float *q, const void *k, const void *v, const float *lut, const int32_t *slots,
                        int begin, int end, int num_heads, int group, int head_dim, int kv_row,
                        float scale, float *s, float *m, float *l, float *acc, float *rows) {
    const float *vrows[BLOCK];
    for (int hq = 0; hq < num_heads; hq++) {
        m[hq] = -INFINITY;
        l[hq] = 0.0f;
    }
    memset(acc, 0, sizeof(float) * num_heads * head_dim);
    for (int t0 = begin; t0 < end; t0 += BLOCK) {
        int n = end - t0 < BLOCK ? end - t0 : BLOCK;
        for (int j = 0; j < n; j += 4) {
            const float *kp[4];
            for (int u = 0; u < 4; u++) {
                /* past the block's end: the last key again, its score not kept */
                int t = t0 + (j + u < n ? j + u : n - 1);
                kp[u] = pool_row(k, lut, slots[t], kv_row, rows + u * kv_row);
                /* Slots need not be contiguous: fetch the K row PREFETCH keys
                 * ahead, and this key's V row for the P @ V pass below. */
                if (t + PREFETCH < end) prefetch_row(k, lut, slots[t + PREFETCH], kv_row);
                prefetch_row(v, lut, slots[t], kv_row);
            }
            score_keys(q, kp, num_heads, group, head_dim, scale, s, j, n);
        }
        for (int hq = 0; hq < num_heads; hq++) {
            const float alpha = softmax_block(s + hq * BLOCK, n, m + hq, l + hq);
            if (alpha != 1.0f) {
                float *ah = acc + hq * head_dim;
#pragma omp simd
                for (int i = 0; i < head_dim; i++) ah[i] *= alpha;
            }
        }
        for (int j = 0; j < n; j++) vrows[j] = pool_row(v, lut, slots[t0 + j], kv_row, rows + j * kv_row);
        for (int hq = 0; hq < num_heads; hq++) {
            const int off = (hq / group) * head_dim;
            const float *p = s + hq * BLOCK;
            float *ah = acc + hq * head_dim;
            if (head_dim == 64) pv_rows(ah, 0, vrows, off, p, BLOCK, 1, n, 64);
            else if (head_dim == 128) pv_rows(ah, 0, vrows, off, p, BLOCK, 1, n, 128);
            else
                for (int j = 0; j < n; j++) {
                    const float pj = p[j], *vh = vrows[j] + off;
#pragma omp simd
                    for (int i = 0; i < head_dim; i++) ah[i] += pj * vh[i];
                }
        }
    }
}

/* What the attention entry points share, and each one's own (decode: seq_lens,
 * num_splits, partial; extend: prefix_lens .. item_req, out; grouped decode:
 * seq_lens, partial, item_req and the fields below out). */
typedef struct {
    const float *q;
    int64_t q_stride;
    const void *k, *v;
    const float *lut;
    const int32_t *req_to_token;
    int64_t rtt_stride;
    const int64_t *rows;
    int num_heads, group, head_dim, kv_row;
    float scale;
    const int64_t *seq_lens;
    int num_splits;
    float *partial;
    const int64_t *prefix_lens, *extend_lens, *q_starts, *item_req;
    float *out;
    /* grouped decode: the batch size, each request's suffix start, and the groups' table */
    int bs;
    const int64_t *suffix_starts, *prefix_rows, *group_prefix_lens, *member_starts, *members;
} Attn;

typedef void (*ItemFn)(const Attn *a, int64_t it, float *scratch);

/* fn(a, it, scratch) for every it < items, shared out over OpenMP threads as
 * they become free, each thread with scratch_floats of scratch of its own;
 * -1 if a thread's scratch could not be allocated. */
static int for_items(const Attn *a, int64_t items, size_t scratch_floats, ItemFn fn, int num_threads) {
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        float *scratch = malloc(sizeof(float) * scratch_floats);
        if (scratch == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < items; it++)
            if (scratch != NULL) fn(a, it, scratch);
        free(scratch);
    }
    return failed ? -1 : 0;
}

/* One (request, KV split) item of decode: its m, l and acc into a->partial. */
static void decode_item(const Attn *a, int64_t it, float *scratch) {
    const int num_heads = a->num_heads, head_dim = a->head_dim, part = head_dim + 2;
    int b = (int)(it / a->num_splits), split = (int)(it % a->num_splits);
    int len = (int)a->seq_lens[b];
    int chunk = (len + a->num_splits - 1) / a->num_splits;
    int begin = split * chunk, end = begin + chunk < len ? begin + chunk : len;
    float *p = a->partial + it * num_heads * part;
    if (begin >= end) {
        for (int hq = 0; hq < num_heads; hq++) p[hq * part + head_dim] = -INFINITY;
        return;
    }
    float *s = scratch, *m = s + num_heads * BLOCK, *l = m + num_heads, *acc = l + num_heads;
    attend_span(a->q + b * a->q_stride, a->k, a->v, a->lut, a->req_to_token + a->rows[b] * a->rtt_stride, begin,
                end, num_heads, a->group, head_dim, a->kv_row, a->scale, s, m, l, acc, acc + num_heads * head_dim);
    for (int hq = 0; hq < num_heads; hq++) {
        memcpy(p + hq * part, acc + hq * head_dim, sizeof(float) * head_dim);
        p[hq * part + head_dim] = m[hq];
        p[hq * part + head_dim + 1] = l[hq];
    }
}

/* out [bs, num_heads, head_dim]: each (request, query head)'s num_splits
 * partials (acc, m, l; m = -inf: an empty split) merged by their maxima. */
static void merge_splits(const float *partial, int num_splits, int bs, int num_heads, int head_dim, float *out,
                         int num_threads) {
    const int part = head_dim + 2;
#pragma omp parallel for num_threads(num_threads)
    for (int64_t bh = 0; bh < (int64_t)bs * num_heads; bh++) {
        int b = (int)(bh / num_heads), hq = (int)(bh % num_heads);
        const float *base = partial + (int64_t)b * num_splits * num_heads * part + hq * part;
        const int64_t split_stride = (int64_t)num_heads * part;
        float mmax = -INFINITY;
        for (int s = 0; s < num_splits; s++) {
            float ms = base[s * split_stride + head_dim];
            mmax = ms > mmax ? ms : mmax;
        }
        float *o = out + bh * head_dim;
        float denom = 0.0f;
        memset(o, 0, sizeof(float) * head_dim);
        for (int s = 0; s < num_splits; s++) {
            const float *ps = base + s * split_stride;
            if (ps[head_dim] == -INFINITY) continue;
            float w = expf(ps[head_dim] - mmax);
            denom += w * ps[head_dim + 1];
#pragma omp simd
            for (int i = 0; i < head_dim; i++) o[i] += w * ps[i];
        }
        float inv = denom > 0.0f ? 1.0f / denom : 0.0f;
#pragma omp simd
        for (int i = 0; i < head_dim; i++) o[i] *= inv;
    }
}

/* k and v are float32 rows when lut is NULL, else one-byte rows that lut
 * (256 floats) decodes. */
int rs_decode_attention(const float *q, int64_t q_stride, const void *k, const void *v, const float *lut,
                        const int32_t *req_to_token, int64_t rtt_stride, const int64_t *rows,
                        const int64_t *seq_lens, float *out, int bs, int num_heads,
                        int num_kv_heads, int head_dim, float scale, int num_splits,
                        int num_threads) {
    const int kv_row = num_kv_heads * head_dim; /* elements per pool slot */
    const int part = head_dim + 2;              /* acc, m, l of one query head and split */
    const int64_t items = (int64_t)bs * num_splits;
    float *partial = malloc(sizeof(float) * items * num_heads * part);
    if (partial == NULL) return -1;
    const Attn a = {.q = q, .q_stride = q_stride, .k = k, .v = v, .lut = lut, .req_to_token = req_to_token,
                    .rtt_stride = rtt_stride, .rows = rows, .num_heads = num_heads,
                    .group = num_heads / num_kv_heads, .head_dim = head_dim, .kv_row = kv_row, .scale = scale,
                    .seq_lens = seq_lens, .num_splits = num_splits, .partial = partial};
    const int failed = for_items(&a, items, num_heads * (BLOCK + 2 + head_dim) + BLOCK * kv_row, decode_item,
                                 num_threads);
    if (failed) {
        free(partial);
        return -1;
    }

    merge_splits(partial, num_splits, bs, num_heads, head_dim, out, num_threads);
    free(partial);
    return 0;
}

/* Extend (prefill) attention: the new tokens of each request attend to its
 * keys up to their own position, read from the pool (their K/V written
 * first). The work is (request, QROWS consecutive new tokens) items. An item
 * reads each K and V row once for its QROWS queries: their scores for a key
 * are QROWS independent vector sums, and P @ V keeps a head's accumulator row
 * in registers over a block of keys (head_dim 64 or 128; other sizes take a
 * plain loop). Query row i of a request sits at position prefix + i and sees
 * keys 0 .. prefix + i.
 *   q, out  [tokens, num_heads * head_dim] (q's row stride q_stride, out contiguous)
 *   rows, prefix_lens, extend_lens, q_starts: [bs] int64 (q_starts: each request's first row of q) */
#define QROWS 4 /* the four sums below are spelled out */

/* Up to QROWS query rows (qs[r], every query head; rows past nq repeat the
 * last) over keys [0, end), reading each K and V row once for all of them;
 * row r sees the keys t <= last_key + r. Leaves per (query head, row) the
 * running max m and sum l [num_heads * QROWS] and the unnormalized acc
 * [nq, num_heads * head_dim]. */
static void attend_rows(const float *const *qs, const void *k, const void *v, const float *lut,
                        const int32_t *slots, int end, int last_key, int nq, int num_heads, int group, int head_dim,
                        int kv_row, float scale, float *s, float *m, float *l, float *acc, float *rows) {
    const int hd = head_dim, span = num_heads * hd;
    const float *vrows[BLOCK];
    for (int i = 0; i < QROWS * num_heads; i++) {
        m[i] = -INFINITY;
        l[i] = 0.0f;
    }
    memset(acc, 0, sizeof(float) * nq * span);
    for (int t0 = 0; t0 < end; t0 += BLOCK) {
        int n = end - t0 < BLOCK ? end - t0 : BLOCK;
        for (int j = 0; j < n; j++) {
            const int t = t0 + j;
            const float *kp = pool_row(k, lut, slots[t], kv_row, rows);
            if (t + PREFETCH < end) prefetch_row(k, lut, slots[t + PREFETCH], kv_row);
            prefetch_row(v, lut, slots[t], kv_row);
            for (int hq = 0; hq < num_heads; hq++) {
                const float *kh = kp + (hq / group) * hd;
                /* rows past nq repeat the last one; their scores are not kept */
                const int o = hq * hd;
                float d[QROWS];
                dot4(kh, qs[0] + o, qs[1] + o, qs[2] + o, qs[3] + o, hd, d);
                for (int r = 0; r < nq; r++)
                    s[(hq * QROWS + r) * BLOCK + j] = t <= last_key + r ? d[r] * scale : -INFINITY;
            }
        }
        for (int hq = 0; hq < num_heads; hq++)
            for (int r = 0; r < nq; r++) {
                const int i = hq * QROWS + r; /* the keys past row r score -inf: weight 0 */
                const float alpha = softmax_block(s + i * BLOCK, n, m + i, l + i);
                if (alpha != 1.0f) {
                    float *ah = acc + r * span + hq * hd;
#pragma omp simd
                    for (int x = 0; x < hd; x++) ah[x] *= alpha;
                }
            }
        for (int j = 0; j < n; j++)
            vrows[j] = lut == NULL ? pool_row(v, lut, slots[t0 + j], kv_row, NULL)
                                   : pool_row(v, lut, slots[t0 + j], kv_row, rows + (1 + j) * kv_row);
        for (int hq = 0; hq < num_heads; hq++) {
            const int off = (hq / group) * hd;
            const float *p = s + hq * QROWS * BLOCK;
            float *ah = acc + hq * hd;
            if (hd == 64) pv_rows(ah, span, vrows, off, p, BLOCK, nq, n, 64);
            else if (hd == 128) pv_rows(ah, span, vrows, off, p, BLOCK, nq, n, 128);
            else
                for (int r = 0; r < nq; r++)
                    for (int j = 0; j < n; j++) {
                        const float pj = p[r * BLOCK + j], *vh = vrows[j] + off;
                        float *a = ah + r * span;
#pragma omp simd
                        for (int x = 0; x < hd; x++) a[x] += pj * vh[x];
                    }
        }
    }
}

/* One (request, QROWS new tokens) item of extend, straight into a->out. */
static void extend_item(const Attn *a, int64_t it, float *scratch) {
    const int num_heads = a->num_heads, span = num_heads * a->head_dim;
    const int b = (int)a->item_req[2 * it];
    const int64_t r0 = a->item_req[2 * it + 1];
    const int nq = a->extend_lens[b] - r0 < QROWS ? (int)(a->extend_lens[b] - r0) : QROWS;
    float *s = scratch, *m = s + QROWS * num_heads * BLOCK, *l = m + QROWS * num_heads;
    float *acc = l + QROWS * num_heads, *rowbuf = acc + QROWS * span;
    const int64_t tok = a->q_starts[b] + r0;
    const int first_pos = (int)(a->prefix_lens[b] + r0), hd = a->head_dim;
    const float *qs[QROWS];
    for (int r = 0; r < QROWS; r++) qs[r] = a->q + (tok + (r < nq ? r : nq - 1)) * a->q_stride;
    attend_rows(qs, a->k, a->v, a->lut, a->req_to_token + a->rows[b] * a->rtt_stride, first_pos + nq, first_pos, nq,
                num_heads, a->group, hd, a->kv_row, a->scale, s, m, l, acc, rowbuf);
    for (int r = 0; r < nq; r++)
        for (int hq = 0; hq < num_heads; hq++) {
            const float li = l[hq * QROWS + r], inv = li > 0.0f ? 1.0f / li : 0.0f;
            const float *ah = acc + r * span + hq * hd;
            float *o = a->out + (tok + r) * span + hq * hd;
#pragma omp simd
            for (int x = 0; x < hd; x++) o[x] = ah[x] * inv;
        }
}

int rs_extend_attention(const float *q, int64_t q_stride, const void *k, const void *v, const float *lut,
                        const int32_t *req_to_token, int64_t rtt_stride, const int64_t *rows,
                        const int64_t *prefix_lens, const int64_t *extend_lens, const int64_t *q_starts,
                        float *out, int bs, int num_heads, int num_kv_heads, int head_dim, float scale,
                        int num_threads) {
    const int kv_row = num_kv_heads * head_dim;
    int64_t items = 0;
    for (int b = 0; b < bs; b++) items += (extend_lens[b] + QROWS - 1) / QROWS;
    int64_t *item_req = malloc(sizeof(int64_t) * (items > 0 ? items : 1) * 2); /* (request, first new token) */
    if (item_req == NULL) return -1;
    for (int64_t b = 0, it = 0; b < bs; b++)
        for (int64_t r = 0; r < extend_lens[b]; r += QROWS, it++) {
            item_req[2 * it] = b;
            item_req[2 * it + 1] = r;
        }
    const Attn a = {.q = q, .q_stride = q_stride, .k = k, .v = v, .lut = lut, .req_to_token = req_to_token,
                    .rtt_stride = rtt_stride, .rows = rows, .num_heads = num_heads,
                    .group = num_heads / num_kv_heads, .head_dim = head_dim, .kv_row = kv_row, .scale = scale,
                    .prefix_lens = prefix_lens, .extend_lens = extend_lens, .q_starts = q_starts,
                    .item_req = item_req, .out = out};
    const size_t scratch = QROWS * num_heads * (BLOCK + 2) + QROWS * num_heads * head_dim + (BLOCK + 1) * kv_row;
    const int failed = for_items(&a, items, scratch, extend_item, num_threads);
    free(item_req);
    return failed;
}

/* Decode with shared prefixes read once per group (cascade attention): the
 * requests members[member_starts[g] .. member_starts[g + 1]) of group g share
 * the K/V slots req_to_token[prefix_rows[g], 0 .. prefix_lens[g]); each
 * request's own keys are positions suffix_starts[b] .. seq_lens[b] (0 ..
 * seq_lens[b] for one in no group). Items: one per request for its suffix
 * (as decode), then one per QROWS members of a group for the prefix, whose
 * K/V rows are read once for those members' queries (as extend's rows, with
 * no causal mask). Both leave partials (acc, m, l) that are merged as
 * decode's splits are. Layouts as rs_decode_attention's; group tables int64. */
static void grouped_item(const Attn *a, int64_t it, float *scratch) {
    const int num_heads = a->num_heads, hd = a->head_dim, part = hd + 2;
    const int bs = a->bs;
    float *s = scratch;
    if (it < bs) { /* request it's suffix into its partial 1; partial 0 empty unless a group fills it */
        const int b = (int)it;
        float *m = s + num_heads * BLOCK, *l = m + num_heads, *acc = l + num_heads;
        float *p = a->partial + ((int64_t)b * 2 + 1) * num_heads * part;
        attend_span(a->q + b * a->q_stride, a->k, a->v, a->lut, a->req_to_token + a->rows[b] * a->rtt_stride,
                    (int)a->suffix_starts[b], (int)a->seq_lens[b], num_heads, a->group, hd, a->kv_row, a->scale, s, m,
                    l, acc, acc + num_heads * hd);
        for (int hq = 0; hq < num_heads; hq++) {
            memcpy(p + hq * part, acc + hq * hd, sizeof(float) * hd);
            p[hq * part + hd] = m[hq];
            p[hq * part + hd + 1] = l[hq];
        }
        if (a->suffix_starts[b] == 0)
            for (int hq = 0; hq < num_heads; hq++) a->partial[(int64_t)b * 2 * num_heads * part + hq * part + hd] = -INFINITY;
        return;
    }
    /* item_req: (group, first member) of each prefix item */
    const int g = (int)a->item_req[2 * (it - bs)];
    const int64_t first = a->item_req[2 * (it - bs) + 1], stop = a->member_starts[g + 1];
    const int nq = stop - first < QROWS ? (int)(stop - first) : QROWS;
    const int span = num_heads * hd, end = (int)a->group_prefix_lens[g];
    float *m = s + QROWS * num_heads * BLOCK, *l = m + QROWS * num_heads;
    float *acc = l + QROWS * num_heads, *rowbuf = acc + QROWS * span;
    const float *qs[QROWS];
    for (int r = 0; r < QROWS; r++) qs[r] = a->q + a->members[first + (r < nq ? r : nq - 1)] * a->q_stride;
    attend_rows(qs, a->k, a->v, a->lut, a->req_to_token + a->prefix_rows[g] * a->rtt_stride, end, end, nq, num_heads,
                a->group, hd, a->kv_row, a->scale, s, m, l, acc, rowbuf);
    for (int r = 0; r < nq; r++) {
        float *p = a->partial + a->members[first + r] * 2 * num_heads * part;
        for (int hq = 0; hq < num_heads; hq++) {
            memcpy(p + hq * part, acc + r * span + hq * hd, sizeof(float) * hd);
            p[hq * part + hd] = m[hq * QROWS + r];
            p[hq * part + hd + 1] = l[hq * QROWS + r];
        }
    }
}

int rs_grouped_decode_attention(const float *q, int64_t q_stride, const void *k, const void *v, const float *lut,
                                const int32_t *req_to_token, int64_t rtt_stride, const int64_t *rows,
                                const int64_t *seq_lens, const int64_t *suffix_starts, int num_groups,
                                const int64_t *prefix_rows, const int64_t *prefix_lens, const int64_t *member_starts,
                                const int64_t *members, float *out, int bs, int num_heads, int num_kv_heads,
                                int head_dim, float scale, int num_threads) {
    const int kv_row = num_kv_heads * head_dim, part = head_dim + 2;
    int64_t prefix_items = 0;
    for (int g = 0; g < num_groups; g++) prefix_items += (member_starts[g + 1] - member_starts[g] + QROWS - 1) / QROWS;
    int64_t *item_req = malloc(sizeof(int64_t) * (prefix_items > 0 ? prefix_items : 1) * 2);
    float *partial = malloc(sizeof(float) * (bs > 0 ? bs : 1) * 2 * num_heads * part);
    if (item_req == NULL || partial == NULL) {
        free(item_req);
        free(partial);
        return -1;
    }
    for (int64_t g = 0, it = 0; g < num_groups; g++)
        for (int64_t i = member_starts[g]; i < member_starts[g + 1]; i += QROWS, it++) {
            item_req[2 * it] = g;
            item_req[2 * it + 1] = i;
        }
    const Attn a = {.q = q, .q_stride = q_stride, .k = k, .v = v, .lut = lut, .req_to_token = req_to_token,
                    .rtt_stride = rtt_stride, .rows = rows, .num_heads = num_heads,
                    .group = num_heads / num_kv_heads, .head_dim = head_dim, .kv_row = kv_row, .scale = scale,
                    .seq_lens = seq_lens, .partial = partial, .item_req = item_req, .bs = bs,
                    .suffix_starts = suffix_starts, .prefix_rows = prefix_rows, .group_prefix_lens = prefix_lens,
                    .member_starts = member_starts, .members = members};
    const size_t scratch_decode = num_heads * (BLOCK + 2 + head_dim) + BLOCK * kv_row;
    const size_t scratch_rows = QROWS * num_heads * (BLOCK + 2) + QROWS * num_heads * head_dim + (BLOCK + 1) * kv_row;
    const int failed = for_items(&a, bs + prefix_items, scratch_decode > scratch_rows ? scratch_decode : scratch_rows,
                                 grouped_item, num_threads);
    free(item_req);
    if (failed) {
        free(partial);
        return -1;
    }
    merge_splits(partial, 2, bs, num_heads, head_dim, out, num_threads);
    free(partial);
    return 0;
}
