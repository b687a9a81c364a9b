// Tensor-core helpers of the attention kernels (attention_tc.cu, attention_tc_bwd.cu), put
// between the prelude and each of those modules by the loader (`kernels::source`): the operand
// formats' packing and mma.sync (bf16, or fp16 where F16), ex2, ldmatrix, cp.async, and the
// causal mask's key count. PTX ISA sections are named where each is used.

#ifndef XT_EMU_PTX // (prelude.cuh: the CPU emulation supplies these)
// Two fp32 as a pair of the operand format (bf16, or fp16 where F16), round to nearest even:
// `lo` in the lower 16 bits (cvt.rn.bf16x2.f32 / cvt.rn.f16x2.f32 d, a, b put a in the upper
// half, b in the lower; PTX ISA, "cvt").
template <bool F16>
__device__ __forceinline__ u32 tc_pack(float lo, float hi) {
    u32 r;
    if constexpr (F16)
        asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    else
        asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// 2^x (ex2.approx.ftz.f32: 2^-inf = +0; results below 2^-126 flush to 0, far below what a 16-bit
// P or dS keeps next to the largest term of its row, at most 1).
__device__ __forceinline__ float tc_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

// d += a * b (16 x 8 x 16, bf16 operands, or fp16 where F16; fp32 accumulate).
template <bool F16>
__device__ __forceinline__ void tc_mma(float* d, const u32* a, u32 b0, u32 b1) {
    if constexpr (F16)
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, "
            "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    else
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
            "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Four 8 x 8 bf16 matrices from shared memory (`addr`: this lane's row address, see above).
// volatile with a memory clobber: the tiles are rewritten at the same addresses every tile or
// step, so these loads must neither be merged across iterations nor moved across the barriers.
__device__ __forceinline__ void tc_ldsm_x4(u32* r, u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr)
                 : "memory");
}

__device__ __forceinline__ void tc_ldsm_x4_trans(u32* r, u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr)
                 : "memory");
}

// 16 bytes global -> shared, cached in L2 only; `src_bytes` of them read from `src`, the rest
// zero-filled (0: a row past the end, nothing is read). `dst` and `src` 16-byte aligned.
__device__ __forceinline__ void tc_cp_async16(u32 dst, const u16* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst),
                 "l"((u64)__cvta_generic_to_global(src)), "r"(src_bytes)
                 : "memory");
}

// 4 bytes global -> shared (.ca: .cg takes 16-byte copies only); `src_bytes` 4 or 0.
__device__ __forceinline__ void tc_cp_async4(u32 dst, const float* src, int src_bytes) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst),
                 "l"((u64)__cvta_generic_to_global(src)), "r"(src_bytes)
                 : "memory");
}

__device__ __forceinline__ void tc_cp_async_commit() {
    asm volatile("cp.async.commit_group;\n" ::: "memory");
}

// Waits until at most N of this thread's cp.async groups, the newest, are pending; the copies
// of the others are then visible to it, and to the whole CTA after a barrier (PTX ISA,
// "cp.async.wait_group"; bar.sync orders the waiting thread's view before every other
// thread's reads after it).
template <int N>
__device__ __forceinline__ void tc_cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}
#endif // XT_EMU_PTX

// The A fragment of k-step kk of a product from the C fragments c0, c1 of the previous
// product's n-tiles 2 kk, 2 kk + 1 (the score tile feeds P V, dS K, P^T dO, dS^T Q without
// shared memory: the C layout of two adjacent n-tiles is the A layout of one k-step, see the
// fragment tables of the modules), rounded to the operand format.
template <bool F16>
__device__ __forceinline__ void tc_c_to_a(u32* a, const float* c0, const float* c1) {
    a[0] = tc_pack<F16>(c0[0], c0[1]);
    a[1] = tc_pack<F16>(c0[2], c0[3]);
    a[2] = tc_pack<F16>(c1[0], c1[1]);
    a[3] = tc_pack<F16>(c1[2], c1[3]);
}

__device__ __forceinline__ u32 tc_smem_addr(const void* p) {
    return (u32)__cvta_generic_to_shared(p);
}

// Keys visible to some query of rows [0, i_end): all of them, or up to the last row's.
__device__ __forceinline__ int tc_keys_seen(int i_end, int Sk, int causal, int q_start,
                                            int k_start) {
    if (!causal) return Sk;
    int v = q_start + i_end - k_start; // keys j with k_start + j <= q_start + i_end - 1
    return v < 0 ? 0 : (v > Sk ? Sk : v);
}

// acc[mt] += A_mt X for each of a warp's MT m-tiles: A_mt the k-step of 16 whose C fragments
// are c[mt][2 kk], c[mt][2 kk + 1] (the score-shaped product before: P for P V, dS for dS K;
// rounded to the format by tc_c_to_a), X rows row .. row + 15 of a 16-bit tile (row stride
// ld; `x_tr`: this lane's "tr" ldmatrix address at row 0, column 0) by D = 16 nk columns;
// output n-tiles 2p, 2p + 1 of every m-tile from one ldmatrix.x4.trans.
template <int MAXK, int MT, int NT, bool F16>
__device__ __forceinline__ void tc_mma_rows_tr(float (&acc)[MT][2 * MAXK][4],
                                               const float (&c)[MT][NT][4], int kk, u32 x_tr,
                                               int row, int ld, int nk) {
    u32 a[MT][4];
#pragma unroll
    for (int mt = 0; mt < MT; mt++) tc_c_to_a<F16>(a[mt], c[mt][2 * kk], c[mt][2 * kk + 1]);
#pragma unroll
    for (int p = 0; p < MAXK; p++) {
        if (p < nk) {
            u32 b[4];
            tc_ldsm_x4_trans(b, x_tr + (u32)(row * ld + p * 16) * 2u);
#pragma unroll
            for (int mt = 0; mt < MT; mt++) {
                tc_mma<F16>(acc[mt][2 * p], a[mt], b[0], b[1]);
                tc_mma<F16>(acc[mt][2 * p + 1], a[mt], b[2], b[3]);
            }
        }
    }
}

// A warp's row bounds relative to the key tile that starts at key j0 (the forward's and dQ's
// masked tiles): for each of its MT m-tiles and halves, the keys the row sees (vis: keys
// 0 .. vis - 1 of the tile) and, under a document mask, its first (lo), from the rows'
// absolute ones.
template <int MT>
__device__ __forceinline__ void tc_tile_bounds(int (&vis)[MT][2], int (&lo)[MT][2],
                                               const int (&vis_row)[MT][2],
                                               const int (&lo_row)[MT][2], int j0) {
#pragma unroll
    for (int mt = 0; mt < MT; mt++) {
#pragma unroll
        for (int hf = 0; hf < 2; hf++) {
            vis[mt][hf] = vis_row[mt][hf] - j0;
            lo[mt][hf] = lo_row[mt][hf] - j0;
        }
    }
}
