//! "This machine" as a planner cluster when it has NVIDIA GPUs (`xtrain plan --cluster this
//! --device cuda`), calibrated in seconds on GPU 0: the bf16 and fp32 GEMM peaks (cuBLASLt,
//! operands prepared once, as the tensor cores see them in training), the share of the
//! run's peak one decoder layer's forward and backward reach in the run's precision (the
//! planner's own FLOP count as the numerator, as on the CPU), the bytes/s of the optimizer
//! phase on the device, the device's memory, and the host ↔ device copies (the path of the
//! host-staged collectives through ordinary memory, and of ZeRO-Offload through page-locked
//! memory). Ranks on this host's GPUs exchange through host memory ("Several ranks" in
//! docs/GPU.md): a link of the shared-memory transport in series with a download and an
//! upload.
use std::time::Instant;

use anyhow::{Context, Result};
use model::{Batch, Model, ModelConfig, StepOptions};
use parallel::plan::{Cluster, Host, Link};
use parallel::Precision;
use tensor::buf::Dev;
use tensor::cuda::ops::{matmul_prepared, AdamScalars, Operand};
use tensor::cuda::Gpu;
use tensor::operands::{Operands, Scope};

/// Best of `n` timings (seconds) of `f` followed by the device's wait, after one warm-up.
fn best_of(gpu: &Gpu, n: usize, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    f()?;
    gpu.synchronize()?;
    let mut best = f64::MAX;
    for _ in 0..n {
        let t = Instant::now();
        f()?;
        gpu.synchronize()?;
        best = best.min(t.elapsed().as_secs_f64());
    }
    Ok(best)
}

/// FLOP/s of an `n`³ product with `operands` (fp32 accumulation), the operands rounded once.
fn gemm_peak(dev: &Dev, gpu: &std::sync::Arc<Gpu>, operands: Operands, n: usize) -> Result<f64> {
    let a = dev.from_vec((0..n * n).map(|i| ((i % 13) as f32 - 6.0) * 0.1).collect())?;
    let b = dev.from_vec((0..n * n).map(|i| ((i % 7) as f32 - 3.0) * 0.1).collect())?;
    let c = gpu.alloc::<f32>(n * n)?;
    let (tensor::buf::Buf::Cuda(a), tensor::buf::Buf::Cuda(b)) = (&a, &b) else {
        unreachable!("buffers of a GPU device")
    };
    let (ao, bo) = (
        Operand::new(a.as_slice(), operands)?,
        Operand::new(b.as_slice(), operands)?,
    );
    let t = best_of(gpu, 5, || {
        // SAFETY: c, a and b hold n·n elements on this GPU.
        unsafe {
            matmul_prepared(
                gpu,
                operands,
                c.ptr(),
                &ao,
                &bo,
                [n, n, n],
                [false, false, false],
            )?
        };
        Ok(())
    })?;
    Ok(2.0 * (n as f64).powi(3) / t)
}

/// Share of `peak` one layer of `cfg` reaches on the device in `operands`.
fn efficiency(dev: &Dev, cfg: &ModelConfig, seq: usize, mb: usize, peak: f64) -> Result<f64> {
    let gpu = match dev {
        Dev::Cuda(g) => g.clone(),
        Dev::Cpu => unreachable!("a GPU device"),
    };
    let mut one = cfg.clone();
    one.num_hidden_layers = 1;
    let model = Model::new(one.clone())?;
    let params = dev.from_vec(model.init_params(1))?;
    let mut grads = dev.zeros(params.len())?;
    let n = mb * seq;
    let ids: Vec<u32> = (0..n).map(|i| (i * 7919 % one.vocab_size) as u32).collect();
    let targets: Vec<i64> = ids
        .iter()
        .map(|&t| ((t as usize + 1) % one.vocab_size) as i64)
        .collect();
    let batch = Batch::new(mb, seq, ids, targets)?;
    let opts = StepOptions::default();
    let flops = super::calibrate::layer_flops(&one, seq, mb)?;
    let t = best_of(&gpu, 5, || {
        model.forward_backward(&params, &mut grads, &batch, &opts, &mut |_| {})?;
        Ok(())
    })?;
    Ok((flops / t / peak).clamp(1e-3, 1.0))
}

/// Bytes/s of the optimizer phase on the device as the planner counts it (36 bytes per
/// parameter): the gradient norm, the clip's scaling, AdamW and the zeroing, over 64 Mi
/// parameters.
fn optimizer_bandwidth(dev: &Dev, gpu: &Gpu) -> Result<f64> {
    let n = 1 << 26;
    let (mut p, mut g, mut m, mut v) = (
        dev.from_vec(vec![0.1f32; n])?,
        dev.from_vec(vec![0.01f32; n])?,
        dev.zeros(n)?,
        dev.zeros(n)?,
    );
    let s = AdamScalars::new(0.9, 0.95, 1e-8, 1e-3, 1);
    let t = best_of(gpu, 3, || {
        std::hint::black_box(tensor::ops::sq_sum(g.r())?);
        tensor::ops::scale(g.m(), 0.5)?;
        let (
            tensor::buf::Buf::Cuda(pb),
            tensor::buf::Buf::Cuda(gb),
            tensor::buf::Buf::Cuda(mb),
            tensor::buf::Buf::Cuda(vb),
        ) = (&mut p, &g, &mut m, &mut v)
        else {
            unreachable!("buffers of a GPU device")
        };
        tensor::cuda::ops::adamw(pb, gb, mb, vb, &[(n, 1.0)], s)?;
        g.m().zero()?;
        Ok(())
    })?;
    Ok(36.0 * n as f64 / t)
}

/// Host ↔ device copies of 256 MiB: the slower direction's bandwidth, and a 4-byte copy as
/// the latency. From and to page-locked memory, through which the host-staged collectives
/// and messages and ZeRO-Offload's chunks travel.
fn host_link(gpu: &std::sync::Arc<Gpu>) -> Result<Link> {
    let n = 64 << 20;
    let mut host = gpu.host_scratch::<f32>(n)?;
    host.fill(1.0);
    let mut d = gpu.alloc::<f32>(n)?;
    let up = best_of(gpu, 3, || Ok(d.copy_from_host(&host)?))?;
    let down = best_of(gpu, 3, || Ok(d.as_slice().read_into(&mut host)?))?;
    let mut one = gpu.alloc::<f32>(1)?;
    let latency = best_of(gpu, 5, || Ok(one.copy_from_host(&[0.0])?))?;
    Ok(Link {
        latency,
        bandwidth: 4.0 * n as f64 / up.max(down),
    })
}

/// This host's GPUs as a cluster of `devices` ranks, calibrated on GPU 0 for the model `cfg`
/// at `micro_batch` sequences of `seq` in `precision`.
pub fn this_gpus(
    cfg: &ModelConfig,
    seq: usize,
    micro_batch: usize,
    devices: usize,
    precision: Precision,
) -> Result<Cluster> {
    let dev = Dev::open("cuda:0").context("calibrating this machine's GPUs")?;
    let Dev::Cuda(gpu) = &dev else {
        unreachable!("a GPU device")
    };
    let process = super::calibrate::process_baseline();
    let peak_16 = gemm_peak(&dev, gpu, Operands::Bf16, 8192)?;
    let peak_32 = gemm_peak(&dev, gpu, Operands::F32, 4096)?;
    let operands = match precision {
        Precision::Fp32 => Operands::F32,
        Precision::Bf16 => Operands::Bf16,
        Precision::Fp16 => Operands::F16,
    };
    let eff = {
        let _scope = Scope::enter(operands);
        let peak = if operands == Operands::F32 {
            peak_32
        } else {
            peak_16
        };
        efficiency(&dev, cfg, seq, micro_batch, peak)?
    };
    let bandwidth = optimizer_bandwidth(&dev, gpu)?;
    let (_, memory) = gpu.memory_info()?;
    let pcie = host_link(gpu)?;
    // A message between two GPUs of this host: downloaded, over the shared-memory
    // transport, uploaded (through page-locked memory).
    let shm = super::calibrate::link()?;
    let link = Link {
        latency: shm.latency + 2.0 * pcie.latency,
        bandwidth: 1.0 / (1.0 / shm.bandwidth + 2.0 / pcie.bandwidth),
    };
    let mut cluster = Cluster::calibrated(devices, memory as u64, peak_16, eff, bandwidth, link);
    cluster.name = format!("this machine's {} x {}", devices, gpu.info.name);
    cluster.gpu = true;
    cluster.peak_flops_32 = peak_32;
    cluster.process_bytes = process;
    cluster.group_peer_bytes = 2 * comm::Options::default().shm_ring_bytes as u64;
    // The host's side, for ZeRO-Offload: its memory, the copies (page-locked), and the rate
    // of the host's update as the offload runs it (from 16-bit gradient bits through the
    // fp32 master and moments into the rounded weights, over 16 Mi parameters).
    cluster.host = Some(Host {
        memory_bytes: super::calibrate::total_memory(),
        link: pcie,
        adam_params_per_s: parallel::executor::host_update_rate(1 << 24),
    });
    Ok(cluster)
}
