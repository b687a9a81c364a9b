"""Lane-level emulation of the library's tensor-core attention forward,
crates/tensor/src/cuda/kernels/attention_tc.cu (module "attention_tc"), in both of its operand
formats: bf16 (attn_fwd_tc_k4 / _k8, F16 = false) and fp16 (attn_fwd_tc_f16_k4 / _k8,
F16 = true), and their _docs twins under a document mask (DOCS: emu_common.DOC_CASES, key_lo
made as tensor::cuda::doc_mask::bounds makes it), to check its indexing, fragments and masks
where no GPU is at hand:
`python3 dev/attention/attention_tc_emu.py` (numpy; about 15 seconds) runs every case in bf16,
then in fp16, prints each case's errors (the format first) and a summary per format, and exits
1 on a mismatch.

A transliteration of attn_fwd_tc_body<MAXK, MT, FULL, F16, DOCS> (keep it in step when the
kernel changes), run at D <= 64 with both choices of m-tiles a warp (MT: 1, the _k4 kernels,
and 2, the _m2_k4 ones; the reference's rounding of P follows the kernel's steps of 64 / MT
keys), in the
manner of attention_tc_bwd_emu.py (the backward's, attention_tc_bwd.cu), on the primitives of emu_common.py, the operand format an emu_common.Format (BF16 or FP16) passed
down to where the kernel's F16 acts, tn_pack and tn_mma: each warp is 32 lanes as numpy
vectors, the 128 threads of a CTA one vector where all of them act (the copies), shared memory
one byte buffer laid out as the kernel lays it out (two stages of a 16-bit K and V tile with
row stride D + 8), filled with NaN first (0xFF bytes: a NaN in bf16 and in fp16) so that a read
of anything the kernel did not write, a padding column or a stale row, poisons the result
instead of slipping through as a small number; ldmatrix (.x4, .trans) and mma.m16n8k16 as the
PTX ISA's fragment layouts say (the 16-bit halves decoded as bf16, or as fp16, subnormals
included), rounding to the format as cvt.rn.bf16x2.f32 / cvt.rn.f16x2.f32 (nearest even, fp16
subnormals kept, a NaN the canonical one), ex2.approx as exact 2^x with flush to zero. Q, K, V
come in as the format's bits (u16), the cases' fp32 inputs rounded once (nearest even) before
the kernel, as the caller does. cp.async is modelled with its commit groups and wait_group, and
every case runs twice: with each copy landing when issued and with each landing at the wait
that covers it (the two extremes the PTX ISA allows; both must give the same bits); the
barriers bound phases in which no shared word may be both read and copied to, nor read while a
copy to it flies or before the barrier after its wait (emu_common.Smem). src-size 0 zero-fills.
The grid's CTAs run one after the other in the order of their linear index (blockIdx.x, the
(batch, head), fastest; so the reversed row order is exercised), each with fresh garbage shared memory; every element of out and lse must be written
exactly once. Not covered: the hardware beyond those PTX rules, the asm's syntax (the NVRTC
compile check), timing, register pressure.

The reference is dense float64 softmax attention with Q, K, V rounded to the format and
(ROUND_P) the unnormalised P rounded to it before P V, divided by the row sum of the unrounded
P (as the kernel sums its fp32 p); lse natural log, -inf (and out 0) for a row that sees no key;
under a document mask the CPU kernel's rule on the documents' starts (not the kernel's key_lo).
"""
import sys
import time
import numpy as np

from emu_common import (DOC_CASES, FORMATS, G, T, CpAsync, Pieces, Smem, doc_bounds, doc_starts,
                        exp2, fmaf, inputs, keys_seen, lane, ld_u32, ldsm_x4, mma, softmax_rows)

LOG2E = np.float32(1.4426950408889634)
LN2 = np.float32(0.6931471805599453)
NEG_INF = np.float32(-np.inf)
ROUND_P = "tile"  # how the reference rounds the unnormalised P to the format before P V (see
# TOL): "tile": exp(S - m_t), m_t the row's maximum over the 64-key tiles up to that key's (the
# kernel's running maximum when it rounds that tile), times exp(m_t - m); True: exp(S - m), m
# the row's maximum; False: not rounded.
# out: max |x - ref| / max |ref|, by format.
TOL = {"tile": {"bf16": 1e-3, "fp16": 1e-3}, True: {"bf16": 4e-3, "fp16": 5e-4},
       False: {"bf16": 5e-3, "fp16": 6.25e-4}}[ROUND_P]
# "tile": ~1e-7, except where S (fp32 sums against fp64) puts one p on the other side of a
# rounding boundary of the format: that row of out then moves by ulp(p) / l |v_j|, at most
# 2^-7 (p / l) |v_j| in bf16 (8 significant bits), 2^-10 (p / l) |v_j| in fp16 (11; a p under
# 2^-14, an fp16 subnormal, by 2^-24 / l |v_j| at most); an extra or missing key, a wrong
# rescale or a wrong index moves rows by (p / l) |v_j| and more, 128 (bf16) or 1024 (fp16)
# times that. bf16: measured up to 1.5e-4 over the cases below (5e-5 typically).
# fp16: a boundary is 8 times as likely to fall between the kernel's p and the reference's (a
# ~1e-7 relative difference against half an ulp of 2^-11, not 2^-8) and a crossing moves the
# row 8 times less: count times size is the same, so the flips do not shrink with the ulp.
# Measured up to 1.3e-4 (B1 Sq129 Sk129 D128 nc: one p = 0.5783692, 8e-8 (relative) above the
# midpoint of its fp16 neighbours, 2.9e-7 lower in the kernel: 2^-11 * |v_j| 2.52 / l 14.79 =
# 8.3e-5, of max |out| 0.66), which bf16's TOL / 8 = 1.25e-4 would not hold. 1e-3 holds any
# single flip: the largest move one fp16 flip can make in these cases (2^-10 (p / l) |v_j| over
# the p that are no fp16 value) is 2.5e-4 .. 5.5e-4 of max |out| by case, so even two in one
# element stay under it, and a wrong key still moves a row 1024 flips' worth (in bf16 that largest
# flip is 2.0e-3 .. 4.4e-3: its TOL holds the measured flips, not every possible one).
# True: where a row's running maximum grows in a later tile the kernel rounded the earlier
# tiles' p against the smaller maximum and rescaled them after (corr = 2^(m2_old - m2_new),
# no power of two), so each such p can land on the other neighbour of the reference's (up to
# 2^-8 relative per term in bf16, 2^-11 in fp16, random signs over the row): measured up to
# 1.5e-3 (bf16), 2.4e-4 (fp16) here; the fp16 TOL is bf16's times 2^-3, like the error.
# False: every p differs by its rounding (2^-9 relative in bf16, 2^-12 in fp16): measured up to
# 1.7e-3 (bf16), 2.2e-4 (fp16); the fp16 TOL is bf16's times 2^-3.
LSE_TOL = 1e-4  # lse: max |x - ref| over the rows that see a key (fp32 sums of |lse| <~ 10:
# ~1e-6, measured up to 6.8e-7 in both formats; the rounding of P, bf16 or fp16, does not enter
# l); -inf rows must be -inf exactly.
BN = 64
PAD = 8


def fmul_rn(a, b):
    with np.errstate(invalid="ignore", over="ignore"):
        return (np.asarray(a, dtype=np.float32) * np.float32(b)).astype(np.float32)


def shfl_xor(x, m):
    return x[lane ^ m]


def copy_tile(cp, kt, vt, kb, vb, k, v, kstride, j0, Sk, D, ld, MAXK, pc):
    """tn_copy_tile<MAXK>: K and V rows j0 .. j0 + 63 (`kb`, `vb`: element offsets of row 0 of
    the head in the bf16 arrays k, v) into the tiles at byte offsets kt, vt."""
    r, c = pc.r.copy(), pc.c.copy()
    seen = np.zeros((BN, D // 8), dtype=int)
    for i in range(MAXK):
        if i < (D >> 4):
            row = j0 + r
            inn = row < Sk
            off = np.where(inn, row * kstride, 0) + 8 * c
            # A row past the end reads nothing; its address stays inside row 0 of the head.
            assert np.all(np.where(inn, True, (off >= 0) & (off + 8 <= D)))
            assert np.all(r < BN) and np.all(8 * c + 8 <= D)  # never a padding column
            np.add.at(seen, (r, c), 1)
            so = (r * ld + 8 * c) * 2
            cp.copy(kt + so, k, kb + off, inn, 16, (kt, kt + BN * ld * 2))
            cp.copy(vt + so, v, vb + off, inn, 16, (vt, vt + BN * ld * 2))
            r, c = pc.advance(r, c)
    assert np.all(seen == 1), "the copies do not cover the tile exactly once"


def tn_step(sm, W, ks_lane, vs_lane, kreg, vreg, ld, nk, MAXK, MT, sl2, kv_lim, vis, masked,
            fmt, c0, lo=None):
    """tn_step<MAXK, MT, MASKED, F16, DOCS> for one warp (W: its registers, lanes as vectors,
    indexed [mt] by m-tile; fmt: the operand format, emu_common.BF16 or FP16; lo: the rows'
    first keys under a document mask, DOCS, else None): keys c0 .. c0 + 64 / MT - 1 of the
    tile; kreg, vreg: the byte ranges of the stage's K and V tiles, which its ldmatrix rows must
    lie in."""
    qf, o, m, l = W["qf"], W["o"], W["m"], W["l"]
    KC = BN // MT
    NT = KC // 8
    # S = Q K^T (16 MT rows x KC keys): n-tiles 2p, 2p + 1 from one ldmatrix.x4 per k-step,
    # for every m-tile.
    s = [[[np.zeros(32, np.float32) for _ in range(4)] for _ in range(NT)] for _ in range(MT)]
    for kk in range(MAXK):
        if kk < nk:
            for p in range(NT // 2):
                if not masked or c0 + 16 * p < kv_lim:
                    bk = ldsm_x4(sm, ks_lane + ((c0 + 16 * p) * ld + kk * 16) * 2, region=kreg)
                    for mt in range(MT):
                        mma(s[mt][2 * p], qf[mt][kk], bk[0], bk[1], fmt)
                        mma(s[mt][2 * p + 1], qf[mt][kk], bk[2], bk[3], fmt)
    # Online softmax, row r0 + 16 mt + 8 hf: s[mt][n][2 hf], s[mt][n][2 hf + 1].
    for mt in range(MT):
        for hf in range(2):
            mx = m[mt][hf].copy()
            for n in range(NT):
                for e in range(2):
                    if masked:
                        c = c0 + n * 8 + 2 * T + e
                        cut = (c >= vis[mt][hf]) | ((c < lo[mt][hf]) if lo is not None else False)
                        s[mt][n][2 * hf + e] = np.where(cut, NEG_INF,
                                                        s[mt][n][2 * hf + e]).astype(np.float32)
                    mx = np.fmax(mx, s[mt][n][2 * hf + e])
            mx = np.fmax(mx, shfl_xor(mx, 1))
            mx = np.fmax(mx, shfl_xor(mx, 2))
            m2 = np.where(mx == NEG_INF, np.float32(0), fmul_rn(mx, sl2)).astype(np.float32)
            with np.errstate(invalid="ignore"):
                corr = exp2((fmul_rn(m[mt][hf], sl2) - m2).astype(np.float32))
            m[mt][hf] = mx
            sm_ = np.zeros(32, np.float32)
            for n in range(NT):
                for e in range(2):
                    p_ = exp2(fmaf(s[mt][n][2 * hf + e], sl2, -m2))
                    s[mt][n][2 * hf + e] = p_
                    sm_ = (sm_ + p_).astype(np.float32)
            # l * corr + sum: contracted to one FFMA by nvcc's default -fmad=true.
            l[mt][hf] = fmaf(l[mt][hf], corr, sm_)
            for n in range(2 * MAXK):
                o[mt][n][2 * hf] = (o[mt][n][2 * hf] * corr).astype(np.float32)
                o[mt][n][2 * hf + 1] = (o[mt][n][2 * hf + 1] * corr).astype(np.float32)
    # O += P V: A = P (k-step kk = keys c0 + 16 kk ..), B from ldmatrix.x4.trans, for every
    # m-tile.
    for kk in range(NT // 2):
        if not masked or c0 + 16 * kk < kv_lim:
            pack = fmt.pack
            a = [[pack(s[mt][2 * kk][0], s[mt][2 * kk][1]),
                  pack(s[mt][2 * kk][2], s[mt][2 * kk][3]),
                  pack(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]),
                  pack(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3])] for mt in range(MT)]
            for p in range(MAXK):
                if p < nk:
                    bv = ldsm_x4(sm, vs_lane + ((c0 + 16 * kk) * ld + p * 16) * 2, trans=True,
                                 region=vreg)
                    for mt in range(MT):
                        mma(o[mt][2 * p], a[mt], bv[0], bv[1], fmt)
                        mma(o[mt][2 * p + 1], a[mt], bv[2], bv[3], fmt)


def tn_tile(sm, W, ks_lane, vs_lane, kreg, vreg, ld, nk, MAXK, MT, sl2, kv_lim, vis, masked,
            fmt, lo=None):
    """tn_tile<MAXK, MT, MASKED, F16, DOCS>: the tile's keys in MT steps of 64 / MT."""
    for c0 in range(0, BN, BN // MT):
        if masked and c0 >= kv_lim:
            break
        tn_step(sm, W, ks_lane, vs_lane, kreg, vreg, ld, nk, MAXK, MT, sl2, kv_lim, vis, masked,
                fmt, c0, lo)


def body(q, k, v, out, lse, wr_out, wr_lse, B, Sq, Sk, H, Hkv, D, causal, q_start, k_start,
         scale, MAXK, MT, FULL, gy, bx, by, late, fmt, key_lo=None):
    """attn_fwd_tc_body<MAXK, MT, FULL, F16, DOCS> for the CTA (bx, by) of a grid (B * H, gy); q,
    k, v the bits (u16) of the operand format `fmt` (F16: fmt is FP16); key_lo the document
    mask's first keys ([B * Sq] int, DOCS) or None."""
    DOCS = key_lo is not None
    if FULL:
        D = 16 * MAXK
    ld = D + PAD
    nbytes = 512 * (D + 8)
    stage = 2 * BN * ld * 2  # byte offsets in the dynamic shared memory
    kt0, vt0 = 0, BN * ld * 2
    assert 2 * stage == nbytes and vt0 % 16 == 0 and stage % 16 == 0
    sm = Smem(nbytes, 0xFF)  # garbage: 0xFFFF is a NaN in bf16 and in fp16
    cp = CpAsync(sm, late)
    b, h = bx // H, bx % H
    hk = h // (H // Hkv)
    bm = 16 * MT * 4  # query rows of the CTA
    q0 = (gy - 1 - by) * bm  # longest rows first
    nk, nd = D >> 4, D >> 3
    qstride, kstride = H * D, Hkv * D
    qb = b * Sq * qstride + h * D
    kb = b * Sk * kstride + hk * D
    vb = b * Sk * kstride + hk * D
    sl2 = np.float32(np.float32(scale) * LOG2E)

    nvis = keys_seen(min(q0 + bm, Sq), Sk, causal, q_start, k_start)
    ntiles = (nvis + BN - 1) // BN
    lrow = b * Sq
    jt0 = int(key_lo[lrow + q0]) // BN if DOCS else 0
    pc = Pieces(D)

    if jt0 < ntiles:
        copy_tile(cp, kt0, vt0, kb, vb, k, v, kstride, jt0 * BN, Sk, D, ld, MAXK, pc)
        cp.commit()

    warps = []
    for warp in range(4):
        iw = q0 + warp * 16 * MT
        wlast = iw + 16 * MT - 1
        r0 = iw + G
        qf = []
        for mt in range(MT):
            # Q's A fragments (rows r0 + 16 mt, + 8; zeros past Sq), 32-bit loads of two
            # elements.
            ra = r0 + 16 * mt
            pa = qb + ra * qstride + 2 * T
            pb = qb + (ra + 8) * qstride + 2 * T
            oka, okb = ra < Sq, ra + 8 < Sq

            def ld2(ok, ptr):
                assert np.all(np.where(ok, (ptr - qb) % qstride + 2 <= D, True))
                return ld_u32(q, ptr, ok)

            f = [None] * MAXK
            for kk in range(MAXK):
                if kk < nk:
                    f[kk] = [ld2(oka, pa + kk * 16), ld2(okb, pb + kk * 16),
                             ld2(oka, pa + kk * 16 + 8), ld2(okb, pb + kk * 16 + 8)]
            qf.append(f)
        wfull = wkeys = wlo_min = wlo_max = 0
        if iw < Sq:
            wkeys = keys_seen(min(wlast + 1, Sq), Sk, causal, q_start, k_start)
            wfull = keys_seen(iw + 1, Sk, causal, q_start, k_start)
            if DOCS:
                wlo_min = int(key_lo[lrow + iw])
                wlo_max = int(key_lo[lrow + min(wlast, Sq - 1)])
        rows = [[r0 + 16 * mt + 8 * hf for hf in range(2)] for mt in range(MT)]
        vis_row = [[np.array([keys_seen(int(x) + 1, Sk, causal, q_start, k_start) for x in i])
                    for i in rr] for rr in rows]
        lo_row = [[np.array([int(key_lo[lrow + x]) if DOCS and x < Sq else 0 for x in i])
                   for i in rr] for rr in rows]
        warps.append(dict(iw=iw, r0=r0, qf=qf, wfull=wfull, wkeys=wkeys, vis_row=vis_row,
                          wlo_min=wlo_min, wlo_max=wlo_max, lo_row=lo_row,
                          o=[[[np.zeros(32, np.float32) for _ in range(4)]
                              for _ in range(2 * MAXK)] for _ in range(MT)],
                          m=[[np.full(32, NEG_INF), np.full(32, NEG_INF)] for _ in range(MT)],
                          l=[[np.zeros(32, np.float32), np.zeros(32, np.float32)]
                             for _ in range(MT)]))

    # ldmatrix row addresses of this lane in stage 0 (k-step 0, n-tile pair 0).
    krow, kcol = ((lane >> 4) << 3) + (lane & 7), ((lane >> 3) & 1) << 3
    vrow, vcol = (((lane >> 3) & 1) << 3) + (lane & 7), (lane >> 4) << 3
    ks_lane = kt0 + (krow * ld + kcol) * 2
    vs_lane = vt0 + (vrow * ld + vcol) * 2

    for it, jt in enumerate(range(jt0, ntiles)):
        j0 = jt * BN
        cur = (it & 1) * stage
        cp.wait(0)
        sm.barrier()
        if jt + 1 < ntiles:
            nxt = stage - cur  # the other stage
            copy_tile(cp, kt0 + nxt, vt0 + nxt, kb, vb, k, v, kstride, j0 + BN, Sk, D, ld, MAXK,
                      pc)
            cp.commit()
        kreg = (kt0 + cur, kt0 + cur + BN * ld * 2)
        vreg = (vt0 + cur, vt0 + cur + BN * ld * 2)
        for W in warps:
            if j0 + BN <= W["wfull"] and (not DOCS or j0 >= W["wlo_max"]):
                tn_tile(sm, W, ks_lane + cur, vs_lane + cur, kreg, vreg, ld, nk, MAXK, MT, sl2,
                        BN, None, False, fmt)
            elif j0 < W["wkeys"] and (not DOCS or j0 + BN > W["wlo_min"]):
                vis = [[x - j0 for x in v_] for v_ in W["vis_row"]]
                lo = [[x - j0 for x in v_] for v_ in W["lo_row"]] if DOCS else None
                tn_tile(sm, W, ks_lane + cur, vs_lane + cur, kreg, vreg, ld, nk, MAXK, MT, sl2,
                        W["wkeys"] - j0, vis, True, fmt, lo)
    assert cp.idle(), "cp.async left in flight at the end of the CTA"

    ob = b * Sq * qstride + h * D
    for W in warps:
        for mt in range(MT):
            for hf in range(2):
                sum_ = W["l"][mt][hf]
                sum_ = (sum_ + shfl_xor(sum_, 1)).astype(np.float32)
                sum_ = (sum_ + shfl_xor(sum_, 2)).astype(np.float32)
                i = W["r0"] + 16 * mt + 8 * hf
                ok = i < Sq
                with np.errstate(divide="ignore"):
                    inv = np.where(sum_ > 0, np.float32(1) / sum_,
                                   np.float32(0)).astype(np.float32)
                orow = ob + np.where(ok, i, 0) * qstride + 2 * T
                for n in range(2 * MAXK):
                    if n < nd:
                        for e in range(2):
                            idx = (orow + n * 8 + e)[ok]
                            with np.errstate(invalid="ignore"):
                                out[idx] = (W["o"][mt][n][2 * hf + e] * inv).astype(
                                    np.float32)[ok]
                            np.add.at(wr_out, idx, 1)
                with np.errstate(divide="ignore", invalid="ignore"):
                    val = np.where(sum_ > 0, ((fmul_rn(W["m"][mt][hf], sl2)
                                               + np.log2(sum_.astype(np.float64)).astype(
                                                   np.float32)) * LN2).astype(np.float32),
                                   NEG_INF)
                w = ok & (T == 0)
                li = ((b * H + h) * Sq + i)[w]
                lse[li] = val[w]
                np.add.at(wr_lse, li, 1)


def kernel(q, k, v, out, lse, B, Sq, Sk, H, Hkv, D, causal, q_start, k_start, scale, MAXK,
           MT, late, fmt, key_lo=None):
    """TN_KERNEL: attn_fwd_tc_k<MAXK> (fmt BF16) or attn_fwd_tc_f16_k<MAXK> (fmt FP16), or
    with a document mask's first keys `key_lo` their _docs twins, over the whole grid
    (ceil(Sq / 64), B H); q, k, v the bits (u16) of `fmt`; `late`: the cp.async landing policy
    (CpAsync)."""
    assert D % 16 == 0 and 16 <= D <= 16 * MAXK
    wr_out = np.zeros(out.size, dtype=int)
    wr_lse = np.zeros(lse.size, dtype=int)
    bm = 64 * MT
    gy = (Sq + bm - 1) // bm
    for by in range(gy):
        for bx in range(B * H):
            body(q, k, v, out, lse, wr_out, wr_lse, B, Sq, Sk, H, Hkv, D, causal, q_start,
                 k_start, scale, MAXK, MT, D == 16 * MAXK, gy, bx, by, late, fmt, key_lo)
    assert np.all(wr_out == 1), "out: elements written other than once"
    assert np.all(wr_lse == 1), "lse: elements written other than once"


def reference(q, k, v, B, Sq, Sk, H, Hkv, D, causal, q_start, k_start, scale, fmt,
              doc_start=None, kc=BN):
    """fp64 attention on Q, K, V rounded to the operand format `fmt`; (ROUND_P) P rounded to
    `fmt` before P V, divided by the row sum of the unrounded P; under a document mask
    (`doc_start`, [B, Sq]: the CPU kernel's rule, key j seen iff doc_start <= k_start + j);
    `kc`: the keys of the kernel's softmax steps (64 / MT)."""
    rb = lambda x: fmt.round(x.astype(np.float32)).astype(np.float64)
    q4 = rb(q).reshape(B, Sq, H, D)
    k4 = rb(k).reshape(B, Sk, Hkv, D)
    v4 = rb(v).reshape(B, Sk, Hkv, D)
    i = np.arange(Sq)[:, None]
    j = np.arange(Sk)[None, :]
    vis = (k_start + j <= q_start + i) if causal else np.ones((Sq, Sk), bool)
    lse = np.full((B, H, Sq), -np.inf)
    out = np.zeros((B, Sq, H, D))
    for bb in range(B):
        for h in range(H):
            hk = h // (H // Hkv)
            S = q4[bb, :, h] @ k4[bb, :, hk].T * scale
            seen = vis if doc_start is None else vis & (doc_start[bb][:, None] <= k_start + j)
            S = np.where(seen, S, -np.inf)
            mm, e, l, lse[bb, h] = softmax_rows(S)
            if ROUND_P == "tile":
                # The maximum the row has seen by the end of each step of kc keys: the kernel's
                # running maximum when it rounds that step's p.
                nt = (Sk + kc - 1) // kc
                tm = np.stack([S[:, kc * t:kc * (t + 1)].max(axis=1) for t in range(nt)], 1)
                mt = np.maximum.accumulate(tm, axis=1)[:, j[0] // kc]
                mt = np.where(np.isfinite(mt), mt, mm)
                P = rb(np.exp(S - mt)) * np.exp(mt - mm)
            elif ROUND_P:
                P = rb(e)
            else:
                P = e
            out[bb, :, h] = np.where(l > 0, (P / np.where(l > 0, l, 1)) @ v4[bb, :, hk], 0)
    return out.reshape(-1), lse.reshape(-1)


def case(B, Sq, Sk, H, Hkv, D, causal, q_start, k_start, fmt, seed=0, note="", opens=None):
    """One case in the operand format `fmt` (emu_common.BF16 or FP16), under a document mask
    where `opens` gives each sequence's document openings (global positions), with each choice
    of m-tiles a warp the head size has (1, and 2 at D <= 64: the _m2_k4 kernels): the kernel's
    results against the reference's; prints a line each; returns (ok, out error, lse error)
    over them."""
    rng = np.random.default_rng(seed)
    q, k, v = inputs(rng, B, Sq, Sk, H, Hkv, D)
    scale = np.float32(1.0 / np.sqrt(D))
    doc_start = key_lo = None
    if opens is not None:
        doc_start = doc_starts(opens, Sq, q_start)
        key_lo, _ = doc_bounds(doc_start, Sq, Sk, k_start)
        note += f" documents {opens}"
    MAXK = 4 if D <= 64 else 8
    # The kernel's inputs: the bits of `fmt`, rounded once (nearest even) as the caller rounds
    # them.
    q16, k16, v16 = fmt.u16(q), fmt.u16(k), fmt.u16(v)
    results = []
    for MT in ((1, 2) if MAXK == 4 else (1,)):
        rout, rlse = reference(q, k, v, B, Sq, Sk, H, Hkv, D, causal, q_start, k_start,
                               np.float64(scale), fmt, doc_start, BN // MT)
        t0 = time.time()
        runs = []
        for late in (False, True):
            out = np.full(B * Sq * H * D, np.nan, np.float32)
            lse = np.full(B * H * Sq, np.nan, np.float32)
            kernel(q16, k16, v16, out, lse, B, Sq, Sk, H, Hkv, D, int(causal), q_start,
                   k_start, scale, MAXK, MT, late, fmt, key_lo)
            runs.append((out, lse))
        dt = time.time() - t0
        ok = True
        msgs = []
        # Copies landing when issued and at their wait read the same bits everywhere.
        if not all(np.array_equal(x.view(np.uint32), y.view(np.uint32))
                   for x, y in zip(runs[0], runs[1])):
            ok = False
            msgs.append("copies landing early and late give different results")
        dead = np.isneginf(rlse)  # rows that see no key
        if not np.array_equal(np.isneginf(lse), dead) or not np.all(np.isfinite(lse[~dead])):
            ok = False
            msgs.append(f"lse -inf rows differ ({np.isneginf(lse).sum()} vs {dead.sum()})")
        dead_o = np.broadcast_to(dead.reshape(B, H, Sq).transpose(0, 2, 1)[..., None],
                                 (B, Sq, H, D)).reshape(-1)
        if not np.all(out[dead_o] == 0):
            ok = False
            msgs.append("out of a row that sees no key not 0")
        top = max(np.abs(rout).max(), 1e-30)
        err = np.abs(out - rout).max() / top if np.all(np.isfinite(out)) else np.inf
        if not err < TOL[fmt.name]:
            ok = False
            bad = (np.argmax(np.abs(out - rout)) if np.isfinite(err)
                   else np.argmax(~np.isfinite(out)))
            msgs.append(f"(out worst at {bad}: {out[bad]} vs {rout[bad]})")
        live = ~dead
        if live.any():
            d = np.abs(lse[live].astype(np.float64) - rlse[live])
            lerr = d.max() if np.all(np.isfinite(lse[live])) else np.inf
            lrel = lerr / np.abs(rlse[live]).max()
        else:
            lerr = lrel = 0.0
        if not lerr < LSE_TOL:
            ok = False
            msgs.append("lse error")
        line = (f"{fmt} B{B} Sq{Sq} Sk{Sk} H{H}/{Hkv} D{D} k{MAXK} m{MT}"
                f"{' full' if D == 16 * MAXK else ''} {'c' if causal else 'nc'} "
                f"{q_start},{k_start}: out {err:.2e}, lse {lerr:.2e} abs {lrel:.2e} rel, -inf "
                f"rows {dead.sum()}/{dead.size} [{dt:.1f} s]{note}")
        print(line + ("" if ok else "  MISMATCH " + "; ".join(msgs)), flush=True)
        results.append((ok, err, lerr))
    return (all(r[0] for r in results), max(r[1] for r in results),
            max(r[2] for r in results))


CASES = [
    # B, Sq, Sk, H, Hkv, D, causal, q_start, k_start
    (1, 70, 70, 2, 1, 64, True, 0, 0),
    (2, 130, 130, 4, 2, 64, True, 0, 0),
    (1, 200, 200, 4, 1, 64, True, 0, 0),
    (1, 1, 17, 2, 1, 32, True, 16, 0),  # one query, the last position (decoding)
    (1, 17, 1, 2, 2, 16, False, 0, 0),
    (1, 63, 65, 2, 1, 48, True, 2, 0),
    (1, 65, 63, 2, 2, 96, False, 0, 0),
    (1, 130, 100, 4, 1, 128, True, 0, 0),
    (1, 100, 130, 2, 2, 32, True, 30, 10),
    (1, 40, 60, 2, 1, 32, True, 0, 20),  # rows 0..19 see no key
    (1, 40, 100, 2, 1, 16, True, 0, 50),  # no row sees a key (the key block in the future)
    (2, 130, 130, 4, 2, 16, True, 0, 65),  # rows 0..64 (a whole CTA and more) see no key
    (1, 150, 170, 2, 2, 128, True, 100, 120),
    (2, 33, 47, 2, 1, 80, False, 0, 0),
    (1, 64, 64, 2, 1, 112, True, 0, 0),
    (1, 97, 33, 3, 3, 48, True, 0, 0),
    (1, 130, 70, 4, 1, 32, False, 0, 0),
    (1, 90, 200, 2, 1, 96, True, 110, 0),
    (1, 129, 129, 2, 1, 128, False, 0, 0),
    # Offsets that put a warp's or a CTA's last key on the first key of a 16-key step or of a
    # 64-key tile (q_start - k_start = 1 mod 16), and a warp's first row one key short of a
    # whole tile (q_start - k_start = 14 mod 16): the boundaries of the skips.
    (1, 100, 120, 2, 1, 64, True, 1, 0),
    (1, 90, 80, 2, 2, 32, True, 0, 15),  # rows 0..14 see no key
    (1, 80, 140, 2, 1, 48, True, 78, 0),
]

if __name__ == "__main__":
    t0 = time.time()
    ok = True
    summary = []
    for fmt in FORMATS:
        t1 = time.time()
        res = [case(*c, fmt=fmt) for c in CASES]
        res += [case(*c[:6], True, *c[6:8], fmt=fmt, opens=c[8]) for c in DOC_CASES]
        ok &= all(r[0] for r in res)
        summary.append(f"{fmt}: {sum(r[0] for r in res)}/{len(res)} cases OK; max out error "
                       f"{max(r[1] for r in res):.2e} (TOL {TOL[fmt.name]:.2e}), max lse error "
                       f"{max(r[2] for r in res):.2e} (LSE_TOL {LSE_TOL:.0e}) "
                       f"[{time.time() - t1:.0f} s]")
    print("\n".join(summary))
    print(f"{'all OK' if ok else 'MISMATCH'} ({time.time() - t0:.0f} s)")
    sys.exit(0 if ok else 1)
