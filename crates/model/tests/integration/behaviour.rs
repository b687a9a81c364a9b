//! Contracts beyond the gradients' values: split backward = fused backward, recomputation
//! changes nothing (bitwise), gradient-ready callbacks, MoE routing semantics, deterministic
//! init, safetensors round trips, and clear errors for bad input.

use std::sync::Arc;

use model::io::{params_to_safetensors, save_params, WeightsFile};
use model::layers::block::Ffn;
use model::{Batch, Model, ModelConfig, ModelError, Pass, Recompute, StepOptions};

fn cfg(moe: bool) -> ModelConfig {
    let mut c = ModelConfig::llama(48, 32, 40, 3, 4, 2);
    c.initializer_range = 0.2;
    if moe {
        c = c.with_experts(4, 2);
        c.output_router_logits = true;
        c.router_aux_loss_coef = 0.1;
        c.shared_expert_intermediate_size = Some(16);
        c.capacity_factor = Some(0.8);
    }
    c
}

fn batch() -> Batch {
    let ids: Vec<u32> = (0..2 * 40).map(|i| ((i * 13 + 5) % 48) as u32).collect();
    Batch::next_token(2, 40, &ids).unwrap()
}

fn grads(m: &Model, p: &[f32], b: &Batch, r: Recompute) -> (Vec<f32>, f32) {
    let mut g = vec![0.0; m.num_params()];
    let opts = StepOptions {
        recompute: r,
        loss_scale: 1.0,
    };
    let rep = m
        .forward_backward(p, &mut g, b, &opts, &mut |_| {})
        .unwrap();
    (g, rep.loss)
}

#[test]
fn recomputation_is_bitwise_identical() {
    for moe in [false, true] {
        let m = Model::new(cfg(moe)).unwrap();
        let p = m.init_params(1);
        let b = batch();
        let (g0, l0) = grads(&m, &p, &b, Recompute::None);
        for r in [Recompute::Full, Recompute::Selective] {
            let (g, l) = grads(&m, &p, &b, r);
            assert_eq!(l.to_bits(), l0.to_bits(), "{r:?} loss (moe {moe})");
            assert!(
                g.iter().zip(&g0).all(|(a, b)| a.to_bits() == b.to_bits()),
                "{r:?} grads (moe {moe})"
            );
        }
    }
}

/// Zero-bubble order: every block's input gradient first (last to first), the weight
/// gradients afterwards in another order; the head split too. Must equal the fused backward
/// (whose head computes its gradients in the forward), bit for bit, whether the split head
/// recomputes its logits, reuses gradients computed in its forward, or was given a different
/// scale in the forward (so must recompute).
#[test]
fn split_backward_equals_fused() {
    for (moe, early) in [
        (false, 0.0),
        (true, 0.0),
        (false, 1.0),
        (true, 1.0),
        (false, 2.0),
    ] {
        let m = Model::new(cfg(moe)).unwrap();
        let p = m.init_params(2);
        let b = batch();
        let (fused, _) = grads(&m, &p, &b, Recompute::None);
        let l = &m.layout;
        let pass = Pass::new(b.batch, b.seq);
        let mut x = m.embed_forward(&p[l.embed_range()], &b.inputs).unwrap();
        let mut caches = Vec::new();
        for i in 0..l.num_blocks() {
            let (y, c) = m
                .block_forward(i, &p[l.block_range(i)], Arc::new(x), &pass)
                .unwrap();
            caches.push(c);
            x = y;
        }
        let scale = m.head.mean_grad_scale(&b.targets, 1.0).unwrap();
        let (ph, pe, x, t) = (
            &p[l.head_range()],
            &p[l.embed_range()],
            Arc::new(x),
            Arc::new(b.targets.clone()),
        );
        let hc = if early == 0.0 {
            m.head_forward(ph, pe, x, t).unwrap()
        } else {
            m.head_forward_with_grad(ph, pe, x, t, early * scale)
                .unwrap()
        };
        assert_eq!(scale, 1.0 / hc.n_valid as f32);
        let (mut dx, head_w) = m
            .head_backward_input(&p[l.head_range()], &p[l.embed_range()], hc, scale)
            .unwrap();
        let mut stores = Vec::new();
        for (i, c) in caches.into_iter().enumerate().rev() {
            let (d, s) = m
                .block_backward_input(i, &p[l.block_range(i)], c, dx)
                .unwrap();
            stores.push((i, s));
            dx = d;
        }
        let mut g = vec![0.0; m.num_params()];
        m.embed_backward(&mut g[l.embed_range()], &b.inputs, &dx)
            .unwrap();
        for (i, s) in stores.into_iter().rev() {
            m.block_backward_weight(i, s, &mut g[l.block_range(i)])
                .unwrap();
        }
        m.head_backward_weight(
            &p[l.head_range()],
            &p[l.embed_range()],
            &mut g[l.head_range()],
            None,
            head_w,
        )
        .unwrap();
        assert!(
            g.iter()
                .zip(&fused)
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "moe {moe}, early {early}"
        );
    }
}

#[test]
fn grads_ready_order_and_accumulation() {
    let m = Model::new(cfg(false)).unwrap();
    let p = m.init_params(3);
    let b = batch();
    let mut g = vec![0.0; m.num_params()];
    let mut order = Vec::new();
    m.forward_backward(&p, &mut g, &b, &StepOptions::default(), &mut |r| {
        order.push(r)
    })
    .unwrap();
    let l = &m.layout;
    let mut expect = vec![l.head_range()];
    expect.extend((0..l.num_blocks()).rev().map(|i| l.block_range(i)));
    expect.push(l.embed_range());
    assert_eq!(order, expect);
    // Gradients accumulate: a second call with loss_scale 0.5 adds half again.
    let g1 = g.clone();
    let opts = StepOptions {
        loss_scale: 0.5,
        ..Default::default()
    };
    m.forward_backward(&p, &mut g, &b, &opts, &mut |_| {})
        .unwrap();
    for (a, b) in g.iter().zip(&g1) {
        assert!((a - 1.5 * b).abs() <= 1e-6 * (1.0 + b.abs()));
    }
}

#[test]
fn moe_routing_semantics() {
    let m = Model::new(cfg(true)).unwrap();
    let p = m.init_params(4);
    let Ffn::Moe(moe) = &m.blocks[0].ffn else {
        panic!()
    };
    let pb = &p[m.layout.block_range(0)];
    let t = 50;
    let mut r = model::init::SplitMix64::new(9);
    let x: Vec<f32> = (0..t * 32).map(|_| r.next_normal() as f32).collect();
    let pass = Pass::new(1, t);
    let (_, c) = moe.forward(pb, &x, &pass).unwrap();
    let rt = &c.routing;
    let (e_n, k) = (4, 2);
    let cap = (0.8f64 * (t * k) as f64 / e_n as f64).ceil() as usize;
    let mut f = vec![0.0f64; e_n];
    let mut pm = vec![0.0f64; e_n];
    for ti in 0..t {
        let pr = &rt.probs[ti * e_n..(ti + 1) * e_n];
        let mut sorted: Vec<usize> = (0..e_n).collect();
        sorted.sort_by(|&a, &b| pr[b].total_cmp(&pr[a]));
        assert_eq!(&rt.experts[ti * k..(ti + 1) * k], &sorted[..k]);
        let s: f32 = sorted[..k].iter().map(|&e| pr[e]).sum();
        for j in 0..k {
            assert!((rt.weights[ti * k + j] - pr[sorted[j]] / s).abs() < 1e-6);
            f[sorted[j]] += 1.0 / t as f64;
        }
        for e in 0..e_n {
            pm[e] += pr[e] as f64 / t as f64;
        }
    }
    // Capacity: no expert over capacity; drops happen in token order.
    for (e, a) in rt.assigned.iter().enumerate() {
        assert!(a.len() <= cap);
        assert_eq!(a.len(), rt.counts[e].min(cap));
        assert!(a.windows(2).all(|w| w[0].0 < w[1].0));
    }
    assert!(rt.dropped() > 0);
    // HF load_balancing_loss_func for one layer: E · Σ_e f_e · P_e.
    let aux: f64 = e_n as f64 * f.iter().zip(&pm).map(|(a, b)| a * b).sum::<f64>();
    assert!((c.aux as f64 - aux).abs() < 1e-5, "{} vs {aux}", c.aux);
    // A capacity large enough to drop nothing is the dropless layer, bitwise.
    let mut big = moe.clone();
    big.capacity_factor = Some(100.0);
    let mut free = moe.clone();
    free.capacity_factor = None;
    let (y1, _) = big.forward(pb, &x, &pass).unwrap();
    let (y2, c2) = free.forward(pb, &x, &pass).unwrap();
    assert_eq!(y1.to_vec().unwrap(), y2.to_vec().unwrap());
    assert_eq!(c2.routing.dropped(), 0);
    // Dropping by probability: each expert over capacity keeps its `cap` most probable
    // assignments (in token order), and no kept assignment is less probable than a dropped
    // one of the same expert.
    let mut prob = moe.clone();
    prob.drop_by_probability = true;
    let rp = prob.route(pb, &x).unwrap();
    for e in 0..e_n {
        let kept = &rp.assigned[e];
        assert_eq!(kept.len(), rp.counts[e].min(cap));
        assert!(kept.windows(2).all(|w| w[0].0 < w[1].0), "token order");
        let min_kept = kept
            .iter()
            .map(|&(t, _)| rp.probs[t * e_n + e])
            .fold(f32::INFINITY, f32::min);
        for t in 0..t {
            for j in 0..k {
                let chosen = rp.experts[t * k + j] == e;
                let is_kept = kept.contains(&(t, j));
                if chosen && !is_kept {
                    assert!(rp.probs[t * e_n + e] <= min_kept, "expert {e} token {t}");
                }
            }
        }
    }
    assert_eq!(rp.dropped(), rt.dropped(), "the same number dropped");
    assert_ne!(rp.assigned, rt.assigned, "but other assignments");
}

#[test]
fn deterministic_init() {
    let m = Model::new(ModelConfig::preset("tiny").unwrap()).unwrap();
    let a = m.init_params(42);
    assert_eq!(a, m.init_params(42));
    assert_ne!(a, m.init_params(43));
    let w = m
        .layout
        .get("model.layers.0.mlp.up_proj.weight")
        .unwrap()
        .view
        .of(&a);
    let std = (w.iter().map(|x| x * x).sum::<f32>() / w.len() as f32).sqrt();
    assert!((std - 0.02).abs() < 0.001, "std {std}");
    assert!(m
        .layout
        .get("model.norm.weight")
        .unwrap()
        .view
        .of(&a)
        .iter()
        .all(|&x| x == 1.0));
}

#[test]
fn layout_blocks_are_contiguous_ranges() {
    for name in ["tiny", "tiny-moe", "small"] {
        let c = ModelConfig::preset(name).unwrap();
        let l = model::ParamLayout::new(&c);
        let mut end = l.embed_range().end;
        for i in 0..l.num_blocks() {
            let r = l.block_range(i);
            assert_eq!(r.start, end);
            let inside: usize = l.entries_in(r.clone()).map(|e| e.view.numel()).sum();
            assert_eq!(inside, r.len());
            assert!(l
                .entries_in(r.clone())
                .all(|e| e.name.starts_with(&format!("model.layers.{i}."))));
            end = r.end;
        }
        assert_eq!(l.head_range().start, end);
        assert_eq!(l.head_range().end, l.total());
    }
}

fn tmp(name: &str) -> std::path::PathBuf {
    std::env::temp_dir().join(format!("xtrain-model-{}-{name}", std::process::id()))
}

#[test]
fn safetensors_round_trip() {
    let m = Model::new(cfg(true)).unwrap();
    let p = m.init_params(5);
    let path = tmp("rt.safetensors");
    save_params(&m.layout, &p, &path, false).unwrap();
    assert_eq!(model::io::load_params(&m.layout, &path).unwrap(), p);
    save_params(&m.layout, &p, &path, true).unwrap();
    let q = model::io::load_params(&m.layout, &path).unwrap();
    assert!(p
        .iter()
        .zip(&q)
        .all(|(a, b)| (a - b).abs() <= a.abs() / 128.0));
    std::fs::remove_file(&path).ok();
    // The Mixtral golden file saves back with exactly the same names, shapes and bytes.
    let dir = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/data/golden");
    let f = WeightsFile::open(&dir.join("mixtral_tiny.safetensors")).unwrap();
    let j: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("mixtral_tiny.json")).unwrap())
            .unwrap();
    let mm = Model::new(ModelConfig::from_json_str(&j["config"].to_string()).unwrap()).unwrap();
    let mut w = vec![0.0; mm.num_params()];
    f.load_into(&mm.layout, "", &mut w).unwrap();
    let back = WeightsFile::from_bytes(params_to_safetensors(&mm.layout, &w, false, None).unwrap())
        .unwrap();
    for e in &mm.layout.entries {
        assert_eq!(
            back.f32(&e.name).unwrap(),
            f.f32(&e.name).unwrap(),
            "{}",
            e.name
        );
    }
}

#[test]
fn bad_weights_files_are_errors() {
    let m = Model::new(cfg(false)).unwrap();
    let p = m.init_params(6);
    let good = params_to_safetensors(&m.layout, &p, false, None).unwrap();
    // Missing tensor: a model with one more layer needs tensors the file lacks.
    let mut bigger = cfg(false);
    bigger.num_hidden_layers = 4;
    let mb = Model::new(bigger).unwrap();
    let f = WeightsFile::from_bytes(good.clone()).unwrap();
    let mut buf = vec![0.0; mb.num_params()];
    match f.load_into(&mb.layout, "", &mut buf) {
        Err(ModelError::MissingTensor(n)) => assert!(n.starts_with("model.layers.3."), "{n}"),
        other => panic!("expected MissingTensor, got {other:?}"),
    }
    // Wrong shape: a model with a wider FFN.
    let mut wide = cfg(false);
    wide.intermediate_size = 44;
    let mw = Model::new(wide).unwrap();
    let mut buf = vec![0.0; mw.num_params()];
    assert!(matches!(
        f.load_into(&mw.layout, "", &mut buf),
        Err(ModelError::ShapeMismatch { .. })
    ));
    // Wrong buffer length, corrupt bytes, missing file.
    assert!(matches!(
        f.load_into(&m.layout, "", &mut [0.0; 3]),
        Err(ModelError::BufferSize { .. })
    ));
    assert!(matches!(
        WeightsFile::from_bytes(good[..good.len() / 2].to_vec()),
        Err(ModelError::Safetensors(_))
    ));
    assert!(matches!(
        WeightsFile::from_bytes(vec![1, 2, 3]),
        Err(ModelError::Safetensors(_))
    ));
    assert!(matches!(
        WeightsFile::open(&tmp("nope")),
        Err(ModelError::Io { .. })
    ));
}

#[test]
fn impossible_configs_are_errors() {
    let base = ModelConfig::llama(64, 32, 40, 2, 4, 2);
    let cases: Vec<(&str, ModelConfig)> = vec![
        (
            "kv heads",
            ModelConfig {
                num_key_value_heads: Some(3),
                ..base.clone()
            },
        ),
        (
            "hidden/heads",
            ModelConfig {
                hidden_size: 30,
                ..base.clone()
            },
        ),
        (
            "zero vocab",
            ModelConfig {
                vocab_size: 0,
                ..base.clone()
            },
        ),
        (
            "zero layers",
            ModelConfig {
                num_hidden_layers: 0,
                ..base.clone()
            },
        ),
        (
            "zero heads",
            ModelConfig {
                num_attention_heads: 0,
                ..base.clone()
            },
        ),
        ("odd head dim", ModelConfig::llama(64, 36, 40, 2, 4, 2)),
        ("top-k", base.clone().with_experts(2, 3)),
        ("top-k zero", base.clone().with_experts(4, 0)),
        (
            "capacity",
            ModelConfig {
                capacity_factor: Some(0.0),
                ..base.clone().with_experts(4, 2)
            },
        ),
        (
            "eps",
            ModelConfig {
                rms_norm_eps: 0.0,
                ..base.clone()
            },
        ),
    ];
    for (what, c) in cases {
        assert!(
            matches!(c.validate(), Err(ModelError::InvalidConfig(_))),
            "{what}"
        );
        assert!(Model::new(c).is_err(), "{what}");
    }
    assert!(matches!(
        ModelConfig::from_json_str("{\"vocab_size\": 3}"),
        Err(ModelError::ConfigParse(_))
    ));
    assert!(ModelConfig::preset("huge").is_err());
    // A real HF config.json with extra fields parses.
    let hf = r#"{"architectures":["MixtralForCausalLM"],"vocab_size":100,"hidden_size":32,
        "intermediate_size":64,"num_hidden_layers":1,"num_attention_heads":4,"num_key_value_heads":2,
        "rms_norm_eps":1e-5,"rope_theta":1e6,"num_local_experts":8,"num_experts_per_tok":2,
        "torch_dtype":"bfloat16","router_aux_loss_coef":0.02,"output_router_logits":false}"#;
    let c = ModelConfig::from_json_str(hf).unwrap();
    assert_eq!((c.num_local_experts, c.effective_aux_coef()), (8, 0.0));
}

#[test]
fn bad_batches_are_errors() {
    let m = Model::new(cfg(false)).unwrap();
    let p = m.init_params(7);
    assert!(Batch::next_token(2, 5, &[1, 2, 3]).is_err());
    assert!(Batch::new(0, 5, vec![], vec![]).is_err());
    let bad_id = Batch::next_token(1, 3, &[1, 999, 2]).unwrap();
    let mut g = vec![0.0; m.num_params()];
    assert!(matches!(
        m.forward_backward(&p, &mut g, &bad_id, &StepOptions::default(), &mut |_| {}),
        Err(ModelError::InvalidBatch(_))
    ));
    let bad_target = Batch::new(1, 2, vec![1, 2], vec![3, 4000]).unwrap();
    assert!(matches!(
        m.forward_backward(
            &p,
            &mut g,
            &bad_target,
            &StepOptions::default(),
            &mut |_| {}
        ),
        Err(ModelError::Tensor(_))
    ));
    assert!(matches!(
        m.forward_backward(
            &p,
            &mut g[..5],
            &batch(),
            &StepOptions::default(),
            &mut |_| {}
        ),
        Err(ModelError::BufferSize { .. })
    ));
}

#[test]
fn decay_segments_cover_shards() {
    let c = ModelConfig::preset("tiny").unwrap();
    let l = model::ParamLayout::new(&c);
    // A shard cutting through tensors: segments tile it exactly, norms get their own decay.
    let shard = 1000..l.total() - 777;
    let segs = l.decay_segments(shard.clone(), 0.1, 0.0);
    assert_eq!(segs.first().unwrap().0.start, 0);
    assert_eq!(segs.last().unwrap().0.end, shard.len());
    assert!(segs
        .windows(2)
        .all(|w| w[0].0.end == w[1].0.start && w[0].1 != w[1].1));
    let norm = l
        .get("model.layers.1.input_layernorm.weight")
        .unwrap()
        .view
        .range();
    let local = norm.start - shard.start;
    assert!(segs.iter().any(|(r, wd)| r.contains(&local) && *wd == 0.0));
}

/// RoPE makes attention depend on relative positions only, so shifting every position by the
/// same offset (a pipeline / context-parallel chunk convention) leaves a block's output unchanged
/// up to rounding of the rotation angles.
#[test]
fn position_offset_is_relative() {
    let m = Model::new(cfg(false)).unwrap();
    let p = m.init_params(8);
    let pb = &p[m.layout.block_range(0)];
    let pass = Pass::new(2, 9);
    let mut r = model::init::SplitMix64::new(2);
    let x: Vec<f32> = (0..pass.tokens() * 32)
        .map(|_| r.next_normal() as f32)
        .collect();
    let (y0, _) = m
        .block_forward(0, pb, Arc::new(x.clone().into()), &pass)
        .unwrap();
    let shifted = Pass {
        part: model::layers::SeqPart::Offset(7),
        ..pass
    };
    let (y1, _) = m
        .block_forward(0, pb, Arc::new(x.into()), &shifted)
        .unwrap();
    let (y0, y1) = (y0.to_vec().unwrap(), y1.to_vec().unwrap());
    let err = y0
        .iter()
        .zip(&y1)
        .fold(0.0f32, |a, (u, v)| a.max((u - v).abs()));
    assert!(err < 1e-5, "{err}");
}

/// `BlockCache::bytes` counts exactly the buffers a dense block saves for backward:
/// x, xn1, h, xn2 `[T, H]`; rstd1, rstd2 `[T]`; q, o `[T, Hq·D]`; k, v `[T, Hkv·D]`;
/// lse `[B·Hq·S]`; g, u, s `[T, F]` (s dropped under selective recomputation).
#[test]
fn block_cache_bytes_count_every_saved_buffer() {
    let cfg = ModelConfig::llama(40, 16, 24, 1, 4, 2);
    let m = Model::new(cfg.clone()).unwrap();
    let p = m.init_params(1);
    let (b, s) = (2, 5);
    let t = b * s;
    let (h, f, d) = (16, 24, 4);
    let pb = &p[m.layout.block_range(0)];
    let x = Arc::new(model::layers::Buf::Host(vec![0.1f32; t * h]));
    let (_, full) = m.block_forward(0, pb, x.clone(), &Pass::new(b, s)).unwrap();
    let want = 4 * (4 * t * h + 2 * t + 2 * t * 4 * d + 2 * t * 2 * d + b * 4 * s + 3 * t * f);
    assert_eq!(full.bytes(), want);
    let sel = Pass::new(b, s).with_recompute(Recompute::Selective);
    let (_, c) = m.block_forward(0, pb, x.clone(), &sel).unwrap();
    assert_eq!(c.bytes(), want - 4 * (2 * t * h + t * f));
    let none = Pass::new(b, s).with_recompute(Recompute::Full);
    let (_, c) = m.block_forward(0, pb, x, &none).unwrap();
    assert_eq!(c.bytes(), 4 * t * h);
}

/// Auxiliary-loss-free balancing: a router that sends every token to experts 0 and 1 (their
/// rows pulled towards the all-positive tokens), with the bias updated by `balance_bias` from
/// each routing's loads, spreads the tokens: max/mean load from 4 (2 of 8 experts take
/// everything) to below 1.5 on average over updates 180–200 (sign updates oscillate around
/// the balance), while the weights stay the probabilities'.
#[test]
fn moe_bias_balancing_evens_the_loads() {
    use model::layers::moe::balance_bias;
    let mut c = ModelConfig::llama(40, 16, 24, 1, 4, 2).with_experts(8, 2);
    c.router_bias = true;
    let m = Model::new(c).unwrap();
    let mut p = m.init_params(3);
    let w = m
        .layout
        .get("model.layers.0.mlp.gate.weight")
        .unwrap()
        .view
        .clone();
    let wr = w.of_mut(&mut p);
    // The initialised router (rows of small random weights) plus a strong pull of every
    // positive token to experts 0 and 1.
    wr[..32].iter_mut().for_each(|v| *v += 0.1);
    let model::layers::block::Ffn::Moe(moe) = &m.blocks[0].ffn else {
        panic!("a MoE block")
    };
    let pb = &p[m.layout.block_range(0)];
    let mut r = model::init::SplitMix64::new(1);
    let x: Vec<f32> = (0..64 * 16)
        .map(|_| r.next_normal().abs() as f32 + 0.1)
        .collect();
    let imbalance = |counts: &[usize]| {
        let mean = counts.iter().sum::<usize>() as f64 / counts.len() as f64;
        *counts.iter().max().unwrap() as f64 / mean
    };
    let first = moe.route(pb, &x).unwrap();
    assert_eq!(imbalance(&first.counts), 4.0, "{:?}", first.counts);
    let bias = moe.bias.as_ref().unwrap().clone();
    let mut last = first.clone();
    let mut tail = Vec::new();
    for i in 0..200 {
        last = moe.route(pb, &x).unwrap();
        if i >= 180 {
            tail.push(imbalance(&last.counts));
        }
        let loads: Vec<u64> = last.counts.iter().map(|&c| c as u64).collect();
        balance_bias(&mut bias.write().unwrap(), &loads, 0.001);
    }
    let settled = tail.iter().sum::<f64>() / tail.len() as f64;
    assert!(settled < 1.5, "{settled}: {:?}", last.counts);
    // The weights are the chosen experts' probabilities, renormalised.
    for t in 0..64 {
        let pr = &last.probs[t * 8..(t + 1) * 8];
        let chosen = &last.experts[t * 2..t * 2 + 2];
        let s: f32 = chosen.iter().map(|&e| pr[e]).sum();
        for j in 0..2 {
            assert!((last.weights[t * 2 + j] - pr[chosen[j]] / s).abs() < 1e-6);
        }
    }
}
