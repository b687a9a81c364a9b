//! Deterministic parameter initialisation with a small self-contained RNG (SplitMix64 +
//! Box–Muller): matrices ~ N(0, initializer_range²) as Hugging Face does, norm gains = 1.
//! Each tensor draws from its own stream (seeded by the global seed and the tensor's index),
//! so any subset of tensors can be initialised independently with identical values; and since
//! SplitMix64's state advances by a constant per draw, any element range of a tensor can be
//! generated without the elements before it ([`init_range`], what a ZeRO-3 rank uses to build
//! only its shard).

use std::ops::Range;

use rayon::prelude::*;

use crate::layout::{ParamKind, ParamLayout};

/// Elements of a matrix one task initialises.
const INIT_CHUNK: usize = 1 << 16;

/// SplitMix64 (Steele, Lea, Flood 2014): a tiny, fast, well-mixed 64-bit generator.
#[derive(Debug, Clone)]
pub struct SplitMix64(u64);

/// SplitMix64's increment (the golden-ratio "gamma").
const GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;

impl SplitMix64 {
    pub fn new(seed: u64) -> Self {
        SplitMix64(seed)
    }
    /// Skips `n` draws of [`Self::next_u64`] in O(1): the state after `n` draws is
    /// `seed + n·gamma (mod 2^64)`, the output a pure function of the state.
    pub fn advance(&mut self, n: u64) {
        self.0 = self.0.wrapping_add(n.wrapping_mul(GAMMA));
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(GAMMA);
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
    init_range(layout, std, seed, 0..layout.total(), params);
}

/// Fill `out` (length `range.len()`) with elements `range` of the flat initial parameters for
/// `seed`, bit for bit equal to the same slice of [`init_params`]' buffer, without building
/// that buffer. Element `k` of a matrix uses draws `2k` and `2k+1` of its tensor's stream
/// (one Box–Muller normal each), so the stream is advanced by `2·k0` to start at element `k0`.
pub fn init_range(layout: &ParamLayout, std: f32, seed: u64, range: Range<usize>, out: &mut [f32]) {
    assert_eq!(out.len(), range.len(), "output length");
    assert!(
        range.end <= layout.total(),
        "range {range:?} beyond {}",
        layout.total()
    );
    for (i, e) in layout.entries.iter().enumerate() {
        let r = e.view.range();
        let (s, t) = (r.start.max(range.start), r.end.min(range.end));
        if s >= t {
            continue;
        }
        let dst = &mut out[s - range.start..t - range.start];
        match e.kind {
            ParamKind::NormGain => dst.fill(1.0),
            ParamKind::Matrix => {
                let stream = seed ^ (i as u64 + 1).wrapping_mul(0xD6E8_FEB8_6659_FD93);
                // Chunks in parallel, each starting its stream where its first element's
                // draws are (the same values as one sequential pass): a 7B model's 6.7 G
                // normals took minutes on one core. On the budget pool, as every kernel.
                tensor::threads::install(|| {
                    dst.par_chunks_mut(INIT_CHUNK)
                        .enumerate()
                        .for_each(|(c, chunk)| {
                            let mut rng = SplitMix64::new(stream);
                            rng.advance(2 * (s - r.start + c * INIT_CHUNK) as u64);
                            for v in chunk {
                                *v = (rng.next_normal() * std as f64) as f32;
                            }
                        })
                });
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

    #[test]
    fn advance_skips_draws() {
        let mut a = SplitMix64::new(11);
        for _ in 0..37 {
            a.next_u64();
        }
        let mut b = SplitMix64::new(11);
        b.advance(37);
        assert_eq!(a.next_u64(), b.next_u64());
    }

    #[test]
    fn any_range_equals_the_full_init_bit_for_bit() {
        let cfg = crate::ModelConfig::llama(50, 16, 24, 2, 4, 2).with_experts(3, 2);
        let layout = ParamLayout::new(&cfg);
        let n = layout.total();
        let mut full = vec![0.0f32; n];
        init_params(&layout, 0.02, 99, &mut full);
        let mut rng = SplitMix64::new(5);
        // Ranges inside one tensor, across tensor boundaries, empty, and the whole buffer.
        let mut ranges = vec![0..n, 0..0, n - 1..n, 3..3 + 16];
        for _ in 0..50 {
            let a = (rng.next_u64() % n as u64) as usize;
            let b = (rng.next_u64() % n as u64) as usize;
            ranges.push(a.min(b)..a.max(b));
        }
        for r in ranges {
            let mut part = vec![f32::NAN; r.len()];
            init_range(&layout, 0.02, 99, r.clone(), &mut part);
            let same = part
                .iter()
                .zip(&full[r.clone()])
                .all(|(x, y)| x.to_bits() == y.to_bits());
            assert!(same, "range {r:?} differs from the full init");
        }
    }

    /// A matrix of several parallel chunks (and a range starting inside one) holds exactly
    /// the values of one sequential pass over its stream.
    #[test]
    fn parallel_chunks_draw_the_sequential_stream() {
        let cfg = crate::ModelConfig::llama(1000, 200, 256, 1, 4, 2);
        let layout = ParamLayout::new(&cfg);
        let (i, e) = layout
            .entries
            .iter()
            .enumerate()
            .find(|(_, e)| e.view.numel() > 2 * INIT_CHUNK + 1)
            .expect("a matrix of more than two chunks");
        let r = e.view.range();
        let mut rng = SplitMix64::new(99 ^ (i as u64 + 1).wrapping_mul(0xD6E8_FEB8_6659_FD93));
        let want: Vec<f32> = r
            .clone()
            .map(|_| (rng.next_normal() * 0.02f32 as f64) as f32)
            .collect();
        let skip = INIT_CHUNK / 2 + 3;
        let mut got = vec![f32::NAN; r.len() - skip];
        init_range(&layout, 0.02, 99, r.start + skip..r.end, &mut got);
        assert!(
            got.iter()
                .zip(&want[skip..])
                .all(|(x, y)| x.to_bits() == y.to_bits()),
            "parallel chunks differ from the sequential stream"
        );
    }
}
