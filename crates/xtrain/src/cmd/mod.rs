//! One module per `xtrain` subcommand.
pub mod launch;
