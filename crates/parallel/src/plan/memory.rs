//! Per-rank memory of a layout: model states, activations and communication buffers.
//!
//! - **Model states** come from the engine's own arithmetic: the rank's parameters are the
//!   parts ([`crate::pipeline_parallel::split::stage_parts`]) of its pipeline stages in the
//!   tensor-parallel layout [`TpPlan::local_layout`] (experts divided by ep), and their bytes
//!   are [`crate::memory::formula`] over the group ZeRO shards across (dp × cp, or the
//!   expert-data-parallel dp·cp/ep, × DualPipe's two copies). The same functions build the
//!   executor's buffers, so the prediction equals its accounting exactly (tested).
//! - **Optimizer offload** ([`Offload::Optimizer`], ZeRO-Offload: Ren et al. 2021, arXiv
//!   2101.06840, §4.1) moves the fp32 master weights and AdamW moments of the rank's optimizer
//!   shard to host memory, with the shard's gradients beside them: the device keeps its 16-bit
//!   weights and gradients — `2Φ + 2Φ` at ZeRO-0/1, `2Φ + 2Φ/N` at ZeRO-2, `2Φ/N + 2Φ/N` at
//!   ZeRO-3 — and the host holds [`host_bytes_per_param`] bytes per element of the optimizer
//!   shard: `4 + 8 + 2 = 14` with this engine's conventions (the 16-bit gradients land in
//!   page-locked memory, `executor::offload`), `4 + 8 + 4 = 16` with Megatron's (DeepSpeed's
//!   ZeRO-1/2 optimizer keeps the partition's fp32 gradients on the host); per rank that is
//!   `⌈Φ/N⌉` elements at ZeRO-1/2/3 (partitioned over the ZeRO group as the optimizer states
//!   are), `Φ` at ZeRO-0 (every rank updates all of it). Only 16-bit training offloads (fp32
//!   weights are their own master copy). With the one-step delayed update
//!   ([`Offload::Delayed`]) a step's gradients are held while the next step's land: the
//!   gradients' bytes once more, `16` and `20`.
//! - **Activations**, with [`Conventions::Xtrain`], are the bytes of what each unit caches
//!   for its backward in this engine (fp32; per block: input, the two norms' outputs and
//!   rstd, q, k, v, the attention output and log-sum-exp, the residual, SwiGLU's gate, up and
//!   product; selective recomputation drops the norm outputs and the product, full keeps the
//!   input only; sequence parallelism divides the residual-region tensors by tp; on GPUs in
//!   bf16 / fp16 ([`Job::gpu`]) what only products read again — the norm outputs, the
//!   product, the linears' operands of pending weight gradients — in 2 bytes), summed over
//!   a rank's stages as its schedule holds them: the rank's compute actions are replayed,
//!   adding a stage's bytes at each forward and releasing them at its backward, and the peak
//!   kept. With [`Conventions::Megatron`], a layer holds `s·b·h·(10 + 24/t + 5·a·s/(h·t))`
//!   bytes, `34·s·b·h/t + 5·a·s²·b/t` with sequence parallelism, dropping the `s²` term
//!   under selective recomputation and keeping `2·s·b·h` (/t with sp) under full
//!   (Korthikanti et al. 2022, arXiv 2205.05198, Table 2).
//! - **Communication buffers** (an estimate, not the exact peak): ZeRO-1/2's gather of the
//!   updated weights (one unit), ZeRO-2/3's gradient buckets in flight (two buckets), ZeRO-3's
//!   two gathered units, and the 16-bit engine's widened unit.
use model::{ModelConfig, ParamLayout, Recompute};

use super::layout::{Layout, Offload};
use super::{Cluster, Conventions, Job};
use crate::data_parallel::bucket::DEFAULT_BUCKET_BYTES;
use crate::data_parallel::ZeroStage;
use crate::memory::{formula, MemoryAccount};
use crate::parallelize::head_grads_in_forward;
use crate::pipeline_parallel::split::{stage_parts, Part};
use crate::pipeline_parallel::{Action, Schedule};
use crate::tensor_parallel::plan::TpPlan;
use crate::ParallelError;

/// What one pipeline stage holds, per micro-batch where it is activations.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StageBytes {
    /// Parameters (elements).
    pub params: usize,
    /// The largest unit (elements).
    pub max_unit: usize,
    /// Activations cached from a forward to its backward, bytes.
    pub cache: usize,
    /// Weight-gradient work pending between a split backward's input and weight halves.
    pub pending: usize,
    /// Highest rise above the start of a split backward's input half (units release their
    /// cache and leave pending work one by one, last unit first).
    pub input_rise: usize,
    /// The largest working set one of the stage's units allocates beyond the caches while
    /// its backward runs, bytes.
    pub workspace: usize,
    /// Layers (blocks) of the stage.
    pub layers: usize,
    pub has_embedding: bool,
    pub has_head: bool,
    /// The head computes its gradients in its forward and holds them until its weight half
    /// ([`crate::parallelize::head_grads_in_forward`]; never under tensor parallelism);
    /// else its backward recomputes the logits.
    pub early_head: bool,
}

/// The local (tensor- and expert-parallel) parameter layout of `cfg` that one rank holds
/// parts of — the layout the engine's decoder stage is built on.
pub fn local_layout(cfg: &ModelConfig, l: &Layout) -> Result<ParamLayout, ParallelError> {
    Ok(TpPlan::with_experts(cfg, l.tp, l.sp, l.ep, 0)?.local_layout)
}

/// Tokens and local sizes one micro-batch runs through a block on one rank.
struct Local {
    /// Tokens of the micro-batch on this rank (its cp share).
    t: usize,
    /// Tokens in the residual region (t / tp under sequence parallelism).
    t_res: usize,
    h: usize,
    heads: usize,
    kv: usize,
    hd: usize,
    /// FFN width this rank computes per token (top-k experts and the shared expert for MoE).
    ffn: usize,
    /// Vocabulary × hidden: the LM-head weight gradient a head without tensor parallelism
    /// computes in its forward (the loss's gradient scale is known then) and keeps until its
    /// weight half runs, where the schedule has one micro-batch in flight at the head; 0
    /// where the head recomputes its logits in its backward instead.
    early_dw: usize,
    /// The head is tensor-parallel (its weight half has its finished gradient pending).
    tp_head: bool,
    /// A MoE block's routing: (experts, top-k, expert FFN width and shared-expert width on
    /// this rank, tokens come back over an all-to-all).
    moe: Option<(usize, usize, usize, usize, bool)>,
    /// Bytes of an element kept for products only (a linear's input or output gradient
    /// waiting for its weight gradient): 2 where products read 16-bit operands (GPUs in bf16
    /// / fp16), else 4.
    kept: usize,
    /// Bytes of an element of the rotated q, k and v that attention keeps for its backward: 2
    /// where attention runs on a GPU's tensor cores (bf16 or fp16, a head size of 16..=128 in
    /// steps of 16, this rank's kernel alone: `tensor::ops::attention_operand`), else 4 (a
    /// context-parallel ring keeps the values it sends).
    attn_kept: usize,
}

fn local(job: &Job, l: &Layout, early_head: bool) -> Local {
    let m = &job.model;
    let t = l.micro_batch * job.seq_len / l.cp;
    let kv = m.kv_heads();
    let ffn = if m.is_moe() {
        m.num_experts_per_tok * m.expert_ffn() + m.shared_expert_intermediate_size.unwrap_or(0)
    } else {
        m.intermediate_size
    };
    Local {
        t,
        t_res: if l.sp { t / l.tp } else { t },
        h: m.hidden_size,
        heads: m.num_attention_heads / l.tp,
        kv: if l.tp <= kv { kv / l.tp } else { 1 },
        hd: m.head_dim(),
        ffn: ffn / l.tp,
        tp_head: l.tp > 1,
        early_dw: if l.tp == 1 && early_head {
            m.vocab_size * m.hidden_size
        } else {
            0
        },
        moe: m.is_moe().then(|| {
            (
                m.num_local_experts,
                m.num_experts_per_tok,
                m.expert_ffn() / l.tp,
                m.shared_expert_intermediate_size.unwrap_or(0) / l.tp,
                l.ep > 1,
            )
        }),
        kept: if job.gpu && job.precision != crate::precision::Precision::Fp32 {
            2
        } else {
            4
        },
        attn_kept: if job.gpu
            && job.precision != crate::precision::Precision::Fp32
            && tensor::cuda::ops::tensor_core_head_dim(m.head_dim())
            && l.cp == 1
        {
            2
        } else {
            4
        },
    }
}

/// Bytes one unit caches for one micro-batch (this engine's caches; see the module doc).
fn xtrain_cache(part: Part, x: &Local, rc: Recompute) -> usize {
    // Elements kept as they are (fp32), those kept for products only (`x.kept` bytes), and
    // attention's q, k, v (`x.attn_kept` bytes).
    let (e, kept, qkv) = match part {
        Part::Embedding => return 4 * x.t, // the token ids (u32)
        // Input, normed input, rstd, log-sum-exp, i64 targets; without tp the early
        // gradients dxn and dW.
        Part::Head => {
            let early = if x.early_dw > 0 {
                x.t * x.h + x.early_dw
            } else {
                0
            };
            (
                x.t_res * x.h + x.t * x.h + x.t_res + x.t + 2 * x.t + early,
                0,
                0,
            )
        }
        Part::Block(_) => match rc {
            Recompute::Full => (x.t_res * x.h, 0, 0),
            _ => {
                let selective = rc == Recompute::Selective;
                // The two norm outputs (the attention's kept for its projections' weight
                // gradients; a dense FFN's likewise, a MoE's as values, which it routes).
                let (attn_in, ffn_in) = if selective {
                    (0, 0)
                } else {
                    (x.t * x.h, x.t * x.h)
                };
                // q, k, v (prepared for the attention kernels); the output o and its lse.
                let qkv = x.t * x.heads * x.hd + 2 * x.t * x.kv * x.hd;
                let attn = x.t * x.heads * x.hd + x.t * x.heads;
                // Gate and up as values; the product `silu(g)∘u`, unless recomputed, kept.
                let mlp =
                    |rows: usize, f: usize| (2 * rows * f, if selective { 0 } else { rows * f });
                let (ffn, ffn_kept) = match x.moe {
                    None => {
                        let (v, k) = mlp(x.t, x.ffn);
                        (v, k + ffn_in)
                    }
                    // Expected (balanced) load: T·k routed rows per rank, each keeping its
                    // input (kept for the expert's weight gradients), MLP cache and output
                    // (and, over ep, the output sent back); the routing tables
                    // (probabilities, weights, choices, counts, assignments; usize = 8
                    // bytes) are held twice, by the MoE cache and by the block.
                    Some((experts, k, fe, fs, exchange)) => {
                        let rows = x.t * k;
                        let routing = x.t * experts + x.t * k + 2 * (x.t * k + experts) + 4 * rows;
                        let ((ev, ek), (sv, sk)) = (mlp(rows, fe), mlp(x.t, fs));
                        (
                            ffn_in
                                + rows * x.h
                                + ev
                                + if exchange { rows * x.h } else { 0 }
                                + sv
                                + 2 * routing,
                            rows * x.h + ek + sk,
                        )
                    }
                };
                (
                    2 * x.t_res * x.h + 2 * x.t_res + attn + ffn,
                    attn_in + ffn_kept,
                    qkv,
                )
            }
        },
    };
    4 * e + x.kept * kept + x.attn_kept * qkv
}

/// Bytes a unit's pending weight-gradient work holds (split backward): each linear's input
/// and output gradient, each norm's input, output gradient and rstd; a head without tensor
/// parallelism its normed input and its gradient, input, rstd, log-sum-exp, targets and the
/// early `dW`; a tensor-parallel head its finished gradient (`params` elements).
fn xtrain_pending(part: Part, x: &Local, params: usize) -> usize {
    let e = match part {
        Part::Embedding => x.t + x.t_res * x.h,
        Part::Head if x.tp_head => params,
        Part::Head => 2 * x.t * x.h + x.t_res * x.h + x.t_res + x.t + 2 * x.t + x.early_dw,
        Part::Block(_) => {
            // The linears' operands, kept for their products (`x.kept` bytes each).
            let attn = 2 * x.t * x.h + 2 * x.t * x.heads * x.hd + 2 * x.t * x.kv * x.hd;
            let mlp = 2 * x.t * x.h + 3 * x.t * x.ffn;
            let norms = 2 * (2 * x.t_res * x.h + x.t_res);
            return 4 * norms + x.kept * (attn + mlp);
        }
    };
    4 * e
}

/// Bytes one unit's backward allocates beyond its cache while it runs, in this engine (an
/// estimate: the tensors alive when its input half ends). A block: the gradients at its
/// output, residual and input, at both norms' outputs, at q, k and v, at the FFN's gate and
/// up projections (a MoE block: per routed row, the expert's gate and up and the row's input
/// and output, plus the shared expert), and whatever recomputation rebuilds (the cache
/// without recomputation less the cache kept). The head: its input gradient and normed
/// input's; the embedding: its output gradient.
fn xtrain_workspace(part: Part, x: &Local, rc: Recompute) -> usize {
    match part {
        Part::Embedding => 4 * x.t_res * x.h,
        Part::Head => 4 * (x.t * x.h + x.t_res * x.h),
        Part::Block(_) => {
            let grads = 3 * x.t_res * x.h
                + 2 * x.t * x.h
                + x.t * x.heads * x.hd
                + 2 * x.t * x.kv * x.hd
                + match x.moe {
                    None => 2 * x.t * x.ffn,
                    Some((_, k, fe, fs, _)) => {
                        let rows = x.t * k;
                        2 * rows * fe + 2 * rows * x.h + 2 * x.t * fs
                    }
                };
            let recomputed = xtrain_cache(part, x, Recompute::None) - xtrain_cache(part, x, rc);
            4 * grads + recomputed
        }
    }
}

/// Megatron's bytes per layer and micro-batch (16-bit activations, see the module doc).
fn megatron_layer(job: &Job, l: &Layout, x: &Local) -> usize {
    let (sbh, t) = ((x.t * x.h) as f64, l.tp as f64);
    let a = job.model.num_attention_heads as f64;
    let s = (job.seq_len / l.cp) as f64;
    let b = l.micro_batch as f64;
    let bytes = match l.recompute {
        Recompute::Full => 2.0 * sbh / if l.sp { t } else { 1.0 },
        rc => {
            let linear = if l.sp { 34.0 / t } else { 10.0 + 24.0 / t };
            let scores = if rc == Recompute::None {
                5.0 * a * s * s * b / t
            } else {
                0.0
            };
            sbh * linear + scores
        }
    };
    bytes.round() as usize
}

/// What layer range `split` of `splits` holds on one rank; `early_head`: whether a head
/// computes its gradients in its forward (see [`StageBytes::early_head`]).
pub fn stage_bytes(
    job: &Job,
    l: &Layout,
    layout: &ParamLayout,
    splits: usize,
    split: usize,
    early_head: bool,
) -> Result<StageBytes, ParallelError> {
    let x = local(job, l, early_head);
    let mut s = StageBytes {
        early_head: x.early_dw > 0,
        ..StageBytes::default()
    };
    let mut level = 0isize;
    // Parts in reverse: the order a backward's input half runs them.
    for part in stage_parts(job.model.num_hidden_layers, splits, split)?
        .into_iter()
        .rev()
    {
        let n = match part {
            Part::Embedding => {
                s.has_embedding = true;
                layout.embed_range().len()
            }
            Part::Block(i) => {
                s.layers += 1;
                layout.block_range(i).len()
            }
            Part::Head => {
                s.has_head = true;
                layout.head_range().len()
            }
        };
        s.params += n;
        s.max_unit = s.max_unit.max(n);
        let (cache, pending, workspace) = match job.conventions {
            Conventions::Xtrain => (
                xtrain_cache(part, &x, l.recompute),
                xtrain_pending(part, &x, n),
                xtrain_workspace(part, &x, l.recompute),
            ),
            Conventions::Megatron => match part {
                Part::Block(_) => {
                    let c = megatron_layer(job, l, &x);
                    (c, xtrain_pending(part, &x, n) / 2, 0)
                }
                _ => (0, 0, 0),
            },
        };
        s.workspace = s.workspace.max(workspace);
        s.cache += cache;
        s.pending += pending;
        level += pending as isize - cache as isize;
        s.input_rise = s.input_rise.max(level.max(0) as usize);
    }
    Ok(s)
}

/// Activations in flight on one pipeline rank at the moments its peak can occur: after each
/// forward, and at the start of each split backward's input half (plus that stage's
/// [`StageBytes::input_rise`]). Each state counts, per local stage, the micro-batches whose
/// activations are held and whose weight-gradient work is pending; a schedule repeats few
/// distinct states, so evaluating a rank's peak for given stage sizes is cheap.
#[derive(Clone, Debug)]
struct RankStates {
    /// The rank's stages (indices of the counts below).
    stages: Vec<usize>,
    /// Distinct (held per stage, pending per stage, rising stage).
    states: Vec<(Vec<u32>, Vec<u32>, Option<usize>)>,
}

/// [`RankStates`] of every rank of a schedule, found by replaying its compute actions.
#[derive(Clone, Debug)]
pub struct Profile {
    ranks: Vec<RankStates>,
}

impl Profile {
    pub fn of(schedule: &Schedule) -> Self {
        let ranks = (0..schedule.num_ranks())
            .map(|r| {
                let stages = schedule.rank_stages(r);
                let idx = |s: usize| stages.iter().position(|&x| x == s).unwrap_or(0);
                let (mut held, mut pending) = (vec![0u32; stages.len()], vec![0u32; stages.len()]);
                let mut seen = std::collections::HashSet::new();
                for a in schedule.actions[r].iter().filter(|a| a.is_compute()) {
                    for part in a.parts() {
                        match part {
                            Action::Forward { stage, .. } => {
                                held[idx(stage)] += 1;
                                seen.insert((held.clone(), pending.clone(), None));
                            }
                            Action::Backward { stage, .. } => {
                                held[idx(stage)] = held[idx(stage)].saturating_sub(1)
                            }
                            Action::BackwardInput { stage, .. } => {
                                let k = idx(stage);
                                seen.insert((held.clone(), pending.clone(), Some(k)));
                                held[k] = held[k].saturating_sub(1);
                                pending[k] += 1;
                            }
                            Action::BackwardWeight { stage, .. } => {
                                let k = idx(stage);
                                pending[k] = pending[k].saturating_sub(1);
                            }
                            _ => {}
                        }
                    }
                }
                RankStates {
                    stages,
                    states: seen.into_iter().collect(),
                }
            })
            .collect();
        Profile { ranks }
    }

    /// Peak activation bytes of pipeline rank `rank` whose stages hold `stage(s)`.
    pub fn peak(&self, rank: usize, stage: impl Fn(usize) -> StageBytes) -> usize {
        let r = &self.ranks[rank];
        let bytes: Vec<StageBytes> = r.stages.iter().map(|&s| stage(s)).collect();
        r.states
            .iter()
            .map(|(held, pending, rising)| {
                let base: usize = bytes
                    .iter()
                    .zip(held.iter().zip(pending))
                    .map(|(b, (&h, &p))| h as usize * b.cache + p as usize * b.pending)
                    .sum();
                base + rising.map_or(0, |k| bytes[k].input_rise)
            })
            .max()
            .unwrap_or(0)
    }
}

/// One pipeline rank's predicted memory and what it holds.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct RankMemory {
    pub pp_rank: usize,
    /// Parameters of the rank's flat buffer (elements).
    pub params: usize,
    /// Ranks its model states are sharded over by ZeRO.
    pub zero_group: usize,
    /// Layers (blocks) the rank holds.
    pub layers: usize,
    /// What the engine accounts for (model states, communication buffers, activations).
    pub account: MemoryAccount,
    /// The backward's working set beyond the account ([`StageBytes::workspace`]).
    pub workspace: usize,
    /// The process around it: [`Cluster::process_bytes`] and the transport's buffers for the
    /// rank's groups ([`group_peers`] × [`Cluster::group_peer_bytes`]).
    pub process: usize,
    /// Host memory of the rank's offloaded optimizer shard (0 without offload).
    pub host: usize,
}

impl RankMemory {
    /// Predicted resident bytes: the account, the workspace and the process.
    pub fn resident(&self) -> usize {
        self.account.total() + self.workspace + self.process
    }
}

/// Peers over all the communication groups one rank of `l` joins (an estimate of the groups
/// the engine opens): the world; tensor parallelism's group; the dp × cp group gradients
/// are reduced over; context parallelism's group and its ring's gradient group; the
/// pipeline's group and its links (a two-rank group per direction for each stage boundary
/// the rank sits at: up to two per virtual stage); expert parallelism's dispatch group.
pub fn group_peers(l: &Layout) -> usize {
    if l.world() == 1 {
        return 0;
    }
    let boundaries = (l.pp - 1).min(2) * l.virtual_stages.max(1);
    (l.world() - 1)
        + (l.tp - 1)
        + (l.dp * l.cp - 1)
        + 2 * (l.cp - 1)
        + (l.pp - 1)
        + 2 * boundaries
        + (l.ep - 1)
}

/// The schedule of training without pipeline parallelism: one stage, `m` micro-batches.
pub fn one_stage_schedule(m: usize) -> Schedule {
    Schedule {
        kind: "one-stage".into(),
        stage_rank: vec![0],
        chains: vec![crate::pipeline_parallel::schedule::Chain {
            stages: 0..1,
            microbatches: 0..m,
        }],
        actions: vec![crate::pipeline_parallel::one_stage(m)],
    }
}

/// What each of the model's `splits` layer ranges holds on one rank running `sched` (see
/// [`stage_bytes`]).
pub fn split_bytes(
    job: &Job,
    l: &Layout,
    layout: &ParamLayout,
    sched: &Schedule,
) -> Result<Vec<StageBytes>, ParallelError> {
    let splits = sched.stage_splits().max(1);
    // The splits' bytes are shared by the ranks holding them: one rule for every head (the
    // ranks without one pass trivially; DualPipe's two heads see the same schedule shape).
    let early = (0..sched.num_ranks()).all(|r| head_grads_in_forward(sched, r));
    (0..splits)
        .map(|k| stage_bytes(job, l, layout, splits, k, early))
        .collect()
}

/// The memory of every pipeline rank of `l` running `sched` (the one-stage schedule without
/// pipeline parallelism), whose layer ranges hold `per_split` ([`split_bytes`]).
pub fn predict(
    job: &Job,
    l: &Layout,
    sched: &Schedule,
    profile: &Profile,
    per_split: &[StageBytes],
    cluster: &Cluster,
) -> Vec<RankMemory> {
    let process =
        cluster.process_bytes as usize + group_peers(l) * cluster.group_peer_bytes as usize;
    let stage = |s: usize| per_split[sched.stage_split(s)];
    let mut out = Vec::with_capacity(sched.num_ranks());
    for r in 0..sched.num_ranks() {
        let stages = sched.local_stages(r);
        let params: usize = stages.iter().map(|&s| stage(s).params).sum();
        let max_unit = stages.iter().map(|&s| stage(s).max_unit).max().unwrap_or(0);
        let layers = stages.iter().map(|&s| stage(s).layers).sum();
        let workspace = stages
            .iter()
            .map(|&s| stage(s).workspace)
            .max()
            .unwrap_or(0);
        let n = zero_group(l, sched, r);
        let (mut account, host) = model_states(job, l, params, n);
        account.activations = profile.peak(r, stage);
        account.comm_buffers = comm_buffers(job, l, params, max_unit, n);
        out.push(RankMemory {
            pp_rank: r,
            params,
            zero_group: n,
            layers,
            account,
            workspace,
            process,
            host,
        });
    }
    out
}

/// Bytes per element of a rank's optimizer shard that optimizer offload keeps in host memory:
/// fp32 master weights 4 + AdamW moments 8 + the gradients, 16-bit here and fp32 in
/// DeepSpeed (Megatron's conventions; see the module doc) — twice under the delayed update.
pub fn host_bytes_per_param(job: &Job, offload: Offload) -> usize {
    let grads = match job.conventions {
        Conventions::Megatron => 4,
        Conventions::Xtrain => job.precision.compute_bytes(),
    };
    match offload {
        Offload::None => 0,
        Offload::Optimizer => 4 + 8 + grads,
        Offload::Delayed => 4 + 8 + 2 * grads,
    }
}

/// Elements of the optimizer shard of a rank holding `params` over a ZeRO group of `n`:
/// the padded `⌈Φ/N⌉` where the stage shards the optimizer (ZeRO ≥ 1), else all `Φ`.
pub fn optimizer_shard(params: usize, n: usize, zero: ZeroStage) -> usize {
    if zero.shards_optimizer() {
        params.div_ceil(n.max(1))
    } else {
        params
    }
}

/// The model states of `params` elements over a ZeRO group of `n`: the device's account (the
/// engine's [`formula`]; with Megatron's conventions fp32 gradients; without the master
/// weights and moments under offload) and the host's bytes (see the module doc).
pub fn model_states(job: &Job, l: &Layout, params: usize, n: usize) -> (MemoryAccount, usize) {
    let mut account = formula(params, n, l.zero, job.precision);
    if job.conventions == Conventions::Megatron && job.precision.half().is_some() {
        // Megatron accumulates gradients in fp32 beside 16-bit weights.
        account.grads *= 2;
    }
    let host = if l.offload.on_host() {
        account.master = 0;
        account.optimizer = 0;
        host_bytes_per_param(job, l.offload) * optimizer_shard(params, n, l.zero)
    } else {
        0
    };
    (account, host)
}

/// The ranks pipeline rank `r`'s model states are sharded over: dp × cp (× DualPipe's two
/// copies), or with expert parallelism the expert-data-parallel dp·cp/ep.
pub fn zero_group(l: &Layout, sched: &Schedule, r: usize) -> usize {
    if l.ep > 1 {
        l.dp * l.cp / l.ep
    } else {
        l.dp * l.cp * sched.replicas(r).len()
    }
}

/// The estimate of the module doc.
fn comm_buffers(job: &Job, l: &Layout, params: usize, max_unit: usize, n: usize) -> usize {
    let unit = 4 * max_unit;
    // This engine widens each 16-bit unit to fp32 for its compute.
    let xtrain_half = job.conventions == Conventions::Xtrain && job.precision.half().is_some();
    let widened = if xtrain_half { unit } else { 0 };
    if n == 1 {
        return widened;
    }
    let buckets = (2 * DEFAULT_BUCKET_BYTES).min(4 * params);
    widened
        + match l.zero.index() {
            0 => 0,
            1 => unit,
            2 => unit + buckets,
            _ => 2 * unit + buckets,
        }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Precision;

    fn job(precision: Precision) -> Job {
        Job {
            model: model::ModelConfig::llama(256, 64, 128, 2, 4, 4),
            seq_len: 16,
            global_batch: 4,
            precision,
            gpu: false,
            conventions: Conventions::Xtrain,
            expert_imbalance: 1.0,
        }
    }

    /// On GPUs in 16 bits the operands kept only for products (the norm outputs, SwiGLU's
    /// product, every linear's input and output gradient waiting for its weight gradient)
    /// count 2 bytes, and attention's q, k, v too (the tensor-core kernels read their 16-bit
    /// copies; a context-parallel ring keeps the values); everything else, and everything on
    /// CPUs or in fp32, 4.
    #[test]
    fn gpu_products_keep_their_operands_in_16_bits() {
        let l: Layout = "dp1 mb2".parse().unwrap();
        let at = |precision: Precision, gpu: bool| {
            let x = local(
                &Job {
                    gpu,
                    ..job(precision)
                },
                &l,
                false,
            );
            let rc = [Recompute::None, Recompute::Selective, Recompute::Full];
            let cache = rc.map(|rc| xtrain_cache(Part::Block(0), &x, rc));
            let pending = xtrain_pending(Part::Block(0), &x, 0);
            (x, cache, pending)
        };
        let (cpu, cpu_cache, cpu_pending) = at(Precision::Bf16, false);
        assert_eq!(
            at(Precision::Fp32, true).1,
            cpu_cache,
            "fp32 on a GPU keeps fp32"
        );
        let (x, cache, pending) = at(Precision::Bf16, true);
        assert_eq!((cpu.kept, x.kept), (4, 2));
        assert_eq!((cpu.attn_kept, x.attn_kept), (4, 2));
        let (t, h, f) = (x.t, x.h, x.ffn);
        assert_eq!((t, h, f), (32, 64, 128), "mb2 × seq 16 tokens");
        // q, k, v: 4 heads and 4 KV heads of 16, i.e. 3 t h elements.
        let qkv = 3 * t * h;
        // No recomputation: the two norm outputs, the product and q, k, v, 2 bytes fewer each.
        assert_eq!(cpu_cache[0] - cache[0], 2 * (2 * t * h + t * f + qkv));
        // Selective recomputation drops the first three (q, k, v stay); full keeps the input
        // only.
        assert_eq!(cpu_cache[1] - cache[1], 2 * qkv);
        assert_eq!(cache[2], cpu_cache[2]);
        // fp16 keeps the same 16-bit copies.
        let (x16, cache16, _) = at(Precision::Fp16, true);
        assert_eq!((x16.kept, x16.attn_kept), (2, 2));
        assert_eq!(cache16, cache);
        // A context-parallel ring keeps the values it sends.
        let cp: Layout = "dp1 cp2 mb2".parse().unwrap();
        let ring = local(
            &Job {
                gpu: true,
                ..job(Precision::Bf16)
            },
            &cp,
            false,
        );
        assert_eq!((ring.kept, ring.attn_kept), (2, 4));
        // Pending: q, k, v, o's and gate, up, down's operands (heads × head_dim = hidden).
        let linears = (2 * t * h + 4 * t * h) + (2 * t * h + 3 * t * f);
        assert_eq!(cpu_pending - pending, 2 * linears);
    }

    #[test]
    fn offload_moves_master_moments_and_grads_to_the_host() {
        // Φ = 1001 does not divide by 2 or 4: shards are padded to ⌈Φ/N⌉ = 501, 251.
        let phi: usize = 1001;
        let job = job(Precision::Bf16);
        // Host bytes per shard element: master 4, moments 8, the 16-bit gradients 2; with
        // Megatron's conventions DeepSpeed's fp32 gradients, 4; the delayed update holds the
        // gradients twice.
        let megatron = Job {
            conventions: Conventions::Megatron,
            ..job.clone()
        };
        let per = |job: &Job| {
            [Offload::None, Offload::Optimizer, Offload::Delayed]
                .map(|o| host_bytes_per_param(job, o))
        };
        assert_eq!((per(&job), per(&megatron)), ([0, 14, 16], [0, 16, 20]));
        for n in [2, 4] {
            let s = phi.div_ceil(n);
            // By hand, per stage: (device weights, device grads, host bytes).
            let want = [
                (2 * phi, 2 * phi, 14 * phi),
                (2 * phi, 2 * phi, 14 * s),
                (2 * phi, 2 * s, 14 * s),
                (2 * s, 2 * s, 14 * s),
            ];
            for (k, &(params, grads, host)) in want.iter().enumerate() {
                let l = Layout {
                    dp: n,
                    zero: ZeroStage::from_index(k).unwrap(),
                    offload: Offload::Optimizer,
                    ..Layout::single(1)
                };
                let (dev, h) = model_states(&job, &l, phi, n);
                let got = (dev.params, dev.grads, dev.master, dev.optimizer, h);
                assert_eq!(got, (params, grads, 0, 0, host), "z{k} over {n}");
                // Delayed: the same device bytes, 2 more a shard element on the host.
                let delayed = Layout {
                    offload: Offload::Delayed,
                    ..l
                };
                let (d, h) = model_states(&job, &delayed, phi, n);
                assert_eq!((d, h), (dev, host / 14 * 16), "z{k} over {n}, delayed");
                // Without offload the same stage keeps 12 bytes per shard element on the
                // device and nothing on the host.
                let on_device = Layout {
                    offload: Offload::None,
                    ..l
                };
                let (dev, h) = model_states(&job, &on_device, phi, n);
                let shard = if k == 0 { phi } else { s };
                assert_eq!((dev.master + dev.optimizer, h), (12 * shard, 0), "z{k}");
            }
        }
    }
}
