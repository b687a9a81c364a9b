//! Utilities to run N ranks as threads of one process (for this crate's and other crates' tests).
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::communicator::{Communicator, Options};
use crate::store::MemStore;

/// A job id unique within this process run (shared-memory names and store keys stay apart
/// when tests run in parallel).
pub fn unique_job_id() -> String {
    static N: AtomicU64 = AtomicU64::new(0);
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    format!(
        "test-{}-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed),
        t % 1_000_000_007
    )
}

/// Runs `f` on `n` ranks (threads) sharing an in-memory store, all on one host, with
/// [`Options::default`] apart from a unique job id and a 30 s timeout. Returns each rank's
/// result in rank order; a panic on any rank is re-raised.
pub fn run_threads<R: Send>(n: usize, f: impl Fn(Communicator) -> R + Sync) -> Vec<R> {
    let options = Options {
        timeout: std::time::Duration::from_secs(30),
        ..Options::default()
    };
    run_threads_with(n, options, f)
}

/// [`run_threads`] with explicit options (the job id is made unique).
pub fn run_threads_with<R: Send>(
    n: usize,
    options: Options,
    f: impl Fn(Communicator) -> R + Sync,
) -> Vec<R> {
    let hosts = vec!["localhost".to_string(); n];
    run_threads_on_hosts(&hosts, options, f)
}

/// Like [`run_threads_with`], with rank i claiming host identity `hosts[i]` (to exercise the
/// per-pair choice of shared memory vs TCP within one process).
pub fn run_threads_on_hosts<R: Send>(
    hosts: &[String],
    options: Options,
    f: impl Fn(Communicator) -> R + Sync,
) -> Vec<R> {
    let n = hosts.len();
    let store = Arc::new(MemStore::new());
    let options = Options {
        job_id: unique_job_id(),
        ..options
    };
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..n)
            .map(|rank| {
                let store = Arc::clone(&store);
                let options = options.clone();
                let f = &f;
                let host = &hosts[rank];
                std::thread::Builder::new()
                    .name(format!("rank{rank}"))
                    .spawn_scoped(s, move || {
                        let comm = Communicator::init(store, rank, n, host, options)
                            .unwrap_or_else(|e| panic!("rank {rank}: init failed: {e}"));
                        f(comm)
                    })
                    .expect("spawning a rank thread")
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
            .collect()
    })
}
