//! Every GPU kernel against its CPU twin on the same inputs (the CPU kernels are the
//! reference). fp32: within 1e-5 of the largest element of the CPU result (a few ulp of f32
//! rounding: the device sums in another order and its `expf` differs from the CPU's polynomial
//! `exp` by at most 2 ulp); 16-bit casts: bit for bit. Skipped with one visible line where no
//! GPU is found (a failure where `XTRAIN_REQUIRE` lists `gpu` or `XTRAIN_REQUIRE_GPU=1`).
use std::sync::Arc;
use tensor::attention::{attention_backward_docs, attention_forward_docs, AttnShape, AttnTiles};
use tensor::buf::Buf;
use tensor::cuda::doc_mask::DocMask;
use tensor::cuda::ops::{AttnBackwardKernels, AttnKernels, WarpRows, ATTN_KERNELS};
use tensor::cuda::{ops, DevBuf, Gpu};
use tensor::operands::Operands;

mod cuda_emu;

/// Every other test of this file again on the CPU emulation of a CUDA device
/// (`tests/cuda_emu`): each kernel against its CPU twin on every machine, GPU or not. Not
/// there: `watched_waits_end_with_the_check_or_the_limit`, which needs a queue that is busy
/// while the host waits (the emulated device runs each launch when it is queued).
#[test]
fn every_kernel_test_on_the_emulated_device() {
    cuda_emu::rerun_on_emulated_device(
        "the GPU kernel tests (tensor/tests/cuda_kernels.rs)",
        &[
            "every_kernel_test_on_the_emulated_device",
            "watched_waits_end_with_the_check_or_the_limit",
        ],
    );
}

/// The GPU, or `None` after the one skip line of this file (`test` names the caller for the
/// failure message where a GPU is required).
fn gpu(test: &str) -> Option<Arc<Gpu>> {
    match Gpu::open(0) {
        Ok(g) => Some(g),
        Err(e) => {
            let what = if tensor::skip::required("gpu") {
                test.to_string()
            } else {
                "the GPU kernel tests (tensor/tests/cuda_kernels.rs)".to_string()
            };
            tensor::skip::skip(&what, "gpu", &format!("no GPU: {e}"));
            None
        }
    }
}

fn rand(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

/// `max |a − b| / max |b|` (0 for two empty or zero vectors).
fn rel(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    let scale = b.iter().fold(0.0f32, |m, x| m.max(x.abs()));
    let d = a
        .iter()
        .zip(b)
        .fold(0.0f32, |m, (x, y)| m.max((x - y).abs()));
    if scale == 0.0 {
        d
    } else {
        d / scale
    }
}

fn assert_close(what: &str, got: &[f32], want: &[f32]) {
    let e = rel(got, want);
    assert!(
        e <= 1e-5,
        "{what}: GPU differs from CPU by {e:e} of the largest element"
    );
}

fn host<T: Copy>(b: &DevBuf<T>) -> Vec<T> {
    b.to_host().unwrap()
}

#[test]
fn casts_round_like_the_cpu() {
    let Some(g) = gpu("casts_round_like_the_cpu") else {
        return;
    };
    let mut x = rand(10_001, 1);
    x.extend([
        0.0,
        -0.0,
        f32::INFINITY,
        f32::NEG_INFINITY,
        1e-40,
        3.0e38,
        65504.0,
        70000.0,
    ]);
    let dx = g.upload(&x).unwrap();
    let mut b = g.alloc::<u16>(x.len()).unwrap();
    ops::cast_f32_to_bf16(&dx, &mut b).unwrap();
    let want: Vec<u16> = tensor::dtype::to_bf16_vec(&x)
        .iter()
        .map(|h| h.to_bits())
        .collect();
    assert_eq!(host(&b), want, "bf16 bits");
    let mut back = g.alloc::<f32>(x.len()).unwrap();
    ops::cast_bf16_to_f32(&b, &mut back).unwrap();
    let want_back = tensor::dtype::from_bf16_vec(&tensor::dtype::to_bf16_vec(&x));
    assert_eq!(host(&back), want_back);
    let mut h = g.alloc::<u16>(x.len()).unwrap();
    ops::cast_f32_to_f16(&dx, &mut h).unwrap();
    let want: Vec<u16> = x
        .iter()
        .map(|&v| half::f16::from_f32(v).to_bits())
        .collect();
    assert_eq!(host(&h), want, "f16 bits");
    let mut h_back = g.alloc::<f32>(x.len()).unwrap();
    ops::cast_f16_to_f32(&h, &mut h_back).unwrap();
    let want_back: Vec<f32> = want
        .iter()
        .map(|&b| half::f16::from_bits(b).to_f32())
        .collect();
    assert_eq!(host(&h_back), want_back, "f16 widened");
    // Views at offsets: both 16-byte aligned (8 elements a thread), either not (one a thread);
    // lengths with a tail past the last group of 8.
    let bits: Vec<u16> = tensor::dtype::to_bf16_vec(&x)
        .iter()
        .map(|h| h.to_bits())
        .collect();
    for (ox, oy, m) in [
        (0, 0, 4099),
        (1, 0, 4099),
        (0, 3, 4096),
        (4, 8, 4101),
        (8, 8, 17),
    ] {
        let mut y = g.alloc::<u16>(m + oy).unwrap();
        ops::cast_f32_to_bf16(dx.slice(ox..ox + m), y.slice_mut(oy..oy + m)).unwrap();
        assert_eq!(
            host(&y)[oy..],
            bits[ox..ox + m],
            "bf16 view at {ox}, into {oy}"
        );
        let mut w = g.alloc::<f32>(m + oy).unwrap();
        ops::cast_bf16_to_f32(b.slice(ox..ox + m), w.slice_mut(oy..oy + m)).unwrap();
        assert_eq!(
            host(&w)[oy..],
            want_back_bf16(&bits[ox..ox + m]),
            "widened view"
        );
    }
}

fn want_back_bf16(bits: &[u16]) -> Vec<f32> {
    bits.iter()
        .map(|&b| half::bf16::from_bits(b).to_f32())
        .collect()
}

/// 16-bit values in the `format` of a product's operands, widened.
fn widen_bits(bits: &[u16], format: Operands) -> Vec<f32> {
    match format {
        Operands::Bf16 => want_back_bf16(bits),
        _ => bits
            .iter()
            .map(|&b| half::f16::from_bits(b).to_f32())
            .collect(),
    }
}

/// Whether `got` is `want` up to the last bit of `format` (bf16's 8 significant bits, fp16's
/// 11): a product rounded once, of a sum cuBLASLt may order otherwise for a 16-bit output.
fn assert_within_last_bit(what: &str, got: &[f32], want: &[f32], format: Operands) {
    let last_bit = match format {
        Operands::Bf16 => 2f32.powi(-7),
        _ => 2f32.powi(-10),
    };
    assert_eq!(got.len(), want.len(), "{what}");
    for (i, (a, b)) in got.iter().zip(want).enumerate() {
        assert!(
            (a - b).abs() <= last_bit * a.abs().max(b.abs()),
            "{what} element {i}: {a} against {b}"
        );
    }
}

#[test]
fn swiglu_matches_cpu() {
    let Some(g) = gpu("swiglu_matches_cpu") else {
        return;
    };
    let n = 4099;
    let (gate, up, d) = (rand(n, 2), rand(n, 3), rand(n, 4));
    let s = ops::swiglu_forward(&g.upload(&gate).unwrap(), &g.upload(&up).unwrap()).unwrap();
    assert_close(
        "swiglu",
        &host(&s),
        &tensor::activation::swiglu_forward(&gate, &up).unwrap(),
    );
    let (dg, du) = ops::swiglu_backward(
        &g.upload(&d).unwrap(),
        &g.upload(&gate).unwrap(),
        &g.upload(&up).unwrap(),
    )
    .unwrap();
    let (wg, wu) = tensor::activation::swiglu_backward(&d, &gate, &up).unwrap();
    assert_close("swiglu dgate", &host(&dg), &wg);
    assert_close("swiglu dup", &host(&du), &wu);
    // Views one element in (not 16-byte aligned: the kernels' one element a thread, against
    // the 8 of whole buffers above) give each element the same bits.
    let (gg, gu, gd) = (
        g.upload(&gate).unwrap(),
        g.upload(&up).unwrap(),
        g.upload(&d).unwrap(),
    );
    let s1 = ops::swiglu_forward(gg.slice(1..n), gu.slice(1..n)).unwrap();
    assert_eq!(host(&s1), host(&s)[1..], "swiglu, unaligned views");
    let (dg1, du1) = ops::swiglu_backward(gd.slice(1..n), gg.slice(1..n), gu.slice(1..n)).unwrap();
    assert_eq!(host(&dg1), host(&dg)[1..], "swiglu dgate, unaligned views");
    assert_eq!(host(&du1), host(&du)[1..], "swiglu dup, unaligned views");
}

#[test]
fn rmsnorm_matches_cpu() {
    let Some(g) = gpu("rmsnorm_matches_cpu") else {
        return;
    };
    // Widths below, between and above the block sizes (a partial warp at 33 and 300), and
    // no rows at all (nothing may run: a block would write a row past the empty buffers).
    for (rows, dim) in [
        (1, 8),
        (3, 33),
        (37, 64),
        (7, 300),
        (130, 512),
        (5, 4096),
        (0, 4096),
    ] {
        let (x, w, dy, res) = (
            rand(rows * dim, 5),
            rand(dim, 6),
            rand(rows * dim, 7),
            rand(rows * dim, 8),
        );
        let (y, rstd) = tensor::norm::rmsnorm_forward(&x, &w, dim, 1e-5).unwrap();
        let (dx_, dw_) = (g.upload(&x).unwrap(), g.upload(&w).unwrap());
        let (gy, grstd) = ops::rmsnorm_forward(&dx_, &dw_, dim, 1e-5).unwrap();
        assert_close("rmsnorm y", &host(&gy), &y);
        assert_close("rmsnorm rstd", &host(&grstd), &rstd);
        let ddy = g.upload(&dy).unwrap();
        for residual in [None, Some(&res)] {
            let want = tensor::norm::rmsnorm_backward_input(
                &dy,
                &x,
                &w,
                &rstd,
                dim,
                residual.map(|v| v.as_slice()),
            )
            .unwrap();
            let r = residual.map(|v| g.upload(v).unwrap());
            let got = ops::rmsnorm_backward_input(
                &ddy,
                &dx_,
                &dw_,
                &grstd,
                dim,
                r.as_ref().map(|b| b.as_slice()),
            )
            .unwrap();
            assert_close("rmsnorm dx", &host(&got), &want);
        }
        let mut dw = rand(dim, 9);
        let mut gdw = g.upload(&dw).unwrap();
        tensor::norm::rmsnorm_backward_weight(&dy, &x, &rstd, dim, &mut dw).unwrap();
        ops::rmsnorm_backward_weight(&ddy, &dx_, &grstd, dim, &mut gdw).unwrap();
        assert_close("rmsnorm dw", &host(&gdw), &dw);
    }
}

#[test]
fn rope_matches_cpu() {
    let Some(g) = gpu("rope_matches_cpu") else {
        return;
    };
    let positions: Vec<usize> = (0..3)
        .flat_map(|b| (0..50).map(move |p| 7 * b + p))
        .collect();
    let heads = 3;
    for (d, backward) in [(64, false), (64, true), (6, false), (128, true)] {
        let rope = tensor::rope::Rope::new(d, 10000.0).unwrap();
        let x = rand(positions.len() * heads * d, 10);
        let mut want = x.clone();
        if backward {
            rope.apply_backward(&mut want, heads, &positions).unwrap();
        } else {
            rope.apply(&mut want, heads, &positions).unwrap();
        }
        let t = ops::RopeTable::new(&g, &rope, &positions, backward).unwrap();
        let mut gx = g.upload(&x).unwrap();
        ops::rope_rotate(&mut gx, heads, &t).unwrap();
        assert_close(
            &format!("rope d={d} backward={backward}"),
            &host(&gx),
            &want,
        );
        // The cached table: built once per key, the same rotation.
        let c = ops::RopeTable::cached(&g, &rope, &positions, backward).unwrap();
        let again = ops::RopeTable::cached(&g, &rope, &positions, backward).unwrap();
        assert!(std::sync::Arc::ptr_eq(&c, &again), "rope table cached");
        let other = ops::RopeTable::cached(&g, &rope, &positions, !backward).unwrap();
        assert!(!std::sync::Arc::ptr_eq(&c, &other), "direction in the key");
        let mut gx = g.upload(&x).unwrap();
        ops::rope_rotate(&mut gx, heads, &c).unwrap();
        assert_close(
            &format!("cached rope d={d} backward={backward}"),
            &host(&gx),
            &want,
        );
    }
}

#[test]
fn embedding_matches_cpu_full_and_sharded() {
    let Some(g) = gpu("embedding_matches_cpu_full_and_sharded") else {
        return;
    };
    let (vocab, dim) = (50, 24);
    let table = rand(vocab * dim, 11);
    let ids: Vec<u32> = (0..300u32)
        .map(|i| (i * 7 + i / 3) % vocab as u32)
        .collect();
    let dout = rand(ids.len() * dim, 12);
    for (start, rows) in [(0, vocab), (20, 13)] {
        let shard = &table[start * dim..(start + rows) * dim];
        let mut want = vec![0.0; ids.len() * dim];
        tensor::embedding::embedding_forward_shard(&ids, shard, dim, start, &mut want).unwrap();
        let got = ops::embedding_forward(
            &g.upload(&ids).unwrap(),
            &g.upload(shard).unwrap(),
            dim,
            start,
        )
        .unwrap();
        assert_eq!(host(&got), want, "lookup copies rows");
        let mut dt = rand(rows * dim, 13);
        let mut gdt = g.upload(&dt).unwrap();
        tensor::embedding::embedding_backward_shard(&ids, &dout, dim, start, &mut dt).unwrap();
        ops::embedding_backward(&ids, &g.upload(&dout).unwrap(), dim, start, &mut gdt).unwrap();
        // Each token added into the table value in token order, as the CPU: the same bits.
        assert_eq!(host(&gdt), dt, "embedding backward");
    }
}

#[test]
fn cross_entropy_pieces_match_cpu() {
    use tensor::cross_entropy::{logits_grad_inplace, logits_row_stats, IGNORE_INDEX};
    let Some(g) = gpu("cross_entropy_pieces_match_cpu") else {
        return;
    };
    let (rows, vocab) = (67, 1000);
    let logits: Vec<f32> = rand(rows * vocab, 14).iter().map(|x| 8.0 * x).collect();
    let targets: Vec<i64> = (0..rows as i64)
        .map(|r| {
            if r % 9 == 4 {
                IGNORE_INDEX
            } else {
                r * 13 % vocab as i64
            }
        })
        .collect();
    let (gl, gt) = (g.upload(&logits).unwrap(), g.upload(&targets).unwrap());
    for (start, shard) in [(0, vocab), (400, 300)] {
        let block: Vec<f32> = logits
            .chunks(vocab)
            .flat_map(|r| r[start..start + shard].to_vec())
            .collect();
        let (mut mx, mut se, mut tl) = (vec![0.0; rows], vec![0.0; rows], vec![0.0; rows]);
        logits_row_stats(
            &block,
            shard,
            start,
            &targets,
            IGNORE_INDEX,
            &mut mx,
            &mut se,
            &mut tl,
        );
        let gb = g.upload(&block).unwrap();
        let [gm, gs, gtl] = ops::ce_row_stats(&gb, &gt, shard, start, IGNORE_INDEX).unwrap();
        assert_eq!(host(&gm), mx, "row max");
        assert_close("sum exp", &host(&gs), &se);
        assert_eq!(host(&gtl), tl, "target logit");
    }
    let (mut mx, mut se, mut tl) = (vec![0.0; rows], vec![0.0; rows], vec![0.0; rows]);
    logits_row_stats(
        &logits,
        vocab,
        0,
        &targets,
        IGNORE_INDEX,
        &mut mx,
        &mut se,
        &mut tl,
    );
    let lse: Vec<f32> = mx
        .iter()
        .zip(&se)
        .map(|(m, s)| tensor::cross_entropy::combine_row_stats(&[(*m, *s)]))
        .collect();
    let [gm, gs, gtl] = ops::ce_row_stats(&gl, &gt, vocab, 0, IGNORE_INDEX).unwrap();
    let glse = ops::ce_lse(&gm, &gs).unwrap();
    assert_close("lse", &host(&glse), &lse);
    let want_sum: f64 = (0..rows)
        .filter(|&r| targets[r] != IGNORE_INDEX)
        .map(|r| (lse[r] - tl[r]) as f64)
        .sum();
    let got_sum = ops::ce_loss_sum(&glse, &gtl, &gt, IGNORE_INDEX).unwrap();
    assert!(
        (got_sum - want_sum).abs() <= 1e-5 * want_sum.abs(),
        "{got_sum} vs {want_sum}"
    );
    let mut grad = logits.clone();
    logits_grad_inplace(&mut grad, vocab, 0, &targets, IGNORE_INDEX, &lse, 0.25);
    let mut gg = g.upload(&logits).unwrap();
    ops::ce_grad_inplace(&mut gg, &gt, &glse, vocab, 0, IGNORE_INDEX, 0.25).unwrap();
    assert_close("logits gradient", &host(&gg), &grad);
}

/// Causal and not, grouped KV heads, head sizes 8 to 128, and the offsets of ring attention
/// (a query block against a key block from elsewhere in the sequence, including one no query
/// sees).
/// Shapes of head size `head_dim` under document masks, with the starts of their queries'
/// documents (`[batch, q_len]`, in the frame of `q_start` / `k_start`, as the CPU kernel takes
/// them): boundaries inside a 64-row tile, on a tile's edge and one row either side of it,
/// documents of one token, a last document that runs past the end; a query block after its
/// key block (context parallelism's calls: the starts are global positions) with documents
/// opening before, inside and after the keys; and a block whose keys all lie in an earlier
/// document than every query (no pair visible: out 0, lse −inf, gradients unchanged).
fn document_mask_cases(head_dim: usize) -> Vec<(AttnShape, Option<Vec<usize>>)> {
    // The start of position p's document, documents opening at `opens` (sorted, from 0).
    let start = |opens: &[usize], p: usize| opens.iter().copied().filter(|&o| o <= p).max();
    let starts = |s: &AttnShape, rows: &[&[usize]]| {
        let v: Vec<usize> = rows
            .iter()
            .flat_map(|opens| (0..s.q_len).map(|i| start(opens, s.q_start + i).unwrap()))
            .collect();
        assert_eq!(v.len(), s.batch * s.q_len);
        Some(v)
    };
    let offset = |q_len, kv_len, q_start, k_start| AttnShape {
        q_len,
        kv_len,
        q_start,
        k_start,
        ..AttnShape::causal(1, q_len, 4, 2, head_dim)
    };
    let a = AttnShape::causal(2, 150, 4, 2, head_dim);
    let b = AttnShape::causal(1, 200, 8, 2, head_dim);
    let c = offset(100, 80, 128, 20);
    let d = offset(40, 40, 40, 0);
    vec![
        (a, starts(&a, &[&[0, 1, 2, 63, 64, 65, 100, 149], &[0, 37]])),
        (b, starts(&b, &[&[0, 50, 120, 127, 128, 129, 180]])),
        (c, starts(&c, &[&[0, 10, 60, 90, 150, 210]])),
        (d, starts(&d, &[&[0, 40]])),
    ]
}

/// Every log-sum-exp equal, or within 1e-5 relative (the −∞ of a row that sees no key equal).
fn assert_lse_close(what: &str, got: &[f32], want: &[f32]) {
    for (a, b) in got.iter().zip(want) {
        assert!(
            a == b || (a - b).abs() <= 1e-5 * b.abs().max(1.0),
            "{what} lse {a} vs {b}"
        );
    }
}

/// Nonzero dq, dk, dv for a backward to accumulate into (seeds `seed`..`seed + 2`), on the
/// host and their copies on the GPU.
fn initial_grads(g: &Arc<Gpu>, s: &AttnShape, seed: u64) -> ([Vec<f32>; 3], [DevBuf<f32>; 3]) {
    let host = [
        rand(s.q_elems(), seed),
        rand(s.kv_elems(), seed + 1),
        rand(s.kv_elems(), seed + 2),
    ];
    let dev = [0, 1, 2].map(|i| g.upload(&host[i]).unwrap());
    (host, dev)
}

#[test]
fn attention_matches_cpu_forward_and_backward() {
    let Some(g) = gpu("attention_matches_cpu_forward_and_backward") else {
        return;
    };
    let shape =
        |batch, q_len, kv_len, n_heads, n_kv_heads, head_dim, causal, q_start, k_start| AttnShape {
            batch,
            q_len,
            kv_len,
            n_heads,
            n_kv_heads,
            head_dim,
            causal,
            q_start,
            k_start,
        };
    for (s, docs) in [
        AttnShape::causal(2, 33, 4, 2, 8),
        AttnShape::causal(1, 100, 8, 4, 32),
        AttnShape::causal(2, 64, 4, 4, 64),
        AttnShape::causal(1, 40, 2, 1, 128),
        shape(2, 20, 30, 4, 2, 16, false, 0, 0),
        shape(1, 16, 16, 4, 2, 32, true, 32, 16),
        shape(1, 16, 16, 4, 2, 32, true, 16, 32),
        // Head sizes that are not a multiple of 32 above one warp, the largest one, groups
        // of four query heads per KV head, a single query token (decoding against a cache),
        // and a single key.
        AttnShape::causal(2, 37, 8, 2, 80),
        AttnShape::causal(1, 9, 4, 4, 256),
        shape(2, 1, 45, 8, 2, 96, true, 44, 0),
        shape(1, 5, 1, 4, 1, 40, false, 0, 0),
    ]
    .into_iter()
    .map(|s| (s, None))
    .chain(document_mask_cases(32))
    {
        let docs = docs.as_deref();
        let mask = docs.map(|ds| DocMask::cached(&g, &s, ds).unwrap());
        let mask = mask.as_deref();
        let what = format!("{s:?}{}", if docs.is_some() { " documents" } else { "" });
        let (q, k, v, dout) = (
            rand(s.q_elems(), 20),
            rand(s.kv_elems(), 21),
            rand(s.kv_elems(), 22),
            rand(s.q_elems(), 23),
        );
        let (mut out, mut lse) = (vec![0.0; s.q_elems()], vec![0.0; s.lse_elems()]);
        let tiles = AttnTiles::default();
        attention_forward_docs(&s, docs, &q, &k, &v, &mut out, &mut lse, tiles).unwrap();
        let (gq, gk, gv) = (
            g.upload(&q).unwrap(),
            g.upload(&k).unwrap(),
            g.upload(&v).unwrap(),
        );
        let (mut go, mut gl) = (
            g.alloc::<f32>(s.q_elems()).unwrap(),
            g.alloc::<f32>(s.lse_elems()).unwrap(),
        );
        ops::attention_forward(&s, mask, &gq, &gk, &gv, &mut go, &mut gl).unwrap();
        assert_close(&format!("{what} out"), &host(&go), &out);
        assert_lse_close(&what, &host(&gl), &lse);
        let ([mut dq, mut dk, mut dv], [mut gdq, mut gdk, mut gdv]) = initial_grads(&g, &s, 24);
        attention_backward_docs(
            &s, docs, &q, &k, &v, &out, &lse, &dout, &mut dq, &mut dk, &mut dv, tiles,
        )
        .unwrap();
        ops::attention_backward(
            &s,
            mask,
            &gq,
            &gk,
            &gv,
            &go,
            &gl,
            &g.upload(&dout).unwrap(),
            &mut gdq,
            &mut gdk,
            &mut gdv,
        )
        .unwrap();
        assert_close(&format!("{what} dq"), &host(&gdq), &dq);
        assert_close(&format!("{what} dk"), &host(&gdk), &dk);
        assert_close(&format!("{what} dv"), &host(&gdv), &dv);
    }
}

/// Ring attention's merge of a partial result into rows of a whole one, with `lse = −∞` on
/// either side (a query that saw no key yet, or none in this block) and a row range inside the
/// sequence, as the context-parallel ring calls it.
#[test]
fn attention_merge_matches_cpu() {
    use tensor::attention::{merge_partial, MergeRows};
    let Some(g) = gpu("attention_merge_matches_cpu") else {
        return;
    };
    for m in [
        MergeRows {
            b: 1,
            len: 37,
            heads: 4,
            head_dim: 64,
            row0: 5,
            rows: 20,
        },
        MergeRows {
            b: 0,
            len: 16,
            heads: 3,
            head_dim: 40,
            row0: 0,
            rows: 16,
        },
        MergeRows {
            b: 2,
            len: 9,
            heads: 2,
            head_dim: 128,
            row0: 8,
            rows: 1,
        },
    ] {
        let batch = m.b + 1;
        let seq = m.len * m.heads * m.head_dim;
        let out = rand(batch * seq, 40);
        let mut lse: Vec<f32> = rand(batch * m.heads * m.len, 41)
            .iter()
            .map(|x| 3.0 * x)
            .collect();
        let part = rand(m.rows * m.heads * m.head_dim, 42);
        let mut part_lse: Vec<f32> = rand(m.heads * m.rows, 43).iter().map(|x| 3.0 * x).collect();
        // Some rows saw no key before, some see none in this block, one neither.
        for h in 0..m.heads {
            lse[(m.b * m.heads + h) * m.len + m.row0] = f32::NEG_INFINITY;
            part_lse[h * m.rows + m.rows - 1] = f32::NEG_INFINITY;
        }
        let (mut want_out, mut want_lse) = (out.clone(), lse.clone());
        merge_partial(&m, &mut want_out, &mut want_lse, &part, &part_lse).unwrap();
        let (mut go, mut gl) = (g.upload(&out).unwrap(), g.upload(&lse).unwrap());
        let (gp, gpl) = (g.upload(&part).unwrap(), g.upload(&part_lse).unwrap());
        ops::attention_merge(
            &m,
            go.as_mut_slice(),
            gl.as_mut_slice(),
            gp.as_slice(),
            gpl.as_slice(),
        )
        .unwrap();
        assert_close(&format!("{m:?} out"), &host(&go), &want_out);
        let got_lse = host(&gl);
        for (i, (a, b)) in got_lse.iter().zip(&want_lse).enumerate() {
            assert!(
                (a.is_infinite() && a == b) || (a - b).abs() <= 1e-5 * b.abs().max(1.0),
                "{m:?} lse[{i}]: GPU {a} vs CPU {b}"
            );
        }
    }
    // A row range past the sequence is a shape error, not a launch.
    let m = MergeRows {
        b: 0,
        len: 4,
        heads: 1,
        head_dim: 8,
        row0: 2,
        rows: 3,
    };
    let (mut o, mut l) = (g.zeros::<f32>(32).unwrap(), g.zeros::<f32>(4).unwrap());
    let (p, pl) = (g.zeros::<f32>(24).unwrap(), g.zeros::<f32>(3).unwrap());
    assert!(ops::attention_merge(
        &m,
        o.as_mut_slice(),
        l.as_mut_slice(),
        p.as_slice(),
        pl.as_slice()
    )
    .is_err());
}

/// The bf16 bits of `x` (nearest even), as the tensor-core attention kernels take them.
fn bf16_bits(x: &[f32]) -> Vec<u16> {
    x.iter()
        .map(|&v| half::bf16::from_f32(v).to_bits())
        .collect()
}

fn round_bf16(x: &[f32]) -> Vec<f32> {
    x.iter()
        .map(|&v| half::bf16::from_f32(v).to_f32())
        .collect()
}

/// Element-wise scales of the bf16 rounding of `P` and `dS` in the tensor-core kernels, from
/// the reference's own `P = exp(s · scale − lse)` and `dS = P (dP − delta)` (f64, dense, on the
/// rounded inputs): `Σ_j P_ij |v_jd|` (out), `scale Σ_j |dS_ij| |k_jd|` (dq),
/// `scale Σ_h Σ_i |dS_ij| |q_id|` (dk), `Σ_h Σ_i P_ij |dO_id|` (dv); over the pairs that the
/// causal rule and the document mask (`docs`: the starts of the queries' documents) let see
/// each other.
#[allow(clippy::too_many_arguments)]
fn bf16_scales(
    s: &AttnShape,
    docs: Option<&[usize]>,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    out: &[f32],
    lse: &[f32],
    dout: &[f32],
) -> [Vec<f64>; 4] {
    let (d, hs, hkv) = (s.head_dim, s.n_heads, s.n_kv_heads);
    let scale = s.scale() as f64;
    let mut mo = vec![0.0f64; s.q_elems()];
    let mut mq = vec![0.0f64; s.q_elems()];
    let mut mk = vec![0.0f64; s.kv_elems()];
    let mut mv = vec![0.0f64; s.kv_elems()];
    let qi = |b: usize, i: usize, h: usize| ((b * s.q_len + i) * hs + h) * d;
    let kj = |b: usize, j: usize, hk: usize| ((b * s.kv_len + j) * hkv + hk) * d;
    for b in 0..s.batch {
        for h in 0..hs {
            let hk = h / (hs / hkv);
            for i in 0..s.q_len {
                let l = lse[(b * hs + h) * s.q_len + i] as f64;
                let (qo, ko) = (qi(b, i, h), kj(b, 0, hk));
                let delta: f64 = (0..d)
                    .map(|e| dout[qo + e] as f64 * out[qo + e] as f64)
                    .sum();
                let first = docs.map_or(0, |ds| ds[b * s.q_len + i]);
                for j in 0..s.kv_len {
                    if s.causal && s.k_start + j > s.q_start + i || s.k_start + j < first {
                        continue;
                    }
                    let ko = ko + j * hkv * d;
                    let (mut sc, mut dp) = (0.0f64, 0.0f64);
                    for e in 0..d {
                        sc += q[qo + e] as f64 * k[ko + e] as f64;
                        dp += dout[qo + e] as f64 * v[ko + e] as f64;
                    }
                    let p = (sc * scale - l).exp();
                    let ds = (p * (dp - delta)).abs();
                    for e in 0..d {
                        mo[qo + e] += p * (v[ko + e] as f64).abs();
                        mq[qo + e] += scale * ds * (k[ko + e] as f64).abs();
                        mk[ko + e] += scale * ds * (q[qo + e] as f64).abs();
                        mv[ko + e] += p * (dout[qo + e] as f64).abs();
                    }
                }
            }
        }
    }
    [mo, mq, mk, mv]
}

/// `|got − want| ≤ 2 · half_ulp · scale + 1e-5 · max |want|` element by element, `half_ulp`
/// the format's relative rounding (2⁻⁸ bf16, 2⁻¹¹ fp16; see
/// `tensor_core_attention_matches_cpu`).
fn assert_rounded_close(what: &str, got: &[f32], want: &[f32], scale: &[f64], half_ulp: f64) {
    let top = want.iter().fold(0.0f32, |m, x| m.max(x.abs())) as f64;
    for (e, ((&a, &b), &m)) in got.iter().zip(want).zip(scale).enumerate() {
        let bound = 2.0 * half_ulp * m + 1e-5 * top;
        assert!(
            ((a - b) as f64).abs() <= bound,
            "{what}[{e}]: GPU {a} vs CPU {b} (bound {bound:e}: rounding scale {m:e}, max {top:e})"
        );
    }
}

/// A format's rounding of fp32 values, and their bits in it.
type Rounding = fn(&[f32]) -> Vec<f32>;
type Bits = fn(&[f32]) -> Vec<u16>;

/// The fp16 bits of `x` (nearest even).
fn f16_bits(x: &[f32]) -> Vec<u16> {
    x.iter()
        .map(|&v| half::f16::from_f32(v).to_bits())
        .collect()
}

fn round_f16(x: &[f32]) -> Vec<f32> {
    x.iter().map(|&v| half::f16::from_f32(v).to_f32()).collect()
}

/// The tensor-core kernels (`attention_forward_tc` / `attention_backward_tc`) against the CPU
/// fp32 kernels on head sizes 64 and 128 (and 32), causal and not, lengths that are not
/// multiples of the 64-row tiles (100, 33, 1), grouped KV heads (8 over 2), the offsets of ring
/// attention (a query block after its key block, one before it: no query sees a key, out 0
/// and lse −inf), several batches; the backward accumulates into nonzero dq, dk, dv.
///
/// Both operand formats: bf16 (bf16 steps) and fp16 (fp16 steps).
///
/// Tolerance. The CPU kernel runs on inputs rounded to the format (the kernels take q, k, v as
/// their 16-bit bits, rounded the same way, nearest even; dout is given rounded to both, since
/// the GPU computes delta from it in fp32 before rounding it for the products), and the
/// backward of both gets the CPU's out and lse, so the products of rounded operands and the
/// fp32 softmax agree up to fp32 rounding. What is left is the rounding of P (forward:
/// O = Σ_j r(P_ij) v_j / l; backward: dV = Σ_i r(P_ij) dO_i) and of dS (dQ = scale Σ_j r(dS_ij)
/// k_j, dK = scale Σ_i r(dS_ij) q_i): rounding to p significant bits (nearest; bf16 p = 8,
/// fp16 p = 11) changes each by half an ulp, a relative 2⁻ᵖ at most (the ulp is 2¹⁻ᵖ of the
/// leading bit), so the error of an output element is at most 2⁻ᵖ times its "rounding scale"
/// (`bf16_scales`: the same sum over absolute values, e.g. Σ_j P_ij |v_jd|); a numpy emulation
/// of the kernels reached 0.82 of that in bf16. The bound is twice it, 2¹⁻ᵖ · scale, the
/// factor 2 for what the derivation leaves out at relative 1e-6 or less (P and dS from fp32
/// scores summed in another order, expf vs the CPU's exp, the tensor cores' fp32
/// accumulation, 1/l; in fp16 the few P or dS below 2⁻¹⁴, fp16's subnormals, whose rounding
/// is absolute, 2⁻²⁵ at most, a relative 4e-6 of the largest v over these ≤ 130 keys), plus
/// the fp32 tolerance of the other tests, 1e-5 of the largest element (the fp32 sums of the
/// initial dq, dk, dv and a difference dP − delta that cancels).
///
/// Every kernel choice (`AttnKernels`) runs: the forward with one and two m-tiles of query
/// rows a warp (head sizes up to 64; above, the same kernels), the backward split with either
/// (dQ the same bits: the same sums in the same order) and fused (head sizes up to 64 without a
/// document mask; otherwise the split kernels). The fused kernel's dk and dv are the split
/// kernel's bits; its dq adds each key
/// block's share into dq in turn, one more fp32 rounding per block of 64 keys (at most 16
/// here, well inside the 1e-5), and is the same bits run to run (checked on the longest shape,
/// 16 key blocks over 4 query heads a KV head, where the blocks' adds wait on each other).
#[test]
fn tensor_core_attention_matches_cpu() {
    let Some(g) = gpu("tensor_core_attention_matches_cpu") else {
        return;
    };
    let shape =
        |batch, q_len, kv_len, n_heads, n_kv_heads, head_dim, causal, q_start, k_start| AttnShape {
            batch,
            q_len,
            kv_len,
            n_heads,
            n_kv_heads,
            head_dim,
            causal,
            q_start,
            k_start,
        };
    for (s, docs, format) in [
        AttnShape::causal(2, 100, 8, 2, 64),
        AttnShape::causal(1, 100, 4, 4, 128),
        AttnShape::causal(2, 130, 8, 2, 128),
        shape(2, 100, 33, 8, 2, 64, false, 0, 0),
        shape(2, 33, 100, 8, 2, 128, false, 0, 0),
        shape(2, 1, 45, 8, 2, 64, true, 44, 0),
        shape(1, 33, 1, 4, 1, 128, false, 0, 0),
        // Ring attention: the query block after its key block (every key visible), before it
        // (none: out 0, lse −inf, gradients unchanged), and overlapping it partly.
        shape(2, 64, 64, 8, 2, 64, true, 64, 0),
        shape(2, 64, 64, 8, 2, 128, true, 0, 64),
        shape(1, 100, 130, 8, 2, 64, true, 30, 0),
        shape(1, 100, 70, 4, 2, 128, true, 0, 40),
        AttnShape::causal(1, 70, 2, 1, 32),
        // Three blocks of 128 query rows, the last ragged (two m-tiles a warp at head 64).
        AttnShape::causal(1, 300, 2, 1, 64),
        // 16 key blocks: the fused kernel's ordered adds, 32 CTAs at once.
        AttnShape::causal(1, 1024, 2, 1, 64),
    ]
    .into_iter()
    .map(|s| (s, None))
    .chain(document_mask_cases(64))
    .chain(document_mask_cases(128))
    .flat_map(|(s, docs)| [Operands::Bf16, Operands::F16].map(|f| (s, docs.clone(), f)))
    {
        let docs = docs.as_deref();
        let mask = docs.map(|ds| DocMask::cached(&g, &s, ds).unwrap());
        let mask = mask.as_deref();
        let (round, bits, half_ulp) = match format {
            Operands::F16 => (round_f16 as Rounding, f16_bits as Bits, 2f64.powi(-11)),
            _ => (round_bf16 as Rounding, bf16_bits as Bits, 2f64.powi(-8)),
        };
        let (q, k, v) = (
            rand(s.q_elems(), 40),
            rand(s.kv_elems(), 41),
            rand(s.kv_elems(), 42),
        );
        let dout = round(&rand(s.q_elems(), 43));
        let (qr, kr, vr) = (round(&q), round(&k), round(&v));
        let (mut out, mut lse) = (vec![0.0; s.q_elems()], vec![0.0; s.lse_elems()]);
        let tiles = AttnTiles::default();
        attention_forward_docs(&s, docs, &qr, &kr, &vr, &mut out, &mut lse, tiles).unwrap();
        let [mo, mq, mk, mv] = bf16_scales(&s, docs, &qr, &kr, &vr, &out, &lse, &dout);
        let (gq, gk, gv) = (
            g.upload(&bits(&q)).unwrap(),
            g.upload(&bits(&k)).unwrap(),
            g.upload(&bits(&v)).unwrap(),
        );
        let (mut go, mut gl) = (
            g.alloc::<f32>(s.q_elems()).unwrap(),
            g.alloc::<f32>(s.lse_elems()).unwrap(),
        );
        let what = format!(
            "{format:?} {s:?}{}",
            if docs.is_some() { " documents" } else { "" }
        );
        for warp_rows in [WarpRows::One, WarpRows::Two] {
            let kernels = AttnKernels {
                warp_rows,
                ..ATTN_KERNELS
            };
            ops::attention_forward_tc(kernels, &s, mask, format, &gq, &gk, &gv, &mut go, &mut gl)
                .unwrap();
            let what = format!("{what} {warp_rows:?}");
            assert_rounded_close(&format!("{what} out"), &host(&go), &out, &mo, half_ulp);
            assert_lse_close(&what, &host(&gl), &lse);
        }
        let ([mut dq, mut dk, mut dv], _) = initial_grads(&g, &s, 44);
        attention_backward_docs(
            &s, docs, &qr, &kr, &vr, &out, &lse, &dout, &mut dq, &mut dk, &mut dv, tiles,
        )
        .unwrap();
        let (go, gl, gdo) = (
            g.upload(&out).unwrap(),
            g.upload(&lse).unwrap(),
            g.upload(&dout).unwrap(),
        );
        let backward = |warp_rows, backward| {
            let kernels = AttnKernels {
                warp_rows,
                backward,
            };
            let (_, [mut gdq, mut gdk, mut gdv]) = initial_grads(&g, &s, 44);
            ops::attention_backward_tc(
                kernels, &s, mask, format, &gq, &gk, &gv, &go, &gl, &gdo, &mut gdq, &mut gdk,
                &mut gdv,
            )
            .unwrap();
            [host(&gdq), host(&gdk), host(&gdv)]
        };
        let split = backward(WarpRows::One, AttnBackwardKernels::Split);
        let split2 = backward(WarpRows::Two, AttnBackwardKernels::Split);
        let fused = backward(WarpRows::One, AttnBackwardKernels::Fused);
        for (kernels, [gdq, gdk, gdv]) in [
            ("split", &split),
            ("split, two m-tiles", &split2),
            ("fused", &fused),
        ] {
            let what = format!("{what} {kernels}");
            assert_rounded_close(&format!("{what} dq"), gdq, &dq, &mq, half_ulp);
            assert_rounded_close(&format!("{what} dk"), gdk, &dk, &mk, half_ulp);
            assert_rounded_close(&format!("{what} dv"), gdv, &dv, &mv, half_ulp);
        }
        let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        assert!(
            bits(&fused[1]) == bits(&split[1]) && bits(&fused[2]) == bits(&split[2]),
            "{what}: the fused kernel's dk, dv are not the split kernel's"
        );
        assert!(
            split2.iter().zip(&split).all(|(a, b)| bits(a) == bits(b)),
            "{what}: dQ with two m-tiles a warp is not the bits of one m-tile's"
        );
        if s.q_len == 1024 {
            let again = backward(WarpRows::One, AttnBackwardKernels::Fused);
            assert!(
                bits(&again[0]) == bits(&fused[0]),
                "{what}: the fused kernel's dq differs run to run"
            );
        }
    }
    // Head sizes the kernels do not take are a shape error (the caller falls back to fp32).
    for d in [8, 40, 256] {
        let s = AttnShape::causal(1, 4, 2, 1, d);
        let (gq, gk) = (
            g.upload(&bf16_bits(&rand(s.q_elems(), 1))).unwrap(),
            g.upload(&bf16_bits(&rand(s.kv_elems(), 2))).unwrap(),
        );
        let (mut go, mut gl) = (
            g.alloc::<f32>(s.q_elems()).unwrap(),
            g.alloc::<f32>(s.lse_elems()).unwrap(),
        );
        let err = ops::attention_forward_tc(
            ATTN_KERNELS,
            &s,
            None,
            Operands::Bf16,
            &gq,
            &gk,
            &gk,
            &mut go,
            &mut gl,
        )
        .unwrap_err();
        assert!(
            matches!(err, tensor::cuda::CudaError::Shape(_)),
            "head_dim {d}: {err}"
        );
    }
    // fp32 "operands" are not a tensor-core format (one head, so that one buffer is the
    // right size for q, k and v alike).
    let s = AttnShape::causal(1, 4, 1, 1, 64);
    let x = g.upload(&bf16_bits(&rand(s.q_elems(), 3))).unwrap();
    let (mut go, mut gl) = (
        g.alloc::<f32>(s.q_elems()).unwrap(),
        g.alloc::<f32>(s.lse_elems()).unwrap(),
    );
    let err = ops::attention_forward_tc(
        ATTN_KERNELS,
        &s,
        None,
        Operands::F32,
        &x,
        &x,
        &x,
        &mut go,
        &mut gl,
    )
    .unwrap_err();
    assert!(err.to_string().contains("fp32"), "{err}");
}

/// AdamW with two weight-decay segments against `model::optim::AdamW::update`'s formula (the
/// same operations; repeated here, as the tensor crate sits below the model crate), over
/// three steps; and the f64 sum of squares.
#[test]
fn adamw_and_square_sum_match_cpu() {
    let Some(g) = gpu("adamw_and_square_sum_match_cpu") else {
        return;
    };
    let n = 70_001;
    let (b1, b2, eps, lr, wd) = (0.9f32, 0.95f32, 1e-8f32, 3e-3f32, 0.1f32);
    let mut p = rand(n, 30);
    let (mut m, mut v) = (vec![0.0f32; n], vec![0.0f32; n]);
    let segments = [(40_000, 1.0 - lr * wd), (n, 1.0)];
    let (mut gp, mut gm, mut gv) = (
        g.upload(&p).unwrap(),
        g.upload(&m).unwrap(),
        g.upload(&v).unwrap(),
    );
    for t in 1..=3u64 {
        let grad = rand(n, 30 + t);
        let s = ops::AdamScalars::new(b1, b2, eps, lr, t);
        ops::adamw(
            &mut gp,
            &g.upload(&grad).unwrap(),
            &mut gm,
            &mut gv,
            &segments,
            s,
        )
        .unwrap();
        for i in 0..n {
            let decay = if i < 40_000 { 1.0 - lr * wd } else { 1.0 };
            p[i] *= decay;
            m[i] += s.one_m_b1 * (grad[i] - m[i]);
            v[i] = v[i] * s.b2 + s.one_m_b2 * grad[i] * grad[i];
            let denom = v[i].sqrt() / s.bc2_sqrt + s.eps;
            p[i] -= s.step_size * (m[i] / denom);
        }
    }
    // Bit for bit: the kernel rounds each operation on its own, in this order (no contraction
    // into fused multiply-adds), as the CPU does.
    for (what, got, want) in [("params", &gp, &p), ("m", &gm, &m), ("v", &gv, &v)] {
        let got = host(got);
        let differ = got
            .iter()
            .zip(want)
            .filter(|(a, b)| a.to_bits() != b.to_bits());
        assert_eq!(
            differ.count(),
            0,
            "adamw {what}: the GPU's bits differ from the CPU's"
        );
    }
    let x = rand(n, 40);
    let want: f64 = x.iter().map(|&a| a as f64 * a as f64).sum();
    let got = ops::sq_sum(&g.upload(&x).unwrap()).unwrap();
    assert!((got - want).abs() <= 1e-12 * want, "{got} vs {want}");
}

/// 16-bit training's one-pass step (`adamw_bits`) against the four kernels it replaces, run
/// one after the other on the same buffers — widen the gradient bits, scale them by the
/// clipping factor, `adamw`, round the master into the weights — bit for bit (the same
/// operations on the same values; the kernel keeps the scaling a separate rounding), in bf16
/// and fp16, over three steps.
#[test]
fn adamw_from_16_bit_gradients_is_widen_scale_update_round() {
    let Some(g) = gpu("adamw_from_16_bit_gradients_is_widen_scale_update_round") else {
        return;
    };
    let n = 70_001;
    let (b1, b2, eps, lr, wd, factor) = (0.9f32, 0.95f32, 1e-8f32, 3e-3f32, 0.1f32, 0.37f32);
    let decay = 1.0 - lr * wd;
    for f16 in [false, true] {
        let bits: Bits = if f16 { f16_bits } else { bf16_bits };
        let master = rand(n, 60);
        let [(mut p1, mut m1, mut v1), (mut p2, mut m2, mut v2)] = [0, 1].map(|_| {
            (
                g.upload(&master).unwrap(),
                g.zeros::<f32>(n).unwrap(),
                g.zeros::<f32>(n).unwrap(),
            )
        });
        let (mut w1, mut w2) = (g.zeros::<u16>(n).unwrap(), g.zeros::<u16>(n).unwrap());
        for t in 1..=3u64 {
            let s = ops::AdamScalars::new(b1, b2, eps, lr, t);
            let grad = g.upload(&bits(&rand(n, 60 + t))).unwrap();
            // One pass.
            ops::adamw_bits(
                &mut p1, &grad, &mut m1, &mut v1, &mut w1, f16, factor, decay, s,
            )
            .unwrap();
            // The four kernels.
            let mut wide = g.zeros::<f32>(n).unwrap();
            if f16 {
                ops::cast_f16_to_f32(&grad, &mut wide).unwrap();
            } else {
                ops::cast_bf16_to_f32(&grad, &mut wide).unwrap();
            }
            ops::scale(&mut wide, factor).unwrap();
            ops::adamw(&mut p2, &wide, &mut m2, &mut v2, &[(n, decay)], s).unwrap();
            if f16 {
                ops::cast_f32_to_f16(&p2, &mut w2).unwrap();
            } else {
                ops::cast_f32_to_bf16(&p2, &mut w2).unwrap();
            }
        }
        let format = if f16 { "fp16" } else { "bf16" };
        for (what, a, b) in [("master", &p1, &p2), ("m", &m1, &m2), ("v", &v1, &v2)] {
            let (a, b) = (host(a), host(b));
            let same = a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits());
            assert!(
                same,
                "{format} {what}: the one pass differs from the four kernels"
            );
        }
        assert_eq!(
            w1.to_host().unwrap(),
            w2.to_host().unwrap(),
            "{format} weights"
        );
    }
}

/// The router's softmax and top-k (ties to the lower expert), and the row movements.
#[test]
fn router_and_row_moves_match_cpu() {
    let Some(g) = gpu("router_and_row_moves_match_cpu") else {
        return;
    };
    let (tokens, experts, k, dim) = (90, 8, 2, 40);
    let mut logits = rand(tokens * experts, 50);
    logits[3] = logits[5]; // a tie in token 0
    let bias = rand(experts, 51)
        .iter()
        .map(|b| 0.01 * b)
        .collect::<Vec<_>>();
    for use_bias in [false, true] {
        let b = use_bias.then(|| g.upload(&bias).unwrap());
        let ops::Routed {
            probs: gp,
            experts: ge,
            weights: gw,
        } = ops::router_topk(
            &g.upload(&logits).unwrap(),
            b.as_ref().map(|b| b.as_slice()),
            experts,
            k,
        )
        .unwrap();
        let mut probs = vec![0.0; logits.len()];
        tensor::softmax::softmax_rows(&logits, experts, &mut probs).unwrap();
        assert_close("router probs", &host(&gp), &probs);
        let (ge, gw) = (host(&ge), host(&gw));
        for t in 0..tokens {
            let pr = &probs[t * experts..(t + 1) * experts];
            let score: Vec<f32> = (0..experts)
                .map(|e| pr[e] + if use_bias { bias[e] } else { 0.0 })
                .collect();
            let mut order: Vec<usize> = (0..experts).collect();
            order.sort_by(|&a, &b| score[b].total_cmp(&score[a]));
            let sum: f32 = order[..k].iter().map(|&e| pr[e]).sum();
            for j in 0..k {
                assert_eq!(ge[t * k + j] as usize, order[j], "token {t} choice {j}");
                let w = pr[order[j]] / sum;
                assert!((gw[t * k + j] - w).abs() <= 1e-6, "token {t} weight {j}");
            }
        }
    }
    // Row moves through tensor::ops, against their host twins (tensor::rows).
    let src = rand(tokens * dim, 52);
    let idx: Vec<u32> = (0..tokens as u32 * 2)
        .map(|i| (i * 37) % tokens as u32)
        .collect();
    let scale = rand(idx.len(), 53);
    let d_src = Buf::Cuda(g.upload(&src).unwrap());
    for sc in [None, Some(&scale[..])] {
        let rows = tensor::ops::gather_rows(d_src.r(), &idx, sc, dim).unwrap();
        let want = tensor::rows::gather_rows(&src, &idx, sc, dim).unwrap();
        assert_eq!(rows.to_vec().unwrap(), want, "gathered rows");
    }
    // One expert's tokens: distinct indices.
    let dst_idx: Vec<u32> = (0..tokens as u32).filter(|t| t % 3 != 1).collect();
    let rows = rand(dst_idx.len() * dim, 54);
    let w = rand(dst_idx.len(), 55);
    let y0 = rand(tokens * dim, 56);
    for wt in [None, Some(&w[..])] {
        let mut gy = Buf::Cuda(g.upload(&y0).unwrap());
        let d_rows = Buf::Cuda(g.upload(&rows).unwrap());
        tensor::ops::scatter_add_rows(d_rows.r(), &dst_idx, wt, gy.m(), dim).unwrap();
        let mut want = y0.clone();
        tensor::rows::scatter_add_rows(&rows, &dst_idx, wt, &mut want, dim).unwrap();
        assert_close("scattered rows", &gy.to_vec().unwrap(), &want);
    }
    let d_rows = Buf::Cuda(g.upload(&rows).unwrap());
    let dots = tensor::ops::row_dots(d_src.r(), &dst_idx, d_rows.r(), dim).unwrap();
    let want = tensor::rows::row_dots(&src, &dst_idx, &rows, dim).unwrap();
    assert_close("row dots", &dots, &want);
    // A bad index is refused before any kernel runs.
    assert!(tensor::ops::gather_rows(d_src.r(), &[tokens as u32], None, dim).is_err());
}

/// cuBLASLt products with `tensor::gemm::matmul`'s conventions, every transpose, with and
/// without accumulation; fp32 keeps fp32 accuracy (no TF32).
#[test]
fn matmul_matches_cpu() {
    let Some(g) = gpu("matmul_matches_cpu") else {
        return;
    };
    for (m, k, n) in [(1, 1, 1), (33, 65, 17), (128, 256, 96), (512, 64, 1000)] {
        for (ta, tb) in [(false, false), (false, true), (true, false), (true, true)] {
            for acc in [false, true] {
                let (a, b, c0) = (rand(m * k, 60), rand(k * n, 61), rand(m * n, 62));
                let mut want = c0.clone();
                tensor::gemm::matmul(&mut want, &a, &b, m, k, n, ta, tb, acc).unwrap();
                let mut gc = g.upload(&c0).unwrap();
                tensor::cuda::blas::matmul(
                    &mut gc,
                    &g.upload(&a).unwrap(),
                    &g.upload(&b).unwrap(),
                    m,
                    k,
                    n,
                    ta,
                    tb,
                    acc,
                )
                .unwrap();
                let e = rel(&host(&gc), &want);
                // k products of values in [-1, 1]: both sides round k times; the bound is
                // the f32 error of a length-k sum relative to the largest result.
                assert!(
                    e <= 1e-5 * (k as f32).sqrt().max(1.0),
                    "{m}x{k}x{n} ta={ta} tb={tb} acc={acc}: {e:e}"
                );
            }
        }
    }
}

/// Products with 16-bit operands on the tensor cores (`tensor::operands`): the same product of
/// the operands rounded to bf16 / fp16 on the host, summed in f64. Both round each operand the
/// same way (round to nearest even), and a product of two 16-bit values is exact in fp32, so
/// what remains is the fp32 accumulation of k terms: at most k·2^-24·Σ|a||b| per element
/// (the standard bound of a length-k sum); doubled, as the tensor cores' fp32 accumulation is
/// not guaranteed to round to nearest.
#[test]
fn sixteen_bit_operand_products_match_rounded_cpu() {
    use tensor::operands::Operands;
    let Some(g) = gpu("sixteen_bit_operand_products_match_rounded_cpu") else {
        return;
    };
    for operands in [Operands::Bf16, Operands::F16] {
        let round = |x: &[f32]| -> Vec<f32> {
            x.iter()
                .map(|&v| match operands {
                    Operands::Bf16 => half::bf16::from_f32(v).to_f32(),
                    _ => half::f16::from_f32(v).to_f32(),
                })
                .collect()
        };
        for (m, k, n) in [(1, 1, 1), (33, 65, 17), (128, 256, 96), (512, 64, 1000)] {
            for (ta, tb) in [(false, false), (false, true), (true, false), (true, true)] {
                for acc in [false, true] {
                    let (a, b, c0) = (rand(m * k, 63), rand(k * n, 64), rand(m * n, 65));
                    let (ar, br) = (round(&a), round(&b));
                    let at = |i: usize, l: usize| if ta { ar[l * m + i] } else { ar[i * k + l] };
                    let bt = |l: usize, j: usize| if tb { br[j * k + l] } else { br[l * n + j] };
                    let gc = g.upload(&c0).unwrap();
                    // SAFETY: gc, a and b hold m·n, m·k and k·n elements on one device.
                    unsafe {
                        ops::matmul_operands(
                            operands,
                            gc.ptr(),
                            g.upload(&a).unwrap().as_slice(),
                            g.upload(&b).unwrap().as_slice(),
                            [m, k, n],
                            [ta, tb, acc],
                        )
                        .unwrap()
                    };
                    let got = host(&gc);
                    for i in 0..m {
                        for j in 0..n {
                            let (mut want, mut mag) = (0.0f64, 0.0f64);
                            for l in 0..k {
                                let p = at(i, l) as f64 * bt(l, j) as f64;
                                want += p;
                                mag += p.abs();
                            }
                            if acc {
                                want += c0[i * n + j] as f64;
                                mag += (c0[i * n + j] as f64).abs();
                            }
                            let bound = 2.0 * (k + 1) as f64 * mag / (1u64 << 24) as f64;
                            let e = (got[i * n + j] as f64 - want).abs();
                            assert!(
                                e <= bound,
                                "{operands:?} {m}x{k}x{n} ta={ta} tb={tb} acc={acc} [{i},{j}]: {} vs {want} (bound {bound:e})",
                                got[i * n + j]
                            );
                        }
                    }
                }
            }
        }
    }
}

/// Operands rounded once for several products (`tensor::operands::Operand`, `Kept`): every
/// product equals, bit for bit, the same product given the fp32 values (rounded inside it):
/// the rounding is one function of the same values, and the product the same cuBLASLt call.
/// An operand rounded for one format is refused by a product of the other.
/// A registered widening (`cuda::widening`: a unit's 16-bit weights widened for the layers)
/// makes a product read the 16-bit bits instead of rounding the fp32 copy: bit for bit the
/// product of the copy rounded inside it (rounding a widened value returns its bits), for the
/// whole copy and for a slice inside it (a layer's weight in a unit), in bf16 and fp16. That
/// the bits are what it reads shows when the copy is changed behind the registration's back:
/// the product keeps the bits' result until the guard drops, then follows the copy. Another
/// format (a bf16 widening seen by an fp16 product) rounds the copy as before.
#[test]
fn registered_widenings_give_products_the_stored_bits() {
    use tensor::buf::Dev;
    use tensor::cuda::widening::Widening;
    use tensor::operands::{Operands, Scope};
    let Some(g) = gpu("registered_widenings_give_products_the_stored_bits") else {
        return;
    };
    let dev = Dev::Cuda(g.clone());
    let (m, k, n) = (64, 96, 40);
    let x = dev.from_vec(rand(m * k, 91)).unwrap();
    for (format, bits_of, widen) in [
        (Operands::Bf16, bf16_bits as Bits, round_bf16 as Rounding),
        (Operands::F16, f16_bits as Bits, round_f16 as Rounding),
    ] {
        let _scope = Scope::enter(format);
        // A unit of two weights: [n, k] at 0 and [n, k] after 8 elements of something else.
        let unit = rand(2 * n * k + 8, 92);
        let bits = g.upload(&bits_of(&unit)).unwrap();
        let mut copy = g.upload(&widen(&unit)).unwrap();
        let second = 8 + n * k..8 + 2 * n * k;
        // The product with weight range `r` of `values` in a fresh, unregistered buffer.
        let product = |values: &[f32], r: std::ops::Range<usize>| {
            let w = dev.from_vec(values[r].to_vec()).unwrap();
            let y = tensor::ops::matmul_new(x.r(), w.r(), m, k, n, false, true);
            y.unwrap().to_vec().unwrap()
        };
        let want = [
            product(&widen(&unit), 0..n * k),
            product(&widen(&unit), second.clone()),
        ];
        let reg = unsafe { Widening::register(copy.as_slice(), bits.as_slice(), format) }.unwrap();
        // Weight range `r` of the registered copy itself.
        let in_place = |copy: &DevBuf<f32>, r: std::ops::Range<usize>| {
            let w = tensor::buf::BufRef::Cuda(copy.as_slice().slice(r));
            let y = tensor::ops::matmul_new(x.r(), w, m, k, n, false, true);
            y.unwrap().to_vec().unwrap()
        };
        assert_eq!(
            in_place(&copy, 0..n * k),
            want[0],
            "{format:?}: first weight"
        );
        assert_eq!(
            in_place(&copy, second.clone()),
            want[1],
            "{format:?}: second"
        );
        // Change the copy behind the registration: the products still read the bits.
        let changed: Vec<f32> = widen(&unit).iter().map(|v| v * 2.0 + 1.0).collect();
        copy.copy_from_host(&changed).unwrap();
        assert_eq!(
            in_place(&copy, 0..n * k),
            want[0],
            "{format:?}: reads the bits"
        );
        {
            let _other = Scope::enter(if format == Operands::Bf16 {
                Operands::F16
            } else {
                Operands::Bf16
            });
            let other = in_place(&copy, 0..n * k);
            assert_eq!(
                other,
                product(&changed, 0..n * k),
                "{format:?}: another format"
            );
        }
        drop(reg);
        let after = in_place(&copy, 0..n * k);
        assert_ne!(
            after, want[0],
            "{format:?}: unregistered, the copy's values again"
        );
        assert_eq!(
            after,
            product(&changed, 0..n * k),
            "{format:?}: as any fp32 operand"
        );
    }
    // Mismatched lengths, or fp32, are refused.
    let (v, b) = (g.zeros::<f32>(4).unwrap(), g.zeros::<u16>(5).unwrap());
    assert!(unsafe { Widening::register(v.as_slice(), b.as_slice(), Operands::Bf16) }.is_err());
    let b4 = g.zeros::<u16>(4).unwrap();
    assert!(unsafe { Widening::register(v.as_slice(), b4.as_slice(), Operands::F32) }.is_err());
}

/// 16-bit gradients take a product through an fp32 copy: widened, accumulated into with a
/// 16-bit product (fp32 sums), rounded back — `round(g + dyᵀ·x)`, rounded once from the exact
/// sum (within half a unit in the last place plus the fp32 summation's error), for a long sum
/// and one too short to split. A product accumulating into 16 bits directly is refused:
/// cuBLASLt's `D = A·B + C` in 16 bits rounds `A·B` before adding `C` (on an H200 with CUDA
/// 13, 1535 of these cases' 7680 elements outside this bound, by up to one unit of `A·B`).
#[test]
fn products_accumulate_into_16_bit_gradients_rounded_once() {
    use tensor::buf::{BufMut, Dev};
    use tensor::cuda::blas::{matmul_raw_into, GemmInput, GemmOutput};
    use tensor::operands::{Operands, Scope};
    let Some(g) = gpu("products_accumulate_into_16_bit_gradients_rounded_once") else {
        return;
    };
    let dev = Dev::Cuda(g.clone());
    let mut wrong = Vec::new();
    // dW [dout, din] += dyᵀ·x over `tokens`, after 16 elements of another tensor.
    for (dout, tokens, din, off) in [(48, 200, 40, 16), (48, 8, 40, 16)] {
        let w = off..off + dout * din;
        let (dy_host, x_host) = (rand(tokens * dout, 93), rand(tokens * din, 94));
        let dy = dev.from_vec(dy_host.clone()).unwrap();
        let x = dev.from_vec(x_host.clone()).unwrap();
        let grads: Vec<f32> = rand(off + dout * din, 95).iter().map(|v| 3.0 * v).collect();
        for (format, widen) in [
            (Operands::Bf16, round_bf16 as Rounding),
            (Operands::F16, round_f16 as Rounding),
        ] {
            let _scope = Scope::enter(format);
            // The exact sum of the rounded gradient and the product of the rounded operands
            // (f64 holds each 16-bit product exactly and the sum to ~1e-16), and the bound of a
            // value rounded once from an fp32 sum of it: half a unit in the last place of the
            // format, plus the fp32 summation's error (γ_K · Σ|terms|, Higham 2002 §3.1).
            let (dyr, xr, g0) = (widen(&dy_host), widen(&x_host), widen(&grads));
            let mantissa = if format == Operands::Bf16 { 7 } else { 10 };
            let mut copy = g.upload(&g0).unwrap();
            tensor::ops::matmul(
                BufMut::Cuda(copy.slice_mut(w.clone())),
                dy.r(),
                x.r(),
                dout,
                tokens,
                din,
                true,
                false,
                true,
            )
            .unwrap();
            let got = widen(&host(&copy));
            assert_eq!(got[..off], g0[..off], "{format:?}: outside left alone");
            for (e, &v) in got[w.clone()].iter().enumerate() {
                let (i, j) = (e / din, e % din);
                let c0 = g0[off + e] as f64;
                let (mut exact, mut size) = (c0, c0.abs());
                for t in 0..tokens {
                    let term = dyr[t * dout + i] as f64 * xr[t * din + j] as f64;
                    exact += term;
                    size += term.abs();
                }
                let binade = exact.abs().max(1e-4).log2().floor() as i32;
                let bound = 0.5 * 2f64.powi(binade - mantissa)
                    + (tokens + 2) as f64 * 2f64.powi(-24) * size;
                if (v as f64 - exact).abs() > bound {
                    wrong.push(format!(
                        "{format:?} [{dout}x{tokens}x{din}] element {e}: {v} against the exact \
                         {exact} (bound {bound:.3e})"
                    ));
                }
            }
            // Into 16 bits directly: refused.
            let bits = g.zeros::<u16>(dout * din).unwrap();
            let input = if format == Operands::Bf16 {
                GemmInput::Bf16
            } else {
                GemmInput::F16
            };
            let err = unsafe {
                matmul_raw_into(
                    &g,
                    input,
                    GemmOutput::Input,
                    bits.ptr(),
                    bits.ptr(),
                    bits.ptr(),
                    [din, 1, dout],
                    [false, false, true],
                )
            }
            .unwrap_err();
            assert!(err.to_string().contains("rounds it twice"), "{err}");
        }
    }
    assert!(
        wrong.is_empty(),
        "{} values not rounded once from the sum:\n{}",
        wrong.len(),
        wrong
            .iter()
            .take(12)
            .cloned()
            .collect::<Vec<_>>()
            .join("\n")
    );
}

#[test]
fn operands_rounded_once_give_the_same_products() {
    use tensor::buf::{BufRef, Dev};
    use tensor::operands::{Kept, Operand, Operands, Scope};
    let Some(g) = gpu("operands_rounded_once_give_the_same_products") else {
        return;
    };
    let dev = Dev::Cuda(g.clone());
    let (m, k, n) = (96, 200, 72);
    let x = Arc::new(dev.from_vec(rand(m * k, 71)).unwrap());
    let ws: Vec<Buf> = (0..3)
        .map(|i| dev.from_vec(rand(n * k, 72 + i)).unwrap())
        .collect();
    for format in [Operands::F32, Operands::Bf16, Operands::F16] {
        let _scope = Scope::enter(format);
        let once = Operand::new(x.r()).unwrap();
        assert_eq!(
            matches!(once, Operand::Rounded(_)),
            format != Operands::F32,
            "{format:?}"
        );
        let kept = Kept::new(x.clone()).unwrap();
        let half = if format == Operands::F32 { 4 } else { 2 };
        assert_eq!(kept.bytes(), half * m * k, "{format:?}: what a task keeps");
        for w in &ws {
            let plain = tensor::ops::matmul_new(x.r(), w.r(), m, k, n, false, true).unwrap();
            let shared =
                tensor::ops::matmul_new(once.clone(), w.r(), m, k, n, false, true).unwrap();
            let from_kept = tensor::ops::matmul_new(kept.r(), w.r(), m, k, n, false, true).unwrap();
            let want = plain.to_vec().unwrap();
            assert_eq!(shared.to_vec().unwrap(), want, "{format:?}: rounded once");
            assert_eq!(from_kept.to_vec().unwrap(), want, "{format:?}: kept");
            // Accumulating into an existing product, the weight gradient's form (xᵀ·dy).
            let dy = dev.from_vec(rand(m * n, 80)).unwrap();
            let dyo = Operand::new(dy.r()).unwrap();
            let mut a = dev.from_vec(rand(n * k, 81)).unwrap();
            let mut b = a.try_clone().unwrap();
            tensor::ops::matmul(a.m(), dy.r(), x.r(), n, m, k, true, false, true).unwrap();
            tensor::ops::matmul(b.m(), dyo, kept.r(), n, m, k, true, false, true).unwrap();
            assert_eq!(b.to_vec().unwrap(), a.to_vec().unwrap(), "{format:?}: dW");
        }
    }
    // Rounded for bf16, used by an fp16 product: refused, naming both.
    let bf = {
        let _s = Scope::enter(Operands::Bf16);
        Operand::new(BufRef::from(&*x)).unwrap()
    };
    let _s = Scope::enter(Operands::F16);
    let Err(e) = tensor::ops::matmul_new(bf, ws[0].r(), m, k, n, false, true) else {
        panic!("a bf16 operand in an fp16 product must be refused")
    };
    assert!(
        e.to_string().contains("Bf16") && e.to_string().contains("F16"),
        "{e}"
    );
}

/// Attention's Q, K, V prepared once (`tensor::ops::attention_operand`, what the model keeps
/// for the backward) give the same bits, forward and backward, as fp32 values that the
/// attention rounds itself: in a bf16 or fp16 step both reach the tensor-core kernels as the
/// same 16-bit copies (and prepared, each is half the bytes of the values); in fp32 steps, and
/// at a head size the tensor cores do not take, attention runs the fp32 kernels and the
/// operands are the values themselves. Refused with a clear error: operands rounded for bf16
/// given to an fp32 attention, a bf16 view that is not 16-byte aligned, an output view that is
/// not 8-byte aligned.
/// The kernels that write their results rounded for the products that read them next
/// (`tensor::prepared`: RMSNorm, SwiGLU forward and backward, RoPE either way) give, in a bf16
/// or fp16 step, the bits of the fp32 kernel's result rounded by a copy afterwards — the path
/// they replace — bit for bit; in an fp32 step, the fp32 kernel's values. RoPE's rounding
/// leaves its input as it was.
#[test]
fn kernels_that_round_their_results_give_the_rounded_copy_bits() {
    fn r(b: &DevBuf<f32>) -> tensor::buf::BufRef<'_> {
        tensor::buf::BufRef::Cuda(b.as_slice())
    }
    use tensor::buf::Buf;
    use tensor::operands::{Kept, Scope};
    use tensor::prepared;
    let Some(g) = gpu("kernels_that_round_their_results_give_the_rounded_copy_bits") else {
        return;
    };
    let bits = |k: &Kept| match k {
        Kept::Rounded(r) => r.bits().to_host().unwrap(),
        Kept::Values(_) => panic!("a 16-bit step on the GPU keeps the rounded copy"),
    };
    let values = |k: &Kept| match k {
        Kept::Values(v) => v.to_vec().unwrap(),
        Kept::Rounded(_) => panic!("an fp32 step keeps the values"),
    };
    let rounded = |x: &DevBuf<f32>, f| host(&ops::rounded_copy(x.as_slice(), f).unwrap());
    let (rows, dim, heads, d) = (37, 300, 3, 64);
    let positions: Vec<usize> = (0..rows).map(|t| 5 + 2 * t).collect();
    let rope = tensor::rope::Rope::new(d, 10000.0).unwrap();
    // Values spread over many binades, so that rounding has work to do at every magnitude.
    let spread = |n, seed| -> Vec<f32> {
        rand(n, seed)
            .iter()
            .enumerate()
            .map(|(i, v)| v * 2f32.powi((i % 23) as i32 - 11))
            .collect()
    };
    let (x, w) = (
        g.upload(&spread(rows * dim, 60)).unwrap(),
        g.upload(&rand(dim, 61)).unwrap(),
    );
    let (a, b, c) = (
        g.upload(&spread(rows * dim, 62)).unwrap(),
        g.upload(&spread(rows * dim, 63)).unwrap(),
        g.upload(&spread(rows * dim, 64)).unwrap(),
    );
    let qk = spread(rows * heads * d, 65);
    let (y, rstd) = ops::rmsnorm_forward(&x, &w, dim, 1e-5).unwrap();
    let s = ops::swiglu_forward(&a, &b).unwrap();
    let (dg, du) = ops::swiglu_backward(&c, &a, &b).unwrap();
    for format in [Operands::Bf16, Operands::F16, Operands::F32] {
        let _scope = Scope::enter(format);
        let what = |k: &str| format!("{k} in a {format:?} step");
        let (py, prstd) = prepared::rmsnorm_forward(r(&x), r(&w), dim, 1e-5).unwrap();
        assert_eq!(
            prstd.to_vec().unwrap(),
            host(&rstd),
            "{}",
            what("rmsnorm rstd")
        );
        let ps = prepared::swiglu_forward(r(&a), r(&b)).unwrap();
        let (pdg, pdu) = prepared::swiglu_backward(r(&c), r(&a), r(&b)).unwrap();
        let pairs = [
            ("rmsnorm y", &py, &y),
            ("swiglu", &ps, &s),
            ("swiglu dgate", &pdg, &dg),
            ("swiglu dup", &pdu, &du),
        ];
        for (name, got, plain) in pairs {
            if format == Operands::F32 {
                assert_eq!(values(got), host(plain), "{}", what(name));
            } else {
                assert_eq!(bits(got), rounded(plain, format), "{}", what(name));
            }
        }
        for backward in [false, true] {
            let t = ops::RopeTable::new(&g, &rope, &positions, backward).unwrap();
            let mut plain = g.upload(&qk).unwrap();
            ops::rope_rotate(&mut plain, heads, &t).unwrap();
            let got = prepared::rope(
                &rope,
                Buf::Cuda(g.upload(&qk).unwrap()),
                heads,
                &positions,
                backward,
            )
            .unwrap();
            let name = what(&format!("rope backward={backward}"));
            if format == Operands::F32 {
                assert_eq!(values(&got), host(&plain), "{name}");
                continue;
            }
            assert_eq!(bits(&got), rounded(&plain, format), "{name}");
            // The kernel itself, and its input left as it was.
            let input = g.upload(&qk).unwrap();
            let direct = ops::rope_rotate_rounded(&input, heads, &t, format).unwrap();
            assert_eq!(host(&direct), rounded(&plain, format), "{name}, direct");
            assert_eq!(host(&input), qk, "{name}: the input is left as it was");
        }
        // Attention's Q and K: rounded where attention runs on the tensor cores (head 64 in a
        // 16-bit step), the values otherwise.
        let at = AttnShape::causal(1, rows, heads, heads, d);
        let q = prepared::rope_for_attention(
            &at,
            &rope,
            Buf::Cuda(g.upload(&qk).unwrap()),
            heads,
            &positions,
        )
        .unwrap();
        assert_eq!(
            matches!(q, Kept::Rounded(_)),
            format != Operands::F32,
            "{}",
            what("rope for attention")
        );
        // V written rounded by its projection: the product's fp32 result rounded, to within
        // the last bit (cuBLASLt may sum in another order for a 16-bit D); head 40 (not a
        // multiple of 16) runs attention in fp32 and keeps the values.
        let (din, wv) = (dim, g.upload(&rand(heads * d * dim, 66)).unwrap());
        let plain = tensor::ops::matmul_new(r(&x), r(&wv), rows, din, heads * d, false, true)
            .unwrap()
            .to_vec()
            .unwrap();
        let v = prepared::linear_for_attention(&at, r(&x).into(), r(&wv), din, heads * d).unwrap();
        match (&v, format) {
            (Kept::Values(v), Operands::F32) => {
                assert_eq!(v.to_vec().unwrap(), plain, "{}", what("V"))
            }
            (Kept::Rounded(b), Operands::Bf16 | Operands::F16) => {
                let got = widen_bits(&b.bits().to_host().unwrap(), format);
                let want = widen_bits(&rounded(&g.upload(&plain).unwrap(), format), format);
                assert_within_last_bit(&what("V"), &got, &want, format);
            }
            _ => panic!("{}: kept as {v:?}", what("V")),
        }
        let at40 = AttnShape::causal(1, rows, heads, heads, 40);
        let v40 = prepared::linear_for_attention(
            &at40,
            r(&x).into(),
            r(&wv).slice(0..heads * 40 * dim),
            din,
            heads * 40,
        )
        .unwrap();
        assert!(matches!(v40, Kept::Values(_)), "{}", what("V at head 40"));
    }
}

#[test]
fn attention_operands_rounded_once_give_the_same_results() {
    use tensor::buf::Dev;
    use tensor::operands::{Kept, Scope};
    let Some(g) = gpu("attention_operands_rounded_once_give_the_same_results") else {
        return;
    };
    let dev = Dev::Cuda(g.clone());
    for (format, head_dim) in [
        (Operands::Bf16, 64),
        (Operands::Bf16, 40),
        (Operands::F32, 64),
        (Operands::F16, 64),
    ] {
        let _scope = Scope::enter(format);
        let s = AttnShape::causal(2, 100, 4, 2, head_dim);
        let up = |n, seed| Arc::new(dev.from_vec(rand(n, seed)).unwrap());
        let (q, k, v) = (
            up(s.q_elems(), 90),
            up(s.kv_elems(), 91),
            up(s.kv_elems(), 92),
        );
        let dout = up(s.q_elems(), 93);
        let kept: Vec<Kept> = [&q, &k, &v]
            .iter()
            .map(|x| tensor::ops::attention_operand(&s, (*x).clone()).unwrap())
            .collect();
        let rounds = format != Operands::F32 && head_dim == 64;
        for (x, kx) in [&q, &k, &v].iter().zip(&kept) {
            assert_eq!(
                kx.bytes(),
                x.bytes() / if rounds { 2 } else { 1 },
                "{format:?}, head {head_dim}: what the layer keeps"
            );
        }
        let (o1, l1) = tensor::ops::attention_forward(&s, None, q.r(), k.r(), v.r()).unwrap();
        let (o2, l2) =
            tensor::ops::attention_forward(&s, None, kept[0].r(), kept[1].r(), kept[2].r())
                .unwrap();
        let what = format!("{format:?}, head {head_dim}");
        assert_eq!(o2.to_vec().unwrap(), o1.to_vec().unwrap(), "{what}: out");
        assert_eq!(l2.to_vec().unwrap(), l1.to_vec().unwrap(), "{what}: lse");
        let grads = |qkv: [tensor::operands::Operand<'_>; 3]| {
            let (mut dq, mut dk, mut dv) = (
                dev.from_vec(rand(s.q_elems(), 94)).unwrap(),
                dev.from_vec(rand(s.kv_elems(), 95)).unwrap(),
                dev.from_vec(rand(s.kv_elems(), 96)).unwrap(),
            );
            let [q, k, v] = qkv;
            tensor::ops::attention_backward(
                &s,
                None,
                q,
                k,
                v,
                o1.r(),
                l1.r(),
                dout.r(),
                dq.m(),
                dk.m(),
                dv.m(),
            )
            .unwrap();
            [dq, dk, dv].map(|x| x.to_vec().unwrap())
        };
        let plain = grads([q.r().into(), k.r().into(), v.r().into()]);
        let once = grads([kept[0].r(), kept[1].r(), kept[2].r()]);
        assert_eq!(once, plain, "{what}: dq, dk, dv");
    }
    // Rounded for bf16 (a bf16 step), given to attention in an fp32 step: refused.
    let s = AttnShape::causal(1, 64, 2, 2, 64);
    let x = Arc::new(dev.from_vec(rand(s.q_elems(), 97)).unwrap());
    let bf = {
        let _b = Scope::enter(Operands::Bf16);
        tensor::ops::attention_operand(&s, x.clone()).unwrap()
    };
    let Err(e) = tensor::ops::attention_forward(&s, None, bf.r(), bf.r(), bf.r()) else {
        panic!("bf16 operands in an fp32 attention must be refused")
    };
    assert!(e.to_string().contains("fp32"), "{e}");
    // A bf16 view 2 bytes into its buffer: the kernels read 16 bytes at a time.
    let bits = g.upload(&bf16_bits(&rand(s.q_elems() + 1, 98))).unwrap();
    let view = bits.slice(1..s.q_elems() + 1);
    let (mut go, mut gl) = (
        g.alloc::<f32>(s.q_elems()).unwrap(),
        g.alloc::<f32>(s.lse_elems()).unwrap(),
    );
    let err = ops::attention_forward_tc(
        ATTN_KERNELS,
        &s,
        None,
        Operands::Bf16,
        view,
        view,
        view,
        &mut go,
        &mut gl,
    )
    .unwrap_err();
    assert!(err.to_string().contains("16-byte"), "{err}");
    // An output view 4 bytes into its buffer: written as pairs of fp32.
    let whole = bits.slice(0..s.q_elems());
    let mut wide = g.alloc::<f32>(s.q_elems() + 1).unwrap();
    let err = ops::attention_forward_tc(
        ATTN_KERNELS,
        &s,
        None,
        Operands::Bf16,
        whole,
        whole,
        whole,
        wide.slice_mut(1..s.q_elems() + 1),
        &mut gl,
    )
    .unwrap_err();
    assert!(err.to_string().contains("8-byte"), "{err}");
}

/// Products on views that start 4, 8 or 12 bytes into their buffers (a weight inside the flat
/// parameter buffer, a chunk of rows of an odd width): cuBLASLt must be told the operands'
/// real alignment, or the algorithm it picks for 256-byte aligned ones may fault.
#[test]
fn matmul_on_unaligned_views_matches_cpu() {
    let Some(g) = gpu("matmul_on_unaligned_views_matches_cpu") else {
        return;
    };
    let dev = tensor::buf::Dev::Cuda(g.clone());
    for (m, k, n) in [(33, 65, 17), (64, 128, 96)] {
        for (ta, tb) in [(false, false), (false, true), (true, false), (true, true)] {
            for (oa, ob, oc) in [(1, 2, 3), (0, 3, 1), (2, 0, 0)] {
                let (a, b, c0) = (rand(m * k, 63), rand(k * n, 64), rand(m * n, 65));
                let mut want = c0.clone();
                tensor::gemm::matmul(&mut want, &a, &b, m, k, n, ta, tb, true).unwrap();
                let pad = |v: &[f32], o: usize| {
                    let mut p = vec![0.5f32; o];
                    p.extend_from_slice(v);
                    dev.from_vec(p).unwrap()
                };
                let (da, db, mut dc) = (pad(&a, oa), pad(&b, ob), pad(&c0, oc));
                tensor::ops::matmul(
                    dc.m().slice_mut(oc..oc + m * n),
                    da.r().slice(oa..oa + m * k),
                    db.r().slice(ob..ob + k * n),
                    m,
                    k,
                    n,
                    ta,
                    tb,
                    true,
                )
                .unwrap();
                let got = dc.to_vec().unwrap();
                assert!(got[..oc].iter().all(|&v| v == 0.5), "wrote before C");
                let e = rel(&got[oc..], &want);
                assert!(
                    e <= 1e-5 * (k as f32).sqrt(),
                    "{m}x{k}x{n} ta={ta} tb={tb} offsets {oa},{ob},{oc}: {e:e}"
                );
            }
        }
    }
}

/// The small element-wise kernels (scaling, sums, fills, 16-bit rounding, the non-finite
/// count) against the host, at lengths that are not a multiple of the block, and empty.
#[test]
fn elementwise_helpers_match_cpu() {
    let Some(g) = gpu("elementwise_helpers_match_cpu") else {
        return;
    };
    for n in [0, 1, 257, 70_001] {
        let (x, y) = (rand(n, 90), rand(n, 91));
        let mut gx = g.upload(&x).unwrap();
        ops::scale(&mut gx, 0.375).unwrap();
        let want: Vec<f32> = x.iter().map(|v| v * 0.375).collect();
        assert_eq!(host(&gx), want, "scale n={n}");
        let mut gy = g.upload(&y).unwrap();
        ops::axpy(&mut gy, &g.upload(&x).unwrap(), -2.5).unwrap();
        let want: Vec<f32> = y.iter().zip(&x).map(|(b, a)| b + -2.5 * a).collect();
        assert_close(&format!("axpy n={n}"), &host(&gy), &want);
        let sum = ops::add(&g.upload(&x).unwrap(), &g.upload(&y).unwrap()).unwrap();
        let want: Vec<f32> = x.iter().zip(&y).map(|(a, b)| a + b).collect();
        assert_eq!(host(&sum), want, "add n={n}");
        let mut gf = g.upload(&x).unwrap();
        ops::fill(&mut gf, 7.25).unwrap();
        assert_eq!(host(&gf), vec![7.25; n], "fill n={n}");
        for bf16 in [true, false] {
            let big: Vec<f32> = x.iter().map(|v| v * 1000.0).collect();
            let mut gr = g.upload(&big).unwrap();
            ops::round_to_16bit(&mut gr, bf16).unwrap();
            let want: Vec<f32> = big
                .iter()
                .map(|&v| {
                    if bf16 {
                        half::bf16::from_f32(v).to_f32()
                    } else {
                        half::f16::from_f32(v).to_f32()
                    }
                })
                .collect();
            assert_eq!(host(&gr), want, "round to 16 bits (bf16 {bf16}) n={n}");
            let mut h = g.alloc::<u16>(n).unwrap();
            let mut back = g.alloc::<f32>(n).unwrap();
            if bf16 {
                ops::cast_f32_to_bf16(&g.upload(&big).unwrap(), &mut h).unwrap();
                ops::cast_bf16_to_f32(&h, &mut back).unwrap();
            } else {
                ops::cast_f32_to_f16(&g.upload(&big).unwrap(), &mut h).unwrap();
                ops::cast_f16_to_f32(&h, &mut back).unwrap();
            }
            assert_eq!(host(&back), want, "cast there and back (bf16 {bf16}) n={n}");
        }
        let mut bad = x.clone();
        let mut count = 0;
        for (i, v) in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY]
            .into_iter()
            .enumerate()
        {
            if let Some(e) = bad.get_mut(i * 97) {
                *e = v;
                count += 1;
            }
        }
        assert_eq!(
            ops::count_nonfinite(&g.upload(&bad).unwrap()).unwrap(),
            count,
            "non-finite count n={n}"
        );
    }
}

/// After a warm-up, repeating the same work makes no driver allocation; an impossible device
/// is a clear error.
#[test]
fn steady_state_allocates_nothing_and_bad_devices_are_errors() {
    let Some(g) = gpu("steady_state_allocates_nothing_and_bad_devices_are_errors") else {
        return;
    };
    let x = g.upload(&rand(100_000, 70)).unwrap();
    let w = g.upload(&rand(1000, 71)).unwrap();
    let work = || {
        let (y, _r) = ops::rmsnorm_forward(&x, &w, 1000, 1e-5).unwrap();
        let s = ops::swiglu_forward(&y, &x).unwrap();
        ops::sq_sum(&s).unwrap()
    };
    work();
    let before = g.memory_stats().driver_allocs;
    for _ in 0..5 {
        work();
    }
    assert_eq!(
        g.memory_stats().driver_allocs,
        before,
        "steady state allocated"
    );
    let err = Gpu::open(1000).expect_err("no device 1000");
    assert!(err.to_string().contains("cuda:1000"), "{err}");
}

/// The fused LM head + cross-entropy through the device dispatch (`tensor::ops`): loss, lse and
/// both gradients on the GPU against the CPU, forward then backward and in one pass, with
/// ignored rows and a chunk of only ignored rows.
#[test]
fn fused_cross_entropy_matches_cpu() {
    use tensor::buf::{Buf, Dev};
    use tensor::cross_entropy::{CeConfig, IGNORE_INDEX};
    use tensor::ops::{fused_linear_ce, Lse};
    let Some(g) = gpu("fused_cross_entropy_matches_cpu") else {
        return;
    };
    let dev = Dev::Cuda(g.clone());
    let (rows, dim, vocab) = (300, 48, 500);
    let cfg = CeConfig {
        chunk_rows: 128,
        ..CeConfig::default()
    };
    let x = rand(rows * dim, 80);
    let w = rand(vocab * dim, 81);
    let targets: Vec<i64> = (0..rows as i64)
        .map(|r| {
            if (128..256).contains(&r) || r % 11 == 0 {
                IGNORE_INDEX
            } else {
                r * 7 % vocab as i64
            }
        })
        .collect();
    let run = |dev: &Dev, one_pass: bool| {
        let (xb, wb) = (
            dev.from_vec(x.clone()).unwrap(),
            dev.from_vec(w.clone()).unwrap(),
        );
        let mut lse = dev.zeros(rows).unwrap();
        let mut dx = dev.zeros(rows * dim).unwrap();
        let mut dw = dev.from_vec(rand(vocab * dim, 82)).unwrap();
        let out = if one_pass {
            fused_linear_ce(
                xb.r(),
                wb.r(),
                &targets,
                dim,
                vocab,
                &cfg,
                Lse::Write(lse.m()),
                Some((0.5, Some(dx.m()), Some(dw.m()))),
            )
            .unwrap()
        } else {
            let out = fused_linear_ce(
                xb.r(),
                wb.r(),
                &targets,
                dim,
                vocab,
                &cfg,
                Lse::Write(lse.m()),
                None,
            )
            .unwrap();
            let l: Buf = lse.try_clone().unwrap();
            fused_linear_ce(
                xb.r(),
                wb.r(),
                &targets,
                dim,
                vocab,
                &cfg,
                Lse::Read(l.r()),
                Some((0.5, Some(dx.m()), Some(dw.m()))),
            )
            .unwrap();
            out
        };
        (
            out,
            lse.to_vec().unwrap(),
            dx.to_vec().unwrap(),
            dw.to_vec().unwrap(),
        )
    };
    for one_pass in [false, true] {
        let (want, l0, dx0, dw0) = run(&Dev::Cpu, one_pass);
        let (got, l1, dx1, dw1) = run(&dev, one_pass);
        assert_eq!(got.n_valid, want.n_valid);
        assert!(
            (got.loss_sum - want.loss_sum).abs() <= 1e-5 * want.loss_sum.abs(),
            "{got:?} vs {want:?}"
        );
        assert_close("fused ce lse", &l1, &l0);
        assert_close("fused ce dx", &dx1, &dx0);
        assert_close("fused ce dw", &dw1, &dw0);
    }
}

/// A watched wait, as NCCL runs set one up (`tensor::cuda::Watch`): a clean check and a
/// generous limit wait like `cuStreamSynchronize`; a check that finds an error ends the wait
/// with it; a busy queue outlasting the limit is an error naming what it waits for. The
/// watch is the GPU's (process-wide): the check runs these binaries one test at a time.
#[test]
fn watched_waits_end_with_the_check_or_the_limit() {
    use std::time::Duration;
    use tensor::buf::{Buf, BufRef};
    use tensor::cuda::{CudaError, Watch};
    let Some(g) = gpu("watched_waits_end_with_the_check_or_the_limit") else {
        return;
    };
    let n = 4096;
    let (a, b) = (
        g.upload(&rand(n * n, 60)).unwrap(),
        g.upload(&rand(n * n, 61)).unwrap(),
    );
    // A queue busy for a while: fp32 products of 4096² (tens of ms each without TF32).
    let busy = || -> Vec<Buf> {
        (0..8)
            .map(|_| {
                tensor::ops::matmul_new(
                    BufRef::Cuda(a.as_slice()),
                    BufRef::Cuda(b.as_slice()),
                    n,
                    n,
                    n,
                    false,
                    false,
                )
                .unwrap()
            })
            .collect()
    };
    let watch = |limit: Duration, fail: bool| Watch {
        limit,
        what: "the test's products".into(),
        check: Box::new(move || {
            if fail {
                Err("a peer failed (the test's check)".into())
            } else {
                Ok(())
            }
        }),
    };
    g.watch(Some(watch(Duration::from_secs(60), false)));
    let held = busy();
    g.synchronize().expect("a clean watched wait");
    drop(held);
    g.watch(Some(watch(Duration::from_secs(60), true)));
    let held = busy();
    match g.synchronize() {
        Err(CudaError::Stalled(m)) => assert!(m.contains("a peer failed"), "{m}"),
        other => panic!("the check's error ends the wait: {other:?}"),
    }
    g.watch(Some(watch(Duration::ZERO, false)));
    match g.synchronize() {
        Err(CudaError::Stalled(m)) => {
            assert!(
                m.contains("did not finish") && m.contains("the test's products"),
                "{m}"
            )
        }
        // The products may have finished in between: then the wait is simply over.
        other => other.expect("a finished queue"),
    }
    g.watch(None);
    g.synchronize().unwrap();
    drop(held);
}

/// Page-locked host memory: zeroed when made; a download straight into it and an upload from
/// it carry the values exactly, and the upload has finished when the call returns (the buffer
/// is overwritten at once, and the device keeps what was sent); an empty one is fine.
#[test]
fn pinned_host_memory_copies_both_ways() {
    let Some(gpu) = gpu("pinned_host_memory_copies_both_ways") else {
        return;
    };
    let n = 3 << 20; // 12 MiB of f32: beyond any single staging chunk of the driver
    let mut p = gpu.pinned::<f32>(n).unwrap();
    assert!(p.iter().all(|&x| x == 0.0));
    let want = rand(n, 41);
    let mut d = gpu.upload(&want).unwrap();
    d.as_slice().read_into(&mut p).unwrap();
    assert_eq!(&p[..], &want[..]);
    // Upload from the pinned buffer, then overwrite it before anything else waits.
    p.iter_mut().for_each(|x| *x = -*x);
    let sent: Vec<f32> = p.to_vec();
    d.copy_from_host(&p).unwrap();
    p.iter_mut().for_each(|x| *x = 7.0);
    assert_eq!(host(&d), sent);
    // A part of it, into a sub-range of the device buffer.
    d.slice_mut(5..1005).copy_from_host(&p[10..1010]).unwrap();
    p[10..1010].fill(0.0);
    assert!(host(&d)[5..1005].iter().all(|&x| x == 7.0));
    let mut empty = gpu.pinned::<u16>(0).unwrap();
    assert!(empty.is_empty());
    gpu.zeros::<u16>(0)
        .unwrap()
        .as_slice()
        .read_into(&mut empty)
        .unwrap();
    // A length mismatch is an error, not a partial copy.
    assert!(d.as_slice().read_into(&mut p[..10]).is_err());
}

/// The GPU's page-locked scratch pool lends the smallest free buffer that holds a request
/// (a returned one is lent again, not a new one made, whatever its element type), and a GPU
/// buffer's values pass through it to host code and back: in place (`Buf::on_host`), into a
/// result of another length (`Buf::on_host_into`), and handed over whole (`into_host_buf`,
/// `to_host_buf`, `Dev::from_host`), exactly; 16-bit values too.
#[test]
fn host_scratch_stages_gpu_buffers_for_host_code() {
    let Some(gpu) = gpu("host_scratch_stages_gpu_buffers_for_host_code") else {
        return;
    };
    let a = gpu.host_scratch::<f32>(100_000).unwrap();
    let at = a.as_ptr() as usize;
    assert_eq!(a.len(), 100_000);
    drop(a);
    let b = gpu.host_scratch::<f32>(70_000).unwrap();
    assert_eq!(
        (b.as_ptr() as usize, b.len()),
        (at, 70_000),
        "the returned buffer lent again"
    );
    let c = gpu.host_scratch::<f32>(70_000).unwrap();
    let ct = c.as_ptr() as usize;
    assert_ne!(ct, at, "a lent buffer is not lent twice");
    drop((b, c));
    let h = gpu.host_scratch::<u16>(200_000).unwrap();
    let ht = h.as_ptr() as usize;
    assert!(
        (ht == at || ht == ct) && h.len() == 200_000,
        "the pool is in bytes: 16-bit elements reuse an fp32 buffer"
    );
    // An empty lease takes no pooled buffer: both are still free for the next two.
    let empty = gpu.host_scratch::<f32>(0).unwrap();
    assert!(empty.is_empty());
    drop(h);
    let (x1, x2) = (
        gpu.host_scratch::<f32>(70_000).unwrap(),
        gpu.host_scratch::<f32>(70_000).unwrap(),
    );
    let mut got = [x1.as_ptr() as usize, x2.as_ptr() as usize];
    got.sort();
    let mut want = [at, ct];
    want.sort();
    assert_eq!(got, want, "the empty lease held no buffer");
    drop((x1, x2, empty));
    let x = rand(3 << 20, 47);
    let d = Buf::Cuda(gpu.upload(&x).unwrap());
    let d = d
        .on_host(|v| {
            v.iter_mut().for_each(|e| *e = -*e);
            Ok::<_, tensor::TensorError>(())
        })
        .unwrap();
    let neg: Vec<f32> = x.iter().map(|e| -e).collect();
    assert_eq!(d.to_vec().unwrap(), neg);
    let twice = d
        .on_host_into(2 * x.len(), |v, out| {
            out[..v.len()].copy_from_slice(v);
            out[v.len()..].copy_from_slice(v);
            Ok::<_, tensor::TensorError>(())
        })
        .unwrap();
    assert!(matches!(twice, Buf::Cuda(_)));
    let t = twice.to_vec().unwrap();
    assert_eq!((&t[..x.len()], &t[x.len()..]), (&neg[..], &neg[..]));
    // Handed over whole, as a message or a collective's buffer travels.
    let part = twice.r().slice(5..x.len() + 5).to_host_buf().unwrap();
    assert!(matches!(part, tensor::buf::HostBuf::Pinned(_)));
    assert_eq!(&part[..], &t[5..x.len() + 5]);
    let dev = twice.dev();
    let whole = twice.into_host_buf().unwrap();
    assert!(matches!(whole, tensor::buf::HostBuf::Pinned(_)));
    let back = dev.from_host(whole).unwrap();
    assert!(matches!(back, Buf::Cuda(_)));
    assert_eq!(back.to_vec().unwrap(), t);
    let z = dev.host_zeros::<f32>(1 << 20).unwrap();
    assert!(
        z.iter().all(|&e| e == 0.0),
        "host_zeros clears a reused buffer"
    );
    let bits: Vec<u16> = (0..70_001u32)
        .map(|i| (i.wrapping_mul(2654435761u32) >> 16) as u16)
        .collect();
    let dbits = gpu.upload(&bits).unwrap();
    let hb = dbits.as_slice().to_scratch().unwrap();
    assert_eq!(&hb[..], &bits[..]);
}

/// Staged copies ([`tensor::cuda::Staged`]) run on their own stream yet in the compute
/// stream's order: a download queued after a kernel lands the kernel's result, pieces land at
/// their offsets while the compute stream goes on (and later compute work does not reach
/// what was queued before it), an upload is seen by the compute stream's next kernel, and
/// ranges beyond the buffer are errors before anything is queued.
#[test]
fn staged_copies_follow_the_compute_stream() {
    let Some(gpu) = gpu("staged_copies_follow_the_compute_stream") else {
        return;
    };
    let n = 3 << 20;
    let x = rand(n, 43);
    let mut d = gpu.upload(&x).unwrap();
    let mut landing = tensor::cuda::Staged::<f32>::new(&gpu, n + 10).unwrap();
    // The kernel's doubling is queued before the downloads: they must see it.
    ops::scale(d.as_mut_slice(), 2.0).unwrap();
    landing.download(10, d.slice(0..n / 2)).unwrap();
    landing.download(10 + n / 2, d.slice(n / 2..n)).unwrap();
    let doubled: Vec<f32> = x.iter().map(|v| v * 2.0).collect();
    assert_eq!(&landing.host().unwrap()[10..], &doubled[..]);
    assert!(landing.host().unwrap()[..10].iter().all(|&v| v == 0.0));
    // Upload negated values, then a kernel on the compute stream reads them.
    let h = landing.host().unwrap();
    h.iter_mut().for_each(|v| *v = -*v);
    landing.upload(10..10 + n, d.as_mut_slice()).unwrap();
    ops::scale(d.as_mut_slice(), 0.5).unwrap();
    let back: Vec<f32> = x.iter().map(|v| -v).collect();
    assert_eq!(host(&d), back);
    // Unordered uploads (a delayed update's weights, unit by unit): a kernel queued after the
    // compute stream is ordered after each reads the uploaded values.
    let h = landing.host().unwrap();
    h[10..].iter_mut().zip(&x).for_each(|(v, x)| *v = 4.0 * x);
    let first = landing
        .upload_unordered(10..10 + n / 2, d.slice_mut(0..n / 2))
        .unwrap();
    let second = landing
        .upload_unordered(10 + n / 2..10 + n, d.slice_mut(n / 2..n))
        .unwrap();
    first.order_compute().unwrap();
    second.order_compute().unwrap();
    ops::scale(d.as_mut_slice(), 0.25).unwrap();
    assert_eq!(host(&d), x);
    assert!(landing.upload_unordered(0..5, d.slice_mut(0..6)).is_err());
    // Bounds: an error, nothing queued.
    assert!(landing.download(20, d.slice(0..n)).is_err());
    assert!(landing.upload(0..5, d.slice_mut(0..6)).is_err());
    let mut bits = tensor::cuda::Staged::<u16>::new(&gpu, 0).unwrap();
    assert!(bits.is_empty() && bits.host().unwrap().is_empty());
}

/// The kernel timeline names every kernel, product and copy queued while it is on, with its
/// calls and positive device time, and nothing once it is off. (The other tests of this
/// process share the GPU and its timeline: their launches may land in it while it is on, so
/// the counts of names they may use are lower bounds; the product's shape is this test's own.)
#[test]
fn kernel_timeline_names_every_launch() {
    let Some(gpu) = gpu("kernel_timeline_names_every_launch") else {
        return;
    };
    let (m, k, n) = (256, 128, 64);
    let a = gpu.upload(&rand(m * k, 1)).unwrap();
    let b = gpu.upload(&rand(k * n, 2)).unwrap();
    let mut c = gpu.zeros::<f32>(m * n).unwrap();
    gpu.time_kernels(true).unwrap();
    for _ in 0..3 {
        tensor::cuda::blas::matmul(&mut c, &a, &b, m, k, n, false, false, false).unwrap();
        ops::scale(&mut c, 0.5).unwrap();
    }
    let host = c.to_host().unwrap();
    let times = gpu.kernel_times().unwrap();
    gpu.time_kernels(false).unwrap();
    let find = |name: &str| {
        times
            .iter()
            .find(|t| t.name == name)
            .unwrap_or_else(|| panic!("{name} not in {times:?}"))
    };
    let gemm_name = format!("cuBLASLt f32 {m}x{k}x{n} (NN)");
    let gemm = find(&gemm_name);
    assert_eq!(gemm.calls, 3);
    assert!(gemm.seconds > 0.0);
    assert!(find("elementwise::scale_f32").calls >= 3);
    assert!(find("copy device to host").calls >= 1);
    assert!(times.windows(2).all(|w| w[0].seconds >= w[1].seconds));
    assert_eq!(host.len(), m * n);
    tensor::cuda::blas::matmul(&mut c, &a, &b, m, k, n, false, false, false).unwrap();
    let after = gpu.kernel_times().unwrap();
    assert!(!after.iter().any(|t| t.name == gemm_name), "{after:?}");
}
