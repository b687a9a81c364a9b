//! `xtrain generate`: sample text from a checkpoint.
use anyhow::Result;
use clap::Args;
use std::path::PathBuf;
use train::generate::{generate, SampleOptions};
use train::trainer::Trainer;

#[derive(Args, Debug)]
pub struct GenerateArgs {
    /// Checkpoint directory (or run directory).
    #[arg(long)]
    pub ckpt: PathBuf,
    #[arg(long, default_value = "the ")]
    pub prompt: String,
    #[arg(long, default_value_t = 200)]
    pub max_new_tokens: usize,
    /// 0 = greedy.
    #[arg(long, default_value_t = 0.8)]
    pub temperature: f64,
    /// 0 = no top-k filter.
    #[arg(long, default_value_t = 20)]
    pub top_k: usize,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

pub fn run_cmd(a: GenerateArgs) -> Result<()> {
    let ck = train::checkpoint::resolve(&a.ckpt)?;
    // Loading the trainer also validates the checkpoint's data settings; keep the corpus small.
    let t = Trainer::from_checkpoint(&ck, &["data.corpus_bytes=20000".into()])?;
    let o = SampleOptions {
        max_new_tokens: a.max_new_tokens,
        temperature: a.temperature,
        top_k: a.top_k,
        seed: a.seed,
        context: t.cfg.model.seq_len,
    };
    let text = generate(&t.model, t.weights.master(), &t.tokenizer, &a.prompt, &o)?;
    println!("{}{}", a.prompt, text);
    Ok(())
}
