//! The row-group drivers of the attention softmax, one text for every vector path: each ISA
//! module (`avx2`, `avx512`) expands [`softmax_row_drivers`] with its target feature, and the
//! expansion calls that module's own `rows_max`, `rows_exp`, `scale_row`, `exp_nonpos_scalar`
//! and `GROUP`, so only the lane-level pieces are written per ISA.

/// Defines `online_softmax_tile` and `exp_tile` (and their row-group helpers) in the invoking
/// ISA module, compiled with `#[target_feature(enable = $feature)]`.
macro_rules! softmax_row_drivers {
    ($feature:literal) => {
        /// See [`super::online_softmax_tile`]: the same steps on [`GROUP`] rows at a time.
        #[allow(clippy::too_many_arguments)]
        #[target_feature(enable = $feature)]
        pub(super) unsafe fn online_softmax_tile(
            st: *mut f32,
            bq: usize,
            bk: usize,
            vis0: isize,
            scale: f32,
            m: *mut f32,
            l: *mut f32,
            acc: *mut f32,
            d: usize,
        ) {
            let mut r0 = 0;
            while r0 + GROUP <= bq {
                online_rows::<GROUP>(st, r0, bk, vis0, scale, m, l, acc, d);
                r0 += GROUP;
            }
            while r0 < bq {
                online_rows::<1>(st, r0, bk, vis0, scale, m, l, acc, d);
                r0 += 1;
            }
        }

        /// [`online_softmax_tile`] on rows `r0..r0 + R`.
        #[allow(clippy::too_many_arguments)]
        #[target_feature(enable = $feature)]
        #[inline]
        unsafe fn online_rows<const R: usize>(
            st: *mut f32,
            r0: usize,
            bk: usize,
            vis0: isize,
            scale: f32,
            m: *mut f32,
            l: *mut f32,
            acc: *mut f32,
            d: usize,
        ) {
            let rows: [*mut f32; R] = std::array::from_fn(|i| st.add((r0 + i) * bk));
            let mut n: [usize; R] = std::array::from_fn(|i| super::visible_cols(vis0, r0 + i, bk));
            let mx = rows_max(rows.map(|p| p as *const f32), n);
            let m_new: [f32; R] = std::array::from_fn(|i| (*m.add(r0 + i)).max(scale * mx[i]));
            // Rows with nothing visible yet (m' = −∞) are zeroed (n = 0) and keep their state.
            let live = m_new.map(|v| v != f32::NEG_INFINITY);
            for i in 0..R {
                if !live[i] {
                    n[i] = 0;
                }
            }
            let sum = rows_exp::<R, true>(rows, n, bk, scale, m_new);
            for i in 0..R {
                if !live[i] {
                    continue;
                }
                let r = r0 + i;
                let alpha = exp_nonpos_scalar(*m.add(r) - m_new[i]);
                *l.add(r) = *l.add(r) * alpha + sum[i];
                *m.add(r) = m_new[i];
                if alpha != 1.0 {
                    scale_row(acc.add(r * d), d, alpha);
                }
            }
        }

        /// See [`super::exp_tile`]: [`GROUP`] rows at a time, no sums.
        #[target_feature(enable = $feature)]
        pub(super) unsafe fn exp_tile(
            p: *mut f32,
            bq: usize,
            bk: usize,
            vis0: isize,
            scale: f32,
            lse: *const f32,
        ) {
            let mut r0 = 0;
            while r0 + GROUP <= bq {
                exp_rows::<GROUP>(p, r0, bk, vis0, scale, lse);
                r0 += GROUP;
            }
            while r0 < bq {
                exp_rows::<1>(p, r0, bk, vis0, scale, lse);
                r0 += 1;
            }
        }

        /// [`exp_tile`] on rows `r0..r0 + R`.
        #[target_feature(enable = $feature)]
        #[inline]
        unsafe fn exp_rows<const R: usize>(
            p: *mut f32,
            r0: usize,
            bk: usize,
            vis0: isize,
            scale: f32,
            lse: *const f32,
        ) {
            let rows: [*mut f32; R] = std::array::from_fn(|i| p.add((r0 + i) * bk));
            let mut n: [usize; R] = std::array::from_fn(|i| super::visible_cols(vis0, r0 + i, bk));
            let mut m: [f32; R] = std::array::from_fn(|i| *lse.add(r0 + i));
            for i in 0..R {
                if m[i] == f32::NEG_INFINITY {
                    (n[i], m[i]) = (0, 0.0);
                }
            }
            rows_exp::<R, false>(rows, n, bk, scale, m);
        }
    };
}
pub(super) use softmax_row_drivers;
