//! Checkpoints at any layout: saved at dp = 4 ZeRO-3 after 3 steps, loaded at dp = 2 ZeRO-1,
//! dp = 1 DDP, dp = 4 ZeRO-3 and dp = 2 ZeRO-2, the next 3 steps repeat the uninterrupted run's
//! losses within 1e-5 relative (the state is restored bit for bit; only the reduction order
//! differs between dp sizes) and bit for bit where the layout is the same. A DDP checkpoint
//! (written once, by dp rank 0) loads at ZeRO-3; a checkpoint of another model, a corrupt shard
//! and a missing one are clear errors.
use crate::common::*;
use parallel::checkpoint::{self, Checkpoint};
use parallel::data_parallel::sampler::DistributedSampler;
use parallel::data_parallel::ZeroStage;
use parallel::executor::Executor;
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
        let mut e =
            Executor::from_params(model.clone(), group, cfg.clone(), &model.init(7)).unwrap();
        if let Some(dir) = load {
            let mut ck = Checkpoint::open(dir).unwrap();
            e.load_checkpoint(&mut ck).unwrap();
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
            checkpoint::save(
                dir,
                c.world(),
                &e.checkpoint_pieces().unwrap(),
                &save_meta(dp, stage, &e),
            )
            .unwrap();
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
    let dir = tmpdir("z3").join("step_000003");
    let first = run(&model, ZeroStage::Three, 4, 0, 3, None, Some(&dir));
    assert_eq!(first, full[..3]);
    let ck = Checkpoint::open(&dir).unwrap();
    assert_eq!(ck.manifest.mesh.dp, 4);
    assert_eq!(ck.file("note.txt").unwrap().unwrap(), b"toy");
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
        if (stage, dp) == (ZeroStage::Three, 4) {
            assert_eq!(rest, full[3..], "same layout: bit for bit");
        }
    }
    // A DDP checkpoint (replicated, written by dp rank 0 only) loads into ZeRO-3 at dp=4 too.
    let ddp_dir = tmpdir("ddp").join("ck");
    run(&model, ZeroStage::Ddp, 2, 0, 3, None, Some(&ddp_dir));
    let files = Checkpoint::open(&ddp_dir).unwrap().manifest.files;
    assert!(
        files.contains_key("shard-00000.safetensors")
            && !files.contains_key("shard-00001.safetensors")
    );
    let rest = run(&model, ZeroStage::Three, 4, 3, 6, Some(&ddp_dir), None);
    for (got, want) in rest.iter().zip(&full[3..]) {
        assert!((got - want).abs() / want.abs() < 1e-5);
    }
    // Saving again into the same directory replaces it as a whole: a ZeRO-3 dp=4 save over
    // the DDP one leaves four shards and loads.
    run(&model, ZeroStage::Three, 4, 0, 3, None, Some(&ddp_dir));
    let files = Checkpoint::open(&ddp_dir).unwrap().manifest.files;
    assert_eq!(files.keys().filter(|f| f.starts_with("shard-")).count(), 4);
    let n = std::fs::read_dir(&ddp_dir).unwrap().count();
    assert_eq!(n, files.len() + 1, "only the listed files and the manifest");
    run(&model, ZeroStage::Ddp, 1, 3, 4, Some(&ddp_dir), None);
    // A checkpoint of another model is refused with a clear error.
    let other = ToyModel::new(12, 8, 3, 10);
    let err = comm::testing::run_threads(1, |c| {
        let mut e = Executor::from_params(
            other.clone(),
            c.world().clone(),
            config(ZeroStage::Ddp),
            &other.init(1),
        )
        .unwrap();
        let mut ck = Checkpoint::open(&dir).unwrap();
        e.load_checkpoint(&mut ck).unwrap_err().to_string()
    });
    assert!(
        err[0].contains("embed has 72 elements in the checkpoint, the model has 96"),
        "{}",
        err[0]
    );
    // A flipped byte in a shard: the checksum names the file; a missing shard is named too.
    let shard = dir.join("shard-00002.safetensors");
    let mut bytes = std::fs::read(&shard).unwrap();
    bytes[100] ^= 1;
    std::fs::write(&shard, &bytes).unwrap();
    let err = comm::testing::run_threads(1, |c| {
        let mut e = Executor::from_params(
            model.clone(),
            c.world().clone(),
            config(ZeroStage::Ddp),
            &model.init(7),
        )
        .unwrap();
        let mut ck = Checkpoint::open(&dir).unwrap();
        e.load_checkpoint(&mut ck).unwrap_err().to_string()
    });
    assert!(
        err[0].contains("checksum mismatch in shard-00002"),
        "{}",
        err[0]
    );
    std::fs::remove_file(&shard).unwrap();
    let err = Checkpoint::open(&dir).err().unwrap().to_string();
    assert!(err.contains("shard-00002.safetensors"), "{err}");
    let _ = std::fs::remove_dir_all(dir.parent().unwrap());
    let _ = std::fs::remove_dir_all(ddp_dir.parent().unwrap());
}
