//! ZeRO-Offload's delayed update (`executor::delayed`): past `delayed_update_after` AdamW steps,
//! step t's update runs beside step t+1's forward and backward, so step t+1's gradients are
//! taken at the weights before it. Checked against the single-process reference that applies
//! each update one optimizer point late ([`ReferenceRun::delayed_after`]): one rank in bf16 and
//! fp16 bit for bit (the reference rounds weights and gradients as 16-bit storage does, and no
//! clipping keeps the update's factor 1), and data parallelism at every ZeRO stage in fp32
//! within 1e-5, like every layout against one process.
use parallel::data_parallel::ZeroStage;
use parallel::{ExecConfig, ParallelDims, Precision};

use crate::common::*;

const GLOBAL: usize = 8;
const STEPS: usize = 6;
/// Two steps updated in place, then four delayed.
const AFTER: u64 = 2;

fn exec(zero: ZeroStage, precision: Precision, after: Option<u64>) -> ExecConfig {
    ExecConfig {
        offload_optimizer: true,
        delayed_update_after: after,
        ..decoder_exec(zero, precision)
    }
}

fn reference(precision: Precision, max_norm: Option<f32>, after: Option<u64>) -> Reference {
    let cfg = llama();
    let run = ReferenceRun {
        adamw: decoder_exec(ZeroStage::Ddp, precision).adamw,
        max_norm,
        global: GLOBAL,
        steps: STEPS,
        n_micro: 1,
        storage: precision.half(),
        delayed_after: after,
    };
    run.train(&model::Model::new(cfg).unwrap(), rows)
}

#[test]
fn a_delayed_16_bit_update_is_adamw_one_step_late_bit_for_bit() {
    let cfg = llama();
    for precision in [Precision::Bf16, Precision::Fp16] {
        let e = ExecConfig {
            max_grad_norm: None,
            // fp16: a scale of 1 keeps the gradients as the reference rounds them.
            loss_scale: 1.0,
            ..exec(ZeroStage::Ddp, precision, Some(AFTER))
        };
        let runs = train_decoder(&cfg, ParallelDims::default(), &e, GLOBAL, 1, STEPS);
        let want = reference(precision, None, Some(AFTER));
        let losses: Vec<f32> = runs[0].stats.iter().map(|s| s.loss).collect();
        let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&losses), bits(&want.losses), "{precision:?}: losses");
        // The master after the last optimizer point: the last step's update is still held.
        assert!(
            bits(&runs[0].params) == bits(&want.params),
            "{precision:?}: master weights differ"
        );
        // The delay is real: from the first step whose gradients are stale the losses leave
        // those of updates in place.
        let in_place = reference(precision, None, None);
        let first_stale = AFTER as usize + 1;
        assert_eq!(losses[..first_stale], in_place.losses[..first_stale]);
        assert_ne!(losses[first_stale], in_place.losses[first_stale]);
    }
}

#[test]
fn delayed_updates_on_every_zero_stage_match_one_process() {
    let cfg = llama();
    let want = reference(Precision::Fp32, Some(1.0), Some(AFTER));
    for (zero, accum) in [
        (ZeroStage::Ddp, 1),
        (ZeroStage::One, 2),
        (ZeroStage::Two, 1),
        (ZeroStage::Three, 2),
    ] {
        let e = exec(zero, Precision::Fp32, Some(AFTER));
        let runs = train_decoder(
            &cfg,
            ParallelDims::data_parallel(2, zero),
            &e,
            GLOBAL,
            accum,
            STEPS,
        );
        let what = format!("dp2 {zero:?} accum {accum}, delayed after {AFTER}");
        assert_matches_reference(&what, &cfg, &runs, &want, RankLosses::Bitwise);
    }
}
