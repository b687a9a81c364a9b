//! The single-process training loop: one optimizer step = `grad_accum` micro-batches of
//! forward/backward into the working gradients, then the [`StepEngine`] (sync + clip + AdamW).
//! Also validation, checkpoint save/restore, and the accounting behind the progress line.
//!
//! Determinism: initialisation depends only on `train.seed`, the data of step `s` only on
//! `(train.seed, s)`, and every reduction runs in a fixed order, so a run resumed from a
//! checkpoint reproduces the uninterrupted run's losses bit for bit.
use crate::checkpoint::{self, SaveOptions};
use crate::config::{Precision, RunConfig};
use crate::data::{Dataset, Sampler, Tokenizer};
use crate::error::{Result, TrainError};
use crate::memory::MemoryAccount;
use crate::optim::{LocalAdamW, StepEngine, StepStats};
use crate::precision::{LossScaler, Weights};
use crate::schedule::CosineSchedule;
use model::{AdamW, Model, StepOptions};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};
use std::path::Path;

/// The model configuration (Hugging Face names) of a run.
pub fn model_config(cfg: &RunConfig) -> model::ModelConfig {
    let m = &cfg.model;
    let mut mc = model::ModelConfig::llama(
        m.vocab_size,
        m.hidden_size,
        m.intermediate_size,
        m.num_layers,
        m.num_heads,
        m.num_kv_heads,
    );
    mc.rope_theta = m.rope_theta as f32;
    mc.rms_norm_eps = m.norm_eps as f32;
    mc.initializer_range = cfg.train.init_std as f32;
    mc.max_position_embeddings = m.seq_len;
    if m.arch == "mixtral" {
        mc = mc.with_experts(m.num_experts, m.experts_per_token);
    }
    mc
}

/// The run-config model section for a Hugging Face config (import), or why it cannot be one.
pub fn from_model_config(
    mc: &model::ModelConfig,
    seq_len: usize,
) -> Result<crate::config::ModelConfig> {
    let unsupported = |what: &str| {
        Err(TrainError::Unsupported(format!(
            "importing a model with {what}"
        )))
    };
    if mc.tie_word_embeddings {
        return unsupported("tied word embeddings");
    }
    if mc
        .head_dim
        .is_some_and(|d| d * mc.num_attention_heads != mc.hidden_size)
    {
        return unsupported("head_dim != hidden_size / num_attention_heads");
    }
    if mc.shared_expert_intermediate_size.is_some()
        || mc.capacity_factor.is_some()
        || mc
            .moe_intermediate_size
            .is_some_and(|f| f != mc.intermediate_size)
    {
        return unsupported("shared experts, capacity factors or a separate expert width");
    }
    Ok(crate::config::ModelConfig {
        arch: if mc.is_moe() { "mixtral" } else { "llama" }.into(),
        vocab_size: mc.vocab_size,
        hidden_size: mc.hidden_size,
        intermediate_size: mc.intermediate_size,
        num_layers: mc.num_hidden_layers,
        num_heads: mc.num_attention_heads,
        num_kv_heads: mc.kv_heads(),
        seq_len,
        rope_theta: f32_decimal(mc.rope_theta),
        norm_eps: f32_decimal(mc.rms_norm_eps),
        num_experts: mc.num_local_experts,
        experts_per_token: if mc.is_moe() {
            mc.num_experts_per_tok
        } else {
            0
        },
    })
}

/// The f64 with the same shortest decimal form as an f32 (`1e-5f32` → `1e-5`, not
/// `9.99999974e-6`), so configs survive an f32 round trip unchanged.
fn f32_decimal(x: f32) -> f64 {
    x.to_string().parse().expect("an f32 prints as a float")
}

/// Training FLOPs per token: `6N + 12·L·H·S` (Kaplan et al. 2020 / PaLM appendix B), with N =
/// every parameter including the embedding table (the convention of the PyTorch reference
/// figures in docs/PERFORMANCE.md), L layers, H hidden size, S sequence length. The second
/// term is attention's QKᵀ and AV products, forward and backward.
pub fn flops_per_token(cfg: &RunConfig, num_params: usize) -> f64 {
    let m = &cfg.model;
    6.0 * num_params as f64 + 12.0 * (m.num_layers * m.hidden_size * m.seq_len) as f64
}

/// Activation bytes kept for backward by one micro-batch, estimated from what a Llama block
/// caches (fp32 in the model's kernels): per token and layer the block input, two normalised
/// inputs, q/k/v, attention output, residual, the three SwiGLU tensors and the per-row
/// statistics; plus the head's input and normalised input and the embedding output.
pub fn activation_bytes(cfg: &RunConfig) -> u64 {
    let m = &cfg.model;
    let kv = m.hidden_size / m.num_heads * m.num_kv_heads;
    let ffn = if m.arch == "mixtral" {
        m.intermediate_size * m.experts_per_token
    } else {
        m.intermediate_size
    };
    let per_token_layer = 6 * m.hidden_size + 2 * kv + 3 * ffn + m.num_heads + 2;
    let per_token = m.num_layers * per_token_layer + 3 * m.hidden_size + 1;
    (per_token * m.seq_len * cfg.train.micro_batch * 4) as u64
}

/// The trainer's resumable state beyond tensors (saved as `state.json`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TrainState {
    /// Optimizer steps completed; also the data position (the sampler is a function of it).
    pub step: usize,
    pub tokens_seen: u64,
    pub adam_step: u64,
    pub scaler: LossScaler,
    pub data_seed: u64,
    pub precision: Precision,
}

/// What one optimizer step reports.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepReport {
    pub step: usize,
    pub loss: f64,
    pub lr: f64,
    pub stats: StepStats,
    pub tokens: usize,
}

/// A model, its weights and optimizer, its data, and where it is in the run.
pub struct Trainer {
    pub cfg: RunConfig,
    pub model: Model,
    pub weights: Weights,
    pub engine: Box<dyn StepEngine + Send>,
    pub scaler: LossScaler,
    pub data: Dataset,
    pub sampler: Sampler,
    pub schedule: CosineSchedule,
    pub tokenizer: Tokenizer,
    /// The raw `tokenizer.json`, kept so checkpoints carry their tokenizer.
    pub tokenizer_json: Option<Vec<u8>>,
    pub step: usize,
    pub tokens_seen: u64,
}

fn merr(e: model::ModelError) -> TrainError {
    TrainError::Model(e.to_string())
}

fn load_tokenizer(spec: &str) -> Result<(Tokenizer, Option<Vec<u8>>)> {
    let tk = Tokenizer::from_spec(spec)?;
    let json = match tk {
        Tokenizer::Byte => None,
        Tokenizer::Hf(_) => {
            Some(std::fs::read(spec).map_err(|e| TrainError::Tokenizer(format!("{spec}: {e}")))?)
        }
    };
    Ok((tk, json))
}

impl Trainer {
    /// A fresh run: weights initialised from `train.seed`.
    pub fn new(cfg: RunConfig) -> Result<Self> {
        cfg.validate()?;
        let model = Model::new(model_config(&cfg)).map_err(merr)?;
        let master = model.init_params(cfg.train.seed);
        let (tk, json) = load_tokenizer(&cfg.data.tokenizer)?;
        Self::assemble(cfg, model, master, tk, json)
    }

    fn assemble(
        cfg: RunConfig,
        model: Model,
        master: Vec<f32>,
        tokenizer: Tokenizer,
        tokenizer_json: Option<Vec<u8>>,
    ) -> Result<Self> {
        cfg.require_single_process()?;
        Self::build(cfg, model, master, tokenizer, tokenizer_json)
    }

    /// A fresh run on data-parallel rank `rank` of `cfg.parallel.dp`, with the engine that
    /// `make_engine(hyper, clip, num_params)` builds (DDP / ZeRO plug in here). The sampler
    /// reads this rank's share of every global batch; gradients handed to the engine are this
    /// rank's mean over its micro-batches, and the engine averages them over ranks.
    pub fn new_with_engine(
        cfg: RunConfig,
        rank: usize,
        make_engine: impl FnOnce(AdamW, f64, usize) -> Box<dyn StepEngine + Send>,
    ) -> Result<Self> {
        cfg.validate()?;
        if rank >= cfg.parallel.dp {
            return Err(TrainError::Config(format!(
                "rank {rank} outside dp {}",
                cfg.parallel.dp
            )));
        }
        let model = Model::new(model_config(&cfg)).map_err(merr)?;
        let master = model.init_params(cfg.train.seed);
        let (tk, json) = load_tokenizer(&cfg.data.tokenizer)?;
        let mut t = Self::build(cfg, model, master, tk, json)?;
        t.engine = make_engine(t.hyper(), t.cfg.train.grad_clip, t.num_params());
        t.sampler.dp = t.cfg.parallel.dp;
        t.sampler.rank = rank;
        Ok(t)
    }

    /// The AdamW hyper-parameters of the config.
    pub fn hyper(&self) -> AdamW {
        let t = &self.cfg.train;
        AdamW {
            lr: t.lr as f32,
            beta1: t.beta1 as f32,
            beta2: t.beta2 as f32,
            eps: t.eps as f32,
            weight_decay: t.weight_decay as f32,
        }
    }

    fn build(
        cfg: RunConfig,
        model: Model,
        master: Vec<f32>,
        tokenizer: Tokenizer,
        tokenizer_json: Option<Vec<u8>>,
    ) -> Result<Self> {
        if cfg.train.threads > 0 {
            tensor::threads::set_thread_budget(cfg.train.threads)
                .map_err(|e| TrainError::Config(e.to_string()))?;
        }
        if tokenizer.vocab_size() > cfg.model.vocab_size {
            return Err(TrainError::Config(format!(
                "tokenizer has {} tokens but model.vocab_size is {}",
                tokenizer.vocab_size(),
                cfg.model.vocab_size
            )));
        }
        let data = Dataset::load(
            &cfg.data,
            &tokenizer,
            cfg.model.vocab_size,
            cfg.model.seq_len,
        )?;
        let t = &cfg.train;
        let hyper = AdamW {
            lr: t.lr as f32,
            beta1: t.beta1 as f32,
            beta2: t.beta2 as f32,
            eps: t.eps as f32,
            weight_decay: t.weight_decay as f32,
        };
        let engine = Box::new(LocalAdamW::new(hyper, t.grad_clip, master.len()));
        let sampler = Sampler {
            seed: t.seed,
            seq_len: cfg.model.seq_len,
            micro_batch: t.micro_batch,
            grad_accum: t.grad_accum,
            dp: 1,
            rank: 0,
        };
        let schedule = CosineSchedule {
            peak: t.lr,
            min: t.min_lr,
            warmup: t.warmup_steps,
            total: t.steps,
        };
        Ok(Self {
            weights: Weights::new(master, t.precision),
            scaler: LossScaler::new(t.precision, t.loss_scale),
            engine,
            data,
            sampler,
            schedule,
            tokenizer,
            tokenizer_json,
            step: 0,
            tokens_seen: 0,
            model,
            cfg,
        })
    }

    pub fn num_params(&self) -> usize {
        self.weights.len()
    }

    /// Bytes held by the training state and one micro-batch's activations.
    pub fn memory(&self) -> MemoryAccount {
        let mut m = MemoryAccount::for_state(self.num_params() as u64, self.cfg.train.precision);
        m.activations = activation_bytes(&self.cfg);
        m
    }

    pub fn flops_per_token(&self) -> f64 {
        flops_per_token(&self.cfg, self.num_params())
    }

    fn model_batch(b: crate::data::Batch) -> Result<model::Batch> {
        let targets = b.targets.iter().map(|&t| t as i64).collect();
        model::Batch::new(b.batch, b.seq, b.inputs, targets).map_err(merr)
    }

    /// One optimizer step over `grad_accum` micro-batches.
    pub fn train_step(&mut self) -> Result<StepReport> {
        let accum = self.cfg.train.grad_accum;
        let opts = StepOptions {
            loss_scale: (self.scaler.scale / accum as f64) as f32,
            ..StepOptions::default()
        };
        let mut loss_sum = 0.0f64;
        let mut tokens = 0;
        for a in 0..accum {
            let batch = Self::model_batch(self.sampler.train_batch(
                &self.data.train,
                self.step as u64,
                a,
            ))?;
            tokens += batch.tokens();
            // The whole pass on one pool worker: its kernels then run inline there instead of
            // each being handed from this thread to the pool (see `threads::install`).
            let (weights, model) = (&mut self.weights, &self.model);
            let r = tensor::threads::install(|| weights.forward_backward(model, &batch, &opts))?;
            loss_sum += r.loss as f64;
        }
        let loss = self.engine.mean_over_ranks(loss_sum / accum as f64)?;
        if !loss.is_finite() && !self.scaler.dynamic {
            return Err(TrainError::Diverged(format!(
                "loss is {loss} at step {}",
                self.step
            )));
        }
        let lr = self.schedule.lr(self.step);
        let stats = self.engine.step(&mut self.weights, &mut self.scaler, lr)?;
        self.step += 1;
        self.tokens_seen += tokens as u64;
        Ok(StepReport {
            step: self.step,
            loss,
            lr,
            stats,
            tokens,
        })
    }

    /// Mean validation loss over `eval_batches` fixed micro-batches of the held-out split.
    pub fn evaluate(&mut self) -> Result<Option<f64>> {
        if self.data.val.is_empty() || self.cfg.train.eval_batches == 0 {
            return Ok(None);
        }
        let mut sum = 0.0;
        for i in 0..self.cfg.train.eval_batches {
            let batch = Self::model_batch(self.sampler.val_batch(&self.data.val, i))?;
            let (weights, model) = (&mut self.weights, &self.model);
            sum += tensor::threads::install(|| weights.forward_loss(model, &batch))?.ce as f64;
        }
        Ok(Some(self.engine.mean_over_ranks(
            sum / self.cfg.train.eval_batches as f64,
        )?))
    }

    pub fn state(&self) -> TrainState {
        TrainState {
            step: self.step,
            tokens_seen: self.tokens_seen,
            adam_step: self.engine.state().step,
            scaler: self.scaler,
            data_seed: self.sampler.seed,
            precision: self.cfg.train.precision,
        }
    }

    /// Writes checkpoint `dir`: `model.safetensors` (fp32 master weights, HF names),
    /// `optimizer.safetensors` (AdamW m and v), `state.json`, `config.toml`, HF `config.json`,
    /// and the tokenizer when it is not the byte tokenizer.
    pub fn save_checkpoint(&self, dir: &Path, opts: SaveOptions) -> Result<()> {
        let mut meta = HashMap::new();
        meta.insert("format".to_string(), "pt".to_string());
        let weights = model::io::params_to_safetensors(
            &self.model.layout,
            self.weights.master(),
            false,
            Some(meta),
        )
        .map_err(merr)?;
        let st = self.engine.state();
        let mut files = vec![
            ("model.safetensors".to_string(), weights),
            (
                "optimizer.safetensors".to_string(),
                flat_safetensors(&[("adamw.m", &st.m), ("adamw.v", &st.v)])?,
            ),
            (
                "state.json".to_string(),
                serde_json::to_vec_pretty(&self.state()).expect("state serialises"),
            ),
            ("config.toml".to_string(), self.cfg.to_toml().into_bytes()),
            (
                "config.json".to_string(),
                hf_config_json(&self.model.cfg).into_bytes(),
            ),
        ];
        if let Some(json) = &self.tokenizer_json {
            files.push(("tokenizer.json".to_string(), json.clone()));
        }
        checkpoint::save(dir, &files, opts)
    }

    /// Restores a run from checkpoint `dir`, applying `overrides` (`key=value`) to its config.
    /// Only keys that do not change tensor shapes or the data stream make sense to override
    /// (e.g. `train.steps`); shape changes are refused by the tensor loaders.
    pub fn from_checkpoint(dir: &Path, overrides: &[String]) -> Result<Self> {
        let files = checkpoint::load(dir)?;
        let bad = |msg: String| TrainError::Checkpoint {
            path: dir.to_path_buf(),
            msg,
        };
        let get = |name: &str| {
            files
                .get(name)
                .ok_or_else(|| bad(format!("missing {name}")))
        };
        let toml_text = std::str::from_utf8(get("config.toml")?)
            .map_err(|_| bad("config.toml is not UTF-8".into()))?;
        let cfg = RunConfig::resolve("tiny", Some(toml_text), overrides)?;
        let state: TrainState = serde_json::from_slice(get("state.json")?)
            .map_err(|e| bad(format!("state.json: {e}")))?;
        if state.precision != cfg.train.precision {
            return Err(bad(format!(
                "checkpoint precision {:?} differs from the config's {:?}",
                state.precision, cfg.train.precision
            )));
        }
        let model = Model::new(model_config(&cfg)).map_err(merr)?;
        let wf = model::io::WeightsFile::from_bytes(get("model.safetensors")?.clone())
            .map_err(|e| bad(format!("model.safetensors: {e}")))?;
        let mut master = vec![0.0f32; model.num_params()];
        wf.load_into(&model.layout, "", &mut master)
            .map_err(|e| bad(format!("model.safetensors: {e}")))?;
        let (tokenizer, json) = match files.get("tokenizer.json") {
            Some(bytes) => (
                Tokenizer::Hf(Box::new(
                    tokenizers::Tokenizer::from_bytes(bytes)
                        .map_err(|e| TrainError::Tokenizer(e.to_string()))?,
                )),
                Some(bytes.clone()),
            ),
            None => (Tokenizer::Byte, None),
        };
        let mut t = Self::assemble(cfg, model, master, tokenizer, json)?;
        let n = t.num_params();
        let opt = read_flat(get("optimizer.safetensors")?, &["adamw.m", "adamw.v"], n)
            .map_err(|e| bad(format!("optimizer.safetensors: {e}")))?;
        let st = t.engine.state_mut();
        st.m.copy_from_slice(&opt[0]);
        st.v.copy_from_slice(&opt[1]);
        st.step = state.adam_step;
        t.step = state.step;
        t.tokens_seen = state.tokens_seen;
        t.scaler = state.scaler;
        t.sampler.seed = state.data_seed;
        Ok(t)
    }
}

/// HF `config.json` text: the model config plus `architectures` / `model_type`, which
/// transformers' `AutoModelForCausalLM` dispatches on.
pub fn hf_config_json(mc: &model::ModelConfig) -> String {
    let mut v: serde_json::Value =
        serde_json::from_str(&mc.to_json_string()).expect("config is JSON");
    let (arch, ty) = if mc.is_moe() {
        ("MixtralForCausalLM", "mixtral")
    } else {
        ("LlamaForCausalLM", "llama")
    };
    let obj = v.as_object_mut().expect("config is an object");
    obj.insert("architectures".into(), serde_json::json!([arch]));
    obj.insert("model_type".into(), serde_json::json!(ty));
    obj.insert("torch_dtype".into(), serde_json::json!("float32"));
    obj.retain(|_, x| !x.is_null());
    serde_json::to_string_pretty(&v).expect("serialises")
}

/// Serialises named flat f32 vectors as 1-D safetensors.
pub fn flat_safetensors(tensors: &[(&str, &[f32])]) -> Result<Vec<u8>> {
    let bytes: Vec<(String, Vec<u8>, usize)> = tensors
        .iter()
        .map(|(n, v)| {
            (
                n.to_string(),
                bytemuck::cast_slice::<f32, u8>(v).to_vec(),
                v.len(),
            )
        })
        .collect();
    let views = bytes
        .iter()
        .map(|(n, b, len)| {
            safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![*len], b)
                .map(|v| (n.clone(), v))
                .map_err(|e| TrainError::Model(e.to_string()))
        })
        .collect::<Result<Vec<_>>>()?;
    safetensors::serialize(views, &None).map_err(|e| TrainError::Model(e.to_string()))
}

/// Reads named 1-D f32 tensors of length `n` from safetensors bytes.
pub fn read_flat(
    bytes: &[u8],
    names: &[&str],
    n: usize,
) -> std::result::Result<Vec<Vec<f32>>, String> {
    let st = safetensors::SafeTensors::deserialize(bytes).map_err(|e| e.to_string())?;
    names
        .iter()
        .map(|name| {
            let t = st
                .tensor(name)
                .map_err(|_| format!("missing tensor {name}"))?;
            if t.dtype() != safetensors::Dtype::F32 || t.shape() != [n] {
                return Err(format!(
                    "{name}: expected f32 [{n}], found {:?} {:?}",
                    t.dtype(),
                    t.shape()
                ));
            }
            Ok(t.data()
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect())
        })
        .collect()
}

/// Checkpoint file names and sizes, for `xtrain` messages.
pub fn describe_checkpoint(files: &BTreeMap<String, Vec<u8>>) -> String {
    files
        .iter()
        .map(|(k, v)| format!("{k} ({})", crate::memory::human(v.len() as u64)))
        .collect::<Vec<_>>()
        .join(", ")
}
