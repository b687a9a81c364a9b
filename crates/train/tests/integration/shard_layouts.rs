//! A shard folder trains the same at every layout: single process, dp 2, tp 2, pp 2 (1F1B)
//! and cp 2 (ranks as threads, the same global batch of 4 sequences) give the single-process
//! losses within 1e-5 relative (fp32; layouts differ only in the order of their sums), and a
//! run checkpointed at one layout and resumed at another continues the single-process losses,
//! so sampling continues exactly where it stopped. A resumed run drawing from another data
//! stream fails that comparison, so it does test the sampling.
use std::path::{Path, PathBuf};

use train::data::prepare::{prepare, PrepareOptions};
use train::data::Tokenizer;
use train::trainer::{checkpoint_config_text, Trainer};
use train::RunConfig;

/// The layouts, each with 4 sequences per optimizer step.
const LAYOUTS: [(&str, &[&str]); 5] = [
    ("single", &["parallel.nproc=1", "train.grad_accum=2"]),
    ("dp2", &["parallel.nproc=2", "parallel.dp=2"]),
    (
        "tp2",
        &["parallel.nproc=2", "parallel.tp=2", "train.grad_accum=2"],
    ),
    (
        "pp2",
        &[
            "parallel.nproc=2",
            "parallel.pp=2",
            "parallel.schedule=\"1f1b\"",
            "train.grad_accum=2",
        ],
    ),
    (
        "cp2",
        &["parallel.nproc=2", "parallel.cp=2", "train.grad_accum=2"],
    ),
];

const STEPS: usize = 4;
/// Steps before the checkpoint of a resumed run.
const SAVED_AT: usize = 2;

fn tmp() -> PathBuf {
    let d = std::env::temp_dir().join(format!("xtrain-shard-layouts-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// A byte-tokenized shard folder of several shards: the built-in corpus's lines as JSONL
/// documents.
fn shard_folder(d: &Path) -> PathBuf {
    let lines: String = train::data::corpus::generate(11, 60_000)
        .lines()
        .map(|l| format!("{}\n", serde_json::json!({ "text": l })))
        .collect();
    std::fs::write(d.join("corpus.jsonl"), lines).unwrap();
    let out = d.join("shards");
    let o = PrepareOptions {
        field: "text".into(),
        shard_tokens: 8000,
        tokenizer_name: "byte".into(),
        eos: None,
        bos: None,
        progress: false,
    };
    let m = prepare(&[d.join("corpus.jsonl")], &Tokenizer::Byte, &out, &o)
        .unwrap()
        .manifest;
    assert!(m.shards.len() >= 5, "{} shards", m.shards.len());
    out
}

/// The layout's overrides after resetting every degree (a resumed run's config is the saved
/// one, which may set others).
fn overrides(layout: &[&str]) -> Vec<String> {
    [
        "parallel.dp=1",
        "parallel.tp=1",
        "parallel.pp=1",
        "parallel.cp=1",
        "train.grad_accum=1",
    ]
    .iter()
    .chain(layout)
    .map(|s| s.to_string())
    .collect()
}

fn config(folder: &Path, layout: &[&str]) -> RunConfig {
    let mut o: Vec<String> = [
        format!("data.path=\"{}\"", folder.display()),
        format!("train.steps={STEPS}"),
        "train.micro_batch=2".into(),
        "model.seq_len=16".into(),
        "train.warmup_steps=0".into(),
        "train.eval_batches=0".into(),
        "train.sample_tokens=0".into(),
    ]
    .into();
    o.extend(overrides(layout));
    RunConfig::resolve("tiny", None, &o).unwrap()
}

/// Rank 0's losses of `steps` steps of `cfg` (ranks as threads), resumed from `from` if given
/// (with `perturb` applied to the resumed trainer), saving to `save` at the end if given.
fn losses(
    cfg: &RunConfig,
    from: Option<&Path>,
    perturb: fn(&mut Trainer),
    steps: usize,
    save: Option<&Path>,
) -> Vec<f64> {
    comm::testing::run_threads(cfg.parallel.nproc, |c| {
        let mut t = match from {
            Some(ck) => {
                let mut t = Trainer::resume(cfg.clone(), ck, &c).unwrap();
                perturb(&mut t);
                t
            }
            None => Trainer::new(cfg.clone(), &c).unwrap(),
        };
        assert!(t.data.source.contains("shard folder"), "{}", t.data.source);
        let l = (0..steps).map(|_| t.train_step().unwrap().loss).collect();
        if let Some(dir) = save {
            t.save_checkpoint(dir).unwrap();
        }
        l
    })
    .remove(0)
}

fn assert_close(got: &[f64], want: &[f64], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}");
    for (s, (x, y)) in got.iter().zip(want).enumerate() {
        assert!(
            (x - y).abs() / y.abs() < 1e-5,
            "{what}: loss {s} {x} vs {y} ({got:?} vs {want:?})"
        );
    }
}

/// B's config: A's saved one with B's layout on top (what `--resume` does).
fn resumed_config(ck: &Path, layout: &[&str]) -> RunConfig {
    let ck = parallel::checkpoint::Checkpoint::open(ck).unwrap();
    let saved = checkpoint_config_text(&ck).unwrap();
    RunConfig::resolve("tiny", Some(&saved), &overrides(layout)).unwrap()
}

#[test]
fn every_layout_trains_and_resumes_a_shard_folder_like_one_process() {
    let d = tmp();
    let folder = shard_folder(&d);
    let keep = |_: &mut Trainer| {};
    let want = losses(&config(&folder, LAYOUTS[0].1), None, keep, STEPS, None);
    for (name, layout) in &LAYOUTS[1..] {
        let got = losses(&config(&folder, layout), None, keep, STEPS, None);
        assert_close(&got, &want, name);
    }
    // Each layout saves once and resumes once, at the next one.
    for (i, (a, la)) in LAYOUTS.iter().enumerate() {
        let (b, lb) = LAYOUTS[(i + 1) % LAYOUTS.len()];
        let ck = d.join(format!("ck-{a}"));
        let first = losses(&config(&folder, la), None, keep, SAVED_AT, Some(&ck));
        assert_close(&first, &want[..SAVED_AT], &format!("{a} before saving"));
        let cfg_b = resumed_config(&ck, lb);
        let rest = losses(&cfg_b, Some(&ck), keep, STEPS - SAVED_AT, None);
        assert_close(&rest, &want[SAVED_AT..], &format!("{a} -> {b} resumed"));
        if i == 0 {
            // The control: the same weights on another stream's samples are told apart.
            let other = losses(&cfg_b, Some(&ck), |t| t.sampler.seed ^= 1, 1, None);
            assert!(
                (other[0] - want[SAVED_AT]).abs() / want[SAVED_AT].abs() > 1e-3,
                "another data stream gave step {}'s loss {}",
                SAVED_AT + 1,
                other[0]
            );
        }
    }
    std::fs::remove_dir_all(&d).unwrap();
}
