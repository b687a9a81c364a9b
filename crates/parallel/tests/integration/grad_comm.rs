//! Compressed gradient communication (`train.grad_comm` = bf16 / fp8) in the executor: after a
//! step, every rank's reduced gradients (the whole buffer at ZeRO-0/1, its shard at ZeRO-2/3)
//! equal the mean of the ranks' own gradients within the error the format allows — and the
//! same runs in fp32 are exact to fp32 rounding, so the bound is not loose enough to hide a
//! wrong reduction (a missing rank, a wrong factor, a piece sent to the wrong rank).
//!
//! The bound, per element `i`, for ranks' gradients `g_r`: every rank's value is rounded once
//! on the wire and the fp32 sum once more, each rounding to nearest in its format —
//! bf16: at most `2^-8·|x|`; fp8 (E4M3 with a per-piece scale `s = max|piece| / 448`): at most
//! `max(2^-4·|x|, 2^-10·s)` (normals have 3 mantissa bits; subnormals are steps of `2^-9·s`),
//! with `s ≤ max|g_r| / 448`. Divided by n for the mean; plus fp32 slack.
use crate::common::*;
use parallel::data_parallel::grad_comm::GradComm;
use parallel::data_parallel::sampler::DistributedSampler;
use parallel::data_parallel::ZeroStage;
use parallel::executor::Executor;
use parallel::testing::ToyModel;

const GLOBAL: usize = 12;

/// Rank `r`'s own gradient of step 0 (a single process over its samples).
fn own_grad(model: &ToyModel, samples: std::ops::Range<usize>) -> Vec<f32> {
    let batch = model.samples(samples.start, samples.len());
    model.loss_and_grads(&model.init(7), &batch).1
}

/// One step at `dp`, `zero`, `comm`: each rank's reduced gradients with their flat offset,
/// and the bytes rank 0 sent over the dp group.
fn reduced(
    model: &ToyModel,
    dp: usize,
    zero: ZeroStage,
    comm: GradComm,
) -> (Vec<(usize, Vec<f32>)>, u64) {
    let mut cfg = config(zero);
    cfg.grad_comm = comm;
    cfg.max_grad_norm = None;
    let sampler = DistributedSampler::new(dp, GLOBAL / dp, 1).unwrap();
    let out = comm::testing::run_threads(dp, |c| {
        let group = c.world().clone();
        let rank = group.rank();
        let mut e =
            Executor::from_params(model.clone(), group, cfg.clone(), &model.init(7)).unwrap();
        let r = sampler.samples(0, rank, 0);
        let stats = e.train_step(&[model.samples(r.start, r.len())]).unwrap();
        let at = if zero.shards_grads() {
            e.spec().range(rank).start
        } else {
            0
        };
        ((at, e.local_grads().unwrap()), stats.dp_bytes_sent)
    });
    let bytes = out[0].1;
    (out.into_iter().map(|(g, _)| g).collect(), bytes)
}

#[test]
fn compressed_reductions_are_the_mean_within_the_format() {
    let model = toy();
    for dp in [2, 3] {
        let sampler = DistributedSampler::new(dp, GLOBAL / dp, 1).unwrap();
        let own: Vec<Vec<f32>> = (0..dp)
            .map(|r| own_grad(&model, sampler.samples(0, r, 0)))
            .collect();
        let n = model.num_params();
        let mean: Vec<f32> = (0..n)
            .map(|i| own.iter().map(|g| g[i]).sum::<f32>() / dp as f32)
            .collect();
        let amax = own.iter().flatten().fold(0.0f32, |m, v| m.max(v.abs()));
        for k in 0..4 {
            let zero = ZeroStage::from_index(k).unwrap();
            let mut fp32_bytes = 0;
            for comm in [GradComm::Fp32, GradComm::Bf16, GradComm::Fp8] {
                let round = |x: f32| match comm {
                    GradComm::Fp32 => x.abs() * 2f32.powi(-23),
                    GradComm::Bf16 => x.abs() * 2f32.powi(-8),
                    GradComm::Fp8 => (x.abs() * 2f32.powi(-4)).max(amax / 448.0 * 2f32.powi(-10)),
                    GradComm::PowerSgd { .. } => unreachable!("tests/powersgd.rs"),
                };
                let (got, bytes) = reduced(&model, dp, zero, comm);
                for (rank, (at, g)) in got.iter().enumerate() {
                    for (j, &v) in g.iter().enumerate() {
                        let i = at + j;
                        if i >= n {
                            assert_eq!(v, 0.0, "padding");
                            continue;
                        }
                        let inputs: f32 = own.iter().map(|g| round(g[i])).sum();
                        let sum: f32 = own.iter().map(|g| g[i]).sum();
                        let bound = (inputs + round(sum)) / dp as f32 + 4.0 * f32::EPSILON * amax;
                        assert!(
                            (v - mean[i]).abs() <= bound,
                            "{comm:?} zero={k} dp={dp} rank {rank} element {i}: {v} vs {} (bound {bound:e})",
                            mean[i]
                        );
                    }
                }
                match comm {
                    GradComm::Fp32 => fp32_bytes = bytes,
                    _ => assert!(
                        bytes < fp32_bytes,
                        "{comm:?} zero={k}: {bytes} bytes vs fp32's {fp32_bytes}"
                    ),
                }
            }
        }
    }
}
