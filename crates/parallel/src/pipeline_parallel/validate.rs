//! The validator: a schedule runs to its end, or an error names what is wrong. Per stage,
//! every micro-batch of its chain has exactly one forward and one input gradient (an `I`, or
//! the `B` that fuses it), a `W` exactly for each `I`, each after what it needs on the same
//! stage, and forwards and backwards in increasing micro-batch order (messages between two
//! stages are delivered in order). Across ranks, the dependencies (a stage's forward needs the
//! previous stage's, its backward the next stage's) must be satisfiable: the compute actions
//! are replayed in every rank's order, and if no rank can go on, the error lists the actions
//! that can never run and what each waits for.
use std::collections::HashSet;

use super::action::Action;
use super::schedule::Schedule;
use crate::ParallelError;

/// What a compute action has produced, as the dependency replay tracks it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Event {
    /// The forward of (stage, micro-batch).
    Forward(usize, usize),
    /// The input gradient of (stage, micro-batch): an `I` or a `B`.
    InputGrad(usize, usize),
    /// The weight gradient of (stage, micro-batch): a `W` or a `B`.
    WeightGrad(usize, usize),
}

/// What compute action `a` (a single F, I, W or B) needs first.
pub fn needs(s: &Schedule, a: &Action) -> Vec<Event> {
    match *a {
        Action::Forward { stage, mb } => s
            .prev_stage(stage)
            .map(|p| Event::Forward(p, mb))
            .into_iter()
            .collect(),
        Action::BackwardInput { stage, mb } | Action::Backward { stage, mb } => {
            let mut v = vec![Event::Forward(stage, mb)];
            if let Some(n) = s.next_stage(stage) {
                v.push(Event::InputGrad(n, mb));
            }
            v
        }
        Action::BackwardWeight { stage, mb } => vec![Event::InputGrad(stage, mb)],
        _ => Vec::new(),
    }
}

/// What compute action `a` produces.
pub fn produces(a: &Action) -> Vec<Event> {
    match *a {
        Action::Forward { stage, mb } => vec![Event::Forward(stage, mb)],
        Action::BackwardInput { stage, mb } => vec![Event::InputGrad(stage, mb)],
        Action::BackwardWeight { stage, mb } => vec![Event::WeightGrad(stage, mb)],
        Action::Backward { stage, mb } => {
            vec![Event::InputGrad(stage, mb), Event::WeightGrad(stage, mb)]
        }
        _ => Vec::new(),
    }
}

fn event_text(e: &Event) -> String {
    match *e {
        Event::Forward(s, mb) => format!("{s}F{mb}"),
        Event::InputGrad(s, mb) => format!("the input gradient {s}I{mb}"),
        Event::WeightGrad(s, mb) => format!("{s}W{mb}"),
    }
}

/// Checks `s` (see the module doc).
pub fn validate(s: &Schedule) -> Result<(), ParallelError> {
    s.check_shape()?;
    let err = |m: String| Err(ParallelError::Schedule(m));
    for chain in &s.chains {
        for stage in chain.stages.clone() {
            let r = s.stage_rank[stage];
            let parts: Vec<Action> = s.actions[r].iter().flat_map(|a| a.parts()).collect();
            let mut seen: HashSet<Event> = HashSet::new();
            let (mut last_f, mut last_i) = (None, None);
            let mut i_only = HashSet::new();
            for a in parts
                .iter()
                .filter(|a| a.is_compute() && a.stage() == Some(stage))
            {
                let mb = a.microbatch().expect("compute actions have a micro-batch");
                if !chain.microbatches.contains(&mb) {
                    return err(format!(
                        "{a}: micro-batch {mb} does not flow through stage {stage} (its chain takes {:?})",
                        chain.microbatches
                    ));
                }
                for need in needs(s, a) {
                    let same_stage = match need {
                        Event::Forward(x, _) | Event::InputGrad(x, _) | Event::WeightGrad(x, _) => {
                            x == stage
                        }
                    };
                    if same_stage && !seen.contains(&need) {
                        return err(format!("{a} comes before {}", event_text(&need)));
                    }
                }
                let order = match a {
                    Action::Forward { .. } => Some(&mut last_f),
                    Action::BackwardInput { .. } | Action::Backward { .. } => Some(&mut last_i),
                    _ => None,
                };
                if let Some(last) = order {
                    if last.is_some_and(|l| mb <= l) {
                        return err(format!(
                            "{a}: stage {stage}'s {} must run in increasing micro-batch order",
                            if matches!(a, Action::Forward { .. }) {
                                "forwards"
                            } else {
                                "backwards"
                            }
                        ));
                    }
                    *last = Some(mb);
                }
                if matches!(a, Action::BackwardInput { .. }) {
                    i_only.insert(mb);
                }
                if let Action::BackwardWeight { .. } = a {
                    if !i_only.remove(&mb) {
                        return err(format!("{a} has no BACKWARD_INPUT {stage}I{mb} before it"));
                    }
                }
                for e in produces(a) {
                    if !seen.insert(e) {
                        return err(format!("{a} runs twice"));
                    }
                }
            }
            for mb in chain.microbatches.clone() {
                for e in [
                    Event::Forward(stage, mb),
                    Event::InputGrad(stage, mb),
                    Event::WeightGrad(stage, mb),
                ] {
                    if !seen.contains(&e) {
                        let what = match e {
                            Event::Forward(..) => format!("{stage}F{mb}"),
                            Event::InputGrad(..) => {
                                format!("a backward of {stage}, micro-batch {mb}")
                            }
                            Event::WeightGrad(..) => format!("{stage}W{mb}"),
                        };
                        return err(format!("rank {r} never runs {what}"));
                    }
                }
            }
        }
    }
    replay(s).map(|_| ())
}

/// Replays the compute actions in every rank's order, one at a time wherever the dependencies
/// allow; returns the order in which they ran (rank, action) or the error naming the actions
/// that can never run. An overlapped pair (`F&B`) runs as one action, as the executor runs it:
/// its backward may use its own forward's output, but other ranks see either only after both.
pub fn replay(s: &Schedule) -> Result<Vec<(usize, Action)>, ParallelError> {
    let lists: Vec<Vec<Action>> = s
        .actions
        .iter()
        .map(|l| l.iter().copied().filter(|a| a.is_compute()).collect())
        .collect();
    let missing = |a: &Action, done: &HashSet<Event>| -> Vec<Event> {
        let parts = a.parts();
        let mut made: HashSet<Event> = HashSet::new();
        let mut out = Vec::new();
        for p in &parts {
            out.extend(
                needs(s, p)
                    .into_iter()
                    .filter(|e| !done.contains(e) && !made.contains(e)),
            );
            made.extend(produces(p));
        }
        out
    };
    let mut pos = vec![0usize; lists.len()];
    let mut done: HashSet<Event> = HashSet::new();
    let total: usize = lists.iter().map(|l| l.len()).sum();
    let mut order = Vec::with_capacity(total);
    while order.len() < total {
        let mut progressed = false;
        for (r, list) in lists.iter().enumerate() {
            while let Some(a) = list.get(pos[r]) {
                if !missing(a, &done).is_empty() {
                    break;
                }
                for p in a.parts() {
                    done.extend(produces(&p));
                }
                order.push((r, *a));
                pos[r] += 1;
                progressed = true;
            }
        }
        if !progressed {
            let stuck: Vec<String> = lists
                .iter()
                .enumerate()
                .filter_map(|(r, l)| {
                    let a = l.get(pos[r])?;
                    let waits: Vec<String> = missing(a, &done).iter().map(event_text).collect();
                    Some(format!("rank {r}: {a} (waits for {})", waits.join(", ")))
                })
                .collect();
            return Err(ParallelError::Schedule(format!(
                "these actions can never run: {}",
                stuck.join("; ")
            )));
        }
    }
    Ok(order)
}
