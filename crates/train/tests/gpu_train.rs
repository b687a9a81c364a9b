//! Training (and generating) on a GPU through the one trainer and executor, against the same
//! run on the CPU: the tiny, small and moe-small presets (fp32, no TF32), ten AdamW steps —
//! every loss within 1e-4 relative and the final parameters within 1e-4 of the largest; bf16
//! and fp16 under the same 16-bit rule on both devices (bounds from the formats); checkpoints
//! crossing devices — one written on the CPU continues on the GPU, and one written on the GPU
//! continues on the CPU, each with the uninterrupted run's losses (1e-4); and greedy
//! generation from a checkpoint; packed documents under the document mask; data parallelism
//! (ZeRO 0-3), tensor, context and pipeline parallelism on one GPU shared by ranks as
//! threads, against the single-GPU run; ZeRO-Offload against the optimizer on the GPU.
//! Skipped with one line where no GPU is found (a failure under `XTRAIN_REQUIRE_GPU=1`).
use std::path::{Path, PathBuf};

use train::trainer::Trainer;
use train::RunConfig;

mod common;

#[path = "../../tensor/tests/cuda_emu/mod.rs"]
mod cuda_emu;

/// The tests of this file again on the CPU emulation of a CUDA device
/// (`tensor/tests/cuda_emu`), but those that train the fp32 presets for many steps: fp32
/// attention's kernels take a warp a query row and shuffle for every key, a barrier of 32
/// emulated threads each time, minutes a test there (they have run on a GPU: docs/GPU.md).
/// bf16 and fp16 training, the delayed update, generation and the one-rank NCCL paths run.
#[test]
fn every_light_training_test_on_the_emulated_device() {
    cuda_emu::rerun_on_emulated_device(
        "the GPU training tests (train/tests/gpu_train.rs)",
        &[
            "every_light_training_test_on_the_emulated_device",
            "ten_steps_on_the_gpu_match_the_cpu",
            "layouts_on_one_gpu_match_one_gpu",
            "document_masks_train_on_the_gpu_as_on_the_cpu",
            "checkpoints_cross_devices_with_the_uninterrupted_losses",
            "offloaded_optimizer_on_the_gpu_matches_the_resident_one",
        ],
    );
}

fn has_gpu() -> bool {
    match tensor::buf::Dev::open("cuda") {
        Ok(_) => true,
        Err(e) => {
            tensor::skip::skip(
                "the GPU training tests (train/tests/gpu_train.rs)",
                "gpu",
                &format!("no GPU: {e}"),
            );
            false
        }
    }
}

fn config(preset: &str, device: &str) -> RunConfig {
    config_with(preset, device, &[])
}

fn config_with(preset: &str, device: &str, extra: &[String]) -> RunConfig {
    let o: Vec<String> = [
        "train.steps=10",
        "train.warmup_steps=2",
        "train.eval_batches=0",
        "data.corpus_bytes=20000",
        // fp32 on either device (a GPU's default is bf16); `extra` may choose another.
        "train.precision=\"fp32\"",
    ]
    .iter()
    .map(|s| s.to_string())
    .chain([format!("train.device=\"{device}\"")])
    .chain(extra.iter().cloned())
    .collect();
    RunConfig::resolve(preset, None, &o).unwrap()
}

/// `steps` losses of a run on `device`, from checkpoint `from` if given, saving to `save` at
/// the end; with the final parameters.
fn run(
    preset: &str,
    device: &str,
    from: Option<&Path>,
    steps: usize,
    save: Option<&Path>,
) -> (Vec<f64>, Vec<f32>) {
    run_cfg(config(preset, device), from, steps, save)
}

fn run_cfg(
    cfg: RunConfig,
    from: Option<&Path>,
    steps: usize,
    save: Option<&Path>,
) -> (Vec<f64>, Vec<f32>) {
    comm::testing::run_threads(1, |c| {
        let mut t = match from {
            Some(ck) => Trainer::resume(cfg.clone(), ck, &c).unwrap(),
            None => Trainer::new(cfg.clone(), &c).unwrap(),
        };
        let losses = (0..steps).map(|_| t.train_step().unwrap().loss).collect();
        if let Some(dir) = save {
            t.save_checkpoint(dir).unwrap();
        }
        (losses, t.exec.full_params().unwrap())
    })
    .remove(0)
}

fn close(what: &str, got: &[f64], want: &[f64]) {
    for (s, (a, b)) in got.iter().zip(want).enumerate() {
        assert!(
            (a - b).abs() <= 1e-4 * b.abs(),
            "{what} step {s}: {a} vs {b}"
        );
    }
}

fn tmp(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("xtrain-gpu-train-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

#[test]
fn ten_steps_on_the_gpu_match_the_cpu() {
    if !has_gpu() {
        return;
    }
    for preset in ["tiny", "small", "moe-small"] {
        let (cpu, p_cpu) = run(preset, "cpu", None, 10, None);
        let (gpu, p_gpu) = run(preset, "cuda", None, 10, None);
        close(&format!("{preset}: gpu vs cpu"), &gpu, &cpu);
        close_params(preset, &p_gpu, &p_cpu, 1e-4);
    }
}

/// Packed documents (`data.document_mask`, with and without restarted positions) train on the
/// GPU as on the CPU: the CUDA attention kernels' document mask (fp32) against the CPU's, ten
/// steps on a shard folder of short documents (a window of 64 tokens holds several).
#[test]
fn document_masks_train_on_the_gpu_as_on_the_cpu() {
    if !has_gpu() {
        return;
    }
    use train::data::prepare::{prepare, PrepareOptions};
    let d = tmp("documents");
    std::fs::create_dir_all(&d).unwrap();
    let texts: String = (0..200)
        .map(|k| {
            let text = format!("doc {k}: {} end", "to be or not ".repeat(1 + k % 4));
            serde_json::json!({ "text": text }).to_string() + "\n"
        })
        .collect();
    let src = d.join("docs.jsonl");
    std::fs::write(&src, texts).unwrap();
    let shards = d.join("shards");
    let opts = PrepareOptions {
        field: "text".into(),
        shard_tokens: 4096,
        tokenizer_name: "byte".into(),
        eos: None,
        bos: None,
        progress: false,
    };
    prepare(&[src], &train::data::Tokenizer::Byte, &shards, &opts).unwrap();
    for positions in [false, true] {
        let extra = [
            format!("data.path=\"{}\"", shards.display()),
            "data.document_mask=true".into(),
            format!("data.document_positions={positions}"),
            "model.seq_len=64".into(),
        ];
        let (cpu, p_cpu) = run_cfg(config_with("tiny", "cpu", &extra), None, 10, None);
        let (gpu, p_gpu) = run_cfg(config_with("tiny", "cuda", &extra), None, 10, None);
        let what = format!("documents (positions restarted: {positions})");
        close(&format!("{what}: gpu vs cpu"), &gpu, &cpu);
        close_params(&what, &p_gpu, &p_cpu, 1e-4);
    }
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn checkpoints_cross_devices_with_the_uninterrupted_losses() {
    if !has_gpu() {
        return;
    }
    let d = tmp("cross");
    let (straight, _) = run("tiny", "cpu", None, 10, None);
    for (first, second) in [("cpu", "cuda"), ("cuda", "cpu")] {
        let ck = d.join(format!("{first}-ck"));
        let (a, _) = run("tiny", first, None, 5, Some(&ck));
        let (b, _) = run("tiny", second, Some(&ck), 5, None);
        close(
            &format!("{first} then {second}"),
            &[a, b].concat(),
            &straight,
        );
    }
    let _ = std::fs::remove_dir_all(&d);
}

/// bf16 and fp16 training (16-bit weights and gradients, fp32 master weights and moments;
/// fp16 with dynamic loss scaling) on the GPU against the CPU. The GPU feeds its products
/// 16-bit operands (tensor cores, fp32 accumulation: `tensor::operands`), the CPU computes them
/// in fp32 from the same 16-bit weights. Tolerance, from the formats: an operand rounded to
/// 16 bits is within 2^-8 of itself for bf16 (8 significand bits; fp16 2^-11), so the
/// products, and the loss, a smooth function of them, agree within 2^-8 relative. An AdamW
/// update is lr·m̂/(√v̂ + ε): gradients 2^-8 apart move it by at most about 2^-8·lr, so after
/// n steps the master weights agree within n·lr·2^-8 (the bound doubles it, 2^-7, for the
/// first steps' bias correction) — except where a gradient element is itself below the
/// operands' rounding: its sign is then the rounding's, and AdamW turns it into a full ±lr
/// step either way. Such elements are few, so the bound holds for the root mean square of the
/// differences, not for the largest one (which is only bounded by 2·n·lr). Measured on the
/// CPU, rounding the products' operands to bf16 or not (tiny, 10 steps, lr 3e-3): losses
/// within 1.7e-5 relative, RMS 7.2e-5 against the bound 2.3e-4, largest 6.5e-3 (0.6 % of the
/// weights above the bound).
#[test]
fn sixteen_bit_training_on_the_gpu_matches_the_cpu() {
    if !has_gpu() {
        return;
    }
    let steps = 10;
    for precision in ["bf16", "fp16"] {
        let extra = [format!("train.precision=\"{precision}\"")];
        let (cpu, p_cpu) = run_cfg(config_with("tiny", "cpu", &extra), None, steps, None);
        let (gpu, p_gpu) = run_cfg(config_with("tiny", "cuda", &extra), None, steps, None);
        let lr = config("tiny", "cpu").train.lr;
        assert_16_bit_close(precision, (&gpu, &p_gpu), (&cpu, &p_cpu), lr);
    }
}

/// 16-bit training on the GPU (`gpu`: losses, master weights) against the CPU (`cpu`) after
/// as many steps as there are losses at peak learning rate `lr`, by the bounds of
/// [`sixteen_bit_training_on_the_gpu_matches_the_cpu`].
fn assert_16_bit_close(what: &str, gpu: (&[f64], &[f32]), cpu: (&[f64], &[f32]), lr: f64) {
    let ((gpu, p_gpu), (cpu, p_cpu)) = (gpu, cpu);
    let steps = cpu.len();
    for (s, (a, b)) in gpu.iter().zip(cpu).enumerate() {
        assert!(
            (a - b).abs() <= b.abs() / 256.0,
            "{what} step {s}: loss {a} vs {b}"
        );
    }
    let bound = steps as f64 * lr / 128.0;
    let sq: f64 = p_gpu
        .iter()
        .zip(p_cpu)
        .map(|(a, b)| ((a - b) as f64).powi(2))
        .sum();
    let rms = (sq / p_cpu.len() as f64).sqrt();
    assert!(
        rms <= bound,
        "{what}: master weights differ by {rms:e} (root mean square; bound {bound:e})"
    );
    let largest = p_gpu
        .iter()
        .zip(p_cpu)
        .fold(0.0f64, |m, (a, b)| m.max((a - b).abs() as f64));
    assert!(
        largest <= 2.0 * steps as f64 * lr,
        "{what}: a master weight moved {largest:e} apart, more than {steps} AdamW steps can"
    );
}

/// The layouts of [`layouts_on_one_gpu_match_one_gpu`], each with 4 sequences per step.
const GPU_LAYOUTS: [(&str, usize, &[&str]); 15] = [
    ("single", 1, &["train.grad_accum=4"]),
    ("dp2 ZeRO-0", 2, &["parallel.dp=2", "train.grad_accum=2"]),
    (
        "dp2 ZeRO-1",
        2,
        &["parallel.dp=2", "parallel.zero=1", "train.grad_accum=2"],
    ),
    (
        "dp2 ZeRO-2",
        2,
        &["parallel.dp=2", "parallel.zero=2", "train.grad_accum=2"],
    ),
    (
        "dp2 ZeRO-3",
        2,
        &["parallel.dp=2", "parallel.zero=3", "train.grad_accum=2"],
    ),
    (
        "pp2 1F1B",
        2,
        &[
            "parallel.pp=2",
            "parallel.schedule=\"1f1b\"",
            "train.grad_accum=4",
        ],
    ),
    (
        "pp2 ZB-V",
        2,
        &[
            "parallel.pp=2",
            "parallel.schedule=\"zb-v\"",
            "train.grad_accum=4",
        ],
    ),
    (
        "pp2 x dp2 ZeRO-1 1F1B",
        4,
        &[
            "parallel.pp=2",
            "parallel.dp=2",
            "parallel.zero=1",
            "parallel.schedule=\"1f1b\"",
            "train.grad_accum=2",
        ],
    ),
    ("tp2", 2, &["parallel.tp=2", "train.grad_accum=4"]),
    (
        "tp2 + sp",
        2,
        &["parallel.tp=2", "parallel.sp=true", "train.grad_accum=4"],
    ),
    (
        "tp2 + sp x dp2 ZeRO-2",
        4,
        &[
            "parallel.tp=2",
            "parallel.sp=true",
            "parallel.dp=2",
            "parallel.zero=2",
            "train.grad_accum=2",
        ],
    ),
    ("cp2 ring", 2, &["parallel.cp=2", "train.grad_accum=4"]),
    (
        "cp2 all-gather",
        2,
        &[
            "parallel.cp=2",
            "parallel.cp_comm=\"allgather\"",
            "train.grad_accum=4",
        ],
    ),
    (
        "cp2 x tp2 + sp",
        4,
        &[
            "parallel.cp=2",
            "parallel.tp=2",
            "parallel.sp=true",
            "train.grad_accum=4",
        ],
    ),
    (
        "dp4 ZeRO-3",
        4,
        &["parallel.dp=4", "parallel.zero=3", "train.grad_accum=1"],
    ),
];

/// Data parallelism at every ZeRO stage, tensor (+ sequence), context and pipeline parallelism
/// on one GPU, `nproc` ranks as threads
/// sharing it (the weights, gradients and optimizer states on the device; the reductions,
/// gathers and pipeline messages staged through host memory over the host transports): five
/// AdamW steps in fp32 (no TF32), every loss and grad norm within 1e-5 relative of the
/// single-GPU run on the same global batch, every final parameter (read back from each run's
/// checkpoint, whatever its layout) within 1e-5 of the largest (the layouts differ only in the
/// order of their sums, as on the CPU).
#[test]
fn layouts_on_one_gpu_match_one_gpu() {
    if has_gpu() {
        layouts_match_one_rank("cuda");
    }
}

/// The same comparison on the CPU (run everywhere): the layouts, batches and bounds of the
/// GPU test hold where every kernel is the reference, so a failure on the GPU is the GPU's.
#[test]
fn layouts_on_the_cpu_match_one_process() {
    layouts_match_one_rank("cpu");
}

/// Five steps of `nproc` ranks as threads on `device` with the layout `extra`: rank 0's
/// (loss, grad norm) per step, and the whole model read back from the run's checkpoint (the
/// one layout of a checkpoint, whatever the run's).
fn run_layout(device: &str, nproc: usize, extra: &[&str]) -> (Vec<(f64, f32)>, Vec<f32>) {
    let o: Vec<String> = [
        "train.micro_batch=1",
        "model.seq_len=32",
        "model.num_layers=4",
        "train.warmup_steps=2",
        "train.eval_batches=0",
        "data.corpus_bytes=20000",
        // AdamW's eps at 1e-4 as in the pipeline and tied-embedding parity tests: with 1e-8,
        // m/(√v + eps) turns the reordered sums of tensor parallelism (gradients ~1e-7 apart)
        // into updates of whole learning rates where a gradient is near zero — tp 2 on the
        // CPU drifts to 1.7e-5 of the largest parameter in 5 steps (losses and grad norms stay
        // within 1e-5).
        "train.eps=1e-4",
        // fp32 on either device (a GPU's default is bf16); `extra` may choose another.
        "train.precision=\"fp32\"",
    ]
    .iter()
    .chain(extra)
    .map(|s| s.to_string())
    .chain([
        format!("parallel.nproc={nproc}"),
        format!("train.device=\"{device}\""),
    ])
    .collect();
    let cfg = RunConfig::resolve("tiny", None, &o).unwrap();
    let tag: String = format!("layout-{device}-{nproc}-{}", extra.join("-"))
        .chars()
        .filter(|c| c.is_ascii_alphanumeric() || *c == '-')
        .collect();
    let ck = tmp(&tag);
    let out = common::run_read_back(&cfg, nproc, 4, (None, 5, &ck));
    let _ = std::fs::remove_dir_all(&ck);
    out
}

/// Asserts run `got` within `rel` of run `want` in every loss and grad norm, and its
/// parameters within `rel` of the largest; returns the parameters' difference / largest.
fn assert_close_runs(
    what: &str,
    (got, p_got): &(Vec<(f64, f32)>, Vec<f32>),
    (want, p_want): &(Vec<(f64, f32)>, Vec<f32>),
    rel: f64,
) -> f64 {
    for (s, ((l, n), (wl, wn))) in got.iter().zip(want).enumerate() {
        let (n, wn) = (*n as f64, *wn as f64);
        assert!(
            (l - wl).abs() <= rel * wl.abs() && (n - wn).abs() <= rel * wn.abs(),
            "{what} step {s}: loss {l} vs {wl}, grad norm {n} vs {wn}"
        );
    }
    close_params(what, p_got, p_want, rel)
}

/// Asserts parameters `got` within `rel` of the largest of `want`; returns their largest
/// difference / the largest.
fn close_params(what: &str, got: &[f32], want: &[f32], rel: f64) -> f64 {
    let scale = want.iter().fold(0.0f32, |m, x| m.max(x.abs())) as f64;
    let err = got
        .iter()
        .zip(want)
        .fold(0.0f64, |m, (a, b)| m.max((a - b).abs() as f64));
    assert!(
        err <= rel * scale,
        "{what}: parameters differ by {:e} of the largest",
        err / scale
    );
    err / scale
}

fn layouts_match_one_rank(device: &str) {
    layouts_match(device, &[]);
    // Tied word embeddings: the head's copy and the embedding summed over the tie group (a
    // pipeline splits them) and reduced exactly, through host memory on a GPU.
    let tied = GPU_LAYOUTS
        .iter()
        .filter(|(name, _, _)| ["single", "dp2 ZeRO-1", "pp2 1F1B", "tp2"].contains(name))
        .copied()
        .collect::<Vec<_>>();
    layouts_match_in(device, &["model.tie_word_embeddings=true"], &tied);
    // A mixture of experts (4 experts, top 2), with expert parallelism: the rows travel
    // through host memory, the experts compute on the device.
    let moe = [
        "model.arch=\"mixtral\"",
        "model.num_experts=4",
        "model.experts_per_token=2",
        "model.aux_loss_coef=0.01",
    ];
    layouts_match_in(device, &moe, &MOE_LAYOUTS);
}

/// Mixture-of-experts layouts, 4 sequences per step (pp 2: the auxiliary loss travels with
/// the activations, one element more in each pipeline message).
const MOE_LAYOUTS: [(&str, usize, &[&str]); 5] = [
    ("single", 1, &["train.grad_accum=4"]),
    (
        "pp2 1F1B",
        2,
        &[
            "parallel.pp=2",
            "parallel.schedule=\"1f1b\"",
            "train.grad_accum=4",
        ],
    ),
    (
        "dp2 ZeRO-1",
        2,
        &["parallel.dp=2", "parallel.zero=1", "train.grad_accum=2"],
    ),
    (
        "ep2",
        2,
        &["parallel.dp=2", "parallel.ep=2", "train.grad_accum=2"],
    ),
    (
        "ep2 x tp2 + sp",
        4,
        &[
            "parallel.dp=2",
            "parallel.ep=2",
            "parallel.tp=2",
            "parallel.sp=true",
            "train.grad_accum=2",
        ],
    ),
];

fn refs(v: &[String]) -> Vec<&str> {
    v.iter().map(|s| s.as_str()).collect()
}

fn layouts_match(device: &str, with: &[&str]) {
    layouts_match_in(device, with, &GPU_LAYOUTS);
}

/// Every layout of `layouts` (the first the single rank) with the settings `with` on `device`
/// against the first.
fn layouts_match_in(device: &str, with: &[&str], layouts: &[(&str, usize, &[&str])]) {
    let extra =
        |e: &[&str]| -> Vec<String> { e.iter().chain(with).map(|s| s.to_string()).collect() };
    let want = run_layout(device, 1, &refs(&extra(layouts[0].2)));
    for (name, nproc, e) in &layouts[1..] {
        let name = format!("{name} {}", with.join(" "));
        let got = run_layout(device, *nproc, &refs(&extra(e)));
        let err = assert_close_runs(&name, &got, &want, 1e-5);
        eprintln!("{device} {name}: = one rank (parameters within {err:e} of the largest)");
    }
}

/// ZeRO-Offload on the GPU: the master weights and moments in host memory, AdamW on the CPU,
/// the gradients downloaded (16-bit: landed during the backward) and the weights uploaded
/// each step — against the same layouts
/// with the optimizer on the GPU. fp32: within 1e-5 (the CPU's AdamW and the GPU's kernel
/// round the same formula apart by an ulp or so per step). bf16: the weights are rounded from
/// masters that agree to ~1e-7, so they agree but where a master lies on a rounding boundary
/// (one bf16 ulp, 2^-8 relative): the bound of the 16-bit test above.
#[test]
fn offloaded_optimizer_on_the_gpu_matches_the_resident_one() {
    if !has_gpu() {
        return;
    }
    let offload = "parallel.offload=\"optimizer\"";
    for (name, nproc, extra, rel) in [
        ("single fp32", 1, &["train.grad_accum=4"][..], 1e-5),
        (
            "dp2 ZeRO-1 fp32",
            2,
            &["parallel.dp=2", "parallel.zero=1", "train.grad_accum=2"],
            1e-5,
        ),
        (
            "dp2 ZeRO-3 fp32",
            2,
            &["parallel.dp=2", "parallel.zero=3", "train.grad_accum=2"],
            1e-5,
        ),
        (
            "single bf16",
            1,
            &["train.grad_accum=4", "train.precision=\"bf16\""],
            1.0 / 256.0,
        ),
        // 16-bit gradients land on the host bucket by bucket during the backward: the
        // shards of ZeRO-1 and ZeRO-3 (reduced after every micro-batch, final after the
        // last), and two pipeline stages.
        (
            "dp2 ZeRO-1 bf16",
            2,
            &[
                "parallel.dp=2",
                "parallel.zero=1",
                "train.grad_accum=2",
                "train.precision=\"bf16\"",
            ],
            1.0 / 256.0,
        ),
        (
            "dp2 ZeRO-3 bf16",
            2,
            &[
                "parallel.dp=2",
                "parallel.zero=3",
                "train.grad_accum=2",
                "train.precision=\"bf16\"",
            ],
            1.0 / 256.0,
        ),
        (
            "pp2 1F1B bf16",
            2,
            &[
                "parallel.pp=2",
                "parallel.schedule=\"1f1b\"",
                "train.grad_accum=4",
                "train.precision=\"bf16\"",
            ],
            1.0 / 256.0,
        ),
    ] {
        let want = run_layout("cuda", nproc, extra);
        let with: Vec<&str> = extra.iter().copied().chain([offload]).collect();
        let got = run_layout("cuda", nproc, &with);
        let err = assert_close_runs(&format!("offloaded {name}"), &got, &want, rel);
        eprintln!("offloaded {name}: = resident (parameters within {err:e} of the largest)");
    }
}

/// ZeRO-Offload's delayed update on the GPU — the held 16-bit gradients in a second
/// page-locked landing buffer, the host's AdamW beside the next step, its rounded weights
/// uploaded from that buffer — against the same delayed runs on the CPU: fp32 within 1e-4
/// (the GPU against the CPU, as in training parity), 16-bit by the bounds of
/// [`sixteen_bit_training_on_the_gpu_matches_the_cpu`].
#[test]
fn a_delayed_update_on_the_gpu_matches_the_cpu() {
    if !has_gpu() {
        return;
    }
    let delayed = [
        "parallel.offload=\"optimizer\"",
        "parallel.delayed_update_after=1",
    ];
    let bf16 = "train.precision=\"bf16\"";
    for (name, nproc, extra) in [
        ("single fp32", 1, &["train.grad_accum=4"][..]),
        (
            "dp2 ZeRO-1 fp32",
            2,
            &["parallel.dp=2", "parallel.zero=1", "train.grad_accum=2"],
        ),
        ("single bf16", 1, &["train.grad_accum=4", bf16]),
        (
            "dp2 ZeRO-3 bf16",
            2,
            &[
                "parallel.dp=2",
                "parallel.zero=3",
                "train.grad_accum=2",
                bf16,
            ],
        ),
        (
            "pp2 1F1B bf16",
            2,
            &[
                "parallel.pp=2",
                "parallel.schedule=\"1f1b\"",
                "train.grad_accum=4",
                bf16,
            ],
        ),
    ] {
        let with: Vec<&str> = extra.iter().chain(&delayed).copied().collect();
        let (gpu, p_gpu) = run_layout("cuda", nproc, &with);
        let (cpu, p_cpu) = run_layout("cpu", nproc, &with);
        if extra.contains(&bf16) {
            let losses = |r: &[(f64, f32)]| r.iter().map(|s| s.0).collect::<Vec<_>>();
            let lr = config("tiny", "cpu").train.lr;
            let what = format!("delayed {name}");
            assert_16_bit_close(&what, (&losses(&gpu), &p_gpu), (&losses(&cpu), &p_cpu), lr);
        } else {
            let err = assert_close_runs(
                &format!("delayed {name}"),
                &(gpu, p_gpu),
                &(cpu, p_cpu),
                1e-4,
            );
            eprintln!("delayed {name}: GPU = CPU (parameters within {err:e} of the largest)");
        }
    }
}

/// `generate` from a checkpoint on the GPU: greedy decoding gives the CPU's text (the logits
/// agree to ~1e-6, far inside the gaps between a trained model's top two tokens).
#[test]
fn generation_on_the_gpu_matches_the_cpu() {
    if !has_gpu() {
        return;
    }
    let d = tmp("generate");
    let ck = d.join("ck");
    run("tiny", "cpu", None, 10, Some(&ck));
    let (_, model, params, tokenizer) = train::trainer::load_model(&ck).unwrap();
    let o = train::generate::SampleOptions {
        max_new_tokens: 40,
        temperature: 0.0,
        top_k: 0,
        seed: 0,
        context: 64,
    };
    let text = |dev: &str| {
        let p = tensor::buf::Dev::open(dev)
            .unwrap()
            .from_vec(params.clone())
            .unwrap();
        train::generate::generate(&model, p.r(), &tokenizer, "the ", &o).unwrap()
    };
    assert_eq!(text("cuda"), text("cpu"));
    let _ = std::fs::remove_dir_all(&d);
}

/// Expert parallelism's token exchange over NCCL with the one-rank communicator one GPU can
/// hold: a MoE layer whose exchange is a one-rank ep group runs the whole device dispatch
/// (rows gathered, exchanged, run through the experts, sent back and combined on the GPU), once
/// over the host transports and once over NCCL on the communication stream — the output and
/// the input gradient bit for bit the same and on the GPU. (A missing wait between the
/// streams would read the rows before they arrived.) Two ranks: `scripts/nccl-parity.sh`.
#[test]
fn expert_exchange_runs_on_a_one_rank_nccl_communicator() {
    use model::layers::block::Ffn;
    use model::layers::{Pass, WeightGradStore};
    use parallel::expert_parallel::EpExchange;
    use parallel::tensor_parallel::TpPlan;
    use std::sync::Arc;
    use tensor::buf::{Buf, Dev};
    if !has_gpu() {
        return;
    }
    let Ok(Dev::Cuda(gpu)) = Dev::open("cuda") else {
        panic!("the GPU opened above");
    };
    let comm = comm::Communicator::single_process().unwrap();
    let cfg = model::ModelConfig::preset("tiny-moe").unwrap();
    let params = model::Model::new(cfg.clone()).unwrap().init_params(5);
    let plan = TpPlan::with_experts(&cfg, 1, false, 1, 0).unwrap();
    let lp = plan.shard(&params, 0);
    let tokens = 24;
    let data = |seed: usize| -> Vec<f32> {
        (0..tokens * cfg.hidden_size)
            .map(|i| (((i * 7919 + seed * 104_729) % 1000) as f32 / 500.0) - 1.0)
            .collect()
    };
    let run = |nccl: bool| -> Vec<Vec<f32>> {
        let mut local = plan.local_model().unwrap();
        let p = Buf::Cuda(gpu.upload(&lp[local.layout.block_range(0)]).unwrap());
        let Ffn::Moe(m) = &mut local.blocks[0].ffn else {
            panic!("a MoE block")
        };
        let exchange = EpExchange::new(comm.world().clone());
        if nccl {
            let g = parallel::nccl::NcclGroup::new(
                exchange.group(),
                &gpu,
                tensor::cuda::Stream::Comm,
                "the ep test",
            )
            .unwrap();
            exchange.attach_nccl(g).unwrap();
        }
        m.exchange = Some(Arc::new(exchange));
        let pass = Pass::new(1, tokens);
        let x = Arc::new(Buf::Cuda(gpu.upload(&data(1)).unwrap()));
        let (y, cache) = m.forward(p.r(), x.r(), &pass).unwrap();
        let dy = Arc::new(Buf::Cuda(gpu.upload(&data(2)).unwrap()));
        let mut store = WeightGradStore::new();
        let dx = m
            .backward_input(p.r(), &x, cache, dy, &pass, &mut store)
            .unwrap();
        [y, dx]
            .iter()
            .map(|b| {
                assert!(matches!(b, Buf::Cuda(_)), "a result left the GPU");
                b.to_vec().unwrap()
            })
            .collect()
    };
    let (host, nccl) = (run(false), run(true));
    for (name, (a, b)) in ["output", "input gradient"]
        .iter()
        .zip(host.iter().zip(&nccl))
    {
        assert!(
            a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()),
            "{name}: NCCL's exchange differs from the host's"
        );
        assert!(a.iter().any(|v| *v != 0.0), "{name}: all zero");
    }
}

/// Tensor parallelism's region operators over NCCL (`XTRAIN_BACKEND=nccl`, ranks with a GPU
/// each), with the one-rank communicator one GPU can hold: every map, with and without
/// sequence parallelism, runs its NCCL collective (all-reduce, all-gather, reduce-scatter) on
/// the compute stream and must give the activation back bit for bit and on the GPU — the
/// host path's answer at tp = 1. Two ranks: the collectives are `gpu_nccl`'s two-GPU test,
/// the whole path `scripts/nccl-parity.sh`'s tp run, on a machine with two GPUs.
#[test]
fn tp_regions_run_on_a_one_rank_nccl_communicator() {
    use model::layers::block::RegionHooks;
    use parallel::tensor_parallel::TpRegion;
    use tensor::buf::{Buf, Dev};
    if !has_gpu() {
        return;
    }
    let Ok(Dev::Cuda(gpu)) = Dev::open("cuda") else {
        panic!("the GPU opened above");
    };
    let comm = comm::Communicator::single_process().unwrap();
    let x: Vec<f32> = (0..4096)
        .map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0)
        .collect();
    type Map = fn(&TpRegion, Buf) -> model::Result<Buf>;
    let maps: [(&str, Map); 4] = [
        ("enter forward", TpRegion::enter_forward),
        ("enter backward", TpRegion::enter_backward),
        ("exit forward", TpRegion::exit_forward),
        ("exit backward", TpRegion::exit_backward),
    ];
    for sp in [false, true] {
        let region = TpRegion::new(comm.world().clone(), sp);
        let nccl = parallel::nccl::NcclGroup::new(
            region.group(),
            &gpu,
            tensor::cuda::Stream::Compute,
            "the region test",
        )
        .unwrap();
        region.attach_nccl(nccl).unwrap();
        for (name, map) in maps {
            let y = map(&region, Buf::Cuda(gpu.upload(&x).unwrap())).unwrap();
            assert!(matches!(y, Buf::Cuda(_)), "sp {sp} {name}: left the GPU");
            let y = y.to_vec().unwrap();
            assert!(
                y.len() == x.len() && y.iter().zip(&x).all(|(a, b)| a.to_bits() == b.to_bits()),
                "sp {sp} {name}: a one-rank collective changed the values"
            );
        }
        assert!(
            region.comm_nanos() > 0,
            "sp {sp}: no collective ran on NCCL"
        );
    }
}

/// Context parallelism's collectives over NCCL (`XTRAIN_BACKEND=nccl`, cp > 1, ranks with a
/// GPU each), with the one-rank communicator one GPU can hold: the all-gather variant runs
/// NCCL's all-gather of the K/V blocks and reduce-scatter of their gradients on the
/// communication stream, joined by the compute stream (at cp = 1 the ring shifts nothing).
/// Forward and backward must equal the same attention without NCCL bit for bit, on the GPU.
/// Two ranks: `scripts/nccl-parity.sh`'s cp run, on a machine with two GPUs.
#[test]
fn context_attention_runs_on_a_one_rank_nccl_communicator() {
    use model::layers::attention::AttentionCore;
    use parallel::context_parallel::ring::ContextAttention;
    use parallel::context_parallel::{CpBalance, CpComm, CpLayout};
    use tensor::attention::AttnShape;
    use tensor::buf::{Buf, Dev};
    if !has_gpu() {
        return;
    }
    let Ok(Dev::Cuda(gpu)) = Dev::open("cuda") else {
        panic!("the GPU opened above");
    };
    let comm = comm::Communicator::single_process().unwrap();
    let layout = CpLayout {
        cp: 1,
        rank: 0,
        balance: CpBalance::None,
    };
    let shape = AttnShape::causal(2, 48, 4, 2, 32);
    let part = layout.part(shape.q_len);
    let data = |n: usize, seed: usize| -> Buf {
        let v: Vec<f32> = (0..n)
            .map(|i| (((i * 7919 + seed * 104_729) % 1000) as f32 / 500.0) - 1.0)
            .collect();
        Buf::Cuda(gpu.upload(&v).unwrap())
    };
    let (q, k, v, dout) = (
        data(shape.q_elems(), 1),
        data(shape.kv_elems(), 2),
        data(shape.kv_elems(), 3),
        data(shape.q_elems(), 4),
    );
    let run = |attention: &ContextAttention| -> Vec<Vec<f32>> {
        let (o, lse) = attention
            .forward(&shape, part, None, q.r(), k.r(), v.r())
            .unwrap();
        let (dq, dk, dv) = attention
            .backward(
                &shape,
                part,
                None,
                q.r(),
                k.r(),
                v.r(),
                o.r(),
                lse.r(),
                dout.r(),
            )
            .unwrap();
        [o, lse, dq, dk, dv]
            .iter()
            .map(|b| {
                assert!(matches!(b, Buf::Cuda(_)), "a result left the GPU");
                b.to_vec().unwrap()
            })
            .collect()
    };
    let make = || {
        let dkv = comm.new_named_group("cp-dkv", &[0]).unwrap();
        ContextAttention::new(layout, CpComm::AllGather, comm.world().clone(), dkv).unwrap()
    };
    let want = run(&make());
    let attention = make();
    let nccl = parallel::nccl::NcclGroup::new(
        attention.group(),
        &gpu,
        tensor::cuda::Stream::Comm,
        "the context-parallel test",
    )
    .unwrap();
    attention.attach_nccl(nccl).unwrap();
    let got = run(&attention);
    for (name, (g, w)) in ["out", "lse", "dq", "dk", "dv"]
        .iter()
        .zip(got.iter().zip(&want))
    {
        assert!(
            g.len() == w.len() && g.iter().zip(w).all(|(a, b)| a.to_bits() == b.to_bits()),
            "{name}: over NCCL it differs from the host path"
        );
    }
}

/// Two ranks sharing the GPU whose fp32 model states (16 bytes a parameter) each fit its
/// free memory but not twice its whole: refused on both before anything is allocated,
/// naming the rank and the GPU.
#[test]
fn more_ranks_than_the_gpu_holds_are_refused() {
    if !has_gpu() {
        return;
    }
    let tensor::buf::Dev::Cuda(g) = tensor::buf::Dev::open("cuda").unwrap() else {
        unreachable!("a GPU was found")
    };
    let (free, total) = g.memory_info().unwrap();
    // A layer of hidden 8192 and FFN 22016: 4·h² + 3·h·f parameters, 16 bytes each.
    let (h, f) = (8192usize, 22016usize);
    let layer = 16 * (4 * h * h + 3 * h * f);
    let layers = (6 * total / 10).div_ceil(layer);
    assert!(
        layers * layer < free,
        "the GPU has too little free memory for this test"
    );
    let extra: Vec<String> = [
        "parallel.nproc=2".to_string(),
        "parallel.dp=2".to_string(),
        format!("model.hidden_size={h}"),
        format!("model.intermediate_size={f}"),
        format!("model.num_layers={layers}"),
        // Head size 128, as a real model of this width has.
        "model.num_heads=64".to_string(),
        "model.num_kv_heads=64".to_string(),
    ]
    .into();
    let errs = comm::testing::run_threads(2, |c| {
        match train::trainer::Trainer::new(config_with("tiny", "cuda", &extra), &c) {
            Ok(_) => "trained".to_string(),
            Err(e) => e.to_string(),
        }
    });
    for (rank, e) in errs.iter().enumerate() {
        assert!(
            e.contains(&format!("rank {rank}: the model states need"))
                && e.contains("2 ranks share GPU 0"),
            "{e}"
        );
    }
}

/// The fp32 copies of 16-bit weights and gradients on a GPU. In a step of the storage's
/// format `read_buf_parts` widens exactly the parts a unit's kernels read as values
/// (`StageModel::value_ranges`; the rest is the products' to read as bits); in another it
/// widens everything. The gradients go through a whole copy (`update_buf`): a product and a
/// kernel accumulate into it and each element is rounded back once, `round(g + dyᵀ·x)`, bit
/// for bit the host's rounding of the exact sum (these values' sums are exact in fp32).
#[test]
fn partial_copies_of_16_bit_storage_on_the_gpu() {
    use parallel::precision::Flat;
    use parallel::Precision;
    use tensor::buf::{BufMut, Dev};
    use tensor::operands::{Operands, Scope};
    if !has_gpu() {
        return;
    }
    let dev = Dev::open("cuda").unwrap();
    let n = 400;
    let values: Vec<f32> = (0..n)
        .map(|i| ((i * 37 % 101) as f32 - 50.0) / 16.0)
        .collect();
    let (r, parts) = (10..390, [20..40, 100..101]);
    let (dout, tokens, din, at) = (8, 16, 12, 200);
    let w = at..at + dout * din;
    let dy: Vec<f32> = (0..tokens * dout)
        .map(|i| ((i % 7) as f32 - 3.0) / 8.0)
        .collect();
    let x: Vec<f32> = (0..tokens * din)
        .map(|i| ((i % 5) as f32 - 2.0) / 4.0)
        .collect();
    let (dy, x) = (dev.from_vec(dy).unwrap(), dev.from_vec(x).unwrap());
    for (precision, format) in [
        (Precision::Bf16, Operands::Bf16),
        (Precision::Fp16, Operands::F16),
    ] {
        let stored = |f: &Flat| f.download().unwrap();
        let flat = Flat::from_f32_on(&dev, values.clone(), precision).unwrap();
        let rounded = stored(&flat);
        {
            let _s = Scope::enter(format);
            let copy = flat
                .read_buf_parts(r.clone(), &parts)
                .unwrap()
                .to_vec()
                .unwrap();
            for p in &parts {
                let local = p.start - r.start..p.end - r.start;
                assert_eq!(
                    copy[local],
                    rounded[p.clone()],
                    "{precision:?}: part {p:?} widened"
                );
            }
        }
        let whole = flat
            .read_buf_parts(r.clone(), &parts)
            .unwrap()
            .to_vec()
            .unwrap();
        assert_eq!(
            whole,
            rounded[r.clone()],
            "{precision:?} in an fp32 step: all widened"
        );

        // Gradients: a product into the weight's range, and +1 on the parts by a kernel.
        let step = |g: BufMut<'_>| -> Result<(), tensor::TensorError> {
            let mut g = g;
            let local = w.start - r.start..w.end - r.start;
            tensor::ops::matmul(
                g.reborrow().slice_mut(local),
                dy.r(),
                x.r(),
                dout,
                tokens,
                din,
                true,
                false,
                true,
            )?;
            for p in &parts {
                let local = p.start - r.start..p.end - r.start;
                let ones = dev.from_vec(vec![1.0; p.len()])?;
                tensor::ops::add_assign(g.reborrow().slice_mut(local), ones.r())?;
            }
            Ok(())
        };
        let _s = Scope::enter(format);
        let mut got = Flat::from_f32_on(&dev, values.clone(), precision).unwrap();
        got.update_buf(r.clone(), step).unwrap();
        let got = stored(&got);
        // The host's: the exact sum (f64), rounded once to the storage's format.
        let (dy, x) = (dy.to_vec().unwrap(), x.to_vec().unwrap());
        let round = |v: f64| match precision {
            Precision::Bf16 => half::bf16::from_f64(v).to_f32(),
            _ => half::f16::from_f64(v).to_f32(),
        };
        for i in 0..n {
            let mut exact = rounded[i] as f64;
            if w.contains(&i) {
                let (row, col) = ((i - at) / din, (i - at) % din);
                exact += (0..tokens)
                    .map(|t| dy[t * dout + row] as f64 * x[t * din + col] as f64)
                    .sum::<f64>();
            }
            if parts.iter().any(|p| p.contains(&i)) {
                exact += 1.0;
            }
            assert_eq!(
                got[i].to_bits(),
                round(exact).to_bits(),
                "{precision:?} element {i}: {} against the exact sum {exact} rounded once",
                got[i]
            );
        }
        assert_ne!(
            got[w.clone()],
            rounded[w.clone()],
            "{precision:?}: the product landed"
        );
    }
}
