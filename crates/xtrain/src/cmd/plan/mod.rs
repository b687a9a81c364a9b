//! `xtrain plan`: every layout of a model on a cluster with its predicted per-rank memory and
//! step time, the feasible ones ranked by tokens/s (`--explain LAYOUT` breaks one down,
//! `--json`, `--svg FILE` draws the memory of the top ones against the device), and
//! `--validate`, which runs short `xtrain bench train` jobs on this machine and prints
//! predicted against measured. The planner itself is `parallel::plan` (docs/PLAN.md).
mod calibrate;
mod calibrate_gpu;
mod validate;

use std::path::Path;

use anyhow::{bail, Context, Result};
use clap::Args;
use model::{ModelConfig, Recompute};
use parallel::data_parallel::ZeroStage;
use parallel::memory::human;
use parallel::plan::{
    self, shapes, Cluster, Conventions, Job, Layout, Offload, Prediction, SearchSpace,
};
use parallel::Precision;

#[derive(Args, Debug)]
pub struct PlanArgs {
    /// The model: a preset (tiny, small, medium, moe-small), a named shape (llama2-7b,
    /// llama3-8b, llama3-70b, llama3-405b, mixtral-8x7b, gpt3-175b) or a Hugging Face
    /// `config.json` (or its directory).
    #[arg(long, default_value = "small")]
    pub model: String,
    /// The cluster: a100-80g, h100-80g (8 devices per node), `this` (this machine, calibrated
    /// now) or a JSON file with the fields of `parallel::plan::Cluster`.
    #[arg(long, default_value = "this")]
    pub cluster: String,
    /// Nodes of a preset cluster.
    #[arg(long, default_value_t = 1)]
    pub nodes: usize,
    /// Ranks (processes) on this machine, for `--cluster this` (default: 2 on the CPU, the
    /// number of GPUs with `--device cuda`).
    #[arg(long)]
    pub devices: Option<usize>,
    /// What `--cluster this` calibrates: `cpu` (ranks sharing the cores) or `cuda` (this
    /// host's NVIDIA GPUs, measured on GPU 0).
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// Sequences per optimizer step (default: a preset's micro-batch × devices, else 1024).
    #[arg(long)]
    pub global_batch: Option<usize>,
    /// Tokens per sequence (default: a preset's, else 4096).
    #[arg(long)]
    pub seq_len: Option<usize>,
    /// fp32, bf16 or fp16.
    #[arg(long, default_value = "bf16")]
    pub precision: String,
    /// Whose memory and time conventions: xtrain (this engine) or megatron (16-bit
    /// activations, fp32 gradients: for comparing with published results).
    #[arg(long, default_value = "xtrain")]
    pub conventions: String,
    /// With expert parallelism: the busiest rank's routed rows over the mean that the
    /// prediction assumes (1 = balanced; `xtrain bench train --ep N` measures it).
    #[arg(long, default_value_t = 1.0)]
    pub expert_imbalance: f64,
    /// Fix a degree instead of searching it.
    #[arg(long)]
    pub tp: Option<usize>,
    #[arg(long)]
    pub pp: Option<usize>,
    #[arg(long)]
    pub dp: Option<usize>,
    #[arg(long)]
    pub cp: Option<usize>,
    #[arg(long)]
    pub ep: Option<usize>,
    /// ZeRO stages to search (comma-separated, e.g. `0,1`).
    #[arg(long, value_delimiter = ',')]
    pub zero: Vec<usize>,
    /// Where the optimizer may run (comma-separated): `none` (on the device), `optimizer`
    /// (ZeRO-Offload: master weights, moments and the step on the host; 16-bit precisions on
    /// a cluster with a host side), `delayed` (the same with the one-step delayed update:
    /// `train --offload optimizer --set parallel.delayed_update_after=N`). Default: all three.
    #[arg(long, value_delimiter = ',')]
    pub offload: Vec<String>,
    /// Deepest pipeline searched when --pp is not given.
    #[arg(long, default_value_t = 16)]
    pub max_pp: usize,
    /// Layouts to print.
    #[arg(long, default_value_t = 10)]
    pub top: usize,
    /// Break one layout down: its rank in the list (1 = fastest) or its name, e.g.
    /// "tp8 pp2 dp4 z1 sp 1f1b mb1x64 rc=selective".
    #[arg(long)]
    pub explain: Option<String>,
    /// Print the plan as JSON.
    #[arg(long)]
    pub json: bool,
    /// Write the memory chart of the top layouts (SVG).
    #[arg(long)]
    pub svg: Option<std::path::PathBuf>,
    /// Write the cluster as JSON (the format `--cluster FILE` reads): this machine's
    /// calibration kept to plan with again without measuring, or a preset to edit.
    #[arg(long, value_name = "FILE")]
    pub save_cluster: Option<std::path::PathBuf>,
    /// Run short benchmarks of small and medium (single process, dp2, tp2, pp2, cp2; ep2 on
    /// moe-small) and print predicted against measured step time and memory; with
    /// `--device cuda`, medium on this machine's GPUs (bf16 and fp32 on one; dp2 and tp2 where
    /// there are two).
    #[arg(long)]
    pub validate: bool,
    /// Rounds of each benchmark in --validate.
    #[arg(long, default_value_t = 3)]
    pub rounds: usize,
    /// Timed steps per benchmark in --validate.
    #[arg(long, default_value_t = 3)]
    pub steps: usize,
    /// One worker of this machine's calibration (internal: started by `--cluster this`, the
    /// model's config.json on standard input): measure at this many sequences per
    /// micro-batch and print the result as JSON.
    #[arg(long, hide = true)]
    pub calibrate_worker: Option<usize>,
}

/// A model and the preset's sequence length and micro-batch, if it is a preset.
pub(crate) fn resolve_model(name: &str) -> Result<(ModelConfig, Option<(usize, usize)>)> {
    let path = Path::new(name);
    if path.exists() {
        let file = if path.is_dir() {
            path.join("config.json")
        } else {
            path.to_path_buf()
        };
        return Ok((ModelConfig::from_json_file(&file)?, None));
    }
    if let Some(cfg) = shapes::named(name) {
        return Ok((cfg, None));
    }
    if train::config::PRESETS.contains(&name) {
        let r = train::RunConfig::preset(name)?;
        let cfg = train::trainer::model_config(&r);
        return Ok((cfg, Some((r.model.seq_len, r.train.micro_batch))));
    }
    bail!(
        "unknown model `{name}`: a preset ({}), a named shape ({}) or a config.json path",
        train::config::PRESETS.join(", "),
        shapes::NAMES.join(", ")
    )
}

fn parse_precision(s: &str) -> Result<Precision> {
    Ok(match s {
        "fp32" => Precision::Fp32,
        "bf16" => Precision::Bf16,
        "fp16" => Precision::Fp16,
        other => bail!("unknown precision `{other}` (fp32, bf16, fp16)"),
    })
}

fn cluster(a: &PlanArgs, cfg: &ModelConfig, seq: usize, micro: usize) -> Result<Cluster> {
    match a.cluster.as_str() {
        "this" if a.device.starts_with("cuda") => {
            let devices = match a.devices {
                Some(d) => d,
                None => tensor::cuda::device_count().context("counting this machine's GPUs")?,
            };
            calibrate_gpu::this_gpus(cfg, seq, micro, devices, parse_precision(&a.precision)?)
        }
        "this" if a.device == "cpu" => {
            calibrate::this_machine(cfg, seq, micro, a.devices.unwrap_or(2))
        }
        "this" => bail!("--device {}: cpu or cuda", a.device),
        name if Path::new(name).exists() => {
            let text = std::fs::read_to_string(name).with_context(|| format!("reading {name}"))?;
            Ok(Cluster::from_json(&text)?)
        }
        name => Ok(Cluster::preset(name, a.nodes)?),
    }
}

pub fn run_cmd(a: PlanArgs) -> Result<()> {
    if let Some(micro_batch) = a.calibrate_worker {
        let seq = a.seq_len.context("--calibrate-worker needs --seq-len")?;
        return calibrate::worker(seq, micro_batch);
    }
    if a.validate {
        return validate::run(a.rounds, a.steps, &a.device);
    }
    let (model, preset) = resolve_model(&a.model)?;
    let seq_len = a.seq_len.or(preset.map(|p| p.0)).unwrap_or(4096);
    let micro = preset.map_or(1, |p| p.1);
    let cluster = cluster(&a, &model, seq_len, micro)?;
    if let Some(path) = &a.save_cluster {
        let text = serde_json::to_string_pretty(&cluster)?;
        std::fs::write(path, text + "\n")
            .with_context(|| format!("writing the cluster to {}", path.display()))?;
    }
    let global_batch = a
        .global_batch
        .unwrap_or_else(|| preset.map_or(1024, |p| p.1 * cluster.devices()));
    let conventions = match a.conventions.as_str() {
        "xtrain" => Conventions::Xtrain,
        "megatron" => Conventions::Megatron,
        other => bail!("unknown conventions `{other}` (xtrain, megatron)"),
    };
    if !(a.expert_imbalance.is_finite() && a.expert_imbalance >= 1.0) {
        bail!(
            "--expert-imbalance must be at least 1 (the busiest rank's rows over the mean), got {}",
            a.expert_imbalance
        );
    }
    let job = Job {
        model,
        seq_len,
        global_batch,
        precision: parse_precision(&a.precision)?,
        gpu: cluster.gpu,
        conventions,
        expert_imbalance: a.expert_imbalance,
    };
    let mut space = SearchSpace {
        tp: a.tp,
        pp: a.pp,
        dp: a.dp,
        cp: a.cp,
        ep: a.ep,
        max_pp: a.max_pp,
        ..SearchSpace::default()
    };
    if !a.zero.is_empty() {
        space.zero = a
            .zero
            .iter()
            .map(|&k| ZeroStage::from_index(k).with_context(|| format!("ZeRO stage {k} (0-3)")))
            .collect::<Result<_>>()?;
    }
    if !a.offload.is_empty() {
        space.offload = a
            .offload
            .iter()
            .map(|o| o.parse::<Offload>())
            .collect::<Result<_, _>>()?;
    }
    let t = std::time::Instant::now();
    let p = plan::plan(&job, &cluster, &space)?;
    let took = t.elapsed();
    if let Some(path) = &a.svg {
        let shown: Vec<Prediction> = if p.feasible.is_empty() {
            p.shortfall.iter().map(|s| s.closest.clone()).collect()
        } else {
            p.feasible.iter().take(a.top.max(1)).cloned().collect()
        };
        let title = format!("{} on {} × {}", a.model, cluster.devices(), cluster.name);
        std::fs::write(
            path,
            plan::chart::memory_svg(&shown, cluster.memory_bytes, &title)?,
        )
        .with_context(|| format!("writing {}", path.display()))?;
    }
    if let Some(which) = &a.explain {
        let pred = match which.parse::<usize>() {
            Ok(k) if k >= 1 => p
                .feasible
                .get(k - 1)
                .cloned()
                .with_context(|| format!("only {} feasible layouts", p.feasible.len()))?,
            _ => plan::evaluate(&job, &cluster, &which.parse::<Layout>()?)?,
        };
        if a.json {
            println!("{}", serde_json::to_string_pretty(&pred)?);
        } else {
            explain(&pred, &cluster);
        }
        return Ok(());
    }
    if a.json {
        let top = serde_json::json!({
            "cluster": cluster,
            "evaluated": p.evaluated,
            "feasible": p.feasible.iter().take(a.top).collect::<Vec<_>>(),
            "feasible_count": p.feasible.len(),
            "shortfall": p.shortfall,
        });
        println!("{}", serde_json::to_string_pretty(&top)?);
        return Ok(());
    }
    let host = cluster.host_share().map_or(String::new(), |h| {
        format!(", {} of host memory per device", human(h))
    });
    println!(
        "{} ({} parameters), seq {seq_len}, global batch {global_batch}, {:?}, on {} × {} ({} per device{host}); {} layouts in {:.2} s, {} fit",
        a.model,
        shapes::num_params(&job.model),
        job.precision,
        cluster.devices(),
        cluster.name,
        human(cluster.memory_bytes),
        p.evaluated,
        took.as_secs_f64(),
        p.feasible.len()
    );
    if let Some(s) = &p.shortfall {
        let mut need = format!(
            "{} per device ({} more than there is)",
            human(s.closest.resident as u64),
            human(s.short_bytes)
        );
        if s.closest.layout.offload.on_host() {
            need += &format!(
                " and {} of host memory per device ({} more)",
                human(s.closest.host as u64),
                human(s.short_host_bytes)
            );
        }
        println!(
            "nothing fits: the closest, {}, needs {need}:",
            s.closest.layout
        );
        for t in &s.suggestions {
            println!("  - {t}");
        }
        return Ok(());
    }
    table(&p.feasible[..p.feasible.len().min(a.top)]);
    Ok(())
}

/// The ranked layouts: speed, bubble, device memory and (offloaded) host memory per device.
fn table(preds: &[Prediction]) {
    println!(
        "{:>3}  {:<68} {:>12} {:>9} {:>7} {:>11} {:>11}",
        "#", "layout", "tokens/s", "step s", "bubble", "memory", "host"
    );
    for (i, x) in preds.iter().enumerate() {
        let host = match x.layout.offload {
            Offload::None => "-".to_string(),
            Offload::Optimizer | Offload::Delayed => human(x.host as u64),
        };
        println!(
            "{:>3}  {:<68} {:>12.0} {:>9.3} {:>6.1}% {:>11} {:>11}",
            i + 1,
            x.layout.to_string(),
            x.time.tokens_per_s,
            x.time.step_s,
            100.0 * x.bubble,
            human(x.resident as u64),
            host
        );
    }
}

/// The breakdown of one layout.
fn explain(p: &Prediction, c: &Cluster) {
    let l = &p.layout;
    println!("{l}  ({} devices)", l.world());
    let rc = match l.recompute {
        Recompute::None => "none",
        Recompute::Selective => "selective",
        Recompute::Full => "full",
    };
    println!(
        "recomputation {rc}, {} micro-batches of {} sequences per dp rank",
        l.microbatches, l.micro_batch
    );
    println!(
        "memory per pipeline rank (limit {}):",
        human(c.memory_bytes)
    );
    for r in &p.ranks {
        println!(
            "  pp rank {}: {} layers, {} parameters, ZeRO over {}: {}",
            r.pp_rank, r.layers, r.params, r.zero_group, r.account
        );
        println!(
            "      + backward workspace {} + process {} = {} resident",
            human(r.workspace as u64),
            human(r.process as u64),
            human(r.resident() as u64)
        );
        if l.offload.on_host() {
            let grads = match l.offload {
                Offload::Delayed => "gradients twice (one step's held)",
                _ => "gradients",
            };
            println!(
                "      host: fp32 master + adam m,v + {grads} of its optimizer shard = {} (limit {} per device)",
                human(r.host as u64),
                human(c.host_share().unwrap_or(0))
            );
        }
    }
    let t = &p.time;
    println!("step {:.4} s → {:.0} tokens/s", t.step_s, t.tokens_per_s);
    for (name, v) in [
        (
            "compute (busiest rank, incl. tp/ep/pp comm below)",
            t.compute_s,
        ),
        ("pipeline bubble", t.bubble_s),
        ("  tensor-parallel collectives", t.tp_comm_s),
        ("  context-parallel ring, exposed", t.cp_exposed_s),
        ("  expert all-to-alls", t.ep_comm_s),
        ("  pipeline sends", t.pp_comm_s),
        ("data-parallel reduction, exposed", t.dp_exposed_s),
        (
            match l.offload {
                Offload::None => "optimizer step",
                Offload::Optimizer => "optimizer step, on the host's CPUs",
                Offload::Delayed => {
                    "optimizer step, on the host's CPUs beside the next step, exposed"
                }
            },
            t.optimizer_s,
        ),
        (
            "host ↔ device copies (offload), exposed",
            t.offload_exposed_s,
        ),
    ] {
        println!("  {name:<52} {v:>10.4} s");
    }
    println!("fits: {}", if p.fits { "yes" } else { "no" });
}
