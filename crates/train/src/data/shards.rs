//! The shard folder: a tokenized corpus as token files of bounded size, each with an index of
//! its document starts, and a manifest (`index.json`) listing them.
//!
//! Files: `shard-NNNNN.tok` (the token file format of [`super::tokfile`]), `shard-NNNNN.idx`
//! (little endian: magic `XTRNIDX\0`, `version: u32 = 1`, `reserved: u32 = 0`, `count: u64`,
//! then `count` u64 token offsets where the shard's documents start, the first 0, strictly
//! increasing), and `index.json` ([`Manifest`]), written last: a folder without it is not a
//! shard folder. A shard holds whole documents; it is closed when the next document would take
//! it past the shard size (a longer document gets a shard of its own). Readers memory-map both
//! files, so opening a corpus of any size costs only the page tables.
use super::tokfile::{self, TokenFile};
use crate::error::{IoContext, Result, TrainError};
use serde::{Deserialize, Serialize};
use std::io::Write;
use std::path::{Path, PathBuf};

pub const MANIFEST: &str = "index.json";
pub const FORMAT: &str = "xtrain-shards";
pub const VERSION: u32 = 1;
pub const IDX_MAGIC: &[u8; 8] = b"XTRNIDX\0";
pub const IDX_VERSION: u32 = 1;
const IDX_HEADER: usize = 24;

/// `index.json`: what the folder holds and how it was tokenized.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Manifest {
    /// Always [`FORMAT`].
    pub format: String,
    /// Always [`VERSION`].
    pub version: u32,
    /// The tokenizer: `byte` or the `tokenizer.json` it was loaded from.
    pub tokenizer: String,
    pub vocab_size: usize,
    /// Prepended to each document, if the tokenizer has one.
    pub bos_id: Option<u32>,
    /// Appended to each document.
    pub eos_id: u32,
    pub documents: u64,
    pub tokens: u64,
    pub shards: Vec<ShardEntry>,
}

/// One shard of the manifest: `<name>.tok` and `<name>.idx`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ShardEntry {
    pub name: String,
    pub documents: u64,
    pub tokens: u64,
}

/// Whether `dir` is a shard folder (holds a manifest).
pub fn is_shard_folder(dir: &Path) -> bool {
    dir.join(MANIFEST).is_file()
}

/// Writes documents into shards as they come.
pub struct ShardWriter {
    dir: PathBuf,
    shard_tokens: u64,
    vocab_size: usize,
    open: Option<OpenShard>,
    done: Vec<ShardEntry>,
}

struct OpenShard {
    name: String,
    tokens: tokfile::Writer,
    starts: Vec<u64>,
}

impl ShardWriter {
    /// Shards of about `shard_tokens` tokens in `dir`, which must be absent or empty.
    pub fn create(dir: &Path, shard_tokens: u64, vocab_size: usize) -> Result<Self> {
        if shard_tokens == 0 {
            return Err(TrainError::Data("the shard size must be positive".into()));
        }
        if dir.exists() {
            let mut entries =
                std::fs::read_dir(dir).ctx(|| format!("listing {}", dir.display()))?;
            if entries.next().is_some() {
                return Err(TrainError::Data(format!(
                    "output folder {} is not empty",
                    dir.display()
                )));
            }
        }
        std::fs::create_dir_all(dir).ctx(|| format!("creating {}", dir.display()))?;
        Ok(Self {
            dir: dir.to_path_buf(),
            shard_tokens,
            vocab_size,
            open: None,
            done: Vec::new(),
        })
    }

    /// Appends one document (its tokens, BOS and EOS included).
    pub fn push(&mut self, ids: &[u32]) -> Result<()> {
        if ids.is_empty() {
            return Err(TrainError::Data(
                "a document needs at least one token".into(),
            ));
        }
        if let Some(s) = &self.open {
            if s.tokens.len() + ids.len() as u64 > self.shard_tokens {
                self.close()?;
            }
        }
        if self.open.is_none() {
            let name = format!("shard-{:05}", self.done.len());
            let tokens =
                tokfile::Writer::create(&self.dir.join(format!("{name}.tok")), self.vocab_size)?;
            self.open = Some(OpenShard {
                name,
                tokens,
                starts: Vec::new(),
            });
        }
        let s = self.open.as_mut().expect("a shard is open");
        s.starts.push(s.tokens.len());
        s.tokens.push(ids)
    }

    fn close(&mut self) -> Result<()> {
        let Some(s) = self.open.take() else {
            return Ok(());
        };
        let tokens = s.tokens.len();
        s.tokens.finish()?;
        let path = self.dir.join(format!("{}.idx", s.name));
        let mut buf = Vec::with_capacity(IDX_HEADER + 8 * s.starts.len());
        buf.extend_from_slice(IDX_MAGIC);
        buf.extend_from_slice(&IDX_VERSION.to_le_bytes());
        buf.extend_from_slice(&0u32.to_le_bytes());
        buf.extend_from_slice(&(s.starts.len() as u64).to_le_bytes());
        for &o in &s.starts {
            buf.extend_from_slice(&o.to_le_bytes());
        }
        write_synced(&path, &buf)?;
        self.done.push(ShardEntry {
            name: s.name,
            documents: s.starts.len() as u64,
            tokens,
        });
        Ok(())
    }

    /// Closes the last shard and writes the manifest; an empty corpus is an error.
    pub fn finish(mut self, tokenizer: &str, bos_id: Option<u32>, eos_id: u32) -> Result<Manifest> {
        self.close()?;
        if self.done.is_empty() {
            return Err(TrainError::Data("the inputs hold no documents".into()));
        }
        let m = Manifest {
            format: FORMAT.into(),
            version: VERSION,
            tokenizer: tokenizer.into(),
            vocab_size: self.vocab_size,
            bos_id,
            eos_id,
            documents: self.done.iter().map(|s| s.documents).sum(),
            tokens: self.done.iter().map(|s| s.tokens).sum(),
            shards: self.done,
        };
        let text = serde_json::to_string_pretty(&m)
            .map_err(|e| TrainError::Data(format!("serialising the manifest: {e}")))?;
        write_synced(&self.dir.join(MANIFEST), text.as_bytes())?;
        Ok(m)
    }
}

fn write_synced(path: &Path, bytes: &[u8]) -> Result<()> {
    let mut f = std::fs::File::create(path).ctx(|| format!("creating {}", path.display()))?;
    f.write_all(bytes)
        .ctx(|| format!("writing {}", path.display()))?;
    f.sync_all().ctx(|| format!("syncing {}", path.display()))
}

/// A memory-mapped document index (`.idx`).
pub struct DocIndex {
    map: memmap2::Mmap,
    count: usize,
}

impl DocIndex {
    /// Opens `path` and checks it against the shard's `tokens`: its size, and the first document
    /// at 0 and the last inside the shard.
    pub fn open(path: &Path, tokens: u64) -> Result<Self> {
        let bad = |msg: String| TrainError::TokenFile {
            path: path.to_path_buf(),
            msg,
        };
        let f = std::fs::File::open(path).ctx(|| format!("opening index {}", path.display()))?;
        // SAFETY: read-only mapping; as for token files, concurrent truncation is not guarded.
        let map =
            unsafe { memmap2::Mmap::map(&f) }.ctx(|| format!("mapping {}", path.display()))?;
        if map.len() < IDX_HEADER || &map[..8] != IDX_MAGIC {
            return Err(bad("not an xtrain document index (bad magic)".into()));
        }
        let version = u32::from_le_bytes(map[8..12].try_into().expect("4 bytes"));
        if version != IDX_VERSION {
            return Err(bad(format!(
                "unsupported version {version} (expected {IDX_VERSION})"
            )));
        }
        let count = u64::from_le_bytes(map[16..24].try_into().expect("8 bytes"));
        if (count as u128) * 8 + IDX_HEADER as u128 != map.len() as u128 {
            return Err(bad(format!(
                "header says {count} documents but the file has {} bytes (truncated?)",
                map.len()
            )));
        }
        let idx = Self {
            map,
            count: count as usize,
        };
        // Only the ends are checked: reading every start would page the whole index in.
        let (first, last) = match idx.count {
            0 => (0, 0),
            n => (idx.start(0), idx.start(n - 1)),
        };
        if idx.count == 0 || first != 0 || last >= tokens {
            return Err(bad(format!(
                "{} documents, first starting at {first}, last at {last}: need at least one, the first at 0 and all below the shard's {tokens} tokens",
                idx.count
            )));
        }
        Ok(idx)
    }

    pub fn len(&self) -> usize {
        self.count
    }

    pub fn is_empty(&self) -> bool {
        self.count == 0
    }

    /// Token offset where document `d` starts.
    pub fn start(&self, d: usize) -> u64 {
        let o = IDX_HEADER + 8 * d;
        u64::from_le_bytes(self.map[o..o + 8].try_into().expect("8 bytes"))
    }

    /// Number of documents starting at or before token `pos` (binary search: the starts are
    /// strictly increasing). Document `starts_up_to(pos)` is the first to start after `pos`.
    pub fn starts_up_to(&self, pos: u64) -> usize {
        let (mut lo, mut hi) = (0, self.count);
        while lo < hi {
            let mid = (lo + hi) / 2;
            if self.start(mid) <= pos {
                lo = mid + 1;
            } else {
                hi = mid;
            }
        }
        lo
    }
}

/// One opened shard.
pub struct Shard {
    pub name: String,
    pub tokens: TokenFile,
    pub docs: DocIndex,
}

/// An opened shard folder.
pub struct ShardSet {
    pub dir: PathBuf,
    pub manifest: Manifest,
    pub shards: Vec<Shard>,
}

impl ShardSet {
    /// Opens `dir`: a folder without a manifest, or whose files disagree with it, is an error.
    pub fn open(dir: &Path) -> Result<Self> {
        let mpath = dir.join(MANIFEST);
        if !mpath.is_file() {
            return Err(TrainError::Data(format!(
                "folder {} has no {MANIFEST}: not a shard folder (`xtrain tokenize INPUTS -o FOLDER` writes one)",
                dir.display()
            )));
        }
        let bad = |msg: String| TrainError::Data(format!("{}: {msg}", mpath.display()));
        let text =
            std::fs::read_to_string(&mpath).ctx(|| format!("reading {}", mpath.display()))?;
        let manifest: Manifest =
            serde_json::from_str(&text).map_err(|e| bad(format!("not a shard manifest: {e}")))?;
        if manifest.format != FORMAT || manifest.version != VERSION {
            return Err(bad(format!(
                "format {} version {} (expected {FORMAT} version {VERSION})",
                manifest.format, manifest.version
            )));
        }
        let mut shards = Vec::with_capacity(manifest.shards.len());
        for e in &manifest.shards {
            if e.name.contains(['/', '\\']) || e.name.starts_with('.') {
                return Err(bad(format!("shard name {:?} is not a file name", e.name)));
            }
            let tokens = TokenFile::open(&dir.join(format!("{}.tok", e.name)))?;
            if tokens.len() as u64 != e.tokens || tokens.vocab_size() != manifest.vocab_size {
                return Err(bad(format!(
                    "shard {} holds {} tokens of vocab {}, the manifest says {} of vocab {}",
                    e.name,
                    tokens.len(),
                    tokens.vocab_size(),
                    e.tokens,
                    manifest.vocab_size
                )));
            }
            let docs = DocIndex::open(&dir.join(format!("{}.idx", e.name)), e.tokens)?;
            if docs.len() as u64 != e.documents {
                return Err(bad(format!(
                    "shard {} indexes {} documents, the manifest says {}",
                    e.name,
                    docs.len(),
                    e.documents
                )));
            }
            shards.push(Shard {
                name: e.name.clone(),
                tokens,
                docs,
            });
        }
        if shards.is_empty() {
            return Err(bad("lists no shard".into()));
        }
        Ok(Self {
            dir: dir.to_path_buf(),
            manifest,
            shards,
        })
    }
}
