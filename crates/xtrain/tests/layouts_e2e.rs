//! Every layout through the one command line, with real processes through the launcher:
//! the README's main command and `convert --to-hf` of its output; dp (ZeRO 0 and 3), tp × dp
//! with sequence parallelism and the single process agree; a checkpoint resumes at other
//! layouts (the resume failures users hit with the per-parallelism paths, now continuing the
//! training) and without repeating any flag; a step saved again at another layout replaces the
//! old one as a whole; `bench train` times any layout; impossible layouts are clear errors.
mod common;
use common::*;
use std::path::Path;
use std::process::Output;

/// Added to `FAST_RUN`: two sequences per micro-batch and a constant learning rate (so a run
/// cut in two follows the same schedule).
const SMALL: [&str; 4] = ["--set", "train.micro_batch=2", "--set", "train.min_lr=3e-3"];

/// `xtrain train` with the small settings, into `out`.
fn train(args: &[&str], out: &Path) -> Output {
    let out_s = out.to_str().unwrap();
    xtrain(
        &[
            &["train", "--quiet", "--out", out_s][..],
            &FAST_RUN,
            &SMALL,
            args,
        ]
        .concat(),
    )
}

#[test]
fn readme_main_command_then_convert_to_hf() {
    let d = tmp("layouts-readme");
    let run = d.join("run");
    // `cargo run --release -p xtrain -- train --preset tiny --nproc 2`, shortened, traced.
    let trace = d.join("trace.json");
    ok(&train(
        &[
            "--preset",
            "tiny",
            "--nproc",
            "2",
            "--set",
            "train.steps=3",
            "--trace",
            trace.to_str().unwrap(),
        ],
        &run,
    ));
    // The trace of a dp2 run: on each rank, per step one forward, one backward and one
    // optimizer action, every unit's backward, and the bucket reductions.
    let t: serde_json::Value = serde_json::from_slice(&std::fs::read(&trace).unwrap()).unwrap();
    let events = t["traceEvents"].as_array().unwrap();
    let count = |pid: u64, tid: u64, prefix: &str| {
        events
            .iter()
            .filter(|e| {
                e["ph"] == "X"
                    && e["pid"] == pid
                    && e["tid"] == tid
                    && e["name"].as_str().unwrap().starts_with(prefix)
            })
            .count()
    };
    for rank in 0..2 {
        assert_eq!(count(rank, 0, "OPTIMIZER"), 3, "rank {rank}: {t}");
        assert!(count(rank, 0, "0F0") == 3 && count(rank, 0, "0B0") == 3);
        // tiny: embedding, 2 blocks, head.
        assert_eq!(count(rank, 1, "unit "), 3 * 4, "rank {rank}");
        assert!(count(rank, 2, "bucket ") >= 3, "rank {rank}");
    }
    for f in [
        "config.toml",
        "metrics.jsonl",
        "loss.png",
        "loss.svg",
        "memory.json",
        "latest",
        "checkpoints/step_000003/manifest.json",
    ] {
        assert!(run.join(f).is_file(), "{f} missing");
    }
    let metrics = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap();
    assert_eq!(metrics.lines().count(), 3, "{metrics}");
    // One TensorBoard event file, from rank 0, with the data-parallel tags of a dp2 run
    // (tags travel as plain strings in the protobuf records; tests/tensorboard.rs decodes).
    let events: Vec<_> = std::fs::read_dir(&run)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.to_string_lossy().contains("events.out.tfevents."))
        .collect();
    assert_eq!(events.len(), 1, "{events:?}");
    let bytes = std::fs::read(&events[0]).unwrap();
    for tag in [
        "loss/train",
        "comm/dp_bytes_sent",
        "memory/rank1/peak_rss_mib",
    ] {
        assert!(
            bytes.windows(tag.len()).any(|w| w == tag.as_bytes()),
            "{tag} missing from {}",
            events[0].display()
        );
    }
    assert!(metrics.lines().last().unwrap().contains("\"val_loss\""));
    let memory: serde_json::Value =
        serde_json::from_slice(&std::fs::read(run.join("memory.json")).unwrap()).unwrap();
    assert_eq!(memory["ranks"].as_array().unwrap().len(), 2);
    // The export of the 2-process checkpoint holds exactly its consolidated weights.
    let hf = d.join("hf");
    ok(&xtrain(&[
        "convert",
        "--to-hf",
        run.to_str().unwrap(),
        hf.to_str().unwrap(),
    ]));
    let (cfg, model, params, _) = train::trainer::load_model(&run).unwrap();
    assert_eq!(cfg.parallel.nproc, 2);
    let exported = model::io::load_params(&model.layout, &hf.join("model.safetensors")).unwrap();
    assert!(exported
        .iter()
        .zip(&params)
        .all(|(a, b)| a.to_bits() == b.to_bits()));
    let config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(hf.join("config.json")).unwrap()).unwrap();
    assert_eq!(config["architectures"][0], "LlamaForCausalLM");
    let out = ok(&xtrain(&[
        "generate",
        "--ckpt",
        run.to_str().unwrap(),
        "--max-new-tokens",
        "5",
    ]));
    assert!(out.starts_with("the "), "{out}");
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn layouts_agree_with_the_single_process() {
    let d = tmp("layouts-agree");
    // The same global batch (4 sequences) everywhere: one process with 2 accumulation steps,
    // dp = 2 at ZeRO-0 and ZeRO-3, tp 2 × dp 2 with sequence parallelism at ZeRO-1, and
    // context parallelism (cp 2; cp 2 × dp 2 striped with all-gather attention).
    let steps = ["--set", "train.steps=3"];
    ok(&train(
        &[&steps[..], &["--set", "train.grad_accum=2"]].concat(),
        &d.join("single"),
    ));
    let want = losses(&d.join("single"));
    for (name, layout) in [
        ("dp2z0", &["--nproc", "2", "--zero", "0"][..]),
        ("dp2z3", &["--nproc", "2", "--zero", "3"]),
        (
            "tp2dp2sp",
            &["--nproc", "4", "--tp", "2", "--sp", "--zero", "1"],
        ),
        ("cp2", &["--cp", "2", "--set", "train.grad_accum=2"]),
        (
            "cp2dp2",
            &[
                "--cp",
                "2",
                "--dp",
                "2",
                "--cp-balance",
                "striped",
                "--cp-comm",
                "allgather",
            ],
        ),
    ] {
        let out = ok(&train(&[&steps[..], layout].concat(), &d.join(name)));
        assert!(out.starts_with("loss "), "{out}");
        close(&losses(&d.join(name)), &want, name);
    }
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn checkpoints_resume_at_any_layout() {
    let d = tmp("layouts-resume");
    let full = d.join("full");
    // Uninterrupted: 4 steps at dp = 2, checkpoints every 2 steps.
    let ckpt = ["--set", "train.steps=4", "--set", "train.ckpt_every=2"];
    ok(&train(&[&["--nproc", "2"][..], &ckpt].concat(), &full));
    let want = losses(&full)[2..].to_vec();
    let step2 = full.join("checkpoints/step_000002");
    let step2 = step2.to_str().unwrap();
    // The resumes that used to train a fresh model: dp → tp (dp 1), dp → tp + sp, and
    // dp → ZeRO-3 on one process; each continues at step 2 with the uninterrupted losses.
    for (name, layout) in [
        ("tp2", &["--nproc", "2", "--dp", "1", "--tp", "2"][..]),
        ("sp", &["--nproc", "2", "--tp", "2", "--sp"]),
        ("z3", &["--nproc", "1", "--zero", "3"]),
        ("cp2", &["--nproc", "2", "--dp", "1", "--cp", "2"]),
    ] {
        let run = d.join(name);
        let out = ok(&xtrain(
            &[
                &["train", "--out", run.to_str().unwrap(), "--resume", step2][..],
                layout,
            ]
            .concat(),
        ));
        assert!(out.contains("resumed at step 2"), "{name}: {out}");
        close(&losses(&run), &want, name);
    }
    // No flag at all: the saved layout (2 processes) continues the run directory's newest
    // checkpoint.
    let out = ok(&xtrain(&[
        "train",
        "--resume",
        full.to_str().unwrap(),
        "--set",
        "train.steps=5",
    ]));
    assert!(
        out.contains("resumed at step 4") && out.contains("dp=2"),
        "{out}"
    );
    assert!(full.join("checkpoints/step_000005/manifest.json").is_file());
    // Step 2 trained again at tp = 2 into the same run directory: its step-4 checkpoint is
    // replaced as a whole (one shard per tp rank, no dp-era files left beside them) and loads
    // at every layout.
    ok(&xtrain(&[
        "train",
        "--resume",
        step2,
        "--out",
        full.to_str().unwrap(),
        "--nproc",
        "2",
        "--tp",
        "2",
        "--set",
        "train.steps=4",
    ]));
    let step4 = full.join("checkpoints/step_000004");
    let manifest: serde_json::Value =
        serde_json::from_slice(&std::fs::read(step4.join("manifest.json")).unwrap()).unwrap();
    assert_eq!(manifest["mesh"]["tp"], 2);
    let files = manifest["files"].as_object().unwrap();
    let on_disk = std::fs::read_dir(&step4).unwrap().count();
    assert_eq!(
        on_disk,
        files.len() + 1,
        "only the listed files and the manifest"
    );
    for layout in [
        &["--nproc", "1", "--tp", "1"][..],
        &["--nproc", "2", "--tp", "1", "--zero", "2"],
    ] {
        let out = ok(&xtrain(
            &[
                &[
                    "train",
                    "--resume",
                    step4.to_str().unwrap(),
                    "--out",
                    d.join("again").to_str().unwrap(),
                    "--set",
                    "train.steps=5",
                ][..],
                layout,
            ]
            .concat(),
        ));
        assert!(out.contains("resumed at step 4"), "{out}");
    }
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn bench_train_times_any_layout() {
    for layout in [
        &["--nproc", "2", "--zero", "2"][..],
        &["--nproc", "2", "--tp", "2"],
    ] {
        let out = ok(&xtrain(
            &[
                &[
                    "bench",
                    "train",
                    "--preset",
                    "tiny",
                    "--threads",
                    "1",
                    "--steps",
                    "1",
                ][..],
                layout,
                &["--set", "model.seq_len=16", "--set", "train.micro_batch=2"],
            ]
            .concat(),
        ));
        assert!(out.contains("on 2 rank(s)"), "{out}");
        assert!(out.contains("MFU") && out.contains("median step"), "{out}");
    }
}

#[test]
fn impossible_layouts_are_clear_errors() {
    let d = tmp("layouts-bad");
    let out = d.join("x");
    for (args, want) in [
        (
            &["--nproc", "3", "--dp", "2"][..],
            "nproc = 3 but pp × dp × cp × tp = 1 × 2 × 1 × 1 = 2",
        ),
        (
            &["--nproc", "3", "--tp", "3"],
            "num_attention_heads = 4 is not divisible by tp = 3",
        ),
        (
            &["--pp", "3"],
            "cuts the model into 3 stages but model.num_layers = 2",
        ),
        (
            &["--pp", "2", "--schedule", "zb-x"],
            "unknown schedule `zb-x`",
        ),
        (
            &[
                "--pp",
                "2",
                "--schedule",
                "interleaved",
                "--virtual-stages",
                "2",
                "--microbatches",
                "3",
            ],
            "micro-batches (3) to be a multiple of pp (2)",
        ),
        (
            &[
                "--pp",
                "2",
                "--dp",
                "2",
                "--zero",
                "2",
                "--schedule",
                "dualpipe",
                "--microbatches",
                "4",
            ],
            "use ZeRO-0 or 1 with it",
        ),
        (&["--ep", "2", "--dp", "2"], "the model has no experts"),
        (
            &["--cp", "3"],
            "a sequence of 16 tokens does not split into 6 equal pieces",
        ),
        (
            &["--cp", "3", "--cp-balance", "striped"],
            "a sequence of 16 tokens does not split into 3 equal pieces",
        ),
        (
            &["--cp", "2", "--cp-balance", "halves"],
            "cp balance `halves` (expected none, zigzag or striped)",
        ),
        (
            &["--nproc", "3", "--tp", "2"],
            "not a multiple of pp × cp × tp = 2",
        ),
        (&["--sp"], "it needs tp > 1"),
    ] {
        let text = failed(&train(args, &out));
        assert!(text.contains(want), "{args:?}: {text}");
    }
    let text = failed(&xtrain(&["train", "--resume", "/nonexistent/run"]));
    assert!(text.contains("does not exist"), "{text}");
    let _ = std::fs::remove_dir_all(&d);
}
