//! One module per `xtrain` subcommand.
pub mod bench;
pub mod convert;
pub mod generate;
pub mod tokenize;
pub mod train;
