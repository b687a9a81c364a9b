//! `xtrain tokenize` streams: a JSONL corpus several times larger than a memory cap tokenizes
//! into a shard folder with the child process's peak resident set (its `ru_maxrss`, from
//! `wait4`) under the cap, and the folder holds every document.
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// Corpus size and the cap on peak RSS: the corpus is twice the cap, so a pipeline that held
/// the corpus (or its ids, four bytes per byte here) could not pass.
const CORPUS_BYTES: usize = 128 << 20;
const CAP_BYTES: u64 = 64 << 20;

/// A temporary folder, removed when dropped (a failing test leaves no corpus behind).
struct TempDir(PathBuf);

impl TempDir {
    fn new() -> Self {
        let d = std::env::temp_dir().join(format!("xtrain-tokenize-memory-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        Self(d)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Writes about `bytes` of JSONL, documents of 1–16 KiB (some non-ASCII), streaming; returns
/// the documents and their text bytes.
fn write_corpus(path: &Path, bytes: usize) -> (u64, u64) {
    let mut out = std::io::BufWriter::new(std::fs::File::create(path).unwrap());
    let words = [
        "the", "robot", "finds", "seven", "apples", "naïve", "café", "→", "data",
    ];
    let (mut written, mut docs, mut text_bytes) = (0usize, 0u64, 0u64);
    let mut text = String::new();
    while written < bytes {
        text.clear();
        let len = 1024 + (docs as usize * 7919) % (15 << 10);
        let mut w = docs as usize;
        while text.len() < len {
            text.push_str(words[w % words.len()]);
            text.push(if w.is_multiple_of(13) { '\n' } else { ' ' });
            w = w.wrapping_mul(31).wrapping_add(7);
        }
        let line = serde_json::json!({ "id": docs, "text": text }).to_string();
        writeln!(out, "{line}").unwrap();
        written += line.len() + 1;
        docs += 1;
        text_bytes += text.len() as u64;
    }
    out.flush().unwrap();
    (docs, text_bytes)
}

/// Runs `xtrain args` to completion; returns whether it succeeded, its output and its peak
/// resident set in bytes.
// The child is reaped by `wait4`, which also returns its own resource usage (`Child::wait`
// would not).
#[allow(clippy::zombie_processes)]
fn run_measured(args: &[&str]) -> (bool, String, u64) {
    let child = Command::new(env!("CARGO_BIN_EXE_xtrain"))
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("running xtrain");
    let pid = child.id() as libc::pid_t;
    // The output is small (a summary line), so reading it after the exit cannot block it.
    let (mut status, mut usage) = (0, unsafe { std::mem::zeroed::<libc::rusage>() });
    // SAFETY: waits for our own child; status and usage are valid out-pointers.
    let r = unsafe { libc::wait4(pid, &mut status, 0, &mut usage) };
    assert_eq!(r, pid, "wait4: {}", std::io::Error::last_os_error());
    let mut text = String::new();
    child.stdout.unwrap().read_to_string(&mut text).unwrap();
    child.stderr.unwrap().read_to_string(&mut text).unwrap();
    let ok = libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0;
    // Linux reports ru_maxrss in KiB.
    (ok, text, usage.ru_maxrss as u64 * 1024)
}

#[test]
fn a_corpus_twice_the_cap_tokenizes_under_it() {
    let tmp = TempDir::new();
    let d = &tmp.0;
    let corpus = d.join("corpus.jsonl");
    let (docs, text_bytes) = write_corpus(&corpus, CORPUS_BYTES);
    let size = std::fs::metadata(&corpus).unwrap().len();
    assert!(size >= 2 * CAP_BYTES, "corpus of {size} bytes");
    let out = d.join("shards");
    let (ok, text, peak) = run_measured(&[
        "tokenize",
        corpus.to_str().unwrap(),
        "-o",
        out.to_str().unwrap(),
        "--shard-tokens",
        "50000000",
    ]);
    assert!(ok, "{text}");
    let manifest: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("index.json")).unwrap()).unwrap();
    // Byte tokenizer: each document is its bytes and an EOS.
    assert_eq!(manifest["documents"], docs, "{text}");
    assert_eq!(manifest["tokens"], text_bytes + docs, "{text}");
    assert!(manifest["shards"].as_array().unwrap().len() >= 3, "{text}");
    assert!(
        peak < CAP_BYTES,
        "peak RSS {} MiB over the {} MiB cap tokenizing {} MiB",
        peak >> 20,
        CAP_BYTES >> 20,
        size >> 20
    );
    eprintln!("peak RSS {} MiB tokenizing {} MiB", peak >> 20, size >> 20);
}
