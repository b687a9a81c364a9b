//! Reading a checkpoint: the manifest, the small files, and any block of any tensor, assembled
//! from the pieces that hold it whatever layout wrote them. Each shard file is mapped and its
//! checksum verified the first time a piece is read from it.
use std::collections::HashMap;
use std::ops::Range;
use std::path::{Path, PathBuf};

use super::files::FileEntry;
use super::{resolve, CheckpointError, Kind, Manifest, MANIFEST};
use super::{FORMAT, VERSION};
use crate::placement::TensorSlice;

/// Largest `manifest.json` read (a manifest lists files and pieces: megabytes, not gigabytes).
pub const MAX_MANIFEST_BYTES: u64 = 1 << 30;

impl Manifest {
    /// Decodes and checks `manifest.json`: any bytes give a manifest whose every file name is
    /// a plain name of the checkpoint directory and whose every piece lies inside its tensor
    /// (sizes computed without overflow), or an error saying what is wrong; never a panic.
    pub fn decode(text: &[u8]) -> Result<Manifest, String> {
        let value: serde_json::Value =
            serde_json::from_slice(text).map_err(|e| format!("corrupt {MANIFEST}: {e}"))?;
        let version = value.get("version").and_then(|v| v.as_u64());
        if value.get("format").and_then(|f| f.as_str()) != Some(FORMAT) {
            return Err(format!("{MANIFEST} is not an xtrain checkpoint manifest"));
        }
        if version != Some(VERSION as u64) {
            return Err(format!(
                "format version {} (this xtrain reads version {VERSION}; version 1 is the single-process format of older releases)",
                version.map_or("?".to_string(), |v| v.to_string())
            ));
        }
        let manifest: Manifest =
            serde_json::from_value(value).map_err(|e| format!("corrupt {MANIFEST}: {e}"))?;
        for name in manifest.files.keys() {
            let plain = !name.is_empty()
                && name != "."
                && name != ".."
                && !name.contains(['/', '\\', '\0']);
            if !plain || name == MANIFEST {
                return Err(format!("{MANIFEST} lists an invalid file name {name:?}"));
            }
        }
        for p in &manifest.pieces {
            if !manifest.files.contains_key(&p.file) {
                return Err(format!(
                    "a piece of {} is in {}, which the manifest does not list",
                    p.slice.name, p.file
                ));
            }
            let inside = p.slice.checked_full_numel().is_some()
                && p.slice.is_valid()
                && p.start
                    .checked_add(p.len)
                    .is_some_and(|end| end <= p.slice.numel());
            if !inside {
                return Err(format!(
                    "a piece of {} lies outside its tensor",
                    p.slice.name
                ));
            }
        }
        Ok(manifest)
    }
}

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
        let path = dir.join(MANIFEST);
        let size = std::fs::metadata(&path)
            .map_err(|e| CheckpointError::at(&dir, format!("reading {MANIFEST}: {e}")))?
            .len();
        if size > MAX_MANIFEST_BYTES {
            return Err(CheckpointError::at(
                &dir,
                format!("{MANIFEST} has {size} bytes, over the limit of {MAX_MANIFEST_BYTES}"),
            ));
        }
        let text = std::fs::read(&path)
            .map_err(|e| CheckpointError::at(&dir, format!("reading {MANIFEST}: {e}")))?;
        let manifest = Manifest::decode(&text).map_err(|e| CheckpointError::at(&dir, e))?;
        for (name, entry) in &manifest.files {
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

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// A manifest with one piece of a tensor: `shape`, `offset`, `local`, `start`, `len` as given.
    fn manifest_json(
        shape: &[usize],
        offset: &[usize],
        local: &[usize],
        start: usize,
        len: usize,
    ) -> String {
        format!(
            r#"{{"format":"{FORMAT}","version":{VERSION},
            "mesh":{{"pp":1,"dp":2,"cp":1,"tp":1,"ep":1,"zero":3,"sp":false,"virtual_stages":1}},
            "precision":"fp32",
            "state":{{"step":3,"tokens_seen":0,"data_seed":0,"adam_step":3,
                "loss_scaler":{{"scale":1.0,"good_steps":0,"growth_interval":2000,"dynamic":false}}}},
            "files":{{"shard-00000.safetensors":{{"bytes":100,"crc32":7}}}},
            "pieces":[{{"file":"shard-00000.safetensors",
                "slice":{{"name":"w","shape":{shape:?},"offset":{offset:?},"local":{local:?}}},
                "start":{start},"len":{len}}}]}}"#
        )
    }

    #[test]
    fn a_valid_manifest_decodes_and_bad_geometry_or_names_are_errors() {
        let m =
            Manifest::decode(manifest_json(&[4, 6], &[2, 0], &[2, 6], 3, 9).as_bytes()).unwrap();
        assert_eq!(m.pieces[0].slice.numel(), 12);
        let err = |text: &str| Manifest::decode(text.as_bytes()).unwrap_err();
        let huge = usize::MAX;
        // Sums and products that wrap around in unchecked arithmetic.
        for (shape, offset, local, start, len) in [
            (vec![4, 6], vec![2, 0], vec![2, 6], 3, 10),
            (vec![4, 6], vec![huge, 0], vec![2, 6], 0, 1),
            (vec![huge, huge], vec![0, 0], vec![1, 1], 0, 1),
            (vec![4, 6], vec![0, 0], vec![4, 6], huge, 2),
            (vec![4, 6], vec![0], vec![4, 6], 0, 1),
        ] {
            let e = err(&manifest_json(&shape, &offset, &local, start, len));
            assert!(e.contains("lies outside its tensor"), "{e}");
        }
        let good = manifest_json(&[4], &[0], &[4], 0, 4);
        for bad in ["..", "a/b", "", "manifest.json"] {
            let e = err(&good.replace(
                "\"files\":{\"shard-00000.safetensors\"",
                &format!(
                    "\"files\":{{\"shard-00000.safetensors\":{{\"bytes\":1,\"crc32\":1}},{bad:?}"
                ),
            ));
            assert!(e.contains("invalid file name"), "{bad}: {e}");
        }
        assert!(err(&good.replace("\"version\":2", "\"version\":1")).contains("format version 1"));
        assert!(err("{").contains("corrupt"));
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        /// Arbitrary bytes: a manifest or an error, never a panic.
        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..400)) {
            let _ = Manifest::decode(&bytes);
        }

        /// A valid manifest with bytes overwritten: never a panic.
        #[test]
        fn mutated_manifests_never_panic(edits in proptest::collection::vec((any::<usize>(), any::<u8>()), 1..6)) {
            let mut text = manifest_json(&[4, 6], &[2, 0], &[2, 6], 3, 9).into_bytes();
            for (i, b) in edits {
                let n = text.len();
                text[i % n] = b;
            }
            let _ = Manifest::decode(&text);
        }

        /// Any geometry, however hostile: accepted only if every element a piece names lies
        /// inside its tensor, so reading it can neither overflow nor index out of bounds.
        #[test]
        fn accepted_pieces_lie_inside_their_tensor(
            dims in proptest::collection::vec((0usize..9, 0usize..9, 0usize..9), 1..4),
            huge in proptest::option::of((0usize..3, any::<usize>())),
            start in prop_oneof![0usize..64, any::<usize>()],
            len in prop_oneof![0usize..64, any::<usize>()],
        ) {
            let mut shape: Vec<usize> = dims.iter().map(|d| d.0).collect();
            let mut offset: Vec<usize> = dims.iter().map(|d| d.1).collect();
            let local: Vec<usize> = dims.iter().map(|d| d.2).collect();
            if let Some((which, v)) = huge {
                let d = v % shape.len();
                match which {
                    0 => shape[d] = v,
                    _ => offset[d] = v,
                }
            }
            let text = manifest_json(&shape, &offset, &local, start, len);
            if let Ok(m) = Manifest::decode(text.as_bytes()) {
                let p = &m.pieces[0];
                let full = p.slice.full_numel();
                prop_assert!(p.start + p.len <= p.slice.numel());
                if p.len <= 4096 {
                    for run in p.slice.runs(p.start..p.start + p.len) {
                        prop_assert!(run.full + run.len <= full);
                    }
                }
            }
        }
    }
}
