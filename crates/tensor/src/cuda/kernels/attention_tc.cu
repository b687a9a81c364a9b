// Tensor-core attention (FlashAttention-2 style) for bf16 training: the same contract as the
// fp32 kernels of the "attention" module (layouts q, out, dq [B, Sq, H, D]; k, v, dk, dv
// [B, Sk, Hkv, D]; lse, delta [B, H, Sq]; causal by global positions: query i at q_start + i
// sees key j iff k_start + j <= q_start + i; grouped KV heads h -> h / (H / Hkv); lse = -inf
// and out = 0 for a row that sees no key; the backward accumulates (+=) into dq, dk, dv), but
// every product runs on the tensor cores with bf16 operands and fp32 accumulation:
// mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 (sm_80+). Q, K, V, dO come in as bf16
// (their fp32 values rounded to nearest even once, by the caller: the bits these kernels would
// get by rounding fp32 themselves, read at half the bytes), each row 16-byte aligned (D being a
// multiple of 16 and the buffers whole allocations); P and dS are rounded to bf16 before their
// products; scores, the online softmax (max, sum, rescaling),
// P = exp(s * scale - lse), dS = P (dP - delta) and every accumulator stay fp32. The backward
// is deterministic (no atomics): dQ and (dK, dV) come from separate kernels, each output
// element has one writer and sums in a fixed order; delta = rowsum(dO * O) is the fp32
// attn_bwd_delta of the "attention" module.
//
// D (head_dim) is a multiple of 16, 16..128 (checked by the launcher); 4 warps per CTA.
//
// Fragments of mma.m16n8k16 (PTX ISA, "Matrix Fragments for mma.m16n8k16 with floating point
// type"), with g = lane >> 2 (groupID) and t = lane & 3 (threadID_in_group); a 32-bit register
// holds two bf16, the lower-indexed element in the lower 16 bits:
//   A (16 x 16, row-major, M x K), 4 registers:
//     a[0] = (row g,     cols 2t, 2t+1)      a[1] = (row g + 8, cols 2t, 2t+1)
//     a[2] = (row g,     cols 2t+8, 2t+9)    a[3] = (row g + 8, cols 2t+8, 2t+9)
//   B (16 x 8, K x N, "col"), 2 registers:
//     b[0] = (rows k = 2t, 2t+1, col n = g)  b[1] = (rows k = 2t+8, 2t+9, col n = g)
//   C/D (16 x 8 fp32), 4 registers:
//     c[0], c[1] = (row g, cols 2t, 2t+1)    c[2], c[3] = (row g + 8, cols 2t, 2t+1)
// So the C fragments of two adjacent n-tiles (cols 16kk..16kk+7 and 16kk+8..16kk+15) are the A
// fragment of k-step kk: a = {pack(c0[0], c0[1]), pack(c0[2], c0[3]), pack(c1[0], c1[1]),
// pack(c1[2], c1[3])} (tc_c_to_a): the score tile feeds the next product without shared memory.
//
// Shared-memory tiles are bf16, row-major with a row stride of D + 8 elements (the 16-byte pad
// spreads the rows of a fragment load over the banks). A B operand whose K index runs along a
// tile row (K for Q K^T, Q and dO for the dK/dV scores) is one 32-bit load (tc_ld2); one whose
// K index runs down the tile's rows (V for P V, K for dS K, dO and Q for P^T dO and dS^T Q) is
// two 16-bit loads of rows k and k + 1 packed together (tc_ld2col).

#define TC_WARPS 4
#define TC_BM 64   // query rows per CTA of the forward and dQ kernels (16 per warp)
#define TC_BN 64   // keys per CTA (per key tile of the forward and dQ; per dK/dV CTA)
#define TC_QC 32   // query rows per step of the dK/dV kernel
#define TC_KC 32   // keys per step of a dQ warp (half a key tile)
#define TC_PAD 8   // bf16 of padding per shared-memory row
// Each kernel is a template on MAXK, the most k-steps of 16 its register tiles hold (D <= 16 MAXK;
// D / 8 <= 2 MAXK n-tiles), instantiated for MAXK = 4 (D <= 64) and 8 (D <= 128): the tiles of
// a head of 64 then take half the registers (Nsight Compute on an H200: 213 registers a thread
// for the head-128 tiles, so 2 CTAs an SM, at head 64).

__device__ __forceinline__ u32 tc_pack(float lo, float hi) {
    return (u32)f32_to_bf16(lo) | ((u32)f32_to_bf16(hi) << 16);
}

// d += a * b (16 x 8 x 16, bf16 operands, fp32 accumulate).
__device__ __forceinline__ void tc_mma(float* d, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0,
                                       u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Elements idx, idx + 1 of a bf16 tile (idx even: 4-byte aligned).
__device__ __forceinline__ u32 tc_ld2(const u16* s, int idx) {
    return *(const u32*)(s + idx);
}

// Elements idx and idx + ld (the same column of two consecutive rows).
__device__ __forceinline__ u32 tc_ld2col(const u16* s, int idx, int ld) {
    return (u32)s[idx] | ((u32)s[idx + ld] << 16);
}

// Rows row0 .. row0 + rows - 1 of one head of a [B, S, Hx, D] bf16 tensor (`src` points at
// (b, 0, head, 0), `rstride` = Hx * D) into a bf16 tile with row stride ld, 16 bytes (8
// elements) a copy: D is a multiple of 16 and ld of 8, so every row of both starts 16-byte
// aligned. Rows at or past S are zeros (so that a masked P or dS of 0 never meets a NaN in the
// product). The whole CTA calls it (the caller synchronises).
__device__ __forceinline__ void tc_load_tile(u16* tile, const u16* src, long long rstride,
                                             int row0, int rows, int S, int D, int ld) {
    const int per_row = D >> 3;
    for (int e = threadIdx.x; e < rows * per_row; e += blockDim.x) {
        const int r = e / per_row, c = (e - r * per_row) * 8;
        const int row = row0 + r;
        uint4 x = make_uint4(0u, 0u, 0u, 0u);
        if (row < S) x = *(const uint4*)(src + (long long)row * rstride + c);
        *(uint4*)(tile + r * ld + c) = x;
    }
}

// The A fragments (per k-step of 16 columns, D / 16 of them) of rows r and r + 8 of one head
// of a [B, S, Hx, D] bf16 tensor, straight from global memory (two bf16 a 32-bit load); rows
// at or past S are zeros. `src` points at (b, 0, head, 0).
template <int MAXK>
__device__ __forceinline__ void tc_load_a(u32 (*f)[4], const u16* src, long long rstride,
                                          int r, int S, int D, int t) {
    const u16* pa = src + (long long)r * rstride;
    const u16* pb = src + (long long)(r + 8) * rstride;
    bool oka = r < S, okb = r + 8 < S;
#pragma unroll
    for (int kk = 0; kk < MAXK; kk++) {
        if (kk < (D >> 4)) {
            int c = kk * 16 + 2 * t;
            f[kk][0] = oka ? *(const u32*)(pa + c) : 0u;
            f[kk][1] = okb ? *(const u32*)(pb + c) : 0u;
            f[kk][2] = oka ? *(const u32*)(pa + c + 8) : 0u;
            f[kk][3] = okb ? *(const u32*)(pb + c + 8) : 0u;
        }
    }
}

__device__ __forceinline__ bool tc_visible(int i, int j, int Sq, int Sk, int causal, int q_start,
                                           int k_start) {
    return i < Sq && j < Sk && (!causal || k_start + j <= q_start + i);
}

// Keys visible to some query of rows [0, i_end): all of them, or up to the last row's.
__device__ __forceinline__ int tc_keys_seen(int i_end, int Sk, int causal, int q_start,
                                            int k_start) {
    if (!causal) return Sk;
    int v = q_start + i_end - k_start; // keys j with k_start + j <= q_start + i_end - 1
    return v < 0 ? 0 : (v > Sk ? Sk : v);
}

// Forward. Grid (ceil(Sq / 64), B * H), block 128; warp w owns query rows 64 x + 16 w ..
// + 15 (its Q fragments stay in registers), the CTA walks the key tiles of 64 that its rows
// see. Dynamic shared memory: K and V tiles, 2 * 64 * (D + 8) bf16 = 256 (D + 8) bytes
// (34816 for D = 128, 18432 for D = 64).
template <int MAXK>
__device__ __forceinline__ void attn_fwd_tc_body(const u16* q, const u16* k, const u16* v,
                                                 float* out, float* lse, int B, int Sq, int Sk,
                                                 int H, int Hkv, int D, int causal, int q_start,
                                                 int k_start, float scale) {
    extern __shared__ __align__(16) u16 tc_smem[];
    const int ld = D + TC_PAD;
    u16* ks = tc_smem;
    u16* vs = tc_smem + TC_BN * ld;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int b = blockIdx.y / H, h = blockIdx.y % H, hk = h / (H / Hkv);
    const int q0 = blockIdx.x * TC_BM;
    const int nk = D >> 4, nd = D >> 3;
    const long long qstride = (long long)H * D, kstride = (long long)Hkv * D;
    const u16* qb = q + (long long)b * Sq * qstride + (long long)h * D;
    const u16* kb = k + (long long)b * Sk * kstride + (long long)hk * D;
    const u16* vb = v + (long long)b * Sk * kstride + (long long)hk * D;
    const int r0 = q0 + warp * 16 + g; // this thread's rows: r0 (half 0) and r0 + 8 (half 1)

    u32 qf[MAXK][4];
    tc_load_a<MAXK>(qf, qb, qstride, r0, Sq, D, t);
    float o[(2 * MAXK)][4];
#pragma unroll
    for (int n = 0; n < (2 * MAXK); n++) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
    float m[2] = {XT_NEG_INF, XT_NEG_INF}, l[2] = {0.0f, 0.0f};

    const int nvis = tc_keys_seen(min(q0 + TC_BM, Sq), Sk, causal, q_start, k_start);
    for (int j0 = 0; j0 < nvis; j0 += TC_BN) {
        __syncthreads(); // every warp is done with the previous tiles
        tc_load_tile(ks, kb, kstride, j0, TC_BN, Sk, D, ld);
        tc_load_tile(vs, vb, kstride, j0, TC_BN, Sk, D, ld);
        __syncthreads();

        // S = Q K^T (16 rows x 64 keys per warp): B(k = d, n = j) = K[j][d].
        float s[8][4];
#pragma unroll
        for (int n = 0; n < 8; n++) {
            s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
            const u16* kr = ks + (n * 8 + g) * ld + 2 * t;
#pragma unroll
            for (int kk = 0; kk < MAXK; kk++) {
                if (kk < nk) {
                    tc_mma(s[n], qf[kk][0], qf[kk][1], qf[kk][2], qf[kk][3],
                           tc_ld2(kr, kk * 16), tc_ld2(kr, kk * 16 + 8));
                }
            }
        }
        // Mask, scale, online softmax; row r0 + 8 hf holds s[n][2 hf], s[n][2 hf + 1], its 64
        // values spread over the 4 threads of the quad (t = 0..3).
#pragma unroll
        for (int hf = 0; hf < 2; hf++) {
            const int i = r0 + 8 * hf;
            float mx = XT_NEG_INF;
#pragma unroll
            for (int n = 0; n < 8; n++) {
#pragma unroll
                for (int e = 0; e < 2; e++) {
                    int j = j0 + n * 8 + 2 * t + e;
                    float x = tc_visible(i, j, Sq, Sk, causal, q_start, k_start)
                                  ? s[n][2 * hf + e] * scale
                                  : XT_NEG_INF;
                    s[n][2 * hf + e] = x;
                    mx = fmaxf(mx, x);
                }
            }
            mx = fmaxf(mx, __shfl_xor_sync(XT_FULL_MASK, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(XT_FULL_MASK, mx, 2));
            const float mnew = fmaxf(m[hf], mx);
            // Subtract 0 while no key is seen (mnew = -inf): p = exp(-inf) = 0, corr = 0
            // (l and o are still 0), never -inf - -inf.
            const float mu = mnew == XT_NEG_INF ? 0.0f : mnew;
            const float corr = expf(m[hf] - mu);
            float sum = 0.0f;
#pragma unroll
            for (int n = 0; n < 8; n++) {
#pragma unroll
                for (int e = 0; e < 2; e++) {
                    float p = expf(s[n][2 * hf + e] - mu);
                    s[n][2 * hf + e] = p;
                    sum += p;
                }
            }
            l[hf] = l[hf] * corr + sum; // this thread's part of the row sum (quad-summed last)
            m[hf] = mnew;
#pragma unroll
            for (int n = 0; n < (2 * MAXK); n++) {
                o[n][2 * hf] *= corr;
                o[n][2 * hf + 1] *= corr;
            }
        }
        // O += P V: A = P (k-step kk = keys 16 kk .. 16 kk + 15: n-tiles 2 kk, 2 kk + 1),
        // B(k = j, n = d) = V[j][d].
#pragma unroll
        for (int kk = 0; kk < 4; kk++) {
            const u32 a0 = tc_pack(s[2 * kk][0], s[2 * kk][1]);
            const u32 a1 = tc_pack(s[2 * kk][2], s[2 * kk][3]);
            const u32 a2 = tc_pack(s[2 * kk + 1][0], s[2 * kk + 1][1]);
            const u32 a3 = tc_pack(s[2 * kk + 1][2], s[2 * kk + 1][3]);
            const u16* vr = vs + (kk * 16 + 2 * t) * ld + g;
#pragma unroll
            for (int n = 0; n < (2 * MAXK); n++) {
                if (n < nd) {
                    tc_mma(o[n], a0, a1, a2, a3, tc_ld2col(vr, n * 8, ld),
                           tc_ld2col(vr, 8 * ld + n * 8, ld));
                }
            }
        }
    }

    float* ob = out + (long long)b * Sq * qstride + (long long)h * D;
#pragma unroll
    for (int hf = 0; hf < 2; hf++) {
        float sum = l[hf];
        sum += __shfl_xor_sync(XT_FULL_MASK, sum, 1);
        sum += __shfl_xor_sync(XT_FULL_MASK, sum, 2);
        const int i = r0 + 8 * hf;
        if (i < Sq) {
            const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
            float* orow = ob + (long long)i * qstride + 2 * t;
#pragma unroll
            for (int n = 0; n < (2 * MAXK); n++) {
                if (n < nd) {
                    orow[n * 8] = o[n][2 * hf] * inv;
                    orow[n * 8 + 1] = o[n][2 * hf + 1] * inv;
                }
            }
            if (t == 0)
                lse[((long long)b * H + h) * Sq + i] =
                    sum > 0.0f ? m[hf] + logf(sum) : XT_NEG_INF;
        }
    }
}

// dq += scale * dS K, dS = P (dP - delta), P = exp(s * scale - lse), dP = dO V^T. Grid
// (ceil(Sq / 64), B * H), block 128; warp w owns query rows 64 x + 16 w .. + 15 (Q and dO
// fragments in registers) and walks each key tile of 64 in two steps of 32 keys. Dynamic
// shared memory: K and V tiles, 256 (D + 8) bytes (34816 for D = 128).
template <int MAXK>
__device__ __forceinline__ void attn_bwd_dq_tc_body(const u16* q, const u16* k,
                                                    const u16* v, const u16* dout,
                                                    const float* lse, const float* delta,
                                                    float* dq, int B, int Sq, int Sk, int H,
                                                    int Hkv, int D, int causal, int q_start,
                                                    int k_start, float scale) {
    extern __shared__ __align__(16) u16 tc_smem[];
    const int ld = D + TC_PAD;
    u16* ks = tc_smem;
    u16* vs = tc_smem + TC_BN * ld;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int b = blockIdx.y / H, h = blockIdx.y % H, hk = h / (H / Hkv);
    const int q0 = blockIdx.x * TC_BM;
    const int nk = D >> 4, nd = D >> 3;
    const long long qstride = (long long)H * D, kstride = (long long)Hkv * D;
    const long long qbase = (long long)b * Sq * qstride + (long long)h * D;
    const u16* kb = k + (long long)b * Sk * kstride + (long long)hk * D;
    const u16* vb = v + (long long)b * Sk * kstride + (long long)hk * D;
    const int r0 = q0 + warp * 16 + g;

    u32 qf[MAXK][4], gf[MAXK][4];
    tc_load_a<MAXK>(qf, q + qbase, qstride, r0, Sq, D, t);
    tc_load_a<MAXK>(gf, dout + qbase, qstride, r0, Sq, D, t);
    float lse_r[2], del_r[2];
#pragma unroll
    for (int hf = 0; hf < 2; hf++) {
        const int i = r0 + 8 * hf;
        const long long li = ((long long)b * H + h) * Sq + i;
        lse_r[hf] = i < Sq ? lse[li] : 0.0f;
        del_r[hf] = i < Sq ? delta[li] : 0.0f;
    }
    float acc[(2 * MAXK)][4];
#pragma unroll
    for (int n = 0; n < (2 * MAXK); n++) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;

    const int nvis = tc_keys_seen(min(q0 + TC_BM, Sq), Sk, causal, q_start, k_start);
    for (int j0 = 0; j0 < nvis; j0 += TC_BN) {
        __syncthreads();
        tc_load_tile(ks, kb, kstride, j0, TC_BN, Sk, D, ld);
        tc_load_tile(vs, vb, kstride, j0, TC_BN, Sk, D, ld);
        __syncthreads();
#pragma unroll 1
        for (int c0 = 0; c0 < TC_BN; c0 += TC_KC) {
            // S = Q K^T and dP = dO V^T on keys c0 .. c0 + 31 of the tile.
            float s[4][4], dp[4][4];
#pragma unroll
            for (int n = 0; n < 4; n++) {
                s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
                dp[n][0] = dp[n][1] = dp[n][2] = dp[n][3] = 0.0f;
                const u16* kr = ks + (c0 + n * 8 + g) * ld + 2 * t;
                const u16* vr = vs + (c0 + n * 8 + g) * ld + 2 * t;
#pragma unroll
                for (int kk = 0; kk < MAXK; kk++) {
                    if (kk < nk) {
                        tc_mma(s[n], qf[kk][0], qf[kk][1], qf[kk][2], qf[kk][3],
                               tc_ld2(kr, kk * 16), tc_ld2(kr, kk * 16 + 8));
                        tc_mma(dp[n], gf[kk][0], gf[kk][1], gf[kk][2], gf[kk][3],
                               tc_ld2(vr, kk * 16), tc_ld2(vr, kk * 16 + 8));
                    }
                }
            }
            // dS = P (dP - delta), 0 where masked (kept in s).
#pragma unroll
            for (int n = 0; n < 4; n++) {
#pragma unroll
                for (int x = 0; x < 4; x++) {
                    const int hf = x >> 1;
                    const int i = r0 + 8 * hf, j = j0 + c0 + n * 8 + 2 * t + (x & 1);
                    float ds = 0.0f;
                    if (tc_visible(i, j, Sq, Sk, causal, q_start, k_start)) {
                        const float p = expf(s[n][x] * scale - lse_r[hf]);
                        ds = p * (dp[n][x] - del_r[hf]);
                    }
                    s[n][x] = ds;
                }
            }
            // dQ += dS K: A = dS (k-step kk = keys c0 + 16 kk ..), B(k = j, n = d) = K[j][d].
#pragma unroll
            for (int kk = 0; kk < 2; kk++) {
                const u32 a0 = tc_pack(s[2 * kk][0], s[2 * kk][1]);
                const u32 a1 = tc_pack(s[2 * kk][2], s[2 * kk][3]);
                const u32 a2 = tc_pack(s[2 * kk + 1][0], s[2 * kk + 1][1]);
                const u32 a3 = tc_pack(s[2 * kk + 1][2], s[2 * kk + 1][3]);
                const u16* kr = ks + (c0 + kk * 16 + 2 * t) * ld + g;
#pragma unroll
                for (int n = 0; n < (2 * MAXK); n++) {
                    if (n < nd) {
                        tc_mma(acc[n], a0, a1, a2, a3, tc_ld2col(kr, n * 8, ld),
                               tc_ld2col(kr, 8 * ld + n * 8, ld));
                    }
                }
            }
        }
    }

#pragma unroll
    for (int hf = 0; hf < 2; hf++) {
        const int i = r0 + 8 * hf;
        if (i < Sq) {
            float* row = dq + qbase + (long long)i * qstride + 2 * t;
#pragma unroll
            for (int n = 0; n < (2 * MAXK); n++) {
                if (n < nd) {
                    row[n * 8] += scale * acc[n][2 * hf];
                    row[n * 8 + 1] += scale * acc[n][2 * hf + 1];
                }
            }
        }
    }
}

// dv += P^T dO, dk += scale * dS^T Q over every query head of the group. Grid
// (ceil(Sk / 64), B * Hkv), block 128; warp w owns keys 64 x + 16 w .. + 15 and computes the
// transposed scores S^T = K Q^T directly (keys as the M dimension), so P^T and dS^T are A
// operands straight from the accumulators. The CTA walks the query rows that see its keys in
// steps of 32. Dynamic shared memory: K and V tiles (64 rows), Q and dO tiles (32 rows), all
// bf16 with row stride D + 8, then lse and delta of the 32 rows (fp32):
// (2 * 64 + 2 * 32) * (D + 8) * 2 + 2 * 32 * 4 = 384 (D + 8) + 256 bytes (52480 for D = 128,
// 27904 for D = 64).
template <int MAXK>
__device__ __forceinline__ void attn_bwd_dkv_tc_body(const u16* q, const u16* k,
                                                     const u16* v, const u16* dout,
                                                     const float* lse, const float* delta,
                                                     float* dk, float* dv, int B, int Sq,
                                                     int Sk, int H, int Hkv, int D, int causal,
                                                     int q_start, int k_start, float scale) {
    extern __shared__ __align__(16) u16 tc_smem[];
    const int ld = D + TC_PAD;
    u16* ks = tc_smem;
    u16* vs = ks + TC_BN * ld;
    u16* qs = vs + TC_BN * ld;
    u16* gs = qs + TC_QC * ld;
    float* lse_s = (float*)(gs + TC_QC * ld); // (2 * 64 + 2 * 32) * ld * 2 bytes: 16-aligned
    float* del_s = lse_s + TC_QC;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int b = blockIdx.y / Hkv, hk = blockIdx.y % Hkv, group = H / Hkv;
    const int j0 = blockIdx.x * TC_BN;
    const int nk = D >> 4, nd = D >> 3;
    const long long qstride = (long long)H * D, kstride = (long long)Hkv * D;
    const long long kbase = (long long)b * Sk * kstride + (long long)hk * D;
    const int jw = warp * 16; // this warp's keys in the tile: jw + g (half 0), jw + g + 8

    tc_load_tile(ks, k + kbase, kstride, j0, TC_BN, Sk, D, ld);
    tc_load_tile(vs, v + kbase, kstride, j0, TC_BN, Sk, D, ld);
    float dka[(2 * MAXK)][4], dva[(2 * MAXK)][4];
#pragma unroll
    for (int n = 0; n < (2 * MAXK); n++) {
        dka[n][0] = dka[n][1] = dka[n][2] = dka[n][3] = 0.0f;
        dva[n][0] = dva[n][1] = dva[n][2] = dva[n][3] = 0.0f;
    }
    // The first query that sees key j0 (the tile's first): q_start + i >= k_start + j0.
    int i0 = causal ? k_start + j0 - q_start : 0;
    i0 = i0 < 0 ? 0 : (i0 / TC_QC) * TC_QC;

    for (int gi = 0; gi < group; gi++) {
        const int h = hk * group + gi;
        const long long qbase = (long long)b * Sq * qstride + (long long)h * D;
        const long long lbase = ((long long)b * H + h) * Sq;
        for (int c0 = i0; c0 < Sq; c0 += TC_QC) {
            __syncthreads(); // every warp is done with the previous Q, dO, lse, delta
            tc_load_tile(qs, q + qbase, qstride, c0, TC_QC, Sq, D, ld);
            tc_load_tile(gs, dout + qbase, qstride, c0, TC_QC, Sq, D, ld);
            for (int r = threadIdx.x; r < TC_QC; r += blockDim.x) {
                const bool in = c0 + r < Sq;
                lse_s[r] = in ? lse[lbase + c0 + r] : 0.0f;
                del_s[r] = in ? delta[lbase + c0 + r] : 0.0f;
            }
            __syncthreads(); // (the first pass also covers the K and V tiles)

            // S^T = K Q^T and dP^T = V dO^T (16 keys x 32 queries per warp):
            // A = the warp's K (V) rows, B(k = d, n = i) = Q[i][d] (dO[i][d]).
            float s[4][4], dp[4][4];
#pragma unroll
            for (int n = 0; n < 4; n++) {
                s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
                dp[n][0] = dp[n][1] = dp[n][2] = dp[n][3] = 0.0f;
            }
#pragma unroll
            for (int kk = 0; kk < MAXK; kk++) {
                if (kk < nk) {
                    const u16* ka = ks + (jw + g) * ld + kk * 16 + 2 * t;
                    const u16* va = vs + (jw + g) * ld + kk * 16 + 2 * t;
                    const u32 k0 = tc_ld2(ka, 0), k1 = tc_ld2(ka, 8 * ld), k2 = tc_ld2(ka, 8),
                              k3 = tc_ld2(ka, 8 * ld + 8);
                    const u32 v0 = tc_ld2(va, 0), v1 = tc_ld2(va, 8 * ld), v2 = tc_ld2(va, 8),
                              v3 = tc_ld2(va, 8 * ld + 8);
#pragma unroll
                    for (int n = 0; n < 4; n++) {
                        const u16* qr = qs + (n * 8 + g) * ld + kk * 16 + 2 * t;
                        const u16* gr = gs + (n * 8 + g) * ld + kk * 16 + 2 * t;
                        tc_mma(s[n], k0, k1, k2, k3, tc_ld2(qr, 0), tc_ld2(qr, 8));
                        tc_mma(dp[n], v0, v1, v2, v3, tc_ld2(gr, 0), tc_ld2(gr, 8));
                    }
                }
            }
            // P^T (kept in s) and dS^T (kept in dp); element x of n-tile n is key
            // j0 + jw + g + 8 (x >> 1), query c0 + 8 n + 2 t + (x & 1).
#pragma unroll
            for (int n = 0; n < 4; n++) {
#pragma unroll
                for (int x = 0; x < 4; x++) {
                    const int il = n * 8 + 2 * t + (x & 1);
                    const int j = j0 + jw + g + 8 * (x >> 1);
                    float p = 0.0f;
                    if (tc_visible(c0 + il, j, Sq, Sk, causal, q_start, k_start))
                        p = expf(s[n][x] * scale - lse_s[il]);
                    s[n][x] = p;
                    dp[n][x] = p * (dp[n][x] - del_s[il]);
                }
            }
            // dV += P^T dO and dK += dS^T Q: A = P^T, dS^T (k-step kk = queries
            // c0 + 16 kk ..), B(k = i, n = d) = dO[i][d], Q[i][d].
#pragma unroll
            for (int kk = 0; kk < 2; kk++) {
                const u32 p0 = tc_pack(s[2 * kk][0], s[2 * kk][1]);
                const u32 p1 = tc_pack(s[2 * kk][2], s[2 * kk][3]);
                const u32 p2 = tc_pack(s[2 * kk + 1][0], s[2 * kk + 1][1]);
                const u32 p3 = tc_pack(s[2 * kk + 1][2], s[2 * kk + 1][3]);
                const u32 d0 = tc_pack(dp[2 * kk][0], dp[2 * kk][1]);
                const u32 d1 = tc_pack(dp[2 * kk][2], dp[2 * kk][3]);
                const u32 d2 = tc_pack(dp[2 * kk + 1][0], dp[2 * kk + 1][1]);
                const u32 d3 = tc_pack(dp[2 * kk + 1][2], dp[2 * kk + 1][3]);
                const u16* gr = gs + (kk * 16 + 2 * t) * ld + g;
                const u16* qr = qs + (kk * 16 + 2 * t) * ld + g;
#pragma unroll
                for (int n = 0; n < (2 * MAXK); n++) {
                    if (n < nd) {
                        tc_mma(dva[n], p0, p1, p2, p3, tc_ld2col(gr, n * 8, ld),
                               tc_ld2col(gr, 8 * ld + n * 8, ld));
                        tc_mma(dka[n], d0, d1, d2, d3, tc_ld2col(qr, n * 8, ld),
                               tc_ld2col(qr, 8 * ld + n * 8, ld));
                    }
                }
            }
        }
    }

#pragma unroll
    for (int hf = 0; hf < 2; hf++) {
        const int j = j0 + jw + g + 8 * hf;
        if (j < Sk) {
            const long long off = kbase + (long long)j * kstride + 2 * t;
#pragma unroll
            for (int n = 0; n < (2 * MAXK); n++) {
                if (n < nd) {
                    dk[off + n * 8] += scale * dka[n][2 * hf];
                    dk[off + n * 8 + 1] += scale * dka[n][2 * hf + 1];
                    dv[off + n * 8] += dva[n][2 * hf];
                    dv[off + n * 8 + 1] += dva[n][2 * hf + 1];
                }
            }
        }
    }
}

// The kernels the launcher names: attn_fwd_tc_k4 (D <= 64) and attn_fwd_tc_k8 (D <= 128), and
// likewise for the backward's two.
#define TC_KERNELS(MAXK)                                                                       \
    extern "C" __global__ void __launch_bounds__(128) attn_fwd_tc_k##MAXK(                    \
        const u16* q, const u16* k, const u16* v, float* out, float* lse, int B, int Sq,       \
        int Sk, int H, int Hkv, int D, int causal, int q_start, int k_start, float scale) {    \
        attn_fwd_tc_body<MAXK>(q, k, v, out, lse, B, Sq, Sk, H, Hkv, D, causal, q_start,       \
                               k_start, scale);                                                \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(128) attn_bwd_dq_tc_k##MAXK(                 \
        const u16* q, const u16* k, const u16* v, const u16* dout, const float* lse,           \
        const float* delta, float* dq, int B, int Sq, int Sk, int H, int Hkv, int D,           \
        int causal, int q_start, int k_start, float scale) {                                   \
        attn_bwd_dq_tc_body<MAXK>(q, k, v, dout, lse, delta, dq, B, Sq, Sk, H, Hkv, D, causal, \
                                  q_start, k_start, scale);                                    \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(128) attn_bwd_dkv_tc_k##MAXK(                \
        const u16* q, const u16* k, const u16* v, const u16* dout, const float* lse,           \
        const float* delta, float* dk, float* dv, int B, int Sq, int Sk, int H, int Hkv,       \
        int D, int causal, int q_start, int k_start, float scale) {                            \
        attn_bwd_dkv_tc_body<MAXK>(q, k, v, dout, lse, delta, dk, dv, B, Sq, Sk, H, Hkv, D,    \
                                   causal, q_start, k_start, scale);                           \
    }

TC_KERNELS(4)
TC_KERNELS(8)
