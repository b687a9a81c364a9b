//! Collective benchmark with ranks as threads of one process (each rank maps the shared
//! memory segment itself, exactly as separate processes do).
//!
//! ```text
//! cargo run --release -p comm --example comm_bench -- [--ranks 2] [--transport shm|tcp]
//!     [--algo auto|ring|tree|hd] [--op all_reduce|all_gather|reduce_scatter|broadcast|all_to_all]
//!     [--sizes 4K,64K,1M,16M,64M] [--iters 20]
//! ```
//! Prints, per size: median time per operation over several timed rounds, algorithm bandwidth
//! (bytes / time) and bus bandwidth (algbw × the usual factor: all-reduce 2(n−1)/n,
//! all-gather/reduce-scatter/all-to-all (n−1)/n, broadcast 1), and rank 0's CPU time per
//! operation. `bytes` is the per-rank buffer (all-gather: the per-rank input).
use std::time::{Duration, Instant};

use comm::testing::run_threads_with;
use comm::*;

fn parse_size(s: &str) -> usize {
    let s = s.trim().to_ascii_uppercase();
    let (num, mul) = match s.chars().last() {
        Some('K') => (&s[..s.len() - 1], 1 << 10),
        Some('M') => (&s[..s.len() - 1], 1 << 20),
        Some('G') => (&s[..s.len() - 1], 1 << 30),
        _ => (&s[..], 1),
    };
    num.parse::<usize>().expect("size") * mul
}

/// CPU time consumed by the calling thread (on an idle machine, wall time approaches it; on a
/// shared one it separates the cost of the code from waiting for a core).
fn thread_cpu() -> f64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes into the timespec we own.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let get = |k: &str, d: &str| -> String {
        args.iter()
            .position(|a| a == k)
            .and_then(|i| args.get(i + 1).cloned())
            .unwrap_or_else(|| d.to_string())
    };
    let n: usize = get("--ranks", "2").parse().unwrap();
    let transport: TransportKind = get("--transport", "shm").parse().unwrap();
    let algo: AllReduceAlgo = get("--algo", "auto").parse().unwrap();
    let op = get("--op", "all_reduce");
    let iters: usize = get("--iters", "20").parse().unwrap();
    let sizes: Vec<usize> = get("--sizes", "4K,64K,1M,16M,64M")
        .split(',')
        .map(parse_size)
        .collect();
    let ring: usize = get("--ring", "0").parse().unwrap();
    let mut options = Options {
        transport,
        algo,
        timeout: Duration::from_secs(120),
        ..Options::from_env().unwrap()
    };
    if ring > 0 {
        options.shm_ring_bytes = ring;
    }
    // Calibration: single-thread memcpy bandwidth of 64 MiB right now (the machine is shared).
    let src = vec![1u8; 64 << 20];
    let mut dst = vec![0u8; 64 << 20];
    let mut best = f64::MAX;
    for _ in 0..5 {
        let t0 = Instant::now();
        dst.copy_from_slice(&src);
        best = best.min(t0.elapsed().as_secs_f64());
        std::hint::black_box(&dst);
    }
    println!(
        "# memcpy 64 MiB: {:.2} GB/s",
        (64 << 20) as f64 / best / 1e9
    );
    println!(
        "# {op} ranks={n} transport={transport:?} algo={algo:?} ring={} (f32, ranks as threads)",
        options.shm_ring_bytes
    );
    println!(
        "{:>10} {:>12} {:>12} {:>12} {:>12}",
        "bytes", "time_us", "algbw_GB/s", "busbw_GB/s", "cpu_us(r0)"
    );
    run_threads_with(n, options, |c| {
        for &bytes in &sizes {
            let len = bytes / 4;
            let mut buf = vec![1.0f32; len];
            let mut out = vec![0.0f32; if op == "all_gather" { len * n } else { len }];
            // Small messages: more iterations per round so timer resolution does not matter.
            let reps = if bytes <= 1 << 16 { iters * 50 } else { iters };
            let run = |buf: &mut Vec<f32>, out: &mut Vec<f32>| match op.as_str() {
                "all_reduce" => c.all_reduce(buf, ReduceOp::Sum).unwrap(),
                "all_gather" => c.all_gather(buf, out).unwrap(),
                "reduce_scatter" => {
                    let m = shard_range(len, n, c.rank()).len();
                    c.reduce_scatter(buf, &mut out[..m], ReduceOp::Sum).unwrap()
                }
                "broadcast" => c.broadcast(buf, 0).unwrap(),
                "all_to_all" => {
                    let l = len / n * n;
                    c.all_to_all(&buf[..l], &mut out[..l]).unwrap()
                }
                other => panic!("unknown op {other}"),
            };
            for _ in 0..3 {
                run(&mut buf, &mut out);
            }
            let mut times = Vec::new();
            let mut cpus = Vec::new();
            for _ in 0..5 {
                c.barrier().unwrap();
                let (t0, c0) = (Instant::now(), thread_cpu());
                for _ in 0..reps {
                    run(&mut buf, &mut out);
                }
                times.push(t0.elapsed().as_secs_f64() / reps as f64);
                cpus.push((thread_cpu() - c0) / reps as f64);
            }
            times.sort_by(|a, b| a.partial_cmp(b).unwrap());
            cpus.sort_by(|a, b| a.partial_cmp(b).unwrap());
            let (t, cpu) = (times[times.len() / 2], cpus[cpus.len() / 2]);
            let nf = n as f64;
            let factor = match op.as_str() {
                "all_reduce" => 2.0 * (nf - 1.0) / nf,
                "broadcast" => 1.0,
                _ => (nf - 1.0) / nf,
            };
            let algbw = bytes as f64 / t / 1e9;
            if c.rank() == 0 {
                println!(
                    "{:>10} {:>12.1} {:>12.3} {:>12.3} {:>12.1}",
                    bytes,
                    t * 1e6,
                    algbw,
                    algbw * factor,
                    cpu * 1e6
                );
            }
        }
    });
}
