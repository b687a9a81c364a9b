// Attention in fp32 (`tensor::attention`): causal by global positions (query i at
// q_start + i sees key j iff k_start + j <= q_start + i), grouped KV heads, the log-sum-exp
// kept for the backward and for ring attention's merges. Layouts: q, out, dq
// [B, Sq, H, D]; k, v, dk, dv [B, Sk, Hkv, D]; lse, delta [B, H, Sq]. D <= 256.
//
// This is the parity path: one warp per query row (forward, dQ) or per key (dK, dV), lanes
// splitting the head dimension; the score matrix is never stored. The forward keeps the
// online-softmax state (m, l, acc) and rescales once per 32 keys. The backward recomputes
// P = exp(s * scale - lse) and, with delta_i = dO_i . O_i, dS = P (dP - delta); dQ and
// (dK, dV) are computed by separate kernels so that every sum has one writer and a fixed
// order (no atomics): the results are the same bits run to run. All three accumulate (+=) into
// their outputs, so ring attention sums the contributions of every key block.
//
// Document masks (block-causal attention over packed documents; tensor::attention's module
// doc): key_lo [B, Sq] and q_end [B, Sk], int32 in the kernels' local indices, or both null
// for none. Query i of sequence b sees key j iff key_lo[b, i] <= j as well as the causal rule;
// equivalently iff i < q_end[b, j] (the queries whose document starts at or before key j are
// a prefix, the starts being nondecreasing). The launcher builds both from the per-query
// document starts (tensor::cuda::ops::DocMask). The forward and dQ start their key loop at
// key_lo, dK/dV ends its query loop at q_end.

#define ATT_MAXD 256
#define ATT_PER_LANE (ATT_MAXD / 32)

__device__ __forceinline__ int att_visible(int i, int Sk, int causal, int q_start, int k_start) {
    if (!causal) return Sk;
    int v = q_start + i + 1 - k_start;
    return v < 0 ? 0 : (v > Sk ? Sk : v);
}

// Grid (ceil(Sq / warps), B * H), block warps * 32, dynamic shared warps * D floats.
extern "C" __global__ void attn_fwd_f32(const float* q, const float* k, const float* v,
                                        float* out, float* lse, int B, int Sq, int Sk, int H,
                                        int Hkv, int D, int causal, int q_start, int k_start,
                                        float scale, const int* key_lo, const int* q_end) {
    extern __shared__ float qs_all[];
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int i = blockIdx.x * (blockDim.x >> 5) + warp;
    int b = blockIdx.y / H, h = blockIdx.y % H, hk = h / (H / Hkv);
    if (i >= Sq) return;
    float* qs = qs_all + warp * D;
    long long qoff = (((long long)b * Sq + i) * H + h) * D;
    for (int d = lane; d < D; d += 32) qs[d] = q[qoff + d];
    __syncwarp();
    long long kstride = (long long)Hkv * D;
    const float* kb = k + (long long)b * Sk * kstride + (long long)hk * D;
    const float* vb = v + (long long)b * Sk * kstride + (long long)hk * D;
    int nvis = att_visible(i, Sk, causal, q_start, k_start);
    int jlo = key_lo ? key_lo[(long long)b * Sq + i] : 0;
    float m = XT_NEG_INF, l = 0.0f;
    float acc[ATT_PER_LANE];
    for (int t = 0; t < ATT_PER_LANE; t++) acc[t] = 0.0f;
    for (int j0 = jlo; j0 < nvis; j0 += 32) {
        int j = j0 + lane;
        float s = XT_NEG_INF;
        if (j < nvis) {
            const float* kr = kb + j * kstride;
            float dot = 0.0f;
            for (int d = 0; d < D; d++) dot += qs[d] * kr[d];
            s = dot * scale;
        }
        float mnew = fmaxf(m, warp_max(s));
        float corr = expf(m - mnew);
        float p = j < nvis ? expf(s - mnew) : 0.0f;
        l = l * corr + warp_sum(p);
        for (int t = 0; t < ATT_PER_LANE; t++) acc[t] *= corr;
        int cnt = min(32, nvis - j0);
        for (int jj = 0; jj < cnt; jj++) {
            float pj = __shfl_sync(XT_FULL_MASK, p, jj);
            const float* vr = vb + (j0 + jj) * kstride;
            for (int t = 0; t < ATT_PER_LANE; t++) {
                int d = lane + 32 * t;
                if (d < D) acc[t] += pj * vr[d];
            }
        }
        m = mnew;
    }
    float inv = l > 0.0f ? 1.0f / l : 0.0f;
    for (int t = 0; t < ATT_PER_LANE; t++) {
        int d = lane + 32 * t;
        if (d < D) out[qoff + d] = acc[t] * inv;
    }
    if (lane == 0) lse[((long long)b * H + h) * Sq + i] = l > 0.0f ? m + logf(l) : XT_NEG_INF;
}

// delta[b, h, i] = dO . O over the head dimension; one warp per (b, i, h).
extern "C" __global__ void attn_bwd_delta(const float* out, const float* dout, float* delta,
                                          int B, int Sq, int H, int D) {
    long long row = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    int lane = threadIdx.x & 31;
    if (row >= (long long)B * Sq * H) return;
    const float* o = out + row * D;
    const float* g = dout + row * D;
    float s = 0.0f;
    for (int d = lane; d < D; d += 32) s += g[d] * o[d];
    s = warp_sum(s);
    int h = (int)(row % H);
    long long bi = row / H;
    int i = (int)(bi % Sq), b = (int)(bi / Sq);
    if (lane == 0) delta[((long long)b * H + h) * Sq + i] = s;
}

// sigma(x) = 1 / (1 + e^-x), without overflow on either side.
__device__ __forceinline__ float attn_sigmoid(float x) {
    if (x >= 0.0f) return 1.0f / (1.0f + expf(-x));
    float e = expf(x);
    return e / (1.0f + e);
}

// Merges a partial result over keys disjoint from those already in (out, lse): rows row0 ..
// row0 + rows of sequence b of out [B, len, H, D] and lse [B, H, len]; the partial part is
// [rows, H, D] with lse part_lse [H, rows] (tensor::attention::merge_partial, its CPU twin).
// With delta = lse_b - lse_a: lse = lse_a + softplus(delta), out = out * sigma(-delta) +
// part * sigma(delta); a side at -inf contributes nothing. One warp per (row, head).
extern "C" __global__ void attn_merge(float* out, float* lse, const float* part,
                                      const float* part_lse, int b, int len, int H, int D,
                                      int row0, int rows) {
    long long w = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    int lane = threadIdx.x & 31;
    if (w >= (long long)rows * H) return;
    int r = (int)(w / H), h = (int)(w % H);
    int row = row0 + r;
    long long li = ((long long)b * H + h) * len + row;
    float la = lse[li], lb = part_lse[(long long)h * rows + r];
    float wa, wb, l;
    if (lb == XT_NEG_INF) {
        wa = 1.0f; wb = 0.0f; l = la;
    } else if (la == XT_NEG_INF) {
        wa = 0.0f; wb = 1.0f; l = lb;
    } else {
        float d = lb - la;
        wa = attn_sigmoid(-d);
        wb = attn_sigmoid(d);
        l = la + (fmaxf(d, 0.0f) + log1pf(expf(-fabsf(d))));
    }
    __syncwarp(); // every lane has read lse[li] before lane 0 writes it
    float* o = out + (((long long)b * len + row) * H + h) * D;
    const float* p = part + ((long long)r * H + h) * D;
    for (int d = lane; d < D; d += 32) o[d] = __fadd_rn(__fmul_rn(o[d], wa), __fmul_rn(p[d], wb));
    if (lane == 0) lse[li] = l;
}

// dq += scale * sum_j dS_ij k_j; one warp per query row, grid (ceil(Sq / warps), B * H).
extern "C" __global__ void attn_bwd_dq(const float* q, const float* k, const float* v,
                                       const float* dout, const float* lse, const float* delta,
                                       float* dq, int B, int Sq, int Sk, int H, int Hkv, int D,
                                       int causal, int q_start, int k_start, float scale,
                                       const int* key_lo, const int* q_end) {
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int i = blockIdx.x * (blockDim.x >> 5) + warp;
    int b = blockIdx.y / H, h = blockIdx.y % H, hk = h / (H / Hkv);
    if (i >= Sq) return;
    long long qoff = (((long long)b * Sq + i) * H + h) * D;
    long long kstride = (long long)Hkv * D;
    const float* kb = k + (long long)b * Sk * kstride + (long long)hk * D;
    const float* vb = v + (long long)b * Sk * kstride + (long long)hk * D;
    float qr[ATT_PER_LANE], gr[ATT_PER_LANE], acc[ATT_PER_LANE];
    for (int t = 0; t < ATT_PER_LANE; t++) {
        int d = lane + 32 * t;
        qr[t] = d < D ? q[qoff + d] : 0.0f;
        gr[t] = d < D ? dout[qoff + d] : 0.0f;
        acc[t] = 0.0f;
    }
    long long li = ((long long)b * H + h) * Sq + i;
    float lse_i = lse[li], delta_i = delta[li];
    int nvis = att_visible(i, Sk, causal, q_start, k_start);
    int jlo = key_lo ? key_lo[(long long)b * Sq + i] : 0;
    for (int j = jlo; j < nvis; j++) {
        const float* kr = kb + j * kstride;
        const float* vr = vb + j * kstride;
        float s = 0.0f, dp = 0.0f;
        for (int t = 0; t < ATT_PER_LANE; t++) {
            int d = lane + 32 * t;
            if (d < D) {
                s += qr[t] * kr[d];
                dp += gr[t] * vr[d];
            }
        }
        s = warp_sum(s) * scale;
        dp = warp_sum(dp);
        float p = expf(s - lse_i);
        float ds = p * (dp - delta_i);
        for (int t = 0; t < ATT_PER_LANE; t++) {
            int d = lane + 32 * t;
            if (d < D) acc[t] += scale * ds * kr[d];
        }
    }
    for (int t = 0; t < ATT_PER_LANE; t++) {
        int d = lane + 32 * t;
        if (d < D) dq[qoff + d] += acc[t];
    }
}

// dv += sum_i P_ij dO_i, dk += scale * sum_i dS_ij q_i over every query head of the group;
// one warp per key, grid (ceil(Sk / warps), B * Hkv).
extern "C" __global__ void attn_bwd_dkv(const float* q, const float* k, const float* v,
                                        const float* dout, const float* lse, const float* delta,
                                        float* dk, float* dv, int B, int Sq, int Sk, int H,
                                        int Hkv, int D, int causal, int q_start, int k_start,
                                        float scale, const int* key_lo, const int* q_end) {
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int j = blockIdx.x * (blockDim.x >> 5) + warp;
    int b = blockIdx.y / Hkv, hk = blockIdx.y % Hkv;
    if (j >= Sk) return;
    int group = H / Hkv;
    long long koff = (((long long)b * Sk + j) * Hkv + hk) * D;
    float kr[ATT_PER_LANE], vr[ATT_PER_LANE], dka[ATT_PER_LANE], dva[ATT_PER_LANE];
    for (int t = 0; t < ATT_PER_LANE; t++) {
        int d = lane + 32 * t;
        kr[t] = d < D ? k[koff + d] : 0.0f;
        vr[t] = d < D ? v[koff + d] : 0.0f;
        dka[t] = 0.0f;
        dva[t] = 0.0f;
    }
    // Queries that see key j: q_start + i >= k_start + j.
    int i0 = causal ? k_start + j - q_start : 0;
    if (i0 < 0) i0 = 0;
    // ... and whose document starts at or before it: i < q_end.
    int iend = q_end ? min(Sq, q_end[(long long)b * Sk + j]) : Sq;
    for (int g = 0; g < group; g++) {
        int h = hk * group + g;
        for (int i = i0; i < iend; i++) {
            long long qoff = (((long long)b * Sq + i) * H + h) * D;
            long long li = ((long long)b * H + h) * Sq + i;
            float s = 0.0f, dp = 0.0f;
            float qv[ATT_PER_LANE], gv[ATT_PER_LANE];
            for (int t = 0; t < ATT_PER_LANE; t++) {
                int d = lane + 32 * t;
                qv[t] = d < D ? q[qoff + d] : 0.0f;
                gv[t] = d < D ? dout[qoff + d] : 0.0f;
                s += qv[t] * kr[t];
                dp += gv[t] * vr[t];
            }
            s = warp_sum(s) * scale;
            dp = warp_sum(dp);
            float p = expf(s - lse[li]);
            float ds = p * (dp - delta[li]);
            for (int t = 0; t < ATT_PER_LANE; t++) {
                dva[t] += p * gv[t];
                dka[t] += scale * ds * qv[t];
            }
        }
    }
    for (int t = 0; t < ATT_PER_LANE; t++) {
        int d = lane + 32 * t;
        if (d < D) {
            dk[koff + d] += dka[t];
            dv[koff + d] += dva[t];
        }
    }
}
