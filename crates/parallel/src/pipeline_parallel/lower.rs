//! Lowering: from a compute-only schedule to what a rank's executor runs. For every compute
//! action it adds the communication its data dependencies imply — `RECV_F` / `RECV_B` posted
//! one compute action before the action that consumes the message (so the transfer overlaps
//! that compute), `SEND_F` / `SEND_B` right after the action that produces it — and the
//! bookkeeping: `REDUCE_GRAD` after a stage's last weight-gradient action (all at the end, in
//! the order of the layers, where ranks hold the same layers: DualPipe), with ZeRO-3
//! `UNSHARD` before a stage's first compute action and `RESHARD` after its last, and the
//! `OPTIMIZER` at the end.
//!
//! Deadlock freedom: every message between two stages travels on its own link (one per
//! stage boundary and direction, see the executor), sent and received in the same order on
//! both ends (the validator requires each stage's forwards and backwards in micro-batch
//! order), and no rank waits for its own receive before posting the sends the other side
//! needs first — so a valid compute schedule lowers to one that runs to its end.
use super::action::Action;
use super::schedule::Schedule;
use crate::ParallelError;

/// Options of the lowering.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LowerOptions {
    /// Keep each stage's parameters gathered from its first compute action to its last
    /// (ZeRO-3 with pipelining: one gather per stage and step instead of one per unit and
    /// micro-batch).
    pub unshard: bool,
}

/// The receives compute action `a` (one F, I or B) on rank `r` consumes from other ranks.
fn receives(s: &Schedule, r: usize, a: &Action) -> Vec<Action> {
    match *a {
        Action::Forward { stage, mb } => s
            .prev_stage(stage)
            .filter(|&p| s.stage_rank[p] != r)
            .map(|_| Action::RecvForward { stage, mb })
            .into_iter()
            .collect(),
        Action::BackwardInput { stage, mb } | Action::Backward { stage, mb } => s
            .next_stage(stage)
            .filter(|&n| s.stage_rank[n] != r)
            .map(|_| Action::RecvBackward { stage, mb })
            .into_iter()
            .collect(),
        _ => Vec::new(),
    }
}

/// The sends compute action `a` on rank `r` produces for other ranks.
fn sends(s: &Schedule, r: usize, a: &Action) -> Vec<Action> {
    match *a {
        Action::Forward { stage, mb } => s
            .next_stage(stage)
            .filter(|&n| s.stage_rank[n] != r)
            .map(|_| Action::SendForward { stage, mb })
            .into_iter()
            .collect(),
        Action::BackwardInput { stage, mb } | Action::Backward { stage, mb } => s
            .prev_stage(stage)
            .filter(|&p| s.stage_rank[p] != r)
            .map(|_| Action::SendBackward { stage, mb })
            .into_iter()
            .collect(),
        _ => Vec::new(),
    }
}

/// Lowers a valid compute-only schedule (communication and bookkeeping actions already in it
/// are dropped and derived again).
pub fn lower(s: &Schedule, opts: LowerOptions) -> Result<Schedule, ParallelError> {
    super::validate::validate(s)?;
    let mut actions = Vec::with_capacity(s.num_ranks());
    for (r, list) in s.actions.iter().enumerate() {
        let compute: Vec<Action> = list.iter().copied().filter(|a| a.is_compute()).collect();
        let stages = s.local_stages(r);
        let first_use = |stage: usize| {
            compute
                .iter()
                .position(|a| a.parts().iter().any(|p| p.stage() == Some(stage)))
        };
        let last_use = |stage: usize| {
            compute
                .iter()
                .rposition(|a| a.parts().iter().any(|p| p.stage() == Some(stage)))
        };
        // Ranks holding the same layers (DualPipe) reduce their gradients together, in one
        // order on every member: all at the end, in the order of the layers.
        let replicated = s.has_replicas();
        let last_weight = |stage: usize| {
            compute
                .iter()
                .rposition(|a| a.computes_weight_grads_of(stage))
        };
        let mut out = Vec::with_capacity(3 * compute.len() + 2 * stages.len() + 1);
        for (i, a) in compute.iter().enumerate() {
            if i == 0 {
                // The first action's receives, and the second's (posted one action early).
                for part in a.parts() {
                    out.extend(receives(s, r, &part));
                }
            }
            if opts.unshard {
                out.extend(
                    stages
                        .iter()
                        .filter(|&&st| first_use(st) == Some(i))
                        .map(|&stage| Action::Unshard { stage }),
                );
            }
            if let Some(next) = compute.get(i + 1) {
                for part in next.parts() {
                    out.extend(receives(s, r, &part));
                }
            }
            out.push(*a);
            for part in a.parts() {
                out.extend(sends(s, r, &part));
            }
            if !replicated {
                out.extend(
                    stages
                        .iter()
                        .filter(|&&st| last_weight(st) == Some(i))
                        .map(|&stage| Action::ReduceGrad { stage }),
                );
            }
            if opts.unshard {
                out.extend(
                    stages
                        .iter()
                        .filter(|&&st| last_use(st) == Some(i))
                        .map(|&stage| Action::Reshard { stage }),
                );
            }
        }
        if replicated {
            out.extend(stages.iter().map(|&stage| Action::ReduceGrad { stage }));
        }
        out.push(Action::Optimizer);
        actions.push(out);
    }
    Ok(Schedule {
        actions,
        ..s.clone()
    })
}
