//! Scaled dot-product attention with grouped KV heads, computed tile by tile with an online
//! softmax (FlashAttention-2): the `q_len × kv_len` score matrix is never materialised.
//!
//! Layouts (row-major): `q`, `out`, `dq`: `[batch, q_len, n_heads, head_dim]` (as the q
//! projection emits them); `k`, `v`, `dk`, `dv`: `[batch, kv_len, n_kv_heads, head_dim]`;
//! `lse`: `[batch, n_heads, q_len]`. Query head `h` reads KV head `h / (n_heads / n_kv_heads)`.
//!
//! Math, per (batch, head), with `s = 1/sqrt(head_dim)`:
//! `S = s·Q·Kᵀ` (masked), `lse_i = log Σ_j exp(S_ij)`, `P = exp(S − lse)`, `O = P·V`.
//! The forward keeps per-row running max `m`, sum `l` and unnormalised output `acc`; a new
//! key tile with scores `S̃` updates `m' = max(m, max S̃)`, `l' = l·e^(m−m') + Σ e^(S̃−m')`,
//! `acc' = acc·e^(m−m') + e^(S̃−m')·V`; at the end `O = acc / l`, `lse = m + log l`.
//! Backward (recomputing `P` from `lse`), with `Dᵢ = Σ_d dOᵢ·Oᵢ`:
//! `dV = Pᵀ·dO`, `dP = dO·Vᵀ`, `dS = P∘(dP − D)`, `dQ = s·dS·K`, `dK = s·dSᵀ·Q`.
//!
//! Causality uses global positions: query `i` is at `q_start + i`, key `j` at `k_start + j`,
//! and key `j` is visible to query `i` iff `k_start + j <= q_start + i`. A query block can so
//! attend to a key block from elsewhere in the sequence (ring / context parallelism); a query
//! that sees no key gets `out = 0`, `lse = −∞`, which [`merge_partial`] treats as "no
//! contribution".

use crate::error::check_len;
use crate::microkernel::{mm_nn, mm_tn_acc};
use crate::threads;
use crate::TensorError;
use rayon::prelude::*;

/// Problem shape of one attention call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttnShape {
    pub batch: usize,
    pub q_len: usize,
    pub kv_len: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    /// Mask keys after the query (by global position).
    pub causal: bool,
    /// Global position of query 0.
    pub q_start: usize,
    /// Global position of key 0.
    pub k_start: usize,
}

impl AttnShape {
    /// Plain causal self-attention over one block (`q_len == kv_len`, no offsets).
    pub fn causal(
        batch: usize,
        seq: usize,
        n_heads: usize,
        n_kv_heads: usize,
        head_dim: usize,
    ) -> AttnShape {
        AttnShape {
            batch,
            q_len: seq,
            kv_len: seq,
            n_heads,
            n_kv_heads,
            head_dim,
            causal: true,
            q_start: 0,
            k_start: 0,
        }
    }

    /// Elements of `q` / `out` / `dq`.
    pub fn q_elems(&self) -> usize {
        self.batch * self.q_len * self.n_heads * self.head_dim
    }

    /// Elements of `k` / `v` / `dk` / `dv`.
    pub fn kv_elems(&self) -> usize {
        self.batch * self.kv_len * self.n_kv_heads * self.head_dim
    }

    /// Elements of `lse`.
    pub fn lse_elems(&self) -> usize {
        self.batch * self.n_heads * self.q_len
    }

    /// The softmax scale `1/sqrt(head_dim)`.
    pub fn scale(&self) -> f32 {
        1.0 / (self.head_dim as f32).sqrt()
    }

    /// Number of keys visible to query `i` is `visible_keys(i)`: keys `0..visible_keys(i)`.
    #[inline]
    pub fn visible_keys(&self, i: usize) -> usize {
        if !self.causal {
            return self.kv_len;
        }
        // k_start + j <= q_start + i  <=>  j < q_start + i + 1 - k_start
        (self.q_start + i + 1)
            .saturating_sub(self.k_start)
            .min(self.kv_len)
    }

    /// Number of (query, key) pairs that are not masked, over all batches and heads.
    pub fn visible_pairs(&self) -> u64 {
        let per_head: u64 = (0..self.q_len).map(|i| self.visible_keys(i) as u64).sum();
        per_head * (self.batch * self.n_heads) as u64
    }

    /// Useful FLOPs `(forward, backward)`: forward does 2 products of `2·head_dim` flops per
    /// visible pair (`Q·Kᵀ`, `P·V`), backward 5 (`Q·Kᵀ` recompute, `dV`, `dP`, `dQ`, `dK`).
    pub fn flops(&self) -> (f64, f64) {
        let pairs = self.visible_pairs() as f64;
        let d = self.head_dim as f64;
        (4.0 * d * pairs, 10.0 * d * pairs)
    }

    fn validate(&self) -> Result<(), TensorError> {
        if self.head_dim == 0 || self.n_heads == 0 || self.n_kv_heads == 0 {
            return Err(TensorError::Shape(format!(
                "attention: zero-sized dimension in {self:?}"
            )));
        }
        if !self.n_heads.is_multiple_of(self.n_kv_heads) {
            return Err(TensorError::Shape(format!(
                "attention: n_heads {} is not a multiple of n_kv_heads {}",
                self.n_heads, self.n_kv_heads
            )));
        }
        Ok(())
    }
}

/// Tile sizes (rows of queries and keys processed together).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttnTiles {
    pub q_tile: usize,
    pub k_tile: usize,
}

impl Default for AttnTiles {
    fn default() -> Self {
        AttnTiles {
            q_tile: 64,
            k_tile: 64,
        }
    }
}

impl AttnTiles {
    fn validate(&self) -> Result<(), TensorError> {
        if self.q_tile == 0 || self.k_tile == 0 {
            return Err(TensorError::Shape(format!(
                "attention tiles must be positive: {self:?}"
            )));
        }
        Ok(())
    }
}

/// Shared raw pointer for tasks that write disjoint parts of one output buffer.
#[derive(Clone, Copy)]
struct SyncPtr(*mut f32);
// SAFETY: every use documents why concurrent tasks touch disjoint elements.
unsafe impl Send for SyncPtr {}
unsafe impl Sync for SyncPtr {}

/// Copies head `h` of a `[batch, len, heads, d]` tensor (batch `b`) into `dst [len, d]`,
/// multiplied by `mul`.
#[allow(clippy::too_many_arguments)]
fn gather_head(
    src: &[f32],
    b: usize,
    len: usize,
    heads: usize,
    h: usize,
    d: usize,
    mul: f32,
    dst: &mut [f32],
) {
    for i in 0..len {
        let s = &src[((b * len + i) * heads + h) * d..][..d];
        for (o, &x) in dst[i * d..(i + 1) * d].iter_mut().zip(s) {
            *o = x * mul;
        }
    }
}

/// Transposed gather: `dst [d, len]` with `dst[c, j] = src[b, j, h, c]`.
#[allow(clippy::too_many_arguments)]
fn gather_head_t(
    src: &[f32],
    b: usize,
    len: usize,
    heads: usize,
    h: usize,
    d: usize,
    dst: &mut [f32],
) {
    for j in 0..len {
        let s = &src[((b * len + j) * heads + h) * d..][..d];
        for (c, &x) in s.iter().enumerate() {
            dst[c * len + j] = x;
        }
    }
}

/// Adds `mul · src [len, d]` into head `h` (batch `b`) of the `[batch, len, heads, d]` buffer
/// behind `dst`.
///
/// # Safety
/// `dst` must point to a buffer of `batch·len·heads·d` elements, and no other thread may access
/// the (b, h) slice concurrently.
#[allow(clippy::too_many_arguments)]
unsafe fn scatter_add_head(
    dst: SyncPtr,
    src: &[f32],
    b: usize,
    len: usize,
    heads: usize,
    h: usize,
    d: usize,
    mul: f32,
) {
    for i in 0..len {
        let o = std::slice::from_raw_parts_mut(dst.0.add(((b * len + i) * heads + h) * d), d);
        for (o, &x) in o.iter_mut().zip(&src[i * d..(i + 1) * d]) {
            *o += mul * x;
        }
    }
}

/// Masks the score tile `s [bq, bk]` (row stride `bk`) for queries `i0..` and keys `j0..`:
/// entries with key index `>= visible_keys(i)` become `−∞`.
fn mask_tile(shape: &AttnShape, s: &mut [f32], i0: usize, bq: usize, j0: usize, bk: usize) {
    for r in 0..bq {
        let vis = shape.visible_keys(i0 + r);
        let first_masked = vis.saturating_sub(j0).min(bk);
        s[r * bk + first_masked..(r + 1) * bk].fill(f32::NEG_INFINITY);
    }
}

/// Forward. Writes `out` (`[batch, q_len, n_heads, head_dim]`) and `lse`
/// (`[batch, n_heads, q_len]`, natural log; `−∞` for queries that see no key).
pub fn attention_forward(
    shape: &AttnShape,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    out: &mut [f32],
    lse: &mut [f32],
    tiles: AttnTiles,
) -> Result<(), TensorError> {
    shape.validate()?;
    tiles.validate()?;
    check_len("attention q", q.len(), shape.q_elems())?;
    check_len("attention k", k.len(), shape.kv_elems())?;
    check_len("attention v", v.len(), shape.kv_elems())?;
    check_len("attention out", out.len(), shape.q_elems())?;
    check_len("attention lse", lse.len(), shape.lse_elems())?;
    let s = *shape;
    let (sq, sk, d) = (s.q_len, s.kv_len, s.head_dim);
    let group = s.n_heads / s.n_kv_heads;
    let scale = s.scale();
    let out_ptr = SyncPtr(out.as_mut_ptr());
    threads::install(|| {
        // One task per (batch, head): it owns out[b, :, h, :] and lse[b, h, :].
        lse.par_chunks_mut(sq.max(1))
            .take(s.batch * s.n_heads)
            .enumerate()
            .for_each(|(bh, lse_row)| {
                let (b, h) = (bh / s.n_heads, bh % s.n_heads);
                let kvh = h / group;
                // Keys beyond what the last query sees are never needed.
                let n_keys = if sq == 0 { 0 } else { s.visible_keys(sq - 1) };
                let mut qs = vec![0.0f32; sq * d];
                let mut kt = vec![0.0f32; d * sk];
                let mut vv = vec![0.0f32; sk * d];
                gather_head(q, b, sq, s.n_heads, h, d, scale, &mut qs);
                gather_head_t(k, b, sk, s.n_kv_heads, kvh, d, &mut kt);
                gather_head(v, b, sk, s.n_kv_heads, kvh, d, 1.0, &mut vv);
                let mut o = vec![0.0f32; sq * d];
                let mut st = vec![0.0f32; tiles.q_tile * tiles.k_tile];
                let mut m = vec![0.0f32; tiles.q_tile];
                let mut l = vec![0.0f32; tiles.q_tile];
                for i0 in (0..sq).step_by(tiles.q_tile) {
                    let bq = tiles.q_tile.min(sq - i0);
                    m[..bq].fill(f32::NEG_INFINITY);
                    l[..bq].fill(0.0);
                    let acc = &mut o[i0 * d..(i0 + bq) * d];
                    let kend = s.visible_keys(i0 + bq - 1).min(n_keys);
                    for j0 in (0..kend).step_by(tiles.k_tile) {
                        let bk = tiles.k_tile.min(kend - j0);
                        let st = &mut st[..bq * bk];
                        // S̃ = (s·Q) · Kᵀ for this tile
                        mm_nn(st, bk, &qs[i0 * d..], d, &kt[j0..], sk, bq, d, bk, false);
                        if s.causal && s.visible_keys(i0) < j0 + bk {
                            mask_tile(&s, st, i0, bq, j0, bk);
                        }
                        for r in 0..bq {
                            let row = &mut st[r * bk..(r + 1) * bk];
                            let tmax = row.iter().fold(f32::NEG_INFINITY, |a, &x| a.max(x));
                            let m_new = m[r].max(tmax);
                            if m_new == f32::NEG_INFINITY {
                                // Nothing visible yet in this row: contributes zero.
                                row.fill(0.0);
                                continue;
                            }
                            let alpha = (m[r] - m_new).exp();
                            let mut sum = 0.0f32;
                            for x in row.iter_mut() {
                                *x = (*x - m_new).exp();
                                sum += *x;
                            }
                            l[r] = l[r] * alpha + sum;
                            m[r] = m_new;
                            if alpha != 1.0 {
                                acc[r * d..(r + 1) * d].iter_mut().for_each(|a| *a *= alpha);
                            }
                        }
                        // acc += P̃ · V
                        mm_nn(acc, d, st, bk, &vv[j0 * d..], d, bq, bk, d, true);
                    }
                    for r in 0..bq {
                        if l[r] > 0.0 {
                            let inv = 1.0 / l[r];
                            acc[r * d..(r + 1) * d].iter_mut().for_each(|a| *a *= inv);
                            lse_row[i0 + r] = m[r] + l[r].ln();
                        } else {
                            acc[r * d..(r + 1) * d].fill(0.0);
                            lse_row[i0 + r] = f32::NEG_INFINITY;
                        }
                    }
                }
                // SAFETY: this task is the only one touching out[b, :, h, :]; out has
                // q_elems() elements (checked above). It was not read, so write = 0 + o.
                unsafe {
                    zero_head(out_ptr, b, sq, s.n_heads, h, d);
                    scatter_add_head(out_ptr, &o, b, sq, s.n_heads, h, d, 1.0);
                }
            });
    });
    Ok(())
}

/// # Safety
/// As for [`scatter_add_head`].
unsafe fn zero_head(dst: SyncPtr, b: usize, len: usize, heads: usize, h: usize, d: usize) {
    for i in 0..len {
        std::slice::from_raw_parts_mut(dst.0.add(((b * len + i) * heads + h) * d), d).fill(0.0);
    }
}

/// Backward. Given the forward's `out` and `lse` and the output gradient `dout`, accumulates
/// (`+=`) into `dq`, `dk` and `dv` (zero them first for a plain gradient). Accumulating all three
/// lets ring attention sum the contributions of every key block.
///
/// For a partial call (ring attention: this key block is one of several), pass the *final*
/// merged `out` and `lse` over all key blocks: then `P = exp(S − lse)` is the true probability
/// and the per-block gradients add up to the full gradient.
#[allow(clippy::too_many_arguments)]
pub fn attention_backward(
    shape: &AttnShape,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    out: &[f32],
    lse: &[f32],
    dout: &[f32],
    dq: &mut [f32],
    dk: &mut [f32],
    dv: &mut [f32],
    tiles: AttnTiles,
) -> Result<(), TensorError> {
    shape.validate()?;
    tiles.validate()?;
    for (what, buf) in [
        ("attention q", q),
        ("attention out", out),
        ("attention dout", dout),
    ] {
        check_len(what, buf.len(), shape.q_elems())?;
    }
    check_len("attention dq", dq.len(), shape.q_elems())?;
    check_len("attention k", k.len(), shape.kv_elems())?;
    check_len("attention v", v.len(), shape.kv_elems())?;
    check_len("attention dk", dk.len(), shape.kv_elems())?;
    check_len("attention dv", dv.len(), shape.kv_elems())?;
    check_len("attention lse", lse.len(), shape.lse_elems())?;
    let s = *shape;
    let (sq, sk, d) = (s.q_len, s.kv_len, s.head_dim);
    let group = s.n_heads / s.n_kv_heads;
    let scale = s.scale();
    let (dq_ptr, dk_ptr, dv_ptr) = (
        SyncPtr(dq.as_mut_ptr()),
        SyncPtr(dk.as_mut_ptr()),
        SyncPtr(dv.as_mut_ptr()),
    );
    threads::install(|| {
        // One task per (batch, kv head): it owns dk/dv[b, :, kvh, :] and dq[b, :, h, :] for the
        // query heads h of its group, so no two tasks write the same element.
        (0..s.batch * s.n_kv_heads)
            .into_par_iter()
            .for_each(|task| {
                let (b, kvh) = (task / s.n_kv_heads, task % s.n_kv_heads);
                let n_keys = if sq == 0 { 0 } else { s.visible_keys(sq - 1) };
                let mut kk = vec![0.0f32; sk * d];
                let mut kt = vec![0.0f32; d * sk];
                let mut vt = vec![0.0f32; d * sk];
                gather_head(k, b, sk, s.n_kv_heads, kvh, d, 1.0, &mut kk);
                gather_head_t(k, b, sk, s.n_kv_heads, kvh, d, &mut kt);
                gather_head_t(v, b, sk, s.n_kv_heads, kvh, d, &mut vt);
                let mut dkl = vec![0.0f32; sk * d];
                let mut dvl = vec![0.0f32; sk * d];
                let mut qs = vec![0.0f32; sq * d];
                let mut o = vec![0.0f32; sq * d];
                let mut dov = vec![0.0f32; sq * d];
                let mut dql = vec![0.0f32; sq * d];
                let mut delta = vec![0.0f32; sq];
                let mut p = vec![0.0f32; tiles.q_tile * tiles.k_tile];
                let mut dp = vec![0.0f32; tiles.q_tile * tiles.k_tile];
                for h in kvh * group..(kvh + 1) * group {
                    gather_head(q, b, sq, s.n_heads, h, d, scale, &mut qs);
                    gather_head(out, b, sq, s.n_heads, h, d, 1.0, &mut o);
                    gather_head(dout, b, sq, s.n_heads, h, d, 1.0, &mut dov);
                    let lse_row = &lse[(b * s.n_heads + h) * sq..][..sq];
                    for i in 0..sq {
                        delta[i] = dov[i * d..(i + 1) * d]
                            .iter()
                            .zip(&o[i * d..(i + 1) * d])
                            .map(|(a, b)| a * b)
                            .sum();
                    }
                    dql.fill(0.0);
                    for i0 in (0..sq).step_by(tiles.q_tile) {
                        let bq = tiles.q_tile.min(sq - i0);
                        let kend = s.visible_keys(i0 + bq - 1).min(n_keys);
                        for j0 in (0..kend).step_by(tiles.k_tile) {
                            let bk = tiles.k_tile.min(kend - j0);
                            let p = &mut p[..bq * bk];
                            let dp = &mut dp[..bq * bk];
                            // P = exp(s·Q·Kᵀ − lse)
                            mm_nn(p, bk, &qs[i0 * d..], d, &kt[j0..], sk, bq, d, bk, false);
                            if s.causal && s.visible_keys(i0) < j0 + bk {
                                mask_tile(&s, p, i0, bq, j0, bk);
                            }
                            for r in 0..bq {
                                let l = lse_row[i0 + r];
                                let row = &mut p[r * bk..(r + 1) * bk];
                                if l == f32::NEG_INFINITY {
                                    row.fill(0.0);
                                } else {
                                    row.iter_mut().for_each(|x| *x = (*x - l).exp());
                                }
                            }
                            // dV += Pᵀ·dO
                            mm_tn_acc(&mut dvl[j0 * d..], d, p, bk, &dov[i0 * d..], d, bk, bq, d);
                            // dP = dO·Vᵀ ; dS = P∘(dP − D)  (stored in dp)
                            mm_nn(dp, bk, &dov[i0 * d..], d, &vt[j0..], sk, bq, d, bk, false);
                            for r in 0..bq {
                                let dl = delta[i0 + r];
                                for (x, &pv) in dp[r * bk..(r + 1) * bk]
                                    .iter_mut()
                                    .zip(&p[r * bk..(r + 1) * bk])
                                {
                                    *x = pv * (*x - dl);
                                }
                            }
                            // dQ += dS·K (scaled by s at the end); dK += dSᵀ·(s·Q)
                            mm_nn(
                                &mut dql[i0 * d..],
                                d,
                                dp,
                                bk,
                                &kk[j0 * d..],
                                d,
                                bq,
                                bk,
                                d,
                                true,
                            );
                            mm_tn_acc(&mut dkl[j0 * d..], d, dp, bk, &qs[i0 * d..], d, bk, bq, d);
                        }
                    }
                    // SAFETY: dq[b, :, h, :] belongs to this task only (h is in its group).
                    unsafe { scatter_add_head(dq_ptr, &dql, b, sq, s.n_heads, h, d, scale) };
                }
                // SAFETY: dk/dv[b, :, kvh, :] belong to this task only.
                unsafe {
                    scatter_add_head(dk_ptr, &dkl, b, sk, s.n_kv_heads, kvh, d, 1.0);
                    scatter_add_head(dv_ptr, &dvl, b, sk, s.n_kv_heads, kvh, d, 1.0);
                }
            });
    });
    Ok(())
}

/// Merges two partial attention results over disjoint key sets into the first one:
/// `lse = log(e^lse_a + e^lse_b)`, `out = out_a·e^(lse_a − lse) + out_b·e^(lse_b − lse)`.
/// Layouts as in [`attention_forward`]; a side with `lse = −∞` contributes nothing.
#[allow(clippy::too_many_arguments)]
pub fn merge_partial(
    out_acc: &mut [f32],
    lse_acc: &mut [f32],
    out_other: &[f32],
    lse_other: &[f32],
    batch: usize,
    q_len: usize,
    n_heads: usize,
    head_dim: usize,
) -> Result<(), TensorError> {
    let n_out = batch * q_len * n_heads * head_dim;
    let n_lse = batch * n_heads * q_len;
    check_len("merge out_acc", out_acc.len(), n_out)?;
    check_len("merge out_other", out_other.len(), n_out)?;
    check_len("merge lse_acc", lse_acc.len(), n_lse)?;
    check_len("merge lse_other", lse_other.len(), n_lse)?;
    if head_dim == 0 {
        return Ok(());
    }
    // Weights per (b, h, i) first (lse is [b, h, i]); then rows of out ([b, i, h, :]).
    let mut wa = vec![0.0f32; n_lse];
    let mut wb = vec![0.0f32; n_lse];
    for idx in 0..n_lse {
        let (la, lb) = (lse_acc[idx], lse_other[idx]);
        let m = la.max(lb);
        if m == f32::NEG_INFINITY {
            wa[idx] = 1.0;
            wb[idx] = 0.0;
            continue;
        }
        let (ea, eb) = ((la - m).exp(), (lb - m).exp());
        let sum = ea + eb;
        wa[idx] = ea / sum;
        wb[idx] = eb / sum;
        lse_acc[idx] = m + sum.ln();
    }
    threads::install(|| {
        out_acc
            .par_chunks_mut(head_dim)
            .zip(out_other.par_chunks(head_dim))
            .enumerate()
            .with_min_len(64)
            .for_each(|(row, (oa, ob))| {
                // row = (b·q_len + i)·n_heads + h
                let h = row % n_heads;
                let bi = row / n_heads;
                let (b, i) = (bi / q_len, bi % q_len);
                let idx = (b * n_heads + h) * q_len + i;
                let (x, y) = (wa[idx], wb[idx]);
                oa.iter_mut()
                    .zip(ob)
                    .for_each(|(a, &bv)| *a = *a * x + bv * y);
            });
    });
    Ok(())
}

#[cfg(test)]
mod tests;
