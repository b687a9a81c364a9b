//! Helpers of the command-line tests: run the built `xtrain`, check its exit and output, read
//! a run's losses, compare them.
#![allow(dead_code)] // each test file uses some of them
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// The settings every end-to-end training run shares: short sequences of a small corpus, the
/// full learning rate from step 1, one kernel thread per rank, no text samples. Each test adds
/// its micro-batch, learning-rate floor and steps.
pub const FAST_RUN: [&str; 10] = [
    "--set",
    "model.seq_len=16",
    "--set",
    "data.corpus_bytes=20000",
    "--set",
    "train.warmup_steps=0",
    "--set",
    "train.threads=1",
    "--set",
    "train.sample_tokens=0",
];

/// Runs the built `xtrain` with `args` (outside any launched job): the binary cargo built, or
/// `XTRAIN_BIN` where set (the GPU check runs these tests from prebuilt copies elsewhere).
pub fn xtrain(args: &[&str]) -> Output {
    xtrain_with(args, &[])
}

/// [`xtrain`] with environment variables `env` set for the run.
pub fn xtrain_with(args: &[&str], env: &[(&str, &str)]) -> Output {
    let bin = std::env::var_os("XTRAIN_BIN").unwrap_or_else(|| env!("CARGO_BIN_EXE_xtrain").into());
    Command::new(bin)
        .args(args)
        .env_remove("RANK")
        .env_remove("WORLD_SIZE")
        .env("RUST_BACKTRACE", "0")
        .envs(env.iter().copied())
        .output()
        .expect("running xtrain")
}

/// The output of a run that must have succeeded.
pub fn ok(o: &Output) -> String {
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(o.status.success(), "{text}");
    text
}

/// The output of a run that must have failed cleanly (no panic).
pub fn failed(o: &Output) -> String {
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(!o.status.success(), "expected a failure:\n{text}");
    assert!(!text.contains("panicked"), "{text}");
    text
}

/// The losses of `metrics.jsonl`, keyed by step.
pub fn losses(run: &Path) -> Vec<(u64, f64)> {
    std::fs::read_to_string(run.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            (v["step"].as_u64().unwrap(), v["loss"].as_f64().unwrap())
        })
        .collect()
}

/// Equal steps, each loss within 1e-5 relative.
pub fn close(got: &[(u64, f64)], want: &[(u64, f64)], what: &str) {
    assert_eq!(
        got.iter().map(|g| g.0).collect::<Vec<_>>(),
        want.iter().map(|w| w.0).collect::<Vec<_>>(),
        "{what}: steps"
    );
    for ((s, a), (_, b)) in got.iter().zip(want) {
        assert!(
            (a - b).abs() / b.abs() < 1e-5,
            "{what} step {s}: {a} vs {b}"
        );
    }
}

/// A fresh temporary directory `xtrain-<tag>-<pid>` (removed if it exists).
pub fn tmp(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("xtrain-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}
