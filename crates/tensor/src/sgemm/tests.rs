//! Tests of the own SGEMM against an f64-accumulated reference: odd and edge sizes around the
//! tile and block sizes, every transpose combination, accumulate on/off, strided views inside
//! larger buffers, several thread counts, and random shapes (proptest).

use super::tile::Tile;
use super::{sgemm_with, Kernel, MatRef};
use crate::testutil::rand_vec;
use proptest::prelude::*;

/// One product case: `op(A)` is `[m, k]` stored with strides `(rs, cs)` inside a buffer with
/// padding, likewise `B`; `C` is `[m, n]` with leading dimension `ldc ≥ n`.
#[derive(Debug, Clone, Copy)]
struct Case {
    m: usize,
    k: usize,
    n: usize,
    trans_a: bool,
    trans_b: bool,
    accumulate: bool,
    /// Extra elements per stored row of A, B and C (0 = dense).
    pad: usize,
    threads: usize,
}

/// Strides of an `[r, c]` operand stored row-major (or transposed) with `pad` extra elements
/// per stored row; returns (buffer length, row stride, column stride).
fn layout(r: usize, c: usize, trans: bool, pad: usize) -> (usize, isize, isize) {
    let (stored_rows, stored_cols) = if trans { (c, r) } else { (r, c) };
    let ld = stored_cols + pad;
    let len = stored_rows * ld;
    if trans {
        (len, 1, ld as isize)
    } else {
        (len, ld as isize, 1)
    }
}

/// Block sizes `[MR, NR, KC, MC, NC]` of an FMA kernel.
fn blocks(kernel: Kernel) -> [usize; 5] {
    fn of<T: Tile>() -> [usize; 5] {
        [T::MR, T::NR, T::KC, T::MC, T::NC]
    }
    match kernel {
        Kernel::Avx512 => of::<super::kernel::Avx512>(),
        Kernel::Avx2 => of::<super::avx2::Avx2>(),
        Kernel::Portable => of::<super::portable::Portable>(),
        Kernel::Amx => [32, 32, super::amx::KC, 32, super::amx::NC],
    }
}

/// The FMA kernels this CPU runs; one visible line names each kernel it cannot run (the
/// forced lower paths cover the rest: `XTRAIN_ISA`).
fn fma_kernels() -> Vec<Kernel> {
    Kernel::FMA
        .into_iter()
        .filter(|&k| {
            let ok = k.available();
            if !ok {
                let feature = if k == Kernel::Avx512 {
                    "AVX-512F"
                } else {
                    "AVX2 + FMA"
                };
                crate::skip::cpu_feature(&format!("sgemm tests of the {k:?} kernel"), feature);
            }
            ok
        })
        .collect()
}

/// Every kernel this CPU runs: the FMA kernels and AMX where present.
fn kernels() -> Vec<Kernel> {
    let mut all = fma_kernels();
    if Kernel::Amx.available() {
        all.push(Kernel::Amx);
    } else {
        crate::skip::cpu_feature("sgemm tests of the AMX kernel", "AMX-TILE + AMX-BF16");
    }
    all
}

/// Runs the case through every available kernel; see [`run_on`].
fn run(case: Case) {
    for kernel in kernels() {
        run_on(kernel, case);
    }
}

/// Runs the case through [`sgemm_with`] and the reference; returns the max error over `C`'s
/// elements relative to the error bound `k·2⁻²³·Σ|a||b|`-style scale, and checks that the
/// padding of `C` is untouched.
fn run_on(kernel: Kernel, case: Case) {
    let Case {
        m,
        k,
        n,
        accumulate,
        pad,
        ..
    } = case;
    let Product {
        a,
        b,
        c0,
        c,
        strides: [ars, acs, brs, bcs],
    } = product(kernel, case);
    let ldc = n + pad;
    for i in 0..m {
        for j in 0..ldc {
            let got = c[i * ldc + j];
            if j >= n {
                assert_eq!(
                    got,
                    c0[i * ldc + j],
                    "{kernel:?} {case:?}: padding C({i}, {j}) written"
                );
                continue;
            }
            let (mut s, mut mag) = (0.0f64, 0.0f64);
            for p in 0..k {
                let av = a[(i as isize * ars + p as isize * acs) as usize] as f64;
                let bv = b[(p as isize * brs + j as isize * bcs) as usize] as f64;
                s += av * bv;
                mag += (av * bv).abs();
            }
            let base = if accumulate {
                c0[i * ldc + j] as f64
            } else {
                0.0
            };
            let want = base + s;
            // f32 accumulation of k products: |error| ≤ k·u·Σ|a·b| (u = 2⁻²⁴) plus the final
            // rounding; the factor 2 leaves room for the split into KC blocks.
            let tol = 2.0 * (k as f64 + 2.0) * f32::EPSILON as f64 * (mag + base.abs()) + 1e-30;
            assert!(
                (got as f64 - want).abs() <= tol,
                "{kernel:?} {case:?}: C({i}, {j}) = {got}, expected {want} (tol {tol})"
            );
        }
    }
}

fn each_layout(m: usize, k: usize, n: usize, pads: &[usize], threads: &[usize]) {
    for &trans_a in &[false, true] {
        for &trans_b in &[false, true] {
            for &accumulate in &[false, true] {
                for &pad in pads {
                    for &t in threads {
                        run(Case {
                            m,
                            k,
                            n,
                            trans_a,
                            trans_b,
                            accumulate,
                            pad,
                            threads: t,
                        });
                    }
                }
            }
        }
    }
}

/// Whether two results are the same bits, element by element (so `-0.0 != 0.0` and NaNs
/// compare by payload).
fn same_bits(x: &[f32], y: &[f32]) -> bool {
    x.len() == y.len() && x.iter().zip(y).all(|(a, b)| a.to_bits() == b.to_bits())
}

#[test]
fn odd_sizes_all_layouts() {
    let sizes = [1usize, 7, 13, 17, 31, 33];
    for &m in &sizes {
        for &k in &[1usize, 7, 17, 33] {
            for &n in &sizes {
                each_layout(m, k, n, &[0], &[1]);
            }
        }
    }
}

#[test]
fn tile_and_block_edges() {
    // Around each kernel's MR, NR, half-vectors and the KC split, with strided views and
    // threads.
    for kernel in kernels() {
        let [mr, nr, kc, _, _] = blocks(kernel);
        for &(m, k, n) in &[
            (mr, kc, nr),
            (mr + 1, kc + 1, nr + 1),
            (2 * mr - 1, 2 * kc + 3, nr + nr / 2),
            (100, 100, 100),
            (3 * mr + 5, 19, 3 * nr - nr / 2 + 1),
        ] {
            each_layout(m, k, n, &[0, 3], &[1, 2, 3]);
        }
    }
}

#[test]
fn spans_column_blocks_and_threads() {
    for t in [1, 2, 3] {
        each_layout(130, 70, 150, &[0], &[t]);
    }
    for kernel in kernels() {
        let [mr, _, _, mc, nc] = blocks(kernel);
        // n beyond NC exercises the jc loop; m, n large enough for every thread to get a slab.
        run_on(
            kernel,
            Case {
                m: 45,
                k: 40,
                n: nc + 37,
                trans_a: false,
                trans_b: true,
                accumulate: true,
                pad: 1,
                threads: 2,
            },
        );
        // m beyond MC with several B blocks: more than one packed A block per rank update,
        // with a row-major and a column-major A.
        for trans_a in [false, true] {
            run_on(
                kernel,
                Case {
                    m: mc + 2 * mr + 3,
                    k: 3,
                    n: nc + 5,
                    trans_a,
                    trans_b: false,
                    accumulate: true,
                    pad: 0,
                    threads: 1,
                },
            );
        }
    }
}

/// A computed case: the operands, `C` before and after, and the strides of `A` and `B`
/// (`[rs_a, cs_a, rs_b, cs_b]`).
struct Product {
    a: Vec<f32>,
    b: Vec<f32>,
    c0: Vec<f32>,
    c: Vec<f32>,
    strides: [isize; 4],
}

/// Runs a case through [`sgemm_with`] on random operands seeded by its shape.
fn product(kernel: Kernel, case: Case) -> Product {
    let Case {
        m,
        k,
        n,
        trans_a,
        trans_b,
        accumulate,
        pad,
        threads,
    } = case;
    let (la, ars, acs) = layout(m, k, trans_a, pad);
    let (lb, brs, bcs) = layout(k, n, trans_b, pad);
    let ldc = n + pad;
    let a = rand_vec(la, 1 + m as u64);
    let b = rand_vec(lb, 2 + n as u64);
    let c0 = rand_vec(m * ldc, 3 + k as u64);
    let mut c = c0.clone();
    let mat = |v: &[f32], rs, cs| MatRef {
        ptr: v.as_ptr(),
        rs,
        cs,
    };
    // SAFETY: every (i, p) / (p, j) / (i, j) in range addresses inside a / b / c by layout().
    unsafe {
        sgemm_with(
            kernel,
            c.as_mut_ptr(),
            ldc,
            mat(&a, ars, acs),
            mat(&b, brs, bcs),
            m,
            k,
            n,
            accumulate,
            threads,
        )
    };
    Product {
        a,
        b,
        c0,
        c,
        strides: [ars, acs, brs, bcs],
    }
}

/// `(trans_a, trans_b, accumulate)`: every transpose combination, accumulating in half.
const LAYOUTS: [(bool, bool, bool); 4] = [
    (false, false, false),
    (false, true, true),
    (true, false, true),
    (true, true, false),
];

/// Splitting a product across threads (the dynamic panel schedule, or the static column
/// split where `m` is small) changes no bit of the result: each element of `C` is summed in
/// the same order by the same kernel as on one thread. Shapes cover one and several `B̂`
/// blocks, several rank updates, a partial last panel, both layouts of `A` (read in place,
/// packed per panel, packed once and shared) and accumulation.
#[test]
fn threads_give_the_bits_of_one_thread() {
    for kernel in fma_kernels() {
        threads_keep_bits(kernel);
    }
}

fn threads_keep_bits(kernel: Kernel) {
    let [mr, _, kc, _, nc] = blocks(kernel);
    for (m, k, n) in [
        (300, 1100, 1100),
        (311, 700, 300),
        (40, 600, 700),
        (8 * mr, kc + 3, nc),
    ] {
        for (trans_a, trans_b, accumulate) in LAYOUTS {
            for pad in [0, 5] {
                let case = |threads| Case {
                    m,
                    k,
                    n,
                    trans_a,
                    trans_b,
                    accumulate,
                    pad,
                    threads,
                };
                let one = product(kernel, case(1)).c;
                for t in [2, 3, 4] {
                    let many = product(kernel, case(t)).c;
                    let same = same_bits(&one, &many);
                    assert!(same, "{kernel:?} {:?}: {t} threads differ from 1", case(t));
                }
            }
        }
    }
}

/// Several callers splitting products on the one budget pool at once (ranks as threads):
/// each product's tasks wait only on their own panels, so none deadlocks, and every result
/// keeps the bits of one thread.
#[test]
fn concurrent_split_products_keep_their_bits() {
    let kernel = Kernel::for_isa(crate::isa::Isa::detected());
    let [_, _, kc, _, nc] = blocks(kernel);
    let cases: Vec<Case> = (0..4)
        .map(|i| Case {
            m: 150 + 40 * i,
            k: kc + 7 * i,
            n: if i % 2 == 0 { nc + 9 } else { 200 },
            trans_a: i % 2 == 1,
            trans_b: i >= 2,
            accumulate: i % 3 == 0,
            pad: i,
            threads: 3,
        })
        .collect();
    let want: Vec<Vec<f32>> = cases
        .iter()
        .map(|&c| product(kernel, Case { threads: 1, ..c }).c)
        .collect();
    std::thread::scope(|scope| {
        for (case, want) in cases.iter().zip(&want) {
            scope.spawn(move || {
                for _ in 0..5 {
                    let got = product(kernel, *case).c;
                    let same = same_bits(&got, want);
                    assert!(same, "{case:?}: concurrent split differs from 1 thread");
                }
            });
        }
    });
}

#[test]
fn k_zero_and_empty() {
    let e = MatRef {
        ptr: [].as_ptr(),
        rs: 0,
        cs: 0,
    };
    for kernel in kernels() {
        let mut c = vec![5.0f32; 6];
        unsafe { sgemm_with(kernel, c.as_mut_ptr(), 3, e, e, 2, 0, 3, true, 1) };
        assert_eq!(c, vec![5.0; 6]);
        unsafe { sgemm_with(kernel, c.as_mut_ptr(), 3, e, e, 2, 0, 3, false, 2) };
        assert_eq!(c, vec![0.0; 6]);
        unsafe { sgemm_with(kernel, c.as_mut_ptr(), 3, e, e, 0, 4, 3, false, 2) };
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]
    #[test]
    fn random_shapes(
        m in 1usize..80,
        k in 1usize..600,
        n in 1usize..90,
        trans_a: bool,
        trans_b: bool,
        accumulate: bool,
        pad in 0usize..3,
        threads in 1usize..4,
    ) {
        run(Case { m, k, n, trans_a, trans_b, accumulate, pad, threads });
    }
}

/// `A·B` for dense row-major `A [m, k]`, `B [k, n]` on one thread.
fn dense_product(kernel: Kernel, a: &[f32], b: &[f32], [m, k, n]: [usize; 3]) -> Vec<f32> {
    assert!(a.len() == m * k && b.len() == k * n);
    let mut c = vec![0.0f32; m * n];
    let mat = |v: &[f32], ld: usize| MatRef {
        ptr: v.as_ptr(),
        rs: ld as isize,
        cs: 1,
    };
    // SAFETY: dense row-major operands of the asserted shapes.
    unsafe {
        sgemm_with(
            kernel,
            c.as_mut_ptr(),
            n,
            mat(a, k),
            mat(b, n),
            m,
            k,
            n,
            false,
            1,
        )
    };
    c
}

/// Root-mean-square and maximum of `|C − C_ref| / Σ|a·b|` over `C = A·B` for `[m, k] · [k, n]`
/// row-major operands (f64 reference).
fn relative_errors(kernel: Kernel, m: usize, k: usize, n: usize, seed: u64) -> (f64, f64) {
    let a = rand_vec(m * k, seed);
    let b = rand_vec(k * n, seed + 1);
    let c = dense_product(kernel, &a, &b, [m, k, n]);
    let (mut sq, mut max) = (0.0f64, 0.0f64);
    for i in 0..m {
        for j in 0..n {
            let (mut s, mut mag) = (0.0f64, 0.0f64);
            for p in 0..k {
                let t = a[i * k + p] as f64 * b[p * n + j] as f64;
                s += t;
                mag += t.abs();
            }
            let e = (c[i * n + j] as f64 - s).abs() / mag;
            sq += e * e;
            max = max.max(e);
        }
    }
    ((sq / (m * n) as f64).sqrt(), max)
}

#[test]
fn amx_split_has_fp32_accuracy() {
    if !Kernel::Amx.available() {
        return crate::skip::cpu_feature("amx_split_has_fp32_accuracy", "AMX-TILE + AMX-BF16");
    }
    let u = f32::EPSILON as f64 / 2.0; // fp32 unit roundoff 2⁻²⁴
                                       // k = 1: C = a·b. An fp32 multiply is within u; the split adds the fp32 rounding of its
                                       // six-term sum and the dropped 2⁻²⁵-sized terms, so 2u. Leaving out any kept term would
                                       // cost ≥ 2⁻¹⁸ ≈ 64u.
    let (_, max1) = relative_errors(Kernel::Amx, 40, 1, 40, 11);
    assert!(max1 <= 2.0 * u, "k = 1: max relative error {max1:e} > 2u");
    // Long sums: the same accuracy class as the FMA kernel. Five extra small addends per k
    // add rounding noise (each ≤ u/2 of the running sum), measured ≈ 1.5× the FMA kernel's
    // RMS error; 3× is the bound, and both stay far below the worst case k·u.
    for (k, seed) in [(512usize, 21u64), (1000, 22)] {
        let (rms_amx, max_amx) = relative_errors(Kernel::Amx, 48, k, 48, seed);
        let (rms_fma, _) = relative_errors(Kernel::Avx512, 48, k, 48, seed);
        assert!(
            rms_amx <= 3.0 * rms_fma,
            "k = {k}: RMS relative error {rms_amx:e} vs FMA {rms_fma:e}"
        );
        assert!(
            max_amx <= 4.0 * (k as f64).sqrt() * u,
            "k = {k}: max {max_amx:e}"
        );
        eprintln!("k = {k}: rms amx {rms_amx:e} fma {rms_fma:e} max amx {max_amx:e}");
    }
}

#[test]
fn amx_split_propagates_nan_and_infinity() {
    if !Kernel::Amx.available() {
        return crate::skip::cpu_feature(
            "amx_split_propagates_nan_and_infinity",
            "AMX-TILE + AMX-BF16",
        );
    }
    // A has a NaN in row 0 and +∞ in row 1; B is positive, so C's row 0 is NaN and row 1
    // non-finite: +∞ where every part of B(9, j) is non-zero, NaN where a lower part is 0
    // (∞ · 0 in the part products; documented in `amx`). Other rows stay finite.
    let (m, k, n) = (40, 70, 36);
    let mut a = rand_vec(m * k, 5);
    let b: Vec<f32> = rand_vec(k * n, 6).iter().map(|x| x.abs() + 0.5).collect();
    a[3] = f32::NAN;
    a[k + 9] = f32::INFINITY;
    let c = dense_product(Kernel::Amx, &a, &b, [m, k, n]);
    for j in 0..n {
        assert!(c[j].is_nan(), "C(0, {j}) = {}", c[j]);
        assert!(c[n + j] == f32::INFINITY || c[n + j].is_nan(), "C(1, {j})");
        for i in 2..m {
            assert!(c[i * n + j].is_finite(), "C({i}, {j})");
        }
    }
}

/// Batch invariance: each row of `C = A·B` has the same bits computed alone, among a few rows
/// or among many, for every kernel, layout of the operands and thread count (the property
/// that keeps expert parallelism, which regroups an expert's tokens across ranks, equal to
/// one process). The `gemm` crate fails this (its small-matrix paths sum in another order).
#[test]
fn a_row_has_the_same_bits_whatever_rows_share_the_product() {
    for kernel in kernels() {
        for (k, n) in [(32, 48), (300, 40), (700, 129)] {
            for (trans_a, trans_b, accumulate) in LAYOUTS {
                let case = |m, threads| Case {
                    m,
                    k,
                    n,
                    trans_a,
                    trans_b,
                    accumulate,
                    pad: 0,
                    threads,
                };
                // One operand set for every m: the first m rows of the largest A (stored
                // transposed, row i of op(A) is column i, so slice by re-laying out).
                let big = 70;
                let full = product(kernel, case(big, 2));
                for m in [1, 2, 5, 6, 13, 33] {
                    let mut a = vec![0.0f32; m * k];
                    for i in 0..m {
                        for p in 0..k {
                            let [ars, acs, _, _] = full.strides;
                            a[if trans_a { p * m + i } else { i * k + p }] =
                                full.a[(i as isize * ars + p as isize * acs) as usize];
                        }
                    }
                    let (ars, acs) = if trans_a {
                        (1, m as isize)
                    } else {
                        (k as isize, 1)
                    };
                    let [_, _, brs, bcs] = full.strides;
                    let mut c = full.c0[..m * n].to_vec();
                    let mat = |v: &[f32], rs, cs| MatRef {
                        ptr: v.as_ptr(),
                        rs,
                        cs,
                    };
                    // SAFETY: dense operands of the shapes given.
                    unsafe {
                        sgemm_with(
                            kernel,
                            c.as_mut_ptr(),
                            n,
                            mat(&a, ars, acs),
                            mat(&full.b, brs, bcs),
                            m,
                            k,
                            n,
                            accumulate,
                            1,
                        )
                    };
                    assert!(
                        same_bits(&c, &full.c[..m * n]),
                        "{kernel:?} m = {m} of {big}, k = {k}, n = {n}, {trans_a} {trans_b}: \
                         rows differ"
                    );
                }
            }
        }
    }
}
