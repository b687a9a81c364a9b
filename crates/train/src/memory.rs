//! Memory accounting: the bytes a training step holds, by category, so the printed figure can
//! be checked against the textbook formulas (ZeRO paper, §3.1, Φ = parameter count):
//!
//! - fp32 AdamW: 4Φ weights + 4Φ gradients + 4Φ m + 4Φ v = **16Φ**;
//! - bf16/fp16 mixed: 2Φ half weights + 2Φ half gradients + 4Φ fp32 master + 4Φ m + 4Φ v
//!   = 2Φ + 2Φ + **12Φ** = 16Φ as well (the saving is in activations, which are half width).
//!
//! Activations are counted from what the model's forward caches keep for backward.
use crate::config::Precision;
use serde::Serialize;

/// Bytes held per category.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct MemoryAccount {
    /// Working (compute) weights: fp32 or half precision.
    pub params: u64,
    /// Gradients in the working precision.
    pub grads: u64,
    /// fp32 master weights (mixed precision only).
    pub master: u64,
    /// AdamW first and second moments (fp32).
    pub optimizer: u64,
    /// Activations kept for backward over one micro-batch (peak).
    pub activations: u64,
}

impl MemoryAccount {
    /// The state bytes for `phi` parameters in `precision`; activations set separately.
    pub fn for_state(phi: u64, precision: Precision) -> Self {
        match precision {
            Precision::Fp32 => Self {
                params: 4 * phi,
                grads: 4 * phi,
                master: 0,
                optimizer: 8 * phi,
                activations: 0,
            },
            Precision::Bf16 | Precision::Fp16 => Self {
                params: 2 * phi,
                grads: 2 * phi,
                master: 4 * phi,
                optimizer: 8 * phi,
                activations: 0,
            },
        }
    }

    /// Parameters + gradients + master + optimizer state.
    pub fn state(&self) -> u64 {
        self.params + self.grads + self.master + self.optimizer
    }

    pub fn total(&self) -> u64 {
        self.state() + self.activations
    }

    /// One line for logs.
    pub fn summary(&self) -> String {
        format!(
            "params {} + grads {} + master {} + adam m,v {} + activations {} = {}",
            human(self.params),
            human(self.grads),
            human(self.master),
            human(self.optimizer),
            human(self.activations),
            human(self.total())
        )
    }
}

/// Bytes in binary units.
pub fn human(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = bytes as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{bytes} B")
    } else {
        format!("{v:.2} {}", UNITS[u])
    }
}

/// Peak resident set size of this process (VmHWM from /proc/self/status), if available.
pub fn peak_rss_bytes() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = s.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formulas() {
        let phi = 1000;
        let f = MemoryAccount::for_state(phi, Precision::Fp32);
        assert_eq!(f.state(), 16 * phi);
        let b = MemoryAccount::for_state(phi, Precision::Bf16);
        assert_eq!(
            (b.params, b.grads, b.master + b.optimizer),
            (2 * phi, 2 * phi, 12 * phi)
        );
        assert_eq!(human(1536), "1.50 KiB");
    }
}
