//! `xtrain launch`: starts the worker processes of one host with the launch variables
//! (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`,
//! `XTRAIN_JOB_ID`, `XTRAIN_JOB_TOKEN`, `XTRAIN_THREADS`, `XTRAIN_RESTART_COUNT`), prefixes their output
//! lines with the rank, and supervises them: when one fails, the others are stopped
//! (SIGTERM, then SIGKILL after a grace period) and the group is restarted up to
//! `--max-restarts` times, else the launch fails naming the rank and its exit status.
//!
//! The job token (the secret every store and link connection proves): the launcher's own
//! `XTRAIN_JOB_TOKEN` when set, else on one host a fresh random one per start of the group.
//! It travels only in the workers' environment, never on a command line or in a log.
//!
//! Multi-node: run the same command on every host with `--nnodes`, `--node-rank`,
//! `--master-addr` and `--master-port`, and the same `XTRAIN_JOB_TOKEN` exported on each
//! (hosts cannot agree on a random one without it; the workers refuse to start a store other
//! hosts can reach without a token); the hosts meet at the rendezvous store that rank 0
//! hosts. Each host's launcher restarts its own workers; a failure on one host makes the
//! collectives of the others fail, so they restart too.
//!
//! Each worker runs in its own process group, so stopping it also stops whatever it
//! spawned, and (on Linux) it is killed if the launcher itself dies.
use comm::auth::{JobToken, TOKEN_VAR};
use comm::env::{JOB_ID_VAR, RESTART_VAR, THREADS_VAR};
use std::ffi::OsString;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// Command-line options of `xtrain launch`.
#[derive(clap::Args, Debug)]
#[command(after_help = "\
Failures: a worker that dies stops the group at once. A stopped or hung worker is found by \
the others: XTRAIN_HEARTBEAT_INTERVAL (seconds, default 5, 0 off) — a peer silent for 3 \
heartbeats counts as stopped; XTRAIN_COMM_TIMEOUT (seconds, default 300) bounds every wait. \
Either way the error names the rank, the operation and group it never entered, and what the \
others wait in.

Restarts that continue: xtrain launch --max-restarts R -- xtrain train --resume auto --out DIR ... \
resumes DIR's newest checkpoint after each restart (the same losses as an uninterrupted run; \
metrics.jsonl keeps one row per step); relaunched on fewer processes it reshards.")]
pub struct Args {
    /// Worker processes to start on this host.
    #[arg(long)]
    pub nproc_per_node: usize,
    /// Hosts in the job (run the same command on each).
    #[arg(long, default_value_t = 1)]
    pub nnodes: usize,
    /// This host's index among the `--nnodes` hosts.
    #[arg(long, default_value_t = 0)]
    pub node_rank: usize,
    /// Host of rank 0, where the rendezvous store listens.
    #[arg(long, default_value = "127.0.0.1")]
    pub master_addr: String,
    /// Port of the rendezvous store (default: a free port on one host, 29500 on several).
    #[arg(long)]
    pub master_port: Option<u16>,
    /// Restart the whole group up to this many times after a failure (with `xtrain train
    /// --resume auto` the run continues from its newest checkpoint).
    #[arg(long, default_value_t = 0)]
    pub max_restarts: u32,
    /// Seconds between SIGTERM and SIGKILL when stopping workers.
    #[arg(long, default_value_t = 5.0)]
    pub grace_period: f64,
    /// Job token shared by all hosts (default: derived from the master address and port).
    #[arg(long)]
    pub job_id: Option<String>,
    /// The worker command and its arguments.
    #[arg(last = true, required = true, num_args = 1..)]
    pub command: Vec<OsString>,
}

/// Why a launch failed.
#[derive(Debug, thiserror::Error)]
pub enum LaunchError {
    #[error("invalid launch: {0}")]
    Invalid(String),
    #[error("cannot start rank {rank} ({program}): {source}")]
    Spawn {
        rank: usize,
        program: String,
        source: std::io::Error,
    },
    #[error("rank {rank} (pid {pid}) {status}{restarts}; the other workers were stopped")]
    WorkerFailed {
        rank: usize,
        pid: u32,
        status: String,
        restarts: String,
    },
    #[error("interrupted by {0}; the workers were stopped")]
    Interrupted(String),
}

/// Everything needed to run one host's group of workers.
#[derive(Debug, Clone)]
pub struct GroupSpec {
    pub nproc_per_node: usize,
    pub nnodes: usize,
    pub node_rank: usize,
    pub master_addr: String,
    pub master_port: Option<u16>,
    pub max_restarts: u32,
    pub grace: Duration,
    pub job_id: Option<String>,
    pub command: Vec<OsString>,
    /// Extra variables for every worker.
    pub extra_env: Vec<(String, String)>,
    /// Prefix workers' stdout lines with `[rank R]` (stderr lines always are).
    pub prefix_stdout: bool,
}

impl GroupSpec {
    pub fn from_args(a: Args) -> Result<Self, LaunchError> {
        let grace = Duration::try_from_secs_f64(a.grace_period)
            .ok()
            .filter(|g| *g <= Duration::from_secs(3600))
            .ok_or_else(|| {
                LaunchError::Invalid(format!(
                    "--grace-period {} must be between 0 and 3600 seconds",
                    a.grace_period
                ))
            })?;
        Ok(GroupSpec {
            nproc_per_node: a.nproc_per_node,
            nnodes: a.nnodes,
            node_rank: a.node_rank,
            master_addr: a.master_addr,
            master_port: a.master_port,
            max_restarts: a.max_restarts,
            grace,
            job_id: a.job_id,
            command: a.command,
            extra_env: Vec::new(),
            prefix_stdout: true,
        })
    }

    fn validate(&self) -> Result<(), LaunchError> {
        let bad = |m: &str| Err(LaunchError::Invalid(m.to_string()));
        if self.nproc_per_node == 0 {
            return bad("--nproc-per-node must be at least 1");
        }
        if self.nnodes == 0 {
            return bad("--nnodes must be at least 1");
        }
        if self.node_rank >= self.nnodes {
            return Err(LaunchError::Invalid(format!(
                "--node-rank {} must be below --nnodes {}",
                self.node_rank, self.nnodes
            )));
        }
        if self.command.is_empty() {
            return bad("no worker command given (put it after `--`)");
        }
        if self.master_port == Some(0) {
            return bad("--master-port must not be 0");
        }
        user_token()?;
        Ok(())
    }
}

pub fn run(args: Args) -> anyhow::Result<()> {
    run_group(&GroupSpec::from_args(args)?)?;
    Ok(())
}

/// Runs the group (restarting it after failures as allowed) until every worker succeeds.
pub fn run_group(spec: &GroupSpec) -> Result<(), LaunchError> {
    spec.validate()?;
    install_signal_handlers();
    let mut attempt = 0;
    loop {
        match run_attempt(spec, attempt) {
            Ok(()) => return Ok(()),
            Err(Failure::Interrupted(sig)) => return Err(LaunchError::Interrupted(sig)),
            Err(Failure::Spawn(e)) => return Err(e),
            Err(Failure::Worker { rank, pid, status }) => {
                if attempt < spec.max_restarts {
                    attempt += 1;
                    eprintln!(
                        "xtrain launch: rank {rank} (pid {pid}) {status}; restarting the group \
                         (restart {attempt} of {})",
                        spec.max_restarts
                    );
                    continue;
                }
                let restarts = match attempt {
                    0 => String::new(),
                    n => format!(" after {n} restart(s)"),
                };
                return Err(LaunchError::WorkerFailed {
                    rank,
                    pid,
                    status,
                    restarts,
                });
            }
        }
    }
}

enum Failure {
    Worker {
        rank: usize,
        pid: u32,
        status: String,
    },
    Interrupted(String),
    Spawn(LaunchError),
}

/// One live worker.
struct Worker {
    rank: usize,
    child: Child,
    done: Option<ExitStatus>,
}

fn run_attempt(spec: &GroupSpec, attempt: u32) -> Result<(), Failure> {
    let world = spec.nnodes * spec.nproc_per_node;
    let port = match spec.master_port {
        Some(p) => p,
        None if spec.nnodes == 1 => free_port(&spec.master_addr).map_err(Failure::Spawn)?,
        None => comm::env::DEFAULT_MASTER_PORT,
    };
    let base_id = spec.job_id.clone().unwrap_or_else(|| match spec.nnodes {
        // One host: unique per launch (a fresh port is picked per launch anyway).
        1 => format!("xtrain-{}-{}", std::process::id(), port),
        // Several hosts must agree without talking: derive it from the rendezvous address.
        _ => format!("xtrain-{}:{port}", spec.master_addr),
    });
    // A fresh id (and on one host a fresh secret) per restart, so leftovers of the previous
    // generation are refused.
    let job_id = format!("{base_id}-r{attempt}");
    let token = match user_token().map_err(Failure::Spawn)? {
        Some(t) => Some(t),
        None if spec.nnodes == 1 => {
            Some(JobToken::generate_secret().map_err(|e| Failure::Spawn(LaunchError::Invalid(e)))?)
        }
        // The workers decide: fine for a store on loopback, else a clear refusal.
        None => None,
    };
    let cores = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    let threads = (cores / spec.nproc_per_node).max(1).to_string();

    let (line_done_tx, line_done_rx) = mpsc::channel::<()>();
    let mut pumps = 0;
    let mut workers: Vec<Worker> = Vec::with_capacity(spec.nproc_per_node);
    for local in 0..spec.nproc_per_node {
        let rank = spec.node_rank * spec.nproc_per_node + local;
        let mut cmd = Command::new(&spec.command[0]);
        cmd.args(&spec.command[1..])
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", world.to_string())
            .env("LOCAL_RANK", local.to_string())
            .env("LOCAL_WORLD_SIZE", spec.nproc_per_node.to_string())
            .env("GROUP_RANK", spec.node_rank.to_string())
            .env("MASTER_ADDR", &spec.master_addr)
            .env("MASTER_PORT", port.to_string())
            .env(JOB_ID_VAR, &job_id)
            .env(THREADS_VAR, &threads)
            .env(RESTART_VAR, attempt.to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(worker_stderr(rank))
            .process_group(0);
        // Thread pools the workers may use: cap them unless the user already did.
        for var in ["RAYON_NUM_THREADS", "OMP_NUM_THREADS"] {
            if std::env::var_os(var).is_none() {
                cmd.env(var, &threads);
            }
        }
        for (k, v) in &spec.extra_env {
            cmd.env(k, v);
        }
        if let Some(t) = &token {
            cmd.env(TOKEN_VAR, t);
        }
        #[cfg(target_os = "linux")]
        // SAFETY: prctl is async-signal-safe; it only asks the kernel to SIGKILL this child
        // when the launcher (its parent) dies, so no orphaned worker outlives a killed launch.
        unsafe {
            cmd.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
        let mut child = match cmd.spawn() {
            Ok(c) => c,
            Err(source) => {
                stop_all(&mut workers, spec.grace);
                let program = spec.command[0].to_string_lossy().into_owned();
                return Err(Failure::Spawn(LaunchError::Spawn {
                    rank,
                    program,
                    source,
                }));
            }
        };
        let prefix = format!("[rank {rank}] ");
        if let Some(out) = child.stdout.take() {
            let p = if spec.prefix_stdout {
                prefix.clone()
            } else {
                String::new()
            };
            spawn_pump(out, p, false, line_done_tx.clone());
            pumps += 1;
        }
        if let Some(err) = child.stderr.take() {
            spawn_pump(err, prefix, true, line_done_tx.clone());
            pumps += 1;
        }
        workers.push(Worker {
            rank,
            child,
            done: None,
        });
    }
    drop(line_done_tx);

    let result = supervise(&mut workers, spec.grace);
    // Whatever a worker left behind in its process group goes too (it would keep the
    // output pipes open).
    for w in &workers {
        signal_group(w, libc::SIGKILL);
    }
    // Let the output pumps drain what the workers wrote last (bounded: a stray process
    // outside the group could hold a pipe open).
    let deadline = Instant::now() + Duration::from_secs(2);
    for _ in 0..pumps {
        let left = deadline.saturating_duration_since(Instant::now());
        if line_done_rx.recv_timeout(left).is_err() {
            break;
        }
    }
    result
}

/// Waits for the workers; on the first failure (or a signal to the launcher) stops the rest.
fn supervise(workers: &mut [Worker], grace: Duration) -> Result<(), Failure> {
    loop {
        let mut failed = None;
        for w in workers.iter_mut().filter(|w| w.done.is_none()) {
            if let Ok(Some(status)) = w.child.try_wait() {
                w.done = Some(status);
                if !status.success() && failed.is_none() {
                    failed = Some((w.rank, w.child.id(), describe(status)));
                }
            }
        }
        if let Some((rank, pid, status)) = failed {
            stop_all(workers, grace);
            return Err(Failure::Worker { rank, pid, status });
        }
        if workers.iter().all(|w| w.done.is_some()) {
            return Ok(());
        }
        let sig = SIGNAL.load(Ordering::SeqCst);
        if sig != 0 {
            stop_all(workers, grace);
            return Err(Failure::Interrupted(signal_name(sig)));
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// SIGTERM to every live worker's group, SIGKILL to those still alive after `grace`.
fn stop_all(workers: &mut [Worker], grace: Duration) {
    for w in workers.iter().filter(|w| w.done.is_none()) {
        signal_group(w, libc::SIGTERM);
    }
    let deadline = Instant::now() + grace;
    loop {
        for w in workers.iter_mut().filter(|w| w.done.is_none()) {
            if let Ok(Some(s)) = w.child.try_wait() {
                w.done = Some(s);
            }
        }
        if workers.iter().all(|w| w.done.is_some()) {
            return;
        }
        if Instant::now() >= deadline {
            break;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    for w in workers.iter_mut().filter(|w| w.done.is_none()) {
        signal_group(w, libc::SIGKILL);
        w.done = w.child.wait().ok();
    }
}

fn signal_group(w: &Worker, sig: i32) {
    // The worker leads its own process group (process_group(0)), whose id is its pid.
    // SAFETY: kill(2) with a negative pid signals that group; it has no memory effects.
    unsafe {
        libc::kill(-(w.child.id() as i32), sig);
    }
}

/// Rank 0 draws the run's progress bar on stderr, which needs a terminal: when ours is one,
/// rank 0 writes its stderr to it directly (unprefixed); every other stream is piped through
/// [`spawn_pump`] and prefixed with its rank.
fn worker_stderr(rank: usize) -> Stdio {
    use std::io::IsTerminal;
    if rank == 0 && std::io::stderr().is_terminal() {
        Stdio::inherit()
    } else {
        Stdio::piped()
    }
}

/// Copies a worker's output to ours line by line, each line prefixed, each written whole.
fn spawn_pump(
    src: impl Read + Send + 'static,
    prefix: String,
    stderr: bool,
    done: mpsc::Sender<()>,
) {
    std::thread::spawn(move || {
        let mut reader = BufReader::new(src);
        let mut line = Vec::new();
        loop {
            line.clear();
            match reader.read_until(b'\n', &mut line) {
                Ok(0) | Err(_) => break,
                Ok(_) => {}
            }
            if line.last() != Some(&b'\n') {
                line.push(b'\n');
            }
            let mut out = Vec::with_capacity(prefix.len() + line.len());
            out.extend_from_slice(prefix.as_bytes());
            out.extend_from_slice(&line);
            let _ = if stderr {
                std::io::stderr().lock().write_all(&out)
            } else {
                let mut o = std::io::stdout().lock();
                o.write_all(&out).and_then(|_| o.flush())
            };
        }
        let _ = done.send(());
    });
}

/// "exited with status 3" / "was killed by signal 9 (SIGKILL)".
pub fn describe(status: ExitStatus) -> String {
    match (status.code(), status.signal()) {
        (Some(c), _) => format!("exited with status {c}"),
        (None, Some(s)) => format!("was killed by signal {s} ({})", signal_name(s)),
        _ => format!("ended with {status}"),
    }
}

fn signal_name(sig: i32) -> String {
    let name = match sig {
        libc::SIGHUP => "SIGHUP",
        libc::SIGINT => "SIGINT",
        libc::SIGQUIT => "SIGQUIT",
        libc::SIGILL => "SIGILL",
        libc::SIGABRT => "SIGABRT",
        libc::SIGBUS => "SIGBUS",
        libc::SIGFPE => "SIGFPE",
        libc::SIGKILL => "SIGKILL",
        libc::SIGSEGV => "SIGSEGV",
        libc::SIGPIPE => "SIGPIPE",
        libc::SIGTERM => "SIGTERM",
        _ => return format!("signal {sig}"),
    };
    name.to_string()
}

/// The token in the launcher's own `XTRAIN_JOB_TOKEN`, checked (None when unset).
fn user_token() -> Result<Option<String>, LaunchError> {
    match std::env::var(TOKEN_VAR) {
        Ok(v) if !v.trim().is_empty() => {
            JobToken::new(&v).map_err(LaunchError::Invalid)?;
            Ok(Some(v.trim().to_string()))
        }
        _ => Ok(None),
    }
}

/// Picks a port that is free right now on `addr` (the store binds it moments later).
fn free_port(addr: &str) -> Result<u16, LaunchError> {
    let listener = std::net::TcpListener::bind((addr, 0))
        .or_else(|_| std::net::TcpListener::bind(("0.0.0.0", 0)))
        .map_err(|e| LaunchError::Invalid(format!("cannot find a free port: {e}")))?;
    Ok(listener
        .local_addr()
        .map_err(|e| LaunchError::Invalid(e.to_string()))?
        .port())
}

/// The last terminating signal the launcher received (0: none).
static SIGNAL: AtomicI32 = AtomicI32::new(0);

extern "C" fn on_signal(sig: i32) {
    SIGNAL.store(sig, Ordering::SeqCst);
}

/// Workers live in their own process groups, so a Ctrl-C reaches only the launcher:
/// record it and let the supervisor stop the workers cleanly.
fn install_signal_handlers() {
    for sig in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
        // SAFETY: the handler only stores to an atomic, which is async-signal-safe.
        unsafe {
            libc::signal(sig, on_signal as extern "C" fn(i32) as libc::sighandler_t);
        }
    }
}
