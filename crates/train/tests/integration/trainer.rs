//! End-to-end trainer properties on the tiny preset: resuming from a checkpoint is
//! bit-identical to an uninterrupted run (fp32 and bf16), a data-parallel run (ranks as
//! threads) gives the single-process losses with the same global batch at every ZeRO stage,
//! and the memory account matches the formulas.
use std::path::{Path, PathBuf};

use train::trainer::{checkpoint_config_text, Trainer};
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

fn tmp(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("xtrain-trainer-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// The config saved in checkpoint `ck`.
fn saved_config(ck: &Path) -> RunConfig {
    let ck = parallel::checkpoint::Checkpoint::open(ck).unwrap();
    RunConfig::resolve("tiny", Some(&checkpoint_config_text(&ck).unwrap()), &[]).unwrap()
}

fn resume_is_bit_identical(precision: &str) {
    let (n, k) = (12, 5);
    let mut straight = Trainer::single(cfg(precision, n)).unwrap();
    let want: Vec<f64> = (0..n)
        .map(|_| straight.train_step().unwrap().loss)
        .collect();

    let mut first = Trainer::single(cfg(precision, n)).unwrap();
    let mut got: Vec<f64> = (0..k).map(|_| first.train_step().unwrap().loss).collect();
    let dir = tmp(precision).join("ck");
    first.save_checkpoint(&dir).unwrap();
    drop(first);
    let comm = comm::Communicator::single_process().unwrap();
    let mut resumed = Trainer::resume(saved_config(&dir), &dir, &comm).unwrap();
    assert_eq!(resumed.step, k);
    got.extend((k..n).map(|_| resumed.train_step().unwrap().loss));
    for (i, (a, b)) in want.iter().zip(&got).enumerate() {
        assert_eq!(a.to_bits(), b.to_bits(), "{precision} step {i}: {a} vs {b}");
    }
    let (a, b) = (
        straight.exec.full_params().unwrap(),
        resumed.exec.full_params().unwrap(),
    );
    assert!(a.iter().zip(&b).all(|(a, b)| a.to_bits() == b.to_bits()));
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
    let t = Trainer::single(cfg("fp32", 1)).unwrap();
    let phi = t.num_params();
    assert_eq!(t.memory().model_states(), 16 * phi);
    let b = Trainer::single(cfg("bf16", 1)).unwrap();
    let m = b.memory();
    assert_eq!(
        (m.params, m.grads, m.master + m.optimizer),
        (2 * phi, 2 * phi, 12 * phi)
    );
    assert_eq!(b.cfg.train.precision, Precision::Bf16);
}

/// `dp` ranks as threads at ZeRO `zero` with `accum` micro-batches each.
fn dp_losses(dp: usize, zero: usize, accum: usize) -> Vec<Vec<f64>> {
    let o: Vec<String> = vec![
        "train.steps=3".into(),
        "train.micro_batch=2".into(),
        format!("train.grad_accum={accum}"),
        "model.seq_len=16".into(),
        "data.corpus_bytes=20000".into(),
        format!("parallel.dp={dp}"),
        format!("parallel.nproc={dp}"),
        format!("parallel.zero={zero}"),
    ];
    let c = RunConfig::resolve("tiny", None, &o).unwrap();
    comm::testing::run_threads(dp, |comm| {
        let mut t = Trainer::new(c.clone(), &comm).unwrap();
        assert_eq!(t.sampler.global_batch(), 4);
        (0..3).map(|_| t.train_step().unwrap().loss).collect()
    })
}

#[test]
fn dp2_every_stage_matches_dp1_with_accumulation() {
    let want = dp_losses(1, 0, 2).remove(0);
    for zero in 0..4 {
        for r in dp_losses(2, zero, 1) {
            for (a, b) in r.iter().zip(&want) {
                assert!(
                    (a - b).abs() / b.abs() < 1e-5,
                    "zero={zero}: {r:?} vs {want:?}"
                );
            }
        }
    }
}

/// Recomputation rebuilds what the forward dropped with the same kernels in the same order, so
/// every loss and weight is bit for bit the run without it (and the activations held shrink).
#[test]
fn recomputation_changes_no_number() {
    let run = |policy: &str| {
        let mut c = cfg("fp32", 3);
        c.train.recompute = policy.into();
        let mut t = Trainer::single(c).unwrap();
        let losses: Vec<u64> = (0..3)
            .map(|_| t.train_step().unwrap().loss.to_bits())
            .collect();
        (
            losses,
            t.exec.full_params().unwrap(),
            t.memory().activations,
        )
    };
    let (want, params, act) = run("none");
    for policy in ["selective", "full"] {
        let (l, p, a) = run(policy);
        assert_eq!(l, want, "{policy}: losses");
        assert!(
            p.iter()
                .zip(&params)
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "{policy}: weights"
        );
        assert!(
            a < act,
            "{policy}: {a} activation bytes held, {act} without"
        );
    }
}
