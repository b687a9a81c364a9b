//! End-to-end tests of `xtrain launch` with real worker processes (`sh -c` scripts):
//! launch variables and output prefixes, fail-stop of the group, restarts.
use std::collections::{BTreeMap, HashSet};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

fn xtrain() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_xtrain"));
    c.env_remove("RUST_BACKTRACE")
        .env_remove("RUST_LIB_BACKTRACE")
        .env_remove("XTRAIN_JOB_TOKEN");
    c
}

/// Runs `xtrain launch <flags> -- sh -c <script>`.
fn launch(flags: &[&str], script: &str) -> (Output, Duration) {
    let start = Instant::now();
    let out = xtrain()
        .arg("launch")
        .args(flags)
        .args(["--", "sh", "-c", script])
        .output()
        .expect("run xtrain");
    (out, start.elapsed())
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

#[test]
fn variables_and_rank_prefixes_for_1_to_4_processes() {
    let script = "echo \"RANK=$RANK WORLD_SIZE=$WORLD_SIZE LOCAL_RANK=$LOCAL_RANK \
                  LOCAL_WORLD_SIZE=$LOCAL_WORLD_SIZE MASTER_ADDR=$MASTER_ADDR \
                  MASTER_PORT=$MASTER_PORT XTRAIN_JOB_ID=$XTRAIN_JOB_ID \
                  XTRAIN_THREADS=$XTRAIN_THREADS XTRAIN_RESTART_COUNT=$XTRAIN_RESTART_COUNT\"; \
                  echo \"to stderr $RANK\" >&2";
    for n in 1..=4usize {
        let (out, _) = launch(&["--nproc-per-node", &n.to_string()], script);
        assert!(out.status.success(), "n={n}: {}", text(&out.stderr));
        let stdout = text(&out.stdout);
        let mut seen = HashSet::new();
        let mut shared = HashSet::new();
        for line in stdout.lines() {
            let (prefix, rest) = line.split_once("] ").expect("prefixed line");
            let prefix_rank: usize = prefix.strip_prefix("[rank ").unwrap().parse().unwrap();
            let vars: BTreeMap<&str, &str> = rest
                .split(' ')
                .map(|kv| kv.split_once('=').unwrap())
                .collect();
            assert_eq!(vars["RANK"], prefix_rank.to_string(), "{line}");
            assert_eq!(vars["LOCAL_RANK"], prefix_rank.to_string(), "{line}");
            assert_eq!(vars["WORLD_SIZE"], n.to_string());
            assert_eq!(vars["LOCAL_WORLD_SIZE"], n.to_string());
            assert_eq!(vars["MASTER_ADDR"], "127.0.0.1");
            assert!(vars["MASTER_PORT"].parse::<u16>().unwrap() > 0);
            assert!(vars["XTRAIN_THREADS"].parse::<usize>().unwrap() >= 1);
            assert_eq!(vars["XTRAIN_RESTART_COUNT"], "0");
            assert!(!vars["XTRAIN_JOB_ID"].is_empty());
            assert!(seen.insert(prefix_rank), "rank {prefix_rank} printed twice");
            shared.insert((
                vars["MASTER_PORT"].to_string(),
                vars["XTRAIN_JOB_ID"].to_string(),
            ));
        }
        assert_eq!(seen, (0..n).collect(), "n={n}: {stdout}");
        assert_eq!(
            shared.len(),
            1,
            "port and job id must be shared: {shared:?}"
        );
        let stderr = text(&out.stderr);
        for r in 0..n {
            assert!(
                stderr.contains(&format!("[rank {r}] to stderr {r}")),
                "{stderr}"
            );
        }
    }
}

#[test]
fn multi_node_flags_give_global_ranks() {
    let (out, _) = launch(
        &[
            "--nproc-per-node",
            "2",
            "--nnodes",
            "3",
            "--node-rank",
            "1",
            "--master-port",
            "29999",
        ],
        "echo $RANK/$WORLD_SIZE/$LOCAL_RANK/$MASTER_PORT",
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    let mut lines: Vec<String> = text(&out.stdout).lines().map(str::to_string).collect();
    lines.sort();
    assert_eq!(lines, ["[rank 2] 2/6/0/29999", "[rank 3] 3/6/1/29999"]);
}

#[test]
fn workers_get_a_fresh_job_token_per_launch_or_the_users() {
    let tokens = |env: Option<&str>| -> (Output, Vec<String>) {
        let mut c = xtrain();
        if let Some(t) = env {
            c.env("XTRAIN_JOB_TOKEN", t);
        }
        let out = c
            .args(["launch", "--nproc-per-node", "2", "--", "sh", "-c"])
            .arg("echo \"$XTRAIN_JOB_TOKEN\"")
            .output()
            .unwrap();
        let lines = text(&out.stdout)
            .lines()
            .map(|l| l.split_once("] ").unwrap().1.to_string())
            .collect();
        (out, lines)
    };
    let (out, a) = tokens(None);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(a.len(), 2);
    assert_eq!(a[0], a[1], "every rank of a job gets the same token");
    assert_eq!(a[0].len(), 64, "{a:?}");
    assert!(a[0].chars().all(|c| c.is_ascii_hexdigit()), "{a:?}");
    // The launcher itself prints nothing of it.
    assert!(!text(&out.stderr).contains(&a[0]));
    let (_, b) = tokens(None);
    assert_ne!(a[0], b[0], "a fresh token per launch");
    let (_, mine) = tokens(Some("my-own-job-secret-42"));
    assert_eq!(mine, ["my-own-job-secret-42"; 2]);
    let (out, _) = tokens(Some("short"));
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("too short"),
        "{}",
        text(&out.stderr)
    );
}

fn alive(pid: u32) -> bool {
    std::path::Path::new(&format!("/proc/{pid}")).exists()
}

#[test]
fn a_failing_worker_stops_the_others_and_is_named() {
    let dir = std::env::temp_dir().join(format!("xtrain-launch-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let script = format!(
        "echo $$ > {dir}/pid.$RANK; if [ $RANK = 2 ]; then sleep 0.3; exit 7; fi; exec sleep 30",
        dir = dir.display()
    );
    let (out, took) = launch(&["--nproc-per-node", "4", "--grace-period", "2"], &script);
    let stderr = text(&out.stderr);
    assert!(!out.status.success());
    assert!(stderr.contains("rank 2 (pid "), "{stderr}");
    assert!(stderr.contains("exited with status 7"), "{stderr}");
    // The sleepers die on SIGTERM: well before both their 30 s and the grace period.
    assert!(took < Duration::from_secs(5), "took {took:?}");
    for r in [0, 1, 3] {
        let pid: u32 = std::fs::read_to_string(dir.join(format!("pid.{r}")))
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        assert!(!alive(pid), "rank {r} (pid {pid}) still running");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_worker_killed_by_a_signal_is_reported_and_term_ignorers_are_killed() {
    // Rank 1 kills itself; rank 0 ignores SIGTERM, so only SIGKILL after the grace ends it.
    let script = "if [ $RANK = 1 ]; then sleep 0.3; kill -9 $$; fi; trap '' TERM; sleep 30";
    let (out, took) = launch(&["--nproc-per-node", "2", "--grace-period", "0.5"], script);
    let stderr = text(&out.stderr);
    assert!(!out.status.success());
    assert!(stderr.contains("rank 1 (pid "), "{stderr}");
    assert!(stderr.contains("killed by signal 9 (SIGKILL)"), "{stderr}");
    assert!(
        took >= Duration::from_millis(700),
        "grace period not honoured: {took:?}"
    );
    assert!(took < Duration::from_secs(5), "took {took:?}");
}

#[test]
fn max_restarts_restarts_the_whole_group() {
    // Succeeds on the third run (restart count 2); every rank runs every time.
    let script = "echo \"run $XTRAIN_RESTART_COUNT\"; [ $XTRAIN_RESTART_COUNT -ge 2 ] || exit 1";
    let (out, _) = launch(&["--nproc-per-node", "2", "--max-restarts", "3"], script);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    // Earlier runs may be cut short (a rank's failure stops the other before it prints);
    // the last run completes on both ranks.
    assert!(
        stdout.contains("[rank 0] run 2") && stdout.contains("[rank 1] run 2"),
        "{stdout}"
    );
    let stderr = text(&out.stderr);
    assert!(
        stderr.contains("restarting the group (restart 1 of 3)"),
        "{stderr}"
    );
    assert!(
        stderr.contains("restarting the group (restart 2 of 3)"),
        "{stderr}"
    );
    assert!(!stderr.contains("restart 3 of 3"), "{stderr}");

    // Out of restarts: the failure is reported with the restart count.
    let (out, _) = launch(&["--nproc-per-node", "2", "--max-restarts", "1"], "exit 4");
    let stderr = text(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains("exited with status 4 after 1 restart(s)"),
        "{stderr}"
    );
}

#[test]
fn bad_launch_arguments_are_clear_errors() {
    let (out, _) = launch(&["--nproc-per-node", "0"], "true");
    assert!(!out.status.success());
    assert!(text(&out.stderr).contains("--nproc-per-node must be at least 1"));
    let (out, _) = launch(
        &["--nproc-per-node", "1", "--nnodes", "2", "--node-rank", "2"],
        "true",
    );
    assert!(text(&out.stderr).contains("--node-rank 2 must be below --nnodes 2"));
    let (out, _) = launch(&["--nproc-per-node", "1", "--grace-period", "inf"], "true");
    assert!(text(&out.stderr).contains("--grace-period inf must be between 0 and 3600"));
    let out = xtrain()
        .args([
            "launch",
            "--nproc-per-node",
            "1",
            "--",
            "/nonexistent/program",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(text(&out.stderr).contains("cannot start rank 0 (/nonexistent/program)"));
}
