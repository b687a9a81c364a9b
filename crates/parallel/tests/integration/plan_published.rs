//! The planner against published numbers (written in): the ZeRO paper's 7B model states,
//! GPT-3 175B on 64 A100s as Korthikanti et al. (arXiv 2205.05198) and Calculon report it,
//! where a 70B model lands on 64 A100s, and a model that fits nowhere.
use parallel::data_parallel::ZeroStage;
use parallel::memory::formula;
use parallel::plan::{
    evaluate, plan, shapes, Cluster, Conventions, Job, Layout, Offload, SearchSpace,
};
use parallel::Precision;

const GIB: f64 = (1u64 << 30) as f64;

fn within(got: f64, want: f64, tol: f64, what: &str) {
    assert!(
        (got - want).abs() <= tol * want,
        "{what}: {got:.3} vs published {want:.3} (tolerance {:.0}%)",
        tol * 100.0
    );
}

#[test]
fn zero_paper_7b_model_states() {
    // Φ = 7e9 (the ZeRO paper's 7.5B example uses the same arithmetic), N = 8.
    let phi = 7_000_000_000usize;
    let gb = |b: usize| b as f64 / 1e9;
    let states = |n, s, p| gb(formula(phi, n, s, p).model_states());
    // fp32 AdamW: 4 + 4 + 8 bytes per parameter.
    assert_eq!(states(1, ZeroStage::Ddp, Precision::Fp32), 112.0);
    assert_eq!(states(8, ZeroStage::One, Precision::Fp32), 56.0 + 7.0); // 8Φ + 8Φ/N
    assert_eq!(states(8, ZeroStage::Three, Precision::Fp32), 14.0); // 16Φ/N
                                                                    // Mixed precision, K = 12: ZeRO-1 2Φ + 2Φ + 12Φ/N, ZeRO-3 16Φ/N.
    assert_eq!(states(1, ZeroStage::Ddp, Precision::Bf16), 112.0);
    assert_eq!(states(8, ZeroStage::One, Precision::Bf16), 28.0 + 10.5);
    assert_eq!(states(8, ZeroStage::Three, Precision::Bf16), 14.0);
    // The planner's per-rank states for a 7B shape are the same formula over its Φ.
    let cfg = shapes::named("llama2-7b").unwrap();
    let n = shapes::num_params(&cfg);
    let job = Job {
        model: cfg,
        seq_len: 4096,
        global_batch: 8,
        precision: Precision::Bf16,
        gpu: false,
        conventions: Conventions::Xtrain,
        expert_imbalance: 1.0,
    };
    let cluster = Cluster::preset("a100-80g", 1).unwrap();
    for (text, stage) in [
        ("dp8 z1 mb1x1", ZeroStage::One),
        ("dp8 z3 mb1x1", ZeroStage::Three),
    ] {
        let p = evaluate(&job, &cluster, &text.parse().unwrap()).unwrap();
        assert_eq!(
            p.peak.model_states(),
            formula(n, 8, stage, Precision::Bf16).model_states()
        );
    }
}

fn gpt3() -> (Job, Cluster) {
    let job = Job {
        model: shapes::named("gpt3-175b").unwrap(),
        seq_len: 2048,
        global_batch: 64,
        precision: Precision::Bf16,
        gpu: false,
        conventions: Conventions::Megatron,
        expert_imbalance: 1.0,
    };
    (job, Cluster::preset("a100-80g", 8).unwrap())
}

#[test]
fn gpt3_175b_on_64_a100s_matches_korthikanti_and_calculon() {
    let (job, cluster) = gpt3();
    // TP8 · PP8 · DP1, micro-batch 1, global batch 64, interleaving 3, sp + selective.
    let l: Layout = "tp8 pp8 dp1 sp interleaved/3 mb1x64 rc=selective"
        .parse()
        .unwrap();
    let p = evaluate(&job, &cluster, &l).unwrap();
    // Parameters + optimizer of a stage of 12 layers (no embedding): 45.56 GiB.
    let middle = &p.ranks[1];
    assert_eq!(middle.layers, 12);
    within(
        middle.account.model_states() as f64 / GIB,
        45.56,
        0.05,
        "parameters + optimizer",
    );
    // Activations of the first stage: 12.35 GiB (34·s·b·h/t per layer, the interleaved
    // schedule's in-flight micro-batches).
    within(
        p.ranks[0].account.activations as f64 / GIB,
        12.35,
        0.05,
        "activations",
    );
    // Step time 13.75 s.
    within(p.time.step_s, 13.75, 0.20, "step time");
    // Without recomputation (and without sp): 34·s·b·h + 5·a·s²·b per layer → 66.84 GiB.
    let none: Layout = "tp8 pp8 dp1 interleaved/3 mb1x64 rc=none".parse().unwrap();
    let p = evaluate(&job, &cluster, &none).unwrap();
    within(
        p.ranks[0].account.activations as f64 / GIB,
        66.84,
        0.05,
        "activations, no recompute",
    );
}

#[test]
fn llama_70b_on_64_a100s_ranks_tp8_pp2_dp4_in_the_top_three() {
    let job = Job {
        model: shapes::named("llama3-70b").unwrap(),
        seq_len: 4096,
        global_batch: 512,
        precision: Precision::Bf16,
        gpu: false,
        conventions: Conventions::Megatron,
        expert_imbalance: 1.0,
    };
    let cluster = Cluster::preset("a100-80g", 8).unwrap();
    // Megatron-LM's options: distributed optimizer (ZeRO-1), no context parallelism, no
    // optimizer offload.
    let space = SearchSpace {
        zero: vec![ZeroStage::Ddp, ZeroStage::One],
        cp: Some(1),
        offload: vec![Offload::None],
        ..SearchSpace::default()
    };
    let p = plan(&job, &cluster, &space).unwrap();
    assert!(p.shortfall.is_none());
    let mesh = |l: &Layout| (l.tp, l.pp, l.dp);
    let top3: Vec<_> = p.feasible.iter().take(3).map(|x| mesh(&x.layout)).collect();
    assert!(top3.contains(&(8, 2, 4)), "top three: {top3:?}");
    // Tensor parallelism across nodes (tp16 spans two nodes of 8) ranks below within a node.
    let best = |f: &dyn Fn(&Layout) -> bool| {
        p.feasible
            .iter()
            .position(|x| f(&x.layout))
            .expect("such a layout fits")
    };
    assert!(best(&|l| l.tp > 8) > best(&|l| l.tp == 8));
    for x in p.feasible.iter().filter(|x| x.layout.tp == 16) {
        let within_node = Layout {
            tp: 8,
            dp: x.layout.dp * 2,
            microbatches: x.layout.microbatches / 2,
            ..x.layout
        };
        if let Ok(y) = evaluate(&job, &cluster, &within_node) {
            assert!(
                y.time.tokens_per_s > x.time.tokens_per_s,
                "{} vs {}",
                y.layout,
                x.layout
            );
        }
    }
}

#[test]
fn a_model_that_fits_nowhere_gets_the_smallest_shortfall_and_a_remedy() {
    // Llama 3 405B on one node of 8 A100-80G: with Megatron's fp32 gradients the model
    // states alone are 18Φ/8 ≈ 913 GB per device.
    let job = Job {
        model: shapes::named("llama3-405b").unwrap(),
        seq_len: 4096,
        global_batch: 16,
        precision: Precision::Bf16,
        gpu: false,
        conventions: Conventions::Megatron,
        expert_imbalance: 1.0,
    };
    let cluster = Cluster::preset("a100-80g", 1).unwrap();
    let p = plan(&job, &cluster, &SearchSpace::default()).unwrap();
    assert!(p.feasible.is_empty());
    let s = p.shortfall.expect("a shortfall");
    // The closest layout shards everything 8 ways: 18Φ/8 ≈ 850 GiB, plus activations.
    let need = s.closest.peak.total() as f64 / GIB;
    assert!((850.0..870.0).contains(&need), "{need:.1} GiB");
    assert_eq!(
        s.short_bytes,
        s.closest.peak.total() as u64 - cluster.memory_bytes
    );
    assert!(
        s.suggestions.iter().any(|t| t.contains("devices")),
        "{:?}",
        s.suggestions
    );
}
