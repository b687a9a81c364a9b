// Shared helpers of the data-parallel integration tests (included with `mod common;`).
#![allow(dead_code)]
use model::optim::{clip_factor, grad_sq_sum, scale_grads, AdamW};
use parallel::engine::{DataParallel, DpConfig, StepStats};
use parallel::memory::{Precision, ZeroStage};
use parallel::sampler::DistributedSampler;
use parallel::staged::StagedModel;
use parallel::testing::ToyModel;

pub fn toy() -> ToyModel {
    // 12*6 + 3*(36+6) + 6*10 = 258 parameters: not a multiple of 4, so shards are padded.
    ToyModel::new(12, 6, 3, 10)
}

pub fn config(stage: ZeroStage) -> DpConfig {
    DpConfig {
        stage,
        // 40 elements: several buckets, cutting across units.
        bucket_bytes: 160,
        adamw: AdamW {
            lr: 2e-2,
            ..AdamW::default()
        },
        precision: Precision::Fp32,
        max_grad_norm: Some(0.5),
    }
}

/// The single-process reference: each step one forward/backward over the whole global batch
/// with the full parameters, clipping and AdamW. Returns (losses, grad norms, final parameters).
pub fn reference(
    model: &ToyModel,
    cfg: &DpConfig,
    global: usize,
    steps: usize,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let mut p = model.init(7);
    let (mut m, mut v) = (vec![0.0; p.len()], vec![0.0; p.len()]);
    let units = model.units();
    let mut losses = Vec::new();
    let mut norms = Vec::new();
    for step in 0..steps {
        let batch = model.samples(step * global, global);
        let mut x = None;
        let mut caches = Vec::new();
        for (u, r) in units.iter().enumerate() {
            let (y, c) = model
                .forward(u, &p[r.clone()], x.take(), &batch, 1.0)
                .unwrap();
            caches.push(c);
            x = Some(y);
        }
        losses.push(model.loss(x.as_ref().unwrap()));
        let mut g = vec![0.0; p.len()];
        let mut dy = None;
        for (u, r) in units.iter().enumerate().rev() {
            dy = model
                .backward(
                    u,
                    &p[r.clone()],
                    caches.pop().unwrap(),
                    dy.take(),
                    1.0,
                    &mut g[r.clone()],
                )
                .unwrap();
        }
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
    cfg: &DpConfig,
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
        let mut e = DataParallel::new(model.clone(), group, cfg.clone(), &model.init(7)).unwrap();
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

/// The single-process reference for the decoders: `steps` steps, each over global batch rows
/// `step·global..` as `n_micro` accumulated micro-batches, then clipping and AdamW from `cfg`.
/// Returns (losses, final parameters).
pub fn llm_reference(
    model: &model::Model,
    cfg: &DpConfig,
    global: usize,
    steps: usize,
    n_micro: usize,
) -> (Vec<f32>, Vec<f32>) {
    let mut p = model.init_params(3);
    let (mut m, mut v) = (vec![0.0; p.len()], vec![0.0; p.len()]);
    let micro = global / n_micro;
    let mut losses = Vec::new();
    for step in 0..steps {
        let mut g = vec![0.0; p.len()];
        let mut loss = 0.0;
        for a in 0..n_micro {
            let b = rows(&model.cfg, step * global + a * micro, micro);
            let opts = model::StepOptions {
                loss_scale: 1.0 / n_micro as f32,
                ..model::StepOptions::default()
            };
            loss += model
                .forward_backward(&p, &mut g, &b, &opts, &mut |_| {})
                .unwrap()
                .loss
                / n_micro as f32;
        }
        losses.push(loss);
        let (_, coef) = clip_factor(grad_sq_sum(&g), cfg.max_grad_norm.unwrap());
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
    (losses, p)
}
