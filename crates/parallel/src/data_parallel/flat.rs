//! Flat parameter and gradient buffers in the compute precision of a data-parallel run: fp32,
//! or bf16 storage with fp32 arithmetic (the conversions are `train::precision::Half`'s, the
//! single-process trainer's, so both round the same way).
//!
//! The model's kernels compute in fp32, so a bf16 buffer is read one unit at a time into an
//! fp32 copy ([`Flat::read`]) and gradients are accumulated through an fp32 copy that is
//! rounded back once per unit and micro-batch ([`Flat::update`]), exactly as
//! `train::precision`'s part-by-part driver does. An fp32 buffer is used in place.
use std::ops::Range;

use half::bf16;
use train::precision::{Half, CHUNK};

use crate::memory::Precision;

/// A flat buffer of parameters or gradients.
#[derive(Clone, Debug, PartialEq)]
pub enum Flat {
    F32(Vec<f32>),
    /// bf16 bit patterns.
    Bf16(Vec<u16>),
}

const BF16: Half = Half::Bf16;

impl Flat {
    /// `n` zeros in the compute precision of `precision`.
    pub fn zeros(n: usize, precision: Precision) -> Self {
        match precision {
            Precision::Fp32 => Flat::F32(vec![0.0; n]),
            Precision::Bf16Mixed => Flat::Bf16(vec![0; n]),
        }
    }

    /// `values` rounded to the compute precision of `precision`.
    pub fn from_f32(values: Vec<f32>, precision: Precision) -> Self {
        match precision {
            Precision::Fp32 => Flat::F32(values),
            Precision::Bf16Mixed => {
                let mut b = vec![0; values.len()];
                BF16.downcast(&values, &mut b);
                Flat::Bf16(b)
            }
        }
    }

    pub fn len(&self) -> usize {
        match self {
            Flat::F32(v) => v.len(),
            Flat::Bf16(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        match self {
            Flat::F32(v) => std::mem::size_of_val(v.as_slice()),
            Flat::Bf16(v) => std::mem::size_of_val(v.as_slice()),
        }
    }

    /// The fp32 buffer itself (`None` for bf16, which must be read through a copy).
    pub fn as_f32(&self) -> Option<&[f32]> {
        match self {
            Flat::F32(v) => Some(v),
            Flat::Bf16(_) => None,
        }
    }

    /// Elements `r` as fp32 (a copy).
    pub fn read(&self, r: Range<usize>) -> Vec<f32> {
        match self {
            Flat::F32(v) => v[r].to_vec(),
            Flat::Bf16(v) => {
                let mut out = vec![0.0; r.len()];
                BF16.upcast(&v[r], &mut out);
                out
            }
        }
    }

    /// Elements `r` as fp32 into `out`.
    pub fn read_into(&self, r: Range<usize>, out: &mut [f32]) {
        match self {
            Flat::F32(v) => out.copy_from_slice(&v[r]),
            Flat::Bf16(v) => BF16.upcast(&v[r], out),
        }
    }

    /// Stores `src` (rounded to bf16 for a bf16 buffer) at `start..`.
    pub fn write(&mut self, start: usize, src: &[f32]) {
        let r = start..start + src.len();
        match self {
            Flat::F32(v) => v[r].copy_from_slice(src),
            Flat::Bf16(v) => BF16.downcast(src, &mut v[r]),
        }
    }

    /// Runs `f` on elements `r` as fp32: in place for fp32; for bf16 through an fp32 copy that
    /// is rounded back afterwards (one rounding per call).
    pub fn update<T>(&mut self, r: Range<usize>, f: impl FnOnce(&mut [f32]) -> T) -> T {
        match self {
            Flat::F32(v) => f(&mut v[r]),
            Flat::Bf16(v) => {
                let mut g = vec![0.0; r.len()];
                BF16.upcast(&v[r.clone()], &mut g);
                let out = f(&mut g);
                BF16.downcast(&g, &mut v[r]);
                out
            }
        }
    }

    pub fn fill_zero(&mut self) {
        match self {
            Flat::F32(v) => v.fill(0.0),
            Flat::Bf16(v) => v.fill(0),
        }
    }

    /// Σ x² over elements `r` in f64 (chunked, in a fixed order).
    pub fn sq_sum(&self, r: Range<usize>) -> f64 {
        match self {
            Flat::F32(v) => model::optim::grad_sq_sum(&v[r]),
            Flat::Bf16(v) => {
                let mut buf = vec![0.0f32; CHUNK.min(r.len())];
                let mut total = 0.0f64;
                for s in r.clone().step_by(CHUNK) {
                    let e = (s + CHUNK).min(r.end);
                    let b = &mut buf[..e - s];
                    BF16.upcast(&v[s..e], b);
                    total += b.iter().map(|&g| g as f64 * g as f64).sum::<f64>();
                }
                total
            }
        }
    }

    /// Elements `r` as a piece to send: fp32 values, or bf16 values (half the bytes).
    pub fn piece(&self, r: Range<usize>) -> Piece {
        match self {
            Flat::F32(v) => Piece::F32(v[r].to_vec()),
            Flat::Bf16(v) => Piece::Bf16(bytemuck::cast_slice::<u16, bf16>(&v[r]).to_vec()),
        }
    }
}

/// Values on the wire in the buffer's own precision.
pub enum Piece {
    F32(Vec<f32>),
    Bf16(Vec<bf16>),
}

impl Piece {
    /// As fp32 (bf16 widens exactly).
    pub fn into_f32(self) -> Vec<f32> {
        match self {
            Piece::F32(v) => v,
            Piece::Bf16(v) => {
                let mut out = vec![0.0; v.len()];
                BF16.upcast(bytemuck::cast_slice(&v), &mut out);
                out
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bf16_rounds_once_per_update_and_widens_exactly() {
        let mut f = Flat::from_f32(vec![1.0, 2.0, 3.0], Precision::Bf16Mixed);
        assert_eq!(f.bytes(), 6);
        // 1 + 2^-9 is not representable in bf16 (8 significant bits): rounds back to 1.
        f.update(0..1, |g| g[0] += 1.0 / 512.0);
        assert_eq!(f.read(0..3), vec![1.0, 2.0, 3.0]);
        f.update(0..1, |g| g[0] += 1.0 / 128.0);
        assert_eq!(f.read(0..1), vec![1.0 + 1.0 / 128.0]);
        let p = f.piece(1..3).into_f32();
        assert_eq!(p, vec![2.0, 3.0]);
        assert_eq!(f.sq_sum(1..3), 13.0);
        let mut g = Flat::zeros(2, Precision::Fp32);
        g.write(0, &[0.1, 0.2]);
        assert_eq!(g.as_f32(), Some(&[0.1f32, 0.2][..]));
    }

    #[test]
    fn bucketed_pieces_follow_addresses_whatever_the_bucket_order() {
        // Buckets in reverse address order, as gradient buckets are planned.
        let mut b = Bucketed::zeros(vec![6..10, 2..6, 0..2], Precision::Fp32);
        assert_eq!(b.bytes(), 40);
        b.update(1, 3..5, |g| g.copy_from_slice(&[3.0, 4.0]));
        b.update(0, 6..8, |g| g.copy_from_slice(&[6.0, 7.0]));
        let mut out = vec![0.0; 6];
        b.read_into(2..8, &mut out);
        assert_eq!(out, vec![0.0, 3.0, 4.0, 0.0, 6.0, 7.0]);
        assert_eq!(b.sq_sum(0..10), 9.0 + 16.0 + 36.0 + 49.0);
        let lent = b.take(1).unwrap();
        assert!(!b.has(1));
        b.put(1, lent);
        let mut seen = Vec::new();
        b.f32_pieces_mut(1..7, |s, p| seen.push((s, p.len())))
            .unwrap();
        assert_eq!(seen, vec![(1, 1), (2, 4), (6, 1)]);
    }
}

/// A flat buffer kept as one allocation per bucket (contiguous ranges that tile `0..len`), so
/// a bucket can be handed to an asynchronous collective by value and put back afterwards —
/// an in-place all-reduce of a bucket of the gradient buffer, with no copy. A single bucket
/// covering everything is an ordinary flat buffer (a ZeRO-2/3 gradient shard).
#[derive(Debug)]
pub struct Bucketed {
    /// Flat range of each bucket (any order; together they tile `0..len`).
    ranges: Vec<Range<usize>>,
    /// Bucket indices by increasing start.
    order: Vec<usize>,
    /// `None` while the bucket is lent out.
    bufs: Vec<Option<Flat>>,
    elem_bytes: usize,
}

impl Bucketed {
    /// Zeros cut into `ranges`, which must tile `0..n` for some `n`.
    pub fn zeros(ranges: Vec<Range<usize>>, precision: Precision) -> Self {
        let mut order: Vec<usize> = (0..ranges.len()).collect();
        order.sort_by_key(|&b| ranges[b].start);
        let mut next = 0;
        for &b in &order {
            assert_eq!(ranges[b].start, next, "buckets must tile the buffer");
            next = ranges[b].end;
        }
        let bufs = ranges
            .iter()
            .map(|r| Some(Flat::zeros(r.len(), precision)))
            .collect();
        let elem_bytes = Flat::zeros(1, precision).bytes();
        Self {
            ranges,
            order,
            bufs,
            elem_bytes,
        }
    }

    /// Bytes of the whole buffer (lent buckets included).
    pub fn bytes(&self) -> usize {
        self.ranges.iter().map(|r| r.len()).sum::<usize>() * self.elem_bytes
    }

    fn buf(&self, b: usize) -> &Flat {
        self.bufs[b].as_ref().expect("bucket is not lent out")
    }

    fn buf_mut(&mut self, b: usize) -> &mut Flat {
        self.bufs[b].as_mut().expect("bucket is not lent out")
    }

    /// The buckets' pieces of flat range `r`, in address order: (bucket, range inside it).
    fn pieces(&self, r: Range<usize>) -> Vec<(usize, Range<usize>)> {
        self.order
            .iter()
            .filter_map(|&b| {
                let br = &self.ranges[b];
                let (s, e) = (r.start.max(br.start), r.end.min(br.end));
                (s < e).then(|| (b, s - br.start..e - br.start))
            })
            .collect()
    }

    pub fn fill_zero(&mut self) {
        self.bufs
            .iter_mut()
            .for_each(|b| b.as_mut().expect("bucket is not lent out").fill_zero());
    }

    /// [`Flat::update`] of range `r`, which must lie inside bucket `b`.
    pub fn update<T>(&mut self, b: usize, r: Range<usize>, f: impl FnOnce(&mut [f32]) -> T) -> T {
        let start = self.ranges[b].start;
        debug_assert!(self.ranges[b].start <= r.start && r.end <= self.ranges[b].end);
        self.buf_mut(b).update(r.start - start..r.end - start, f)
    }

    /// Lends bucket `b` out (e.g. to a collective).
    pub fn take(&mut self, b: usize) -> Option<Flat> {
        self.bufs[b].take()
    }

    /// Returns bucket `b`.
    pub fn put(&mut self, b: usize, buf: Flat) {
        debug_assert_eq!(buf.len(), self.ranges[b].len());
        self.bufs[b] = Some(buf);
    }

    /// Whether bucket `b` is at home.
    pub fn has(&self, b: usize) -> bool {
        self.bufs[b].is_some()
    }

    /// Elements `r` of bucket `b` as fp32 (a copy).
    pub fn read(&self, b: usize, r: Range<usize>) -> Vec<f32> {
        let start = self.ranges[b].start;
        self.buf(b).read(r.start - start..r.end - start)
    }

    /// Stores `src` at flat offset `start` (inside bucket `b`).
    pub fn write(&mut self, b: usize, start: usize, src: &[f32]) {
        let base = self.ranges[b].start;
        self.buf_mut(b).write(start - base, src)
    }

    /// Σ x² over flat range `r` (bucket by bucket).
    pub fn sq_sum(&self, r: Range<usize>) -> f64 {
        self.pieces(r)
            .into_iter()
            .map(|(b, p)| self.buf(b).sq_sum(p))
            .sum()
    }

    /// Flat range `r` as fp32 into `out`.
    pub fn read_into(&self, r: Range<usize>, out: &mut [f32]) {
        let base = r.start;
        for (b, p) in self.pieces(r) {
            let s = self.ranges[b].start + p.start - base;
            self.buf(b).read_into(p.clone(), &mut out[s..s + p.len()]);
        }
    }

    /// Runs `f(flat offset, piece)` on the fp32 pieces of flat range `r`, in address order
    /// (`None` for bf16 storage).
    pub fn f32_pieces_mut(
        &mut self,
        r: Range<usize>,
        mut f: impl FnMut(usize, &mut [f32]),
    ) -> Option<()> {
        for (b, p) in self.pieces(r) {
            let start = self.ranges[b].start + p.start;
            match self.buf_mut(b) {
                Flat::F32(v) => f(start, &mut v[p]),
                Flat::Bf16(_) => return None,
            }
        }
        Some(())
    }

    /// Whether the buffers hold fp32.
    pub fn is_f32(&self) -> bool {
        self.elem_bytes == 4
    }
}
