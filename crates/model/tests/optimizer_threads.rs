//! The optimizer's parallel loops stay inside the per-process thread budget: with a budget of
//! one thread, AdamW, the gradient norm and the gradient scaling must not start rayon's global
//! pool (one thread per core). This file holds a single test, so the process's threads are
//! the harness's main thread, the test's thread and whatever the code under test started.
#![cfg(target_os = "linux")]

use model::optim::{clip_grad_norm, AdamW};

/// Names of this process's threads that are not budget-pool workers.
fn other_threads() -> Vec<String> {
    std::fs::read_dir("/proc/self/task")
        .expect("listing /proc/self/task")
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .map(|c| c.trim().to_string())
        .filter(|c| !c.starts_with("xtrain-kernel-"))
        .collect()
}

#[test]
fn optimizer_runs_on_the_budget_pool_only() {
    tensor::threads::set_thread_budget(1).unwrap();
    let n = 1 << 20;
    let mut params: Vec<f32> = (0..n).map(|i| (i % 97) as f32 * 1e-3).collect();
    let mut grads: Vec<f32> = (0..n).map(|i| ((i % 13) as f32 - 6.0) * 1e-2).collect();
    let (mut m, mut v) = (vec![0.0f32; n], vec![0.0f32; n]);
    let norm = clip_grad_norm(&mut grads, 0.5);
    assert!(norm > 0.5);
    AdamW::default().update(1, 1e-3, 0.1, &mut params, &grads, &mut m, &mut v);
    let others = other_threads();
    assert!(
        others.len() <= 2,
        "threads outside the budget pool: {others:?} (rayon's global pool was used)"
    );
}
