//! A small deterministic random number generator whose whole state is one `u64`, so it can be
//! saved in a checkpoint and restored bit for bit (SplitMix64, Steele et al. 2014).
use serde::{Deserialize, Serialize};

/// SplitMix64: `state += 0x9E3779B97F4A7C15`, then a 64-bit finaliser. Passes BigCrush and is
/// trivially seekable, which is all sampling and data generation need.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Rng {
    pub state: u64,
}

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self { state: seed }
    }

    /// A generator for an independent stream `(seed, stream)`, e.g. one per sample index.
    pub fn stream(seed: u64, stream: u64) -> Self {
        Self {
            state: mix(seed ^ mix(stream.wrapping_add(0x5851_F42D_4C95_7F2D))),
        }
    }

    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        mix(self.state)
    }

    /// Uniform in `0..n` (n > 0); the modulo bias is < n / 2^64, irrelevant here.
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }

    /// Uniform in `[0, 1)` with 53 random bits.
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// Picks one element of a non-empty slice.
    pub fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len() as u64) as usize]
    }
}

fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deterministic_and_resumable() {
        let mut a = Rng::new(7);
        let first: Vec<u64> = (0..5).map(|_| a.next_u64()).collect();
        let saved = a;
        let next = a.next_u64();
        let mut b = Rng::new(7);
        assert_eq!(first, (0..5).map(|_| b.next_u64()).collect::<Vec<_>>());
        let mut c = saved;
        assert_eq!(c.next_u64(), next);
        assert_ne!(Rng::stream(1, 0).next_u64(), Rng::stream(1, 1).next_u64());
    }
}
