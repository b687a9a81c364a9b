//! Run configuration: the TOML schema, the three presets, and `--set key=value` overrides.
//!
//! Resolution order: preset (or defaults) → TOML file → `--set` overrides. Every layer is merged
//! into the previous one key by key, and a key the schema does not have is an error naming it
//! (`config: unknown key `train.lrr``) rather than being silently ignored.
use crate::error::{IoContext, Result, TrainError};
use serde::{Deserialize, Serialize};
use std::path::Path;

pub use parallel::Precision;

/// Model shape. Names follow Hugging Face's LlamaConfig where one exists.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    /// `llama` (dense SwiGLU MLP) or `mixtral` (top-k routed experts).
    pub arch: String,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    /// Training context length (tokens per sample).
    pub seq_len: usize,
    pub rope_theta: f64,
    /// RoPE frequency scaling as Hugging Face's `rope_scaling` table (only `rope_type =
    /// "llama3"`, with `factor`, `low_freq_factor`, `high_freq_factor`,
    /// `original_max_position_embeddings`); absent: none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_scaling: Option<model::config::RopeScaling>,
    /// The LM head reads the token embedding (one parameter), as Hugging Face's
    /// `tie_word_embeddings` (Llama 3.2 1B/3B, SmolLM).
    #[serde(default)]
    pub tie_word_embeddings: bool,
    pub norm_eps: f64,
    /// Number of experts (mixtral only).
    pub num_experts: usize,
    /// Experts per token (mixtral only).
    pub experts_per_token: usize,
    /// Width of a shared expert every token also goes through (mixtral only; 0: none).
    #[serde(default)]
    pub shared_expert_size: usize,
    /// Weight of the load-balancing auxiliary loss, summed over layers (mixtral only).
    #[serde(default)]
    pub aux_loss_coef: f64,
    /// Expert capacity factor: each expert takes at most ⌈c·tokens·k/E⌉ assignments of a
    /// micro-batch (mixtral only; 0: dropless).
    #[serde(default)]
    pub capacity_factor: f64,
    /// Which assignments an expert over capacity keeps: `position` (the first in token order)
    /// or `probability` (the most probable).
    #[serde(default = "default_capacity_drop")]
    pub capacity_drop: String,
    /// Auxiliary-loss-free balancing (DeepSeek-V3): the rate γ at which each expert's
    /// routing bias moves towards balance after every step (mixtral only; 0: off).
    #[serde(default)]
    pub bias_balance_rate: f64,
}

fn default_capacity_drop() -> String {
    "position".into()
}

/// Optimisation and loop settings.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrainConfig {
    /// Sequences per micro-batch per data-parallel rank.
    pub micro_batch: usize,
    /// Micro-batches accumulated per optimizer step.
    pub grad_accum: usize,
    /// Optimizer steps in the run.
    pub steps: usize,
    /// Peak learning rate, reached after `warmup_steps`.
    pub lr: f64,
    /// Final learning rate of the cosine decay.
    pub min_lr: f64,
    pub warmup_steps: usize,
    pub weight_decay: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    /// Global gradient-norm clip (0 disables).
    pub grad_clip: f64,
    pub precision: Precision,
    /// Activation recomputation of every block: `none`, `selective` (drop the norm outputs
    /// and the SwiGLU product, rebuilt in backward) or `full` (keep only each block's input).
    #[serde(default = "default_recompute")]
    pub recompute: String,
    /// Validation every N steps (0 disables); also run at the end.
    pub eval_every: usize,
    /// Micro-batches per validation.
    pub eval_batches: usize,
    /// Checkpoint every N steps (0: only at the end).
    pub ckpt_every: usize,
    /// Initial fp16 loss scale (fp16 only).
    pub loss_scale: f64,
    /// Std of the normal initialisation of linear and embedding weights.
    pub init_std: f64,
    pub seed: u64,
    /// Rayon threads (0: library default).
    pub threads: usize,
    /// Tokens sampled from the model at the end of a run (0 disables).
    pub sample_tokens: usize,
    /// Prompt for that sample.
    pub sample_prompt: String,
    /// Where the model trains: `cpu`, `cuda` or `cuda:N` (`--device`); empty: `XTRAIN_DEVICE`,
    /// else the CPU.
    #[serde(default)]
    pub device: String,
    /// The wire format of the data-parallel gradient reductions: `fp32` (exact), `bf16` or
    /// `fp8` (half and a quarter of the bytes, summed in fp32 where they arrive).
    #[serde(default = "default_grad_comm")]
    pub grad_comm: String,
    /// Write TensorBoard event files into the run directory (rank 0).
    #[serde(default = "default_true")]
    pub tensorboard: bool,
}

impl TrainConfig {
    /// The device spec in effect: `train.device`, else `XTRAIN_DEVICE`, else `cpu`.
    pub fn device_spec(&self) -> String {
        if !self.device.trim().is_empty() {
            return self.device.trim().to_string();
        }
        match std::env::var(tensor::buf::DEVICE_ENV) {
            Ok(v) if !v.trim().is_empty() => v.trim().to_string(),
            _ => "cpu".into(),
        }
    }

    /// Whether the run is on a GPU (`cuda` or `cuda:N`).
    pub fn on_gpu(&self) -> bool {
        self.device_spec().to_ascii_lowercase().starts_with("cuda")
    }
}

/// Where tokens come from.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DataConfig {
    /// Empty: the built-in procedural corpus. Otherwise a shard folder (written by
    /// `xtrain tokenize … -o FOLDER`), a `.tok` token file or a text file.
    pub path: String,
    /// A mixture instead of `path`: sources (any form `path` takes) sampled with these weights
    /// (normalised to sum to 1).
    #[serde(default)]
    pub mix: Vec<MixSource>,
    /// `byte` or the path of a Hugging Face `tokenizer.json`.
    pub tokenizer: String,
    /// Fraction held out for validation: of each shard's documents (its last ones) for a shard
    /// folder, else of the tokens (the tail of the stream).
    pub val_fraction: f64,
    /// Size of the built-in corpus in bytes.
    pub corpus_bytes: usize,
    /// Seed of the built-in corpus (independent of the training seed).
    pub corpus_seed: u64,
    /// Block-causal attention: a token attends only to the tokens of its own document inside
    /// its (packed) window. The boundaries come from shard folders' document indexes, so every
    /// source must be a shard folder. On the CPU and on GPUs (the attention kernels of both
    /// take the mask).
    #[serde(default)]
    pub document_mask: bool,
    /// With `document_mask`: RoPE positions restart at 0 at every document's first token, so
    /// each document is computed exactly as if it were alone in its sequence.
    #[serde(default)]
    pub document_positions: bool,
}

/// One source of `data.mix`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MixSource {
    pub path: String,
    pub weight: f64,
}

/// Process layout: the degrees of the mesh `[pp, dp, cp, tp]` (`nproc = pp·dp·cp·tp`), the
/// ZeRO stage and the gradient bucket size.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ParallelConfig {
    pub nproc: usize,
    pub dp: usize,
    /// ZeRO stage (0 = plain data parallel).
    pub zero: usize,
    /// Tensor-parallel degree (the fastest-varying mesh dimension).
    #[serde(default = "one")]
    pub tp: usize,
    /// Sequence parallelism inside the tensor-parallel group.
    #[serde(default)]
    pub sp: bool,
    /// Pipeline-parallel degree (the slowest-varying mesh dimension).
    #[serde(default = "one")]
    pub pp: usize,
    /// Context-parallel degree.
    #[serde(default = "one")]
    pub cp: usize,
    /// How context parallelism splits each sequence: `zigzag` (default), `striped` or `none`.
    #[serde(default = "default_cp_balance")]
    pub cp_balance: String,
    /// How keys and values reach the other cp ranks: `ring` (default) or `allgather`.
    #[serde(default = "default_cp_comm")]
    pub cp_comm: String,
    /// Expert-parallel degree (carved out of dp × cp).
    #[serde(default = "one")]
    pub ep: usize,
    /// Pipeline stages per pipeline rank of the interleaved schedule; 0 (the default) takes the
    /// schedule's own default (2 for interleaved, as `xtrain schedule` does; 1 otherwise).
    #[serde(default)]
    pub virtual_stages: usize,
    /// The pipeline schedule (pp > 1): `gpipe`, `1f1b`, `interleaved`, `zb-h1`, `zb-h2`,
    /// `zb-v`, `dualpipev`, `dualpipe`, or `csv:FILE` (a schedule written by `xtrain schedule
    /// --csv`).
    /// Its micro-batches per step are `train.grad_accum`.
    #[serde(default = "default_schedule")]
    pub schedule: String,
    /// Gradient bucket size of data parallelism in MiB (PyTorch DDP's 25 by default).
    #[serde(default = "default_bucket_mb")]
    pub bucket_mb: f64,
    /// ZeRO-Offload: `none` (default) or `optimizer` — the fp32 master weights and AdamW
    /// moments in host memory, AdamW on the CPU (docs/GPU.md).
    #[serde(default = "default_offload")]
    pub offload: String,
    /// ZeRO-Offload's delayed update: past this many AdamW steps, each step's update runs on
    /// the host beside the next step's forward and backward, whose gradients are then taken
    /// at the weights one update behind (docs/GPU.md). Unset (the default), or `"none"` (to
    /// turn it off in a resumed run's config): every update before the next step.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "steps_or_none"
    )]
    pub delayed_update_after: Option<u64>,
}

impl ParallelConfig {
    /// Whether ZeRO-Offload moves the optimizer to the host (`offload = "optimizer"`).
    pub fn offload_optimizer(&self) -> Result<bool> {
        match self.offload.trim() {
            "none" | "" => Ok(false),
            "optimizer" => Ok(true),
            other => Err(TrainError::Config(format!(
                "parallel.offload = `{other}` (expected none or optimizer)"
            ))),
        }
    }

    /// The degrees as the mesh takes them (not yet checked against each other).
    pub fn dims(&self) -> Result<parallel::ParallelDims> {
        let zero = parallel::data_parallel::ZeroStage::from_index(self.zero).ok_or_else(|| {
            TrainError::Config(format!(
                "parallel.zero = {} (expected 0, 1, 2 or 3)",
                self.zero
            ))
        })?;
        Ok(parallel::ParallelDims {
            pp: self.pp,
            dp: self.dp,
            cp: self.cp,
            tp: self.tp,
            ep: self.ep,
            zero,
            sp: self.sp,
            virtual_stages: self.virtual_stages(),
        })
    }

    /// `virtual_stages`, with 0 resolved to the schedule's default (1 for a schedule read from
    /// a CSV file or one that does not parse, which is reported where the schedule is built).
    pub fn virtual_stages(&self) -> usize {
        if self.virtual_stages > 0 {
            return self.virtual_stages;
        }
        self.schedule
            .parse::<parallel::pipeline_parallel::ScheduleKind>()
            .map_or(1, |k| k.default_virtual_stages())
    }

    /// Completes a layout from the degrees a user gave: `nproc` alone sets dp to
    /// `nproc / (pp·cp·tp)`; degrees without `nproc` set it to their product. `given` names
    /// the fields set explicitly (`nproc`, `dp`); the others keep their values.
    pub fn complete(&mut self, nproc_given: bool, dp_given: bool) -> Result<()> {
        let others = self.pp * self.cp * self.tp;
        if nproc_given && !dp_given {
            if others == 0 || !self.nproc.is_multiple_of(others) {
                return Err(TrainError::Config(format!(
                    "nproc = {} is not a multiple of pp × cp × tp = {others}",
                    self.nproc
                )));
            }
            self.dp = self.nproc / others;
        } else if !nproc_given {
            self.nproc = self.dp * others;
        }
        Ok(())
    }
}

fn one() -> usize {
    1
}

/// A configuration error of the parallel layer, as this crate's (without a second prefix).
fn pconf(e: parallel::ParallelError) -> TrainError {
    match e {
        parallel::ParallelError::Config(m) | parallel::ParallelError::Layout(m) => {
            TrainError::Config(m)
        }
        other => TrainError::Config(other.to_string()),
    }
}

fn default_cp_balance() -> String {
    "zigzag".into()
}

fn default_cp_comm() -> String {
    "ring".into()
}

fn default_schedule() -> String {
    "1f1b".into()
}

fn default_bucket_mb() -> f64 {
    25.0
}

/// A number of steps, or the string `"none"` for no value.
fn steps_or_none<'de, D: serde::Deserializer<'de>>(
    d: D,
) -> std::result::Result<Option<u64>, D::Error> {
    struct Steps;
    impl serde::de::Visitor<'_> for Steps {
        type Value = Option<u64>;
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("a number of steps (0 or more) or \"none\"")
        }
        fn visit_u64<E: serde::de::Error>(self, n: u64) -> std::result::Result<Self::Value, E> {
            Ok(Some(n))
        }
        fn visit_i64<E: serde::de::Error>(self, n: i64) -> std::result::Result<Self::Value, E> {
            u64::try_from(n)
                .map(Some)
                .map_err(|_| E::invalid_value(serde::de::Unexpected::Signed(n), &self))
        }
        fn visit_str<E: serde::de::Error>(self, w: &str) -> std::result::Result<Self::Value, E> {
            match w {
                "none" => Ok(None),
                _ => Err(E::invalid_value(serde::de::Unexpected::Str(w), &self)),
            }
        }
    }
    d.deserialize_any(Steps)
}

fn default_offload() -> String {
    "none".into()
}

fn default_recompute() -> String {
    "none".into()
}

fn default_grad_comm() -> String {
    "fp32".into()
}

fn default_true() -> bool {
    true
}

/// The whole run.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RunConfig {
    pub model: ModelConfig,
    pub train: TrainConfig,
    pub data: DataConfig,
    pub parallel: ParallelConfig,
}

/// The named presets.
pub const PRESETS: [&str; 4] = ["tiny", "small", "medium", "moe-small"];

impl RunConfig {
    /// A preset by name: tiny, small, medium or moe-small (see the README's trainer tour).
    pub fn preset(name: &str) -> Result<Self> {
        // (vocab, hidden, ffn, layers, heads, kv heads, seq, batch, steps, lr)
        let (v, h, f, l, nh, kv, s, b, steps, lr) = match name {
            "tiny" => (256, 64, 176, 2, 4, 2, 64, 8, 1500, 3e-3),
            "small" => (256, 256, 688, 6, 8, 4, 256, 8, 2000, 1e-3),
            "medium" => (4096, 512, 1376, 8, 8, 4, 512, 4, 5000, 6e-4),
            // Mixtral-style: 8 experts of width 344, top-2 (about small's active FLOPs).
            "moe-small" => (256, 256, 344, 6, 8, 4, 256, 8, 2000, 1e-3),
            other => {
                return Err(TrainError::Config(format!(
                    "unknown preset `{other}` (expected one of {PRESETS:?})"
                )))
            }
        };
        let mut cfg = Self {
            model: ModelConfig {
                arch: "llama".into(),
                vocab_size: v,
                hidden_size: h,
                intermediate_size: f,
                num_layers: l,
                num_heads: nh,
                num_kv_heads: kv,
                seq_len: s,
                rope_theta: 10000.0,
                rope_scaling: None,
                tie_word_embeddings: false,
                norm_eps: 1e-5,
                num_experts: 0,
                experts_per_token: 0,
                shared_expert_size: 0,
                aux_loss_coef: 0.0,
                capacity_factor: 0.0,
                capacity_drop: default_capacity_drop(),
                bias_balance_rate: 0.0,
            },
            train: TrainConfig {
                micro_batch: b,
                grad_accum: 1,
                steps,
                lr,
                min_lr: lr / 10.0,
                warmup_steps: steps / 20,
                weight_decay: 0.1,
                beta1: 0.9,
                beta2: 0.95,
                eps: 1e-8,
                grad_clip: 1.0,
                precision: Precision::Fp32,
                recompute: default_recompute(),
                eval_every: (steps / 6).max(1),
                eval_batches: 4,
                ckpt_every: 0,
                loss_scale: 65536.0,
                init_std: 0.02,
                seed: 1234,
                threads: 0,
                sample_tokens: 200,
                sample_prompt: "the ".into(),
                device: String::new(),
                grad_comm: default_grad_comm(),
                tensorboard: true,
            },
            data: DataConfig {
                path: String::new(),
                mix: Vec::new(),
                tokenizer: "byte".into(),
                val_fraction: 0.05,
                corpus_bytes: 2_000_000,
                corpus_seed: 42,
                document_mask: false,
                document_positions: false,
            },
            parallel: ParallelConfig {
                nproc: 1,
                dp: 1,
                zero: 0,
                tp: 1,
                sp: false,
                pp: 1,
                cp: 1,
                cp_balance: default_cp_balance(),
                cp_comm: default_cp_comm(),
                ep: 1,
                virtual_stages: 0,
                schedule: default_schedule(),
                bucket_mb: default_bucket_mb(),
                offload: default_offload(),
                delayed_update_after: None,
            },
        };
        if name == "moe-small" {
            cfg.model.arch = "mixtral".into();
            cfg.model.num_experts = 8;
            cfg.model.experts_per_token = 2;
            cfg.model.aux_loss_coef = 0.01;
        }
        Ok(cfg)
    }

    /// Resolves preset → TOML text → overrides (`key.path=value`, value parsed as TOML,
    /// falling back to a bare string).
    pub fn resolve(preset: &str, toml_text: Option<&str>, overrides: &[String]) -> Result<Self> {
        let cfg = Self::merge_layers(preset, toml_text, overrides)?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// [`Self::resolve`] for a command line that gave layout flags: the layout is completed
    /// first ([`ParallelConfig::complete`]: `--nproc` alone sets dp; degrees alone set nproc),
    /// then validated. `nproc_given` / `dp_given`: whether the overrides set them.
    pub fn resolve_layout(
        preset: &str,
        toml_text: Option<&str>,
        overrides: &[String],
        nproc_given: bool,
        dp_given: bool,
    ) -> Result<Self> {
        let mut cfg = Self::merge_layers(preset, toml_text, overrides)?;
        cfg.parallel.complete(nproc_given, dp_given)?;
        cfg.validate()?;
        Ok(cfg)
    }

    fn merge_layers(preset: &str, toml_text: Option<&str>, overrides: &[String]) -> Result<Self> {
        let base = Self::preset(preset)?;
        let mut tree = toml::Value::try_from(&base)
            .map_err(|e| TrainError::Config(format!("serialising preset: {e}")))?;
        // Whether the user chose the precision (a file or an override); if not, a GPU run
        // trains in bf16 and a CPU run in fp32 (the presets' value).
        let mut precision_given = false;
        if let Some(text) = toml_text {
            let user: toml::Value = toml::from_str(text)
                .map_err(|e| TrainError::Config(format!("parsing TOML: {e}")))?;
            precision_given |= user.get("train").and_then(|t| t.get("precision")).is_some();
            merge(&mut tree, &user, "")?;
        }
        for item in overrides {
            let (key, raw) = item.split_once('=').ok_or_else(|| {
                TrainError::Config(format!("override `{item}` is not of the form key=value"))
            })?;
            precision_given |= key.trim() == "train.precision";
            set_path(&mut tree, key.trim(), parse_value(raw.trim()))?;
        }
        let mut cfg: RunConfig = tree
            .try_into()
            .map_err(|e: toml::de::Error| TrainError::Config(e.to_string()))?;
        if !precision_given && cfg.train.on_gpu() {
            cfg.train.precision = Precision::Bf16;
        }
        Ok(cfg)
    }

    /// Loads a TOML file on top of a preset.
    pub fn load(preset: &str, path: Option<&Path>, overrides: &[String]) -> Result<Self> {
        let text = match path {
            Some(p) => {
                Some(std::fs::read_to_string(p).ctx(|| format!("reading config {}", p.display()))?)
            }
            None => None,
        };
        Self::resolve(preset, text.as_deref(), overrides)
    }

    /// Checks the relations between fields that types cannot express.
    pub fn validate(&self) -> Result<()> {
        let m = &self.model;
        let t = &self.train;
        let bad = |msg: String| Err(TrainError::Config(msg));
        let grad_comm = parallel::data_parallel::grad_comm::GradComm::parse(
            &t.grad_comm,
            t.warmup_steps as u64,
        )
        .map_err(TrainError::Config)?;
        if matches!(
            grad_comm,
            parallel::data_parallel::grad_comm::GradComm::PowerSgd { .. }
        ) && self.parallel.zero >= 2
        {
            return bad(format!(
                "train.grad_comm = {}: PowerSGD compresses whole gradient buckets; ZeRO-{} reduces shards (use parallel.zero = 0 or 1, or grad_comm bf16 / fp8)",
                t.grad_comm, self.parallel.zero
            ));
        }
        if m.arch != "llama" && m.arch != "mixtral" {
            return bad(format!(
                "model.arch must be `llama` or `mixtral`, not `{}`",
                m.arch
            ));
        }
        for (name, v) in [
            ("model.vocab_size", m.vocab_size),
            ("model.hidden_size", m.hidden_size),
            ("model.intermediate_size", m.intermediate_size),
            ("model.num_layers", m.num_layers),
            ("model.num_heads", m.num_heads),
            ("model.num_kv_heads", m.num_kv_heads),
            ("model.seq_len", m.seq_len),
            ("train.micro_batch", t.micro_batch),
            ("train.grad_accum", t.grad_accum),
            ("parallel.nproc", self.parallel.nproc),
            ("parallel.dp", self.parallel.dp),
            ("parallel.tp", self.parallel.tp),
            ("parallel.pp", self.parallel.pp),
            ("parallel.cp", self.parallel.cp),
            ("parallel.ep", self.parallel.ep),
        ] {
            if v == 0 {
                return bad(format!("{name} must be > 0"));
            }
        }
        if !m.hidden_size.is_multiple_of(m.num_heads) {
            return bad(format!(
                "model.hidden_size {} is not divisible by model.num_heads {}",
                m.hidden_size, m.num_heads
            ));
        }
        if !m.num_heads.is_multiple_of(m.num_kv_heads) {
            return bad(format!(
                "model.num_heads {} is not a multiple of model.num_kv_heads {}",
                m.num_heads, m.num_kv_heads
            ));
        }
        if !(m.hidden_size / m.num_heads).is_multiple_of(2) {
            return bad("head dim must be even for RoPE".into());
        }
        if m.arch == "mixtral" && (m.num_experts == 0 || m.experts_per_token == 0) {
            return bad("mixtral needs model.num_experts and model.experts_per_token > 0".into());
        }
        if m.experts_per_token > m.num_experts {
            return bad("model.experts_per_token exceeds model.num_experts".into());
        }
        if !(t.lr.is_finite() && t.lr > 0.0) || t.min_lr < 0.0 || t.min_lr > t.lr {
            return bad(format!(
                "need 0 <= train.min_lr <= train.lr, lr > 0 (lr {}, min_lr {})",
                t.lr, t.min_lr
            ));
        }
        if !(0.0..1.0).contains(&t.beta1) || !(0.0..1.0).contains(&t.beta2) {
            return bad("train.beta1 and train.beta2 must lie in [0, 1)".into());
        }
        let bucket = self.parallel.bucket_mb;
        if !(bucket.is_finite() && bucket > 0.0 && bucket <= 1024.0 * 1024.0) {
            return bad(format!(
                "parallel.bucket_mb must be a positive size in MiB (got {bucket})"
            ));
        }
        let offload = self.parallel.offload_optimizer()?;
        if self.parallel.delayed_update_after.is_some() && !offload {
            return bad(
                "parallel.delayed_update_after needs parallel.offload = \"optimizer\" (the delayed update is ZeRO-Offload's: AdamW on the host beside the device's next step); without offload set it to \"none\""
                    .into(),
            );
        }
        if !(0.0..0.5).contains(&self.data.val_fraction) {
            return bad("data.val_fraction must lie in [0, 0.5)".into());
        }
        if !self.data.mix.is_empty() && !self.data.path.is_empty() {
            return bad("set data.path or data.mix, not both".into());
        }
        if let Some(m) = self
            .data
            .mix
            .iter()
            .find(|m| m.path.is_empty() || !(m.weight.is_finite() && m.weight > 0.0))
        {
            return bad(format!(
                "data.mix: each source needs a path and a positive weight (got path {:?}, weight {})",
                m.path, m.weight
            ));
        }
        if t.precision == Precision::Fp16 && (t.loss_scale.is_nan() || t.loss_scale < 1.0) {
            return bad("train.loss_scale must be >= 1".into());
        }
        self.recompute()?;
        self.check_device()?;
        self.check_documents()?;
        crate::trainer::model_config(self)
            .validate()
            .map_err(|e| TrainError::Config(format!("model: {e}")))?;
        let (cp_balance, _) = self.cp_options()?;
        let dims = self.parallel.dims()?;
        dims.validate(self.parallel.nproc).map_err(pconf)?;
        if dims.cp > 1 {
            let layout = parallel::context_parallel::CpLayout {
                cp: dims.cp,
                rank: 0,
                balance: cp_balance,
            };
            layout.check(m.seq_len).map_err(pconf)?;
        }
        if dims.pp > 1 {
            // The schedule is generated (or read) here too, so that a bad one is reported
            // before any worker starts.
            let s = crate::pipeline::compute_schedule(self, &dims)?;
            if s.has_replicas() && dims.zero.shards_grads() {
                return Err(TrainError::Unsupported(format!(
                    "the {} schedule keeps two copies of every layer, whose gradients are reduced once at the end of the step: use ZeRO-0 or 1 with it (parallel.zero = {})",
                    s.kind, self.parallel.zero
                )));
            }
            if s.stage_splits() > m.num_layers {
                return bad(format!(
                    "the {} schedule cuts the model into {} stages but model.num_layers = {}: every stage needs a layer",
                    s.kind,
                    s.stage_splits(),
                    m.num_layers
                ));
            }
        }
        // The degrees against the model (heads, KV heads and ffn over tp, experts over ep):
        // here too, so that a bad layout is reported before any worker starts.
        dims.validate_model(&crate::trainer::model_config(self), m.seq_len)
            .map_err(pconf)?;
        Ok(())
    }

    /// The device spec is well formed: `cpu`, `cuda` or `cuda:N` (checked here, before any
    /// worker starts or any GPU is opened). Every layout runs on a GPU.
    fn check_device(&self) -> Result<()> {
        let spec = self.train.device_spec();
        let s = spec.to_ascii_lowercase();
        let ordinal_ok = |n: &str| {
            n.strip_prefix(':')
                .is_some_and(|n| n.parse::<usize>().is_ok())
        };
        match s.strip_prefix("cuda") {
            _ if s == "cpu" => Ok(()),
            Some(n) if n.is_empty() || ordinal_ok(n) => Ok(()),
            _ => Err(TrainError::Config(format!(
                "train.device = `{spec}`: expected cpu, cuda or cuda:N"
            ))),
        }
    }

    /// `data.document_mask` needs document boundaries, which only shard folders record (their
    /// `.idx` document starts): the built-in corpus, `.tok` streams and text files have none.
    /// Boundaries are not guessed from EOS ids: the byte tokenizer's EOS is byte 0, which a
    /// text may contain, and a `.tok` file does not record which id ended its documents.
    fn check_documents(&self) -> Result<()> {
        let d = &self.data;
        let bad = |msg: String| Err(TrainError::Config(msg));
        if d.document_positions && !d.document_mask {
            return bad(
                "data.document_positions restarts positions per document: it needs data.document_mask = true".into(),
            );
        }
        if !d.document_mask {
            return Ok(());
        }
        let paths: Vec<&str> = if d.mix.is_empty() {
            vec![d.path.as_str()]
        } else {
            d.mix.iter().map(|m| m.path.as_str()).collect()
        };
        for p in paths {
            let what = if p.is_empty() {
                "the built-in corpus".to_string()
            } else if crate::data::shards::is_shard_folder(std::path::Path::new(p)) {
                continue;
            } else {
                format!("{p} (not a shard folder)")
            };
            return bad(format!(
                "data.document_mask needs document boundaries, which only shard folders record (`xtrain tokenize … -o FOLDER`); {what} has none"
            ));
        }
        Ok(())
    }

    /// `parallel.cp_balance` and `parallel.cp_comm`, parsed.
    pub fn cp_options(
        &self,
    ) -> Result<(
        parallel::context_parallel::CpBalance,
        parallel::context_parallel::CpComm,
    )> {
        let p = &self.parallel;
        Ok((
            p.cp_balance.parse().map_err(pconf)?,
            p.cp_comm.parse().map_err(pconf)?,
        ))
    }

    /// The activation recomputation policy of `train.recompute`.
    pub fn recompute(&self) -> Result<model::Recompute> {
        match self.train.recompute.as_str() {
            "none" => Ok(model::Recompute::None),
            "selective" => Ok(model::Recompute::Selective),
            "full" => Ok(model::Recompute::Full),
            other => Err(TrainError::Config(format!(
                "train.recompute must be `none`, `selective` or `full`, not `{other}`"
            ))),
        }
    }

    /// Sequences per optimizer step over all ranks: dp × micro × accum.
    pub fn global_batch(&self) -> usize {
        self.parallel.dp * self.train.micro_batch * self.train.grad_accum
    }

    pub fn to_toml(&self) -> String {
        toml::to_string_pretty(self).expect("config serialises")
    }
}

fn parse_value(raw: &str) -> toml::Value {
    // Parse `x = <raw>` so TOML decides the type (int, float, bool, array, quoted string).
    toml::from_str::<toml::Table>(&format!("x = {raw}"))
        .ok()
        .and_then(|mut t| t.remove("x"))
        .unwrap_or_else(|| toml::Value::String(raw.to_string()))
}

/// Keys the presets leave out (absent unless set): a layer may add them.
const OPTIONAL_KEYS: &[&str] = &["model.rope_scaling", "parallel.delayed_update_after"];

fn merge(base: &mut toml::Value, user: &toml::Value, prefix: &str) -> Result<()> {
    let (Some(bt), Some(ut)) = (base.as_table_mut(), user.as_table()) else {
        return Err(TrainError::Config(format!("`{prefix}` must be a table")));
    };
    for (k, v) in ut {
        let path = if prefix.is_empty() {
            k.clone()
        } else {
            format!("{prefix}.{k}")
        };
        match bt.get_mut(k) {
            None if OPTIONAL_KEYS.contains(&path.as_str()) => {
                bt.insert(k.clone(), v.clone());
            }
            None => return Err(TrainError::UnknownKey(path)),
            Some(slot) if slot.is_table() => merge(slot, v, &path)?,
            Some(slot) => *slot = coerce(slot, v.clone()),
        }
    }
    Ok(())
}

fn set_path(tree: &mut toml::Value, key: &str, value: toml::Value) -> Result<()> {
    let mut node = tree;
    let parts: Vec<&str> = key.split('.').collect();
    for (i, part) in parts.iter().enumerate() {
        let table = node
            .as_table_mut()
            .ok_or_else(|| TrainError::UnknownKey(key.to_string()))?;
        if i + 1 == parts.len() && !table.contains_key(*part) && OPTIONAL_KEYS.contains(&key) {
            table.insert(part.to_string(), value);
            return Ok(());
        }
        let slot = table
            .get_mut(*part)
            .ok_or_else(|| TrainError::UnknownKey(key.to_string()))?;
        if i + 1 == parts.len() {
            if slot.is_table() {
                return Err(TrainError::Config(format!(
                    "`{key}` is a section, not a value"
                )));
            }
            *slot = coerce(slot, value);
            return Ok(());
        }
        node = slot;
    }
    Err(TrainError::UnknownKey(key.to_string()))
}

/// `lr = 1` in TOML is an integer; accept it where a float is expected.
fn coerce(slot: &toml::Value, v: toml::Value) -> toml::Value {
    match (slot, &v) {
        (toml::Value::Float(_), toml::Value::Integer(i)) => toml::Value::Float(*i as f64),
        (
            toml::Value::String(_),
            toml::Value::Integer(_) | toml::Value::Float(_) | toml::Value::Boolean(_),
        ) => toml::Value::String(v.to_string()),
        _ => v,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_match_the_spec() {
        // (vocab, hidden, ffn, layers, heads, kv heads, seq, micro-batch) as the issue states them.
        for (name, want) in [
            ("tiny", (256, 64, 176, 2, 4, 2, 64, 8)),
            ("small", (256, 256, 688, 6, 8, 4, 256, 8)),
            ("medium", (4096, 512, 1376, 8, 8, 4, 512, 4)),
        ] {
            let c = RunConfig::preset(name).unwrap();
            let m = &c.model;
            let got = (
                m.vocab_size,
                m.hidden_size,
                m.intermediate_size,
                m.num_layers,
                m.num_heads,
                m.num_kv_heads,
                m.seq_len,
                c.train.micro_batch,
            );
            assert_eq!(got, want, "preset {name}");
        }
        assert!(RunConfig::preset("huge").is_err());
    }

    /// A GPU run trains in bf16 unless the precision is chosen (a file or an override); a CPU
    /// run keeps the presets' fp32; a written config keeps what it says.
    #[test]
    fn bf16_is_the_default_on_a_gpu_only() {
        let on = |extra: &[&str], text: Option<&str>| {
            let o: Vec<String> = extra.iter().map(|s| s.to_string()).collect();
            RunConfig::resolve("tiny", text, &o)
                .unwrap()
                .train
                .precision
        };
        assert_eq!(on(&["train.device=\"cuda\""], None), Precision::Bf16);
        assert_eq!(on(&["train.device=\"cuda:1\""], None), Precision::Bf16);
        assert_eq!(on(&["train.device=\"cpu\""], None), Precision::Fp32);
        assert_eq!(
            on(&["train.device=\"cuda\"", "train.precision=\"fp32\""], None),
            Precision::Fp32
        );
        let text = "[train]\nprecision = \"fp16\"\n";
        assert_eq!(on(&["train.device=\"cuda\""], Some(text)), Precision::Fp16);
        let c = RunConfig::resolve("tiny", None, &["train.device=\"cuda\"".into()]).unwrap();
        let mut cpu = c.clone();
        cpu.train.precision = Precision::Fp32;
        assert_eq!(
            RunConfig::resolve("tiny", Some(&cpu.to_toml()), &[])
                .unwrap()
                .train
                .precision,
            Precision::Fp32,
            "a written config (a checkpoint's) keeps its precision on a GPU"
        );
    }

    #[test]
    fn toml_then_overrides() {
        let text = "[train]\nlr = 1\nprecision = \"bf16\"\n[model]\nseq_len = 32\n";
        let c = RunConfig::resolve(
            "tiny",
            Some(text),
            &["train.steps=7".into(), "data.tokenizer=byte".into()],
        )
        .unwrap();
        assert_eq!(c.train.lr, 1.0);
        assert_eq!(c.train.precision, Precision::Bf16);
        assert_eq!(c.model.seq_len, 32);
        assert_eq!(c.train.steps, 7);
        // Round trip through the written form.
        assert_eq!(
            RunConfig::resolve("tiny", Some(&c.to_toml()), &[]).unwrap(),
            c
        );
    }

    #[test]
    fn gpu_layouts_are_checked_before_any_gpu_is_opened() {
        let on_gpu = |preset: &str, extra: &[&str]| {
            let o: Vec<String> = ["train.device=\"cuda\"", "parallel.nproc=2"]
                .iter()
                .chain(extra)
                .map(|s| s.to_string())
                .collect();
            RunConfig::resolve(preset, None, &o)
        };
        // Every layout passes (no GPU is opened here).
        for (preset, ok) in [
            ("tiny", &["parallel.dp=2", "parallel.zero=3"][..]),
            (
                "tiny",
                &[
                    "parallel.dp=2",
                    "parallel.zero=1",
                    "train.precision=\"bf16\"",
                ],
            ),
            ("tiny", &["parallel.pp=2", "parallel.schedule=\"1f1b\""]),
            ("tiny", &["parallel.tp=2", "parallel.sp=true"]),
            ("tiny", &["parallel.cp=2"]),
            ("moe-small", &["parallel.dp=2", "parallel.ep=2"]),
        ] {
            on_gpu(preset, ok).unwrap_or_else(|e| panic!("{ok:?}: {e}"));
        }
        let e = RunConfig::resolve("tiny", None, &["train.device=\"gpu\"".into()]).unwrap_err();
        assert!(
            e.to_string().contains("expected cpu, cuda or cuda:N"),
            "{e}"
        );
    }

    #[test]
    fn unknown_keys_are_named() {
        let e = RunConfig::resolve("tiny", Some("[train]\nlrr = 1.0\n"), &[]).unwrap_err();
        assert_eq!(e.to_string(), "config: unknown key `train.lrr`");
        let e = RunConfig::resolve("tiny", None, &["model.hiden_size=3".into()]).unwrap_err();
        assert!(e.to_string().contains("`model.hiden_size`"), "{e}");
        let e = RunConfig::resolve("tiny", Some("[optim]\nx=1\n"), &[]).unwrap_err();
        assert!(e.to_string().contains("`optim`"), "{e}");
        let e = RunConfig::resolve("tiny", None, &["train.steps".into()]).unwrap_err();
        assert!(e.to_string().contains("key=value"), "{e}");
    }

    #[test]
    fn invalid_values_are_errors() {
        let e = RunConfig::resolve("tiny", None, &["model.num_kv_heads=3".into()]).unwrap_err();
        assert!(e.to_string().contains("num_kv_heads"), "{e}");
        let e = RunConfig::resolve("tiny", None, &["train.precision=fp8".into()]).unwrap_err();
        assert!(e.to_string().contains("fp8"), "{e}");
        let e = RunConfig::resolve("tiny", None, &["train.steps=-1".into()]).unwrap_err();
        assert!(matches!(e, TrainError::Config(_)), "{e}");
        let e = RunConfig::resolve("tiny", None, &["parallel.nproc=2".into()]).unwrap_err();
        assert!(e.to_string().contains("nproc = 2"), "{e}");
        let e = RunConfig::resolve("tiny", None, &["train.recompute=some".into()]).unwrap_err();
        assert!(e.to_string().contains("train.recompute"), "{e}");
        let mut p = RunConfig::preset("tiny").unwrap().parallel;
        p.tp = 2;
        p.nproc = 8;
        p.complete(true, false).unwrap();
        assert_eq!((p.dp, p.nproc), (4, 8));
        p.dp = 3;
        p.complete(false, true).unwrap();
        assert_eq!(p.nproc, 6);
        p.nproc = 7;
        assert!(p.complete(true, false).is_err());
    }
}
