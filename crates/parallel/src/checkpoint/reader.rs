//! Reading a checkpoint: the manifest, the small files, and any block of any tensor, assembled
//! from the pieces that hold it whatever layout wrote them. Each shard file is mapped and its
//! checksum verified the first time a piece is read from it.
use std::collections::HashMap;
use std::ops::Range;
use std::path::{Path, PathBuf};

use super::files::FileEntry;
use super::{resolve, CheckpointError, Kind, Manifest, FORMAT, MANIFEST, VERSION};
use crate::placement::TensorSlice;

/// An open checkpoint.
pub struct Checkpoint {
    dir: PathBuf,
    pub manifest: Manifest,
    /// Pieces of each tensor (indices into `manifest.pieces`).
    by_tensor: HashMap<String, Vec<usize>>,
    /// Shard files mapped so far (verified).
    maps: HashMap<String, memmap2::Mmap>,
    /// The last tensor assembled, for the reads of its blocks that follow.
    cached: Option<((Kind, String), Vec<f32>)>,
}

impl Checkpoint {
    /// Opens the checkpoint at `path` (a checkpoint or a run directory): reads the manifest and
    /// checks that every file it lists exists with its size.
    pub fn open(path: &Path) -> Result<Self, CheckpointError> {
        let dir = resolve(path)?;
        let text = std::fs::read(dir.join(MANIFEST))
            .map_err(|e| CheckpointError::at(&dir, format!("reading {MANIFEST}: {e}")))?;
        let value: serde_json::Value = serde_json::from_slice(&text)
            .map_err(|e| CheckpointError::at(&dir, format!("corrupt {MANIFEST}: {e}")))?;
        let version = value.get("version").and_then(|v| v.as_u64());
        if value.get("format").and_then(|f| f.as_str()) != Some(FORMAT) {
            return Err(CheckpointError::at(
                &dir,
                format!("{MANIFEST} is not an xtrain checkpoint manifest"),
            ));
        }
        if version != Some(VERSION as u64) {
            return Err(CheckpointError::at(
                &dir,
                format!(
                    "format version {} (this xtrain reads version {VERSION}; version 1 is the single-process format of older releases)",
                    version.map_or("?".to_string(), |v| v.to_string())
                ),
            ));
        }
        let manifest: Manifest = serde_json::from_value(value)
            .map_err(|e| CheckpointError::at(&dir, format!("corrupt {MANIFEST}: {e}")))?;
        for (name, entry) in &manifest.files {
            if name.contains('/') || name == MANIFEST {
                return Err(CheckpointError::at(
                    &dir,
                    format!("{MANIFEST} lists an invalid file name {name}"),
                ));
            }
            let meta = std::fs::metadata(dir.join(name))
                .map_err(|e| CheckpointError::at(&dir, format!("{name}: {e}")))?;
            if meta.len() != entry.bytes {
                return Err(CheckpointError::at(
                    &dir,
                    format!(
                        "{name} has {} bytes, the manifest says {} (truncated?)",
                        meta.len(),
                        entry.bytes
                    ),
                ));
            }
        }
        let mut by_tensor: HashMap<String, Vec<usize>> = HashMap::new();
        for (i, p) in manifest.pieces.iter().enumerate() {
            if !manifest.files.contains_key(&p.file) {
                return Err(CheckpointError::at(
                    &dir,
                    format!(
                        "a piece of {} is in {}, which the manifest does not list",
                        p.slice.name, p.file
                    ),
                ));
            }
            if !p.slice.is_valid() || p.start + p.len > p.slice.numel() {
                return Err(CheckpointError::at(
                    &dir,
                    format!("a piece of {} lies outside its tensor", p.slice.name),
                ));
            }
            by_tensor.entry(p.slice.name.clone()).or_default().push(i);
        }
        Ok(Checkpoint {
            dir,
            manifest,
            by_tensor,
            maps: HashMap::new(),
            cached: None,
        })
    }

    /// The checkpoint directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// A small file of the checkpoint (e.g. `config.toml`), checksum verified; `None` when the
    /// checkpoint has none of that name.
    pub fn file(&self, name: &str) -> Result<Option<Vec<u8>>, CheckpointError> {
        let Some(entry) = self.manifest.files.get(name) else {
            return Ok(None);
        };
        let bytes = std::fs::read(self.dir.join(name))
            .map_err(|e| CheckpointError::at(&self.dir, format!("reading {name}: {e}")))?;
        entry.verify(&self.dir, name, &bytes)?;
        Ok(Some(bytes))
    }

    /// Names of the tensors the checkpoint holds.
    pub fn tensor_names(&self) -> Vec<String> {
        let mut v: Vec<String> = self.by_tensor.keys().cloned().collect();
        v.sort();
        v
    }

    fn map(&mut self, file: &str) -> Result<&memmap2::Mmap, CheckpointError> {
        if !self.maps.contains_key(file) {
            let path = self.dir.join(file);
            let f = std::fs::File::open(&path)
                .map_err(|e| CheckpointError::at(&self.dir, format!("opening {file}: {e}")))?;
            // SAFETY: the file is only read, and a checkpoint directory is not modified in
            // place (a new save replaces it by a rename).
            let map = unsafe { memmap2::Mmap::map(&f) }
                .map_err(|e| CheckpointError::at(&self.dir, format!("mapping {file}: {e}")))?;
            let entry: &FileEntry = &self.manifest.files[file];
            entry.verify(&self.dir, file, &map)?;
            self.maps.insert(file.to_string(), map);
        }
        Ok(&self.maps[file])
    }

    /// The whole tensor `name` of buffer `kind` (its elements in row-major order), assembled
    /// from its pieces; `numel` is what the caller's model expects.
    pub fn tensor(
        &mut self,
        kind: Kind,
        name: &str,
        numel: usize,
    ) -> Result<Vec<f32>, CheckpointError> {
        if let Some(((k, n), v)) = &self.cached {
            if *k == kind && n == name {
                return Ok(v.clone());
            }
        }
        let full = self.assemble(kind, name, numel)?;
        self.cached = Some(((kind, name.to_string()), full.clone()));
        Ok(full)
    }

    fn assemble(
        &mut self,
        kind: Kind,
        name: &str,
        numel: usize,
    ) -> Result<Vec<f32>, CheckpointError> {
        let dir = self.dir.clone();
        let pieces = self.by_tensor.get(name).cloned().ok_or_else(|| {
            CheckpointError::at(
                &dir,
                format!("holds no tensor {name} (a checkpoint of another model?)"),
            )
        })?;
        let mut full = vec![0.0f32; numel];
        let mut covered = 0usize;
        for i in pieces {
            let p = self.manifest.pieces[i].clone();
            if p.slice.full_numel() != numel {
                return Err(CheckpointError::at(
                    &dir,
                    format!("{name} has {} elements in the checkpoint, the model has {numel} (a checkpoint of another model?)", p.slice.full_numel()),
                ));
            }
            let key = kind.key(name, p.start);
            let map = self.map(&p.file)?;
            let st = safetensors::SafeTensors::deserialize(map)
                .map_err(|e| CheckpointError::at(&dir, format!("{}: {e}", p.file)))?;
            let t = st
                .tensor(&key)
                .map_err(|_| CheckpointError::at(&dir, format!("{} has no {key}", p.file)))?;
            if t.dtype() != safetensors::Dtype::F32 || t.shape() != [p.len] {
                return Err(CheckpointError::at(
                    &dir,
                    format!("{key} in {} is not f32 [{}]", p.file, p.len),
                ));
            }
            let data = t.data();
            for run in p.slice.runs(p.start..p.start + p.len) {
                let src = &data[4 * (run.slice - p.start)..4 * (run.slice - p.start + run.len)];
                for (d, c) in full[run.full..run.full + run.len]
                    .iter_mut()
                    .zip(src.chunks_exact(4))
                {
                    *d = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                }
            }
            covered += p.len;
        }
        if covered != numel {
            return Err(CheckpointError::at(
                &dir,
                format!("the pieces of {name} cover {covered} of its {numel} elements (a shard is missing or listed twice)"),
            ));
        }
        Ok(full)
    }

    /// Elements `flat` (row-major) of block `slice` of buffer `kind` into `out`.
    pub fn read(
        &mut self,
        kind: Kind,
        slice: &TensorSlice,
        flat: Range<usize>,
        out: &mut [f32],
    ) -> Result<(), CheckpointError> {
        if out.len() != flat.len() {
            return Err(CheckpointError::at(&self.dir, "read: output length"));
        }
        if self
            .cached
            .as_ref()
            .is_none_or(|((k, n), _)| *k != kind || n != &slice.name)
        {
            let full = self.assemble(kind, &slice.name, slice.full_numel())?;
            self.cached = Some(((kind, slice.name.clone()), full));
        }
        let full = &self.cached.as_ref().expect("assembled above").1;
        if full.len() != slice.full_numel() {
            return Err(CheckpointError::at(
                &self.dir,
                format!(
                    "{} has {} elements in the checkpoint, the model has {}",
                    slice.name,
                    full.len(),
                    slice.full_numel()
                ),
            ));
        }
        for run in slice.runs(flat.clone()) {
            let d = run.slice - flat.start;
            out[d..d + run.len].copy_from_slice(&full[run.full..run.full + run.len]);
        }
        Ok(())
    }
}
