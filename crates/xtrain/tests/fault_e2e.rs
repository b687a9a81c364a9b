//! Failures of real processes through the launcher (faults injected with `XTRAIN_FAULT`):
//! - restarts that continue: `xtrain launch --max-restarts 1 -- xtrain train --resume auto`
//!   with a rank killed mid-run ends with exactly the losses of an uninterrupted run, bit for
//!   bit, and one metrics row per step; a group restarted on fewer processes reshards (dp 2 →
//!   1, the global batch kept) and continues;
//! - the hung-rank locator: a rank of a dp 2 × tp 2 job stopped with SIGSTOP is named, with
//!   the operation it never entered, within the heartbeat's limit (long before the collective
//!   timeout), and no process is left behind.
mod common;
use common::*;
use std::path::Path;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

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

/// Processes whose environment holds `XTRAIN_TEST_MARK=<mark>`.
fn marked_processes(mark: &str) -> Vec<i32> {
    let needle = format!("XTRAIN_TEST_MARK={mark}");
    std::fs::read_dir("/proc")
        .map(|d| {
            d.flatten()
                .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
                .filter(|pid| {
                    std::fs::read(format!("/proc/{pid}/environ"))
                        .is_ok_and(|env| env.split(|&b| b == 0).any(|v| v == needle.as_bytes()))
                })
                .collect()
        })
        .unwrap_or_default()
}

#[test]
fn a_stopped_rank_is_named_within_the_heartbeat_limit() {
    let d = tmp("stopped");
    let bin = env!("CARGO_BIN_EXE_xtrain");
    let mark = format!("stopped-{}", std::process::id());
    let t0 = Instant::now();
    // dp 2 × tp 2; rank 1 stops itself (SIGSTOP) after step 2; heartbeats every second, so
    // the ranks waiting on it know within about 3 s; the collective timeout is 300 s.
    let out = Command::new(bin)
        .args([
            "launch",
            "--nproc-per-node",
            "4",
            "--grace-period",
            "1",
            "--",
        ])
        .args([
            bin,
            "train",
            "--quiet",
            "--tp",
            "2",
            "--out",
            d.to_str().unwrap(),
        ])
        .args([
            "--set",
            "model.seq_len=16",
            "--set",
            "data.corpus_bytes=20000",
        ])
        .args(["--set", "train.micro_batch=2", "--set", "train.threads=1"])
        .args(["--set", "train.sample_tokens=0", "--set", "train.steps=200"])
        .env_remove("RANK")
        .env_remove("WORLD_SIZE")
        .env("XTRAIN_FAULT", "stop:1@2")
        .env("XTRAIN_HEARTBEAT_INTERVAL", "1")
        .env("XTRAIN_COMM_TIMEOUT", "300")
        .env("XTRAIN_TEST_MARK", &mark)
        .env("RUST_BACKTRACE", "0")
        .output()
        .expect("running xtrain launch");
    let took = t0.elapsed();
    // Nothing may be left running (the launcher kills the stopped rank); clean up if it did.
    let left = marked_processes(&mark);
    for &pid in &left {
        // SAFETY: kill(2) on processes this test started (marked in their environment).
        unsafe {
            libc::kill(pid, libc::SIGCONT);
            libc::kill(pid, libc::SIGKILL);
        }
    }
    assert!(left.is_empty(), "processes left running: {left:?}");
    let text = failed(&out);
    assert!(text.contains("rank(s) [1] stopped (no heartbeat"), "{text}");
    assert!(text.contains("diagnosis: rank 1 never entered"), "{text}");
    assert!(text.contains("it is stopped (no heartbeat for"), "{text}");
    assert!(text.contains("XTRAIN_FAULT: rank 1 sends itself"), "{text}");
    assert!(took < Duration::from_secs(90), "{took:?}: {text}");
    let _ = std::fs::remove_dir_all(&d);
}
