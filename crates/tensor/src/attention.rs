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
//!
//! Document masking (block-causal attention over packed documents, [`attention_forward_docs`]):
//! each query `i` also carries `doc_start[i]`, the position (same frame as `q_start`/`k_start`)
//! of the first token of its document, and sees key `j` iff
//! `doc_start[i] <= k_start + j <= q_start + i`. Documents are contiguous runs of positions, so
//! this interval is exactly "same document, not after the query". Per query tile the key loop
//! starts at the smallest `doc_start` of its rows (key tiles wholly before every row's document
//! are skipped, so packed short documents cost less than full causal attention); inside a tile
//! that straddles a row's document start, that row's earlier scores are set to `−∞` before the
//! softmax step, so `exp` gives exactly 0 there and forward and backward mask the same pairs.
//! Without a mask the kernels run as before (one untaken branch per key tile).

use crate::error::check_len;
use crate::microkernel::{
    dot, exp_tile, gather_t, mm, mm_raw, online_softmax_tile, prefetch_rows, softmax_grad_tile,
};
use crate::threads::{self, SyncPtr};
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

    /// Mask offset of the score tile for queries `i0..` and keys `j0..` (see
    /// [`visible_cols`](crate::microkernel::visible_cols)): query `i0 + r` sees tile columns
    /// `< vis0 + r`, i.e. keys `k_start + j0 + c <= q_start + i0 + r`.
    fn tile_vis0(&self, i0: usize, j0: usize) -> isize {
        if self.causal {
            (self.q_start + i0 + 1) as isize - (self.k_start + j0) as isize
        } else {
            isize::MAX
        }
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
    /// Short query tiles waste little work on the causal diagonal; long key tiles amortise the
    /// per-row softmax bookkeeping (max, sums, rescaling) over many scores. A `16 × 256` score
    /// tile is 16 KiB and stays in L1. Measured in docs/PERFORMANCE.md ("Attention").
    fn default() -> Self {
        AttnTiles {
            q_tile: 16,
            k_tile: 256,
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

/// Per-thread scratch buffer reused across tasks (avoids page-faulting fresh allocations in
/// every task). Taken out of the thread-local while in use, so re-entry just allocates.
fn with_scratch<R>(len: usize, f: impl FnOnce(&mut [f32]) -> R) -> R {
    thread_local! {
        static SCRATCH: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
    }
    let mut buf = SCRATCH.with(|c| std::mem::take(&mut *c.borrow_mut()));
    if buf.len() < len {
        buf.resize(len, 0.0);
    }
    let r = f(&mut buf[..len]);
    SCRATCH.with(|c| *c.borrow_mut() = buf);
    r
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
    attention_forward_docs(shape, None, q, k, v, out, lse, tiles)
}

/// Checks a document mask: one start per query (`[batch, q_len]`), on a causal shape (a
/// document mask narrows the causal window from below; without causality it is not defined).
fn check_doc_start(shape: &AttnShape, doc_start: Option<&[usize]>) -> Result<(), TensorError> {
    if let Some(ds) = doc_start {
        if !shape.causal {
            return Err(TensorError::Shape(
                "attention: a document mask needs causal attention".into(),
            ));
        }
        check_len("attention doc_start", ds.len(), shape.batch * shape.q_len)?;
    }
    Ok(())
}

/// The document starts of batch row `b`'s queries (`[q_len]`).
fn doc_row(doc_start: Option<&[usize]>, b: usize, sq: usize) -> Option<&[usize]> {
    doc_start.map(|ds| &ds[b * sq..(b + 1) * sq])
}

/// First key (local index) a query tile needs: the smallest document start among its rows
/// (`ds`, the tile's rows of [`doc_row`]), clamped to `[0, kend]`; 0 without a mask.
#[inline]
fn first_key(ds: Option<&[usize]>, k_start: usize, kend: usize) -> usize {
    ds.map_or(0, |ds| {
        let lo = ds.iter().copied().min().unwrap_or(0);
        lo.saturating_sub(k_start).min(kend)
    })
}

/// Sets to `−∞` the scores of the `[bq, bk]` tile whose key (position `key0 + c` for column
/// `c`) lies before its row's document start (`ds[r]`, row `r` of the tile). Only rows whose
/// document starts after `key0` have such columns: in a tile of one document that begins at
/// or before the tile's first key this writes nothing.
#[inline]
fn mask_before_documents(st: &mut [f32], bk: usize, ds: &[usize], key0: usize) {
    for (row, &start) in st.chunks_mut(bk).zip(ds) {
        let n = start.saturating_sub(key0).min(bk);
        row[..n].fill(f32::NEG_INFINITY);
    }
}

/// [`attention_forward`] with an optional document mask: `doc_start` (`[batch, q_len]`) gives,
/// per query, the position of its document's first token in the frame of `q_start` /
/// `k_start`; keys before it are masked (module doc). `None` is plain causal attention.
#[allow(clippy::too_many_arguments)]
pub fn attention_forward_docs(
    shape: &AttnShape,
    doc_start: Option<&[usize]>,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    out: &mut [f32],
    lse: &mut [f32],
    tiles: AttnTiles,
) -> Result<(), TensorError> {
    shape.validate()?;
    tiles.validate()?;
    check_doc_start(shape, doc_start)?;
    check_len("attention q", q.len(), shape.q_elems())?;
    check_len("attention k", k.len(), shape.kv_elems())?;
    check_len("attention v", v.len(), shape.kv_elems())?;
    check_len("attention out", out.len(), shape.q_elems())?;
    check_len("attention lse", lse.len(), shape.lse_elems())?;
    let s = *shape;
    let (sq, sk, d) = (s.q_len, s.kv_len, s.head_dim);
    if sq == 0 {
        return Ok(());
    }
    let group = s.n_heads / s.n_kv_heads;
    let scale = s.scale();
    // Row strides of q/out and k/v.
    let (hd, kvd) = (s.n_heads * d, s.n_kv_heads * d);
    // Keys beyond what the last query sees are never needed.
    let n_keys = s.visible_keys(sq - 1);
    let (tq, tk) = (tiles.q_tile.min(sq), tiles.k_tile.min(n_keys.max(1)));
    let out_ptr = SyncPtr(out.as_mut_ptr());
    threads::install(|| {
        // One task per (batch, head): it owns out[b, :, h, :] and lse[b, h, :].
        lse.par_chunks_mut(sq)
            .enumerate()
            .for_each(|(bh, lse_row)| {
                let (b, h) = (bh / s.n_heads, bh % s.n_heads);
                let qbase = b * sq * hd + h * d;
                let kvbase = b * sk * kvd + (h / group) * d;
                let docs = doc_row(doc_start, b, sq);
                let scratch_len = d * n_keys + tq * tk + tq * d + 2 * tq;
                with_scratch(scratch_len, |buf| {
                    let (kt, rest) = buf.split_at_mut(d * n_keys);
                    let (st, rest) = rest.split_at_mut(tq * tk);
                    let (acc, rest) = rest.split_at_mut(tq * d);
                    let (m, l) = rest.split_at_mut(tq);
                    gather_t(&k[kvbase..], kvd, n_keys, d, kt);
                    for i0 in (0..sq).step_by(tq) {
                        let bq = tq.min(sq - i0);
                        // The tile's output rows are written only at its end; they are usually
                        // cold (rows `n_heads·d` apart), so fetch them while the tile computes.
                        let o_len = s.q_elems() - qbase;
                        prefetch_rows::<true>(
                            out_ptr.get().wrapping_add(qbase),
                            o_len,
                            hd,
                            (i0, i0 + bq),
                            d,
                        );
                        m[..bq].fill(f32::NEG_INFINITY);
                        l[..bq].fill(0.0);
                        acc[..bq * d].fill(0.0);
                        let kend = s.visible_keys(i0 + bq - 1);
                        let tile_docs = docs.map(|ds| &ds[i0..i0 + bq]);
                        let kbegin = first_key(tile_docs, s.k_start, kend);
                        for j0 in (kbegin..kend).step_by(tk) {
                            let bk = tk.min(kend - j0);
                            let st = &mut st[..bq * bk];
                            // S̃ = Q·Kᵀ for this tile (the scale is applied inside the exp)
                            mm(
                                st,
                                bk,
                                &q[qbase + i0 * hd..],
                                hd,
                                1,
                                &kt[j0..],
                                n_keys,
                                bq,
                                d,
                                bk,
                                false,
                            );
                            if let Some(ds) = tile_docs {
                                mask_before_documents(st, bk, ds, s.k_start + j0);
                            }
                            let vis0 = s.tile_vis0(i0, j0);
                            online_softmax_tile(st, bq, bk, vis0, scale, m, l, acc, d);
                            // acc += P̃ · V
                            mm(
                                &mut acc[..bq * d],
                                d,
                                st,
                                bk,
                                1,
                                &v[kvbase + j0 * kvd..],
                                kvd,
                                bq,
                                bk,
                                d,
                                true,
                            );
                        }
                        for r in 0..bq {
                            let (inv, lse_v) = if l[r] > 0.0 {
                                (1.0 / l[r], m[r] + l[r].ln())
                            } else {
                                (0.0, f32::NEG_INFINITY)
                            };
                            lse_row[i0 + r] = lse_v;
                            // SAFETY: row (b, i0 + r, h) of `out` is in bounds (q_elems checked)
                            // and belongs to this task only.
                            let o = unsafe {
                                std::slice::from_raw_parts_mut(
                                    out_ptr.get().add(qbase + (i0 + r) * hd),
                                    d,
                                )
                            };
                            for (o, a) in o.iter_mut().zip(&acc[r * d..(r + 1) * d]) {
                                *o = a * inv;
                            }
                        }
                    }
                });
            });
    });
    Ok(())
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
    attention_backward_docs(shape, None, q, k, v, out, lse, dout, dq, dk, dv, tiles)
}

/// [`attention_backward`] under the document mask of [`attention_forward_docs`] (the same
/// `doc_start` as the forward: the masked pairs have `P = 0`, so they get no gradient).
#[allow(clippy::too_many_arguments)]
pub fn attention_backward_docs(
    shape: &AttnShape,
    doc_start: Option<&[usize]>,
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
    check_doc_start(shape, doc_start)?;
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
    if sq == 0 {
        return Ok(());
    }
    let n_keys = s.visible_keys(sq - 1);
    if n_keys == 0 {
        return Ok(());
    }
    let group = s.n_heads / s.n_kv_heads;
    let scale = s.scale();
    let (hd, kvd) = (s.n_heads * d, s.n_kv_heads * d);
    let (tq, tk) = (tiles.q_tile.min(sq), tiles.k_tile.min(n_keys));
    let (dq_ptr, dk_ptr, dv_ptr) = (
        SyncPtr(dq.as_mut_ptr()),
        SyncPtr(dk.as_mut_ptr()),
        SyncPtr(dv.as_mut_ptr()),
    );
    threads::install(|| {
        // One task per (batch, kv head): it owns dk/dv[b, :, kvh, :] and dq[b, :, h, :] for the
        // query heads h of its group, so no two tasks write the same element. Products that
        // update those gradients write them in place through raw pointers (`mm_raw`).
        (0..s.batch * s.n_kv_heads)
            .into_par_iter()
            .for_each(|task| {
                let (b, kvh) = (task / s.n_kv_heads, task % s.n_kv_heads);
                let kvbase = b * sk * kvd + kvh * d;
                let docs = doc_row(doc_start, b, sq);
                with_scratch(2 * d * n_keys + 2 * tq * tk + sq, |buf| {
                    let (kt, rest) = buf.split_at_mut(d * n_keys);
                    let (vt, rest) = rest.split_at_mut(d * n_keys);
                    let (p, rest) = rest.split_at_mut(tq * tk);
                    let (dp, delta) = rest.split_at_mut(tq * tk);
                    gather_t(&k[kvbase..], kvd, n_keys, d, kt);
                    gather_t(&v[kvbase..], kvd, n_keys, d, vt);
                    for h in kvh * group..(kvh + 1) * group {
                        let qbase = b * sq * hd + h * d;
                        let lse_row = &lse[(b * s.n_heads + h) * sq..][..sq];
                        let nq = s.q_elems() - qbase;
                        for (i, dl) in delta.iter_mut().enumerate() {
                            // A few rows ahead: this pass is the first touch of out and dO.
                            for m in [out.as_ptr(), dout.as_ptr()] {
                                let rows = (i + DELTA_AHEAD, i + DELTA_AHEAD + 1);
                                prefetch_rows::<false>(m.wrapping_add(qbase), nq, hd, rows, d);
                            }
                            let o = &out[qbase + i * hd..][..d];
                            *dl = dot(&dout[qbase + i * hd..][..d], o, None);
                        }
                        let mut kend_before = 0;
                        for i0 in (0..sq).step_by(tq) {
                            let bq = tq.min(sq - i0);
                            let kend = s.visible_keys(i0 + bq - 1);
                            // Rows this tile is the first to touch, usually cold: its dQ rows
                            // and the dK/dV rows of the keys it adds (written), and the next
                            // tile's Q rows (read).
                            let nkv = s.kv_elems() - kvbase;
                            prefetch_rows::<true>(
                                dq_ptr.get().wrapping_add(qbase),
                                nq,
                                hd,
                                (i0, i0 + bq),
                                d,
                            );
                            let rows = (kend_before, kend);
                            for m in [dk_ptr.get(), dv_ptr.get()] {
                                prefetch_rows::<true>(m.wrapping_add(kvbase), nkv, kvd, rows, d);
                            }
                            let next = (i0 + bq, i0 + bq + tq);
                            prefetch_rows::<false>(q.as_ptr().wrapping_add(qbase), nq, hd, next, d);
                            kend_before = kend;
                            let q_i = &q[qbase + i0 * hd..];
                            let do_i = &dout[qbase + i0 * hd..];
                            let tile_docs = docs.map(|ds| &ds[i0..i0 + bq]);
                            let kbegin = first_key(tile_docs, s.k_start, kend);
                            for j0 in (kbegin..kend).step_by(tk) {
                                let bk = tk.min(kend - j0);
                                let p = &mut p[..bq * bk];
                                let dp = &mut dp[..bq * bk];
                                // P = exp(s·Q·Kᵀ − lse)
                                mm(p, bk, q_i, hd, 1, &kt[j0..], n_keys, bq, d, bk, false);
                                if let Some(ds) = tile_docs {
                                    mask_before_documents(p, bk, ds, s.k_start + j0);
                                }
                                let vis0 = s.tile_vis0(i0, j0);
                                exp_tile(p, bq, bk, vis0, scale, &lse_row[i0..]);
                                // dP = dO·Vᵀ, then dS' = s·P∘(dP − D) in place
                                mm(dp, bk, do_i, hd, 1, &vt[j0..], n_keys, bq, d, bk, false);
                                softmax_grad_tile(dp, p, &delta[i0..i0 + bq], bk, scale);
                                // SAFETY: rows j0..j0+bk of dk/dv (head kvh, batch b) and rows
                                // i0..i0+bq of dq (head h, batch b) are in bounds (lengths checked,
                                // j0 + bk <= n_keys <= kv_len, i0 + bq <= q_len) and written only by
                                // this task; the outputs are distinct from all inputs.
                                unsafe {
                                    let kv_off = kvbase + j0 * kvd;
                                    // dV += Pᵀ·dO
                                    mm_raw(
                                        dv_ptr.get().add(kv_off),
                                        kvd,
                                        p.as_ptr(),
                                        1,
                                        bk,
                                        do_i.as_ptr(),
                                        hd,
                                        bk,
                                        bq,
                                        d,
                                        true,
                                    );
                                    // dK += dS'ᵀ·Q
                                    mm_raw(
                                        dk_ptr.get().add(kv_off),
                                        kvd,
                                        dp.as_ptr(),
                                        1,
                                        bk,
                                        q_i.as_ptr(),
                                        hd,
                                        bk,
                                        bq,
                                        d,
                                        true,
                                    );
                                    // dQ += dS'·K
                                    mm_raw(
                                        dq_ptr.get().add(qbase + i0 * hd),
                                        hd,
                                        dp.as_ptr(),
                                        bk,
                                        1,
                                        k.as_ptr().add(kv_off),
                                        kvd,
                                        bq,
                                        bk,
                                        d,
                                        true,
                                    );
                                }
                            }
                        }
                    }
                });
            });
    });
    Ok(())
}

/// Rows ahead of use that the backward's `D = rowsum(dO∘O)` pass prefetches.
const DELTA_AHEAD: usize = 8;

/// Where a partial attention result merges into a whole one ([`merge_partial`]): query rows
/// `row0 .. row0 + rows` of sequence `b` of a `[batch, len, heads, head_dim]` output and its
/// `[batch, heads, len]` log-sum-exp; the partial is `[rows, heads, head_dim]` with lse
/// `[heads, rows]` (what one kernel call on that sequence's rows returns).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MergeRows {
    pub b: usize,
    pub len: usize,
    pub heads: usize,
    pub head_dim: usize,
    pub row0: usize,
    pub rows: usize,
}

impl MergeRows {
    /// Checks the four lengths against the rows; `out` holds whole sequences.
    pub fn check(
        &self,
        out: usize,
        lse: usize,
        part: usize,
        part_lse: usize,
    ) -> Result<(), TensorError> {
        let seq = self.len * self.heads * self.head_dim;
        if self.row0 + self.rows > self.len
            || seq == 0
            || !out.is_multiple_of(seq)
            || self.b >= out / seq
        {
            return Err(TensorError::Shape(format!(
                "merge: rows {}..{} of sequence {} of an output of {out} elements ({} tokens × {} heads × {})",
                self.row0,
                self.row0 + self.rows,
                self.b,
                self.len,
                self.heads,
                self.head_dim
            )));
        }
        check_len("merge lse", lse, out / self.head_dim)?;
        check_len(
            "merge partial",
            part,
            self.rows * self.heads * self.head_dim,
        )?;
        check_len("merge partial lse", part_lse, self.heads * self.rows)
    }
}

/// The merge of partial results `a` and `b` over disjoint keys from their log-sum-exps: the
/// weights of `a` and `b` and the merged lse. With `δ = lse_b − lse_a`,
/// `lse = lse_a + softplus(δ)`, `w_a = σ(−δ)`, `w_b = σ(δ)` (ring-flash-attention's
/// `lse − logsigmoid(lse − lse_blk)` form), which cannot overflow; a side with `lse = −∞`
/// contributes nothing.
#[inline]
pub fn merge_weights(la: f32, lb: f32) -> (f32, f32, f32) {
    if lb == f32::NEG_INFINITY {
        return (1.0, 0.0, la);
    }
    if la == f32::NEG_INFINITY {
        return (0.0, 1.0, lb);
    }
    let d = lb - la;
    let softplus = d.max(0.0) + (-d.abs()).exp().ln_1p();
    let sig = |x: f32| {
        if x >= 0.0 {
            1.0 / (1.0 + (-x).exp())
        } else {
            let e = x.exp();
            e / (1.0 + e)
        }
    };
    (sig(-d), sig(d), la + softplus)
}

/// Merges a partial attention result (`part`, `part_lse`, laid out as [`MergeRows`] says)
/// over keys disjoint from those already in `out`, `lse` into its rows there:
/// `out = out·w_a + part·w_b`, `lse` the merged one ([`merge_weights`]). Ring attention merges
/// each key block's result this way; its CUDA twin is `attn_merge`.
pub fn merge_partial(
    m: &MergeRows,
    out: &mut [f32],
    lse: &mut [f32],
    part: &[f32],
    part_lse: &[f32],
) -> Result<(), TensorError> {
    m.check(out.len(), lse.len(), part.len(), part_lse.len())?;
    let (h, d) = (m.heads, m.head_dim);
    for r in 0..m.rows {
        let row = m.row0 + r;
        for hh in 0..h {
            let li = (m.b * h + hh) * m.len + row;
            let (wa, wb, l) = merge_weights(lse[li], part_lse[hh * m.rows + r]);
            lse[li] = l;
            let oa = &mut out[((m.b * m.len + row) * h + hh) * d..][..d];
            let ob = &part[(r * h + hh) * d..][..d];
            for (x, &y) in oa.iter_mut().zip(ob) {
                *x = *x * wa + y * wb;
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests;
