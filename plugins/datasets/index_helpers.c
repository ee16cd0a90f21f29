/* The two sequential loops of Megatron's index building, as plain C (loaded with ctypes by
 * gpt_indices.py; `make install` compiles this file into index_helpers.so). Without the .so the
 * same arrays come from numpy/Python, slower. Megatron-Core's helpers.cpp does the same work;
 * these are written from the algorithm, not from its code.
 *
 * build_blending_indices: the greedy rule. Each choice depends on the counts so far, so it
 * cannot be vectorised; the same double arithmetic and tie-breaking (first largest error wins).
 * For 2 to 8 datasets (blend_small) the counts live in registers as doubles and every choice
 * is made with compare masks instead of branches and an indexed counter: the same integers,
 * about twice as fast (RESULTS.md, "Data pipeline, fifth pass").
 *
 * build_sample_index: where each sample of seq_length + 1 tokens starts in the shuffled
 * document stream. Sample j starts at token j * seq_length of the concatenated documents; one
 * walk over the documents finds (document-index position, offset) for every j, instead of a
 * binary search per sample over a cumulative array the size of the document index. */
#include <stdint.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

/* Any number of datasets: the rule as written (also the reference blend_small is tested
 * against). Each sample waits on the previous one through counts[best]: a store, a reload, an
 * int-to-double conversion, the comparisons and the address of counts[best]. best is 64-bit:
 * as an int32 it was sign-extended between the choice and that address, one more cycle on
 * that path each sample, which made this loop ~5% slower than Megatron's (RESULTS.md). */
static void blend_any(int16_t *dataset_index, int64_t *dataset_sample_index,
                      const double *weights, int32_t num_datasets, int64_t size,
                      int64_t *counts_out) {
    /* counts on the stack: a pointer the outputs might alias would be reloaded every step */
    int64_t counts[num_datasets > 0 ? num_datasets : 1];
    for (int32_t i = 0; i < num_datasets; ++i) counts[i] = 0;
    for (int64_t s = 0; s < size; ++s) {
        double scale = s > 1 ? (double)s : 1.0;
        int64_t best = 0;
        double best_error = weights[0] * scale - (double)counts[0];
        for (int64_t i = 1; i < num_datasets; ++i) {
            double error = weights[i] * scale - (double)counts[i];
            if (error > best_error) {
                best = i;
                best_error = error;
            }
        }
        dataset_index[s] = (int16_t)best;
        dataset_sample_index[s] = counts[best];
        counts[best] += 1;
    }
    for (int32_t i = 0; i < num_datasets; ++i) counts_out[i] = counts[i];
}

#if defined(__SSE2__)
#define BLEND_SMALL_MAX 8
/* The same rule for a compile-time N (inlined per N, the loops over datasets unrolled). Why it
 * gives the same integers: a count below 2^53 is exact as a double, so w*scale - count is the
 * very double blend_any computes; e_i > best (cmpgt) and max(e_i, best) are its `if`, NaNs
 * included (both keep the earlier best), so the first largest error still wins. What changes is
 * the dependency from one sample to the next: counts stay in registers and each gets + 1.0 or
 * + 0.0 through its one-hot mask (no store/reload, no conversion, no branch to mispredict). */
static inline __attribute__((always_inline)) void
blend_small(const int N, int16_t *dataset_index, int64_t *dataset_sample_index,
            const double *weights, int64_t size, int64_t *counts_out) {
    __m128d count[BLEND_SMALL_MAX], weight[BLEND_SMALL_MAX];
    const __m128d one = _mm_set_sd(1.0), ones = _mm_castsi128_pd(_mm_set1_epi32(-1));
    for (int i = 0; i < N; ++i) {
        count[i] = _mm_setzero_pd();
        weight[i] = _mm_set_sd(weights[i]);
    }
    for (int64_t s = 0; s < size; ++s) {
        const __m128d scale = _mm_set_sd(s > 1 ? (double)s : 1.0);
        __m128d error[BLEND_SMALL_MAX], beats[BLEND_SMALL_MAX], chosen[BLEND_SMALL_MAX];
        for (int i = 0; i < N; ++i) error[i] = _mm_sub_sd(_mm_mul_sd(weight[i], scale), count[i]);
        __m128d best = error[0];
        for (int i = 1; i < N; ++i) { /* beats[i]: dataset i took the lead */
            beats[i] = _mm_cmpgt_sd(error[i], best);
            best = _mm_max_sd(error[i], best); /* error[i] > best ? error[i] : best */
        }
        /* the winner is the last dataset that took the lead, else dataset 0 */
        __m128d later = _mm_setzero_pd();
        for (int i = N - 1; i >= 1; --i) {
            chosen[i] = _mm_andnot_pd(later, beats[i]);
            later = _mm_or_pd(later, beats[i]);
        }
        chosen[0] = _mm_andnot_pd(later, ones);
        __m128d taken = _mm_setzero_pd();
        int winner = 0;
        for (int i = 0; i < N; ++i) {
            taken = _mm_or_pd(taken, _mm_and_pd(chosen[i], count[i]));
            winner |= i * (_mm_movemask_pd(chosen[i]) & 1);
            count[i] = _mm_add_sd(count[i], _mm_and_pd(chosen[i], one));
        }
        dataset_index[s] = (int16_t)winner;
        dataset_sample_index[s] = (int64_t)_mm_cvtsd_f64(taken);
    }
    for (int i = 0; i < N; ++i) counts_out[i] = (int64_t)_mm_cvtsd_f64(count[i]);
}

#define BLEND_SMALL(N)                                                                        \
    static void blend_##N(int16_t *d, int64_t *s, const double *w, int64_t size, int64_t *c) { \
        blend_small(N, d, s, w, size, c);                                                     \
    }
BLEND_SMALL(2) BLEND_SMALL(3) BLEND_SMALL(4) BLEND_SMALL(5) BLEND_SMALL(6) BLEND_SMALL(7)
BLEND_SMALL(8)
#endif

/* use_any != 0 forces the general loop (the tests compare both). */
void build_blending_indices(int16_t *dataset_index, int64_t *dataset_sample_index,
                            const double *weights, int32_t num_datasets, int64_t size,
                            int64_t *counts_out, int32_t use_any) {
#if defined(__SSE2__)
    static void (*const small[BLEND_SMALL_MAX + 1])(int16_t *, int64_t *, const double *,
                                                    int64_t, int64_t *) = {
        0, 0, blend_2, blend_3, blend_4, blend_5, blend_6, blend_7, blend_8};
    /* counts stay exact doubles below 2^53 samples: far beyond any int64 blend in memory */
    if (!use_any && num_datasets >= 2 && num_datasets <= BLEND_SMALL_MAX) {
        small[num_datasets](dataset_index, dataset_sample_index, weights, size, counts_out);
        return;
    }
#endif
    (void)use_any;
    blend_any(dataset_index, dataset_sample_index, weights, num_datasets, size, counts_out);
}

void build_sample_index(const int32_t *sizes, const int32_t *document_index,
                        int64_t num_documents, int64_t seq_length, int64_t num_samples,
                        int64_t *out) {
    int64_t position = 0, start = 0; /* start: first token of document_index[position] */
    int64_t end = num_documents ? sizes[document_index[0]] : 0;
    for (int64_t j = 0; j <= num_samples; ++j) {
        int64_t target = j * seq_length;
        while (end <= target && position + 1 < num_documents) {
            ++position;
            start = end;
            end += sizes[document_index[position]];
        }
        out[2 * j] = position;
        out[2 * j + 1] = target - start;
    }
    if (num_samples >= 0) out[0] = out[1] = 0; /* (0, 0) even when the first document is empty */
}
