//! `xtrain bench train`: steady-state step time, tokens/s and MFU of a preset on this machine,
//! on any layout (the same trainer as `xtrain train`), plus peak RSS against the memory
//! account. MFU has one definition everywhere: `6N + 12·L·H·S` FLOPs per token times tokens/s
//! over the measured peak of all the cores the job uses (every rank's, summed).
use crate::config::RunConfig;
use crate::error::Result;
use crate::run::{gemm_peak_flops, job_peak_flops};
use crate::trainer::Trainer;
use comm::Communicator;
use parallel::memory::{human, peak_rss_bytes};
use std::time::Instant;

/// Benchmark figures.
#[derive(Clone, Debug, serde::Serialize)]
pub struct BenchReport {
    pub preset: String,
    /// The layout (`pp=… dp=… cp=… tp=… ep=… ZeRO-k`).
    pub layout: String,
    /// Processes of the job.
    pub ranks: usize,
    /// Kernel threads per rank.
    pub threads: usize,
    /// The CPU model and the path of every dispatched kernel ([`tensor::isa::describe`]).
    pub kernels: String,
    pub params: usize,
    pub tokens_per_step: usize,
    pub median_step_s: f64,
    pub tokens_per_s: f64,
    pub flops_per_token: f64,
    pub achieved_gflops: f64,
    /// The fp32 GEMM peak of all the job's cores (every rank's with its thread budget, summed;
    /// best of one sample per timed step).
    pub gemm_peak_gflops: f64,
    /// Achieved FLOP/s over [`Self::gemm_peak_gflops`].
    pub mfu: f64,
    /// The cores' f32 FMA ceiling ([`tensor::peak`]: a register-only FMA loop on each rank's
    /// threads, summed over ranks, best of one sample per timed step), `None` without vector
    /// FMA. The usual MFU denominator (hardware peak), measured because a VM does not tell
    /// its clock.
    pub fma_peak_gflops: Option<f64>,
    /// Rank 0's accounted bytes (its model states and the peaks of its transient buffers).
    pub accounted_bytes: u64,
    /// Of which in host memory while training on a GPU (the optimizer state under
    /// ZeRO-Offload).
    pub offloaded_bytes: u64,
    /// ZeRO-Offload's page-locked host buffers beside it (the landed gradients, the upload
    /// stages).
    pub offload_pinned_bytes: u64,
    pub peak_rss_bytes: Option<u64>,
    /// Seconds per step in each model kernel class and the optimizer's update, and the rest
    /// ("other": precision conversions, gradient norms, data, glue), from the profile timers.
    pub profile: Vec<(String, f64)>,
    /// The profile comes from one extra step with the GPU synchronised around every kernel
    /// class ([`model::profile::synchronize_with`]), not from the timed steps.
    pub profile_synchronized: bool,
    /// Share of the machine's CPU time the hypervisor gave to other guests ("steal") while
    /// the timed steps ran (Linux `/proc/stat`; `None` elsewhere). On a shared VM this is what
    /// makes the same binary 25–40 % slower from one minute to the next.
    pub cpu_steal: Option<f64>,
    /// With expert parallelism: how unevenly the router loaded the ranks' experts, the mean
    /// over the timed steps of [`crate::trainer::ExpertLoad::ep_imbalance`] (1 = balanced).
    /// The all-to-alls wait for the busiest rank.
    pub expert_imbalance: Option<f64>,
    /// With ZeRO-Offload's delayed update: the medians over the timed steps of its host
    /// AdamW's seconds beside the step and of the seconds the step waited for it.
    pub delayed_update: Option<(f64, f64)>,
    /// With pipeline parallelism: the measured bubble beside the simulator's.
    pub pipeline: Option<crate::pipeline::PipelineReport>,
    /// With context parallelism: each rank's attention compute and exposed ring wait, seconds
    /// per step, by world rank.
    pub context: Option<Vec<(f64, f64)>>,
    /// On a GPU: the device, the bytes of xtrain's live buffers at their peak (the caching
    /// allocator's count) and the bytes the device had in use at the end (`cuMemGetInfo`:
    /// total − free, the allocator's cache and the CUDA context included).
    pub gpu: Option<GpuMemory>,
    /// On a GPU: one more step with every kernel, product and copy of the compute stream
    /// bracketed by timing events ([`tensor::cuda::timeline`]): device time by name.
    pub gpu_kernels: Option<GpuKernels>,
}

/// Device time of one step by kernel ([`BenchReport::gpu_kernels`]).
#[derive(Clone, Debug, serde::Serialize)]
pub struct GpuKernels {
    /// The step's wall time (the queue running as in training: no waits between kernels).
    pub step_s: f64,
    /// `(name, calls, seconds)`, longest first.
    pub kernels: Vec<(String, usize, f64)>,
}

/// Names of [`GpuKernels`] printed one a line; the rest are summed in one line.
const KERNEL_LINES: usize = 15;

impl std::fmt::Display for GpuKernels {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let busy: f64 = self.kernels.iter().map(|k| k.2).sum();
        let calls: usize = self.kernels.iter().map(|k| k.1).sum();
        write!(
            f,
            "GPU time by kernel (one more step, timing events around each launch): {calls} launches, {:.2} ms of device time in a {:.2} ms step",
            busy * 1e3,
            self.step_s * 1e3
        )?;
        let line = |f: &mut std::fmt::Formatter<'_>, name: &str, calls: usize, s: f64| {
            write!(
                f,
                "\n  {:5.1}%  {:8.3} ms  {:5}x  {name}",
                100.0 * s / busy.max(1e-12),
                s * 1e3,
                calls
            )
        };
        for (name, calls, s) in self.kernels.iter().take(KERNEL_LINES) {
            line(f, name, *calls, *s)?;
        }
        let rest = &self.kernels[self.kernels.len().min(KERNEL_LINES)..];
        if !rest.is_empty() {
            let n = rest.len();
            let (c, s) = rest.iter().fold((0, 0.0), |(c, s), k| (c + k.1, s + k.2));
            line(f, &format!("{n} others"), c, s)?;
        }
        Ok(())
    }
}

/// A GPU run's device and memory.
#[derive(Clone, Debug, serde::Serialize)]
pub struct GpuMemory {
    pub device: String,
    pub peak_live_bytes: u64,
    pub device_used_bytes: u64,
}

/// Cumulative (steal, total) CPU time of the machine in clock ticks, from the first line of
/// `/proc/stat` (`cpu  user nice system idle iowait irq softirq steal …`).
fn cpu_ticks() -> Option<(u64, u64)> {
    parse_cpu_ticks(&std::fs::read_to_string("/proc/stat").ok()?)
}

fn parse_cpu_ticks(stat: &str) -> Option<(u64, u64)> {
    let line = stat.lines().next()?.strip_prefix("cpu ")?;
    // The first eight fields: user nice system idle iowait irq softirq steal (guest time is
    // already inside user and nice).
    let v: Vec<u64> = line
        .split_whitespace()
        .take(8)
        .map(str::parse)
        .collect::<std::result::Result<_, _>>()
        .ok()?;
    (v.len() == 8).then(|| (v[7], v.iter().sum()))
}

/// Steal share between two [`cpu_ticks`] readings.
fn steal_share(before: Option<(u64, u64)>, after: Option<(u64, u64)>) -> Option<f64> {
    let ((s0, t0), (s1, t1)) = (before?, after?);
    (t1 > t0).then(|| s1.saturating_sub(s0) as f64 / (t1 - t0) as f64)
}

impl std::fmt::Display for BenchReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "preset {} ({} params), {} on {} rank(s) × {} thread(s), {} tokens/step",
            self.preset, self.params, self.layout, self.ranks, self.threads, self.tokens_per_step
        )?;
        writeln!(f, "{}", self.kernels)?;
        writeln!(
            f,
            "median step {:.4} s  ->  {:.0} tokens/s",
            self.median_step_s, self.tokens_per_s
        )?;
        writeln!(
            f,
            "FLOPs/token (6N + 12·L·H·S, N = all parameters) {:.3e}  ->  {:.1} GFLOP/s; GEMM peak {}; MFU {}",
            self.flops_per_token,
            self.achieved_gflops,
            if self.gemm_peak_gflops.is_finite() {
                format!("{:.1} GFLOP/s", self.gemm_peak_gflops)
            } else {
                "unknown".into()
            },
            crate::progress::mfu_percent(self.mfu)
        )?;
        if let Some(p) = self.fma_peak_gflops {
            writeln!(
                f,
                "f32 FMA peak of {} × {} thread(s) (register-only loop) {:.1} GFLOP/s: the step runs at {:.1}% of it",
                self.ranks,
                self.threads,
                p,
                100.0 * self.achieved_gflops / p
            )?;
        }
        // Shares of the profiled time (the timed steps' mean on the CPU, the synchronised
        // step on a GPU).
        let profiled_step: f64 = self.profile.iter().map(|p| p.1).sum();
        let parts: Vec<String> = self
            .profile
            .iter()
            .map(|(k, s)| format!("{k} {:.0}%", 100.0 * s / profiled_step.max(1e-12)))
            .collect();
        if self.profile_synchronized {
            writeln!(
                f,
                "time per step by kernel (one more step, the GPU synchronised around each kernel class): {}",
                parts.join(", ")
            )?;
        } else {
            writeln!(f, "time per step by kernel: {}", parts.join(", "))?;
        }
        if let Some(st) = self.cpu_steal {
            writeln!(
                f,
                "CPU time stolen by the hypervisor during the timed steps: {:.0}% of the machine (other guests' load on a shared VM; the step times include it)",
                100.0 * st
            )?;
        }
        if let Some((host, waited)) = self.delayed_update {
            writeln!(
                f,
                "delayed update: the host's AdamW {host:.4} s a step beside the forward and backward, {waited:.4} s of it waited for (medians)"
            )?;
        }
        if let Some(x) = self.expert_imbalance {
            writeln!(
                f,
                "expert load: the busiest rank's routed rows are {x:.2}× the mean (the all-to-alls wait for it)"
            )?;
        }
        if let Some(p) = &self.pipeline {
            writeln!(f, "{p}")?;
        }
        if let Some(c) = &self.context {
            let compute: Vec<f64> = c.iter().map(|x| x.0).collect();
            let mean = compute.iter().sum::<f64>() / compute.len().max(1) as f64;
            let max = compute.iter().copied().fold(0.0, f64::max);
            let per: Vec<String> = c
                .iter()
                .map(|(a, w)| format!("{:.1}+{:.1}", a * 1e3, w * 1e3))
                .collect();
            let wait: f64 = c.iter().map(|x| x.1).sum::<f64>() / c.len().max(1) as f64;
            writeln!(
                f,
                "context parallel: attention compute + ring wait per rank (ms/step) {}; compute max/mean {:.2}; wait {:.1}% of attention",
                per.join(", "),
                max / mean.max(1e-12),
                100.0 * wait / (mean + wait).max(1e-12)
            )?;
        }
        if let Some(g) = &self.gpu {
            let on_device = self.accounted_bytes - self.offloaded_bytes;
            writeln!(
                f,
                "GPU {}: peak live buffers {} ({:.2}x the account on the device, {}), device memory in use {}",
                g.device,
                human(g.peak_live_bytes),
                g.peak_live_bytes as f64 / on_device as f64,
                human(on_device),
                human(g.device_used_bytes)
            )?;
            if self.offloaded_bytes > 0 {
                writeln!(
                    f,
                    "optimizer state offloaded to the host: {}, and {} page-locked (the landed gradients, the weights' upload stages)",
                    human(self.offloaded_bytes),
                    human(self.offload_pinned_bytes)
                )?;
            }
        }
        if let Some(k) = &self.gpu_kernels {
            writeln!(f, "{k}")?;
        }
        write!(
            f,
            "memory of rank 0: accounted {} ; peak RSS {} ({})",
            human(self.accounted_bytes),
            self.peak_rss_bytes.map(human).unwrap_or_else(|| "?".into()),
            self.peak_rss_bytes
                .map(|r| format!("{:.2}x the account", r as f64 / self.accounted_bytes as f64))
                .unwrap_or_default()
        )
    }
}

/// Runs `steps` timed optimizer steps (after one warm-up step) of `cfg` on this rank of
/// `comm`'s world with real data (the built-in corpus) and reports the median (on rank 0; the
/// other ranks return `None`). Every rank calls it.
pub fn bench_train(
    preset: &str,
    mut cfg: RunConfig,
    steps: usize,
    comm: &Communicator,
) -> Result<Option<BenchReport>> {
    cfg.train.steps = steps + 1;
    cfg.train.sample_tokens = 0;
    cfg.data.corpus_bytes = cfg.data.corpus_bytes.min(400_000);
    let mut t = Trainer::new(cfg, comm)?;
    let gpu = match &t.exec.config().device {
        tensor::buf::Dev::Cuda(g) => Some(g.clone()),
        tensor::buf::Dev::Cpu => None,
    };
    // A GPU step ends when its queued kernels have run.
    let sync = || -> Result<()> {
        if let Some(g) = &gpu {
            g.synchronize()
                .map_err(|e| crate::error::TrainError::Config(e.to_string()))?;
        }
        Ok(())
    };
    let threads = tensor::threads::thread_budget();
    t.train_step()?; // warm-up: page in buffers, size the thread pool
    sync()?;
    model::profile::reset();
    // On a GPU the kernel timers would charge queued work to whichever call waits: the timed
    // steps run without them, and one more step is profiled with the device synchronised.
    model::profile::enable(gpu.is_none());
    // The MFU denominators are sampled before every timed step and the best kept: on a shared
    // machine a single sample can land in a slow moment and put the MFU above 100 %.
    let mut peak = 0.0f64;
    let mut fma_peak = Some(0.0f64);
    let ticks0 = cpu_ticks();
    let mut times = Vec::with_capacity(steps.max(1));
    let mut ep_imbalance = Vec::new();
    let mut delayed = Vec::new();
    for _ in 0..steps.max(1) {
        match &gpu {
            // The GPU's dense bf16 tensor-core peak (the usual MFU denominator).
            Some(g) => {
                peak = g.info.bf16_peak_flops().unwrap_or(f64::NAN);
                fma_peak = None;
            }
            None => {
                peak = peak.max(job_peak_flops(comm, gemm_peak_flops)?);
                let fma = job_peak_flops(comm, || {
                    tensor::peak::fma_peak_flops(threads).unwrap_or(f64::NAN)
                })?;
                fma_peak = fma_peak.filter(|_| fma.is_finite()).map(|p| p.max(fma));
            }
        }
        let s = Instant::now();
        let report = t.train_step()?;
        sync()?;
        times.push(s.elapsed().as_secs_f64());
        ep_imbalance.extend(report.experts.map(|x| x.ep_imbalance));
        delayed.extend(report.stats.delayed_update);
    }
    let cpu_steal = steal_share(ticks0, cpu_ticks());
    // The pipeline's measured bubble comes from the timed steps' trace, before the profiled
    // GPU step below adds one with the device synchronised around every kernel.
    let pipeline = t.pipeline_report()?;
    // (steps, seconds) the kernel timers ran over.
    let mut profiled = (times.len() as f64, times.iter().sum::<f64>());
    let profiled_on_gpu = gpu.is_some();
    if let Some(g) = &gpu {
        let g = g.clone();
        model::profile::synchronize_with(Some(std::sync::Arc::new(move || {
            // A failed wait surfaces at the step's own synchronisation below.
            let _ = g.synchronize();
        })));
        model::profile::reset();
        model::profile::enable(true);
        let s = Instant::now();
        let r = t.train_step();
        let waited = sync();
        profiled = (1.0, s.elapsed().as_secs_f64());
        model::profile::synchronize_with(None);
        r?;
        waited?;
    }
    model::profile::enable(false);
    // And one with timing events around every launch, the queue running freely.
    let gpu_kernels = match &gpu {
        Some(g) => {
            let dev = |e: tensor::cuda::CudaError| crate::error::TrainError::Config(e.to_string());
            g.time_kernels(true).map_err(dev)?;
            let s = Instant::now();
            let r = t.train_step();
            let waited = sync();
            let step_s = s.elapsed().as_secs_f64();
            let times = g.kernel_times();
            g.time_kernels(false).map_err(dev)?;
            r?;
            waited?;
            let kernels = times
                .map_err(dev)?
                .into_iter()
                .map(|k| (k.name, k.calls, k.seconds))
                .collect();
            Some(GpuKernels { step_s, kernels })
        }
        None => None,
    };
    let delayed_update = (!delayed.is_empty()).then(|| {
        let (host, waited): (Vec<f64>, Vec<f64>) = delayed.into_iter().unzip();
        (median(host), median(waited))
    });
    let expert_imbalance = (t.dims.ep > 1 && !ep_imbalance.is_empty())
        .then(|| ep_imbalance.iter().sum::<f64>() / ep_imbalance.len() as f64);
    let context = if t.dims.cp > 1 {
        let secs = |k: model::profile::Kernel| {
            model::profile::report()
                .into_iter()
                .find(|(x, _)| *x == k)
                .map_or(0.0, |(_, s)| s)
        };
        let n = profiled.0;
        let mine = [
            (secs(model::profile::Kernel::Attention) / n) as f32,
            (secs(model::profile::Kernel::ContextWait) / n) as f32,
        ];
        let mut all = vec![0.0f32; 2 * comm.size()];
        comm.all_gather(&mine, &mut all)?;
        Some(
            all.chunks_exact(2)
                .map(|c| (c[0] as f64, c[1] as f64))
                .collect(),
        )
    } else {
        None
    };
    if t.rank() != 0 {
        return Ok(None);
    }
    let mut profile: Vec<(String, f64)> = model::profile::report()
        .into_iter()
        .map(|(k, s)| (format!("{k:?}"), s / profiled.0))
        .filter(|(_, s)| *s > 0.0)
        .collect();
    let kernels: f64 = profile.iter().map(|p| p.1).sum();
    profile.push(("other".into(), (profiled.1 / profiled.0 - kernels).max(0.0)));
    let median = median(times);
    let tokens = t.tokens_per_step();
    let tps = tokens as f64 / median;
    let fpt = t.flops_per_token();
    let gpu = match &gpu {
        Some(g) => {
            let (free, total) = g
                .memory_info()
                .map_err(|e| crate::error::TrainError::Config(e.to_string()))?;
            Some(GpuMemory {
                device: format!(
                    "cuda:{} {} (sm_{}, driver CUDA {}.{})",
                    g.info.ordinal,
                    g.info.name,
                    g.info.arch(),
                    g.info.driver_version / 1000,
                    g.info.driver_version % 1000 / 10
                ),
                peak_live_bytes: g.memory_stats().peak as u64,
                device_used_bytes: (total - free) as u64,
            })
        }
        None => None,
    };
    Ok(Some(BenchReport {
        preset: preset.to_string(),
        layout: match (
            t.exec.config().offload_optimizer,
            t.exec.config().delayed_update_after,
        ) {
            (true, None) => format!("{} + optimizer offloaded to the host", t.dims.describe()),
            (true, Some(n)) => format!(
                "{} + optimizer offloaded to the host, updates past step {n} delayed a step",
                t.dims.describe()
            ),
            (false, _) => t.dims.describe(),
        },
        ranks: comm.size(),
        threads,
        kernels: tensor::isa::describe(),
        params: t.num_params(),
        tokens_per_step: tokens,
        median_step_s: median,
        tokens_per_s: tps,
        flops_per_token: fpt,
        achieved_gflops: tps * fpt / 1e9,
        gemm_peak_gflops: peak / 1e9,
        mfu: tps * fpt / peak,
        fma_peak_gflops: fma_peak.map(|p| p / 1e9),
        accounted_bytes: t.memory().total() as u64,
        offloaded_bytes: t.exec.offloaded_bytes() as u64,
        offload_pinned_bytes: t.exec.offload_pinned_bytes() as u64,
        peak_rss_bytes: peak_rss_bytes(),
        profile,
        profile_synchronized: profiled_on_gpu,
        cpu_steal,
        expert_imbalance,
        delayed_update,
        pipeline,
        context,
        gpu,
        gpu_kernels,
    }))
}

/// The middle value of `v` (the upper one of an even count); `v` is not empty.
fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn steal_share_from_proc_stat() {
        let a = parse_cpu_ticks("cpu  100 0 50 800 10 0 5 35 0 0\ncpu0 1 2 3\n").unwrap();
        assert_eq!(a, (35, 1000));
        let b = parse_cpu_ticks("cpu  300 0 50 900 10 0 5 135 0 0\n").unwrap();
        assert_eq!(b, (135, 1400));
        assert_eq!(steal_share(Some(a), Some(b)), Some(0.25));
        assert_eq!(steal_share(Some(b), Some(b)), None);
        assert_eq!(steal_share(None, Some(b)), None);
        assert_eq!(parse_cpu_ticks("intr 5\n"), None);
        assert_eq!(parse_cpu_ticks("cpu  1 2 3\n"), None);
    }

    #[test]
    fn gpu_kernel_table_lists_the_longest_and_sums_the_rest() {
        let kernels: Vec<(String, usize, f64)> = (0..KERNEL_LINES + 3)
            .map(|i| (format!("k{i}"), 2, 0.001 * (KERNEL_LINES + 3 - i) as f64))
            .collect();
        let busy: f64 = kernels.iter().map(|k| k.2).sum();
        let text = GpuKernels {
            step_s: 0.5,
            kernels,
        }
        .to_string();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 1 + KERNEL_LINES + 1, "{text}");
        assert!(lines[0].contains(&format!("{} launches", 2 * (KERNEL_LINES + 3))));
        assert!(lines[0].contains(&format!(
            "{:.2} ms of device time in a 500.00 ms step",
            busy * 1e3
        )));
        assert!(lines[1].ends_with("2x  k0"), "{}", lines[1]);
        // The last three (3, 2 and 1 ms) in one line.
        let last = lines.last().unwrap();
        assert!(
            last.ends_with("6x  3 others") && last.contains("6.000 ms"),
            "{last}"
        );
    }
}
