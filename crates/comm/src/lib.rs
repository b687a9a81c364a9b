//! `comm`: xtrain's communication layer, written from first principles.
//!
//! Layout (one module per concern):
//! - [`store`]: the rendezvous key-value store ranks use to find each other.
//! - [`auth`]: the job token, and the proof of it every store and link connection makes.
//! - [`env`]: rank, world size and rendezvous address from the launcher's variables;
//!   [`env::init_from_env`] builds the world communicator from them.
//! - [`communicator`]: initialisation from a store + rank identity; creating groups.
//! - [`group`]: [`ProcessGroup`] with point-to-point and collectives, sync and async ([`Work`]),
//!   run by a `backend`: the own engine or an [`external`] library (the system MPI, which the
//!   `comm-mpi` crate registers in a build with the `mpi` feature).
//! - [`mesh`]: [`DeviceMesh`], named dimensions from which every group is sliced.
//! - [`collectives`]: the algorithms (ring, tree, halving-doubling, ...); `arg_check`: the
//!   buffer checks every backend makes before an operation.
//! - `engine`, `transport` (shm, tcp, cma), `wire`: progress engine, transports, message headers;
//!   `single_copy`: ring steps that read a same-host peer's buffer directly.
//! - [`flight`], [`monitor`], [`diagnosis`]: every rank's record of its last operations, its
//!   heartbeat, and the hung-rank locator's message when a wait times out or a peer stops.
//! - [`compress`]: reductions with values on the wire in bf16 or fp8, summed in fp32.
//! - [`element`]: element types and reductions. [`testing`]: ranks as threads. `fuzzing`: each
//!   decoder of network bytes on a byte string, for the fuzz tests.
//!
//! `comm` knows nothing about tensors: collectives work on plain element slices.
mod arg_check;
pub mod auth;
mod backend;
pub mod collectives;
pub mod communicator;
pub mod compress;
mod deadline_io;
pub mod diagnosis;
pub mod element;
mod engine;
pub mod env;
pub mod error;
pub mod external;
pub mod flight;
#[doc(hidden)]
pub mod fuzzing;
pub mod group;
pub mod mesh;
pub mod monitor;
mod single_copy;
pub mod store;
pub mod testing;
pub mod transport;
mod wire;

pub use collectives::{shard_range, AllReduceAlgo};
pub use communicator::{CommBackend, Communicator, Options};
pub use element::{DType, Element, ReduceOp};
pub use error::{CommError, Result};
pub use group::{CommStats, ProcessGroup, Work};
pub use half::{bf16, f16};
pub use mesh::{DeviceMesh, MeshShape};
pub use store::{MemStore, Store, StoreError};
pub use transport::TransportKind;
pub use wire::OpKind;
