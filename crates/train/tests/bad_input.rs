//! Bad input gives clear errors, never a panic: corrupt and truncated checkpoints, checksum
//! mismatches, interrupted saves, unknown config keys, missing or empty datasets, token ids
//! beyond the vocabulary, and parallel layouts this trainer does not run.
use train::checkpoint::SaveOptions;
use train::trainer::Trainer;
use train::{RunConfig, TrainError};

fn cfg(extra: &[&str]) -> RunConfig {
    let mut o: Vec<String> = vec!["data.corpus_bytes=50000".into(), "train.steps=4".into()];
    o.extend(extra.iter().map(|s| s.to_string()));
    RunConfig::resolve("tiny", None, &o).unwrap()
}

fn tmp(tag: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("xtrain-bad-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

#[test]
fn corrupt_checkpoints_are_refused() {
    let d = tmp("ck");
    let ck = d.join("ck");
    let mut t = Trainer::new(cfg(&[])).unwrap();
    t.train_step().unwrap();
    t.save_checkpoint(&ck, SaveOptions::default()).unwrap();
    // Bit flip in the weights: checksum mismatch naming the file.
    let w = ck.join("model.safetensors");
    let orig = std::fs::read(&w).unwrap();
    let mut bytes = orig.clone();
    let n = bytes.len();
    bytes[n / 2] ^= 0x40;
    std::fs::write(&w, &bytes).unwrap();
    let e = Trainer::from_checkpoint(&ck, &[]).err().unwrap();
    assert!(
        matches!(e, TrainError::Checksum { ref file, .. } if file == "model.safetensors"),
        "{e}"
    );
    // Truncated file.
    std::fs::write(&w, &orig[..n - 7]).unwrap();
    let e = Trainer::from_checkpoint(&ck, &[]).err().unwrap();
    assert!(e.to_string().contains("truncated"), "{e}");
    // A consistent manifest over a garbage safetensors file: the parser's error, no panic.
    std::fs::write(&w, b"garbage").unwrap();
    let man = ck.join("manifest.json");
    let mut m: serde_json::Value = serde_json::from_slice(&std::fs::read(&man).unwrap()).unwrap();
    m["files"]["model.safetensors"] =
        serde_json::json!({"bytes": 7, "crc32": crc32fast::hash(b"garbage")});
    std::fs::write(&man, serde_json::to_vec(&m).unwrap()).unwrap();
    let e = Trainer::from_checkpoint(&ck, &[]).err().unwrap();
    assert!(e.to_string().contains("model.safetensors"), "{e}");
    // Not a checkpoint at all.
    assert!(Trainer::from_checkpoint(&d.join("missing"), &[]).is_err());
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn interrupted_save_keeps_the_previous_checkpoint() {
    let d = tmp("crash");
    let ck = d.join("ck");
    let mut t = Trainer::new(cfg(&[])).unwrap();
    t.train_step().unwrap();
    t.save_checkpoint(&ck, SaveOptions::default()).unwrap();
    let saved: Vec<f32> = t.weights.master().to_vec();
    t.train_step().unwrap();
    for k in 0..4 {
        let e = t
            .save_checkpoint(
                &ck,
                SaveOptions {
                    fail_after_files: Some(k),
                },
            )
            .unwrap_err();
        assert!(e.to_string().contains("injected"), "{e}");
        let back = Trainer::from_checkpoint(&ck, &[]).unwrap();
        assert_eq!(back.step, 1);
        assert_eq!(back.weights.master(), &saved[..]);
    }
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
    let e = Trainer::new(cfg(&[&format!("data.path=\"{}\"", missing.display())]))
        .err()
        .unwrap();
    assert!(e.to_string().contains("does not exist"), "{e}");
    let empty = d.join("empty.txt");
    std::fs::write(&empty, "").unwrap();
    let e = Trainer::new(cfg(&[&format!("data.path=\"{}\"", empty.display())]))
        .err()
        .unwrap();
    assert!(e.to_string().contains("empty"), "{e}");
    // A token file for a larger vocabulary than the model's.
    let tok = d.join("big.tok");
    train::data::tokfile::write(&tok, &[1, 2, 299, 4], 300).unwrap();
    let e = Trainer::new(cfg(&[&format!("data.path=\"{}\"", tok.display())]))
        .err()
        .unwrap();
    assert!(e.to_string().contains("vocab size 300"), "{e}");
    // Multi-process layouts are refused until data parallelism is wired in.
    let e = Trainer::new(cfg(&["parallel.nproc=2"])).err().unwrap();
    assert!(matches!(e, TrainError::Unsupported(_)), "{e}");
    std::fs::remove_dir_all(&d).unwrap();
}
