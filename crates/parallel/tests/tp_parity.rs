//! Whole-model tensor-parallel parity: Llama with GQA (4 query / 2 KV heads, so tp = 4
//! replicates KV heads) and a Mixtral-style MoE (shared expert, auxiliary loss), tp ∈ {1, 2, 4},
//! with and without sequence parallelism, trained 5 AdamW steps (global-norm clipping on)
//! against the single-process run on the same batches: every loss and every parameter
//! (gathered back to the full layout) within 1e-5 relative, fp32. Also: the collective count
//! of a step equals the analytic count, a checkpoint saved at tp = 2 resumes at tp = 4 and 1,
//! and impossible layouts are clear errors.
use comm::testing::run_threads;
use comm::OpKind;
use model::optim::{clip_factor, grad_sq_sum, scale_grads};
use model::{AdamW, AdamWState, Batch, Model, ModelConfig, StepOptions};
use parallel::tensor_parallel::{TpModel, TpPlan};
use parallel::ParallelError;

const SEQ: usize = 8;
const BATCH: usize = 4;
const STEPS: usize = 5;
const MAX_NORM: f32 = 1.0;

fn adamw() -> AdamW {
    // eps = 1e-5: AdamW's first update lr·g/(|g| + eps) has sensitivity
    // d(update)/dg = lr·eps/(|g| + eps)², up to lr/eps at g → 0. TP splits every row-parallel
    // matmul into per-rank partial sums, so gradients move by ordinary f32 rounding (measured
    // ≤ 3e-7 of the gradient scale, asserted by `first_step_gradients_match`); an MoE
    // embedding row reached only through the auxiliary loss has |g| ≈ 9e-7 ± 3e-9, which
    // with eps = 1e-6 (gain ≈ 3e3) moved that parameter by 9e-6 of max|p|. With eps = 1e-5 the
    // gain is ≤ 1e3 and every configuration stays below 5e-6 (measured).
    AdamW {
        lr: 1e-2,
        weight_decay: 0.1,
        eps: 1e-5,
        ..AdamW::default()
    }
}

fn batch(cfg: &ModelConfig, step: usize) -> Batch {
    let ids: Vec<u32> = (step * BATCH * SEQ..(step + 1) * BATCH * SEQ)
        .map(|i| ((i as u64).wrapping_mul(0x9E3779B97F4A7C15) >> 40) as u32 % cfg.vocab_size as u32)
        .collect();
    Batch::next_token(BATCH, SEQ, &ids).unwrap()
}

fn reference(cfg: &ModelConfig) -> (Vec<f32>, Vec<f32>) {
    let model = Model::new(cfg.clone()).unwrap();
    let mut p = model.init_params(3);
    let mut state = AdamWState::new(p.len());
    let mut losses = Vec::new();
    for step in 0..STEPS {
        let mut g = vec![0.0; p.len()];
        let r = model
            .forward_backward(
                &p,
                &mut g,
                &batch(cfg, step),
                &StepOptions::default(),
                &mut |_| {},
            )
            .unwrap();
        losses.push(r.loss);
        let (_, coef) = clip_factor(grad_sq_sum(&g), MAX_NORM);
        scale_grads(&mut g, coef);
        adamw().step(&mut state, &mut p, &g, adamw().lr);
    }
    (losses, p)
}

/// Trains steps `steps` at `tp` from full-layout parameters / moments; returns the losses and
/// the gathered parameters and moments.
/// One rank's losses, parameters, optimizer state and plan.
type RankOut = (Vec<f32>, Vec<f32>, AdamWState, TpPlan);

fn train_tp(
    cfg: &ModelConfig,
    tp: usize,
    sp: bool,
    steps: std::ops::Range<usize>,
    start: &(Vec<f32>, AdamWState),
) -> (Vec<f32>, Vec<f32>, AdamWState) {
    let out = run_threads(tp, |c| {
        let m = TpModel::new(cfg, c.world().clone(), sp).unwrap();
        let mut p = m.shard_params(&start.0);
        let mut state = AdamWState {
            m: m.shard_params(&start.1.m),
            v: m.shard_params(&start.1.v),
            step: start.1.step,
        };
        let losses: Vec<f32> = steps
            .clone()
            .map(|s| {
                m.train_step(
                    &mut p,
                    &mut state,
                    &[batch(cfg, s)],
                    &adamw(),
                    Some(MAX_NORM),
                )
                .unwrap()
            })
            .collect();
        (losses, p, state, m.plan.clone())
    });
    let plan = out[0].3.clone();
    for o in &out {
        assert_eq!(o.0, out[0].0, "every tp rank reports the same loss");
    }
    let gather = |f: &dyn Fn(&RankOut) -> Vec<f32>| {
        plan.gather(&out.iter().map(f).collect::<Vec<_>>()).unwrap()
    };
    let p = gather(&|o| o.1.clone());
    let state = AdamWState {
        m: gather(&|o| o.2.m.clone()),
        v: gather(&|o| o.2.v.clone()),
        step: out[0].2.step,
    };
    (out[0].0.clone(), p, state)
}

fn fresh(cfg: &ModelConfig) -> (Vec<f32>, AdamWState) {
    let p = Model::new(cfg.clone()).unwrap().init_params(3);
    let n = p.len();
    (p, AdamWState::new(n))
}

fn assert_parity(what: &str, losses: &[f32], params: &[f32], reference: &(Vec<f32>, Vec<f32>)) {
    assert_eq!(losses.len(), reference.0.len());
    for (s, (a, b)) in losses.iter().zip(&reference.0).enumerate() {
        assert!(
            (a - b).abs() / b.abs() < 1e-5,
            "{what} step {s}: {a} vs {b}"
        );
    }
    let scale = reference.1.iter().fold(0.0f32, |m, x| m.max(x.abs()));
    let err = params
        .iter()
        .zip(&reference.1)
        .fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
    assert!(
        err / scale < 1e-5,
        "{what}: params differ by {:e}",
        err / scale
    );
}

fn llama() -> ModelConfig {
    ModelConfig::llama(64, 32, 48, 2, 4, 2)
}

fn moe() -> ModelConfig {
    let mut cfg = llama().with_experts(4, 2);
    cfg.output_router_logits = true;
    cfg.router_aux_loss_coef = 0.05;
    cfg.shared_expert_intermediate_size = Some(16);
    cfg
}

fn check(cfg: ModelConfig) {
    let reference = reference(&cfg);
    for tp in [1, 2, 4] {
        for sp in [false, true] {
            let (losses, p, _) = train_tp(&cfg, tp, sp, 0..STEPS, &fresh(&cfg));
            assert_parity(&format!("tp={tp} sp={sp}"), &losses, &p, &reference);
        }
    }
}

#[test]
fn llama_gqa_matches_single_process() {
    check(llama());
}

/// A vocabulary that does not divide: padded to ⌈V/tp⌉ rows per rank (66 over 4 ranks: 17
/// rows each, the last holding 15 real ones; 5 over 4: the last rank holds only padding),
/// padding outside the softmax.
#[test]
fn padded_vocab_matches_single_process() {
    check(ModelConfig::llama(66, 32, 48, 1, 4, 2));
    check(ModelConfig::llama(5, 32, 48, 1, 4, 2));
}

#[test]
fn moe_matches_single_process() {
    check(moe());
}

#[test]
fn checkpoint_at_tp2_resumes_at_other_tp_sizes() {
    // Save after 2 steps at tp = 2 (parameters and AdamW moments, gathered = resharded through
    // the full layout), resume the remaining steps at tp = 4 and at tp = 1.
    let cfg = llama();
    let reference = reference(&cfg);
    let (first, p, state) = train_tp(&cfg, 2, true, 0..2, &fresh(&cfg));
    for tp in [4, 1] {
        let (rest, p2, _) = train_tp(&cfg, tp, false, 2..STEPS, &(p.clone(), state.clone()));
        let losses: Vec<f32> = first.iter().chain(&rest).copied().collect();
        assert_parity(&format!("tp 2 -> {tp}"), &losses, &p2, &reference);
    }
    // The plan-level reshard of per-rank buffers agrees with gather + shard.
    let (p2, p4) = (
        TpPlan::new(&cfg, 2, false).unwrap(),
        TpPlan::new(&cfg, 4, false).unwrap(),
    );
    let at2: Vec<_> = (0..2).map(|r| p2.shard(&p, r)).collect();
    let at4 = p4.reshard_from(&p2, &at2).unwrap();
    for (r, l) in at4.iter().enumerate() {
        assert_eq!(l, &p4.shard(&p, r));
    }
}

/// Collectives of one training step on the tp group, against the analytic count for `L`
/// blocks (see docs/TENSOR_PARALLEL.md): without sp, 2 all-reduces per block forward and 2
/// backward, 1 for the embedding, 3 for the vocab-parallel head (max and sums forward, dX
/// backward), plus one for partial gradients when any; with sp, each block's all-reduces
/// become all-gather + reduce-scatter pairs, forward and backward.
#[test]
fn communication_per_step_matches_analytic_count() {
    let (b, s, l) = (BATCH, SEQ, 2u64);
    for (cfg, tp, sp) in [
        (llama(), 2usize, false),
        (llama(), 4, false),
        (moe(), 2, false),
        (llama(), 2, true),
        (moe(), 4, true),
    ] {
        let h = cfg.hidden_size;
        let stats = run_threads(tp, |c| {
            let m = TpModel::new(&cfg, c.world().clone(), sp).unwrap();
            let mut p = m.shard_params(&fresh(&cfg).0);
            let mut st = AdamWState::new(p.len());
            m.group().reset_stats();
            m.train_step(&mut p, &mut st, &[batch(&cfg, 0)], &adamw(), Some(1.0))
                .unwrap();
            m.group().stats()
        });
        let partial = u64::from(sp || cfg.is_moe() || cfg.kv_heads() < tp);
        let (ar, ag, rs) = if sp {
            (2 + partial, 4 * l + 3, 4 * l + 2)
        } else {
            (1 + 4 * l + 3 + partial, 1, 0)
        };
        // Ring all-gather / reduce-scatter: each rank sends (tp − 1) chunks of the local
        // [b·s/tp, h] activation; the clip's all-gather sends (tp − 1) f64 partials.
        let chunk = (b * s / tp * h * 4) as u64;
        let t = tp as u64 - 1;
        for (r, st) in stats.iter().enumerate() {
            let what = format!(
                "{} tp={tp} sp={sp} rank {r}",
                if cfg.is_moe() { "moe" } else { "llama" }
            );
            assert_eq!(st.ops(OpKind::AllReduce), ar, "{what}: all-reduces");
            assert_eq!(st.ops(OpKind::AllGather), ag, "{what}: all-gathers");
            assert_eq!(st.ops(OpKind::ReduceScatter), rs, "{what}: reduce-scatters");
            let ag_bytes = if sp { (ag - 1) * t * chunk } else { 0 } + t * 8;
            assert_eq!(
                st.bytes_sent(OpKind::AllGather),
                ag_bytes,
                "{what}: all-gather bytes"
            );
            assert_eq!(
                st.bytes_sent(OpKind::ReduceScatter),
                rs * t * chunk,
                "{what}: reduce-scatter bytes"
            );
        }
    }
}

#[test]
fn impossible_layouts_are_clear_errors() {
    let layout = |cfg: &ModelConfig, tp: usize| match TpPlan::new(cfg, tp, false) {
        Err(ParallelError::Layout(m)) => m,
        other => panic!("expected a layout error, got {other:?}"),
    };
    let mut c = llama();
    c.num_attention_heads = 6;
    c.num_key_value_heads = Some(6);
    c.head_dim = Some(8);
    assert!(layout(&c, 4).contains("num_attention_heads = 6"));
    let mut c = ModelConfig::llama(64, 32, 48, 1, 6, 3);
    c.head_dim = Some(8);
    assert!(layout(&c, 2).contains("num_key_value_heads = 3"));
    let mut c = ModelConfig::llama(64, 32, 48, 1, 6, 2);
    c.head_dim = Some(8);
    assert!(layout(&c, 3).contains("num_key_value_heads = 2 < tp = 3"));
    // More ranks than KV heads is fine when they replicate evenly.
    assert!(TpPlan::new(&ModelConfig::llama(64, 32, 48, 1, 8, 2), 8, false).is_ok());
    assert!(layout(&ModelConfig::llama(64, 32, 50, 1, 4, 2), 4).contains("intermediate_size = 50"));
    let mut c = moe();
    c.moe_intermediate_size = Some(10);
    assert!(layout(&c, 4).contains("expert ffn size = 10"));
    // Sequence parallel: the sequence must split over tp.
    let plan = TpPlan::new(&llama(), 4, true).unwrap();
    match plan.check_seq(6) {
        Err(ParallelError::Layout(m)) => assert!(m.contains("seq len 6"), "{m}"),
        other => panic!("expected a layout error, got {other:?}"),
    }
    let err = run_threads(2, |c| {
        let m = TpModel::new(&llama(), c.world().clone(), true).unwrap();
        let p = m.shard_params(&fresh(&llama()).0);
        let mut g = vec![0.0; p.len()];
        let b = Batch::next_token(1, 5, &[1, 2, 3, 4, 5]).unwrap();
        m.forward_backward(&p, &mut g, &b, &StepOptions::default())
            .unwrap_err()
            .to_string()
    });
    assert!(err[0].contains("not divisible by tp = 2"), "{}", err[0]);
}

/// The gradients of one step, gathered to the full layout, equal the single-process ones to
/// f32 rounding (1e-6 of the largest gradient), for every tp and sp.
#[test]
fn first_step_gradients_match() {
    for cfg in [llama(), moe()] {
        let model = Model::new(cfg.clone()).unwrap();
        let p = model.init_params(3);
        let mut g = vec![0.0; p.len()];
        model
            .forward_backward(
                &p,
                &mut g,
                &batch(&cfg, 0),
                &StepOptions::default(),
                &mut |_| {},
            )
            .unwrap();
        let scale = g.iter().fold(0.0f32, |m, x| m.max(x.abs()));
        for tp in [2, 4] {
            for sp in [false, true] {
                let out = run_threads(tp, |c| {
                    let m = TpModel::new(&cfg, c.world().clone(), sp).unwrap();
                    let q = m.shard_params(&p);
                    let mut gl = vec![0.0; q.len()];
                    m.forward_backward(&q, &mut gl, &batch(&cfg, 0), &StepOptions::default())
                        .unwrap();
                    m.finish_grads(&mut gl).unwrap();
                    (gl, m.plan.clone())
                });
                let plan = out[0].1.clone();
                let gt = plan
                    .gather(&out.into_iter().map(|o| o.0).collect::<Vec<_>>())
                    .unwrap();
                for e in &model.layout.entries {
                    let err = e
                        .view
                        .of(&gt)
                        .iter()
                        .zip(e.view.of(&g))
                        .fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
                    assert!(
                        err <= 1e-6 * scale,
                        "tp={tp} sp={sp} {}: {:e} of the gradient scale",
                        e.name,
                        err / scale
                    );
                }
            }
        }
    }
}
