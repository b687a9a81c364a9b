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
    /// Benchmarks (collectives: `xtrain bench comm`).
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
    match cli.command {
        Command::Launch(args) => cmd::launch::run(args),
        Command::Bench(args) => cmd::bench::run(args),
    }
}
