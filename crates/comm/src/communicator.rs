//! [`Communicator`]: this rank's entry point. Built from any [`Store`] plus the rank's
//! identity (rank, world size, host), it connects the world group and creates sub-groups.
//!
//! Group set-up (collective over the group's members only):
//! 1. the group gets a key from its member list and how many groups with those members this
//!    rank created before (all members create groups in the same order), so store keys are
//!    `xtrain/<job>/<key>/...`;
//! 2. each pair of members picks shared memory (same host, or forced) or TCP;
//! 3. shared memory: the lowest member on each host creates the segment file (under
//!    `/dev/shm`), publishes its path, waits until all local members mapped it, and unlinks it;
//! 4. TCP: every member with TCP peers listens on an ephemeral port and publishes its address;
//!    the higher rank of each pair connects, presents the job id, group key and ranks, and
//!    both sides prove the job token.
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::auth::JobToken;
use crate::collectives::AllReduceAlgo;
use crate::engine::{Counters, Engine, EngineConfig, GroupDesc};
use crate::error::{CommError, Result};
use crate::group::ProcessGroup;
use crate::monitor::Monitor;
use crate::store::Store;
use crate::transport::cma;
use crate::transport::shm::{Segment, ShmLink};
use crate::transport::tcp::{self, Hello, TcpLink};
use crate::transport::{Link, TransportKind};

/// Communication settings. `Options::default()` ignores the environment; [`Options::from_env`]
/// applies `XTRAIN_TRANSPORT` (shm|tcp|auto), `XTRAIN_COMM_TIMEOUT` (seconds),
/// `XTRAIN_HEARTBEAT_INTERVAL` (seconds, 0: off),
/// `XTRAIN_ALLREDUCE_ALGO` (ring|tree|hd|auto), `XTRAIN_JOB_ID`, `XTRAIN_JOB_TOKEN`,
/// `XTRAIN_TCP_ADDR` (address this
/// rank listens on and advertises), `XTRAIN_SPIN_US`, `XTRAIN_SHM_SINGLE_COPY` (0|1) and
/// `XTRAIN_SHM_SINGLE_COPY_MIN` (bytes) and `XTRAIN_BACKEND` (own|mpi; nccl: own here).
#[derive(Clone, Debug)]
pub struct Options {
    /// Which library runs the collectives (see [`CommBackend`]).
    pub backend: CommBackend,
    /// Shared token: connections presenting another job id are refused; store keys and
    /// shared-memory names are namespaced by it.
    pub job_id: String,
    /// The job's secret: every TCP link proves it in its handshake ([`crate::auth`]).
    pub token: JobToken,
    pub transport: TransportKind,
    /// Limit of every blocking wait.
    pub timeout: Duration,
    /// Period of the heartbeat (zero: none). A peer whose heartbeat stays still for
    /// [`HEARTBEAT_MISSES`](crate::monitor::HEARTBEAT_MISSES) periods counts as stopped, and
    /// waits on it fail then instead of at `timeout` ([`crate::monitor`]).
    pub heartbeat_interval: Duration,
    /// Default all-reduce algorithm of groups.
    pub algo: AllReduceAlgo,
    /// IP address to listen on and advertise for TCP (port chosen by the OS).
    pub tcp_addr: String,
    /// Bytes of each shared-memory ring (rounded up to 4 KiB).
    pub shm_ring_bytes: usize,
    /// How long an idle wait spins before sleeping.
    pub spin: Duration,
    /// Whether groups whose members all share one host may use single-copy ring steps
    /// (the receiver reads the sender's buffer with `process_vm_readv`). Used only where a probe
    /// at group set-up shows the OS allows it; otherwise the ring path runs, silently.
    pub shm_single_copy: bool,
    /// Ring collectives (ring all-reduce, reduce-scatter, all-gather) over at least this many
    /// bytes use single-copy steps when the group can.
    pub single_copy_min_bytes: usize,
}

/// Default of [`Options::single_copy_min_bytes`]: below it copying through the rings is as
/// fast. Measured, 2 processes, ring all-reduce with the ring pages mapped in advance: 32 KiB
/// 4.6–5.2 µs single-copy against 5.8–7.2 µs, 64 KiB 6.2–6.9 against 9.4–9.7, 256 KiB 15–16
/// against 34–37; 16 KiB 3.9–4.1 against 4.2–4.8 (docs/PERFORMANCE.md).
pub const SINGLE_COPY_MIN_BYTES: usize = 32 << 10;

/// Which library runs a communicator's operations.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CommBackend {
    /// xtrain's own collectives over shared memory and TCP.
    Own,
    /// The system MPI library (`mpirun`'s world); needs the `mpi` cargo feature.
    Mpi,
}

impl std::str::FromStr for CommBackend {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            // `nccl` puts GPU ranks' gradient all-reduces on NCCL (the `parallel` crate); the
            // host collectives stay on the own engine.
            "own" | "nccl" => Ok(CommBackend::Own),
            "mpi" => Ok(CommBackend::Mpi),
            _ => Err(format!(
                "unknown communication backend {s:?} (own, mpi or nccl)"
            )),
        }
    }
}

impl CommBackend {
    /// Lower-case name (`own`, `mpi`).
    pub fn name(self) -> &'static str {
        match self {
            CommBackend::Own => "own",
            CommBackend::Mpi => "mpi",
        }
    }
}

impl Default for Options {
    fn default() -> Self {
        Options {
            backend: CommBackend::Own,
            job_id: "xtrain".to_string(),
            token: JobToken::none(),
            transport: TransportKind::Auto,
            timeout: Duration::from_secs(300),
            heartbeat_interval: crate::monitor::HEARTBEAT_INTERVAL,
            algo: AllReduceAlgo::Auto,
            tcp_addr: "127.0.0.1".to_string(),
            shm_ring_bytes: 1 << 20,
            spin: Duration::from_micros(20),
            shm_single_copy: true,
            single_copy_min_bytes: SINGLE_COPY_MIN_BYTES,
        }
    }
}

impl Options {
    /// Defaults overridden by the `XTRAIN_*` environment variables listed on [`Options`].
    pub fn from_env() -> Result<Self> {
        let mut o = Options::default();
        let var = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
        let bad = |k: &str, e: String| CommError::invalid("Options::from_env", format!("{k}: {e}"));
        if let Some(v) = var("XTRAIN_BACKEND") {
            o.backend = v.parse().map_err(|e| bad("XTRAIN_BACKEND", e))?;
        }
        if let Some(v) = var("XTRAIN_TRANSPORT") {
            o.transport = v.parse().map_err(|e| bad("XTRAIN_TRANSPORT", e))?;
        }
        if let Some(v) = var("XTRAIN_ALLREDUCE_ALGO") {
            o.algo = v.parse().map_err(|e| bad("XTRAIN_ALLREDUCE_ALGO", e))?;
        }
        if let Some(v) = var("XTRAIN_COMM_TIMEOUT") {
            let s: f64 = v
                .parse()
                .map_err(|_| bad("XTRAIN_COMM_TIMEOUT", format!("{v:?} is not seconds")))?;
            o.timeout = Duration::from_secs_f64(s);
        }
        if let Some(v) = var("XTRAIN_HEARTBEAT_INTERVAL") {
            let s = v
                .parse::<f64>()
                .ok()
                .and_then(|s| Duration::try_from_secs_f64(s).ok())
                .ok_or_else(|| {
                    bad(
                        "XTRAIN_HEARTBEAT_INTERVAL",
                        format!("{v:?} is not seconds (0: no heartbeat)"),
                    )
                })?;
            o.heartbeat_interval = s;
        }
        if let Some(v) = var("XTRAIN_SPIN_US") {
            let s: u64 = v
                .parse()
                .map_err(|_| bad("XTRAIN_SPIN_US", format!("{v:?} is not an integer")))?;
            o.spin = Duration::from_micros(s);
        }
        if let Some(v) = var("XTRAIN_SHM_SINGLE_COPY") {
            o.shm_single_copy = match v.to_ascii_lowercase().as_str() {
                "1" | "on" | "true" | "yes" => true,
                "0" | "off" | "false" | "no" => false,
                _ => {
                    return Err(bad(
                        "XTRAIN_SHM_SINGLE_COPY",
                        format!("{v:?} is not 0 or 1"),
                    ))
                }
            };
        }
        if let Some(v) = var("XTRAIN_SHM_SINGLE_COPY_MIN") {
            o.single_copy_min_bytes = v.parse().map_err(|_| {
                bad(
                    "XTRAIN_SHM_SINGLE_COPY_MIN",
                    format!("{v:?} is not a byte count"),
                )
            })?;
        }
        if let Some(v) = var("XTRAIN_JOB_ID") {
            o.job_id = v;
        }
        o.token = JobToken::from_env().map_err(|e| bad(crate::auth::TOKEN_VAR, e))?;
        if let Some(v) = var("XTRAIN_TCP_ADDR") {
            o.tcp_addr = v;
        }
        Ok(o)
    }
}

struct Ctx {
    store: Arc<dyn Store>,
    rank: usize,
    hosts: Vec<String>,
    options: Options,
    /// Groups this rank created so far, per member list (for unique, agreed group keys).
    created: Mutex<HashMap<Vec<usize>, usize>>,
    /// Flight recorder and heartbeat of this rank, shared by all its groups.
    monitor: Arc<Monitor>,
    /// The external library's world when it runs this communicator's groups
    /// (`XTRAIN_BACKEND=mpi`).
    mpi: Option<Arc<dyn crate::external::ExternalWorld>>,
}

impl Drop for Ctx {
    fn drop(&mut self) {
        self.monitor.shutdown();
    }
}

/// This rank's communicator: the world group plus the means to create sub-groups.
/// Dereferences to the world [`ProcessGroup`].
#[derive(Clone)]
pub struct Communicator {
    ctx: Arc<Ctx>,
    world: ProcessGroup,
}

impl std::ops::Deref for Communicator {
    type Target = ProcessGroup;
    fn deref(&self) -> &ProcessGroup {
        &self.world
    }
}

impl Communicator {
    /// Joins the job: publishes this rank's host, learns everyone's, and connects the world.
    /// Every rank of the world must call it with the same store, world size and job id.
    pub fn init(
        store: Arc<dyn Store>,
        rank: usize,
        world_size: usize,
        host: &str,
        options: Options,
    ) -> Result<Self> {
        if world_size == 0 || rank >= world_size {
            return Err(CommError::invalid(
                "Communicator::init",
                format!("rank {rank} of world size {world_size}"),
            ));
        }
        let ns = format!("xtrain/{}", options.job_id);
        store.set(&format!("{ns}/host/{rank}"), host.as_bytes())?;
        let mut hosts = Vec::with_capacity(world_size);
        for r in 0..world_size {
            let h = store.get(&format!("{ns}/host/{r}"), options.timeout)?;
            hosts.push(String::from_utf8_lossy(&h).into_owned());
        }
        let monitor = Monitor::new(
            Arc::clone(&store),
            &options.job_id,
            rank,
            world_size,
            options.heartbeat_interval,
        );
        monitor.start();
        let ctx = Arc::new(Ctx {
            store,
            rank,
            hosts,
            options,
            created: Mutex::new(HashMap::new()),
            monitor,
            mpi: None,
        });
        let world = connect_group(&ctx, "world", &(0..world_size).collect::<Vec<_>>())?;
        Ok(Communicator { ctx, world })
    }

    /// Joins `mpirun`'s world with the MPI backend: ranks and size are `MPI_COMM_WORLD`'s, and
    /// every group's operations run as MPI collectives (`options` other than the job id and
    /// the backend do not apply). Collective over the world. Needs the MPI backend registered
    /// ([`crate::external::register`]: a build with the `mpi` feature).
    pub fn init_mpi(options: Options) -> Result<Self> {
        let library = crate::external::library().ok_or_else(|| {
            CommError::invalid(
                "init_mpi",
                "XTRAIN_BACKEND=mpi, but this build has no MPI backend: build with \
                 `cargo build --release --features mpi` (needs an MPI library, e.g. libopenmpi-dev)",
            )
        })?;
        let world = (library.init)()?;
        let (rank, size) = (world.rank(), world.size());
        let hosts = world.all_hosts(&crate::env::host_identity())?;
        let store: Arc<dyn Store> = Arc::new(crate::store::MemStore::new());
        // No heartbeat: MPI's ranks share no store, and mpirun ends the job when one dies.
        let monitor = Monitor::new(
            Arc::clone(&store),
            &options.job_id,
            rank,
            size,
            Duration::ZERO,
        );
        let ctx = Arc::new(Ctx {
            store,
            monitor,
            rank,
            hosts,
            options: Options {
                backend: CommBackend::Mpi,
                ..options
            },
            created: Mutex::new(HashMap::new()),
            mpi: Some(world),
        });
        let world = connect_group(&ctx, "world", &(0..size).collect::<Vec<_>>())?;
        Ok(Communicator { ctx, world })
    }

    /// A world of one rank: this process alone (an in-memory store, no peers). Single-process
    /// training runs on it, so it takes the same path as every parallel layout.
    pub fn single_process() -> Result<Self> {
        let options = Options {
            job_id: crate::testing::unique_job_id().replacen("test", "single", 1),
            ..Options::default()
        };
        Self::init(
            Arc::new(crate::store::MemStore::new()),
            0,
            1,
            "localhost",
            options,
        )
    }

    /// The world group.
    pub fn world(&self) -> &ProcessGroup {
        &self.world
    }

    /// Options this communicator was built with.
    pub fn options(&self) -> &Options {
        &self.ctx.options
    }

    /// This rank's flight record: its last operations on every group ([`crate::flight`]).
    pub fn flight_record(&self) -> crate::flight::FlightRecord {
        self.ctx.monitor.recorder.snapshot(self.ctx.rank)
    }

    /// Host identity of every world rank.
    pub fn hosts(&self) -> &[String] {
        &self.ctx.hosts
    }

    /// Creates a group over `world_ranks` (in that order: group rank i is `world_ranks[i]`).
    /// Collective over the listed ranks only; this rank must be one of them.
    pub fn new_group(&self, world_ranks: &[usize]) -> Result<ProcessGroup> {
        self.new_named_group("group", world_ranks)
    }

    /// [`new_group`](Self::new_group) with a label used in error messages (e.g. `"dp"`).
    pub fn new_named_group(&self, label: &str, world_ranks: &[usize]) -> Result<ProcessGroup> {
        connect_group(&self.ctx, label, world_ranks)
    }
}

/// FNV-1a, for short stable identifiers derived from strings.
fn fnv(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
        (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
    })
}

/// Store/handshake key of the `k`-th group this rank created over `members`.
fn group_key(members: &[usize], k: usize) -> String {
    let member_str = members
        .iter()
        .map(|r| r.to_string())
        .collect::<Vec<_>>()
        .join(",");
    format!("g{:016x}-{k}", fnv(member_str.as_bytes()))
}

fn shm_dir() -> PathBuf {
    let d = PathBuf::from("/dev/shm");
    if d.is_dir() {
        d
    } else {
        std::env::temp_dir()
    }
}

fn connect_group(ctx: &Arc<Ctx>, label: &str, members: &[usize]) -> Result<ProcessGroup> {
    let op = "new_group";
    let n_world = ctx.hosts.len();
    let mut sorted = members.to_vec();
    sorted.sort_unstable();
    sorted.dedup();
    if members.is_empty() || sorted.len() != members.len() || sorted.iter().any(|&r| r >= n_world) {
        return Err(CommError::invalid(
            op,
            format!("members {members:?} must be distinct world ranks < {n_world}"),
        ));
    }
    let me = members.iter().position(|&r| r == ctx.rank).ok_or_else(|| {
        CommError::invalid(
            op,
            format!("rank {} is not a member of {members:?}", ctx.rank),
        )
    })?;
    let k = {
        let mut created = ctx.created.lock().unwrap_or_else(|e| e.into_inner());
        let c = created.entry(members.to_vec()).or_insert(0);
        *c += 1;
        *c
    };
    let member_str = members
        .iter()
        .map(|r| r.to_string())
        .collect::<Vec<_>>()
        .join(",");
    let key = group_key(members, k);
    let ns = format!("xtrain/{}/{key}", ctx.options.job_id);
    let name = format!("{label}[{member_str}]");
    if let Some(world) = &ctx.mpi {
        // The tag tells apart group creations that could overlap; every member derives the
        // same one from the member list and how many such groups it created before.
        let tag = (fnv(key.as_bytes()) & 0x3fff_ffff) as i32;
        let counters = Arc::new(Counters::default());
        let counter = crate::external::OpCounter(Arc::clone(&counters));
        let group = world.create(members, me, tag, &name, counter)?;
        tracing::info!(target: "comm", "group {name}: rank {} runs on MPI", ctx.rank);
        let desc = Arc::new(GroupDesc {
            name,
            world_ranks: members.to_vec(),
            rank: me,
        });
        return Ok(ProcessGroup::with_backend(
            crate::backend::Backend::External(group),
            desc,
            counters,
            None,
            ctx.options.algo,
        ));
    }
    let o = &ctx.options;
    let deadline = Instant::now() + o.timeout;
    let n = members.len();
    let host_of = |g: usize| &ctx.hosts[members[g]];
    let use_shm = |g: usize| match o.transport {
        TransportKind::Shm => true,
        TransportKind::Tcp => false,
        TransportKind::Auto => host_of(g) == host_of(me),
    };
    if o.transport == TransportKind::Shm {
        if let Some(g) = (0..n).find(|&g| host_of(g) != host_of(me)) {
            return Err(CommError::invalid(
                op,
                format!(
                    "transport forced to shm, but rank {} is on host {:?} and rank {} on {:?}",
                    members[g],
                    host_of(g),
                    ctx.rank,
                    host_of(me)
                ),
            ));
        }
    }
    let mut links: Vec<Option<Link>> = (0..n).map(|_| None).collect();

    // Shared memory among the members on this host.
    let local: Vec<usize> = (0..n).filter(|&g| g == me || use_shm(g)).collect();
    let mut shm = None;
    if local.len() > 1 {
        let li = local.iter().position(|&g| g == me).expect("me is local");
        let cap = o.shm_ring_bytes.max(4096).next_multiple_of(4096);
        let token = fnv(o.job_id.as_bytes());
        let host_key = format!("{ns}/shm/{:016x}", fnv(host_of(me).as_bytes()));
        let seg = if li == 0 {
            static SEQ: AtomicU64 = AtomicU64::new(0);
            let file = format!(
                "xtrain-{}-{}-{}",
                std::process::id(),
                SEQ.fetch_add(1, Ordering::Relaxed),
                fnv(format!("{ns}{:?}", Instant::now()).as_bytes()) % 1_000_000
            );
            let path = shm_dir().join(file);
            let seg = Segment::create(&path, local.len(), cap, token).map_err(|e| {
                CommError::io(format!("{op} {name}: creating {}", path.display()), e)
            })?;
            ctx.store
                .set(&host_key, path.to_string_lossy().as_bytes())?;
            let attached: Vec<String> = (1..local.len())
                .map(|i| format!("{host_key}/attached/{i}"))
                .collect();
            let keys: Vec<&str> = attached.iter().map(|s| s.as_str()).collect();
            let waited = ctx.store.wait(&keys, o.timeout);
            let _ = std::fs::remove_file(&path);
            waited?;
            seg
        } else {
            let path = PathBuf::from(
                String::from_utf8_lossy(&ctx.store.get(&host_key, o.timeout)?).into_owned(),
            );
            let seg = Segment::open(&path, local.len(), cap, token).map_err(|e| {
                CommError::io(format!("{op} {name}: attaching {}", path.display()), e)
            })?;
            ctx.store.set(&format!("{host_key}/attached/{li}"), b"1")?;
            seg
        };
        seg.set_pid(li);
        for (lj, &g) in local.iter().enumerate() {
            if g != me {
                seg.prefault(li, lj);
                links[g] = Some(Link::Shm(ShmLink::new(Arc::clone(&seg), li, lj)));
            }
        }
        shm = Some((seg, li));
    }

    // TCP to everyone else.
    let tcp_peers: Vec<usize> = (0..n).filter(|&g| g != me && !use_shm(g)).collect();
    if !tcp_peers.is_empty() {
        let listener = std::net::TcpListener::bind((o.tcp_addr.as_str(), 0))
            .map_err(|e| CommError::io(format!("{op} {name}: listening on {}", o.tcp_addr), e))?;
        let addr = listener
            .local_addr()
            .map_err(|e| CommError::io("local_addr", e))?;
        ctx.store
            .set(&format!("{ns}/addr/{me}"), addr.to_string().as_bytes())?;
        for &g in tcp_peers.iter().filter(|&&g| g < me) {
            let a = ctx.store.get(&format!("{ns}/addr/{g}"), o.timeout)?;
            let a = String::from_utf8_lossy(&a).into_owned();
            let hello = Hello {
                job: o.job_id.clone(),
                key: key.clone(),
                from: me as u32,
                to: g as u32,
            };
            let s = tcp::connect(&a, &hello, &o.token, deadline).map_err(|e| {
                CommError::Refused(format!(
                    "{op} {name}: rank {} connecting to rank {}: {e}",
                    ctx.rank, members[g]
                ))
            })?;
            links[g] = Some(Link::Tcp(
                TcpLink::new(s).map_err(|e| CommError::io("configuring socket", e))?,
            ));
        }
        let expected: Vec<u32> = tcp_peers
            .iter()
            .filter(|&&g| g > me)
            .map(|&g| g as u32)
            .collect();
        if !expected.is_empty() {
            let me_at = tcp::Expect {
                job: &o.job_id,
                key: &key,
                token: &o.token,
                me: me as u32,
            };
            let got = tcp::accept_all(&listener, &me_at, &expected, deadline).map_err(|e| {
                CommError::Timeout {
                    group: name.clone(),
                    op: format!("{op} ({e})"),
                    ranks: expected.iter().map(|&g| members[g as usize]).collect(),
                    timeout: o.timeout,
                    note: String::new(),
                }
            })?;
            for (g, s) in got {
                links[g as usize] = Some(Link::Tcp(
                    TcpLink::new(s).map_err(|e| CommError::io("configuring socket", e))?,
                ));
            }
        }
    }

    log_transports(&name, ctx.rank, members, &links);
    let desc = Arc::new(GroupDesc {
        name,
        world_ranks: members.to_vec(),
        rank: me,
    });
    let config = EngineConfig {
        timeout: o.timeout,
        spin: o.spin,
    };
    let board = Some((Arc::clone(&ctx.store), format!("{ns}/abort")));
    let single_copy = shm.is_some() && local.len() == n && probe_single_copy(ctx, &ns, me, n)?;
    let mut engine = Engine::new(
        desc,
        links,
        shm,
        config,
        Arc::new(Counters::default()),
        board,
    );
    engine.single_copy = single_copy.then_some(o.single_copy_min_bytes);
    let gid = ctx.monitor.recorder.register(&engine.desc);
    engine.monitor = Some((Arc::clone(&ctx.monitor), gid));
    Ok(ProcessGroup::new(engine, o.algo))
}

/// Logs (at info level, target `comm`) which peers this rank reaches by which transport, e.g.
/// `group dp[0,2]: rank 0 reaches shm [] tcp [2]` (world ranks): what a multi-host run
/// checks to see that shared memory stayed within hosts.
fn log_transports(name: &str, rank: usize, members: &[usize], links: &[Option<Link>]) {
    let peers = |want: TransportKind| -> Vec<usize> {
        let kind = |l: &Link| match l {
            Link::Shm(_) => TransportKind::Shm,
            Link::Tcp(_) => TransportKind::Tcp,
        };
        (0..members.len())
            .filter(|&g| links[g].as_ref().map(kind) == Some(want))
            .map(|g| members[g])
            .collect()
    };
    tracing::info!(
        target: "comm",
        "group {name}: rank {rank} reaches shm {:?} tcp {:?}",
        peers(TransportKind::Shm),
        peers(TransportKind::Tcp)
    );
}

/// Whether the members of a group on one host may use single-copy ring steps: each member
/// publishes its pid and the address of a known word, reads its left ring neighbour's word
/// (the only reads single-copy steps make) and publishes the verdict, or "disabled" when its
/// options forbid single copy; the group uses it only if every verdict is "ok", so all members
/// decide alike even if their options differ. A refusal (Yama `ptrace_scope`, seccomp, other
/// users) is logged once at debug level, not an error.
fn probe_single_copy(ctx: &Ctx, ns: &str, me: usize, n: usize) -> Result<bool> {
    let timeout = ctx.options.timeout;
    let word = &cma::PROBE_WORD as *const u64 as u64;
    let at = format!("{} {word}", std::process::id());
    ctx.store.set(&format!("{ns}/cma/at/{me}"), at.as_bytes())?;
    let left = (me + n - 1) % n;
    let theirs = ctx.store.get(&format!("{ns}/cma/at/{left}"), timeout)?;
    let theirs = String::from_utf8_lossy(&theirs).into_owned();
    let verdict = match theirs.split_once(' ').map(|(p, a)| (p.parse(), a.parse())) {
        _ if !ctx.options.shm_single_copy => Err("disabled by option".to_string()),
        Some((Ok(pid), Ok(addr))) => cma::probe(pid, addr),
        _ => Err(format!("malformed probe address {theirs:?}")),
    };
    let mine = verdict.err().unwrap_or_else(|| "ok".to_string());
    ctx.store
        .set(&format!("{ns}/cma/ok/{me}"), mine.as_bytes())?;
    for g in 0..n {
        let reason = ctx.store.get(&format!("{ns}/cma/ok/{g}"), timeout)?;
        if reason != b"ok" {
            static LOGGED: std::sync::Once = std::sync::Once::new();
            LOGGED.call_once(|| {
                tracing::debug!(
                    "single-copy shared memory unavailable, using the ring path: {}",
                    String::from_utf8_lossy(&reason)
                )
            });
            return Ok(false);
        }
    }
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::MemStore;
    use crate::wire::Header;

    fn opts(transport: TransportKind, job: &str) -> Options {
        Options {
            transport,
            job_id: job.to_string(),
            token: JobToken::new("communicator-test-token").unwrap(),
            timeout: Duration::from_secs(5),
            ..Options::default()
        }
    }

    #[test]
    fn a_foreign_connection_with_the_wrong_job_id_or_token_is_refused() {
        let store: Arc<dyn Store> = Arc::new(MemStore::new());
        let job = crate::testing::unique_job_id();
        let o = opts(TransportKind::Tcp, &job);
        let sums: Vec<f32> = std::thread::scope(|s| {
            let ranks: Vec<_> = (0..3)
                .map(|r| {
                    let (store, o) = (Arc::clone(&store), o.clone());
                    s.spawn(move || {
                        let c = Communicator::init(store, r, 3, "h", o).unwrap();
                        if r == 2 {
                            return 0.0;
                        }
                        if r == 1 {
                            // Give the intruder time to knock on rank 0 first.
                            std::thread::sleep(Duration::from_millis(1500));
                        }
                        let g = c.new_group(&[0, 1]).unwrap();
                        let mut v = [1.0f32; 3];
                        g.all_reduce(&mut v, crate::ReduceOp::Sum).unwrap();
                        v[0]
                    })
                })
                .collect();
            // The intruder reads rank 0's address of the new group from the store.
            let ns = format!("xtrain/{job}/{}", group_key(&[0, 1], 1));
            let addr = store
                .get(&format!("{ns}/addr/0"), Duration::from_secs(5))
                .unwrap();
            let addr = String::from_utf8(addr).unwrap();
            let deadline = Instant::now() + Duration::from_secs(2);
            let mut hello = Hello {
                job: "someone-else".into(),
                key: group_key(&[0, 1], 1),
                from: 1,
                to: 0,
            };
            let none = JobToken::none();
            let refused = tcp::connect(&addr, &hello, &none, deadline).unwrap_err();
            assert!(refused.contains("foreign job id"), "{refused}");
            hello.job = job.clone();
            hello.key = "another-group".into();
            let refused = tcp::connect(&addr, &hello, &none, deadline).unwrap_err();
            assert!(refused.contains("expected"), "{refused}");
            // The right job id, group and ranks (none of them secret), but not the token.
            hello.key = group_key(&[0, 1], 1);
            let stranger = JobToken::new("not-this-jobs-token").unwrap();
            let refused = tcp::connect(&addr, &hello, &stranger, deadline).unwrap_err();
            assert!(refused.contains("did not prove the job token"), "{refused}");
            ranks.into_iter().map(|h| h.join().unwrap()).collect()
        });
        // The real peer still got through.
        assert_eq!(sums[..2], [2.0, 2.0]);
    }

    #[test]
    fn malformed_header_bytes_are_an_error_not_a_panic() {
        for transport in [TransportKind::Shm, TransportKind::Tcp] {
            let hdr = Header {
                kind: crate::OpKind::P2p,
                dtype: crate::DType::F32,
                op: 0,
                seq: 0,
                tag: 0,
                count: 0,
                payload_len: 12,
            }
            .encode();
            let mut bad_magic = hdr;
            bad_magic[0] ^= 0xff;
            let mut bad_dtype = hdr;
            bad_dtype[4] = 99;
            let mut huge = hdr;
            huge[24..32].copy_from_slice(&u64::MAX.to_le_bytes());
            let mut odd_len = hdr;
            odd_len[24] = 13;
            for (what, bytes) in [
                ("magic", bad_magic),
                ("dtype", bad_dtype),
                ("limit", huge),
                ("whole number", odd_len),
            ] {
                let o = Options {
                    job_id: crate::testing::unique_job_id(),
                    ..opts(transport, "x")
                };
                let errs = crate::testing::run_threads_with(2, o, |c| {
                    if c.rank() == 1 {
                        c.world().with_engine(|e| e.inject_raw(0, bytes));
                        // Stay until rank 0 has read the bytes.
                        let _ = c.barrier();
                        return None;
                    }
                    let mut b = [0.0f32; 3];
                    Some(c.recv(&mut b, 1, 0).unwrap_err())
                });
                let e = errs.into_iter().flatten().next().unwrap();
                assert!(matches!(e, CommError::Malformed { rank: 1, .. }), "{e}");
                assert!(e.to_string().contains(what), "{what}: {e}");
            }
        }
    }
}
