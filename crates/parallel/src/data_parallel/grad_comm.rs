//! How data parallelism's gradient reductions travel (`train.grad_comm`): in fp32 (exact
//! sums, the default), or compressed — bf16 or fp8 (E4M3 with a per-piece scale) on the wire,
//! summed in fp32 where they arrive ([`comm::compress`]): half and a quarter of the bytes, at
//! the price of one rounding of every rank's gradient and one of the sum (the bucket
//! all-reduces of DDP and ZeRO-1 and the per-shard reductions of ZeRO-2/3); or PowerSGD of
//! rank R ([`super::powersgd`], DDP and ZeRO-1: it compresses whole buckets).
use comm::compress::Codec;

/// The wire format of gradient reductions.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum GradComm {
    #[default]
    Fp32,
    Bf16,
    Fp8,
    /// PowerSGD with matrices of rank at most `rank`, from optimizer step `start` on (exact
    /// fp32 reductions before it: PyTorch's `start_powerSGD_iter`, since the first steps'
    /// large, fast-changing gradients suffer most from a low rank and a stale warm start).
    PowerSgd {
        rank: usize,
        start: u64,
    },
}

impl GradComm {
    /// `fp32`, `bf16`, `fp8`, or `powersgd:R` (R ≥ 1) optionally `:S` (start at step S;
    /// without it at `default_start`: the trainer passes the learning-rate warmup, as PyTorch
    /// advises for `start_powerSGD_iter`).
    pub fn parse(s: &str, default_start: u64) -> Result<Self, String> {
        let s = s.trim().to_ascii_lowercase();
        let bad =
            || format!("train.grad_comm = `{s}`: expected fp32, bf16, fp8 or powersgd:R (R ≥ 1)");
        match s.as_str() {
            "fp32" | "f32" => Ok(GradComm::Fp32),
            "bf16" => Ok(GradComm::Bf16),
            "fp8" | "e4m3" => Ok(GradComm::Fp8),
            other => {
                let mut it = other.strip_prefix("powersgd:").ok_or_else(bad)?.split(':');
                let rank = it.next().and_then(|r| r.parse::<usize>().ok());
                let start = it
                    .next()
                    .map_or(Some(default_start), |s| s.parse::<u64>().ok());
                match (rank, start, it.next()) {
                    (Some(rank), Some(start), None) if rank >= 1 => {
                        Ok(GradComm::PowerSgd { rank, start })
                    }
                    _ => Err(bad()),
                }
            }
        }
    }

    pub fn name(self) -> String {
        match self {
            GradComm::Fp32 => "fp32".into(),
            GradComm::Bf16 => "bf16".into(),
            GradComm::Fp8 => "fp8".into(),
            GradComm::PowerSgd { rank, start } => format!("powersgd:{rank}:{start}"),
        }
    }

    /// The codec of a compressed reduction (`None`: fp32, exact).
    pub fn codec(self) -> Option<Codec> {
        match self {
            GradComm::Fp32 => None,
            GradComm::Bf16 => Some(Codec::Bf16),
            GradComm::Fp8 => Some(Codec::Fp8),
            GradComm::PowerSgd { .. } => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_formats_and_refuses_others() {
        for (s, g) in [
            ("fp32", GradComm::Fp32),
            ("BF16", GradComm::Bf16),
            ("fp8", GradComm::Fp8),
            ("powersgd:4", GradComm::PowerSgd { rank: 4, start: 7 }),
            (
                "powersgd:2:100",
                GradComm::PowerSgd {
                    rank: 2,
                    start: 100,
                },
            ),
        ] {
            assert_eq!(GradComm::parse(s, 7).unwrap(), g);
            assert_eq!(GradComm::parse(&g.name(), 0).unwrap(), g);
        }
        for bad in [
            "int4",
            "powersgd:0",
            "powersgd:",
            "powersgd:x",
            "powersgd:2:x",
            "powersgd:2:3:4",
        ] {
            assert!(
                GradComm::parse(bad, 0).unwrap_err().contains("powersgd:R"),
                "{bad}"
            );
        }
    }
}
