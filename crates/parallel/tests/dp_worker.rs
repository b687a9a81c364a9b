//! The trainer-level data-parallel run (`parallel::worker::run`, what `xtrain train --dp N
//! --zero K` executes in each worker) on the tiny preset and the built-in corpus: dp = 2 at
//! every ZeRO stage gives the losses of dp = 1 with twice the accumulation steps (the same
//! global batch; ZeRO-3 ranks generate only their shard of the initial parameters, so this also
//! checks the range initialiser end to end), and a config that cannot work is a clear error.
use parallel::worker::run;
use train::RunConfig;

fn cfg(dp: usize, zero: usize, accum: usize) -> RunConfig {
    let o: Vec<String> = [
        "train.steps=3".to_string(),
        "train.micro_batch=2".into(),
        format!("train.grad_accum={accum}"),
        "model.seq_len=16".into(),
        "data.corpus_bytes=20000".into(),
        format!("parallel.dp={dp}"),
        format!("parallel.nproc={dp}"),
        format!("parallel.zero={zero}"),
    ]
    .into();
    RunConfig::resolve("tiny", None, &o).unwrap()
}

#[test]
fn dp2_every_stage_matches_dp1_with_accumulation() {
    let single =
        comm::testing::run_threads(1, |c| run(&cfg(1, 0, 2), &c, &Default::default()).unwrap());
    let want = &single[0].losses;
    for zero in 0..4 {
        let out = comm::testing::run_threads(2, |c| {
            run(&cfg(2, zero, 1), &c, &Default::default()).unwrap()
        });
        for r in &out {
            for (a, b) in r.losses.iter().zip(want) {
                assert!(
                    (a - b).abs() / b.abs() < 1e-5,
                    "zero={zero}: {:?} vs {want:?}",
                    r.losses
                );
            }
            let f = r.formula;
            assert_eq!(
                (r.memory.params, r.memory.grads, r.memory.optimizer),
                (f.params, f.grads, f.optimizer)
            );
        }
    }
}

#[test]
fn mismatched_layout_is_a_clear_error() {
    let err = comm::testing::run_threads(1, |c| {
        run(&cfg(2, 0, 1), &c, &Default::default())
            .unwrap_err()
            .to_string()
    });
    assert!(err[0].contains("parallel.dp"), "{}", err[0]);
    let err = comm::testing::run_threads(2, |c| {
        run(&cfg(2, 4, 1), &c, &Default::default())
            .unwrap_err()
            .to_string()
    });
    assert!(err[0].contains("zero"), "{}", err[0]);
    let mut bad = cfg(2, 1, 1);
    bad.parallel.bucket_mb = 0.0;
    let err = comm::testing::run_threads(2, |c| {
        run(&bad, &c, &Default::default()).unwrap_err().to_string()
    });
    assert!(err[0].contains("bucket_mb"), "{}", err[0]);
    let mut fp16 = cfg(2, 1, 1);
    fp16.train.precision = train::config::Precision::Fp16;
    let err = comm::testing::run_threads(2, |c| {
        run(&fp16, &c, &Default::default()).unwrap_err().to_string()
    });
    assert!(err[0].contains("fp16"), "{}", err[0]);
}

#[test]
fn rank0_writes_the_trainers_metrics_and_validation() {
    let out = std::env::temp_dir().join(format!("xtrain-dp-worker-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&out);
    let opts = parallel::worker::DpRunOptions {
        out: Some(out.clone()),
        ..Default::default()
    };
    let mut c = cfg(2, 2, 1);
    c.train.sample_tokens = 0;
    comm::testing::run_threads(2, |comm| run(&c, &comm, &opts).unwrap());
    let records = train::metrics::read(&out.join("metrics.jsonl")).unwrap();
    assert_eq!(
        records.iter().map(|r| r.step).collect::<Vec<_>>(),
        [1, 2, 3]
    );
    assert!(out.join("loss.png").is_file() && out.join("config.toml").is_file());
    // memory.json: every rank's account, whose model states are the formula's (ZeRO-2).
    let mem: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("memory.json")).unwrap()).unwrap();
    let states = mem["formula_bytes"]["model_states"].as_i64().unwrap();
    let ranks = mem["ranks"].as_array().unwrap();
    assert_eq!(ranks.len(), 2);
    for r in ranks {
        let sum = ["params", "grads", "optimizer"].map(|k| r[k].as_i64().unwrap());
        assert_eq!(sum.iter().sum::<i64>(), states, "{mem}");
    }
    assert_eq!(mem["formula"], "4Φ + 12Φ/N");
    // The single-process trainer on the same global batch: same losses, same validation.
    let mut single = c.clone();
    (
        single.parallel.dp,
        single.parallel.nproc,
        single.parallel.zero,
    ) = (1, 1, 0);
    single.train.grad_accum = 2;
    let mut t = train::trainer::Trainer::new(single).unwrap();
    for r in &records {
        let s = t.train_step().unwrap();
        assert!((s.loss - r.loss).abs() / r.loss < 1e-5, "{s:?} vs {r:?}");
    }
    let val = t.evaluate().unwrap().unwrap();
    let got = records[2].val_loss.unwrap();
    assert!((val - got).abs() / val < 1e-5, "validation {got} vs {val}");
    let _ = std::fs::remove_dir_all(&out);
}
