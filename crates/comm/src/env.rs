//! Launch environment: which rank this process is, how many there are, and where the
//! rendezvous store lives, read from the variables a launcher sets.
//!
//! Three launchers are understood, checked in this order (the most specific first):
//! 1. torchrun-style variables, also set by `xtrain launch`: `RANK`, `WORLD_SIZE`,
//!    `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`;
//! 2. Open MPI's `mpirun`: `OMPI_COMM_WORLD_{RANK,SIZE,LOCAL_RANK,LOCAL_SIZE}`;
//! 3. Slurm's `srun`: `SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_LOCALID`, the tasks per node
//!    (`SLURM_STEP_TASKS_PER_NODE`, `SLURM_TASKS_PER_NODE` or `SLURM_NTASKS_PER_NODE`, in
//!    Slurm's compressed `2(x3),1` form, indexed by `SLURM_NODEID`), and the master host
//!    from the first node of `SLURM_STEP_NODELIST` / `SLURM_JOB_NODELIST`.
//!
//! (Open MPI comes before Slurm because `mpirun` inside an `sbatch` script inherits the
//! batch step's `SLURM_PROCID=0` on every rank.) `MASTER_ADDR` / `MASTER_PORT` override
//! the derived rendezvous address under every launcher.
//!
//! xtrain's own variables: [`JOB_ID_VAR`] (the job's name: it namespaces store keys, and
//! links presenting another are refused), [`TOKEN_VAR`] (the job's secret, which every store
//! and link connection proves: see [`crate::auth`]), [`THREADS_VAR`] (the per-rank thread
//! budget) and [`RESTART_VAR`] (which restart of the group this is).
//!
//! ## Where the store listens, and who may join it
//! - A one-host job (every rank on this host: the local world size is the world size) hosts
//!   the store on loopback (`127.0.0.1:MASTER_PORT`, whatever `MASTER_ADDR` says), so no
//!   other host can reach it. A token is optional there: without one, any process of this
//!   host can join (`xtrain launch` always sets one).
//! - A job spanning hosts hosts it on `MASTER_ADDR` (the address it names on rank 0's host;
//!   all interfaces when it is a host name that resolves to a loopback address there, as
//!   Debian's `127.0.1.1` host entry does), or on [`STORE_BIND_VAR`] when set. Unless that
//!   address is a loopback one, the job needs a token: without [`TOKEN_VAR`] it is refused
//!   with a message saying how to set one, unless [`ALLOW_NO_TOKEN_VAR`]`=1`.
//!
//! Parsing takes a lookup function, so tests pass a map instead of the process env.
//! [`init_from_env`] turns the environment into a connected world communicator.
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use crate::communicator::{CommBackend, Communicator, Options};
use crate::error::CommError;
use crate::store::TcpStore;

pub use crate::auth::{ALLOW_NO_TOKEN_VAR, TOKEN_VAR};

/// Job id / token shared by all ranks of one job (set by `xtrain launch`).
pub const JOB_ID_VAR: &str = "XTRAIN_JOB_ID";
/// Threads this rank may use (cores / ranks per host, at least 1).
pub const THREADS_VAR: &str = "XTRAIN_THREADS";
/// How many times the launcher has restarted the group (0 on the first run).
pub const RESTART_VAR: &str = "XTRAIN_RESTART_COUNT";
/// Address rank 0 hosts the store on in a job spanning hosts (default: `MASTER_ADDR`).
pub const STORE_BIND_VAR: &str = "XTRAIN_STORE_BIND";
/// `MASTER_PORT` used under Open MPI when none is set (torch's default port).
pub const DEFAULT_MASTER_PORT: u16 = 29500;

/// Which launcher's variables the environment was read from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Launcher {
    /// torchrun-style variables (`xtrain launch` sets these).
    Torchrun,
    OpenMpi,
    Slurm,
}

impl std::fmt::Display for Launcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Launcher::Torchrun => "torchrun-style",
            Launcher::OpenMpi => "Open MPI",
            Launcher::Slurm => "Slurm",
        })
    }
}

/// Where this process sits in the job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaunchEnv {
    pub rank: usize,
    pub world_size: usize,
    /// Rank among the processes on this host.
    pub local_rank: usize,
    /// Processes on this host.
    pub local_world_size: usize,
    /// Host of the rendezvous store (rank 0's host).
    pub master_addr: String,
    pub master_port: u16,
    /// Token identical on all ranks of the job and different between jobs.
    pub job_id: String,
    /// Per-rank thread budget, when the launcher set one.
    pub threads: Option<usize>,
    /// Restart generation (0 unless the launcher restarted the group).
    pub restart_count: u32,
    pub launcher: Launcher,
}

/// A launch environment that cannot be used.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum EnvError {
    #[error(
        "no launch environment: set RANK and WORLD_SIZE (or start through `xtrain launch`), \
         or run under Open MPI (OMPI_COMM_WORLD_RANK) or Slurm (SLURM_PROCID)"
    )]
    NoLauncher,
    #[error("{launcher} launch environment: {var} is not set")]
    Missing { launcher: Launcher, var: String },
    #[error("{var}={value:?} is malformed: {reason}")]
    Malformed {
        var: String,
        value: String,
        reason: String,
    },
    #[error("inconsistent launch environment: {0}")]
    Inconsistent(String),
    #[error(
        "the rendezvous store of a job spanning hosts ({0}) is reachable from other hosts, so \
         the job needs a secret: set {TOKEN_VAR} to the same random string on every rank \
         (e.g. `export {TOKEN_VAR}=$(openssl rand -hex 32)` before starting the job), or \
         {ALLOW_NO_TOKEN_VAR}=1 to let anyone who can reach it join"
    )]
    NoToken(String),
}

/// Where the rendezvous store lives: what rank 0 binds, and what every rank connects to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StorePlan {
    /// Host rank 0 binds (an IP address or a host name of this host).
    pub bind_host: String,
    /// Host every rank connects to.
    pub connect_host: String,
    pub port: u16,
}

impl StorePlan {
    /// `host:port` the ranks connect to.
    pub fn connect_addr(&self) -> String {
        match self.connect_host.parse::<std::net::Ipv6Addr>() {
            Ok(_) => format!("[{}]:{}", self.connect_host, self.port),
            Err(_) => format!("{}:{}", self.connect_host, self.port),
        }
    }
}

impl LaunchEnv {
    /// Reads the process environment.
    pub fn from_env() -> Result<Self, EnvError> {
        Self::from_lookup(|k| std::env::var(k).ok())
    }

    /// Reads a map of variables (for tests and for launchers preparing a child's env).
    pub fn from_map(vars: &HashMap<String, String>) -> Result<Self, EnvError> {
        Self::from_lookup(|k| vars.get(k).cloned())
    }

    /// `host:port` of the rendezvous store.
    pub fn store_addr(&self) -> String {
        format!("{}:{}", self.master_addr, self.master_port)
    }

    /// Whether this rank hosts the rendezvous store (rank 0 does).
    pub fn hosts_store(&self) -> bool {
        self.rank == 0
    }

    /// Whether every rank of the job runs on this host.
    pub fn single_host(&self) -> bool {
        self.local_world_size == self.world_size
    }

    /// Where the store lives and whether the job may run without a token (see the module
    /// doc); `get` reads [`STORE_BIND_VAR`] and [`ALLOW_NO_TOKEN_VAR`].
    pub fn store_plan(
        &self,
        has_token: bool,
        get: impl Fn(&str) -> Option<String>,
    ) -> Result<StorePlan, EnvError> {
        let get = |k: &str| {
            get(k)
                .map(|v| v.trim().to_string())
                .filter(|v| !v.is_empty())
        };
        if self.single_host() {
            return Ok(StorePlan {
                bind_host: "127.0.0.1".into(),
                connect_host: "127.0.0.1".into(),
                port: self.master_port,
            });
        }
        let bind_host = match get(STORE_BIND_VAR) {
            Some(b) => b,
            None => bind_host_for(&self.master_addr),
        };
        let loopback_only = bind_host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback());
        let allowed = matches!(
            get(ALLOW_NO_TOKEN_VAR).as_deref(),
            Some("1" | "true" | "yes" | "on")
        );
        if !has_token && !loopback_only && !allowed {
            return Err(EnvError::NoToken(format!(
                "MASTER_ADDR={}, listening on {bind_host}",
                self.master_addr
            )));
        }
        Ok(StorePlan {
            bind_host,
            connect_host: self.master_addr.clone(),
            port: self.master_port,
        })
    }

    /// Reads the variables through `get` (unset and empty are the same).
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<Self, EnvError> {
        let get = |k: &str| get(k).filter(|v| !v.trim().is_empty());
        let has = |k: &str| get(k).is_some();
        let launcher = if has("RANK") || has("WORLD_SIZE") {
            Launcher::Torchrun
        } else if has("OMPI_COMM_WORLD_RANK") {
            Launcher::OpenMpi
        } else if has("SLURM_PROCID") {
            Launcher::Slurm
        } else {
            return Err(EnvError::NoLauncher);
        };
        let v = Vars {
            get: &get,
            launcher,
        };
        let (rank, world_size, local_rank, local_world_size) = match launcher {
            Launcher::Torchrun => {
                let (rank, world) = (v.usize("RANK")?, v.usize("WORLD_SIZE")?);
                // Both local variables absent: a hand-set single-host job.
                let (local_rank, local_size) = if !v.has("LOCAL_RANK") && !v.has("LOCAL_WORLD_SIZE")
                {
                    (rank, world)
                } else {
                    (v.usize("LOCAL_RANK")?, v.usize("LOCAL_WORLD_SIZE")?)
                };
                (rank, world, local_rank, local_size)
            }
            Launcher::OpenMpi => (
                v.usize("OMPI_COMM_WORLD_RANK")?,
                v.usize("OMPI_COMM_WORLD_SIZE")?,
                v.usize("OMPI_COMM_WORLD_LOCAL_RANK")?,
                v.usize("OMPI_COMM_WORLD_LOCAL_SIZE")?,
            ),
            Launcher::Slurm => {
                let world = match v.has("SLURM_NTASKS") {
                    true => v.usize("SLURM_NTASKS")?,
                    false => v.usize("SLURM_NPROCS")?,
                };
                (
                    v.usize("SLURM_PROCID")?,
                    world,
                    v.usize("SLURM_LOCALID")?,
                    v.slurm_local_size()?,
                )
            }
        };

        let master_addr = match (v.raw("MASTER_ADDR"), launcher) {
            (Some(a), _) => a.trim().to_string(),
            (None, Launcher::Slurm) => v.slurm_master_host()?,
            // mpirun on one host needs no address.
            (None, Launcher::OpenMpi) if local_world_size == world_size => "127.0.0.1".into(),
            (None, _) => return Err(v.missing("MASTER_ADDR")),
        };
        let master_port = match (v.has("MASTER_PORT"), launcher) {
            (true, _) => v.port("MASTER_PORT")?,
            // A port every rank of the job derives alike (Lightning's convention).
            (false, Launcher::Slurm) => 15000 + (v.u64("SLURM_JOB_ID")? % 10000) as u16,
            (false, Launcher::OpenMpi) => DEFAULT_MASTER_PORT,
            (false, Launcher::Torchrun) => return Err(v.missing("MASTER_PORT")),
        };
        let job_id = match v.raw(JOB_ID_VAR) {
            Some(id) => id,
            None => match launcher {
                Launcher::Slurm if v.has("SLURM_JOB_ID") => format!(
                    "slurm-{}.{}",
                    v.raw("SLURM_JOB_ID").unwrap_or_default(),
                    v.raw("SLURM_STEP_ID").unwrap_or_default()
                ),
                Launcher::OpenMpi if v.has("PMIX_NAMESPACE") => {
                    v.raw("PMIX_NAMESPACE").unwrap_or_default()
                }
                // Every rank agrees on the rendezvous address, so it names the job.
                _ => format!("{master_addr}:{master_port}"),
            },
        };
        let threads = match v.has(THREADS_VAR) {
            true => match v.usize(THREADS_VAR)? {
                0 => return Err(v.malformed(THREADS_VAR, "must be at least 1")),
                t => Some(t),
            },
            false => None,
        };
        let restart_count = match v.has(RESTART_VAR) {
            true => v.usize(RESTART_VAR)? as u32,
            false => 0,
        };

        let env = LaunchEnv {
            rank,
            world_size,
            local_rank,
            local_world_size,
            master_addr,
            master_port,
            job_id,
            threads,
            restart_count,
            launcher,
        };
        env.validate()?;
        Ok(env)
    }

    fn validate(&self) -> Result<(), EnvError> {
        let bad = |m: String| Err(EnvError::Inconsistent(m));
        if self.world_size == 0 {
            return bad("world size is 0".into());
        }
        if self.rank >= self.world_size {
            return bad(format!(
                "rank {} is not below world size {}",
                self.rank, self.world_size
            ));
        }
        if self.local_world_size == 0 || self.local_world_size > self.world_size {
            return bad(format!(
                "local world size {} must be between 1 and the world size {}",
                self.local_world_size, self.world_size
            ));
        }
        if self.local_rank >= self.local_world_size {
            return bad(format!(
                "local rank {} is not below local world size {}",
                self.local_rank, self.local_world_size
            ));
        }
        if self.master_addr.is_empty() {
            return bad("empty master address".into());
        }
        Ok(())
    }
}

/// Builds the world communicator of a launched job: reads [`LaunchEnv`] and the
/// `XTRAIN_*` options ([`Options::from_env`], the job token among them); rank 0 hosts the TCP
/// rendezvous store where [`LaunchEnv::store_plan`] says and every rank connects to it
/// (retrying until the communication timeout, since rank 0 may start late) and proves the
/// token. The host identity that decides shared memory vs TCP is [`host_identity`]. On a job
/// spanning several hosts, unless
/// `XTRAIN_TCP_ADDR` says otherwise, each rank listens on the address of the interface
/// that routes to the master, so peers on other hosts can reach it.
pub fn init_from_env() -> crate::Result<(Communicator, LaunchEnv)> {
    init_with(Options::from_env()?)
}

/// [`init_from_env`] with explicit options (e.g. a transport chosen on a command line).
pub fn init_with(mut options: Options) -> crate::Result<(Communicator, LaunchEnv)> {
    let env =
        LaunchEnv::from_env().map_err(|e| CommError::invalid("init_from_env", e.to_string()))?;
    // The launcher's job id names the job unless the options set one explicitly.
    if std::env::var_os(JOB_ID_VAR).is_none() {
        options.job_id = env.job_id.clone();
    }
    if options.backend == CommBackend::Mpi {
        return init_mpi(options, env);
    }
    if env.local_world_size < env.world_size && std::env::var_os("XTRAIN_TCP_ADDR").is_none() {
        if let Some(ip) = route_to(&env.master_addr, env.master_port) {
            options.tcp_addr = ip;
        }
    }
    let plan = env
        .store_plan(!options.token.is_none(), |k| std::env::var(k).ok())
        .map_err(|e| CommError::invalid("init_from_env", e.to_string()))?;
    if options.token.is_none() && env.hosts_store() {
        tracing::info!(
            "no {TOKEN_VAR}: the store at {}:{} admits any process that can reach it",
            plan.bind_host,
            plan.port
        );
    }
    let timeout = options.timeout.max(Duration::from_secs(1));
    let store = if env.hosts_store() {
        TcpStore::host(
            (plan.bind_host.as_str(), plan.port),
            &options.token,
            timeout,
        )?
    } else {
        TcpStore::connect(&plan.connect_addr(), &options.token, timeout)?
    };
    let comm = Communicator::init(
        Arc::new(store),
        env.rank,
        env.world_size,
        &host_identity(),
        options,
    )?;
    Ok((comm, env))
}

/// Ends the communication library at the end of a successful run: `MPI_Finalize` when the MPI
/// backend started MPI in this process, nothing otherwise. A failed rank must not call it
/// (its peers may be blocked in a collective; `mpirun` stops the job when a rank fails).
pub fn finalize() {
    if let Some(library) = crate::external::library() {
        (library.finalize)();
    }
}

/// The MPI library's version line when this build has the MPI backend.
pub fn mpi_library_version() -> Option<String> {
    crate::external::library().map(|l| (l.version)())
}

/// The MPI backend's world; its ranks must be the launcher's.
fn init_mpi(options: Options, env: LaunchEnv) -> crate::Result<(Communicator, LaunchEnv)> {
    let comm = Communicator::init_mpi(options)?;
    if (comm.rank(), comm.size()) != (env.rank, env.world_size) {
        return Err(CommError::invalid(
            "init_from_env",
            format!(
                "MPI says rank {} of {}, the {} variables rank {} of {}: start the job with \
                 mpirun (or srun) directly",
                comm.rank(),
                comm.size(),
                env.launcher,
                env.rank,
                env.world_size
            ),
        ));
    }
    Ok((comm, env))
}

/// The identity ranks compare to pick shared memory (equal) or TCP (different): the host
/// name, the kernel's boot id and the network namespace, e.g.
/// `node7/boot 0522e508/net 4026531833`. The host name alone is not enough: containers
/// and network namespaces on one machine (or cloned machines) can share a name while being
/// separate hosts on the network, each with its own addresses and, usually, its own
/// `/dev/shm`; seeing the same `/dev/shm` does not make two processes one host either (all
/// network namespaces of a machine share it unless a container mounts its own).
pub fn host_identity() -> String {
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_default();
    let boot = boot.trim().split('-').next().unwrap_or("");
    // "net:[4026531833]": the inode of this process's network namespace.
    let net = std::fs::read_link("/proc/self/ns/net")
        .map(|p| {
            p.to_string_lossy()
                .trim_start_matches("net:[")
                .trim_end_matches(']')
                .to_string()
        })
        .unwrap_or_default();
    format!("{}/boot {boot}/net {net}", hostname())
}

/// This machine's host name.
pub fn hostname() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: gethostname writes at most `buf.len()` bytes into the buffer we own.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    if rc != 0 {
        return "localhost".to_string();
    }
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    String::from_utf8_lossy(&buf[..end]).into_owned()
}

/// What rank 0 binds for master address `master`: the address itself, unless it is a host
/// name that resolves to a loopback address here (then all interfaces, so other hosts reach
/// it; the token guards it).
fn bind_host_for(master: &str) -> String {
    if master.parse::<std::net::IpAddr>().is_ok() {
        return master.to_string();
    }
    let resolved: Vec<std::net::IpAddr> = std::net::ToSocketAddrs::to_socket_addrs(&(master, 0))
        .map(|a| a.map(|a| a.ip()).collect())
        .unwrap_or_default();
    match resolved.first() {
        Some(ip) if ip.is_loopback() => match ip {
            std::net::IpAddr::V4(_) => "0.0.0.0".into(),
            std::net::IpAddr::V6(_) => "::".into(),
        },
        _ => master.to_string(),
    }
}

/// The local address of the interface that routes to `host` (a UDP "connect" sends nothing).
fn route_to(host: &str, port: u16) -> Option<String> {
    let sock = std::net::UdpSocket::bind("0.0.0.0:0").ok()?;
    sock.connect((host, port)).ok()?;
    let ip = sock.local_addr().ok()?.ip();
    (!ip.is_unspecified()).then(|| ip.to_string())
}

/// Variable access with typed parsing and errors that name the variable.
struct Vars<'a> {
    get: &'a dyn Fn(&str) -> Option<String>,
    launcher: Launcher,
}

impl Vars<'_> {
    fn raw(&self, k: &str) -> Option<String> {
        (self.get)(k)
    }
    fn has(&self, k: &str) -> bool {
        self.raw(k).is_some()
    }
    fn missing(&self, k: &str) -> EnvError {
        EnvError::Missing {
            launcher: self.launcher,
            var: k.to_string(),
        }
    }
    fn malformed(&self, k: &str, reason: &str) -> EnvError {
        EnvError::Malformed {
            var: k.to_string(),
            value: self.raw(k).unwrap_or_default(),
            reason: reason.to_string(),
        }
    }
    fn required(&self, k: &str) -> Result<String, EnvError> {
        self.raw(k).ok_or_else(|| self.missing(k))
    }
    fn u64(&self, k: &str) -> Result<u64, EnvError> {
        self.required(k)?
            .trim()
            .parse()
            .map_err(|_| self.malformed(k, "expected a non-negative integer"))
    }
    fn usize(&self, k: &str) -> Result<usize, EnvError> {
        Ok(self.u64(k)? as usize)
    }
    fn port(&self, k: &str) -> Result<u16, EnvError> {
        match self.required(k)?.trim().parse::<u16>() {
            Ok(p) if p > 0 => Ok(p),
            _ => Err(self.malformed(k, "expected a TCP port between 1 and 65535")),
        }
    }

    /// This node's task count from Slurm's compressed tasks-per-node list.
    fn slurm_local_size(&self) -> Result<usize, EnvError> {
        let var = [
            "SLURM_STEP_TASKS_PER_NODE",
            "SLURM_TASKS_PER_NODE",
            "SLURM_NTASKS_PER_NODE",
        ]
        .into_iter()
        .find(|k| self.has(k))
        .ok_or_else(|| self.missing("SLURM_TASKS_PER_NODE"))?;
        let counts = parse_tasks_per_node(&self.required(var)?)
            .map_err(|reason| self.malformed(var, &reason))?;
        let node = if self.has("SLURM_NODEID") {
            self.usize("SLURM_NODEID")?
        } else {
            0
        };
        // SLURM_NTASKS_PER_NODE is a single value that applies to every node.
        let idx = if counts.len() == 1 { 0 } else { node };
        counts.get(idx).copied().ok_or_else(|| {
            EnvError::Inconsistent(format!(
                "SLURM_NODEID {node} but {var} lists only {} node(s)",
                counts.len()
            ))
        })
    }

    fn slurm_master_host(&self) -> Result<String, EnvError> {
        let var = [
            "SLURM_STEP_NODELIST",
            "SLURM_JOB_NODELIST",
            "SLURM_NODELIST",
        ]
        .into_iter()
        .find(|k| self.has(k))
        .ok_or_else(|| self.missing("MASTER_ADDR (or SLURM_STEP_NODELIST)"))?;
        first_host(&self.required(var)?).map_err(|reason| self.malformed(var, &reason))
    }
}

/// Expands Slurm's tasks-per-node form: `"2(x3),1"` → `[2, 2, 2, 1]`.
pub fn parse_tasks_per_node(s: &str) -> Result<Vec<usize>, String> {
    let mut out = Vec::new();
    for part in s.split(',').map(str::trim) {
        let (count, repeat) = match part.split_once("(x") {
            Some((c, r)) => {
                let r = r
                    .strip_suffix(')')
                    .ok_or_else(|| format!("unclosed repeat in {part:?}"))?;
                (
                    c,
                    r.parse::<usize>()
                        .map_err(|_| format!("bad repeat in {part:?}"))?,
                )
            }
            None => (part, 1),
        };
        let count: usize = count
            .parse()
            .map_err(|_| format!("bad task count {count:?}"))?;
        if count == 0 || repeat == 0 || repeat > 1 << 20 {
            return Err(format!("bad entry {part:?}"));
        }
        out.extend(std::iter::repeat_n(count, repeat));
    }
    Ok(out)
}

/// The first host of a Slurm hostlist: `"gpu[003-004,9],cpu1"` → `"gpu003"`;
/// `"rack[1-2]-n[07-08]"` → `"rack1-n07"` (each bracket contributes its first number,
/// zero padding kept).
pub fn first_host(list: &str) -> Result<String, String> {
    let mut host = String::new();
    let mut chars = list.trim().chars();
    while let Some(c) = chars.next() {
        match c {
            ',' => break,
            '[' => {
                let group: String = chars.by_ref().take_while(|&c| c != ']').collect();
                let first = group.split(',').next().unwrap_or("");
                let first = first.split('-').next().unwrap_or("").trim();
                if first.is_empty() || !first.chars().all(|c| c.is_ascii_digit()) {
                    return Err(format!("bad range [{group}]"));
                }
                host.push_str(first);
            }
            ']' => return Err("unbalanced ']'".into()),
            c => host.push(c),
        }
    }
    if host.is_empty() {
        return Err("empty host list".into());
    }
    Ok(host)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(vars: &[(&str, &str)]) -> Result<LaunchEnv, EnvError> {
        let map = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        LaunchEnv::from_map(&map)
    }

    const TORCHRUN: &[(&str, &str)] = &[
        ("RANK", "5"),
        ("WORLD_SIZE", "8"),
        ("LOCAL_RANK", "1"),
        ("LOCAL_WORLD_SIZE", "4"),
        ("MASTER_ADDR", "node0"),
        ("MASTER_PORT", "29501"),
        ("XTRAIN_JOB_ID", "job-42"),
        ("XTRAIN_THREADS", "3"),
        ("XTRAIN_RESTART_COUNT", "2"),
    ];

    #[test]
    fn torchrun_variables() {
        let env = parse(TORCHRUN).unwrap();
        assert_eq!(
            env,
            LaunchEnv {
                rank: 5,
                world_size: 8,
                local_rank: 1,
                local_world_size: 4,
                master_addr: "node0".into(),
                master_port: 29501,
                job_id: "job-42".into(),
                threads: Some(3),
                restart_count: 2,
                launcher: Launcher::Torchrun,
            }
        );
        assert_eq!(env.store_addr(), "node0:29501");
        assert!(!env.hosts_store());
    }

    #[test]
    fn torchrun_missing_and_malformed_values_are_named() {
        let without = |k: &str| -> Vec<(&str, &str)> {
            TORCHRUN.iter().copied().filter(|(n, _)| *n != k).collect()
        };
        let with = |k: &'static str, v: &'static str| -> Vec<(&str, &str)> {
            let mut vars = without(k);
            vars.push((k, v));
            vars
        };
        let err = parse(&without("MASTER_PORT")).unwrap_err();
        assert_eq!(
            err.to_string(),
            "torchrun-style launch environment: MASTER_PORT is not set"
        );
        let err = parse(&without("WORLD_SIZE")).unwrap_err();
        assert!(err.to_string().contains("WORLD_SIZE is not set"), "{err}");
        let err = parse(&without("LOCAL_WORLD_SIZE")).unwrap_err();
        assert!(
            err.to_string().contains("LOCAL_WORLD_SIZE is not set"),
            "{err}"
        );
        let err = parse(&with("RANK", "two")).unwrap_err();
        assert_eq!(
            err.to_string(),
            "RANK=\"two\" is malformed: expected a non-negative integer"
        );
        let err = parse(&with("MASTER_PORT", "70000")).unwrap_err();
        assert!(err.to_string().contains("MASTER_PORT=\"70000\""), "{err}");
        let err = parse(&with("XTRAIN_THREADS", "0")).unwrap_err();
        assert!(err.to_string().contains("at least 1"), "{err}");
        let err = parse(&with("RANK", "8")).unwrap_err();
        assert!(
            err.to_string().contains("rank 8 is not below world size 8"),
            "{err}"
        );
        let err = parse(&with("LOCAL_RANK", "4")).unwrap_err();
        assert!(err.to_string().contains("local rank 4"), "{err}");
        assert_eq!(parse(&[]).unwrap_err(), EnvError::NoLauncher);
    }

    #[test]
    fn torchrun_minimal_set_defaults() {
        let env = parse(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "127.0.0.1"),
            ("MASTER_PORT", "1234"),
        ])
        .unwrap();
        assert_eq!((env.local_rank, env.local_world_size), (0, 2));
        assert_eq!(env.job_id, "127.0.0.1:1234");
        assert_eq!((env.threads, env.restart_count), (None, 0));
        assert!(env.hosts_store());
    }

    #[test]
    fn slurm_variables() {
        let env = parse(&[
            ("SLURM_PROCID", "5"),
            ("SLURM_NTASKS", "7"),
            ("SLURM_LOCALID", "1"),
            ("SLURM_NODEID", "2"),
            ("SLURM_STEP_TASKS_PER_NODE", "2(x3),1"),
            ("SLURM_STEP_NODELIST", "gpu[003-005,9]"),
            ("SLURM_JOB_ID", "123456"),
            ("SLURM_STEP_ID", "0"),
        ])
        .unwrap();
        assert_eq!(env.launcher, Launcher::Slurm);
        assert_eq!(
            (
                env.rank,
                env.world_size,
                env.local_rank,
                env.local_world_size
            ),
            (5, 7, 1, 2)
        );
        assert_eq!(env.master_addr, "gpu003");
        assert_eq!(env.master_port, 15000 + 3456);
        assert_eq!(env.job_id, "slurm-123456.0");

        // MASTER_ADDR/MASTER_PORT override; SLURM_NTASKS_PER_NODE applies to every node.
        let env = parse(&[
            ("SLURM_PROCID", "3"),
            ("SLURM_NTASKS", "4"),
            ("SLURM_LOCALID", "1"),
            ("SLURM_NODEID", "1"),
            ("SLURM_NTASKS_PER_NODE", "2"),
            ("MASTER_ADDR", "10.1.2.3"),
            ("MASTER_PORT", "4000"),
        ])
        .unwrap();
        assert_eq!(
            (
                env.local_world_size,
                env.master_addr.as_str(),
                env.master_port
            ),
            (2, "10.1.2.3", 4000)
        );

        let err = parse(&[
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "2"),
            ("SLURM_LOCALID", "0"),
            ("SLURM_TASKS_PER_NODE", "2"),
            ("SLURM_JOB_ID", "1"),
        ])
        .unwrap_err();
        assert!(
            err.to_string()
                .contains("MASTER_ADDR (or SLURM_STEP_NODELIST) is not set"),
            "{err}"
        );
        let err = parse(&[
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "2"),
            ("SLURM_LOCALID", "0"),
            ("SLURM_TASKS_PER_NODE", "2(x"),
        ])
        .unwrap_err();
        assert!(
            err.to_string()
                .contains("SLURM_TASKS_PER_NODE=\"2(x\" is malformed"),
            "{err}"
        );
    }

    #[test]
    fn open_mpi_variables() {
        let vars = [
            ("OMPI_COMM_WORLD_RANK", "3"),
            ("OMPI_COMM_WORLD_SIZE", "4"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "3"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "4"),
            ("PMIX_NAMESPACE", "prterun-host-77@1"),
            // A batch step's Slurm variables must not win over mpirun's.
            ("SLURM_PROCID", "0"),
        ];
        let env = parse(&vars).unwrap();
        assert_eq!(env.launcher, Launcher::OpenMpi);
        assert_eq!(
            (
                env.rank,
                env.world_size,
                env.local_rank,
                env.local_world_size
            ),
            (3, 4, 3, 4)
        );
        assert_eq!(env.store_addr(), "127.0.0.1:29500");
        assert_eq!(env.job_id, "prterun-host-77@1");

        // Several hosts: the store's host must be given.
        let err = parse(&[
            ("OMPI_COMM_WORLD_RANK", "3"),
            ("OMPI_COMM_WORLD_SIZE", "4"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
        ])
        .unwrap_err();
        assert_eq!(
            err.to_string(),
            "Open MPI launch environment: MASTER_ADDR is not set"
        );
        let err = parse(&[
            ("OMPI_COMM_WORLD_RANK", "0"),
            ("OMPI_COMM_WORLD_SIZE", "-1"),
        ])
        .unwrap_err();
        assert!(
            err.to_string().contains("OMPI_COMM_WORLD_SIZE=\"-1\""),
            "{err}"
        );
    }

    #[test]
    fn the_store_stays_on_loopback_for_one_host_and_needs_a_token_across_hosts() {
        let no_vars = |_: &str| None;
        // One host: loopback whatever MASTER_ADDR says, token or not.
        let one = parse(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "10.1.2.3"),
            ("MASTER_PORT", "1234"),
        ])
        .unwrap();
        let plan = one.store_plan(false, no_vars).unwrap();
        assert_eq!(
            (plan.bind_host.as_str(), plan.connect_addr()),
            ("127.0.0.1", "127.0.0.1:1234".to_string())
        );
        // Several hosts: MASTER_ADDR, and without a token a clear refusal.
        let many = parse(TORCHRUN).unwrap();
        let err = many.store_plan(false, no_vars).unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains("XTRAIN_JOB_TOKEN") && msg.contains("MASTER_ADDR=node0"),
            "{msg}"
        );
        assert!(msg.contains("XTRAIN_ALLOW_NO_TOKEN=1"), "{msg}");
        let mut ip = many.clone();
        ip.master_addr = "10.1.2.3".into();
        let plan = ip.store_plan(true, no_vars).unwrap();
        assert_eq!(
            (plan.bind_host.as_str(), plan.connect_addr()),
            ("10.1.2.3", "10.1.2.3:29501".to_string())
        );
        ip.master_addr = "fd00::7".into();
        assert_eq!(
            ip.store_plan(true, no_vars).unwrap().connect_addr(),
            "[fd00::7]:29501"
        );
        // The opt-out, an explicit bind address, and a loopback store need no token.
        let vars = |pairs: &'static [(&'static str, &'static str)]| {
            move |k: &str| {
                pairs
                    .iter()
                    .find(|(n, _)| *n == k)
                    .map(|(_, v)| v.to_string())
            }
        };
        assert!(many
            .store_plan(false, vars(&[("XTRAIN_ALLOW_NO_TOKEN", "1")]))
            .is_ok());
        let plan = many
            .store_plan(true, vars(&[("XTRAIN_STORE_BIND", "0.0.0.0")]))
            .unwrap();
        assert_eq!(
            (plan.bind_host.as_str(), plan.connect_host.as_str()),
            ("0.0.0.0", "node0")
        );
        let mut lo = many.clone();
        lo.master_addr = "127.0.0.1".into();
        assert_eq!(
            lo.store_plan(false, no_vars).unwrap().bind_host,
            "127.0.0.1"
        );
        // A host name that resolves to loopback here (Debian's 127.0.1.1 entry): all interfaces.
        assert_eq!(bind_host_for("localhost"), "0.0.0.0");
        assert_eq!(bind_host_for("192.168.0.9"), "192.168.0.9");
    }

    #[test]
    fn slurm_list_forms() {
        assert_eq!(parse_tasks_per_node("4").unwrap(), vec![4]);
        assert_eq!(parse_tasks_per_node("2(x3),1").unwrap(), vec![2, 2, 2, 1]);
        assert!(parse_tasks_per_node("0").is_err());
        assert!(parse_tasks_per_node("a").is_err());
        assert_eq!(first_host("node7").unwrap(), "node7");
        assert_eq!(first_host("gpu[003-004,9],cpu1").unwrap(), "gpu003");
        assert_eq!(first_host("rack[1-2]-n[07-08]").unwrap(), "rack1-n07");
        assert!(first_host("n[x-y]").is_err());
        assert!(first_host("").is_err());
    }

    #[test]
    fn slurm_job_nodelist_of_an_sbatch_step() {
        // `srun` in an `sbatch -N3 --ntasks-per-node=2` job: the last node's second task.
        let env = parse(&[
            ("SLURM_PROCID", "5"),
            ("SLURM_NTASKS", "6"),
            ("SLURM_LOCALID", "1"),
            ("SLURM_NODEID", "2"),
            ("SLURM_TASKS_PER_NODE", "2(x3)"),
            ("SLURM_JOB_NODELIST", "node[01-03]"),
            ("SLURM_JOB_ID", "77"),
        ])
        .unwrap();
        assert_eq!(
            (
                env.rank,
                env.world_size,
                env.local_rank,
                env.local_world_size
            ),
            (5, 6, 1, 2)
        );
        assert_eq!(env.store_addr(), "node01:15077");
        assert!(!env.hosts_store());
        let err = parse(&[
            ("SLURM_PROCID", "5"),
            ("SLURM_NTASKS", "6"),
            ("SLURM_LOCALID", "1"),
            ("SLURM_NODEID", "3"),
            ("SLURM_TASKS_PER_NODE", "2(x3)"),
            ("SLURM_JOB_NODELIST", "node[01-03]"),
            ("SLURM_JOB_ID", "77"),
        ])
        .unwrap_err();
        assert!(err.to_string().contains("SLURM_NODEID 3"), "{err}");
    }

    #[test]
    fn host_identity_names_the_host_boot_and_network_namespace() {
        let id = host_identity();
        assert!(id.starts_with(&format!("{}/boot ", hostname())), "{id}");
        assert!(id.contains("/net "), "{id}");
        assert_eq!(id, host_identity());
    }
}
