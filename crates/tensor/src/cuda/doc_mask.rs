//! The document mask of the CUDA attention kernels (block-causal attention over packed
//! documents, [`crate::attention`]'s module doc) in the form the kernels read it.
//!
//! The CPU kernel takes, per query `i`, the start `doc_start[i]` of its document (in the frame
//! of `q_start` / `k_start`) and lets it see key `j` iff `doc_start[i] ≤ k_start + j ≤
//! q_start + i`. The GPU kernels take two int32 arrays in their own local indices instead:
//!
//! - `key_lo[b, i] = clamp(doc_start[b, i] − k_start, 0, kv_len)`: query `i`'s first visible
//!   key, where the forward and dQ start their key loops;
//! - `q_end[b, j] = #{i : doc_start[b, i] ≤ k_start + j}`: the queries that may see key `j`
//!   (its own document's and none later), where dK/dV ends its query loop.
//!
//! Query `i` sees key `j` iff `key_lo[i] ≤ j` (and the causal rule), iff `i < q_end[j]` (and
//! the causal rule). The two agree, and `q_end` counts a prefix, because the starts of a row are
//! nondecreasing: documents are contiguous runs of positions, a later query's document never
//! starts before an earlier one's. [`bounds`] checks that (a row that breaks it is an error,
//! never a mask that differs from the CPU's), and the kernels rely on it once more to take a
//! tile's bounds from its first and last rows. Every caller's starts satisfy it: a sequence's
//! (the rule `model::Documents` checks), and each context-parallel block call's (its
//! `first_key` is monotone in the start).
//!
//! A training step calls attention with the same mask in every layer, forward and backward,
//! so [`DocMask::cached`] keeps the uploaded arrays per (device, shape, starts).

use super::driver::{DevBuf, Gpu};
use super::ops::{lru, Lru};
use super::CudaError;
use crate::attention::AttnShape;
use std::sync::{Arc, OnceLock};

/// `(key_lo, q_end)` of the module doc, `[batch, q_len]` and `[batch, kv_len]`, from
/// `doc_start` (`[batch, q_len]`) of a causal shape.
pub fn bounds(s: &AttnShape, doc_start: &[usize]) -> Result<(Vec<i32>, Vec<i32>), CudaError> {
    let shape = |why: String| Err(CudaError::Shape(format!("attention document mask: {why}")));
    if !s.causal {
        return shape("it needs causal attention".into());
    }
    if doc_start.len() != s.batch * s.q_len {
        return shape(format!(
            "{} document starts for {} × {} queries",
            doc_start.len(),
            s.batch,
            s.q_len
        ));
    }
    if s.q_len > i32::MAX as usize || s.kv_len > i32::MAX as usize {
        return shape(format!("{s:?} is too long for the kernels' int32 indices"));
    }
    let mut key_lo = Vec::with_capacity(s.batch * s.q_len);
    let mut q_end = Vec::with_capacity(s.batch * s.kv_len);
    for (b, row) in doc_start.chunks(s.q_len.max(1)).enumerate() {
        if let Some(i) = row.windows(2).position(|w| w[1] < w[0]) {
            return shape(format!(
                "sequence {b}: query {} starts its document at {}, before query {i}'s ({}); \
                 the starts of a sequence must not decrease (contiguous documents)",
                i + 1,
                row[i + 1],
                row[i]
            ));
        }
        key_lo.extend(
            row.iter()
                .map(|&d| d.saturating_sub(s.k_start).min(s.kv_len) as i32),
        );
        // Two pointers: the queries whose start is at or before key j's position, a prefix
        // that grows with j.
        let mut n = 0;
        for j in 0..s.kv_len {
            while n < row.len() && row[n] <= s.k_start + j {
                n += 1;
            }
            q_end.push(n as i32);
        }
    }
    // A batch of queries of length 0 has no rows above; its keys see no query.
    if s.q_len == 0 {
        q_end.resize(s.batch * s.kv_len, 0);
    }
    Ok((key_lo, q_end))
}

/// [`bounds`] on the device.
pub struct DocMask {
    pub key_lo: DevBuf<i32>,
    pub q_end: DevBuf<i32>,
}

/// The identity of a cached [`DocMask`]: the device, the shape and the starts.
struct Key {
    gpu: usize,
    shape: AttnShape,
    doc_start: Vec<usize>,
}

/// Masks kept per process, most recently used first: a step's layers share one per
/// attention call shape (a context-parallel rank has one per block call of its ring).
const CACHE: usize = 16;

impl DocMask {
    /// [`bounds`] uploaded, once per (device, shape, starts).
    pub fn cached(
        gpu: &Arc<Gpu>,
        s: &AttnShape,
        doc_start: &[usize],
    ) -> Result<Arc<DocMask>, CudaError> {
        static MASKS: Lru<Key, DocMask> = OnceLock::new();
        let at = Arc::as_ptr(gpu) as usize;
        let is = |k: &Key| k.gpu == at && k.shape == *s && k.doc_start == doc_start;
        let key = || Key {
            gpu: at,
            shape: *s,
            doc_start: doc_start.to_vec(),
        };
        lru(&MASKS, is, key, CACHE, || {
            let (key_lo, q_end) = bounds(s, doc_start)?;
            Ok(DocMask {
                key_lo: gpu.upload(&key_lo)?,
                q_end: gpu.upload(&q_end)?,
            })
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(
        batch: usize,
        q_len: usize,
        kv_len: usize,
        q_start: usize,
        k_start: usize,
    ) -> AttnShape {
        AttnShape {
            q_len,
            kv_len,
            q_start,
            k_start,
            ..AttnShape::causal(batch, q_len, 2, 1, 16)
        }
    }

    /// Both arrays give exactly the CPU kernel's visible pairs (`doc_start[i] ≤ k_start + j ≤
    /// q_start + i`), for blocks at offsets (context parallelism's calls), keys before and after
    /// the queries, documents of one token, and starts before, inside and past the key block.
    #[test]
    fn bounds_are_the_cpu_kernels_mask() {
        let cases: &[(usize, usize, usize, usize, &[usize])] = &[
            // (q_len, kv_len, q_start, k_start, document openings)
            (9, 9, 0, 0, &[0, 3, 4, 7]),
            (8, 8, 8, 0, &[0, 5, 11, 12, 15]),
            (8, 8, 8, 8, &[0, 9, 10, 14]),
            (6, 10, 20, 4, &[0, 7, 16, 21, 24]),
            (5, 7, 0, 0, &[0]),
            (4, 6, 3, 10, &[0, 2, 5]),
            (0, 5, 0, 0, &[0]),
        ];
        for &(q_len, kv_len, q_start, k_start, opens) in cases {
            let s = shape(2, q_len, kv_len, q_start, k_start);
            let start_of = |p: usize| opens.iter().copied().filter(|&o| o <= p).max().unwrap();
            // Row 1: every position its own document from the first query on.
            let doc_start: Vec<usize> = (0..q_len)
                .map(|i| start_of(q_start + i))
                .chain((0..q_len).map(|i| q_start + i))
                .collect();
            let (key_lo, q_end) = bounds(&s, &doc_start).unwrap();
            assert_eq!((key_lo.len(), q_end.len()), (2 * q_len, 2 * kv_len));
            for b in 0..2 {
                for i in 0..q_len {
                    for j in 0..kv_len {
                        let causal = k_start + j <= q_start + i;
                        let cpu = doc_start[b * q_len + i] <= k_start + j && causal;
                        let by_query = key_lo[b * q_len + i] as usize <= j && causal;
                        let by_key = i < q_end[b * kv_len + j] as usize && causal;
                        let at = format!("{s:?} opens {opens:?} b {b} i {i} j {j}");
                        assert_eq!(by_query, cpu, "key_lo: {at}");
                        assert_eq!(by_key, cpu, "q_end: {at}");
                    }
                }
            }
        }
    }

    #[test]
    fn decreasing_starts_wrong_lengths_and_non_causal_shapes_are_errors() {
        let s = shape(1, 4, 4, 0, 0);
        let e = bounds(&s, &[0, 2, 1, 3]).unwrap_err().to_string();
        assert!(
            e.contains("query 2 starts its document at 1, before query 1's (2)"),
            "{e}"
        );
        let e = bounds(&s, &[0, 0, 0]).unwrap_err().to_string();
        assert!(e.contains("3 document starts for 1 × 4 queries"), "{e}");
        let e = bounds(&AttnShape { causal: false, ..s }, &[0; 4])
            .unwrap_err()
            .to_string();
        assert!(e.contains("needs causal attention"), "{e}");
    }
}
