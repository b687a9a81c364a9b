// A prototype of the attention forward on Hopper's warpgroup products (wgmma, sm_90a), the
// path the 2x floor needs (docs/GPU.md, "What comes next"): FlashAttention-3's products
// without its warp specialisation, to measure what the instructions alone give at the
// 124M's shape before the library takes them. Run and checked by attn_fwd.py (PyTorch's
// scaled_dot_product_attention as the reference and the peer); not part of the library.
//
// q, k, v: bf16 [B, S, H, 64] (no grouped heads); out fp32 [B, S, H, 64], lse fp32 [B, H, S]
// (natural log); causal. Grid (ceil(S / 64), B * H), the longest query blocks first; one
// warpgroup (128 threads) a CTA: 64 query rows, warp w rows 16w .. 16w + 15 (the wgmma
// accumulator's rows). Per key tile of 64: S = Q K^T (4 wgmma m64n64k16, Q and K from
// shared memory), the online softmax in registers (exp2 domain), O += P V (4 wgmma, P from
// registers in mma.sync's A layout, V from shared memory MN-major). K and V double-buffered
// by cp.async. Shared tiles: rows of 128 bytes (64 bf16) with the 128-byte swizzle
// (wgmma.cuh, put in front by probe.py), 1024-byte aligned: Q, then two stages of K and V:
// 40 KiB. `vlbo`, `vsbo`: V's descriptor byte offsets, as probe.py finds them.

#define NEG_INF (__int_as_float(0xff800000))
#define LOG2E 1.4426950408889634f
#define LN2 0.6931471805599453f

__device__ __forceinline__ u32 pack_bf16(float lo, float hi) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

__device__ __forceinline__ float ex2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

__device__ __forceinline__ void cp16(u32 dst, const u16* src, int bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst),
                 "l"((u64)__cvta_generic_to_global(src)), "r"(bytes)
                 : "memory");
}

// Rows r0 .. r0 + 63 of a [.., S, H, 64] head (`x`: row 0 of the head, `stride` elements
// between rows) into a swizzled tile at `tile`; rows past S zero-filled. 512 pieces of 16
// bytes, 4 a thread.
__device__ __forceinline__ void load_tile(u32 tile, const u16* x, long long stride, int r0,
                                          int S) {
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const int e = threadIdx.x + 128 * i, r = e >> 3, c = e & 7;
        const bool in = r0 + r < S;
        const u16* src = x + (in ? (long long)(r0 + r) * stride : 0) + 8 * c;
        cp16(tile + (u32)r * 128 + ((u32)(c ^ (r & 7)) << 4), src, in ? 16 : 0);
    }
}

extern "C" __global__ void __launch_bounds__(128) attn_fwd_wgmma(
    const u16* q, const u16* k, const u16* v, float* out, float* lse, int B, int S, int H,
    float scale, int vlbo, int vsbo) {
    extern __shared__ __align__(1024) unsigned char smem[];
    // Dynamic shared memory is 16-byte aligned by contract: round up to 1024 (the launch asks
    // for 1 KiB more than the tiles).
    const u32 base = ((u32)__cvta_generic_to_shared(smem) + 1023u) & ~1023u;
    const u32 qt = base, kt0 = base + 8192, vt0 = base + 16384, stage = 16384;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
    const int b = blockIdx.y / H, h = blockIdx.y % H;
    const int q0 = (gridDim.x - 1 - blockIdx.x) * 64;
    const long long stride = (long long)H * 64;
    const u16* qb = q + (long long)b * S * stride + (long long)h * 64;
    const u16* kb = k + (long long)b * S * stride + (long long)h * 64;
    const u16* vb = v + (long long)b * S * stride + (long long)h * 64;
    const float sl2 = scale * LOG2E;
    const int nt = (min(q0 + 64, S) + 63) / 64; // key tiles the block's rows see

    load_tile(qt, qb, stride, q0, S);
    load_tile(kt0, kb, stride, 0, S);
    load_tile(vt0, vb, stride, 0, S);
    asm volatile("cp.async.commit_group;\n" ::: "memory");

    const int r_lo = q0 + 16 * warp + g, r_hi = r_lo + 8; // this thread's two rows
    float o[32], m[2] = {NEG_INF, NEG_INF}, l[2] = {0.0f, 0.0f};
#pragma unroll
    for (int i = 0; i < 32; i++) o[i] = 0.0f;

    for (int j = 0; j < nt; j++) {
        const u32 cur = (u32)(j & 1) * stage;
        asm volatile("cp.async.wait_group 0;\n" ::: "memory");
        // The copies (generic proxy) made visible to the products (async proxy).
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        __syncthreads();
        if (j + 1 < nt) {
            load_tile(kt0 + (stage - cur), kb, stride, 64 * (j + 1), S);
            load_tile(vt0 + (stage - cur), vb, stride, 64 * (j + 1), S);
        }
        asm volatile("cp.async.commit_group;\n" ::: "memory");

        // S = Q K^T: k-step kk is 32 bytes into the swizzled rows (SBO: 8 rows, 1024 bytes).
        float s[32];
#pragma unroll
        for (int i = 0; i < 32; i++) s[i] = 0.0f;
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < 4; kk++)
            wg_ss(s, desc(qt + 32 * kk, 16, 1024), desc(kt0 + cur + 32 * kk, 16, 1024));
        wg_commit();
        wg_wait0();

        // Online softmax. s[4i + x]: row r_lo (x < 2) or r_hi, key 64j + 8i + 2t + (x & 1).
        const int j0 = 64 * j;
        const bool edge = j0 + 63 > q0 || j0 + 64 > S;
#pragma unroll
        for (int hf = 0; hf < 2; hf++) {
            const int row = hf ? r_hi : r_lo;
            float mx = m[hf];
#pragma unroll
            for (int i = 0; i < 8; i++) {
#pragma unroll
                for (int e = 0; e < 2; e++) {
                    const int key = j0 + 8 * i + 2 * t + e;
                    float& x = s[4 * i + 2 * hf + e];
                    if (edge && (key > row || key >= S)) x = NEG_INF;
                    mx = fmaxf(mx, x);
                }
            }
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            const float m2 = mx == NEG_INF ? 0.0f : __fmul_rn(mx, sl2);
            const float corr = ex2(__fmul_rn(m[hf], sl2) - m2);
            m[hf] = mx;
            float sum = 0.0f;
#pragma unroll
            for (int i = 0; i < 8; i++) {
#pragma unroll
                for (int e = 0; e < 2; e++) {
                    float& x = s[4 * i + 2 * hf + e];
                    x = ex2(fmaf(x, sl2, -m2));
                    sum += x;
                }
            }
            l[hf] = l[hf] * corr + sum;
#pragma unroll
            for (int i = 0; i < 8; i++) {
                o[4 * i + 2 * hf] *= corr;
                o[4 * i + 2 * hf + 1] *= corr;
            }
        }

        // O += P V: A = P's k-step kk (keys 16kk ..: n-tiles 2kk, 2kk + 1 of S), B = V's rows
        // 16kk .. 16kk + 15 (two 8-row atoms, 2048 bytes in), MN-major.
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < 4; kk++) {
            u32 a[4];
            a[0] = pack_bf16(s[8 * kk], s[8 * kk + 1]);
            a[1] = pack_bf16(s[8 * kk + 2], s[8 * kk + 3]);
            a[2] = pack_bf16(s[8 * kk + 4], s[8 * kk + 5]);
            a[3] = pack_bf16(s[8 * kk + 6], s[8 * kk + 7]);
            wg_rs<1>(o, a, desc(vt0 + cur + 2048 * kk, (u32)vlbo, (u32)vsbo));
        }
        wg_commit();
        wg_wait0();
    }

    float* ob = out + (long long)b * S * stride + (long long)h * 64;
#pragma unroll
    for (int hf = 0; hf < 2; hf++) {
        float sum = l[hf];
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        sum += __shfl_xor_sync(0xffffffffu, sum, 2);
        const int row = hf ? r_hi : r_lo;
        if (row < S) {
            const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
#pragma unroll
            for (int i = 0; i < 8; i++) {
                float* p = ob + (long long)row * stride + 8 * i + 2 * t;
                p[0] = o[4 * i + 2 * hf] * inv;
                p[1] = o[4 * i + 2 * hf + 1] * inv;
            }
            if (t == 0)
                lse[((long long)b * H + h) * S + row] =
                    sum > 0.0f ? (__fmul_rn(m[hf], sl2) + log2f(sum)) * LN2 : NEG_INF;
        }
    }
}
