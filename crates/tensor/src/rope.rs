//! Rotary position embedding, Hugging Face "rotate-half" layout (Llama/Mixtral).
//!
//! For a head vector `x` of size `d` with halves `x₁ = x[..d/2]`, `x₂ = x[d/2..]` and
//! angle `a_i = pos · inv_freq_i`, `inv_freq_i = theta^(−2i/d)`:
//! `out₁ = x₁ cos a − x₂ sin a`, `out₂ = x₂ cos a + x₁ sin a`.
//! The map is a rotation, so its backward (the transpose) is the rotation by `−a`.
//!
//! Angles are computed in f32 exactly as transformers does (`inv_freq` in f32, `pos·inv_freq`
//! rounded to f32, then `cos`/`sin`), so results match Hugging Face references bit-closely.
//! Positions are given per token, so offsets (pipeline/context-parallel chunks, zigzag
//! layouts) are just different position lists.
//!
//! Llama 3's frequency scaling ([`Llama3Scaling`], `rope_scaling = {rope_type = "llama3"}`)
//! rewrites `inv_freq` once; everything else is unchanged.

use crate::error::check_len;
use crate::microkernel::rotate_half;
use crate::threads;
use crate::TensorError;
use rayon::prelude::*;

/// Llama 3's RoPE frequency scaling (Hugging Face `rope_scaling` with `rope_type = "llama3"`;
/// Llama 3.1 / 3.2 use factor 8 or 32, low 1, high 4, original length 8192).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Llama3Scaling {
    pub factor: f32,
    pub low_freq_factor: f32,
    pub high_freq_factor: f32,
    pub original_max_position_embeddings: usize,
}

impl Llama3Scaling {
    fn check(&self) -> Result<(), TensorError> {
        let ok = self.factor > 0.0
            && self.factor.is_finite()
            && self.low_freq_factor > 0.0
            && self.high_freq_factor > self.low_freq_factor
            && self.high_freq_factor.is_finite()
            && self.original_max_position_embeddings > 0;
        if ok {
            Ok(())
        } else {
            Err(TensorError::Shape(format!(
                "llama3 rope scaling needs factor > 0, 0 < low_freq_factor < high_freq_factor and original_max_position_embeddings > 0, got {self:?}"
            )))
        }
    }
}

/// Precomputed inverse frequencies for one head size.
#[derive(Debug, Clone)]
pub struct Rope {
    head_dim: usize,
    inv_freq: Vec<f32>,
}

impl Rope {
    /// `head_dim` must be even and positive; `theta` is the RoPE base (e.g. 10000 or 500000).
    pub fn new(head_dim: usize, theta: f32) -> Result<Rope, TensorError> {
        if head_dim == 0 || !head_dim.is_multiple_of(2) {
            return Err(TensorError::Shape(format!(
                "rope head_dim must be even and positive, got {head_dim}"
            )));
        }
        if theta.is_nan() || theta <= 0.0 {
            return Err(TensorError::Shape(format!(
                "rope theta must be > 0, got {theta}"
            )));
        }
        // transformers: 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim))
        let inv_freq = (0..head_dim / 2)
            .map(|i| 1.0 / theta.powf((2 * i) as f32 / head_dim as f32))
            .collect();
        Ok(Rope { head_dim, inv_freq })
    }

    /// The same rotation with Llama 3's frequency scaling: long wavelengths slowed by
    /// `factor`, short ones kept, the band between interpolated (transformers'
    /// `_compute_llama3_parameters`, in the same f32 operations and order). With `λ_i = 2π /
    /// inv_freq_i`, `L = original_max_position_embeddings`:
    /// `λ_i < L / high_freq_factor`: unchanged; `λ_i > L / low_freq_factor`: `inv_freq_i /
    /// factor`; between: `(1 − s)·inv_freq_i/factor + s·inv_freq_i` with
    /// `s = (L/λ_i − low_freq_factor) / (high_freq_factor − low_freq_factor)`.
    pub fn with_llama3(mut self, s: &Llama3Scaling) -> Result<Rope, TensorError> {
        s.check()?;
        let l = s.original_max_position_embeddings as f32;
        let wavelen_at =
            |factor: f32| (s.original_max_position_embeddings as f64 / factor as f64) as f32;
        let (low_wavelen, high_wavelen) = (
            wavelen_at(s.low_freq_factor),
            wavelen_at(s.high_freq_factor),
        );
        // `scalar / tensor` is `tensor.reciprocal() * scalar` in PyTorch: the same here.
        let two_pi = (2.0 * std::f64::consts::PI) as f32;
        for f in &mut self.inv_freq {
            let wavelen = (1.0 / *f) * two_pi;
            let scaled = if wavelen > low_wavelen {
                *f / s.factor
            } else {
                *f
            };
            if (high_wavelen..=low_wavelen).contains(&wavelen) {
                let smooth = ((1.0 / wavelen) * l - s.low_freq_factor)
                    / (s.high_freq_factor - s.low_freq_factor);
                *f = (1.0 - smooth) * scaled / s.factor + smooth * scaled;
            } else {
                *f = scaled;
            }
        }
        Ok(self)
    }

    pub fn head_dim(&self) -> usize {
        self.head_dim
    }

    /// `theta^(−2i/d)` for `i < d/2`.
    pub fn inv_freq(&self) -> &[f32] {
        &self.inv_freq
    }

    /// Rotates `x` (`[n_tokens, n_heads, head_dim]`, token `t` at position `positions[t]`)
    /// in place.
    pub fn apply(
        &self,
        x: &mut [f32],
        n_heads: usize,
        positions: &[usize],
    ) -> Result<(), TensorError> {
        self.rotate(x, n_heads, positions, 1.0)
    }

    /// Backward of [`Rope::apply`]: rotates the gradient by `−a`, in place.
    pub fn apply_backward(
        &self,
        dx: &mut [f32],
        n_heads: usize,
        positions: &[usize],
    ) -> Result<(), TensorError> {
        self.rotate(dx, n_heads, positions, -1.0)
    }

    fn rotate(
        &self,
        x: &mut [f32],
        n_heads: usize,
        positions: &[usize],
        sign: f32,
    ) -> Result<(), TensorError> {
        let d = self.head_dim;
        let half = d / 2;
        check_len("rope x", x.len(), positions.len() * n_heads * d)?;
        if x.is_empty() {
            return Ok(());
        }
        // cos/sin per distinct position (a batch repeats the same positions for each
        // sequence), computed once per call with the same formula, so results are unchanged.
        let mut uniq = positions.to_vec();
        uniq.sort_unstable();
        uniq.dedup();
        let mut table = vec![0.0f32; uniq.len() * d];
        threads::install(|| {
            table
                .par_chunks_mut(d)
                .zip(uniq.par_iter())
                .with_min_len(16)
                .for_each(|(cs, &pos)| {
                    let (cos, sin) = cs.split_at_mut(half);
                    for i in 0..half {
                        let a = pos as f32 * self.inv_freq[i];
                        cos[i] = a.cos();
                        sin[i] = sign * a.sin();
                    }
                });
            x.par_chunks_mut(n_heads * d)
                .zip(positions.par_iter())
                .with_min_len(4)
                .for_each(|(tok, pos)| {
                    let row = uniq.binary_search(pos).expect("position is in the table");
                    let (cos, sin) = table[row * d..(row + 1) * d].split_at(half);
                    for h in tok.chunks_mut(d) {
                        rotate_half(h, cos, sin);
                    }
                });
        });
        Ok(())
    }
}

/// Positions `[offset, offset + seq)` repeated for each of `batch` sequences, laid out
/// `[batch, seq]` (the usual token order).
pub fn positions_range(batch: usize, seq: usize, offset: usize) -> Vec<usize> {
    (0..batch).flat_map(|_| offset..offset + seq).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::rand_vec;

    /// Llama 3.1's scaling (d 128, θ 5e5, factor 8, low 1, high 4, L 8192) against the
    /// formula in f64: all three bands occur, and only the f32 roundings differ.
    #[test]
    fn llama3_scaling_follows_the_three_bands() {
        let s = Llama3Scaling {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192,
        };
        let plain = Rope::new(128, 5e5).unwrap();
        let scaled = plain.clone().with_llama3(&s).unwrap();
        let mut bands = [0; 3];
        for (i, (&p, &q)) in plain.inv_freq().iter().zip(scaled.inv_freq()).enumerate() {
            let f = 5e5f64.powf(-(2.0 * i as f64) / 128.0);
            let wavelen = 2.0 * std::f64::consts::PI / f;
            let want = if wavelen < 8192.0 / 4.0 {
                bands[0] += 1;
                f
            } else if wavelen > 8192.0 {
                bands[2] += 1;
                f / 8.0
            } else {
                bands[1] += 1;
                let sm = (8192.0 / wavelen - 1.0) / 3.0;
                (1.0 - sm) * f / 8.0 + sm * f
            };
            assert!((q as f64 - want).abs() <= 1e-6 * want, "{i}: {q} vs {want}");
            assert!((p as f64 - f).abs() <= 1e-6 * f);
        }
        assert!(bands.iter().all(|&n| n > 0), "{bands:?}");
    }

    #[test]
    fn matches_direct_formula_and_inverts() {
        let (batch, seq, heads, d) = (2, 5, 3, 8);
        let rope = Rope::new(d, 10000.0).unwrap();
        let pos = positions_range(batch, seq, 7);
        assert_eq!(pos[5], 7);
        let x = rand_vec(batch * seq * heads * d, 3);
        let mut y = x.clone();
        rope.apply(&mut y, heads, &pos).unwrap();
        for (t, &p) in pos.iter().enumerate() {
            for h in 0..heads {
                let base = (t * heads + h) * d;
                for i in 0..d / 2 {
                    // Direct formula in f64.
                    let a = p as f64 * 10000f64.powf(-(2.0 * i as f64) / d as f64);
                    let (x1, x2) = (x[base + i] as f64, x[base + i + d / 2] as f64);
                    let o1 = x1 * a.cos() - x2 * a.sin();
                    let o2 = x2 * a.cos() + x1 * a.sin();
                    // f32 angle pos·inv_freq has relative error ~6e-8, i.e. ~1e-6 rad here.
                    assert!((y[base + i] as f64 - o1).abs() < 1e-5, "{t} {h} {i}");
                    assert!((y[base + i + d / 2] as f64 - o2).abs() < 1e-5);
                }
            }
        }
        // Backward is the transpose of the rotation: <R x, g> == <x, Rᵀ g>.
        let g = rand_vec(x.len(), 4);
        let mut rtg = g.clone();
        rope.apply_backward(&mut rtg, heads, &pos).unwrap();
        let lhs: f64 = y.iter().zip(&g).map(|(a, b)| *a as f64 * *b as f64).sum();
        let rhs: f64 = x.iter().zip(&rtg).map(|(a, b)| *a as f64 * *b as f64).sum();
        assert!((lhs - rhs).abs() < 1e-4, "{lhs} {rhs}");
        // And it inverts the forward.
        rope.apply_backward(&mut y, heads, &pos).unwrap();
        assert!(crate::tensor::max_abs_diff(&x, &y) < 1e-6);
        // Arbitrary (unsorted, repeated, sparse) positions: each token rotated as if alone.
        let odd = [9usize, 3, 1000, 3, 0, 9, 41, 7, 2, 5];
        let mut z = x.clone();
        rope.apply(&mut z, heads, &odd).unwrap();
        for (t, &p) in odd.iter().enumerate() {
            let mut one = x[t * heads * d..(t + 1) * heads * d].to_vec();
            rope.apply(&mut one, heads, &[p]).unwrap();
            assert_eq!(one, z[t * heads * d..(t + 1) * heads * d]);
        }
        assert!(Rope::new(7, 1e4).is_err());
        let bad = Llama3Scaling {
            factor: 8.0,
            low_freq_factor: 4.0,
            high_freq_factor: 1.0,
            original_max_position_embeddings: 8192,
        };
        assert!(Rope::new(64, 5e5).unwrap().with_llama3(&bad).is_err());
        assert!(rope.apply(&mut y[1..], heads, &pos).is_err());
    }
}
