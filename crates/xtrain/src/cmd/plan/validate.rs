//! `xtrain plan --validate`: the planner against measured runs on this machine. For small and
//! medium at one process, dp2, tp2, pp2 and cp2 (and moe-small at ep2, the experts' layout),
//! each round calibrates this machine ([`super::calibrate`]), runs `xtrain bench train` (the
//! same command users run, as a child process), reads its JSON report, and predicts the
//! layout on the calibrated cluster, with expert parallelism at the expert load imbalance the
//! run had (the router decides it at run time). On a shared machine the cores' capacity
//! changes from minute to minute: validate on a quiet one. The table gives the medians and
//! ranges over the rounds; "RSS/pred" is rank 0's peak resident set over its predicted
//! resident bytes (account, backward workspace, process).
//!
//! With `--device cuda` the same on this machine's GPUs ([`super::calibrate_gpu`]): medium in
//! bf16 and fp32 on one GPU, and dp 2 / tp 2 where the machine has two; the memory column is
//! then the device's peak of live buffers over the predicted account.
use std::process::Command;

use anyhow::{bail, Context, Result};
use parallel::memory::human;
use parallel::plan::{evaluate, Conventions, Job, Layout};
use parallel::Precision;

use super::calibrate::median;

/// One validated layout: the preset, the bench flags, the planner's name for it.
struct Case {
    preset: &'static str,
    flags: &'static [&'static str],
    layout: &'static str,
}

/// The GPU cases: a [`Case`] (its flags after `--device cuda`) in a precision.
struct GpuCase {
    case: Case,
    precision: Precision,
}

const GPU_CASES: &[GpuCase] = &[
    GpuCase {
        case: Case {
            preset: "medium",
            flags: &["--set", "train.precision=\"bf16\""],
            layout: "dp1 mb4x1",
        },
        precision: Precision::Bf16,
    },
    GpuCase {
        case: Case {
            preset: "medium",
            flags: &["--set", "train.precision=\"fp32\""],
            layout: "dp1 mb4x1",
        },
        precision: Precision::Fp32,
    },
    GpuCase {
        case: Case {
            preset: "medium",
            flags: &["--nproc", "2", "--set", "train.precision=\"bf16\""],
            layout: "dp2 mb4x1",
        },
        precision: Precision::Bf16,
    },
    GpuCase {
        case: Case {
            preset: "medium",
            flags: &["--tp", "2", "--set", "train.precision=\"bf16\""],
            layout: "tp2 mb4x1",
        },
        precision: Precision::Bf16,
    },
];

const CASES: &[Case] = &[
    Case {
        preset: "small",
        flags: &[],
        layout: "dp1 mb8x1",
    },
    Case {
        preset: "small",
        flags: &["--nproc", "2"],
        layout: "dp2 mb8x1",
    },
    Case {
        preset: "small",
        flags: &["--tp", "2"],
        layout: "tp2 mb8x1",
    },
    Case {
        preset: "small",
        flags: &[
            "--pp",
            "2",
            "--schedule",
            "1f1b",
            "--microbatches",
            "4",
            "--set",
            "train.micro_batch=2",
        ],
        layout: "pp2 1f1b mb2x4",
    },
    Case {
        preset: "small",
        flags: &["--cp", "2"],
        layout: "cp2 mb8x1",
    },
    Case {
        preset: "moe-small",
        flags: &["--nproc", "2", "--ep", "2"],
        layout: "dp2 ep2 mb8x1",
    },
    Case {
        preset: "medium",
        flags: &[],
        layout: "dp1 mb4x1",
    },
    Case {
        preset: "medium",
        flags: &["--nproc", "2"],
        layout: "dp2 mb4x1",
    },
    Case {
        preset: "medium",
        flags: &["--tp", "2"],
        layout: "tp2 mb4x1",
    },
    Case {
        preset: "medium",
        flags: &[
            "--pp",
            "2",
            "--schedule",
            "1f1b",
            "--microbatches",
            "4",
            "--set",
            "train.micro_batch=1",
        ],
        layout: "pp2 1f1b mb1x4",
    },
    Case {
        preset: "medium",
        flags: &["--cp", "2"],
        layout: "cp2 mb4x1",
    },
];

/// What one round of a case gave.
struct Round {
    predicted_s: f64,
    measured_s: f64,
    predicted_bytes: u64,
    accounted_bytes: u64,
    /// Rank 0's predicted resident bytes (account, workspace, process).
    predicted_resident: u64,
    /// The run's expert imbalance the prediction used (expert parallelism only).
    imbalance: Option<f64>,
    peak_rss: Option<u64>,
}

fn bench(case: &Case, steps: usize, gpu: bool) -> Result<serde_json::Value> {
    let exe = std::env::current_exe()?;
    let device: &[&str] = if gpu { &["--device", "cuda"] } else { &[] };
    let out = Command::new(exe)
        .args([
            "bench",
            "train",
            "--preset",
            case.preset,
            "--json",
            "--steps",
        ])
        .arg(steps.to_string())
        .args(device)
        .args(case.flags)
        .output()
        .context("starting xtrain bench train")?;
    let text = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        bail!(
            "xtrain bench train --preset {} {}: {}\n{}",
            case.preset,
            case.flags.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let (a, b) = (text.find('{'), text.rfind('}'));
    let json = match (a, b) {
        (Some(a), Some(b)) if a < b => &text[a..=b],
        _ => bail!("no JSON report in the benchmark's output: {text}"),
    };
    Ok(serde_json::from_str(json)?)
}

/// One round of `case`: calibrated on this machine's cores, or (`gpu`: `Some(precision)`) on
/// its GPUs in that precision.
fn round(case: &Case, steps: usize, gpu: Option<Precision>) -> Result<Round> {
    let (model, preset) = super::resolve_model(case.preset)?;
    let (seq, _) = preset.context("a preset")?;
    let l: Layout = case.layout.parse()?;
    let cluster = match gpu {
        Some(p) => super::calibrate_gpu::this_gpus(&model, seq, l.micro_batch, l.world(), p)?,
        None => super::calibrate::this_machine(&model, seq, l.micro_batch, l.world())?,
    };
    let r = bench(case, steps, gpu.is_some())?;
    let num = |k: &str| r.get(k).and_then(|v| v.as_f64());
    // On a GPU the memory measured is the device's peak of live buffers.
    let peak = match gpu {
        Some(_) => r
            .pointer("/gpu/peak_live_bytes")
            .and_then(|v| v.as_f64())
            .map(|b| b as u64),
        None => num("peak_rss_bytes").map(|b| b as u64),
    };
    // The router's load is decided at run time: predicted at the imbalance the run had.
    let job = Job {
        model,
        seq_len: seq,
        global_batch: l.global_batch(),
        precision: gpu.unwrap_or(Precision::Fp32),
        gpu: cluster.gpu,
        conventions: Conventions::Xtrain,
        expert_imbalance: num("expert_imbalance").unwrap_or(1.0),
    };
    // The prediction is the calibration's alone, as a user planning here gets it (the
    // benchmark's own GEMM peak is the best of its steps, an optimistic denominator).
    let p = evaluate(&job, &cluster, &l)?;
    let account = p.ranks[0].account.total() as u64;
    Ok(Round {
        predicted_s: p.time.step_s,
        measured_s: num("median_step_s").context("median_step_s in the report")?,
        predicted_bytes: account,
        // A GPU's live buffers are the account alone (the process is on the host).
        predicted_resident: match gpu {
            Some(_) => account,
            None => p.ranks[0].resident() as u64,
        },
        imbalance: num("expert_imbalance"),
        accounted_bytes: num("accounted_bytes").unwrap_or(0.0) as u64,
        peak_rss: peak,
    })
}

fn range(v: &[f64]) -> (f64, f64) {
    v.iter()
        .fold((f64::MAX, f64::MIN), |(a, b), &x| (a.min(x), b.max(x)))
}

/// `xtrain plan --validate` on `device` (`cpu` or `cuda`).
pub fn run(rounds: usize, steps: usize, device: &str) -> Result<()> {
    if rounds == 0 || steps == 0 {
        bail!("--rounds and --steps must be at least 1");
    }
    let cases: Vec<(&Case, Option<Precision>)> = match device {
        "cpu" => CASES.iter().map(|c| (c, None)).collect(),
        d if d.starts_with("cuda") => {
            let gpus = tensor::cuda::device_count().context("counting this machine's GPUs")?;
            let mut cases = Vec::new();
            for c in GPU_CASES {
                let l: Layout = c.case.layout.parse()?;
                if l.world() <= gpus {
                    cases.push((&c.case, Some(c.precision)));
                } else {
                    println!(
                        "{} {} {}: needs {} GPUs, this machine has {gpus} (skipped)",
                        c.case.preset,
                        c.precision.name(),
                        c.case.layout,
                        l.world()
                    );
                }
            }
            cases
        }
        other => bail!("--device {other}: cpu or cuda"),
    };
    super::calibrate::process_baseline();
    let memory = if device == "cpu" {
        "RSS/pred"
    } else {
        "peak/pred"
    };
    println!(
        "{:<10} {:<6} {:<16} {:>22} {:>28} {:>8} {:>24} {:>9}",
        "preset",
        "format",
        "layout",
        "predicted s [range]",
        "measured s [range]",
        "error",
        "accounted pred / engine",
        memory
    );
    let mut worst: f64 = 0.0;
    for (case, gpu) in cases {
        let mut all = Vec::new();
        for _ in 0..rounds {
            all.push(round(case, steps, gpu)?);
        }
        let pred: Vec<f64> = all.iter().map(|r| r.predicted_s).collect();
        let meas: Vec<f64> = all.iter().map(|r| r.measured_s).collect();
        let (pm, mm) = (median(pred.clone()), median(meas.clone()));
        let (p0, p1) = range(&pred);
        let (m0, m1) = range(&meas);
        let err = pm / mm - 1.0;
        worst = worst.max(err.abs());
        let last = all.last().expect("a round");
        let ratios: Vec<f64> = all
            .iter()
            .filter_map(|r| Some(r.peak_rss? as f64 / r.predicted_resident as f64))
            .collect();
        let rss = if ratios.is_empty() {
            "-".to_string()
        } else {
            format!("{:.2}", median(ratios))
        };
        println!(
            "{:<10} {:<6} {:<16} {:>8.4} [{:.4}-{:.4}] {:>10.4} [{:.4}-{:.4}] {:>7.1}% {:>11} / {:<11} {:>9}",
            case.preset,
            gpu.unwrap_or(Precision::Fp32).name(),
            case.layout,
            pm,
            p0,
            p1,
            mm,
            m0,
            m1,
            100.0 * err,
            human(last.predicted_bytes),
            human(last.accounted_bytes),
            rss
        );
        let imbalance: Vec<f64> = all.iter().filter_map(|r| r.imbalance).collect();
        if !imbalance.is_empty() {
            println!(
                "{:<27} predicted at the runs' expert imbalance, median {:.2} (the busiest rank's routed rows over the mean)",
                "",
                median(imbalance)
            );
        }
    }
    println!("largest step-time error (medians): {:.1}%", 100.0 * worst);
    Ok(())
}
