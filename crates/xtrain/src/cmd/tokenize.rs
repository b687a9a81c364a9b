//! `xtrain tokenize`: train a byte-level BPE tokenizer (optional) and write a token file.
use anyhow::{bail, Result};
use clap::Args;
use std::path::PathBuf;
use train::data::tokenizer::{train_bpe, Tokenizer};
use train::data::tokfile;

#[derive(Args, Debug)]
pub struct TokenizeArgs {
    /// Input text files.
    #[arg(required = true)]
    pub inputs: Vec<PathBuf>,
    /// Output token file (`.tok`).
    #[arg(long, short)]
    pub out: PathBuf,
    /// Train a BPE tokenizer with this vocabulary size and save it beside the output as
    /// `tokenizer.json`.
    #[arg(long)]
    pub train_bpe: Option<usize>,
    /// Use an existing `tokenizer.json` (default: bytes).
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
}

pub fn run_cmd(a: TokenizeArgs) -> Result<()> {
    let files: Vec<String> = a
        .inputs
        .iter()
        .map(|p| p.to_string_lossy().into_owned())
        .collect();
    let tk = match (a.train_bpe, &a.tokenizer) {
        (Some(_), Some(_)) => bail!("--train-bpe and --tokenizer are exclusive"),
        (Some(v), None) => {
            let trained = train_bpe(&files, v)?;
            let dir = a
                .out
                .parent()
                .filter(|p| !p.as_os_str().is_empty())
                .map(PathBuf::from)
                .unwrap_or_else(|| ".".into());
            std::fs::create_dir_all(&dir)?;
            let path = dir.join("tokenizer.json");
            trained
                .save(&path, false)
                .map_err(|e| anyhow::anyhow!("saving {}: {e}", path.display()))?;
            eprintln!(
                "tokenizer: {} ({} tokens)",
                path.display(),
                trained.get_vocab_size(true)
            );
            Tokenizer::Hf(Box::new(trained))
        }
        (None, Some(p)) => Tokenizer::from_spec(&p.to_string_lossy())?,
        (None, None) => Tokenizer::Byte,
    };
    let mut ids = Vec::new();
    for f in &files {
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
