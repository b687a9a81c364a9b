//! Optimizer offload in the planner: a 7B Llama that fits one 80 GB H100 only with its
//! optimizer in 128 GB of host memory, the host bytes it needs (14Φ), a host too small named
//! as the shortfall, the step time of the CPU's AdamW and the copies, and a small model the
//! search keeps on the device because offload is slower; the delayed update's host bytes and
//! step time.
use model::ModelConfig;
use parallel::data_parallel::ZeroStage;
use parallel::memory::human;
use parallel::plan::search::layouts;
use parallel::plan::time::{offload, Overlap};
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
        gpu: false,
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
    assert!(p.feasible.iter().all(|x| x.layout.offload.on_host()));
    for offload in [Offload::Optimizer, Offload::Delayed] {
        let best = p
            .feasible
            .iter()
            .find(|x| x.layout.offload == offload)
            .unwrap();
        // Device: 16-bit weights and gradients, 2Φ + 2Φ; host: master, m, v and the landed
        // 16-bit gradients, 14Φ (one rank: its shard is the whole model), and a delayed
        // update's held gradients, 2Φ more.
        assert_eq!(best.peak.model_states(), 4 * phi, "{}", best.layout);
        assert_eq!((best.peak.master, best.peak.optimizer), (0, 0));
        let per = if offload == Offload::Delayed { 16 } else { 14 };
        assert_eq!(best.host, per * phi, "{}", best.layout);
    }
    let best = &p.feasible[0];
    assert!(best.resident as u64 <= cluster.memory_bytes);
    assert!(best.host as u64 <= cluster.host_share().unwrap());
}

#[test]
fn a_host_too_small_is_the_shortfall() {
    // 80 GiB of host memory: the offloaded 7B needs 14Φ ≈ 87.9 GiB.
    let (job, phi) = llama_7b();
    let cluster = one_h100(80 * GIB);
    let p = plan(&job, &cluster, &SearchSpace::default()).unwrap();
    assert!(p.feasible.is_empty());
    let s = p.shortfall.unwrap();
    assert_eq!(s.closest.layout.offload, Offload::Optimizer);
    assert_eq!(s.short_bytes, 0, "the device holds it");
    assert_eq!(s.short_host_bytes, (14 * phi) as u64 - 80 * GIB);
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
    let link = |bytes: f64| host.link.latency + bytes / host.link.bandwidth;
    let at = |job: &Job, name: &str| evaluate(job, &cluster, &name.parse().unwrap()).unwrap();
    let adam = phi / host.adam_params_per_s;
    // This engine: each direction moves 2 bytes per parameter of the shard (the whole model
    // here). The gradients land behind the last backward; the weights go up chunk by chunk
    // while the CPU's AdamW runs, and the last chunk's upload shows. On the H100's PCIe 5
    // both copies (0.27 s each) hide, behind 8 sequences' backward and AdamW (1.7 s); on a
    // link of 2 GB/s (6.7 s each) they show; the gradients' less after 8 sequences' backward
    // than after one's (on PCIe 5 one sequence's hides part of them).
    let chunk = parallel::precision::DEVICE_CHUNK as f64;
    let mut slow = cluster.clone();
    slow.host.as_mut().unwrap().link.bandwidth = 2e9;
    for c in [&cluster, &slow] {
        let h = c.host.as_ref().unwrap();
        let link = |bytes: f64| h.link.latency + bytes / h.link.bandwidth;
        let weights = (link(2.0 * phi) - adam).max(0.0) + link(2.0 * chunk);
        let mut exposed_by_name = Vec::new();
        for name in [
            "dp1 mb8x1 rc=full offload=optimizer",
            "dp1 mb1x8 rc=full offload=optimizer",
        ] {
            let x = evaluate(&job, c, &name.parse().unwrap()).unwrap();
            assert!((x.time.optimizer_s - adam).abs() < 1e-9 * adam, "{name}");
            let exposed = x.time.offload_exposed_s;
            // Beyond the weights' part, the gradients' copy less some backward.
            let grads = exposed - weights;
            assert!(
                grads > -1e-9 * weights && grads <= link(2.0 * phi) * (1.0 + 1e-9),
                "{name}: {exposed} vs {weights} + at most {}",
                link(2.0 * phi)
            );
            exposed_by_name.push(grads);
        }
        // A step's last backward is 8 sequences' or one's: the one hides more.
        assert!(
            exposed_by_name[0] < exposed_by_name[1] && exposed_by_name[1] > 0.0,
            "{exposed_by_name:?}"
        );
        if std::ptr::eq(c, &cluster) {
            assert_eq!(exposed_by_name[0], 0.0, "hidden on PCIe 5 by 8 sequences");
        }
    }
    // The step adds them where the device's step was.
    let short = at(&job, "dp1 mb1x8 rc=full offload=optimizer");
    let on_device = at(&job, "dp1 mb1x8 rc=full");
    let added = short.time.step_s - on_device.time.step_s;
    let want_added = adam + short.time.offload_exposed_s - on_device.time.optimizer_s;
    assert!((added - want_added).abs() < 1e-9, "{added} vs {want_added}");
    // Megatron's conventions, DeepSpeed's overlap: the gradients' copy (fp32, 4 bytes a
    // parameter, ~0.54 s) behind the last backward — hidden by 8 sequences' (~0.7 s), partly
    // shown after one sequence's — then the weights' copy back, exposed.
    let megatron = Job {
        conventions: Conventions::Megatron,
        ..job.clone()
    };
    let back = link(2.0 * phi);
    let long = at(&megatron, "dp1 mb8x1 rc=full offload=optimizer");
    assert!((long.time.offload_exposed_s - back).abs() < 1e-9 * back);
    let exposed = at(&megatron, "dp1 mb1x8 rc=full offload=optimizer")
        .time
        .offload_exposed_s;
    assert!(
        exposed > back && exposed < back + link(4.0 * phi),
        "{exposed} vs {back}"
    );
}

/// The delayed update (`offload=delayed`): the CPU's AdamW beside the next step's device work
/// D and the gradients' exposed landing G, `max(D + G, AdamW)`, then the updated weights' upload
/// W; the same D and G as updating in place. At ZeRO-0 the weights go up unit by unit behind
/// the next step's first forward F: W = max(0, α + 2Φ/β − F) plus the largest unit's upload —
/// that unit's alone where F is the longer (8 sequences' forward here), more where it is not
/// (one sequence's); at other stages all of α + 2Φ/β.
#[test]
fn a_delayed_update_hides_the_cpu_step_behind_the_next_step() {
    let (job, phi) = llama_7b();
    let cluster = one_h100(128_000_000_000);
    let h = cluster.host.unwrap();
    let phi = phi as f64;
    let link = |bytes: f64| h.link.latency + bytes / h.link.bandwidth;
    let adam = phi / h.adam_params_per_s;
    let chunk = parallel::precision::DEVICE_CHUNK as f64;
    // The largest unit: a block (norms, the four attention projections, the MLP's three).
    let m = &job.model;
    let (hid, ffn) = (m.hidden_size as f64, m.intermediate_size as f64);
    let kv = (m.kv_heads() * m.head_dim()) as f64;
    let block = 2.0 * hid + 2.0 * hid * hid + 2.0 * hid * kv + 3.0 * hid * ffn;
    let unit_up = link(2.0 * block);
    let at = |name: &str| evaluate(&job, &cluster, &name.parse().unwrap()).unwrap();
    let close = |a: f64, b: f64| (a - b).abs() <= 1e-9 * b;
    for (layout, hidden) in [
        ("dp1 mb8x1 rc=full", true),
        ("dp1 mb1x8 rc=full", false),
        ("dp1 mb2x4 rc=none", false),
    ] {
        let plain = at(&format!("{layout} offload=optimizer")).time;
        let delayed = at(&format!("{layout} offload=delayed")).time;
        let device = plain.step_s - plain.optimizer_s - plain.offload_exposed_s;
        let grads = plain.offload_exposed_s - (link(2.0 * phi) - adam).max(0.0) - link(2.0 * chunk);
        let weights = delayed.offload_exposed_s - grads;
        if hidden {
            assert!(close(weights, unit_up), "{layout}: {weights} vs {unit_up}");
        } else {
            assert!(
                weights > unit_up && weights < link(2.0 * phi) + unit_up,
                "{layout}: {weights}"
            );
        }
        let want = (device + grads).max(adam) + weights;
        assert!(
            close(delayed.step_s, want),
            "{layout}: {} vs {want}",
            delayed.step_s
        );
        assert!(
            (delayed.optimizer_s - (adam - device - grads).max(0.0)).abs() <= 1e-9 * adam,
            "{layout}: AdamW exposed {}",
            delayed.optimizer_s
        );
        // Here (PCIe 5: the weights' upload 0.27 s, AdamW 1.7 s) hiding AdamW wins.
        assert!(delayed.step_s < plain.step_s, "{layout}");
    }
    // Where a gather follows (ZeRO-1/2) or the weights are sharded (ZeRO-3), and with
    // DeepSpeed's conventions: one upload, all exposed.
    let o = Overlap {
        backward: 1.0,
        step: 1.0,
        forward: 10.0,
        unit: block,
    };
    let megatron = Job {
        conventions: Conventions::Megatron,
        ..job.clone()
    };
    for (j, zero) in [
        (&job, ZeroStage::One),
        (&job, ZeroStage::Three),
        (&megatron, ZeroStage::Ddp),
    ] {
        let grad_bytes = if j.conventions == Conventions::Megatron {
            4.0
        } else {
            2.0
        };
        let (_, exposed) = offload(j, &h, 1, phi, (Offload::Delayed, zero), o);
        let want = (link(grad_bytes * phi) - 1.0).max(0.0) + link(2.0 * phi);
        assert!(
            close(exposed, want),
            "{zero:?} {:?}: {exposed} vs {want}",
            j.conventions
        );
    }
    let (_, exposed) = offload(&job, &h, 1, phi, (Offload::Delayed, ZeroStage::Ddp), o);
    assert!(
        close(exposed, unit_up),
        "ZeRO-0 behind a long forward: {exposed}"
    );
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
    for offload in [Offload::Optimizer, Offload::Delayed] {
        let twin = Layout {
            offload,
            ..best.layout
        };
        let x = evaluate(&job, &cluster, &twin).unwrap();
        assert!(x.fits, "{twin} fits too");
        assert!(x.time.tokens_per_s < best.time.tokens_per_s, "{twin}");
        assert!(x.resident < best.resident);
    }
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
            .filter(|l| l.offload.on_host())
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
