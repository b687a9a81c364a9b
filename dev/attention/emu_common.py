"""The emulation primitives both lane-level emulators of the candidate attention kernels use
(attention_tc_next_emu.py, attention_tc_bwd_next_emu.py): bf16 rounding as cvt.rn (nearest
even, a NaN the canonical one), register packing, mma.m16n8k16 on the PTX ISA's fragment
layouts, ex2.approx and fmaf, shared memory filled with garbage and ldmatrix.x4 from it, the
causal key count of a query block, and the threads' walk over a tile's 4-element pieces.
Lanes are numpy vectors of 32; a CTA's threads numpy vectors of THREADS.
"""
import numpy as np

lane = np.arange(32)
G, T = lane >> 2, lane & 3
THREADS = 128
TID = np.arange(THREADS)


def bf16_bits(x):
    """cvt.rn.bf16.f32: round to nearest even; a NaN becomes the canonical NaN 0x7FFF (the
    rounding would carry a NaN with all low bits set into +-0, hiding a read of garbage)."""
    x = np.asarray(x, dtype=np.float32)
    u = x.view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return np.where(np.isnan(x), 0x7FFF, u & 0xFFFF).astype(np.uint32)


def bits_f32(b):
    return (np.asarray(b, dtype=np.uint32) << 16).view(np.float32)


def bf16(x):
    return bits_f32(bf16_bits(x))


def pack(lo, hi):
    """tn_pack: cvt.rn.bf16x2.f32, `lo` in the lower 16 bits."""
    return bf16_bits(lo) | (bf16_bits(hi) << 16)


def lo_f(r):
    return bits_f32(r & 0xFFFF)


def hi_f(r):
    return bits_f32(r >> 16)


def mma(d, a, b0, b1):
    """d: [4][32] float32 (modified), a: 4 regs, b0, b1 regs."""
    A = np.zeros((16, 16))
    B = np.zeros((16, 8))
    A[G, 2 * T], A[G, 2 * T + 1] = lo_f(a[0]), hi_f(a[0])
    A[G + 8, 2 * T], A[G + 8, 2 * T + 1] = lo_f(a[1]), hi_f(a[1])
    A[G, 2 * T + 8], A[G, 2 * T + 9] = lo_f(a[2]), hi_f(a[2])
    A[G + 8, 2 * T + 8], A[G + 8, 2 * T + 9] = lo_f(a[3]), hi_f(a[3])
    B[2 * T, G], B[2 * T + 1, G] = lo_f(b0), hi_f(b0)
    B[2 * T + 8, G], B[2 * T + 9, G] = lo_f(b1), hi_f(b1)
    with np.errstate(invalid="ignore", over="ignore"):
        C = A @ B
        d[0] = (d[0] + C[G, 2 * T]).astype(np.float32)
        d[1] = (d[1] + C[G, 2 * T + 1]).astype(np.float32)
        d[2] = (d[2] + C[G + 8, 2 * T]).astype(np.float32)
        d[3] = (d[3] + C[G + 8, 2 * T + 1]).astype(np.float32)


def exp2(x):
    """tn_exp2: ex2.approx.ftz.f32 as the exact 2^x, results below 2^-126 flushed to 0."""
    with np.errstate(over="ignore", invalid="ignore"):
        y = np.exp2(np.asarray(x, dtype=np.float64)).astype(np.float32)
    return np.where(y < 2.0 ** -126, np.float32(0), y)


def fmaf(a, b, c):
    with np.errstate(invalid="ignore", over="ignore"):
        return (np.float64(a) * np.float64(b) + np.float64(c)).astype(np.float32)


class Smem:
    """A CTA's dynamic shared memory, filled with `fill` bytes (garbage a read of anything not
    written shows), and the thread whose cp.async wrote each 16 bytes (-1: none)."""

    def __init__(self, nbytes, fill):
        self.buf = np.full(nbytes, fill, dtype=np.uint8)
        self.n = nbytes
        self.owner = np.full(nbytes // 16, -1)

    def u16(self):
        return self.buf.view(np.uint16)

    def f32(self):
        return self.buf.view(np.float32)


def ldsm_x4(sm, addr, trans=False, region=None):
    """addr: [32] byte addresses; returns 4 registers, each [32] uint32. `region`: the byte
    range (lo, hi) the 16-byte rows must lie in (the tile read), if given."""
    assert np.all(addr % 16 == 0) and np.all(addr >= 0) and np.all(addr + 16 <= sm.n), addr
    if region is not None:
        assert np.all(addr >= region[0]) and np.all(addr + 16 <= region[1]), addr
    u = sm.u16()
    regs = []
    for i in range(4):
        rows = np.stack([u[addr[8 * i + r] // 2: addr[8 * i + r] // 2 + 8] for r in range(8)])
        rows = rows.astype(np.uint32)
        if trans:
            a, b = rows[2 * T, G], rows[2 * T + 1, G]
        else:
            a, b = rows[G, 2 * T], rows[G, 2 * T + 1]
        regs.append(a | (b << 16))
    return regs


def keys_seen(i_end, Sk, causal, q_start, k_start):
    """tn_keys_seen / tb_keys_seen: keys a query block ending at row `i_end` sees."""
    if not causal:
        return Sk
    v = q_start + i_end - k_start
    return 0 if v < 0 else min(v, Sk)


class Pieces:
    """TnPieces / TbPieces: every thread of the CTA at once (arrays over threadIdx.x) walking
    a tile's 4-element pieces, D / 4 a row."""

    def __init__(self, D):
        self.cpr = D >> 2
        self.r = TID // self.cpr
        self.c = TID - self.r * self.cpr
        self.dr = THREADS // self.cpr
        self.dc = THREADS - self.dr * self.cpr

    def advance(self, r, c):
        c = c + self.dc
        r = r + self.dr
        carry = c >= self.cpr
        return np.where(carry, r + 1, r), np.where(carry, c - self.cpr, c)

    def walk(self, n):
        r, c = self.r.copy(), self.c.copy()
        for i in range(n):
            yield i, r.copy(), c.copy()
            r, c = self.advance(r, c)


def inputs(rng, B, Sq, Sk, H, Hkv, D):
    """Random q [B, Sq, H, D], k and v [B, Sk, Hkv, D], fp32, flat."""
    q = rng.standard_normal(B * Sq * H * D).astype(np.float32)
    k = rng.standard_normal(B * Sk * Hkv * D).astype(np.float32)
    v = rng.standard_normal(B * Sk * Hkv * D).astype(np.float32)
    return q, k, v


def softmax_rows(S):
    """Rows of masked scores S (-inf where hidden; float64): the maximum with 0 for rows that
    see nothing, exp(S - max), its row sums, and the log-sum-exp (-inf for rows that see
    nothing)."""
    m = S.max(axis=1, keepdims=True) if S.shape[1] > 0 else np.full((S.shape[0], 1), -np.inf)
    mm = np.where(np.isfinite(m), m, 0)
    e = np.exp(S - mm)
    l = e.sum(axis=1, keepdims=True)
    with np.errstate(divide="ignore"):
        lse = np.where(l[:, 0] > 0, mm[:, 0] + np.log(l[:, 0]), -np.inf)
    return mm, e, l, lse
