//! `xtrain convert`: checkpoints to and from Hugging Face `config.json` + `model.safetensors`.
use anyhow::{bail, Result};
use clap::Args;
use std::path::PathBuf;

#[derive(Args, Debug)]
pub struct ConvertArgs {
    /// Export checkpoint CKPT as a Hugging Face directory OUT.
    #[arg(long, num_args = 2, value_names = ["CKPT", "OUT"])]
    pub to_hf: Option<Vec<PathBuf>>,
    /// Import Hugging Face directory DIR as checkpoint OUT.
    #[arg(long, num_args = 2, value_names = ["DIR", "OUT"])]
    pub from_hf: Option<Vec<PathBuf>>,
    /// Training preset whose optimizer settings an imported checkpoint gets.
    #[arg(long, default_value = "tiny")]
    pub preset: String,
    /// Config overrides for an imported checkpoint (`key=value`, repeatable).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub overrides: Vec<String>,
}

pub fn run_cmd(a: ConvertArgs) -> Result<()> {
    match (&a.to_hf, &a.from_hf) {
        (Some(p), None) => {
            train::hf::to_hf(&p[0], &p[1])?;
            println!("wrote {}/config.json and model.safetensors", p[1].display());
        }
        (None, Some(p)) => {
            train::hf::from_hf(&p[0], &p[1], &a.preset, &a.overrides)?;
            println!("wrote checkpoint {}", p[1].display());
        }
        _ => bail!("give exactly one of --to-hf CKPT OUT or --from-hf DIR OUT"),
    }
    Ok(())
}
