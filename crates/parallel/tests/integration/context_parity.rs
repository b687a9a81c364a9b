//! Context parallelism of the decoders through the one path (`parallelize` → executor),
//! against the single process on the same global batch: Llama with GQA and a Mixtral-style MoE
//! (shared expert, auxiliary loss over the whole sequences), cp ∈ {2, 4} under every balance
//! (zigzag, striped, none) with ring and all-gather attention, and cp composed with tp (± sp),
//! dp at ZeRO-3, and pipelines. fp32: every loss and gradient norm of 5 AdamW steps and every
//! parameter within 1e-5 relative; the full gradient of one step. Impossible splits are clear
//! errors.
use model::{Model, ModelConfig};
use parallel::context_parallel::{CpBalance, CpComm};
use parallel::data_parallel::ZeroStage;
use parallel::pipeline_parallel::{generate, ScheduleKind};
use parallel::{ModelOptions, ParallelDims, Precision};

use crate::common::*;

const STEPS: usize = 5;
const GLOBAL: usize = 8;

#[derive(Clone, Copy, Debug)]
struct Layout {
    cp: usize,
    balance: CpBalance,
    comm: CpComm,
    dp: usize,
    tp: usize,
    sp: bool,
    zero: usize,
    pp: usize,
}

fn cp(cp: usize, balance: CpBalance, comm: CpComm) -> Layout {
    Layout {
        cp,
        balance,
        comm,
        dp: 1,
        tp: 1,
        sp: false,
        zero: 0,
        pp: 1,
    }
}

/// Trains `l` on `cfg` for `steps` steps, clipping to `clip`; returns every rank's run and the
/// single-process reference.
fn run(cfg: &ModelConfig, l: Layout, steps: usize, clip: Option<f32>) -> (Vec<RankRun>, Reference) {
    let model = Model::new(cfg.clone()).unwrap();
    let zero = ZeroStage::from_index(l.zero).unwrap();
    let mut exec = decoder_exec(zero, Precision::Fp32);
    exec.max_grad_norm = clip;
    let accum = 2;
    let reference = llm_reference(&model, exec.adamw, clip, GLOBAL, steps, l.dp * accum);
    let dims = ParallelDims {
        pp: l.pp,
        dp: l.dp,
        cp: l.cp,
        tp: l.tp,
        sp: l.sp,
        zero,
        ..Default::default()
    };
    let schedule = (l.pp > 1).then(|| generate(ScheduleKind::OneFOneB, l.pp, accum, 1).unwrap());
    let opts = ModelOptions {
        cp_balance: l.balance,
        cp_comm: l.comm,
        ..ModelOptions::new(8)
    };
    let runs = train_decoder_opts(
        cfg,
        dims,
        &exec,
        GLOBAL,
        accum,
        steps,
        schedule.as_ref(),
        opts,
    );
    (runs, reference)
}

fn check(cfg: &ModelConfig, l: Layout) {
    let (runs, reference) = run(cfg, l, STEPS, Some(1.0));
    assert_matches_reference(
        &format!("{l:?}"),
        cfg,
        &runs,
        &reference,
        RankLosses::Within1e6,
    );
}

/// The full gradient of one step equals the single process's (1e-6 of its largest element):
/// ring and all-gather attention, zigzag and striped, cp 4, cp × tp + sp, cp × dp.
#[test]
fn first_step_gradients_match() {
    for cfg in [llama(), moe()] {
        for l in [
            cp(2, CpBalance::Zigzag, CpComm::Ring),
            cp(2, CpBalance::Striped, CpComm::AllGather),
            cp(4, CpBalance::Zigzag, CpComm::Ring),
            Layout {
                tp: 2,
                sp: true,
                ..cp(2, CpBalance::Zigzag, CpComm::Ring)
            },
            Layout {
                dp: 2,
                ..cp(2, CpBalance::Zigzag, CpComm::AllGather)
            },
        ] {
            let (runs, reference) = run(&cfg, l, 1, None);
            assert_first_step_gradients(&format!("{l:?}"), &cfg, &runs, &reference);
        }
    }
}

fn every_split() -> Vec<Layout> {
    let mut v = Vec::new();
    for n in [2, 4] {
        for balance in [CpBalance::Zigzag, CpBalance::Striped, CpBalance::None] {
            for comm in [CpComm::Ring, CpComm::AllGather] {
                v.push(cp(n, balance, comm));
            }
        }
    }
    v
}

#[test]
fn llama_every_context_split_matches_single_process() {
    for l in every_split() {
        check(&llama(), l);
    }
}

#[test]
fn moe_every_context_split_matches_single_process() {
    for l in every_split() {
        check(&moe(), l);
    }
}

#[test]
fn context_parallel_composes_with_tp_dp_zero3_and_pp() {
    let base = cp(2, CpBalance::Zigzag, CpComm::Ring);
    let layouts = [
        Layout { tp: 2, ..base },
        Layout {
            tp: 2,
            sp: true,
            ..base
        },
        Layout {
            dp: 2,
            zero: 3,
            ..base
        },
        Layout { pp: 2, ..base },
        Layout {
            dp: 2,
            tp: 2,
            zero: 1,
            ..base
        },
    ];
    for cfg in [llama(), moe()] {
        for l in layouts {
            check(&cfg, l);
        }
    }
}

#[test]
fn sequences_that_cannot_be_split_are_clear_errors() {
    let errs = comm::testing::run_threads(3, |c| {
        let dims = ParallelDims {
            cp: 3,
            ..Default::default()
        };
        let mesh = parallel::Mesh::new(&c, dims).unwrap();
        // 12 tokens split into 3 blocks but not into 6 zigzag chunks of equal length? 12 = 6·2:
        // use 9 (divisible by cp = 3, not by 2·cp).
        parallel::parallelize(&llama(), &mesh, &ModelOptions::new(9), None)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default()
    });
    assert!(
        errs[0].contains("zigzag needs seq_len divisible by 2·cp"),
        "{}",
        errs[0]
    );
}
