//! Pipeline parallelism through the command line, with real processes: `xtrain schedule`
//! prints a schedule, its simulation and closed form, and writes its CSV and SVG; `xtrain
//! train --pp` runs generated schedules and that CSV file to the single process's losses, with
//! the measured bubble in `pipeline.json` and every action in the Chrome trace of `--trace`;
//! its checkpoint resumes at pp = 1 and at another schedule.
mod common;
use common::*;
use std::path::Path;

/// Added to `FAST_RUN`: a 4-layer tiny model (every pipeline stage of a V needs a layer), a
/// constant learning rate.
const SMALL: [&str; 8] = [
    "--set",
    "model.num_layers=4",
    "--set",
    "train.micro_batch=1",
    "--set",
    "train.min_lr=3e-3",
    "--set",
    "train.eval_batches=1",
];

fn train(args: &[&str], out: &Path) -> String {
    let out_s = out.to_str().unwrap();
    ok(&xtrain(
        &[
            &["train", "--quiet", "--out", out_s][..],
            &FAST_RUN,
            &SMALL,
            args,
        ]
        .concat(),
    ))
}

#[test]
fn schedule_command_shows_simulates_and_writes_csv_and_svg() {
    let d = tmp("pipeline-schedule");
    std::fs::create_dir_all(&d).unwrap();
    let (csv, svg) = (d.join("zb.csv"), d.join("zb.svg"));
    let text = ok(&xtrain(&[
        "schedule",
        "--schedule",
        "zb-h1",
        "--pp",
        "4",
        "--microbatches",
        "8",
        "--csv",
        csv.to_str().unwrap(),
        "--svg",
        svg.to_str().unwrap(),
    ]));
    // ZB-H1 with unit costs: makespan 3m + p − 1 = 27, bubble (p − 1)/27 = 11.1 % on every
    // rank; rank 0 holds p = 4 micro-batches' activations.
    assert!(text.contains("rank 3: 3F0 3I0 3F1 3I1"), "{text}");
    assert!(
        text.contains("bubble per rank: 11.1% 11.1% 11.1% 11.1%"),
        "{text}"
    );
    assert!(
        text.contains("peak activations per rank: [4, 3, 2, 1]"),
        "{text}"
    );
    assert!(
        text.contains("closed form (p−1)/(3m+p−1) = 11.1%"),
        "{text}"
    );
    let pic = std::fs::read_to_string(&svg).unwrap();
    assert!(
        pic.contains("<svg") && pic.contains("time (cost units)"),
        "labelled axes"
    );
    let back =
        parallel::pipeline_parallel::Schedule::from_csv(&std::fs::read_to_string(&csv).unwrap())
            .unwrap();
    assert_eq!(back.num_ranks(), 4);
    let cmp = ok(&xtrain(&[
        "schedule",
        "--compare",
        "--pp",
        "2",
        "--microbatches",
        "4",
    ]));
    for kind in [
        "gpipe",
        "1f1b",
        "interleaved",
        "zb-h1",
        "zb-h2",
        "zb-v",
        "dualpipev",
        "dualpipe",
    ] {
        assert!(cmp.lines().any(|l| l.starts_with(kind)), "{kind}: {cmp}");
    }
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn pipeline_runs_match_the_single_process_and_resume_anywhere() {
    let d = tmp("pipeline-train");
    let steps = ["--set", "train.steps=4"];
    let single = d.join("single");
    train(&[&steps[..], &["--microbatches", "4"]].concat(), &single);
    let want = losses(&single);
    // Generated schedules, 2 and 4 pipeline ranks, one with dp beside it at ZeRO-3.
    for (tag, args) in [
        ("1f1b", &["--pp", "2", "--microbatches", "4"][..]),
        (
            "zbv",
            &["--pp", "2", "--microbatches", "4", "--schedule", "zb-v"],
        ),
        (
            "interleaved",
            &[
                "--pp",
                "2",
                "--microbatches",
                "4",
                "--schedule",
                "interleaved",
                "--virtual-stages",
                "2",
            ],
        ),
        (
            "dualpipe",
            &["--pp", "2", "--microbatches", "4", "--schedule", "dualpipe"],
        ),
        (
            "gpipe-pp4",
            &["--pp", "4", "--microbatches", "4", "--schedule", "gpipe"],
        ),
        (
            "zbh1-dp2-zero3",
            &[
                "--pp",
                "2",
                "--dp",
                "2",
                "--zero",
                "3",
                "--microbatches",
                "2",
                "--schedule",
                "zb-h1",
            ],
        ),
    ] {
        let run = d.join(tag);
        train(&[&steps[..], args].concat(), &run);
        close(&losses(&run), &want, tag);
        let report: serde_json::Value =
            serde_json::from_slice(&std::fs::read(run.join("pipeline.json")).unwrap()).unwrap();
        let bubble = report["measured_median"].as_f64().unwrap();
        assert!((0.0..1.0).contains(&bubble), "{tag}: {report}");
        assert_eq!(report["measured"].as_array().unwrap().len(), 4, "{tag}");
    }
    // A schedule written by `xtrain schedule --csv` runs, with the Chrome trace.
    let csv = d.join("zbh2.csv");
    ok(&xtrain(&[
        "schedule",
        "--schedule",
        "zb-h2",
        "--pp",
        "2",
        "--microbatches",
        "4",
        "--csv",
        csv.to_str().unwrap(),
    ]));
    let (run, trace) = (d.join("csv"), d.join("trace.json"));
    let spec = format!("csv:{}", csv.display());
    train(
        &[
            &steps[..],
            &[
                "--pp",
                "2",
                "--microbatches",
                "4",
                "--schedule",
                &spec,
                "--trace",
                trace.to_str().unwrap(),
            ],
        ]
        .concat(),
        &run,
    );
    close(&losses(&run), &want, "csv");
    let t: serde_json::Value = serde_json::from_slice(&std::fs::read(&trace).unwrap()).unwrap();
    let events = t["traceEvents"].as_array().unwrap();
    // Every compute action of the 4 steps on both ranks: 2 stages × 4 micro-batches × (F, I,
    // W) per step.
    let compute = events
        .iter()
        .filter(|e| {
            let n = e["name"].as_str().unwrap_or("");
            e["ph"] == "X"
                && ["F", "I", "W"]
                    .iter()
                    .any(|k| n.len() > 1 && n[1..].starts_with(k))
        })
        .count();
    assert_eq!(compute, 4 * 2 * 4 * 3, "trace events");
    // The pp = 2 checkpoint continues at pp = 1 and under another schedule.
    let half = d.join("half");
    train(
        &["--set", "train.steps=2", "--pp", "2", "--microbatches", "4"],
        &half,
    );
    for (tag, args) in [
        ("to-single", &["--pp", "1"][..]),
        ("to-zbv", &["--pp", "2", "--schedule", "zb-v"]),
    ] {
        let run = d.join(tag);
        let from = half.to_str().unwrap();
        train(
            &[&["--resume", from, "--set", "train.steps=4"][..], args].concat(),
            &run,
        );
        close(&losses(&run), &want[2..], tag);
    }
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn a_deadlocking_schedule_is_refused_before_any_worker_starts() {
    let d = tmp("pipeline-dead");
    std::fs::create_dir_all(&d).unwrap();
    // Rank 0 waits in 0B0 for stage 1's input gradient of micro-batch 0, which rank 1 computes
    // only after 1F1, which needs rank 0's 0F1: a cycle.
    let csv = d.join("dead.csv");
    std::fs::write(&csv, "0F0,0B0,0F1,0B1\n1F0,1F1,1B0,1B1\n").unwrap();
    let spec = format!("csv:{}", csv.display());
    let o = xtrain(&[
        "train",
        "--quiet",
        "--out",
        d.join("run").to_str().unwrap(),
        "--pp",
        "2",
        "--microbatches",
        "2",
        "--schedule",
        &spec,
    ]);
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(!o.status.success() && !text.contains("panicked"), "{text}");
    assert!(
        text.contains("can never run: rank 0: 0B0 (waits for the input gradient 1I0); rank 1: 1F1 (waits for 0F1)"),
        "{text}"
    );
    assert!(
        !text.contains("[rank"),
        "refused before the workers start: {text}"
    );
    let _ = std::fs::remove_dir_all(&d);
}
