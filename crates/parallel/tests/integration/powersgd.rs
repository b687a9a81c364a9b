//! PowerSGD (`parallel::data_parallel::powersgd`): the reduction of three ranks over three
//! steps (error feedback and warm start included) against a naive f64 reference of the
//! algorithm written from the paper's equations; a rank-1 gradient passing exactly; and in the
//! executor, a rank large enough that nothing compresses reproducing the single process (the
//! plumbing), and a compressing rank giving every rank the same gradients.
use crate::common::*;
use parallel::data_parallel::grad_comm::GradComm;
use parallel::data_parallel::powersgd::{initial_qs, BucketLayout, Matrix, PowerSgd};
use parallel::data_parallel::ZeroStage;

const SEED: u64 = 99;

fn layout() -> BucketLayout {
    BucketLayout {
        matrices: vec![
            Matrix {
                at: 5,
                n: 12,
                m: 10,
                r: 2,
            },
            Matrix {
                at: 5 + 120 + 3,
                n: 8,
                m: 16,
                r: 3,
            },
        ],
        exact: vec![0..5, 125..128],
    }
}

const LEN: usize = 5 + 120 + 3 + 128;

/// Pseudo-random values in [-1, 1) (full-rank matrices: a smooth function of the index
/// would make them rank 2, and the Gram-Schmidt of a vanishing column ill-conditioned).
fn input(rank: usize, step: usize) -> Vec<f32> {
    (0..LEN)
        .map(|i| {
            let h = ((i + 1000 * rank + 100_000 * step) as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
            ((h >> 40) as f32 / (1u64 << 23) as f32) - 1.0
        })
        .collect()
}

/// Gram-Schmidt in f64 (columns of a row-major [rows, cols] matrix), with PowerSGD's ε.
fn orth(a: &mut [f64], rows: usize, cols: usize) {
    for i in 0..cols {
        let norm: f64 = (0..rows)
            .map(|k| a[k * cols + i].powi(2))
            .sum::<f64>()
            .sqrt();
        for k in 0..rows {
            a[k * cols + i] /= norm + 1e-8;
        }
        for j in i + 1..cols {
            let d: f64 = (0..rows).map(|k| a[k * cols + i] * a[k * cols + j]).sum();
            for k in 0..rows {
                a[k * cols + j] -= d * a[k * cols + i];
            }
        }
    }
}

/// The algorithm for `ranks` ranks over `steps` steps, from the equations: returns each
/// step's result (the same for every rank).
fn reference(ranks: usize, steps: usize) -> Vec<Vec<f64>> {
    let l = layout();
    let mut qs: Vec<f64> = initial_qs(&l, SEED, 0).iter().map(|&v| v as f64).collect();
    let mut err = vec![vec![0.0f64; LEN]; ranks];
    let mut out = Vec::new();
    for step in 0..steps {
        let ms: Vec<Vec<f64>> = (0..ranks)
            .map(|r| {
                input(r, step)
                    .iter()
                    .zip(&err[r])
                    .map(|(&g, e)| g as f64 + e)
                    .collect()
            })
            .collect();
        let mut res = vec![0.0f64; LEN];
        for range in &l.exact {
            for i in range.clone() {
                res[i] = ms.iter().map(|m| m[i]).sum::<f64>() / ranks as f64;
            }
        }
        let mut qo = 0;
        for x in &l.matrices {
            let (n, m, r) = (x.n, x.m, x.r);
            let q = &mut qs[qo..qo + m * r];
            orth(q, m, r);
            let mut p = vec![0.0f64; n * r];
            for mm in &ms {
                for i in 0..n {
                    for c in 0..r {
                        p[i * r + c] += (0..m)
                            .map(|j| mm[x.at + i * m + j] * q[j * r + c])
                            .sum::<f64>();
                    }
                }
            }
            orth(&mut p, n, r);
            let mut qn = vec![0.0f64; m * r];
            for mm in &ms {
                for j in 0..m {
                    for c in 0..r {
                        qn[j * r + c] += (0..n)
                            .map(|i| mm[x.at + i * m + j] * p[i * r + c])
                            .sum::<f64>();
                    }
                }
            }
            qn.iter_mut().for_each(|v| *v /= ranks as f64);
            for i in 0..n {
                for j in 0..m {
                    res[x.at + i * m + j] = (0..r).map(|c| p[i * r + c] * qn[j * r + c]).sum();
                }
            }
            q.copy_from_slice(&qn);
            qo += m * r;
        }
        for r in 0..ranks {
            for i in 0..LEN {
                err[r][i] = ms[r][i] - res[i];
            }
        }
        out.push(res);
    }
    out
}

#[test]
fn reduction_matches_the_equations_over_steps() {
    let (ranks, steps) = (3, 3);
    let want = reference(ranks, steps);
    let got = comm::testing::run_threads(ranks, |c| {
        let g = c.world();
        let mut p = PowerSgd::new(4, SEED);
        (0..steps)
            .map(|s| {
                let mut buf = input(g.rank(), s);
                p.reduce(0, &layout(), &mut buf, g).unwrap();
                buf
            })
            .collect::<Vec<_>>()
    });
    for (rank, steps_out) in got.iter().enumerate() {
        for (s, (a, b)) in steps_out.iter().zip(&want).enumerate() {
            let scale = b.iter().fold(0.0f64, |m, v| m.max(v.abs()));
            let err = a
                .iter()
                .zip(b)
                .fold(0.0f64, |m, (&x, y)| m.max((x as f64 - y).abs()));
            assert!(
                err <= 1e-5 * scale,
                "rank {rank} step {s}: differs by {err:e} of {scale:e}"
            );
        }
        assert_eq!(steps_out, &got[0], "every rank holds the same result");
    }
}

#[test]
fn a_rank_one_gradient_passes_exactly() {
    let (n, m) = (12, 9);
    let l = BucketLayout {
        matrices: vec![Matrix { at: 0, n, m, r: 1 }],
        exact: vec![],
    };
    let mat: Vec<f32> = (0..n * m)
        .map(|k| ((k / m) as f32 - 5.5) * ((k % m) as f32 * 0.3 + 1.0))
        .collect();
    let out = comm::testing::run_threads(2, |c| {
        let mut p = PowerSgd::new(1, SEED);
        let mut buf = mat.clone();
        p.reduce(0, &l, &mut buf, c.world()).unwrap();
        (buf, p.error(0).unwrap().to_vec())
    });
    for (buf, err) in out {
        assert!(rel_err(&buf, &mat) < 1e-5, "rank-1 matrix reproduced");
        assert!(err.iter().all(|e| e.abs() < 1e-4), "no error left");
    }
}

#[test]
fn executor_plumbing_matches_the_single_process_when_nothing_compresses() {
    let model = toy();
    for zero in [ZeroStage::Ddp, ZeroStage::One] {
        let mut cfg = config(zero);
        // Rank 1000: no matrix of the toy model pays, so every tensor is reduced exactly.
        cfg.grad_comm = GradComm::PowerSgd {
            rank: 1000,
            start: 0,
        };
        let (ref_losses, ref_norms, ref_params) = reference_run(&model, &cfg);
        let (stats, params) = run_dp(&model, &cfg, 2, 8, 1, 4);
        for (s, st) in stats.iter().enumerate() {
            assert!(
                (st.loss - ref_losses[s]).abs() <= 1e-5 * ref_losses[s].abs(),
                "{zero:?} step {s} loss"
            );
            assert!(
                (st.grad_norm - ref_norms[s]).abs() <= 1e-5 * ref_norms[s],
                "{zero:?} step {s} norm"
            );
        }
        assert!(rel_err(&params, &ref_params) < 1e-5, "{zero:?} params");
    }
}

/// `powersgd:R:S`: the steps before S reduce exactly (the single process's losses, norms and
/// updates), the steps from S on compress (the parameters part from the reference).
#[test]
fn compression_starts_at_the_configured_step() {
    let model = toy();
    let mut cfg = config(ZeroStage::One);
    cfg.grad_comm = GradComm::PowerSgd { rank: 1, start: 3 };
    let (ref_losses, ref_norms, ref_params) = reference_run(&model, &cfg);
    let (stats, params) = run_dp(&model, &cfg, 2, 8, 1, 4);
    for s in 0..4 {
        // Steps 0..=3 see parameters updated with exact means: the same losses.
        assert!(
            (stats[s].loss - ref_losses[s]).abs() <= 1e-5 * ref_losses[s].abs(),
            "step {s} loss"
        );
    }
    for s in 0..3 {
        assert!(
            (stats[s].grad_norm - ref_norms[s]).abs() <= 1e-5 * ref_norms[s],
            "step {s} norm"
        );
    }
    // Step 3 reduces through rank 1: the norm of the reduced gradient is the compressed one's.
    assert!((stats[3].grad_norm - ref_norms[3]).abs() > 1e-4 * ref_norms[3]);
    assert!(
        rel_err(&params, &ref_params) > 1e-4,
        "step 3's rank-1 update must differ from the exact one"
    );
}

fn reference_run(
    model: &parallel::testing::ToyModel,
    cfg: &parallel::executor::ExecConfig,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    crate::common::reference(model, cfg, 8, 4)
}

#[test]
fn compressed_training_keeps_the_ranks_together_and_learns() {
    let model = toy();
    let mut cfg = config(ZeroStage::One);
    cfg.grad_comm = GradComm::PowerSgd { rank: 1, start: 0 };
    let out = {
        let sampler = parallel::data_parallel::sampler::DistributedSampler::new(2, 4, 1).unwrap();
        comm::testing::run_threads(2, |c| {
            let group = c.world().clone();
            let rank = group.rank();
            let mut e = parallel::executor::Executor::from_params(
                model.clone(),
                group,
                cfg.clone(),
                &model.init(7),
            )
            .unwrap();
            let mut losses = Vec::new();
            for step in 0..30 {
                let r = sampler.samples(step % 2, rank, 0);
                losses.push(
                    e.train_step(&[model.samples(r.start, r.len())])
                        .unwrap()
                        .loss,
                );
            }
            (losses, e.full_params().unwrap())
        })
    };
    assert_eq!(out[0].1, out[1].1, "both ranks hold the same parameters");
    let l = &out[0].0;
    assert!(l[29] < 0.8 * l[0], "loss {} -> {}", l[0], l[29]);
    // ZeRO-2 reduces shards: refused, naming the alternatives.
    let mut z2 = config(ZeroStage::Two);
    z2.grad_comm = GradComm::PowerSgd { rank: 1, start: 0 };
    let err = comm::testing::run_threads(2, |c| {
        parallel::executor::Executor::from_params(
            model.clone(),
            c.world().clone(),
            z2.clone(),
            &model.init(7),
        )
        .err()
        .map(|e| e.to_string())
    });
    assert!(
        err[0].as_deref().unwrap_or("").contains("ZeRO-0 or 1"),
        "{err:?}"
    );
}

/// The ranks' mean error feedback goes into the checkpoint and comes back on every rank, at the
/// saving layout and at another dp size (saved again at once, it is the same).
#[test]
fn error_feedback_survives_a_checkpoint_at_any_dp() {
    use parallel::checkpoint::{self, Checkpoint};
    use parallel::executor::Executor;
    let model = toy();
    let dir = std::env::temp_dir().join(format!("xtrain-powersgd-ck-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let cfg_for = |zero| {
        let mut c = config(zero);
        c.grad_comm = GradComm::PowerSgd { rank: 1, start: 0 };
        c
    };
    let errors = |pieces: Vec<parallel::checkpoint::SavedPiece>| -> Vec<f32> {
        pieces
            .into_iter()
            .flat_map(|p| p.grad_comm_error.unwrap())
            .collect()
    };
    let saved = comm::testing::run_threads(2, |c| {
        let group = c.world().clone();
        let rank = group.rank();
        let sampler = parallel::data_parallel::sampler::DistributedSampler::new(2, 4, 1).unwrap();
        let mut e = Executor::from_params(
            model.clone(),
            group,
            cfg_for(ZeroStage::One),
            &model.init(7),
        )
        .unwrap();
        for step in 0..3 {
            let r = sampler.samples(step, rank, 0);
            e.train_step(&[model.samples(r.start, r.len())]).unwrap();
        }
        let pieces = e.checkpoint_pieces().unwrap();
        checkpoint::save(&dir, c.world(), &pieces, &save_meta(2, ZeroStage::One, &e)).unwrap();
        errors(pieces)
    })
    .into_iter()
    .flatten()
    .collect::<Vec<f32>>();
    assert!(
        saved.iter().any(|&v| v != 0.0),
        "rank-1 PowerSGD leaves an error"
    );
    for (dp, zero) in [(2, ZeroStage::One), (3, ZeroStage::Ddp)] {
        let again = comm::testing::run_threads(dp, |c| {
            let mut e = Executor::from_params(
                model.clone(),
                c.world().clone(),
                cfg_for(zero),
                &model.init(7),
            )
            .unwrap();
            e.load_checkpoint(&mut Checkpoint::open(&dir).unwrap())
                .unwrap();
            errors(e.checkpoint_pieces().unwrap())
        })
        .into_iter()
        .flatten()
        .collect::<Vec<f32>>();
        // At dp 3 the mean of three equal values is (3x)·(1/3): within an ulp.
        assert!(
            rel_err(&again, &saved) <= 1e-6,
            "dp {dp}: {}",
            rel_err(&again, &saved)
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}
