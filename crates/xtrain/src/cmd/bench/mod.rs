//! `xtrain bench ...`: benchmarks that print tables with the figures quoted in
//! `docs/PERFORMANCE.md`. One module per benchmark.
pub mod comm;
pub mod kernels;
pub mod tp;
pub mod train;

/// `xtrain bench` options.
#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(subcommand)]
    pub what: What,
}

#[derive(clap::Subcommand, Debug)]
pub enum What {
    /// Collective bandwidth and latency in the style of nccl-tests.
    Comm(comm::Args),
    /// Training throughput (tokens/s, MFU) of a preset.
    Train(Box<train::BenchTrainArgs>),
    /// Tensor-parallel activation bytes with and without sequence parallelism.
    Tp(tp::Args),
    /// Attention forward + backward and the MLP product at a preset's shapes: GFLOP/s each.
    Kernels(Box<kernels::Args>),
}

pub fn run(args: Args) -> anyhow::Result<()> {
    match args.what {
        What::Comm(a) => comm::run(a),
        What::Train(a) => train::run_cmd(*a),
        What::Tp(a) => tp::run(a),
        What::Kernels(a) => kernels::run(*a),
    }
}
