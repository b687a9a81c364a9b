//! Row movements between token order and expert order (the mixture of experts): gather rows
//! by index (optionally scaled), add rows into a target at distinct indices (optionally
//! weighted), and per-row dot products. Rows are `dim` contiguous elements; indices are
//! checked against the buffers. Each output element is one fixed sequence of operations, so
//! results do not depend on threads.

use crate::error::TensorError;

type Result<T> = std::result::Result<T, TensorError>;

/// Rows of `dim` in a buffer of `len` elements.
pub(crate) fn rows_of(len: usize, dim: usize, what: &str) -> Result<usize> {
    if dim == 0 || !len.is_multiple_of(dim) {
        return Err(TensorError::Shape(format!(
            "{what}: {len} elements are not rows of {dim}"
        )));
    }
    Ok(len / dim)
}

/// Every index below `rows`, and (with `distinct`) none repeated.
pub(crate) fn check_indices(idx: &[u32], rows: usize, distinct: bool, what: &str) -> Result<()> {
    if let Some(pos) = idx.iter().position(|&i| i as usize >= rows) {
        return Err(TensorError::Shape(format!(
            "{what}: index {} at position {pos} is beyond {rows} rows",
            idx[pos]
        )));
    }
    if distinct {
        let mut seen = vec![false; rows];
        for (pos, &i) in idx.iter().enumerate() {
            if std::mem::replace(&mut seen[i as usize], true) {
                return Err(TensorError::Shape(format!(
                    "{what}: index {i} repeated at position {pos}"
                )));
            }
        }
    }
    Ok(())
}

/// `dst[r] = scale[r]·src[idx[r]]` (`scale` absent: a copy), a new buffer of `idx.len()` rows.
pub fn gather_rows(
    src: &[f32],
    idx: &[u32],
    scale: Option<&[f32]>,
    dim: usize,
) -> Result<Vec<f32>> {
    check_indices(
        idx,
        rows_of(src.len(), dim, "gathered rows")?,
        false,
        "gather",
    )?;
    if let Some(s) = scale {
        crate::error::check_len("gather scales", s.len(), idx.len())?;
    }
    let mut dst = vec![0.0; idx.len() * dim];
    for (r, (d, &i)) in dst.chunks_exact_mut(dim).zip(idx).enumerate() {
        let row = &src[i as usize * dim..(i as usize + 1) * dim];
        match scale {
            Some(s) => d.iter_mut().zip(row).for_each(|(d, &v)| *d = s[r] * v),
            None => d.copy_from_slice(row),
        }
    }
    Ok(dst)
}

/// `y[idx[r]] += w[r]·rows[r]` (`w` absent: `+= rows[r]`), the indices distinct.
pub fn scatter_add_rows(
    rows: &[f32],
    idx: &[u32],
    w: Option<&[f32]>,
    y: &mut [f32],
    dim: usize,
) -> Result<()> {
    let n = rows_of(rows.len(), dim, "scattered rows")?;
    crate::error::check_len("scatter indices", idx.len(), n)?;
    if let Some(w) = w {
        crate::error::check_len("scatter weights", w.len(), n)?;
    }
    check_indices(
        idx,
        rows_of(y.len(), dim, "scatter target")?,
        true,
        "scatter",
    )?;
    for (r, (row, &i)) in rows.chunks_exact(dim).zip(idx).enumerate() {
        let dst = &mut y[i as usize * dim..(i as usize + 1) * dim];
        match w {
            Some(w) => dst.iter_mut().zip(row).for_each(|(a, &b)| *a += w[r] * b),
            None => dst.iter_mut().zip(row).for_each(|(a, &b)| *a += b),
        }
    }
    Ok(())
}

/// `out[r] = a[ia[r]] · b[r]` (summed in element order), `b` holding `ia.len()` rows.
pub fn row_dots(a: &[f32], ia: &[u32], b: &[f32], dim: usize) -> Result<Vec<f32>> {
    check_indices(ia, rows_of(a.len(), dim, "row_dots a")?, false, "row_dots")?;
    crate::error::check_len("row_dots b", b.len(), ia.len() * dim)?;
    Ok(ia
        .iter()
        .zip(b.chunks_exact(dim))
        .map(|(&i, y)| {
            let x = &a[i as usize * dim..(i as usize + 1) * dim];
            x.iter().zip(y).map(|(p, q)| p * q).sum()
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gather_scatter_and_dots() {
        let dim = 3;
        let src: Vec<f32> = (0..12).map(|v| v as f32).collect();
        let g = gather_rows(&src, &[3, 0, 3], Some(&[1.0, 2.0, -1.0]), dim).unwrap();
        assert_eq!(g, [9.0, 10.0, 11.0, 0.0, 2.0, 4.0, -9.0, -10.0, -11.0]);
        assert_eq!(gather_rows(&src, &[1], None, dim).unwrap(), [3.0, 4.0, 5.0]);
        let mut y = vec![1.0; 12];
        scatter_add_rows(&g[..6], &[2, 0], Some(&[1.0, 0.5]), &mut y, dim).unwrap();
        assert_eq!(&y[..3], &[1.0, 2.0, 3.0]);
        assert_eq!(&y[6..9], &[10.0, 11.0, 12.0]);
        assert_eq!(&y[3..6], &[1.0, 1.0, 1.0]);
        let d = row_dots(&src, &[1, 0], &[1.0, 1.0, 1.0, 2.0, 0.0, 0.0], dim).unwrap();
        assert_eq!(d, [12.0, 0.0]);
        // Bad indices are errors, not out-of-bounds accesses (a GPU would write anywhere).
        assert!(gather_rows(&src, &[4], None, dim).is_err());
        assert!(scatter_add_rows(&g[..6], &[1, 1], None, &mut y, dim).is_err());
        assert!(row_dots(&src, &[0], &[1.0], dim).is_err());
    }
}
