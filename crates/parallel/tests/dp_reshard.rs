//! Reshard: save at dp=4 ZeRO-3 after 3 steps, load at dp=2 ZeRO-1 and at dp=1 (DDP), and
//! continue 3 steps: the losses equal the uninterrupted dp=4 ZeRO-3 run's within 1e-5 relative
//! (the state is restored bit for bit; only the reduction order differs between dp sizes).
mod common;
use common::*;
use parallel::engine::DataParallel;
use parallel::memory::ZeroStage;
use parallel::sampler::DistributedSampler;
use parallel::testing::ToyModel;
use std::path::Path;

const GLOBAL: usize = 8;

/// Runs steps `from..to` on `dp` ranks at `stage`, loading `load` first and saving to `save`
/// after; returns the losses.
fn run(
    model: &ToyModel,
    stage: ZeroStage,
    dp: usize,
    from: usize,
    to: usize,
    load: Option<&Path>,
    save: Option<&Path>,
) -> Vec<f32> {
    let cfg = config(stage);
    let sampler = DistributedSampler::for_global_batch(GLOBAL, dp, 2).unwrap();
    let out = comm::testing::run_threads(dp, |c| {
        let group = c.world().clone();
        let rank = group.rank();
        let mut e = DataParallel::new(model.clone(), group, cfg.clone(), &model.init(7)).unwrap();
        if let Some(dir) = load {
            e.load_checkpoint(dir).unwrap();
            assert_eq!(e.step_count(), from as u64);
        }
        let mut losses = Vec::new();
        for step in from..to {
            let batches: Vec<_> = (0..sampler.accum)
                .map(|a| {
                    let r = sampler.samples(step, rank, a);
                    model.samples(r.start, r.len())
                })
                .collect();
            losses.push(e.train_step(&batches).unwrap().loss);
        }
        if let Some(dir) = save {
            e.save_checkpoint(dir).unwrap();
        }
        losses
    });
    out.into_iter().next().unwrap()
}

fn tmpdir(tag: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("xtrain-reshard-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

#[test]
fn zero3_dp4_checkpoint_continues_at_other_sizes_and_stages() {
    let model = toy();
    let full = run(&model, ZeroStage::Three, 4, 0, 6, None, None);
    let dir = tmpdir("z3");
    let first = run(&model, ZeroStage::Three, 4, 0, 3, None, Some(&dir));
    assert_eq!(first, full[..3]);
    for (stage, dp) in [
        (ZeroStage::One, 2),
        (ZeroStage::Ddp, 1),
        (ZeroStage::Three, 4),
        (ZeroStage::Two, 2),
    ] {
        let rest = run(&model, stage, dp, 3, 6, Some(&dir), None);
        for (got, want) in rest.iter().zip(&full[3..]) {
            assert!(
                (got - want).abs() / want.abs() < 1e-5,
                "{stage:?} dp={dp}: {rest:?} vs {:?}",
                &full[3..]
            );
        }
    }
    // A DDP checkpoint (replicated, saved once as world 1) loads into ZeRO-3 at dp=4 too.
    let ddp_dir = tmpdir("ddp");
    run(&model, ZeroStage::Ddp, 2, 0, 3, None, Some(&ddp_dir));
    let rest = run(&model, ZeroStage::Three, 4, 3, 6, Some(&ddp_dir), None);
    for (got, want) in rest.iter().zip(&full[3..]) {
        assert!((got - want).abs() / want.abs() < 1e-5);
    }
    // A checkpoint of another model is refused with a clear error.
    let other = ToyModel::new(12, 6, 2, 10);
    let err = comm::testing::run_threads(1, |c| {
        let mut e = DataParallel::new(
            other.clone(),
            c.world().clone(),
            config(ZeroStage::Ddp),
            &other.init(1),
        )
        .unwrap();
        e.load_checkpoint(&dir).unwrap_err().to_string()
    });
    assert!(err[0].contains("units"), "{}", err[0]);
    let _ = std::fs::remove_dir_all(&dir);
    let _ = std::fs::remove_dir_all(&ddp_dir);
}
