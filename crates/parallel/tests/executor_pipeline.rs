//! The executor driven by pipeline schedules (written out by hand here; the generators are the
//! pipeline-parallel issue's): the toy model split into stages over pp ranks, with dp ranks
//! beside them, trains to the single-process run's losses, gradient norms and parameters
//! (fp32, 1e-5 relative). Covered: GPipe with fused backward and with the backward split into
//! input and weight gradients (zero-bubble's B / W), every ZeRO stage at dp = 2, and a V-shaped
//! assignment (stages 0 and 3 on one rank, 1 and 2 on the other, handing activations over
//! locally). A malformed schedule is an error naming the action.
mod common;
use comm::DeviceMesh;
use common::*;
use parallel::data_parallel::ZeroStage;
use parallel::executor::{Executor, Pipeline};
use parallel::pipeline_parallel::Action::{self, *};
use parallel::testing::ToyModel;

const GLOBAL: usize = 8;
const STEPS: usize = 4;

/// GPipe for pipeline stage `s` of `n`: every forward, then every backward (fused, or input
/// gradients first and the weight gradients at the end).
fn gpipe(s: usize, n: usize, m: usize, split: bool) -> Vec<Action> {
    let mut out = Vec::new();
    for mb in 0..m {
        if s > 0 {
            out.push(RecvForward { stage: s, mb });
        }
        out.push(Forward { stage: s, mb });
        if s + 1 < n {
            out.push(SendForward { stage: s, mb });
        }
    }
    for mb in 0..m {
        if s + 1 < n {
            out.push(RecvBackward { stage: s, mb });
        }
        out.push(if split {
            BackwardInput { stage: s, mb }
        } else {
            Backward { stage: s, mb }
        });
        if s > 0 {
            out.push(SendBackward { stage: s, mb });
        }
    }
    if split {
        out.extend((0..m).map(|mb| BackwardWeight { stage: s, mb }));
    }
    out.push(ReduceGrad { stage: s });
    out.push(Optimizer);
    out
}

/// Trains `STEPS` steps on a `[pp, dp]` mesh; `stages[r]` are the global units of each stage
/// pp rank `r` runs, `stage_rank` which pp rank runs each stage, `schedule(r, m)` pp rank
/// `r`'s actions for `m` micro-batches. Returns (losses, grad norms, full parameters).
fn run(
    stages: &[Vec<(usize, Vec<usize>)>],
    stage_rank: &[usize],
    dp: usize,
    zero: ZeroStage,
    accum: usize,
    schedule: &(dyn Fn(usize, usize) -> Vec<Action> + Sync),
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let model = toy();
    let pp = stages.len();
    let out = comm::testing::run_threads(pp * dp, |c| {
        let mesh = DeviceMesh::new(&c, &[("pp", pp), ("dp", dp)]).unwrap();
        let (pp_rank, dp_rank) = (mesh.coord("pp").unwrap(), mesh.coord("dp").unwrap());
        let (ppg, dpg) = (mesh.group(&["pp"]).unwrap(), mesh.group(&["dp"]).unwrap());
        let mut units = Vec::new();
        let mut local = Vec::new();
        for (id, us) in &stages[pp_rank] {
            local.push((*id, units.len()..units.len() + us.len()));
            units.extend(us);
        }
        let view = model.stage(&units);
        let init = view.init_held(7);
        let pipe = Pipeline {
            group: ppg,
            stage_rank: stage_rank.to_vec(),
            local,
        };
        let mut e = Executor::new(view, dpg, Some(pipe), config(zero), |r, out| {
            out.copy_from_slice(&init[r])
        })
        .unwrap();
        let micro = GLOBAL / (dp * accum);
        let sched = schedule(pp_rank, accum);
        let mut stats = Vec::new();
        for step in 0..STEPS {
            let batches: Vec<_> = (0..accum)
                .map(|a| model.samples(step * GLOBAL + (a * dp + dp_rank) * micro, micro))
                .collect();
            stats.push(e.run_step(&batches, &sched).unwrap());
        }
        (pp_rank, dp_rank, stats, units, e.full_params().unwrap())
    });
    for o in &out {
        assert_eq!(
            o.2.iter().map(|s| s.loss).collect::<Vec<_>>(),
            out[0].2.iter().map(|s| s.loss).collect::<Vec<_>>(),
            "every rank reports the same losses"
        );
    }
    // The full parameters in global unit order, from dp rank 0 of each pp rank.
    let sizes: Vec<usize> = {
        use parallel::stage::StageModel;
        model.units().iter().map(|r| r.len()).collect()
    };
    let mut params = vec![f32::NAN; model.num_params()];
    for o in out.iter().filter(|o| o.1 == 0) {
        let mut at = 0;
        for &g in &o.3 {
            let start: usize = sizes[..g].iter().sum();
            params[start..start + sizes[g]].copy_from_slice(&o.4[at..at + sizes[g]]);
            at += sizes[g];
        }
    }
    let losses = out[0].2.iter().map(|s| s.loss).collect();
    let norms = out[0].2.iter().map(|s| s.grad_norm).collect();
    (losses, norms, params)
}

fn check(what: &str, got: (Vec<f32>, Vec<f32>, Vec<f32>), zero: ZeroStage) {
    let (losses, norms, params) = reference(&toy(), &config(zero), GLOBAL, STEPS);
    for s in 0..STEPS {
        assert!(
            (got.0[s] - losses[s]).abs() / losses[s].abs() < 1e-5,
            "{what} step {s}: loss {} vs {}",
            got.0[s],
            losses[s]
        );
        assert!(
            (got.1[s] - norms[s]).abs() / norms[s] < 1e-5,
            "{what} step {s}: grad norm {} vs {}",
            got.1[s],
            norms[s]
        );
    }
    let e = rel_err(&got.2, &params);
    assert!(e < 1e-5, "{what}: parameters differ by {e:e}");
}

/// Two stages on two pp ranks: embedding + block 1 | blocks 2, 3 + head.
fn two_stages() -> Vec<Vec<(usize, Vec<usize>)>> {
    vec![vec![(0, vec![0, 1])], vec![(1, vec![2, 3, 4])]]
}

#[test]
fn gpipe_matches_single_process_fused_and_split() {
    for split in [false, true] {
        let sched = move |r: usize, m: usize| gpipe(r, 2, m, split);
        let got = run(&two_stages(), &[0, 1], 1, ZeroStage::Ddp, 4, &sched);
        check(&format!("pp=2 split={split}"), got, ZeroStage::Ddp);
    }
}

#[test]
fn pipeline_composes_with_every_zero_stage() {
    for k in 0..4 {
        let zero = ZeroStage::from_index(k).unwrap();
        let sched = |r: usize, m: usize| gpipe(r, 2, m, true);
        let got = run(&two_stages(), &[0, 1], 2, zero, 2, &sched);
        check(&format!("pp=2 dp=2 zero={k}"), got, zero);
    }
}

#[test]
fn v_shaped_stages_hand_activations_over_locally() {
    // Stages 0 | 1 | 2 | 3 = embedding | block 1 | block 2 | block 3 + head; rank 0 runs 0 and 3,
    // rank 1 runs 1 and 2 (stage 1 hands its output to stage 2 on the same rank).
    let stages = vec![
        vec![(0, vec![0]), (3, vec![3, 4])],
        vec![(1, vec![1]), (2, vec![2])],
    ];
    let sched = |r: usize, m: usize| {
        let mut out = Vec::new();
        if r == 0 {
            for mb in 0..m {
                out.extend([Forward { stage: 0, mb }, SendForward { stage: 0, mb }]);
            }
            for mb in 0..m {
                out.extend([
                    RecvForward { stage: 3, mb },
                    Forward { stage: 3, mb },
                    Backward { stage: 3, mb },
                    SendBackward { stage: 3, mb },
                ]);
            }
            for mb in 0..m {
                out.extend([RecvBackward { stage: 0, mb }, Backward { stage: 0, mb }]);
            }
            out.extend([ReduceGrad { stage: 0 }, ReduceGrad { stage: 3 }]);
        } else {
            for mb in 0..m {
                out.extend([
                    RecvForward { stage: 1, mb },
                    Forward { stage: 1, mb },
                    Forward { stage: 2, mb },
                    SendForward { stage: 2, mb },
                ]);
            }
            for mb in 0..m {
                out.extend([
                    RecvBackward { stage: 2, mb },
                    Backward { stage: 2, mb },
                    Backward { stage: 1, mb },
                    SendBackward { stage: 1, mb },
                ]);
            }
            out.extend([ReduceGrad { stage: 1 }, ReduceGrad { stage: 2 }]);
        }
        out.push(Optimizer);
        out
    };
    for zero in [ZeroStage::Ddp, ZeroStage::Three] {
        let got = run(&stages, &[0, 1, 1, 0], 1, zero, 2, &sched);
        check(&format!("V zero={zero:?}"), got, zero);
    }
}

#[test]
fn malformed_schedules_are_errors_naming_the_action() {
    let model = toy();
    let errs = comm::testing::run_threads(1, |c| {
        let mut e = Executor::from_params(
            model.clone(),
            c.world().clone(),
            config(ZeroStage::Ddp),
            &model.init(7),
        )
        .unwrap();
        let b = vec![model.samples(0, 4)];
        let run =
            |e: &mut Executor<ToyModel>, s: &[Action]| e.run_step(&b, s).unwrap_err().to_string();
        vec![
            run(&mut e, &[Backward { stage: 0, mb: 0 }, Optimizer]),
            run(&mut e, &[Forward { stage: 0, mb: 0 }, Optimizer]),
            run(&mut e, &[Forward { stage: 1, mb: 0 }, Optimizer]),
            run(&mut e, &[Forward { stage: 0, mb: 3 }, Optimizer]),
            run(
                &mut e,
                &[Forward { stage: 0, mb: 0 }, Backward { stage: 0, mb: 0 }],
            ),
            run(&mut e, &[BackwardWeight { stage: 0, mb: 0 }, Optimizer]),
        ]
    })
    .remove(0);
    let want = [
        "0B0: no forward of this micro-batch came before",
        "no backward for the forward of stage 0, micro-batch 0",
        "1F0: stage 1 does not run on this rank",
        "0F3: micro-batch 3 of a step with 1",
        "ends with its one OPTIMIZER action",
        "0W0: no BACKWARD_INPUT of this micro-batch came before",
    ];
    for (e, w) in errs.iter().zip(want) {
        assert!(e.contains(w), "{e} (wanted {w})");
    }
}
