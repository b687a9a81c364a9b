//! `xtrain bench`: one subcommand per benchmark, each in its own file.
use clap::Subcommand;

pub mod train;

#[derive(Subcommand, Debug)]
pub enum BenchCommand {
    /// Training throughput (tokens/s, MFU) of a preset.
    Train(train::BenchTrainArgs),
}

pub fn run_cmd(c: BenchCommand) -> anyhow::Result<()> {
    match c {
        BenchCommand::Train(a) => train::run_cmd(a),
    }
}
