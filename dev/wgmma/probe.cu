// Probes of Hopper's warpgroup product (wgmma.mma_async, sm_90a) for the attention kernels
// to come (docs/GPU.md, "What comes next"): which shared-memory layouts, matrix descriptors and
// register fragments give D = A B on the hardware. Run by probe.py on a GPU (no Rust there);
// compiled for sm_90a by NVRTC. One warpgroup (128 threads), one 64 x 64 x 64 product in four
// k-steps of 16, bf16 operands, fp32 accumulators:
//   a: bf16 [64][64] row-major (M x K), b: bf16 [64][64], out: fp32 [64][64] row-major (M x N).
//   mode 0: A and B from shared memory, both K-major (B given as [N][K]: out = a b^T, as
//           S = Q K^T), 128-byte swizzle.
//   mode 1: A from registers (mma.sync's A fragment layout, a warp's 16 rows), B as mode 0.
//   mode 2: A from registers, B MN-major (given as [K][N], N contiguous: out = a b, as
//           O = P V), 128-byte swizzle.
// The descriptors' leading and stride byte offsets are the arguments `lbo`, `sbo`: the probe
// sweeps candidates and reports which give the product.
// The swizzle, the descriptor and the product's pieces: wgmma.cuh, put in front by probe.py.
extern "C" __global__ void __launch_bounds__(128) probe(const u16* a, const u16* b, float* out,
                                                        int mode, int lbo, int sbo) {
    __shared__ __align__(1024) unsigned char sa[64 * 128];
    __shared__ __align__(1024) unsigned char sb[64 * 128];
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
    // Both tiles into shared memory, swizzled by rows of 128 bytes (A's rows m, B's rows: n
    // for K-major, k for MN-major: the row of the given array either way).
    for (int e = tid; e < 64 * 64; e += 128) {
        const int r = e >> 6, c = e & 63;
        *(u16*)(sa + sw128(r, c)) = a[e];
        *(u16*)(sb + sw128(r, c)) = b[e];
    }
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    __syncthreads();
    const u32 sa0 = (u32)__cvta_generic_to_shared(sa), sb0 = (u32)__cvta_generic_to_shared(sb);
    float d[32];
#pragma unroll
    for (int i = 0; i < 32; i++) d[i] = 0.0f;
    wg_fence();
#pragma unroll
    for (int kk = 0; kk < 4; kk++) {
        if (mode == 0) {
            // K-major, swizzled: k-step kk starts 32 bytes into the rows; 8-row groups 1024
            // bytes apart (SBO, expected; LBO expected unused for swizzled K-major).
            wg_ss(d, desc(sa0 + 32 * kk, (u32)lbo, (u32)sbo),
                  desc(sb0 + 32 * kk, (u32)lbo, (u32)sbo));
        } else {
            // A's fragment of warp w: rows 16w + g, + 8; columns 16kk + 2t, + 1 and + 8, + 9.
            u32 af[4];
            const int r0 = 16 * warp + g;
            const int c0 = 16 * kk + 2 * t;
            af[0] = *(const u32*)(a + r0 * 64 + c0);
            af[1] = *(const u32*)(a + (r0 + 8) * 64 + c0);
            af[2] = *(const u32*)(a + r0 * 64 + c0 + 8);
            af[3] = *(const u32*)(a + (r0 + 8) * 64 + c0 + 8);
            if (mode == 1)
                wg_rs<0>(d, af, desc(sb0 + 32 * kk, (u32)lbo, (u32)sbo));
            else
                // MN-major: k-step kk is rows 16kk .. 16kk + 15 of b, 2048 bytes in.
                wg_rs<1>(d, af, desc(sb0 + 2048 * kk, (u32)lbo, (u32)sbo));
        }
    }
    wg_commit();
    wg_wait0();
    // The accumulators as m16n8 fragments stacked: warp w rows 16w + g (+ 8), n-tile i
    // columns 8i + 2t (+ 1): d[4i .. 4i + 3].
#pragma unroll
    for (int i = 0; i < 8; i++) {
        const int r = 16 * warp + g, c = 8 * i + 2 * t;
        out[r * 64 + c] = d[4 * i];
        out[r * 64 + c + 1] = d[4 * i + 1];
        out[(r + 8) * 64 + c] = d[4 * i + 2];
        out[(r + 8) * 64 + c + 1] = d[4 * i + 3];
    }
}
