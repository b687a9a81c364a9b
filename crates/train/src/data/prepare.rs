//! Tokenizing a corpus into a shard folder: documents are read one file at a time, tokenized
//! in parallel batches (on the process's kernel thread pool, `XTRAIN_THREADS`) and appended to
//! shards as they fill, so memory stays bounded by a batch and the largest single document
//! whatever the corpus size.
use super::shards::{Manifest, ShardWriter};
use super::sources::{self, BYTES_READ};
use super::tokenizer::Tokenizer;
use crate::error::{Result, TrainError};
use rayon::prelude::*;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::time::Instant;

/// Documents per parallel batch, and the text bytes at which a batch is cut earlier. A batch
/// holds its text and then its ids, up to 4 bytes per text byte (the byte tokenizer), so
/// `BATCH_BYTES` bounds the pipeline's memory at about 5 × 4 MiB plus the largest document.
const BATCH_DOCS: usize = 4096;
const BATCH_BYTES: usize = 4 << 20;

/// How to turn documents into shards.
#[derive(Clone, Debug)]
pub struct PrepareOptions {
    /// JSON field or Parquet column holding the text.
    pub field: String,
    /// Tokens per shard (a longer document gets a shard of its own).
    pub shard_tokens: u64,
    /// The tokenizer as the manifest names it (`byte` or a `tokenizer.json` path).
    pub tokenizer_name: String,
    /// End- and beginning-of-document tokens (Hugging Face tokenizers only; see
    /// [`Tokenizer::document_ids`]).
    pub eos: Option<String>,
    pub bos: Option<String>,
    /// Draw a progress bar (when stderr is a terminal).
    pub progress: bool,
}

/// What [`prepare`] wrote.
#[derive(Clone, Debug)]
pub struct Summary {
    pub manifest: Manifest,
    /// Documents with no text, which are not written.
    pub empty_documents: u64,
    pub seconds: f64,
}

impl Summary {
    /// The closing line: documents, tokens, throughput, shards.
    pub fn line(&self, out: &Path) -> String {
        let m = &self.manifest;
        let mut s = format!(
            "{}: {} documents, {} tokens, {:.0} tokens/s, {} shard(s), vocab {}, eos {}",
            out.display(),
            m.documents,
            m.tokens,
            m.tokens as f64 / self.seconds.max(1e-9),
            m.shards.len(),
            m.vocab_size,
            m.eos_id
        );
        if self.empty_documents > 0 {
            s.push_str(&format!(
                ", {} empty document(s) skipped",
                self.empty_documents
            ));
        }
        s
    }
}

/// Tokenizes the documents of `files` (see [`sources::expand`]) with `tk` into a new shard
/// folder `out`.
pub fn prepare(
    files: &[PathBuf],
    tk: &Tokenizer,
    out: &Path,
    o: &PrepareOptions,
) -> Result<Summary> {
    let started = Instant::now();
    let (bos, eos) = tk.document_ids(o.eos.as_deref(), o.bos.as_deref())?;
    let mut writer = ShardWriter::create(out, o.shard_tokens, tk.vocab_size())?;
    let total: u64 = files
        .iter()
        .map(|f| std::fs::metadata(f).map(|m| m.len()).unwrap_or(0))
        .sum();
    let bar = if o.progress {
        indicatif::ProgressBar::new(total)
    } else {
        indicatif::ProgressBar::hidden()
    };
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "{bar:30} {bytes}/{total_bytes} {elapsed_precise} (eta {eta}) {msg}",
        )
        .expect("a valid template"),
    );
    let base = BYTES_READ.load(Ordering::Relaxed);
    let (mut docs, mut tokens, mut empty) = (0u64, 0u64, 0u64);
    let mut batch: Vec<String> = Vec::new();
    let mut batch_bytes = 0usize;
    let mut flush = |batch: &mut Vec<String>, writer: &mut ShardWriter| -> Result<()> {
        let encoded: Vec<Vec<u32>> = tensor::threads::install(|| {
            batch
                .par_iter()
                .map(|text| tk.encode_document(text, bos, eos))
                .collect::<Result<_>>()
        })?;
        for ids in &encoded {
            writer.push(ids)?;
            tokens += ids.len() as u64;
        }
        docs += encoded.len() as u64;
        batch.clear();
        bar.set_position(BYTES_READ.load(Ordering::Relaxed) - base);
        bar.set_message(format!(
            "{docs} documents, {tokens} tokens, {:.0} tokens/s",
            tokens as f64 / started.elapsed().as_secs_f64().max(1e-9)
        ));
        Ok(())
    };
    for file in files {
        sources::for_each_document(file, &o.field, &mut |text| {
            if text.is_empty() {
                empty += 1;
                return Ok(());
            }
            batch_bytes += text.len();
            batch.push(text);
            if batch.len() >= BATCH_DOCS || batch_bytes >= BATCH_BYTES {
                batch_bytes = 0;
                flush(&mut batch, &mut writer)?;
            }
            Ok(())
        })?;
    }
    flush(&mut batch, &mut writer)?;
    bar.finish_and_clear();
    if docs == 0 {
        return Err(TrainError::Data(format!(
            "the inputs hold no documents ({} file(s), {empty} empty document(s))",
            files.len()
        )));
    }
    let manifest = writer.finish(&o.tokenizer_name, bos, eos)?;
    Ok(Summary {
        manifest,
        empty_documents: empty,
        seconds: started.elapsed().as_secs_f64(),
    })
}

/// Every document of `files`, streamed from a reader thread (for training a tokenizer on
/// them): the iterator ends at the first error, which the returned handle then reports.
pub fn document_stream(
    files: Vec<PathBuf>,
    field: String,
) -> (
    impl Iterator<Item = String> + Send,
    std::thread::JoinHandle<Result<()>>,
) {
    let (tx, rx) = std::sync::mpsc::sync_channel::<String>(256);
    let reader = std::thread::spawn(move || {
        for f in &files {
            sources::for_each_document(f, &field, &mut |text| {
                // A closed channel means the consumer stopped; nothing more to read.
                tx.send(text)
                    .map_err(|_| TrainError::Data("document consumer stopped".into()))
            })?;
        }
        Ok(())
    });
    (rx.into_iter(), reader)
}
