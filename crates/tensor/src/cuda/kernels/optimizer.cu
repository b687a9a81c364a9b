// AdamW over the flat fp32 buffers in one launch (`model::optim::AdamW::update`, the same
// operations in the same order), with the weight decay per segment of the buffer; AdamW of
// 16-bit training in one pass (the gradients' bits widened and scaled, the fp32 master and
// moments updated, the master rounded into the 16-bit weights); the sum of squares of the
// gradients in f64 (global-norm clipping), in two deterministic passes.

// One element: p, m, v updated in place from the gradient g with decay factor
// decay = 1 - lr * weight_decay (AdamW::update's operations, in its order).
__device__ __forceinline__ void adamw_element(float& p, float g, float& m, float& v, float decay,
                                              float one_m_b1, float b2, float one_m_b2,
                                              float bc2_sqrt, float eps, float step_size) {
    // Every operation rounded on its own, in the CPU's order (model::optim::AdamStep::apply):
    // with --fmad=true the compiler would contract products into the adds as it sees fit,
    // differently from kernel to kernel (adamw against adamw_bits), and unlike the CPU.
    float pi = __fmul_rn(p, decay);
    float mi = __fadd_rn(m, __fmul_rn(one_m_b1, __fsub_rn(g, m)));
    float vi = __fadd_rn(__fmul_rn(v, b2), __fmul_rn(__fmul_rn(one_m_b2, g), g));
    float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(vi), bc2_sqrt), eps);
    p = __fsub_rn(pi, __fmul_rn(step_size, __fdiv_rn(mi, denom)));
    m = mi;
    v = vi;
}

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
        float pi = p[i], mi = m[i], vi = v[i];
        adamw_element(pi, g[i], mi, vi, seg_decay[lo], one_m_b1, b2, one_m_b2, bc2_sqrt, eps,
                      step_size);
        p[i] = pi;
        m[i] = mi;
        v[i] = vi;
    }
}

// 16-bit training's step in one pass over the buffers (the engine's rule,
// parallel::precision): gradient g (bf16 bits, or fp16 with f16 != 0) widened and scaled by
// `factor` (clipping and loss unscaling; one rounded product, never fused into what follows,
// as the separate scale kernel computes it), the fp32 master p and moments m, v updated as
// `adamw` updates them (one decay factor), and p rounded to nearest even into the weights w.
// The bits are those of widen (cast_bf16_f32) + scale + adamw + round (cast_f32_bf16), with
// one read of g, p, m, v and one write of p, m, v, w: 28 bytes an element instead of 48, in
// one launch instead of four.
extern "C" __global__ void adamw_bits(float* p, const u16* g, float* m, float* v, u16* w, int n,
                                      int f16, float factor, float decay, float one_m_b1,
                                      float b2, float one_m_b2, float bc2_sqrt, float eps,
                                      float step_size) {
    XT_FOR(i, n) {
        const float gi = __fmul_rn(f16 ? f16_to_f32(g[i]) : bf16_to_f32(g[i]), factor);
        float pi = p[i], mi = m[i], vi = v[i];
        adamw_element(pi, gi, mi, vi, decay, one_m_b1, b2, one_m_b2, bc2_sqrt, eps, step_size);
        p[i] = pi;
        m[i] = mi;
        v[i] = vi;
        w[i] = f16 ? f32_to_f16(pi) : f32_to_bf16(pi);
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
