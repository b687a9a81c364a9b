//! Forward+backward throughput of the trainer presets, with the time split by kernel class.
//!
//! ```text
//! cargo run --release -p model --example model_bench -- [preset ...] [--iters N] [--threads T]
//!     [--recompute none|full|selective]
//! ```
//! Presets: tiny (batch 8, seq 64), small (8 × 256), medium (4 × 512), tiny-moe (8 × 64).
//! Prints the median tokens/s over the timed iterations, then one profiled iteration's split.
//! On a shared machine wall time depends on the other load, so the process CPU time per step
//! is printed too (Linux `/proc/self/stat`): `tokens / (cpu_seconds / threads)` estimates the
//! throughput with the threads' cores to ourselves.

use std::time::Instant;

use model::profile;
use model::{Batch, Model, ModelConfig, Recompute, StepOptions};

fn shape(preset: &str) -> (usize, usize) {
    match preset {
        "small" => (8, 256),
        "medium" => (4, 512),
        _ => (8, 64),
    }
}

/// User + system CPU seconds of this process so far (None where `/proc` is unavailable).
fn cpu_seconds() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // Fields after the parenthesised command name; utime and stime are fields 14 and 15.
    let rest = &stat[stat.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks: f64 = f.get(11)?.parse::<f64>().ok()? + f.get(12)?.parse::<f64>().ok()?;
    Some(ticks / 100.0) // USER_HZ is 100 on Linux
}

fn main() {
    let mut presets = Vec::new();
    let (mut iters, mut threads, mut recompute) = (5usize, 2usize, Recompute::None);
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--iters" => iters = args.next().and_then(|v| v.parse().ok()).expect("--iters N"),
            "--threads" => {
                threads = args
                    .next()
                    .and_then(|v| v.parse().ok())
                    .expect("--threads T")
            }
            "--recompute" => {
                recompute = match args.next().as_deref() {
                    Some("full") => Recompute::Full,
                    Some("selective") => Recompute::Selective,
                    _ => Recompute::None,
                }
            }
            p => presets.push(p.to_string()),
        }
    }
    if presets.is_empty() {
        presets = vec!["tiny".into(), "small".into(), "medium".into()];
    }
    tensor::threads::set_thread_budget(threads).expect("thread budget");
    for name in presets {
        let cfg = ModelConfig::preset(&name).expect("preset");
        let m = Model::new(cfg.clone()).expect("model");
        let params = m.init_params(0);
        let mut grads = vec![0.0; m.num_params()];
        let (b, s) = shape(&name);
        let ids: Vec<u32> = (0..b * s)
            .map(|i| ((i * 7919 + 13) % cfg.vocab_size) as u32)
            .collect();
        let batch = Batch::next_token(b, s, &ids).expect("batch");
        let opts = StepOptions {
            recompute,
            loss_scale: 1.0,
        };
        let mut step = || {
            grads.fill(0.0);
            let t = Instant::now();
            let r = m
                .forward_backward(&params, &mut grads, &batch, &opts, &mut |_| {})
                .expect("step");
            (t.elapsed().as_secs_f64(), r.loss)
        };
        step(); // warm-up
        let cpu0 = cpu_seconds();
        let mut times: Vec<f64> = (0..iters).map(|_| step().0).collect();
        let cpu = cpu_seconds().zip(cpu0).map(|(a, b)| (a - b) / iters as f64);
        times.sort_by(f64::total_cmp);
        let med = times[times.len() / 2];
        println!(
            "{name}: params {:.2}M, batch {b} x seq {s}, threads {threads}, recompute {recompute:?}: \
             median {:.1} ms/step, {:.0} tokens/s (min {:.1} ms, max {:.1} ms)",
            m.num_params() as f64 / 1e6,
            med * 1e3,
            (b * s) as f64 / med,
            times[0] * 1e3,
            times[times.len() - 1] * 1e3
        );
        if let Some(c) = cpu {
            println!(
                "  cpu {:.2} s/step -> {:.0} tokens/s with {threads} uncontended cores (estimate)",
                c,
                (b * s) as f64 / (c / threads as f64)
            );
        }
        profile::reset();
        profile::enable(true);
        let (total, _) = step();
        profile::enable(false);
        let split: Vec<String> = profile::report()
            .into_iter()
            .filter(|(_, s)| *s > 0.0)
            .map(|(k, s)| format!("{k:?} {:.0}%", 100.0 * s / total))
            .collect();
        println!(
            "  split of one step ({:.1} ms): {}",
            total * 1e3,
            split.join(", ")
        );
    }
}
