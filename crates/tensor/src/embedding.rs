//! Embedding lookup (row gather) and its backward (scatter-add into the table gradient).

use crate::error::check_len;
use crate::threads;
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
    let vocab = vocab_of(table.len(), dim)?;
    check_len("embedding out", out.len(), ids.len() * dim)?;
    check_ids(ids, vocab)?;
    threads::install(|| {
        out.par_chunks_mut(dim)
            .zip(ids.par_iter())
            .with_min_len(64)
            .for_each(|(o, &id)| {
                let id = id as usize;
                o.copy_from_slice(&table[id * dim..(id + 1) * dim]);
            });
    });
    Ok(())
}

/// `dtable[ids[t]] += dout[t]` (accumulated; repeated ids add up).
pub fn embedding_backward(
    ids: &[u32],
    dout: &[f32],
    dim: usize,
    dtable: &mut [f32],
) -> Result<(), TensorError> {
    let vocab = vocab_of(dtable.len(), dim)?;
    check_len("embedding dout", dout.len(), ids.len() * dim)?;
    check_ids(ids, vocab)?;
    // Parallel over column blocks of the table: each task owns columns [c0, c1) of every
    // row, so repeated ids never race and summation order is deterministic.
    let n_tasks = threads::thread_budget().min(dim.div_ceil(16)).max(1);
    let block = dim.div_ceil(n_tasks);
    let table = SyncPtr(dtable.as_mut_ptr());
    threads::install(|| {
        (0..n_tasks).into_par_iter().for_each(|task| {
            let c0 = task * block;
            let c1 = ((task + 1) * block).min(dim);
            let table = &table;
            for (t, &id) in ids.iter().enumerate() {
                let src = &dout[t * dim + c0..t * dim + c1];
                // SAFETY: row `id < vocab` checked above; columns [c0, c1) belong only to
                // this task, so the mutable slices of different tasks are disjoint.
                let dst = unsafe {
                    std::slice::from_raw_parts_mut(table.0.add(id as usize * dim + c0), c1 - c0)
                };
                dst.iter_mut().zip(src).for_each(|(d, s)| *d += s);
            }
        });
    });
    Ok(())
}

struct SyncPtr(*mut f32);
// SAFETY: tasks write disjoint column ranges (see `embedding_backward`).
unsafe impl Sync for SyncPtr {}

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
    }
}
