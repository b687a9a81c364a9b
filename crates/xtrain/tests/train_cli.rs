//! The trainer's subcommands end to end through the real binary: train, resume, convert both
//! ways, generate, tokenize, and clear errors for bad arguments.
use std::path::PathBuf;
use std::process::Command;

fn xtrain(args: &[&str]) -> (bool, String) {
    xtrain_env(args, &[])
}

fn xtrain_env(args: &[&str], env: &[(&str, &str)]) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_xtrain"))
        .args(args)
        .env("RUST_BACKTRACE", "0")
        .env_remove("XTRAIN_ISA")
        .envs(env.iter().copied())
        .output()
        .unwrap();
    (
        out.status.success(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}

fn tmp(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("xtrain-cli-train-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

#[test]
fn train_resume_convert_generate() {
    let d = tmp("run");
    let run = d.join("run");
    let r = run.to_str().unwrap();
    let small = [
        "--set",
        "data.corpus_bytes=60000",
        "--set",
        "train.sample_tokens=20",
        "--quiet",
    ];
    let (ok, out) = xtrain(
        &[
            &[
                "train",
                "--preset",
                "tiny",
                "--out",
                r,
                "--set",
                "train.steps=6",
            ][..],
            &small,
        ]
        .concat(),
    );
    assert!(ok, "{out}");
    assert!(out.contains("loss "), "{out}");
    for f in [
        "metrics.jsonl",
        "loss.png",
        "loss.svg",
        "config.toml",
        "latest",
    ] {
        assert!(run.join(f).exists(), "{f}");
    }
    let events = std::fs::read_dir(&run)
        .unwrap()
        .filter(|e| {
            let name = e.as_ref().unwrap().file_name();
            name.to_string_lossy().starts_with("events.out.tfevents.")
        })
        .count();
    assert_eq!(events, 1, "one TensorBoard event file");
    let (ok, out) = xtrain(
        &[
            &["train", "--resume", r, "--set", "train.steps=8"][..],
            &small,
        ]
        .concat(),
    );
    assert!(ok, "{out}");
    assert!(run.join("checkpoints/step_000008/manifest.json").exists());
    assert_eq!(
        std::fs::read_to_string(run.join("metrics.jsonl"))
            .unwrap()
            .lines()
            .count(),
        8
    );
    let hf = d.join("hf");
    let (ok, out) = xtrain(&["convert", "--to-hf", r, hf.to_str().unwrap()]);
    assert!(ok, "{out}");
    let back = d.join("back");
    let (ok, out) = xtrain(&[
        "convert",
        "--from-hf",
        hf.to_str().unwrap(),
        back.to_str().unwrap(),
        "--set",
        "data.corpus_bytes=60000",
    ]);
    assert!(ok, "{out}");
    let (ok, out) = xtrain(&[
        "generate",
        "--ckpt",
        back.to_str().unwrap(),
        "--prompt",
        "the ",
        "--max-new-tokens",
        "10",
        "--seed",
        "1",
    ]);
    assert!(ok && out.starts_with("the "), "{out}");
    // The imported checkpoint continues at another layout: tensor parallel on 2 processes.
    let (ok, out) = xtrain(&[
        "train",
        "--resume",
        back.to_str().unwrap(),
        "--nproc",
        "2",
        "--tp",
        "2",
        "--out",
        d.join("tp").to_str().unwrap(),
        "--set",
        "train.steps=1",
        "--set",
        "train.sample_tokens=0",
    ]);
    assert!(ok && out.contains("tp=2") && out.contains("loss "), "{out}");
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn tokenize_then_train_on_the_token_file() {
    let d = tmp("tok");
    let text = d.join("a.txt");
    std::fs::write(&text, train::data::corpus::generate(9, 30_000)).unwrap();
    let tok = d.join("a.tok");
    let (ok, out) = xtrain(&[
        "tokenize",
        text.to_str().unwrap(),
        "-o",
        tok.to_str().unwrap(),
    ]);
    assert!(ok, "{out}");
    let (ok, out) = xtrain(&[
        "train",
        "--preset",
        "tiny",
        "--data",
        tok.to_str().unwrap(),
        "--out",
        d.join("run").to_str().unwrap(),
        "--set",
        "train.steps=2",
        "--set",
        "train.sample_tokens=0",
        "--quiet",
    ]);
    assert!(ok, "{out}");
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn bad_arguments_are_clear_errors() {
    let (ok, out) = xtrain(&["train", "--set", "train.lrr=1"]);
    assert!(!ok && out.contains("unknown key `train.lrr`"), "{out}");
    let (ok, out) = xtrain(&["train", "--preset", "huge"]);
    assert!(!ok && out.contains("unknown preset"), "{out}");
    let (ok, out) = xtrain(&["train", "--data", "/nonexistent/x.tok"]);
    assert!(!ok && out.contains("does not exist"), "{out}");
    let (ok, out) = xtrain(&["generate", "--ckpt", "/nonexistent"]);
    assert!(!ok && out.contains("checkpoint"), "{out}");
    assert!(!out.contains("panicked"), "{out}");
    let (ok, out) = xtrain_env(&["schedule"], &[("XTRAIN_ISA", "sse9")]);
    assert!(
        !ok && out.contains("XTRAIN_ISA") && !out.contains("panicked"),
        "{out}"
    );
    // NCCL serves GPU ranks only; an unknown backend is named.
    let steps = [
        "train",
        "--set",
        "train.steps=1",
        "--set",
        "data.corpus_bytes=20000",
    ];
    let (ok, out) = xtrain_env(&steps, &[("XTRAIN_BACKEND", "nccl")]);
    assert!(
        !ok && out.contains("XTRAIN_BACKEND=nccl") && out.contains("--device cuda"),
        "{out}"
    );
    let (ok, out) = xtrain_env(&steps, &[("XTRAIN_BACKEND", "gloo")]);
    assert!(!ok && out.contains("own, mpi or nccl"), "{out}");
}

/// Every layout that cannot work is refused before any worker starts (no `[rank R]` line),
/// naming the constraint: ep not dividing the experts, ep on a dense model, tp not dividing
/// the heads, more pipeline stages than layers; and `--schedule interleaved` without
/// `--virtual-stages` runs with 2, as `xtrain schedule` does.
#[test]
fn layout_errors_come_before_launch_and_interleaved_defaults_to_two_stages() {
    for (args, says) in [
        (
            &["--preset", "moe-small", "--nproc", "3", "--ep", "3"][..],
            "not divisible by ep = 3",
        ),
        (
            &["--preset", "tiny", "--nproc", "2", "--ep", "2"],
            "no experts",
        ),
        (
            &["--preset", "tiny", "--tp", "8"],
            "not divisible by tp = 8",
        ),
        (
            &[
                "--preset",
                "tiny",
                "--pp",
                "2",
                "--schedule",
                "interleaved",
                "--microbatches",
                "4",
            ],
            "cuts the model into 4 stages but model.num_layers = 2",
        ),
    ] {
        let (ok, out) = xtrain(&[&["train", "--quiet"][..], args].concat());
        assert!(!ok && out.contains(says), "{args:?}: {out}");
        assert!(!out.contains("[rank"), "{args:?}: a worker started:\n{out}");
    }
    let d = std::env::temp_dir().join(format!("xtrain-cli-interleaved-{}", std::process::id()));
    let (ok, out) = xtrain(&[
        "train",
        "--quiet",
        "--preset",
        "tiny",
        "--pp",
        "2",
        "--schedule",
        "interleaved",
        "--microbatches",
        "4",
        "--set",
        "model.num_layers=4",
        "--set",
        "train.steps=1",
        "--out",
        d.to_str().unwrap(),
    ]);
    assert!(ok, "{out}");
    let _ = std::fs::remove_dir_all(&d);
}

/// `XTRAIN_ISA` forces the kernels' path for a whole run, and `bench train` names the CPU and
/// every kernel's path.
#[test]
fn bench_train_reports_the_forced_kernel_path() {
    let (ok, text) = xtrain_env(
        &[
            "bench",
            "train",
            "--preset",
            "tiny",
            "--threads",
            "1",
            "--steps",
            "1",
        ],
        &[("XTRAIN_ISA", "portable")],
    );
    assert!(ok, "{text}");
    assert!(text.contains("CPU "), "{text}");
    let forced = text.contains("kernels portable (forced by XTRAIN_ISA")
        || text.contains("kernels portable (detected)");
    assert!(forced && text.contains("RMSNorm portable"), "{text}");
}

/// The bound: peak RSS within 1.5× of the byte account. Preset small at 2 threads shows
/// a per-thread malloc arena clearly (1.98× with glibc's default arenas, 1.19× with the one
/// arena `train::allocator::use_one_arena` keeps), in about a second.
#[test]
fn bench_train_peak_rss_stays_within_one_and_a_half_accounts() {
    let (ok, text) = xtrain(&[
        "bench",
        "train",
        "--preset",
        "small",
        "--threads",
        "2",
        "--steps",
        "1",
    ]);
    assert!(ok, "{text}");
    let ratio: f64 = text
        .split("peak RSS")
        .nth(1)
        .and_then(|s| s.split('(').nth(1))
        .and_then(|s| s.split('x').next())
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or_else(|| panic!("no peak RSS ratio in:\n{text}"));
    assert!(ratio < 1.5, "peak RSS {ratio}x the account:\n{text}");
}

/// `xtrain bench kernels` on the CPU: attention and the product at the tiny preset's shapes,
/// each a positive rate, and their ratio; with `--doc-len 16` attention over packed documents
/// too, and the share of the causal pairs its mask leaves (16·17/2 a document, four of them,
/// of 64·65/2: 0.26); `--nproc` and `--doc-len 0` are refused.
#[test]
fn bench_kernels_reports_attention_against_the_product() {
    let (ok, text) = xtrain(&[
        "bench",
        "kernels",
        "--preset",
        "tiny",
        "--reps",
        "2",
        "--doc-len",
        "16",
    ]);
    assert!(ok, "{text}");
    assert!(
        text.contains("attention over packed documents of 16 tokens: forward")
            && text.contains("for 0.26 of its pairs"),
        "{text}"
    );
    let rate = |after: &str| -> f64 {
        text.split(after)
            .nth(1)
            .and_then(|s| s.split('(').nth(1))
            .and_then(|s| s.split(" GFLOP/s").next())
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or_else(|| panic!("no rate after {after:?} in:\n{text}"))
    };
    assert!(rate("forward") > 0.0 && rate("backward") > 0.0, "{text}");
    assert!(rate("up projection):") > 0.0, "{text}");
    assert!(text.contains("head 16, seq 64, causal"), "{text}");
    assert!(text.contains("time per FLOP / the product's: "), "{text}");
    let (ok, text) = xtrain(&["bench", "kernels", "--preset", "tiny", "--nproc", "2"]);
    assert!(!ok && text.contains("one process"), "{text}");
    let (ok, text) = xtrain(&["bench", "kernels", "--preset", "tiny", "--doc-len", "0"]);
    assert!(!ok && text.contains("at least 1 token"), "{text}");
}
