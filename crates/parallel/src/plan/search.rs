//! The search: every layout of a job on a cluster (within the limits a [`SearchSpace`] sets),
//! each predicted, the feasible ones ranked by tokens per second; when none fits, the one
//! closest to fitting and what would make the job fit. A layout fits when its fullest rank's
//! resident bytes fit in a device and, under optimizer offload, its fullest rank's host bytes
//! in the device's share of its node's host memory ([`Cluster::host_share`]); offload is
//! searched beside every 16-bit layout on a cluster with a host side.
use std::collections::HashMap;
use std::rc::Rc;

use model::{ParamLayout, Recompute};
use serde::Serialize;

use super::cluster::Cluster;
use super::layout::{Layout, Offload};
use super::memory::{self, RankMemory};
use super::time::{self, StepTime};
use super::Job;
use crate::data_parallel::ZeroStage;
use crate::memory::{human, MemoryAccount};
use crate::pipeline_parallel::{generate, simulate, validate, Costs, Schedule};
use crate::pipeline_parallel::{ScheduleKind, Simulation};
use crate::ParallelError;

/// Which layouts to consider; `None` degrees are searched over.
#[derive(Clone, Debug)]
pub struct SearchSpace {
    pub tp: Option<usize>,
    pub pp: Option<usize>,
    pub dp: Option<usize>,
    pub cp: Option<usize>,
    pub ep: Option<usize>,
    /// The deepest pipeline searched when pp is not fixed (deeper pipelines cost the
    /// simulator the most and rarely win).
    pub max_pp: usize,
    pub zero: Vec<ZeroStage>,
    /// Pipeline schedules with their virtual stages (interleaved: 2, 3, 4).
    pub schedules: Vec<(ScheduleKind, usize)>,
    /// Sequences per micro-batch.
    pub micro_batches: Vec<usize>,
    pub recompute: Vec<Recompute>,
    /// Sequence parallelism wherever tp > 1 (it halves nothing it costs: the same bytes
    /// move as all-gather + reduce-scatter instead of all-reduce); `false` searches both.
    pub sp_always: bool,
    /// Where the optimizer runs; offload only where it can ([`check_offload`]).
    pub offload: Vec<Offload>,
}

impl Default for SearchSpace {
    fn default() -> Self {
        use ScheduleKind::*;
        SearchSpace {
            tp: None,
            pp: None,
            dp: None,
            cp: None,
            ep: None,
            max_pp: 16,
            zero: vec![
                ZeroStage::Ddp,
                ZeroStage::One,
                ZeroStage::Two,
                ZeroStage::Three,
            ],
            schedules: vec![
                (GPipe, 1),
                (OneFOneB, 1),
                (Interleaved, 2),
                (Interleaved, 3),
                (Interleaved, 4),
                (ZbH1, 1),
                (ZbH2, 1),
                (ZbV, 1),
                (DualPipeV, 1),
            ],
            micro_batches: vec![1, 2, 4, 8],
            recompute: vec![Recompute::None, Recompute::Selective, Recompute::Full],
            sp_always: true,
            offload: vec![Offload::None, Offload::Optimizer, Offload::Delayed],
        }
    }
}

/// One layout's prediction.
#[derive(Clone, Debug, Serialize)]
pub struct Prediction {
    pub layout: Layout,
    /// Every pipeline rank's memory.
    pub ranks: Vec<RankMemory>,
    /// The fullest rank's account (the rank with the most resident bytes).
    pub peak: MemoryAccount,
    /// That rank's predicted resident bytes ([`memory::RankMemory::resident`]): what must
    /// fit in the device.
    pub resident: usize,
    /// The most host memory a rank's offloaded optimizer shard holds (0 without offload):
    /// what must fit in its share of the node's host memory.
    pub host: usize,
    pub time: StepTime,
    /// The schedule's mean bubble share (simulated with unit costs).
    pub bubble: f64,
    pub fits: bool,
}

impl Prediction {
    /// Bytes the layout lacks per device and in each device's host share.
    pub fn short(&self, cluster: &Cluster) -> (u64, u64) {
        let device = (self.resident as u64).saturating_sub(cluster.memory_bytes);
        let host = (self.host as u64).saturating_sub(cluster.host_share().unwrap_or(0));
        (device, host)
    }
}

/// Why nothing fits, and what would.
#[derive(Clone, Debug, Serialize)]
pub struct Shortfall {
    /// The layout lacking the fewest bytes, device and host together (of those lacking
    /// equally, the one needing the least device memory).
    pub closest: Prediction,
    /// Bytes it lacks per device.
    pub short_bytes: u64,
    /// Bytes it lacks in each device's share of host memory (optimizer offload).
    pub short_host_bytes: u64,
    pub suggestions: Vec<String>,
}

/// The result of a search.
#[derive(Clone, Debug, Serialize)]
pub struct Plan {
    /// Feasible layouts, fastest first.
    pub feasible: Vec<Prediction>,
    /// Layouts predicted (valid for the engine and the model).
    pub evaluated: usize,
    pub shortfall: Option<Shortfall>,
}

/// A schedule as the planner uses it: its makespan (unit costs) and mean bubble, and the
/// schedules memory is replayed on. Long schedules are simulated at two shorter lengths
/// `m_a < m_b` (4 and 6 micro-batches per pipeline rank) and extrapolated linearly: past the
/// warm-up every further micro-batch adds the same work (the makespan grows by a constant)
/// and the same activations in flight (none for 1F1B-like schedules, one per micro-batch for
/// GPipe), so the line through the two is exact there.
/// One simulated length: (micro-batches, schedule, simulation, activation profile).
type Sample = (usize, Schedule, Simulation, memory::Profile);

struct Sampled {
    m: usize,
    a: Rc<Sample>,
    b: Option<Rc<Sample>>,
}

impl Sampled {
    fn at(&self, f: impl Fn(&Schedule, &Simulation, &memory::Profile) -> f64) -> f64 {
        let (ma, sa, xa, pa) = &*self.a;
        let va = f(sa, xa, pa);
        match &self.b {
            None => va,
            Some(b) => {
                let (mb, sb, xb, pb) = &**b;
                let vb = f(sb, xb, pb);
                va + (self.m - ma) as f64 * (vb - va) / (mb - ma) as f64
            }
        }
    }
}

/// (schedule name, pp, micro-batches, virtual stages).
type ScheduleKey = (Option<&'static str>, usize, usize, usize);
/// (schedule name, pp, virtual stages).
type SampleKey = (Option<&'static str>, usize, usize);

/// Schedules and layouts, built once per shape.
#[derive(Default)]
pub struct Cache {
    schedules: HashMap<ScheduleKey, Option<Rc<Sampled>>>,
    /// The two sample lengths of long schedules, per (kind, pp, virtual stages).
    samples: HashMap<SampleKey, Option<Rc<Sampled>>>,
    layouts: HashMap<(usize, usize), ParamLayout>,
}

fn build(l: &Layout, m: usize) -> Option<Rc<Sample>> {
    let s = match l.schedule {
        None => memory::one_stage_schedule(m),
        Some(kind) => generate(kind, l.pp, m, l.virtual_stages).ok()?,
    };
    validate(&s).ok()?;
    let sim = simulate(&s, &Costs::default()).ok()?;
    let profile = memory::Profile::of(&s);
    Some(Rc::new((m, s, sim, profile)))
}

impl Cache {
    fn schedule(&mut self, l: &Layout) -> Option<Rc<Sampled>> {
        let name = l.schedule.map(|k| k.name());
        let m = l.microbatches;
        let key = (name, l.pp, m, l.virtual_stages);
        if let Some(s) = self.schedules.get(&key) {
            return s.clone();
        }
        // One stage: every micro-batch alike, lengths 1 and 2 suffice; short pipelines
        // directly; long ones from the samples at 2·pp and 3·pp.
        let (short, ma, mb) = if l.pp == 1 {
            (1, 1, 2)
        } else {
            (3 * l.pp, 2 * l.pp, 3 * l.pp)
        };
        let made = if m > short {
            let buildable = l.pp == 1 || generate(l.schedule?, l.pp, m, l.virtual_stages).is_ok();
            let s = self
                .samples
                .entry((name, l.pp, l.virtual_stages))
                .or_insert_with(|| {
                    Some(Rc::new(Sampled {
                        m: 0,
                        a: build(l, ma)?,
                        b: Some(build(l, mb)?),
                    }))
                })
                .clone();
            match s {
                Some(s) if buildable => Some(Rc::new(Sampled {
                    m,
                    a: s.a.clone(),
                    b: s.b.clone(),
                })),
                _ => None,
            }
        } else {
            build(l, m).map(|a| Rc::new(Sampled { m, a, b: None }))
        };
        self.schedules.insert(key, made.clone());
        made
    }
}

/// Predicts one layout (an error names what makes it impossible for the engine or model).
pub fn evaluate(job: &Job, cluster: &Cluster, l: &Layout) -> Result<Prediction, ParallelError> {
    evaluate_cached(job, cluster, l, &mut Cache::default())
}

fn evaluate_cached(
    job: &Job,
    cluster: &Cluster,
    l: &Layout,
    cache: &mut Cache,
) -> Result<Prediction, ParallelError> {
    let dims = l.dims();
    dims.validate(l.world())?;
    dims.validate_model(&job.model, job.seq_len)?;
    if l.global_batch() != job.global_batch {
        return Err(ParallelError::Config(format!(
            "{l}: dp × micro-batch × micro-batches = {} is not the global batch {}",
            l.global_batch(),
            job.global_batch
        )));
    }
    if l.pp > 1 && l.schedule.is_none() {
        return Err(ParallelError::Config(format!(
            "{l}: pp > 1 needs a schedule"
        )));
    }
    check_offload(job, cluster, l.offload)?;
    if l.cp > 1 && job.model.is_moe() && job.model.capacity_factor.is_some() {
        return Err(ParallelError::Unsupported(
            "an expert capacity with context parallelism".into(),
        ));
    }
    let key = (l.tp, l.ep);
    if let std::collections::hash_map::Entry::Vacant(e) = cache.layouts.entry(key) {
        e.insert(memory::local_layout(&job.model, l)?);
    }
    let sampled = cache.schedule(l).ok_or_else(|| {
        ParallelError::Schedule(format!(
            "{l}: the schedule cannot be built for pp = {} with {} micro-batches",
            l.pp, l.microbatches
        ))
    })?;
    let sched = &sampled.a.1;
    if l.ep > 1 && sched.has_replicas() {
        return Err(ParallelError::Unsupported(
            "expert parallelism with DualPipe's two copies of the model".into(),
        ));
    }
    let layout = &cache.layouts[&key];
    let per_split = memory::split_bytes(job, l, layout, sched)?;
    let mut ranks = memory::predict(job, l, sched, &sampled.a.3, &per_split, cluster);
    if sampled.b.is_some() {
        for r in ranks.iter_mut() {
            let pp = r.pp_rank;
            let stage = |s: &Schedule, x: usize| per_split[s.stage_split(x)];
            let acts = sampled.at(|s, _, p| p.peak(pp, |x| stage(s, x)) as f64);
            r.account.activations = acts.round().max(0.0) as usize;
        }
    }
    let stages: Vec<Vec<_>> = (0..sched.num_ranks())
        .map(|r| {
            sched
                .local_stages(r)
                .iter()
                .map(|&s| per_split[sched.stage_split(s)])
                .collect()
        })
        .collect();
    let params: Vec<usize> = ranks.iter().map(|r| r.params).collect();
    let group = ranks.iter().map(|r| r.zero_group).max().unwrap_or(1);
    let makespan = sampled.at(|_, x, _| x.makespan);
    let time = time::predict(job, cluster, l, &stages, &params, group, makespan);
    let busy_units = 3.0 * (l.microbatches * sched.local_stages(0).len()) as f64;
    let bubble = (1.0 - busy_units / makespan).max(0.0);
    let (peak, resident) = ranks
        .iter()
        .max_by_key(|r| r.resident())
        .map_or((MemoryAccount::default(), 0), |r| (r.account, r.resident()));
    let host = ranks.iter().map(|r| r.host).max().unwrap_or(0);
    let mut p = Prediction {
        layout: *l,
        fits: false,
        ranks,
        peak,
        resident,
        host,
        time,
        bubble,
    };
    p.fits = p.short(cluster) == (0, 0);
    Ok(p)
}

/// Whether `offload` can run: optimizer offload needs 16-bit weights on the device (fp32
/// weights are their own master copy: nothing would leave the device but the moments) and a
/// cluster with a host side.
pub fn check_offload(job: &Job, cluster: &Cluster, offload: Offload) -> Result<(), ParallelError> {
    if offload == Offload::None {
        return Ok(());
    }
    if job.precision.half().is_none() {
        return Err(ParallelError::Unsupported(
            "optimizer offload in fp32 (it keeps 16-bit weights on the device: train in bf16 or fp16)".into(),
        ));
    }
    if cluster.host.is_none() {
        return Err(ParallelError::Config(format!(
            "optimizer offload on {}, which describes no host memory (a cluster JSON's `host`)",
            cluster.name
        )));
    }
    Ok(())
}

fn divisors(n: usize, fixed: Option<usize>) -> Vec<usize> {
    match fixed {
        Some(f) => vec![f],
        None => (1..=n).filter(|d| n.is_multiple_of(*d)).collect(),
    }
}

/// Every layout of `space` for `job` on all of `cluster`'s devices, each with every offload
/// choice of `space` that can run ([`check_offload`]).
pub fn layouts(job: &Job, cluster: &Cluster, space: &SearchSpace) -> Vec<Layout> {
    let offloads: Vec<Offload> = space
        .offload
        .iter()
        .copied()
        .filter(|&o| check_offload(job, cluster, o).is_ok())
        .collect();
    on_device_layouts(job, cluster, space)
        .into_iter()
        .flat_map(|l| offloads.iter().map(move |&offload| Layout { offload, ..l }))
        .collect()
}

/// Every layout of `space` without offload.
fn on_device_layouts(job: &Job, cluster: &Cluster, space: &SearchSpace) -> Vec<Layout> {
    let world = cluster.devices();
    let m = &job.model;
    let mut out = Vec::new();
    for tp in divisors(world, space.tp) {
        for pp in divisors(world / tp.max(1), space.pp) {
            for cp in divisors(world / (tp * pp).max(1), space.cp) {
                if tp * pp * cp == 0 || !world.is_multiple_of(tp * pp * cp) {
                    continue;
                }
                let dp = world / (tp * pp * cp);
                let too_deep = space.pp.is_none() && pp > space.max_pp;
                if space.dp.is_some_and(|d| d != dp) || pp > m.num_hidden_layers || too_deep {
                    continue;
                }
                let eps = if m.is_moe() {
                    divisors(dp * cp, space.ep)
                } else {
                    vec![space.ep.unwrap_or(1)]
                };
                let sps: &[bool] = match (tp > 1, space.sp_always) {
                    (false, _) => &[false],
                    (true, true) => &[true],
                    (true, false) => &[false, true],
                };
                let schedules: Vec<(Option<ScheduleKind>, usize)> = if pp == 1 {
                    vec![(None, 1)]
                } else {
                    space.schedules.iter().map(|&(k, v)| (Some(k), v)).collect()
                };
                for &ep in &eps {
                    for &sp in sps {
                        for &mb in &space.micro_batches {
                            if !job.global_batch.is_multiple_of(dp * mb) {
                                continue;
                            }
                            let micro = job.global_batch / (dp * mb);
                            for &(schedule, v) in &schedules {
                                for &zero in &space.zero {
                                    if zero != ZeroStage::Ddp && dp * cp == 1 {
                                        continue;
                                    }
                                    for &recompute in &space.recompute {
                                        out.push(Layout {
                                            dp,
                                            tp,
                                            pp,
                                            cp,
                                            ep,
                                            zero,
                                            sp,
                                            schedule,
                                            virtual_stages: v,
                                            micro_batch: mb,
                                            microbatches: micro,
                                            recompute,
                                            offload: Offload::None,
                                        });
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
    }
    out
}

/// Searches `space` (see the module doc).
pub fn plan(job: &Job, cluster: &Cluster, space: &SearchSpace) -> Result<Plan, ParallelError> {
    cluster.check()?;
    job.model
        .validate()
        .map_err(|e| ParallelError::Config(e.to_string()))?;
    if job.global_batch == 0 || job.seq_len == 0 {
        return Err(ParallelError::Config(
            "the global batch and the sequence length must be at least 1".into(),
        ));
    }
    let mut cache = Cache::default();
    let mut all: Vec<Prediction> = layouts(job, cluster, space)
        .iter()
        .filter_map(|l| evaluate_cached(job, cluster, l, &mut cache).ok())
        .collect();
    let evaluated = all.len();
    if evaluated == 0 {
        return Err(ParallelError::Config(format!(
            "no layout of {} devices can run this model with global batch {} and sequence length {} (check the degrees you fixed, and that the global batch is a multiple of the dp degree)",
            cluster.devices(),
            job.global_batch,
            job.seq_len
        )));
    }
    all.sort_by(|a, b| {
        b.time
            .tokens_per_s
            .total_cmp(&a.time.tokens_per_s)
            .then(a.resident.cmp(&b.resident))
    });
    let (feasible, rest): (Vec<_>, Vec<_>) = all.into_iter().partition(|p| p.fits);
    let shortfall = if feasible.is_empty() {
        Some(shortfall(job, cluster, space, rest))
    } else {
        None
    };
    Ok(Plan {
        feasible,
        evaluated,
        shortfall,
    })
}

/// The closest layout and what would make the job fit: more memory per device or per node's
/// host, more devices (the same nodes, up to 64 times as many), a shorter sequence.
fn shortfall(
    job: &Job,
    cluster: &Cluster,
    space: &SearchSpace,
    rest: Vec<Prediction>,
) -> Shortfall {
    let closest = rest
        .into_iter()
        .min_by_key(|p| {
            let (device, host) = p.short(cluster);
            (device + host, p.resident)
        })
        .expect("at least one layout was evaluated");
    let (short, short_host) = closest.short(cluster);
    let mut suggestions = Vec::new();
    if short > 0 {
        suggestions.push(format!(
            "a device with at least {} (this one has {}), at {}",
            human(closest.resident as u64),
            human(cluster.memory_bytes),
            closest.layout
        ));
    }
    if short_host > 0 {
        let per_node = |b: u64| human(b * cluster.devices_per_node as u64);
        suggestions.push(format!(
            "host memory of at least {} per node (this one has {}), at {}",
            per_node(closest.host as u64),
            per_node(cluster.host_share().unwrap_or(0)),
            closest.layout
        ));
    }
    let fits_with = |c: &Cluster, j: &Job| {
        let mut cache = Cache::default();
        layouts(j, c, space)
            .iter()
            .filter_map(|l| evaluate_cached(j, c, l, &mut cache).ok())
            .filter(|p| p.fits)
            .max_by(|a, b| a.time.tokens_per_s.total_cmp(&b.time.tokens_per_s))
    };
    for k in [2, 4, 8, 16, 32, 64] {
        let mut c = cluster.clone();
        if c.nodes == 1 && c.devices_per_node * k <= 8 {
            c.devices_per_node *= k;
        } else {
            c.nodes *= k;
        }
        if let Some(p) = fits_with(&c, job) {
            suggestions.push(format!(
                "{} devices ({} nodes of {}): {} fits, {:.0} tokens/s",
                c.devices(),
                c.nodes,
                c.devices_per_node,
                p.layout,
                p.time.tokens_per_s
            ));
            break;
        }
    }
    let mut seq = job.seq_len / 2;
    while seq >= 128 {
        let j = Job {
            seq_len: seq,
            ..job.clone()
        };
        if let Some(p) = fits_with(cluster, &j) {
            suggestions.push(format!(
                "sequence length {seq} (from {}): {} fits",
                job.seq_len, p.layout
            ));
            break;
        }
        seq /= 2;
    }
    Shortfall {
        closest,
        short_bytes: short,
        short_host_bytes: short_host,
        suggestions,
    }
}
