//! Finite-difference checks of every layer's backward (attention, SwiGLU MLP, MoE router +
//! experts + shared expert + auxiliary loss, with and without capacity drops, whole blocks with
//! their norms, embedding and head with tied and untied LM head).
//!
//! Each check compares a directional derivative `⟨∇f, v⟩` (random `v` restricted to one tensor)
//! with the central difference `(f(θ + hv) − f(θ − hv)) / 2h`, `f = ⟨y, r⟩` accumulated in f64.
//! In fp32 the difference quotient carries rounding noise `~ε·|f|/h`; Richardson extrapolation
//! keeps truncation at `O(h⁴)` with a fairly large `h`, and the agreement asked for is 1e-2
//! relative (a wrong backward is off by O(1)).

use std::ops::Range;
use std::sync::Arc;

use model::init::SplitMix64;
use model::layers::block::Ffn;
use model::layers::{Kept, Pass, WeightGradStore};
use model::{Batch, Model, ModelConfig, StepOptions, View};

fn randn(n: usize, seed: u64, std: f32) -> Vec<f32> {
    let mut r = SplitMix64::new(seed);
    (0..n).map(|_| (r.next_normal() as f32) * std).collect()
}

fn host(b: model::layers::Buf) -> Vec<f32> {
    b.into_host("test").unwrap()
}

fn dot(a: &[f32], b: &[f32]) -> f64 {
    a.iter().zip(b).map(|(x, y)| *x as f64 * *y as f64).sum()
}

/// Value of the checked function and a discrete signature of its routing decisions (MoE top-k
/// and capacity choices; empty for dense layers). The function is smooth only while the
/// signature is unchanged, so finite differences are taken only inside such a region.
type Eval<'a> = &'a dyn Fn(&[f32]) -> (f64, Vec<usize>);

/// Compare `⟨grad, v⟩` with the central difference of `f` around `at` along `v` on `range`.
fn check_dir(what: &str, f: Eval, at: &[f32], grad: &[f32], range: Range<usize>, seed: u64) {
    let n = range.len();
    let scale = (at[range.clone()].iter().map(|x| x * x).sum::<f32>() / n as f32)
        .sqrt()
        .max(0.05);
    let v = randn(n, seed, scale);
    let base_key = f(at).1;
    let shifted = |step: f32| {
        let mut p = at.to_vec();
        for (x, d) in p[range.clone()].iter_mut().zip(&v) {
            *x += step * d;
        }
        f(&p)
    };
    // Richardson extrapolation of the central difference: O(h⁴) truncation, so h can stay
    // large enough that fp32 rounding of f (~1e-7 relative) is negligible. h shrinks while a
    // routing decision flips inside [-h, h].
    let mut h = 2e-2f32;
    let fd = loop {
        let pts: Vec<_> = [h, h / 2.0, -h / 2.0, -h]
            .iter()
            .map(|&s| shifted(s))
            .collect();
        if pts.iter().all(|(_, k)| *k == base_key) {
            let central = |a: f64, b: f64, h: f32| (a - b) / (2.0 * h as f64);
            break (4.0 * central(pts[1].0, pts[2].0, h / 2.0) - central(pts[0].0, pts[3].0, h))
                / 3.0;
        }
        h /= 4.0;
        assert!(h > 1e-5, "{what}: routing flips for every step size");
    };
    let an = dot(&grad[range], &v);
    let tol = 1e-2 * an.abs().max(fd.abs()) + 1e-5;
    assert!(
        (fd - an).abs() <= tol,
        "{what}: analytic {an:e} vs finite difference {fd:e} (h {h})"
    );
}

/// A layer as a function of (parameters, input): output, weighted aux loss, routing signature.
type LayerFn<'a> = &'a dyn Fn(&[f32], &[f32]) -> (Vec<f32>, f64, Vec<usize>);

fn route_key(r: &model::layers::moe::Routing) -> Vec<usize> {
    let mut k = r.experts.clone();
    for a in &r.assigned {
        k.extend(a.iter().map(|&(t, j)| t * 16 + j));
        k.push(usize::MAX);
    }
    k
}

fn small_cfg(moe: bool) -> ModelConfig {
    let mut c = ModelConfig::llama(32, 16, 24, 2, 4, 2);
    c.initializer_range = 0.3;
    if moe {
        c = c.with_experts(4, 2);
        c.output_router_logits = true;
        c.router_aux_loss_coef = 0.5;
        c.shared_expert_intermediate_size = Some(8);
    }
    c
}

/// Check the block-level function `fwd(p_block, x)` (returns output and aux loss), given the
/// analytic dx and block weight gradient for `dy = r`.
#[allow(clippy::too_many_arguments)]
fn check_layer(
    what: &str,
    fwd: LayerFn,
    p: &[f32],
    x: &[f32],
    r: &[f32],
    dx: &[f32],
    g: &[f32],
    views: &[(&str, View)],
) {
    let f_x = |xx: &[f32]| {
        let (y, aux, key) = fwd(p, xx);
        (dot(&y, r) + aux, key)
    };
    check_dir(&format!("{what} dx"), &f_x, x, dx, 0..x.len(), 11);
    let f_p = |pp: &[f32]| {
        let (y, aux, key) = fwd(pp, x);
        (dot(&y, r) + aux, key)
    };
    for (i, (name, v)) in views.iter().enumerate() {
        check_dir(
            &format!("{what} {name}"),
            &f_p,
            p,
            g,
            v.range(),
            100 + i as u64,
        );
    }
}

fn block_setup(moe: bool) -> (Model, Vec<f32>, Pass, Vec<f32>, Vec<f32>) {
    let m = Model::new(small_cfg(moe)).unwrap();
    let params = m.init_params(5);
    let pass = Pass::new(2, 5);
    let x = randn(pass.tokens() * 16, 7, 1.0);
    let r = randn(pass.tokens() * 16, 8, 1.0);
    (m, params, pass, x, r)
}

#[test]
fn attention_layer() {
    let (m, params, pass, x, r) = block_setup(false);
    let p = &params[m.layout.block_range(0)];
    let a = &m.blocks[0].attn;
    let fwd = |pp: &[f32], xx: &[f32]| (host(a.forward(pp, xx, &pass).unwrap().0), 0.0, vec![]);
    let (_, cache) = a.forward(p, &x, &pass).unwrap();
    let mut store = WeightGradStore::new();
    let dx = a
        .backward_input(
            p,
            &Kept::Values(Arc::new(x.clone().into())),
            cache,
            Arc::new(r.clone().into()),
            &pass,
            &mut store,
        )
        .unwrap();
    let mut g = vec![0.0; p.len()];
    store.apply(&mut g).unwrap();
    let views = [
        ("wq", a.wq.clone()),
        ("wk", a.wk.clone()),
        ("wv", a.wv.clone()),
        ("wo", a.wo.clone()),
    ];
    check_layer("attention", &fwd, p, &x, &r, &host(dx), &g, &views);
}

#[test]
fn mlp_layer() {
    let (m, params, _, x, r) = block_setup(false);
    let p = &params[m.layout.block_range(1)];
    let Ffn::Dense(mlp) = &m.blocks[1].ffn else {
        panic!("dense")
    };
    let fwd = |pp: &[f32], xx: &[f32]| (host(mlp.forward(pp, xx, true).unwrap().0), 0.0, vec![]);
    let (_, cache) = mlp.forward(p, &x, true).unwrap();
    let mut store = WeightGradStore::new();
    let dx = mlp
        .backward_input(
            p,
            &Kept::Values(Arc::new(x.clone().into())),
            cache,
            Arc::new(r.clone().into()),
            &mut store,
        )
        .unwrap();
    let mut g = vec![0.0; p.len()];
    store.apply(&mut g).unwrap();
    let views = [
        ("gate", mlp.gate.clone()),
        ("up", mlp.up.clone()),
        ("down", mlp.down.clone()),
    ];
    check_layer("mlp", &fwd, p, &x, &r, &host(dx), &g, &views);
}

fn moe_check(capacity: Option<f32>) {
    let (m, params, pass, x, r) = block_setup(true);
    let p = &params[m.layout.block_range(0)];
    let Ffn::Moe(moe) = &m.blocks[0].ffn else {
        panic!("moe")
    };
    let mut moe = moe.clone();
    moe.capacity_factor = capacity;
    let fwd = |pp: &[f32], xx: &[f32]| {
        let (y, c) = moe.forward(pp, xx, &pass).unwrap();
        (
            y.into_vec().unwrap(),
            (moe.aux_coef * c.aux) as f64,
            route_key(&c.routing),
        )
    };
    let (_, cache) = moe.forward(p, &x, &pass).unwrap();
    if capacity.is_some() {
        assert!(
            cache.routing.dropped() > 0,
            "capacity test must drop assignments"
        );
    } else {
        assert_eq!(cache.routing.dropped(), 0);
    }
    let mut store = WeightGradStore::new();
    let dx = moe
        .backward_input(
            p,
            &Arc::new(x.clone().into()),
            cache,
            Arc::new(r.clone().into()),
            &pass,
            &mut store,
        )
        .unwrap();
    let mut g = vec![0.0; p.len()];
    store.apply(&mut g).unwrap();
    let mut views = vec![("router", moe.router.clone())];
    for e in &moe.experts {
        views.extend([
            ("expert gate", e.gate.clone()),
            ("expert up", e.up.clone()),
            ("expert down", e.down.clone()),
        ]);
    }
    let s = moe.shared.as_ref().unwrap();
    views.extend([
        ("shared gate", s.gate.clone()),
        ("shared up", s.up.clone()),
        ("shared down", s.down.clone()),
    ]);
    assert!(moe.aux_coef > 0.0);
    let dx = dx.into_vec().unwrap();
    check_layer("moe", &fwd, p, &x, &r, &dx, &g, &views);
}

#[test]
fn moe_layer_dropless() {
    moe_check(None);
}

#[test]
fn moe_layer_with_capacity() {
    moe_check(Some(0.5));
}

fn block_check(moe: bool) {
    let (m, params, pass, x, r) = block_setup(moe);
    let range = m.layout.block_range(0);
    let p = &params[range.clone()];
    let b = &m.blocks[0];
    let fwd = |pp: &[f32], xx: &[f32]| {
        let (y, c) = b.forward(pp, Arc::new(xx.to_vec().into()), &pass).unwrap();
        let key = c.routing().map(route_key).unwrap_or_default();
        (host(y), c.aux_loss() as f64, key)
    };
    let (_, cache) = b.forward(p, Arc::new(x.clone().into()), &pass).unwrap();
    let mut g = vec![0.0; p.len()];
    let dx = host(b.backward(p, &mut g, cache, r.clone().into()).unwrap());
    let views: Vec<(&str, View)> = m
        .layout
        .entries_in(range.clone())
        .map(|e| (e.name.as_str(), e.view.relative_to(range.start)))
        .collect();
    check_layer(
        if moe { "moe block" } else { "dense block" },
        &fwd,
        p,
        &x,
        &r,
        &dx,
        &g,
        &views,
    );
}

#[test]
fn dense_block_with_norms() {
    block_check(false);
}

#[test]
fn moe_block_with_norms() {
    block_check(true);
}

/// The loss through the per-part API (embedding, blocks, head), with the routing signature.
fn loss_and_routes(m: &Model, p: &[f32], batch: &Batch) -> (f64, Vec<usize>) {
    let pass = Pass::new(batch.batch, batch.seq);
    let l = &m.layout;
    let mut x = m.embed_forward(&p[l.embed_range()], &batch.inputs).unwrap();
    let (mut key, mut aux) = (Vec::new(), 0.0f64);
    for i in 0..l.num_blocks() {
        let (y, c) = m
            .block_forward(i, &p[l.block_range(i)], Arc::new(x), &pass)
            .unwrap();
        key.extend(c.routing().map(route_key).unwrap_or_default());
        aux += c.aux_loss() as f64;
        x = y;
    }
    let targets = Arc::new(batch.targets.clone());
    let h = m
        .head_forward(
            &p[l.head_range()],
            &p[l.embed_range()],
            Arc::new(x),
            targets,
        )
        .unwrap();
    (h.loss_sum / h.n_valid as f64 + aux, key)
}

fn whole_model_check(tied: bool, moe: bool) {
    let mut cfg = small_cfg(moe);
    cfg.tie_word_embeddings = tied;
    let m = Model::new(cfg).unwrap();
    let params = m.init_params(9);
    let ids: Vec<u32> = (0..12).map(|i| (i * 7 + 3) % 32).collect();
    let batch = Batch::next_token(2, 6, &ids).unwrap();
    let mut g = vec![0.0; m.num_params()];
    m.forward_backward(
        &params,
        &mut g,
        &batch,
        &StepOptions::default(),
        &mut |_| {},
    )
    .unwrap();
    let f = |p: &[f32]| loss_and_routes(&m, p, &batch);
    for (i, e) in m.layout.entries.iter().enumerate() {
        check_dir(&e.name, &f, &params, &g, e.view.range(), 300 + i as u64);
    }
}

#[test]
fn whole_model_untied() {
    whole_model_check(false, false);
}

#[test]
fn whole_model_tied_moe() {
    whole_model_check(true, true);
}
#[test]
fn whole_model_tied_dense() {
    whole_model_check(true, false);
}
#[test]
fn whole_model_untied_moe() {
    whole_model_check(false, true);
}
