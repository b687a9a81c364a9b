//! Multi-host training on one machine: two network namespaces joined by a veth pair are two
//! "hosts" with their own addresses. `xtrain launch --nnodes 2 --node-rank K
//! --nproc-per-node 2 --master-addr <host 0>` runs in each; the ranks must reach their own
//! host's peers by shared memory and the other host's by TCP (checked from the transports each
//! group logs), and train with the single process's losses: pure data parallel over 4 ranks,
//! and tp 2 inside each host × dp 2 across the hosts.
//!
//! Creating namespaces needs root (CI runs as root); elsewhere the test says on stderr that
//! it was skipped, and passes, except where `XTRAIN_REQUIRE` lists `netns` (CI sets it), where
//! a skip fails.
mod common;
use common::*;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Added to `FAST_RUN`: one sequence per micro-batch, so that 4 data-parallel ranks and 1
/// process with 4 accumulation steps read the same global batch; three steps.
const SMALL: [&str; 6] = [
    "--set",
    "train.micro_batch=1",
    "--set",
    "train.min_lr=3e-3",
    "--set",
    "train.steps=3",
];

/// Subnet of the veth pair: host 0 is `.1`, host 1 is `.2`. The pair lives only inside its
/// namespaces, so it cannot clash with the machine's own networks.
const SUBNET: &str = "10.231.7";

/// Runs `ip <args>`; the error names the command and what it printed.
fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| format!("ip {}: {e}", args.join(" ")))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// Two network namespaces joined by a veth pair, deleted on drop (also when the test fails:
/// deleting a namespace deletes its end of the pair, and with it the other end).
struct Hosts {
    names: [String; 2],
}

impl Hosts {
    fn create() -> Result<Hosts, String> {
        let tag = format!("{}", std::process::id());
        let hosts = Hosts {
            names: [format!("xtrain-mh{tag}-0"), format!("xtrain-mh{tag}-1")],
        };
        for n in &hosts.names {
            let _ = ip(&["netns", "del", n]); // a leftover of a killed run with this pid
            ip(&["netns", "add", n])?;
        }
        let veth = [format!("xv{tag}a"), format!("xv{tag}b")];
        ip(&[
            "link", "add", &veth[0], "type", "veth", "peer", "name", &veth[1],
        ])?;
        for (k, (ns, dev)) in hosts.names.iter().zip(&veth).enumerate() {
            ip(&["link", "set", dev, "netns", ns])?;
            let addr = format!("{SUBNET}.{}/24", k + 1);
            ip(&["-n", ns, "addr", "add", &addr, "dev", dev])?;
            ip(&["-n", ns, "link", "set", dev, "up"])?;
            ip(&["-n", ns, "link", "set", "lo", "up"])?;
        }
        Ok(hosts)
    }
}

impl Drop for Hosts {
    fn drop(&mut self) {
        for n in &self.names {
            let _ = ip(&["netns", "del", n]);
        }
    }
}

/// The namespaces, or `None` after printing why the test is skipped (a failure instead where
/// `XTRAIN_REQUIRE` lists `netns`, as CI's does: see `tensor::skip`).
fn hosts_or_skip() -> Option<Hosts> {
    // SAFETY: geteuid only reads this process's effective user id.
    let reason = if unsafe { libc::geteuid() } != 0 {
        "not running as root".to_string()
    } else {
        match Hosts::create() {
            Ok(h) => return Some(h),
            Err(e) => format!("cannot create network namespaces ({e})"),
        }
    };
    tensor::skip::skip(
        "multi-host test",
        "netns",
        &format!("{reason}; it needs root and `ip netns` (Debian: iproute2)"),
    );
    None
}

/// The two launchers of one job, one per namespace, each running `xtrain train` with
/// `layout`; returns the combined output of both. Fails the test if either fails or hangs.
fn launch_two_hosts(hosts: &Hosts, out: &Path, layout: &[&str]) -> String {
    let exe = env!("CARGO_BIN_EXE_xtrain");
    let master = format!("{SUBNET}.1");
    // The store of a job spanning hosts is reachable from other hosts, so every host's
    // launcher is given the same job secret (as `export XTRAIN_JOB_TOKEN=...` would).
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock after 1970")
        .as_nanos();
    let token = format!("multihost-test-{}-{nanos:x}", std::process::id());
    let children: Vec<_> = hosts
        .names
        .iter()
        .enumerate()
        .map(|(k, ns)| {
            let node_rank = k.to_string();
            let args = [
                &[
                    "netns",
                    "exec",
                    ns,
                    exe,
                    "launch",
                    "--nnodes",
                    "2",
                    "--node-rank",
                    &node_rank,
                    "--nproc-per-node",
                    "2",
                    "--master-addr",
                    &master,
                    "--master-port",
                    "29500",
                    "--",
                    exe,
                    "train",
                    "--quiet",
                    "--out",
                    out.to_str().unwrap(),
                ][..],
                &FAST_RUN,
                &SMALL,
                layout,
            ]
            .concat();
            Command::new("ip")
                .args(args)
                .env_remove("RANK")
                .env_remove("WORLD_SIZE")
                .env("RUST_LOG", "comm=info")
                .env("RUST_BACKTRACE", "0")
                .env("XTRAIN_COMM_TIMEOUT", "120")
                .env("XTRAIN_JOB_TOKEN", &token)
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .expect("starting ip netns exec")
        })
        .collect();
    let deadline = Instant::now() + Duration::from_secs(400);
    let mut text = String::new();
    let mut failed = Vec::new();
    for (k, mut child) in children.into_iter().enumerate() {
        while child.try_wait().unwrap().is_none() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
        }
        if child.try_wait().unwrap().is_none() {
            let _ = child.kill();
            failed.push(format!("host {k} timed out"));
        }
        let o = child.wait_with_output().unwrap();
        if !o.status.success() {
            failed.push(format!("host {k}: {}", o.status));
        }
        text += &String::from_utf8_lossy(&o.stdout);
        text += &String::from_utf8_lossy(&o.stderr);
    }
    assert!(failed.is_empty(), "{failed:?}\n{text}");
    text
}

/// Every group's transports from the `comm` log lines
/// `group NAME: rank R reaches shm [..] tcp [..]`: (group name, rank, shm peers, tcp peers).
fn transports(log: &str) -> Vec<(String, usize, Vec<usize>, Vec<usize>)> {
    let list = |s: &str| -> Vec<usize> {
        s.trim_matches(|c| c == '[' || c == ']')
            .split(',')
            .filter(|x| !x.trim().is_empty())
            .map(|x| x.trim().parse().unwrap())
            .collect()
    };
    log.lines()
        .filter_map(|l| {
            let rest = &l[l.find("group ")? + 6..];
            let (name, rest) = rest.split_once(": rank ")?;
            let (rank, rest) = rest.split_once(" reaches shm ")?;
            let (shm, tcp) = rest.split_once(" tcp ")?;
            Some((name.to_string(), rank.parse().ok()?, list(shm), list(tcp)))
        })
        .collect()
}

/// Host of a world rank: 2 ranks per host.
fn host(rank: usize) -> usize {
    rank / 2
}

/// Asserts that every connection of every logged group is shared memory within a host and
/// TCP across, and returns the names of the groups seen.
fn assert_shm_inside_tcp_across(log: &str) -> Vec<String> {
    let seen = transports(log);
    assert!(!seen.is_empty(), "no transport lines logged:\n{log}");
    for (name, rank, shm, tcp) in &seen {
        assert!(
            shm.iter().all(|&p| host(p) == host(*rank)),
            "{name}: rank {rank} uses shared memory to another host: {shm:?}"
        );
        assert!(
            tcp.iter().all(|&p| host(p) != host(*rank)),
            "{name}: rank {rank} uses TCP inside its host: {tcp:?}"
        );
    }
    seen.into_iter().map(|s| s.0).collect()
}

#[test]
fn two_hosts_train_like_one_process() {
    let Some(hosts) = hosts_or_skip() else {
        return;
    };
    let d = tmp("multihost");
    let single = d.join("single");
    ok(&xtrain(
        &[
            &["train", "--quiet", "--out", single.to_str().unwrap()][..],
            &FAST_RUN,
            &SMALL,
            &["--set", "train.grad_accum=4"],
        ]
        .concat(),
    ));
    let want = losses(&single);

    // dp 4 over two hosts: the world (and dp) group spans both.
    let log = launch_two_hosts(&hosts, &d.join("dp4"), &["--nproc", "4"]);
    let groups = assert_shm_inside_tcp_across(&log);
    let world = transports(&log)
        .into_iter()
        .filter(|t| t.0 == "world[0,1,2,3]")
        .collect::<Vec<_>>();
    assert_eq!(world.len(), 4, "{groups:?}");
    for (_, rank, shm, tcp) in world {
        assert_eq!(shm.len(), 1, "rank {rank}");
        assert_eq!(tcp.len(), 2, "rank {rank}");
    }
    close(&losses(&d.join("dp4")), &want, "dp4 over two hosts");

    // tp 2 inside each host (ranks 0,1 and 2,3), dp 2 across the hosts.
    let log = launch_two_hosts(
        &hosts,
        &d.join("tp2dp2"),
        &["--nproc", "4", "--tp", "2", "--set", "train.grad_accum=2"],
    );
    let groups = assert_shm_inside_tcp_across(&log);
    for g in ["tp[0,1]", "tp[2,3]", "dpxcp[0,2]", "dpxcp[1,3]"] {
        assert!(groups.iter().any(|n| n == g), "no group {g} in {groups:?}");
    }
    close(
        &losses(&d.join("tp2dp2")),
        &want,
        "tp2 in hosts x dp2 across",
    );
    drop(hosts);
    let _ = std::fs::remove_dir_all(&d);
}

/// `srun`'s variables alone start a job: two processes with Slurm's rank, task and node
/// variables (as `srun -N1 -n2` sets them) train data parallel with the single process's
/// losses; the store's host comes from the first node of `SLURM_JOB_NODELIST`.
#[test]
fn srun_variables_start_a_job() {
    let d = tmp("srun");
    let single = d.join("single");
    let args = |out: &Path, extra: &[&'static str]| -> Vec<String> {
        [
            &["train", "--quiet", "--out", out.to_str().unwrap()][..],
            &FAST_RUN,
            &SMALL,
            extra,
        ]
        .concat()
        .into_iter()
        .map(String::from)
        .collect()
    };
    let a = args(&single, &["--set", "train.grad_accum=2"]);
    ok(&xtrain(&a.iter().map(String::as_str).collect::<Vec<_>>()));
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
        .to_string();
    let run = d.join("srun");
    let ranks: Vec<_> = (0..2)
        .map(|r| {
            Command::new(env!("CARGO_BIN_EXE_xtrain"))
                .args(args(&run, &["--nproc", "2"]))
                .env_remove("RANK")
                .env_remove("WORLD_SIZE")
                .env("SLURM_PROCID", r.to_string())
                .env("SLURM_LOCALID", r.to_string())
                .env("SLURM_NTASKS", "2")
                .env("SLURM_NODEID", "0")
                .env("SLURM_STEP_TASKS_PER_NODE", "2")
                .env("SLURM_JOB_NODELIST", "localhost")
                .env("SLURM_JOB_ID", "4242")
                .env("SLURM_STEP_ID", "0")
                .env("MASTER_PORT", &port)
                .env("XTRAIN_COMM_TIMEOUT", "120")
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    for child in ranks {
        ok(&child.wait_with_output().unwrap());
    }
    close(
        &losses(&run),
        &losses(&single),
        "dp2 under srun's variables",
    );
    let _ = std::fs::remove_dir_all(&d);
}
