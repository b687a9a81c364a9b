//! TensorBoard event files in the run directory, written by hand (no TensorFlow, no protobuf
//! library): the run's scalars each step and its config as text.
//!
//! Formats:
//! - A file is a sequence of TFRecords (tensorflow/core/lib/io/record_writer.cc): the data
//!   length as a little-endian u64, the masked CRC-32C of those 8 bytes as a u32, the data,
//!   the masked CRC-32C of the data. Masking: `((crc >> 15) | (crc << 17)) + 0xa282ead8`.
//! - Each record is a protobuf `Event` (tensorflow/core/util/event.proto): `wall_time = 1`
//!   (double), `step = 2` (int64), `file_version = 3` (string, `"brain.Event:2"` in the
//!   first record), `summary = 5`. A `Summary` (tensorflow/core/framework/summary.proto) holds
//!   repeated `value = 1`, each `Value { tag = 1, simple_value = 2 (float), tensor = 8,
//!   metadata = 9 }`; text is `metadata.plugin_data.plugin_name = "text"` with a `TensorProto
//!   { dtype = 1 (DT_STRING = 7), tensor_shape = 2 (empty: a scalar), string_val = 8 }`.
//! - Protobuf wire format (protobuf.dev/programming-guides/encoding): a key is the varint
//!   `field << 3 | wire type` (0 varint, 1 fixed64, 2 length-delimited, 5 fixed32).
//!
//! TensorBoard reads every `*tfevents*` file of a folder in name order, so a resumed run adds
//! a file; [`EventFile::continue_at`] first drops the events past the resumed step from the
//! run's earlier files (as `metrics.jsonl` drops its rows), so each step appears once.
use std::io::Write;
use std::path::{Path, PathBuf};

use crate::error::{IoContext, Result, TrainError};
use crate::metrics::StepRecord;

/// The suffix of the event files this crate writes (earlier ones are rewritten on resume,
/// other tools' files are left alone).
const SUFFIX: &str = ".xtrain";

/// CRC-32C (Castagnoli, reflected polynomial 0x82F63B78), table-driven.
pub fn crc32c(data: &[u8]) -> u32 {
    const TABLE: [u32; 256] = {
        let mut t = [0u32; 256];
        let mut i = 0;
        while i < 256 {
            let mut c = i as u32;
            let mut k = 0;
            while k < 8 {
                c = if c & 1 != 0 {
                    (c >> 1) ^ 0x82F6_3B78
                } else {
                    c >> 1
                };
                k += 1;
            }
            t[i] = c;
            i += 1;
        }
        t
    };
    !data.iter().fold(!0u32, |c, &b| {
        TABLE[((c ^ b as u32) & 0xff) as usize] ^ (c >> 8)
    })
}

/// The CRC as TFRecord stores it (rotated and offset, so a CRC of CRCs is not trivial).
pub fn masked_crc(data: &[u8]) -> u32 {
    let c = crc32c(data);
    // ((crc >> 15) | (crc << 17)) + 0xa282ead8
    c.rotate_right(15).wrapping_add(0xa282_ead8)
}

/// One TFRecord: length, its masked CRC, the data, its masked CRC.
pub fn frame(data: &[u8]) -> Vec<u8> {
    let len = (data.len() as u64).to_le_bytes();
    let mut out = Vec::with_capacity(data.len() + 16);
    out.extend_from_slice(&len);
    out.extend_from_slice(&masked_crc(&len).to_le_bytes());
    out.extend_from_slice(data);
    out.extend_from_slice(&masked_crc(data).to_le_bytes());
    out
}

/// Minimal protobuf encoding: just the field kinds `Event` needs.
mod pb {
    pub fn varint(out: &mut Vec<u8>, mut v: u64) {
        while v >= 0x80 {
            out.push(v as u8 | 0x80);
            v >>= 7;
        }
        out.push(v as u8);
    }
    fn key(out: &mut Vec<u8>, field: u32, wire: u8) {
        varint(out, (field as u64) << 3 | wire as u64);
    }
    pub fn uint(out: &mut Vec<u8>, field: u32, v: u64) {
        key(out, field, 0);
        varint(out, v);
    }
    pub fn double(out: &mut Vec<u8>, field: u32, v: f64) {
        key(out, field, 1);
        out.extend_from_slice(&v.to_le_bytes());
    }
    pub fn float(out: &mut Vec<u8>, field: u32, v: f32) {
        key(out, field, 5);
        out.extend_from_slice(&v.to_le_bytes());
    }
    pub fn bytes(out: &mut Vec<u8>, field: u32, v: &[u8]) {
        key(out, field, 2);
        varint(out, v.len() as u64);
        out.extend_from_slice(v);
    }

    /// A decoded field: number, wire type, varint or fixed value (or length), payload.
    pub type Field<'a> = (u64, u8, u64, &'a [u8]);

    /// The fields of a message, or `None` where it is malformed.
    pub fn fields(mut b: &[u8]) -> Option<Vec<Field<'_>>> {
        fn read_varint(b: &mut &[u8]) -> Option<u64> {
            let mut v = 0u64;
            for shift in (0..64).step_by(7) {
                let (&x, rest) = b.split_first()?;
                *b = rest;
                v |= ((x & 0x7f) as u64) << shift;
                if x < 0x80 {
                    return Some(v);
                }
            }
            None
        }
        let mut out = Vec::new();
        while !b.is_empty() {
            let k = read_varint(&mut b)?;
            let wire = (k & 7) as u8;
            let (v, payload): (u64, &[u8]) = match wire {
                0 => (read_varint(&mut b)?, &[]),
                1 | 5 => {
                    let n = if wire == 1 { 8 } else { 4 };
                    let (x, rest) = b.split_at_checked(n)?;
                    b = rest;
                    let mut le = [0u8; 8];
                    le[..n].copy_from_slice(x);
                    (u64::from_le_bytes(le), x)
                }
                2 => {
                    let n = usize::try_from(read_varint(&mut b)?).ok()?;
                    let (x, rest) = b.split_at_checked(n)?;
                    b = rest;
                    (n as u64, x)
                }
                _ => return None,
            };
            out.push((k >> 3, wire, v, payload));
        }
        Some(out)
    }
}

fn wall_time() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// An `Event` with `wall_time`, `step` and the given other fields already encoded.
fn event(step: u64, rest: &[u8]) -> Vec<u8> {
    let mut e = Vec::with_capacity(rest.len() + 16);
    pb::double(&mut e, 1, wall_time());
    pb::uint(&mut e, 2, step);
    e.extend_from_slice(rest);
    e
}

/// `Event.summary` with one `simple_value` per (tag, value).
fn scalars_summary(values: &[(String, f64)]) -> Vec<u8> {
    let mut summary = Vec::new();
    for (tag, v) in values {
        let mut value = Vec::new();
        pb::bytes(&mut value, 1, tag.as_bytes());
        pb::float(&mut value, 2, *v as f32);
        pb::bytes(&mut summary, 1, &value);
    }
    let mut out = Vec::new();
    pb::bytes(&mut out, 5, &summary);
    out
}

/// `Event.summary` with one text value (the text plugin's string tensor).
fn text_summary(tag: &str, text: &str) -> Vec<u8> {
    let mut plugin = Vec::new();
    pb::bytes(&mut plugin, 1, b"text");
    let mut metadata = Vec::new();
    pb::bytes(&mut metadata, 1, &plugin);
    let mut tensor = Vec::new();
    pb::uint(&mut tensor, 1, 7); // DT_STRING
    pb::bytes(&mut tensor, 2, &[]); // a scalar: no dimensions
    pb::bytes(&mut tensor, 8, text.as_bytes());
    let mut value = Vec::new();
    pb::bytes(&mut value, 1, tag.as_bytes());
    pb::bytes(&mut value, 8, &tensor);
    pb::bytes(&mut value, 9, &metadata);
    let mut summary = Vec::new();
    pb::bytes(&mut summary, 1, &value);
    let mut out = Vec::new();
    pb::bytes(&mut out, 5, &summary);
    out
}

/// The records of an event file, each with its event's step; a torn last record (a process
/// killed mid-write) ends the list, any other damage is an error.
fn read_records(bytes: &[u8]) -> std::result::Result<Vec<(&[u8], u64)>, String> {
    let mut out = Vec::new();
    let mut at = 0;
    while at < bytes.len() {
        let Some(head) = bytes.get(at..at + 12) else {
            break;
        };
        let (len, crc) = head.split_at(8);
        if masked_crc(len) != u32::from_le_bytes(crc.try_into().expect("4 bytes")) {
            return Err(format!("bad length checksum at byte {at}"));
        }
        let n = u64::from_le_bytes(len.try_into().expect("8 bytes"));
        let end = usize::try_from(n)
            .ok()
            .and_then(|n| (at + 12).checked_add(n))
            .filter(|&e| e.checked_add(4).is_some_and(|e4| e4 <= bytes.len()));
        let Some(end) = end else {
            break;
        };
        let data = &bytes[at + 12..end];
        if masked_crc(data) != u32::from_le_bytes(bytes[end..end + 4].try_into().expect("4")) {
            return Err(format!("bad data checksum at byte {at}"));
        }
        let step = pb::fields(data)
            .ok_or_else(|| format!("the event at byte {at} is not a protobuf message"))?
            .iter()
            .find(|f| f.0 == 2 && f.1 == 0)
            .map_or(0, |f| f.2);
        out.push((data, step));
        at = end + 4;
    }
    Ok(out)
}

/// This machine's name for the file name (characters safe in a path), or `localhost`.
fn hostname() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: the buffer is valid for its length; gethostname writes at most that much.
    let ok = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) } == 0;
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    let name: String = String::from_utf8_lossy(&buf[..end])
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
                c
            } else {
                '_'
            }
        })
        .collect();
    if ok && !name.is_empty() {
        name
    } else {
        "localhost".into()
    }
}

/// The event files this crate wrote into `dir`, in name order.
pub fn event_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir).ctx(|| format!("listing {}", dir.display()))? {
        let path = entry.ctx(|| format!("listing {}", dir.display()))?.path();
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if name.starts_with("events.out.tfevents.") && name.contains(SUFFIX) && path.is_file() {
            files.push(path);
        }
    }
    files.sort();
    Ok(files)
}

/// Drops the events after `step` from `path` (rewritten through a temporary file renamed over
/// it, so a failure leaves the old file whole).
fn truncate_after(path: &Path, step: u64) -> Result<()> {
    let bytes = std::fs::read(path).ctx(|| format!("reading {}", path.display()))?;
    let records = read_records(&bytes).map_err(|e| {
        TrainError::Data(format!(
            "{}: {e} (remove the file, or set train.tensorboard = false)",
            path.display()
        ))
    })?;
    let kept: Vec<u8> = records
        .iter()
        .filter(|r| r.1 <= step)
        .flat_map(|r| frame(r.0))
        .collect();
    if kept != bytes {
        let tmp = path.with_file_name(".xtrain-events-rewrite.tmp");
        std::fs::write(&tmp, &kept).ctx(|| format!("writing {}", tmp.display()))?;
        std::fs::rename(&tmp, path).ctx(|| format!("replacing {}", path.display()))?;
    }
    Ok(())
}

/// An open event file.
pub struct EventFile {
    file: std::fs::File,
    path: PathBuf,
}

impl EventFile {
    /// Starts a new event file in `dir` for a run at `step`, after dropping the events past
    /// `step` from the earlier files of the run (a fresh run, step 0, removes them).
    pub fn continue_at(dir: &Path, step: usize) -> Result<Self> {
        for f in event_files(dir)? {
            if step == 0 {
                std::fs::remove_file(&f).ctx(|| format!("removing {}", f.display()))?;
            } else {
                truncate_after(&f, step as u64)?;
            }
        }
        let secs = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let base = format!("events.out.tfevents.{secs:010}.{}", hostname());
        // A second start within the same second gets the next free name.
        let mut n = 0;
        let (file, path) = loop {
            let name = match n {
                0 => format!("{base}{SUFFIX}"),
                n => format!("{base}{SUFFIX}.{n}"),
            };
            let path = dir.join(name);
            match std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(&path)
            {
                Ok(f) => break (f, path),
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && n < 100 => n += 1,
                Err(e) => return Err(e).ctx(|| format!("creating {}", path.display())),
            }
        };
        let mut me = Self { file, path };
        let mut version = Vec::new();
        pb::bytes(&mut version, 3, b"brain.Event:2");
        me.write(&event(step as u64, &version))?;
        Ok(me)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// One record, in one write (each event reaches the file as soon as it is logged).
    fn write(&mut self, event: &[u8]) -> Result<()> {
        self.file
            .write_all(&frame(event))
            .ctx(|| format!("writing TensorBoard events to {}", self.path.display()))
    }

    /// Scalars of one step (NaN and infinities as they are).
    pub fn scalars(&mut self, step: usize, values: &[(String, f64)]) -> Result<()> {
        if values.is_empty() {
            return Ok(());
        }
        self.write(&event(step as u64, &scalars_summary(values)))
    }

    /// Text (markdown, shown by TensorBoard's text dashboard) at `step`.
    pub fn text(&mut self, step: usize, tag: &str, text: &str) -> Result<()> {
        self.write(&event(step as u64, &text_summary(tag, text)))
    }
}

/// The scalars of a logged step, named as on the dashboard: `loss/train`,
/// `loss/validation`, `train/lr`, `train/grad_norm`, `train/loss_scale`, `perf/tokens_per_s`,
/// `perf/mfu`, `comm/dp_bytes_sent`, `experts/imbalance`, `experts/dropped_fraction`,
/// `experts/all_to_all_ms` (those a record has).
pub fn step_scalars(r: &StepRecord) -> Vec<(String, f64)> {
    let mut v = vec![
        ("loss/train", Some(r.loss)),
        ("loss/validation", r.val_loss),
        ("train/lr", Some(r.lr)),
        ("train/grad_norm", Some(r.grad_norm)),
        ("train/loss_scale", r.loss_scale),
        ("perf/tokens_per_s", Some(r.tokens_per_s)),
        ("perf/mfu", Some(r.mfu)),
        ("comm/dp_bytes_sent", r.dp_bytes_sent.map(|b| b as f64)),
        ("experts/imbalance", r.expert_imbalance),
        ("experts/dropped_fraction", r.dropped_fraction),
        ("experts/all_to_all_ms", r.all_to_all_ms),
    ];
    v.retain(|x| x.1.is_some());
    v.into_iter()
        .map(|(k, x)| (k.to_string(), x.expect("kept")))
        .collect()
}

/// The run's event file as the step loop uses it: a write that fails prints one warning and
/// stops TensorBoard logging, and training goes on (`metrics.jsonl` still has every step).
pub struct Board {
    file: Option<EventFile>,
}

impl Board {
    /// Opens the run's event file (errors here stop the run before its first step).
    pub fn open(dir: &Path, step: usize, config_toml: &str) -> Result<Self> {
        let mut file = EventFile::continue_at(dir, step)?;
        // A resumed run's config (perhaps a new layout) at the first step it governs; a step
        // past the checkpoint, so resuming from the same checkpoint again drops it.
        let at = if step == 0 { 0 } else { step + 1 };
        // Indented: markdown shows it as a code block.
        let text: String = config_toml.lines().map(|l| format!("    {l}\n")).collect();
        file.text(at, "config", &text)?;
        Ok(Self { file: Some(file) })
    }

    /// Does nothing (no event file).
    pub fn off() -> Self {
        Self { file: None }
    }

    pub fn scalars(&mut self, step: usize, values: &[(String, f64)]) {
        if let Some(f) = &mut self.file {
            if let Err(e) = f.scalars(step, values) {
                eprintln!("warning: {e}; TensorBoard logging stops (metrics.jsonl goes on)");
                self.file = None;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc32c_check_values() {
        // RFC 3720 appendix B.4 and the usual "123456789" check value.
        assert_eq!(crc32c(b"123456789"), 0xE306_9283);
        assert_eq!(crc32c(&[0u8; 32]), 0x8A91_36AA);
        assert_eq!(crc32c(&[0xffu8; 32]), 0x62A8_AB43);
    }

    #[test]
    fn varints_and_fields_round_trip() {
        let mut m = Vec::new();
        pb::uint(&mut m, 2, 300);
        pb::bytes(&mut m, 3, b"abc");
        pb::float(&mut m, 4, 1.5);
        assert_eq!(&m[..3], &[0x10, 0xac, 0x02]);
        let f = pb::fields(&m).unwrap();
        assert_eq!((f[0].0, f[0].2), (2, 300));
        assert_eq!((f[1].0, f[1].3), (3, &b"abc"[..]));
        assert_eq!(f32::from_bits(f[2].2 as u32), 1.5);
        assert!(pb::fields(&m[..m.len() - 1]).is_none());
    }

    #[test]
    fn truncation_keeps_the_steps_up_to_the_resume_and_refuses_damage() {
        let d = std::env::temp_dir().join(format!("xtrain-tb-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        std::fs::write(
            d.join("events.out.tfevents.1.old.xtrain"),
            b"an earlier run",
        )
        .unwrap();
        std::fs::write(d.join("events.out.tfevents.1.other"), b"another tool's").unwrap();
        let mut f = EventFile::continue_at(&d, 0).unwrap();
        // A fresh run removes the run's earlier files, not another tool's.
        assert_eq!(event_files(&d).unwrap(), [f.path()]);
        assert!(d.join("events.out.tfevents.1.other").is_file());
        for s in 1..=5 {
            f.scalars(s, &[("x".into(), s as f64)]).unwrap();
        }
        let path = f.path().to_path_buf();
        drop(f);
        let steps = |p: &Path| -> Vec<u64> {
            let b = std::fs::read(p).unwrap();
            read_records(&b).unwrap().iter().map(|r| r.1).collect()
        };
        assert_eq!(steps(&path), [0, 1, 2, 3, 4, 5]);
        // A torn tail is dropped with the later steps.
        let mut b = std::fs::read(&path).unwrap();
        b.extend_from_slice(&frame(b"partial")[..9]);
        std::fs::write(&path, &b).unwrap();
        let g = EventFile::continue_at(&d, 3).unwrap();
        assert_eq!(steps(&path), [0, 1, 2, 3]);
        assert_eq!(event_files(&d).unwrap().len(), 2);
        // A flipped byte in the middle is an error naming the file.
        let mut b = std::fs::read(&path).unwrap();
        b[30] ^= 1;
        std::fs::write(&path, &b).unwrap();
        drop(g);
        let e = EventFile::continue_at(&d, 3).err().unwrap().to_string();
        assert!(
            e.contains("checksum") && e.contains(&*path.to_string_lossy()),
            "{e}"
        );
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn a_failing_write_stops_the_logging_not_the_run() {
        let Ok(full) = std::fs::OpenOptions::new().write(true).open("/dev/full") else {
            eprintln!("skipped: no /dev/full to fail writes on");
            return;
        };
        let mut b = Board {
            file: Some(EventFile {
                file: full,
                path: "/dev/full".into(),
            }),
        };
        b.scalars(1, &[("x".into(), 1.0)]);
        assert!(b.file.is_none());
        b.scalars(2, &[("x".into(), 2.0)]);
    }
}
