// AdamW over the flat fp32 buffers in one launch (`model::optim::AdamW::update`, the same
// operations in the same order), with the weight decay per segment of the buffer; the sum of
// squares of the gradients in f64 (global-norm clipping), in two deterministic passes.

// Segment s covers [seg_end[s-1], seg_end[s]) (seg_end[-1] = 0) with decay factor
// seg_decay[s] = 1 - lr * weight_decay.
extern "C" __global__ void adamw(float* p, const float* g, float* m, float* v, int n,
                                 const int* seg_end, const float* seg_decay, int segs,
                                 float one_m_b1, float b2, float one_m_b2, float bc2_sqrt,
                                 float eps, float step_size) {
    XT_FOR(i, n) {
        int lo = 0, hi = segs - 1;
        while (lo < hi) {  // first segment whose end is beyond i
            int mid = (lo + hi) >> 1;
            if (seg_end[mid] > i) hi = mid; else lo = mid + 1;
        }
        float pi = p[i] * seg_decay[lo];
        float gi = g[i];
        float mi = m[i] + one_m_b1 * (gi - m[i]);
        float vi = v[i] * b2 + one_m_b2 * gi * gi;
        float denom = sqrtf(vi) / bc2_sqrt + eps;
        p[i] = pi - step_size * (mi / denom);
        m[i] = mi;
        v[i] = vi;
    }
}

// Pass 1: partial[b] = sum of g^2 over elements [b * chunk, (b + 1) * chunk), in f64.
extern "C" __global__ void sq_sum_partial(const float* g, int n, int chunk, double* partial) {
    __shared__ double part[32];
    long long start = (long long)blockIdx.x * chunk;
    long long end = min((long long)n, start + chunk);
    double acc = 0.0;
    for (long long i = start + threadIdx.x; i < end; i += blockDim.x) acc += (double)g[i] * (double)g[i];
    acc = warp_sum_f64(acc);
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) part[warp] = acc;
    __syncthreads();
    if (warp == 0) {
        acc = lane < (int)(blockDim.x >> 5) ? part[lane] : 0.0;
        acc = warp_sum_f64(acc);
        if (lane == 0) partial[blockIdx.x] = acc;
    }
}

// Pass 2: out[0] = sum of partial[0..count] (one block).
extern "C" __global__ void sum_f64(const double* partial, int count, double* out) {
    __shared__ double part[32];
    double acc = 0.0;
    for (int i = threadIdx.x; i < count; i += blockDim.x) acc += partial[i];
    acc = warp_sum_f64(acc);
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) part[warp] = acc;
    __syncthreads();
    if (warp == 0) {
        acc = lane < (int)(blockDim.x >> 5) ? part[lane] : 0.0;
        acc = warp_sum_f64(acc);
        if (lane == 0) out[0] = acc;
    }
}
