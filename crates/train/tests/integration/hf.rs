//! Hugging Face interop: export/import round trip is exact, and the transformers golden
//! (weights + config) imported through `from_hf` gives transformers' loss.
use std::path::{Path, PathBuf};
use train::trainer::{checkpoint_config_text, load_model, Trainer};
use train::RunConfig;

fn tmp(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("xtrain-hf-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn golden() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/data/golden")
}

#[test]
fn round_trip_is_identical() {
    let d = tmp("rt");
    let cfg = RunConfig::resolve(
        "tiny",
        None,
        &["train.steps=3".into(), "data.corpus_bytes=50000".into()],
    )
    .unwrap();
    let mut t = Trainer::single(cfg).unwrap();
    for _ in 0..3 {
        t.train_step().unwrap();
    }
    t.save_checkpoint(&d.join("ck")).unwrap();
    train::hf::to_hf(&d.join("ck"), &d.join("hf")).unwrap();
    let cj: serde_json::Value =
        serde_json::from_slice(&std::fs::read(d.join("hf/config.json")).unwrap()).unwrap();
    assert_eq!(cj["architectures"][0], "LlamaForCausalLM");
    assert_eq!(cj["num_key_value_heads"], 2);
    train::hf::from_hf(
        &d.join("hf"),
        &d.join("back"),
        "tiny",
        &["data.corpus_bytes=50000".into()],
    )
    .unwrap();
    let ck = parallel::checkpoint::Checkpoint::open(&d.join("back")).unwrap();
    let back_cfg =
        RunConfig::resolve("tiny", Some(&checkpoint_config_text(&ck).unwrap()), &[]).unwrap();
    let back = Trainer::resume(
        back_cfg,
        &d.join("back"),
        &comm::Communicator::single_process().unwrap(),
    )
    .unwrap();
    assert_eq!(back.cfg.model, t.cfg.model);
    assert_eq!(back.step, 0);
    let (a, b) = (
        t.exec.full_params().unwrap(),
        back.exec.full_params().unwrap(),
    );
    let same = a.iter().zip(&b).all(|(a, b)| a.to_bits() == b.to_bits());
    assert!(same, "weights survive to_hf + from_hf bit for bit");
    std::fs::remove_dir_all(&d).unwrap();
}

/// Every transformers golden — Llama and Mixtral, untied, and tied with Llama 3 RoPE
/// scaling — imported through `from_hf` gives transformers' loss; exported again, the tied
/// ones keep `tie_word_embeddings` and hold no `lm_head.weight`, with the golden's weights
/// bit for bit (so transformers loads the same model).
#[test]
fn imported_goldens_give_the_golden_loss() {
    for name in [
        "llama_tiny",
        "mixtral_tiny",
        "llama_tied_rope3",
        "mixtral_tied_rope3",
    ] {
        let d = tmp(name);
        let meta: serde_json::Value =
            serde_json::from_slice(&std::fs::read(golden().join(format!("{name}.json"))).unwrap())
                .unwrap();
        let hf = d.join("hf");
        std::fs::create_dir_all(&hf).unwrap();
        std::fs::write(hf.join("config.json"), meta["config"].to_string()).unwrap();
        let weights = golden().join(format!("{name}.safetensors"));
        std::fs::copy(&weights, hf.join("model.safetensors")).unwrap();
        train::hf::from_hf(
            &hf,
            &d.join("ck"),
            "tiny",
            &["data.corpus_bytes=50000".into()],
        )
        .unwrap();
        let (_, model, params, _) = load_model(&d.join("ck")).unwrap();
        let tied = meta["config"]["tie_word_embeddings"].as_bool() == Some(true);
        assert_eq!(model.cfg.tie_word_embeddings, tied, "{name}");
        let wf = model::io::WeightsFile::open(&weights).unwrap();
        let (ids, shape) = wf.i64("input_ids").unwrap();
        let ids: Vec<u32> = ids.iter().map(|&x| x as u32).collect();
        let batch = model::Batch::next_token(shape[0], shape[1], &ids).unwrap();
        let loss = model.forward_loss(&params, &batch).unwrap().loss as f64;
        let want = meta["loss"].as_f64().unwrap();
        // fp32 with a different summation order than torch: agreement to ~1e-6 relative.
        assert!(
            (loss - want).abs() / want < 1e-5,
            "{name}: loss {loss} vs golden {want}"
        );
        train::hf::to_hf(&d.join("ck"), &d.join("out")).unwrap();
        let cj: serde_json::Value =
            serde_json::from_slice(&std::fs::read(d.join("out/config.json")).unwrap()).unwrap();
        assert_eq!(cj["tie_word_embeddings"].as_bool(), Some(tied), "{name}");
        let out = model::io::WeightsFile::open(&d.join("out/model.safetensors")).unwrap();
        let has_head = out.names().iter().any(|n| n == "lm_head.weight");
        assert_eq!(has_head, !tied, "{name}");
        let embed = "model.embed_tokens.weight";
        let (a, b) = (out.f32(embed).unwrap().0, wf.f32(embed).unwrap().0);
        assert!(
            a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()),
            "{name}: the exported embedding is the golden's"
        );
        std::fs::remove_dir_all(&d).unwrap();
    }
}

#[test]
fn bad_imports_are_errors() {
    let d = tmp("bad");
    let e = train::hf::from_hf(&d, &d.join("ck"), "tiny", &[]).unwrap_err();
    assert!(e.to_string().contains("config.json"), "{e}");
    std::fs::write(d.join("config.json"), r#"{"vocab_size": 256, "hidden_size": 64, "intermediate_size": 176, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}"#).unwrap();
    let e = train::hf::from_hf(&d, &d.join("ck"), "tiny", &[]).unwrap_err();
    assert!(e.to_string().contains("model.safetensors"), "{e}");
    assert!(train::hf::to_hf(&d.join("nothing"), &d.join("out")).is_err());
    std::fs::remove_dir_all(&d).unwrap();
}

/// Llama 3's RoPE scaling goes out as `rope_scaling` in config.json and comes back in, and a
/// run configured with it trains (the rotation is the scaled one: other losses than without).
#[test]
fn rope_scaling_survives_export_and_import() {
    let d = tmp("rope3");
    let set = |scaled: bool| {
        let mut s = vec!["train.steps=2".into(), "data.corpus_bytes=50000".into()];
        if scaled {
            s.push(
                "model.rope_scaling={rope_type=\"llama3\", factor=8.0, low_freq_factor=1.0, \
                 high_freq_factor=4.0, original_max_position_embeddings=64}"
                    .into(),
            );
        }
        s
    };
    let mut t = Trainer::single(RunConfig::resolve("tiny", None, &set(true)).unwrap()).unwrap();
    let mut plain =
        Trainer::single(RunConfig::resolve("tiny", None, &set(false)).unwrap()).unwrap();
    let (a, b) = (t.train_step().unwrap(), plain.train_step().unwrap());
    assert_ne!(a.loss, b.loss, "the scaling changes the rotation");
    t.save_checkpoint(&d.join("ck")).unwrap();
    train::hf::to_hf(&d.join("ck"), &d.join("hf")).unwrap();
    let cj: serde_json::Value =
        serde_json::from_slice(&std::fs::read(d.join("hf/config.json")).unwrap()).unwrap();
    assert_eq!(cj["rope_scaling"]["rope_type"], "llama3");
    assert_eq!(cj["rope_scaling"]["original_max_position_embeddings"], 64);
    train::hf::from_hf(
        &d.join("hf"),
        &d.join("back"),
        "tiny",
        &["data.corpus_bytes=50000".into()],
    )
    .unwrap();
    let ck = parallel::checkpoint::Checkpoint::open(&d.join("back")).unwrap();
    let back =
        RunConfig::resolve("tiny", Some(&checkpoint_config_text(&ck).unwrap()), &[]).unwrap();
    assert_eq!(back.model.rope_scaling, t.cfg.model.rope_scaling);
    // A type xtrain does not implement is refused before anything runs.
    let bad = RunConfig::resolve(
        "tiny",
        None,
        &["model.rope_scaling={rope_type=\"yarn\", factor=4.0}".into()],
    )
    .unwrap_err();
    assert!(bad.to_string().contains("`yarn` is not supported"), "{bad}");
    std::fs::remove_dir_all(&d).unwrap();
}
