//! The reshard matrix (in the spirit of Megatron's parallel-reconfiguration test): save under
//! layout A after 2 steps, resume under layout B for 2 more, for A and B each one of
//! {1 process; dp 2 ZeRO-0; dp 2 ZeRO-3; tp 2; tp 2 + sp; dp 2 × tp 2 ZeRO-1; bf16 dp 2;
//! pp 2 1F1B; pp 4 GPipe; pp 2 × dp 2 ZeRO-3 ZB-V; pp 2 DualPipe (two copies of the model);
//! cp 2 zigzag ring; cp 2 × dp 2 ZeRO-3 striped all-gather} (ranks as threads, the
//! same global batch of 4 sequences everywhere, a 4-layer model so that every pipeline
//! stage has a layer).
//!
//! - The checkpoint holds the full fp32 master weights: loaded at B and saved again at once,
//!   its Hugging Face export is byte for byte A's.
//! - fp32 → fp32: the resumed losses and gradient norms equal the single-process run's within
//!   1e-5 relative (the state is restored exactly; layouts differ only in the order of their
//!   sums), and equal the uninterrupted run of A bit for bit when B = A.
//! - bf16 → bf16 at the same layout: bit for bit too.
//! - Across precisions the run continues from the same master weights in the other format:
//!   each loss within 0.05 nats of the fp32 run (bf16's own drift, see the trainer's
//!   `bf16_mixed_tracks_fp32`).
use std::path::{Path, PathBuf};

use train::trainer::Trainer;
use train::RunConfig;

const LAYOUTS: [(&str, &[&str]); 13] = [
    ("single", &["parallel.nproc=1", "train.grad_accum=2"]),
    (
        "dp2z0",
        &["parallel.nproc=2", "parallel.dp=2", "parallel.zero=0"],
    ),
    (
        "dp2z3",
        &["parallel.nproc=2", "parallel.dp=2", "parallel.zero=3"],
    ),
    (
        "tp2",
        &["parallel.nproc=2", "parallel.tp=2", "train.grad_accum=2"],
    ),
    (
        "tp2sp",
        &[
            "parallel.nproc=2",
            "parallel.tp=2",
            "parallel.sp=true",
            "train.grad_accum=2",
        ],
    ),
    (
        "dp2tp2z1",
        &[
            "parallel.nproc=4",
            "parallel.dp=2",
            "parallel.tp=2",
            "parallel.zero=1",
        ],
    ),
    (
        "bf16dp2",
        &[
            "parallel.nproc=2",
            "parallel.dp=2",
            "parallel.zero=1",
            "train.precision=bf16",
        ],
    ),
    (
        "pp2",
        &[
            "parallel.nproc=2",
            "parallel.pp=2",
            "parallel.schedule=1f1b",
            "train.grad_accum=2",
        ],
    ),
    (
        "pp4",
        &[
            "parallel.nproc=4",
            "parallel.pp=4",
            "parallel.schedule=gpipe",
            "train.grad_accum=2",
        ],
    ),
    (
        "pp2dp2z3",
        &[
            "parallel.nproc=4",
            "parallel.pp=2",
            "parallel.dp=2",
            "parallel.zero=3",
            "parallel.schedule=zb-v",
        ],
    ),
    (
        "dualpipe",
        &[
            "parallel.nproc=2",
            "parallel.pp=2",
            "parallel.schedule=dualpipe",
            "train.micro_batch=1",
            "train.grad_accum=4",
        ],
    ),
    (
        "cp2",
        &["parallel.nproc=2", "parallel.cp=2", "train.grad_accum=2"],
    ),
    (
        "cp2dp2z3",
        &[
            "parallel.nproc=4",
            "parallel.cp=2",
            "parallel.dp=2",
            "parallel.zero=3",
            "parallel.cp_balance=striped",
            "parallel.cp_comm=allgather",
        ],
    ),
];

/// The layout settings every run shares.
const BASE: [&str; 8] = [
    "model.num_layers=4",
    "train.steps=4",
    "train.micro_batch=2",
    "model.seq_len=16",
    "data.corpus_bytes=20000",
    "train.warmup_steps=0",
    "train.min_lr=3e-3",
    "train.eval_batches=0",
];

/// The layout overrides of `layout`, with every degree reset first (B overrides A's saved
/// config, which may set others).
fn overrides(layout: &[&str]) -> Vec<String> {
    let reset = [
        "parallel.dp=1",
        "parallel.tp=1",
        "parallel.pp=1",
        "parallel.schedule=\"1f1b\"",
        "parallel.cp=1",
        "parallel.cp_balance=\"zigzag\"",
        "parallel.cp_comm=\"ring\"",
        "parallel.sp=false",
        "parallel.zero=0",
        "train.grad_accum=1",
        "train.micro_batch=2",
        "train.precision=\"fp32\"",
    ];
    reset.iter().chain(layout).map(|s| s.to_string()).collect()
}

fn config(layout: &[&str]) -> RunConfig {
    config_with(layout, &[])
}

/// [`config`] with `extra` settings of the model.
fn config_with(layout: &[&str], extra: &[&str]) -> RunConfig {
    let mut o: Vec<String> = BASE.iter().chain(extra).map(|s| s.to_string()).collect();
    o.extend(overrides(layout));
    RunConfig::resolve("tiny", None, &o).unwrap()
}

fn fp32(layout: &[&str]) -> bool {
    !layout.contains(&"train.precision=bf16")
}

/// One step's loss and global gradient norm (before clipping).
type Step = (f64, f32);

/// Runs `steps` steps of `cfg` on its processes (threads), from checkpoint `from` if given,
/// saving to `save_at_start` before the first step; returns rank 0's steps.
fn run(
    cfg: &RunConfig,
    from: Option<&Path>,
    save_at_start: Option<&Path>,
    steps: usize,
    save_at_end: Option<&Path>,
) -> Vec<Step> {
    comm::testing::run_threads(cfg.parallel.nproc, |c| {
        let mut t = match from {
            Some(ck) => Trainer::resume(cfg.clone(), ck, &c).unwrap(),
            None => Trainer::new(cfg.clone(), &c).unwrap(),
        };
        if let Some(dir) = save_at_start {
            t.save_checkpoint(dir).unwrap();
        }
        let losses = (0..steps)
            .map(|_| {
                let r = t.train_step().unwrap();
                (r.loss, r.stats.grad_norm)
            })
            .collect();
        if let Some(dir) = save_at_end {
            t.save_checkpoint(dir).unwrap();
        }
        losses
    })
    .remove(0)
}

/// Steps 3 and 4 of a resumed fp32 run (`rest`) against the single-process run's: losses and
/// gradient norms within 1e-5 relative.
fn assert_continues(what: &str, rest: &[Step], reference: &[Step]) {
    for (s, ((x, nx), (y, ny))) in rest.iter().zip(&reference[2..]).enumerate() {
        assert!(
            (nx - ny).abs() / ny.abs() < 1e-5,
            "{what} step {}: gradient norm {nx} vs {ny}",
            s + 3
        );
        assert!(
            (x - y).abs() / y.abs() < 1e-5,
            "{what} step {}: {x} vs {y}",
            s + 3
        );
    }
}

/// The Hugging Face weights file exported from checkpoint `ck`.
fn export(ck: &Path, out: &Path) -> Vec<u8> {
    train::hf::to_hf(ck, out).unwrap();
    std::fs::read(out.join("model.safetensors")).unwrap()
}

fn tmp() -> PathBuf {
    tmp_named("matrix")
}

fn tmp_named(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("xtrain-reshard-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

#[test]
fn every_layout_resumes_every_other() {
    let d = tmp();
    let reference = run(&config(LAYOUTS[0].1), None, None, 4, None);
    for (a, la) in LAYOUTS {
        let straight = run(&config(la), None, None, 4, None);
        let ck_a = d.join(a).join("ck");
        let first = run(&config(la), None, None, 2, Some(&ck_a));
        assert_eq!(first, straight[..2], "{a}: the same first steps");
        let hf_a = export(&ck_a, &d.join(a).join("hf"));
        // B's config is A's saved one with B's layout on top (what `--resume` does).
        let saved = {
            let ck = parallel::checkpoint::Checkpoint::open(&ck_a).unwrap();
            train::trainer::checkpoint_config_text(&ck).unwrap()
        };
        for (b, lb) in LAYOUTS {
            let cfg_b = RunConfig::resolve("tiny", Some(&saved), &overrides(lb)).unwrap();
            let what = format!("{a} -> {b}");
            let ck_ab = d.join(a).join(format!("to-{b}"));
            let rest = run(&cfg_b, Some(&ck_a), Some(&ck_ab), 2, None);
            assert_eq!(
                export(&ck_ab, &d.join(a).join(format!("hf-{b}"))),
                hf_a,
                "{what}: the Hugging Face export of the reloaded checkpoint"
            );
            if fp32(la) && fp32(lb) {
                assert_continues(&what, &rest, &reference);
            } else {
                for (s, ((x, _), (y, _))) in rest.iter().zip(&reference[2..]).enumerate() {
                    assert!(
                        (x - y).abs() < 0.05,
                        "{what} step {}: {x} vs fp32 {y}",
                        s + 3
                    );
                }
            }
            if a == b {
                let bits = |v: &[Step]| {
                    v.iter()
                        .map(|(l, n)| (l.to_bits(), n.to_bits()))
                        .collect::<Vec<_>>()
                };
                assert_eq!(bits(&rest), bits(&straight[2..]), "{what}: bit for bit");
            }
        }
    }
    let _ = std::fs::remove_dir_all(&d);
}

/// A model with tied embeddings saved at one layout resumes at another: the checkpoint holds
/// the embedding once (the head's copies are refilled from it), so the resumed losses and
/// gradient norms equal the single process's and the export is A's, byte for byte.
#[test]
fn tied_embeddings_resume_across_layouts() {
    let d = tmp_named("tied");
    let tied = ["model.tie_word_embeddings=true"];
    let pick = |names: &[&str]| -> Vec<(&str, &[&str])> {
        LAYOUTS
            .iter()
            .filter(|(n, _)| names.contains(n))
            .copied()
            .collect()
    };
    let reference = run(&config_with(LAYOUTS[0].1, &tied), None, None, 4, None);
    for (a, la) in pick(&["single", "pp2", "tp2sp"]) {
        let ck_a = d.join(a).join("ck");
        run(&config_with(la, &tied), None, None, 2, Some(&ck_a));
        let hf_a = export(&ck_a, &d.join(a).join("hf"));
        let saved = {
            let ck = parallel::checkpoint::Checkpoint::open(&ck_a).unwrap();
            train::trainer::checkpoint_config_text(&ck).unwrap()
        };
        for (b, lb) in pick(&["single", "dp2z3", "tp2sp", "pp2", "pp2dp2z3", "cp2"]) {
            let cfg_b = RunConfig::resolve("tiny", Some(&saved), &overrides(lb)).unwrap();
            assert!(cfg_b.model.tie_word_embeddings);
            let what = format!("tied {a} -> {b}");
            let ck_ab = d.join(a).join(format!("to-{b}"));
            let rest = run(&cfg_b, Some(&ck_a), Some(&ck_ab), 2, None);
            assert_eq!(
                export(&ck_ab, &d.join(a).join(format!("hf-{b}"))),
                hf_a,
                "{what}: the Hugging Face export of the reloaded checkpoint"
            );
            assert_continues(&what, &rest, &reference);
        }
    }
    let _ = std::fs::remove_dir_all(&d);
}
