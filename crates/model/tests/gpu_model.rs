//! The whole model on a GPU against the same model on the CPU (the reference): a Llama config
//! (GQA, 2 layers) and Mixtral configs (8 experts, top-2, the auxiliary loss; one with a shared
//! expert and capacity drops), one forward/backward on the same parameters and batch (loss,
//! and every gradient within 1e-4 of the largest; plain batches and batches packed with
//! documents), then ten AdamW steps with the optimizer on
//! the device (every loss, each step's gradients against the CPU's on the device's parameters
//! of that step, and the parameters after every step within 1e-4 relative; a failure names the
//! step and the tensor). fp32 throughout, no TF32. Skipped with one line where no GPU is found (a failure under `XTRAIN_REQUIRE_GPU=1`).
use model::optim::{clip_factor, grad_sq_sum, scale_grads, AdamW};
use model::{Batch, Model, ModelConfig, StepOptions};
use tensor::buf::{Buf, Dev};
use tensor::cuda::ops::{adamw, AdamScalars};

#[path = "../../tensor/tests/cuda_emu/mod.rs"]
mod cuda_emu;

/// The tests of this file again on the CPU emulation of a CUDA device
/// (`tensor/tests/cuda_emu`): the whole model on the device's code path, GPU or not.
#[test]
fn every_model_test_on_the_emulated_device() {
    cuda_emu::rerun_on_emulated_device(
        "the GPU model tests (model/tests/gpu_model.rs)",
        &["every_model_test_on_the_emulated_device"],
    );
}

fn gpu() -> Option<Dev> {
    match Dev::open("cuda") {
        Ok(d) => Some(d),
        Err(e) => {
            tensor::skip::skip(
                "the whole-model GPU tests (model/tests/gpu_model.rs)",
                "gpu",
                &format!("no GPU: {e}"),
            );
            None
        }
    }
}

fn batch(cfg: &ModelConfig, step: usize) -> Batch {
    let (b, s) = (2, 16);
    let ids: Vec<u32> = (0..b * s)
        .map(|i| {
            (((i + 31 * step) as u64).wrapping_mul(0x9E3779B97F4A7C15) >> 40) as u32
                % cfg.vocab_size as u32
        })
        .collect();
    Batch::next_token(b, s, &ids).unwrap()
}

/// [`batch`] packed with documents: row 0 opens documents at 5, 6 and 11, row 1 at 8; with
/// `restart` RoPE positions restart at each document (`data.document_positions`).
fn batch_with_documents(cfg: &ModelConfig, restart: bool) -> Batch {
    let (b, s) = (2, 16);
    let opens: [&[usize]; 2] = [&[0, 5, 6, 11], &[0, 8]];
    let start: Vec<usize> = opens
        .iter()
        .flat_map(|o| (0..s).map(|p| o.iter().copied().filter(|&x| x <= p).max().unwrap()))
        .collect();
    let docs = model::Documents::new(b, s, start, restart).unwrap();
    batch(cfg, 0).with_documents(docs).unwrap()
}

fn rel(a: &[f32], b: &[f32]) -> f32 {
    let scale = b.iter().fold(0.0f32, |m, x| m.max(x.abs())).max(1e-30);
    a.iter()
        .zip(b)
        .fold(0.0f32, |m, (x, y)| m.max((x - y).abs()))
        / scale
}

/// The tiny preset's shape: vocab 256, hidden 64, ffn 176, 2 layers, 4 heads over 2 KV heads.
fn dense() -> ModelConfig {
    ModelConfig::llama(256, 64, 176, 2, 4, 2)
}

/// The same shape as a mixture of 8 experts (top-2, experts of 96, the auxiliary loss on);
/// with `extras` a shared expert of 64 and capacity 1.0 (assignments dropped).
fn moe(extras: bool) -> ModelConfig {
    let mut c = dense();
    c.num_local_experts = 8;
    c.num_experts_per_tok = 2;
    c.moe_intermediate_size = Some(96);
    c.output_router_logits = true;
    c.router_aux_loss_coef = 0.02;
    if extras {
        c.shared_expert_intermediate_size = Some(64);
        c.capacity_factor = Some(1.0);
    }
    c
}

/// The dense shape with tied embeddings and Llama 3's RoPE scaling (the head reads and the
/// embedding's gradient sums both uses; the rotation tables come from the scaled frequencies).
fn tied_rope3() -> ModelConfig {
    let mut c = dense();
    c.tie_word_embeddings = true;
    c.rope_scaling = Some(model::config::RopeScaling::llama3(8.0, 1.0, 4.0, 256));
    c
}

fn configs() -> [ModelConfig; 4] {
    [dense(), moe(false), moe(true), tied_rope3()]
}

/// One forward and backward, on plain batches and on batches packed with documents (the
/// attention kernels' document mask, with and without restarted positions).
#[test]
fn one_step_matches_the_cpu() {
    let Some(dev) = gpu() else { return };
    let cases = configs().into_iter().flat_map(|cfg| {
        [
            batch(&cfg, 0),
            batch_with_documents(&cfg, false),
            batch_with_documents(&cfg, true),
        ]
        .map(|b| (cfg.clone(), b))
    });
    for (cfg, b) in cases {
        let m = Model::new(cfg.clone()).unwrap();
        let p = m.init_params(3);
        let mut g = vec![0.0; p.len()];
        let want = m
            .forward_backward(&p, &mut g, &b, &StepOptions::default(), &mut |_| {})
            .unwrap();
        let pd = dev.from_vec(p.clone()).unwrap();
        let mut gd = dev.zeros(p.len()).unwrap();
        let got = m
            .forward_backward(&pd, &mut gd, &b, &StepOptions::default(), &mut |_| {})
            .unwrap();
        assert!(
            (got.loss - want.loss).abs() <= 1e-5 * want.loss.abs(),
            "loss {} vs {}",
            got.loss,
            want.loss
        );
        let e = rel(&gd.to_vec().unwrap(), &g);
        assert!(
            e <= 1e-4,
            "{cfg:?} (documents: {}): gradients differ by {e:e} of the largest",
            b.docs.is_some()
        );
    }
}

/// Ten steps of clipping + AdamW with the update on the device (`tensor::cuda::ops::adamw`,
/// the same operations as `AdamW::update`).
#[test]
fn ten_adamw_steps_match_the_cpu() {
    let Some(dev) = gpu() else { return };
    for cfg in configs() {
        ten_steps(&dev, cfg);
    }
}

fn ten_steps(dev: &Dev, cfg: ModelConfig) {
    let m = Model::new(cfg.clone()).unwrap();
    // AdamW's eps at 1e-4, as in the layouts' parity tests: an update is lr·m̂/(√v̂ + eps),
    // whose sensitivity to a gradient element g is lr/eps where |g| ≲ eps, so with 1e-8 a
    // gradient difference of 1e-9 (fp32 reassociation of a near-zero element) becomes a tenth
    // of a learning rate. Measured on an H200 with 1e-8: every step's gradients within 1e-4 of
    // the largest, yet the Mixtral config's parameters 1.2e-3 apart after step 4, in one
    // element of an embedding row first seen at that step (0.00635 vs 0.00513, lr 3e-3).
    // With 1e-4 the same gradient difference moves an update by lr·1e-5 at most.
    let opt = AdamW {
        lr: 3e-3,
        weight_decay: 0.1,
        eps: 1e-4,
        ..AdamW::default()
    };
    let mut p = m.init_params(3);
    let (mut mo, mut v) = (vec![0.0; p.len()], vec![0.0; p.len()]);
    let mut pd = dev.from_vec(p.clone()).unwrap();
    let (mut md, mut vd) = (dev.zeros(p.len()).unwrap(), dev.zeros(p.len()).unwrap());
    let segments = [(p.len(), 1.0 - opt.lr * opt.weight_decay)];
    for step in 0..10 {
        let b = batch(&cfg, step);
        let p_before = pd.to_vec().unwrap();
        let mut g = vec![0.0; p.len()];
        let want = m
            .forward_backward(&p, &mut g, &b, &StepOptions::default(), &mut |_| {})
            .unwrap();
        let (_, coef) = clip_factor(grad_sq_sum(&g), 1.0);
        scale_grads(&mut g, coef);
        opt.update(
            step as u64 + 1,
            opt.lr,
            opt.weight_decay,
            &mut p,
            &g,
            &mut mo,
            &mut v,
        );

        let mut gd = dev.zeros(p.len()).unwrap();
        let got = m
            .forward_backward(&pd, &mut gd, &b, &StepOptions::default(), &mut |_| {})
            .unwrap();
        assert!(
            (got.loss - want.loss).abs() <= 1e-4 * want.loss.abs(),
            "{cfg:?} step {step}: loss {} vs {}",
            got.loss,
            want.loss
        );
        // The gradients of this step first (before clipping): a mismatch here names the
        // step and tensor where the device's forward/backward departs, rather than leaving
        // only the parameters after ten steps to show it.
        let gh = gd.to_vec().unwrap();
        let mut g_cpu = vec![0.0; p.len()];
        m.forward_backward(
            &p_before,
            &mut g_cpu,
            &b,
            &StepOptions::default(),
            &mut |_| {},
        )
        .unwrap();
        let e = rel(&gh, &g_cpu);
        assert!(
            e <= 1e-4,
            "{cfg:?} step {step}: gradients differ by {e:e} of the largest, worst in {}",
            worst_tensor(&m, &gh, &g_cpu)
        );
        let sq = tensor::ops::sq_sum(gd.r()).unwrap();
        let (_, coef) = clip_factor(sq, 1.0);
        tensor::ops::scale(gd.m(), coef).unwrap();
        let s = AdamScalars::new(opt.beta1, opt.beta2, opt.eps, opt.lr, step as u64 + 1);
        let (Buf::Cuda(pdb), Buf::Cuda(gdb), Buf::Cuda(mdb), Buf::Cuda(vdb)) =
            (&mut pd, &gd, &mut md, &mut vd)
        else {
            unreachable!("device buffers")
        };
        adamw(pdb, gdb, mdb, vdb, &segments, s).unwrap();
        let got = pd.to_vec().unwrap();
        let e = rel(&got, &p);
        assert!(
            e <= 1e-4,
            "{cfg:?}: parameters after step {step} differ by {e:e}, worst in {}",
            worst_tensor(&m, &got, &p)
        );
    }
}

/// The tensor holding the largest difference between `a` and `b`, its index in the tensor,
/// both values and the tensor's largest magnitude in `b`.
fn worst_tensor(m: &Model, a: &[f32], b: &[f32]) -> String {
    let (i, _) = a
        .iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .enumerate()
        .fold((0, -1.0f32), |w, (i, d)| if d > w.1 { (i, d) } else { w });
    let entry = m
        .layout
        .entries
        .iter()
        .find(|e| e.view.range().contains(&i));
    match entry {
        Some(e) => {
            let r = e.view.range();
            let largest = b[r.clone()].iter().fold(0.0f32, |w, x| w.max(x.abs()));
            format!(
                "{} [{}]: {} vs {} (largest there {largest})",
                e.name,
                i - r.start,
                a[i],
                b[i]
            )
        }
        None => format!("element {i}"),
    }
}
