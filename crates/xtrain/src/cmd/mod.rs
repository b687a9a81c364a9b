//! One module per `xtrain` subcommand.
pub mod bench;
pub mod convert;
pub mod generate;
pub mod launch;
pub mod plan;
pub mod schedule;
pub mod tokenize;
pub mod train;
