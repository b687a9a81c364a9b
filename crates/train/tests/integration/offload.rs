//! ZeRO-Offload (`parallel.offload = "optimizer"`): the fp32 master weights and AdamW moments
//! in host memory, AdamW on the CPU over them, the weights stored from the master. On the CPU
//! the same path runs with nothing to move — a separate master beside the weights, 16-bit
//! gradients landing in a host vector by the GPU's rules — so every
//! loss, grad norm and final parameter equals the run without offload bit for bit, at every
//! ZeRO stage, with a pipeline and in bf16; and checkpoints cross between the two modes with
//! the uninterrupted run's losses. (The GPU runs, where the state really moves, are in
//! `gpu_train.rs`.)
use std::path::{Path, PathBuf};

use train::RunConfig;

/// Layouts with 4 sequences per step. In bf16 the gradients land in a host vector bucket by
/// bucket as they become final (`executor::offload`, by the rules the GPU's page-locked
/// landing follows): ZeRO-3 with two micro-batches (its buckets reduced after each, final
/// after the second) and two pipeline stages check those rules — a gradient landed before
/// its last sum would change the step.
const LAYOUTS: [(&str, usize, &[&str]); 9] = [
    ("single", 1, &["train.grad_accum=4"]),
    ("dp2 ZeRO-0", 2, &["parallel.dp=2", "train.grad_accum=2"]),
    (
        "dp2 ZeRO-1",
        2,
        &["parallel.dp=2", "parallel.zero=1", "train.grad_accum=2"],
    ),
    (
        "dp2 ZeRO-2",
        2,
        &["parallel.dp=2", "parallel.zero=2", "train.grad_accum=2"],
    ),
    (
        "dp2 ZeRO-3",
        2,
        &["parallel.dp=2", "parallel.zero=3", "train.grad_accum=2"],
    ),
    ("pp2 1F1B", 2, &["parallel.pp=2", "train.grad_accum=4"]),
    (
        "dp2 ZeRO-1 bf16",
        2,
        &[
            "parallel.dp=2",
            "parallel.zero=1",
            "train.grad_accum=2",
            "train.precision=\"bf16\"",
        ],
    ),
    (
        "dp2 ZeRO-3 bf16",
        2,
        &[
            "parallel.dp=2",
            "parallel.zero=3",
            "train.grad_accum=2",
            "train.precision=\"bf16\"",
        ],
    ),
    (
        "pp2 1F1B bf16",
        2,
        &[
            "parallel.pp=2",
            "train.grad_accum=4",
            "train.precision=\"bf16\"",
        ],
    ),
];

fn config(nproc: usize, extra: &[&str], offload: bool) -> RunConfig {
    let o: Vec<String> = [
        "train.micro_batch=1",
        "model.seq_len=32",
        "train.warmup_steps=2",
        "train.eval_batches=0",
        "data.corpus_bytes=20000",
    ]
    .iter()
    .chain(extra)
    .map(|s| s.to_string())
    .chain([
        format!("parallel.nproc={nproc}"),
        format!(
            "parallel.offload=\"{}\"",
            if offload { "optimizer" } else { "none" }
        ),
    ])
    .collect();
    RunConfig::resolve("tiny", None, &o).unwrap()
}

fn tmp(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("xtrain-offload-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

/// [`crate::common::run_read_back`] of 4 sequences per step.
fn run(
    cfg: &RunConfig,
    nproc: usize,
    from: Option<&Path>,
    steps: usize,
    save: &Path,
) -> (Vec<(f64, f32)>, Vec<f32>) {
    crate::common::run_read_back(cfg, nproc, 4, (from, steps, save))
}

#[test]
fn offloaded_optimizer_changes_no_number() {
    let d = tmp("layouts");
    for (name, nproc, extra) in LAYOUTS {
        let (want, p_want) = run(&config(nproc, extra, false), nproc, None, 4, &d.join("a"));
        let (got, p_got) = run(&config(nproc, extra, true), nproc, None, 4, &d.join("b"));
        assert_eq!(got, want, "{name}: losses and grad norms");
        assert!(p_got == p_want, "{name}: parameters differ");
    }
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn checkpoints_cross_between_offloaded_and_resident_optimizers() {
    let d = tmp("resume");
    let (nproc, extra) = (LAYOUTS[2].1, LAYOUTS[2].2);
    let (straight, p_straight) = run(&config(nproc, extra, false), nproc, None, 4, &d.join("s"));
    for first in [true, false] {
        let ck = d.join(format!("first-{first}"));
        let (a, _) = run(&config(nproc, extra, first), nproc, None, 2, &ck);
        let (b, p) = run(
            &config(nproc, extra, !first),
            nproc,
            Some(&ck),
            2,
            &d.join(format!("then-{first}")),
        );
        assert_eq!([a, b].concat(), straight, "offload {first} then {}", !first);
        assert!(
            p == p_straight,
            "offload {first} then {}: parameters",
            !first
        );
    }
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn an_unknown_offload_is_a_config_error() {
    let e = RunConfig::resolve("tiny", None, &["parallel.offload=\"gradients\"".into()])
        .unwrap_err()
        .to_string();
    assert!(e.contains("expected none or optimizer"), "{e}");
}
