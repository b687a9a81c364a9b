//! `xtrain plan` through the command line: a ranked table, JSON, the SVG chart, `--explain`
//! by rank and by name, a model that fits nowhere, and bad input named.
mod common;
use common::*;

const GPT3: [&str; 12] = [
    "plan",
    "--model",
    "gpt3-175b",
    "--cluster",
    "a100-80g",
    "--nodes",
    "8",
    "--global-batch",
    "64",
    "--seq-len",
    "2048",
    "--conventions=megatron",
];

#[test]
fn ranks_explains_and_draws() {
    let dir = tmp("plan-cli");
    std::fs::create_dir_all(&dir).unwrap();
    let svg = dir.join("memory.svg");
    let out = ok(&xtrain(
        &[&GPT3[..], &["--top", "3", "--svg", svg.to_str().unwrap()]].concat(),
    ));
    assert!(out.contains("tokens/s"), "{out}");
    assert_eq!(
        out.lines()
            .filter(|l| l.trim_start().starts_with(['1', '2', '3']))
            .count(),
        3,
        "{out}"
    );
    let chart = std::fs::read_to_string(&svg).unwrap();
    assert!(
        chart.contains("<svg") && chart.contains("memory per device"),
        "axis labels"
    );
    let json = ok(&xtrain(&[&GPT3[..], &["--top", "2", "--json"]].concat()));
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(v["feasible"].as_array().unwrap().len(), 2);
    assert!(v["feasible"][0]["time"]["tokens_per_s"].as_f64().unwrap() > 0.0);
    let first = v["feasible"][0]["layout"].as_str().unwrap().to_string();
    let by_rank = ok(&xtrain(&[&GPT3[..], &["--explain", "1"]].concat()));
    assert!(by_rank.starts_with(&first), "{by_rank}");
    let by_name = ok(&xtrain(
        &[
            &GPT3[..],
            &[
                "--explain",
                "tp8 pp8 dp1 sp interleaved/3 mb1x64 rc=selective",
            ],
        ]
        .concat(),
    ));
    assert!(by_name.contains("activations 12.35 GiB"), "{by_name}");
}

#[test]
fn a_model_that_fits_nowhere_and_bad_input() {
    let out = ok(&xtrain(&[
        "plan",
        "--model",
        "llama3-405b",
        "--cluster",
        "a100-80g",
        "--global-batch",
        "16",
        "--conventions",
        "megatron",
    ]));
    assert!(
        out.contains("nothing fits") && out.contains("devices"),
        "{out}"
    );
    let err = failed(&xtrain(&[
        "plan",
        "--model",
        "gpt-9",
        "--cluster",
        "a100-80g",
    ]));
    assert!(err.contains("unknown model `gpt-9`"), "{err}");
    let err = failed(&xtrain(&["plan", "--model", "tiny", "--cluster", "tpu-v9"]));
    assert!(err.contains("unknown cluster"), "{err}");
    let err = failed(&xtrain(&[
        "plan",
        "--model",
        "tiny",
        "--cluster",
        "a100-80g",
        "--explain",
        "tp3 warp9",
    ]));
    assert!(err.contains("layout token `warp9`"), "{err}");
    let err = failed(&xtrain(&[
        "plan",
        "--model",
        "tiny",
        "--cluster",
        "a100-80g",
        "--expert-imbalance",
        "0.5",
    ]));
    assert!(
        err.contains("--expert-imbalance must be at least 1"),
        "{err}"
    );
}

#[test]
fn this_machine_is_calibrated_by_a_worker_per_device() {
    // Two calibration workers run at once, one per device; the breakdown adds the backward's
    // workspace and the measured process to the engine's account.
    let out = ok(&xtrain(&[
        "plan",
        "--model",
        "tiny",
        "--devices",
        "2",
        "--precision",
        "fp32",
        "--explain",
        "dp2 mb8x1",
    ]));
    assert!(out.contains("2 devices"), "{out}");
    let line = out
        .lines()
        .find(|l| l.contains("backward workspace"))
        .unwrap_or_else(|| panic!("{out}"));
    assert!(
        line.contains("process") && line.ends_with("resident"),
        "{out}"
    );
}
