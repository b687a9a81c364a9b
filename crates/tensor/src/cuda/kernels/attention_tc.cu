// Tensor-core FlashAttention-2 forward for bf16 training (module "attention_tc"): kernels
// attn_fwd_tc_k4 for D <= 64 and attn_fwd_tc_k8 for D <= 128 (templates on the register tile,
// below). The backward's two kernels, dQ and dK/dV, are module "attention_tc_bwd"
// (attention_tc_bwd.cu). Like every kernel module this one is compiled with the prelude
// (kernels/prelude.cuh) put in front.
//
// Contract: that of the fp32 forward (attn_fwd_f32, module "attention"), on bf16 operands.
// q [B, Sq, H, D] and k, v [B, Sk, Hkv, D] as bf16 bits (`const u16*`: the caller rounds the
// fp32 values to nearest even once, for every kernel that reads them); out [B, Sq, H, D] fp32;
// lse [B, H, Sq] fp32 (natural log); causal by global positions (query i at q_start + i sees
// key j iff k_start + j <= q_start + i); grouped KV heads h -> h / (H / Hkv); a row that sees
// no key gets lse = -inf and out = 0; D a multiple of 16 in 16..128. Products on the tensor
// cores with bf16 operands and fp32 accumulation, Q, K, V as given
// (mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32, sm_80+), and P rounded to bf16
// (nearest even) before P V; scores, the online softmax and every accumulator stay fp32.
// `scale` must be positive (the launcher passes 1 / sqrt(D)): the running maximum is taken over
// the unscaled scores. Every output element is written once, by one thread.
//
// Launch (tensor::cuda::ops::attention_forward_tc, crates/tensor/src/cuda/ops.rs): grid
// (ceil(Sq / (64 MT)), B * H) (MT: h. below), block 128 (4 warps), and 512 (D + 8) bytes of
// dynamic shared memory (below: more than the default 48 KiB from D = 96 on, which the launch
// opts into with cuFuncSetAttribute MAX_DYNAMIC_SHARED_SIZE_BYTES). q, k, v 16-byte aligned,
// as the launcher checks (cp.async copies 16 bytes of a row of K or V; D a multiple of 16
// keeps every row 16-byte aligned after the first); out 8-byte aligned (float2 stores).
//
// Design, and why (an earlier version, which loaded its K and V tiles into shared memory
// synchronously, measured latency-bound on an H200 in Nsight Compute: nothing overlapped the
// loads; this one, with the backward's, measured 3.5 to 6 times faster there):
//  a. K and V tiles come in with cp.async (PTX ISA, "Data Movement and Conversion
//     Instructions: cp.async"), 16 bytes (8 bf16) a copy, L2 only (.cg), straight from the
//     bf16 rows into the bf16 tiles the mma operands are read from: no staging, no conversion.
//     Two stages (a K and a V tile each) make a double buffer: the copies of tile j + 1 go to
//     the other stage right after the barrier that opens tile j, and stay in flight while tile
//     j is computed (one commit group in flight at a time; see the loop for the barrier
//     discipline). Rows at or past Sk are zero-filled by the copy (src-size 0), so that a
//     masked P of 0 never meets a NaN of stale shared memory in P V.
//  b. Q's A fragments are read from global memory with 32-bit loads (two bf16 a load), not
//     through shared memory and ldmatrix: each element of Q is read once per CTA, by one
//     thread, so a shared tile would add 64 x (D + 8) x 2 bytes (or a third use of a stage), a
//     barrier and the ldmatrix for the same bytes from L2. A quad's two loads of a row and
//     k-step (columns 2t, 2t + 1 and 2t + 8, 2t + 9, t = 0..3) cover one whole 32-byte sector
//     (rows start 32-byte aligned: 2 D bytes apart, D a multiple of 16), so nothing fetched is
//     wasted, and they are issued while tile 0's copies fly.
//  c. B fragments come from the bf16 tiles with ldmatrix (PTX ISA, "Warp-level matrix load
//     instruction: ldmatrix"): .x4 gives the fragments of two n-tiles of 8 at once, .trans for
//     V in P V (V's k index runs down the tile's rows).
//  d. The online softmax runs in the exp2 domain: p = 2^(s * scale * log2(e) - m2) with one
//     FFMA and ex2.approx.ftz (PTX ISA, "ex2"), m2 the running maximum of the row in the same
//     units; lse = (m2 + log2(l)) * ln(2) at the end.
//  e. The causal (and Sk-edge) mask is applied only on the key tiles where some row of the
//     warp does not see some key of the tile; a warp skips tiles none of its rows sees, and on
//     a partly seen tile the 16-key steps past the last key its last row sees.
//  f. The longest blocks first, over the whole grid (a scheduler's "longest processing time
//     first", as FlashAttention-3's tile scheduler orders causal attention): blockIdx.y = 0
//     takes the last query rows of every (batch, head), which see the most keys under a
//     causal mask, and blockIdx.x the (batch, head), so that the blocks, started in the order
//     of their linear index (x fastest), start longest first across all heads, and the short
//     ones fill the tail. With the heads outermost instead, the longest block of the last
//     heads started last: a list-scheduling model at the 124M's shape (16 query blocks of 96
//     heads over 396 block slots; dev/attention/grid_order_model.py) finishes in 1.30x the
//     work's ideal time that way, 1.03x this way.
//  g. out is written as float2 (a thread's two adjacent columns of an accumulator fragment).
//  h. Rows a warp: MT m-tiles of 16 (the _k4 kernels 1, the _m2_k4 ones 2; the _k8 ones
//     1). With two, FlashAttention-2's layout (32 rows a warp, 128 a CTA), every ldmatrix of K
//     or V feeds the products of both m-tiles: at one m-tile a warp reads 16 KiB of shared
//     memory (32 ldmatrix.x4) for the 64 mma of a 64-key tile at D = 64, at two the same
//     16 KiB for 128. At 128 bytes a clock an SM the 16 KiB take 128 clocks, and 64 mma take
//     64 at Hopper's dense tensor-core peak (2048 FMA a clock an SM; mma.sync is reported to
//     reach about 2/3 of it, ~96): with one m-tile a warp shared memory is the tighter bound,
//     with two (128 mma: 128 to ~192 clocks) the tensor cores are. The tile's keys then go in
//     two steps of 32 (tn_step), so that the scores stay 32 registers a thread (one step of
//     64 spilled).
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
// The C fragments of two adjacent n-tiles (score columns 16kk..16kk+7 and 16kk+8..16kk+15) are
// the A fragment of k-step kk of P V: a = {pack(c0[0], c0[1]), pack(c0[2], c0[3]),
// pack(c1[0], c1[1]), pack(c1[2], c1[3])}.
//
// ldmatrix .m8n8 .x4: lanes 8i .. 8i + 7 give the 8 row addresses (16 bytes each: 8 bf16) of
// matrix i, and destination register i receives matrix i; lane l holds, of an 8 x 8 matrix M
// whose row r starts at the r-th address, M[l >> 2][2 (l & 3)], M[l >> 2][2 (l & 3) + 1]
// (lower half first), or with .trans M[2 (l & 3)][l >> 2], M[2 (l & 3) + 1][l >> 2]. So
//   S = Q K^T, B(k = d, n = j) = K[j][d]: M[r][c] = K[8n + r][16kk + c] gives lane l
//     K[8n + g][16kk + 2t, +1] = b[0] of n-tile n at k-step kk (columns 16kk + 8 .. give b[1]);
//     the four matrices are (n, cols 16kk), (n, 16kk + 8), (n + 1, 16kk), (n + 1, 16kk + 8).
//   O += P V, B(k = j, n = d) = V[j][d]: M[r][c] = V[16kk + r][8n + c] with .trans gives
//     V[16kk + 2t, +1][8n + g] = b[0] (rows 16kk + 8 .. give b[1]); the four matrices are
//     (rows 16kk, n), (16kk + 8, n), (16kk, n + 1), (16kk + 8, n + 1).
// The bf16 tiles have a row stride of D + 8 elements, (D + 8) / 2 = 4 (mod 8) 32-bit words
// since D is a multiple of 16: the 8 rows of one matrix start 4 (mod 8) words apart, i.e. on
// 8 distinct groups of 4 banks, so every ldmatrix phase is free of bank conflicts.
//
// Shared memory (dynamic, 16-byte aligned): two stages, each a bf16 K tile and a bf16 V tile of
// 64 rows with row stride D + 8 (stage s at byte 256 (D + 8) s, its V tile 128 (D + 8) bytes
// after its K tile): 2 x 2 x 64 x (D + 8) x 2 = 512 (D + 8) bytes, 36864 (36 KiB) for D = 64
// and 69632 (68 KiB) for D = 128; no static shared memory. (An earlier version took fp32 K
// and V through an fp32 stage beside the bf16 tiles: 768 D + 2048 bytes, 50 and 98 KiB.)
// Occupancy: an H100 or H200 SM has 228 KiB of shared memory (at most 227 KiB a block, opt-in
// above 48 KiB; 1 KiB reserved per block) and 64K registers. Shared memory allows 228 / 37 = 6
// blocks an SM at D = 64 and 228 / 69 = 3 at D = 128 (an A100's 164 KiB: 4 and 2); registers
// allow 3 at D = 64 with one m-tile a warp (a cap of 168 a thread), 2 with two (255), and 2
// at D = 128 (255), so registers are the limit everywhere (TN_K4_MIN_BLOCKS below).
//
// Checks: NVRTC 12.9 / 13.0 compile it for sm_80 and sm_90 with no warning
// (tests/cuda_kernels_compile.rs); on a GPU, tests/cuda_kernels.rs compares
// attention_forward_tc with the CPU's fp32 forward within the bf16 rounding of P; and without
// a GPU, dev/attention/attention_tc_emu.py, a lane-level numpy transliteration of this kernel
// (fragment layouts, shared-memory bytes, cp.async groups and barriers as the PTX ISA gives
// them; keep it in step), matches a dense float64 reference on 22 shapes (head sizes 16 to
// 128, causal with offsets, rows that see no key, GQA, ragged edges) and 6 under document
// masks (the _docs kernels), at D <= 64 with one m-tile a warp and with two, each run with
// every copy landing when issued and again at the wait that covers it.
//
// Document masks (the _docs kernels, DOCS): the "attention" module's key_lo (kernels/
// attention.cu), each row's first visible key. The starts being nondecreasing, a CTA's and a
// warp's bounds are those of their first and last rows. ptxas: the _docs kernels take 167
// registers at D = 64 (sm_80 and sm_90; with two m-tiles a warp 252 on sm_90, 234 on sm_80)
// and 255 at D = 128, no spills; the others are unchanged by the parameters (166 / 168 and
// 255).

#define TN_WARP_ROWS 16 // query rows of an m-tile (a warp owns MT of them: 16 MT rows)
#define TN_BN 64  // keys per tile
#define TN_PAD 8  // bf16 of padding per row of the bf16 tiles
#define TN_THREADS 128
#define TN_LOG2E 1.4426950408889634f
#define TN_LN2 0.6931471805599453f

// The 16-byte pieces (8 bf16) of a 64-row tile that this thread copies: pieces
// e = threadIdx.x + 128 i for i < D / 16 (64 rows of D / 8 pieces: 8 D pieces, D / 16 a
// thread), piece e at tile row e / (D / 8), columns 8 (e % (D / 8)) .. + 7. Consecutive
// threads take consecutive pieces of a row: at D = 64 and 128 a warp reads whole rows, or 512
// consecutive bytes of one, and each quarter-warp writes 128 consecutive bytes of one tile row
// (8 pieces, all 32 banks once: conflict-free). The row and column of piece i + 1 are those of
// piece i advanced by 128 pieces: `dr` rows and `dc` pieces, with a carry (no division in the
// loop).
struct TnPieces {
    int r, c;   // row and piece column of the first piece (i = 0)
    int dr, dc; // 128 / (D / 8), 128 % (D / 8)
    int cpr;    // pieces a row, D / 8
};

// Issues the copies of key rows j0 .. j0 + 63 of K and V (`kb`, `vb`: row 0 of the head;
// `kstride` = Hkv * D) into the bf16 tiles at shared addresses `kt`, `vt` (row stride ld);
// rows at or past Sk are zero-filled. Both addresses of a piece are 16-byte aligned: 8 c
// elements into a row, rows 2 kstride (a multiple of 32) and 2 ld (of 16) bytes apart.
template <int MAXK>
__device__ __forceinline__ void tn_copy_tile(u32 kt, u32 vt, const u16* kb, const u16* vb,
                                             long long kstride, int j0, int Sk, int D, int ld,
                                             const TnPieces& pc) {
    int r = pc.r, c = pc.c;
#pragma unroll
    for (int i = 0; i < MAXK; i++) {
        if (i < (D >> 4)) {
            const int row = j0 + r;
            const bool in = row < Sk;
            // A row past the end reads nothing; its address stays inside row 0 of the head.
            const long long off = (in ? (long long)row * kstride : 0) + 8 * c;
            const u32 so = (u32)(r * ld + 8 * c) * 2u;
            tc_cp_async16(kt + so, kb + off, in ? 16 : 0);
            tc_cp_async16(vt + so, vb + off, in ? 16 : 0);
            c += pc.dc;
            r += pc.dr;
            if (c >= pc.cpr) {
                c -= pc.cpr;
                r++;
            }
        }
    }
}

// Keys c0 .. c0 + KC - 1 (KC = 64 / MT) of a key tile of 64 for one warp's 16 MT query rows
// (MT m16 tiles: rows 16 mt .. + 15 of the warp's in tile mt): S = Q K^T, the online softmax,
// O += P V. Every K and V fragment read from shared memory serves the MT tiles' products
// (see "Rows a warp" in the header). `ks_lane`, `vs_lane`: this lane's ldmatrix row address
// in the bf16 K and V tiles (k-step 0, n-tile pair 0). MASKED: some row of the warp does not
// see some key of the tile; then `kv_lim` is the number of the tile's keys the warp's last
// row below Sq sees (16-key steps from it on are skipped: no row of the warp sees them) and
// `vis[mt][hf]` the number row r0 + 16 mt + 8 hf sees (keys 0 .. vis - 1 of the tile; may be
// <= 0 or > 64), and under a document mask (DOCS) not the keys before lo[mt][hf] either (keys
// lo .. vis - 1; lo may be <= 0).
template <int MAXK, int MT, bool MASKED, bool F16, bool DOCS>
__device__ __forceinline__ void tn_step(const u32 (&qf)[MT][MAXK][4],
                                        float (&o)[MT][2 * MAXK][4], float (&m)[MT][2],
                                        float (&l)[MT][2], u32 ks_lane, u32 vs_lane, int ld,
                                        int nk, float sl2, int kv_lim, const int (&vis)[MT][2],
                                        const int (&lo)[MT][2], int t, int c0) {
    constexpr int KC = TN_BN / MT; // keys a step
    constexpr int NT = KC / 8;     // n-tiles of 8 keys a step
    // S = Q K^T (16 MT rows x KC keys): n-tiles 2p, 2p + 1 (keys c0 + 16p ..) from one
    // ldmatrix.x4 per k-step, for every m-tile.
    float s[MT][NT][4];
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int n = 0; n < NT; n++)
            s[mt][n][0] = s[mt][n][1] = s[mt][n][2] = s[mt][n][3] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < MAXK; kk++) {
        if (kk < nk) {
#pragma unroll
            for (int p = 0; p < NT / 2; p++) {
                if (!MASKED || c0 + 16 * p < kv_lim) {
                    u32 bk[4];
                    tc_ldsm_x4(bk, ks_lane + (u32)((c0 + 16 * p) * ld + kk * 16) * 2u);
#pragma unroll
                    for (int mt = 0; mt < MT; mt++) {
                        tc_mma<F16>(s[mt][2 * p], qf[mt][kk], bk[0], bk[1]);
                        tc_mma<F16>(s[mt][2 * p + 1], qf[mt][kk], bk[2], bk[3]);
                    }
                }
            }
        }
    }
    // Online softmax, row r0 + 16 mt + 8 hf: s[mt][n][2 hf], s[mt][n][2 hf + 1] (keys
    // c0 + 8n + 2t, +1 of the tile), the row's KC scores spread over the 4 threads of the
    // quad. Skipped n-tiles hold 0 and are masked (no row of the warp sees them).
#pragma unroll
    for (int mt = 0; mt < MT; mt++) {
#pragma unroll
        for (int hf = 0; hf < 2; hf++) {
            float mx = m[mt][hf];
#pragma unroll
            for (int n = 0; n < NT; n++) {
#pragma unroll
                for (int e = 0; e < 2; e++) {
                    const int c = c0 + n * 8 + 2 * t + e;
                    if (MASKED && (c >= vis[mt][hf] || (DOCS && c < lo[mt][hf])))
                        s[mt][n][2 * hf + e] = XT_NEG_INF;
                    mx = fmaxf(mx, s[mt][n][2 * hf + e]);
                }
            }
            mx = fmaxf(mx, __shfl_xor_sync(XT_FULL_MASK, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(XT_FULL_MASK, mx, 2));
            // The new running maximum mx (unscaled; scale > 0) in exp2 units, m2 = mx *
            // scale * log2(e), rounded once (__fmul_rn: never fused) so that the previous
            // step's m2 is recomputed bit for bit below. 0 while the row has seen no key
            // (mx = -inf): p = 2^-inf = 0, never -inf - -inf.
            const float m2 = mx == XT_NEG_INF ? 0.0f : __fmul_rn(mx, sl2);
            // The rescale of what was summed against the previous m2 (2^-inf = 0 on the
            // first seen step, where l and o are still 0).
            const float corr = tc_exp2(__fmul_rn(m[mt][hf], sl2) - m2);
            m[mt][hf] = mx;
            float sum = 0.0f;
#pragma unroll
            for (int n = 0; n < NT; n++) {
#pragma unroll
                for (int e = 0; e < 2; e++) {
                    const float p = tc_exp2(fmaf(s[mt][n][2 * hf + e], sl2, -m2));
                    s[mt][n][2 * hf + e] = p;
                    sum += p;
                }
            }
            l[mt][hf] = l[mt][hf] * corr + sum; // this thread's part of the row sum
#pragma unroll
            for (int n = 0; n < 2 * MAXK; n++) {
                o[mt][n][2 * hf] *= corr;
                o[mt][n][2 * hf + 1] *= corr;
            }
        }
    }
    // O += P V: A = P (k-step kk = keys c0 + 16 kk ..: n-tiles 2 kk, 2 kk + 1), B(k = j,
    // n = d) = V[j][d], output n-tiles 2p, 2p + 1 (D / 16 = nk pairs) from one
    // ldmatrix.x4.trans, for every m-tile.
#pragma unroll
    for (int kk = 0; kk < NT / 2; kk++) {
        if (!MASKED || c0 + 16 * kk < kv_lim)
            tc_mma_rows_tr<MAXK, MT, NT, F16>(o, s, kk, vs_lane, c0 + 16 * kk, ld, nk);
    }
}

// One key tile of 64 for one warp's 16 MT query rows, in MT steps of 64 / MT keys (tn_step):
// the scores of 16 MT rows by 64 / MT keys are 32 registers a thread either way. The arguments
// are tn_step's.
template <int MAXK, int MT, bool MASKED, bool F16, bool DOCS>
__device__ __forceinline__ void tn_tile(const u32 (&qf)[MT][MAXK][4],
                                        float (&o)[MT][2 * MAXK][4], float (&m)[MT][2],
                                        float (&l)[MT][2], u32 ks_lane, u32 vs_lane, int ld,
                                        int nk, float sl2, int kv_lim, const int (&vis)[MT][2],
                                        const int (&lo)[MT][2], int t) {
    if (MT == 1) {
        tn_step<MAXK, MT, MASKED, F16, DOCS>(qf, o, m, l, ks_lane, vs_lane, ld, nk, sl2, kv_lim,
                                             vis, lo, t, 0);
    } else {
        // Not unrolled: unrolled, the two steps took more registers than the 255 there are.
#pragma unroll 1
        for (int c0 = 0; c0 < TN_BN; c0 += TN_BN / MT) {
            if (MASKED && c0 >= kv_lim) break;
            tn_step<MAXK, MT, MASKED, F16, DOCS>(qf, o, m, l, ks_lane, vs_lane, ld, nk, sl2,
                                                 kv_lim, vis, lo, t, c0);
        }
    }
}

// Grid (B * H, ceil(Sq / (64 MT))), block 128; the CTA of blockIdx.y = y owns query rows
// 64 MT (gridDim.y - 1 - y) .. + 64 MT - 1 of (batch, head) blockIdx.x, warp w rows + 16 MT w .. + 16 MT - 1 (its Q
// fragments stay in registers; m-tile mt of them rows + 16 mt .. + 15), and walks the key tiles
// of 64 that its rows see. DOCS: under a document mask, key_lo [B, Sq] (int32) gives each
// row's first visible key (the "attention" module's contract): the walk starts at the tile of
// the CTA's smallest (its first row's: the starts are nondecreasing), a warp skips the tiles
// wholly before its first row's, and a tile that some row of the warp sees only from a later
// key is masked per element.
template <int MAXK, int MT, bool FULL, bool F16, bool DOCS>
__device__ __forceinline__ void attn_fwd_tc_body(const u16* q, const u16* k, const u16* v,
                                                      float* out, float* lse, int B, int Sq,
                                                      int Sk, int H, int Hkv, int D, int causal,
                                                      int q_start, int k_start, float scale,
                                                      const int* key_lo) {
    extern __shared__ __align__(16) unsigned char tn_smem[];
    if (FULL) D = 16 * MAXK; // a constant from here on: loops without guards, fixed offsets
    const int ld = D + TN_PAD;
    const int bm = TN_WARP_ROWS * MT * 4; // query rows of the CTA
    // Stage s of the double buffer: the K tile at kt0 + s * stage, the V tile at vt0 + s * stage.
    const u32 stage = (u32)(2 * TN_BN * ld) * 2u;
    const u32 kt0 = tc_smem_addr(tn_smem), vt0 = kt0 + (u32)(TN_BN * ld) * 2u;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int b = blockIdx.x / H, h = blockIdx.x % H, hk = h / (H / Hkv);
    const int q0 = (gridDim.y - 1 - blockIdx.y) * bm; // longest rows first (f.)
    const int nk = D >> 4, nd = D >> 3;
    const long long qstride = (long long)H * D, kstride = (long long)Hkv * D;
    const u16* qb = q + (long long)b * Sq * qstride + (long long)h * D;
    const u16* kb = k + (long long)b * Sk * kstride + (long long)hk * D;
    const u16* vb = v + (long long)b * Sk * kstride + (long long)hk * D;
    const int iw = q0 + warp * TN_WARP_ROWS * MT; // the warp's first row
    const int wlast = iw + TN_WARP_ROWS * MT - 1;   // and its last
    // This thread's rows: r0 + 16 mt (half 0 of m-tile mt) and r0 + 16 mt + 8 (half 1).
    const int r0 = iw + g;
    const float sl2 = scale * TN_LOG2E;

    const int nvis = tc_keys_seen(min(q0 + bm, Sq), Sk, causal, q_start, k_start);
    const int ntiles = (nvis + TN_BN - 1) / TN_BN;
    // The first tile the CTA needs (CTA-uniform): that of its first row's first key.
    const long long lrow = (long long)b * Sq;
    const int jt0 = DOCS ? key_lo[lrow + q0] / TN_BN : 0;
    TnPieces pc;
    pc.cpr = D >> 3;
    pc.r = threadIdx.x / pc.cpr;
    pc.c = threadIdx.x - pc.r * pc.cpr;
    pc.dr = TN_THREADS / pc.cpr;
    pc.dc = TN_THREADS - pc.dr * pc.cpr;

    // Tile jt0's copies (stage 0) fly while Q is read.
    if (jt0 < ntiles) {
        tn_copy_tile<MAXK>(kt0, vt0, kb, vb, kstride, jt0 * TN_BN, Sk, D, ld, pc);
        tc_cp_async_commit();
    }

    // Q's A fragments (m-tile mt: rows r0 + 16 mt, + 8; zeros past Sq) from global memory, two
    // bf16 a 32-bit load (see b. in the header): a[0], a[1] columns 16 kk + 2t, + 1 of the two
    // rows; a[2], a[3] columns 16 kk + 2t + 8, + 9.
    u32 qf[MT][MAXK][4];
#pragma unroll
    for (int mt = 0; mt < MT; mt++) {
        const int ra = r0 + TN_WARP_ROWS * mt;
        const u16* pa = qb + (long long)ra * qstride + 2 * t;
        const u16* pb = qb + (long long)(ra + 8) * qstride + 2 * t;
        const bool oka = ra < Sq, okb = ra + 8 < Sq;
#pragma unroll
        for (int kk = 0; kk < MAXK; kk++) {
            if (kk < nk) {
                qf[mt][kk][0] = oka ? *(const u32*)(pa + kk * 16) : 0u;
                qf[mt][kk][1] = okb ? *(const u32*)(pb + kk * 16) : 0u;
                qf[mt][kk][2] = oka ? *(const u32*)(pa + kk * 16 + 8) : 0u;
                qf[mt][kk][3] = okb ? *(const u32*)(pb + kk * 16 + 8) : 0u;
            }
        }
    }

    // What the warp sees (warp-uniform): keys 0 .. wfull - 1 by every row of it (the first
    // row sees the fewest), keys 0 .. wkeys - 1 by some row (the last row below Sq sees the
    // most); nothing for a warp whose rows are all past Sq. And what each of this thread's
    // rows sees: keys 0 .. vis_row - 1.
    // Under a document mask also: keys from wlo_max on by every row (the last row's first key
    // is the largest), keys before wlo_min by none (the first row's), and this thread's rows
    // keys from lo_row on.
    int wfull = 0, wkeys = 0, wlo_min = 0, wlo_max = 0;
    if (iw < Sq) {
        wkeys = tc_keys_seen(min(wlast + 1, Sq), Sk, causal, q_start, k_start);
        wfull = tc_keys_seen(iw + 1, Sk, causal, q_start, k_start);
        if (DOCS) {
            wlo_min = key_lo[lrow + iw];
            wlo_max = key_lo[lrow + min(wlast, Sq - 1)];
        }
    }
    int vis_row[MT][2], lo_row[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; mt++) {
#pragma unroll
        for (int hf = 0; hf < 2; hf++) {
            const int i = r0 + TN_WARP_ROWS * mt + 8 * hf;
            vis_row[mt][hf] = tc_keys_seen(i + 1, Sk, causal, q_start, k_start);
            lo_row[mt][hf] = DOCS && i < Sq ? key_lo[lrow + i] : 0;
        }
    }

    // ldmatrix row addresses of this lane in stage 0 (k-step 0, n-tile pair 0; see the header).
    const int krow = ((lane >> 4) << 3) + (lane & 7), kcol = ((lane >> 3) & 1) << 3;
    const int vrow = (((lane >> 3) & 1) << 3) + (lane & 7), vcol = (lane >> 4) << 3;
    const u32 ks_lane = kt0 + (u32)(krow * ld + kcol) * 2u;
    const u32 vs_lane = vt0 + (u32)(vrow * ld + vcol) * 2u;

    float o[MT][2 * MAXK][4], m[MT][2], l[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; mt++) {
#pragma unroll
        for (int n = 0; n < 2 * MAXK; n++)
            o[mt][n][0] = o[mt][n][1] = o[mt][n][2] = o[mt][n][3] = 0.0f;
        m[mt][0] = m[mt][1] = XT_NEG_INF;
        l[mt][0] = l[mt][1] = 0.0f;
    }

    // The pipeline, one barrier a tile: tile jt0 + it is in stage it & 1. At the top of
    // iteration it the only commit group in flight is that tile's; after this thread's wait
    // and the barrier, (1) every thread's copies of the tile have landed and are visible to
    // the CTA, and (2) every warp is done with the previous tile, so its stage, (it + 1) & 1,
    // may be overwritten: the next tile's copies go there and fly while this one is computed.
    // Warps that skip a tile still pass every barrier (the loop and its barrier are
    // CTA-uniform).
    for (int it = 0, jt = jt0; jt < ntiles; it++, jt++) {
        const int j0 = jt * TN_BN;
        const u32 cur = (u32)(it & 1) * stage;
        tc_cp_async_wait<0>();
        __syncthreads();
        if (jt + 1 < ntiles) {
            const u32 nxt = stage - cur; // the other stage
            tn_copy_tile<MAXK>(kt0 + nxt, vt0 + nxt, kb, vb, kstride, j0 + TN_BN, Sk, D, ld, pc);
            tc_cp_async_commit();
        }
        if (j0 + TN_BN <= wfull && (!DOCS || j0 >= wlo_max)) {
            const int none[MT][2] = {};
            tn_tile<MAXK, MT, false, F16, DOCS>(qf, o, m, l, ks_lane + cur, vs_lane + cur, ld,
                                                nk, sl2, TN_BN, none, none, t);
        } else if (j0 < wkeys && (!DOCS || j0 + TN_BN > wlo_min)) {
            int vis[MT][2], lo[MT][2];
            tc_tile_bounds<MT>(vis, lo, vis_row, lo_row, j0);
            tn_tile<MAXK, MT, true, F16, DOCS>(qf, o, m, l, ks_lane + cur, vs_lane + cur, ld,
                                               nk, sl2, wkeys - j0, vis, lo, t);
        }
    }

    float* ob = out + (long long)b * Sq * qstride + (long long)h * D;
#pragma unroll
    for (int mt = 0; mt < MT; mt++) {
#pragma unroll
        for (int hf = 0; hf < 2; hf++) {
            float sum = l[mt][hf];
            sum += __shfl_xor_sync(XT_FULL_MASK, sum, 1);
            sum += __shfl_xor_sync(XT_FULL_MASK, sum, 2);
            const int i = r0 + TN_WARP_ROWS * mt + 8 * hf;
            if (i < Sq) {
                const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
                float* orow = ob + (long long)i * qstride + 2 * t;
#pragma unroll
                for (int n = 0; n < 2 * MAXK; n++) {
                    if (n < nd)
                        *(float2*)(orow + n * 8) =
                            make_float2(o[mt][n][2 * hf] * inv, o[mt][n][2 * hf + 1] * inv);
                }
                // lse = ln(sum_j e^(s_j scale)) = (m2 + log2(l)) ln 2, l summed against m2.
                if (t == 0)
                    lse[((long long)b * H + h) * Sq + i] =
                        sum > 0.0f ? (__fmul_rn(m[mt][hf], sl2) + log2f(sum)) * TN_LN2
                                   : XT_NEG_INF;
            }
        }
    }
}

// M-tiles of 16 query rows a warp owns (the CTA's 4 warps own 64 MT rows): at D <= 64 1 (the
// _k4 kernels) or 2 (the _m2_k4 ones: the launcher's choice, tensor::cuda::ops::AttnKernels);
// at D = 128 always 1 (two m-tiles' accumulators, 2 x 64 registers, would not fit beside the
// rest).

// Blocks an SM each kernel is compiled for (__launch_bounds__' second argument: the register
// cap is 64K / (128 x blocks)). attn_fwd_tc_k4 with one m-tile a warp: 3, a cap of 168
// registers a thread (ptxas of CUDA 12.9 and 13.0 takes 166 on sm_90 and 168 on sm_80 with no
// spills; a cap of 128, for 4 of the 6 blocks that shared memory allows, spills 36 bytes on
// sm_90 and 40 on sm_80; measured on an H200 no faster, docs/GPU.md); with two: 2, a cap of
// 255 (ptxas takes 240 on sm_90 and 224 on sm_80, no spills: 8 warps an SM of 32 rows each,
// against 12 of 16). attn_fwd_tc_k8: 2, a cap of 255, which it fills (255 on both, no
// spills; under a cap of 240, __maxnreg__, it takes 240 with no spills on sm_90 and 8 bytes
// of stack on sm_80, and 2 blocks either way). The library builds these defaults; to measure
// another choice, a #define before the source (e.g. `#define TN_K4_MIN_BLOCKS 4` after the
// prelude, compiling the module by hand with NVRTC) overrides either.
#ifndef TN_K4_MIN_BLOCKS
#define TN_K4_MIN_BLOCKS 3
#endif
#ifndef TN_M2_K4_MIN_BLOCKS
#define TN_M2_K4_MIN_BLOCKS 2
#endif
#ifndef TN_K8_MIN_BLOCKS
#define TN_K8_MIN_BLOCKS 2
#endif

// Every kernel takes the document mask's two arrays (the "attention" module's key_lo, q_end);
// only the _docs kernels read key_lo (the forward needs no q_end), and the others, which may
// be passed nulls, are the same code as without the parameters.
#define TN_KERNEL(NAME, MAXK, MT, MIN_BLOCKS, F16, DOCS)                                       \
    extern "C" __global__ void __launch_bounds__(TN_THREADS, MIN_BLOCKS)                       \
        NAME(const u16* q, const u16* k, const u16* v, float* out, float* lse, int B, int Sq,  \
             int Sk, int H, int Hkv, int D, int causal, int q_start, int k_start, float scale, \
             const int* key_lo, const int* q_end) {                                            \
        if (D == 16 * MAXK)                                                                    \
            attn_fwd_tc_body<MAXK, MT, true, F16, DOCS>(q, k, v, out, lse, B, Sq, Sk, H, Hkv,  \
                                                        D, causal, q_start, k_start, scale,    \
                                                        key_lo);                               \
        else                                                                                   \
            attn_fwd_tc_body<MAXK, MT, false, F16, DOCS>(q, k, v, out, lse, B, Sq, Sk, H, Hkv, \
                                                         D, causal, q_start, k_start, scale,   \
                                                         key_lo);                              \
    }

// bf16 operands (bf16 steps), and fp16 (fp16 steps); plain causal, and under a document mask;
// at D <= 64 one m-tile a warp (_k4) and two (_m2_k4).
TN_KERNEL(attn_fwd_tc_k4, 4, 1, TN_K4_MIN_BLOCKS, false, false)
TN_KERNEL(attn_fwd_tc_m2_k4, 4, 2, TN_M2_K4_MIN_BLOCKS, false, false)
TN_KERNEL(attn_fwd_tc_k8, 8, 1, TN_K8_MIN_BLOCKS, false, false)
TN_KERNEL(attn_fwd_tc_f16_k4, 4, 1, TN_K4_MIN_BLOCKS, true, false)
TN_KERNEL(attn_fwd_tc_f16_m2_k4, 4, 2, TN_M2_K4_MIN_BLOCKS, true, false)
TN_KERNEL(attn_fwd_tc_f16_k8, 8, 1, TN_K8_MIN_BLOCKS, true, false)
TN_KERNEL(attn_fwd_tc_docs_k4, 4, 1, TN_K4_MIN_BLOCKS, false, true)
TN_KERNEL(attn_fwd_tc_docs_m2_k4, 4, 2, TN_M2_K4_MIN_BLOCKS, false, true)
TN_KERNEL(attn_fwd_tc_docs_k8, 8, 1, TN_K8_MIN_BLOCKS, false, true)
TN_KERNEL(attn_fwd_tc_docs_f16_k4, 4, 1, TN_K4_MIN_BLOCKS, true, true)
TN_KERNEL(attn_fwd_tc_docs_f16_m2_k4, 4, 2, TN_M2_K4_MIN_BLOCKS, true, true)
TN_KERNEL(attn_fwd_tc_docs_f16_k8, 8, 1, TN_K8_MIN_BLOCKS, true, true)
