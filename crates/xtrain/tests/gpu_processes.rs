//! Every layout as real processes sharing one GPU: `xtrain train --nproc N --device cuda`
//! through the launcher, each process opening the one GPU (`LOCAL_RANK mod 1`) in its own
//! CUDA context, the communication staged through host memory over the own transports. Five
//! AdamW steps in fp32 (no TF32): every loss within 1e-5 relative of one GPU process on the
//! same global batch (4 sequences), and every final parameter — read back from each run's
//! checkpoint, whatever its layout — within 1e-5 of the largest. AdamW's eps at 1e-4, as in
//! the ranks-as-threads twin (`train/tests/gpu_train.rs`, which measures why). Skipped with
//! one line where no GPU is found (a failure under `XTRAIN_REQUIRE_GPU=1`).
mod common;
use common::*;
use std::path::Path;

const BASE: [&str; 20] = [
    "--preset",
    "tiny",
    "--quiet",
    "--set",
    "model.seq_len=32",
    "--set",
    "model.num_layers=4",
    "--set",
    "train.micro_batch=1",
    "--set",
    "train.steps=5",
    "--set",
    "train.warmup_steps=2",
    "--set",
    "train.eval_batches=0",
    "--set",
    "data.corpus_bytes=20000",
    "--set",
    "train.eps=1e-4",
    "--set",
];

/// Mixtral (4 experts, top 2) instead of Llama.
const MOE: [&str; 8] = [
    "--set",
    "model.arch=\"mixtral\"",
    "--set",
    "model.num_experts=4",
    "--set",
    "model.experts_per_token=2",
    "--set",
    "model.aux_loss_coef=0.01",
];

/// The layouts of issue "Every layout on GPUs": dp 2 at ZeRO 0–3, tp 2 + sp, pp 2 (1F1B and
/// ZB-V), cp 2, pp 2 × dp 2 and cp 2 × tp 2 on 4 processes; ep 2 on the Mixtral.
const LAYOUTS: [(&str, bool, &[&str]); 11] = [
    (
        "dp2 ZeRO-0",
        false,
        &[
            "--nproc",
            "2",
            "--dp",
            "2",
            "--zero",
            "0",
            "--set",
            "train.grad_accum=2",
        ],
    ),
    (
        "dp2 ZeRO-1",
        false,
        &[
            "--nproc",
            "2",
            "--dp",
            "2",
            "--zero",
            "1",
            "--set",
            "train.grad_accum=2",
        ],
    ),
    (
        "dp2 ZeRO-2",
        false,
        &[
            "--nproc",
            "2",
            "--dp",
            "2",
            "--zero",
            "2",
            "--set",
            "train.grad_accum=2",
        ],
    ),
    (
        "dp2 ZeRO-3",
        false,
        &[
            "--nproc",
            "2",
            "--dp",
            "2",
            "--zero",
            "3",
            "--set",
            "train.grad_accum=2",
        ],
    ),
    (
        "tp2 + sp",
        false,
        &[
            "--nproc",
            "2",
            "--tp",
            "2",
            "--sp",
            "--set",
            "train.grad_accum=4",
        ],
    ),
    (
        "pp2 1F1B",
        false,
        &[
            "--nproc",
            "2",
            "--pp",
            "2",
            "--schedule",
            "1f1b",
            "--set",
            "train.grad_accum=4",
        ],
    ),
    (
        "pp2 ZB-V",
        false,
        &[
            "--nproc",
            "2",
            "--pp",
            "2",
            "--schedule",
            "zb-v",
            "--set",
            "train.grad_accum=4",
        ],
    ),
    (
        "cp2",
        false,
        &["--nproc", "2", "--cp", "2", "--set", "train.grad_accum=4"],
    ),
    (
        "pp2 x dp2",
        false,
        &[
            "--nproc",
            "4",
            "--pp",
            "2",
            "--dp",
            "2",
            "--zero",
            "1",
            "--set",
            "train.grad_accum=2",
        ],
    ),
    (
        "cp2 x tp2",
        false,
        &[
            "--nproc",
            "4",
            "--cp",
            "2",
            "--tp",
            "2",
            "--sp",
            "--set",
            "train.grad_accum=4",
        ],
    ),
    (
        "ep2",
        true,
        &[
            "--nproc",
            "2",
            "--dp",
            "2",
            "--ep",
            "2",
            "--set",
            "train.grad_accum=2",
        ],
    ),
];

/// A run's losses by step and its final parameters.
type Run = (Vec<(u64, f64)>, Vec<f32>);

/// Runs `xtrain train` on `device` into `out` with the base settings, `moe` and `layout`, in
/// fp32; returns the losses and the final parameters.
fn run(device: &str, out: &Path, moe: bool, layout: &[&str]) -> Run {
    run_with(device, out, moe, "fp32", &[], layout).0
}

/// [`run`] in `precision` with environment `env`; also returns the run's output.
fn run_with(
    device: &str,
    out: &Path,
    moe: bool,
    precision: &str,
    env: &[(&str, &str)],
    layout: &[&str],
) -> (Run, String) {
    let out_s = out.to_str().unwrap();
    let moe: &[&str] = if moe { &MOE } else { &[] };
    let precision = format!("train.precision=\"{precision}\"");
    let text = ok(&xtrain_with(
        &[
            &["train", "--out", out_s, "--device", device][..],
            &BASE,
            &[precision.as_str()],
            moe,
            layout,
        ]
        .concat(),
        env,
    ));
    let (_, _, params, _) =
        train::trainer::load_model(&out.join("checkpoints/step_000005")).unwrap();
    ((losses(out), params), text)
}

/// Whether this machine has a GPU; else the skip line for `what`.
fn have_gpu(what: &str) -> bool {
    match tensor::buf::Dev::open("cuda") {
        Ok(_) => true,
        Err(e) => {
            tensor::skip::skip(what, "gpu", &format!("no GPU: {e}"));
            false
        }
    }
}

/// NCCL's path through the executor on the one GPU a check has (NCCL cannot pair two ranks
/// on one GPU): `XTRAIN_BACKEND=nccl` with dp 1 makes a one-rank communicator, and the bucket
/// reductions (ZeRO-0/1: all-reduce of the bucket, or of its fp32 copy in bf16; ZeRO-2/3:
/// reduce of the staging buffer onto its owner) and the weight gathers (ZeRO-3) run on the
/// communication stream, ordered against the kernels by events. A one-rank sum changes
/// nothing and the arithmetic around it is the own engine's (times 1/n, added into the shard,
/// rounded once), and every kernel is deterministic, so the losses and parameters must equal
/// the own engine's bit for bit: a missing wait between the streams would read stale values.
/// Many ranks: `scripts/nccl-parity.sh` on a machine with two GPUs or more.
#[test]
fn nccl_with_one_rank_matches_the_own_engine_bit_for_bit() {
    if !have_gpu("NCCL through the executor (xtrain/tests/gpu_processes.rs)") {
        return;
    }
    let d = tmp("nccl-one-rank");
    for (precision, zero) in [
        ("fp32", "0"),
        ("fp32", "2"),
        ("fp32", "3"),
        ("bf16", "1"),
        ("bf16", "3"),
    ] {
        let layout = ["--zero", zero, "--set", "train.grad_accum=2"];
        let name = format!("{precision} ZeRO-{zero}");
        let run_on = |backend: &str| {
            let env = [("XTRAIN_BACKEND", backend), ("RUST_LOG", "comm=info")];
            let out = d.join(format!("{precision}-{zero}-{backend}"));
            run_with("cuda", &out, false, precision, &env, &layout)
        };
        let ((ol, op), _) = run_on("own");
        let ((nl, np), text) = run_on("nccl");
        assert!(
            text.contains("over NCCL"),
            "{name}: NCCL was not used:\n{text}"
        );
        assert_eq!(nl, ol, "{name}: losses over NCCL vs the own engine");
        let differ = np
            .iter()
            .zip(&op)
            .filter(|(a, b)| a.to_bits() != b.to_bits())
            .count();
        assert!(
            np.len() == op.len() && differ == 0,
            "{name}: {differ} of {} parameters differ over NCCL",
            op.len()
        );
        eprintln!("{name}: NCCL (one rank, communication stream) = the own engine, bit for bit");
    }
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn layouts_as_processes_on_one_gpu_match_one_gpu() {
    if !have_gpu("the GPU layouts as processes (xtrain/tests/gpu_processes.rs)") {
        return;
    }
    layouts_match_one_process("cuda");
}

/// The same on the CPU (run everywhere, a few seconds): the layouts, batches and bounds of the
/// GPU test hold where every kernel is the reference, so a failure on the GPU is the GPU's.
#[test]
fn layouts_as_processes_on_the_cpu_match_one_process() {
    layouts_match_one_process("cpu");
}

fn layouts_match_one_process(device: &str) {
    let d = tmp(&format!("processes-{device}"));
    let mut want = [None, None];
    for (name, moe, layout) in LAYOUTS {
        let (wl, wp) = want[moe as usize]
            .get_or_insert_with(|| {
                let single = d.join(format!("single-{moe}"));
                run(device, &single, moe, &["--set", "train.grad_accum=4"])
            })
            .clone();
        let tag: String = name.chars().filter(|c| c.is_ascii_alphanumeric()).collect();
        let (gl, gp) = run(device, &d.join(tag), moe, layout);
        close(&gl, &wl, name);
        let largest = wp.iter().fold(0.0f32, |m, x| m.max(x.abs()));
        let err = gp
            .iter()
            .zip(&wp)
            .fold(0.0f32, |m, (a, b)| m.max((a - b).abs()))
            / largest;
        assert!(
            gp.len() == wp.len() && err <= 1e-5,
            "{device} {name}: parameters {err:e} of the largest apart"
        );
        eprintln!("{device} {name}: = one process (parameters within {err:e} of the largest)");
    }
    let _ = std::fs::remove_dir_all(&d);
}
