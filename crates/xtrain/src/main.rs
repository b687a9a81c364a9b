//! `xtrain`: the command-line entry point. Each subcommand lives in its own module
//! under `cmd/`, so the parallelism or tool it drives is easy to find.
use clap::{Parser, Subcommand};

mod cmd;

#[derive(Parser)]
#[command(
    name = "xtrain",
    version,
    about = "Distributed LLM pre-training from first principles"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Start this host's worker processes with the launch variables and supervise them.
    Launch(cmd::launch::Args),
    /// Train a model on any layout (`--nproc`, `--dp`, `--zero`, `--tp`, `--sp`, `--pp`, `--cp`, `--ep`, …).
    Train(Box<cmd::train::TrainArgs>),
    /// Sample text from a checkpoint.
    Generate(cmd::generate::GenerateArgs),
    /// Tokenize a corpus (text, JSONL, Parquet) into a shard folder, or text into a token file
    /// (optionally training a BPE tokenizer first).
    Tokenize(cmd::tokenize::TokenizeArgs),
    /// Show a pipeline schedule: every rank's actions, the simulated timeline, bubble and
    /// memory (`--compare`: every schedule side by side; `--svg`, `--csv`).
    Schedule(cmd::schedule::ScheduleArgs),
    /// Predict memory and step time of every layout before launch, ranked by tokens/s
    /// (`--explain LAYOUT`, `--json`, `--svg`; `--validate` against measured runs here).
    Plan(Box<cmd::plan::PlanArgs>),
    /// Convert checkpoints to and from Hugging Face format.
    Convert(cmd::convert::ConvertArgs),
    /// Benchmarks (`xtrain bench comm`, `xtrain bench train`).
    Bench(cmd::bench::Args),
}

fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    // Before any thread starts. Tokenizing allocates many small strings on every thread, which
    // one arena would serialise (its memory is bounded by a batch either way).
    if !matches!(cli.command, Command::Tokenize(_)) {
        train::allocator::use_one_arena();
    }
    // A bad or unsupported XTRAIN_ISA is reported here, before any kernel runs.
    tensor::isa::selected()?;
    // XTRAIN_BACKEND=mpi's library (a build with the `mpi` feature; else nothing to register).
    comm_mpi::register();
    let result = match cli.command {
        Command::Launch(args) => cmd::launch::run(args),
        Command::Train(a) => cmd::train::run_cmd(*a),
        Command::Generate(a) => cmd::generate::run_cmd(a),
        Command::Tokenize(a) => cmd::tokenize::run_cmd(a),
        Command::Convert(a) => cmd::convert::run_cmd(a),
        Command::Plan(a) => cmd::plan::run_cmd(*a),
        Command::Schedule(a) => cmd::schedule::run_cmd(a),
        Command::Bench(args) => cmd::bench::run(args),
    };
    if result.is_ok() {
        // Every group is gone by now; MPI (if this run used it) ends here.
        comm::env::finalize();
    }
    result
}
