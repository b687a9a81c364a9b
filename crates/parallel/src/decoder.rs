//! The Llama / Mixtral decoder of the `model` crate as a [`StageModel`]: what one rank holds of
//! it after the passes of [`crate::parallelize`] — a run of parts (the token embedding, blocks,
//! the final norm + LM head + cross-entropy), each a unit over its slice of the rank's flat
//! buffer, sharded over the tensor-parallel group when tp > 1.
//!
//! Without tensor parallelism the units are the model's own layers, exactly as the
//! single-process `Model::forward_backward` runs them (the head computes its gradients in the
//! forward pass, while the logits are in cache). With it, the blocks carry the tp region
//! operators and the embedding and head are vocab-parallel ([`crate::tensor_parallel`]).
//!
//! The loss of a micro-batch is the model's: mean cross-entropy over its valid targets plus the
//! blocks' MoE auxiliary losses, which travel forward with the activations ([`LlmAct`]).
//!
//! Tied embeddings: the head holds a copy of the embedding (see [`crate::tensor_parallel::plan`]);
//! [`StageModel::tied_ranges`] names both (or the one this rank holds, with the group of the
//! rank holding the other: Megatron's embedding group, [`DecoderStage::with_tie_group`]) and
//! [`StageModel::sum_tied`] makes each the sum of both. Norms, checkpoints and exports count
//! the embedding only.
//!
//! With context parallelism ([`DecoderStage::with_context`]) the stage runs on its rank's
//! tokens of every sequence ([`CpLayout::slice`]) at their global positions; attention and the
//! MoE statistics see the other ranks' through the cores it is given. Each rank's loss is its
//! tokens' share of the mean over all valid targets, times cp, as is the gradient it seeds:
//! the executor averages both over dp × cp, which makes them the mean over the sequence.
use std::borrow::Cow;
use std::ops::Range;
use std::sync::Arc;

use comm::ProcessGroup;
use model::layers::block::BlockCache;
use model::layers::head::{HeadCache, HeadWeightGrad};
use model::layers::{Buf, BufMut, BufRef, Pass, Recompute, WeightGradStore};
use model::{Batch, Model, ModelConfig};

use crate::context_parallel::CpLayout;
use crate::pipeline_parallel::split::Part;
use crate::placement::Placement;
use crate::stage::StageModel;
use crate::tensor_parallel::head::TpHeadCache;
use crate::tensor_parallel::{TpPlan, TpShard};
use crate::ParallelError;

/// Activations between units, with the auxiliary loss accumulated so far.
pub struct LlmAct {
    pub x: Buf,
    pub aux: f32,
}

/// What a unit keeps for its backward.
pub enum DecoderCache {
    Embed(Vec<u32>),
    Block(Box<BlockCache>),
    /// The model's head, its reported cross-entropy (the eval metric), and the number of
    /// valid targets its mean is over (the whole sequences' under context parallelism).
    Head(HeadCache, f32, usize),
    /// The vocab-parallel head, and the count of the mean.
    TpHead(TpHeadCache, usize),
}

/// A unit's pending weight-gradient work.
pub enum DecoderWeightGrad {
    /// The embedding's scatter-add of its output gradient.
    Embed {
        ids: Vec<u32>,
        dx: Buf,
    },
    Block(WeightGradStore),
    Head(HeadWeightGrad),
    /// Gradients already computed (the vocab-parallel head's fused backward), to be added.
    Dense(Buf),
}

/// One tensor this rank holds: where, and where it comes from in the full model.
#[derive(Clone, Debug)]
struct Held {
    placement: Placement,
    /// Elements of the local tensor (the slice plus any vocabulary padding rows after it).
    local_len: usize,
    /// Offset of the tensor in the full model's flat layout.
    full_offset: usize,
    /// A stacked expert tensor (held by this ep rank only; the others are replicated over ep).
    experts: bool,
    /// The embedding of a model with tied embeddings, or the head's copy of it.
    tied: bool,
    /// The head's copy (never counted in norms or saved).
    tied_copy: bool,
}

impl Held {
    /// Whether the model reads this tensor only as an operand of matrix products: the
    /// attention projections, a dense MLP's, and an untied LM head (the fused loss and the
    /// logits read it through products). The rest — norm gains, the embedding table (rows
    /// gathered), a tied table, a mixture of experts' router and experts — is read as values.
    fn product_only(&self) -> bool {
        const PROJECTIONS: [&str; 7] = [
            ".self_attn.q_proj.weight",
            ".self_attn.k_proj.weight",
            ".self_attn.v_proj.weight",
            ".self_attn.o_proj.weight",
            ".mlp.gate_proj.weight",
            ".mlp.up_proj.weight",
            ".mlp.down_proj.weight",
        ];
        let name = &self.placement.slice.name;
        !self.experts
            && !self.tied
            && (name == "lm_head.weight" || PROJECTIONS.iter().any(|p| name.ends_with(p)))
    }
}

/// Routed tokens of the MoE layers since the last [`DecoderStage::take_moe_load`]: per layer
/// (global index) and expert, and the assignments dropped by a capacity. Training forwards
/// only, counted on tp rank 0 (the tp ranks route the same tokens).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MoeLoad {
    pub tokens: std::collections::BTreeMap<usize, Vec<u64>>,
    pub dropped: u64,
}

/// Expert parallelism's groups of a stage.
#[derive(Clone, Debug)]
struct EpGroups {
    /// The ranks holding the other experts (same tp coordinate).
    ep: ProcessGroup,
    /// The ranks holding parts of the same layers (ep × tp): gradient norms sum over it.
    parts: ProcessGroup,
}

/// One rank's part of the decoder.
#[derive(Clone, Debug)]
pub struct DecoderStage {
    /// The full model's configuration.
    pub cfg: ModelConfig,
    /// This rank's shard as a model (the full model without tensor parallelism).
    pub local: Model,
    /// The tensor-parallel parts (tp > 1).
    pub tp: Option<TpShard>,
    /// The tensor-parallel plan (the identity plan at tp = 1).
    pub plan: TpPlan,
    /// The parts this rank runs, in forward order (one unit each).
    pub parts: Vec<Part>,
    pub recompute: Recompute,
    /// Each unit's range in this rank's flat buffer, and in the local model's layout.
    ranges: Vec<Range<usize>>,
    layout_ranges: Vec<Range<usize>>,
    /// Units holding a tensor whose local gradient is a partial sum over tp.
    partial: Vec<bool>,
    held: Vec<Held>,
    /// This rank's share of the sequences (context parallelism), and the group of the ranks
    /// holding the rest.
    pub cp: Option<CpLayout>,
    /// The blocks' (shared) context-parallel attention (cp > 1).
    pub cp_attention: Option<Arc<crate::context_parallel::ring::ContextAttention>>,
    /// The MoE layers' (shared) token exchange over the ep group (ep > 1).
    pub ep_exchange: Option<crate::expert_parallel::EpExchange>,
    seqs: Option<Arc<dyn model::layers::SequenceGroup>>,
    /// Expert parallelism (ep > 1).
    ep: Option<EpGroups>,
    moe_load: Arc<std::sync::Mutex<MoeLoad>>,
    /// The ranks holding the other copy of the tied embedding (pipeline parallelism with the
    /// embedding and the head on different ranks), this rank first or second.
    tie_group: Option<ProcessGroup>,
    /// Whether the head (without tensor parallelism) computes its gradients in its forward:
    /// one logits product fewer, but its `V·h` weight gradient is then held until the
    /// micro-batch's weight gradients run ([`crate::parallelize::head_grads_in_forward`]).
    early_head_grads: bool,
}

fn merr(e: model::ModelError) -> ParallelError {
    ParallelError::Model(e.to_string())
}

impl DecoderStage {
    /// The whole decoder on one rank (no tensor or pipeline parallelism).
    pub fn whole(cfg: &ModelConfig) -> Result<Self, ParallelError> {
        let parts = crate::pipeline_parallel::split::stage_parts(cfg.num_hidden_layers, 1, 0)?;
        Self::new(cfg, None, parts, Recompute::None, (1, 0))
    }

    /// `parts` of the decoder `cfg`, sharded by `tp` (the local model and its tensor-parallel
    /// parts from [`crate::tensor_parallel::shard_model_with_experts`]) or whole but for the
    /// experts of `ep = (size, rank)` (see [`Self::with_experts`]).
    pub fn new(
        cfg: &ModelConfig,
        tp: Option<(Model, TpShard)>,
        parts: Vec<Part>,
        recompute: Recompute,
        ep: (usize, usize),
    ) -> Result<Self, ParallelError> {
        if parts.is_empty() {
            return Err(ParallelError::Layout(
                "a stage needs at least one part".into(),
            ));
        }
        let (local, tp, plan) = match tp {
            Some((local, shard)) => {
                let plan = shard.plan.clone();
                (local, Some(shard), plan)
            }
            None => {
                let plan = TpPlan::with_experts(cfg, 1, false, ep.0, ep.1)?;
                (plan.local_model()?, None, plan)
            }
        };
        let tp_rank = tp.as_ref().map_or(0, |t| t.rank());
        let l = &local.layout;
        let layout_ranges: Vec<Range<usize>> = parts
            .iter()
            .map(|p| match *p {
                Part::Embedding => Ok(l.embed_range()),
                Part::Block(i) if i < l.num_blocks() => Ok(l.block_range(i)),
                Part::Head => Ok(l.head_range()),
                Part::Block(i) => Err(ParallelError::Layout(format!(
                    "block {i} of a {}-layer model",
                    l.num_blocks()
                ))),
            })
            .collect::<Result<_, _>>()?;
        let mut ranges = Vec::with_capacity(parts.len());
        let mut at = 0;
        for r in &layout_ranges {
            ranges.push(at..at + r.len());
            at += r.len();
        }
        let mut held = Vec::new();
        let mut partial = vec![false; parts.len()];
        for t in &plan.tensors {
            let Some(u) = layout_ranges
                .iter()
                .position(|r| r.start <= t.local.offset && t.local.range().end <= r.end)
            else {
                continue;
            };
            partial[u] |= t.partial_grad && plan.tp > 1;
            held.push(Held {
                placement: Placement {
                    slice: plan.slice(t, tp_rank),
                    start: ranges[u].start + t.local.offset - layout_ranges[u].start,
                    owner: plan.owns_tensor(t, tp_rank),
                },
                local_len: t.local.numel(),
                full_offset: t.full.offset,
                experts: t.experts.is_some(),
                tied: cfg.tie_word_embeddings
                    && (t.tied_copy || t.name == "model.embed_tokens.weight"),
                tied_copy: t.tied_copy,
            });
        }
        held.sort_by_key(|h| h.placement.start);
        Ok(DecoderStage {
            cfg: cfg.clone(),
            local,
            tp,
            plan,
            parts,
            recompute,
            ranges,
            layout_ranges,
            partial,
            held,
            cp: None,
            cp_attention: None,
            ep_exchange: None,
            seqs: None,
            ep: None,
            moe_load: Arc::default(),
            tie_group: None,
            early_head_grads: true,
        })
    }

    /// The stage with the group over which its copy of the tied embedding is summed with the
    /// other copy, held by another rank (see the module doc).
    pub fn with_tie_group(mut self, group: ProcessGroup) -> Self {
        self.tie_group = Some(group);
        self
    }

    /// The stage with the head computing its gradients in its forward or not (default: it
    /// does; see [`crate::parallelize::head_grads_in_forward`]). Either way the gradients
    /// are the same bits.
    pub fn with_early_head_grads(mut self, early: bool) -> Self {
        self.early_head_grads = early;
        self
    }

    /// The stage with its experts spread over `ep` (the MoE layers exchange tokens over it)
    /// and `parts` the group of the ranks holding parts of the same layers (ep × tp). The
    /// stage must have been built for this ep rank ([`Self::new`]'s `ep`).
    pub fn with_experts(mut self, ep: ProcessGroup, parts: ProcessGroup) -> Self {
        let ep_exchange = crate::expert_parallel::EpExchange::new(ep.clone());
        let exchange: Arc<dyn model::layers::moe::ExpertExchange> = Arc::new(ep_exchange.clone());
        for b in &mut self.local.blocks {
            if let model::layers::block::Ffn::Moe(m) = &mut b.ffn {
                m.exchange = Some(exchange.clone());
            }
        }
        self.ep_exchange = Some(ep_exchange);
        self.ep = Some(EpGroups { ep, parts });
        self
    }

    /// The stage on `layout`'s share of every sequence: its blocks' attention through
    /// `attention` and their MoE statistics summed over `seqs`.
    pub fn with_context(
        mut self,
        layout: CpLayout,
        attention: Arc<crate::context_parallel::ring::ContextAttention>,
        seqs: Arc<dyn model::layers::SequenceGroup>,
    ) -> Self {
        let core: Arc<dyn model::layers::attention::AttentionCore> = attention.clone();
        for b in &mut self.local.blocks {
            b.attn.core = Some(core.clone());
            if let model::layers::block::Ffn::Moe(m) = &mut b.ffn {
                m.seq_group = Some(seqs.clone());
            }
        }
        self.cp = Some(layout);
        self.cp_attention = Some(attention);
        self.seqs = Some(seqs);
        self
    }

    /// The MoE layers' routed tokens since the last call (and resets them).
    pub fn take_moe_load(&self) -> MoeLoad {
        let mut l = self.moe_load.lock().unwrap_or_else(|e| e.into_inner());
        std::mem::take(&mut *l)
    }

    /// The multiple each cp rank's loss and gradient seed carry (module doc).
    fn cp_mult(&self) -> f32 {
        self.cp.map_or(1.0, |l| l.cp as f32)
    }

    /// This rank's tokens of `batch` (all of them without context parallelism).
    fn local_batch<'a>(&self, batch: &'a Batch) -> Result<Cow<'a, Batch>, ParallelError> {
        let Some(l) = &self.cp else {
            return Ok(Cow::Borrowed(batch));
        };
        l.check(batch.seq)?;
        let (b, s) = (batch.batch, batch.seq);
        Batch::new(
            b,
            l.local_len(s),
            l.slice(&batch.inputs, b, s, 1),
            l.slice(&batch.targets, b, s, 1),
        )
        .map(Cow::Owned)
        .map_err(merr)
    }

    /// Valid targets the mean cross-entropy of `batch` is over: all of the sequences', which
    /// every cp rank can count itself.
    fn mean_count(&self, batch: &Batch, local_valid: usize) -> Result<usize, ParallelError> {
        match self.cp {
            None => Ok(local_valid),
            Some(_) => tensor::cross_entropy::count_valid(
                &batch.targets,
                self.cfg.vocab_size,
                tensor::cross_entropy::IGNORE_INDEX,
            )
            .map_err(|e| ParallelError::Model(e.to_string())),
        }
    }

    /// Elements of this rank's flat buffer.
    pub fn num_params(&self) -> usize {
        self.ranges.last().map_or(0, |r| r.end)
    }

    fn tp_rank(&self) -> usize {
        self.tp.as_ref().map_or(0, |t| t.rank())
    }

    /// Elements `range` of this rank's initial flat buffer for `seed`: the full model's
    /// initialisation ([`Model::init_range`]) cut to this rank's blocks, generated element by
    /// element (no rank builds the full model).
    pub fn init_range(&self, seed: u64, range: Range<usize>, out: &mut [f32]) {
        let full_layout = &self.plan.full_layout;
        let std = self.cfg.initializer_range;
        out.fill(0.0);
        for h in &self.held {
            let p = &h.placement;
            let local = p.start..p.start + h.local_len;
            let (s, e) = (local.start.max(range.start), local.end.min(range.end));
            if s >= e {
                continue;
            }
            // Slice elements only: vocabulary padding rows stay zero.
            let slice_end = (p.slice.numel() + p.start).min(e);
            if s >= slice_end {
                continue;
            }
            for run in p.slice.runs(s - p.start..slice_end - p.start) {
                let full = h.full_offset + run.full;
                let dst = p.start + run.slice - range.start;
                model::init::init_range(
                    full_layout,
                    std,
                    seed,
                    full..full + run.len,
                    &mut out[dst..dst + run.len],
                );
            }
        }
    }

    /// The tokens of a micro-batch this rank's activations hold (its share under sequence
    /// parallelism).
    fn local_tokens(&self, batch: &Batch) -> usize {
        let tokens = batch.tokens() / self.cp.map_or(1, |l| l.cp);
        match &self.tp {
            Some(t) if t.region.sequence_parallel() => tokens / t.region.tp(),
            _ => tokens,
        }
    }

    /// Adds `gu` (a unit's fresh gradients) into `g`, after summing its partial gradients over
    /// the tp group. A fresh buffer, so accumulation over micro-batches never sums an already
    /// synced part twice.
    /// The sum runs over the host transports (a GPU's gradients go through host memory).
    fn add_synced(&self, unit: usize, gu: Buf, g: BufMut<'_>) -> Result<(), ParallelError> {
        let gu = match (&self.tp, self.partial[unit]) {
            (Some(tp), true) => gu.on_host(|v| -> Result<_, ParallelError> {
                self.plan
                    .sync_grads_in(tp.group(), v, self.layout_ranges[unit].clone())?;
                Ok(())
            })?,
            _ => gu,
        };
        tensor::ops::add_assign(g, gu.r()).map_err(terr)
    }
}

impl StageModel for DecoderStage {
    type Batch = Batch;
    type Act = LlmAct;
    type Cache = DecoderCache;
    type WeightGrad = DecoderWeightGrad;

    fn units(&self) -> Vec<Range<usize>> {
        self.ranges.clone()
    }

    fn tensors(&self) -> Vec<Range<usize>> {
        self.held
            .iter()
            .map(|h| h.placement.start..h.placement.start + h.local_len)
            .collect()
    }

    fn placements(&self) -> Vec<Placement> {
        self.held.iter().map(|h| h.placement.clone()).collect()
    }

    /// Everything but the tensors only products read ([`Held::product_only`]): the norm
    /// gains, the embedding table, a mixture of experts' tensors — and anything of the unit no
    /// tensor is known to cover.
    fn value_ranges(&self, unit: usize) -> Vec<Range<usize>> {
        let u = self.ranges[unit].clone();
        let products = self
            .held
            .iter()
            .filter(|h| h.product_only())
            .map(|h| h.placement.start..h.placement.start + h.local_len)
            .filter(|r| u.start <= r.start && r.end <= u.end)
            .collect();
        crate::placement::uncovered(products, u)
    }

    fn is_first(&self, unit: usize) -> bool {
        self.parts[unit] == Part::Embedding
    }

    fn is_last(&self, unit: usize) -> bool {
        self.parts[unit] == Part::Head
    }

    fn forward(
        &self,
        unit: usize,
        p: BufRef<'_>,
        x: Option<LlmAct>,
        batch: &Batch,
        scale: f32,
    ) -> Result<(LlmAct, DecoderCache), ParallelError> {
        let need = |x: Option<LlmAct>| {
            x.ok_or_else(|| ParallelError::Model(format!("unit {unit} needs an input")))
        };
        let full = batch;
        let batch = &*self.local_batch(full)?;
        match self.parts[unit] {
            Part::Embedding => {
                let x = match &self.tp {
                    Some(t) => {
                        t.plan.check_seq(batch.seq)?;
                        t.embed.forward(p, &batch.inputs).map_err(merr)?
                    }
                    None => self.local.embed_forward(p, &batch.inputs).map_err(merr)?,
                };
                Ok((
                    LlmAct { x, aux: 0.0 },
                    DecoderCache::Embed(batch.inputs.clone()),
                ))
            }
            Part::Block(i) => {
                let act = need(x)?;
                // The documents are over the whole sequences (global positions), also under cp.
                let mut pass = Pass::new(batch.batch, batch.seq)
                    .with_recompute(self.recompute)
                    .with_documents(full.docs.clone());
                if let Some(l) = &self.cp {
                    pass.part = l.part(full.seq);
                }
                // The auxiliary-loss gradient is seeded once over the tp group.
                pass.loss_scale = if self.tp_rank() == 0 {
                    scale * self.cp_mult()
                } else {
                    0.0
                };
                let (y, cache) = self.local.blocks[i]
                    .forward(p, Arc::new(act.x), &pass)
                    .map_err(merr)?;
                let aux = act.aux + cache.aux_loss();
                if let (Some(r), true, 0) = (cache.routing(), scale != 0.0, self.tp_rank()) {
                    let mut l = self.moe_load.lock().unwrap_or_else(|e| e.into_inner());
                    let layer = l.tokens.entry(i).or_insert_with(|| vec![0; r.counts.len()]);
                    for (a, &c) in layer.iter_mut().zip(&r.counts) {
                        *a += c as u64;
                    }
                    l.dropped += r.dropped() as u64;
                }
                Ok((LlmAct { x: y, aux }, DecoderCache::Block(Box::new(cache))))
            }
            Part::Head => {
                let act = need(x)?;
                let (x, targets) = (Arc::new(act.x), Arc::new(batch.targets.clone()));
                let mult = self.cp_mult();
                let (cache, ce) = match &self.tp {
                    Some(t) => {
                        let c = t.head.forward(p, x, targets).map_err(merr)?;
                        let n = self.mean_count(full, c.n_valid)?;
                        let ce = mean(c.loss_sum, n) * mult;
                        (DecoderCache::TpHead(c, n), ce)
                    }
                    None => {
                        // The gradient scale of the mean loss is known now: the head computes
                        // its gradients in this pass (one logits product fewer) unless they
                        // would pile up over micro-batches in flight. `scale = 0` is a
                        // forward-only pass (validation).
                        let local_valid = tensor::cross_entropy::count_valid(
                            &targets,
                            self.cfg.vocab_size,
                            tensor::cross_entropy::IGNORE_INDEX,
                        )
                        .map_err(|e| ParallelError::Model(e.to_string()))?;
                        let n = self.mean_count(full, local_valid)?;
                        let none: &[f32] = &[];
                        let c = if scale == 0.0 || !self.early_head_grads {
                            self.local.head_forward(p, none, x, targets)
                        } else {
                            let s = grad_scale(scale * mult, n);
                            self.local.head_forward_with_grad(p, none, x, targets, s)
                        }
                        .map_err(merr)?;
                        let ce = mean(c.loss_sum, n) * mult;
                        (DecoderCache::Head(c, ce, n), ce)
                    }
                };
                // Expert parallelism: the ep ranks hold different data, and the executor
                // averages over the expert-data-parallel group only: report the ep mean.
                let (ce, aux, cache) = match &self.ep {
                    Some(g) => {
                        let mut v = [ce, act.aux];
                        g.ep.all_reduce(&mut v, comm::ReduceOp::Sum)?;
                        let n = g.ep.size() as f32;
                        let cache = match cache {
                            DecoderCache::Head(c, _, m) => DecoderCache::Head(c, v[0] / n, m),
                            other => other,
                        };
                        (v[0] / n, v[1] / n, cache)
                    }
                    None => (ce, act.aux, cache),
                };
                Ok((
                    LlmAct {
                        x: Buf::Host(vec![ce + aux]),
                        aux,
                    },
                    cache,
                ))
            }
        }
    }

    fn backward_input(
        &self,
        unit: usize,
        p: BufRef<'_>,
        cache: DecoderCache,
        dy: Option<LlmAct>,
        scale: f32,
    ) -> Result<(Option<LlmAct>, DecoderWeightGrad), ParallelError> {
        let need = |dy: Option<LlmAct>| {
            dy.map(|a| a.x)
                .ok_or_else(|| ParallelError::Model(format!("unit {unit} backward needs dY")))
        };
        let act = |x: Buf| Some(LlmAct { x, aux: 0.0 });
        match cache {
            DecoderCache::Embed(ids) => Ok((None, DecoderWeightGrad::Embed { ids, dx: need(dy)? })),
            DecoderCache::Block(c) => {
                let i = match self.parts[unit] {
                    Part::Block(i) => i,
                    _ => return Err(ParallelError::Model(format!("unit {unit} is not a block"))),
                };
                let (dx, store) = self.local.blocks[i]
                    .backward_input(p, *c, need(dy)?)
                    .map_err(merr)?;
                Ok((act(dx), DecoderWeightGrad::Block(store)))
            }
            DecoderCache::Head(c, _, n) => {
                // d(mean CE)/d(loss_sum) = 1/n_valid, times the micro-batch's weight (and cp).
                let s = grad_scale(scale * self.cp_mult(), n);
                let none: &[f32] = &[];
                let (dx, pending) = self
                    .local
                    .head_backward_input(p, none, c, s)
                    .map_err(merr)?;
                Ok((act(dx), DecoderWeightGrad::Head(pending)))
            }
            DecoderCache::TpHead(c, n) => {
                let t = self
                    .tp
                    .as_ref()
                    .expect("a tp head cache comes from a tp stage");
                let s = grad_scale(scale * self.cp_mult(), n);
                let mut gu = tensor::ops::zeros_like(p, p.len()).map_err(terr)?;
                let dx = t.head.backward(p, gu.m(), c, s).map_err(merr)?;
                Ok((act(dx), DecoderWeightGrad::Dense(gu)))
            }
        }
    }

    fn backward_weight(
        &self,
        unit: usize,
        p: BufRef<'_>,
        pending: DecoderWeightGrad,
        g: BufMut<'_>,
    ) -> Result<(), ParallelError> {
        match pending {
            DecoderWeightGrad::Embed { ids, dx } => match &self.tp {
                Some(t) => t.embed.backward(g, &ids, dx).map_err(merr),
                None => self.local.embed_backward(g, &ids, dx.r()).map_err(merr),
            },
            DecoderWeightGrad::Block(store) => {
                if self.partial[unit] {
                    let mut gu = tensor::ops::zeros_like(p, g.len()).map_err(terr)?;
                    store.apply(gu.m()).map_err(merr)?;
                    self.add_synced(unit, gu, g)
                } else {
                    store.apply(g).map_err(merr)
                }
            }
            DecoderWeightGrad::Head(w) => {
                let none: &[f32] = &[];
                self.local
                    .head_backward_weight(p, none, g, None, w)
                    .map_err(merr)
            }
            DecoderWeightGrad::Dense(gu) => self.add_synced(unit, gu, g),
        }
    }

    fn loss(&self, out: &LlmAct) -> f32 {
        // The head's output is one host scalar (the loss), whatever the device.
        out.x.as_host("the loss").map_or(f32::NAN, |v| v[0])
    }

    fn eval_metric(&self, out: &LlmAct, last: &DecoderCache) -> Result<f32, ParallelError> {
        // The cross-entropy this rank reports is cp × its tokens' share: the mean over cp of
        // it is the sequences' mean.
        let ce = match last {
            DecoderCache::Head(_, ce, _) => *ce,
            DecoderCache::TpHead(c, n) => mean(c.loss_sum, *n) * self.cp_mult(),
            _ => self.loss(out) - out.aux,
        };
        match &self.seqs {
            Some(g) => {
                let mut v = [ce as f64];
                g.sum(&mut v).map_err(merr)?;
                Ok((v[0] / self.cp_mult() as f64) as f32)
            }
            None => Ok(ce),
        }
    }

    fn cache_bytes(&self, cache: &DecoderCache) -> usize {
        match cache {
            DecoderCache::Embed(ids) => std::mem::size_of_val(ids.as_slice()),
            DecoderCache::Block(c) => c.bytes(),
            DecoderCache::Head(c, _, _) => c.bytes(),
            DecoderCache::TpHead(c, _) => c.bytes(),
        }
    }

    fn weight_grad_bytes(&self, w: &DecoderWeightGrad) -> usize {
        match w {
            DecoderWeightGrad::Embed { ids, dx } => 4 * (ids.len() + dx.len()),
            DecoderWeightGrad::Block(s) => s.bytes(),
            DecoderWeightGrad::Head(h) => h.bytes(),
            DecoderWeightGrad::Dense(g) => 4 * g.len(),
        }
    }

    /// Counts every tensor block once (its owner among the tp ranks holding it) and sums the
    /// ranks' f64 partials in tp rank order, so every rank gets the same bits.
    fn grad_sq_sum(
        &self,
        range: Range<usize>,
        sq: &dyn Fn(Range<usize>) -> f64,
    ) -> Result<f64, ParallelError> {
        let group = match (&self.ep, &self.tp) {
            (Some(g), _) => &g.parts,
            (None, Some(tp)) => tp.group(),
            (None, None) => {
                // Everything but the tied copy, in flat order.
                let mut at = range.start;
                let mut total = 0.0;
                for h in self.held.iter().filter(|h| h.tied_copy) {
                    let r = h.placement.start..h.placement.start + h.local_len;
                    let (s, e) = (r.start.max(range.start), r.end.min(range.end));
                    if s < e {
                        total += sq(at..s);
                        at = e;
                    }
                }
                return Ok(total + sq(at..range.end));
            }
        };
        let local: f64 = self
            .held
            .iter()
            .filter(|h| h.placement.owner)
            .map(|h| {
                let r = h.placement.range();
                let (s, e) = (r.start.max(range.start), r.end.min(range.end));
                if s < e {
                    sq(s..e)
                } else {
                    0.0
                }
            })
            .sum();
        let bits = [local.to_bits() as i64];
        let mut all = vec![0i64; group.size()];
        group.all_gather(&bits, &mut all)?;
        Ok(all.iter().map(|&b| f64::from_bits(b as u64)).sum())
    }

    fn prepares_reductions(&self) -> bool {
        self.ep.is_some()
    }

    /// Expert parallelism (module doc of [`crate::expert_parallel`]): the replicated tensors'
    /// gradients averaged over the ep ranks (one all-reduce of their parts of `range`), the
    /// experts' divided by ep.
    fn prepare_reduction(
        &self,
        range: Range<usize>,
        grads: &mut [f32],
    ) -> Result<(), ParallelError> {
        let Some(g) = &self.ep else {
            return Ok(());
        };
        let inv = 1.0 / g.ep.size() as f32;
        let mut dense = Vec::new();
        for h in &self.held {
            let r = h.placement.start..h.placement.start + h.local_len;
            let (s, e) = (r.start.max(range.start), r.end.min(range.end));
            if s >= e {
                continue;
            }
            let part = s - range.start..e - range.start;
            if h.experts {
                grads[part].iter_mut().for_each(|x| *x *= inv);
            } else {
                dense.push(part);
            }
        }
        if dense.is_empty() {
            return Ok(());
        }
        let mut buf: Vec<f32> = dense
            .iter()
            .flat_map(|r| grads[r.clone()].to_vec())
            .collect();
        g.ep.all_reduce(&mut buf, comm::ReduceOp::Sum)?;
        let mut at = 0;
        for r in dense {
            for (x, y) in grads[r.clone()].iter_mut().zip(&buf[at..at + r.len()]) {
                *x = y * inv;
            }
            at += r.len();
        }
        Ok(())
    }

    fn tied_ranges(&self) -> Vec<Range<usize>> {
        self.held
            .iter()
            .filter(|h| h.tied)
            .map(|h| h.placement.start..h.placement.start + h.local_len)
            .collect()
    }

    /// The copies on this rank summed in flat order (the embedding first), then over the
    /// tie group: two members, and `a + b = b + a` exactly, so both ranks get the same bits.
    fn sum_tied(&self, copies: &mut [&mut [f32]]) -> Result<(), ParallelError> {
        let (first, rest) = match copies.split_first_mut() {
            Some(x) => x,
            None => return Ok(()),
        };
        for c in rest.iter() {
            if c.len() != first.len() {
                return Err(ParallelError::Layout(format!(
                    "tied copies of {} and {} elements",
                    first.len(),
                    c.len()
                )));
            }
            tensor::threads::add_assign(first, c);
        }
        if let Some(g) = &self.tie_group {
            g.all_reduce(first, comm::ReduceOp::Sum)?;
        }
        for c in rest.iter_mut() {
            c.copy_from_slice(first);
        }
        Ok(())
    }

    fn communicates(&self) -> bool {
        self.tp.is_some() || self.cp.is_some() || self.ep.is_some()
    }

    fn act_to_wire(&self, act: LlmAct) -> Result<Buf, ParallelError> {
        if !self.cfg.is_moe() {
            return Ok(act.x); // a dense model's auxiliary loss is 0: the message is x alone
        }
        // x then the auxiliary loss so far (one more element).
        let n = act.x.len();
        let mut wire = tensor::ops::zeros_like(act.x.r(), n + 1).map_err(terr)?;
        wire.m()
            .slice_mut(0..n)
            .copy_from(act.x.r())
            .map_err(terr)?;
        wire.m()
            .slice_mut(n..n + 1)
            .copy_from_host(&[act.aux])
            .map_err(terr)?;
        Ok(wire)
    }

    fn wire_to_act(&self, wire: Buf) -> Result<LlmAct, ParallelError> {
        if !self.cfg.is_moe() {
            return Ok(LlmAct { x: wire, aux: 0.0 });
        }
        // The auxiliary loss is a host number: reading it from a GPU waits for the message
        // (a MoE block's forward reads its router's loss on the host anyway).
        let n = wire.len().checked_sub(1).ok_or_else(|| {
            ParallelError::Protocol("an empty MoE pipeline message (no auxiliary loss)".into())
        })?;
        let mut aux = [0.0f32];
        wire.r().slice(n..n + 1).read_into(&mut aux).map_err(terr)?;
        let x = match wire {
            Buf::Host(mut v) => {
                v.truncate(n);
                Buf::Host(v)
            }
            Buf::Cuda(_) => wire.r().slice(0..n).to_buf().map_err(terr)?,
        };
        Ok(LlmAct { x, aux: aux[0] })
    }

    fn wire_len(&self, batch: &Batch) -> usize {
        self.local_tokens(batch) * self.cfg.hidden_size + usize::from(self.cfg.is_moe())
    }
}

/// A tensor error as this crate's.
fn terr(e: tensor::TensorError) -> ParallelError {
    ParallelError::Model(e.to_string())
}

/// Mean loss over `n` valid targets (0 when none).
fn mean(sum: f64, n: usize) -> f32 {
    if n == 0 {
        0.0
    } else {
        (sum / n as f64) as f32
    }
}

/// The gradient scale of `scale ×` a mean over `n` valid targets.
fn grad_scale(scale: f32, n: usize) -> f32 {
    if n == 0 {
        0.0
    } else {
        scale / n as f32
    }
}
