//! Hugging Face interop: export any checkpoint (saved at any layout) as `config.json` +
//! `model.safetensors` that transformers' `LlamaForCausalLM` / `MixtralForCausalLM` load
//! directly, and import such a directory as a checkpoint (step 0, zero optimizer state) that
//! `xtrain train --resume` continues at any layout and `xtrain generate` samples from. Tensor
//! names and layouts are the model crate's, which are Hugging Face's.
use std::path::Path;

use comm::Communicator;
use parallel::checkpoint::{self, MeshRecord, SaveMeta, SavedPiece, TrainingState};
use parallel::placement::TensorSlice;
use parallel::precision::LossScaler;
use parallel::ParallelDims;

use crate::config::RunConfig;
use crate::error::{IoContext, Result, TrainError};
use crate::trainer::{from_model_config, hf_config_json, load_model, model_config};

/// Writes `out/config.json` and `out/model.safetensors` (fp32), and the tokenizer when the
/// checkpoint has one, from checkpoint `ckpt` (or the run directory naming it).
pub fn to_hf(ckpt: &Path, out: &Path) -> Result<()> {
    let (cfg, model, params, _) = load_model(ckpt)?;
    let ck = checkpoint::Checkpoint::open(ckpt)?;
    let mut meta = std::collections::HashMap::new();
    meta.insert("format".to_string(), "pt".to_string());
    let weights = model::io::params_to_safetensors(&model.layout, &params, false, Some(meta))
        .map_err(|e| TrainError::Model(e.to_string()))?;
    std::fs::create_dir_all(out).ctx(|| format!("creating {}", out.display()))?;
    std::fs::write(out.join("config.json"), hf_config_json(&model_config(&cfg)))
        .ctx(|| "writing config.json".into())?;
    std::fs::write(out.join("model.safetensors"), weights)
        .ctx(|| "writing model.safetensors".into())?;
    if let Some(tk) = ck.file("tokenizer.json")? {
        std::fs::write(out.join("tokenizer.json"), tk).ctx(|| "writing tokenizer.json".into())?;
    }
    Ok(())
}

/// Imports HF directory `dir` (`config.json`, `model.safetensors`, optional `tokenizer.json`)
/// as checkpoint `out`, training with `preset`'s optimizer settings and `overrides` when
/// resumed. The sequence length defaults to `min(max_position_embeddings, preset seq_len)`.
pub fn from_hf(dir: &Path, out: &Path, preset: &str, overrides: &[String]) -> Result<()> {
    let mc = model::ModelConfig::from_json_file(&dir.join("config.json"))
        .map_err(|e| TrainError::Model(e.to_string()))?;
    let mut cfg = RunConfig::preset(preset)?;
    let seq = cfg.model.seq_len.min(mc.max_position_embeddings);
    cfg.model = from_model_config(&mc, seq)?;
    cfg.train.init_std = mc.initializer_range as f64;
    let tk_path = dir.join("tokenizer.json");
    let tokenizer = if tk_path.is_file() {
        cfg.data.tokenizer = tk_path.to_string_lossy().into_owned();
        Some(std::fs::read(&tk_path).ctx(|| format!("reading {}", tk_path.display()))?)
    } else if mc.vocab_size < 256 {
        return Err(TrainError::Config(format!(
            "{} has no tokenizer.json and vocab size {} < 256 cannot hold the byte tokenizer",
            dir.display(),
            mc.vocab_size
        )));
    } else {
        None
    };
    let mut cfg = RunConfig::resolve(preset, Some(&cfg.to_toml()), overrides)?;
    let m = model::Model::new(model_config(&cfg)).map_err(|e| TrainError::Model(e.to_string()))?;
    let params = model::io::load_params(&m.layout, &dir.join("model.safetensors"))
        .map_err(|e| TrainError::Model(e.to_string()))?;
    // The checkpoint carries its own copy of the tokenizer (resumes read that one).
    if tokenizer.is_some() {
        cfg.data.tokenizer = "checkpoint".into();
    }
    // One rank holding every tensor whole, with zero moments.
    let pieces: Vec<SavedPiece> = m
        .layout
        .entries
        .iter()
        .map(|e| {
            let n = e.view.numel();
            SavedPiece {
                slice: TensorSlice::whole(&e.name, &e.view.shape),
                start: 0,
                param: e.view.of(&params).to_vec(),
                exp_avg: vec![0.0; n],
                exp_avg_sq: vec![0.0; n],
                grad_comm_error: None,
                pending_grad: None,
            }
        })
        .collect();
    let mut files = vec![
        ("config.toml".to_string(), cfg.to_toml().into_bytes()),
        (
            "config.json".to_string(),
            hf_config_json(&m.cfg).into_bytes(),
        ),
    ];
    if let Some(tk) = tokenizer {
        files.push(("tokenizer.json".to_string(), tk));
    }
    let meta = SaveMeta {
        mesh: MeshRecord::from(&ParallelDims::default()),
        precision: cfg.train.precision,
        state: TrainingState {
            step: 0,
            tokens_seen: 0,
            data_seed: cfg.train.seed,
            adam_step: 0,
            loss_scaler: LossScaler::new(cfg.train.precision, cfg.train.loss_scale),
            router_bias: Vec::new(),
            grad_comm_error: false,
            pending_update: None,
        },
        files,
    };
    let world = Communicator::single_process()?;
    checkpoint::save(out, world.world(), &pieces, &meta)
        .map_err(|e| TrainError::Parallel(e.to_string()))
}
