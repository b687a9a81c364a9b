//! The comm crate's integration tests, one binary (one link, one instantiation of the
//! generic code they share); each module is one subject. Tests that need a process of
//! their own (GPU tests, thread counting) stay separate files beside this folder.
mod collectives;
mod common;
mod compressed;
mod decoders;
mod failures;
mod locator;
mod store_churn;
