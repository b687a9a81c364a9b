//! Learning-rate schedule: linear warmup then cosine decay to a floor.
//!
//! `lr(s) = peak · (s+1)/warmup` for `s < warmup`; afterwards, with progress
//! `p = (s − warmup)/(total − warmup)` clamped to [0, 1],
//! `lr(s) = min + ½ (peak − min)(1 + cos πp)` (Loshchilov & Hutter, SGDR, without restarts).
use serde::{Deserialize, Serialize};

#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct CosineSchedule {
    pub peak: f64,
    pub min: f64,
    pub warmup: usize,
    pub total: usize,
}

impl CosineSchedule {
    pub fn lr(&self, step: usize) -> f64 {
        if step < self.warmup {
            return self.peak * (step + 1) as f64 / self.warmup as f64;
        }
        let span = self.total.saturating_sub(self.warmup).max(1) as f64;
        let p = ((step - self.warmup) as f64 / span).min(1.0);
        self.min + 0.5 * (self.peak - self.min) * (1.0 + (std::f64::consts::PI * p).cos())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn warmup_peak_and_floor() {
        let s = CosineSchedule {
            peak: 1.0,
            min: 0.1,
            warmup: 10,
            total: 110,
        };
        assert!((s.lr(0) - 0.1).abs() < 1e-12);
        assert!((s.lr(9) - 1.0).abs() < 1e-12);
        assert!((s.lr(10) - 1.0).abs() < 1e-12);
        assert!((s.lr(60) - 0.55).abs() < 1e-12, "half way down the cosine");
        assert!((s.lr(110) - 0.1).abs() < 1e-12);
        assert!((s.lr(500) - 0.1).abs() < 1e-12);
        for k in 10..110 {
            assert!(s.lr(k + 1) <= s.lr(k));
        }
    }
}
