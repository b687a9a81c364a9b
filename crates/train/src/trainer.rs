//! The one trainer, for every layout: a rank's model part and executor from
//! `parallel::parallelize`, its share of the data, the learning-rate schedule, and where the
//! run is. One optimizer step = this dp rank's `grad_accum` micro-batches through the executor
//! (forward, backward, gradient reduction, clipping, AdamW); the single process is the layout
//! with every degree 1.
//!
//! Determinism: initialisation depends only on `train.seed` (each rank generates exactly its
//! blocks of the full model's initial weights), the data of step `s` only on `(seed, s)`, and
//! every reduction runs in a fixed order, so a run resumed from a checkpoint at the same layout
//! reproduces the uninterrupted run's losses bit for bit.
use std::path::Path;

use comm::Communicator;
use model::Model;
use parallel::checkpoint::{self, Checkpoint, MeshRecord, SaveMeta, TrainingState};
use parallel::executor::{ExecConfig, Executor, StepStats};
use parallel::memory::MemoryAccount;
use parallel::{DecoderStage, Mesh, ModelOptions, ParallelDims};

use crate::config::RunConfig;
use crate::data::{Dataset, Sampler, Tokenizer};
use crate::error::{Result, TrainError};
use crate::pipeline::{PipelineReport, RunPipeline};
use crate::schedule::CosineSchedule;

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
    mc.rope_scaling = m.rope_scaling.clone();
    mc.tie_word_embeddings = m.tie_word_embeddings;
    mc.rms_norm_eps = m.norm_eps as f32;
    mc.initializer_range = cfg.train.init_std as f32;
    mc.max_position_embeddings = m.seq_len;
    if m.arch == "mixtral" {
        mc = mc.with_experts(m.num_experts, m.experts_per_token);
        if m.shared_expert_size > 0 {
            mc.shared_expert_intermediate_size = Some(m.shared_expert_size);
        }
        if m.aux_loss_coef > 0.0 {
            mc.output_router_logits = true;
            mc.router_aux_loss_coef = m.aux_loss_coef as f32;
        }
        mc.router_bias = m.bias_balance_rate > 0.0;
        if m.capacity_factor > 0.0 {
            mc.capacity_factor = Some(m.capacity_factor as f32);
            mc.capacity_drop = Some(m.capacity_drop.clone());
        }
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
        rope_scaling: mc.rope_scaling.clone(),
        tie_word_embeddings: mc.tie_word_embeddings,
        norm_eps: f32_decimal(mc.rms_norm_eps),
        num_experts: mc.num_local_experts,
        experts_per_token: if mc.is_moe() {
            mc.num_experts_per_tok
        } else {
            0
        },
        shared_expert_size: 0,
        capacity_factor: 0.0,
        capacity_drop: "position".into(),
        bias_balance_rate: 0.0,
        aux_loss_coef: if mc.is_moe() {
            f32_decimal(mc.effective_aux_coef())
        } else {
            0.0
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
/// term is attention's QKᵀ and AV products, forward and backward. Every layout counts the full
/// model's N, so the MFU of a parallel run divides the same work by all the cores it uses. A
/// MoE token only goes through `experts_per_token` of the experts: N counts those (the
/// active parameters), not the `3·H·F` weights of each of the others in every layer.
pub fn flops_per_token(cfg: &RunConfig, num_params: usize) -> f64 {
    let m = &cfg.model;
    let idle_experts = if m.arch == "mixtral" {
        m.num_layers
            * m.num_experts.saturating_sub(m.experts_per_token)
            * 3
            * m.hidden_size
            * m.intermediate_size
    } else {
        0
    };
    let active = num_params.saturating_sub(idle_experts);
    6.0 * active as f64 + 12.0 * (m.num_layers * m.hidden_size * m.seq_len) as f64
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

/// What one optimizer step reports.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepReport {
    /// Steps done (counted from 1).
    pub step: usize,
    /// Mean loss over the global batch.
    pub loss: f64,
    pub lr: f64,
    pub stats: StepStats,
    /// Tokens of the global batch.
    pub tokens: usize,
    /// MoE models: how the step's tokens spread over the experts.
    pub experts: Option<ExpertLoad>,
}

/// The experts' load in one step, over every rank and MoE layer.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ExpertLoad {
    /// Most tokens routed to one expert over the mean per expert.
    pub imbalance: f64,
    /// With expert parallelism: over the MoE layers, the busiest ep rank's routed rows summed
    /// over the mean ep rank's (its experts' tokens, from every rank; 1 without ep). Each
    /// layer's all-to-alls wait for its busiest rank.
    pub ep_imbalance: f64,
    /// Assignments dropped by the expert capacity, over all assignments.
    pub dropped: f64,
    /// Seconds this rank waited for expert parallelism's all-to-alls (0 without ep).
    pub all_to_all_s: f64,
}

/// A rank's model part, executor, data, and where the run is.
pub struct Trainer {
    pub cfg: RunConfig,
    pub dims: ParallelDims,
    comm: Communicator,
    mesh: Mesh,
    pub exec: Executor<DecoderStage>,
    /// The pipeline schedule and its measured timeline (pp > 1).
    pub pipeline: Option<RunPipeline>,
    /// The traced timeline of a run without pipeline parallelism ([`Self::keep_trace`]).
    trace: Option<crate::pipeline::Timeline>,
    pub data: Dataset,
    pub sampler: Sampler,
    pub schedule: CosineSchedule,
    pub tokenizer: Tokenizer,
    /// The raw `tokenizer.json`, kept so checkpoints carry their tokenizer.
    pub tokenizer_json: Option<Vec<u8>>,
    pub step: usize,
    pub tokens_seen: u64,
    /// Expert parallelism's all-to-all wait so far (the profile's cumulative seconds).
    expert_wait_seen: f64,
    /// Resident set of the process before the model state existed (memory reports).
    pub baseline_rss: Option<u64>,
}

fn merr(e: impl std::fmt::Display) -> TrainError {
    TrainError::Model(e.to_string())
}

fn perr(e: parallel::ParallelError) -> TrainError {
    match e {
        parallel::ParallelError::Config(m) | parallel::ParallelError::Layout(m) => {
            TrainError::Config(m)
        }
        parallel::ParallelError::Unsupported(m) => TrainError::Unsupported(m),
        other => TrainError::Parallel(other.to_string()),
    }
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

/// The tokenizer a checkpoint carries (`tokenizer.json`, else bytes).
fn checkpoint_tokenizer(ck: &Checkpoint) -> Result<(Tokenizer, Option<Vec<u8>>)> {
    match ck.file("tokenizer.json")? {
        Some(bytes) => Ok((
            Tokenizer::Hf(Box::new(
                tokenizers::Tokenizer::from_bytes(&bytes)
                    .map_err(|e| TrainError::Tokenizer(e.to_string()))?,
            )),
            Some(bytes),
        )),
        None => Ok((Tokenizer::Byte, None)),
    }
}

/// The resolved run config a checkpoint holds.
pub fn checkpoint_config_text(ck: &Checkpoint) -> Result<String> {
    let bytes = ck
        .file("config.toml")?
        .ok_or_else(|| TrainError::Checkpoint {
            path: ck.dir().to_path_buf(),
            msg: "holds no config.toml".into(),
        })?;
    String::from_utf8(bytes).map_err(|_| TrainError::Checkpoint {
        path: ck.dir().to_path_buf(),
        msg: "config.toml is not UTF-8".into(),
    })
}

impl Trainer {
    /// A fresh run on this rank of `comm`'s world (every rank calls it).
    pub fn new(cfg: RunConfig, comm: &Communicator) -> Result<Self> {
        cfg.validate()?;
        let (tk, json) = load_tokenizer(&cfg.data.tokenizer)?;
        Self::build(cfg, comm, tk, json)
    }

    /// A fresh single-process run.
    pub fn single(cfg: RunConfig) -> Result<Self> {
        Self::new(cfg, &Communicator::single_process()?)
    }

    /// Continues checkpoint `ck` (saved at any layout) with `cfg` — the checkpoint's config
    /// with the caller's overrides, typically a new layout. Every rank calls it.
    pub fn resume(cfg: RunConfig, ck: &Path, comm: &Communicator) -> Result<Self> {
        cfg.validate()?;
        let mut ck = Checkpoint::open(ck)?;
        let (tk, json) = checkpoint_tokenizer(&ck)?;
        let mut t = Self::build(cfg, comm, tk, json)?;
        let state = ck.manifest.state.clone();
        if state.step as usize > t.cfg.train.steps {
            return Err(TrainError::Config(format!(
                "the checkpoint is at step {}, beyond train.steps = {} (raise it with --set train.steps=N)",
                state.step, t.cfg.train.steps
            )));
        }
        t.exec.load_checkpoint(&mut ck).map_err(perr)?;
        // The routing biases continue (a run that balances by bias saves them; balancing
        // switched on at a resume starts from zero).
        if t.cfg.model.bias_balance_rate > 0.0 && !state.router_bias.is_empty() {
            t.exec
                .model()
                .local
                .set_router_biases(&state.router_bias)
                .map_err(merr)?;
        }
        t.step = state.step as usize;
        t.tokens_seen = state.tokens_seen;
        t.sampler.seed = state.data_seed;
        Ok(t)
    }

    fn build(
        cfg: RunConfig,
        comm: &Communicator,
        tokenizer: Tokenizer,
        tokenizer_json: Option<Vec<u8>>,
    ) -> Result<Self> {
        let p = &cfg.parallel;
        if comm.size() != p.nproc {
            return Err(TrainError::Config(format!(
                "parallel.nproc = {} but the job has {} process(es)",
                p.nproc,
                comm.size()
            )));
        }
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
        let dims = p.dims()?;
        dims.validate_model(&model_config(&cfg), cfg.model.seq_len)
            .map_err(perr)?;
        let data = Dataset::load(
            &cfg.data,
            &tokenizer,
            cfg.model.vocab_size,
            cfg.model.seq_len,
        )?;
        let baseline_rss = parallel::memory::proc_status_bytes("VmRSS:");
        let mesh = Mesh::new(comm, dims).map_err(perr)?;
        let (cp_balance, cp_comm) = cfg.cp_options()?;
        let opts = ModelOptions {
            seq_len: cfg.model.seq_len,
            recompute: cfg.recompute()?,
            cp_balance,
            cp_comm,
        };
        let pipeline = if dims.pp > 1 {
            let pp_rank = mesh.coord("pp").map_err(perr)?;
            Some(RunPipeline::new(&cfg, &dims, pp_rank)?)
        } else {
            None
        };
        let mut par = parallel::parallelize(
            &model_config(&cfg),
            &mesh,
            &opts,
            pipeline.as_ref().map(|p| &p.lowered),
        )
        .map_err(perr)?;
        let t = &cfg.train;
        same_device_kind(comm, &t.device_spec())?;
        // A launched worker takes its host's GPU `LOCAL_RANK mod count`; ranks as threads of
        // one process share the process's GPU.
        let local_rank = comm::env::LaunchEnv::from_env().map_or(0, |e| e.local_rank);
        let device = tensor::buf::Dev::open_local(&t.device_spec(), local_rank)
            .map_err(|e| TrainError::Config(format!("train.device: {e}")))?;
        {
            use parallel::stage::StageModel;
            let phi = par.stage.units().last().map_or(0, |u| u.end);
            let n = par.dp.size();
            let states = parallel::memory::formula(phi, n, dims.zero, t.precision);
            let formula = format!(
                "ZeRO-{} in {}: {}, Φ = {:.3} G parameters on this rank, N = {n}",
                dims.zero.index(),
                t.precision.name(),
                parallel::memory::formula_text(dims.zero, t.precision),
                phi as f64 / 1e9
            );
            let offload = p.offload_optimizer()?.then_some(Offload {
                held_bytes: if p.delayed_update_after.is_some() {
                    // A held update's gradients: the own range in their storage format.
                    states.master / 4 * t.precision.half().map_or(4, |_| 2)
                } else {
                    0
                },
            });
            check_memory(comm, &device, &t.device_spec(), states, &formula, offload)?;
        }
        let nccl = nccl_groups(&device, &mut par, comm.options().timeout)?;
        let exec_cfg = ExecConfig {
            zero: dims.zero,
            bucket_bytes: (p.bucket_mb * 1024.0 * 1024.0) as usize,
            grad_comm: parallel::data_parallel::grad_comm::GradComm::parse(
                &t.grad_comm,
                t.warmup_steps as u64,
            )
            .map_err(TrainError::Config)?,
            adamw: adamw(t),
            max_grad_norm: (t.grad_clip > 0.0).then_some(t.grad_clip as f32),
            precision: t.precision,
            loss_scale: t.loss_scale,
            // A launched worker or a lone process runs one rank; ranks as threads of a test
            // process do not.
            one_rank_per_process: comm.size() == 1 || comm::env::LaunchEnv::from_env().is_ok(),
            device,
            offload_optimizer: p.offload_optimizer()?,
            delayed_update_after: p.delayed_update_after,
            nccl,
        };
        let init = par.stage.clone();
        let seed = t.seed;
        let mut exec = Executor::new(par.stage, par.dp, par.pipe, exec_cfg, |r, out| {
            init.init_range(seed, r, out)
        })
        .map_err(perr)?;
        if pipeline.is_some() {
            // The action trace gives the measured bubble (an Instant per action).
            exec.enable_trace();
        }
        if dims.ep > 1 {
            // The all-to-all wait of every step (metrics.jsonl, the progress line).
            model::profile::enable(true);
        }
        let sampler = Sampler {
            seed,
            seq_len: cfg.model.seq_len,
            micro_batch: t.micro_batch,
            grad_accum: t.grad_accum,
            dp: dims.dp,
            rank: mesh.coord("dp").map_err(perr)?,
        };
        let schedule = CosineSchedule {
            peak: t.lr,
            min: t.min_lr,
            warmup: t.warmup_steps,
            total: t.steps,
        };
        Ok(Self {
            dims,
            comm: comm.clone(),
            mesh,
            exec,
            pipeline,
            trace: None,
            data,
            sampler,
            schedule,
            tokenizer,
            tokenizer_json,
            step: 0,
            tokens_seen: 0,
            expert_wait_seen: 0.0,
            baseline_rss,
            cfg,
        })
    }

    /// This rank in the world.
    pub fn rank(&self) -> usize {
        self.comm.rank()
    }

    /// The world communicator.
    pub fn comm(&self) -> &Communicator {
        &self.comm
    }

    /// The mesh the run is laid out on.
    pub fn mesh(&self) -> &Mesh {
        &self.mesh
    }

    /// Parameters of the full model.
    pub fn num_params(&self) -> usize {
        self.exec.model().plan.full_layout.total()
    }

    /// Bytes held on this rank (persistent buffers, and the peaks of transient ones so far).
    pub fn memory(&self) -> MemoryAccount {
        self.exec.memory()
    }

    pub fn flops_per_token(&self) -> f64 {
        flops_per_token(&self.cfg, self.num_params())
    }

    /// Tokens of one global batch.
    pub fn tokens_per_step(&self) -> usize {
        self.cfg.global_batch() * self.cfg.model.seq_len
    }

    /// The model's batch of a sampled one: under `data.document_mask` with the windows'
    /// document starts (validation made every source a shard folder, which records them).
    fn model_batch(&self, b: crate::data::Batch) -> Result<model::Batch> {
        let targets = b.targets.iter().map(|&t| t as i64).collect();
        let mb = model::Batch::new(b.batch, b.seq, b.inputs, targets).map_err(merr)?;
        let d = &self.cfg.data;
        if !d.document_mask {
            return Ok(mb);
        }
        let starts = b.doc_starts.ok_or_else(|| {
            TrainError::Data(
                "data.document_mask: a sampled window has no document boundaries (only shard folders record them)".into(),
            )
        })?;
        let docs =
            model::Documents::new(b.batch, b.seq, starts, d.document_positions).map_err(merr)?;
        mb.with_documents(docs).map_err(merr)
    }

    /// One optimizer step over this dp rank's `grad_accum` micro-batches.
    pub fn train_step(&mut self) -> Result<StepReport> {
        let batches = (0..self.cfg.train.grad_accum)
            .map(|a| {
                self.model_batch(
                    self.sampler
                        .train_batch(&self.data.train, self.step as u64, a),
                )
            })
            .collect::<Result<Vec<_>>>()?;
        let lr = self.schedule.lr(self.step);
        self.exec.set_lr(lr as f32);
        let stats = match &mut self.pipeline {
            Some(p) => {
                let stats = self.exec.run_step(&batches, p.actions()).map_err(perr)?;
                p.timeline.absorb(&self.exec.take_trace());
                stats
            }
            None => {
                let stats = self.exec.train_step(&batches).map_err(perr)?;
                if let Some(t) = &mut self.trace {
                    t.absorb(&self.exec.take_trace());
                }
                stats
            }
        };
        let loss = stats.loss as f64;
        if !loss.is_finite() && !self.exec.loss_scaler().dynamic {
            return Err(TrainError::Diverged(format!(
                "loss is {loss} at step {}",
                self.step
            )));
        }
        self.step += 1;
        let tokens = self.tokens_per_step();
        self.tokens_seen += tokens as u64;
        let experts = self.expert_load()?;
        Ok(StepReport {
            step: self.step,
            loss,
            lr,
            stats,
            tokens,
            experts,
        })
    }

    /// Mean validation loss over `eval_batches` fixed micro-batches of the held-out split
    /// (every rank evaluates the same batches; a collective where weights are gathered).
    pub fn evaluate(&mut self) -> Result<Option<f64>> {
        if self.data.val.is_empty() || self.cfg.train.eval_batches == 0 {
            return Ok(None);
        }
        let mut sum = 0.0;
        for i in 0..self.cfg.train.eval_batches {
            let batch = self.model_batch(self.sampler.val_batch(&self.data.val, i))?;
            sum += self.exec.evaluate(&batch).map_err(perr)? as f64;
        }
        Ok(Some(sum / self.cfg.train.eval_batches as f64))
    }

    /// The MoE layers' load of the step just run, summed over every rank (a collective over
    /// the world for MoE models; `None` for dense ones).
    fn expert_load(&mut self) -> Result<Option<ExpertLoad>> {
        if self.cfg.model.arch != "mixtral" {
            return Ok(None);
        }
        let load = self.exec.model().take_moe_load();
        let (e, layers) = (self.cfg.model.num_experts, self.cfg.model.num_layers);
        // [layer-major tokens per expert, dropped], summed over every rank.
        let mut v = vec![0i64; layers * e + 1];
        for (&l, counts) in &load.tokens {
            for (x, &c) in v[l * e..(l + 1) * e].iter_mut().zip(counts) {
                *x += c as i64;
            }
        }
        v[layers * e] = load.dropped as i64;
        if self.comm.size() > 1 {
            self.comm.all_reduce(&mut v, comm::ReduceOp::Sum)?;
        }
        let per_expert: Vec<i64> = (0..e)
            .map(|x| (0..layers).map(|l| v[l * e + x]).sum())
            .collect();
        let total: i64 = per_expert.iter().sum();
        // Rank r of the ep group holds experts [r·E/ep, (r+1)·E/ep) of every layer.
        let ep = self.dims.ep.max(1);
        let (mut busiest, mut mean_rank) = (0i64, 0.0f64);
        for layer in v[..layers * e].chunks_exact(e) {
            let rows = layer.chunks_exact(e / ep).map(|c| c.iter().sum::<i64>());
            busiest += rows.clone().max().unwrap_or(0);
            mean_rank += rows.sum::<i64>() as f64 / ep as f64;
        }
        let max = per_expert.iter().copied().max().unwrap_or(0);
        let mean = total as f64 / e.max(1) as f64;
        self.balance_router(&v[..layers * e])?;
        let waited = model::profile::report()
            .into_iter()
            .find(|(k, _)| *k == model::profile::Kernel::ExpertExchange)
            .map_or(0.0, |(_, s)| s);
        let all_to_all_s = waited - self.expert_wait_seen;
        self.expert_wait_seen = waited;
        Ok(Some(ExpertLoad {
            imbalance: if mean > 0.0 { max as f64 / mean } else { 0.0 },
            ep_imbalance: if mean_rank > 0.0 {
                busiest as f64 / mean_rank
            } else {
                1.0
            },
            dropped: if total > 0 {
                v[layers * e] as f64 / total as f64
            } else {
                0.0
            },
            all_to_all_s,
        }))
    }

    /// Auxiliary-loss-free balancing: every layer's router bias moves by
    /// `model.bias_balance_rate` towards its experts' mean load
    /// ([`model::layers::moe::balance_bias`]). `loads` is layer-major and the same on every
    /// rank, so every rank's biases stay equal.
    fn balance_router(&self, loads: &[i64]) -> Result<()> {
        let rate = self.cfg.model.bias_balance_rate as f32;
        if rate <= 0.0 {
            return Ok(());
        }
        let model = &self.exec.model().local;
        let e = self.cfg.model.num_experts;
        let mut biases = model.router_biases();
        for (l, b) in biases.iter_mut().enumerate() {
            if !b.is_empty() {
                let load: Vec<u64> = loads[l * e..(l + 1) * e]
                    .iter()
                    .map(|&x| x as u64)
                    .collect();
                model::layers::moe::balance_bias(b, &load, rate);
            }
        }
        model.set_router_biases(&biases).map_err(merr)
    }

    /// The pipeline's measured bubble beside the simulator's (pp > 1; on the pp group's rank
    /// 0, `None` elsewhere). A collective over every rank.
    pub fn pipeline_report(&self) -> Result<Option<PipelineReport>> {
        match &self.pipeline {
            Some(p) => {
                crate::pipeline::report(&self.mesh.pp().map_err(perr)?, &p.timeline, &p.compute)
            }
            None => Ok(None),
        }
    }

    /// Keeps every action's span (and the units' backwards and buckets' reductions) from now
    /// on, for [`Self::write_trace`]; at any layout.
    pub fn keep_trace(&mut self) {
        match &mut self.pipeline {
            Some(p) => p.timeline = crate::pipeline::Timeline::new(true),
            None => {
                self.exec.enable_trace();
                self.trace = Some(crate::pipeline::Timeline::new(true));
            }
        }
    }

    /// Writes the Chrome trace of what was kept since [`Self::keep_trace`] (rank 0 writes;
    /// a collective).
    pub fn write_trace(&self, path: &Path) -> Result<()> {
        let timeline = match (&self.pipeline, &self.trace) {
            (Some(p), _) => &p.timeline,
            (None, Some(t)) => t,
            (None, None) => {
                return Err(TrainError::Config(
                    "write_trace: no trace was kept (keep_trace first)".into(),
                ))
            }
        };
        crate::pipeline::write_trace(&self.comm, timeline, path)
    }

    /// Where training stands (what a checkpoint records besides tensors).
    pub fn state(&self) -> TrainingState {
        TrainingState {
            step: self.step as u64,
            tokens_seen: self.tokens_seen,
            data_seed: self.sampler.seed,
            adam_step: self.exec.step_count(),
            loss_scaler: *self.exec.loss_scaler(),
            router_bias: if self.cfg.model.bias_balance_rate > 0.0 {
                self.exec.model().local.router_biases()
            } else {
                Vec::new()
            },
            grad_comm_error: self.exec.has_powersgd(),
            pending_update: self.exec.pending_update(),
        }
    }

    /// Saves checkpoint `dir`: every rank's blocks, the manifest, the resolved config, the
    /// Hugging Face config and the tokenizer. A collective: every rank calls it.
    pub fn save_checkpoint(&self, dir: &Path) -> Result<()> {
        let mut files = vec![
            ("config.toml".to_string(), self.cfg.to_toml().into_bytes()),
            (
                "config.json".to_string(),
                hf_config_json(&model_config(&self.cfg)).into_bytes(),
            ),
        ];
        if let Some(json) = &self.tokenizer_json {
            files.push(("tokenizer.json".to_string(), json.clone()));
        }
        let meta = SaveMeta {
            mesh: MeshRecord::from(&self.dims),
            precision: self.cfg.train.precision,
            state: self.state(),
            files,
        };
        checkpoint::save(
            dir,
            self.comm.world(),
            &self.exec.checkpoint_pieces().map_err(perr)?,
            &meta,
        )
        .map_err(perr)
    }
}

/// AdamW's hyper-parameters of a run (`lr` its peak).
fn adamw(t: &crate::config::TrainConfig) -> model::AdamW {
    model::AdamW {
        lr: t.lr as f32,
        beta1: t.beta1 as f32,
        beta2: t.beta2 as f32,
        eps: t.eps as f32,
        weight_decay: t.weight_decay as f32,
    }
}

/// A model and its full fp32 weights from any checkpoint (any layout): for generation and
/// export. Returns the run config, the model, the weights and the tokenizer. A checkpoint
/// holding a delayed update gives the weights with it applied
/// ([`checkpoint::PendingUpdate::apply`]): every step's update.
pub fn load_model(path: &Path) -> Result<(RunConfig, Model, Vec<f32>, Tokenizer)> {
    use checkpoint::Kind;
    let mut ck = Checkpoint::open(path)?;
    let cfg = RunConfig::resolve("tiny", Some(&checkpoint_config_text(&ck)?), &[])?;
    let model = Model::new(model_config(&cfg)).map_err(merr)?;
    let mut params = vec![0.0f32; model.num_params()];
    let state = ck.manifest.state.clone();
    for e in &model.layout.entries {
        let n = e.view.numel();
        let mut t = ck.tensor(Kind::Param, &e.name, n)?;
        if let Some(p) = state.pending_update {
            let g = ck.tensor(Kind::PendingGrad, &e.name, n)?;
            let mut m = ck.tensor(Kind::ExpAvg, &e.name, n)?;
            let mut v = ck.tensor(Kind::ExpAvgSq, &e.name, n)?;
            p.apply(
                &adamw(&cfg.train),
                state.adam_step,
                &mut t,
                &g,
                &mut m,
                &mut v,
            );
        }
        e.view.of_mut(&mut params).copy_from_slice(&t);
    }
    let (tokenizer, _) = checkpoint_tokenizer(&ck)?;
    Ok((cfg, model, params, tokenizer))
}

/// The NCCL communicators `XTRAIN_BACKEND=nccl` asks for (GPU ranks, one GPU each; none for
/// the own engine), made in this order on every rank: the dp group's, on the communication
/// stream, returned for the executor; the tp group's (tp > 1), on the compute stream, attached
/// to the region operators; the cp group's (cp > 1), on the communication stream, attached to
/// the ring attention; the ep group's (ep > 1), on the communication stream, attached to the
/// MoE layers' token exchange; one per pipeline link (pp > 1), a side stream each
/// ([`parallel::pipeline_parallel::link`]). A dp group of one rank gets a one-rank communicator: its reductions change nothing, but they
/// run the same path as many ranks' (how that path is checked on a machine with one GPU).
///
/// The GPU's host waits then watch them ([`tensor::cuda::Watch`]): a wait that outlasts
/// `timeout` (`XTRAIN_COMM_TIMEOUT`), or a communicator's background error (a peer that
/// failed), ends it with an error naming the groups and this rank, instead of a hang.
fn nccl_groups(
    device: &tensor::buf::Dev,
    par: &mut parallel::parallelize::Parallelized,
    timeout: std::time::Duration,
) -> Result<Option<parallel::nccl::NcclGroup>> {
    use parallel::nccl::{Backend, NcclGroup, BACKEND_ENV};
    use tensor::cuda::Stream;
    let dp = &par.dp;
    let region = par.stage.tp.as_ref().map(|t| &t.region);
    if Backend::from_env().map_err(perr)? == Backend::Host {
        if let tensor::buf::Dev::Cuda(gpu) = device {
            let links = par.pipe.iter().flat_map(|p| p.links.values());
            let groups = std::iter::once(dp)
                .chain(region.map(|r| r.group()))
                .chain(par.stage.cp_attention.as_ref().map(|a| a.group()))
                .chain(par.stage.ep_exchange.as_ref().map(|e| e.group()))
                .chain(links.map(|l| l.group()));
            for g in groups.filter(|g| g.size() > 1) {
                tracing::info!(
                    target: "comm",
                    "group {} of {} ranks: device buffers on cuda:{} staged through host memory over the own transports ({BACKEND_ENV}=nccl puts them on NCCL)",
                    g.name(),
                    g.size(),
                    gpu.info.ordinal
                );
            }
        }
        return Ok(None);
    }
    let tensor::buf::Dev::Cuda(gpu) = device else {
        return Err(TrainError::Config(format!(
            "{BACKEND_ENV}=nccl communicates between GPUs: train with --device cuda (or unset it)"
        )));
    };
    // Every communicator made, for the GPU's watch.
    let mut all: Vec<NcclGroup> = Vec::new();
    let mut make = |group: &comm::ProcessGroup, stream: Stream, what: &str| {
        let g = NcclGroup::new(group, gpu, stream, what).map_err(perr)?;
        all.push(g.clone());
        Ok::<_, TrainError>(g)
    };
    let dp_group = make(
        dp,
        Stream::Comm,
        "gradient reductions and ZeRO weight gathers",
    )?;
    if let Some(region) = region.filter(|r| r.tp() > 1) {
        let what = "tensor-parallel activations and their gradients";
        region
            .attach_nccl(make(region.group(), Stream::Compute, what)?)
            .map_err(perr)?;
    }
    if let Some(attention) = &par.stage.cp_attention {
        let what = "context-parallel K/V blocks and their gradients";
        attention
            .attach_nccl(make(attention.group(), Stream::Comm, what)?)
            .map_err(perr)?;
    }
    if let Some(exchange) = &par.stage.ep_exchange {
        let what = "expert-parallel token rows and their gradients";
        exchange
            .attach_nccl(make(exchange.group(), Stream::Comm, what)?)
            .map_err(perr)?;
    }
    if let Some(pipe) = &mut par.pipe {
        all.extend(pipe.use_nccl(gpu).map_err(perr)?);
    }
    // The watch outlives this job (the GPU is the process's): it holds watchers, which let
    // the communicators go with the job.
    let watchers: Vec<parallel::nccl::NcclWatcher> = all.iter().map(|g| g.watcher()).collect();
    gpu.watch(Some(tensor::cuda::Watch {
        limit: timeout,
        what: watchers
            .iter()
            .map(|w| w.describe())
            .collect::<Vec<_>>()
            .join(", "),
        check: Box::new(move || watchers.iter().try_for_each(|w| w.check())),
    }));
    Ok(Some(dp_group))
}

/// Every rank of the job trains on the same kind of device (a CPU rank beside GPU ranks would
/// meet device buffers it cannot read, or the reverse, somewhere in the first step): checked
/// over the world before any device is opened, naming each rank's device.
/// Refuses, before anything is allocated, model states that cannot fit this rank's memory
/// (the ZeRO formula's bytes, `parallel::memory::check_states_fit`): on the GPU the weights
/// and gradients, and the optimizer's state unless offloaded; in host memory what the CPU or
/// the offload keeps. Each memory is shared by the ranks it holds: the processes (or the
/// threads) of the host, the ranks on the GPU (`LOCAL_RANK mod GPUs`, or all of the host's for
/// `cuda:N`).
/// ZeRO-Offload's host memory beside the optimizer state.
struct Offload {
    /// A delayed update's held gradients (`parallel::executor::delayed`).
    held_bytes: usize,
}

fn check_memory(
    comm: &Communicator,
    device: &tensor::buf::Dev,
    spec: &str,
    states: MemoryAccount,
    formula: &str,
    offload: Option<Offload>,
) -> Result<()> {
    use parallel::memory::{check_states_fit, human, Capacity};
    let h = |b: usize| human(b as u64);
    let weights = format!(
        "weights {} + gradients {}",
        h(states.params),
        h(states.grads)
    );
    let master = match states.master {
        0 => String::new(),
        b => format!("fp32 master {} + ", h(b)),
    };
    let optimizer = format!("{master}AdamW moments {}", h(states.optimizer));
    // Launched processes of this host, or the ranks as threads of this one.
    let launched = comm::env::LaunchEnv::from_env().ok();
    let (local_rank, host_ranks) = match &launched {
        Some(e) => (e.local_rank, e.local_world_size),
        None => (0, comm.size()),
    };
    let rank = comm.rank();
    let bytes = |b: usize| b as u64;
    let fail = |e: parallel::ParallelError| match e {
        parallel::ParallelError::Config(m) => TrainError::Parallel(m),
        e => TrainError::Parallel(e.to_string()),
    };
    let all = format!("{weights} + {optimizer}; {formula}");
    let (host, host_what) = match device {
        tensor::buf::Dev::Cpu => (states.model_states(), all),
        tensor::buf::Dev::Cuda(g) => {
            let (on_gpu, what) = if offload.is_some() {
                (
                    states.params + states.grads,
                    format!("{weights}; {formula}"),
                )
            } else {
                (states.model_states(), all)
            };
            let (free, total) = g
                .memory_info()
                .map_err(|e| TrainError::Config(format!("reading the GPU's memory: {e}")))?;
            let sharing = match tensor::cuda::device_count() {
                // `cuda`: this host's ranks with the same `LOCAL_RANK mod count`.
                Ok(count)
                    if launched.is_some()
                        && spec.trim().eq_ignore_ascii_case("cuda")
                        && count > 0 =>
                {
                    (0..host_ranks)
                        .filter(|r| r % count == local_rank % count)
                        .count()
                }
                _ => host_ranks,
            };
            let cap = Capacity {
                place: format!("GPU {} ({})", g.info.ordinal, g.info.name),
                free: bytes(free),
                total: bytes(total),
                ranks: sharing.max(1),
            };
            check_states_fit(rank, bytes(on_gpu), &what, &cap).map_err(fail)?;
            let Some(offload) = offload else {
                return Ok(());
            };
            // 16-bit training also lands this rank's gradients in page-locked host memory,
            // 2 bytes for each of the master's 4 (`parallel::executor::offload`).
            let landed = states.master / 2;
            let mut what = match landed {
                0 => format!("offloaded {optimizer}"),
                b => format!("offloaded {optimizer} + landed 16-bit gradients {}", h(b)),
            };
            if offload.held_bytes > 0 {
                what += &format!(
                    " + a delayed update's held gradients {}",
                    h(offload.held_bytes)
                );
            }
            (
                states.master + states.optimizer + landed + offload.held_bytes,
                what,
            )
        }
    };
    match Capacity::host(host_ranks.max(1)) {
        Some(cap) => check_states_fit(rank, bytes(host), &host_what, &cap).map_err(fail),
        None => Ok(()),
    }
}

fn same_device_kind(comm: &Communicator, spec: &str) -> Result<()> {
    if comm.size() == 1 {
        return Ok(());
    }
    let gpu = spec.trim().to_ascii_lowercase().starts_with("cuda") as i64;
    let mut all = vec![0i64; comm.size()];
    comm.world()
        .all_gather(&[gpu], &mut all)
        .map_err(|e| TrainError::Config(format!("agreeing on the device: {e}")))?;
    if all.iter().all(|&g| g == all[0]) {
        return Ok(());
    }
    let each: Vec<String> = all
        .iter()
        .enumerate()
        .map(|(r, &g)| format!("rank {r} {}", if g == 1 { "cuda" } else { "cpu" }))
        .collect();
    Err(TrainError::Config(format!(
        "the ranks train on different kinds of device ({}): set train.device (or XTRAIN_DEVICE) alike on every rank",
        each.join(", ")
    )))
}
