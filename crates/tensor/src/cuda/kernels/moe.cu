// Mixture-of-experts pieces (`model::layers::moe`): the router's softmax and top-k with the k
// weights renormalised, and the row movements between token order and expert order. The
// assignment lists (capacity, expert parallelism's counts) are built on the host; these
// kernels move the rows.

// One warp per token: probs = softmax(logits[t]) over E experts; the k experts of highest
// score (probability + bias, bias may be null), ties to the lower index; weights = p / sum of
// the k chosen p. E <= 32 * 32.
extern "C" __global__ void router_topk(const float* logits, const float* bias, float* probs,
                                       int* experts, float* weights, int tokens, int E, int k) {
    int t = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    int lane = threadIdx.x & 31;
    if (t >= tokens) return;
    const float* z = logits + (long long)t * E;
    float* p = probs + (long long)t * E;
    float m = XT_NEG_INF;
    for (int e = lane; e < E; e += 32) m = fmaxf(m, z[e]);
    m = warp_max(m);
    float s = 0.0f;
    for (int e = lane; e < E; e += 32) s += expf(z[e] - m);
    s = warp_sum(s);
    for (int e = lane; e < E; e += 32) p[e] = expf(z[e] - m) / s;
    __syncwarp();
    // k rounds of an arg-max over the experts not yet taken (lane-strided, then the warp).
    u32 taken[32];
    for (int w = 0; w < 32; w++) taken[w] = 0;
    float sum = 0.0f;
    for (int j = 0; j < k; j++) {
        float best = XT_NEG_INF;
        int best_e = E;
        for (int e = lane; e < E; e += 32) {
            if (taken[e >> 5] & (1u << (e & 31))) continue;
            float sc = p[e] + (bias ? bias[e] : 0.0f);
            if (sc > best || (sc == best && e < best_e)) { best = sc; best_e = e; }
        }
        for (int o = 16; o > 0; o >>= 1) {
            float ob = __shfl_xor_sync(XT_FULL_MASK, best, o);
            int oe = __shfl_xor_sync(XT_FULL_MASK, best_e, o);
            if (ob > best || (ob == best && oe < best_e)) { best = ob; best_e = oe; }
        }
        if (best_e >= E) {  // every score left is NaN: the lowest expert not taken yet
            best_e = 0;
            while (taken[best_e >> 5] & (1u << (best_e & 31))) best_e++;
        }
        taken[best_e >> 5] |= 1u << (best_e & 31);
        if (lane == 0) experts[t * k + j] = best_e;
        sum += p[best_e];
    }
    if (lane == 0)
        for (int j = 0; j < k; j++) weights[t * k + j] = p[experts[t * k + j]] / sum;
}

// dst[r] = src[idx[r]] * (scale ? scale[r] : 1), rows of `dim`; a block a row (XT_FOR_ROWS).
extern "C" __global__ void gather_rows(const float* src, const int* idx, const float* scale,
                                       float* dst, int rows, int dim) {
    XT_FOR_ROWS(r, rows) {
        const float* s = src + (long long)idx[r] * dim;
        XT_FOR_COLS(c, dim) {
            const float v = s[c];
            dst[r * dim + c] = scale ? v * scale[r] : v;
        }
    }
}

// y[idx[r]] += (w ? w[r] : 1) * rows[r], rows of `dim`; a block a row (XT_FOR_ROWS). The
// indices of one call are distinct (one expert's tokens), so no two threads add into the same
// element; calls in expert order give the host's summation order.
extern "C" __global__ void scatter_add_rows(const float* rows, const int* idx, const float* w,
                                            float* y, int n_rows, int dim) {
    XT_FOR_ROWS(r, n_rows) {
        float* d = y + (long long)idx[r] * dim;
        XT_FOR_COLS(c, dim) {
            const float v = rows[r * dim + c];
            d[c] = w ? d[c] + w[r] * v : d[c] + v;
        }
    }
}

// out[r] = dot(a[ia[r]], b[ib ? ib[r] : r]) over `dim`; one warp per row.
extern "C" __global__ void row_dots(const float* a, const int* ia, const float* b,
                                    const int* ib, float* out, int rows, int dim) {
    int r = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    int lane = threadIdx.x & 31;
    if (r >= rows) return;
    const float* x = a + (long long)ia[r] * dim;
    const float* y = b + (long long)(ib ? ib[r] : r) * dim;
    float s = 0.0f;
    for (int c = lane; c < dim; c += 32) s += x[c] * y[c];
    s = warp_sum(s);
    if (lane == 0) out[r] = s;
}
