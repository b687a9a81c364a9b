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
    /// Clip, AdamW, and (ZeRO-1/2) the parameter all-gather: the end of the step.
    Optimizer,
}

impl Action {
    /// The stage the action works on (`None` for the optimizer step).
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
            Optimizer => None,
        }
    }

    /// The micro-batch the action works on, if any.
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

    /// Whether the action computes weight gradients (a fused or a weight-only backward).
    pub fn computes_weight_grads(&self) -> bool {
        matches!(
            self,
            Action::Backward { .. } | Action::BackwardWeight { .. }
        )
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
        assert!(Action::BackwardWeight { stage: 0, mb: 0 }.computes_weight_grads());
        assert!(!Action::BackwardInput { stage: 0, mb: 0 }.computes_weight_grads());
    }
}
