//! One module per `xtrain` subcommand.
