//! Attention tests: a naive f64 reference that materialises the softmax, finite differences of
//! that reference for the backward, and the ring-attention identities.

use super::*;
use crate::testutil::{assert_close, fd_grad, rand_vec};

/// Naive f64 attention: returns (out `[b, i, h, d]`, lse `[b, h, i]`).
fn reference(s: &AttnShape, q: &[f64], k: &[f64], v: &[f64]) -> (Vec<f64>, Vec<f64>) {
    reference_docs(s, None, q, k, v)
}

/// [`reference`] under a document mask: key `j` is visible to query `i` iff it is causally
/// visible and `doc_start[b, i] <= k_start + j` (the mask written out pair by pair).
fn reference_docs(
    s: &AttnShape,
    doc_start: Option<&[usize]>,
    q: &[f64],
    k: &[f64],
    v: &[f64],
) -> (Vec<f64>, Vec<f64>) {
    let d = s.head_dim;
    let group = s.n_heads / s.n_kv_heads;
    let scale = 1.0 / (d as f64).sqrt();
    let mut out = vec![0.0; s.q_elems()];
    let mut lse = vec![f64::NEG_INFINITY; s.lse_elems()];
    for b in 0..s.batch {
        for h in 0..s.n_heads {
            let kvh = h / group;
            for i in 0..s.q_len {
                let qi = &q[((b * s.q_len + i) * s.n_heads + h) * d..][..d];
                let scores: Vec<f64> = (0..s.kv_len)
                    .map(|j| {
                        let visible = (!s.causal || s.k_start + j <= s.q_start + i)
                            && doc_start.is_none_or(|ds| ds[b * s.q_len + i] <= s.k_start + j);
                        if !visible {
                            return f64::NEG_INFINITY;
                        }
                        let kj = &k[((b * s.kv_len + j) * s.n_kv_heads + kvh) * d..][..d];
                        scale * qi.iter().zip(kj).map(|(a, b)| a * b).sum::<f64>()
                    })
                    .collect();
                let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                if m == f64::NEG_INFINITY {
                    continue;
                }
                let z: f64 = scores.iter().map(|x| (x - m).exp()).sum();
                lse[(b * s.n_heads + h) * s.q_len + i] = m + z.ln();
                let o = &mut out[((b * s.q_len + i) * s.n_heads + h) * d..][..d];
                for (j, sc) in scores.iter().enumerate() {
                    let p = (sc - m).exp() / z;
                    if p == 0.0 {
                        continue;
                    }
                    let vj = &v[((b * s.kv_len + j) * s.n_kv_heads + kvh) * d..][..d];
                    o.iter_mut().zip(vj).for_each(|(o, x)| *o += p * x);
                }
            }
        }
    }
    (out, lse)
}

fn to64(x: &[f32]) -> Vec<f64> {
    x.iter().map(|&v| v as f64).collect()
}

struct Case {
    shape: AttnShape,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
}

fn case(shape: AttnShape, seed: u64) -> Case {
    // Scores of O(1) spread: inputs in [-1.5, 1.5].
    let f = |n, s| rand_vec(n, s).iter().map(|x| x * 1.5).collect::<Vec<f32>>();
    Case {
        q: f(shape.q_elems(), seed),
        k: f(shape.kv_elems(), seed + 1),
        v: f(shape.kv_elems(), seed + 2),
        shape,
    }
}

#[allow(clippy::too_many_arguments)]
fn shape(
    batch: usize,
    q_len: usize,
    kv_len: usize,
    heads: usize,
    kv_heads: usize,
    d: usize,
    causal: bool,
    q_start: usize,
    k_start: usize,
) -> AttnShape {
    AttnShape {
        batch,
        q_len,
        kv_len,
        n_heads: heads,
        n_kv_heads: kv_heads,
        head_dim: d,
        causal,
        q_start,
        k_start,
    }
}

fn run_forward(c: &Case, tiles: AttnTiles) -> (Vec<f32>, Vec<f32>) {
    let mut out = vec![f32::NAN; c.shape.q_elems()];
    let mut lse = vec![f32::NAN; c.shape.lse_elems()];
    attention_forward(&c.shape, &c.q, &c.k, &c.v, &mut out, &mut lse, tiles).unwrap();
    (out, lse)
}

fn check_lse(what: &str, got: &[f32], want: &[f64]) {
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        if w == f64::NEG_INFINITY {
            assert_eq!(g, f32::NEG_INFINITY, "{what}[{i}]");
        } else {
            assert!(
                (g as f64 - w).abs() < 1e-5 * (1.0 + w.abs()),
                "{what}[{i}]: {g} vs {w}"
            );
        }
    }
}

#[test]
fn forward_matches_naive_reference() {
    let shapes = [
        shape(2, 13, 13, 4, 4, 8, true, 0, 0),    // GQA ratio 1
        shape(1, 13, 13, 4, 2, 8, true, 0, 0),    // ratio 2
        shape(2, 11, 11, 8, 2, 4, true, 0, 0),    // ratio 4
        shape(1, 9, 14, 4, 1, 8, true, 5, 0),     // queries later in the sequence than keys
        shape(1, 10, 7, 2, 1, 8, true, 3, 6),     // keys start later: early queries see nothing
        shape(2, 9, 12, 4, 2, 8, false, 0, 0),    // non-causal
        shape(1, 70, 70, 2, 1, 16, true, 0, 0),   // longer than the default tile
        shape(1, 33, 33, 2, 1, 64, true, 0, 0),   // head_dim 64: full 4-vector blocks
        shape(1, 21, 300, 2, 2, 40, false, 0, 0), // head_dim 40 (masked lanes), > 256 keys
        shape(1, 300, 300, 1, 1, 8, true, 0, 0),  // several default-size key tiles
    ];
    let tiles = [(1, 1), (3, 5), (4, 4), (8, 3), (64, 64), (16, 32)];
    for (n, s) in shapes.iter().enumerate() {
        let c = case(*s, 10 * n as u64);
        let (want_o, want_l) = reference(s, &to64(&c.q), &to64(&c.k), &to64(&c.v));
        for &(tq, tk) in &tiles {
            let (o, l) = run_forward(
                &c,
                AttnTiles {
                    q_tile: tq,
                    k_tile: tk,
                },
            );
            // f32 accumulation over <= 70 keys of O(1) values: errors ~1e-6.
            assert_close(
                &format!("out {s:?} tiles {tq}x{tk}"),
                &o,
                &want_o,
                2e-5,
                1e-5,
            );
            check_lse(&format!("lse {s:?} tiles {tq}x{tk}"), &l, &want_l);
        }
    }
}

/// Checks dq/dk/dv against central differences of the f64 reference for
/// `L = Σ dout ∘ out(q, k, v)`.
fn check_backward(s: AttnShape, tiles: AttnTiles, seed: u64) {
    let c = case(s, seed);
    let dout = rand_vec(s.q_elems(), seed + 7);
    let (out, lse) = run_forward(&c, tiles);
    // Accumulation semantics: start from a known non-zero value.
    let mut dq = vec![0.25f32; s.q_elems()];
    let mut dk = vec![0.25f32; s.kv_elems()];
    let mut dv = vec![0.25f32; s.kv_elems()];
    attention_backward(
        &s, &c.q, &c.k, &c.v, &out, &lse, &dout, &mut dq, &mut dk, &mut dv, tiles,
    )
    .unwrap();
    let (q64, k64, v64) = (to64(&c.q), to64(&c.k), to64(&c.v));
    let loss = |q: &[f64], k: &[f64], v: &[f64]| -> f64 {
        let (o, _) = reference(&s, q, k, v);
        o.iter().zip(&dout).map(|(a, b)| a * *b as f64).sum()
    };
    // h = 1e-4 in f64: truncation error ~h²·|f'''| ~ 1e-8, rounding ~1e-16/h ~ 1e-12; the
    // tolerance covers the f32 rounding of the analytical gradient (~1e-6 relative).
    let add = |g: Vec<f64>| g.into_iter().map(|x| x + 0.25).collect::<Vec<f64>>();
    let gq = add(fd_grad(&c.q, 1e-4, &mut |x| loss(x, &k64, &v64)));
    let gk = add(fd_grad(&c.k, 1e-4, &mut |x| loss(&q64, x, &v64)));
    let gv = add(fd_grad(&c.v, 1e-4, &mut |x| loss(&q64, &k64, x)));
    let what = format!("{s:?} {tiles:?}");
    assert_close(&format!("dq {what}"), &dq, &gq, 1e-4, 1e-4);
    assert_close(&format!("dk {what}"), &dk, &gk, 1e-4, 1e-4);
    assert_close(&format!("dv {what}"), &dv, &gv, 1e-4, 1e-4);
}

#[test]
fn backward_matches_finite_differences() {
    let t = |q_tile, k_tile| AttnTiles { q_tile, k_tile };
    check_backward(shape(2, 7, 7, 2, 2, 4, true, 0, 0), t(3, 2), 1); // ratio 1, 7 % 3 != 0
    check_backward(shape(1, 9, 9, 4, 2, 4, true, 0, 0), t(4, 4), 2); // ratio 2
    check_backward(shape(1, 6, 6, 4, 1, 4, true, 0, 0), t(64, 64), 3); // ratio 4, one tile
    check_backward(shape(1, 5, 8, 2, 1, 4, true, 4, 0), t(2, 3), 4); // query offset
    check_backward(shape(1, 8, 5, 2, 1, 4, true, 0, 3), t(3, 2), 5); // key offset, empty rows
    check_backward(shape(1, 6, 7, 4, 2, 4, false, 0, 0), t(4, 3), 6); // non-causal
    check_backward(shape(1, 5, 5, 1, 1, 64, true, 0, 0), t(2, 3), 7); // head_dim 64
    check_backward(
        shape(1, 6, 6, 2, 1, 40, true, 0, 0),
        AttnTiles::default(),
        8,
    ); // lanes
}

/// Document starts `[batch, q_len]` for queries at `q_start..`: row `b`'s documents begin at
/// `bounds[b]` (sorted; a query before the first bound belongs to a document that started at 0).
fn doc_starts(s: &AttnShape, bounds: &[&[usize]]) -> Vec<usize> {
    (0..s.batch)
        .flat_map(|b| {
            (0..s.q_len).map(move |i| {
                let p = s.q_start + i;
                bounds[b]
                    .iter()
                    .copied()
                    .filter(|&x| x <= p)
                    .max()
                    .unwrap_or(0)
            })
        })
        .collect()
}

/// Shapes with document masks, their boundaries chosen to exercise every tile case: a
/// boundary inside a query tile (rows of one tile in two documents), at a tile edge, key tiles
/// wholly before a document (skipped), documents of one token, and key blocks from elsewhere
/// in the sequence (`q_start`, `k_start`) whose keys all lie in an earlier document.
fn doc_cases() -> Vec<(AttnShape, Vec<usize>)> {
    let mut v = Vec::new();
    let s = shape(2, 13, 13, 4, 2, 8, true, 0, 0);
    v.push((s, doc_starts(&s, &[&[0, 4, 5, 9], &[0, 8]])));
    let s = shape(1, 70, 70, 2, 1, 16, true, 0, 0);
    v.push((s, doc_starts(&s, &[&[0, 16, 17, 40, 69]])));
    let s = shape(1, 9, 14, 4, 1, 8, true, 5, 0); // queries after the keys' start
    v.push((s, doc_starts(&s, &[&[3, 7, 12]])));
    let s = shape(1, 10, 7, 2, 1, 8, true, 3, 6); // keys start later
    v.push((s, doc_starts(&s, &[&[0, 8]])));
    let s = shape(1, 8, 8, 2, 2, 8, true, 16, 0); // every key in an earlier document: lse = −∞
    v.push((s, doc_starts(&s, &[&[0, 12]])));
    let s = shape(1, 300, 300, 1, 1, 8, true, 0, 0); // several default-size key tiles
    v.push((s, doc_starts(&s, &[&[0, 130, 260, 262]])));
    v
}

#[test]
fn document_mask_forward_matches_naive_reference() {
    let tiles = [(1, 1), (3, 5), (4, 4), (16, 32), (16, 256)];
    for (n, (s, ds)) in doc_cases().into_iter().enumerate() {
        let c = case(s, 500 + 10 * n as u64);
        let (want_o, want_l) = reference_docs(&s, Some(&ds), &to64(&c.q), &to64(&c.k), &to64(&c.v));
        for &(q_tile, k_tile) in &tiles {
            let t = AttnTiles { q_tile, k_tile };
            let mut o = vec![f32::NAN; s.q_elems()];
            let mut l = vec![f32::NAN; s.lse_elems()];
            attention_forward_docs(&s, Some(&ds), &c.q, &c.k, &c.v, &mut o, &mut l, t).unwrap();
            // As in the unmasked test: f32 accumulation over <= 300 keys of O(1) values.
            assert_close(&format!("out {s:?} {t:?}"), &o, &want_o, 2e-5, 1e-5);
            check_lse(&format!("lse {s:?} {t:?}"), &l, &want_l);
        }
    }
}

#[test]
fn document_mask_backward_matches_finite_differences() {
    let t = |q_tile, k_tile| AttnTiles { q_tile, k_tile };
    for (n, (s, ds)) in doc_cases().into_iter().enumerate() {
        if s.q_len * s.kv_len > 200 {
            continue; // finite differences of the long cases would take seconds
        }
        for tiles in [t(3, 2), t(4, 4), AttnTiles::default()] {
            let seed = 600 + 10 * n as u64;
            let c = case(s, seed);
            let dout = rand_vec(s.q_elems(), seed + 7);
            let mut o = vec![f32::NAN; s.q_elems()];
            let mut l = vec![f32::NAN; s.lse_elems()];
            let ds = Some(&ds[..]);
            attention_forward_docs(&s, ds, &c.q, &c.k, &c.v, &mut o, &mut l, tiles).unwrap();
            let mut dq = vec![0.0f32; s.q_elems()];
            let mut dk = vec![0.0f32; s.kv_elems()];
            let mut dv = vec![0.0f32; s.kv_elems()];
            attention_backward_docs(
                &s, ds, &c.q, &c.k, &c.v, &o, &l, &dout, &mut dq, &mut dk, &mut dv, tiles,
            )
            .unwrap();
            let (q64, k64, v64) = (to64(&c.q), to64(&c.k), to64(&c.v));
            let loss = |q: &[f64], k: &[f64], v: &[f64]| -> f64 {
                let (o, _) = reference_docs(&s, ds, q, k, v);
                o.iter().zip(&dout).map(|(a, b)| a * *b as f64).sum()
            };
            // Central differences of the f64 reference, as in `check_backward`.
            let gq = fd_grad(&c.q, 1e-4, &mut |x| loss(x, &k64, &v64));
            let gk = fd_grad(&c.k, 1e-4, &mut |x| loss(&q64, x, &v64));
            let gv = fd_grad(&c.v, 1e-4, &mut |x| loss(&q64, &k64, x));
            let what = format!("{s:?} {tiles:?}");
            assert_close(&format!("dq {what}"), &dq, &gq, 1e-4, 1e-4);
            assert_close(&format!("dk {what}"), &dk, &gk, 1e-4, 1e-4);
            assert_close(&format!("dv {what}"), &dv, &gv, 1e-4, 1e-4);
        }
    }
}

#[test]
fn document_mask_errors() {
    let s = AttnShape::causal(1, 4, 2, 2, 8);
    let c = case(s, 1);
    let mut out = vec![0.0; s.q_elems()];
    let mut lse = vec![0.0; s.lse_elems()];
    let t = AttnTiles::default();
    let e = attention_forward_docs(&s, Some(&[0; 3]), &c.q, &c.k, &c.v, &mut out, &mut lse, t);
    assert!(e.unwrap_err().to_string().contains("doc_start"));
    let open = AttnShape { causal: false, ..s };
    let e = attention_forward_docs(
        &open,
        Some(&[0; 4]),
        &c.q,
        &c.k,
        &c.v,
        &mut out,
        &mut lse,
        t,
    );
    assert!(e.unwrap_err().to_string().contains("causal"));
}

#[test]
fn merge_of_key_halves_equals_full_attention() {
    // Full causal attention over 16 keys vs two calls over keys [0, 7) and [7, 16) with k_start
    // offsets, merged. Queries are the last 10 positions (q_start = 6).
    let (b, sq, sk, h, kvh, d) = (2, 10, 16, 4, 2, 8);
    let full = shape(b, sq, sk, h, kvh, d, true, 6, 0);
    let c = case(full, 77);
    let tiles = AttnTiles {
        q_tile: 4,
        k_tile: 3,
    };
    let (o_full, l_full) = run_forward(&c, tiles);
    let split = 7;
    let slice_keys = |x: &[f32], j0: usize, j1: usize| -> Vec<f32> {
        let row = kvh * d;
        (0..b)
            .flat_map(|bb| x[(bb * sk + j0) * row..(bb * sk + j1) * row].to_vec())
            .collect()
    };
    let mut parts = Vec::new();
    for (j0, j1) in [(0, split), (split, sk)] {
        let s = AttnShape {
            kv_len: j1 - j0,
            k_start: j0,
            ..full
        };
        let part = Case {
            shape: s,
            q: c.q.clone(),
            k: slice_keys(&c.k, j0, j1),
            v: slice_keys(&c.v, j0, j1),
        };
        let (o, l) = run_forward(&part, tiles);
        parts.push((part, o, l));
    }
    let (mut o, mut l) = (parts[1].1.clone(), parts[1].2.clone());
    for bb in 0..b {
        let m = MergeRows {
            b: bb,
            len: sq,
            heads: h,
            head_dim: d,
            row0: 0,
            rows: sq,
        };
        let (po, pl) = (&parts[0].1[bb * sq * h * d..], &parts[0].2[bb * h * sq..]);
        merge_partial(&m, &mut o, &mut l, &po[..sq * h * d], &pl[..h * sq]).unwrap();
    }
    assert!(crate::tensor::max_abs_diff(&o, &o_full) < 1e-5);
    assert!(crate::tensor::max_abs_diff(&l, &l_full) < 1e-5);

    // Ring backward: per-block backward with the merged (out, lse) sums to the full gradient.
    let dout = rand_vec(full.q_elems(), 78);
    let mut dq = vec![0.0; full.q_elems()];
    let mut dk = vec![0.0; full.kv_elems()];
    let mut dv = vec![0.0; full.kv_elems()];
    attention_backward(
        &full, &c.q, &c.k, &c.v, &o_full, &l_full, &dout, &mut dq, &mut dk, &mut dv, tiles,
    )
    .unwrap();
    let mut dq_ring = vec![0.0; full.q_elems()];
    let mut dk_ring = Vec::new();
    let mut dv_ring = Vec::new();
    for (part, _, _) in &parts {
        let mut dkp = vec![0.0; part.shape.kv_elems()];
        let mut dvp = vec![0.0; part.shape.kv_elems()];
        attention_backward(
            &part.shape,
            &part.q,
            &part.k,
            &part.v,
            &o,
            &l,
            &dout,
            &mut dq_ring,
            &mut dkp,
            &mut dvp,
            tiles,
        )
        .unwrap();
        dk_ring.push(dkp);
        dv_ring.push(dvp);
    }
    assert!(crate::tensor::max_abs_diff(&dq_ring, &dq) < 1e-5);
    let join = |p: &[Vec<f32>]| -> Vec<f32> {
        let (n0, n1) = (split * kvh * d, (sk - split) * kvh * d);
        (0..b)
            .flat_map(|bb| [&p[0][bb * n0..(bb + 1) * n0], &p[1][bb * n1..(bb + 1) * n1]].concat())
            .collect()
    };
    assert!(crate::tensor::max_abs_diff(&join(&dk_ring), &dk) < 1e-5);
    assert!(crate::tensor::max_abs_diff(&join(&dv_ring), &dv) < 1e-5);
}

#[test]
fn flop_count_and_errors() {
    let s = AttnShape::causal(1, 4, 2, 2, 8);
    assert_eq!(s.visible_pairs(), 2 * (1 + 2 + 3 + 4));
    assert_eq!(s.flops().0, 4.0 * 8.0 * 20.0);
    let bad = AttnShape { n_kv_heads: 3, ..s };
    let c = case(s, 1);
    let mut out = vec![0.0; s.q_elems()];
    let mut lse = vec![0.0; s.lse_elems()];
    assert!(attention_forward(
        &bad,
        &c.q,
        &c.k,
        &c.v,
        &mut out,
        &mut lse,
        AttnTiles::default()
    )
    .is_err());
    assert!(attention_forward(
        &s,
        &c.q[1..],
        &c.k,
        &c.v,
        &mut out,
        &mut lse,
        AttnTiles::default()
    )
    .is_err());
    assert!(attention_forward(
        &s,
        &c.q,
        &c.k,
        &c.v,
        &mut out,
        &mut lse,
        AttnTiles {
            q_tile: 0,
            k_tile: 4
        }
    )
    .is_err());
    let m = MergeRows {
        b: 0,
        len: 4,
        heads: 2,
        head_dim: 8,
        row0: 0,
        rows: 4,
    };
    assert!(merge_partial(&m, &mut out, &mut lse, &c.q, &[0.0; 1]).is_err());
    assert!(merge_partial(
        &MergeRows { rows: 5, ..m },
        &mut out,
        &mut lse,
        &c.q,
        &[0.0; 8]
    )
    .is_err());
    assert!(merge_partial(
        &MergeRows { b: 1, ..m },
        &mut out,
        &mut lse,
        &c.q,
        &[0.0; 8]
    )
    .is_err());
}
