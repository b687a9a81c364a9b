//! Document masking through the one path (`parallelize` → executor), Llama with GQA and a
//! Mixtral-style MoE (auxiliary loss on): the same packed batches
//! (several documents per row, block-causal attention, positions restarting per document) at
//! cp 2 (ring and all-gather, zigzag and striped), tp 2 (± sp), pp 2 and cp × tp against the
//! single process. fp32, one step: the loss, the gradient norm and the parameters after AdamW
//! within 1e-5 relative, and every gradient tensor within 1e-6 of the largest gradient element
//! (f32 rounding of reordered sums). That the single process's packed batch equals each
//! document run alone is the model crate's `documents` test; together: every layout equals
//! the documents run separately.
use model::{Model, ModelConfig};
use parallel::context_parallel::{CpBalance, CpComm};
use parallel::data_parallel::ZeroStage;
use parallel::pipeline_parallel::{generate, ScheduleKind};
use parallel::{ModelOptions, ParallelDims, Precision};

use crate::common::*;

const GLOBAL: usize = 4;
const ACCUM: usize = 2;

#[derive(Clone, Copy, Debug)]
struct Layout {
    cp: usize,
    balance: CpBalance,
    comm: CpComm,
    tp: usize,
    sp: bool,
    pp: usize,
}

const ONE: Layout = Layout {
    cp: 1,
    balance: CpBalance::Zigzag,
    comm: CpComm::Ring,
    tp: 1,
    sp: false,
    pp: 1,
};

fn check(cfg: &ModelConfig, l: Layout) {
    let model = Model::new(cfg.clone()).unwrap();
    // No clipping: the gradients compared are the raw ones of the step.
    let mut exec = decoder_exec(ZeroStage::Ddp, Precision::Fp32);
    exec.max_grad_norm = None;
    let reference = llm_reference_rows(&model, exec.adamw, None, GLOBAL, 1, ACCUM, packed_rows);
    let dims = ParallelDims {
        pp: l.pp,
        cp: l.cp,
        tp: l.tp,
        sp: l.sp,
        ..Default::default()
    };
    let schedule = (l.pp > 1).then(|| generate(ScheduleKind::OneFOneB, l.pp, ACCUM, 1).unwrap());
    let opts = ModelOptions {
        cp_balance: l.balance,
        cp_comm: l.comm,
        ..ModelOptions::new(8)
    };
    let runs = train_decoder_rows(
        cfg,
        dims,
        &exec,
        GLOBAL,
        ACCUM,
        1,
        schedule.as_ref(),
        opts,
        packed_rows,
    );
    let what = format!("documents {l:?}");
    assert_first_step_gradients(&what, cfg, &runs, &reference);
    assert_matches_reference(&what, cfg, &runs, &reference, RankLosses::Within1e6);
}

#[test]
fn packed_documents_match_the_single_process_in_every_layout() {
    let cp = |balance, comm| Layout {
        cp: 2,
        balance,
        comm,
        ..ONE
    };
    for l in [
        cp(CpBalance::Zigzag, CpComm::Ring),
        cp(CpBalance::Zigzag, CpComm::AllGather),
        cp(CpBalance::Striped, CpComm::Ring),
        Layout { tp: 2, ..ONE },
        Layout {
            tp: 2,
            sp: true,
            ..ONE
        },
        Layout { pp: 2, ..ONE },
        Layout {
            tp: 2,
            ..cp(CpBalance::Zigzag, CpComm::AllGather)
        },
    ] {
        for cfg in [llama(), moe()] {
            check(&cfg, l);
        }
    }
}

/// The mask is not a no-op here either: the packed batches without their documents give
/// another loss.
#[test]
fn the_documents_change_the_loss() {
    let m = Model::new(llama()).unwrap();
    let p = m.init_params(3);
    let b = packed_rows(&m.cfg, 0, 2);
    let plain = model::Batch {
        docs: None,
        ..b.clone()
    };
    let (a, c) = (
        m.forward_loss(&p[..], &b).unwrap().loss,
        m.forward_loss(&p[..], &plain).unwrap().loss,
    );
    assert!((a - c).abs() > 1e-4, "{a} {c}");
}
