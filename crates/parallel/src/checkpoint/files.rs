//! Files of a checkpoint directory: written with fsync, checked against their size and CRC-32
//! on load, and the directory put into place by one rename, so a crash mid-save never leaves a
//! half-written checkpoint under the final name (nor damages the one it replaces).
use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::CheckpointError;

/// Size and checksum of one file.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileEntry {
    pub bytes: u64,
    pub crc32: u32,
}

impl FileEntry {
    pub fn of(bytes: &[u8]) -> Self {
        FileEntry {
            bytes: bytes.len() as u64,
            crc32: crc32fast::hash(bytes),
        }
    }

    /// Checks `bytes` (file `name` of checkpoint `dir`) against this entry.
    pub fn verify(&self, dir: &Path, name: &str, bytes: &[u8]) -> Result<(), CheckpointError> {
        if bytes.len() as u64 != self.bytes {
            return Err(CheckpointError::at(
                dir,
                format!(
                    "{name} has {} bytes, the manifest says {} (truncated?)",
                    bytes.len(),
                    self.bytes
                ),
            ));
        }
        let crc = crc32fast::hash(bytes);
        if crc != self.crc32 {
            return Err(CheckpointError::at(
                dir,
                format!(
                    "checksum mismatch in {name} (manifest {:08x}, file {crc:08x})",
                    self.crc32
                ),
            ));
        }
        Ok(())
    }
}

fn io(path: &Path, what: &str, e: std::io::Error) -> CheckpointError {
    CheckpointError::at(path, format!("{what}: {e}"))
}

/// Writes `bytes` to `path` and fsyncs it.
pub fn write_synced(path: &Path, bytes: &[u8]) -> Result<(), CheckpointError> {
    let mut f = std::fs::File::create(path).map_err(|e| io(path, "creating", e))?;
    f.write_all(bytes).map_err(|e| io(path, "writing", e))?;
    f.sync_all().map_err(|e| io(path, "syncing", e))
}

/// Fsyncs a directory (its entries: renames and new files).
pub fn sync_dir(path: &Path) -> Result<(), CheckpointError> {
    std::fs::File::open(path)
        .and_then(|d| d.sync_all())
        .map_err(|e| io(path, "syncing directory", e))
}

/// The staging directory a checkpoint `dir` is written into before it is renamed into place:
/// a sibling with a fixed name, so every rank of a job finds the same one.
pub fn staging_dir(dir: &Path) -> Result<PathBuf, CheckpointError> {
    let name = dir
        .file_name()
        .ok_or_else(|| CheckpointError::at(dir, "a checkpoint path needs a file name"))?;
    Ok(parent(dir).join(format!(".{}.tmp", name.to_string_lossy())))
}

fn parent(dir: &Path) -> &Path {
    dir.parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."))
}

/// Creates an empty staging directory for `dir` (removing a stale one a crash left).
pub fn begin(dir: &Path) -> Result<PathBuf, CheckpointError> {
    let p = parent(dir);
    std::fs::create_dir_all(p).map_err(|e| io(p, "creating", e))?;
    let tmp = staging_dir(dir)?;
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).map_err(|e| io(&tmp, "removing stale", e))?;
    }
    std::fs::create_dir(&tmp).map_err(|e| io(&tmp, "creating", e))?;
    Ok(tmp)
}

/// Puts the finished staging directory in place as `dir`, replacing any checkpoint of the
/// same name as a whole (its old files are moved aside first and removed only once the new
/// directory is in place).
pub fn commit(dir: &Path) -> Result<(), CheckpointError> {
    let tmp = staging_dir(dir)?;
    sync_dir(&tmp)?;
    let name = dir.file_name().expect("checked by staging_dir");
    let old = parent(dir).join(format!(".{}.old", name.to_string_lossy()));
    if old.exists() {
        std::fs::remove_dir_all(&old).map_err(|e| io(&old, "removing stale", e))?;
    }
    let had_old = dir.exists();
    if had_old {
        std::fs::rename(dir, &old).map_err(|e| io(dir, "moving aside", e))?;
    }
    std::fs::rename(&tmp, dir).map_err(|e| io(&tmp, "renaming into place", e))?;
    sync_dir(parent(dir))?;
    if had_old {
        std::fs::remove_dir_all(&old).map_err(|e| io(&old, "removing", e))?;
    }
    Ok(())
}

/// Points `run_dir/latest` at `name` (a path relative to the run directory), atomically.
pub fn set_latest(run_dir: &Path, name: &str) -> Result<(), CheckpointError> {
    let tmp = run_dir.join(".latest.tmp");
    write_synced(&tmp, name.as_bytes())?;
    std::fs::rename(&tmp, run_dir.join("latest")).map_err(|e| io(run_dir, "updating latest", e))?;
    sync_dir(run_dir)
}
