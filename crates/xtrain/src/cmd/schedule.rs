//! `xtrain schedule`: a pipeline schedule without training — each rank's actions, its
//! simulated timeline (text, or an SVG picture), bubble and activation memory, and its CSV
//! form (which `xtrain train --schedule csv:FILE` runs). `--compare` puts every schedule side
//! by side for one pp and micro-batch count.
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::Args;
use parallel::pipeline_parallel::{
    generate, lower, render, simulate, validate, Costs, LowerOptions, Schedule, ScheduleKind,
    Simulation,
};

#[derive(Args, Debug)]
pub struct ScheduleArgs {
    /// Schedule: gpipe, 1f1b, interleaved, zb-h1, zb-h2, zb-v, dualpipev, dualpipe, or
    /// csv:FILE.
    #[arg(long, default_value = "1f1b")]
    pub schedule: String,
    /// Pipeline ranks.
    #[arg(long, default_value_t = 4)]
    pub pp: usize,
    /// Micro-batches per step.
    #[arg(long, default_value_t = 8)]
    pub microbatches: usize,
    /// Stages per rank of the interleaved schedule (default 2, as `xtrain train`).
    #[arg(long)]
    pub virtual_stages: Option<usize>,
    /// Cost of each action type for the simulation, e.g. `F=1,B=2,W=1` (B is the fused
    /// backward, I = B − W; `FB=` an overlapped pair). Default: F = I = W = 1.
    #[arg(long)]
    pub costs: Option<String>,
    /// Print the lowered schedule (with sends, receives, reductions and the optimizer step).
    #[arg(long)]
    pub lowered: bool,
    /// Write the timeline as an SVG picture.
    #[arg(long)]
    pub svg: Option<PathBuf>,
    /// Write the schedule's CSV form (for `xtrain train --schedule csv:FILE`).
    #[arg(long)]
    pub csv: Option<PathBuf>,
    /// Compare every schedule at this pp and micro-batch count.
    #[arg(long)]
    pub compare: bool,
}

/// The schedule `spec` names.
/// The schedule `spec` for `pp` ranks and `m` micro-batches; `v` virtual stages for
/// interleaved (its default when `None`), ignored by the other kinds.
fn schedule(spec: &str, pp: usize, m: usize, v: Option<usize>) -> Result<Schedule> {
    if let Some(path) = spec.strip_prefix("csv:") {
        let text = std::fs::read_to_string(path).with_context(|| format!("reading {path}"))?;
        let s = Schedule::from_csv(&text).with_context(|| path.to_string())?;
        validate(&s)?;
        return Ok(s);
    }
    let kind: ScheduleKind = spec.parse()?;
    let v = if kind == ScheduleKind::Interleaved {
        v.unwrap_or(kind.default_virtual_stages())
    } else {
        1
    };
    Ok(generate(kind, pp, m, v)?)
}

/// The closed-form bubble of the kinds that have one, for unit costs (F = I = W = 1).
fn formula(kind: &str, p: usize, m: usize, v: usize) -> Option<(String, f64)> {
    let (p, m, v) = (p as f64, m as f64, v as f64);
    match kind {
        "gpipe" | "1f1b" => Some(("(p−1)/(m+p−1)".into(), (p - 1.0) / (m + p - 1.0))),
        "interleaved" => Some(("(p−1)/(v·m+p−1)".into(), (p - 1.0) / (v * m + p - 1.0))),
        "zb-h1" => Some(("(p−1)/(3m+p−1)".into(), (p - 1.0) / (3.0 * m + p - 1.0))),
        _ => None,
    }
}

fn summary(s: &Schedule, sim: &Simulation) -> String {
    let peak = |v: &[usize]| v.iter().copied().max().unwrap_or(0);
    format!(
        "{:<12} {:>6} {:>9.1} {:>8.1}% {:>8} {:>9}",
        s.kind,
        s.num_stages(),
        sim.makespan,
        100.0 * sim.mean_bubble(),
        peak(&sim.peak_activations),
        peak(&sim.peak_pending_weights)
    )
}

const HEADER: &str = "schedule     stages  makespan   bubble  peak act  pending W";

pub fn run_cmd(a: ScheduleArgs) -> Result<()> {
    if a.pp == 0 || a.microbatches == 0 {
        bail!("--pp and --microbatches must be at least 1");
    }
    let costs: Costs = match &a.costs {
        Some(c) => c.parse()?,
        None => Costs::default(),
    };
    if a.compare {
        println!(
            "pp = {}, m = {}, costs F={} I={} W={} (interleaved: v = {})",
            a.pp,
            a.microbatches,
            costs.forward,
            costs.input,
            costs.weight,
            a.virtual_stages
                .unwrap_or(ScheduleKind::Interleaved.default_virtual_stages())
        );
        println!("{HEADER}");
        for kind in ScheduleKind::ALL {
            match schedule(kind.name(), a.pp, a.microbatches, a.virtual_stages) {
                Ok(s) => println!("{}", summary(&s, &simulate(&s, &costs)?)),
                Err(e) => println!("{:<12} not generated: {e}", kind.name()),
            }
        }
        println!("(peak act: most micro-batches between a stage's F and its input gradient on one rank; pending W: between I and W)");
        return Ok(());
    }
    let s = schedule(&a.schedule, a.pp, a.microbatches, a.virtual_stages)?;
    let sim = simulate(&s, &costs)?;
    let ranks = s.num_ranks();
    let several = (0..ranks).any(|r| s.rank_stages(r).len() > 1);
    println!(
        "{}: pp = {ranks}, {} stages, {} micro-batches",
        s.kind,
        s.num_stages(),
        s.num_microbatches()
    );
    let shown = if a.lowered {
        lower(&s, LowerOptions::default())?
    } else {
        s.clone()
    };
    for (r, list) in shown.actions.iter().enumerate() {
        let text: Vec<String> = list.iter().map(|x| x.to_string()).collect();
        println!("rank {r}: {}", text.join(" "));
    }
    println!();
    let width = 100.0 / sim.makespan.max(1.0);
    print!(
        "{}",
        render::text(&sim, ranks, width.clamp(1.0, 4.0), several)
    );
    println!();
    println!("{HEADER}");
    println!("{}", summary(&s, &sim));
    let bubbles: Vec<String> = sim
        .bubble
        .iter()
        .map(|b| format!("{:.1}%", 100.0 * b))
        .collect();
    println!("bubble per rank: {}", bubbles.join(" "));
    println!("peak activations per rank: {:?}", sim.peak_activations);
    let v = if s.kind == "interleaved" {
        a.virtual_stages
            .unwrap_or(ScheduleKind::Interleaved.default_virtual_stages())
    } else {
        1
    };
    if a.costs.is_none() {
        if let Some((f, b)) = formula(&s.kind, ranks, s.num_microbatches(), v) {
            println!("closed form {f} = {:.1}%", 100.0 * b);
        }
    }
    if let Some(path) = &a.svg {
        let title = format!("{} pp={ranks} m={}", s.kind, s.num_microbatches());
        let pic = render::svg(&sim, ranks, &title, several).map_err(anyhow::Error::msg)?;
        std::fs::write(path, pic).with_context(|| format!("writing {}", path.display()))?;
        println!("timeline: {}", path.display());
    }
    if let Some(path) = &a.csv {
        std::fs::write(path, s.to_csv()).with_context(|| format!("writing {}", path.display()))?;
        println!("schedule: {}", path.display());
    }
    Ok(())
}
