//! End-to-end tensor parallelism with real processes through the launcher:
//! `xtrain train --nproc 4 --tp 2 --dp 2 --zero 1 --sp` prints the same losses as the
//! data-parallel run `--nproc 2 --dp 2` on the same global batch; a checkpoint saved at tp = 2
//! resumes at tp = 1 with the losses of the uninterrupted run; an impossible layout is a clear
//! error.
use std::process::Command;

fn train(args: &[&str], steps: usize, out: &std::path::Path) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_xtrain"))
        .args(["train", "--preset", "tiny", "--quiet"])
        .args(args)
        .args(["--set", &format!("train.steps={steps}")])
        // Constant learning rate, so a run cut in two follows the same schedule.
        .args([
            "--set",
            "train.warmup_steps=0",
            "--set",
            "train.min_lr=3e-3",
        ])
        .args(["--set", "train.micro_batch=2", "--set", "train.threads=1"])
        .args([
            "--set",
            "model.seq_len=16",
            "--set",
            "data.corpus_bytes=20000",
        ])
        .arg("--out")
        .arg(out)
        .env_remove("RANK")
        .env_remove("WORLD_SIZE")
        .output()
        .expect("running xtrain")
}

fn losses(o: &std::process::Output) -> Vec<String> {
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
    stdout
        .lines()
        .filter(|l| l.starts_with("step "))
        .map(|l| l.split('|').nth(1).unwrap_or("").trim().to_string())
        .collect()
}

#[test]
fn tp2_dp2_matches_dp2_and_resumes_at_tp1() {
    let dir = std::env::temp_dir().join(format!("xtrain-tp-e2e-{}", std::process::id()));
    let dp = losses(&train(
        &["--nproc", "2", "--dp", "2", "--zero", "1"],
        4,
        &dir.join("dp"),
    ));
    let tp_args = [
        "--nproc", "4", "--tp", "2", "--dp", "2", "--zero", "1", "--sp",
    ];
    let tp = losses(&train(&tp_args, 4, &dir.join("tp")));
    assert_eq!(tp.len(), 4);
    assert_eq!(tp, dp, "tp × dp vs dp losses");
    // Rank 0 wrote the run directory like a data-parallel run: one metrics line per step with
    // the same losses, validation at the end, and the loss plot.
    let metrics = |run: &str| -> Vec<serde_json::Value> {
        std::fs::read_to_string(dir.join(run).join("metrics.jsonl"))
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    };
    let (m_tp, m_dp) = (metrics("tp"), metrics("dp"));
    assert_eq!(m_tp.len(), 4);
    for (a, b) in m_tp.iter().zip(&m_dp) {
        assert_eq!(a["step"], b["step"]);
        let (la, lb) = (a["loss"].as_f64().unwrap(), b["loss"].as_f64().unwrap());
        assert!(
            (la - lb).abs() <= 1e-6 * lb.abs(),
            "metrics loss {la} vs {lb}"
        );
    }
    assert!(m_tp[3]["val_loss"].as_f64().is_some(), "{:?}", m_tp[3]);
    for f in ["config.toml", "loss.png", "loss.svg"] {
        assert!(dir.join("tp").join(f).is_file(), "{f}");
    }
    // Two steps at tp = 2, then resume the remaining two at tp = 1 (dp = 2 as before).
    // Checkpoints every step: step 1 periodic, step 2 at the end, `latest` naming step 2.
    let cut_args = [&tp_args[..], &["--set", "train.ckpt_every=1"]].concat();
    let first = losses(&train(&cut_args, 2, &dir.join("cut")));
    let ckpt = dir.join("cut");
    for step in ["step_000001", "step_000002"] {
        assert!(ckpt.join("tp-checkpoints").join(step).join("tp-1").is_dir());
    }
    let latest = std::fs::read_to_string(ckpt.join("latest")).unwrap();
    assert_eq!(latest.trim(), "tp-checkpoints/step_000002");
    // Resumed from the run directory: `latest` names the newest complete tp checkpoint.
    let resumed = train(
        &[
            "--nproc",
            "2",
            "--dp",
            "2",
            "--zero",
            "3",
            "--resume",
            ckpt.to_str().unwrap(),
        ],
        4,
        &dir.join("resumed"),
    );
    let rest = losses(&resumed);
    assert!(String::from_utf8_lossy(&resumed.stdout).contains("resumed at step 2"));
    let all: Vec<String> = first.into_iter().chain(rest).collect();
    assert_eq!(all, tp, "resumed at another tp size vs uninterrupted");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn heads_not_divisible_by_tp_is_an_error() {
    let dir = std::env::temp_dir().join(format!("xtrain-tp-e2e-bad-{}", std::process::id()));
    let o = train(&["--nproc", "3", "--tp", "3"], 1, &dir);
    assert!(!o.status.success());
    let all = format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(
        all.contains("num_attention_heads = 4 is not divisible by tp = 3"),
        "{all}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
