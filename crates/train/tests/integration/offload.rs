//! ZeRO-Offload (`parallel.offload = "optimizer"`): the fp32 master weights and AdamW moments
//! in host memory, AdamW on the CPU over them, the weights stored from the master. On the CPU
//! the same path runs with nothing to move — a separate master beside the weights, 16-bit
//! gradients landing in a host vector by the GPU's rules — so every
//! loss, grad norm and final parameter equals the run without offload bit for bit, at every
//! ZeRO stage, with a pipeline and in bf16; and checkpoints cross between the two modes with
//! the uninterrupted run's losses. (The GPU runs, where the state really moves, are in
//! `gpu_train.rs`.)
use std::path::{Path, PathBuf};

use train::RunConfig;

/// Layouts with 4 sequences per step. In bf16 the gradients land in a host vector bucket by
/// bucket as they become final (`executor::offload`, by the rules the GPU's page-locked
/// landing follows): ZeRO-3 with two micro-batches (its buckets reduced after each, final
/// after the second) and two pipeline stages check those rules — a gradient landed before
/// its last sum would change the step.
const LAYOUTS: [(&str, usize, &[&str]); 9] = [
    ("single", 1, &["train.grad_accum=4"]),
    ("dp2 ZeRO-0", 2, &["parallel.dp=2", "train.grad_accum=2"]),
    (
        "dp2 ZeRO-1",
        2,
        &["parallel.dp=2", "parallel.zero=1", "train.grad_accum=2"],
    ),
    (
        "dp2 ZeRO-2",
        2,
        &["parallel.dp=2", "parallel.zero=2", "train.grad_accum=2"],
    ),
    (
        "dp2 ZeRO-3",
        2,
        &["parallel.dp=2", "parallel.zero=3", "train.grad_accum=2"],
    ),
    ("pp2 1F1B", 2, &["parallel.pp=2", "train.grad_accum=4"]),
    (
        "dp2 ZeRO-1 bf16",
        2,
        &[
            "parallel.dp=2",
            "parallel.zero=1",
            "train.grad_accum=2",
            "train.precision=\"bf16\"",
        ],
    ),
    (
        "dp2 ZeRO-3 bf16",
        2,
        &[
            "parallel.dp=2",
            "parallel.zero=3",
            "train.grad_accum=2",
            "train.precision=\"bf16\"",
        ],
    ),
    (
        "pp2 1F1B bf16",
        2,
        &[
            "parallel.pp=2",
            "train.grad_accum=4",
            "train.precision=\"bf16\"",
        ],
    ),
];

fn config(nproc: usize, extra: &[&str], offload: bool) -> RunConfig {
    let o: Vec<String> = [
        "train.micro_batch=1",
        "model.seq_len=32",
        "train.warmup_steps=2",
        "train.eval_batches=0",
        "data.corpus_bytes=20000",
    ]
    .iter()
    .chain(extra)
    .map(|s| s.to_string())
    .chain([
        format!("parallel.nproc={nproc}"),
        format!(
            "parallel.offload=\"{}\"",
            if offload { "optimizer" } else { "none" }
        ),
    ])
    .collect();
    RunConfig::resolve("tiny", None, &o).unwrap()
}

fn tmp(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("xtrain-offload-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

/// [`crate::common::run_read_back`] of 4 sequences per step.
fn run(
    cfg: &RunConfig,
    nproc: usize,
    from: Option<&Path>,
    steps: usize,
    save: &Path,
) -> (Vec<(f64, f32)>, Vec<f32>) {
    crate::common::run_read_back(cfg, nproc, 4, (from, steps, save))
}

#[test]
fn offloaded_optimizer_changes_no_number() {
    let d = tmp("layouts");
    for (name, nproc, extra) in LAYOUTS {
        let (want, p_want) = run(&config(nproc, extra, false), nproc, None, 4, &d.join("a"));
        let (got, p_got) = run(&config(nproc, extra, true), nproc, None, 4, &d.join("b"));
        assert_eq!(got, want, "{name}: losses and grad norms");
        assert!(p_got == p_want, "{name}: parameters differ");
    }
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn checkpoints_cross_between_offloaded_and_resident_optimizers() {
    let d = tmp("resume");
    let (nproc, extra) = (LAYOUTS[2].1, LAYOUTS[2].2);
    let (straight, p_straight) = run(&config(nproc, extra, false), nproc, None, 4, &d.join("s"));
    for first in [true, false] {
        let ck = d.join(format!("first-{first}"));
        let (a, _) = run(&config(nproc, extra, first), nproc, None, 2, &ck);
        let (b, p) = run(
            &config(nproc, extra, !first),
            nproc,
            Some(&ck),
            2,
            &d.join(format!("then-{first}")),
        );
        assert_eq!([a, b].concat(), straight, "offload {first} then {}", !first);
        assert!(
            p == p_straight,
            "offload {first} then {}: parameters",
            !first
        );
    }
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn an_unknown_offload_is_a_config_error() {
    let e = RunConfig::resolve("tiny", None, &["parallel.offload=\"gradients\"".into()])
        .unwrap_err()
        .to_string();
    assert!(e.contains("expected none or optimizer"), "{e}");
}

/// Layouts of the delayed update: every update past the first runs beside the next step.
const DELAYED: [(&str, usize, &[&str]); 4] = [
    (
        "single bf16",
        1,
        &["train.grad_accum=4", "train.precision=\"bf16\""],
    ),
    (
        "dp2 ZeRO-1 bf16",
        2,
        &[
            "parallel.dp=2",
            "parallel.zero=1",
            "train.grad_accum=2",
            "train.precision=\"bf16\"",
        ],
    ),
    ("pp2 1F1B fp32", 2, &["parallel.pp=2", "train.grad_accum=4"]),
    (
        "tp2 sp bf16",
        2,
        &[
            "parallel.tp=2",
            "parallel.sp=true",
            "train.grad_accum=4",
            "train.precision=\"bf16\"",
        ],
    ),
];

fn delayed(nproc: usize, extra: &[&str], after: Option<u64>) -> RunConfig {
    let mut cfg = config(nproc, extra, true);
    cfg.parallel.delayed_update_after = after;
    cfg
}

/// The master weights a checkpoint holds, as saved (no held update applied).
fn saved_params(dir: &Path) -> Vec<f32> {
    use parallel::checkpoint::{Checkpoint, Kind};
    let (_, model, _, _) = train::trainer::load_model(dir).unwrap();
    let mut ck = Checkpoint::open(dir).unwrap();
    let mut p = vec![0.0f32; model.num_params()];
    for e in &model.layout.entries {
        let t = ck.tensor(Kind::Param, &e.name, e.view.numel()).unwrap();
        e.view.of_mut(&mut p).copy_from_slice(&t);
    }
    p
}

fn held(dir: &Path) -> bool {
    parallel::checkpoint::Checkpoint::open(dir)
        .unwrap()
        .manifest
        .state
        .pending_update
        .is_some()
}

#[test]
fn a_delayed_update_resumes_where_it_stopped() {
    let d = tmp("delayed-resume");
    for (name, nproc, extra) in DELAYED {
        let cfg = delayed(nproc, extra, Some(1));
        let (straight, p_straight) = run(&cfg, nproc, None, 4, &d.join("s"));
        let ck = d.join("first");
        let (a, _) = run(&cfg, nproc, None, 2, &ck);
        assert!(held(&ck), "{name}: the checkpoint holds step 2's update");
        let (b, p) = run(&cfg, nproc, Some(&ck), 2, &d.join("then"));
        assert_eq!([a, b].concat(), straight, "{name}: losses and grad norms");
        assert!(p == p_straight, "{name}: parameters");
        // The delay is real: the same run updating in place differs from step 3 on.
        let (in_place, _) = run(&delayed(nproc, extra, None), nproc, None, 3, &d.join("i"));
        assert_eq!(
            in_place[..2],
            straight[..2],
            "{name}: before the first stale step"
        );
        assert_ne!(
            in_place[2], straight[2],
            "{name}: step 3 is taken one update late"
        );
    }
    // At another layout: the held gradients reshard like the moments. fp32 dp2 ZeRO-1 (each
    // rank holding its shard's) resumed as pp2 (each rank its stage's) tracks the
    // uninterrupted dp2 run within 1e-5, as layouts track one another.
    let dp2 = ["parallel.dp=2", "parallel.zero=1", "train.grad_accum=2"];
    let pp2 = ["parallel.pp=2", "train.grad_accum=4"];
    let (straight, p_straight) = run(&delayed(2, &dp2, Some(1)), 2, None, 4, &d.join("s2"));
    let ck = d.join("dp2");
    let (a, _) = run(&delayed(2, &dp2, Some(1)), 2, None, 2, &ck);
    let (b, p) = run(&delayed(2, &pp2, Some(1)), 2, Some(&ck), 2, &d.join("pp2"));
    for (s, ((l, n), (wl, wn))) in [a, b].concat().iter().zip(&straight).enumerate() {
        let rel = |x: f64, w: f64| (x - w).abs() / w.abs();
        assert!(
            rel(*l, *wl) < 1e-5 && rel(*n as f64, *wn as f64) < 1e-5,
            "dp2 ZeRO-1 then pp2, step {s}: {l} {n} vs {wl} {wn}"
        );
    }
    let scale = p_straight.iter().fold(0.0f32, |m, x| m.max(x.abs()));
    let err = p
        .iter()
        .zip(&p_straight)
        .fold(0.0f32, |m, (x, y)| m.max((x - y).abs()));
    assert!(
        err <= 1e-5 * scale,
        "dp2 ZeRO-1 then pp2: parameters {:e}",
        err / scale
    );
    let _ = std::fs::remove_dir_all(&d);
}

/// A checkpoint taken between a held update and the step it runs beside: whoever reads it
/// otherwise than a delaying run applies the update first — `load_model` (export,
/// generation) and a run that updates in place — and gets the weights the delaying run's
/// own update thread makes.
#[test]
fn a_held_update_is_applied_by_every_other_reader() {
    let d = tmp("delayed-readers");
    let (nproc, extra) = (DELAYED[0].1, DELAYED[0].2);
    let cfg = delayed(nproc, extra, Some(1));
    let (ck2, ck3) = (d.join("2"), d.join("3"));
    let _ = run(&cfg, nproc, None, 2, &ck2);
    let _ = run(&cfg, nproc, Some(&ck2), 1, &ck3);
    let (_, exported) = run(&cfg, nproc, Some(&ck2), 0, &d.join("again"));
    let by_the_thread = saved_params(&ck3);
    assert!(
        exported == by_the_thread,
        "load_model applies the held update"
    );
    assert!(
        saved_params(&ck2) != by_the_thread,
        "step 2's update was held"
    );
    let plain = d.join("plain");
    let _ = run(&delayed(nproc, extra, None), nproc, Some(&ck2), 0, &plain);
    assert!(!held(&plain));
    assert!(
        saved_params(&plain) == by_the_thread,
        "a run updating in place applies it on loading"
    );
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn a_delayed_update_without_offload_is_a_config_error() {
    let resolve = |o: &[&str]| {
        let o: Vec<String> = o.iter().map(|s| s.to_string()).collect();
        RunConfig::resolve("tiny", None, &o)
    };
    let e = resolve(&["parallel.delayed_update_after=10"])
        .unwrap_err()
        .to_string();
    assert!(e.contains("needs parallel.offload"), "{e}");
    for bad in ["-3", "\"soon\"", "1.5"] {
        let e = resolve(&[&format!("parallel.delayed_update_after={bad}")])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("a number of steps (0 or more) or \"none\""),
            "{bad}: {e}"
        );
    }
    // "none" turns it off (a resumed run's config holds the number).
    let off = [
        "parallel.delayed_update_after=3",
        "parallel.delayed_update_after=\"none\"",
    ];
    assert_eq!(resolve(&off).unwrap().parallel.delayed_update_after, None);
}
