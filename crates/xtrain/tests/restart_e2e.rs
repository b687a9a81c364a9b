//! Restarts that continue: `xtrain launch --max-restarts 1 -- xtrain train --resume auto` with
//! a rank killed mid-run (the `XTRAIN_FAULT` hook) ends with exactly the losses of an
//! uninterrupted run, bit for bit, and one metrics row per step; a group restarted on fewer
//! processes reshards (dp 2 → 1, the global batch kept) and continues.
mod common;
use common::*;
use std::path::Path;
use std::process::{Command, Output};

/// `xtrain launch --nproc-per-node N --max-restarts R -- xtrain train --resume auto --out O`
/// on a small, fast run of 6 steps with checkpoints every 2, `fault` in `XTRAIN_FAULT`.
fn launch(nproc: usize, restarts: u32, fault: Option<&str>, out: &Path) -> Output {
    let bin = env!("CARGO_BIN_EXE_xtrain");
    let (n, r) = (nproc.to_string(), restarts.to_string());
    let mut cmd = Command::new(bin);
    cmd.args(["launch", "--nproc-per-node", &n, "--max-restarts", &r])
        .args(["--grace-period", "1", "--", bin, "train"])
        .args(["--resume", "auto", "--out", out.to_str().unwrap()])
        .args([
            "--set",
            "model.seq_len=16",
            "--set",
            "data.corpus_bytes=20000",
        ])
        .args([
            "--set",
            "train.micro_batch=2",
            "--set",
            "train.warmup_steps=0",
        ])
        .args(["--set", "train.threads=1", "--set", "train.sample_tokens=0"])
        .args(["--set", "train.steps=6", "--set", "train.ckpt_every=2"])
        .env_remove("RANK")
        .env_remove("WORLD_SIZE")
        .env_remove("XTRAIN_FAULT")
        .env("RUST_BACKTRACE", "0");
    if let Some(f) = fault {
        cmd.env("XTRAIN_FAULT", f);
    }
    cmd.output().expect("running xtrain launch")
}

fn steps(l: &[(u64, f64)]) -> Vec<u64> {
    l.iter().map(|s| s.0).collect()
}

#[test]
fn a_killed_rank_restarts_from_the_last_checkpoint_with_identical_losses() {
    let d = tmp("restart");
    ok(&launch(2, 0, None, &d.join("straight")));
    let want = losses(&d.join("straight"));
    assert_eq!(steps(&want), [1, 2, 3, 4, 5, 6]);

    // Rank 1 is killed right after step 3; the restart continues from step 2's checkpoint.
    let run = d.join("restarted");
    let text = ok(&launch(2, 1, Some("kill:1@3"), &run));
    assert!(
        text.contains("rank 1") && text.contains("restarting the group"),
        "{text}"
    );
    assert!(text.contains("resumed at step 2"), "{text}");
    let got = losses(&run);
    assert_eq!(steps(&got), [1, 2, 3, 4, 5, 6], "one row per step");
    for ((s, a), (_, b)) in got.iter().zip(&want) {
        assert_eq!(a.to_bits(), b.to_bits(), "step {s}: {a} vs {b}");
    }

    // The same failure without a restart left step 2's checkpoint; a group of one process
    // continues it (dp 2 → 1, two accumulation steps keep the global batch).
    let run = d.join("shrunk");
    let text = failed(&launch(2, 0, Some("kill:1@3"), &run));
    assert!(text.contains("rank 1"), "{text}");
    let text = ok(&launch(1, 0, None, &run));
    assert!(text.contains("resumed at step 2"), "{text}");
    assert!(
        text.contains("dp = 1 × micro_batch = 2 × grad_accum = 2"),
        "{text}"
    );
    close(&losses(&run), &want, "dp 2 -> 1");
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn resume_auto_refuses_a_damaged_run_directory() {
    let d = tmp("restart-bad");
    // Checkpoints without `latest`: an error naming the way out, not a fresh start.
    std::fs::create_dir_all(d.join("checkpoints/step_000002")).unwrap();
    let out = d.to_str().unwrap();
    let text = failed(&xtrain(&["train", "--resume", "auto", "--out", out]));
    assert!(text.contains("no `latest`"), "{text}");
    // `latest` naming a checkpoint that is not there.
    std::fs::write(d.join("latest"), "checkpoints/step_000004").unwrap();
    let text = failed(&xtrain(&["train", "--resume", "auto", "--out", out]));
    assert!(text.contains("step_000004"), "{text}");
    let _ = std::fs::remove_dir_all(&d);
}
