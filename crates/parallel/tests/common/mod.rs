// Shared helpers of the executor's integration tests (included with `mod common;`).
#![allow(dead_code)]
use model::optim::{clip_factor, grad_sq_sum, scale_grads, AdamW};
use parallel::data_parallel::sampler::DistributedSampler;
use parallel::data_parallel::ZeroStage;
use parallel::executor::{ExecConfig, Executor, StepStats};
use parallel::stage::StageModel;
use parallel::testing::ToyModel;
use parallel::Precision;

pub fn toy() -> ToyModel {
    // 12*6 + 3*(36+6) + 6*10 = 258 parameters: not a multiple of 4, so shards are padded.
    ToyModel::new(12, 6, 3, 10)
}

pub fn config(stage: ZeroStage) -> ExecConfig {
    ExecConfig {
        zero: stage,
        // 40 elements: several buckets, cutting across units.
        bucket_bytes: 160,
        adamw: AdamW {
            lr: 2e-2,
            ..AdamW::default()
        },
        precision: Precision::Fp32,
        max_grad_norm: Some(0.5),
        ..ExecConfig::default()
    }
}

/// The single-process reference: each step one forward/backward over the whole global batch
/// with the full parameters, clipping and AdamW. Returns (losses, grad norms, final parameters).
pub fn reference(
    model: &ToyModel,
    cfg: &ExecConfig,
    global: usize,
    steps: usize,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let mut p = model.init(7);
    let (mut m, mut v) = (vec![0.0; p.len()], vec![0.0; p.len()]);
    let mut losses = Vec::new();
    let mut norms = Vec::new();
    for step in 0..steps {
        let batch = model.samples(step * global, global);
        let (loss, mut g) = model.loss_and_grads(&p, &batch);
        losses.push(loss);
        let (norm, coef) = clip_factor(grad_sq_sum(&g), cfg.max_grad_norm.unwrap());
        norms.push(norm);
        scale_grads(&mut g, coef);
        let a = cfg.adamw;
        a.update(
            step as u64 + 1,
            a.lr,
            a.weight_decay,
            &mut p,
            &g,
            &mut m,
            &mut v,
        );
    }
    (losses, norms, p)
}

/// Runs `steps` steps on `dp` thread ranks; returns rank 0's (stats, final full parameters).
pub fn run_dp(
    model: &ToyModel,
    cfg: &ExecConfig,
    dp: usize,
    global: usize,
    accum: usize,
    steps: usize,
) -> (Vec<StepStats>, Vec<f32>) {
    let micro = global / (dp * accum);
    let sampler = DistributedSampler::new(dp, micro, accum).unwrap();
    assert_eq!(sampler.global_batch(), global);
    let out = comm::testing::run_threads(dp, |c| {
        let group = c.world().clone();
        let rank = group.rank();
        let mut e =
            Executor::from_params(model.clone(), group, cfg.clone(), &model.init(7)).unwrap();
        let mut stats = Vec::new();
        for step in 0..steps {
            let batches: Vec<_> = (0..accum)
                .map(|a| {
                    let r = sampler.samples(step, rank, a);
                    model.samples(r.start, r.len())
                })
                .collect();
            stats.push(e.train_step(&batches).unwrap());
        }
        (stats, e.full_params().unwrap())
    });
    out.into_iter().next().unwrap()
}

/// Max |a-b| / max |b|: relative error in the infinity norm.
pub fn rel_err(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    let scale = b.iter().fold(0.0f32, |m, x| m.max(x.abs())).max(1e-30);
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
        / scale
}

/// Rows `start..start + n` of a fixed pseudo-random token stream, 8 tokens each, as a
/// next-token batch for the decoders.
pub fn rows(cfg: &model::ModelConfig, start: usize, n: usize) -> model::Batch {
    const SEQ: usize = 8;
    let ids: Vec<u32> = (start * SEQ..(start + n) * SEQ)
        .map(|i| ((i as u64).wrapping_mul(0x9E3779B97F4A7C15) >> 40) as u32 % cfg.vocab_size as u32)
        .collect();
    model::Batch::next_token(n, SEQ, &ids).unwrap()
}

/// How a test turns global rows `start..start + n` into a micro-batch ([`rows`],
/// [`packed_rows`]).
pub type RowsFn = fn(&model::ModelConfig, usize, usize) -> model::Batch;

/// [`rows`] packed with documents: global row `r` opens a document at every position `p` with
/// `(p + r) % 3 == 0` (documents of 1 to 3 tokens, boundaries at a different offset in every
/// row, inside every context-parallel chunk), positions restarting per document, each token
/// predicting the next one of its own document ([`model::Batch::next_token_per_document`]).
pub fn packed_rows(cfg: &model::ModelConfig, start: usize, n: usize) -> model::Batch {
    let b = rows(cfg, start, n);
    let docs =
        model::Documents::from_openings(n, b.seq, true, |r, p| (p + start + r).is_multiple_of(3));
    model::Batch::next_token_per_document(&b.inputs, docs).unwrap()
}

/// What the single-process reference of the decoders gives per run.
pub struct Reference {
    /// The mean loss of every step.
    pub losses: Vec<f32>,
    /// The global gradient norm of every step, before clipping.
    pub grad_norms: Vec<f32>,
    /// The parameters after the last step.
    pub params: Vec<f32>,
    /// The gradient of the last step, after clipping (what the executor leaves in its
    /// gradient buffer).
    pub last_grads: Vec<f32>,
}

/// The single-process reference for the decoders: `steps` steps, each over global batch rows
/// `step·global..` as `n_micro` accumulated micro-batches, then clipping to `max_norm` (none
/// when `None`) and AdamW with `adamw`.
pub fn llm_reference(
    model: &model::Model,
    adamw: AdamW,
    max_norm: Option<f32>,
    global: usize,
    steps: usize,
    n_micro: usize,
) -> Reference {
    llm_reference_rows(model, adamw, max_norm, global, steps, n_micro, rows)
}

/// [`llm_reference`] over the micro-batches `rows` makes.
pub fn llm_reference_rows(
    model: &model::Model,
    adamw: AdamW,
    max_norm: Option<f32>,
    global: usize,
    steps: usize,
    n_micro: usize,
    rows: RowsFn,
) -> Reference {
    let run = ReferenceRun {
        adamw,
        max_norm,
        global,
        steps,
        n_micro,
        ..ReferenceRun::default()
    };
    run.train(model, rows)
}

/// The single-process reference's settings ([`llm_reference_rows`]), with what the plain
/// one leaves out: 16-bit storage and ZeRO-Offload's delayed update.
#[derive(Clone, Copy, Debug, Default)]
pub struct ReferenceRun {
    pub adamw: AdamW,
    pub max_norm: Option<f32>,
    pub global: usize,
    pub steps: usize,
    pub n_micro: usize,
    /// 16-bit storage: the forward reads the master rounded, the gradient is rounded (once:
    /// one micro-batch).
    pub storage: Option<parallel::precision::Half>,
    /// The update of every AdamW step past this one applied at the next step's optimizer
    /// point, after that step's forward and backward.
    pub delayed_after: Option<u64>,
}

impl ReferenceRun {
    pub fn train(&self, model: &model::Model, rows: RowsFn) -> Reference {
        assert!(
            self.storage.is_none() || self.n_micro == 1,
            "16-bit storage rounds after each micro-batch: one here"
        );
        let adamw = self.adamw;
        let round = |x: &[f32]| -> Vec<f32> {
            match self.storage {
                Some(k) => x.iter().map(|&v| k.to_f32(k.from_f32(v))).collect(),
                None => x.to_vec(),
            }
        };
        let mut p = model.init_params(3);
        let (mut m, mut v) = (vec![0.0; p.len()], vec![0.0; p.len()]);
        let micro = self.global / self.n_micro;
        let mut losses = Vec::new();
        let mut grad_norms = Vec::new();
        let mut last_grads = Vec::new();
        let mut held: Option<(Vec<f32>, u64)> = None;
        for step in 0..self.steps {
            let weights = round(&p);
            let mut g = vec![0.0; p.len()];
            let mut loss = 0.0;
            for a in 0..self.n_micro {
                let b = rows(&model.cfg, step * self.global + a * micro, micro);
                let opts = model::StepOptions {
                    loss_scale: 1.0 / self.n_micro as f32,
                    ..model::StepOptions::default()
                };
                loss += model
                    .forward_backward(&weights, &mut g, &b, &opts, &mut |_| {})
                    .unwrap()
                    .loss
                    / self.n_micro as f32;
            }
            losses.push(loss);
            let mut g = round(&g);
            let sq = grad_sq_sum(&g);
            grad_norms.push(sq.sqrt() as f32);
            if let Some(max_norm) = self.max_norm {
                let (_, coef) = clip_factor(sq, max_norm);
                scale_grads(&mut g, coef);
            }
            let mut update = |g: &[f32], t: u64| {
                adamw.update(t, adamw.lr, adamw.weight_decay, &mut p, g, &mut m, &mut v)
            };
            if let Some((g, t)) = held.take() {
                update(&g, t);
            }
            let t = step as u64 + 1;
            if self.delayed_after.is_some_and(|n| t > n) {
                held = Some((g.clone(), t));
            } else {
                update(&g, t);
            }
            last_grads = g;
        }
        Reference {
            losses,
            grad_norms,
            params: p,
            last_grads,
        }
    }
}

/// Whether the ranks of a run must report bitwise equal losses ([`assert_matches_reference`]):
/// `Bitwise` where every rank receives the loss from the same reduction, `Within1e6` where
/// ranks sum partial losses in their own order (context parallelism).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum RankLosses {
    Bitwise,
    Within1e6,
}

/// A parallel run against the single process on the same global batch: every rank reports
/// rank 0's losses ([`RankLosses`]); every step's loss and global gradient norm within 1e-5
/// relative of the reference's (a wrong gradient scale such as a missing 1/cp moves the norm
/// by that factor, where AdamW's normalisation and clipping would hide it in the parameters);
/// every parameter within 1e-5 of the largest.
pub fn assert_matches_reference(
    what: &str,
    cfg: &model::ModelConfig,
    runs: &[RankRun],
    reference: &Reference,
    ranks: RankLosses,
) {
    let losses: Vec<f32> = runs[0].stats.iter().map(|s| s.loss).collect();
    for r in runs {
        let x: Vec<f32> = r.stats.iter().map(|s| s.loss).collect();
        match ranks {
            RankLosses::Bitwise => {
                assert_eq!(x, losses, "{what}: every rank reports the same losses")
            }
            RankLosses::Within1e6 => {
                for (a, b) in x.iter().zip(&losses) {
                    assert!(
                        (a - b).abs() / b.abs() < 1e-6,
                        "{what}: ranks disagree {x:?} {losses:?}"
                    );
                }
            }
        }
    }
    assert_eq!(losses.len(), reference.losses.len(), "{what}: steps");
    for (s, st) in runs[0].stats.iter().enumerate() {
        let (a, b) = (st.grad_norm, reference.grad_norms[s]);
        assert!(
            (a - b).abs() / b.abs() < 1e-5,
            "{what} step {s}: gradient norm {a} vs {b}"
        );
        let (a, b) = (losses[s], reference.losses[s]);
        assert!(
            (a - b).abs() / b.abs() < 1e-5,
            "{what} step {s}: loss {a} vs {b}"
        );
    }
    let params = assemble(cfg, runs, |r| &r.params);
    let err = rel_err(&params, &reference.params);
    assert!(err < 1e-5, "{what}: params differ by {err:e}");
}

/// The gradient the executor left after a one-step run at ZeRO-0 (gathered from every rank
/// through the placements) against the reference's, tensor by tensor: within 1e-6 of the
/// largest gradient element (f32 rounding of reordered sums: the measured differences are
/// 1e-7 to 2e-7 of it).
pub fn assert_first_step_gradients(
    what: &str,
    cfg: &model::ModelConfig,
    runs: &[RankRun],
    reference: &Reference,
) {
    assert_eq!(reference.losses.len(), 1, "{what}: a one-step reference");
    let g = &reference.last_grads;
    let gt = assemble(cfg, runs, |r| &r.grads);
    let scale = g.iter().fold(0.0f32, |m, x| m.max(x.abs()));
    let layout = model::ParamLayout::new(cfg);
    for e in &layout.entries {
        let err = e
            .view
            .of(&gt)
            .iter()
            .zip(e.view.of(g))
            .fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(
            err <= 1e-6 * scale,
            "{what} {}: first-step gradient differs by {:e} of the gradient scale",
            e.name,
            err / scale
        );
    }
}

/// One rank's results of [`train_decoder`].
pub struct RankRun {
    pub dp_rank: usize,
    pub stats: Vec<StepStats>,
    /// The rank's fp32 master parameters (its whole flat buffer).
    pub params: Vec<f32>,
    pub placements: Vec<parallel::placement::Placement>,
    pub memory: parallel::memory::MemoryAccount,
    pub grads: Vec<f32>,
    pub gathered: usize,
}

/// Trains the decoder `cfg` on the layout `dims` (ranks as threads) through `parallelize` and
/// the executor: `steps` steps, each over global batch rows `step·global..`, dp rank `d`
/// taking micro-batches `d·accum..(d+1)·accum` of `global / (dp·accum)` rows.
pub fn train_decoder(
    cfg: &model::ModelConfig,
    dims: parallel::ParallelDims,
    exec: &ExecConfig,
    global: usize,
    accum: usize,
    steps: usize,
) -> Vec<RankRun> {
    train_decoder_with(cfg, dims, exec, global, accum, steps, None)
}

/// [`train_decoder_with`] with the model options `opts` (context-parallel balance and
/// communication).
#[allow(clippy::too_many_arguments)]
pub fn train_decoder_opts(
    cfg: &model::ModelConfig,
    dims: parallel::ParallelDims,
    exec: &ExecConfig,
    global: usize,
    accum: usize,
    steps: usize,
    schedule: Option<&parallel::pipeline_parallel::Schedule>,
    opts: parallel::ModelOptions,
) -> Vec<RankRun> {
    train_decoder_rows(cfg, dims, exec, global, accum, steps, schedule, opts, rows)
}

/// [`train_decoder_opts`] over the micro-batches `rows` makes.
#[allow(clippy::too_many_arguments)]
pub fn train_decoder_rows(
    cfg: &model::ModelConfig,
    dims: parallel::ParallelDims,
    exec: &ExecConfig,
    global: usize,
    accum: usize,
    steps: usize,
    schedule: Option<&parallel::pipeline_parallel::Schedule>,
    opts: parallel::ModelOptions,
    rows: RowsFn,
) -> Vec<RankRun> {
    run_decoder(cfg, dims, exec, global, accum, steps, schedule, opts, rows)
}

/// [`train_decoder`] with pipeline parallelism: `schedule` is the compute-only schedule for
/// `dims.pp` ranks and `accum` micro-batches, lowered here (ZeRO-3 keeps each stage gathered
/// between its first and last action).
pub fn train_decoder_with(
    cfg: &model::ModelConfig,
    dims: parallel::ParallelDims,
    exec: &ExecConfig,
    global: usize,
    accum: usize,
    steps: usize,
    schedule: Option<&parallel::pipeline_parallel::Schedule>,
) -> Vec<RankRun> {
    let opts = parallel::ModelOptions::new(8);
    train_decoder_rows(cfg, dims, exec, global, accum, steps, schedule, opts, rows)
}

#[allow(clippy::too_many_arguments)]
fn run_decoder(
    cfg: &model::ModelConfig,
    dims: parallel::ParallelDims,
    exec: &ExecConfig,
    global: usize,
    accum: usize,
    steps: usize,
    schedule: Option<&parallel::pipeline_parallel::Schedule>,
    opts: parallel::ModelOptions,
    rows: RowsFn,
) -> Vec<RankRun> {
    use parallel::pipeline_parallel::{lower, LowerOptions};
    let lowered = schedule.map(|s| {
        let opts = LowerOptions {
            unshard: exec.zero == ZeroStage::Three,
        };
        lower(s, opts).unwrap()
    });
    comm::testing::run_threads(dims.world(), |c| {
        let mesh = parallel::Mesh::new(&c, dims).unwrap();
        let par = parallel::parallelize(cfg, &mesh, &opts, lowered.as_ref()).unwrap();
        let dp_rank = mesh.coord("dp").unwrap();
        let pp_rank = mesh.coord("pp").unwrap();
        let init = par.stage.clone();
        let mut e = Executor::new(par.stage, par.dp, par.pipe, exec.clone(), |r, out| {
            init.init_range(3, r, out)
        })
        .unwrap();
        let micro = global / (dims.dp * accum);
        let stats = (0..steps)
            .map(|s| {
                let batches: Vec<model::Batch> = (0..accum)
                    .map(|a| rows(cfg, s * global + (dp_rank * accum + a) * micro, micro))
                    .collect();
                match &lowered {
                    Some(l) => e.run_step(&batches, &l.actions[pp_rank]).unwrap(),
                    None => e.train_step(&batches).unwrap(),
                }
            })
            .collect();
        RankRun {
            dp_rank,
            stats,
            params: e.full_params().unwrap(),
            placements: e.model().placements(),
            memory: e.memory(),
            grads: e.local_grads().unwrap(),
            gathered: e.peak_gathered_bytes(),
        }
    })
}

/// The full model's buffer (its flat layout) from the ranks' buffers `pick` selects, through
/// their placements (each tensor block from the ranks that own it).
pub fn assemble(
    cfg: &model::ModelConfig,
    runs: &[RankRun],
    pick: impl Fn(&RankRun) -> &[f32],
) -> Vec<f32> {
    let layout = model::ParamLayout::new(cfg);
    let mut full = vec![f32::NAN; layout.total()];
    // Every rank's counted copies (replicas over dp hold the same values; expert-parallel
    // ranks are dp ranks holding different experts).
    for r in runs {
        let buf = pick(r);
        for p in r.placements.iter().filter(|p| p.owner) {
            let base = layout.get(&p.slice.name).unwrap().view.offset;
            for run in p.slice.runs(0..p.slice.numel()) {
                let src = p.start + run.slice;
                full[base + run.full..base + run.full + run.len]
                    .copy_from_slice(&buf[src..src + run.len]);
            }
        }
    }
    assert!(full.iter().all(|x| !x.is_nan()), "every element placed");
    full
}

/// The decoders' test models: Llama with GQA (4 query, 2 KV heads), and a Mixtral-style MoE
/// with a shared expert and the auxiliary loss on.
pub fn llama() -> model::ModelConfig {
    model::ModelConfig::llama(64, 32, 48, 2, 4, 2)
}

pub fn moe() -> model::ModelConfig {
    let mut cfg = llama().with_experts(4, 2);
    cfg.output_router_logits = true;
    cfg.router_aux_loss_coef = 0.05;
    cfg.shared_expert_intermediate_size = Some(16);
    cfg
}

/// The executor settings of the decoder tests at `zero` and `precision`. AdamW eps = 1e-5:
/// AdamW's first update lr·g/(|g| + eps) has sensitivity d(update)/dg = lr·eps/(|g| + eps)²,
/// up to lr/eps at g → 0, so gradient elements of order eps (MoE router / expert entries that
/// nearly cancel, an embedding row reached only through the auxiliary loss, |g| ≈ 9e-7)
/// amplify the f32 rounding of reordered sums (split matmuls, rank reductions): with
/// eps = 1e-8 one such element moved by 1.3e-5 of max|p| after a single step, with 1e-6 by
/// 9e-6; with 1e-5 the gain is at most 1e3 and every configuration stays below 5e-6.
pub fn decoder_exec(zero: ZeroStage, precision: Precision) -> ExecConfig {
    ExecConfig {
        zero,
        bucket_bytes: 16 * 1024,
        adamw: AdamW {
            lr: 1e-2,
            weight_decay: 0.1,
            eps: 1e-5,
            ..AdamW::default()
        },
        max_grad_norm: Some(1.0),
        precision,
        ..ExecConfig::default()
    }
}

/// What a toy executor's checkpoint records besides tensors, at data parallelism `dp` and
/// `stage` (with a `note.txt` file, and PowerSGD's error when the executor compresses so).
pub fn save_meta(
    dp: usize,
    stage: ZeroStage,
    e: &parallel::executor::Executor<ToyModel>,
) -> parallel::checkpoint::SaveMeta {
    use parallel::checkpoint::{MeshRecord, SaveMeta, TrainingState};
    SaveMeta {
        mesh: MeshRecord::from(&parallel::ParallelDims::data_parallel(dp, stage)),
        precision: parallel::Precision::Fp32,
        state: TrainingState {
            step: e.step_count(),
            tokens_seen: 0,
            data_seed: 0,
            adam_step: e.step_count(),
            loss_scaler: *e.loss_scaler(),
            router_bias: Vec::new(),
            grad_comm_error: e.has_powersgd(),
            pending_update: e.pending_update(),
        },
        files: vec![("note.txt".into(), b"toy".to_vec())],
    }
}
