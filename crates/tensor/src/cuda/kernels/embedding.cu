// Embedding lookup and its backward (`tensor::embedding`), full table or a vocabulary shard
// [vocab_start, vocab_start + rows): tokens outside the shard get zero rows and no gradient.

// out[t] = table[ids[t] - vocab_start] (or zeros). A block a token (XT_FOR_ROWS).
extern "C" __global__ void embedding_forward(const u32* ids, const float* table, float* out,
                                             int tokens, int dim, int vocab_start, int rows) {
    XT_FOR_ROWS(t, tokens) {
        const long long r = (long long)ids[t] - vocab_start;
        const bool in = r >= 0 && r < rows;
        XT_FOR_COLS(c, dim) out[t * dim + c] = in ? table[r * dim + c] : 0.0f;
    }
}

// dtable[row] += dout[t] for each token of that row, in token order: the host sorts the
// tokens by row into CSR form (`uniq[u]` the row, `start[u]..start[u+1]` its tokens in
// `tokens_sorted`), so no two threads add to one element and the sum order is fixed. Each
// token is added into the running table value, as the CPU does (the same bits), not summed
// apart first.
// Grid (distinct rows, ceil(dim / blockDim.x)).
extern "C" __global__ void embedding_backward(const float* dout, const int* uniq,
                                              const int* start, const int* tokens_sorted,
                                              float* dtable, int dim) {
    int u = blockIdx.x;
    int c = blockIdx.y * blockDim.x + threadIdx.x;
    if (c >= dim) return;
    float* dst = dtable + (long long)uniq[u] * dim + c;
    float acc = *dst;
    for (int k = start[u]; k < start[u + 1]; k++) acc += dout[(long long)tokens_sorted[k] * dim + c];
    *dst = acc;
}
