//! The block reused as a tensor-parallel shard: two ranks (threads) hold half the heads and half
//! the FFN width, the `RegionHooks` all-reduce at the region borders, and the output, input
//! gradient and every weight gradient must equal the unsharded block's.

use std::sync::{Arc, Barrier, Mutex};

use model::layers::block::RegionHooks;
use model::layers::Pass;
use model::{Model, ModelConfig, Result, View};
use tensor::buf::Buf;

/// In-process all-reduce over `n` threads (sums in rank order, so every rank gets the same bits).
#[derive(Debug)]
struct Group {
    barrier: Barrier,
    slots: Mutex<Vec<Vec<f32>>>,
}

#[derive(Debug)]
struct TpHooks {
    group: Arc<Group>,
    rank: usize,
}

impl TpHooks {
    fn all_reduce(&self, x: Vec<f32>) -> Vec<f32> {
        self.group.slots.lock().unwrap()[self.rank] = x;
        self.group.barrier.wait();
        let out = {
            let slots = self.group.slots.lock().unwrap();
            let mut acc = slots[0].clone();
            for s in &slots[1..] {
                acc.iter_mut().zip(s).for_each(|(a, b)| *a += b);
            }
            acc
        };
        self.group.barrier.wait();
        out
    }
}

impl RegionHooks for TpHooks {
    fn enter_forward(&self, x: Buf) -> Result<Buf> {
        Ok(x)
    }
    fn enter_backward(&self, dx: Buf) -> Result<Buf> {
        dx.on_host(|v| {
            v.copy_from_slice(&self.all_reduce(v.to_vec()));
            Ok(())
        })
    }
    fn exit_forward(&self, y: Buf) -> Result<Buf> {
        y.on_host(|v| {
            v.copy_from_slice(&self.all_reduce(v.to_vec()));
            Ok(())
        })
    }
    fn exit_backward(&self, dy: Buf) -> Result<Buf> {
        Ok(dy)
    }
}

/// Rows `[r·n, (r+1)·n)` of a `[rows, cols]` tensor.
fn rows(buf: &[f32], v: &View, r: usize, n: usize) -> Vec<f32> {
    let c = v.shape[1];
    v.of(buf)[r * n * c..(r + 1) * n * c].to_vec()
}

/// Columns `[r·n, (r+1)·n)` of a `[rows, cols]` tensor.
fn cols(buf: &[f32], v: &View, r: usize, n: usize) -> Vec<f32> {
    let c = v.shape[1];
    v.of(buf)
        .chunks(c)
        .flat_map(|row| row[r * n..(r + 1) * n].to_vec())
        .collect()
}

/// Rank `r`'s shard of every block-0 tensor, in the local layout's order.
fn shard(full: &Model, local: &Model, buf: &[f32], r: usize) -> Vec<f32> {
    let mut out = vec![0.0; local.layout.block_range(0).len()];
    let base = local.layout.block_range(0).start;
    for e in local.layout.entries_in(local.layout.block_range(0)) {
        let fv = &full.layout.get(&e.name).unwrap().view;
        let n_rows = e.view.shape[0];
        let data = if e.name.ends_with("layernorm.weight") {
            fv.of(buf).to_vec()
        } else if e.name.ends_with("o_proj.weight") || e.name.ends_with("down_proj.weight") {
            cols(buf, fv, r, e.view.shape[1])
        } else {
            rows(buf, fv, r, n_rows)
        };
        e.view
            .relative_to(base)
            .of_mut(&mut out)
            .copy_from_slice(&data);
    }
    out
}

fn close(a: &[f32], b: &[f32], what: &str) {
    let scale = b.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let err = a
        .iter()
        .zip(b)
        .fold(0.0f32, |m, (x, y)| m.max((x - y).abs()));
    assert!(err <= 1e-5 * scale, "{what}: {err:e} vs scale {scale:e}");
}

#[test]
fn tensor_parallel_block_matches_single_device() {
    let mut cfg = ModelConfig::llama(16, 32, 40, 1, 4, 2);
    cfg.initializer_range = 0.2;
    let full = Model::new(cfg.clone()).unwrap();
    let mut lc = cfg.clone();
    lc.num_attention_heads = 2;
    lc.num_key_value_heads = Some(1);
    lc.intermediate_size = 20;
    lc.head_dim = Some(8);
    let local = Model::new(lc).unwrap();
    let params = full.init_params(3);
    let pass = Pass::new(2, 7);
    let mut rng = model::init::SplitMix64::new(1);
    let x: Vec<f32> = (0..pass.tokens() * 32)
        .map(|_| rng.next_normal() as f32)
        .collect();
    let dy: Vec<f32> = (0..pass.tokens() * 32)
        .map(|_| rng.next_normal() as f32)
        .collect();

    let fr = full.layout.block_range(0);
    let pf = &params[fr.clone()];
    let (y_ref, cache) = full.blocks[0]
        .forward(pf, Arc::new(x.clone().into()), &pass)
        .unwrap();
    let y_ref = y_ref.to_vec().unwrap();
    let mut g_ref = vec![0.0; fr.len()];
    let dx_ref = full.blocks[0]
        .backward(pf, &mut g_ref, cache, dy.clone().into())
        .unwrap()
        .to_vec()
        .unwrap();
    let mut g_full = vec![0.0; params.len()];
    g_full[fr.clone()].copy_from_slice(&g_ref);

    let group = Arc::new(Group {
        barrier: Barrier::new(2),
        slots: Mutex::new(vec![Vec::new(); 2]),
    });
    let results: Vec<_> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..2)
            .map(|r| {
                let (group, full, local, params, x, dy) =
                    (group.clone(), &full, &local, &params, &x, &dy);
                let pass = &pass;
                s.spawn(move || {
                    let p = shard(full, local, params, r);
                    let mut block = local.blocks[0].clone();
                    block.hooks = Some(Arc::new(TpHooks { group, rank: r }));
                    let (y, c) = block.forward(&p, Arc::new(x.clone().into()), pass).unwrap();
                    let mut g = vec![0.0; p.len()];
                    let dx = block.backward(&p, &mut g, c, dy.clone().into()).unwrap();
                    (y.to_vec().unwrap(), dx.to_vec().unwrap(), g)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (r, (y, dx, g)) in results.iter().enumerate() {
        close(y, &y_ref, "output");
        close(dx, &dx_ref, "input gradient");
        let expect = shard(&full, &local, &g_full, r);
        for e in local.layout.entries_in(local.layout.block_range(0)) {
            let v = e.view.relative_to(local.layout.block_range(0).start);
            close(v.of(g), v.of(&expect), &format!("rank {r} grad {}", e.name));
        }
    }
}
