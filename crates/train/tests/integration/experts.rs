//! Expert parallelism through the trainer: a Mixtral-style model (8 experts, top-2, auxiliary
//! loss) saved under ep 2 × dp 2 after 2 steps resumes at one process, at ep 4, and at ep 2 ×
//! tp 2 with the uninterrupted single-process losses (fp32, 1e-5), and every checkpoint
//! exports to the same Hugging Face tensors (a MixtralForCausalLM config). The step reports
//! the experts' load, per expert and per ep rank.
use std::path::{Path, PathBuf};

use train::trainer::Trainer;
use train::RunConfig;

const BASE: [&str; 12] = [
    "model.arch=mixtral",
    "model.num_experts=8",
    "model.experts_per_token=2",
    "model.aux_loss_coef=0.02",
    "model.seq_len=16",
    "train.steps=4",
    "train.micro_batch=1",
    "data.corpus_bytes=20000",
    "train.warmup_steps=0",
    "train.min_lr=3e-3",
    "train.eval_batches=0",
    "model.num_layers=2",
];

fn config(layout: &[&str]) -> RunConfig {
    let mut o: Vec<String> = BASE.iter().map(|s| s.to_string()).collect();
    o.extend(layout.iter().map(|s| s.to_string()));
    RunConfig::resolve("tiny", None, &o).unwrap()
}

/// `steps` steps of `cfg` (from checkpoint `from`), saving to `save` at the end; rank 0's
/// losses and the experts' load of the last step.
fn run(cfg: &RunConfig, from: Option<&Path>, steps: usize, save: Option<&Path>) -> Vec<f64> {
    comm::testing::run_threads(cfg.parallel.nproc, |c| {
        let mut t = match from {
            Some(ck) => Trainer::resume(cfg.clone(), ck, &c).unwrap(),
            None => Trainer::new(cfg.clone(), &c).unwrap(),
        };
        let mut losses = Vec::new();
        for _ in 0..steps {
            let r = t.train_step().unwrap();
            let e = r.experts.expect("a MoE model reports its experts' load");
            assert!(e.imbalance >= 1.0 && e.dropped == 0.0, "{e:?}");
            // The busiest ep rank's rows over the mean: 1 without expert parallelism.
            let ep = cfg.parallel.ep > 1;
            assert!(
                e.ep_imbalance >= 1.0 && (ep || e.ep_imbalance == 1.0),
                "{e:?}"
            );
            losses.push(r.loss);
        }
        if let Some(dir) = save {
            t.save_checkpoint(dir).unwrap();
        }
        losses
    })
    .remove(0)
}

fn tmp() -> PathBuf {
    let d = std::env::temp_dir().join(format!("xtrain-experts-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

#[test]
fn an_expert_parallel_checkpoint_resumes_anywhere_and_exports() {
    let d = tmp();
    let single = ["parallel.nproc=1", "train.grad_accum=4"];
    let reference = run(&config(&single), None, 4, None);
    let ep2 = [
        "parallel.nproc=4",
        "parallel.dp=4",
        "parallel.ep=2",
        "train.grad_accum=1",
    ];
    let ck = d.join("ep2");
    let first = run(&config(&ep2), None, 2, Some(&ck));
    for (s, (a, b)) in first.iter().zip(&reference).enumerate() {
        assert!((a - b).abs() / b.abs() < 1e-5, "ep2 step {s}: {a} vs {b}");
    }
    train::hf::to_hf(&ck, &d.join("hf-ep2")).unwrap();
    let hf = std::fs::read(d.join("hf-ep2/model.safetensors")).unwrap();
    let config_json = std::fs::read_to_string(d.join("hf-ep2/config.json")).unwrap();
    assert!(config_json.contains("MixtralForCausalLM"), "{config_json}");
    let saved = {
        let c = parallel::checkpoint::Checkpoint::open(&ck).unwrap();
        train::trainer::checkpoint_config_text(&c).unwrap()
    };
    for (name, layout) in [
        ("single", &single[..]),
        (
            "ep4",
            &[
                "parallel.nproc=4",
                "parallel.dp=4",
                "parallel.ep=4",
                "train.grad_accum=1",
            ],
        ),
        (
            "ep2tp2",
            &[
                "parallel.nproc=4",
                "parallel.dp=2",
                "parallel.tp=2",
                "parallel.ep=2",
                "train.grad_accum=2",
            ],
        ),
    ] {
        let mut o: Vec<String> = ["parallel.dp=1", "parallel.tp=1", "parallel.ep=1"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        o.extend(layout.iter().map(|s| s.to_string()));
        let cfg = RunConfig::resolve("tiny", Some(&saved), &o).unwrap();
        let again = d.join(format!("again-{name}"));
        // Reload and save again at once: the same tensors.
        run(&cfg, Some(&ck), 0, Some(&again));
        train::hf::to_hf(&again, &d.join(format!("hf-{name}"))).unwrap();
        assert_eq!(
            std::fs::read(d.join(format!("hf-{name}/model.safetensors"))).unwrap(),
            hf,
            "{name}: the export"
        );
        let rest = run(&cfg, Some(&ck), 2, None);
        for (s, (a, b)) in rest.iter().zip(&reference[2..]).enumerate() {
            assert!(
                (a - b).abs() / b.abs() < 1e-5,
                "{name} step {}: {a} vs {b}",
                s + 3
            );
        }
    }
    let _ = std::fs::remove_dir_all(&d);
}

/// Auxiliary-loss-free balancing: the routing biases move with the global loads on every rank
/// alike (ep 2 × dp 2 = one process), are saved in the checkpoint and restored by a resume (the
/// resumed run repeats the uninterrupted one bit for bit). That they balance is the model's
/// test (`moe_bias_balancing_evens_the_loads`).
#[test]
fn bias_balancing_is_global_checkpointed_and_balances() {
    let d = tmp().join("bias");
    let bal = [
        "model.bias_balance_rate=0.05",
        "model.aux_loss_coef=0",
        "train.steps=6",
    ];
    let with = |layout: &[&str]| {
        let mut v: Vec<&str> = bal.to_vec();
        v.extend_from_slice(layout);
        config(&v)
    };
    let single = with(&["parallel.nproc=1", "train.grad_accum=4"]);
    let straight = run(&single, None, 6, None);
    let ep2 = with(&[
        "parallel.nproc=4",
        "parallel.dp=4",
        "parallel.ep=2",
        "train.grad_accum=1",
    ]);
    let other = run(&ep2, None, 6, None);
    for (s, (a, b)) in other.iter().zip(&straight).enumerate() {
        assert!((a - b).abs() / b.abs() < 1e-5, "ep2 step {s}: {a} vs {b}");
    }
    let ck = d.join("ck");
    run(&single, None, 3, Some(&ck));
    let manifest = std::fs::read_to_string(ck.join("manifest.json")).unwrap();
    assert!(manifest.contains("router_bias"), "the biases are saved");
    let rest = run(&single, Some(&ck), 3, None);
    let bits = |v: &[f64]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&rest), bits(&straight[3..]), "resumed bit for bit");
    let _ = std::fs::remove_dir_all(&d);
}
