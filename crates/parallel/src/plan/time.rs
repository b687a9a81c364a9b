//! Step time of a layout: compute from FLOPs at the cluster's efficiency, each collective
//! from an alpha-beta model on the link its group runs on, the pipeline bubble from the
//! schedule simulator, and overlap where the engine overlaps.
//!
//! **Compute.** Per micro-batch and block on one rank, the forward runs `2·P·T` FLOPs of
//! products (P: the block's weights this rank multiplies by — its tp share of attention and of
//! the MLP, the top-k experts of a MoE block) and `2·T·S·h/tp` of causal attention (half of
//! `4·T·S·h/tp`; T local tokens attending over S positions); the backward's input half runs
//! the products again and the attention core twice, its weight half the products once.
//! The head adds `2·T·h·V/tp` (once more in the input half where it recomputes its logits:
//! under tp, and where the schedule holds more than one micro-batch at it). Full
//! recomputation reruns the forward before the backward, selective recomputation the
//! attention core (Megatron's choice; this engine's selective policy only recomputes
//! element-wise work, which the model leaves out).
//!
//! **Collectives** of `B` bytes over `n` ranks on a link of latency α and bandwidth β (ring
//! algorithms, Thakur et al. 2005): all-reduce `2(n−1)·α + 2(n−1)/n·B/β`; all-gather and
//! reduce-scatter `(n−1)·α + (n−1)/n·B/β`; all-to-all `(n−1)·α + (n−1)/n·B/β`; a pipeline
//! send `α + B/β`. A group runs within a node when its ranks fit in one (the mesh
//! `[pp, dp, cp, tp]` puts tp neighbours on consecutive devices), else between nodes.
//!
//! - tp (+sp): two all-reduces (or all-gather + reduce-scatter pairs) of `T·h` activations
//!   per block forward and two backward, on the critical path;
//! - cp: the ring passes k, v (`cp − 1` steps forward; k, v and their gradients backward),
//!   hidden behind the attention core; what exceeds it is exposed;
//! - ep: dispatch and combine all-to-alls of `T·k·h` forward and backward, exposed; the
//!   routed experts' products and the all-to-alls at the busiest rank's load
//!   ([`super::Job::expert_imbalance`] times the mean), which every rank waits for;
//! - pp: each stage's output activation forward and its gradient backward, exposed;
//! - dp: gradients reduced in fp32 over the ZeRO group — DDP / ZeRO-1 one all-reduce per step
//!   behind the last micro-batch's backward, ZeRO-2 a reduce-scatter behind every
//!   micro-batch's backward, ZeRO-3 also all-gathering the parameters for each forward and
//!   backward (prefetched: behind compute); ZeRO-1/2 then all-gather the updated weights;
//! - the optimizer step streams its shard's master weights, moments, gradients and weights
//!   through memory once (`36` bytes per parameter at the cluster's memory bandwidth).
//!
//! **Optimizer offload** (ZeRO-Offload, Ren et al. 2021, arXiv 2101.06840, §4.1-4.2; the
//! host's figures in [`Cluster::host`]) replaces the device's step: for a rank's optimizer
//! shard of `S` elements ([`super::memory::optimizer_shard`]: `⌈Φ/N⌉` at ZeRO ≥ 1, `Φ` at
//! ZeRO-0) on the host link (α, β per device and direction),
//! - the CPU's AdamW, `S / (R / devices per node)` seconds (R: the node's rate, its devices'
//!   ranks updating their shards at once), exposed — or, with the one-step delayed update
//!   ([`Offload::Delayed`], `executor::delayed`), run beside the next step's device work `D`
//!   (its compute, bubble and exposed dp communication) and the gradients' exposed landing
//!   `G`: only `max(0, AdamW − D − G)` exposed;
//! - the gradients go device → host, `g·S` bytes (`g` = 2 for 16-bit gradients, 4 for
//!   Megatron's fp32 ones), and the updated 16-bit weights host → device, `2·S` (ZeRO-1/2
//!   all-gather them among the group afterwards, as without offload). With Megatron's
//!   conventions, DeepSpeed's overlap: the gradients bucket by bucket as the last
//!   micro-batch's backward finishes them, `max(0, α + g·S/β − backward)` exposed, then the
//!   weights, `α + 2·S/β`, exposed. With this engine's (`executor::offload`): the gradients
//!   land bucket by bucket behind the last backward as in DeepSpeed, `max(0, α + g·S/β −
//!   backward)` exposed, and the weights go up chunk by chunk (`C` = 4 Mi elements) while
//!   the CPU updates the next, `max(0, α + 2·S/β − AdamW)` plus the last chunk's upload
//!   (`α + 2·C/β`). Delayed, the update has finished before its weights go up from the
//!   buffer they were rounded into: at ZeRO-0 unit by unit, each unit's forward of the next
//!   step waiting for its own (`executor::delayed`), so `max(0, α + 2·S/β − F)` plus the
//!   largest unit's upload is exposed (F: one micro-batch's forward); at ZeRO-1/2 (whose
//!   all-gather follows) and ZeRO-3, and with Megatron's conventions, `α + 2·S/β`.
//!
//! **Pipeline.** The rank's schedule is simulated with unit costs (F = I = W = 1, B = 2); the
//! step's compute is the makespan in those units times the slowest stage's seconds per unit.
use serde::Serialize;

use super::cluster::{Cluster, Host, Link};
use super::layout::{Layout, Offload};
use super::memory::{optimizer_shard, StageBytes};
use super::{Conventions, Job};
use model::Recompute;

/// Seconds of one collective (see the module doc).
pub fn all_reduce(link: Link, n: usize, bytes: f64) -> f64 {
    if n <= 1 {
        return 0.0;
    }
    let n_f = n as f64;
    2.0 * (n_f - 1.0) * link.latency + 2.0 * (n_f - 1.0) / n_f * bytes / link.bandwidth
}

/// All-gather or reduce-scatter of `bytes` (the full buffer) over `n` ranks.
pub fn all_gather(link: Link, n: usize, bytes: f64) -> f64 {
    if n <= 1 {
        return 0.0;
    }
    let n_f = n as f64;
    (n_f - 1.0) * link.latency + (n_f - 1.0) / n_f * bytes / link.bandwidth
}

/// Seconds of one optimizer step per layout and what they are made of.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct StepTime {
    /// The whole step.
    pub step_s: f64,
    /// Compute of the busiest rank (no bubble), with tp, ep and pp communication on its
    /// critical path included below.
    pub compute_s: f64,
    /// Idle time of the pipeline (makespan − busy).
    pub bubble_s: f64,
    pub tp_comm_s: f64,
    pub cp_exposed_s: f64,
    pub ep_comm_s: f64,
    pub pp_comm_s: f64,
    /// Data-parallel communication not hidden behind backward.
    pub dp_exposed_s: f64,
    /// The optimizer step: on the device, or on the host's CPUs under offload.
    pub optimizer_s: f64,
    /// Optimizer offload's host ↔ device copies not hidden behind the backward.
    pub offload_exposed_s: f64,
    /// Predicted tokens per second of the whole job.
    pub tokens_per_s: f64,
}

/// Per-micro-batch seconds of one stage: forward, input and weight halves, and what of
/// them is communication.
#[derive(Clone, Copy, Debug, Default)]
struct StageCost {
    f: f64,
    i: f64,
    w: f64,
    tp: f64,
    cp: f64,
    ep: f64,
    pp: f64,
    /// ZeRO-3's parameter gathers and ZeRO-2/3's reduce-scatter per micro-batch.
    dp_per_mb: f64,
}

fn stage_cost(job: &Job, c: &Cluster, l: &Layout, st: &StageBytes, dp_group: usize) -> StageCost {
    let m = &job.model;
    let t = (l.micro_batch * job.seq_len / l.cp) as f64;
    let s = job.seq_len as f64;
    let h = m.hidden_size as f64;
    let tp = l.tp as f64;
    let (heads, hd) = ((m.num_attention_heads / l.tp) as f64, m.head_dim() as f64);
    let kv = (if l.tp <= m.kv_heads() {
        m.kv_heads() / l.tp
    } else {
        1
    }) as f64;
    // The busiest expert-parallel rank's routed rows set the pace (the all-to-alls wait for
    // it): the routed experts' width per token times the imbalance.
    let load = if l.ep > 1 { job.expert_imbalance } else { 1.0 };
    let routed = (m.num_experts_per_tok * m.expert_ffn()) as f64 / tp * load;
    let ffn = if m.is_moe() {
        routed + m.shared_expert_intermediate_size.unwrap_or(0) as f64 / tp
    } else {
        m.intermediate_size as f64 / tp
    };
    let peak = if job.precision.half().is_some() {
        c.peak_flops_16
    } else {
        c.peak_flops_32
    } * c.efficiency;
    let act_bytes = match job.conventions {
        Conventions::Xtrain => 4.0,
        Conventions::Megatron => 2.0,
    };
    let layers = st.layers as f64;
    let block_weights = 2.0 * h * heads * hd + 2.0 * h * kv * hd + 3.0 * h * ffn;
    let linear = layers * 2.0 * block_weights * t
        + if st.has_head {
            2.0 * t * h * (m.vocab_size as f64 / tp).ceil()
        } else {
            0.0
        };
    let core = layers * 2.0 * t * s * heads * hd;
    let recompute = match l.recompute {
        Recompute::None => 0.0,
        Recompute::Selective => core,
        Recompute::Full => linear + core,
    };
    // A head that did not compute its gradients in its forward recomputes the logits.
    let relogits = if st.has_head && !st.early_head {
        2.0 * t * h * (m.vocab_size as f64 / tp).ceil()
    } else {
        0.0
    };
    let (f_c, i_c, w_c) = (
        (linear + core) / peak,
        (linear + 2.0 * core + recompute + relogits) / peak,
        linear / peak,
    );
    // Tensor parallel: 2 all-reduces (or AG + RS) of T·h per block and direction.
    let tp_link = c.link(l.tp, 1);
    let tp_one = all_reduce(tp_link, l.tp, t * h * act_bytes);
    let tp_f = layers * 2.0 * tp_one + if st.has_embedding { tp_one } else { 0.0 };
    let tp_b = layers * 2.0 * tp_one + if st.has_head { tp_one } else { 0.0 };
    // Context parallel: the ring's k, v (and gradients), hidden behind the attention core.
    let cp_link = c.link(l.cp, l.tp);
    let kv_bytes = 2.0 * t * kv * hd * act_bytes;
    let ring = (l.cp.saturating_sub(1)) as f64 * cp_link.time(kv_bytes);
    let core_f = core / layers.max(1.0) / peak;
    let cp_f = layers * (ring - core_f).max(0.0);
    let cp_b = layers * (2.0 * ring - 2.0 * core_f).max(0.0);
    // Expert parallel: dispatch + combine of T·k·h per MoE block and direction.
    let ep_link = c.link(l.ep, l.tp);
    let a2a = if m.is_moe() {
        2.0 * all_gather(
            ep_link,
            l.ep,
            t * m.num_experts_per_tok as f64 * load * h * act_bytes,
        )
    } else {
        0.0
    };
    let ep_f = layers * a2a;
    // Pipeline: the stage's output forward, its input gradient backward.
    let pp_link = c.link(l.pp, l.tp * l.cp * l.dp);
    let pp_one = if l.pp > 1 {
        pp_link.time(t / if l.sp { tp } else { 1.0 } * h * act_bytes)
    } else {
        0.0
    };
    // ZeRO-2/3 per micro-batch: reduce-scatter the fp32 gradients; ZeRO-3 also gathers the
    // parameters for the forward and again for the backward.
    let dp_link = c.link(dp_group, l.tp);
    let params = st.params as f64;
    let compute_bytes = job.precision.compute_bytes() as f64;
    let dp_per_mb = match l.zero.index() {
        0 | 1 => 0.0,
        2 => all_gather(dp_link, dp_group, 4.0 * params),
        _ => {
            all_gather(dp_link, dp_group, 4.0 * params)
                + 2.0 * all_gather(dp_link, dp_group, compute_bytes * params)
        }
    };
    StageCost {
        f: f_c + tp_f + cp_f + ep_f + pp_one,
        i: i_c + tp_b + cp_b + ep_f + pp_one,
        w: w_c,
        tp: tp_f + tp_b,
        cp: cp_f + cp_b,
        ep: 2.0 * ep_f,
        pp: 2.0 * pp_one,
        dp_per_mb,
    }
}

/// The step time of `l` whose pipeline ranks hold `stages[r]` (per-split bytes of the
/// stages each rank runs), whose schedule's unit-cost makespan is `makespan_units`, with ZeRO
/// group `dp_group` and rank parameters `params[r]`.
pub fn predict(
    job: &Job,
    c: &Cluster,
    l: &Layout,
    stages: &[Vec<StageBytes>],
    params: &[usize],
    dp_group: usize,
    makespan_units: f64,
) -> StepTime {
    let mut worst = StepTime::default();
    let mut unit_max = 0.0f64;
    let costs: Vec<Vec<StageCost>> = stages
        .iter()
        .map(|r| {
            r.iter()
                .map(|s| stage_cost(job, c, l, s, dp_group))
                .collect()
        })
        .collect();
    for r in &costs {
        for s in r {
            unit_max = unit_max.max((s.f + s.i + s.w) / 3.0);
        }
    }
    let makespan = makespan_units * unit_max;
    let mb = l.microbatches as f64;
    for (r, cost) in costs.iter().enumerate() {
        let sum = |f: &dyn Fn(&StageCost) -> f64| cost.iter().map(f).sum::<f64>() * mb;
        let busy = sum(&|s| s.f + s.i + s.w);
        let rank_params = params[r] as f64;
        let dp_link = c.link(dp_group, l.tp);
        let grads = 4.0 * rank_params;
        let weights = job.precision.compute_bytes() as f64 * rank_params;
        // What the last micro-batch's backward hides, and what every micro-batch's hides.
        let last_backward: f64 = cost.iter().map(|s| s.i + s.w).sum();
        let per_mb_hidden: f64 = cost.iter().map(|s| s.f + s.i + s.w).sum();
        let per_mb: f64 = cost.iter().map(|s| s.dp_per_mb).sum();
        let dp_exposed = match l.zero.index() {
            0 => (all_reduce(dp_link, dp_group, grads) - last_backward).max(0.0),
            1 => {
                (all_reduce(dp_link, dp_group, grads) - last_backward).max(0.0)
                    + all_gather(dp_link, dp_group, weights)
            }
            2 => mb * (per_mb - per_mb_hidden).max(0.0) + all_gather(dp_link, dp_group, weights),
            _ => mb * (per_mb - per_mb_hidden).max(0.0),
        };
        let shard = optimizer_shard(params[r], dp_group, l.zero) as f64;
        let (optimizer, offload_exposed) = match (l.offload, &c.host) {
            (Offload::None, _) | (_, None) => (36.0 * shard / c.memory_bandwidth, 0.0),
            (o, Some(host)) => {
                let device = Overlap {
                    backward: last_backward,
                    step: makespan + dp_exposed,
                    forward: cost.iter().map(|s| s.f).sum(),
                    unit: stages[r].iter().map(|s| s.max_unit).max().unwrap_or(0) as f64,
                };
                offload(job, host, c.devices_per_node, shard, (o, l.zero), device)
            }
        };
        let step = makespan + dp_exposed + optimizer + offload_exposed;
        if step > worst.step_s {
            worst = StepTime {
                step_s: step,
                compute_s: busy,
                bubble_s: (makespan - busy).max(0.0),
                tp_comm_s: sum(&|s| s.tp),
                cp_exposed_s: sum(&|s| s.cp),
                ep_comm_s: sum(&|s| s.ep),
                pp_comm_s: sum(&|s| s.pp),
                dp_exposed_s: dp_exposed,
                optimizer_s: optimizer,
                offload_exposed_s: offload_exposed,
                tokens_per_s: 0.0,
            };
        }
    }
    worst.tokens_per_s = (l.global_batch() * job.seq_len) as f64 / worst.step_s;
    worst
}

/// What of a step the offload's work can hide behind ([`offload`]).
#[derive(Clone, Copy, Debug)]
pub struct Overlap {
    /// The last micro-batch's backward, seconds (the gradients' copy).
    pub backward: f64,
    /// The device's work before the optimizer point (compute, bubble, exposed dp
    /// communication), seconds (a delayed update's AdamW).
    pub step: f64,
    /// One micro-batch's forward, seconds (a delayed update's weights, unit by unit).
    pub forward: f64,
    /// The rank's largest unit, elements.
    pub unit: f64,
}

/// Optimizer offload's seconds for a shard of `shard` elements, updated in place or delayed
/// (`mode`) at ZeRO stage `zero`, behind the step's work `o`: (the CPU's AdamW exposed, the
/// copies exposed); see the module doc.
pub fn offload(
    job: &Job,
    host: &Host,
    devices_per_node: usize,
    shard: f64,
    (mode, zero): (Offload, crate::data_parallel::ZeroStage),
    o: Overlap,
) -> (f64, f64) {
    let grad_bytes = match job.conventions {
        Conventions::Megatron => 4.0,
        Conventions::Xtrain => job.precision.compute_bytes() as f64,
    };
    let weight_bytes = job.precision.compute_bytes() as f64;
    let to_host = host.link.time(grad_bytes * shard);
    let to_device = host.link.time(weight_bytes * shard);
    let adam = shard * devices_per_node as f64 / host.adam_params_per_s;
    let grads_exposed = (to_host - o.backward).max(0.0);
    if mode == Offload::Delayed {
        // AdamW beside the next step; its weights go up once it is done: at ZeRO-0 (this
        // engine) unit by unit behind the next forward, else in one copy.
        let weights = match (job.conventions, zero) {
            (Conventions::Xtrain, crate::data_parallel::ZeroStage::Ddp) => {
                (to_device - o.forward).max(0.0) + host.link.time(weight_bytes * o.unit)
            }
            _ => to_device,
        };
        return (
            (adam - o.step - grads_exposed).max(0.0),
            grads_exposed + weights,
        );
    }
    // The gradients' copy behind the last backward; then the weights'.
    let weights_exposed = match job.conventions {
        // DeepSpeed: after AdamW.
        Conventions::Megatron => to_device,
        // This engine (`executor::offload`): chunk by chunk while the CPU updates the next
        // chunk; the last chunk's upload follows the update.
        Conventions::Xtrain => {
            let chunk = (crate::precision::DEVICE_CHUNK as f64).min(shard);
            (to_device - adam).max(0.0) + host.link.time(weight_bytes * chunk)
        }
    };
    let exposed = grads_exposed + weights_exposed;
    (adam, exposed)
}
