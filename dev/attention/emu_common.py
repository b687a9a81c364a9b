"""The emulation primitives both lane-level emulators of the library's tensor-core attention
kernels use (attention_tc_emu.py for crates/tensor/src/cuda/kernels/attention_tc.cu,
attention_tc_bwd_emu.py for attention_tc_bwd.cu): the two operand formats (Format: BF16 and
FP16, the kernels' F16 = false / true) with their rounding as cvt.rn (nearest even, a NaN the
canonical one), register packing and decoding, mma.m16n8k16 on the PTX ISA's fragment layouts
for either format, ex2.approx and fmaf, shared memory filled with garbage, cp.async into it
(commit groups, wait_group, two landing policies) with a check of every read and copy against
the barriers, ldmatrix.x4 from it, the causal key count of a query block, and the threads' walk
over a tile's 16-byte pieces (8 elements of 16 bits). Lanes are numpy vectors of 32; a CTA's
threads numpy vectors of THREADS.
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
    """bf16 bits (the lower 16 of each uint32) as fp32, exactly."""
    return (np.asarray(b, dtype=np.uint32) << 16).view(np.float32)


def fp16_bits(x):
    """cvt.rn.f16.f32: round to nearest even, numpy's float32 -> float16 conversion (which is
    that, subnormals kept: fp16 has them, and cvt.rn without .ftz keeps them; beyond 65504 it
    gives +-inf, as cvt.rn does without .satfinite); a NaN becomes the canonical NaN 0x7FFF."""
    x = np.asarray(x, dtype=np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        u = x.astype(np.float16).view(np.uint16).astype(np.uint32)
    return np.where(np.isnan(x), 0x7FFF, u).astype(np.uint32)


def fp16_f32(b):
    """fp16 bits (the lower 16 of each uint32) as fp32, exactly (subnormals included)."""
    return (np.asarray(b, dtype=np.uint32) & 0xFFFF).astype(np.uint16).view(np.float16) \
        .astype(np.float32)


class Format:
    """An operand format of the kernels: 16-bit floats, two to a 32-bit register (the
    lower-indexed element in the lower half), fp32 rounded to it by cvt.rn (tn_pack / tb_pack),
    multiplied by mma.m16n8k16 into fp32 (tn_mma / tb_mma). `bits`: fp32 -> the 16 bits (as
    uint32), round to nearest even; `f32`: the 16 bits -> fp32, exact."""

    def __init__(self, name, bits, f32):
        self.name, self.bits, self.f32 = name, bits, f32

    def __repr__(self):
        return self.name

    def round(self, x):
        """fp32 values rounded to the format (as fp32)."""
        return self.f32(self.bits(x))

    def u16(self, x):
        """The bits of fp32 values as the kernels take them (u16), rounded once, as the caller
        does before the launch."""
        return self.bits(x).astype(np.uint16)

    def pack(self, lo, hi):
        """tn_pack / tb_pack: cvt.rn.{bf16x2,f16x2}.f32, `lo` in the lower 16 bits."""
        return self.bits(lo) | (self.bits(hi) << 16)

    def halves(self, r):
        """Registers (uint32, any shape [..]) as their two elements, [2, ..] fp32: the lower
        half, then the upper."""
        r = np.asarray(r, dtype=np.uint32)
        return self.f32(np.stack([r & 0xFFFF, r >> 16]))


BF16 = Format("bf16", bf16_bits, bits_f32)  # F16 = false: .bf16 operands, cvt.rn.bf16x2.f32
FP16 = Format("fp16", fp16_bits, fp16_f32)  # F16 = true: .f16 operands, cvt.rn.f16x2.f32
FORMATS = (BF16, FP16)

# The fragments of mma.m16n8k16 (PTX ISA, "Matrix Fragments for mma.m16n8k16"), in the order
# of Format.halves of the registers stacked as a0..a3, b0, b1: (row, column) of each element.
_A_RC = [(G, 2 * T), (G, 2 * T + 1), (G + 8, 2 * T), (G + 8, 2 * T + 1),
         (G, 2 * T + 8), (G, 2 * T + 9), (G + 8, 2 * T + 8), (G + 8, 2 * T + 9)]
_A_ROW = np.stack([rc[0] for rc in _A_RC])
_A_COL = np.stack([rc[1] for rc in _A_RC])
_B_ROW = np.stack([2 * T, 2 * T + 1, 2 * T + 8, 2 * T + 9])
_B_COL = np.stack([G, G, G, G])
_D_ROW = np.stack([G, G, G + 8, G + 8])
_D_COL = np.stack([2 * T, 2 * T + 1, 2 * T, 2 * T + 1])


def mma(d, a, b0, b1, fmt):
    """mma.sync.aligned.m16n8k16.row.col.f32.{bf16.bf16,f16.f16}.f32 (`fmt`): d: [4][32]
    float32 (modified), a: 4 regs, b0, b1 regs; the products exact, the sum rounded once to
    fp32."""
    h = fmt.halves(np.stack([a[0], a[1], a[2], a[3], b0, b1]))  # [2][6][32]
    h = h.transpose(1, 0, 2).reshape(12, 32)  # a0 lo, a0 hi, a1 lo, .., b1 hi
    A = np.zeros((16, 16))
    B = np.zeros((16, 8))
    A[_A_ROW, _A_COL] = h[:8]
    B[_B_ROW, _B_COL] = h[8:]
    with np.errstate(invalid="ignore", over="ignore"):
        C = (A @ B)[_D_ROW, _D_COL]
        for i in range(4):
            d[i] = (d[i] + C[i]).astype(np.float32)


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
    written shows), and the state of every 4-byte word for the race check: the barriers are
    the bounds of phases (`barrier()` starts the next one); within a phase the threads are
    unordered, so a word may not be both read and the target of a cp.async in one phase, nor
    read while a copy to it is in flight, nor before the phase after the one in which the
    copy's thread waited for it (cp.async.wait_group makes a copy visible to its own thread;
    the barrier after it, to the others: the kernels' threads always wait, then barrier)."""

    def __init__(self, nbytes, fill):
        assert nbytes % 16 == 0
        self.buf = np.full(nbytes, fill, dtype=np.uint8)
        self.n = nbytes
        self.phase = 0
        self.inflight = np.zeros(nbytes // 4, dtype=bool)  # a copy to the word is pending
        self.ready = np.full(nbytes // 4, -1)  # the phase its last copy was waited for in
        self.last_read = np.full(nbytes // 4, -1)  # the last phase it was read in

    def u16(self):
        return self.buf.view(np.uint16)

    def f32(self):
        return self.buf.view(np.float32)

    def barrier(self):
        """__syncthreads(): the next phase."""
        self.phase += 1

    def read(self, lo, nbytes):
        """Every thread of a warp (or CTA) reads `nbytes` at byte addresses `lo` (array)."""
        lo = np.asarray(lo).reshape(-1)
        assert np.all(lo % 4 == 0) and nbytes % 4 == 0
        assert np.all(lo >= 0) and np.all(lo + nbytes <= self.n), lo
        w = (lo[:, None] // 4 + np.arange(nbytes // 4)).reshape(-1)
        assert not self.inflight[w].any(), \
            f"read of shared bytes {4 * w[self.inflight[w]][:4]} while a cp.async to them flies"
        assert np.all(self.ready[w] < self.phase), \
            f"read of shared bytes {4 * w[self.ready[w] >= self.phase][:4]} with no barrier " \
            "after the wait for their copy"
        self.last_read[w] = self.phase


    def write(self, addr, words):
        """Every thread of a warp stores one 32-bit word each: `addr` [32] byte addresses,
        `words` [32] uint32. A word may not be written while a copy to it flies, nor in a
        phase in which it is read (no barrier between), and is read only after a barrier that
        follows the store (the other warps' reads)."""
        addr = np.asarray(addr).reshape(-1)
        assert np.all(addr % 4 == 0) and np.all(addr >= 0) and np.all(addr + 4 <= self.n), addr
        w = addr // 4
        assert len(np.unique(w)) == w.size, "two lanes store to one shared word"
        assert not self.inflight[w].any(), "a store to shared bytes a cp.async flies to"
        assert not np.any(self.last_read[w] == self.phase), \
            "a store to shared bytes read in the same phase (no barrier between)"
        self.buf.view(np.uint32)[w] = np.asarray(words, np.uint32)
        self.ready[w] = self.phase


class CpAsync:
    """cp.async of a CTA whose threads all issue, commit and wait together (as these kernels
    do: the group counts are CTA-uniform), so one list of commit groups serves every thread.
    `late`: a copy lands at the wait_group that covers it (the latest the PTX ISA allows: a
    read before it sees the garbage); else when issued (the earliest: a copy into bytes still
    to be read overwrites them). The race check (Smem) holds under either."""

    def __init__(self, sm, late):
        self.sm, self.late = sm, late
        self.open, self.groups = [], []

    def copy(self, dst, src, src_idx, valid, size, region):
        """cp.async.{cg,ca}.shared.global [dst], [src + src_idx], size, valid ? size : 0 for
        the threads given as arrays: dst byte addresses, src a flat numpy array (the global
        tensor), src_idx element indices into it, valid whether the source is read (else the
        `size` bytes are zero-filled). `region`: the byte range (lo, hi) dst must lie in."""
        sm = self.sm
        dst, src_idx = np.asarray(dst), np.asarray(src_idx)
        valid = np.broadcast_to(np.asarray(valid, bool), dst.shape)
        lo, hi = region
        assert np.all(dst % size == 0) and np.all(dst >= lo) and np.all(dst + size <= hi), dst
        per = size // src.itemsize  # elements a copy
        # The source address is formed (aligned, inside the tensor) even for src-size 0.
        assert np.all((src_idx * src.itemsize) % size == 0), "unaligned cp.async source"
        assert np.all(src_idx >= 0) and np.all(src_idx + per <= src.size)
        w = (dst[:, None] // 4 + np.arange(size // 4)).reshape(-1)
        assert len(np.unique(w)) == w.size, "two copies of one cp.async batch to one word"
        assert not sm.inflight[w].any(), "a cp.async to shared bytes another still flies to"
        assert not np.any(sm.last_read[w] == sm.phase), \
            "a cp.async to shared bytes read in the same phase (no barrier between)"
        vals = np.where(valid[:, None], src[src_idx[:, None] + np.arange(per)],
                        np.zeros(1, src.dtype))
        rec = (dst, vals.astype(src.dtype), w)
        sm.inflight[w] = True
        if not self.late:
            self._land(rec)
        self.open.append(rec)

    def _land(self, rec):
        dst, vals, _ = rec
        b = vals.view(np.uint8).reshape(len(dst), -1)
        self.sm.buf[dst[:, None] + np.arange(b.shape[1])] = b

    def commit(self):
        """cp.async.commit_group (a group with no copy is empty, as the PTX ISA says)."""
        self.groups.append(self.open)
        self.open = []

    def wait(self, n):
        """cp.async.wait_group n: every group but the newest n completes."""
        while len(self.groups) > n:
            for rec in self.groups.pop(0):
                if self.late:
                    self._land(rec)
                self.sm.inflight[rec[2]] = False
                self.sm.ready[rec[2]] = self.sm.phase

    def idle(self):
        """No copy issued but not committed, nor in flight (at the end of a CTA)."""
        return not self.open and not any(self.groups)


def ldsm_x4(sm, addr, trans=False, region=None):
    """addr: [32] byte addresses; returns 4 registers, each [32] uint32. `region`: the byte
    range (lo, hi) the 16-byte rows must lie in (the tile read), if given."""
    assert np.all(addr % 16 == 0) and np.all(addr >= 0) and np.all(addr + 16 <= sm.n), addr
    if region is not None:
        assert np.all(addr >= region[0]) and np.all(addr + 16 <= region[1]), addr
    sm.read(addr, 16)
    # rows[i, r]: the 8 16-bit elements at lane 8 i + r's address (row r of matrix i).
    rows = sm.u16()[(addr // 2)[:, None] + np.arange(8)].astype(np.uint32).reshape(4, 8, 8)
    if trans:
        a, b = rows[:, 2 * T, G], rows[:, 2 * T + 1, G]
    else:
        a, b = rows[:, G, 2 * T], rows[:, G, 2 * T + 1]
    return list(a | (b << 16))


def ld_u32(x, idx, ok):
    """A 32-bit load of two 16-bit elements (idx, idx + 1 of the u16 array x; the
    lower-indexed in the lower half) where `ok`, else 0 (no load)."""
    i = np.where(ok, idx, 0)
    assert np.all(i % 2 == 0), "unaligned 32-bit load"
    assert np.all(np.where(ok, (i >= 0) & (i + 2 <= x.size), True))
    return np.where(ok, x[i].astype(np.uint32) | (x[i + 1].astype(np.uint32) << 16),
                    0).astype(np.uint32)


def keys_seen(i_end, Sk, causal, q_start, k_start):
    """tn_keys_seen / tb_keys_seen: keys a query block ending at row `i_end` sees."""
    if not causal:
        return Sk
    v = q_start + i_end - k_start
    return 0 if v < 0 else min(v, Sk)


class Pieces:
    """TnPieces / TbPieces: every thread of the CTA at once (arrays over threadIdx.x) walking
    a tile's 16-byte pieces of 8 elements (bf16 or fp16), D / 8 a row."""

    def __init__(self, D):
        self.cpr = D >> 3
        self.r = TID // self.cpr
        self.c = TID - self.r * self.cpr
        self.dr = THREADS // self.cpr
        self.dc = THREADS - self.dr * self.cpr

    def advance(self, r, c):
        c = c + self.dc
        r = r + self.dr
        carry = c >= self.cpr
        return np.where(carry, r + 1, r), np.where(carry, c - self.cpr, c)


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


# Document masks (causal): B, Sq, Sk, H, Hkv, D, q_start, k_start, each sequence's document
# openings. Boundaries inside a warp's 16 rows and a CTA's 64, on a tile's edge and one either
# side, one-token documents; query blocks after their key block (context parallelism), with
# documents opening before, inside and after the keys; every key in an earlier document than
# every query (nothing seen); a CTA whose first key tile is past the first (jt0 > 0). No row
# sees exactly one key: there dS = P (dP - delta) = dP - delta is zero but for the rounding of
# dO (to the format for dP, fp32 for delta), so the kernel and the reference would compare
# rounding noise with rounding noise (in fp16, 3e-4 of a tiny largest gradient).
DOC_CASES = [  # the forward's and the backward's emulators run them all
    (2, 150, 150, 2, 1, 64, 0, 0, [[0, 1, 2, 63, 64, 65, 100, 149], [0, 37]]),
    (1, 200, 200, 2, 2, 128, 0, 0, [[0, 50, 120, 127, 128, 129, 180]]),
    (1, 100, 80, 4, 2, 32, 128, 20, [[0, 10, 60, 90, 150, 210]]),
    (1, 40, 40, 2, 1, 16, 40, 0, [[0, 40]]),
    (1, 130, 130, 2, 1, 48, 0, 0, [[0, 70, 71, 72, 73, 74, 75, 76, 77, 78, 79, 80, 81, 82]]),
    (1, 70, 200, 2, 1, 96, 130, 0, [[0, 5, 135, 160]]),
]


def doc_starts(opens, Sq, q_start):
    """[B, Sq]: the start of each query's document (global positions)."""
    return np.array([[max(o for o in row if o <= q_start + i) for i in range(Sq)]
                     for row in opens], dtype=np.int64)


def doc_bounds(doc_start, Sq, Sk, k_start):
    """(key_lo [B * Sq], q_end [B * Sk]) as tensor::cuda::doc_mask::bounds makes them (keep it
    in step): key_lo = clamp(doc_start - k_start, 0, Sk), q_end[j] = #{i: doc_start[i] <=
    k_start + j}."""
    assert np.all(np.diff(doc_start, axis=1) >= 0), "starts must not decrease"
    key_lo = np.clip(doc_start - k_start, 0, Sk).reshape(-1)
    q_end = np.array([[int((row <= k_start + j).sum()) for j in range(Sk)] for row in doc_start])
    return key_lo, q_end.reshape(-1)
