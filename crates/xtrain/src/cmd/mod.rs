//! One module per `xtrain` subcommand.
pub mod bench;
pub mod launch;
