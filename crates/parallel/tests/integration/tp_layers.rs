//! Each tensor-parallel layer against its single-rank counterpart, forward and backward, for
//! tp ∈ {1, 2, 4}, with and without sequence parallelism (ranks as threads): column → row
//! linear pair, a decoder block (GQA attention split by heads, SwiGLU split by FFN columns;
//! KV heads replicated when tp > kv heads), a MoE block (router replicated, experts split),
//! and the vocab-parallel embedding + fused LM head / cross-entropy. Gradients are compared
//! after the partial-gradient sync, gathered back to the full layout.
use model::layers::{Buf, BufRef};
use std::sync::Arc;

use comm::testing::run_threads;
use model::init::SplitMix64;
use model::layers::{Pass, Recompute};
use model::{Model, ModelConfig, View};
use parallel::tensor_parallel::{shard_model, ColumnParallelLinear, RowParallelLinear, TpRegion};

fn randn(n: usize, seed: u64) -> Vec<f32> {
    let mut rng = SplitMix64::new(seed);
    (0..n).map(|_| rng.next_normal() as f32).collect()
}

fn close(a: &[f32], b: &[f32], what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: lengths");
    let scale = b.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let err = a
        .iter()
        .zip(b)
        .fold(0.0f32, |m, (x, y)| m.max((x - y).abs()));
    assert!(err <= 1e-5 * scale, "{what}: {err:e} vs scale {scale:e}");
}

/// Rows `range` of a `[tokens, width]` buffer.
fn rows(x: &[f32], width: usize, r: std::ops::Range<usize>) -> Vec<f32> {
    x[r.start * width..r.end * width].to_vec()
}

/// Columns `[c0, c0 + n)` of a `[rows, cols]` buffer.
fn cols(x: &[f32], cols: usize, c0: usize, n: usize) -> Vec<f32> {
    x.chunks(cols)
        .flat_map(|r| r[c0..c0 + n].to_vec())
        .collect()
}

#[test]
fn column_then_row_linear_match_dense() {
    let (t, h, f) = (8, 6, 8);
    let x = randn(t * h, 1);
    let w1 = randn(f * h, 2); // [f, h]
    let w2 = randn(h * f, 3); // [h, f]
    let dy = randn(t * h, 4);
    // Dense reference: z = x·W1ᵀ, y = z·W2ᵀ and the gradients.
    let mm = |a: &[f32], b: &[f32], m, k, n, ta, tb| {
        let mut c = vec![0.0; m * n];
        tensor::gemm::matmul(&mut c, a, b, m, k, n, ta, tb, false).unwrap();
        c
    };
    let z = mm(&x, &w1, t, h, f, false, true);
    let y = mm(&z, &w2, t, f, h, false, true);
    let dz = mm(&dy, &w2, t, h, f, false, false);
    let dw2 = mm(&dy, &z, h, t, f, true, false);
    let dx = mm(&dz, &w1, t, f, h, false, false);
    let dw1 = mm(&dz, &x, f, t, h, true, false);
    for tp in [1, 2, 4] {
        for sp in [false, true] {
            run_threads(tp, |c| {
                let region = TpRegion::new(c.world().clone(), sp);
                let r = region.rank();
                let fl = f / tp;
                // Local buffer: W1 rows [r·fl, (r+1)·fl), then W2 columns of the same range.
                let mut p = w1[r * fl * h..(r + 1) * fl * h].to_vec();
                p.extend(cols(&w2, f, r * fl, fl));
                let col = ColumnParallelLinear {
                    w: View {
                        offset: 0,
                        shape: vec![fl, h],
                    },
                    region: region.clone(),
                };
                let row = RowParallelLinear {
                    w: View {
                        offset: fl * h,
                        shape: vec![h, fl],
                    },
                    region: region.clone(),
                };
                let toks = region.local_tokens(t);
                let (zl, c1) = col.forward(&p, rows(&x, h, toks.clone())).unwrap();
                close(&zl, &cols(&z, f, r * fl, fl), "column output");
                let (yl, c2) = row.forward(&p, zl).unwrap();
                close(&yl, &rows(&y, h, toks.clone()), "row output");
                let mut g = vec![0.0; p.len()];
                let dzl = row
                    .backward(&p, &mut g, c2, rows(&dy, h, toks.clone()))
                    .unwrap();
                close(&dzl, &cols(&dz, f, r * fl, fl), "row input grad");
                let dxl = col.backward(&p, &mut g, c1, &dzl).unwrap();
                close(&dxl, &rows(&dx, h, toks), "column input grad");
                close(&g[..fl * h], &dw1[r * fl * h..(r + 1) * fl * h], "dW1");
                close(&g[fl * h..], &cols(&dw2, f, r * fl, fl), "dW2");
            });
        }
    }
}

/// Block 0 of `cfg` under tp ranks vs the single-device block: output, input gradient and
/// every weight gradient (gathered).
fn check_block(cfg: &ModelConfig, tp: usize, sp: bool) {
    for recompute in [Recompute::None, Recompute::Selective, Recompute::Full] {
        check_block_with(cfg, tp, sp, recompute);
    }
}

/// [`check_block`] with one activation-recomputation policy (recomputation reissues the
/// forward's region collectives inside backward).
fn check_block_with(cfg: &ModelConfig, tp: usize, sp: bool, recompute: Recompute) {
    let full = Model::new(cfg.clone()).unwrap();
    let params = full.init_params(3);
    let pass = Pass::new(2, 8).with_recompute(recompute);
    let h = cfg.hidden_size;
    let (t, fr) = (pass.tokens(), full.layout.block_range(0));
    let x = randn(t * h, 5);
    let dy = randn(t * h, 6);
    let host = |b: Buf| b.into_host("test").unwrap();
    let (y_ref, cache) = full.blocks[0]
        .forward(&params[fr.clone()], Arc::new(Buf::Host(x.clone())), &pass)
        .unwrap();
    let y_ref = host(y_ref);
    let mut g_ref = vec![0.0; params.len()];
    let dx_ref = host(
        full.blocks[0]
            .backward(
                &params[fr.clone()],
                &mut g_ref[fr.clone()],
                cache,
                Buf::Host(dy.clone()),
            )
            .unwrap(),
    );
    let out = run_threads(tp, |c| {
        let (local, m) = shard_model(cfg, c.world().clone(), sp).unwrap();
        let p = m.plan.shard(&params, m.rank());
        let br = local.layout.block_range(0);
        let toks = m.region.local_tokens(t);
        let mut local_pass = pass.clone();
        local_pass.loss_scale = if m.rank() == 0 { 1.0 } else { 0.0 };
        let b = &local.blocks[0];
        let (y, cache) = b
            .forward(
                &p[br.clone()],
                Arc::new(Buf::Host(rows(&x, h, toks.clone()))),
                &local_pass,
            )
            .unwrap();
        let y = host(y);
        close(&y, &rows(&y_ref, h, toks.clone()), "block output");
        let mut g = vec![0.0; p.len()];
        let dx = host(
            b.backward(
                &p[br.clone()],
                &mut g[br],
                cache,
                Buf::Host(rows(&dy, h, toks.clone())),
            )
            .unwrap(),
        );
        close(&dx, &rows(&dx_ref, h, toks), "block input grad");
        m.plan.sync_grads(m.group(), &mut g).unwrap();
        (g, m.plan.clone())
    });
    let plan = out[0].1.clone();
    let g = plan
        .gather(&out.into_iter().map(|o| o.0).collect::<Vec<_>>())
        .unwrap();
    for e in full.layout.entries_in(fr) {
        close(
            e.view.of(&g),
            e.view.of(&g_ref),
            &format!("tp={tp} sp={sp} {recompute:?} grad {}", e.name),
        );
    }
}

fn llama_gqa() -> ModelConfig {
    // 4 query heads over 2 KV heads: tp = 4 replicates each KV head on two ranks.
    let mut cfg = ModelConfig::llama(64, 32, 48, 1, 4, 2);
    cfg.initializer_range = 0.2;
    cfg
}

fn moe() -> ModelConfig {
    let mut cfg = ModelConfig::llama(64, 32, 48, 1, 4, 2).with_experts(4, 2);
    cfg.initializer_range = 0.2;
    cfg.output_router_logits = true;
    cfg.router_aux_loss_coef = 0.05;
    cfg.shared_expert_intermediate_size = Some(16);
    cfg
}

#[test]
fn attention_and_mlp_block_matches_single_device() {
    for tp in [1, 2, 4] {
        for sp in [false, true] {
            check_block(&llama_gqa(), tp, sp);
        }
    }
}

#[test]
fn moe_block_matches_single_device() {
    for tp in [1, 2, 4] {
        for sp in [false, true] {
            check_block(&moe(), tp, sp);
        }
    }
}

#[test]
fn vocab_parallel_embedding_and_head_match_single_device() {
    let cfg = llama_gqa();
    let full = Model::new(cfg.clone()).unwrap();
    let params = full.init_params(4);
    let (b, s) = (2, 8);
    let ids: Vec<u32> = (0..b * s).map(|i| (i * 37 % 64) as u32).collect();
    let batch = model::Batch::next_token(b, s, &ids).unwrap();
    let (er, hr) = (full.layout.embed_range(), full.layout.head_range());
    // Reference: embedding straight into the head (no blocks).
    let none = BufRef::Host(&[]);
    let x = full.embed_forward(&params[er.clone()], &ids).unwrap();
    let hc = full
        .head_forward(
            &params[hr.clone()],
            none,
            Arc::new(x),
            Arc::new(batch.targets.clone()),
        )
        .unwrap();
    let loss_ref = hc.loss_sum;
    let scale = 1.0 / hc.n_valid as f32;
    let mut g_ref = vec![0.0; params.len()];
    let (ge, gr) = g_ref.split_at_mut(hr.start);
    let dx = full
        .head_backward(&params[hr.clone()], none, gr, None, hc, scale)
        .unwrap();
    full.embed_backward(&mut ge[er.clone()], &ids, dx.r())
        .unwrap();
    for tp in [1, 2, 4] {
        for sp in [false, true] {
            let out = run_threads(tp, |c| {
                let (local, m) = shard_model(&cfg, c.world().clone(), sp).unwrap();
                let p = m.plan.shard(&params, m.rank());
                let l = &local.layout;
                let (er, hr) = (l.embed_range(), l.head_range());
                let x = m.embed.forward((&p[er.clone()]).into(), &ids).unwrap();
                let hc = m
                    .head
                    .forward(
                        (&p[hr.clone()]).into(),
                        Arc::new(x),
                        Arc::new(batch.targets.clone()),
                    )
                    .unwrap();
                let loss = hc.loss_sum;
                let mut g = vec![0.0; p.len()];
                let dx = m
                    .head
                    .backward((&p[hr.clone()]).into(), (&mut g[hr]).into(), hc, scale)
                    .unwrap();
                m.embed.backward((&mut g[er]).into(), &ids, dx).unwrap();
                m.plan.sync_grads(m.group(), &mut g).unwrap();
                (loss, g, m.plan.clone())
            });
            let plan = out[0].2.clone();
            for o in &out {
                assert!(
                    ((o.0 - loss_ref) / loss_ref).abs() < 1e-6,
                    "tp={tp} sp={sp} loss {} vs {loss_ref}",
                    o.0
                );
            }
            let g = plan
                .gather(&out.into_iter().map(|o| o.1).collect::<Vec<_>>())
                .unwrap();
            for name in [
                "model.embed_tokens.weight",
                "model.norm.weight",
                "lm_head.weight",
            ] {
                let v = &full.layout.get(name).unwrap().view;
                close(
                    v.of(&g),
                    v.of(&g_ref),
                    &format!("tp={tp} sp={sp} grad {name}"),
                );
            }
        }
    }
}

/// Cutting a full buffer into tp shards and gathering them back is the identity, and each
/// tensor's distinct parts tile it exactly (local size × parts = full size).
#[test]
fn shard_then_gather_is_identity() {
    for cfg in [llama_gqa(), moe()] {
        let full: Vec<f32> = (0..Model::new(cfg.clone()).unwrap().num_params())
            .map(|i| i as f32)
            .collect();
        for tp in [1, 2, 4] {
            let plan = parallel::tensor_parallel::TpPlan::new(&cfg, tp, false).unwrap();
            let shards: Vec<Vec<f32>> = (0..tp).map(|r| plan.shard(&full, r)).collect();
            assert_eq!(plan.gather(&shards).unwrap(), full, "tp={tp}");
            for t in &plan.tensors {
                assert_eq!(
                    t.local.numel() * t.split.parts(),
                    t.full.numel(),
                    "{}",
                    t.name
                );
            }
        }
    }
}
