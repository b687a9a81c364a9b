//! `parallelize`: from the model's configuration and the mesh to what one rank runs. The passes
//! apply in Megatron's order, each in its own folder, and a pass of size 1 is the identity:
//!
//! 1. tensor parallelism (+ sequence parallelism): [`crate::tensor_parallel::shard_model`];
//! 2. context parallelism (cp): each rank takes its share of every sequence and its blocks'
//!    attention becomes ring attention over the cp group ([`crate::context_parallel`]);
//! 3. expert parallelism (ep): each rank holds E/ep experts of every MoE layer and exchanges
//!    tokens with the ep group ([`crate::expert_parallel`]);
//! 4. the pipeline split: the schedule says which stages this rank runs and which layers each
//!    holds ([`crate::pipeline_parallel::split`]), and the pipeline's links are connected;
//! 5. data parallelism / ZeRO over dp × cp: the executor's configuration
//!    ([`crate::executor::ExecConfig`]) and the group returned here — widened over the pp
//!    ranks that hold the same layers where a schedule replicates them (DualPipe's two
//!    copies of the model, whose gradients are averaged like data-parallel ones).
use std::sync::Arc;

use comm::ProcessGroup;
use model::layers::Recompute;
use model::ModelConfig;

use crate::context_parallel::ring::ContextAttention;
use crate::context_parallel::{CpBalance, CpComm, CpGroup, CpLayout};
use crate::decoder::DecoderStage;
use crate::dims::Mesh;
use crate::executor::Pipeline;
use crate::pipeline_parallel::split::stage_parts;
use crate::pipeline_parallel::Schedule;
use crate::ParallelError;

/// Model-side options of the passes.
#[derive(Clone, Copy, Debug)]
pub struct ModelOptions {
    /// Training sequence length (checked against cp and sp).
    pub seq_len: usize,
    /// Activation recomputation of every block.
    pub recompute: Recompute,
    /// How context parallelism splits the sequences and moves keys and values.
    pub cp_balance: CpBalance,
    pub cp_comm: CpComm,
}

impl ModelOptions {
    /// Sequences of `seq_len` tokens, no recomputation, zigzag ring attention.
    pub fn new(seq_len: usize) -> Self {
        ModelOptions {
            seq_len,
            recompute: Recompute::None,
            cp_balance: CpBalance::default(),
            cp_comm: CpComm::default(),
        }
    }
}

/// What one rank runs: its part of the model and the groups the executor drives it over.
pub struct Parallelized {
    pub stage: DecoderStage,
    /// The group dense gradients are averaged over (dp × cp, × the replicas of DualPipe).
    pub dp: ProcessGroup,
    /// The pipeline (pp > 1).
    pub pipe: Option<Pipeline>,
}

fn not_yet(what: &str) -> ParallelError {
    ParallelError::Unsupported(format!(
        "{what} is not implemented yet: this build runs pp × dp (ZeRO 0-3) × cp × ep × tp (+sp)"
    ))
}

/// Whether pipeline rank `pp_rank`'s head (if it holds one) computes its gradients in its
/// forward: where each of its loss stages has one micro-batch in flight at a time (no
/// pipeline; 1F1B's and the zero-bubble schedules' last stage when they run its weight half
/// at once). Elsewhere (GPipe, interleaved) the early `V·h` weight gradient would be held
/// for every micro-batch in flight — 2 GiB each in fp32 for a 128 K vocabulary at h = 4096 —
/// so the backward recomputes the logits instead (one more head product).
pub fn head_grads_in_forward(schedule: &Schedule, pp_rank: usize) -> bool {
    schedule
        .rank_stages(pp_rank)
        .into_iter()
        .filter(|&s| schedule.next_stage(s).is_none())
        .all(|s| schedule.max_in_flight(s) <= 1)
}

/// Tied embeddings under pipeline parallelism: the pp ranks `[embedding, head]` whose copies
/// are summed over a group of their own (Megatron's embedding group), when this rank is one of
/// them; `None` where every rank holding one also holds the other (V-shaped schedules put
/// the first and last stage on one rank, DualPipe's two chains give each end rank both), so
/// the copies are summed on the rank.
fn tie_pair(
    cfg: &ModelConfig,
    schedule: &Schedule,
    splits: usize,
    pp_rank: usize,
) -> Result<Option<[usize; 2]>, ParallelError> {
    use crate::pipeline_parallel::split::Part;
    let mut embed_only = Vec::new();
    let mut head_only = Vec::new();
    for r in 0..schedule.num_ranks() {
        let mut holds = (false, false);
        for s in schedule.local_stages(r) {
            for p in stage_parts(cfg.num_hidden_layers, splits, schedule.stage_split(s))? {
                holds.0 |= p == Part::Embedding;
                holds.1 |= p == Part::Head;
            }
        }
        match holds {
            (true, false) => embed_only.push(r),
            (false, true) => head_only.push(r),
            _ => {}
        }
    }
    match (embed_only.as_slice(), head_only.as_slice()) {
        ([], []) => Ok(None),
        ([e], [h]) => Ok([*e, *h].contains(&pp_rank).then_some([*e, *h])),
        _ => Err(not_yet(&format!(
            "tied embeddings with the {} schedule's placement (embedding alone on pp ranks {embed_only:?}, head alone on {head_only:?})",
            schedule.kind
        ))),
    }
}

/// Applies the passes of the module doc to `cfg` for this rank of `mesh`; with pipeline
/// parallelism, `schedule` (for the whole pp group) places the stages.
pub fn parallelize(
    cfg: &ModelConfig,
    mesh: &Mesh,
    opts: &ModelOptions,
    schedule: Option<&Schedule>,
) -> Result<Parallelized, ParallelError> {
    let dims = *mesh.dims();
    cfg.validate()
        .map_err(|e| ParallelError::Config(e.to_string()))?;
    dims.validate_model(cfg, opts.seq_len)?;
    // This rank's place among the expert-parallel ranks (pass 3); the tp pass already holds
    // just its experts.
    let ep_rank = if dims.ep > 1 { mesh.ep()?.rank() } else { 0 };
    // 1. Tensor (and sequence) parallelism.
    let tp = if dims.tp > 1 {
        Some(crate::tensor_parallel::shard_model_with_experts(
            cfg,
            mesh.tp()?,
            dims.sp,
            dims.ep,
            ep_rank,
        )?)
    } else {
        None
    };
    // 2. Context parallelism: this rank's share of every sequence, and the ring.
    let cp = if dims.cp > 1 {
        let layout = CpLayout {
            cp: dims.cp,
            rank: mesh.coord("cp")?,
            balance: opts.cp_balance,
        };
        layout.check(opts.seq_len)?;
        if cfg.is_moe() && cfg.capacity_factor.is_some() {
            return Err(not_yet(
                "an expert capacity with context parallelism (capacity and drops are per sequence; use dropless experts)",
            ));
        }
        let kv = mesh.cp()?;
        let dkv = mesh.comm().new_named_group("cp-dkv", kv.world_ranks())?;
        let attention = ContextAttention::new(layout, opts.cp_comm, kv.clone(), dkv)?;
        Some((layout, attention, CpGroup(kv)))
    } else {
        None
    };
    // 3. Expert parallelism: E/ep experts per rank, tokens exchanged over the ep group.
    let ep = if dims.ep > 1 {
        if schedule.is_some_and(|s| s.has_replicas()) {
            return Err(not_yet(
                "expert parallelism with DualPipe's two copies of the model",
            ));
        }
        Some((mesh.ep()?, mesh.expert_parts()?))
    } else {
        None
    };
    // 4. The pipeline split: this rank's stages, their parts, and which rank runs each stage.
    let pp_rank = mesh.coord("pp")?;
    let one_stage = Schedule {
        kind: "one-stage".into(),
        stage_rank: vec![0],
        chains: vec![crate::pipeline_parallel::schedule::Chain {
            stages: 0..1,
            microbatches: 0..1,
        }],
        actions: vec![Vec::new()],
    };
    let schedule = match (dims.pp, schedule) {
        (1, _) => &one_stage,
        (_, Some(s)) => s,
        (pp, None) => {
            return Err(ParallelError::Config(format!(
                "pp = {pp} needs a pipeline schedule"
            )))
        }
    };
    if schedule.num_ranks() != dims.pp {
        return Err(ParallelError::Config(format!(
            "the schedule is for {} pipeline ranks, the mesh has pp = {}",
            schedule.num_ranks(),
            dims.pp
        )));
    }
    let splits = schedule.stage_splits();
    if splits > cfg.num_hidden_layers {
        return Err(ParallelError::Config(format!(
            "the {} schedule cuts the model into {splits} stages but it has num_hidden_layers = {}: every stage needs a layer",
            schedule.kind, cfg.num_hidden_layers
        )));
    }
    let mut parts = Vec::new();
    let mut local = Vec::new();
    for s in schedule.local_stages(pp_rank) {
        let p = stage_parts(cfg.num_hidden_layers, splits, schedule.stage_split(s))?;
        local.push((s, parts.len()..parts.len() + p.len()));
        parts.extend(p);
    }
    let replicas = schedule.replicas(pp_rank);
    let pipe = if dims.pp > 1 {
        let s = schedule;
        let mut pipe = Pipeline::connect(
            mesh.comm(),
            mesh.pp()?,
            s.stage_rank.clone(),
            local,
            |stage| s.next_stage(stage).is_some(),
        )?;
        pipe.replicas = replicas.len();
        pipe.first_chain_end = s.chains.first().map_or(0, |c| c.stages.end);
        Some(pipe)
    } else {
        None
    };
    let tie = if cfg.tie_word_embeddings && dims.pp > 1 {
        tie_pair(cfg, schedule, splits, pp_rank)?
    } else {
        None
    };
    let mut stage = DecoderStage::new(cfg, tp, parts, opts.recompute, (dims.ep, ep_rank))?
        .with_early_head_grads(head_grads_in_forward(schedule, pp_rank));
    if let Some(pair) = tie {
        let pp = mesh.pp()?;
        let world = pair.map(|r| pp.world_ranks()[r]);
        stage = stage.with_tie_group(mesh.comm().new_named_group("tied-embedding", &world)?);
    }
    if let Some((layout, attention, seqs)) = cp {
        stage = stage.with_context(layout, Arc::new(attention), Arc::new(seqs));
    }
    // 5. Data parallelism over dp × cp (and the pp ranks holding the same layers: DualPipe);
    //    with expert parallelism over the ranks holding the same experts (dp·cp/ep), the
    //    replicated tensors' average over ep being the stage's (crate::expert_parallel).
    let dp = match ep {
        Some((ep, parts)) => {
            stage = stage.with_experts(ep, parts);
            mesh.edp()?
        }
        None => mesh.dp_cp_with_replicas(&replicas)?,
    };
    Ok(Parallelized { stage, dp, pipe })
}
