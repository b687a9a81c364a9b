//! End-to-end collectives with real processes: workers started by `xtrain launch` (or by
//! `xtrain bench comm --nproc`) rendezvous through the TCP store, connect over shared
//! memory or TCP, and check every collective's result exactly (the bench's `#wrong`
//! column). Also: a rank killed mid-run makes the others fail within the timeout.
use std::net::TcpListener;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

const XTRAIN: &str = env!("CARGO_BIN_EXE_xtrain");

fn xtrain() -> Command {
    let mut c = Command::new(XTRAIN);
    c.env_remove("RUST_BACKTRACE")
        .env_remove("RUST_LIB_BACKTRACE");
    for v in [
        "XTRAIN_TRANSPORT",
        "XTRAIN_ALLREDUCE_ALGO",
        "XTRAIN_COMM_TIMEOUT",
        "XTRAIN_JOB_ID",
        "XTRAIN_JOB_TOKEN",
        "XTRAIN_ALLOW_NO_TOKEN",
        "XTRAIN_STORE_BIND",
        "XTRAIN_SHM_SINGLE_COPY",
        "XTRAIN_SHM_SINGLE_COPY_MIN",
    ] {
        c.env_remove(v);
    }
    c
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// Data rows of the bench table: (bytes, #wrong).
fn rows(stdout: &str) -> Vec<(usize, i64)> {
    stdout
        .lines()
        .map(|l| l.trim_start_matches("[rank 0] "))
        .filter(|l| !l.starts_with('#'))
        .map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f[0].parse().unwrap(), f[f.len() - 1].parse().unwrap())
        })
        .collect()
}

/// Transports of the end-to-end tests: shared memory through its rings (single copy off),
/// shared memory with single-copy ring steps at every size (the ring all-reduce too), and TCP.
/// (name, transport, extra environment).
type Path = (
    &'static str,
    &'static str,
    &'static [(&'static str, &'static str)],
);
const PATHS: [Path; 3] = [
    ("shm", "shm", &[("XTRAIN_SHM_SINGLE_COPY", "0")]),
    (
        "shm single copy",
        "shm",
        &[
            ("XTRAIN_SHM_SINGLE_COPY", "1"),
            ("XTRAIN_SHM_SINGLE_COPY_MIN", "0"),
            ("XTRAIN_ALLREDUCE_ALGO", "ring"),
        ],
    ),
    ("tcp", "tcp", &[]),
];

#[test]
fn every_collective_is_exact_through_launch_over_shm_and_tcp() {
    for (path, transport, env) in PATHS {
        for op in [
            "all_reduce",
            "all_gather",
            "reduce_scatter",
            "all_to_all",
            "broadcast",
        ] {
            // Sizes 1000, 4000, 16000, 64000 bytes: counts that do not split evenly too.
            let out = xtrain()
                .envs(env.iter().copied())
                .env("XTRAIN_TRANSPORT", transport)
                .env("XTRAIN_COMM_TIMEOUT", "20")
                .args([
                    "launch",
                    "--nproc-per-node",
                    "3",
                    "--",
                    XTRAIN,
                    "bench",
                    "comm",
                ])
                .args([
                    "--op", op, "--min", "1000", "--max", "64000", "--factor", "4",
                ])
                .args(["--iters", "2", "--warmup", "1"])
                .output()
                .unwrap();
            let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
            assert!(out.status.success(), "{op} over {path}: {stderr}");
            assert!(
                stdout.contains(&format!("{op} over 3 rank(s), transport {transport}")),
                "{stdout}"
            );
            // Forced off, the rings carry everything (forced on, it depends on whether this
            // host lets sibling processes use process_vm_readv, e.g. Yama's ptrace_scope).
            if env.contains(&("XTRAIN_SHM_SINGLE_COPY", "0")) {
                assert!(stdout.contains("single-copy shared memory off"), "{stdout}");
            }
            let rows = rows(&stdout);
            assert_eq!(rows.len(), 4, "{stdout}");
            assert!(rows.iter().all(|&(_, wrong)| wrong == 0), "{stdout}");
        }
    }
}

#[test]
fn bench_spawns_its_own_workers_for_every_algorithm() {
    for algo in ["ring", "tree", "rhd", "rd", "auto"] {
        let out = xtrain()
            .args(["bench", "comm", "--nproc", "3", "--algo", algo, "--json"])
            .args([
                "--min", "4K", "--max", "256K", "--factor", "8", "--iters", "3",
            ])
            .output()
            .unwrap();
        assert!(out.status.success(), "{algo}: {}", text(&out.stderr));
        let doc: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(doc["nproc"], 3);
        assert_eq!(doc["algo"], algo);
        let rows = doc["rows"].as_array().unwrap();
        let bytes: Vec<u64> = rows.iter().map(|r| r["bytes"].as_u64().unwrap()).collect();
        assert_eq!(bytes, [4096, 32768, 262144]);
        for r in rows {
            assert_eq!(r["wrong"], 0, "{algo}: {r}");
            let (alg, bus) = (
                r["algbw_gbs"].as_f64().unwrap(),
                r["busbw_gbs"].as_f64().unwrap(),
            );
            // all-reduce bus factor 2(n-1)/n with n = 3.
            assert!((bus - alg * 4.0 / 3.0).abs() <= 1e-9 * bus.max(1.0), "{r}");
            assert!(r["time_us"].as_f64().unwrap() > 0.0);
        }
    }
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Starts rank `rank` of `n` by hand (no launcher), running the bench with rank 1 set to
/// kill itself after a few timed iterations.
fn spawn_rank(
    rank: usize,
    n: usize,
    port: u16,
    (transport, env): (&str, &[(&str, &str)]),
    timeout_s: u64,
) -> Child {
    xtrain()
        .envs(env.iter().copied())
        .env("RANK", rank.to_string())
        .env("WORLD_SIZE", n.to_string())
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", port.to_string())
        .env("XTRAIN_COMM_TIMEOUT", timeout_s.to_string())
        .args([
            "bench",
            "comm",
            "--transport",
            transport,
            "--min",
            "256K",
            "--max",
            "256K",
        ])
        .args([
            "--iters",
            "100000",
            "--warmup",
            "0",
            "--kill-rank",
            "1",
            "--kill-after",
            "3",
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

#[test]
fn a_rank_killed_mid_run_makes_the_others_fail_within_the_timeout() {
    let timeout_s = 3;
    for (path, transport, env) in PATHS {
        let start = Instant::now();
        let port = free_port();
        let children: Vec<Child> = (0..3)
            .map(|r| spawn_rank(r, 3, port, (transport, env), timeout_s))
            .collect();
        let outs: Vec<Output> = children
            .into_iter()
            .map(|c| c.wait_with_output().unwrap())
            .collect();
        let took = start.elapsed();
        assert!(
            took < Duration::from_secs(timeout_s + 10),
            "{path}: took {took:?}"
        );
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(
            outs[1].status.signal(),
            Some(9),
            "{path}: rank 1 kills itself"
        );
        // An error names a rank as "rank 1 closed ..." or "waiting for rank(s) [1]".
        let names = |stderr: &str, r: usize| {
            stderr.contains(&format!("rank {r} ")) || stderr.contains(&format!("rank(s) [{r}]"))
        };
        let err: Vec<String> = outs.iter().map(|o| text(&o.stderr)).collect();
        assert!(
            !outs[0].status.success() && !outs[2].status.success(),
            "{path}: {err:?}"
        );
        // Rank 0 waits on rank 1 directly in the barrier and collectives of 3 ranks.
        assert!(names(&err[0], 1), "{path}: rank 0: {}", err[0]);
        // Rank 2 may be waiting on rank 0, which gave up because of rank 1. Over TCP it sees
        // rank 0 close and reads rank 0's reason (naming rank 1) from the store; over shared
        // memory both may reach their timeout at the same moment.
        match transport {
            "tcp" => assert!(names(&err[2], 1), "rank 2: {}", err[2]),
            _ => assert!(names(&err[2], 1) || names(&err[2], 0), "rank 2: {}", err[2]),
        }
    }
}

#[test]
fn a_rank_killed_mid_run_fails_the_launch_naming_it() {
    let start = Instant::now();
    let out = xtrain()
        .env("XTRAIN_COMM_TIMEOUT", "20")
        .args([
            "launch",
            "--nproc-per-node",
            "3",
            "--",
            XTRAIN,
            "bench",
            "comm",
        ])
        .args([
            "--min", "256K", "--max", "256K", "--iters", "100000", "--warmup", "0",
        ])
        .args(["--kill-rank", "1", "--kill-after", "3"])
        .output()
        .unwrap();
    let stderr = text(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains("rank 1 (pid ") && stderr.contains("killed by signal 9 (SIGKILL)"),
        "{stderr}"
    );
    // The launcher stops the others at once, long before the 20 s communication timeout.
    assert!(
        start.elapsed() < Duration::from_secs(10),
        "took {:?}",
        start.elapsed()
    );
}

#[test]
fn two_launchers_form_one_job_like_two_hosts() {
    // What `--nnodes 2` on two hosts does, with both "hosts" here: each launcher starts 2
    // ranks, they meet at the store hosted by rank 0 (proving the token exported on both
    // "hosts") and run collectives over TCP.
    let port = free_port().to_string();
    let node = |rank: &str| {
        xtrain()
            .env("XTRAIN_COMM_TIMEOUT", "20")
            .env("XTRAIN_JOB_TOKEN", "shared-by-both-hosts-0123")
            .args([
                "launch",
                "--nproc-per-node",
                "2",
                "--nnodes",
                "2",
                "--node-rank",
                rank,
            ])
            .args(["--master-addr", "127.0.0.1", "--master-port", &port, "--"])
            .args([
                XTRAIN,
                "bench",
                "comm",
                "--transport",
                "tcp",
                "--min",
                "4K",
                "--max",
                "64K",
            ])
            .args(["--factor", "4", "--iters", "2"])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    };
    // Node 1 first: its ranks must wait for rank 0's store to appear.
    let second = node("1");
    std::thread::sleep(Duration::from_millis(200));
    let first = node("0");
    let (a, b) = (
        first.wait_with_output().unwrap(),
        second.wait_with_output().unwrap(),
    );
    assert!(a.status.success(), "node 0: {}", text(&a.stderr));
    assert!(b.status.success(), "node 1: {}", text(&b.stderr));
    let stdout = text(&a.stdout);
    assert!(
        stdout.contains("all_reduce over 4 rank(s), transport tcp"),
        "{stdout}"
    );
    let rows = rows(&stdout);
    assert_eq!(rows.len(), 3, "{stdout}");
    assert!(rows.iter().all(|&(_, wrong)| wrong == 0), "{stdout}");
    // Only rank 0 (on node 0) prints the table.
    assert!(text(&b.stdout).trim().is_empty(), "{}", text(&b.stdout));
}

#[test]
fn a_rank_with_another_token_is_refused_by_the_store() {
    let port = free_port();
    let rank = |r: usize, token: &str| {
        xtrain()
            .env("RANK", r.to_string())
            .env("WORLD_SIZE", "2")
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", port.to_string())
            .env("XTRAIN_COMM_TIMEOUT", "3")
            .env("XTRAIN_JOB_TOKEN", token)
            .args([
                "bench", "comm", "--min", "4K", "--max", "4K", "--iters", "1",
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    };
    let host = rank(0, "the-real-job-token-0001");
    let stranger = rank(1, "a-guessed-job-token-999")
        .wait_with_output()
        .unwrap();
    let host = host.wait_with_output().unwrap();
    assert!(!stranger.status.success());
    let err = text(&stranger.stderr);
    assert!(err.contains("job token proof rejected"), "{err}");
    // Rank 0 never saw a rank 1 and gives up at its timeout.
    assert!(!host.status.success());
    assert!(
        text(&host.stderr).contains("timed out"),
        "{}",
        text(&host.stderr)
    );
}

/// `--device cuda`: the buffers on each rank's GPU, staged through host memory around the
/// collective, with the copies alone measured beside it; every result checked from the GPU's
/// copy. Without a GPU, one clear error naming the option.
#[test]
fn bench_comm_stages_gpu_buffers_or_says_there_is_no_gpu() {
    let gpus = tensor::cuda::device_count().unwrap_or(0);
    for op in ["all_reduce", "all_gather", "reduce_scatter"] {
        let out = xtrain()
            .args([
                "bench", "comm", "--nproc", "2", "--device", "cuda", "--json",
            ])
            .args(["--op", op, "--min", "4K", "--max", "64K", "--factor", "16"])
            .args(["--iters", "2", "--warmup", "1"])
            .output()
            .unwrap();
        if gpus == 0 {
            assert!(!out.status.success(), "{op}: ran without a GPU");
            let stderr = text(&out.stderr);
            assert!(
                stderr.contains("bench comm --device cuda"),
                "{op}: {stderr}"
            );
            eprintln!("no GPU: bench comm --device cuda refused ({op})");
            continue;
        }
        assert!(out.status.success(), "{op}: {}", text(&out.stderr));
        let doc: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert!(doc["device"].as_str().unwrap().starts_with("cuda"), "{doc}");
        for r in doc["rows"].as_array().unwrap() {
            assert_eq!(r["wrong"], 0, "{op}: {r}");
            let (time, copy) = (
                r["time_us"].as_f64().unwrap(),
                r["copy_us"].as_f64().unwrap(),
            );
            assert!(copy > 0.0 && copy < time * 4.0, "{op}: {r}");
            assert!(r["copy_gbs"].as_f64().unwrap() > 0.0, "{op}: {r}");
        }
    }
}
