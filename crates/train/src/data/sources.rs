//! Corpus inputs: expanding files, folders and globs into a list of input files, and reading
//! each file's documents one at a time (bounded memory whatever the corpus size).
//!
//! Formats, by file name: `.jsonl` / `.ndjson` (one JSON object per line, the document is a
//! chosen string field), `.parquet` (a chosen string column, one document per row), and text
//! (`.txt`, or any other name given explicitly: the whole file is one document). `.gz` and
//! `.zst` after a JSONL or text name are decompressed while reading. Every error names the file
//! and the line (JSONL) or row (Parquet).
use crate::error::{IoContext, Result, TrainError};
use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// How a file's documents are stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// The whole (decompressed) file is one document.
    Text,
    /// One JSON object per line.
    Jsonl,
    /// One document per row of a string column.
    Parquet,
}

/// Compression of a JSONL or text file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Compression {
    None,
    Gzip,
    Zstd,
}

/// The format and compression a file name says, or `None` for a name no format claims.
pub fn detect(path: &Path) -> Option<(Format, Compression)> {
    let name = path.file_name()?.to_string_lossy().to_ascii_lowercase();
    let (stem, comp) = if let Some(s) = name.strip_suffix(".gz") {
        (s, Compression::Gzip)
    } else if let Some(s) = name.strip_suffix(".zst") {
        (s, Compression::Zstd)
    } else {
        (name.as_str(), Compression::None)
    };
    if stem.ends_with(".jsonl") || stem.ends_with(".ndjson") {
        Some((Format::Jsonl, comp))
    } else if stem.ends_with(".txt") {
        Some((Format::Text, comp))
    } else if stem.ends_with(".parquet") && comp == Compression::None {
        Some((Format::Parquet, comp))
    } else {
        None
    }
}

/// The input files `specs` name, in order: a file as given (a name no format claims is read as
/// text, as `xtrain tokenize` always did), a folder's files of known formats recursively in
/// name order, a glob's matches in name order. A folder or glob that yields no file is an error.
pub fn expand(specs: &[String]) -> Result<Vec<PathBuf>> {
    let mut out = Vec::new();
    for spec in specs {
        let path = Path::new(spec);
        if path.is_file() {
            out.push(path.to_path_buf());
        } else if path.is_dir() {
            let before = out.len();
            walk(path, &mut out)?;
            if out.len() == before {
                return Err(TrainError::Data(format!(
                    "folder {spec} holds no .jsonl, .ndjson, .txt (optionally .gz or .zst) or .parquet file"
                )));
            }
        } else if spec.contains(['*', '?', '[']) {
            let pattern =
                glob::glob(spec).map_err(|e| TrainError::Data(format!("glob {spec}: {e}")))?;
            let mut hits = Vec::new();
            for entry in pattern {
                let p = entry.map_err(|e| TrainError::Data(format!("glob {spec}: {e}")))?;
                if p.is_file() {
                    hits.push(p);
                }
            }
            if hits.is_empty() {
                return Err(TrainError::Data(format!("glob {spec} matches no file")));
            }
            hits.sort();
            out.extend(hits);
        } else {
            return Err(TrainError::Data(format!("input {spec} does not exist")));
        }
    }
    Ok(out)
}

fn walk(dir: &Path, out: &mut Vec<PathBuf>) -> Result<()> {
    let mut entries: Vec<PathBuf> = std::fs::read_dir(dir)
        .ctx(|| format!("listing {}", dir.display()))?
        .map(|e| e.map(|e| e.path()))
        .collect::<std::io::Result<_>>()
        .ctx(|| format!("listing {}", dir.display()))?;
    entries.sort();
    for p in entries {
        if p.is_dir() {
            walk(&p, out)?;
        } else if detect(&p).is_some() {
            out.push(p);
        }
    }
    Ok(())
}

/// Counts the bytes read from a file, for the progress bar.
struct Counting<R> {
    inner: R,
    read: &'static AtomicU64,
}

impl<R: Read> Read for Counting<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.read.fetch_add(n as u64, Ordering::Relaxed);
        Ok(n)
    }
}

/// A zstd stream of any number of frames (ruzstd's decoder reads one).
struct ZstdFrames<R: BufRead> {
    decoder: Option<ruzstd::decoding::StreamingDecoder<R, ruzstd::decoding::FrameDecoder>>,
}

impl<R: BufRead> ZstdFrames<R> {
    fn new(r: R) -> std::io::Result<Self> {
        Ok(Self {
            decoder: Some(
                ruzstd::decoding::StreamingDecoder::new(r).map_err(std::io::Error::other)?,
            ),
        })
    }
}

impl<R: BufRead> Read for ZstdFrames<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        loop {
            let Some(dec) = self.decoder.as_mut() else {
                return Ok(0);
            };
            let n = dec.read(buf)?;
            if n > 0 || buf.is_empty() {
                return Ok(n);
            }
            // This frame is done: another may follow.
            let mut rest = self.decoder.take().expect("decoder present").into_inner();
            if rest.fill_buf()?.is_empty() {
                return Ok(0);
            }
            self.decoder =
                Some(ruzstd::decoding::StreamingDecoder::new(rest).map_err(std::io::Error::other)?);
        }
    }
}

/// Bytes read from input files so far (all readers of this process), for progress bars.
pub static BYTES_READ: AtomicU64 = AtomicU64::new(0);

fn open(path: &Path, comp: Compression) -> Result<Box<dyn BufRead>> {
    let f = std::fs::File::open(path).ctx(|| format!("opening {}", path.display()))?;
    let raw = BufReader::with_capacity(
        1 << 20,
        Counting {
            inner: f,
            read: &BYTES_READ,
        },
    );
    Ok(match comp {
        Compression::None => Box::new(raw),
        Compression::Gzip => Box::new(BufReader::new(flate2::bufread::MultiGzDecoder::new(raw))),
        Compression::Zstd => Box::new(BufReader::new(
            ZstdFrames::new(raw).ctx(|| format!("reading zstd {}", path.display()))?,
        )),
    })
}

/// Calls `doc` with each document of `path` in order; `field` names the JSON field or Parquet
/// column holding the text. Stops at the first error (the file's or `doc`'s).
pub fn for_each_document(
    path: &Path,
    field: &str,
    doc: &mut dyn FnMut(String) -> Result<()>,
) -> Result<()> {
    let (format, comp) = detect(path).unwrap_or((Format::Text, Compression::None));
    match format {
        Format::Text => {
            let mut text = String::new();
            open(path, comp)?
                .read_to_string(&mut text)
                .ctx(|| format!("reading text {}", path.display()))?;
            doc(text)
        }
        Format::Jsonl => jsonl(path, comp, field, doc),
        Format::Parquet => parquet(path, field, doc),
    }
}

fn jsonl(
    path: &Path,
    comp: Compression,
    field: &str,
    doc: &mut dyn FnMut(String) -> Result<()>,
) -> Result<()> {
    let mut r = open(path, comp)?;
    let mut line = String::new();
    let mut n = 0usize;
    loop {
        line.clear();
        n += 1;
        let read = r
            .read_line(&mut line)
            .ctx(|| format!("reading {} line {n}", path.display()))?;
        if read == 0 {
            return Ok(());
        }
        if line.trim().is_empty() {
            continue;
        }
        let bad = |msg: String| TrainError::Data(format!("{}:{n}: {msg}", path.display()));
        let mut obj: serde_json::Map<String, serde_json::Value> =
            serde_json::from_str(&line).map_err(|e| bad(format!("not a JSON object: {e}")))?;
        match obj.remove(field) {
            Some(serde_json::Value::String(s)) => doc(s)?,
            Some(other) => {
                return Err(bad(format!(
                    "field \"{field}\" is not a string (found {})",
                    json_kind(&other)
                )))
            }
            None => return Err(bad(format!("no field \"{field}\""))),
        }
    }
}

fn json_kind(v: &serde_json::Value) -> &'static str {
    match v {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "a boolean",
        serde_json::Value::Number(_) => "a number",
        serde_json::Value::String(_) => "a string",
        serde_json::Value::Array(_) => "an array",
        serde_json::Value::Object(_) => "an object",
    }
}

#[cfg(not(feature = "parquet"))]
fn parquet(path: &Path, _field: &str, _doc: &mut dyn FnMut(String) -> Result<()>) -> Result<()> {
    Err(TrainError::Data(format!(
        "{}: this build has no Parquet support (build with the `parquet` feature)",
        path.display()
    )))
}

#[cfg(feature = "parquet")]
fn parquet(path: &Path, field: &str, doc: &mut dyn FnMut(String) -> Result<()>) -> Result<()> {
    use std::panic::{catch_unwind, AssertUnwindSafe};
    // The parquet crate asserts on some malformed files; such a file is bad input, not a bug
    // here, so it is reported as an error naming the file like any other.
    match catch_unwind(AssertUnwindSafe(|| parquet_rows(path, field, doc))) {
        Ok(r) => r,
        Err(p) => {
            let msg = p
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default();
            Err(TrainError::Data(format!(
                "{}: unreadable Parquet file ({msg})",
                path.display()
            )))
        }
    }
}

#[cfg(feature = "parquet")]
fn parquet_rows(path: &Path, field: &str, doc: &mut dyn FnMut(String) -> Result<()>) -> Result<()> {
    use parquet::file::reader::{FileReader, SerializedFileReader};
    use parquet::record::Field;
    use parquet::schema::types::Type;
    use std::sync::Arc;
    let bad = |msg: String| {
        // This build's Parquet codecs (see the workspace manifest): say what to do about others.
        let hint = if msg.contains("Disabled feature") {
            " (xtrain reads uncompressed, snappy and gzip Parquet; recompress the file, e.g. pyarrow's write_table(..., compression=\"snappy\"))"
        } else {
            ""
        };
        TrainError::Data(format!("{}: {msg}{hint}", path.display()))
    };
    let f = std::fs::File::open(path).ctx(|| format!("opening {}", path.display()))?;
    let size = f.metadata().map(|m| m.len()).unwrap_or(0);
    let reader =
        SerializedFileReader::new(f).map_err(|e| bad(format!("unreadable Parquet file: {e}")))?;
    let schema = reader.metadata().file_metadata().schema();
    let column = schema
        .get_fields()
        .iter()
        .find(|t| t.name() == field)
        .ok_or_else(|| {
            let names: Vec<&str> = schema.get_fields().iter().map(|t| t.name()).collect();
            bad(format!("no column \"{field}\" (columns: {names:?})"))
        })?;
    let projection = Type::group_type_builder(schema.name())
        .with_fields(vec![Arc::clone(column)])
        .build()
        .map_err(|e| bad(e.to_string()))?;
    let mut row_no = 0u64;
    for g in 0..reader.num_row_groups() {
        let group = reader
            .get_row_group(g)
            .map_err(|e| bad(format!("row group {g}: {e}")))?;
        let rows = group
            .get_row_iter(Some(projection.clone()))
            .map_err(|e| bad(format!("row group {g}: {e}")))?;
        for row in rows {
            let row = row.map_err(|e| bad(format!("row {row_no}: {e}")))?;
            let value = row.get_column_iter().next().map(|(_, v)| v);
            let text = match value {
                Some(Field::Str(s)) => s.clone(),
                Some(Field::Bytes(b)) => String::from_utf8(b.data().to_vec())
                    .map_err(|_| bad(format!("row {row_no}: column \"{field}\" is not UTF-8")))?,
                Some(Field::Null) => {
                    return Err(bad(format!("row {row_no}: column \"{field}\" is null")))
                }
                Some(other) => {
                    return Err(bad(format!(
                        "row {row_no}: column \"{field}\" is not a string (found {other})"
                    )))
                }
                None => return Err(bad(format!("row {row_no}: no value"))),
            };
            doc(text)?;
            row_no += 1;
        }
    }
    BYTES_READ.fetch_add(size, Ordering::Relaxed);
    Ok(())
}
