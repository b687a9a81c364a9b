//! `xtrain tokenize`: tokenize a corpus (text, JSONL, Parquet; optionally training a
//! byte-level BPE tokenizer first) into a shard folder, or text files into one token file.
use anyhow::{bail, Context, Result};
use clap::Args;
use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use train::data::prepare::{document_stream, prepare, PrepareOptions};
use train::data::sources;
use train::data::tokenizer::{save_tokenizer, train_bpe, train_bpe_on, HfTokenizer, Tokenizer};
use train::data::tokfile;

#[derive(Args, Debug)]
pub struct TokenizeArgs {
    /// Input files, folders (their .jsonl/.ndjson/.txt files, optionally .gz or .zst, and
    /// .parquet files, recursively) or quoted globs. A file of another name is read as text.
    #[arg(required = true)]
    pub inputs: Vec<String>,
    /// Output: a shard folder (created; must be absent or empty), or a `.tok` file (text
    /// inputs only, all held in memory, no document boundaries).
    #[arg(long, short)]
    pub out: PathBuf,
    /// JSON field or Parquet column holding each document's text.
    #[arg(long, default_value = "text")]
    pub field: String,
    /// Tokens per shard (a shard holds whole documents).
    #[arg(long, default_value_t = 100_000_000)]
    pub shard_tokens: u64,
    /// Train a BPE tokenizer with this vocabulary size and save it as `tokenizer.json` in the
    /// shard folder (beside a `.tok` output).
    #[arg(long)]
    pub train_bpe: Option<usize>,
    /// Use an existing `tokenizer.json` (default: bytes).
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// End-of-document token of a `tokenizer.json` (default: the first of <|endoftext|>, </s>,
    /// <|end_of_text|>, <eos> it has).
    #[arg(long)]
    pub eos: Option<String>,
    /// Beginning-of-document token of a `tokenizer.json` (default: <s>, <|begin_of_text|> or
    /// <bos> if it has one; none otherwise).
    #[arg(long)]
    pub bos: Option<String>,
    /// Tokenizing threads (default: `XTRAIN_THREADS`, else every core).
    #[arg(long)]
    pub threads: Option<usize>,
}

pub fn run_cmd(a: TokenizeArgs) -> Result<()> {
    if a.train_bpe.is_some() && a.tokenizer.is_some() {
        bail!("--train-bpe and --tokenizer are exclusive");
    }
    if let Some(n) = a.threads {
        tensor::threads::set_thread_budget(n).with_context(|| format!("--threads {n}"))?;
    }
    let files = sources::expand(&a.inputs)?;
    if a.out.extension().is_some_and(|e| e == "tok") {
        return token_file(&a, &files);
    }
    let (tk, name) = match (a.train_bpe, &a.tokenizer) {
        (Some(v), _) => {
            // Checked before training, which may take long.
            if a.out.exists() && std::fs::read_dir(&a.out)?.next().is_some() {
                bail!("output folder {} is not empty", a.out.display());
            }
            let (docs, reader) = document_stream(files.clone(), a.field.clone());
            let trained = train_bpe_on(docs, v);
            reader
                .join()
                .map_err(|_| anyhow::anyhow!("the document reader panicked"))??;
            let tk = Tokenizer::Hf(Box::new(trained?));
            // The manifest names the tokenizer relative to the folder it is saved in.
            let summary = run_prepare(&a, &files, &tk, "tokenizer.json")?;
            if let Tokenizer::Hf(t) = &tk {
                save(t, &a.out.join("tokenizer.json"))?;
            }
            println!("{}", summary.line(&a.out));
            return Ok(());
        }
        (None, Some(p)) => (
            Tokenizer::from_spec(&p.to_string_lossy())?,
            p.to_string_lossy().into_owned(),
        ),
        (None, None) => (Tokenizer::Byte, "byte".to_string()),
    };
    let summary = run_prepare(&a, &files, &tk, &name)?;
    println!("{}", summary.line(&a.out));
    Ok(())
}

fn run_prepare(
    a: &TokenizeArgs,
    files: &[PathBuf],
    tk: &Tokenizer,
    name: &str,
) -> train::Result<train::data::prepare::Summary> {
    let o = PrepareOptions {
        field: a.field.clone(),
        shard_tokens: a.shard_tokens,
        tokenizer_name: name.into(),
        eos: a.eos.clone(),
        bos: a.bos.clone(),
        progress: std::io::stderr().is_terminal(),
    };
    prepare(files, tk, &a.out, &o)
}

fn save(tk: &HfTokenizer, path: &Path) -> Result<()> {
    let vocab = save_tokenizer(tk, path)?;
    eprintln!("tokenizer: {} ({vocab} tokens)", path.display());
    Ok(())
}

/// The single token file of text inputs (the original form of this command).
fn token_file(a: &TokenizeArgs, files: &[PathBuf]) -> Result<()> {
    if let Some(f) = files
        .iter()
        .find(|f| sources::detect(f).is_some_and(|(fmt, _)| fmt != sources::Format::Text))
    {
        bail!(
            "{}: a .tok output takes text files; write JSONL or Parquet corpora to a shard folder (-o FOLDER)",
            f.display()
        );
    }
    let names: Vec<String> = files
        .iter()
        .map(|p| p.to_string_lossy().into_owned())
        .collect();
    let tk = match (a.train_bpe, &a.tokenizer) {
        (Some(v), _) => {
            let trained = train_bpe(&names, v)?;
            let dir = a
                .out
                .parent()
                .filter(|p| !p.as_os_str().is_empty())
                .map(PathBuf::from)
                .unwrap_or_else(|| ".".into());
            std::fs::create_dir_all(&dir)?;
            save(&trained, &dir.join("tokenizer.json"))?;
            Tokenizer::Hf(Box::new(trained))
        }
        (None, Some(p)) => Tokenizer::from_spec(&p.to_string_lossy())?,
        (None, None) => Tokenizer::Byte,
    };
    let mut ids = Vec::new();
    for f in &names {
        let text = std::fs::read_to_string(f).map_err(|e| anyhow::anyhow!("reading {f}: {e}"))?;
        ids.extend(tk.encode(&text)?);
    }
    if ids.is_empty() {
        bail!("the inputs hold no tokens");
    }
    tokfile::write(&a.out, &ids, tk.vocab_size())?;
    println!(
        "{}: {} tokens, vocab {}",
        a.out.display(),
        ids.len(),
        tk.vocab_size()
    );
    Ok(())
}
