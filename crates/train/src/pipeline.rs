//! The run's pipeline (pp > 1): the schedule `parallel.schedule` names — generated for pp
//! ranks and `train.grad_accum` micro-batches per step, or read from a CSV file — validated
//! and lowered; and its measured timeline. From the executor's action trace each step gives,
//! per rank, when its first action started, when its last ended (the gradient reductions and
//! the optimizer step excluded) and how long it worked (an action's time less what it waited
//! for messages from other ranks); the step's **measured bubble** is the simulator's
//! definition applied to these times, `1 − busy_r / makespan` averaged over ranks, with
//! `makespan = max_r last_r − min_r first_r`. The report sets it beside the simulator's
//! prediction with unit costs and with each stage's measured mean cost of each action type (a
//! compute action's cost includes the sends, receives and gathers the rank does right after
//! it), and `--trace FILE` writes every action as a Chrome trace (`chrome://tracing`,
//! Perfetto): one process per rank, each action with what it waited for, and below it the
//! backward of each unit and each gradient bucket's data-parallel reduction from launch to
//! completion (what overlaps what). The timeline and the trace serve every layout: without
//! pipeline parallelism the one-stage schedule's actions are traced the same way.
use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use comm::{Communicator, ProcessGroup};
use parallel::executor::{TraceEvent, TraceKind};
use parallel::pipeline_parallel::{
    generate, lower, simulate, simulate_with, Action, Costs, LowerOptions, Schedule, ScheduleKind,
};
use parallel::ParallelDims;
use serde::Serialize;

use crate::config::RunConfig;
use crate::error::{IoContext, Result, TrainError};

fn serr(e: parallel::ParallelError) -> TrainError {
    TrainError::Config(e.to_string())
}

/// The compute-only schedule of `cfg` (not yet lowered): `parallel.schedule` for `dims.pp`
/// ranks and `train.grad_accum` micro-batches.
pub fn compute_schedule(cfg: &RunConfig, dims: &ParallelDims) -> Result<Schedule> {
    let p = &cfg.parallel;
    let m = cfg.train.grad_accum;
    let s = match p.schedule.strip_prefix("csv:") {
        Some(path) => {
            let text =
                std::fs::read_to_string(path).ctx(|| format!("reading the schedule {path}"))?;
            Schedule::from_csv(&text).map_err(|e| TrainError::Config(format!("{path}: {e}")))?
        }
        None => {
            let kind: ScheduleKind = p.schedule.parse().map_err(serr)?;
            generate(kind, dims.pp, m, dims.virtual_stages).map_err(serr)?
        }
    };
    if s.num_ranks() != dims.pp {
        return Err(TrainError::Config(format!(
            "parallel.schedule `{}` is for {} pipeline ranks but pp = {}",
            p.schedule,
            s.num_ranks(),
            dims.pp
        )));
    }
    parallel::pipeline_parallel::validate(&s).map_err(serr)?;
    if s.num_microbatches() != m {
        return Err(TrainError::Config(format!(
            "parallel.schedule `{}` runs {} micro-batches per step but train.grad_accum = {m} (set it with --microbatches)",
            p.schedule,
            s.num_microbatches()
        )));
    }
    Ok(s)
}

/// The lowered schedule every rank runs (ZeRO-3 keeps a stage's weights gathered from its
/// first action to its last).
pub fn lowered_schedule(compute: &Schedule, dims: &ParallelDims) -> Result<Schedule> {
    let opts = LowerOptions {
        unshard: dims.zero.shards_params(),
    };
    lower(compute, opts).map_err(serr)
}

/// A rank's pipeline: the schedule, its lowered form, and the measured timeline.
#[derive(Debug)]
pub struct RunPipeline {
    /// The compute-only schedule (what the simulator and `xtrain schedule` show).
    pub compute: Schedule,
    /// What every pp rank runs.
    pub lowered: Schedule,
    pub pp_rank: usize,
    pub timeline: Timeline,
}

impl RunPipeline {
    pub fn new(cfg: &RunConfig, dims: &ParallelDims, pp_rank: usize) -> Result<Self> {
        let compute = compute_schedule(cfg, dims)?;
        let lowered = lowered_schedule(&compute, dims)?;
        Ok(RunPipeline {
            compute,
            lowered,
            pp_rank,
            timeline: Timeline::new(false),
        })
    }

    /// This rank's actions.
    pub fn actions(&self) -> &[Action] {
        &self.lowered.actions[self.pp_rank]
    }
}

/// One action as it ran, in microseconds since the Unix epoch (for the Chrome trace).
#[derive(Clone, Debug)]
struct Span {
    action: Action,
    step: usize,
    start_us: i64,
    took_us: i64,
    waited_us: i64,
}

/// A unit's backward or a bucket's reduction, in microseconds since the Unix epoch, on trace
/// row `tid` (1: units, 2: reductions).
#[derive(Clone, Debug)]
struct Detail {
    name: String,
    tid: u8,
    step: usize,
    start_us: i64,
    dur_us: i64,
}

/// This rank's measured timeline of the steps run so far.
#[derive(Debug)]
pub struct Timeline {
    /// One clock reading on both clocks: converts the trace's instants to the wall clock
    /// every rank of a machine shares.
    anchor: (Instant, SystemTime),
    /// Per step: first compute start, last compute end (ns since the epoch), busy ns.
    steps: Vec<[i64; 3]>,
    /// Per (stage, action type index of [`KINDS`]): total compute ns and count, for the
    /// measured costs.
    costs: BTreeMap<(usize, usize), (i64, i64)>,
    /// Every action, when a trace file was asked for.
    spans: Option<Vec<Span>>,
    /// Units' backwards and buckets' reductions, likewise.
    details: Vec<Detail>,
}

impl Timeline {
    /// An empty timeline; `keep_spans`: keep every action for [`write_trace`].
    pub fn new(keep_spans: bool) -> Self {
        Timeline {
            anchor: (Instant::now(), SystemTime::now()),
            steps: Vec::new(),
            costs: BTreeMap::new(),
            spans: keep_spans.then(Vec::new),
            details: Vec::new(),
        }
    }

    fn epoch_ns(&self, at: Instant) -> i64 {
        let (i0, s0) = self.anchor;
        let base = s0.duration_since(UNIX_EPOCH).unwrap_or_default().as_nanos() as i64;
        match at.checked_duration_since(i0) {
            Some(d) => base + d.as_nanos() as i64,
            None => base - i0.duration_since(at).as_nanos() as i64,
        }
    }

    /// Adds one step's trace (the executor's events of that step).
    pub fn absorb(&mut self, trace: &[TraceEvent]) {
        let step = self.steps.len();
        let (mut first, mut last, mut busy) = (i64::MAX, i64::MIN, 0i64);
        let (mut lead, mut last_key) = (0i64, None);
        if self.spans.is_some() {
            self.absorb_details(step, trace);
        }
        for e in trace {
            let TraceKind::Action {
                action,
                took,
                waited,
            } = &e.kind
            else {
                continue;
            };
            let start = self.epoch_ns(e.at);
            let (took, waited) = (took.as_nanos() as i64, waited.as_nanos() as i64);
            if let Some(spans) = &mut self.spans {
                spans.push(Span {
                    action: *action,
                    step,
                    start_us: start / 1000,
                    took_us: took / 1000,
                    waited_us: waited / 1000,
                });
            }
            if matches!(action, Action::Optimizer | Action::ReduceGrad { .. }) {
                continue; // after the pipeline's timeline (and its dp reductions)
            }
            let work = took - waited;
            first = first.min(start);
            last = last.max(start + took);
            busy += work;
            // A send, receive or gather is work of the compute action before it (the first
            // compute action takes what precedes it).
            match cost_key(action) {
                Some(key) => {
                    let c = self.costs.entry(key).or_default();
                    c.0 += work + std::mem::take(&mut lead);
                    c.1 += 1;
                    last_key = Some(key);
                }
                None => match last_key {
                    Some(k) => self.costs.entry(k).or_default().0 += work,
                    None => lead += work,
                },
            }
        }
        if first <= last {
            self.steps.push([first, last, busy]);
        }
    }
}

impl Timeline {
    /// Pairs the trace's unit-backward and bucket events into spans.
    fn absorb_details(&mut self, step: usize, trace: &[TraceEvent]) {
        let mut open: BTreeMap<(u8, usize), i64> = BTreeMap::new();
        for e in trace {
            let at = self.epoch_ns(e.at) / 1000;
            let (key, end) = match e.kind {
                TraceKind::BackwardStart(u) => ((1, u), false),
                TraceKind::BackwardEnd(u) => ((1, u), true),
                TraceKind::BucketLaunched(b) => ((2, b), false),
                TraceKind::BucketDone(b) => ((2, b), true),
                TraceKind::Action { .. } => continue,
            };
            if !end {
                open.insert(key, at);
            } else if let Some(start_us) = open.remove(&key) {
                let name = match key.0 {
                    1 => format!("unit {} backward", key.1),
                    _ => format!("bucket {} reduction", key.1),
                };
                self.details.push(Detail {
                    name,
                    tid: key.0,
                    step,
                    start_us,
                    dur_us: at - start_us,
                });
            }
        }
    }
}

/// The action types whose costs are measured.
const KINDS: [&str; 5] = ["F", "I", "W", "B", "F&B"];

/// Where an action's time is counted among the measured costs: (its stage — an overlapped
/// pair's forward stage —, its index in [`KINDS`]); `None` for what is not compute.
fn cost_key(a: &Action) -> Option<(usize, usize)> {
    Some(match *a {
        Action::Forward { stage, .. } => (stage, 0),
        Action::BackwardInput { stage, .. } => (stage, 1),
        Action::BackwardWeight { stage, .. } => (stage, 2),
        Action::Backward { stage, .. } => (stage, 3),
        Action::ForwardBackward { f_stage, .. } => (f_stage, 4),
        _ => return None,
    })
}

/// The pipeline's measured bubble beside the simulator's prediction.
#[derive(Clone, Debug, Serialize)]
pub struct PipelineReport {
    pub schedule: String,
    pub pp: usize,
    pub microbatches: usize,
    /// Measured bubble of every step (mean over ranks).
    pub measured: Vec<f64>,
    /// Median of `measured` after the first step (the first pages in buffers), or of all
    /// steps when only one ran.
    pub measured_median: f64,
    /// Mean measured compute seconds of one action of each type (`F`, `I`, `W`, `B`, `F&B`;
    /// absent types omitted), over every stage.
    pub measured_costs: Vec<(String, f64)>,
    /// The simulator's bubble with each stage's measured costs, and with unit costs
    /// (F = I = W = 1).
    pub simulated_measured_costs: f64,
    pub simulated_unit_costs: f64,
}

impl std::fmt::Display for PipelineReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let costs: Vec<String> = self
            .measured_costs
            .iter()
            .map(|(k, s)| format!("{k} {:.2} ms", s * 1e3))
            .collect();
        write!(
            f,
            "pipeline {} pp={} m={}: bubble measured {:.1}% (median over steps) | simulated with the measured costs ({}) {:.1}% | with unit costs {:.1}%",
            self.schedule,
            self.pp,
            self.microbatches,
            100.0 * self.measured_median,
            costs.join(", "),
            100.0 * self.simulated_measured_costs,
            100.0 * self.simulated_unit_costs
        )
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// The measured bubble of each step from every rank's (first, last, busy), rank-major.
pub fn measured_bubbles(per_rank: &[Vec<[i64; 3]>]) -> Vec<f64> {
    let steps = per_rank.iter().map(|r| r.len()).min().unwrap_or(0);
    (0..steps)
        .map(|s| {
            let first = per_rank.iter().map(|r| r[s][0]).min().unwrap_or(0);
            let last = per_rank.iter().map(|r| r[s][1]).max().unwrap_or(0);
            let makespan = (last - first).max(1) as f64;
            let idle: f64 = per_rank
                .iter()
                .map(|r| 1.0 - r[s][2] as f64 / makespan)
                .sum();
            idle / per_rank.len() as f64
        })
        .collect()
}

/// Gathers the timelines of the pp group `pp` (a collective over it) and reports on its rank
/// 0 (`None` elsewhere). `compute` is the compute-only schedule; the simulator runs it with
/// each stage's measured mean cost per action type (the first and last stages also run the
/// embedding and the head), and with unit costs.
pub fn report(
    pp: &ProcessGroup,
    timeline: &Timeline,
    compute: &Schedule,
) -> Result<Option<PipelineReport>> {
    // [steps, (first, last, busy) per step, (stage, kind, total, count) per measured cost]
    let mut mine: Vec<i64> = vec![timeline.steps.len() as i64];
    mine.extend(timeline.steps.iter().flatten());
    for (&(stage, kind), &(total, count)) in &timeline.costs {
        mine.extend([stage as i64, kind as i64, total, count]);
    }
    let (all, counts) = pp.all_gather_v(&mine)?;
    if pp.rank() != 0 {
        return Ok(None);
    }
    let mut per_rank = Vec::new();
    let mut costs: BTreeMap<(usize, usize), (i64, i64)> = BTreeMap::new();
    let mut at = 0;
    for n in counts {
        let row = &all[at..at + n];
        at += n;
        let steps = row[0] as usize;
        let (times, rest) = row[1..].split_at(3 * steps);
        per_rank.push(
            times
                .chunks_exact(3)
                .map(|x| [x[0], x[1], x[2]])
                .collect::<Vec<_>>(),
        );
        for c in rest.chunks_exact(4) {
            let e = costs.entry((c[0] as usize, c[1] as usize)).or_default();
            e.0 += c[2];
            e.1 += c[3];
        }
    }
    let measured = measured_bubbles(&per_rank);
    let after_first = measured.iter().skip(usize::from(measured.len() > 1));
    let measured_median = median(after_first.copied().collect());
    let seconds = |(total, count): (i64, i64)| total as f64 / count.max(1) as f64 / 1e9;
    let measured_costs: Vec<(String, f64)> = (0..KINDS.len())
        .filter_map(|k| {
            let (t, c) = costs
                .iter()
                .filter(|((_, kind), _)| *kind == k)
                .fold((0, 0), |acc, (_, v)| (acc.0 + v.0, acc.1 + v.1));
            (c > 0).then(|| (KINDS[k].to_string(), seconds((t, c))))
        })
        .collect();
    // The simulator with each stage's measured mean cost of each action type.
    let cost = |a: &Action| -> f64 {
        let mean = |s: usize, k: usize| costs.get(&(s, k)).map(|&v| seconds(v));
        let key = cost_key(a).expect("the simulator costs compute actions");
        mean(key.0, key.1).unwrap_or_else(|| {
            a.parts()
                .iter()
                .filter_map(cost_key)
                .map(|(s, k)| mean(s, k).unwrap_or(0.0))
                .sum()
        })
    };
    let with_measured = simulate_with(compute, cost).map_err(serr)?;
    let with_units = simulate(compute, &Costs::default()).map_err(serr)?;
    Ok(Some(PipelineReport {
        schedule: compute.kind.clone(),
        pp: compute.num_ranks(),
        microbatches: compute.num_microbatches(),
        measured,
        measured_median,
        measured_costs,
        simulated_measured_costs: with_measured.mean_bubble(),
        simulated_unit_costs: with_units.mean_bubble(),
    }))
}

/// Writes every rank's actions as a Chrome trace to `path` on rank 0 (a collective over the
/// world). Rows are ranks (`pid`), times microseconds from the first action; each action
/// carries its step and what it waited for, and its wait is drawn inside it as `wait`.
pub fn write_trace(comm: &Communicator, timeline: &Timeline, path: &Path) -> Result<()> {
    let rank = comm.rank();
    let mut events = Vec::new();
    for s in timeline.spans.iter().flatten() {
        let name = s.action.to_string();
        events.push(serde_json::json!({
            "name": name, "ph": "X", "pid": rank, "tid": 0, "ts": s.start_us, "dur": s.took_us,
            "args": {"step": s.step, "waited_us": s.waited_us},
        }));
        if s.waited_us > 0 {
            events.push(serde_json::json!({
                "name": "wait", "ph": "X", "pid": rank, "tid": 0, "ts": s.start_us, "dur": s.waited_us,
                "args": {"for": name},
            }));
        }
    }
    for d in &timeline.details {
        events.push(serde_json::json!({
            "name": d.name, "ph": "X", "pid": rank, "tid": d.tid, "ts": d.start_us,
            "dur": d.dur_us, "args": {"step": d.step},
        }));
    }
    let bytes = serde_json::to_vec(&events).expect("serialises");
    let (all, counts) = comm.world().all_gather_v(&bytes)?;
    if rank != 0 {
        return Ok(());
    }
    let mut merged: Vec<serde_json::Value> = Vec::new();
    let mut at = 0;
    for n in counts {
        let part: Vec<serde_json::Value> = serde_json::from_slice(&all[at..at + n])
            .map_err(|e| TrainError::Parallel(format!("trace from a rank is not JSON: {e}")))?;
        merged.extend(part);
        at += n;
    }
    let t0 = merged
        .iter()
        .filter_map(|e| e["ts"].as_i64())
        .min()
        .unwrap_or(0);
    for e in &mut merged {
        if let Some(ts) = e["ts"].as_i64() {
            e["ts"] = serde_json::json!(ts - t0);
        }
    }
    for r in 0..comm.size() {
        merged.push(serde_json::json!({
            "name": "process_name", "ph": "M", "pid": r, "args": {"name": format!("rank {r}")},
        }));
        for (tid, row) in [
            (0, "schedule actions"),
            (1, "unit backwards"),
            (2, "dp reductions"),
        ] {
            merged.push(serde_json::json!({
                "name": "thread_name", "ph": "M", "pid": r, "tid": tid, "args": {"name": row},
            }));
        }
    }
    let doc = serde_json::json!({ "traceEvents": merged, "displayTimeUnit": "ms" });
    std::fs::write(path, serde_json::to_vec(&doc).expect("serialises"))
        .ctx(|| format!("writing the trace {}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn measured_bubble_is_the_simulators_definition() {
        // Two ranks over a makespan of 10: rank 0 busy 6, rank 1 busy 8 → (0.4 + 0.2) / 2.
        let r0 = vec![[100, 108, 6]];
        let r1 = vec![[102, 110, 8]];
        let b = measured_bubbles(&[r0, r1]);
        assert_eq!(b.len(), 1);
        assert!((b[0] - 0.3).abs() < 1e-12, "{b:?}");
    }
}
