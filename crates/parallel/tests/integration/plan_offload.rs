//! Optimizer offload in the planner: a 7B Llama that fits one 80 GB H100 only with its
//! optimizer in 128 GB of host memory, the host bytes it needs (16Φ), a host too small named
//! as the shortfall, the step time of the CPU's AdamW and the copies, and a small model the
//! search keeps on the device because offload is slower.
use model::ModelConfig;
use parallel::memory::human;
use parallel::plan::search::layouts;
use parallel::plan::{
    evaluate, plan, shapes, Cluster, Conventions, Host, Job, Layout, Offload, SearchSpace,
};
use parallel::Precision;

const GIB: u64 = 1 << 30;

/// One H100-80G with `host_bytes` of host memory (the preset's PCIe Gen5 link and CPU AdamW).
fn one_h100(host_bytes: u64) -> Cluster {
    let mut c = Cluster::preset("h100-80g", 1).unwrap();
    c.devices_per_node = 1;
    c.host = Some(Host {
        memory_bytes: host_bytes,
        ..c.host.unwrap()
    });
    c
}

fn job(model: ModelConfig, precision: Precision) -> Job {
    Job {
        model,
        seq_len: 2048,
        global_batch: 8,
        precision,
        conventions: Conventions::Xtrain,
        expert_imbalance: 1.0,
    }
}

fn llama_7b() -> (Job, usize) {
    let cfg = shapes::named("llama2-7b").unwrap();
    let phi = shapes::num_params(&cfg);
    (job(cfg, Precision::Bf16), phi)
}

#[test]
fn llama_7b_fits_one_h100_only_with_the_optimizer_on_the_host() {
    let (job, phi) = llama_7b();
    let cluster = one_h100(128_000_000_000);
    let on_device = SearchSpace {
        offload: vec![Offload::None],
        ..SearchSpace::default()
    };
    let p = plan(&job, &cluster, &on_device).unwrap();
    let s = p.shortfall.as_ref().expect("nothing fits without offload");
    let states = s.closest.peak.model_states();
    assert!(
        p.feasible.is_empty() && states == 16 * phi && s.short_bytes > 0,
        "without offload: {phi} parameters, model states {} (16Φ = {}), resident {} on a {} device",
        human(states as u64),
        human(16 * phi as u64),
        human(s.closest.resident as u64),
        human(cluster.memory_bytes)
    );

    let p = plan(&job, &cluster, &SearchSpace::default()).unwrap();
    assert!(p.shortfall.is_none(), "{:?}", p.shortfall);
    assert!(p
        .feasible
        .iter()
        .all(|x| x.layout.offload == Offload::Optimizer));
    let best = &p.feasible[0];
    // Device: 16-bit weights and gradients, 2Φ + 2Φ; host: master, m, v and fp32
    // gradients, 16Φ (one rank: its shard is the whole model).
    assert_eq!(best.peak.model_states(), 4 * phi, "{}", best.layout);
    assert_eq!((best.peak.master, best.peak.optimizer), (0, 0));
    assert_eq!(best.host, 16 * phi);
    assert!(best.resident as u64 <= cluster.memory_bytes);
    assert!(best.host as u64 <= cluster.host_share().unwrap());
}

#[test]
fn a_host_too_small_is_the_shortfall() {
    // 96 GiB of host memory: the offloaded 7B needs 16Φ ≈ 100.4 GiB.
    let (job, phi) = llama_7b();
    let cluster = one_h100(96 * GIB);
    let p = plan(&job, &cluster, &SearchSpace::default()).unwrap();
    assert!(p.feasible.is_empty());
    let s = p.shortfall.unwrap();
    assert_eq!(s.closest.layout.offload, Offload::Optimizer);
    assert_eq!(s.short_bytes, 0, "the device holds it");
    assert_eq!(s.short_host_bytes, (16 * phi) as u64 - 96 * GIB);
    assert!(
        s.suggestions.iter().any(|t| t.contains("host memory")),
        "{:?}",
        s.suggestions
    );
    // The same layout evaluated alone says it does not fit, for the host alone.
    let x = evaluate(&job, &cluster, &s.closest.layout).unwrap();
    assert!(!x.fits && x.resident as u64 <= cluster.memory_bytes);
}

#[test]
fn offload_step_time_is_the_cpu_step_and_the_exposed_copies() {
    let (job, phi) = llama_7b();
    let cluster = one_h100(128_000_000_000);
    let host = cluster.host.unwrap();
    let phi = phi as f64;
    // Each direction moves 2 bytes per parameter of the shard (the whole model here).
    let copy = host.link.latency + 2.0 * phi / host.link.bandwidth;
    let at = |name: &str| evaluate(&job, &cluster, &name.parse().unwrap()).unwrap();
    // 8 sequences per micro-batch: the last backward (~0.7 s) hides the gradients' copy
    // (~0.27 s); only the weights' copy back is exposed.
    let long = at("dp1 mb8x1 rc=full offload=optimizer");
    let adam = phi / host.adam_params_per_s;
    assert!((long.time.optimizer_s - adam).abs() < 1e-9 * adam);
    assert!((long.time.offload_exposed_s - copy).abs() < 1e-9 * copy);
    // One sequence per micro-batch: part of the gradients' copy shows.
    let short = at("dp1 mb1x8 rc=full offload=optimizer");
    let exposed = short.time.offload_exposed_s;
    assert!(
        exposed > copy && exposed < 2.0 * copy,
        "{exposed} vs {copy}"
    );
    // The step adds them where the device's step was.
    let on_device = at("dp1 mb1x8 rc=full");
    let added = short.time.step_s - on_device.time.step_s;
    let want = adam + exposed - on_device.time.optimizer_s;
    assert!((added - want).abs() < 1e-9, "{added} vs {want}");
}

#[test]
fn a_small_model_keeps_its_optimizer_on_the_device() {
    // ~1.4B parameters: 16Φ ≈ 22 GB fits the device, and the CPU's AdamW is slower.
    let cfg = ModelConfig::llama(32000, 2048, 5632, 24, 16, 16);
    let job = job(cfg, Precision::Bf16);
    let cluster = one_h100(128_000_000_000);
    let p = plan(&job, &cluster, &SearchSpace::default()).unwrap();
    let best = &p.feasible[0];
    assert_eq!(best.layout.offload, Offload::None, "{}", best.layout);
    let twin = Layout {
        offload: Offload::Optimizer,
        ..best.layout
    };
    let x = evaluate(&job, &cluster, &twin).unwrap();
    assert!(x.fits, "{twin} fits too");
    assert!(x.time.tokens_per_s < best.time.tokens_per_s);
    assert!(x.resident < best.resident);
}

#[test]
fn offload_needs_16_bit_weights_and_a_host() {
    let (bf16, _) = llama_7b();
    let fp32 = Job {
        precision: Precision::Fp32,
        ..bf16.clone()
    };
    let cluster = one_h100(128_000_000_000);
    let name: Layout = "dp1 mb1x8 offload=optimizer".parse().unwrap();
    let err = evaluate(&fp32, &cluster, &name).unwrap_err().to_string();
    assert!(err.contains("fp32"), "{err}");
    let space = SearchSpace::default();
    let offloaded = |j: &Job, c: &Cluster| {
        layouts(j, c, &space)
            .iter()
            .filter(|l| l.offload == Offload::Optimizer)
            .count()
    };
    assert_eq!(offloaded(&fp32, &cluster), 0);
    assert!(offloaded(&bf16, &cluster) > 0);
    let no_host = Cluster {
        host: None,
        ..cluster.clone()
    };
    assert_eq!(offloaded(&bf16, &no_host), 0);
    let err = evaluate(&bf16, &no_host, &name).unwrap_err().to_string();
    assert!(err.contains("no host memory"), "{err}");
}
