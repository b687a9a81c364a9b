//! Matrix products, parallelised over the thread budget, on one of the backends
//! ([`Backend`]). The default ([`Backend::Auto`]) is the own SGEMM of [`crate::sgemm`] with the
//! micro-kernel of the kernel path of [`crate::isa`] (AVX-512, AVX2 + FMA or portable), whose
//! rows do not depend on how many rows share a product (batch invariance, see
//! [`crate::sgemm`]). For comparisons, [`matmul_using`] also runs the `gemm` crate (built
//! without its AVX-512 kernels) or the own SGEMM on AMX tiles ([`crate::sgemm::amx`], fp32
//! accuracy from an exact bf16 split). (AMX is not the default because on the shared VMs
//! measured AMX alternated between 1.2–1.45× faster and 0.63–0.91× slower training steps,
//! geometric mean ≈ 1; docs/PERFORMANCE.md, "AMX".)
//!
//! Transposed operands are read through strides, never copied: a row-major `[r, c]` matrix
//! read as its transpose is the same memory with row stride 1 and column stride `c`.
//! For a linear layer with HF weight layout `W [out, in]`:
//! `y = x·Wᵀ` is `matmul(y, x, w, tokens, in, out, false, true, false)`,
//! `dx = dy·W` is `matmul(dx, dy, w, tokens, out, in, false, false, false)` and
//! `dW += dyᵀ·x` is `matmul(dw, dy, x, out, tokens, in, true, false, true)`.

use crate::error::check_len;
use crate::sgemm;
use crate::threads::{self, SyncPtr};
use crate::TensorError;
use gemm::Parallelism;

/// Below this many multiply-adds a product runs on the calling thread (threading overhead
/// would dominate).
const PARALLEL_MIN_WORK: usize = 64 * 64 * 64;

/// A strided matrix view for [`gemm_raw`]: element `(i, j)` is at
/// `ptr[i * row_stride + j * col_stride]`.
#[derive(Debug, Clone, Copy)]
pub struct Strides {
    pub row: isize,
    pub col: isize,
}

impl Strides {
    /// Row-major `[rows, cols]` matrix, read as is (`trans = false`) or as its transpose.
    pub fn row_major(cols: usize, trans: bool) -> Strides {
        if trans {
            Strides {
                row: 1,
                col: cols as isize,
            }
        } else {
            Strides {
                row: cols as isize,
                col: 1,
            }
        }
    }
}

/// `C = op(A)·op(B)` (or `C += op(A)·op(B)` when `accumulate`), with `C [m, n]` row-major.
///
/// `op(A)` is `[m, k]`: `A` is stored row-major as `[m, k]`, or as `[k, m]` when `trans_a`.
/// `op(B)` is `[k, n]`: `B` is stored row-major as `[k, n]`, or as `[n, k]` when `trans_b`.
#[allow(clippy::too_many_arguments)]
pub fn matmul(
    c: &mut [f32],
    a: &[f32],
    b: &[f32],
    m: usize,
    k: usize,
    n: usize,
    trans_a: bool,
    trans_b: bool,
    accumulate: bool,
) -> Result<(), TensorError> {
    matmul_with(
        c,
        a,
        b,
        [m, k, n],
        [trans_a, trans_b, accumulate],
        Some(threads::thread_budget()),
    )
}

/// Strides of `op(A) [m, k]` and `op(B) [k, n]` stored row-major (transposed when asked),
/// the [`matmul`] conventions.
fn operand_strides([m, k, n]: [usize; 3], trans_a: bool, trans_b: bool) -> (Strides, Strides) {
    (
        Strides::row_major(if trans_a { m } else { k }, trans_a),
        Strides::row_major(if trans_b { k } else { n }, trans_b),
    )
}

/// `op(A)·op(B)` as a new row-major `[m, n]` vector, on the thread budget (see [`matmul`]).
/// The product writes every element, so the buffer is not zero-filled first: in a training
/// step that fill is a serial `memset` of every activation (≈ 4–5 % of a step, preset small).
pub fn matmul_new(
    a: &[f32],
    b: &[f32],
    m: usize,
    k: usize,
    n: usize,
    trans_a: bool,
    trans_b: bool,
) -> Result<Vec<f32>, TensorError> {
    check_len("matmul A", a.len(), m * k)?;
    check_len("matmul B", b.len(), k * n)?;
    let mut c = Vec::<f32>::with_capacity(m * n);
    let (sa, sb) = operand_strides([m, k, n], trans_a, trans_b);
    // SAFETY: A and B lengths are checked and every (i, p) / (p, j) addresses inside them; C has
    // capacity m·n and is reached only through the raw pointer. A non-accumulating product
    // writes every C(i, j) on every backend (k = 0 writes zeros) and reads none, so all m·n
    // elements are initialised when `set_len` runs.
    unsafe {
        gemm_raw(
            c.as_mut_ptr(),
            Strides::row_major(n, false),
            a.as_ptr(),
            sa,
            b.as_ptr(),
            sb,
            m,
            k,
            n,
            false,
            Some(threads::thread_budget()),
        );
        c.set_len(m * n);
    }
    Ok(c)
}

/// Single-threaded [`matmul`] for callers that already parallelise outside (e.g. one product
/// per attention head inside a rayon task).
#[allow(clippy::too_many_arguments)]
pub fn matmul_serial(
    c: &mut [f32],
    a: &[f32],
    b: &[f32],
    m: usize,
    k: usize,
    n: usize,
    trans_a: bool,
    trans_b: bool,
    accumulate: bool,
) -> Result<(), TensorError> {
    matmul_with(c, a, b, [m, k, n], [trans_a, trans_b, accumulate], None)
}

/// Which implementation computes a product.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    /// The own SGEMM with the micro-kernel of the kernel path ([`crate::isa::active`]:
    /// AVX-512, AVX2 + FMA or portable).
    Auto,
    /// The `gemm` crate (for comparisons; its small-matrix paths sum in an order that depends
    /// on the number of rows, so it is not batch-invariant).
    Crate,
    /// The own SGEMM on the AMX tile unit ([`crate::sgemm::amx`]: exact bf16 split, fp32
    /// accuracy) for every product; where AMX is unavailable, the same choice as
    /// [`Backend::Auto`].
    Amx,
}

/// [`matmul`] with an explicit backend and thread count (`threads: None` runs serially);
/// for benchmarks and tests that compare the implementations.
#[allow(clippy::too_many_arguments)]
pub fn matmul_using(
    backend: Backend,
    threads: Option<usize>,
    c: &mut [f32],
    a: &[f32],
    b: &[f32],
    m: usize,
    k: usize,
    n: usize,
    trans_a: bool,
    trans_b: bool,
    accumulate: bool,
) -> Result<(), TensorError> {
    matmul_checked(
        backend,
        c,
        a,
        b,
        [m, k, n],
        [trans_a, trans_b, accumulate],
        threads,
    )
}

/// The checked body of [`matmul`] and [`matmul_serial`]; `threads: None` runs serially.
fn matmul_with(
    c: &mut [f32],
    a: &[f32],
    b: &[f32],
    mkn: [usize; 3],
    flags: [bool; 3],
    threads: Option<usize>,
) -> Result<(), TensorError> {
    matmul_checked(Backend::Auto, c, a, b, mkn, flags, threads)
}

fn matmul_checked(
    backend: Backend,
    c: &mut [f32],
    a: &[f32],
    b: &[f32],
    [m, k, n]: [usize; 3],
    [trans_a, trans_b, accumulate]: [bool; 3],
    threads: Option<usize>,
) -> Result<(), TensorError> {
    check_len("matmul C", c.len(), m * n)?;
    check_len("matmul A", a.len(), m * k)?;
    check_len("matmul B", b.len(), k * n)?;
    let (sa, sb) = operand_strides([m, k, n], trans_a, trans_b);
    // SAFETY: lengths checked above; every index (i, p) / (p, j) / (i, j) with i < m, p < k,
    // j < n lies inside the corresponding slice for these row-major strides.
    unsafe {
        gemm_raw_using(
            backend,
            c.as_mut_ptr(),
            Strides::row_major(n, false),
            a.as_ptr(),
            sa,
            b.as_ptr(),
            sb,
            m,
            k,
            n,
            accumulate,
            threads,
        )
    };
    Ok(())
}

/// General strided product `C (+)= A·B` with `A [m, k]`, `B [k, n]`, `C [m, n]` described by
/// pointers and strides. `threads = None` runs on the calling thread, `Some(t)` on up to `t`
/// threads of the budget pool.
///
/// # Safety
/// Every addressed element must be inside its allocation; `c` must not alias `a` or `b`.
#[allow(clippy::too_many_arguments)]
pub unsafe fn gemm_raw(
    c: *mut f32,
    sc: Strides,
    a: *const f32,
    sa: Strides,
    b: *const f32,
    sb: Strides,
    m: usize,
    k: usize,
    n: usize,
    accumulate: bool,
    threads: Option<usize>,
) {
    gemm_raw_using(
        Backend::Auto,
        c,
        sc,
        a,
        sa,
        b,
        sb,
        m,
        k,
        n,
        accumulate,
        threads,
    )
}

/// [`gemm_raw`] with an explicit backend.
///
/// # Safety
/// As for [`gemm_raw`].
#[allow(clippy::too_many_arguments)]
pub unsafe fn gemm_raw_using(
    backend: Backend,
    c: *mut f32,
    sc: Strides,
    a: *const f32,
    sa: Strides,
    b: *const f32,
    sb: Strides,
    m: usize,
    k: usize,
    n: usize,
    accumulate: bool,
    threads: Option<usize>,
) {
    // The own kernels write row-major C; a column-major C is the transposed product
    // Cᵀ = Bᵀ·Aᵀ, which is row-major with the operands' roles and strides swapped.
    let own = if sc.col == 1 && sc.row >= n as isize {
        Some((c, sc.row as usize, a, sa, b, sb, m, n))
    } else if sc.row == 1 && sc.col >= m as isize {
        let swap = |s: Strides| Strides {
            row: s.col,
            col: s.row,
        };
        Some((c, sc.col as usize, b, swap(sb), a, swap(sa), n, m))
    } else {
        None
    };
    let path = sgemm::Kernel::for_isa(crate::isa::active());
    let kernel = match backend {
        Backend::Crate => None,
        Backend::Auto => Some(path),
        Backend::Amx if sgemm::Kernel::Amx.available() => Some(sgemm::Kernel::Amx),
        Backend::Amx => Some(path),
    };
    if let Some((kernel, (c, ldc, a, sa, b, sb, m, n))) = kernel.zip(own) {
        let mat = |p: *const f32, s: Strides| sgemm::MatRef {
            ptr: p,
            rs: s.row,
            cs: s.col,
        };
        sgemm::sgemm_with(
            kernel,
            c,
            ldc,
            mat(a, sa),
            mat(b, sb),
            m,
            k,
            n,
            accumulate,
            threads.unwrap_or(1),
        );
        return;
    }
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !accumulate {
            for i in 0..m {
                for j in 0..n {
                    *c.offset(i as isize * sc.row + j as isize * sc.col) = 0.0;
                }
            }
        }
        return;
    }
    let work = m.saturating_mul(n).saturating_mul(k);
    let par = match threads {
        Some(t) if t > 1 && work >= PARALLEL_MIN_WORK => Parallelism::Rayon(t),
        _ => Parallelism::None,
    };
    if matches!(par, Parallelism::Rayon(_)) {
        let c = SyncPtr(c);
        let a = SyncPtr(a as *mut f32);
        let b = SyncPtr(b as *mut f32);
        threads::install(move || {
            let (c, a, b) = (c, a, b);
            gemm::gemm(
                m,
                n,
                k,
                c.get(),
                sc.col,
                sc.row,
                accumulate,
                a.get(),
                sa.col,
                sa.row,
                b.get(),
                sb.col,
                sb.row,
                1.0f32,
                1.0f32,
                false,
                false,
                false,
                par,
            )
        });
    } else {
        // gemm computes dst = alpha·dst + beta·lhs·rhs (dst read only when read_dst).
        gemm::gemm(
            m, n, k, c, sc.col, sc.row, accumulate, a, sa.col, sa.row, b, sb.col, sb.row, 1.0f32,
            1.0f32, false, false, false, par,
        )
    }
}

/// Naive triple-loop reference product (f64 accumulation) with the same conventions as
/// [`matmul`]; used by tests across the crate.
#[allow(clippy::too_many_arguments)]
pub fn matmul_reference(
    c: &mut [f32],
    a: &[f32],
    b: &[f32],
    m: usize,
    k: usize,
    n: usize,
    trans_a: bool,
    trans_b: bool,
    accumulate: bool,
) {
    for i in 0..m {
        for j in 0..n {
            let mut s = 0.0f64;
            for p in 0..k {
                let av = if trans_a { a[p * m + i] } else { a[i * k + p] };
                let bv = if trans_b { b[j * k + p] } else { b[p * n + j] };
                s += av as f64 * bv as f64;
            }
            let dst = &mut c[i * n + j];
            *dst = if accumulate {
                *dst + s as f32
            } else {
                s as f32
            };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor::max_abs_diff;
    use crate::testutil::rand_vec;

    #[test]
    fn matches_naive_for_all_transposes_and_odd_sizes() {
        // Sizes include odd values and ones large enough to take the parallel path.
        for &(m, k, n) in &[
            (1, 1, 1),
            (3, 5, 7),
            (17, 13, 9),
            (33, 65, 31),
            (70, 80, 90),
        ] {
            for ta in [false, true] {
                for tb in [false, true] {
                    for acc in [false, true] {
                        let a = rand_vec(m * k, 1);
                        let b = rand_vec(k * n, 2);
                        let c0 = rand_vec(m * n, 3);
                        let mut c = c0.clone();
                        let mut r = c0.clone();
                        matmul(&mut c, &a, &b, m, k, n, ta, tb, acc).unwrap();
                        matmul_reference(&mut r, &a, &b, m, k, n, ta, tb, acc);
                        // f32 sums of k products of values in [-1, 1]: error ~ k·eps.
                        let tol = 1e-6 * k as f32 * 4.0;
                        let d = max_abs_diff(&c, &r);
                        assert!(d <= tol, "{m}x{k}x{n} ta={ta} tb={tb} acc={acc}: {d}");
                        let mut cs = c0.clone();
                        matmul_serial(&mut cs, &a, &b, m, k, n, ta, tb, acc).unwrap();
                        assert!(max_abs_diff(&cs, &r) <= tol);
                    }
                }
            }
        }
    }

    #[test]
    fn backends_agree_including_column_major_c() {
        // Both backends through matmul_using, and gemm_raw with a column-major C (the own
        // kernel computes it as the transposed product) and strided inputs.
        let (m, k, n) = (37, 45, 29);
        for backend in [Backend::Crate, Backend::Auto, Backend::Amx] {
            for threads in [None, Some(2)] {
                for (ta, tb) in [(false, false), (true, false), (false, true), (true, true)] {
                    let a = rand_vec(m * k, 4);
                    let b = rand_vec(k * n, 5);
                    let mut c = rand_vec(m * n, 6);
                    let mut r = c.clone();
                    matmul_using(backend, threads, &mut c, &a, &b, m, k, n, ta, tb, true).unwrap();
                    matmul_reference(&mut r, &a, &b, m, k, n, ta, tb, true);
                    assert!(max_abs_diff(&c, &r) <= 1e-6 * k as f32 * 4.0, "{backend:?}");
                }
                // C stored column-major: C(i, j) at c[j·m + i].
                let a = rand_vec(m * k, 7);
                let b = rand_vec(k * n, 8);
                let mut ct = vec![0.0f32; m * n];
                let mut r = vec![0.0f32; m * n];
                unsafe {
                    gemm_raw_using(
                        backend,
                        ct.as_mut_ptr(),
                        Strides {
                            row: 1,
                            col: m as isize,
                        },
                        a.as_ptr(),
                        Strides::row_major(k, false),
                        b.as_ptr(),
                        Strides::row_major(n, false),
                        m,
                        k,
                        n,
                        false,
                        threads,
                    )
                };
                matmul_reference(&mut r, &a, &b, m, k, n, false, false, false);
                for i in 0..m {
                    for j in 0..n {
                        let d = (ct[j * m + i] - r[i * n + j]).abs();
                        assert!(d <= 1e-6 * k as f32 * 4.0, "{backend:?} C({i},{j})");
                    }
                }
            }
        }
    }

    #[test]
    fn matmul_new_equals_matmul() {
        for &(m, k, n) in &[(1, 1, 1), (7, 0, 5), (33, 17, 65), (130, 70, 40)] {
            for (ta, tb) in [(false, false), (false, true), (true, false), (true, true)] {
                let a = rand_vec(m * k, 3);
                let b = rand_vec(k * n, 4);
                let mut want = vec![f32::NAN; m * n];
                matmul(&mut want, &a, &b, m, k, n, ta, tb, false).unwrap();
                let got = matmul_new(&a, &b, m, k, n, ta, tb).unwrap();
                assert_eq!(got, want, "{m}x{k}x{n} {ta} {tb}");
            }
        }
        assert!(matmul_new(&[1.0; 3], &[1.0; 4], 2, 2, 2, false, false).is_err());
    }

    #[test]
    fn rejects_bad_lengths_and_handles_k0() {
        let mut c = vec![1.0; 4];
        assert!(matmul(&mut c, &[0.0; 3], &[0.0; 4], 2, 2, 2, false, false, false).is_err());
        assert!(matmul(
            &mut c[..3],
            &[0.0; 4],
            &[0.0; 4],
            2,
            2,
            2,
            false,
            false,
            false
        )
        .is_err());
        matmul(&mut c, &[], &[], 2, 0, 2, false, false, true).unwrap();
        assert_eq!(c, vec![1.0; 4]);
        matmul(&mut c, &[], &[], 2, 0, 2, false, false, false).unwrap();
        assert_eq!(c, vec![0.0; 4]);
    }
}
