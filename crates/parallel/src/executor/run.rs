//! Running a schedule: each action of a rank's list in order, with the step's state (the
//! activations and gradients between stages and between a stage's `B` and `W`, messages in
//! flight, the bucket reductions launched so far) carried in a [`StepState`].
use std::collections::HashMap;
use std::ops::Range;
use std::time::{Duration, Instant};

use comm::ReduceOp;

use super::reduce::{param_slice, Gather, Pending};
use super::{p2p_tag, schedule_err, Executor, Gauge, Spare, StepStats, TraceKind, F32};
use crate::data_parallel::bucket::{Bucket, ReadyTracker};
use crate::data_parallel::ZeroStage;
use crate::pipeline_parallel::link::{check_order, Incoming, Outgoing};
use crate::pipeline_parallel::Action;
use crate::precision::Bucketed;
use crate::stage::StageModel;
use crate::ParallelError;
use tensor::buf::{Buf, BufMut, Dev};

type Key = (usize, usize);

/// A posted receive: the sending pp rank and the transfer.
type Receive = (usize, Incoming);

/// The two directions of pipeline messages: activations to the next stage, gradients to the
/// previous one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Flow {
    Activation = 0,
    Gradient = 1,
}

impl Flow {
    /// The stage `stage`'s message of this flow goes to.
    fn to(self, stage: usize) -> Option<usize> {
        match self {
            Flow::Activation => stage.checked_add(1),
            Flow::Gradient => stage.checked_sub(1),
        }
    }
    /// The stage `stage` receives this flow's message from.
    fn from(self, stage: usize) -> Option<usize> {
        match self {
            Flow::Activation => stage.checked_sub(1),
            Flow::Gradient => stage.checked_add(1),
        }
    }
    fn index(self) -> usize {
        self as usize
    }
    fn name(self) -> &'static str {
        match self {
            Flow::Activation => "activation",
            Flow::Gradient => "gradient",
        }
    }
}

/// What one step carries from action to action (keys are (stage, micro-batch)).
pub(super) struct StepState<M: StageModel> {
    /// Per local stage, d(total loss)/d(a micro-batch's loss): the loss scale over the number
    /// of micro-batches the stage runs (all of the step's, or with replicated layers its
    /// chain's: the replicas' gradients are then averaged).
    scale: Vec<f32>,
    /// Per [`Flow`]: what a stage hands to a neighbour stage on this rank (keyed by the
    /// receiving stage), what waits for its `SEND_*` (keyed by the sending stage), and the
    /// receives posted (keyed by the receiving stage).
    handed: [HashMap<Key, M::Act>; 2],
    outbox: [HashMap<Key, M::Act>; 2],
    receives: [HashMap<Key, Receive>; 2],
    /// Sends in flight: the action, the receiving pp rank, the transfer.
    sends: Vec<(Action, usize, Outgoing)>,
    caches: HashMap<Key, Vec<M::Cache>>,
    /// Pending weight gradients per unit, in the order `BACKWARD_INPUT` made them.
    weight_grads: HashMap<Key, Vec<(usize, M::WeightGrad)>>,
    /// Per local stage: actions computing weight gradients still to come this step.
    weight_left: Vec<usize>,
    reductions: Vec<Pending>,
    /// Time the current action has waited for messages from other ranks.
    waited: Duration,
    /// Sum of the losses of this rank's micro-batches (on the rank of the last stage).
    loss: f64,
}

/// Waits for `sends` (each with its action and the receiving pp rank, for errors).
fn wait_sends(sends: Vec<(Action, usize, Outgoing)>) -> Result<(), ParallelError> {
    for (a, peer, w) in sends {
        w.wait()
            .map_err(|e| schedule_err(&a, format!("sending to pp rank {peer}: {e}")))?;
    }
    Ok(())
}

/// A tensor (device) error as this crate's.
pub(super) fn terr(e: tensor::TensorError) -> ParallelError {
    ParallelError::Model(e.to_string())
}

/// Runs `f` on the process's kernel pool when allowed (see [`Executor::pin_compute`]).
fn compute<R: Send>(pin: bool, f: impl FnOnce() -> R + Send) -> R {
    if pin {
        tensor::threads::install(f)
    } else {
        f()
    }
}

/// The gradient side of the executor, borrowed field by field so that a unit's weights (a
/// slice of `params`) stay borrowed while its weight gradients are accumulated.
struct GradSink<'a> {
    zero: ZeroStage,
    grads: &'a mut Bucketed,
    staging: &'a mut [Option<Buf>],
    dev: &'a Dev,
    comm_bytes: &'a mut Gauge,
    gathered_bytes: &'a mut Gauge,
    spare: &'a mut Spare,
    buckets: &'a [Bucket],
    unit_bucket: &'a [usize],
}

/// The [`GradSink`] of executor `$e`.
macro_rules! grad_sink {
    ($e:ident) => {
        GradSink {
            zero: $e.cfg.zero,
            grads: &mut $e.grads,
            staging: &mut $e.staging,
            dev: &$e.cfg.device,
            comm_bytes: &mut $e.comm_bytes,
            gathered_bytes: &mut $e.gathered_bytes,
            spare: &mut $e.spare_grads,
            buckets: &$e.buckets,
            unit_bucket: &$e.unit_bucket,
        }
    };
}

impl GradSink<'_> {
    /// Accumulates unit `u`'s weight gradients (`f` adds them into the slice it is given, the
    /// unit's flat `range`): into its bucket's fp32 staging buffer at ZeRO-2/3, else into the
    /// gradient buffer (through an fp32 copy of the unit's gradients when they are stored in
    /// 16 bits).
    fn accumulate(
        self,
        u: usize,
        range: Range<usize>,
        f: impl FnOnce(BufMut<'_>) -> Result<(), ParallelError>,
    ) -> Result<(), ParallelError> {
        let b = self.unit_bucket[u];
        if self.zero.shards_grads() {
            let br = self.buckets[b].range.clone();
            if self.staging[b].is_none() {
                self.comm_bytes.add(br.len() * F32);
                self.staging[b] = Some(self.dev.zeros(br.len())?);
            }
            let buf = self.staging[b].as_mut().expect("staged just above");
            return f(buf
                .m()
                .slice_mut(range.start - br.start..range.end - br.start));
        }
        if self.grads.is_f32() {
            return self.grads.update_buf(b, range, f);
        }
        if matches!(self.dev, Dev::Cpu) {
            // Widened into the last unit's buffer where it has this unit's size.
            let mut widened = self.spare.take(range.len(), self.gathered_bytes);
            let r = self.grads.update_buf_in(b, range, &mut widened, f);
            self.spare.keep(widened, self.gathered_bytes);
            return r;
        }
        self.gathered_bytes.add(range.len() * F32);
        let r = self.grads.update_buf(b, range.clone(), f);
        self.gathered_bytes.sub(range.len() * F32);
        r
    }
}

impl<M: StageModel> Executor<M> {
    /// Whether a unit's compute runs on the kernel pool's worker (one hand-over per unit
    /// rather than per kernel): always when units issue no collectives, and with collectives
    /// only when this process runs one rank (ranks as threads of one process sharing a pool
    /// could otherwise wait on each other from inside it).
    fn pin_compute(&self) -> bool {
        self.cfg.one_rank_per_process || !self.model.communicates()
    }

    fn local_stage(&self, a: &Action, stage: usize) -> Result<usize, ParallelError> {
        self.stages
            .iter()
            .position(|s| s.id == stage)
            .ok_or_else(|| schedule_err(a, format!("stage {stage} does not run on this rank")))
    }

    fn is_local(&self, stage: usize) -> bool {
        self.stages.iter().any(|s| s.id == stage)
    }

    fn pipe(&self, a: &Action) -> Result<&super::Pipeline, ParallelError> {
        self.pipe
            .as_ref()
            .ok_or_else(|| schedule_err(a, "a pipeline message without pipeline parallelism"))
    }

    /// Runs one step: `schedule` over this rank's micro-batches `micro`. The schedule must end
    /// with the optimizer step.
    pub fn run_step(
        &mut self,
        micro: &[M::Batch],
        schedule: &[Action],
    ) -> Result<StepStats, ParallelError> {
        let _operands = tensor::operands::Scope::enter(self.cfg.operands());
        if micro.is_empty() {
            return Err(ParallelError::Config(
                "a step needs at least one micro-batch".into(),
            ));
        }
        match schedule.iter().position(|a| *a == Action::Optimizer) {
            Some(i) if i + 1 == schedule.len() => {}
            _ => {
                return Err(ParallelError::Schedule(
                    "a step's schedule ends with its one OPTIMIZER action".into(),
                ))
            }
        }
        if self
            .pipe
            .as_ref()
            .is_some_and(|p| p.links.values().any(|l| l.is_nccl()))
        {
            check_order(schedule)?;
        }
        let dp_sent_before = self.dp.stats().total_bytes_sent();
        self.grads.fill_zero().map_err(terr)?;
        self.begin_offload_step()?;
        let weight_left = self
            .stages
            .iter()
            .map(|s| {
                schedule
                    .iter()
                    .filter(|a| a.computes_weight_grads_of(s.id))
                    .count()
            })
            .collect();
        let scale = self
            .stages
            .iter()
            .map(|s| {
                let forwards = schedule
                    .iter()
                    .flat_map(|a| a.parts())
                    .filter(|a| matches!(a, Action::Forward { stage, .. } if *stage == s.id))
                    .count();
                (self.scaler.scale / forwards.max(1) as f64) as f32
            })
            .collect();
        let mut st = StepState::<M> {
            scale,
            handed: Default::default(),
            outbox: Default::default(),
            receives: Default::default(),
            sends: Vec::new(),
            caches: HashMap::new(),
            weight_grads: HashMap::new(),
            weight_left,
            reductions: Vec::new(),
            waited: Duration::ZERO,
            loss: 0.0,
        };
        // A held update runs on a thread of its own beside this step's actions ([`super::delayed`]).
        let mut work = self.begin_delayed_work();
        let (acted, ran, waited) = std::thread::scope(|s| {
            let update = work.as_mut().map(|w| {
                s.spawn(|| {
                    let start = Instant::now();
                    w.run().map(|()| start.elapsed())
                })
            });
            let acted = schedule[..schedule.len() - 1].iter().try_for_each(|a| {
                let start = Instant::now();
                st.waited = Duration::ZERO;
                self.act(a, micro, &mut st)?;
                self.record_span(a, start, st.waited);
                Ok::<(), ParallelError>(())
            });
            let start = Instant::now();
            let ran = update.map(|u| u.join());
            (acted, ran, start.elapsed())
        });
        let ended = self.end_delayed_work(work, ran);
        acted?;
        let delayed_update = ended?.map(|took| (took.as_secs_f64(), waited.as_secs_f64()));
        let start = Instant::now();
        let mut stats = self.finish(micro.len(), st)?;
        stats.delayed_update = delayed_update;
        self.record_span(&Action::Optimizer, start, Duration::ZERO);
        stats.dp_bytes_sent = self.dp.stats().total_bytes_sent() - dp_sent_before;
        Ok(stats)
    }

    fn record_span(&mut self, a: &Action, start: Instant, waited: Duration) {
        if self.tracing() {
            let kind = TraceKind::Action {
                action: *a,
                took: start.elapsed(),
                waited,
            };
            self.record_at(kind, start);
        }
    }

    /// Runs one action of the schedule.
    fn act(
        &mut self,
        a: &Action,
        micro: &[M::Batch],
        st: &mut StepState<M>,
    ) -> Result<(), ParallelError> {
        let done = self.act_on(a, micro, st);
        // The action's widened buffers are not kept past it.
        self.spare_params.clear(&mut self.gathered_bytes);
        self.spare_grads.clear(&mut self.gathered_bytes);
        done
    }

    fn act_on(
        &mut self,
        a: &Action,
        micro: &[M::Batch],
        st: &mut StepState<M>,
    ) -> Result<(), ParallelError> {
        let batch = |mb: usize| {
            micro.get(mb).ok_or_else(|| {
                schedule_err(
                    a,
                    format!("micro-batch {mb} of a step with {}", micro.len()),
                )
            })
        };
        match *a {
            Action::Forward { stage, mb } => self.forward(a, stage, mb, batch(mb)?, st),
            Action::Backward { stage, mb } => self.backward(a, stage, mb, true, st),
            Action::BackwardInput { stage, mb } => self.backward(a, stage, mb, false, st),
            Action::BackwardWeight { stage, mb } => self.backward_weight(a, stage, mb, st),
            Action::SendForward { stage, mb } => self.send(a, Flow::Activation, stage, mb, st),
            Action::SendBackward { stage, mb } => self.send(a, Flow::Gradient, stage, mb, st),
            Action::RecvForward { stage, mb } => {
                self.recv(a, Flow::Activation, stage, mb, batch(mb)?, st)
            }
            Action::RecvBackward { stage, mb } => {
                self.recv(a, Flow::Gradient, stage, mb, batch(mb)?, st)
            }
            Action::Unshard { stage } => {
                let ls = self.local_stage(a, stage)?;
                if self.cfg.zero.shards_params() {
                    for u in self.stages[ls].units.clone() {
                        if !self.resident.contains_key(&u) {
                            let w = self.gather_async(u)?;
                            let full = self.finish_gather_on_device(u, w)?;
                            self.resident.insert(u, full);
                        }
                    }
                }
                Ok(())
            }
            Action::Reshard { stage } => {
                let ls = self.local_stage(a, stage)?;
                for u in self.stages[ls].units.clone() {
                    if let Some(full) = self.resident.remove(&u) {
                        self.gathered_bytes.sub(full.len() * F32);
                    }
                }
                Ok(())
            }
            Action::ReduceGrad { stage } => {
                let ls = self.local_stage(a, stage)?;
                let buckets = self.stages[ls].buckets.clone();
                if self.defer_reductions() {
                    for b in buckets.clone() {
                        if !self.tied_bucket[b] {
                            self.launch(b, &mut st.reductions)?;
                        }
                    }
                }
                self.drain(&mut st.reductions, Some(&buckets))
            }
            Action::ForwardBackward {
                f_stage,
                f_mb,
                b_stage,
                b_mb,
            } => {
                // The pair's halves in turn: on a CPU there is no second stream to overlap
                // them on; the schedule's order is what DualPipe relies on.
                self.forward(a, f_stage, f_mb, batch(f_mb)?, st)?;
                self.backward(a, b_stage, b_mb, true, st)
            }
            Action::Optimizer => Err(schedule_err(a, "the optimizer step ends the schedule")),
        }
    }

    /// `SEND_*`: `stage`'s message of `flow` for `mb` to the rank of the stage it goes to.
    fn send(
        &mut self,
        a: &Action,
        flow: Flow,
        stage: usize,
        mb: usize,
        st: &mut StepState<M>,
    ) -> Result<(), ParallelError> {
        self.local_stage(a, stage)?;
        let act = st.outbox[flow.index()]
            .remove(&(stage, mb))
            .ok_or_else(|| {
                schedule_err(
                    a,
                    format!(
                        "no {} to send: the pass that makes it has not run on this rank",
                        flow.name()
                    ),
                )
            })?;
        let pipe = self.pipe(a)?;
        let to = flow
            .to(stage)
            .filter(|&s| s < pipe.stage_rank.len())
            .ok_or_else(|| schedule_err(a, format!("stage {stage} sends no {}", flow.name())))?;
        let link = pipe.link(flow == Flow::Gradient, stage).ok_or_else(|| {
            schedule_err(
                a,
                format!("stages {stage} and {to} have no link (same rank?)"),
            )
        })?;
        let wire = self.model.act_to_wire(act)?;
        let tag = p2p_tag(flow == Flow::Gradient, to, mb);
        let out = link.send(wire, tag)?;
        // The sends that have left release their buffers now rather than at the step's end.
        let (done, pending) = std::mem::take(&mut st.sends)
            .into_iter()
            .partition(|(_, _, w)| w.is_done());
        st.sends = pending;
        wait_sends(done)?;
        st.sends.push((*a, pipe.stage_rank[to], out));
        Ok(())
    }

    /// `RECV_*`: posts the receive of `stage`'s message of `flow` for `mb`.
    fn recv(
        &mut self,
        a: &Action,
        flow: Flow,
        stage: usize,
        mb: usize,
        batch: &M::Batch,
        st: &mut StepState<M>,
    ) -> Result<(), ParallelError> {
        self.local_stage(a, stage)?;
        let len = self.model.wire_len(batch);
        let pipe = self.pipe(a)?;
        let from = flow
            .from(stage)
            .filter(|&s| s < pipe.stage_rank.len())
            .ok_or_else(|| schedule_err(a, format!("stage {stage} receives no {}", flow.name())))?;
        let link = pipe.link(flow == Flow::Gradient, from).ok_or_else(|| {
            schedule_err(
                a,
                format!("stages {from} and {stage} have no link (same rank?)"),
            )
        })?;
        let tag = p2p_tag(flow == Flow::Gradient, stage, mb);
        let w = link.recv(len, &self.cfg.device, tag)?;
        st.receives[flow.index()].insert((stage, mb), (pipe.stage_rank[from], w));
        Ok(())
    }

    /// The message of `flow` that `stage` consumes for `mb`: handed over by a neighbour stage
    /// on this rank, or received.
    fn take(
        &self,
        a: &Action,
        flow: Flow,
        stage: usize,
        mb: usize,
        st: &mut StepState<M>,
    ) -> Result<M::Act, ParallelError> {
        if let Some(x) = st.handed[flow.index()].remove(&(stage, mb)) {
            return Ok(x);
        }
        let (peer, w) = st.receives[flow.index()]
            .remove(&(stage, mb))
            .ok_or_else(|| {
                schedule_err(a, format!("no input {}: neither its receive nor the pass that makes it on this rank came before", flow.name()))
            })?;
        let t = Instant::now();
        let wire = w.wait().map_err(|e| {
            schedule_err(
                a,
                format!(
                    "waiting for the {} of stage {stage}, micro-batch {mb} from pp rank {peer}: {e}",
                    flow.name()
                ),
            )
        })?;
        st.waited += t.elapsed();
        self.model.wire_to_act(wire)
    }

    /// Passes `stage`'s message of `flow` on: to the neighbour stage if this rank runs it,
    /// else to the outbox for its `SEND_*`.
    fn deliver(&self, flow: Flow, stage: usize, mb: usize, act: M::Act, st: &mut StepState<M>) {
        match flow.to(stage).filter(|&s| self.is_local(s)) {
            Some(to) => st.handed[flow.index()].insert((to, mb), act),
            None => st.outbox[flow.index()].insert((stage, mb), act),
        };
    }

    /// Starts gathering unit `u`'s weights (ZeRO-3, unless a `UNSHARD` keeps them).
    fn prefetch(&mut self, u: usize) -> Result<Option<Gather>, ParallelError> {
        if self.cfg.zero.shards_params() && !self.resident.contains_key(&u) {
            return Ok(Some(self.gather_async(u)?));
        }
        Ok(None)
    }

    fn forward(
        &mut self,
        a: &Action,
        stage: usize,
        mb: usize,
        batch: &M::Batch,
        st: &mut StepState<M>,
    ) -> Result<(), ParallelError> {
        let ls = self.local_stage(a, stage)?;
        if st.caches.contains_key(&(stage, mb)) {
            return Err(schedule_err(a, "a second forward of the same micro-batch"));
        }
        let units = self.stages[ls].units.clone();
        let mut x = if self.model.is_first(units.start) {
            None
        } else {
            Some(self.take(a, Flow::Activation, stage, mb, st)?)
        };
        let (scale, pin) = (st.scale[ls], self.pin_compute());
        let mut caches = Vec::with_capacity(units.len());
        let mut prefetch = self.prefetch(units.start)?;
        for u in units.clone() {
            let w = prefetch.take();
            if u + 1 < units.end {
                prefetch = self.prefetch(u + 1)?;
            }
            let owned = self.unit_params(u, w)?;
            let range = self.units[u].clone();
            let p = param_slice(&self.params, &self.resident, &owned, u, range);
            let model = &self.model;
            let xin = x.take();
            let (y, cache) = compute(pin, || model.forward(u, p, xin, batch, scale))?;
            self.act_bytes.add(self.model.cache_bytes(&cache));
            caches.push(cache);
            self.release(owned);
            x = Some(y);
        }
        let y = x.expect("a stage has units");
        st.caches.insert((stage, mb), caches);
        if self.model.is_last(units.end - 1) {
            st.loss += self.model.loss(&y) as f64;
        } else {
            self.deliver(Flow::Activation, stage, mb, y, st);
        }
        Ok(())
    }

    /// Decrements `stage`'s count of weight-gradient actions; whether this one launches the
    /// bucket reductions (ZeRO-2/3: every one; else the step's last).
    fn reduces_now(&mut self, ls: usize, st: &mut StepState<M>) -> bool {
        st.weight_left[ls] = st.weight_left[ls].saturating_sub(1);
        let last = st.weight_left[ls] == 0;
        if last {
            self.stage_grads_final(ls);
        }
        self.cfg.zero.shards_grads() || last
    }

    fn tracker(&self, ls: usize) -> ReadyTracker {
        ReadyTracker::for_buckets(&self.buckets[self.stages[ls].buckets.clone()])
    }

    /// Marks unit `u`'s gradients final and launches the buckets that became complete.
    fn mark_ready(
        &mut self,
        ls: usize,
        u: usize,
        tracker: &mut Option<ReadyTracker>,
        st: &mut StepState<M>,
    ) -> Result<(), ParallelError> {
        if let Some(tr) = tracker {
            let first = self.stages[ls].buckets.start;
            for b in tr.mark(self.units[u].clone())? {
                // Tied copies wait for their sum at the end of the step.
                if !self.tied_bucket[first + b] {
                    self.launch(first + b, &mut st.reductions)?;
                }
            }
        }
        // Consume reductions that already finished, so their buffers are freed during
        // backward rather than at its end.
        self.poll(&mut st.reductions)
    }

    fn check_complete(
        &self,
        ls: usize,
        tracker: Option<ReadyTracker>,
    ) -> Result<(), ParallelError> {
        if let Some(tr) = tracker {
            let missing = tr.incomplete();
            if !missing.is_empty() {
                return Err(ParallelError::Protocol(format!(
                    "stage {}: buckets {missing:?} never became ready",
                    self.stages[ls].id
                )));
            }
        }
        Ok(())
    }

    /// `BACKWARD` (`fused`) or `BACKWARD_INPUT` of `stage` for `mb`, unit by unit in reverse.
    fn backward(
        &mut self,
        a: &Action,
        stage: usize,
        mb: usize,
        fused: bool,
        st: &mut StepState<M>,
    ) -> Result<(), ParallelError> {
        let ls = self.local_stage(a, stage)?;
        let mut caches = st
            .caches
            .remove(&(stage, mb))
            .ok_or_else(|| schedule_err(a, "no forward of this micro-batch came before"))?;
        let units = self.stages[ls].units.clone();
        let mut dy = if self.model.is_last(units.end - 1) {
            None
        } else {
            Some(self.take(a, Flow::Gradient, stage, mb, st)?)
        };
        let mut tracker = (fused && self.reduces_now(ls, st) && !self.defer_reductions())
            .then(|| self.tracker(ls));
        let (scale, pin) = (st.scale[ls], self.pin_compute());
        let mut pending = Vec::new();
        let mut prefetch = self.prefetch(units.end - 1)?;
        for u in units.clone().rev() {
            let cache = caches.pop().expect("one cache per unit");
            let cache_bytes = self.model.cache_bytes(&cache);
            let w = prefetch.take();
            if u > units.start {
                prefetch = self.prefetch(u - 1)?;
            }
            let owned = self.unit_params(u, w)?;
            self.record(TraceKind::BackwardStart(u));
            let range = self.units[u].clone();
            let p = param_slice(&self.params, &self.resident, &owned, u, range.clone());
            let model = &self.model;
            let din = dy.take();
            let (dx, wg) = compute(pin, || model.backward_input(u, p, cache, din, scale))?;
            self.act_bytes.sub(cache_bytes);
            if fused {
                grad_sink!(self).accumulate(u, range, |g| {
                    compute(pin, || model.backward_weight(u, p, wg, g))
                })?;
            } else {
                self.act_bytes.add(self.model.weight_grad_bytes(&wg));
                pending.push((u, wg));
            }
            self.release(owned);
            self.record(TraceKind::BackwardEnd(u));
            if fused {
                self.mark_ready(ls, u, &mut tracker, st)?;
            }
            dy = dx;
        }
        self.check_complete(ls, tracker)?;
        if !fused {
            st.weight_grads.insert((stage, mb), pending);
        }
        if let Some(dx) = dy {
            if self.model.is_first(units.start) {
                return Err(schedule_err(
                    a,
                    "the model's first unit returned an input gradient",
                ));
            }
            self.deliver(Flow::Gradient, stage, mb, dx, st);
        }
        Ok(())
    }

    /// `BACKWARD_WEIGHT` of `stage` for `mb`: the weight gradients its `BACKWARD_INPUT` left.
    fn backward_weight(
        &mut self,
        a: &Action,
        stage: usize,
        mb: usize,
        st: &mut StepState<M>,
    ) -> Result<(), ParallelError> {
        let ls = self.local_stage(a, stage)?;
        let list = st
            .weight_grads
            .remove(&(stage, mb))
            .ok_or_else(|| schedule_err(a, "no BACKWARD_INPUT of this micro-batch came before"))?;
        let mut tracker =
            (self.reduces_now(ls, st) && !self.defer_reductions()).then(|| self.tracker(ls));
        let pin = self.pin_compute();
        let order: Vec<usize> = list.iter().map(|(u, _)| *u).collect();
        let mut prefetch = match order.first() {
            Some(&u) => self.prefetch(u)?,
            None => None,
        };
        for (k, (u, wg)) in list.into_iter().enumerate() {
            let bytes = self.model.weight_grad_bytes(&wg);
            let w = prefetch.take();
            if let Some(&next) = order.get(k + 1) {
                prefetch = self.prefetch(next)?;
            }
            let owned = self.unit_params(u, w)?;
            self.record(TraceKind::BackwardStart(u));
            let range = self.units[u].clone();
            let p = param_slice(&self.params, &self.resident, &owned, u, range.clone());
            let model = &self.model;
            grad_sink!(self).accumulate(u, range, |g| {
                compute(pin, || model.backward_weight(u, p, wg, g))
            })?;
            self.act_bytes.sub(bytes);
            self.release(owned);
            self.record(TraceKind::BackwardEnd(u));
            self.mark_ready(ls, u, &mut tracker, st)?;
        }
        self.check_complete(ls, tracker)
    }

    /// Ends the step: every message delivered, every reduction stored, nothing left over; the
    /// loss averaged over micro-batches and ranks; the optimizer step.
    fn finish(&mut self, n_micro: usize, mut st: StepState<M>) -> Result<StepStats, ParallelError> {
        wait_sends(std::mem::take(&mut st.sends))?;
        self.reduce_tied(&mut st.reductions)?;
        self.drain(&mut st.reductions, None)?;
        let leftover = |what: &str, keys: Vec<Key>| -> Result<(), ParallelError> {
            match keys.first() {
                None => Ok(()),
                Some((s, mb)) => Err(ParallelError::Schedule(format!(
                    "the step ended with {what} of stage {s}, micro-batch {mb} (and {} more)",
                    keys.len() - 1
                ))),
            }
        };
        leftover(
            "no backward for the forward",
            st.caches.keys().copied().collect(),
        )?;
        leftover(
            "no BACKWARD_WEIGHT for the BACKWARD_INPUT",
            st.weight_grads.keys().copied().collect(),
        )?;
        for flow in [Flow::Activation, Flow::Gradient] {
            let i = flow.index();
            let what = |w: &str| format!("{w} {}", flow.name());
            leftover(
                &what("an unused handed-over"),
                st.handed[i].keys().copied().collect(),
            )?;
            leftover(&what("an unsent"), st.outbox[i].keys().copied().collect())?;
            leftover(
                &what("an unused received"),
                st.receives[i].keys().copied().collect(),
            )?;
        }
        for full in std::mem::take(&mut self.resident).into_values() {
            self.gathered_bytes.sub(full.len() * F32);
        }
        // Mean over micro-batches, then over dp ranks; with a pipeline only the last stage
        // holds it, and the sum over the pp group hands it to every stage.
        let mut loss = [(st.loss / n_micro as f64) as f32];
        if self.dp.size() > 1 {
            self.dp.all_reduce(&mut loss, ReduceOp::Sum)?;
            loss[0] /= self.dp.size() as f32;
        }
        if let Some(p) = &self.pipe {
            if p.group.size() > 1 {
                p.group.all_reduce(&mut loss, ReduceOp::Sum)?;
            }
        }
        let loss_scale = self.scaler.scale;
        let (grad_norm, applied) = self.optimizer_step()?;
        Ok(StepStats {
            loss: loss[0],
            grad_norm,
            applied,
            loss_scale,
            dp_bytes_sent: 0,
            delayed_update: None,
        })
    }

    /// The validation metric of a forward-only pass over `batch` with the current weights
    /// ([`StageModel::eval_metric`]), on every rank. A collective where the weights are
    /// gathered (ZeRO-3) or stages send activations: every rank calls it, with the same batch
    /// on the ranks of one model replica.
    pub fn evaluate(&mut self, batch: &M::Batch) -> Result<f32, ParallelError> {
        let _operands = tensor::operands::Scope::enter(self.cfg.operands());
        let pin = self.pin_compute();
        let mut metric = 0.0f32;
        let mut carried: Option<M::Act> = None;
        let mut sends = Vec::new();
        let no_pipe = || {
            ParallelError::Layout(
                "evaluation: the model's stages span ranks but there is no pipeline group".into(),
            )
        };
        let first_chain_end = self.pipe.as_ref().map_or(usize::MAX, |p| p.first_chain_end);
        for ls in 0..self.stages.len() {
            let (id, units) = (self.stages[ls].id, self.stages[ls].units.clone());
            if id >= first_chain_end {
                continue; // a replica of layers the first chain runs
            }
            let mut x = if self.model.is_first(units.start) {
                None
            } else if let Some(c) = carried.take() {
                Some(c)
            } else {
                let pipe = self.pipe.as_ref().ok_or_else(no_pipe)?;
                let link = pipe.link(false, id - 1).ok_or_else(no_pipe)?;
                let w = link.recv(
                    self.model.wire_len(batch),
                    &self.cfg.device,
                    p2p_tag(false, id, 0),
                )?;
                Some(self.model.wire_to_act(w.wait()?)?)
            };
            let mut last = None;
            let mut prefetch = self.prefetch(units.start)?;
            for u in units.clone() {
                let w = prefetch.take();
                if u + 1 < units.end {
                    prefetch = self.prefetch(u + 1)?;
                }
                let owned = self.unit_params(u, w)?;
                let range = self.units[u].clone();
                let p = param_slice(&self.params, &self.resident, &owned, u, range);
                let model = &self.model;
                let xin = x.take();
                let (y, cache) = compute(pin, || model.forward(u, p, xin, batch, 0.0))?;
                last = Some(cache);
                self.release(owned);
                x = Some(y);
            }
            let y = x.expect("a stage has units");
            if self.model.is_last(units.end - 1) {
                metric = self
                    .model
                    .eval_metric(&y, last.as_ref().expect("a stage has units"))?;
            } else if self.is_local(id + 1) {
                carried = Some(y);
            } else {
                let pipe = self.pipe.as_ref().ok_or_else(no_pipe)?;
                let link = pipe.link(false, id).ok_or_else(no_pipe)?;
                let wire = self.model.act_to_wire(y)?;
                sends.push(link.send(wire, p2p_tag(false, id + 1, 0))?);
            }
        }
        for w in sends {
            w.wait()?;
        }
        if let Some(p) = &self.pipe {
            if p.group.size() > 1 {
                let mut m = [metric];
                p.group.all_reduce(&mut m, ReduceOp::Sum)?;
                metric = m[0];
            }
        }
        Ok(metric)
    }
}
