//! Memory accounting follows the ZeRO formulas exactly for the model states, ZeRO-3 keeps at
//! most two gathered units beside its shard, and bucket reductions overlap backward.
use crate::common::*;
use parallel::data_parallel::sampler::DistributedSampler;
use parallel::data_parallel::ZeroStage;
use parallel::executor::{Executor, TraceKind};
use parallel::memory::{formula, MemoryAccount};
use parallel::stage::StageModel;
use parallel::testing::ToyModel;
use parallel::Precision;

/// Runs two steps on `dp` ranks and returns each rank's engine-side figures.
fn run(
    model: &ToyModel,
    stage: ZeroStage,
    dp: usize,
) -> Vec<(MemoryAccount, usize, Vec<TraceKind>)> {
    run_in(model, stage, dp, Precision::Fp32)
}

fn run_in(
    model: &ToyModel,
    stage: ZeroStage,
    dp: usize,
    precision: Precision,
) -> Vec<(MemoryAccount, usize, Vec<TraceKind>)> {
    let cfg = parallel::executor::ExecConfig {
        precision,
        ..config(stage)
    };
    let sampler = DistributedSampler::new(dp, 2, 1).unwrap();
    comm::testing::run_threads(dp, |c| {
        let group = c.world().clone();
        let rank = group.rank();
        let mut e =
            Executor::from_params(model.clone(), group, cfg.clone(), &model.init(7)).unwrap();
        e.enable_trace();
        for step in 0..2 {
            let r = sampler.samples(step, rank, 0);
            e.train_step(&[model.samples(r.start, r.len())]).unwrap();
        }
        let trace = e
            .take_trace()
            .into_iter()
            .map(|t| t.kind)
            .filter(|k| !matches!(k, TraceKind::Action { .. }))
            .collect();
        (e.memory(), e.peak_gathered_bytes(), trace)
    })
}

#[test]
fn accounted_bytes_equal_the_formula() {
    let model = toy();
    let phi = model.num_params();
    let max_unit = model.units().iter().map(|u| u.len()).max().unwrap();
    for k in 0..4 {
        let stage = ZeroStage::from_index(k).unwrap();
        for dp in [1, 2, 4] {
            let want = formula(phi, dp, stage, Precision::Fp32);
            for (rank, (mem, gathered, _)) in run(&model, stage, dp).into_iter().enumerate() {
                assert_eq!(
                    (mem.params, mem.grads, mem.master, mem.optimizer),
                    (want.params, want.grads, want.master, want.optimizer),
                    "zero={k} dp={dp} rank {rank}"
                );
                // Buffers: every gradient in flight at most once (4Φ), plus the bucket being
                // cut into per-owner pieces and comm's one scratch copy of a non-root reduce
                // (a bucket closes once it reaches the 40-element cap, so it holds fewer than
                // 40 + max_unit elements), plus two gathered units.
                let max_bucket = 40 + max_unit;
                assert!(
                    mem.comm_buffers <= 4 * phi + 2 * 4 * max_bucket + 2 * 4 * max_unit,
                    "zero={k} dp={dp}: {mem:?}"
                );
                assert!(mem.activations > 0);
                // DDP and ZeRO-1 all-reduce each bucket in its own allocation: no copies in
                // flight, only ZeRO-1's gather of the updated weights (one unit at a time).
                match stage {
                    ZeroStage::Ddp => assert_eq!(mem.comm_buffers, 0, "dp={dp}"),
                    ZeroStage::One => assert_eq!(mem.comm_buffers, gathered, "dp={dp}"),
                    _ => {}
                }
                if stage == ZeroStage::Three {
                    // Peak parameter bytes: the shard plus at most two gathered units.
                    assert!(
                        gathered > 0 && gathered <= 2 * 4 * max_unit,
                        "dp={dp}: gathered {gathered}"
                    );
                }
            }
        }
    }
    // Fixed formula check against the table: 258 params over 4 ranks, shard 65.
    assert_eq!(
        formula(258, 4, ZeroStage::Two, Precision::Fp32).model_states(),
        4 * 258 + 12 * 65
    );
}

/// 16-bit weights and gradients on the CPU are widened unit by unit (the widened buffers are
/// reused from one unit to the next of its size within an action, and counted while kept):
/// at most one unit's fp32 weights and one unit's fp32 gradients at once, whatever the depth.
#[test]
fn widened_16_bit_units_are_counted_and_bounded() {
    for model in [toy(), ToyModel::new(12, 6, 6, 10)] {
        let max_unit = model.units().iter().map(|u| u.len()).max().unwrap();
        for (mem, gathered, _) in run_in(&model, ZeroStage::Ddp, 1, Precision::Bf16) {
            assert!(
                gathered >= 4 * max_unit && gathered <= 2 * 4 * max_unit,
                "gathered {gathered} for units of at most {max_unit}: {mem:?}"
            );
        }
    }
}

#[test]
fn zero3_peak_does_not_grow_with_depth() {
    // Six blocks instead of three: the gathered peak is still two units, not the model.
    let model = ToyModel::new(12, 6, 6, 10);
    let max_unit = model.units().iter().map(|u| u.len()).max().unwrap();
    for (_, gathered, _) in run(&model, ZeroStage::Three, 4) {
        assert!(
            gathered <= 2 * 4 * max_unit,
            "gathered {gathered} > two units of {max_unit}"
        );
    }
}

#[test]
fn first_bucket_completes_before_the_last_backward_unit_starts() {
    // Each block's backward takes 30 ms, so a bucket launched after the head's backward has
    // ample time to finish while the blocks' backward runs on the compute thread.
    let mut model = toy();
    model.backward_delay = std::time::Duration::from_millis(30);
    for stage in [ZeroStage::Ddp, ZeroStage::Two] {
        for (rank, (_, _, trace)) in run(&model, stage, 2).into_iter().enumerate() {
            // The second step's events (the first step warms the worker thread up).
            let starts: Vec<_> = trace
                .iter()
                .enumerate()
                .filter(|(_, k)| **k == TraceKind::BackwardStart(4))
                .map(|(i, _)| i)
                .collect();
            let t = &trace[starts[1]..];
            let pos = |k: TraceKind| {
                t.iter()
                    .position(|x| *x == k)
                    .unwrap_or_else(|| panic!("{k:?} missing: {t:?}"))
            };
            let launched = pos(TraceKind::BucketLaunched(0));
            let done = pos(TraceKind::BucketDone(0));
            let last_unit = pos(TraceKind::BackwardStart(0));
            assert!(
                launched < done && done < last_unit,
                "{stage:?} rank {rank}: {t:?}"
            );
        }
    }
}
