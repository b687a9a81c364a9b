//! Checkpoint directories: written atomically, verified on load.
//!
//! A checkpoint is a directory of files plus `manifest.json` listing each file's size and CRC-32.
//! Saving writes everything into a sibling temporary directory, fsyncs each file and the
//! directory, and only then renames it into place, so a crash (or an injected failure) mid-save
//! leaves the previous checkpoint untouched. Loading recomputes every CRC before any byte is
//! interpreted. A run directory points at its newest checkpoint through the file `latest`
//! (itself replaced atomically by write-then-rename).
use crate::error::{IoContext, Result, TrainError};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};

pub const MANIFEST: &str = "manifest.json";
pub const FORMAT_VERSION: u32 = 1;

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FileEntry {
    pub bytes: u64,
    pub crc32: u32,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    pub format: String,
    pub version: u32,
    pub files: BTreeMap<String, FileEntry>,
}

/// Test hook: make a save fail after writing this many files (simulates a crash mid-save).
#[derive(Clone, Copy, Debug, Default)]
pub struct SaveOptions {
    pub fail_after_files: Option<usize>,
}

fn ck_err(path: &Path, msg: impl Into<String>) -> TrainError {
    TrainError::Checkpoint {
        path: path.to_path_buf(),
        msg: msg.into(),
    }
}

fn write_synced(path: &Path, bytes: &[u8]) -> Result<()> {
    let mut f = std::fs::File::create(path).ctx(|| format!("creating {}", path.display()))?;
    f.write_all(bytes)
        .ctx(|| format!("writing {}", path.display()))?;
    f.sync_all().ctx(|| format!("syncing {}", path.display()))
}

fn sync_dir(path: &Path) -> Result<()> {
    std::fs::File::open(path)
        .and_then(|d| d.sync_all())
        .ctx(|| format!("syncing directory {}", path.display()))
}

/// Writes `files` (name, bytes) as checkpoint `dir`, atomically replacing any existing one.
pub fn save(dir: &Path, files: &[(String, Vec<u8>)], opts: SaveOptions) -> Result<()> {
    let parent = dir
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    std::fs::create_dir_all(parent).ctx(|| format!("creating {}", parent.display()))?;
    let name = dir
        .file_name()
        .ok_or_else(|| ck_err(dir, "checkpoint path has no file name"))?;
    let tmp = parent.join(format!(
        ".{}.tmp-{}",
        name.to_string_lossy(),
        std::process::id()
    ));
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).ctx(|| format!("removing stale {}", tmp.display()))?;
    }
    std::fs::create_dir(&tmp).ctx(|| format!("creating {}", tmp.display()))?;
    let mut manifest = Manifest {
        format: "xtrain-checkpoint".into(),
        version: FORMAT_VERSION,
        files: BTreeMap::new(),
    };
    for (i, (fname, bytes)) in files.iter().enumerate() {
        if opts.fail_after_files == Some(i) {
            return Err(ck_err(dir, format!("injected failure after {i} files")));
        }
        if fname == MANIFEST || fname.contains('/') {
            return Err(ck_err(dir, format!("invalid checkpoint file name {fname}")));
        }
        write_synced(&tmp.join(fname), bytes)?;
        manifest.files.insert(
            fname.clone(),
            FileEntry {
                bytes: bytes.len() as u64,
                crc32: crc32fast::hash(bytes),
            },
        );
    }
    let text = serde_json::to_vec_pretty(&manifest).expect("manifest serialises");
    write_synced(&tmp.join(MANIFEST), &text)?;
    sync_dir(&tmp)?;
    // Move any previous checkpoint of the same name aside only now that the new one is whole.
    let old = parent.join(format!(
        ".{}.old-{}",
        name.to_string_lossy(),
        std::process::id()
    ));
    let had_old = dir.exists();
    if had_old {
        std::fs::rename(dir, &old).ctx(|| format!("moving aside {}", dir.display()))?;
    }
    std::fs::rename(&tmp, dir).ctx(|| format!("renaming {} into place", tmp.display()))?;
    sync_dir(parent)?;
    if had_old {
        std::fs::remove_dir_all(&old).ctx(|| format!("removing {}", old.display()))?;
    }
    Ok(())
}

/// Reads and verifies every file of checkpoint `dir`; returns them by name.
pub fn load(dir: &Path) -> Result<BTreeMap<String, Vec<u8>>> {
    if !dir.is_dir() {
        return Err(ck_err(dir, "is not a directory"));
    }
    let mpath = dir.join(MANIFEST);
    let text =
        std::fs::read(&mpath).map_err(|e| ck_err(dir, format!("reading {MANIFEST}: {e}")))?;
    let manifest: Manifest = serde_json::from_slice(&text)
        .map_err(|e| ck_err(dir, format!("corrupt {MANIFEST}: {e}")))?;
    if manifest.format != "xtrain-checkpoint" || manifest.version != FORMAT_VERSION {
        return Err(ck_err(
            dir,
            format!(
                "unsupported format {} v{}",
                manifest.format, manifest.version
            ),
        ));
    }
    let mut out = BTreeMap::new();
    for (name, entry) in &manifest.files {
        let bytes = std::fs::read(dir.join(name))
            .map_err(|e| ck_err(dir, format!("reading {name}: {e}")))?;
        if bytes.len() as u64 != entry.bytes {
            return Err(ck_err(
                dir,
                format!(
                    "{name} has {} bytes, manifest says {} (truncated?)",
                    bytes.len(),
                    entry.bytes
                ),
            ));
        }
        let crc = crc32fast::hash(&bytes);
        if crc != entry.crc32 {
            return Err(TrainError::Checksum {
                path: dir.to_path_buf(),
                file: name.clone(),
                expected: entry.crc32,
                actual: crc,
            });
        }
        out.insert(name.clone(), bytes);
    }
    Ok(out)
}

/// Points `run_dir/latest` at checkpoint `name` (atomic write-then-rename).
pub fn set_latest(run_dir: &Path, name: &str) -> Result<()> {
    let tmp = run_dir.join(format!(".latest.tmp-{}", std::process::id()));
    write_synced(&tmp, name.as_bytes())?;
    std::fs::rename(&tmp, run_dir.join("latest"))
        .ctx(|| format!("updating {}/latest", run_dir.display()))?;
    sync_dir(run_dir)
}

/// Resolves a `--resume` argument: a checkpoint directory (has a manifest) or a run directory
/// whose `latest` names one.
pub fn resolve(path: &Path) -> Result<PathBuf> {
    if path.join(MANIFEST).is_file() {
        return Ok(path.to_path_buf());
    }
    let latest = path.join("latest");
    if latest.is_file() {
        let name =
            std::fs::read_to_string(&latest).ctx(|| format!("reading {}", latest.display()))?;
        return Ok(path.join(name.trim()));
    }
    Err(ck_err(
        path,
        "neither a checkpoint (no manifest.json) nor a run directory (no `latest`)",
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tmpdir(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("xtrain-ck-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    fn files(x: u8) -> Vec<(String, Vec<u8>)> {
        vec![
            ("a.bin".into(), vec![x; 100]),
            ("b.json".into(), format!("{{\"x\":{x}}}").into_bytes()),
        ]
    }

    #[test]
    fn round_trip_and_replace() {
        let d = tmpdir("rt");
        let ck = d.join("step_1");
        save(&ck, &files(1), SaveOptions::default()).unwrap();
        assert_eq!(load(&ck).unwrap()["a.bin"], vec![1; 100]);
        save(&ck, &files(2), SaveOptions::default()).unwrap();
        assert_eq!(load(&ck).unwrap()["a.bin"], vec![2; 100]);
        set_latest(&d, "step_1").unwrap();
        assert_eq!(resolve(&d).unwrap(), ck);
        assert_eq!(resolve(&ck).unwrap(), ck);
        assert!(resolve(&d.join("nothing")).is_err());
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn corruption_is_detected() {
        let d = tmpdir("bad");
        let ck = d.join("c");
        save(&ck, &files(3), SaveOptions::default()).unwrap();
        // Flip one byte: checksum mismatch naming the file.
        let mut bytes = std::fs::read(ck.join("a.bin")).unwrap();
        bytes[10] ^= 1;
        std::fs::write(ck.join("a.bin"), &bytes).unwrap();
        let e = load(&ck).unwrap_err();
        assert!(
            matches!(e, TrainError::Checksum { ref file, .. } if file == "a.bin"),
            "{e}"
        );
        // Truncate.
        std::fs::write(ck.join("a.bin"), &bytes[..50]).unwrap();
        assert!(load(&ck).unwrap_err().to_string().contains("truncated"));
        // Missing file, corrupt manifest, not a directory.
        std::fs::remove_file(ck.join("a.bin")).unwrap();
        assert!(load(&ck).unwrap_err().to_string().contains("a.bin"));
        std::fs::write(ck.join(MANIFEST), b"{not json").unwrap();
        assert!(load(&ck)
            .unwrap_err()
            .to_string()
            .contains("corrupt manifest.json"));
        assert!(load(&d.join("missing")).is_err());
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn interrupted_save_keeps_the_previous_checkpoint() {
        let d = tmpdir("crash");
        let ck = d.join("c");
        save(&ck, &files(4), SaveOptions::default()).unwrap();
        let e = save(
            &ck,
            &files(5),
            SaveOptions {
                fail_after_files: Some(1),
            },
        )
        .unwrap_err();
        assert!(e.to_string().contains("injected"), "{e}");
        assert_eq!(load(&ck).unwrap()["a.bin"], vec![4; 100]);
        // The next save cleans the stale temporary directory and succeeds.
        save(&ck, &files(6), SaveOptions::default()).unwrap();
        assert_eq!(load(&ck).unwrap()["a.bin"], vec![6; 100]);
        std::fs::remove_dir_all(&d).unwrap();
    }
}
