//! The token file: a memory-mapped array of token ids behind a 32-byte header.
//!
//! Layout (little endian): `magic "XTRNTOK\0"` (8 bytes), `version: u32 = 1`, `dtype: u32`
//! (2 = u16 ids, 4 = u32 ids; the width in bytes), `count: u64` (number of ids),
//! `vocab_size: u32`, `reserved: u32 = 0`, then `count × dtype` bytes of ids.
use crate::error::{IoContext, Result, TrainError};
use std::io::{BufWriter, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

pub const MAGIC: &[u8; 8] = b"XTRNTOK\0";
pub const VERSION: u32 = 1;
pub const HEADER_BYTES: usize = 32;

/// Writes `ids` with the narrowest width that holds `vocab_size`.
pub fn write(path: &Path, ids: &[u32], vocab_size: usize) -> Result<()> {
    let mut w = Writer::create(path, vocab_size)?;
    w.push(ids)?;
    w.finish()
}

/// Streams ids into a token file: the header goes first with a zero count, which
/// [`Writer::finish`] patches, so a file of any size is written with bounded memory.
pub struct Writer {
    path: PathBuf,
    out: BufWriter<std::fs::File>,
    width: u32,
    vocab_size: usize,
    count: u64,
}

impl Writer {
    /// Creates `path` for ids below `vocab_size` (2-byte ids when they fit, else 4).
    pub fn create(path: &Path, vocab_size: usize) -> Result<Self> {
        let width: u32 = if vocab_size <= 1 << 16 { 2 } else { 4 };
        let f = std::fs::File::create(path).ctx(|| format!("creating {}", path.display()))?;
        let mut out = BufWriter::with_capacity(1 << 20, f);
        let mut head = Vec::with_capacity(HEADER_BYTES);
        head.extend_from_slice(MAGIC);
        head.extend_from_slice(&VERSION.to_le_bytes());
        head.extend_from_slice(&width.to_le_bytes());
        head.extend_from_slice(&0u64.to_le_bytes());
        head.extend_from_slice(&(vocab_size as u32).to_le_bytes());
        head.extend_from_slice(&0u32.to_le_bytes());
        out.write_all(&head)
            .ctx(|| format!("writing {}", path.display()))?;
        Ok(Self {
            path: path.to_path_buf(),
            out,
            width,
            vocab_size,
            count: 0,
        })
    }

    /// Ids written so far.
    pub fn len(&self) -> u64 {
        self.count
    }

    pub fn is_empty(&self) -> bool {
        self.count == 0
    }

    /// Appends `ids`; an id beyond the vocabulary is refused with its position in the file.
    pub fn push(&mut self, ids: &[u32]) -> Result<()> {
        if let Some((k, &id)) = ids
            .iter()
            .enumerate()
            .find(|(_, &i)| i as usize >= self.vocab_size)
        {
            return Err(TrainError::Data(format!(
                "token {id} at position {} is >= vocab size {}",
                self.count + k as u64,
                self.vocab_size
            )));
        }
        let mut buf = Vec::with_capacity(ids.len() * self.width as usize);
        for &id in ids {
            if self.width == 2 {
                buf.extend_from_slice(&(id as u16).to_le_bytes());
            } else {
                buf.extend_from_slice(&id.to_le_bytes());
            }
        }
        self.out
            .write_all(&buf)
            .ctx(|| format!("writing {}", self.path.display()))?;
        self.count += ids.len() as u64;
        Ok(())
    }

    /// Writes the final count into the header and syncs the file.
    pub fn finish(self) -> Result<()> {
        let path = self.path;
        let mut f = self
            .out
            .into_inner()
            .map_err(|e| e.into_error())
            .ctx(|| format!("writing {}", path.display()))?;
        f.seek(SeekFrom::Start(16))
            .and_then(|_| f.write_all(&self.count.to_le_bytes()))
            .ctx(|| format!("writing {}", path.display()))?;
        f.sync_all().ctx(|| format!("syncing {}", path.display()))
    }
}

/// A validated, memory-mapped token file.
pub struct TokenFile {
    map: memmap2::Mmap,
    width: usize,
    count: usize,
    vocab_size: usize,
}

impl TokenFile {
    pub fn open(path: &Path) -> Result<Self> {
        let bad = |msg: String| TrainError::TokenFile {
            path: PathBuf::from(path),
            msg,
        };
        let f =
            std::fs::File::open(path).ctx(|| format!("opening token file {}", path.display()))?;
        // SAFETY: the file is opened read-only; we do not guard against concurrent truncation
        // by other processes (the same contract as numpy's memmap).
        let map =
            unsafe { memmap2::Mmap::map(&f) }.ctx(|| format!("mapping {}", path.display()))?;
        if map.len() < HEADER_BYTES {
            return Err(bad(format!(
                "{} bytes is shorter than the {HEADER_BYTES}-byte header",
                map.len()
            )));
        }
        if &map[..8] != MAGIC {
            return Err(bad("bad magic (not an xtrain token file)".into()));
        }
        let u32_at = |o: usize| u32::from_le_bytes(map[o..o + 4].try_into().unwrap());
        let version = u32_at(8);
        if version != VERSION {
            return Err(bad(format!(
                "unsupported version {version} (expected {VERSION})"
            )));
        }
        let width = u32_at(12) as usize;
        if width != 2 && width != 4 {
            return Err(bad(format!(
                "unsupported dtype width {width} (expected 2 or 4)"
            )));
        }
        let count = u64::from_le_bytes(map[16..24].try_into().unwrap());
        let vocab_size = u32_at(24) as usize;
        let expected = (count as u128) * width as u128 + HEADER_BYTES as u128;
        if expected != map.len() as u128 {
            return Err(bad(format!(
                "header says {count} tokens ({expected} bytes) but the file has {} bytes (truncated?)",
                map.len()
            )));
        }
        Ok(Self {
            map,
            width,
            count: count as usize,
            vocab_size,
        })
    }

    pub fn len(&self) -> usize {
        self.count
    }

    pub fn is_empty(&self) -> bool {
        self.count == 0
    }

    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    pub fn get(&self, i: usize) -> u32 {
        let o = HEADER_BYTES + i * self.width;
        if self.width == 2 {
            u16::from_le_bytes([self.map[o], self.map[o + 1]]) as u32
        } else {
            u32::from_le_bytes(self.map[o..o + 4].try_into().unwrap())
        }
    }

    /// Copies all ids out (small corpora) — training reads through [`TokenFile::get`] otherwise.
    pub fn to_vec(&self) -> Vec<u32> {
        (0..self.count).map(|i| self.get(i)).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn write_read_and_validate() {
        let dir = std::env::temp_dir().join(format!("xtrain-tok-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("a.tok");
        let ids: Vec<u32> = (0..1000).map(|i| (i * 7) % 300).collect();
        write(&p, &ids, 300).unwrap();
        let t = TokenFile::open(&p).unwrap();
        assert_eq!((t.len(), t.vocab_size()), (1000, 300));
        assert_eq!(t.to_vec(), ids);
        // Wide ids use 4 bytes.
        let wide = dir.join("w.tok");
        write(&wide, &[70_000, 1], 70_001).unwrap();
        assert_eq!(TokenFile::open(&wide).unwrap().to_vec(), vec![70_000, 1]);
        // Ids beyond the vocabulary are refused on write.
        assert!(write(&dir.join("x.tok"), &[5, 300], 300)
            .unwrap_err()
            .to_string()
            .contains("300"));
        // Truncation, bad magic, bad version, bad dtype.
        let bytes = std::fs::read(&p).unwrap();
        let cases: Vec<(Vec<u8>, &str)> = vec![
            (bytes[..bytes.len() - 1].to_vec(), "truncated"),
            (bytes[..10].to_vec(), "shorter"),
            ([b"NOTATOK\0".as_slice(), &bytes[8..]].concat(), "magic"),
            (
                {
                    let mut b = bytes.clone();
                    b[8] = 9;
                    b
                },
                "version",
            ),
            (
                {
                    let mut b = bytes.clone();
                    b[12] = 3;
                    b
                },
                "dtype",
            ),
        ];
        for (data, needle) in cases {
            let q = dir.join("bad.tok");
            std::fs::write(&q, data).unwrap();
            let e = TokenFile::open(&q).err().unwrap().to_string();
            assert!(e.contains(needle), "{e}");
        }
        assert!(TokenFile::open(&dir.join("missing.tok")).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
