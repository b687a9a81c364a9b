//! The data-parallel engine: one training step of DDP or ZeRO-1/2/3 over a [`StagedModel`],
//! parameterised by the stage (what is sharded) rather than written four times.
//!
//! | stage | parameters | gradients | AdamW m, v | gradient sync | after the update |
//! |-------|------------|-----------|------------|---------------|------------------|
//! | 0 DDP | full       | full      | full       | bucket all-reduce on the last micro-step | — |
//! | 1     | full       | full      | shard      | bucket all-reduce on the last micro-step | all-gather params |
//! | 2     | full       | shard     | shard      | bucket reduce-scatter every micro-step   | all-gather params |
//! | 3     | shard      | shard     | shard      | bucket reduce-scatter every micro-step   | — (gathered per unit) |
//!
//! Shards are the equal padded ranges of [`ShardSpec`]. Buckets are launched asynchronously the
//! moment the backward of the last unit they cover returns (an all-reduce for stages 0/1, a
//! reduce-scatter with uneven pieces for 2/3), so communication runs on the group's worker
//! thread while backward continues on this one. ZeRO-3 gathers a unit's parameters just before its forward
//! (prefetching the next unit's asynchronously), frees them after, and does the same in reverse
//! for backward, so at most two gathered units are alive beside the shard.
use std::ops::Range;
use std::time::Instant;

use comm::{ProcessGroup, ReduceOp, Work};
use model::optim::{clip_factor, grad_sq_sum, scale_grads, AdamW};

use crate::bucket::{BucketPlan, ReadyTracker};
use crate::memory::{formula, MemoryBytes, Precision, ZeroStage};
use crate::shard::ShardSpec;
use crate::staged::StagedModel;
use crate::ParallelError;

/// Configuration of data-parallel training.
#[derive(Clone, Debug)]
pub struct DpConfig {
    pub stage: ZeroStage,
    /// Gradient bucket size in bytes (PyTorch DDP's default 25 MB).
    pub bucket_bytes: usize,
    /// AdamW hyper-parameters; `adamw.lr` is the initial learning rate (see
    /// [`DataParallel::set_lr`]).
    pub adamw: AdamW,
    /// Global gradient-norm clipping threshold.
    pub max_grad_norm: Option<f32>,
}

impl Default for DpConfig {
    fn default() -> Self {
        Self {
            stage: ZeroStage::Ddp,
            bucket_bytes: crate::bucket::DEFAULT_BUCKET_BYTES,
            adamw: AdamW::default(),
            max_grad_norm: Some(1.0),
        }
    }
}

/// What one optimizer step reports.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepStats {
    /// Mean loss over the global batch (all ranks, all micro-steps).
    pub loss: f32,
    /// Global gradient norm before clipping.
    pub grad_norm: f32,
}

/// Timeline events recorded when tracing is on (the overlap proof).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TraceKind {
    BackwardStart(usize),
    BackwardEnd(usize),
    BucketLaunched(usize),
    /// The bucket's reduction was observed complete (polled after each unit's backward; a
    /// bucket first seen complete at the end of backward is recorded then).
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

/// A reduction in flight.
enum Pending {
    /// Stages 0/1: the bucket's gradients, summed over ranks.
    AllReduce { bucket: usize, work: Work<Vec<f32>> },
    /// Stages 2/3: the piece of a bucket owned by `root`, summed onto `root`.
    Reduce {
        bucket: usize,
        root: usize,
        range: Range<usize>,
        /// Bytes accounted for this reduction's buffer.
        bytes: usize,
        work: Work<Vec<f32>>,
    },
}

impl Pending {
    fn bucket(&self) -> usize {
        match self {
            Pending::AllReduce { bucket, .. } | Pending::Reduce { bucket, .. } => *bucket,
        }
    }
}

pub struct DataParallel<M: StagedModel> {
    model: M,
    group: ProcessGroup,
    cfg: DpConfig,
    units: Vec<Range<usize>>,
    spec: ShardSpec,
    plan: BucketPlan,
    /// Stages 2/3: the bucket each unit's gradients are staged in.
    unit_bucket: Vec<usize>,
    staging: Vec<Option<Vec<f32>>>,
    /// Full (stages 0-2) or this rank's padded shard (stage 3).
    params: Vec<f32>,
    /// Full (stages 0-1) or this rank's padded shard (stages 2-3).
    grads: Vec<f32>,
    /// Full (stage 0) or this rank's padded shard (stages 1-3).
    m: Vec<f32>,
    v: Vec<f32>,
    step: u64,
    lr: f32,
    comm_bytes: Gauge,
    /// Largest reduction a non-root rank has sent: comm's `reduce` sums partial results in a
    /// scratch copy of the input there, and the group's worker runs one collective at a time,
    /// so at most one such copy is alive.
    reduce_scratch: usize,
    gathered_bytes: Gauge,
    act_bytes: Gauge,
    trace: Option<Vec<TraceEvent>>,
}

const F32: usize = 4;

impl<M: StagedModel> DataParallel<M> {
    /// Builds the engine on `group` from the full initial parameters (the same on every rank).
    pub fn new(
        model: M,
        group: ProcessGroup,
        cfg: DpConfig,
        init: &[f32],
    ) -> Result<Self, ParallelError> {
        let total = model.units().last().map(|u| u.end).unwrap_or(0);
        if init.len() != total {
            return Err(ParallelError::Layout(format!(
                "initial parameters have {} elements, the model's units cover {total}",
                init.len()
            )));
        }
        Self::with_init(model, group, cfg, |r, out| out.copy_from_slice(&init[r]))
    }

    /// Builds the engine from an initialiser that writes elements `range` of the flat initial
    /// parameters into `out` (e.g. `model::Model::init_range`). Only the elements this rank
    /// keeps are generated: its shard at ZeRO-3, so no rank ever holds the full fp32 model.
    pub fn with_init(
        model: M,
        group: ProcessGroup,
        cfg: DpConfig,
        init: impl Fn(Range<usize>, &mut [f32]),
    ) -> Result<Self, ParallelError> {
        let units = model.units();
        let total = units.last().map(|u| u.end).unwrap_or(0);
        check_units(&units)?;
        let spec = ShardSpec::new(total, group.size())?;
        let stage = cfg.stage;
        // Stages 0/1 keep the full gradient buffer, so buckets can cut at tensor boundaries;
        // stages 2/3 stage gradients per bucket, which must then hold whole units.
        let grain = if stage.shards_grads() {
            units.clone()
        } else {
            model.tensors()
        };
        let plan = BucketPlan::new(&grain, BucketPlan::cap_elems(cfg.bucket_bytes, F32))?;
        let unit_bucket = units
            .iter()
            .map(|u| {
                plan.buckets
                    .iter()
                    .position(|b| b.range.start <= u.start && u.end <= b.range.end)
                    .unwrap_or(0)
            })
            .collect();
        let staging = vec![None; plan.buckets.len()];
        let me = group.rank();
        let params = if stage.shards_params() {
            let mut s = vec![0.0; spec.shard_len()];
            let r = spec.range(me);
            init(r.clone(), &mut s[..r.len()]);
            s
        } else {
            let mut p = vec![0.0; total];
            init(0..total, &mut p);
            p
        };
        let per = |sharded: bool| vec![0.0; if sharded { spec.shard_len() } else { total }];
        let grads = per(stage.shards_grads());
        let m = per(stage.shards_optimizer());
        let v = per(stage.shards_optimizer());
        let lr = cfg.adamw.lr;
        Ok(Self {
            model,
            group,
            cfg,
            units,
            spec,
            plan,
            unit_bucket,
            staging,
            params,
            grads,
            m,
            v,
            step: 0,
            lr,
            comm_bytes: Gauge::default(),
            reduce_scratch: 0,
            gathered_bytes: Gauge::default(),
            act_bytes: Gauge::default(),
            trace: None,
        })
    }

    pub fn model(&self) -> &M {
        &self.model
    }
    pub fn group(&self) -> &ProcessGroup {
        &self.group
    }
    pub fn config(&self) -> &DpConfig {
        &self.cfg
    }
    pub fn spec(&self) -> &ShardSpec {
        &self.spec
    }
    pub fn plan(&self) -> &BucketPlan {
        &self.plan
    }
    pub fn units(&self) -> &[Range<usize>] {
        &self.units
    }
    /// Optimizer steps taken.
    pub fn step_count(&self) -> u64 {
        self.step
    }

    /// Learning rate of the next steps (from the schedule).
    pub fn set_lr(&mut self, lr: f32) {
        self.lr = lr;
    }

    /// Starts recording a timeline of backward and bucket events.
    pub fn enable_trace(&mut self) {
        self.trace = Some(Vec::new());
    }
    pub fn take_trace(&mut self) -> Vec<TraceEvent> {
        self.trace.replace(Vec::new()).unwrap_or_default()
    }
    fn record(&mut self, kind: TraceKind) {
        if let Some(t) = &mut self.trace {
            t.push(TraceEvent {
                kind,
                at: Instant::now(),
            });
        }
    }

    /// One optimizer step over this rank's micro-batches (the accumulation steps).
    pub fn train_step(&mut self, micro: &[M::Batch]) -> Result<StepStats, ParallelError> {
        if micro.is_empty() {
            return Err(ParallelError::Config(
                "a step needs at least one micro-batch".into(),
            ));
        }
        self.grads.iter_mut().for_each(|g| *g = 0.0);
        let scale = 1.0 / micro.len() as f32;
        let mut loss = 0.0f32;
        for (a, batch) in micro.iter().enumerate() {
            // DDP and ZeRO-1 accumulate locally and reduce once; ZeRO-2/3 keep no full
            // gradient buffer, so every micro-step reduces into the shard.
            let reduce = self.cfg.stage.shards_grads() || a + 1 == micro.len();
            loss += self.micro_step(batch, scale, reduce)?;
        }
        let mut l = [loss * scale];
        self.group.all_reduce(&mut l, ReduceOp::Sum)?;
        let grad_norm = self.optimizer_step()?;
        Ok(StepStats {
            loss: l[0] / self.group.size() as f32,
            grad_norm,
        })
    }

    /// Forward and backward of one micro-batch; returns its loss.
    fn micro_step(
        &mut self,
        batch: &M::Batch,
        scale: f32,
        reduce: bool,
    ) -> Result<f32, ParallelError> {
        let n = self.units.len();
        let stage3 = self.cfg.stage.shards_params();
        let mut caches = Vec::with_capacity(n);
        let mut x = None;
        let mut prefetch = stage3.then(|| self.gather_async(0));
        for u in 0..n {
            let owned = match prefetch.take() {
                Some(w) => {
                    if u + 1 < n {
                        prefetch = Some(self.gather_async(u + 1));
                    }
                    Some(self.finish_gather(u, w)?)
                }
                None => None,
            };
            let p = match &owned {
                Some(o) => o.as_slice(),
                None => &self.params[self.units[u].clone()],
            };
            let (y, cache) = self.model.forward(u, p, x.take(), batch, scale)?;
            self.act_bytes.add(self.model.cache_bytes(&cache));
            caches.push(cache);
            if let Some(o) = owned {
                self.gathered_bytes.sub(o.len() * F32);
            }
            x = Some(y);
        }
        let out = x.ok_or_else(|| ParallelError::Layout("the model has no units".into()))?;
        let loss = self.model.loss(&out);

        let mut tracker = reduce.then(|| ReadyTracker::new(&self.plan));
        let mut pending: Vec<Pending> = Vec::new();
        let mut dy = None;
        let mut prefetch = stage3.then(|| self.gather_async(n - 1));
        for u in (0..n).rev() {
            let cache = caches.pop().expect("one cache per unit");
            let cache_bytes = self.model.cache_bytes(&cache);
            let owned = match prefetch.take() {
                Some(w) => {
                    if u > 0 {
                        prefetch = Some(self.gather_async(u - 1));
                    }
                    Some(self.finish_gather(u, w)?)
                }
                None => None,
            };
            self.record(TraceKind::BackwardStart(u));
            let range = self.units[u].clone();
            let p = match &owned {
                Some(o) => o.as_slice(),
                None => &self.params[range.clone()],
            };
            let dx = if self.cfg.stage.shards_grads() {
                let b = self.unit_bucket[u];
                let br = self.plan.buckets[b].range.clone();
                let comm_bytes = &mut self.comm_bytes;
                let buf = self.staging[b].get_or_insert_with(|| {
                    comm_bytes.add(br.len() * F32);
                    vec![0.0; br.len()]
                });
                let g = &mut buf[range.start - br.start..range.end - br.start];
                self.model.backward(u, p, cache, dy.take(), scale, g)?
            } else {
                self.model.backward(
                    u,
                    p,
                    cache,
                    dy.take(),
                    scale,
                    &mut self.grads[range.clone()],
                )?
            };
            self.act_bytes.sub(cache_bytes);
            if let Some(o) = owned {
                self.gathered_bytes.sub(o.len() * F32);
            }
            self.record(TraceKind::BackwardEnd(u));
            if let Some(tr) = &mut tracker {
                for b in tr.mark(range)? {
                    self.launch(b, &mut pending)?;
                }
            }
            // Consume reductions that already finished, so their buffers are freed during
            // backward rather than at its end.
            self.drain(&mut pending, false)?;
            dy = dx;
        }
        if let Some(tr) = &tracker {
            let missing = tr.incomplete();
            if !missing.is_empty() {
                return Err(ParallelError::Protocol(format!(
                    "buckets {missing:?} never became ready"
                )));
            }
        }
        self.drain(&mut pending, true)?;
        Ok(loss)
    }

    /// Launches the reduction of bucket `b` (its gradients are final).
    fn launch(&mut self, b: usize, pending: &mut Vec<Pending>) -> Result<(), ParallelError> {
        self.record(TraceKind::BucketLaunched(b));
        let br = self.plan.buckets[b].range.clone();
        if !self.cfg.stage.shards_grads() {
            let buf = self.grads[br.clone()].to_vec();
            self.comm_bytes.add(buf.len() * F32);
            pending.push(Pending::AllReduce {
                bucket: b,
                work: self.group.all_reduce_async(buf, ReduceOp::Sum),
            });
            return Ok(());
        }
        let buf = self.staging[b].take().ok_or_else(|| {
            ParallelError::Protocol(format!("bucket {b} has no staged gradients"))
        })?;
        // Reduce-scatter with uneven pieces: each piece of the bucket is summed onto the rank
        // whose shard contains it (one reduce per owning rank, issued in the same order
        // everywhere). A bucket inside one shard (the usual case when buckets are smaller than
        // shards) is handed over without a copy; a bucket spanning shards is copied piece by
        // piece and its staging buffer freed, so in-flight bytes never exceed the bucket's.
        let pieces = self.spec.split(br.clone());
        let me = self.group.rank();
        for (root, piece) in &pieces {
            if *root != me {
                self.reduce_scratch = self.reduce_scratch.max(piece.len() * F32);
            }
        }
        if let [(root, piece)] = pieces.as_slice() {
            let bytes = buf.len() * F32;
            let work = self.group.reduce_async(buf, ReduceOp::Sum, *root);
            pending.push(Pending::Reduce {
                bucket: b,
                root: *root,
                range: piece.clone(),
                bytes,
                work,
            });
            return Ok(());
        }
        for (root, piece) in pieces {
            let data = buf[piece.start - br.start..piece.end - br.start].to_vec();
            let bytes = data.len() * F32;
            self.comm_bytes.add(bytes);
            let work = self.group.reduce_async(data, ReduceOp::Sum, root);
            pending.push(Pending::Reduce {
                bucket: b,
                root,
                range: piece,
                bytes,
                work,
            });
        }
        self.comm_bytes.sub(buf.len() * F32);
        Ok(())
    }

    /// Stores the averaged gradients of the finished reductions (all of them, waiting, when
    /// `all`). Every gradient element receives exactly one reduction result per micro-step, so
    /// the order in which they are consumed does not change the numbers.
    fn drain(&mut self, pending: &mut Vec<Pending>, all: bool) -> Result<(), ParallelError> {
        let inv = 1.0 / self.group.size() as f32;
        let me = self.group.rank();
        let mut keep = Vec::new();
        let mut consumed = Vec::new();
        for p in pending.drain(..) {
            let ready = match &p {
                Pending::AllReduce { work, .. } | Pending::Reduce { work, .. } => {
                    work.is_completed()
                }
            };
            if !(all || ready) {
                keep.push(p);
                continue;
            }
            let bucket = match p {
                Pending::AllReduce { bucket, work } => {
                    let sum = work.wait()?;
                    let r = self.plan.buckets[bucket].range.clone();
                    for (g, s) in self.grads[r].iter_mut().zip(&sum) {
                        *g = s * inv;
                    }
                    self.comm_bytes.sub(sum.len() * F32);
                    bucket
                }
                Pending::Reduce {
                    bucket,
                    root,
                    range,
                    bytes,
                    work,
                } => {
                    let sum = work.wait()?;
                    if root == me {
                        let local = self.spec.to_local(me, &range);
                        for (g, s) in self.grads[local].iter_mut().zip(&sum) {
                            *g += s * inv;
                        }
                    }
                    self.comm_bytes.sub(bytes);
                    bucket
                }
            };
            if consumed.last() != Some(&bucket) {
                consumed.push(bucket);
            }
        }
        for b in consumed {
            if !keep.iter().any(|k| k.bucket() == b) {
                self.record(TraceKind::BucketDone(b));
            }
        }
        *pending = keep;
        Ok(())
    }

    /// This rank's real elements of flat range `r` (from the full buffer or the shard).
    fn own_piece(&self, r: &Range<usize>) -> Vec<f32> {
        let me = self.group.rank();
        let own = self.spec.intersect(me, r);
        if own.is_empty() {
            return Vec::new();
        }
        if self.cfg.stage.shards_params() {
            self.params[self.spec.to_local(me, &own)].to_vec()
        } else {
            self.params[own].to_vec()
        }
    }

    /// Starts gathering unit `u`'s parameters from the shards (pieces arrive in rank order,
    /// which is flat order).
    fn gather_async(&mut self, u: usize) -> Work<(Vec<f32>, Vec<usize>)> {
        let r = self.units[u].clone();
        self.gathered_bytes.add(r.len() * F32);
        let piece = self.own_piece(&r);
        self.group.all_gather_v_async(piece)
    }

    fn finish_gather(
        &mut self,
        u: usize,
        w: Work<(Vec<f32>, Vec<usize>)>,
    ) -> Result<Vec<f32>, ParallelError> {
        let (full, _) = w.wait()?;
        let want = self.units[u].len();
        if full.len() != want {
            return Err(ParallelError::Protocol(format!(
                "gathered {} parameters for unit {u}, expected {want}",
                full.len()
            )));
        }
        Ok(full)
    }

    /// Clipping + AdamW on what this rank owns, then (stages 1/2) the parameter all-gather.
    fn optimizer_step(&mut self) -> Result<f32, ParallelError> {
        let me = self.group.rank();
        let own = self.spec.range(me);
        let n_own = own.len();
        let stage = self.cfg.stage;
        // The gradients this rank updates: all of them (DDP), or its shard's real elements.
        let (g_own, p_own): (&mut [f32], &mut [f32]) = match stage {
            ZeroStage::Ddp => (&mut self.grads[..], &mut self.params[..]),
            ZeroStage::One => (&mut self.grads[own.clone()], &mut self.params[own.clone()]),
            ZeroStage::Two => (&mut self.grads[..n_own], &mut self.params[own.clone()]),
            ZeroStage::Three => (&mut self.grads[..n_own], &mut self.params[..n_own]),
        };
        let sq = if stage.shards_optimizer() {
            // Partial sums gathered and added in rank order: the same total on every rank.
            let partial = [grad_sq_sum(g_own) as f32];
            let mut all = vec![0.0f32; self.group.size()];
            self.group.all_gather(&partial, &mut all)?;
            all.iter().map(|&x| x as f64).sum::<f64>()
        } else {
            grad_sq_sum(g_own)
        };
        let (norm, coef) = match self.cfg.max_grad_norm {
            Some(c) => clip_factor(sq, c),
            None => (sq.sqrt() as f32, 1.0),
        };
        scale_grads(g_own, coef);
        self.step += 1;
        let opt = self.cfg.adamw;
        let (m, v) = if stage.shards_optimizer() {
            (&mut self.m[..n_own], &mut self.v[..n_own])
        } else {
            (&mut self.m[..], &mut self.v[..])
        };
        opt.update(self.step, self.lr, opt.weight_decay, p_own, g_own, m, v);
        if matches!(stage, ZeroStage::One | ZeroStage::Two) {
            // All-gather the updated parameters unit by unit (buffer bounded by one unit).
            for u in 0..self.units.len() {
                let w = self.gather_async(u);
                let full = self.finish_gather(u, w)?;
                self.gathered_bytes.sub(full.len() * F32);
                let r = self.units[u].clone();
                self.params[r].copy_from_slice(&full);
            }
        }
        Ok(norm)
    }

    /// The full parameter vector (a collective at stage 3: every rank must call it).
    pub fn full_params(&self) -> Result<Vec<f32>, ParallelError> {
        if !self.cfg.stage.shards_params() {
            return Ok(self.params.clone());
        }
        let (full, _) = self
            .group
            .all_gather_v(&self.own_piece(&(0..self.spec.total())))?;
        Ok(full)
    }

    /// Accounted bytes on this rank: the persistent buffers, and the peaks of the transient
    /// ones (communication buffers include ZeRO-3's gathered units).
    pub fn memory(&self) -> MemoryBytes {
        MemoryBytes {
            params: self.params.len() * F32,
            grads: self.grads.len() * F32,
            optimizer: (self.m.len() + self.v.len()) * F32,
            comm_buffers: self.comm_bytes.peak + self.reduce_scratch + self.gathered_bytes.peak,
            activations: self.act_bytes.peak,
        }
    }

    /// Peak bytes of gathered (non-owned) parameters alive at once.
    pub fn peak_gathered_bytes(&self) -> usize {
        self.gathered_bytes.peak
    }

    /// The formula's model-state bytes for this configuration.
    pub fn formula(&self) -> MemoryBytes {
        formula(
            self.spec.total(),
            self.group.size(),
            self.cfg.stage,
            Precision::Fp32,
        )
    }

    /// This rank's training state as a flat shard for checkpoints.
    pub fn export_shard(&self) -> ShardState {
        let me = self.group.rank();
        let (world, rank) = if self.cfg.stage.shards_optimizer() {
            (self.group.size(), me)
        } else {
            (1, 0)
        };
        let spec = ShardSpec::new(self.spec.total(), world).expect("world >= 1");
        let cut = |buf: &[f32], sharded: bool| {
            if sharded {
                buf.to_vec()
            } else {
                let r = spec.range(rank);
                let mut s = vec![0.0; spec.shard_len()];
                s[..r.len()].copy_from_slice(&buf[r]);
                s
            }
        };
        ShardState {
            total: self.spec.total(),
            world,
            rank,
            step: self.step,
            params: cut(&self.params, self.cfg.stage.shards_params() || world == 1),
            exp_avg: cut(&self.m, true),
            exp_avg_sq: cut(&self.v, true),
        }
    }
}

impl<M: StagedModel> DataParallel<M> {
    fn unit_sizes(&self) -> Vec<usize> {
        self.units.iter().map(|u| u.len()).collect()
    }

    /// Saves this rank's shard under `dir` (replicated DDP state is written by rank 0 only) and
    /// waits until every rank has written. A collective: every rank calls it.
    pub fn save_checkpoint(&self, dir: &std::path::Path) -> Result<(), ParallelError> {
        // Replicated (DDP) state is exported by rank 0 only: the copy is the full model.
        let writes = self.cfg.stage.shards_optimizer() || self.group.rank() == 0;
        let result = if writes {
            crate::checkpoint::save_shard(dir, &self.export_shard(), &self.unit_sizes())
        } else {
            Ok(())
        };
        self.group.barrier()?;
        result
    }

    /// Loads a checkpoint saved at any dp size and stage, re-cut for this engine's.
    pub fn load_checkpoint(&mut self, dir: &std::path::Path) -> Result<(), ParallelError> {
        let states = crate::checkpoint::load_shards(dir, &self.unit_sizes())?;
        self.restore(&states)
    }

    /// Restores parameters, moments and step from saved shards (any world, same layout).
    pub fn restore(&mut self, states: &[ShardState]) -> Result<(), ParallelError> {
        let total = self.spec.total();
        if states.first().map(|s| s.total) != Some(total) {
            return Err(ParallelError::Layout(format!(
                "checkpoint does not hold {total} parameters"
            )));
        }
        let me = self.group.rank();
        let stage = self.cfg.stage;
        let (world, rank) = (self.group.size(), me);
        let full = crate::checkpoint::reshard_states(states, 1, 0)?;
        let own = crate::checkpoint::reshard_states(states, world, rank)?;
        self.params = if stage.shards_params() {
            own.params.clone()
        } else {
            full.params[..total].to_vec()
        };
        if stage.shards_optimizer() {
            self.m = own.exp_avg;
            self.v = own.exp_avg_sq;
        } else {
            self.m = full.exp_avg[..total].to_vec();
            self.v = full.exp_avg_sq[..total].to_vec();
        }
        self.step = own.step;
        Ok(())
    }
}

/// One rank's saved flat shard of parameters and AdamW moments (padded to `ceil(total/world)`).
#[derive(Clone, Debug, PartialEq)]
pub struct ShardState {
    pub total: usize,
    pub world: usize,
    pub rank: usize,
    pub step: u64,
    pub params: Vec<f32>,
    pub exp_avg: Vec<f32>,
    pub exp_avg_sq: Vec<f32>,
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
