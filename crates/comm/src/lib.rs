//! `comm`: xtrain's communication layer, written from first principles.
//!
//! Layout (one module per concern):
//! - [`store`]: the rendezvous key-value store ranks use to find each other.
//!
//! `comm` knows nothing about tensors: collectives work on plain element slices.
pub mod store;
