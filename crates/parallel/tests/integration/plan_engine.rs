//! The planner against the engine: for the layouts the parity tests run, the predicted
//! per-rank model states and activation peaks equal the executor's accounting exactly. The
//! one estimate is a MoE block's routed rows where the router decides them (top-k < E): the
//! planner assumes the balanced load, checked within a bound.
use model::Recompute;
use parallel::data_parallel::ZeroStage;
use parallel::pipeline_parallel::generate;
use parallel::plan::{evaluate, Cluster, Conventions, Job, Layout};
use parallel::{ModelOptions, Precision};

use crate::common::*;

const GLOBAL: usize = 8;

fn check(cfg: &model::ModelConfig, l: Layout, precision: Precision, exact_activations: bool) {
    let job = Job {
        model: cfg.clone(),
        seq_len: 8,
        global_batch: GLOBAL,
        precision,
        gpu: false,
        conventions: Conventions::Xtrain,
        expert_imbalance: 1.0,
    };
    let cluster = Cluster::preset("a100-80g", 1).unwrap();
    let pred = evaluate(&job, &cluster, &l).unwrap();
    let schedule = l
        .schedule
        .map(|k| generate(k, l.pp, l.microbatches, l.virtual_stages).unwrap());
    let opts = ModelOptions {
        recompute: l.recompute,
        ..ModelOptions::new(8)
    };
    let exec = decoder_exec(l.zero, precision);
    let runs = train_decoder_opts(
        cfg,
        l.dims(),
        &exec,
        GLOBAL,
        l.microbatches,
        1,
        schedule.as_ref(),
        opts,
    );
    let per_pp = l.world() / l.pp;
    for (rank, run) in runs.iter().enumerate() {
        let want = pred.ranks[rank / per_pp].account;
        let got = run.memory;
        assert_eq!(
            (got.params, got.grads, got.master, got.optimizer),
            (want.params, want.grads, want.master, want.optimizer),
            "{l} {precision:?} rank {rank}: model states"
        );
        if exact_activations {
            assert_eq!(
                got.activations, want.activations,
                "{l} {precision:?} rank {rank}: activations"
            );
        } else {
            let ratio = want.activations as f64 / got.activations as f64;
            assert!(
                (0.75..1.25).contains(&ratio),
                "{l} {precision:?} rank {rank}: activations {} predicted {}",
                got.activations,
                want.activations
            );
        }
    }
}

fn layout(text: &str) -> Layout {
    text.parse().unwrap()
}

#[test]
fn data_and_tensor_parallel_layouts_match_the_engine() {
    let cfg = llama();
    for text in [
        "dp1 mb8x1",
        "dp1 mb4x2 rc=selective",
        "dp1 mb8x1 rc=full",
        "dp2 z0 mb4x1",
        "dp2 z1 mb2x2",
        "dp2 z2 mb4x1",
        "dp2 z3 mb4x1",
        "tp2 mb8x1",
        "tp2 sp mb8x1",
        "tp2 dp2 z1 sp mb2x2",
    ] {
        check(&cfg, layout(text), Precision::Fp32, true);
    }
    for text in ["dp2 z1 mb4x1", "dp2 z3 mb4x1"] {
        check(&cfg, layout(text), Precision::Bf16, true);
    }
}

#[test]
fn pipeline_and_context_layouts_match_the_engine() {
    let cfg4 = model::ModelConfig::llama(64, 32, 48, 4, 4, 2);
    for text in [
        "pp2 1f1b mb2x4",
        "pp2 gpipe mb2x4",
        "pp2 interleaved/2 mb2x4",
        "pp2 dp2 z1 1f1b mb1x4",
        "pp2 1f1b mb2x4 rc=selective",
        "cp2 mb8x1",
        "cp2 dp2 z2 mb4x1",
    ] {
        check(&cfg4, layout(text), Precision::Fp32, true);
    }
    // Split backwards: the weight-gradient work pending between the two halves, with and
    // without a tensor-parallel head.
    for text in [
        "pp2 zb-h1 mb2x4",
        "pp2 zb-v mb2x4",
        "tp2 pp2 sp zb-h1 mb2x4",
    ] {
        check(&cfg4, layout(text), Precision::Fp32, true);
    }
}

#[test]
fn expert_parallel_layouts_match_the_engine_where_the_load_is_fixed() {
    // Every token chooses every expert (top-k = E): each ep rank receives exactly T·k rows,
    // the balanced load the planner assumes, so its activations are exact too.
    let mut cfg = moe();
    cfg.num_experts_per_tok = cfg.num_local_experts;
    for text in [
        "dp2 ep2 z1 mb4x1",
        "dp2 ep2 z3 mb2x2",
        "pp2 dp2 ep2 z1 1f1b mb1x4",
    ] {
        check(&cfg, layout(text), Precision::Fp32, true);
    }
}

#[test]
fn expert_parallel_model_states_match_the_engine() {
    // Top-2 of 4: the rows a rank receives depend on the routing, so its activations are
    // within a bound of the balanced expectation; the model states are exact.
    let l = layout("dp2 ep2 z1 mb4x1");
    assert_eq!(l.recompute, Recompute::None);
    assert_eq!(l.zero, ZeroStage::One);
    check(&moe(), l, Precision::Fp32, false);
}

#[test]
fn resident_memory_decides_the_fit_and_imbalance_slows_only_expert_parallelism() {
    let job = |imbalance: f64| Job {
        model: moe(),
        seq_len: 8,
        global_batch: GLOBAL,
        precision: Precision::Fp32,
        gpu: false,
        conventions: Conventions::Xtrain,
        expert_imbalance: imbalance,
    };
    let mut cluster = Cluster::preset("a100-80g", 1).unwrap();
    cluster.process_bytes = 5 << 20;
    cluster.group_peer_bytes = 2 << 20;
    let ep = layout("dp2 ep2 z1 mb4x1");
    let p = evaluate(&job(1.0), &cluster, &ep).unwrap();
    let r = &p.ranks[0];
    // dp2 × ep2: the world, the dp × cp group and the ep group, one peer each.
    assert_eq!(r.process, (5 << 20) + 3 * (2 << 20));
    assert!(r.workspace > 0);
    assert_eq!(r.resident(), r.account.total() + r.workspace + r.process);
    assert_eq!(p.resident, r.resident());
    // A device between the account and the resident bytes does not fit.
    cluster.memory_bytes = (r.account.total() + r.workspace) as u64;
    assert!(!evaluate(&job(1.0), &cluster, &ep).unwrap().fits);
    cluster.memory_bytes = r.resident() as u64;
    assert!(evaluate(&job(1.0), &cluster, &ep).unwrap().fits);
    // The busiest expert rank sets the pace with expert parallelism, not without.
    let slow = evaluate(&job(1.5), &cluster, &ep).unwrap();
    assert!(slow.time.compute_s > p.time.compute_s, "{:?}", slow.time);
    assert!(slow.time.ep_comm_s > p.time.ep_comm_s, "{:?}", slow.time);
    assert_eq!(
        slow.peak, p.peak,
        "memory is predicted at the balanced load"
    );
    let dp = layout("dp2 z1 mb4x1");
    assert_eq!(
        evaluate(&job(1.5), &cluster, &dp).unwrap().time,
        evaluate(&job(1.0), &cluster, &dp).unwrap().time
    );
}
