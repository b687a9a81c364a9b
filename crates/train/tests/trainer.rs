//! End-to-end trainer properties on the tiny preset: the loss falls, resuming from a checkpoint
//! is bit-identical to an uninterrupted run (fp32 and bf16-mixed), bf16-mixed tracks fp32, and
//! the memory account matches the formulas.
use train::checkpoint::SaveOptions;
use train::trainer::Trainer;
use train::{Precision, RunConfig};

fn cfg(precision: &str, steps: usize) -> RunConfig {
    RunConfig::resolve(
        "tiny",
        None,
        &[
            format!("train.precision={precision}"),
            format!("train.steps={steps}"),
            "train.warmup_steps=5".into(),
            "data.corpus_bytes=200000".into(),
            "train.eval_batches=2".into(),
        ],
    )
    .unwrap()
}

fn tmp(tag: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("xtrain-trainer-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn resume_is_bit_identical(precision: &str) {
    let (n, k) = (12, 5);
    let mut straight = Trainer::new(cfg(precision, n)).unwrap();
    let want: Vec<f64> = (0..n)
        .map(|_| straight.train_step().unwrap().loss)
        .collect();

    let mut first = Trainer::new(cfg(precision, n)).unwrap();
    let mut got: Vec<f64> = (0..k).map(|_| first.train_step().unwrap().loss).collect();
    let dir = tmp(precision).join("ck");
    first.save_checkpoint(&dir, SaveOptions::default()).unwrap();
    drop(first);
    let mut resumed = Trainer::from_checkpoint(&dir, &[]).unwrap();
    assert_eq!(resumed.step, k);
    got.extend((k..n).map(|_| resumed.train_step().unwrap().loss));
    for (i, (a, b)) in want.iter().zip(&got).enumerate() {
        assert_eq!(a.to_bits(), b.to_bits(), "{precision} step {i}: {a} vs {b}");
    }
    assert!(straight
        .weights
        .master()
        .iter()
        .zip(resumed.weights.master())
        .all(|(a, b)| a.to_bits() == b.to_bits()));
    std::fs::remove_dir_all(dir.parent().unwrap()).unwrap();
}

#[test]
fn resume_fp32_bit_identical() {
    resume_is_bit_identical("fp32");
}

#[test]
fn resume_bf16_bit_identical() {
    resume_is_bit_identical("bf16");
}

#[test]
fn memory_account_matches_formulas() {
    let t = Trainer::new(cfg("fp32", 1)).unwrap();
    let phi = t.num_params() as u64;
    assert_eq!(t.memory().state(), 16 * phi);
    let b = Trainer::new(cfg("bf16", 1)).unwrap();
    let m = b.memory();
    assert_eq!(
        (m.params, m.grads, m.master + m.optimizer),
        (2 * phi, 2 * phi, 12 * phi)
    );
    assert_eq!(b.cfg.train.precision, Precision::Bf16);
}

#[test]
fn engine_plug_in_sets_the_rank_share() {
    let mut c = cfg("fp32", 2);
    c.parallel.dp = 2;
    c.parallel.nproc = 2;
    let make = |h, clip, n| {
        Box::new(train::optim::LocalAdamW::new(h, clip, n))
            as Box<dyn train::optim::StepEngine + Send>
    };
    assert!(
        Trainer::new_with_engine(c.clone(), 2, make).is_err(),
        "rank outside dp"
    );
    let t = Trainer::new_with_engine(c, 1, make).unwrap();
    assert_eq!(
        (t.sampler.dp, t.sampler.rank, t.sampler.global_batch()),
        (2, 1, 16)
    );
}
