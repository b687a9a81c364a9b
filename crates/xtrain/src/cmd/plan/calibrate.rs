//! "This machine" as a planner cluster, calibrated in a few seconds: one worker process per
//! device, started together, each with its share of the cores (`xtrain plan
//! --calibrate-worker`), measures the fp32 GEMM peak of its thread budget and the share of it
//! one decoder layer's forward and backward reach (on the model being planned, with the
//! planner's own FLOP count as the numerator, so the efficiency means what the planner
//! multiplies by; each timing paired with a peak measurement taken right before it, so a
//! shared machine's changing load cancels out of the ratio), then the bandwidth of the
//! executor's optimizer phase over more than the last-level cache. Measured together, the ranks
//! share the cores' vector units, caches and memory bandwidth as they will in training. Then
//! the shared-memory link between two ranks (`xtrain bench comm` between two processes: alpha
//! from an 8-byte all-reduce, beta from a 2 MiB one), and the resident set of a process
//! before it builds a model.
use std::io::Write;
use std::process::{Command, Stdio};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use model::{Batch, Model, ModelConfig, StepOptions};
use parallel::plan::{evaluate, Cluster, Conventions, Job, Layout, Link};
use parallel::Precision;

/// Best of `n` timings of `f` (seconds), after one warm-up call.
fn best_of(n: usize, mut f: impl FnMut()) -> f64 {
    f();
    (0..n)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64()
        })
        .fold(f64::MAX, f64::min)
}

/// Share of the fp32 GEMM peak one layer of `cfg` reaches on `micro_batch` sequences of `seq`
/// tokens, and that peak: seven pairs of a peak measurement and a timed forward + backward,
/// back to back, the medians of the ratio and of the peak. The ratio of two measurements
/// taken together is what a shared machine's load changes least.
fn efficiency(cfg: &ModelConfig, seq: usize, micro_batch: usize) -> Result<(f64, f64)> {
    let mut one = cfg.clone();
    one.num_hidden_layers = 1;
    let model = Model::new(one.clone())?;
    let params = model.init_params(1);
    let mut grads = vec![0.0; params.len()];
    let n = micro_batch * seq;
    let ids: Vec<u32> = (0..n).map(|i| (i * 7919 % one.vocab_size) as u32).collect();
    let targets: Vec<i64> = ids
        .iter()
        .map(|&t| ((t as usize + 1) % one.vocab_size) as i64)
        .collect();
    let batch = Batch::new(micro_batch, seq, ids, targets)?;
    let opts = StepOptions::default();
    let flops = layer_flops(&one, seq, micro_batch)?;
    let mut step = || {
        tensor::threads::install(|| {
            model.forward_backward(&params, &mut grads, &batch, &opts, &mut |_| {})
        })
    };
    step()?; // warm-up
    let (mut ratios, mut peaks) = (Vec::new(), Vec::new());
    for _ in 0..7 {
        let peak = train::run::gemm_peak_flops();
        let t = Instant::now();
        step()?;
        let secs = t.elapsed().as_secs_f64();
        ratios.push(flops / secs / peak);
        peaks.push(peak);
    }
    Ok((median(ratios).clamp(1e-3, 1.0), median(peaks)))
}

/// The planner's FLOPs of a forward and backward of `one` (a one-layer model) on
/// `micro_batch` sequences of `seq`: its compute seconds at a peak of 1 FLOP/s, efficiency 1.
pub(super) fn layer_flops(one: &ModelConfig, seq: usize, micro_batch: usize) -> Result<f64> {
    let job = Job {
        model: one.clone(),
        seq_len: seq,
        global_batch: micro_batch,
        precision: Precision::Fp32,
        gpu: false,
        conventions: Conventions::Xtrain,
        expert_imbalance: 1.0,
    };
    let unit = Link {
        latency: 0.0,
        bandwidth: 1e12,
    };
    let ideal = Cluster::calibrated(1, 1 << 40, 1.0, 1.0, 1e12, unit);
    Ok(evaluate(&job, &ideal, &Layout::single(micro_batch))?
        .time
        .compute_s)
}

/// The middle value (the upper one of an even count); `v` must not be empty.
pub(super) fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Bytes/s of this engine's optimizer step as the planner counts it (36 bytes per parameter):
/// the timed phases are the ones the executor runs per step — the gradient norm, the clip's
/// scaling, AdamW, the zeroing of the gradients for the next step — over 16 Mi parameters
/// (256 MiB of weights, gradients and moments, more than a server CPU's last-level cache
/// holds: training finds its optimizer states evicted by the activations).
pub(super) fn memory_bandwidth() -> f64 {
    let n = 1 << 24;
    let (mut p, mut g, mut m, mut v) = (
        vec![0.1f32; n],
        vec![0.01f32; n],
        vec![0.0; n],
        vec![0.0; n],
    );
    let adamw = model::AdamW::default();
    let t = best_of(3, || {
        tensor::threads::install(|| {
            std::hint::black_box(model::optim::grad_sq_sum(&g));
            model::optim::scale_grads(&mut g, 0.5);
            adamw.update(1, 1e-3, 0.0, &mut p, &g, &mut m, &mut v);
            g.fill(0.01);
        })
    });
    36.0 * n as f64 / t
}

/// Alpha and beta of the shared-memory link between two ranks: `xtrain bench comm` (two
/// worker processes, the transport training uses) all-reducing 8 bytes and 2 MiB.
pub(super) fn link() -> Result<Link> {
    let out = Command::new(std::env::current_exe()?)
        .args([
            "bench",
            "comm",
            "--nproc",
            "2",
            "--transport",
            "shm",
            "--min",
            "8",
        ])
        .args([
            "--max", "2M", "--factor", "262144", "--iters", "10", "--json",
        ])
        .output()
        .context("starting xtrain bench comm")?;
    if !out.status.success() {
        bail!(
            "xtrain bench comm: {}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let v: serde_json::Value =
        serde_json::from_slice(&out.stdout).context("the JSON report of xtrain bench comm")?;
    let rows = v["rows"].as_array().context("rows in the comm report")?;
    let row = |i: usize| -> Result<(f64, f64)> {
        let r = rows.get(i).context("a row of the comm report")?;
        let bytes = r["bytes"].as_f64().context("bytes")?;
        let us = r["time_us"].as_f64().context("time_us")?;
        Ok((bytes, us * 1e-6))
    };
    let ((_, small), (bytes, large)) = (row(0)?, row(rows.len().saturating_sub(1))?);
    // n = 2: all-reduce = 2α + B/β.
    let latency = small / 2.0;
    Ok(Link {
        latency,
        bandwidth: bytes / (large - small).max(1e-6),
    })
}

/// Bytes of RAM on this machine (`MemTotal`), or 16 GiB where unknown.
pub(super) fn total_memory() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| {
            let line = s.lines().find(|l| l.starts_with("MemTotal:"))?.to_string();
            line.split_whitespace().nth(1)?.parse::<u64>().ok()
        })
        .map_or(16 << 30, |kib| kib * 1024)
}

/// The resident bytes of this process the first time it is asked, before the calibration
/// (or a `--validate` round) allocated anything: the binary, libraries and runtime a rank's
/// process holds besides its model, buffers and workspace.
pub fn process_baseline() -> u64 {
    static FIRST: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *FIRST.get_or_init(|| parallel::memory::proc_status_bytes("VmRSS:").unwrap_or(0))
}

/// What one calibration worker measured: the share of its GEMM peak a layer reaches, and
/// that peak (FLOP/s of its thread budget while every worker ran).
#[derive(serde::Serialize, serde::Deserialize)]
struct WorkerReport {
    efficiency: f64,
    peak_flops: f64,
    /// The bytes/s of its optimizer phase ([`memory_bandwidth`]), measured after the
    /// efficiency.
    memory_bandwidth: f64,
}

/// `xtrain plan --calibrate-worker MB --seq-len S`: reads the model (a `config.json` text)
/// from standard input, measures [`efficiency`] at `MB` sequences of `S` tokens with this
/// process's thread budget (`XTRAIN_THREADS`), and prints a [`WorkerReport`] as JSON.
pub fn worker(seq: usize, micro_batch: usize) -> Result<()> {
    let mut text = String::new();
    std::io::Read::read_to_string(&mut std::io::stdin(), &mut text)?;
    let cfg = ModelConfig::from_json_str(&text)?;
    train::allocator::reuse_freed_memory();
    let (efficiency, peak_flops) = efficiency(&cfg, seq, micro_batch)?;
    let memory_bandwidth = memory_bandwidth();
    println!(
        "{}",
        serde_json::to_string(&WorkerReport {
            efficiency,
            peak_flops,
            memory_bandwidth,
        })?
    );
    Ok(())
}

/// The efficiency, one device's GEMM peak and its memory bandwidth as `devices` ranks of
/// `threads` threads see them together: a worker process per device, started at once; the
/// medians over them.
fn measure_together(
    cfg: &ModelConfig,
    seq: usize,
    micro_batch: usize,
    devices: usize,
    threads: usize,
) -> Result<(f64, f64, f64)> {
    let exe = std::env::current_exe()?;
    let mut children = Vec::with_capacity(devices);
    for _ in 0..devices.max(1) {
        let mut child = Command::new(&exe)
            .args(["plan", "--calibrate-worker"])
            .arg(micro_batch.to_string())
            .arg("--seq-len")
            .arg(seq.to_string())
            .env(tensor::threads::THREADS_ENV, threads.to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .context("starting a calibration worker (xtrain plan --calibrate-worker)")?;
        child
            .stdin
            .take()
            .context("the worker's standard input")?
            .write_all(cfg.to_json_string().as_bytes())?;
        children.push(child);
    }
    let (mut effs, mut peaks, mut bws) = (Vec::new(), Vec::new(), Vec::new());
    for child in children {
        let out = child.wait_with_output()?;
        if !out.status.success() {
            bail!(
                "calibration worker: {}\n{}",
                out.status,
                String::from_utf8_lossy(&out.stderr)
            );
        }
        let r: WorkerReport = serde_json::from_slice(&out.stdout)
            .context("the JSON report of a calibration worker")?;
        effs.push(r.efficiency);
        peaks.push(r.peak_flops);
        bws.push(r.memory_bandwidth);
    }
    Ok((median(effs), median(peaks), median(bws)))
}

/// This machine as a cluster of `devices` ranks (threads: the cores over the ranks), for
/// the model `cfg` at `micro_batch` sequences of `seq`. A device's peak is what one rank's
/// thread budget reaches while every rank computes ([`measure_together`]), not what it
/// reaches alone: the ranks share the cores' vector units (on a VM two vCPUs may be one
/// core's two hyperthreads, and one thread alone then reaches nearly the whole core's peak).
pub fn this_machine(
    cfg: &ModelConfig,
    seq: usize,
    micro_batch: usize,
    devices: usize,
) -> Result<Cluster> {
    let process = process_baseline();
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let threads = (cores / devices.max(1)).max(1);
    // More devices than cores: one worker per core, whose peak the devices then share.
    let workers = devices.clamp(1, cores);
    let (eff, worker_peak, worker_bw) = measure_together(cfg, seq, micro_batch, workers, threads)?;
    let share = workers as f64 / devices.max(1) as f64;
    let link = link()?;
    let mut cluster = Cluster::calibrated(
        devices,
        total_memory() / devices.max(1) as u64,
        worker_peak * share,
        eff,
        worker_bw * share,
        link,
    );
    cluster.process_bytes = process;
    // The shared-memory transport maps a ring each way per peer of a group.
    cluster.group_peer_bytes = 2 * comm::Options::default().shm_ring_bytes as u64;
    Ok(cluster)
}
