//! Optional per-kernel wall-clock timers for benchmarks: off by default (one relaxed atomic load
//! per call), switched on with [`enable`], read with [`report`].
//!
//! On a GPU a kernel call only queues work, so its wall time would land on whichever later
//! call waits for the device. [`synchronize_with`] installs the device's wait, run before and
//! after every timed call: each class is then charged the device time of its own kernels (at
//! the price of an idle queue between them, so such a step is for the breakdown, not for
//! throughput).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Instant;

/// The device wait of a synchronised profile.
pub type Sync = Arc<dyn Fn() + Send + std::marker::Sync>;

static SYNC: RwLock<Option<Sync>> = RwLock::new(None);

/// Wait for the device with `sync` around every timed call (`None`: host wall time only).
pub fn synchronize_with(sync: Option<Sync>) {
    *SYNC.write().unwrap_or_else(|e| e.into_inner()) = sync;
}

/// The kernel classes time is attributed to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kernel {
    /// Activation-side matmuls (forward and input gradient).
    Matmul,
    /// Weight-gradient matmuls.
    MatmulWeight,
    Attention,
    Norm,
    Rope,
    Activation,
    /// MoE routing, gather and scatter.
    Router,
    Embedding,
    /// Final norm, LM head and cross-entropy.
    Head,
    /// Waiting for other context-parallel ranks' keys, values and their gradients: the ring's
    /// communication that compute did not hide.
    ContextWait,
    /// Waiting for expert parallelism's all-to-alls (tokens to their experts and back).
    ExpertExchange,
    /// The optimizer's update: AdamW on the device, or on the host under ZeRO-Offload
    /// (with its wait for the landed gradients and the weights' uploads).
    Optimizer,
}

const ALL: [Kernel; 12] = [
    Kernel::Matmul,
    Kernel::MatmulWeight,
    Kernel::Attention,
    Kernel::Norm,
    Kernel::Rope,
    Kernel::Activation,
    Kernel::Router,
    Kernel::Embedding,
    Kernel::Head,
    Kernel::ContextWait,
    Kernel::ExpertExchange,
    Kernel::Optimizer,
];

static ENABLED: AtomicBool = AtomicBool::new(false);
static NANOS: [AtomicU64; ALL.len()] = [const { AtomicU64::new(0) }; ALL.len()];

/// Turn timing on or off.
pub fn enable(on: bool) {
    ENABLED.store(on, Ordering::Relaxed);
}

/// Zero all counters.
pub fn reset() {
    NANOS.iter().for_each(|n| n.store(0, Ordering::Relaxed));
}

/// Run `f`, charging its wall time to `k` when timing is on.
#[inline]
pub fn time<R>(k: Kernel, f: impl FnOnce() -> R) -> R {
    if !ENABLED.load(Ordering::Relaxed) {
        return f();
    }
    let sync = SYNC.read().unwrap_or_else(|e| e.into_inner()).clone();
    if let Some(s) = &sync {
        s();
    }
    let t = Instant::now();
    let r = f();
    if let Some(s) = &sync {
        s();
    }
    NANOS[k as usize].fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
    r
}

/// Seconds spent per kernel class since the last [`reset`].
pub fn report() -> Vec<(Kernel, f64)> {
    ALL.iter()
        .map(|&k| (k, NANOS[k as usize].load(Ordering::Relaxed) as f64 * 1e-9))
        .collect()
}
