//! Bad input gives clear errors, never a panic: corrupt and truncated checkpoints, checksum
//! mismatches, a failed save (the previous checkpoint stays whole), unknown config keys,
//! missing or empty datasets, token ids beyond the vocabulary, a layout that does not match
//! the processes, ranks on different kinds of device, model states larger than the memory.
use std::path::PathBuf;

use parallel::checkpoint::Checkpoint;
use train::trainer::{checkpoint_config_text, Trainer};
use train::RunConfig;

fn cfg(extra: &[&str]) -> RunConfig {
    let mut o: Vec<String> = vec!["data.corpus_bytes=50000".into(), "train.steps=4".into()];
    o.extend(extra.iter().map(|s| s.to_string()));
    RunConfig::resolve("tiny", None, &o).unwrap()
}

fn tmp(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("xtrain-bad-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Resumes checkpoint `ck` in one process, with its own config.
fn resume(ck: &std::path::Path) -> train::Result<Trainer> {
    let c = Checkpoint::open(ck)?;
    let cfg = RunConfig::resolve("tiny", Some(&checkpoint_config_text(&c)?), &[])?;
    Trainer::resume(cfg, ck, &comm::Communicator::single_process().unwrap())
}

#[test]
fn corrupt_checkpoints_are_refused() {
    let d = tmp("ck");
    let ck = d.join("ck");
    let mut t = Trainer::single(cfg(&[])).unwrap();
    t.train_step().unwrap();
    t.save_checkpoint(&ck).unwrap();
    assert_eq!(resume(&ck).unwrap().step, 1);
    // Bit flip in the weights: checksum mismatch naming the file.
    let w = ck.join("shard-00000.safetensors");
    let orig = std::fs::read(&w).unwrap();
    let mut bytes = orig.clone();
    let n = bytes.len();
    bytes[n / 2] ^= 0x40;
    std::fs::write(&w, &bytes).unwrap();
    let e = resume(&ck).err().unwrap().to_string();
    assert!(
        e.contains("checksum mismatch in shard-00000.safetensors"),
        "{e}"
    );
    // Truncated file.
    std::fs::write(&w, &orig[..n - 7]).unwrap();
    let e = resume(&ck).err().unwrap().to_string();
    assert!(e.contains("truncated"), "{e}");
    // A consistent manifest over a garbage safetensors file: the parser's error, no panic.
    std::fs::write(&w, b"garbage").unwrap();
    let man = ck.join("manifest.json");
    let mut m: serde_json::Value = serde_json::from_slice(&std::fs::read(&man).unwrap()).unwrap();
    m["files"]["shard-00000.safetensors"] =
        serde_json::json!({"bytes": 7, "crc32": crc32fast::hash(b"garbage")});
    std::fs::write(&man, serde_json::to_vec(&m).unwrap()).unwrap();
    let e = resume(&ck).err().unwrap().to_string();
    assert!(e.contains("shard-00000.safetensors"), "{e}");
    // A corrupt manifest, an older format, not a checkpoint at all.
    std::fs::write(&man, b"{not json").unwrap();
    let e = resume(&ck).err().unwrap().to_string();
    assert!(e.contains("corrupt manifest.json"), "{e}");
    std::fs::write(
        &man,
        br#"{"format": "xtrain-checkpoint", "version": 1, "files": {}}"#,
    )
    .unwrap();
    let e = resume(&ck).err().unwrap().to_string();
    assert!(e.contains("format version 1"), "{e}");
    let e = resume(&d.join("missing")).err().unwrap().to_string();
    assert!(e.contains("does not exist"), "{e}");
    std::fs::create_dir_all(d.join("old/rank-00000")).unwrap();
    let e = resume(&d.join("old")).err().unwrap().to_string();
    assert!(e.contains("older xtrain"), "{e}");
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn a_failed_save_keeps_the_previous_checkpoint() {
    let d = tmp("crash");
    let ck = d.join("ck");
    let mut t = Trainer::single(cfg(&[])).unwrap();
    t.train_step().unwrap();
    t.save_checkpoint(&ck).unwrap();
    let saved = t.exec.full_params().unwrap();
    t.train_step().unwrap();
    // Rank 0 fails after every shard is written (a file name the format refuses): the new
    // checkpoint never replaces the old one.
    let meta = parallel::checkpoint::SaveMeta {
        mesh: parallel::checkpoint::MeshRecord::from(&t.dims),
        precision: t.cfg.train.precision,
        state: t.state(),
        files: vec![("../escape".into(), b"x".to_vec())],
    };
    let e = parallel::checkpoint::save(
        &ck,
        t.comm().world(),
        &t.exec.checkpoint_pieces().unwrap(),
        &meta,
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("invalid file name"), "{e}");
    let back = resume(&ck).unwrap();
    assert_eq!(back.step, 1);
    assert_eq!(back.exec.full_params().unwrap(), saved);
    // The next save clears the stale staging directory and succeeds.
    t.save_checkpoint(&ck).unwrap();
    assert_eq!(resume(&ck).unwrap().step, 2);
    assert!(!d.join(".ck.tmp").exists());
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn bad_data_and_config() {
    let d = tmp("data");
    // Unknown key.
    let e = RunConfig::resolve("tiny", Some("[train]\nlearning_rate = 1.0\n"), &[]).unwrap_err();
    assert_eq!(e.to_string(), "config: unknown key `train.learning_rate`");
    // Missing and empty datasets.
    let missing = d.join("nope.txt");
    let e = Trainer::single(cfg(&[&format!("data.path=\"{}\"", missing.display())]))
        .err()
        .unwrap();
    assert!(e.to_string().contains("does not exist"), "{e}");
    let empty = d.join("empty.txt");
    std::fs::write(&empty, "").unwrap();
    let e = Trainer::single(cfg(&[&format!("data.path=\"{}\"", empty.display())]))
        .err()
        .unwrap();
    assert!(e.to_string().contains("empty"), "{e}");
    // A token file for a larger vocabulary than the model's.
    let tok = d.join("big.tok");
    train::data::tokfile::write(&tok, &[1, 2, 299, 4], 300).unwrap();
    let e = Trainer::single(cfg(&[&format!("data.path=\"{}\"", tok.display())]))
        .err()
        .unwrap();
    assert!(e.to_string().contains("vocab size 300"), "{e}");
    // A layout of two processes in a job of one.
    let e = Trainer::single(cfg(&["parallel.nproc=2", "parallel.dp=2"]))
        .err()
        .unwrap();
    assert!(
        e.to_string()
            .contains("parallel.nproc = 2 but the job has 1 process"),
        "{e}"
    );
    std::fs::remove_dir_all(&d).unwrap();
}

/// Ranks configured for different kinds of device are refused on every rank, naming each
/// rank's device, before any device is opened (rank 1 asks for a GPU this machine may not
/// have: the disagreement is reported first).
#[test]
fn ranks_on_different_kinds_of_device_are_refused() {
    let errs = comm::testing::run_threads(2, |c| {
        let base = cfg(&["parallel.nproc=2", "parallel.dp=2"]);
        let mut mine = base.clone();
        if c.rank() == 1 {
            mine.train.device = "cuda".into();
        }
        match Trainer::new(mine, &c) {
            Ok(_) => "trained".to_string(),
            Err(e) => e.to_string(),
        }
    });
    for e in errs {
        assert!(
            e.contains("rank 0 cpu, rank 1 cuda") && e.contains("XTRAIN_DEVICE"),
            "{e}"
        );
    }
}

/// Model states that cannot fit the host's memory (a 3 T-parameter model: 48 TiB at 16
/// bytes a parameter, more than any host has) are refused on every rank before anything is
/// allocated, naming the rank, the bytes by kind and the formula — not a failed allocation
/// or a kill later.
#[test]
fn model_states_that_cannot_fit_are_refused_before_allocating() {
    let errs = comm::testing::run_threads(2, |c| {
        let huge = cfg(&[
            "parallel.nproc=2",
            "parallel.dp=2",
            "parallel.zero=1",
            "model.hidden_size=32768",
            "model.intermediate_size=87381",
            "model.num_layers=256",
        ]);
        match Trainer::new(huge, &c) {
            Ok(_) => "trained".to_string(),
            Err(e) => e.to_string(),
        }
    });
    for (rank, e) in errs.iter().enumerate() {
        assert!(
            e.contains(&format!("rank {rank}: the model states need"))
                && e.contains("in host memory")
                && e.contains("ZeRO-1 in fp32: 8Φ + 8Φ/N")
                && e.contains("N = 2")
                && e.contains("xtrain plan"),
            "{e}"
        );
    }
}
