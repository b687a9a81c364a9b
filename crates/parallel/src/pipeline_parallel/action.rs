//! The schedule IR: one rank's step is a list of actions on (pipeline stage, micro-batch)
//! pairs, written and read in torch.distributed.pipelining's short form (`0F1` = stage 0,
//! forward of micro-batch 1; `1SEND_B3`; `0REDUCE_GRAD`).
//!
//! Data dependencies are implicit: a forward of stage `s > 0` consumes the activation its
//! `RECV_F` (or the same rank's forward of stage `s − 1`) delivered, a backward of a stage
//! that is not the last consumes the gradient of its `RECV_B`, a `BACKWARD_WEIGHT` consumes
//! the pending work of the same pair's `BACKWARD_INPUT`. Training without pipeline parallelism
//! is [`one_stage`]: forward and backward of each micro-batch in turn, then the gradient
//! reduction and the optimizer step.
use std::fmt;

/// One action of a rank's schedule.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Action {
    /// Forward of every unit of `stage` on micro-batch `mb`.
    Forward { stage: usize, mb: usize },
    /// Input gradients of `stage` (weight gradients left pending).
    BackwardInput { stage: usize, mb: usize },
    /// The pending weight gradients of `stage` for `mb`.
    BackwardWeight { stage: usize, mb: usize },
    /// Input and weight gradients together, unit by unit.
    Backward { stage: usize, mb: usize },
    /// Send `stage`'s output activation of `mb` to stage + 1.
    SendForward { stage: usize, mb: usize },
    /// Receive `stage`'s input activation of `mb` from stage − 1.
    RecvForward { stage: usize, mb: usize },
    /// Send `stage`'s input gradient of `mb` to stage − 1.
    SendBackward { stage: usize, mb: usize },
    /// Receive `stage`'s output gradient of `mb` from stage + 1.
    RecvBackward { stage: usize, mb: usize },
    /// ZeRO-3: gather `stage`'s parameters and keep them until [`Action::Reshard`].
    Unshard { stage: usize },
    /// ZeRO-3: free `stage`'s gathered parameters.
    Reshard { stage: usize },
    /// Wait for every gradient reduction of `stage` (launched bucket by bucket as its last
    /// backward produces them).
    ReduceGrad { stage: usize },
    /// DualPipe's overlapped pair: the forward of one (stage, micro-batch) and the fused
    /// backward of another, issued together so one's communication can hide behind the
    /// other's compute (run one after the other on a CPU).
    ForwardBackward {
        f_stage: usize,
        f_mb: usize,
        b_stage: usize,
        b_mb: usize,
    },
    /// Clip, AdamW, and (ZeRO-1/2) the parameter all-gather: the end of the step.
    Optimizer,
}

impl Action {
    /// The stage the action works on (`None` for the optimizer step and an overlapped pair,
    /// which works on two).
    pub fn stage(&self) -> Option<usize> {
        use Action::*;
        match *self {
            Forward { stage, .. }
            | BackwardInput { stage, .. }
            | BackwardWeight { stage, .. }
            | Backward { stage, .. }
            | SendForward { stage, .. }
            | RecvForward { stage, .. }
            | SendBackward { stage, .. }
            | RecvBackward { stage, .. }
            | Unshard { stage }
            | Reshard { stage }
            | ReduceGrad { stage } => Some(stage),
            ForwardBackward { .. } | Optimizer => None,
        }
    }

    /// The micro-batch the action works on, if any (`None` for an overlapped pair, which
    /// works on two).
    pub fn microbatch(&self) -> Option<usize> {
        use Action::*;
        match *self {
            Forward { mb, .. }
            | BackwardInput { mb, .. }
            | BackwardWeight { mb, .. }
            | Backward { mb, .. }
            | SendForward { mb, .. }
            | RecvForward { mb, .. }
            | SendBackward { mb, .. }
            | RecvBackward { mb, .. } => Some(mb),
            _ => None,
        }
    }

    /// Whether the action computes weight gradients of `stage` (a fused or a weight-only
    /// backward, alone or in an overlapped pair).
    pub fn computes_weight_grads_of(&self, stage: usize) -> bool {
        match *self {
            Action::Backward { stage: s, .. } | Action::BackwardWeight { stage: s, .. } => {
                s == stage
            }
            Action::ForwardBackward { b_stage, .. } => b_stage == stage,
            _ => false,
        }
    }

    /// Whether the action is computation (F, I, W, B or an overlapped F&B), as opposed to
    /// communication and bookkeeping.
    pub fn is_compute(&self) -> bool {
        matches!(
            self,
            Action::Forward { .. }
                | Action::BackwardInput { .. }
                | Action::BackwardWeight { .. }
                | Action::Backward { .. }
                | Action::ForwardBackward { .. }
        )
    }

    /// The compute actions this one stands for: itself, or an overlapped pair's two halves.
    pub fn parts(&self) -> Vec<Action> {
        match *self {
            Action::ForwardBackward {
                f_stage,
                f_mb,
                b_stage,
                b_mb,
            } => vec![
                Action::Forward {
                    stage: f_stage,
                    mb: f_mb,
                },
                Action::Backward {
                    stage: b_stage,
                    mb: b_mb,
                },
            ],
            a => vec![a],
        }
    }
}

impl std::str::FromStr for Action {
    type Err = String;

    /// The short form: `2F0`, `1SEND_B3`, `0REDUCE_GRAD`, `OPTIMIZER`, and `0F3&5B1` for an
    /// overlapped forward / backward pair.
    fn from_str(text: &str) -> Result<Self, String> {
        let t = text.trim();
        let bad = || {
            format!(
                "`{t}` is not an action (forms: 2F0, 1I3, 0W2, 3B1, 1SEND_F0, 2RECV_B1, 0UNSHARD, 0RESHARD, 0REDUCE_GRAD, OPTIMIZER, 0F3&5B1)"
            )
        };
        if t == "OPTIMIZER" {
            return Ok(Action::Optimizer);
        }
        if let Some((f, b)) = t.split_once('&') {
            return match (f.parse::<Action>(), b.parse::<Action>()) {
                (
                    Ok(Action::Forward { stage: fs, mb: fm }),
                    Ok(Action::Backward { stage: bs, mb: bm }),
                ) => Ok(Action::ForwardBackward {
                    f_stage: fs,
                    f_mb: fm,
                    b_stage: bs,
                    b_mb: bm,
                }),
                _ => Err(bad()),
            };
        }
        let digits = t.find(|c: char| !c.is_ascii_digit()).ok_or_else(bad)?;
        let stage: usize = t[..digits].parse().map_err(|_| bad())?;
        let rest = &t[digits..];
        let kind_len = rest
            .find(|c: char| c.is_ascii_digit())
            .unwrap_or(rest.len());
        let (kind, mb) = rest.split_at(kind_len);
        let mb: Option<usize> = if mb.is_empty() {
            None
        } else {
            Some(mb.parse().map_err(|_| bad())?)
        };
        let with_mb = |f: fn(usize, usize) -> Action| mb.map(|mb| f(stage, mb)).ok_or_else(bad);
        let no_mb = |a: Action| if mb.is_none() { Ok(a) } else { Err(bad()) };
        match kind {
            "F" => with_mb(|stage, mb| Action::Forward { stage, mb }),
            "I" => with_mb(|stage, mb| Action::BackwardInput { stage, mb }),
            "W" => with_mb(|stage, mb| Action::BackwardWeight { stage, mb }),
            "B" => with_mb(|stage, mb| Action::Backward { stage, mb }),
            "SEND_F" => with_mb(|stage, mb| Action::SendForward { stage, mb }),
            "RECV_F" => with_mb(|stage, mb| Action::RecvForward { stage, mb }),
            "SEND_B" => with_mb(|stage, mb| Action::SendBackward { stage, mb }),
            "RECV_B" => with_mb(|stage, mb| Action::RecvBackward { stage, mb }),
            "UNSHARD" => no_mb(Action::Unshard { stage }),
            "RESHARD" => no_mb(Action::Reshard { stage }),
            "REDUCE_GRAD" => no_mb(Action::ReduceGrad { stage }),
            _ => Err(bad()),
        }
    }
}

impl fmt::Display for Action {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        use Action::*;
        match *self {
            Forward { stage, mb } => write!(f, "{stage}F{mb}"),
            BackwardInput { stage, mb } => write!(f, "{stage}I{mb}"),
            BackwardWeight { stage, mb } => write!(f, "{stage}W{mb}"),
            Backward { stage, mb } => write!(f, "{stage}B{mb}"),
            SendForward { stage, mb } => write!(f, "{stage}SEND_F{mb}"),
            RecvForward { stage, mb } => write!(f, "{stage}RECV_F{mb}"),
            SendBackward { stage, mb } => write!(f, "{stage}SEND_B{mb}"),
            RecvBackward { stage, mb } => write!(f, "{stage}RECV_B{mb}"),
            Unshard { stage } => write!(f, "{stage}UNSHARD"),
            Reshard { stage } => write!(f, "{stage}RESHARD"),
            ReduceGrad { stage } => write!(f, "{stage}REDUCE_GRAD"),
            ForwardBackward {
                f_stage,
                f_mb,
                b_stage,
                b_mb,
            } => write!(f, "{f_stage}F{f_mb}&{b_stage}B{b_mb}"),
            Optimizer => write!(f, "OPTIMIZER"),
        }
    }
}

/// The schedule of a step without pipeline parallelism: each of `microbatches` micro-batches'
/// forward and fused backward in turn (so only one micro-batch's activations are alive), the
/// gradient reduction of stage 0, the optimizer step.
pub fn one_stage(microbatches: usize) -> Vec<Action> {
    let mut out = Vec::with_capacity(2 * microbatches + 2);
    for mb in 0..microbatches {
        out.push(Action::Forward { stage: 0, mb });
        out.push(Action::Backward { stage: 0, mb });
    }
    out.push(Action::ReduceGrad { stage: 0 });
    out.push(Action::Optimizer);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn short_form_and_one_stage() {
        let s: Vec<String> = one_stage(2).iter().map(|a| a.to_string()).collect();
        assert_eq!(s, ["0F0", "0B0", "0F1", "0B1", "0REDUCE_GRAD", "OPTIMIZER"]);
        assert_eq!(
            Action::SendBackward { stage: 1, mb: 3 }.to_string(),
            "1SEND_B3"
        );
        assert_eq!(Action::Optimizer.stage(), None);
        assert!(Action::BackwardWeight { stage: 0, mb: 0 }.computes_weight_grads_of(0));
        assert!(!Action::BackwardInput { stage: 0, mb: 0 }.computes_weight_grads_of(0));
    }

    #[test]
    fn text_form_round_trips() {
        for t in [
            "2F0",
            "1I3",
            "0W12",
            "3B1",
            "1SEND_F0",
            "2RECV_F4",
            "0SEND_B1",
            "1RECV_B2",
            "0UNSHARD",
            "3RESHARD",
            "0REDUCE_GRAD",
            "OPTIMIZER",
            "0F3&7B1",
        ] {
            let a: Action = t.parse().unwrap();
            assert_eq!(a.to_string(), t);
        }
        for bad in ["", "F0", "0X1", "0F", "0UNSHARD1", "0F1&0F2", "1F-1", "x"] {
            assert!(bad.parse::<Action>().is_err(), "{bad}");
        }
        let pair: Action = "0F3&7B1".parse().unwrap();
        assert_eq!(
            pair.parts(),
            [
                Action::Forward { stage: 0, mb: 3 },
                Action::Backward { stage: 7, mb: 1 }
            ]
        );
        assert!(pair.computes_weight_grads_of(7) && pair.is_compute());
    }
}
