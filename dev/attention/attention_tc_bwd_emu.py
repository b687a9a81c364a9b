"""Lane-level emulation of the library's tensor-core attention backward,
crates/tensor/src/cuda/kernels/attention_tc_bwd.cu (module "attention_tc_bwd"), in both of its
operand formats: bf16 (attn_bwd_dq_tc_k4 / _k8 and attn_bwd_dkv_tc_k4 / _k8, F16 = false) and
fp16 (attn_bwd_dq_tc_f16_k4 / _k8 and attn_bwd_dkv_tc_f16_k4 / _k8, F16 = true), and their
_docs twins under a document mask (DOCS: emu_common.DOC_CASES, key_lo and q_end made as
tensor::cuda::doc_mask::bounds makes them), to check their indexing, fragments and masks where
no GPU is at hand:
`python3 dev/attention/attention_tc_bwd_emu.py` (numpy; about half a minute) runs every case in
bf16, then in fp16, prints each case's errors (the format first) and a summary per format, and
exits 1 on a mismatch.

A transliteration of the two kernels (keep it in step when the kernels change), dQ at D <= 64
also with two m-tiles a warp (the _m2_k4 kernels), whose dq must be the bits of one m-tile's
(the same sums in the same order), and at D <= 64 without a document mask the fused kernel
(attn_bwd_fused_tc_k4: dK/dV's code plus dQ's share of each query step through a shared dS^T
tile, added into dq in the order its counters allow; its CTAs run in block order and each
checks that its turn has come where it adds, so that the kernel's waits only ever wait on a
block of lower index; its dk and dv must be the split kernel's bits, its dq match the
reference), the operand
format an emu_common.Format (BF16 or FP16) passed down to where the kernels' F16 acts, tb_pack
and tb_mma: each warp is 32 lanes as numpy vectors, the 128 threads of a CTA one vector where
all of them act (the copies), shared memory one byte buffer laid out as the kernels lay it out
(two stages of 16-bit tiles with row stride D + 8; dK/dV's lse / delta stages and K / V tiles),
filled with garbage first, ldmatrix (.x4, .trans) and mma.m16n8k16 as the PTX ISA's fragment
layouts say (the 16-bit halves decoded as bf16, or as fp16, subnormals included), rounding to
the format as cvt.rn.bf16x2.f32 / cvt.rn.f16x2.f32 (nearest even, fp16 subnormals kept),
ex2.approx as exact 2^x with flush to zero. Q, K, V and dO come in as the format's bits (u16),
the cases' fp32 inputs rounded once (nearest even) before the kernels, as the caller does
(delta from the fp32 dO, as attention_backward_tc computes it). cp.async is modelled with its
commit groups and wait_group, and every case runs twice: with each copy landing when issued
and with each landing at the wait that covers it (both must give the same bits); the barriers
bound phases in which no shared word may be both read and copied to, nor read while a copy to
it flies or before the barrier after its wait (emu_common.Smem). Not covered: the hardware
beyond those PTX rules, the asm's syntax (the NVRTC compile check), timing, register pressure.

The reference is dense float64 with the fp32 backward's formulas: the forward's lse on the
unrounded inputs (natural log, -inf for a row that sees no key), delta = rowsum(dO * O), Q, K,
V, dO and (ROUND_P) P and dS rounded to the format, under a document mask the CPU kernel's
rule on the documents' starts (not the kernels' key_lo / q_end); the kernels accumulate into
random dq, dk, dv (the += contract) and the base is subtracted before comparing.
"""
import sys
import time
import numpy as np

from emu_common import (DOC_CASES, FORMATS, G, T, THREADS, TID, CpAsync, Pieces, Smem, doc_bounds,
                        doc_starts, exp2, fmaf, inputs, keys_seen, lane, ld_u32, ldsm_x4, mma,
                        softmax_rows)

LOG2E = np.float32(1.4426950408889634)
ROUND_P = True  # the reference rounds P and dS to the format too (sharper: see TOL)
TOL = {"bf16": 1.5e-3, "fp16": 1.875e-4}  # max |x - ref| / max |ref|, by format.
# bf16: 1e-7 typically; up to ~7e-4 where the reference and the kernel round one P or dS
# element to different bf16 neighbours (S sums differ in the last fp32 bits): one row of dq and
# one of dk (or dv) then differ by that element's ulp (<= 2^-7 of it). A reference that does
# not round P and dS misses by 1.9e-3 .. 3.3e-3 over these cases: TOL lies between.
# fp16 (11 significant bits, half an ulp 2^-11 against 2^-8): both sides scale by 2^-3: such a
# flip moves the rows by <= 2^-10 of the element (2^-24 at most for an fp16 subnormal), the
# unrounded reference misses by 2.2e-4 .. 4.7e-4; so TOL is bf16's times 2^-3, still under
# every unrounded miss. The flips come 8 times as often (the fp32 differences against a
# smaller half ulp), each 8 times smaller: measured up to 4.5e-5. (In either format a single
# flip of the heaviest element could reach further, 7.9e-3 in bf16 and 9.8e-4 in fp16 over
# these cases, at the odds of its rounding boundary lying within ~1e-7 of it: the TOLs hold the
# measured flips, not every possible one: at head size 32 the shape (1, 150, 300, 4, 2, 32,
# causal, 200, 0) with seed 0 flips one such element, 2.9e-3 in bf16 in one (row, head) of dq
# and one of dk, split and fused kernels alike, the next row 6.7e-4; seeds 1 and 2 give
# 9.6e-5 and 2.9e-4, and the list runs it at head size 64.)


def copy_rows(cp, ta, tb, xa, xb, row_base, stride, row0, ROWS, S, D, ld, MAXK):
    """tb_copy_rows<ROWS, MAXK>: rows row0 .. row0 + ROWS - 1 of the 16-bit tensors xa, xb
    (`row_base`: element offset of row 0 of the head) into the 16-bit tiles at byte offsets ta,
    tb (row stride ld) by cp.async, 16 bytes a copy; zero past S."""
    pc = Pieces(D)
    n = ROWS * (D >> 3)
    r, c = pc.r.copy(), pc.c.copy()
    seen = np.zeros((ROWS, D // 8), dtype=int)
    for i in range(ROWS * MAXK // 64):
        act = ((i + 1) * THREADS <= n) | ((i * THREADS < n) & (TID + i * THREADS < n))
        act = np.broadcast_to(act, TID.shape)
        if act.any():
            rr, cc = r[act], c[act]
            row = row0 + rr
            inn = row < S
            off = row_base + np.where(inn, row * stride, 0) + 8 * cc
            # A row past the end reads nothing; its address stays inside row 0 of the head.
            assert np.all(np.where(inn, True, (off - row_base >= 0) & (off - row_base + 8 <= D)))
            assert np.all(rr < ROWS) and np.all(8 * cc + 8 <= D)  # never a padding column
            np.add.at(seen, (rr, cc), 1)
            so = (rr * ld + 8 * cc) * 2
            cp.copy(ta + so, xa, off, inn, 16, (ta, ta + ROWS * ld * 2))
            cp.copy(tb + so, xb, off, inn, 16, (tb, tb + ROWS * ld * 2))
        r, c = pc.advance(r, c)
    assert np.all(seen == 1), "the copies do not cover the tile exactly once"


def lane_addr(base, ld, kind, row_off=0):
    if kind == "nt":
        row = ((lane >> 4) << 3) + (lane & 7)
        col = ((lane >> 3) & 1) << 3
    else:
        row = (((lane >> 3) & 1) << 3) + (lane & 7)
        col = (lane >> 4) << 3
    return base + ((row_off + row) * ld + col) * 2


def dq_kernel(q, k, v, dout, lse, delta, dq, B, Sq, Sk, H, Hkv, D, causal, q_start, k_start,
              scale, MAXK, late, fmt, key_lo=None, MT=1):
    """attn_bwd_dq_tc_k<MAXK> (fmt BF16) or attn_bwd_dq_tc_f16_k<MAXK> (fmt FP16), or with a
    document mask's first keys `key_lo` ([B * Sq]) their _docs twins, over its grid, with MT
    m-tiles of 16 rows a warp (2: the _m2_k4 kernels, D <= 64); q, k, v, dout the bits (u16) of
    `fmt`."""
    DOCS = key_lo is not None
    ld = D + 8
    nbytes = 512 * (D + 8)
    stage = 2 * 64 * ld * 2
    kt0, vt0 = 0, 64 * ld * 2
    assert 2 * stage == nbytes
    nk, nd = D >> 4, D >> 3
    sl2 = np.float32(np.float32(scale) * LOG2E)
    bm = 64 * MT  # query rows of a CTA
    gy = (Sq + bm - 1) // bm
    for by in range(gy):  # the grid (B * H, gy) in the order of its linear index
        for bx in range(B * H):
            sm = Smem(nbytes, 0xAB)  # garbage: 0xABAB is -1.2e-12 in bf16, -0.0599 in fp16
            cp = CpAsync(sm, late)
            b, h = bx // H, bx % H
            hk = h // (H // Hkv)
            q0 = (gy - 1 - by) * bm
            qstride, kstride = H * D, Hkv * D
            qbase = b * Sq * qstride + h * D
            kbase = b * Sk * kstride + hk * D
            nvis = keys_seen(min(q0 + bm, Sq), Sk, causal, q_start, k_start)
            ntiles = (nvis + 63) // 64
            lrow = b * Sq
            jt0 = int(key_lo[lrow + q0]) // 64 if DOCS else 0
            if jt0 < ntiles:
                copy_rows(cp, kt0, vt0, k, v, kbase, kstride, jt0 * 64, 64, Sk, D, ld, MAXK)
                cp.commit()
            warps = []
            for w in range(4):
                iw = q0 + 16 * MT * w
                wlast = iw + 16 * MT - 1
                r0 = iw + G
                # Per m-tile mt (rows r0 + 16 mt, + 8): the Q and dO fragments, and per row
                # lse in exp2 units, delta, the keys it sees and its first key.
                qf, gf, lse2, dl, vis_row, lo_row = [], [], [], [], [], []
                for mt in range(MT):
                    rm = r0 + 16 * mt
                    fq, fg = [], []
                    for kk in range(nk):
                        regs_q, regs_g = [], []
                        for (rr, cc) in ((0, 0), (8, 0), (0, 8), (8, 8)):
                            row = rm + rr
                            ok = row < Sq
                            idx = qbase + np.where(ok, row, 0) * qstride + kk * 16 + 2 * T + cc
                            regs_q.append(ld_u32(q, idx, ok))
                            regs_g.append(ld_u32(dout, idx, ok))
                        fq.append(regs_q)
                        fg.append(regs_g)
                    qf.append(fq)
                    gf.append(fg)
                    l2, d_, vr, lr = [], [], [], []
                    for hf in range(2):
                        i = rm + 8 * hf
                        ok = i < Sq
                        li = (b * H + h) * Sq + np.where(ok, i, 0)
                        with np.errstate(invalid="ignore"):
                            l2.append(np.where(ok, (lse[li] * LOG2E).astype(np.float32),
                                               0).astype(np.float32))
                        d_.append(np.where(ok, delta[li], 0).astype(np.float32))
                        vr.append(np.array([keys_seen(x + 1, Sk, causal, q_start, k_start)
                                            if x < Sq else 0 for x in i]))
                        lr.append(np.array([int(key_lo[lrow + x]) if DOCS and x < Sq else 0
                                            for x in i]))
                    lse2.append(l2)
                    dl.append(d_)
                    vis_row.append(vr)
                    lo_row.append(lr)
                wfull = wkeys = wlo_min = wlo_max = 0
                if iw < Sq:
                    wkeys = keys_seen(min(wlast + 1, Sq), Sk, causal, q_start, k_start)
                    wfull = keys_seen(iw + 1, Sk, causal, q_start, k_start)
                    if DOCS:
                        wlo_min = int(key_lo[lrow + iw])
                        wlo_max = int(key_lo[lrow + min(wlast, Sq - 1)])
                acc = [[[np.zeros(32, np.float32) for _ in range(4)] for _ in range(2 * MAXK)]
                       for _ in range(MT)]
                warps.append(dict(r0=r0, qf=qf, gf=gf, lse2=lse2, dl=dl, vis_row=vis_row,
                                  lo_row=lo_row, wfull=wfull, wkeys=wkeys, wlo_min=wlo_min,
                                  wlo_max=wlo_max, acc=acc))
            ks_nt = lane_addr(kt0, ld, "nt")
            vs_nt = lane_addr(vt0, ld, "nt")
            ks_tr = lane_addr(kt0, ld, "tr")
            for it, jt in enumerate(range(jt0, ntiles)):
                j0 = jt * 64
                cur = (it & 1) * stage
                cp.wait(0)
                sm.barrier()
                if jt + 1 < ntiles:
                    nxt = stage - cur  # the other stage
                    copy_rows(cp, kt0 + nxt, vt0 + nxt, k, v, kbase, kstride, j0 + 64, 64, Sk, D,
                              ld, MAXK)
                    cp.commit()
                regs = ((kt0 + cur, kt0 + cur + 64 * ld * 2), (vt0 + cur, vt0 + cur + 64 * ld * 2))
                for W in warps:
                    lo = None
                    if j0 + 64 <= W["wfull"] and (not DOCS or j0 >= W["wlo_max"]):
                        masked, kv_lim, vis = False, 64, None
                    elif j0 < W["wkeys"] and (not DOCS or j0 + 64 > W["wlo_min"]):
                        masked, kv_lim = True, W["wkeys"] - j0
                        vis = [[x - j0 for x in v_] for v_ in W["vis_row"]]
                        if DOCS:
                            lo = [[x - j0 for x in v_] for v_ in W["lo_row"]]
                    else:
                        continue
                    dq_tile(sm, W, ks_nt + cur, vs_nt + cur, ks_tr + cur, regs, ld, nk, MAXK, MT,
                            sl2, masked, kv_lim, vis, fmt, lo)
            assert cp.idle(), "cp.async left in flight at the end of the CTA"
            for W in warps:
                for mt in range(MT):
                    for hf in range(2):
                        i = W["r0"] + 16 * mt + 8 * hf
                        for n in range(nd):
                            for e in range(2):
                                for ln in range(32):
                                    if i[ln] < Sq:
                                        o = qbase + i[ln] * qstride + 2 * T[ln] + n * 8 + e
                                        dq[o] = np.float32(dq[o] + np.float32(scale)
                                                           * W["acc"][mt][n][2 * hf + e][ln])


def dq_tile(sm, W, ks_nt, vs_nt, ks_tr, regs, ld, nk, MAXK, MT, sl2, masked, kv_lim, vis, fmt,
            lo=None):
    """tb_dq_tile<MAXK, MT, MASKED, F16, DOCS> for one warp (fmt: the operand format,
    emu_common.BF16 or FP16; its registers indexed [mt] by m-tile); regs: the byte ranges of
    the stage's K and V tiles, which its ldmatrix rows must lie in."""
    kreg, vreg = regs
    KC = 32 // MT  # keys a step
    NT = KC // 8
    for c0 in range(0, 64, KC):
        if masked and c0 >= kv_lim:
            break
        s = [[[np.zeros(32, np.float32) for _ in range(4)] for _ in range(NT)] for _ in range(MT)]
        dp = [[[np.zeros(32, np.float32) for _ in range(4)] for _ in range(NT)]
              for _ in range(MT)]
        for kk in range(nk):
            for p in range(NT // 2):
                if not masked or c0 + 16 * p < kv_lim:
                    off = ((c0 + 16 * p) * ld + kk * 16) * 2
                    bk = ldsm_x4(sm, ks_nt + off, region=kreg)
                    bv = ldsm_x4(sm, vs_nt + off, region=vreg)
                    for mt in range(MT):
                        mma(s[mt][2 * p], W["qf"][mt][kk], bk[0], bk[1], fmt)
                        mma(s[mt][2 * p + 1], W["qf"][mt][kk], bk[2], bk[3], fmt)
                        mma(dp[mt][2 * p], W["gf"][mt][kk], bv[0], bv[1], fmt)
                        mma(dp[mt][2 * p + 1], W["gf"][mt][kk], bv[2], bv[3], fmt)
        for mt in range(MT):
            for n in range(NT):
                for x in range(4):
                    hf = x >> 1
                    p_ = exp2(fmaf(s[mt][n][x], sl2, -W["lse2"][mt][hf]))
                    with np.errstate(invalid="ignore", over="ignore"):
                        ds = (p_ * (dp[mt][n][x] - W["dl"][mt][hf])).astype(np.float32)
                    if masked:
                        c = c0 + n * 8 + 2 * T + (x & 1)
                        cut = (c >= vis[mt][hf]) | ((c < lo[mt][hf]) if lo is not None else False)
                        ds = np.where(cut, np.float32(0), ds)
                    s[mt][n][x] = ds.astype(np.float32)
        pack = fmt.pack
        for kk in range(NT // 2):
            if not masked or c0 + 16 * kk < kv_lim:
                a = [[pack(s[mt][2 * kk][0], s[mt][2 * kk][1]),
                      pack(s[mt][2 * kk][2], s[mt][2 * kk][3]),
                      pack(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]),
                      pack(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3])] for mt in range(MT)]
                for p in range(nk):
                    bk = ldsm_x4(sm, ks_tr + ((c0 + 16 * kk) * ld + p * 16) * 2, trans=True,
                                 region=kreg)
                    for mt in range(MT):
                        mma(W["acc"][mt][2 * p], a[mt], bk[0], bk[1], fmt)
                        mma(W["acc"][mt][2 * p + 1], a[mt], bk[2], bk[3], fmt)


def dkv_kernel(q, k, v, dout, lse, delta, dk, dv, B, Sq, Sk, H, Hkv, D, causal, q_start,
               k_start, scale, MAXK, KV_REGS, late, fmt, q_end=None, dq=None):
    """attn_bwd_dkv_tc_k<MAXK> (fmt BF16) or attn_bwd_dkv_tc_f16_k<MAXK> (fmt FP16), or with a
    document mask's query ends `q_end` ([B * Sk]) their _docs twins, over its grid; q, k, v,
    dout the bits (u16) of `fmt`. With `dq`: the fused kernel attn_bwd_fused_tc(_f16)_k4
    (FUSED), which adds dQ too, its CTAs run one after another in the order of their block
    index, which its waits must allow: each CTA's turn in a query step's count must have come
    when it gets there (the kernel's wait would otherwise wait on a later block)."""
    DOCS = q_end is not None
    FUSED = dq is not None
    assert not FUSED or (MAXK == 4 and not DOCS)
    ld = D + 8
    nbytes = 512 * (D + 8) + 512 + (64 * 40 * 2 if FUSED else 0)
    ls0 = 0  # lse / delta stages: stage s at 256 s (lse 32 fp32, then delta 32)
    kt = 512
    vt = kt + 64 * ld * 2
    qstage = 2 * 32 * ld * 2
    qt0 = vt + 64 * ld * 2
    gt0 = qt0 + 32 * ld * 2
    assert qt0 + 2 * qstage + (64 * 40 * 2 if FUSED else 0) == nbytes and qt0 % 16 == 0
    nk, nd = D >> 4, D >> 3
    sl2 = np.float32(np.float32(scale) * LOG2E)
    group = H // Hkv
    nblocks = (Sk + 63) // 64
    nqs = (Sq + 31) // 32
    turns = np.zeros(B * H * nqs, np.int64)  # the fused kernel's counters, zeroed
    dst0 = qt0 + 2 * qstage  # FUSED: the dS^T tile (64 keys, row stride 40)
    for by in range(nblocks):  # the grid (B * Hkv, nblocks) in the order of its linear index
        for bx in range(B * Hkv):
            sm = Smem(nbytes, 0xAB)  # garbage: 0xABAB is -1.2e-12 in bf16, -0.0599 in fp16
            cp = CpAsync(sm, late)
            b, hk = bx // Hkv, bx % Hkv
            jb = by
            j0 = jb * 64
            qstride, kstride = H * D, Hkv * D
            kbase = b * Sk * kstride + hk * D
            i0 = k_start + j0 - q_start if causal else 0
            i0 = 0 if i0 < 0 else (i0 // 32) * 32
            krow = b * Sk
            iend = min(Sq, int(q_end[krow + min(j0 + 63, Sk - 1)])) if DOCS else Sq
            nsteps = (iend - i0 + 31) // 32 if i0 < iend else 0
            total = group * nsteps
            # tb_first_step / tb_next_step: from the last step down to i0 (DOCS: up from i0),
            # head after head.
            c_first = i0 if DOCS else i0 + (iend - 1 - i0) // 32 * 32

            def next_step(c, head):
                c += 32 if DOCS else -32
                if (c >= iend) if DOCS else (c < i0):
                    return c_first, head + 1
                return c, head

            def copy_step(qt, gt, lst, h, c0):
                """tb_dkv_copy_step: one commit group."""
                qbase = b * Sq * qstride + h * D
                copy_rows(cp, qt, gt, q, dout, qbase, qstride, c0, 32, Sq, D, ld, MAXK)
                lbase = (b * H + h) * Sq
                r = TID & 31
                inn = c0 + r < Sq
                li = lbase + np.where(inn, c0 + r, 0)
                lo, hi = TID < 32, (TID >= 32) & (TID < 64)
                cp.copy(lst + 4 * r[lo], lse, li[lo], inn[lo], 4, (lst, lst + 128))
                cp.copy(lst + 128 + 4 * r[hi], delta, li[hi], inn[hi], 4, (lst + 128, lst + 256))
                cp.commit()

            if total > 0:
                copy_rows(cp, kt, vt, k, v, kbase, kstride, j0, 64, Sk, D, ld, MAXK)
                cp.commit()
                copy_step(qt0, gt0, ls0, hk * group, c_first)
            warps = []
            if KV_REGS:
                cp.wait(1)
                sm.barrier()
            for w in range(4):
                W = dict(jw=j0 + 16 * w)
                W["ka_tr"] = lane_addr(kt, ld, "tr", 16 * w)
                W["va_tr"] = lane_addr(vt, ld, "tr", 16 * w)
                if KV_REGS:
                    W["kf"] = [ldsm_x4(sm, W["ka_tr"] + kk * 32, region=(kt, vt))
                               for kk in range(nk)]
                    W["vf"] = [ldsm_x4(sm, W["va_tr"] + kk * 32, region=(vt, qt0))
                               for kk in range(nk)]
                W["dka"] = [[np.zeros(32, np.float32) for _ in range(4)] for _ in range(2 * MAXK)]
                W["dva"] = [[np.zeros(32, np.float32) for _ in range(4)] for _ in range(2 * MAXK)]
                W["jdiag"] = k_start + W["jw"] - q_start
                W["qe_wmin"] = W["qe_wmax"] = 0
                if DOCS and W["jw"] < Sk:
                    W["qe_wmin"] = int(q_end[krow + W["jw"]])
                    W["qe_wmax"] = int(q_end[krow + min(W["jw"] + 15, Sk - 1)])
                warps.append(W)
            c0, gi, ngi, nc0 = c_first, 0, 0, c_first
            for it in range(total):
                odd = it & 1
                qo, lo_ = (qstage, 256) if odd else (0, 0)
                cp.wait(0)
                sm.barrier()
                nc0, ngi = next_step(nc0, ngi)
                if it + 1 < total:
                    nq, nl = (0, 0) if odd else (qstage, 256)
                    copy_step(qt0 + nq, gt0 + nq, ls0 + nl, hk * group + ngi, nc0)
                A = dict(qs_nt=lane_addr(qt0 + qo, ld, "nt"), gs_nt=lane_addr(gt0 + qo, ld, "nt"),
                         qs_tr=lane_addr(qt0 + qo, ld, "tr"), gs_tr=lane_addr(gt0 + qo, ld, "tr"),
                         qreg=(qt0 + qo, qt0 + qo + 32 * ld * 2),
                         greg=(gt0 + qo, gt0 + qo + 32 * ld * 2), kreg=(kt, vt), vreg=(vt, qt0),
                         lse_s=ls0 + lo_, del_s=ls0 + lo_ + 128)
                hi = Sq - c0
                for W in warps:
                    W["ds"] = None
                    jw = W["jw"]
                    first = W["jdiag"] - c0 if causal else 0
                    first_last = first + 15 if causal else 0
                    whi = min(hi, W["qe_wmax"] - c0) if DOCS else hi
                    if jw < Sk and first < min(whi, 32):
                        if (jw + 16 <= Sk and hi >= 32 and first_last <= 0
                                and (not DOCS or W["qe_wmin"] - c0 >= 32)):
                            W["ds"] = dkv_step(sm, W, A, ld, nk, MAXK, KV_REGS, sl2, False, 0, 2,
                                               [0, 0], 32, fmt)
                        else:
                            lo, hr = [], None
                            for hf in range(2):
                                kj = jw + G + 8 * hf
                                lo.append(np.where(kj >= Sk, 1 << 28, (first + G + 8 * hf) if causal else 0))
                            if DOCS:
                                hr = [np.array([min(hi, int(q_end[krow + x]) - c0) if x < Sk else 0
                                                for x in jw + G + 8 * hf]) for hf in range(2)]
                            plo = first >> 4 if first > 0 else 0
                            phi = (min(whi, 32) + 15) >> 4
                            W["ds"] = dkv_step(sm, W, A, ld, nk, MAXK, KV_REGS, sl2, True, plo, phi,
                                               lo, hi, fmt, hr)
                if FUSED:
                    fused_dq_step(sm, warps, turns, dq, fmt, b, H, D, Sq, ld, nk, nqs, dst0, kt,
                                  hk * group + gi, c0, jb, nblocks, causal, q_start, k_start,
                                  scale)
                c0, gi = next_step(c0, gi)
            assert cp.idle(), "cp.async left in flight at the end of the CTA"
            for W in warps:
                for hf in range(2):
                    j = W["jw"] + G + 8 * hf
                    for n in range(nd):
                        for e in range(2):
                            for ln in range(32):
                                if j[ln] < Sk:
                                    o = kbase + j[ln] * kstride + 2 * T[ln] + n * 8 + e
                                    dk[o] = np.float32(dk[o] + np.float32(scale) * W["dka"][n][2 * hf + e][ln])
                                    dv[o] = np.float32(dv[o] + W["dva"][n][2 * hf + e][ln])


def dkv_step(sm, W, A, ld, nk, MAXK, KV_REGS, sl2, masked, plo, phi, lo, hi, fmt, hr=None):
    """tb_dkv_step<MAXK, MASKED, KV_REGS, F16, DOCS> for one warp (A: the step's stage
    addresses; fmt: the operand format; hr: the key rows' query ends under a document mask,
    DOCS, else None)."""
    s = [[np.zeros(32, np.float32) for _ in range(4)] for _ in range(4)]
    dp = [[np.zeros(32, np.float32) for _ in range(4)] for _ in range(4)]
    for kk in range(nk):
        if KV_REGS:
            ka, va = W["kf"][kk], W["vf"][kk]
        else:
            ka = ldsm_x4(sm, W["ka_tr"] + kk * 32, region=A["kreg"])
            va = ldsm_x4(sm, W["va_tr"] + kk * 32, region=A["vreg"])
        for p in range(2):
            if not masked or (plo <= p < phi):
                off = (p * 16 * ld + kk * 16) * 2
                bq = ldsm_x4(sm, A["qs_nt"] + off, region=A["qreg"])
                bg = ldsm_x4(sm, A["gs_nt"] + off, region=A["greg"])
                mma(s[2 * p], ka, bq[0], bq[1], fmt)
                mma(s[2 * p + 1], ka, bq[2], bq[3], fmt)
                mma(dp[2 * p], va, bg[0], bg[1], fmt)
                mma(dp[2 * p + 1], va, bg[2], bg[3], fmt)
    f = sm.f32()
    for n in range(4):
        # float2 reads of the step's lse and delta (queries 8n + 2t, + 1), lse times log2(e)
        # (one fp32 product) where read.
        la = A["lse_s"] + (n * 8 + 2 * T) * 4
        da = A["del_s"] + (n * 8 + 2 * T) * 4
        sm.read(la, 8)
        sm.read(da, 8)
        for x in range(4):
            e = x & 1
            il = n * 8 + 2 * T + e
            with np.errstate(invalid="ignore"):
                l2 = (f[la // 4 + e] * LOG2E).astype(np.float32)
            dl = f[da // 4 + e]
            p_ = exp2(fmaf(s[n][x], sl2, -l2))
            with np.errstate(invalid="ignore", over="ignore"):
                ds = (p_ * (dp[n][x] - dl)).astype(np.float32)
            if masked:
                bad = (il < lo[x >> 1]) | (il >= (hi if hr is None else hr[x >> 1]))
                p_ = np.where(bad, np.float32(0), p_)
                ds = np.where(bad, np.float32(0), ds)
            s[n][x] = p_.astype(np.float32)
            dp[n][x] = ds.astype(np.float32)
    ds_t = [[x.copy() for x in n] for n in dp]  # dS^T, for the fused kernel's dQ
    pack = fmt.pack
    for kk in range(2):
        if not masked or (plo <= kk < phi):
            a = [pack(s[2 * kk][0], s[2 * kk][1]), pack(s[2 * kk][2], s[2 * kk][3]),
                 pack(s[2 * kk + 1][0], s[2 * kk + 1][1]), pack(s[2 * kk + 1][2], s[2 * kk + 1][3])]
            for p in range(nk):
                bg = ldsm_x4(sm, A["gs_tr"] + (kk * 16 * ld + p * 16) * 2, trans=True,
                             region=A["greg"])
                mma(W["dva"][2 * p], a, bg[0], bg[1], fmt)
                mma(W["dva"][2 * p + 1], a, bg[2], bg[3], fmt)
            a = [pack(dp[2 * kk][0], dp[2 * kk][1]), pack(dp[2 * kk][2], dp[2 * kk][3]),
                 pack(dp[2 * kk + 1][0], dp[2 * kk + 1][1]), pack(dp[2 * kk + 1][2], dp[2 * kk + 1][3])]
            for p in range(nk):
                bq = ldsm_x4(sm, A["qs_tr"] + (kk * 16 * ld + p * 16) * 2, trans=True,
                             region=A["qreg"])
                mma(W["dka"][2 * p], a, bq[0], bq[1], fmt)
                mma(W["dka"][2 * p + 1], a, bq[2], bq[3], fmt)
    return ds_t


def fused_dq_step(sm, warps, turns, dq, fmt, b, H, D, Sq, ld, nk, nqs, dst0, kt, h, c0, jb,
                  nblocks, causal, q_start, k_start, scale):
    """The fused kernel's dQ share of query step c0 of head h (its FUSED block): each warp's
    dS^T into the shared tile (tb_store_ds, or tb_zero_ds for a warp that skipped the step),
    the barrier, the product (tb_fused_dq), the turn (key block jb's: jb; checked against the
    count: the CTAs run in block order; each warp waits for it, no barrier), the adds; the
    count (after the next barrier in the kernel)."""
    for w, W in enumerate(warps):
        for hf in range(2):
            for n in range(4):
                addr = dst0 + ((16 * w + G + 8 * hf) * 40 + 8 * n + 2 * T) * 2
                if W["ds"] is None:
                    word = np.zeros(32, np.uint32)
                else:
                    word = fmt.pack(W["ds"][n][2 * hf], W["ds"][n][2 * hf + 1])
                sm.write(addr, word)
    sm.barrier()
    qa = []
    for w in range(4):
        acc = [[np.zeros(32, np.float32) for _ in range(4)] for _ in range(8)]  # [n-tile][x]
        ds_nt = lane_addr(dst0 + 16 * (w & 1) * 2, 40, "nt")
        ks_tr = lane_addr(kt, ld, "tr")
        for kk in range(4):
            a = ldsm_x4(sm, ds_nt + kk * 16 * 40 * 2, trans=True, region=(dst0, dst0 + 64 * 80))
            for p in range(w >> 1, nk, 2):
                bb = ldsm_x4(sm, ks_tr + (kk * 16 * ld + p * 16) * 2, trans=True,
                             region=(kt, kt + 64 * ld * 2))
                mma(acc[2 * p], a, bb[0], bb[1], fmt)
                mma(acc[2 * p + 1], a, bb[2], bb[3], fmt)
        qa.append(acc)
    turn = (b * H + h) * nqs + c0 // 32
    assert turns[turn] == jb, \
        f"key block {jb} at query step {c0}: count {turns[turn]}, its turn {jb}"
    for w in range(4):
        for hf in range(2):
            i = c0 + 16 * (w & 1) + G + 8 * hf
            for p in range(w >> 1, nk, 2):
                for n in range(2):
                    for e in range(2):
                        col = 16 * p + 8 * n + 2 * T + e
                        o = ((b * Sq + i) * H + h) * D + col
                        ok = i < Sq
                        dq[o[ok]] = fmaf(np.float32(scale), qa[w][2 * p + n][2 * hf + e][ok],
                                         dq[o[ok]])
    turns[turn] += 1


def reference(q, k, v, dout, B, Sq, Sk, H, Hkv, D, causal, q_start, k_start, scale, fmt,
              doc_start=None):
    """fp64: forward (lse, out) on the unrounded inputs; backward with the operands rounded to
    the format `fmt`, as the fp32 backward's formulas ((ROUND_P) P, dS rounded to `fmt`); under
    a document mask (`doc_start` [B, Sq]: key j seen iff doc_start <= k_start + j) if given."""
    q4 = q.reshape(B, Sq, H, D).astype(np.float64)
    k4 = k.reshape(B, Sk, Hkv, D).astype(np.float64)
    v4 = v.reshape(B, Sk, Hkv, D).astype(np.float64)
    g4 = dout.reshape(B, Sq, H, D).astype(np.float64)
    i = np.arange(Sq)[:, None]
    j = np.arange(Sk)[None, :]
    vis0 = (k_start + j <= q_start + i) if causal else np.ones((Sq, Sk), bool)
    seen = [vis0 if doc_start is None else vis0 & (doc_start[bb][:, None] <= k_start + j)
            for bb in range(B)]
    lse = np.full((B, H, Sq), -np.inf)
    out = np.zeros((B, Sq, H, D))
    dq = np.zeros_like(q4)
    dk = np.zeros_like(k4)
    dv = np.zeros_like(v4)
    rb = lambda x: fmt.round(x.astype(np.float32)).astype(np.float64)
    for bb in range(B):
        for h in range(H):
            hk = h // (H // Hkv)
            S = q4[bb, :, h] @ k4[bb, :, hk].T * scale
            S = np.where(seen[bb], S, -np.inf)
            _, e, l, lse[bb, h] = softmax_rows(S)
            out[bb, :, h] = np.where(l > 0, (e / np.where(l > 0, l, 1)) @ v4[bb, :, hk], 0)
    lse = lse.astype(np.float32)
    delta = np.einsum("bihd,bihd->bhi", out.astype(np.float32).astype(np.float64), g4).astype(np.float32)
    for bb in range(B):
        for h in range(H):
            hk = h // (H // Hkv)
            Q, K, V, G_ = rb(q4[bb, :, h]), rb(k4[bb, :, hk]), rb(v4[bb, :, hk]), rb(g4[bb, :, h])
            S = Q @ K.T
            L = lse[bb, h].astype(np.float64)[:, None]
            with np.errstate(invalid="ignore", over="ignore"):
                P = np.where(seen[bb], np.exp(S * scale - np.where(np.isfinite(L), L, 0)), 0)
            dP = G_ @ V.T
            dS = P * (dP - delta[bb, h].astype(np.float64)[:, None])
            if ROUND_P:  # P and dS rounded to `fmt` as the kernels round them
                P, dS = rb(P), rb(dS)
            dv[bb, :, hk] += P.T @ G_
            dk[bb, :, hk] += scale * dS.T @ Q
            dq[bb, :, h] += scale * dS @ K
    return lse.reshape(-1), delta.reshape(-1), dq.reshape(-1), dk.reshape(-1), dv.reshape(-1)


def case(B, Sq, Sk, H, Hkv, D, causal, q_start, k_start, fmt, seed=0, kv_regs=None,
         opens=None):
    """One case in the operand format `fmt` (emu_common.BF16 or FP16), under a document mask
    where `opens` gives each sequence's document openings (global positions): the kernels'
    results against the reference's; prints a line; returns (ok, max error of dq, dk, dv)."""
    t0 = time.time()
    rng = np.random.default_rng(seed)
    q, k, v = inputs(rng, B, Sq, Sk, H, Hkv, D)
    dout = rng.standard_normal(B * Sq * H * D).astype(np.float32)
    scale = 1.0 / np.sqrt(D)
    doc_start = key_lo = q_end = None
    if opens is not None:
        doc_start = doc_starts(opens, Sq, q_start)
        key_lo, q_end = doc_bounds(doc_start, Sq, Sk, k_start)
    lse, delta, rq, rk, rv = reference(q, k, v, dout, B, Sq, Sk, H, Hkv, D, causal, q_start,
                                       k_start, scale, fmt, doc_start)
    MAXK = 4 if D <= 64 else 8
    if kv_regs is None:
        kv_regs = MAXK == 4
    # The kernels' inputs: the bits of `fmt`, rounded once (nearest even) as the caller rounds
    # them (delta, from the fp32 dO, is the reference's, as the launcher computes it first).
    q16, k16, v16, g16 = fmt.u16(q), fmt.u16(k), fmt.u16(v), fmt.u16(dout)
    # Accumulate onto a base to check +=.
    base_q = rng.standard_normal(q.size).astype(np.float32)
    base_k = rng.standard_normal(k.size).astype(np.float32)
    base_v = rng.standard_normal(v.size).astype(np.float32)
    args = (B, Sq, Sk, H, Hkv, D, int(causal), q_start, k_start, np.float32(scale))
    runs = []
    for late in (False, True):
        dq, dk, dv = base_q.copy(), base_k.copy(), base_v.copy()
        dq_kernel(q16, k16, v16, g16, lse, delta, dq, *args, MAXK, late, fmt, key_lo)
        dkv_kernel(q16, k16, v16, g16, lse, delta, dk, dv, *args, MAXK, kv_regs, late, fmt,
                   q_end)
        runs.append((dq, dk, dv))
    # Copies landing when issued and at their wait read the same bits everywhere.
    same = all(np.array_equal(x.view(np.uint32), y.view(np.uint32))
               for x, y in zip(runs[0], runs[1]))
    # dQ with two m-tiles a warp (the _m2_k4 kernels, D <= 64): the same sums in the same
    # order, so the same bits, with copies landing early and late.
    same_m2 = True
    if MAXK == 4:
        for late in (False, True):
            dq2 = base_q.copy()
            dq_kernel(q16, k16, v16, g16, lse, delta, dq2, *args, MAXK, late, fmt, key_lo, MT=2)
            same_m2 &= np.array_equal(dq2.view(np.uint32), runs[0][0].view(np.uint32))
    # The fused kernel (D <= 64, no document mask): dK and dV the split kernel's bits (the same
    # code), dq to the reference, copies landing early and late alike.
    fused = MAXK == 4 and opens is None
    same_fused = True
    if fused:
        fruns = []
        for late in (False, True):
            dq3, dk3, dv3 = base_q.copy(), base_k.copy(), base_v.copy()
            dkv_kernel(q16, k16, v16, g16, lse, delta, dk3, dv3, *args, MAXK, kv_regs, late, fmt,
                       dq=dq3)
            fruns.append((dq3, dk3, dv3))
        same_fused = (all(np.array_equal(x.view(np.uint32), y.view(np.uint32))
                          for x, y in zip(fruns[0], fruns[1]))
                      and all(np.array_equal(x.view(np.uint32), y.view(np.uint32))
                              for x, y in zip(fruns[0][1:], runs[0][1:])))
    dq, dk, dv = runs[1]
    errs = []
    maxerr = 0.0
    ok_all = True
    checks = [("dq", dq, base_q, rq), ("dk", dk, base_k, rk), ("dv", dv, base_v, rv)]
    if fused:
        checks.append(("fused dq", fruns[1][0], base_q, rq))
    for name, x, base, r in checks:
        got = x.astype(np.float64) - base
        top = max(np.abs(r).max(), 1e-30)
        err = np.abs(got - r).max() / top if np.all(np.isfinite(x)) else np.inf
        errs.append(f"{name} {err:.2e}")
        maxerr = max(maxerr, err)
        ok = err < TOL[fmt.name]
        ok_all &= ok
        if not ok:
            bad = np.argmax(np.abs(got - r))
            errs.append(f"(worst at {bad}: {got[bad]} vs {r[bad]})")
    if not same:
        ok_all = False
        errs.append("copies landing early and late give different results")
    if not same_fused:
        ok_all = False
        errs.append("the fused kernel's dk, dv differ from the split's, or early and late copies")
    if not same_m2:
        ok_all = False
        errs.append("dQ with two m-tiles a warp differs from one's")
    line = (f"{fmt} B{B} Sq{Sq} Sk{Sk} H{H}/{Hkv} D{D} {'c' if causal else 'nc'} "
            f"{q_start},{k_start} kv_regs={int(kv_regs)}"
            f"{' (dQ m2 bitwise)' if MAXK == 4 else ''}{' (fused)' if fused else ''}: "
            + ", ".join(errs)
            + f" [{time.time() - t0:.1f} s]" + (f" documents {opens}" if opens else ""))
    print(line, flush=True)
    return bool(ok_all), maxerr


CASES = [
    # B, Sq, Sk, H, Hkv, D, causal, q_start, k_start
    (1, 70, 70, 2, 1, 64, True, 0, 0),
    (1, 100, 130, 2, 2, 32, True, 30, 10),
    (1, 90, 80, 4, 2, 48, False, 0, 0),
    (1, 40, 100, 2, 1, 16, True, 0, 50),  # no row sees a key: nothing added
    (1, 40, 60, 2, 1, 32, True, 0, 20),  # rows 0..19 see no key
    (1, 200, 200, 4, 1, 64, True, 0, 0),
    (1, 70, 75, 2, 1, 128, True, 5, 0),
    (1, 150, 170, 2, 2, 128, True, 100, 120),
    (1, 50, 60, 2, 2, 96, True, 40, 20),
    (2, 33, 47, 2, 1, 80, False, 0, 0),
    (1, 97, 33, 3, 3, 48, True, 0, 0),
    (1, 130, 70, 4, 1, 32, False, 0, 0),
    (1, 64, 64, 2, 1, 112, True, 0, 0),
    (1, 150, 300, 4, 2, 64, True, 200, 0),  # 5 key blocks; the fused kernel's turns, offsets
]

if __name__ == "__main__":
    t0 = time.time()
    ok = True
    summary = []
    for fmt in FORMATS:
        t1 = time.time()
        res = [case(*c, fmt=fmt) for c in CASES]
        # The other choice of TB_DKV_KV_REGS_K4 / _K8.
        res.append(case(1, 70, 75, 2, 1, 128, True, 5, 0, fmt=fmt, kv_regs=True))
        res.append(case(1, 70, 70, 2, 1, 64, True, 0, 0, fmt=fmt, kv_regs=False))
        # Document masks (emu_common.DOC_CASES, which the forward emulator runs too).
        res += [case(*c[:6], True, *c[6:8], fmt=fmt, opens=c[8]) for c in DOC_CASES]
        ok &= all(r[0] for r in res)
        summary.append(f"{fmt}: {sum(r[0] for r in res)}/{len(res)} cases OK; max error "
                       f"{max(r[1] for r in res):.2e} (TOL {TOL[fmt.name]:.2e}) "
                       f"[{time.time() - t1:.0f} s]")
    print("\n".join(summary))
    print(f"{'all OK' if ok else 'MISMATCH'} ({time.time() - t0:.0f} s)")
    sys.exit(0 if ok else 1)
