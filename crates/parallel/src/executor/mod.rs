//! The one executor: runs a rank's schedule — a list of [`Action`]s — over the units of a
//! [`StageModel`], with data parallelism (DDP, ZeRO-1/2/3) over the dp group and the pipeline
//! stages' activations and gradients sent between pp ranks. Training without pipeline
//! parallelism is the one-stage schedule ([`crate::pipeline_parallel::one_stage`]).
//!
//! | stage | parameters | gradients | AdamW m, v (+ fp32 master) | gradient sync | after the update |
//! |-------|------------|-----------|----------------------------|---------------|------------------|
//! | 0 DDP | full       | full      | full                       | bucket all-reduce in a stage's last backward | — |
//! | 1     | full       | full      | shard                      | bucket all-reduce in a stage's last backward | all-gather params |
//! | 2     | full       | shard     | shard                      | bucket reduce-scatter in every backward      | all-gather params |
//! | 3     | shard      | shard     | shard                      | bucket reduce-scatter in every backward      | — (gathered per unit) |
//!
//! Shards are the equal padded ranges of [`ShardSpec`] over the rank's flat buffer. Buckets
//! (whole units, never across two pipeline stages) are launched asynchronously the moment the
//! weight gradients of the last unit they cover are final, so communication runs on the dp
//! group's worker thread while backward continues on this one; `REDUCE_GRAD` waits for them.
//! Stages 0/1 keep their gradients one allocation per bucket ([`Bucketed`]) and lend the bucket
//! itself to the all-reduce (in place, no copy). ZeRO-3 gathers a unit's parameters just
//! before it runs (prefetching the next unit's asynchronously) and frees them after, or keeps a
//! whole stage's between `UNSHARD` and `RESHARD`.
//!
//! Precision ([`Precision`]): fp32, or 16-bit (bf16, fp16) weights and gradients with fp32
//! master weights and moments over the range the rank updates. Gradients are reduced in fp32:
//! each bucket is widened before its reduction and the average rounded once when stored, so
//! the only 16-bit roundings are those the single-process run also makes. fp16 adds dynamic
//! loss scaling: the seed gradient is multiplied by the scale, and a step whose global gradient
//! norm is not finite is skipped (every rank computes the same norm, so all skip together).
//!
//! Files: [`run`] interprets the actions, [`reduce`] launches and completes the bucket
//! reductions, [`optimizer`] clips and updates, [`offload`] moves ZeRO-Offload's gradients
//! and weights between a GPU and the host, [`delayed`] runs its host update beside the next
//! step, [`state`] saves and loads checkpoints.
mod delayed;
mod offload;
pub use offload::host_update_rate;
mod optimizer;
mod reduce;
mod run;
mod state;

use std::collections::HashMap;
use std::ops::Range;
use std::time::{Duration, Instant};

use std::borrow::Cow;

use comm::ProcessGroup;
use model::optim::AdamW;
use serde::Serialize;
use tensor::buf::{Buf, Dev};

use crate::data_parallel::bucket::{Bucket, BucketPlan};
use crate::data_parallel::grad_comm::GradComm;
use crate::data_parallel::powersgd::{BucketLayout, PowerSgd};
use crate::data_parallel::shard::ShardSpec;
use crate::data_parallel::ZeroStage;
use crate::memory::{formula, MemoryAccount};
use crate::pipeline_parallel::link::Link;
use crate::pipeline_parallel::Action;
use crate::precision::{Bucketed, Flat, LossScaler, Precision, CHUNK};
use crate::stage::StageModel;
use crate::ParallelError;
use run::terr;

/// Seed of PowerSGD's first random `Q`s (the same on every rank).
const POWERSGD_SEED: u64 = 0x5057_5253_4744;

/// Configuration of the executor.
#[derive(Clone, Debug)]
pub struct ExecConfig {
    pub zero: ZeroStage,
    /// Gradient bucket size in bytes (PyTorch DDP's default 25 MiB).
    pub bucket_bytes: usize,
    /// The wire format of the gradient reductions over the dp group.
    pub grad_comm: GradComm,
    /// AdamW hyper-parameters; `adamw.lr` is the initial learning rate (see
    /// [`Executor::set_lr`]).
    pub adamw: AdamW,
    /// Global gradient-norm clipping threshold.
    pub max_grad_norm: Option<f32>,
    pub precision: Precision,
    /// Initial loss scale of fp16 training (ignored otherwise).
    pub loss_scale: f64,
    /// This process runs one rank (not ranks as threads): each unit's compute may then run
    /// on the process's kernel pool even when it issues collectives.
    pub one_rank_per_process: bool,
    /// Where the rank's buffers live and its kernels run: the host, or a GPU. On a GPU the
    /// executor's data-parallel, ZeRO and pipeline communication stages through host memory
    /// over the host transports, or runs on NCCL (`nccl` below, and the pipeline's links:
    /// [`Pipeline::use_nccl`]); so do the model's own collectives (tensor, context and expert
    /// parallelism, each with its group's communicator attached).
    pub device: Dev,
    /// ZeRO-Offload (Ren et al. 2021, arXiv 2101.06840): the fp32 master weights and AdamW
    /// moments of what this rank updates live in host memory and AdamW runs on the CPU; the
    /// device keeps the compute weights and gradients. Each step the gradients come to the
    /// host chunk by chunk (widened from 16 bits), the master is updated there, and the
    /// weights go back (rounded). In fp32 the master is then a host copy beside the device
    /// weights. On the CPU nothing moves, but the same path runs (a separate master).
    pub offload_optimizer: bool,
    /// ZeRO-Offload's delayed update ([`delayed`]): the update of every AdamW step past this
    /// many runs on the host beside the next step's forward and backward (`None`: each
    /// update before the next step).
    pub delayed_update_after: Option<u64>,
    /// GPU ranks with a GPU each: the dp group's NCCL communicator, which takes the exact
    /// (uncompressed) gradient reductions and ZeRO's weight gathers of every stage onto the
    /// devices ([`crate::nccl`]); `None`: all of them through host memory over the own
    /// transports.
    pub nccl: Option<crate::nccl::NcclGroup>,
}

impl ExecConfig {
    /// The operand format of the products on this rank's device ([`tensor::operands`]):
    /// 16-bit runs on a GPU feed the tensor cores their storage format; fp32 runs and every
    /// CPU run compute in fp32.
    pub fn operands(&self) -> tensor::operands::Operands {
        use tensor::operands::Operands;
        match (&self.device, self.precision) {
            (Dev::Cuda(_), Precision::Bf16) => Operands::Bf16,
            (Dev::Cuda(_), Precision::Fp16) => Operands::F16,
            _ => Operands::F32,
        }
    }
}

impl Default for ExecConfig {
    fn default() -> Self {
        Self {
            zero: ZeroStage::Ddp,
            bucket_bytes: crate::data_parallel::bucket::DEFAULT_BUCKET_BYTES,
            grad_comm: GradComm::Fp32,
            adamw: AdamW::default(),
            max_grad_norm: Some(1.0),
            precision: Precision::Fp32,
            loss_scale: 65536.0,
            one_rank_per_process: false,
            device: Dev::Cpu,
            offload_optimizer: false,
            delayed_update_after: None,
            nccl: None,
        }
    }
}

/// This rank's place in a pipeline.
#[derive(Clone, Debug)]
pub struct Pipeline {
    /// The pp group (the loss, the validation metric and the gradient norm are summed over
    /// it).
    pub group: ProcessGroup,
    /// The pp rank that runs each stage.
    pub stage_rank: Vec<usize>,
    /// The stages this rank runs, with their units (contiguous, in order, covering all of the
    /// model's units).
    pub local: Vec<(usize, Range<usize>)>,
    /// The link each cross-rank message travels on, by (is a gradient, sending stage): over a
    /// group of the two ranks, the sender first. One link per stage boundary and direction,
    /// each with its own worker thread (or NCCL stream), so messages of different boundaries
    /// never queue behind each other and every link delivers in the order its messages were
    /// sent ([`Link`]).
    pub links: HashMap<(bool, usize), Link>,
    /// How many pp ranks hold this rank's layers (DualPipe: 2, the rank and its mirror; else
    /// 1). The executor's gradient group then spans them all (dp × replicas): their
    /// gradients are averaged like data-parallel ones — each replica's are the mean over its
    /// chain's micro-batches — and reduced only at `REDUCE_GRAD`, so that every member
    /// launches them in the same order; the gradient norm counts each layer once.
    pub replicas: usize,
    /// Stages `0..first_chain_end` form the pipeline's first chain: the one evaluation runs.
    pub first_chain_end: usize,
}

impl Pipeline {
    /// Connects this rank's pipeline: the links of every stage boundary `s → s + 1` for which
    /// `boundary(s)` holds and the two stages run on different ranks. Every rank of `group`
    /// calls it with the same stage placement (a link is created by its two members, in the
    /// same order everywhere).
    pub fn connect(
        comm: &comm::Communicator,
        group: ProcessGroup,
        stage_rank: Vec<usize>,
        local: Vec<(usize, Range<usize>)>,
        boundary: impl Fn(usize) -> bool,
    ) -> Result<Self, ParallelError> {
        let world = group.world_ranks().to_vec();
        let me = group.rank();
        let mut links = HashMap::new();
        for s in 0..stage_rank.len().saturating_sub(1) {
            let (a, b) = (stage_rank[s], stage_rank[s + 1]);
            if !boundary(s) || a == b {
                continue;
            }
            for (gradient, from, to, sender) in [(false, a, b, s), (true, b, a, s + 1)] {
                if me == from || me == to {
                    let label = format!("pp-{}{sender}", if gradient { "grad" } else { "act" });
                    let g = comm.new_named_group(&label, &[world[from], world[to]])?;
                    links.insert((gradient, sender), Link::new(g));
                }
            }
        }
        let first_chain_end = stage_rank.len();
        Ok(Pipeline {
            group,
            stage_rank,
            local,
            links,
            replicas: 1,
            first_chain_end,
        })
    }

    /// The link a message of `gradient` kind sent by stage `sender` travels on.
    fn link(&self, gradient: bool, sender: usize) -> Option<&Link> {
        self.links.get(&(gradient, sender))
    }

    /// Moves every link's device messages onto NCCL (`XTRAIN_BACKEND=nccl`, ranks with a GPU
    /// each), a communicator of the link's two ranks on a side stream of `gpu` each; returns
    /// them (for the GPU's watch). A collective over the pp group: every rank makes its links'
    /// communicators in one global order — by stage boundary, activations first — so that no
    /// two ranks wait for each other's next link.
    pub fn use_nccl(
        &mut self,
        gpu: &std::sync::Arc<tensor::cuda::Gpu>,
    ) -> Result<Vec<crate::nccl::NcclGroup>, ParallelError> {
        let mut keys: Vec<(bool, usize)> = self.links.keys().copied().collect();
        let boundary =
            |&(gradient, sender): &(bool, usize)| (sender - usize::from(gradient), gradient);
        keys.sort_by_key(boundary);
        let mut groups = Vec::with_capacity(keys.len());
        for key in keys {
            let (b, gradient) = boundary(&key);
            let what = if gradient {
                format!("pipeline gradients stage {} → {b}", b + 1)
            } else {
                format!("pipeline activations stage {b} → {}", b + 1)
            };
            let link = self.links.get_mut(&key).expect("a key of the map");
            groups.push(link.use_nccl(gpu, &what)?);
        }
        Ok(groups)
    }
}

/// What one optimizer step reports.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct StepStats {
    /// Mean loss over the global batch (all ranks, all micro-batches).
    pub loss: f32,
    /// Global gradient norm before clipping (of the unscaled gradient).
    pub grad_norm: f32,
    /// False when the step was skipped (a non-finite gradient under fp16 loss scaling).
    pub applied: bool,
    /// The loss scale the step used (1 unless fp16).
    pub loss_scale: f64,
    /// Bytes this rank sent over the dp group during the step (gradient reductions, ZeRO's
    /// gathers): what `train.grad_comm` compresses.
    pub dp_bytes_sent: u64,
    /// A delayed update ran beside the step ([`delayed`]): its seconds on the host, and the
    /// seconds the step waited for it at its optimizer point.
    pub delayed_update: Option<(f64, f64)>,
}

/// Timeline events recorded when tracing is on: the actions of the schedule as they ran (a
/// pipeline's measured timeline), and inside backward the units and bucket reductions (the
/// overlap proof).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TraceKind {
    /// A schedule action started at the event's time and took `took`, of which `waited` went
    /// on waiting for messages from other pp ranks (a pipeline bubble seen from this rank).
    Action {
        action: Action,
        took: Duration,
        waited: Duration,
    },
    BackwardStart(usize),
    BackwardEnd(usize),
    BucketLaunched(usize),
    /// The bucket's reduction was observed complete (polled after each unit's backward; a
    /// bucket first seen complete when its stage's reductions are waited for is recorded then).
    BucketDone(usize),
}

#[derive(Clone, Debug)]
pub struct TraceEvent {
    pub kind: TraceKind,
    pub at: Instant,
}

/// Live and peak bytes of transient buffers.
#[derive(Clone, Copy, Debug, Default)]
struct Gauge {
    cur: usize,
    peak: usize,
}

impl Gauge {
    fn add(&mut self, bytes: usize) {
        self.cur += bytes;
        self.peak = self.peak.max(self.cur);
    }
    fn sub(&mut self, bytes: usize) {
        self.cur = self.cur.saturating_sub(bytes);
    }
}

/// A host fp32 buffer of a widened 16-bit unit (its weights, or its gradients), kept from one
/// unit to the next of the same size within an action, and counted in the byte account while
/// kept. Why: a unit's fp32 copy is above glibc's 32 MiB mmap ceiling from a few million
/// parameters on, so a fresh one is new pages, each faulted in and zeroed by the kernel on
/// first touch — most of a small-batch bf16 step on the CPU, where the same pages can be
/// reused by the next layer (all a model's layers are one size).
#[derive(Debug, Default)]
struct Spare(Vec<f32>);

impl Spare {
    /// A buffer of `n` elements for a unit, contents unspecified: the kept one when it holds
    /// exactly `n`, else a new one (the kept one freed); `gauge` counts it either way.
    fn take(&mut self, n: usize, gauge: &mut Gauge) -> Vec<f32> {
        let kept = std::mem::take(&mut self.0);
        if kept.len() == n && n > 0 {
            return kept;
        }
        gauge.sub(kept.len() * F32);
        gauge.add(n * F32);
        vec![0.0; n]
    }

    /// Keeps a unit's buffer for the next unit (still counted), freeing the one kept before.
    fn keep(&mut self, v: Vec<f32>, gauge: &mut Gauge) {
        gauge.sub(self.0.len() * F32);
        self.0 = v;
    }

    /// Frees the kept buffer.
    fn clear(&mut self, gauge: &mut Gauge) {
        self.keep(Vec::new(), gauge);
    }
}

/// A pipeline stage this rank runs.
#[derive(Clone, Debug)]
struct LocalStage {
    id: usize,
    units: Range<usize>,
    /// Its buckets (indices into `Executor::buckets`).
    buckets: Range<usize>,
}

const F32: usize = 4;

/// One rank's training state and the machinery that steps it.
pub struct Executor<M: StageModel> {
    model: M,
    dp: ProcessGroup,
    pipe: Option<Pipeline>,
    stages: Vec<LocalStage>,
    num_stages: usize,
    cfg: ExecConfig,
    units: Vec<Range<usize>>,
    /// Per unit, the parts its kernels read as values ([`StageModel::value_ranges`]), asked
    /// once.
    value_parts: Vec<Vec<Range<usize>>>,
    spec: ShardSpec,
    buckets: Vec<Bucket>,
    /// The bucket each unit's gradients belong to.
    unit_bucket: Vec<usize>,
    /// Stages 2/3: each bucket's fp32 gradients of the current backward, until reduced (on
    /// the executor's device).
    staging: Vec<Option<Buf>>,
    /// Compute weights: full (stages 0-2) or this rank's padded shard (stage 3). In fp32 they
    /// are also the master weights.
    params: Flat,
    /// Full, bucket by bucket (stages 0-1), or this rank's padded shard (stages 2-3).
    grads: Bucketed,
    /// 16-bit training only (empty in fp32): the fp32 master weights of the range AdamW
    /// updates, like `m` and `v`, on the executor's device.
    master: Buf,
    /// Full (stage 0) or this rank's padded shard (stages 1-3), on the executor's device.
    m: Buf,
    v: Buf,
    step: u64,
    lr: f32,
    scaler: LossScaler,
    /// ZeRO-3: units gathered by `UNSHARD`, kept until `RESHARD` (on the executor's device).
    resident: HashMap<usize, Buf>,
    comm_bytes: Gauge,
    /// Largest reduction a non-root rank has sent: comm's `reduce` sums partial results in a
    /// scratch copy of the input there, and the group's worker runs one collective at a time,
    /// so at most one such copy is alive.
    reduce_scratch: usize,
    /// Gathered (ZeRO-3) or widened (16-bit) unit parameters and widened unit gradients.
    gathered_bytes: Gauge,
    /// The widened weights and gradients of the last unit (16-bit storage on the host).
    spare_params: Spare,
    spare_grads: Spare,
    act_bytes: Gauge,
    trace: Option<Vec<TraceEvent>>,
    /// PowerSGD's state and each bucket's layout (`grad_comm = powersgd:R`).
    powersgd: Option<(PowerSgd, Vec<BucketLayout>)>,
    /// This rank's copies of a tied tensor ([`StageModel::tied_ranges`]), and whether each
    /// bucket holds one: those are reduced at the end of the step, after the copies' sum
    /// (`reduce::reduce_tied`).
    tied: Vec<Range<usize>>,
    tied_bucket: Vec<bool>,
    /// ZeRO-Offload of 16-bit weights: the host buffers the gradients land in during the
    /// backward and (on a GPU, page-locked) the rounded weights go up from ([`offload`]);
    /// made at the first step, kept.
    offload: Option<offload::OffloadTraffic>,
    /// The update held for the next step, and its buffers ([`delayed`]).
    delayed: delayed::Delayed,
}

impl<M: StageModel> Executor<M> {
    /// Builds the executor for `model` over the dp group `dp` (and, with pipeline parallelism,
    /// the pipeline `pipe`) from an initialiser that writes elements `range` of the rank's
    /// initial flat parameters into `out` (e.g. [`crate::DecoderStage::init_range`]). Only
    /// the elements this rank keeps are generated: its shard at ZeRO-3.
    pub fn new(
        model: M,
        dp: ProcessGroup,
        pipe: Option<Pipeline>,
        cfg: ExecConfig,
        init: impl Fn(Range<usize>, &mut [f32]),
    ) -> Result<Self, ParallelError> {
        let units = model.units();
        check_units(&units)?;
        let total = units.last().map_or(0, |u| u.end);
        let (stages_spec, num_stages) = match &pipe {
            None => (vec![(0, 0..units.len())], 1),
            Some(p) => (p.local.clone(), p.stage_rank.len()),
        };
        check_stages(&stages_spec, units.len(), num_stages)?;
        if pipe.as_ref().is_some_and(|p| p.replicas > 1) && cfg.zero.shards_grads() {
            return Err(ParallelError::Unsupported(format!(
                "ZeRO-{} with a pipeline whose ranks hold replicated layers (DualPipe): replicas reduce their gradients once, at the end of the step, so sharded gradients would have to be held whole anyway (use ZeRO-0 or 1)",
                cfg.zero.index()
            )));
        }
        let spec = ShardSpec::new(total, dp.size())?;
        let dev = cfg.device.clone();
        let zero = cfg.zero;
        // Buckets hold whole units of one stage: a unit's gradients are written by one call
        // into one contiguous slice, and its backward returning is the grads-ready event.
        let cap = BucketPlan::cap_elems(cfg.bucket_bytes, F32);
        let mut buckets = Vec::new();
        let mut stages = Vec::with_capacity(stages_spec.len());
        for (id, ur) in stages_spec {
            let first = buckets.len();
            buckets.extend(BucketPlan::new(&units[ur.clone()], cap)?.buckets);
            stages.push(LocalStage {
                id,
                units: ur,
                buckets: first..buckets.len(),
            });
        }
        let unit_bucket = units
            .iter()
            .map(|u| {
                buckets
                    .iter()
                    .position(|b| b.range.start <= u.start && u.end <= b.range.end)
                    .expect("every unit lies in one bucket")
            })
            .collect();
        let me = dp.rank();
        let own = spec.range(me);
        let precision = cfg.precision;
        // A buffer of `len` elements whose first real elements are flat range `r`.
        let fill = |r: Range<usize>, len: usize| {
            let mut b = vec![0.0; len];
            init(r.clone(), &mut b[..r.len()]);
            b
        };
        let per = |sharded: bool| if sharded { spec.shard_len() } else { total };
        let dev_err = |e: tensor::TensorError| ParallelError::Model(e.to_string());
        // Made on the host, then (on a GPU) uploaded: the same values on either device. A
        // separate fp32 master exists in 16-bit training and under ZeRO-Offload.
        let offload = cfg.offload_optimizer;
        let (params, master) = match precision.half() {
            None if zero.shards_params() && !offload => {
                (Flat::F32(fill(own.clone(), spec.shard_len())), None)
            }
            None if !offload => (Flat::F32(fill(0..total, total)), None),
            _ => {
                let master = if zero.shards_optimizer() {
                    fill(own.clone(), spec.shard_len())
                } else {
                    fill(0..total, total)
                };
                let params = if zero.shards_params() || !zero.shards_optimizer() {
                    // The rounded master itself (the shard at ZeRO-3, everything for DDP).
                    let mut p = Flat::zeros(master.len(), precision);
                    p.write(0, &master).map_err(dev_err)?;
                    p
                } else {
                    // Full 16-bit weights beside a master shard: generated chunk by chunk, so
                    // no full fp32 copy ever exists.
                    let mut p = Flat::zeros(total, precision);
                    let mut buf = vec![0.0; CHUNK.min(total)];
                    for s in (0..total).step_by(CHUNK) {
                        let e = (s + CHUNK).min(total);
                        init(s..e, &mut buf[..e - s]);
                        p.write(s, &buf[..e - s]).map_err(dev_err)?;
                    }
                    p
                };
                (params, Some(master))
            }
        };
        let params = params.to_dev(&dev).map_err(dev_err)?;
        // Where AdamW's state lives: the device, or the host under ZeRO-Offload.
        let state_dev = if offload { Dev::Cpu } else { dev.clone() };
        let master = match master {
            Some(m) => state_dev.from_vec(m).map_err(dev_err)?,
            None => Buf::Host(Vec::new()),
        };
        // Stages 0/1: the full gradients, one allocation per bucket (all-reduced in place);
        // stages 2/3: the shard.
        let grads = if zero.shards_grads() {
            std::iter::once(0..spec.shard_len()).collect()
        } else {
            buckets.iter().map(|b| b.range.clone()).collect()
        };
        let grads = Bucketed::zeros_on(&dev, grads, precision).map_err(dev_err)?;
        let m = state_dev
            .zeros(per(zero.shards_optimizer()))
            .map_err(dev_err)?;
        let v = state_dev
            .zeros(per(zero.shards_optimizer()))
            .map_err(dev_err)?;
        let lr = cfg.adamw.lr;
        let scaler = LossScaler::new(precision, cfg.loss_scale);
        let staging = (0..buckets.len()).map(|_| None).collect();
        let powersgd = match cfg.grad_comm {
            GradComm::PowerSgd { rank, .. } => {
                if zero.shards_grads() {
                    return Err(ParallelError::Unsupported(format!(
                        "PowerSGD compresses whole gradient buckets; ZeRO-{} reduces shards (use ZeRO-0 or 1, or grad_comm bf16 / fp8)",
                        zero.index()
                    )));
                }
                let tensors: Vec<(Range<usize>, Vec<usize>)> = model
                    .placements()
                    .iter()
                    .map(|p| (p.range(), p.slice.local.clone()))
                    .collect();
                let layouts = buckets
                    .iter()
                    .map(|b| BucketLayout::new(b.range.clone(), &tensors, rank))
                    .collect();
                Some((PowerSgd::new(rank, POWERSGD_SEED), layouts))
            }
            _ => None,
        };
        let tied = model.tied_ranges();
        let tied_bucket = buckets
            .iter()
            .map(|b| {
                tied.iter()
                    .any(|t| t.start < b.range.end && b.range.start < t.end)
            })
            .collect();
        let value_parts = (0..units.len()).map(|u| model.value_ranges(u)).collect();
        Ok(Self {
            model,
            dp,
            pipe,
            stages,
            num_stages,
            cfg,
            units,
            value_parts,
            spec,
            buckets,
            unit_bucket,
            staging,
            params,
            grads,
            master,
            m,
            v,
            step: 0,
            lr,
            scaler,
            resident: HashMap::new(),
            comm_bytes: Gauge::default(),
            reduce_scratch: 0,
            gathered_bytes: Gauge::default(),
            spare_params: Spare::default(),
            spare_grads: Spare::default(),
            act_bytes: Gauge::default(),
            trace: None,
            powersgd,
            tied,
            tied_bucket,
            offload: None,
            delayed: delayed::Delayed::default(),
        })
    }

    /// [`Self::new`] from the full initial parameters (the same on every rank).
    pub fn from_params(
        model: M,
        dp: ProcessGroup,
        cfg: ExecConfig,
        init: &[f32],
    ) -> Result<Self, ParallelError> {
        let total = model.units().last().map_or(0, |u| u.end);
        if init.len() != total {
            return Err(ParallelError::Layout(format!(
                "initial parameters have {} elements, the model's units cover {total}",
                init.len()
            )));
        }
        Self::new(model, dp, None, cfg, |r, out| out.copy_from_slice(&init[r]))
    }

    pub fn model(&self) -> &M {
        &self.model
    }
    pub fn dp_group(&self) -> &ProcessGroup {
        &self.dp
    }
    pub fn config(&self) -> &ExecConfig {
        &self.cfg
    }
    pub fn spec(&self) -> &ShardSpec {
        &self.spec
    }
    pub fn buckets(&self) -> &[Bucket] {
        &self.buckets
    }
    pub fn units(&self) -> &[Range<usize>] {
        &self.units
    }
    /// Optimizer steps taken.
    pub fn step_count(&self) -> u64 {
        self.step
    }
    pub fn loss_scaler(&self) -> &LossScaler {
        &self.scaler
    }
    /// Number of pipeline stages of the whole model (1 without pipeline parallelism).
    pub fn num_stages(&self) -> usize {
        self.num_stages
    }

    /// Learning rate of the next steps (from the schedule).
    pub fn set_lr(&mut self, lr: f32) {
        self.lr = lr;
    }

    /// Starts recording a timeline of actions, backward units and bucket events.
    pub fn enable_trace(&mut self) {
        self.trace = Some(Vec::new());
    }
    /// The events recorded since the last call (tracing stays on).
    pub fn take_trace(&mut self) -> Vec<TraceEvent> {
        self.trace.replace(Vec::new()).unwrap_or_default()
    }
    fn record(&mut self, kind: TraceKind) {
        self.record_at(kind, Instant::now());
    }
    fn record_at(&mut self, kind: TraceKind, at: Instant) {
        if let Some(t) = &mut self.trace {
            t.push(TraceEvent { kind, at });
        }
    }
    fn tracing(&self) -> bool {
        self.trace.is_some()
    }

    /// One optimizer step over this rank's micro-batches with the one-stage schedule (no
    /// pipeline parallelism).
    pub fn train_step(&mut self, micro: &[M::Batch]) -> Result<StepStats, ParallelError> {
        if self.num_stages != 1 {
            return Err(ParallelError::Config(format!(
                "{} pipeline stages need a pipeline schedule",
                self.num_stages
            )));
        }
        let schedule = crate::pipeline_parallel::one_stage(micro.len());
        self.run_step(micro, &schedule)
    }

    /// Accounted bytes on this rank: the persistent buffers, and the peaks of the transient
    /// ones (communication buffers include ZeRO-3's gathered units).
    pub fn memory(&self) -> MemoryAccount {
        let (master, optimizer) = (self.master.bytes(), self.m.bytes() + self.v.bytes());
        MemoryAccount {
            params: self.params.bytes(),
            grads: self.grads.bytes(),
            master,
            optimizer,
            comm_buffers: self.comm_bytes.peak + self.reduce_scratch + self.gathered_bytes.peak,
            activations: self.act_bytes.peak,
        }
    }

    /// Bytes of [`Self::memory`] held in host memory rather than on the GPU: the master
    /// weights and moments under ZeRO-Offload (0 otherwise, and on the CPU).
    pub fn offloaded_bytes(&self) -> usize {
        if self.cfg.offload_optimizer && self.cfg.device.is_cuda() {
            self.master.bytes() + self.m.bytes() + self.v.bytes()
        } else {
            0
        }
    }

    /// Bytes of page-locked host memory ZeRO-Offload holds beside [`Self::offloaded_bytes`]:
    /// the landed 16-bit gradients and the two upload stages, and a delayed update's held
    /// gradients (0 before the first step).
    pub fn offload_pinned_bytes(&self) -> usize {
        self.offload.as_ref().map_or(0, |t| t.pinned_bytes()) + self.delayed.pinned_bytes()
    }

    /// Whether gradient reductions wait for `REDUCE_GRAD` (replicated layers: one launch order
    /// on every member of the gradient group).
    fn defer_reductions(&self) -> bool {
        self.pipe.as_ref().is_some_and(|p| p.replicas > 1)
    }

    /// Peak bytes of gathered (non-owned) or widened parameters alive at once.
    pub fn peak_gathered_bytes(&self) -> usize {
        self.gathered_bytes.peak
    }

    /// The formula's model-state bytes for this configuration.
    pub fn formula(&self) -> MemoryAccount {
        formula(
            self.spec.total(),
            self.dp.size(),
            self.cfg.zero,
            self.cfg.precision,
        )
    }

    /// The fp32 master weights this rank holds on the host (downloaded from a GPU): full
    /// (`false`) or its shard (`true`).
    fn master_view(&self) -> Result<(Cow<'_, [f32]>, bool), ParallelError> {
        if self.cfg.offload_optimizer {
            return Ok((
                Cow::Borrowed(self.master.as_host("the offloaded master weights")?),
                self.cfg.zero.shards_optimizer(),
            ));
        }
        Ok(match &self.params {
            Flat::F32(p) => (Cow::Borrowed(p), self.cfg.zero.shards_params()),
            Flat::Half { .. } => (
                Cow::Borrowed(self.master.as_host("the master weights").map_err(terr)?),
                self.cfg.zero.shards_optimizer(),
            ),
            Flat::Dev(b) => (
                Cow::Owned(b.to_vec().map_err(terr)?),
                self.cfg.zero.shards_params(),
            ),
            Flat::DevHalf { .. } => (
                Cow::Owned(self.master.to_vec().map_err(terr)?),
                self.cfg.zero.shards_optimizer(),
            ),
        })
    }

    /// This rank's gradient buffer as fp32 on the host (its shard at ZeRO-2/3): what the last
    /// step's backward and reductions produced, loss-scaled, and clipped in place when fp32
    /// training clipped. For tests and diagnostics.
    pub fn local_grads(&self) -> Result<Vec<f32>, ParallelError> {
        self.grads.download().map_err(terr)
    }

    /// This rank's whole flat buffer of fp32 (master) parameters on the host; a collective
    /// over the dp group where the master weights are sharded (every dp rank must call it).
    pub fn full_params(&self) -> Result<Vec<f32>, ParallelError> {
        let (master, sharded) = self.master_view()?;
        if !sharded {
            return Ok(master[..self.spec.total()].to_vec());
        }
        let n = self.spec.range(self.dp.rank()).len();
        let (full, _) = self.dp.all_gather_v(&master[..n])?;
        Ok(full)
    }
}

fn check_units(units: &[Range<usize>]) -> Result<(), ParallelError> {
    let mut next = 0;
    for (i, u) in units.iter().enumerate() {
        if u.start != next || u.end < u.start {
            return Err(ParallelError::Layout(format!(
                "unit {i} covers {u:?}; units must be contiguous from 0"
            )));
        }
        next = u.end;
    }
    if units.is_empty() {
        return Err(ParallelError::Layout("the model has no units".into()));
    }
    Ok(())
}

fn check_stages(
    stages: &[(usize, Range<usize>)],
    units: usize,
    num_stages: usize,
) -> Result<(), ParallelError> {
    let mut next = 0;
    for (id, r) in stages {
        if r.start != next || r.is_empty() || *id >= num_stages {
            return Err(ParallelError::Layout(format!(
                "stage {id} holds units {r:?}: a rank's stages must hold consecutive, non-empty runs of its {units} units, with ids below {num_stages}"
            )));
        }
        next = r.end;
    }
    if next != units {
        return Err(ParallelError::Layout(format!(
            "the rank's stages hold {next} of its {units} units"
        )));
    }
    Ok(())
}

/// Tag of a pipeline message: the kind (activation or gradient), the stage that receives it,
/// the micro-batch.
fn p2p_tag(gradient: bool, to_stage: usize, mb: usize) -> u32 {
    ((gradient as u32) << 30) | ((to_stage as u32 & 0x3FFF) << 16) | (mb as u32 & 0xFFFF)
}

/// The text of a schedule error naming the action.
fn schedule_err(a: &Action, msg: impl std::fmt::Display) -> ParallelError {
    ParallelError::Schedule(format!("{a}: {msg}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A kept buffer is lent again for a unit of its size (the same allocation, still
    /// counted once), replaced for another size (the gauge follows), and freed by `clear`.
    #[test]
    fn spares_are_reused_for_equal_units_and_always_counted() {
        let (mut spare, mut gauge) = (Spare::default(), Gauge::default());
        let mut a = spare.take(1000, &mut gauge);
        assert_eq!((a.len(), gauge.cur), (1000, 4000));
        a[7] = 3.0;
        let at = a.as_ptr();
        spare.keep(a, &mut gauge);
        assert_eq!(gauge.cur, 4000, "a kept buffer stays counted");
        let b = spare.take(1000, &mut gauge);
        assert_eq!(
            (b.as_ptr(), gauge.cur),
            (at, 4000),
            "lent again, counted once"
        );
        spare.keep(b, &mut gauge);
        let c = spare.take(600, &mut gauge);
        assert_eq!((c.len(), gauge.cur), (600, 2400), "another size: replaced");
        spare.keep(c, &mut gauge);
        spare.clear(&mut gauge);
        assert_eq!((gauge.cur, gauge.peak), (0, 4000));
        assert!(spare.take(0, &mut gauge).is_empty());
        assert_eq!(gauge.cur, 0);
    }
}
