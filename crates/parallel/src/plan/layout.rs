//! One candidate layout of a training job — the degrees, the ZeRO stage, sequence
//! parallelism, the pipeline schedule, micro-batching, recomputation and optimizer offload —
//! with a compact name that prints and parses
//! (`tp8 pp2 dp4 z1 sp 1f1b mb1x64 rc=selective offload=optimizer`).
use std::fmt;
use std::str::FromStr;

use model::Recompute;
use serde::Serialize;

use crate::data_parallel::ZeroStage;
use crate::dims::ParallelDims;
use crate::pipeline_parallel::ScheduleKind;
use crate::ParallelError;

/// Where the optimizer's fp32 state lives and where its step runs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Offload {
    /// On the device: master weights and AdamW moments beside the 16-bit weights.
    #[default]
    None,
    /// ZeRO-Offload: the fp32 master weights, AdamW moments and fp32 gradients of the rank's
    /// optimizer shard in host memory, the AdamW step on the CPU; gradients stream device →
    /// host, the updated 16-bit weights host → device (16-bit training only).
    Optimizer,
    /// ZeRO-Offload with the one-step delayed update (`parallel.delayed_update_after`): the
    /// CPU's AdamW of a step runs beside the next step's forward and backward, whose
    /// gradients are taken one update late; the host holds the shard's gradients twice.
    Delayed,
}

impl Offload {
    /// The name in a layout (`offload=NAME`) and on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Offload::None => "none",
            Offload::Optimizer => "optimizer",
            Offload::Delayed => "delayed",
        }
    }

    /// Whether the optimizer runs on the host.
    pub fn on_host(self) -> bool {
        self != Offload::None
    }
}

impl FromStr for Offload {
    type Err = ParallelError;
    fn from_str(text: &str) -> Result<Self, ParallelError> {
        match text {
            "none" => Ok(Offload::None),
            "optimizer" => Ok(Offload::Optimizer),
            "delayed" => Ok(Offload::Delayed),
            other => Err(ParallelError::Config(format!(
                "offload `{other}` (expected none, optimizer or delayed)"
            ))),
        }
    }
}

/// A layout of the job.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Layout {
    pub dp: usize,
    pub tp: usize,
    pub pp: usize,
    pub cp: usize,
    pub ep: usize,
    pub zero: ZeroStage,
    pub sp: bool,
    /// The pipeline schedule (`None` without pipeline parallelism).
    pub schedule: Option<ScheduleKind>,
    /// Stages per pp rank of an interleaved schedule (1 otherwise).
    pub virtual_stages: usize,
    /// Sequences per micro-batch.
    pub micro_batch: usize,
    /// Micro-batches per step on each dp rank (gradient accumulation / pipeline depth).
    pub microbatches: usize,
    pub recompute: Recompute,
    pub offload: Offload,
}

impl Layout {
    /// One process: every degree 1, one micro-batch of `micro_batch` sequences.
    pub fn single(micro_batch: usize) -> Self {
        Layout {
            dp: 1,
            tp: 1,
            pp: 1,
            cp: 1,
            ep: 1,
            zero: ZeroStage::Ddp,
            sp: false,
            schedule: None,
            virtual_stages: 1,
            micro_batch,
            microbatches: 1,
            recompute: Recompute::None,
            offload: Offload::None,
        }
    }

    /// Devices the layout uses: `pp · dp · cp · tp`.
    pub fn world(&self) -> usize {
        self.pp * self.dp * self.cp * self.tp
    }

    /// The engine's degrees.
    pub fn dims(&self) -> ParallelDims {
        ParallelDims {
            pp: self.pp,
            dp: self.dp,
            cp: self.cp,
            tp: self.tp,
            ep: self.ep,
            zero: self.zero,
            sp: self.sp,
            virtual_stages: self.virtual_stages,
        }
    }

    /// Sequences per optimizer step.
    pub fn global_batch(&self) -> usize {
        self.dp * self.micro_batch * self.microbatches
    }
}

fn recompute_name(r: Recompute) -> &'static str {
    match r {
        Recompute::None => "none",
        Recompute::Selective => "selective",
        Recompute::Full => "full",
    }
}

impl fmt::Display for Layout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "tp{} pp{} dp{}", self.tp, self.pp, self.dp)?;
        if self.cp > 1 {
            write!(f, " cp{}", self.cp)?;
        }
        if self.ep > 1 {
            write!(f, " ep{}", self.ep)?;
        }
        write!(f, " z{}", self.zero.index())?;
        if self.sp {
            write!(f, " sp")?;
        }
        if let Some(s) = self.schedule {
            write!(f, " {}", s.name())?;
            if self.virtual_stages > 1 {
                write!(f, "/{}", self.virtual_stages)?;
            }
        }
        write!(
            f,
            " mb{}x{} rc={}",
            self.micro_batch,
            self.microbatches,
            recompute_name(self.recompute)
        )?;
        if self.offload != Offload::None {
            write!(f, " offload={}", self.offload.name())?;
        }
        Ok(())
    }
}

impl Serialize for Layout {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_string())
    }
}

impl FromStr for Layout {
    type Err = ParallelError;
    /// Parses the printed name; tokens may be separated by spaces or commas, absent degrees
    /// are 1, absent ZeRO stage 0, absent micro-batching `mb1x1`, absent recomputation and
    /// offload none.
    fn from_str(text: &str) -> Result<Self, ParallelError> {
        let bad = |t: &str| {
            ParallelError::Config(format!(
                "layout token `{t}` (expected tpN ppN dpN cpN epN zK sp SCHEDULE[/V] mbBxM rc=none|selective|full offload=none|optimizer)"
            ))
        };
        let mut l = Layout::single(1);
        for tok in text
            .split(|c: char| c.is_whitespace() || c == ',')
            .filter(|t| !t.is_empty())
        {
            let num = |prefix: &str| -> Option<usize> {
                tok.strip_prefix(prefix)
                    .and_then(|n| n.parse().ok())
                    .filter(|&n| n > 0)
            };
            if let Some(n) = num("tp") {
                l.tp = n;
            } else if let Some(n) = num("pp") {
                l.pp = n;
            } else if let Some(n) = num("dp") {
                l.dp = n;
            } else if let Some(n) = num("cp") {
                l.cp = n;
            } else if let Some(n) = num("ep") {
                l.ep = n;
            } else if let Some(z) = tok.strip_prefix('z').and_then(|k| k.parse().ok()) {
                l.zero = ZeroStage::from_index(z).ok_or_else(|| bad(tok))?;
            } else if tok == "sp" {
                l.sp = true;
            } else if let Some(mb) = tok.strip_prefix("mb") {
                let (b, m) = mb.split_once('x').unwrap_or((mb, "1"));
                l.micro_batch = b.parse().ok().filter(|&b| b > 0).ok_or_else(|| bad(tok))?;
                l.microbatches = m.parse().ok().filter(|&m| m > 0).ok_or_else(|| bad(tok))?;
            } else if let Some(r) = tok.strip_prefix("rc=") {
                l.recompute = match r {
                    "none" => Recompute::None,
                    "selective" => Recompute::Selective,
                    "full" => Recompute::Full,
                    _ => return Err(bad(tok)),
                };
            } else if let Some(o) = tok.strip_prefix("offload=") {
                l.offload = o.parse().map_err(|_| bad(tok))?;
            } else {
                let (name, v) = tok.split_once('/').unwrap_or((tok, "1"));
                l.schedule = Some(name.parse().map_err(|_| bad(tok))?);
                l.virtual_stages = v.parse().ok().filter(|&v| v > 0).ok_or_else(|| bad(tok))?;
            }
        }
        if l.pp > 1 && l.schedule.is_none() {
            l.schedule = Some(ScheduleKind::OneFOneB);
        }
        if l.pp == 1 {
            l.schedule = None;
        }
        Ok(l)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        let l = Layout {
            dp: 4,
            tp: 8,
            pp: 2,
            cp: 2,
            ep: 2,
            zero: ZeroStage::One,
            sp: true,
            schedule: Some(ScheduleKind::Interleaved),
            virtual_stages: 3,
            micro_batch: 1,
            microbatches: 16,
            recompute: Recompute::Selective,
            offload: Offload::Optimizer,
        };
        let name = l.to_string();
        assert_eq!(
            name,
            "tp8 pp2 dp4 cp2 ep2 z1 sp interleaved/3 mb1x16 rc=selective offload=optimizer"
        );
        assert_eq!(name.parse::<Layout>().unwrap(), l);
        let on_device = Layout {
            offload: Offload::None,
            ..l
        };
        assert!(!on_device.to_string().contains("offload"));
        assert_eq!(on_device.to_string().parse::<Layout>().unwrap(), on_device);
        assert!("dp2 offload=disk".parse::<Layout>().is_err());
        assert_eq!(
            "tp2,dp2,zb-h1,pp2".parse::<Layout>().unwrap().schedule,
            Some(ScheduleKind::ZbH1)
        );
        assert!("tp0".parse::<Layout>().is_err());
        assert!("z7".parse::<Layout>().is_err());
        assert!("warp9".parse::<Layout>().is_err());
    }
}
