//! The simulator: from per-action costs (unit, or measured), when every compute action of a
//! schedule starts and ends, the makespan, each rank's bubble (the share of the makespan it is
//! idle) and its peak number of micro-batches' activations in flight.
//!
//! Each rank runs its actions in order; an action starts when the rank is free and what it
//! needs has finished (communication is taken as free). Activations in flight are counted the
//! zero-bubble paper's way: a micro-batch holds its stage's activations from its forward to its
//! input gradient (`I` or `B`); weight-gradient work waiting for its `W` is reported separately.
use std::collections::HashMap;
use std::str::FromStr;

use super::action::Action;
use super::schedule::Schedule;
use super::validate::{needs, produces, Event};
use crate::ParallelError;

/// Seconds (or units) per action of one stage.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Costs {
    pub forward: f64,
    pub input: f64,
    pub weight: f64,
    /// An overlapped forward + backward pair (DualPipe's F&B); `None`: F + B.
    pub overlapped: Option<f64>,
}

impl Default for Costs {
    /// Unit costs: F = I = W = 1, so B = 2.
    fn default() -> Self {
        Costs {
            forward: 1.0,
            input: 1.0,
            weight: 1.0,
            overlapped: None,
        }
    }
}

impl Costs {
    /// The cost of one action (B = I + W).
    pub fn of(&self, a: &Action) -> f64 {
        match a {
            Action::Forward { .. } => self.forward,
            Action::BackwardInput { .. } => self.input,
            Action::BackwardWeight { .. } => self.weight,
            Action::Backward { .. } => self.input + self.weight,
            Action::ForwardBackward { .. } => self
                .overlapped
                .unwrap_or(self.forward + self.input + self.weight),
            _ => 0.0,
        }
    }
}

impl FromStr for Costs {
    type Err = ParallelError;
    /// `F=1,B=2,W=1` (B is the fused backward: I = B − W), also `I=…` and `FB=…`.
    fn from_str(text: &str) -> Result<Self, ParallelError> {
        let mut c = Costs::default();
        let mut b = None;
        let mut i = None;
        for item in text.split(',').filter(|t| !t.trim().is_empty()) {
            let (k, v) = item.split_once('=').ok_or_else(|| {
                ParallelError::Schedule(format!("cost `{item}` is not KEY=VALUE (F, I, W, B, FB)"))
            })?;
            let v: f64 = v
                .trim()
                .parse()
                .ok()
                .filter(|v: &f64| v.is_finite() && *v >= 0.0)
                .ok_or_else(|| {
                    ParallelError::Schedule(format!("cost `{item}` is not a non-negative number"))
                })?;
            match k.trim().to_ascii_uppercase().as_str() {
                "F" => c.forward = v,
                "I" => i = Some(v),
                "W" => c.weight = v,
                "B" => b = Some(v),
                "FB" => c.overlapped = Some(v),
                other => {
                    return Err(ParallelError::Schedule(format!(
                        "unknown cost `{other}` (F, I, W, B, FB)"
                    )))
                }
            }
        }
        c.input = match (i, b) {
            (Some(i), _) => i,
            (None, Some(b)) if b >= c.weight => b - c.weight,
            (None, Some(b)) => {
                return Err(ParallelError::Schedule(format!(
                    "B = {b} is less than W = {}: B is the fused I + W",
                    c.weight
                )))
            }
            (None, None) => c.input,
        };
        Ok(c)
    }
}

/// One simulated compute action.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Slot {
    pub rank: usize,
    pub action: Action,
    pub start: f64,
    pub end: f64,
}

/// What the simulator reports.
#[derive(Clone, Debug, PartialEq)]
pub struct Simulation {
    pub slots: Vec<Slot>,
    pub makespan: f64,
    /// Per rank: time busy, bubble share of the makespan, peak micro-batches between F and
    /// I (activations held), peak micro-batches between I and W (weight work pending).
    pub busy: Vec<f64>,
    pub bubble: Vec<f64>,
    pub peak_activations: Vec<usize>,
    pub peak_pending_weights: Vec<usize>,
}

impl Simulation {
    /// The mean bubble share over ranks.
    pub fn mean_bubble(&self) -> f64 {
        self.bubble.iter().sum::<f64>() / self.bubble.len().max(1) as f64
    }
}

/// Simulates `s` with `costs` (see the module doc). The schedule must be valid.
pub fn simulate(s: &Schedule, costs: &Costs) -> Result<Simulation, ParallelError> {
    simulate_with(s, |a| costs.of(a))
}

/// [`simulate`] with a cost per action (e.g. measured per stage: the first and last stages
/// also run the embedding and the head).
pub fn simulate_with(
    s: &Schedule,
    cost: impl Fn(&Action) -> f64,
) -> Result<Simulation, ParallelError> {
    let lists: Vec<Vec<Action>> = s
        .actions
        .iter()
        .map(|l| l.iter().copied().filter(|a| a.is_compute()).collect())
        .collect();
    let p = lists.len();
    let mut free = vec![0.0f64; p];
    let mut pos = vec![0usize; p];
    let mut finished: HashMap<Event, f64> = HashMap::new();
    let mut slots = Vec::new();
    let total: usize = lists.iter().map(|l| l.len()).sum();
    while slots.len() < total {
        // The ready action (all it needs finished) that can start first.
        let mut best: Option<(f64, usize)> = None;
        for r in 0..p {
            let Some(a) = lists[r].get(pos[r]) else {
                continue;
            };
            let mut start = free[r];
            let mut ready = true;
            for part in a.parts() {
                for e in needs(s, &part) {
                    // An overlapped pair's backward may need its own forward: the pair runs
                    // forward first.
                    if a.parts().iter().any(|x| produces(x).contains(&e)) {
                        continue;
                    }
                    match finished.get(&e) {
                        Some(&t) => start = start.max(t),
                        None => ready = false,
                    }
                }
            }
            if ready && best.is_none_or(|b| start < b.0) {
                best = Some((start, r));
            }
        }
        let (start, r) = best.ok_or_else(|| {
            ParallelError::Schedule("the schedule cannot run to its end (validate it first)".into())
        })?;
        let a = lists[r][pos[r]];
        let end = start + cost(&a);
        for part in a.parts() {
            for e in produces(&part) {
                finished.insert(e, end);
            }
        }
        slots.push(Slot {
            rank: r,
            action: a,
            start,
            end,
        });
        free[r] = end;
        pos[r] += 1;
    }
    let makespan = free.iter().copied().fold(0.0, f64::max);
    let mut busy = vec![0.0; p];
    let mut held = vec![0isize; p];
    let mut pending = vec![0isize; p];
    let mut peak_a = vec![0usize; p];
    let mut peak_w = vec![0usize; p];
    // Per rank in its own order: activations in flight after each action.
    for slot in &slots {
        let r = slot.rank;
        busy[r] += slot.end - slot.start;
        for part in slot.action.parts() {
            match part {
                Action::Forward { .. } => held[r] += 1,
                Action::BackwardInput { .. } => {
                    held[r] -= 1;
                    pending[r] += 1;
                }
                Action::Backward { .. } => held[r] -= 1,
                Action::BackwardWeight { .. } => pending[r] -= 1,
                _ => {}
            }
            peak_a[r] = peak_a[r].max(held[r].max(0) as usize);
            peak_w[r] = peak_w[r].max(pending[r].max(0) as usize);
        }
    }
    let bubble = busy
        .iter()
        .map(|b| {
            if makespan > 0.0 {
                1.0 - b / makespan
            } else {
                0.0
            }
        })
        .collect();
    Ok(Simulation {
        slots,
        makespan,
        busy,
        bubble,
        peak_activations: peak_a,
        peak_pending_weights: peak_w,
    })
}
