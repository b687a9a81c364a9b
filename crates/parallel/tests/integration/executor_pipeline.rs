//! The executor driven by pipeline schedules: the toy model cut into stages over pp ranks, with
//! dp ranks beside them, trains to the single-process run's losses, gradient norms and
//! parameters (fp32, 1e-5 relative) under every generated schedule (GPipe, 1F1B, interleaved,
//! ZB-H1, ZB-H2, ZB-V, DualPipeV, DualPipe with its two copies of the model) at pp 2 and 4
//! with m = p, 2p and an odd count (DualPipe: even counts), composed with every ZeRO stage at
//! dp = 2 (ZeRO-3 with the lowering's UNSHARD / RESHARD; DualPipe with ZeRO 0 and 1), and
//! with a schedule read back from its CSV form. A malformed schedule is an error naming the action.
use crate::common::*;
use comm::DeviceMesh;
use parallel::data_parallel::ZeroStage;
use parallel::executor::{Executor, Pipeline};
use parallel::pipeline_parallel::Action::{self, *};
use parallel::pipeline_parallel::{generate, lower, LowerOptions, Schedule, ScheduleKind};
use parallel::testing::ToyModel;

const STEPS: usize = 3;
/// Rows of one micro-batch.
const ROWS: usize = 2;

/// The toy model's units split over `splits` contiguous ranges (the first ranges one longer).
fn split_units(units: usize, splits: usize, i: usize) -> Vec<usize> {
    let (q, r) = (units / splits, units % splits);
    let start = i * q + i.min(r);
    (start..start + q + usize::from(i < r)).collect()
}

/// The executor of pp rank `pp_rank` of `sched` for the toy model (its stages' units taken
/// from [`split_units`]), over the pp group `ppg` and the gradient group `dpg`; with the global
/// units it holds, in its order.
fn pipeline_executor(
    c: &comm::Communicator,
    model: &ToyModel,
    sched: &Schedule,
    ppg: comm::ProcessGroup,
    pp_rank: usize,
    dpg: comm::ProcessGroup,
    zero: ZeroStage,
) -> (Executor<ToyModel>, Vec<usize>) {
    use parallel::stage::StageModel;
    let n_units = model.units().len();
    let mut units = Vec::new();
    let mut local = Vec::new();
    for s in sched.local_stages(pp_rank) {
        let us = split_units(n_units, sched.stage_splits(), sched.stage_split(s));
        local.push((s, units.len()..units.len() + us.len()));
        units.extend(us);
    }
    let view = model.stage(&units);
    let init = view.init_held(7);
    let mut pipe = Pipeline::connect(c, ppg, sched.stage_rank.clone(), local, |s| {
        sched.next_stage(s).is_some()
    })
    .unwrap();
    pipe.replicas = sched.replicas(pp_rank).len();
    pipe.first_chain_end = sched.chains[0].stages.end;
    let e = Executor::new(view, dpg, Some(pipe), config(zero), |r, out| {
        out.copy_from_slice(&init[r])
    })
    .unwrap();
    (e, units)
}

/// Trains `STEPS` steps of `model` on a `[pp, dp]` mesh under the lowered `sched`, each step
/// over a global batch of `m · dp · ROWS` rows. Returns (losses, grad norms, full parameters).
fn run(
    model: &ToyModel,
    sched: &Schedule,
    dp: usize,
    zero: ZeroStage,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    use parallel::stage::StageModel;
    let pp = sched.num_ranks();
    let m = sched.num_microbatches();
    let global = m * dp * ROWS;
    let out = comm::testing::run_threads(pp * dp, |c| {
        let mesh = DeviceMesh::new(&c, &[("pp", pp), ("dp", dp)]).unwrap();
        let (pp_rank, dp_rank) = (mesh.coord("pp").unwrap(), mesh.coord("dp").unwrap());
        let (ppg, dpg) = (mesh.group(&["pp"]).unwrap(), mesh.group(&["dp"]).unwrap());
        // Ranks holding the same layers (DualPipe) average their gradients with the dp ranks.
        let replicas = sched.replicas(pp_rank);
        let dpg = if replicas.len() > 1 {
            let mut ranks: Vec<usize> = replicas
                .iter()
                .flat_map(|&q| (0..dp).map(move |d| q * dp + d))
                .collect();
            ranks.sort_unstable();
            c.new_group(&ranks).unwrap()
        } else {
            dpg
        };
        let (mut e, units) = pipeline_executor(&c, model, sched, ppg, pp_rank, dpg, zero);
        let mut stats = Vec::new();
        for step in 0..STEPS {
            let batches: Vec<_> = (0..m)
                .map(|a| model.samples(step * global + (a * dp + dp_rank) * ROWS, ROWS))
                .collect();
            stats.push(e.run_step(&batches, &sched.actions[pp_rank]).unwrap());
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
    let sizes: Vec<usize> = model.units().iter().map(|r| r.len()).collect();
    let mut params = vec![f32::NAN; model.num_params()];
    for o in out.iter().filter(|o| o.1 == 0) {
        let mut at = 0;
        for &g in &o.3 {
            let start: usize = sizes[..g].iter().sum();
            params[start..start + sizes[g]].copy_from_slice(&o.4[at..at + sizes[g]]);
            at += sizes[g];
        }
    }
    assert!(
        params.iter().all(|p| !p.is_nan()),
        "every unit runs somewhere"
    );
    let losses = out[0].2.iter().map(|s| s.loss).collect();
    let norms = out[0].2.iter().map(|s| s.grad_norm).collect();
    (losses, norms, params)
}

fn check(
    what: &str,
    model: &ToyModel,
    global: usize,
    got: (Vec<f32>, Vec<f32>, Vec<f32>),
    zero: ZeroStage,
) {
    let (losses, norms, params) = reference(model, &config(zero), global, STEPS);
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

/// The toy model with enough blocks for `stages` stages.
fn toy_for(stages: usize) -> ToyModel {
    ToyModel::new(12, 6, stages.max(3), 10)
}

/// Generates, lowers and trains `kind` at `pp`, `m`, `dp`, `zero`, checking it against the
/// single process.
fn train_and_check(kind: ScheduleKind, pp: usize, m: usize, v: usize, dp: usize, zero: ZeroStage) {
    let compute = generate(kind, pp, m, v).unwrap();
    let opts = LowerOptions {
        unshard: zero == ZeroStage::Three,
    };
    let sched = lower(&compute, opts).unwrap();
    let model = toy_for(sched.stage_splits());
    let got = run(&model, &sched, dp, zero);
    let what = format!("{} pp={pp} m={m} v={v} dp={dp} zero={zero:?}", kind.name());
    check(&what, &model, m * dp * ROWS, got, zero);
}

#[test]
fn every_schedule_matches_the_single_process() {
    for kind in ScheduleKind::ALL {
        for pp in [2, 4] {
            let v = if kind == ScheduleKind::Interleaved {
                2
            } else {
                1
            };
            let mut counts = vec![pp, 2 * pp, 2 * pp + 1];
            if kind == ScheduleKind::Interleaved {
                counts = vec![pp, 2 * pp, 3 * pp]; // multiples of pp only
            }
            if kind == ScheduleKind::DualPipeV {
                counts = vec![2 * pp, 2 * pp + 1, 4 * pp]; // at least 2·pp
            }
            if kind == ScheduleKind::DualPipe {
                counts = vec![2 * pp, 2 * pp + 2, 4 * pp]; // even, at least 2·pp
            }
            for m in counts {
                train_and_check(kind, pp, m, v, 1, ZeroStage::Ddp);
            }
        }
    }
}

#[test]
fn pipeline_schedules_compose_with_every_zero_stage() {
    for k in 0..4 {
        let zero = ZeroStage::from_index(k).unwrap();
        train_and_check(ScheduleKind::OneFOneB, 2, 4, 1, 2, zero);
        train_and_check(ScheduleKind::ZbV, 2, 3, 1, 2, zero);
    }
    train_and_check(ScheduleKind::Interleaved, 2, 4, 2, 2, ZeroStage::Three);
    // DualPipe's two copies of every layer average their gradients with the dp ranks'.
    for k in 0..2 {
        train_and_check(
            ScheduleKind::DualPipe,
            2,
            4,
            1,
            2,
            ZeroStage::from_index(k).unwrap(),
        );
        train_and_check(
            ScheduleKind::DualPipe,
            4,
            8,
            1,
            2,
            ZeroStage::from_index(k).unwrap(),
        );
    }
    train_and_check(ScheduleKind::ZbH1, 2, 5, 1, 2, ZeroStage::Two);
}

#[test]
fn a_schedule_read_back_from_csv_trains_the_same() {
    let sched = lower(
        &generate(ScheduleKind::ZbH2, 2, 4, 1).unwrap(),
        LowerOptions::default(),
    )
    .unwrap();
    let back = Schedule::from_csv(&sched.to_csv()).unwrap();
    assert_eq!(back.actions, sched.actions);
    let model = toy_for(2);
    let a = run(&model, &sched, 1, ZeroStage::Ddp);
    let b = run(&model, &back, 1, ZeroStage::Ddp);
    assert_eq!(a, b, "bit-identical");
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

#[test]
fn a_silent_pipeline_peer_is_named_with_the_action_waiting_for_it() {
    // pp rank 1 never runs its schedule (stuck elsewhere, alive): pp rank 0 runs 1F1B's warm-up
    // forward and then waits for the gradient of micro-batch 0, until the timeout names the
    // action, the stage, the micro-batch and the peer.
    let model = toy_for(2);
    let sched = lower(
        &generate(ScheduleKind::OneFOneB, 2, 2, 1).unwrap(),
        LowerOptions::default(),
    )
    .unwrap();
    let options = comm::Options {
        timeout: std::time::Duration::from_millis(1500),
        ..comm::Options::default()
    };
    let errs = comm::testing::run_threads_with(2, options, |c| {
        let r = c.rank();
        let solo = c.new_group(&[r]).unwrap();
        let (mut e, _) = pipeline_executor(
            &c,
            &model,
            &sched,
            c.world().clone(),
            r,
            solo,
            ZeroStage::Ddp,
        );
        if r == 1 {
            std::thread::sleep(std::time::Duration::from_millis(3000));
            return String::new();
        }
        let batches: Vec<_> = (0..2).map(|a| model.samples(a * ROWS, ROWS)).collect();
        let t = std::time::Instant::now();
        let err = e
            .run_step(&batches, &sched.actions[0])
            .unwrap_err()
            .to_string();
        assert!(
            t.elapsed() < std::time::Duration::from_secs(3),
            "within the timeout"
        );
        err
    });
    let e = &errs[0];
    for want in ["0B0", "gradient of stage 0, micro-batch 0", "pp rank 1"] {
        assert!(e.contains(want), "{e} (wanted {want})");
    }
}

#[test]
fn the_executed_order_is_the_schedule() {
    // The executor's trace lists every action of a step, in the schedule's order, on every
    // rank (ZB-V: two stages per rank, sends, receives, deferred W, reductions, optimizer).
    use parallel::executor::TraceKind;
    let sched = lower(
        &generate(ScheduleKind::ZbV, 2, 4, 1).unwrap(),
        LowerOptions::default(),
    )
    .unwrap();
    let model = toy_for(sched.stage_splits());
    let traced = comm::testing::run_threads(2, |c| {
        let r = c.rank();
        let solo = c.new_group(&[r]).unwrap();
        let (mut e, _) = pipeline_executor(
            &c,
            &model,
            &sched,
            c.world().clone(),
            r,
            solo,
            ZeroStage::Ddp,
        );
        e.enable_trace();
        let batches: Vec<_> = (0..4).map(|a| model.samples(a * ROWS, ROWS)).collect();
        e.run_step(&batches, &sched.actions[r]).unwrap();
        e.take_trace()
            .into_iter()
            .filter_map(|t| match t.kind {
                TraceKind::Action { action, .. } => Some(action),
                _ => None,
            })
            .collect::<Vec<Action>>()
    });
    for (r, got) in traced.iter().enumerate() {
        assert_eq!(got, &sched.actions[r], "rank {r}");
    }
}
