//! Kernel benchmarks (criterion). Run with
//! `cargo bench -p tensor --bench kernels -- <filter>`; the thread budget comes from
//! `XTRAIN_THREADS` (default: all cores). Throughput is reported in elements = FLOPs, so
//! criterion's "elem/s" reads as FLOP/s.

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use std::hint::black_box;
use std::time::Duration;
use tensor::attention::{attention_backward, attention_forward, AttnShape, AttnTiles};
use tensor::cross_entropy::{fused_linear_ce_backward, fused_linear_ce_forward, CeConfig};
use tensor::gemm::{matmul, matmul_using, Backend};
use tensor::norm::{rmsnorm_backward_input, rmsnorm_backward_weight, rmsnorm_forward};

fn data(n: usize, seed: u32) -> Vec<f32> {
    let mut s = seed.wrapping_mul(2654435761).wrapping_add(1);
    (0..n)
        .map(|_| {
            s = s.wrapping_mul(1664525).wrapping_add(1013904223);
            (s >> 8) as f32 / (1u32 << 24) as f32 - 0.5
        })
        .collect()
}

fn bench_gemm(c: &mut Criterion) {
    let mut g = c.benchmark_group("gemm");
    g.sample_size(10)
        .measurement_time(Duration::from_secs(5))
        .warm_up_time(Duration::from_secs(1));
    for &(n, ta, tb) in &[
        (2048usize, false, false),
        (2048, false, true),
        (2048, true, false),
    ] {
        let a = data(n * n, 1);
        let b = data(n * n, 2);
        let mut out = vec![0.0f32; n * n];
        g.throughput(Throughput::Elements(2 * (n * n * n) as u64));
        g.bench_function(
            format!("f32_{n}^3_ta{}_tb{}", ta as u8, tb as u8),
            |bench| bench.iter(|| matmul(&mut out, &a, &b, n, n, n, ta, tb, false).unwrap()),
        );
    }
    // Own SGEMM against the gemm crate on the same products: 2048³ and the three forms of the
    // medium preset's MLP up-projection (tokens 2048, in 512, out 1376).
    let threads = tensor::threads::thread_budget();
    for &(m, k, n, ta, tb) in &[
        (2048usize, 2048usize, 2048usize, false, false),
        (2048, 512, 1376, false, true),
        (2048, 1376, 512, false, false),
        (1376, 2048, 512, true, false),
    ] {
        let a = data(m * k, 1);
        let b = data(k * n, 2);
        let mut out = vec![0.0f32; m * n];
        g.throughput(Throughput::Elements(2 * (m * n * k) as u64));
        for (name, be) in [("own", Backend::Auto), ("crate", Backend::Crate)] {
            g.bench_function(
                format!("{name}_{m}x{k}x{n}_ta{}_tb{}", ta as u8, tb as u8),
                |bench| {
                    bench.iter(|| {
                        matmul_using(be, Some(threads), &mut out, &a, &b, m, k, n, ta, tb, false)
                            .unwrap()
                    })
                },
            );
        }
    }
    g.finish();
}

fn bench_attention(c: &mut Criterion) {
    let mut g = c.benchmark_group("attention");
    g.sample_size(10)
        .measurement_time(Duration::from_secs(5))
        .warm_up_time(Duration::from_secs(1));
    let s = AttnShape::causal(8, 256, 8, 8, 32);
    let (q, k, v) = (
        data(s.q_elems(), 1),
        data(s.kv_elems(), 2),
        data(s.kv_elems(), 3),
    );
    let dout = data(s.q_elems(), 4);
    let tiles = AttnTiles::default();
    let mut out = vec![0.0; s.q_elems()];
    let mut lse = vec![0.0; s.lse_elems()];
    let (mut dq, mut dk, mut dv) = (
        vec![0.0; s.q_elems()],
        vec![0.0; s.kv_elems()],
        vec![0.0; s.kv_elems()],
    );
    let (ff, fb) = s.flops();
    g.throughput(Throughput::Elements(ff as u64));
    g.bench_function("fwd_b8_h8_d32_s256_causal", |bench| {
        bench.iter(|| attention_forward(&s, &q, &k, &v, &mut out, &mut lse, tiles).unwrap())
    });
    g.throughput(Throughput::Elements(fb as u64));
    g.bench_function("bwd_b8_h8_d32_s256_causal", |bench| {
        bench.iter(|| {
            attention_backward(
                &s, &q, &k, &v, &out, &lse, &dout, &mut dq, &mut dk, &mut dv, tiles,
            )
            .unwrap()
        })
    });
    g.throughput(Throughput::Elements((ff + fb) as u64));
    g.bench_function("fwd_bwd_b8_h8_d32_s256_causal", |bench| {
        bench.iter(|| {
            attention_forward(&s, &q, &k, &v, &mut out, &mut lse, tiles).unwrap();
            attention_backward(
                &s, &q, &k, &v, &out, &lse, &dout, &mut dq, &mut dk, &mut dv, tiles,
            )
            .unwrap()
        })
    });
    g.finish();
}

fn bench_misc(c: &mut Criterion) {
    let mut g = c.benchmark_group("misc");
    g.sample_size(10)
        .measurement_time(Duration::from_secs(3))
        .warm_up_time(Duration::from_secs(1));
    // Fused LM head + CE: 256 tokens, dim 256, vocab 8192 (forward recomputes nothing; the
    // backward recomputes the logits: 4 products of 2·rows·dim·vocab FLOPs in all).
    let (rows, dim, vocab) = (256usize, 256usize, 8192usize);
    let x = data(rows * dim, 1);
    let w = data(vocab * dim, 2);
    let targets: Vec<i64> = (0..rows as i64)
        .map(|i| (i * 7919) % vocab as i64)
        .collect();
    let cfg = CeConfig::default();
    let mut lse = vec![0.0; rows];
    let mut dx = vec![0.0; rows * dim];
    let mut dw = vec![0.0; vocab * dim];
    g.throughput(Throughput::Elements((2 * rows * dim * vocab * 4) as u64));
    g.bench_function("fused_ce_fwd_bwd_256x256x8192", |bench| {
        bench.iter(|| {
            let o = fused_linear_ce_forward(&x, &w, &targets, dim, vocab, &cfg, &mut lse).unwrap();
            fused_linear_ce_backward(
                &x,
                &w,
                &targets,
                &lse,
                dim,
                vocab,
                &cfg,
                1.0 / o.n_valid as f32,
                Some(&mut dx),
                Some(&mut dw),
            )
            .unwrap();
        })
    });
    let (rows, dim) = (8192usize, 1024usize);
    let x = data(rows * dim, 3);
    let wn = data(dim, 4);
    let mut dwn = vec![0.0; dim];
    g.throughput(Throughput::Elements((rows * dim) as u64));
    g.bench_function("rmsnorm_fwd_bwd_8192x1024", |bench| {
        bench.iter(|| {
            let (y, rstd) = rmsnorm_forward(&x, &wn, dim, 1e-5).unwrap();
            black_box(rmsnorm_backward_input(&y, &x, &wn, &rstd, dim, None).unwrap());
            rmsnorm_backward_weight(&y, &x, &rstd, dim, &mut dwn).unwrap();
            black_box(&dwn);
        })
    });
    g.finish();
}

criterion_group!(benches, bench_gemm, bench_attention, bench_misc);
criterion_main!(benches);
