//! Every layout of the decoders through the one path (`parallelize` → executor), against the
//! single process on the same global batch (split into the same micro-batches, as the MoE
//! auxiliary loss is a per-micro-batch quantity): Llama with GQA and a Mixtral-style MoE
//! (shared expert, auxiliary loss), dp ∈ {1, 2, 4} at every ZeRO stage with and without
//! accumulation, tp ∈ {2, 4} with and without sequence parallelism, and dp × tp at every ZeRO
//! stage. fp32: every loss and gradient norm of 5 AdamW steps and every parameter within 1e-5
//! relative. Also the first step's full gradients, the collectives a step issues, and
//! impossible layouts.
use comm::OpKind;
use model::{Model, ModelConfig};
use parallel::data_parallel::ZeroStage;
use parallel::tensor_parallel::TpPlan;
use parallel::{ParallelDims, ParallelError, Precision};

use crate::common::*;

const GLOBAL: usize = 8;
const STEPS: usize = 5;

fn dims(dp: usize, tp: usize, sp: bool, zero: usize) -> ParallelDims {
    ParallelDims {
        dp,
        tp,
        sp,
        zero: ZeroStage::from_index(zero).unwrap(),
        ..Default::default()
    }
}

/// Trains each of `layouts` ((dp, tp, sp, zero, accum)) and compares with the single process.
fn check(cfg: &ModelConfig, layouts: &[(usize, usize, bool, usize, usize)]) {
    check_batch(cfg, layouts, GLOBAL)
}

fn check_batch(cfg: &ModelConfig, layouts: &[(usize, usize, bool, usize, usize)], global: usize) {
    let model = Model::new(cfg.clone()).unwrap();
    for &(dp, tp, sp, zero, accum) in layouts {
        let exec = decoder_exec(ZeroStage::from_index(zero).unwrap(), Precision::Fp32);
        let reference = llm_reference(&model, exec.adamw, Some(1.0), global, STEPS, dp * accum);
        let runs = train_decoder(cfg, dims(dp, tp, sp, zero), &exec, global, accum, STEPS);
        let what = format!("dp={dp} tp={tp} sp={sp} zero={zero} accum={accum}");
        assert_matches_reference(&what, cfg, &runs, &reference, RankLosses::Bitwise);
    }
}

/// dp ∈ {1, 2, 4} × ZeRO 0-3 × accumulation {1, 2}; tp ∈ {2, 4} ± sp; dp 2 × tp 2 ± sp × ZeRO
/// 0-3 × accumulation {1, 2}.
fn every_layout() -> Vec<(usize, usize, bool, usize, usize)> {
    let mut v = Vec::new();
    for dp in [1, 2, 4] {
        for zero in 0..4 {
            for accum in [1, 2] {
                v.push((dp, 1, false, zero, accum));
            }
        }
    }
    for tp in [2, 4] {
        for sp in [false, true] {
            v.push((1, tp, sp, 0, 1));
        }
    }
    for sp in [false, true] {
        for zero in 0..4 {
            for accum in [1, 2] {
                v.push((2, 2, sp, zero, accum));
            }
        }
    }
    v
}

#[test]
fn llama_every_layout_matches_single_process() {
    check(&llama(), &every_layout());
}

#[test]
fn moe_every_layout_matches_single_process() {
    check(&moe(), &every_layout());
}

/// A vocabulary that does not divide: padded to ⌈V/tp⌉ rows per rank (66 over 4 ranks: 17
/// rows each, the last holding 15 real ones; 5 over 4: the last rank holds only padding),
/// padding outside the softmax. Global batches of 4 rows: with 8, token 32 of the 66-token
/// vocabulary appears once in step 2, its embedding gradient (1.4e-5, 2e-4 of the largest)
/// lands in AdamW's ill-conditioned regime |g| ≈ eps (see `decoder_exec`), and the f32
/// rounding of the sequence-parallel reductions (1e-7 absolute in that element, 1.4e-6 of the
/// largest gradient) moves its update by 0.4 %: 1.4e-5 of max|p| after 5 steps at tp = 4 + sp,
/// with every other element below 2.5e-6 (measured). The gradients themselves are checked in
/// `first_step_gradients_match`.
#[test]
fn padded_vocab_matches_single_process() {
    for v in [66, 5] {
        let cfg = ModelConfig::llama(v, 32, 48, 1, 4, 2);
        check_batch(
            &cfg,
            &[(1, 4, false, 0, 1), (1, 4, true, 0, 1), (2, 2, true, 3, 1)],
            4,
        );
    }
}

/// The gradients of one step, gathered to the full layout, equal the single-process ones to
/// f32 rounding (1e-6 of the largest gradient), for dp, every tp and sp, and dp × tp.
#[test]
fn first_step_gradients_match() {
    for cfg in [llama(), moe()] {
        let model = Model::new(cfg.clone()).unwrap();
        let exec = parallel::ExecConfig {
            max_grad_norm: None,
            ..decoder_exec(ZeroStage::Ddp, Precision::Fp32)
        };
        for (dp, tp, sp) in [
            (1, 1, false),
            (2, 1, false),
            (1, 2, false),
            (1, 2, true),
            (1, 4, false),
            (1, 4, true),
            (2, 2, true),
        ] {
            let reference = llm_reference(&model, exec.adamw, None, GLOBAL, 1, dp);
            let runs = train_decoder(&cfg, dims(dp, tp, sp, 0), &exec, GLOBAL, 1, 1);
            let what = format!("dp={dp} tp={tp} sp={sp}");
            assert_first_step_gradients(&what, &cfg, &runs, &reference);
        }
    }
}

/// Collectives of one training step on the tp group, against the analytic count for `L`
/// blocks (see docs/TENSOR_PARALLEL.md): without sp, 2 all-reduces per block forward and 2
/// backward, 1 for the embedding, 3 for the vocab-parallel head (max and sums forward, dX
/// backward), plus one per unit holding a tensor with a partial gradient (the router,
/// replicated KV heads, and under sp the norms); with sp, each block's all-reduces become
/// all-gather + reduce-scatter pairs, forward and backward. One all-gather for the clipping
/// norm's partial sums.
#[test]
fn communication_per_step_matches_analytic_count() {
    let (b, s, l) = (GLOBAL, 8usize, 2u64);
    for (cfg, tp, sp) in [
        (llama(), 2usize, false),
        (llama(), 4, false),
        (moe(), 2, false),
        (llama(), 2, true),
        (moe(), 4, true),
    ] {
        let h = cfg.hidden_size;
        let stats = comm::testing::run_threads(tp, |c| {
            use parallel::executor::Executor;
            let mesh = parallel::Mesh::new(&c, dims(1, tp, sp, 0)).unwrap();
            let opts = parallel::ModelOptions::new(s);
            let par = parallel::parallelize(&cfg, &mesh, &opts, None).unwrap();
            let init = par.stage.clone();
            let exec = decoder_exec(ZeroStage::Ddp, Precision::Fp32);
            let mut e = Executor::new(par.stage, par.dp, None, exec, |r, o| {
                init.init_range(3, r, o)
            })
            .unwrap();
            let group = e.model().tp.as_ref().unwrap().group().clone();
            group.reset_stats();
            e.train_step(&[rows(&cfg, 0, b)]).unwrap();
            group.stats()
        });
        let blocks_partial = cfg.is_moe() || cfg.kv_heads() < tp || sp;
        let partial = if blocks_partial { l } else { 0 } + u64::from(sp);
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
    // Through the passes, before any unit runs: the layout against the model and sequence.
    let err = |d: ParallelDims, cfg: &ModelConfig, seq: usize| {
        comm::testing::run_threads(d.world(), |c| {
            let mesh = parallel::Mesh::new(&c, d).unwrap();
            let opts = parallel::ModelOptions::new(seq);
            parallel::parallelize(cfg, &mesh, &opts, None)
                .err()
                .unwrap()
                .to_string()
        })
        .remove(0)
    };
    assert!(err(dims(1, 2, true, 0), &llama(), 5).contains("not divisible by tp = 2"));
    assert!(err(
        dims(1, 2, false, 0),
        &ModelConfig::llama(64, 32, 49, 2, 4, 2),
        8
    )
    .contains("ffn size 49"));
    let cp = ParallelDims {
        cp: 2,
        ..Default::default()
    };
    assert!(err(cp, &llama(), 6).contains("zigzag needs seq_len divisible by 2·cp"));
    let mut capped = moe();
    capped.capacity_factor = Some(1.25);
    assert!(err(cp, &capped, 8).contains("an expert capacity with context parallelism"));
    // A micro-batch whose sequence does not split over tp under sp is refused when it runs.
    let e = comm::testing::run_threads(2, |c| {
        use parallel::stage::StageModel;
        let mesh = parallel::Mesh::new(&c, dims(1, 2, true, 0)).unwrap();
        let opts = parallel::ModelOptions::new(8);
        let par = parallel::parallelize(&llama(), &mesh, &opts, None).unwrap();
        let p = vec![0.0; par.stage.units()[0].len()];
        let b = model::Batch::next_token(1, 5, &[1, 2, 3, 4, 5]).unwrap();
        par.stage
            .forward(0, (&p).into(), None, &b, 1.0)
            .err()
            .unwrap()
            .to_string()
    });
    assert!(e[0].contains("not divisible by tp = 2"), "{}", e[0]);
}
