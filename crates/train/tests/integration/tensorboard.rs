//! The TensorBoard event files of real runs, read back by a decoder written here from the
//! formats (TFRecord framing with a bitwise CRC-32C, protobuf `Event` / `Summary`), not with
//! the writer's code: the scalars equal `metrics.jsonl`, the config is there as text, and a
//! run resumed from an earlier checkpoint leaves each step once over the folder's files.
//! Where Python's `tensorboard` package is installed, its event accumulator reads the folder
//! too.
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use train::run::{run, RunOptions};
use train::trainer::Trainer;
use train::RunConfig;

fn cfg(steps: usize, extra: &[&str]) -> RunConfig {
    let mut o: Vec<String> = [
        format!("train.steps={steps}"),
        "train.warmup_steps=2".into(),
        "train.eval_every=3".into(),
        "train.eval_batches=1".into(),
        "train.sample_tokens=0".into(),
        "data.corpus_bytes=100000".into(),
    ]
    .into();
    o.extend(extra.iter().map(|s| s.to_string()));
    RunConfig::resolve("tiny", None, &o).unwrap()
}

fn tmp(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("xtrain-tb-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

/// CRC-32C bit by bit (reflected Castagnoli polynomial), masked as TFRecord stores it.
fn masked_crc32c(data: &[u8]) -> u32 {
    let mut c = !0u32;
    for &b in data {
        c ^= b as u32;
        for _ in 0..8 {
            c = (c >> 1) ^ (0x82F6_3B78 & (c & 1).wrapping_neg());
        }
    }
    let c = !c;
    c.rotate_right(15).wrapping_add(0xa282_ead8)
}

/// A protobuf field: number and value.
#[derive(Debug)]
enum Field<'a> {
    Varint(u64),
    Fixed64(u64),
    Fixed32(u32),
    Bytes(&'a [u8]),
}

fn varint(b: &[u8], at: &mut usize) -> u64 {
    let mut v = 0;
    for shift in (0..64).step_by(7) {
        let x = b[*at];
        *at += 1;
        v |= ((x & 0x7f) as u64) << shift;
        if x & 0x80 == 0 {
            return v;
        }
    }
    panic!("varint longer than 10 bytes");
}

fn message(b: &[u8]) -> Vec<(u64, Field<'_>)> {
    let (mut at, mut out) = (0, Vec::new());
    while at < b.len() {
        let key = varint(b, &mut at);
        let f = match key & 7 {
            0 => Field::Varint(varint(b, &mut at)),
            1 => {
                at += 8;
                Field::Fixed64(u64::from_le_bytes(b[at - 8..at].try_into().unwrap()))
            }
            5 => {
                at += 4;
                Field::Fixed32(u32::from_le_bytes(b[at - 4..at].try_into().unwrap()))
            }
            2 => {
                let n = varint(b, &mut at) as usize;
                at += n;
                Field::Bytes(&b[at - n..at])
            }
            w => panic!("wire type {w}"),
        };
        out.push((key >> 3, f));
    }
    assert_eq!(at, b.len(), "a field runs past its message");
    out
}

fn bytes_of<'a>(m: &[(u64, Field<'a>)], n: u64) -> Vec<&'a [u8]> {
    m.iter()
        .filter_map(|(k, f)| match f {
            Field::Bytes(b) if *k == n => Some(*b),
            _ => None,
        })
        .collect()
}

/// What the decoder makes of one events file.
#[derive(Default)]
struct Events {
    file_version: Option<String>,
    /// (tag, step) → simple_value.
    scalars: BTreeMap<(String, u64), f32>,
    /// (tag, step, plugin, text).
    texts: Vec<(String, u64, String, String)>,
    wall_times: Vec<f64>,
}

fn decode(path: &Path, into: &mut Events) {
    let b = std::fs::read(path).unwrap();
    let mut at = 0;
    let mut first = true;
    while at < b.len() {
        let len = &b[at..at + 8];
        let crc = u32::from_le_bytes(b[at + 8..at + 12].try_into().unwrap());
        assert_eq!(masked_crc32c(len), crc, "length CRC at {at}");
        let n = u64::from_le_bytes(len.try_into().unwrap()) as usize;
        let data = &b[at + 12..at + 12 + n];
        let crc = u32::from_le_bytes(b[at + 12 + n..at + 16 + n].try_into().unwrap());
        assert_eq!(masked_crc32c(data), crc, "data CRC at {at}");
        at += 16 + n;
        let event = message(data);
        let mut step = 0;
        for (k, f) in &event {
            match (k, f) {
                (1, Field::Fixed64(w)) => into.wall_times.push(f64::from_bits(*w)),
                (2, Field::Varint(s)) => step = *s,
                (3, Field::Bytes(v)) => {
                    assert!(first, "file_version only in the first record");
                    into.file_version = Some(String::from_utf8(v.to_vec()).unwrap());
                }
                (5, Field::Bytes(_)) => {}
                other => panic!("unexpected Event field {other:?}"),
            }
        }
        assert!(
            !first || into.file_version.is_some(),
            "the first record has the version"
        );
        first = false;
        for summary in bytes_of(&event, 5) {
            for value in bytes_of(&message(summary), 1) {
                let v = message(value);
                let tag = String::from_utf8(bytes_of(&v, 1)[0].to_vec()).unwrap();
                if let Some((_, Field::Fixed32(x))) = v.iter().find(|f| f.0 == 2) {
                    let old = into.scalars.insert((tag.clone(), step), f32::from_bits(*x));
                    assert!(old.is_none(), "{tag} twice at step {step}");
                    continue;
                }
                let meta = message(bytes_of(&v, 9)[0]);
                let plugin = message(bytes_of(&meta, 1)[0]);
                let plugin = String::from_utf8(bytes_of(&plugin, 1)[0].to_vec()).unwrap();
                let tensor = message(bytes_of(&v, 8)[0]);
                assert!(matches!(
                    tensor.iter().find(|f| f.0 == 1),
                    Some((_, Field::Varint(7)))
                ));
                assert_eq!(bytes_of(&tensor, 2), [&[] as &[u8]], "a scalar shape");
                let text = String::from_utf8(bytes_of(&tensor, 8)[0].to_vec()).unwrap();
                into.texts.push((tag, step, plugin, text));
            }
        }
    }
}

fn event_files(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| {
            p.file_name()
                .unwrap()
                .to_str()
                .unwrap()
                .contains("tfevents")
        })
        .collect();
    v.sort();
    v
}

/// Every scalar of `metrics.jsonl` is in the events at its step, as an f32.
fn assert_matches_metrics(ev: &Events, out: &Path) -> usize {
    let recs = train::metrics::read(&out.join("metrics.jsonl")).unwrap();
    let mut n = 0;
    for r in &recs {
        let fields = [
            ("loss/train", Some(r.loss)),
            ("loss/validation", r.val_loss),
            ("train/lr", Some(r.lr)),
            ("train/grad_norm", Some(r.grad_norm)),
            ("perf/tokens_per_s", Some(r.tokens_per_s)),
            ("perf/mfu", Some(r.mfu)),
        ];
        for (tag, want) in fields {
            let got = ev.scalars.get(&(tag.to_string(), r.step as u64));
            match want {
                Some(w) => {
                    assert_eq!(got, Some(&(w as f32)), "{tag} at step {}", r.step);
                    n += 1;
                }
                None => assert_eq!(got, None, "{tag} at step {}", r.step),
            }
        }
        let mem = ("memory/rank0/accounted_mib".to_string(), r.step as u64);
        assert!(ev.scalars[&mem] > 0.0);
    }
    // Nothing logged for a step that metrics.jsonl does not have.
    let steps: Vec<u64> = recs.iter().map(|r| r.step as u64).collect();
    for (tag, s) in ev.scalars.keys() {
        assert!(steps.contains(s), "{tag} at step {s} beyond metrics.jsonl");
    }
    n
}

#[test]
fn a_run_writes_its_scalars_and_config_and_a_resume_appends_without_repeats() {
    let out = tmp("run");
    let opts = RunOptions {
        out_dir: out.clone(),
        quiet: true,
        trace: None,
    };
    let c = cfg(6, &["train.ckpt_every=3"]);
    run(&mut Trainer::single(c.clone()).unwrap(), &opts).unwrap();
    let files = event_files(&out);
    assert_eq!(files.len(), 1);
    let name = files[0].file_name().unwrap().to_str().unwrap();
    assert!(
        name.starts_with("events.out.tfevents.") && name.ends_with(".xtrain"),
        "{name}"
    );
    let mut ev = Events::default();
    decode(&files[0], &mut ev);
    assert_eq!(ev.file_version.as_deref(), Some("brain.Event:2"));
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64();
    assert!(ev.wall_times.iter().all(|&w| w > now - 600.0 && w <= now));
    // Five scalars every step, and the validations at steps 3 and 6.
    assert_eq!(assert_matches_metrics(&ev, &out), 6 * 5 + 2);
    assert_eq!(ev.texts.len(), 1);
    let (tag, step, plugin, text) = &ev.texts[0];
    assert_eq!(
        (tag.as_str(), *step, plugin.as_str()),
        ("config", 0, "text")
    );
    let toml: String = text
        .lines()
        .map(|l| l.trim_start().to_string() + "\n")
        .collect();
    assert_eq!(
        toml.parse::<toml::Table>().unwrap()["train"]["steps"].as_integer(),
        Some(6)
    );

    // Resumed from step 3 after the run went on to 6: steps 4-6 leave the first file, and the
    // new file holds 4-8 and the resumed config.
    let ck = out.join("checkpoints/step_000003");
    let comm = comm::Communicator::single_process().unwrap();
    let mut t = Trainer::resume(cfg(8, &[]), &ck, &comm).unwrap();
    run(&mut t, &opts).unwrap();
    let files = event_files(&out);
    assert_eq!(files.len(), 2);
    let (mut first, mut all) = (Events::default(), Events::default());
    decode(&files[0], &mut first);
    assert_eq!(first.scalars.keys().map(|k| k.1).max(), Some(3));
    for f in &files {
        decode(f, &mut all);
    }
    assert_eq!(assert_matches_metrics(&all, &out), 8 * 5 + 3);
    let texts: Vec<u64> = all.texts.iter().map(|t| t.1).collect();
    assert_eq!(texts, [0, 4]);

    python_reads(&out, &all);
    std::fs::remove_dir_all(&out).unwrap();
}

#[test]
fn switched_off_writes_no_event_file() {
    let out = tmp("off");
    let opts = RunOptions {
        out_dir: out.clone(),
        quiet: true,
        trace: None,
    };
    let c = cfg(2, &["train.tensorboard=false"]);
    run(&mut Trainer::single(c).unwrap(), &opts).unwrap();
    assert!(out.join("metrics.jsonl").is_file());
    assert!(event_files(&out).is_empty());
    std::fs::remove_dir_all(&out).unwrap();
}

/// A pipeline run on two ranks (threads): rank 0 writes the one event file, with the measured
/// bubble of every step and the simulated one, every rank's accounted memory and peak RSS,
/// and the scalars of `metrics.jsonl`.
#[test]
fn a_pipeline_run_logs_its_bubble_and_every_rank_s_memory() {
    let out = tmp("pp");
    let c = cfg(
        4,
        &[
            "parallel.nproc=2",
            "parallel.pp=2",
            "parallel.schedule=\"1f1b\"",
            "train.grad_accum=4",
            "train.micro_batch=1",
        ],
    );
    let opts = RunOptions {
        out_dir: out.clone(),
        quiet: true,
        trace: None,
    };
    comm::testing::run_threads(2, |comm| {
        let mut t = Trainer::new(c.clone(), &comm).unwrap();
        run(&mut t, &opts).unwrap();
    });
    let files = event_files(&out);
    assert_eq!(files.len(), 1, "rank 0 alone writes events");
    let mut ev = Events::default();
    decode(&files[0], &mut ev);
    assert_matches_metrics(&ev, &out);
    for step in 1..=4u64 {
        let b = ev.scalars[&("pipeline/bubble_measured".to_string(), step)];
        assert!((0.0..1.0).contains(&b), "bubble {b} at step {step}");
    }
    let sim = ev.scalars[&("pipeline/bubble_simulated".to_string(), 4)];
    assert!((0.0..1.0).contains(&sim), "simulated bubble {sim}");
    for rank in [0, 1] {
        let acc = format!("memory/rank{rank}/accounted_mib");
        assert!(ev.scalars[&(acc, 4)] > 0.0, "rank {rank}'s account");
    }
    std::fs::remove_dir_all(&out).unwrap();
}

/// TensorBoard's own reader, where it is installed: the same scalar tags and steps.
fn python_reads(dir: &Path, ev: &Events) {
    let probe = std::process::Command::new("python3")
        .args(["-c", "import tensorboard"])
        .output();
    if !probe.is_ok_and(|o| o.status.success()) {
        eprintln!("skipped: Python's tensorboard package is not installed; the events were checked by this test's own decoder only");
        return;
    }
    let script = r#"
import sys
from tensorboard.backend.event_processing import event_accumulator as ea
acc = ea.EventAccumulator(sys.argv[1], size_guidance={ea.SCALARS: 0, ea.TENSORS: 0})
acc.Reload()
for tag in sorted(acc.Tags()["scalars"]):
    for e in acc.Scalars(tag):
        print(f"{tag} {e.step} {e.value!r}")
for tag in acc.Tags()["tensors"]:
    for e in acc.Tensors(tag):
        print(f"text {tag} {e.step}")
"#;
    let o = std::process::Command::new("python3")
        .args(["-c", script, dir.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let text = String::from_utf8(o.stdout).unwrap();
    let mut got = BTreeMap::new();
    let mut texts = Vec::new();
    for line in text.lines() {
        let w: Vec<&str> = line.split(' ').collect();
        if w[0] == "text" {
            texts.push((w[1].to_string(), w[2].parse::<u64>().unwrap()));
        } else {
            let v: f64 = w[2].parse().unwrap();
            got.insert((w[0].to_string(), w[1].parse::<u64>().unwrap()), v as f32);
        }
    }
    let want: BTreeMap<_, _> = ev.scalars.iter().map(|(k, v)| (k.clone(), *v)).collect();
    let same = |a: &f32, b: &f32| a == b || (a.is_nan() && b.is_nan());
    assert_eq!(got.len(), want.len(), "tensorboard read {got:?}");
    for (k, v) in &want {
        assert!(same(&got[k], v), "{k:?}: tensorboard {} vs {v}", got[k]);
    }
    assert!(texts.iter().any(|t| t.0.starts_with("config")), "{texts:?}");
}
