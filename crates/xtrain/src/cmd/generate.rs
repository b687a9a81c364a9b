//! `xtrain generate`: sample text from any checkpoint (saved at any layout).
use anyhow::Result;
use clap::Args;
use std::path::PathBuf;
use train::generate::{generate, SampleOptions};

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
    /// Where to run the model: cpu, cuda or cuda:N (default `XTRAIN_DEVICE`, else the CPU).
    #[arg(long)]
    pub device: Option<String>,
}

pub fn run_cmd(a: GenerateArgs) -> Result<()> {
    let (cfg, model, params, tokenizer) = train::trainer::load_model(&a.ckpt)?;
    let o = SampleOptions {
        max_new_tokens: a.max_new_tokens,
        temperature: a.temperature,
        top_k: a.top_k,
        seed: a.seed,
        context: cfg.model.seq_len,
    };
    let dev = match &a.device {
        Some(d) => tensor::buf::Dev::open(d)?,
        None => tensor::buf::Dev::from_env()?,
    };
    let params = dev.from_vec(params)?;
    let text = generate(&model, params.r(), &tokenizer, &a.prompt, &o)?;
    println!("{}{}", a.prompt, text);
    Ok(())
}
