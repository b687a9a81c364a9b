//! Small dense products on row-major tiles, used inside attention where each rayon task
//! multiplies tiles of a few dozen rows (too small for `gemm`'s packing to pay off).
//!
//! Both kernels stream rows of `B` and update rows of `C` with `c_row += a · b_row`, so the
//! innermost loop is a contiguous multiply-add over `n` that the compiler vectorises.

/// `C[m×n] (+)= A[m×k] · B[k×n]`; `A`, `B`, `C` row-major with leading dimensions
/// `lda`, `ldb`, `ldc`.
#[allow(clippy::too_many_arguments)]
#[inline]
pub(crate) fn mm_nn(
    c: &mut [f32],
    ldc: usize,
    a: &[f32],
    lda: usize,
    b: &[f32],
    ldb: usize,
    m: usize,
    k: usize,
    n: usize,
    accumulate: bool,
) {
    for i in 0..m {
        let crow = &mut c[i * ldc..i * ldc + n];
        if !accumulate {
            crow.fill(0.0);
        }
        let arow = &a[i * lda..i * lda + k];
        for (p, &av) in arow.iter().enumerate() {
            let brow = &b[p * ldb..p * ldb + n];
            for (cv, &bv) in crow.iter_mut().zip(brow) {
                *cv += av * bv;
            }
        }
    }
}

/// `C[m×n] += Aᵀ · B` where `A` is stored `[k×m]` (leading dimension `lda`) and `B` `[k×n]`.
#[allow(clippy::too_many_arguments)]
#[inline]
pub(crate) fn mm_tn_acc(
    c: &mut [f32],
    ldc: usize,
    a: &[f32],
    lda: usize,
    b: &[f32],
    ldb: usize,
    m: usize,
    k: usize,
    n: usize,
) {
    for p in 0..k {
        let arow = &a[p * lda..p * lda + m];
        let brow = &b[p * ldb..p * ldb + n];
        for (i, &av) in arow.iter().enumerate() {
            if av == 0.0 {
                continue;
            }
            let crow = &mut c[i * ldc..i * ldc + n];
            for (cv, &bv) in crow.iter_mut().zip(brow) {
                *cv += av * bv;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gemm::matmul_reference;
    use crate::tensor::max_abs_diff;
    use crate::testutil::rand_vec;

    #[test]
    fn tile_products_match_reference() {
        for &(m, k, n) in &[(1, 1, 1), (5, 7, 3), (16, 32, 64), (13, 29, 17)] {
            let a = rand_vec(m * k, 1);
            let b = rand_vec(k * n, 2);
            let mut c = rand_vec(m * n, 3);
            let mut r = c.clone();
            mm_nn(&mut c, n, &a, k, &b, n, m, k, n, true);
            matmul_reference(&mut r, &a, &b, m, k, n, false, false, true);
            assert!(max_abs_diff(&c, &r) < 1e-5);
            mm_nn(&mut c, n, &a, k, &b, n, m, k, n, false);
            matmul_reference(&mut r, &a, &b, m, k, n, false, false, false);
            assert!(max_abs_diff(&c, &r) < 1e-5);
            let at = rand_vec(k * m, 4);
            mm_tn_acc(&mut c, n, &at, m, &b, n, m, k, n);
            matmul_reference(&mut r, &at, &b, m, k, n, true, false, true);
            assert!(max_abs_diff(&c, &r) < 1e-5);
        }
    }
}
