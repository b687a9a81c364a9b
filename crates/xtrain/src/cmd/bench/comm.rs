//! `xtrain bench comm`: collective latency and bandwidth in the style of nccl-tests.
//!
//! `--nproc N` starts N worker processes itself (through the launcher machinery,
//! re-invoking this executable); without it the command is a worker of a job started by
//! `xtrain launch`, srun or mpirun. `--backend mpi` (a build with the `mpi` feature, under
//! `mpirun`) measures the MPI library's collectives beside the own ones: each size runs on
//! the own communicator, then on MPI's, and the table shows both. For each size (doubling from `--min` to `--max`) every
//! rank first runs the collective once on known data and counts wrong elements, then runs
//! warm-up and timed iterations, each timed one starting from a barrier. The time of an
//! iteration is that of the slowest rank; the table shows the median over iterations.
//!
//! Sizes follow nccl-tests: `size` is the bytes of the larger buffer (all-gather: the
//! gathered output, reduce-scatter: the input, all-to-all: each rank's input), `count` its
//! f32 elements. `algbw = size / time`; `busbw = algbw × factor` with nccl-tests' factors
//! (all-reduce 2(n−1)/n; all-gather, reduce-scatter, all-to-all (n−1)/n; broadcast 1),
//! which makes busbw comparable with the link bandwidth whatever n is.
//!
//! `--device cuda` keeps the buffers on each rank's GPU and measures what the executor's host
//! path does with them: download, the host collective, upload (the time includes both
//! copies); beside it the table shows the download and upload alone, measured in the same
//! run, so the collective's share of a staged step is plain.
use super::super::launch::{run_group, GroupSpec};
use anyhow::{bail, Context};
use comm::{AllReduceAlgo, CommBackend, Communicator, Options, ReduceOp, TransportKind};
use std::time::{Duration, Instant};
use tensor::buf::{Buf, Dev, HostBuf};

/// Collective to measure.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Op {
    #[value(name = "all_reduce")]
    AllReduce,
    #[value(name = "all_gather")]
    AllGather,
    #[value(name = "reduce_scatter")]
    ReduceScatter,
    #[value(name = "all_to_all")]
    AllToAll,
    #[value(name = "broadcast")]
    Broadcast,
}

impl Op {
    fn name(self) -> &'static str {
        match self {
            Op::AllReduce => "all_reduce",
            Op::AllGather => "all_gather",
            Op::ReduceScatter => "reduce_scatter",
            Op::AllToAll => "all_to_all",
            Op::Broadcast => "broadcast",
        }
    }

    /// nccl-tests' bus-bandwidth factor for `n` ranks (see the module doc).
    fn bus_factor(self, n: usize) -> f64 {
        let n = n as f64;
        match self {
            Op::AllReduce => 2.0 * (n - 1.0) / n,
            Op::AllGather | Op::ReduceScatter | Op::AllToAll => (n - 1.0) / n,
            Op::Broadcast => 1.0,
        }
    }

    fn reduces(self) -> bool {
        matches!(self, Op::AllReduce | Op::ReduceScatter)
    }
}

/// `xtrain bench comm` options.
#[derive(clap::Args, Debug, Clone)]
pub struct Args {
    /// Collective to measure.
    #[arg(long, value_enum, default_value = "all_reduce")]
    pub op: Op,
    /// Start this many worker processes on this host (else: be a worker of a launched job).
    #[arg(long)]
    pub nproc: Option<usize>,
    /// All-reduce algorithm: ring, tree, rhd (recursive halving-doubling), rd (recursive
    /// doubling) or auto
    /// (default: XTRAIN_ALLREDUCE_ALGO, else auto).
    #[arg(long, value_parser = parse_algo)]
    pub algo: Option<AllReduceAlgo>,
    /// Transport between ranks: shm, tcp or auto, i.e. shm on one host
    /// (default: XTRAIN_TRANSPORT, else auto).
    #[arg(long, value_parser = parse_transport)]
    pub transport: Option<TransportKind>,
    /// `own` (default), or `mpi`: the own collectives and the MPI library's side by side
    /// (run under mpirun, with a build that has the `mpi` feature).
    #[arg(long, value_parser = parse_backend, default_value = "own")]
    pub backend: CommBackend,
    /// Smallest size (bytes; K, M, G suffixes are binary).
    #[arg(long, default_value = "4K", value_parser = parse_size)]
    pub min: usize,
    /// Largest size.
    #[arg(long, default_value = "256M", value_parser = parse_size)]
    pub max: usize,
    /// Size multiplier between rows.
    #[arg(long, default_value_t = 2)]
    pub factor: usize,
    /// Timed iterations per size up to 16 MiB; fewer above (at least 3), so big sizes
    /// take about as long as 16 MiB.
    #[arg(long, default_value_t = 20)]
    pub iters: usize,
    /// Untimed iterations before the timed ones (capped like --iters).
    #[arg(long, default_value_t = 5)]
    pub warmup: usize,
    /// Where the buffers live: `cpu`, or `cuda[:N]` (each rank on its host's GPU `LOCAL_RANK
    /// mod count`): staged through host memory around the host collective, with the copies
    /// alone measured beside it.
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// Print one JSON document instead of the table.
    #[arg(long)]
    pub json: bool,
    /// Testing aid: this rank kills itself (SIGKILL) during the run.
    #[arg(long, hide = true)]
    pub kill_rank: Option<usize>,
    /// Testing aid: after this many timed iterations of the first size.
    #[arg(long, hide = true, default_value_t = 2)]
    pub kill_after: usize,
}

fn parse_algo(s: &str) -> Result<AllReduceAlgo, String> {
    match s {
        "rhd" => Ok(AllReduceAlgo::HalvingDoubling),
        other => other.parse(),
    }
}

fn parse_backend(s: &str) -> Result<CommBackend, String> {
    s.parse()
}

fn parse_transport(s: &str) -> Result<TransportKind, String> {
    s.parse()
}

fn algo_name(a: AllReduceAlgo) -> &'static str {
    match a {
        AllReduceAlgo::Auto => "auto",
        AllReduceAlgo::Ring => "ring",
        AllReduceAlgo::Tree => "tree",
        AllReduceAlgo::HalvingDoubling => "rhd",
        AllReduceAlgo::RecursiveDoubling => "rd",
    }
}

fn transport_name(t: TransportKind) -> &'static str {
    match t {
        TransportKind::Auto => "auto",
        TransportKind::Shm => "shm",
        TransportKind::Tcp => "tcp",
    }
}

/// "4K" → 4096, "256M", "1G", "1000" (binary multiples; optional trailing "B"/"iB").
pub fn parse_size(s: &str) -> Result<usize, String> {
    let t = s.trim().to_ascii_uppercase();
    let t = t
        .strip_suffix("IB")
        .or_else(|| t.strip_suffix('B'))
        .unwrap_or(&t);
    let (num, mult) = match t.chars().last() {
        Some('K') => (&t[..t.len() - 1], 1usize << 10),
        Some('M') => (&t[..t.len() - 1], 1 << 20),
        Some('G') => (&t[..t.len() - 1], 1 << 30),
        _ => (t, 1),
    };
    let n: usize = num
        .parse()
        .map_err(|_| format!("{s:?} is not a size like 4K, 256M or 1000"))?;
    n.checked_mul(mult)
        .ok_or_else(|| format!("{s:?} is too large"))
}

fn human(bytes: usize) -> String {
    match bytes {
        b if b >= 1 << 30 && b % (1 << 30) == 0 => format!("{}G", b >> 30),
        b if b >= 1 << 20 && b % (1 << 20) == 0 => format!("{}M", b >> 20),
        b if b >= 1 << 10 && b % (1 << 10) == 0 => format!("{}K", b >> 10),
        b => b.to_string(),
    }
}

impl Args {
    fn validate(&self) -> anyhow::Result<()> {
        if self.min == 0 || self.min > self.max {
            bail!("--min must be at least 1 byte and at most --max");
        }
        if self.factor < 2 {
            bail!("--factor must be at least 2");
        }
        if self.iters == 0 {
            bail!("--iters must be at least 1");
        }
        if self.nproc == Some(0) {
            bail!("--nproc must be at least 1");
        }
        if self.backend == CommBackend::Mpi && self.nproc.is_some() {
            bail!("--backend mpi runs under mpirun: `mpirun -np N xtrain bench comm --backend mpi` (without --nproc)");
        }
        Ok(())
    }

    /// The arguments a worker gets: these options without `--nproc`.
    fn worker_args(&self) -> Vec<String> {
        let mut a: Vec<String> = vec![
            "bench".into(),
            "comm".into(),
            format!("--op={}", self.op.name()),
            format!("--min={}", self.min),
            format!("--max={}", self.max),
            format!("--factor={}", self.factor),
            format!("--iters={}", self.iters),
            format!("--warmup={}", self.warmup),
        ];
        if let Some(algo) = self.algo {
            a.push(format!("--algo={}", algo_name(algo)));
        }
        if let Some(t) = self.transport {
            a.push(format!("--transport={}", transport_name(t)));
        }
        if self.json {
            a.push("--json".into());
        }
        if self.device != "cpu" {
            a.push(format!("--device={}", self.device));
        }
        if self.backend != CommBackend::Own {
            a.push(format!("--backend={}", self.backend.name()));
        }
        if let Some(r) = self.kill_rank {
            a.push(format!("--kill-rank={r}"));
            a.push(format!("--kill-after={}", self.kill_after));
        }
        a
    }

    /// Timed iterations for `bytes`: `--iters` up to 16 MiB, then scaled down (≥ 3).
    fn iters_for(&self, bytes: usize) -> usize {
        const FULL: usize = 16 << 20;
        if bytes <= FULL {
            self.iters
        } else {
            (self.iters * FULL / bytes).max(3).min(self.iters)
        }
    }
}

pub fn run(args: Args) -> anyhow::Result<()> {
    args.validate()?;
    match args.nproc {
        Some(n) => {
            let exe = std::env::current_exe().context("locating the xtrain executable")?;
            let mut command = vec![exe.into_os_string()];
            command.extend(args.worker_args().into_iter().map(Into::into));
            let spec = GroupSpec {
                nproc_per_node: n,
                nnodes: 1,
                node_rank: 0,
                master_addr: "127.0.0.1".into(),
                master_port: None,
                max_restarts: 0,
                grace: Duration::from_secs(2),
                job_id: None,
                command,
                extra_env: Vec::new(),
                prefix_stdout: false,
            };
            run_group(&spec)?;
            Ok(())
        }
        None => worker(&args),
    }
}

/// One row of results.
#[derive(serde::Serialize)]
struct Row {
    bytes: usize,
    count: usize,
    dtype: &'static str,
    redop: &'static str,
    iters: usize,
    time_us: f64,
    algbw_gbs: f64,
    busbw_gbs: f64,
    /// `--device cuda`: the download and upload alone, and their bandwidth (bytes moved both
    /// ways over the time).
    #[serde(skip_serializing_if = "Option::is_none")]
    copy_us: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    copy_gbs: Option<f64>,
    wrong: i64,
}

fn worker(args: &Args) -> anyhow::Result<()> {
    let mut options = Options::from_env()?;
    options.backend = CommBackend::Own;
    options.transport = args.transport.unwrap_or(options.transport);
    options.algo = args.algo.unwrap_or(options.algo);
    let (transport, algo) = (options.transport, options.algo);
    // MPI's world first: joining it is collective over all of mpirun's ranks.
    let mpi = match args.backend {
        CommBackend::Own => None,
        CommBackend::Mpi => {
            let o = Options {
                backend: CommBackend::Mpi,
                ..options.clone()
            };
            Some(
                comm::env::init_with(o)
                    .context("bench comm: joining MPI's world")?
                    .0,
            )
        }
    };
    let (own, env) = comm::env::init_with(options)
        .context("bench comm: joining the job (run with --nproc N, or under `xtrain launch`)")?;
    let dev = Dev::open_local(&args.device, env.local_rank)
        .with_context(|| format!("bench comm --device {}", args.device))?;
    let mut comms = vec![("own", &own)];
    comms.extend(mpi.as_ref().map(|m| ("mpi", m)));
    let (n, rank) = (own.size(), own.rank());
    let lead = rank == 0;
    if lead && !args.json {
        println!(
            "# xtrain bench comm: {} over {n} rank(s), transport {}, algo {}; f32; time = median \
             over iterations of the slowest rank",
            args.op.name(),
            transport_name(transport),
            algo_name(algo)
        );
        // Which shared-memory data path large ring collectives take (XTRAIN_SHM_SINGLE_COPY).
        match own.single_copy_min_bytes() {
            Some(min) => println!("# single-copy shared memory from {min} bytes"),
            None => println!("# single-copy shared memory off"),
        }
        if mpi.is_some() {
            println!(
                "# own collectives beside MPI's ({}), each size on both in turn",
                comm::env::mpi_library_version().unwrap_or_default()
            );
        }
        if dev.is_cuda() {
            println!(
                "# buffers on {} (rank 0's): downloaded, the host collective, uploaded (time); \
                 copy = the download and upload alone, copybw = bytes both ways / copy time",
                dev.name()
            );
        }
        print!(
            "#{:>11} {:>12} {:>6} {:>6} {:>6}",
            "size(B)", "count", "type", "redop", "iters"
        );
        for (name, _) in &comms {
            let prefix = if comms.len() > 1 { *name } else { "" };
            print!(
                " {:>12} {:>12} {:>12}",
                format!("{prefix}time(us)"),
                format!("{prefix}algbw(GB/s)"),
                format!("{prefix}busbw(GB/s)")
            );
        }
        if dev.is_cuda() {
            print!(" {:>12} {:>12}", "copy(us)", "copybw(GB/s)");
        }
        println!(" {:>7}", "#wrong");
    }
    let mut rows: Vec<Vec<Row>> = comms.iter().map(|_| Vec::new()).collect();
    let mut bytes = args.min;
    let mut first = true;
    while bytes <= args.max {
        // Whole elements, and for the sharded ops a multiple of n (equal shards).
        let unit = if matches!(args.op, Op::AllReduce | Op::Broadcast) {
            1
        } else {
            n
        };
        let count = (bytes / 4) / unit * unit;
        if count > 0 {
            for (k, (_, c)) in comms.iter().enumerate() {
                let row = match measure(c, args, &dev, count, first) {
                    Ok(row) => row,
                    Err(e) => {
                        if env.hosts_store() {
                            // Peers look up why a group was aborted in the store this rank
                            // hosts: keep it up a moment so their errors can name the cause.
                            std::thread::sleep(Duration::from_secs(1));
                        }
                        return Err(e);
                    }
                };
                rows[k].push(row);
            }
            first = false;
            if lead && !args.json {
                let r0 = rows[0].last().expect("just measured");
                print!(
                    "{:>12} {:>12} {:>6} {:>6} {:>6}",
                    r0.bytes, r0.count, r0.dtype, r0.redop, r0.iters
                );
                let mut wrong = 0;
                for r in rows.iter().map(|r| r.last().expect("just measured")) {
                    print!(
                        " {:>12.1} {:>12.3} {:>12.3}",
                        r.time_us, r.algbw_gbs, r.busbw_gbs
                    );
                    wrong += r.wrong;
                }
                if let (Some(us), Some(gbs)) = (r0.copy_us, r0.copy_gbs) {
                    print!(" {us:>12.1} {gbs:>12.3}");
                }
                println!(" {wrong:>7}");
            }
        }
        bytes = match bytes.checked_mul(args.factor) {
            Some(b) => b,
            None => break,
        };
    }
    let wrong: i64 = rows.iter().flatten().map(|r| r.wrong).sum();
    if lead && args.json {
        let mut doc = serde_json::json!({
            "op": args.op.name(),
            "nproc": n,
            "transport": transport_name(transport),
            "algo": algo_name(algo),
            "device": dev.name(),
            "dtype": "float",
            "rows": rows[0],
        });
        if let Some(mpi_rows) = rows.get(1) {
            doc["mpi_rows"] = serde_json::to_value(mpi_rows)?;
            doc["mpi_library"] = comm::env::mpi_library_version().unwrap_or_default().into();
        }
        println!("{}", serde_json::to_string_pretty(&doc)?);
    }
    if wrong > 0 {
        bail!("bench comm: {wrong} wrong element(s) in the correctness checks");
    }
    if lead && !args.json {
        println!(
            "# sizes {}..{}, all results correct",
            human(args.min),
            human(args.max)
        );
    }
    Ok(())
}

/// Exactly representable test values: sums over ≤ 2^10 ranks of these stay integers < 2^24.
fn reduce_value(rank: usize, i: usize) -> f32 {
    ((rank + 1) * (i % 13 + 1)) as f32
}
fn reduce_expected(n: usize, i: usize) -> f32 {
    ((n * (n + 1) / 2) * (i % 13 + 1)) as f32
}
/// A value naming its sender and position, for the ops that move data unchanged.
fn tag_value(rank: usize, i: usize) -> f32 {
    (rank * 1024 + i % 1021) as f32
}

/// The buffers of one op at one size: on the host, and with `--device cuda` their GPU copies
/// (`input`, `output`), which each run stages through the host ones (page-locked then:
/// `Dev::host_zeros`, as a staged collective of the engine would hold them).
struct Case {
    op: Op,
    algo: AllReduceAlgo,
    n: usize,
    rank: usize,
    input: HostBuf,
    output: HostBuf,
    dev: Option<(Buf, Buf)>,
}

impl Case {
    fn new(
        op: Op,
        algo: AllReduceAlgo,
        count: usize,
        (n, rank): (usize, usize),
        dev: &Dev,
    ) -> anyhow::Result<Self> {
        let (ilen, olen) = match op {
            Op::AllReduce | Op::Broadcast => (count, 0),
            Op::AllGather => (count / n, count),
            Op::ReduceScatter => (count, count / n),
            Op::AllToAll => (count, count),
        };
        let (input, output) = (dev.host_zeros(ilen)?, dev.host_zeros(olen)?);
        let dev = match dev {
            Dev::Cpu => None,
            d => Some((d.zeros(ilen)?, d.zeros(olen)?)),
        };
        Ok(Case {
            op,
            algo,
            n,
            rank,
            input,
            output,
            dev,
        })
    }

    /// Whether the result is written over the input (all-reduce, broadcast).
    fn in_place(&self) -> bool {
        matches!(self.op, Op::AllReduce | Op::Broadcast)
    }

    fn fill_check_data(&mut self) -> anyhow::Result<()> {
        let r = self.rank;
        for (i, x) in self.input.iter_mut().enumerate() {
            *x = match self.op {
                Op::AllReduce | Op::ReduceScatter => reduce_value(r, i),
                Op::Broadcast if r == 0 => tag_value(0, i),
                Op::Broadcast => -1.0,
                Op::AllGather | Op::AllToAll => tag_value(r, i),
            };
        }
        self.output.fill(-1.0);
        if let Some((input, output)) = &mut self.dev {
            input.m().copy_from_host(&self.input)?;
            output.m().copy_from_host(&self.output)?;
        }
        Ok(())
    }

    /// The collective; on a GPU the input downloaded first and the result uploaded after
    /// (finished before it returns).
    fn run(&mut self, comm: &Communicator) -> anyhow::Result<()> {
        self.download()?;
        match self.op {
            Op::AllReduce => comm.all_reduce_with(&mut self.input, ReduceOp::Sum, self.algo),
            Op::Broadcast => comm.broadcast(&mut self.input, 0),
            Op::AllGather => comm.all_gather(&self.input, &mut self.output),
            Op::ReduceScatter => comm.reduce_scatter(&self.input, &mut self.output, ReduceOp::Sum),
            Op::AllToAll => comm.all_to_all(&self.input, &mut self.output),
        }?;
        self.upload()
    }

    /// The input from the GPU (`--device cuda`).
    fn download(&mut self) -> anyhow::Result<()> {
        if let Some((input, _)) = &self.dev {
            input.r().read_into(&mut self.input)?;
        }
        Ok(())
    }

    /// The host buffer holding the result and its GPU copy (`--device cuda`).
    fn result(&mut self) -> Option<(&mut HostBuf, &mut Buf)> {
        let in_place = self.in_place();
        let (input, output) = self.dev.as_mut()?;
        Some(match in_place {
            true => (&mut self.input, input),
            false => (&mut self.output, output),
        })
    }

    /// The result onto the GPU, waiting until it is there.
    fn upload(&mut self) -> anyhow::Result<()> {
        if let Some((host, buf)) = self.result() {
            buf.m().copy_from_host(host)?;
            if let Buf::Cuda(d) = buf {
                d.gpu().synchronize()?; // the copy is queued: done once the stream is
            }
        }
        Ok(())
    }

    /// The download and the upload alone (`--device cuda`).
    fn copy(&mut self) -> anyhow::Result<()> {
        self.download()?;
        self.upload()
    }

    /// The GPU's result into the host buffers (what the check reads).
    fn fetch(&mut self) -> anyhow::Result<()> {
        if let Some((host, buf)) = self.result() {
            host.fill(f32::NAN);
            buf.r().read_into(host)?;
        }
        Ok(())
    }

    /// Elements differing from the exact expected result.
    fn wrong(&self) -> usize {
        let (n, r) = (self.n, self.rank);
        let count = |got: &[f32], want: &dyn Fn(usize) -> f32| {
            got.iter()
                .enumerate()
                .filter(|&(i, &g)| g != want(i))
                .count()
        };
        match self.op {
            Op::AllReduce => count(&self.input, &|i| reduce_expected(n, i)),
            Op::Broadcast => count(&self.input, &|i| tag_value(0, i)),
            Op::AllGather => {
                let m = self.input.len();
                count(&self.output, &|i| tag_value(i / m, i % m))
            }
            Op::ReduceScatter => {
                let start = comm::shard_range(self.input.len(), n, r).start;
                count(&self.output, &|k| reduce_expected(n, start + k))
            }
            Op::AllToAll => {
                // Block s of my output is what rank s sent to me: its block `r`.
                let m = self.input.len() / n;
                count(&self.output, &|i| tag_value(i / m, r * m + i % m))
            }
        }
    }
}

fn measure(
    comm: &Communicator,
    args: &Args,
    dev: &Dev,
    count: usize,
    first: bool,
) -> anyhow::Result<Row> {
    let (n, rank) = (comm.size(), comm.rank());
    let mut case = Case::new(args.op, comm.options().algo, count, (n, rank), dev)?;
    case.fill_check_data()?;
    case.run(comm)?;
    case.fetch()?;
    let wrong = case.wrong() as i64;

    let iters = args.iters_for(count * 4);
    for _ in 0..args.warmup.min(iters) {
        case.run(comm)?;
    }
    let mut times = Vec::with_capacity(iters);
    for it in 0..iters {
        if first && it == args.kill_after && args.kill_rank == Some(rank) {
            // SAFETY: kill(2) on our own pid; SIGKILL ends the process at once, as a
            // crash or an OOM kill would, mid-job for the other ranks.
            unsafe {
                libc::kill(libc::getpid(), libc::SIGKILL);
            }
        }
        comm.barrier()?;
        let t0 = Instant::now();
        case.run(comm)?;
        times.push(t0.elapsed().as_nanos() as i64);
    }
    // The copies alone, as many times (every rank at once, as in the collective).
    let mut copy_times = Vec::with_capacity(iters);
    if case.dev.is_some() {
        for _ in 0..iters {
            comm.barrier()?;
            let t0 = Instant::now();
            case.copy()?;
            copy_times.push(t0.elapsed().as_nanos() as i64);
        }
    }
    // Per iteration, the slowest rank's time; and the total of wrong elements.
    let median_ns = slowest_median(comm, times)?;
    let copy_ns = match copy_times.is_empty() {
        true => None,
        false => Some(slowest_median(comm, copy_times)?),
    };
    let mut wrong_total = [wrong];
    comm.all_reduce(&mut wrong_total, ReduceOp::Sum)?;
    let bytes = count * 4;
    let moved = (case.input.len()
        + if case.in_place() {
            case.input.len()
        } else {
            case.output.len()
        })
        * 4;
    let algbw = bytes as f64 / median_ns; // bytes/ns = GB/s
    Ok(Row {
        bytes,
        count,
        dtype: "float",
        redop: if args.op.reduces() { "sum" } else { "none" },
        iters,
        time_us: median_ns / 1e3,
        algbw_gbs: algbw,
        busbw_gbs: algbw * args.op.bus_factor(n),
        copy_us: copy_ns.map(|t| t / 1e3),
        copy_gbs: copy_ns.map(|t| moved as f64 / t),
        wrong: wrong_total[0],
    })
}

/// The median over iterations of the slowest rank's time (ns): a collective over `comm`.
fn slowest_median(comm: &Communicator, mut times: Vec<i64>) -> anyhow::Result<f64> {
    comm.all_reduce(&mut times, ReduceOp::Max)?;
    times.sort_unstable();
    let k = times.len();
    Ok(if k % 2 == 1 {
        times[k / 2] as f64
    } else {
        (times[k / 2 - 1] + times[k / 2]) as f64 / 2.0
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse() {
        assert_eq!(parse_size("4K"), Ok(4096));
        assert_eq!(parse_size("256M"), Ok(256 << 20));
        assert_eq!(parse_size("1g"), Ok(1 << 30));
        assert_eq!(parse_size("64KiB"), Ok(64 << 10));
        assert_eq!(parse_size("1000"), Ok(1000));
        assert!(parse_size("4X").is_err());
        assert_eq!(human(256 << 20), "256M");
    }

    #[test]
    fn bus_factors_are_nccl_tests() {
        assert_eq!(Op::AllReduce.bus_factor(4), 1.5);
        assert_eq!(Op::AllGather.bus_factor(4), 0.75);
        assert_eq!(Op::AllToAll.bus_factor(2), 0.5);
        assert_eq!(Op::Broadcast.bus_factor(8), 1.0);
    }
}
