//! Hugging Face interop: export a checkpoint as `config.json` + `model.safetensors` that
//! transformers' `LlamaForCausalLM` / `MixtralForCausalLM` load directly, and import such a
//! directory as a fresh xtrain checkpoint (step 0, zero optimizer state) that `xtrain train
//! --resume` and `xtrain generate` accept. Tensor names and layouts are the model crate's,
//! which are Hugging Face's, so both directions are per-tensor copies.
use crate::checkpoint::{self, SaveOptions};
use crate::config::RunConfig;
use crate::error::{IoContext, Result, TrainError};
use crate::trainer::{from_model_config, hf_config_json, model_config, Trainer};
use std::path::Path;

/// Writes `out/config.json` and `out/model.safetensors` (fp32) from checkpoint `ckpt`.
pub fn to_hf(ckpt: &Path, out: &Path) -> Result<()> {
    let files = checkpoint::load(&checkpoint::resolve(ckpt)?)?;
    let bad = |msg: String| TrainError::Checkpoint {
        path: ckpt.to_path_buf(),
        msg,
    };
    let toml_text = files
        .get("config.toml")
        .ok_or_else(|| bad("missing config.toml".into()))?;
    let cfg = RunConfig::resolve("tiny", Some(&String::from_utf8_lossy(toml_text)), &[])?;
    let weights = files
        .get("model.safetensors")
        .ok_or_else(|| bad("missing model.safetensors".into()))?;
    std::fs::create_dir_all(out).ctx(|| format!("creating {}", out.display()))?;
    std::fs::write(out.join("config.json"), hf_config_json(&model_config(&cfg)))
        .ctx(|| "writing config.json".into())?;
    // The checkpoint's weights file already has HF names and layouts in fp32.
    std::fs::write(out.join("model.safetensors"), weights)
        .ctx(|| "writing model.safetensors".into())?;
    if let Some(tk) = files.get("tokenizer.json") {
        std::fs::write(out.join("tokenizer.json"), tk).ctx(|| "writing tokenizer.json".into())?;
    }
    Ok(())
}

/// Imports HF directory `dir` (`config.json`, `model.safetensors`, optional `tokenizer.json`)
/// as checkpoint `out`, training with `preset`'s optimizer settings and `overrides` if resumed.
/// The sequence length defaults to `min(max_position_embeddings, preset seq_len)`.
pub fn from_hf(dir: &Path, out: &Path, preset: &str, overrides: &[String]) -> Result<()> {
    let mc = model::ModelConfig::from_json_file(&dir.join("config.json"))
        .map_err(|e| TrainError::Model(e.to_string()))?;
    let mut cfg = RunConfig::preset(preset)?;
    let seq = cfg.model.seq_len.min(mc.max_position_embeddings);
    cfg.model = from_model_config(&mc, seq)?;
    cfg.train.init_std = mc.initializer_range as f64;
    let tk = dir.join("tokenizer.json");
    if tk.is_file() {
        cfg.data.tokenizer = tk.to_string_lossy().into_owned();
    } else if mc.vocab_size < 256 {
        return Err(TrainError::Config(format!(
            "{} has no tokenizer.json and vocab size {} < 256 cannot hold the byte tokenizer",
            dir.display(),
            mc.vocab_size
        )));
    }
    let cfg = RunConfig::resolve(preset, Some(&cfg.to_toml()), overrides)?;
    let m = model::Model::new(model_config(&cfg)).map_err(|e| TrainError::Model(e.to_string()))?;
    let params = model::io::load_params(&m.layout, &dir.join("model.safetensors"))
        .map_err(|e| TrainError::Model(e.to_string()))?;
    let mut t = Trainer::new(cfg)?;
    if t.num_params() != params.len() {
        return Err(TrainError::Model("parameter count mismatch".into()));
    }
    t.weights = crate::precision::Weights::new(params, t.cfg.train.precision);
    // The tokenizer path in the config points into `dir`; the checkpoint carries its own copy.
    t.cfg.data.tokenizer = if t.tokenizer_json.is_some() {
        "checkpoint".into()
    } else {
        "byte".into()
    };
    t.save_checkpoint(out, SaveOptions::default())
}
