//! How data parallelism's gradient reductions travel (`train.grad_comm`): in fp32 (exact
//! sums, the default), or compressed — bf16 or fp8 (E4M3 with a per-piece scale) on the wire,
//! summed in fp32 where they arrive ([`comm::compress`]): half and a quarter of the bytes, at
//! the price of one rounding of every rank's gradient and one of the sum. The bucket
//! all-reduces (DDP, ZeRO-1) and the per-shard reductions (ZeRO-2/3) both use it.
use comm::compress::Codec;

/// The wire format of gradient reductions.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum GradComm {
    #[default]
    Fp32,
    Bf16,
    Fp8,
}

impl GradComm {
    /// `fp32`, `bf16` or `fp8`.
    pub fn parse(s: &str) -> Result<Self, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "fp32" | "f32" => Ok(GradComm::Fp32),
            "bf16" => Ok(GradComm::Bf16),
            "fp8" | "e4m3" => Ok(GradComm::Fp8),
            other => Err(format!(
                "train.grad_comm = `{other}`: expected fp32, bf16 or fp8"
            )),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            GradComm::Fp32 => "fp32",
            GradComm::Bf16 => "bf16",
            GradComm::Fp8 => "fp8",
        }
    }

    /// The codec of a compressed reduction (`None`: fp32, exact).
    pub fn codec(self) -> Option<Codec> {
        match self {
            GradComm::Fp32 => None,
            GradComm::Bf16 => Some(Codec::Bf16),
            GradComm::Fp8 => Some(Codec::Fp8),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_three_formats_and_refuses_others() {
        for (s, g) in [
            ("fp32", GradComm::Fp32),
            ("BF16", GradComm::Bf16),
            ("fp8", GradComm::Fp8),
        ] {
            assert_eq!(GradComm::parse(s).unwrap(), g);
            assert_eq!(GradComm::parse(g.name()).unwrap(), g);
        }
        assert!(GradComm::parse("int4")
            .unwrap_err()
            .contains("expected fp32, bf16 or fp8"));
    }
}
