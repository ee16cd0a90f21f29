/* The two sequential loops of Megatron's index building, as plain C (loaded with ctypes by
 * gpt_indices.py; `make install` compiles this file into index_helpers.so). Without the .so the
 * same arrays come from numpy/Python, slower. Megatron-Core's helpers.cpp does the same work;
 * these are written from the algorithm, not from its code.
 *
 * build_blending_indices: the greedy rule. Each choice depends on the counts so far, so it
 * cannot be vectorised; the same double arithmetic and tie-breaking (first largest error wins).
 *
 * build_sample_index: where each sample of seq_length + 1 tokens starts in the shuffled
 * document stream. Sample j starts at token j * seq_length of the concatenated documents; one
 * walk over the documents finds (document-index position, offset) for every j, instead of a
 * binary search per sample over a cumulative array the size of the document index. */
#include <stdint.h>

void build_blending_indices(int16_t *dataset_index, int64_t *dataset_sample_index,
                            const double *weights, int32_t num_datasets, int64_t size,
                            int64_t *counts_out) {
    /* counts on the stack: a pointer the outputs might alias would be reloaded every step */
    int64_t counts[num_datasets > 0 ? num_datasets : 1];
    for (int32_t i = 0; i < num_datasets; ++i) counts[i] = 0;
    for (int64_t s = 0; s < size; ++s) {
        double scale = s > 1 ? (double)s : 1.0;
        int32_t best = 0;
        double best_error = weights[0] * scale - (double)counts[0];
        for (int32_t i = 1; i < num_datasets; ++i) {
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
