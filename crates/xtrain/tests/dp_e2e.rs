//! End-to-end data parallelism with real processes: `xtrain train --nproc 2 --dp 2 --zero K`
//! spawns two workers through the launcher; ZeRO-0 and ZeRO-3 print the same losses, each
//! rank writes its checkpoint shard, rank 0 writes the single-process trainer's metrics and loss
//! plot, a checkpoint saved at dp=4 ZeRO-3 resumes at dp=2 ZeRO-1
//! with the uninterrupted run's losses, and an impossible layout fails with a clear message.
use std::path::Path;
use std::process::{Command, Output};

const SMALL: [&str; 6] = [
    "--set",
    "model.seq_len=16",
    "--set",
    "data.corpus_bytes=20000",
    "--set",
    "train.micro_batch=2",
];

fn xtrain(args: &[&str], out: &Path) -> Output {
    Command::new(env!("CARGO_BIN_EXE_xtrain"))
        .args(["train", "--preset", "tiny", "--quiet"])
        .args(SMALL)
        .args(args)
        .arg("--out")
        .arg(out)
        .env_remove("RANK")
        .env_remove("WORLD_SIZE")
        .output()
        .expect("running xtrain")
}

fn train(zero: usize, dp: usize, out: &Path) -> Output {
    let (dp, zero) = (dp.to_string(), zero.to_string());
    xtrain(
        &[
            "--nproc",
            "2",
            "--dp",
            &dp,
            "--zero",
            &zero,
            "--set",
            "train.steps=2",
        ],
        out,
    )
}

fn ok(o: &Output) -> String {
    let stdout = String::from_utf8_lossy(&o.stdout).to_string();
    assert!(
        o.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
    stdout
}

fn losses(stdout: &str) -> Vec<String> {
    stdout
        .lines()
        .filter(|l| l.starts_with("step "))
        .map(|l| l.split('|').nth(1).unwrap_or("").trim().to_string())
        .collect()
}

#[test]
fn zero0_and_zero3_agree_across_processes() {
    let dir = std::env::temp_dir().join(format!("xtrain-dp-e2e-{}", std::process::id()));
    let mut seen = Vec::new();
    for zero in [0, 3] {
        let out = dir.join(format!("z{zero}"));
        let o = train(zero, 2, &out);
        let stdout = String::from_utf8_lossy(&o.stdout);
        assert!(
            o.status.success(),
            "zero={zero}: {stdout}\n{}",
            String::from_utf8_lossy(&o.stderr)
        );
        assert!(stdout.contains(&format!("ZeRO-{zero}")), "{stdout}");
        let l = losses(&stdout);
        assert_eq!(l.len(), 2, "{stdout}");
        let shards = if zero == 0 { 1 } else { 2 };
        for r in 0..shards {
            assert!(out
                .join(format!(
                    "dp-checkpoints/step_000002/rank-{r:05}/manifest.json"
                ))
                .is_file());
        }
        // Rank 0 writes what the single-process trainer writes: config, one JSON record per
        // step (with validation at the last step), the loss plot; and every rank's memory account.
        for f in [
            "config.toml",
            "metrics.jsonl",
            "loss.png",
            "loss.svg",
            "memory.json",
            "latest",
        ] {
            assert!(out.join(f).is_file(), "zero={zero}: {f} missing");
        }
        let metrics = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
        let lines: Vec<_> = metrics.lines().collect();
        assert_eq!(lines.len(), 2, "{metrics}");
        assert!(lines[1].contains("\"val_loss\""), "{metrics}");
        seen.push(l);
    }
    assert_eq!(seen[0], seen[1]);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn dp_not_matching_processes_is_an_error() {
    let dir = std::env::temp_dir().join(format!("xtrain-dp-e2e-bad-{}", std::process::id()));
    let o = train(1, 3, &dir);
    assert!(!o.status.success());
    let all = format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(all.contains("parallel.dp"), "{all}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Printed losses of the steps as numbers, keyed by step.
fn step_losses(stdout: &str) -> Vec<(usize, f32)> {
    stdout
        .lines()
        .filter(|l| l.starts_with("step "))
        .map(|l| {
            let mut f = l.split('|');
            let step = f.next().unwrap()["step".len()..].trim().parse().unwrap();
            let loss = f.next().unwrap().trim()["loss".len()..]
                .trim()
                .parse()
                .unwrap();
            (step, loss)
        })
        .collect()
}

#[test]
fn zero3_dp4_checkpoint_resumes_at_dp2_zero1_through_the_cli() {
    let dir = std::env::temp_dir().join(format!("xtrain-dp-resume-{}", std::process::id()));
    let full = dir.join("full");
    // Uninterrupted: 6 steps at dp=4 ZeRO-3 (global batch 4 × 2), checkpoints every 3 steps.
    let ckpt = ["--set", "train.steps=6", "--set", "train.ckpt_every=3"];
    let args = [&["--nproc", "4", "--dp", "4", "--zero", "3"][..], &ckpt].concat();
    let want = step_losses(&ok(&xtrain(&args, &full)));
    assert_eq!(want.len(), 6);
    let saved = full.join("dp-checkpoints/step_000003");
    assert!(saved.join("config.toml").is_file());
    assert!((0..4).all(|r| saved.join(format!("rank-{r:05}/manifest.json")).is_file()));
    // Resumed from the step-3 shards at dp=2 ZeRO-1 with 2 accumulation steps: the same
    // global batch, so steps 4-6 repeat the uninterrupted losses (printed to 4 decimals; the
    // restored state is exact, only the reduction order differs).
    let resume = saved.to_str().unwrap();
    let args = [
        &["--nproc", "2", "--zero", "1", "--resume", resume][..],
        &["--set", "train.grad_accum=2"],
        &ckpt,
    ]
    .concat();
    let stdout = ok(&xtrain(&args, &dir.join("resumed")));
    assert!(
        stdout.contains("ZeRO-1") && stdout.contains("resumed at step 3"),
        "{stdout}"
    );
    let got = step_losses(&stdout);
    assert_eq!(got.iter().map(|g| g.0).collect::<Vec<_>>(), [4, 5, 6]);
    for ((s, a), (_, b)) in got.iter().zip(&want[3..]) {
        assert!((a - b).abs() <= 1.5e-4, "step {s}: {a} vs {b}\n{stdout}");
    }
    // A run directory resolves through its `latest` (the final step-6 checkpoint): nothing
    // left to train, and a non-checkpoint is a clear error.
    let stdout = ok(&xtrain(
        &[
            &["--nproc", "2", "--resume", full.to_str().unwrap()][..],
            &ckpt,
        ]
        .concat(),
        &dir.join("again"),
    ));
    assert!(stdout.contains("resumed at step 6"), "{stdout}");
    let o = xtrain(
        &[
            "--nproc",
            "2",
            "--resume",
            dir.join("nothing").to_str().unwrap(),
        ],
        &dir.join("bad"),
    );
    assert!(!o.status.success());
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn bench_train_times_the_data_parallel_engine() {
    let o = Command::new(env!("CARGO_BIN_EXE_xtrain"))
        .args([
            "bench",
            "train",
            "--preset",
            "tiny",
            "--threads",
            "1",
            "--steps",
            "1",
        ])
        .args(["--nproc", "2", "--zero", "2"])
        .args(SMALL)
        .env_remove("RANK")
        .env_remove("WORLD_SIZE")
        .output()
        .expect("running xtrain");
    let stdout = ok(&o);
    assert!(stdout.contains("ZeRO-2"), "{stdout}");
    for r in 0..2 {
        assert!(
            stdout.contains(&format!("rank {r}: peak RSS")) && stdout.contains("median step"),
            "{stdout}"
        );
    }
}
