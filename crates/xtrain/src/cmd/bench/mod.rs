//! `xtrain bench ...`: benchmarks that print tables with the figures quoted in
//! `docs/PERFORMANCE.md`. One module per benchmark.
pub mod comm;

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
}

pub fn run(args: Args) -> anyhow::Result<()> {
    match args.what {
        What::Comm(a) => comm::run(a),
    }
}
