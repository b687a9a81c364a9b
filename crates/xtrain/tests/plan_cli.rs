//! `xtrain plan` through the command line: a ranked table, JSON, the SVG chart, `--explain`
//! by rank and by name, a model that fits nowhere, optimizer offload on a cluster JSON with a
//! host side, and bad input named.
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

/// One H100-80G with 128 GB of host memory (PCIe Gen5, two sockets' CPU AdamW).
const ONE_H100: &str = r#"{"name": "one H100", "nodes": 1, "devices_per_node": 1,
  "memory_bytes": 85899345920, "peak_flops_16": 989e12, "peak_flops_32": 495e12,
  "efficiency": 0.65, "memory_bandwidth": 3.35e12,
  "intra": {"latency": 4e-6, "bandwidth": 360e9}, "inter": {"latency": 8e-6, "bandwidth": 46e9},
  "host": {"memory_bytes": 128000000000, "link": {"latency": 1e-5, "bandwidth": 50e9},
           "adam_params_per_s": 4e9}}"#;

#[test]
fn offload_fits_a_7b_model_on_one_h100() {
    let dir = tmp("plan-offload");
    std::fs::create_dir_all(&dir).unwrap();
    let cluster = dir.join("one-h100.json");
    std::fs::write(&cluster, ONE_H100).unwrap();
    let base = [
        "plan",
        "--model",
        "llama2-7b",
        "--cluster",
        cluster.to_str().unwrap(),
        "--global-batch",
        "8",
        "--seq-len",
        "2048",
    ];
    let out = ok(&xtrain(&base));
    assert!(out.contains("host memory per device"), "{out}");
    let first = out
        .lines()
        .find(|l| l.trim_start().starts_with("1 "))
        .unwrap_or_else(|| panic!("{out}"));
    // The delayed update hides the CPU's AdamW behind the next step: first.
    assert!(first.contains("offload=delayed"), "{out}");
    // The host column: 14 bytes per parameter of the whole model, ~88 GiB; 2 more for the
    // delayed update's held gradients.
    for (offload, per) in [("delayed", 16), ("optimizer", 14)] {
        let only = ["--top", "1", "--json", "--offload", offload];
        let json = ok(&xtrain(&[&base[..], &only].concat()));
        let v: serde_json::Value = serde_json::from_str(&json).unwrap();
        let best = &v["feasible"][0];
        let params = best["ranks"][0]["params"].as_u64().unwrap();
        assert_eq!(best["host"].as_u64().unwrap(), per * params, "{offload}");
        assert_eq!(best["peak"]["master"].as_u64().unwrap(), 0);
    }
    let explained = ok(&xtrain(&[&base[..], &["--explain", "1"]].concat()));
    assert!(
        explained.contains("host: fp32 master") && explained.contains("on the host's CPUs"),
        "{explained}"
    );
    // The cluster saved as JSON and read back plans the same (the first line, which times the
    // search, aside).
    let ranked = |s: &str| s.lines().skip(1).collect::<Vec<_>>().join("\n");
    let saved = dir.join("saved.json");
    let again = ok(&xtrain(
        &[&base[..], &["--save-cluster", saved.to_str().unwrap()]].concat(),
    ));
    assert_eq!(ranked(&again), ranked(&out));
    let reread = [&base[..4], &[saved.to_str().unwrap()], &base[5..]].concat();
    assert_eq!(ranked(&ok(&xtrain(&reread))), ranked(&out));
    let unwritable = dir.join("no-such-dir").join("c.json");
    let err = failed(&xtrain(
        &[&base[..], &["--save-cluster", unwritable.to_str().unwrap()]].concat(),
    ));
    assert!(err.contains("writing the cluster"), "{err}");
    let on_device = ok(&xtrain(&[&base[..], &["--offload", "none"]].concat()));
    assert!(on_device.contains("nothing fits"), "{on_device}");
    let err = failed(&xtrain(&[&base[..], &["--offload", "disk"]].concat()));
    assert!(err.contains("offload `disk`"), "{err}");
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

/// `--cluster this --device cuda` calibrates this host's GPUs; without a GPU it is an error
/// naming what is missing (never a CPU calibration in its place), and an unknown device is
/// named. (On a GPU the calibration runs in `scripts/gpu-check.sh`.)
#[test]
fn calibrating_gpus_without_one_is_a_clear_error() {
    if tensor::buf::Dev::open("cuda").is_ok() {
        return;
    }
    let err = failed(&xtrain(&[
        "plan",
        "--model",
        "tiny",
        "--cluster",
        "this",
        "--device",
        "cuda",
    ]));
    assert!(err.contains("GPUs") && err.contains("libcuda"), "{err}");
    let err = failed(&xtrain(&[
        "plan",
        "--model",
        "tiny",
        "--cluster",
        "this",
        "--device",
        "tpu",
    ]));
    assert!(err.contains("--device tpu: cpu or cuda"), "{err}");
    // Validating on GPUs without one: the same cause, before any benchmark starts.
    let err = failed(&xtrain(&["plan", "--validate", "--device", "cuda"]));
    assert!(err.contains("GPUs") && err.contains("libcuda"), "{err}");
    let err = failed(&xtrain(&["plan", "--validate", "--device", "tpu"]));
    assert!(err.contains("--device tpu: cpu or cuda"), "{err}");
}
