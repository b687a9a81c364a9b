//! 2D parallelism: tp × dp = 2 × 2 on one `DeviceMesh` (`[dp, tp]`, tp fastest-varying), the
//! data-parallel engine (DDP, ZeRO-1/2/3) driving a tensor-parallel shard over the dp group,
//! with and without sequence parallelism, Llama and MoE. Against the single-process run on
//! the same global batch (split into the same micro-batches, as the MoE auxiliary loss is a
//! per-micro-batch quantity), with 1 or 2 accumulated micro-batches per rank: every loss of
//! 5 AdamW steps and every parameter within 1e-5.
use comm::testing::run_threads;
use comm::DeviceMesh;
use model::{AdamW, Batch, Model, ModelConfig};
use parallel::engine::{DataParallel, DpConfig};
use parallel::memory::ZeroStage;
use parallel::tensor_parallel::{StagedTp, TpModel};

mod common;
use common::rows;

const GLOBAL: usize = 8;
const STEPS: usize = 5;
const DP: usize = 2;
const TP: usize = 2;

fn dp_config(stage: ZeroStage) -> DpConfig {
    DpConfig {
        stage,
        bucket_bytes: 16 * 1024,
        // eps = 1e-5: see `adamw()` in tp_parity.rs (AdamW's first-step gain lr/eps on
        // gradient elements of order eps amplifies reordered-sum rounding).
        adamw: AdamW {
            lr: 1e-2,
            weight_decay: 0.1,
            eps: 1e-5,
            ..AdamW::default()
        },
        max_grad_norm: Some(1.0),
        ..DpConfig::default()
    }
}

/// Single process: each step's global batch as `n_micro` accumulated micro-batches.
fn reference(model: &Model, n_micro: usize) -> (Vec<f32>, Vec<f32>) {
    common::llm_reference(model, &dp_config(ZeroStage::Ddp), GLOBAL, STEPS, n_micro)
}

/// `accum` micro-batches per dp rank and step; rank `d` takes micro-batches `d·accum..`.
fn run(model: &Model, stage: ZeroStage, sp: bool, accum: usize) -> (Vec<f32>, Vec<f32>) {
    let out = run_threads(DP * TP, |c| {
        let mesh = DeviceMesh::new(&c, &[("dp", DP), ("tp", TP)]).unwrap();
        let (tp_group, dp_group) = (mesh.group(&["tp"]).unwrap(), mesh.group(&["dp"]).unwrap());
        let dp_rank = dp_group.rank();
        let tp = TpModel::new(&model.cfg, tp_group, sp).unwrap();
        let init = tp.shard_params(&model.init_params(3));
        let plan = tp.plan.clone();
        let mut e = DataParallel::new(StagedTp { tp }, dp_group, dp_config(stage), &init).unwrap();
        let micro = GLOBAL / (DP * accum);
        let losses: Vec<f32> = (0..STEPS)
            .map(|s| {
                let batches: Vec<Batch> = (0..accum)
                    .map(|a| {
                        rows(
                            &model.cfg,
                            s * GLOBAL + (dp_rank * accum + a) * micro,
                            micro,
                        )
                    })
                    .collect();
                e.train_step(&batches).unwrap().loss
            })
            .collect();
        (
            losses,
            e.full_params().unwrap(),
            plan,
            mesh.coord("dp").unwrap(),
        )
    });
    // The tp shards of dp replica 0, gathered to the full layout.
    let plan = out[0].2.clone();
    let shards: Vec<Vec<f32>> = out
        .iter()
        .filter(|o| o.3 == 0)
        .map(|o| o.1.clone())
        .collect();
    for o in &out {
        assert_eq!(o.0, out[0].0, "every rank reports the same losses");
    }
    (out[0].0.clone(), plan.gather(&shards).unwrap())
}

fn check(cfg: ModelConfig, sps: &[bool], accums: &[usize]) {
    let model = Model::new(cfg).unwrap();
    for &accum in accums {
        let (ref_losses, ref_params) = reference(&model, DP * accum);
        for &sp in sps {
            for k in [0, 1, 2, 3] {
                let stage = ZeroStage::from_index(k).unwrap();
                let (losses, params) = run(&model, stage, sp, accum);
                let what = format!("zero={k} sp={sp} accum={accum}");
                for (s, (a, b)) in losses.iter().zip(&ref_losses).enumerate() {
                    assert!(
                        (a - b).abs() / b.abs() < 1e-5,
                        "{what} step {s}: {a} vs {b}"
                    );
                }
                let scale = ref_params.iter().fold(0.0f32, |m, x| m.max(x.abs()));
                let err = params
                    .iter()
                    .zip(&ref_params)
                    .fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
                assert!(
                    err / scale < 1e-5,
                    "{what}: params differ by {:e}",
                    err / scale
                );
            }
        }
    }
}

#[test]
fn llama_tp2_dp2_matches_single_process() {
    check(
        ModelConfig::llama(64, 32, 48, 2, 4, 2),
        &[false, true],
        &[1, 2],
    );
}

#[test]
fn moe_tp2_dp2_matches_single_process() {
    let mut cfg = ModelConfig::llama(64, 32, 48, 2, 4, 2).with_experts(4, 2);
    cfg.output_router_logits = true;
    cfg.router_aux_loss_coef = 0.05;
    // Accumulation: per-unit partial-gradient syncs must not re-sum earlier micro-batches.
    check(cfg, &[false, true], &[1, 2]);
}
