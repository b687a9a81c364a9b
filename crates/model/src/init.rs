//! Deterministic parameter initialisation with a small self-contained RNG (SplitMix64 +
//! Box–Muller): matrices ~ N(0, initializer_range²) as Hugging Face does, norm gains = 1.
//! Each tensor draws from its own stream (seeded by the global seed and the tensor's index),
//! so any subset of tensors can be initialised independently with identical values.

use crate::layout::{ParamKind, ParamLayout};

/// SplitMix64 (Steele, Lea, Flood 2014): a tiny, fast, well-mixed 64-bit generator.
#[derive(Debug, Clone)]
pub struct SplitMix64(u64);

impl SplitMix64 {
    pub fn new(seed: u64) -> Self {
        SplitMix64(seed)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in (0, 1): 53 random bits, never exactly 0 (safe for `ln`).
    pub fn next_f64(&mut self) -> f64 {
        ((self.next_u64() >> 11) as f64 + 0.5) * (1.0 / (1u64 << 53) as f64)
    }
    /// Standard normal by Box–Muller (one of the pair is used; simplicity over speed).
    pub fn next_normal(&mut self) -> f64 {
        let (u1, u2) = (self.next_f64(), self.next_f64());
        (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
    }
}

/// Fill `params` (length `layout.total()`) with the initial values for `seed`.
pub fn init_params(layout: &ParamLayout, std: f32, seed: u64, params: &mut [f32]) {
    assert_eq!(params.len(), layout.total(), "params buffer length");
    for (i, e) in layout.entries.iter().enumerate() {
        let dst = e.view.of_mut(params);
        match e.kind {
            ParamKind::NormGain => dst.fill(1.0),
            ParamKind::Matrix => {
                let mut rng =
                    SplitMix64::new(seed ^ (i as u64 + 1).wrapping_mul(0xD6E8_FEB8_6659_FD93));
                for v in dst {
                    *v = (rng.next_normal() * std as f64) as f32;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn normal_moments() {
        let mut r = SplitMix64::new(7);
        let n = 100_000;
        let xs: Vec<f64> = (0..n).map(|_| r.next_normal()).collect();
        let mean = xs.iter().sum::<f64>() / n as f64;
        let var = xs.iter().map(|x| (x - mean) * (x - mean)).sum::<f64>() / n as f64;
        assert!(mean.abs() < 0.02, "mean {mean}");
        assert!((var - 1.0).abs() < 0.02, "var {var}");
    }
}
