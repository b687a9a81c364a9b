//! `comm`: xtrain's communication layer, written from first principles.
//!
//! Layout (one module per concern):
//! - [`store`]: the rendezvous key-value store ranks use to find each other.
//! - [`env`]: rank, world size and rendezvous address from the launcher's variables.
//!
//! `comm` knows nothing about tensors: collectives work on plain element slices.
pub mod env;
pub mod store;
