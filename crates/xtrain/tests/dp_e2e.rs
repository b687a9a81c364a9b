//! End-to-end data parallelism with real processes: `xtrain train --nproc 2 --dp 2 --zero K`
//! spawns two workers through the launcher; ZeRO-0 and ZeRO-3 print the same losses, each
//! rank writes its checkpoint shard, and an impossible layout fails with a clear message.
use std::process::Command;

fn train(zero: usize, dp: usize, out: &std::path::Path) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_xtrain"))
        .args(["train", "--preset", "tiny", "--quiet", "--nproc", "2"])
        .args(["--dp", &dp.to_string(), "--zero", &zero.to_string()])
        .args(["--set", "train.steps=2", "--set", "train.micro_batch=2"])
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
                .join(format!("dp-checkpoint/rank-{r:05}/manifest.json"))
                .is_file());
        }
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
