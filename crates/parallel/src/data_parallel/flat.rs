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
}
