// Tensor-core FlashAttention-2 backward for bf16 training (module "attention_tc_bwd"): kernels
// attn_bwd_dq_tc_k4 / _k8 (dQ) and attn_bwd_dkv_tc_k4 / _k8 (dK and dV), _k4 for D <= 64, _k8
// for D <= 128, and attn_bwd_fused_tc_k4 (dK, dV and dQ in one kernel, D <= 64; design h.);
// the counterpart of the forward kernel (attention_tc.cu, module "attention_tc"),
// whose design it shares. Like every kernel module it is compiled with the prelude
// (kernels/prelude.cuh) put in front.
//
// Contract: that of the fp32 backward (attn_bwd_dq, attn_bwd_dkv, module "attention"), on bf16
// operands:
//   attn_bwd_dq_tc_k{4,8}(q, k, v, dout, lse, delta, dq, B, Sq, Sk, H, Hkv, D, causal,
//                         q_start, k_start, scale):  dq += scale * dS K
//   attn_bwd_dkv_tc_k{4,8}(q, k, v, dout, lse, delta, dk, dv, B, Sq, Sk, H, Hkv, D,
//                          causal, q_start, k_start, scale): dv += P^T dO,
//                                                            dk += scale * dS^T Q
// with P = exp(S scale - lse), S = Q K^T, dP = dO V^T, dS = P (dP - delta). q, dout
// [B, Sq, H, D] and k, v [B, Sk, Hkv, D] as bf16 bits (`const u16*`: the caller rounds the
// fp32 values to nearest even once, for every kernel that reads them, as for the forward; the
// backward launcher rounds dout itself, after computing delta from the fp32 dout); dq
// [B, Sq, H, D] and dk, dv [B, Sk, Hkv, D] fp32; lse, delta [B, H, Sq] fp32 (lse the forward's
// natural-log log-sum-exp, -inf for a row that sees no key; delta = rowsum(dO * O), the
// "attention" module's attn_bwd_delta); causal by global positions (query i at q_start + i
// sees key j iff k_start + j <= q_start + i); grouped KV heads h -> h / (H / Hkv), dk and dv
// summing over the H / Hkv query heads of their group; D a multiple of 16 in 16..128. The
// outputs are accumulated (+=), every element by one thread in a fixed order (deterministic,
// no atomics). A pair (i, j) that is masked (causal, or i >= Sq, or j >= Sk) contributes
// exactly 0, so a row that sees no key (lse = -inf) gets nothing and gives nothing. Numerics:
// Q, K, V, dO as given (bf16); S and dP one mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32
// product each (fp32 accumulation, sm_80+); P and dS fp32, rounded to bf16 (nearest even) as
// the operands of the three gradient products, which accumulate in fp32; scale applied to dQ
// and dK once, at the end. The sums run in this order: dK and dV over the group's heads, then
// the query steps of 32 from the last down to the one holding the first query that sees the
// CTA's first key (under a document mask up from it), then 16-query k-steps; dQ over key tiles of 64, then k-steps of 16 (in
// steps of 32 keys, or of 16 with two m-tiles a warp: the same order, the same bits); the
// fused kernel's dQ over the key blocks from the first, each block's share over its k-steps of
// 16 keys, rounded into dq in turn.
//
// Launch (tensor::cuda::ops::attention_backward_tc, crates/tensor/src/cuda/ops.rs, after
// attn_bwd_delta and the rounding of dout), both with block 128 (4 warps):
//   dQ:    grid (ceil(Sq / (64 MT)), B * H) (MT: m-tiles of 16 rows a warp, below),
//          dynamic shared memory 512 (D + 8) bytes (36864 for D = 64, 69632 for D = 128).
//   dK/dV: grid (ceil(Sk / 64), B * Hkv), dynamic shared memory 512 (D + 8) + 512 bytes
//          (37376 for D = 64, 70144 for D = 128).
//   fused (instead of both, D <= 64, no document mask): dK/dV's grid, its shared memory and a
//          dS^T tile of 64 x 40 bf16 (42496 bytes at D = 64), and B * H * ceil(Sq / 32)
//          counters (u32) zeroed before it.
// Both need more than the default 48 KiB from D = 96 on, which the launch opts into
// (cuFuncSetAttribute MAX_DYNAMIC_SHARED_SIZE_BYTES). q, k, v and dout 16-byte aligned, as the
// launcher checks (cp.async copies 16 bytes of a row; D a multiple of 16 keeps every row
// 16-byte aligned after the first); dq, dk and dv 8-byte aligned (float2 read-modify-write);
// lse and delta 4-byte aligned (as any fp32). Unlike the forward, `scale` may have either sign.
//
// Design, and why (the forward's techniques: an earlier version of both, which loaded its
// tiles into shared memory synchronously, measured latency-bound on an H200 in Nsight Compute,
// nothing overlapping the loads):
//  a. The tiles a CTA streams over come in with cp.async (PTX ISA, "Data Movement and
//     Conversion Instructions: cp.async"), 16 bytes (8 bf16) a copy, L2 only (.cg), straight
//     from the bf16 rows into the bf16 tiles the mma operands are read from (no staging, no
//     conversion), double-buffered: two stages, the copies of step n + 1 issued into the other
//     stage right after the barrier that opens step n and in flight while step n is computed
//     (the forward's pipeline, one barrier a step). dQ streams the K and V tiles of 64 keys
//     (as the forward); dK/dV streams the Q and dO tiles of 32 query rows plus their 32 lse
//     and delta values (4-byte cp.async.ca, zero-filled past Sq). Rows past the end are
//     zero-filled by the copy (src-size 0), so a masked P or dS of 0 never meets a NaN of stale
//     memory. dK/dV's own K and V tiles (64 keys, read once per CTA) come in with cp.async
//     too, one commit group ahead of the first step's. dQ's Q and dO A fragments are read from
//     global memory with 32-bit loads (two bf16 a load): each element once per CTA, by one
//     thread (the forward's reasoning for Q: a shared tile would only add a barrier and an
//     ldmatrix for the same bytes).
//  b. B fragments come from the bf16 tiles with ldmatrix (.x4: two n-tiles of 8 at once), .trans
//     where the product's k index runs down the tile's rows: K in dS K (dQ), dO in P^T dO and
//     Q in dS^T Q (dK/dV). dK/dV's A fragments of its warp's 16 keys of K and V come from
//     ldmatrix too, and at D <= 64 (_k4) stay in registers for the whole CTA
//     (TB_DKV_KV_REGS_K4; at D = 128 they would take 64 more registers and spill, so _k8
//     reloads them every step: TB_DKV_KV_REGS_K8 = 0).
//  c. P is recomputed in the exp2 domain: p = 2^(s * scale * log2(e) - lse * log2(e)), one FFMA
//     and ex2.approx.ftz (PTX ISA, "ex2"); lse * log2(e) (one fp32 product, the same bits
//     either way) once per row in dQ (in registers), and in dK/dV where a thread reads the
//     step's lse from its stage (2 products per n-tile of 8 queries and step: a copy scaled in
//     shared memory would take a second barrier per step).
//  d. Masks only where some pair of a warp's tile is masked: a warp of dQ tests its 16 rows
//     against the 64 keys of a tile (the forward's rule: every row sees every key -> no mask;
//     no row sees any -> skipped; else the 16-key steps past the last key its last row sees
//     are skipped and the rest masked per element); a warp of dK/dV tests its 16 keys against
//     the step's 32 queries (all 16 keys below Sk, all 32 rows below Sq and the last key seen
//     by the first row -> no mask; its first key seen by no row of the step, or past Sk ->
//     skipped; else the 16-query halves no row sees are skipped and the rest masked).
//     In an unmasked tile every row below Sq sees some key, so its lse is finite (a row past
//     Sq has lse = delta = 0 and zero Q and dO there: finite, and never stored or summed).
//  e. The longest blocks first over the whole grid, as the forward (attention_tc.cu, f.):
//     blockIdx.y the block, blockIdx.x the (batch, head), so that blocks start longest first
//     across all heads. dQ's blockIdx.y = 0 takes the last query rows (which see the most keys
//     under a causal mask), dK/dV's (and the fused kernel's) the first keys (seen by every
//     query).
//  f. dq, dk, dv are read and written as float2 (a thread's two adjacent columns of an
//     accumulator fragment): half the memory instructions of one float at a time.
//  g. dQ's rows a warp: MT m-tiles of 16 (the _k4 kernels 1, the _m2_k4 ones 2; the _k8
//     ones 1), as the forward's (attention_tc.cu, h.): with two, every ldmatrix of K or V
//     feeds both m-tiles' products, half the shared-memory reads per mma; the key steps are
//     then 16 keys, so that S and dP stay 32 registers a thread.
//  h. The fused kernel (attn_bwd_fused_tc_k4; FlashAttention-2's backward, Dao 2023,
//     Algorithm 2, with its atomic adds of dQ replaced by ordered ones): the split kernels
//     compute S and dP twice, once per kernel, seven products where FlashAttention-2 has five.
//     The fused kernel is dK/dV's (the same code, the same bits of dk and dv) plus, every query
//     step, the CTA's share of dQ: each warp writes its dS^T (16 keys x 32 queries, rounded as
//     for dK) into a shared tile; after a barrier each warp computes dS K over the CTA's 64 keys
//     for 16 queries and two pairs of 16 columns (ldmatrix.trans of the dS^T tile gives dS's A
//     fragments directly), and adds it into dq in global memory, fp32, L2 only. The order of the
//     adds into a query step is fixed, so the result is the same bits run to run (no atomic
//     sums): the key blocks that visit the step add in order, key block jb waiting (its warps'
//     first lanes, ld.acquire) until a counter of the step's adds reaches jb, and counting its
//     own (red.release) after the barrier that follows them (each warp waits on its own, so
//     one barrier a step is added: the one that completes the dS^T tile). A CTA so only ever
//     waits for a block of lower index (key block jb - 1 has blockIdx.y one less, e.): the
//     hardware starts blocks in the order of their index (not a documented guarantee, but
//     what FlashAttention-3's deterministic backward and CUTLASS's stream-K reductions rely on
//     too), so the one waited for has started, and it never waits on its waiter: no deadlock
//     however few CTAs fit at once. The dK/dV walk takes the query steps from the last down,
//     every key block from the same last step, so key block jb - 1, started no later, is at
//     least as far along its walk as jb at every step: at the same speed its add is done when
//     jb gets there, and the waits are short (ascending, jb - 1 would start 64 queries before
//     jb and reach each step two steps later). A wait that sees no progress for ~4 s
//     traps (the launch fails, no hang). 168 registers as dK/dV's (ptxas below).
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
// The C fragments of two adjacent n-tiles (columns 16kk..16kk+7 and 16kk+8..16kk+15) are the A
// fragment of k-step kk of the next product: a = {pack(c0[0], c0[1]), pack(c0[2], c0[3]),
// pack(c1[0], c1[1]), pack(c1[2], c1[3])} (dS for dS K; P^T, dS^T for P^T dO, dS^T Q).
//
// ldmatrix .m8n8 .x4: lanes 8i .. 8i + 7 give the 8 row addresses (16 bytes each: 8 bf16) of
// matrix i, and destination register i receives matrix i; lane l holds, of an 8 x 8 matrix M
// whose row r starts at the r-th address, M[l >> 2][2 (l & 3)], M[l >> 2][2 (l & 3) + 1]
// (lower half first), or with .trans M[2 (l & 3)][l >> 2], M[2 (l & 3) + 1][l >> 2]. So, for a
// bf16 tile X (row stride ld) and a pair of n-tiles 2p, 2p + 1 at k-step kk:
//   B(k = d, n = r) = X[r][d] (K and V in S = Q K^T and dP = dO V^T; Q and dO in S^T = K Q^T and
//     dP^T = V dO^T): the four matrices are (rows 16p, cols 16kk), (16p, 16kk + 8),
//     (16p + 8, 16kk), (16p + 8, 16kk + 8) -> lane l addresses row 16p + 8 (l >> 4) + (l & 7),
//     column 16kk + 8 ((l >> 3) & 1) ("nt" below): b[0], b[1] of n-tile 2p, then of 2p + 1.
//   B(k = r, n = d) = X[r][d] (K in dS K; dO in P^T dO and Q in dS^T Q), .trans: the four
//     matrices are (rows 16kk, cols 16p), (16kk + 8, 16p), (16kk, 16p + 8), (16kk + 8,
//     16p + 8) -> lane l addresses row 16kk + 8 ((l >> 3) & 1) + (l & 7), column 16p +
//     8 (l >> 4) ("tr" below).
//   A = X[r][d] for rows 16w .. 16w + 15 of X (dK/dV's K and V, A of S^T and dP^T), k-step kk:
//     the four matrices are (rows 16w, cols 16kk), (16w + 8, 16kk), (16w, 16kk + 8),
//     (16w + 8, 16kk + 8) -> lane l addresses row 16w + 8 ((l >> 3) & 1) + (l & 7), column
//     16kk + 8 (l >> 4) (the "tr" addressing, without .trans).
// The bf16 tiles have a row stride of D + 8 elements, (D + 8) / 2 = 4 (mod 8) 32-bit words
// since D is a multiple of 16: the 8 rows of one matrix start on 8 distinct groups of 4 banks,
// so every ldmatrix phase is free of bank conflicts.
//
// Shared memory (dynamic, 16-byte aligned), bf16 tiles with row stride D + 8 (ld):
//   dQ:    two stages of a K and a V tile (2 x 2 x 64 x ld x 2): 512 (D + 8) bytes; stage s at
//          byte 256 ld s, its V tile 128 ld bytes after its K tile.
//   dK/dV: two stages of the step's lse and delta (2 x 2 x 32 x 4 = 512 bytes, first: fixed
//          offsets), the K and V tiles (2 x 64 x ld x 2), two stages of the step's Q and dO
//          tiles (2 x 2 x 32 x ld x 2): 512 (D + 8) + 512 bytes.
// No static shared memory. An H100 / H200 SM has 228 KiB (227 KiB at most a block, opt-in
// above 48 KiB; 1 KiB reserved per block), so shared memory allows 6 blocks an SM of either
// kernel at D = 64 (228 / 37) and 3 at D = 128 (228 / 69, 228 / 69.5); an A100's 164 KiB: 4
// and 2. Registers allow fewer (below): they are the limit at both head sizes.
//
// ptxas (NVRTC 12.9 and 13.0 give the same figures; `-Xptxas -v` on the source as the compile
// check builds it; 0 bytes of spills and stack but where noted), registers a thread, sm_90 /
// sm_80, under the cap of __launch_bounds__(128, blocks) (the *_MIN_BLOCKS below), and blocks
// an SM as registers and shared memory allow (H100 / A100):
//   attn_bwd_dq_tc_k4    161 / 157 (cap 168)  shared 36864 B   3 / 3 blocks
//     two m-tiles a warp 230 / 231 (cap 255)                   2 / 2
//   attn_bwd_dq_tc_k8    234 / 230 (cap 255)  shared 69632 B   2 / 2
//   attn_bwd_dkv_tc_k4   168 / 168 (cap 168)  shared 37376 B   3 / 3
//   attn_bwd_dkv_tc_k8   253 / 246 (cap 255)  shared 70144 B   2 / 2
//   attn_bwd_fused_tc_k4 168 / 168 (cap 168)  shared 42496 B   3 / 3 (sm_80 spills 12 bytes)
// attn_bwd_dkv_tc_k8 sits 2 registers under the 255 of the hardware: a compiler that needs 3
// more spills (the figures above are the ones to compare against after a change), and
// dK/dV_k4 fills its cap (the dK/dV loop's stage offsets are selects on the step's parity, not
// products: with the products sm_80 spilled 4 bytes). At D = 64 shared memory would allow 6
// blocks, but a cap of 128 registers (4 blocks) spills (sm_90: dQ 28 bytes, dK/dV 776).
// TB_DKV_KV_REGS_K8 = 1 (K and V fragments in registers at D = 128) takes 255 and spills 8
// bytes on sm_80; TB_DKV_KV_REGS_K4 = 0 takes 168 / 164.
//
// Checks: NVRTC 12.9 / 13.0 compile it for sm_80 and sm_90 with no warning
// (tests/cuda_kernels_compile.rs); on a GPU, tests/cuda_kernels.rs compares
// attention_backward_tc with the CPU's fp32 backward within the bf16 rounding of P and dS; and
// without a GPU, dev/attention/attention_tc_bwd_emu.py, a lane-level numpy transliteration of
// both kernels (the ldmatrix and mma fragment layouts as the PTX ISA gives them, the
// shared-memory byte layout, the cp.async commit groups and waits, and the barriers as the
// bounds of phases in which no shared word is both read and copied to; keep it in step),
// matches a dense float64 reference of the fp32 backward's formulas (P and dS rounded to bf16
// too), the fused kernel too (its CTAs run in block order, each checking that its turn has
// come when it gets to a step: the order the kernel's waits allow; its dk, dv bitwise the
// split kernel's), on 16 shapes (head sizes 16 to 128, causal with offsets, rows that see no
// key, GQA, ragged edges, both choices of the K/V fragments in registers) and 6 under document
// masks (the _docs kernels), dQ at D <= 64 also with two m-tiles a warp (the same bits as
// one's), each run with every copy landing when issued and again with every copy landing at
// the wait that covers it: to about 1e-7 of the largest gradient where both round every P and
// dS alike, at most 7e-4 where one element rounds to the other bf16 neighbour (its S sums
// differ in the last fp32 bits). What the emulator does not cover: the hardware's memory
// ordering beyond the PTX rules it follows (the fused kernel's acquire / release included),
// ex2.approx's error, the speed.
//
// Document masks (the _docs kernels, DOCS): the "attention" module's key_lo (dQ: each row's
// first visible key) and q_end (dK/dV: the queries below it may see the key), nondecreasing,
// so that a CTA's and a warp's bounds are those of their first and last rows. ptxas, sm_90 /
// sm_80: attn_bwd_dq_tc_docs 158 / 159 (k4) and 238 / 234 (k8), attn_bwd_dkv_tc_docs 168 / 168
// (k4; sm_80 spills 8 bytes there) and 243 / 248 (k8); the kernels without a mask are
// unchanged by the parameters (the figures above).
//
// The kernels are templates on MAXK, the most k-steps of 16 a register tile holds (D <= 16 MAXK),
// instantiated for MAXK = 4 and 8, and on FULL (D == 16 MAXK: D a constant, loops without
// guards), chosen at run time as the forward does.

#define TB_WARP_ROWS 16 // query rows of a dQ m-tile (a warp owns MT of them: 16 MT rows)
#define TB_BN 64  // keys per K/V tile of dQ; keys per dK/dV CTA (16 per warp)
#define TB_KC 32  // keys per step of a dQ warp with one m-tile (half a key tile; 32 / MT)
#define TB_QC 32  // query rows per step of dK/dV
#define TB_PAD 8  // bf16 of padding per row of the bf16 tiles
#define TB_THREADS 128
#define TB_LOG2E 1.4426950408889634f
#define TB_NONE (1 << 28) // "no query of the step sees this key"

// The 16-byte pieces (8 bf16) of a tile of ROWS rows that this thread copies: pieces
// e = threadIdx.x + 128 i below ROWS D / 8 (ROWS rows of D / 8 pieces), piece e at tile row
// e / (D / 8), columns 8 (e % (D / 8)) .. + 7. Consecutive threads take consecutive pieces of
// a row: at D = 64 and 128 each quarter-warp writes 128 consecutive bytes of one tile row
// (conflict-free) and a warp reads whole rows, or 512 consecutive bytes of one. The row and
// column of piece i + 1 are those of piece i advanced by 128 pieces: `dr` rows and `dc`
// pieces, with a carry (no division in the loops).
struct TbPieces {
    int r, c;   // row and piece column of the first piece (i = 0)
    int dr, dc; // 128 / (D / 8), 128 % (D / 8)
    int cpr;    // pieces a row, D / 8
};

__device__ __forceinline__ TbPieces tb_pieces(int D) {
    TbPieces pc;
    pc.cpr = D >> 3;
    pc.r = threadIdx.x / pc.cpr;
    pc.c = threadIdx.x - pc.r * pc.cpr;
    pc.dr = TB_THREADS / pc.cpr;
    pc.dc = TB_THREADS - pc.dr * pc.cpr;
    return pc;
}

__device__ __forceinline__ void tb_next_piece(int& r, int& c, const TbPieces& pc) {
    c += pc.dc;
    r += pc.dr;
    if (c >= pc.cpr) {
        c -= pc.cpr;
        r++;
    }
}

// Issues the copies of rows row0 .. row0 + ROWS - 1 of two bf16 tensors of rows (`xa`, `xb`:
// row 0 of the head; `stride` elements between rows) straight into the bf16 tiles at shared
// addresses `ta`, `tb` (row stride ld); rows at or past S are zero-filled. Both addresses of
// a piece are 16-byte aligned: 8 c elements into a row, rows 2 stride (a multiple of 32) and
// 2 ld (of 16) bytes apart. ROWS D / 8 pieces, at most ROWS MAXK / 64 a thread; a multiple of
// 128 unless ROWS = 32 and D / 16 is odd (the guard folds away for FULL).
template <int ROWS, int MAXK>
__device__ __forceinline__ void tb_copy_rows(u32 ta, u32 tb, const u16* xa, const u16* xb,
                                             long long stride, int row0, int S, int D, int ld) {
    const TbPieces pc = tb_pieces(D);
    const int n = ROWS * (D >> 3);
    int r = pc.r, c = pc.c;
#pragma unroll
    for (int i = 0; i < ROWS * MAXK / 64; i++) {
        if ((i + 1) * TB_THREADS <= n || (i * TB_THREADS < n && threadIdx.x + i * TB_THREADS < n)) {
            const int row = row0 + r;
            const bool in = row < S;
            // A row past the end reads nothing; its address stays inside row 0 of the head.
            const long long off = (in ? (long long)row * stride : 0) + 8 * c;
            const u32 so = (u32)(r * ld + 8 * c) * 2u;
            tc_cp_async16(ta + so, xa + off, in ? 16 : 0);
            tc_cp_async16(tb + so, xb + off, in ? 16 : 0);
            tb_next_piece(r, c, pc);
        }
    }
}

// The A fragments of rows r and r + 8 of one head of a [B, S, H, D] bf16 tensor (`x`: its
// element (b, 0, h, 0); `stride` = H D), straight from global memory, two bf16 a 32-bit load
// (as the forward reads Q): f[kk][0], f[kk][1] columns 16 kk + 2t, + 1 of rows r, r + 8;
// f[kk][2], f[kk][3] columns 16 kk + 2t + 8, + 9; zeros for rows at or past S. A quad's loads
// of a row and k-step cover one whole 32-byte sector (rows start 32-byte aligned: 2 D bytes
// apart, D a multiple of 16).
template <int MAXK>
__device__ __forceinline__ void tb_load_a(u32 (&f)[MAXK][4], const u16* x, long long stride,
                                          int r, int S, int nk, int t) {
    const u16* pa = x + (long long)r * stride + 2 * t;
    const u16* pb = x + (long long)(r + 8) * stride + 2 * t;
    const bool oka = r < S, okb = r + 8 < S;
#pragma unroll
    for (int kk = 0; kk < MAXK; kk++) {
        if (kk < nk) {
            f[kk][0] = oka ? *(const u32*)(pa + kk * 16) : 0u;
            f[kk][1] = okb ? *(const u32*)(pb + kk * 16) : 0u;
            f[kk][2] = oka ? *(const u32*)(pa + kk * 16 + 8) : 0u;
            f[kk][3] = okb ? *(const u32*)(pb + kk * 16 + 8) : 0u;
        }
    }
}

// ---------------------------------------------------------------------------------------------
// dQ: dq += scale * dS K.

// One key tile of 64 for one warp's 16 MT query rows (MT m-tiles of 16: rows 16 mt .. + 15 of
// the warp's in tile mt), in steps of KC = 32 / MT keys (the scores and dP of 16 MT rows by
// KC keys are 32 registers a thread either way): S = Q K^T, dP = dO V^T, dS = P (dP - delta),
// acc += dS K. Every K and V fragment read from shared memory serves the MT tiles' products
// (the forward's "Rows a warp"); the sums into acc run over the same 16-key k-steps in the
// same order for either MT, so dQ is the same bits with one m-tile a warp or two.
// `ks_nt`, `vs_nt`: this lane's "nt" address in the bf16 K and V tiles, `ks_tr` its "tr"
// address in the K tile (k-step 0, pair 0). `lse2[mt][hf]`: row r0 + 16 mt + 8 hf's
// lse * log2(e) (0 for a row past Sq), `del[mt][hf]` its delta. MASKED: some row of the warp
// does not see some key of the tile; then `kv_lim` is the number of the tile's keys the
// warp's last row below Sq sees (16-key steps from it on are skipped: no row of the warp sees
// them) and `vis[mt][hf]` the number row r0 + 16 mt + 8 hf sees (keys 0 .. vis - 1 of the
// tile; 0 for a row past Sq; may be <= 0 or > 64), and under a document mask (DOCS) not the
// keys before lo[mt][hf] either (keys lo .. vis - 1; lo may be <= 0).
template <int MAXK, int MT, bool MASKED, bool F16, bool DOCS>
__device__ __forceinline__ void tb_dq_tile(const u32 (&qf)[MT][MAXK][4],
                                           const u32 (&gf)[MT][MAXK][4],
                                           float (&acc)[MT][2 * MAXK][4], u32 ks_nt, u32 vs_nt,
                                           u32 ks_tr, int ld, int nk, float sl2,
                                           const float (&lse2)[MT][2],
                                           const float (&del)[MT][2], int kv_lim,
                                           const int (&vis)[MT][2], const int (&lo)[MT][2],
                                           int t) {
    constexpr int KC = TB_KC / MT; // keys a step
    constexpr int NT = KC / 8;     // n-tiles of 8 keys a step
#pragma unroll 1
    for (int c0 = 0; c0 < TB_BN; c0 += KC) {
        if (MASKED && c0 >= kv_lim) break;
        // S and dP on keys c0 .. c0 + KC - 1: n-tiles 2p, 2p + 1 (keys c0 + 16p ..) from one
        // ldmatrix.x4 each of K and V per k-step, for every m-tile.
        float s[MT][NT][4], dp[MT][NT][4];
#pragma unroll
        for (int mt = 0; mt < MT; mt++) {
#pragma unroll
            for (int n = 0; n < NT; n++) {
                s[mt][n][0] = s[mt][n][1] = s[mt][n][2] = s[mt][n][3] = 0.0f;
                dp[mt][n][0] = dp[mt][n][1] = dp[mt][n][2] = dp[mt][n][3] = 0.0f;
            }
        }
#pragma unroll
        for (int kk = 0; kk < MAXK; kk++) {
            if (kk < nk) {
#pragma unroll
                for (int p = 0; p < NT / 2; p++) {
                    if (!MASKED || c0 + 16 * p < kv_lim) {
                        const u32 off = (u32)((c0 + 16 * p) * ld + kk * 16) * 2u;
                        u32 bk[4], bv[4];
                        tc_ldsm_x4(bk, ks_nt + off);
                        tc_ldsm_x4(bv, vs_nt + off);
#pragma unroll
                        for (int mt = 0; mt < MT; mt++) {
                            tc_mma<F16>(s[mt][2 * p], qf[mt][kk], bk[0], bk[1]);
                            tc_mma<F16>(s[mt][2 * p + 1], qf[mt][kk], bk[2], bk[3]);
                            tc_mma<F16>(dp[mt][2 * p], gf[mt][kk], bv[0], bv[1]);
                            tc_mma<F16>(dp[mt][2 * p + 1], gf[mt][kk], bv[2], bv[3]);
                        }
                    }
                }
            }
        }
        // dS = P (dP - delta), P = 2^(s scale log2(e) - lse log2(e)); 0 where masked (a select:
        // a row that sees no key has lse = -inf and P = 2^inf there). Kept in s. Element x of
        // n-tile n of m-tile mt: row r0 + 16 mt + 8 (x >> 1), key c0 + 8n + 2t + (x & 1) of the
        // tile.
#pragma unroll
        for (int mt = 0; mt < MT; mt++) {
#pragma unroll
            for (int n = 0; n < NT; n++) {
#pragma unroll
                for (int x = 0; x < 4; x++) {
                    const int hf = x >> 1;
                    const float p = tc_exp2(fmaf(s[mt][n][x], sl2, -lse2[mt][hf]));
                    float ds = p * (dp[mt][n][x] - del[mt][hf]);
                    const int c = c0 + n * 8 + 2 * t + (x & 1);
                    if (MASKED && (c >= vis[mt][hf] || (DOCS && c < lo[mt][hf]))) ds = 0.0f;
                    s[mt][n][x] = ds;
                }
            }
        }
        // acc += dS K: A = dS (k-step kk = keys c0 + 16 kk ..: n-tiles 2 kk, 2 kk + 1),
        // B(k = j, n = d) = K[j][d], output n-tiles 2p, 2p + 1 from one ldmatrix.x4.trans, for
        // every m-tile.
#pragma unroll
        for (int kk = 0; kk < NT / 2; kk++) {
            if (!MASKED || c0 + 16 * kk < kv_lim)
                tc_mma_rows_tr<MAXK, MT, NT, F16>(acc, s, kk, ks_tr, c0 + 16 * kk, ld, nk);
        }
    }
}

// Grid (B * H, ceil(Sq / (64 MT))), block 128; the CTA of blockIdx.y = y owns query rows
// 64 MT (gridDim.y - 1 - y) .. + 64 MT - 1 of (batch, head) blockIdx.x, warp w rows + 16 MT w .. + 16 MT - 1 (its Q and dO
// fragments stay in registers; m-tile mt of them rows + 16 mt .. + 15), and walks the key
// tiles of 64 that its rows see. DOCS: under a document mask (key_lo [B, Sq], the "attention"
// module's contract), as the forward: the walk starts at the tile of the CTA's first row's
// first key, a warp skips the tiles wholly before its first row's, and masks per element a
// tile that some row sees only from a later key.
template <int MAXK, int MT, bool FULL, bool F16, bool DOCS>
__device__ __forceinline__ void attn_bwd_dq_tc_body(const u16* q, const u16* k,
                                                         const u16* v, const u16* dout,
                                                         const float* lse, const float* delta,
                                                         float* dq, int B, int Sq, int Sk,
                                                         int H, int Hkv, int D, int causal,
                                                         int q_start, int k_start,
                                                         float scale, const int* key_lo) {
    extern __shared__ __align__(16) unsigned char tb_smem[];
    if (FULL) D = 16 * MAXK; // a constant from here on: loops without guards, fixed offsets
    const int ld = D + TB_PAD;
    const int bm = TB_WARP_ROWS * MT * 4; // query rows of the CTA
    // Stage s of the double buffer: the K tile at kt0 + s * stage, the V tile at vt0 + s * stage.
    const u32 stage = (u32)(2 * TB_BN * ld) * 2u;
    const u32 kt0 = tc_smem_addr(tb_smem), vt0 = kt0 + (u32)(TB_BN * ld) * 2u;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int b = blockIdx.x / H, h = blockIdx.x % H, hk = h / (H / Hkv);
    const int q0 = (gridDim.y - 1 - blockIdx.y) * bm; // longest rows first (e.)
    const int nk = D >> 4, nd = D >> 3;
    const long long qstride = (long long)H * D, kstride = (long long)Hkv * D;
    const long long qbase = (long long)b * Sq * qstride + (long long)h * D;
    const u16* kb = k + (long long)b * Sk * kstride + (long long)hk * D;
    const u16* vb = v + (long long)b * Sk * kstride + (long long)hk * D;
    const int iw = q0 + warp * TB_WARP_ROWS * MT; // the warp's first row
    const int wlast = iw + TB_WARP_ROWS * MT - 1;   // and its last
    // This thread's rows: r0 + 16 mt (half 0 of m-tile mt) and r0 + 16 mt + 8 (half 1).
    const int r0 = iw + g;
    const float sl2 = scale * TB_LOG2E;

    const int nvis = tc_keys_seen(min(q0 + bm, Sq), Sk, causal, q_start, k_start);
    const int ntiles = (nvis + TB_BN - 1) / TB_BN;
    // The first tile the CTA needs (CTA-uniform): that of its first row's first key.
    const long long lrow = (long long)b * Sq;
    const int jt0 = DOCS ? key_lo[lrow + q0] / TB_BN : 0;

    // Tile jt0's copies (stage 0) fly while Q, dO, lse and delta are read.
    if (jt0 < ntiles) {
        tb_copy_rows<TB_BN, MAXK>(kt0, vt0, kb, vb, kstride, jt0 * TB_BN, Sk, D, ld);
        tc_cp_async_commit();
    }

    // Q's and dO's A fragments (m-tile mt: rows r0 + 16 mt, + 8; zeros past Sq) from global
    // memory: each element is read once per CTA, by one thread, so not through shared memory
    // (the forward kernel's reasoning).
    u32 qf[MT][MAXK][4], gf[MT][MAXK][4];
    // Per row: lse in exp2 units, delta, and the keys it sees (0 past Sq: masked everywhere).
    float lse2[MT][2], del[MT][2];
    int vis_row[MT][2], lo_row[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; mt++) {
        tb_load_a<MAXK>(qf[mt], q + qbase, qstride, r0 + TB_WARP_ROWS * mt, Sq, nk, t);
        tb_load_a<MAXK>(gf[mt], dout + qbase, qstride, r0 + TB_WARP_ROWS * mt, Sq, nk, t);
#pragma unroll
        for (int hf = 0; hf < 2; hf++) {
            const int i = r0 + TB_WARP_ROWS * mt + 8 * hf;
            const long long li = ((long long)b * H + h) * Sq + i;
            lse2[mt][hf] = i < Sq ? lse[li] * TB_LOG2E : 0.0f;
            del[mt][hf] = i < Sq ? delta[li] : 0.0f;
            vis_row[mt][hf] = i < Sq ? tc_keys_seen(i + 1, Sk, causal, q_start, k_start) : 0;
            lo_row[mt][hf] = DOCS && i < Sq ? key_lo[lrow + i] : 0;
        }
    }
    // What the warp sees (warp-uniform): keys 0 .. wfull - 1 by every row of it (the first row
    // sees the fewest; rows past Sq are never stored), keys 0 .. wkeys - 1 by some row (the
    // last row below Sq sees the most); nothing for a warp whose rows are all past Sq. Under
    // a document mask also: keys from wlo_max on by every row, keys before wlo_min by none.
    int wfull = 0, wkeys = 0, wlo_min = 0, wlo_max = 0;
    if (iw < Sq) {
        wkeys = tc_keys_seen(min(wlast + 1, Sq), Sk, causal, q_start, k_start);
        wfull = tc_keys_seen(iw + 1, Sk, causal, q_start, k_start);
        if (DOCS) {
            wlo_min = key_lo[lrow + iw];
            wlo_max = key_lo[lrow + min(wlast, Sq - 1)];
        }
    }

    // ldmatrix row addresses of this lane in stage 0 (k-step 0, pair 0; see the header).
    const int nt_row = ((lane >> 4) << 3) + (lane & 7), nt_col = ((lane >> 3) & 1) << 3;
    const int tr_row = (((lane >> 3) & 1) << 3) + (lane & 7), tr_col = (lane >> 4) << 3;
    const u32 ks_nt = kt0 + (u32)(nt_row * ld + nt_col) * 2u;
    const u32 vs_nt = vt0 + (u32)(nt_row * ld + nt_col) * 2u;
    const u32 ks_tr = kt0 + (u32)(tr_row * ld + tr_col) * 2u;

    float acc[MT][2 * MAXK][4];
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int n = 0; n < 2 * MAXK; n++)
            acc[mt][n][0] = acc[mt][n][1] = acc[mt][n][2] = acc[mt][n][3] = 0.0f;

    // The pipeline, one barrier a tile (the forward kernel's): tile jt0 + it is in stage
    // it & 1; at the top of iteration it the only commit group in flight is that tile's.
    // After this thread's wait and the barrier every thread's copies of the tile are visible
    // to the CTA and every warp is done with the previous tile, whose stage the next tile's
    // copies then take, in flight while this one is computed. The loop and its barrier are
    // CTA-uniform.
    for (int it = 0, jt = jt0; jt < ntiles; it++, jt++) {
        const int j0 = jt * TB_BN;
        const u32 cur = (u32)(it & 1) * stage;
        tc_cp_async_wait<0>();
        __syncthreads();
        if (jt + 1 < ntiles) {
            const u32 nxt = stage - cur; // the other stage
            tb_copy_rows<TB_BN, MAXK>(kt0 + nxt, vt0 + nxt, kb, vb, kstride, j0 + TB_BN, Sk, D,
                                      ld);
            tc_cp_async_commit();
        }
        if (j0 + TB_BN <= wfull && (!DOCS || j0 >= wlo_max)) {
            const int none[MT][2] = {};
            tb_dq_tile<MAXK, MT, false, F16, DOCS>(qf, gf, acc, ks_nt + cur, vs_nt + cur,
                                                   ks_tr + cur, ld, nk, sl2, lse2, del, TB_BN,
                                                   none, none, t);
        } else if (j0 < wkeys && (!DOCS || j0 + TB_BN > wlo_min)) {
            int vis[MT][2], lo[MT][2];
            tc_tile_bounds<MT>(vis, lo, vis_row, lo_row, j0);
            tb_dq_tile<MAXK, MT, true, F16, DOCS>(qf, gf, acc, ks_nt + cur, vs_nt + cur,
                                                  ks_tr + cur, ld, nk, sl2, lse2, del,
                                                  wkeys - j0, vis, lo, t);
        }
    }

#pragma unroll
    for (int mt = 0; mt < MT; mt++) {
#pragma unroll
        for (int hf = 0; hf < 2; hf++) {
            const int i = r0 + TB_WARP_ROWS * mt + 8 * hf;
            if (i < Sq) {
                float* row = dq + qbase + (long long)i * qstride + 2 * t;
#pragma unroll
                for (int n = 0; n < 2 * MAXK; n++) {
                    if (n < nd) {
                        float2 x = *(float2*)(row + n * 8);
                        x.x += scale * acc[mt][n][2 * hf];
                        x.y += scale * acc[mt][n][2 * hf + 1];
                        *(float2*)(row + n * 8) = x;
                    }
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// dK, dV: dv += P^T dO, dk += scale * dS^T Q.

// Whether a dK/dV warp keeps the A fragments of its K and V rows in registers for the whole
// CTA (else it reloads them with ldmatrix every step): 32 registers at MAXK = 4, 64 at 8.
#ifndef TB_DKV_KV_REGS_K4
#define TB_DKV_KV_REGS_K4 1
#endif
#ifndef TB_DKV_KV_REGS_K8
#define TB_DKV_KV_REGS_K8 0
#endif

// ---------------------------------------------------------------------------------------------
// The fused backward (attn_bwd_fused_tc_k4: dK, dV and dQ from one kernel; design h. above).

#define TB_DS_LD 40 // row stride (bf16) of the fused kernel's dS^T tile: 32 queries + 8 padding
#define TB_SPIN_LIMIT (1 << 26) // polls (64 ns sleeps: ~4 s) before a wait is called a hang

// A warp's dS^T (16 keys x 32 queries, the C fragments of tb_dkv_step: element x of n-tile n
// at key row g + 8 (x >> 1), query 8n + 2t + (x & 1)) into the shared dS^T tile, rounded to
// the format as tc_c_to_a rounds it for dK: `row` is this lane's word of key row g, queries
// 2t, 2t + 1 (tile row 16 w + g). Lane (g, t) writes word 20 g + 4 n + t of its rows (+ 160
// for the second half): the 32 lanes take 32 distinct banks (20 g mod 32 is a distinct
// multiple of 4 for g = 0 .. 7).
template <bool F16>
__device__ __forceinline__ void tb_store_ds(u32* row, const float (&ds)[4][4]) {
#pragma unroll
    for (int n = 0; n < 4; n++) {
        row[4 * n] = tc_pack<F16>(ds[n][0], ds[n][1]);
        row[4 * n + TB_DS_LD * 4] = tc_pack<F16>(ds[n][2], ds[n][3]);
    }
}

// The same words zeroed: a warp none of whose keys the step's queries see.
__device__ __forceinline__ void tb_zero_ds(u32* row) {
#pragma unroll
    for (int n = 0; n < 4; n++) row[4 * n] = row[4 * n + TB_DS_LD * 4] = 0u;
}

// This CTA's share of dQ for one query step: acc = dS K over its 64 keys, for the step's
// m-tile `mt` (queries 16 mt .. + 15) and the column pairs p = pw, pw + 2 (columns 16p .. +
// 15; those below nk). A(m = query, k = key) = dS^T[key][query] from the dS^T tile with
// ldmatrix.trans at the "nt" addresses (`ds_nt`: this lane's, k-step 0, at column 16 mt;
// see the header: the transposed storage turns the "nt" matrices into A's four), B(k = key,
// n = d) = K[key][d] with ldmatrix.trans at the "tr" addresses (`ks_tr`, as in dQ's dS K).
// The sum runs over the k-steps of 16 keys in order.
template <int MAXK, bool F16>
__device__ __forceinline__ void tb_fused_dq(float (&acc)[MAXK / 2][2][4], u32 ds_nt, u32 ks_tr,
                                            int ld, int nk, int pw) {
#pragma unroll
    for (int i = 0; i < MAXK / 2; i++)
#pragma unroll
        for (int n = 0; n < 2; n++) acc[i][n][0] = acc[i][n][1] = acc[i][n][2] = acc[i][n][3] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < TB_BN / 16; kk++) {
        u32 a[4];
        tc_ldsm_x4_trans(a, ds_nt + (u32)(kk * 16 * TB_DS_LD) * 2u);
#pragma unroll
        for (int i = 0; i < MAXK / 2; i++) {
            const int p = pw + 2 * i;
            if (p < nk) {
                u32 b[4];
                tc_ldsm_x4_trans(b, ks_tr + (u32)(kk * 16 * ld + p * 16) * 2u);
                tc_mma<F16>(acc[i][0], a, b[0], b[1]);
                tc_mma<F16>(acc[i][1], a, b[2], b[3]);
            }
        }
    }
}

#ifndef XT_EMU_PTX // (prelude.cuh: the CPU emulation supplies these)
// Waits (one thread) until `turn` key blocks have added into the query step `flag` counts for
// (ld.acquire: their adds are visible after it, and to the other threads after the barrier
// that follows, __syncwarp for its warp; PTX ISA, "Memory Consistency Model"). A count past `turn`, or no progress in
// TB_SPIN_LIMIT polls, traps: the launch fails with an error instead of hanging.
__device__ __forceinline__ void tb_wait_turn(const unsigned* flag, unsigned turn) {
    for (int polls = 0;; polls++) {
        unsigned v;
        asm volatile("ld.acquire.gpu.global.u32 %0, [%1];\n"
                     : "=r"(v)
                     : "l"((u64)__cvta_generic_to_global(flag))
                     : "memory");
        if (v == turn) return;
        if (v > turn || polls >= TB_SPIN_LIMIT) __trap();
        __nanosleep(64);
    }
}

// One more key block has added into the step `flag` counts for (one thread, after a barrier
// that follows every thread's adds: red.release makes them visible before the count).
__device__ __forceinline__ void tb_signal(unsigned* flag) {
    asm volatile("red.release.gpu.global.add.u32 [%0], 1;\n" ::"l"(
                     (u64)__cvta_generic_to_global(flag))
                 : "memory");
}
#endif // XT_EMU_PTX

// The dK/dV walk over one head's query steps of 32 (i0, i0 + 32, .. below iend): DESC from the
// last down (for the fused kernel's adds, h.; the split kernel walks the same way, so that
// the two sum dK and dV in one order), else up from i0 (under a document mask, where iend
// is the mask's and one more register live across the loop spilled on sm_90): its first
// step (iend > i0), and the step after c (of head `head` of the group), past the end the
// first of the next head.
template <bool DESC>
__device__ __forceinline__ int tb_first_step(int i0, int iend) {
    return DESC ? i0 + (iend - 1 - i0) / TB_QC * TB_QC : i0;
}

template <bool DESC>
__device__ __forceinline__ void tb_next_step(int& c, int& head, int i0, int iend) {
    c += DESC ? -TB_QC : TB_QC;
    if (DESC ? c < i0 : c >= iend) {
        c = tb_first_step<DESC>(i0, iend);
        head++;
    }
}

// One query step of 32 rows for one warp's 16 keys: S^T = K Q^T and dP^T = V dO^T (keys as
// the M dimension: P^T and dS^T are A operands straight from the accumulators), P^T, dS^T,
// dva += P^T dO, dka += dS^T Q. `kf`, `vf`: the warp's K and V A fragments (KV_REGS), else
// `ka_tr`, `va_tr`: this lane's A ("tr") address in the bf16 K and V tiles (its warp's rows,
// k-step 0). `qs_nt`, `gs_nt`: its "nt" address in the step's bf16 Q and dO tiles, `qs_tr`,
// `gs_tr` its "tr" address (k-step 0, pair 0). `lse_s`, `del_s`: the step's lse (natural log,
// as copied; times log2(e) here, once per value and thread) and delta, 32 each. MASKED: some
// pair (key, query) of the warp's 16 x 32 is masked; then the 16-query halves p < plo and
// p >= phi are seen by no key of the warp (skipped), and key row j = g + 8 hf of the warp sees
// the step's queries lo[hf] <= il < hi — under a document mask (DOCS) lo[hf] <= il < hr[hf]
// (hr <= hi: the queries of the key's document).
template <int MAXK, bool MASKED, bool KV_REGS, bool F16, bool DOCS, bool FUSED>
__device__ __forceinline__ void tb_dkv_step(const u32 (&kf)[MAXK][4], const u32 (&vf)[MAXK][4],
                                            u32 ka_tr, u32 va_tr, u32 qs_nt, u32 gs_nt,
                                            u32 qs_tr, u32 gs_tr, const float* lse_s,
                                            const float* del_s, float (&dka)[2 * MAXK][4],
                                            float (&dva)[2 * MAXK][4], int ld, int nk,
                                            float sl2, int plo, int phi, const int (&lo)[2],
                                            int hi, const int (&hr)[2], int t, u32* ds_row) {
    // S^T and dP^T (16 keys x 32 queries): n-tiles 2p, 2p + 1 (queries 16p ..) from one
    // ldmatrix.x4 each of Q and dO per k-step; A = the warp's K (V) rows.
    float s[4][4], dp[4][4];
#pragma unroll
    for (int n = 0; n < 4; n++) {
        s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
        dp[n][0] = dp[n][1] = dp[n][2] = dp[n][3] = 0.0f;
    }
#pragma unroll
    for (int kk = 0; kk < MAXK; kk++) {
        if (kk < nk) {
            u32 ka[4], va[4];
            if (KV_REGS) {
#pragma unroll
                for (int x = 0; x < 4; x++) {
                    ka[x] = kf[kk][x];
                    va[x] = vf[kk][x];
                }
            } else {
                tc_ldsm_x4(ka, ka_tr + (u32)(kk * 16) * 2u);
                tc_ldsm_x4(va, va_tr + (u32)(kk * 16) * 2u);
            }
#pragma unroll
            for (int p = 0; p < 2; p++) {
                if (!MASKED || (p >= plo && p < phi)) {
                    const u32 off = (u32)(p * 16 * ld + kk * 16) * 2u;
                    u32 bq[4], bg[4];
                    tc_ldsm_x4(bq, qs_nt + off);
                    tc_ldsm_x4(bg, gs_nt + off);
                    tc_mma<F16>(s[2 * p], ka, bq[0], bq[1]);
                    tc_mma<F16>(s[2 * p + 1], ka, bq[2], bq[3]);
                    tc_mma<F16>(dp[2 * p], va, bg[0], bg[1]);
                    tc_mma<F16>(dp[2 * p + 1], va, bg[2], bg[3]);
                }
            }
        }
    }
    // P^T (kept in s) and dS^T (kept in dp); element x of n-tile n is key row g + 8 (x >> 1) of
    // the warp, query il = 8n + 2t + (x & 1) of the step. 0 where masked (selects: a row that
    // sees no key has lse = -inf and P = 2^inf there).
#pragma unroll
    for (int n = 0; n < 4; n++) {
        const float2 lr = *(const float2*)(lse_s + n * 8 + 2 * t);
        const float2 dl = *(const float2*)(del_s + n * 8 + 2 * t);
        const float l2[2] = {__fmul_rn(lr.x, TB_LOG2E), __fmul_rn(lr.y, TB_LOG2E)};
#pragma unroll
        for (int x = 0; x < 4; x++) {
            const int e = x & 1;
            float p = tc_exp2(fmaf(s[n][x], sl2, -l2[e]));
            float ds = p * (dp[n][x] - (e ? dl.y : dl.x));
            if (MASKED) {
                const int il = n * 8 + 2 * t + e;
                if (il < lo[x >> 1] || il >= (DOCS ? hr[x >> 1] : hi)) p = ds = 0.0f;
            }
            s[n][x] = p;
            dp[n][x] = ds;
        }
    }
    // FUSED: dS^T, rounded as the dK product's operand below, into the step's shared dS^T
    // tile for dQ (tb_store_ds).
    if (FUSED) tb_store_ds<F16>(ds_row, dp);
    // dV += P^T dO and dK += dS^T Q: A = P^T, dS^T (k-step kk = queries 16 kk ..: n-tiles
    // 2 kk, 2 kk + 1), B(k = i, n = d) = dO[i][d], Q[i][d]: output n-tiles 2p, 2p + 1 from one
    // ldmatrix.x4.trans each.
#pragma unroll
    for (int kk = 0; kk < 2; kk++) {
        if (!MASKED || (kk >= plo && kk < phi)) {
            u32 a[4];
            tc_c_to_a<F16>(a, s[2 * kk], s[2 * kk + 1]);
#pragma unroll
            for (int p = 0; p < MAXK; p++) {
                if (p < nk) {
                    u32 bg[4];
                    tc_ldsm_x4_trans(bg, gs_tr + (u32)(kk * 16 * ld + p * 16) * 2u);
                    tc_mma<F16>(dva[2 * p], a, bg[0], bg[1]);
                    tc_mma<F16>(dva[2 * p + 1], a, bg[2], bg[3]);
                }
            }
            tc_c_to_a<F16>(a, dp[2 * kk], dp[2 * kk + 1]);
#pragma unroll
            for (int p = 0; p < MAXK; p++) {
                if (p < nk) {
                    u32 bq[4];
                    tc_ldsm_x4_trans(bq, qs_tr + (u32)(kk * 16 * ld + p * 16) * 2u);
                    tc_mma<F16>(dka[2 * p], a, bq[0], bq[1]);
                    tc_mma<F16>(dka[2 * p + 1], a, bq[2], bq[3]);
                }
            }
        }
    }
}

// Issues the copies of query step c0 of head h: rows c0 .. c0 + 31 of Q and dO into the bf16
// tiles at shared addresses `qt`, `gt`, and lse, delta of those rows into `lst`, `dst` (threads
// 0 .. 31 and 32 .. 63, one value each); rows at or past Sq zero-filled. One commit group.
template <int MAXK>
__device__ __forceinline__ void tb_dkv_copy_step(u32 qt, u32 gt, u32 lst, u32 dst, const u16* q,
                                                 const u16* dout, const float* lse,
                                                 const float* delta, int b, int h, int c0,
                                                 int Sq, int H, int D, int ld,
                                                 long long qstride) {
    const long long qbase = (long long)b * Sq * qstride + (long long)h * D;
    tb_copy_rows<TB_QC, MAXK>(qt, gt, q + qbase, dout + qbase, qstride, c0, Sq, D, ld);
    const long long lbase = ((long long)b * H + h) * Sq;
    const int r = threadIdx.x & (TB_QC - 1);
    const bool in = c0 + r < Sq;
    const long long li = lbase + (in ? c0 + r : 0);
    if (threadIdx.x < TB_QC)
        tc_cp_async4(lst + 4u * r, lse + li, in ? 4 : 0);
    else if (threadIdx.x < 2 * TB_QC)
        tc_cp_async4(dst + 4u * r, delta + li, in ? 4 : 0);
    tc_cp_async_commit();
}

// Grid (B * Hkv, ceil(Sk / 64)), block 128; the CTA of blockIdx.y = y owns keys 64 y .. + 63 of
// (batch, KV head) blockIdx.x, warp w keys + 16 w .. + 15, and walks, for each query head of
// the group, the query steps of 32 rows that see its keys, from the last down (DOCS: up). DOCS: under a document mask (q_end [B, Sk], the "attention"
// module's contract: key j is seen by the queries below q_end[j] only) the walk ends at the
// step holding the last query that sees the CTA's last key (the ends are nondecreasing), a
// warp skips the steps past its last key's end, and masks per element a step that goes past
// its first key's.
template <int MAXK, bool FULL, bool KV_REGS, bool F16, bool DOCS, bool FUSED>
__device__ __forceinline__ void attn_bwd_dkv_tc_body(
    const u16* q, const u16* k, const u16* v, const u16* dout, const float* lse,
    const float* delta, float* dk, float* dv, int B, int Sq, int Sk, int H, int Hkv, int D,
    int causal, int q_start, int k_start, float scale, const int* q_end, float* dq,
    unsigned* turns) {
    static_assert(!FUSED || (MAXK == 4 && !DOCS), "the fused kernel is built for D <= 64");
    extern __shared__ __align__(16) unsigned char tb_smem[];
    if (FULL) D = 16 * MAXK;
    const int ld = D + TB_PAD;
    // Two stages of a step's lse and delta (32 fp32 each; stage s at byte 256 s: fixed
    // offsets, no register holds them), then the CTA's K and V tiles (64 rows each), then two
    // stages of a step's Q and dO tiles (32 rows each; stage s at qt0 + s * qstage). Byte
    // offsets 0, 512, 512 + 128 ld, 512 + 256 ld, 512 + 320 ld; 512 + 512 ld in all; FUSED:
    // then the step's dS^T tile (64 keys x TB_DS_LD bf16), 5120 bytes more.
    const float* lse_s0 = (const float*)tb_smem;
    const u32 lst0 = tc_smem_addr(tb_smem);
    const u32 kt = lst0 + 4u * 4 * TB_QC, vt = kt + (u32)(TB_BN * ld) * 2u;
    const u32 qstage = (u32)(2 * TB_QC * ld) * 2u;
    const u32 qt0 = kt + (u32)(2 * TB_BN * ld) * 2u, gt0 = qt0 + (u32)(TB_QC * ld) * 2u;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int b = blockIdx.x / Hkv, hk = blockIdx.x % Hkv, group = H / Hkv;
    const int jb = blockIdx.y; // key block 0 (seen by every query) first (e.)
    const int j0 = jb * TB_BN;
    const int nk = D >> 4, nd = D >> 3;
    const long long qstride = (long long)H * D, kstride = (long long)Hkv * D;
    const long long kbase = (long long)b * Sk * kstride + (long long)hk * D;
    const int jw = j0 + warp * 16; // the warp's first key; this thread's: jw + g, jw + g + 8
    const int jdiag = k_start + jw - q_start; // the first query (causal) that sees key jw
    const float sl2 = scale * TB_LOG2E;

    // The query steps: down to the step of 32 holding the first query that sees key j0
    // (q_start + i >= k_start + j0), for each head of the group.
    // Under a document mask they end at the last query that sees key j0 + 63 (or Sk - 1).
    int i0 = causal ? k_start + j0 - q_start : 0;
    i0 = i0 < 0 ? 0 : (i0 / TB_QC) * TB_QC;
    const long long krow = (long long)b * Sk;
    const int iend = DOCS ? min(Sq, q_end[krow + min(j0 + TB_BN - 1, Sk - 1)]) : Sq;
    const int nsteps = i0 < iend ? (iend - i0 + TB_QC - 1) / TB_QC : 0;
    const int total = group * nsteps;
    // The ends of the warp's first and last keys' queries (this thread's two keys' are read
    // where a step needs them: in registers for the whole loop they spill on sm_80).
    int qe_wmin = 0, qe_wmax = 0;
    if (DOCS && jw < Sk) {
        qe_wmin = q_end[krow + jw];
        qe_wmax = q_end[krow + min(jw + 15, Sk - 1)];
    }

    // The K and V tiles (read once per CTA) come in with cp.async too, one commit group, and
    // the first step's copies (stage 0) right behind them, a second group; none of it for a
    // CTA with no step (its dk and dv get += 0).
    if (total > 0) {
        tb_copy_rows<TB_BN, MAXK>(kt, vt, k + kbase, v + kbase, kstride, j0, Sk, D, ld);
        tc_cp_async_commit();
        tb_dkv_copy_step<MAXK>(qt0, gt0, lst0, lst0 + 4u * TB_QC, q, dout, lse, delta, b,
                               hk * group, tb_first_step<!DOCS>(i0, iend), Sq, H, D, ld,
                               qstride);
    }

    // ldmatrix row addresses of this lane (stage 0 for Q and dO; see the header).
    const int nt_row = ((lane >> 4) << 3) + (lane & 7), nt_col = ((lane >> 3) & 1) << 3;
    const int tr_row = (((lane >> 3) & 1) << 3) + (lane & 7), tr_col = (lane >> 4) << 3;
    const u32 ka_tr = kt + (u32)((warp * 16 + tr_row) * ld + tr_col) * 2u;
    const u32 va_tr = vt + (u32)((warp * 16 + tr_row) * ld + tr_col) * 2u;
    const u32 qs_nt = qt0 + (u32)(nt_row * ld + nt_col) * 2u;
    const u32 gs_nt = gt0 + (u32)(nt_row * ld + nt_col) * 2u;
    const u32 qs_tr = qt0 + (u32)(tr_row * ld + tr_col) * 2u;
    const u32 gs_tr = gt0 + (u32)(tr_row * ld + tr_col) * 2u;
    // FUSED: the dS^T tile after the Q and dO stages; this lane's word of it (key row
    // 16 w + g, queries 2t, 2t + 1), its "nt" address for dQ's A fragments (m-tile warp & 1)
    // and its "tr" address in the K tile for dQ's B fragments.
    const u32 dst0 = qt0 + 2 * qstage;
    u32* ds_row = (u32*)(tb_smem + (dst0 - lst0)) + (warp * 16 + g) * (TB_DS_LD / 2) + t;
    const u32 ds_nt = dst0 + (u32)(nt_row * TB_DS_LD + 16 * (warp & 1) + nt_col) * 2u;
    const u32 ks_tr = kt + (u32)(tr_row * ld + tr_col) * 2u;

    u32 kf[MAXK][4], vf[MAXK][4];
    if (KV_REGS) {
        // This thread's K and V copies have landed (the newest group, step 0's, may still
        // fly), then everyone's.
        tc_cp_async_wait<1>();
        __syncthreads();
#pragma unroll
        for (int kk = 0; kk < MAXK; kk++) {
            if (kk < nk) {
                tc_ldsm_x4(kf[kk], ka_tr + (u32)(kk * 16) * 2u);
                tc_ldsm_x4(vf[kk], va_tr + (u32)(kk * 16) * 2u);
            }
        }
    }

    float dka[2 * MAXK][4], dva[2 * MAXK][4];
#pragma unroll
    for (int n = 0; n < 2 * MAXK; n++) {
        dka[n][0] = dka[n][1] = dka[n][2] = dka[n][3] = 0.0f;
        dva[n][0] = dva[n][1] = dva[n][2] = dva[n][3] = 0.0f;
    }

    // The pipeline, one barrier a step (the forward kernel's): step it is in stage it & 1;
    // at the top of iteration it the only commit group in flight is step it's (at it = 0 also
    // the K and V tiles' where KV_REGS has not waited for them). After this thread's wait and
    // the barrier every thread's copies of step it (and of K and V) are visible to the CTA and
    // every warp is done with step it - 1, whose stage step it + 1's copies then take, in
    // flight while step it is computed. The loop and its barrier are CTA-uniform.
    int c0 = tb_first_step<!DOCS>(i0, iend); // the step being computed
    int gi = 0;                              // its head of the group
    int ngi = 0, nc0 = c0;                   // the step being copied
    int done = -1; // FUSED: the counter (index in turns) of the step this CTA last added into
    for (int it = 0; it < total; it++) {
        // Byte offsets of this step's stage (Q and dO tiles; lse and delta) and of the other.
        const bool odd = it & 1;
        const u32 qo = odd ? qstage : 0u, lo_ = odd ? 4u * 2 * TB_QC : 0u;
        tc_cp_async_wait<0>();
        __syncthreads();
        // FUSED: every thread's adds of the previous step are done (the barrier): count them.
        if (FUSED && done >= 0 && threadIdx.x == 0) tb_signal(turns + done);
        tb_next_step<!DOCS>(nc0, ngi, i0, iend);
        if (it + 1 < total) {
            const u32 nq = odd ? 0u : qstage, nl = odd ? 0u : 4u * 2 * TB_QC;
            tb_dkv_copy_step<MAXK>(qt0 + nq, gt0 + nq, lst0 + nl, lst0 + nl + 4u * TB_QC, q, dout,
                                   lse, delta, b, hk * group + ngi, nc0, Sq, H, D, ld, qstride);
        }
        const float* lse_s = (const float*)((const unsigned char*)lse_s0 + lo_);
        const float* del_s = lse_s + TB_QC;

        // What the warp's keys see of queries c0 .. c0 + 31 (warp-uniform): query il of the
        // step sees key jw + x iff il >= k_start + jw + x - q_start - c0 (causal) and
        // il < hi = Sq - c0, and jw + x < Sk.
        // Non-causal: every query below Sq sees every key below Sk (first = 0).
        // Under a document mask the step's queries from qe_wmax - c0 on see none of the
        // warp's keys, and those from qe_wmin - c0 on not all of them.
        const int hi = Sq - c0;
        const int first = causal ? jdiag - c0 : 0; // first query of key jw
        const int first_last = causal ? first + 15 : 0;              // ... of key jw + 15
        const int whi = DOCS ? min(hi, qe_wmax - c0) : hi;
        if (jw < Sk && first < min(whi, TB_QC)) {
            if (jw + 16 <= Sk && hi >= TB_QC && first_last <= 0 &&
                (!DOCS || qe_wmin - c0 >= TB_QC)) {
                const int none[2] = {0, 0};
                tb_dkv_step<MAXK, false, KV_REGS, F16, DOCS, FUSED>(
                    kf, vf, ka_tr, va_tr, qs_nt + qo, gs_nt + qo, qs_tr + qo, gs_tr + qo, lse_s,
                    del_s, dka, dva, ld, nk, sl2, 0, 2, none, TB_QC, none, t, ds_row);
            } else {
                int lo[2], hr[2] = {0, 0};
#pragma unroll
                for (int hf = 0; hf < 2; hf++) {
                    lo[hf] = jw + g + 8 * hf >= Sk ? TB_NONE : (causal ? first + g + 8 * hf : 0);
                    if (DOCS && jw + g + 8 * hf < Sk)
                        hr[hf] = min(hi, q_end[krow + jw + g + 8 * hf] - c0);
                }
                const int plo = first > 0 ? first >> 4 : 0;
                const int phi = (min(whi, TB_QC) + 15) >> 4;
                tb_dkv_step<MAXK, true, KV_REGS, F16, DOCS, FUSED>(
                    kf, vf, ka_tr, va_tr, qs_nt + qo, gs_nt + qo, qs_tr + qo, gs_tr + qo, lse_s,
                    del_s, dka, dva, ld, nk, sl2, plo, phi, lo, hi, hr, t, ds_row);
            }
        } else if (FUSED) {
            tb_zero_ds(ds_row);
        }
        if (FUSED) {
            // dQ's share of the step (design h.): every warp's dS^T is in the tile after the
            // barrier; the product; this CTA's turn among the key blocks adding into the
            // step, which each warp waits for on its own (its first lane; __syncwarp orders
            // the other lanes' loads after that lane's acquire), so that no warp waits for
            // another's product; the adds. The next step's dS^T is written, and the adds are
            // counted, after the next barrier, which follows every warp's adds.
            __syncthreads();
            float qa[MAXK / 2][2][4];
            tb_fused_dq<MAXK, F16>(qa, ds_nt, ks_tr, ld, nk, warp >> 1);
            const int h = hk * group + gi;
            // (The launcher checks that B H ceil(Sq / 32) counters fit an int.)
            const int turn = (b * H + h) * ((Sq + TB_QC - 1) / TB_QC) + c0 / TB_QC;
            if (lane == 0) tb_wait_turn(turns + turn, (unsigned)jb);
            __syncwarp();
            // Element x of n-tile n of pair i: query c0 + 16 (warp & 1) + g + 8 (x >> 1),
            // column 16 p + 8 n + 2t + (x & 1). L2 only (.cg): another CTA wrote them last,
            // and no SM's L1 keeps a copy.
#pragma unroll
            for (int hf = 0; hf < 2; hf++) {
                const int i = c0 + 16 * (warp & 1) + g + 8 * hf;
                if (i < Sq) {
                    float* row = dq + ((long long)b * Sq + i) * qstride + (long long)h * D + 2 * t;
#pragma unroll
                    for (int x = 0; x < MAXK / 2; x++) {
                        const int p = (warp >> 1) + 2 * x;
                        if (p < nk) {
#pragma unroll
                            for (int n = 0; n < 2; n++) {
                                float2* a = (float2*)(row + 16 * p + 8 * n);
                                float2 y = __ldcg(a);
                                y.x = fmaf(scale, qa[x][n][2 * hf], y.x);
                                y.y = fmaf(scale, qa[x][n][2 * hf + 1], y.y);
                                __stcg(a, y);
                            }
                        }
                    }
                }
            }
            done = turn;
        }
        tb_next_step<!DOCS>(c0, gi, i0, iend);
    }
    if (FUSED && done >= 0) {
        __syncthreads();
        if (threadIdx.x == 0) tb_signal(turns + done);
    }

    // (b, hk) from blockIdx again: nothing 64-bit stays live across the loop for the stores.
    const long long obase = ((long long)(blockIdx.x / Hkv) * Sk * Hkv + blockIdx.x % Hkv) * D;
#pragma unroll
    for (int hf = 0; hf < 2; hf++) {
        const int j = jw + g + 8 * hf;
        if (j < Sk) {
            const long long off = obase + (long long)j * Hkv * D + 2 * t;
#pragma unroll
            for (int n = 0; n < 2 * MAXK; n++) {
                if (n < nd) {
                    float2 x = *(float2*)(dk + off + n * 8);
                    x.x += scale * dka[n][2 * hf];
                    x.y += scale * dka[n][2 * hf + 1];
                    *(float2*)(dk + off + n * 8) = x;
                    float2 y = *(float2*)(dv + off + n * 8);
                    y.x += dva[n][2 * hf];
                    y.y += dva[n][2 * hf + 1];
                    *(float2*)(dv + off + n * 8) = y;
                }
            }
        }
    }
}

// M-tiles of 16 query rows a dQ warp owns (the CTA's 4 warps own 64 MT rows): at D <= 64 1 (the
// _k4 kernels) or 2 (the _m2_k4 ones), as for the forward; at D = 128 always 1.

// Blocks an SM each kernel is compiled for (__launch_bounds__' second argument: the register
// cap is 64K / (128 x blocks)); see the ptxas figures in the header (dQ at D <= 64 with two
// m-tiles a warp: 2 blocks, a cap of 255). The library builds these
// defaults; to measure another choice, a #define before the source (e.g.
// `#define TB_DQ_K4_MIN_BLOCKS 4` after the prelude, compiling the module by hand with NVRTC)
// overrides each.
#ifndef TB_DQ_K4_MIN_BLOCKS
#define TB_DQ_K4_MIN_BLOCKS 3
#endif
#ifndef TB_DQ_M2_K4_MIN_BLOCKS
#define TB_DQ_M2_K4_MIN_BLOCKS 2
#endif
#ifndef TB_DQ_K8_MIN_BLOCKS
#define TB_DQ_K8_MIN_BLOCKS 2
#endif
#ifndef TB_DKV_K4_MIN_BLOCKS
#define TB_DKV_K4_MIN_BLOCKS 3
#endif
#ifndef TB_DKV_K8_MIN_BLOCKS
#define TB_DKV_K8_MIN_BLOCKS 2
#endif

// Every kernel takes the document mask's two arrays (the "attention" module's key_lo, q_end);
// only the _docs kernels read them (dQ key_lo, dK/dV q_end), and the others, which may be
// passed nulls, are the same code as without the parameters.
#define TB_DQ_KERNEL(NAME, MAXK, MT, MIN_BLOCKS, F16, DOCS)                                     \
    extern "C" __global__ void __launch_bounds__(TB_THREADS, MIN_BLOCKS)                        \
        NAME(const u16* q, const u16* k, const u16* v, const u16* dout, const float* lse,       \
             const float* delta, float* dq, int B, int Sq, int Sk, int H, int Hkv, int D,       \
             int causal, int q_start, int k_start, float scale, const int* key_lo,              \
             const int* q_end) {                                                                \
        if (D == 16 * MAXK)                                                                     \
            attn_bwd_dq_tc_body<MAXK, MT, true, F16, DOCS>(q, k, v, dout, lse, delta, dq, B,    \
                                                           Sq, Sk, H, Hkv, D, causal, q_start,  \
                                                           k_start, scale, key_lo);             \
        else                                                                                    \
            attn_bwd_dq_tc_body<MAXK, MT, false, F16, DOCS>(q, k, v, dout, lse, delta, dq, B,   \
                                                            Sq, Sk, H, Hkv, D, causal, q_start, \
                                                            k_start, scale, key_lo);            \
    }
#define TB_DKV_KERNEL(NAME, MAXK, MIN_BLOCKS, KV_REGS, F16, DOCS)                               \
    extern "C" __global__ void __launch_bounds__(TB_THREADS, MIN_BLOCKS)                        \
        NAME(const u16* q, const u16* k, const u16* v, const u16* dout, const float* lse,       \
             const float* delta, float* dk, float* dv, int B, int Sq, int Sk, int H, int Hkv,   \
             int D, int causal, int q_start, int k_start, float scale, const int* key_lo,       \
             const int* q_end) {                                                                \
        if (D == 16 * MAXK)                                                                     \
            attn_bwd_dkv_tc_body<MAXK, true, KV_REGS, F16, DOCS, false>(                        \
                q, k, v, dout, lse, delta, dk, dv, B, Sq, Sk, H, Hkv, D, causal, q_start,       \
                k_start, scale, q_end, nullptr, nullptr);                                       \
        else                                                                                    \
            attn_bwd_dkv_tc_body<MAXK, false, KV_REGS, F16, DOCS, false>(                       \
                q, k, v, dout, lse, delta, dk, dv, B, Sq, Sk, H, Hkv, D, causal, q_start,       \
                k_start, scale, q_end, nullptr, nullptr);                                       \
    }

// bf16 operands (bf16 steps), and fp16 (fp16 steps); plain causal, and under a document mask;
// dQ at D <= 64 with one m-tile a warp (_k4) and two (_m2_k4).
#define TB_DQ_K4 4, 1, TB_DQ_K4_MIN_BLOCKS
#define TB_DQ_M2_K4 4, 2, TB_DQ_M2_K4_MIN_BLOCKS
#define TB_DQ_K8 8, 1, TB_DQ_K8_MIN_BLOCKS
#define TB_DKV_K4 4, TB_DKV_K4_MIN_BLOCKS, (TB_DKV_KV_REGS_K4 != 0)
#define TB_DKV_K8 8, TB_DKV_K8_MIN_BLOCKS, (TB_DKV_KV_REGS_K8 != 0)
// TB_DQ_KERNEL_ and TB_DKV_KERNEL_ expand a tiling's commas into the macro's arguments.
#define TB_DQ_KERNEL_(...) TB_DQ_KERNEL(__VA_ARGS__)
#define TB_DKV_KERNEL_(...) TB_DKV_KERNEL(__VA_ARGS__)
TB_DQ_KERNEL_(attn_bwd_dq_tc_k4, TB_DQ_K4, false, false)
TB_DQ_KERNEL_(attn_bwd_dq_tc_m2_k4, TB_DQ_M2_K4, false, false)
TB_DQ_KERNEL_(attn_bwd_dq_tc_k8, TB_DQ_K8, false, false)
TB_DQ_KERNEL_(attn_bwd_dq_tc_f16_k4, TB_DQ_K4, true, false)
TB_DQ_KERNEL_(attn_bwd_dq_tc_f16_m2_k4, TB_DQ_M2_K4, true, false)
TB_DQ_KERNEL_(attn_bwd_dq_tc_f16_k8, TB_DQ_K8, true, false)
TB_DQ_KERNEL_(attn_bwd_dq_tc_docs_k4, TB_DQ_K4, false, true)
TB_DQ_KERNEL_(attn_bwd_dq_tc_docs_m2_k4, TB_DQ_M2_K4, false, true)
TB_DQ_KERNEL_(attn_bwd_dq_tc_docs_k8, TB_DQ_K8, false, true)
TB_DQ_KERNEL_(attn_bwd_dq_tc_docs_f16_k4, TB_DQ_K4, true, true)
TB_DQ_KERNEL_(attn_bwd_dq_tc_docs_f16_m2_k4, TB_DQ_M2_K4, true, true)
TB_DQ_KERNEL_(attn_bwd_dq_tc_docs_f16_k8, TB_DQ_K8, true, true)
TB_DKV_KERNEL_(attn_bwd_dkv_tc_k4, TB_DKV_K4, false, false)
TB_DKV_KERNEL_(attn_bwd_dkv_tc_k8, TB_DKV_K8, false, false)
TB_DKV_KERNEL_(attn_bwd_dkv_tc_f16_k4, TB_DKV_K4, true, false)
TB_DKV_KERNEL_(attn_bwd_dkv_tc_f16_k8, TB_DKV_K8, true, false)
TB_DKV_KERNEL_(attn_bwd_dkv_tc_docs_k4, TB_DKV_K4, false, true)
TB_DKV_KERNEL_(attn_bwd_dkv_tc_docs_k8, TB_DKV_K8, false, true)
TB_DKV_KERNEL_(attn_bwd_dkv_tc_docs_f16_k4, TB_DKV_K4, true, true)
TB_DKV_KERNEL_(attn_bwd_dkv_tc_docs_f16_k8, TB_DKV_K8, true, true)

// The fused backward at D <= 64 (design h.), without a document mask: dK, dV and dQ from one
// kernel; `turns` [B, H, ceil(Sq / 32)] zeroed before the launch (the adds into each query
// step counted), dq accumulated (+=) like dk and dv; the trailing key_lo, q_end unread (the
// arguments of every kernel of the module).
#define TB_FUSED_KERNEL(NAME, F16)                                                              \
    extern "C" __global__ void __launch_bounds__(TB_THREADS, TB_FUSED_K4_MIN_BLOCKS)            \
        NAME(const u16* q, const u16* k, const u16* v, const u16* dout, const float* lse,       \
             const float* delta, float* dq, float* dk, float* dv, unsigned* turns, int B,       \
             int Sq, int Sk, int H, int Hkv, int D, int causal, int q_start, int k_start,       \
             float scale, const int* key_lo, const int* q_end) {                                \
        if (D == 64)                                                                            \
            attn_bwd_dkv_tc_body<4, true, (TB_DKV_KV_REGS_K4 != 0), F16, false, true>(          \
                q, k, v, dout, lse, delta, dk, dv, B, Sq, Sk, H, Hkv, D, causal, q_start,       \
                k_start, scale, nullptr, dq, turns);                                            \
        else                                                                                    \
            attn_bwd_dkv_tc_body<4, false, (TB_DKV_KV_REGS_K4 != 0), F16, false, true>(         \
                q, k, v, dout, lse, delta, dk, dv, B, Sq, Sk, H, Hkv, D, causal, q_start,       \
                k_start, scale, nullptr, dq, turns);                                            \
    }
#ifndef TB_FUSED_K4_MIN_BLOCKS
#define TB_FUSED_K4_MIN_BLOCKS 3
#endif
TB_FUSED_KERNEL(attn_bwd_fused_tc_k4, false)
TB_FUSED_KERNEL(attn_bwd_fused_tc_f16_k4, true)
