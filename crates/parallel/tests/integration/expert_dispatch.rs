//! The expert-parallel MoE layer alone, ranks as threads, against the single-process layer on
//! each rank's own tokens: its output, its input gradient and the router's gradient equal the
//! single-process ones, and each expert's weight gradient (on the rank holding it) equals the
//! sum of the single-process layer's over every rank's tokens — for random (uneven) loads and
//! for a router that sends every token to experts 0 and 1, which leaves the other ranks'
//! experts empty. Also the bytes each rank sends per layer, from the communicator's statistics.
use model::layers::Buf;
use std::sync::Arc;

use comm::OpKind;
use model::layers::block::Ffn;
use model::layers::{Pass, WeightGradStore};
use model::{Model, ModelConfig};
use parallel::expert_parallel::EpExchange;
use parallel::tensor_parallel::TpPlan;

use crate::common::rel_err;

const T: usize = 12;

fn moe8() -> ModelConfig {
    let mut cfg = crate::common::llama().with_experts(8, 2);
    cfg.shared_expert_intermediate_size = Some(16);
    cfg.output_router_logits = true;
    cfg.router_aux_loss_coef = 0.05;
    cfg
}

fn rand(n: usize, seed: u64) -> Vec<f32> {
    let mut r = model::init::SplitMix64::new(seed);
    (0..n).map(|_| r.next_normal() as f32).collect()
}

struct Out {
    y: Vec<f32>,
    dx: Vec<f32>,
    grads: Vec<f32>,
    /// Rows this rank sent to others per direction, and the bytes it sent: in the rows'
    /// all-to-all-v and in the counts' all-to-all.
    bytes: u64,
    count_bytes: u64,
    rows_out: usize,
    rows_in: usize,
}

/// Runs block 0's MoE layer on `ep` ranks (rank r's tokens `x(r)`), optionally with a router
/// that prefers expert 0 overwhelmingly.
fn run(ep: usize, skewed: bool) -> (Vec<Out>, Vec<Vec<f32>>, Model, Vec<f32>) {
    let cfg = moe8();
    let full = Model::new(cfg.clone()).unwrap();
    let mut params = full.init_params(5);
    let h = cfg.hidden_size;
    if skewed {
        // logits = W_r·x: row 0 all ones, the rest zero, tokens positive: expert 0 first and
        // (ties in order) expert 1 second for every token.
        let v = full
            .layout
            .get("model.layers.0.mlp.gate.weight")
            .unwrap()
            .view
            .clone();
        let w = v.of_mut(&mut params);
        w.fill(0.0);
        w[..h].fill(1.0);
    }
    let x = |r: usize| -> Vec<f32> {
        let v = rand(T * h, 10 + r as u64);
        if skewed {
            v.iter().map(|a| a.abs() + 0.1).collect()
        } else {
            v
        }
    };
    let dy = |r: usize| rand(T * h, 100 + r as u64);
    let outs = comm::testing::run_threads(ep, |c| {
        let r = c.rank();
        let plan = TpPlan::with_experts(&cfg, 1, false, ep, r).unwrap();
        let mut local = plan.local_model().unwrap();
        let lp = plan.shard(&params, 0);
        let group = c.new_group(&(0..ep).collect::<Vec<_>>()).unwrap();
        let Ffn::Moe(m) = &mut local.blocks[0].ffn else {
            panic!("a MoE block")
        };
        m.exchange = Some(Arc::new(EpExchange::new(group.clone())));
        let p = &lp[local.layout.block_range(0)];
        let pass = Pass::new(1, T);
        let xr = Arc::new(Buf::Host(x(r)));
        let (y, cache) = m.forward(p, xr.as_host("test").unwrap(), &pass).unwrap();
        let rows_out: usize = (0..8)
            .filter(|&e| e / (8 / ep) != r)
            .map(|e| cache.routing.assigned[e].len())
            .sum();
        let rows_in: usize = cache
            .dispatch
            .as_ref()
            .unwrap()
            .received
            .iter()
            .enumerate()
            .filter(|(src, _)| *src != r)
            .map(|(_, c)| c.iter().sum::<usize>())
            .sum();
        let mut store = WeightGradStore::new();
        let dx = m
            .backward_input(p, &xr, cache, Arc::new(Buf::Host(dy(r))), &pass, &mut store)
            .unwrap();
        let mut g = vec![0.0; p.len()];
        store.apply(&mut g).unwrap();
        Out {
            y: y.into_vec().unwrap(),
            dx: dx.into_vec().unwrap(),
            grads: g,
            bytes: group.stats().bytes_sent(OpKind::AllToAllV),
            count_bytes: group.stats().bytes_sent(OpKind::AllToAll),
            rows_out,
            rows_in,
        }
    });
    let xs = (0..ep).map(x).collect();
    (outs, xs, full, params)
}

fn check(ep: usize, skewed: bool) {
    let (outs, xs, full, params) = run(ep, skewed);
    let cfg = moe8();
    let Ffn::Moe(m) = &full.blocks[0].ffn else {
        panic!()
    };
    let p = &params[full.layout.block_range(0)];
    let pass = Pass::new(1, T);
    let mut g_all = vec![0.0; p.len()];
    let what = format!("ep={ep} skewed={skewed}");
    let lay = |name: &str| {
        full.layout
            .get(name)
            .unwrap()
            .view
            .relative_to(full.layout.block_range(0).start)
    };
    let gate_up = lay("model.layers.0.mlp.experts.gate_up_proj");
    let down = lay("model.layers.0.mlp.experts.down_proj");
    let router = lay("model.layers.0.mlp.gate.weight");
    for (r, o) in outs.iter().enumerate() {
        let xr = Arc::new(Buf::Host(xs[r].clone()));
        let (y, cache) = m.forward(p, xr.as_host("test").unwrap(), &pass).unwrap();
        assert!(
            rel_err(&o.y, y.as_host("test").unwrap()) < 1e-6,
            "{what} rank {r}: output"
        );
        let mut store = WeightGradStore::new();
        let dy = rand(T * cfg.hidden_size, 100 + r as u64);
        let dx = m
            .backward_input(p, &xr, cache, Arc::new(Buf::Host(dy)), &pass, &mut store)
            .unwrap();
        assert!(
            rel_err(&o.dx, dx.as_host("test").unwrap()) < 1e-6,
            "{what} rank {r}: input gradient"
        );
        let mut g = vec![0.0; p.len()];
        store.apply(&mut g).unwrap();
        // The router is every rank's own.
        let (a, b) = (router.of(&o.grads[..]), router.of(&g[..]));
        assert!(rel_err(a, b) < 1e-6, "{what} rank {r}: router gradient");
        g_all.iter_mut().zip(&g).for_each(|(s, x)| *s += x);
    }
    // Expert weights: rank r holds experts r·8/ep.., its gradients cover every rank's tokens.
    let per = 8 / ep;
    for (r, o) in outs.iter().enumerate() {
        let plan = TpPlan::with_experts(&cfg, 1, false, ep, r).unwrap();
        let local = plan.local_model().unwrap();
        let lb = local.layout.block_range(0).start;
        let lgu = local
            .layout
            .get("model.layers.0.mlp.experts.gate_up_proj")
            .unwrap()
            .view
            .relative_to(lb);
        let ldn = local
            .layout
            .get("model.layers.0.mlp.experts.down_proj")
            .unwrap()
            .view
            .relative_to(lb);
        let n_gu = lgu.numel();
        let n_dn = ldn.numel();
        let want_gu = &gate_up.of(&g_all[..])[r * n_gu..r * n_gu + n_gu];
        let want_dn = &down.of(&g_all[..])[r * n_dn..r * n_dn + n_dn];
        let e_gu = rel_err(lgu.of(&o.grads[..]), want_gu);
        let e_dn = rel_err(ldn.of(&o.grads[..]), want_dn);
        assert!(
            e_gu < 1e-5 && e_dn < 1e-5,
            "{what} rank {r}: expert gradients {e_gu:e} {e_dn:e}"
        );
    }
    if skewed {
        // Experts 0 and 1 take every token: rank 0 receives everything, the others nothing.
        for (r, o) in outs.iter().enumerate().skip(1) {
            assert_eq!(o.rows_in, 0, "{what} rank {r} received rows");
        }
    }
    // Bytes per layer (forward and backward, two all-to-all-v each): the rows this rank sends
    // to other ranks' experts go out twice (tokens, output gradients), the rows it received
    // go back twice (outputs, input gradients), each h·4 bytes, and every all-to-all-v
    // exchanges one 8-byte count per peer; before them, in the forward, the E/ep row counts
    // per peer (8 bytes each) tell each rank what comes.
    let h = cfg.hidden_size as u64;
    for (r, o) in outs.iter().enumerate() {
        let peers = (ep - 1) as u64;
        let want = 2 * (o.rows_out as u64 + o.rows_in as u64) * h * 4 + 4 * peers * 8;
        assert_eq!(o.bytes, want, "{what} rank {r}: bytes sent");
        assert_eq!(
            o.count_bytes,
            peers * per as u64 * 8,
            "{what} rank {r}: count bytes"
        );
    }
}

#[test]
fn expert_parallel_layer_equals_the_single_process_layer() {
    for ep in [1, 2, 4] {
        for skewed in [false, true] {
            check(ep, skewed);
        }
    }
}
