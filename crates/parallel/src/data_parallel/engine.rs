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
//! thread while backward continues on this one. Stages 0/1 keep their gradients one
//! allocation per bucket ([`Bucketed`]) and lend the bucket itself to the all-reduce: an
//! in-place reduction, no copy in flight. ZeRO-3 gathers a unit's parameters just before its forward
//! (prefetching the next unit's asynchronously), frees them after, and does the same in reverse
//! for backward, so at most two gathered units are alive beside the shard.
//!
//! Precision ([`DpConfig::precision`]): fp32, or bf16-mixed — bf16 parameters and gradients
//! ([`Flat`]; ZeRO-3 gathers the bf16 shards, half the bytes), fp32 master weights and AdamW
//! moments over the range the rank updates (the whole model for DDP, its shard for ZeRO-1/2/3).
//! Gradients are reduced in fp32: each bucket is widened from bf16 (or staged in fp32 at
//! ZeRO-2/3) before its all-reduce / reduce, and the average is rounded to bf16 once when
//! stored. A bf16 reduction would halve the bytes but round every partial sum on the way
//! (log₂N or N−1 extra roundings, depending on the algorithm, in an order that changes with
//! N), so results would drift with the dp size; in fp32 the only bf16 roundings are the ones
//! the single-process bf16 run also makes (one per unit backward and micro-batch, one per
//! stored average).
use std::ops::Range;
use std::time::Instant;

use comm::{ProcessGroup, ReduceOp, Work};
use model::optim::{clip_factor, scale_grads, AdamW};
use train::precision::CHUNK;

use crate::bucket::{BucketPlan, ReadyTracker};
use crate::flat::{Bucketed, Flat, Piece};
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
    /// fp32, or bf16 parameters and gradients with fp32 master weights.
    pub precision: Precision,
}

impl Default for DpConfig {
    fn default() -> Self {
        Self {
            stage: ZeroStage::Ddp,
            bucket_bytes: crate::bucket::DEFAULT_BUCKET_BYTES,
            adamw: AdamW::default(),
            max_grad_norm: Some(1.0),
            precision: Precision::Fp32,
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
    /// Compute weights: full (stages 0-2) or this rank's padded shard (stage 3). In fp32 they
    /// are also the master weights.
    params: Flat,
    /// Full, bucket by bucket (stages 0-1), or this rank's padded shard (stages 2-3).
    grads: Bucketed,
    /// bf16-mixed only (empty in fp32): the fp32 master weights of the range AdamW updates,
    /// like `m` and `v`.
    master: Vec<f32>,
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
    /// Gathered (ZeRO-3) or widened (bf16) unit parameters and widened unit gradients.
    gathered_bytes: Gauge,
    act_bytes: Gauge,
    trace: Option<Vec<TraceEvent>>,
}

const F32: usize = 4;
const BF16: usize = 2;

/// A parameter all-gather in flight, in the weights' precision.
enum Gather {
    F32(Work<(Vec<f32>, Vec<usize>)>),
    Bf16(Work<(Vec<half::bf16>, Vec<usize>)>),
}

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
        // Buckets hold whole units: a unit's gradients are written by one backward call into
        // one contiguous slice (of the bucket's own allocation at stages 0/1, of its staging
        // buffer at 2/3), and a unit's backward returning is the grads-ready event anyway.
        let plan = BucketPlan::new(&units, BucketPlan::cap_elems(cfg.bucket_bytes, F32))?;
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
        let own = spec.range(me);
        let precision = cfg.precision;
        // Fills a buffer of `len` elements whose first real elements are flat range `r`.
        let fill = |r: Range<usize>, len: usize| {
            let mut b = vec![0.0; len];
            init(r.clone(), &mut b[..r.len()]);
            b
        };
        let per = |sharded: bool| if sharded { spec.shard_len() } else { total };
        let (params, master) = match precision {
            Precision::Fp32 if stage.shards_params() => {
                (Flat::F32(fill(own.clone(), spec.shard_len())), Vec::new())
            }
            Precision::Fp32 => (Flat::F32(fill(0..total, total)), Vec::new()),
            Precision::Bf16Mixed => {
                let master = if stage.shards_optimizer() {
                    fill(own.clone(), spec.shard_len())
                } else {
                    fill(0..total, total)
                };
                let params = if stage.shards_params() || !stage.shards_optimizer() {
                    // The rounded master itself (the shard at ZeRO-3, everything for DDP).
                    let mut p = Flat::zeros(master.len(), precision);
                    p.write(0, &master);
                    p
                } else {
                    // Full bf16 weights beside a master shard: generated chunk by chunk, so
                    // no full fp32 copy ever exists.
                    let mut p = Flat::zeros(total, precision);
                    let mut buf = vec![0.0; CHUNK.min(total)];
                    for s in (0..total).step_by(CHUNK) {
                        let e = (s + CHUNK).min(total);
                        init(s..e, &mut buf[..e - s]);
                        p.write(s, &buf[..e - s]);
                    }
                    p
                };
                (params, master)
            }
        };
        // Stages 0/1: the full gradients, one allocation per bucket (all-reduced in place);
        // stages 2/3: the shard.
        let grads = if stage.shards_grads() {
            Bucketed::zeros(std::iter::once(0..spec.shard_len()).collect(), precision)
        } else {
            let ranges = plan.buckets.iter().map(|b| b.range.clone()).collect();
            Bucketed::zeros(ranges, precision)
        };
        let m = vec![0.0; per(stage.shards_optimizer())];
        let v = vec![0.0; per(stage.shards_optimizer())];
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
            master,
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
        self.grads.fill_zero();
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

    /// Unit `u`'s parameters as an fp32 copy, when they are not used in place: gathered
    /// (ZeRO-3, from the prefetch `w`) or widened from bf16. `None`: read `self.params`.
    fn unit_params(
        &mut self,
        u: usize,
        w: Option<Gather>,
    ) -> Result<Option<Vec<f32>>, ParallelError> {
        if let Some(w) = w {
            return self.finish_gather(u, w).map(Some);
        }
        if self.params.as_f32().is_some() {
            return Ok(None);
        }
        let r = self.units[u].clone();
        self.gathered_bytes.add(r.len() * F32);
        Ok(Some(self.params.read(r)))
    }

    /// The validation metric of a forward-only pass over `batch` with the current weights
    /// (the model's [`StagedModel::eval_metric`]). A collective at ZeRO-3 (the units are
    /// gathered): every rank must call it, with a batch of its choice.
    pub fn evaluate(&mut self, batch: &M::Batch) -> Result<f32, ParallelError> {
        let (out, caches) = self.forward(batch, 1.0, false)?;
        let last = caches
            .last()
            .ok_or_else(|| ParallelError::Layout("the model has no units".into()))?;
        Ok(self.model.eval_metric(&out, last))
    }

    /// Forward of every unit; returns the output and the caches for backward (`keep`), or
    /// only the last unit's cache.
    fn forward(
        &mut self,
        batch: &M::Batch,
        scale: f32,
        keep: bool,
    ) -> Result<(M::Act, Vec<M::Cache>), ParallelError> {
        let n = self.units.len();
        let stage3 = self.cfg.stage.shards_params();
        let mut caches = Vec::with_capacity(if keep { n } else { 1 });
        let mut x = None;
        let mut prefetch = stage3.then(|| self.gather_async(0));
        for u in 0..n {
            let w = prefetch.take();
            if w.is_some() && u + 1 < n {
                prefetch = Some(self.gather_async(u + 1));
            }
            let owned = self.unit_params(u, w)?;
            let p = match &owned {
                Some(o) => o.as_slice(),
                None => &self.params.as_f32().expect("fp32 weights")[self.units[u].clone()],
            };
            let (y, cache) = self.model.forward(u, p, x.take(), batch, scale)?;
            if keep {
                self.act_bytes.add(self.model.cache_bytes(&cache));
            } else {
                caches.clear();
            }
            caches.push(cache);
            if let Some(o) = owned {
                self.gathered_bytes.sub(o.len() * F32);
            }
            x = Some(y);
        }
        let out = x.ok_or_else(|| ParallelError::Layout("the model has no units".into()))?;
        Ok((out, caches))
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
        let (out, mut caches) = self.forward(batch, scale, true)?;
        let loss = self.model.loss(&out);

        let mut tracker = reduce.then(|| ReadyTracker::new(&self.plan));
        let mut pending: Vec<Pending> = Vec::new();
        let mut dy = None;
        let mut prefetch = stage3.then(|| self.gather_async(n - 1));
        for u in (0..n).rev() {
            let cache = caches.pop().expect("one cache per unit");
            let cache_bytes = self.model.cache_bytes(&cache);
            let w = prefetch.take();
            if w.is_some() && u > 0 {
                prefetch = Some(self.gather_async(u - 1));
            }
            let owned = self.unit_params(u, w)?;
            self.record(TraceKind::BackwardStart(u));
            let range = self.units[u].clone();
            let p = match &owned {
                Some(o) => o.as_slice(),
                None => &self.params.as_f32().expect("fp32 weights")[range.clone()],
            };
            let dx = if self.cfg.stage.shards_grads() {
                // Stages 2/3: fp32 gradients straight into the bucket's staging buffer.
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
                // Stages 0/1: accumulated into the gradient buffer (through an fp32 copy of
                // the unit's gradients when they are stored in bf16).
                let widened = !self.grads.is_f32();
                if widened {
                    self.gathered_bytes.add(range.len() * F32);
                }
                let model = &self.model;
                let dy = dy.take();
                let b = self.unit_bucket[u];
                let dx = self.grads.update(b, range.clone(), |g| {
                    model.backward(u, p, cache, dy, scale, g)
                })?;
                if widened {
                    self.gathered_bytes.sub(range.len() * F32);
                }
                dx
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
            // fp32: the bucket's own allocation is all-reduced in place (lent to the
            // collective, returned in `drain`). bf16: an fp32 copy, since reductions run in
            // fp32.
            let buf = if self.grads.is_f32() {
                match self.grads.take(b) {
                    Some(Flat::F32(v)) => v,
                    _ => {
                        return Err(ParallelError::Protocol(format!(
                            "bucket {b} is already in flight"
                        )))
                    }
                }
            } else {
                let buf = self.grads.read(b, br.clone());
                self.comm_bytes.add(buf.len() * F32);
                buf
            };
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
                    let mut sum = work.wait()?;
                    let r = self.plan.buckets[bucket].range.clone();
                    sum.iter_mut().for_each(|s| *s *= inv);
                    if self.grads.has(bucket) {
                        self.grads.write(bucket, r.start, &sum);
                        self.comm_bytes.sub(sum.len() * F32);
                    } else {
                        self.grads.put(bucket, Flat::F32(sum));
                    }
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
                        self.grads.update(0, local, |g| {
                            for (g, s) in g.iter_mut().zip(&sum) {
                                *g += s * inv;
                            }
                        });
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

    /// This rank's real elements of flat range `r` of the compute weights (from the full
    /// buffer or the shard), in their own precision.
    fn own_piece(&self, r: &Range<usize>) -> Piece {
        let me = self.group.rank();
        let own = self.spec.intersect(me, r);
        let local = if own.is_empty() {
            0..0
        } else if self.cfg.stage.shards_params() {
            self.spec.to_local(me, &own)
        } else {
            own
        };
        self.params.piece(local)
    }

    /// Starts gathering unit `u`'s compute weights from the shards (pieces arrive in rank
    /// order, which is flat order; bf16 weights travel as bf16).
    fn gather_async(&mut self, u: usize) -> Gather {
        let r = self.units[u].clone();
        match self.own_piece(&r) {
            Piece::F32(p) => {
                self.gathered_bytes.add(r.len() * F32);
                Gather::F32(self.group.all_gather_v_async(p))
            }
            Piece::Bf16(p) => {
                self.gathered_bytes.add(r.len() * BF16);
                Gather::Bf16(self.group.all_gather_v_async(p))
            }
        }
    }

    /// Waits for unit `u`'s gather and returns its weights in fp32 (accounted until the
    /// caller subtracts them).
    fn finish_gather(&mut self, u: usize, w: Gather) -> Result<Vec<f32>, ParallelError> {
        let full = match w {
            Gather::F32(w) => Piece::F32(w.wait()?.0),
            Gather::Bf16(w) => Piece::Bf16(w.wait()?.0),
        };
        let want = self.units[u].len();
        let (got, bf16) = match &full {
            Piece::F32(v) => (v.len(), false),
            Piece::Bf16(v) => (v.len(), true),
        };
        if got != want {
            return Err(ParallelError::Protocol(format!(
                "gathered {got} parameters for unit {u}, expected {want}"
            )));
        }
        if bf16 {
            // Widened to fp32 for the kernels; the bf16 copy is freed right after.
            self.gathered_bytes.add(want * F32);
            self.gathered_bytes.sub(want * BF16);
        }
        Ok(full.into_f32())
    }

    /// The flat range AdamW updates here, as indices of (grads, compute params, master/m/v).
    fn own_ranges(&self) -> (Range<usize>, Range<usize>, Range<usize>) {
        let own = self.spec.range(self.group.rank());
        let local = 0..own.len();
        let all = 0..self.spec.total();
        match self.cfg.stage {
            ZeroStage::Ddp => (all.clone(), all.clone(), all),
            ZeroStage::One => (own.clone(), own, local),
            ZeroStage::Two => (local.clone(), own, local),
            ZeroStage::Three => (local.clone(), local.clone(), local),
        }
    }

    /// Clipping + AdamW on what this rank owns, then (stages 1/2) the parameter all-gather.
    fn optimizer_step(&mut self) -> Result<f32, ParallelError> {
        let stage = self.cfg.stage;
        let (gr, pr, mr) = self.own_ranges();
        let local_sq = self.grads.sq_sum(gr.clone());
        let sq = if stage.shards_optimizer() {
            // Partial sums gathered and added in rank order: the same total on every rank.
            let partial = [local_sq as f32];
            let mut all = vec![0.0f32; self.group.size()];
            self.group.all_gather(&partial, &mut all)?;
            all.iter().map(|&x| x as f64).sum::<f64>()
        } else {
            local_sq
        };
        let (norm, coef) = match self.cfg.max_grad_norm {
            Some(c) => clip_factor(sq, c),
            None => (sq.sqrt() as f32, 1.0),
        };
        self.step += 1;
        let opt = self.cfg.adamw;
        let (t, lr) = (self.step, self.lr);
        let (m, v) = (&mut self.m[mr.clone()], &mut self.v[mr.clone()]);
        match (&mut self.params, &mut self.grads) {
            (Flat::F32(p), grads) if grads.is_f32() => {
                // Bucket by bucket (AdamW is elementwise): the piece at flat offset `s` of the
                // gradients pairs with the same offset from the starts of `pr` and `mr`.
                grads.f32_pieces_mut(gr.clone(), |s, g| {
                    let o = s - gr.start;
                    let n = g.len();
                    scale_grads(g, coef);
                    opt.update(
                        t,
                        lr,
                        opt.weight_decay,
                        &mut p[pr.start + o..pr.start + o + n],
                        g,
                        &mut m[o..o + n],
                        &mut v[o..o + n],
                    );
                });
            }
            (params, grads) => {
                // bf16-mixed, as `train::optim::apply_update` does it: chunk by chunk, widen
                // the gradients, clip, update the fp32 master, round it into the weights.
                let master = &mut self.master[mr.clone()];
                let mut g = vec![0.0f32; CHUNK.min(master.len())];
                for s in (0..master.len()).step_by(CHUNK) {
                    let e = (s + CHUNK).min(master.len());
                    let g = &mut g[..e - s];
                    grads.read_into(gr.start + s..gr.start + e, g);
                    scale_grads(g, coef);
                    opt.update(
                        t,
                        lr,
                        opt.weight_decay,
                        &mut master[s..e],
                        g,
                        &mut m[s..e],
                        &mut v[s..e],
                    );
                    params.write(pr.start + s, &master[s..e]);
                }
            }
        }
        if matches!(stage, ZeroStage::One | ZeroStage::Two) {
            // All-gather the updated weights unit by unit (buffer bounded by one unit).
            for u in 0..self.units.len() {
                let w = self.gather_async(u);
                let full = self.finish_gather(u, w)?;
                self.gathered_bytes.sub(full.len() * F32);
                self.params.write(self.units[u].start, &full);
            }
        }
        Ok(norm)
    }

    /// The fp32 master weights this rank holds: full (`false`) or its shard (`true`).
    fn master_view(&self) -> (&[f32], bool) {
        match &self.params {
            Flat::F32(p) => (p, self.cfg.stage.shards_params()),
            Flat::Bf16(_) => (&self.master, self.cfg.stage.shards_optimizer()),
        }
    }

    /// The full fp32 (master) parameter vector; a collective where the master weights are
    /// sharded (every rank must call it).
    pub fn full_params(&self) -> Result<Vec<f32>, ParallelError> {
        let (master, sharded) = self.master_view();
        if !sharded {
            return Ok(master[..self.spec.total()].to_vec());
        }
        let me = self.group.rank();
        let n = self.spec.range(me).len();
        let (full, _) = self.group.all_gather_v(&master[..n])?;
        Ok(full)
    }

    /// Accounted bytes on this rank: the persistent buffers, and the peaks of the transient
    /// ones (communication buffers include ZeRO-3's gathered units).
    pub fn memory(&self) -> MemoryBytes {
        MemoryBytes {
            params: self.params.bytes(),
            grads: self.grads.bytes(),
            optimizer: (self.master.len() + self.m.len() + self.v.len()) * F32,
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
            self.cfg.precision,
        )
    }

    /// This rank's training state as a flat shard for checkpoints (borrowed, no copy): the
    /// fp32 master weights and the moments, whatever the compute precision. Replicated (DDP)
    /// state is the world-1 shard.
    pub fn shard_ref(&self) -> ShardRef<'_> {
        let (world, rank) = if self.cfg.stage.shards_optimizer() {
            (self.group.size(), self.group.rank())
        } else {
            (1, 0)
        };
        let (master, sharded) = self.master_view();
        let params = if sharded {
            master
        } else {
            // Full weights (fp32 ZeRO-1/2 keep them all): this rank's range of them.
            let spec = ShardSpec::new(self.spec.total(), world).expect("world >= 1");
            &master[spec.range(rank)]
        };
        ShardRef {
            total: self.spec.total(),
            world,
            rank,
            step: self.step,
            params,
            exp_avg: &self.m,
            exp_avg_sq: &self.v,
        }
    }

    /// [`Self::shard_ref`] as an owned, padded shard.
    pub fn export_shard(&self) -> ShardState {
        self.shard_ref().to_owned()
    }
}

impl<M: StagedModel> DataParallel<M> {
    fn unit_sizes(&self) -> Vec<usize> {
        self.units.iter().map(|u| u.len()).collect()
    }

    /// Saves this rank's shard under `dir` (replicated DDP state is written by rank 0 only) and
    /// waits until every rank has written. A collective: every rank calls it.
    pub fn save_checkpoint(&self, dir: &std::path::Path) -> Result<(), ParallelError> {
        // Replicated (DDP) state is written by rank 0 only.
        let writes = self.cfg.stage.shards_optimizer() || self.group.rank() == 0;
        let result = if writes {
            crate::checkpoint::save_shard(dir, &self.shard_ref(), &self.unit_sizes())
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

    /// Restores parameters, moments and step from saved shards (any world, same layout; a
    /// checkpoint holds fp32 master weights, so it loads at either precision).
    pub fn restore(&mut self, states: &[ShardState]) -> Result<(), ParallelError> {
        let total = self.spec.total();
        if states.first().map(|s| s.total) != Some(total) {
            return Err(ParallelError::Layout(format!(
                "checkpoint does not hold {total} parameters"
            )));
        }
        let stage = self.cfg.stage;
        let (world, rank) = (self.group.size(), self.group.rank());
        // Each buffer re-cut once, to this rank's shard or to the full buffer, as this stage
        // keeps it.
        let cut = |sharded: bool, f: fn(&ShardState) -> &Vec<f32>| {
            if sharded {
                crate::checkpoint::reshard_buffer(states, world, rank, f)
            } else {
                let mut full = crate::checkpoint::reshard_buffer(states, 1, 0, f)?;
                full.truncate(total);
                Ok(full)
            }
        };
        let precision = self.cfg.precision;
        let weights = cut(stage.shards_params(), |s| &s.params)?;
        if precision == Precision::Bf16Mixed {
            self.master = cut(stage.shards_optimizer(), |s| &s.params)?;
        }
        self.params = Flat::from_f32(weights, precision);
        self.m = cut(stage.shards_optimizer(), |s| &s.exp_avg)?;
        self.v = cut(stage.shards_optimizer(), |s| &s.exp_avg_sq)?;
        self.step = states[0].step;
        Ok(())
    }
}

/// A borrowed shard: like [`ShardState`], but its buffers may stop short of the padded length
/// `ceil(total/world)` (the missing tail is padding, zeros).
#[derive(Clone, Copy, Debug)]
pub struct ShardRef<'a> {
    pub total: usize,
    pub world: usize,
    pub rank: usize,
    pub step: u64,
    pub params: &'a [f32],
    pub exp_avg: &'a [f32],
    pub exp_avg_sq: &'a [f32],
}

impl ShardRef<'_> {
    /// Padded length of a shard of this layout.
    pub fn shard_len(&self) -> usize {
        self.total.div_ceil(self.world.max(1))
    }

    /// An owned copy, padded with zeros.
    pub fn to_owned(&self) -> ShardState {
        let pad = |b: &[f32]| {
            let mut v = b.to_vec();
            v.resize(self.shard_len(), 0.0);
            v
        };
        ShardState {
            total: self.total,
            world: self.world,
            rank: self.rank,
            step: self.step,
            params: pad(self.params),
            exp_avg: pad(self.exp_avg),
            exp_avg_sq: pad(self.exp_avg_sq),
        }
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
