//! `comm-mpi`: the MPI backend of `comm` ([`comm::external`]), in a crate of its own so that a
//! build with MPI (the `mpi` feature, which needs the system's MPI library) recompiles this
//! crate and the binary that calls [`register`], not `comm` and the crates above it.
#[cfg(feature = "mpi")]
mod mpi;

/// Makes `XTRAIN_BACKEND=mpi` run on the system's MPI library (a build with the `mpi`
/// feature; without it there is nothing to register, and `XTRAIN_BACKEND=mpi` fails with an
/// error saying the build lacks MPI and how to build it). Call once, before the communicator
/// is made.
pub fn register() {
    #[cfg(feature = "mpi")]
    comm::external::register(mpi::library());
}
