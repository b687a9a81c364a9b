//! Embedding lookup (row gather) and its backward (scatter-add into the table gradient).

use crate::error::check_len;
use crate::threads::{self, SyncPtr};
use crate::TensorError;
use rayon::prelude::*;

fn check_ids(ids: &[u32], vocab: usize) -> Result<(), TensorError> {
    match ids.iter().position(|&id| id as usize >= vocab) {
        Some(pos) => Err(TensorError::IdOutOfRange {
            id: ids[pos] as i64,
            pos,
            vocab,
        }),
        None => Ok(()),
    }
}

fn vocab_of(table_len: usize, dim: usize) -> Result<usize, TensorError> {
    if dim == 0 || !table_len.is_multiple_of(dim) {
        return Err(TensorError::Shape(format!(
            "embedding table length {table_len} is not a multiple of dim {dim}"
        )));
    }
    Ok(table_len / dim)
}

/// `out[t] = table[ids[t]]` with `table [vocab, dim]`, `out [ids.len(), dim]`.
/// An id `>= vocab` is an error (nothing is written then).
pub fn embedding_forward(
    ids: &[u32],
    table: &[f32],
    dim: usize,
    out: &mut [f32],
) -> Result<(), TensorError> {
    check_ids(ids, vocab_of(table.len(), dim)?)?;
    lookup(ids, table, dim, 0, out)
}

/// Vocabulary-parallel lookup: `table_shard` holds rows `[vocab_start, vocab_start + shard)` of
/// the full table; tokens whose id falls outside the shard get zero rows (the rank owning them
/// supplies theirs, and summing the partial outputs over ranks gives the full lookup).
pub fn embedding_forward_shard(
    ids: &[u32],
    table_shard: &[f32],
    dim: usize,
    vocab_start: usize,
    out: &mut [f32],
) -> Result<(), TensorError> {
    lookup(ids, table_shard, dim, vocab_start, out)
}

/// `dtable[ids[t]] += dout[t]` (accumulated; repeated ids add up).
pub fn embedding_backward(
    ids: &[u32],
    dout: &[f32],
    dim: usize,
    dtable: &mut [f32],
) -> Result<(), TensorError> {
    check_ids(ids, vocab_of(dtable.len(), dim)?)?;
    scatter_add(ids, dout, dim, 0, dtable)
}

/// Backward of [`embedding_forward_shard`]: accumulates the rows of tokens whose id is in this
/// shard into `dtable_shard`; other tokens are skipped.
pub fn embedding_backward_shard(
    ids: &[u32],
    dout: &[f32],
    dim: usize,
    vocab_start: usize,
    dtable_shard: &mut [f32],
) -> Result<(), TensorError> {
    scatter_add(ids, dout, dim, vocab_start, dtable_shard)
}

/// Row of `id` inside a shard starting at `vocab_start` with `rows` rows, if it is there.
#[inline]
fn local_row(id: u32, vocab_start: usize, rows: usize) -> Option<usize> {
    (id as usize).checked_sub(vocab_start).filter(|&r| r < rows)
}

fn lookup(
    ids: &[u32],
    table: &[f32],
    dim: usize,
    vocab_start: usize,
    out: &mut [f32],
) -> Result<(), TensorError> {
    let rows = vocab_of(table.len(), dim)?;
    check_len("embedding out", out.len(), ids.len() * dim)?;
    threads::install(|| {
        out.par_chunks_mut(dim)
            .zip(ids.par_iter())
            .with_min_len(64)
            .for_each(|(o, &id)| match local_row(id, vocab_start, rows) {
                Some(r) => o.copy_from_slice(&table[r * dim..(r + 1) * dim]),
                None => o.fill(0.0),
            });
    });
    Ok(())
}

fn scatter_add(
    ids: &[u32],
    dout: &[f32],
    dim: usize,
    vocab_start: usize,
    dtable: &mut [f32],
) -> Result<(), TensorError> {
    let rows = vocab_of(dtable.len(), dim)?;
    check_len("embedding dout", dout.len(), ids.len() * dim)?;
    // Parallel over column blocks of the table: each task owns columns [c0, c1) of every
    // row, so repeated ids never race, and each element sums its tokens in token order
    // (bitwise reproducible for any thread count).
    let n_tasks = threads::thread_budget().min(dim.div_ceil(16)).max(1);
    let block = dim.div_ceil(n_tasks);
    let table = SyncPtr(dtable.as_mut_ptr());
    threads::install(|| {
        (0..n_tasks).into_par_iter().for_each(|task| {
            let c0 = (task * block).min(dim);
            let c1 = ((task + 1) * block).min(dim);
            let table = &table;
            for (t, &id) in ids.iter().enumerate() {
                let Some(r) = local_row(id, vocab_start, rows) else {
                    continue;
                };
                let src = &dout[t * dim + c0..t * dim + c1];
                // SAFETY: row r < rows is inside the table; columns [c0, c1) belong only to
                // this task, so the mutable slices of different tasks are disjoint.
                let dst = unsafe {
                    std::slice::from_raw_parts_mut(table.get().add(r * dim + c0), c1 - c0)
                };
                dst.iter_mut().zip(src).for_each(|(d, s)| *d += s);
            }
        });
    });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::rand_vec;

    #[test]
    fn gather_and_scatter_add() {
        let (vocab, dim) = (10, 37);
        let table = rand_vec(vocab * dim, 1);
        let ids = [3u32, 0, 9, 3, 3, 7];
        let mut out = vec![0.0; ids.len() * dim];
        embedding_forward(&ids, &table, dim, &mut out).unwrap();
        for (t, &id) in ids.iter().enumerate() {
            assert_eq!(
                &out[t * dim..(t + 1) * dim],
                &table[id as usize * dim..(id as usize + 1) * dim]
            );
        }
        let dout = rand_vec(ids.len() * dim, 2);
        let mut dt = vec![0.5; vocab * dim];
        embedding_backward(&ids, &dout, dim, &mut dt).unwrap();
        // The forward is linear, so the exact gradient is the scatter-add; check it directly.
        let mut want = vec![0.5f32; vocab * dim];
        for (t, &id) in ids.iter().enumerate() {
            for j in 0..dim {
                want[id as usize * dim + j] += dout[t * dim + j];
            }
        }
        assert!(crate::tensor::max_abs_diff(&dt, &want) < 1e-6);
        let err = embedding_forward(&[1, 10], &table, dim, &mut out[..2 * dim]).unwrap_err();
        assert_eq!(
            err,
            TensorError::IdOutOfRange {
                id: 10,
                pos: 1,
                vocab
            }
        );
        assert!(embedding_backward(&[11], &dout[..dim], dim, &mut dt).is_err());

        // Two vocabulary shards [0, 4) and [4, 10): partial lookups sum to the full one, and
        // shard gradients are the matching rows of the full gradient.
        let mut sum = vec![0.0; ids.len() * dim];
        let mut dfull = vec![0.0; vocab * dim];
        embedding_backward(&ids, &dout, dim, &mut dfull).unwrap();
        for (start, rows) in [(0usize, 4usize), (4, 6)] {
            let shard = &table[start * dim..(start + rows) * dim];
            let mut part = vec![f32::NAN; ids.len() * dim];
            embedding_forward_shard(&ids, shard, dim, start, &mut part).unwrap();
            sum.iter_mut().zip(&part).for_each(|(s, p)| *s += p);
            let mut dshard = vec![0.0; rows * dim];
            embedding_backward_shard(&ids, &dout, dim, start, &mut dshard).unwrap();
            assert_eq!(&dshard[..], &dfull[start * dim..(start + rows) * dim]);
        }
        assert_eq!(sum, out);
    }
}
